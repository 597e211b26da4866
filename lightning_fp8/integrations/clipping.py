"""Gradient clipping shared by the Lightning plugin and the Accelerate integration, on gradients that still carry
the gradient scale mu (the optimizer step unscales them)."""

from __future__ import annotations

from typing import Any

import torch


def clip_grad_value_keeping_overflow_(parameters: Any, limit: float) -> None:
    """``torch.nn.utils.clip_grad_value_(parameters, limit)``, but infinities stay: clamped, an overflow would pass
    for a large finite gradient and the gradient scaler would take the step instead of skipping it (NaN stays NaN
    either way)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    with torch.no_grad():
        for grad in (p.grad for p in params if p.grad is not None):
            grad.copy_(torch.where(grad.isinf(), grad, grad.clamp(-limit, limit)))
