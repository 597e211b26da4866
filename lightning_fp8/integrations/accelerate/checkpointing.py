"""``accelerator.save_state`` / ``load_state`` of the FP8 Accelerator: the FP8 state files and tensor parallelism.

:class:`CheckpointMixin` is a base class of :class:`~lightning_fp8.accelerate.Accelerator` (it uses the
accelerator's FP8 attributes); the per-rank FP8 state file is :mod:`.checkpoint`, the checks of Accelerate's own files
:mod:`.load_checks`, the tensor-parallel checkpoint layout :mod:`.tensor_parallel`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import DistributedType
from torch import nn
from typing_extensions import override

from lightning_fp8.health import scaler_fallbacks
from lightning_fp8.integrations.accelerate import checkpoint, load_checks, tensor_parallel
from lightning_fp8.recipe import check_flag
from lightning_fp8.warnings import warn_once


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
        """Accelerate's ``save_state``, and lightning_fp8's state (``lightning_fp8/rank<R>.pt``), written last.

        A save that fails part-way (a full disk while Accelerate writes the optimizer file) must not leave a folder
        that loads as a mix of this save's files and an earlier save's: the folder is marked incomplete before
        Accelerate writes its first file (:func:`.checkpoint.begin_save`, on every rank: here for a folder the script
        names, and in the save pre-hook for the one automatic checkpoint naming picks, which Accelerate creates itself),
        the FP8 state files are written once every rank wrote Accelerate's files, and the mark goes once every rank
        wrote its FP8 state. ``load_state`` refuses a marked folder.

        Raises:
            RuntimeError: when another process failed to write its part (its own error says why). The folder stays
                marked incomplete.
        """
        if self.fp8_lm_config is None:
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        if self._fp8_tp_enabled:
            # Under tensor parallelism the model file holds the full weights; safetensors' loader inspects the
            # storage of every parameter of the model, which a DTensor has none of: torch.save them instead.
            safe_serialization = False
        if output_dir is not None and not self.project_configuration.automatic_checkpoint_naming:
            # Before Accelerate saves FSDP2's model and optimizer folders, which it does before its pre-hooks run.
            checkpoint.begin_save(output_dir, self.process_index)
        self._fp8_saving = None
        location = self._fp8_on_every_process(
            "writing Accelerate's files", lambda: super(CheckpointMixin, self).save_state(
                output_dir, safe_serialization=safe_serialization, **kwargs
            )
        )  # fmt: skip
        directory, self._fp8_saving = self._fp8_saving, None
        state = checkpoint.build_state(
            self.fp8_lm_config.recipe,
            self._fp8_models,
            self.num_processes,
            self.fp8_grad_scaler,
            self.fp8_health,
            self._fp8_steps,
            self.fp8_scale_jumps,
            self._fp8_comm_state_list(),
        )
        self._fp8_on_every_process(
            "writing its FP8 state", lambda: checkpoint.save(directory, self.process_index, state)
        )
        if self._fp8_tp_enabled:  # a collective: complete on rank 0 once every rank's shards are written
            tensor_parallel.save_sharded(checkpoint.rank_file(directory, 0).parent, *self._fp8_sharded_checkpoint())
        if self.is_main_process:
            checkpoint.end_save(directory)
        self.wait_for_everyone()  # no process goes on (to load it, say) before the checkpoint is complete
        return location

    def _fp8_comm_state_list(self) -> list[Any | None]:
        """Each prepared model's FP8CommState (its DDP hook's or FSDP2 collectives'), ``None`` for one without."""
        return [self._fp8_comm_states.get(index) for index in range(len(self._fp8_models))]

    def _fp8_on_every_process(self, action: str, write: Callable[[], Any]) -> Any:
        """``write()``, raising on every process when it raised on any (a barrier: a process does not wait forever
        for one that failed)."""
        try:
            result = write()
        except Exception:
            self._fp8_any_process_failed(True)
            raise
        if self._fp8_any_process_failed(False):
            raise RuntimeError(
                f"accelerator.save_state: another process failed while {action} (its error says why). The checkpoint "
                "is incomplete and load_state refuses it: fix the cause and save again, or load an earlier checkpoint"
            )
        return result

    def _fp8_sharded_checkpoint(self) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        if len(self._fp8_models) != 1:
            raise ValueError(
                f"accelerator.save_state/load_state under tensor parallelism: {len(self._fp8_models)} models were "
                "prepared; lightning_fp8 checkpoints one tensor-parallel model (with its optimizer)"
            )
        return self._fp8_models[0], self._fp8_optimizer.optimizer if self._fp8_optimizer is not None else None

    def _fp8_save_hook(self, models: list[nn.Module], weights: list[Any], output_dir: str) -> None:
        """Accelerate's save pre-hook: the folder it saves into (automatic naming picks it), marked incomplete before
        Accelerate writes its files there; :meth:`save_state` writes the FP8 state after them."""
        checkpoint.begin_save(output_dir, self.process_index)
        self._fp8_saving = output_dir

    @override
    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None, **load_model_func_kwargs: Any
    ) -> None:
        """Accelerate's ``load_state``, and lightning_fp8's state: the FP8 scaling states, mu and its counters, the
        health history, the layers the ``"bf16"`` fallback had put back to ``nn.Linear``. All or nothing.

        Before anything changes, every process reads and checks the checkpoint: that its save completed (see
        :meth:`save_state`), lightning_fp8's file (``lightning_fp8/rank<R>.pt``) against the prepared models, mu and
        health monitor, and Accelerate's model, optimizer (FP8AdamW's states), scheduler, custom object and random
        states files (:mod:`.load_checks`); the processes then agree that each found its part good. Only then are the
        fallen-back layers put back to ``nn.Linear``, does Accelerate load its files, and is lightning_fp8's state
        restored.

        What the checks cannot see, and which fails part-way (the run is then part-loaded: load a good checkpoint or
        start again): a weight a layer's own ``load_state_dict`` refuses, a value a scheduler's or custom object's
        ``load_state_dict`` refuses, a data sampler's file, FSDP2's model and optimizer folders and the
        tensor-parallel sharded checkpoint (torch.distributed.checkpoint reads them straight in).

        Raises:
            FileNotFoundError, ValueError, KeyError: for a folder whose save did not complete, a missing, unreadable
                or corrupt file, or one written for other models or optimizers; the message names the file and says
                what to do. Nothing was loaded.
            RuntimeError: when another process found its part bad (its own error says why), or for another number
                of custom checkpoints than registered objects. Nothing was loaded.
            TypeError: for a ``strict`` that is not a bool. Nothing was loaded.
        """
        directory = self._fp8_input_dir(input_dir) if self.fp8_lm_config is not None else None
        if directory is None:  # FP8-LM off, or Accelerate's own error (no such folder)
            plain = self._fp8_input_dir(input_dir) if self.fp8_lm_config is None else None
            if plain is not None:
                load_checks.check_plain_run_files(plain, self._optimizers, load_kwargs)
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        # Checked here, not by the FP8 state's own load: its error would name the checkpoint file, as if it were bad.
        strict = check_flag("accelerator.load_state", "strict", load_model_func_kwargs.get("strict", True))
        try:
            state = self._fp8_checked_state(directory, load_kwargs, strict)
        except Exception:
            self._fp8_any_process_failed(True)
            raise
        if self._fp8_any_process_failed(False):
            raise RuntimeError(
                f"accelerator.load_state({directory!r}): another process found its part of the checkpoint bad (its "
                "error says which file and why). Nothing was loaded on any process"
            )
        # Every part is known good: from here on the run changes.
        optimizers = [self._fp8_optimizer.optimizer] if self._fp8_optimizer is not None else []
        if state is not None:
            checkpoint.put_back(state, self._fp8_models, optimizers)
        if self._fp8_tp_enabled:
            tensor_parallel.load_sharded(checkpoint.rank_file(directory, 0).parent, *self._fp8_sharded_checkpoint())
        super().load_state(directory, load_kwargs, **load_model_func_kwargs)
        if state is None:
            return
        checkpoint.restore(
            state, self.fp8_lm_config.recipe, self._fp8_models, self.fp8_grad_scaler, self.fp8_health, strict=strict,
            scale_jumps=self.fp8_scale_jumps, comm_states=self._fp8_comm_state_list(),
        )  # fmt: skip
        self._fp8_steps = int(state["optimizer_steps"])
        self._fp8_skipped_grad_norm = None  # a step of the run before the load
        if self.fp8_grad_scaler is not None:  # fallbacks before the checkpoint were reported then
            self._fp8_fallback_seen = scaler_fallbacks(self.fp8_grad_scaler.history, -1)[1]
        elif state.get("grad_scaler") is not None:
            # The scaler (mu) is made when the optimizer is prepared: a later prepare would start mu afresh, and
            # Accelerate skips the optimizer file of an optimizer not prepared yet, both without a word.
            warn_once(
                f"accelerator.load_state({directory!r}): the checkpoint holds the gradient scale mu, but no optimizer "
                "was prepared yet, so mu was not loaded (nor is a saved optimizer state: Accelerate loads only the "
                "optimizers prepared before load_state). To resume training, prepare the optimizer before load_state "
                "(model, optimizer = accelerator.prepare(model, optimizer)); to evaluate only, ignore this"
            )

    def _fp8_input_dir(self, input_dir: str | None) -> str | None:
        """The folder Accelerate's ``load_state`` reads (Accelerate 1.15's rules: ``input_dir``, or the last of the
        automatically named checkpoints), or ``None`` where it raises."""
        if input_dir is not None:
            input_dir = os.path.expanduser(input_dir)
            return input_dir if os.path.isdir(input_dir) else None
        if not self.project_configuration.automatic_checkpoint_naming:
            return None
        parent = os.path.join(self.project_dir, "checkpoints")
        folders = sorted(
            (os.path.join(parent, name) for name in os.listdir(parent)),
            key=lambda folder: int(re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)[0]),
        )
        return folders[-1]

    def _fp8_checked_state(self, directory: str, load_kwargs: dict[str, Any] | None, strict: bool) -> Any:
        """This process's FP8 state (``None`` when the checkpoint has none), once every part of the checkpoint this
        process loads was checked against the prepared objects; raises for a bad part, changing nothing."""
        state = checkpoint.load(directory, self.process_index, self.num_processes)
        if state is not None:
            recipe, source = self.fp8_lm_config.recipe, str(checkpoint.state_file(directory, self.process_index))
            checkpoint.check(
                state, recipe, self._fp8_models, self.fp8_grad_scaler, self.fp8_health, strict=strict, source=source,
                scale_jumps=self.fp8_scale_jumps, comm_states=self._fp8_comm_state_list(),
            )  # fmt: skip
        if self._fp8_tp_enabled:
            tensor_parallel.sharded_path(checkpoint.rank_file(directory, 0).parent)
        accelerate_files = self.distributed_type != DistributedType.FSDP  # FSDP's are DCP folders, not checked
        load_checks.check_files(
            directory,
            self._models if accelerate_files else None,
            self._optimizers if accelerate_files else None,
            self._schedulers,
            len(self._custom_objects),
            strict=strict,
            load_kwargs=load_kwargs,
        )
        saved_processes = state["world_size"] if state is not None else None
        load_checks.check_random_states(directory, self.process_index, saved_processes)
        return state

    def _fp8_any_process_failed(self, failed: bool) -> bool:
        """Whether this or another process failed its checks (every process calls it once per load_state)."""
        if self.num_processes == 1 or not torch.distributed.is_initialized():
            return failed
        flag = torch.tensor([int(failed)], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())
