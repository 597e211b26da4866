"""Training under ``torch.set_default_device(...)`` (common in LLM scripts: ``torch.set_default_device("cuda")``).

The library's own host-side tensors ask for the CPU by name: the pinned host copy of a scaling state's amax (under a
CUDA default device every FP8 forward failed, "Only dense CPU tensors can be pinned"), FP8AdamW's step counters (kept
on the CPU, as torch.optim.AdamW keeps them) and their checkpoint load, the reference AdamW's decay constant. A run
under a default device equals the run without one, bit for bit. On a CPU machine the default device is ``meta``: a
tensor the library made without naming a device lands there and fails (what lands on the GPU under ``"cuda"``).
"""

import contextlib
import io

import pytest
import torch

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8
from tests.core.gpt_tiny import TinyGPT


def _train(
    default_device: str | None, device: str, recipe: str, emit: bool, compiled: bool = False
) -> list[torch.Tensor]:
    """Three steps, a checkpoint round trip (torch.load(weights_only=True)), one more step: the losses and weights.
    The model is built on ``device`` without naming it where that is the default device, as a script does."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 16), generator=gen) for _ in range(4)]
    if default_device is not None:
        torch.set_default_device(default_device)
    try:
        with torch.device(device) if default_device != device else contextlib.nullcontext():
            model = convert_to_fp8(TinyGPT(), recipe=recipe)
        step = torch.compile(model) if compiled else model
        scaler = FP8GradScaler(model=model)
        opt = FP8AdamW(model.parameters(), lr=1e-2, recipe=recipe, grad_scaler=scaler, emit_fp8_weights=emit)
        losses = []
        for i, idx in enumerate(batches):
            if i == 3:
                buffer = io.BytesIO()
                torch.save({"opt": opt.state_dict(), "scaler": scaler.state_dict()}, buffer)
                buffer.seek(0)
                saved = torch.load(buffer, weights_only=True)
                opt.load_state_dict(saved["opt"])
                scaler.load_state_dict(saved["scaler"])
            idx = idx.to(device)
            loss = step(idx, idx)
            scaler.scale_loss(loss).backward()
            scaler.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.detach())
        assert all(state["step"].device.type == "cpu" for state in opt.state.values())  # as torch.optim.AdamW's
        return [*losses, *(p.detach().clone() for p in model.parameters())]
    finally:
        torch.set_default_device(None)


def _assert_equal(run: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    assert len(run) == len(reference)
    for got, expected in zip(run, reference, strict=True):
        assert got.device == expected.device and torch.equal(got, expected)


@pytest.mark.parametrize("recipe", ["fp8-lm", "fp8-lm-o1", "fp8-lm-current"])
def test_a_cpu_run_under_another_default_device_equals_the_plain_run(recipe):
    _assert_equal(_train("meta", "cpu", recipe, emit=False), _train(None, "cpu", recipe, emit=False))


@pytest.mark.gpu
@pytest.mark.parametrize("emit", [False, True])
@pytest.mark.parametrize("recipe", ["fp8-lm", "fp8-lm-o1", "fp8-lm-current"])
def test_a_run_under_the_cuda_default_device_equals_the_plain_run(recipe, emit):
    _assert_equal(_train("cuda", "cuda", recipe, emit), _train(None, "cuda", recipe, emit))


@pytest.mark.gpu
def test_a_compiled_run_under_the_cuda_default_device_equals_the_plain_one():
    # Deterministic algorithms: inductor otherwise sums the embedding's gradient with atomic adds, in an order that
    # varies from run to run (on a busy H100 the two runs' last embedding updates differed; their losses did not).
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _assert_equal(_train("cuda", "cuda", "fp8-lm", False, True), _train(None, "cuda", "fp8-lm", False, True))
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
