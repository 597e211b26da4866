"""convert_to_fp8: swap a model's ``nn.Linear`` layers for :class:`~lightning_fp8.FP8Linear` in place."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from torch import nn

from lightning_fp8.eligibility import (
    _LEFT_BECAUSE,
    _NOT_ASKED,
    _bypassed_layers,
    _kept_in_fp32,
    _label,
    _left_messages,
    _why_left,
    shared_parameter_ids,
)
from lightning_fp8.linear import FP8Linear, _is_dtensor
from lightning_fp8.recipe import FP8Recipe, resolve_recipe
from lightning_fp8.warnings import warn_once

ModuleFilter = Callable[[nn.Module, str], bool]


# nn.Module's forward and backward hook registries (OrderedDicts keyed by the id of the handle that registered the hook)
# and the flag that register_full_backward_hook sets.
CALL_HOOKS = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook",
)  # fmt: skip


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

    Idempotent (FP8 layers, and layers the ``"bf16"`` fallback put back to ``nn.Linear``, are left as they are). An FP8
    layer keeps the recipe it was converted with: one whose scaling differs from ``recipe``'s (any field but
    ``opt_level``, which layers do not use) is refused, unless ``module_filter_fn`` leaves it out. A layer registered
    under several names (``self.b = self.a``, ``nn.Sequential(lin, act, lin)``) becomes one FP8Linear under all of them.
    The FP8Linear takes over the layer's forward and backward hooks (:func:`share_hooks`: the handles keep working).
    Some layers stay ``nn.Linear`` and are named in one warning per reason: feature sizes that are not multiples of 16,
    parameters that are not float32, bfloat16 or float16 (float64), a weight shared with another module of ``module``
    (tied weights: only ``module``'s own modules are seen, so convert the whole model, not the head alone, where the
    head's weight is the embedding's), a weight computed by a reparametrization (``weight_norm``, ``spectral_norm``,
    pruning, ``torch.nn.utils.parametrize``), state_dict hooks, an instance ``forward`` or a layer compiled in place
    (``layer.compile()``, or a ``torch.compile(layer)`` the model holds: compile after converting),
    ``nn.TransformerEncoderLayer``'s ``linear1``/``linear2`` (its fused inference path reads their weights itself),
    subclasses of ``nn.Linear`` (a LoRA layer, ``nn.MultiheadAttention``'s ``out_proj``), a weight or bias that is not
    an ``nn.Parameter`` (a buffer), parameters, buffers or submodules registered on the layer besides weight and bias
    (plain attributes go with it), the layers a Hugging Face model keeps in float32 (``_keep_in_fp32_modules``: T5's
    ``wo``), layers whose input a module holding them casts to their weight's dtype (LongT5's ``wo``: float16 at O2),
    layers whose weight the code of a module holding them computes with itself (``self.dt_proj.weight @ x`` in Mamba's
    mixer; ``proj.weight`` for a local ``proj`` bound to ``self.proj`` or to each layer of ``self.layers`` in a loop:
    read from the source of the modules' ``forward``, the methods it calls and the bases' methods it calls through
    ``super()``), bypassing the layer. transformers' ``Conv1D`` projections (GPT-2), mixture-of-experts weights
    (one 3-D parameter per projection, a module with ``num_experts``: Mixtral's ``experts``) and
    ``nn.MultiheadAttention``'s input projections (``in_proj_weight``) are not ``nn.Linear`` and are named in a warning
    too (the filter is asked about a ``Conv1D`` as about a linear layer, not about the others). State dict keys do not
    change, so checkpoints load into the model before or after conversion. A layer whose weight is sharded already
    (tensor parallelism applied first) is converted and named in a warning: it keeps the parallel style it was given
    as ``nn.Linear``, which moves its activations in high precision (convert first for FP8 activation communication).

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
    recipe = resolve_recipe(recipe, "convert_to_fp8(recipe=...)")
    module_filter_fn = _checked_filter(module_filter_fn)
    _check_converted_recipes(module, recipe, module_filter_fn)
    left: dict[str, list[str]] = {reason: [] for reason in _LEFT_BECAUSE}
    shared = shared_parameter_ids(module)
    bypassed = _bypassed_layers(module)
    keep_fp32 = _kept_in_fp32(module)
    done: dict[int, nn.Module] = {}  # a layer registered under several names becomes one FP8Linear (as decided first)
    sharded: list[str] = []  # converted layers whose weight was a DTensor already (parallelized before the conversion)
    # Every layer's decision (the filter's answer too) before the first layer changes: a filter that raises leaves the
    # model as it was. named_modules() gives each module once, under the first name, as replace_children asks.
    reasons = {id(m): _why_left(m, fqn, module_filter_fn, keep_fp32, shared, bypassed)
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
        if _is_dtensor(child.weight):
            sharded.append(fqn or "<root>")
        return FP8Linear.from_linear(child, recipe)  # takes over the layer's forward and backward hooks

    root = convert(module, "")
    if root is not module:  # a bare nn.Linear: its new FP8Linear
        _warn_sharded(sharded)
        keep_scaling_states_per_rank(root)
        return root
    replace_children(module, convert)
    for message in _left_messages(left):
        warn_once(message)
    _warn_sharded(sharded)
    keep_scaling_states_per_rank(module)
    return module


def _warn_sharded(names: list[str]) -> None:
    """Say that layers parallelized before the conversion keep the parallel style they had: the FP8 GEMMs run on
    their shards, but a style made for nn.Linear (torch's, or an FP8 style applied to the nn.Linear) moves their
    activations in high precision, without the FP8 activation communication of sequence parallelism."""
    if names:
        warn_once(
            f"convert_to_fp8 converted {len(names)} linear layer(s) whose weight is sharded already (tensor "
            f"parallelism applied before the conversion): {', '.join(names)}. They run FP8 GEMMs on their shards, "
            "but keep the parallel style they were given as nn.Linear, whose activations travel in high precision (no "
            "FP8 activation communication); for that, call convert_to_fp8 first, then apply_fp8_tensor_parallel (or "
            "parallelize_module with FP8ColwiseParallel / FP8RowwiseParallel)"
        )


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
        try:
            answer = self.fn(layer, fqn)
        except AttributeError as err:
            if isinstance(layer, nn.Linear):
                raise
            # The one other layer asked: transformers' Conv1D (GPT-2), which has no in_features / out_features.
            raise AttributeError(
                f"convert_to_fp8: module_filter_fn raised AttributeError ({err}) for {fqn or '<root>'!r}, a "
                f"{type(layer).__name__}: the filter is asked about transformers' Conv1D (GPT-2's linear layers, "
                "whose sizes are nx / nf) too, which stays in high precision whatever it answers (False also silences "
                "the warning naming it). Handle it, e.g. getattr(module, 'in_features', 0). Nothing was changed"
            ) from err
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
    bypassed = _bypassed_layers(module)
    module_filter_fn = _checked_filter(module_filter_fn)
    found = {fqn: m for fqn, m in module.named_modules()
             if _why_left(m, fqn, module_filter_fn, keep_fp32, shared, bypassed) is None}  # fmt: skip
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


def fp8_modules(module: nn.Module) -> dict[str, FP8Linear]:
    """The FP8 layers of ``module`` by qualified name.

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fp8_modules expects an nn.Module (the model), got {type(module).__name__}")
    return {name: m for name, m in module.named_modules() if isinstance(m, FP8Linear)}
