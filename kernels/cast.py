"""Fused FP8 casts in Triton: scaled saturating cast (+ transposed copy, amax, saturation count) and amax.

Math (the scale convention of DESIGN.md; numerics defined by :mod:`lightning_fp8.kernels.reference`)::

    y       = float32(x) * scale                      scale: 0-dim fp32, a power of two (exact)
    x_fp8   = RNE(clamp(y, -fp8_max, fp8_max))        for finite x;  NaN for x = +-inf or NaN
    x_fp8_t = x_fp8^T                                 only with transpose=True (2-D x)
    amax    = max |x|                                 NaN counts as inf; 0 for an empty x
    n_sat   = #{finite x : |y| >= fp8_max}            int64

One pass: ``cast_to_fp8`` reads each element of ``x`` once (2-D tiles), writes ``x_fp8`` and, with
``transpose``, the transposed tile to ``x_fp8_t`` (``tl.trans``; the compiler moves it through shared
memory so that both stores are coalesced), and folds each program's amax and saturation count into two
global accumulators (at most one atomic max and one atomic add per program, skipped when they cannot
change anything). Programs are persistent (a grid-stride loop over tiles) and keep scalar running
statistics, so neither atomics nor registers grow with the tensor.

A scaling state's cast (``quantize_``, what ``ScalingState.quantize`` runs on a GPU) is the same kernel with
``RECORD``: each program folds its statistics into a per-stream int64 workspace with atomics and takes an
arrival ticket; the last program to arrive reads the totals, leaves the workspace zeroed, and does the state's
bookkeeping (kernels/scaling.py: history, next scale, 1 / scale, counters). A delayed cast is one launch; a
current-scaled one adds the amax launch before it, whose last program writes the scale.

Rounding (found while testing under ``TRITON_INTERPRET=1``): the Triton interpreter converts fp32 to
FP8 with a wrong "round to nearest": it adds the rounding bit to the mantissa without carrying into the
exponent (7.77 -> 4.0 instead of 8.0 in E4M3, 3.9 -> 2.0 in E5M2), rounds ties away from zero, and
turns NaN into 384 in E4M3. It converts values that are already on the FP8 grid exactly. So under the
interpreter (``EXACT_ROUND``) the kernel first rounds to the FP8 grid in fp32 with integer arithmetic:

    normal   |y| >= 2**e_min : drop the low 23 - m mantissa bits with round-to-nearest-even
    subnormal|y| <  2**e_min : (|y| + C) - C with C = 2**(e_min - m + 23): the fp32 add rounds to
                               the subnormal spacing 2**(e_min - m) (RNE), the subtraction is exact

(m = 3, e_min = -6 for E4M3; m = 2, e_min = -14 for E5M2), and writes NaN as the byte 0x7F, the
pattern PyTorch uses for both formats. On a GPU the hardware conversion (``cvt.rn.satfinite``) already
rounds to nearest even (bit-exact against the reference on an H100), and the pre-rounding is off: it made
the cast with transpose 2.2x slower there (``EXACT_ROUND_ON_GPU``; benchmarks/README.md).

Speed (H100, 8192 x 8192 bf16 -> E4M3, bytes read + written over the time, against a device copy at
2.85 TB/s): cast with transpose 73%, cast 74%, amax 80%; eager ``(x * scale).to(fp8)`` reaches 23%.
Not profiled further; the likely limit of the transposed cast is its shared-memory traffic (the PTX of
the byte path shows one byte-wide shared store per element).
"""

import functools

import torch
import triton
import triton.language as tl
from lightning_fp8.kernels.reference import float32_exponent_mantissa
from lightning_fp8.kernels.scaling import _pow2_scale, _record
from triton.runtime.jit import JITFunction

_FP8 = {
    # dtype: (max, mantissa bits, smallest normal exponent)
    torch.float8_e4m3fn: (448.0, 3, -6),
    torch.float8_e5m2: (57344.0, 2, -14),
}
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Launch configs: the best of benchmarks/bench_cast.py --sweep on an H100 (8192 x 8192 bf16 -> E4M3; see
# benchmarks/results/cast_linear_h100.txt). PROGRAMS_PER_SM bounds the persistent grid (2**20: one work item
# per program); NUM_STAGES pipelines the tile loop; TRANSPOSE_FP32: see _cast_transpose_kernel.
CONFIGS = {
    "transpose": {
        "BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "PROGRAMS_PER_SM": 8, "NUM_STAGES": 1, "TRANSPOSE_FP32": True
    },
    "flat": {"BLOCK": 4096, "num_warps": 8, "PROGRAMS_PER_SM": 8, "NUM_STAGES": 1},
    "amax": {"BLOCK": 8192, "num_warps": 8, "PROGRAMS_PER_SM": 2**20, "NUM_STAGES": 1},
}  # fmt: skip
# Tensors whose (tile-padded) size reaches this use 64-bit offsets.
INT32_INDEX_LIMIT = 2**31
# Under the interpreter programs run one after another: a grid of this many programs keeps tests fast.
_INTERPRETER_PROGRAMS = 4
# Round to the FP8 grid in fp32 before the conversion also on a GPU (always on under the interpreter).
# The hardware conversion needs no help; benchmarks/bench_cast.py measures what this would cost.
EXACT_ROUND_ON_GPU = False


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
    # x: fp32 tile. Returns (y clamped to +-fp8_max, finite(x), |x| with NaN -> inf, saturated as int32 0/1).
    ax = tl.abs(x)
    finite = ax < float("inf")  # False for inf and NaN
    y = x * scale
    sat = ((tl.abs(y) >= FP8_MAX) & finite).to(tl.int32)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
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
    total_bits = tl.atomic_xchg(ws_ptr, 0, mask=last, sem="acq_rel")
    total_nsat = tl.atomic_xchg(ws_ptr + 1, 0, mask=last, sem="acq_rel")
    tl.atomic_xchg(ws_ptr + 2, 0, mask=last, sem="acq_rel")
    return last, total_bits.to(tl.int32).to(tl.float32, bitcast=True), total_nsat


@triton.jit
def _finish(
    amax_ptr, nsat_ptr, amax, nsat, scale_ptr, scale, ws_ptr, hist_ptr, scale_inv_ptr, last_amax_ptr, saturation_ptr,
    nonfinite_ptr, casts_ptr, unscale_ptr, numel, H,
    BLOCK_H: tl.constexpr, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr, MARGIN: tl.constexpr,
    ALGO_MAX: tl.constexpr, DELAYED: tl.constexpr, RECORD: tl.constexpr, UNSCALE: tl.constexpr,
):  # fmt: skip
    # RECORD: the last program to finish does the scaling state's bookkeeping (kernels/scaling.py) with the totals;
    # otherwise the statistics go to the zeroed output accumulators.
    if RECORD:
        last, total_amax, total_nsat = _arrive(ws_ptr, amax, nsat, True)
        if last:
            unscale = tl.load(unscale_ptr) if UNSCALE else 1.0
            _record(
                total_amax, total_nsat, numel, scale, hist_ptr, scale_ptr, scale_inv_ptr, last_amax_ptr, saturation_ptr,
                nonfinite_ptr, casts_ptr, H, unscale, BLOCK_H, MAX_EXP, MAX_MANT, MARGIN, ALGO_MAX, DELAYED, UNSCALE,
            )  # fmt: skip
    else:
        _publish(amax_ptr, nsat_ptr, amax, nsat)


@triton.jit
def _cast_transpose_kernel(
    x_ptr,  # (M, N) input, row-major, fp32/bf16/fp16
    scale_ptr,  # 0-dim fp32 scale
    out_ptr,  # (M, N) FP8 output
    out_t_ptr,  # (N, M) FP8 output, the transposed copy
    amax_ptr,  # 0-dim fp32 accumulator, zeroed: atomic max of |x| (unused with RECORD)
    nsat_ptr,  # 0-dim int64 accumulator, zeroed: atomic count of saturated elements (unused with RECORD)
    ws_ptr,  # RECORD: int64[3] workspace, zero (left zero): amax bits, saturated count, arrival ticket
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
    TRANSPOSE_FP32: tl.constexpr,  # transpose the fp32 values and convert again (else the FP8 bytes); GPU only
    NUM_STAGES: tl.constexpr,  # software pipelining depth of the tile loop
    RECORD: tl.constexpr,  # fused bookkeeping of a scaling state (else amax_ptr/nsat_ptr accumulate the statistics)
    BLOCK_H: tl.constexpr,  # RECORD: next power of two >= H
    MAX_EXP: tl.constexpr,  # RECORD: fp32 exponent and mantissa fields of the format max, margin, history algorithm
    MAX_MANT: tl.constexpr,
    MARGIN: tl.constexpr,
    ALGO_MAX: tl.constexpr,
    DELAYED: tl.constexpr,  # RECORD: the last program also writes the next delayed scale
    UNSCALE: tl.constexpr,  # RECORD: see unscale_ptr
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    scale = tl.load(scale_ptr)
    # Running amax and saturation count of this program: scalars, so the loop holds no tile-sized accumulators.
    amax_acc = 0.0
    nsat_acc = 0
    for tile in tl.range(pid, num_tiles, tl.num_programs(0), num_stages=NUM_STAGES):
        rm = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        if INDEX_64:
            rm = rm.to(tl.int64)
            rn = rn.to(tl.int64)
        offs = rm[:, None] * N + rn[None, :]
        offs_t = rn[:, None] * M + rm[None, :]  # rows of x_fp8_t are columns of x: contiguous along rm
        if EVEN:
            x = tl.load(x_ptr + offs).to(tl.float32)
        else:
            mask = (rm[:, None] < M) & (rn[None, :] < N)
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y, finite, ax, sat = _scale_saturate(x, scale, FP8_MAX)
        amax_acc = tl.maximum(amax_acc, tl.max(ax))  # masked lanes hold 0: neutral
        nsat_acc += tl.sum(sat)
        if EXACT_ROUND:  # non-finite lanes may come out as anything here: they are replaced below
            y = _round_to_fp8_grid(y, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC)
        q = _fp8_bytes(y, IS_E4M3)
        q = tl.where(finite, q, 0x7F).to(tl.uint8)  # NaN, as PyTorch writes it in both formats
        # The transposed tile goes through shared memory; which form the compiler moves best is measured.
        if TRANSPOSE_FP32:
            q_t = _fp8_bytes(tl.trans(tl.where(finite, y, float("nan"))), IS_E4M3)
        else:
            q_t = tl.trans(q)
        q = q.to(out_ptr.dtype.element_ty, bitcast=True)
        q_t = q_t.to(out_ptr.dtype.element_ty, bitcast=True)
        if EVEN:
            tl.store(out_ptr + offs, q)
            tl.store(out_t_ptr + offs_t, q_t)
        else:
            tl.store(out_ptr + offs, q, mask=mask)
            tl.store(out_t_ptr + offs_t, q_t, mask=(rn[:, None] < N) & (rm[None, :] < M))
    _finish(
        amax_ptr, nsat_ptr, amax_acc, nsat_acc, scale_ptr, scale, ws_ptr, hist_ptr, scale_inv_ptr, last_amax_ptr,
        saturation_ptr, nonfinite_ptr, casts_ptr, unscale_ptr, numel, H, BLOCK_H, MAX_EXP, MAX_MANT, MARGIN, ALGO_MAX,
        DELAYED, RECORD, UNSCALE,
    )  # fmt: skip


@triton.jit
def _cast_flat_kernel(
    x_ptr,  # (n,) input, contiguous, fp32/bf16/fp16
    scale_ptr,  # 0-dim fp32 scale
    out_ptr,  # (n,) FP8 output
    amax_ptr,  # 0-dim fp32 accumulator, zeroed: atomic max of |x| (unused with RECORD)
    nsat_ptr,  # 0-dim int64 accumulator, zeroed: atomic count of saturated elements (unused with RECORD)
    ws_ptr,  # RECORD: int64[3] workspace, zero (left zero): amax bits, saturated count, arrival ticket
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
    NUM_STAGES: tl.constexpr,  # software pipelining depth of the block loop
    RECORD: tl.constexpr,  # fused bookkeeping of a scaling state (else amax_ptr/nsat_ptr accumulate the statistics)
    BLOCK_H: tl.constexpr,  # RECORD: next power of two >= H
    MAX_EXP: tl.constexpr,  # RECORD: fp32 exponent and mantissa fields of the format max, margin, history algorithm
    MAX_MANT: tl.constexpr,
    MARGIN: tl.constexpr,
    ALGO_MAX: tl.constexpr,
    DELAYED: tl.constexpr,  # RECORD: the last program also writes the next delayed scale
    UNSCALE: tl.constexpr,  # RECORD: see unscale_ptr
):
    pid = tl.program_id(0)
    scale = tl.load(scale_ptr)
    amax_acc = 0.0
    nsat_acc = 0
    for block in tl.range(pid, tl.cdiv(n, BLOCK), tl.num_programs(0), num_stages=NUM_STAGES):
        if INDEX_64:
            offs = tl.cast(block, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        else:
            offs = block * BLOCK + tl.arange(0, BLOCK)
        if EVEN:
            x = tl.load(x_ptr + offs).to(tl.float32)
        else:
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        y, finite, ax, sat = _scale_saturate(x, scale, FP8_MAX)
        amax_acc = tl.maximum(amax_acc, tl.max(ax))
        nsat_acc += tl.sum(sat)
        if EXACT_ROUND:  # non-finite lanes may come out as anything here: they are replaced below
            y = _round_to_fp8_grid(y, MBITS, MIN_NORMAL_EXP, SUBNORMAL_MAGIC)
        q = _fp8_bytes(y, IS_E4M3)
        q = tl.where(finite, q, 0x7F).to(tl.uint8).to(out_ptr.dtype.element_ty, bitcast=True)
        if EVEN:
            tl.store(out_ptr + offs, q)
        else:
            tl.store(out_ptr + offs, q, mask=offs < n)
    _finish(
        amax_ptr, nsat_ptr, amax_acc, nsat_acc, scale_ptr, scale, ws_ptr, hist_ptr, scale_inv_ptr, last_amax_ptr,
        saturation_ptr, nonfinite_ptr, casts_ptr, unscale_ptr, numel, H, BLOCK_H, MAX_EXP, MAX_MANT, MARGIN, ALGO_MAX,
        DELAYED, RECORD, UNSCALE,
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


def _interpreted(kernel) -> bool:
    # TRITON_INTERPRET=1 makes @triton.jit return an InterpretedFunction instead of a JITFunction.
    return not isinstance(kernel, JITFunction)


def _launchable(kernel):
    # wrap_triton lets torch.compile trace the launch; an interpreted kernel is launched as is.
    return kernel if _interpreted(kernel) else torch.library.wrap_triton(kernel)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _grid_size(x: torch.Tensor, work_items: int, programs_per_sm: int) -> int:
    if x.device.type != "cuda":
        return max(1, min(work_items, _INTERPRETER_PROGRAMS))
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return max(1, min(work_items, _sm_count(index) * programs_per_sm))


def _index_64(padded_numel: int) -> bool:
    # 32-bit offsets are cheaper; masked lanes of the last tiles reach up to the padded size.
    return padded_numel >= INT32_INDEX_LIMIT


def _format_args(fp8_dtype: torch.dtype, exact_round: bool) -> dict:
    fp8_max, mbits, min_exp = _FP8[fp8_dtype]
    return {
        "IS_E4M3": fp8_dtype == torch.float8_e4m3fn,
        "FP8_MAX": fp8_max,
        "MBITS": mbits,
        "MIN_NORMAL_EXP": min_exp,
        "SUBNORMAL_MAGIC": 2.0 ** (min_exp - mbits + 23),
        "EXACT_ROUND": exact_round,
    }


def _launch(kernel, x: torch.Tensor, work_items: int, cfg: dict, *args, eager: bool = False, **constexprs) -> None:
    # A persistent grid of at most PROGRAMS_PER_SM programs per multiprocessor; the rest of cfg is launch metadata.
    # `eager`: launch the kernel as is (outside a triton_op, wrap_triton would route it through a slower traced path).
    meta = {k: v for k, v in cfg.items() if k != "PROGRAMS_PER_SM"}
    grid = (_grid_size(x, work_items, cfg["PROGRAMS_PER_SM"]),)
    (kernel if eager else _launchable(kernel))[grid](*args, **constexprs, **meta)


# Without RECORD the bookkeeping arguments are not read: any pointer will do.
_NO_RECORD = {
    "RECORD": False,
    "BLOCK_H": 1,
    "MAX_EXP": 0,
    "MAX_MANT": 0,
    "MARGIN": 0,
    "ALGO_MAX": False,
    "DELAYED": False,
    "UNSCALE": False,
}
# Per (device, stream): the zeroed workspace of the fused bookkeeping. A launch leaves it zeroed, and launches on one
# stream run one after another, so one workspace serves every cast on that stream.
_WORKSPACES: dict[tuple[torch.device, int], torch.Tensor] = {}


def _workspace(device: torch.device) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    ws = _WORKSPACES.get((device, stream))
    if ws is None:
        ws = _WORKSPACES[(device, stream)] = torch.zeros(3, dtype=torch.int64, device=device)
    return ws


def _cast_impl(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    transpose: bool,
    stats: tuple[torch.Tensor, ...],
    record: dict,
    eager: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the cast of non-empty contiguous ``x``; ``stats``: the 10 statistics/bookkeeping tensor arguments (and
    ``record`` the constexprs) of the kernels. Returns ``(x_fp8, x_fp8_t)``."""
    x_fp8 = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    t_shape = (x.shape[1], x.shape[0]) if transpose else (0,)
    x_fp8_t = torch.empty(t_shape, dtype=fp8_dtype, device=x.device)
    interpreted = _interpreted(_cast_flat_kernel)
    fmt = _format_args(fp8_dtype, interpreted or EXACT_ROUND_ON_GPU)
    if transpose:
        cfg = dict(CONFIGS["transpose"])
        if interpreted:  # the interpreter cannot convert NaN to E4M3: keep the byte path
            cfg["TRANSPOSE_FP32"] = False
        m, n = x.shape
        tiles_m, tiles_n = triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"])
        padded = tiles_m * cfg["BLOCK_M"] * tiles_n * cfg["BLOCK_N"]
        even = m % cfg["BLOCK_M"] == 0 and n % cfg["BLOCK_N"] == 0
        args = (x, scale, x_fp8, x_fp8_t, *stats, m, n)
        kernel, work, index_64 = _cast_transpose_kernel, tiles_m * tiles_n, _index_64(padded)
    else:
        cfg = CONFIGS["flat"]
        blocks = triton.cdiv(x.numel(), cfg["BLOCK"])
        even = x.numel() % cfg["BLOCK"] == 0
        args = (x, scale, x_fp8, *stats, x.numel())
        kernel, work, index_64 = _cast_flat_kernel, blocks, _index_64(blocks * cfg["BLOCK"])
    _launch(kernel, x, work, cfg, *args, eager=eager, **fmt, **record, EVEN=even, INDEX_64=index_64)
    return x_fp8, x_fp8_t


def _cast_with_stats(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool, eager: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # x: contiguous (2-D when transpose); scale: fp32 with one element on x's device (checked by cast_to_fp8).
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    n_saturated = torch.zeros((), dtype=torch.int64, device=x.device)
    if x.numel() == 0:
        x_fp8_t = torch.empty((x.shape[1], x.shape[0]) if transpose else (0,), dtype=fp8_dtype, device=x.device)
        return torch.empty(x.shape, dtype=fp8_dtype, device=x.device), x_fp8_t, amax, n_saturated
    stats = (amax, n_saturated, *(amax,) * 8, 1, x.numel())  # accumulators; the rest unread without RECORD
    return (*_cast_impl(x, scale, fp8_dtype, transpose, stats, _NO_RECORD, eager), amax, n_saturated)


@torch.library.triton_op("lightning_fp8::cast_to_fp8", mutates_args=())
def _cast_to_fp8_op(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _cast_with_stats(x, scale, fp8_dtype, transpose, eager=False)


def _amax_impl(x: torch.Tensor, eager: bool) -> torch.Tensor:
    # x: contiguous (checked by amax).
    amax_out = torch.zeros((), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return amax_out
    cfg = CONFIGS["amax"]
    blocks = triton.cdiv(x.numel(), cfg["BLOCK"])
    flags = {"EVEN": x.numel() % cfg["BLOCK"] == 0, "INDEX_64": _index_64(blocks * cfg["BLOCK"])}
    args = (x, amax_out, amax_out, amax_out, x.numel())  # workspace and scale: unread without CURRENT_SCALE
    _launch(
        _amax_kernel, x, blocks, cfg, *args, eager=eager, **flags, CURRENT_SCALE=False, MAX_EXP=0, MAX_MANT=0, MARGIN=0
    )
    return amax_out


@torch.library.triton_op("lightning_fp8::amax", mutates_args=())
def _amax_op(x: torch.Tensor) -> torch.Tensor:
    return _amax_impl(x, eager=False)


def quantize_(
    x: torch.Tensor,
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    last_amax: torch.Tensor,
    saturation: torch.Tensor,
    nonfinite_count: torch.Tensor,
    casts: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int,
    algo_max: bool,
    delayed: bool,
    current: bool,
    transpose: bool,
    unscale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One cast of a scaling state in one launch (two with ``current``): cast, statistics, history and next scale.

    Same signature and bit-exact results as :func:`lightning_fp8.kernels.reference.quantize_ref`. ``x`` must be
    contiguous and of a supported dtype (the caller, ``ScalingState.quantize``, guarantees it). The last program
    of the cast does the bookkeeping of ``kernels/scaling.py`` (no separate launch, no zeroed accumulators); with
    ``current`` the amax launch before it writes the scale. Eager only: ``torch.compile`` sees the whole cast as the
    opaque custom op ``lightning_fp8::quantize``.
    """
    if x.numel() == 0:
        from lightning_fp8.kernels.reference import quantize_ref

        return quantize_ref(x, amax_history, scale, last_amax, saturation, nonfinite_count, casts, fp8_dtype, margin,
                            algo_max, delayed, current, transpose, unscale)  # fmt: skip
    fmax = _FP8[fp8_dtype][0]
    max_exp, max_mant = float32_exponent_mantissa(fmax)
    fields = {"MAX_EXP": max_exp, "MAX_MANT": max_mant, "MARGIN": margin}
    ws = _workspace(x.device)
    if current:
        cfg = CONFIGS["amax"]
        blocks = triton.cdiv(x.numel(), cfg["BLOCK"])
        flags = {"EVEN": x.numel() % cfg["BLOCK"] == 0, "INDEX_64": _index_64(blocks * cfg["BLOCK"])}
        _launch(_amax_kernel, x, blocks, cfg, x, scale, ws, scale, x.numel(), eager=True, CURRENT_SCALE=True,
                **flags, **fields)  # fmt: skip
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    h = amax_history.numel()
    stats = (ws, ws, ws, amax_history, scale_inv, last_amax, saturation, nonfinite_count, casts,
             scale if unscale is None else unscale, h, x.numel())  # fmt: skip
    record = {"RECORD": True, "BLOCK_H": triton.next_power_of_2(h), "ALGO_MAX": algo_max, "DELAYED": delayed,
              "UNSCALE": unscale is not None, **fields}  # fmt: skip
    x_fp8, x_fp8_t = _cast_impl(x, scale, fp8_dtype, transpose, stats, record, eager=True)
    return x_fp8, x_fp8_t, scale_inv


def amax(x: torch.Tensor) -> torch.Tensor:
    """``max(|x|)`` as a 0-dim fp32 tensor, NaN counted as inf, 0 for an empty tensor.

    Same signature and result as :func:`lightning_fp8.kernels.reference.amax_ref`.

    Raises:
        TypeError: if ``x`` is not a floating-point tensor.
    """
    if not x.is_floating_point() or x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"amax expects a float32, bfloat16 or float16 tensor, got {x.dtype}; cast it first")
    x = x.detach().contiguous()
    return _amax_op(x) if torch.compiler.is_compiling() else _amax_impl(x, eager=True)


def cast_to_fp8(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Saturating scaled cast to FP8 in one pass, with an optional transposed copy, amax and saturation count.

    Same signature and bit-exact results as :func:`lightning_fp8.kernels.reference.cast_to_fp8_ref`.

    Args:
        x: float32, bfloat16 or float16 tensor of any shape (2-D when ``transpose``); made contiguous first.
        scale: fp32 tensor with one element on ``x``'s device (a power of two).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        transpose: also return ``x_fp8.t().contiguous()``.

    Returns:
        ``(x_fp8, x_fp8_t, amax, n_saturated)``; ``x_fp8_t`` is empty unless ``transpose``.

    Raises:
        TypeError: for an unsupported ``x`` dtype, ``fp8_dtype`` or ``scale`` dtype.
        ValueError: for a ``scale`` that is not one element on ``x``'s device, or ``transpose`` of a tensor
            that is not 2-D.
    """
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"cast_to_fp8 expects a float32, bfloat16 or float16 tensor, got {x.dtype}; cast it first")
    if fp8_dtype not in _FP8:
        raise TypeError(f"cast_to_fp8: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise TypeError(
            f"cast_to_fp8: scale must be a one-element float32 tensor, got {scale.dtype} of shape "
            f"{tuple(scale.shape)}; use lightning_fp8.compute_scale"
        )
    if scale.device != x.device:
        raise ValueError(f"cast_to_fp8: scale is on {scale.device} but x is on {x.device}; move the scale to x's")
    if transpose and x.dim() != 2:
        raise ValueError(f"cast_to_fp8(transpose=True) needs a 2-D tensor, got shape {tuple(x.shape)}")
    x, scale = x.detach().contiguous(), scale.reshape(())
    if torch.compiler.is_compiling():
        return _cast_to_fp8_op(x, scale, fp8_dtype, transpose)
    return _cast_with_stats(x, scale, fp8_dtype, transpose, eager=True)
