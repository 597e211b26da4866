"""The custom collectives that FSDP2 runs for :func:`~lightning_fp8.distributed.enable_fp8_fsdp2`.

:class:`FP8ReduceScatter` (``FSDPModule.set_custom_reduce_scatter``) reduce-scatters a module's gradients through FP8
and checks them for non-finite values into the :class:`~lightning_fp8.distributed.FP8CommState`;
:class:`FP8WeightAllGather` (``set_custom_all_gather``) gathers its FP8Linear weights as E4M3 bytes. FSDP2 calls them
with its flat buffers, and they find each parameter's place in them from FSDP2's parameter group. Apart from
:mod:`~lightning_fp8.distributed.fsdp2`, which checks a model and installs them (the numerics and the fallbacks are
described there).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from lightning_fp8 import ops
from lightning_fp8.distributed.comm import CastStats, all_reduce_max, cast_stats, local_amax, reduce_scatter_fp8
from lightning_fp8.distributed.comm_state import FP8CommState, check_state
from lightning_fp8.distributed.comm_state_checks import resolve_fused
from lightning_fp8.distributed.layout import SegmentLayout
from lightning_fp8.distributed.quantize import segment_kernels
from lightning_fp8.formats import E4M3
from lightning_fp8.kernels.comm_table import BlockTable, block_table
from lightning_fp8.recipe import check_flag
from lightning_fp8.warnings import warn_once

try:  # the Comm interfaces are importable from here in torch 2.8+ (not re-exported publicly)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - older torch: duck-typed
    AllGather = ReduceScatter = object  # type: ignore[misc,assignment]

_FALLBACK_BLOCK = 1 << 16


def _shard_numel(fsdp_param) -> int:
    return fsdp_param.padded_sharded_param_size.numel()


class FP8ReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter of gradients through FP8 (sum; FSDP divides by the world size).

    Gradients outside ``state.fp8_params`` are reduce-scattered in their own dtype; their non-finite check rides
    on the FP8 gradients' amax all-reduce (or, in a module without FP8 gradients, on a MAX all-reduce of one
    value), so every rank of the shard group agrees on the step.

    Args:
        state: the communication state (dtype, margin, grad scaler, ``fp8_params``, step flag).
        param_group: the FSDP parameter group whose gradients this comm reduces.
        replicate_group: HSDP only: the group FSDP all-reduces the reduced shards over afterwards, in their own
            dtype and outside this comm; the step's non-finite flag is MAX-reduced over it as well (one value),
            so that every rank of the mesh agrees.
        fp8: False: every gradient in its own dtype (``enable_fp8_fsdp2(reduce_scatter=False)``), still checked
            for non-finite values into ``state``.
    """

    def __init__(
        self, state: FP8CommState, param_group, replicate_group: dist.ProcessGroup | None = None, *, fp8: bool = True
    ) -> None:
        check_state(state, "FP8ReduceScatter")  # raised here, not inside FSDP2's backward
        check_flag("FP8ReduceScatter", "fp8", fp8)
        self.state = state
        self.param_group = param_group
        self.replicate_group = replicate_group
        self.fp8 = fp8

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        world = group.size()
        if op == dist.ReduceOp.AVG:
            divide = float(world)
        elif op == dist.ReduceOp.SUM:
            divide = 1.0
        else:
            raise NotImplementedError(
                f"FP8ReduceScatter got reduce op {op}; it implements SUM and AVG. Keep "
                "set_force_sum_reduction_for_comms(True) (enable_fp8_fsdp2 sets it) so FSDP divides itself"
            )
        chunk = output_tensor.numel()
        params = [p for p in self.param_group.fsdp_params if p.sharded_param.requires_grad]
        columns = [_shard_numel(p) for p in params]
        fp8 = [self.fp8 and self.state.is_fp8(p.sharded_param) for p in params]
        out = output_tensor.view(-1)
        if not any(fp8):  # e.g. the root unit of a transformer (embeddings, final norm, head), or fp8=False
            stats = _reduce_scatter_high_precision(out, input_tensor.view(-1), group, divide)
        elif sum(columns) != chunk:  # FSDP left out the gradients of parameters that got none: which, is not known
            if all(fp8):  # every gradient of the module travels in FP8 anyway
                self._warn_unplaced(chunk, f"sent through FP8 with one scale per block of {_FALLBACK_BLOCK} elements")
                layout = SegmentLayout.blocks(world * chunk, _FALLBACK_BLOCK)
                _, stats = self._fp8(input_tensor.view(-1), layout, group, out, divide)
            else:  # never quantize the gradients fp8_params leaves out ("reduced in their own dtype")
                self._warn_unplaced(chunk, "reduce-scattered in their own dtype, the FP8Linear weights' too")
                stats = _reduce_scatter_high_precision(out, input_tensor.view(-1), group, divide)
        elif all(fp8):
            _, stats = self._fp8(input_tensor.view(-1), SegmentLayout.rows(world, columns), group, out, divide)
        else:
            stats = self._mixed(out, input_tensor.view(world, chunk), columns, fp8, group, divide)
        self._record(stats)
        return None

    def _warn_unplaced(self, chunk: int, instead: str) -> None:
        from torch.distributed.fsdp import FSDPModule

        fqn = getattr(self.param_group, "_module_fqn", None)  # "" for the root module
        module = "" if fqn is None else f" ({fqn or 'the root module'})"
        # Not set by enable_fp8_fsdp2: FSDP then gives such parameters zero gradients instead of None, which an
        # optimizer does not skip (weight decay and momentum move them), unlike plain FSDP2.
        flag = hasattr(FSDPModule, "set_reduce_scatter_unused_params")
        fix = (
            "call model.set_reduce_scatter_unused_params(True) (such parameters then get zero gradients instead "
            "of None: weight decay and momentum still move them), or "
            if flag
            else ""
        )
        warn_once(
            f"FP8ReduceScatter{module}: some parameters of this FSDP module got no gradient in the backward (an "
            f"unused submodule?), and FSDP left them out of the reduce-scatter buffer ({chunk} elements per rank), so "
            f"the place of each gradient in it is not known: this module's gradients are {instead}, not each with "
            f"its own FP8 scale. To keep the FP8 reduce-scatter, {fix}call requires_grad_(False) on the parameters "
            "that take no part in training"
        )

    def _fp8(self, flat: torch.Tensor, layout: SegmentLayout, group, out, divide: float,
             other_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, CastStats]:  # fmt: skip
        state = self.state
        return reduce_scatter_fp8(
            flat, layout, group, state.fp8_dtype, margin=state.margin, fused=state.use_fused(flat.device),
            slices=state.slices(flat.numel()), out=out, divisor=divide, other_amax=other_amax,
        )  # fmt: skip

    def _mixed(self, out, rows, columns, fp8, group, divide) -> CastStats:
        # FP8 columns go through FP8; the others through one reduce-scatter in their own dtype, their local amax
        # riding on the FP8 columns' amax all-reduce.
        world = rows.shape[0]
        starts = [sum(columns[:i]) for i in range(len(columns))]
        blocks = [rows[:, s : s + n] for s, n in zip(starts, columns, strict=True)]
        fp8_blocks = [b for b, m in zip(blocks, fp8, strict=True) if m]
        other_blocks = [b for b, m in zip(blocks, fp8, strict=True) if not m]
        fp8_cols = [b.shape[1] for b in fp8_blocks]
        other_cols = [b.shape[1] for b in other_blocks]
        other_in = torch.cat(other_blocks, dim=1).reshape(-1)
        fp8_in = torch.cat(fp8_blocks, dim=1).reshape(-1)
        layout = SegmentLayout.rows(world, fp8_cols)
        fp8_out, stats = self._fp8(fp8_in, layout, group, None, divide, other_amax=local_amax(other_in))
        other_out = other_in.new_empty(sum(other_cols))
        _reduce_scatter(other_out, other_in, group)
        other_out.div_(divide)
        fp8_parts = iter(fp8_out.split(fp8_cols))
        other_parts = iter(other_out.split(other_cols))
        for s, n, m in zip(starts, columns, fp8, strict=True):
            out[s : s + n].copy_(next(fp8_parts) if m else next(other_parts))
        return stats

    def _record(self, stats: CastStats) -> None:
        if self.replicate_group is not None:
            found = stats.found_nonfinite.float()  # MAX all-reduce: any replica's flag
            all_reduce_max(found, self.replicate_group)
            stats = replace(stats, found_nonfinite=found > 0)
        self.state.record(stats)


def _reduce_scatter_high_precision(out: torch.Tensor, flat: torch.Tensor, group, divide: float) -> CastStats:
    # Each rank receives a different shard, so a local check of the result would not agree across ranks: the
    # flag travels in a MAX all-reduce of this rank's amax instead (one value, beside the data).
    amax = local_amax(flat)
    all_reduce_max(amax, group)
    _reduce_scatter(out, flat, group)
    out.div_(divide)
    return cast_stats(amax, torch.zeros((), dtype=torch.int64, device=flat.device), 0)


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None)
    if fn is not None:
        fn(output=output, input=input, group=group)
    else:
        dist.reduce_scatter_tensor(output, input, group=group)


class FP8WeightAllGather(AllGather):
    """FSDP2 all-gather that sends FP8Linear weights as E4M3 bytes with a whole-tensor scale beside them.

    Args:
        param_group: the FSDP parameter group this comm gathers.
        fp8_weights: ``{id(sharded weight): margin}`` of the FP8Linear weights (the margin of the layer's weight
            role, so the gathered weight's scale is the one the layer's own weight cast computes).
        fused: the Triton cast and decode kernels (``kernels/comm.py``) or their PyTorch references, with
            :class:`FP8CommState`'s meaning: ``None`` picks the kernels where they run, and does so on the device of
            each gather (a model sharded on the meta device gathers on the device it is materialized on later);
            ``True`` without Triton is refused here, on a device the kernels do not run on at the gather.
            ``enable_fp8_fsdp2`` passes its state's setting.
    """

    def __init__(self, param_group, fp8_weights: dict[int, int], fused: bool | None = None) -> None:
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"FP8WeightAllGather(fused={fused!r}): pass None, True or False")
        if fused and not ops.triton_available():  # raise now, not inside FSDP's all-gather
            resolve_fused(fused, torch.device("cpu"), "FP8WeightAllGather", "the weights")
        self.param_group = param_group
        self.fp8_weights = fp8_weights
        self.fused = fused
        self._plans: dict = {}

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        params = self.param_group.fsdp_params
        numels = [_shard_numel(p) for p in params]
        if input_tensor.dtype == torch.uint8 or sum(numels) != input_tensor.numel():
            warn_once(
                "FP8WeightAllGather: the all-gather buffer does not hold one padded shard per parameter in one "
                "floating-point dtype; gathering this module in its own dtype instead"
            )
            return _all_gather(output_tensor, input_tensor, group)
        margins = [self.fp8_weights.get(id(p.sharded_param)) for p in params]
        with torch.no_grad():
            self._gather(output_tensor, input_tensor, group, numels, margins)
        return None

    def _gather(self, output, shard, group, numels, margins) -> None:
        # Sent by each rank: every parameter's shard, E4M3 bytes for FP8 weights and its own bytes otherwise. The
        # scales come from the global amax (one MAX all-reduce of the shards' amaxes), so every rank already holds
        # the scale of every rank's bytes: one launch casts all FP8 weights, one decodes all of them.
        world = group.size()
        plan = self._plan(numels, margins, world, shard)
        kernels = segment_kernels(resolve_fused(self.fused, shard.device, "FP8WeightAllGather", "the weights"))
        amax = torch.zeros(plan.num_fp8, dtype=torch.float32, device=shard.device)
        kernels.segment_amax(shard, plan.amax, amax)
        all_reduce_max(amax, group)
        send = torch.empty(plan.send_bytes, dtype=torch.uint8, device=shard.device)
        n_sat = torch.zeros((), dtype=torch.int64, device=shard.device)  # weights: rounding only, nothing to report
        for margin, table in plan.quantize:
            kernels.quantize(shard, table, amax, E4M3, send, n_sat, margin=margin)
        for start, n, offset in plan.copies:
            send[offset : offset + n * shard.element_size()].copy_(shard[start : start + n].view(torch.uint8))
        gathered = torch.empty(world * plan.send_bytes, dtype=torch.uint8, device=shard.device)
        _all_gather(gathered, send, group)
        for margin, table in plan.decode:
            kernels.dequantize(gathered, table, amax, E4M3, output.view(-1), margin=margin)
        rows_in, rows_out = gathered.view(world, -1), output.view(world, -1)
        for start, n, offset in plan.copies:
            width = n * shard.element_size()
            rows_out[:, start : start + n].view(torch.uint8).copy_(rows_in[:, offset : offset + width])

    def _plan(self, numels, margins, world, shard) -> _GatherPlan:
        key = (tuple(numels), tuple(margins), world, shard.device, shard.dtype)
        if self._plans.get("key") != key:
            self._plans = {"key": key, "plan": _gather_plan(numels, margins, world, shard)}
        return self._plans["plan"]


@dataclass(frozen=True)
class _GatherPlan:
    num_fp8: int
    send_bytes: int
    amax: BlockTable  # each FP8 weight's shard -> its amax slot
    quantize: list[tuple[int, BlockTable]]  # per margin: shard -> send bytes
    decode: list[tuple[int, BlockTable]]  # per margin: every rank's bytes -> the unsharded output
    copies: list[tuple[int, int, int]]  # other parameters: (start in the shard, elements, byte offset in send)


def _gather_plan(numels, margins, world, shard) -> _GatherPlan:
    starts = [sum(numels[:i]) for i in range(len(numels))]
    total = sum(numels)
    offsets, offset, copies, fp8 = [], 0, [], []
    for i, (start, n) in enumerate(zip(starts, numels, strict=True)):
        offsets.append(offset)
        if margins[i] is None:
            copies.append((start, n, offset))
            offset += n * shard.element_size()
        else:
            fp8.append(i)
            offset += n
    slot = {i: k for k, i in enumerate(fp8)}
    dev = shard.device

    def table(entries):
        columns = list(zip(*entries, strict=True)) if entries else [(), (), (), ()]
        return block_table(*columns, device=dev)

    quantize, decode = [], []
    for margin in sorted({margins[i] for i in fp8}):
        mine = [i for i in fp8 if margins[i] == margin]
        quantize.append((margin, table([(starts[i], offsets[i], numels[i], slot[i]) for i in mine])))
        decode.append((margin, table([(r * offset + offsets[i], r * total + starts[i], numels[i], slot[i])
                                      for r in range(world) for i in mine])))  # fmt: skip
    amax = table([(starts[i], starts[i], numels[i], slot[i]) for i in fp8])
    return _GatherPlan(len(fp8), offset, amax, quantize, decode, copies)


def _all_gather(output: torch.Tensor, input: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input, group=group)
