"""A layer with ``in_features=0`` has an output (its bias on every token) and so an output gradient, though its input
is empty. Compiled, its output gradient's scaling state follows the eager rule (the reference: the same layer run
eagerly): the first informative gradient cast marks it initialized and the later casts use the delayed scale. The
traced forward marks the role for the backward it cannot mark itself (matmul.note_casts); it marked nothing where the
input was empty, so compiled, every gradient cast took its own amax for good (FP8Linear and FP8MLP's fc)."""

import copy

import pytest
import torch

from lightning_fp8 import FP8MLP, FP8Linear

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny tensor ops on one thread


def _grad_output_states(layers) -> list:
    return [
        (s.initialized, s.scale.clone(), s.amax_history.clone(), s.saturation.clone())
        for s in (layer.fp8_scaling["grad_output"] for layer in layers)
    ]


def _run(model, layers, step) -> list:
    """Three steps whose output gradient grows 64x, then shrinks: a delayed scale saturates the second step's cast,
    a cast with its own amax does not. The states after each step."""
    seen = []
    for magnitude in (1.0, 64.0, 0.25):
        x = torch.randn(2, 3, 0, requires_grad=True)
        step(x, magnitude)
        seen.append(_grad_output_states(layers))
    return seen


def _assert_same(eager: list, compiled: list) -> None:
    for step, (want, got) in enumerate(zip(eager, compiled, strict=True)):
        for layer, (w, g) in enumerate(zip(want, got, strict=True)):
            assert g[0] == w[0], f"step {step}, layer {layer}: initialized {g[0]}, eagerly {w[0]}"
            for name, a, b in zip(("scale", "amax_history", "saturation"), g[1:], w[1:], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"step {step}, layer {layer}: {name}")


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_compiled_output_gradient_state_follows_eager_without_input_features(kind):
    torch.manual_seed(0)
    if kind == "linear":
        eager = FP8Linear(0, 32)
        with torch.no_grad():
            eager.bias.normal_()
    else:
        eager = FP8MLP(0, 64, 32)
        with torch.no_grad():
            eager.fc.bias.normal_()
    compiled = copy.deepcopy(eager)
    w = torch.linspace(-1, 1, 32)

    def step_of(model):
        forward = model if model is eager else torch.compile(model, backend="aot_eager")

        def step(x, magnitude):
            (forward(x) * (w * magnitude)).sum().backward()

        return step

    def layers(model):
        return [model] if kind == "linear" else [model.fc, model.proj]

    want = _run(eager, layers(eager), step_of(eager))
    assert all(state[0] for state in want[0]), "eagerly the first gradient casts initialize the states"
    assert want[1][0][3].item() > 0, "eagerly the second step's delayed scale saturates (the test's premise)"
    _assert_same(want, _run(compiled, layers(compiled), step_of(compiled)))
