"""DDP with the FP8 hook on a model with a sparse gradient (``nn.Embedding(sparse=True)``, valid under DDP): the
sparse bucket is averaged in its own dtype as torch's default hook does; it used to fail inside the hook (leaving
DDP's reducer mid-step) with "FP8 all-reduce: out must be contiguous"."""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations as objects.
import math

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed.launch import run_workers

pytestmark = pytest.mark.slow


def _model(head: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 8, sparse=True), nn.Linear(8, 4) if head else nn.Identity())


def _grads(ddp: DDP, rank: int, nan: bool = False) -> list[torch.Tensor]:
    ids = torch.tensor([[rank, 3, 5, 3]])
    loss = ddp(ids).square().sum()
    if nan and rank == 1:
        loss = loss * math.nan
    loss.backward()
    grads = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in ddp.parameters()]
    ddp.zero_grad(set_to_none=True)
    return grads


def _sparse(rank: int, world: int) -> dict:
    from lightning_fp8.distributed import enable_fp8_ddp

    plain = _grads(DDP(_model()), rank)  # torch's default all-reduce: the mean, exact
    ddp = DDP(_model())
    state = enable_fp8_ddp(ddp)
    fp8 = _grads(ddp, rank)
    step_ok = state.check_step()
    alone = DDP(_model(head=False))  # only the sparse gradient: its own check must see rank 1's NaN
    alone_state = enable_fp8_ddp(alone)
    _grads(alone, rank, nan=True)
    return {"plain": plain, "fp8": fp8, "step_ok": step_ok, "nan_step_ok": alone_state.check_step()}


def test_sparse_gradient_is_averaged_in_its_own_dtype_and_checked():
    results = run_workers(_sparse, 2)
    for r in results:
        embedding, *dense = zip(r["fp8"], r["plain"], strict=True)
        assert torch.allclose(*embedding, rtol=1e-6, atol=0), "the sparse gradient is the exact mean"
        for fp8, plain in dense:  # the Linear's gradients through FP8
            assert torch.allclose(fp8, plain, rtol=0.25, atol=0.05 * float(plain.abs().max()))
        assert r["step_ok"]
        assert not r["nan_step_ok"], "a NaN on rank 1 skips the step on every rank"
