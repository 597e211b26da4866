"""More of Accelerate's options combined with FP8-LM (after test_accelerate_options.py): each is honoured as plain
Accelerate honours it, or refused with an error that says what to do; and the logged values of a skipped step match
the Lightning callbacks'."""

import math
import re
import warnings

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from torch import nn

import lightning_fp8.warnings
from lightning_fp8.accelerate import Accelerator
from tests.integrations.accelerate.test_accelerator import _fresh_accelerate_state  # noqa: F401 (autouse fixture)


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))


def test_a_skipped_step_logs_its_non_finite_grad_norm_as_the_lightning_callback_does():
    # TrainingHealthMonitor logs a skipped step's non-finite health/grad_norm (a check watching it finds this step's
    # value); the Accelerate side left the key out, so a tracker's grad_norm curve skipped the step without a trace.
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    model = _net()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for scale in (1.0, math.inf, 1.0):
        accelerator.backward(model(torch.randn(8, 32)).square().mean() * scale)
        optimizer.step()
        optimizer.zero_grad()
        values = accelerator.fp8_log_values()
        assert optimizer.step_was_skipped == (scale == math.inf)
        assert math.isfinite(values["health/grad_norm"]) == (scale != math.inf), values
    # Out of the monitor's series (and its spike tests): the two steps taken only.
    assert [step for step, _ in accelerator.fp8_health.series["grad_norm"]] == [0, 2]


def test_load_state_before_the_optimizer_is_prepared_says_mu_was_not_loaded(tmp_path, monkeypatch):
    # mu is made when the optimizer is prepared: a load_state before that left the saved mu out without a word (the
    # optimizer prepared next started at mu 1, not the checkpoint's 512), as Accelerate skips the optimizer file.
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    model = _net()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    scaler = accelerator.fp8_grad_scaler
    scaler.load_state_dict({**scaler.state_dict(), "scale": 512.0})
    accelerator.save_state(str(tmp_path / "ckpt"))

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    model = accelerator.prepare(_net())
    with pytest.warns(UserWarning, match=r"no optimizer was prepared yet, so mu was not loaded.*before load_state"):
        accelerator.load_state(str(tmp_path / "ckpt"))

    # Prepared first, the optimizer's mu is the checkpoint's (and nothing is warned).
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    model = _net()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        accelerator.load_state(str(tmp_path / "ckpt"))
    assert accelerator.fp8_grad_scaler.loss_scale == 512.0


@pytest.mark.parametrize(
    ("answer", "error"),
    [("no", r"returned 'no' for '0': it must return True"), (None, r"returned None for all 2 linear layers")],
)
def test_an_fp8_module_filter_answer_convert_to_fp8_refuses_is_refused_by_prepare_too(answer, error):
    # prepare() made the script's answer a bool before convert_to_fp8 saw it: "no" converted every layer and a filter
    # without a return statement kept every layer in high precision, where convert_to_fp8 refuses both.
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm", fp8_module_filter=lambda module, fqn: answer)
    model = _net()
    with pytest.raises(TypeError, match=error):
        accelerator.prepare(model)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]  # nothing changed


def test_an_fp8_module_filter_read_by_truthiness_as_convert_to_fp8_reads_it():
    # torchao's idiom, which convert_to_fp8 takes: a re.search match converts, its None keeps the layer.
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm", fp8_module_filter=lambda m, fqn: re.search("2", fqn))
    model = accelerator.prepare(_net())
    assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "FP8Linear"]
