"""Run by test_save_state_interrupted.py under torchrun with two CPU processes (DDP).

1. A save_state into a saved folder that fails on rank 1 (while Accelerate writes its random states) raises on both
   ranks (rank 0: "another process failed", no hang), and leaves a folder that load_state refuses on both, changing
   nothing; saved again, it loads.
2. A checkpoint without rank 1's random states file is refused by both ranks, changing nothing.
"""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT)]
from lightning_fp8.accelerate import Accelerator  # noqa: E402
from tests.distributed.launch import exit_worker  # noqa: E402
from tests.integrations.accelerate.test_load_state_atomic import (  # noqa: E402
    Net,
    _assert_same,
    _batches,
    _snapshot,
    _steps,
)


def _expect(error: type[Exception], match: str, call) -> None:
    try:
        call()
    except error as raised:
        assert match in str(raised), raised
    else:
        raise AssertionError(f"did not raise {error.__name__}")


def _save_failing_on_rank_1(accelerator: Accelerator, directory: str) -> None:
    save = torch.save

    def failing(obj, f, *args, **kwargs):
        if str(f).endswith("random_states_1.pkl"):
            raise OSError(28, "No space left on device (simulated)")
        return save(obj, f, *args, **kwargs)

    torch.save = failing
    try:
        accelerator.save_state(directory)
    finally:
        torch.save = save


def main(directory: str) -> None:
    accelerator = Accelerator(fp8_lm_recipe="fp8-lm")
    rank = accelerator.process_index
    assert accelerator.num_processes == 2
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.8)
    run = accelerator.prepare(model, optimizer, scheduler)
    _steps((accelerator, *run), _batches(seed=rank, n=2))
    accelerator.save_state(directory)
    _steps((accelerator, *run), _batches(seed=10 + rank, n=2))

    # 1. The second save fails on rank 1 only.
    error = (OSError, "simulated") if rank == 1 else (RuntimeError, "another process failed")
    _expect(*error, lambda: _save_failing_on_rank_1(accelerator, directory))
    before = _snapshot(accelerator, *run)
    _expect(ValueError, "did not complete", lambda: accelerator.load_state(directory))
    _assert_same(before, _snapshot(accelerator, *run))
    accelerator.save_state(directory)  # saved again, whole
    fp8_dir = Path(directory) / "lightning_fp8"
    assert sorted(p.name for p in fp8_dir.iterdir()) == ["rank0.pt", "rank1.pt"], list(fp8_dir.iterdir())
    accelerator.load_state(directory)
    _assert_same(before, _snapshot(accelerator, *run))  # the checkpoint of this very state

    # 2. Rank 1's random states file goes missing.
    accelerator.wait_for_everyone()
    if rank == 1:
        (Path(directory) / "random_states_1.pkl").unlink()
    accelerator.wait_for_everyone()
    _steps((accelerator, *run), _batches(seed=20 + rank, n=1))
    before = _snapshot(accelerator, *run)
    error = (FileNotFoundError, "random_states_1.pkl is missing") if rank == 1 else (RuntimeError, "another process")
    _expect(*error, lambda: accelerator.load_state(directory))
    _assert_same(before, _snapshot(accelerator, *run))
    print(f"rank {rank}: save/load ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_worker()  # every rank done: leave without the interpreter's teardown (see tests/distributed/launch.py)
