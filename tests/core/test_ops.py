"""ops.has_fp8_gemm under torch.compile: no Dynamo warning about its functools.cache (users saw one per compile on a
GPU), the same answer as eagerly; ops.cast_to_fp8 and ops.amax check their arguments on the reference path as the Triton
path does."""

import warnings

import numpy as np
import pytest
import torch

from lightning_fp8 import ops


@pytest.mark.parametrize("capability", [(9, 0), (8, 0)])
def test_has_fp8_gemm_compiles_without_the_lru_cache_warning(capability, monkeypatch):
    # On CPU the function returns before the cached query for CPU tensors: ask about a CUDA device whose capability
    # the test gives, so the path a GPU takes is the one traced.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.delenv("LIGHTNING_FP8_EMULATE_GEMM", raising=False)
    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set(), raising=False)  # once per message, process
    device = torch.device("cuda", 0)

    def f(x):
        return x + 1 if ops.has_fp8_gemm(device) else x - 1

    torch._dynamo.reset()
    ops._device_has_fp8_gemm.cache_clear()  # the eager cache holds no capability but the one given here
    try:
        x = torch.randn(4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = torch.compile(f, backend="eager", fullgraph=True)(x)
        assert not [w for w in caught if "lru_cache" in str(w.message)]
        assert torch.equal(got, f(x))  # eagerly, through the cache
    finally:
        ops._device_has_fp8_gemm.cache_clear()  # nor afterwards
        torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounded_to_widens_every_bit_pattern_exactly(dtype):
    """ops.rounded_to (the bias of the emulated GEMM): through the bits of a bf16/fp16 tensor, exactly ``.float()``
    for every one of the 65536 bit patterns (zeros and subnormals with their sign, inf, NaN)."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    got, want = ops.rounded_to(x, dtype), x.float()
    assert got.dtype == torch.float32
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert bool(same.all()), x[~same][:8]
    y = torch.randn(1000) * 1e3
    assert torch.equal(ops.rounded_to(y, dtype), y.to(dtype).float())


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((torch.tensor([3 + 4j]), torch.tensor(1.0), torch.float8_e4m3fn), TypeError, "casts float16, bfloat16"),
        ((torch.arange(4), torch.tensor(1.0), torch.float8_e4m3fn), TypeError, "casts float16, bfloat16"),
        ((torch.ones(2, 2), torch.tensor([1.0, 64.0]), torch.float8_e4m3fn), TypeError, "one-element float32 tensor"),
        ((torch.ones(2, 2), torch.tensor(1.0, dtype=torch.float64), torch.float8_e4m3fn), TypeError, "float32 tensor"),
        ((torch.ones(2, 2), 1.0, torch.float8_e4m3fn), TypeError, "one-element float32 tensor.*got float"),
        ((torch.ones(2, 2), torch.tensor(1.0), torch.float32), TypeError, "fp8_dtype must be torch.float8_e4m3fn"),
        ((torch.ones(4), torch.tensor(1.0), torch.float8_e4m3fn, True), ValueError, r"transpose=True\) needs a 2-D"),
    ],
    ids=["complex", "int", "scale_per_column", "scale_float64", "scale_number", "not_fp8", "transpose_1d"],
)
def test_reference_cast_refuses_what_the_triton_cast_refuses(args, error, match, monkeypatch):
    # Found by a sweep: on the CPU path a complex input lost its imaginary part, a (2,) scale scaled each column apart,
    # float32 "FP8" came back as float32 and a 1-D "transpose" was returned as is.
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", "reference")
    with pytest.raises(error, match=match):
        ops.cast_to_fp8(*args)
    with pytest.raises(TypeError, match="casts float16, bfloat16"):
        ops.amax(torch.tensor([3 + 4j]))
    x = torch.tensor([[1.0, -600.0], [0.5, 2.0]])
    x_fp8, _, amax, saturated = ops.cast_to_fp8(x, torch.tensor(1.0), torch.float8_e4m3fn)
    assert torch.equal(x_fp8.float(), x.clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert amax.item() == 600.0 and saturated.item() == 1


E4M3 = torch.float8_e4m3fn
_X = torch.randn(4, 8)


@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize("transpose", ["no", 1, 0, None, torch.tensor(True), np.bool_(True)], ids=repr)
def test_cast_transpose_must_be_a_bool(kernels, transpose, monkeypatch):
    # transpose was read by its truth: "no" (or 1, a tensor) returned a transposed copy, None none, without a word.
    from lightning_fp8.kernels import cast

    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
    match = r"cast_to_fp8\(transpose=.*\): must be True or False \(a Python bool\), got"
    with pytest.raises(TypeError, match=match):
        ops.cast_to_fp8(_X, torch.tensor(1.0), E4M3, transpose=transpose)
    with pytest.raises(TypeError, match=match):
        cast.cast_to_fp8(_X, torch.tensor(1.0), E4M3, transpose)
    x_fp8, x_fp8_t, _, _ = ops.cast_to_fp8(_X, torch.tensor(1.0), E4M3, transpose=True)
    assert torch.equal(x_fp8_t.view(torch.uint8), x_fp8.t().contiguous().view(torch.uint8))


@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((_X.to(E4M3), torch.tensor(1.0), E4M3), TypeError, "got an FP8 tensor"),
        ((_X > 0, torch.tensor(1.0), E4M3), TypeError, "casts float16, bfloat16"),
        ((torch.randn(5), torch.tensor(1.0), E4M3), ValueError, "needs a 2-D tensor"),
        ((torch.randn(2, 3, 4), torch.tensor(1.0), E4M3), ValueError, "needs a 2-D tensor"),
        ((_X, torch.tensor(1.0, dtype=torch.float64), E4M3), TypeError, "one-element float32 tensor"),
        ((_X, torch.ones(4), E4M3), TypeError, "one-element float32 tensor"),
        ((_X, torch.tensor(1.0), torch.float16), TypeError, "fp8_dtype must be torch.float8_e4m3fn"),
    ],
    ids=["fp8", "bool", "1d", "3d", "scale_float64", "scale_per_row", "not_fp8"],
)
def test_recast_transposed_refuses_what_the_cast_refuses(kernels, args, error, match, monkeypatch):
    # Found by a sweep: the Triton path (the backward's weight recast on a GPU) took no checks: a bool tensor was cast
    # as 0/1, an FP8 one read with a garbage scale_inv, and the rest failed with an IndexError, a KeyError or an
    # InterpreterError; the reference path refused them through cast_to_fp8.
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
    with pytest.raises(error, match=match):
        ops.recast_transposed(*args)


@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"activation": "relu"}, ValueError, "activation='relu'.*'gelu'"),
        ({"activation": "gelu_backward"}, ValueError, "activation='gelu_backward'.*'gelu'"),
        ({"activation": None}, ValueError, "activation=None.*'gelu'"),
        ({"x_fp8": _X}, TypeError, "x_fp8 must be an FP8 tensor.*float32"),
        ({"x_fp8": _X.to(E4M3)[0]}, ValueError, "needs a 2-D x_fp8"),
        ({"x_scale_inv": torch.tensor(1.0, dtype=torch.float64)}, TypeError, "x_scale_inv must be a one-element"),
        ({"x_scale_inv": torch.ones(2)}, TypeError, "x_scale_inv must be a one-element float32"),
        ({"scale": torch.ones(2)}, TypeError, "scale must be a one-element float32"),
        ({"fp8_dtype": torch.float16}, TypeError, "fp8_dtype must be torch.float8_e4m3fn"),
    ],
    ids=[
        "relu",
        "gelu_backward",
        "none",
        "high_precision",
        "1d",
        "scale_inv_float64",
        "scale_inv_2",
        "scale_2",
        "fp16",
    ],
)
def test_recast_activation_transposed_checks_its_arguments(kernels, change, error, match, monkeypatch):
    # Found by a sweep: nothing was checked. On the Triton path an unknown activation cast x itself and a high-precision
    # x ignored x_scale_inv (the reference multiplied by it); on the reference path "relu" was an AttributeError, a 1-D
    # x came back as is and fp8_dtype=torch.float16 returned float16.
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
    args = {"x_fp8": (_X * 8).to(E4M3), "x_scale_inv": torch.tensor(0.125), "scale": torch.tensor(1.0),
            "fp8_dtype": E4M3, "activation": "gelu", **change}  # fmt: skip
    with pytest.raises(error, match=match):
        ops.recast_activation_transposed(**args)


@pytest.mark.parametrize("dtype", [[torch.float8_e4m3fn], {}, "float8_e4m3fn", torch.tensor(1.0).to(E4M3)],
                         ids=["list", "dict", "name", "tensor"])  # fmt: skip
def test_fp8_max_refuses_what_is_not_an_fp8_dtype_with_a_value_error(dtype):
    # Found by a sweep: a list or dict was "TypeError: unhashable type", and the name came back unquoted (got
    # float8_e4m3fn, as if it were the dtype).
    from lightning_fp8 import fp8_max

    with pytest.raises(ValueError, match=r"expected an FP8 dtype \(torch.float8_e4m3fn or torch.float8_e5m2\), got "):
        fp8_max(dtype)
    if isinstance(dtype, str):
        with pytest.raises(ValueError, match="got 'float8_e4m3fn'"):
            fp8_max(dtype)


@pytest.mark.parametrize(
    ("a", "out_dtype"),
    [(torch.randn(4, 16), torch.float32), (torch.randn(4, 16).to(E4M3), torch.int32)],
    ids=["high_precision_operand", "integer_output"],
)
def test_emulated_gemm_refuses_what_scaled_mm_refuses(a, out_dtype, monkeypatch):
    # Found by a sweep: the emulation (CPU, older GPUs) multiplied a high-precision operand as it was and truncated the
    # product to int32, where torch._scaled_mm refuses both.
    monkeypatch.setenv("LIGHTNING_FP8_EMULATE_GEMM", "1")
    b_fp8, one = torch.randn(8, 16).to(E4M3).t(), torch.tensor(1.0)
    with pytest.raises(TypeError, match="scaled_mm multiplies FP8 operands into a floating-point output"):
        ops.scaled_mm(a, b_fp8, one, one, out_dtype)
    assert ops.scaled_mm(a.to(E4M3), b_fp8, one, one, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "bad",
    [torch.arange(3), torch.tensor([3 + 4j]), torch.ones(2, dtype=torch.bool), torch.ones(2).to(E4M3)],
    ids=["int", "complex", "bool", "fp8"],
)
def test_amaxes_refuses_what_amax_refuses(bad):
    # Found by a sweep: ops.amaxes (the batched amax) returned 5.0 for 3 + 4j, which ops.amax refuses, and raised
    # torch's norm errors ("linalg.vector_norm: Expected a floating point...") for the rest.
    with pytest.raises(TypeError, match=r"amaxes \(tensor 1\)"):
        ops.amaxes([torch.randn(2), bad])
    with pytest.raises(TypeError):
        ops.amax(bad)


@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize("x_shape", [(), (24,), (3, 5)], ids=["0d", "1d", "2d"])
@pytest.mark.parametrize("scale_shape", [(1,), (1, 1), (1, 1, 1)], ids=["s1", "s11", "s111"])
def test_cast_keeps_the_input_shape_with_any_one_element_scale(kernels, x_shape, scale_shape, monkeypatch):
    # Found by running the Triton path against the reference: a one-element scale (which both paths accept) with more
    # dimensions than x broadcast the reference's x_fp8 to (1, 24) for a (24,) x, where the Triton cast kept x's shape.
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
    x = torch.randn(x_shape)
    x_fp8, _, amax, saturated = ops.cast_to_fp8(x, torch.full(scale_shape, 4.0), E4M3)
    assert x_fp8.shape == x.shape
    assert torch.equal(x_fp8.float(), (x * 4.0).to(E4M3).float())
    assert amax.shape == () and saturated.shape == ()
