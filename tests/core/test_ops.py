"""ops.has_fp8_gemm under torch.compile: no Dynamo warning about its functools.cache (users saw one per compile on a
GPU), the same answer as eagerly; ops.cast_to_fp8 and ops.amax check their arguments on the reference path as the Triton
path does."""

import warnings

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
