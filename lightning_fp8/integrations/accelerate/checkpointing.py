"""``accelerator.save_state`` / ``load_state`` of the FP8 Accelerator: the FP8 state files and tensor parallelism.

:class:`CheckpointMixin` is a base class of :class:`~lightning_fp8.accelerate.Accelerator` (it uses the
accelerator's FP8 attributes); the per-rank FP8 state file is :mod:`.checkpoint`, the tensor-parallel checkpoint
layout :mod:`.tensor_parallel`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_fp8.health import scaler_fallbacks
from lightning_fp8.integrations.accelerate import tensor_parallel
from lightning_fp8.integrations.accelerate.checkpoint import build_state, load, rank_file, restore, save


class CheckpointMixin:
    """The checkpoint side of the FP8 Accelerator (see the module docstring); not usable on its own."""

    @override
    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """Accelerate's, with tensor-parallel (DTensor) weights gathered: the full model, as ``save_model`` and
        ``save_state`` write it (a collective under tensor parallelism: call it on every rank)."""
        state_dict = super().get_state_dict(model, unwrap=unwrap)
        if self.fp8_lm_config is not None and self._fp8_tp_enabled:
            state_dict = tensor_parallel.full_state_dict(state_dict)
        return state_dict

    @override
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        if self.fp8_lm_config is not None and self._fp8_tp_enabled:
            # Under tensor parallelism the model file holds the full weights; safetensors' loader inspects the
            # storage of every parameter of the model, which a DTensor has none of: torch.save them instead.
            safe_serialization = False
        return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)

    def _fp8_sharded_checkpoint(self) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        if len(self._fp8_models) != 1:
            raise ValueError(
                f"accelerator.save_state/load_state under tensor parallelism: {len(self._fp8_models)} models were "
                "prepared; lightning_fp8 checkpoints one tensor-parallel model (with its optimizer)"
            )
        return self._fp8_models[0], self._fp8_optimizer.optimizer if self._fp8_optimizer is not None else None

    def _fp8_save_hook(self, models: list[nn.Module], weights: list[Any], output_dir: str) -> None:
        state = build_state(
            self.fp8_lm_config.recipe,
            self._fp8_models,
            self.num_processes,
            self.fp8_grad_scaler,
            self.fp8_health,
            self._fp8_steps,
        )
        save(output_dir, self.process_index, state)
        if self._fp8_tp_enabled:
            tensor_parallel.save_sharded(rank_file(output_dir, 0).parent, *self._fp8_sharded_checkpoint())

    def _fp8_load_hook(self, models: list[nn.Module], input_dir: str) -> None:
        if self._fp8_tp_enabled:
            tensor_parallel.load_sharded(rank_file(input_dir, 0).parent, *self._fp8_sharded_checkpoint())
        state = load(input_dir, self.process_index, self.num_processes)
        if state is None:
            return
        recipe = self.fp8_lm_config.recipe
        restore(state, recipe, self._fp8_models, self.fp8_grad_scaler, self.fp8_health)
        self._fp8_steps = int(state["optimizer_steps"])
        if self.fp8_grad_scaler is not None:  # fallbacks before the checkpoint were reported then
            self._fp8_fallback_seen = scaler_fallbacks(self.fp8_grad_scaler.history, -1)[1]
