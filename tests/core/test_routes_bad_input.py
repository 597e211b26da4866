"""Bad-input sweep of the public API on CPU: for each public name, arguments a user could plausibly get wrong, each
refused with the exception its kind calls for (TypeError for a wrong type, ValueError for a bad value), with a message
naming the argument, and without changing anything (model weights, scaling states, optimizer and scaler states compare
equal to copies taken before the failed call); and the reverse, valid edge inputs accepted with the right result
against an independent reference (``nn.Linear``, ``torch.optim.AdamW``, DESIGN.md's scale rule written here).

Covered (what tests/core/test_bad_input.py, test_refusals_and_edges.py, test_optim_refusals.py,
test_optim_input_checks.py, test_state_load_checks.py, test_layer_guards.py, test_recipe.py, test_routes_recipe.py and
test_grad_scaler_settings.py do not already pin):

- ``fp8_max`` and ``compute_scale``: wrong types and values of every argument, ``prev_scale`` numbers outside fp32's
  normal range and on another device; valid NumPy / 0-dim / bf16 / FP8 amaxes against the scale rule.
- ``ScalingState.quantize``: wrong input dtypes, flags, devices and shapes change nothing; empty, 0-dim, transposed,
  expanded and strided inputs cast as their contiguous copies; ``unscale`` values that are no power of two.
- ``FP8Linear`` / ``FP8MLP``: constructor arguments, inputs of wrong type, dtype, shape and device (state untouched);
  empty batches, 1-D / 3-D / single-row / non-contiguous / huge / tiny / bf16 / fp16 inputs against ``nn.Linear``.
- ``FP8AdamW``: constructor and ``add_param_group`` values (nothing adopted by a refused call), hyper-parameters and
  moments of a loaded state dict; 0-dim, empty, strided, huge and tiny parameters and ``lr=0`` against
  ``torch.optim.AdamW``.
- ``FP8GradScaler``: arguments, calls in the wrong order, objects that are not optimizers, FP8 and meta tensors,
  a truthy string flag of ``clip_grad_norm_``, corrupt state dicts.
- ``load_fp8_state_dict`` of scales that are no fp32 scale tensors, and the whole checkpoint (scaling state, optimizer,
  scaler, health monitor) through ``torch.save`` / ``torch.load(weights_only=True)``, resuming bit for bit.
- ``HealthConfig`` / ``HealthMonitor`` arguments and saved states, the Lightning callbacks' settings, and
  ``lightning_fp8.distributed``'s ``SegmentLayout``, ``mark_fp8_weights``, ``enable_fp8_fsdp2`` and ``FP8ReduceScatter``
  given what is not what they take.

Tests marked ``# Fixed (found by this sweep):`` failed on the code of their time: each says what the library did
and what it does now.
"""

import copy
import io
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import lightning_fp8
import lightning_fp8.warnings
from lightning_fp8 import (
    E4M3,
    E5M2,
    FP8MLP,
    FP8AdamW,
    FP8GradScaler,
    FP8Linear,
    FP8Recipe,
    HealthConfig,
    HealthMonitor,
    ScalingState,
    compute_scale,
    convert_to_fp8,
    fp8_max,
    fp8_state_dict,
    load_fp8_state_dict,
)
from tests.numerics import BACKWARD_SQNR_DB, FORWARD_SQNR_DB, assert_same, pow2_scale, sqnr

# FP8AdamW's fp32 step of a parameter that is not an FP8 weight against torch.optim.AdamW's: the same formula in another
# operation order, a few fp32 ulp per step (tests/core/test_optim_input_checks.py names the same bound).
ADAMW_ATOL = 1e-6


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16)))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 32, generator=gen)).square().mean().backward()
        opt.step()


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in module.named_buffers()}


def _parameters(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> tuple:
    """Everything a failed call must leave as it was: weights (and their storage dtype), scaling buffers, and the
    optimizer's state dict."""
    return (_parameters(model), _buffers(model), None if opt is None else copy.deepcopy(opt.state_dict()))


def _weights_only_round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# ============================================================================================ fp8_max, compute_scale
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float8_e4m3fnuz, "e4m3", None, 448, [E4M3]])
def test_fp8_max_refuses_what_is_no_fp8_dtype(dtype):
    with pytest.raises(ValueError, match=r"expected an FP8 dtype \(torch.float8_e4m3fn or torch.float8_e5m2\), got"):
        fp8_max(dtype)
    assert (fp8_max(E4M3), fp8_max(E5M2)) == (448.0, 57344.0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"amax": "1.0"}, TypeError, r"amax=\.\.\.\) takes a floating-point tensor or a number, got str"),
     ({"amax": None}, TypeError, "got NoneType"),
     ({"amax": True}, TypeError, "got bool"),
     ({"amax": torch.tensor(3)}, TypeError, "got a torch.int64 tensor"),
     ({"amax": torch.tensor(1 + 0j)}, TypeError, "got a torch.complex64 tensor"),
     ({"amax": -1.0}, ValueError, r"amax=-1.0\): amax is an absolute maximum .* x.abs\(\).max\(\)"),
     ({"amax": -math.inf}, ValueError, "absolute maximum"),
     ({"margin": 1.0}, TypeError, r"margin=1.0\) must be an int"),
     ({"margin": "1"}, TypeError, r"margin='1'\) must be an int"),
     ({"margin": torch.tensor(1)}, TypeError, "must be an int"),
     ({"margin": -1}, ValueError, r"margin=-1\) must be in \[0, 16\]"),
     ({"fp8_dtype": torch.bfloat16}, ValueError, r"fp8_dtype=torch.bfloat16\) is not a format it scales for"),
     ({"fp8_dtype": "e4m3"}, ValueError, "is not a format it scales for"),
     ({"prev_scale": 3.0}, ValueError, r"prev_scale=3.0\): must be a positive power of two"),
     ({"prev_scale": -2.0}, ValueError, "must be a positive power of two"),
     ({"prev_scale": math.nan}, ValueError, "must be a positive power of two"),
     ({"prev_scale": "1"}, TypeError, r"prev_scale=\.\.\.\) takes a real"),
     ({"prev_scale": torch.ones(2)}, ValueError, r"of shape \(2,\) does not fit amax's shape \(\)")],
)  # fmt: skip
def test_compute_scale_refuses_each_bad_argument_naming_it(kwargs, error, match):
    args = {"amax": torch.tensor(0.0), "fp8_dtype": E4M3, **kwargs}
    with pytest.raises(error, match=match):
        compute_scale(**args)


@pytest.mark.parametrize(
    "amax",
    [1.0, 3, np.float32(2.5), np.int64(7), np.float64(1e-30), torch.tensor(100.0), torch.tensor(0.3).bfloat16(),
     torch.tensor(0.3).half(), torch.tensor(3e38), torch.tensor(1e-38), torch.tensor(448.0).to(E4M3)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_compute_scale_of_valid_amax_kinds_is_the_scale_rule(amax, dtype):
    """Python and NumPy numbers, 0-dim tensors of every floating dtype (an FP8 amax too), huge and tiny finite values:
    the power of two of DESIGN.md's rule (tests/numerics.py: pow2_scale, in float64), as a 0-dim fp32 tensor."""
    value = float(amax.float()) if isinstance(amax, torch.Tensor) else float(amax)
    got = compute_scale(amax, dtype)
    assert got.dtype == torch.float32 and got.shape == ()
    want = min(max(pow2_scale(value, fp8_max(dtype)), 2.0**-126), 2.0**127)
    assert got.item() == want


@pytest.mark.parametrize("prev_scale", [2.0**-150, 2.0**-130, 2.0**128, 2**200])
def test_compute_scale_refuses_a_prev_scale_number_outside_fp32s_normal_range(prev_scale):
    # Fixed (found by this sweep): compute_scale takes any positive power of two as a number prev_scale and returns it,
    # converted to fp32, where the amax carries no information: 2**-150 comes back as a scale of 0.0, 2**128 and 2**200
    # as inf, 2**-130 as an fp32 subnormal whose reciprocal is inf. None is a scale a cast could use (the docstring:
    # results lie in 2**-126 .. 2**127; load_fp8_state_dict refuses such scales "from 2**-126 to 2**127"). Expected:
    # ValueError naming prev_scale, as for 3.0. Cause: cast_checks.py: checked_prev_scale checks the mantissa only, not
    # the exponent.
    with pytest.raises(ValueError, match=r"compute_scale\(prev_scale="):
        compute_scale(torch.tensor(0.0), E4M3, prev_scale=prev_scale)
    for edge in (2.0**-126, 2.0**127):  # the ends of the range stay valid
        assert compute_scale(torch.tensor(0.0), E4M3, prev_scale=edge).item() == edge


def test_compute_scale_refuses_a_prev_scale_on_another_device_naming_it():
    # Fixed (found by this sweep): a prev_scale tensor on the meta device beside a CPU amax fails inside torch.as_tensor
    # with NotImplementedError "Cannot copy out of meta tensor; no data!" (nothing names prev_scale or says what to do).
    # Expected: ValueError naming prev_scale and the devices, as ScalingState.quantize does for x. Cause: scale_rule.py:
    # compute_scale moves prev_scale to amax's device without checking it can be.
    with pytest.raises(ValueError, match="prev_scale"):
        compute_scale(torch.tensor(0.0), E4M3, prev_scale=torch.tensor(2.0, device="meta"))


# ======================================================================================== ScalingState.quantize
def _state(delayed: bool = True, history_len: int = 4) -> ScalingState:
    state = ScalingState(E4M3, history_len, 0, "max", delayed)
    state.quantize(torch.randn(8, 16))
    return state


@pytest.mark.parametrize(
    ("x", "kwargs", "error", "match"),
    [(torch.ones(4, 16, dtype=torch.int32), {}, TypeError, "casts float16, bfloat16, float32 or float64 values, got"),
     (torch.ones(4, 16, dtype=torch.bool), {}, TypeError, "got torch.bool"),
     (torch.randn(4, 16, dtype=torch.complex64), {}, TypeError, "got torch.complex64"),
     (torch.randn(4, 16).to(E5M2), {}, TypeError, r"got an FP8 tensor .* it is cast already"),
     ([[1.0] * 16], {}, TypeError, "expects a tensor, got list"),
     (np.ones((4, 16), dtype=np.float32), {}, TypeError, "expects a tensor, got ndarray"),
     (torch.randn(4, 16).to_sparse(), {}, TypeError, "takes dense tensors"),
     (torch.empty(4, 16, device="meta"), {}, ValueError, "x is on meta but the scaling state on cpu"),
     (torch.randn(16), {"transpose": True}, ValueError, r"transpose=True\) needs a 2-D tensor, got shape \(16,\)"),
     (torch.randn(2, 4, 16), {"column_sum": True}, ValueError, r"column_sum=True\) needs a 2-D tensor"),
     (torch.randn(4, 16), {"transpose": "no"}, TypeError, r"transpose='no'\): must be True or False"),
     (torch.randn(4, 16), {"current": 1}, TypeError, r"current=1\): must be True or False"),
     (torch.randn(4, 16), {"column_sum": np.bool_(True)}, TypeError, "got numpy.bool"),
     (torch.randn(4, 16), {"activation": "relu"}, ValueError, r"activation='relu'\): choose one of"),
     (torch.randn(4, 16), {"unscale": 2.0, "current": True}, TypeError, "must be a one-element float32 tensor"),
     (torch.randn(4, 16), {"unscale": torch.tensor(2.0).double(), "current": True}, TypeError, "float32 tensor")],
)  # fmt: skip
def test_quantize_refuses_bad_inputs_and_changes_nothing(x, kwargs, error, match):
    state = _state()
    before = _buffers(state)
    with pytest.raises(error, match=match):
        state.quantize(x, **kwargs)
    assert_same(_buffers(state), before)
    assert state.initialized


@pytest.mark.parametrize(
    "make",
    [lambda: torch.randn(16, 8).t(), lambda: torch.randn(1, 16).expand(8, 16), lambda: torch.randn(8, 32)[:, ::2],
     lambda: torch.randn(3, 8, 16).transpose(0, 1)[0], lambda: torch.randn(8, 16).bfloat16()[:, :],
     lambda: torch.randn(8, 16).double()],
    ids=["transposed", "expanded", "strided", "sliced-3d", "bf16", "float64"],
)  # fmt: skip
def test_quantize_of_a_strided_input_is_the_cast_of_its_contiguous_copy(make):
    """Non-contiguous, transposed and expanded inputs (and the wide dtypes, read as fp32) cast bit for bit as their
    contiguous copies, with the same statistics, and the FP8 values are DESIGN.md's saturate(x * scale)."""
    x = make()
    a, b = _state(), _state()
    for name, buf in a.named_buffers():
        b.get_buffer(name).copy_(buf)
    got = a.quantize(x, transpose=True)
    want = b.quantize(x.contiguous(), transpose=True)
    assert_same(got, want)
    assert_same(_buffers(a), _buffers(b))
    scale = 1 / got[2]
    assert torch.equal(got[0].float(), (x.float() * scale).clamp(-448, 448).to(E4M3).float())
    assert torch.equal(got[1], got[0].t().contiguous())


def test_quantize_of_empty_and_zero_dim_inputs():
    """An empty tensor casts to an empty one, records an amax of 0 and keeps the scale (no information); a 0-dim one
    (not transposed) casts as the one-element tensor it is."""
    state = _state()
    scale, casts = state.scale.clone(), int(state.casts)
    x_fp8, x_fp8_t, scale_inv = state.quantize(torch.empty(0, 16), transpose=True)
    assert x_fp8.shape == (0, 16) and x_fp8_t.shape == (16, 0) and x_fp8.dtype == E4M3
    assert torch.equal(state.scale, scale) and state.amax.item() == 0.0 and int(state.casts) == casts + 1
    assert state.amax_history[0].item() == 0.0
    fresh = ScalingState(E4M3, 4, 0, "max", False)
    x_fp8, _, scale_inv = fresh.quantize(torch.tensor(3.0))
    assert x_fp8.shape == () and x_fp8.float().item() * scale_inv.item() == 3.0  # 3 is exact in E4M3 (1.5 * 2**1)
    assert fresh.scale.item() == pow2_scale(3.0, 448.0)


# ================================================================================================ FP8Linear, FP8MLP
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"in_features": 16.0}, TypeError, r"in_features=16.0\): must be an int"),
     ({"in_features": "16"}, TypeError, r"in_features='16'\): must be an int"),
     ({"in_features": torch.tensor(16)}, TypeError, "must be an int"),
     ({"in_features": -16}, ValueError, r"in_features=-16\): a feature size must be >= 0"),
     ({"out_features": 20}, ValueError, r"out_features=20\): FP8 GEMMs need feature sizes that are multiples of 16"),
     ({"bias": None}, TypeError, r"bias=None\): must be True or False"),
     ({"bias": 0}, TypeError, r"bias=0\): must be True or False"),
     ({"dtype": "float32"}, TypeError, r"dtype='float32'\): must be a torch.dtype"),
     ({"dtype": E4M3}, TypeError, "FP8 layers keep float32, bfloat16 or float16 parameters"),
     ({"recipe": 3}, TypeError, r"FP8Linear\(recipe=\.\.\.\) must be an FP8Recipe"),
     ({"recipe": "fp8-lm-o3"}, ValueError, "unknown FP8 recipe name 'fp8-lm-o3'")],
)  # fmt: skip
def test_fp8linear_constructor_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        FP8Linear(**{"in_features": 32, "out_features": 16, **kwargs})


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")  # torch's, for nn.Linear(0, 16) too
def test_fp8linear_takes_numpy_sizes_and_zero_features_as_nn_linear():
    layer = FP8Linear(np.int64(32), np.int32(16))
    assert (layer.in_features, layer.out_features) == (32, 16)
    empty = FP8Linear(0, 16)
    ref = nn.Linear(0, 16)
    with torch.no_grad():
        ref.bias.copy_(empty.bias)
    assert torch.equal(empty(torch.randn(4, 0)), ref(torch.randn(4, 0)))  # the bias on every row, as nn.Linear


BAD_INPUTS = [
    (torch.tensor(1.0), ValueError, r"received an input of shape \(\): its last dimension must be 32"),
    (torch.randn(4, 16), ValueError, r"input of shape \(4, 16\): its last dimension must be 32"),
    (torch.randn(4, 0), ValueError, "its last dimension must be 32"),
    (torch.randn(4, 32).double(), TypeError, r"input of dtype torch.float64.*x.float\(\)"),
    (torch.ones(4, 32, dtype=torch.int64), TypeError, "input of dtype torch.int64"),
    (torch.ones(4, 32, dtype=torch.bool), TypeError, "input of dtype torch.bool"),
    (torch.randn(4, 32, dtype=torch.complex64), TypeError, "input of dtype torch.complex64"),
    (torch.randn(4, 32).to(E4M3), TypeError, "input of dtype torch.float8_e4m3fn"),
    (torch.empty(4, 32, device="meta"), ValueError, "input is on meta but the layer's weight is on cpu"),
    (np.zeros((4, 32), dtype=np.float32), TypeError, "expects a tensor input, got ndarray"),
    ([[0.0] * 32], TypeError, "expects a tensor input, got list"),
    (None, TypeError, "expects a tensor input, got NoneType"),
]


@pytest.mark.parametrize(("x", "error", "match"), BAD_INPUTS)
def test_fp8linear_refuses_bad_inputs_before_any_cast(x, error, match):
    layer = _model()[0]
    layer(torch.randn(4, 32))
    before = (_parameters(layer), _buffers(layer))
    with pytest.raises(error, match=match):
        layer(x)
    assert_same((_parameters(layer), _buffers(layer)), before)


@pytest.mark.parametrize(("x", "error", "match"), BAD_INPUTS)
def test_fp8mlp_refuses_bad_inputs_before_any_cast(x, error, match):
    mlp = FP8MLP(32, 64)
    mlp(torch.randn(4, 32))
    before = (_parameters(mlp), _buffers(mlp))
    with pytest.raises(error, match=match.replace("FP8Linear", "FP8MLP")):
        mlp(x)
    assert_same((_parameters(mlp), _buffers(mlp)), before)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"hidden_features": 20}, ValueError, r"FP8MLP\(hidden_features=20\)"),
     ({"out_features": 8.0}, TypeError, r"FP8MLP\(out_features=8.0\): must be an int"),
     ({"bias": "yes"}, TypeError, r"FP8MLP\(bias='yes'\)"),
     ({"dtype": torch.float64}, TypeError, r"FP8MLP\(dtype=torch.float64\)"),
     ({"fp8_hidden": 1}, TypeError, r"FP8MLP\(fp8_hidden=1\): must be True or False"),
     ({"recipe": {"margin": 1}}, TypeError, r"FP8MLP\(recipe=\.\.\.\) must be an FP8Recipe")],
)  # fmt: skip
def test_fp8mlp_constructor_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        FP8MLP(**{"in_features": 32, "hidden_features": 64, **kwargs})


def test_fp8mlp_from_modules_refuses_layers_that_do_not_chain_and_wraps_nothing():
    fc, proj = nn.Linear(32, 64), nn.Linear(48, 32)
    with pytest.raises(ValueError, match="fc gives 64 features but proj takes 48"):
        FP8MLP.from_modules(fc, proj)
    with pytest.raises(TypeError, match="fc must be an nn.Linear"):
        FP8MLP.from_modules(nn.Conv1d(32, 64, 1), proj)
    with pytest.raises(ValueError, match="unknown FP8 recipe name"):
        FP8MLP.from_modules(nn.Linear(32, 64), nn.Linear(64, 32), recipe="fp8")
    assert type(fc) is nn.Linear and not hasattr(fc, "fp8_scaling")


EDGE_INPUTS = {
    "empty-batch": lambda: torch.randn(0, 32),
    "empty-3d": lambda: torch.randn(2, 0, 32),
    "1d": lambda: torch.randn(32),
    "3d": lambda: torch.randn(2, 5, 32),
    "single-row": lambda: torch.randn(1, 32),
    "transposed": lambda: torch.randn(32, 8).t(),
    "expanded": lambda: torch.randn(1, 32).expand(8, 32),
    "strided": lambda: torch.randn(8, 64)[:, ::2],
    "huge": lambda: torch.randn(8, 32) * 1e30,
    "tiny": lambda: torch.randn(8, 32) * 1e-30,
    "bf16": lambda: torch.randn(8, 32).bfloat16(),
    "fp16": lambda: torch.randn(8, 32).half(),
}


@pytest.mark.parametrize("name", EDGE_INPUTS)
def test_fp8linear_takes_valid_edge_inputs_as_nn_linear(name):
    """Output shape and dtype, input and parameter gradients of nn.Linear's (on the same weights, in the input's
    dtype), to FP8 accuracy; empty batches give empty outputs and zero parameter gradients."""
    torch.manual_seed(0)
    x = EDGE_INPUTS[name]()
    ref = nn.Linear(32, 16)
    layer = convert_to_fp8(copy.deepcopy(ref))
    ref = ref.to(x.dtype)
    xa, xb = x.detach().requires_grad_(), x.detach().requires_grad_()  # views: strides kept (clone() would not)
    y, y_ref = layer(xa), ref(xb)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    dy = torch.randn(y.shape).to(y.dtype)
    y.backward(dy)
    y_ref.backward(dy)
    assert xa.grad.shape == x.shape and layer.weight.grad.shape == (16, 32)
    if x.numel() == 0:
        assert not layer.weight.grad.any() and not layer.bias.grad.any()
        return
    assert torch.isfinite(y).all()
    if name != "tiny":  # x @ w.T is ~1e-30 there: y is the bias, compared as a whole
        assert sqnr(y.float() - layer.bias.float(), y_ref.float() - ref.bias.float()) > FORWARD_SQNR_DB
    assert sqnr(y.float(), y_ref.float()) > FORWARD_SQNR_DB
    assert sqnr(xa.grad.float(), xb.grad.float()) > BACKWARD_SQNR_DB
    assert sqnr(layer.weight.grad.float(), ref.weight.grad.float()) > BACKWARD_SQNR_DB


@pytest.mark.parametrize("name", ["empty-batch", "1d", "3d", "transposed", "bf16"])
def test_fp8mlp_takes_valid_edge_inputs_as_two_linears(name):
    torch.manual_seed(0)
    x = EDGE_INPUTS[name]()
    fc, proj = nn.Linear(32, 64), nn.Linear(64, 32)
    mlp = FP8MLP.from_modules(copy.deepcopy(fc), copy.deepcopy(proj))
    fc, proj = fc.to(x.dtype), proj.to(x.dtype)
    y = mlp(x)
    y_ref = proj(nn.functional.gelu(fc(x)))
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    if x.numel():
        assert sqnr(y.float(), y_ref.float()) > BACKWARD_SQNR_DB  # two FP8 GEMMs in a row


# ================================================================================================ convert_to_fp8
@pytest.mark.parametrize(
    ("call", "error", "match"),
    [(lambda m: convert_to_fp8("model"), TypeError, "convert_to_fp8 expects an nn.Module, got str"),
     (lambda m: convert_to_fp8(m, 3), TypeError, r"convert_to_fp8\(recipe=\.\.\.\) must be an FP8Recipe"),
     (lambda m: convert_to_fp8(m, "fp8"), ValueError, "unknown FP8 recipe name 'fp8'"),
     (lambda m: convert_to_fp8(m, module_filter_fn="lm_head"), TypeError, "must be a callable fn"),
     (lambda m: convert_to_fp8(m, module_filter_fn=lambda fqn: True), TypeError, "which it cannot take"),
     (lambda m: convert_to_fp8(m, module_filter_fn=lambda m, f: "no"), TypeError, "returned 'no' for '0'"),
     (lambda m: lightning_fp8.fp8_modules([m]), TypeError, "fp8_modules expects an nn.Module")],
)  # fmt: skip
def test_convert_refuses_bad_arguments_and_converts_nothing(call, error, match):
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=match):
        call(model)
    assert [type(m) for m in model] == [nn.Linear, nn.GELU, nn.Linear]
    assert_same(model.state_dict(), before)


# ======================================================================================================== FP8AdamW
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"lr": math.inf}, ValueError, r"Invalid learning rate: inf"),
     ({"lr": torch.tensor([1e-3, 1e-3])}, ValueError, r"a tensor lr must have one element"),
     ({"betas": (0.9,)}, ValueError, r"Invalid betas: \(0.9,\) \(FP8AdamW needs a pair"),
     ({"betas": None}, ValueError, r"Invalid betas: None"),
     ({"betas": (math.nan, 0.999)}, ValueError, r"Invalid beta parameter at index 0: nan"),
     ({"betas": (0.9, 1.0)}, ValueError, r"Invalid beta parameter at index 1: 1.0"),
     ({"eps": math.nan}, ValueError, r"Invalid epsilon value: nan"),
     ({"eps": True}, TypeError, r"eps must be a number, got bool"),
     ({"weight_decay": -0.1}, ValueError, r"Invalid weight_decay value: -0.1"),
     ({"weight_decay": math.nan}, ValueError, r"Invalid weight_decay value: nan"),
     ({"opt_level": "o2"}, ValueError, r"opt_level='o2'\) is not supported: choose 'O1' or 'O2'"),
     ({"master_dtype": E4M3}, ValueError, r"master_dtype=torch.float8_e4m3fn\) is not supported"),
     ({"exp_avg_sq_dtype": E4M3}, ValueError, r"exp_avg_sq_dtype=torch.float8_e4m3fn\) is not supported"),
     ({"exp_avg_dtype": torch.int8}, ValueError, r"exp_avg_dtype=torch.int8\) is not supported"),
     ({"scale_update": "three_pass"}, ValueError, r"scale_update='three_pass'\) is not supported"),
     ({"low_precision_moments": "none"}, ValueError, r"low_precision_moments='none'\) is not supported"),
     ({"grad_cast_bucket_mb": -1}, ValueError, r"grad_cast_bucket_mb=-1\) is not supported"),
     ({"grad_cast_bucket_mb": math.inf}, ValueError, r"grad_cast_bucket_mb=inf\)"),
     ({"fp8_params": 3}, TypeError, r"fp8_params=\.\.\.\) takes an iterable of the weight tensors"),
     ({"fp8_params": ["0.weight"]}, TypeError, "got list holding str"),
     ({"emit_fp8_weights": 1}, TypeError, r"emit_fp8_weights=1\): must be True or False"),
     ({"fp8_grads": "no"}, TypeError, r"fp8_grads='no'\): must be True or False"),
     ({"recipe": "fp8-lm-o3"}, ValueError, "unknown FP8 recipe name")],
)  # fmt: skip
def test_fp8adamw_constructor_refuses_bad_arguments_and_adopts_nothing(kwargs, error, match):
    model = _model()
    before = _snapshot(model)
    with pytest.raises(error, match=match):
        FP8AdamW(model.parameters(), **kwargs)
    assert_same(_snapshot(model), before)  # no fp16 master made of a weight (O2 adopts in the constructor)
    assert all(not hasattr(p, lightning_fp8.optim.master.SCALE_ATTR) for p in model.parameters())


@pytest.mark.parametrize(
    ("group", "error", "match"),
    [({"lr": math.nan}, ValueError, "Invalid learning rate: nan"),
     ({"betas": (1.0, 0.999)}, ValueError, "Invalid beta parameter at index 0: 1.0"),
     ({"betas": [0.9]}, ValueError, "Invalid betas"),
     ({"eps": -1.0}, ValueError, "Invalid epsilon value: -1.0"),
     ({"weight_decay": math.inf}, ValueError, "Invalid weight_decay value: inf"),
     ({"maximize": "yes"}, TypeError, r"maximize='yes'\): must be True or False"),
     ({"params": [torch.randn(3, dtype=torch.float64, requires_grad=True)]}, TypeError, "float64 parameter")],
)  # fmt: skip
def test_add_param_group_refuses_bad_values_before_adopting_anything(group, error, match):
    model = _model()
    opt = FP8AdamW(model[0].parameters(), lr=1e-2)
    _train(nn.Sequential(model[0]), opt, steps=1)
    before = _snapshot(model, opt)
    with pytest.raises(error, match=match):
        opt.add_param_group({"params": list(model[2].parameters()), **group})
    assert len(opt.param_groups) == 1
    assert_same(_snapshot(model, opt), before)
    assert model[2].weight.dtype == torch.float32  # not made an fp16 master


@pytest.mark.parametrize(
    ("change", "match"),
    [(lambda sd: sd["param_groups"][0].__setitem__("lr", -1.0), r"parameter group 0 of the state dict: Invalid learn"),
     (lambda sd: sd["param_groups"][0].__setitem__("betas", (0.9, 1.0)), "Invalid beta parameter at index 1"),
     (lambda sd: sd["param_groups"][0].__setitem__("eps", math.nan), "Invalid epsilon value: nan"),
     (lambda sd: sd["param_groups"][0].__setitem__("weight_decay", math.nan), "Invalid weight_decay value: nan"),
     (lambda sd: sd["state"][1].__setitem__("exp_avg_sq", -sd["state"][1]["exp_avg_sq"] - 1), "holds negative values"),
     (lambda sd: sd["state"][0].__setitem__("exp_avg_sq", -sd["state"][0]["exp_avg_sq"].float().add(1).half()),
      "parameter 0's 'exp_avg_sq' holds negative values"),
     (lambda sd: sd["state"][0].__setitem__("exp_avg", torch.full((32, 32), math.nan).to(E4M3)), "holds inf or NaN"),
     (lambda sd: sd["state"][0].__setitem__("master", torch.full((32, 32), math.inf).half()), "holds inf or NaN"),
     (lambda sd: sd["state"][1].__setitem__("exp_avg", sd["state"][1]["exp_avg"].long()), "not a floating-point"),
     (lambda sd: sd.pop("param_groups"), "expects a dict with 'state' and 'param_groups'"),
     (lambda sd: sd["state"].__setitem__(99, dict(sd["state"][1])), "which no parameter group lists")],
    ids=["lr<0", "beta2=1", "eps-nan", "wd-nan", "fp32-v<0", "fp16-v<0", "fp8-m-nan", "master-inf", "int-moment",
         "no-groups", "extra-index"],
)  # fmt: skip
def test_fp8adamw_load_refuses_corrupt_hyper_parameters_and_moments(change, match):
    """A checkpoint whose groups or moments no AdamW run can produce: refused, the optimizer and weights unchanged;
    the intact checkpoint then loads and the next step stays finite."""
    source = _model(0)
    source_opt = FP8AdamW(source.parameters(), lr=1e-2)
    _train(source, source_opt)
    saved = _weights_only_round_trip(source_opt.state_dict())
    model = _model(1)
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, seed=1)
    before = _snapshot(model, opt)
    bad = copy.deepcopy(saved)
    change(bad)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(bad)
    assert_same(_snapshot(model, opt), before)
    opt.load_state_dict(saved)
    _train(model, opt, steps=1)
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


@pytest.mark.parametrize(
    "make",
    [lambda: torch.tensor(2.0), lambda: torch.empty(0), lambda: torch.empty(0, 16), lambda: torch.randn(8, 4).t(),
     lambda: torch.full((5,), 1e30), lambda: torch.full((5,), 1e-30), lambda: torch.randn(16, 16)],
    ids=["0-dim", "empty", "empty-2d", "transposed", "huge", "tiny", "matrix"],
)  # fmt: skip
@pytest.mark.parametrize("hyper", [{"lr": 1e-2}, {"lr": 0.0}, {"lr": 1e-2, "weight_decay": 0.0, "eps": 0.0}])
def test_fp8adamw_steps_valid_edge_parameters_as_torch_adamw(make, hyper):
    """Parameters that are not FP8 weights (fp32 states): FP8AdamW's steps are torch.optim.AdamW's, for 0-dim, empty,
    non-contiguous, huge and tiny parameters, lr=0 (nothing moves) and eps=0."""
    torch.manual_seed(0)
    base = make()
    p, q = nn.Parameter(base.clone()), nn.Parameter(base.clone())
    opt, ref = FP8AdamW([p], **hyper), torch.optim.AdamW([q], **hyper)
    for _ in range(3):
        g = torch.randn(base.shape) * (1e-3 if base.numel() == 5 else 1.0)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=ADAMW_ATOL)
    if hyper["lr"] == 0.0:
        assert torch.equal(p.detach(), base)


# =================================================================================================== FP8GradScaler
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"init_scale": 0}, ValueError, r"init_scale=0\): must be a positive power of two"),
     ({"init_scale": math.nan}, ValueError, "must be a positive power of two"),
     ({"init_scale": 3.0}, ValueError, "must be a positive power of two"),
     ({"init_scale": 2.0**-130}, ValueError, "must be from 2\\*\\*-126 to 2\\*\\*127"),
     ({"init_scale": torch.tensor(2.0)}, TypeError, r"init_scale=tensor\(2.\)\): must be a number"),
     ({"init_scale": None}, TypeError, "must be a number"),
     ({"init_scale": 2.0**30}, ValueError, "need min_scale <= init_scale <= max_scale"),
     ({"min_scale": 4.0, "max_scale": 2.0}, ValueError, "need min_scale <= init_scale <= max_scale"),
     ({"saturation_threshold": torch.tensor(0.1)}, TypeError, "must be a number in \\[0, 1\\), got Tensor"),
     ({"headroom": 0.99}, ValueError, "must be finite and >= 1"),
     ({"lr_factor": torch.tensor(0.5)}, TypeError, "must be a number in \\(0, 1\\), got Tensor"),
     ({"fallback_after": True}, TypeError, "must be an int >= 1, got bool"),
     ({"nonfinite_fallback": "bf16"}, ValueError, "needs the model"),
     ({"model": "model"}, TypeError, r"model=\.\.\.\) got a str"),
     ({"process_group": 0}, TypeError, r"process_group=\.\.\.\) got a int")],
)  # fmt: skip
def test_fp8gradscaler_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        FP8GradScaler(**kwargs)


def _plain_setup(scale: float = 2.0**4):
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = FP8GradScaler(init_scale=scale)
    scaler.scale_loss(model(torch.randn(4, 16)).square().mean()).backward()
    return model, opt, scaler


def test_scaler_calls_in_the_wrong_order_are_refused_and_change_nothing():
    model, opt, scaler = _plain_setup()
    scaler.unscale_(opt)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"unscale_\(optimizer\) has already been called on this optimizer"):
        scaler.unscale_(opt)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))  # not unscaled twice
    assert scaler.step(opt)
    weights = _parameters(model)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update\(\)"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(optimizer\) is being called after step\(\)"):
        scaler.unscale_(opt)
    assert_same(_parameters(model), weights)
    scaler.update()
    scaler.update()  # nothing recorded since: harmless, mu as it was
    assert scaler.get_scale() == 2.0**4 and scaler.state_dict()["steps"] == 1


def test_a_step_before_any_scaled_loss_is_refused_before_anything_changes():
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 16)).sum().backward()
    scaler = FP8GradScaler(init_scale=2.0**4)
    weights, grads, state = _parameters(model), [p.grad.clone() for p in model.parameters()], scaler.state_dict()
    for call in (scaler.step, scaler.unscale_):
        with pytest.raises(RuntimeError, match="no loss was scaled by this scaler"):
            call(opt)
    assert_same(_parameters(model), weights)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert scaler.state_dict() == state


@pytest.mark.parametrize("given", [None, "optimizer", nn.Linear(4, 4), 3])
def test_scaler_step_and_unscale_refuse_what_is_no_optimizer_alike(given):
    # Fixed (found by this sweep): FP8GradScaler.step refuses these with TypeError "takes the optimizer to step (a
    # torch.optim.Optimizer), got ...", but unscale_ fails with a raw AttributeError "'NoneType' object has no attribute
    # 'param_groups'" (for None, a string, a module, an int). Expected: unscale_ raises step's TypeError. Cause:
    # grad_scaling/unscaling.py: _Unscaling.unscale_ reads optimizer.param_groups without checking what it got.
    scaler = FP8GradScaler()
    with pytest.raises(TypeError, match=r"FP8GradScaler.step\(optimizer\) takes the optimizer to step"):
        scaler.step(given)
    with pytest.raises(TypeError, match=r"FP8GradScaler.unscale_"):
        scaler.unscale_(given)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_scale_loss_refuses_an_fp8_loss_naming_it(dtype):
    # Fixed (found by this sweep): scale_loss refuses int, bool and complex losses with "takes a real floating-point
    # loss ... compute the loss in floating point", but an FP8 loss (floating point too) reaches the multiplication and
    # fails inside torch with NotImplementedError '"mul_cpu_reduced_float" not implemented for Float8_e4m3fn'. Expected:
    # TypeError naming the loss's dtype and saying to compute the loss in float32 / bf16. Cause: grad_scaling/losses.py:
    # _LossScaling.scale_loss checks is_floating_point() only.
    scaler = FP8GradScaler(init_scale=4.0)
    with pytest.raises(TypeError, match="scale_loss"):
        scaler.scale_loss(torch.tensor(1.0).to(dtype))
    assert float(scaler.scale_loss(torch.tensor(1.5))) == 6.0  # a float32 loss: mu times it


def test_update_refuses_a_new_scale_on_the_meta_device_naming_it():
    # Fixed (found by this sweep): update(new_scale=torch.tensor(4., device="meta")) fails with torch's raw RuntimeError
    # "Tensor.item() cannot be called on meta tensors". Expected: ValueError (or TypeError) naming new_scale, as for a
    # tensor of the wrong shape or dtype. Cause: grad_scaling/arguments.py: check_new_scale reads .item() without
    # checking the device.
    scaler = FP8GradScaler()
    with pytest.raises((TypeError, ValueError), match="new_scale"):
        scaler.update(new_scale=torch.tensor(4.0, device="meta"))
    assert scaler.get_scale() == 1.0


@pytest.mark.parametrize("flag", ["no", "False"])
def test_clip_grad_norm_refuses_an_error_if_nonfinite_that_is_no_bool(flag):
    # Fixed (found by this sweep): clip_grad_norm_(error_if_nonfinite="no") is taken for its truth value: with an
    # overflowed gradient it raises "The total norm ... is non-finite" though the caller said no. The library refuses
    # every other flag that is not a bool (recipe.py: check_flag, "a truthy string such as 'no' would switch a feature
    # on against what was meant"). Expected: TypeError naming error_if_nonfinite, nothing clipped. Cause:
    # grad_scaling/unscaling.py: _Unscaling.clip_grad_norm_ does not check the flag.
    model, opt, scaler = _plain_setup()
    with torch.no_grad():
        model.weight.grad[0, 0] = math.inf
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"error_if_nonfinite="):
        scaler.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=flag)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


def test_clip_grad_norm_of_finite_gradients_is_torchs_on_the_unscaled_ones():
    """The valid route: the true norm, and gradients clipped as torch clips the unscaled ones (mu stays on them)."""
    model, opt, scaler = _plain_setup(scale=2.0**6)
    ref = [p.grad / 2.0**6 for p in model.parameters()]
    ref_params = [nn.Parameter(torch.zeros_like(g)) for g in ref]
    for p, g in zip(ref_params, ref, strict=True):
        p.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(ref_params, 0.1)
    assert want > 0.1  # so the gradients are clipped, not only measured
    got = scaler.clip_grad_norm_(model.parameters(), 0.1)
    torch.testing.assert_close(got, want.float())
    for p, q in zip(model.parameters(), ref_params, strict=True):
        torch.testing.assert_close(p.grad / 2.0**6, q.grad, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [("scale", 0.0, ValueError), ("scale", 3.0, ValueError), ("scale", "2", TypeError), ("scale", torch.tensor(2.0),
     TypeError), ("growth_tracker", -1, ValueError), ("growth_tracker", 1.5, TypeError), ("skipped_steps", True,
     TypeError), ("last_saturation", math.nan, ValueError), ("last_saturation", 1.5, ValueError), ("history", "x",
     TypeError), ("fp16_full", "no", TypeError), ("nonfinite_runs", [-1], ValueError)],
)  # fmt: skip
def test_scaler_load_refuses_corrupt_entries_and_changes_nothing(key, value, error):
    model, opt, scaler = _plain_setup()
    scaler.step(opt)
    scaler.update()
    saved = _weights_only_round_trip(scaler.state_dict())
    other = FP8GradScaler(init_scale=2.0**8)
    before = other.state_dict()
    with pytest.raises(error, match=r"FP8GradScaler.load_state_dict: .*Nothing was loaded"):
        other.load_state_dict({**saved, key: value})
    assert other.state_dict() == before
    other.load_state_dict(saved)
    assert other.state_dict() == saved


# ======================================================================================== fp8_state_dict checkpoints
@pytest.mark.parametrize(
    ("value", "error"),
    [(1.0, TypeError), (np.float32(1.0), TypeError), (np.ones(()), TypeError), ([1.0], TypeError),
     (torch.tensor(math.inf), ValueError), (torch.tensor(2.0**-127), ValueError), (torch.tensor(0.5).half(), None)],
)  # fmt: skip
def test_load_fp8_state_dict_of_a_scale_that_is_no_fp32_scale_tensor(value, error):
    """A scale saved as a Python or NumPy number, a list, inf, a subnormal: refused, nothing loaded. An fp16 power of
    two holds the fp32 value exactly: it loads."""
    model = _model(1)
    model(torch.randn(4, 32)).sum().backward()
    saved = fp8_state_dict(_model(0))
    before = fp8_state_dict(model)
    bad = {**saved, "0.fp8_scaling.input.scale": value}
    if error is None:
        load_fp8_state_dict(model, bad)
        assert model[0].fp8_scaling["input"].scale.item() == 0.5
        assert model[0].fp8_scaling["input"].scale.dtype == torch.float32
        return
    with pytest.raises(error, match="0.fp8_scaling.input.scale"):
        load_fp8_state_dict(model, bad)
    assert_same(fp8_state_dict(model), before)


def test_checkpoint_of_every_state_round_trips_weights_only(tmp_path):
    """The FP8 scaling state, FP8AdamW, FP8GradScaler and HealthMonitor states in one file: torch.load(weights_only=
    True) reads it and each part loads into fresh objects, which then train as the originals, bit for bit."""
    model = _model(0)
    scaler = FP8GradScaler(init_scale=2.0**4, model=model)
    opt = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)
    monitor = HealthMonitor(HealthConfig(window=4, warmup_steps=0))
    for step in range(3):
        opt.zero_grad()
        loss = model(torch.randn(8, 32)).square().mean()
        scaler.scale_loss(loss).backward()
        opt.step()
        monitor.observe(step, loss=loss.detach(), grad_norm=1.0 + step)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "fp8": fp8_state_dict(model), "opt": opt.state_dict(),
                "scaler": scaler.state_dict(), "health": monitor.state_dict()}, path)  # fmt: skip
    ckpt = torch.load(path, weights_only=True)
    fresh = _model(1)
    fresh_scaler = FP8GradScaler(model=fresh)
    fresh_opt = FP8AdamW(fresh.parameters(), lr=1e-2, grad_scaler=fresh_scaler)
    fresh_monitor = HealthMonitor(HealthConfig(window=4, warmup_steps=0))
    fresh.load_state_dict(ckpt["model"])
    load_fp8_state_dict(fresh, ckpt["fp8"])
    fresh_opt.load_state_dict(ckpt["opt"])
    fresh_scaler.load_state_dict(ckpt["scaler"])
    fresh_monitor.load_state_dict(ckpt["health"])
    assert fresh_monitor.state_dict() == monitor.state_dict()
    x = torch.randn(8, 32)
    for m, s, o in ((model, scaler, opt), (fresh, fresh_scaler, fresh_opt)):
        o.zero_grad()
        s.scale_loss(m(x).square().mean()).backward()
        o.step()
    assert_same(fresh.state_dict(), model.state_dict())
    assert_same(fp8_state_dict(fresh), fp8_state_dict(model))


# ============================================================================================ HealthConfig, monitor
@pytest.mark.parametrize(
    "kwargs",
    [{"window": "50"}, {"window": 50.0}, {"warmup_steps": None}, {"spike_patience": torch.tensor(3)},
     {"spike_zscore": "6"}, {"spike_ratio": None}, {"plateau_min_improvement": torch.tensor(0.01)},
     {"plateau_grad_norm_drop": [0.1]}],
)  # fmt: skip
def test_health_config_of_the_wrong_type_is_a_type_error(kwargs):
    # Fixed (found by this sweep): HealthConfig raises a plain ValueError for a value of the wrong type (a string, None,
    # a float count, a tensor, a list), where FP8Recipe (RecipeFieldTypeError) and the Lightning monitors
    # (MonitorArgumentTypeError) raise an error that is both a TypeError and a ValueError. Expected: a TypeError that is
    # also a ValueError (the existing tests catch ValueError), naming the field. Cause: monitoring/config.py:
    # HealthConfig.__post_init__.
    (name,) = kwargs
    with pytest.raises(TypeError, match=rf"HealthConfig\({name}=") as raised:
        HealthConfig(**kwargs)
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((0, "loss", 3), {}), ((0, "loss", ["skip_step"]), {}), ((0, None, "skip_step"), {}), ((0, 3, "skip_step"), {})],
)  # fmt: skip
def test_record_nonfinite_of_the_wrong_type_is_a_type_error(args, kwargs):
    # Fixed (found by this sweep): record_nonfinite(action=3) and action=["skip_step"] raise ValueError("pass a
    # string"), source=None or 3 ValueError("must be one of"): a wrong type is a ValueError here, while
    # record_nonfinite(value="abc") and observe(step="0") raise TypeError. Expected: TypeError naming the argument, no
    # event recorded. Cause: health.py: HealthMonitor.record_nonfinite.
    monitor = HealthMonitor()
    with pytest.raises(TypeError, match=r"record_nonfinite\((action|source)="):
        monitor.record_nonfinite(*args, **kwargs)
    assert monitor.events == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"loss": "1.0"}, TypeError, r"observe\(loss='1.0'\) expects a number"),
     ({"loss": torch.tensor([1.0, 2.0])}, TypeError, r"observe\(loss=tensor"),
     ({"loss": 1 + 2j}, TypeError, "got complex"),
     ({"grad_norm": -1.0}, ValueError, r"observe\(grad_norm=-1.0\) must be >= 0"),
     ({"samples": math.nan, "seconds": 1.0}, ValueError, r"samples=nan\) must be a finite number >= 0"),
     ({"memory_gib": {"total": 3.0}}, TypeError, "without a 'peak' entry")],
)  # fmt: skip
def test_health_monitor_observe_refuses_bad_values_and_records_nothing(kwargs, error, match):
    monitor = HealthMonitor(HealthConfig(window=4, warmup_steps=0))
    monitor.observe(0, loss=2.0, grad_norm=1.0)
    before = monitor.state_dict()
    with pytest.raises(error, match=match):
        monitor.observe(1, **kwargs)
    assert monitor.state_dict() == before
    # The valid kinds: NumPy numbers and one-element tensors are numbers, non-finite values are events.
    events = monitor.observe(1, loss=np.float32(1.5), grad_norm=torch.tensor([2.0]), param_norm=np.int64(3))
    assert events == [] and monitor.series["grad_norm"][-1] == (1, 2.0)
    assert [e.kind for e in monitor.observe(2, loss=math.inf)] == ["nonfinite_loss"]


@pytest.mark.parametrize("key", ["grad_norms", "spike_run", "plateau_grad"])
def test_health_monitor_load_refuses_a_negative_norm_in_its_windows(key):
    # Fixed (found by this sweep): observe() refuses a negative gradient norm ("must be >= 0 (a norm)"), but
    # load_state_dict takes one in the spike baseline ('grad_norms'), the run of spikes or the plateau test's norms,
    # where the next spike test and plateau test compute their mean and drop from it. Expected: ValueError naming the
    # entry, nothing loaded. Cause: monitoring/state.py: _checked_state checks those windows for finite values only.
    monitor = HealthMonitor(HealthConfig(window=4, warmup_steps=0, plateau_window=4))
    for step in range(3):
        monitor.observe(step, loss=2.0 - step * 0.1, grad_norm=1.0)
    saved = monitor.state_dict()
    bad = copy.deepcopy(saved)
    bad[key] = [-5.0] * len(bad[key] or [0])
    if key == "plateau_grad":
        bad["plateau_loss"] = [1.0] * len(bad[key])
    other = HealthMonitor(HealthConfig(window=4, warmup_steps=0, plateau_window=4))
    with pytest.raises(ValueError, match=rf"HealthMonitor.load_state_dict: .*{key}"):
        other.load_state_dict(bad)
    assert other.state_dict() == HealthMonitor().state_dict()


# ======================================================================================= wrong types elsewhere
@pytest.mark.parametrize(
    "call",
    [lambda: FP8AdamW([nn.Parameter(torch.randn(4))], grad_cast_bucket_mb="64"),
     lambda: FP8AdamW([nn.Parameter(torch.randn(4))], grad_cast_bucket_mb=True),
     lambda: FP8AdamW([nn.Parameter(torch.randn(4))], opt_level=2),
     lambda: FP8AdamW([nn.Parameter(torch.randn(4))], scale_update=None)],
    ids=["bucket-str", "bucket-bool", "opt_level-int", "scale_update-None"],
)  # fmt: skip
def test_fp8adamw_arguments_of_the_wrong_type_are_type_errors(call):
    # Fixed (found by this sweep): FP8AdamW raises a plain ValueError ("... is not supported") for
    # grad_cast_bucket_mb="64" or True, opt_level=2 and scale_update=None: values of the wrong type, which
    # FP8Recipe(opt_level=2) refuses with a TypeError (that is also a ValueError) and FP8AdamW(lr="1e-3") with a
    # TypeError. Expected: TypeError (also a ValueError, for callers catching that). Cause: optim/settings.py:
    # resolved_settings, and the bucket check in optim/grad_cast.py (the bucket check FP8AdamW's constructor calls).
    with pytest.raises(TypeError):  # the recipe's refusal of the same opt_level, for comparison
        FP8Recipe(opt_level=2)
    with pytest.raises(TypeError) as raised:
        call()
    assert isinstance(raised.value, ValueError)


# ============================================================================================ Lightning callbacks
@pytest.mark.parametrize(
    ("name", "value"),
    [("jump_factor", 0.5), ("jump_factor", 1.0), ("jump_factor", math.inf), ("jump_factor", "16"),
     ("jump_factor", True), ("alert_after_steps", -5), ("alert_after_steps", "x"), ("alert_after_steps", 1.5),
     ("alert_after_steps", None)],
)  # fmt: skip
def test_scale_monitor_settings_set_later_are_checked_as_the_constructor_checks_them(name, value):
    # Fixed (found by this sweep): FP8ScaleMonitor(jump_factor=0.5) and FP8ScaleMonitor(alert_after_steps=-5) are
    # refused, but the properties' setters take any value: monitor.jump_factor = 0.5 (every log then alerts), = inf
    # (never), = "16" (converted), and monitor.alert_after_steps = "x" or None (each log after the first then fails
    # comparing a step with it), -5 or 1.5 (kept as they are); jump_factor = "abc" fails with a bare float() ValueError.
    # FP8GradScaler checks its settings on assignment and keeps the old value. Expected: the constructor's error
    # (TypeError / ValueError naming the setting), the old value kept. Cause: integrations/lightning/callbacks.py:
    # FP8ScaleMonitor.jump_factor / alert_after_steps setters.
    pytest.importorskip("lightning")
    from lightning_fp8.callbacks import FP8ScaleMonitor

    with pytest.raises((TypeError, ValueError)) as constructed:
        FP8ScaleMonitor(**{name: value})
    monitor = FP8ScaleMonitor(jump_factor=8.0, alert_after_steps=10)
    with pytest.raises(constructed.type, match=name):
        setattr(monitor, name, value)
    assert (monitor.jump_factor, monitor.alert_after_steps) == (8.0, 10)


def test_monitor_constructors_refuse_bad_values_and_take_numpy_ones():
    pytest.importorskip("lightning")
    from lightning_fp8.callbacks import FP8ScaleMonitor, TrainingHealthMonitor

    for make, error in [(lambda: FP8ScaleMonitor(log_every_n_steps=0), ValueError),
                        (lambda: FP8ScaleMonitor(jump_factor=None), TypeError),
                        (lambda: TrainingHealthMonitor(smoothing_window=0), ValueError),
                        (lambda: TrainingHealthMonitor(config=HealthMonitor()), TypeError),
                        (lambda: TrainingHealthMonitor(tokens_fn="tokens"), TypeError)]:  # fmt: skip
        with pytest.raises(error):
            make()
    monitor = FP8ScaleMonitor(log_every_n_steps=np.int64(3), jump_factor=np.float64(4.0))
    assert monitor.log_every_n_steps == 3 and monitor.jump_factor == 4.0


def test_scale_monitor_load_refuses_corrupt_states_and_keeps_its_alerts():
    pytest.importorskip("lightning")
    from lightning_fp8.callbacks import FP8ScaleMonitor

    monitor = FP8ScaleMonitor()
    good = {"alerts": [{"step": 3, "layer": "0", "role": "input", "kind": "drop", "from": 8.0, "to": 0.25}],
            "previous_scales": [["0", "input", 0.25]], "previous_mu": None, "before_jumps": []}  # fmt: skip
    monitor.load_state_dict(good)
    for bad, error in [(None, TypeError), ({**good, "alerts": "x"}, TypeError), ({**good, "bogus": 1}, ValueError),
                       ({**good, "previous_scales": [["0", "input", -1.0]]}, ValueError),
                       ({**good, "previous_scales": [["0", "activation", 1.0]]}, ValueError),
                       ({**good, "previous_mu": math.nan}, ValueError)]:  # fmt: skip
        with pytest.raises(error, match="FP8ScaleMonitor.load_state_dict: .*Nothing was loaded"):
            monitor.load_state_dict(bad)
        assert monitor.state_dict() == good


# ========================================================================================== lightning_fp8.distributed
@pytest.mark.parametrize("given", [None, "model", [nn.Linear(16, 16)]])
def test_distributed_entry_points_refuse_what_is_no_module(given):
    # Fixed (found by this sweep): enable_fp8_ddp and enable_fp8_fsdp1 refuse a non-module with a TypeError naming what
    # they take, but enable_fp8_fsdp2 and mark_fp8_weights fail with a raw AttributeError ("'str' object has no
    # attribute 'modules'"). Expected: TypeError naming the function and "nn.Module". Cause: distributed/fsdp2.py:
    # mark_fp8_weights and enable_fp8_fsdp2 call model.modules() unchecked.
    from lightning_fp8.distributed import enable_fp8_ddp, enable_fp8_fsdp1, enable_fp8_fsdp2, mark_fp8_weights

    for call in (enable_fp8_ddp, enable_fp8_fsdp1):
        with pytest.raises(TypeError, match=call.__name__):
            call(given)
    for call in (enable_fp8_fsdp2, mark_fp8_weights):
        with pytest.raises(TypeError, match=call.__name__):
            call(given)


@pytest.mark.parametrize(
    "args",
    [((16.0,), (0,), 1), ((True, 16), (0, 1), 2), ((16,), (0,), 1.5)],
    ids=["float-length", "bool-length", "float-num-groups"],
)
def test_segment_layout_refuses_counts_that_are_no_ints_as_its_classmethods_do(args):
    # Fixed (found by this sweep): SegmentLayout.per_tensor([16.0]) is refused ("expected an int, got float"), but
    # SegmentLayout((16.0,), (0,), 1) is built and gives float offsets (parts() -> [(0, 16.0, 0)]), a bool length is
    # taken as 1, a float num_groups is kept. Expected: TypeError naming SegmentLayout, as per_tensor / blocks / rows
    # raise (their _count). Cause: distributed/layout.py: SegmentLayout.__post_init__ checks the ranges only.
    from lightning_fp8.distributed import SegmentLayout

    with pytest.raises(TypeError, match="SegmentLayout"):
        SegmentLayout(*args)
    with pytest.raises(TypeError, match="expected an int"):
        SegmentLayout.per_tensor([16.0])


def test_segment_layout_of_lists_is_the_layout_of_tuples():
    # Fixed (found by this sweep): SegmentLayout([16, 8], [0, 1], 2) keeps the lists: the frozen layout cannot be hashed
    # ("unhashable type: 'list'"), and the collectives' plan caches (functools.lru_cache(all_reduce_plan /
    # reduce_scatter_plan / _gather_plan) keyed by the layout) fail inside all_reduce_fp8 / reduce_scatter_fp8.
    # Expected: the lists taken as tuples (equal, and hashed alike, to SegmentLayout((16, 8), (0, 1), 2)), or a
    # TypeError at construction. Cause: distributed/layout.py: SegmentLayout.__post_init__.
    from lightning_fp8.distributed import SegmentLayout

    layout = SegmentLayout([16, 8], [0, 1], 2)
    assert hash(layout) == hash(SegmentLayout((16, 8), (0, 1), 2))
    assert layout == SegmentLayout((16, 8), (0, 1), 2)


def test_fp8_reduce_scatter_refuses_a_state_that_is_no_comm_state_and_a_non_bool_flag():
    # Fixed (found by this sweep): FP8ReduceScatter(state, param_group, fp8=...) keeps whatever it is given: a state
    # that is no FP8CommState (None, the process group passed first) fails only inside FSDP2's backward ("'NoneType'
    # object has no attribute 'is_fp8'"), and fp8="no" turns FP8 on; FP8WeightAllGather beside it checks its fused flag
    # at construction. Expected: TypeError naming the argument at construction. Cause: distributed/fsdp2_comms.py:
    # FP8ReduceScatter.__init__.
    from lightning_fp8.distributed import FP8CommState, FP8ReduceScatter

    with pytest.raises(TypeError, match="FP8ReduceScatter"):
        FP8ReduceScatter(None, None)
    with pytest.raises(TypeError, match="fp8"):
        FP8ReduceScatter(FP8CommState(), None, fp8="no")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"fp8_dtype": torch.float16}, ValueError, "expected an FP8 dtype"),
     ({"algorithm": "fastest"}, ValueError, r"algorithm='fastest'\) is not supported"),
     ({"margin": 1.0}, TypeError, r"margin=1.0\) must be an int"),
     ({"margin": 17}, ValueError, r"margin=17\) must be <= 16"),
     ({"slice_numel": 0}, ValueError, r"slice_numel=0\): must be an int >= 1"),
     ({"grad_scaler": torch.amp.GradScaler("cpu", enabled=False)}, TypeError, "pass an FP8GradScaler"),
     ({"fused": "yes"}, TypeError, r"fused='yes'\)"),
     ({"fp8_params": "0.weight"}, TypeError, "got a str, not an iterable of tensors"),
     ({"process_group": "world"}, TypeError, r"process_group=\.\.\.\) got a str")],
)  # fmt: skip
def test_fp8_comm_state_refuses_bad_arguments(kwargs, error, match):
    from lightning_fp8.distributed import FP8CommState

    with pytest.raises(error, match=match):
        FP8CommState(**kwargs)
    state = FP8CommState(margin=np.int64(2), slice_numel=np.int64(1024))
    assert (state.margin, state.slice_numel) == (2, 1024)


def test_warnings_of_a_skipped_layer_name_it_once(monkeypatch):
    """A layer convert_to_fp8 leaves in high precision (20 features: no multiple of 16) is named in one warning,
    whose text says why; converting again does not warn again."""
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    model = nn.Sequential(nn.Linear(32, 20), nn.GELU(), nn.Linear(20, 16))
    with pytest.warns(UserWarning, match=r"not multiples of 16: 0 \(32->20\), 2 \(20->16\)") as record:
        convert_to_fp8(model)
    assert len([w for w in record if "multiples of 16" in str(w.message)]) == 1
    assert all(type(m) is nn.Linear for m in (model[0], model[2]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_to_fp8(model)
