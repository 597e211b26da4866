"""convert_to_fp8: swap a model's ``nn.Linear`` layers for :class:`~lightning_fp8.FP8Linear` in place."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

from torch import nn
from torch.nn.utils import parametrize

from lightning_fp8.linear import _ACTIVATION_DTYPES, FP8Linear
from lightning_fp8.recipe import FP8Recipe, resolve_recipe
from lightning_fp8.warnings import warn_once

ModuleFilter = Callable[[nn.Module, str], bool]

# Set on each nn.Linear that recovery.put_back_to_high_precision put in place of an FP8 layer (the "bf16" fallback):
# convert_to_fp8 leaves it in high precision, so converting again does not undo the fallback.
FALLBACK_ATTR = "_lightning_fp8_fallen_back"

# nn.Module's forward and backward hook registries (OrderedDicts keyed by the id of the handle that registered the hook)
# and the flag that register_full_backward_hook sets.
CALL_HOOKS = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook",
)  # fmt: skip
# Its state_dict hook registries. FP8Linear registers hooks of its own there (the O2 master's export and import).
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
    "state_dict_hooks": (
        "they have state_dict hooks, an instance forward or were compiled in place (layer.compile()), which an FP8 "
        "layer cannot take over (its own state_dict hooks export the O2 master weight; a compiled call runs the "
        "nn.Linear)",
        "to run them in FP8, register those (or call .compile()) after convert_to_fp8 (or FP8Linear.from_linear)",
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
        "before convert_to_fp8",
    ),
}


def _is_hf_conv1d(module: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D (GPT-2 and its kin): y = x @ weight + bias with weight (nx, nf).
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


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
    return linear and not getattr(module, FALLBACK_ATTR, False)


def _holds_non_parameters(layer: nn.Module) -> bool:
    # A weight (or a bias) that is a buffer or a plain tensor: an FP8Linear registers them as parameters, so it would
    # drop them from the state_dict and leave them where .to() does not move them.
    if not isinstance(layer._parameters.get("weight"), nn.Parameter):
        return True
    return not isinstance(layer._parameters.get("bias"), nn.Parameter) and getattr(layer, "bias", None) is not None


def _fast_path_children(module: nn.Module) -> set[int]:
    # torch's fused inference path of nn.TransformerEncoderLayer (torch._transformer_encoder_layer_fwd) takes
    # linear1/linear2's weights as tensors: an FP8 layer there would be bypassed.
    return {id(c) for m in module.modules() if isinstance(m, nn.TransformerEncoderLayer) for c in m.children()}


def _reason_left(layer: nn.Module, shared: set[int], fast_path: frozenset[int] = frozenset()) -> str | None:
    """The key of :data:`_LEFT_BECAUSE` for why the linear ``layer`` cannot become an FP8Linear, or None if it can."""
    if id(layer) in fast_path:
        return "fast_path"
    return _reason_refused(layer) or _reason_in_model(layer, shared)


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


def _reason_in_model(layer: nn.Linear, shared: set[int]) -> str | None:
    if layer.in_features % 16 or layer.out_features % 16:
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
    if layer.weight.dtype not in _ACTIVATION_DTYPES:  # as every forward would refuse it (a bias is cast)
        raise TypeError(
            f"{caller}: {layer_repr} has a {layer.weight.dtype} weight; FP8 layers keep float32, bfloat16 or float16 "
            "weights: cast the layer first (layer.float()) or keep it as nn.Linear (convert_to_fp8 leaves such "
            "layers as they are)"
        )
    reason = _reason_refused(layer)
    if reason is not None:
        because, fix = _LEFT_BECAUSE[reason]
        raise ValueError(
            f"{caller}: {layer_repr} cannot become an FP8Linear; convert_to_fp8 leaves such layers in high precision "
            f"because {because}" + (f"; {fix}" if fix else "")
        )


def _label(layer: nn.Module, fqn: str, reason: str) -> str:
    name = fqn or "<root>"
    if reason == "not_linear":  # transformers' Conv1D
        return f"{name} ({layer.weight.shape[0]}->{layer.nf})"
    if reason == "keep_in_fp32":
        return fqn
    if reason == "sizes":
        return f"{name} ({layer.in_features}->{layer.out_features})"
    if reason == "dtype":
        return f"{name} ({layer.weight.dtype})"
    if reason == "subclass":
        return f"{name} ({type(layer).__name__})"
    return name


def share_hooks(source: nn.Module, target: nn.Module, registries: tuple[str, ...] = CALL_HOOKS) -> None:
    """Give ``target``, which replaces ``source`` in a model, the hooks of ``source`` (by default its forward and
    backward hooks, :data:`CALL_HOOKS`).

    ``target`` gets the same registries, not copies: the handles that registered the hooks still remove them, from both
    modules (``source`` keeps its hooks, for a caller that still holds it).
    """
    for name in registries:
        if name in vars(source):
            setattr(target, name, getattr(source, name))


def convert_to_fp8(
    module: nn.Module, recipe: FP8Recipe | str | None = None, module_filter_fn: ModuleFilter | None = None
) -> nn.Module:
    """Replace every ``nn.Linear`` in ``module`` by an :class:`FP8Linear` that shares its parameters.

    Idempotent (FP8 layers, and layers the ``"bf16"`` fallback put back to ``nn.Linear``, are left as they are). An
    FP8 layer keeps the recipe it was converted with: one whose scaling differs from ``recipe``'s (any field but
    ``opt_level``, which layers do not use) is refused, unless ``module_filter_fn`` leaves it out.
    A layer registered under several names (``self.b = self.a``, ``nn.Sequential(lin, act, lin)``) becomes one
    FP8Linear under all of them. The FP8Linear takes over the layer's
    forward and backward hooks (:func:`share_hooks`: the handles keep working). Some layers stay
    ``nn.Linear`` and are named in one warning per reason: feature sizes that are not multiples of 16, parameters
    that are not float32, bfloat16 or float16 (float64), a weight shared with another module of ``module`` (tied
    weights: only ``module``'s own modules are seen, so convert the whole model, not the head alone, where the head's
    weight is the embedding's), a weight computed by a reparametrization (``weight_norm``, ``spectral_norm``, pruning,
    ``torch.nn.utils.parametrize``), state_dict hooks, an instance ``forward`` or a layer compiled in place
    (``layer.compile()``: compile after converting), ``nn.TransformerEncoderLayer``'s ``linear1``/``linear2`` (its fused
    inference path reads their weights itself), subclasses of ``nn.Linear`` (a LoRA layer, ``nn.MultiheadAttention``'s
    ``out_proj``), a weight or bias that is not an ``nn.Parameter`` (a buffer), parameters, buffers or submodules
    registered on the layer besides weight and bias (plain attributes go with it), the layers a Hugging Face model
    keeps in float32 (``_keep_in_fp32_modules``: T5's ``wo``). transformers' ``Conv1D`` projections (GPT-2) are not
    ``nn.Linear`` and are named in a warning too. State dict keys do not change, so
    checkpoints load into the model before or after conversion.

    Args:
        module: the model; converted in place. If it is itself an ``nn.Linear``, a new layer is returned.
        recipe: an :class:`FP8Recipe`, a recipe name, or ``None`` for ``"fp8-lm"``.
        module_filter_fn: ``fn(module, fqn) -> bool``; a linear layer is converted only where it returns True
            (e.g. ``lambda m, fqn: "lm_head" not in fqn`` keeps the output head in high precision). A layer
            registered under several names is asked about once, under its first name.

    Returns:
        The converted module (the same object unless ``module`` is a bare ``nn.Linear``).

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``, or ``module_filter_fn`` is not callable, returns a string,
            or returns None for every linear layer (a function without ``return``); nothing is changed.
        ValueError: if an FP8 layer of ``module`` was converted with another recipe (see above); nothing is changed.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_to_fp8 expects an nn.Module, got {type(module).__name__}")
    if module_filter_fn is not None and not callable(module_filter_fn):  # as FP8LMPrecision(module_filter_fn=...)
        raise TypeError(
            f"convert_to_fp8(module_filter_fn={module_filter_fn!r}): must be a callable fn(module, fqn) -> bool, e.g. "
            f"{filter_example(module_filter_fn)} to keep that layer in high precision"
        )
    if module_filter_fn is not None and not takes_module_and_name(module_filter_fn):
        raise TypeError(
            f"convert_to_fp8(module_filter_fn={module_filter_fn!r}) is called as fn(module, fqn) for each linear "
            "layer, which it cannot take: give it the two arguments, e.g. lambda module, fqn: 'lm_head' not in fqn"
        )
    recipe = resolve_recipe(recipe)
    module_filter_fn = _checked_filter(module_filter_fn)
    _check_converted_recipes(module, recipe, module_filter_fn)
    left: dict[str, list[str]] = {reason: [] for reason in _LEFT_BECAUSE}
    shared = shared_parameter_ids(module)
    fast_path = frozenset(_fast_path_children(module))
    keep_fp32 = _kept_in_fp32(module)
    done: dict[int, nn.Module] = {}  # a layer registered under several names becomes one FP8Linear (as decided first)
    # Every layer's decision (the filter's answer too) before the first layer changes: a filter that raises leaves the
    # model as it was. named_modules() gives each module once, under the first name, as replace_children asks.
    reasons = {id(m): _why_left(m, fqn, module_filter_fn, keep_fp32, shared, fast_path)
               for fqn, m in module.named_modules()}  # fmt: skip
    if module_filter_fn is not None:
        module_filter_fn.check()

    def convert(child: nn.Module, fqn: str) -> nn.Module:
        if id(child) not in done:
            done[id(child)] = _convert_one(child, fqn)
        return done[id(child)]

    def _convert_one(child: nn.Module, fqn: str) -> nn.Module:
        reason = reasons[id(child)]
        if reason == _NOT_ASKED:
            return child
        if reason is not None:
            left[reason].append(_label(child, fqn, reason))
            return child
        return FP8Linear.from_linear(child, recipe)  # takes over the layer's forward and backward hooks

    root = convert(module, "")
    if root is not module:  # a bare nn.Linear: its new FP8Linear
        keep_scaling_states_per_rank(root)
        return root
    replace_children(module, convert)
    for message in _left_messages(left):
        warn_once(message)
    keep_scaling_states_per_rank(module)
    return module


_NOT_ASKED = "not_asked"  # not a linear layer to convert, or the filter leaves it out: named in no warning


def _why_left(
    child: nn.Module,
    fqn: str,
    module_filter_fn: ModuleFilter | None,
    keep_fp32: re.Pattern[str] | None,
    shared: set[int],
    fast_path: frozenset[int],
) -> str | None:
    """Why :func:`convert_to_fp8` leaves ``child`` as it is (:data:`_NOT_ASKED` or a key of :data:`_LEFT_BECAUSE`), or
    None where it converts it."""
    conv1d = _is_hf_conv1d(child)
    if not (_is_linear_to_convert(child) or conv1d):
        return _NOT_ASKED
    if module_filter_fn is not None and not module_filter_fn(child, fqn):
        return _NOT_ASKED
    if conv1d:
        return "not_linear"
    if _is_kept_in_fp32(fqn, keep_fp32):
        return "keep_in_fp32"
    return _reason_left(child, shared, fast_path)


def filter_example(value: object) -> str:
    """A module_filter_fn for the error of a non-callable ``value``: keep the layer it names (a string), or lm_head."""
    return f"lambda module, fqn: fqn != {value if isinstance(value, str) else 'lm_head'!r}"


def takes_module_and_name(fn: Callable[..., object]) -> bool:
    """Whether ``fn`` can be called as a ``module_filter_fn``, ``fn(module, fqn)`` (else the conversion fails at its
    first layer with Python's bare ``<lambda>() takes 1 positional argument but 2 were given``)."""
    try:
        inspect.signature(fn).bind(None, "")
    except TypeError:
        return False
    except ValueError:  # no signature to read (some builtins): the call will tell
        return True
    return True


class _CheckedFilter:
    """A ``module_filter_fn`` whose answers are read as torchao reads them (truthiness: a ``re.search`` match
    converts, None keeps), with the two answers that say the function is wrong refused before any layer changes: a
    string (``"no"`` was truthy: it converted), and None for every layer asked (a function without ``return``, which
    kept the whole model in high precision without a word)."""

    def __init__(self, fn: ModuleFilter) -> None:
        self.fn = fn
        self.asked = self.nones = 0

    def __call__(self, layer: nn.Module, fqn: str) -> bool:
        answer = self.fn(layer, fqn)
        if isinstance(answer, (str, bytes)):
            raise TypeError(
                f"convert_to_fp8: module_filter_fn returned {answer!r} for {fqn or '<root>'!r}: it must return True "
                "(convert the layer to FP8) or False (keep it in high precision), e.g. lambda module, fqn: 'lm_head' "
                "not in fqn. Nothing was changed"
            )
        self.asked += 1
        self.nones += answer is None
        return bool(answer)

    def check(self) -> None:
        """Raise when the filter answered None for every layer it was asked about."""
        if self.asked and self.nones == self.asked:
            raise TypeError(
                f"convert_to_fp8: module_filter_fn returned None for all {self.asked} linear layers: check that the "
                "function has a return statement (return False to keep every layer in high precision). Nothing was "
                "changed"
            )


def _checked_filter(module_filter_fn: ModuleFilter | None) -> _CheckedFilter | None:
    return None if module_filter_fn is None else _CheckedFilter(module_filter_fn)


def convertible_linears(module: nn.Module, module_filter_fn: ModuleFilter | None = None) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` layers of ``module`` that :func:`convert_to_fp8` with this filter would convert, by name,
    without converting anything (a layer registered under several names: under its first)."""
    shared, keep_fp32 = shared_parameter_ids(module), _kept_in_fp32(module)
    fast_path = frozenset(_fast_path_children(module))
    module_filter_fn = _checked_filter(module_filter_fn)
    found = {fqn: m for fqn, m in module.named_modules()
             if _why_left(m, fqn, module_filter_fn, keep_fp32, shared, fast_path) is None}  # fmt: skip
    if module_filter_fn is not None:
        module_filter_fn.check()
    return found


def keep_scaling_states_per_rank(module: nn.Module) -> None:
    """Name the FP8 scaling buffers under ``module`` in ``module._ddp_params_and_buffers_to_ignore`` (kept with what
    it named before), which ``DistributedDataParallel(module)`` reads when it is built: DDP broadcasts a model's
    buffers from rank 0 before every forward (``broadcast_buffers=True``, its default), which overwrote each rank's
    amax history and scales with rank 0's, so a rank whose activations or gradients run larger cast them with rank
    0's scales and saturated, silently, and ``enable_fp8_amax_sync`` took the maximum of histories already made equal.
    Each rank keeps its own now (amax sync, when enabled, makes them the maximum over ranks). ``convert_to_fp8`` calls
    it on the module it converts; for a DDP wrapping another (a parent) module, call it on that one first."""
    from lightning_fp8.scaling import ScalingState

    names = {f"{prefix}.{name}" if prefix else name
             for prefix, sub in module.named_modules() if isinstance(sub, ScalingState)
             for name, _ in sub.named_buffers(recurse=False)}  # fmt: skip
    if names:
        before = getattr(module, "_ddp_params_and_buffers_to_ignore", ())
        module._ddp_params_and_buffers_to_ignore = sorted(set(before) | names)


def _check_converted_recipes(module: nn.Module, recipe: FP8Recipe, module_filter_fn: ModuleFilter | None) -> None:
    # Converting leaves FP8 layers as they are: one converted with another recipe would silently keep it.
    for fqn, layer in module.named_modules():
        if not isinstance(layer, FP8Linear) or layer.recipe.same_scaling(recipe):
            continue
        if module_filter_fn is not None and not module_filter_fn(layer, fqn):
            continue
        old, new = layer.recipe.to_dict(), recipe.to_dict()
        changed = [k for k in old if k != "opt_level" and old[k] != new[k]]
        had, asked = (", ".join(f"{k}={values[k]!r}" for k in changed) for values in (old, new))
        raise ValueError(
            f"convert_to_fp8: {fqn or '<root>'!r} is already an FP8 layer, converted with {had}, and this call asks "
            f"for {asked}: converting again leaves FP8 layers as they are, so it would keep its recipe. Pass the "
            "recipe the model was converted with, convert a model that is not converted yet, or leave the layer out "
            "with module_filter_fn; nothing was changed"
        )


def replace_children(module: nn.Module, convert: Callable[[nn.Module, str], nn.Module]) -> None:
    """Put ``convert(child, fqn)`` in place of each module inside ``module``, under every name the child has; ``fqn``
    is the child's first name in ``named_modules()`` order (the name filters and reports use), whichever name the
    walk meets first."""
    first_name = {id(m): fqn for fqn, m in module.named_modules()}
    for parent_name, parent in list(module.named_modules()):
        if isinstance(parent, FP8Linear):
            continue
        # _modules, not named_children(): that skips a child registered under a second name, which would keep the
        # nn.Linear there, reading the FP8 weight's storage (at O2 a scaled fp16 master).
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            new = convert(child, first_name.get(id(child), f"{parent_name}.{name}" if parent_name else name))
            if new is not child:
                setattr(parent, name, new)


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


def fp8_modules(module: nn.Module) -> dict[str, FP8Linear]:
    """The FP8 layers of ``module`` by qualified name.

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fp8_modules expects an nn.Module (the model), got {type(module).__name__}")
    return {name: m for name, m in module.named_modules() if isinstance(m, FP8Linear)}
