"""torch.distributed.checkpoint's state-dict API gives an optimizer without state one ``step()`` on zero gradients at
lr 0 (``_init_optim_state``), so that there are states to save or load into: the first thing the documented sharded
resume does (``get_state_dict(model, optimizer)`` as the template of ``dcp.load``), and what Lightning's and
Accelerate's sharded checkpointing call. An FP8AdamW with a ``grad_scaler`` handed that step to the scaler, which
refused it (no loss was scaled) and left every group's lr at 0 and the gradients zero. It is a plain step now, which
the scaler neither refuses nor counts. One process (DCP without a process group), unsharded: the step is the same.

Also here: the FP8GradScaler in a DCP checkpoint (its history, a list of dicts, was flattened into one key per entry,
which the fresh scaler's empty history could not take).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, FP8Recipe, convert_to_fp8

dcp = pytest.importorskip("torch.distributed.checkpoint")
state_dict_api = pytest.importorskip("torch.distributed.checkpoint.state_dict")

LR = 1e-2


def _build(recipe: str, **kwargs) -> tuple[nn.Module, FP8AdamW, FP8GradScaler]:
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)), FP8Recipe.from_name(recipe))
    scaler = FP8GradScaler(model=model, init_scale=2.0**4, growth_interval=2)
    return model, FP8AdamW(model.parameters(), lr=LR, grad_scaler=scaler, **kwargs), scaler


def _steps(model: nn.Module, opt: FP8AdamW, scaler: FP8GradScaler, first: int, n: int) -> list[float]:
    losses = []
    for step in range(first, first + n):
        gen = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 16, generator=gen)
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["fp8-lm", "fp8-lm-o1"])
def test_state_dict_template_of_a_fresh_optimizer_with_a_scaler(recipe):
    model, opt, scaler = _build(recipe)
    weights = copy.deepcopy(model.state_dict())
    _, optim_sd = state_dict_api.get_state_dict(model, opt)
    assert set(optim_sd["state"]) == {name for name, _ in model.named_parameters()}
    assert [group["lr"] for group in opt.param_groups] == [LR]
    assert all(p.grad is None for p in model.parameters())
    # The scaler took no part: no step counted, mu and its history as built.
    assert (scaler.get_scale(), scaler.skipped_steps, scaler.history) == (2.0**4, 0, ())
    for name, value in model.state_dict().items():  # lr 0, zero gradients: nothing moved
        assert torch.equal(value, weights[name]), name


def test_a_loss_scaled_before_does_not_make_the_init_step_count():
    """The scaler had scaled a loss (another optimizer of it stepped): the new optimizer's init step still leaves it
    alone (it would have counted as a step with headroom)."""
    model, opt, scaler = _build("fp8-lm")
    _steps(model, opt, scaler, 0, 1)
    other = convert_to_fp8(nn.Sequential(nn.Linear(32, 32)))
    new = FP8AdamW(other.parameters(), lr=LR, grad_scaler=scaler)
    before = (scaler.get_scale(), scaler.skipped_steps, scaler.history, scaler.growth_tracker)
    state_dict_api.get_state_dict(other, new)
    assert (scaler.get_scale(), scaler.skipped_steps, scaler.history, scaler.growth_tracker) == before
    assert [group["lr"] for group in new.param_groups] == [LR]


@pytest.mark.parametrize("fp8_grads", [False, True])
def test_a_genuine_first_step_at_lr_0_with_zero_gradients_goes_to_the_scaler(fp8_grads):
    """A training step is no state-making step whatever its values: the first step of a warm-up from lr 0 on a batch
    whose loss has zero gradients is the scaler's, as any other (a rank deciding from its own gradient shards would
    skip the scaler's collective while the others ran it). The same run without zero gradients is the reference for
    what the scaler counts."""
    trackers = []
    for zero in (True, False):
        model, opt, scaler = _build("fp8-lm-o1", fp8_grads=fp8_grads)
        opt.param_groups[0]["lr"] = 0.0
        out = model(torch.randn(4, 32))
        scaler.scale_loss(out.sum() * 0.0 if zero else out.pow(2).mean()).backward()
        opt.step()
        trackers.append((scaler.growth_tracker, len(scaler.history), scaler.get_scale()))
    assert trackers[0] == trackers[1] == (1, 0, 2.0**4)


def test_state_dict_between_backward_and_first_step_with_fp8_held_gradients_changes_nothing():
    """FP8-held gradients (fp8_grads) leave param.grad None, so torch's get_state_dict stepped an optimizer without
    state after a backward too: the held gradients went into the moments at lr 0, then its zero_grad dropped them,
    and the training step had nothing to step. As for an optimizer whose gradients torch sees: no step, the gradients
    kept, and the run goes on as one without the call, bit for bit."""
    runs = []
    for call in (True, False):
        torch.manual_seed(0)
        model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64, bias=False), nn.GELU(), nn.Linear(64, 16, bias=False)),
                               "fp8-lm-o1")  # fmt: skip
        scaler = FP8GradScaler(model=model, init_scale=2.0**4)
        opt = FP8AdamW(model.parameters(), lr=LR, grad_scaler=scaler, recipe="fp8-lm-o1")
        x = torch.randn(4, 32)
        scaler.scale_loss(model(x).pow(2).mean()).backward()
        if call:
            assert all(p.grad is None for p in model.parameters())  # held in FP8 by the optimizer: torch steps
            _, optim_sd = state_dict_api.get_state_dict(model, opt)
            assert optim_sd["state"] == {} and [g["lr"] for g in opt.param_groups] == [LR]
        opt.step()
        runs.append((copy.deepcopy(model.state_dict()), scaler.state_dict()))
    assert runs[0][1] == runs[1][1]
    for name, value in runs[0][0].items():
        assert torch.equal(value, runs[1][0][name]), name


@pytest.mark.parametrize("recipe", ["fp8-lm", "fp8-lm-o1"])
def test_sharded_checkpoint_resume_with_a_scaler_continues_the_run(recipe, tmp_path):
    """The documented resume: the fresh optimizer's state dict as the template, dcp.load, set_state_dict; the run
    continues bit for bit as the uninterrupted one."""
    model, opt, scaler = _build(recipe)
    _steps(model, opt, scaler, 0, 3)
    model_sd, optim_sd = state_dict_api.get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))
    scaler_sd = copy.deepcopy(scaler.state_dict())
    expected = _steps(model, opt, scaler, 3, 3)

    model, opt, scaler = _build(recipe)
    model_sd, optim_sd = state_dict_api.get_state_dict(model, opt)  # the template DCP loads into
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(tmp_path))
    state_dict_api.set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scaler.load_state_dict(scaler_sd)
    assert _steps(model, opt, scaler, 3, 3) == expected


def test_named_optimizer_init_state_with_a_scaler():
    """torch's _NamedOptimizer.init_state (keyed optimizers) makes the states with a zero-gradient step at the real lr,
    before any loss was scaled: a plain step too, the weights as torch's own AdamW leaves them (weight decay only)."""
    named_optim = pytest.importorskip("torch.distributed.optim")._NamedOptimizer
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)), "fp8-lm-o1")
    scaler = FP8GradScaler(model=model, init_scale=2.0**4)
    reference = copy.deepcopy(model)
    named = named_optim(dict(model.named_parameters()), FP8AdamW, lr=LR, grad_scaler=scaler, recipe="fp8-lm-o1")
    named.init_state()
    assert set(named.state_dict()["state"]) == {name for name, _ in model.named_parameters()}
    assert (scaler.get_scale(), scaler.skipped_steps, scaler.history) == (2.0**4, 0, ())
    torch_named = named_optim(dict(reference.named_parameters()), torch.optim.AdamW, lr=LR)
    torch_named.init_state()
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7, msg=name)


def test_zero_gradients_of_a_fresh_optimizer_after_a_scaled_loss_go_to_the_scaler():
    """A new optimizer's first step on all-zero gradients (after the scaler has scaled a loss for another) is a
    training step the scaler counts: only torch's own state-making calls are not."""
    model, opt, scaler = _build("fp8-lm")
    _steps(model, opt, scaler, 0, 1)
    other = convert_to_fp8(nn.Sequential(nn.Linear(32, 32)))
    new = FP8AdamW(other.parameters(), lr=LR, grad_scaler=scaler)
    for p in other.parameters():
        p.grad = torch.zeros_like(p)
    steps = len(scaler.history), scaler.growth_tracker
    new.step()
    assert (len(scaler.history), scaler.growth_tracker) != steps


@pytest.mark.parametrize("as_object", [True, False], ids=["stateful", "state_dict"])
def test_scaler_in_a_dcp_checkpoint_loads_into_a_fresh_scaler(as_object, tmp_path):
    """After mu has changed (a history to save), the documented DCP resume with the scaler in the checkpoint: as the
    object (DCP's Stateful protocol) or as its state dict. It raised "Missing key in checkpoint state_dict:
    scaler.history"."""
    model, opt, scaler = _build("fp8-lm")
    _steps(model, opt, scaler, 0, 3)
    assert scaler.history, "mu changed: the history to save"
    saved = scaler.state_dict()
    dcp.save({"scaler": scaler if as_object else scaler.state_dict()}, checkpoint_id=str(tmp_path))
    fresh = FP8GradScaler(init_scale=2.0**4, growth_interval=2)
    state = {"scaler": fresh if as_object else fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path))
    if not as_object:
        fresh.load_state_dict(state["scaler"])
    assert fresh.state_dict() == saved
    assert fresh.get_scale() == scaler.get_scale() != 2.0**4
