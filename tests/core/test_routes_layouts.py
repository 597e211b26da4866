"""Input layouts and call forms of FP8Linear and FP8MLP, from a route sweep: the ways a user of ``nn.Linear`` feeds and
calls it (views that are not contiguous, every input rank, empty batches, no_grad / frozen / shared / functional
calls, keyword calls, checkpoints and conversions of the module) against an independent reference.

The reference quantizes ``x``, ``W`` and the output gradient itself, with DESIGN.md's per-tensor power-of-two scale
(``tests.numerics.pow2_scale`` of the tensor's float64 amax) and torch's own FP8 casts as the rounding oracle, and
multiplies in float64: with current scaling ("fp8-lm-current") that is the layer's result exactly, up to the fp32
accumulation of the emulated GEMM. With delayed scaling a route is compared with the same layer fed the contiguous
tensor (the same configuration reached by another route): bit for bit, outputs, gradients and scaling state.
"""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_fp8.warnings
from lightning_fp8 import FP8MLP, FP8Linear, convert_to_fp8
from tests.copying import COPY_ROUTES, copy_by
from tests.numerics import assert_same, pow2_scale, sqnr

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CURRENT = "fp8-lm-current"
# The emulated GEMMs multiply FP8 values times power-of-two scales, exact in fp32: they differ from the float64
# reference only by fp32 accumulation order and the fp32 result's rounding (about 1e-7 relative at these sizes).
EMULATION_TOL = {"rtol": 1e-5, "atol": 1e-5}
# FP8MLP against its layers called one after another: both cast the same fp32 GELU values (torch's erf and the casts'
# agree to an ulp or so, which at most moves a value to its neighbouring FP8 code now and then), as in test_mlp.py.
SAME_CASTS_SQNR_DB = 60.0


def quantized(t: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``t`` as its FP8 values times ``scale_inv`` in float64: the scale from its own amax, torch's saturating cast."""
    t = t.detach().double()
    amax = t.abs().max().item() if t.numel() else 0.0
    if amax == 0:  # no information: every value is 0, whatever the scale kept
        return t
    fmax = torch.finfo(fp8_dtype).max
    scale = pow2_scale(amax, fmax)
    return (t.float() * scale).clamp(-fmax, fmax).to(fp8_dtype).double() / scale


def reference(layer: nn.Linear, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(y, dx, dW, db)`` of current scaling in float64, ``x`` of any rank (the layer's tokens are its rows)."""
    x_q = quantized(x.reshape(-1, x.shape[-1]), E4M3)
    w_q = quantized(layer.weight, E4M3)
    dy_2d = dy.reshape(-1, dy.shape[-1])
    dy_q = quantized(dy_2d, E5M2)
    y = x_q @ w_q.T + (0 if layer.bias is None else layer.bias.detach().double())
    return y.reshape(*x.shape[:-1], -1), (dy_q @ w_q).reshape(x.shape), dy_q.T @ x_q, dy_2d.double().sum(0)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected, **EMULATION_TOL)


def run(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple:
    """Forward and backward of ``layer`` on ``x`` as it is laid out (a leaf of ``x``'s strides): output, input gradient
    and parameter gradients."""
    leaf = x.detach().requires_grad_()
    y = layer(leaf)
    y.backward(dy.to(y.dtype))
    return y, leaf.grad, [p.grad for p in layer.parameters()]


# Each route: the values of a contiguous (2, 3, 32) tensor reached through another layout.
ROUTES = {
    "transposed": lambda x: x.reshape(6, 32).T.contiguous().T.reshape(x.shape),
    "storage_offset": lambda x: torch.cat([torch.randn(5, 32), x.reshape(6, 32)])[5:].view(x.shape),
    "every_other_row": lambda x: torch.stack([x.reshape(6, 32), torch.randn(6, 32)], 1).reshape(12, 32)[::2],
    "every_other_column": lambda x: torch.stack([x, torch.randn(x.shape)], -1).flatten(-2)[..., ::2],
    "column_slice": lambda x: torch.cat([torch.randn(2, 3, 8), x, torch.randn(2, 3, 8)], -1)[..., 8:40],
    "channels_last": lambda x: x.reshape(2, 3, 1, 32).contiguous(memory_format=torch.channels_last),
    # (S, B, E) attention output (seq-first, nn.MultiheadAttention's default) transposed to (B, S, E) for the projection
    "sequence_first": lambda x: x.transpose(0, 1).contiguous().transpose(0, 1),
    "unsqueezed_and_permuted": lambda x: x.reshape(6, 32).T.contiguous().T.reshape(2, 3, 1, 32).permute(0, 2, 1, 3),
}


@pytest.mark.parametrize("kernels", ["reference", "triton"])  # the Triton casts under the interpreter on the CPU
@pytest.mark.parametrize("route", ROUTES)
def test_non_contiguous_inputs_give_the_quantized_reference_and_the_contiguous_result(route, kernels, monkeypatch):
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
    torch.manual_seed(0)
    layer = FP8Linear(32, 48, recipe=CURRENT)
    twin = copy.deepcopy(layer)
    x = torch.randn(2, 3, 32) * 3
    routed = ROUTES[route](x)
    assert torch.equal(routed.reshape(-1, 32), x.reshape(-1, 32))
    assert not routed.is_contiguous() or routed.storage_offset() > 0  # (a slice at an offset is contiguous)
    dy = torch.randn(*routed.shape[:-1], 48)
    y, dx, (dw, db) = run(layer, routed, dy)
    y_ref, dx_ref, dw_ref, db_ref = reference(layer, routed, dy)
    assert y.shape == (*routed.shape[:-1], 48) and dx.shape == routed.shape
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref), (db, db_ref)):
        assert_close(got, want)
    # The plain contiguous route of an identical layer: the same values, so the same bits.
    y2, dx2, grads2 = run(twin, routed.contiguous(), dy)
    assert_same([y, dx, dw, db], [y2, dx2, *grads2])


def test_stride_zero_expanded_inputs_sum_their_gradients_as_nn_linear():
    """``x.expand(...)`` of one row (a broadcast token, learned queries): the gradient of the row is the sum over its
    copies, and the layer sees every copy."""
    layer = FP8Linear(32, 48, recipe=CURRENT)
    row = torch.randn(1, 32, requires_grad=True)
    dy = torch.randn(2, 3, 48)
    y = layer(row.expand(2, 3, 32))
    y.backward(dy)
    y_ref, dx_ref, dw_ref, db_ref = reference(layer, row.expand(2, 3, 32), dy)
    assert_close(y, y_ref)
    assert_close(row.grad, dx_ref.sum((0, 1)).reshape(1, 32))
    assert_close(layer.weight.grad, dw_ref)
    assert_close(layer.bias.grad, db_ref)


@pytest.mark.parametrize("recipe", ["fp8-lm", CURRENT])
@pytest.mark.parametrize("module", ["linear", "mlp"])
def test_delayed_scaling_reaches_the_same_state_through_any_layout(recipe, module):
    """Three steps through non-contiguous layouts (and autocast) against an identical module fed contiguous tensors:
    the delayed scales come from the same histories, so everything is bit for bit the same."""
    torch.manual_seed(0)
    routed_module = FP8Linear(32, 48, recipe=recipe) if module == "linear" else FP8MLP(32, 64, 48, recipe=recipe)
    plain = copy.deepcopy(routed_module)
    for step, route in enumerate(("transposed", "channels_last", "sequence_first")):
        x = torch.randn(2, 3, 32) * 4.0**step  # a range that moves: the delayed scales change with it
        routed = ROUTES[route](x)
        dy = torch.randn(*routed.shape[:-1], 48)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=step == 2):
            y, dx, grads = run(routed_module, routed, dy)
            y2, dx2, grads2 = run(plain, routed.contiguous(), dy)
        assert_same([y, dx, grads], [y2, dx2, grads2])
        for m in (routed_module, plain):
            m.zero_grad()
    assert_same(dict(routed_module.named_buffers()), dict(plain.named_buffers()))


@pytest.mark.parametrize("shape", [(32,), (5, 32), (2, 3, 32), (2, 1, 3, 32)], ids=["1d", "2d", "3d", "4d"])
def test_every_input_rank_as_nn_linear(shape):
    """A 1-D input (one token, no batch dimension) gives a 1-D output as nn.Linear's; higher ranks keep their leading
    dimensions."""
    layer = FP8Linear(32, 48, recipe=CURRENT)
    linear = nn.Linear(32, 48)
    linear.load_state_dict(layer.state_dict())
    x = torch.randn(shape)
    dy = torch.randn(*shape[:-1], 48)
    y, dx, (dw, db) = run(layer, x, dy)
    assert y.shape == linear(x).shape == (*shape[:-1], 48) and dx.shape == shape
    for got, want in zip((y, dx, dw, db), reference(layer, x, dy), strict=True):
        assert_close(got, want)


@pytest.mark.parametrize("recipe", ["fp8-lm", CURRENT])
@pytest.mark.parametrize("shape", [(0, 32), (2, 0, 32)], ids=["0xK", "2x0xK"])
@pytest.mark.parametrize("module", ["linear", "mlp"])
def test_empty_batches_give_nn_linears_results_and_keep_the_scaling_state(recipe, shape, module):
    """A batch without tokens (an MoE expert that got none) gives nn.Linear's empty output, an empty input gradient and
    zero parameter gradients; its amax of 0 carries no information: the scales stay, and the next steps are bit for bit
    those of a twin that never saw the empty batch, also where it comes first (the first casts are not used up)."""
    torch.manual_seed(0)

    def make():
        return FP8Linear(32, 48, recipe=recipe) if module == "linear" else FP8MLP(32, 64, 48, recipe=recipe)

    for warm_up in (False, True):
        fp8 = make()
        twin = copy.deepcopy(fp8)
        if warm_up:
            for m in (fp8, twin):
                run(m, torch.randn(4, 32), torch.randn(4, 48))
                m.zero_grad()
        # the scales of the casts that saw no values (the weight's cast measures the weight, which is not empty)
        scales = {k: v.clone() for k, v in fp8.named_buffers() if k.endswith(("input.scale", "grad_output.scale"))}
        y, dx, grads = run(fp8, torch.randn(shape), torch.randn(*shape[:-1], 48))
        assert y.shape == (*shape[:-1], 48) and dx.shape == shape
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
        assert all(torch.equal(v, fp8.get_buffer(k)) for k, v in scales.items())
        fp8.zero_grad()
        for step in range(2):
            x, dy = torch.randn(5, 32) * 3.0**step, torch.randn(5, 48)
            assert_same(run(fp8, x, dy), run(twin, x, dy))
            fp8.zero_grad()
            twin.zero_grad()
            assert_same(
                {k: v for k, v in fp8.named_buffers() if k.endswith(".scale")},
                {k: v for k, v in twin.named_buffers() if k.endswith(".scale")},
            )


@pytest.mark.parametrize("frozen", ["weight", "bias", "weight_and_bias"])
def test_frozen_parameters_get_no_gradient_and_the_rest_the_reference(frozen):
    layer = FP8Linear(32, 48, recipe=CURRENT)
    for name in frozen.split("_and_"):
        getattr(layer, name).requires_grad_(False)
    x, dy = torch.randn(6, 32), torch.randn(6, 48)
    y, dx, _ = run(layer, x, dy)
    y_ref, dx_ref, dw_ref, db_ref = reference(layer, x, dy)
    assert_close(y, y_ref)
    assert_close(dx, dx_ref)
    for param, want in ((layer.weight, dw_ref), (layer.bias, db_ref)):
        if param.requires_grad:
            assert_close(param.grad, want)
        else:
            assert param.grad is None


def test_autograd_grad_with_respect_to_the_input_alone_leaves_the_parameters_alone():
    layer = FP8Linear(32, 48, recipe=CURRENT)
    x, dy = torch.randn(2, 3, 32, requires_grad=True), torch.randn(2, 3, 48)
    (dx,) = torch.autograd.grad(layer(x), x, dy)
    assert_close(dx, reference(layer, x, dy)[1])
    assert layer.weight.grad is None and layer.bias.grad is None


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "eval"])
def test_forwards_without_a_graph_give_the_reference_output(mode):
    layer = FP8Linear(32, 48, recipe=CURRENT)
    x = torch.randn(2, 3, 32, requires_grad=True)
    if mode == "eval":
        layer.eval()
        y = layer(x)
        assert y.requires_grad
    else:
        with getattr(torch, mode)():
            y = layer(x)
        assert not y.requires_grad
    assert_close(y, reference(layer, x, torch.zeros(2, 3, 48))[0])


def test_two_backwards_of_a_retained_graph_accumulate_twice_the_gradients():
    layer = FP8Linear(32, 48, recipe=CURRENT)
    x, dy = torch.randn(6, 32, requires_grad=True), torch.randn(6, 48)
    y = layer(x)
    y.backward(dy, retain_graph=True)
    y.backward(dy)
    _, dx_ref, dw_ref, db_ref = reference(layer, x, dy)
    for got, want in ((x.grad, dx_ref), (layer.weight.grad, dw_ref), (layer.bias.grad, db_ref)):
        assert_close(got, 2 * want)


@pytest.mark.parametrize("backwards", ["one", "two"], ids=["shared_in_one_graph", "accumulated_micro_batches"])
def test_a_layer_called_twice_accumulates_each_calls_gradients(backwards):
    """Weight sharing within one forward (one backward through both uses) and gradient accumulation over two
    forward/backward passes before one step: the parameter gradients are the sums of each call's, as nn.Linear's."""
    layer = FP8Linear(32, 48, recipe=CURRENT)
    xs = [torch.randn(6, 32, requires_grad=True), torch.randn(2, 5, 32, requires_grad=True)]
    dys = [torch.randn(6, 48), torch.randn(2, 5, 48)]
    if backwards == "one":
        torch.autograd.backward([layer(x) for x in xs], dys)
    else:
        for x, dy in zip(xs, dys, strict=True):
            layer(x).backward(dy)
    refs = [reference(layer, x, dy) for x, dy in zip(xs, dys, strict=True)]
    for x, ref in zip(xs, refs, strict=True):
        assert_close(x.grad, ref[1])
    assert_close(layer.weight.grad, refs[0][2] + refs[1][2])
    assert_close(layer.bias.grad, refs[0][3] + refs[1][3])


def test_functional_call_computes_with_the_parameters_given():
    layer = FP8Linear(32, 48, recipe=CURRENT)
    params = {name: (p.detach() * 2).requires_grad_() for name, p in layer.named_parameters()}
    x, dy = torch.randn(6, 32), torch.randn(6, 48)
    y = torch.func.functional_call(layer, params, (x,))
    y.backward(dy)
    as_given = FP8Linear(32, 48, recipe=CURRENT)
    as_given.load_state_dict(params)
    y_ref, _, dw_ref, db_ref = reference(as_given, x, dy)
    assert_close(y, y_ref)
    assert_close(params["weight"].grad, dw_ref)
    assert_close(params["bias"].grad, db_ref)
    assert layer.weight.grad is None and layer.bias.grad is None


def test_the_input_can_be_passed_by_keyword_as_to_nn_linear():
    """``nn.Linear.forward(input)``: ``layer(input=x)`` and ``functional_call(layer, params, (), {"input": x})`` are
    nn.Linear call forms, which FP8Linear refused with a TypeError (its argument was named ``x``)."""
    layer = FP8Linear(32, 48, recipe=CURRENT)
    linear = nn.Linear(32, 48)
    linear.load_state_dict(layer.state_dict())
    x, dy = torch.randn(2, 3, 32, requires_grad=True), torch.randn(2, 3, 48)
    assert linear(input=x).shape == (2, 3, 48)
    y = layer(input=x)
    y.backward(dy)
    y_ref, dx_ref, dw_ref, _ = reference(layer, x, dy)
    assert_close(y, y_ref)
    assert_close(x.grad, dx_ref)
    assert_close(layer.weight.grad, dw_ref)
    params = dict(layer.named_parameters())
    assert_same(torch.func.functional_call(layer, params, (), {"input": x}), y)
    assert_same(layer(x), y)


@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_round_trips_with_nn_linear(bias):
    """FP8Linear and nn.Linear load each other's state_dicts (strict), also through torch.save and
    ``torch.load(weights_only=True)``; a bias-less state_dict loads non-strictly into a layer with a bias, naming the
    missing key, and the layer computes with the weight loaded."""
    linear = nn.Linear(32, 48, bias=bias)
    layer = FP8Linear(32, 48, bias=bias, recipe=CURRENT)
    buffer = io.BytesIO()
    torch.save(linear.state_dict(), buffer)
    buffer.seek(0)
    layer.load_state_dict(torch.load(buffer, weights_only=True))
    back = nn.Linear(32, 48, bias=bias)
    back.load_state_dict(layer.state_dict())
    assert_same(dict(back.state_dict()), dict(linear.state_dict()))
    x = torch.randn(6, 32)
    assert_close(layer(x), reference(linear, x, torch.zeros(6, 48))[0])
    other = FP8Linear(32, 48, bias=not bias, recipe=CURRENT)
    with pytest.raises(RuntimeError, match="Missing key|Unexpected key"):
        other.load_state_dict(linear.state_dict())
    result = other.load_state_dict(linear.state_dict(), strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (([], ["bias"]) if bias else (["bias"], []))
    assert torch.equal(other.weight, linear.weight)


@pytest.mark.parametrize("how", COPY_ROUTES)
def test_copies_of_a_trained_layer_continue_as_the_layer(how):
    """Delayed scaling: the copy carries the scaling state, so its next steps are bit for bit the original's."""
    layer = FP8Linear(32, 48)
    run(layer, torch.randn(6, 32), torch.randn(6, 48))
    copied = copy_by(layer, how)
    for _ in range(2):
        layer.zero_grad()
        copied.zero_grad()
        x, dy = torch.randn(6, 32) * 5, torch.randn(6, 48)
        assert_same(run(copied, x, dy), run(layer, x, dy))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_layer_cast_with_to_dtype_computes_in_that_dtype_and_keeps_fp32_scaling_state(dtype):
    layer = FP8Linear(32, 48, recipe=CURRENT).to(dtype)
    assert layer.weight.dtype == layer.bias.dtype == dtype
    assert all(b.dtype in (torch.float32, torch.int64, torch.int32) for b in layer.buffers())
    x, dy = torch.randn(6, 32, dtype=dtype), torch.randn(6, 48, dtype=dtype)
    y, dx, (dw, db) = run(layer, x, dy)
    assert y.dtype == dx.dtype == dw.dtype == db.dtype == dtype
    # The reference rounded once to the layer's dtype, as the emulated GEMM's fp32 result is (a result on a tie of
    # that dtype may round the other way from fp32 than from float64: torch's default tolerance for the dtype).
    for got, want in zip((y, dx, dw, db), reference(layer, x, dy), strict=True):
        torch.testing.assert_close(got, want.to(dtype))


def test_meta_built_layer_materialized_with_to_empty_and_reset_parameters():
    layer = FP8Linear(32, 48, recipe="fp8-lm", device="meta")
    assert layer(torch.randn(2, 3, 32, device="meta")).shape == (2, 3, 48)  # shape propagation
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    torch.manual_seed(3)
    fresh = FP8Linear(32, 48, recipe="fp8-lm")
    fresh.load_state_dict(layer.state_dict())
    x, dy = torch.randn(6, 32), torch.randn(6, 48)
    assert_same(run(layer, x, dy), run(fresh, x, dy))  # the first casts of fresh states: own amaxes
    assert_same(dict(layer.named_buffers()), dict(fresh.named_buffers()))
    assert_close(layer(x), reference(layer, x, dy)[0])


def test_apply_init_after_conversion_trains_with_the_new_weights_and_sizes_off_16_stay_nn_linear(monkeypatch):
    """``model.apply(init)`` after convert_to_fp8 initializes the FP8 layers as the nn.Linear ones (weights are cast
    with their own amax, so the new range needs no history); a layer whose sizes are not multiples of 16 stays an
    nn.Linear, named in a warning."""

    def init(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)

    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())  # warn_once warns once per process: again here
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 20))
    with pytest.warns(UserWarning, match=r"not multiples of 16: 2 \(48->20\)"):
        convert_to_fp8(model, CURRENT)
    assert type(model[0]) is FP8Linear and type(model[2]) is nn.Linear
    model[0](torch.randn(4, 32))  # a forward before the initialization
    model.apply(init)
    x, dy = torch.randn(6, 32), torch.randn(6, 48)
    y, dx, (dw, db) = run(model[0], x, dy)
    for got, want in zip((y, dx, dw, db), reference(model[0], x, dy), strict=True):
        assert_close(got, want)
    assert torch.equal(model[0].bias, torch.zeros(48))


@pytest.mark.parametrize("recipe", ["fp8-lm", CURRENT])
@pytest.mark.parametrize(
    "form", ["1d", "transposed", "sequence_first", "no_grad", "shared", "retain_graph", "functional_call"]
)
def test_mlp_routes_match_the_unfused_layers(recipe, form):
    """FP8MLP on the routes and call forms above against its own layers called one after another,
    ``proj(gelu(fc(x)))``: the same casts (fp32 GELU on both sides), so the same scales and FP8-exact results."""
    torch.manual_seed(0)
    mlp = FP8MLP(32, 64, recipe=recipe)
    twin = copy.deepcopy(mlp)

    def unfused(x):
        return twin.proj(F.gelu(twin.fc(x)))

    x = torch.randn(32) if form == "1d" else torch.randn(2, 3, 32)
    if form in ("transposed", "sequence_first"):
        x = ROUTES[form](x)
    dy = torch.randn(*x.shape[:-1], 32)
    results = []
    for fn, module in ((mlp, mlp), (unfused, twin)):
        leaf = x.detach().clone().requires_grad_()
        assert leaf.stride() == x.stride()  # (clone keeps a dense layout)
        if form == "no_grad":
            with torch.no_grad():
                results.append([fn(leaf)])
            continue
        if form == "shared":
            y = fn(leaf)
            torch.autograd.backward([y, fn(leaf * 2)], [dy, dy])
        elif form == "retain_graph":
            y = fn(leaf)
            y.backward(dy, retain_graph=True)
            y.backward(dy)
        elif form == "functional_call" and module is mlp:
            y = torch.func.functional_call(mlp, dict(mlp.named_parameters()), (leaf,))
            y.backward(dy)
        else:
            y = fn(leaf)
            y.backward(dy)
        results.append([y, leaf.grad, *(p.grad for p in module.parameters())])
    for got, want in zip(*results, strict=True):
        assert got.shape == want.shape and sqnr(got, want) > SAME_CASTS_SQNR_DB
    for key, state in mlp.named_buffers():
        if key.endswith(".scale"):
            assert torch.equal(state, twin.get_buffer(key)), key
