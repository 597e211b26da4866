"""Scale bookkeeping in Triton: the device functions the fused casts of kernels/cast.py run in their last program.

Math (numerics defined by :func:`~lightning_fp8.kernels.reference.current_scale_ref` and
:func:`~lightning_fp8.kernels.reference.record_cast_ref`)::

    pow2_scale(a) = 2 ** (floor(log2(fmax / a)) - margin)    from the fp32 bit patterns; kept where a is 0 or inf
    current:  scale <- pow2_scale(amax)
    record:   scale_inv_out <- 1 / scale;  last_amax <- amax;  saturation <- n_sat / numel
              nonfinite_count += (amax == inf);  casts += 1
              history <- [amax if finite else 0, history[:-1]]
              delayed only, where 0 < amax < inf (else the scale is kept):
                scale <- pow2_scale(max(history) or history[0])

Eagerly, the torch version of ``record`` is ~20 launches of a few microseconds each, for every cast of every
layer; fused into the cast (kernels/quantize.py ``quantize_``) it costs no launch at all.

Also here: how a cast's programs hand their statistics over (``_publish`` to output accumulators, or ``_arrive`` in
a workspace whose last arriving program does the bookkeeping, ``_finish``), and the two passes of speculative
current scaling (``_guess_scale``, ``_redo``; kernels/quantize.py).
"""

import triton
import triton.language as tl


@triton.jit
def _pow2_scale(a, prev, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr, MARGIN: tl.constexpr):
    # a >= 0 (an amax; NaN was already mapped to inf). Largest k with a * 2**k <= fmax, from exponents then mantissas.
    bits = a.to(tl.int32, bitcast=True)
    exp, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    # An fp32 subnormal: its normalized exponent and mantissa from mant as an fp32 (reference.pow2_scale_ref).
    sub = mant.to(tl.float32).to(tl.int32, bitcast=True)
    normal = exp != 0
    exp = tl.where(normal, exp, ((sub >> 23) & 0xFF) - 149)
    mant = tl.where(normal, mant, sub & 0x7FFFFF)
    k = (MAX_EXP - exp) - (mant > MAX_MANT).to(tl.int32) - MARGIN
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
    # An amax of 0 or inf carries no information: it enters the history as 0 (the window rolls, as on every rank of
    # an amax sync) and the scale is kept.
    informative = finite & (a > 0)
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
        # The stored scale describes t already (the cast read x = t * unscale).
        tl.store(scale_ptr, tl.where(informative, new_scale * unscale, tl.load(scale_ptr)))
    elif DELAYED:
        tl.store(scale_ptr, tl.where(informative, new_scale, tl.load(scale_ptr)))


@triton.jit
def _publish(amax_ptr, nsat_ptr, amax, nsat):
    # Fold a program's statistics into the global ones. Atomics on one address serialize, so skip those that
    # cannot change anything: a zero count, an amax not above the current one (a stale read only costs an atomic).
    # Relaxed: nothing in the kernel orders other memory against these; the launch boundary publishes them.
    tl.atomic_max(amax_ptr, amax, mask=amax > tl.load(amax_ptr), sem="relaxed")
    tl.atomic_add(nsat_ptr, nsat.to(tl.int64), mask=nsat > 0, sem="relaxed")


@triton.jit
def _arrive(ws_ptr, amax, nsat, COUNT: tl.constexpr):
    # Fold a program's statistics into the workspace (int64: amax as its fp32 bits, which order like the non-negative
    # floats they encode; saturated count; arrival ticket) and take a ticket. Returns (last, amax, nsat): `last` is
    # true in the one program that arrives last, which then holds the totals and leaves the workspace zeroed for the
    # next launch on this stream. The ticket is acquire-release: every program's statistics are folded before it.
    bits = amax.to(tl.int32, bitcast=True).to(tl.int64)
    tl.atomic_max(ws_ptr, bits, mask=bits > tl.load(ws_ptr), sem="relaxed")
    if COUNT:
        tl.atomic_add(ws_ptr + 1, nsat.to(tl.int64), mask=nsat > 0, sem="relaxed")
    last = tl.atomic_add(ws_ptr + 2, 1, sem="acq_rel") == tl.num_programs(0) - 1
    # After its acquire the last program reads the totals with plain loads (volatile: not from a stale L1 line) and
    # resets the workspace with plain stores, which the end of the launch publishes to the next one: one round trip
    # to memory at the end of the cast instead of three dependent atomics.
    total_bits = tl.load(ws_ptr, mask=last, other=0, volatile=True)
    total_nsat = tl.load(ws_ptr + 1, mask=last, other=0, volatile=True)
    zero = tl.zeros_like(total_bits)
    tl.store(ws_ptr, zero, mask=last)
    tl.store(ws_ptr + 1, zero, mask=last)
    tl.store(ws_ptr + 2, zero, mask=last)
    return last, total_bits.to(tl.int32).to(tl.float32, bitcast=True), total_nsat


@triton.jit
def _guess_scale(scale_ptr, unscale_ptr, UNSCALE: tl.constexpr, SPECULATE: tl.constexpr):
    # The scale a cast uses: the state's scale (delayed; current scaling's, written by the amax launch, or its redo),
    # or, speculating (SPECULATE == 1), the scale of the state's last cast (the state keeps t's scale with UNSCALE).
    scale = tl.load(scale_ptr)
    if SPECULATE == 1 and UNSCALE:
        scale = scale / tl.load(unscale_ptr)
    return scale


@triton.jit
def _redo(ws_ptr, SPECULATE: tl.constexpr):
    # Whether this launch casts: always, except the redo pass (SPECULATE == 2) when the speculative pass kept its scale.
    if SPECULATE == 2:
        return tl.load(ws_ptr + 3) != 0
    else:
        return True


@triton.jit
def _finish(
    amax_ptr, nsat_ptr, amax, nsat, scale_ptr, scale, ws_ptr, hist_ptr, scale_inv_ptr, last_amax_ptr, saturation_ptr,
    nonfinite_ptr, casts_ptr, unscale_ptr, numel, H, go,
    BLOCK_H: tl.constexpr, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr, MARGIN: tl.constexpr,
    ALGO_MAX: tl.constexpr, DELAYED: tl.constexpr, RECORD: tl.constexpr, UNSCALE: tl.constexpr,
    SPECULATE: tl.constexpr,
):  # fmt: skip
    # RECORD: the last program to finish does the scaling state's bookkeeping (kernels/scaling.py) with the totals;
    # otherwise the statistics go to the zeroed output accumulators. Speculative current scaling (kernels/quantize.py):
    # the first pass (SPECULATE == 1) cast with the last cast's scale; if that is the scale of this tensor's amax, it
    # records as the current-scaled cast would, else it writes the fresh scale and raises the workspace's redo flag
    # (ws[3]), and the second pass (SPECULATE == 2) casts again with it, records, and lowers the flag.
    if RECORD:
        if go:
            last, total_amax, total_nsat = _arrive(ws_ptr, amax, nsat, True)
            if last:
                keep = True
                if SPECULATE == 1:
                    # pow2_scale(amax) keeps the stored scale for an amax of 0 or inf; with UNSCALE that is t's, which
                    # casts x = t * unscale as scale / unscale: the guess (_guess_scale) holds then.
                    prev = tl.load(scale_ptr)
                    if UNSCALE:
                        prev = prev / tl.load(unscale_ptr)
                    fresh = _pow2_scale(total_amax, prev, MAX_EXP, MAX_MANT, MARGIN)
                    keep = fresh == scale
                    tl.store(ws_ptr + 3, tl.where(keep, 0, 1).to(tl.int64))  # written either way: never stale
                    if not keep:
                        tl.store(scale_ptr, fresh)
                if SPECULATE == 2:
                    tl.store(ws_ptr + 3, 0)
                if keep:
                    unscale = tl.load(unscale_ptr) if UNSCALE else 1.0
                    _record(
                        total_amax, total_nsat, numel, scale, hist_ptr, scale_ptr, scale_inv_ptr, last_amax_ptr,
                        saturation_ptr, nonfinite_ptr, casts_ptr, H, unscale, BLOCK_H, MAX_EXP, MAX_MANT, MARGIN,
                        ALGO_MAX, DELAYED, UNSCALE,
                    )  # fmt: skip
    else:
        _publish(amax_ptr, nsat_ptr, amax, nsat)
