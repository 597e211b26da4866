"""warn_once warns on rank zero only, reading the rank from the launchers' variables (RANK, LOCAL_RANK,
SLURM_PROCID, in that order). A variable that holds no integer (an empty RANK exported by a shell script) is skipped
as if unset: the warning raised a bare ValueError from ``int()`` instead, inside whatever call wanted to warn."""

import warnings

import pytest

from lightning_fp8 import warnings as fp8_warnings

VARS = ("RANK", "LOCAL_RANK", "SLURM_PROCID")


@pytest.mark.parametrize(
    ("env", "warns"),
    [
        ({"RANK": ""}, True),
        ({"RANK": "abc"}, True),
        ({"RANK": "", "LOCAL_RANK": "1"}, False),
        ({"RANK": " ", "LOCAL_RANK": "x", "SLURM_PROCID": "3"}, False),
        ({"RANK": "0", "LOCAL_RANK": "1"}, True),
        ({"RANK": "2"}, False),
        ({"LOCAL_RANK": " 0 "}, True),
    ],
)
def test_rank_variables_that_hold_no_integer_are_skipped(monkeypatch, env, warns):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    message = f"lightning_fp8 test message for {sorted(env.items())}"
    monkeypatch.setattr(fp8_warnings, "_seen", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp8_warnings.warn_once(message)
    assert [str(w.message) for w in caught] == ([message] if warns else [])
