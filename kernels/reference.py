"""Pure-PyTorch references of the Triton kernels, one function per kernel with the same signature.

They define the numerics: a Triton kernel must match its reference bit for bit (casts, optimizer
states) on any valid input. They also run everything on devices without Triton (CPU in CI).

The scale convention (DESIGN.md): ``x_fp8 = saturate(x * scale)``, ``x ~= x_fp8.float() * scale_inv``.
"""

from __future__ import annotations

import torch

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def amax_ref(x: torch.Tensor) -> torch.Tensor:
    """``max(|x|)`` as a 0-dim fp32 tensor; NaN counts as ``inf`` so a non-finite tensor has a non-finite amax.

    An empty tensor has amax 0.
    """
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    a = x.detach().float().abs()
    return torch.where(torch.isnan(a), torch.inf, a).amax()


def cast_to_fp8_ref(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Saturating scaled cast to FP8, with an optional transposed copy, the amax and a saturation count.

    ``y = x.float() * scale``; finite ``y`` is clamped to ``[-fp8_max, fp8_max]`` and rounded to nearest
    even; a non-finite ``x`` becomes NaN (so overflow is never hidden by the clamp).

    Args:
        x: a floating-point tensor (any shape; 2-D when ``transpose``).
        scale: 0-dim fp32 tensor, a power of two.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        transpose: also return ``x_fp8.t().contiguous()`` (the copy the backward GEMMs need).

    Returns:
        ``(x_fp8, x_fp8_t, amax, n_saturated)``: ``x_fp8`` has ``x``'s shape; ``x_fp8_t`` is the
        transposed copy or an empty tensor; ``amax`` is :func:`amax_ref` of ``x`` (unscaled); ``n_saturated``
        is a 0-dim int64 count of finite elements with ``|x * scale| >= fp8_max``.
    """
    fp8_max = _FP8_MAX[fp8_dtype]
    x32 = x.detach().float()
    y = x32 * scale
    finite = torch.isfinite(x32)
    n_saturated = ((y.abs() >= fp8_max) & finite).sum()
    y = torch.where(finite, y.clamp(-fp8_max, fp8_max), torch.nan)
    x_fp8 = y.to(fp8_dtype)
    if transpose:
        x_fp8_t = x_fp8.t().contiguous()
    else:
        x_fp8_t = torch.empty(0, dtype=fp8_dtype, device=x.device)
    return x_fp8, x_fp8_t, amax_ref(x), n_saturated
