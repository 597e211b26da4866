"""strategy="fsdp_fp8" (FSDP1) across Trainer stages and with manual optimization: 2 CPU processes (fsdp_stages.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = Path(__file__).with_name("fsdp_stages.py")


def _run(case: str, out: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT)}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(SCRIPT), "--case", case, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_validate_after_fit_with_parameters_outside_the_units(tmp_path):
    """The same Trainer validates with the fit's root wrapper: FSDPStrategy had wrapped nothing (the units inside
    were FSDP already) and run the module bare, whose head held this rank's shard ("a parameter was replaced by one of
    another shape"). The loss is the gathered fp32 weights' within FP8 error. A new Trainer cannot gather them: it
    says so and what to do."""
    for rank in _run("eval", tmp_path):
        assert rank["val_loss"] == pytest.approx(rank["reference"], rel=0.05), rank
        assert "sharded by another Trainer's fit" in rank["refusal"] and "net.1.weight" in rank["refusal"], rank
        assert "ckpt_path=" in rank["refusal"]


@pytest.mark.slow
def test_manual_optimization_trains_checkpoints_and_resumes_as_automatic(tmp_path):
    """Manual optimization's backward runs inside FSDP1's root forward, where FSDP1 runs no end of backward: each
    unit's reduced gradient stayed pending, so every later backward added to it (with zero_grad after step, the
    optimizer stepped on the sum of all gradients so far), and the units stayed in their post-backward state, which
    failed every checkpoint ("Expects the handle training to be IDLE"). Now the losses are automatic optimization's,
    and resumed from step 2's checkpoint, steps 3 and 4 are those of the uninterrupted run."""
    for rank in _run("manual", tmp_path):
        assert len(rank["losses"]) == 4 and len(rank["resumed"]) == 2, rank
        assert rank["losses"] == rank["automatic"], rank
        assert rank["resumed"] == rank["losses"][2:], rank


@pytest.mark.slow
def test_manual_optimization_with_parameters_in_the_root_unit_is_refused_at_setup(tmp_path):
    """FSDP1 cannot run the backward of the root unit's own parameters inside the root's forward, where
    manual_backward runs: the first manual_backward failed in FSDP's internals ("Expects BACKWARD_PRE or
    BACKWARD_POST state"). Refused before any step, naming the parameters and what to do."""
    for rank in _run("manual_root", tmp_path):
        assert "needs every parameter inside an auto_wrap_policy unit" in rank["refusal"], rank
        assert "net.1.weight" in rank["refusal"] and rank["steps"] == 0, rank
