"""Warnings emitted once per process, on rank zero only (STYLE.md habit 10)."""

from __future__ import annotations

import os
import warnings

_seen: set[str] = set()


def _rank() -> int:
    for var in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
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
