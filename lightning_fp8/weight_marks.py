"""What FP8 training sets on an FP8Linear's weight Parameter, and how it survives a new Parameter object.

The FP8-weight marker (:class:`LayerMark`, under :data:`master.MARKER`) tells FP8AdamW that a parameter is an FP8
layer's weight. Some flows put a new Parameter object in place of the weight: ``to_empty()`` from the meta device (and
other ``_apply`` conversions between tensor types), ``load_state_dict(assign=True)``. torch.__future__'s
swap_module_params_on_conversion keeps the object but swaps its contents (torch.utils.swap_tensors), for every
``_apply`` (``.to()``, ``.half()``) and load: its attributes and the registration of its post-accumulate-grad hooks
stay with the discarded tensor. What FP8 training set on the old object would be lost: the FP8-weight marker
(FP8AdamW would then give the weight fp32 states and no FP8 gradient), at O2 the master scale its storage holds the
weight times (the forward would read the scaled fp16 storage), FP8AdamW's FP8 gradient hook and the FP8 weight copy.
FP8Linear._apply (:func:`weight_marks`, :func:`put_back_marks`) and the load hooks :func:`before_load` and
:func:`after_load` put them back. (assign=True into an adopted O2 weight is refused before anything is loaded:
master_layer.load_state_dict_pre_hook.) Loaded with assign=True into a layer converted on the meta device, the weight
becomes real but the scaling buffers (not in the state_dict) would stay on meta: the post-hook makes them fresh ones
on the weight's device, as converting there would have. A weight loaded into a layer that has run makes its input
and grad_output scaling start fresh (:func:`start_fresh_for_new_weight`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_fp8 import load_pairing, weight_cache
from lightning_fp8.optim import master
from lightning_fp8.optim.adamw import GRAD_OWNER_ATTR

WEIGHT_MARKS = (
    master.MARKER, master.SCALE_ATTR, master.AMAX_ATTR, master.DTYPE_ATTR, GRAD_OWNER_ATTR, weight_cache.ATTR,
    weight_cache.KEY_ATTR,
)  # fmt: skip


def weight_marks(module: nn.Module) -> tuple[torch.Tensor | None, dict[str, Any], Any]:
    """``(weight, its marks, its post-accumulate-grad hooks)``, for :func:`put_back_marks`."""
    weight = module._parameters.get("weight")
    marks = {a: getattr(weight, a) for a in WEIGHT_MARKS if hasattr(weight, a)}
    return weight, marks, None if weight is None else weight._post_accumulate_grad_hooks


def put_back_marks(module: nn.Module, saved: tuple[torch.Tensor | None, dict[str, Any], Any]) -> None:
    """Put what :func:`weight_marks` saved back on ``module``'s weight (a new object, or the old one swapped)."""
    old, marks, hooks = saved
    weight = module._parameters.get("weight")
    if weight is None:
        return
    for attr, value in marks.items():
        if not hasattr(weight, attr):
            setattr(weight, attr, value)
    if weight is old and hooks is not None:  # registers the same hooks again (swapped or not: they fire once)
        weight._post_accumulate_grad_hooks = hooks


def before_load(module: nn.Module, state_dict: Any = None, prefix: str = "", *args: Any) -> None:
    """A load_state_dict pre-hook: save the weight's marks for :func:`after_load`, and whether the weight loads."""
    # Not attributes nn.Module tracks; popped below.
    module.__dict__["_fp8_weight_marks"] = weight_marks(module)
    value = state_dict.get(f"{prefix}weight") if isinstance(state_dict, Mapping) else None
    weight = module._parameters.get("weight")
    # A value torch will load (one of another shape fails the load, leaving the weight as it was).
    loads = isinstance(value, torch.Tensor) and weight is not None and value.shape == weight.shape
    module.__dict__["_fp8_weight_loads"] = loads


def after_load(module: nn.Module, incompatible_keys: Any) -> None:
    """A load_state_dict post-hook: put the weight's marks back; scaling buffers left on meta by an ``assign=True``
    load onto a real weight become fresh ones on its device; a loaded weight makes the input and grad_output states
    start fresh (:func:`start_fresh_for_new_weight`)."""
    put_back_marks(module, module.__dict__.pop("_fp8_weight_marks", (None, {}, None)))
    weight_loaded = module.__dict__.pop("_fp8_weight_loads", False)
    weight = module._parameters.get("weight")
    scaling = module._modules.get("fp8_scaling")
    if weight is None or scaling is None:
        return
    if not weight.is_meta and any(b.is_meta for b in scaling.buffers()):
        scaling.to_empty(device=weight.device)  # fresh states: ScalingState._apply resets them off the meta device
    elif weight_loaded:
        start_fresh_for_new_weight(module)


# The roles whose scales come from earlier casts (delayed scaling); a weight's cast always measures its own amax.
_HISTORY_ROLES = ("input", "grad_output")


def start_fresh_for_new_weight(layer: nn.Module) -> None:
    """Forget the input and grad_output casts of an FP8 layer whose weight ``load_state_dict`` just replaced: their
    amax histories are of the old weight's activations and gradients, and the delayed scales from them saturated the
    first casts after pretrained weights of another range were loaded into a model that had already run (95% error in
    one test, for as many forwards as the model has layers). The next casts compute their own scales, as in a fresh
    model. A state a checkpoint's FP8 state filled since its last cast (:func:`load_fp8_state_dict`, or a gradient
    scaler load for a grad_output state) is kept: the same checkpoint's weights, loaded second."""
    scaling = layer._modules.get("fp8_scaling")
    for role in _HISTORY_ROLES if scaling is not None else ():
        state = scaling[role]
        casts = load_pairing._cast_count(state)
        if casts is None or (casts == 0 and not state.initialized):  # on meta, or nothing to forget
            continue
        if not load_pairing.loaded_since_last_cast(state):
            state.reset()


class LayerMark:
    """The FP8-weight marker (:data:`master.MARKER`) of an FP8Linear's weight: true while an FP8Linear holding it
    exists (weak references, so the mark keeps no layer alive).

    ``FP8Linear.from_linear`` and ``convert_to_fp8`` mark the weight of the ``nn.Linear`` they wrap. Where the new
    layer is dropped (``convert_to_fp8(model[2])`` not assigned back), the weight is an ordinary parameter again: an
    FP8AdamW must not make its storage a scaled fp16 master, which the model's ``nn.Linear`` would compute with.
    Pickled as an empty set, FP8Linear.__setstate__ marks itself again; deep-copied, it marks the copies of its layers.
    """

    __slots__ = ("_layers",)

    def __init__(self, layers: Iterable[nn.Module] = ()) -> None:
        self._layers = [weakref.ref(layer) for layer in layers]

    def layers(self) -> list[nn.Module]:
        return [layer for ref in self._layers if (layer := ref()) is not None]

    def add(self, layer: nn.Module) -> None:
        self._layers = [weakref.ref(live) for live in self.layers() if live is not layer] + [weakref.ref(layer)]

    def __bool__(self) -> bool:
        return any(ref() is not None for ref in self._layers)

    def __reduce__(self) -> tuple:
        # A weak reference cannot be pickled: unpickled, the mark is an empty set (false: no layer holds the weight)
        # and the unpickled layers mark themselves again. A set, not this class: a pickled Parameter carries its
        # attributes, and torch.load(weights_only=True) reads no class of ours (it allows a set).
        return set, ()

    def __deepcopy__(self, memo: dict) -> LayerMark:
        return LayerMark(memo[id(layer)] for layer in self.layers() if id(layer) in memo)


def mark_weight(layer: nn.Module) -> None:
    """Mark ``layer``'s weight as an FP8 layer's (see :class:`LayerMark`); a weight two FP8 layers share keeps both."""
    mark = getattr(layer.weight, master.MARKER, None)
    if isinstance(mark, LayerMark):
        mark.add(layer)
    else:
        setattr(layer.weight, master.MARKER, LayerMark([layer]))
