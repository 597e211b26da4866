"""Refusals and edge cases of the public API: scales whose reciprocal overflows fp32 in checkpoints, ScalingState's
arguments, FP8AdamW built under torch.inference_mode(), converting again with another recipe, and the monitoring
guide's gradient norm."""

import copy
import functools
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_fp8 as lf
from lightning_fp8 import (
    E4M3,
    FP8MLP,
    FP8AdamW,
    FP8Linear,
    FP8Recipe,
    ScalingState,
    convert_to_fp8,
    fp8_state_dict,
    load_fp8_state_dict,
)
from lightning_fp8.health import global_norm

ROOT = Path(__file__).resolve().parents[2]


def _model(seed=0):
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)))


def _train(model, opt, steps=2):
    for _ in range(steps):
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()


# ------------------------------------------------------------------------------- scales outside 2**-126 .. 2**127
# fp32 subnormals, exact in an fp32 buffer, which no cast or step produces: from 2**-128 on their reciprocal is inf, and
# the next cast or step writes NaN.
_SUBNORMAL_SCALES = [2.0**-127, 2.0**-130, 2.0**-149]


@pytest.mark.parametrize("scale", _SUBNORMAL_SCALES)
def test_load_fp8_state_dict_refuses_a_scale_whose_reciprocal_overflows(scale):
    layer = FP8Linear(32, 16)
    layer(torch.randn(4, 32))
    saved = fp8_state_dict(layer)
    before = fp8_state_dict(layer)
    bad = {**saved, "fp8_scaling.input.scale": torch.tensor(scale)}
    with pytest.raises(ValueError, match=re.escape("from 2**-126 to 2**127")):
        load_fp8_state_dict(layer, bad)
    assert all(torch.equal(v, before[k]) for k, v in fp8_state_dict(layer).items())  # nothing was loaded
    for edge in (2.0**-126, 2.0**127):  # the range casts produce loads
        load_fp8_state_dict(layer, {**saved, "fp8_scaling.input.scale": torch.tensor(edge)})
        assert layer.fp8_scaling["input"].scale.item() == edge


@pytest.mark.parametrize("key", ["exp_avg_scale", "exp_avg_sq_scale", "master_scale"])
def test_optimizer_load_refuses_a_scale_whose_reciprocal_overflows(key):
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, steps=1)
    saved = opt.state_dict()
    before = copy.deepcopy(saved)
    for scale in _SUBNORMAL_SCALES:
        bad = {**saved, "state": {i: dict(s) for i, s in saved["state"].items()}}
        bad["state"][0][key] = torch.tensor(scale)
        with pytest.raises(ValueError, match=re.escape(f"'{key}' has the value")):
            opt.load_state_dict(bad)
    after = opt.state_dict()
    for index, state in before["state"].items():
        assert all(torch.equal(torch.as_tensor(after["state"][index][k]), torch.as_tensor(v)) for k, v in state.items())
    opt.load_state_dict(saved)  # the intact checkpoint loads, and the next step stays finite
    _train(model, opt, steps=1)
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


# ------------------------------------------------------------------------------------------ ScalingState arguments
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"algo": "maxx"}, ValueError, r"algo='maxx'.*'max', 'most_recent'"),
     ({"algo": None}, TypeError, r"algo=None\) must be a string"),
     ({"margin": -3}, ValueError, r"margin=-3\) must be >= 0"),
     ({"margin": 17}, ValueError, r"margin=17\) must be <= 16"),
     ({"margin": 1.0}, TypeError, r"margin=1.0\) must be an int"),
     ({"history_len": 0}, ValueError, r"history_len=0\) must be >= 1"),
     ({"history_len": True}, TypeError, r"history_len=True\) must be an int"),
     ({"fp8_dtype": torch.float16}, ValueError, r"fp8_dtype=torch.float16\) is not supported"),
     ({"fp8_dtype": torch.bfloat16}, ValueError, r"choose torch.float8_e4m3fn \(E4M3\) or torch.float8_e5m2")],
)  # fmt: skip
def test_scaling_state_refuses_what_a_recipe_refuses(kwargs, error, match):
    args = {"fp8_dtype": E4M3, "history_len": 16, "margin": 0, "algo": "max", "delayed": True, **kwargs}
    with pytest.raises(error, match=match):
        ScalingState(**args)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # what a recipe takes, limits included, still builds
        for algo in ("max", "most_recent"):
            state = ScalingState(dtype, 1, 16, algo, delayed=False)
            state.quantize(torch.randn(8, 16))
            assert state.casts.item() == 1


# ----------------------------------------------------------------------------------------- torch.inference_mode()
def test_fp8adamw_built_under_inference_mode_trains_as_one_built_outside():
    """torch.optim.AdamW can be built under inference_mode; FP8AdamW (O2) failed in its accumulator probe, and its
    adopted masters must not become inference tensors (training updates them in place)."""
    results = []
    for inference in (False, True):
        model = _model()
        if inference:
            with torch.inference_mode():
                opt = FP8AdamW(model.parameters(), lr=1e-2)
        else:
            opt = FP8AdamW(model.parameters(), lr=1e-2)
        assert not any(p.is_inference() for p in model.parameters())
        torch.manual_seed(1)
        _train(model, opt)
        results.append(model.state_dict())
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


# --------------------------------------------------------------------------------------- converting again
def test_converting_again_with_another_recipe_is_refused_before_anything_changes():
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    convert_to_fp8(model, "fp8-lm", module_filter_fn=lambda m, fqn: fqn == "0")
    fp8_layer, linear = model[0], model[2]
    with pytest.raises(ValueError, match=r"'0' is already an FP8 layer, converted with scaling='delayed', margin=0"):
        convert_to_fp8(model, FP8Recipe(scaling="current", margin=1))
    assert model[0] is fp8_layer and model[2] is linear and type(linear) is nn.Linear
    assert fp8_layer.recipe == FP8Recipe.from_name("fp8-lm")
    # Still converted again: with the same scaling (opt_level is not the layers'), or with the layer filtered out.
    convert_to_fp8(model, "fp8-lm-o1", module_filter_fn=lambda m, fqn: fqn == "0")
    assert model[0] is fp8_layer and type(model[2]) is nn.Linear
    current = FP8Recipe(scaling="current")
    convert_to_fp8(model, current, module_filter_fn=lambda m, fqn: fqn != "0")  # a layer per recipe
    assert model[0] is fp8_layer and fp8_layer.recipe.scaling == "delayed" and model[2].recipe == current


# ---------------------------------------------------------------------------------- docs/guides/monitoring.md
def test_monitoring_guide_loop_observes_the_true_gradient_norm(monkeypatch):
    """The plain-loop example of the monitoring guide, run as written: the gradient norm it feeds the HealthMonitor
    covers the FP8 weights' gradients (FP8AdamW holds them, param.grad None, with its default fp8_grads=True) and
    is unscaled by mu."""
    text = (ROOT / "docs" / "guides" / "monitoring.md").read_text()
    section = text[text.index("## The health dashboard") :]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    # mu far from 1, so that a norm still scaled by it shows
    monkeypatch.setattr(lf, "FP8GradScaler", functools.partial(lf.FP8GradScaler, init_scale=2.0**8))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    model = convert_to_fp8(copy.deepcopy(ref))
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    namespace = {"model": model, "loader": [(x, y)], "loss_fn": nn.functional.mse_loss}
    exec(compile(snippet, "monitoring.md", "exec"), namespace)  # noqa: S102
    nn.functional.mse_loss(ref(x), y).backward()
    true_norm = global_norm([p.grad for p in ref.parameters()]).item()
    ((step, observed),) = namespace["monitor"].series["grad_norm"]
    assert step == 0 and observed == pytest.approx(true_norm, rel=0.02)  # FP8 GEMMs: ~0.3% here


def test_layer_built_under_inference_mode_runs_outside_it():
    """Its scaling buffers were inference tensors, which every forward updates in place: outside inference mode
    torch refused that. nn.Linear, the reference, runs there; so does the FP8 layer now, with the same result as a
    layer built normally."""
    torch.manual_seed(0)
    with torch.inference_mode():
        built = FP8Linear(32, 16)
        built(torch.randn(2, 32))
    normal = FP8Linear(32, 16)
    with torch.no_grad():
        normal.weight.copy_(built.weight)
        normal.bias.copy_(built.bias)
    normal(torch.randn(2, 32))  # a first forward as the built layer's (only the history's position matters here)
    normal.fp8_scaling.load_state_dict(built.fp8_scaling.state_dict())
    for state in ("input", "weight", "grad_output"):
        normal.fp8_scaling[state].amax_history.copy_(built.fp8_scaling[state].amax_history)
        normal.fp8_scaling[state].scale.copy_(built.fp8_scaling[state].scale)
    x = torch.randn(4, 32)
    with torch.no_grad():  # training is out of reach for both: the parameters are inference tensors, as nn.Linear's
        assert torch.equal(built(x), normal(x))
        assert torch.equal(built(x), normal(x))  # and the in-place updates of the second forward agree too


def test_layer_materialized_under_inference_mode_runs_outside_it():
    """Built on the meta device and materialized under inference mode (to_empty, or load_state_dict(assign=True)),
    the scaling buffers were inference tensors again (made by Module._apply there)."""
    with torch.device("meta"):
        layer = FP8Linear(32, 16)
    with torch.inference_mode():
        layer.to_empty(device="cpu")
        nn.init.normal_(layer.weight)
        nn.init.zeros_(layer.bias)
    with torch.no_grad():
        assert torch.isfinite(layer(torch.randn(4, 32))).all()
    assert not any(b.is_inference() for b in layer.buffers())


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_parameter_of_another_shape_is_refused_before_any_cast(which):
    """A parameter replaced by one of another shape failed in the GEMM or bias add, after the casts had recorded
    the input's and weight's statistics: refused first now, the scaling state unchanged."""
    layer = FP8Linear(32, 16)
    layer(torch.randn(4, 32))
    if which == "weight":
        layer.weight = nn.Parameter(torch.randn(16, 48))
    else:
        layer.bias = nn.Parameter(torch.zeros(8))
    before = {k: v.clone() for k, v in layer.named_buffers()}
    with pytest.raises(ValueError, match="a parameter was replaced by one of another shape"):
        layer(torch.randn(4, 32))
    assert all(torch.equal(before[k], v) for k, v in layer.named_buffers())


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64, torch.int32])
def test_unsupported_parameter_dtype_is_refused_at_construction(dtype):
    """FP8Linear(dtype=torch.float64) was built and refused only at its first forward."""
    with pytest.raises(TypeError, match="FP8 layers keep float32, bfloat16 or float16 parameters"):
        FP8Linear(32, 16, dtype=dtype)
    assert FP8Linear(32, 16, dtype=torch.bfloat16).weight.dtype == torch.bfloat16


@pytest.mark.parametrize("which", ["fc", "proj"])
def test_fp8mlp_parameter_of_another_shape_is_refused_before_any_cast(which):
    """FP8MLP's fused path checked fc's input only: a proj weight of another shape gave an output of the wrong width
    (bias=False) or torch's error after the casts had recorded statistics."""
    mlp = FP8MLP.from_modules(nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False))
    layer = getattr(mlp, which)
    layer.weight = nn.Parameter(torch.randn(48, layer.in_features))
    before = {k: v.clone() for k, v in mlp.named_buffers()}
    with pytest.raises(ValueError, match="a parameter was replaced by one of another shape"):
        mlp(torch.randn(4, 32))
    assert all(torch.equal(before[k], v) for k, v in mlp.named_buffers())
