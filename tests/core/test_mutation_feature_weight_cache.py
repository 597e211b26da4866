"""The FP8 weight copy of FP8AdamW(emit_fp8_weights=True) (lightning_fp8/weight_cache.py) where a mutation audit found
its rules unpinned, against what the module docstring states and the forward's own cast of the weight (the reference:
``ScalingState.quantize`` of the weight with its master scale, or the same forward with every copy dropped):

- a copy is valid only for the stored values it was made from, the master scale's in-place changes included (a
  validity check that ignored the scale's version counter passed the suite);
- an emitting step of another margin than the copy's makes a copy of its own margin, which the forwards then use (one
  that rewrote the old copy kept its old margin, and no forward used it again);
- the copy of a non-finite weight records what its cast records, a history entry of 0 included (a copy that wrote its
  amax, inf, into the history passed the suite)."""

import copy

import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8Recipe, convert_to_fp8, fp8_modules, weight_cache
from lightning_fp8.optim import master
from lightning_fp8.scaling import ScalingState
from tests.core.test_weight_cache import cast_and_copy_runs


def _model(recipe=None):
    torch.manual_seed(0)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)), recipe=recipe)


def _step(model, opt, x):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _served(model):
    return [weight_cache.lookup(m.weight, m.fp8_scaling["weight"]) is not None for m in fp8_modules(model).values()]


def _cast(layer):
    """The forward's cast of ``layer``'s weight (the reference), on a copy of its weight state."""
    state = copy.deepcopy(layer.fp8_scaling["weight"])
    return state.quantize(layer.weight, False, True, master.master_scale(layer.weight))


def _counting(monkeypatch):
    calls = []
    original = ScalingState.quantize

    def quantize(self, x, *args, **kwargs):
        calls.append(self)
        return original(self, x, *args, **kwargs)

    monkeypatch.setattr(ScalingState, "quantize", quantize)
    return calls


def test_an_in_place_change_of_the_master_scale_invalidates_the_copy(monkeypatch):
    # O2 (fp16 masters): the weight is its storage times 1 / scale. Doubling the scale in place halves the weight the
    # stored values stand for: the copy, made for the old scale, no longer holds its cast, and the forward casts.
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=1e-2, scale_update="two_pass", emit_fp8_weights=True, opt_level="O2")
    x = torch.randn(24, 32)
    _step(model, opt, x)
    assert _served(model) == [True, True]
    layer = model[0]
    scale = master.master_scale(layer.weight)
    assert scale is not None and scale.dtype == torch.float32
    with torch.no_grad():
        scale.mul_(2.0)
    assert _served(model) == [False, True]
    calls = _counting(monkeypatch)
    with torch.no_grad():
        y = model(x)
    assert layer.fp8_scaling["weight"] in calls  # cast again
    for p in model.parameters():  # the reference: the forward with every copy dropped casts both weights
        weight_cache.drop(p)
    with torch.no_grad():
        y_ref = model(x)
    assert torch.equal(y, y_ref)


def test_a_step_of_another_margin_makes_a_copy_the_forwards_use(monkeypatch):
    # The layers' weight states have margin 1; a first optimizer (the default recipe: margin 0) writes copies of
    # margin 0, which the forwards do not use (another margin than the state's). A second optimizer with the layers'
    # margin writes copies of margin 1: the forwards use those, and they are the forward's cast of the weight.
    model = _model(FP8Recipe(margin=1))
    x = torch.randn(24, 32)
    first = FP8AdamW(model.parameters(), lr=1e-2, scale_update="two_pass", emit_fp8_weights=True)
    _step(model, first, x)
    assert _served(model) == [False, False]
    second = FP8AdamW(model.parameters(), lr=1e-2, scale_update="two_pass", emit_fp8_weights=True,
                      recipe=FP8Recipe(margin=1))  # fmt: skip
    _step(model, second, x)
    assert _served(model) == [True, True]
    for layer in fp8_modules(model).values():
        copy_ = weight_cache.lookup(layer.weight, layer.fp8_scaling["weight"])
        ref_fp8, _, ref_scale_inv = _cast(layer)
        assert copy_.margin == 1
        assert torch.equal(copy_.data.view(torch.uint8), ref_fp8.view(torch.uint8))
        assert torch.equal(copy_.scale_inv, ref_scale_inv)
    calls = _counting(monkeypatch)
    with torch.no_grad():
        model(x)
    weight_states = {id(m.fp8_scaling["weight"]) for m in fp8_modules(model).values()}
    assert not any(id(s) in weight_states for s in calls)  # served by the copies


def test_the_copy_of_a_non_finite_weight_records_what_its_cast_records():
    # A NaN loss makes every weight NaN in the step. The forward's record of such a weight (cast or copy): amax inf, a
    # history entry of 0 (no information: module docstring of record_into, DESIGN.md), a non-finite count, the scale
    # kept. The copy's record is the cast's, buffer for buffer.
    x, runs = cast_and_copy_runs()
    stats = {}
    for emit, model in runs:
        opt = FP8AdamW(model.parameters(), lr=1e-2, scale_update="two_pass", emit_fp8_weights=emit)
        (model(x).sum() * float("nan")).backward()
        opt.step()
        assert all(m.weight.isnan().all() for m in fp8_modules(model).values())
        assert _served(model) == [emit, emit]
        with torch.no_grad():
            model(x)
        stats[emit] = [dict(m.fp8_scaling["weight"].named_buffers()) for m in fp8_modules(model).values()]
    for cast, copied in zip(stats[False], stats[True], strict=True):
        assert float(cast["amax_history"][0]) == 0.0 and int(cast["nonfinite_count"]) == 1
        for key, value in cast.items():
            torch.testing.assert_close(copied[key], value, rtol=0, atol=0, equal_nan=True, msg=key)
