"""A BaseFinetuning fit resumed at precision="fp8-lm" after its backbone was unfrozen: the callback puts the saved
parameter groups in place directly (``optimizer.param_groups = ...``) before Lightning loads the optimizer state, and
FP8AdamW takes the backbone's FP8 weights in as add_param_group did in the uninterrupted fit (O2 states, the weight's
storage its fp16 master). They stepped with fp32 states (16 bytes per parameter) and the run left the uninterrupted
one's path by about 1e-2."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import BaseFinetuning, ModelCheckpoint  # noqa: E402

import lightning_fp8  # noqa: E402, F401  (registers precision="fp8-lm")

UNFREEZE_AT = 1


class _Finetuning(BaseFinetuning):
    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.backbone)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._restarting:  # resumed after the unfreezing epoch (setup froze the backbone again)
            self.make_trainable(pl_module.backbone)
        super().on_fit_start(trainer, pl_module)

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == UNFREEZE_AT:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=5e-3, initial_denom_lr=1.0)


class _Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64))
        self.head = nn.Linear(64, 16)

    def training_step(self, batch: tuple, _: int) -> torch.Tensor:
        x, y = batch
        return (self.head(self.backbone(x)) - y).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class _Probe(L.Callback):
    """The backbone's first weight and its optimizer state as the first resumed step starts."""

    def __init__(self) -> None:
        self.seen: dict = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if not self.seen:
            weight = pl_module.backbone[0].weight
            state = trainer.optimizers[0].state[weight]
            self.seen = {"dtype": weight.dtype, "exp_avg": state["exp_avg"].dtype, "apart": "master" in state}


def _fit(epochs: int, tmp_path, ckpt_path: str | None = None, save: bool = False) -> tuple[_Module, _Probe]:
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    data = DataLoader(TensorDataset(x, torch.tanh(x @ torch.randn(32, 16))), batch_size=16)
    module, probe = _Module(), _Probe()
    callbacks = [_Finetuning(), ModelCheckpoint(dirpath=tmp_path, save_last=True)] if save else [_Finetuning()]
    trainer = L.Trainer(precision="fp8-lm", accelerator="cpu", max_epochs=epochs, logger=False, num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=save,
                        callbacks=[*callbacks, probe] if ckpt_path else callbacks)  # fmt: skip
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return module, probe


def test_resumed_after_the_backbone_was_unfrozen_continues_bit_identically_with_o2_states(tmp_path):
    uninterrupted, _ = _fit(4, tmp_path / "a")
    _fit(2, tmp_path / "b", save=True)
    resumed, probe = _fit(4, tmp_path / "c", ckpt_path=str(tmp_path / "b" / "last.ckpt"))
    assert probe.seen == {"dtype": torch.float16, "exp_avg": torch.float8_e4m3fn, "apart": False}
    for (name, a), b in zip(uninterrupted.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
