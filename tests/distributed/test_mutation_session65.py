"""FP8GradScaler.clip_grad_norm_ refusing FSDP1's parameters on 2 gloo processes, from a mutation audit of today's
fixes (grad_scaling/unscaling.py ``_refuse_fsdp1_shards``).

Each rank holds a shard of FSDP1's flat gradients, so a norm taken of them is its shard's and every rank would clip
by another factor. tests/distributed/test_routes_fsdp1.py passes ``model.parameters()`` of a model with
``use_orig_params=False`` only, which left these mutants alive:

- ``any(getattr(p, "_fsdp_flattened", False) ...)`` -> ``all(...)``: FSDP1's parameters listed beside a parameter
  FSDP1 does not manage (a head outside the wrapped model) were taken, each rank clipping by its own shard's norm.
- ``getattr(p, "_fsdp_flattened", False)`` -> ``getattr(p, "_is_flat_param", False)`` (FSDP1's mark on its flat
  parameters only): with ``use_orig_params=True`` ``model.parameters()`` are the original parameters (views into
  each rank's shard), which were taken.

A NaN in one rank's shard, clipped through the FSDP1 root: every rank's norm is NaN, no gradient is multiplied (FSDP1's
own clip_grad_norm_, which measured it, made them NaN on every rank).

Each refusal part checks that the norm each rank would have clipped by (its own shard's and the head's) differs
between the ranks, then that the call is refused naming the FSDP1 root's route, its gradients as they were. One spawn
runs every part.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tests.distributed.launch import part_results, run_parts, run_workers

pytestmark = pytest.mark.slow


def _setup(orig: bool):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from lightning_fp8 import FP8GradScaler

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), device_id=torch.device("cpu"),
                     use_orig_params=orig)  # fmt: skip
    head = nn.Linear(8, 2)  # not FSDP1's: replicated on every rank
    scaler = FP8GradScaler(init_scale=2.0**4)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    scaler.scale_loss(head(model(x)).square().sum()).backward()
    return model, head, scaler


def _refusal(scaler, params: list[torch.Tensor]) -> dict:
    grads = [p.grad for p in params if p.grad is not None]
    before = [g.clone() for g in grads]
    try:
        scaler.clip_grad_norm_(params, 1e-3)
        error = None
    except ValueError as caught:
        error = str(caught)
    # the norm each rank would have clipped by: its own shard's (FSDP1's gradients) and the head's
    local = torch.stack([g.float().norm() for g in before]).norm().item() / scaler.loss_scale
    untouched = all(torch.equal(g, b) for g, b in zip(grads, before, strict=True))
    return {"error": error, "untouched": untouched, "local_norm": local}


def _mixed() -> dict:
    model, head, scaler = _setup(orig=False)
    return _refusal(scaler, [*head.parameters(), *model.parameters()])


def _orig_params() -> dict:
    model, _, scaler = _setup(orig=True)
    return _refusal(scaler, list(model.parameters()))


def _nan_on_one_rank(orig: bool) -> dict:
    """A NaN in rank 1's gradient shard only: clipped through the FSDP1 root (found by this audit: FSDP1's own
    clip_grad_norm_ multiplied every rank's gradients by inf / NaN)."""
    model, _, scaler = _setup(orig)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if torch.distributed.get_rank() == 1:
        grads[0].view(-1)[0] = float("nan")
    before = [g.clone() for g in grads]
    norm = scaler.clip_grad_norm_(model, 1e-3).item()
    untouched = all(torch.equal(g.nan_to_num(), b.nan_to_num()) for g, b in zip(grads, before, strict=True))
    return {"norm_is_nan": norm != norm, "untouched": untouched}


def _worker(rank: int, world: int) -> dict:
    return run_parts({
        "mixed": _mixed, "orig_params": _orig_params,
        "nan_flat": lambda: _nan_on_one_rank(False), "nan_orig": lambda: _nan_on_one_rank(True),
    })  # fmt: skip


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_workers(_worker, 2)


@pytest.mark.parametrize("part", ["mixed", "orig_params"])
def test_fsdp1_parameters_in_a_multi_process_run_are_refused_whatever_else_is_listed(runs, part):
    reports = part_results(runs, part)
    assert reports[0]["local_norm"] != pytest.approx(reports[1]["local_norm"], rel=1e-3)  # each rank its own norm
    for report in reports:
        assert "scaler.clip_grad_norm_(model, max_norm)" in (report["error"] or ""), report
        assert report["untouched"]


@pytest.mark.parametrize("part", ["nan_flat", "nan_orig"])
def test_a_nan_on_one_rank_gives_every_rank_a_nan_norm_and_leaves_the_gradients_as_they_are(runs, part):
    """The ranks agree that the norm is NaN (the step every rank skips) and no rank's gradients are multiplied: rank
    0's stay finite, as the other routes leave them since today's clipping fix."""
    for report in part_results(runs, part):
        assert report == {"norm_is_nan": True, "untouched": True}
