"""The script's AdamW/Adam replaced by :class:`~lightning_fp8.FP8AdamW` in the FP8 Accelerator's ``prepare``.

:class:`OptimizerSwapMixin` is a base class of :class:`~lightning_fp8.accelerate.Accelerator` (it uses the
accelerator's FP8 attributes: the prepared models, the scaler, the swaps made so far). ``_fp8_swap`` builds the
FP8AdamW (hyper-parameters and param groups kept, ``fp8_grads=False`` so that clipping sees ``p.grad``), adopts an
FP8AdamW the script built itself, or keeps another optimizer with a warning; under FSDP2 the swap waits for the
sharded parameters (``_fp8_swap_after_sharding``); the LR schedulers built on the script's optimizer are pointed at
the FP8AdamW through ``_fp8_swapped``. Apart from the accelerator's ``prepare*``, which decide when to swap.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_fp8.convert import fp8_modules
from lightning_fp8.integrations.accelerate import parallel, refusals
from lightning_fp8.integrations.accelerate.optimizer import to_fp8_optimizer, warn_if_level_differs
from lightning_fp8.optim import FP8AdamW
from lightning_fp8.optim.swap import is_replaceable as is_swappable
from lightning_fp8.optim.swap import rebind_scheduler
from lightning_fp8.stats import unwrap_compiled
from lightning_fp8.warnings import warn_once


class OptimizerSwapMixin:
    """The optimizer swap of :class:`~lightning_fp8.accelerate.Accelerator` (see the module docstring)."""

    def _fp8_swap(self, optimizer: torch.optim.Optimizer, **fp8_kwargs: Any) -> torch.optim.Optimizer:
        """``optimizer`` as FP8AdamW (AdamW/Adam), or unchanged (with a warning for other types)."""
        if any(new is optimizer for _, new in self._fp8_swaps):
            return optimizer
        refusals.check_model_prepared(optimizer, self._fp8_models)
        name = type(optimizer).__name__
        if is_swappable(optimizer):
            if any(isinstance(unwrap_compiled(m), nn.parallel.DistributedDataParallel) for m in self._models):
                raise ValueError(
                    f"accelerator.prepare_optimizer({name}) after the model was prepared: FP8AdamW takes over the FP8 "
                    "weights' storage, which must happen before DDP wraps the model. Pass the model and the optimizer "
                    "to the same accelerator.prepare(model, optimizer, ...) call"
                )
            self._fp8_sync_initial_weights()
            new = to_fp8_optimizer(
                optimizer,
                grad_scaler=self._fp8_scaler(),
                recipe=self.fp8_lm_config.recipe,
                # Gradients stay in p.grad until the step, where accelerator.clip_grad_norm_ and user code see them.
                fp8_grads=False,
                **fp8_kwargs,
            )
            self._fp8_swaps.append((optimizer, new))
        elif isinstance(optimizer, FP8AdamW):
            refusals.check_built_after_conversion(optimizer)
            new = optimizer
            refusals.check_scaler((new,), self.fp8_grad_scaler)
            warn_if_level_differs(new, self.fp8_lm_config.recipe)
            if new.grad_scaler is None:  # its gradient casts report to the accelerator's mu
                new.grad_scaler = self._fp8_scaler()
            elif self.fp8_grad_scaler is None:  # the user's FP8AdamW brought its own scaler: scale by that mu
                self.fp8_grad_scaler = new.grad_scaler  # (as FP8LMPrecision does); saved and loaded with the state
                self._fp8_give_scaler_the_model()
        else:
            new = optimizer
            warn_once(
                f"lightning_fp8: {name} is not AdamW/Adam, so it is kept: FP8 GEMMs and the gradient scale mu "
                "apply (its gradients are unscaled in place before each step); its states stay in full precision"
            )
        self.fp8_report["optimizer"] = f"{name} -> {type(new).__name__}" if new is not optimizer else name
        self._fp8_info(f"lightning_fp8: optimizer {self.fp8_report['optimizer']}")
        return new

    def _fp8_swap_after_sharding(self) -> None:
        # FSDP2: FP8AdamW is built on the sharded (DTensor) parameters; fully_shard made new parameter objects,
        # so the FP8 weights are named explicitly.
        prepared = self._fp8_optimizer
        if prepared is None or not is_swappable(prepared.optimizer):
            return
        old = prepared.optimizer
        fp8_weights = [layer.weight for model in self._fp8_models for layer in fp8_modules(model).values()]
        prepared.optimizer = self._fp8_swap(old, fp8_params=fp8_weights)
        prepared.take_over(old)
        for scheduler in self._schedulers:
            rebind_scheduler(getattr(scheduler, "scheduler", scheduler), self._fp8_swapped())

    def _fp8_sync_initial_weights(self) -> None:
        # FP8AdamW derives each FP8 weight's master scale from the weight itself. DDP would broadcast rank 0's
        # weights only later, so a rank initialized differently would keep a scale that does not match them.
        # Under FSDP2 the optimizer is built on the shards, after fully_shard; it keeps its masters apart.
        # Under tensor parallelism they were made equal before sharding (tensor_parallel.shard_model).
        distributed = self.num_processes > 1 and torch.distributed.is_initialized()
        if distributed and not self.is_fsdp2 and not self._fp8_tp_enabled:
            for model in self._fp8_models:
                parallel.broadcast_parameters(model)

    def _fp8_swapped(self) -> dict[int, torch.optim.Optimizer]:
        """``{id(the script's optimizer): the FP8AdamW that replaced it}``, as ``rebind_scheduler`` takes it."""
        return {id(old): new for old, new in self._fp8_swaps}
