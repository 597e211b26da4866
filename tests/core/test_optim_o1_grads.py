"""FP8AdamW at O1 holds the FP8Linear weights' gradients in FP8 (E5M2 + per-tensor scale), as at O2: 13 bytes per
parameter (docs/concepts/optimizer.md). Checked against the project's reference cast (kernels/reference.py) and
against O1 with ``fp8_grads=False`` fed the dequantized FP8 gradient, bit for bit."""

import copy

import pytest
import torch
from lightning_fp8.kernels import adamw as adamw_kernels
from lightning_fp8.kernels import reference_adamw
from lightning_fp8.kernels.reference import quantize_ref
from lightning_fp8.kernels.reference_grad_cast import grad_cast_state_buffers, new_grad_cast_state
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, FP8Recipe, convert_to_fp8
from lightning_fp8.formats import E5M2
from lightning_fp8.optim import master

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _model(seed=0):
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)))


def _fp8_weights(model):
    return [p for p in model.parameters() if master.is_fp8_weight(p)]


def _others(model):
    return [p for p in model.parameters() if not master.is_fp8_weight(p)]


def _backward(model, x, y, scaler=None, factor=1.0):
    loss = ((model(x) - y) ** 2).mean() * factor
    (scaler.scale_loss(loss) if scaler is not None else loss).backward()


def _quantize(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The project's reference FP8 gradient cast (current scaling, E5M2, margin 0): ``(g_fp8, scale_inv)``."""
    buffers = grad_cast_state_buffers(new_grad_cast_state(g.device))
    g_fp8, _, scale_inv = quantize_ref(g.float().contiguous(), *buffers, E5M2, 0, True, False, True, False)
    return g_fp8, scale_inv.reshape(())


def _dequantized(g: torch.Tensor) -> torch.Tensor:
    g_fp8, scale_inv = _quantize(g)
    return (g_fp8.float() * scale_inv).to(g.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(_bits(a), _bits(b))


def _assert_same_params_and_states(opt_a, opt_b):
    params_a = [p for g in opt_a.param_groups for p in g["params"]]
    params_b = [p for g in opt_b.param_groups for p in g["params"]]
    for p, q in zip(params_a, params_b, strict=True):
        _same(p, q)
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        for key, value in opt_a.state[p].items():
            _same(value, opt_b.state[q][key])


@pytest.mark.parametrize("bucket_mb", [0, 64])
@pytest.mark.parametrize("spelling", ["opt_level", "recipe"])
def test_o1_holds_fp8_weight_gradients_in_fp8(bucket_mb, spelling):
    model = _model()
    level = {"opt_level": "O1"} if spelling == "opt_level" else {"recipe": "fp8-lm-o1"}
    opt = FP8AdamW(model.parameters(), lr=1e-2, grad_cast_bucket_mb=bucket_mb, **level)
    assert opt.opt_level == "O1" and opt.fp8_grads
    _backward(model, torch.randn(8, 32), torch.randn(8, 16))
    for p in _fp8_weights(model):
        assert p.dtype == torch.float32  # O1: the weight keeps its storage (the fp32 master)
        assert p.grad is None
        entry = opt._pending[p]
        assert entry.data.dtype == E5M2 == FP8Recipe(opt_level="O1").backward_dtype
        assert entry.data.shape == p.shape and entry.scale_inv.dtype == torch.float32 and entry.scale_inv.dim() == 0
    for p in _others(model):  # biases keep their fp32 gradients
        assert p.grad is not None and p.grad.dtype == torch.float32 and p not in opt._pending
    assert len(opt._grad_casts) == 0  # the end of the backward flushed the queue


@pytest.mark.parametrize("bucket_mb", [0, 64])
def test_o1_step_equals_the_step_on_the_dequantized_fp8_gradient_bit_for_bit(bucket_mb):
    # Twin models: O1 holding FP8 gradients, and O1 with fp8_grads=False fed the reference cast's dequantized
    # gradient. The FP8 gradients equal the reference cast's bits, and two steps give the same bits everywhere.
    model_a = _model()
    model_b = copy.deepcopy(model_a)
    opt_a = FP8AdamW(model_a.parameters(), lr=1e-2, weight_decay=0.1, opt_level="O1", grad_cast_bucket_mb=bucket_mb)
    opt_b = FP8AdamW(model_b.parameters(), lr=1e-2, weight_decay=0.1, opt_level="O1", fp8_grads=False)
    ref = copy.deepcopy(model_b)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        x, y = torch.randn(8, 32), torch.randn(8, 16)
        for m, o in ((model_a, opt_a), (model_b, opt_b)):
            o.zero_grad()
            _backward(m, x, y)
        for p, q in zip(_fp8_weights(model_a), _fp8_weights(model_b), strict=True):
            g_fp8, scale_inv = _quantize(q.grad)
            _same(opt_a._pending[p].data, g_fp8)
            _same(opt_a._pending[p].scale_inv, scale_inv)
            q.grad = _dequantized(q.grad)
        for p, q in zip(_others(model_a), _others(model_b), strict=True):
            _same(p.grad, q.grad)
        ref_opt.zero_grad()
        for r, q in zip(ref.parameters(), model_b.parameters(), strict=True):
            r.grad = q.grad.clone()
        opt_a.step()
        opt_b.step()
        ref_opt.step()
        _assert_same_params_and_states(opt_a, opt_b)
        # And that is AdamW on the FP8 gradient (O1's fp32 states: a few ulp of operation order).
        for p, r in zip(model_a.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
    for p in _fp8_weights(model_a):
        assert opt_a.state[p]["exp_avg"].dtype == opt_a.state[p]["exp_avg_sq"].dtype == torch.float32


def test_o1_step_through_the_triton_kernel_equals_the_reference(monkeypatch):
    # The fused kernel (under the interpreter on CPU) with fp32 master and moments and an E5M2 gradient with its
    # scale_inv (no state scales), against the PyTorch reference, bit for bit; with the gradient scaler's unscale.
    launched, real = [], adamw_kernels.adamw_step

    def recording(params, grads, *args, **kwargs):
        launched.append((params[0].dtype, grads[0].dtype, args[4] is not None))  # (target, grad, grad_scale_inv)
        return real(params, grads, *args, **kwargs)

    monkeypatch.setattr(adamw_kernels, "adamw_step", recording)
    runs = []
    for kernels in ("reference", "triton"):
        monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
        model = _model()
        scaler = FP8GradScaler(init_scale=2.0**6)
        opt = FP8AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, opt_level="O1", grad_scaler=scaler)
        torch.manual_seed(1)
        x, y = torch.randn(8, 32), torch.randn(8, 16)
        _backward(model, x, y, scaler)
        assert all(opt._pending[p].data.dtype == E5M2 for p in _fp8_weights(model))
        opt.step()
        runs.append(opt)
    _assert_same_params_and_states(*runs)
    assert (torch.float32, E5M2, True) in launched and (torch.float32, torch.float32, False) in launched


@pytest.mark.gpu
@pytest.mark.parametrize("copies", [False, True], ids=["fp32_param", "bf16_param"])
def test_kernel_o1_fp8_gradient_combination_on_gpu(copies):
    # The launch an O1 step makes for FP8Linear weights: fp32 master and moments (no state scales, two passes) and
    # an E5M2 gradient with its scale_inv (HAS_GSI), with a bf16 parameter copy for a bf16 model; compiled on a GPU.
    from tests.kernels.test_adamw import SHAPES, _assert_same, _make, _run

    dtypes = (torch.float32, torch.float32, torch.float32, E5M2)
    tensors = _make("cuda", [*SHAPES, (1000, 333)], dtypes, scaled=False, fp8_grads=True, copies=copies)
    kw = {"scaled": False, "fp8_grads": True, "copies": copies, "two_pass": True}
    _assert_same(_run(reference_adamw.adamw_step_ref, tensors, **kw), _run(adamw_kernels.adamw_step, tensors, **kw))


@pytest.mark.parametrize("bucket_mb", [0, 64])
def test_o1_accumulation_over_two_micro_batches(bucket_mb):
    # The second micro-batch is added to the dequantized pending FP8 gradient and cast again (the O2 semantics): the
    # reference cast of (dequantized cast of g1) + g2, bit for bit; close to the single batch's gradient; and the
    # step equals the step on that dequantized gradient.
    model_a = _model()
    model_b = copy.deepcopy(model_a)
    model_full = copy.deepcopy(model_a)
    opt_a = FP8AdamW(model_a.parameters(), lr=1e-2, opt_level="O1", grad_cast_bucket_mb=bucket_mb)
    opt_b = FP8AdamW(model_b.parameters(), lr=1e-2, opt_level="O1", fp8_grads=False)
    x, y = torch.randn(16, 32), torch.randn(16, 16)
    micro = [(x[:8], y[:8]), (x[8:], y[8:])]
    g1 = None
    for i, (xm, ym) in enumerate(micro):
        _backward(model_a, xm, ym, factor=0.5)
        _backward(model_b, xm, ym, factor=0.5)
        if i == 0:
            g1 = [q.grad.clone() for q in _fp8_weights(model_b)]
    _backward(model_full, x, y)
    for p, q, first, full in zip(_fp8_weights(model_a), _fp8_weights(model_b), g1, _fp8_weights(model_full),
                                 strict=True):  # fmt: skip
        assert p.grad is None
        second = q.grad - first  # what the second micro-batch added (exact: q.grad = first + second, in fp32)
        expected = _dequantized(first) + second
        g_fp8, scale_inv = _quantize(expected)
        _same(opt_a._pending[p].data, g_fp8)
        _same(opt_a._pending[p].scale_inv, scale_inv)
        got = opt_a._pending[p].data.float() * opt_a._pending[p].scale_inv
        # The single batch's gradient, up to the FP8 roundings (E5M2: 2**-3 relative, twice; FP8 GEMMs per batch).
        amax = full.grad.abs().max()
        torch.testing.assert_close(got, full.grad, rtol=0.3, atol=float(amax) * 2**-4)
        q.grad = (g_fp8.float() * scale_inv).to(q.dtype)
    opt_a.step()
    opt_b.step()
    _assert_same_params_and_states(opt_a, opt_b)


def test_o1_nonfinite_fp8_gradient_skips_the_step_with_the_grad_scaler():
    model = _model()
    scaler = FP8GradScaler(init_scale=2.0**4, model=model)
    opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler, opt_level="O1")
    x, y = torch.randn(24, 32), torch.randn(24, 16)
    _backward(model, x, y, scaler)
    opt.step()  # a clean step creates the states
    before = [p.detach().clone() for p in model.parameters()]
    steps = [float(opt.state[p]["step"]) for p in model.parameters()]
    opt.zero_grad()
    x_bad = x.clone()
    x_bad[3, 7] = float("nan")
    _backward(model, x_bad, y, scaler)
    weights = _fp8_weights(model)
    assert all(p.grad is None and not torch.isfinite(opt._pending[p].amax) for p in weights)
    opt.step()
    assert scaler.skipped_steps == 1 and scaler.history[-1]["action"] == "skip"
    assert float(scaler.scale) == 2.0**3
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert [float(opt.state[p]["step"]) for p in model.parameters()] == steps
    assert set(opt.skipped_grad_amax) == set(weights) and not opt._pending
    assert all(not torch.isfinite(a) for a in opt.skipped_grad_amax.values())
    opt.zero_grad()
    _backward(model, x, y, scaler)
    opt.step()  # the next clean step goes through
    assert scaler.skipped_steps == 1 and not torch.equal(weights[0], before[0])


def test_o1_without_fp8_grads_keeps_gradients_in_param_grad():
    model_a = _model()
    model_b = copy.deepcopy(model_a)
    opt_a = FP8AdamW(model_a.parameters(), lr=1e-2, opt_level="O1", fp8_grads=False)
    ref_opt = torch.optim.AdamW(model_b.parameters(), lr=1e-2)
    assert not opt_a._hooks
    x, y = torch.randn(8, 32), torch.randn(8, 16)
    _backward(model_a, x, y)
    _backward(model_b, x, y)
    for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert p.grad.dtype == torch.float32
        _same(p.grad, q.grad)
    assert not opt_a._pending
    opt_a.step()
    ref_opt.step()
    for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


def test_o1_fp8_gradients_only_for_trained_fp8linear_weights():
    # fp8_params (no FP8 GEMMs) and frozen weights keep their gradients as they are, as at O2.
    model = _model()
    extra = nn.Parameter(torch.randn(5, 3))
    model[2].weight.requires_grad_(False)
    opt = FP8AdamW([*model.parameters(), extra], lr=1e-2, opt_level="O1", fp8_params=[extra])
    assert set(opt._hooks) == {model[0].weight}
    later = _model(seed=1)
    opt.add_param_group({"params": list(later.parameters())})
    assert set(opt._hooks) == {model[0].weight, later[0].weight, later[2].weight}
    _backward(model, torch.randn(8, 32), torch.randn(8, 16))
    (extra.sum() * 2).backward()
    assert model[0].weight.grad is None and model[0].weight in opt._pending
    assert model[2].weight.grad is None and model[2].weight not in opt._pending
    assert extra.grad.dtype == torch.float32 and extra not in opt._pending
    opt.step()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_o1_zero_grad_drops_the_fp8_gradients(set_to_none):
    model = _model()
    scaler = FP8GradScaler(init_scale=2.0**4)
    opt = FP8AdamW(model.parameters(), lr=1e-2, opt_level="O1", grad_scaler=scaler, grad_cast_bucket_mb=64)
    x, y = torch.randn(8, 32), torch.randn(8, 16)
    _backward(model, x, y, scaler)
    opt.step()
    _backward(model, x * 100, y, scaler)  # discarded
    assert opt._pending
    opt.zero_grad(set_to_none=set_to_none)
    assert not opt._pending and len(opt._grad_casts) == 0
    for p in _fp8_weights(model):
        assert p.grad is None if set_to_none else torch.equal(p.grad, torch.zeros_like(p))
    # The next gradient is the new backward's alone (a zero param.grad accumulates, then the hook takes it).
    twin = copy.deepcopy(model)
    twin_opt = FP8AdamW(twin.parameters(), lr=1e-2, opt_level="O1", fp8_grads=False)
    _backward(model, x, y, scaler)
    _backward(twin, x, y, scaler)
    for p, q in zip(_fp8_weights(model), _fp8_weights(twin), strict=True):
        assert p.grad is None
        _same(opt._pending[p].data, _quantize(q.grad)[0])
    assert twin_opt._pending == {}


def test_o1_release_hands_the_gradient_back_and_removes_the_hook():
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=1e-2, opt_level="O1", grad_cast_bucket_mb=64)
    weight = model[2].weight
    x, y = torch.randn(8, 32), torch.randn(8, 16)
    _backward(model, x, y)
    entry = opt._pending[weight]
    expected = entry.data.float() * entry.scale_inv
    opt.release(weight)
    assert weight not in opt._hooks and weight not in opt._pending
    assert weight.grad is not None and weight.grad.dtype == torch.float32 and torch.equal(weight.grad, expected)
    opt.step()
    opt.zero_grad()
    _backward(model, x, y)  # no hook any more: the gradient stays in param.grad
    assert weight.grad is not None and weight.grad.dtype == torch.float32 and weight not in opt._pending
    assert model[0].weight.grad is None and model[0].weight in opt._pending


def test_o1_bf16_fallback_releases_the_weight():
    # The recovery puts a layer back to nn.Linear after repeated non-finite gradients; its weight's gradients then
    # stay in param.grad (fp32), the other FP8 weight keeps its FP8 gradients.
    from lightning_fp8 import FP8Linear

    model = _model()
    scaler = FP8GradScaler(nonfinite_fallback=model, fallback_after=2)
    opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler, opt_level="O1")
    x, y = torch.randn(24, 32), torch.randn(24, 16)
    for _ in range(2):
        opt.zero_grad()
        hidden = model[1](model[0](x)).detach()  # only the last layer gets (non-finite) gradients
        scaler.scale_loss(((model[2](hidden) - y) ** 2).mean() * float("inf")).backward()
        opt.step()
    assert isinstance(model[0], FP8Linear) and type(model[2]) is nn.Linear
    assert model[2].weight not in opt._hooks and model[0].weight in opt._hooks
    opt.zero_grad()
    _backward(model, x, y, scaler)
    assert model[2].weight.grad.dtype == torch.float32 and model[0].weight.grad is None
    opt.step()
    assert scaler.skipped_steps == 2


def test_o1_state_dict_flushes_queued_gradients():
    # A gradient queued outside a backward (no end-of-backward flush) is accumulated onto the pending FP8 gradient
    # before the state dict is taken.
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=1e-2, opt_level="O1", grad_cast_bucket_mb=64)
    weight = model[0].weight
    _backward(model, torch.randn(8, 32), torch.randn(8, 16))
    entry = opt._pending[weight]
    extra = torch.randn_like(weight)
    expected = _quantize(entry.data.float() * entry.scale_inv + extra)[0]
    opt._grad_casts.put(opt, weight, extra)
    assert len(opt._grad_casts) == 1
    opt.state_dict()
    assert len(opt._grad_casts) == 0
    _same(opt._pending[weight].data, expected)
