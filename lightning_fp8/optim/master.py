"""Master weights of FP8 linear layers kept in the parameter's own storage (O2: fp16 with a power-of-two scale).

At O2 the optimizer owns the master weight, and the model's parameter would otherwise keep a second
(fp32) copy. Instead the parameter's storage *becomes* the master: ``param.data`` holds ``w * scale`` in
fp16, and the 0-dim fp32 ``scale`` hangs on the parameter (attribute :data:`SCALE_ATTR`). FP8Linear folds
``1 / scale`` into its weight cast (exact: a power of two), and its state_dict hooks (below) export and
import the unscaled weight in the dtype the model had (:mod:`~lightning_fp8.optim.master_layer`), so checkpoints and
``model.state_dict()`` never see the scaled storage.

A parameter is an FP8 linear weight when :class:`~lightning_fp8.FP8Linear` marked it (:data:`MARKER`).
Such a weight must be used only by its FP8 layer: a weight tied to another module (an embedding) would
read the scaled storage; :func:`~lightning_fp8.convert_to_fp8` keeps tied heads out with a filter.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import prune

from lightning_fp8 import ops
from lightning_fp8.scale_rule import compute_scale

MARKER = "_lightning_fp8_weight"  # set by FP8Linear on its weight
SCALE_ATTR = "_lightning_fp8_master_scale"  # 0-dim fp32: the parameter's storage holds weight * scale
AMAX_ATTR = "_lightning_fp8_master_amax"  # 0-dim fp32: max |weight| of the stored value
DTYPE_ATTR = "_lightning_fp8_dtype"  # the dtype the weight had before the optimizer took its storage
# The SCALE_ATTR tensor, also in the __dict__ of the FP8 layers that marked the weight: torch.export (non-strict)
# traces the forward with stand-ins for the parameters, which carry no attributes; the layer's forward reads it there.
LAYER_SCALE_ATTR = "_lightning_fp8_weight_master_scale"

FP16_MAX = 65504.0

# How many FP8 layers FP8Linear.from_linear (so convert_to_fp8) has made of existing layers. FP8AdamW compares it with
# the count it last saw (one int per step) and only when it changed looks for parameters that became FP8 weights after
# it took them in as plain ones (adoption._Adoption._check_not_converted_since): states made for a plain parameter,
# trained without a word.
conversions = 0


def note_conversion() -> None:
    """Count one FP8 layer made of an existing ``nn.Linear`` (see :data:`conversions`)."""
    global conversions
    conversions += 1


def is_fp8_weight(param: torch.Tensor) -> bool:
    """Whether ``param`` is the weight of an FP8Linear (marked by the layer)."""
    return bool(getattr(param, MARKER, False))


def _marking_layers(param: torch.Tensor) -> list[nn.Module]:
    """The live FP8Linear layers that marked ``param`` (FSDP2's and TP's marks, ``True``, name none)."""
    layers = getattr(getattr(param, MARKER, None), "layers", None)
    return layers() if callable(layers) else []


def layer_recipes(params: Iterable[torch.Tensor]) -> list[Any]:
    """The recipes of the live FP8Linear layers that marked any of ``params`` (FSDP2's and TP's marks name none)."""
    return [layer.recipe for param in params for layer in _marking_layers(param)]


def check_not_reparametrized(param: torch.Tensor, where: str) -> None:
    """Raise ValueError if an FP8Linear that marked ``param`` now computes its weight from it: reparametrized after the
    conversion (``torch.nn.utils.parametrize``, pruning, ``spectral_norm``), the layer holds ``param`` under another
    name (``parametrizations.weight.original``, ``weight_orig``) and the marker stays on it. FP8Linear's forward
    refuses such a layer; at O2 the optimizer would first make ``param``'s storage a scaled fp16 master, read by the
    reparametrization as the weight. ``where`` names ``param`` in the message."""
    for layer in _marking_layers(param):
        if layer._parameters.get("weight") is param:
            continue
        name = next((name for name, p in layer.named_parameters() if p is param), None)
        if name is None:
            continue  # the layer's weight was replaced: param is no longer the layer's
        layer_name = f"FP8Linear(in_features={layer.in_features}, out_features={layer.out_features})"
        if any(isinstance(hook, prune.BasePruningMethod) for hook in layer._forward_pre_hooks.values()):
            what = "was pruned after the conversion (torch.nn.utils.prune): pruning of FP8 layers is not supported"
            fix = (
                "make the pruning permanent before creating the optimizer (torch.nn.utils.prune.remove(layer, "
                "'weight'): the mask is applied once and not kept during training), or keep the layer out of FP8: "
                "prune the nn.Linear before convert_to_fp8, which leaves it in high precision (or leave it out with "
                "module_filter_fn)"
            )
        else:
            what = (
                "was reparametrized after the conversion (torch.nn.utils.parametrize, spectral_norm): FP8 layers do "
                "not support a weight computed from other parameters"
            )
            fix = (
                "remove the reparametrization before creating the optimizer (torch.nn.utils.parametrize."
                "remove_parametrizations(layer, 'weight')), or keep the layer out of FP8: reparametrize the nn.Linear "
                "before convert_to_fp8, which leaves it in high precision (or leave it out with module_filter_fn)"
            )
        raise ValueError(
            f"FP8AdamW got {where}, the parameter {name!r} of shape {tuple(param.shape)} of {layer_name}, whose weight "
            f"is computed from it: the layer {what} (its forward refuses it). To train it, {fix}; nothing was changed"
        )


def master_scale(param: torch.Tensor) -> torch.Tensor | None:
    """The scale of a parameter whose storage is an fp16 master, else ``None``."""
    return getattr(param, SCALE_ATTR, None)


def forward_master_scale(weight: torch.Tensor, owner: str, layer: nn.Module | None = None) -> torch.Tensor | None:
    """:func:`master_scale` for an FP8 layer's forward: refuses a scale left on another device than its weight, which
    the module's ``to()``/``to_empty()`` after the FP8AdamW that adopted the weight leaves behind (the cast would read
    it there, or fail deep inside). Under torch.export, whose stand-ins for the parameters carry no attributes, the
    scale is ``layer``'s copy of the reference (:data:`LAYER_SCALE_ATTR`): the exported program computes with the
    weight, not with its scaled fp16 storage."""
    scale = getattr(weight, SCALE_ATTR, None)
    if scale is None and layer is not None and torch.compiler.is_exporting():
        scale = layer.__dict__.get(LAYER_SCALE_ATTR)
    if scale is not None and scale.device != weight.device:
        raise RuntimeError(
            f"{owner}: the weight of shape {tuple(weight.shape)} is on {weight.device} but its fp16 master's scale "
            f"(set by the FP8AdamW that holds it at O2) is on {scale.device}: the module was moved or materialized "
            "(to(), to_empty() from the meta device) after that optimizer was created, whose states stayed where they "
            "were. Create FP8AdamW after moving or materializing the model (to_empty() + "
            "reset_parameters(), then the optimizer)"
        )
    return scale


def quantize_fp16(w: torch.Tensor, prev_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """``(w * scale)`` in fp16 with the power-of-two scale of ``max|w|``: returns ``(w_fp16, scale, amax)``."""
    w32 = w.detach().float()
    amax = ops.amax(w32)
    scale = compute_scale(amax, torch.float16, prev_scale=prev_scale)
    return (w32 * scale).clamp(-FP16_MAX, FP16_MAX).to(torch.float16), scale, amax


def adopt(param: nn.Parameter, master_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Make ``param``'s storage the master weight in ``master_dtype``; return its ``(scale, amax)`` (shared).

    fp16 storage is scaled; other dtypes (bf16) are stored unscaled with scale 1. Any existing gradient is
    dropped here (it has the old dtype); FP8AdamW's takeover hands it back (``_adopt``).

    Raises:
        RuntimeError: when the dtype would change under a wrapper that hooked the parameter's gradient accumulator
            (:func:`check_adoptable`); nothing is changed then.
    """
    if param.dtype != master_dtype:
        check_adoptable(param)
    # Not inference tensors when the optimizer is built under torch.inference_mode(): training updates the storage and
    # the scale in place, which torch refuses for inference tensors outside inference mode.
    with torch.inference_mode(False), torch.no_grad():
        original = param.dtype
        if master_dtype == torch.float16:
            data, scale, amax = quantize_fp16(param)
        else:
            data = param.detach().to(master_dtype)
            scale = torch.ones((), dtype=torch.float32, device=param.device)
            amax = ops.amax(data.float())
        param.grad = None
        param.data = data
    setattr(param, SCALE_ATTR, scale)
    setattr(param, AMAX_ATTR, amax)
    setattr(param, DTYPE_ATTR, original)
    for layer in _marking_layers(param):
        track_layer_scale(layer, param)
    return scale, amax


def track_layer_scale(layer: nn.Module, weight: torch.Tensor | None) -> None:
    """``layer``'s copy of the reference to its weight's master scale (:data:`LAYER_SCALE_ATTR`), for a weight
    registered anew: the new weight's scale, or none (a stale one would unscale another weight under torch.export)."""
    scale = None if weight is None else master_scale(weight)
    if scale is None:
        layer.__dict__.pop(LAYER_SCALE_ATTR, None)
        HELD_WEIGHTS.pop(layer, None)
    else:
        layer.__dict__[LAYER_SCALE_ATTR] = scale
        HELD_WEIGHTS[layer] = weight


# Each FP8 layer's weight that holds a master, by layer (weakly: not in the layer's __dict__, which copies and pickles
# would carry): what master_layer.check_kept_weight puts back where a reparametrization deleted it behind the layer's
# back.
HELD_WEIGHTS: weakref.WeakKeyDictionary[nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()


_PROBE = "lightning_fp8_adoption_probe"


def accumulator_held(param: torch.Tensor) -> bool:
    """Whether something besides autograd holds ``param``'s gradient accumulator (its ``AccumulateGrad`` node).

    Changing a parameter's dtype (``param.data = ...``, as :func:`adopt` and :func:`release` do) makes autograd give
    it a new accumulator: hooks on the old one stop firing without a word. DistributedDataParallel's reducer holds and
    hooks every parameter's accumulator when the model is wrapped, so its gradients would no longer be averaged over
    the ranks (and DDP fails one iteration later, "Expected to have finished reduction in the prior iteration").
    Autograd itself keeps only a weak reference: an accumulator that outlives our own reference to it is held
    elsewhere (a DDP reducer, another wrapper's hook, a graph not yet backpropagated). Costs a few microseconds.
    """
    if not param.requires_grad or param.grad_fn is not None:
        return False  # no accumulator (frozen, or not a leaf)
    # Under torch.inference_mode() (an optimizer built there) the view would have no grad_fn: autograd records nothing.
    with torch.inference_mode(False), torch.enable_grad():
        node = param.view_as(param).grad_fn.next_functions[0][0]  # the accumulator, created if there is none
        node.metadata[_PROBE] = True  # kept by the C++ node for as long as it lives
        del node
        node = param.view_as(param).grad_fn.next_functions[0][0]
        held = node.metadata.pop(_PROBE, False)
        del node
    return held


def check_adoptable(param: torch.Tensor) -> None:
    """Raise RuntimeError if :func:`adopt` would change the dtype of a parameter whose gradient accumulator is held
    (:func:`accumulator_held`): an FP8AdamW created after ``DDP(model)`` would step on gradients that were never
    averaged over the ranks. Checked once per parameter, at adoption."""
    if accumulator_held(param):
        raise RuntimeError(
            f"FP8AdamW (O2) keeps the master weight of an FP8 layer in the weight's own storage, which changes the "
            f"dtype of the {tuple(param.shape)} weight from {param.dtype}; but its gradient accumulator is already "
            "held by another object, which would be left behind with the old dtype. Either an output of an earlier "
            "forward is still referenced (a `loss` or `out` kept from a step run before the optimizer was created or "
            "before add_param_group, even after its backward): `del` it first; or DistributedDataParallel's reducer "
            "hooked it (the model was wrapped before the optimizer was created), and DDP would stop averaging this "
            "weight's gradients: Create FP8AdamW before wrapping the model in DDP. opt_level='O1' keeps the weights' "
            "dtype; nothing was changed"
        )


def check_shareable(param: torch.Tensor, where: str, optimizer: str, master_dtype: torch.dtype | None) -> None:
    """Raise ValueError if ``param``'s storage already holds a master (:func:`adopt`, by another FP8AdamW at O2) that
    the FP8AdamW being built would not step as it is: it keeps ``master_dtype`` masters in the storage of FP8 weights,
    or (``None``) the parameter itself is its unscaled master (O1). At O1 it would step the stored ``weight * scale``
    as the weight, each update ``scale`` times too small against it; with another ``master_dtype`` its first step
    would refuse the storage's dtype as a cast of the model (:func:`check_storage_dtypes`). ``where`` names ``param``
    in the message and ``optimizer`` the FP8AdamW."""
    if master_scale(param) is None or param.dtype == master_dtype:
        return
    keeps = (
        f"keeps {master_dtype} masters there"
        if master_dtype is not None
        else "keeps its master in the weight, unscaled"
    )
    share = (
        "; or create this one with opt_level='O2' and master_dtype=torch.float16 (the defaults): it takes them over as "
        "they are"
        if param.dtype == torch.float16
        else ""
    )
    raise ValueError(
        f"{optimizer} got {where}, an FP8 weight of shape {tuple(param.shape)} whose {param.dtype} storage holds an O2 "
        "master (the weight times a power-of-two scale) that another FP8AdamW took (or FP8LMPrecision, at O2 under "
        f"DDP): this optimizer {keeps}, so it would step the stored values as the weight. Call release_weights() on "
        "that FP8AdamW before creating this one (the weights get their own storage back, unscaled, in the model's "
        f"dtype; should it be gone, FP8AdamW(those weights).release_weights() does it){share}. Under FP8LMPrecision, "
        "use recipe='fp8-lm-o1' for O1. Nothing was changed"
    )


def check_not_taken(param: torch.Tensor, where: str, master_in_storage: bool) -> None:
    """Raise RuntimeError if ``param``'s storage holds a master (:func:`adopt`) and the FP8AdamW about to step keeps its
    master of ``param`` elsewhere (kept apart, or ``param`` itself as its unscaled master: not
    ``master_in_storage``): an FP8AdamW created after it took the storage (at O2), and the step would take the stored
    ``weight * scale`` for the weight, or write its own master over it. ``where`` names ``param`` in the message."""
    if master_scale(param) is None or master_in_storage:
        return
    raise RuntimeError(
        f"FP8AdamW: {where}, an FP8 weight of shape {tuple(param.shape)}, now holds in its {param.dtype} storage the "
        "master weight of another FP8AdamW, created after this one (at O2: it took the weight's storage, times a "
        "power-of-two scale), where this optimizer's own master is not: its step would take the stored values for "
        "the weight. Step only the FP8AdamW that took the weights, or call its release_weights() before stepping this "
        "one again; nothing was stepped"
    )


def check_storage_dtypes(params: Iterable[torch.Tensor], master_dtype: torch.dtype) -> None:
    """Raise if a parameter whose storage holds its master (:func:`adopt`) is no longer stored in ``master_dtype``:
    the model was cast to another dtype after the optimizer took the storage, which would silently break every update.

    A cast to ``master_dtype`` itself (``model.half()`` over fp16 masters) leaves those weights as they are and is
    accepted: the other parameters then step in that dtype, from their fp32 states.
    """
    for p in params:
        if master_scale(p) is not None and p.dtype != master_dtype:
            rounded = (
                f". A cast back to {master_dtype} gives the masters back exactly where every cast since went to a "
                "dtype with at least its mantissa bits (float32); one to fewer (bfloat16) rounded them, which no cast "
                "undoes: load the last checkpoint then"
            )
            raise RuntimeError(
                f"FP8AdamW: a weight of shape {tuple(p.shape)} is stored as {p.dtype}, but FP8AdamW keeps its "
                f"{master_dtype} master there, with a per-tensor scale: the model was cast to {p.dtype} (e.g. "
                f"model.float(), .bfloat16(), .to(dtype)), or the weight's .data replaced by a {p.dtype} tensor "
                f"(torch.nn.utils.vector_to_parameters does), after FP8AdamW took its weights. Those weights must stay "
                f"{master_dtype} (a cast to {master_dtype} is accepted); cast the model before creating the "
                f"optimizer{rounded}; nothing was stepped"
            )


def release(param: nn.Parameter) -> None:
    """Give ``param`` back its own storage, unscaled, in the dtype it had before :func:`adopt`."""
    with torch.no_grad():
        param.grad = None
        param.data = export(param)
    for attr in (SCALE_ATTR, AMAX_ATTR, DTYPE_ATTR):
        if hasattr(param, attr):
            delattr(param, attr)
    for layer in _marking_layers(param):
        track_layer_scale(layer, param)  # no scale now: dropped


def export(param: torch.Tensor) -> torch.Tensor:
    """The unscaled weight of ``param`` in the dtype the model had (a copy; ``param`` itself if not adopted)."""
    scale = master_scale(param)
    if scale is None:
        return param.detach()
    # The scale is an attribute, which a module's .to()/.cpu() does not move with the parameter.
    return (param.detach().float() / scale.to(param.device)).to(getattr(param, DTYPE_ATTR, torch.float32))
