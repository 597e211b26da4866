"""FP8 gradient communication for the model as the strategy wrapped it (DDP, FSDP1, FSDP2).

The numerics live in :mod:`lightning_fp8.distributed`; this module only recognises the wrapper and calls the
matching entry point, so that ``Trainer(precision="fp8-lm", strategy="ddp")`` communicates in FP8 without any
user code.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_fp8.convert import fp8_modules
from lightning_fp8.recipe import FP8Recipe


def all_gather_state(state: Any) -> list[Any]:
    """Every rank's ``state`` (a state dict), in rank order, on every rank.

    Serialized with ``torch.save`` and sent as bytes: ``all_gather_object``'s own pickling cannot rebuild FP8
    tensors (it goes through torch's legacy storage loader).
    """
    buffer = io.BytesIO()
    torch.save(state, buffer)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, buffer.getvalue())
    return [torch.load(io.BytesIO(data), map_location="cpu", weights_only=True) for data in gathered]


def is_fsdp1_root(model: Any) -> bool:
    """Whether ``model`` is a root ``FullyShardedDataParallel`` (FSDP1) module."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(model, FullyShardedDataParallel) and FullyShardedDataParallel.fsdp_modules(model, True) != []


def fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` (FSDP2) was applied to."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def check_converted_before_sharding(module: nn.Module) -> None:
    """Raise unless a ``fully_shard`` (FSDP2) model already has FP8 layers.

    FSDP2 keeps references to the module objects it sharded, so swapping a sharded ``nn.Linear`` for an FP8
    layer afterwards would detach it from FSDP; the conversion has to happen in ``configure_model`` before
    ``fully_shard``. Layers the user left as ``nn.Linear`` on purpose stay so.
    """
    if not fp8_modules(module):
        raise ValueError(
            "precision='fp8-lm' with fully_shard (ModelParallelStrategy) needs the FP8 layers created before "
            "sharding, and this model has none: call `lightning_fp8.convert_to_fp8(self, recipe)` at the start of "
            "configure_model(), before fully_shard"
        )


def fp8_weights(model: nn.Module) -> list[nn.Parameter]:
    """The FP8 layers' weights: their gradients travel in FP8 (as in FP8-LM); norms, biases and embeddings keep
    their dtype on the wire, like they keep higher-precision optimizer states."""
    return [m.weight for m in fp8_modules(model).values()]


def comm_state(state_cls: type, model: nn.Module, grad_scaler: Any, recipe: FP8Recipe) -> Any:
    """The FP8CommState for ``model``: the recipe's gradient format, mu's scaler, the FP8 weights."""
    return state_cls(
        getattr(model, "process_group", None),
        fp8_dtype=recipe.backward_dtype,
        grad_scaler=grad_scaler,
        fp8_params=fp8_weights(model),
    )


def install_comm_hooks(model: nn.Module, grad_scaler: Any, recipe: FP8Recipe) -> tuple[str | None, Any]:
    """Install the FP8 gradient communication for ``model``'s wrapper.

    DDP: :func:`lightning_fp8.distributed.fp8_allreduce_hook`. FSDP1 and FSDP2: the distributed package's
    reduce-scatter hooks. A single-device model needs nothing.

    Returns:
        ``(kind, state)``: ``"ddp"``, ``"fsdp1"`` or ``"fsdp2"`` and the hooks' ``FP8CommState``, or
        ``(None, None)`` when the model is not wrapped for data parallelism.
    """
    if isinstance(model, DistributedDataParallel):
        from lightning_fp8.distributed import FP8CommState, fp8_allreduce_hook

        state = comm_state(FP8CommState, model, grad_scaler, recipe)
        model.register_comm_hook(state, fp8_allreduce_hook)
        return "ddp", state
    if is_fsdp1_root(model):
        from lightning_fp8.distributed import FP8CommState, enable_fp8_fsdp1, fp8_reduce_scatter_hook

        if getattr(model, "_comm_hook", None) is fp8_reduce_scatter_hook:  # a fit's wrapper, reused by a later stage
            return "fsdp1", model._comm_hook_state
        return "fsdp1", enable_fp8_fsdp1(model, comm_state(FP8CommState, model, grad_scaler, recipe))
    if fsdp2_modules(model):
        from lightning_fp8.distributed import FP8CommState, enable_fp8_fsdp2

        return "fsdp2", enable_fp8_fsdp2(model, comm_state(FP8CommState, model, grad_scaler, recipe))
    return None, None
