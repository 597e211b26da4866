"""Resuming from fp8_state_dict casts exactly as continuing would: the saved state includes whether each role's next
delayed cast uses its amax history (ScalingState.initialized), which the buffers cannot always tell. A cast of an
all-zero tensor (amax 0: a history of zeros and scale 1, as before any cast) leaves it unset."""

import io

import pytest
import torch

from lightning_fp8 import FP8Linear, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.scaling import ROLES


def _round_trip(state: dict) -> dict:
    """``state`` through torch.save and torch.load(weights_only=True), as a checkpoint."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _step(layer: FP8Linear, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One forward and backward; ``(y, dx, dw)``."""
    layer.zero_grad()
    xg = x.clone().requires_grad_()
    y = layer(xg)
    y.backward(dy)
    return y.detach(), xg.grad, layer.weight.grad.clone()


def _zero_step_then_resume() -> tuple[FP8Linear, FP8Linear]:
    """A layer whose first step cast an all-zero input and output gradient, and a fresh layer loaded from its
    checkpoint."""
    torch.manual_seed(0)
    live = FP8Linear(32, 16, bias=False)
    _step(live, torch.zeros(8, 32), torch.zeros(8, 16))
    saved = _round_trip({"model": live.state_dict(), "fp8": fp8_state_dict(live)})
    torch.manual_seed(1)
    resumed = FP8Linear(32, 16, bias=False)
    resumed.load_state_dict(saved["model"])
    load_fp8_state_dict(resumed, saved["fp8"])
    return live, resumed


def test_resume_after_an_all_zero_cast_matches_continuing_bit_for_bit():
    live, resumed = _zero_step_then_resume()
    # Continuing is the reference: its casts after the zero step use the (zero) history, the delayed path.
    for role in ROLES:
        assert resumed.fp8_scaling[role].initialized == live.fp8_scaling[role].initialized, role
    g = torch.Generator().manual_seed(2)
    for i in range(4):
        # Magnitudes far from scale 1's range, so that the first-cast path (own amax) and the delayed path differ.
        x, dy = torch.randn(8, 32, generator=g) * 1e3, torch.randn(8, 16, generator=g) * 1e-6
        for a, b, name in zip(_step(live, x, dy), _step(resumed, x, dy), ("y", "dx", "dw"), strict=True):
            assert torch.equal(a, b), f"step {i}: {name} differs between continuing and resuming"
        want, got = fp8_state_dict(live), fp8_state_dict(resumed)
        assert want.keys() == got.keys()
        for key, value in want.items():
            assert torch.equal(value, got[key]), f"step {i}: {key} {value.tolist()} != {got[key].tolist()}"


def test_initialized_is_saved_as_a_plain_integer_tensor():
    fresh = FP8Linear(32, 16)
    live, _ = _zero_step_then_resume()
    # After a step of all-zero inputs and gradients only the weight's cast (a random weight) carried information.
    flags = {"input": 0, "weight": 1, "grad_output": 0}
    for layer, want in ((fresh, dict.fromkeys(ROLES, 0)), (live, flags)):
        saved = _round_trip(fp8_state_dict(layer))
        for role in ROLES:
            t = saved[f"fp8_scaling.{role}.initialized"]
            assert t.dtype == torch.int64 and t.shape == () and t.item() == want[role], (role, want)


def test_checkpoint_without_the_flag_infers_it_as_before():
    """Written before ``initialized`` was saved: a state that cast is initialized once its history or scale shows it;
    one whose only casts were of all-zero (or empty) tensors is not, and its next cast uses its own amax."""
    live, _ = _zero_step_then_resume()
    g = torch.Generator().manual_seed(3)
    _step(live, torch.zeros(8, 32), torch.randn(8, 16, generator=g))  # the input: zeros again; grad_output: not
    old = {k: v for k, v in fp8_state_dict(live).items() if not k.endswith(".initialized")}
    loaded = FP8Linear(32, 16, bias=False)
    load_fp8_state_dict(loaded, _round_trip(old))
    assert not loaded.fp8_scaling["input"].initialized  # history of zeros, scale 1
    assert loaded.fp8_scaling["grad_output"].initialized  # an amax in its history
    assert loaded.fp8_scaling["weight"].initialized  # its own scale (not 1) from the random weight


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (torch.tensor(2), ValueError),
        (torch.tensor(-1), ValueError),
        (torch.tensor(1.0), TypeError),
        (torch.tensor([1, 1]), TypeError),
        (True, TypeError),
    ],
)
def test_a_bad_flag_is_refused_and_nothing_loads(value, error):
    live, _ = _zero_step_then_resume()
    saved = {**fp8_state_dict(live), "fp8_scaling.input.initialized": value}
    model = FP8Linear(32, 16, bias=False)
    before = fp8_state_dict(model)
    with pytest.raises(error, match="fp8_scaling.input.initialized"):
        load_fp8_state_dict(model, saved)
    after = fp8_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(model.fp8_scaling[role].initialized for role in ROLES)
