"""``FP8CommState(fused=True)`` on CPU gradients without Triton's interpreter: the first collective used to fail inside
the hook (leaving DDP's reducer mid-step) with Triton's ``RuntimeError: 0 active drivers ([])``, which names neither
the argument nor the fix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# Run in a fresh interpreter: the tests' own process has TRITON_INTERPRET=1 (tests/conftest.py).
_CODE = """
import torch
from lightning_fp8.distributed import FP8CommState
try:
    FP8CommState(fused=True).use_fused(torch.device("cpu"))
except ValueError as e:
    print("ValueError:", e)
else:
    print("accepted")
"""


def _run(interpret: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", _CODE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_fused_kernels_on_cpu_gradients_need_the_interpreter_and_say_so():
    out = _run(interpret=False)
    assert "ValueError: FP8CommState(fused=True)" in out and "TRITON_INTERPRET=1" in out and "fused=None" in out, out
    assert _run(interpret=True).strip() == "accepted"


def test_fused_none_and_false_never_need_triton():
    from lightning_fp8.distributed import FP8CommState

    assert FP8CommState(fused=False).use_fused(torch.device("cpu")) is False
    assert FP8CommState().use_fused(torch.device("cpu")) is False
    # CUDA: Triton on GPUs of compute capability 8.9+ only (tests/core/test_pre_ada_gpus.py)


def test_fused_none_without_triton_takes_the_references_on_an_fp8_gpu(monkeypatch):
    """Without Triton (not installed: on Windows, where pyproject.toml does not ask for it; custom builds), a GPU of
    compute capability 8.9+ casts with the references (ops.use_triton), but ``fused=None`` picked the Triton kernels
    there: the first collective failed inside the hook with ``ModuleNotFoundError: No module named 'triton'``.
    ``fused=True`` says at construction that it needs Triton."""
    from lightning_fp8 import ops
    from lightning_fp8.distributed import FP8CommState

    monkeypatch.setattr(ops, "triton_available", lambda: False)
    monkeypatch.setattr(ops, "fp8_device", lambda device: device.type == "cuda")  # an H100, seen from a CPU machine
    gpu = torch.device("cuda", 0)
    assert FP8CommState().use_fused(gpu) is False
    assert FP8CommState(fused=False).use_fused(gpu) is False
    with pytest.raises(ValueError, match=r"FP8CommState\(fused=True\).*Triton is not installed.*fused=None"):
        FP8CommState(fused=True)
