"""What a mutation audit of state.py and state_values.py found unpinned: the range of scales load_fp8_state_dict takes
(the docstring's "a power of two from 2**-126 to 2**127", which is what the casts' exponent clamp produces: the
reference is the float64 formula 2**clamp(floor(log2(fmax / amax)) - margin, -126, 127)), the saved ``initialized``
flag winning over what the buffers suggest, the inference of that flag for checkpoints written without it ("taken as
initialized when it has cast and its history or scale shows it"), and the rule that a tie between two readings of the
saved names keeps the names as they are. The reference for the flags is the saved model itself, continuing."""

import math

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Linear, FP8Recipe, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.formats import E4M3
from lightning_fp8.scaling import ROLES, ScalingState


def _holder(margin: int) -> nn.ModuleDict:
    """One current-scaled E4M3 state (history 1, as a weight's), under the name ``s``."""
    return nn.ModuleDict({"s": ScalingState(E4M3, 1, margin, "max", False)})


def _pow2_scale(amax: float, fmax: float, margin: int) -> float:
    # The spec's scale in float64: the largest power of two with amax * scale <= fmax, less margin binades, clamped.
    return 2.0 ** min(max(math.floor(math.log2(fmax / amax)) - margin, -126), 127)


@pytest.mark.parametrize(("amax", "margin"), [(3.0e38, 16), (1.0e-38, 0)], ids=["smallest", "largest"])
def test_a_scale_at_the_casts_clamp_round_trips(amax, margin):
    live = _holder(margin)
    x = torch.full((4, 8), amax / 2, dtype=torch.float32)
    x[1, 3] = amax
    live["s"].quantize(x)
    want = _pow2_scale(float(x.abs().max()), 448.0, margin)
    assert want in (2.0**-126, 2.0**127)  # the shape of the case: the clamp's own ends
    assert live["s"].scale.item() == want
    fresh = _holder(margin)
    load_fp8_state_dict(fresh, fp8_state_dict(live))  # a scale the casts produced loads
    assert fresh["s"].scale.item() == want
    assert fresh["s"].initialized


def test_a_scale_below_the_clamp_is_refused():
    live = _holder(0)
    live["s"].quantize(torch.randn(4, 8))
    saved = fp8_state_dict(live)
    saved["s.scale"] = torch.tensor(2.0**-127)  # a power of two fp32 holds (subnormal), which no cast produces
    with pytest.raises(ValueError, match=r"s\.scale.*power of two from 2\*\*-126"):
        load_fp8_state_dict(_holder(0), saved)


@pytest.mark.parametrize(
    ("buffer", "rule"), [("scale", "a power of two"), ("saturation", r"in \[0, 1\]"), ("amax_history", "finite")]
)
def test_a_nan_is_refused_for_what_it_is(buffer, rule):
    # NaN is not equal to itself: the exactness check (fp32 holds NaN) must not report it as a value fp32 cannot hold.
    live = _holder(0)
    live["s"].quantize(torch.randn(4, 8))
    saved = fp8_state_dict(live)
    saved[f"s.{buffer}"] = torch.full_like(saved[f"s.{buffer}"], float("nan"))
    with pytest.raises(ValueError, match=rf"s\.{buffer}' holds \[?nan\]?, but it must be {rule}"):
        load_fp8_state_dict(_holder(0), saved)


def test_a_complex_counter_is_refused_as_not_an_integer():
    # A complex value's real part would fit an int64 counter: it is still not a tensor of the buffer's kind.
    live = _holder(0)
    live["s"].quantize(torch.randn(4, 8))
    saved = {**fp8_state_dict(live), "s.casts": torch.tensor(1 + 0j)}
    fresh = _holder(0)
    with pytest.raises(TypeError, match=r"s\.casts' is a torch.complex64 tensor, expected a torch.int64 tensor"):
        load_fp8_state_dict(fresh, saved)
    assert fresh["s"].casts.item() == 0


def test_a_state_whose_last_cast_saturated_everything_round_trips():
    # A delayed scale from small tensors, then a tensor a million times larger: every value reaches 448.
    live = nn.ModuleDict({"s": ScalingState(E4M3, 4, 0, "max", True)})
    g = torch.Generator().manual_seed(0)
    live["s"].quantize(torch.randn(4, 8, generator=g))
    big = (torch.randn(4, 8, generator=g).abs() + 1.0) * 1e6
    scale = live["s"].scale.item()  # the delayed scale this cast uses
    live["s"].quantize(big)
    want = (big.double() * scale >= 448.0).double().mean().item()  # the fraction clamped to the format's max
    assert want == 1.0
    assert live["s"].saturation.item() == want
    fresh = nn.ModuleDict({"s": ScalingState(E4M3, 4, 0, "max", True)})
    load_fp8_state_dict(fresh, fp8_state_dict(live))  # "a saturation outside [0, 1]" is refused: 1 is inside
    assert fresh["s"].saturation.item() == 1.0


def _layer() -> FP8Linear:
    # History length 1: a cast of zeros rolls the history back to zeros at once.
    return FP8Linear(32, 16, bias=False, recipe=FP8Recipe(amax_history_len=1))


def _step(layer: FP8Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(torch.ones_like(y))
    return y.detach(), x.grad


def _input_of_amax(value: float) -> torch.Tensor:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0)).clamp(-3, 3)
    x[2, 5] = value  # amax 300: scale 2**floor(log2(448 / 300)) = 1, as a state that never cast has
    return x


def _assert_continues_as_live(live: FP8Linear, resumed: FP8Linear) -> None:
    assert resumed.fp8_scaling["input"].initialized == live.fp8_scaling["input"].initialized
    # Far from scale 1's range: a cast with its own amax and one with the delayed scale 1 differ.
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)) * 1e3
    for a, b in zip(_step(live, x), _step(resumed, x), strict=True):
        assert torch.equal(a, b)


def test_the_saved_flag_wins_over_a_history_of_zeros_and_scale_one():
    torch.manual_seed(0)
    live = _layer()
    _step(live, _input_of_amax(300.0))  # initializes the input state, scale 1
    _step(live, torch.zeros(8, 32))  # history [0], scale still 1: the buffers look like a fresh state's
    state = live.fp8_scaling["input"]
    assert state.initialized and not state.amax_history.any() and state.scale.item() == 1.0
    saved = fp8_state_dict(live)
    resumed = _layer()
    resumed.load_state_dict(live.state_dict())
    load_fp8_state_dict(resumed, saved)
    _assert_continues_as_live(live, resumed)


def test_a_checkpoint_without_the_flag_is_initialized_by_its_history_alone():
    torch.manual_seed(0)
    live = _layer()
    _step(live, _input_of_amax(300.0))  # history [300], scale 1
    assert live.fp8_scaling["input"].scale.item() == 1.0
    old = {k: v for k, v in fp8_state_dict(live).items() if not k.endswith(".initialized")}
    resumed = _layer()
    resumed.load_state_dict(live.state_dict())
    load_fp8_state_dict(resumed, old)
    assert resumed.fp8_scaling["input"].initialized  # it has cast, and its history shows it
    _assert_continues_as_live(live, resumed)


def test_a_tie_between_readings_of_the_names_keeps_them_as_they_are():
    """The docstring of _in_model_names: "the reading that maps the most keys ... is taken, the keys as they are on a
    tie". A model with a child named ``module`` holding ``b`` and a layer ``b`` of its own: the saved keys of
    ``module.b`` map to it as they are, and to ``b`` without the leading ``module.``."""
    torch.manual_seed(0)
    source = nn.Module()
    source.module = nn.Module()
    source.module.b = FP8Linear(16, 16)
    source.module.b(torch.randn(4, 16)).sum().backward()
    saved = {k: v for k, v in fp8_state_dict(source).items()}
    assert all(k.startswith("module.b.") for k in saved)
    saved["unrelated.entry"] = torch.zeros(())  # not a state of the model's: the names are read both ways

    model = nn.Module()
    model.module = nn.Module()
    model.module.b = FP8Linear(16, 16)
    model.b = FP8Linear(16, 16)
    load_fp8_state_dict(model, saved, strict=False)
    for role in ROLES:
        assert torch.equal(model.module.b.fp8_scaling[role].scale, source.module.b.fp8_scaling[role].scale)
        assert model.module.b.fp8_scaling[role].casts.item() == 1
        assert model.b.fp8_scaling[role].casts.item() == 0, "the tie went to the stripped reading"


def test_a_load_of_exactly_scale_and_history_pairs_with_the_scaler_load():
    """load_pairing's rule: an FP8 state load that fills a grad_output state's ``scale`` and ``amax_history`` (what its
    next casts use; here with strict=False and nothing else) gives it the saved mu's values, so the scaler load of the
    same checkpoint that follows does not rescale them. The reference is the checkpoint's own values."""
    from tests.core.test_scaler_load_rescale import _checkpoint

    checkpoint, _, model, scaler = _checkpoint()  # saved at mu 4096, live at mu 16
    partial = {
        k: v for k, v in checkpoint["fp8"].items() if ".grad_output." in k and k.endswith((".scale", ".amax_history"))
    }
    assert len(partial) == 4  # two layers' grad_output states
    load_fp8_state_dict(model, partial, strict=False)
    scaler.load_state_dict(checkpoint["scaler"])
    assert scaler.scale == 4096.0
    now = fp8_state_dict(model)
    for key, value in partial.items():
        assert torch.equal(now[key], value), f"{key}: {now[key].tolist()} != saved {value.tolist()}"


def test_a_checkpoint_without_the_flag_of_a_state_that_never_cast_is_not_initialized():
    """The rule "taken as initialized when it has cast and its history or scale shows it": a grad_output state that
    never cast has a scale other than 1 once a scaler load rescaled it to another mu. Loaded from a checkpoint without
    the flag, its first cast must still use its own amax, as the saved model's own next cast (the reference) does."""
    from lightning_fp8 import FP8GradScaler

    torch.manual_seed(0)
    live = FP8Linear(32, 16, bias=False)
    scaler = FP8GradScaler(init_scale=16.0, growth_interval=10**6, model=live)
    scaler.load_state_dict(FP8GradScaler(init_scale=4096.0).state_dict())  # rescales the live states by 256
    state = live.fp8_scaling["grad_output"]
    assert state.casts.item() == 0 and state.scale.item() == 1 / 256 and not state.initialized
    old = {k: v for k, v in fp8_state_dict(live).items() if not k.endswith(".initialized")}
    resumed = FP8Linear(32, 16, bias=False)
    resumed.load_state_dict(live.state_dict())
    load_fp8_state_dict(resumed, old)
    assert not resumed.fp8_scaling["grad_output"].initialized
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)
    for layer in (live, resumed):
        layer.zero_grad()
    xs = [x.clone().requires_grad_() for _ in range(2)]
    live(xs[0]).backward(dy)
    resumed(xs[1]).backward(dy)
    assert torch.equal(xs[0].grad, xs[1].grad) and torch.equal(live.weight.grad, resumed.weight.grad)
