"""Multi-tensor AdamW step on scaled low-precision states, in Triton (the FP8-LM optimizer, O2).

Math (per element, fp32 in registers, one IEEE rounding per operation; numerics defined by
:func:`lightning_fp8.kernels.reference.adamw_step_ref`)::

    g = grad * grad_scale_inv                        FP8 gradient scale and 1/mu, powers of two (exact)
    w, m, v = state * (1 / state_scale)              fp16 master, E4M3 m, fp16 v (or unscaled fp32/bf16); exact
    m = m * b1 + g * (1 - b1);  v = v * b2 + g * g * (1 - b2)
    w = w * (1 - lr wd) - m / (sqrt(v) * (1 / sqrt(1 - b2^t)) + eps) * lr / (1 - b1^t)
    state = RNE(saturate(x * new_scale)),  new_scale = 2 ** floor(log2(fmax / a))

The new amax is known only after the update. Two schedules, selected by ``two_pass``:

- two passes: pass A computes the update and folds each tensor's new amaxes into a [T, 3] buffer (one
  atomic max per program and state); pass B recomputes the update and writes with the scale of that
  amax (``a`` = the fresh amax). Reads the inputs twice: 6 + 6 + 5 bytes per parameter at O2.
- one pass: ``a`` is an upper bound of the new amax known before the update, from the stored amaxes and
  the gradient's amax (``reference.adamw_bound_ref``): the write never saturates and the fresh amax is
  folded for the next step. 6 + 5 bytes per parameter; the scale is at most a binade or so conservative.

Either way a small finalize launch writes the new scales and amaxes into the 0-dim state tensors (the
main passes read the old scales, so they cannot be overwritten while those run).

Many tensors per launch: a table holds each tensor's addresses (param, grad, m, v, scales, amaxes, grad
scale_inv, an optional high-precision copy, grad amax) and element count; a block table maps each program
to one chunk of one tensor. Tensors are grouped by dtypes, so a launch has one set of element types,
taken from the first tensor of each list.

Exactness: the GPU build disables fp contraction (``enable_fp_fusion=False``) and uses IEEE division and
square root (``div_rn``, ``sqrt_rn``), so results equal the reference bit for bit. Dividing by a
power-of-two scale is a multiplication by its exact reciprocal. Under the interpreter fp32 -> FP8 and
fp32 -> bf16 conversions are pre-rounded in fp32 (see kernels/cast.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from lightning_fp8.kernels.cast import _interpreted, _round_to_fp8_grid
from lightning_fp8.kernels.reference import BOUND_SLACK, SCALED_STATE_MAX, AdamWConstants, float32_exponent_mantissa

# Launch config (measured on an H100 with benchmarks/bench_optim.py --sweep): BLOCK elements per loop step,
# ITERS loop steps per program (one chunk), NUM_WARPS per program.
CONFIG = {"BLOCK": 512, "ITERS": 16, "NUM_WARPS": 4}
_INTERPRETER_CONFIG = {"BLOCK": 64, "ITERS": 2, "NUM_WARPS": 1}

# Table columns: addresses of param, grad, exp_avg, exp_avg_sq, their 3 scales, their 3 amaxes, the grad's
# scale_inv, the high-precision copy, then the element count and the address of the grad's amax.
_NCOL = 14
_FP8_FORMAT = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}  # mantissa bits, min normal exponent


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
def _load_state(ptr, offs, mask, scale_inv, SCALED: tl.constexpr):
    x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        x = x * scale_inv
    return x


@triton.jit
def _store_state(
    ptr, offs, mask, x, scale,
    SCALED: tl.constexpr, FMAX: tl.constexpr, IS_FP8: tl.constexpr,
    MBITS: tl.constexpr, MIN_EXP: tl.constexpr, EXACT_ROUND: tl.constexpr,
):  # fmt: skip
    if SCALED:
        finite = tl.abs(x) < float("inf")
        y = tl.minimum(tl.maximum(x * scale, -FMAX), FMAX)
        if IS_FP8:
            if EXACT_ROUND:
                y = _round_to_fp8_grid(y, MBITS, MIN_EXP, 2.0 ** (MIN_EXP - MBITS + 23))
            q = y.to(ptr.dtype.element_ty).to(tl.uint8, bitcast=True)
            q = tl.where(finite, q, 0x7F).to(tl.uint8)  # NaN, as PyTorch writes it
            tl.store(ptr + offs, q.to(ptr.dtype.element_ty, bitcast=True), mask=mask)
        else:
            tl.store(ptr + offs, tl.where(finite, y, float("nan")).to(ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=mask)


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
def _adamw_kernel(
    table_ptr,  # int64 [T, 14]: addresses (see _NCOL) and element count per tensor
    blocks_ptr,  # int32 [n_programs, 2]: (tensor index, chunk index) of each program
    amax_out_ptr,  # fp32 [T, 3]: new amax of (param, exp_avg, exp_avg_sq); atomic max (pass A, one pass) or read (B)
    p0, g0, m0, v0, c0,  # first tensor of each list: their pointer types type the table's addresses
    grad_unscale, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, step_size, inv_bc2_sqrt,
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
    BLOCK: tl.constexpr,  # elements per loop step
    ITERS: tl.constexpr,  # loop steps per program
):  # fmt: skip
    pid = tl.program_id(0)
    t = tl.load(blocks_ptr + pid * 2).to(tl.int64)
    chunk = tl.load(blocks_ptr + pid * 2 + 1).to(tl.int64)
    n = tl.load(table_ptr + t * 14 + 12)
    p_ptr, g_ptr = _addr(table_ptr, t, 0, p0), _addr(table_ptr, t, 1, g0)
    m_ptr, v_ptr = _addr(table_ptr, t, 2, m0), _addr(table_ptr, t, 3, v0)
    ginv = grad_unscale
    if HAS_GSI:
        ginv = tl.load(_addr(table_ptr, t, 10, amax_out_ptr)) * grad_unscale
    # Old scales (and their exact reciprocals, powers of two) and the scales of this write.
    p_s = 1.0
    m_s = 1.0
    v_s = 1.0
    p_inv = 1.0
    m_inv = 1.0
    v_inv = 1.0
    if SCALED_P:
        p_s = tl.load(_addr(table_ptr, t, 4, amax_out_ptr))
        p_inv = tl.div_rn(1.0, p_s)
    if SCALED_M:
        m_s = tl.load(_addr(table_ptr, t, 5, amax_out_ptr))
        m_inv = tl.div_rn(1.0, m_s)
    if SCALED_V:
        v_s = tl.load(_addr(table_ptr, t, 6, amax_out_ptr))
        v_inv = tl.div_rn(1.0, v_s)
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
    acc_p = tl.zeros([BLOCK], dtype=tl.float32)
    acc_m = tl.zeros([BLOCK], dtype=tl.float32)
    acc_v = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = (chunk * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * ginv
        w = _load_state(p_ptr, offs, mask, p_inv, SCALED_P)
        m = _load_state(m_ptr, offs, mask, m_inv, SCALED_M)
        v = _load_state(v_ptr, offs, mask, v_inv, SCALED_V)
        m = m * beta1 + g * one_minus_beta1
        v = v * beta2 + (g * g) * one_minus_beta2
        denom = tl.sqrt_rn(v) * inv_bc2_sqrt + eps
        w = w * decay - tl.div_rn(m, denom) * step_size
        if ACCUM_AMAX:  # masked lanes computed from zeros stay 0 (w = 0, m = 0, v = 0): neutral for the max
            acc_p = tl.maximum(acc_p, tl.where(w == w, tl.abs(w), float("inf")))
            acc_m = tl.maximum(acc_m, tl.where(m == m, tl.abs(m), float("inf")))
            acc_v = tl.maximum(acc_v, tl.where(v == v, tl.abs(v), float("inf")))
        if WRITE:
            _store_state(p_ptr, offs, mask, w, wp_s, SCALED_P, P_MAX, False, 0, 0, EXACT_ROUND)
            _store_state(m_ptr, offs, mask, m, wm_s, SCALED_M, M_MAX, M_FP8, M_MBITS, M_MIN_EXP, EXACT_ROUND)
            _store_state(v_ptr, offs, mask, v, wv_s, SCALED_V, V_MAX, False, 0, 0, EXACT_ROUND)
            if HAS_COPY:
                c_ptr = _addr(table_ptr, t, 11, c0)
                if EXACT_ROUND and c0.dtype.element_ty == tl.bfloat16:
                    w = _round_to_bf16(w)
                tl.store(c_ptr + offs, w.to(c0.dtype.element_ty), mask=mask)
    if ACCUM_AMAX:
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


def _check(params, grads, exp_avgs, exp_avg_sqs, scales, amaxes, param_copies) -> None:
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    for name, tensors in lists.items():
        if len(tensors) != len(params):
            raise ValueError(f"adamw_step: {name} has {len(tensors)} tensors but params has {len(params)}")
    for name, tensors in {"params": params, **lists, "param_copies": param_copies or []}.items():
        if any(not t.is_contiguous() for t in tensors) or len({t.dtype for t in tensors}) > 1:
            raise ValueError(f"adamw_step: the tensors of {name} must be contiguous and share one dtype")
    for i, p in enumerate(params):
        if any(t[i].numel() != p.numel() for t in lists.values()):
            raise ValueError(f"adamw_step: tensor {i} has states whose sizes differ from its param ({p.numel()})")
    if (scales is None) != (amaxes is None):
        raise ValueError("adamw_step: pass scales and amaxes together (both or neither)")


def _table(params, grads, exp_avgs, exp_avg_sqs, scales, amaxes, grad_scale_invs, grad_amaxes, param_copies):
    rows = []
    for i, p in enumerate(params):
        row = [p, grads[i], exp_avgs[i], exp_avg_sqs[i]]
        row += list(scales[i]) if scales is not None else [None] * 3
        row += list(amaxes[i]) if amaxes is not None else [None] * 3
        row.append(grad_scale_invs[i] if grad_scale_invs is not None else None)
        row.append(param_copies[i] if param_copies is not None else None)
        addresses = [t.data_ptr() if t is not None else 0 for t in row]
        addresses.append(p.numel())
        addresses.append(grad_amaxes[i].data_ptr() if grad_amaxes is not None else 0)
        rows.append(addresses)
    return torch.tensor(rows, dtype=torch.int64).to(params[0].device, non_blocking=True)


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
    _check(params, grads, exp_avgs, exp_avg_sqs, scales, amaxes, param_copies)
    c = AdamWConstants(lr, beta1, beta2, eps, weight_decay, step)
    if not two_pass and scales is not None and (grad_amaxes is None or c.max_update is None):
        raise ValueError("adamw_step(two_pass=False) needs grad_amaxes and beta1**2 < beta2 for its scale bounds")
    if not params:
        return
    device = params[0].device
    table = _table(params, grads, exp_avgs, exp_avg_sqs, scales, amaxes, grad_scale_invs, grad_amaxes, param_copies)
    interpreted = _interpreted(_adamw_kernel)
    cfg = _INTERPRETER_CONFIG if interpreted else CONFIG
    blocks = _block_table(tuple(p.numel() for p in params), cfg["BLOCK"] * cfg["ITERS"], device)
    amax_out = torch.zeros(len(params), 3, dtype=torch.float32, device=device)
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
        "SLACK": BOUND_SLACK, "EXACT_ROUND": interpreted, "BLOCK": cfg["BLOCK"], "ITERS": cfg["ITERS"],
    }  # fmt: skip
    launch = {} if interpreted else {"num_warps": cfg["NUM_WARPS"], "enable_fp_fusion": False}
    copy0 = param_copies[0] if param_copies is not None else params[0]
    args = (table, blocks, amax_out, params[0], grads[0], exp_avgs[0], exp_avg_sqs[0], copy0,
            *hyper, c.eps, c.decay, c.step_size, c.inv_bc2_sqrt, max_update)  # fmt: skip
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
