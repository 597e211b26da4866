"""Gradients that still carry the gradient scale mu (the optimizer step unscales them), as the Lightning plugin and
the Accelerate integration handle them before the step: clipped as if they did not carry it, and unscaled in place
for code that reads them without rounding away what mu keeps representable (:class:`UnscaledGradients`)."""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_fp8.health import global_norm
from lightning_fp8.optim import fp8_grads


def check_clip_limit(caller: str, name: str, value: Any) -> None:
    """Raise for a clipping limit that is not a number from 0 to inf: a negative ``max_norm`` flipped every
    gradient's sign (the step then climbed the loss) and a NaN one made every gradient NaN (the step skipped, mu
    halved), silently, as in torch. 0 (clip to nothing) and inf (measure only) are limits."""
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (number or isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex()):
        raise TypeError(f"{caller}({name}={value!r}): expected a number >= 0")
    if not float(value) >= 0:  # NaN too
        raise ValueError(
            f"{caller}({name}={float(value)}): must be >= 0 (0 clips every gradient to zero, inf only measures); a "
            "negative limit would flip the gradients' signs and NaN would make them NaN; nothing was clipped"
        )


def checked_norm_type(caller: str, norm_type: Any) -> float:
    """``norm_type`` as a float, the string ``'inf'`` too (as torch's clip_grad_norm_ takes it); ValueError naming
    ``caller`` for anything but a number > 0: order 0 (torch's count of nonzero elements) and negative orders do not
    scale with the gradients, so mu cannot be divided out of them."""
    if norm_type == "inf":
        return math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real) or not float(norm_type) > 0:
        raise ValueError(f"{caller}(norm_type={norm_type!r}): expected a number > 0, or inf (math.inf or 'inf')")
    return float(norm_type)


def unique(parameters: Any) -> list[Tensor]:
    """``parameters`` (a tensor or an iterable of them) as a list, each tensor once: listed twice, a gradient would
    count twice in the norm and be multiplied twice (``torch.nn.utils.clip_grad_norm_`` does both)."""
    return list(dict.fromkeys([parameters] if isinstance(parameters, Tensor) else parameters))


def clip_grad_value_keeping_overflow_(parameters: Any, limit: float) -> None:
    """``torch.nn.utils.clip_grad_value_(parameters, limit)``, but infinities stay: clamped, an overflow would pass
    for a large finite gradient and the gradient scaler would take the step instead of skipping it (NaN stays NaN
    either way). The limit is capped at each gradient's largest finite value: ``clip_val * mu`` passes fp16's 65504
    once mu grows, which ``clamp`` refuses to convert, and every finite fp16 value is within that cap anyway."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    with torch.no_grad():
        for grad in (p.grad for p in params if p.grad is not None):
            cap = min(limit, torch.finfo(grad.dtype).max)
            grad.copy_(torch.where(grad.isinf(), grad, grad.clamp(-cap, cap)))


def clip_scaled_grad_norm_(
    parameters: Any, max_norm: float, mu: float = 1.0, check: Callable[[Tensor], None] | None = None
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (L2) of gradients that carry a factor ``mu``, as if they did not: each is
    multiplied by ``min(1, max_norm / (norm / mu + 1e-6))``, the norm summed in fp32 (their norm can be past fp16's
    range, which torch's fp16 norm would turn into inf and the factor into 0). Returns the norm of the gradients as
    they are. DTensor gradients (FSDP2) are reduced over their mesh. The gradients an FP8AdamW holds in FP8 for
    these parameters (``fp8_grads``: ``param.grad`` is None) count and are clipped too, through their scales
    (:func:`~lightning_fp8.optim.fp8_grads.scale_fp8_grads_`: the FP8 values stay as they are). ``check`` is called
    with the norm before anything is clipped (it may raise)."""
    params = unique(parameters)
    held = fp8_grads.held_fp8_grads(params)  # first: it folds a param.grad beside a held one into it
    grads = [p.grad for p in params if p.grad is not None]
    if not grads and not held:
        return torch.zeros((), dtype=torch.float32)  # the 0-dim fp32 norm, whatever the default dtype
    total = with_held_norms(global_norm(grads) if grads else None, fp8_grads.fp8_grad_norms(held))
    if check is not None:
        check(total)
    factor = clip_factor(total, max_norm, mu)
    if grads:
        mul_grads_by_(grads, factor)
    fp8_grads.scale_fp8_grads_(held, factor)
    return total


def clip_grad_norm_fp32(
    parameters: Any, max_norm: float, norm_type: float, grad_scale: float, check: Callable[[Tensor], None] | None = None
) -> Tensor:
    """Clip gradients that carry a factor ``grad_scale`` as if they did not; return the unscaled ``norm_type`` norm.

    Replicated gradients (one process, DDP). Norms are computed in fp32 whatever the gradients' dtype; a
    non-finite norm leaves the gradients as they are (:func:`finite_or_one`; torch's clip_grad_norm_ makes each 0 or
    NaN), a step the gradient scaler then skips. The gradients an FP8AdamW holds in FP8 for these parameters
    (``fp8_grads``) count and are clipped too, through their scales.
    ``check`` is called with the unscaled norm before anything is clipped (it may raise).
    """
    parameters = unique(parameters)
    held = fp8_grads.held_fp8_grads(parameters)  # first: it folds a param.grad beside a held one into it
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads and not held:
        return torch.zeros((), dtype=torch.float32)  # the 0-dim fp32 norm, whatever the default dtype
    norms = [fp8_grads.p_norm(g, norm_type) for g in grads]
    others = fp8_grads.p_norm(torch.stack(norms), norm_type) if norms else None
    total = with_held_norms(others, fp8_grads.fp8_grad_norms(held, norm_type), norm_type) / grad_scale
    if check is not None:
        check(total)
    coef = finite_or_one(total, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    fp8_grads.scale_fp8_grads_(held, coef)
    return total


def with_held_norms(total: Tensor | None, held: list[Tensor], norm_type: float = 2.0) -> Tensor:
    """The ``norm_type`` norm of ``total`` (the norm of the other gradients, or None) and the held FP8 gradients'
    norms ``held``, in fp32, on ``total``'s device (else the first held one's)."""
    if not held and total is not None:
        return total
    parts = ([] if total is None else [total.float().reshape(())]) + [n.reshape(()) for n in held]
    device = parts[0].device
    return fp8_grads.p_norm(torch.stack([t.to(device) for t in parts]), norm_type)


def clip_factor(total: Tensor, max_norm: float, mu: float) -> Tensor:
    # torch's clip_grad_norm_ factor of the true gradients (norm total / mu), its 1e-6 in their units; 1 where the
    # norm is not finite (finite_or_one).
    return finite_or_one(total, torch.clamp(max_norm * mu / (total.float() + 1e-6 * mu), max=1.0))


def finite_or_one(total: Tensor, factor: Tensor) -> Tensor:
    """``factor``, or 1 where the norm ``total`` is not finite: gradients that carry mu are clipped before a step the
    gradient scaler skips when any of them is not finite, and torch's ``max_norm / norm`` would make every gradient
    NaN (or 0) there, so the scaler's ``"bf16"`` fallback would put back every FP8 layer, not the ones whose
    gradients overflowed. No host sync: a ``torch.where`` on the device."""
    return torch.where(torch.isfinite(total), factor, torch.ones_like(factor))


def mul_grads_by_(grads: list[Tensor], factor: Tensor) -> None:
    # grads *= factor (0-dim fp32 tensor), per device; the plain factor multiplies DTensors as a replicated value.
    by_device: dict[torch.device, list[Tensor]] = {}
    for grad in grads:
        by_device.setdefault(grad.device, []).append(grad)
    with _implicit_replication(grads):
        for device, group in by_device.items():
            torch._foreach_mul_(group, factor.to(device))


def _implicit_replication(tensors: list[Tensor]) -> contextlib.AbstractContextManager:
    if not any(type(t).__name__ == "DTensor" for t in tensors):
        return contextlib.nullcontext()
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()


def optimizer_grads(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The dense gradients of ``optimizer``'s parameters."""
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None and not p.grad.is_sparse]


def mul_grads_(grads: list[Tensor], factor: float) -> None:
    """``grads *= factor`` in place, rounded once in each gradient's dtype.

    The factor goes in as a 0-dim fp32 tensor: ``torch._foreach_mul_`` with a Python scalar first rounds the
    scalar to the tensors' dtype, so for fp16 gradients 2^16 becomes inf and 2^-25 becomes 0.
    """
    by_device: dict[torch.device, list[Tensor]] = {}
    for grad in grads:
        by_device.setdefault(grad.device, []).append(grad)
    for device, group in by_device.items():
        torch._foreach_mul_(group, torch.full((), factor, dtype=torch.float32, device=device))  # no H2D copy


class UnscaledGradients:
    """``optimizer``'s gradients divided by ``mu`` in place, with the fp16 ones' scaled values kept (see
    :meth:`~lightning_fp8.integrations.lightning.FP8LMPrecision.unscaled_gradients`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, mu: float) -> None:
        self.optimizer, self.mu = optimizer, mu
        grads = optimizer_grads(optimizer)
        kept = [g.clone() if g.dtype == torch.float16 else None for g in grads]
        mul_grads_(grads, 1.0 / mu)
        self.kept = {id(g): (g, k, g._version) for g, k in zip(grads, kept, strict=True) if k is not None}

    def scale_back(self) -> None:
        """Multiply the gradients by mu again, except an fp16 gradient not written through itself (its version
        counter): its elements that still hold what the division left get their kept scaled values back, the others
        (written through ``.data`` or another alias, which leave the counter alone) are multiplied, rounded once.
        An element set through an alias to the very value it held unscaled (0 where the true gradient is below
        fp16's range) counts as unchanged."""
        multiply = []
        with torch.no_grad():
            for grad in optimizer_grads(self.optimizer):  # hooks may have put new gradient tensors in place
                entry = self.kept.get(id(grad))
                if entry is None or entry[0] is not grad or grad._version != entry[2]:
                    multiply.append(grad)
                    continue
                kept = entry[1]
                untouched = grad == _times(kept, 1.0 / self.mu)  # what mul_grads_ made of it: one rounding
                grad.copy_(torch.where(untouched, kept, _times(grad, self.mu)))
        mul_grads_(multiply, self.mu)
        self.kept = {}


def _times(t: Tensor, factor: float) -> Tensor:
    # t * factor computed in fp32 and rounded once to t's dtype, as mul_grads_ does in place.
    return (t.float() * factor).to(t.dtype)
