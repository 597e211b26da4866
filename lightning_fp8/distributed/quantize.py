"""The elementwise kernels of FP8 communication: the pure-PyTorch references and the dispatch to Triton.

Every function takes a block table (:class:`lightning_fp8.kernels.comm_table.BlockTable`: rows ``(src, dst, length,
value, out)``) and per-segment amaxes, and has the signature and the results, bit for bit, of its Triton kernel in
``kernels/comm.py`` (its docstring has the math). These references expand the table to one index per element, so
they are for CPU runs and tests; on CUDA the collectives use the Triton kernels (:func:`segment_kernels`).
"""

from __future__ import annotations

import functools
import sys
from types import SimpleNamespace

import torch

from lightning_fp8 import ops
from lightning_fp8.formats import fp8_max
from lightning_fp8.kernels.comm_table import BlockTable, check_headroom
from lightning_fp8.scale_rule import compute_scale

_NAMES = ("segment_amax", "quantize", "dequantize", "rows_amax", "rows_quantize", "rows_sum")


def segment_kernels(fused: bool) -> SimpleNamespace:
    """The kernels of this module (``fused=False``) or their Triton versions (``lightning_fp8.kernels.comm``)."""
    return _triton_kernels() if fused else _REFERENCE


@functools.cache
def _triton_kernels() -> SimpleNamespace:
    from lightning_fp8.kernels import comm

    return SimpleNamespace(**{name: _on_its_device(getattr(comm, name)) for name in _NAMES})


def _on_its_device(kernel):
    # Each kernel launches on the device of the buffer it takes first, as torch's ops would (ops.on_device).
    @functools.wraps(kernel)
    def launch(t: torch.Tensor, *args, **kwargs):
        with ops.on_device(t):
            return kernel(t, *args, **kwargs)

    return launch


def _expand(table: BlockTable) -> tuple[torch.Tensor, ...]:
    """Per element of the table's tiles: (src index, dst index, value index, out index)."""
    src, dst, length, value, out = table.rows.unbind(1)
    start = torch.cumsum(length, 0) - length

    def per_element(col: torch.Tensor) -> torch.Tensor:
        return torch.repeat_interleave(col, length, output_size=table.numel)

    within = torch.arange(table.numel, device=length.device) - per_element(start)
    return per_element(src) + within, per_element(dst) + within, per_element(value), per_element(out)


def _scale(amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int, headroom: torch.Tensor | None) -> torch.Tensor:
    scale = compute_scale(amax.float(), fp8_dtype, margin)
    if headroom is not None:  # times 2**-headroom, built from the exponent bits like the kernel (exact)
        scale = scale * ((127 - headroom.to(torch.int32)) << 23).view(torch.float32)
    return scale


def _inverse(scale: torch.Tensor, inv_divisor: float) -> torch.Tensor:
    # inv_divisor / scale for a power-of-two scale: exact reciprocal, one rounding (the kernel's _inverse_pow2).
    return scale.reciprocal() * torch.tensor(inv_divisor, dtype=torch.float32, device=scale.device)


def _fold_amax(target: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    a = values.abs()
    target.scatter_reduce_(0, index, torch.where(torch.isnan(a), torch.inf, a), "amax")


def _cast(y: torch.Tensor, finite: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # Saturate finite values, turn non-finite ones into NaN. Saturated means clipped (|y| > max): the scales come from
    # the exact amax, so the amax lands on the maximum whenever its mantissa equals the maximum's (common for a mean of
    # FP8 values), and that loses nothing.
    fmax = fp8_max(fp8_dtype)
    n_saturated = ((y.abs() > fmax) & finite).sum()
    return torch.where(finite, y.clamp(-fmax, fmax), torch.nan).to(fp8_dtype).view(torch.uint8), n_saturated


def _to_out(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Saturated at the dtype's largest finite value (NaN stays NaN): the FP8 rounding of a mean of finite values can
    # reach the next power of two above the dtype's range (the kernels' _store). y is fp32: a float64 output is
    # saturated at fp32's (its own would not convert to y's dtype).
    limit = min(torch.finfo(dtype).max, torch.finfo(y.dtype).max)
    return y.clamp(-limit, limit).to(dtype)


def _decode(q: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    return q.view(torch.uint8).view(fp8_dtype).float()


def segment_amax(x: torch.Tensor, table: BlockTable, amax: torch.Tensor) -> None:
    src, _, value, _ = _expand(table)
    _fold_amax(amax, value, x.reshape(-1)[src].float())


def quantize(x, table, amax, fp8_dtype, out, n_sat, *, margin=0, headroom=None) -> None:
    check_headroom(headroom, "quantize")
    src, dst, value, _ = _expand(table)
    x32 = x.reshape(-1)[src].float()
    q, n = _cast(x32 * _scale(amax, fp8_dtype, margin, headroom)[value], torch.isfinite(x32), fp8_dtype)
    out.view(torch.uint8).reshape(-1)[dst] = q
    n_sat += n


def dequantize(q, table, amax, fp8_dtype, out, *, margin=0, headroom=None, inv_divisor=1.0, counts=None) -> None:
    check_headroom(headroom, "dequantize")
    src, dst, value, _ = _expand(table)
    q32 = _decode(q.view(torch.uint8).reshape(-1)[src], fp8_dtype)
    if counts is not None:  # the decode of an FP8 sum: sums that overflowed (non-finite) or reached the maximum
        nonfinite = ~torch.isfinite(q32)
        counts[0] += (nonfinite | (q32.abs() >= fp8_max(fp8_dtype))).sum()
        counts[1] += nonfinite.sum()
    scale_inv = _inverse(_scale(amax, fp8_dtype, margin, headroom), inv_divisor)
    out.reshape(-1)[dst] = _to_out(q32 * scale_inv[value], out.dtype)


def _rows_mean(rows, table, amax, fp8_dtype, margin, inv_divisor):
    src, dst, value, out = _expand(table)
    picked = rows.view(torch.uint8)[:, src]
    acc = _decode(picked[0], fp8_dtype)
    for r in range(1, picked.shape[0]):  # in rank order, as the kernel sums (fp32 addition is not associative)
        acc = acc + _decode(picked[r], fp8_dtype)
    mean = acc * _inverse(_scale(amax, fp8_dtype, margin, None), inv_divisor)[value]
    limit = torch.finfo(torch.float32).max  # the product of finite values can overflow fp32: the mean stays finite
    return mean.clamp(-limit, limit), dst, out


def rows_amax(rows, table, amax, piece_amax, fp8_dtype, *, margin=0, inv_divisor=1.0) -> None:
    mean, _, piece = _rows_mean(rows, table, amax, fp8_dtype, margin, inv_divisor)
    _fold_amax(piece_amax, piece, mean)


def rows_quantize(rows, table, amax, piece_amax, fp8_dtype, out, n_sat, *, margin=0, inv_divisor=1.0) -> None:
    mean, dst, piece = _rows_mean(rows, table, amax, fp8_dtype, margin, inv_divisor)
    q, n = _cast(mean * compute_scale(piece_amax, fp8_dtype, margin)[piece], torch.isfinite(mean), fp8_dtype)
    out.view(torch.uint8).reshape(-1)[dst] = q
    n_sat += n


def rows_sum(rows, table, amax, fp8_dtype, out, *, margin=0, inv_divisor=1.0) -> None:
    mean, dst, _ = _rows_mean(rows, table, amax, fp8_dtype, margin, inv_divisor)
    out.reshape(-1)[dst] = _to_out(mean, out.dtype)


_REFERENCE = SimpleNamespace(**{name: getattr(sys.modules[__name__], name) for name in _NAMES})
