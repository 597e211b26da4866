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

import itertools

import torch
from lightning_fp8.kernels.reference import _FP8_MAX, quantize_ref

# The state of one gradient's cast, packed in one int64[4] tensor so that a batched launch needs one address per
# tensor: bytes 0-15 fp32 [amax_history (one entry), scale, last_amax, saturation], then int64 [nonfinite_count,
# casts] (elements 2 and 3). The kernels (kernels/grad_cast_kernels.py) read and write it at these offsets.
STATE_SLOTS = 4
# The gradients' dtypes a batched cast reads.
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def check_grad_cast(
    grads: list[torch.Tensor],
    states: list[torch.Tensor],
    fp8_dtype: torch.dtype,
    pending_data: list[torch.Tensor] | None,
    pending_scale_inv: list[torch.Tensor] | None,
) -> None:
    """Raise for arguments of a batched gradient cast (non-empty ``grads``) that the Triton kernel refuses: it reads
    and writes every tensor by its address. ``lightning_fp8.ops.grad_cast`` runs these checks on the reference path
    too, so that both paths accept the same calls.

    Raises:
        TypeError: for an unknown ``fp8_dtype``, gradients of mixed or unsupported dtypes or not contiguous, states that
            are not contiguous int64 tensors of ``STATE_SLOTS`` elements, pending gradients that are not contiguous
            FP8 of one dtype, or a ``pending_scale_inv`` that is not one float32 value.
        ValueError: for a state count that is not the gradient count, ``pending_data`` without its scales (or the
            reverse), pending gradients of another count or size, a tensor on another device than ``grads[0]``, or
            states that overlap (one state passed for two gradients).
    """
    if fp8_dtype not in _FP8_MAX:
        raise TypeError(f"grad_cast: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    if len(states) != len(grads):
        raise ValueError(f"grad_cast: {len(states)} states for {len(grads)} gradients; pass one state per gradient")
    if (pending_data is None) != (pending_scale_inv is None):
        raise ValueError("grad_cast: pass pending_data and pending_scale_inv together (both or neither)")
    dtype = grads[0].dtype
    if dtype not in INPUT_DTYPES or not all([g.dtype == dtype and g.is_contiguous() for g in grads]):
        raise TypeError("grad_cast: the gradients must be contiguous and share one dtype (float32, bfloat16, float16)")
    # The kernel reads and writes each state and pending gradient by its address: a smaller one would reach other
    # memory.
    if not all([s.dtype == torch.int64 and s.numel() == STATE_SLOTS and s.is_contiguous() for s in states]):
        raise TypeError(f"grad_cast: each state must be a contiguous int64 tensor of {STATE_SLOTS} elements "
                        "(reference_grad_cast.new_grad_cast_state)")  # fmt: skip
    if pending_data is not None:
        if len(pending_data) != len(grads) or len(pending_scale_inv) != len(grads):
            raise ValueError(f"grad_cast: {len(pending_data)} pending gradients and {len(pending_scale_inv)} scale "
                             f"inverses for {len(grads)} gradients; pass one of each per gradient")  # fmt: skip
        p_dtype = pending_data[0].dtype
        if p_dtype not in _FP8_MAX or not all([d.dtype == p_dtype and d.is_contiguous() for d in pending_data]):
            raise TypeError("grad_cast: the pending gradients must be contiguous and share one FP8 dtype")
        if [d.numel() for d in pending_data] != [g.numel() for g in grads]:
            raise ValueError("grad_cast: each pending gradient must have its gradient's number of elements")
        # Read by address as one fp32 value: a float64 or float16 scale_inv was read as other bits (wrong gradients).
        if not all([s.dtype == torch.float32 and s.numel() == 1 for s in pending_scale_inv]):
            got = [(str(s.dtype), tuple(s.shape)) for s in pending_scale_inv]
            raise TypeError(f"grad_cast: each pending_scale_inv must be a one-element float32 tensor, got {got}")
    device = grads[0].device
    tensors = [*grads, *states, *(pending_data or ()), *(pending_scale_inv or ())]
    if not all([t.device == device for t in tensors]):
        raise ValueError(f"grad_cast: the gradients, states and pending gradients must all be on {device} (grads[0]'s)")
    # Each state's counters are updated in place by its own program: two gradients on one state would race on them
    # (the reference would count both, in order).
    starts = sorted(s.data_ptr() for s in states)
    if any(b - a < STATE_SLOTS * 8 for a, b in itertools.pairwise(starts)):
        raise ValueError("grad_cast: the states overlap (one state passed for two gradients?); pass one state per "
                         "gradient, each its own tensor (reference_grad_cast.new_grad_cast_state)")  # fmt: skip


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
            # The pending gradient as the kernel reads it: its elements in the gradient's shape.
            g = pending_data[i].float().reshape(grad.shape) * pending_scale_inv[i].reshape(()) + grad.float()
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
