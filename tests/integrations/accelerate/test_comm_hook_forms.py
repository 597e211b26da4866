"""DistributedDataParallelKwargs(comm_hook=...) under FP8-LM: what DDP runs decides whether gradients go in FP8, for
every form of the value (see comm_hook_forms_worker.py)."""

from pathlib import Path

import pytest

from tests.integrations.accelerate.torchrun import run_two_processes


@pytest.mark.slow
def test_every_form_of_comm_hook_gets_the_hook_ddp_really_runs(tmp_path):
    log = run_two_processes(Path(__file__).with_name("comm_hook_forms_worker.py"), tmp_path)
    assert "rank 0: comm hook forms ok" in log and "rank 1: comm hook forms ok" in log, log[-3000:]
