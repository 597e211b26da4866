"""Which linear layers :func:`~lightning_fp8.convert.convert_to_fp8` can make FP8 layers of, and why it leaves the
others in high precision (one warning per reason, naming the layers and what to do)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

from torch import nn
from torch.nn.utils import parametrize

from lightning_fp8.linear import FP8Linear
from lightning_fp8.linear_checks import _ACTIVATION_DTYPES
from lightning_fp8.weight_reads import forward_weight_reads

# Set on each nn.Linear that recovery.put_back_to_high_precision put in place of an FP8 layer (the "bf16" fallback):
# convert_to_fp8 leaves it in high precision, so converting again does not undo the fallback.
FALLBACK_ATTR = "_lightning_fp8_fallen_back"

# nn.Module's state_dict hook registries. FP8Linear registers hooks of its own there (the O2 master's export and
# import): a layer holding some is left in high precision.
STATE_DICT_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                    "_load_state_dict_post_hooks")  # fmt: skip

# Why a linear layer stays in high precision, and what to do to run it in FP8 (if anything): one warning per reason,
# in this order, naming the layers.
_LEFT_BECAUSE: dict[str, tuple[str, str]] = {
    "tied": ("their weight is shared with another module (tied weights)", ""),
    "sizes": ("their feature sizes are not multiples of 16", ""),
    "dtype": (
        "their parameters are not float32, bfloat16 or float16, the dtypes FP8 layers run with",
        "to run them in FP8, convert the model first (model.float() or model.bfloat16())",
    ),
    "reparametrized": (
        "their weight is computed from other parameters (weight_norm, spectral_norm, pruning or "
        "torch.nn.utils.parametrize), which an FP8 layer does not do",
        "to run them in FP8, remove the reparametrization first (torch.nn.utils.parametrize.remove_parametrizations, "
        "torch.nn.utils.remove_weight_norm, ...)",
    ),
    "lazy": (
        "they are nn.LazyLinear layers not initialized yet (their input size is known after their first forward)",
        "to run them in FP8, run one forward first (they then become nn.Linear) and call convert_to_fp8 again",
    ),
    "subclass": (
        "they are subclasses of nn.Linear (a LoRA layer, nn.MultiheadAttention's out_proj, ...), whose forward, added "
        "parameters or own use of the weight (nn.MultiheadAttention reads out_proj's weight itself) an FP8 layer would "
        "not keep",
        "to run one in FP8, make it a plain nn.Linear (a LoRA layer's base layer, say, with the adapters beside it)",
    ),
    "not_parameters": (
        "their weight or bias is not an nn.Parameter (a frozen weight registered as a buffer, say), which an FP8 layer "
        "would drop from the state_dict and from .to()",
        "to run them in FP8, make it a parameter that needs no gradient: nn.Parameter(tensor, requires_grad=False)",
    ),
    "added_state": (
        "they hold parameters, buffers or submodules besides weight and bias (registered on the layer itself), which "
        "an FP8 layer would drop from the state_dict, .to() and the optimizer",
        "to run them in FP8, keep those in a module beside the layer",
    ),
    "fast_path": (
        "they belong to an nn.TransformerEncoderLayer, whose inference fast path (eval under no_grad) reads their "
        "weights itself, bypassing the layer (at O2 it would read FP8AdamW's scaled fp16 master)",
        "to run them in FP8, build the block from its own nn.Linear layers",
    ),
    "weight_read": (
        "the module holding them reads their weight itself (as Mamba's dt_proj.weight @ x, DETR's conv2d over "
        "k_proj.weight), bypassing the layer: at O2 it would read FP8AdamW's scaled fp16 master, a wrong value of "
        "another dtype",
        "",
    ),
    "dtype_cast": (
        "the module holding them casts their input to their weight's dtype (as T5's feed-forward does: "
        "hidden_states.to(self.wo.weight.dtype)), which FP8AdamW's O2 master makes float16, where such activations "
        "overflow",
        "",
    ),
    "state_dict_hooks": (
        "they have state_dict hooks, an instance forward or were compiled in place (layer.compile()) or by "
        "torch.compile(layer) registered in the model, which an FP8 layer cannot take over (its own state_dict hooks "
        "export the O2 master weight; a compiled call runs the nn.Linear)",
        "to run them in FP8, register those (or call .compile()) after convert_to_fp8 (or FP8Linear.from_linear), and "
        "compile the converted layer (or the whole model)",
    ),
    "keep_in_fp32": (
        "the model keeps them in float32 (Hugging Face's _keep_in_fp32_modules, e.g. T5's wo): such models cast the "
        "layer's input to its weight's dtype, which FP8AdamW's O2 master makes float16, where those activations "
        "overflow",
        "",
    ),
    "not_linear": (
        "they are not nn.Linear but transformers' Conv1D (GPT-2's projections: a linear layer with its weight "
        "transposed)",
        "to run them in FP8, replace each by an nn.Linear(nx, nf) with weight conv.weight.t() and the same bias "
        "before convert_to_fp8 (the state_dict then holds those weights transposed: a GPT-2 model refuses such a "
        "checkpoint, or loads a square one transposed; save from a model with Conv1D layers holding them transposed "
        "back)",
    ),
    "attention_in_proj": (
        "they are nn.MultiheadAttention's input projections (in_proj_weight, or q/k/v_proj_weight where kdim or vdim "
        "differ), which its attention function multiplies with itself, not nn.Linear layers",
        "to run them in FP8, build the attention from nn.Linear projections and "
        "torch.nn.functional.scaled_dot_product_attention",
    ),
    "experts": (
        "they are a mixture of experts' expert weights, one 3-D parameter (experts, out, in) per projection as "
        "transformers' MoE models (Mixtral, Qwen-MoE, DeepSeek...) hold them, not nn.Linear layers",
        "",
    ),
}


def _is_hf_conv1d(module: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D (GPT-2 and its kin): y = x @ weight + bias with weight (nx, nf).
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _projection_kind(module: nn.Module) -> str | None:
    """The key of :data:`_LEFT_BECAUSE` for a module holding linear projections that are not ``nn.Linear`` layers
    (named in a warning, as they stay in high precision), or None."""
    if _is_hf_conv1d(module):
        return "not_linear"
    if _is_experts(module):
        return "experts"
    if isinstance(module, nn.MultiheadAttention):
        return "attention_in_proj"
    return None


def _is_experts(module: nn.Module) -> bool:
    # transformers' MoE experts (MixtralExperts and the like, since transformers 5): each projection of all experts is
    # one nn.Parameter (num_experts, out, in) that the forward indexes per expert; most of such a model's weights.
    num_experts = vars(module).get("num_experts")
    return isinstance(num_experts, int) and any(
        p.dim() == 3 and p.shape[0] == num_experts for p in module._parameters.values() if p is not None
    )


def _kept_in_fp32(module: nn.Module) -> re.Pattern[str] | None:
    """What a Hugging Face model keeps in float32 (``_keep_in_fp32_modules`` and its ``_strict`` form, on any module
    of ``module``), as a pattern of parameter names: an entry matches a run of whole name components ("wo",
    "indexer.weights_proj", "gate.weight"; ``*`` any characters, as transformers reads it). None: nothing kept."""
    names: set[str] = set()
    for sub in module.modules():
        for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
            names.update(getattr(sub, attr, None) or ())
    if not names:
        return None
    entries = "|".join(re.escape(name).replace(r"\*", ".*") for name in sorted(names))
    return re.compile(rf"(^|\.)({entries})(\.|$)")


def _is_kept_in_fp32(fqn: str, keep_fp32: re.Pattern[str] | None) -> bool:
    # The layer's parameter names, as transformers matches the entries against them.
    prefix = f"{fqn}." if fqn else ""
    return keep_fp32 is not None and any(keep_fp32.search(prefix + name) for name in ("weight", "bias"))


def _is_linear_to_convert(module: nn.Module) -> bool:
    # Every nn.Linear but the FP8 layers and the "bf16" fallback's layers; _reason_left then leaves some, named.
    linear = isinstance(module, nn.Linear) and not isinstance(module, FP8Linear)
    return linear and not is_fallen_back(module)


def is_fallen_back(module: nn.Module | None) -> bool:
    """Whether ``module`` is an ``nn.Linear`` the ``"bf16"`` fallback put in place of an FP8 layer: its own mark, not
    one a wrapper proxies (``torch.compile``'s wrapper reads unknown attributes from the module it holds)."""
    return module is not None and vars(module).get(FALLBACK_ATTR, False) is True


def _holds_non_parameters(layer: nn.Module) -> bool:
    # A weight (or a bias) that is a buffer or a plain tensor: an FP8Linear registers them as parameters, so it would
    # drop them from the state_dict and leave them where .to() does not move them.
    if not isinstance(layer._parameters.get("weight"), nn.Parameter):
        return True
    return not isinstance(layer._parameters.get("bias"), nn.Parameter) and getattr(layer, "bias", None) is not None


def _bypassed_layers(module: nn.Module) -> dict[int, str]:
    """The linear layers of ``module`` whose weight the code around them reads itself (by id): ``"fast_path"`` or
    ``"weight_read"`` (their forward bypassed), ``"dtype_cast"`` (their input cast to the weight's dtype); keys of
    :data:`_LEFT_BECAUSE`."""
    bypassed = {}
    for parent in module.modules():
        for path, use in forward_weight_reads(type(parent), vars(parent).get("forward"), parent).items():
            if path.endswith(".*"):  # any layer the container holds (self.lora_A[adapter].weight)
                container = _submodule(parent, path[:-2])
                layers = list(container.children()) if container is not None else []
            else:
                layers = [_submodule(parent, path)]
            for layer in layers:
                if isinstance(layer, nn.Linear) and bypassed.get(id(layer)) != "weight_read":
                    bypassed[id(layer)] = use
    # torch's fused inference path of nn.TransformerEncoderLayer (torch._transformer_encoder_layer_fwd) takes
    # linear1/linear2's weights as tensors: an FP8 layer there would be bypassed.
    for m in module.modules():
        if isinstance(m, nn.TransformerEncoderLayer):
            bypassed.update({id(c): "fast_path" for c in m.children()})
    # torch.compile(layer) registered in the model: the wrapper's forward is the compiled call of the nn.Linear it was
    # built from, which an FP8 layer put in its place as _orig_mod would not change.
    bypassed.update({id(m._orig_mod): "state_dict_hooks" for m in module.modules() if is_compiled_wrapper(m)})
    return bypassed


def is_compiled_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile(m)`` returns (``OptimizedModule``), whose forward was bound to
    ``m`` (its ``_orig_mod``) when it was built."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:  # a path the source names that is no submodule here (a plain attribute, another config)
        return None


def _reason_left(layer: nn.Module, shared: set[int], bypassed: dict[int, str] | None = None) -> str | None:
    """The key of :data:`_LEFT_BECAUSE` for why the linear ``layer`` cannot become an FP8Linear, or None if it can."""
    bypass = (bypassed or {}).get(id(layer))
    if bypass in ("fast_path", "state_dict_hooks"):
        return bypass
    return _reason_refused(layer) or _reason_in_model(layer, shared) or bypass


def _reason_refused(layer: nn.Linear) -> str | None:
    """The reasons that concern the layer alone, for which :meth:`FP8Linear.from_linear` raises too (it would drop the
    real parameters, the subclass's forward or the hooks)."""
    # First: reading the weight of a torch.nn.utils.parametrize layer (a ParametrizedLinear, computing its weight or
    # bias on each access) would run the parametrization (a power iteration).
    if parametrize.is_parametrized(layer):
        return "reparametrized"
    # Hook-based reparametrizations (nn.utils.weight_norm, spectral_norm, prune) keep the nn.Linear type but replace
    # the registered parameter by a tensor that a forward pre-hook recomputes from the real parameters.
    if any(vars(layer).get(name) is not None for name in ("weight", "bias")):
        return "reparametrized"
    if isinstance(layer, nn.LazyLinear):  # once initialized it is an nn.Linear (LazyLinear.cls_to_become)
        return "lazy"
    if type(layer) is not nn.Linear:
        return "subclass"
    if _holds_non_parameters(layer):
        return "not_parameters"
    if set(layer._parameters) - {"weight", "bias"} or layer._buffers or layer._modules:
        return "added_state"
    # An instance forward, or nn.Module.compile()'s compiled call of the layer itself (which Module.__call__ would
    # keep running: the nn.Linear's forward, not the FP8 one).
    if any(getattr(layer, name) for name in STATE_DICT_HOOKS) or {"forward", "_compiled_call_impl"} & set(vars(layer)):
        return "state_dict_hooks"
    return None


def weight_features(layer: nn.Linear) -> tuple[int, int]:
    """``(in_features, out_features)`` of ``layer`` as its forward uses them: its weight's sizes (``nn.Linear`` never
    reads its attributes, which a weight replaced by hand, pruned rows say, leaves as they were)."""
    weight = layer.weight
    if weight is not None and weight.dim() == 2:
        return weight.shape[1], weight.shape[0]
    return layer.in_features, layer.out_features


def _reason_in_model(layer: nn.Linear, shared: set[int]) -> str | None:
    if any(size % 16 for size in weight_features(layer)):
        return "sizes"
    if any(p.dtype not in _ACTIVATION_DTYPES for p in layer.parameters(recurse=False)):
        return "dtype"  # FP8Linear refuses float64 weights at every forward
    if id(layer.weight) in shared:
        # A tied weight (e.g. an output head sharing the token embedding) is read by another module too; the
        # FP8 optimizer's O2 storage of FP8 weights would change what that module sees.
        return "tied"
    return None


def check_wrappable(layer: nn.Module, caller: str) -> None:
    """Raise for a linear layer that ``caller`` (``"FP8Linear.from_linear"``...) cannot make an FP8Linear of: one
    that :func:`convert_to_fp8` leaves in high precision for what it is (see :func:`_reason_refused`).

    Raises:
        TypeError: if ``layer`` is not an ``nn.Linear``, or its weight has a dtype FP8 layers do not keep (float64:
            every forward would refuse it).
        ValueError: for such a layer, naming the reason and what to do, or for an FP8Linear (already one).
    """
    if not isinstance(layer, nn.Linear):
        raise TypeError(f"{caller} takes an nn.Linear, got {type(layer).__name__}")
    layer_repr = f"{type(layer).__name__}(in_features={layer.in_features}, out_features={layer.out_features})"
    if isinstance(layer, FP8Linear):  # else refused as a subclass of nn.Linear, for a reason that does not apply
        raise ValueError(
            f"{caller}: {layer_repr} is already an FP8Linear; use it as it is (convert_to_fp8 leaves FP8 layers as "
            "they are). For another recipe, convert the original nn.Linear, or build a new FP8Linear(..., recipe=...)"
        )
    # The reasons first: they never read the weight, which may be missing (deleted, None) or computed on access.
    reason = _reason_refused(layer)
    if reason is not None:
        because, fix = _LEFT_BECAUSE[reason]
        raise ValueError(
            f"{caller}: {layer_repr} cannot become an FP8Linear; convert_to_fp8 leaves such layers in high precision "
            f"because {because}" + (f"; {fix}" if fix else "")
        )
    if layer.weight.dtype not in _ACTIVATION_DTYPES:  # as every forward would refuse it (a bias is cast)
        raise TypeError(
            f"{caller}: {layer_repr} has a {layer.weight.dtype} weight; FP8 layers keep float32, bfloat16 or float16 "
            "weights: cast the layer first (layer.float()) or keep it as nn.Linear (convert_to_fp8 leaves such "
            "layers as they are)"
        )


def _label(layer: nn.Module, fqn: str, reason: str) -> str:
    name = fqn or "<root>"
    if reason == "not_linear":  # transformers' Conv1D
        return f"{name} ({layer.weight.shape[0]}->{layer.nf})"
    if reason == "experts":
        return f"{name} ({layer.num_experts} experts)"
    if reason == "attention_in_proj":
        return f"{name} ({'in_proj_weight' if layer._qkv_same_embed_dim else 'q/k/v_proj_weight'})"
    if reason == "keep_in_fp32":
        return fqn
    if reason == "sizes":
        in_features, out_features = weight_features(layer)
        return f"{name} ({in_features}->{out_features})"
    if reason == "dtype":
        return f"{name} ({layer.weight.dtype})"
    if reason == "subclass":
        return f"{name} ({type(layer).__name__})"
    return name


_NOT_ASKED = "not_asked"  # not a linear layer to convert, or the filter leaves it out: named in no warning


def _why_left(
    child: nn.Module,
    fqn: str,
    module_filter_fn: Callable[[nn.Module, str], bool] | None,
    keep_fp32: re.Pattern[str] | None,
    shared: set[int],
    bypassed: dict[int, str],
) -> str | None:
    """Why :func:`convert_to_fp8` leaves ``child`` as it is (:data:`_NOT_ASKED` or a key of :data:`_LEFT_BECAUSE`), or
    None where it converts it."""
    projection = _projection_kind(child)  # a linear projection that is not an nn.Linear
    if not (_is_linear_to_convert(child) or projection):
        return _NOT_ASKED
    if projection in ("experts", "attention_in_proj"):
        # Named, never asked: the filter is asked about linear layers, and one written for them (m.in_features % 16)
        # would fail on an attention or experts module. (GPT-2's Conv1D, a linear layer by another name, is asked.)
        return projection
    if module_filter_fn is not None and not module_filter_fn(child, fqn):
        return _NOT_ASKED
    if projection:
        return projection
    if _is_kept_in_fp32(fqn, keep_fp32):
        return "keep_in_fp32"
    return _reason_left(child, shared, bypassed)


def _left_messages(left: dict[str, list[str]]) -> list[str]:
    messages = []
    for reason, (because, fix) in _LEFT_BECAUSE.items():
        names = left[reason]
        if names:
            message = f"convert_to_fp8 left {len(names)} linear layer(s) in high precision because {because}: "
            messages.append(message + ", ".join(names) + (f"; {fix}" if fix else ""))
    return messages


def shared_parameter_ids(module: nn.Module) -> set[int]:
    """The ids of the parameters that two or more modules of ``module`` hold (tied weights), which a conversion
    must leave alone (only ``module``'s own modules are seen)."""
    owners: dict[int, int] = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {pid for pid, count in owners.items() if count > 1}
