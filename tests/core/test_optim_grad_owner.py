"""Which FP8AdamW takes an FP8 weight's gradient, and the scaler's step over empty parameters.

An FP8AdamW with ``fp8_grads`` hooks each FP8 weight's gradient out of ``param.grad``; a later FP8AdamW over the same
weight that does not hook it (``fp8_grads=False``, or the weight frozen when it was built) used to leave the earlier
one's hook in charge while that one lived (a LR scheduler keeps it alive): the new optimizer saw no gradient and never
trained the weights, without a word. And ``FP8GradScaler.step(FP8AdamW)`` raised for a parameter with no elements
(``_foreach_norm(inf)`` of an empty gradient), where torch.amp.GradScaler steps.
"""

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8
from lightning_fp8.optim import master

LR = 1e-2
# One fp32 AdamW step against torch.optim.AdamW's: the same formula in another operation order.
ONE_FP32_STEP_RTOL, ONE_FP32_STEP_ATOL = 1e-6, 1e-7
# A first Adam step moves each weight by lr * g / (|g| + eps) (+ decay); O2's fp16 master rounds the result (2**-11
# relative) and tiny |g| near eps move the quotient by far less than lr / 256.
O2_STEP_RTOL, O2_STEP_ATOL = 2**-10, LR / 256


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.LayerNorm(48), nn.Linear(48, 16)))


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [model[0].weight, model[2].weight]


def _backward(model: nn.Module, seed: int = 0) -> None:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))
    (model(x) ** 2).mean().backward()


def _reference_step(model: nn.Module) -> list[torch.Tensor]:
    """Each FP8 weight after one torch.optim.AdamW step on its ``param.grad`` (in the weight's own units)."""
    refs = []
    for name, p in model.named_parameters():
        if not name.endswith("weight") or not master.is_fp8_weight(p):
            continue
        assert p.grad is not None, f"{name}: the gradient left param.grad"
        scale = master.master_scale(p)
        factor = 1.0 if scale is None else scale.float()  # the storage holds the weight times scale (O2)
        ref = nn.Parameter(model.state_dict()[name].detach().float().clone())
        ref.grad = p.grad.detach().float() * factor
        refs.append(ref)
    torch.optim.AdamW(refs, lr=LR).step()
    return [r.detach() for r in refs]


def _check_stepped_as_adamw(model: nn.Module, refs: list[torch.Tensor], opt_level: str) -> None:
    tol = (ONE_FP32_STEP_RTOL, ONE_FP32_STEP_ATOL) if opt_level == "O1" else (O2_STEP_RTOL, O2_STEP_ATOL)
    names = [n for n, p in model.named_parameters() if n.endswith("weight") and master.is_fp8_weight(p)]
    for name, ref in zip(names, refs, strict=True):
        torch.testing.assert_close(model.state_dict()[name].float(), ref, rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("how", ["init", "add_param_group"])
def test_a_later_optimizer_without_fp8_grads_trains_the_weights_an_earlier_one_hooked(opt_level, how):
    model = _model()
    old = FP8AdamW(model.parameters(), lr=LR, opt_level=opt_level)  # fp8_grads: hooks the FP8 weights
    sched = torch.optim.lr_scheduler.LambdaLR(old, lambda step: 1.0)  # keeps `old` (and its hooks) alive
    if how == "init":
        opt = FP8AdamW(model.parameters(), lr=LR, opt_level=opt_level, fp8_grads=False)
    else:
        weights = {id(p) for p in _weights(model)}
        opt = FP8AdamW([p for p in model.parameters() if id(p) not in weights], lr=LR, opt_level=opt_level,
                       fp8_grads=False)  # fmt: skip
        opt.add_param_group({"params": _weights(model)})
    before = [model.state_dict()[k].clone() for k in ("0.weight", "2.weight")]
    _backward(model)
    assert all(w.grad is not None for w in _weights(model))  # left in param.grad for `opt`
    assert not old.fp8_grad_norms()  # the old hook took nothing
    refs = _reference_step(model)
    opt.step()
    _check_stepped_as_adamw(model, refs, opt_level)
    for key, b in zip(("0.weight", "2.weight"), before, strict=True):  # a first Adam step: about lr per element
        moved = (model.state_dict()[key] - b).abs().max()
        torch.testing.assert_close(moved, torch.tensor(LR, dtype=moved.dtype), rtol=0.05, atol=0)
    assert sched.optimizer is old


def test_a_weight_frozen_when_a_later_optimizer_was_built_is_not_taken_by_an_earlier_ones_hook():
    model = _model()
    old = FP8AdamW(model.parameters(), lr=LR, opt_level="O1")  # hooks both FP8 weights
    weight = model[0].weight
    weight.requires_grad_(False)
    opt = FP8AdamW(model.parameters(), lr=LR, opt_level="O1")  # hooks model[2].weight only
    weight.requires_grad_(True)
    _backward(model)
    assert weight.grad is not None and not old.fp8_grad_norms()
    ref = nn.Parameter(weight.detach().clone())
    ref.grad = weight.grad.clone()
    torch.optim.AdamW([ref], lr=LR).step()
    opt.step()
    torch.testing.assert_close(weight.detach(), ref.detach(), rtol=ONE_FP32_STEP_RTOL, atol=ONE_FP32_STEP_ATOL)


def test_the_scaler_clips_the_gradients_of_a_later_optimizer_without_fp8_grads():
    """Those of the later optimizer (fp8_grads=False) are in param.grad, not held by the earlier one in FP8."""
    model = _model()
    old = FP8AdamW(model.parameters(), lr=LR, opt_level="O1")
    scaler = FP8GradScaler()
    opt = FP8AdamW(model.parameters(), lr=LR, opt_level="O1", fp8_grads=False, grad_scaler=scaler)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    scaler.scale_loss((model(x) ** 2).mean()).backward()
    params = list(model.parameters())
    norm = scaler.clip_grad_norm_(params, 1e9)  # (no clipping at 1e9)
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.double()) for p in params]))
    torch.testing.assert_close(norm.double(), want / scaler.loss_scale, rtol=1e-5, atol=0)
    assert not old.fp8_grad_norms()
    opt.step()


def test_scaler_steps_fp8adamw_over_an_empty_parameter_as_torch_adamw():
    a = nn.Parameter(torch.randn(0, 4))
    b = nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(0)))
    ref = nn.Parameter(b.detach().clone())
    scaler = FP8GradScaler()
    opt = FP8AdamW([a, b], lr=LR, grad_scaler=scaler)
    scaler.scale_loss(a.sum() + (b * torch.arange(1.0, 5.0)).sum()).backward()
    scaler.step(opt)  # raised: "cannot compute the infinity norm on an empty tensor"
    scaler.update()
    ref.grad = torch.arange(1.0, 5.0)
    torch.optim.AdamW([ref], lr=LR).step()
    torch.testing.assert_close(b.detach(), ref.detach(), rtol=ONE_FP32_STEP_RTOL, atol=ONE_FP32_STEP_ATOL)
    assert a.shape == (0, 4)


def test_scaler_still_skips_a_nonfinite_step_next_to_an_empty_parameter():
    a = nn.Parameter(torch.randn(0, 4))
    b = nn.Parameter(torch.randn(4))
    before = b.detach().clone()
    scaler = FP8GradScaler()
    opt = FP8AdamW([a, b], lr=LR, grad_scaler=scaler)
    scaler.scale_loss(a.sum() + b.sum()).backward()
    b.grad[1] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert torch.equal(b.detach(), before) and scaler.skipped_steps == 1
