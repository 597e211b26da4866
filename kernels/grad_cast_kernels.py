"""The Triton kernels of the batched FP8 gradient cast (launched by :mod:`lightning_fp8.kernels.grad_cast`, which
states the math, the table layout and the launch plan).

Two launches over a block table that maps each program to one chunk (``BLOCK * ITERS`` elements) of one tensor:
``_grad_amax_kernel`` folds each tensor's amax into a zeroed fp32 [T] buffer (one atomic max per program);
``_grad_cast_kernel`` computes each tensor's scale from that amax, writes the FP8 bytes, counts the saturated values,
and the last program of each tensor to finish (an arrival ticket per tensor) records the cast in the tensor's packed
scaling state (kernels/scaling.py ``_record``, as the per-tensor cast does).

What keeps them memory-bound (as the AdamW kernels, kernels/adamw.py): each data pointer is a pointer argument (its
alignment is known to Triton) plus an element offset from the table that the launcher checked to be a multiple of 16
bytes (``ALIGNED``: a ``tl.multiple_of`` hint), so loads and stores are 16-byte (8-byte for FP8) vectors; chunks that
lie wholly inside their tensor run without masks, only a tensor's last chunk is masked; running amaxes and counts stay
in registers until the end of the chunk.
"""

import triton
import triton.language as tl
from lightning_fp8.kernels.adamw_kernels import _fold_amax
from lightning_fp8.kernels.comm_kernels import _decode_fp8
from lightning_fp8.kernels.fp8_encoding import _fp8_bytes, _round_to_fp8_grid
from lightning_fp8.kernels.scaling import _pow2_scale, _record

# Table columns (int64 [T, NCOL] per launch): element offsets of the gradient and of its FP8 output (from the first
# tensor of each list), the element count, the address of the packed state (reference_grad_cast.STATE_SLOTS), the
# element offset of the pending FP8 gradient and the address of its scale_inv (both only when accumulating).
NCOL = 6
_NCOL = tl.constexpr(NCOL)  # what the kernels read (a jit function may use a global only as a constexpr)


@triton.jit
def _data_ptr(table_ptr, t, col: tl.constexpr, base, ALIGNED: tl.constexpr):
    # `base` (a pointer argument) plus the element offset in column `col`; ALIGNED: that offset is a multiple of 16
    # bytes, so Triton may vectorize (an address loaded from the table would carry no alignment).
    offset = tl.load(table_ptr + t * _NCOL + col)
    if ALIGNED:
        offset = tl.multiple_of(offset, 128 // base.dtype.element_ty.primitive_bitwidth)
    return base + offset


@triton.jit
def _addr(table_ptr, t, col: tl.constexpr, like):
    # The address in column `col` of tensor t's row, typed like the pointer `like`.
    return tl.load(table_ptr + t * _NCOL + col).to(like.dtype)


@triton.jit
def _chunk(table_ptr, blocks_ptr, OFFS_64: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # This program's tensor, the first element of its chunk and the tensor's element count.
    pid = tl.program_id(0)
    t = tl.load(blocks_ptr + pid * 2).to(tl.int64)
    chunk = tl.load(blocks_ptr + pid * 2 + 1)
    n = tl.load(table_ptr + t * _NCOL + 2)
    if OFFS_64:
        chunk = chunk.to(tl.int64)
    else:
        n = n.to(tl.int32)
    return t, chunk * (BLOCK * ITERS), n


@triton.jit
def _load_grad(
    x_ptr, p_ptr, offs, mask, p_scale_inv, MASKED: tl.constexpr, ACCUM: tl.constexpr, P_E4M3: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):  # fmt: skip
    # The fp32 gradient: the loaded one, plus the pending FP8 gradient times its scale_inv (ACCUM). Two roundings, as
    # the reference's two torch ops (the GPU launch turns fp contraction off). Masked lanes hold 0.
    if MASKED:
        g = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        g = tl.load(x_ptr + offs).to(tl.float32)
    if ACCUM:
        if MASKED:
            q = tl.load(p_ptr + offs, mask=mask, other=0)
        else:
            q = tl.load(p_ptr + offs)
        g = _decode_fp8(q, P_E4M3, EXACT_ROUND) * p_scale_inv + g
    return g


@triton.jit
def _grad_amax_kernel(
    table_ptr,  # int64 [T, NCOL], see NCOL
    blocks_ptr,  # int32 [n_programs, 2]: (tensor index, chunk index) of each program
    amax_ptr,  # fp32 [T], zeroed: atomic max of |g| per tensor (NaN counts as inf)
    x0,  # the first gradient: the base of column 0's offsets (its type types the others)
    p0,  # ACCUM: the first pending FP8 gradient, as uint8: the base of column 4's offsets
    ACCUM: tl.constexpr,  # add the pending FP8 gradients
    P_E4M3: tl.constexpr,  # ACCUM: the pending gradients are E4M3 (else E5M2)
    EXACT_ROUND: tl.constexpr,  # decode FP8 with integer arithmetic (interpreter)
    ALIGNED: tl.constexpr,  # every data offset is a multiple of 16 bytes
    OFFS_64: tl.constexpr,  # a tensor is too large for 32-bit element offsets
    BLOCK: tl.constexpr,  # elements per loop step
    ITERS: tl.constexpr,  # loop steps per program (one chunk)
    VEC: tl.constexpr,  # consecutive elements per thread: BLOCK / (32 num_warps)
):
    t, start, n = _chunk(table_ptr, blocks_ptr, OFFS_64, BLOCK, ITERS)
    x_ptr = _data_ptr(table_ptr, t, 0, x0, ALIGNED)
    p_ptr = _data_ptr(table_ptr, t, 4, p0, ALIGNED)
    p_scale_inv = 1.0
    if ACCUM:
        p_scale_inv = tl.load(_addr(table_ptr, t, 5, amax_ptr))
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK // VEC], dtype=tl.float32)
    if start + BLOCK * ITERS <= n:  # inside the tensor: no masks, so the accesses stay vectorized
        for i in range(ITERS):
            offs = start + i * BLOCK + lanes
            g = _load_grad(x_ptr, p_ptr, offs, None, p_scale_inv, False, ACCUM, P_E4M3, EXACT_ROUND)
            acc = _fold_amax(acc, g, None, False, BLOCK, VEC)
    else:  # the tensor's last chunk
        for i in range(ITERS):
            offs = start + i * BLOCK + lanes
            mask = offs < n
            g = _load_grad(x_ptr, p_ptr, offs, mask, p_scale_inv, True, ACCUM, P_E4M3, EXACT_ROUND)
            acc = _fold_amax(acc, g, mask, True, BLOCK, VEC)
    acc = tl.where(acc == acc, acc, float("inf"))  # NaN counts as inf (reference.amax_ref)
    a = tl.max(acc, axis=0)
    tl.atomic_max(amax_ptr + t, a, mask=a > tl.load(amax_ptr + t), sem="relaxed")  # skip atomics that change nothing


@triton.jit
def _cast_block(
    g, scale, sat_acc, big_acc, FP8_MAX: tl.constexpr, IS_E4M3: tl.constexpr, MBITS: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr, SUBNORMAL_MAGIC: tl.constexpr, COUNT_BIG: tl.constexpr, EXACT_ROUND: tl.constexpr,
):  # fmt: skip
    # The FP8 bytes of fp32 g (NaN 0x7F for a non-finite g, as PyTorch writes it), the saturated count of the cast
    # (finite g with |g * scale| >= fp8_max) and the count of |g| >= fp8_max (NaN not), per element. Masked lanes hold
    # 0: counted nowhere. The per-tensor cast's numerics (kernels/cast_kernels.py).
    ag = tl.abs(g)
    finite = ag < float("inf")
    y = g * scale
    sat_acc += ((tl.abs(y) >= FP8_MAX) & finite).to(tl.int32)
    if COUNT_BIG:
        big_acc += (ag >= FP8_MAX).to(tl.int32)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    if EXACT_ROUND:  # non-finite lanes may come out as anything here: they are replaced below
        y = _round_to_fp8_grid(y, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC)
    q = tl.where(finite, _fp8_bytes(y, IS_E4M3), 0x7F).to(tl.uint8)
    return q, sat_acc, big_acc


@triton.jit
def _grad_cast_kernel(
    table_ptr,  # int64 [T, NCOL], see NCOL
    blocks_ptr,  # int32 [n_programs, 2]: (tensor index, chunk index) of each program
    f32_ptr,  # fp32 [2T]: the amaxes (from _grad_amax_kernel), then the scale_inv outputs
    cnt_ptr,  # int64 [3T], zeroed: saturated counts, arrival tickets, counts of |g| >= fp8_max
    x0,  # the first gradient: the base of column 0's offsets
    out0,  # uint8: the FP8 output buffer, the base of column 1's offsets
    p0,  # ACCUM: the first pending FP8 gradient, as uint8: the base of column 4's offsets
    T,  # tensors in the table
    FP8_MAX: tl.constexpr,  # largest finite value of the format
    IS_E4M3: tl.constexpr,  # E4M3 (True) or E5M2 output
    MBITS: tl.constexpr,  # mantissa bits of the format
    MIN_NORMAL_EXP: tl.constexpr,  # exponent of its smallest normal
    SUBNORMAL_MAGIC: tl.constexpr,  # 2**(MIN_NORMAL_EXP - MBITS + 23), see kernels/cast_kernels.py
    MAX_EXP: tl.constexpr,  # fp32 exponent and mantissa fields of the format max, and the margin (the scale)
    MAX_MANT: tl.constexpr,
    MARGIN: tl.constexpr,
    COUNT_BIG: tl.constexpr,  # count |g| >= fp8_max (for the gradient scaler)
    ACCUM: tl.constexpr,  # add the pending FP8 gradients
    P_E4M3: tl.constexpr,  # ACCUM: the pending gradients are E4M3 (else E5M2)
    EXACT_ROUND: tl.constexpr,  # round to the FP8 grid in fp32, decode FP8 with integer arithmetic (interpreter)
    ALIGNED: tl.constexpr,  # every data offset is a multiple of 16 bytes
    OFFS_64: tl.constexpr,  # a tensor is too large for 32-bit element offsets
    BLOCK: tl.constexpr,  # elements per loop step
    ITERS: tl.constexpr,  # loop steps per program (one chunk)
):
    t, start, n = _chunk(table_ptr, blocks_ptr, OFFS_64, BLOCK, ITERS)
    x_ptr = _data_ptr(table_ptr, t, 0, x0, ALIGNED)
    o_ptr = _data_ptr(table_ptr, t, 1, out0, ALIGNED)
    p_ptr = _data_ptr(table_ptr, t, 4, p0, ALIGNED)
    p_scale_inv = 1.0
    if ACCUM:
        p_scale_inv = tl.load(_addr(table_ptr, t, 5, f32_ptr))
    state = _addr(table_ptr, t, 3, f32_ptr)  # fp32 [history, scale, last_amax, saturation], int64 [.., .., nf, casts]
    a = tl.load(f32_ptr + t)
    # Current scaling: every program of the tensor computes its scale; the last one stores it (a program that read
    # the new scale instead of the old would compute the same: pow2_scale(a) where a is valid, else the old one).
    scale = _pow2_scale(a, tl.load(state + 1), MAX_EXP, MAX_MANT, MARGIN)
    lanes = tl.arange(0, BLOCK)
    sat_acc = tl.zeros([BLOCK], dtype=tl.int32)
    big_acc = tl.zeros([BLOCK], dtype=tl.int32)
    if start + BLOCK * ITERS <= n:  # inside the tensor: no masks
        for i in range(ITERS):
            offs = start + i * BLOCK + lanes
            g = _load_grad(x_ptr, p_ptr, offs, None, p_scale_inv, False, ACCUM, P_E4M3, EXACT_ROUND)
            q, sat_acc, big_acc = _cast_block(g, scale, sat_acc, big_acc, FP8_MAX, IS_E4M3, MBITS, MIN_NORMAL_EXP,
                                              SUBNORMAL_MAGIC, COUNT_BIG, EXACT_ROUND)  # fmt: skip
            tl.store(o_ptr + offs, q)
    else:  # the tensor's last chunk
        for i in range(ITERS):
            offs = start + i * BLOCK + lanes
            mask = offs < n
            g = _load_grad(x_ptr, p_ptr, offs, mask, p_scale_inv, True, ACCUM, P_E4M3, EXACT_ROUND)
            q, sat_acc, big_acc = _cast_block(g, scale, sat_acc, big_acc, FP8_MAX, IS_E4M3, MBITS, MIN_NORMAL_EXP,
                                              SUBNORMAL_MAGIC, COUNT_BIG, EXACT_ROUND)  # fmt: skip
            tl.store(o_ptr + offs, q, mask=mask)
    n_sat = tl.sum(sat_acc, axis=0).to(tl.int64)
    tl.atomic_add(cnt_ptr + t, n_sat, mask=n_sat > 0, sem="relaxed")
    if COUNT_BIG:
        n_big = tl.sum(big_acc, axis=0).to(tl.int64)
        tl.atomic_add(cnt_ptr + 2 * T + t, n_big, mask=n_big > 0, sem="relaxed")
    # The arrival ticket (acquire-release: every program's count is folded before it); the last program of the tensor
    # (an empty tensor has one program) records the cast in its state.
    numel = tl.maximum(n, 1)
    chunks = tl.cdiv(numel, BLOCK * ITERS)
    last = tl.atomic_add(cnt_ptr + T + t, 1, sem="acq_rel") == chunks - 1
    if last:
        total_sat = tl.atomic_add(cnt_ptr + t, 0, sem="acq_rel")
        ints = _addr(table_ptr, t, 3, table_ptr)
        _record(
            a, total_sat, numel, scale, state, state + 1, f32_ptr + T + t, state + 2, state + 3, ints + 2, ints + 3,
            1, 1.0, 1, MAX_EXP, MAX_MANT, MARGIN, True, False, False,
        )  # fmt: skip
        tl.store(state + 1, scale)
