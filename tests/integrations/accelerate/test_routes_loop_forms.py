"""Training-loop forms an Accelerate script writes, each against an independent reference (found by a sweep of loop
forms; they held): ``accumulate`` against the manual form with ``no_sync``, gradient accumulation whatever mu is,
``unscale_gradients`` then torch's clipping against ``accelerator.clip_grad_*``, a mid-epoch ``save_state`` resumed
with ``skip_first_batches``, and ``save_model`` read into a plain ``nn.Linear`` model."""

import contextlib
import copy
import warnings

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fp8.accelerate import Accelerator
from lightning_fp8.grad_scaler import FP8GradScaler
from lightning_fp8.integrations.accelerate.config import ENV_EXCLUDE, ENV_RECIPE
from lightning_fp8.optim import FP8AdamW

# One FP8 forward of this net against fp32 (3 to 4 % per FP8 GEMM, two of them in a row): the saved model's outputs.
FP8_FORWARD_RTOL = 0.05


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(48, 80)
        self.fc2 = nn.Linear(80, 48)
        self.head = nn.Linear(48, 10)  # 10 outputs: stays nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


@pytest.fixture(autouse=True)
def _fresh_accelerate_state(monkeypatch):
    monkeypatch.delenv(ENV_RECIPE, raising=False)
    monkeypatch.delenv(ENV_EXCLUDE, raising=False)
    warnings.simplefilter("ignore")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _reset() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


torch.manual_seed(0)
_BASE = Net()
_DATA = [(torch.randn(8, 48), torch.randint(0, 10, (8,))) for _ in range(8)]


def _weights(accelerator, model) -> dict[str, torch.Tensor]:
    return {k: v.detach().double().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def _prepared(recipe: str, accum: int, init_scale: float = 1024.0, growth_interval: int = 2):
    """A model and an FP8AdamW whose mu starts at ``init_scale`` and doubles every ``growth_interval`` steps."""
    _reset()
    accelerator = Accelerator(cpu=True, fp8_lm_recipe=recipe, gradient_accumulation_steps=accum)
    model = accelerator.prepare(copy.deepcopy(_BASE))
    level = "O2" if recipe == "fp8-lm" else "O1"
    scaler = FP8GradScaler(init_scale=init_scale, growth_interval=growth_interval)
    optimizer = FP8AdamW(model.parameters(), lr=1e-2, opt_level=level, fp8_grads=False, grad_scaler=scaler)
    return accelerator, model, accelerator.prepare(optimizer)


def _train(recipe: str, form: str, init_scale: float = 1024.0, growth_interval: int = 2) -> dict[str, torch.Tensor]:
    accumulate = form in ("accumulate", "unscale_each", "clip_inf_each")
    accelerator, model, optimizer = _prepared(recipe, 2 if accumulate else 1, init_scale, growth_interval)
    for i, (x, y) in enumerate(_DATA):
        if accumulate:
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.cross_entropy(model(x), y) * 30)
                if form == "unscale_each":  # on every micro-batch: the next backward must put mu back
                    accelerator.unscale_gradients()
                if form == "clip_inf_each":
                    accelerator.clip_grad_norm_(model.parameters(), float("inf"))
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
        else:  # the manual form: no_sync on the first micro-batch, the loss divided by hand, a step every second
            last = i % 2 == 1
            with contextlib.nullcontext() if last else accelerator.no_sync(model):
                accelerator.backward(nn.functional.cross_entropy(model(x), y) * 30 / 2)
            if last:
                optimizer.step()
                optimizer.zero_grad()
    return _weights(accelerator, model)


@pytest.mark.parametrize("recipe", ["fp8-lm", "fp8-lm-o1"])
def test_accumulate_equals_the_manual_no_sync_form_and_mu_changes_nothing(recipe):
    reference = _train(recipe, "manual")
    for form in ("accumulate", "unscale_each", "clip_inf_each"):
        for name, value in _train(recipe, form).items():
            torch.testing.assert_close(value, reference[name], rtol=0, atol=0, msg=f"{form}: {name}")
    # mu is a power of two: 1 held, or 8 doubling at every step, gives the same weights bit for bit
    for init_scale, growth_interval in ((1.0, 1000), (8.0, 1)):
        other = _train(recipe, "manual", init_scale, growth_interval)
        for name, value in other.items():
            torch.testing.assert_close(value, reference[name], rtol=0, atol=0, msg=f"mu {init_scale}: {name}")


@pytest.mark.parametrize("recipe", ["fp8-lm", "fp8-lm-o1"])
def test_unscale_gradients_then_torch_clip_value_is_accelerator_clip_grad_value(recipe):
    results = []
    for own in (True, False):
        accelerator, model, optimizer = _prepared(recipe, 1)
        for x, y in _DATA:
            accelerator.backward(nn.functional.cross_entropy(model(x), y) * 30)
            if own:
                accelerator.unscale_gradients()
                torch.nn.utils.clip_grad_value_(model.parameters(), 1e-2)
            else:
                accelerator.clip_grad_value_(model.parameters(), 1e-2)
            optimizer.step()
            optimizer.zero_grad()
        results.append(_weights(accelerator, model))
    for name, value in results[0].items():
        torch.testing.assert_close(value, results[1][name], rtol=0, atol=0, msg=name)


class _Count:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def _resumable(accum: int):
    _reset()
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm", gradient_accumulation_steps=accum)
    model = copy.deepcopy(_BASE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.95**step)
    data = TensorDataset(torch.cat([x for x, _ in _DATA]), torch.cat([y for _, y in _DATA]))
    prepared = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=8), scheduler)
    count = _Count()
    accelerator.register_for_checkpointing(count)
    return accelerator, *prepared, count


def _epochs(objects, stop_after=None, ckpt=None, resume_at=None):
    accelerator, model, optimizer, loader, scheduler, count = objects
    for epoch in range(2):
        if resume_at is not None and epoch < resume_at[0]:
            continue
        skip = resume_at[1] if resume_at is not None and epoch == resume_at[0] else 0
        for i, (x, y) in enumerate(accelerator.skip_first_batches(loader, skip) if skip else loader, start=skip):
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss * float("inf") if count.n == 2 else loss)  # a skipped step, mu halved
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                count.n += 1
            if (epoch, i) == stop_after:
                accelerator.save_state(ckpt)
                return None
    return _weights(accelerator, model), accelerator.fp8_grad_scaler.scale, scheduler.get_last_lr(), count.n


@pytest.mark.parametrize("accum", [1, 2])
def test_a_mid_epoch_save_state_resumed_with_skip_first_batches_continues_bit_for_bit(tmp_path, accum):
    uninterrupted = _epochs(_resumable(accum))
    _epochs(_resumable(accum), stop_after=(0, 3), ckpt=str(tmp_path))  # after a whole accumulation window
    objects = _resumable(accum)
    objects[0].load_state(str(tmp_path))
    resumed = _epochs(objects, resume_at=(0, 4))
    assert resumed[1:] == uninterrupted[1:]
    for name, value in resumed[0].items():
        torch.testing.assert_close(value, uninterrupted[0][name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("recipe", ["fp8-lm", "fp8-lm-o1"])
@pytest.mark.parametrize("safe", [True, False])
def test_save_model_loads_into_a_plain_model_that_computes_what_the_fp8_model_computes(tmp_path, recipe, safe):
    accelerator = Accelerator(cpu=True, fp8_lm_recipe=recipe)
    model = copy.deepcopy(_BASE)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for x, y in _DATA[:3]:
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_model(model, tmp_path, safe_serialization=safe)
    if safe:
        saved = load_file(tmp_path / "model.safetensors")
    else:
        saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    plain = Net()
    plain.load_state_dict(saved)  # strict: the same keys, plain tensors
    for name, value in accelerator.get_state_dict(model).items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=name)
    x = _DATA[4][0]
    with torch.no_grad():
        model.eval()
        torch.testing.assert_close(model(x), plain(x), rtol=FP8_FORWARD_RTOL, atol=FP8_FORWARD_RTOL)
