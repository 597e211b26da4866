"""The scale rule: the power-of-two scale a cast takes from an amax, ``2 ** (floor(log2(fp8_max / amax)) - margin)``,
computed exactly from fp32 bit patterns (DESIGN.md's scale convention). :mod:`lightning_fp8.scaling`'s states, the
optimizer's scaled moments and masters, and the distributed casts all take their scales from it; the kernels share its
reference (``kernels/reference.py: pow2_scale_ref``).
"""

from __future__ import annotations

import math
import numbers

import torch

from lightning_fp8.cast_checks import checked_prev_scale
from lightning_fp8.formats import fp8_max
from lightning_fp8.kernels import reference
from lightning_fp8.recipe import MAX_MARGIN, as_count


def _format_max(dtype: torch.dtype) -> float:
    # fp16 is accepted too: the optimizer stores fp16 states with a power-of-two scale (max 65504).
    return 65504.0 if dtype == torch.float16 else fp8_max(dtype)


def compute_scale(
    amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0, prev_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Power-of-two scale ``2 ** (floor(log2(fp8_max / amax)) - margin)`` as a fp32 tensor of ``amax``'s shape.

    The exponent is computed exactly from the fp32 bit patterns (no ``log2`` rounding): ``amax * scale``
    never exceeds ``fp8_max / 2**margin`` and doubling the scale would (unless that scale lies outside
    ``2**-126 .. 2**127``, the range the result is clamped to). Where ``amax`` is 0 or not finite, the result is
    ``prev_scale`` (1.0 when there is none).

    The amax is taken in fp32. A float64 amax (or a Python number) is rounded up to the next fp32 value, so the
    headroom above holds for the value given (448.000001 gets the scale of the fp32 number above it, 0.5 for
    E4M3); one beyond fp32's range (above 3.4e38) becomes inf and, like any non-finite amax, gives ``prev_scale``.

    Args:
        amax: a 0-dim (or any-shape, elementwise) floating-point tensor of absolute maxima, or a Python number.
        fp8_dtype: the format the scale targets (an FP8 dtype, or ``torch.float16`` for scaled fp16 storage).
        margin: binades of headroom: an int from 0 to :data:`lightning_fp8.recipe.MAX_MARGIN`.
        prev_scale: the scale to keep where ``amax`` carries no information: a real tensor (taken as fp32; 0-dim or
            of ``amax``'s shape), a number (a positive power of two) or None.

    Raises:
        TypeError: if ``amax`` is neither a floating-point tensor nor a number, ``margin`` is not an int, or
            ``prev_scale`` is neither a real (not bool, not complex) tensor nor a number.
        ValueError: if ``amax`` is a negative number (a tensor's values are not checked: that would synchronize with
            the device), ``margin`` is outside ``[0, MAX_MARGIN]``, ``fp8_dtype`` is not a supported format,
            ``prev_scale`` is a number (or a bool) that is no positive power of two in ``2**-126 .. 2**127``, is a
            meta tensor (for an ``amax`` with values), or does not broadcast to ``amax``'s shape.
    """
    margin = as_count(margin)  # a NumPy integer as FP8Recipe and ScalingState take it
    if isinstance(margin, bool) or not isinstance(margin, int):
        raise TypeError(
            f"compute_scale(margin={margin!r}) must be an int (binades of headroom), got {type(margin).__name__}"
        )
    if not 0 <= margin <= MAX_MARGIN:
        raise ValueError(f"compute_scale(margin={margin}) must be in [0, {MAX_MARGIN}] (binades of headroom)")
    if isinstance(amax, numbers.Real) and not isinstance(amax, bool):  # NumPy numbers too
        if amax < 0:  # a tensor's sign is not checked: that would wait for the device (a host sync per cast)
            raise ValueError(
                f"compute_scale(amax={amax!r}): amax is an absolute maximum (max |x|, >= 0), got a negative number; "
                "pass the largest magnitude, e.g. x.abs().max()"
            )
        try:
            value = float(amax)
        except OverflowError:  # an int beyond float64's range: beyond fp32's too, so inf (prev_scale), as documented
            value = math.inf
        amax = torch.tensor(value, dtype=torch.float64)
    if not isinstance(amax, torch.Tensor) or not amax.is_floating_point():
        kind = f"a {amax.dtype} tensor" if isinstance(amax, torch.Tensor) else type(amax).__name__
        raise TypeError(f"compute_scale(amax=...) takes a floating-point tensor or a number, got {kind}")
    if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float16):
        raise ValueError(
            f"compute_scale(fp8_dtype={fp8_dtype!r}) is not a format it scales for: pass torch.float8_e4m3fn (E4M3), "
            "torch.float8_e5m2 (E5M2) or torch.float16 (scaled fp16 storage)"
        )
    fmax = _format_max(fp8_dtype)
    if amax.dtype == torch.float64:  # to fp32 rounding up: a smaller amax would get a scale too large for it
        a32 = amax.float()
        amax = torch.where(a32.double() < amax, torch.nextafter(a32, torch.full_like(a32, torch.inf)), a32)
    if prev_scale is None:
        prev_scale = torch.ones((), dtype=torch.float32, device=amax.device)
    else:
        prev_scale = checked_prev_scale(prev_scale)
    if isinstance(prev_scale, torch.Tensor) and prev_scale.is_meta and not amax.is_meta:  # no values to move
        raise ValueError(
            f"compute_scale(prev_scale=...) is on the meta device (no values) but amax on {amax.device}: pass a "
            "prev_scale with values (on amax's device)"
        )
    prev_scale = torch.as_tensor(prev_scale, dtype=torch.float32, device=amax.device)
    try:
        fits = torch.broadcast_shapes(prev_scale.shape, amax.shape) == amax.shape
    except RuntimeError:  # not broadcastable at all
        fits = False
    if not fits:
        raise ValueError(
            f"compute_scale(prev_scale=...) of shape {tuple(prev_scale.shape)} does not fit amax's shape "
            f"{tuple(amax.shape)}: pass one scale (0-dim) or one per amax"
        )
    return reference.pow2_scale_ref(amax, fmax, margin, prev_scale)
