"""FP8 gradient communication with shared power-of-two scales, and FP8 weight all-gather for FSDP.

- DDP: ``enable_fp8_ddp(ddp)`` registers :func:`fp8_allreduce_hook` (``ddp.register_comm_hook(state,
  fp8_allreduce_hook)`` without the check that the state's group is DDP's).
- FSDP1 (``FullyShardedDataParallel``): ``enable_fp8_fsdp1(model)`` registers :func:`fp8_reduce_scatter_hook`.
- FSDP2 (``fully_shard``): ``enable_fp8_fsdp2(model)`` installs :class:`FP8ReduceScatter` (gradients) and
  :class:`FP8WeightAllGather` (FP8Linear weights in E4M3), and marks the sharded FP8Linear weights for FP8AdamW
  (:func:`mark_fp8_weights` does only the marking, for a ``fully_shard`` model that keeps FSDP's own collectives).
- The collectives themselves: :mod:`lightning_fp8.distributed.comm` (shared scales, reduce-scatter, all-gather)
  and :mod:`lightning_fp8.distributed.allreduce` (portable, native and gather FP8 all-reduces).

See DESIGN.md "FP8 gradient communication" for the numerics.
"""

from lightning_fp8.distributed.allreduce import all_reduce_fp8, all_reduce_fp8_gather, all_reduce_fp8_native
from lightning_fp8.distributed.comm import CastStats, all_gather_fp8, reduce_scatter_fp8
from lightning_fp8.distributed.comm_state import FP8CommState
from lightning_fp8.distributed.ddp import enable_fp8_ddp, fp8_allreduce_hook
from lightning_fp8.distributed.fsdp import enable_fp8_fsdp1, fp8_reduce_scatter_hook
from lightning_fp8.distributed.fsdp2 import enable_fp8_fsdp2, mark_fp8_weights
from lightning_fp8.distributed.fsdp2_comms import FP8ReduceScatter, FP8WeightAllGather
from lightning_fp8.distributed.layout import SegmentLayout

__all__ = [
    "CastStats",
    "FP8CommState",
    "FP8ReduceScatter",
    "FP8WeightAllGather",
    "SegmentLayout",
    "all_gather_fp8",
    "all_reduce_fp8",
    "all_reduce_fp8_gather",
    "all_reduce_fp8_native",
    "enable_fp8_ddp",
    "enable_fp8_fsdp1",
    "enable_fp8_fsdp2",
    "fp8_allreduce_hook",
    "fp8_reduce_scatter_hook",
    "mark_fp8_weights",
    "reduce_scatter_fp8",
]
