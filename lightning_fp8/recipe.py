"""FP8Recipe: the frozen configuration of FP8-LM training.

A recipe answers: which FP8 formats (hybrid E4M3/E5M2 or all-E4M3), how scales are chosen (delayed
from an amax history, or current from the tensor itself), and how much of the optimizer runs in low
precision (opt level O1 or O2, see DESIGN.md "Optimization levels").
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

import torch

from lightning_fp8.formats import E4M3, E5M2

FP8Format = Literal["hybrid", "e4m3"]
Scaling = Literal["delayed", "current"]
AmaxComputeAlgo = Literal["max", "most_recent"]
OptLevel = Literal["O1", "O2"]

# The largest margin a recipe takes (binades of headroom; E4M3 spans about 18 binades, subnormals included).
MAX_MARGIN = 16
# The longest amax history a recipe takes: the cast kernels hold the whole window in one block of a program
# (kernels/scaling.py), and Transformer Engine's longest recommended window is 1024.
MAX_AMAX_HISTORY_LEN = 4096
_ALLOWED: dict[str, tuple[str, ...]] = {
    "fp8_format": ("hybrid", "e4m3"),
    "scaling": ("delayed", "current"),
    "amax_compute_algo": ("max", "most_recent"),
    "opt_level": ("O1", "O2"),
}


class ArgumentTypeError(TypeError, ValueError):
    """An argument (a setting) of the wrong type: a ``TypeError``, and a ``ValueError`` like every other bad value of
    it (callers may catch either). A value of the right type out of range raises ``ValueError``."""


class RecipeFieldTypeError(ArgumentTypeError):
    """An :class:`FP8Recipe` field of the wrong type: a ``TypeError``, and a ``ValueError`` like every other bad
    recipe value (callers may catch either)."""


def check_settings(
    owner: str,
    choices: dict[str, tuple[object, tuple[str, ...]]],
    counts: dict[str, tuple[object, int]],
    type_error: type[TypeError] = TypeError,
) -> None:
    """Raise for a bad scaling setting of ``owner`` (an FP8Recipe, a ScalingState): each of ``choices`` (name:
    ``(value, allowed strings)``), then each of ``counts`` (name: ``(value, lowest int)``), a ``"margin"`` count
    above :data:`MAX_MARGIN` and an ``"amax_history_len"`` or ``"history_len"`` count above
    :data:`MAX_AMAX_HISTORY_LEN`. ``type_error`` for a value of the wrong type, ValueError for one out of range."""
    for name, (value, allowed) in choices.items():
        if not isinstance(value, str):
            raise type_error(
                f"{owner}({name}={value!r}) must be a string, got {type(value).__name__}: choose one of {list(allowed)}"
            )
        if value not in allowed:
            raise ValueError(f"{owner}({name}={value!r}) is not supported: choose one of {list(allowed)}")
    for name, (value, low) in counts.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise type_error(f"{owner}({name}={value!r}) must be an int, got {type(value).__name__}")
        if value < low:
            raise ValueError(f"{owner}({name}={value!r}) must be >= {low}")
    margin = counts.get("margin", (0, 0))[0]
    if margin > MAX_MARGIN:
        raise ValueError(
            f"{owner}(margin={margin}) must be <= {MAX_MARGIN}: each unit halves the scale, and E4M3 spans about 18 "
            "binades, 15 of them normal: from margin 15 every E4M3 value is subnormal, and past 16 few subnormals are "
            "left (0 to 2 is usual)"
        )
    for name in ("amax_history_len", "history_len"):
        if name in counts and counts[name][0] > MAX_AMAX_HISTORY_LEN:
            raise ValueError(
                f"{owner}({name}={counts[name][0]}) must be <= {MAX_AMAX_HISTORY_LEN}: the cast kernels keep the whole "
                "window in one block (16 to 1024 is usual)"
            )


def check_flag(owner: str, name: str, value: Any, error: type[TypeError] = TypeError) -> bool:
    """``value`` if it is a bool, else raise ``error`` naming ``owner(name=value)``: a truthy string such as ``"no"``
    or a NumPy bool would otherwise switch a feature on (or off) against what was meant."""
    if not isinstance(value, bool):
        kind = type(value).__name__  # NumPy 2 names its bool "bool": say whose it is, or "got bool" reads as a riddle
        kind = kind if type(value).__module__ == "builtins" else f"{type(value).__module__}.{kind}"
        raise error(f"{owner}({name}={value!r}): must be True or False (a Python bool), got {kind}")
    return value


def as_count(value: Any) -> Any:
    """``value`` as an ``int`` if it is a NumPy (or other ``numbers.Integral``) integer, not a bool; else unchanged,
    for :func:`check_settings` to judge."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return int(value)
    return value


def as_choice(value: Any) -> Any:
    """``value`` as a plain ``str`` if it is a ``str`` subclass (a NumPy string, a ``StrEnum`` member); else
    unchanged. Kept as it was, it would reach checkpoints through :meth:`FP8Recipe.to_dict` as a pickled class,
    which ``torch.load(weights_only=True)`` refuses."""
    return str.__str__(value) if isinstance(value, str) else value


@dataclass(frozen=True, kw_only=True)
class FP8Recipe:
    """How FP8 training casts, scales and stores tensors.

    Args:
        fp8_format: ``"hybrid"`` (E4M3 forward, E5M2 gradients; the default) or ``"e4m3"`` (E4M3 everywhere).
        scaling: ``"delayed"`` (scale from the amax history of earlier steps; one pass per cast) or
            ``"current"`` (scale from this tensor's own amax; two passes). Weights always use their
            current amax, which is exact and cheap.
        amax_history_len: length of the amax history window for delayed scaling (1 to :data:`MAX_AMAX_HISTORY_LEN`).
        amax_compute_algo: ``"max"`` over the history window, or ``"most_recent"`` entry.
        margin: the scale is ``2 ** (floor(log2(fp8_max / amax)) - margin)``; a margin of 1 leaves one
            binade of headroom (0 to :data:`MAX_MARGIN`).
        opt_level: ``"O1"`` (FP8 GEMMs and gradients, fp32 optimizer states) or ``"O2"`` (also FP8 first
            moment, fp16 second moment and fp16 master weights: 6 bytes per parameter).

    Example:
        >>> FP8Recipe.from_name("fp8-lm").scaling
        'delayed'
        >>> FP8Recipe(scaling="current", margin=1).margin
        1
    """

    fp8_format: FP8Format = "hybrid"
    scaling: Scaling = "delayed"
    amax_history_len: int = 16
    amax_compute_algo: AmaxComputeAlgo = "max"
    margin: int = 0
    opt_level: OptLevel = "O2"

    def __post_init__(self) -> None:
        for name in ("amax_history_len", "margin"):
            object.__setattr__(self, name, as_count(getattr(self, name)))
        for name in _ALLOWED:
            object.__setattr__(self, name, as_choice(getattr(self, name)))
        check_settings(
            "FP8Recipe",
            {name: (getattr(self, name), allowed) for name, allowed in _ALLOWED.items()},
            {"amax_history_len": (self.amax_history_len, 1), "margin": (self.margin, 0)},
            RecipeFieldTypeError,
        )

    @property
    def forward_dtype(self) -> torch.dtype:
        """FP8 dtype of activations and weights."""
        return E4M3

    @property
    def backward_dtype(self) -> torch.dtype:
        """FP8 dtype of gradients (E5M2 for ``"hybrid"``, E4M3 for ``"e4m3"``)."""
        return E5M2 if self.fp8_format == "hybrid" else E4M3

    @classmethod
    def from_name(cls, name: str) -> FP8Recipe:
        """A named recipe: one of :meth:`names`.

        Raises:
            TypeError: if ``name`` is not a string.
            ValueError: if ``name`` is not a known recipe.
        """
        if not isinstance(name, str):
            raise TypeError(f"FP8Recipe.from_name takes a recipe name (one of {sorted(_NAMED)}), got {name!r}")
        if name not in _NAMED:
            raise ValueError(f"unknown FP8 recipe name {name!r}: choose one of {sorted(_NAMED)}")
        return cls(**_NAMED[name])

    @staticmethod
    def names() -> list[str]:
        return sorted(_NAMED)

    def same_scaling(self, other: FP8Recipe | str) -> bool:
        """Whether the scaling states of ``other``'s layers (a recipe or a recipe name) mean what this recipe's do
        (format, scaling, amax history and algorithm, margin): a checkpoint's scales and amax histories carry over
        only then."""
        if not isinstance(other, (FP8Recipe, str)):
            raise TypeError(f"FP8Recipe.same_scaling takes a recipe or a recipe name, got {other!r}")
        other = resolve_recipe(other)
        fields = ("fp8_format", "scaling", "amax_history_len", "amax_compute_algo", "margin")
        return all(getattr(self, f) == getattr(other, f) for f in fields)

    def to_dict(self) -> dict[str, Any]:
        """The recipe's fields as a plain dict (what :meth:`from_dict` reads back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> FP8Recipe:
        """Build a recipe from a mapping (e.g. a YAML config), rejecting unknown keys.

        Raises:
            TypeError: if ``values`` is not a mapping (a recipe name goes to :meth:`from_name`).
            ValueError: for an unknown key, or a value the recipe refuses.
        """
        known = {f.name for f in fields(cls)}
        if not isinstance(values, Mapping):
            # A string would be taken for its characters (each an unknown field), a list of pairs for its pairs.
            hint = f"; for a named recipe use FP8Recipe.from_name({values!r})" if isinstance(values, str) else ""
            raise TypeError(
                f"FP8Recipe.from_dict takes a mapping of recipe fields (e.g. {{'scaling': 'current'}}; allowed fields "
                f"are {sorted(known)}), got {type(values).__name__} {values!r}{hint}"
            )
        unknown = set(values) - known
        if unknown:  # key=repr: keys of other types than str do not compare with each other
            # A base recipe's name (as LIGHTNING_FP8_RECIPE's JSON and the config section take it) is no field here.
            base = next((values[k] for k in ("name", "recipe") if k in unknown and isinstance(values[k], str)), None)
            hint = "" if base is None else f"; a named recipe with changes: FP8Recipe.from_name({base!r}).replace(...)"
            raise ValueError(
                f"unknown FP8Recipe field(s) {sorted(unknown, key=repr)}: allowed fields are {sorted(known)}{hint}"
            )
        return cls(**values)

    def replace(self, **changes: Any) -> FP8Recipe:
        """A copy of this recipe with ``changes`` applied, validated as a new recipe.

        Raises:
            TypeError: for a keyword that is not a recipe field, or a value of the wrong type.
            ValueError: for a value the recipe refuses.
        """
        known = {f.name for f in fields(self)}
        unknown = set(changes) - known
        if unknown:  # dataclasses.replace would only say "unexpected keyword argument", not what is allowed
            raise TypeError(
                f"FP8Recipe.replace got unknown field(s) {sorted(unknown)}: allowed fields are {sorted(known)}"
            )
        return replace(self, **changes)


_NAMED: dict[str, dict[str, Any]] = {
    # FP8-LM as in the paper: hybrid formats, delayed scaling, O2 optimizer.
    "fp8-lm": {},
    "fp8-lm-o1": {"opt_level": "O1"},
    # Just-in-time scaling: every cast uses the tensor's own amax (robust, two passes).
    "fp8-lm-current": {"scaling": "current"},
    # All-E4M3: gradients in E4M3 too (more precision, less range).
    "fp8-lm-e4m3": {"fp8_format": "e4m3"},
}


def resolve_recipe(recipe: FP8Recipe | str | None, where: str = "recipe") -> FP8Recipe:
    """Accept a recipe, a recipe name, or ``None`` (the ``"fp8-lm"`` default); ``where`` names the argument in the
    error for anything else (e.g. ``"FP8Linear(recipe=...)"``)."""
    if recipe is None:
        return FP8Recipe()
    if isinstance(recipe, str):
        return FP8Recipe.from_name(recipe)
    if not isinstance(recipe, FP8Recipe):
        raise TypeError(
            f"{where} must be an FP8Recipe, a recipe name ({FP8Recipe.names()}) or None, got {type(recipe).__name__}"
            + (": e.g. FP8Recipe(**fields), or FP8Recipe.from_dict(fields)" if isinstance(recipe, Mapping) else "")
        )
    return recipe
