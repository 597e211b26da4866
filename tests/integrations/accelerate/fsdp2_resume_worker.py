"""Run by test_fsdp2.py under torchrun with two CPU processes, twice: ``run OUT`` trains STEPS steps of FP8-LM on
FSDP2 (Accelerate's own path, declared on CPU as fsdp2_worker.py does) and saves the state after SAVE of them;
``resume OUT`` is a new launch that builds everything afresh, ``load_state``s that checkpoint and trains the rest.
Each writes its losses (and mu) to OUT/<mode>_rank<r>.json for the test to compare.

Accelerate reads a sharded optimizer state through torch's ``get_optimizer_state_dict``, which first steps the fresh
optimizer on zero gradients at lr 0: the FP8GradScaler attached to FP8AdamW once refused that step.
"""

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]
from gpt import GPT, GPTConfig  # noqa: E402

from tests.distributed.launch import exit_worker  # noqa: E402
from tests.integrations.accelerate.fsdp2_worker import fsdp2_accelerator  # noqa: E402

STEPS, SAVE = 5, 2


def main(mode: str, out: Path) -> None:
    accelerator = fsdp2_accelerator()
    torch.manual_seed(0)
    model = GPT(GPTConfig(depth=2, width=64, heads=2, seq_len=32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.fp8_grad_scaler.load_state_dict({**accelerator.fp8_grad_scaler.state_dict(), "scale": 2.0**6})
    rank, first = accelerator.process_index, 0
    if mode == "resume":
        accelerator.load_state(str(out / "ckpt"))
        first = SAVE
    losses = {}
    for step in range(first, STEPS):
        tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1000 * step + rank))
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
        if mode == "run" and step + 1 == SAVE:
            accelerator.save_state(str(out / "ckpt"))
    result = {"losses": losses, "mu": accelerator.fp8_grad_scaler.get_scale()}
    (out / f"{mode}_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
    exit_worker()
