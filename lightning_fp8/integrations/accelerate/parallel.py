"""FP8 communication for the models Accelerate wraps: the DDP gradient hook and the FSDP2 FP8 collectives.

Thin calls into :mod:`lightning_fp8.distributed`; each returns what it set up, for the accelerator's report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_fp8.convert import fp8_modules
from lightning_fp8.integrations.clipping import with_held_norms
from lightning_fp8.monitoring.measures import global_norm
from lightning_fp8.optim import fp8_grads
from lightning_fp8.recipe import FP8Recipe

if TYPE_CHECKING:
    from lightning_fp8.distributed import FP8CommState


def install_ddp_hook(
    model: nn.parallel.DistributedDataParallel, recipe: FP8Recipe, grad_scaler: Any
) -> tuple[str, FP8CommState]:
    """Register the FP8 all-reduce comm hook on a DDP model; returns the report's line and the hook's state (which
    ``save_state`` keeps).

    The gradients of the FP8 layers' weights travel in the recipe's gradient format (as in FP8-LM, whose FP8
    gradients are those of its FP8 weights); the other gradients (embeddings, norms, biases) in their own dtype.
    Every FP8 cast and non-finite check reports to ``grad_scaler`` (mu).
    """
    from lightning_fp8.distributed import FP8CommState, fp8_allreduce_hook

    fp8_weights = [layer.weight for layer in fp8_modules(model.module).values()]
    state = FP8CommState(
        model.process_group, fp8_dtype=recipe.backward_dtype, grad_scaler=grad_scaler, fp8_params=fp8_weights
    )
    model.register_comm_hook(state, fp8_allreduce_hook)
    return f"fp8_allreduce_hook ({len(fp8_weights)} FP8 weight gradients in {recipe.backward_dtype})", state


def install_fsdp2_collectives(model: nn.Module, recipe: FP8Recipe, grad_scaler: Any) -> tuple[str, FP8CommState]:
    """FP8 gradient reduce-scatter and FP8 weight all-gather on every ``fully_shard`` module of ``model``; returns the
    report's line and the collectives' state (which ``save_state`` keeps)."""
    from lightning_fp8.distributed import FP8CommState, enable_fp8_fsdp2

    fp8_weights = [layer.weight for layer in fp8_modules(model).values()]
    state = FP8CommState(None, fp8_dtype=recipe.backward_dtype, grad_scaler=grad_scaler, fp8_params=fp8_weights)
    enable_fp8_fsdp2(model, state)
    line = f"FSDP2 FP8 reduce-scatter ({recipe.backward_dtype}) and FP8 weight all-gather ({len(fp8_weights)} weights)"
    return line, state


def broadcast_parameters(model: nn.Module, src: int = 0, *, buffers: bool = False) -> None:
    """Copy rank ``src``'s parameter values to every rank (what DDP does when it wraps a model).

    ``buffers=True`` copies the model's buffers too (DDP does that itself when it wraps; tensor parallelism has no
    wrapper to do it), except the FP8 layers' scaling states: each rank's own, and fresh before the first step.
    """
    from lightning_fp8.scaling import ScalingState

    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param.data, src)
        if not buffers:
            return
        for module in model.modules():
            if not isinstance(module, ScalingState):
                for buffer in module.buffers(recurse=False):
                    data = buffer if buffer.is_contiguous() else buffer.contiguous()
                    dist.broadcast(data, src)
                    if data is not buffer:
                        buffer.copy_(data)


def grad_norm_fp32(parameters: list[torch.Tensor], grad_scale: float) -> torch.Tensor | None:
    """The L2 norm of ``parameters``' gradients as if they did not carry ``grad_scale``, in fp32, without clipping:
    what :func:`~lightning_fp8.integrations.clipping.clip_grad_norm_fp32` (or Accelerate's clipping of DTensor
    gradients, which reduce over their mesh) returns. The FP8 gradients an FP8AdamW holds count through their scales.
    ``None`` without any gradient."""
    held = fp8_grads.held_fp8_grads(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads and not held:
        return None
    others = global_norm(grads, device=grads[0].device) if grads else None
    return with_held_norms(others, fp8_grads.fp8_grad_norms(held, 2.0)) / grad_scale
