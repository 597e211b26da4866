"""Run by test_load_state_atomic.py under torchrun with two CPU processes (DDP): a checkpoint whose rank-1 FP8 state is
corrupt is refused on both ranks, and neither changes anything (rank 0's own parts are good: it must not load them).
Made good again, it loads on both, the DDP hook's FP8CommState included (once left out of the checkpoint).
"""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT)]
from lightning_fp8.accelerate import Accelerator  # noqa: E402
from tests.distributed.launch import exit_worker  # noqa: E402
from tests.integrations.accelerate.test_load_state_atomic import Net, _assert_same, _batches, _snapshot  # noqa: E402


def main(checkpoint_dir: str) -> None:
    accelerator = Accelerator(fp8_lm_recipe="fp8-lm")
    rank = accelerator.process_index
    assert accelerator.num_processes == 2
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.8)
    run = accelerator.prepare(model, optimizer, scheduler)
    model, optimizer, scheduler = run
    batches = _batches(seed=rank, n=3)
    ((_, comm),) = model._comm_hooks  # the DDP hook's FP8CommState
    for i, (x, y) in enumerate(batches):
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if i == 1:
            # Headroom as the native path grows it after overflowing FP8 sums (gloo has no native FP8 sums).
            comm.load_state_dict({"extra_headroom": 2, "reductions": comm.reductions})
            saved_comm = comm.state_dict()
            accelerator.save_state(checkpoint_dir)
    accelerator.wait_for_everyone()
    assert comm.reductions > saved_comm["reductions"] > 0, (comm.state_dict(), saved_comm)
    path = Path(checkpoint_dir) / "lightning_fp8" / f"rank{rank}.pt"
    good = path.read_bytes()
    if rank == 1:  # the last step moved the live run past the checkpoint; now rank 1's FP8 state goes bad
        state = torch.load(path, weights_only=True)
        state["grad_scaler"]["scale"] = 3.0
        torch.save(state, path)
    accelerator.wait_for_everyone()

    before, live_comm = _snapshot(accelerator, model, optimizer, scheduler), comm.state_dict()
    expected = (ValueError, "expected a positive power of two") if rank == 1 else (RuntimeError, "another process")
    try:
        accelerator.load_state(checkpoint_dir)
    except expected[0] as error:
        assert expected[1] in str(error), error
    else:
        raise AssertionError(f"rank {rank}: load_state did not raise")
    _assert_same(before, _snapshot(accelerator, model, optimizer, scheduler))
    assert comm.state_dict() == live_comm, (comm.state_dict(), live_comm)
    print(f"rank {rank}: refused ok", flush=True)

    accelerator.wait_for_everyone()
    path.write_bytes(good)
    accelerator.wait_for_everyone()
    accelerator.load_state(checkpoint_dir)
    assert comm.state_dict() == saved_comm, (comm.state_dict(), saved_comm)
    print(f"rank {rank}: comm state loaded ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_worker()  # every rank done: leave without the interpreter's teardown (see tests/distributed/launch.py)
