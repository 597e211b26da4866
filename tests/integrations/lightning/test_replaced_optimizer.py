"""The AdamW that configure_optimizers returned, once the plugin replaced it by FP8AdamW: code that kept it (an LR
scheduler stepped by hand, a learning rate set on it) drives the FP8AdamW, and stepping it says what to step."""

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fp8 import FP8AdamW
from tests.integrations.lightning.gpt_tiny import GPTModule, loader


class _KeptScheduler(GPTModule):
    """Manual optimization with a StepLR built in configure_optimizers and stepped by hand, not returned."""

    def __init__(self) -> None:
        super().__init__(manual=True)
        self.lrs: list[float] = []

    def configure_optimizers(self):
        self.kept = torch.optim.AdamW(self.parameters(), lr=self.lr)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.kept, step_size=1, gamma=0.5)
        return self.kept

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = self.loss(batch)
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        self.scheduler.step()
        self.lrs.append(optimizer.optimizer.param_groups[0]["lr"])
        return loss


def _fit(module: GPTModule, precision: str, max_steps: int = 3, **kwargs) -> L.Trainer:
    torch.manual_seed(0)
    trainer = L.Trainer(
        precision=precision, accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, **{"enable_checkpointing": False, **kwargs},
    )  # fmt: skip
    trainer.fit(module, loader(n=24))
    return trainer


def test_a_scheduler_not_returned_from_configure_optimizers_drives_the_fp8adamw():
    """Found by a sweep: the plugin rebound only the schedulers Lightning was given, so one stepped by hand kept
    halving the learning rate of the replaced AdamW, which no longer stepped: the FP8AdamW trained at 1e-2 throughout
    (where "32-true" went 5e-3, 2.5e-3, ...), with only torch's misleading "lr_scheduler.step() before
    optimizer.step()" warning."""
    reference = _KeptScheduler()
    _fit(reference, "32-true")
    module = _KeptScheduler()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*")
        trainer = _fit(module, "fp8-lm")
    assert isinstance(trainer.optimizers[0], FP8AdamW)
    assert module.lrs == reference.lrs == [5e-3, 2.5e-3, 1.25e-3]
    module.kept.param_groups[0]["lr"] = 1e-4  # a learning rate set on the kept AdamW reaches the FP8AdamW
    assert trainer.optimizers[0].param_groups[0]["lr"] == 1e-4


def test_stepping_the_replaced_adamw_raises_saying_what_to_step():
    """Found by a sweep: a manual training_step that stepped the AdamW it kept from configure_optimizers updated the
    weights with torch's AdamW on gradients scaled by mu, beside the FP8AdamW, silently."""

    class SteppingKept(_KeptScheduler):
        def training_step(self, batch, batch_idx):
            self.manual_backward(self.loss(batch))
            self.kept.step()

    with pytest.raises(RuntimeError, match=r"replaced by FP8AdamW.*self\.optimizers\(\)"):
        _fit(SteppingKept(), "fp8-lm", max_epochs=1)  # the FP8AdamW never steps: no global step would end the fit


def test_the_kept_adamw_follows_the_fp8adamw_after_a_resume(tmp_path):
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    _fit(_KeptScheduler(), "fp8-lm", max_steps=2, callbacks=[every], enable_checkpointing=True)
    module = _KeptScheduler()
    torch.manual_seed(0)
    trainer = L.Trainer(
        precision="fp8-lm", accelerator="cpu", max_steps=4, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(module, loader(n=24), ckpt_path=tmp_path / "epoch=0-step=2.ckpt")
    assert module.kept.param_groups is trainer.optimizers[0].param_groups  # load_state_dict gave it new group dicts
