"""The DDP comm hook on a process group of one rank (a one-GPU run under torchrun, or a test), in one gloo process.

fp8_allreduce_hook's docstring: "A non-finite gradient on any rank sets ``state.found_nonfinite``". With one rank
there is nothing to send, so the hook leaves the bucket as it is (the mean over one rank is the gradient itself, with
no FP8 rounding) but must still check it. A mutation audit of the distributed layer found that check unpinned (a hook
that skipped it on one rank passed the suite, and ``check_step()`` said True on a step with NaN gradients). The
reference: the same model without DDP, whose gradients the hooked ones must equal bit for bit.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations as objects.
import copy
import math

import pytest
import torch
from torch import nn

from tests.distributed.launch import run_workers

pytestmark = pytest.mark.slow


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN where the other has NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _worker(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_fp8.distributed import enable_fp8_ddp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    state = enable_fp8_ddp(ddp)
    res: dict = {}
    for step, poisoned in enumerate((False, True, False)):
        x = torch.randn(5, 8)
        if poisoned:
            x[2, 3] = math.nan
        for m in (ddp, reference):
            m.zero_grad(set_to_none=True)
            m(x).square().sum().backward()
        grads = [p.grad for p in model.parameters()]
        want = [p.grad for p in reference.parameters()]
        res[step] = {
            "check_step": state.check_step(),
            "same_grads": all(_same(g, w) for g, w in zip(grads, want, strict=True)),
        }
    return res


@pytest.fixture(scope="module")
def one_rank() -> dict:
    return run_workers(_worker, 1, timeout=120)[0]


def test_one_rank_hook_flags_a_nan_gradient_and_clears_it_after_the_step(one_rank):
    assert [one_rank[s]["check_step"] for s in range(3)] == [True, False, True]


def test_one_rank_hook_leaves_the_gradients_unrounded(one_rank):
    assert all(one_rank[s]["same_grads"] for s in range(3))
