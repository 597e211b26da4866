"""The samples, tokens and wall time of the training forwards between two optimizer steps: the throughput the FP8
Accelerator's health monitor records (``health/samples_per_sec``, ``health/tokens_per_sec``), as Lightning's
``TrainingHealthMonitor`` records it from its batches.

Accelerate hands the accelerator no batch, so the batches are read where they meet the model: a forward pre-hook on
each model ``prepare`` returns (the object the script calls, outside a compiled region) counts the samples (the
first dimension of the first tensor of its arguments) and tokens (the first integer tensor of rank >= 2: token ids)
of each forward in training mode with autograd on, of the first model that runs one (the student of a distillation,
whose teacher runs in evaluation mode; a GAN's first network). That model's forwards in evaluation mode or under
``torch.no_grad`` are not training: the clock stops at the first of them and restarts with the next training
forward. A window runs from the previous step (the first: from the first training forward) to this one; this
process's own work (per rank). A model compiled in place (``model.compile()``) runs its hooks inside the compiled
region, where nothing is counted: no throughput is recorded for it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_fp8.monitoring.measures import count_batch


class StepWork:
    """Counts the work of the training forwards of one prepared model; :meth:`take` at each optimizer step."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        self._reset()

    def _reset(self) -> None:
        self._counted: int | None = None  # id of the model whose forwards count: the first to train
        self._samples: int | None = 0  # None once a forward of the window had no tensor to count
        self._tokens: int | None = 0  # None once a forward of the window had no token ids
        self._forwards = 0
        self._t0: float | None = None  # the window's start; None before the first training forward
        self._paused_at: float | None = None

    def attach(self, model: nn.Module) -> None:
        """Watch the forwards of ``model`` (the first model to run a training forward is the one counted)."""
        self._handles.append(model.register_forward_pre_hook(self._on_forward, with_kwargs=True))

    def detach(self) -> None:
        """Stop counting (``free_memory``: a new prepare starts a new training)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._reset()

    def _on_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():  # a model compiled in place: its hooks are traced, nothing to count
            return
        training = module.training and torch.is_grad_enabled()
        if self._counted is None and training:
            self._counted = id(module)
        if self._counted != id(module):  # another model (a teacher, a GAN's second network), or none trains yet
            return
        now = time.perf_counter()
        if not training:
            if self._paused_at is None:
                self._paused_at = now
            return
        if self._t0 is None:
            self._t0 = now
        elif self._paused_at is not None:
            self._t0 += now - self._paused_at
        self._paused_at = None
        samples, tokens = count_batch((args, kwargs))
        self._samples = None if samples is None or self._samples is None else self._samples + samples
        self._tokens = None if tokens is None or self._tokens is None else self._tokens + tokens
        self._forwards += 1

    def take(self) -> tuple[int | None, int | None, float | None]:
        """``(samples, tokens, seconds)`` since the last call (``None`` where nothing was counted), and a new
        window from now."""
        now = time.perf_counter()
        end = self._paused_at if self._paused_at is not None else now  # the clock stopped at an evaluation forward
        taken = (self._samples, self._tokens, end - self._t0) if self._forwards and self._t0 is not None else None
        self._samples, self._tokens, self._forwards, self._paused_at = 0, 0, 0, None
        if self._t0 is not None:
            self._t0 = now
        return taken or (None, None, None)
