"""Multi-tensor AdamW step on scaled low-precision states, in Triton (the FP8-LM optimizer, O2).

Math (per element, fp32 in registers, one IEEE rounding per operation; numerics defined by
:func:`lightning_fp8.kernels.reference_adamw.adamw_step_ref`)::

    g = grad * grad_scale_inv                          FP8 gradient scale and 1/mu, powers of two
    g = clamp(g, +-2**63) if finite and v is scaled    (g * g would overflow fp32: reference_adamw.saturate_grad_ref)
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
  the gradient's amax (``reference_adamw.adamw_bound_ref``): the write never saturates and the fresh amax is
  folded for the next step. 6 + 5 bytes per parameter; the scale is at most a binade or so conservative.

Either way a small finalize launch writes the new scales and amaxes into the 0-dim state tensors (the
main passes read the old scales, so they cannot be overwritten while those run).

FP8 weight copy (``fp8_weights``, FP8AdamW's ``emit_fp8_weights``): the write pass also casts the stored weight
(what the FP8Linear forward reads) to FP8 with the forward's current scaling, computed from the stored image of the
fresh amax (two passes: bit for bit the forward's cast) or of the one-pass bound (a valid copy whose scale may be
lower), and counts its saturated elements; the finalize launch writes the statistics the forward's cast would
record (reference_adamw.emit_fp8_weight_ref). +1 byte per parameter. The transposed copy is not written here: the 1-D
chunks cannot store it coalesced; the first forward that needs it makes it with one byte transpose
(lightning_fp8/weight_cache.py).

Many tensors per launch: a table holds each tensor's element count, the element offsets of its param, grad,
m, v, optional high-precision copy and optional FP8 copy from the first tensor of each list (a kernel argument),
and the addresses of its scales, amaxes, grad scale_inv, grad amax and FP8 copy record (the jit kernels are in
kernels/adamw_kernels.py, with the column layout); a block table maps each program to one chunk
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
from lightning_fp8.kernels.adamw_finalize import _finalize_kernel
from lightning_fp8.kernels.adamw_kernels import NCOL, _adamw_kernel
from lightning_fp8.kernels.cast import _interpreted
from lightning_fp8.kernels.reference import _FP8_MAX, float32_exponent_mantissa
from lightning_fp8.kernels.reference_adamw import BOUND_SLACK, SCALED_STATE_MAX, AdamWConstants, check_fp8_weights

# Launch config, the best of benchmarks/bench_optim.py --sweep on an H100 (benchmarks/results/optim_h100.txt: 4.2 to
# 4.4 ms from 256 to 2048 elements per step, 7.7 ms with 16 elements per thread, whose layout conversions go through
# shared memory): BLOCK elements per loop step (BLOCK / (32 NUM_WARPS) consecutive elements per thread: 8 gives
# 16-byte fp16 accesses), ITERS loop steps per program (one chunk), NUM_WARPS per program.
CONFIG = {"BLOCK": 1024, "ITERS": 16, "NUM_WARPS": 4}
_INTERPRETER_CONFIG = {"BLOCK": 64, "ITERS": 2, "NUM_WARPS": 1}

_FP8_FORMAT = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}  # mantissa bits, min normal exponent
_ALIGN = 16  # bytes: one vector access


@functools.lru_cache(maxsize=64)
def _block_table(numels: tuple[int, ...], chunk: int, device: torch.device) -> torch.Tensor:
    # Built on the host (whatever torch.set_default_device says), then copied over once.
    chunks = torch.tensor([triton.cdiv(n, chunk) for n in numels], dtype=torch.int64, device="cpu")
    tensor_index = torch.repeat_interleave(torch.arange(len(numels), device="cpu"), chunks)
    starts = torch.cumsum(chunks, 0) - chunks
    chunk_index = torch.arange(int(chunks.sum()), device="cpu") - torch.repeat_interleave(starts, chunks)
    return torch.stack([tensor_index, chunk_index], dim=1).to(torch.int32).to(device)


def _check(params, grads, exp_avgs, exp_avg_sqs, scales, amaxes, param_copies, grad_scale_invs=None,
           grad_amaxes=None) -> list[int]:  # fmt: skip
    """Validate the lists (one pass each: this runs every step, per tensor); returns the element counts. The kernel
    reads and writes every tensor by its address: a size or dtype it does not expect would reach other memory."""
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if param_copies is not None:
        lists["param_copies"] = param_copies
    for name, tensors in lists.items():
        if len(tensors) != len(params):
            raise ValueError(f"adamw_step: {name} has {len(tensors)} tensors but params has {len(params)}")
    # The kernel reads every tensor by its address: one on another device (a CPU scale beside CUDA params) is read
    # from an address of another memory (a crash, or an illegal memory access that ends the CUDA context).
    device = params[0].device if params else None
    for name, tensors in {"params": params, **lists}.items():
        dtype = tensors[0].dtype if tensors else None
        if not all([t.dtype == dtype and t.is_contiguous() and t.device == device for t in tensors]):
            raise ValueError(f"adamw_step: the tensors of {name} must be contiguous and share one dtype and "
                             f"params[0]'s device ({device})")  # fmt: skip
    numels = [p.numel() for p in params]
    for tensors in lists.values():
        sizes = [t.numel() for t in tensors]
        if sizes != numels:
            i = next(i for i, (a, b) in enumerate(zip(sizes, numels, strict=True)) if a != b)
            raise ValueError(f"adamw_step: tensor {i} has states whose sizes differ from its param ({numels[i]})")
    if (scales is None) != (amaxes is None):
        raise ValueError("adamw_step: pass scales and amaxes together (both or neither)")
    triples = {"scales": scales, "amaxes": amaxes}
    for name, states in triples.items():
        if states is not None and (len(states) != len(params) or not all([len(t) == 3 for t in states])):
            raise ValueError(f"adamw_step: {name} must hold one tuple of 3 tensors per param ({len(params)})")
    singles = {"grad_scale_invs": grad_scale_invs, "grad_amaxes": grad_amaxes}
    for name, tensors in singles.items():
        if tensors is not None and len(tensors) != len(params):
            raise ValueError(f"adamw_step: {name} has {len(tensors)} tensors but params has {len(params)}")
    scalars = [t for ts in (scales, amaxes) if ts is not None for triple in ts for t in triple]
    scalars += [t for ts in singles.values() if ts is not None for t in ts]
    if not all([t.dtype == torch.float32 and t.numel() == 1 and t.device == device for t in scalars]):
        raise ValueError("adamw_step: scales, amaxes, grad_scale_invs and grad_amaxes must be one-element fp32 tensors "
                         f"on params[0]'s device ({device})")  # fmt: skip
    return numels


def _table(params, grads, exp_avgs, exp_avg_sqs, scales, amaxes, grad_scale_invs, grad_amaxes, param_copies, numels,
           fp8_weights=None, fp8_weight_stats=None):  # fmt: skip
    """The int64 [T, NCOL] table (columns: adamw_kernels.NCOL) and a zeroed fp32 [T, 4] buffer (new amaxes, the FP8
    copy's saturated count) on the device, and whether every data address is a multiple of 16 bytes."""
    zeros = [0] * len(params)
    lists = (params, grads, exp_avgs, exp_avg_sqs, param_copies or (), fp8_weights or ())
    data = [[t.data_ptr() for t in ts] for ts in lists if ts]
    aligned = functools.reduce(operator.or_, (functools.reduce(operator.or_, c, 0) for c in data), 0) % _ALIGN == 0
    sizes = [ts[0].element_size() for ts in lists if ts]
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
    columns.append(offsets[-1] if fp8_weights is not None else zeros)
    columns.append([t.data_ptr() for t in fp8_weight_stats] if fp8_weights is not None else zeros)
    # Through array: 2x faster than torch.tensor(nested lists), which matters for models with many small tensors. The
    # zeroed fp32 [T, 4] buffer travels in the same copy (one transfer instead of a transfer and a fill).
    n = len(params)
    flat = array.array("q", [x for row in zip(*columns, strict=True) for x in row])
    flat.extend([0] * (2 * n))
    flat = torch.frombuffer(flat, dtype=torch.int64).to(params[0].device, non_blocking=True)
    amax_out = flat[n * NCOL :].view(torch.float32).view(n, 4)
    return flat[: n * NCOL].view(n, NCOL), amax_out, aligned


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
    fp8_weights: list[torch.Tensor] | None = None,
    fp8_weight_stats: list[torch.Tensor] | None = None,
    fp8_margin: int = 0,
) -> None:
    """Multi-tensor AdamW step; same signature and bit-exact results as ``reference_adamw.adamw_step_ref``.

    Each list holds tensors of one dtype, contiguous and on one device; see the reference for the arguments.

    Raises:
        ValueError: for lists of different lengths, sizes or mixed dtypes, ``scales`` without ``amaxes``, or a
            one-pass step without its bounds (see the reference).
    """
    numels = _check(params, grads, exp_avgs, exp_avg_sqs, scales, amaxes, param_copies, grad_scale_invs, grad_amaxes)
    check_fp8_weights(params, fp8_weights, fp8_weight_stats, fp8_margin)
    c = AdamWConstants(lr, beta1, beta2, eps, weight_decay, step)
    if not two_pass and scales is not None and (grad_amaxes is None or c.max_update is None):
        raise ValueError("adamw_step(two_pass=False) needs grad_amaxes and beta1**2 < beta2 for its scale bounds")
    if fp8_weights is not None and not two_pass and amaxes is None:
        raise ValueError("adamw_step(two_pass=False) with fp8_weights needs the amaxes for the copies' scale bounds")
    if not params:
        return
    device = params[0].device
    table, amax_out, aligned = _table(params, grads, exp_avgs, exp_avg_sqs, scales, amaxes, grad_scale_invs,
                                      grad_amaxes, param_copies, numels, fp8_weights, fp8_weight_stats)  # fmt: skip
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
    emit = _emit_constants(fp8_weights, fp8_margin, dtypes[0])
    common = {
        **formats, **emit,
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
    fp8_0 = fp8_weights[0] if fp8_weights is not None else exp_avgs[0]  # only typing when not emitting
    args = (table, blocks, amax_out, params[0], grads[0], exp_avgs[0], exp_avg_sqs[0], copy0, fp8_0,
            *hyper, c.eps, c.decay, c.step_size, max_update)  # fmt: skip
    grid = (blocks.shape[0],)
    if two_pass:
        _adamw_kernel[grid](*args, **common, WRITE=False, FRESH=True, ACCUM_AMAX=True, **launch)
        _adamw_kernel[grid](*args, **common, WRITE=True, FRESH=True, ACCUM_AMAX=False, **launch)
    else:
        _adamw_kernel[grid](*args, **common, WRITE=True, FRESH=False, ACCUM_AMAX=True, **launch)
    if amaxes is not None or fp8_weights is not None:
        fin_launch = {} if interpreted else {"enable_fp_fusion": False}
        keys = ("HAS_COPY", "EMIT", "SRC_MAX", "E_EXP", "E_MANT", "E_MARGIN", "EXACT_ROUND")
        fin = {key: common[key] for key in keys}
        _finalize_kernel[(len(params),)](table, amax_out, params[0], copy0, *hyper, c.decay, max_update, **formats,
                                         HAS_AMAXES=amaxes is not None, **fin, FRESH=two_pass, SLACK=BOUND_SLACK,
                                         **fin_launch)  # fmt: skip


def _emit_constants(fp8_weights, margin: int, param_dtype: torch.dtype) -> dict:
    """The constexprs of the FP8 weight copy: its format and margin, and the max of the master's scaled storage."""
    if fp8_weights is None:
        return {"EMIT": False, "E_MAX": 1.0, "E_EXP": 0, "E_MANT": 0, "E_MBITS": 0, "E_MIN_EXP": 0, "E_MARGIN": 0,
                "SRC_MAX": 1.0}  # fmt: skip
    dtype = fp8_weights[0].dtype
    fmax = _FP8_MAX[dtype]
    exp, mant = float32_exponent_mantissa(fmax)
    mbits, min_exp = _FP8_FORMAT[dtype]
    return {"EMIT": True, "E_MAX": fmax, "E_EXP": exp, "E_MANT": mant, "E_MBITS": mbits, "E_MIN_EXP": min_exp,
            "E_MARGIN": margin, "SRC_MAX": SCALED_STATE_MAX.get(param_dtype, 1.0)}  # fmt: skip
