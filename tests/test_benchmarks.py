"""The end-to-end benchmark (benchmarks/train_step.py) runs on CPU at toy size, so it never rots between GPU runs:
every variant trains (the loss falls) from the same initial loss as BF16 (same seed and weights, FP8 rounding
only), and the table of ratios is printed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_train_step_toy_runs_every_variant(tmp_path):
    variants = ["bf16", "o1", "o2", "o2w"]
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--toy", "--variants", ",".join(variants),
           "--json", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert sorted(rows) == sorted(variants)
    base = rows["bf16"]
    # A random-token model starts near ln(vocab) = ln(256).
    assert abs(base["first_loss"] - math.log(256)) < 0.2
    for name, row in rows.items():
        assert "error" not in row, (name, row)
        assert row["params_m"] == base["params_m"]
        assert row["step_ms"] > 0 and row["tok_s"] > 0
        # FP8 rounding of the GEMM operands moves the first loss of a toy model by well under 1%.
        assert row["first_loss"] == pytest.approx(base["first_loss"], rel=1e-2), name
        assert row["last_loss"] < row["first_loss"], name  # it trains
    table = proc.stdout.splitlines()
    assert any(line.split()[:2] == ["64x2", "o2w"] for line in table), proc.stdout[-2000:]
