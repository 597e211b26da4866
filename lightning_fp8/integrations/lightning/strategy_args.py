"""What ``FP8FSDPStrategy(...)`` (``strategy="fsdp_fp8"``) refuses when it is built: sharding strategies and device
meshes whose groups are not the FP8 gradient communication's, and flat parameters (``use_orig_params=False``), under
which FP8AdamW cannot tell the FP8 weights apart. Also what the Trainer refuses of Lightning's DDPStrategy under the
FP8 precision: a ``ddp_comm_hook`` of the user's beside the FP8 gradient communication."""

from __future__ import annotations

from typing import Any

from lightning_fp8.recipe import check_flag
from lightning_fp8.warnings import warn_once

STRATEGY_NAME = "fsdp_fp8"

_HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def check_sharding_strategy(value: Any) -> None:
    """Raise for a sharding strategy ``strategy="fsdp_fp8"`` cannot train with: None or another type (TypeError), an
    unknown name (Lightning looks a string up in ShardingStrategy and failed with a bare KeyError 'BOGUS') and the
    hybrid ones (ValueError)."""
    from torch.distributed.fsdp import ShardingStrategy

    if value is None:
        raise TypeError(
            f"strategy='{STRATEGY_NAME}': sharding_strategy=None: give 'FULL_SHARD' (the default), 'SHARD_GRAD_OP' "
            "or 'NO_SHARD', or leave it out"
        )
    if not isinstance(value, (str, ShardingStrategy)):
        raise TypeError(
            f"strategy='{STRATEGY_NAME}': sharding_strategy must be a name or a "
            f"torch.distributed.fsdp.ShardingStrategy, got {value!r} ({type(value).__name__})"
        )
    name = value.upper() if isinstance(value, str) else getattr(value, "name", None)
    if isinstance(value, str) and name not in ShardingStrategy.__members__:
        choices = ", ".join(repr(name) for name in ShardingStrategy.__members__ if name not in _HYBRID)
        raise ValueError(f"strategy='{STRATEGY_NAME}': sharding_strategy={value!r} is not one of {choices}")
    if name in _HYBRID:
        raise ValueError(
            f"strategy='{STRATEGY_NAME}' shards over all processes: use sharding_strategy 'FULL_SHARD', "
            f"'SHARD_GRAD_OP' or 'NO_SHARD', got {name}. Hybrid sharding's groups are not those of the FP8 gradient "
            "communication (FSDP takes no communication hook under it) nor of the FP8 optimizer states' checkpoints; "
            "on CPUs torch even falls back to NO_SHARD within each process, training every rank apart"
        )


def check_use_orig_params(value: Any) -> None:
    """Raise TypeError for a non-bool; warn for False: FP8AdamW then sees FSDP's flat parameters, cannot tell the FP8
    weights inside them, and gives every parameter fp32 states (an O2 recipe trains with O1's optimizer, silently)."""
    if not check_flag("FP8FSDPStrategy", "use_orig_params", value):
        warn_once(
            f"strategy='{STRATEGY_NAME}' with use_orig_params=False: FP8AdamW sees FSDP's flat parameters and cannot "
            "tell the FP8 weights inside them, so every parameter gets fp32 optimizer states (an O2 recipe's fp16 "
            "masters and FP8/fp16 moments are not used). Leave use_orig_params=True (the default) for them"
        )


def check_device_mesh(mesh: Any) -> Any:
    """``mesh`` as FSDP gets it (a list as the tuple Lightning builds a DeviceMesh from, which it did not convert), or
    raise: TypeError for anything but a tuple or list of ints or a DeviceMesh, ValueError for a mesh with more than
    one process along a dimension after the first. Without hybrid sharding FSDP1 takes the mesh's first dimension as
    its process group (``device_mesh.get_group(mesh_dim=0)``), so under ``(1, N)`` every process sharded with itself
    alone and trained apart, and under ``(R, S)`` the S groups of R did, each without a word (the FP8 hook reduces over
    the same groups)."""
    from torch.distributed.device_mesh import DeviceMesh

    if mesh is None:
        return None
    if isinstance(mesh, (tuple, list)):
        if not mesh or not all(isinstance(size, int) and not isinstance(size, bool) and size >= 1 for size in mesh):
            raise TypeError(
                f"strategy='{STRATEGY_NAME}': device_mesh={mesh!r} must be a tuple of process counts >= 1 (the "
                "number of processes,) or a torch.distributed DeviceMesh"
            )
        shape = tuple(mesh)
    elif isinstance(mesh, DeviceMesh):
        shape = tuple(mesh.shape)
    else:
        raise TypeError(
            f"strategy='{STRATEGY_NAME}': device_mesh={mesh!r} ({type(mesh).__name__}) must be a tuple, e.g. "
            "(number of processes,), or a torch.distributed DeviceMesh"
        )
    if any(size != 1 for size in shape[1:]):
        raise ValueError(
            f"strategy='{STRATEGY_NAME}' shards over all processes, but device_mesh={shape} has processes along a "
            "dimension after the first: FSDP (without hybrid sharding, which it does not support, see "
            "sharding_strategy) shards over the first dimension only, and the processes along the others would train "
            "apart. Give a 1-D mesh (number of processes,) or drop device_mesh"
        )
    return shape if isinstance(mesh, list) else mesh
