"""GPUs below compute capability 8.9 (A100, V100, RTX 30xx): Triton refuses its E4M3 type there ("type fp8e4nv not
supported in this architecture"), so the casts, the FP8AdamW step and the gradient communication run the PyTorch
references on them, as they do on the CPU, and the GEMMs are emulated. A forced Triton path says why it cannot run.
On a CPU machine the capability query is what the tests give; on an sm89+ GPU the whole training step runs with the
capability of an A100 given, against the reference path."""

import pytest
import torch

from lightning_fp8 import FP8AdamW, FP8Linear, ops
from lightning_fp8.distributed import FP8CommState


@pytest.fixture
def capability(monkeypatch):
    """Sets the capability every CUDA device reports; the cached answers are dropped before and after."""

    def give(value: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: value)
        ops._device_has_fp8_gemm.cache_clear()

    yield give
    ops._device_has_fp8_gemm.cache_clear()


@pytest.mark.parametrize(("given", "fp8"), [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)])
def test_fp8_device_is_compute_capability_8_9_and_up(given, fp8, capability, monkeypatch):
    monkeypatch.delenv("LIGHTNING_FP8_EMULATE_GEMM", raising=False)
    capability(given)
    cuda = torch.device("cuda", 0)
    assert ops.fp8_device(cuda) is fp8
    assert ops.has_fp8_gemm(cuda) is fp8
    assert not ops.fp8_device(torch.device("cpu"))
    monkeypatch.setenv("LIGHTNING_FP8_EMULATE_GEMM", "1")  # emulated GEMMs; the Triton casts are still there
    assert not ops.has_fp8_gemm(cuda)
    assert ops.fp8_device(cuda) is fp8


@pytest.mark.parametrize("given", [(9, 4), (9, 5)])  # MI300 (gfx942), MI350 (gfx950)
def test_amd_gpus_run_the_references(given, capability, monkeypatch):
    # A ROCm build calls AMD GPUs "cuda" with their gfx version as the capability: MI300's 9.4 passed the 8.9 test,
    # so the OCP E4M3/E5M2 casts and GEMMs were taken on a GPU whose FP8 formats are the fnuz ones.
    monkeypatch.delenv("LIGHTNING_FP8_EMULATE_GEMM", raising=False)
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    capability(given)
    cuda = torch.device("cuda", 0)
    assert not ops.fp8_device(cuda)
    assert not ops.has_fp8_gemm(cuda)
    assert not FP8CommState().use_fused(cuda)
    with pytest.raises(ValueError, match=r"cuda:0 is an AMD GPU .* fnuz.*fused=None"):
        FP8CommState(fused=True).use_fused(cuda)
    monkeypatch.setattr(torch.version, "hip", None)
    ops._device_has_fp8_gemm.cache_clear()
    assert ops.fp8_device(cuda)  # the same capability from a CUDA build


def test_fp8_comm_state_runs_the_references_below_8_9(capability):
    # Before: fused=None picked the Triton kernels on any CUDA device, which fail to compile on an A100.
    cuda = torch.device("cuda", 0)
    capability((9, 0))
    assert FP8CommState().use_fused(cuda)
    capability((8, 0))
    assert not FP8CommState().use_fused(cuda)
    assert not FP8CommState(fused=False).use_fused(cuda)
    with pytest.raises(ValueError, match=r"cuda:0 has compute capability 8\.0, for which Triton has no E4M3"):
        FP8CommState(fused=True).use_fused(cuda)


def _train(kernels: str, monkeypatch) -> list[torch.Tensor]:
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
    torch.manual_seed(0)
    layer = FP8Linear(64, 32).cuda()
    opt = FP8AdamW(layer.parameters(), lr=1e-2)
    outs = []
    for _ in range(3):
        x = torch.randn(16, 64, device="cuda", requires_grad=True)
        y = layer(x)
        (y * torch.linspace(-1, 1, 32, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
        outs += [y.detach(), x.grad]
    return [*outs, *(p.detach().float() for p in layer.parameters())]


@pytest.mark.gpu
def test_a_gpu_below_8_9_trains_on_the_references(capability, monkeypatch):
    # The capability of an A100 given to an sm89+ GPU: the default (auto) path must not launch a Triton kernel (on
    # an A100 every one of them failed to compile), and it trains as the reference path does, bit for bit.
    from lightning_fp8.kernels import adamw, cast, grad_cast, quantize

    capability((8, 0))
    want = _train("reference", monkeypatch)
    for module in (cast, quantize, grad_cast, adamw):
        for name in dir(module):
            if (
                not name.startswith("_")
                and callable(getattr(module, name))
                and getattr(module, name).__module__ == module.__name__
            ):
                monkeypatch.setattr(module, name, _no_triton(f"{module.__name__}.{name}"))
    got = _train("auto", monkeypatch)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), i
    refusal = r"LIGHTNING_FP8_KERNELS=triton, but cuda:\d has compute capability 8\.0.*needs 8\.9"
    with pytest.raises(RuntimeError, match=refusal):
        _train("triton", monkeypatch)


def _no_triton(name: str):
    def launch(*args, **kwargs):
        raise AssertionError(f"{name} ran on a GPU below compute capability 8.9")

    return launch


def test_forced_triton_without_triton_says_so(monkeypatch):
    # A bare ModuleNotFoundError from the first kernel's import named neither the variable nor what to do.
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", "triton")
    monkeypatch.setattr(ops, "_TRITON_FOUND", False)
    with pytest.raises(RuntimeError, match=r"LIGHTNING_FP8_KERNELS=triton, but Triton is not installed.*unset"):
        ops.use_triton(torch.ones(4))
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", "auto")
    assert ops.use_triton(torch.ones(4)) is False
