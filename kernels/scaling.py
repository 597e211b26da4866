"""Scale bookkeeping in Triton: the device functions the fused casts of kernels/cast.py run in their last program.

Math (numerics defined by :func:`~lightning_fp8.kernels.reference.current_scale_ref` and
:func:`~lightning_fp8.kernels.reference.record_cast_ref`)::

    pow2_scale(a) = 2 ** (floor(log2(fmax / a)) - margin)    from the fp32 bit patterns; kept where a is 0 or inf
    current:  scale <- pow2_scale(amax)
    record:   scale_inv_out <- 1 / scale;  last_amax <- amax;  saturation <- n_sat / numel
              nonfinite_count += (amax == inf);  casts += 1
              history <- [amax if finite else 0, history[:-1]]
              delayed only:  scale <- pow2_scale(max(history) or history[0])

Eagerly, the torch version of ``record`` is ~20 launches of a few microseconds each, for every cast of every
layer; fused into the cast (kernels/quantize.py ``quantize_``) it costs no launch at all.
"""

import triton
import triton.language as tl


@triton.jit
def _pow2_scale(a, prev, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr, MARGIN: tl.constexpr):
    # a >= 0 (an amax; NaN was already mapped to inf). Largest k with a * 2**k <= fmax, from exponents then mantissas.
    bits = a.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    k = (MAX_EXP - exp) - ((bits & 0x7FFFFF) > MAX_MANT).to(tl.int32) - MARGIN
    k = tl.minimum(tl.maximum(k, -126), 127)
    scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
    valid = (a > 0) & (a < float("inf"))
    return tl.where(valid, scale, prev)


@triton.jit
def _record(
    a, n_sat, numel, used_scale, hist_ptr, scale_ptr, scale_inv_out_ptr, last_amax_ptr, saturation_ptr, nonfinite_ptr,
    casts_ptr, H, unscale, BLOCK_H: tl.constexpr, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr,
    MARGIN: tl.constexpr, ALGO_MAX: tl.constexpr, DELAYED: tl.constexpr, UNSCALE: tl.constexpr,
):  # fmt: skip
    # The bookkeeping of one cast from its amax `a` (inf if it saw inf/NaN), its saturated count and the scale it
    # used (also the previous scale: an invalid amax keeps it), run by the last program of a fused cast.
    # UNSCALE: the cast input was t * unscale (a power of two; FP8AdamW's scaled fp16 master): the statistics, the
    # scale and 1 / scale are recorded for t itself.
    if UNSCALE:
        tl.store(scale_inv_out_ptr, (1.0 / used_scale) / unscale)
    else:
        tl.store(scale_inv_out_ptr, 1.0 / used_scale)
    finite = a < float("inf")
    tl.store(nonfinite_ptr, tl.load(nonfinite_ptr) + tl.where(finite, 0, 1).to(tl.int64))
    tl.store(casts_ptr, tl.load(casts_ptr) + 1)
    tl.store(last_amax_ptr, a / unscale if UNSCALE else a)
    tl.store(saturation_ptr, n_sat.to(tl.float32) / numel)  # numel: a python int (may be specialized)
    # Roll: every load of the old history is issued before any store (one program, data dependency).
    offs = tl.arange(0, BLOCK_H)
    shifted = tl.load(hist_ptr + offs - 1, mask=(offs > 0) & (offs < H), other=0.0)
    a_info = tl.where(finite, a, 0.0)
    hist = tl.where(offs == 0, a_info, shifted)
    tl.store(hist_ptr + offs, hist / unscale if UNSCALE else hist, mask=offs < H)
    new_scale = used_scale
    if DELAYED:
        if ALGO_MAX:
            ref = tl.max(tl.where(offs < H, hist, 0.0), axis=0)
        else:
            ref = a_info
        new_scale = _pow2_scale(ref, used_scale, MAX_EXP, MAX_MANT, MARGIN)
    if UNSCALE:
        tl.store(scale_ptr, new_scale * unscale)
    elif DELAYED:
        tl.store(scale_ptr, new_scale)
