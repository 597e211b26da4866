"""Parameter groups put into FP8AdamW without ``add_param_group`` (``optimizer.param_groups = groups``, as Lightning's
BaseFinetuning restores the groups of an interrupted fit before the optimizer state is loaded): their FP8 weights get
O2 states and their storage becomes the fp16 master, as through ``add_param_group``. They stepped with fp32 states (16
bytes per parameter, silently) and a checkpoint's O2 states loaded into those, so the resumed run left the
uninterrupted one's path."""

import copy

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, convert_to_fp8, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.optim import master


def _model() -> nn.Module:
    torch.manual_seed(0)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int, keep_loss: bool = False) -> float:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 16, generator=gen)
    loss = (model(x) - y).square().mean()
    loss.backward()
    value = loss.item()
    if not keep_loss:  # (its graph holds the weights' gradient accumulators)
        del loss
    opt.step()
    opt.zero_grad()
    model.zero_grad()  # the weights outside the optimizer's groups too
    return value


def _groups(model: nn.Module) -> tuple[list[dict], list[nn.Parameter]]:
    head, body = list(model[2].parameters()), list(model[0].parameters())
    return [{"params": head}], body


def _uninterrupted(steps: int) -> tuple[nn.Module, list[float], dict]:
    """The head trains from the start, the body joins through add_param_group after two steps."""
    model = _model()
    groups, body = _groups(model)
    opt = FP8AdamW(groups, lr=1e-2)
    losses = [_step(model, opt, s) for s in range(2)]
    opt.add_param_group({"params": body, "lr": 5e-3})
    losses.append(_step(model, opt, 2))
    saved = tuple(copy.deepcopy(sd) for sd in (model.state_dict(), opt.state_dict(), fp8_state_dict(model)))
    losses += [_step(model, opt, s) for s in range(3, steps)]
    return model, losses, saved


def test_groups_assigned_then_loaded_resume_bit_identically_with_o2_states():
    model, losses, (model_sd, opt_sd, fp8_sd) = _uninterrupted(6)
    resumed = _model()
    groups, body = _groups(resumed)
    opt = FP8AdamW(groups, lr=1e-2)
    # BaseFinetuning's restore: the saved group layout, put in place directly.
    opt.param_groups = [{**opt.param_groups[0]}, {**opt.param_groups[0], "params": body, "lr": 5e-3}]
    resumed.load_state_dict(model_sd)
    load_fp8_state_dict(resumed, fp8_sd)
    opt.load_state_dict(opt_sd)
    weight = resumed[0].weight
    assert weight.dtype == torch.float16 and master.master_scale(weight) is not None  # its storage is the master
    assert opt.state[weight]["exp_avg"].dtype == torch.float8_e4m3fn
    assert [_step(resumed, opt, s) for s in range(3, 6)] == losses[3:]
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_groups_assigned_then_stepped_adopt_as_add_param_group_does():
    # Taken in at the step: as add_param_group called between the backward and the step (the weight's gradient, in
    # fp32 from that backward, is applied by its first step).
    def run(assign: bool) -> tuple[nn.Module, list[float]]:
        model = _model()
        groups, body = _groups(model)
        opt = FP8AdamW(groups, lr=1e-2)
        losses = [_step(model, opt, s) for s in range(2)]
        before_step = opt.step

        def step(closure=None):
            if assign:
                opt.param_groups = [*opt.param_groups, {**opt.param_groups[0], "params": body, "lr": 5e-3}]
            else:
                opt.add_param_group({"params": body, "lr": 5e-3})
            opt.step = before_step
            return before_step(closure)

        opt.step = step
        losses += [_step(model, opt, s) for s in range(2, 5)]
        assert model[0].weight.dtype == torch.float16 and opt.state[model[0].weight]["step"] == 3
        return model, losses

    (ref, ref_losses), (model, losses) = run(assign=False), run(assign=True)
    assert losses == ref_losses
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_groups_assigned_while_a_loss_holds_the_graph_keep_the_masters_apart_with_o2_states():
    # Taking the storage would leave the held gradient accumulator behind: the master is kept apart (as a frozen
    # weight's), the moments are O2's all the same, and the weight trains.
    model = _model()
    groups, body = _groups(model)
    opt = FP8AdamW(groups, lr=1e-2)
    opt.param_groups = [*opt.param_groups, {**opt.param_groups[0], "params": body, "lr": 5e-3}]
    before = model[0].weight.detach().clone()
    losses = [_step(model, opt, s, keep_loss=True) for s in range(4)]
    weight = model[0].weight
    assert weight.dtype == torch.float32 and master.master_scale(weight) is None
    state = opt.state[weight]
    assert state["master"].dtype == torch.float16 and state["exp_avg"].dtype == torch.float8_e4m3fn
    assert not torch.equal(weight, before) and losses[-1] < losses[0]
    # The master is the weight, to fp16's rounding at its scale.
    torch.testing.assert_close(state["master"].float() / state["master_scale"], weight.detach(), rtol=0, atol=0)


def test_a_parameter_an_assigned_group_cannot_hold_is_refused_at_the_step():
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    extra = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt.param_groups = [*opt.param_groups, {**opt.param_groups[0], "params": [extra]}]
    with pytest.raises(TypeError, match="float64 parameter"):
        _step(model, opt, 0)


def test_a_copy_made_before_the_assigned_groups_are_taken_in_takes_them_in():
    model = _model()
    groups, body = _groups(model)
    opt = FP8AdamW(groups, lr=1e-2)
    opt.param_groups = [*opt.param_groups, {**opt.param_groups[0], "params": body, "lr": 5e-3}]
    model_copy, opt_copy = copy.deepcopy((model, opt))
    _step(model_copy, opt_copy, 0)
    weight = model_copy[0].weight
    assert weight.dtype == torch.float16 and opt_copy.state[weight]["exp_avg"].dtype == torch.float8_e4m3fn


def test_a_refused_load_into_assigned_groups_changes_no_weight():
    model = _model()
    groups, body = _groups(model)
    opt = FP8AdamW(groups, lr=1e-2)
    saved = copy.deepcopy(opt.state_dict())  # one group: the assigned layout below has two
    opt.param_groups = [*opt.param_groups, {**opt.param_groups[0], "params": body, "lr": 5e-3}]
    with pytest.raises(ValueError):
        opt.load_state_dict(saved)
    assert model[0].weight.dtype == torch.float32 and master.master_scale(model[0].weight) is None


def test_an_assigned_group_without_the_default_keys_gets_them():
    model = _model()
    groups, body = _groups(model)
    opt = FP8AdamW(groups, lr=1e-2, betas=(0.8, 0.9), weight_decay=0.0)
    opt.param_groups.append({"params": body, "lr": 5e-3})
    _step(model, opt, 0)
    group = opt.param_groups[-1]
    assert group["betas"] == (0.8, 0.9) and group["weight_decay"] == 0.0 and group["lr"] == 5e-3
    assert model[0].weight.dtype == torch.float16
