"""FP8ReduceScatter (FSDP2's custom reduce-scatter) honours the reduce op FSDP passes, on 2 gloo processes: SUM gives
the sum over ranks, AVG the mean (FSDP2 passes AVG where ``set_force_sum_reduction_for_comms`` is not set, e.g. a
torch without it, or a user who installs the comm by hand). enable_fp8_fsdp2 always forces SUM, so a mutation audit
of the distributed layer found the AVG division unpinned on each of the comm's three paths (every gradient in FP8,
some in their own dtype, none in FP8): an AVG that summed passed the suite. The comm is called here directly, with a
parameter group of two parameters, against the float64 sum and mean of the ranks' buffers.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.distributed import tolerances as tol
from tests.distributed.launch import run_workers
from tests.numerics import sqnr

pytestmark = pytest.mark.slow
COLUMNS = [40, 24]  # each parameter's padded shard
PATHS = ("fp8", "mixed", "high")


def _param_group():
    """What FP8ReduceScatter reads of FSDP2's parameter group: each parameter's sharded tensor and padded shard size."""
    params = [
        SimpleNamespace(sharded_param=torch.nn.Parameter(torch.zeros(n)), padded_sharded_param_size=torch.Size([n]))
        for n in COLUMNS
    ]
    return SimpleNamespace(fsdp_params=params)


def _fp8_params(group, path: str) -> list | None:
    """FP8CommState's fp8_params for each path: every gradient in FP8, the first only, none."""
    sharded = [p.sharded_param for p in group.fsdp_params]
    return {"fp8": None, "mixed": sharded[:1], "high": []}[path]


def _worker(rank: int, world: int) -> dict:
    from lightning_fp8.distributed import FP8CommState
    from lightning_fp8.distributed.fsdp2_comms import FP8ReduceScatter

    g = torch.Generator().manual_seed(rank)
    # FSDP2's reduce-scatter input: row r holds every parameter's r-th shard (here 100 and 1e-3 in magnitude).
    rows = torch.cat([torch.randn(world, COLUMNS[0], generator=g) * 100, torch.randn(world, COLUMNS[1], generator=g)
                      * 1e-3], dim=1)  # fmt: skip
    total = rows.double().clone()
    dist.all_reduce(total)
    want = total[rank]
    out = {}
    for path in PATHS:
        for name, op, expected in (("sum", dist.ReduceOp.SUM, want), ("avg", dist.ReduceOp.AVG, want / world)):
            group = _param_group()
            comm = FP8ReduceScatter(FP8CommState(fp8_params=_fp8_params(group, path)), group)
            got = torch.empty(sum(COLUMNS))
            comm(got, rows.reshape(-1).clone(), dist.group.WORLD, op)
            out[path, name] = [sqnr(a, b) for a, b in zip(got.split(COLUMNS), expected.split(COLUMNS), strict=True)]
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_workers(_worker, 2, timeout=120)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_fp8_reduce_scatter_gives_the_sum_or_the_mean_the_op_asks_for(two_ranks, path, op):
    for r in two_ranks:
        assert min(r[path, op]) >= tol.REDUCE_SCATTER_E5M2_SQNR_DB, (path, op, r[path, op])
