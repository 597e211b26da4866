"""FP8AdamWs that the user builds in configure_optimizers, which the plugin keeps: the gradient scaler they bring (the
plugin scales every backward by one mu, so one scaler, and none the user gave is dropped silently), and the O2 masters
they keep in the weights' storage whatever the plugin's recipe (weight averaging is refused with them)."""

import lightning as L
import pytest
import torch

from lightning_fp8 import FP8AdamW, FP8GradScaler
from lightning_fp8.integrations.lightning import FP8LMPrecision
from tests.integrations.lightning.gpt_tiny import GPTModule, loader


def _trainer(plugin: FP8LMPrecision, **kwargs) -> L.Trainer:
    return L.Trainer(
        plugins=[plugin], accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip


class _OwnScalers(GPTModule):
    """Two FP8AdamWs (the model's first half, the rest), each built with ``scalers[i]`` (manual optimization)."""

    scalers: tuple = (None, None)

    def __init__(self) -> None:
        super().__init__(manual=True)

    def configure_optimizers(self):
        params = list(self.model.parameters())
        half = len(params) // 2
        return [
            FP8AdamW(part, lr=self.lr, grad_scaler=scaler)
            for part, scaler in zip((params[:half], params[half:]), self.scalers, strict=True)
        ]

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            optimizer.step()
            optimizer.zero_grad()
        return loss


def _module(*scalers) -> _OwnScalers:
    torch.manual_seed(0)
    module = _OwnScalers()
    module.scalers = scalers
    return module


def test_fp8adamws_with_different_scalers_are_refused_naming_them():
    """Found by a sweep: the plugin scaled the loss by the last FP8AdamW's scaler and stepped the others through it,
    so the first one's scaler (its init_scale, growth settings) was ignored without a word."""
    first, second = FP8GradScaler(init_scale=2.0**8), FP8GradScaler()
    trainer = _trainer(FP8LMPrecision())
    with pytest.raises(ValueError, match=r"2 different gradient scalers.*one FP8GradScaler"):
        trainer.fit(_module(first, second), loader(n=12))
    assert first.state_dict()["steps"] == second.state_dict()["steps"] == 0


def test_an_fp8adamw_scaler_other_than_the_plugins_own_is_refused():
    """Found by a sweep: FP8LMPrecision(grad_scaler={...}) was dropped for the scaler of the user's FP8AdamW, silently
    (the plugin's init_scale=1024 never scaled a loss)."""

    class Module(GPTModule):
        def configure_optimizers(self):
            return FP8AdamW(self.parameters(), lr=self.lr, grad_scaler=FP8GradScaler())

    trainer = _trainer(FP8LMPrecision(grad_scaler={"init_scale": 2.0**10}))
    with pytest.raises(ValueError, match=r"FP8LMPrecision\(grad_scaler=...\).*FP8AdamW.*same FP8GradScaler"):
        trainer.fit(Module(), loader(n=12))


def test_one_scaler_shared_or_brought_by_one_optimizer_scales_every_backward():
    shared = FP8GradScaler(init_scale=2.0**4, growth_interval=10**6)
    module = _module(shared, shared)
    trainer = _trainer(FP8LMPrecision(grad_scaler=shared))  # the same one on the plugin too
    trainer.fit(module, loader(n=12))
    assert trainer.precision_plugin.grad_scaler is shared
    assert all(optimizer.optimizer.grad_scaler is shared for optimizer in module.optimizers())
    # One FP8AdamW brings a scaler, the other none: both step through the one brought, which scales the loss.
    brought = FP8GradScaler(init_scale=2.0**4, growth_interval=10**6)
    module = _module(None, brought)
    trainer = _trainer(FP8LMPrecision())
    trainer.fit(module, loader(n=12))
    assert trainer.precision_plugin.grad_scaler is brought and brought.loss_scale == 2.0**4
    assert all(optimizer.optimizer.grad_scaler is brought for optimizer in module.optimizers())


@pytest.mark.parametrize("plugin", ["o1_recipe", "replace_optimizers_false"])
def test_weight_averaging_is_refused_when_an_fp8adamw_of_the_users_keeps_o2_masters(plugin):
    """Found by a sweep: the refusal looked only at the plugin's own recipe, so precision='fp8-lm-o1' (or
    replace_optimizers=False) with an FP8AdamW of the user's at O2 (its default) ran StochasticWeightAveraging on the
    fp16 masters times their scales: the averaged weights were 135% off the O1 run's, silently."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    class Module(GPTModule):
        def configure_optimizers(self):
            return FP8AdamW(self.parameters(), lr=self.lr, recipe="fp8-lm")

    precision = FP8LMPrecision("fp8-lm-o1") if plugin == "o1_recipe" else FP8LMPrecision(replace_optimizers=False)
    trainer = _trainer(precision, callbacks=[StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)])
    with pytest.raises(ValueError, match=r"cannot run with StochasticWeightAveraging.*opt_level='O1'"):
        trainer.fit(Module(), loader(n=12))
