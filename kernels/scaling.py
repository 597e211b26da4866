"""Scale bookkeeping in Triton: one single-program launch per cast for what would be dozens of tiny ops.

Math (numerics defined by :func:`~lightning_fp8.kernels.reference.current_scale_ref` and
:func:`~lightning_fp8.kernels.reference.record_cast_ref`)::

    pow2_scale(a) = 2 ** (floor(log2(fmax / a)) - margin)    from the fp32 bit patterns; kept where a is 0 or inf
    current:  scale <- pow2_scale(amax)
    record:   scale_inv_out <- 1 / scale;  last_amax <- amax;  saturation <- n_sat / numel
              nonfinite_count += (amax == inf);  casts += 1
              history <- [amax if finite else 0, history[:-1]]
              delayed only:  scale <- pow2_scale(max(history) or history[0])

Eagerly, the torch version of ``record`` is ~20 launches of a few microseconds each, for every cast of every
layer (benchmarks/bench_linear.py measured ~0.6-1.1 ms per cast on an H100 against ~0.1 ms of cast kernel).
"""

import torch
import triton
import triton.language as tl
from lightning_fp8.kernels.reference import float32_exponent_mantissa
from triton.runtime.jit import JITFunction


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
def _current_scale_kernel(
    amax_ptr,  # fp32[1]: amax of the tensor about to be cast
    scale_ptr,  # fp32[1]: in/out, the scale
    MAX_EXP: tl.constexpr,  # biased fp32 exponent of the format max
    MAX_MANT: tl.constexpr,  # fp32 mantissa field of the format max
    MARGIN: tl.constexpr,  # binades of headroom
):
    tl.store(scale_ptr, _pow2_scale(tl.load(amax_ptr), tl.load(scale_ptr), MAX_EXP, MAX_MANT, MARGIN))


@triton.jit
def _record(
    a, n_sat, numel, used_scale, hist_ptr, scale_ptr, scale_inv_out_ptr, last_amax_ptr, saturation_ptr, nonfinite_ptr,
    casts_ptr, H, unscale, BLOCK_H: tl.constexpr, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr,
    MARGIN: tl.constexpr, ALGO_MAX: tl.constexpr, DELAYED: tl.constexpr, UNSCALE: tl.constexpr,
):  # fmt: skip
    # The bookkeeping of one cast from its amax `a` (inf if it saw inf/NaN), its saturated count and the scale it
    # used (also the previous scale: an invalid amax keeps it). Shared by the record launch and the fused cast.
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


@triton.jit
def _record_cast_kernel(
    amax_ptr,  # fp32[1]: amax of the cast (inf if it saw inf/NaN)
    n_sat_ptr,  # int64[1]: saturated elements of the cast
    numel,  # elements cast
    used_scale_ptr,  # fp32[1]: the scale the cast used (a copy of scale)
    hist_ptr,  # fp32[H]: amax history, most recent first (in/out)
    scale_ptr,  # fp32[1]: scale (in/out: the next one, if DELAYED)
    scale_inv_out_ptr,  # fp32[1]: out, 1 / used scale
    last_amax_ptr,  # fp32[1]: out
    saturation_ptr,  # fp32[1]: out, fraction saturated
    nonfinite_ptr,  # int64[1]: in/out counter
    casts_ptr,  # int64[1]: in/out counter
    H,  # history length
    BLOCK_H: tl.constexpr,  # next power of two >= H
    MAX_EXP: tl.constexpr,
    MAX_MANT: tl.constexpr,
    MARGIN: tl.constexpr,
    ALGO_MAX: tl.constexpr,  # max over the history (else most recent)
    DELAYED: tl.constexpr,  # update the scale from the history
):
    # The previous scale (kept when the history holds no information) is `scale` as it is now, equal to the used one.
    _record(
        tl.load(amax_ptr), tl.load(n_sat_ptr), numel, tl.load(used_scale_ptr), hist_ptr, scale_ptr, scale_inv_out_ptr,
        last_amax_ptr, saturation_ptr, nonfinite_ptr, casts_ptr, H, 1.0, BLOCK_H, MAX_EXP, MAX_MANT, MARGIN, ALGO_MAX,
        DELAYED, False,
    )  # fmt: skip


def _launch(kernel, *args, **constexprs) -> None:
    # wrap_triton lets torch.compile trace the launch; an interpreted kernel (TRITON_INTERPRET=1) is launched as is.
    fn = kernel if not isinstance(kernel, JITFunction) else torch.library.wrap_triton(kernel)
    fn[(1,)](*args, **constexprs)


def _format(fmax: float, margin: int) -> dict:
    max_exp, max_mant = float32_exponent_mantissa(fmax)
    return {"MAX_EXP": max_exp, "MAX_MANT": max_mant, "MARGIN": margin}


@torch.library.triton_op("lightning_fp8::current_scale_", mutates_args=("scale",))
def _current_scale_op(amax: torch.Tensor, scale: torch.Tensor, fmax: float, margin: int) -> None:
    _launch(_current_scale_kernel, amax, scale, **_format(fmax, margin))


@torch.library.triton_op(
    "lightning_fp8::record_cast_",
    mutates_args=("amax_history", "scale", "last_amax", "saturation", "nonfinite_count", "casts"),
)
def _record_cast_op(
    amax: torch.Tensor,
    n_saturated: torch.Tensor,
    numel: int,
    used_scale: torch.Tensor,
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    last_amax: torch.Tensor,
    saturation: torch.Tensor,
    nonfinite_count: torch.Tensor,
    casts: torch.Tensor,
    fmax: float,
    margin: int,
    algo_max: bool,
    delayed: bool,
) -> torch.Tensor:
    scale_inv = torch.empty((), dtype=torch.float32, device=scale.device)  # 1 / used_scale
    h = amax_history.numel()
    _launch(
        _record_cast_kernel,
        amax, n_saturated, max(numel, 1), used_scale, amax_history, scale, scale_inv, last_amax, saturation,
        nonfinite_count, casts, h,
        BLOCK_H=triton.next_power_of_2(h), ALGO_MAX=algo_max, DELAYED=delayed, **_format(fmax, margin),
    )  # fmt: skip
    return scale_inv


def current_scale_(amax: torch.Tensor, scale: torch.Tensor, fmax: float, margin: int) -> None:
    """Same as :func:`~lightning_fp8.kernels.reference.current_scale_ref`."""
    _current_scale_op(amax, scale, fmax, margin)


def record_cast_(*args, **kwargs) -> torch.Tensor:
    """Same signature and results as :func:`~lightning_fp8.kernels.reference.record_cast_ref`."""
    return _record_cast_op(*args, **kwargs)
