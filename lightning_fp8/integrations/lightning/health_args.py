"""Argument checks of :class:`~lightning_fp8.integrations.lightning.health_callback.TrainingHealthMonitor`: what its
``tokens_fn`` returns, and the file its ``plot_path`` names (without importing matplotlib unless a suffix must be
checked)."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable
from typing import Any

import torch

from lightning_fp8.integrations.lightning.callbacks import MonitorArgumentTypeError


def _checked_tokens(tokens: Any, tokens_fn: Callable[[Any], Any]) -> Any:
    """What ``tokens_fn`` returned for a batch, if it is a count (a number, or a one-element tensor, left on its
    device); else raise naming ``tokens_fn``."""
    name = getattr(tokens_fn, "__qualname__", None) or repr(tokens_fn)
    if isinstance(tokens, torch.Tensor):
        is_count = tokens.numel() == 1 and tokens.dtype != torch.bool and not tokens.is_complex()
    else:
        is_count = isinstance(tokens, numbers.Real) and not isinstance(tokens, bool)
    if not is_count:
        raise TypeError(
            f"TrainingHealthMonitor(tokens_fn={name}) returned {repr(tokens)[:100]} ({type(tokens).__name__}) for a "
            "batch: it must return the number of tokens in the batch (an int, or a one-element tensor) or None"
        )
    if not isinstance(tokens, torch.Tensor) and not (math.isfinite(tokens) and tokens >= 0):
        raise ValueError(
            f"TrainingHealthMonitor(tokens_fn={name}) returned {tokens!r} tokens for a batch, expected a finite "
            "number >= 0"
        )
    return tokens


# Separators a plot_path naming a folder may end with.
_SEPARATORS = tuple(sep for sep in (os.sep, os.altsep) if sep)


def _names_folder(path: str) -> bool:
    return path.endswith(_SEPARATORS) or os.path.isdir(path)


def plot_file_for(path: str | os.PathLike[str]) -> str:
    """The file a ``TrainingHealthMonitor(plot_path=...)`` plot is written to: ``health.png`` inside ``path`` when it
    names a folder (an existing one, or a path ending in a separator); ``path`` with ``.png`` appended when its name
    has no suffix (as matplotlib's ``savefig`` does, which would write ``health.png`` for ``health``); else ``path``."""
    path = os.fspath(path)
    if _names_folder(path):
        return os.path.join(path, "health.png")
    return path if os.path.splitext(path)[1] else path + ".png"


def _checked_plot_path(plot_path: Any) -> None:
    """Raise for a ``plot_path`` that is not a path, or whose suffix names a format matplotlib cannot write (found at
    construction, not at the end of fit)."""
    if plot_path is None:
        return
    path = os.fspath(plot_path) if isinstance(plot_path, (str, os.PathLike)) else None
    if not isinstance(path, str):
        raise MonitorArgumentTypeError(
            f"TrainingHealthMonitor(plot_path={plot_path!r}) must be a path (a str or os.PathLike) or None, got "
            f"{type(plot_path).__name__}"
        )
    suffix = os.path.splitext(path)[1][1:].lower()
    if not suffix or _names_folder(path):
        return
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:  # no plot will be written: on_fit_end warns
        return
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if suffix not in formats:
        raise ValueError(
            f"TrainingHealthMonitor(plot_path={path!r}): matplotlib cannot write a '.{suffix}' file; end the name with "
            f"one of {formats} (or with no suffix, for a PNG)"
        )
