"""The native FP8-sum all-reduce (``all_reduce_fp8_native``) on 2 gloo processes, against its docstring computed here
with plain torch casts: each rank casts ``x * s * 2**-h`` (``s`` the power-of-two scale of the shared amax, ``h`` a
power of two near ``1/sqrt(N)``: 1 on two ranks), the FP8 values are summed and rounded once to FP8 (NCCL's float8
all-reduce, emulated as in test_comm.py), and the decode gives ``sum * 2**h / (N s)``; "FP8 sums that overflowed
(non-finite, or at the format maximum) are counted in ``n_saturated``".

A mutation audit of the distributed layer found the count of sums at the maximum unpinned by the collective tests: a
decode that counted only sums past the maximum (``>`` for ``>=``) passed all of them (only the Triton-against-reference
kernel test saw it; the four-rank case overflows past the maximum), and a result that left the sums' count out of
``n_saturated`` passed them on two ranks. Fully correlated gradients on two ranks reach the maximum exactly: each
rank's ``x * s`` is the maximum, halved by the pre-scale and doubled by the sum.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.distributed.launch import run_workers

E5M2 = torch.float8_e5m2
FMAX = 57344.0  # E5M2's largest finite value, 1.75 * 2**15
pytestmark = pytest.mark.slow


def _gradient() -> torch.Tensor:
    """The same on every rank (fully correlated): random values, some at the amax 14 = 1.75 * 2**3, whose scaled value
    is E5M2's maximum exactly (scale 2**12)."""
    x = torch.randn(300, generator=torch.Generator().manual_seed(5)) * 3.0
    x[[4, 77, 150, 299]] = torch.tensor([14.0, -14.0, 14.0, -14.0])
    return x


def _emulated_fp8_sum(q: torch.Tensor, group=None) -> None:
    """NCCL's float8 all-reduce: the fp32 sum of every rank's FP8 values, rounded once to FP8."""
    world = dist.get_world_size(group)
    gathered = torch.empty(world * q.numel(), dtype=torch.uint8)
    dist.all_gather_into_tensor(gathered, q.view(torch.uint8).reshape(-1), group=group)
    q.copy_(gathered.view(world, -1).view(q.dtype).float().sum(0).to(q.dtype).view(q.shape))


def _worker(rank: int, world: int) -> dict:
    from lightning_fp8.distributed import SegmentLayout, all_reduce_fp8_native

    x = _gradient()
    orig = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if tensor.dtype == E5M2:
            return _emulated_fp8_sum(tensor, group)
        return orig(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = all_reduce
    try:
        out, stats = all_reduce_fp8_native(x, SegmentLayout.per_tensor([x.numel()]), None, E5M2)
    finally:
        dist.all_reduce = orig
    return {"out": out, "n_saturated": int(stats.n_saturated), "found": bool(stats.found_nonfinite)}


def _expected(world: int) -> tuple[torch.Tensor, int]:
    """The docstring's result and saturation count, from torch's own FP8 conversions and float64 arithmetic."""
    x = _gradient().double()
    amax = x.abs().max().item()  # the same on every rank
    scale = 2.0 ** math.floor(math.log2(FMAX / amax))
    h = math.ceil(math.log2(world) / 2)
    q = (x * scale * 2.0**-h).float().to(E5M2).float()  # each rank's cast (no value reaches the maximum)
    total = (q * world).to(E5M2).double()  # the sum of world equal FP8 values, rounded once to FP8
    n_at_max = int((total.abs() >= FMAX).sum())
    return (total * 2.0**h / (world * scale)).float(), n_at_max


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_workers(_worker, 2, timeout=180)


def test_native_sum_reaching_the_maximum_is_counted_as_saturated(two_ranks):
    out, n_at_max = _expected(2)
    assert n_at_max == 4  # the four elements at the amax: the premise of the test
    for r in two_ranks:
        assert r["n_saturated"] == n_at_max
        assert not r["found"]  # at the maximum, not past it: nothing overflowed


def test_native_mean_is_the_fp8_sum_times_two_to_the_h_over_n_s(two_ranks):
    out, _ = _expected(2)
    for r in two_ranks:
        assert torch.equal(r["out"], out)
    x = _gradient()  # the mean of equal gradients is each of them, within one E5M2 rounding (2 mantissa bits)
    assert ((out - x).abs() <= x.abs() * 2.0**-3 + 2.0**-14).all()
