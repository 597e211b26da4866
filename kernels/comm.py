"""Segmented FP8 kernels of gradient communication: amax, cast, decode, and the sum of received rows.

A collective moves flat buffers made of *segments* (tensors, or their pieces), each with its own power-of-two
scale. Every kernel (the ``@triton.jit`` functions are in ``kernels/comm_kernels.py``; this module launches them)
reads a *block table*, one row per tile of at most ``BLOCK`` elements that never straddles a segment::

    table[i] = (src, dst, length, value, out)        int64
        src, dst   offsets of the tile in the input and in the output (any layout: strided rows, padding, ...)
        length     elements of the tile (<= BLOCK)
        value      index of the tile's scale, given as an amax (the scale is computed in registers)
        out        index of a second per-segment value (the piece amax of a requantization)

One launch covers every segment of a bucket and reads each element once: by default one program per row, which walks
its row in blocks of ``SUB`` elements (``CONFIGS``); with ``PROGRAMS_PER_SM`` > 0 a capped, persistent grid whose
programs loop over rows. Per-segment results (amaxes, counters) are folded in with atomics, once per program (an amax
also when a program's scale group changes). Math, in fp32, bit for bit the references in
``lightning_fp8/distributed/quantize.py``::

    scale(a)       = 2 ** (floor(log2(fp8_max / a)) - margin)   fp32 bits; 1 where a is 0 or not finite
    s_q            = scale(amax[value]) * 2**-headroom           (headroom: 0 unless given)
    segment_amax:  amax[value] = max(amax[value], max |x|)                    NaN counts as inf
    quantize:      q = RNE(clamp(x * s_q, +-fp8_max)), NaN where x is not finite;  n_sat += #{|x * s_q| > fp8_max}
    dequantize:    out = q * (inv_divisor * 2**-log2(s_q))        counts += (#{q not finite or |q| >= fp8_max},
                                                                             #{q not finite})   when checked
    rows_*:        acc = q_0 + q_1 + ... + q_{W-1} (fp32, in rank order),  mean = sat32(acc * (inv_divisor / scale))
        rows_amax:     piece_amax[out] = max(piece_amax[out], max |mean|)
        rows_quantize: q' = RNE(clamp(mean * scale(piece_amax[out]), +-fp8_max));  n_sat += #{saturated}
        rows_sum:      out = mean, in out's dtype

Values stored in a float output (``dequantize``, ``rows_sum``) are saturated at its dtype's largest finite value
(NaN stays NaN): the FP8 rounding of a mean of finite values can otherwise reach inf (65536 in fp16); ``sat32``
saturates at fp32's, where the product of finite values overflows (near bf16's and fp32's maximum).
``1 / s`` is built from the exponent bits (exact), so ``inv_divisor / s`` is one fp32 rounding of ``1 / (s N)``.
FP8 bytes are decoded with integer arithmetic (E5M2 is the top byte of an fp16); E4M3 uses the hardware
conversion on a GPU. Under ``TRITON_INTERPRET=1`` the interpreter's own conversions are wrong in places
(fp32 -> FP8 and fp32 -> bf16 do not round to nearest even, FP8 NaN/inf bytes decode to numbers), so there the
kernels round and decode with integer arithmetic (``EXACT``), the same results as the hardware paths.
"""

from __future__ import annotations

import functools

import torch
from lightning_fp8.kernels.cast import _FP8, _interpreted
from lightning_fp8.kernels.comm_kernels import _dequantize_kernel, _quantize_kernel, _rows_kernel, _segment_amax_kernel
from lightning_fp8.kernels.comm_table import ALIGN, BlockTable, check_headroom
from lightning_fp8.kernels.reference import float32_exponent_mantissa


def _format(fp8_dtype: torch.dtype, margin: int, exact: bool) -> dict:
    if fp8_dtype not in _FP8:
        raise TypeError(f"FP8 communication kernels: fp8_dtype must be float8_e4m3fn or float8_e5m2, got {fp8_dtype}")
    fmax, mbits, min_exp = _FP8[fp8_dtype]
    max_exp, max_mant = float32_exponent_mantissa(fmax)
    return {
        "MAX_EXP": max_exp, "MAX_MANT": max_mant, "MARGIN": int(margin), "FP8_MAX": fmax,
        "IS_E4M3": fp8_dtype == torch.float8_e4m3fn, "EXACT": exact,
    }  # fmt: skip


def _rounding(fp8_dtype: torch.dtype) -> dict:
    _, mbits, min_exp = _FP8[fp8_dtype]
    return {"MBITS": mbits, "MIN_NORMAL_EXP": min_exp, "SUBNORMAL_MAGIC": 2.0 ** (min_exp - mbits + 23)}


# Launch configs per pass (see kernels/comm_kernels.py): SUB elements per block of a row (a program walks its row in
# blocks), warps, the grid (PROGRAMS_PER_SM programs per multiprocessor, at most one per row; 0: one program per row),
# HINT (the alignment the aligned rows are declared with: 8 gives 1- and 2-byte sides the same 8 elements per thread,
# no layout conversion through shared memory) and POLICY (the eviction policy of the streamed loads). Measured on an
# H100, 1B bf16 elements (benchmarks/bench_comm_passes.py; results/comm_passes_h100.txt): 4096-element blocks of 8
# warps, one program per 8192-element row, run at 89-96% of a device copy's bandwidth (amax, cast, decode with and
# without checks); persistent grids of 8-16 programs per SM ran from 4% faster (cast) to 17% slower (checked decode),
# 4 per SM slower everywhere; evict_first loads 2-16% slower.
# PROGRAMS_PER_SM > 0 leaves SMs to NCCL's kernels when they run beside these (bench_comm.py --sweep measures that);
# so does MAX_PROGRAMS below: on 2 H200s every cap from 66 to 528 programs made the FP8 all-reduce slower
# (benchmarks/bench_comm_caps.py, results/comm_fp8_h200x2_s9.txt).
CONFIGS = {
    "amax": {"SUB": 4096, "num_warps": 8, "PROGRAMS_PER_SM": 0, "HINT": 16, "POLICY": ""},
    "quantize": {"SUB": 4096, "num_warps": 8, "PROGRAMS_PER_SM": 0, "HINT": 8, "POLICY": ""},
    "dequantize": {"SUB": 4096, "num_warps": 8, "PROGRAMS_PER_SM": 0, "HINT": 8, "POLICY": ""},
    "rows": {"SUB": 4096, "num_warps": 8, "PROGRAMS_PER_SM": 0, "HINT": 8, "POLICY": ""},
}  # fmt: skip
# Under the interpreter programs run one after another: a small grid keeps tests fast and makes every program loop.
_INTERPRETER_PROGRAMS = 3
# A cap on every grid (None: none); tests make compiled programs loop over many rows with it.
MAX_PROGRAMS: int | None = None


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _grid(table: BlockTable, programs_per_sm: int, interpreted: bool) -> int:
    grid = len(table)
    if interpreted:
        grid = min(grid, _INTERPRETER_PROGRAMS)
    elif programs_per_sm > 0:
        device = table.rows.device
        index = device.index if device.index is not None else torch.cuda.current_device()
        grid = min(grid, _sm_count(index) * programs_per_sm)
    return grid if MAX_PROGRAMS is None else min(grid, MAX_PROGRAMS)


def _launch(kernel, name: str, table: BlockTable, before: tuple, after: tuple, **constexprs) -> None:
    # One launch for all tiles: the table's rows go between `before` and `after`, then the aligned and total row counts.
    if len(table):
        cfg = dict(CONFIGS[name])
        grid = _grid(table, cfg.pop("PROGRAMS_PER_SM"), _interpreted(kernel))
        sub = min(cfg.pop("SUB"), table.block)
        kernel[(grid,)](*before, table.rows, *after, table.aligned, len(table), SUB=sub,
                        EDGE_SUB=min(table.edge_block, sub), **{**cfg, **constexprs})  # fmt: skip


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def segment_amax(x: torch.Tensor, table: BlockTable, amax: torch.Tensor) -> None:
    """``amax[value] = max(amax[value], max |x[tile]|)`` over the table's tiles (NaN counts as inf); in place."""
    _launch(_segment_amax_kernel, "amax", table, (x,), (amax,))


def quantize(
    x: torch.Tensor,
    table: BlockTable,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    out: torch.Tensor,
    n_sat: torch.Tensor,
    *,
    margin: int = 0,
    headroom: torch.Tensor | None = None,
) -> None:
    """FP8 bytes of ``x`` into ``out`` (uint8), each tile with the scale of ``amax[value]``; adds to ``n_sat``.
    ``headroom``: one int64 value (0-dim) for all segments."""
    check_headroom(headroom, "quantize")
    interpreted = _interpreted(_quantize_kernel)
    after = (amax, headroom if headroom is not None else n_sat, _bytes(out), n_sat)
    fmt = _format(fp8_dtype, margin, interpreted) | _rounding(fp8_dtype)
    _launch(_quantize_kernel, "quantize", table, (x,), after, HAS_HEADROOM=headroom is not None, **fmt)


def dequantize(
    q: torch.Tensor,
    table: BlockTable,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    out: torch.Tensor,
    *,
    margin: int = 0,
    headroom: torch.Tensor | None = None,
    inv_divisor: float = 1.0,
    counts: torch.Tensor | None = None,
) -> None:
    """Decode FP8 bytes ``q`` into ``out`` (its dtype) with the inverse of each tile's scale times ``inv_divisor``.

    With ``counts`` (int64[2]), also adds the number of values that are non-finite or at the FP8 maximum (an FP8
    sum that overflowed) and the number of non-finite ones. ``headroom``: as :func:`quantize`.
    """
    check_headroom(headroom, "dequantize")
    interpreted = _interpreted(_dequantize_kernel)
    fmt = _format(fp8_dtype, margin, interpreted)
    extra = headroom if headroom is not None else table.rows
    after = (amax, extra, out, counts if counts is not None else table.rows, inv_divisor)
    exact_bf16 = interpreted and out.dtype == torch.bfloat16
    _launch(_dequantize_kernel, "dequantize", table, (_bytes(q),), after, HAS_HEADROOM=headroom is not None,
            CHECK=counts is not None, EXACT_BF16=exact_bf16, **fmt)  # fmt: skip


def _rows(mode, rows, table, amax, piece_amax, out, n_sat, fp8_dtype, margin, inv_divisor) -> None:
    if rows.dim() != 2 or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous (world, chunk) byte tensor, got shape {tuple(rows.shape)}")
    interpreted = _interpreted(_rows_kernel)
    fmt = _format(fp8_dtype, margin, interpreted) | _rounding(fp8_dtype)
    exact_bf16 = interpreted and out.dtype == torch.bfloat16
    before, after = (_bytes(rows), rows.shape[1], rows.shape[0]), (amax, piece_amax, out, n_sat, inv_divisor)
    hint = {} if rows.shape[1] % ALIGN == 0 else {"HINT": 1}  # else rows after the first start misaligned
    _launch(_rows_kernel, "rows", table, before, after, MODE=mode, EXACT_BF16=exact_bf16, **fmt, **hint)


def rows_amax(
    rows: torch.Tensor, table: BlockTable, amax: torch.Tensor, piece_amax: torch.Tensor, fp8_dtype: torch.dtype,
    *, margin: int = 0, inv_divisor: float = 1.0,
) -> None:  # fmt: skip
    """``piece_amax[out] = max(piece_amax[out], max |mean|)``, mean = the decoded sum of the ``rows`` of a tile."""
    _rows(0, rows, table, amax, piece_amax, piece_amax, piece_amax, fp8_dtype, margin, inv_divisor)


def rows_quantize(
    rows: torch.Tensor, table: BlockTable, amax: torch.Tensor, piece_amax: torch.Tensor, fp8_dtype: torch.dtype,
    out: torch.Tensor, n_sat: torch.Tensor, *, margin: int = 0, inv_divisor: float = 1.0,
) -> None:  # fmt: skip
    """FP8 bytes of the decoded mean of ``rows`` into ``out``, scaled by ``piece_amax[out]``; adds to ``n_sat``."""
    _rows(1, rows, table, amax, piece_amax, _bytes(out), n_sat, fp8_dtype, margin, inv_divisor)


def rows_sum(
    rows: torch.Tensor, table: BlockTable, amax: torch.Tensor, fp8_dtype: torch.dtype, out: torch.Tensor,
    *, margin: int = 0, inv_divisor: float = 1.0,
) -> None:  # fmt: skip
    """The decoded sum of ``rows`` times ``inv_divisor`` into ``out`` (its dtype)."""
    _rows(2, rows, table, amax, amax, out, amax, fp8_dtype, margin, inv_divisor)
