"""FP8GradScaler's clipping takes torch's arguments: clip_grad_norm_'s norm_type (1, 2, inf, against a float64 norm of
the true gradients) and error_if_nonfinite, and clip_grad_value_ (infinities kept, so the step still skips the
overflow); limits that are not numbers >= 0 are refused (a negative max_norm flipped every gradient's sign, NaN made
them NaN, silently); a parameter listed twice counts and is clipped once."""

import math

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8

MU = 2.0**10


def _setup(fp8_grads: bool = False, opt_level: str = "O2") -> tuple[nn.Module, FP8GradScaler, FP8AdamW]:
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))
    scaler = FP8GradScaler(init_scale=MU)
    opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler, fp8_grads=fp8_grads, opt_level=opt_level)
    x, y = torch.randn(24, 32), torch.randn(24, 16)
    scaler.scale_loss(((model(x) - y) ** 2).mean()).backward()
    return model, scaler, opt


def _true_grads(model: nn.Module, opt: FP8AdamW) -> list[torch.Tensor]:
    """Every gradient in float64 without mu: param.grad, or the FP8 one the optimizer holds, dequantized."""
    opt._grad_casts.flush(opt)
    out = []
    for p in model.parameters():
        entry = opt._pending.get(p)
        g = p.grad.double() if entry is None else entry.data.double() * entry.scale_inv.double()
        out.append(g / MU)
    return out


@pytest.mark.parametrize("fp8_grads", [False, True])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf, 3])
def test_clip_grad_norm_of_each_norm_type_against_float64(norm_type, fp8_grads):
    model, scaler, opt = _setup(fp8_grads)
    grads = _true_grads(model, opt)
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]), norm_type)
    max_norm = float(want) / 4
    total = scaler.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
    torch.testing.assert_close(total.double(), want, rtol=1e-5, atol=0)
    after = _true_grads(model, opt)
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in after]), norm_type)
    torch.testing.assert_close(clipped, torch.tensor(max_norm, dtype=torch.float64), rtol=2e-3, atol=0)


def test_error_if_nonfinite_raises_as_torch_and_otherwise_the_overflow_is_skipped():
    model, scaler, opt = _setup()
    model[2].bias.grad[0] = math.inf
    with pytest.raises(RuntimeError, match="non-finite"):
        scaler.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    assert math.isinf(float(scaler.clip_grad_norm_(model.parameters(), 1.0)))
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert scaler.skipped_steps == 1
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("limit", [-1.0, math.nan, "1", None, True])
@pytest.mark.parametrize("method", ["clip_grad_norm_", "clip_grad_value_"])
def test_a_limit_that_is_not_a_number_from_0_is_refused_and_nothing_clipped(method, limit):
    model, scaler, opt = _setup()
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises((TypeError, ValueError), match=rf"{method}\("):
        getattr(scaler, method)(model.parameters(), limit)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("norm_type", [0, -2.0, "fro"])
def test_a_norm_type_that_is_not_positive_is_refused(norm_type):
    model, scaler, _ = _setup()
    with pytest.raises(ValueError, match="norm_type"):
        scaler.clip_grad_norm_(model.parameters(), 1.0, norm_type=norm_type)


def test_a_parameter_listed_twice_counts_and_is_clipped_once():
    model, scaler, opt = _setup()
    w = model[0].weight
    once = float(torch.linalg.vector_norm(w.grad.double())) / MU
    grad = w.grad.double().clone()
    total = scaler.clip_grad_norm_([w, w], once / 2)
    torch.testing.assert_close(float(total), once, rtol=1e-5, atol=0)
    torch.testing.assert_close(w.grad.double(), grad / 2, rtol=2e-3, atol=0)  # halved, not quartered


def test_clip_grad_value_clamps_the_true_gradients_and_keeps_an_overflow():
    model, scaler, opt = _setup(opt_level="O1")
    limit = 1e-3
    grads = [p.grad.double() / MU for p in model.parameters()]
    model[2].bias.grad[1] = -math.inf
    scaler.clip_grad_value_(model.parameters(), limit)
    for p, g in zip(model.parameters(), grads, strict=True):
        got = p.grad.double() / MU
        finite = got.isfinite()
        torch.testing.assert_close(got[finite], g.clamp(-limit, limit)[finite], rtol=1e-6, atol=0)
    assert float(model[2].bias.grad[1]) == -math.inf  # the step still sees the overflow
    opt.step()
    assert scaler.skipped_steps == 1


def test_clip_grad_value_refuses_gradients_held_in_fp8():
    model, scaler, _ = _setup(fp8_grads=True)
    assert model[0].weight.grad is None
    with pytest.raises(ValueError, match="fp8_grads=False"):
        scaler.clip_grad_value_(model.parameters(), 1.0)


@pytest.mark.parametrize("norm_type", [8.0, "inf"])
def test_a_high_order_norm_of_gradients_carrying_a_large_mu_does_not_overflow(norm_type):
    # |g| ** 8 of gradients times mu = 2**16 passed fp32's range: the norm came back inf and every gradient was zeroed.
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))
    scaler = FP8GradScaler(init_scale=2.0**16)
    opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler, fp8_grads=True, opt_level="O1")
    scaler.scale_loss(((model(torch.randn(24, 32) * 30) - torch.randn(24, 16)) ** 2).mean()).backward()
    opt._grad_casts.flush(opt)
    grads = []
    for p in model.parameters():
        entry = opt._pending.get(p)
        grads.append((p.grad.double() if entry is None else entry.data.double() * entry.scale_inv.double()) / 2.0**16)
    order = math.inf if norm_type == "inf" else norm_type
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, order) for g in grads]), order)
    total = scaler.clip_grad_norm_(model.parameters(), 1e9, norm_type=norm_type)
    torch.testing.assert_close(total.double(), want, rtol=1e-5, atol=0)
    assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())  # not zeroed


@pytest.mark.parametrize("what", ["optimizer", "module", "layer", "param_groups", "named_parameters", "none"])
@pytest.mark.parametrize("method", ["clip_grad_norm_", "clip_grad_value_", "grad_factor"])
def test_parameters_that_are_not_tensors_are_refused_with_what_to_pass(method, what):
    # An optimizer or a module in place of its parameters failed with "'FP8AdamW' object is not iterable" or
    # "'FP8Linear' object has no attribute 'grad'", which said neither what was wrong nor what to pass.
    model, scaler, opt = _setup()
    passed = {
        "optimizer": opt,
        "module": model,
        "layer": model[0],
        "param_groups": opt.param_groups,
        "named_parameters": dict(model.named_parameters()),
        "none": None,
    }[what]
    before = [p.grad.clone() for p in model.parameters()]
    args = () if method == "grad_factor" else (1e-6,)
    with pytest.raises(TypeError, match=r"takes the parameters .*model\.parameters\(\).*nothing was changed"):
        getattr(scaler, method)(passed, *args)
    for p, grad in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.grad, grad)


def test_a_parameter_list_module_is_taken_as_torch_takes_it():
    # An nn.ParameterList iterates over its parameters: torch.nn.utils.clip_grad_norm_ takes it, and so does the scaler.
    params = nn.ParameterList([nn.Parameter(torch.full((3,), 1.0)), nn.Parameter(torch.full((4,), 1.0))])
    scaler = FP8GradScaler(init_scale=MU)
    scaler.scale_loss(sum(p.sum() for p in params)).backward()
    total = scaler.clip_grad_norm_(params, 1.0)
    torch.testing.assert_close(total, torch.tensor(math.sqrt(7.0)))
