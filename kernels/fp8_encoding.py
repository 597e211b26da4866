"""The FP8 encoding of a block in Triton: scaling with saturation, rounding to the FP8 grid, the bytes, and the running
amax and saturation count of a cast. Shared by the cast kernels (kernels/cast_kernels.py), FP8AdamW's kernels, the
gradient casts and the FP8 communication kernels, so that every FP8 byte of the package is written by the same rules
(kernels/reference.py: ``cast_to_fp8_ref``).

Rounding (found while testing under ``TRITON_INTERPRET=1``): the Triton interpreter converts fp32 to
FP8 with a wrong "round to nearest": it adds the rounding bit to the mantissa without carrying into the
exponent (7.77 -> 4.0 instead of 8.0 in E4M3, 3.9 -> 2.0 in E5M2), rounds ties away from zero, and
turns NaN into 384 in E4M3. It converts values that are already on the FP8 grid exactly. So under the
interpreter (``EXACT_ROUND``) the kernels first round to the FP8 grid in fp32 with integer arithmetic:

    normal   |y| >= 2**e_min : drop the low 23 - m mantissa bits with round-to-nearest-even
    subnormal|y| <  2**e_min : (|y| + C) - C with C = 2**(e_min - m + 23): the fp32 add rounds to
                               the subnormal spacing 2**(e_min - m) (RNE), the subtraction is exact

(m = 3, e_min = -6 for E4M3; m = 2, e_min = -14 for E5M2), and writes NaN as the byte 0x7F, the
pattern PyTorch uses for both formats. On a GPU the hardware conversion (``cvt.rn.satfinite``) already
rounds to nearest even (bit-exact against the reference on an H100), and the pre-rounding is off: it made
the cast with transpose 2.2x slower there (``EXACT_ROUND_ON_GPU``; benchmarks/README.md).
"""

import triton
import triton.language as tl


@triton.jit
def _round_to_fp8_grid(y, MBITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, SUBNORMAL_MAGIC: tl.constexpr):
    # y: fp32, |y| <= fp8_max. Returns the nearest FP8 value (ties to even), still in fp32; a non-finite lane
    # comes out as anything (an int32 overflow), so callers overwrite those lanes.
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) << 31
    mag = bits & 0x7FFFFFFF
    SHIFT: tl.constexpr = 23 - MBITS
    lsb = (mag >> SHIFT) & 1
    normal = ((mag + ((1 << (SHIFT - 1)) - 1) + lsb) >> SHIFT) << SHIFT
    a = mag.to(tl.float32, bitcast=True)
    subnormal = ((a + SUBNORMAL_MAGIC) - SUBNORMAL_MAGIC).to(tl.int32, bitcast=True)
    is_small = mag < ((MIN_NORMAL_EXP + 127) << 23)
    return (tl.where(is_small, subnormal, normal) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _scale_saturate(x, scale, FP8_MAX: tl.constexpr):
    # x: fp32 tile. Returns (y clamped to +-fp8_max, finite(x), |x| with NaN -> inf, saturated as int32 0/1). A NaN
    # product of a finite x (a NaN scale, or 0 * inf) stays NaN, as torch.clamp leaves it in the reference: the
    # NaN-propagating min/max (PTX max.NaN) cost what the plain ones do.
    ax = tl.abs(x)
    finite = ax < float("inf")  # False for inf and NaN
    y = x * scale
    sat = ((tl.abs(y) >= FP8_MAX) & finite).to(tl.int32)
    y = tl.minimum(
        tl.maximum(y, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX, propagate_nan=tl.PropagateNan.ALL
    )
    ax = tl.where(ax == ax, ax, float("inf"))
    return y, finite, ax, sat


@triton.jit
def _fp8_bytes(y, IS_E4M3: tl.constexpr):
    # The FP8 encoding of the fp32 tile y as uint8 (stored through a bitcast: no second conversion).
    if IS_E4M3:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return y.to(tl.float8e5).to(tl.uint8, bitcast=True)


@triton.jit
def _quantize_block(
    x, scale, amax_acc, nsat_acc, FP8_MAX: tl.constexpr, IS_E4M3: tl.constexpr, MBITS: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr, SUBNORMAL_MAGIC: tl.constexpr, EXACT_ROUND: tl.constexpr, STATS: tl.constexpr,
):  # fmt: skip
    # One block of a cast: the FP8 bytes (uint8; NaN 0x7F, as PyTorch writes it in both formats), the scaled and
    # saturated fp32 values and their finiteness (the transposed copy may convert those again), and the running
    # amax and saturation count (STATS): per element ("element"), per row of a 2-D block ("row": reduced along
    # its rows, within the threads that hold a row) or folded to scalars ("tile"). Masked lanes hold 0: neutral.
    y, finite, ax, sat = _scale_saturate(x, scale, FP8_MAX)
    if STATS == "element":
        amax_acc = tl.maximum(amax_acc, ax)
        nsat_acc += sat
    elif STATS == "row":
        amax_acc = tl.maximum(amax_acc, tl.max(ax, axis=1))
        nsat_acc += tl.sum(sat, axis=1)
    else:
        amax_acc = tl.maximum(amax_acc, tl.max(ax))
        nsat_acc += tl.sum(sat)
    if EXACT_ROUND:  # non-finite lanes (a NaN y too) may come out as anything here: they are replaced below
        finite = finite & (y == y)
        y = _round_to_fp8_grid(y, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC)
    q = tl.where(finite, _fp8_bytes(y, IS_E4M3), 0x7F).to(tl.uint8)
    return q, y, finite, amax_acc, nsat_acc
