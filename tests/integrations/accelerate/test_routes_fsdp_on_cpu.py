"""FSDP asked for on the CPU, by every route: Accelerate runs FSDP on CUDA devices only and otherwise goes on
without a word, so ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))``, the variables
``accelerate launch`` exports for a config file's ``distributed_type: FSDP``, and ``lightning-fp8 launch`` of such a
file with ``use_cpu: true`` all trained the model unsharded under DDP. Each is refused now, before anything is
converted, saying what to do (the FSDP2 path itself is tested in test_fsdp2.py, by switching the process state)."""

from pathlib import Path

import pytest
import yaml

from lightning_fp8.integrations.accelerate import cli
from tests.integrations.accelerate.torchrun import run_two_processes

WORKER = Path(__file__).with_name("routes_fsdp_cpu_worker.py")
# What `accelerate launch` exports for `distributed_type: FSDP` with `fsdp_config: {fsdp_version: 2}`.
FSDP_LAUNCH_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}


@pytest.mark.slow
@pytest.mark.parametrize("route", ["plugin", "env"])
def test_fsdp_that_accelerate_does_not_set_up_on_the_cpu_is_refused_at_prepare(tmp_path, route):
    log = run_two_processes(WORKER, tmp_path, route, **(FSDP_LAUNCH_ENV if route == "env" else {}))
    for rank in (0, 1):
        assert f"rank {rank}: refused (0 converted): the launch asked for FSDP" in log, log[-3000:]
        assert "set up MULTI_CPU on cpu (2 processes)" in log and "Launch on GPUs, or drop the FSDP settings" in log
    assert "prepared DistributedDataParallel" not in log


def test_lightning_fp8_launch_refuses_fsdp_with_use_cpu(tmp_path, capsys):
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_processes": 2,
              "num_machines": 1, "use_cpu": True, "mixed_precision": "no", "fsdp_config": {"fsdp_version": 2},
              "lightning_fp8": {"recipe": "fp8-lm"}}  # fmt: skip
    path = tmp_path / "fsdp_cpu.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli.main(["launch", "--config_file", str(path), str(tmp_path / "train.py")]) == 2
    err = capsys.readouterr().err
    assert "FSDP on the CPU (--cpu or use_cpu: true)" in err and "distributed_type: MULTI_CPU" in err, err
