"""The finalize launch of the multi-tensor AdamW step (launched by :mod:`lightning_fp8.kernels.adamw` after the main
pass of :mod:`lightning_fp8.kernels.adamw_kernels`): one program per tensor writes the states' new scales and amaxes
and, with an emitted FP8 weight copy, the statistics record the forward's cast would have written for it.
"""

import triton
import triton.language as tl
from lightning_fp8.kernels.adamw_kernels import _addr, _emit_scale, _emitted_amax, _write_scale


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
    tl.store(_addr(table_ptr, t, 7 + j, amax_out_ptr), tl.load(amax_out_ptr + t * 4 + j))


@triton.jit
def _finalize_emit(
    table_ptr, amax_out_ptr, t, p0, c0, grad_unscale, decay, max_update,
    SCALED_P: tl.constexpr, HAS_COPY: tl.constexpr, P_EXP: tl.constexpr, P_MANT: tl.constexpr, SRC_MAX: tl.constexpr,
    E_EXP: tl.constexpr, E_MANT: tl.constexpr, E_MARGIN: tl.constexpr, FRESH: tl.constexpr, SLACK: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):  # fmt: skip
    # The record of the FP8 copy, as the forward's cast would record it for the unscaled weight (reference.
    # emit_fp8_weight_ref): fp32 [scale_inv, amax, scale, saturation, history], then int64 [nonfinite, 1] at byte 24.
    # Runs before the master's scale and amax are overwritten: it recomputes the scales the main pass used.
    ms = 1.0
    if SCALED_P:
        ms = _write_scale(table_ptr, amax_out_ptr, t, 0, tl.load(_addr(table_ptr, t, 4, amax_out_ptr)), grad_unscale,
                          0.0, 0.0, 0.0, 0.0, decay, max_update, P_EXP, P_MANT, FRESH, SLACK)  # fmt: skip
    e_s = _emit_scale(table_ptr, amax_out_ptr, t, ms, p0, c0, grad_unscale, decay, max_update, SCALED_P, HAS_COPY,
                      SRC_MAX, E_EXP, E_MANT, E_MARGIN, FRESH, SLACK, EXACT_ROUND)  # fmt: skip
    a_s = _emitted_amax(tl.load(amax_out_ptr + t * 4), ms, p0, c0, SCALED_P, HAS_COPY, SRC_MAX, EXACT_ROUND)
    if HAS_COPY:  # the copy is cast unscaled
        ms = 1.0
    inv_ms = tl.div_rn(1.0, ms)  # exact: powers of two
    n = tl.load(table_ptr + t * 16 + 12).to(tl.float32)
    rec = _addr(table_ptr, t, 15, amax_out_ptr)
    tl.store(rec, tl.div_rn(1.0, e_s) * inv_ms)
    tl.store(rec + 1, a_s * inv_ms)
    tl.store(rec + 2, e_s * ms)
    tl.store(rec + 3, tl.div_rn(tl.load(amax_out_ptr + t * 4 + 3), tl.maximum(n, 1.0)))  # an empty weight: 0, not NaN
    tl.store(rec + 4, tl.where(a_s < float("inf"), a_s, 0.0) * inv_ms)
    counts = _addr(table_ptr, t, 15, table_ptr) + 3
    tl.store(counts, (a_s == float("inf")).to(tl.int64))
    tl.store(counts + 1, tl.full([], 1, tl.int64))


@triton.jit
def _finalize_kernel(
    table_ptr,  # int64 [T, NCOL], as above
    amax_out_ptr,  # fp32 [T, 4]: the new amaxes, the copy's saturated count
    p0, c0,  # the first param and copy: their types are the stored formats of the weights
    grad_unscale, beta1, one_minus_beta1, beta2, one_minus_beta2, decay, max_update,  # fp32 scalars
    SCALED_P: tl.constexpr, SCALED_M: tl.constexpr, SCALED_V: tl.constexpr,
    P_EXP: tl.constexpr, P_MANT: tl.constexpr, M_EXP: tl.constexpr,
    M_MANT: tl.constexpr, V_EXP: tl.constexpr, V_MANT: tl.constexpr,
    HAS_AMAXES: tl.constexpr,  # amaxes (and scales) of the states to write
    HAS_COPY: tl.constexpr, EMIT: tl.constexpr, SRC_MAX: tl.constexpr,  # as _adamw_kernel
    E_EXP: tl.constexpr, E_MANT: tl.constexpr, E_MARGIN: tl.constexpr,
    FRESH: tl.constexpr, SLACK: tl.constexpr, EXACT_ROUND: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    if EMIT:
        _finalize_emit(table_ptr, amax_out_ptr, t, p0, c0, grad_unscale, decay, max_update, SCALED_P, HAS_COPY,
                       P_EXP, P_MANT, SRC_MAX, E_EXP, E_MANT, E_MARGIN, FRESH, SLACK, EXACT_ROUND)  # fmt: skip
    if HAS_AMAXES:
        _finalize_one(table_ptr, amax_out_ptr, t, 0, SCALED_P, grad_unscale, beta1, one_minus_beta1, beta2,
                      one_minus_beta2, decay, max_update, P_EXP, P_MANT, FRESH, SLACK)  # fmt: skip
        _finalize_one(table_ptr, amax_out_ptr, t, 1, SCALED_M, grad_unscale, beta1, one_minus_beta1, beta2,
                      one_minus_beta2, decay, max_update, M_EXP, M_MANT, FRESH, SLACK)  # fmt: skip
        _finalize_one(table_ptr, amax_out_ptr, t, 2, SCALED_V, grad_unscale, beta1, one_minus_beta1, beta2,
                      one_minus_beta2, decay, max_update, V_EXP, V_MANT, FRESH, SLACK)  # fmt: skip
