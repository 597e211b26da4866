"""`lightning-fp8 launch` and `accelerate launch` run examples/accelerate/train_gpt.py with FP8-LM on, with one and
two CPU processes, and a run resumed from `save_state` continues exactly as the uninterrupted one."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "examples" / "accelerate" / "train_gpt.py"
CONFIGS = ROOT / "examples" / "accelerate"
BIN = Path(sys.executable).parent
# A toy GPT (2 blocks of width 64: 8 linear layers, the tied head excluded) for a few steps on a small corpus.
TINY = ["--depth", "2", "--width", "64", "--heads", "2", "--seq-len", "32", "--batch-size", "4", "--warmup", "2",
        "--max-bytes", "60000", "--log-every", "1", "--steps", "4"]  # fmt: skip
TIMEOUT_S = 300

pytestmark = pytest.mark.slow


def _run(cmd: list[str], tmp_path: Path, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_FP8_", "ACCELERATE_"))}
    # No default Accelerate config from the developer's home; one thread per process on a small CI machine.
    environ.update({"HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1", **env})
    out = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=TIMEOUT_S)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    return log


def _metrics(out: Path) -> dict[int, dict]:
    return {
        row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if row["step"]
    }


def _is_power_of_two(x: float) -> bool:
    return x > 0 and math.frexp(x)[0] == 0.5


def _check_fp8_run(log: str, metrics: dict[int, dict], processes: int) -> None:
    assert "converted 8 linear layer(s) of GPT to FP8" in log and "kept 1 in high precision ['lm_head']" in log
    assert f"optimizer: FP8AdamW, processes: {processes}" in log
    assert log.count("FP8-LM runs in emulation") == 1  # one warning, on rank 0 only
    assert sorted(metrics) == [1, 2, 3, 4]
    for row in metrics.values():
        assert math.isfinite(row["train/loss"])
        for role in ("input", "weight", "grad_output"):
            assert _is_power_of_two(row[f"fp8/{role}/scale_min"]), (role, row)
            assert row[f"fp8/{role}/nonfinite_count"] == 0
        assert row["fp8/grad_scaler/scale"] == 1.0 and row["fp8/grad_scaler/skipped_steps"] == 0
        assert _is_power_of_two(row["fp8/optimizer/exp_avg_scale/min"])
        assert _is_power_of_two(row["fp8/optimizer/master_scale/max"])
    assert metrics[4]["train/loss"] < metrics[1]["train/loss"]


def _check_resumed(first: dict[int, dict], resumed: dict[int, dict]) -> None:
    # Same weights, FP8AdamW states, mu, FP8 scaling histories, data position: the same numbers, bit for bit.
    # Not the machine's measures: memory and the rates of the wall clock differ from run to run.
    measured = ("health/memory_gib", "health/samples_per_sec", "health/tokens_per_sec")
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        for key, value in first[step].items():
            assert key in resumed[step], (step, key)
            if key not in measured:
                assert resumed[step][key] == value, (step, key)


def test_one_process_lightning_fp8_launch_then_resume_with_plain_accelerate_launch(tmp_path):
    launch = [str(BIN / "lightning-fp8"), "launch", "--config_file", str(CONFIGS / "single_process.yaml"), str(SCRIPT)]
    log = _run([*launch, *TINY, "--save-every", "2", "--out", str(tmp_path / "a")], tmp_path)
    first = _metrics(tmp_path / "a")
    _check_fp8_run(log, first, processes=1)
    assert (tmp_path / "a" / "checkpoint_2" / "lightning_fp8" / "rank0.pt").is_file()

    # Resumed by plain `accelerate launch`, the recipe from the environment.
    accelerate = [str(BIN / "accelerate"), "launch", "--cpu", "--num_processes", "1", str(SCRIPT)]
    resume = ["--resume", str(tmp_path / "a" / "checkpoint_2"), "--out", str(tmp_path / "b")]
    env = {"LIGHTNING_FP8_RECIPE": "fp8-lm", "LIGHTNING_FP8_EXCLUDE": "lm_head"}
    log = _run([*accelerate, *TINY, *resume], tmp_path, **env)
    assert "resumed from" in log and "at step 2" in log and "optimizer: FP8AdamW, processes: 1" in log
    _check_resumed(first, _metrics(tmp_path / "b"))


def test_two_processes_ddp_and_resume_with_plain_accelerate_launch(tmp_path):
    launch = [str(BIN / "lightning-fp8"), "launch", "--config_file", str(CONFIGS / "ddp_cpu.yaml"), str(SCRIPT)]
    log = _run([*launch, *TINY, "--save-every", "2", "--out", str(tmp_path / "a")], tmp_path)
    first = _metrics(tmp_path / "a")
    _check_fp8_run(log, first, processes=2)
    assert "starting them with torchrun" in log
    assert "DDP gradient communication: fp8_allreduce_hook (8 FP8 weight gradients in torch.float8_e5m2)" in log
    assert {p.name for p in (tmp_path / "a" / "checkpoint_2" / "lightning_fp8").iterdir()} == {"rank0.pt", "rank1.pt"}

    # The same run resumed by plain `accelerate launch`: the recipe from the environment, two CPU processes
    # through Accelerate's torchrun launcher.
    accelerate = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", "0"]
    resume = ["--resume", str(tmp_path / "a" / "checkpoint_2"), "--out", str(tmp_path / "b")]
    env = {"ACCELERATE_USE_CPU": "true", "LIGHTNING_FP8_RECIPE": "fp8-lm", "LIGHTNING_FP8_EXCLUDE": "lm_head"}
    log = _run([*accelerate, str(SCRIPT), *TINY, *resume], tmp_path, **env)
    assert "optimizer: FP8AdamW, processes: 2" in log
    _check_resumed(first, _metrics(tmp_path / "b"))
