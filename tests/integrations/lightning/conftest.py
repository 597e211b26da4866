"""Lightning integration tests: toy shapes on CPU."""

import importlib
import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # Toy shapes: intra-op threads only add synchronization, and stall badly when the cores are shared
    # (a 144x128x32 matmul measured 50 ms with 2 threads on a loaded 2-core machine, 0.05 ms with 1).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _environment_restored():
    # An in-process fit under a distributed strategy (FSDPStrategy on one process) leaves WORLD_SIZE, LOCAL_RANK and
    # the like in os.environ: a later test's two-process Lightning run inherited them and waited for ranks that never
    # came (test_tensor_parallel_fit.py after test_strategy.py: a 240 s timeout in CI).
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def registered():
    """``register(namespace, name, cls, **init_params)``: a name in that Lightning namespace's StrategyRegistry for one
    test, taken out again after it."""
    added = []

    def register(namespace, name, cls, **init_params):
        root = "pytorch_lightning" if namespace == "pytorch_lightning" else "lightning.pytorch"
        registry_ = importlib.import_module(f"{root}.strategies").StrategyRegistry
        registry_.register(name, cls, description="a test's alias", **init_params)
        added.append((registry_, name))

    yield register
    for registry_, name in added:
        registry_.remove(name)
