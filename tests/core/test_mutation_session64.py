"""FP8AdamW's hyper-parameter checks and FP8GradScaler's torch.amp calls, from a mutation audit of today's changes
(optim/step.py, grad_scaler.py, grad_scaling/arguments.py, grad_scaling/unscaling.py).

Each test kills mutants the existing tests let survive:

- ``_check_one_element``: ``value.numel() != 1`` -> ``> 1`` (a tensor without elements failed in ``float()`` with
  torch's words, not naming the value).
- ``check_new_scale``: ``numel() != 1`` -> ``> 1`` (an empty tensor failed in ``.item()``); the floating-point check
  dropped (an integer tensor taken); the ``bool`` check dropped (``update(True)`` set mu to 1); ``min_scale <=`` ->
  ``<`` and ``<= max_scale`` -> ``<`` (the bounds, documented as included, refused).
- ``FP8GradScaler._step_or_skip``: ``_step_through_public_step(wrapper, ...)`` -> ``(optimizer, ...)`` (a wrapped
  FP8AdamW stepped past its wrapper's ``step()``).
- ``_inner_optimizer``: ``while`` -> one unwrapping (a wrapper of a wrapper of an FP8AdamW unscaled twice).
- ``_step_through_public_step``: the ``finally`` clearing the wrapper's attribute instead of the FP8AdamW's (the next
  ``optimizer.step()`` of the FP8AdamW unscaled by the old mu, past the scaler).
"""

import copy
import math
import re

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler
from tests.core.test_routes_grad_scaler import _Wrapper  # an optimizer wrapper as Accelerate's and Lightning's

pytestmark = pytest.mark.usefixtures("one_thread")

MU0 = 2.0**6


def _param() -> nn.Parameter:
    return nn.Parameter(torch.randn(4, 4))


# --------------------------------------------------------------------------------------------- FP8AdamW's checks
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"lr": torch.tensor([])}, "lr"),
        ({"eps": torch.tensor([])}, "eps"),
        ({"weight_decay": torch.tensor([])}, "weight_decay"),
        ({"betas": (torch.tensor([]), 0.999)}, "betas[0]"),
        ({"betas": (0.9, torch.tensor([]))}, "betas[1]"),
    ],
    ids=["lr", "eps", "weight_decay", "beta1", "beta2"],
)
def test_a_hyper_parameter_tensor_without_elements_is_refused_naming_it(kwargs, name):
    """torch.optim.AdamW refuses a tensor hyper-parameter without elements; FP8AdamW refuses it naming the value, as
    it names one of two elements."""
    with pytest.raises((ValueError, RuntimeError)):
        torch.optim.AdamW([_param()], **kwargs)
    with pytest.raises(ValueError, match=rf"tensor {re.escape(name)} must have one element, got shape \(0,\)"):
        FP8AdamW([_param()], **kwargs)


# ------------------------------------------------------------------------------------ FP8GradScaler.update(new_scale)
def _stepped_scaler(**kwargs) -> FP8GradScaler:
    """A scaler after one finite SGD step, its update still to make."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    scaler = FP8GradScaler(init_scale=MU0, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale_loss(model(torch.randn(8, 4)).square().mean()).backward()
    scaler.step(opt)
    return scaler


@pytest.mark.parametrize(
    "new_scale",
    [torch.tensor([]), True],
    ids=["empty tensor", "bool"],
)
def test_update_refuses_a_new_scale_torch_amp_refuses_before_anything_changes(new_scale):
    """torch.amp.GradScaler.update refuses a tensor without elements (its assertion) and a bool (no ``.device``);
    FP8GradScaler refuses them with a TypeError naming the value, mu and history as they were."""
    reference = torch.amp.GradScaler("cpu", init_scale=MU0)
    reference.scale(torch.ones(()))
    with pytest.raises((AssertionError, AttributeError)):
        reference.update(new_scale)
    scaler = _stepped_scaler()
    with pytest.raises(TypeError, match="new_scale"):
        scaler.update(new_scale)
    assert scaler.get_scale() == MU0 and scaler.history == ()


def test_update_refuses_an_integer_tensor_as_torch_amp_documents_a_float_tensor():
    """torch.amp's contract (its message): "new_scale should be a float or a 1-element ... FloatTensor"; FP8GradScaler
    documents a one-element floating-point tensor and refuses an integer one (which would be an integer mu)."""
    scaler = _stepped_scaler()
    with pytest.raises(TypeError, match="one floating-point element"):
        scaler.update(torch.tensor(2**10))
    assert scaler.get_scale() == MU0 and scaler.history == ()
    scaler.update(torch.tensor(2.0**10))
    assert scaler.get_scale() == 2.0**10


@pytest.mark.parametrize("bound", ["min_scale", "max_scale"])
def test_update_takes_either_bound_of_min_scale_max_scale(bound):
    """``update(new_scale)``: "a power of two within [min_scale, max_scale]" (the docs), both bounds included."""
    scaler = _stepped_scaler(min_scale=2.0**-4, max_scale=2.0**12)
    value = getattr(scaler, bound)
    scaler.update(value)
    assert scaler.get_scale() == value
    assert [(e["action"], e["scale"]) for e in scaler.history] == [("set", value)]


# ------------------------------------------------------------------------------------------ optimizer wrappers
def _fp8adamw_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16))


@pytest.mark.parametrize("depth", [1, 2], ids=["wrapper", "wrapper of a wrapper"])
def test_scaler_step_of_a_wrapped_fp8adamw_runs_the_wrappers_step_as_torch_amp(depth):
    """torch.amp.GradScaler.step(wrapper) runs ``wrapper.step()`` (Accelerate's and Lightning's wrappers do their own
    work there; Lightning's can hold Accelerate's); FP8GradScaler.step of a wrapped FP8AdamW does too, once, and steps
    as the FP8AdamW given alone (unscaled once)."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    reference = _Wrapper(torch.optim.AdamW(nn.Linear(2, 2).parameters()))
    amp = torch.amp.GradScaler("cpu", init_scale=MU0)
    amp.scale(sum(p.sum() for p in reference.optimizer.param_groups[0]["params"])).backward()
    amp.step(reference)
    assert reference.steps == 1
    weights = []
    for wrap in (False, True):
        model = _fp8adamw_model()
        scaler = FP8GradScaler(init_scale=MU0)
        opt = FP8AdamW(model.parameters(), lr=0.01, grad_scaler=scaler)
        stepped = opt
        for _ in range(depth if wrap else 0):
            stepped = _Wrapper(stepped)
        scaler.scale_loss(model(x).square().mean()).backward()
        assert scaler.step(stepped) is True
        scaler.update()
        if wrap:
            assert stepped.steps == 1 and (depth == 1 or stepped.optimizer.steps == 1)
        weights.append(copy.deepcopy(model.state_dict()))
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key


def test_a_wrapped_step_leaves_the_fp8adamw_to_route_its_next_step_through_the_scaler():
    """After ``scaler.step(wrapper of FP8AdamW(grad_scaler=scaler))``, the FP8AdamW's own ``step()`` goes through the
    scaler again (unscaled by the current mu, its non-finite check run): the run matches one without the wrapper."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    runs = []
    for wrap in (False, True):
        model = _fp8adamw_model()
        scaler = FP8GradScaler(init_scale=MU0, growth_interval=1)
        opt = FP8AdamW(model.parameters(), lr=0.01, grad_scaler=scaler)
        scaler.scale_loss(model(x).square().mean()).backward()
        scaler.step(_Wrapper(opt) if wrap else opt)
        scaler.update()
        opt.zero_grad()
        for i in range(2):
            loss = model(x).square().mean()
            scaler.scale_loss(loss * math.inf if i == 1 else loss).backward()
            opt.step()  # the FP8AdamW's own route: step, then update
            opt.zero_grad()
        runs.append((copy.deepcopy(model.state_dict()), scaler.get_scale(), scaler.skipped_steps))
    (a, mu_a, skipped_a), (b, mu_b, skipped_b) = runs
    assert mu_a == mu_b and skipped_a == skipped_b == 1
    for key in a:
        assert torch.equal(a[key], b[key]), key
