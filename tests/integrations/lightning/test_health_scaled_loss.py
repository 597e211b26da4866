"""TrainingHealthMonitor logs the true loss when the module scales its own loss with an FP8GradScaler.

Two documented ways of scaling by hand under a precision without FP8: ``training_step`` returns
``scaler.scale_loss(loss)`` (the loss Lightning hands the callback then carries mu), or an overridden ``backward``
scales it (the returned loss does not). mu changes inside every step here (``growth_interval=1``: each step doubles
it), so dividing by the scaler's mu at the end of the batch would be off by 2.
"""

import gc
import warnings
import weakref

import lightning as L
import pytest
import torch

from lightning_fp8 import FP8AdamW, FP8GradScaler
from lightning_fp8.callbacks import TrainingHealthMonitor
from lightning_fp8.integrations.lightning import FP8LMPrecision
from tests.integrations.lightning.gpt_tiny import GPTModule, loader

INIT_SCALE = 2.0**10
STEPS = 3
# The fp32 mean over the accumulated micro-batches against the mean of the same Python floats.
LOSS_RTOL = 1e-6


class ScalesByHand(GPTModule):
    """The user's own FP8AdamW and FP8GradScaler; ``where`` says where the loss is scaled. ``self.losses`` keeps the
    unscaled losses (GPTModule records them in ``training_step`` before anything scales them)."""

    def __init__(self, where: str, init_scale: float = INIT_SCALE) -> None:
        super().__init__()
        self.where, self.init_scale = where, init_scale

    def configure_optimizers(self):
        self.scaler = FP8GradScaler(init_scale=self.init_scale, growth_interval=1)
        return FP8AdamW(self.parameters(), lr=1e-3, fp8_grads=False, grad_scaler=self.scaler)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return self.scaler.scale_loss(loss) if self.where == "training_step" else loss

    def backward(self, loss, *args, **kwargs):
        (self.scaler.scale_loss(loss) if self.where == "backward" else loss).backward(*args, **kwargs)


def _fit(module: GPTModule, tmp_path, accumulate: int = 1, **kwargs) -> TrainingHealthMonitor:
    health = TrainingHealthMonitor(log_every_n_steps=1, plot=False)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        callbacks=[health],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no logger, a few steps: Lightning's own advice
        trainer.fit(module, loader(n=6 * STEPS * accumulate))
    return health


def _true_losses(module: GPTModule, accumulate: int) -> list[float]:
    # What each optimizer step's health/loss should be: the mean of its micro-batches' unscaled losses.
    losses = module.losses
    return [sum(losses[i : i + accumulate]) / accumulate for i in range(0, len(losses), accumulate)]


@pytest.mark.parametrize(
    ("where", "precision", "accumulate", "init_scale"),
    [
        ("training_step", "32-true", 1, INIT_SCALE),
        ("training_step", "bf16-mixed", 2, INIT_SCALE),
        ("backward", "32-true", 1, INIT_SCALE),
        ("backward", "32-true", 2, INIT_SCALE),
        # mu == accumulate_grad_batches in the first step: a loss scaled in backward, (L / 2) * 2, divided by 2 is the
        # L / 2 Lightning hands the callback, by value, and was taken for a returned scaled loss
        ("backward", "32-true", 2, 2.0),
        ("training_step", "32-true", 2, 2.0),
    ],
)
def test_health_loss_is_the_unscaled_loss_wherever_the_module_scales_it(
    tmp_path, where, precision, accumulate, init_scale
):
    torch.manual_seed(0)
    module = ScalesByHand(where, init_scale)
    health = _fit(module, tmp_path, accumulate, precision=precision)
    # mu grew in every step, between the scale_loss and the batch end: each loss carries a different mu.
    assert module.scaler.get_scale() == init_scale * 2**STEPS
    logged = [value for _, value in health.monitor.series["loss"]]
    assert logged == pytest.approx(_true_losses(module, accumulate), rel=LOSS_RTOL)
    assert health._metrics()["health/loss"] == pytest.approx(logged[-1])
    assert health._metrics()["health/loss_smooth"] == pytest.approx(sum(logged) / len(logged), rel=LOSS_RTOL)


@pytest.mark.parametrize(("accumulate", "init_scale"), [(1, INIT_SCALE), (2, 2.0), (4, 4.0)])
def test_health_loss_under_fp8_lm_is_the_loss_before_the_plugin_scales_it(tmp_path, accumulate, init_scale):
    # FP8LMPrecision scales the loss in its backward, after training_step: the loss handed to the callback is
    # unscaled, also when mu equals accumulate_grad_batches (the plugin's scaled loss divided by it is, by value, the
    # loss Lightning hands the callback: it was divided by mu).
    torch.manual_seed(0)
    module = GPTModule()
    plugin = FP8LMPrecision(grad_scaler={"init_scale": init_scale, "growth_interval": 10**6})
    health = _fit(module, tmp_path, accumulate, plugins=[plugin])
    assert plugin.grad_scaler.get_scale() == init_scale
    logged = [value for _, value in health.monitor.series["loss"]]
    assert logged == pytest.approx(_true_losses(module, accumulate), rel=LOSS_RTOL)


def test_the_scaler_keeps_no_graph_of_the_losses_it_scaled():
    # What the scaler remembers of a scaled loss (for the monitor to recognise it) must not keep its graph alive.
    scaler = FP8GradScaler(init_scale=INIT_SCALE)
    x = torch.randn(5, 7, requires_grad=True)
    hidden = x * 3.0
    ref = weakref.ref(hidden)
    scaler.scale_loss(hidden.square().mean())  # square() saves `hidden` for its backward
    del hidden
    gc.collect()
    assert ref() is None
