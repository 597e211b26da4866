"""Putting FP8 layers back to ``nn.Linear``: the swap the ``"bf16"`` fallback makes, and makes again on resume.

:func:`put_back_to_high_precision` replaces FP8 layers by ``nn.Linear`` layers holding the same parameter objects
(an FP8AdamW gives a weight held at O2 its own storage back), takes their hooks along, and turns an
:class:`~lightning_fp8.FP8MLP` holding one into an :class:`UnfusedMLP`; it refuses, before changing anything, the
layers it cannot replace (DTensor parameters, DistributedDataParallel, an O2 master whose optimizer was not passed).
:func:`fallen_back_layers` names the layers put back, to be saved with a checkpoint. Apart from
:mod:`lightning_fp8.recovery`, which decides when and which layers to put back, because resuming a run uses the swap
alone (the Lightning plugin, the Accelerate checkpoint); the argument checks the two share are here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_fp8.convert import CALL_HOOKS, share_hooks
from lightning_fp8.eligibility import FALLBACK_ATTR, STATE_DICT_HOOKS, is_compiled_wrapper, is_fallen_back
from lightning_fp8.linear import FP8Linear
from lightning_fp8.mlp import FP8MLP
from lightning_fp8.optim import master
from lightning_fp8.optim.shards import is_dtensor
from lightning_fp8.stats import clean_name, wraps_as_module


class UnfusedMLP(nn.Module):
    """``proj(gelu(fc(x)))`` with the layers ``fc`` and ``proj`` as they are: what an :class:`~lightning_fp8.FP8MLP`
    becomes when :func:`put_back_to_high_precision` puts one of its layers back to ``nn.Linear``.

    FP8MLP's fused path needs two FP8Linear layers; this module calls them one after another, as FP8MLP itself does
    where it cannot fuse, with the same GELU (the exact one, ``approximate="none"``; FP8MLP has no dropout). It holds
    the FP8MLP's layer objects: the same parameters, state_dict keys and layer names.
    """

    def __init__(self, fc: nn.Linear, proj: nn.Linear) -> None:
        super().__init__()
        self.fc = fc
        self.proj = proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


def _check_optimizer(where: str, optimizer: object) -> None:
    """Raise unless ``optimizer`` has ``param_groups`` (a torch optimizer, or a wrapper of one such as Lightning's
    or Accelerate's): a list of optimizers, or a string, failed deep inside with an AttributeError."""
    if not isinstance(getattr(optimizer, "param_groups", None), list):
        raise TypeError(
            f"{where}: expected an optimizer (with param_groups, e.g. a torch.optim.AdamW), got "
            f"{type(optimizer).__name__}"
            + ("; pass one optimizer at a time" if isinstance(optimizer, (list, tuple)) else "")
        )


def _check_model(where: str, model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{where}: expected the model (an nn.Module holding the FP8 layers), got {type(model).__name__}"
        )


def fallen_back_layers(model: nn.Module) -> list[str]:
    """The qualified names of the layers of ``model`` that :func:`put_back_to_high_precision` put back to
    ``nn.Linear`` (the ``"bf16"`` fallback), in ``named_modules()`` order.

    Save them with a checkpoint: a model converted afresh has those layers in FP8 again, and its FP8 scaling state
    and optimizer state would not match the checkpoint's.
    """
    return [name for name, module in model.named_modules() if is_fallen_back(module)]


def put_back_to_high_precision(
    model: nn.Module,
    names: Iterable[str],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
) -> list[str]:
    """Replace the FP8 layers ``names`` of ``model`` by ``nn.Linear`` layers that keep the same parameter objects.

    Optimizers keep pointing at the parameters the model uses; an :class:`~lightning_fp8.FP8AdamW` holding a weight
    gives it back its own storage (unscaled, in its original dtype) with fp32 states. The new layer takes over the
    FP8 layer's forward and backward hooks, under every name the FP8 layer had. A layer of an
    :class:`~lightning_fp8.FP8MLP` takes its FP8MLP with it: that becomes an :class:`UnfusedMLP` holding the same
    layers (and the FP8MLP's hooks). Layers already put back are skipped, so a second call does nothing. To resume a
    run whose layers fell back, call it after converting the new model and creating its optimizer, and before loading
    the model's, the optimizer's and the FP8 state.

    Args:
        model: the model (or a module containing the layers); changed in place.
        names: qualified names in ``model``, as :func:`fallen_back_layers` returns them (those of the model under
            another wrapper too: torch.compile's ``_orig_mod.``, a DDP wrapper's ``module.``). The name of a
            ``torch.compile`` wrapper held by the model stands for the layer it compiled.
        optimizer: the optimizer (or a list of them) over the layers' weights; needed where FP8AdamW (O2) keeps a
            weight's master in the weight's storage.

    Returns:
        The names of the layers this call put back.

    Raises:
        ValueError: before anything is changed, when a name is not an FP8 layer inside ``model`` (``model`` itself, or
            a layer of an FP8MLP that is ``model`` itself, cannot be replaced in place), a layer's parameters (or its
            FP8MLP's) are DTensors (FSDP2, tensor parallelism), a weight's storage holds an FP8AdamW master and no
            optimizer was given that holds it, or the model is wrapped by DistributedDataParallel.
        TypeError: when ``model`` is not an ``nn.Module`` or ``optimizer`` is not an optimizer, a list of them or
            None.

    Example (resuming a plain PyTorch run)::

        model = convert_to_fp8(build_model())
        optimizer = FP8AdamW(model.parameters(), grad_scaler=scaler)
        put_back_to_high_precision(model, ckpt["fallen_back_layers"], optimizer)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        load_fp8_state_dict(model, ckpt["fp8"])
    """
    if isinstance(names, str):
        raise TypeError(
            f"put_back_to_high_precision(names={names!r}): expected a list of layer names, got one string (its "
            f"characters would be taken as names): pass [{names!r}]"
        )
    _check_model("put_back_to_high_precision(model=...)", model)
    optimizers = _as_list(optimizer, "put_back_to_high_precision(optimizer=...)")
    modules = dict(model.named_modules())
    # Each name once (dict.fromkeys keeps the order): a name given twice was put back twice and returned twice.
    names = list(dict.fromkeys(_as_layer_names(model, modules, names)))
    names = [name for name in names if not is_fallen_back(modules.get(name))]
    _check_can_put_back(modules, names, optimizers)
    for name in names:
        _swap(model, modules, name, optimizers)
    return names


def _as_layer_names(model: nn.Module, modules: dict[str, nn.Module], names: Iterable[str]) -> list[str]:
    """``names`` as ``model`` names its layers. A name it does not have is matched by its clean name (without the path
    components torch.compile, FSDP1 and activation checkpointing insert, and a DDP or DataParallel wrapper's leading
    ``module.``), as :func:`~lightning_fp8.load_fp8_state_dict` matches the keys of the FP8 state saved beside it: a
    run saved from a compiled model ("_orig_mod.2") resumes in a model compiled after the load ("2"), and back. The name
    of a ``torch.compile`` wrapper held by the model stands for the layer it compiled ("2" for "2._orig_mod")."""
    own: dict[str, str] = {}
    strip = wraps_as_module(model)
    for key in modules:
        own.setdefault(clean_name(key, strip_module=strip), key)
    found = []
    for name in names:
        if isinstance(name, str) and name not in modules:
            name = own.get(clean_name(name, strip_module=False), own.get(clean_name(name, strip_module=True), name))
        while name and is_compiled_wrapper(modules.get(name)):
            name = f"{name}._orig_mod"
        found.append(name)
    return found


def _as_list(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None, where: str
) -> list[torch.optim.Optimizer]:
    """``optimizer`` (one, a sequence of them, or None) as a list; raises naming ``where`` for anything else."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "param_groups"):
        return [optimizer]
    if isinstance(optimizer, (str, bytes, Mapping)) or not isinstance(optimizer, Iterable):
        # a string's characters, a dict's keys are no optimizers
        raise TypeError(f"{where}: expected an optimizer, a list of optimizers or None, got {type(optimizer).__name__}")
    optimizers = list(optimizer)
    for opt in optimizers:
        _check_optimizer(where, opt)
    return optimizers


def _mlps_holding(model: nn.Module, layer: nn.Module) -> list[FP8MLP]:
    """Every FP8MLP of ``model`` that holds ``layer``, under any name: a layer shared with another module
    (``self.extra = mlp.fc``) is named after that module first, which is not its FP8MLP."""
    return [m for m in model.modules() if isinstance(m, FP8MLP) and any(c is layer for c in m._modules.values())]


def _holds(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> bool:
    return any(p is param for group in optimizer.param_groups for p in group["params"])


def _under_ddp(weight: torch.Tensor) -> bool:
    """Whether DistributedDataParallel may hook ``weight``'s gradients: it needs a process group, and its reducer
    holds the weight's gradient accumulator (:func:`~lightning_fp8.optim.master.accumulator_held`). A graph still
    referenced (the loss in the caller's scope) holds it too: a process group of more than one rank tells a
    single-process run apart (also one that initialized torch.distributed with one rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return False
    return master.accumulator_held(weight)


def _check_can_put_back(
    modules: dict[str, nn.Module], names: list[str], optimizers: list[torch.optim.Optimizer]
) -> None:
    """Raise ValueError if one of the layers ``names`` cannot be put back; checks all of them before any changes."""
    # The root ("") cannot be replaced in place: only a layer inside the model can.
    unknown = [name for name in names if not name or not isinstance(modules.get(name), FP8Linear)]
    if unknown:
        raise ValueError(
            f"put_back_to_high_precision: {', '.join(map(repr, unknown))} is not an FP8Linear inside the model (its "
            "FP8 layers are fp8_modules(model)); pass names from fallen_back_layers() of a model structured like this "
            "one. Nothing was changed"
        )
    holders = {name: _mlps_holding(modules[""], modules[name]) for name in names}  # the FP8MLPs each takes with it
    in_root = [name for name in names if any(mlp is modules[""] for mlp in holders[name])]
    if in_root:
        raise ValueError(
            f"put_back_to_high_precision: {', '.join(map(repr, in_root))} is a layer of the FP8MLP that is the model "
            "itself, which would have to become an UnfusedMLP (FP8MLP's fused path needs two FP8 layers) and cannot be "
            "replaced in place; pass a module containing it (e.g. nn.Sequential(mlp)) as the model, or use "
            "nonfinite_fallback='lower_lr'. Nothing was changed"
        )
    prefix = "FP8GradScaler(nonfinite_fallback='bf16') cannot put"
    sharded = [name for name in names if any(is_dtensor(p) for m in (modules[name], *holders[name])
                                             for p in m.parameters())]  # fmt: skip
    if sharded:
        raise ValueError(
            f"{prefix} {', '.join(map(repr, sharded))} back to nn.Linear: their parameters are DTensors (fully_shard "
            "or tensor parallelism), whose hooks keep references to the FP8 modules, so a new module would get "
            "sharded weights. Nothing was changed; use nonfinite_fallback='lower_lr' (or a callable) for sharded models"
        )
    weights = {name: modules[name].weight for name in names}
    orphaned = [name for name, w in weights.items() if master.master_scale(w) is not None
                and not any(hasattr(opt, "release") and _holds(opt, w) for opt in optimizers)]  # fmt: skip
    if orphaned:
        raise ValueError(
            f"cannot put {', '.join(map(repr, orphaned))} back to nn.Linear: the weight's storage holds the scaled "
            "master of an FP8AdamW (O2) that was not passed; pass that optimizer (optimizer=...). Nothing was changed"
        )
    # At O2 the weight would get its own dtype back from FP8AdamW's fp16 master, and with it a new gradient
    # accumulator: DDP's reducer hooks the old one, so the weight's gradients would silently no longer be averaged
    # (DDP fails an iteration later). At any level, DDP broadcasts the buffers it found when it wrapped the model,
    # and fails once the FP8 layers' scaling buffers were all removed.
    hooked = [name for name, w in weights.items() if _under_ddp(w)]
    if hooked:
        raise ValueError(
            f"{prefix} {', '.join(map(repr, hooked))} back to nn.Linear under DistributedDataParallel, which hooked "
            "the model's parameters and buffers when it wrapped it: at O2 the weight would get its own dtype back "
            "(FP8AdamW keeps an fp16 master in its storage) and DDP would silently stop averaging its gradients. "
            "Nothing was changed; use nonfinite_fallback='lower_lr' (or a callable) under DDP"
        )


def _swap(model: nn.Module, modules: dict[str, nn.Module], name: str, optimizers: list[torch.optim.Optimizer]) -> None:
    """Put the FP8 layer ``name`` back to an ``nn.Linear`` holding its parameter objects, marked as fallen back; an
    FP8MLP holding it becomes an :class:`UnfusedMLP`."""
    layer = modules[name]
    mlps = _mlps_holding(model, layer)
    for optimizer in optimizers:
        if hasattr(optimizer, "release") and _holds(optimizer, layer.weight):
            optimizer.release(layer.weight)
    # An FP8AdamW created later must treat the weight as an ordinary parameter (not keep its master in its storage).
    setattr(layer.weight, master.MARKER, False)
    linear = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(linear)
    linear.in_features, linear.out_features = layer.in_features, layer.out_features
    linear.register_parameter("weight", layer.weight)
    linear.register_parameter("bias", layer.bias)  # registered when None too, as nn.Linear(bias=False) does
    linear.train(layer.training)
    share_hooks(layer, linear)  # not its state_dict hooks: FP8Linear's own, for the O2 master it no longer has
    setattr(linear, FALLBACK_ATTR, True)
    _replace(model, layer, linear)
    modules[name] = linear
    for parent in mlps:  # each FP8MLP holding the layer (under any of its names) runs its layers one by one now
        unfused = UnfusedMLP(parent.fc, parent.proj)
        unfused.train(parent.training)
        share_hooks(parent, unfused, CALL_HOOKS + STATE_DICT_HOOKS)
        _replace(model, parent, unfused)
        for key in [key for key, module in modules.items() if module is parent]:
            modules[key] = unfused


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put ``new`` in place of ``old`` under every name ``old`` has in ``model`` (named_modules() gives only the first
    one of a module registered under several)."""
    for parent in list(model.modules()):
        for key, child in list(parent._modules.items()):
            if child is old:
                setattr(parent, key, new)
                if key == "_orig_mod" and is_compiled_wrapper(parent):  # torch.compile(old) held by the model: its
                    # forward is the compiled call of the module it was built from; bind it to the new one, as its
                    # constructor does (else the old FP8 layer kept running)
                    parent._initialize()
