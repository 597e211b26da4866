"""Lightning integration tests: toy shapes on CPU."""

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
