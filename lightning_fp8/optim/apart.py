"""Masters kept apart from their parameters, and values written to those parameters between steps.

FP8AdamW keeps some masters apart from the parameter they update: a bf16 or fp16 parameter's fp32 master, and an FP8
weight's fp16 master after :meth:`~lightning_fp8.FP8AdamW.release_weights` or when the weight was frozen as the
optimizer was built. Each step writes the new value into the parameter as well. ``torch.optim.AdamW`` steps from the
parameter's current values, so a write between steps (``model.load_state_dict``, an in-place ``fill_`` or
``clamp_``, a rollback to a snapshot) is what its next step continues from; a master kept apart would continue from
its own values and overwrite the write.

So each step notes such a parameter's version counter and storage after writing it (:func:`mark`), and the next step
takes what was written since (:func:`take_writes`): where the parameter's values differ from the master's rounded to
the parameter's dtype, the master takes the parameter's; the other elements keep the master's precision, so putting
the same values back (an EMA swap for evaluation) changes nothing. DTensor (FSDP2) parameters are not tracked.

An in-place write through ``p.data`` (``p.data.clamp_(...)``) is not seen: ``.data`` is an alias with a version counter
of its own, in the same storage, so the mark does not change, and the next step overwrites the write. Comparing every
watched parameter with its master at every step would see it, exactly, but in torch ops that is a pass of its own
(round the master, compare, select: nearly the bytes of these parameters' step). The fused step kernel could do it
with one more read of the parameter (which the step writes from the master as stored, unscaled).
docs/concepts/optimizer.md documents the exception.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_fp8.optim import checkpoint, shards

Mark = tuple[int, int, torch.dtype]


def mark(p: torch.Tensor) -> Mark | None:
    """What changes when anything writes ``p`` in place (its version counter) or swaps its storage (``p.data = t``,
    also a cast of the module: ``model.float()``), and the dtype the step wrote it in; ``None`` for a DTensor (not
    tracked: a wrapper without storage of its own)."""
    return None if shards.is_dtensor(p) else (p._version, p.data_ptr(), p.dtype)


def take_writes(p: torch.Tensor, state: dict[str, Any], marked: Mark | None) -> None:
    """Put the values written to ``p`` since the step that ``marked`` it into its master kept apart, ``state["master"]``
    (plain, or scaled with ``master_scale``). Reads the values only when ``p`` was written (a host sync then).

    A cast of ``p`` since (``model.float()`` after bf16 training, ``model.half()``) writes the same values in another
    dtype: an element equal to the master rounded to the old dtype and then to the new one is unchanged (a cast to
    fp32 compared with the master rounded to fp32 took every bf16-rounded value for a write, and the master lost its
    precision); any other value in the new dtype was written."""
    if marked is None or marked == mark(p):
        return
    kept = checkpoint.dequantize(state, "master")
    value = p.detach().to(kept.device)
    before = marked[2]
    changed = (value != kept.to(value.dtype)) & (value != kept.to(before).to(value.dtype))
    if not bool(changed.any()):
        return
    merged = torch.where(changed, value.float(), kept)
    if "master_scale" in state:
        checkpoint.store(state, "master", merged, state["master"].dtype, merged.shape, merged.device)
    else:
        state["master"].copy_(merged)
