"""Fused FP8 casts in Triton: scaled saturating cast (+ transposed copy, amax, saturation count) and amax.

Math (the scale convention of DESIGN.md; numerics defined by :mod:`lightning_fp8.kernels.reference`)::

    y       = float32(x) * scale                      scale: 0-dim fp32, a power of two (exact)
    x_fp8   = RNE(clamp(y, -fp8_max, fp8_max))        for finite x;  NaN for x = +-inf or NaN
    x_fp8_t = x_fp8^T                                 only with transpose=True (2-D x)
    amax    = max |x|                                 NaN counts as inf; 0 for an empty x
    n_sat   = #{finite x : |y| >= fp8_max}            int64

The kernels themselves (one pass over the input, the fused bookkeeping of a scaling state, the rounding
under the Triton interpreter) are in :mod:`lightning_fp8.kernels.cast_kernels`; this module launches them, and
:mod:`lightning_fp8.kernels.quantize` launches a scaling state's cast (the same kernels with its bookkeeping).

Speed (H100, 8192 x 8192 bf16 -> E4M3, bytes read + written over the time, against a device copy at
2.84 TB/s in the same run; benchmarks/results/h100_s6.txt): cast with transpose 81% (116 us), cast 84%,
amax 81%; eager ``(x * scale).to(fp8)`` reaches 23%. The transposed cast holds 128 registers per thread in 8-warp
128 x 64 tiles (one or two programs per SM); 64 x 64 tiles with 4 warps did best. Programs walk GROUP_M row tiles
down a column block; the fused column sums (``column_sum``, a linear layer's bias gradient) add those tiles in
registers and reduce once per group: 16384 x 4096 bf16 -> E5M2, 145.9 us against 116.9 us for the cast and 70.8 us for
``x.sum(0)`` (results/h100_s8.txt; with one reduction per tile, the sixth session's kernel, they cost more than x.sum).
"""

import functools

import torch
from lightning_fp8.kernels import launch
from lightning_fp8.kernels.cast_kernels import _amax_kernel, _cast_flat_kernel, _cast_transpose_kernel
from triton.runtime.jit import JITFunction

from lightning_fp8.cast_checks import check_cast_arguments, check_castable

try:  # triton >= 3.3: host-side tensor descriptors (TMA on Hopper)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

_FP8 = {
    # dtype: (max, mantissa bits, smallest normal exponent)
    torch.float8_e4m3fn: (448.0, 3, -6),
    torch.float8_e5m2: (57344.0, 2, -14),
}

# Launch configs: the best of benchmarks/bench_cast.py --sweep on an H100 (8192 x 8192 bf16 -> E4M3; the sixth
# session's sweep, benchmarks/results/h100_s6.txt). PROGRAMS_PER_SM bounds the persistent grid (2**20: one work item
# per program; 32 beat 16 and every value between, although fewer programs than that fit on an SM at once); NUM_STAGES
# pipelines the tile loop (2 and 3: no faster); TRANSPOSE_VIA: the transpose path (see _cast_transpose_kernel); STATS:
# running statistics per "element", "row" or "tile" (see fp8_encoding._quantize_block; per row, reduced within the
# threads that hold a row, saved the transposed cast the two barriers per tile of "tile": 81.8% of copy against 80.5%);
# LOAD_POLICY: the loads' eviction policy; STORE_POLICY: the FP8 stores' cache modifier (.cs and .cg: no faster);
# MAXNREG: registers per thread (None: the compiler's choice; 96 and 128 were slower); TMA: the transposed cast moves
# its tiles through tensor descriptors (eager launches of 2-D x whose sides are multiples of 16; off: 73-77% of copy).
# MIN_ITEMS: the least work items (blocks, tiles) per program where there are enough; current-scaled casts
# (bench_cast.py --small, results/h100_s7.txt): 2 for the amax launch made 16384 x 4096 and 8192 x 8192 140 us instead
# of 152 us and changed nothing measurable below; the casts' own launches gained nothing from it.
# GROUP_M: the row tiles a program walks down a column block (bench_cast.py --sum-groups, results/h100_s8.txt: 8 made
# the fused column sums 146 us instead of 178 us with 1 on 16384 x 4096, and the plain transposed cast of 16384 x 16384
# 417 us instead of 487 us; 16 was no better). The transposed cast's BLOCK_M and GROUP_M also fix the summation order
# of its column sums (kernels/reference.py: COLUMN_SUM_BLOCK_ROWS, COLUMN_SUM_GROUP).
CONFIGS = {
    "transpose": {
        "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "PROGRAMS_PER_SM": 32, "NUM_STAGES": 1, "TRANSPOSE_VIA": "fp32",
        "STATS": "row", "LOAD_POLICY": "", "STORE_POLICY": "", "MAXNREG": None, "TMA": False, "GROUP_M": 8,
    },
    "flat": {"BLOCK": 2048, "num_warps": 4, "PROGRAMS_PER_SM": 32, "NUM_STAGES": 1, "STATS": "element",
             "LOAD_POLICY": "evict_first"},
    "amax": {"BLOCK": 4096, "num_warps": 8, "PROGRAMS_PER_SM": 2**20, "NUM_STAGES": 1, "MIN_ITEMS": 2},
}  # fmt: skip
# Casts without column sums with fewer than GROUP_M * this * (multiprocessors) tiles walk fewer row tiles per work
# item (_group_m). H100, bench_cast.py --sum-groups (results/h100_s9.txt): 1024 x 4096 bf16 -> E5M2, quantize_ 21.5 us
# with GROUP_M 8, 16.8-16.9 us with 1 or 2; 16384 x 1024 the same (39-43 us) with every GROUP_M from 1 to 8.
GROUP_M_MIN_ITEMS_PER_SM = 2
# Tensors whose (tile-padded) size reaches this use 64-bit offsets.
INT32_INDEX_LIMIT = 2**31
# Under the interpreter programs run one after another: a grid of this many programs keeps tests fast.
_INTERPRETER_PROGRAMS = 4
# The persistent grid of the redo pass of a speculative current-scaled cast (kernels/quantize.py): its programs return
# at once unless the first pass guessed the scale wrong, and then loop over every tile.
REDO_PROGRAMS_PER_SM = 4
# Round to the FP8 grid in fp32 before the conversion also on a GPU (always on under the interpreter).
# The hardware conversion needs no help; benchmarks/bench_cast.py measures what this would cost.
EXACT_ROUND_ON_GPU = False


def _interpreted(kernel) -> bool:
    # TRITON_INTERPRET=1 makes @triton.jit return an InterpretedFunction instead of a JITFunction.
    return not isinstance(kernel, JITFunction)


def _launchable(kernel):
    # wrap_triton lets torch.compile trace the launch; an interpreted kernel is launched as is.
    return kernel if _interpreted(kernel) else torch.library.wrap_triton(kernel)


def _cdiv(a: int, b: int) -> int:
    # triton.cdiv is a ConstexprFunction in triton 3.6 and 3.9: ~4 us a call on the host, more than this whole helper.
    return -(-a // b)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _multiprocessors(x: torch.Tensor) -> int:
    # The multiprocessors of CUDA tensor x's device.
    return _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device())


def _grid_size(x: torch.Tensor, work_items: int, programs_per_sm: int, min_items: int = 1) -> int:
    # At most programs_per_sm per multiprocessor, and at least min_items work items per program where there are enough.
    if x.device.type != "cuda":
        return max(1, min(work_items, _INTERPRETER_PROGRAMS))
    return max(1, min(work_items // min_items, _multiprocessors(x) * programs_per_sm))


def _group_m(tiles: int, group_m: int, multiprocessors: int) -> int:
    """GROUP_M for a transposed cast of ``tiles`` tiles without column sums: halved until its work items fill every
    multiprocessor GROUP_M_MIN_ITEMS_PER_SM times (a program walking 8 tiles one after another on a half-empty GPU is
    slower than 8 programs side by side)."""
    while group_m > 1 and tiles < group_m * GROUP_M_MIN_ITEMS_PER_SM * multiprocessors:
        group_m //= 2
    return group_m


def _index_64(padded_numel: int) -> bool:
    # 32-bit offsets are cheaper; masked lanes of the last tiles reach up to the padded size.
    return padded_numel >= INT32_INDEX_LIMIT


@functools.cache
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


# Config keys that are not launch metadata: they size the grid (TMA is decided per call).
_GRID_KEYS = ("PROGRAMS_PER_SM", "MIN_ITEMS", "MAXNREG", "TMA")


def _launch_meta(cfg: dict, eager: bool, interpreted: bool) -> dict:
    # The launch metadata of cfg (the rest of it sizes the grid). MAXNREG caps the registers per thread (occupancy);
    # eager launches only (the interpreter has no registers, and wrap_triton's tracing is left to the defaults).
    meta = {k: v for k, v in cfg.items() if k not in _GRID_KEYS}
    if cfg.get("MAXNREG") and eager and not interpreted:
        meta["maxnreg"] = cfg["MAXNREG"]
    return meta


def _launch(kernel, x: torch.Tensor, work_items: int, cfg: dict, *args, eager: bool = False, **constexprs) -> None:
    # A persistent grid of at most PROGRAMS_PER_SM programs per multiprocessor; the rest of cfg is launch metadata.
    # `eager`: launch the kernel as is, through kernels/launch.py's fast path (outside a triton_op, wrap_triton would
    # route it through a slower traced path).
    grid = (_grid_size(x, work_items, cfg["PROGRAMS_PER_SM"], cfg.get("MIN_ITEMS", 1)),)
    interpreted = _interpreted(kernel)
    meta = _launch_meta(cfg, eager, interpreted)
    if eager and not interpreted:
        launch.launch(kernel, grid, *args, **constexprs, **meta)
    else:
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
    "SPECULATE": 0,
}


def _fp8_outputs(x: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # The FP8 copy of x and its transpose (empty unless transpose).
    t_shape = (x.shape[1], x.shape[0]) if transpose else (0,)
    x_fp8_t = torch.empty(t_shape, dtype=fp8_dtype, device=x.device)
    return torch.empty(x.shape, dtype=fp8_dtype, device=x.device), x_fp8_t


def _cast_impl(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    transpose: bool,
    stats: tuple[torch.Tensor, ...],
    record: dict,
    eager: bool,
    column_sum: bool = False,
    write_x: bool = True,
    activation: str = "",
    activation_input: torch.Tensor | None = None,
    dequant_scale_inv: torch.Tensor | None = None,
    pre: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Launch the cast of non-empty contiguous ``x``; ``stats``: the 10 statistics/bookkeeping tensor arguments (and
    ``record`` the constexprs) of the kernels. Returns ``(x_fp8, x_fp8_t, partials)``: with ``column_sum`` (2-D ``x``)
    the fp32 column sums of each row group (:func:`column_sums` adds them), else None. ``write_x=False`` (with
    ``transpose``): the transposed copy alone, ``x_fp8`` None. ``activation`` (2-D ``x``; "gelu" or "gelu_backward"
    with ``activation_input``, contiguous, of ``x``'s shape): cast ``reference.activation_ref`` of ``x``. An FP8 ``x``
    or ``activation_input`` (not both) stands for its values times ``dequant_scale_inv`` (0-dim fp32). ``pre`` (FP8,
    ``x``'s shape, with an activation): also filled with ``x`` cast with the scale times
    ``2**-reference.PRE_ACTIVATION_HEADROOM`` (no statistics)."""
    if write_x:
        x_fp8, x_fp8_t = _fp8_outputs(x, fp8_dtype, transpose)
    else:
        x_fp8, x_fp8_t = None, torch.empty((x.shape[1], x.shape[0]), dtype=fp8_dtype, device=x.device)
    out = x_fp8_t if x_fp8 is None else x_fp8  # without write_x the kernel never reads its row-major output pointer
    interpreted = _interpreted(_cast_flat_kernel)
    fmt = _format_args(fp8_dtype, interpreted or EXACT_ROUND_ON_GPU)
    sums = None
    if transpose or column_sum or activation:
        cfg = dict(CONFIGS["transpose"])
        if interpreted:  # the interpreter cannot convert NaN to E4M3: keep the byte path
            cfg["TRANSPOSE_VIA"] = "bytes"
        m, n = x.shape
        tiles_m, tiles_n = _cdiv(m, cfg["BLOCK_M"]), _cdiv(n, cfg["BLOCK_N"])
        padded = tiles_m * cfg["BLOCK_M"] * tiles_n * cfg["BLOCK_N"]
        even = m % cfg["BLOCK_M"] == 0 and n % cfg["BLOCK_N"] == 0
        if not column_sum and x.is_cuda:  # the column sums' order fixes their GROUP_M; a plain cast may walk less
            cfg["GROUP_M"] = _group_m(tiles_m * tiles_n, cfg["GROUP_M"], _multiprocessors(x))
        groups = _cdiv(tiles_m, cfg["GROUP_M"])
        sums = column_partials(x) if column_sum else out
        tma = cfg["TMA"] and eager and transpose and write_x and not activation and _tma_fits(x)  # x not FP8 either
        if tma:  # the tiles through tensor descriptors: the outputs as their bytes
            blocks, blocks_t = [cfg["BLOCK_M"], cfg["BLOCK_N"]], [cfg["BLOCK_N"], cfg["BLOCK_M"]]
            tensors = (TensorDescriptor.from_tensor(x, blocks),
                       TensorDescriptor.from_tensor(x_fp8.view(torch.uint8), blocks),
                       TensorDescriptor.from_tensor(x_fp8_t.view(torch.uint8), blocks_t))  # fmt: skip
        else:
            tensors = (x, out, x_fp8_t)
        aux_fp8 = activation_input is not None and activation_input.dtype in _FP8
        fp8_in = x if x.dtype in _FP8 else activation_input if aux_fp8 else None
        dequant = "" if fp8_in is None else "x" if fp8_in is x else "aux"
        # Pointers the kernel does not read or write (aux unless "gelu_backward", pre, dq) get x eagerly; traced, a
        # one-element stand-in: inductor realizes every tensor argument of a user kernel as a buffer of its own, so x
        # computed by a fused kernel (a LayerNorm's output) would be written again for each (session 18: with x in
        # three of them the compiled d=2048 GPT step went NaN from its second step), and a state buffer the kernel
        # writes must not be passed twice.
        def unused(t):
            return t if t is not None else x if eager else _unread(x)

        args = (tensors[0], unused(activation_input), scale, *tensors[1:], unused(pre), unused(dequant_scale_inv), sums,
                *stats, m, n)  # fmt: skip
        flags = {"WRITE_T": transpose, "WRITE_X": write_x, "COLUMN_SUM": column_sum, "TMA": tma,
                 "ACTIVATION": activation, "DEQUANT": dequant, "WRITE_PRE": pre is not None,
                 "DQ_E4M3": fp8_in is not None and fp8_in.dtype == torch.float8_e4m3fn}  # fmt: skip
        work = groups * tiles_n  # work items: GROUP_M row tiles of a column block
        kernel, index_64 = _cast_transpose_kernel, _index_64(padded)
    else:
        cfg = CONFIGS["flat"]
        blocks = _cdiv(x.numel(), cfg["BLOCK"])
        even = x.numel() % cfg["BLOCK"] == 0
        args = (x, scale, x_fp8, *stats, x.numel())
        flags = {}
        kernel, work, index_64 = _cast_flat_kernel, blocks, _index_64(blocks * cfg["BLOCK"])
    _launch(kernel, x, work, cfg, *args, eager=eager, **fmt, **record, **flags, EVEN=even, INDEX_64=index_64)
    if record["SPECULATE"] == 1:  # the redo pass (kernels/quantize.py): a small grid, idle unless the guess was wrong
        redo = {**record, "SPECULATE": 2}
        cfg = {**cfg, "PROGRAMS_PER_SM": REDO_PROGRAMS_PER_SM}
        _launch(kernel, x, work, cfg, *args, eager=eager, **fmt, **redo, **flags, EVEN=even, INDEX_64=index_64)
    return x_fp8, x_fp8_t, (sums if column_sum else None)


def _unread(x: torch.Tensor) -> torch.Tensor:
    # A stand-in for a pointer argument the kernel does not read (one element of x's dtype on its device).
    return torch.empty(1, dtype=x.dtype, device=x.device)


def scalar_output(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A one-element tensor for a kernel to write a scalar into (its caller returns ``.view(())``). Traced, a 0-dim
    ``torch.empty`` costs a launch: inductor lowers every ``empty`` as a fill that it skips only when the tensor has
    a dimension (``torch/_inductor/lowering.py: empty_strided``), so each 0-dim output a compiled step allocates was
    a tiny kernel writing 0 before the cast overwrote it; one element with a dimension costs none."""
    return torch.empty(1, dtype=dtype, device=device)


def column_partials(x: torch.Tensor) -> torch.Tensor:
    """The buffer of the transposed cast's partial column sums of 2-D ``x``: one fp32 row per row group of GROUP_M
    tiles (``_cast_impl`` fills it; a replay of that launch is given a fresh one)."""
    cfg = CONFIGS["transpose"]
    groups = _cdiv(_cdiv(x.shape[0], cfg["BLOCK_M"]), cfg["GROUP_M"])
    return torch.empty((groups, x.shape[1]), dtype=torch.float32, device=x.device)


def column_sums(partials: torch.Tensor) -> torch.Tensor:
    """The column sums of a cast's row groups (``_cast_impl(column_sum=True)``'s third output), added in a fixed order:
    deterministic, as ``kernels/reference.py: column_sum_ref`` defines it."""
    return partials.sum(0)


def _tma_fits(x: torch.Tensor) -> bool:
    # Tensor descriptors need 16-byte aligned bases and row strides: x's rows, and the rows of both FP8 outputs
    # (fresh allocations, aligned), whose lengths are x's columns and rows.
    m, n = x.shape
    aligned = x.data_ptr() % 16 == 0 and (n * x.element_size()) % 16 == 0 and n % 16 == 0 and m % 16 == 0
    return aligned and TensorDescriptor is not None


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
    return (*_cast_impl(x, scale, fp8_dtype, transpose, stats, _NO_RECORD, eager)[:2], amax, n_saturated)


@torch.library.triton_op("lightning_fp8::cast_to_fp8", mutates_args=())
def _cast_to_fp8_op(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _cast_with_stats(x, scale, fp8_dtype, transpose, eager=False)


@torch.library.triton_op("lightning_fp8::cast_to_fp8_transposed", mutates_args=())
def _cast_transposed_op(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    activation: str = "",
    x_scale_inv: torch.Tensor | None = None,
) -> torch.Tensor:
    # The transposed copy alone, statistics dropped (the backward's weight recast, FP8MLP's GELU output recomputed,
    # under torch.compile; kernels/quantize.py: recast_transposed): non-empty 2-D contiguous x on a CUDA device. Fresh
    # accumulators (a graph cannot hold on to a global buffer its kernels mutate), not zeroed: nothing reads them, and
    # zeroed ones cost two launches per recast in a compiled step (inductor's fill of each, then its copy of it).
    acc = scalar_output(torch.float32, x.device)
    stats = (acc, scalar_output(torch.int64, x.device), *(acc,) * 8, 1, x.numel())
    return _cast_impl(x, scale, fp8_dtype, True, stats, _NO_RECORD, eager=False, write_x=False, activation=activation,
                      dequant_scale_inv=x_scale_inv)[1]  # fmt: skip


def _amax_impl(x: torch.Tensor, eager: bool) -> torch.Tensor:
    # x: contiguous (checked by amax).
    amax_out = torch.zeros((), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return amax_out
    cfg = CONFIGS["amax"]
    blocks = _cdiv(x.numel(), cfg["BLOCK"])
    flags = {"EVEN": x.numel() % cfg["BLOCK"] == 0, "INDEX_64": _index_64(blocks * cfg["BLOCK"])}
    args = (x, amax_out, amax_out, amax_out, x.numel())  # workspace and scale: unread without CURRENT_SCALE
    _launch(
        _amax_kernel, x, blocks, cfg, *args, eager=eager, **flags, CURRENT_SCALE=False, MAX_EXP=0, MAX_MANT=0, MARGIN=0
    )
    return amax_out


@torch.library.triton_op("lightning_fp8::amax", mutates_args=())
def _amax_op(x: torch.Tensor) -> torch.Tensor:
    return _amax_impl(x, eager=False)


def amax(x: torch.Tensor) -> torch.Tensor:
    """``max(|x|)`` as a 0-dim fp32 tensor, NaN counted as inf, 0 for an empty tensor.

    Same signature and result as :func:`lightning_fp8.kernels.reference.amax_ref`.

    Raises:
        TypeError: if ``x`` is not a dense float32, bfloat16 or float16 tensor.
    """
    check_castable(x, "amax", wide=False)  # the kernels read 16- and 32-bit floats; float64: the reference path
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
        TypeError: for an unsupported ``x`` dtype or ``fp8_dtype``, or a ``scale`` that is not one float32 element.
        ValueError: for a ``scale`` on another device than ``x``, or ``transpose`` of a tensor that is not 2-D.
    """
    check_cast_arguments(x, scale, fp8_dtype, transpose, "cast_to_fp8", wide=False)
    x, scale = x.detach().contiguous(), scale.reshape(())
    if torch.compiler.is_compiling():
        return _cast_to_fp8_op(x, scale, fp8_dtype, transpose)
    return _cast_with_stats(x, scale, fp8_dtype, transpose, eager=True)
