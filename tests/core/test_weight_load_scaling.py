"""Weights loaded into a converted model that has already run (pretrained weights after a sanity forward, another
checkpoint evaluated in the same process): the layers' input and grad_output casts start fresh, as in a model that
never ran. The delayed scales of the old activations saturated the first casts after the load (outputs 96% off a
float64 reference for the first forward, one layer further each forward). The FP8 state of a checkpoint loaded with
the weights (load_fp8_state_dict after them, or before them with no cast between) is kept: a resume is unchanged."""

import copy

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, FP8Recipe, convert_to_fp8, fp8_state_dict, load_fp8_state_dict
from tests.numerics import sqnr


def _model(seed: int, gain: float = 1.0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(gain)
    return model


def _float64(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return copy.deepcopy(model).double()(x.double())


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_weights_of_another_range_loaded_after_forwards_give_fp8_accurate_outputs(opt_level):
    pretrained = _model(1, gain=8.0)  # weights (and so activations and gradients) 8 to 8**3 times the model's
    model = convert_to_fp8(_model(0), FP8Recipe(opt_level=opt_level))
    opt = FP8AdamW(model.parameters(), lr=1e-3, opt_level=opt_level)
    for _ in range(3):  # histories of the old weights' activations and gradients
        model(torch.randn(16, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model.load_state_dict(pretrained.state_dict())
    x = torch.randn(16, 32)
    out = model(x)
    ref = _float64(pretrained, x)
    assert sqnr(out.double(), ref) > 20  # E4M3 rounding of inputs and weights: ~25-30 dB; stale scales: < 1 dB
    for layer in (model[0], model[2], model[4]):  # the input casts measured the new activations
        assert not bool(layer.fp8_scaling["input"].saturation)


def test_gradients_after_the_load_are_fp8_accurate():
    pretrained = _model(1, gain=8.0)
    model = convert_to_fp8(_model(0))
    model(torch.randn(16, 32)).square().mean().backward()
    model.zero_grad()
    model.load_state_dict(pretrained.state_dict())
    x = torch.randn(16, 32)
    model(x).square().mean().backward()
    ref = copy.deepcopy(pretrained).double()
    ref(x.double()).square().mean().backward()
    assert sqnr(model[0].weight.grad.double(), ref[0].weight.grad) > 15  # E5M2 gradients


@pytest.mark.parametrize("fp8_first", [False, True], ids=["weights_then_fp8_state", "fp8_state_then_weights"])
def test_a_checkpoints_fp8_state_loaded_with_its_weights_is_kept_in_either_order(fp8_first):
    saved = convert_to_fp8(_model(1))
    scaler = FP8GradScaler()
    for _ in range(3):
        scaler.scale_loss(saved(torch.randn(16, 32) * 4).square().mean()).backward()
    ckpt = copy.deepcopy({"model": saved.state_dict(), "fp8": fp8_state_dict(saved)})
    model = convert_to_fp8(_model(0))
    model(torch.randn(16, 32)).square().mean().backward()  # a state of its own, which both loads replace
    if fp8_first:
        load_fp8_state_dict(model, ckpt["fp8"])
        model.load_state_dict(ckpt["model"])
    else:
        model.load_state_dict(ckpt["model"])
        load_fp8_state_dict(model, ckpt["fp8"])
    for key, value in fp8_state_dict(model).items():
        assert torch.equal(value, ckpt["fp8"][key]), key
    x = torch.randn(16, 32)
    assert torch.equal(model(x), saved(x))


def test_a_cast_between_the_fp8_state_and_the_weights_ends_the_pairing():
    ckpt_model = convert_to_fp8(_model(1))
    ckpt_model(torch.randn(16, 32)).sum().backward()
    model = convert_to_fp8(_model(0))
    load_fp8_state_dict(model, fp8_state_dict(ckpt_model))
    model(torch.randn(16, 32) * 1e3)  # a cast after that load: its histories are this forward's now
    model.load_state_dict(_model(2).state_dict())
    for layer in (model[0], model[2], model[4]):
        assert int(layer.fp8_scaling["input"].casts) == 0 and not layer.fp8_scaling["input"].initialized


def test_a_load_without_the_weight_keeps_the_state():
    model = convert_to_fp8(_model(0))
    model(torch.randn(16, 32)).sum().backward()
    before = fp8_state_dict(model)
    model.load_state_dict({"0.bias": torch.zeros(64)}, strict=False)
    after = fp8_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_load_torch_refuses_for_a_shape_keeps_the_state():
    model = convert_to_fp8(_model(0))
    model(torch.randn(16, 32)).sum().backward()
    before = fp8_state_dict(model)
    bad = {**model.state_dict(), "2.weight": torch.zeros(3, 3)}
    with pytest.raises(RuntimeError, match="size mismatch"):
        model.load_state_dict(bad)
    after = fp8_state_dict(model)
    for key in (k for k in before if k.startswith("2.")):  # the layer whose weight did not load
        assert torch.equal(before[key], after[key]), key


def test_a_state_reset_since_a_checkpoint_load_is_not_taken_for_the_loaded_one():
    # A checkpoint's FP8 state loaded (cast counts 3), forwards, other weights (a reset), as many forwards as the
    # loaded count: the checkpoint's weights loaded again then must start fresh, not keep the tiny inputs' history.
    saved = convert_to_fp8(_model(1))
    for _ in range(3):
        saved(torch.randn(16, 32))
    ckpt = copy.deepcopy({"model": saved.state_dict(), "fp8": fp8_state_dict(saved)})
    model = convert_to_fp8(_model(0))
    model.load_state_dict(ckpt["model"])
    load_fp8_state_dict(model, ckpt["fp8"])
    for _ in range(2):
        model(torch.randn(16, 32))
    model.load_state_dict(_model(2).state_dict())
    for _ in range(3):
        model(torch.randn(16, 32) * 1e-3)
    model.load_state_dict(ckpt["model"])
    state = model[0].fp8_scaling["input"]
    assert int(state.casts) == 0 and not state.initialized
    x = torch.randn(16, 32)
    assert sqnr(model(x).double(), _float64(_model(1), x)) > 20
