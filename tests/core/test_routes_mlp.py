"""A route sweep of FP8MLP (lightning_fp8/mlp.py): one computation, ``proj(gelu(fc(x)))``, reached by every route a user
takes to it (how the module is built, which recipe, how it is called, how it trains, how it is copied and saved, what
it does with bad or non-finite input), each against two references written here, not taken from the code under test:

(a) the same two FP8Linear layers called one after another, ``proj(F.gelu(fc(x)))`` on a deep copy: FP8MLP documents
    that its parameters, scaling states and numerics are those of the unfused layers. With fp32 activations both sides
    cast the same fp32 GELU values, but torch's erf and the casts' differ by an ulp now and then (measured: up to
    1.4e-6 on the GELU, 7e-7 on its derivative), which can move a value to its neighbouring FP8 code and does move the
    fp32 column sums that make fc's bias gradient and the amaxes the histories record (measured here: every output
    and gradient bit for bit but fc's bias gradient, 135-140 dB). So results are compared at SAME_CASTS_SQNR_DB (as
    test_mlp.py does), amax histories at AMAX_RTOL, and the scales, cast counts and non-finite counts exactly (powers
    of two and counts, which an ulp does not move here). With bf16 / fp16 activations the unfused GELU rounds its
    output (and its input gradient) to that dtype before the FP8 cast, the fused one does not (the class docstring):
    there the two are compared with (b), and the fused route must be no worse than the unfused one.
(b) a float64 ``nn.Linear``-GELU-``nn.Linear`` with the same weights (the module's unscaled ``state_dict()``), at FP8's
    rounding (FORWARD_RTOL / BACKWARD_RTOL below).

Routes that the other test files cover for FP8MLP are not repeated: test_mlp.py (fused vs unfused by recipe and bias,
from_modules' refusals, hooks, fp8_hidden, compile of the module alone, the 30-step training), test_routes_layouts.py
(non-contiguous layouts, 1-D inputs, empty batches, retain_graph, a shared call), test_routes_dtypes.py (float64).
"""

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_fp8.warnings
from lightning_fp8 import FP8MLP, FP8AdamW, FP8Linear, FP8Recipe, convert_to_fp8, fp8_state_dict, load_fp8_state_dict
from tests.numerics import assert_same, sqnr

# See the module docstring: fused and unfused cast the same fp32 values but for ulp differences of erf.
SAME_CASTS_SQNR_DB = 60.0
AMAX_RTOL = 1e-5
# Relative (Frobenius) error against float64 of an MLP of two FP8 GEMMs, measured over 6 seeds and every dtype route
# here (delayed and current scaling, inputs of a steady range): output 0.057-0.068 (two E4M3 GEMMs in a row; one alone
# measured 0.035 in test_routes_dtypes.py), input and weight gradients 0.080-0.121 (two E5M2 output-gradient casts in
# a row, 0.047-0.062 each). The bounds leave a third of margin.
FORWARD_RTOL, BACKWARD_RTOL = 0.1, 0.16
# proj's bias gradient is the fp32 column sums of the output gradient itself (no FP8 cast): exact but for the sums'
# fp32 rounding, then one rounding to the bias's dtype (2**-11 relative for fp16, 2**-8 for bf16).
BIAS_RTOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
CURRENT = "fp8-lm-current"
SIZES = (32, 64, 48)  # in, hidden, out: in != out, none a power-of-two multiple of another for every pair


def unfused(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Reference (a): the MLP's own layers, one after another, with torch's GELU between them."""
    return mlp.proj(F.gelu(mlp.fc(x)))


class Float64MLP(nn.Module):
    """Reference (b): ``proj(gelu(fc(x)))`` in float64 with an FP8 MLP's weights (its unscaled state_dict), under the
    same parameter names."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        fc, proj = mlp.fc, mlp.proj
        self.fc = nn.Linear(fc.in_features, fc.out_features, bias=fc.bias is not None, dtype=torch.float64)
        self.proj = nn.Linear(proj.in_features, proj.out_features, bias=proj.bias is not None, dtype=torch.float64)
        self.load_state_dict({k: v.double() for k, v in mlp.state_dict().items()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return unfused(self, x.double())


def step(module: nn.Module, x: torch.Tensor, dy: torch.Tensor, call=None, autocast=None) -> dict:
    """One forward and backward of ``call(module, leaf)`` (default ``module(leaf)``) on a leaf copy of ``x``: the output
    ``y``, the input gradient ``dx`` and each parameter's gradient under its name; the gradients are then cleared."""
    leaf = x.detach().clone().requires_grad_(x.is_floating_point())
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y = call(module, leaf) if call is not None else module(leaf)
    y.backward(dy.to(y.dtype))
    out = {"y": y.detach(), "dx": leaf.grad, **{n: p.grad for n, p in module.named_parameters()}}
    module.zero_grad()
    return out


def rel(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return ((actual.double() - reference.double()).norm() / reference.double().norm()).item()


def assert_fp8_accurate(result: dict, result_hp: dict) -> None:
    """``result`` against the float64 MLP's: FP8's rounding, and proj's bias gradient to its dtype's."""
    assert rel(result["y"], result_hp["y"]) < FORWARD_RTOL
    for name, g in result.items():
        if name in ("y", "proj.bias") or g is None:
            continue
        assert rel(g, result_hp[name]) < BACKWARD_RTOL, name
    if result.get("proj.bias") is not None:
        assert rel(result["proj.bias"], result_hp["proj.bias"]) < BIAS_RTOL[result["proj.bias"].dtype]


def assert_same_casts(result: dict, result_ref: dict) -> None:
    """Reference (a) with fp32 activations: the same tensors and dtypes, within the ulps of erf."""
    assert result.keys() == result_ref.keys()
    for name, got in result.items():
        want = result_ref[name]
        assert (got is None) == (want is None), name
        if got is not None:
            assert got.shape == want.shape and got.dtype == want.dtype, name
            assert sqnr(got, want) > SAME_CASTS_SQNR_DB, name


def assert_same_states(mlp: nn.Module, ref: nn.Module) -> None:
    """The scaling states of ``mlp``'s layers against ``ref``'s: scales, counts and statistics of the same casts."""
    buffers, ref_buffers = dict(mlp.named_buffers()), dict(ref.named_buffers())
    assert buffers.keys() == ref_buffers.keys()
    for name, b in buffers.items():
        if b.is_floating_point() and not name.endswith(".scale"):  # amaxes, histories, saturation fractions
            torch.testing.assert_close(b, ref_buffers[name], rtol=AMAX_RTOL, atol=0, msg=name)
        else:
            assert torch.equal(b, ref_buffers[name]), name


# ------------------------------------------------------------------------------------------------ construction routes


def _built(route: str, recipe) -> FP8MLP:
    """The same MLP (the seed's weights) built by ``route``."""
    torch.manual_seed(7)
    fc, proj = nn.Linear(SIZES[0], SIZES[1]), nn.Linear(SIZES[1], SIZES[2])
    if route == "constructor":
        mlp = FP8MLP(*SIZES, recipe=recipe)
        mlp.load_state_dict({"fc.weight": fc.weight, "fc.bias": fc.bias, "proj.weight": proj.weight,
                             "proj.bias": proj.bias})  # fmt: skip
        return mlp
    if route == "from_modules":
        return FP8MLP.from_modules(fc, proj, recipe)
    if route == "from_fp8_layers":
        return FP8MLP.from_modules(FP8Linear.from_linear(fc, recipe), FP8Linear.from_linear(proj, recipe))
    # convert_to_fp8 of a plain MLP makes its layers FP8Linear around the nn.GELU, not an FP8MLP; from_modules then
    # takes the converted layers as they are.
    model = nn.Sequential(fc, nn.GELU(), proj)
    convert_to_fp8(model, recipe)
    assert [type(m) for m in model] == [FP8Linear, nn.GELU, FP8Linear]
    mlp = FP8MLP.from_modules(model[0], model[2])
    assert mlp.fc is model[0] and mlp.proj is model[2]
    return mlp


@pytest.mark.parametrize("recipe", ["fp8-lm", CURRENT])
def test_every_construction_route_gives_the_same_module(recipe):
    """The constructor, from_modules of nn.Linear layers, of FP8Linear layers, and of a converted nn.Sequential: the
    same parameters, state_dict keys and recipe, and three delayed-scaling steps bit for bit the same, against the
    unfused layers and float64."""
    routes = ("constructor", "from_modules", "from_fp8_layers", "converted_sequential")
    mlps = {route: _built(route, recipe) for route in routes}
    ref = copy.deepcopy(mlps["constructor"])
    results = {route: [] for route in (*routes, "unfused")}
    for i in range(3):
        x, dy = torch.randn(2, 4, SIZES[0]) * 3.0, torch.randn(2, 4, SIZES[2])
        hp = step(Float64MLP(ref), x, dy)
        for route, mlp in mlps.items():
            results[route].append(step(mlp, x, dy))
        results["unfused"].append(step(ref, x, dy, unfused))
        assert_fp8_accurate(results["constructor"][i], hp)
    for route, mlp in mlps.items():
        assert type(mlp) is FP8MLP and not mlp.fp8_hidden
        assert list(mlp.state_dict()) == ["fc.weight", "fc.bias", "proj.weight", "proj.bias"]
        assert mlp.fc.recipe == mlp.proj.recipe == FP8Recipe.from_name(recipe)
        assert_same(results[route], results["constructor"])
        assert_same(dict(mlp.named_buffers()), dict(mlps["constructor"].named_buffers()))
    for got, want in zip(results["constructor"], results["unfused"], strict=True):
        assert_same_casts(got, want)
    assert_same_states(mlps["constructor"], ref)


RECIPES = {
    "delayed": FP8Recipe(),
    "current": FP8Recipe(scaling="current"),
    "e4m3": FP8Recipe(fp8_format="e4m3"),
    "margin_2_history_1": FP8Recipe(margin=2, amax_history_len=1),
    "most_recent": FP8Recipe(amax_compute_algo="most_recent", amax_history_len=4),
    "current_e4m3_margin_1_O1": FP8Recipe(scaling="current", fp8_format="e4m3", margin=1, opt_level="O1"),
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_cast_as_the_unfused_layers(recipe, bias):
    """Each recipe's formats, scaling, margin and history window, on three steps whose input range falls by 4x (the
    delayed scales follow their histories, "max" keeping the larger amax, "most_recent" and a window of 1 the last):
    the unfused layers' results and scaling states, and float64's within FP8's rounding. Then a step whose range grows
    16x: the delayed casts saturate (their scales come from the history, as designed) exactly where the unfused
    layers' do; current scaling follows the range, FP8-accurate. (Power-of-two scales change the FP8 rounding only at
    saturation and among subnormals: this step is what tells a delayed cast from a current one.)"""
    mlp = FP8MLP(*SIZES, bias=bias, recipe=RECIPES[recipe])
    ref = copy.deepcopy(mlp)
    assert all(s.fp8_dtype == torch.float8_e4m3fn for s in (mlp.fc.fp8_scaling["input"], mlp.proj.fp8_scaling["input"]))
    for gain in (1.0, 0.25, 0.25, 4.0):
        x, dy = torch.randn(2, 1, 3, SIZES[0]) * gain, torch.randn(2, 1, 3, SIZES[2]) * gain
        result = step(mlp, x, dy)
        assert_same_casts(result, step(ref, x, dy, unfused))
        assert result["y"].shape == (2, 1, 3, SIZES[2])
        if gain < 4.0 or RECIPES[recipe].scaling == "current":
            assert_fp8_accurate(result, step(Float64MLP(mlp), x, dy))
        assert_same_states(mlp, ref)
    saturated = {role: float(s.saturation) > 0 for role, s in mlp.fc.fp8_scaling.items()}
    delayed = RECIPES[recipe].scaling == "delayed"
    assert saturated == {"input": delayed, "weight": False, "grad_output": delayed}
    grad_format = torch.float8_e4m3fn if RECIPES[recipe].fp8_format == "e4m3" else torch.float8_e5m2
    assert mlp.fc.fp8_scaling["grad_output"].fp8_dtype == grad_format


def test_sizes_that_are_not_multiples_of_16_are_refused_or_left_in_high_precision(monkeypatch):
    """The constructor and from_modules refuse them naming the size; convert_to_fp8 leaves such an MLP's layers
    nn.Linear (with its warning), computing exactly what they computed."""
    import lightning_fp8.warnings

    for args, name in (((24, 64), "in_features=24"), ((32, 40), "hidden_features=40"), ((32, 64, 8), "out_features=8")):
        with pytest.raises(ValueError, match=rf"FP8MLP\({name}\): FP8 GEMMs need sizes that are multiples of 16"):
            FP8MLP(*args)
    with pytest.raises(ValueError, match="multiples of 16"):
        FP8MLP.from_modules(nn.Linear(32, 64), nn.Linear(64, 40))
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())  # warnings are once per process
    model = nn.Sequential(nn.Linear(32, 40), nn.GELU(), nn.Linear(40, 32))
    plain = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="not multiples of 16"):
        convert_to_fp8(model)
    assert [type(m) for m in model] == [nn.Linear, nn.GELU, nn.Linear]
    x = torch.randn(4, 32)
    assert torch.equal(model(x), plain(x))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bias": "False"}, r"FP8MLP\(bias='False'\): must be True or False"),
        ({"bias": 1}, r"FP8MLP\(bias=1\): must be True or False"),
        ({"recipe": {"scaling": "current"}}, r"FP8MLP\(recipe=\.\.\.\) must be an FP8Recipe"),
    ],
    ids=["bias_str", "bias_int", "recipe_dict"],
)
def test_bad_constructor_flags_are_named_as_the_mlps_arguments(kwargs, message):
    """Found by this sweep: a bad ``bias`` or ``recipe`` was refused by FP8Linear's checks, naming ``FP8Linear(...)``,
    an object the user did not build (the sizes and dtype were already named as FP8MLP's arguments)."""
    with pytest.raises(TypeError, match=message):
        FP8MLP(32, 64, **kwargs)


def test_the_gelu_is_the_exact_one():
    """No ``approximate`` argument: the exact (erf) GELU, as ``nn.GELU()``; from_modules of a GPT-2 style MLP (tanh
    GELU) computes the erf one, which the tanh one misses by less than FP8's rounding."""
    with pytest.raises(TypeError, match="approximate"):
        FP8MLP(32, 64, approximate="tanh")
    fc, proj = nn.Linear(32, 64), nn.Linear(64, 32)
    x, dy = torch.randn(8, 32) * 2, torch.randn(8, 32)
    tanh_mlp = Float64MLP(nn.ModuleDict({"fc": fc, "proj": proj}))
    with torch.no_grad():
        tanh_y = tanh_mlp.proj(F.gelu(tanh_mlp.fc(x.double()), approximate="tanh"))
    mlp = FP8MLP.from_modules(fc, proj, CURRENT)
    result = step(mlp, x, dy)
    assert_fp8_accurate(result, step(Float64MLP(mlp), x, dy))
    assert rel(result["y"], tanh_y) < FORWARD_RTOL


# ------------------------------------------------------------------------------------------------------- call routes

CALLS = {
    "2d": ((8, 32), lambda v: v),
    "3d": ((2, 4, 32), lambda v: v),
    "1d": ((32,), lambda v: v),
    "transposed": ((32, 8), lambda v: v.T),
    "expanded": ((1, 32), lambda v: v.expand(2, 4, 32)),  # stride 0: the row's gradient sums its copies
    "column_slice": ((2, 4, 48), lambda v: v[..., 8:40]),
    "permuted_4d": ((2, 3, 1, 32), lambda v: v.permute(2, 1, 0, 3)),
}


@pytest.mark.parametrize("recipe", ["fp8-lm", CURRENT])
@pytest.mark.parametrize("call", CALLS)
def test_input_shapes_and_layouts(call, recipe):
    """Inputs of every rank and views that are not contiguous (transposed, stride-0 expanded, a column slice, a
    permutation): the shape nn.Linear gives, the unfused layers' results on the same view, float64's."""
    shape, view = CALLS[call]
    mlp = FP8MLP(*SIZES, recipe=recipe)
    ref = copy.deepcopy(mlp)
    x = torch.randn(shape)
    out_shape = (*view(x).shape[:-1], SIZES[2])
    dy = torch.randn(out_shape)
    for gain in (1.0, 0.5):  # a falling range: a delayed scale from the first step saturates nothing in the second
        x, dy = x * gain, dy * gain
        result = step(mlp, x, dy, lambda m, v: m(view(v)))
        assert result["y"].shape == out_shape and result["dx"].shape == shape
        assert_same_casts(result, step(ref, x, dy, lambda m, v: unfused(m, view(v))))
        assert_fp8_accurate(result, step(Float64MLP(mlp), x, dy, lambda m, v: m(view(v))))
    assert_same_states(mlp, ref)


DTYPE_ROUTES = {
    # name: (parameter dtype, input dtype, autocast dtype)
    "bf16_input": (torch.float32, torch.bfloat16, None),
    "fp16_input": (torch.float32, torch.float16, None),
    "autocast_bf16": (torch.float32, torch.float32, torch.bfloat16),
    "autocast_fp16": (torch.float32, torch.float32, torch.float16),
    "bf16_params": (torch.bfloat16, torch.bfloat16, None),
    "fp16_params_autocast_bf16": (torch.float16, torch.float16, torch.bfloat16),
    "bf16_params_fp32_input": (torch.bfloat16, torch.float32, None),
}


@pytest.mark.parametrize("route", DTYPE_ROUTES)
def test_dtype_routes_against_float64_and_no_worse_than_unfused(route):
    """Low-precision activations: the output and gradient dtypes of the unfused layers (the autocast dtype, else the
    input's; gradients in their tensors' dtypes), FP8-accurate against float64, and no less accurate than the unfused
    layers, which round the GELU's output and input gradient to the activation dtype (the fused casts do not)."""
    param_dtype, x_dtype, autocast = DTYPE_ROUTES[route]
    mlp = FP8MLP(*SIZES, dtype=param_dtype)
    ref = copy.deepcopy(mlp)
    err, err_ref = [], []
    for _ in range(3):
        # dy in the output's dtype: float64 sees the values the MLPs see
        x, dy = torch.randn(6, SIZES[0]).to(x_dtype), torch.randn(6, SIZES[2]).to(autocast or x_dtype)
        result = step(mlp, x, dy, autocast=autocast)
        result_ref = step(ref, x, dy, unfused, autocast=autocast)
        hp = step(Float64MLP(mlp), x, dy)
        assert {k: (v.dtype, v.shape) for k, v in result.items()} == {
            k: (v.dtype, v.shape) for k, v in result_ref.items()
        }
        assert result["y"].dtype == (autocast or x_dtype) and result["dx"].dtype == x_dtype
        assert result["fc.weight"].dtype == param_dtype
        assert_fp8_accurate(result, hp)
        err.append([rel(result[k], hp[k]) for k in ("y", "dx", "fc.weight", "proj.weight")])
        err_ref.append([rel(result_ref[k], hp[k]) for k in ("y", "dx", "fc.weight", "proj.weight")])
    # summed over the steps, each tensor's error within a tenth of the unfused layers'
    for got, want in zip(torch.tensor(err).sum(0), torch.tensor(err_ref).sum(0), strict=True):
        assert got <= want * 1.1
    # the scales come from the same amaxes (the rounding moves an amax by less than a power of two here)
    for (name, b), b_ref in zip(mlp.named_buffers(), ref.buffers(), strict=True):
        if name.endswith((".scale", ".casts", "nonfinite_count")):
            assert torch.equal(b, b_ref), name


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "input_and_module_frozen", "eval"])
def test_forwards_without_a_backward_then_training(mode):
    """Forwards that build no graph (no_grad, inference_mode, nothing requires a gradient) or run in eval mode: the
    unfused layers' outputs and scaling states, and the training steps after them too (the first gradient casts were
    not used up by forwards without a backward)."""
    mlp = FP8MLP(*SIZES)
    ref = copy.deepcopy(mlp)
    x = torch.randn(6, SIZES[0])
    for module in (mlp, ref):
        module.train(mode != "eval")
        module.requires_grad_(mode != "input_and_module_frozen")
    for _ in range(2):
        if mode in ("no_grad", "inference_mode"):
            with getattr(torch, mode)():
                y, y_ref = mlp(x), unfused(ref, x)
        else:
            y, y_ref = mlp(x), unfused(ref, x)
        assert y.requires_grad == y_ref.requires_grad == (mode == "eval")
        assert sqnr(y, y_ref) > SAME_CASTS_SQNR_DB
        assert rel(y, Float64MLP(mlp)(x)) < FORWARD_RTOL
    assert_same_states(mlp, ref)
    for module in (mlp, ref):
        module.requires_grad_(True)
    for _ in range(2):
        dy = torch.randn(6, SIZES[2])
        assert_same_casts(step(mlp, x, dy), step(ref, x, dy, unfused))
    assert_same_states(mlp, ref)


def test_an_input_made_under_inference_mode_trains_the_parameters():
    """An inference tensor as the input (data loaded under inference_mode), parameters requiring gradients: the
    unfused layers' parameter gradients; the input gets none."""
    mlp = FP8MLP(*SIZES)
    ref = copy.deepcopy(mlp)
    with torch.inference_mode():
        x = torch.randn(6, SIZES[0])
    dy = torch.randn(6, SIZES[2])
    mlp(x).backward(dy)
    unfused(ref, x).backward(dy)
    for (name, p), p_ref in zip(mlp.named_parameters(), ref.parameters(), strict=True):
        assert sqnr(p.grad, p_ref.grad) > SAME_CASTS_SQNR_DB, name
    assert_same_states(mlp, ref)


def test_functional_call_with_substituted_parameters():
    """torch.func.functional_call with other parameters, computed from leaves (a hypernetwork, an EMA): the output and
    the leaves' gradients are those of the unfused layers called with the same substitutes, and of float64 with them;
    the module's own parameters get no gradient, its scaling states record the call as the layers' do."""
    mlp = FP8MLP(*SIZES, recipe=CURRENT)
    ref = copy.deepcopy(mlp)
    x, dy = torch.randn(2, 3, SIZES[0]), torch.randn(2, 3, SIZES[2])
    results = []
    for module in (mlp, ref):
        leaves = {n: (p.detach() * 1.5).requires_grad_() for n, p in module.named_parameters()}
        params = {n: v * 2.0 for n, v in leaves.items()}  # not leaves: the gradient flows through the product
        if module is mlp:
            result = step(module, x, dy, lambda m, v, params=params: torch.func.functional_call(m, params, (v,)))
        else:  # each layer called with its substitutes

            def call(m, v, params=params):
                layer = {name: {k.split(".", 1)[1]: t for k, t in params.items() if k.startswith(name)}
                         for name in ("fc", "proj")}  # fmt: skip
                h = torch.func.functional_call(m.fc, layer["fc"], (v,))
                return torch.func.functional_call(m.proj, layer["proj"], (F.gelu(h),))

            result = step(module, x, dy, call)
        results.append({**result, **{f"leaf.{n}": v.grad for n, v in leaves.items()}})
        assert all(p.grad is None for p in module.parameters())
    assert_same_casts(*results)
    substituted = FP8MLP(*SIZES, recipe=CURRENT)
    substituted.load_state_dict({n: p.detach() * 3.0 for n, p in mlp.named_parameters()})
    hp = step(Float64MLP(substituted), x, dy)
    assert_fp8_accurate({"y": results[0]["y"], "dx": results[0]["dx"]}, hp)
    for name in ("fc.weight", "fc.bias", "proj.weight", "proj.bias"):  # d/d(leaf) = 2 d/d(param)
        assert rel(results[0][f"leaf.{name}"], 2 * hp[name]) < (BACKWARD_RTOL if name != "proj.bias" else 1e-6), name
    assert_same_states(mlp, ref)


# --------------------------------------------------------------------------------------------------------- fallbacks


def _hook_on_fc(mlp):
    mlp.fc.register_forward_hook(lambda m, args, out: None)


def _pre_hook_on_proj(mlp):
    mlp.proj.register_forward_pre_hook(lambda m, args: None)


def _fc_back_to_nn_linear(mlp):
    linear = nn.Linear(mlp.fc.in_features, mlp.fc.out_features)
    linear.load_state_dict(mlp.fc.state_dict())
    mlp.fc = linear


FALLBACKS = {"forward_hook_on_fc": _hook_on_fc, "pre_hook_on_proj": _pre_hook_on_proj,
             "fc_back_to_nn_linear": _fc_back_to_nn_linear}  # fmt: skip


@pytest.mark.parametrize("fallback", FALLBACKS)
def test_documented_fallbacks_compute_the_unfused_layers_bit_for_bit(fallback):
    """A forward hook on a layer, a layer put back to nn.Linear: the module calls its layers one after another, which
    is reference (a) itself: bit for bit, outputs, gradients and scaling states, and float64's within FP8's rounding
    (fc in high precision: proj's rounding alone)."""
    mlp = FP8MLP(*SIZES)
    FALLBACKS[fallback](mlp)
    ref = copy.deepcopy(mlp)
    for gain in (1.0, 0.5):
        x, dy = torch.randn(2, 3, SIZES[0]) * gain, torch.randn(2, 3, SIZES[2]) * gain
        result = step(mlp, x, dy)
        assert_same(result, step(ref, x, dy, unfused))
        assert_fp8_accurate(result, step(Float64MLP(mlp), x, dy))
    assert_same(dict(mlp.named_buffers()), dict(ref.named_buffers()))


def test_one_layer_as_fc_and_proj():
    """``from_modules(f, f)``: ``f(gelu(f(x)))``, the layer called twice (its gradients the sums of both calls'), bit
    for bit the unfused calls and within FP8 rounding of float64."""
    f = FP8Linear(32, 32)
    mlp = FP8MLP.from_modules(f, f)
    ref = copy.deepcopy(mlp)
    assert ref.fc is ref.proj and [n for n, _ in mlp.named_parameters()] == ["fc.weight", "fc.bias"]
    assert list(mlp.state_dict()) == ["fc.weight", "fc.bias", "proj.weight", "proj.bias"]  # as torch lists a shared one
    for gain in (1.0, 0.5):
        x, dy = torch.randn(6, 32) * gain, torch.randn(6, 32) * gain
        result = step(mlp, x, dy)
        assert_same(result, step(ref, x, dy, unfused))
        hp = step(Float64MLP(nn.ModuleDict({"fc": mlp.fc, "proj": mlp.proj})), x, dy)
        assert rel(result["y"], hp["y"]) < FORWARD_RTOL and rel(result["dx"], hp["dx"]) < BACKWARD_RTOL
        # the shared parameters' gradients: float64's per name, summed (fc's use and proj's)
        assert rel(result["fc.weight"], hp["fc.weight"] + hp["proj.weight"]) < BACKWARD_RTOL


# ----------------------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize(
    ("opt_level", "emit"), [("O1", False), ("O2", False), ("O2", True)], ids=["O1", "O2", "O2_emit_fp8_weights"]
)
def test_fp8adamw_steps_track_the_unfused_layers_step_by_step(opt_level, emit):
    """Four FP8AdamW steps of the fused MLP and of its unfused copy from the same start, delayed scaling (histories
    move): after each step the weights (at O2 fp16 masters in the weights' storage, with FP8 weight copies emitted by
    the step for the next forward) agree within the ulps of erf, and the scales exactly; the loss falls as float64's.
    Emitted weight copies with a two-pass scale update are the forward's own casts: the same bits as without them."""
    torch.manual_seed(0)
    mlp = FP8MLP(*SIZES)
    ref = copy.deepcopy(mlp)
    plain = copy.deepcopy(mlp)  # the fused MLP without emitted copies
    kwargs = {"lr": 1e-2, "opt_level": opt_level, "emit_fp8_weights": emit, "scale_update": "two_pass"}
    opts = [FP8AdamW(m.parameters(), **kwargs) for m in (mlp, ref)]
    opt_plain = FP8AdamW(plain.parameters(), **{**kwargs, "emit_fp8_weights": False})
    x, target = torch.randn(16, SIZES[0]), torch.randn(16, SIZES[2]) * 0.1
    losses = []
    for _ in range(4):
        for module, opt, call in ((mlp, opts[0], None), (ref, opts[1], unfused), (plain, opt_plain, None)):
            y = call(module, x) if call else module(x)
            loss = F.mse_loss(y, target)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if module is mlp:
                losses.append(loss.item())
        weights, weights_ref = mlp.state_dict(), ref.state_dict()  # unscaled: the masters' values at O2
        for name, w in weights.items():
            assert w.dtype == torch.float32 and sqnr(w, weights_ref[name]) > SAME_CASTS_SQNR_DB, name
        assert_same_states(mlp, ref)
        assert_same(dict(mlp.state_dict()), dict(plain.state_dict()))
    assert losses[-1] < 0.8 * losses[0]
    with torch.no_grad():
        assert rel(mlp(x), Float64MLP(mlp)(x)) < FORWARD_RTOL


@pytest.mark.parametrize("fp8_hidden", [False, True])
def test_non_reentrant_checkpointing_is_the_run_without_it_bit_for_bit(fp8_hidden):
    """torch.utils.checkpoint(use_reentrant=False) around the MLP (in a residual block), three delayed-scaling steps:
    the recompute casts with the forward's scales and records nothing, so everything is the uncheckpointed run's."""
    block = nn.Sequential(nn.LayerNorm(SIZES[0]), FP8MLP(*SIZES, fp8_hidden=fp8_hidden))
    ref = copy.deepcopy(block)
    for gain in (1.0, 0.5, 0.5):
        x, dy = torch.randn(2, 3, SIZES[0]) * gain, torch.randn(2, 3, SIZES[2]) * gain
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no ambiguity: one forward of each layer waits for its backward
            result = step(block, x, dy, lambda m, v: checkpoint(m, v, use_reentrant=False))
        assert_same(result, step(ref, x, dy))
    assert_same(dict(block.named_buffers()), dict(ref.named_buffers()))


def test_reentrant_checkpointing_takes_the_own_amax_path_as_the_unfused_layers(monkeypatch):
    """use_reentrant=True (its forward under no_grad keeps nothing to repeat): the recompute casts with its input's own
    amax, warning once, as the unfused layers under the same checkpoint do: the same results and scaling states as
    theirs, and FP8-accurate against float64."""
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())  # once per process: another test may have warned
    mlp = FP8MLP(*SIZES)
    ref = copy.deepcopy(mlp)
    with pytest.warns(UserWarning, match="use_reentrant=True"):
        checkpoint(mlp, torch.randn(4, SIZES[0], requires_grad=True), use_reentrant=True).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the same warning, once per process: already shown
        checkpoint(lambda v: unfused(ref, v), torch.randn(4, SIZES[0], requires_grad=True), use_reentrant=True)
    ref.load_state_dict(mlp.state_dict())
    load_fp8_state_dict(ref, fp8_state_dict(mlp))
    mlp.zero_grad()
    ref.zero_grad()
    for gain in (1.0, 0.5):
        x, dy = torch.randn(2, 3, SIZES[0]) * gain, torch.randn(2, 3, SIZES[2]) * gain
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = step(mlp, x, dy, lambda m, v: checkpoint(m, v, use_reentrant=True))
            result_ref = step(ref, x, dy, lambda m, v: checkpoint(lambda u: unfused(m, u), v, use_reentrant=True))
        assert_same_casts(result, result_ref)
        assert_fp8_accurate(result, step(Float64MLP(mlp), x, dy))
    assert_same_states(mlp, ref)


def test_compiled_model_is_eager_bit_for_bit():
    """torch.compile(backend="aot_eager") of a model holding FP8MLPs in residual pre-norm blocks, bf16 autocast, three
    delayed-scaling steps: the eager model's outputs, gradients and scaling states, bit for bit."""
    torch._dynamo.reset()

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.mlp = nn.LayerNorm(32), FP8MLP(32, 64)

        def forward(self, v):
            return v + self.mlp(self.norm(v))

    eager = nn.Sequential(Block(), Block())
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    for gain in (1.0, 0.5, 0.5):
        x, dy = torch.randn(2, 5, 32) * gain, torch.randn(2, 5, 32) * gain
        result = step(compiled_model, x, dy, lambda m, v: compiled(v), autocast=torch.bfloat16)
        assert_same(result, step(eager, x, dy, autocast=torch.bfloat16))
    assert_same(dict(compiled_model.named_buffers()), dict(eager.named_buffers()))


# ------------------------------------------------------------------------------------------ state dicts and copies


def _trained_o2_mlp() -> FP8MLP:
    """Three delayed-scaling FP8AdamW O2 steps: fp16 masters in the weights' storage, histories that moved (with
    output gradients of the size the tests then feed: a delayed scale saturates gradients 1000x its history's)."""
    mlp = FP8MLP(*SIZES)
    opt = FP8AdamW(mlp.parameters(), lr=1e-2)
    for _ in range(3):
        mlp(torch.randn(8, SIZES[0])).backward(torch.randn(8, SIZES[2]))
        opt.step()
        opt.zero_grad()
    assert mlp.fc.weight.dtype == torch.float16  # the O2 master
    return mlp


def _reloaded(mlp: FP8MLP, into: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save({"model": mlp.state_dict(), "fp8": fp8_state_dict(mlp)}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    into.load_state_dict(saved["model"])
    load_fp8_state_dict(into, saved["fp8"])
    return into


COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "state_dicts_into_fresh_mlp": lambda m: _reloaded(m, FP8MLP(*SIZES)),
}


@pytest.mark.parametrize("how", COPIES)
def test_copies_and_reloads_continue_as_the_trained_module(how):
    """A trained O2 MLP deep-copied, pickled, or saved (state_dict and fp8_state_dict, torch.load(weights_only=True))
    and loaded into a fresh FP8MLP: the next steps are the original's bit for bit (the same weights, the same delayed
    scaling states)."""
    mlp = _trained_o2_mlp()
    copied = COPIES[how](mlp)
    assert_same(dict(copied.state_dict()), dict(mlp.state_dict()))
    for gain in (1.0, 0.5):
        x, dy = torch.randn(2, 3, SIZES[0]) * gain, torch.randn(2, 3, SIZES[2]) * gain
        result, result_ref = step(copied, x, dy), step(mlp, x, dy)
        if how == "state_dicts_into_fresh_mlp":  # fp32 weights (the masters' values), not fp16 masters: the same
            result = {k: v.to(result_ref[k].dtype) for k, v in result.items()}  # fp32 gradients, rounded as theirs
        assert_same(result, result_ref)
    assert_same(dict(copied.named_buffers()), dict(mlp.named_buffers()))


def test_state_dicts_are_the_unfused_layers_and_load_into_them():
    """The state_dict and fp8_state_dict keys are those of two FP8Linear layers named fc and proj (the unscaled weights
    at O2); they load, strict, into such a pair, which continues as the MLP within the ulps of erf; and the weights into
    a plain float64 MLP, which the FP8 MLP matches within FP8's rounding."""
    mlp = _trained_o2_mlp()
    pair = _reloaded(mlp, nn.ModuleDict({"fc": FP8Linear(*SIZES[:2]), "proj": FP8Linear(*SIZES[1:])}))
    assert list(mlp.state_dict()) == list(pair.state_dict()) == ["fc.weight", "fc.bias", "proj.weight", "proj.bias"]
    assert list(fp8_state_dict(mlp)) == list(fp8_state_dict(pair))
    assert {k.split(".fp8_scaling.")[0] for k in fp8_state_dict(mlp)} == {"fc", "proj"}
    assert all(v.dtype == torch.float32 for v in mlp.state_dict().values())
    for gain in (1.0, 0.5):
        x, dy = torch.randn(2, 3, SIZES[0]) * gain, torch.randn(2, 3, SIZES[2]) * gain
        result = step(mlp, x, dy)  # gradients in the fp16 masters' dtype; the pair's fp32 weights get fp32 ones
        result_pair = {k: v.to(result[k].dtype) for k, v in step(pair, x, dy, unfused).items()}
        assert_same_casts(result, result_pair)
        assert_fp8_accurate(result, step(Float64MLP(mlp), x, dy))
    assert_same_states(mlp, pair)


# -------------------------------------------------------------------------------------------------- non-finite input


@pytest.mark.parametrize("where", ["x_nan", "x_inf", "dy_nan", "dy_inf"])
def test_non_finite_values_are_counted_and_the_scales_kept_as_by_the_unfused_layers(where):
    """A NaN or inf in the input or in the upstream gradient, after a finite step (delayed scaling): the casts that see
    it count it and keep their scales (non-finite counts, scales and histories as the unfused layers', float64's NaNs
    where it has them), and the next finite step is the unfused layers' as before."""
    mlp = FP8MLP(*SIZES)
    ref = copy.deepcopy(mlp)
    x, dy = torch.randn(6, SIZES[0]), torch.randn(6, SIZES[2])
    assert_same_casts(step(mlp, x, dy), step(ref, x, dy, unfused))
    scales = {k: v.clone() for k, v in mlp.named_buffers() if k.endswith(".scale")}
    bad_x, bad_dy = x.clone(), dy.clone()
    (bad_x if where.startswith("x") else bad_dy)[2, 5] = float("nan") if where.endswith("nan") else float("inf")
    result, result_ref = step(mlp, bad_x, bad_dy), step(ref, bad_x, bad_dy, unfused)
    for name, got in result.items():
        assert torch.equal(got.isnan(), result_ref[name].isnan()), name
        finite = got.isfinite()
        assert torch.equal(finite, result_ref[name].isfinite()), name
        if finite.any():
            assert sqnr(got[finite], result_ref[name][finite]) > SAME_CASTS_SQNR_DB, name
    # which casts saw a non-finite value: x's reaches both input casts and fc's output gradient (through gelu'(h)),
    # not proj's (dy itself); dy's both output-gradient casts
    counts = {k: int(v) for k, v in mlp.named_buffers() if k.endswith("nonfinite_count")}
    saw = {k for k, n in counts.items() if n}
    roles = ["fc.input", "proj.input", "fc.grad_output"] if where.startswith("x") else ["fc.grad_output",
                                                                                        "proj.grad_output"]  # fmt: skip
    expected = {"{}.fp8_scaling.{}.nonfinite_count".format(*role.split(".")) for role in roles}
    assert saw == expected, counts
    assert all(counts[k] == 1 for k in saw)
    assert_same_states(mlp, ref)
    for name, scale in scales.items():  # kept; the weights' own casts (finite weights) compute theirs as before
        if ".weight." not in name:
            assert torch.equal(mlp.get_buffer(name), scale), name
    x, dy = torch.randn(6, SIZES[0]), torch.randn(6, SIZES[2])
    assert_same_casts(step(mlp, x, dy), step(ref, x, dy, unfused))
    assert_same_states(mlp, ref)


# ------------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        (lambda: torch.randn(4, 31), ValueError, r"\(in_features=32\) received an input of shape \(4, 31\)"),
        (lambda: torch.randn(()), ValueError, r"\(in_features=32\) received an input of shape \(\)"),
        (lambda: torch.ones(4, 32, dtype=torch.int64), TypeError, "received an input of dtype torch.int64"),
        (lambda: torch.ones(4, 32, dtype=torch.bool), TypeError, "received an input of dtype torch.bool"),
        (lambda: torch.randn(4, 32, dtype=torch.float64), TypeError, "received an input of dtype torch.float64"),
        (lambda: torch.randn(4, 32, device="meta"), ValueError, "input is on meta but the layer's weight is on cpu"),
    ],
    ids=["feature_size", "scalar", "int64", "bool", "float64", "other_device"],
)
def test_bad_input_raises_the_unfused_layers_error_naming_the_mlp_and_records_nothing(bad, error, message):
    mlp = FP8MLP(*SIZES)
    x = bad()
    with pytest.raises(error, match=message) as fc_error:
        mlp.fc(x)
    assert str(fc_error.value).startswith("FP8Linear")
    with pytest.raises(error, match=message) as mlp_error:
        mlp(x)
    assert str(mlp_error.value).startswith("FP8MLP")
    assert all(int(v) == 0 for k, v in mlp.named_buffers() if k.endswith(".casts"))


def test_layers_on_different_devices_are_refused_before_any_cast():
    """proj moved to another device than fc (here the meta device, the one other device a CPU has): a clear error
    naming both devices, before any cast, where the unfused layers fail at proj's input check."""
    mlp = FP8MLP(*SIZES)
    mlp.proj.to("meta")
    x = torch.randn(4, SIZES[0])
    with pytest.raises(ValueError, match="input is on cpu but the layer's weight is on meta"):
        unfused(copy.deepcopy(mlp), x)
    with pytest.raises(ValueError, match="FP8MLP: fc's weight is on cpu but proj's on meta; move the module"):
        mlp(x)
    assert all(int(v) == 0 for k, v in mlp.fc.named_buffers() if k.endswith(".casts"))
