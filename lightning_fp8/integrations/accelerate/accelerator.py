"""``Accelerator``: ``accelerate.Accelerator`` with FP8-LM training, switched on by the launch.

A plain Accelerate script changes one line (``from lightning_fp8.accelerate import Accelerator``); the recipe
comes from the launch (``lightning-fp8 launch``, or ``LIGHTNING_FP8_RECIPE``, see :mod:`.config`). Then:

- ``prepare(model, ...)`` converts the model's linear layers to FP8 (:func:`~lightning_fp8.convert_to_fp8`),
  replaces ``AdamW``/``Adam`` by :class:`~lightning_fp8.FP8AdamW` (hyper-parameters and param groups kept; the LR
  schedulers built on the AdamW drive it, prepared or not, in any prepare order), installs the FP8 gradient
  all-reduce hook on DDP models and the FP8 all-gather / reduce-scatter on FSDP2 models; with Accelerate's tensor
  parallelism (``ParallelismConfig(tp_size=N)``) it shards the model with lightning_fp8's Megatron-style plan first
  (:mod:`.tensor_parallel`);
- ``backward`` multiplies the loss by the gradient scale mu (:class:`~lightning_fp8.FP8GradScaler`); the
  prepared optimizer's ``step`` skips the update on every rank when a gradient was non-finite, and Accelerate's
  scheduler wrapper then does not advance; ``accumulate`` works as in Accelerate;
- ``clip_grad_norm_`` clips and returns the norm of the *unscaled* gradients;
- ``save_state``/``load_state`` also save/restore the FP8 scaling state, mu and the health history; ``load_state``
  checks the whole checkpoint before it changes anything;
- ``log`` adds the FP8 and health statistics (:mod:`.metrics`) to what the script logs; ``log_fp8_stats`` logs
  them on their own.

The setups it refuses before anything is converted are in :mod:`.refusals`; backward, unscaling, clipping and the
step's health records in :mod:`.gradients`, the checkpoints in :mod:`.checkpointing`, the logged statistics in
:mod:`.metrics`, the optimizer's replacement by FP8AdamW in :mod:`.optimizer_swap`.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

import accelerate
import torch
from accelerate.utils import DDPCommunicationHookType
from torch import nn
from typing_extensions import override

from lightning_fp8.convert import takes_module_and_name
from lightning_fp8.health import HealthMonitor
from lightning_fp8.integrations.accelerate import conversion, parallel, refusals, tensor_parallel
from lightning_fp8.integrations.accelerate.checkpointing import CheckpointMixin
from lightning_fp8.integrations.accelerate.config import ENV_RECIPE, resolve_launch_config
from lightning_fp8.integrations.accelerate.gradients import GradientsMixin
from lightning_fp8.integrations.accelerate.metrics import LoggingMixin, new_scale_jumps
from lightning_fp8.integrations.accelerate.optimizer import FP8AcceleratedOptimizer
from lightning_fp8.integrations.accelerate.optimizer_swap import OptimizerSwapMixin
from lightning_fp8.integrations.accelerate.step_work import StepWork
from lightning_fp8.linear import FP8Linear
from lightning_fp8.monitoring.scale_jumps import ScaleJumps
from lightning_fp8.optim import FP8AdamW
from lightning_fp8.optim.swap import rebind_scheduler
from lightning_fp8.recipe import FP8Recipe, check_flag
from lightning_fp8.stats import unwrap_compiled
from lightning_fp8.warnings import warn_once

logger = logging.getLogger("lightning_fp8.accelerate")


def _same_device(a: torch.device, b: torch.device) -> bool:
    # Accelerate's CPU device is "cpu:0", a CPU tensor's "cpu".
    return a.type == b.type and (a.type == "cpu" or a.index == b.index)


def _accelerate_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``accelerate.Accelerator``'s arguments by name, however they were passed (positionally too); arguments it
    would refuse give none here, and its own error when it is built."""
    try:
        return inspect.signature(accelerate.Accelerator.__init__).bind_partial(None, *args, **kwargs).arguments
    except TypeError:
        return {}


class Accelerator(CheckpointMixin, LoggingMixin, GradientsMixin, OptimizerSwapMixin, accelerate.Accelerator):
    """``accelerate.Accelerator`` that trains with FP8-LM when the launch asks for it.

    All of Accelerate's arguments are accepted and mean the same. Without an FP8 recipe from the launch (or
    ``fp8_lm_recipe``), this is Accelerate's Accelerator, plus one warning saying FP8-LM is off.

    Args:
        fp8_lm_recipe: an :class:`~lightning_fp8.FP8Recipe` or recipe name overriding the launch's
            ``LIGHTNING_FP8_RECIPE`` (``"none"`` turns FP8-LM off); ``None``: the launch decides.
        fp8_module_filter: ``fn(module, fqn) -> bool``; only linear layers where it returns True become FP8
            (combined with the launch's ``LIGHTNING_FP8_EXCLUDE`` patterns).
        fp8_stats_in_log: add the FP8 and health statistics to every ``accelerator.log`` call.

    Raises:
        ValueError: for a bad recipe name in the launch, ``mixed_precision`` ``"fp16"``/``"fp8"`` (FP8-LM brings
            its own loss scale and FP8 path: use ``"bf16"`` or ``"no"``), a ``GradScalerKwargs`` handler (the fp16
            scaler's settings), or DeepSpeed, Megatron-LM, XLA or FSDP1.
    """

    def __init__(
        self,
        *args: Any,
        fp8_lm_recipe: FP8Recipe | str | None = None,
        fp8_module_filter: conversion.ModuleFilter | None = None,
        fp8_stats_in_log: bool = True,
        **kwargs: Any,
    ) -> None:
        # Validate the launch first: a bad recipe name should fail before any process group is created.
        if fp8_module_filter is not None and not (
            callable(fp8_module_filter) and takes_module_and_name(fp8_module_filter)
        ):
            raise TypeError(
                f"Accelerator(fp8_module_filter={fp8_module_filter!r}): must be a callable fn(module, fqn) -> bool "
                "(True converts the layer), or None"
            )
        check_flag("Accelerator", "fp8_stats_in_log", fp8_stats_in_log)
        self.fp8_lm_config = resolve_launch_config(fp8_lm_recipe)
        passed = _accelerate_arguments(args, kwargs)
        tensor_parallel.check_launch(passed.get("parallelism_config"))
        if self.fp8_lm_config is not None:  # before Accelerate sets up its process-wide state with it
            refusals.check_mixed_precision_argument(passed.get("mixed_precision"))
            refusals.check_kwargs_handlers(passed.get("kwargs_handlers"))
        super().__init__(*args, **kwargs)
        self._fp8_init_attributes(fp8_stats_in_log, fp8_module_filter)
        if self.fp8_lm_config is None:
            if fp8_lm_recipe is None and os.environ.get(ENV_RECIPE, "").strip() != "none":
                warn_once(
                    "lightning_fp8.accelerate.Accelerator: FP8-LM is off because the launch chose no recipe. Turn it "
                    f"on with `lightning-fp8 launch ...` or {ENV_RECIPE}=fp8-lm (set {ENV_RECIPE}=none to silence this)"
                )
            return
        refusals.check_supported(self.mixed_precision, self.distributed_type, self.is_fsdp2, self._fp8_tp_enabled)
        self.fp8_health, self.fp8_scale_jumps = HealthMonitor(), new_scale_jumps()
        # load_state is overridden instead (CheckpointMixin): Accelerate's load hooks run after FSDP's model and
        # optimizer were loaded, and before its other files are, while lightning_fp8's state must be checked first
        # and loaded last.
        self.register_save_state_pre_hook(self._fp8_save_hook)

    def _fp8_init_attributes(self, fp8_stats_in_log: bool, fp8_module_filter: conversion.ModuleFilter | None) -> None:
        """The FP8 side's attributes before any prepare: nothing converted, swapped, wrapped or stepped yet."""
        self.fp8_stats_in_log = fp8_stats_in_log
        self.fp8_grad_scaler: Any | None = None
        self.fp8_health: HealthMonitor | None = None
        self.fp8_scale_jumps: ScaleJumps | None = None  # fp8/alerts/* (FP8ScaleMonitor's)
        self.fp8_report: dict[str, Any] = self._fp8_initial_report()
        self._fp8_user_filter = fp8_module_filter
        self._fp8_models: list[nn.Module] = []
        self._fp8_conversions: list[dict[str, Any]] = []  # conversion.convert's report of each of _fp8_models
        self._fp8_optimizer: FP8AcceleratedOptimizer | None = None
        self._fp8_swaps: list[tuple[torch.optim.Optimizer, torch.optim.Optimizer]] = []  # (script's AdamW, FP8AdamW)
        self._fp8_wrapped: set[int] = set()
        self._fp8_wrap_lines: dict[str, dict[int, str]] = {}  # report key -> {model index: what the wrap installed}
        self._fp8_ddp_weights: set[int] = set()  # ids of the FP8 weights of the models prepare wrapped in DDP
        self._fp8_comm_states: dict[int, Any] = {}  # model index -> its DDP hook's or FSDP2 collectives' FP8CommState
        self._fp8_steps = 0
        self._fp8_saving: str | None = None  # the folder save_state is writing (CheckpointMixin)
        self._fp8_fallback_seen = -1  # the scaler step of the last fallback reported to fp8_health
        self._fp8_tp_mapping: dict[int, nn.Parameter] = {}  # unsharded parameter id -> its tensor-parallel shard
        self._fp8_loss: list[torch.Tensor] = []
        self._fp8_grad_norm: torch.Tensor | None = None
        self._fp8_skipped_grad_norm: tuple[int, float] | None = None  # (step, norm) of the last skipped step
        self._fp8_param_norm: torch.Tensor | None = None  # of the step's weights, before it (GradientsMixin)
        self._fp8_work = StepWork()  # samples, tokens and time of the training forwards (health throughput)
        self._fp8_clipping = False  # in Accelerate's clip_grad_norm_ (its unscale_gradients call is not the script's)

    @property
    def fp8_lm_enabled(self) -> bool:
        """Whether this accelerator trains with FP8-LM."""
        return self.fp8_lm_config is not None

    @property
    def fp8_lm_recipe(self) -> FP8Recipe | None:
        return self.fp8_lm_config.recipe if self.fp8_lm_config is not None else None

    def _fp8_initial_report(self) -> dict[str, Any]:
        """``fp8_report`` before any prepare: the recipe (FP8-LM on), or nothing."""
        return {"recipe": self.fp8_lm_config.recipe.to_dict()} if self.fp8_lm_config is not None else {}

    @property
    def _fp8_tp_enabled(self) -> bool:
        return bool(self.parallelism_config and self.parallelism_config.tp_enabled)

    # ------------------------------------------------------------------------------------------------ prepare
    @override
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        if self.fp8_lm_config is None:
            return super().prepare(*args, device_placement=device_placement)
        # Convert before Accelerate wraps (DDP) or shards (FSDP2) the model; FP8Linear shares nn.Linear's
        # parameters, so the optimizer built on them stays valid.
        if device_placement is not None and len(device_placement) != len(args):
            return super().prepare(*args, device_placement=device_placement)  # Accelerate's error for it
        refusals.check_fsdp_set_up(self.distributed_type, self.is_fsdp2, self.device)
        refusals.check_one_optimizer(args, self._fp8_prepared_optimizer())
        refusals.check_scaler(args, self.fp8_grad_scaler)
        self._fp8_check_before_optimizer([obj for obj in args if isinstance(obj, nn.Module)])
        placements = device_placement if device_placement is not None else [None] * len(args)
        args = tuple(
            self._fp8_convert(obj, placed) if isinstance(obj, nn.Module) else obj
            for obj, placed in zip(args, placements, strict=True)
        )
        if self._fp8_tp_enabled:  # the optimizers were built on the unsharded parameters
            for obj in args:
                if refusals.is_fresh_optimizer(obj):
                    tensor_parallel.remap_optimizer(obj, self._fp8_tp_mapping)
        if not self.is_fsdp2:
            # FP8AdamW (O2) takes over the FP8 weights' storage as its fp16 master: that has to happen before
            # DDP builds its gradient buckets. Under FSDP2 it happens after sharding (_fp8_swap_after_sharding).
            optimizers = [obj for obj in args if refusals.is_fresh_optimizer(obj)]
            refusals.check_not_after_ddp(optimizers, self._fp8_ddp_weights, self.fp8_lm_config.recipe.opt_level)
            args = tuple(self._fp8_swap(obj) if refusals.is_fresh_optimizer(obj) else obj for obj in args)
        result = super().prepare(*args, device_placement=device_placement)
        if self.is_fsdp2:
            self._fp8_swap_after_sharding()
        for obj in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(obj, nn.Module):
                self._fp8_after_wrap(obj)
        return result

    @override
    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        if self.fp8_lm_config is None:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        refusals.check_fsdp_set_up(self.distributed_type, self.is_fsdp2, self.device)
        self._fp8_check_before_optimizer([model])
        model = self._fp8_convert(model, device_placement)
        prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if not evaluation_mode:
            self._fp8_after_wrap(prepared)
        return prepared

    @override
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        if self.fp8_lm_config is None or getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        refusals.check_model_prepared(optimizer, self._fp8_models)
        refusals.check_one_optimizer((optimizer,), self._fp8_prepared_optimizer())
        refusals.check_scaler((optimizer,), self.fp8_grad_scaler)
        if not self.is_fsdp2:
            if self._fp8_tp_enabled:  # built on the unsharded parameters of a model prepared on its own before
                tensor_parallel.remap_optimizer(optimizer, self._fp8_tp_mapping)
            optimizer = self._fp8_swap(optimizer)  # a no-op when prepare() swapped it already
        elif isinstance(optimizer, FP8AdamW):
            raise ValueError(
                "under FSDP2, pass a torch.optim.AdamW to accelerator.prepare: the Accelerator builds FP8AdamW after "
                "fully_shard, on the sharded parameters (an FP8AdamW built before sharding holds the unsharded ones)"
            )
        device_placement = self.device_placement if device_placement is None else device_placement
        prepared = FP8AcceleratedOptimizer(
            optimizer, device_placement, self._fp8_scaler(), self._fp8_on_step, before_step=self._fp8_before_step
        )
        prepared.sharded_states = self._fp8_tp_enabled
        for old, new in self._fp8_swaps:
            if new is optimizer:  # schedulers built on the old one, prepared or not, drive the FP8AdamW
                prepared.take_over(old)
        self._optimizers.append(prepared)
        self._fp8_optimizer = prepared
        return prepared

    @override
    def prepare_scheduler(self, scheduler: Any) -> Any:
        # Prepared after the optimizer, a scheduler is pointed at the FP8AdamW. Prepared before it (or never), it keeps
        # the script's AdamW, whose param groups are then the FP8AdamW's (FP8AcceleratedOptimizer.take_over).
        if self._fp8_swaps:
            rebind_scheduler(scheduler, self._fp8_swapped())
        return super().prepare_scheduler(scheduler)

    def _fp8_convert(self, model: nn.Module, device_placement: bool | None = None) -> nn.Module:
        """Once per model: on the device, converted to FP8, and sharded under tensor parallelism."""
        if any(model is m for m in self._fp8_models):
            return model
        # On the device before FP8AdamW adopts the FP8 weights' storage (DDP), the ranks' weights are broadcast,
        # or the model is sharded (tensor parallelism): Accelerate would move it later, in prepare_model.
        placed = self.device_placement if device_placement is None else device_placement
        # Only when needed: Module.to replaces DTensor parameters (of a model the script sharded) by new objects.
        elsewhere = any(not _same_device(p.device, self.device) for p in model.parameters())
        if placed and elsewhere and not self.is_fsdp2 and not self.verify_device_map(model):
            model = model.to(self.device)
        model, report = conversion.convert(model, self.fp8_lm_config, self._fp8_user_filter, self.device)
        self._fp8_models.append(model)
        self._fp8_conversions.append(report)
        self.fp8_report.update(conversion.combined_report(self._fp8_conversions))
        if self.fp8_grad_scaler is not None:  # a model prepared after the optimizer (one it does not train)
            self._fp8_give_scaler_the_model()
        self._fp8_info(
            f"lightning_fp8: converted {report['converted_layers']} linear layer(s) of {type(model).__name__} to FP8 "
            f"(recipe {self.fp8_lm_config.recipe.to_dict()}); kept {len(report['high_precision_linears'])} in high "
            f"precision {report['high_precision_linears']}"
        )
        if self._fp8_tp_enabled:
            mapping, line = tensor_parallel.prepare(model, self.torch_device_mesh["tp"], self.fp8_lm_config)
            self._fp8_tp_mapping.update(mapping)
            if line is not None:
                self.fp8_report["tensor_parallel"] = line
                self._fp8_info(f"lightning_fp8: tensor parallelism: {line}")
        return model

    def _fp8_scaler(self) -> Any:
        if self.fp8_grad_scaler is None:  # created at the first prepare that needs it, after the model's conversion
            from lightning_fp8.grad_scaler import FP8GradScaler

            self.fp8_grad_scaler = FP8GradScaler()
            self._fp8_give_scaler_the_model()
        return self.fp8_grad_scaler

    def _fp8_give_scaler_the_model(self) -> None:
        """Make the prepared FP8 models (:meth:`_fp8_scaler_model`) the scaler's ``model``
        (:meth:`FP8GradScaler._take_model`: where it has none or one an integration gave it)."""
        if self._fp8_models:
            self.fp8_grad_scaler._take_model(self._fp8_scaler_model())

    def _fp8_scaler_model(self) -> nn.Module:
        """The scaler's ``model``: the FP8 model, or with several, a container holding them as ``model<i>`` (the
        logged statistics' names). Every FP8 layer that casts a mu-scaled gradient must be in it: the scaler rescales
        their ``grad_output`` scaling states when mu changes, else their next casts saturate (mu doubled) or lose
        precision (mu halved). Its ``"bf16"`` fallback finds the layers to put back there too."""
        if len(self._fp8_models) == 1:  # the layer names the fallback reports are the model's own
            return self._fp8_models[0]
        return nn.ModuleDict({f"model{i}": model for i, model in enumerate(self._fp8_models)})

    def _fp8_prepared_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer inside the prepared FP8AcceleratedOptimizer, if one was prepared."""
        return self._fp8_optimizer.optimizer if self._fp8_optimizer is not None else None

    def _fp8_check_before_optimizer(self, models: list[nn.Module]) -> None:
        # The optimizers of earlier prepares: FP8AdamW (O2) ones must not train the linear weights of ``models``.
        optimizers = [new for _, new in self._fp8_swaps]
        if self._fp8_optimizer is not None:
            optimizers.append(self._fp8_prepared_optimizer())
        refusals.check_before_optimizer(
            models,
            optimizers=optimizers,
            prepared_models=self._fp8_models,
            config=self.fp8_lm_config,
            user_filter=self._fp8_user_filter,
        )

    def _fp8_after_wrap(self, model: nn.Module) -> None:
        if id(model) in self._fp8_wrapped:
            return
        self._fp8_wrapped.add(id(model))
        self._fp8_work.attach(model)  # the object the script calls: its hooks run outside a compiled region
        ddp = unwrap_compiled(model)  # Accelerate's dynamo_backend compiles last: OptimizedModule(DDP)
        if isinstance(ddp, nn.parallel.DistributedDataParallel):
            self._fp8_ddp_weights |= {id(m.weight) for m in ddp.module.modules() if isinstance(m, FP8Linear)}
            comm_hook = getattr(self.ddp_handler, "comm_hook", DDPCommunicationHookType.NO)
            # What DDP runs decides, not the handler's value: Accelerate registers a hook only for a
            # DDPCommunicationHookType member other than NO (a string such as "bf16" registers none, silently).
            if getattr(ddp, "_comm_hooks", None):
                warn_once(
                    f"lightning_fp8: DistributedDataParallelKwargs(comm_hook={comm_hook}) is in use, so gradients are "
                    "not communicated in FP8; drop that comm_hook to get the FP8 all-reduce"
                )
                line = str(comm_hook)
            else:
                if str(getattr(comm_hook, "value", comm_hook)).lower() not in ("no", "none"):
                    warn_once(
                        f"lightning_fp8: DistributedDataParallelKwargs(comm_hook={comm_hook!r}) registered no hook "
                        "(Accelerate takes a DDPCommunicationHookType member), so gradients are communicated in FP8"
                    )
                line, state = parallel.install_ddp_hook(ddp, self.fp8_lm_config.recipe, self._fp8_scaler())
                self._fp8_comm_states[self._fp8_model_index(ddp.module)] = state
            self._fp8_info(f"lightning_fp8: DDP gradient communication: {line}")
            self._fp8_report_wrap("ddp_comm_hook", ddp.module, line)
        elif self.is_fsdp2:
            line, state = parallel.install_fsdp2_collectives(model, self.fp8_lm_config.recipe, self._fp8_scaler())
            self._fp8_comm_states[self._fp8_model_index(unwrap_compiled(model))] = state
            self._fp8_info(f"lightning_fp8: {line}")
            self._fp8_report_wrap("fsdp2_collectives", unwrap_compiled(model), line)

    def _fp8_model_index(self, model: nn.Module) -> int:
        """The index of ``model`` (unwrapped) in ``_fp8_models`` (prepare order, as the report's layer names)."""
        found = (i for i, m in enumerate(self._fp8_models) if model in (m, unwrap_compiled(m)))
        return next(found, len(self._fp8_models))

    def _fp8_report_wrap(self, key: str, model: nn.Module, line: str) -> None:
        """``fp8_report[key]``: ``line`` with one prepared model; with several, each model's line named
        ``model<i>`` (prepare order, as the report's layer names), so that one model's wrap does not hide another's."""
        index = self._fp8_model_index(model)
        lines = self._fp8_wrap_lines.setdefault(key, {})
        lines[index] = line
        several = len(self._fp8_models) > 1 or len(lines) > 1
        self.fp8_report[key] = "; ".join(f"model{i}: {lines[i]}" for i in sorted(lines)) if several else line

    def _fp8_info(self, message: str) -> None:
        if self.is_main_process:
            logger.info(message)

    @override
    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        # A weight's storage that FP8AdamW (O2) holds as a scaled fp16 master: refused (LocalSGD at O2).
        refusals.check_not_masters(tensor, self._fp8_prepared_optimizer(), "accelerator.reduce")
        return super().reduce(tensor, reduction, scale)

    @override
    def free_memory(self, *objects: Any) -> Any:
        # Training is over: the FP8 weights get their own storage back (unscaled, the model's dtype), as a later
        # optimizer, Accelerator or precision would otherwise train their fp16 masters times a scale.
        optimizer = self._fp8_prepared_optimizer()
        if isinstance(optimizer, FP8AdamW):
            optimizer.release_weights()
        result = super().free_memory(*objects)
        # Accelerate forgets its prepared objects; so does the FP8 side (a new prepare starts a new training).
        self.fp8_grad_scaler, self._fp8_optimizer = None, None
        self._fp8_models, self._fp8_swaps, self._fp8_wrapped, self._fp8_tp_mapping = [], [], set(), {}
        self._fp8_ddp_weights, self._fp8_wrap_lines, self._fp8_comm_states = set(), {}, {}
        self._fp8_conversions = []
        self.fp8_report = self._fp8_initial_report()  # what the next prepare does (no optimizer swap, comm hook, ...)
        self._fp8_loss, self._fp8_grad_norm, self._fp8_steps, self._fp8_fallback_seen = [], None, 0, -1
        self._fp8_param_norm, self._fp8_skipped_grad_norm = None, None
        self._fp8_work.detach()
        if self.fp8_lm_config is not None:
            self.fp8_health, self.fp8_scale_jumps = HealthMonitor(), new_scale_jumps(self.fp8_scale_jumps)
        return result
