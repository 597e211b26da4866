"""Fit a tiny GPT with precision="fp8-lm" under Lightning's ModelParallelStrategy with tensor parallelism (TP=2,
sequence parallel, FP8 activation communication) on 2 CPU processes; run by test_tensor_parallel_fit.py.

The user's ``configure_model`` converts the model to FP8 and applies lightning_fp8's Megatron-style plan on the
strategy's tensor-parallel mesh. With ``--devices 1`` the same module trains in one process (the reference).
Every rank writes ``<out>/rank<r>.json``: losses, the optimizer, and the placements of the FP8 weights.

    python tests/integrations/lightning/tp_fit.py --devices 2 --out /tmp/run
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import lightning_fp8  # noqa: E402,F401  (registers precision="fp8-lm")
from lightning_fp8 import FP8Linear, convert_to_fp8  # noqa: E402
from tests.distributed.launch import exit_worker  # noqa: E402
from tests.distributed.test_tensor_parallel import GPT, SEQ, VOCAB  # noqa: E402


class TPGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(layers=2)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        convert_to_fp8(self.model, module_filter_fn=lambda module, name: name != "head")
        if self.trainer.world_size > 1:
            from lightning_fp8.distributed.tensor_parallel import apply_fp8_tensor_parallel

            apply_fp8_tensor_parallel(self.model, self.device_mesh["tensor_parallel"])

    def training_step(self, batch, batch_idx):
        idx, target = batch
        loss = F.cross_entropy(self.model(idx).flatten(0, 1).float(), target.flatten())
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        idx = torch.randint(0, VOCAB, (48, SEQ), generator=gen)
        data = torch.utils.data.TensorDataset(idx, (idx * 7 + 3) % VOCAB)  # a token map the model can learn
        return torch.utils.data.DataLoader(data, batch_size=6)  # every tensor-parallel rank sees the same batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.manual_seed(0)
    module = TPGPT()
    strategy = "auto"
    if args.devices > 1:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=args.devices)
    trainer = L.Trainer(
        precision="fp8-lm", accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(module)
    weights = [m.weight for m in module.modules() if isinstance(m, FP8Linear)]
    result = {
        "rank": trainer.global_rank,
        "losses": module.losses,
        "optimizer": type(getattr(trainer.optimizers[0], "_optimizer", trainer.optimizers[0])).__name__,
        "fp8_layers": len(weights),
        "placements": sorted({str(getattr(w, "placements", "local")) for w in weights}),
        "finite": all(bool(torch.isfinite(p.full_tensor() if hasattr(p, "full_tensor") else p).all())
                      for p in module.parameters()),  # fmt: skip
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    exit_worker()  # every rank done: leave without the interpreter's teardown (see tests/distributed/launch.py)
