"""Test configuration: Triton kernels run on CPU under the interpreter when no GPU is present.

TRITON_INTERPRET must be set before any kernel module is imported (``triton.jit`` reads it then).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with FP8 tensor cores (sm89+); shown by benchmarks/ instead")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny tensor ops (a thread pool only adds contention there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """warn_once warns once per process: warn again in this test."""
    import lightning_fp8.warnings

    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
