"""What each saved value of an FP8 state dict must be to load into a scaling state's buffer.

:func:`~lightning_fp8.state.load_fp8_state_dict` matches a checkpoint to the model (names, strictness, the recipe
settings); before it copies anything, every value it would copy is checked here: the dict itself (string keys), each
tensor's kind (a plain tensor of real numbers, of the buffer's kind), shape, exactness in the buffer's dtype, and
range (a scale a power of two that casts can produce, a non-negative amax, a saturation in [0, 1], an ``initialized``
flag of 0 or 1). A corrupt or hand-made checkpoint then fails with an error naming the entry, and changes nothing.
Apart from :mod:`lightning_fp8.state` because these checks know only the buffers, not the model.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

# The scales casts and FP8AdamW produce: pow2_scale_ref (kernels/reference.py) and the kernels clamp the exponent to
# [-126, 127], so a scale is a normal fp32 number with a finite reciprocal. Below, it is subnormal, and from 2**-128
# down its reciprocal is inf: the next cast, or the next optimizer step, writes NaN.
MIN_SCALE, MAX_SCALE = 2.0**-126, 2.0**127


def _check_mapping(state_dict: object) -> None:
    fix = "pass the dict fp8_state_dict() returned (the checkpoint may be corrupt)"
    if not isinstance(state_dict, Mapping):
        kind = type(state_dict).__name__
        raise TypeError(f"load_fp8_state_dict: the FP8 scaling state is a {kind}, not a dict: {fix}")
    odd = [key for key in state_dict if not isinstance(key, str)]
    if odd:
        raise TypeError(f"load_fp8_state_dict: the FP8 scaling state has keys that are not strings {odd[:5]}: {fix}")


def _is_number_tensor(value: object) -> bool:
    """Whether ``value`` is a plain (strided, not nested) tensor of real numbers: not bool, not complex."""
    return (
        isinstance(value, torch.Tensor)
        and value.layout == torch.strided
        and not value.is_nested
        and value.dtype != torch.bool
        and not value.is_complex()
    )


def _kind(value: object) -> str:
    """What ``value`` is, for an error message."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    layout = "nested " if value.is_nested else "" if value.layout == torch.strided else f"{value.layout} "
    return f"a {layout}{value.dtype} tensor"


def _shape(value: object) -> str:
    """``value``'s shape, for an error message (a nested tensor has none)."""
    if not isinstance(value, torch.Tensor):
        return "()"
    return "(nested)" if value.is_nested else str(tuple(value.shape))


def _check_initialized(key: str, value: object) -> bool:
    """The flag an ``initialized`` entry (``key``) holds; raise unless it is one integer, 0 or 1."""
    fix = "the checkpoint is corrupt or not an fp8_state_dict(); save it again, or load the model without it"
    if not _is_number_tensor(value) or value.numel() != 1 or value.is_floating_point():
        kind, shape = _kind(value), _shape(value)
        raise TypeError(f"FP8 scaling state {key!r} is {kind} of shape {shape}, expected one integer, 1 or 0: {fix}")
    flag = int(value.detach().cpu().reshape(()))
    if flag not in (0, 1):
        raise ValueError(f"FP8 scaling state {key!r} holds {flag}, but it must be 1 or 0: {fix}")
    return bool(flag)


def _check_value(key: str, buf_name: str, value: object, buf: torch.Tensor) -> None:
    """Raise if ``value`` cannot be loaded into the scaling-state buffer ``buf`` (named ``buf_name``)."""
    fix = "the checkpoint is corrupt or not an fp8_state_dict(); save it again, or load the model without it"
    if not _is_number_tensor(value) or value.is_floating_point() != buf.is_floating_point():
        raise TypeError(f"FP8 scaling state {key!r} is {_kind(value)}, expected a {buf.dtype} tensor: {fix}")
    if buf.shape != value.shape:
        # Only a history's length follows the recipe (amax_history_len); every other buffer is one number.
        why = "amax_history_len differs?" if buf_name == "amax_history" and value.dim() == buf.dim() == 1 else fix
        raise ValueError(
            f"FP8 scaling state {key!r} has shape {tuple(value.shape)} in the checkpoint but "
            f"{tuple(buf.shape)} in the model ({why})"
        )
    # Checked as it will be stored: the buffer's dtype (a float64 2**200 is a power of two, and inf in fp32).
    saved = value.detach().cpu()
    stored = saved.to(buf.dtype)
    same = stored.to(saved.dtype) == saved
    if saved.is_floating_point():
        same = same | (torch.isnan(saved) & torch.isnan(stored))  # NaN: refused below, as what it is
    if not same.all():
        raise ValueError(
            f"FP8 scaling state {key!r} holds {_entry(saved, ~same)}, which a {buf.dtype} buffer cannot hold exactly "
            f"(it would be {_entry(stored, ~same)}): {fix}"
        )
    v = stored.double()
    if buf_name == "scale":  # NaN fails every comparison: out of range
        good = (v >= MIN_SCALE) & (v <= MAX_SCALE) & (torch.frexp(v).mantissa == 0.5)
        what = "a power of two from 2**-126 to 2**127 (the scales casts produce)"
    elif buf_name == "saturation":
        good, what = (v >= 0) & (v <= 1), "in [0, 1]"
    elif buf_name == "amax_history":  # a cast records a non-finite amax as 0 here (no information)
        good, what = (v >= 0) & (v < float("inf")), "finite and non-negative"
    else:  # amax (inf is a recorded overflow), nonfinite_count, casts
        good, what = v >= 0, "non-negative"
    if not good.all():
        raise ValueError(f"FP8 scaling state {key!r} holds {_entry(stored, ~good)}, but it must be {what}: {fix}")


def _entry(value: torch.Tensor, bad: torch.Tensor) -> str:
    """``value`` as an error shows it: the number itself where it is one, else (an amax history, 1-D, up to thousands
    of values) its first entry where ``bad`` is True, with its index and the size."""
    if value.numel() == 1:
        return repr(value.reshape(()).item())
    index = int(bad.reshape(-1).nonzero()[0])
    return f"{value.reshape(-1)[index].item()!r} at index {index} (of {tuple(value.shape)})"
