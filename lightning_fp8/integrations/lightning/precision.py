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
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Generator
from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from typing_extensions import override

from lightning_fp8 import recovery
from lightning_fp8.convert import FALLBACK_ATTR, convert_to_fp8, fp8_modules
from lightning_fp8.integrations.clipping import (
    UnscaledGradients,
    clip_factor,
    clip_grad_value_keeping_overflow_,
    clip_scaled_grad_norm_,
    mul_grads_by_,
    optimizer_grads,
)
from lightning_fp8.integrations.lightning import comm
from lightning_fp8.integrations.lightning import optimizers as optimizer_swap
from lightning_fp8.integrations.lightning.callbacks import SCALED_GRADIENTS_MARK, _unwrap_optimizer
from lightning_fp8.integrations.lightning.flavour import build_flavour
from lightning_fp8.linear import FP8Linear
from lightning_fp8.optim import master
from lightning_fp8.recipe import FP8Recipe, resolve_recipe
from lightning_fp8.state import check_fp8_state_dict, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.stats import clean_name
from lightning_fp8.warnings import warn_once

Backend = Literal["native", "te"]
_BACKENDS = ("native", "te")
# The names Lightning files the plugin's state under in a checkpoint: the class's __qualname__, in the ``lightning``
# flavour and in the ``pytorch_lightning`` one (precision_class).
_STATE_KEYS = ("FP8LMPrecision", "FP8LMPrecisionPL")
# Where the code calling the plugin's hooks lives, in either namespace: the Trainer's strategies, or Fabric.
_TRAINER_PACKAGES = ("lightning.pytorch.", "pytorch_lightning.")
_FABRIC_PACKAGES = ("lightning.fabric.", "lightning_fabric.")


class _FP8LMPrecisionLogic:
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
            if not isinstance(value, bool):
                raise TypeError(f"FP8LMPrecision({name}={value!r}): must be True or False")
        if module_filter_fn is not None and not callable(module_filter_fn):
            raise TypeError(
                f"FP8LMPrecision(module_filter_fn={module_filter_fn!r}): must be a callable fn(module, fqn) -> bool, "
                f"e.g. lambda module, fqn: fqn != {module_filter_fn!r}"
            )
        self.recipe = resolve_recipe(recipe)
        self.backend = backend
        self.autocast = autocast
        self.replace_optimizers = replace_optimizers
        self.fp8_communication = fp8_communication
        self.fp8_grads = fp8_grads
        self.module_filter_fn = module_filter_fn
        self.grad_scaler = _make_grad_scaler(grad_scaler)
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
        if self.grad_scaler.model is None:  # lets mu changes rescale the FP8 layers' grad_output scales exactly
            self.grad_scaler.model = module
        return module

    @override
    def connect(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        self._wrapped_model = model
        self._device_type = _first_device_type(model)
        if self.replace_optimizers:
            optimizers = [self._replace_optimizer(opt, lr_schedulers) for opt in optimizers]
        _refuse_bf16_fallback_in_data_parallel(self.grad_scaler, self._module)  # a user's FP8AdamW may bring its scaler
        if self._will_adopt_masters():
            _refuse_weight_averaging(self._module)
        _refuse_pruning_of_converted_layers(self._module)
        if self.fp8_communication:
            self.comm_hooks, self.comm_state = comm.install_comm_hooks(model, self.grad_scaler, self.recipe)
        self._optimizers = list(optimizers)
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

    def _replace_optimizer(self, optimizer: torch.optim.Optimizer, lr_scheduler_configs: list[Any]) -> Any:
        if optimizer_swap.is_mock_optimizer(optimizer):  # configure_optimizers returned None: kept, as Lightning does
            return optimizer
        fp8_kwargs: dict[str, Any] = {
            "recipe": self.recipe,
            "grad_scaler": self.grad_scaler,
            "fp8_grads": self.fp8_grads,
        }
        fsdp1 = comm.is_fsdp1_root(self._wrapped_model)
        if fsdp1:
            fp8_kwargs["fp8_params"] = optimizer_swap.keep_masters_apart(self._wrapped_model)
        new = optimizer_swap.to_fp8_optimizer(optimizer, **fp8_kwargs)
        if new is optimizer and fsdp1 and _holds_masters_in_storage(new):
            raise ValueError(
                "strategy='fsdp_fp8': the FP8AdamW returned by configure_optimizers keeps its fp16 masters in the FP8 "
                "weights' storage, which under FSDP is a view into FSDP's flat parameter (its first step would fail). "
                "Return torch.optim.AdamW (or Adam) from configure_optimizers: FP8LMPrecision replaces it with an "
                "FP8AdamW that keeps its masters apart, with FP8 and fp16 states sharded by FSDP"
            )
        if self._early_masters and getattr(new, "master_dtype", None) != torch.float16:
            raise ValueError(
                f"the FP8AdamW from configure_optimizers keeps {new.master_dtype} masters, but under DDP "
                f"FP8LMPrecision(recipe={self.recipe.opt_level!r} level) prepared fp16 ones before wrapping the model: "
                "use FP8LMPrecision(recipe='fp8-lm-o1') for an O1 optimizer, or the default FP8AdamW arguments"
            )
        if new is not optimizer:
            schedulers = [getattr(config, "scheduler", config) for config in lr_scheduler_configs]
            optimizer_swap.rebind_schedulers(schedulers, optimizer, new)
        elif getattr(new, "grad_scaler", None) is None:
            new.grad_scaler = self.grad_scaler  # the user's FP8AdamW: unscale by our mu, report its casts to it
        else:
            self.grad_scaler = new.grad_scaler  # the user's FP8AdamW brought its own scaler: scale by that mu
            if self.grad_scaler.model is None:
                self.grad_scaler.model = self._module
        return new

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

    # -- backward and step ------------------------------------------------------------------------------------

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        return super().pre_backward(self.grad_scaler.scale_loss(tensor), module)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("precision='fp8-lm' cannot step LBFGS (its closure re-evaluates the loss): use AdamW")
        closure_result = closure()
        # training_step returned None in automatic optimization: no backward ran for this micro-batch. The earlier ones
        # of its accumulation window may have left gradients, which are stepped, as torch.optim steps them under
        # precision="bf16-mixed"; with none, there is nothing to step.
        nothing_to_step = closure_result is None and model.automatic_optimization and not _holds_gradients(optimizer)
        with self.unscaled_gradients(optimizer, enabled=not nothing_to_step and _hooks_read_gradients(model)):
            self._after_closure(model, optimizer)  # on_before_optimizer_step hooks + gradient clipping
        if kwargs:
            raise TypeError(f"precision='fp8-lm' steps through FP8GradScaler.step(optimizer); got extra {list(kwargs)}")
        # Lightning's stand-in optimizer (configure_optimizers returned None) steps nothing: mu stays as it is.
        if nothing_to_step or optimizer_swap.is_mock_optimizer(optimizer):
            return closure_result
        if getattr(optimizer, "grad_scaler", None) is self.grad_scaler:
            optimizer.step()  # FP8AdamW routes through the scaler: skip or step (unscaling in its kernel), update mu
        else:
            self.grad_scaler.step(optimizer)  # skips on a non-finite gradient (agreed on all ranks)
            self.grad_scaler.update()
        return closure_result

    @contextlib.contextmanager
    def unscaled_gradients(self, optimizer: Any, enabled: bool = True) -> Generator[None, None, None]:
        """Inside, ``optimizer``'s gradients are the true gradients (divided by mu); outside, scaled by mu again.

        mu is a power of two, so for fp32 and bf16 gradients both multiplications are exact. fp16 gradients (the FP8
        weights' at O2) are not: mu is there for the values fp16 cannot hold unscaled (below 2^-24, above 65504),
        which the division would round away or overflow. Their scaled values are kept meanwhile and put back where
        the code inside left the values as the division made them (:class:`~lightning_fp8.integrations.clipping.
        UnscaledGradients`), so a hook that only reads changes nothing of the step; values changed inside are
        multiplied back (rounded once). With mu == 1 (the common case) this costs nothing.
        """
        mu = self.grad_scaler.loss_scale  # the backward's mu
        if not enabled or self._unscaled is not None or mu == 1.0:
            yield
            return
        self._unscaled = UnscaledGradients(optimizer, mu)
        try:
            yield
        finally:
            self._end_unscaled_region()

    def _end_unscaled_region(self) -> None:
        region, self._unscaled = self._unscaled, None
        if region is not None:
            region.scale_back()

    def gradient_factor(self) -> float:
        """The factor the gradients carry now: mu (the backward's), or 1 while :meth:`unscaled_gradients` has them
        unscaled. Callbacks that read gradients in ``on_before_optimizer_step`` without the unscaling divide by it."""
        return 1.0 if self._unscaled is not None else self.grad_scaler.loss_scale

    @override
    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        # Reached from inside optimizer_step's unscaled region (automatic optimization) or directly from
        # LightningModule.clip_gradients (manual optimization); the flag keeps the first from unscaling twice.
        # The plugin's flag, or a user's own FP8AdamW holding FP8 gradients (its fp8_grads, at O1 or O2)
        holds_fp8_grads = self.fp8_grads or getattr(_unwrap_optimizer(optimizer), "holds_fp8_grads", False)
        if clip_val > 0 and holds_fp8_grads:
            raise ValueError(
                f"gradient clipping (clip_val={clip_val}) would miss the FP8 weights' gradients, which FP8AdamW "
                "holds in FP8 (fp8_grads=True: they leave param.grad as soon as they are computed): use "
                "FP8LMPrecision(fp8_grads=False) (the default) and, for your own FP8AdamW, fp8_grads=False; or no "
                "clipping"
            )
        if clip_val <= 0:
            return
        # Clipped carrying mu: an unscaled region (hooks, a configure_gradient_clipping of the module's own) puts its
        # gradients back exactly first, and is opened again after, for the code that runs on in it.
        region, self._unscaled = self._unscaled, None
        if region is not None:
            region.scale_back()
        try:
            super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)
        finally:
            if region is not None:
                self._unscaled = UnscaledGradients(region.optimizer, region.mu)

    @override
    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        # The gradients carry mu (a power of two): clamping them at clip_val * mu clamps the true ones at clip_val.
        clip_grad_value_keeping_overflow_(self.main_params(optimizer), clip_val * self.grad_scaler.loss_scale)

    @override
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        # On the gradients as they are (carrying mu, fp16 for the FP8 weights at O2: unscaling them would round): the
        # factor min(1, clip_val / (true norm + 1e-6)) of torch's clip_grad_norm_, the norm summed in fp32.
        mu = self.grad_scaler.loss_scale
        clip = getattr(self._wrapped_model, "clip_grad_norm_", None)
        if clip is not None and comm.is_fsdp1_root(self._wrapped_model):
            # FSDP1 shards gradients: only the root computes the global norm (in fp32); max_norm=inf clips nothing.
            if self._wrapped_model.training_state.name != "IDLE":  # inside its forward: manual optimization
                raise ValueError(
                    "clip_gradients(gradient_clip_algorithm='norm') inside training_step cannot run under "
                    "strategy='fsdp_fp8': FSDP1 computes the global norm only outside its root module's forward, and "
                    "manual optimization's training_step runs inside it. Clip by value there, clip with automatic "
                    "optimization (Trainer(gradient_clip_val=...)), or use FSDP2 (ModelParallelStrategy), which clips "
                    "by norm in training_step"
                )
            total = clip(float("inf"))
            mul_grads_by_(optimizer_grads(optimizer), clip_factor(total, clip_val, mu))
            return
        clip_scaled_grad_norm_(self.main_params(optimizer), clip_val, mu)

    # -- checkpoints ------------------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        """mu, the FP8 scaling state and the layers put back to ``nn.Linear`` by the ``"bf16"`` fallback; plain
        tensors, numbers and strings (``torch.load(weights_only=True)`` reads it)."""
        state: dict[str, Any] = {"recipe": self.recipe.to_dict(), "grad_scaler": self.grad_scaler.state_dict()}
        if self._module is not None:
            state["fallen_back_layers"] = [_clean_name(name) for name in recovery.fallen_back_layers(self._module)]
            state["fp8"] = {_clean_name(key): value for key, value in fp8_state_dict(self._module).items()}
            if _world_size() > 1:  # each rank's activation amaxes differ: keep them all for an exact resume
                state["fp8_per_rank"] = comm.all_gather_state(state["fp8"])
        return state

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Put the layers that had fallen back to ``nn.Linear`` back again, with the checkpoint's parameter values.

        Lightning calls this just before :meth:`load_state_dict`, after ``convert_module`` turned every linear layer
        into FP8 and ``connect`` created FP8AdamW, which at O2 took each FP8 weight's storage for its fp16 master:
        the fallen-back weights too, rounding them to fp16. Once plain parameters again they get the checkpoint's
        fp32 values back, and the optimizer states Lightning loads next are their fp32 ones. The plugin's state is
        checked whole first: a bad one changes nothing.

        Lightning files the plugin's state under the class's name, which differs between the ``lightning`` and the
        ``pytorch_lightning`` flavour; a checkpoint of the other flavour is loaded here, as Lightning would not.
        """
        self._check_optimizer_states(checkpoint)
        own = type(self).__qualname__
        key = next((key for key in (own, *_STATE_KEYS) if key in checkpoint), None)
        if key is None:
            return
        state = checkpoint[key]
        _, names, _ = self._checked(state)  # before any layer is put back
        model_state = checkpoint.get("state_dict")
        if names and model_state is not None:
            # Checked too before any layer is put back: once put back, a layer has left its FP8 form and optimizer.
            values = _layer_parameter_values(self._module, names, model_state)
            self._put_back(names)  # checks every layer before it changes any
            with torch.no_grad():
                for param, value in values:
                    param.copy_(value)
        if key != own:  # Lightning only loads the state filed under this class's own name
            self.load_state_dict(state)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved, names, fp8_state = self._checked(state_dict)
        if saved != self.recipe:
            warn_once(f"resuming with FP8 recipe {self.recipe} from a checkpoint written with {saved}")
        if names:
            self._put_back(names)  # raises, before changing anything, when a layer cannot be put back
        self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        if fp8_state is not None:
            load_fp8_state_dict(self._module, fp8_state)
        elif "fp8" in state_dict:
            warn_once(
                "the checkpoint's FP8 scaling state (scales, amax histories) was written under other scaling settings "
                "and is not loaded: each FP8 layer's first casts compute their scales from the tensors themselves"
            )

    def _checked(self, state_dict: Any) -> tuple[FP8Recipe, list[str], dict[str, Any] | None]:
        """Check every part of the plugin's saved state before any is loaded; return the saved recipe, the layers to
        put back (as this model names them) and the FP8 scaling state to load (``None``: none to load)."""
        required = ("recipe", "grad_scaler")
        missing = [key for key in required if not isinstance(state_dict, dict) or key not in state_dict]
        if missing:
            saved = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise KeyError(
                f"FP8LMPrecision: the checkpoint's precision-plugin state lacks {missing} (it holds {saved}): it was "
                "not written by FP8LMPrecision.state_dict() or is corrupt. Resume from a checkpoint of a "
                "precision='fp8-lm' run, or load only the model's weights (e.g. LightningModule.load_from_checkpoint)"
            )
        saved = FP8Recipe.from_dict(state_dict["recipe"])
        names = self._checked_fallen_back(state_dict.get("fallen_back_layers", []))  # absent from older checkpoints
        self.grad_scaler.check_state_dict(state_dict["grad_scaler"])
        per_rank = state_dict.get("fp8_per_rank")  # written by runs of several processes only
        well_formed = per_rank is None or (
            isinstance(per_rank, (list, tuple)) and len(per_rank) > 0 and all(isinstance(s, dict) for s in per_rank)
        )
        if not well_formed:
            raise TypeError(
                f"FP8LMPrecision: the checkpoint's 'fp8_per_rank' is {repr(per_rank)[:200]}, not a list of one FP8 "
                "scaling state (a dict) per process of the run that saved it: the checkpoint is corrupt. Resume from "
                "an earlier checkpoint, or load only the model's weights (e.g. LightningModule.load_from_checkpoint)"
            )
        if "fp8" not in state_dict or not saved.same_scaling(self.recipe):
            return saved, names, None
        if self._module is None:
            raise RuntimeError("FP8LMPrecision.load_state_dict: no converted model yet (call convert_module)")
        fp8_state = state_dict["fp8"]
        if per_rank is not None and len(per_rank) == _world_size():  # else every rank resumes from rank 0's state
            fp8_state = per_rank[_rank()]
        if isinstance(fp8_state, dict):  # else check_fp8_state_dict says what it is
            fp8_state = _to_module_names(self._module, fp8_state)
        layers = dict(self._module.named_modules())
        # The layers about to be put back have no scaling state in the checkpoint
        check_fp8_state_dict(self._module, fp8_state, leaving_out=[layers[n] for n in names if n in layers])
        return saved, names, fp8_state

    def _checked_fallen_back(self, names: Any) -> list[str]:
        """The saved ``fallen_back_layers``, checked to be names of this model's FP8 layers (or of layers already put
        back), as this model names them."""
        if not isinstance(names, (list, tuple)) or not all(isinstance(name, str) for name in names):
            raise TypeError(
                f"FP8LMPrecision: the checkpoint's 'fallen_back_layers' is {repr(names)[:200]}, not a list of layer "
                "names (strings): the checkpoint is corrupt. Resume from an earlier checkpoint, or load only the "
                "model's weights (e.g. LightningModule.load_from_checkpoint)"
            )
        if not names or self._module is None:  # without a model, _put_back says to convert it first
            return list(names)
        names = _to_layer_names(self._module, list(names))
        layers = dict(self._module.named_modules())
        # The root cannot be put back in place; a layer put back already (a second load) is an nn.Linear again.
        bad = [name for name in names if not name or not _fp8_or_put_back(layers.get(name))]
        if bad:
            raise ValueError(
                f"FP8LMPrecision: the checkpoint names layers {bad[:5]} as fallen back to nn.Linear in the saved run, "
                f"but this {type(self._module).__name__} has no FP8 layer of that name (its FP8 layers: "
                f"{_first(list(fp8_modules(self._module)))}): the checkpoint was written for another model or is "
                "corrupt. Resume with the model (and module_filter_fn) that saved it. Nothing was changed"
            )
        return names

    def _check_optimizer_states(self, checkpoint: dict[str, Any]) -> None:
        # Before the optimizer and FP8 states are loaded (Lightning has loaded the weights by then): FP8FSDPStrategy's
        # per-rank optimizer shards only fit FP8FSDPStrategy with as many processes, and it loads nothing else.
        trainer = getattr(self._module, "_trainer", None)
        if trainer is None or trainer.state.fn != "fit" or checkpoint.get("optimizer_states") is None:
            return
        # Imported here: strategy.py imports this module.
        from lightning_fp8.integrations.lightning.strategy import check_optimizer_states

        states = checkpoint["optimizer_states"]
        check_optimizer_states(states, trainer.strategy)
        # Where the strategy hands each saved state to its optimizer's load_state_dict as it is (single device, DDP;
        # FSDP's are keyed by parameter name, resharded by the strategy), FP8AdamW checks it now: a corrupt one then
        # raises before the FP8 state, mu and fallen-back layers load, not after.
        if type(trainer.strategy).load_optimizer_state_dict.__qualname__ == "Strategy.load_optimizer_state_dict":
            for optimizer, state in zip(self._optimizers, states, strict=False):  # a count mismatch: Lightning's error
                check = getattr(_unwrap_optimizer(optimizer), "check_state_dict", None)
                if check is not None:
                    check(state)

    def _put_back(self, names: list[str]) -> None:
        """Put the layers ``names`` back to ``nn.Linear`` (no-op for those already put back), releasing their weights
        from the optimizers, so that the checkpoint's FP8 state and fp32 optimizer states fit them."""
        if self._module is None:
            raise RuntimeError("FP8LMPrecision: no converted model yet to put layers back in (call convert_module)")
        recovery.put_back_to_high_precision(self._module, names, self._optimizers)


def _holds_masters_in_storage(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` (an FP8AdamW at O2) took any parameter's storage for its scaled fp16 master."""
    return any(master.master_scale(p) is not None for group in optimizer.param_groups for p in group["params"])


def _clean_name(name: str) -> str:
    """``name`` without the path components that FSDP1 (auto_wrap_policy), activation checkpointing and torch.compile
    insert (``net._fsdp_wrapped_module.0`` -> ``net.0``): whole components only, so ``net_orig_mod.0`` stays. A child
    of the user's own named ``module`` stays too (the plugin gets the LightningModule, not a DDP wrapper)."""
    return clean_name(name, strip_module=False)


def _to_layer_names(module: nn.Module, names: list[str]) -> list[str]:
    """The layers ``names`` (clean, or wrapped as older checkpoints saved them) as ``module`` names them."""
    own = {_clean_name(name): name for name, _ in module.named_modules()}
    return [own.get(_clean_name(name), name) for name in names]


def _to_module_names(module: nn.Module, fp8_state: dict[str, Any]) -> dict[str, Any]:
    """``fp8_state`` keyed by ``module``'s own (possibly wrapped) scaling-state names, matched by their clean names.

    Checkpoints hold clean names (older ones, the names under the wrapping that saved them); both load under any
    wrapping. Keys that match no scaling state are kept as they are (``load_fp8_state_dict`` names them).
    """
    split = [key.rpartition(".") for key in fp8_state]
    names = _to_layer_names(module, [state_name for state_name, _, _ in split])
    values = fp8_state.values()
    return {f"{name}.{field}": value for name, (_, _, field), value in zip(names, split, values, strict=True)}


def _refuse_fabric() -> None:
    """Raise TypeError when Lightning Fabric, not a Trainer, calls the plugin (``fabric.setup`` converting the model).

    Fabric accepts any Lightning precision plugin, but this one's backward, step and clipping hooks need the Trainer
    (its LightningModule, optimizer loop and callbacks): under Fabric the model was converted, then ``fabric.backward``
    failed with an AttributeError. The nearest Lightning caller decides: a Trainer's strategy (whatever module it
    passes, attached to a Trainer or not) or Fabric; a call from neither (tests, scripts) is left alone.
    """
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__") or ""
        if name.startswith(_TRAINER_PACKAGES):
            return
        if name.startswith(_FABRIC_PACKAGES):
            raise TypeError(
                "FP8LMPrecision is a plugin for the Lightning Trainer (Trainer(precision='fp8-lm') or "
                "Trainer(plugins=[FP8LMPrecision()])); Lightning Fabric is not supported: its backward and step "
                "hooks need a Trainer. Drop it from Fabric(plugins=...) and use the plain-PyTorch API in your Fabric "
                "loop: lightning_fp8.convert_to_fp8(model), FP8AdamW and FP8GradScaler (docs/guides/pytorch.md)"
            )
        frame = frame.f_back


def _make_grad_scaler(grad_scaler: Any) -> Any:
    from lightning_fp8.grad_scaler import FP8GradScaler

    if grad_scaler is None:
        return FP8GradScaler()
    if isinstance(grad_scaler, dict):
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


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _first(names: list[str], count: int = 5) -> str:
    return ", ".join(map(repr, names[:count])) + (f" and {len(names) - count} more" if len(names) > count else "")


def _fp8_or_put_back(layer: nn.Module | None) -> bool:
    return isinstance(layer, FP8Linear) or getattr(layer, FALLBACK_ATTR, False)


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _is_ddp(module: nn.Module) -> bool:
    # The DDP family of either namespace (ddp, ddp_spawn, ddp_fork...): it wraps the model before connect().
    trainer = getattr(module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None)
    return any(cls.__name__ == "DDPStrategy" for cls in type(strategy).__mro__)


def _is_multi_process(module: nn.Module) -> bool:
    # DDP (also on one device: it hooked the parameters), FSDP and ModelParallelStrategy, or any run of several ranks.
    trainer = getattr(module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None)
    families = ("DDPStrategy", "FSDPStrategy", "ModelParallelStrategy")
    return any(cls.__name__ in families for cls in type(strategy).__mro__) or getattr(trainer, "world_size", 1) > 1


def _refuse_bf16_fallback_in_data_parallel(grad_scaler: Any, module: nn.Module | None) -> None:
    """Raise now, rather than after ``fallback_after`` non-finite steps, when the ``"bf16"`` fallback could only fail.

    DDP hooked the model's parameters and buffers when it wrapped it, so putting a layer back to ``nn.Linear`` is
    refused under DDP (:func:`lightning_fp8.recovery.put_back_to_high_precision`).
    """
    if module is None or getattr(grad_scaler, "nonfinite_fallback", None) != "bf16" or not _is_multi_process(module):
        return
    strategy = type(module.trainer.strategy).__name__
    raise ValueError(
        f"FP8LMPrecision: FP8GradScaler(nonfinite_fallback='bf16') cannot run under {strategy}: putting layers back "
        "to nn.Linear is refused under DistributedDataParallel (it hooked the model's parameters and buffers) and "
        "cannot swap FSDP's sharded layers, and each rank would choose the layers from its own gradients, so this "
        "fallback could only ever fail, after `fallback_after` non-finite steps. Use "
        "FP8GradScaler(nonfinite_fallback='lower_lr') (or a callable) under DDP and FSDP; 'bf16' works on a single "
        "device"
    )


def _layer_parameter_values(
    module: nn.Module, names: list[str], model_state: dict[str, Any]
) -> list[tuple[nn.Parameter, Tensor]]:
    """``(parameter, checkpoint value)`` for each parameter of the layers ``names`` that ``model_state`` (the
    checkpoint's model state, keyed with or without wrapper names) holds, each checked to fit its parameter; one it
    lacks keeps its value (the model was loaded with ``strict=False``)."""
    if not isinstance(model_state, dict):
        raise TypeError(
            f"FP8LMPrecision: the checkpoint's 'state_dict' is a {type(model_state).__name__}, not the model's state "
            "dict: the checkpoint is corrupt. Resume from an earlier checkpoint. Nothing was changed"
        )
    keys = {_clean_name(key): key for key in model_state if isinstance(key, str)}
    layers = dict(module.named_modules())
    values = []
    for name in names:
        for param_name, param in layers[name].named_parameters(recurse=False):
            key = keys.get(_clean_name(f"{name}.{param_name}"))
            if key is None:
                continue
            value = model_state[key]
            if not isinstance(value, Tensor) or value.shape != param.shape:
                got = f"a {tuple(value.shape)} tensor" if isinstance(value, Tensor) else repr(value)[:100]
                raise ValueError(
                    f"FP8LMPrecision: the checkpoint's {key!r} is {got}, but {name!r}, a layer that fell back to "
                    f"nn.Linear in the saved run, has a {tuple(param.shape)} {param_name}: the checkpoint is corrupt "
                    "or was written for another model. Resume with the model that saved it. Nothing was changed"
                )
            values.append((param, value))
    return values


def _holds_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` has any gradient to step on: a ``param.grad``, or one an FP8AdamW holds in FP8
    (``fp8_grads``: those leave ``param.grad`` as backward produces them)."""
    if any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
        return True
    fp8_grad_norms = getattr(_unwrap_optimizer(optimizer), "fp8_grad_norms", None)
    return fp8_grad_norms is not None and bool(fp8_grad_norms())


# Lightning's callbacks that average ``module.parameters()`` (by class name, across Lightning versions: the
# ``WeightAveraging`` base and its ``EMAWeightAveraging`` came with Lightning 2.6).
_AVERAGING_CALLBACKS = ("StochasticWeightAveraging", "WeightAveraging")


def _callbacks_of(module: nn.Module | None, names: tuple[str, ...]) -> list[Any]:
    """The Trainer's callbacks whose class is, or derives from, a class named in ``names``."""
    trainer = getattr(module, "_trainer", None)
    return [cb for cb in getattr(trainer, "callbacks", None) or []
            if any(cls.__name__ in names for cls in type(cb).__mro__)]  # fmt: skip


def _refuse_weight_averaging(module: nn.Module | None) -> None:
    """Raise ValueError if the Trainer has one of Lightning's weight-averaging callbacks (StochasticWeightAveraging,
    EMAWeightAveraging or another WeightAveraging): they average ``module.parameters()``, which at O2 hold each FP8
    weight's fp16 master times a power-of-two scale that changes from step to step, so the average (and the weights
    it puts back or saves in checkpoints) would be wrong, silently."""
    averaging = _callbacks_of(module, _AVERAGING_CALLBACKS)
    if averaging:
        raise ValueError(
            f"precision='fp8-lm' (O2) cannot run with {type(averaging[0]).__name__}: it averages the parameters' "
            "storage, which at O2 holds each FP8 weight's fp16 master times a scale that changes between steps, so "
            "the averaged weights would be wrong. Use the O1 recipe (FP8LMPrecision(recipe='fp8-lm-o1'): the "
            "weights keep their own storage), or average the unscaled weights of model.state_dict() in a callback "
            "of your own"
        )


def _refuse_pruning_of_converted_layers(module: nn.Module | None) -> None:
    """Raise ValueError if Lightning's ModelPruning will prune a layer that the conversion replaced: it collects its
    modules in ``setup``, before the plugin converts them, so its masks would go to the replaced ``nn.Linear`` while
    its forward pre-hook (shared with the FP8Linear, convert.py's hook registries) runs on the FP8 layer, which has no
    mask: the next forward failed deep inside torch.nn.utils.prune."""
    if module is None:
        return
    present = {id(m) for m in module.modules()}
    for callback in _callbacks_of(module, ("ModelPruning",)):
        gone = [m for m, _ in getattr(callback, "_parameters_to_prune", None) or []
                if isinstance(m, nn.Module) and id(m) not in present]  # fmt: skip
        if gone:
            raise ValueError(
                f"precision='fp8-lm' cannot run {type(callback).__name__} on layers it converts to FP8Linear (here "
                f"{gone[0]!r} and {len(gone) - 1} more): the callback collected them before the conversion, so its "
                "masks would never reach the FP8 layers. Leave the layers to prune in high precision "
                "(FP8LMPrecision(module_filter_fn=...) returning False for them), or prune before training"
            )


def _hooks_read_gradients(model: Any) -> bool:
    """Whether something may read or change gradients between the backward and the step, so that they are
    unscaled for it: an ``on_before_optimizer_step`` of the module or of a callback (not Lightning's own, nor one
    marked with ``callbacks.reads_scaled_gradients``), also one assigned on the instance, or the module's own
    ``configure_gradient_clipping``."""
    trainer = getattr(model, "trainer", None)
    callbacks = getattr(trainer, "callbacks", None) or []
    return (
        _user_hook(model, "on_before_optimizer_step")
        or _user_hook(model, "configure_gradient_clipping")
        or any(_user_hook(cb, "on_before_optimizer_step") for cb in callbacks)
    )


def _user_hook(obj: Any, name: str) -> bool:
    if name in getattr(obj, "__dict__", {}):  # assigned on the instance
        return True
    hook = getattr(type(obj), name, None)
    if hook is None or getattr(hook, SCALED_GRADIENTS_MARK, False):
        return False
    module = getattr(hook, "__module__", None) or ""  # Lightning's own (the base classes' no-ops), either flavour
    return not module.startswith(("lightning.pytorch.", "pytorch_lightning."))


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
            a byte or more per parameter). Off by default: those gradients then leave ``param.grad``, so gradient
            clipping, ``on_before_optimizer_step`` hooks and gradient-norm logging would not see them. Refused by
            FP8AdamW under a multi-process strategy (DDP would average nothing: the gradients leave before it).
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
