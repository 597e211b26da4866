"""The elementwise kernels of FP8 communication: per-segment amax, cast, decode, decode-and-sum.

Each kernel takes per-segment values (scales) and the segments' end offsets, and expands the values to
elements. Eagerly (CPU, tests) the expansion is a ``repeat_interleave`` and a single segment broadcasts; under
``torch.compile`` (CUDA) it is a ``bucketize`` of the element index, which fuses into the kernel's one pass, so a
cast reads its input once and writes one byte per element.

The cast is the reference cast (``kernels/reference.py: cast_to_fp8_ref``) with a per-element scale.
"""

from __future__ import annotations

import functools

import torch

from lightning_fp8.formats import fp8_max


def _expand(values: torch.Tensor, ends: torch.Tensor, numel: int) -> torch.Tensor:
    if values.numel() == 1:
        return values
    if torch.compiler.is_compiling():
        index = torch.bucketize(torch.arange(numel, device=values.device), ends, right=True)
        return values[index.clamp_(max=max(values.numel() - 1, 0))]
    lengths = torch.diff(ends, prepend=ends.new_zeros(1))
    return torch.repeat_interleave(values, lengths, output_size=numel)


def _quantize(
    x: torch.Tensor, ends: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    # Saturate finite values, turn non-finite ones into NaN. Saturated means clipped (|y| > max): these scales
    # come from the exact amax, so the amax lands on the maximum whenever its mantissa equals the maximum's
    # (common for a mean of FP8 values), and that loses nothing.
    fmax = fp8_max(fp8_dtype)
    x32 = x.reshape(-1).float()
    y = x32 * _expand(scale, ends, x32.numel())
    finite = torch.isfinite(x32)
    n_saturated = ((y.abs() > fmax) & finite).sum()
    y = torch.where(finite, y.clamp(-fmax, fmax), torch.nan)
    return y.to(fp8_dtype), n_saturated


def _dequantize(q: torch.Tensor, ends: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    # `q` may be a strided view (rows of a gathered buffer): under torch.compile the flattening fuses in.
    q32 = q.reshape(-1).float()
    return (q32 * _expand(scale_inv, ends, q32.numel())).to(out_dtype)


def _dequantize_checked(
    q: torch.Tensor, ends: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype, fmax: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The decode of an FP8 sum: also counts sums that overflowed (non-finite) or reached the maximum.
    q32 = q.reshape(-1).float()
    nonfinite = ~torch.isfinite(q32)
    n_overflow = (nonfinite | (q32.abs() >= fmax)).sum()
    return (q32 * _expand(scale_inv, ends, q32.numel())).to(out_dtype), n_overflow, nonfinite.any()


def _dequant_sum(rows: torch.Tensor, ends: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    # rows: (world, chunk) FP8 values sharing one scale per column: sum them in fp32, then scale once.
    return rows.float().sum(0) * _expand(scale_inv, ends, rows.shape[1])


_KERNELS = {
    "quantize": _quantize,
    "dequantize": _dequantize,
    "dequantize_checked": _dequantize_checked,
    "dequant_sum": _dequant_sum,
}


@functools.cache
def _compiled(name: str):
    return torch.compile(_KERNELS[name], dynamic=True)


def kernel(name: str, compiled: bool):
    """The elementwise kernel ``name`` (a key of ``_KERNELS``), eager or compiled with ``torch.compile``."""
    return _compiled(name) if compiled else _KERNELS[name]


def segment_amax(x: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """``max|x|`` of each consecutive segment of flat ``x`` as fp32 (0 for an empty one, inf where NaN).

    NaN becomes inf because a MAX all-reduce need not propagate NaN; inf it does.
    """
    amaxes, start = [], 0
    zero = torch.zeros((), dtype=torch.float32, device=x.device)
    for length in lengths:
        seg = x[start : start + length]
        amaxes.append(torch.linalg.vector_norm(seg, float("inf")).float() if length else zero)
        start += length
    if not amaxes:
        return torch.zeros(0, dtype=torch.float32, device=x.device)
    amax = torch.stack(amaxes)
    return torch.where(torch.isnan(amax), torch.inf, amax)
