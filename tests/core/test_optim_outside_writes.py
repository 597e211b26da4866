"""Writes to a parameter between steps, where FP8AdamW keeps the master apart from it (a bf16 parameter's fp32 master;
an FP8 weight's fp16 master when the weight was frozen as the optimizer was built, or after release_weights): the next
step starts from what was written, as torch.optim.AdamW's does, and putting the same values back changes nothing
(lightning_fp8/optim/apart.py). Also the parameters and state dicts FP8AdamW refuses or normalizes as torch's AdamW."""

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, convert_to_fp8

# An lr so small that one step moves no weight by a unit in the last place of its dtype: the weights after the step
# are those the step started from.
TINY_LR = 1e-12


def _bf16_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).bfloat16()


def _fp8_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, model[0].in_features, generator=gen).to(model[0].weight.dtype)
    opt.zero_grad()
    model(x).float().square().mean().backward()
    opt.step()


def _tiny_lr(opt: torch.optim.Optimizer) -> None:
    for group in opt.param_groups:
        group["lr"] = TINY_LR


@pytest.mark.parametrize("how", ["fill", "load_state_dict"])
def test_a_bf16_parameter_written_between_steps_steps_from_what_was_written(how):
    model = _bf16_model()
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    for seed in range(3):
        _step(model, opt, seed)
    with torch.no_grad():
        if how == "fill":
            model[0].weight.fill_(0.5)
            want = {k: v.clone() for k, v in model.state_dict().items()}
        else:
            model.load_state_dict(snapshot)
            want = snapshot
    _tiny_lr(opt)  # torch.optim.AdamW (no master) would leave the weights as written
    _step(model, opt, 3)
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key


def test_putting_the_same_values_back_keeps_the_masters_precision():
    """An EMA swap for evaluation writes other values and then the same ones back: bit for bit a run without it."""
    runs = []
    for swap in (False, True):
        model = _bf16_model()
        opt = FP8AdamW(model.parameters(), lr=1e-2)
        for seed in range(6):
            if swap and seed == 3:
                saved = [p.detach().clone() for p in model.parameters()]
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.5)
                    for p, s in zip(model.parameters(), saved, strict=True):
                        p.copy_(s)
            _step(model, opt, seed)
        runs.append((model, opt))
    (plain, plain_opt), (swapped, swapped_opt) = runs
    for a, b in zip(plain.parameters(), swapped.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(plain_opt.state[a]["master"], swapped_opt.state[b]["master"])


@pytest.mark.parametrize("how", ["frozen_when_built", "released"])
def test_an_fp8_weight_whose_master_is_apart_rolls_back_with_the_model(how):
    """O2: an FP8 weight frozen when the optimizer was built, unfrozen later, keeps its fp16 master apart; so do the
    weights after release_weights(). model.load_state_dict(snapshot) then a step: the weights stay at the snapshot
    to the master's fp16 rounding (torch.optim.AdamW: exactly). Before, the step went on from the master (0.03 off)."""
    model = _fp8_model()
    if how == "frozen_when_built":
        model[0].weight.requires_grad_(False)
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    model[0].weight.requires_grad_(True)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    for seed in range(3):
        _step(model, opt, seed)
    if how == "released":
        opt.release_weights()
        _step(model, opt, 3)
    assert "master" in opt.state[model[0].weight]  # kept apart
    model.load_state_dict(snapshot)
    _tiny_lr(opt)
    _step(model, opt, 4)
    after = model.state_dict()
    for key in ("0.weight", "2.weight"):
        # fp16 master with a power-of-two scale: relative rounding 2**-11 of the largest value, at most
        tol = 2**-10 * snapshot[key].abs().max().item()
        torch.testing.assert_close(after[key], snapshot[key], rtol=0, atol=tol)


def test_a_loaded_optimizer_state_is_where_the_next_step_starts():
    """model.load_state_dict then optimizer.load_state_dict (a resume): the loaded masters, not the parameters' rounded
    values, continue; bit for bit the run that was saved."""
    model = _bf16_model()
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    for seed in range(3):
        _step(model, opt, seed)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = {**opt.state_dict()}
    saved_opt = {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in saved_opt["state"].items()},
                 "param_groups": saved_opt["param_groups"]}  # fmt: skip
    _step(model, opt, 3)
    resumed = _bf16_model(seed=1)
    resumed_opt = FP8AdamW(resumed.parameters(), lr=1e-2)
    _step(resumed, resumed_opt, 9)  # a step of its own first: its masters and marks are not the saved ones
    resumed.load_state_dict(saved_model)
    resumed_opt.load_state_dict(saved_opt)
    _step(resumed, resumed_opt, 3)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_float64_parameters_are_refused_clearly():
    with pytest.raises(TypeError, match=r"float64 parameter of shape \(4,\).*model.float\(\)"):
        FP8AdamW([nn.Parameter(torch.ones(4, dtype=torch.float64))], lr=1e-3)
    opt = FP8AdamW([nn.Parameter(torch.ones(4))], lr=1e-3)
    with pytest.raises(TypeError, match="float64 parameter"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(4, dtype=torch.float64))]})
    assert len(opt.param_groups) == 1


def test_a_torch_adam_state_dict_loads_with_decoupled_weight_decay_as_into_torch_adamw():
    model = nn.Linear(16, 16)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=0.1)
    model(torch.randn(4, 16)).sum().backward()
    adam.step()
    want = torch.optim.AdamW(model.parameters(), lr=1e-3)
    want.load_state_dict(adam.state_dict())
    opt = FP8AdamW(model.parameters(), lr=1e-3)
    opt.load_state_dict(adam.state_dict())
    assert [g.get("decoupled_weight_decay") for g in opt.param_groups] == [True]
    assert [g["decoupled_weight_decay"] for g in want.param_groups] == [True]


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "load_state_dict"])
def test_writes_after_a_copy_or_a_load_of_the_optimizer_are_kept(how):
    """A deep-copied, unpickled or loaded optimizer watches its masters from then on: a write after it (a rollback,
    fill_) is where its next step starts, as without the copy. Before, the first step after it overwrote the write."""
    import copy
    import io

    model = _bf16_model()
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    for seed in range(3):
        _step(model, opt, seed)
    if how == "deepcopy":
        model, opt = copy.deepcopy((model, opt))
    elif how == "pickle":
        buf = io.BytesIO()
        torch.save((model, opt), buf)
        buf.seek(0)
        model, opt = torch.load(buf, weights_only=False)
    else:
        opt.load_state_dict(opt.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    _tiny_lr(opt)
    _step(model, opt, 3)
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in model.parameters())


WRITES = {
    "no_grad": lambda p, value: p.copy_(value),
    "detach": lambda p, value: p.detach().copy_(value),
    "assign_data": lambda p, value: setattr(p, "data", value.clone()),
    "in_place_through_data": lambda p, value: p.data.copy_(value),
}


@pytest.mark.parametrize("how", list(WRITES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_which_writes_the_next_step_starts_from_as_torch_adamw_does(how, dtype):
    """torch.optim.AdamW steps from the parameter however it was written. FP8AdamW's fp32 master of a bf16 parameter,
    kept apart, sees writes through the parameter (its version counter) and p.data = t (its storage), but not an
    in-place write through p.data, an alias with a version counter of its own (docs/concepts/optimizer.md says so and
    why): the step overwrites it. An fp32 parameter is its own master: every write is where its step starts."""
    torch.manual_seed(0)
    written = torch.randn(64).clamp(-0.01, 0.01).to(dtype)
    after = {}
    for cls in (torch.optim.AdamW, FP8AdamW):
        torch.manual_seed(1)
        p = nn.Parameter(torch.randn(64).to(dtype))
        opt = cls([p], lr=1e-2, weight_decay=0.0)
        p.grad = torch.randn(64).to(dtype)
        opt.step()
        with torch.no_grad():
            WRITES[how](p, written)
        _tiny_lr(opt)
        p.grad = torch.randn(64).to(dtype)
        opt.step()
        after[cls] = p.detach().clone()
    assert torch.equal(after[torch.optim.AdamW], written)
    seen = dtype == torch.float32 or how != "in_place_through_data"
    assert torch.equal(after[FP8AdamW], written) == seen
