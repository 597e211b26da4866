"""Pure-PyTorch reference of the batched FP8 gradient cast (kernels/grad_cast.py), and the packed state it updates.

Each gradient gets the cast FP8AdamW gives a gradient on its own: current scaling with a small per-parameter scaling
state (a history of one), ``quantize_ref(g, *state_buffers(state), fp8_dtype, margin, True, False, True, False)``.
The batch only changes how many launches that takes; the numerics are those of :func:`quantize_ref`, per tensor::

    g        = grad                                             or, accumulating onto a pending FP8 gradient,
    g        = float32(pending) * pending_scale_inv + float32(grad)      (two roundings: no fused multiply-add)
    scale    <- pow2_scale(amax(g)) (kept where amax is 0 or not finite);  g_fp8 = RNE(saturate(g * scale))
    state    <- record(amax, #{finite g: |g * scale| >= fp8_max}, numel);  scale_inv = 1 / scale
    n_big    = #{|g| >= fp8_max}    (the count FP8GradScaler.record_gradient_cast takes: mu is the only scale it knows)
"""

from __future__ import annotations

import torch
from lightning_fp8.kernels.reference import _FP8_MAX, quantize_ref

# The state of one gradient's cast, packed in one int64[4] tensor so that a batched launch needs one address per
# tensor: bytes 0-15 fp32 [amax_history (one entry), scale, last_amax, saturation], then int64 [nonfinite_count,
# casts] (elements 2 and 3). The kernels (kernels/grad_cast_kernels.py) read and write it at these offsets.
STATE_SLOTS = 4


def new_grad_cast_state(device: torch.device | str) -> torch.Tensor:
    """A fresh packed state: history 0, scale 1, last amax 0, saturation 0, counters 0."""
    state = torch.zeros(STATE_SLOTS, dtype=torch.int64, device=device)
    state[:2].view(torch.float32)[1] = 1.0
    return state


def grad_cast_state_buffers(state: torch.Tensor) -> list[torch.Tensor]:
    """Views of a packed state as the arguments of ``quantize_ref``: ``[amax_history (1,), scale, last_amax,
    saturation, nonfinite_count, casts]`` (0-dim except the history); writes through them update ``state``."""
    f32 = state[:2].view(torch.float32)
    return [f32[0:1], f32[1], f32[2], f32[3], state[2], state[3]]


def grad_cast_ref(
    grads: list[torch.Tensor],
    states: list[torch.Tensor],
    fp8_dtype: torch.dtype,
    *,
    pending_data: list[torch.Tensor] | None = None,
    pending_scale_inv: list[torch.Tensor] | None = None,
    margin: int = 0,
    count_big: bool = False,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Cast each gradient to FP8 with current scaling, updating its packed state in place (module docstring).

    Args:
        grads: high-precision gradients (fp32, bf16 or fp16), each contiguous.
        states: one packed state per gradient (:func:`new_grad_cast_state`), all distinct.
        fp8_dtype: the FP8 format of the casts.
        pending_data, pending_scale_inv: FP8 gradients (one format, contiguous, the gradients' shapes) and their 0-dim
            fp32 ``scale_inv``, added to the gradients before the cast (gradient accumulation); both or neither.
        margin: binades of headroom of the scales.
        count_big: also count the values with ``|g| >= fp8_max`` (for the gradient scaler).

    Returns:
        ``(g_fp8, scale_inv, amax, n_big)``: the FP8 gradients (the gradients' shapes), fp32 [T] ``1 / scale``,
        fp32 [T] amaxes (NaN counts as inf; also each state's last amax), int64 [T] counts or ``None``.
    """
    outs, scale_invs, amaxes, bigs = [], [], [], []
    fmax = _FP8_MAX[fp8_dtype]
    for i, (grad, state) in enumerate(zip(grads, states, strict=True)):
        g = grad
        if pending_data is not None:
            g = pending_data[i].float() * pending_scale_inv[i] + grad.float()
        buffers = grad_cast_state_buffers(state)
        g_fp8, _, scale_inv = quantize_ref(g.contiguous(), *buffers, fp8_dtype, margin, True, False, True, False)
        outs.append(g_fp8)
        scale_invs.append(scale_inv.reshape(()))
        amaxes.append(buffers[2].clone())
        if count_big:
            bigs.append((g.abs() >= fmax).sum())
    device = grads[0].device if grads else torch.device("cpu")
    scale_inv_out = torch.stack(scale_invs) if grads else torch.empty(0, dtype=torch.float32, device=device)
    amax_out = torch.stack(amaxes) if grads else torch.empty(0, dtype=torch.float32, device=device)
    n_big = None
    if count_big:
        n_big = torch.stack(bigs) if grads else torch.empty(0, dtype=torch.int64, device=device)
    return outs, scale_inv_out, amax_out, n_big
