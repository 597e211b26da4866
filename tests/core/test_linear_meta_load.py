"""Converted on the meta device, materialized with ``to_empty()`` and loaded from a checkpoint, without
``reset_parameters()`` (the "init empty weights, then load" flow): the scaling states must start fresh, not from the
uninitialized memory ``to_empty()`` hands out (they are not in the state_dict: the load does not fill them)."""

import pytest
import torch
from torch import nn

from lightning_fp8 import ScalingState, convert_to_fp8, fp8_state_dict

# What to_empty() hands out here in place of uninitialized memory, which may hold anything (and often zeros, which
# would hide the bug): a large amax in a history sets the delayed scale of the next casts.
GARBAGE = 3.0e4


def _plain() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


def _garbage_empty_like(t: torch.Tensor, **kwargs) -> torch.Tensor:
    return torch.full_like(t, GARBAGE if t.is_floating_point() else 7, **kwargs)


@pytest.mark.parametrize("assign", [False, True])
def test_to_empty_then_load_equals_cpu_conversion(monkeypatch, assign):
    torch.manual_seed(0)
    sd = _plain().state_dict()
    ref = convert_to_fp8(_plain())
    ref.load_state_dict(sd)
    with torch.device("meta"):
        model = convert_to_fp8(_plain())
    with monkeypatch.context() as patch:  # nn.Module.to_empty calls torch.empty_like for every tensor
        patch.setattr(torch, "empty_like", _garbage_empty_like)
        model.to_empty(device="cpu")
    model.load_state_dict(sd, assign=assign)

    states = [m for m in model.modules() if isinstance(m, ScalingState)]
    assert len(states) == 6
    for state in states:
        assert float(state.scale) == 1.0 and not state.amax_history.any() and int(state.casts) == 0
        assert int(state.nonfinite_count) == 0 and not state.initialized

    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for step in range(4):  # delayed scaling: each step's scales come from the history of the steps before
        x = torch.randn(24, 32) * 10.0 ** (step % 3 - 1)
        outs = [m(x) for m in (model, ref)]
        assert torch.equal(outs[0], outs[1]), step
        for out, opt in zip(outs, opts, strict=True):
            out.square().sum().backward()
            opt.step()
            opt.zero_grad()
    got, want = fp8_state_dict(model), fp8_state_dict(ref)
    assert got.keys() == want.keys()
    for key, value in got.items():
        assert torch.equal(value, want[key]), key
    assert int(model[0].fp8_scaling["input"].casts) == 4 and int(model[0].fp8_scaling["input"].nonfinite_count) == 0


@pytest.mark.parametrize("under_autocast", [False, True])
def test_forward_and_backward_on_meta_give_nn_linears_shapes_and_dtypes(under_autocast):
    # Shape propagation through a model built on the meta device (a parameter count, a memory estimate before
    # materializing): nn.Linear runs there, and so must the FP8 layers (they asked the meta device for its autocast).
    from lightning_fp8 import FP8MLP

    torch.manual_seed(0)
    with torch.device("meta"):
        plain = _plain()
        fp8 = convert_to_fp8(_plain())
        mlp = FP8MLP.from_modules(nn.Linear(32, 64), nn.Linear(64, 32))
        x = torch.randn(2, 5, 32, requires_grad=True)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if under_autocast else torch.autocast("cpu", enabled=False)
    for model in (plain, fp8, mlp):
        with ctx:
            y = model(x)
        y.sum().backward()
        expected = (2, 5, 32 if model is mlp else 16)
        assert (y.device.type, tuple(y.shape), y.dtype) == ("meta", expected, torch.float32)
        assert x.grad.shape == x.shape and x.grad.is_meta
        assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
        x.grad = None


class _TwoParents(nn.Module):
    """One linear layer under two parents (``a.0`` and ``b.1``): ``Module._apply`` visits it once through each."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(32, 32)
        self.a = nn.Sequential(shared, nn.ReLU())
        self.b = nn.Sequential(nn.ReLU(), shared)

    def forward(self, x):
        return self.b(self.a(x))


def test_a_layer_under_two_parents_starts_fresh_after_to_empty(monkeypatch):
    # to_empty()'s first visit reset the states it took off the meta device; its second visit replaced them with
    # uninitialized memory again, which the states kept (a garbage amax history and counters).
    with torch.device("meta"):
        model = convert_to_fp8(_TwoParents())
    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty_like", _garbage_empty_like)
        model.to_empty(device="cpu")
    model.load_state_dict(_TwoParents().state_dict())
    for state in (m for m in model.modules() if isinstance(m, ScalingState)):
        assert float(state.scale) == 1.0 and not state.amax_history.any() and int(state.casts) == 0
        assert not state.initialized and int(state.nonfinite_count) == 0 and float(state.amax) == 0.0


def test_a_state_that_cast_keeps_its_values_when_a_move_replaces_its_buffers():
    model = convert_to_fp8(_TwoParents())
    model(torch.randn(8, 32)).sum().backward()
    before = fp8_state_dict(model)
    model._apply(torch.clone)  # what a move to another device does: new buffers, the same values
    after = fp8_state_dict(model)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before if isinstance(before[k], torch.Tensor))
    assert int(model.a[0].fp8_scaling["input"].casts) == 2  # the layer ran twice
