"""NaN recovery through ``lightning_fp8.accelerate.Accelerator``, route by route, against references written here (a
route sweep; the plain PyTorch routes are in ``tests/core/test_routes_recovery.py``).

Routes: the script's ``torch.optim.AdamW`` swapped by ``prepare`` (the accelerator's scaler, its fallback set on
``accelerator.fp8_grad_scaler``) and the script's own ``FP8AdamW(grad_scaler=FP8GradScaler(...))`` (adopted: that
scaler scales the loss), each without and with gradient accumulation (the NaN in the first micro-batch of its window).
Checked by hand: mu, the skipped steps leaving weights and optimizer states bit for bit, a prepared ``StepLR`` that
does not advance on a skipped step and goes on from the lr ``"lower_lr"`` lowered once (``initial_lr`` too); the
``"bf16"`` fallback puts back the one layer whose accumulated gradient held the NaN; and a ``save_state`` between the
two skips resumes the count: the next skip of the resumed run lowers the lr as in the uninterrupted run.
"""

import copy
import math

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, FP8Linear, convert_to_fp8
from lightning_fp8.accelerate import Accelerator
from tests.integrations.accelerate.test_accelerator import _fresh_accelerate_state  # noqa: F401 (autouse)
from tests.numerics import same

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]


BAD = (1, 2)  # optimizer steps whose first micro-batch has a NaN in the head's weight gradient
LR0, GAMMA, FACTOR = 0.1, 0.5, 0.25


def _setup(route: str, fallback: str, accumulate: int, seed: int = 0):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm", gradient_accumulation_steps=accumulate)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    settings = {"nonfinite_fallback": fallback, "fallback_after": 2, "lr_factor": FACTOR}
    if route == "own FP8AdamW and scaler":
        model = convert_to_fp8(model)
        scaler = FP8GradScaler(init_scale=16.0, **settings, **({"model": model} if fallback == "bf16" else {}))
        optimizer = FP8AdamW(model.parameters(), lr=LR0, grad_scaler=scaler)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    scaler = accelerator.fp8_grad_scaler
    if route == "swapped AdamW":
        scaler.nonfinite_fallback, scaler.fallback_after, scaler.lr_factor = fallback, 2, FACTOR
    return accelerator, model, optimizer, scheduler


def _train(accelerator, model, optimizer, scheduler, steps, accumulate: int) -> list[dict]:
    rows = []
    for step in steps:
        before = copy.deepcopy(([p.detach() for p in model.parameters()], optimizer.state_dict()["state"]))
        for micro in range(accumulate):
            with accelerator.accumulate(model):
                x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + micro))
                hook = model[2].weight.register_hook(lambda g: g * math.nan) if step in BAD and micro == 0 else None
                accelerator.backward(model(x).square().mean())
                if hook is not None:
                    hook.remove()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        rows.append({
            "mu": accelerator.fp8_grad_scaler.get_scale(),
            "kept": same(before, ([p.detach() for p in model.parameters()], optimizer.state_dict()["state"])),
            "lr": optimizer.param_groups[0]["lr"], "initial_lr": optimizer.param_groups[0]["initial_lr"],
        })  # fmt: skip
    return rows


ROUTES = ["swapped AdamW", "own FP8AdamW and scaler"]


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("route", ROUTES)
def test_lower_lr_lands_once_and_the_prepared_scheduler_goes_on_from_it(route, accumulate):
    accelerator, model, optimizer, scheduler = _setup(route, "lower_lr", accumulate)
    assert isinstance(optimizer.optimizer, FP8AdamW)
    mu0 = accelerator.fp8_grad_scaler.get_scale()  # 1 (the accelerator's default), 16 (the script's scaler)
    rows = _train(accelerator, model, optimizer, scheduler, range(5), accumulate)
    # By hand: mu halves at the two skips. The prepared StepLR advances after each step taken, not after a skipped
    # one; the second consecutive skip multiplies the lr (and initial_lr) by FACTOR, once.
    assert [row["mu"] / mu0 for row in rows] == [1, 0.5, 0.25, 0.25, 0.25]
    assert [row["kept"] for row in rows] == [False, True, True, False, False]
    expected = [LR0 * GAMMA, LR0 * GAMMA, LR0 * GAMMA * FACTOR, LR0 * GAMMA**2 * FACTOR, LR0 * GAMMA**3 * FACTOR]
    assert [row["lr"] for row in rows] == pytest.approx(expected, rel=1e-12)
    assert [row["initial_lr"] for row in rows] == [LR0, LR0, LR0 * FACTOR, LR0 * FACTOR, LR0 * FACTOR]
    history = accelerator.fp8_grad_scaler.history
    assert [e["action"] for e in history] == ["skip", "skip", "fallback"]
    assert history[-1]["reason"] == f"2 consecutive non-finite steps: lowered the learning rate by {FACTOR}x"
    assert all(isinstance(model[j], FP8Linear) for j in (0, 2))


@pytest.mark.parametrize("route", ROUTES)
def test_bf16_fallback_with_accumulation_puts_back_the_layer_of_the_poisoned_micro_batch(route):
    accelerator, model, optimizer, scheduler = _setup(route, "bf16", accumulate=2)
    mu0, head = accelerator.fp8_grad_scaler.get_scale(), model[2].weight
    rows = _train(accelerator, model, optimizer, scheduler, range(1), accumulate=2)
    # By hand (the scale convention): the O2 master is the fp16 storage divided by its power-of-two scale.
    master = head.detach().float() / optimizer.optimizer.state[head]["master_scale"]
    rows += _train(accelerator, model, optimizer, scheduler, range(1, 3), accumulate=2)
    assert torch.equal(head.detach(), master)  # put back bit for bit, the skips having changed nothing
    rows += _train(accelerator, model, optimizer, scheduler, range(3, 4), accumulate=2)
    assert [row["mu"] / mu0 for row in rows] == [1, 0.5, 0.25, 0.25]
    assert [row["kept"] for row in rows] == [False, True, False, False]  # the fallback releases the head's states
    assert isinstance(model[0], FP8Linear) and type(model[2]) is nn.Linear and model[2].weight is head
    assert head.dtype == torch.float32 and optimizer.optimizer.state[head]["exp_avg"].dtype == torch.float32
    reason = accelerator.fp8_grad_scaler.history[-1]["reason"]
    assert reason == "2 consecutive non-finite steps: put 1 layer(s) back to high precision: 2"
    assert rows[-1]["lr"] == pytest.approx(LR0 * GAMMA**2, rel=1e-12)  # the lr is not lowered


def test_a_state_saved_between_two_skips_resumes_the_count(tmp_path):
    full = _setup("swapped AdamW", "lower_lr", accumulate=1)
    rows = _train(*full, range(2), accumulate=1)
    full[0].save_state(str(tmp_path / "ckpt"))
    rows += _train(*full, range(2, 4), accumulate=1)

    resumed = _setup("swapped AdamW", "lower_lr", accumulate=1, seed=123)
    resumed[0].load_state(str(tmp_path / "ckpt"))
    again = _train(*resumed, range(2, 4), accumulate=1)
    assert [row["lr"] for row in again] == [row["lr"] for row in rows[2:]]
    assert again[0]["initial_lr"] == LR0 * FACTOR  # the resumed run's second skip triggered the fallback
    assert resumed[0].fp8_grad_scaler.state_dict() == full[0].fp8_grad_scaler.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(resumed[1].parameters(), full[1].parameters(), strict=True))


def test_clip_grad_norm_leaves_the_bf16_fallback_its_offending_layer_alone():
    accelerator, model, optimizer, _ = _setup("swapped AdamW", "bf16", accumulate=1)
    for step in BAD:
        hook = model[2].weight.register_hook(lambda g: g * math.nan)
        accelerator.backward(model(torch.randn(8, 16, generator=torch.Generator().manual_seed(step))).square().mean())
        hook.remove()
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    assert accelerator.fp8_grad_scaler.skipped_steps == 2
    assert isinstance(model[0], FP8Linear) and type(model[2]) is nn.Linear
