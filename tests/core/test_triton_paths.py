"""The Triton paths (a GPU's; on the CPU forced with LIGHTNING_FP8_KERNELS=triton, under TRITON_INTERPRET=1) against
the reference paths: their host code traced by torch.compile, and valid inputs that one path took and the other
refused or shaped differently."""

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8MLP, FP8AdamW, FP8Linear, ScalingState, ops


def test_out_of_modes_sight_traces_under_torch_compile():
    # Found by running tests/core with LIGHTNING_FP8_KERNELS=triton: a compiled backward's recast of the input's
    # transposed copy (ops.recast_transposed, on a GPU's Triton path) entered ops.out_of_modes_sight, whose
    # dispatch-stack query dynamo cannot trace ("torch.* op returned non-Tensor"): compiled FP8Linear backwards
    # on that path failed. Under the interpreter the traced Triton ops themselves cannot run on fake tensors (no
    # wrap_triton), so the CPU test traces the context manager alone; the GPU test below runs the layers.
    def f(x):
        with ops.out_of_modes_sight():
            return x * 2

    torch._dynamo.reset()
    x = torch.randn(4)
    assert torch.equal(torch.compile(f, backend="eager", fullgraph=True)(x), x * 2)
    torch._dynamo.reset()


def _forward_backward(layer: nn.Module, x: torch.Tensor, compiled: bool) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    fn = torch.compile(layer, backend="eager", fullgraph=True) if compiled else layer
    y = fn(x)
    (y * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum().backward()
    return [y.detach(), x.grad, *(p.grad for p in layer.parameters())]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_compiled_backward_on_the_triton_paths_equals_eager(kind):
    # The layers of the test above, compiled on a GPU (its Triton paths) against eager.
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        layer = (FP8Linear(32, 16) if kind == "linear" else FP8MLP(32, 64)).cuda()
        results.append(_forward_backward(layer, torch.randn(16, 32, device="cuda"), compiled))
    for i, (got, want) in enumerate(zip(results[1], results[0], strict=True)):
        assert torch.equal(got, want), i
    torch._dynamo.reset()


@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize("unscale_shape", [(), (1,), (1, 1)], ids=["0d", "1", "1x1"])
def test_a_one_element_unscale_of_any_shape_casts_as_a_0_dim_one(kernels, unscale_shape, monkeypatch):
    # Found by running the Triton path against the reference: ScalingState.quantize takes any one-element unscale
    # (check_unscale), which the Triton kernels read as a scalar; the reference divided the 0-dim last amax by a (1,)
    # one in place, a RuntimeError ("output with shape [] doesn't match the broadcast shape [1]") after the cast had
    # written the history.
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
    torch.manual_seed(0)
    x = torch.randn(3, 16)
    results = []
    for shape in ((), unscale_shape):
        state = ScalingState(torch.float8_e4m3fn, 1, 0, "max", False)
        x_fp8, _, scale_inv = state.quantize(x, unscale=torch.full(shape, 0.25))
        results.append((x_fp8.view(torch.uint8), scale_inv, *state.cast_buffers()))
    for i, (got, want) in enumerate(zip(results[1], results[0], strict=True)):
        assert got.shape == want.shape and torch.equal(got, want), i


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_non_contiguous_fp8_gradient_handed_over_steps_on_the_triton_path(opt_level, monkeypatch):
    # Found by probing the Triton paths: accumulate_fp8_grad keeps a first FP8 gradient as it is, and a transposed
    # view of one (a reduced buffer laid out the other way) reached the fused step, which reads its tensors by address:
    # "adamw_step: the tensors of grads must be contiguous", where the reference path stepped.
    results = []
    for kernels in ("reference", "triton"):
        monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
        torch.manual_seed(0)
        layer = FP8Linear(48, 32)
        opt = FP8AdamW(layer.parameters(), lr=1e-2, opt_level=opt_level)
        grad_fp8 = torch.randn(48, 32).to(torch.float8_e5m2).t()
        opt.accumulate_fp8_grad(layer.weight, grad_fp8, torch.tensor(0.5))
        layer.bias.grad = torch.randn(32)
        opt.step()
        results.append([p.detach().clone() for p in layer.parameters()])
    for i, (got, want) in enumerate(zip(results[1], results[0], strict=True)):
        assert torch.equal(got, want), i


def test_a_meta_model_propagates_shapes_with_the_triton_kernels_forced(monkeypatch):
    # Found by the sweep with LIGHTNING_FP8_KERNELS=triton: a model built on the meta device (a parameter count, a
    # memory estimate) runs its forward and backward there, as nn.Linear does. Forced Triton launched the casts on
    # tensors without data: "NotImplementedError: Cannot copy out of meta tensor; no data!" (on a GPU, the same
    # forced mode read their addresses), where the default mode takes the references' ops.
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", "triton")
    with torch.device("meta"):
        layers = (FP8Linear(32, 16), FP8MLP(32, 64))
        x = torch.randn(4, 32, requires_grad=True)
    for layer in layers:
        y = layer(x)
        y.sum().backward()
        assert y.is_meta and x.grad.shape == x.shape and all(p.grad.is_meta for p in layer.parameters())
        x.grad = None
    assert not ops.use_triton(torch.empty(2, device="meta"))


@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_a_cast_under_a_torch_func_transform_says_why_it_cannot_run(kernels, transform, monkeypatch):
    # Found by probing the Triton paths: FP8Linear and FP8MLP refuse torch.func transforms with a message that says why,
    # ScalingState.quantize did not. Its Triton path failed with "Cannot access storage of BatchedTensorImpl" (of
    # TensorWrapper under grad), the reference path with functorch's in-place errors; neither said a word of FP8.
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
    state = ScalingState(torch.float8_e4m3fn, 4, 0, "max", True)
    if transform == "vmap":
        fn = torch.func.vmap(lambda t: state.quantize(t)[0].float())
        x = torch.randn(3, 4, 32)
    else:
        fn = torch.func.grad(lambda t: state.quantize(t)[0].float().sum())
        x = torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="ScalingState.quantize does not support torch.func transforms"):
        fn(x)
    assert int(state.casts) == 0 and not state.initialized
