"""The FP8 native all-reduce with the comm kernels' grids capped, so that NCCL's kernels find free multiprocessors.

    torchrun --nproc-per-node 2 benchmarks/bench_comm_caps.py     # NCCL; NCCL_NVLS_ENABLE=0 on the lent machines

1B bf16 gradient elements in 64 tensors (bench_comm.py's), the default 4 and 8 slices, with the amaxes on the data
communicator, on a second one, or both of high priority; every grid capped at ``kernels.comm.MAX_PROGRAMS`` programs
(each loops over several rows) or not. Prints each variant's median time, its ratio to bf16 all_reduce in the same run,
and whether its result is byte-identical to the uncapped default's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_comm import _nccl_group, gradients, timed  # noqa: E402
from gpu_args import gpu_only_args  # noqa: E402
from lightning_fp8.kernels import comm  # noqa: E402

from lightning_fp8.distributed.allreduce import all_reduce_fp8_native  # noqa: E402

CAPS = (None, 66, 99, 132, 198, 264, 528)  # programs in all (132 multiprocessors on an H200)


def main() -> None:
    gpu_only_args(__doc__)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    grads, layout = gradients(10**9, 64, device)
    x16 = grads.clone()
    settings = (
        ("", None, None),
        ("amax comm", None, _nccl_group()),
        ("hp amax comm", _nccl_group(True), _nccl_group(True)),
    )
    e5m2 = torch.float8_e5m2
    ref = all_reduce_fp8_native(grads, layout, None, e5m2, slices=4, fused=True)[0].clone()
    rows = [("all_reduce bf16", timed(lambda: dist.all_reduce(x16, op=dist.ReduceOp.AVG), 10, 3, device), True)]
    for cap in CAPS:
        comm.MAX_PROGRAMS = cap
        for label, group, amax_group in settings:
            for slices in (4, 8):

                def fn(g=group, a=amax_group, s=slices):
                    return all_reduce_fp8_native(grads, layout, g, e5m2, slices=s, fused=True, amax_group=a)[0]

                same = torch.equal(fn(), ref)
                rows.append((f"native {slices} sl, cap {cap} {label}".rstrip(), timed(fn, 10, 3, device), same))
    comm.MAX_PROGRAMS = None
    if rank == 0:
        for name, ms, same in rows:
            print(f"{name:<40} {ms:8.3f} ms  {rows[0][1] / ms:5.2f}x  {'same bytes' if same else 'DIFFERENT'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
