"""The Accelerator under Accelerate's tensor-parallel config, on two CPU processes (see tp_worker.py)."""

import importlib.util
from pathlib import Path

import pytest

from tests.integrations.accelerate.torchrun import run_two_processes

WORKER = Path(__file__).with_name("tp_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize(("sharded_by", "plan"), [("accelerator", "gpt"), ("script", "none")])
def test_tensor_parallel_launch_shards_trains_like_one_process_and_resumes_bit_identically(tmp_path, sharded_by, plan):
    pytest.importorskip("transformers", reason="Accelerate's ParallelismConfig(tp_size > 1) requires transformers")
    # What `accelerate launch --parallelism_config_tp_size 2` (or `lightning-fp8 launch ...`) exports.
    env = {
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        "PARALLELISM_CONFIG_TP_SIZE": "2",
        "LIGHTNING_FP8_RECIPE": "fp8-lm",
        "LIGHTNING_FP8_TP_PLAN": plan,
    }
    log = run_two_processes(WORKER, tmp_path, str(tmp_path / "ckpt"), sharded_by, drop=("PARALLELISM_",), **env)
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
