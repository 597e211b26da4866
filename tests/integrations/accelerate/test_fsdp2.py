"""The Accelerator's FSDP2 path on two CPU processes: forward and full training steps.

See fsdp2_worker.py for how FSDP is declared on CPU and for the unsharded reference.
"""

import json
from pathlib import Path

import pytest

from tests.integrations.accelerate.torchrun import run_two_processes

WORKER = Path(__file__).with_name("fsdp2_worker.py")
RESUME_WORKER = Path(__file__).with_name("fsdp2_resume_worker.py")


@pytest.mark.slow
def test_fsdp2_converts_swaps_gathers_fp8_weights_and_trains_like_the_unsharded_model(tmp_path):
    # The worker also runs full steps (backward through the FP8 reduce-scatter, FP8AdamW on the shards) against
    # an unsharded reference; its assertions (tolerance: LOSS_ATOL there) fail the process, hence the return code.
    log = run_two_processes(WORKER, tmp_path)
    assert "rank 0: fsdp2 forward ok" in log and "rank 1: fsdp2 forward ok" in log
    assert "rank 0: fsdp2 ok" in log and "rank 1: fsdp2 ok" in log


@pytest.mark.slow
def test_fsdp2_state_saved_and_loaded_in_a_new_launch_continues_the_run(tmp_path):
    """save_state after 2 steps, then a new launch that builds everything afresh and load_states it: the steps after
    the checkpoint are the uninterrupted run's, bit for bit, on both ranks (the sharded optimizer state is read
    through torch's get_optimizer_state_dict, whose init step the FP8GradScaler once refused)."""
    run_two_processes(RESUME_WORKER, tmp_path, "run", str(tmp_path))
    run_two_processes(RESUME_WORKER, tmp_path, "resume", str(tmp_path))
    for rank in (0, 1):
        run = json.loads((tmp_path / f"run_rank{rank}.json").read_text())
        resumed = json.loads((tmp_path / f"resume_rank{rank}.json").read_text())
        assert list(resumed["losses"]) == ["2", "3", "4"]
        assert resumed["losses"] == {step: run["losses"][step] for step in resumed["losses"]}
        assert resumed["mu"] == run["mu"]
