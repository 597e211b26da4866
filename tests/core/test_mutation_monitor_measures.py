"""What HealthMonitor is given to watch, measured: behaviours of lightning_fp8/monitoring/measures.py that a mutation
audit found unpinned. memory_gib('cpu') is the process's peak RSS in GiB, checked against the kernel's own count
(/proc/self/status's VmHWM, in kB = KiB); global_norm's ``device`` applies only "when ``tensors`` is empty", checked
against torch.linalg.vector_norm in float64."""

import sys
from pathlib import Path

import pytest
import torch

from lightning_fp8.health import global_norm, memory_gib


def _peak_rss_kib_from_proc() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            value, unit = line.split()[1:3]
            assert unit == "kB"  # the kernel's kB are KiB (1024 bytes)
            return float(value)
    pytest.skip("/proc/self/status has no VmHWM line")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc/self/status")
def test_cpu_memory_is_the_peak_rss_in_gib():
    keep = torch.ones(8 * 2**20, dtype=torch.uint8)  # the peak is the process's, whatever it holds
    got = memory_gib("cpu")
    expected = _peak_rss_kib_from_proc() * 1024 / 2**30
    assert set(got) == {"peak"}
    # Peak RSS only grows; read second, the kernel's count may be a few pages higher. KiB read as 1000 bytes would be
    # 2.4% low.
    assert expected * 0.995 <= got["peak"] <= expected * 1.0001
    del keep


def test_the_device_argument_is_only_used_without_tensors():
    torch.manual_seed(0)
    tensors = [torch.randn(3, 5), torch.randn(7)]
    expected = torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in tensors]))
    # The tensors are on the CPU: the norm is computed there, not on the device given for an empty list.
    norm = global_norm(tensors, device=torch.device("meta"))
    assert norm.device.type == "cpu" and norm.dtype == torch.float32
    assert torch.allclose(norm.double(), expected, rtol=1e-6)
    empty = global_norm([], device=torch.device("meta"))
    assert empty.device.type == "meta" and empty.shape == ()
