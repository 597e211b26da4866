"""FP8AdamW against torch.optim.AdamW in float64, fed the same hand-set gradients (``fp8_grads=False``), over many
steps: each state within what its storage format explains, and no NaN where torch's step has none."""

import copy

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, convert_to_fp8

# Bounds of the relative (norm) deviation from float64 AdamW after STEPS steps, per O2 state, from the formats:
# - exp_avg: E4M3 rounds each step's value by <= 2**-4 (about 2.4% RMS); the errors decay with beta1, so they add up
#   to ~2.4% / sqrt(1 - beta1**2) = 5.5% at beta1 0.9 (6% seen): 0.1 leaves margin;
# - exp_avg_sq: fp16 rounds by <= 2**-11 per step, summed over the steps with little decay (beta2 0.999): 0.07% seen
#   after 30 steps; 0.3% leaves margin;
# - weights: the first moment's error enters each update (lr times ~6%), the fp16 master adds 2**-11 per step: 2-3%
#   seen after 30 steps at lr 1e-2 (the weights move ~0.3 from ~0.1): 0.06 leaves margin;
# - fp32 states (biases): fp32 rounding only.
STEPS = 30
EXP_AVG_RTOL, EXP_AVG_SQ_RTOL, WEIGHT_RTOL, FP32_RTOL = 0.1, 3e-3, 0.06, 1e-5


_ADAMW_ARGS = ("lr", "betas", "eps", "weight_decay", "maximize")


def _rel(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return ((actual.double() - reference).norm() / reference.norm()).item()


def _against_adamw(grad_fn, steps=STEPS, sizes=((32, 48), (48, 16)), **kwargs):
    """FP8AdamW and float64 torch.optim.AdamW on the same gradients ``grad_fn(step, index, shape, generator)``
    (a tensor, or None to leave the parameter without one); returns the model, both optimizers and the float64
    parameters."""
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(a, b) for a, b in sizes])
    model = convert_to_fp8(copy.deepcopy(base))
    params = list(model.parameters())
    reference = [p.detach().double().clone().requires_grad_() for p in base.parameters()]
    opt = FP8AdamW(params, fp8_grads=False, **kwargs)
    ref = torch.optim.AdamW(reference, **{k: v for k, v in kwargs.items() if k in _ADAMW_ARGS})
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        for index, (p, r) in enumerate(zip(params, reference, strict=True)):
            grad = grad_fn(step, index, p.shape, generator)
            p.grad = None if grad is None else grad.to(p.dtype)  # fp16 for the O2 weights
            r.grad = None if grad is None else p.grad.double()
        opt.step()
        ref.step()
    return model, opt, ref, reference


def _shifted_normal(step, index, shape, generator):
    return torch.randn(shape, generator=generator) + 0.3  # a steady part, so the moments do not average out


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 1e-2},
        {"lr": torch.tensor(1e-2), "betas": (0.0, 0.999)},
        {"lr": 1e-2, "betas": (0.9, 0.99999), "eps": 1e-30},
        {"lr": 1e-2, "weight_decay": 10.0, "maximize": True},
        {"lr": 1e-2, "scale_update": "one_pass", "eps": 0.0},
    ],
    ids=["defaults", "tensor-lr-beta1-0", "beta2-near-1-tiny-eps", "large-decay-maximize", "one-pass-eps-0"],
)
def test_states_stay_within_their_formats_precision_of_float64_adamw(kwargs):
    model, opt, ref, reference = _against_adamw(_shifted_normal, **kwargs)
    weights = model.state_dict()  # unscaled, in the model's dtype
    exported = opt.to_adamw_state_dict()["state"]
    for index, (name, p) in enumerate(model.named_parameters()):
        state = ref.state[reference[index]]
        low_precision = opt.state[p]["exp_avg"].dtype != torch.float32
        w_tol, m_tol, v_tol = (WEIGHT_RTOL, EXP_AVG_RTOL, EXP_AVG_SQ_RTOL) if low_precision else (FP32_RTOL,) * 3
        assert _rel(weights[name], reference[index].detach()) < w_tol, name
        assert _rel(exported[index]["exp_avg"], state["exp_avg"]) < m_tol, name
        assert _rel(exported[index]["exp_avg_sq"], state["exp_avg_sq"]) < v_tol, name


@pytest.mark.parametrize("moments", ["fp8_weights", "all"])
@pytest.mark.parametrize("scale_update", ["one_pass", "two_pass"])
def test_eps_zero_steps_no_nan_where_flushed_moments_get_no_gradient(moments, scale_update):
    # Element 0 of each tensor gets a gradient 2**-25 below the others once, then none: its E4M3 first moment and
    # fp16 second moment flush to 0 in their per-tensor scaled formats. With eps 0 its next update was 0 / 0 = NaN
    # (spreading through the next forward), where torch's moments stay nonzero and its update is 0.
    def grad_fn(step, index, shape, generator):
        grad = torch.randn(shape, generator=generator) + 0.3
        grad.view(-1)[0] = 1e-7 if step == 0 else 0.0
        return grad

    model, opt, ref, reference = _against_adamw(
        grad_fn, steps=3, lr=1e-2, eps=0.0, scale_update=scale_update, low_precision_moments=moments
    )
    weights = model.state_dict()
    for index, (name, _) in enumerate(model.named_parameters()):
        assert torch.isfinite(reference[index]).all()
        assert torch.isfinite(weights[name]).all(), name
        assert _rel(weights[name], reference[index].detach()) < WEIGHT_RTOL, name


def _e5m2(grad: torch.Tensor) -> torch.Tensor:
    """The documented FP8 gradient cast, in float64: E5M2 with the power-of-two scale of the tensor's own amax."""
    grad = grad.double()
    scale = 2.0 ** torch.floor(torch.log2(torch.tensor(57344.0, dtype=torch.float64) / grad.abs().max()))
    return (grad * scale).float().to(torch.float8_e5m2).double() / scale


@pytest.mark.parametrize(
    ("model_dtype", "master_dtype"),
    [(torch.float32, torch.float32), (torch.float16, None), (torch.bfloat16, torch.bfloat16)],
    ids=["fp32-master", "half-model", "bf16-model-bf16-master"],
)
def test_fp8_grads_cast_the_gradients_of_weights_already_of_the_master_dtype(model_dtype, master_dtype):
    # Such a weight keeps its master apart (its storage is not taken): fp8_grads left its gradient in param.grad, in
    # high precision (4 bytes per parameter for an fp32 master, not 1), without a word.
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 16)).to(model_dtype)
    model = convert_to_fp8(copy.deepcopy(base))
    params = list(model.parameters())
    reference = [p.detach().double().clone().requires_grad_() for p in base.parameters()]
    kwargs = {} if master_dtype is None else {"master_dtype": master_dtype}
    opt = FP8AdamW(params, lr=1e-2, **kwargs)
    ref = torch.optim.AdamW(reference, lr=1e-2)
    weights = {model[0].weight, model[1].weight}
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        grads = [(torch.randn(p.shape, generator=generator) + 0.3).to(p.dtype) for p in params]
        sum((p * g).sum() for p, g in zip(params, grads, strict=True)).backward()  # gradient g for each p
        for p, g, r in zip(params, grads, reference, strict=True):
            assert (p.grad is None) == (p in weights)  # the FP8 weights' gradients are held in FP8
            r.grad = _e5m2(g) if p in weights else g.double()
        opt.step()
        opt.zero_grad()
        ref.step()
    state = model.state_dict()
    for index, (name, p) in enumerate(model.named_parameters()):
        if p in weights:  # (the other parameters' values are rounded to the model's dtype)
            assert _rel(state[name], reference[index].detach()) < WEIGHT_RTOL, name
