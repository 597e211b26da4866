"""What ``FP8FSDPStrategy(...)`` (``strategy="fsdp_fp8"``) refuses when it is built: sharding strategies and device
meshes whose groups are not the FP8 gradient communication's, and flat parameters (``use_orig_params=False``), under
which FP8AdamW cannot tell the FP8 weights apart."""

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


def check_device_mesh(mesh: Any) -> None:
    """Raise ValueError for a ``device_mesh`` that replicates over groups, ``(R, S)`` with R > 1 (a tuple or a 2-D
    DeviceMesh): Lightning passes it to FSDP without making the strategy hybrid, and FSDP then shards over one mesh
    dimension only, each group training apart (the FP8 hook reduces over the same group, so nothing says so)."""
    if mesh is None:
        return
    shape = tuple(mesh) if isinstance(mesh, (tuple, list)) else tuple(getattr(mesh, "shape", ()))
    if len(shape) > 1 and any(size != 1 for size in shape[:-1]):
        raise ValueError(
            f"strategy='{STRATEGY_NAME}' shards over all processes, but device_mesh={shape} is (replication size, "
            "sharding size) for hybrid sharding, which it does not support (see sharding_strategy): drop device_mesh "
            "(or give (1, number of processes))"
        )
