"""The Triton kernels of FP8 gradient communication (launched by :mod:`lightning_fp8.kernels.comm`, whose docstring
has the block table, the math and the launch configs).

Every kernel loops: program ``p`` of ``G`` takes the table rows ``p, p + G, p + 2G, ...`` of the aligned rows
(``[0, n_aligned)``: vector loads and stores) and then of the edge rows (``[n_aligned, n_rows)``), and walks each row
in blocks of ``SUB`` elements (``G`` = the number of rows is one program per row; fewer makes the programs
persistent). Counters and amaxes run in registers, first reduced within each thread's ``LANE`` consecutive elements
(no data moves between threads), and reach memory once per program; an amax also when the row's scale group changes.
"""

import triton
import triton.language as tl
from lightning_fp8.kernels.fp8_encoding import _fp8_bytes, _round_to_fp8_grid
from lightning_fp8.kernels.scaling import _pow2_scale

# Running statistics keep one value per LANE consecutive elements of a block: a thread holds 8 (or 16) consecutive
# elements of an aligned block, so the reduction stays within the thread and the accumulator takes SUB / LANE slots.
LANE = tl.constexpr(8)


@triton.jit
def _row(table_ptr, i, HINT: tl.constexpr):
    # Row i of the table. Aligned rows promise multiples of 16 elements; HINT (8 or 16) is what the compiler is told,
    # and it picks the elements per thread of every access from it (8: the same layout for 1- and 2-byte sides).
    base = table_ptr + tl.cast(i, tl.int64) * 5
    src, dst, length = tl.load(base), tl.load(base + 1), tl.load(base + 2)
    if HINT > 1:
        src = tl.multiple_of(src, HINT)
        dst = tl.multiple_of(dst, HINT)
        length = tl.multiple_of(length, HINT)
    return src, dst, length.to(tl.int32), tl.load(base + 3), tl.load(base + 4)


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
def _clamp_abs(v, limit: tl.constexpr):
    # v limited to [-limit, limit]; NaN stays NaN (both comparisons are false for it).
    return tl.where(v > limit, limit, tl.where(v < -limit, -limit, v))


@triton.jit
def _store(ptr, v, mask, EXACT_BF16: tl.constexpr):
    # Store fp32 v in ptr's dtype, saturated at the dtype's largest finite value: a mean of finite gradients is at most
    # their amax, but its FP8 rounding can reach the next power of two (65536 in fp16, 2**128 in bf16/fp32), which
    # would be inf and pass every non-finite check. Round to nearest even by hand where the interpreter would truncate
    # to bf16.
    if ptr.dtype.element_ty == tl.float16:
        v = _clamp_abs(v, 65504.0)
    elif ptr.dtype.element_ty == tl.bfloat16:
        v = _clamp_abs(v, 3.3895313892515355e38)
    elif ptr.dtype.element_ty == tl.float32 or ptr.dtype.element_ty == tl.float64:  # v is fp32: fp32's max
        v = _clamp_abs(v, 3.4028234663852886e38)
    if EXACT_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(v == v, r, 0x7FC0).to(tl.uint16)
        tl.store(ptr, r.to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lane_sum(v):
    return tl.sum(tl.reshape(v, [v.shape[0] // LANE, LANE]), axis=1)


@triton.jit
def _lane_max(v):
    return tl.max(tl.reshape(v, [v.shape[0] // LANE, LANE]), axis=1)


@triton.jit
def _count(ptr, counts):
    # Add the sum of a block of per-element counts to an int64 counter (atomics on one address serialize: skip zeros).
    n = tl.sum(counts, axis=0)
    tl.atomic_add(ptr, n.to(tl.int64), mask=n > 0, sem="relaxed")


@triton.jit
def _fold_max(ptr, run):
    # Fold a block of running |x| maxima (NaN already inf) into *ptr; skip atomics that cannot raise it.
    a = tl.max(run, axis=0)
    tl.atomic_max(ptr, a, mask=a > tl.load(ptr), sem="relaxed")


@triton.jit
def _abs_nan_inf(v):
    a = tl.abs(v)
    return tl.where(a == a, a, float("inf"))


# --------------------------------------------------------------------------------------------------- one pass each
@triton.jit
def _amax_rows(x_ptr, table_ptr, amax_ptr, first, last, HINT: tl.constexpr, SUB: tl.constexpr,
               POLICY: tl.constexpr):  # fmt: skip
    # The rows [first, last) of this program: amax[value] = max(amax[value], max |x[tile]|).
    run = tl.zeros([SUB // LANE], dtype=tl.float32)
    cur = tl.full((), -1, tl.int64)  # the scale group `run` belongs to
    for i in range(first + tl.program_id(0), last, tl.num_programs(0)):
        src, _dst, length, value, _out = _row(table_ptr, i, HINT)
        if value != cur:
            if cur >= 0:
                _fold_max(amax_ptr + cur, run)
            run = tl.zeros([SUB // LANE], dtype=tl.float32)
            cur = value
        for off in range(0, length, SUB):
            offs = off + tl.arange(0, SUB)
            x = tl.load(x_ptr + src + offs, mask=offs < length, other=0.0, eviction_policy=POLICY)
            run = tl.maximum(run, _lane_max(_abs_nan_inf(x.to(tl.float32))))
    if cur >= 0:
        _fold_max(amax_ptr + cur, run)


@triton.jit
def _segment_amax_kernel(
    x_ptr,  # flat input, fp32/bf16/fp16
    table_ptr,  # (rows, 5) int64 block table
    amax_ptr,  # fp32 per value index: atomic max of |x| (NaN -> inf)
    n_aligned,  # rows [0, n_aligned) are aligned, the rest are edges
    n_rows,
    HINT: tl.constexpr,  # alignment (elements) the aligned rows are declared with
    SUB: tl.constexpr,  # elements per block of an aligned row
    EDGE_SUB: tl.constexpr,  # elements per block of an edge row
    POLICY: tl.constexpr,  # eviction policy of the streamed loads ("" or "evict_first")
):
    _amax_rows(x_ptr, table_ptr, amax_ptr, 0, n_aligned, HINT, SUB, POLICY)
    _amax_rows(x_ptr, table_ptr, amax_ptr, n_aligned, n_rows, 1, EDGE_SUB, POLICY)


@triton.jit
def _quantize_rows(
    x_ptr, table_ptr, amax_ptr, headroom_ptr, q_ptr, nsat_ptr, first, last, HAS_HEADROOM: tl.constexpr,
    MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr, MARGIN: tl.constexpr, FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr, MBITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, SUBNORMAL_MAGIC: tl.constexpr,
    EXACT: tl.constexpr, HINT: tl.constexpr, SUB: tl.constexpr, POLICY: tl.constexpr,
):  # fmt: skip
    sat = tl.zeros([SUB // LANE], dtype=tl.int32)  # saturated elements
    for i in range(first + tl.program_id(0), last, tl.num_programs(0)):
        src, dst, length, value, _out = _row(table_ptr, i, HINT)
        scale = _segment_scale(amax_ptr, value, headroom_ptr, HAS_HEADROOM, MAX_EXP, MAX_MANT, MARGIN)
        for off in range(0, length, SUB):
            offs = off + tl.arange(0, SUB)
            mask = offs < length
            x = tl.load(x_ptr + src + offs, mask=mask, other=0.0, eviction_policy=POLICY).to(tl.float32)
            finite = tl.abs(x) < float("inf")
            y = x * scale
            sat += _lane_sum(((tl.abs(y) > FP8_MAX) & finite).to(tl.int32))  # masked lanes are 0: never saturated
            q = _encode_fp8(y, finite, FP8_MAX, IS_E4M3, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC, EXACT)
            tl.store(q_ptr + dst + offs, q, mask=mask)
    _count(nsat_ptr, sat)


@triton.jit
def _quantize_kernel(
    x_ptr,  # flat input, fp32/bf16/fp16
    table_ptr,  # (rows, 5) int64 block table
    amax_ptr,  # fp32 amax per value index (the scale's source)
    headroom_ptr,  # int64 0-dim: extra binades divided out of every scale (read when HAS_HEADROOM)
    q_ptr,  # uint8 output: FP8 bytes
    nsat_ptr,  # int64 0-dim accumulator: saturated elements
    n_aligned,
    n_rows,
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
    HINT: tl.constexpr,
    SUB: tl.constexpr,
    EDGE_SUB: tl.constexpr,
    POLICY: tl.constexpr,
):
    _quantize_rows(x_ptr, table_ptr, amax_ptr, headroom_ptr, q_ptr, nsat_ptr, 0, n_aligned, HAS_HEADROOM, MAX_EXP,
                   MAX_MANT, MARGIN, FP8_MAX, IS_E4M3, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC, EXACT, HINT, SUB,
                   POLICY)  # fmt: skip
    _quantize_rows(x_ptr, table_ptr, amax_ptr, headroom_ptr, q_ptr, nsat_ptr, n_aligned, n_rows, HAS_HEADROOM,
                   MAX_EXP, MAX_MANT, MARGIN, FP8_MAX, IS_E4M3, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC, EXACT, 1,
                   EDGE_SUB, POLICY)  # fmt: skip


@triton.jit
def _dequantize_rows(
    q_ptr, table_ptr, amax_ptr, headroom_ptr, out_ptr, counts_ptr, inv_divisor, first, last,
    HAS_HEADROOM: tl.constexpr, CHECK: tl.constexpr, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr,
    MARGIN: tl.constexpr, FP8_MAX: tl.constexpr, IS_E4M3: tl.constexpr, EXACT: tl.constexpr,
    EXACT_BF16: tl.constexpr, HINT: tl.constexpr, SUB: tl.constexpr, POLICY: tl.constexpr,
):  # fmt: skip
    big = tl.zeros([SUB // LANE], dtype=tl.int32)  # CHECK: values non-finite or at the FP8 maximum (overflowed sums)
    bad = tl.zeros([SUB // LANE], dtype=tl.int32)  # CHECK: non-finite values
    for i in range(first + tl.program_id(0), last, tl.num_programs(0)):
        src, dst, length, value, _out = _row(table_ptr, i, HINT)
        scale = _segment_scale(amax_ptr, value, headroom_ptr, HAS_HEADROOM, MAX_EXP, MAX_MANT, MARGIN)
        scale_inv = inv_divisor * _inverse_pow2(scale)
        for off in range(0, length, SUB):
            offs = off + tl.arange(0, SUB)
            mask = offs < length
            q = _decode_fp8(tl.load(q_ptr + src + offs, mask=mask, other=0, eviction_policy=POLICY), IS_E4M3, EXACT)
            if CHECK:  # masked lanes decode 0: counted nowhere
                nonfinite = ~(tl.abs(q) < float("inf"))
                big += _lane_sum((nonfinite | (tl.abs(q) >= FP8_MAX)).to(tl.int32))
                bad += _lane_sum(nonfinite.to(tl.int32))
            _store(out_ptr + dst + offs, q * scale_inv, mask, EXACT_BF16)
    if CHECK:
        _count(counts_ptr, big)
        _count(counts_ptr + 1, bad)


@triton.jit
def _dequantize_kernel(
    q_ptr,  # uint8 input: FP8 bytes
    table_ptr,  # (rows, 5) int64 block table
    amax_ptr,  # fp32 amax per value index (the scale's source)
    headroom_ptr,  # int64 0-dim (read when HAS_HEADROOM)
    out_ptr,  # output, fp32/bf16/fp16
    counts_ptr,  # int64[2] accumulators (CHECK): overflowed-or-at-max, non-finite
    inv_divisor,  # fp32: 1 / N of a mean (1.0 otherwise)
    n_aligned,
    n_rows,
    HAS_HEADROOM: tl.constexpr,
    CHECK: tl.constexpr,
    MAX_EXP: tl.constexpr,
    MAX_MANT: tl.constexpr,
    MARGIN: tl.constexpr,
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    EXACT: tl.constexpr,
    EXACT_BF16: tl.constexpr,
    HINT: tl.constexpr,
    SUB: tl.constexpr,
    EDGE_SUB: tl.constexpr,
    POLICY: tl.constexpr,
):
    _dequantize_rows(q_ptr, table_ptr, amax_ptr, headroom_ptr, out_ptr, counts_ptr, inv_divisor, 0, n_aligned,
                     HAS_HEADROOM, CHECK, MAX_EXP, MAX_MANT, MARGIN, FP8_MAX, IS_E4M3, EXACT, EXACT_BF16, HINT, SUB,
                     POLICY)  # fmt: skip
    _dequantize_rows(q_ptr, table_ptr, amax_ptr, headroom_ptr, out_ptr, counts_ptr, inv_divisor, n_aligned, n_rows,
                     HAS_HEADROOM, CHECK, MAX_EXP, MAX_MANT, MARGIN, FP8_MAX, IS_E4M3, EXACT, EXACT_BF16, 1, EDGE_SUB,
                     POLICY)  # fmt: skip


@triton.jit
def _rows_rows(
    rows_ptr, row_stride, W, table_ptr, amax_ptr, piece_amax_ptr, out_ptr, nsat_ptr, inv_divisor, first, last,
    MODE: tl.constexpr, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr, MARGIN: tl.constexpr, FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr, MBITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, SUBNORMAL_MAGIC: tl.constexpr,
    EXACT: tl.constexpr, EXACT_BF16: tl.constexpr, HINT: tl.constexpr, SUB: tl.constexpr, POLICY: tl.constexpr,
):  # fmt: skip
    run = tl.zeros([SUB // LANE], dtype=tl.float32)  # MODE 0: running |mean| of piece `cur`
    sat = tl.zeros([SUB // LANE], dtype=tl.int32)  # MODE 1: saturated elements
    cur = tl.full((), -1, tl.int64)
    for i in range(first + tl.program_id(0), last, tl.num_programs(0)):
        src, dst, length, value, piece = _row(table_ptr, i, HINT)
        scale = _pow2_scale(tl.load(amax_ptr + value), 1.0, MAX_EXP, MAX_MANT, MARGIN)
        scale_inv = inv_divisor * _inverse_pow2(scale)
        if MODE == 0:
            if piece != cur:
                if cur >= 0:
                    _fold_max(piece_amax_ptr + cur, run)
                run = tl.zeros([SUB // LANE], dtype=tl.float32)
                cur = piece
        piece_scale = 1.0
        if MODE == 1:
            piece_scale = _pow2_scale(tl.load(piece_amax_ptr + piece), 1.0, MAX_EXP, MAX_MANT, MARGIN)
        for off in range(0, length, SUB):
            offs = off + tl.arange(0, SUB)
            mask = offs < length
            row = rows_ptr + src
            acc = _decode_fp8(tl.load(row + offs, mask=mask, other=0, eviction_policy=POLICY), IS_E4M3, EXACT)
            for _ in range(1, W):
                row += row_stride  # a 64-bit pointer step: no int32 product to overflow
                acc = acc + _decode_fp8(tl.load(row + offs, mask=mask, other=0, eviction_policy=POLICY), IS_E4M3,
                                        EXACT)  # fmt: skip
            mean = _clamp_abs(acc * scale_inv, 3.4028234663852886e38)  # a finite mean, not inf from an fp32 overflow
            if MODE == 0:
                run = tl.maximum(run, _lane_max(tl.where(mask, _abs_nan_inf(mean), 0.0)))
            elif MODE == 1:
                y = mean * piece_scale
                finite = tl.abs(mean) < float("inf")
                sat += _lane_sum(((tl.abs(y) > FP8_MAX) & finite & mask).to(tl.int32))
                q = _encode_fp8(y, finite, FP8_MAX, IS_E4M3, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC, EXACT)
                tl.store(out_ptr + dst + offs, q, mask=mask)
            else:
                _store(out_ptr + dst + offs, mean, mask, EXACT_BF16)
    if MODE == 0:
        if cur >= 0:
            _fold_max(piece_amax_ptr + cur, run)
    elif MODE == 1:
        _count(nsat_ptr, sat)


@triton.jit
def _rows_kernel(
    rows_ptr,  # uint8 (W, row_stride): FP8 bytes received from each rank, one scale per column segment
    row_stride,  # elements per row (a multiple of ALIGN for aligned launches)
    W,  # rows (ranks)
    table_ptr,  # (rows, 5) int64 block table: src within a row, dst in the output, value = group, out = piece
    amax_ptr,  # fp32 group amax (the scale of the received bytes)
    piece_amax_ptr,  # fp32 per piece: MODE 0 accumulates into it, MODE 1 reads it
    out_ptr,  # MODE 1: uint8 FP8 bytes; MODE 2: the mean in out's dtype
    nsat_ptr,  # int64 0-dim accumulator (MODE 1)
    inv_divisor,  # fp32: 1 / N for a mean
    n_aligned,
    n_rows,
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
    HINT: tl.constexpr,  # 1 where row_stride is not a multiple of ALIGN (rows after the first start misaligned)
    SUB: tl.constexpr,
    EDGE_SUB: tl.constexpr,
    POLICY: tl.constexpr,
):
    _rows_rows(rows_ptr, row_stride, W, table_ptr, amax_ptr, piece_amax_ptr, out_ptr, nsat_ptr, inv_divisor, 0,
               n_aligned, MODE, MAX_EXP, MAX_MANT, MARGIN, FP8_MAX, IS_E4M3, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC,
               EXACT, EXACT_BF16, HINT, SUB, POLICY)  # fmt: skip
    _rows_rows(rows_ptr, row_stride, W, table_ptr, amax_ptr, piece_amax_ptr, out_ptr, nsat_ptr, inv_divisor,
               n_aligned, n_rows, MODE, MAX_EXP, MAX_MANT, MARGIN, FP8_MAX, IS_E4M3, MBITS, MIN_NORMAL_EXP,
               SUBNORMAL_MAGIC, EXACT, EXACT_BF16, 1, EDGE_SUB, POLICY)  # fmt: skip
