"""The checks of :class:`~lightning_fp8.distributed.FP8CommState`'s inputs: its constructor's arguments, its
``fp8_params``, a saved state before it loads, and the wrappers' refusals of states they cannot serve; and
:func:`resolve_fused`, which a ``fused`` setting (the state's, or ``FP8WeightAllGather``'s) picks on a device.

Each raises before anything changes, with what was passed and what to pass instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_fp8 import ops
from lightning_fp8.formats import check_fp8_dtype
from lightning_fp8.recipe import MAX_MARGIN, as_count

ALGORITHMS = ("auto", "portable", "native", "gather")
# Binades the native path may add to its pre-scale headroom after overflows (each overflow adds one).
MAX_EXTRA_HEADROOM = 8


def check_args(
    fp8_dtype: torch.dtype, algorithm: str, grad_scaler: Any, margin: Any, fused: Any, slice_numel: Any
) -> tuple[int, int]:
    """Raise for a bad argument of ``FP8CommState(...)`` (the process groups aside); returns ``margin`` and
    ``slice_numel`` as ints (a NumPy integer is one)."""
    check_fp8_dtype(fp8_dtype)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"FP8CommState(algorithm={algorithm!r}) is not supported: choose one of {ALGORITHMS}")
    margin, slice_numel = as_count(margin), as_count(slice_numel)
    for name, value in (("margin", margin), ("slice_numel", slice_numel)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"FP8CommState({name}={value!r}) must be an int, got {type(value).__name__}")
    if margin < 0:
        raise ValueError(f"FP8CommState(margin={margin!r}): must be an int >= 0 (binades of headroom)")
    if margin > MAX_MARGIN:
        raise ValueError(
            f"FP8CommState(margin={margin}) must be <= {MAX_MARGIN}: each unit halves the scale, and E4M3 spans "
            "about 18 binades, 15 of them normal: from margin 15 every E4M3 value is subnormal, and past 16 few "
            "subnormals are left (0 to 2 is usual)"
        )
    if slice_numel < 1:
        raise ValueError(f"FP8CommState(slice_numel={slice_numel!r}): must be an int >= 1 (elements per slice)")
    if grad_scaler is not None and not all(
        callable(getattr(grad_scaler, name, None)) for name in ("record_gradient_cast", "record_nonfinite")
    ):
        raise TypeError(
            f"FP8CommState(grad_scaler=...) got a {type(grad_scaler).__name__}: pass an FP8GradScaler "
            "(it needs record_gradient_cast and record_nonfinite)"
        )
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(
            f"FP8CommState(fused={fused!r}): pass True (Triton kernels), False (PyTorch references) or None "
            "(Triton on CUDA tensors)"
        )
    return margin, slice_numel


def param_ids(fp8_params: Iterable[torch.Tensor]) -> set[int]:
    """The ids of ``FP8CommState(fp8_params=...)``'s tensors, refusing what is not an iterable of tensors."""
    hint = "pass the parameters themselves, e.g. [m.weight for m in model.modules() if isinstance(m, FP8Linear)]"
    if isinstance(fp8_params, (torch.Tensor, nn.Module, str)) or not isinstance(fp8_params, Iterable):
        raise TypeError(f"FP8CommState(fp8_params=...) got a {type(fp8_params).__name__}, not an iterable of tensors: "
                        f"{hint}")  # fmt: skip
    params = list(fp8_params)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"FP8CommState(fp8_params=...) holds a {type(p).__name__} ({p!r:.60}) at index {i}, not a "
                            f"tensor: {hint}")  # fmt: skip
    return {id(p) for p in params}


def checked_saved_state(state_dict: Any) -> tuple[int, int]:
    """``(extra_headroom, reductions)`` of a dict ``FP8CommState.state_dict()`` returned, or the error
    ``FP8CommState.load_state_dict`` raises for it."""
    redo = "load the dict that FP8CommState.state_dict() returned (the checkpoint may be corrupt). Nothing was loaded"
    if not isinstance(state_dict, dict):
        raise TypeError(f"FP8CommState.load_state_dict: got a {type(state_dict).__name__}, not a dict; {redo}")
    expected = {"extra_headroom", "reductions"}
    if set(state_dict) != expected:
        missing, unknown = sorted(expected - set(state_dict)), sorted(map(str, set(state_dict) - expected))
        raise KeyError(
            f"FP8CommState.load_state_dict: missing entries {missing}, unknown entries {unknown} (expected "
            f"{sorted(expected)}); {redo}"
        )
    bounds = {"extra_headroom": (0, MAX_EXTRA_HEADROOM), "reductions": (0, None)}
    values = []
    for name, (low, high) in bounds.items():
        value = as_count(state_dict[name])  # a NumPy integer as an int
        if isinstance(value, bool) or not isinstance(value, int):
            got = repr(value)[:100]
            raise TypeError(f"FP8CommState.load_state_dict: entry {name!r} is {got}, not an int; {redo}")
        if value < low or (high is not None and value > high):
            allowed = f"an int from {low} to {high}" if high is not None else f"an int >= {low}"
            raise ValueError(f"FP8CommState.load_state_dict: entry {name!r} is {value}, expected {allowed}; {redo}")
        values.append(value)
    return values[0], values[1]


def empty_fp8_params_message(where: str) -> str:
    return (
        f"{where}: FP8CommState(fp8_params=...) is empty, but the model has FP8 layers: their gradients are reduced "
        "in their own dtype, not in FP8. Build the list after convert_to_fp8 (and after fully_shard), e.g. "
        "[m.weight for m in model.modules() if isinstance(m, FP8Linear)], or leave fp8_params out"
    )


def refuse_layer_swaps(state: Any, where: str, wrapper: str) -> None:
    """Raise now, not after ``fallback_after`` non-finite steps of training, when the FP8CommState's grad scaler has
    the ``"bf16"`` fallback: it replaces FP8Linear modules by ``nn.Linear``, which ``wrapper`` (what it holds of the
    modules it wraps) cannot follow."""
    if getattr(state.grad_scaler, "nonfinite_fallback", None) == "bf16":
        raise ValueError(
            f"{where}: FP8CommState(grad_scaler=...) has nonfinite_fallback='bf16', which puts layers back to "
            f"nn.Linear by replacing the modules; {wrapper}, so it cannot do that here: use "
            "nonfinite_fallback='lower_lr', a callable, or None"
        )


def _triton_interpreted() -> bool:
    """Whether Triton runs its kernels in its interpreter (CPU tensors), as ``TRITON_INTERPRET=1`` makes it."""
    try:
        from lightning_fp8.kernels import comm
    except ImportError:  # no Triton: no kernel runs anywhere
        return False
    return comm._interpreted(comm._quantize_kernel)


def resolve_fused(
    fused: bool | None, device: torch.device, who: str = "FP8CommState", what: str = "the gradients"
) -> bool:
    """Whether collectives on ``device`` run the Triton kernels for the setting ``fused`` of ``who``: ``None`` picks
    them where they run (Triton installed, a CUDA GPU of compute capability 8.9+), the PyTorch references elsewhere.

    Raises:
        ValueError: for ``fused=True`` without Triton installed, and for tensors off CUDA without Triton's
            interpreter, where the first kernel would fail with Triton's ``RuntimeError: 0 active drivers``, and on
            CUDA devices below compute capability 8.9, for which Triton does not compile its E4M3 type, and on AMD
            GPUs (fnuz FP8 formats).
    """
    if fused is None:
        # As ops.use_triton: without Triton (not installed on Windows, or in a custom build) the references run,
        # on any GPU; the kernels' import failed inside the hook.
        return ops.triton_available() and ops.fp8_device(device)
    if fused and not ops.triton_available():
        raise ValueError(
            f"{who}(fused=True): the Triton kernels need Triton, and Triton is not installed here; install it, or pass "
            "fused=None (Triton where it runs, the PyTorch references elsewhere) or fused=False"
        )
    if fused and device.type != "cuda" and not _triton_interpreted():
        raise ValueError(
            f"{who}(fused=True): {what} are on {device}, where the Triton kernels run only under Triton's interpreter "
            "(TRITON_INTERPRET=1, set before lightning_fp8 is imported); pass fused=None (Triton on CUDA, the PyTorch "
            "references elsewhere) or fused=False"
        )
    if fused and device.type == "cuda" and not ops.fp8_device(device):
        raise ValueError(
            f"{who}(fused=True): {what} are on {device}, and {ops.no_fp8_kernels(device)}; pass fused=None (Triton "
            "on GPUs of compute capability 8.9+, the PyTorch references elsewhere) or fused=False"
        )
    return fused
