"""Segmented FP8 kernels of gradient communication: amax, cast, decode, and the sum of received rows.

A collective moves flat buffers made of *segments* (tensors, or their pieces), each with its own power-of-two
scale. Every kernel here reads a *block table*, one row per tile of at most ``BLOCK`` elements that never
straddles a segment::

    table[i] = (src, dst, length, value, out)        int64
        src, dst   offsets of the tile in the input and in the output (any layout: strided rows, padding, ...)
        length     elements of the tile (<= BLOCK)
        value      index of the tile's scale, given as an amax (the scale is computed in registers)
        out        index of a second per-segment value (the piece amax of a requantization)

One program per row, so one launch covers every segment of a bucket and reads each element once; per-segment
results (amaxes, counters) are folded in with atomics. Math, in fp32, bit for bit the references in
``lightning_fp8/distributed/quantize.py``::

    scale(a)       = 2 ** (floor(log2(fp8_max / a)) - margin)   fp32 bits; 1 where a is 0 or not finite
    s_q            = scale(amax[value]) * 2**-headroom           (headroom: 0 unless given)
    segment_amax:  amax[value] = max(amax[value], max |x|)                    NaN counts as inf
    quantize:      q = RNE(clamp(x * s_q, +-fp8_max)), NaN where x is not finite;  n_sat += #{|x * s_q| > fp8_max}
    dequantize:    out = q * (inv_divisor * 2**-log2(s_q))        counts += (#{q not finite or |q| >= fp8_max},
                                                                             #{q not finite})   when checked
    rows_*:        acc = q_0 + q_1 + ... + q_{W-1} (fp32, in rank order),  mean = acc * (inv_divisor / scale)
        rows_amax:     piece_amax[out] = max(piece_amax[out], max |mean|)
        rows_quantize: q' = RNE(clamp(mean * scale(piece_amax[out]), +-fp8_max));  n_sat += #{saturated}
        rows_sum:      out = mean, in out's dtype

``1 / s`` is built from the exponent bits (exact), so ``inv_divisor / s`` is one fp32 rounding of ``1 / (s N)``.
FP8 bytes are decoded with integer arithmetic (E5M2 is the top byte of an fp16); E4M3 uses the hardware
conversion on a GPU. Under ``TRITON_INTERPRET=1`` the interpreter's own conversions are wrong in places
(fp32 -> FP8 and fp32 -> bf16 do not round to nearest even, FP8 NaN/inf bytes decode to numbers), so there the
kernels round and decode with integer arithmetic (``EXACT``), the same results as the hardware paths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lightning_fp8.kernels.cast import _FP8, _interpreted
from lightning_fp8.kernels.cast_kernels import _fp8_bytes, _round_to_fp8_grid
from lightning_fp8.kernels.comm_table import ALIGN, BlockTable
from lightning_fp8.kernels.reference import float32_exponent_mantissa
from lightning_fp8.kernels.scaling import _pow2_scale


@triton.jit
def _row(table_ptr, ALIGNED: tl.constexpr):
    # This program's tile. Aligned tiles promise multiples of 16 (the host's ALIGN): 16-byte vector loads and stores.
    base = table_ptr + tl.program_id(0).to(tl.int64) * 5
    src, dst, length = tl.load(base), tl.load(base + 1), tl.load(base + 2)
    if ALIGNED:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        length = tl.multiple_of(length, 16)
    return src, dst, length, tl.load(base + 3), tl.load(base + 4)


@triton.jit
def _inverse_pow2(s):
    # 1 / s for a power of two s >= 2**-126, exactly: the exponent field mirrored (2**-127 is the one subnormal).
    e = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF
    bits = tl.where(e >= 254, 0x00400000, (254 - e) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _neg_pow2(e):
    # 2**-e for an integer 0 <= e <= 126.
    return ((127 - e.to(tl.int32)) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _segment_scale(
    amax_ptr, value, headroom_ptr, HAS_HEADROOM: tl.constexpr, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr,
    MARGIN: tl.constexpr,
):
    # The shared power-of-two scale of segment value `value` from its amax, lowered by the native path's extra
    # headroom binades when HAS_HEADROOM.
    scale = _pow2_scale(tl.load(amax_ptr + value), 1.0, MAX_EXP, MAX_MANT, MARGIN)
    if HAS_HEADROOM:
        scale = scale * _neg_pow2(tl.load(headroom_ptr))
    return scale


@triton.jit
def _decode_fp8(q, IS_E4M3: tl.constexpr, EXACT: tl.constexpr):
    # q: uint8 FP8 bytes -> fp32, exact. E5M2 is the high byte of an fp16.
    if IS_E4M3:
        if EXACT:
            b = q.to(tl.uint32)
            e = (b >> 3) & 0xF
            m = b & 7
            normal = (((b >> 7) << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
            sub = m.to(tl.float32) * 0.001953125  # 2**-9: the subnormal step of E4M3
            v = tl.where(e == 0, tl.where(b >= 128, -sub, sub), normal)
            return tl.where((b & 0x7F) == 0x7F, float("nan"), v)
        else:
            return q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return (q.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _encode_fp8(y, finite, FP8_MAX: tl.constexpr, IS_E4M3: tl.constexpr, MBITS: tl.constexpr,
                MIN_NORMAL_EXP: tl.constexpr, SUBNORMAL_MAGIC: tl.constexpr, EXACT: tl.constexpr):  # fmt: skip
    # y: fp32 scaled values; finite: where the input was finite. Saturate, round to nearest even, NaN as 0x7F.
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    if EXACT:
        y = _round_to_fp8_grid(y, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC)
    return tl.where(finite, _fp8_bytes(y, IS_E4M3), 0x7F).to(tl.uint8)


@triton.jit
def _store(ptr, v, mask, EXACT_BF16: tl.constexpr):
    # Store fp32 v in ptr's dtype; round to nearest even by hand where the interpreter would truncate to bf16.
    if EXACT_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(v == v, r, 0x7FC0).to(tl.uint16)
        tl.store(ptr, r.to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _count(ptr, flags):
    n = tl.sum(flags.to(tl.int32), axis=0)
    tl.atomic_add(ptr, n.to(tl.int64), mask=n > 0, sem="relaxed")


@triton.jit
def _fold_max(ptr, a):
    # Atomics on one address serialize: skip those that cannot raise the stored value.
    tl.atomic_max(ptr, a, mask=a > tl.load(ptr), sem="relaxed")


# ------------------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _segment_amax_tile(
    x_ptr,  # flat input, fp32/bf16/fp16
    table_ptr,  # (rows, 5) int64 block table
    amax_ptr,  # fp32 per value index: atomic max of |x| (NaN -> inf)
    ALIGNED: tl.constexpr,  # this tile's src, dst and length are multiples of ALIGN
    BLOCK: tl.constexpr,  # tile (>= the row's length)
):
    src, _dst, length, value, _out = _row(table_ptr, ALIGNED)
    offs = tl.arange(0, BLOCK)
    ax = tl.abs(tl.load(x_ptr + src + offs, mask=offs < length, other=0.0).to(tl.float32))
    _fold_max(amax_ptr + value, tl.max(tl.where(ax == ax, ax, float("inf")), axis=0))


@triton.jit
def _quantize_tile(
    x_ptr,  # flat input, fp32/bf16/fp16
    table_ptr,  # (rows, 5) int64 block table
    amax_ptr,  # fp32 amax per value index (the scale's source)
    headroom_ptr,  # int64 0-dim: extra binades divided out of every scale (read when HAS_HEADROOM)
    q_ptr,  # uint8 output: FP8 bytes
    nsat_ptr,  # int64 0-dim accumulator: saturated elements
    HAS_HEADROOM: tl.constexpr,
    MAX_EXP: tl.constexpr,  # biased fp32 exponent of the format max
    MAX_MANT: tl.constexpr,  # fp32 mantissa field of the format max
    MARGIN: tl.constexpr,  # binades of headroom of the scale
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr,
    SUBNORMAL_MAGIC: tl.constexpr,
    EXACT: tl.constexpr,  # interpreter: round and convert with integer arithmetic
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    src, dst, length, value, _out = _row(table_ptr, ALIGNED)
    scale = _segment_scale(amax_ptr, value, headroom_ptr, HAS_HEADROOM, MAX_EXP, MAX_MANT, MARGIN)
    offs = tl.arange(0, BLOCK)
    mask = offs < length
    x = tl.load(x_ptr + src + offs, mask=mask, other=0.0).to(tl.float32)
    finite = tl.abs(x) < float("inf")
    y = x * scale
    _count(nsat_ptr, (tl.abs(y) > FP8_MAX) & finite & mask)
    q = _encode_fp8(y, finite, FP8_MAX, IS_E4M3, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC, EXACT)
    tl.store(q_ptr + dst + offs, q, mask=mask)


@triton.jit
def _dequantize_tile(
    q_ptr,  # uint8 input: FP8 bytes
    table_ptr,  # (rows, 5) int64 block table
    amax_ptr,  # fp32 amax per value index (the scale's source)
    headroom_ptr,  # int64 0-dim (read when HAS_HEADROOM)
    out_ptr,  # output, fp32/bf16/fp16
    counts_ptr,  # int64[2] accumulators (CHECK): overflowed-or-at-max, non-finite
    inv_divisor,  # fp32: 1 / N of a mean (1.0 otherwise)
    HAS_HEADROOM: tl.constexpr,
    CHECK: tl.constexpr,
    MAX_EXP: tl.constexpr,
    MAX_MANT: tl.constexpr,
    MARGIN: tl.constexpr,
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    EXACT: tl.constexpr,
    EXACT_BF16: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    src, dst, length, value, _out = _row(table_ptr, ALIGNED)
    scale = _segment_scale(amax_ptr, value, headroom_ptr, HAS_HEADROOM, MAX_EXP, MAX_MANT, MARGIN)
    scale_inv = inv_divisor * _inverse_pow2(scale)
    offs = tl.arange(0, BLOCK)
    mask = offs < length
    q = _decode_fp8(tl.load(q_ptr + src + offs, mask=mask, other=0), IS_E4M3, EXACT)
    if CHECK:
        nonfinite = ~(tl.abs(q) < float("inf")) & mask
        _count(counts_ptr, nonfinite | ((tl.abs(q) >= FP8_MAX) & mask))
        _count(counts_ptr + 1, nonfinite)
    _store(out_ptr + dst + offs, q * scale_inv, mask, EXACT_BF16)


@triton.jit
def _rows_tile(
    rows_ptr,  # uint8 (W, row_stride): FP8 bytes received from each rank, one scale per column segment
    row_stride,  # elements per row (a multiple of ALIGN for aligned launches)
    W,  # rows (ranks)
    table_ptr,  # (rows, 5) int64 block table: src within a row, dst in the output, value = group, out = piece
    amax_ptr,  # fp32 group amax (the scale of the received bytes)
    piece_amax_ptr,  # fp32 per piece: MODE 0 accumulates into it, MODE 1 reads it
    out_ptr,  # MODE 1: uint8 FP8 bytes; MODE 2: the mean in out's dtype
    nsat_ptr,  # int64 0-dim accumulator (MODE 1)
    inv_divisor,  # fp32: 1 / N for a mean
    MODE: tl.constexpr,  # 0: piece amax of the mean, 1: requantize the mean, 2: store the mean
    MAX_EXP: tl.constexpr,
    MAX_MANT: tl.constexpr,
    MARGIN: tl.constexpr,
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr,
    SUBNORMAL_MAGIC: tl.constexpr,
    EXACT: tl.constexpr,
    EXACT_BF16: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    src, dst, length, value, piece = _row(table_ptr, ALIGNED)
    scale = _pow2_scale(tl.load(amax_ptr + value), 1.0, MAX_EXP, MAX_MANT, MARGIN)
    scale_inv = inv_divisor * _inverse_pow2(scale)
    offs = tl.arange(0, BLOCK)
    mask = offs < length
    row = rows_ptr + src
    acc = _decode_fp8(tl.load(row + offs, mask=mask, other=0), IS_E4M3, EXACT)
    for _ in range(1, W):
        row += row_stride  # a 64-bit pointer step: no int32 product to overflow
        acc = acc + _decode_fp8(tl.load(row + offs, mask=mask, other=0), IS_E4M3, EXACT)
    mean = acc * scale_inv
    if MODE == 0:
        a = tl.where(mask, tl.abs(mean), 0.0)
        _fold_max(piece_amax_ptr + piece, tl.max(tl.where(a == a, a, float("inf")), axis=0))
    elif MODE == 1:
        piece_scale = _pow2_scale(tl.load(piece_amax_ptr + piece), 1.0, MAX_EXP, MAX_MANT, MARGIN)
        y = mean * piece_scale
        finite = tl.abs(mean) < float("inf")
        _count(nsat_ptr, (tl.abs(y) > FP8_MAX) & finite & mask)
        q = _encode_fp8(y, finite, FP8_MAX, IS_E4M3, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC, EXACT)
        tl.store(out_ptr + dst + offs, q, mask=mask)
    else:
        _store(out_ptr + dst + offs, mean, mask, EXACT_BF16)


# One launch per pass: programs below n_aligned take the aligned tiles (vectorized), the others the edges.
@triton.jit
def _segment_amax_kernel(x_ptr, table_ptr, amax_ptr, n_aligned, BLOCK: tl.constexpr, EDGE_BLOCK: tl.constexpr):
    if tl.program_id(0) < n_aligned:
        _segment_amax_tile(x_ptr, table_ptr, amax_ptr, True, BLOCK)
    else:
        _segment_amax_tile(x_ptr, table_ptr, amax_ptr, False, EDGE_BLOCK)


@triton.jit
def _quantize_kernel(
    x_ptr, table_ptr, amax_ptr, headroom_ptr, q_ptr, nsat_ptr, n_aligned, HAS_HEADROOM: tl.constexpr,
    MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr, MARGIN: tl.constexpr, FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr, MBITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, SUBNORMAL_MAGIC: tl.constexpr,
    EXACT: tl.constexpr, BLOCK: tl.constexpr, EDGE_BLOCK: tl.constexpr,
):  # fmt: skip
    if tl.program_id(0) < n_aligned:
        _quantize_tile(x_ptr, table_ptr, amax_ptr, headroom_ptr, q_ptr, nsat_ptr, HAS_HEADROOM, MAX_EXP, MAX_MANT,
                       MARGIN, FP8_MAX, IS_E4M3, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC, EXACT, True, BLOCK)
    else:
        _quantize_tile(x_ptr, table_ptr, amax_ptr, headroom_ptr, q_ptr, nsat_ptr, HAS_HEADROOM, MAX_EXP, MAX_MANT,
                       MARGIN, FP8_MAX, IS_E4M3, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC, EXACT, False, EDGE_BLOCK)


@triton.jit
def _dequantize_kernel(
    q_ptr, table_ptr, amax_ptr, headroom_ptr, out_ptr, counts_ptr, inv_divisor, n_aligned,
    HAS_HEADROOM: tl.constexpr, CHECK: tl.constexpr, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr,
    MARGIN: tl.constexpr, FP8_MAX: tl.constexpr, IS_E4M3: tl.constexpr, EXACT: tl.constexpr,
    EXACT_BF16: tl.constexpr, BLOCK: tl.constexpr, EDGE_BLOCK: tl.constexpr,
):  # fmt: skip
    if tl.program_id(0) < n_aligned:
        _dequantize_tile(q_ptr, table_ptr, amax_ptr, headroom_ptr, out_ptr, counts_ptr, inv_divisor, HAS_HEADROOM,
                         CHECK, MAX_EXP, MAX_MANT, MARGIN, FP8_MAX, IS_E4M3, EXACT, EXACT_BF16, True, BLOCK)
    else:
        _dequantize_tile(q_ptr, table_ptr, amax_ptr, headroom_ptr, out_ptr, counts_ptr, inv_divisor, HAS_HEADROOM,
                         CHECK, MAX_EXP, MAX_MANT, MARGIN, FP8_MAX, IS_E4M3, EXACT, EXACT_BF16, False, EDGE_BLOCK)


@triton.jit
def _rows_kernel(
    rows_ptr, row_stride, W, table_ptr, amax_ptr, piece_amax_ptr, out_ptr, nsat_ptr, inv_divisor, n_aligned,
    MODE: tl.constexpr, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr, MARGIN: tl.constexpr, FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr, MBITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, SUBNORMAL_MAGIC: tl.constexpr,
    EXACT: tl.constexpr, EXACT_BF16: tl.constexpr, ALIGNED_OK: tl.constexpr, BLOCK: tl.constexpr,
    EDGE_BLOCK: tl.constexpr,
):  # fmt: skip
    # ALIGNED_OK: row_stride is a multiple of ALIGN too (else every row after the first starts misaligned).
    if tl.program_id(0) < n_aligned:
        _rows_tile(rows_ptr, row_stride, W, table_ptr, amax_ptr, piece_amax_ptr, out_ptr, nsat_ptr, inv_divisor, MODE,
                   MAX_EXP, MAX_MANT, MARGIN, FP8_MAX, IS_E4M3, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC, EXACT,
                   EXACT_BF16, ALIGNED_OK, BLOCK)
    else:
        _rows_tile(rows_ptr, row_stride, W, table_ptr, amax_ptr, piece_amax_ptr, out_ptr, nsat_ptr, inv_divisor, MODE,
                   MAX_EXP, MAX_MANT, MARGIN, FP8_MAX, IS_E4M3, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC, EXACT,
                   EXACT_BF16, False, EDGE_BLOCK)  # fmt: skip


# ----------------------------------------------------------------------------------------------------------- launchers
def _format(fp8_dtype: torch.dtype, margin: int, exact: bool) -> dict:
    if fp8_dtype not in _FP8:
        raise TypeError(f"FP8 communication kernels: fp8_dtype must be float8_e4m3fn or float8_e5m2, got {fp8_dtype}")
    fmax, mbits, min_exp = _FP8[fp8_dtype]
    max_exp, max_mant = float32_exponent_mantissa(fmax)
    return {
        "MAX_EXP": max_exp, "MAX_MANT": max_mant, "MARGIN": int(margin), "FP8_MAX": fmax,
        "IS_E4M3": fp8_dtype == torch.float8_e4m3fn, "EXACT": exact,
    }  # fmt: skip


def _rounding(fp8_dtype: torch.dtype) -> dict:
    _, mbits, min_exp = _FP8[fp8_dtype]
    return {"MBITS": mbits, "MIN_NORMAL_EXP": min_exp, "SUBNORMAL_MAGIC": 2.0 ** (min_exp - mbits + 23)}


def _launch(kernel, table: BlockTable, before: tuple, after: tuple, **constexprs) -> None:
    # One launch for all tiles; the table's rows go between `before` and `after`, then the aligned-row count.
    if len(table):
        warps = 8 if table.block >= 4096 else 4
        kernel[(len(table),)](*before, table.rows, *after, table.aligned, BLOCK=table.block,
                              EDGE_BLOCK=table.edge_block, num_warps=warps, **constexprs)  # fmt: skip


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def segment_amax(x: torch.Tensor, table: BlockTable, amax: torch.Tensor) -> None:
    """``amax[value] = max(amax[value], max |x[tile]|)`` over the table's tiles (NaN counts as inf); in place."""
    _launch(_segment_amax_kernel, table, (x,), (amax,))


def quantize(
    x: torch.Tensor,
    table: BlockTable,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    out: torch.Tensor,
    n_sat: torch.Tensor,
    *,
    margin: int = 0,
    headroom: torch.Tensor | None = None,
) -> None:
    """FP8 bytes of ``x`` into ``out`` (uint8), each tile with the scale of ``amax[value]``; adds to ``n_sat``."""
    interpreted = _interpreted(_quantize_kernel)
    after = (amax, headroom if headroom is not None else n_sat, _bytes(out), n_sat)
    fmt = _format(fp8_dtype, margin, interpreted) | _rounding(fp8_dtype)
    _launch(_quantize_kernel, table, (x,), after, HAS_HEADROOM=headroom is not None, **fmt)


def dequantize(
    q: torch.Tensor,
    table: BlockTable,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    out: torch.Tensor,
    *,
    margin: int = 0,
    headroom: torch.Tensor | None = None,
    inv_divisor: float = 1.0,
    counts: torch.Tensor | None = None,
) -> None:
    """Decode FP8 bytes ``q`` into ``out`` (its dtype) with the inverse of each tile's scale times ``inv_divisor``.

    With ``counts`` (int64[2]), also adds the number of values that are non-finite or at the FP8 maximum (an FP8
    sum that overflowed) and the number of non-finite ones.
    """
    interpreted = _interpreted(_dequantize_kernel)
    fmt = _format(fp8_dtype, margin, interpreted)
    extra = headroom if headroom is not None else table.rows
    after = (amax, extra, out, counts if counts is not None else table.rows, inv_divisor)
    exact_bf16 = interpreted and out.dtype == torch.bfloat16
    _launch(_dequantize_kernel, table, (_bytes(q),), after, HAS_HEADROOM=headroom is not None,
            CHECK=counts is not None, EXACT_BF16=exact_bf16, **fmt)  # fmt: skip


def _rows(mode, rows, table, amax, piece_amax, out, n_sat, fp8_dtype, margin, inv_divisor) -> None:
    if rows.dim() != 2 or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous (world, chunk) byte tensor, got shape {tuple(rows.shape)}")
    interpreted = _interpreted(_rows_kernel)
    fmt = _format(fp8_dtype, margin, interpreted) | _rounding(fp8_dtype)
    exact_bf16 = interpreted and out.dtype == torch.bfloat16
    before, after = (_bytes(rows), rows.shape[1], rows.shape[0]), (amax, piece_amax, out, n_sat, inv_divisor)
    aligned_ok = rows.shape[1] % ALIGN == 0  # every row starts aligned
    _launch(_rows_kernel, table, before, after, ALIGNED_OK=aligned_ok, MODE=mode, EXACT_BF16=exact_bf16, **fmt)


def rows_amax(
    rows: torch.Tensor, table: BlockTable, amax: torch.Tensor, piece_amax: torch.Tensor, fp8_dtype: torch.dtype,
    *, margin: int = 0, inv_divisor: float = 1.0,
) -> None:  # fmt: skip
    """``piece_amax[out] = max(piece_amax[out], max |mean|)``, mean = the decoded sum of the ``rows`` of a tile."""
    _rows(0, rows, table, amax, piece_amax, piece_amax, piece_amax, fp8_dtype, margin, inv_divisor)


def rows_quantize(
    rows: torch.Tensor, table: BlockTable, amax: torch.Tensor, piece_amax: torch.Tensor, fp8_dtype: torch.dtype,
    out: torch.Tensor, n_sat: torch.Tensor, *, margin: int = 0, inv_divisor: float = 1.0,
) -> None:  # fmt: skip
    """FP8 bytes of the decoded mean of ``rows`` into ``out``, scaled by ``piece_amax[out]``; adds to ``n_sat``."""
    _rows(1, rows, table, amax, piece_amax, _bytes(out), n_sat, fp8_dtype, margin, inv_divisor)


def rows_sum(
    rows: torch.Tensor, table: BlockTable, amax: torch.Tensor, fp8_dtype: torch.dtype, out: torch.Tensor,
    *, margin: int = 0, inv_divisor: float = 1.0,
) -> None:  # fmt: skip
    """The decoded sum of ``rows`` times ``inv_divisor`` into ``out`` (its dtype)."""
    _rows(2, rows, table, amax, amax, out, amax, fp8_dtype, margin, inv_divisor)
