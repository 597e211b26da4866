"""A mutation audit of this session's library changes (``git diff e81c69d b442eec -- lightning_fp8 kernels``): 67 hand
mutants, each run against the tests most likely to kill it, then against this file (and
tests/distributed/test_mutation_session66.py, 2 gloo processes, for enable_fp8_fsdp1).

Killed by existing tests (42):

- grad_scaling/arguments.py ``_check_scale``: power-of-two check dropped
  (test_grad_scaler.py::test_bad_arguments_raise); ``MIN_MU <=`` -> ``<`` (test_mutation_monitor_scaler_args.py); ``<=
  MAX_MU`` -> ``<`` (test_grad_scaler.py). ``need_model and`` dropped, the call's ``need_model=False`` -> ``True``
  (test_grad_scaler_settings.py's bf16 test); default ``need_model=True`` -> ``False`` (test_bad_arguments_raise).
  ``_Settings.__setattr__``: ``"_history" in`` -> ``not in``, the check dropped (test_grad_scaler_settings.py).
  ``checked_setting``: ``None if _model_from_integration else model`` -> ``model`` and the flipped condition; ``name in
  ("min_scale", "max_scale")`` -> ``== "min_scale"``; the ``low, high`` condition flipped; ``settings[name] = value``
  dropped; ``type(err)`` -> ``ValueError``; ``scaler.model = model`` dropped; ``kind(value)`` dropped; ``process_group``
  left out of SETTINGS (all test_grad_scaler_settings.py).
- grad_scaling/model.py ``_refuse_fallback_without_model``: ``is None`` -> ``is not None``, ``and`` -> ``or``; its call
  in step() dropped (test_grad_scaler_settings.py).
- distributed/fsdp.py: the ``_refuse_hybrid_sharding`` call dropped, or moved after the layouts are recorded
  (test_routes_fsdp1.py -k hybrid; also the distributed file here).
- state_values.py: the history hint without ``value.dim() == buf.dim() == 1``; ``numel() == 1`` -> ``!= 1``; ``~same``
  -> ``same``; "it would be" of ``saved``; ``[index]`` -> ``[0]``; the scale's mantissa check dropped; saturation ``<=
  1`` -> ``< 1``; history ``< inf`` -> ``<= inf``; ``v >= 0`` -> ``v > 0``; ``good.all()`` -> ``good.any()``
  (test_routes_scaling.py). scaling.py: ``as_choice(algo)`` -> ``algo`` (test_routes_scaling.py).
- linear.py: ``_unparametrizing(self)`` dropped from register_parameter; its ``parametrizations`` branch dropped
  (test_routes_module_protocol.py). convert.py: ``isinstance(layer, nn.Linear)`` flipped (test_routes_hugging_face.py).
- kernels: ``tl.maximum(n, 1.0)`` -> ``n`` (test_routes_kernels.py, the empty weight); ``_scalar`` without the reshape,
  or a copy (``.clone()``: the scales' writes lost); the ``grad_scale_invs`` and ``pending_scale_inv`` reshapes dropped;
  the reference cast's ``scale.detach()`` dropped (test_routes_kernels.py).

Equivalent (6):

- ``"_history" in self.__dict__`` -> ``"_model" in``: __init__ sets ``_model`` after every setting, and unpickling fills
  ``__dict__`` without ``__setattr__``: both mean "constructed" at every assignment.
- ``_check_arguments(scaler._scale, ...)`` -> ``(settings["min_scale"], ...)``: mu is within the bounds (checked just
  before for a new bound; update and load_state_dict keep it there), so the init_scale checks pass either way.
- state_values ``_entry(stored, ~good)`` -> ``_entry(saved, ~good)``: reached only once ``stored`` holds ``saved``
  exactly (or both NaN), and ``.item()`` gives the same Python number of either.
- adamw_finalize ``tl.maximum(n, 1.0)`` -> ``tl.maximum(n, 2.0)``: differs for n = 1 only, and a one-element copy never
  saturates (its own value sets the scale; a non-finite value is not counted), so 0 / 1 == 0 / 2.
- reference_adamw: the emit bound from ``amaxes[i][0]`` (a (1,) view) instead of ``state_amaxes[0]``:
  ``stored_amax_ref`` reduces it to 0-dim before use; ``amaxes[i][j].copy_`` in place of ``state_amaxes[j].copy_``: the
  0-dim view writes the same storage.

Killed by the tests below (18; C02 / C03 by the distributed file):

- ``_check_scale``'s ``isinstance(value, bool) or`` dropped (True taken as 1.0).
- ``if low <= high`` -> ``<`` (equal bounds called an inverted range); ``not low <= mu <= high`` -> strict (a bound
  equal to mu refused, which the constructor takes).
- ``from None`` -> ``from err`` (the constructor's message shown twice, as the cause).
- ``scaler.model = model`` -> ``scaler._model = model`` (the module stays "an integration's": replaced at the next fit).
- SETTINGS ``fallback_after: int`` -> None, ``min_scale: float`` -> None (np.int64 / int stored).
- step(): the refusal moved after the first-step records (the no-model warning spent on a refused step).
- state_values ``_entry``: ``nonzero()[0]`` -> ``[-1]`` (the last bad entry named, not the first).
- linear.py: the WeightNorm hook's ``name == "weight"`` dropped; ``name == "weight"`` dropped from register_parameter's
  mark (a weight tied around a reparametrized bias taken as the FP8 weight).
- convert.py: the ``nn.Linear`` re-raise dropped (a filter's own typo blamed on Conv1D); ``from err`` -> ``from None``;
  ``except AttributeError`` -> ``except Exception`` (a Conv1D's KeyError turned into an AttributeError).
- reference_adamw: the one-pass bound from ``amaxes[i][j]`` (not the 0-dim view), ``_scalar`` dropped for the amaxes
  (one-element amaxes of shape (1,) / (1, 1) refused or mis-broadcast where the kernel steps).
- fsdp.py ``"HYBRID" in name`` -> ``== "HYBRID_SHARD"``; ``FSDP.fsdp_modules(model)`` -> ``[model]``.

Survived, not a gap (1): ``type(hook).__name__ == "WeightNorm" and`` dropped from ``_unparametrizing``: the mutant
differed from the code for the legacy ``SpectralNorm`` hook (``name == "weight"`` too), where the mutant was right. It
pointed at the first bug below.

Real bugs found (no mutation), both in linear.py's new ``_unparametrizing`` / ``FP8Linear.register_parameter``, fixed
since (the two tests below that say "A real bug" failed before the fix):

1. ``nn.utils.remove_spectral_norm`` registers a new Parameter (as ``remove_weight_norm``) while its ``SpectralNorm``
   pre-hook is still there; only ``WeightNorm`` was looked for, so FP8AdamW trained that FP8Linear's weight as a plain
   fp32 parameter without a word.
2. Any ``parametrizations`` on the layer counted: a plain Parameter (another module's, tied) assigned to the weight
   while the bias is parametrized was marked as the FP8 weight, and FP8AdamW at O2 made the other module's weight its
   fp16 master. The fix: a weight is marked as undone only where none is registered (torch unregisters a
   reparametrized weight; a tied assignment replaces a registered one), and both legacy hooks are looked for.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import lightning_fp8.warnings
from lightning_fp8 import FP8GradScaler, FP8Linear, FP8Recipe, convert_to_fp8, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.optim import FP8AdamW, master

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------- FP8GradScaler settings
@pytest.mark.parametrize("name", ["init_scale", "min_scale", "max_scale"])
def test_a_bool_scale_is_refused_as_not_a_number_when_constructed_and_when_set(name):
    # True passes as 1.0 (a power of two within the bounds) where bool is not excluded; the documented rule: a number.
    with pytest.raises(TypeError, match=rf"FP8GradScaler\({name}=True\): must be a number"):
        FP8GradScaler(**{name: True})
    if name != "init_scale":  # init_scale is no setting
        scaler = FP8GradScaler()
        with pytest.raises(TypeError, match=rf"^FP8GradScaler\.{name} = True: .*must be a number"):
            setattr(scaler, name, True)
        assert (scaler.min_scale, scaler.max_scale) == (2.0**-24, 2.0**24)


def test_bounds_equal_to_mu_are_taken_as_the_constructor_takes_them():
    constructed = FP8GradScaler(init_scale=128.0, min_scale=128.0, max_scale=128.0)
    scaler = FP8GradScaler(init_scale=128.0)
    scaler.max_scale = 128
    scaler.min_scale = 128
    got = (scaler.min_scale, scaler.get_scale(), scaler.max_scale)
    assert got == (constructed.min_scale, constructed.get_scale(), constructed.max_scale) == (128.0, 128.0, 128.0)


def test_equal_bounds_that_leave_mu_outside_name_mu_not_an_inverted_range():
    # [256, 256] is a range (min_scale <= max_scale): what is wrong is mu, 128, outside it.
    scaler = FP8GradScaler(init_scale=128.0, max_scale=256.0)
    with pytest.raises(ValueError, match=r"min_scale = 256: mu is 128\.0, outside \[min_scale, max_scale\] = "
                                         r"\[256, 256\.0\]: bring mu within them"):  # fmt: skip
        scaler.min_scale = 256
    assert scaler.min_scale == 2.0**-24


@pytest.mark.parametrize(
    ("name", "value"), [("fallback_after", np.int64(2)), ("min_scale", 1), ("growth_interval", np.int32(3))]
)
def test_a_setting_is_stored_as_the_constructor_stores_it(name, value):
    constructed, scaler = FP8GradScaler(**{name: value}), FP8GradScaler()
    setattr(scaler, name, value)
    assert getattr(scaler, name) == getattr(constructed, name)
    assert type(getattr(scaler, name)) is type(getattr(constructed, name)) in (int, float)


def test_a_refused_setting_raises_one_error_not_a_chain_of_two():
    scaler = FP8GradScaler()
    with pytest.raises(
        ValueError, match=r"^FP8GradScaler\.fallback_after = 0: FP8GradScaler\(fallback_after=0\)"
    ) as info:
        scaler.fallback_after = 0
    # One error in the traceback: the constructor's message is inside it, not shown again as its cause.
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_a_module_set_as_the_fallback_over_an_integration_s_model_stays_when_an_integration_gives_another():
    # As FP8GradScaler(nonfinite_fallback=model): the module is the user's model, which an integration does not replace
    # (_take_model: "A model the user gave (model=, or set since) is the user's and stays").
    model, _ = _model_and_batch()
    scaler = FP8GradScaler()
    scaler._take_model(nn.Linear(4, 4))
    scaler.nonfinite_fallback = model
    scaler._take_model(nn.Linear(4, 4))  # a later fit, or a later prepare
    assert scaler.model is model and scaler.nonfinite_fallback == "bf16"


def _model_and_batch():
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16)))
    return model, torch.randn(8, 32)


def test_a_step_refused_for_bf16_without_a_model_leaves_the_first_step_warning_to_the_step_that_runs(monkeypatch):
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    model, x = _model_and_batch()
    scaler = FP8GradScaler()
    scaler.nonfinite_fallback = "bf16"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale_loss(model(x).sum()).backward()
    with warnings.catch_warnings(record=True) as refused:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="no model to put layers back in"):
            scaler.step(optimizer)
    assert not refused, [str(w.message) for w in refused]  # refused before anything: no first-step warning either
    scaler.nonfinite_fallback = "lower_lr"
    with pytest.warns(UserWarning, match="FP8GradScaler has no model"):
        assert scaler.step(optimizer)


# ------------------------------------------------------------------------------------------------ scaling-state loads
def test_the_refusal_of_a_history_names_its_first_bad_entry():
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 16)), recipe=FP8Recipe(amax_history_len=16))
    saved = fp8_state_dict(model)
    history = torch.zeros(16)
    history[[5, 9, 12]] = torch.tensor([-1.0, -2.0, math.inf])
    saved["0.fp8_scaling.input.amax_history"] = history
    first = int(torch.nonzero(~((history >= 0) & torch.isfinite(history)))[0])
    with pytest.raises(ValueError, match=rf"holds -1\.0 at index {first} \(of \(16,\)\), but it must be finite"):
        load_fp8_state_dict(model, saved)


# ------------------------------------------------------------------------------------------------ FP8Linear weights
def _weight_norm_on_the_bias(layer: nn.Module, how: str, tie=None) -> None:
    """Weight norm put on ``layer``'s bias and removed; ``tie()`` (another module's weight assigned to the layer's)
    called while it is on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
        if how == "legacy":
            nn.utils.weight_norm(layer, name="bias")
        else:
            nn.utils.parametrizations.weight_norm(layer, name="bias")
        if tie is not None:
            tie()
        if how == "legacy":
            nn.utils.remove_weight_norm(layer, name="bias")
        else:
            parametrize.remove_parametrizations(layer, "bias")


@pytest.mark.parametrize(("how", "when"), [("legacy", "while"), ("legacy", "before"), ("parametrizations", "before")])
def test_a_weight_tied_around_a_reparametrized_bias_stays_a_plain_weight(how, when):
    # Only the weight torch registers while undoing *its* reparametrization is the layer's own: a plain Parameter
    # assigned to the weight (another module's, tied) stays plain (trained in high precision; its storage is not an O2
    # master's), whatever reparametrizes the bias. (("parametrizations", "while"): the real bug pinned below.)
    layer, other = FP8Linear(32, 16), nn.Linear(32, 16)

    def tie():
        layer.weight = other.weight

    if when == "before":
        tie()
    _weight_norm_on_the_bias(layer, how, tie if when == "while" else None)
    assert layer.weight is other.weight and not master.is_fp8_weight(other.weight)


def test_a_weight_tied_while_a_parametrization_is_on_the_bias_stays_a_plain_weight():
    """A real bug (fixed): ``_unparametrizing`` answers True for any layer holding ``parametrizations``, so a
    plain Parameter assigned to the weight while the *bias* is parametrized (another module's weight, tied) is marked
    as the layer's FP8 weight, and FP8AdamW at O2 turns that other module's weight into its fp16 master."""
    layer, other = FP8Linear(32, 16), nn.Linear(32, 16)

    def tie():
        layer.weight = other.weight

    _weight_norm_on_the_bias(layer, "parametrizations", tie)
    assert layer.weight is other.weight and not master.is_fp8_weight(other.weight)
    FP8AdamW(layer.parameters(), lr=1e-2)
    assert other.weight.dtype == torch.float32


def test_spectral_norm_removed_after_conversion_leaves_an_fp8_weight_for_fp8adamw():
    """A real bug (fixed): ``nn.utils.remove_spectral_norm`` registers a new Parameter holding the computed weight
    (as ``remove_weight_norm`` does) while its ``SpectralNorm`` pre-hook is still there, but ``_unparametrizing`` looks
    for ``WeightNorm`` alone: FP8AdamW then trains the weight of this FP8Linear as a plain fp32 parameter, without a
    word (the docstring of test_routes_module_protocol's weight-norm test says spectral norm keeps the Parameter)."""
    torch.manual_seed(0)
    layer = FP8Linear(32, 16)
    nn.utils.spectral_norm(layer)
    nn.utils.remove_spectral_norm(layer)
    opt = FP8AdamW(layer.parameters(), lr=1e-2)
    layer(torch.randn(8, 32)).square().sum().backward()
    opt.step()
    assert master.is_fp8_weight(layer.weight)
    assert opt.state[layer.weight]["exp_avg"].dtype == torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------------ convert_to_fp8 filter
def _conv1d_model() -> nn.Module:
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    return nn.Sequential(nn.Linear(16, 16), conv1d(16, 16))


def test_a_filter_s_attribute_error_on_an_nn_linear_is_its_own():
    # The filter's own bug on an nn.Linear (which has in_features): not blamed on Conv1D.
    model = nn.Sequential(nn.Linear(16, 16))

    def wrong(module, fqn):
        return module.in_feature % 16 == 0  # a typo

    with pytest.raises(AttributeError) as info:
        convert_to_fp8(model, module_filter_fn=wrong)
    assert "Conv1D" not in str(info.value) and "in_feature" in str(info.value)
    assert type(model[0]) is nn.Linear


def test_a_conv1d_filter_error_keeps_the_filter_s_own_error_as_its_cause():
    model = _conv1d_model()
    with pytest.raises(AttributeError, match="a Conv1D") as info:
        convert_to_fp8(model, module_filter_fn=lambda m, fqn: m.in_features % 16 == 0)
    assert isinstance(info.value.__cause__, AttributeError) and "in_features" in str(info.value.__cause__)


def test_another_error_a_filter_raises_on_a_conv1d_is_not_turned_into_an_attribute_error():
    model = _conv1d_model()

    def refuses(module, fqn):
        if not isinstance(module, nn.Linear):
            raise KeyError(fqn)  # (the filter's own error, on the Conv1D)
        return True

    with pytest.raises(KeyError, match="'1'"):
        convert_to_fp8(model, module_filter_fn=refuses)
    assert type(model[0]) is nn.Linear


# ------------------------------------------------------------------------------------------------ AdamW's reference
def _adamw_inputs(amax_shape: tuple[int, ...]) -> dict:
    """One O2 tensor (fp16 master, E4M3 / fp16 moments scaled, an E5M2 gradient) a few steps into training, its state
    amaxes and scales one-element tensors of ``amax_shape``, with an E4M3 weight copy to emit."""
    from lightning_fp8.kernels import reference

    gen = torch.Generator().manual_seed(66)
    w, m = torch.randn(40, generator=gen) * 0.05, torch.randn(40, generator=gen) * 1e-3
    v, g = torch.rand(40, generator=gen) * 1e-5 + 1e-9, torch.randn(40, generator=gen) * 1e-2
    scales = [torch.tensor(2.0**k) for k in (16, 10, 20)]
    return {
        "p": (w * scales[0]).half(), "m": (m * scales[1]).to(torch.float8_e4m3fn), "v": (v * scales[2]).half(),
        "g": (g * 2**10).to(torch.float8_e5m2), "gsi": torch.tensor(2.0**-10), "gamax": reference.amax_ref(g),
        "scales": [s.reshape(amax_shape) for s in scales],
        "amaxes": [reference.amax_ref(t).reshape(amax_shape) for t in (w, m, v)],
        "fp8": torch.full((40,), math.nan, dtype=torch.float8_e4m3fn),
        "record": torch.full((5,), -1, dtype=torch.int64),
    }  # fmt: skip


def _adamw_one_pass(fn, d: dict) -> list[torch.Tensor]:
    d = {k: (v.clone() if torch.is_tensor(v) else [x.clone() for x in v]) for k, v in d.items()}
    fn([d["p"]], [d["g"]], [d["m"]], [d["v"]], [tuple(d["scales"])], [tuple(d["amaxes"])], [d["gsi"]], lr=1e-3,
       beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3, grad_unscale=0.5, two_pass=False,
       grad_amaxes=[d["gamax"]], fp8_weights=[d["fp8"]], fp8_weight_stats=[d["record"]])  # fmt: skip
    tensors = [d["p"], d["m"], d["v"], *d["scales"], *d["amaxes"], d["fp8"], d["record"]]
    return [t.reshape(-1).view(torch.uint8) if t.element_size() == 1 else t.reshape(-1) for t in tensors]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the Triton interpreter's numpy
@pytest.mark.parametrize("amax_shape", [(1,), (1, 1)])
def test_a_one_pass_step_emitting_the_fp8_weight_reads_one_element_amaxes_of_any_shape(amax_shape):
    """adamw_step takes amaxes as "one-element fp32 tensors" (kernels/adamw.py), as the scales: a one-pass step bounds
    the new amaxes (and the emitted copy's scale) from them. The reference must step as the kernel does and as with
    0-dim amaxes, bit for bit (test_routes_kernels reshapes the scales of a two-pass step only)."""
    pytest.importorskip("triton")
    from lightning_fp8.kernels import adamw, reference_adamw

    want = _adamw_one_pass(reference_adamw.adamw_step_ref, _adamw_inputs(()))
    got = _adamw_one_pass(reference_adamw.adamw_step_ref, _adamw_inputs(amax_shape))
    kernel = _adamw_one_pass(adamw.adamw_step, _adamw_inputs(amax_shape))
    for a, b, c in zip(want, got, kernel, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c), (a, b, c)
