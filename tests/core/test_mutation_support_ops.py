"""What a mutation audit of ops.py (all but scaled_mm), formats.py and warnings.py found unpinned: ops.amaxes against
max |x| in float64 (NaN counts as inf, an empty tensor 0: the docstring's "amax of each tensor, the same values"),
the refusal of an unknown LIGHTNING_FP8_KERNELS value, rounded_to's rounding kept under inductor (eager's
``x.to(dtype).float()`` is the reference; inductor drops a plain conversion and back), autocast_off against
torch.is_autocast_enabled (and the emulated GEMM it guards against an fp64 product), fp8_device of an index-less "cuda"
device (the current one), a forced Triton path on the meta device (the references run there), formats.is_fp8 for both
formats, and warn_once's "once per process, on rank zero only" (STYLE.md habit 10)."""

import uuid
import warnings

import pytest
import torch

from lightning_fp8 import FP8Linear, ops
from lightning_fp8.formats import E4M3, E5M2, is_fp8
from lightning_fp8.warnings import warn_once


def _max_abs(t: torch.Tensor) -> float:
    # The spec in float64: max |x|, NaN counted as inf, 0 for no element; returned as fp32 (a float64 past fp32's
    # range is inf there).
    if t.numel() == 0:
        return 0.0
    a = t.detach().double().abs()
    return float(torch.tensor(float("inf") if torch.isnan(a).any() else a.max().item()).float())


def test_amaxes_are_max_abs_of_each_tensor():
    g = torch.Generator().manual_seed(0)
    with_nan = torch.randn(5, 7, generator=g)
    with_nan[3, 1] = float("nan")
    tensors = [
        torch.randn(6, 10, generator=g) * 30,
        torch.randn(33, generator=g).to(torch.bfloat16),
        torch.randn(4, 4, generator=g).to(torch.float16) * 1e3,
        torch.randn(3, generator=g, dtype=torch.float64) * 1e300,  # past fp32's range: inf
        with_nan,
        torch.empty(0, 4),
        -torch.rand(9, generator=g) - 2.0,  # all negative: the magnitude, not the largest value
    ]
    got = ops.amaxes(tensors)
    assert len(got) == len(tensors)
    for i, (t, a) in enumerate(zip(tensors, got, strict=True)):
        assert a.dtype == torch.float32 and a.shape == (), i
        assert a.item() == _max_abs(t), (i, a.item(), _max_abs(t))
        assert torch.equal(a, ops.amax(t)), i  # "the same values" as amax


def test_an_unknown_kernel_mode_is_refused(monkeypatch):
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", "cuda")
    with pytest.raises(ValueError, match=r"LIGHTNING_FP8_KERNELS='cuda' is not supported: use 'auto', 'triton'"):
        ops.amax(torch.randn(4))


def test_rounded_to_rounds_under_inductor_as_eagerly():
    torch._dynamo.reset()
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 3 + 1e-3  # few values exact in 16 bits

    def both(t):  # "* 1.0" around it: the conversions sit between ops inductor fuses
        return tuple(ops.rounded_to(t * 1.0, dtype) * 1.0 for dtype in (torch.float16, torch.bfloat16))

    compiled = torch.compile(both, backend="inductor", fullgraph=True)
    for dtype, got in zip((torch.float16, torch.bfloat16), compiled(x), strict=True):
        assert torch.equal(got, x.to(dtype).float()), dtype


def test_autocast_off_turns_autocast_off_and_keeps_the_emulated_gemm_exact():
    cpu = torch.device("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with ops.autocast_off(cpu):
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")
    g = torch.Generator().manual_seed(0)
    a_fp8 = (torch.randn(16, 32, generator=g) * 20).to(E4M3)
    b_fp8 = (torch.randn(48, 32, generator=g) * 20).to(E4M3).t()
    a_inv, b_inv = torch.tensor(0.25), torch.tensor(0.5)
    # FP8 values and power-of-two scales are exact: the float64 product is the reference, fp32 accumulation its error.
    want = (a_fp8.double() * 0.25) @ (b_fp8.double() * 0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ops.scaled_mm(a_fp8, b_fp8, a_inv, b_inv, torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)  # a bf16 matmul is off by ~1e-2


def test_fp8_device_of_cuda_without_an_index_is_the_current_device(monkeypatch):
    capabilities = {0: (8, 0), 1: (9, 0)}  # an A100 as cuda:0, an H100 current
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capabilities[device])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.version, "hip", None)
    ops._device_has_fp8_gemm.cache_clear()
    try:
        assert ops.fp8_device(torch.device("cuda"))
        assert not ops.fp8_device(torch.device("cuda", 0))
        assert ops.fp8_device(torch.device("cuda", 1))
    finally:
        ops._device_has_fp8_gemm.cache_clear()


@pytest.mark.skipif(not ops.triton_available(), reason="LIGHTNING_FP8_KERNELS=triton needs Triton installed")
def test_forced_triton_runs_the_references_on_the_meta_device(monkeypatch):
    # docs: a model built on meta for shape propagation runs the references' ops (its tensors have no data to launch).
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", "triton")
    assert not ops.use_triton(torch.empty(4, 16, device="meta"))
    with torch.device("meta"):
        layer = FP8Linear(16, 32)
        y = layer(torch.empty(4, 16))
    assert y.is_meta and y.shape == (4, 32)


def test_is_fp8_is_true_for_both_formats_only():
    for dtype in (E4M3, E5M2):
        assert is_fp8(torch.zeros(2, dtype=dtype)), dtype
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fnuz):
        assert not is_fp8(torch.zeros(2, dtype=dtype)), dtype


def _clear_rank(monkeypatch) -> None:
    for var in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


def test_warn_once_warns_once_per_message(monkeypatch):
    _clear_rank(monkeypatch)
    first, second = f"audit {uuid.uuid4()}", f"audit {uuid.uuid4()}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # so that Python's own registry hides nothing: the once is warn_once's
        for message in (first, first, second, first, second):
            warn_once(message)
    assert [str(w.message) for w in caught] == [first, second]


@pytest.mark.parametrize("var", ["RANK", "LOCAL_RANK", "SLURM_PROCID"])
def test_warn_once_is_silent_off_rank_zero(var, monkeypatch):
    _clear_rank(monkeypatch)
    monkeypatch.setenv(var, "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_once(f"audit {uuid.uuid4()}")
    assert caught == []
