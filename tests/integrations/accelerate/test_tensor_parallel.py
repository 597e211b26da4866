"""The Accelerator under Accelerate's tensor-parallel config, on two CPU processes (see tp_worker.py)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("tp_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize(("sharded_by", "plan"), [("accelerator", "gpt"), ("script", "none")])
def test_tensor_parallel_launch_shards_trains_like_one_process_and_resumes_bit_identically(tmp_path, sharded_by, plan):
    pytest.importorskip("transformers", reason="Accelerate's ParallelismConfig(tp_size > 1) requires transformers")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_FP8_", "ACCELERATE_", "PARALLELISM_"))}
    # What `accelerate launch --parallelism_config_tp_size 2` (or `lightning-fp8 launch ...`) exports.
    env.update(
        {
            "ACCELERATE_USE_CPU": "true",
            "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
            "PARALLELISM_CONFIG_TP_SIZE": "2",
            "LIGHTNING_FP8_RECIPE": "fp8-lm",
            "LIGHTNING_FP8_TP_PLAN": plan,
            "OMP_NUM_THREADS": "1",
            "HF_HOME": str(tmp_path),
        }
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER)]
    out = subprocess.run(
        [*cmd, str(tmp_path / "ckpt"), sharded_by], env=env, capture_output=True, text=True, timeout=300
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    for rank in (0, 1):
        assert f"rank {rank}: tp train ok" in log and f"rank {rank}: tp checkpoint ok" in log, log[-3000:]
    assert (tmp_path / "ckpt" / "lightning_fp8" / "tensor_parallel").is_dir()


def test_tensor_parallel_without_transformers_says_what_to_install(monkeypatch):
    from lightning_fp8.integrations.accelerate import tensor_parallel

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    with pytest.raises(ValueError, match=r"tp_size=2\).*pip install 'lightning-fp8\[accelerate-tp\]'"):
        tensor_parallel.check_launch(None)
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "1")
    tensor_parallel.check_launch(None)  # no tensor parallelism: nothing to check
