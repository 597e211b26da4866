"""The public FP8 collectives refuse integer, complex and FP8 buffers and outputs before any collective runs.

An integer buffer used to pass the size checks, run the amax all-reduce and the all-to-all, and fail in the decode
(``torch.finfo() requires a floating point input type``): by then the ranks had exchanged data, and a rank that
failed alone would leave the others waiting. Every collective of ``torch.distributed`` is spied on here (the
collectives look them up there at call time); a valid call shows the spy sees them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests.distributed.launch import run_workers

pytestmark = pytest.mark.slow

WORLD = 2
TENSORS = (6, 10)  # one layout of 16 elements: 8 per rank
COLLECTIVES = (
    "all_reduce", "all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter", "broadcast", "barrier",
)  # fmt: skip


def _calls(rank: int, world: int) -> dict[str, tuple[str, list[str]]]:
    """``{case: (the exception's type and message, or "ok"; the collectives it called)}``."""
    from lightning_fp8.distributed import (
        FP8CommState,
        SegmentLayout,
        all_gather_fp8,
        all_reduce_fp8,
        all_reduce_fp8_gather,
        all_reduce_fp8_native,
        reduce_scatter_fp8,
    )
    from lightning_fp8.distributed.amax_sync import enable_fp8_amax_sync
    from lightning_fp8.distributed.tensor_parallel import apply_fp8_tensor_parallel

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    layout = SegmentLayout.per_tensor(TENSORS)
    x = torch.randn(sum(TENSORS), generator=torch.Generator().manual_seed(rank))
    ints = torch.arange(sum(TENSORS)) * (rank + 1)
    chunk = x[: x.numel() // world]
    only_rank0 = dist.new_group([0])  # every rank calls it; rank 1 gets torch's NON_GROUP_MEMBER marker
    cases = {
        "FP8CommState(group of rank 0)": lambda: FP8CommState(only_rank0),
        "FP8CommState(amax_group of rank 0)": lambda: FP8CommState(amax_group=only_rank0),
        "enable_fp8_amax_sync(group of rank 0)": lambda: enable_fp8_amax_sync(nn.Linear(2, 2), only_rank0),
        "apply_fp8_tensor_parallel(amax_sync_group of rank 0)": lambda: apply_fp8_tensor_parallel(
            nn.Sequential(), init_device_mesh("cpu", (world,)), plan={"fc": "colwise"}, amax_sync_group=only_rank0
        ),
        "all_reduce_fp8(valid)": lambda: all_reduce_fp8(x, layout, None, e5m2),
        "all_reduce_fp8(int x)": lambda: all_reduce_fp8(ints, layout, None, e5m2),
        "all_reduce_fp8(fp8 x)": lambda: all_reduce_fp8(x.to(e4m3), layout, None, e5m2),
        "all_reduce_fp8(complex x)": lambda: all_reduce_fp8(x.to(torch.complex64), layout, None, e5m2),
        "all_reduce_fp8(int out)": lambda: all_reduce_fp8(x, layout, None, e5m2, out=ints.int()),
        "all_reduce_fp8_gather(int x)": lambda: all_reduce_fp8_gather(ints, layout, None, e5m2),
        "all_reduce_fp8_native(int x)": lambda: all_reduce_fp8_native(ints, layout, None, e5m2),
        "all_gather_fp8(int out_dtype)": lambda: all_gather_fp8(chunk, layout, None, e4m3, torch.int32),
        "all_gather_fp8(int chunk)": lambda: all_gather_fp8(ints[: chunk.numel()], layout, None, e4m3, torch.float32),
        "reduce_scatter_fp8(int out)": lambda: reduce_scatter_fp8(
            x, layout, None, e5m2, out=torch.empty(chunk.numel(), dtype=torch.int32)
        ),
        "reduce_scatter_fp8(int x)": lambda: reduce_scatter_fp8(ints, layout, None, e5m2),
        # Found by a sweep: accepted (slices <= 0 ran unsliced; divisor -2 or NaN flipped or poisoned every value), or
        # failing with AttributeError / ZeroDivisionError that named no argument.
        "all_reduce_fp8(slices=0)": lambda: all_reduce_fp8(x, layout, None, e5m2, slices=0),
        "all_reduce_fp8_gather(slices=-1)": lambda: all_reduce_fp8_gather(x, layout, None, e5m2, slices=-1),
        "all_reduce_fp8_native(slices=2.0)": lambda: all_reduce_fp8_native(x, layout, None, e5m2, slices=2.0),
        "all_reduce_fp8(layout=list)": lambda: all_reduce_fp8(x, list(TENSORS), None, e5m2),
        "all_reduce_fp8(group=str)": lambda: all_reduce_fp8(x, layout, "world", e5m2),
        "all_gather_fp8(layout=list)": lambda: all_gather_fp8(chunk, list(TENSORS), None, e4m3, torch.float32),
        "reduce_scatter_fp8(divisor=0)": lambda: reduce_scatter_fp8(x, layout, None, e5m2, divisor=0),
        "reduce_scatter_fp8(divisor=-2)": lambda: reduce_scatter_fp8(x, layout, None, e5m2, divisor=-2.0),
        "reduce_scatter_fp8(divisor=nan)": lambda: reduce_scatter_fp8(x, layout, None, e5m2, divisor=float("nan")),
        # Found by a sweep: a margin out of range or not an int failed in the first cast, after the amax all-reduce
        # (a rank that passed it alone left the others waiting), with an error that named compute_scale.
        "all_reduce_fp8(margin=-1)": lambda: all_reduce_fp8(x, layout, None, e5m2, margin=-1),
        "all_reduce_fp8_gather(margin=40)": lambda: all_reduce_fp8_gather(x, layout, None, e5m2, margin=40),
        "all_reduce_fp8_native(margin=1.5)": lambda: all_reduce_fp8_native(x, layout, None, e5m2, margin=1.5),
        "reduce_scatter_fp8(margin=True)": lambda: reduce_scatter_fp8(x, layout, None, e5m2, margin=True),
        "all_gather_fp8(margin=17)": lambda: all_gather_fp8(chunk, layout, None, e4m3, torch.float32, margin=17),
    }
    called: list[str] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def spy(name, fn):
        def call(*args, **kwargs):
            called.append(name)
            return fn(*args, **kwargs)

        return call

    results = {}
    try:
        for name, fn in originals.items():
            setattr(dist, name, spy(name, fn))
        for case, fn in cases.items():
            called.clear()
            try:
                fn()
                outcome = "ok"
            except Exception as e:
                outcome = f"{type(e).__name__}: {e}"
            results[case] = (outcome, list(called))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return results


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_workers(_calls, WORLD, timeout=180)


def test_a_valid_call_is_seen_by_the_spy(two_ranks):
    for rank, results in enumerate(two_ranks):
        outcome, called = results["all_reduce_fp8(valid)"]
        assert outcome == "ok" and "all_reduce" in called and "all_to_all_single" in called, (rank, outcome, called)


@pytest.mark.parametrize(
    "case",
    [
        "all_reduce_fp8(int x)", "all_reduce_fp8(fp8 x)", "all_reduce_fp8(complex x)", "all_reduce_fp8(int out)",
        "all_reduce_fp8_gather(int x)", "all_reduce_fp8_native(int x)", "all_gather_fp8(int out_dtype)",
        "all_gather_fp8(int chunk)", "reduce_scatter_fp8(int out)", "reduce_scatter_fp8(int x)",
    ],
)  # fmt: skip
def test_non_float_buffers_are_refused_before_any_collective(two_ranks, case):
    for rank, results in enumerate(two_ranks):
        outcome, called = results[case]
        assert called == [], f"rank {rank}: {case} ran {called} before failing with {outcome}"
        assert outcome.startswith("TypeError:") and "high-precision floating-point" in outcome, (rank, outcome)


def test_an_amax_sync_group_without_this_rank_is_named_as_such(two_ranks):
    """Found by a sweep: as FP8CommState did before, the amax sync said it "got a int" there."""
    for case in ("enable_fp8_amax_sync(group of rank 0)", "apply_fp8_tensor_parallel(amax_sync_group of rank 0)"):
        outcome, called = two_ranks[1][case]
        assert outcome.startswith("ValueError:") and "rank (1) is not a member" in outcome, outcome
        assert called == []
    assert two_ranks[0]["enable_fp8_amax_sync(group of rank 0)"][0] == "ok"


def test_a_group_without_this_rank_is_named_as_such(two_ranks):
    """Found by a sweep: on a rank that new_group() left out, FP8CommState said it "got a int" and to pass a group
    from torch.distributed.new_group, which the user had done."""
    assert two_ranks[0]["FP8CommState(group of rank 0)"][0] == "ok"
    for case in ("FP8CommState(group of rank 0)", "FP8CommState(amax_group of rank 0)"):
        outcome, called = two_ranks[1][case]
        assert outcome.startswith("ValueError:") and "rank (1) is not a member" in outcome, outcome
        assert called == []


BAD_ARGUMENTS = {
    "all_reduce_fp8(slices=0)": ("ValueError", "all_reduce_fp8(slices=0): must be >= 1"),
    "all_reduce_fp8_gather(slices=-1)": ("ValueError", "all_reduce_fp8_gather(slices=-1): must be >= 1"),
    "all_reduce_fp8_native(slices=2.0)": ("TypeError", "all_reduce_fp8_native(slices=2.0): must be an int"),
    "all_reduce_fp8(layout=list)": ("TypeError", "all_reduce_fp8(layout=...) got a list: pass a SegmentLayout"),
    "all_reduce_fp8(group=str)": ("TypeError", "all_reduce_fp8(group=...) got a str: pass a process group"),
    "all_gather_fp8(layout=list)": ("TypeError", "all_gather_fp8(layout=...) got a list: pass a SegmentLayout"),
    "reduce_scatter_fp8(divisor=0)": ("ValueError", "reduce_scatter_fp8(divisor=0): must be finite and > 0"),
    "reduce_scatter_fp8(divisor=-2)": ("ValueError", "reduce_scatter_fp8(divisor=-2.0): must be finite and > 0"),
    "reduce_scatter_fp8(divisor=nan)": ("ValueError", "reduce_scatter_fp8(divisor=nan): must be finite and > 0"),
    "all_reduce_fp8(margin=-1)": ("ValueError", "all_reduce_fp8(margin=-1): must be in [0, 16]"),
    "all_reduce_fp8_gather(margin=40)": ("ValueError", "all_reduce_fp8_gather(margin=40): must be in [0, 16]"),
    "all_reduce_fp8_native(margin=1.5)": ("TypeError", "all_reduce_fp8_native(margin=1.5): must be an int"),
    "reduce_scatter_fp8(margin=True)": ("TypeError", "reduce_scatter_fp8(margin=True): must be an int"),
    "all_gather_fp8(margin=17)": ("ValueError", "all_gather_fp8(margin=17): must be in [0, 16]"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments_are_named_before_any_collective(two_ranks, case):
    kind, message = BAD_ARGUMENTS[case]
    for rank, results in enumerate(two_ranks):
        outcome, called = results[case]
        assert called == [], f"rank {rank}: {case} ran {called} before failing with {outcome}"
        assert outcome.startswith(f"{kind}: {message}"), (rank, outcome)
