"""The setups the FP8-LM ``Accelerator`` refuses, each before anything is converted or swapped, with an error that
says what to do instead.

Each of them could only fail later, or train wrongly without a word: ``mixed_precision`` ``"fp16"``/``"fp8"`` and
the distributed types FP8-LM does not support (DeepSpeed, Megatron-LM, XLA, FSDP1), and FSDP asked for where
Accelerate set up something else (the CPU); a ``GradScalerKwargs`` handler
(the fp16 scaler's settings, which mu would ignore); a second optimizer or a second
gradient scaler (one gradient scale mu scales the loss and unscales the gradients); an optimizer prepared before
the model, or an FP8AdamW (O2) that took the model's linear weights for ordinary parameters before they became FP8
weights; an FP8AdamW (O2) prepared after DDP wrapped its model; the ``"bf16"`` fallback with a prepared model that is
itself an FP8 layer; clipping that would miss gradients held in FP8; and a collective over FP8AdamW's scaled fp16
masters (LocalSGD's average of ``param.data``).
:mod:`~lightning_fp8.integrations.accelerate.accelerator` calls them from ``__init__`` and ``prepare*``,
:mod:`~lightning_fp8.integrations.accelerate.gradients` from ``backward`` and the clipping methods.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from accelerate.utils import DistributedType
from torch import nn

from lightning_fp8.integrations.accelerate import conversion, tensor_parallel
from lightning_fp8.integrations.accelerate.config import ENV_RECIPE, FP8LaunchConfig
from lightning_fp8.linear import FP8Linear
from lightning_fp8.mlp import FP8MLP
from lightning_fp8.optim import FP8AdamW, master
from lightning_fp8.optim.shards import is_dtensor


def is_fresh_optimizer(obj: Any) -> bool:
    """Whether ``obj`` is an optimizer Accelerate has not prepared yet (one prepare may swap for FP8AdamW)."""
    return isinstance(obj, torch.optim.Optimizer) and not getattr(obj, "_is_accelerate_prepared", False)


def check_mixed_precision(mixed_precision: Any) -> None:
    """Raise ValueError for ``mixed_precision`` ``"fp16"`` or ``"fp8"``."""
    value = str(getattr(mixed_precision, "value", mixed_precision)).lower()  # a string or a PrecisionType
    if value in ("fp16", "fp8"):
        raise ValueError(
            f"mixed_precision={value!r} cannot be combined with FP8-LM: 'fp16' brings a second loss "
            "scaler and 'fp8' selects Accelerate's own FP8 backends. Use mixed_precision 'bf16' (the usual FP8-LM "
            f"setting) or 'no', with the recipe from {ENV_RECIPE} / `lightning-fp8 launch`"
        )


def check_mixed_precision_argument(mixed_precision: Any) -> None:
    """:func:`check_mixed_precision` in Accelerate's own order: the argument, else ``ACCELERATE_MIXED_PRECISION`` (an
    ``accelerate launch --mixed_precision``), named in the error."""
    try:
        check_mixed_precision(mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION"))
    except ValueError as err:
        if mixed_precision:
            raise
        raise ValueError(f"{err} (set by the environment variable ACCELERATE_MIXED_PRECISION)") from None


# Accelerate's recipes of its own FP8 backends (those its version has): with FP8-LM they would configure a backend that
# does not run. Accelerate refuses them without mixed_precision="fp8" except under FSDP and DeepSpeed.
_FP8_BACKEND_HANDLERS = ("AORecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs", "FP8RecipeKwargs")


def check_kwargs_handlers(handlers: Any) -> None:
    """Raise ValueError for a ``GradScalerKwargs`` among ``handlers`` (``Accelerator(kwargs_handlers=...)``): it
    configures the ``torch.amp.GradScaler`` of ``mixed_precision="fp16"``, while FP8-LM scales the loss by its own
    gradient scale mu, which would otherwise ignore the settings without a word. Also for a recipe of Accelerate's own
    FP8 backends (``AORecipeKwargs``, ``TERecipeKwargs``, ...), which FP8-LM replaces."""
    import accelerate.utils as utils
    from accelerate.utils import GradScalerKwargs

    backends = tuple(getattr(utils, name) for name in _FP8_BACKEND_HANDLERS if hasattr(utils, name))
    recipes = [h for h in handlers or () if isinstance(h, backends)]
    if recipes:
        raise ValueError(
            f"Accelerator(kwargs_handlers=[{recipes[0]!r}]): {type(recipes[0]).__name__} configures one of "
            "Accelerate's own FP8 backends (mixed_precision='fp8'), which FP8-LM replaces: its settings would be "
            f"ignored. Drop it and set the FP8-LM recipe (fp8_lm_recipe=..., {ENV_RECIPE}), or train with "
            f"Accelerate's backend ({ENV_RECIPE}=none and mixed_precision='fp8')"
        )
    given = [h for h in handlers or () if isinstance(h, GradScalerKwargs)]
    if given:
        raise ValueError(
            f"Accelerator(kwargs_handlers=[{given[0]!r}]): GradScalerKwargs configures the fp16 GradScaler, which "
            "FP8-LM replaces by its own gradient scale mu (FP8GradScaler), so its settings would be ignored. Drop it; "
            "to set mu's init_scale or growth_interval, prepare an FP8AdamW built with "
            "grad_scaler=FP8GradScaler(init_scale=..., growth_interval=...) (docs/accelerate.md, "
            f"accelerator.fp8_grad_scaler), or train without FP8-LM ({ENV_RECIPE}=none)"
        )


def check_supported(mixed_precision: Any, distributed_type: DistributedType, is_fsdp2: bool, tp_enabled: bool) -> None:
    """Raise ValueError for an Accelerator set up (by its arguments or an Accelerate config file) in a way FP8-LM
    does not support: ``mixed_precision`` ``"fp16"``/``"fp8"``, DeepSpeed, Megatron-LM, XLA, FSDP1, or tensor
    parallelism combined with FSDP2 in a way :func:`tensor_parallel.check_fsdp2_combination` refuses."""
    check_mixed_precision(mixed_precision)  # e.g. from an Accelerate config file
    unsupported = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)
    if distributed_type in unsupported:
        raise ValueError(
            f"FP8-LM under Accelerate supports single process, DDP and FSDP2, not {distributed_type.value}: "
            f"launch without it, or set {ENV_RECIPE}=none"
        )
    if distributed_type == DistributedType.FSDP and not is_fsdp2:
        raise ValueError("FP8-LM under Accelerate supports FSDP2 only: set `fsdp_version: 2` in the fsdp_config")
    if tp_enabled:
        tensor_parallel.check_fsdp2_combination(is_fsdp2)


def check_fsdp_set_up(distributed_type: DistributedType, is_fsdp2: bool, device: torch.device) -> None:
    """Raise ValueError if the launch asked for FSDP (an ``fsdp_plugin``, or ``distributed_type: FSDP`` in the config
    file: ``ACCELERATE_USE_FSDP``) on several processes and Accelerate set up something else. Accelerate runs FSDP on
    CUDA devices only and otherwise goes on without a word: on the CPU the model trained unsharded under DDP, or (a
    GPU config launched where there is no GPU) each process trained on its own. Called from ``prepare``, so that a
    process state switched to FSDP after the Accelerator was built (the CPU tests) counts."""
    asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    processes = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if not asked or is_fsdp2 or distributed_type == DistributedType.FSDP or processes < 2:
        return
    raise ValueError(
        f"the launch asked for FSDP (fsdp_plugin=..., or distributed_type: FSDP in the Accelerate config), but "
        f"Accelerate set up {distributed_type.value} on {device.type} ({processes} processes): it runs FSDP on CUDA "
        "devices only, so the model would not be sharded. Launch on GPUs, or drop the FSDP settings to train with "
        "DDP on the CPU (distributed_type: MULTI_CPU, or `lightning-fp8 launch --cpu --num_processes N`). "
        "Nothing was converted"
    )


def check_model_prepared(optimizer: torch.optim.Optimizer, models: list[nn.Module]) -> None:
    """Raise ValueError if no model was prepared before ``optimizer`` (``models``: the FP8 models prepared so far)."""
    if not models:  # FP8AdamW would keep fp32 states, and the scaler would not know the model
        raise ValueError(
            f"accelerator.prepare({type(optimizer).__name__}) before the model: FP8-LM converts the model's linear "
            "layers first and builds the FP8 optimizer and its gradient scaler on them. Prepare the model first "
            "(accelerator.prepare(model), then the optimizer) or both together (accelerator.prepare(model, "
            "optimizer))"
        )


def check_one_optimizer(args: tuple[Any, ...], prepared_before: torch.optim.Optimizer | None) -> None:
    """Raise ValueError, before anything of ``args`` is converted or swapped, if they would make a second
    optimizer besides each other or ``prepared_before`` (the optimizer an earlier prepare made, if any): one gradient
    scale mu steps one optimizer (a second one prepared in the same call was found only after the model had been
    converted and the first optimizer replaced)."""
    fresh = [type(obj).__name__ for obj in args if is_fresh_optimizer(obj)]
    if prepared_before is not None:
        fresh.insert(0, f"{type(prepared_before).__name__} (prepared before)")
    if len(fresh) > 1:
        raise ValueError(
            f"FP8-LM under Accelerate trains with one optimizer (one gradient scale mu), got {', '.join(fresh)}: "
            "put all parameters in param groups of a single AdamW (a GAN too: generator and discriminator as two "
            "groups, optimizer.zero_grad() before each backward, the other model frozen with requires_grad_(False) "
            "during each model's step). Nothing was converted"
        )


def check_scaler(args: tuple[Any, ...], grad_scaler: Any | None) -> None:
    """Raise ValueError, before anything of ``args`` is converted or swapped, if an FP8AdamW among them brought a
    gradient scaler (``grad_scaler=``) other than the accelerator's (``grad_scaler``), or two FP8AdamW brought
    different ones: one gradient scale mu scales the loss and unscales the gradients. With no accelerator scaler yet,
    the FP8AdamW's own one is adopted (``Accelerator._fp8_swap``)."""
    scalers = [] if grad_scaler is None else [grad_scaler]
    for obj in args:
        own = getattr(obj, "grad_scaler", None) if isinstance(obj, FP8AdamW) else None
        if own is not None and not any(own is s for s in scalers):
            scalers.append(own)
    if len(scalers) > 1:
        raise ValueError(
            "FP8-LM under Accelerate scales the loss by one gradient scaler, and the FP8AdamW passed to prepare "
            "brought another one (grad_scaler=) than the accelerator's (accelerator.fp8_grad_scaler, or that of an "
            "FP8AdamW prepared before): create the FP8AdamW without grad_scaler= (it then reports to the "
            "accelerator's), or share one FP8GradScaler. Nothing was converted"
        )


def check_before_optimizer(
    models: list[nn.Module],
    *,
    optimizers: list[torch.optim.Optimizer],
    prepared_models: list[nn.Module],
    config: FP8LaunchConfig,
    user_filter: conversion.ModuleFilter | None,
) -> None:
    """Raise ValueError, before any of ``models`` is converted, if an FP8AdamW (O2) of an earlier prepare
    (``optimizers``) trains weights of their linear layers: it took them for ordinary parameters, and once they become
    FP8 weights it would keep training them with fp32 states and no fp16 master, without a word (as an FP8AdamW built
    before the conversion would: :func:`check_built_after_conversion`). Only the layers the conversion will convert
    count (:func:`conversion.to_convert` with ``config`` and ``user_filter``): one it leaves in high precision (its
    sizes, a tied weight, the filters) trains as before, and so do the weights of ``prepared_models`` (the FP8 models
    prepared already)."""
    held = {id(p) for opt in optimizers if isinstance(opt, FP8AdamW) and opt.opt_level == "O2"
            for group in opt.param_groups for p in group["params"] if p not in opt._low_precision}  # fmt: skip
    # The weights of the models prepared already are known to the optimizer as they are (e.g. a high-precision
    # head, or the same model prepared again).
    held -= {id(p) for model in prepared_models for p in model.parameters()}
    if not held:
        return
    for model in models:
        layers = conversion.to_convert(model, config, user_filter)
        late = [name for name, m in layers.items() if id(m.weight) in held]
        if late:
            raise ValueError(
                f"accelerator.prepare({type(model).__name__}) after the optimizer that trains it: the FP8AdamW "
                f"that an earlier prepare built took the weights of its linear layers {late[:5]} for ordinary "
                "parameters, so those that prepare makes FP8 weights would train with fp32 states and no fp16 "
                "master. Prepare every model the optimizer trains before the optimizer or in the same call "
                "(accelerator.prepare(model1, model2, optimizer)). Nothing was converted"
            )


def check_built_after_conversion(optimizer: FP8AdamW) -> None:
    """Raise ValueError if ``optimizer`` (O2) was built before the model's linear layers became FP8 (prepare converts
    them): it took their weights for ordinary parameters, and would train them with fp32 states and no fp16 master,
    without a word."""
    if optimizer.opt_level != "O2":  # O1 gives every parameter fp32 states: the FP8 weights differ by no state
        return
    missed = [
        p for group in optimizer.param_groups for p in group["params"]
        if master.is_fp8_weight(p) and p not in optimizer._low_precision
    ]  # fmt: skip
    if missed:
        raise ValueError(
            f"accelerator.prepare got an FP8AdamW built before the model's conversion: {len(missed)} of its "
            "parameters became FP8 weights afterwards (the first of shape "
            f"{tuple(missed[0].shape)}), which it keeps with fp32 states instead of O2's. Build it after "
            "convert_to_fp8(model) or after accelerator.prepare(model), or pass a torch.optim.AdamW, which prepare() "
            "replaces with an FP8AdamW"
        )


def check_not_after_ddp(optimizers: list[torch.optim.Optimizer], ddp_weights: set[int], opt_level: str) -> None:
    """Raise ValueError, before anything changes, if an optimizer to become FP8AdamW (O2) trains FP8 weights of a
    model an earlier ``prepare`` wrapped in DDP (``ddp_weights``: their ids): taking over their storage as fp16
    masters would detach DDP's gradient hooks (FP8AdamW refuses it, with advice for plain PyTorch; here the fix is the
    prepare call). ``opt_level`` is the recipe's, for the optimizers that are not FP8AdamW yet."""
    if not ddp_weights:
        return
    for optimizer in optimizers:
        level = optimizer.opt_level if isinstance(optimizer, FP8AdamW) else opt_level
        params = (p for group in optimizer.param_groups for p in group["params"])
        if level == "O2" and any(id(p) in ddp_weights for p in params):
            raise ValueError(
                f"accelerator.prepare({type(optimizer).__name__}) under DDP after the model it trains was prepared "
                "in an earlier call: at O2 FP8AdamW keeps each FP8 weight's fp16 master in the weight's own "
                "storage, which has to happen before DDP wraps the model. Prepare the model and its optimizer in "
                "the same call: model, optimizer = accelerator.prepare(model, optimizer). Nothing was changed"
            )


def check_fallback(grad_scaler: Any, models: list[nn.Module]) -> None:
    """Raise ValueError if the scaler's ``"bf16"`` fallback could put back a prepared model itself.

    With several ``models`` it searches the container of ``Accelerator._fp8_scaler_model``, where a model that is
    itself an FP8 layer (or FP8MLP, which would become an UnfusedMLP) would be replaced in the container only: the
    script would train on with the FP8 module the fallback released. With one model the fallback refuses it itself.
    """
    if grad_scaler.nonfinite_fallback != "bf16" or len(models) < 2:
        return
    roots = [f"model{i} ({type(m).__name__})" for i, m in enumerate(models)
             if isinstance(m, (FP8Linear, FP8MLP))]  # fmt: skip
    if roots:
        raise ValueError(
            f"FP8GradScaler(nonfinite_fallback='bf16') cannot put back {', '.join(roots)}: a prepared model that "
            "is itself an FP8Linear or FP8MLP cannot be replaced in place (your script holds that object). Wrap "
            "it in a module before accelerator.prepare (e.g. nn.Sequential(layer)), or set the scaler's "
            "nonfinite_fallback to 'lower_lr'. Nothing was changed"
        )


def check_clippable(optimizer: torch.optim.Optimizer | None, caller: str) -> None:
    """Raise if the prepared FP8AdamW (``optimizer``) holds FP8 weights' gradients outside ``param.grad``
    (``fp8_grads=True``, a user's own optimizer): ``caller`` (clipping by value, unscaling) would miss them."""
    if getattr(optimizer, "holds_fp8_grads", False):
        raise ValueError(
            f"{caller} would miss the FP8 weights' gradients, which the prepared "
            "FP8AdamW holds in FP8 (fp8_grads=True: they leave param.grad as soon as they are computed; "
            "accelerator.clip_grad_norm_ clips them too): create it with fp8_grads=False (or pass a torch AdamW, "
            "which prepare() swaps with fp8_grads=False)"
        )


def check_not_masters(tensors: Any, optimizer: torch.optim.Optimizer | None, caller: str) -> None:
    """Raise if a tensor of ``tensors`` (nested as Accelerate's collectives take them) is the storage of a weight that
    the prepared FP8AdamW (``optimizer``, O2) holds as a scaled fp16 master: its values are not the weight's (summed
    over ranks they overflow fp16; each rank has its own scale). ``accelerate.local_sgd.LocalSGD`` averages
    ``param.data`` so."""
    if optimizer is None:
        return
    masters = {p.data_ptr(): p for group in optimizer.param_groups for p in group["params"]
               if master.master_scale(p) is not None and not is_dtensor(p)}  # fmt: skip
    if not masters:
        return
    leaves = [t for t in torch.utils._pytree.tree_leaves(tensors) if isinstance(t, torch.Tensor) and not is_dtensor(t)]
    held = next((masters[t.data_ptr()] for t in leaves if not t.is_meta and t.data_ptr() in masters), None)
    if held is not None:
        raise ValueError(
            f"{caller}: a tensor given is the storage of an FP8 weight of shape {tuple(held.shape)}, which FP8AdamW "
            "(O2) holds as its fp16 master times a scale (not the weight's values; accelerate's LocalSGD averages "
            "param.data so). Reduce the weights of accelerator.get_state_dict(model) instead, or train with the "
            "fp8-lm-o1 recipe (O1 keeps the true weights in the parameters) to use LocalSGD. Nothing was reduced"
        )
