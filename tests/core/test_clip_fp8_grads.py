"""Clipping by norm counts and clips the gradients FP8AdamW holds in FP8 (``fp8_grads=True``: ``param.grad`` is None
for the FP8 weights), through their scales. The reference: the same gradients dequantized and clipped as
``torch.nn.utils.clip_grad_norm_`` clips the true gradients, and the step an ``fp8_grads=False`` FP8AdamW takes on
them."""

import copy

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8

MU = 2.0**8


def _model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)).to(device))


def _backward(model: nn.Module, scaler: FP8GradScaler, seed: int = 0, factor: float = 50.0) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(24, 32, generator=gen), torch.randn(24, 16, generator=gen)
    x, y = x.to(model[0].weight.device), y.to(model[0].weight.device)
    scaler.scale_loss(((model(x) - y) ** 2).mean() * factor).backward()


def _gradients(model: nn.Module, opt: FP8AdamW) -> dict[nn.Parameter, torch.Tensor]:
    """Every gradient as fp32 values carrying mu: param.grad, or the held FP8 one dequantized."""
    opt._grad_casts.flush(opt)
    out = {}
    for p in model.parameters():
        entry = opt._pending.get(p)
        out[p] = p.grad.float().clone() if entry is None else entry.data.float() * entry.scale_inv
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_clip_grad_norm_clips_the_gradients_fp8adamw_holds_in_fp8(opt_level, max_norm, device):
    # On CUDA the step is the Triton kernel's, with the clip factor in the gradient's scale_inv (not a power of two).
    model = _model(device)
    scaler = FP8GradScaler(init_scale=MU)
    opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler, opt_level=opt_level, fp8_grads=True)
    _backward(model, scaler)
    assert len(opt.fp8_grad_norms()) == 2 and model[0].weight.grad is None
    before = _gradients(model, opt)
    true_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in before.values()]))
    true_norm = true_norm / MU
    factor = min(1.0, max_norm / (float(true_norm) + 1e-6))
    norm = scaler.clip_grad_norm_(model.parameters(), max_norm)
    torch.testing.assert_close(norm.double(), true_norm, rtol=1e-5, atol=0)
    after = _gradients(model, opt)
    for p, g in before.items():
        torch.testing.assert_close(after[p], g * factor, rtol=2e-6 if p.dtype == torch.float32 else 1e-3, atol=0)
    assert (factor < 1) == (max_norm == 0.5)
    # The step on them: as an fp8_grads=False FP8AdamW steps on the clipped gradients put in param.grad.
    ref_model = _model(device)
    ref_scaler = FP8GradScaler(init_scale=MU)
    ref = FP8AdamW(ref_model.parameters(), lr=1e-2, grad_scaler=ref_scaler, opt_level=opt_level, fp8_grads=False)
    ref_scaler.scale_loss(torch.zeros(()))  # the gradients put below carry mu
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        q.grad = after[p].to(q.dtype)
    assert opt.step() is None and ref.step() is None
    assert scaler.skipped_steps == ref_scaler.skipped_steps == 0
    start = _model(device).state_dict()
    for (name, p), q in zip(model.state_dict().items(), ref_model.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        assert not torch.equal(p, start[name])  # stepped


def test_clipping_after_more_backwards_and_skips_keeps_the_held_gradients_right():
    """Accumulation on top of a clipped FP8 gradient (a backward after the clip) adds to the clipped one, and a
    non-finite held gradient stays non-finite after clipping: the step is skipped."""
    model = _model()
    scaler = FP8GradScaler(init_scale=MU)
    opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler, fp8_grads=True)
    _backward(model, scaler, seed=0)
    scaler.clip_grad_norm_(model.parameters(), 0.01)
    clipped = _gradients(model, opt)
    twin = copy.deepcopy(model)
    twin_scaler = FP8GradScaler(init_scale=MU)
    twin_opt = FP8AdamW(twin.parameters(), lr=1e-2, grad_scaler=twin_scaler, fp8_grads=False)
    _backward(twin, twin_scaler, seed=1)
    _backward(model, scaler, seed=1)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        want = clipped[p] + q.grad.float()
        got = _gradients(model, opt)[p]
        # The sum re-cast to E5M2 (3 significant bits: within a quarter of the largest value).
        assert float((got - want).abs().max()) <= 0.13 * float(want.abs().max()) + 1e-6
    del twin_opt
    weights = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    _backward(model, scaler, seed=2, factor=float("inf"))
    assert not torch.isfinite(scaler.clip_grad_norm_(model.parameters(), 1.0))
    opt.step()
    assert scaler.skipped_steps == 1
    assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights, strict=True))


def test_value_clipping_still_refuses_gradients_held_in_fp8():
    """A value clip cannot go through a scale: it is refused, with what to do, by the integrations (and by the
    scaler's clip_grad_value_: tests/core/test_scaler_clipping_args.py)."""
    from lightning_fp8.integrations.lightning import FP8LMPrecision

    model = _model()
    opt = FP8AdamW(model.parameters(), lr=1e-2, fp8_grads=True)
    with pytest.raises(ValueError, match="clipping by value.*clip by norm"):
        FP8LMPrecision().clip_gradients(opt, clip_val=1.0, gradient_clip_algorithm="value")


@pytest.mark.parametrize("new_fp8_grads", [True, False])
def test_what_an_older_fp8adamw_still_holds_is_not_counted_nor_takes_the_new_gradients(new_fp8_grads):
    """An FP8AdamW made again over the same weights (the older one kept alive with an FP8 gradient of a backward it
    never stepped on) takes their gradients over: clipping counted the older one's too (a wrong norm and factor),
    and with fp8_grads=False folded the new param.grad into it, so the new optimizer's step left the FP8 weights
    alone."""
    model = _model()
    scaler = FP8GradScaler(init_scale=MU)
    old = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)
    _backward(model, scaler, seed=0)
    assert len(old.fp8_grad_norms()) == 2
    new = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler, fp8_grads=new_fp8_grads)
    _backward(model, scaler, seed=1)
    grads = _gradients(model, new)
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads.values()])) / MU
    torch.testing.assert_close(scaler.clip_grad_norm_(model.parameters(), 1e9).double(), want, rtol=1e-5, atol=0)
    assert (model[0].weight.grad is not None) is not new_fp8_grads  # the new gradient stays where the new one keeps it
    weights = [p.detach().clone() for p in model.parameters()]
    new.step()
    assert all(not torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights, strict=True))


def test_the_clip_norm_sums_in_the_parameters_order_in_every_build():
    """The held FP8 gradients' norms were summed in a set's order (a tensor hashes by its id): the same model, data
    and gradients built twice gave clip norms one bit apart for 2 seeds in 10, so a run resumed from a checkpoint
    (new objects) clipped differently from the uninterrupted one."""
    keep = []  # alive: the second build's tensors get other ids

    def clip_norm(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(12)])
        with torch.no_grad():
            for i, layer in enumerate(model):
                layer.weight.mul_(1 + 0.1 * i)
        convert_to_fp8(model, "fp8-lm-e4m3")
        scaler = FP8GradScaler(model=model)
        opt = FP8AdamW(model.parameters(), lr=1e-3, recipe="fp8-lm-e4m3", grad_scaler=scaler)
        keep.append((model, opt, scaler))
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(seed))
        scaler.scale_loss(model(x).square().mean()).backward()
        return scaler.clip_grad_norm_(model.parameters(), 1e-3)

    for seed in range(10):
        assert torch.equal(clip_norm(seed), clip_norm(seed)), seed
