"""The Triton kernels of the multi-tensor AdamW step (launched by :mod:`lightning_fp8.kernels.adamw`, which states
their math, the table layout and the speed).

Emission of the FP8 weight copy (``EMIT``): the forward of an FP8Linear casts the tensor it reads (the scaled fp16
master in the weight's storage, or the high-precision copy) with current scaling. The write pass casts the same
stored values the same way: ``x_fp8 = RNE(saturate(stored * s))`` with ``s = pow2_scale(a_stored)`` for the E4M3
maximum and the recipe's margin, where ``a_stored`` is the amax of the stored values. Rounding to the storage format
is monotonic, so ``a_stored`` is the stored image of the fp32 amax: exact from the fresh amax (two passes: the copy
is the forward's cast bit for bit), or from the one-pass bound (a valid copy, its scale possibly lower). A
high-precision copy holds the stored master unscaled, rounded to its dtype: its amax is that image again.
The finalize launch (kernels/adamw_finalize.py) then writes, per weight, the statistics the forward records into the
layer's scaling state.
"""

import triton
import triton.language as tl
from lightning_fp8.kernels.comm_kernels import _decode_fp8
from lightning_fp8.kernels.fp8_encoding import _round_to_fp8_grid
from lightning_fp8.kernels.scaling import _pow2_scale

# Table columns (int64 [T, NCOL] per launch; see kernels/adamw.py): element offsets of param, grad, exp_avg,
# exp_avg_sq (from the first tensor of each list), addresses of their 3 scales, their 3 amaxes and the grad's
# scale_inv, the element offset of the high-precision copy, the element count, the address of the grad's amax,
# the element offset of the FP8 weight copy and the address of its statistics record.
NCOL = 16
GRAD_SATURATION: tl.constexpr = tl.constexpr(2.0**63)  # reference_adamw.GRAD_SATURATION


@triton.jit
def _round_to_bf16(x):
    # The interpreter converts fp32 -> bf16 by truncation; round to nearest even in fp32 first (finite x).
    bits = x.to(tl.int32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _addr(table_ptr, t, col: tl.constexpr, like):
    # The address in column `col` of tensor t's row, typed like the pointer `like`.
    return tl.load(table_ptr + t * 16 + col).to(like.dtype)


@triton.jit
def _data_ptr(table_ptr, t, col: tl.constexpr, base, ALIGNED: tl.constexpr):
    # A tensor's pointer: `base` (the list's first tensor, a kernel argument) plus the element offset in column `col`.
    # Triton knows a pointer argument's alignment; with ALIGNED (every offset a multiple of 16 bytes, checked by the
    # launcher) it knows the sum's, and emits 16-byte accesses. An address loaded from the table carries none.
    offset = tl.load(table_ptr + t * 16 + col)
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
def _quantize(
    x, scale, like, SCALED: tl.constexpr, FMAX: tl.constexpr, IS_FP8: tl.constexpr, MBITS: tl.constexpr,
    MIN_EXP: tl.constexpr, EXACT_ROUND: tl.constexpr,
):  # fmt: skip
    # fp32 x as stored in the dtype of the pointer `like`: saturate(x * scale) for scaled formats (NaN for a non-finite
    # x, so an overflow is never hidden), a plain RNE conversion otherwise.
    dtype = like.dtype.element_ty
    if SCALED:
        finite = tl.abs(x) < float("inf")
        y = x * scale
        if IS_FP8 and not EXACT_ROUND:  # cvt.rn.satfinite saturates and writes NaN as 0x7F
            q = tl.where(finite, y, float("nan")).to(dtype)
        elif IS_FP8:
            y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
            y = _round_to_fp8_grid(y, MBITS, MIN_EXP, 2.0 ** (MIN_EXP - MBITS + 23))
            q = tl.where(finite, y.to(dtype).to(tl.uint8, bitcast=True), 0x7F).to(tl.uint8)
            q = q.to(dtype, bitcast=True)  # NaN as PyTorch writes it
        else:
            q = tl.where(finite, tl.minimum(tl.maximum(y, -FMAX), FMAX), float("nan")).to(dtype)
    else:
        if EXACT_ROUND and dtype == tl.bfloat16:
            x = _round_to_bf16(x)
        q = x.to(dtype)
    return q


@triton.jit
def _widen(q, EXACT_ROUND: tl.constexpr):
    # A loaded tile as fp32. Under the interpreter an FP8 tile is decoded from its bytes: the interpreter's own
    # conversion turns NaN and E5M2's infinities into numbers (480; 65536, 81920), so a NaN gradient or a moment stored
    # NaN updated the weight as a large finite value where the reference (and a GPU) makes it NaN.
    if EXACT_ROUND and q.dtype == tl.float8e4nv:
        return _decode_fp8(q.to(tl.uint8, bitcast=True), True, True)
    elif EXACT_ROUND and q.dtype == tl.float8e5:
        return _decode_fp8(q.to(tl.uint8, bitcast=True), False, True)
    else:
        return q.to(tl.float32)


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
def _emit(
    e_ptr, offs, mask, src, e_s, acc_s, MASKED: tl.constexpr, E_MAX: tl.constexpr, E_MBITS: tl.constexpr,
    E_MIN_EXP: tl.constexpr, EXACT_ROUND: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    # The forward's weight cast of the stored values `src` (fp32): write the FP8 copy, count saturated elements
    # (acc_s [BLOCK // VEC]: each thread folds its VEC consecutive elements into one register, as the amaxes).
    sat = (tl.abs(src * e_s) >= E_MAX) & (tl.abs(src) < float("inf"))
    if MASKED:
        sat = sat & mask
    q = _quantize(src, e_s, e_ptr, True, E_MAX, True, E_MBITS, E_MIN_EXP, EXACT_ROUND)
    _store(e_ptr, offs, q, mask, MASKED)
    return acc_s + tl.sum(tl.reshape(sat.to(tl.float32), [BLOCK // VEC, VEC]), 1)


@triton.jit
def _decay_progress(q, x, old_bits, beta1, FMAX: tl.constexpr, EXACT_ROUND: tl.constexpr):
    # reference_adamw.decay_progress_ref, with the scale unchanged: q (FP8 exp_avg) rounded back to the stored code
    # `old_bits` (not 0) while the exact `x` fell at least half the decay toward zero: one code toward zero. A NaN q
    # (a NaN stored again) is never held: read as a number (the interpreter's 480), it became 448.
    x = tl.minimum(tl.maximum(x, -FMAX), FMAX)
    bits = q.to(tl.uint8, bitcast=True)
    q32 = _widen(q, EXACT_ROUND)
    held = (bits == old_bits) & (q32 != 0.0) & (tl.abs(x) <= tl.abs(q32) * ((1.0 + beta1) * 0.5))
    bits = tl.where(held, bits - 1, bits)  # sign and magnitude: one code less is one step toward zero
    return bits.to(q.dtype, bitcast=True)


@triton.jit
def _saturate_grad(g, LIMIT: tl.constexpr):
    # reference_adamw.saturate_grad_ref: a finite g clamped to +-LIMIT, inf and NaN unchanged.
    return tl.where(tl.abs(g) < float("inf"), tl.minimum(tl.maximum(g, -LIMIT), LIMIT), g)


@triton.jit
def _update(
    gq, wq, mq, vq, p_ptr, m_ptr, v_ptr, c_ptr, e_ptr, offs, mask, acc_p, acc_m, acc_v, acc_s,
    ginv, w_mul, m_mul, v_mul, wp_s, wp_inv, wm_s, wv_s, e_s, one_minus_beta1, one_minus_beta2, eps, step_size, beta1,
    m_s,
    MASKED: tl.constexpr, SCALED_P: tl.constexpr, SCALED_M: tl.constexpr, SCALED_V: tl.constexpr,
    P_MAX: tl.constexpr, M_MAX: tl.constexpr, V_MAX: tl.constexpr,
    M_FP8: tl.constexpr, M_MBITS: tl.constexpr, M_MIN_EXP: tl.constexpr, HAS_COPY: tl.constexpr,
    EMIT: tl.constexpr, E_MAX: tl.constexpr, E_MBITS: tl.constexpr, E_MIN_EXP: tl.constexpr,
    WRITE: tl.constexpr, ACCUM_AMAX: tl.constexpr, EXACT_ROUND: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    # One block: the AdamW update of loaded values (stored dtypes), the amaxes, the scaled stores, the FP8 copy.
    g = _widen(gq, EXACT_ROUND) * ginv
    if SCALED_V:  # g * g of a finite |g| > ~1.8e19 would overflow and be stored NaN
        g = _saturate_grad(g, GRAD_SATURATION)
    m = _widen(mq, EXACT_ROUND) * m_mul + g * one_minus_beta1
    v = vq.to(tl.float32) * v_mul + (g * g) * one_minus_beta2
    w = wq.to(tl.float32) * w_mul - tl.div_rn(m, tl.sqrt_rn(v) + eps) * step_size
    if ACCUM_AMAX:
        acc_p = _fold_amax(acc_p, w, mask, MASKED, BLOCK, VEC)
        acc_m = _fold_amax(acc_m, m, mask, MASKED, BLOCK, VEC)
        acc_v = _fold_amax(acc_v, v, mask, MASKED, BLOCK, VEC)
    if WRITE:
        qp = _quantize(w, wp_s, p_ptr, SCALED_P, P_MAX, False, 0, 0, EXACT_ROUND)
        _store(p_ptr, offs, qp, mask, MASKED)
        qm = _quantize(m, wm_s, m_ptr, SCALED_M, M_MAX, M_FP8, M_MBITS, M_MIN_EXP, EXACT_ROUND)
        if M_FP8 and SCALED_M:
            if wm_s == m_s:  # (a step that changes the scale moves every stored value)
                qm = _decay_progress(qm, m * wm_s, mq.to(tl.uint8, bitcast=True), beta1, M_MAX, EXACT_ROUND)
        _store(m_ptr, offs, qm, mask, MASKED)
        _store(v_ptr, offs, _quantize(v, wv_s, v_ptr, SCALED_V, V_MAX, False, 0, 0, EXACT_ROUND), mask, MASKED)
        if HAS_COPY:  # the master as stored, unscaled (exact: a power-of-two scale), so the weight is the master
            c = qp.to(tl.float32)
            if SCALED_P:
                c = c * wp_inv
            qc = _quantize(c, 1.0, c_ptr, False, 1.0, False, 0, 0, EXACT_ROUND)
            _store(c_ptr, offs, qc, mask, MASKED)
            if EMIT:  # the forward reads the copy
                acc_s = _emit(e_ptr, offs, mask, qc.to(tl.float32), e_s, acc_s, MASKED, E_MAX, E_MBITS, E_MIN_EXP,
                              EXACT_ROUND, BLOCK, VEC)  # fmt: skip
        elif EMIT:  # the forward reads the param's storage (scaled at O2)
            acc_s = _emit(e_ptr, offs, mask, qp.to(tl.float32), e_s, acc_s, MASKED, E_MAX, E_MBITS, E_MIN_EXP,
                          EXACT_ROUND, BLOCK, VEC)  # fmt: skip
    return acc_p, acc_m, acc_v, acc_s


@triton.jit
def _scale_source(
    table_ptr, amax_out_ptr, t, j: tl.constexpr, grad_unscale,
    beta1, one_minus_beta1, beta2, one_minus_beta2, decay, max_update, FRESH: tl.constexpr, SLACK: tl.constexpr,
):  # fmt: skip
    # The amax state j's new scale comes from: this step's (two-pass), or a bound known before the update.
    if FRESH:
        source = tl.load(amax_out_ptr + t * 4 + j)
    else:  # reference_adamw.adamw_bound_ref, operation for operation
        a = tl.load(_addr(table_ptr, t, 7 + j, amax_out_ptr)) * SLACK
        if j == 0:
            source = a * tl.abs(decay) + max_update
        else:
            ga = tl.load(_addr(table_ptr, t, 13, amax_out_ptr)) * tl.abs(grad_unscale) * SLACK
            if j == 1:
                source = a * beta1 + ga * one_minus_beta1
            else:
                ga = tl.where((ga > GRAD_SATURATION) & (ga < float("inf")), GRAD_SATURATION, ga)  # (adamw_bound_ref)
                source = a * beta2 + (ga * ga) * one_minus_beta2
    return source


@triton.jit
def _write_scale(
    table_ptr, amax_out_ptr, t, j: tl.constexpr, prev, grad_unscale,
    beta1, one_minus_beta1, beta2, one_minus_beta2, decay, max_update,
    MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr, FRESH: tl.constexpr, SLACK: tl.constexpr,
):  # fmt: skip
    # The scale state j is written with.
    source = _scale_source(table_ptr, amax_out_ptr, t, j, grad_unscale, beta1, one_minus_beta1, beta2,
                           one_minus_beta2, decay, max_update, FRESH, SLACK)  # fmt: skip
    return _pow2_scale(source, prev, MAX_EXP, MAX_MANT, 0)


@triton.jit
def _stored_amax(a, ms, src, SCALED_SRC: tl.constexpr, SRC_MAX: tl.constexpr, EXACT_ROUND: tl.constexpr):
    # The amax of the stored values from the fp32 amax `a` (monotonic rounding); NaN (a non-finite weight) as inf.
    a_s = _quantize(a, ms, src, SCALED_SRC, SRC_MAX, False, 0, 0, EXACT_ROUND).to(tl.float32)
    return tl.where(a_s == a_s, a_s, float("inf"))


@triton.jit
def _state_factors(table_ptr, t, col: tl.constexpr, like, factor, SCALED: tl.constexpr):
    # (old scale, (1 / old scale) * factor): the dequantization folded into the state's per-tensor factor.
    if SCALED:
        scale = tl.load(_addr(table_ptr, t, col, like))
        return scale, tl.div_rn(1.0, scale) * factor
    return 1.0, factor


@triton.jit
def _adamw_kernel(
    table_ptr,  # int64 [T, NCOL]: offsets, addresses (see NCOL) and element count per tensor
    blocks_ptr,  # int32 [n_programs, 2]: (tensor index, chunk index) of each program
    amax_out_ptr,  # fp32 [T, 4]: new amax of (param, exp_avg, exp_avg_sq), atomic max (pass A, one pass) or read
    # (pass B); then the saturated count of the FP8 weight copy (atomic add in the write pass)
    p0, g0, m0, v0, c0, e0,  # first tensor of each list: the bases of the table's offsets; their types type the others
    grad_unscale, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, step_size,
    max_update,  # fp32 scalars (reference_adamw.AdamWConstants)
    SCALED_P: tl.constexpr, SCALED_M: tl.constexpr, SCALED_V: tl.constexpr,  # storage carries a scale
    P_EXP: tl.constexpr, P_MANT: tl.constexpr, M_EXP: tl.constexpr,  # exponent/mantissa bits of each format max
    M_MANT: tl.constexpr, V_EXP: tl.constexpr, V_MANT: tl.constexpr,
    P_MAX: tl.constexpr, M_MAX: tl.constexpr, V_MAX: tl.constexpr,  # format maxima
    M_FP8: tl.constexpr, M_MBITS: tl.constexpr, M_MIN_EXP: tl.constexpr,  # exp_avg is FP8 (and its format)
    HAS_GSI: tl.constexpr,  # gradients carry a scale_inv (FP8 gradients)
    HAS_COPY: tl.constexpr,  # write the new weight, unscaled, to a high-precision copy
    EMIT: tl.constexpr,  # write the FP8 copy of the weight the forward reads (the copy, else the param's storage)
    E_MAX: tl.constexpr, E_EXP: tl.constexpr, E_MANT: tl.constexpr,  # its format: max and the max's fp32 fields,
    E_MBITS: tl.constexpr, E_MIN_EXP: tl.constexpr, E_MARGIN: tl.constexpr,  # mantissa bits, min normal exponent
    SRC_MAX: tl.constexpr,  # the format max of the master's scaled storage (SCALED_P)
    WRITE: tl.constexpr,  # False: pass A (amax only)
    FRESH: tl.constexpr,  # write scales from amax_out (two-pass B) or from the bounds (one pass)
    ACCUM_AMAX: tl.constexpr,  # fold this pass's amax into amax_out
    SLACK: tl.constexpr,  # reference_adamw.BOUND_SLACK
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
    n = tl.load(table_ptr + t * 16 + 12)
    if OFFS_64:
        chunk = chunk.to(tl.int64)
    else:
        n = n.to(tl.int32)
    p_ptr, g_ptr = _data_ptr(table_ptr, t, 0, p0, ALIGNED), _data_ptr(table_ptr, t, 1, g0, ALIGNED)
    m_ptr, v_ptr = _data_ptr(table_ptr, t, 2, m0, ALIGNED), _data_ptr(table_ptr, t, 3, v0, ALIGNED)
    c_ptr, e_ptr = _data_ptr(table_ptr, t, 11, c0, ALIGNED), _data_ptr(table_ptr, t, 14, e0, ALIGNED)
    start = chunk * (BLOCK * ITERS)
    lanes = tl.arange(0, BLOCK)
    ginv = grad_unscale
    if HAS_GSI:
        ginv = tl.load(_addr(table_ptr, t, 10, amax_out_ptr)) * grad_unscale
    # Old scales, the per-tensor factors of the update and the scales of this write.
    p_s, w_mul = _state_factors(table_ptr, t, 4, amax_out_ptr, decay, SCALED_P)
    m_s, m_mul = _state_factors(table_ptr, t, 5, amax_out_ptr, beta1, SCALED_M)
    v_s, v_mul = _state_factors(table_ptr, t, 6, amax_out_ptr, beta2, SCALED_V)
    wp_s, wm_s, wv_s, e_s, wp_inv = p_s, m_s, v_s, 1.0, 1.0
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
        wp_inv = tl.div_rn(1.0, wp_s)  # exact: a power of two
        if EMIT:
            e_s = _emit_scale(table_ptr, amax_out_ptr, t, wp_s, p0, c0, grad_unscale, decay, max_update, SCALED_P,
                              HAS_COPY, SRC_MAX, E_EXP, E_MANT, E_MARGIN, FRESH, SLACK, EXACT_ROUND)  # fmt: skip
    acc_p = tl.zeros([BLOCK // VEC], dtype=tl.float32)
    acc_m = tl.zeros([BLOCK // VEC], dtype=tl.float32)
    acc_v = tl.zeros([BLOCK // VEC], dtype=tl.float32)
    acc_s = tl.zeros([BLOCK // VEC], dtype=tl.float32)
    if start + BLOCK * ITERS <= n:  # inside the tensor: no masks, so the accesses stay vectorized
        for i in range(ITERS):
            offs = start + i * BLOCK + lanes
            gq, wq = tl.load(g_ptr + offs), tl.load(p_ptr + offs)
            mq, vq = tl.load(m_ptr + offs), tl.load(v_ptr + offs)
            acc_p, acc_m, acc_v, acc_s = _update(
                gq, wq, mq, vq, p_ptr, m_ptr, v_ptr, c_ptr, e_ptr, offs, None, acc_p, acc_m, acc_v, acc_s, ginv,
                w_mul, m_mul, v_mul, wp_s, wp_inv, wm_s, wv_s, e_s, one_minus_beta1, one_minus_beta2, eps, step_size,
                beta1, m_s,
                False, SCALED_P, SCALED_M, SCALED_V, P_MAX, M_MAX, V_MAX, M_FP8, M_MBITS, M_MIN_EXP, HAS_COPY,
                EMIT, E_MAX, E_MBITS, E_MIN_EXP, WRITE, ACCUM_AMAX, EXACT_ROUND, BLOCK, VEC,
            )  # fmt: skip
    else:  # the tensor's last chunk
        for i in range(ITERS):
            offs = start + i * BLOCK + lanes
            mask = offs < n
            gq, wq = tl.load(g_ptr + offs, mask=mask, other=0.0), tl.load(p_ptr + offs, mask=mask, other=0.0)
            mq, vq = tl.load(m_ptr + offs, mask=mask, other=0.0), tl.load(v_ptr + offs, mask=mask, other=0.0)
            acc_p, acc_m, acc_v, acc_s = _update(
                gq, wq, mq, vq, p_ptr, m_ptr, v_ptr, c_ptr, e_ptr, offs, mask, acc_p, acc_m, acc_v, acc_s, ginv,
                w_mul, m_mul, v_mul, wp_s, wp_inv, wm_s, wv_s, e_s, one_minus_beta1, one_minus_beta2, eps, step_size,
                beta1, m_s,
                True, SCALED_P, SCALED_M, SCALED_V, P_MAX, M_MAX, V_MAX, M_FP8, M_MBITS, M_MIN_EXP, HAS_COPY,
                EMIT, E_MAX, E_MBITS, E_MIN_EXP, WRITE, ACCUM_AMAX, EXACT_ROUND, BLOCK, VEC,
            )  # fmt: skip
    if ACCUM_AMAX:  # NaN counts as inf (reference.amax_ref)
        acc_p = tl.where(acc_p == acc_p, acc_p, float("inf"))
        acc_m = tl.where(acc_m == acc_m, acc_m, float("inf"))
        acc_v = tl.where(acc_v == acc_v, acc_v, float("inf"))
        tl.atomic_max(amax_out_ptr + t * 4, tl.max(acc_p, axis=0))
        tl.atomic_max(amax_out_ptr + t * 4 + 1, tl.max(acc_m, axis=0))
        tl.atomic_max(amax_out_ptr + t * 4 + 2, tl.max(acc_v, axis=0))
    if EMIT and WRITE:  # exact in fp32 below 2**24 saturated elements per tensor
        n_sat = tl.sum(acc_s, axis=0)
        tl.atomic_add(amax_out_ptr + t * 4 + 3, n_sat, mask=n_sat > 0)


@triton.jit
def _emitted_amax(a, ms, p0, c0, SCALED_P: tl.constexpr, HAS_COPY: tl.constexpr, SRC_MAX: tl.constexpr,
                  EXACT_ROUND: tl.constexpr):  # fmt: skip
    # The amax of the values the FP8 copy is cast from, from the master's fp32 amax `a`: its stored image (scaled by
    # `ms`), then, with a high-precision copy, that unscaled and rounded to the copy's dtype (every step monotonic).
    a_s = _stored_amax(a, ms, p0, SCALED_P, SRC_MAX, EXACT_ROUND)
    if HAS_COPY:
        a_s = _stored_amax(a_s * tl.div_rn(1.0, ms), 1.0, c0, False, 1.0, EXACT_ROUND)
    return a_s


@triton.jit
def _emit_scale(
    table_ptr, amax_out_ptr, t, ms, p0, c0, grad_unscale, decay, max_update,
    SCALED_P: tl.constexpr, HAS_COPY: tl.constexpr, SRC_MAX: tl.constexpr, E_EXP: tl.constexpr,
    E_MANT: tl.constexpr, E_MARGIN: tl.constexpr, FRESH: tl.constexpr, SLACK: tl.constexpr, EXACT_ROUND: tl.constexpr,
):  # fmt: skip
    # The FP8 copy's scale: current scaling of the stored values, whose amax is the stored image of the master's new
    # amax (fresh) or of its one-pass bound. `ms`: the new master scale (used only for scaled storage).
    a = _scale_source(table_ptr, amax_out_ptr, t, 0, grad_unscale, 0.0, 0.0, 0.0, 0.0, decay, max_update, FRESH,
                      SLACK)  # fmt: skip
    a_s = _emitted_amax(a, ms, p0, c0, SCALED_P, HAS_COPY, SRC_MAX, EXACT_ROUND)
    # An amax of 0 or inf: scale 1 for the weight, i.e. 1 / ms for scaled storage (reference.emit_fp8_weight_ref).
    prev = 1.0
    if SCALED_P and not HAS_COPY:
        prev = tl.div_rn(1.0, ms)
    return _pow2_scale(a_s, prev, E_EXP, E_MANT, E_MARGIN)
