"""The Accelerator's FSDP2 path on two CPU processes: forward and full training steps.

See fsdp2_worker.py for how FSDP is declared on CPU and for the unsharded reference.
"""

from pathlib import Path

import pytest

from tests.integrations.accelerate.torchrun import run_two_processes

WORKER = Path(__file__).with_name("fsdp2_worker.py")


@pytest.mark.slow
def test_fsdp2_converts_swaps_gathers_fp8_weights_and_trains_like_the_unsharded_model(tmp_path):
    # The worker also runs full steps (backward through the FP8 reduce-scatter, FP8AdamW on the shards) against
    # an unsharded reference; its assertions (tolerance: LOSS_ATOL there) fail the process, hence the return code.
    log = run_two_processes(WORKER, tmp_path)
    assert "rank 0: fsdp2 forward ok" in log and "rank 1: fsdp2 forward ok" in log
    assert "rank 0: fsdp2 ok" in log and "rank 1: fsdp2 ok" in log
