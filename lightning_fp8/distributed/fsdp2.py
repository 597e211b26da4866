"""FSDP2 (``fully_shard``): FP8 gradient reduce-scatter and FP8 weight all-gather through FSDP2's comm hooks.

::

    from lightning_fp8.distributed import enable_fp8_fsdp2

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = enable_fp8_fsdp2(model)      # before the first forward

- **Gradients**: :class:`FP8ReduceScatter` replaces each FSDP module's reduce-scatter
  (``FSDPModule.set_custom_reduce_scatter``): one MAX all-reduce of the per-parameter amaxes, the FP8 bytes of
  every shard to its owner by an all-to-all, and an fp32 sum there (:func:`~.comm.reduce_scatter_fp8`). FSDP
  itself divides by the world size (``set_force_sum_reduction_for_comms``).
- **Weights**: :class:`FP8WeightAllGather` replaces the all-gather (``set_custom_all_gather``). The weight of
  every :class:`~lightning_fp8.FP8Linear` travels as E4M3 bytes with a whole-tensor scale from its global amax
  (one MAX all-reduce for all weights of the module, so every rank already holds the scale of every rank's
  bytes: no scale travels); other parameters (biases, norms, embeddings) travel in their own dtype in the
  same collective. Each rank decodes the gathered bytes into the unsharded weight, whose values then lie on the FP8
  grid of that scale: the forward's own weight cast (FP8Linear, current scaling) reproduces the same FP8 values
  without any further communication.

Both hooks work on the module's flat buffers and need each parameter's place in them; they read it from
FSDP2's parameter group (``FSDPParam.padded_sharded_param_size``). Where that does not match the buffer, the
all-gather falls back to FSDP's default, with a warning. So does the reduce-scatter where FSDP leaves out the
gradients of parameters that got none in the backward (an unused submodule; unless
``set_reduce_scatter_unused_params(True)``, which sends zeros for them): with ``fp8_params`` naming some of the
module's parameters it reduces all its gradients in their own dtype (those outside ``fp8_params`` must not go
through FP8), else through FP8 with one scale per block.

The two collectives live in :mod:`~lightning_fp8.distributed.fsdp2_comms`; this module checks a model and installs
them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_fp8.distributed.comm_state import FP8CommState, check_state
from lightning_fp8.distributed.comm_state_checks import empty_fp8_params_message, refuse_layer_swaps
from lightning_fp8.distributed.fsdp2_comms import FP8ReduceScatter, FP8WeightAllGather
from lightning_fp8.linear import FP8Linear
from lightning_fp8.optim import master
from lightning_fp8.recipe import check_flag
from lightning_fp8.warnings import warn_once

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup


def _param_groups(module: nn.Module) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.12: at most one group
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def fp8_linear_weights(model: nn.Module) -> dict[int, int]:
    """``{id(weight): margin}`` of every :class:`~lightning_fp8.FP8Linear` weight in ``model``."""
    return {id(m.weight): int(m.fp8_scaling["weight"].margin) for m in model.modules() if isinstance(m, FP8Linear)}


def _check_module(model: object, where: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where} expects the model (an nn.Module, after fully_shard), got {type(model).__name__}")


def mark_fp8_weights(model: nn.Module) -> None:
    """Mark the weights of ``model``'s FP8Linear layers as FP8 weights (:data:`master.MARKER`): ``fully_shard`` put new
    (DTensor) Parameters in their place, without the mark, and an FP8AdamW created without it gives them fp32 states
    (O1's 16 bytes per parameter instead of O2's 6). Call it before creating the optimizer.

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``.
    """
    _check_module(model, "mark_fp8_weights")
    for module in model.modules():
        if isinstance(module, FP8Linear):
            setattr(module.weight, master.MARKER, True)


def enable_fp8_fsdp2(
    model: nn.Module,
    state: FP8CommState | None = None,
    *,
    reduce_scatter: bool = True,
    weight_all_gather: bool = True,
) -> FP8CommState:
    """Turn on FP8 gradient reduce-scatter and FP8 weight all-gather for every FSDP2 module of ``model``.

    Call after ``fully_shard`` has been applied (to ``model`` and any submodules) and before the first forward
    and before creating :class:`~lightning_fp8.FP8AdamW`: ``fully_shard`` replaces every parameter with a sharded
    one, and this marks the new FP8Linear weights again, so that ``FP8AdamW(model.parameters())`` gives them their
    low-precision states without ``fp8_params``. For the same reason, take ``FP8CommState(fp8_params=...)`` from
    the sharded model.

    Every rank agrees on ``state.check_step()``: with HSDP (a 2-D replicate x shard mesh) the step's flag is also
    reduced over the replicas (one value per module and step); with tensor parallelism (parameters that are DTensors
    over a data x tensor parallel mesh) ``check_step()`` reduces it over that whole mesh (one value per step), so
    every rank of the mesh must call it. Where the shard group has one rank (one process, or HSDP with a shard size
    of 1), FSDP runs no reduce-scatter; the gradients are checked in FSDP's all-reduce hook instead
    (``set_all_reduce_hook``: do not set another one on these modules).

    Calling it again on the same model replaces the collectives (as Lightning's plugin does for each stage): from then
    on only the state of the last call sees the gradients, and an earlier state's ``check_step()`` stays True.

    Args:
        model: a model whose modules were wrapped by ``torch.distributed.fsdp.fully_shard``.
        state: the communication state (default: a new :class:`FP8CommState`). Its ``process_group`` is not
            used here: FSDP passes its own.
        reduce_scatter: reduce-scatter the gradients through FP8. False: in their own dtype, still by
            :class:`FP8ReduceScatter`, which checks them for non-finite values (one MAX all-reduce of one value per
            FSDP module), so that ``state.check_step()`` and the state's grad scaler still see a NaN or inf gradient.
        weight_all_gather: replace the parameter all-gather (FP8Linear weights in E4M3).

    Returns:
        The state: per step, read ``state.check_step()`` or let its grad scaler decide.

    Raises:
        TypeError: if ``model`` is not an ``nn.Module`` or none of its modules was wrapped by ``fully_shard``,
            ``state`` is not an FP8CommState, or ``reduce_scatter`` or ``weight_all_gather`` is not a bool.
        ValueError: if ``state.fp8_params`` holds none of ``model``'s parameters (e.g. taken before ``fully_shard``),
            or if ``state.grad_scaler`` has ``nonfinite_fallback="bf16"``, which cannot swap the layers of a sharded
            model.
        RuntimeError: if this torch's FSDP2 has no custom-collective hooks (torch < 2.8).
    """
    from torch.distributed.fsdp import FSDPModule

    _check_module(model, "enable_fp8_fsdp2")
    # A truthy string such as "no" would otherwise switch a collective to FP8.
    check_flag("enable_fp8_fsdp2", "reduce_scatter", reduce_scatter)
    check_flag("enable_fp8_fsdp2", "weight_all_gather", weight_all_gather)
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not fsdp_modules:
        raise TypeError(
            f"enable_fp8_fsdp2: no module of {type(model).__name__} was wrapped by fully_shard; call "
            "fully_shard(...) first (for FullyShardedDataParallel, use enable_fp8_fsdp1)"
        )
    if not hasattr(fsdp_modules[0], "set_custom_reduce_scatter"):
        raise RuntimeError(
            f"enable_fp8_fsdp2 needs FSDPModule.set_custom_reduce_scatter / set_custom_all_gather (torch >= 2.8); "
            f"this is torch {torch.__version__}"
        )
    state = state if state is not None else FP8CommState()
    check_state(state, "enable_fp8_fsdp2")
    _check_state(model, state)
    mark_fp8_weights(model)
    weights = fp8_linear_weights(model)
    wider: list[DeviceMesh] = []  # meshes of parameters spread beyond FSDP's groups (tensor parallel)
    for module in fsdp_modules:
        groups = _param_groups(module)
        if not groups:
            continue
        if len(groups) > 1:
            raise ValueError(
                f"enable_fp8_fsdp2: {type(module).__name__} has {len(groups)} FSDP parameter groups (a per-parameter "
                "mesh); FSDP's custom collectives need one group per module"
            )
        # Installed also without FP8 gradients: FSDP's own reduce-scatter would leave state.check_step() blind to
        # non-finite gradients (True on a step whose gradients are NaN on every rank).
        _install_reduce_scatter(module, groups[0], state, fp8=reduce_scatter)
        wider += _mesh_beyond_fsdp(groups[0])
        if weight_all_gather and any(id(p.sharded_param) in weights for p in groups[0].fsdp_params):
            # Kernels picked per gather (on the shard's device), not here: a model sharded on the meta device took the
            # references on the GPU it was materialized on (fused=None), or raised (fused=True).
            module.set_custom_all_gather(FP8WeightAllGather(groups[0], weights, fused=state.fused))
    # Over the widest mesh, or (a state used before on a tensor-parallel model) back to the hooks' groups alone
    state._agree_over_mesh(max(wider, key=lambda mesh: mesh.size()) if wider else None)
    return state


def _mesh_beyond_fsdp(param_group: FSDPParamGroup) -> list[DeviceMesh]:
    """``[mesh]``: the device mesh of the group's parameters where it holds more ranks than FSDP's own (the data
    parallel x tensor parallel mesh of FSDP2 + TP), else ``[]``. FSDP's collectives, and so the non-finite flag
    riding on them, reach only the ranks of FSDP's mesh; the tensor-parallel peers hold other pieces of the same
    gradients and must take the same decision."""
    fsdp_size = param_group.mesh_info.mesh.size()
    for fsdp_param in param_group.fsdp_params:
        mesh = getattr(fsdp_param.sharded_param, "device_mesh", None)  # a DTensor over FSDP's mesh, or FSDP + TP's
        if mesh is not None and mesh.size() > fsdp_size:
            return [mesh]
    return []


def _check_state(model: nn.Module, state: FP8CommState) -> None:
    # Both checked before anything is changed.
    if state.leaves_out_fp8_weights(any(isinstance(m, FP8Linear) for m in model.modules())):
        warn_once(empty_fp8_params_message("enable_fp8_fsdp2"))
    if not state.names_fp8_params(model.parameters()):
        raise ValueError(
            f"enable_fp8_fsdp2: none of the {len(state._fp8_param_ids)} tensors in FP8CommState(fp8_params=...) is a "
            f"parameter of {type(model).__name__}; fully_shard replaces every parameter by a sharded one, so build "
            "the state after fully_shard: FP8CommState(fp8_params=[m.weight for m in model.modules() if "
            "isinstance(m, FP8Linear)])"
        )
    refuse_layer_swaps(state, "enable_fp8_fsdp2", "FSDP2 keeps references to the modules it shards")


def _install_reduce_scatter(module: nn.Module, param_group, state: FP8CommState, fp8: bool) -> None:
    mesh_info = param_group.mesh_info
    if getattr(mesh_info, "shard_mesh_size", 1) == 1:
        # FSDP skips the reduce-scatter of a one-rank shard group, so the comm below would never see a gradient.
        # Its all-reduce hook sees the result instead, the same on every replica (after HSDP's all-reduce, if any):
        # a local check agrees everywhere.
        module.set_all_reduce_hook(state.record_reduced)
    replicate_group = getattr(mesh_info, "replicate_process_group", None)
    module.set_custom_reduce_scatter(FP8ReduceScatter(state, param_group, replicate_group, fp8=fp8))
    if hasattr(module, "set_force_sum_reduction_for_comms"):
        module.set_force_sum_reduction_for_comms(True)
