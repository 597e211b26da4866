"""Edges of the collectives and the amax sync: chunks that are not a multiple of 16 elements, fp16 gradients near the
format's maximum in the DDP hook, amax histories that differ in more than their newest entry.

Two spawns: the all-gather on 2 gloo processes, the rest on 3; each check is a part of its worker (``run_parts``), so
one failure hides none of the others.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations as objects.
from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed.launch import part_results, run_parts, run_workers

pytestmark = pytest.mark.slow

DTYPES = {"e5m2": torch.float8_e5m2, "e4m3": torch.float8_e4m3fn}
# 20 elements per rank: not a multiple of kernels.comm_table.ALIGN (16), which the portable all-reduce rounds its
# chunks up to. Two tensors, the first ending inside rank 0's chunk: rank 0 sends two pieces, rank 1 one.
GATHER_CHUNK, GATHER_TENSORS = 20, (13, 27)
# fp16 gradients whose sum over 3 ranks overflows fp16 (max 65504) while their mean does not.
FP16_GRAD, FP16_WORLD = 30000.0, 3
# The hook and torch's default hook both divide by 3 and sum in fp16, but gloo sums the hook's 5 values and DDP's
# 10-value bucket in different orders: up to three fp16 roundings (2**-11 relative each) apart, one step (2**-10) seen.
SUM_ORDER_RTOL = 3 * 2.0**-11


# ------------------------------------------------------------------------------------------------ all_gather_fp8
def _cast_ref(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``x`` through FP8 with the power-of-two scale of its own amax, ``2**floor(log2(fp8_max / amax))``, written out
    here rather than taken from the library."""
    scale = 2.0 ** (torch.finfo(fp8_dtype).max / x.abs().amax().double()).log2().floor()
    return (x.double() * scale).to(fp8_dtype).double() / scale


def _all_gather(fp8_dtype: torch.dtype, fused: bool) -> dict:
    from lightning_fp8.distributed import SegmentLayout, all_gather_fp8

    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.randn(world * GATHER_CHUNK, generator=torch.Generator().manual_seed(7))
    full[GATHER_TENSORS[0] :] *= 1e3  # a scale per piece: the second tensor is 1000 times larger
    chunk = full[rank * GATHER_CHUNK : (rank + 1) * GATHER_CHUNK].clone()
    layout = SegmentLayout.per_tensor(GATHER_TENSORS)
    out, n_sat = all_gather_fp8(chunk, layout, None, fp8_dtype, torch.float32, fused=fused)
    # Each rank casts each piece of its chunk (a tensor cut at the chunk's bounds) with the piece's own amax.
    bounds = sorted({0, GATHER_TENSORS[0], *range(0, full.numel() + 1, GATHER_CHUNK)})
    ref = torch.cat([_cast_ref(full[a:b], fp8_dtype) for a, b in zip(bounds[:-1], bounds[1:], strict=False)])
    return {"out": out, "ref": ref, "full": full, "n_sat": int(n_sat)}


# ------------------------------------------------------------------------------------------------------ amax sync
def _fp8_model() -> nn.Module:
    from lightning_fp8 import convert_to_fp8

    torch.manual_seed(0)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)))


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every delayed scaling state's scale and amax history, as one vector per state."""
    from lightning_fp8.scaling import ScalingState

    return {
        name: torch.cat([s.scale.reshape(1), s.amax_history]).clone()
        for name, s in model.named_modules()
        if isinstance(s, ScalingState) and s.delayed
    }


def _snapshot_training_forwards(model: nn.Module) -> list[dict[str, torch.Tensor]]:
    """Snapshots taken at each training forward, after the root's pre-hooks (the sync, whenever it was enabled) and
    before the first cast: a pre-hook of the first layer."""
    seen: list[dict[str, torch.Tensor]] = []
    model[0].register_forward_pre_hook(lambda _m, _a: seen.append(_snapshot(model)) if model.training else None)
    return seen


def _batch(rank: int, step: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step + rank)) * scale


def _amax_two_forwards() -> list[dict[str, torch.Tensor]]:
    """Two forwards before one backward: each grad_output state casts twice in that backward; the sync of the next
    forward (enable_fp8_amax_sync's hook) must leave whole histories and scales identical."""
    from lightning_fp8.distributed.amax_sync import enable_fp8_amax_sync

    rank = dist.get_rank()
    model = _fp8_model()
    enable_fp8_amax_sync(model)
    seen = _snapshot_training_forwards(model)
    for step in range(3):
        y1, y2 = model(_batch(rank, step)), model(_batch(rank, step, 4.0))
        (y1.sum() + y2.sum() * (8.0 if rank == 0 else 1.0)).backward()
    return seen[2:]  # from step 1 on: after a backward


def _ddp_amax_from_every_rank() -> dict[str, torch.Tensor]:
    """DDP with its default broadcast_buffers=True broadcast rank 0's scaling buffers before every forward: the last
    rank's larger inputs never reached the synced history (its casts used rank 0's scale and saturated)."""
    from lightning_fp8.distributed.amax_sync import enable_fp8_amax_sync

    rank = dist.get_rank()
    model = _fp8_model()
    ddp = DDP(model)
    enable_fp8_amax_sync(model)
    seen = _snapshot_training_forwards(model)
    for step in range(3):
        ddp(_batch(rank, step, 100.0 if rank == dist.get_world_size() - 1 else 1.0)).sum().backward()
    return seen[-1]  # at the third forward: the first two steps' amaxes, synced


def _amax_skipped_layer() -> list[dict[str, torch.Tensor]]:
    """A layer skipped on one rank in one step (a data-dependent branch), then sync_fp8_amax after each step."""
    from lightning_fp8.distributed.amax_sync import sync_fp8_amax

    rank = dist.get_rank()
    model = _fp8_model()
    seen = []
    for step in range(3):
        h = model[0](_batch(rank, step, 2.0 ** (4 - 2 * step)))
        if not (rank == 1 and step == 1):
            h = model[1](h)
        h.sum().backward()
        sync_fp8_amax(model)
        seen.append(_snapshot(model))
    return seen[1:]  # from the step where a layer was skipped on


def _amax_rank0_evaluation() -> list[dict[str, torch.Tensor]]:
    """Evaluation on rank 0 alone, with the sync's hook removed for it (the workaround enable_fp8_amax_sync's docstring
    gives): the next training forward's sync must make the histories identical again."""
    from lightning_fp8.distributed.amax_sync import enable_fp8_amax_sync

    rank = dist.get_rank()
    model = _fp8_model()
    handle = enable_fp8_amax_sync(model)
    seen = _snapshot_training_forwards(model)
    for step in range(3):
        model(_batch(rank, step)).sum().backward()
        if rank == 0:
            handle.remove()
            model.eval()
            with torch.no_grad():
                model(_batch(rank, step, 100.0))
            model.train()
            handle = enable_fp8_amax_sync(model)
    return seen[1:]  # the training forwards after an evaluation


def _amax_deepcopied_model() -> dict:
    """A deep copy of a model whose amax sync is on (an EMA or teacher copy, torch's AveragedModel): the copied hook
    must sync the copy's states, not the original's (a closure hook was shared by the copy)."""
    import copy

    from lightning_fp8.distributed import amax_sync
    from lightning_fp8.distributed.amax_sync import enable_fp8_amax_sync
    from lightning_fp8.scaling import ScalingState

    rank = dist.get_rank()
    model = _fp8_model()
    enable_fp8_amax_sync(model)
    model(_batch(rank, 0, 2.0**rank)).sum().backward()  # recorded, not synced yet (the next forward's hook would)
    twin = copy.deepcopy(model)
    before = _snapshot(model)
    seen = _snapshot_training_forwards(twin)
    for step in range(3):
        twin(_batch(rank, step, 4.0**rank)).sum().backward()
    # The copy's sync marks the copy's states as agreed across ranks (the token tensor-parallel gathers consume:
    # claim_shared_scale); marking the original's instead costs each copied layer a collective of its own there.
    twin_states = [m for m in twin.modules() if isinstance(m, ScalingState) and m.delayed]
    marked = [amax_sync._synced.get(s, "unmarked") for s in twin_states]
    return {"copy": seen[1:], "original_before": before, "original_after": _snapshot(model), "copy_marked": marked}


def _amax_rank_without_tokens() -> list[tuple[list[float], float, list[float], float]]:
    """Rank 0 casts data once, then only empty batches' zeros (an MoE expert without tokens there); the others cast
    100 then 1s, and at step 2 every rank casts zeros. After each sync: (history, scale) on this rank and those of one
    process casting the others' data."""
    from lightning_fp8.distributed.amax_sync import AmaxSync
    from lightning_fp8.scaling import ScalingState

    seen = []
    for algo in ("max", "most_recent"):
        module = nn.Module()
        module.state = ScalingState(torch.float8_e4m3fn, 2, 0, algo, True)
        single = ScalingState(torch.float8_e4m3fn, 2, 0, algo, True)
        sync = AmaxSync(module)
        for step, value in enumerate([100.0, 1.0, 0.0, 1.0, 1.0]):
            x = torch.full((4, 4), value)
            module.state.quantize(x if dist.get_rank() > 0 or step == 0 else torch.zeros(4, 4))
            single.quantize(x)
            sync.sync()
            seen.append((module.state.amax_history.tolist(), module.state.scale.item(),
                         single.amax_history.tolist(), single.scale.item()))  # fmt: skip
    return seen


# --------------------------------------------------------------------------------------------- DDP, fp16 gradients
class _HalfModel(nn.Module):
    """A weight that goes through FP8 and a bias that does not, both fp16; their gradients are ``c``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(5, dtype=torch.float16))
        self.bias = nn.Parameter(torch.ones(5, dtype=torch.float16))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.weight * c).sum() + (self.bias * c).sum()


def _ddp_fp16_grads() -> dict:
    from lightning_fp8.distributed import FP8CommState, fp8_allreduce_hook

    rank = dist.get_rank()
    noise = torch.randn(5, generator=torch.Generator().manual_seed(rank))
    c = (FP16_GRAD * (1 + 0.01 * noise)).half()  # near 30000 on every rank: the sum over 3 ranks overflows fp16
    grads = {}
    for hook in ("torch", "fp8"):
        model = _HalfModel()
        ddp = DDP(model)
        state = FP8CommState(fp8_params=[model.weight])
        if hook == "fp8":
            ddp.register_comm_hook(state, fp8_allreduce_hook)
        ddp(c).backward()
        grads[hook] = {"bias": model.bias.grad.clone(), "weight": model.weight.grad.clone()}
        grads[hook]["check_step"] = state.check_step() if hook == "fp8" else None
    return grads


# ------------------------------------------------------------------------------------------------------- spawns
def _gather_worker(rank: int, world: int) -> dict:
    # A spawn of its own: a rank that fails inside the all-gather leaves the others waiting in the collective, which
    # would take the other checks down with it.
    return run_parts({f"{d}:{f}": partial(_all_gather, DTYPES[d], f) for d in DTYPES for f in (False, True)})


def _three_rank_worker(rank: int, world: int) -> dict:
    parts: dict[str, Callable[[], object]] = {
        "amax_two_forwards": _amax_two_forwards,
        "amax_skipped_layer": _amax_skipped_layer,
        "amax_rank0_evaluation": _amax_rank0_evaluation,
        "amax_rank_without_tokens": _amax_rank_without_tokens,
        "amax_deepcopied_model": _amax_deepcopied_model,
        "ddp_amax_from_every_rank": _ddp_amax_from_every_rank,
        "ddp_fp16": _ddp_fp16_grads,
    }
    return run_parts(parts)


@pytest.fixture(scope="module")
def gathered() -> list[dict]:
    return run_workers(_gather_worker, 2, timeout=60)


@pytest.fixture(scope="module")
def three_ranks() -> list[dict]:
    return run_workers(_three_rank_worker, FP16_WORLD, timeout=120)


# -------------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("fused", [False, True], ids=["reference", "triton"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_all_gather_fp8_chunks_not_a_multiple_of_16(gathered, dtype, fused):
    """Every rank decodes exactly the independently cast chunks, each piece within one FP8 rounding of the input."""
    reports = part_results(gathered, f"{dtype}:{fused}")
    eps = 2.0 ** -(4 if dtype == "e4m3" else 3)  # one rounding: half a step of 3 (E4M3) or 2 (E5M2) mantissa bits
    for report in reports:
        out, ref, full = report["out"], report["ref"], report["full"]
        assert out.shape == full.shape
        assert torch.equal(out.double(), ref), (out - ref).abs().max()
        assert bool(((out.double() - full.double()).abs() <= eps * full.double().abs()).all())
        assert report["n_sat"] == 0
    assert torch.equal(reports[0]["out"], reports[1]["out"])


@pytest.mark.parametrize("part", ["amax_two_forwards", "amax_skipped_layer", "amax_rank0_evaluation"])
def test_amax_sync_leaves_identical_histories_and_scales(three_ranks, part):
    """The ranks' histories differ beyond their newest entry before the sync; after it, scale and history alike."""
    reports = part_results(three_ranks, part)
    for rank, report in enumerate(reports[1:], 1):
        assert len(report) == len(reports[0]) >= 2
        for first, other in zip(reports[0], report, strict=True):
            assert first.keys() == other.keys() and len(first) == 4  # input and grad_output of two layers
            for name in first:
                assert torch.equal(first[name], other[name]), (rank, name, first[name], other[name])
    for first in reports[0]:  # histories with older entries to compare
        assert any(int((h[1:] > 0).sum()) >= 2 for h in first.values())


def test_amax_sync_of_a_deep_copy_syncs_the_copy(three_ranks):
    """The copy's histories and scales agree across ranks at each training forward after the first; the original's
    unsynced ones (each rank's own step) are left as they were."""
    reports = part_results(three_ranks, "amax_deepcopied_model")
    for rank, report in enumerate(reports):
        for name, value in report["original_before"].items():
            assert torch.equal(value, report["original_after"][name]), (rank, name)
        assert len(report["copy"]) == 2
        assert report["copy_marked"] == [None] * 4, report["copy_marked"]  # synced over the whole world
        for first, other in zip(reports[0]["copy"], report["copy"], strict=True):
            assert first.keys() == other.keys() and len(first) == 4
            for name in first:
                assert torch.equal(first[name], other[name]), (rank, name, first[name], other[name])
    differ = [
        n for n, v in reports[0]["original_before"].items() if not torch.equal(v, reports[1]["original_before"][n])
    ]
    assert differ  # each rank's own step: what a wrong sync would have changed


def test_amax_sync_with_a_rank_whose_casts_carry_no_information_matches_one_process(three_ranks):
    """A cast whose amax is 0 keeps its scale, and its window still rolls: after the sync every rank holds the history
    and scale of one process casting the data (a window that had stopped on rank 0 held 100 there for good; where no
    rank's last cast carried information, the sync keeps the scale as that cast did)."""
    for report in part_results(three_ranks, "amax_rank_without_tokens"):
        for history, scale, single_history, single_scale in report:
            assert (history, scale) == (single_history, single_scale)
        assert report[-1][:2] == ([1.0, 1.0], 256.0)


def test_ddp_default_buffer_broadcast_keeps_every_ranks_amax(three_ranks):
    """Under DDP(model) (broadcast_buffers=True) with amax sync, layer 0's input history holds the largest input of
    any rank at each step (the reference: the batches' amaxes recomputed here), on every rank."""

    def largest(step: int) -> float:
        return max(float(_batch(r, step, 100.0 if r == FP16_WORLD - 1 else 1.0).abs().max()) for r in range(FP16_WORLD))

    for report in part_results(three_ranks, "ddp_amax_from_every_rank"):
        history = report["0.fp8_scaling.input"][1:]  # after the scale
        assert sorted(history[history > 0].tolist()) == sorted([largest(0), largest(1)]), history


def test_ddp_hook_fp16_gradients_match_torch_default_hook(three_ranks):
    """The gradients outside FP8 are averaged as torch's default hook does (divided before the sum): finite, where
    their fp16 sum over 3 ranks would overflow."""
    for grads in part_results(three_ranks, "ddp_fp16"):
        torch_bias, fp8 = grads["torch"]["bias"], grads["fp8"]
        assert torch.isfinite(torch_bias).all()  # the reference itself is the finite mean
        torch.testing.assert_close(fp8["bias"], torch_bias, rtol=SUM_ORDER_RTOL, atol=0)
        assert fp8["check_step"] is True  # no false non-finite step
        assert torch.isfinite(fp8["weight"]).all()  # the FP8 part (an fp32 sum) never overflowed
