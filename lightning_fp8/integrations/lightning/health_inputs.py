"""What :class:`~lightning_fp8.integrations.lightning.health_callback.TrainingHealthMonitor` reads from a batch and a
run: the samples in a batch, the run's FP8GradScalers, and a logged loss without the scaler's factor.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_fp8.integrations.lightning.callbacks import _unwrap_optimizer


def count_samples(batch: Any) -> int | None:
    """Samples in ``batch``: Lightning's batch size (the first dimension of its first tensor), else the length of a
    flat list or tuple (a list of strings, as a dataset of raw text collates), else ``None``."""
    try:
        return extract_batch_size(batch)
    except (MisconfigurationException, RecursionError):  # no tensor in it
        pass
    # Only a flat sequence's length counts samples: a dict's is its keys, [texts, labels]'s is 2.
    if isinstance(batch, (list, tuple)) and not any(isinstance(x, (list, tuple, dict)) for x in batch):
        return len(batch)
    return None


def _grad_scalers(trainer: Trainer) -> list[Any]:
    """Every FP8GradScaler of the run: the precision plugin's and the optimizers' (``grad_scaler``), once each."""
    found = [getattr(trainer.precision_plugin, "grad_scaler", None)]
    found += [getattr(_unwrap_optimizer(optimizer), "grad_scaler", None) for optimizer in trainer.optimizers]
    scalers: list[Any] = []
    for scaler in found:
        if hasattr(scaler, "scaled_losses") and not any(scaler is seen for seen in scalers):
            scalers.append(scaler)
    return scalers


def _true_loss(loss: torch.Tensor, normalize: int, scaled_losses: list[tuple[torch.Tensor, float]]) -> torch.Tensor:
    """``loss * normalize`` in fp32, divided by mu when ``loss`` is ``scaled / normalize`` for one of
    ``scaled_losses`` (an FP8GradScaler's ``scale_loss`` results, each with the mu it applied); the newest match wins.

    Lightning hands callbacks ``(training_step's loss / normalize).detach().clone()`` (manual optimization: the loss
    detached), never the tensor scale_loss returned, so the loss is known by its value. mu is a power of two, so where
    it is not 1 a loss that does not carry it is 2x off at least; a few ulps tell them apart. On the device (no host
    synchronization).
    """
    base = loss.float() * normalize
    if not loss.is_floating_point():
        return base
    rtol = 4 * torch.finfo(loss.dtype).eps
    true_loss = base
    for scaled, mu in scaled_losses:
        if scaled.shape == loss.shape and scaled.dtype == loss.dtype and scaled.device == loss.device:
            carries_mu = torch.isclose(loss, scaled / normalize, rtol=rtol, atol=0.0)
            true_loss = torch.where(carries_mu, base / mu, true_loss)
    return true_loss
