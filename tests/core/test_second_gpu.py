"""A model on another GPU than the current one (``model.to("cuda:1")`` without ``torch.cuda.set_device(1)``, as a
script passing its ``torch.device`` around does). Triton launches on the current device, with its stream, where
torch's ops follow their tensors: every Triton path (casts, FP8AdamW's step, the FP8 weight copies' transposes, the
FP8 communication kernels) makes its tensor's device current around its launch (``ops.on_device``). Needs two GPUs
(``benchmarks/run_multi.sh`` runs it)."""

import contextlib

import pytest
import torch

from lightning_fp8 import FP8MLP, FP8AdamW, FP8Linear, ops

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (a model on the second one)")


def test_on_device_is_a_no_op_off_cuda():
    assert isinstance(ops.on_device(torch.ones(2)), contextlib.nullcontext)
    assert isinstance(ops.on_device(torch.ones(2, device="meta")), contextlib.nullcontext)


def _train(device: str) -> list[torch.Tensor]:
    """Three steps of an FP8Linear and an FP8MLP with FP8AdamW emitting FP8 weight copies (their transposes run in
    Triton too): outputs, input gradients and parameters, on the CPU."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(FP8Linear(64, 32), FP8MLP(32, 64)).to(device)
    opt = FP8AdamW(model.parameters(), lr=1e-2, emit_fp8_weights=True)
    out = []
    for _ in range(3):
        x = torch.randn(16, 64).to(device).requires_grad_()
        y = model(x)
        (y * torch.linspace(-1, 1, 32, device=device)).sum().backward()
        opt.step()
        opt.zero_grad()
        out += [y.detach(), x.grad]
    return [t.cpu() for t in [*out, *(p.detach() for p in model.parameters())]]


@pytest.mark.gpu
@two_gpus
def test_a_model_on_the_second_gpu_trains_as_on_the_current_one():
    torch.cuda.set_device(0)
    want = _train("cuda:0")
    got = _train("cuda:1")  # cuda:0 still the current device
    assert torch.cuda.current_device() == 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), i


@pytest.mark.gpu
@two_gpus
def test_the_comm_kernels_launch_on_their_buffers_gpu():
    from lightning_fp8.kernels.comm_table import block_table

    from lightning_fp8.distributed.quantize import segment_kernels

    torch.cuda.set_device(0)
    results = []
    for kernels in (segment_kernels(False), segment_kernels(True)):
        x = (torch.randn(300, generator=torch.Generator().manual_seed(0)) * 100).to("cuda:1")
        table = block_table([0, 100], [0, 100], [100, 200], [0, 1], [0, 1], device="cuda:1", block=64)
        amax = torch.zeros(2, device="cuda:1")
        kernels.segment_amax(x, table, amax)
        q, n_sat = torch.zeros(300, dtype=torch.uint8, device="cuda:1"), torch.tensor(0, device="cuda:1")
        kernels.quantize(x, table, amax, torch.float8_e4m3fn, q, n_sat)
        results.append((amax.cpu(), q.cpu()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
