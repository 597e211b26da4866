"""The FP8 layer's side of a master weight kept in its weight's storage (O2, :mod:`~lightning_fp8.optim.master`): the
state_dict hooks that export and import the unscaled weight, and the refusal to reparametrize or delete such a weight.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_fp8 import ops
from lightning_fp8.formats import FP8_DTYPES
from lightning_fp8.optim.master import AMAX_ATTR, HELD_WEIGHTS, export, master_scale, quantize_fp16


def state_dict_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``module.state_dict()`` gives the unscaled weight, in the model's dtype, of an adopted weight."""
    key = prefix + "weight"
    weight = getattr(module, "weight", None)
    if weight is not None and key in state_dict and master_scale(weight) is not None:
        state_dict[key] = export(weight)


def load_state_dict_pre_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict, *args: Any, **kwargs: Any
) -> None:
    """Loading an unscaled weight into an adopted parameter stores it scaled, with a fresh scale. The weight's own
    storage (``dict(model.named_parameters())``) loads as the no-op it is; another adopted weight (another O2 model's
    parameter, also saved and loaded: its master scale goes with it) loads as its unscaled value, into an adopted
    weight or not.

    Raises:
        RuntimeError: for ``load_state_dict(..., assign=True)`` into an adopted weight, before anything of this layer
            is loaded: the new Parameter would not be the one FP8AdamW steps (nor hold its scaled master).
        ValueError: for a weight holding inf or NaN loaded into an fp16 master (O2), before anything of this layer is
            loaded: the scaled fp16 storage would saturate inf to 65504 without a word. (fp32 and bf16 storage, O1,
            takes the values as they are, as torch does.)
    """
    key = prefix + "weight"
    weight = getattr(module, "weight", None)
    if weight is None or key not in state_dict:
        return
    if master_scale(weight) is None:  # not adopted: takes true weights, so another O2 model's parameter exported
        incoming = state_dict[key]
        if isinstance(incoming, torch.Tensor) and not incoming.is_meta and master_scale(incoming) is not None:
            state_dict[key] = export(incoming)
        return
    if local_metadata.get("assign_to_params_buffers", False):
        raise RuntimeError(
            f"load_state_dict(..., assign=True) would replace the weight Parameter {prefix + 'weight'!r} of shape "
            f"{tuple(weight.shape)}, whose storage FP8AdamW (O2) holds as its scaled fp16 master: the optimizer would "
            "go on stepping the old Parameter, which the model no longer uses. Load with assign=False (the default: "
            "the values are copied into the existing Parameter, and the optimizer keeps working), or create the "
            "optimizer after loading. This layer was not changed"
        )
    incoming = state_dict[key]
    if not isinstance(incoming, torch.Tensor) or incoming.shape != weight.shape or incoming.is_meta:
        return  # the default loader reports the mismatch (a meta tensor: it warns that the copy is a no-op)
    if _is_stored_in(incoming, weight):
        # The weight's own storage (model.load_state_dict(dict(model.named_parameters())); torch's distributed
        # checkpoint set_model_state_dict fills the keys a partial dict lacks so): the scaled master, copied on itself.
        return
    if master_scale(incoming) is not None:  # another adopted weight (another O2 model's named_parameters()): scaled
        incoming = export(incoming)
    if incoming.dtype in FP8_DTYPES:  # torch copies FP8 values into a wider parameter; isfinite has no FP8 kernel
        incoming = incoming.float()
    if weight.dtype == torch.float16 and incoming.is_floating_point() and not bool(torch.isfinite(incoming).all()):
        raise ValueError(
            f"load_state_dict: the weight {key!r} of shape {tuple(weight.shape)} holds inf or NaN. FP8AdamW (O2) keeps "
            "it as a scaled fp16 master, which cannot hold them (inf would become 65504, silently). Load a checkpoint "
            "from before the values went non-finite. This layer was not changed"
        )
    with torch.no_grad():
        incoming = incoming.to(weight.device)
        if weight.dtype == torch.float16:
            scaled, scale, amax = quantize_fp16(incoming)
        else:
            scaled, scale, amax = incoming.to(weight.dtype), torch.ones_like(master_scale(weight)), ops.amax(incoming)
        master_scale(weight).copy_(scale)
        getattr(weight, AMAX_ATTR).copy_(amax)
    state_dict[key] = scaled


def _is_stored_in(tensor: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``tensor`` is ``weight`` or a plain view of all of its values (``weight.detach()``, ``weight.data``)."""
    if tensor is weight:
        return True
    plain = type(tensor) in (torch.Tensor, nn.Parameter) and type(weight) in (torch.Tensor, nn.Parameter)  # no DTensor
    return (
        plain
        and tensor.device == weight.device
        and tensor.dtype == weight.dtype
        and tensor.data_ptr() == weight.data_ptr()
        and tensor.stride() == weight.stride()
    )


def check_kept_weight(layer: nn.Module, name: str, param: torch.Tensor | None = None) -> None:
    """Raise before a reparametrization takes ``layer``'s weight while FP8AdamW (O2) holds it as a scaled fp16 master:
    ``torch.nn.utils.parametrize`` and ``spectral_norm`` delete the weight (``name`` "weight", from ``__delattr__``),
    pruning registers it as ``weight_orig`` first, ``weight_norm`` registers ``weight_g`` after deleting it from the
    parameters (put back here). They would compute from the scaled storage: weight norm's per-row norm overflows
    fp16 (an inf weight once removed), spectral norm's power iteration gives NaN, and the state dict holds the storage.

    Raises:
        ValueError: naming ``optimizer.release_weights()``; the layer keeps its weight.
    """
    held = HELD_WEIGHTS.get(layer)
    if held is None or master_scale(held) is None:  # released (release_weights) or never held
        return
    current = layer._parameters.get("weight")
    deleted = "weight" not in layer._parameters and name.startswith("weight_")
    if not ((name == "weight" and current is held) or (name != "weight" and (param is held or deleted))):
        return
    if deleted:
        layer._parameters["weight"] = held  # weight_norm deleted it from the parameters itself
    raise ValueError(
        f"{type(layer).__name__}(in_features={layer.in_features}, out_features={layer.out_features}): its weight "
        "cannot be reparametrized (torch.nn.utils.parametrize, weight_norm, spectral_norm, pruning) or deleted while "
        "FP8AdamW (O2) holds it as its fp16 master times a scale: the reparametrization would compute from the scaled "
        "storage (weight norm overflows fp16, spectral norm gives NaN). Call optimizer.release_weights() first (the "
        "weight gets its own storage back), or reparametrize before creating FP8AdamW. The layer keeps its weight"
    )
