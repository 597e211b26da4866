"""An FP8AdamW the script built with its own FP8GradScaler (``grad_scaler=``): the Accelerator adopts that scaler, as
FP8LMPrecision does, so its settings govern mu, and it is the one saved and loaded; another scaler is refused."""

import copy

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, FP8Linear, convert_to_fp8
from lightning_fp8.accelerate import Accelerator
from tests.integrations.accelerate.test_accelerator import _fresh_accelerate_state  # noqa: F401 (autouse fixture)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16)))


def _batches(n: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 32, generator=generator) for _ in range(n)]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def _user_optimizer(model: nn.Module, scaler: FP8GradScaler | None = None) -> FP8AdamW:
    return FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler, fp8_grads=False)


def test_the_scaler_of_the_users_fp8adamw_is_adopted_and_governs_mu():
    model = _model()
    reference_model = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    mine = FP8GradScaler(model=model, init_scale=64, growth_interval=1)
    model, optimizer = accelerator.prepare(model, _user_optimizer(model, mine))
    assert accelerator.fp8_grad_scaler is mine and optimizer.optimizer.grad_scaler is mine
    for x in _batches():
        accelerator.backward(_loss(model, x))
        optimizer.step()
        optimizer.zero_grad()

    # The same loop by hand, through a plain FP8GradScaler with the same settings.
    scaler = FP8GradScaler(model=reference_model, init_scale=64, growth_interval=1)
    reference = _user_optimizer(reference_model, scaler)
    for x in _batches():
        scaler.scale_loss(_loss(reference_model, x)).backward()
        scaler.step(reference)
        scaler.update()
        reference.zero_grad()

    assert scaler.get_scale() != 64.0  # growth_interval=1 moved mu at every step
    assert mine.get_scale() == scaler.get_scale() and mine.loss_scale == scaler.loss_scale
    assert [(e["action"], e["scale"]) for e in mine.history] == [(e["action"], e["scale"]) for e in scaler.history]
    assert accelerator.fp8_log_values()["fp8/grad_scaler/scale"] == scaler.get_scale()
    for (name, p), q in zip(model.named_parameters(), reference_model.parameters(), strict=True):
        torch.testing.assert_close(p.float(), q.float(), msg=name)


def test_a_scaler_without_a_model_gets_the_prepared_model():
    model = _model()
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    mine = FP8GradScaler(init_scale=8)
    model, _ = accelerator.prepare(model, _user_optimizer(model, mine))
    assert accelerator.fp8_grad_scaler is mine and mine.model is model


def test_save_and_load_state_keep_the_adopted_scaler(tmp_path):
    model = _model()
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    mine = FP8GradScaler(model=model, init_scale=64, growth_interval=1)
    model, optimizer = accelerator.prepare(model, _user_optimizer(model, mine))
    for x in _batches():
        accelerator.backward(_loss(model, x))
        optimizer.step()
        optimizer.zero_grad()
    saved = mine.state_dict()
    accelerator.save_state(str(tmp_path / "ckpt"))
    state = torch.load(tmp_path / "ckpt" / "lightning_fp8" / "rank0.pt", weights_only=True)
    assert state["grad_scaler"] == saved and saved["scale"] != 64.0
    mine.load_state_dict({**saved, "scale": 2.0})
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert accelerator.fp8_grad_scaler is mine and mine.state_dict() == saved


def test_another_scaler_than_the_accelerators_is_refused_before_anything_changes():
    net = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    theirs = FP8GradScaler(init_scale=4)
    accelerator.fp8_grad_scaler = theirs
    model = _model()
    mine = FP8GradScaler(model=model, init_scale=64)
    with pytest.raises(ValueError, match=r"without grad_scaler=.*share one FP8GradScaler.*Nothing was converted"):
        accelerator.prepare(net, _user_optimizer(model, mine))
    assert type(net[0]) is nn.Linear and accelerator.fp8_grad_scaler is theirs

    # Sharing the accelerator's scaler is fine.
    model, optimizer = accelerator.prepare(model, _user_optimizer(model, theirs))
    assert accelerator.fp8_grad_scaler is theirs and optimizer.optimizer.grad_scaler is theirs
    assert isinstance(model[0], FP8Linear)


def test_a_scaler_of_an_fp8adamw_prepared_on_its_own_is_checked_too():
    model = _model()
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    model = accelerator.prepare(model)
    accelerator.fp8_grad_scaler = FP8GradScaler(model=model)
    with pytest.raises(ValueError, match="without grad_scaler="):
        accelerator.prepare_optimizer(_user_optimizer(model, FP8GradScaler(init_scale=64)))
