"""Warnings emitted once per process, on rank zero only (STYLE.md habit 10)."""

from __future__ import annotations

import os
import warnings

_seen: set[str] = set()


def _rank() -> int:
    # The first of the launchers' variables that holds an integer: a warning must not raise where a variable holds
    # something else (an empty RANK exported by a shell script).
    for var in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        value = os.environ.get(var, "").strip()
        if value.lstrip("-").isdigit():
            return int(value)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:
        pass
    return 0


def warn_once(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn with ``message`` the first time it is seen in this process, on rank zero only."""
    if message in _seen:
        return
    _seen.add(message)
    if _rank() == 0:
        warnings.warn(message, category, stacklevel=3)
