"""What lab.py records during each variant's training: per-step loss and time, validation losses, the FP8 layers'
scales, the gradient scale (mu) and the bytes per parameter that persist across steps."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_fp8 import fp8_modules, fp8_stats


def grad_scaler(trainer: L.Trainer) -> Any | None:
    """The FP8 gradient scaler (mu) of an FP8-LM run; None for BF16 and torchao."""
    return getattr(trainer.precision_plugin, "grad_scaler", None)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _bytes_per_param(model: torch.nn.Module, optimizer: torch.optim.Optimizer, linear_only: bool) -> float:
    """Bytes that persist across steps per parameter: the parameter's storage and its optimizer states.

    Measured from the tensors, not modelled. Gradients are left out: they are transient, and where they live
    between backward and step differs (``p.grad``, or FP8AdamW's FP8 copy). ``linear_only``: only the weights
    of the transformer blocks' linear layers (those FP8 converts), as in DESIGN.md's bytes-per-parameter table.
    """
    total, count = 0, 0
    for name, p in model.named_parameters():
        if linear_only and not (name.startswith("blocks.") and p.dim() == 2):
            continue
        states = [t for t in optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor)]
        total += sum(t.numel() * t.element_size() for t in [p, *states])
        count += p.numel()
    return total / count


class LabRecorder(Callback):
    """Records per-step loss and time, validation losses, per-layer FP8 scales, and the gradient scaler."""

    def __init__(self, tokens_per_step: int, scale_every: int) -> None:
        self.tokens_per_step, self.scale_every = tokens_per_step, scale_every
        self.steps: list[int] = []
        self.train_loss: list[float] = []
        self.step_seconds: list[float] = []
        self.val: list[tuple[int, float]] = []
        self.scale_steps: list[int] = []
        self.scales: dict[str, dict[str, list[float]]] = {}  # layer -> role -> log2(scale) per scale step
        self.grad_scale: list[tuple[int, float]] = []
        self.bytes_per_param = {"all": math.nan, "linear": math.nan}
        self._t0 = 0.0

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int):
        _sync()
        self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = float(outputs["loss"])  # waits for the step on a GPU
        _sync()
        step = trainer.global_step
        self.steps.append(step)
        self.step_seconds.append(time.perf_counter() - self._t0)
        self.train_loss.append(loss)
        if step >= 1 and math.isnan(self.bytes_per_param["all"]):  # the states exist after the first step
            optimizer = getattr(trainer.optimizers[0], "_optimizer", trainer.optimizers[0])
            for key, linear_only in (("all", False), ("linear", True)):
                self.bytes_per_param[key] = _bytes_per_param(pl_module.model, optimizer, linear_only)
        if step % self.scale_every == 0 or step == 1:
            self._record_scales(trainer, pl_module, step)

    def _record_scales(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        scaler = grad_scaler(trainer)
        if scaler is not None:
            self.grad_scale.append((step, float(scaler.scale)))
        if not fp8_modules(pl_module):
            return
        layers = fp8_stats(pl_module.model)["layers"]
        self.scale_steps.append(step)
        for layer, roles in layers.items():
            for role, values in roles.items():
                self.scales.setdefault(layer, {}).setdefault(role, []).append(math.log2(values["scale"]))

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # During fit only: the final trainer.validate() after fit is reported separately.
        if trainer.state.fn == "fit" and not trainer.sanity_checking and "val_loss" in trainer.callback_metrics:
            self.val.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))

    def tokens_per_second(self) -> float:
        """Median over steps after a warm-up (compilation, allocator, first scales) of 10% of the run."""
        skip = max(3, len(self.step_seconds) // 10)
        times = self.step_seconds[skip:] or self.step_seconds
        return self.tokens_per_step / statistics.median(times) if times else math.nan
