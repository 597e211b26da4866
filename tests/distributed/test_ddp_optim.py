"""FP8AdamW (O2) with DistributedDataParallel in plain PyTorch, in the order docs/guides/pytorch.md shows: the
optimizer first (it changes the FP8 weights' dtype), then DDP, whose reducer hooks the weights' gradient accumulators.
The other order is refused at FP8AdamW's construction: it used to step on gradients DDP never averaged (replicas
drifting apart), then fail an iteration later in DDP with a message about unused parameters."""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations as objects.
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed.launch import run_workers

pytestmark = pytest.mark.slow


def _model() -> nn.Module:
    from lightning_fp8 import convert_to_fp8

    torch.manual_seed(0)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))


def _documented_order(rank: int) -> dict:
    """docs/guides/pytorch.md "Several processes (DDP)": scaler and optimizer, then DDP and its FP8 hook."""
    from lightning_fp8 import FP8AdamW, FP8GradScaler
    from lightning_fp8.distributed import FP8CommState, fp8_allreduce_hook

    model = _model()
    scaler = FP8GradScaler(model=model)
    optimizer = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)
    ddp = DDP(model)
    ddp.register_comm_hook(FP8CommState(grad_scaler=scaler), fp8_allreduce_hook)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))  # each rank its own data
    identical = []
    for _ in range(3):
        scaler.scale_loss(ddp(x).square().mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
        weight = model.state_dict()["0.weight"]
        gathered = [torch.empty_like(weight) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, weight)
        identical.append(all(torch.equal(gathered[0], w) for w in gathered))
    return {"identical": identical, "dtype": str(model[0].weight.dtype)}


def _wrong_order(rank: int) -> dict:
    from lightning_fp8 import FP8AdamW

    model = _model()
    ddp = DDP(model)
    try:
        FP8AdamW(model.parameters(), lr=1e-2)
    except RuntimeError as error:
        return {"error": str(error), "dtypes": sorted({str(p.dtype) for p in ddp.parameters()})}
    return {"error": None}


def _worker(rank: int, world: int) -> dict:
    return {"documented": _documented_order(rank), "wrong": _wrong_order(rank)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, 2)


def test_optimizer_before_ddp_keeps_replicas_identical(results):
    for report in results:
        assert report["documented"]["dtype"] == "torch.float16", "the FP8 weights hold the fp16 masters (O2)"
        assert report["documented"]["identical"] == [True] * 3


def test_optimizer_after_ddp_is_refused_and_changes_nothing(results):
    for report in results:
        error = report["wrong"]["error"]
        assert error is not None and "Create FP8AdamW before wrapping the model in DDP" in error, error
        assert report["wrong"]["dtypes"] == ["torch.float32"]
