"""The Accelerator's reading of accelerate.Accelerator's arguments before Accelerate builds anything, pinned where a
mutation audit found it unpinned. The references are Accelerate's own: its signature (arguments by position), its
order for the mixed precision (the argument, else ACCELERATE_MIXED_PRECISION), its errors for arguments it refuses,
and the same call by keyword. A refusal must come before Accelerate sets up its process-wide state: a script (or a
notebook) that then passes a supported value in the same process must build."""

import importlib.util
import inspect

import accelerate
import pytest
from accelerate.parallelism_config import ParallelismConfig
from accelerate.state import AcceleratorState

from lightning_fp8.accelerate import Accelerator
from tests.integrations.accelerate.test_accelerator import _fresh_accelerate_state  # noqa: F401 (autouse fixture)


def _positional(**given):
    """accelerate.Accelerator's arguments up to the last one ``given``, by position: its defaults, with ``given``."""
    params = list(inspect.signature(accelerate.Accelerator.__init__).parameters.values())[1:]
    last = max(i for i, p in enumerate(params) if p.name in given)
    return [given.get(p.name, p.default) for p in params[: last + 1]]


def _accelerate_state_is_set_up() -> bool:
    return bool(AcceleratorState._shared_state)


@pytest.mark.parametrize("by", ["keyword", "position"])
def test_a_refused_mixed_precision_leaves_accelerates_state_unset(by):
    args, kwargs = ([], {"cpu": True, "mixed_precision": "fp16"}) if by == "keyword" else (
        _positional(cpu=True, mixed_precision="fp16"), {})  # fmt: skip
    with pytest.raises(ValueError, match=r"mixed_precision='fp16' cannot be combined with FP8-LM"):
        Accelerator(*args, **kwargs, fp8_lm_recipe="fp8-lm")
    assert not _accelerate_state_is_set_up()
    assert Accelerator(cpu=True, mixed_precision="bf16", fp8_lm_recipe="fp8-lm").mixed_precision == "bf16"


def test_the_launchs_mixed_precision_is_read_in_accelerates_order(monkeypatch):
    """ACCELERATE_MIXED_PRECISION=fp16 (an `accelerate launch --mixed_precision fp16`) is refused before Accelerate
    takes it up; an argument overrides it, as in Accelerate."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ValueError, match=r"mixed_precision='fp16' cannot be combined with FP8-LM"):
        Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    assert not _accelerate_state_is_set_up()
    reference = accelerate.Accelerator(cpu=True, mixed_precision="bf16").mixed_precision
    AcceleratorState._reset_state(True)
    assert Accelerator(cpu=True, mixed_precision="bf16", fp8_lm_recipe="fp8-lm").mixed_precision == reference == "bf16"


def test_a_parallelism_config_by_position_is_checked_as_by_keyword(monkeypatch):
    """Tensor parallelism without transformers: Accelerate failed with a bare PackageNotFoundError."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    config = ParallelismConfig(tp_size=2)
    with pytest.raises(ValueError) as by_keyword:
        Accelerator(cpu=True, parallelism_config=config, fp8_lm_recipe="fp8-lm")
    with pytest.raises(ValueError) as by_position:
        Accelerator(*_positional(cpu=True, parallelism_config=config), fp8_lm_recipe="fp8-lm")
    assert str(by_position.value) == str(by_keyword.value)
    assert "tp_size=2" in str(by_keyword.value) and not _accelerate_state_is_set_up()


def test_an_argument_accelerate_refuses_gets_its_error_before_any_fp8_check():
    """The user's typo is what Accelerate reports, whatever else the call holds."""
    with pytest.raises(TypeError) as ours:
        Accelerator(cpu=True, mixed_precision="fp16", no_such_argument=1, fp8_lm_recipe="fp8-lm")
    with pytest.raises(TypeError) as theirs:
        accelerate.Accelerator(cpu=True, mixed_precision="fp16", no_such_argument=1)
    assert str(ours.value) == str(theirs.value)
