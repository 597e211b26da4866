"""Cases of test_strategy_arguments.py that need 2 CPU processes (gloo): each rank writes ``<out>/<case>.rank<r>.json``
with the losses of its fit, or the error that stopped it. Lightning launches rank 1 by re-running this script.

    python tests/integrations/lightning/strategy_arguments_fit.py --out /tmp/run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from lightning_fp8 import FP8FSDPStrategy, convert_to_fp8  # noqa: E402
from tests.integrations.lightning.distributed_fit import DataParallelGPT  # noqa: E402
from tests.integrations.lightning.gpt_tiny import Block  # noqa: E402


class WrappedBlocks(DataParallelGPT):
    """Lightning's way of wrapping by hand: ``wrap()`` in configure_model (under the strategy's enable_wrap)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp.wrap import wrap

        for i, block in enumerate(self.model.blocks):
            self.model.blocks[i] = wrap(block)


class ConvertedAndWrapped(DataParallelGPT):
    """FSDP units made directly, after converting the layers (every parameter inside a unit)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        convert_to_fp8(self.model)
        self.model = FullyShardedDataParallel(self.model, device_id=torch.device("cpu"))


def _fit(
    module_cls: type = DataParallelGPT, steps: int = 2, ckpt_path: str | None = None, **strategy: Any
) -> L.Trainer:
    torch.manual_seed(0)
    module = module_cls()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=FP8FSDPStrategy(auto_wrap_policy={Block}, **strategy),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def _resumed_without_sharding(out: str) -> L.Trainer:
    path = os.path.join(out, "full_shard.ckpt")
    _fit(steps=1).save_checkpoint(path)
    return _fit(ckpt_path=path, sharding_strategy="NO_SHARD")


CASES = {
    "auto_wrap_policy": lambda out: _fit(),
    "wrap_in_configure_model": lambda out: _fit(WrappedBlocks),
    "fsdp_in_configure_model": lambda out: _fit(ConvertedAndWrapped),
    "sync_module_states": lambda out: _fit(sync_module_states=True),
    "resumed_without_sharding": _resumed_without_sharding,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    for case, fit in CASES.items():
        try:
            result = {"losses": fit(args.out).lightning_module.losses}
        except Exception as error:  # each rank reports what stopped it; the next case runs on
            result = {"error": f"{type(error).__name__}: {error}"}
        rank = int(os.environ.get("LOCAL_RANK", 0))
        with open(os.path.join(args.out, f"{case}.rank{rank}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
