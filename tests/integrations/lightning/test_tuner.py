"""Lightning's Tuner under precision="fp8-lm" (single device): the weights it restores, and the fit after it.

At O2, FP8AdamW makes each FP8 weight's storage its scaled fp16 master when the fit sets up, before the tuner saves
the model it restores when done: that model's FP8 weights are already rounded to fp16 (docs/guides/lightning.md).
"""

import lightning as L
import torch
from lightning.pytorch.tuner import Tuner

import lightning_fp8  # noqa: F401  (registers precision="fp8-lm")
from lightning_fp8 import FP8Linear
from lightning_fp8.optim import master
from tests.integrations.lightning.gpt_tiny import GPTModule, loader


def _trainer(tmp_path) -> L.Trainer:
    return L.Trainer(
        precision="fp8-lm", accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip


def _adopted(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as the O2 master holds it: rounded to fp16 under its power-of-two scale (exact to unscale)."""
    stored, scale, _ = master.quantize_fp16(weight)
    return stored.float() / scale


def test_lr_find_restores_the_adopted_weights_and_leaves_the_next_fit_unchanged(tmp_path):
    torch.manual_seed(0)
    module = GPTModule()
    initial = {name: value.clone() for name, value in module.state_dict().items()}
    trainer = _trainer(tmp_path)
    Tuner(trainer).lr_find(module, loader(), min_lr=1e-5, max_lr=1.0, num_training=5, update_attr=False)
    fp8_weights = {f"{name}.weight" for name, m in module.named_modules() if isinstance(m, FP8Linear)}
    assert fp8_weights
    for name, value in module.state_dict().items():  # the FP8 weights as adopted, everything else bit for bit
        assert torch.equal(value, _adopted(initial[name]) if name in fp8_weights else initial[name]), name
    module.losses.clear()
    trainer.fit(module, loader())
    torch.manual_seed(0)
    untuned = GPTModule()
    _trainer(tmp_path).fit(untuned, loader())
    # Adopting an adopted weight again gives the same master: the fit trains exactly as without the tuner
    assert module.losses == untuned.losses
    assert all(torch.equal(value, untuned.state_dict()[name]) for name, value in module.state_dict().items())
