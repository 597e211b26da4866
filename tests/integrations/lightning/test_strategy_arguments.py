"""Arguments of Lightning's strategies under the FP8 precision: what the Trainer refuses when it is built, and (2 CPU
processes, strategy_arguments_fit.py) what strategy="fsdp_fp8" refuses when it sets the model up."""

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_fp8 import FP8FSDPStrategy, FP8LMPrecision
from tests.distributed.launch import free_port
from tests.integrations.lightning.gpt_tiny import Block, GPTModule, loader

SCRIPT = Path(__file__).with_name("strategy_arguments_fit.py")
ROOT = SCRIPT.parents[3]
TIMEOUT_S = 240


@pytest.fixture(autouse=True)
def _no_process_group_left():
    # FSDPStrategy initializes a process group (world size 1) that outlives the Trainer: leave none for other tests.
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False, **kwargs)


@pytest.mark.parametrize("fp8", [{"precision": "fp8-lm"}, {"plugins": [FP8LMPrecision(recipe="fp8-lm-o1")]}])
def test_a_ddp_comm_hook_of_the_users_is_refused_beside_the_fp8_all_reduce(fp8):
    """DDP takes one communication hook: the FP8 all-reduce registered after the user's failed in the first fit (on
    GPUs) with torch's "register_comm_hook ... can only be called once"."""
    strategy = DDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook)
    with pytest.raises(ValueError, match=r"ddp_comm_hook=fp16_compress_hook.*fp8_communication=False"):
        _trainer(strategy=strategy, **fp8)


def test_a_ddp_comm_hook_of_the_users_is_kept_without_fp8_communication():
    strategy = DDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook)
    trainer = _trainer(strategy=strategy, plugins=[FP8LMPrecision(fp8_communication=False)])
    assert trainer.strategy is strategy


@pytest.mark.parametrize("missing", [True, False])
def test_fsdp_fp8_ckpt_path_of_a_missing_file_or_a_directory_says_which(tmp_path, missing):
    """Both were "... is not one": a missing file is reported as Lightning's other strategies report it, a directory
    (Lightning's sharded checkpoints) with the command that makes one file of it."""
    path = tmp_path / ("missing.ckpt" if missing else "sharded.ckpt")
    if not missing:
        path.mkdir()
    trainer = L.Trainer(strategy=FP8FSDPStrategy(auto_wrap_policy={Block}), accelerator="cpu", devices=1, max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    error, match = (
        (FileNotFoundError, "Checkpoint file not found") if missing else (ValueError, "consolidate_checkpoint")
    )
    with pytest.raises(error, match=match):
        trainer.fit(GPTModule(), loader(n=12, batch_size=12), ckpt_path=str(path))


@pytest.fixture(scope="module")
def fsdp_fp8_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("strategy_arguments")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    cases = {path.name.split(".")[0] for path in out.glob("*.rank0.json")}
    return {case: [json.loads((out / f"{case}.rank{r}.json").read_text()) for r in range(2)] for case in cases}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["wrap_in_configure_model", "fsdp_in_configure_model"])
def test_fsdp_units_made_in_configure_model_are_refused_saying_what_to_use(fsdp_fp8_ranks, case):
    """wrap() in configure_model failed on the CPU inside FSDP1 ("needs a non-CPU accelerator device"); on GPUs the
    conversion replaced the layers inside the units (the first forward failed), and units of converted layers trained
    without the FP8 gradient communication. Refused on every rank, naming auto_wrap_policy."""
    assert fsdp_fp8_ranks["auto_wrap_policy"][0].get("error") is None, fsdp_fp8_ranks["auto_wrap_policy"]
    for rank in fsdp_fp8_ranks[case]:
        assert "made by hand" in rank.get("error", "") and "auto_wrap_policy" in rank["error"], rank


@pytest.mark.slow
def test_sync_module_states_on_the_cpu_is_refused_saying_what_to_do(fsdp_fp8_ranks):
    """FSDP1 failed asking for a device_id (given: the CPU) or a GPU."""
    for rank in fsdp_fp8_ranks["sync_module_states"]:
        assert "sync_module_states=True" in rank.get("error", "") and "drop sync_module_states" in rank["error"], rank


@pytest.mark.slow
def test_optimizer_shards_of_another_sharding_strategy_are_refused_naming_it(fsdp_fp8_ranks):
    """A FULL_SHARD checkpoint resumed with NO_SHARD: the error named the auto_wrap_policy, which had not changed."""
    for rank in fsdp_fp8_ranks["resumed_without_sharding"]:
        assert "does not fit" in rank.get("error", "") and "sharding_strategy='NO_SHARD'" in rank["error"], rank
