"""The setups FP8LMPrecision refuses before any training step, each with an error that says what to use instead.

Each of them could only fail later, or train wrongly without a word: Lightning Fabric calling the plugin (its
backward and step hooks need a Trainer), Lightning's weight-averaging callbacks at O2 (they would average the fp16
masters times a changing scale), ModelPruning of layers the conversion replaced (its masks never reach the FP8
layers), and ``FP8GradScaler(nonfinite_fallback="bf16")`` under DDP or FSDP (putting layers back is refused there).
:mod:`~lightning_fp8.integrations.lightning.precision` calls them from ``convert_module`` and ``connect``.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

# Where the code calling the plugin's hooks lives, in either namespace: the Trainer's strategies, or Fabric.
_TRAINER_PACKAGES = ("lightning.pytorch.", "pytorch_lightning.")
_FABRIC_PACKAGES = ("lightning.fabric.", "lightning_fabric.")
# Lightning's callbacks that average ``module.parameters()`` (by class name, across Lightning versions: the
# ``WeightAveraging`` base and its ``EMAWeightAveraging`` came with Lightning 2.6).
_AVERAGING_CALLBACKS = ("StochasticWeightAveraging", "WeightAveraging")


def fabric_unsupported(what_to_drop: str) -> str:
    """The message of every Fabric refusal: the plugin needs a Trainer; ``what_to_drop`` says which argument."""
    return (
        "FP8LMPrecision is a plugin for the Lightning Trainer (Trainer(precision='fp8-lm') or "
        "Trainer(plugins=[FP8LMPrecision()])); Lightning Fabric is not supported: its backward and step hooks need "
        f"a Trainer. {what_to_drop} and use the plain-PyTorch API in your Fabric loop: "
        "lightning_fp8.convert_to_fp8(model), FP8AdamW and FP8GradScaler (docs/guides/pytorch.md)"
    )


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
            raise TypeError(fabric_unsupported("Drop it from Fabric(plugins=...)"))
        frame = frame.f_back


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
            "weights keep their own storage; an FP8AdamW of your own from configure_optimizers needs "
            "opt_level='O1' too, or recipe='fp8-lm-o1'), or average the unscaled weights of model.state_dict() in a "
            "callback of your own"
        )


def _refuse_averaging_with_weight_copies(module: nn.Module | None, optimizers: list[Any]) -> None:
    """Raise ValueError if the Trainer has one of Lightning's ``WeightAveraging`` callbacks (``EMAWeightAveraging``)
    while an FP8AdamW writes FP8 copies of the weights (``emit_fp8_weights=True``): the callback swaps the averaged
    weights in through ``param.data``, which the copies' validity check cannot see (lightning_fp8/weight_cache.py), so
    the evaluation forwards computed with the copies of the current weights, silently. (StochasticWeightAveraging
    writes through the parameters, which the check sees.)"""
    averaging = _callbacks_of(module, ("WeightAveraging",))
    emitting = [o for o in optimizers if getattr(o, "emit_fp8_weights", False) is True]
    if averaging and emitting:
        raise ValueError(
            f"precision='fp8-lm' cannot run {type(averaging[0]).__name__} with an FP8AdamW(emit_fp8_weights=True): "
            "the callback swaps the averaged weights in through param.data, which the FP8 weight copies the optimizer "
            "writes for the next forwards do not follow, so evaluation would use the current weights' copies. Create "
            "the FP8AdamW with emit_fp8_weights=False (the default)"
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
        gone = list({id(m): m for m in gone}.values())  # a layer per (module, "weight"), (module, "bias") pair: once
        if gone:
            raise ValueError(
                f"precision='fp8-lm' cannot run {type(callback).__name__} on layers it converts to FP8Linear (here "
                f"{gone[0]!r} and {len(gone) - 1} more): the callback collected them before the conversion, so its "
                "masks would never reach the FP8 layers. Leave the layers to prune in high precision "
                "(FP8LMPrecision(module_filter_fn=...) returning False for them) in a module built afresh (this one's "
                "layers are FP8 layers now), or prune before training"
            )
