"""strategy="fsdp_fp8" beyond a single fit, on 2 CPU processes (gloo); run by test_fsdp_stages.py.

``--case eval``: a module with parameters outside the ``auto_wrap_policy`` units (a head at its root) is fitted,
then validated with the same Trainer (the validation loss, and the same loss computed in fp32 from the gathered
weights), then tested with a new Trainer (refused: what it says). ``--case manual``: manual optimization with a
``ModelCheckpoint`` every 2 steps, then a new Trainer resumed from the checkpoint of step 2, then the same model with
automatic optimization: the three runs' losses. ``--case manual_root``: manual optimization of a module with a head in
the root unit (refused at setup: what it says, and how many steps ran).
Every rank writes ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from lightning_fp8 import FP8FSDPStrategy  # noqa: E402
from tests.distributed.launch import exit_worker  # noqa: E402


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


def _data(seed: int) -> DataLoader:
    return DataLoader(torch.randn(16, 32, generator=torch.Generator().manual_seed(seed)), batch_size=4)


class RootHead(L.LightningModule):
    """A block FSDP wraps on its own and a head that stays in the root unit."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(Block(), nn.Linear(32, 16))

    def training_step(self, batch, batch_idx):
        return self.net(batch).float().square().mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.net(batch).float().square().mean(), sync_dist=True)

    test_step = validation_step

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class ManualMLP(L.LightningModule):
    def __init__(self, manual: bool = True) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
        self.automatic_optimization = not manual
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        # step s trains on batch s, whatever the loader yields: Lightning restarts the epoch's data on a resume
        batch = list(_data(0))[self.trainer.global_step]
        loss = self.net(batch).float().square().mean()
        self.losses.append(loss.item())
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()  # after the step: the next backward must not add to this step's gradients

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return _data(0)


def _trainer(policy: set, **kwargs) -> L.Trainer:
    return L.Trainer(
        precision="fp8-lm", accelerator="cpu", devices=2, strategy=FP8FSDPStrategy(auto_wrap_policy=policy),
        logger=False, enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, **kwargs,
    )  # fmt: skip


def _eval_case() -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    module = RootHead()
    trainer = _trainer({Block}, max_steps=2, enable_checkpointing=False)
    trainer.fit(module, _data(0))
    val = trainer.validate(module, _data(1), verbose=False)[0]["val_loss"]
    with FullyShardedDataParallel.summon_full_params(trainer.strategy.model, writeback=False):
        weights = [p.detach().float().clone() for p in module.net.parameters()]
    fc_w, fc_b, head_w, head_b = weights
    xs = torch.cat(list(_data(1)))
    reference = F.linear(xs + F.linear(xs, fc_w, fc_b), head_w, head_b).square().mean().item()
    try:
        _trainer({Block}).test(module, _data(1), verbose=False)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return {"val_loss": val, "reference": reference, "refusal": refusal}


def _manual_case(out: str) -> dict:
    torch.manual_seed(0)
    module = ManualMLP()
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1)
    _trainer({nn.Linear}, max_steps=4, callbacks=[checkpoints]).fit(module)
    torch.manual_seed(1)  # other initial weights: the checkpoint must bring back step 2's
    resumed = ManualMLP()
    _trainer({nn.Linear}, max_steps=4, enable_checkpointing=False).fit(
        resumed, ckpt_path=os.path.join(out, "epoch=0-step=2.ckpt")
    )
    torch.manual_seed(0)
    automatic = ManualMLP(manual=False)
    _trainer({nn.Linear}, max_steps=4, enable_checkpointing=False).fit(automatic)
    return {"losses": module.losses, "resumed": resumed.losses, "automatic": automatic.losses}


class ManualRootHead(RootHead):
    """RootHead (a head in the root unit) with manual optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        self.manual_backward(self.net(batch).float().square().mean())
        self.optimizers().step()


def _manual_root_case() -> dict:
    torch.manual_seed(0)
    module = ManualRootHead()
    trainer = _trainer({Block}, max_steps=2, enable_checkpointing=False)
    try:
        trainer.fit(module, _data(0))
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return {"refusal": refusal, "steps": trainer.global_step}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True, choices=["eval", "manual", "manual_root"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cases = {"eval": _eval_case, "manual": lambda: _manual_case(args.out), "manual_root": _manual_root_case}
    result = cases[args.case]()
    rank = int(os.environ.get("LOCAL_RANK", 0))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    exit_worker()


if __name__ == "__main__":
    main()
