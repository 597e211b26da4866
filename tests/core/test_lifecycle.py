"""The lifecycle of a converted model and its optimizer: what users do to a model between building it and training it
(and after), probed through the public names."""

import copy

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, convert_to_fp8


def _model(seed=0):
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)))


# ----------------------------------------------------------------------------------------- torch.inference_mode()
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_parameters_made_under_inference_mode_are_refused_clearly_and_nothing_changes(opt_level):
    """A model built under inference_mode has inference-tensor parameters, which torch cannot train. FP8AdamW (O2)
    failed in its gradient-accumulator probe with AttributeError: 'NoneType' object has no attribute
    'next_functions'; now both levels say what is wrong before any weight changes."""
    with torch.inference_mode():
        model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"parameter 0 of parameter group 0.*created under torch.inference_mode"):
        FP8AdamW(model.parameters(), lr=1e-2, opt_level=opt_level)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_frozen_parameters_made_under_inference_mode_are_left_as_torch_adamw_leaves_them():
    """A frozen backbone built under inference_mode beside a head that trains: torch.optim.AdamW never steps the
    frozen parameters, and neither does FP8AdamW."""
    with torch.inference_mode():
        backbone = _model()
    backbone.requires_grad_(False)
    head = convert_to_fp8(nn.Linear(16, 16))
    model = nn.Sequential(backbone, head)
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    frozen = {k: v.clone() for k, v in backbone.state_dict().items()}
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    assert all(torch.equal(frozen[k], v) for k, v in backbone.state_dict().items())
    assert head.weight.dtype == torch.float16  # the head trains at O2


def _train(model, opt, seed, steps=2):
    torch.manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _after(how, opt_level, inference):
    """A model and its FP8AdamW after ``how`` ran under torch.inference_mode(inference), then two more steps."""
    model = _model()
    first = list(model[0].parameters()) if how == "add_param_group" else list(model.parameters())
    if how == "constructor with a gradient":  # a backward before the optimizer: its first step applies it
        torch.manual_seed(1)
        model(torch.randn(8, 32)).square().mean().backward()
        with torch.inference_mode(inference):
            opt = FP8AdamW(model.parameters(), lr=1e-2, opt_level=opt_level)
    else:
        opt = FP8AdamW(first, lr=1e-2, opt_level=opt_level)
        _train(model, opt, seed=1)
        saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
        _train(model, opt, seed=2, steps=1)
        if how != "add_param_group":  # whose layer takes in the gradients its backwards left (handed over as FP8)
            model.zero_grad()
        with torch.inference_mode(inference):
            if how == "load_state_dict":
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
            elif how == "add_param_group":
                opt.add_param_group({"params": list(model[2].parameters())})
            elif how == "release_weights":
                opt.release_weights()
            else:
                opt.release(model[0].weight)
    assert not any(t.is_inference() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    assert not any(p.is_inference() for p in model.parameters())
    _train(model, opt, seed=3)
    return model.state_dict()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize(
    "how", ["load_state_dict", "add_param_group", "release_weights", "release", "constructor with a gradient"]
)
def test_what_the_optimizer_does_under_inference_mode_trains_on_as_outside_it(how, opt_level):
    """An evaluation loop under torch.inference_mode() that rolls back to a checkpoint, unfreezes layers, releases the
    weights or builds the optimizer: torch.optim.AdamW steps on afterwards. FP8AdamW made its states there (step
    counts, moments, the gradient handed over, at O2 the released weights' storage) as inference tensors, and its next
    forward or step outside failed ("Inplace update to inference tensor outside InferenceMode is not allowed")."""
    outside, inside = (_after(how, opt_level, inference) for inference in (False, True))
    assert all(torch.equal(outside[k], inside[k]) for k in outside)
