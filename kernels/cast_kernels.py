"""The Triton kernels of the FP8 casts (launched by :mod:`lightning_fp8.kernels.cast`, which states their math).

One pass: ``cast_to_fp8`` reads each element of ``x`` once (2-D tiles), writes ``x_fp8`` and, with
``transpose``, the transposed tile to ``x_fp8_t`` (``tl.trans``; the compiler moves it through shared
memory so that both stores are coalesced), and folds each program's amax and saturation count into two
global accumulators (at most one atomic max and one atomic add per program, skipped when they cannot
change anything). Programs are persistent (a grid-stride loop over work items of ``GROUP_M`` row tiles of one column
block, walked down the column) and keep running statistics (scalars, or per row or per element: ``STATS``), so neither
atomics nor registers grow with the tensor. With ``COLUMN_SUM`` the transposed cast also writes the column sums of
each work item's rows (a linear layer's bias gradient: the tiles added in registers, one reduction per item; the
launcher adds the items' sums in a fixed order: deterministic, no float atomics). With ``ACTIVATION`` the transposed
cast casts a GELU of each tile it reads (``"gelu"``), or the tile times the GELU's derivative at a second input's tile
(``"gelu_backward"``): FP8MLP's casts (``_activation``; kernels/reference.py: ``activation_ref``).

A scaling state's cast (``quantize_``, what ``ScalingState.quantize`` runs on a GPU) is the same kernel with
``RECORD``: each program folds its statistics into a per-stream int64 workspace with atomics and takes an
arrival ticket; the last program to arrive reads the totals, leaves the workspace zeroed, and does the state's
bookkeeping (kernels/scaling.py: history, next scale, 1 / scale, counters). A delayed cast is one launch; a
current-scaled one adds the amax launch before it, whose last program writes the scale.

The FP8 encoding of a block (rounding, saturation, bytes, running statistics) is in
:mod:`lightning_fp8.kernels.fp8_encoding`, shared with the optimizer, gradient and communication kernels.
"""

import triton
import triton.language as tl
from lightning_fp8.kernels.fp8_encoding import _fp8_bytes, _quantize_block, _round_to_fp8_grid, _scale_saturate
from lightning_fp8.kernels.reference import PRE_ACTIVATION_HEADROOM, PRE_ACTIVATION_MAX_SCALE
from lightning_fp8.kernels.scaling import _arrive, _finish, _guess_scale, _pow2_scale, _redo

# WRITE_PRE's scale: the cast's, PRE_ACTIVATION_HEADROOM binades smaller, at most PRE_SCALE_MAX (kernels/reference.py:
# quantize_ref, kept_input_scale_inv).
PRE_SCALE_FACTOR = tl.constexpr(2.0**-PRE_ACTIVATION_HEADROOM)
PRE_SCALE_MAX = tl.constexpr(PRE_ACTIVATION_MAX_SCALE)


@triton.jit
def _load_tile(ptr, offs, mask, dq, EVEN: tl.constexpr, LOAD_POLICY: tl.constexpr, FP8_IN: tl.constexpr,
               FP8_IN_E4M3: tl.constexpr, EXACT_ROUND: tl.constexpr):  # fmt: skip
    # A tile of a high-precision tensor as fp32, or (FP8_IN) of an FP8 one times its scale_inv dq (exact: a power of
    # two). Masked lanes: 0. The interpreter converts an FP8 NaN, and E5M2's infinities, to numbers (480; 65536, an
    # inf input whose GELU came out finite): their lanes are set from the bytes.
    if EVEN:
        v = tl.load(ptr + offs, eviction_policy=LOAD_POLICY)
    else:
        v = tl.load(ptr + offs, mask=mask, other=0.0, eviction_policy=LOAD_POLICY)
    x = v.to(tl.float32)
    if FP8_IN:
        x = x * dq
        if EXACT_ROUND:
            b = v.to(tl.uint8, bitcast=True)
            if FP8_IN_E4M3:
                x = tl.where((b & 0x7F) == 0x7F, float("nan"), x)
            else:
                inf = tl.where(b > 0x7F, float("-inf"), float("inf"))
                x = tl.where((b & 0x7F) > 0x7C, float("nan"), tl.where((b & 0x7F) == 0x7C, inf, x))
    return x


@triton.jit
def _activation(x, aux_ptr, offs, mask, dq, EVEN: tl.constexpr, ACTIVATION: tl.constexpr, DEQUANT: tl.constexpr,
                DQ_E4M3: tl.constexpr, EXACT_ROUND: tl.constexpr):  # fmt: skip
    # What the cast casts (kernels/reference.py: activation_ref), fp32: x itself, gelu(x), or x * gelu'(h) with h the
    # tile of aux at the same offsets (DEQUANT "aux": aux is FP8, h its values times dq; masked lanes: x = 0 -> 0,
    # neutral for the statistics and the column sums).
    if ACTIVATION == "gelu":
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == "gelu_backward":
        h = _load_tile(aux_ptr, offs, mask, dq, EVEN, "", DEQUANT == "aux", DQ_E4M3, EXACT_ROUND)
        cdf = 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))
        pdf = tl.exp(-0.5 * h * h) * 0.3989422804014327
        x = x * (cdf + h * pdf)
    return x


@triton.jit
def _cast_tile(
    x_ptr, aux_ptr, scale, out_ptr, out_t_ptr, pre_ptr, dq, amax_acc, nsat_acc, tm, tn, M, N, IS_E4M3: tl.constexpr,
    FP8_MAX: tl.constexpr, MBITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, SUBNORMAL_MAGIC: tl.constexpr,
    EXACT_ROUND: tl.constexpr, EVEN: tl.constexpr, INDEX_64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TRANSPOSE_VIA: tl.constexpr, WRITE_T: tl.constexpr, WRITE_X: tl.constexpr, STATS: tl.constexpr,
    LOAD_POLICY: tl.constexpr, STORE_POLICY: tl.constexpr, TMA: tl.constexpr, ACTIVATION: tl.constexpr,
    DEQUANT: tl.constexpr, DQ_E4M3: tl.constexpr, WRITE_PRE: tl.constexpr,
):  # fmt: skip
    # Tile (tm, tn) of _cast_transpose_kernel (its arguments say what each is): load, cast, store the copies, fold the
    # statistics. Returns the tile as fp32 (zeros past the edges) and the running statistics.
    rm = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    if INDEX_64:
        rm = rm.to(tl.int64)
        rn = rn.to(tl.int64)
    offs = rm[:, None] * N + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if TMA:  # a tile past the edge reads zeros: neutral for the statistics and the column sums
        x = x_ptr.load([tm * BLOCK_M, tn * BLOCK_N]).to(tl.float32)
    else:
        x = _load_tile(x_ptr, offs, mask, dq, EVEN, LOAD_POLICY, DEQUANT == "x", DQ_E4M3, EXACT_ROUND)
    if WRITE_PRE:  # x itself (the activation's input) in FP8 too, with PRE_SCALE_FACTOR times the scale (capped)
        pre, pre_finite, _, _ = _scale_saturate(x, tl.minimum(scale * PRE_SCALE_FACTOR, PRE_SCALE_MAX), FP8_MAX)
        if EXACT_ROUND:
            pre = _round_to_fp8_grid(pre, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC)
        q_pre = tl.where(pre_finite, _fp8_bytes(pre, IS_E4M3), 0x7F).to(tl.uint8)
        q_pre = q_pre.to(pre_ptr.dtype.element_ty, bitcast=True)
        if EVEN:
            tl.store(pre_ptr + offs, q_pre, cache_modifier=STORE_POLICY)
        else:
            tl.store(pre_ptr + offs, q_pre, mask=mask, cache_modifier=STORE_POLICY)
    if ACTIVATION != "":  # the launcher never combines an activation with TMA
        x = _activation(x, aux_ptr, offs, mask, dq, EVEN, ACTIVATION, DEQUANT, DQ_E4M3, EXACT_ROUND)
    q, y, finite, amax_acc, nsat_acc = _quantize_block(
        x, scale, amax_acc, nsat_acc, FP8_MAX, IS_E4M3, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC, EXACT_ROUND, STATS,
    )  # fmt: skip
    if not WRITE_X:
        pass
    elif TMA:
        out_ptr.store([tm * BLOCK_M, tn * BLOCK_N], q)
    elif EVEN:
        tl.store(out_ptr + offs, q.to(out_ptr.dtype.element_ty, bitcast=True), cache_modifier=STORE_POLICY)
    else:
        tl.store(out_ptr + offs, q.to(out_ptr.dtype.element_ty, bitcast=True), mask=mask,
                 cache_modifier=STORE_POLICY)  # fmt: skip
    if WRITE_T:
        # The transposed tile goes through shared memory; which form the compiler moves best is measured.
        if TRANSPOSE_VIA == "fp32":
            q_t = _fp8_bytes(tl.trans(tl.where(finite, y, float("nan"))), IS_E4M3)
        else:
            q_t = tl.trans(q)
        if TMA:  # q_t: FP8 bytes (uint8), the descriptor's element type
            out_t_ptr.store([tn * BLOCK_N, tm * BLOCK_M], q_t)
        else:
            q_t = q_t.to(out_t_ptr.dtype.element_ty, bitcast=True)
            offs_t = rn[:, None] * M + rm[None, :]  # rows of x_fp8_t are columns of x: contiguous along rm
            if EVEN:
                tl.store(out_t_ptr + offs_t, q_t, cache_modifier=STORE_POLICY)
            else:
                tl.store(out_t_ptr + offs_t, q_t, mask=(rn[:, None] < N) & (rm[None, :] < M),
                         cache_modifier=STORE_POLICY)  # fmt: skip
    return x, amax_acc, nsat_acc


@triton.jit
def _cast_transpose_kernel(
    x_ptr,  # (M, N) input, row-major, fp32/bf16/fp16 (TMA: its tensor descriptor, blocks of BLOCK_M x BLOCK_N)
    aux_ptr,  # ACTIVATION "gelu_backward": (M, N) the GELU's input, row-major (else unread)
    scale_ptr,  # 0-dim fp32 scale
    out_ptr,  # (M, N) FP8 output (TMA: a descriptor of its bytes, uint8)
    out_t_ptr,  # (N, M) FP8 output, the transposed copy (TMA: a descriptor of its bytes, blocks of BLOCK_N x BLOCK_M)
    pre_ptr,  # WRITE_PRE: (M, N) FP8 output, x itself cast with min(scale * PRE_SCALE_FACTOR, PRE_SCALE_MAX)
    dq_ptr,  # DEQUANT: 0-dim fp32, the scale_inv of the FP8 x ("x") or aux ("aux") (else unread)
    colsum_ptr,  # COLUMN_SUM: (cdiv(cdiv(M, BLOCK_M), GROUP_M), N) fp32 output, column sums of each row group of x
    amax_ptr,  # 0-dim fp32 accumulator, zeroed: atomic max of |x| (unused with RECORD)
    nsat_ptr,  # 0-dim int64 accumulator, zeroed: atomic count of saturated elements (unused with RECORD)
    ws_ptr,  # RECORD: int64[4] workspace, zero (left zero): amax bits, saturated count, arrival ticket, redo flag
    hist_ptr,  # RECORD: the scaling state's buffers (kernels/scaling.py: _record)
    scale_inv_ptr,
    last_amax_ptr,
    saturation_ptr,
    nonfinite_ptr,
    casts_ptr,
    unscale_ptr,  # RECORD and UNSCALE: 0-dim fp32, x = t * unscale; statistics and scales are recorded for t
    H,  # RECORD: amax history length
    numel,  # RECORD: elements of x (for the saturated fraction)
    M,  # rows of x
    N,  # columns of x
    IS_E4M3: tl.constexpr,  # E4M3 (True) or E5M2 output
    FP8_MAX: tl.constexpr,  # largest finite value of the format
    MBITS: tl.constexpr,  # mantissa bits of the format
    MIN_NORMAL_EXP: tl.constexpr,  # exponent of its smallest normal
    SUBNORMAL_MAGIC: tl.constexpr,  # 2**(MIN_NORMAL_EXP - MBITS + 23), see the module docstring
    EXACT_ROUND: tl.constexpr,  # round to the FP8 grid in fp32 before converting (interpreter)
    EVEN: tl.constexpr,  # tiles divide M and N: no masks
    INDEX_64: tl.constexpr,  # M * N >= 2**31: 64-bit offsets
    BLOCK_M: tl.constexpr,  # tile rows
    BLOCK_N: tl.constexpr,  # tile columns
    TRANSPOSE_VIA: tl.constexpr,  # what the transposed tile moves as: "fp32" (the values, converted again; GPU only)
    # or "bytes" (the FP8 bytes)
    WRITE_T: tl.constexpr,  # write x_fp8_t
    WRITE_X: tl.constexpr,  # write x_fp8 (off: the transposed copy alone, out_ptr unread)
    COLUMN_SUM: tl.constexpr,  # write the column sums of each row group (the bias gradient's partial sums)
    GROUP_M: tl.constexpr,  # row tiles (of BLOCK_M rows) per work item: a row group of the column sums
    STATS: tl.constexpr,  # amax / saturation kept running per "element", per "row" or per "tile" (see _quantize_block)
    LOAD_POLICY: tl.constexpr,  # eviction policy of the loads ("" or "evict_first")
    STORE_POLICY: tl.constexpr,  # cache modifier of the FP8 stores ("" or ".cs": streaming, written once)
    TMA: tl.constexpr,  # move tiles with the tensor memory accelerator (descriptors; out of bounds: zeros / clipped)
    NUM_STAGES: tl.constexpr,  # software pipelining depth of the loop over a work item's tiles
    RECORD: tl.constexpr,  # fused bookkeeping of a scaling state (else amax_ptr/nsat_ptr accumulate the statistics)
    BLOCK_H: tl.constexpr,  # RECORD: next power of two >= H
    MAX_EXP: tl.constexpr,  # RECORD: fp32 exponent and mantissa fields of the format max, margin, history algorithm
    MAX_MANT: tl.constexpr,
    MARGIN: tl.constexpr,
    ALGO_MAX: tl.constexpr,
    DELAYED: tl.constexpr,  # RECORD: the last program also writes the next delayed scale
    UNSCALE: tl.constexpr,  # RECORD: see unscale_ptr
    SPECULATE: tl.constexpr,  # RECORD, current scaling: 0 (off), 1 (the speculative pass), 2 (its redo); see _finish
    ACTIVATION: tl.constexpr,  # "" (cast x), "gelu" or "gelu_backward": cast what _activation makes of the tile
    DEQUANT: tl.constexpr,  # "" (x and aux in high precision), "x" or "aux": that input is FP8, its values times dq
    DQ_E4M3: tl.constexpr,  # DEQUANT: that input's format is E4M3 (True) or E5M2
    WRITE_PRE: tl.constexpr,  # write pre_ptr
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    go = _redo(ws_ptr, SPECULATE)
    scale = _guess_scale(scale_ptr, unscale_ptr, UNSCALE, SPECULATE)
    dq = 1.0
    if DEQUANT != "":
        dq = tl.load(dq_ptr)
    # Running amax and saturation count of this program: per element (no reduction in the loop, but registers: it
    # cost occupancy here on an H100), per row (a reduction within the threads of each row, no barrier) or scalars
    # (a reduction over the tile, through shared memory, per tile).
    if STATS == "element":
        amax_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        nsat_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    elif STATS == "row":
        amax_acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        nsat_acc = tl.zeros([BLOCK_M], dtype=tl.int32)
    else:
        amax_acc = 0.0
        nsat_acc = 0
    # Work items of GROUP_M row tiles of one column block, walked down the column. With COLUMN_SUM their rows are added
    # element by element in registers (no reduction per tile) and reduced once per item, into that item's partial
    # column sums (row group, N). GROUP_M = 1 walks the tiles row block by row block.
    tiles_m = tl.cdiv(M, BLOCK_M)
    items = tl.where(go, tl.cdiv(tiles_m, GROUP_M) * tiles_n, 0)
    for item in tl.range(pid, items, tl.num_programs(0), num_stages=1):
        group = item // tiles_n
        tn = item % tiles_n
        if COLUMN_SUM:
            csum = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for tm in tl.range(group * GROUP_M, tl.minimum(group * GROUP_M + GROUP_M, tiles_m), num_stages=NUM_STAGES):
            x, amax_acc, nsat_acc = _cast_tile(
                x_ptr, aux_ptr, scale, out_ptr, out_t_ptr, pre_ptr, dq, amax_acc, nsat_acc, tm, tn, M, N, IS_E4M3,
                FP8_MAX, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC, EXACT_ROUND, EVEN, INDEX_64, BLOCK_M, BLOCK_N,
                TRANSPOSE_VIA, WRITE_T, WRITE_X, STATS, LOAD_POLICY, STORE_POLICY, TMA, ACTIVATION, DEQUANT, DQ_E4M3,
                WRITE_PRE,
            )  # fmt: skip
            if COLUMN_SUM:
                csum += x
        if COLUMN_SUM:
            rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
            if EVEN:
                tl.store(colsum_ptr + group * N + rn, tl.sum(csum, axis=0))
            else:
                tl.store(colsum_ptr + group * N + rn, tl.sum(csum, axis=0), mask=rn < N)
    if STATS == "element":
        amax_acc = tl.max(tl.max(amax_acc, axis=1), axis=0)
        nsat_acc = tl.sum(tl.sum(nsat_acc, axis=1), axis=0)
    elif STATS == "row":
        amax_acc = tl.max(amax_acc, axis=0)
        nsat_acc = tl.sum(nsat_acc, axis=0)
    _finish(
        amax_ptr, nsat_ptr, amax_acc, nsat_acc, scale_ptr, scale, ws_ptr, hist_ptr, scale_inv_ptr, last_amax_ptr,
        saturation_ptr, nonfinite_ptr, casts_ptr, unscale_ptr, numel, H, go, BLOCK_H, MAX_EXP, MAX_MANT, MARGIN,
        ALGO_MAX, DELAYED, RECORD, UNSCALE, SPECULATE,
    )  # fmt: skip


@triton.jit
def _cast_flat_kernel(
    x_ptr,  # (n,) input, contiguous, fp32/bf16/fp16
    scale_ptr,  # 0-dim fp32 scale
    out_ptr,  # (n,) FP8 output
    amax_ptr,  # 0-dim fp32 accumulator, zeroed: atomic max of |x| (unused with RECORD)
    nsat_ptr,  # 0-dim int64 accumulator, zeroed: atomic count of saturated elements (unused with RECORD)
    ws_ptr,  # RECORD: int64[4] workspace, zero (left zero): amax bits, saturated count, arrival ticket, redo flag
    hist_ptr,  # RECORD: the scaling state's buffers (kernels/scaling.py: _record)
    scale_inv_ptr,
    last_amax_ptr,
    saturation_ptr,
    nonfinite_ptr,
    casts_ptr,
    unscale_ptr,  # RECORD and UNSCALE: 0-dim fp32, x = t * unscale; statistics and scales are recorded for t
    H,  # RECORD: amax history length
    numel,  # RECORD: elements of x (for the saturated fraction)
    n,  # number of elements
    IS_E4M3: tl.constexpr,  # E4M3 (True) or E5M2 output
    FP8_MAX: tl.constexpr,  # largest finite value of the format
    MBITS: tl.constexpr,  # mantissa bits of the format
    MIN_NORMAL_EXP: tl.constexpr,  # exponent of its smallest normal
    SUBNORMAL_MAGIC: tl.constexpr,  # 2**(MIN_NORMAL_EXP - MBITS + 23)
    EXACT_ROUND: tl.constexpr,  # round to the FP8 grid in fp32 before converting (interpreter)
    EVEN: tl.constexpr,  # BLOCK divides n: no masks
    INDEX_64: tl.constexpr,  # n >= 2**31: 64-bit offsets
    BLOCK: tl.constexpr,  # elements per loop step of a program
    STATS: tl.constexpr,  # amax / saturation kept running per "element" or per "tile" (block; see _quantize_block)
    LOAD_POLICY: tl.constexpr,  # eviction policy of the loads ("" or "evict_first")
    NUM_STAGES: tl.constexpr,  # software pipelining depth of the block loop
    RECORD: tl.constexpr,  # fused bookkeeping of a scaling state (else amax_ptr/nsat_ptr accumulate the statistics)
    BLOCK_H: tl.constexpr,  # RECORD: next power of two >= H
    MAX_EXP: tl.constexpr,  # RECORD: fp32 exponent and mantissa fields of the format max, margin, history algorithm
    MAX_MANT: tl.constexpr,
    MARGIN: tl.constexpr,
    ALGO_MAX: tl.constexpr,
    DELAYED: tl.constexpr,  # RECORD: the last program also writes the next delayed scale
    UNSCALE: tl.constexpr,  # RECORD: see unscale_ptr
    SPECULATE: tl.constexpr,  # RECORD, current scaling: 0 (off), 1 (the speculative pass), 2 (its redo); see _finish
):
    pid = tl.program_id(0)
    go = _redo(ws_ptr, SPECULATE)
    scale = _guess_scale(scale_ptr, unscale_ptr, UNSCALE, SPECULATE)
    if STATS == "element":
        amax_acc = tl.zeros([BLOCK], dtype=tl.float32)
        nsat_acc = tl.zeros([BLOCK], dtype=tl.int32)
    else:
        amax_acc = 0.0
        nsat_acc = 0
    for block in tl.range(pid, tl.where(go, tl.cdiv(n, BLOCK), 0), tl.num_programs(0), num_stages=NUM_STAGES):
        if INDEX_64:
            offs = tl.cast(block, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        else:
            offs = block * BLOCK + tl.arange(0, BLOCK)
        if EVEN:
            x = tl.load(x_ptr + offs, eviction_policy=LOAD_POLICY).to(tl.float32)
        else:
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy=LOAD_POLICY).to(tl.float32)
        q, y, finite, amax_acc, nsat_acc = _quantize_block(
            x, scale, amax_acc, nsat_acc, FP8_MAX, IS_E4M3, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC, EXACT_ROUND,
            STATS,
        )  # fmt: skip
        q = q.to(out_ptr.dtype.element_ty, bitcast=True)
        if EVEN:
            tl.store(out_ptr + offs, q)
        else:
            tl.store(out_ptr + offs, q, mask=offs < n)
    if STATS == "element":
        amax_acc = tl.max(amax_acc, axis=0)
        nsat_acc = tl.sum(nsat_acc, axis=0)
    _finish(
        amax_ptr, nsat_ptr, amax_acc, nsat_acc, scale_ptr, scale, ws_ptr, hist_ptr, scale_inv_ptr, last_amax_ptr,
        saturation_ptr, nonfinite_ptr, casts_ptr, unscale_ptr, numel, H, go, BLOCK_H, MAX_EXP, MAX_MANT, MARGIN,
        ALGO_MAX, DELAYED, RECORD, UNSCALE, SPECULATE,
    )  # fmt: skip


@triton.jit
def _amax_kernel(
    x_ptr,  # (n,) input, contiguous, floating point
    amax_ptr,  # 0-dim fp32 accumulator, zeroed: atomic max of |x| (NaN -> inf); unused with CURRENT_SCALE
    ws_ptr,  # CURRENT_SCALE: int64[3] workspace, zero (left zero); see _arrive
    scale_ptr,  # CURRENT_SCALE: 0-dim fp32 scale, in/out
    n,  # number of elements
    EVEN: tl.constexpr,  # BLOCK divides n: no masks
    INDEX_64: tl.constexpr,  # n >= 2**31: 64-bit offsets
    BLOCK: tl.constexpr,  # elements per loop step of a program
    NUM_STAGES: tl.constexpr,  # software pipelining depth of the block loop
    CURRENT_SCALE: tl.constexpr,  # the last program writes scale <- pow2_scale(amax) (current scaling), not amax
    MAX_EXP: tl.constexpr,  # CURRENT_SCALE: fp32 exponent and mantissa fields of the format max, and the margin
    MAX_MANT: tl.constexpr,
    MARGIN: tl.constexpr,
):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for block in tl.range(pid, tl.cdiv(n, BLOCK), tl.num_programs(0), num_stages=NUM_STAGES):
        if INDEX_64:
            offs = tl.cast(block, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        else:
            offs = block * BLOCK + tl.arange(0, BLOCK)
        if EVEN:
            ax = tl.abs(tl.load(x_ptr + offs).to(tl.float32))
        else:
            ax = tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32))
        acc = tl.maximum(acc, tl.where(ax == ax, ax, float("inf")))
    amax = tl.max(acc, axis=0)
    if CURRENT_SCALE:
        last, total, _ = _arrive(ws_ptr, amax, 0, False)
        if last:
            tl.store(scale_ptr, _pow2_scale(total, tl.load(scale_ptr), MAX_EXP, MAX_MANT, MARGIN))
    else:
        tl.atomic_max(amax_ptr, amax, mask=amax > tl.load(amax_ptr), sem="relaxed")  # see _publish
