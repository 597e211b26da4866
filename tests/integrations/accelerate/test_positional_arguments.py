"""Accelerate's Accelerator arguments passed by position meet the same FP8-LM checks as by keyword: the refusals read
them by name from accelerate.Accelerator's own signature, not from the keywords only."""

import inspect

import accelerate
import pytest
from accelerate.utils import GradScalerKwargs

from lightning_fp8.accelerate import Accelerator
from tests.integrations.accelerate.test_accelerator import _fresh_accelerate_state  # noqa: F401 (autouse fixture)


def _positional(**given):
    """accelerate.Accelerator's arguments up to the last one ``given``, by position: its defaults, with ``given``."""
    params = list(inspect.signature(accelerate.Accelerator.__init__).parameters.values())[1:]
    last = max(i for i, p in enumerate(params) if p.name in given)
    return [given.get(p.name, p.default) for p in params[: last + 1]]


def test_grad_scaler_kwargs_by_position_are_refused_as_by_keyword():
    args = _positional(cpu=True, kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    with pytest.raises(ValueError, match=r"GradScalerKwargs.*init_scale=1024.0"):
        Accelerator(*args, fp8_lm_recipe="fp8-lm")


def test_fp16_mixed_precision_by_position_is_refused_as_by_keyword():
    with pytest.raises(ValueError) as by_keyword:
        Accelerator(cpu=True, mixed_precision="fp16", fp8_lm_recipe="fp8-lm")
    with pytest.raises(ValueError) as by_position:
        Accelerator(*_positional(cpu=True, mixed_precision="fp16"), fp8_lm_recipe="fp8-lm")
    assert str(by_position.value) == str(by_keyword.value)


def test_positional_arguments_that_pass_the_checks_reach_accelerate():
    accelerator = Accelerator(*_positional(cpu=True, gradient_accumulation_steps=3), fp8_lm_recipe="fp8-lm")
    assert accelerator.gradient_accumulation_steps == 3 and accelerator.device.type == "cpu"


def test_arguments_accelerate_refuses_get_its_own_error():
    with pytest.raises(TypeError) as ours:
        Accelerator(cpu=True, no_such_argument=1, fp8_lm_recipe="fp8-lm")
    with pytest.raises(TypeError) as theirs:
        accelerate.Accelerator(cpu=True, no_such_argument=1)
    assert str(ours.value) == str(theirs.value)
