"""FP8LMPrecision: the Lightning precision plugin behind ``Trainer(precision="fp8-lm")``.

What it does, hook by hook (Lightning calls them in this order):

- ``convert_module``: ``nn.Linear`` layers become :class:`~lightning_fp8.FP8Linear` (or Transformer Engine
  layers with ``backend="te"``), in place.
- ``connect``: the AdamW/Adam optimizers from ``configure_optimizers`` become :class:`~lightning_fp8.FP8AdamW`
  (same hyper-parameters and param groups; LR schedulers are rebound), and the FP8 gradient communication
  hooks are installed when the model is wrapped by DDP or FSDP. Under DDP, ``convert_module`` and ``connect``
  refuse a gradient scaler with ``nonfinite_fallback="bf16"``, which could only ever fail there (see
  :mod:`lightning_fp8.recovery`), before any training step.
- ``forward_context``: ops that are not FP8 GEMMs (attention, norms, softmax) run under bf16 autocast, as with
  ``precision="bf16-mixed"``, on GPU and on CPU alike (so CPU runs test the same numerics).
- ``pre_backward``: the loss is multiplied by the gradient scale mu (:class:`~lightning_fp8.FP8GradScaler`).
- ``optimizer_step``: runs the closure, unscales the gradients where an ``on_before_optimizer_step`` hook (or a
  ``configure_gradient_clipping`` of the module's own) may read them, so that it sees true gradients, clips them
  (on the gradients as they are, with the threshold scaled by mu: no rounding of fp16 gradients), then lets the
  scaler skip the step (non-finite gradients, agreed on all ranks) or take it, and updates mu.
- ``state_dict``/``load_state_dict``: mu and the FP8 scaling state (scales, amax histories) travel in the
  Lightning checkpoint, so a resumed run continues with the same scales. So do the names of the layers that
  ``FP8GradScaler(nonfinite_fallback="bf16")`` put back to ``nn.Linear``: ``on_load_checkpoint`` puts them back
  again (after ``convert_module`` made them FP8) before the FP8 and optimizer states are loaded. The scaling state
  is keyed by the layers' names without the FSDP, activation-checkpointing and ``torch.compile`` wrappers, so it
  resumes under another wrapping or on one device; ``on_load_checkpoint`` first refuses, saying what resumes them,
  optimizer states this run's strategy cannot load (``strategy="fsdp_fp8"``'s per-rank shards elsewhere).

Gradient accumulation needs nothing special: mu only changes after an optimizer step, so every micro-batch of
an accumulation window is scaled alike. A window whose last ``training_step`` returns None steps on what the earlier
micro-batches accumulated, as with ``precision="bf16-mixed"``. Manual optimization works the same way
(``manual_backward`` scales, ``optimizer.step()`` unscales and steps; ``self.clip_gradients`` clips as if the
gradients were unscaled).

This module holds the plugin's construction, model and optimizer hooks and forward; its bases, one concern each, live
beside it: :mod:`~lightning_fp8.integrations.lightning.precision_step` (backward, unscaling for the hooks, clipping
and the step), :mod:`~lightning_fp8.integrations.lightning.precision_state` (the checkpoint state, checked before
anything loads) and :mod:`~lightning_fp8.integrations.lightning.precision_optimizers` (the optimizers ``connect``
hands the strategy: FP8AdamW in place of AdamW, one gradient scaler). The setups it refuses before any step are in
:mod:`~lightning_fp8.integrations.lightning.refusals`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Generator
from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from typing_extensions import override

from lightning_fp8.convert import (
    _check_converted_recipes,
    convert_to_fp8,
    filter_example,
    fp8_modules,
    takes_module_and_name,
)
from lightning_fp8.integrations.clipping import UnscaledGradients
from lightning_fp8.integrations.lightning import comm
from lightning_fp8.integrations.lightning import optimizers as optimizer_swap
from lightning_fp8.integrations.lightning.callbacks import _unwrap_optimizer
from lightning_fp8.integrations.lightning.flavour import build_flavour
from lightning_fp8.integrations.lightning.precision_optimizers import _holds_masters_in_storage, _PrecisionOptimizers
from lightning_fp8.integrations.lightning.precision_state import _PrecisionState
from lightning_fp8.integrations.lightning.precision_step import _PrecisionStep
from lightning_fp8.integrations.lightning.refusals import (
    _is_ddp,
    _refuse_averaging_with_weight_copies,
    _refuse_bf16_fallback_in_data_parallel,
    _refuse_fabric,
    _refuse_pruning_of_converted_layers,
    _refuse_weight_averaging,
)
from lightning_fp8.optim import master
from lightning_fp8.recipe import FP8Recipe, check_flag, resolve_recipe
from lightning_fp8.warnings import warn_once

Backend = Literal["native", "te"]
_BACKENDS = ("native", "te")


class _FP8LMPrecisionLogic(_PrecisionStep, _PrecisionState, _PrecisionOptimizers):
    """The plugin's behaviour, shared by the ``lightning`` and ``pytorch_lightning`` flavours of the class."""

    precision = "fp8-lm"

    def __init__(
        self,
        recipe: FP8Recipe | str | None = None,
        *,
        backend: Backend = "native",
        autocast: bool = True,
        replace_optimizers: bool = True,
        fp8_communication: bool = True,
        fp8_grads: bool = False,
        grad_scaler: Any = None,
        module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    ) -> None:
        super().__init__()
        if backend not in _BACKENDS:
            raise ValueError(f"FP8LMPrecision(backend={backend!r}) is not supported: choose one of {list(_BACKENDS)}")
        flags = {"autocast": autocast, "replace_optimizers": replace_optimizers,
                 "fp8_communication": fp8_communication, "fp8_grads": fp8_grads}  # fmt: skip
        for name, value in flags.items():
            check_flag("FP8LMPrecision", name, value)
        if module_filter_fn is not None and not callable(module_filter_fn):
            raise TypeError(
                f"FP8LMPrecision(module_filter_fn={module_filter_fn!r}): must be a callable fn(module, fqn) -> bool, "
                f"e.g. {filter_example(module_filter_fn)}"
            )
        if module_filter_fn is not None and not takes_module_and_name(module_filter_fn):
            raise TypeError(  # else the fit failed in convert_module with Python's bare arity error
                f"FP8LMPrecision(module_filter_fn={module_filter_fn!r}) is called as fn(module, fqn) for each linear "
                "layer, which it cannot take: give it the two arguments, e.g. lambda module, fqn: 'lm_head' not in fqn"
            )
        self.recipe = resolve_recipe(recipe, "FP8LMPrecision(recipe=...)")
        self.backend = backend
        self.autocast = autocast
        self.replace_optimizers = replace_optimizers
        self.fp8_communication = fp8_communication
        self.fp8_grads = fp8_grads
        self.module_filter_fn = module_filter_fn
        self.grad_scaler = _make_grad_scaler(grad_scaler)
        self._grad_scaler_given = grad_scaler is not None  # then an FP8AdamW's other scaler must not replace it
        if backend == "te":
            from lightning_fp8.integrations.lightning import te

            te.require_transformer_engine()
        self._module: nn.Module | None = None  # the LightningModule whose layers were converted
        self._wrapped_model: nn.Module | None = None  # the same, as wrapped by the strategy (DDP, FSDP)
        self._device_type: str | None = None
        self._unscaled: UnscaledGradients | None = None  # the gradients unscaled in place for the hooks, while they run
        self._early_masters: list[nn.Parameter] = []  # trainable FP8 weights made fp16 masters before DDP wrapped
        self._optimizers: list[torch.optim.Optimizer] = []  # as connect() handed them to the strategy
        self.comm_hooks: str | None = None  # what connect() installed: "ddp", "fsdp1", "fsdp2" or None
        self.comm_state: Any = None  # the hooks' FP8CommState

    def __repr__(self) -> str:
        return f"FP8LMPrecision(recipe={self.recipe!r}, backend={self.backend!r})"

    # -- model and optimizers ---------------------------------------------------------------------------------

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Swap the linear layers for FP8 layers, in place (strategies may ignore the return value)."""
        _refuse_fabric()
        if self.backend == "te":
            from lightning_fp8.integrations.lightning import te

            te.convert_to_te(module, self.recipe, self.module_filter_fn)
        elif comm.fsdp2_modules(module):  # ModelParallelStrategy: configure_model already ran fully_shard
            from lightning_fp8.distributed.fsdp2 import mark_fp8_weights

            comm.check_converted_before_sharding(module)
            try:  # configure_model converted the layers: with this plugin's recipe, or they would keep theirs
                _check_converted_recipes(module, self.recipe, self.module_filter_fn)
            except ValueError as error:
                raise ValueError(
                    f"precision={self.recipe!r} under fully_shard: the layers were converted in configure_model with "
                    "another recipe (convert there with this one: convert_to_fp8(model, "
                    f"self.trainer.precision_plugin.recipe)). {error}"
                ) from None
            # fully_shard's new Parameters lack the FP8 mark: set it before configure_optimizers creates any FP8AdamW
            # (the user's or the plugin's), which would give unmarked FP8 weights fp32 states.
            mark_fp8_weights(module)
        else:
            _refuse_bf16_fallback_in_data_parallel(self.grad_scaler, module)
            convert_to_fp8(module, self.recipe, self.module_filter_fn)
            if not fp8_modules(module):
                warn_once(
                    f"precision='fp8-lm': no linear layer of {type(module).__name__} was converted to FP8, so it "
                    "trains without FP8 GEMMs: convert_to_fp8's warnings name the layers it left in high precision "
                    "and why (feature sizes not multiples of 16, tied weights, transformers' Conv1D, ...); "
                    "module_filter_fn must not exclude them either"
                )
            # DDP wraps only to fit (validate, test and predict run the bare model, with no optimizer to adopt them)
            if self._will_adopt_masters() and _is_ddp(module) and module.trainer.state.fn == "fit":
                strategy = module.trainer.strategy
                self._early_masters = optimizer_swap.adopt_masters_early(module, strategy.root_device)
        self._module = module
        self._give_scaler_the_model()
        return module

    @override
    def connect(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        self._wrapped_model = model
        self._device_type = _first_device_type(model)
        if self.replace_optimizers:
            self._adopt_brought_scaler(optimizers)
            optimizers = [self._replace_optimizer(opt, lr_schedulers) for opt in optimizers]
        # Before the refusals below: the teardown that follows one releases the masters these optimizers adopted
        # (else the weights stayed fp16 masters times a scale, and a next fit of the module failed on them).
        self._optimizers = list(optimizers)
        _refuse_bf16_fallback_in_data_parallel(self.grad_scaler, self._module)  # a user's FP8AdamW may bring its scaler
        # The masters in the weights' storage are the plugin's at O2, or an FP8AdamW's of the user's whatever the
        # plugin's recipe (kept as built: an O2 one under precision='fp8-lm-o1' or replace_optimizers=False)
        if self._will_adopt_masters() or any(_holds_masters_in_storage(_unwrap_optimizer(o)) for o in optimizers):
            _refuse_weight_averaging(self._module)
        _refuse_averaging_with_weight_copies(self._module, [_unwrap_optimizer(o) for o in optimizers])
        _refuse_pruning_of_converted_layers(self._module)
        if self.fp8_communication:
            self.comm_hooks, self.comm_state = comm.install_comm_hooks(model, self.grad_scaler, self.recipe)
        self.grad_scaler._set_optimizer_order(self._optimizers)  # each optimizer's saved run, by its index
        return model, optimizers, lr_schedulers

    @override
    def teardown(self) -> None:
        # A stage is over (fit, validate, ...): the FP8 weights get their own storage back (unscaled, in the model's
        # dtype; FP8AdamW keeps its masters in its state), so that another Trainer or precision, or code reading
        # param.data, gets the weights and not their fp16 masters times a scale. A next fit adopts them again.
        for optimizer in self._optimizers:
            release = getattr(_unwrap_optimizer(optimizer), "release_weights", None)
            if release is not None:
                release()
        for weight in self._early_masters:  # adopted before DDP wrapped the model, held by no optimizer
            if master.master_scale(weight) is not None:
                master.release(weight)
        self._early_masters = []
        super().teardown()

    def _will_adopt_masters(self) -> bool:
        return self.backend == "native" and self.replace_optimizers and self.recipe.opt_level == "O2"

    def _give_scaler_the_model(self) -> None:
        """Make the module this stage converted the scaler's ``model`` (:meth:`FP8GradScaler._take_model`), so that
        mu changes rescale the grad_output scales of its FP8 layers exactly and ``nonfinite_fallback="bf16"`` finds
        its layers."""
        if self._module is not None:
            self.grad_scaler._take_model(self._module)

    # -- forward ----------------------------------------------------------------------------------------------

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """bf16 autocast for the ops that are not FP8 GEMMs (FP8 layers pick their output dtype from it)."""
        if not self.autocast:
            with self._fp8_region():
                yield
            return
        device_type = self._device_type or _first_device_type(self._module)
        with torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=False), self._fp8_region():
            yield

    def _fp8_region(self) -> contextlib.AbstractContextManager:
        if self.backend == "te":  # Transformer Engine layers run FP8 only inside its own autocast region
            from lightning_fp8.integrations.lightning import te

            return te.te_autocast(self.recipe)
        return contextlib.nullcontext()


def _make_grad_scaler(grad_scaler: Any) -> Any:
    from lightning_fp8.grad_scaler import FP8GradScaler

    if grad_scaler is None:
        return FP8GradScaler()
    if isinstance(grad_scaler, dict):
        allowed = list(inspect.signature(FP8GradScaler).parameters)
        unknown = [key for key in grad_scaler if key not in allowed]
        if unknown:  # Python's own error names FP8GradScaler.__init__ and lists nothing to choose from
            raise TypeError(
                f"FP8LMPrecision(grad_scaler={grad_scaler!r}): unknown FP8GradScaler argument(s) {unknown}; the "
                f"arguments are {allowed}"
            )
        if grad_scaler.get("nonfinite_fallback") == "bf16" and grad_scaler.get("model") is None:
            # The scaler needs the model for this fallback; the plugin gives it the LightningModule when the fit
            # converts it (convert_module), which a dict written before the Trainer exists cannot name.
            scaler = FP8GradScaler(**{**grad_scaler, "nonfinite_fallback": None})
            scaler.nonfinite_fallback = "bf16"
            return scaler
        return FP8GradScaler(**grad_scaler)
    if isinstance(grad_scaler, FP8GradScaler):
        return grad_scaler
    raise TypeError(
        f"FP8LMPrecision(grad_scaler=...) expects an FP8GradScaler, a dict of its arguments or None, "
        f"got {type(grad_scaler).__name__}"
    )


def _first_device_type(module: nn.Module | None) -> str:
    if module is not None:
        for tensor in module.parameters():
            return tensor.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


class FP8LMPrecision(_FP8LMPrecisionLogic, Precision):
    """FP8-LM mixed precision for the Lightning ``Trainer``: ``Trainer(precision="fp8-lm")`` or
    ``Trainer(plugins=[FP8LMPrecision(recipe=...)])``.

    Args:
        recipe: an :class:`~lightning_fp8.FP8Recipe`, a recipe name (``"fp8-lm"``, ``"fp8-lm-o1"``,
            ``"fp8-lm-current"``, ``"fp8-lm-e4m3"``) or ``None`` for ``"fp8-lm"``.
        backend: ``"native"`` (this project's FP8 layers) or ``"te"`` (Transformer Engine layers do the GEMMs;
            this project's optimizer and communication stay). ``"te"`` needs ``pip install lightning-fp8[te]``.
        autocast: run the non-FP8 ops under bf16 autocast (default). ``False`` keeps them in the parameters' dtype.
        replace_optimizers: replace AdamW/Adam from ``configure_optimizers`` by ``FP8AdamW`` (default). With
            ``False`` the optimizers are kept as returned (any optimizer; fp32 states).
        fp8_communication: install the FP8 gradient communication hooks under DDP and FSDP (default).
        fp8_grads: let FP8AdamW turn each FP8 weight's gradient into FP8 as soon as backward produces it (saves
            a byte or more per parameter). Off by default: those gradients then leave ``param.grad``, so
            ``on_before_optimizer_step`` hooks and clipping by value would not see them (clipping by norm counts
            and clips them, through their scales; ``TrainingHealthMonitor`` counts them too). Refused by
            FP8AdamW under a multi-process strategy (DDP would average nothing: the gradients leave before it);
            without effect on weights sharded by ``fully_shard`` (their gradients stay in ``param.grad``, and clip).
        grad_scaler: an :class:`~lightning_fp8.FP8GradScaler`, a dict of its arguments, or ``None`` for defaults.
        module_filter_fn: ``fn(module, fqn) -> bool``; only linear layers where it returns True become FP8
            (e.g. ``lambda m, fqn: "lm_head" not in fqn``).

    Raises:
        ValueError: for an unknown backend or recipe; at fit time, for an optimizer FP8AdamW cannot replace.
        ImportError: for ``backend="te"`` when Transformer Engine is not installed.

    Example::

        trainer = L.Trainer(plugins=[FP8LMPrecision(recipe="fp8-lm-current")])
    """


@functools.cache
def precision_class(namespace: str) -> type:
    """:class:`FP8LMPrecision` for ``"lightning"``, or the same plugin built on ``pytorch_lightning``'s base."""
    if namespace == "lightning":
        return FP8LMPrecision
    return build_flavour(
        _FP8LMPrecisionLogic, f"{namespace}.plugins.precision", "Precision", "FP8LMPrecisionPL", __name__,
        FP8LMPrecision.__doc__,
    )  # fmt: skip


def __getattr__(name: str) -> Any:
    # Makes the pytorch_lightning flavour importable by name, so spawned processes can unpickle it.
    if name == "FP8LMPrecisionPL":
        return precision_class("pytorch_lightning")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
