"""FP8GradScaler with a plain torch optimizer over FSDP2 (DTensor) gradients: its unscale and non-finite check ran
on the DTensors, and the flag, a DTensor, failed in the scaler's plain-tensor counts ("got mixed torch.Tensor and
DTensor") on every rank, after the gradients were already divided by mu."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.distributed.launch import run_workers

pytestmark = pytest.mark.slow
MU = 4.0


def _batch(rank):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))


def _worker(rank: int, world: int, mode: str) -> dict:
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_fp8 import FP8GradScaler

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    reference = copy.deepcopy(plain)
    model = fully_shard(plain, mesh=init_device_mesh("cpu", (world,)))  # CPU also where CUDA is
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = FP8GradScaler(init_scale=MU)
    scaler.scale_loss(model(_batch(rank)).square().mean()).backward()
    if mode == "inf" and rank == 1:
        model[0].weight.grad.to_local()[0, 0] = float("inf")
    if mode == "unscale_":
        scaler.unscale_(opt)
    stepped = scaler.step(opt)
    scaler.update()
    # The reference: the unsharded model, the mean of the ranks' gradients (FSDP2's reduce-scatter), torch's AdamW.
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for r in range(world):
        (reference(_batch(r)).square().mean() / world).backward()
    if mode != "inf":
        ref_opt.step()
    close = all(
        torch.allclose(p.full_tensor(), q, rtol=1e-6, atol=1e-7)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    return {"stepped": stepped, "close": close, "scale": scaler.get_scale()}


@pytest.mark.parametrize("mode", ["step", "unscale_", "inf"])
def test_a_plain_optimizer_steps_through_the_scaler_on_sharded_gradients(mode):
    for rank, report in enumerate(run_workers(_worker, 2, mode)):
        assert report["stepped"] == (mode != "inf"), (rank, report)
        assert report["close"], (rank, report)
        assert report["scale"] == (MU / 2 if mode == "inf" else MU), (rank, report)
