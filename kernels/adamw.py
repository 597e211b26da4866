"""Multi-tensor AdamW step on scaled low-precision states, in Triton (the FP8-LM optimizer, O2).

Math (per element, fp32 in registers, one IEEE rounding per operation; numerics defined by
:func:`lightning_fp8.kernels.reference.adamw_step_ref`)::

    g = grad * grad_scale_inv                          FP8 gradient scale and 1/mu, powers of two
    m = m_stored * ((1 / m_scale) * b1) + g * (1 - b1)   dequantization folded into per-tensor factors
    v = v_stored * ((1 / v_scale) * b2) + (g * g) * (1 - b2)
    w = w_stored * ((1 / w_scale) * (1 - lr wd)) - (m / (sqrt(v) + eps_hat)) * step_size_hat
    state = RNE(saturate(x * new_scale)),  new_scale = 2 ** floor(log2(fmax / a))

``step_size_hat = lr sqrt(1 - b2^t) / (1 - b1^t)`` and ``eps_hat = eps sqrt(1 - b2^t)``: Adam's bias
corrections folded into two per-step constants (Kingma & Ba, end of section 2), one multiply fewer per element.

The new amax is known only after the update. Two schedules, selected by ``two_pass``:

- two passes: pass A computes the update and folds each tensor's new amaxes into a [T, 3] buffer (one
  atomic max per program and state); pass B recomputes the update and writes with the scale of that
  amax (``a`` = the fresh amax). Reads the inputs twice: 6 + 6 + 5 bytes per parameter at O2.
- one pass: ``a`` is an upper bound of the new amax known before the update, from the stored amaxes and
  the gradient's amax (``reference.adamw_bound_ref``): the write never saturates and the fresh amax is
  folded for the next step. 6 + 5 bytes per parameter; the scale is at most a binade or so conservative.

Either way a small finalize launch writes the new scales and amaxes into the 0-dim state tensors (the
main passes read the old scales, so they cannot be overwritten while those run).

Many tensors per launch: a table holds each tensor's element count, the element offsets of its param, grad,
m, v and optional high-precision copy from the first tensor of each list (a kernel argument), and the
addresses of its scales, amaxes, grad scale_inv and grad amax; a block table maps each program to one chunk
(``BLOCK * ITERS`` elements) of one tensor. Tensors are grouped by dtypes, so a launch has one set of element
types, taken from the first tensor of each list.

Speed (H100, 16 x 8192 x 8192 parameters, benchmarks/results/optim_h100.txt): the one-pass kernel moves the
11 bytes per parameter in 4.2 ms, 94% of a device copy's bandwidth and 2.8x ``torch.optim.AdamW(fused=True)``
(``FP8AdamW.step`` with its host bookkeeping: 4.5 ms). It is memory-bound: replacing the IEEE square root and
division by approximations gains 1%, dropping them altogether no more. The first version took 7.9 ms (50%);
its SASS showed why: an address loaded from a table carries no alignment, so every load and store was one
element wide (``LDG.E.U8``), with a 64-bit bounds check per element. Now each
data pointer is a pointer argument (whose 16-byte alignment Triton specializes on) plus an offset that the
launcher has checked to be a multiple of 16 bytes (``ALIGNED``, a ``tl.multiple_of`` hint); chunks that lie
wholly inside their tensor run without masks (only a tensor's last chunk is masked); offsets are 32-bit unless
a tensor needs more; each thread owns ``BLOCK / (32 num_warps)`` consecutive elements, 8 by default: 16-byte
fp16 and 8-byte FP8 accesses. The running amaxes fold within each thread (one register per state, not one
per element), NaN propagating through ``max.NaN`` instead of a compare and select per element, and the
dequantization and bias corrections are folded into per-tensor and per-step factors (see the math above).

Exactness: the GPU build disables fp contraction (``enable_fp_fusion=False``) and uses IEEE division and
square root (``div_rn``, ``sqrt_rn``), so results equal the reference bit for bit. Dividing by a
power-of-two scale is a multiplication by its exact reciprocal. On the GPU the FP8 conversion
(``cvt.rn.satfinite``) saturates by itself and turns NaN into 0x7F; under the interpreter fp32 -> FP8 and
fp32 -> bf16 conversions are pre-rounded in fp32 and saturated explicitly (see kernels/cast.py).
"""

from __future__ import annotations

import array
import functools
import operator

import torch
import triton
import triton.language as tl
from lightning_fp8.kernels.cast import _interpreted
from lightning_fp8.kernels.cast_kernels import _round_to_fp8_grid
from lightning_fp8.kernels.reference import BOUND_SLACK, SCALED_STATE_MAX, AdamWConstants, float32_exponent_mantissa

# Launch config, the best of benchmarks/bench_optim.py --sweep on an H100 (benchmarks/results/optim_h100.txt: 4.2 to
# 4.4 ms from 256 to 2048 elements per step, 7.7 ms with 16 elements per thread, whose layout conversions go through
# shared memory): BLOCK elements per loop step (BLOCK / (32 NUM_WARPS) consecutive elements per thread: 8 gives
# 16-byte fp16 accesses), ITERS loop steps per program (one chunk), NUM_WARPS per program.
CONFIG = {"BLOCK": 1024, "ITERS": 16, "NUM_WARPS": 4}
_INTERPRETER_CONFIG = {"BLOCK": 64, "ITERS": 2, "NUM_WARPS": 1}

# Table columns: element offsets of param, grad, exp_avg, exp_avg_sq (from the first tensor of each list), addresses
# of their 3 scales, their 3 amaxes and the grad's scale_inv, the element offset of the high-precision copy, then the
# element count and the address of the grad's amax.
_NCOL = 14
_FP8_FORMAT = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}  # mantissa bits, min normal exponent
_ALIGN = 16  # bytes: one vector access


@triton.jit
def _pow2_scale(amax, prev, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr):
    # 2 ** floor(log2(fmax / amax)) from the bit patterns; prev where amax is 0 or not finite.
    bits = amax.to(tl.int32, bitcast=True)
    k = (MAX_EXP - ((bits >> 23) & 0xFF)) - ((bits & 0x7FFFFF) > MAX_MANT).to(tl.int32)
    k = tl.minimum(tl.maximum(k, -126), 127)
    scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
    valid = (amax > 0) & (amax < float("inf"))
    return tl.where(valid, scale, prev)


@triton.jit
def _round_to_bf16(x):
    # The interpreter converts fp32 -> bf16 by truncation; round to nearest even in fp32 first (finite x).
    bits = x.to(tl.int32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _addr(table_ptr, t, col: tl.constexpr, like):
    # The address in column `col` of tensor t's row, typed like the pointer `like`.
    return tl.load(table_ptr + t * 14 + col).to(like.dtype)


@triton.jit
def _data_ptr(table_ptr, t, col: tl.constexpr, base, ALIGNED: tl.constexpr):
    # A tensor's pointer: `base` (the list's first tensor, a kernel argument) plus the element offset in column `col`.
    # Triton knows a pointer argument's alignment; with ALIGNED (every offset a multiple of 16 bytes, checked by the
    # launcher) it knows the sum's, and emits 16-byte accesses. An address loaded from the table carries none.
    offset = tl.load(table_ptr + t * 14 + col)
    if ALIGNED:
        offset = tl.multiple_of(offset, 128 // base.dtype.element_ty.primitive_bitwidth)
    return base + offset


@triton.jit
def _store(ptr, offs, x, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, x, mask=mask)
    else:
        tl.store(ptr + offs, x)


@triton.jit
def _store_state(
    ptr, offs, mask, x, scale,
    MASKED: tl.constexpr, SCALED: tl.constexpr, FMAX: tl.constexpr, IS_FP8: tl.constexpr,
    MBITS: tl.constexpr, MIN_EXP: tl.constexpr, EXACT_ROUND: tl.constexpr,
):  # fmt: skip
    if SCALED:
        finite = tl.abs(x) < float("inf")
        y = x * scale
        if IS_FP8 and not EXACT_ROUND:  # cvt.rn.satfinite saturates and writes NaN as 0x7F
            q = tl.where(finite, y, float("nan")).to(ptr.dtype.element_ty)
        elif IS_FP8:
            y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
            y = _round_to_fp8_grid(y, MBITS, MIN_EXP, 2.0 ** (MIN_EXP - MBITS + 23))
            q = tl.where(finite, y.to(ptr.dtype.element_ty).to(tl.uint8, bitcast=True), 0x7F).to(tl.uint8)
            q = q.to(ptr.dtype.element_ty, bitcast=True)  # NaN as PyTorch writes it
        else:
            q = tl.where(finite, tl.minimum(tl.maximum(y, -FMAX), FMAX), float("nan")).to(ptr.dtype.element_ty)
        _store(ptr, offs, q, mask, MASKED)
    else:
        _store(ptr, offs, x.to(ptr.dtype.element_ty), mask, MASKED)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _fold_amax(acc, x, mask, MASKED: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):
    # acc [BLOCK // VEC]: each thread folds its VEC consecutive |x| into one register; NaN propagates.
    a = tl.abs(x)
    if MASKED:  # masked lanes are computed from zeros, which need not give 0 (eps = 0: 0 / 0)
        a = tl.where(mask, a, 0.0)
    return _max_nan(acc, tl.reduce(tl.reshape(a, [BLOCK // VEC, VEC]), 1, _max_nan))


@triton.jit
def _update(
    gq, wq, mq, vq, p_ptr, m_ptr, v_ptr, c_ptr, offs, mask, acc_p, acc_m, acc_v,
    ginv, w_mul, m_mul, v_mul, wp_s, wm_s, wv_s, one_minus_beta1, one_minus_beta2, eps, step_size,
    MASKED: tl.constexpr, SCALED_P: tl.constexpr, SCALED_M: tl.constexpr, SCALED_V: tl.constexpr,
    P_MAX: tl.constexpr, M_MAX: tl.constexpr, V_MAX: tl.constexpr,
    M_FP8: tl.constexpr, M_MBITS: tl.constexpr, M_MIN_EXP: tl.constexpr, HAS_COPY: tl.constexpr,
    WRITE: tl.constexpr, ACCUM_AMAX: tl.constexpr, EXACT_ROUND: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    # One block: the AdamW update of loaded values (stored dtypes), the amaxes, the scaled stores.
    g = gq.to(tl.float32) * ginv
    m = mq.to(tl.float32) * m_mul + g * one_minus_beta1
    v = vq.to(tl.float32) * v_mul + (g * g) * one_minus_beta2
    w = wq.to(tl.float32) * w_mul - tl.div_rn(m, tl.sqrt_rn(v) + eps) * step_size
    if ACCUM_AMAX:
        acc_p = _fold_amax(acc_p, w, mask, MASKED, BLOCK, VEC)
        acc_m = _fold_amax(acc_m, m, mask, MASKED, BLOCK, VEC)
        acc_v = _fold_amax(acc_v, v, mask, MASKED, BLOCK, VEC)
    if WRITE:
        _store_state(p_ptr, offs, mask, w, wp_s, MASKED, SCALED_P, P_MAX, False, 0, 0, EXACT_ROUND)
        _store_state(m_ptr, offs, mask, m, wm_s, MASKED, SCALED_M, M_MAX, M_FP8, M_MBITS, M_MIN_EXP, EXACT_ROUND)
        _store_state(v_ptr, offs, mask, v, wv_s, MASKED, SCALED_V, V_MAX, False, 0, 0, EXACT_ROUND)
        if HAS_COPY:
            if EXACT_ROUND and c_ptr.dtype.element_ty == tl.bfloat16:
                w = _round_to_bf16(w)
            _store(c_ptr, offs, w.to(c_ptr.dtype.element_ty), mask, MASKED)
    return acc_p, acc_m, acc_v


@triton.jit
def _write_scale(
    table_ptr, amax_out_ptr, t, j: tl.constexpr, prev, grad_unscale,
    beta1, one_minus_beta1, beta2, one_minus_beta2, decay, max_update,
    MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr, FRESH: tl.constexpr, SLACK: tl.constexpr,
):  # fmt: skip
    # The scale state j is written with: of this step's amax (two-pass), or of a bound known before the update.
    if FRESH:
        source = tl.load(amax_out_ptr + t * 3 + j)
    else:  # reference.adamw_bound_ref, operation for operation
        a = tl.load(_addr(table_ptr, t, 7 + j, amax_out_ptr)) * SLACK
        if j == 0:
            source = a * decay + max_update
        else:
            ga = tl.load(_addr(table_ptr, t, 13, amax_out_ptr)) * tl.abs(grad_unscale) * SLACK
            if j == 1:
                source = a * beta1 + ga * one_minus_beta1
            else:
                source = a * beta2 + (ga * ga) * one_minus_beta2
    return _pow2_scale(source, prev, MAX_EXP, MAX_MANT)


@triton.jit
def _state_factors(table_ptr, t, col: tl.constexpr, like, factor, SCALED: tl.constexpr):
    # (old scale, (1 / old scale) * factor): the dequantization folded into the state's per-tensor factor.
    if SCALED:
        scale = tl.load(_addr(table_ptr, t, col, like))
        return scale, tl.div_rn(1.0, scale) * factor
    return 1.0, factor


@triton.jit
def _adamw_kernel(
    table_ptr,  # int64 [T, 14]: offsets, addresses (see _NCOL) and element count per tensor
    blocks_ptr,  # int32 [n_programs, 2]: (tensor index, chunk index) of each program
    amax_out_ptr,  # fp32 [T, 3]: new amax of (param, exp_avg, exp_avg_sq); atomic max (pass A, one pass) or read (B)
    p0, g0, m0, v0, c0,  # first tensor of each list: the bases of the table's offsets; their types type the others
    grad_unscale, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, step_size,
    max_update,  # fp32 scalars (reference.AdamWConstants)
    SCALED_P: tl.constexpr, SCALED_M: tl.constexpr, SCALED_V: tl.constexpr,  # storage carries a scale
    P_EXP: tl.constexpr, P_MANT: tl.constexpr, M_EXP: tl.constexpr,  # exponent/mantissa bits of each format max
    M_MANT: tl.constexpr, V_EXP: tl.constexpr, V_MANT: tl.constexpr,
    P_MAX: tl.constexpr, M_MAX: tl.constexpr, V_MAX: tl.constexpr,  # format maxima
    M_FP8: tl.constexpr, M_MBITS: tl.constexpr, M_MIN_EXP: tl.constexpr,  # exp_avg is FP8 (and its format)
    HAS_GSI: tl.constexpr,  # gradients carry a scale_inv (FP8 gradients)
    HAS_COPY: tl.constexpr,  # write the new weight, unscaled, to a high-precision copy
    WRITE: tl.constexpr,  # False: pass A (amax only)
    FRESH: tl.constexpr,  # write scales from amax_out (two-pass B) or from the bounds (one pass)
    ACCUM_AMAX: tl.constexpr,  # fold this pass's amax into amax_out
    SLACK: tl.constexpr,  # reference.BOUND_SLACK
    EXACT_ROUND: tl.constexpr,  # pre-round FP8/bf16 in fp32 (interpreter)
    ALIGNED: tl.constexpr,  # every data address is a multiple of 16 bytes
    OFFS_64: tl.constexpr,  # a tensor is too large for 32-bit element offsets
    BLOCK: tl.constexpr,  # elements per loop step
    ITERS: tl.constexpr,  # loop steps per program
    VEC: tl.constexpr,  # consecutive elements per thread: BLOCK / (32 num_warps)
):  # fmt: skip
    pid = tl.program_id(0)
    t = tl.load(blocks_ptr + pid * 2).to(tl.int64)
    chunk = tl.load(blocks_ptr + pid * 2 + 1)
    n = tl.load(table_ptr + t * 14 + 12)
    if OFFS_64:
        chunk = chunk.to(tl.int64)
    else:
        n = n.to(tl.int32)
    p_ptr, g_ptr = _data_ptr(table_ptr, t, 0, p0, ALIGNED), _data_ptr(table_ptr, t, 1, g0, ALIGNED)
    m_ptr, v_ptr = _data_ptr(table_ptr, t, 2, m0, ALIGNED), _data_ptr(table_ptr, t, 3, v0, ALIGNED)
    c_ptr = _data_ptr(table_ptr, t, 11, c0, ALIGNED)
    start = chunk * (BLOCK * ITERS)
    lanes = tl.arange(0, BLOCK)
    ginv = grad_unscale
    if HAS_GSI:
        ginv = tl.load(_addr(table_ptr, t, 10, amax_out_ptr)) * grad_unscale
    # Old scales, the per-tensor factors of the update and the scales of this write.
    p_s, w_mul = _state_factors(table_ptr, t, 4, amax_out_ptr, decay, SCALED_P)
    m_s, m_mul = _state_factors(table_ptr, t, 5, amax_out_ptr, beta1, SCALED_M)
    v_s, v_mul = _state_factors(table_ptr, t, 6, amax_out_ptr, beta2, SCALED_V)
    wp_s, wm_s, wv_s = p_s, m_s, v_s
    if WRITE:
        if SCALED_P:
            wp_s = _write_scale(table_ptr, amax_out_ptr, t, 0, p_s, grad_unscale, beta1, one_minus_beta1, beta2,
                                one_minus_beta2, decay, max_update, P_EXP, P_MANT, FRESH, SLACK)  # fmt: skip
        if SCALED_M:
            wm_s = _write_scale(table_ptr, amax_out_ptr, t, 1, m_s, grad_unscale, beta1, one_minus_beta1, beta2,
                                one_minus_beta2, decay, max_update, M_EXP, M_MANT, FRESH, SLACK)  # fmt: skip
        if SCALED_V:
            wv_s = _write_scale(table_ptr, amax_out_ptr, t, 2, v_s, grad_unscale, beta1, one_minus_beta1, beta2,
                                one_minus_beta2, decay, max_update, V_EXP, V_MANT, FRESH, SLACK)  # fmt: skip
    acc_p = tl.zeros([BLOCK // VEC], dtype=tl.float32)
    acc_m = tl.zeros([BLOCK // VEC], dtype=tl.float32)
    acc_v = tl.zeros([BLOCK // VEC], dtype=tl.float32)
    if start + BLOCK * ITERS <= n:  # inside the tensor: no masks, so the accesses stay vectorized
        for i in range(ITERS):
            offs = start + i * BLOCK + lanes
            gq, wq = tl.load(g_ptr + offs), tl.load(p_ptr + offs)
            mq, vq = tl.load(m_ptr + offs), tl.load(v_ptr + offs)
            acc_p, acc_m, acc_v = _update(
                gq, wq, mq, vq, p_ptr, m_ptr, v_ptr, c_ptr, offs, None, acc_p, acc_m, acc_v, ginv, w_mul, m_mul,
                v_mul, wp_s, wm_s, wv_s, one_minus_beta1, one_minus_beta2, eps, step_size,
                False, SCALED_P, SCALED_M, SCALED_V, P_MAX, M_MAX, V_MAX, M_FP8, M_MBITS, M_MIN_EXP, HAS_COPY,
                WRITE, ACCUM_AMAX, EXACT_ROUND, BLOCK, VEC,
            )  # fmt: skip
    else:  # the tensor's last chunk
        for i in range(ITERS):
            offs = start + i * BLOCK + lanes
            mask = offs < n
            gq, wq = tl.load(g_ptr + offs, mask=mask, other=0.0), tl.load(p_ptr + offs, mask=mask, other=0.0)
            mq, vq = tl.load(m_ptr + offs, mask=mask, other=0.0), tl.load(v_ptr + offs, mask=mask, other=0.0)
            acc_p, acc_m, acc_v = _update(
                gq, wq, mq, vq, p_ptr, m_ptr, v_ptr, c_ptr, offs, mask, acc_p, acc_m, acc_v, ginv, w_mul, m_mul,
                v_mul, wp_s, wm_s, wv_s, one_minus_beta1, one_minus_beta2, eps, step_size,
                True, SCALED_P, SCALED_M, SCALED_V, P_MAX, M_MAX, V_MAX, M_FP8, M_MBITS, M_MIN_EXP, HAS_COPY,
                WRITE, ACCUM_AMAX, EXACT_ROUND, BLOCK, VEC,
            )  # fmt: skip
    if ACCUM_AMAX:  # NaN counts as inf (reference.amax_ref)
        acc_p = tl.where(acc_p == acc_p, acc_p, float("inf"))
        acc_m = tl.where(acc_m == acc_m, acc_m, float("inf"))
        acc_v = tl.where(acc_v == acc_v, acc_v, float("inf"))
        tl.atomic_max(amax_out_ptr + t * 3, tl.max(acc_p, axis=0))
        tl.atomic_max(amax_out_ptr + t * 3 + 1, tl.max(acc_m, axis=0))
        tl.atomic_max(amax_out_ptr + t * 3 + 2, tl.max(acc_v, axis=0))


@triton.jit
def _finalize_one(
    table_ptr, amax_out_ptr, t, j: tl.constexpr, SCALED: tl.constexpr,
    grad_unscale, beta1, one_minus_beta1, beta2, one_minus_beta2, decay, max_update,
    MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr, FRESH: tl.constexpr, SLACK: tl.constexpr,
):  # fmt: skip
    if SCALED:  # after the main passes: nothing reads the old scale any more
        scale_addr = _addr(table_ptr, t, 4 + j, amax_out_ptr)
        prev = tl.load(scale_addr)
        new = _write_scale(table_ptr, amax_out_ptr, t, j, prev, grad_unscale, beta1, one_minus_beta1, beta2,
                           one_minus_beta2, decay, max_update, MAX_EXP, MAX_MANT, FRESH, SLACK)  # fmt: skip
        tl.store(scale_addr, new)
    tl.store(_addr(table_ptr, t, 7 + j, amax_out_ptr), tl.load(amax_out_ptr + t * 3 + j))


@triton.jit
def _finalize_kernel(
    table_ptr,  # int64 [T, 14], as above
    amax_out_ptr,  # fp32 [T, 3]: the new amaxes
    grad_unscale, beta1, one_minus_beta1, beta2, one_minus_beta2, decay, max_update,  # fp32 scalars
    SCALED_P: tl.constexpr, SCALED_M: tl.constexpr, SCALED_V: tl.constexpr,
    P_EXP: tl.constexpr, P_MANT: tl.constexpr, M_EXP: tl.constexpr,
    M_MANT: tl.constexpr, V_EXP: tl.constexpr, V_MANT: tl.constexpr,
    FRESH: tl.constexpr, SLACK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    _finalize_one(table_ptr, amax_out_ptr, t, 0, SCALED_P, grad_unscale, beta1, one_minus_beta1, beta2,
                  one_minus_beta2, decay, max_update, P_EXP, P_MANT, FRESH, SLACK)  # fmt: skip
    _finalize_one(table_ptr, amax_out_ptr, t, 1, SCALED_M, grad_unscale, beta1, one_minus_beta1, beta2,
                  one_minus_beta2, decay, max_update, M_EXP, M_MANT, FRESH, SLACK)  # fmt: skip
    _finalize_one(table_ptr, amax_out_ptr, t, 2, SCALED_V, grad_unscale, beta1, one_minus_beta1, beta2,
                  one_minus_beta2, decay, max_update, V_EXP, V_MANT, FRESH, SLACK)  # fmt: skip


@functools.lru_cache(maxsize=64)
def _block_table(numels: tuple[int, ...], chunk: int, device: torch.device) -> torch.Tensor:
    chunks = torch.tensor([triton.cdiv(n, chunk) for n in numels], dtype=torch.int64)
    tensor_index = torch.repeat_interleave(torch.arange(len(numels)), chunks)
    starts = torch.cumsum(chunks, 0) - chunks
    chunk_index = torch.arange(int(chunks.sum())) - torch.repeat_interleave(starts, chunks)
    return torch.stack([tensor_index, chunk_index], dim=1).to(torch.int32).to(device)


def _check(params, grads, exp_avgs, exp_avg_sqs, scales, amaxes, param_copies) -> list[int]:
    """Validate the lists (one pass each: this runs every step, per tensor); returns the element counts."""
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    for name, tensors in lists.items():
        if len(tensors) != len(params):
            raise ValueError(f"adamw_step: {name} has {len(tensors)} tensors but params has {len(params)}")
    for name, tensors in {"params": params, **lists, "param_copies": param_copies or []}.items():
        dtype = tensors[0].dtype if tensors else None
        if not all([t.dtype == dtype and t.is_contiguous() for t in tensors]):
            raise ValueError(f"adamw_step: the tensors of {name} must be contiguous and share one dtype")
    numels = [p.numel() for p in params]
    for tensors in lists.values():
        sizes = [t.numel() for t in tensors]
        if sizes != numels:
            i = next(i for i, (a, b) in enumerate(zip(sizes, numels, strict=True)) if a != b)
            raise ValueError(f"adamw_step: tensor {i} has states whose sizes differ from its param ({numels[i]})")
    if (scales is None) != (amaxes is None):
        raise ValueError("adamw_step: pass scales and amaxes together (both or neither)")
    return numels


def _table(params, grads, exp_avgs, exp_avg_sqs, scales, amaxes, grad_scale_invs, grad_amaxes, param_copies, numels):
    """The int64 [T, 14] table and a zeroed fp32 [T, 3] amax buffer on the device, and whether every data address
    is a multiple of 16 bytes."""
    zeros = [0] * len(params)
    data = [[t.data_ptr() for t in ts] for ts in (params, grads, exp_avgs, exp_avg_sqs, param_copies or ()) if ts]
    aligned = functools.reduce(operator.or_, (functools.reduce(operator.or_, c, 0) for c in data), 0) % _ALIGN == 0
    sizes = [ts[0].element_size() for ts in (params, grads, exp_avgs, exp_avg_sqs, param_copies or ()) if ts]
    offsets = [[(a - c[0]) // size for a in c] for c, size in zip(data, sizes, strict=True)]
    if not aligned and any((a - c[0]) % size for c, size in zip(data, sizes, strict=True) for a in c):
        raise ValueError("adamw_step: a tensor's address is not a multiple of its element size")
    columns = offsets[:4]
    for states in (scales, amaxes):  # [T] tuples of 3 -> 3 columns
        columns += [[t.data_ptr() for t in ts] for ts in zip(*states, strict=True)] if states else [zeros] * 3
    columns.append([t.data_ptr() for t in grad_scale_invs] if grad_scale_invs is not None else zeros)
    columns.append(offsets[4] if param_copies is not None else zeros)
    columns.append(numels)
    columns.append([t.data_ptr() for t in grad_amaxes] if grad_amaxes is not None else zeros)
    # Through array: 2x faster than torch.tensor(nested lists), which matters for models with many small tensors. The
    # zeroed fp32 [T, 3] amax buffer travels in the same copy (one transfer instead of a transfer and a fill).
    n = len(params)
    flat = array.array("q", [x for row in zip(*columns, strict=True) for x in row])
    flat.extend([0] * ((3 * n + 1) // 2))
    flat = torch.frombuffer(flat, dtype=torch.int64).to(params[0].device, non_blocking=True)
    amax_out = flat[n * _NCOL :].view(torch.float32)[: 3 * n].view(n, 3)
    return flat[: n * _NCOL].view(n, _NCOL), amax_out, aligned


def _launch_config(interpreted: bool) -> dict:
    cfg = dict(_INTERPRETER_CONFIG if interpreted else CONFIG)
    cfg["VEC"] = max(1, cfg["BLOCK"] // (32 * cfg["NUM_WARPS"]))
    if cfg["BLOCK"] % cfg["VEC"] or cfg["VEC"] & (cfg["VEC"] - 1):
        raise ValueError(f"adamw CONFIG {cfg}: BLOCK must be a power of two times 32 * NUM_WARPS")
    return cfg


def adamw_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    scales: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None,
    amaxes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None,
    grad_scale_invs: list[torch.Tensor] | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_unscale: float = 1.0,
    two_pass: bool = True,
    grad_amaxes: list[torch.Tensor] | None = None,
    param_copies: list[torch.Tensor] | None = None,
) -> None:
    """Multi-tensor AdamW step; same signature and bit-exact results as ``reference.adamw_step_ref``.

    Each list holds tensors of one dtype, contiguous and on one device; see the reference for the arguments.

    Raises:
        ValueError: for lists of different lengths, sizes or mixed dtypes, ``scales`` without ``amaxes``, or a
            one-pass step without its bounds (see the reference).
    """
    numels = _check(params, grads, exp_avgs, exp_avg_sqs, scales, amaxes, param_copies)
    c = AdamWConstants(lr, beta1, beta2, eps, weight_decay, step)
    if not two_pass and scales is not None and (grad_amaxes is None or c.max_update is None):
        raise ValueError("adamw_step(two_pass=False) needs grad_amaxes and beta1**2 < beta2 for its scale bounds")
    if not params:
        return
    device = params[0].device
    table, amax_out, aligned = _table(params, grads, exp_avgs, exp_avg_sqs, scales, amaxes, grad_scale_invs,
                                      grad_amaxes, param_copies, numels)  # fmt: skip
    interpreted = _interpreted(_adamw_kernel)
    cfg = _launch_config(interpreted)
    chunk = cfg["BLOCK"] * cfg["ITERS"]
    blocks = _block_table(tuple(numels), chunk, device)
    formats = {}
    dtypes = (params[0].dtype, exp_avgs[0].dtype, exp_avg_sqs[0].dtype)
    for key, dtype in zip("PMV", dtypes, strict=True):
        fmax = SCALED_STATE_MAX.get(dtype, 1.0)
        exp, mant = float32_exponent_mantissa(fmax)
        formats.update({f"SCALED_{key}": scales is not None and dtype in SCALED_STATE_MAX, f"{key}_EXP": exp,
                        f"{key}_MANT": mant})  # fmt: skip
    m_fmt = _FP8_FORMAT.get(exp_avgs[0].dtype, (0, 0))
    max_update = c.max_update if c.max_update is not None else 0.0
    hyper = (grad_unscale, c.beta1, c.one_minus_beta1, c.beta2, c.one_minus_beta2)
    common = {
        **formats,
        "P_MAX": SCALED_STATE_MAX.get(dtypes[0], 1.0), "M_MAX": SCALED_STATE_MAX.get(dtypes[1], 1.0),
        "V_MAX": SCALED_STATE_MAX.get(dtypes[2], 1.0),
        "M_FP8": dtypes[1] in _FP8_FORMAT, "M_MBITS": m_fmt[0], "M_MIN_EXP": m_fmt[1],
        "HAS_GSI": grad_scale_invs is not None, "HAS_COPY": param_copies is not None,
        "SLACK": BOUND_SLACK, "EXACT_ROUND": interpreted, "ALIGNED": aligned,
        "OFFS_64": max(numels) + chunk >= 2**31,
        "BLOCK": cfg["BLOCK"], "ITERS": cfg["ITERS"], "VEC": cfg["VEC"],
    }  # fmt: skip
    launch = {} if interpreted else {"num_warps": cfg["NUM_WARPS"], "enable_fp_fusion": False}
    copy0 = param_copies[0] if param_copies is not None else params[0]
    args = (table, blocks, amax_out, params[0], grads[0], exp_avgs[0], exp_avg_sqs[0], copy0,
            *hyper, c.eps, c.decay, c.step_size, max_update)  # fmt: skip
    grid = (blocks.shape[0],)
    if two_pass:
        _adamw_kernel[grid](*args, **common, WRITE=False, FRESH=True, ACCUM_AMAX=True, **launch)
        _adamw_kernel[grid](*args, **common, WRITE=True, FRESH=True, ACCUM_AMAX=False, **launch)
    else:
        _adamw_kernel[grid](*args, **common, WRITE=True, FRESH=False, ACCUM_AMAX=True, **launch)
    if amaxes is not None:
        fin_launch = {} if interpreted else {"enable_fp_fusion": False}
        _finalize_kernel[(len(params),)](table, amax_out, *hyper, c.decay, max_update, **formats, FRESH=two_pass,
                                         SLACK=BOUND_SLACK, **fin_launch)  # fmt: skip
