"""The "bf16" fallback: resuming a plain PyTorch run after layers fell back, and DistributedDataParallel (2 gloo
processes), under which it is refused: at O2 giving a weight back its own dtype unhooks DDP's gradient averaging
(measured: the next step's gradients differ between the ranks, then DDP fails), and at O1 removing every FP8 layer's
buffers trips DDP's buffer broadcast (an internal assert in its next forward)."""

import io
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, FP8Linear, convert_to_fp8
from lightning_fp8.recovery import fallen_back_layers, put_back_to_high_precision
from lightning_fp8.state import fp8_state_dict, load_fp8_state_dict
from tests.distributed.launch import run_workers

POISONED = (1, 2)  # steps at which only the last layer gets gradients, non-finite: it falls back after the second


def _model() -> nn.Module:
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))


def _training(model: nn.Module) -> tuple[FP8GradScaler, FP8AdamW]:
    scaler = FP8GradScaler(nonfinite_fallback=model, fallback_after=2, init_scale=2.0**4)
    return scaler, FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)


def _train(model: nn.Module, scaler: FP8GradScaler, optimizer: FP8AdamW, steps: range) -> list[float]:
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(24, 32, generator=gen), torch.randn(24, 16, generator=gen)
        optimizer.zero_grad()
        if step in POISONED:
            hidden = model[1](model[0](x)).detach()
            loss = ((model[2](hidden) - y) ** 2).mean() * math.inf
        else:
            loss = ((model(x) - y) ** 2).mean()
        scaler.scale_loss(loss).backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _checkpoint(model: nn.Module, scaler: FP8GradScaler, optimizer: FP8AdamW) -> dict:
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
             "fp8": fp8_state_dict(model), "fallen_back_layers": fallen_back_layers(model)}  # fmt: skip
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_plain_pytorch_resume_after_fallback_continues_the_same_run():
    torch.manual_seed(0)
    full = _model()
    scaler, optimizer = _training(full)
    losses = _train(full, scaler, optimizer, range(4))
    assert type(full[2]) is nn.Linear and isinstance(full[0], FP8Linear)
    ckpt = _checkpoint(full, scaler, optimizer)
    assert ckpt["fallen_back_layers"] == ["2"]
    losses += _train(full, scaler, optimizer, range(4, 8))

    torch.manual_seed(123)  # other initial weights: everything must come from the checkpoint
    resumed = _model()
    resumed_scaler, resumed_optimizer = _training(resumed)
    assert put_back_to_high_precision(resumed, ckpt["fallen_back_layers"], resumed_optimizer) == ["2"]
    resumed.load_state_dict(ckpt["model"])
    resumed_optimizer.load_state_dict(ckpt["optimizer"])
    resumed_scaler.load_state_dict(ckpt["scaler"])
    load_fp8_state_dict(resumed, ckpt["fp8"])
    assert type(resumed[2]) is nn.Linear and isinstance(resumed[0], FP8Linear)
    assert resumed[2].weight.dtype == torch.float32 and resumed[0].weight.dtype == torch.float16  # O2 master
    assert resumed_optimizer.state[resumed[2].weight]["exp_avg"].dtype == torch.float32

    assert _train(resumed, resumed_scaler, resumed_optimizer, range(4, 8)) == losses[4:]
    for (name, a), b in zip(resumed.state_dict().items(), full.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert fallen_back_layers(resumed) == ["2"]


def test_put_back_is_idempotent_and_checks_before_changing_anything():
    model = _model()
    _, optimizer = _training(model)  # O2: the FP8 weights' storage holds fp16 masters
    with pytest.raises(ValueError, match=r"'0\.weight' is not an FP8Linear inside the model"):
        put_back_to_high_precision(model, ["0", "0.weight"], optimizer)
    with pytest.raises(ValueError, match="FP8AdamW \\(O2\\) that was not passed; pass that optimizer"):
        put_back_to_high_precision(model, ["0"])
    assert isinstance(model[0], FP8Linear) and model[0].weight.dtype == torch.float16  # nothing changed
    expected = model.state_dict()
    assert put_back_to_high_precision(model, ["0"], [optimizer]) == ["0"]
    assert put_back_to_high_precision(model, ["0"], optimizer) == []
    assert type(model[0]) is nn.Linear and model[0].weight.dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.values(), strict=True))


def test_layers_put_back_before_the_optimizer_exists_get_fp32_states():
    model = _model()
    put_back_to_high_precision(model, ["2"])
    optimizer = FP8AdamW(model.parameters(), lr=1e-2)
    assert model[2].weight.dtype == torch.float32 and model[0].weight.dtype == torch.float16
    model(torch.randn(8, 32)).square().mean().backward()
    optimizer.step()
    assert optimizer.state[model[2].weight]["exp_avg"].dtype == torch.float32


# ----------------------------------------------------------------------------------- DistributedDataParallel
def _gradients_averaged(model: nn.Module, ddp: nn.Module, x: torch.Tensor) -> bool:
    """One backward through DDP: is every gradient the same on both ranks (averaged), none of them missing?"""
    ddp(x).square().mean().backward()
    same = []
    for p in model.parameters():
        grad = p.grad.float()
        gathered = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, grad)
        same.append(torch.equal(gathered[0], gathered[1]))
    return all(same)


def _ddp_fallback(rank: int, opt_level: str, blamed: tuple[int, ...]) -> dict:
    """The ``blamed`` layers' gradients made non-finite on both ranks, the fallback, then a backward on each rank's
    data (more steps if the fallback went through)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = _model()
    scaler = FP8GradScaler(nonfinite_fallback=model, fallback_after=1)
    optimizer = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler, opt_level=opt_level)
    ddp = DDP(model)  # after the optimizer, as docs/guides/pytorch.md says
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))  # each rank its own data
    ddp(x).square().mean().backward()
    for i in blamed:
        model[i].weight.grad.fill_(math.inf)
        model[i].fp8_scaling["grad_output"].amax.fill_(math.inf)  # blames the layer, as a non-finite gradient would
    error = None
    try:
        optimizer.step()
    except ValueError as e:
        error = str(e)
    optimizer.zero_grad()
    report = {"error": error, "layers": [type(model[i]).__name__ for i in blamed], "averaged": [],
              "dtypes": [str(model[i].weight.dtype) for i in blamed]}  # fmt: skip
    for _ in range(3 if error is None else 1):  # after a refused fallback the scaler's step is not finished
        try:
            report["averaged"].append(_gradients_averaged(model, ddp, x))
        except RuntimeError as e:  # DDP's reducer found a gradient it never saw (both ranks raise alike)
            report["averaged"].append(f"RuntimeError: {str(e)[:300]}")
            break
        if error is None:
            optimizer.step()
        optimizer.zero_grad()
    return report


def _worker(rank: int, world: int) -> dict:
    return {"O2": _ddp_fallback(rank, "O2", (2,)), "O1": _ddp_fallback(rank, "O1", (0, 2))}


@pytest.fixture(scope="module")
def ddp_reports() -> list[dict]:
    return run_workers(_worker, 2)


@pytest.mark.slow
@pytest.mark.parametrize(("level", "dtype"), [("O2", "torch.float16"), ("O1", "torch.float32")])
def test_ddp_fallback_is_refused_before_changing_anything(ddp_reports, level, dtype):
    for report in (r[level] for r in ddp_reports):
        assert report["error"] is not None and "under DistributedDataParallel" in report["error"], report
        assert "Nothing was changed; use nonfinite_fallback='lower_lr'" in report["error"]
        assert set(report["layers"]) == {"FP8Linear"} and set(report["dtypes"]) == {dtype}
        assert report["averaged"] == [True]  # DDP still averages every gradient
