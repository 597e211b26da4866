"""What the FSDP1 and FSDP2 route sweeps (test_routes_fsdp1.py, test_routes_fsdp2.py) share: each rank's batches and
the global batch they make, the loss, a few plain training steps, the one-process reference run, and the comparison of
named tensors with a reference (SQNR, elementwise for small tensors). Module-level functions: the spawned workers
import them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tests.distributed.tolerances import MIN_SQNR_NUMEL, SMALL_TENSOR_RTOL
from tests.numerics import sqnr


def batch(rank: int, step: int, dtype: torch.dtype, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: ``rows`` token ids (0 to 9) and ``rows`` x 32 features."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 10, (rows,), generator=gen), torch.randn(rows, 32, generator=gen).to(dtype)


def global_batch(world: int, step: int, dtype: torch.dtype, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's batch of step ``step``, concatenated in rank order: what one process trains on."""
    parts = [batch(r, step, dtype, rows) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def loss(model: nn.Module, inputs) -> torch.Tensor:
    return model(*inputs).float().square().mean()


def steps(rank: int, model: nn.Module, opt: torch.optim.Optimizer, first: int, n: int, rows: int) -> list[float]:
    """Steps ``first .. first + n - 1`` of this rank's batches (forward, backward, step); their losses."""
    losses = []
    for step in range(first, first + n):
        value = loss(model, batch(rank, step, torch.float32, rows))
        value.backward()
        opt.step()
        opt.zero_grad()
        losses.append(value.item())
    return losses


def reference(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    weights: Callable[[nn.Module], dict[str, torch.Tensor]],
    world: int,
    n: int,
    rows: int,
    dtype: torch.dtype = torch.float32,
    accum: int = 1,
    skip: tuple = (),
) -> dict:
    """``model`` (not sharded) trained ``n`` steps on the global batch, every rank's micro-batches (``accum`` per
    step): the losses, the first step's gradients (fp32) and their norm, and ``weights(model)`` at the start and after
    the last step (no optimizer step at the steps in ``skip``)."""
    out: dict = {"losses": [], "start": weights(model)}
    for step in range(n):
        batches = [global_batch(world, step * accum + m, dtype, rows) for m in range(accum)]
        value = sum(loss(model, b) for b in batches) / accum
        value.backward()
        out["losses"].append(value.item())
        if step == 0:
            out["grads"] = {
                name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None
            }
            out["norm"] = torch.stack([g.norm() for g in out["grads"].values()]).norm().item()
        if step not in skip:
            opt.step()
        opt.zero_grad()
    out["weights"] = weights(model)
    return out


def far_from(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], min_db: float) -> dict[str, object]:
    """The names whose tensor is not within ``min_db`` of the reference (elementwise for small tensors)."""
    bad = {}
    assert got.keys() == ref.keys(), (sorted(got), sorted(ref))
    for name, r in ref.items():
        g = got[name]
        if r.numel() >= MIN_SQNR_NUMEL:
            db = sqnr(g, r)
            if not db >= min_db:
                bad[name] = db
        elif not bool(((g - r).abs() <= SMALL_TENSOR_RTOL * r.abs().max()).all()):
            bad[name] = (g - r).abs().max().item()
    return bad
