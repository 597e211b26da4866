"""FP8AdamW's gradient casts, batched: the gradient hooks queue high-precision gradients, a flush casts them together.

Casting each gradient in its hook costs two launches and a dozen small host operations, ~300 us of host time per FP8
weight on an H100; under torch.compile the backward hands every gradient over at its end, so the hooks run back to
back and the step becomes host-bound. Queued, the gradients of a flush are cast in two launches on a GPU
(kernels/grad_cast.py; the reference elsewhere), each bit for bit as its own cast would have been: the same FP8 data,
``scale_inv`` and amax, the same updates of its per-parameter scaling state, the same report to the gradient scaler.

A flush runs

- when the queued gradients reach ``bucket_bytes`` (so an eager backward keeps at most about that many bytes of
  high-precision gradients alive: they are freed as they are cast);
- at the end of the backward pass (a callback the first hook of each backward queues on the autograd engine);
- before anything reads the pending FP8 gradients or the scaling states (FP8AdamW calls :meth:`GradCastQueue.flush`:
  the step, the gradient scaler's checks, state dicts, statistics, ``release``, a direct ``accumulate_fp8_grad``).

Accumulation keeps the unbatched meaning: a queued gradient of a parameter whose FP8 gradient is pending is added to
its dequantized value and the sum is cast again; a parameter queued twice before a flush flushes the queue first.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import TYPE_CHECKING, Any

import torch

from lightning_fp8 import ops
from lightning_fp8.kernels.reference_grad_cast import grad_cast_state_buffers, new_grad_cast_state
from lightning_fp8.recipe import ArgumentTypeError

if TYPE_CHECKING:
    from lightning_fp8.optim.adamw import FP8AdamW

# Gradient dtypes the batched casts take; others are cast one by one (FP8AdamW.accumulate_fp8_grad).
_BATCHED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MB = 2**20


class FP8Grad:
    """A gradient in FP8 waiting for the step: ``grad ~= data * scale_inv`` (still multiplied by mu)."""

    __slots__ = ("data", "scale_inv", "amax")

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor) -> None:
        self.data, self.scale_inv, self.amax = data, scale_inv, amax


def bucket_bytes(bucket_mb: Any) -> int:
    """The flush bound in bytes of ``FP8AdamW(grad_cast_bucket_mb=...)``.

    Raises:
        ValueError: for anything but a finite number >= 0 (:class:`~lightning_fp8.recipe.ArgumentTypeError`, a
            ``TypeError`` too, for what is no number).
    """
    ok = isinstance(bucket_mb, (int, float)) and not isinstance(bucket_mb, bool)
    if not ok or not math.isfinite(bucket_mb) or bucket_mb < 0:
        raise (ValueError if ok else ArgumentTypeError)(
            f"FP8AdamW(grad_cast_bucket_mb={bucket_mb!r}) is not supported: use a number of megabytes >= 0 (e.g. 64), "
            "or 0 to cast each gradient in its own hook"
        )
    return int(bucket_mb * _MB)


def cast_state(states: dict[torch.Tensor, tuple], p: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(packed, buffers)``: the scaling state of ``p``'s gradient cast in ``states``, created once (on ``p``'s
    device): packed for the batched kernels, and as the buffers of a ``ScalingState`` (history of one) for
    ``ops.quantize`` (kernels/reference_grad_cast.py)."""
    state = states.get(p)
    if state is None or state[0].device != p.device:
        packed = new_grad_cast_state(p.device)
        state = states[p] = (packed, grad_cast_state_buffers(packed))
    return state


@torch.compiler.disable  # eager, as the gradient hooks (fp8_grads.py)
def _end_of_backward(owner: weakref.ref) -> None:
    optimizer = owner()
    if optimizer is not None:
        optimizer._grad_casts.flush(optimizer)


class GradCastQueue:
    """High-precision gradients of FP8 weights waiting for their FP8 cast, in hook order.

    Args:
        bucket_bytes: flush when the queued gradients reach this many bytes; 0 casts each gradient in its hook.
    """

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self._queued: dict[torch.Tensor, torch.Tensor] = {}  # param -> its high-precision gradient
        self._bytes = 0
        self._graph_task = -1  # the backward (autograd graph task) whose end already flushes

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, p: torch.Tensor) -> bool:
        return p in self._queued

    @property
    def nbytes(self) -> int:
        """Bytes of the queued high-precision gradients."""
        return self._bytes

    def put(self, opt: FP8AdamW, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Queue ``grad`` (``p``'s new gradient, taken from ``p.grad`` by the hook); may flush (module docstring)."""
        if self.bucket_bytes == 0 or grad.dtype not in _BATCHED_DTYPES or grad.is_sparse:
            opt.accumulate_fp8_grad(p, grad)  # the unbatched cast (and its checks)
            return
        if p in self._queued:  # a second gradient before the first was cast: cast the first, as the hook would have
            self.flush(opt)
        self._queued[p] = grad
        self._bytes += grad.numel() * grad.element_size()
        task = torch._C._current_graph_task_id()
        if task != self._graph_task and task != -1:  # the first hook of this backward: flush at its end
            self._graph_task = task
            callback = functools.partial(_end_of_backward, weakref.ref(opt))  # no reference to the optimizer
            torch.autograd.Variable._execution_engine.queue_callback(callback)
        if self._bytes >= self.bucket_bytes:
            self.flush(opt)

    def clear(self) -> None:
        """Drop the queued gradients uncast (``zero_grad``)."""
        self._queued = {}
        self._bytes = 0

    def flush(self, opt: FP8AdamW) -> None:
        """Cast the queued gradients into ``opt``'s pending FP8 gradients (and free them): one batched cast per
        device, gradient dtype and pending FP8 dtype (accumulation), so a few launches whatever the count."""
        if not self._queued:
            return
        queued = self._queued
        self.clear()
        pending = opt._pending
        groups: dict[tuple, list[tuple]] = {}
        for p, grad in queued.items():
            entry = pending.get(p)
            key = (grad.device, grad.dtype, None if entry is None else entry.data.dtype)
            group = groups.get(key)
            if group is None:
                group = groups[key] = []
            group.append((p, grad, entry))
        del queued
        with torch.no_grad():
            for key, group in groups.items():
                _cast_group(opt, group, accumulate=key[2] is not None)


def _cast_group(opt: FP8AdamW, group: list[tuple], accumulate: bool) -> None:
    # One batched cast; each result as FP8AdamW.accumulate_fp8_grad stores it (amax: the state's last amax).
    params = [p for p, _, _ in group]
    grads = [g if g.is_contiguous() else g.contiguous() for _, g, _ in group]
    states = [cast_state(opt._grad_cast_states, p) for p in params]
    pending_data = pending_scale_inv = None
    if accumulate:
        pending_data = [e.data if e.data.is_contiguous() else e.data.contiguous() for _, _, e in group]
        pending_scale_inv = [e.scale_inv for _, _, e in group]
    scaler = opt.grad_scaler
    data, scale_inv, amax, n_big = ops.grad_cast(
        grads, [s[0] for s in states], opt.grad_dtype, pending_data=pending_data,
        pending_scale_inv=pending_scale_inv, margin=0, count_big=scaler is not None,
    )  # fmt: skip
    if scaler is not None:  # one report for the group: the scaler sums amax flags and counts (integers: exact)
        scaler.record_gradient_cast(amax, n_big, sum(map(torch.Tensor.numel, grads)), opt.grad_dtype, owner=opt,
                                    source_dtype=grads[0].dtype)  # fmt: skip
    entries = opt._pending
    for p, d, s, (_, buffers) in zip(params, data, scale_inv.unbind(), states, strict=True):
        entries[p] = FP8Grad(d, s, buffers[2])
