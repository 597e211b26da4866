"""DDP with the FP8 communication hook: training tracks fp32 communication, non-finite steps skip together."""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations as objects.
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import tolerances as tol

STEPS = 50
NAN_STEP = 7


def _model() -> nn.Module:
    torch.manual_seed(0)
    # The head has no bias, so with a small bucket cap its weight fills a bucket alone.
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 8, bias=False))


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    teacher = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(10 + rank))
    return x, torch.tanh(x @ teacher)


def _train(
    rank: int, comm: str, nan_step: int | None = None, scaler: bool = False, steps: int = STEPS, amax_group=None,
    algorithm: str = "auto",
) -> dict:
    from lightning_fp8 import FP8GradScaler
    from lightning_fp8.distributed import FP8CommState, fp8_allreduce_hook

    # A tiny bucket cap (256 fp32 values) gives several buckets, one of them holding a single tensor.
    ddp = DDP(_model(), bucket_cap_mb=0.001)
    grad_scaler = FP8GradScaler(init_scale=2.0**4) if scaler else None
    state = FP8CommState(grad_scaler=grad_scaler, amax_group=amax_group, algorithm=algorithm)
    bucket_sizes: list[int] = []

    def hook(state: FP8CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        bucket_sizes.append(len(bucket.parameters()))
        return fp8_allreduce_hook(state, bucket)

    if comm == "fp8":
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    x, y = _data(rank)
    losses, skipped = [], []
    for step in range(steps):
        inp = x.clone()
        if step == nan_step and rank == 1:
            inp[3, 5] = math.nan  # poisons this rank's gradients only
        loss = nn.functional.mse_loss(ddp(inp), y)
        if grad_scaler is not None:
            grad_scaler.scale_loss(loss).backward()
            if not grad_scaler.step(opt):
                skipped.append(step)
            grad_scaler.update()
            state.reset()
        else:
            loss.backward()
            if state.check_step():
                opt.step()
            else:
                skipped.append(step)
        opt.zero_grad()
        losses.append(loss.item())
    params = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    gathered = [torch.empty_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, params)
    return {
        "losses": losses,
        "skipped": skipped,
        "finite": bool(torch.isfinite(params).all()),
        "replicas_identical": all(torch.equal(gathered[0], g) for g in gathered),
        "single_tensor_bucket": 1 in bucket_sizes and max(bucket_sizes, default=0) > 1,
        "scaler_skipped": grad_scaler.skipped_steps if grad_scaler is not None else None,
        "scaler_scale": float(grad_scaler.scale) if grad_scaler is not None else None,
    }


def _mixed_bucket(rank: int) -> dict:
    """Weights in FP8, biases in fp32, in the same buckets: the biases' mean is exact."""
    from lightning_fp8.distributed import FP8CommState, fp8_allreduce_hook

    model = _model()
    ddp = DDP(model, bucket_cap_mb=25)  # one bucket for everything
    weights = [p for n, p in ddp.named_parameters() if n.endswith("weight")]
    ddp.register_comm_hook(FP8CommState(fp8_params=weights), fp8_allreduce_hook)
    x, y = _data(rank)
    nn.functional.mse_loss(ddp(x), y).backward()
    ref = _model()
    nn.functional.mse_loss(ref(x), y).backward()
    out = {}
    for (name, p), q in zip(ddp.module.named_parameters(), ref.parameters(), strict=True):
        mean = q.grad.clone()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        out[name] = (torch.allclose(p.grad, mean, rtol=1e-6, atol=0), (p.grad - mean).norm() / mean.norm())
    return out


def _complex_bucket(rank: int) -> dict:
    """Two complex parameters in one bucket, gradients 1e12 apart: each keeps its own FP8 scale (the bucket holds
    their real views, twice their numel: the hook took that for a mismatch and shared one scale, zeroing the small
    one)."""
    import warnings

    from lightning_fp8.distributed import enable_fp8_ddp

    torch.manual_seed(0)
    model = nn.ParameterDict({k: nn.Parameter(torch.randn(64, dtype=torch.complex64)) for k in ("big", "small")})
    ref = nn.ParameterDict({k: nn.Parameter(p.detach().clone()) for k, p in model.items()})

    def loss(m, x):
        return (m["big"] * x * 1e6).abs().sum() + (m["small"] * x * 1e-6).abs().sum()

    class Wrap(nn.Module):
        def __init__(self, params):
            super().__init__()
            self.params = params

        def forward(self, x):
            return loss(self.params, x)

    ddp = DDP(Wrap(model))
    enable_fp8_ddp(ddp)
    x = torch.randn(64, dtype=torch.complex64, generator=torch.Generator().manual_seed(rank))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp(x).backward()
    loss(ref, x).backward()
    out = {"warnings": [str(w.message) for w in caught]}
    for name, p in model.items():
        mean = ref[name].grad.clone()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        out[name] = float((p.grad - mean).abs().norm() / mean.abs().norm())
    return out


def _worker(rank: int, world: int) -> dict:
    return {
        "fp32": _train(rank, "fp32"),
        "fp8": _train(rank, "fp8"),
        # The amaxes' MAX all-reduces on a second group of the same ranks: the same bits.
        "fp8_amax_group": _train(rank, "fp8", amax_group=dist.new_group(list(range(world)))),
        "fp8_nan": _train(rank, "fp8", nan_step=NAN_STEP, steps=NAN_STEP + 3),
        "fp8_nan_scaler": _train(rank, "fp8", nan_step=NAN_STEP, scaler=True, steps=NAN_STEP + 3),
        "fp8_gather": _train(rank, "fp8", algorithm="gather"),
        "fp8_gather_nan": _train(rank, "fp8", nan_step=NAN_STEP, steps=NAN_STEP + 3, algorithm="gather"),
        "mixed": _mixed_bucket(rank),
        "complex": _complex_bucket(rank),
    }


@pytest.fixture(scope="module")
def results(spawned):
    return spawned(2, "test_ddp", "_worker")


pytestmark = pytest.mark.slow


def test_fp8_training_tracks_fp32_communication(results):
    for r in results:
        fp32, fp8 = r["fp32"]["losses"], r["fp8"]["losses"]
        assert fp8[-1] < 0.5 * fp8[0]  # it trains
        assert abs(fp8[-1] - fp32[-1]) <= tol.TRAINING_FINAL_LOSS_RTOL * fp32[-1], (fp8[-1], fp32[-1])
        assert r["fp8"]["replicas_identical"] and r["fp8"]["skipped"] == []
        assert r["fp8"]["single_tensor_bucket"]  # buckets of one tensor and of several


def test_gather_algorithm_trains_like_fp32_communication(results):
    """FP8CommState(algorithm="gather") (all-gathers on gloo): converges with fp32's loss, skips a NaN step together."""
    for r in results:
        fp32, gather = r["fp32"]["losses"], r["fp8_gather"]["losses"]
        assert gather[-1] < 0.5 * gather[0]
        assert abs(gather[-1] - fp32[-1]) <= tol.TRAINING_FINAL_LOSS_RTOL * fp32[-1], (gather[-1], fp32[-1])
        assert r["fp8_gather"]["replicas_identical"] and r["fp8_gather"]["skipped"] == []
        assert r["fp8_gather"]["losses"] != r["fp8"]["losses"]  # another reduction than the default's
        nan = r["fp8_gather_nan"]
        assert nan["skipped"] == [NAN_STEP] and nan["finite"] and nan["replicas_identical"]


def test_amax_group_gives_the_same_training(results):
    """FP8CommState(amax_group=...): the amaxes travel on another communicator; every loss is bit for bit the same."""
    for r in results:
        assert r["fp8_amax_group"]["losses"] == r["fp8"]["losses"]
        assert r["fp8_amax_group"]["replicas_identical"]


def test_nan_on_one_rank_skips_the_same_step_everywhere(results):
    for r in results:
        run = r["fp8_nan"]
        assert run["skipped"] == [NAN_STEP]
        assert run["finite"] and run["replicas_identical"]


def test_nan_with_grad_scaler_skips_and_halves_mu(results):
    for r in results:
        run = r["fp8_nan_scaler"]
        assert run["skipped"] == [NAN_STEP] and run["scaler_skipped"] == 1
        assert run["scaler_scale"] == 2.0**3
        assert run["finite"] and run["replicas_identical"]


def test_mixed_bucket_reduces_non_fp8_params_exactly(results):
    for r in results:
        for name, (exact, rel_err) in r["mixed"].items():
            if name.endswith("bias"):
                assert exact, name
            else:  # FP8: within two E5M2 roundings
                assert 0 < rel_err < 0.15, (name, rel_err)


def test_complex_parameters_keep_one_fp8_scale_each(results):
    for r in results:
        run = r["complex"]
        assert not any("does not match" in w for w in run["warnings"]), run["warnings"]
        assert 0 < run["big"] < 0.15 and 0 < run["small"] < 0.15, run  # within two E5M2 roundings
