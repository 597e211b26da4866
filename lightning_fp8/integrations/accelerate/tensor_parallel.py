"""Accelerate's tensor parallelism (``ParallelismConfig(tp_size=N)``) for FP8 models.

Accelerate shards a model for tensor parallelism only through ``transformers`` (``from_pretrained(tp_plan=...)``)
and, in its own ``prepare``, only checks that the model was sharded (``model.tp_size``). For any model, the
Accelerator applies lightning_fp8's Megatron-style plan here instead, on Accelerate's ``"tp"`` mesh: FP8 weights
sharded as DTensors, FP8 activation communication with sequence parallelism, amaxes synchronized across ranks.
"""

from __future__ import annotations

import importlib.util
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_fp8.distributed.tensor_parallel import apply_fp8_tensor_parallel
from lightning_fp8.integrations.accelerate.config import FP8LaunchConfig
from lightning_fp8.integrations.accelerate.parallel import broadcast_parameters


def is_sharded(model: nn.Module) -> bool:
    """Whether some parameter of ``model`` is already a DTensor (the script parallelized it)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def prepare(
    model: nn.Module, tp_mesh: DeviceMesh, config: FP8LaunchConfig
) -> tuple[dict[int, nn.Parameter], str | None]:
    """Shard ``model`` with the launch's plan, unless the script did; ``(shard_model's mapping, a report line)``.

    Either way the model learns to load full-weight checkpoints (:func:`load_full_state_dict`) and gets the
    ``tp_size`` attribute Accelerate checks.

    Raises:
        ValueError: the plan is ``none`` and the model is not sharded.
    """
    # Checkpoints hold full weights: loading one cuts each rank's shards out of it.
    model.register_load_state_dict_pre_hook(load_full_state_dict)
    if is_sharded(model):
        model.tp_size = getattr(model, "tp_size", None) or tp_mesh.size()
        return {}, None
    if config.tensor_parallel is None:
        raise ValueError(
            "tensor parallelism is on (tp_size > 1) and the tensor-parallel plan is 'none', but the model passed "
            "to prepare() is not sharded: shard it in the script (lightning_fp8.distributed.tensor_parallel."
            "apply_fp8_tensor_parallel on accelerator.torch_device_mesh['tp']) or choose a plan ('gpt', 'llama')"
        )
    plan, sequence_parallel = config.tensor_parallel
    mapping = shard_model(model, tp_mesh, plan, sequence_parallel)
    return mapping, report(model, plan, sequence_parallel)


def shard_model(model: nn.Module, tp_mesh: DeviceMesh, plan: str, sequence_parallel: bool) -> dict[int, nn.Parameter]:
    """Shard ``model`` over ``tp_mesh`` with ``plan``; return ``{id(old parameter): new parameter}``.

    The ranks' weights and buffers are made equal first (rank 0's, as DDP would): the sharded weights are cut from
    rank 0's values anyway, and the layers outside the blocks (embeddings, head, final norm) run replicated.
    """
    if torch.distributed.get_world_size() > 1:
        broadcast_parameters(model, buffers=True)
    before = dict(model.named_parameters())
    apply_fp8_tensor_parallel(model, tp_mesh, plan=plan, sequence_parallel=sequence_parallel)
    after = dict(model.named_parameters())
    model.tp_size = tp_mesh.size()  # what Accelerate checks (transformers models record it there too)
    return {id(param): after[name] for name, param in before.items() if after[name] is not param}


def remap_optimizer(optimizer: torch.optim.Optimizer, mapping: dict[int, nn.Parameter]) -> None:
    """Point ``optimizer``'s param groups at the sharded parameters (it was built on the unsharded ones)."""
    if mapping and optimizer.state:
        raise ValueError(
            f"{type(optimizer).__name__} already holds states: pass a fresh optimizer to accelerator.prepare under "
            "tensor parallelism (its parameters are replaced by their shards)"
        )
    for group in optimizer.param_groups:
        group["params"] = [mapping.get(id(p), p) for p in group["params"]]


def check_launch(parallelism_config: Any) -> None:
    """Before Accelerate builds its state: tensor parallelism asked for without ``transformers`` installed.

    Accelerate 1.15's ``ParallelismConfig`` with ``tp_size > 1`` requires ``transformers`` (a version check), even
    for models that lightning_fp8 shards itself; without it Accelerate fails with a bare ``PackageNotFoundError``.
    """
    if parallelism_config is None and os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() == "true":
        tp_size = int(os.environ.get("PARALLELISM_CONFIG_TP_SIZE", "1"))
    else:
        tp_size = getattr(parallelism_config, "tp_size", 1) or 1
    if tp_size > 1 and importlib.util.find_spec("transformers") is None:
        raise ValueError(
            f"tensor parallelism (tp_size={tp_size}) under Accelerate needs `transformers` installed (Accelerate's "
            "ParallelismConfig checks for it): pip install 'lightning-fp8[accelerate-tp]'"
        )


def check_fsdp2_combination(fsdp2: bool) -> None:
    """Tensor parallelism with FSDP2 in Accelerate goes through ``transformers``; say so before it fails there."""
    if not fsdp2:
        return
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError(
            "tensor parallelism combined with FSDP2 (dp_shard_size > 1) under Accelerate needs `transformers` "
            "(Accelerate replicates the non-sharded parameters with it): `pip install transformers`, or use pure "
            "tensor parallelism (tp_size = number of processes), or Lightning's ModelParallelStrategy for data x "
            "tensor parallelism"
        ) from None


def report(model: nn.Module, plan: str, sequence_parallel: bool) -> str:
    """A line for ``accelerator.fp8_report["tensor_parallel"]``."""
    from torch.distributed.tensor import DTensor

    sharded = sum(isinstance(p, DTensor) for p in model.parameters())
    comm = "sequence parallel (FP8 activation all-gather / reduce-scatter)" if sequence_parallel else "no SP"
    return f"plan {plan!r} over tp_size={model.tp_size}: {sharded} DTensor parameters, {comm}"


# ----------------------------------------------------------------------------------------------- checkpoints
# Accelerate 1.15 saves a model with safetensors and an optimizer with torch.save, both on the main process only,
# which cannot hold the other ranks' shards (and safetensors rejects DTensors). Under tensor parallelism:
# - the model file holds the full (gathered) weights, an ordinary checkpoint that also loads into an unsharded
#   model; loading it back cuts each rank's shard out of it (load_full_state_dict);
# - the model's and FP8AdamW's sharded states are saved with torch.distributed.checkpoint in DCP_DIR, every rank
#   writing its shards (the per-shard scales of the FP8 states included): resuming continues bit-identically;
# - the optimizer file holds a marker saying so (sharded_optimizer_placeholder).
DCP_DIR = "tensor_parallel"
_PLACEHOLDER_KEY = "lightning_fp8_tensor_parallel"


def full_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with every DTensor gathered into a plain tensor (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    # An OrderedDict, as model.state_dict() returns: Accelerate removes tied duplicates only from those.
    full = OrderedDict((k, v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state_dict.items())
    if hasattr(state_dict, "_metadata"):
        full._metadata = state_dict._metadata
    return full


def load_full_state_dict(model: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook of a sharded model: full tensors for DTensor parameters become local shards."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in model.named_parameters():
        value = state_dict.get(prefix + name)
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            if tuple(value.shape) != tuple(param.shape):
                continue  # load_state_dict reports the size mismatch
            # Every rank read the same full tensor: cut this rank's shard, without communication.
            state_dict[prefix + name] = distribute_tensor(
                value.to(param.device, param.dtype), param.device_mesh, param.placements, src_data_rank=None
            )


def sharded_optimizer_placeholder(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What Accelerate's optimizer file holds under tensor parallelism (the states are in :data:`DCP_DIR`)."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
    return {_PLACEHOLDER_KEY: f"the optimizer states are in <checkpoint>/lightning_fp8/{DCP_DIR}", "groups": groups}


def is_placeholder(state_dict: dict[str, Any]) -> bool:
    return _PLACEHOLDER_KEY in state_dict


def save_sharded(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Save the sharded model and optimizer with torch.distributed.checkpoint (every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded_state(model, optimizer), checkpoint_id=str(Path(directory) / DCP_DIR))


def sharded_path(directory: str | Path) -> Path:
    """Where :func:`save_sharded` wrote into ``directory``.

    Raises:
        FileNotFoundError: when the checkpoint has no sharded states.
    """
    path = Path(directory) / DCP_DIR
    if not path.is_dir():
        raise FileNotFoundError(
            f"accelerator.load_state: {path} is missing: this checkpoint was not saved by a tensor-parallel run of "
            "lightning_fp8's Accelerator, so the optimizer's sharded states cannot be restored. Load the model "
            "weights alone with model.load_state_dict (the model file holds full weights)"
        )
    return path


def load_sharded(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load what :func:`save_sharded` wrote into the prepared model and optimizer.

    Not all or nothing: torch.distributed.checkpoint reads into a template whose tensors may be the model's own, and
    fails (e.g. on a truncated shard file) part-way.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = sharded_path(directory)
    state = _sharded_state(model, optimizer)  # the template: shapes, placements, this rank's shards
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is None:
        model.load_state_dict(state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if optimizer is None:
        return {"model": model.state_dict()}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}
