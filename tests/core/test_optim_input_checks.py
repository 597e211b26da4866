"""What FP8AdamW takes from its caller besides parameters, as torch.optim.AdamW takes it: NumPy scalar
hyper-parameters (stored as Python floats); a gradient handed to accumulate_fp8_grad only for a parameter it holds; a
state dict whose per-parameter states are dicts (a corrupt one is refused before anything changes)."""

import copy
import io

import numpy as np
import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8
from tests.numerics import assert_same

# FP8AdamW's fp32 step (parameters that are not FP8 weights) against torch.optim.AdamW's: the same formula in another
# operation order, a few fp32 ulp per step; 1e-6 bounds these few steps with margin.
ADAMW_ATOL = 1e-6


def _fp8_layer(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Linear(32, 48))


def _plain_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 8))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(8, 24, generator=gen)).square().mean().backward()
    opt.step()


def test_numpy_scalar_hyper_parameters_step_as_in_torch_adamw_and_are_stored_as_floats():
    """np.float32 ones (from a config or an array) were refused with TypeError; torch.optim.AdamW takes them (its
    betas only as floats or tensors: it gets the same values as floats)."""
    kwargs = {"lr": np.float32(1e-2), "eps": np.float32(1e-6), "weight_decay": np.float32(0.1)}
    betas = (np.float32(0.8), np.float64(0.99))
    model, ref = _plain_model(), _plain_model()
    opt = FP8AdamW(model.parameters(), betas=betas, **kwargs)
    ref_opt = torch.optim.AdamW(ref.parameters(), betas=tuple(float(beta) for beta in betas), **kwargs)
    for seed in range(5):
        _step(model, opt, seed)
        _step(ref, ref_opt, seed)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=ADAMW_ATOL)
    extra = nn.Parameter(torch.randn(7))
    opt.add_param_group({"params": [extra], "lr": np.float32(1e-3), "betas": (np.float32(0.9), 0.999)})
    for group in opt.param_groups:
        assert all(type(group[name]) is float for name in ("lr", "eps", "weight_decay"))
        assert all(type(beta) is float for beta in group["betas"])
    # Python floats, so the state dict loads where NumPy scalars are refused.
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["param_groups"][0]["lr"] == float(np.float32(1e-2))
    # A state dict whose groups hold NumPy scalars (torch.optim.AdamW keeps them as given) loads as floats.
    loaded = FP8AdamW(_plain_model().parameters())
    loaded.load_state_dict(ref_opt.state_dict())
    assert type(loaded.param_groups[0]["lr"]) is float and type(loaded.param_groups[0]["betas"][0]) is float
    with pytest.raises(TypeError, match="lr must be a number, got bool"):
        FP8AdamW(model.parameters(), lr=True)


def test_accumulate_fp8_grad_refuses_a_parameter_the_optimizer_does_not_hold():
    """It kept the gradient, which no step applied, and counted it in the scaler's non-finite check (an inf one
    skipped the steps of the parameters it holds)."""
    held, other = _fp8_layer(0), _fp8_layer(1)
    scaler = FP8GradScaler()
    opt = FP8AdamW(held.parameters(), lr=1e-2, grad_scaler=scaler)
    with pytest.raises(ValueError, match="in none of this FP8AdamW's parameter groups.*add_param_group"):
        opt.accumulate_fp8_grad(other.weight, torch.full(other.weight.shape, float("inf")))
    before = held.state_dict()["weight"].clone()
    scaler.scale_loss(held(torch.randn(8, 32)).square().mean()).backward()
    opt.step()
    assert scaler.skipped_steps == 0 and not torch.equal(held.state_dict()["weight"], before)
    # Once added, its gradient is applied as by an optimizer that held it from the start.
    twin = copy.deepcopy(other)
    twin_opt = FP8AdamW(twin.parameters(), lr=1e-2)
    opt.zero_grad()
    opt.add_param_group({"params": list(other.parameters())})
    grad = torch.randn(other.weight.shape)
    opt.accumulate_fp8_grad(other.weight, grad)
    twin_opt.accumulate_fp8_grad(twin.weight, grad)
    opt.step()
    twin_opt.step()
    assert_same(other.state_dict()["weight"], twin.state_dict()["weight"])


@pytest.mark.parametrize("corrupt", [None, []])
def test_a_per_parameter_state_that_is_not_a_dict_is_refused_before_anything_changes(corrupt):
    """A state None loaded without a word and that parameter's Adam state started again from zero;
    torch.optim.AdamW fails on it."""
    source = _plain_model(1)
    source_opt = FP8AdamW(source.parameters(), lr=1e-2)
    _step(source, source_opt, 0)
    saved = source_opt.state_dict()
    saved["state"][0] = corrupt
    model = _plain_model()
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, 1)
    before = copy.deepcopy((opt.state_dict(), model.state_dict()))
    message = f"parameter 0's state is a {type(corrupt).__name__}, not a dict"
    with pytest.raises(ValueError, match=message):
        opt.check_state_dict(saved)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(saved)
    assert_same((opt.state_dict(), model.state_dict()), before)
    if corrupt is None:
        with pytest.raises(TypeError):
            torch.optim.AdamW(_plain_model().parameters()).load_state_dict(saved)
    # An absent state is a parameter not stepped yet (as torch.optim.AdamW's state dict leaves it out): it loads.
    del saved["state"][0]
    opt.load_state_dict(saved)
    assert 0 not in opt.state_dict()["state"] and 1 in opt.state_dict()["state"]


def test_accumulate_fp8_grad_takes_any_one_element_scale_inv_and_refuses_what_it_cannot_use():
    # A (1,)-shaped scale_inv was stored with a (1,)-shaped amax: the next step() failed on a broadcast; a scale_inv
    # given with a high-precision gradient was ignored, and integer or complex gradients were cast as numbers.
    results = []
    for scale_inv in (torch.tensor(0.5), torch.tensor([0.5], dtype=torch.float64)):
        torch.manual_seed(0)
        model = convert_to_fp8(nn.Sequential(nn.Linear(32, 16)))
        opt = FP8AdamW(model.parameters(), lr=1e-2, fp8_grads=True)
        grad = (torch.randn(16, 32, generator=torch.Generator().manual_seed(1)) * 8).to(torch.float8_e5m2)
        opt.accumulate_fp8_grad(model[0].weight, grad, scale_inv)
        opt.step()
        results.append(model[0].weight.detach().clone())
    assert torch.equal(results[0], results[1])
    weight = model[0].weight
    for grad, scale_inv, error, match in [
        (torch.ones(16, 32), torch.tensor(0.25), ValueError, "scale_inv goes with an FP8 gradient"),
        (torch.ones(16, 32, dtype=torch.int64), None, TypeError, "casts float16, bfloat16, float32 or float64"),
        (torch.ones(16, 32, dtype=torch.complex64), None, TypeError, "casts float16"),
        (torch.ones(16, 32).to(torch.float8_e5m2), torch.ones(2), ValueError, "one-element floating tensor"),
        (torch.ones(16, 32).to(torch.float8_e5m2), 0.5, ValueError, "one-element floating tensor"),
        (torch.ones(16, 32).to(torch.float8_e5m2), None, ValueError, "needs its scale_inv"),
    ]:
        with pytest.raises(error, match=match):
            opt.accumulate_fp8_grad(weight, grad, scale_inv)
        assert weight not in opt._pending  # nothing was accumulated


@pytest.mark.parametrize(
    "key, value, error, match",
    [
        ("amsgrad", True, ValueError, r"amsgrad=True\) is not supported"),
        ("capturable", True, ValueError, r"capturable=True\) is not supported"),
        ("maximize", "no", TypeError, r"maximize='no'\): must be True or False"),
        ("betas", (1.0, 0.999), ValueError, r"Invalid beta parameter at index 0: 1.0"),
        ("lr", float("nan"), ValueError, r"Invalid learning rate: nan"),
        ("lr", "1e-3", TypeError, r"lr must be a number, got str"),
        ("lr", None, TypeError, r"lr must be a number, got NoneType"),
        ("eps", -1.0, ValueError, r"Invalid epsilon value: -1.0"),
        ("weight_decay", torch.tensor(float("inf")), ValueError, r"Invalid weight_decay value: inf"),
    ],
)
@pytest.mark.parametrize("with_scaler", [False, True])
def test_a_group_written_with_a_value_the_constructor_refuses_is_refused_by_the_step(
    key, value, error, match, with_scaler
):
    """Found by the sweep of the optimizer side: the step did not look at a group's values again, so a group written
    after the constructor checked it was stepped silently (``amsgrad=True`` without AMSGrad, ``capturable=True``,
    ``maximize="no"`` as gradient ascent, an lr of ``"1e-3"``) or failed on its way (``betas=(1.0, ...)``:
    ZeroDivisionError). Now the step raises the constructor's error, naming the group, before anything changes, and
    steps as before once the value is set right."""
    model = _fp8_layer(0)
    scaler = FP8GradScaler() if with_scaler else None
    opt = FP8AdamW(model.parameters(), lr=1e-3, grad_scaler=scaler)
    for _ in range(2):
        opt.zero_grad()
        loss = model(torch.randn(4, 32)).square().mean()
        (scaler.scale_loss(loss) if scaler else loss).backward()
        if _ == 1:
            absent = key not in opt.param_groups[0]  # (amsgrad, capturable: FP8AdamW's groups have no such key)
            good = opt.param_groups[0].get(key)
            opt.param_groups[0][key] = value
            before = copy.deepcopy((model.state_dict(), opt.state_dict()))
            with pytest.raises(error, match=rf"FP8AdamW.step: parameter group 0 .*{match}.*nothing was stepped"):
                opt.step()
            after = (model.state_dict(), opt.state_dict())
            assert_same(after[0], before[0])
            assert_same(after[1]["state"], before[1]["state"])
            if absent:
                del opt.param_groups[0][key]
            else:
                opt.param_groups[0][key] = good
        opt.step()  # the gradients left by the refused step, as they were
    assert all(int(state["step"]) == 2 for state in opt.state.values())


def test_one_element_tensor_eps_and_weight_decay_are_taken_as_torch_takes_them():
    # torch.optim.AdamW takes tensors for eps and weight_decay, and FP8AdamW's step did too, but the constructor,
    # add_param_group and load_state_dict refused them: a torch.optim.AdamW state dict with them, and FP8AdamW's own
    # after such a group was stepped, did not load.
    import io

    torch.manual_seed(0)
    weights, grads = torch.randn(16, 16), [torch.randn(16, 16) for _ in range(3)]
    results = []
    for eps, weight_decay in ((1e-6, 0.25), (torch.tensor(1e-6), torch.tensor(0.25))):
        p = nn.Parameter(weights.clone())
        opt = FP8AdamW([p], lr=1e-2, eps=eps, weight_decay=weight_decay, fp8_params=[p])
        for g in grads:
            p.grad = g.clone()
            opt.step()
        results.append(p.detach().clone())
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        buffer.seek(0)
        q = nn.Parameter(weights.clone())
        FP8AdamW([q], fp8_params=[q]).load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(results[0], results[1])
    p = nn.Parameter(weights.clone())
    torch_opt = torch.optim.AdamW([p], eps=torch.tensor(1e-6), weight_decay=torch.tensor(0.25))
    p.grad = grads[0].clone()
    torch_opt.step()
    opt = FP8AdamW([nn.Parameter(weights.clone())])
    opt.load_state_dict(torch_opt.state_dict())
    assert float(opt.param_groups[0]["eps"]) == pytest.approx(1e-6)
    opt.add_param_group({"params": [nn.Parameter(torch.randn(3))], "weight_decay": torch.tensor(0.5)})
    for name in ("eps", "weight_decay"):
        with pytest.raises(ValueError, match=f"a tensor {name} must have one element, got shape \\(2,\\)"):
            FP8AdamW([nn.Parameter(torch.randn(3))], **{name: torch.tensor([0.1, 0.2])})
    with pytest.raises(ValueError, match="Invalid epsilon value: -1.0"):
        FP8AdamW([nn.Parameter(torch.randn(3))], eps=torch.tensor(-1.0))
