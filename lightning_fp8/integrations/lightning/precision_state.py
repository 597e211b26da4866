"""FP8LMPrecision's checkpoint state: mu, the FP8 scaling state and the layers the ``"bf16"`` fallback put back.

``state_dict`` writes them under clean layer names (without the FSDP, activation-checkpointing and
``torch.compile`` wrappers), so a run resumes under another wrapping or on one device. ``on_load_checkpoint`` and
``load_state_dict`` check the whole saved state (and the fallen-back layers' weights) before they change anything,
then put the fallen-back layers back to ``nn.Linear`` and load mu and the scaling state. :class:`_PrecisionState` is
a base of the plugin (:mod:`~lightning_fp8.integrations.lightning.precision`) and reads its attributes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_fp8 import recovery
from lightning_fp8.convert import fp8_modules
from lightning_fp8.eligibility import is_fallen_back
from lightning_fp8.integrations.lightning import comm
from lightning_fp8.integrations.lightning.callbacks import _unwrap_optimizer
from lightning_fp8.linear import FP8Linear
from lightning_fp8.recipe import FP8Recipe
from lightning_fp8.state import check_fp8_state_dict, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.stats import clean_name
from lightning_fp8.warnings import warn_once

# The names Lightning files the plugin's state under in a checkpoint: the class's __qualname__, in the ``lightning``
# flavour and in the ``pytorch_lightning`` one (precision_class).
_STATE_KEYS = ("FP8LMPrecision", "FP8LMPrecisionPL")


class _PrecisionState:
    """The plugin's checkpoint hooks and the checks they run before loading anything."""

    recipe: FP8Recipe
    grad_scaler: Any
    comm_state: Any
    _module: nn.Module | None
    _optimizers: list[torch.optim.Optimizer]

    @override
    def state_dict(self) -> dict[str, Any]:
        """mu, the FP8 scaling state, the layers put back to ``nn.Linear`` by the ``"bf16"`` fallback and the FP8
        communication hooks' state (the native path's extra headroom); plain tensors, numbers and strings
        (``torch.load(weights_only=True)`` reads it)."""
        state: dict[str, Any] = {"recipe": self.recipe.to_dict(), "grad_scaler": self.grad_scaler.state_dict()}
        if self.comm_state is not None:  # the same on every rank
            state["comm"] = self.comm_state.state_dict()
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
            if "optimizer_states" in checkpoint:  # a training checkpoint (not save_weights_only) without the state
                warn_once(
                    "the checkpoint has no FP8-LM precision state (was it saved without precision='fp8-lm'?): mu and "
                    "the FP8 scales start fresh, as in a new run (outside fit, where mu plays no part, the FP8 "
                    "scales: the first casts measure their own amax)"
                )
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
        if "comm" in state_dict and self.comm_state is not None:  # without hooks in this run, it has no use
            self.comm_state.load_state_dict(state_dict["comm"])
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
        try:
            saved = FP8Recipe.from_dict(state_dict["recipe"])
        except (TypeError, ValueError) as error:
            # FP8Recipe's own message names a field the user never wrote: say where the value came from.
            raise type(error)(
                f"FP8LMPrecision: the checkpoint's 'recipe' {repr(state_dict['recipe'])[:200]} is not an FP8Recipe's "
                f"to_dict() ({error}): the checkpoint is corrupt. Resume from an earlier checkpoint, or load only the "
                "model's weights (e.g. LightningModule.load_from_checkpoint). Nothing was changed"
            ) from error
        names = self._checked_fallen_back(state_dict.get("fallen_back_layers", []))  # absent from older checkpoints
        self.grad_scaler.check_state_dict(state_dict["grad_scaler"])
        if "comm" in state_dict and self.comm_state is not None:  # absent from older and single-process checkpoints
            self.comm_state.check_state_dict(state_dict["comm"])
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
        # Imported here: strategy.py imports precision.py, which imports this module.
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


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _first(names: list[str], count: int = 5) -> str:
    return ", ".join(map(repr, names[:count])) + (f" and {len(names) - count} more" if len(names) > count else "")


def _fp8_or_put_back(layer: nn.Module | None) -> bool:
    return isinstance(layer, FP8Linear) or is_fallen_back(layer)


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


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
