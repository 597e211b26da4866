"""The checks an FP8 layer runs before its casts record anything: its input (type, dtype, shape, device), its
parameters' shapes and devices, and no reparametrization of its weight since the conversion. Each error says what to
do; :class:`~lightning_fp8.linear.FP8Linear`, :class:`~lightning_fp8.mlp.FP8MLP` and the tensor-parallel forward
share them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from lightning_fp8.autograd_rules import check_no_forward_ad
from lightning_fp8.cast_checks import check_castable

if TYPE_CHECKING:
    from lightning_fp8.linear import FP8Linear

_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The forward pre-hooks of the hook-based reparametrizations (nn.utils.weight_norm, spectral_norm, nn.utils.prune): each
# recomputes the weight from other parameters before the forward.
_REPARAMETRIZING_HOOKS = (WeightNorm, SpectralNorm, BasePruningMethod)


def check_not_reparametrized(layer: FP8Linear) -> None:
    """Raise if ``layer`` was reparametrized after the conversion (``torch.nn.utils.parametrize``,
    ``parametrizations.weight_norm``, the hook-based ``weight_norm``, ``spectral_norm``, pruning). The FP8-weight
    marker stays on the parameter the weight is now computed from: at O2 FP8AdamW keeps a scaled fp16 master there,
    and the computed weight is garbage (or the forward fails on its dtype)."""
    parametrized = layer._modules.get("parametrizations") is not None  # parametrize.is_parametrized, without getattr
    pre_hooks = layer._forward_pre_hooks
    if parametrized or (pre_hooks and any(isinstance(h, _REPARAMETRIZING_HOOKS) for h in pre_hooks.values())):
        raise RuntimeError(
            f"FP8Linear(in_features={layer.in_features}, out_features={layer.out_features}) was reparametrized after "
            "the conversion (torch.nn.utils.parametrize, weight_norm, spectral_norm or pruning): FP8 layers do not "
            "support a weight computed from other parameters. Remove the reparametrization, or keep the layer in high "
            "precision: reparametrize the nn.Linear before convert_to_fp8, which leaves such layers as they are (or "
            "leave it out with module_filter_fn)"
        )


def check_input(layer: FP8Linear, x: torch.Tensor, weight: torch.Tensor, owner: str = "FP8Linear") -> None:
    """Raise for an input ``x`` that FP8Linear ``layer`` (its ``weight`` read once by the caller) cannot take: not a
    tensor (an fx Proxy), a dtype other than fp32 / bf16 / fp16 (or such a weight), a sparse or nested tensor, another
    last dimension than ``in_features``, another device than the weight's, forward-mode AD; then
    :func:`check_shapes`. ``owner`` names the module in the messages."""
    if not isinstance(x, torch.Tensor):
        if isinstance(x, torch.fx.Proxy):  # torch.fx traces into modules outside torch.nn
            raise TypeError(
                f"{owner} cannot be traced by torch.fx.symbolic_trace (its casts and scaling state are not "
                "symbolic): keep FP8 layers as leaves with a Tracer whose is_leaf_module(m, name) returns True "
                "for FP8Linear (and FP8MLP), or trace with torch.export / torch.compile"
            )
        raise TypeError(f"{owner} expects a tensor input, got {type(x).__name__}")
    if weight.dtype not in _ACTIVATION_DTYPES:  # first: model.double() makes both float64, the weight is the cause
        raise TypeError(
            f"{owner} weight has dtype {weight.dtype}: use float32, bfloat16 or float16 parameters (a model cast "
            "with .double() or .to(torch.float64): cast it back, e.g. model.float())"
        )
    if x.dtype not in _ACTIVATION_DTYPES:
        raise TypeError(
            f"{owner} received an input of dtype {x.dtype}: FP8 layers take floating-point activations "
            f"in {[str(d) for d in _ACTIVATION_DTYPES]}; cast the input first (e.g. x.float() or x.bfloat16())"
        )
    check_castable(x, owner)  # a sparse or nested input
    if x.dim() == 0 or x.shape[-1] != layer.in_features:
        raise ValueError(
            f"{owner}(in_features={layer.in_features}) received an input of shape {tuple(x.shape)}: "
            f"its last dimension must be {layer.in_features}"
        )
    if x.device != weight.device:
        raise ValueError(
            f"{owner} input is on {x.device} but the layer's weight is on {weight.device}: "
            "move the input or the model to the same device"
        )
    check_no_forward_ad(owner, x, weight, layer.bias)
    check_shapes(layer, weight, owner)


def check_shapes(layer: FP8Linear, weight: torch.Tensor, owner: str = "FP8Linear") -> None:
    """Raise ValueError if ``weight`` (``layer``'s) or the bias is not of the layer's shape, or the scaling state
    is not on the weight's device: checked before the casts record anything."""
    bias = layer.bias
    state_device = layer.fp8_scaling["input"]._buffers["scale"].device
    if state_device != weight.device:
        raise ValueError(
            f"{owner}: the weight is on {weight.device} but the FP8 scaling state on {state_device}: the "
            "parameters were replaced without moving the module. Move the whole module (module.to(device); a "
            "module built on the meta device: module.to_empty(device=...), then its reset_parameters())"
        )
    if weight.shape != (layer.out_features, layer.in_features) or (
        bias is not None and bias.shape != (layer.out_features,)
    ):
        got = f"weight {tuple(weight.shape)}" + ("" if bias is None else f" and bias {tuple(bias.shape)}")
        raise ValueError(
            f"FP8Linear(in_features={layer.in_features}, out_features={layer.out_features}) holds a {got}: a "
            f"parameter was replaced by one of another shape. Give it weight ({layer.out_features}, "
            f"{layer.in_features}) and bias ({layer.out_features},), or build a new FP8Linear of the new size"
        )
