"""load_fp8_state_dict(strict=False)'s warnings that nothing was loaded point at the caller's line (their stacklevel
counts the frames of the checks they are raised from)."""

import warnings

import pytest
import torch

from lightning_fp8 import convert_to_fp8, load_fp8_state_dict


def _fp8_model() -> torch.nn.Module:
    return convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(16, 16)))


@pytest.mark.parametrize("model", [_fp8_model, lambda: torch.nn.Linear(4, 4)], ids=["no-key-matches", "no-fp8-state"])
def test_the_warning_names_the_callers_line(model):
    module = model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _line_after() + 1
        load_fp8_state_dict(module, {"elsewhere.scale": torch.ones(())}, strict=False)
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]
    assert "nothing was loaded" in str(caught[0].message) or "none of the" in str(caught[0].message)


def _line_after() -> int:
    import inspect

    return inspect.currentframe().f_back.f_lineno
