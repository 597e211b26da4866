"""`accelerator.save_state` that fails part-way leaves a folder `load_state` refuses, and `load_state` checks the random
states file (lightning_fp8/integrations/accelerate/checkpointing.py, checkpoint.py, load_checks.py)."""

import os
import shutil
from pathlib import Path

import accelerate.checkpointing
import pytest
import torch
from accelerate.utils import ProjectConfiguration

from lightning_fp8.accelerate import Accelerator
from lightning_fp8.integrations.accelerate import checkpoint, load_checks
from tests.integrations.accelerate.test_load_state_atomic import (  # noqa: F401 (the autouse fixture)
    Net,
    _assert_same,
    _batches,
    _fresh_accelerate_state,
    _fresh_state,
    _snapshot,
    _steps,
    _train,
)
from tests.integrations.accelerate.torchrun import run_two_processes

WORKER = Path(__file__).with_name("save_state_worker.py")
MARKER = Path("lightning_fp8") / "save_in_progress"


def _fail_writing(monkeypatch, name: str) -> None:
    """Make Accelerate's writes of the file ``name`` fail, as on a full disk."""
    save = accelerate.checkpointing.save

    def failing(obj, f, *args, **kwargs):
        if str(f).endswith(name):
            raise OSError(28, "No space left on device (simulated)")
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(accelerate.checkpointing, "save", failing)


def test_a_save_that_fails_part_way_leaves_a_folder_load_state_refuses(tmp_path, monkeypatch):
    # The FP8 state (mu, scales, step count) used to be written first: the failed save paired it with the earlier
    # save's optimizer and scheduler files, and load_state took them silently.
    directory = str(tmp_path / "checkpoint")
    run = _train(seed=0, steps=2)
    run[0].save_state(directory)
    _steps(run, _batches(1, 3))
    with monkeypatch.context() as patch:
        _fail_writing(patch, "optimizer.bin")
        with pytest.raises(OSError, match="simulated"):
            run[0].save_state(directory)

    resumed = _train(seed=7, steps=1)
    before = _snapshot(*resumed)
    with pytest.raises(ValueError, match=r"save_in_progress exists: a save_state into .* did not complete.*load an "):
        resumed[0].load_state(directory)
    _assert_same(before, _snapshot(*resumed))
    assert (tmp_path / "checkpoint" / MARKER).is_file()

    run[0].save_state(directory)  # saved again, whole: it loads
    assert not (tmp_path / "checkpoint" / MARKER).exists()
    resumed[0].load_state(directory)
    _assert_same(_snapshot(*run), _snapshot(*resumed))


def test_a_save_that_fails_writing_the_fp8_state_leaves_a_folder_load_state_refuses(tmp_path, monkeypatch):
    directory = str(tmp_path / "checkpoint")
    run = _train(seed=0, steps=2)
    run[0].save_state(directory)

    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device (simulated)")

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "save", failing)
        with pytest.raises(OSError, match="simulated"):
            run[0].save_state(directory)
    resumed = _train(seed=7, steps=1)
    with pytest.raises(ValueError, match="did not complete"):
        resumed[0].load_state(directory)


def test_automatic_checkpoint_naming_keeps_total_limit_and_refuses_a_failed_last_save(tmp_path, monkeypatch):
    _fresh_state()
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm", project_config=config)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.8)
    run = (accelerator, *accelerator.prepare(model, optimizer, scheduler))
    for i in range(3):
        _steps(run, _batches(i, 1))
        accelerator.save_state()
    folders = sorted(os.listdir(tmp_path / "checkpoints"))
    assert folders == ["checkpoint_1", "checkpoint_2"]
    for folder in folders:
        assert sorted(os.listdir(tmp_path / "checkpoints" / folder / "lightning_fp8")) == ["rank0.pt"]
    saved = _snapshot(*run)
    _steps(run, _batches(5, 1))
    accelerator.load_state()  # the last: checkpoint_2
    _assert_same(saved, _snapshot(*run))
    assert accelerator._fp8_steps == 3

    with monkeypatch.context() as patch:
        _fail_writing(patch, "optimizer.bin")
        with pytest.raises(OSError, match="simulated"):
            accelerator.save_state()
    with pytest.raises(ValueError, match=r"checkpoint_3.*did not complete"):
        accelerator.load_state()
    assert (tmp_path / "checkpoints" / "checkpoint_3" / MARKER).is_file()
    _assert_same(saved, _snapshot(*run))
    accelerator.load_state(str(tmp_path / "checkpoints" / "checkpoint_2"))  # the earlier checkpoint loads


def test_a_folder_missing_the_fp8_state_of_a_rank_that_saved_it_is_refused(tmp_path):
    entries = {"recipe": {}, "models": [], "health": None, "format_version": checkpoint.FORMAT_VERSION}
    checkpoint.save(tmp_path, 1, {**entries, "world_size": 2, "grad_scaler": {"scale": 2.0**5}})
    with pytest.raises(ValueError, match=r"rank0.pt is missing .*incomplete.*load an earlier checkpoint"):
        checkpoint.load(tmp_path, 0, 2)
    checkpoint.save(tmp_path, 0, {**entries, "world_size": 2, "grad_scaler": {"scale": 2.0**5}})
    checkpoint.rank_file(tmp_path, 1).unlink()
    with pytest.raises(ValueError, match=r"rank1.pt is missing .*incomplete"):
        checkpoint.load(tmp_path, 1, 2)
    # Saved by 1 process and resumed on 2: rank 1 takes rank 0's file.
    checkpoint.save(tmp_path, 0, {**entries, "world_size": 1, "grad_scaler": {"scale": 2.0**5}})
    assert checkpoint.load(tmp_path, 1, 2)["grad_scaler"]["scale"] == 2.0**5


@pytest.mark.parametrize("damage", ["missing", "truncated", "not random states"])
def test_a_bad_random_states_file_is_refused_before_anything_loads(tmp_path, damage):
    # Accelerate's load_state catches the error and only logs it: the run went on with its own random states.
    directory = tmp_path / "checkpoint"
    _train(seed=0, steps=2)[0].save_state(str(directory))
    path = directory / "random_states_0.pkl"
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:50])
    else:
        torch.save({"step": 0}, path)
    resumed = _train(seed=7, steps=1)
    before, rng = _snapshot(*resumed), torch.get_rng_state()
    error, match = {
        "missing": (FileNotFoundError, r"random_states_0.pkl is missing"),
        "truncated": (ValueError, r"random_states_0.pkl cannot be read .*corrupt or was not completely written"),
        "not random states": (ValueError, r"random_states_0.pkl does not hold the random states \['random_state'"),
    }[damage]
    with pytest.raises(error, match=match):
        resumed[0].load_state(str(directory))
    _assert_same(before, _snapshot(*resumed))
    assert torch.equal(rng, torch.get_rng_state())


def test_the_random_states_of_the_checkpoint_are_restored(tmp_path):
    directory = tmp_path / "checkpoint"
    run = _train(seed=0, steps=2)
    run[0].save_state(str(directory))
    expected = torch.rand(3)
    resumed = _train(seed=7, steps=1)
    resumed[0].load_state(str(directory))
    assert torch.equal(torch.rand(3), expected)


def test_only_the_processes_that_saved_need_a_random_states_file(tmp_path):
    shutil.copy(Path(__file__), tmp_path / "unrelated.pkl")
    torch.save({"random_state": 0, "numpy_random_seed": 0, "torch_manual_seed": 0}, tmp_path / "random_states_0.pkl")
    load_checks.check_random_states(tmp_path, 1, 1)  # resumed on more processes: rank 1 keeps its own
    load_checks.check_random_states(tmp_path, 1, None)  # unknown: the files say one process saved
    with pytest.raises(FileNotFoundError, match="random_states_1.pkl is missing"):
        load_checks.check_random_states(tmp_path, 1, 2)
    torch.save({}, tmp_path / "random_states_2.pkl")
    with pytest.raises(FileNotFoundError, match="random_states_1.pkl is missing"):
        load_checks.check_random_states(tmp_path, 1, None)


@pytest.mark.slow
def test_a_save_failing_on_one_process_raises_on_every_process_and_is_refused_by_every_process(tmp_path):
    # See save_state_worker.py: also a random states file missing on rank 1 only.
    log = run_two_processes(WORKER, tmp_path, str(tmp_path / "ckpt"))
    assert "rank 0: save/load ok" in log and "rank 1: save/load ok" in log, log[-3000:]
