"""FP8MLP (lightning_fp8/mlp.py) where a mutation audit found its fused path unpinned, each against the same
FP8Linear layers called one after another with torch's GELU between them (``proj(F.gelu(fc(x)))``, the module's own
unfused path and the reference test_mlp.py uses) or, for a bias gradient, against its float64 column sums:

- fc's bias as the only trainable part of fc (a backward that cast no output gradient for fc lost that gradient);
- two layers with different recipes, eagerly and compiled (a fused path that cast proj's input, or either output
  gradient, with the other layer's current / delayed mode);
- hooks on a layer send the module unfused, so that they run (the class docstring): a forward pre-hook, and each kind
  of backward hook alone (test_mlp.py registers two kinds at once, either of which sufficed);
- a proj bias of another dtype than fc's keeps its gradient's dtype (it was rounded to fc's bias dtype)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_fp8 import FP8MLP, FP8Linear
from tests.core.test_mlp import SAME_CASTS_SQNR_DB, assert_like_unfused
from tests.numerics import sqnr


def _unfused(mlp: FP8MLP, x: torch.Tensor) -> torch.Tensor:
    return mlp.proj(F.gelu(mlp.fc(x)))


def _steps(fn, mlp, xs, weights):
    """One forward/backward per input in ``xs``, the loss ``sum(y * w)`` with its own ``w`` each step; the last
    output, input gradient and parameter gradients."""
    for x, w in zip(xs, weights, strict=True):
        x = x.detach().clone().requires_grad_(x.requires_grad)
        for p in mlp.parameters():
            p.grad = None
        y = fn(mlp, x)
        (y.float() * w).sum().backward()
    return y, x.grad, {n: None if p.grad is None else p.grad.clone() for n, p in mlp.named_parameters()}


@pytest.mark.parametrize("fp8_hidden", [False, True])
def test_fc_bias_alone_trainable_gets_its_gradient(fp8_hidden):
    # fc's weight frozen and an input without gradient: fc's output gradient is still cast, for fc's bias.
    torch.manual_seed(0)
    mlp = FP8MLP(32, 64, fp8_hidden=fp8_hidden)
    mlp.fc.weight.requires_grad_(False)
    ref = copy.deepcopy(mlp)
    xs = [torch.randn(24, 32) for _ in range(2)]
    ws = [torch.linspace(-1, 1, 32)] * 2
    _, _, grads = _steps(lambda m, v: m(v), mlp, xs, ws)
    _, _, grads_ref = _steps(_unfused, ref, xs, ws)
    assert grads["fc.weight"] is None and grads["fc.bias"] is not None
    # fp8_hidden: the backward sees the GELU's input rounded to FP8 (the class docstring); FP8-accurate still
    bound = 20.0 if fp8_hidden else SAME_CASTS_SQNR_DB
    assert sqnr(grads["fc.bias"], grads_ref["fc.bias"]) > bound
    for name in ("proj.weight", "proj.bias"):
        assert sqnr(grads[name], grads_ref[name]) > bound, name


def test_layers_with_different_recipes_each_cast_with_their_own():
    # fc delayed (fp8-lm), proj current: inputs and loss weights growing 8x a step, so a delayed cast saturates where a
    # current one does not, and each state's scale tells which mode its cast used.
    torch.manual_seed(0)
    fc, proj = FP8Linear(32, 64, recipe="fp8-lm"), FP8Linear(64, 32, recipe="fp8-lm-current")
    mlp = FP8MLP.from_modules(fc, proj)
    ref = copy.deepcopy(mlp)
    xs = [torch.randn(24, 32, requires_grad=True) * 8.0**k for k in range(3)]
    ws = [torch.linspace(-1, 1, 32) * 8.0**k for k in range(3)]
    result, result_ref = _steps(lambda m, v: m(v), mlp, xs, ws), _steps(_unfused, ref, xs, ws)
    for s, r in assert_like_unfused(mlp, ref, result, result_ref):
        torch.testing.assert_close(s.saturation, r.saturation, rtol=0, atol=1e-6)


def test_compiled_layers_with_different_recipes_cast_their_gradients_as_eagerly():
    # Traced, a backward's grad_output cast takes the current / delayed flag its layer's forward read
    # (matmul.grad_output_current): fc's for fc's output gradient, proj's for proj's. Against the eager module (pinned
    # to the unfused layers above).
    torch.manual_seed(0)
    fc, proj = FP8Linear(32, 64, recipe="fp8-lm"), FP8Linear(64, 32, recipe="fp8-lm-current")
    mlp = FP8MLP.from_modules(fc, proj)
    ref = copy.deepcopy(mlp)
    compiled = torch.compile(mlp, backend="aot_eager")
    xs = [torch.randn(24, 32, requires_grad=True) for _ in range(3)]
    ws = [torch.linspace(-1, 1, 32) * 8.0**k for k in range(3)]  # growing: a delayed gradient cast saturates
    result, result_ref = _steps(lambda m, v: compiled(v), mlp, xs, ws), _steps(lambda m, v: m(v), ref, xs, ws)
    for s, r in assert_like_unfused(mlp, ref, result, result_ref):
        torch.testing.assert_close(s.saturation, r.saturation, rtol=0, atol=1e-6)


@pytest.mark.parametrize("layer", ["fc", "proj"])
def test_a_forward_pre_hook_on_a_layer_runs(layer):
    # A pre-hook that halves the layer's input: the module must call the layers one after another, so that it runs.
    torch.manual_seed(0)
    mlp = FP8MLP(32, 64)
    ref = copy.deepcopy(mlp)
    calls = []

    def halve(module, args):
        calls.append(module)
        return (args[0] * 0.5,)

    getattr(mlp, layer).register_forward_pre_hook(halve)
    x = torch.randn(16, 32)
    y = mlp(x)
    y_ref = ref.proj(F.gelu(ref.fc(x * 0.5))) if layer == "fc" else ref.proj(F.gelu(ref.fc(x)) * 0.5)
    assert calls == [getattr(mlp, layer)]
    assert sqnr(y, y_ref) > SAME_CASTS_SQNR_DB


_HOOKS = {
    "backward": lambda layer, fired: layer.register_full_backward_hook(lambda m, gi, go: fired.append(m)),
    "backward_pre": lambda layer, fired: layer.register_full_backward_pre_hook(lambda m, go: fired.append(m)),
}


@pytest.mark.parametrize("kind", sorted(_HOOKS))
@pytest.mark.parametrize("layer", ["fc", "proj"])
def test_a_backward_hook_alone_on_one_layer_runs(kind, layer):
    # One hook of one kind on one layer (test_mlp.py registers two kinds at once, either of which sends the module
    # unfused): it fires once per backward, and the gradients are the unfused layers'.
    torch.manual_seed(0)
    mlp = FP8MLP(32, 64)
    ref = copy.deepcopy(mlp)
    fired = []
    _HOOKS[kind](getattr(mlp, layer), fired)
    xs = [torch.randn(16, 32, requires_grad=True) for _ in range(2)]
    ws = [torch.linspace(-1, 1, 32)] * 2
    y, dx, _ = _steps(lambda m, v: m(v), mlp, xs, ws)
    y_ref, dx_ref, _ = _steps(_unfused, ref, xs, ws)
    assert fired == [getattr(mlp, layer)] * 2
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)


def test_proj_bias_gradient_keeps_its_own_dtype():
    # fc in bf16, proj in fp32: proj's bias gradient is the fp32 column sum of the output gradient, not rounded to bf16.
    torch.manual_seed(0)
    mlp = FP8MLP.from_modules(nn.Linear(32, 64).to(torch.bfloat16), nn.Linear(64, 32))
    x = torch.randn(16, 32)
    w = torch.linspace(-1, 1, 32) / 3  # values bf16 cannot hold
    (mlp(x).float() * w).sum().backward()
    expected = (w.double() * x.shape[0]).float()  # d(sum(y * w))/d(b2) = sum over tokens of w
    assert mlp.proj.bias.grad.dtype == torch.float32 and mlp.fc.bias.grad.dtype == torch.bfloat16
    torch.testing.assert_close(mlp.proj.bias.grad, expected, rtol=1e-6, atol=0)
