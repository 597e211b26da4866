"""FP8AdamW.release (the recovery "back to high precision", put_back_to_high_precision): the weight becomes a plain
parameter whose states are those of any parameter of its dtype (a bf16 one keeps an fp32 master apart), and a gradient
not stepped yet is handed back to param.grad, at O1 and O2. Checked against torch.optim.AdamW continuing from the
released state."""

import io

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, convert_to_fp8, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.optim import master
from lightning_fp8.recovery import put_back_to_high_precision
from tests.numerics import assert_same

# FP8AdamW's fp32 step against torch.optim.AdamW's: the same formula in another operation order, a few fp32 ulp per
# step; 1e-6 bounds it over these 40 steps with margin, against weights of magnitude ~0.25.
ADAMW_ATOL = 1e-6
# Rounding to nearest with p significant bits: |round(x) - x| <= |x| * 2**-p (the unit roundoff); bf16 has 8, fp16 11.
BF16_UNIT_ROUNDOFF = 2.0**-8
FP16_UNIT_ROUNDOFF = 2.0**-11


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16))).to(dtype)


def _backward(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 32, generator=gen).to(model[0].weight.device, model[0].weight.dtype)
    model(x).float().square().mean().backward()


def _adamw_from(weight: torch.Tensor, state: dict, lr: float) -> tuple[nn.Parameter, torch.optim.AdamW]:
    """torch.optim.AdamW over an fp32 copy of ``weight`` (values), continuing from FP8AdamW's released ``state``."""
    ref = nn.Parameter(weight.detach().float().clone())
    opt = torch.optim.AdamW([ref], lr=lr)
    opt.state[ref] = {key: state[key].detach().float().clone() for key in ("step", "exp_avg", "exp_avg_sq")}
    return ref, opt


@pytest.mark.parametrize("master_at", ["storage", "apart"])
def test_a_released_bf16_weight_keeps_an_fp32_master_and_steps_as_torch_adamw(master_at):
    """It kept no master: its bf16 storage rounded away each update smaller than half a unit in the last place (20
    steps at lr 1e-4 moved 30 of 256 elements; a bf16 nn.Linear weight of a fresh FP8AdamW moved 229)."""
    lr = 1e-4
    model = _model(torch.bfloat16)
    opt = FP8AdamW(model.parameters(), lr=lr)
    weight = model[0].weight
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    if master_at == "apart":
        opt.release_weights()  # the fp16 master moves into the optimizer's state
        expected = opt.state[weight]["master"].float() / opt.state[weight]["master_scale"]
    else:
        expected = weight.detach().float() / master.master_scale(weight)
    put_back_to_high_precision(model, ["0"], opt)
    state = opt.state[weight]
    assert weight.dtype == torch.bfloat16
    ref, ref_opt = _adamw_from(expected, state, lr)  # from the O2 master, unrounded
    gen = torch.Generator().manual_seed(1)
    for _ in range(40):
        grad = (torch.randn(weight.shape, generator=gen) * 1e-2).to(torch.bfloat16)
        weight.grad, ref.grad = grad, grad.float()
        opt.step()
        ref_opt.step()
    # The weight is within bf16's rounding of torch's fp32 trajectory: the rounding of an fp32 master's.
    error = (weight.detach().float() - ref.detach()).abs()
    assert bool((error <= ref.detach().abs() * BF16_UNIT_ROUNDOFF + ADAMW_ATOL).all())
    assert state["master"].dtype == torch.float32
    torch.testing.assert_close(state["master"], ref.detach(), rtol=0, atol=ADAMW_ATOL)


@pytest.mark.parametrize("fp8_grads", [True, False])
def test_release_at_o2_hands_the_gradient_not_stepped_yet_back(fp8_grads):
    """At O2 the gradient of the backward before the put-back was dropped (the FP8 one the optimizer held, or the fp16
    param.grad): the weight skipped that step. At O1 it was handed back."""
    lr = 1e-2
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=lr, fp8_grads=fp8_grads)
    weight = model[0].weight
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    _backward(model, 1)
    if fp8_grads:
        assert weight.grad is None
        entry = opt._pending[weight]
        expected = entry.data.float() * entry.scale_inv  # the FP8 gradient, dequantized
    else:
        expected = weight.grad.float()
    put_back_to_high_precision(model, ["0"], opt)
    assert weight.dtype == torch.float32
    assert_same(weight.grad, expected)
    ref, ref_opt = _adamw_from(weight, opt.state[weight], lr)
    ref.grad = expected.clone()
    opt.step()
    ref_opt.step()
    torch.testing.assert_close(weight.detach(), ref.detach(), rtol=0, atol=ADAMW_ATOL)


def test_a_write_to_a_released_weight_before_the_put_back_is_kept():
    """After release_weights() the master is kept apart (fp16, scaled) and a write to the weight reaches it at the next
    step; the put-back copied the master over the weight and lost the write."""
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    _backward(model, 0)
    opt.step()
    opt.release_weights()
    written = torch.randn(model[0].weight.shape)
    with torch.no_grad():
        model[0].weight.copy_(written)
    put_back_to_high_precision(model, ["0"], opt)
    # As the next step would have taken it: into the fp16 master (values of a few units: no subnormals at its scale).
    torch.testing.assert_close(model[0].weight.detach(), written, rtol=FP16_UNIT_ROUNDOFF, atol=0)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_released_weight_is_no_longer_counted_as_held_in_fp8(opt_level):
    # After release (or release_weights), the optimizer no longer holds the weight's gradient: a backward leaves it in
    # param.grad, where the scaler's clip_grad_norm_ finds it; the other weight's is held in FP8 and counted from there.
    from lightning_fp8 import FP8GradScaler

    model = _model()
    scaler = FP8GradScaler()
    opt = FP8AdamW(model.parameters(), lr=1e-3, opt_level=opt_level, fp8_grads=True, grad_scaler=scaler)
    assert float(scaler.clip_grad_norm_([model[0].weight], 1.0)) == 0.0  # no gradient yet
    opt.release(model[0].weight)
    scaler.scale_loss(torch.zeros(()))  # (the scaler's mu is 1: the backward below carries it as it is)
    _backward(model, 1)
    assert model[0].weight.grad is not None  # the gradient stays in param.grad
    want = torch.linalg.vector_norm(model[0].weight.grad.double())
    torch.testing.assert_close(scaler.clip_grad_norm_([model[0].weight], 1e9).double(), want, rtol=1e-6, atol=0)
    held = opt.fp8_grad_norms()
    assert list(held) == [model[2].weight]  # the other weight's is still held, and counted from there
    torch.testing.assert_close(scaler.clip_grad_norm_([model[2].weight], 1e9), held[model[2].weight], rtol=1e-6, atol=0)


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_released_weights_are_their_masters_and_a_resumed_run_continues_bit_for_bit(dtype, device):
    """After release_weights() each step wrote the weight from the unrounded update while the master kept its fp16
    rounding: the model's state dict and the optimizer's disagreed (up to an fp16 ulp), and a run resumed from them
    (the master put back) left the uninterrupted run's path. Now the weight is the stored master, unscaled."""

    def step(model, opt, seed):
        _backward(model, seed)
        opt.step()
        opt.zero_grad()

    model = _model(dtype).to(device)
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    step(model, opt, 0)
    opt.release_weights()
    step(model, opt, 1)
    for weight in (model[0].weight, model[2].weight):
        state = opt.state[weight]
        assert_same(weight.detach(), (state["master"].float() / state["master_scale"]).to(dtype))
    saved = [_roundtrip(x) for x in (model.state_dict(), opt.state_dict(), fp8_state_dict(model))]
    resumed = _model(dtype).to(device)
    resumed.load_state_dict(saved[0])
    load_fp8_state_dict(resumed, saved[2])
    resumed_opt = FP8AdamW(resumed.parameters(), lr=1e-2)
    resumed_opt.load_state_dict(saved[1])  # the masters back in the weights' storage
    resumed_opt.release_weights()  # and apart again, as in the run saved
    for seed in (2, 3, 4):
        step(model, opt, seed)
        step(resumed, resumed_opt, seed)
        for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
            assert_same(p.detach(), q.detach())
            assert all(torch.equal(opt.state[p][key], resumed_opt.state[q][key]) for key in opt.state[p])


def test_release_of_a_parameter_it_does_not_hold_or_of_no_parameter_is_refused():
    # A parameter of another optimizer (or None) was "released" without a word, the caller's weight left in FP8
    # storage; a list failed with "unhashable type: 'list'".
    model, other = _model(), _model()
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    other_opt = FP8AdamW(other.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"in none of this FP8AdamW's parameter groups.*nothing was released"):
        opt.release(other[0].weight)
    assert other[0].weight in other_opt._low_precision and master.master_scale(other[0].weight) is not None
    for bad in (None, [model[0].weight]):
        with pytest.raises(TypeError, match="FP8AdamW.release takes one parameter"):
            opt.release(bad)
    assert model[0].weight in opt._low_precision
    opt.release(model[0].bias)  # held, with fp32 states already: nothing to do
    opt.release(model[0].weight)
    assert model[0].weight not in opt._low_precision
