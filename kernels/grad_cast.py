"""Batched FP8 gradient casts in Triton: any number of gradients, each with current scaling, in two launches.

Math (per tensor; numerics defined by :func:`lightning_fp8.kernels.reference_grad_cast.grad_cast_ref`, bit for bit)::

    g        = grad,  or  float32(pending) * pending_scale_inv + float32(grad)     (accumulation; no fused multiply-add)
    amax     = max |g|                                   NaN counts as inf
    scale    = pow2_scale(amax) = 2 ** (floor(log2(fp8_max / amax)) - margin)     the state's scale where amax is 0 or
                                                                                   not finite
    g_fp8    = RNE(saturate(g * scale)),  NaN where g is not finite
    state    <- record(amax, n_sat = #{finite g: |g * scale| >= fp8_max}, numel)   kernels/scaling.py, history of one
    n_big    = #{|g| >= fp8_max}                          only with count_big (the gradient scaler's count)

FP8AdamW's gradient hooks queue gradients and cast them here together (lightning_fp8/optim/grad_cast.py): one cast per
gradient costs two launches and a few host operations, ~300 us of host time per weight on an H100 in a compiled GPT
step, where the backward hands over all gradients at once.

Launches: ``_grad_amax_kernel`` (amax per tensor), then ``_grad_cast_kernel`` (scale, cast, counts; the last program
of each tensor records the cast in the tensor's packed state). Both read one int64 table, built on the host from the
tensors' addresses and sent in one host-to-device copy together with the zeroed per-tensor outputs (amax, 1 / scale,
counts, arrival tickets); a cached block table maps each program to one chunk (``BLOCK * ITERS`` elements) of one
tensor (kernels/adamw.py builds and reads its tables the same way). The FP8 outputs are views of one buffer, each
starting at a multiple of 16 bytes.
"""

from __future__ import annotations

import array
import functools
import operator

import torch
from lightning_fp8.kernels import launch
from lightning_fp8.kernels.adamw import _block_table
from lightning_fp8.kernels.cast import _FP8, _interpreted
from lightning_fp8.kernels.grad_cast_kernels import NCOL, _grad_amax_kernel, _grad_cast_kernel
from lightning_fp8.kernels.reference import float32_exponent_mantissa
from lightning_fp8.kernels.reference_grad_cast import check_grad_cast

# BLOCK elements per loop step (BLOCK / (32 NUM_WARPS) = 8 consecutive elements per thread: 16-byte fp16 loads, 8-byte
# FP8 stores), ITERS loop steps per program (one chunk), NUM_WARPS per program: the AdamW kernels' config
# (kernels/adamw.py), whose loads are of the same kind.
CONFIG = {"BLOCK": 1024, "ITERS": 16, "NUM_WARPS": 4}
_INTERPRETER_CONFIG = {"BLOCK": 64, "ITERS": 2, "NUM_WARPS": 1}
_ALIGN = 16  # bytes: one vector access


@functools.cache
def _format(fp8_dtype: torch.dtype, margin: int, exact: bool) -> dict:
    fmax, mbits, min_exp = _FP8[fp8_dtype]
    max_exp, max_mant = float32_exponent_mantissa(fmax)
    return {"FP8_MAX": fmax, "IS_E4M3": fp8_dtype == torch.float8_e4m3fn, "MBITS": mbits, "MIN_NORMAL_EXP": min_exp,
            "SUBNORMAL_MAGIC": 2.0 ** (min_exp - mbits + 23), "MAX_EXP": max_exp, "MAX_MANT": max_mant,
            "MARGIN": margin, "EXACT_ROUND": exact}  # fmt: skip


def _table(grads, states, pending_data, pending_scale_inv, numels):
    """The int64 table [T, NCOL] with the zeroed outputs behind it (fp32 [2T]: amaxes, 1 / scales; int64 [3T]:
    saturated counts, tickets, big counts) on the device, the FP8 outputs' offsets and total size (bytes), and
    whether every data address is a multiple of 16 bytes."""
    n = len(grads)
    x_addr = [g.data_ptr() for g in grads]
    size = grads[0].element_size()
    x_offs = [(a - x_addr[0]) // size for a in x_addr]
    if pending_data is not None:
        p_addr = [d.data_ptr() for d in pending_data]
        p_offs = [a - p_addr[0] for a in p_addr]  # bytes: FP8
        p_scale_inv = [s.data_ptr() for s in pending_scale_inv]
    else:
        p_addr, p_offs = [], [0] * n
        p_scale_inv = p_offs
    aligned = functools.reduce(operator.or_, x_addr + p_addr, 0) % _ALIGN == 0
    if not aligned and any((a - x_addr[0]) % size for a in x_addr):
        raise ValueError("grad_cast: a gradient's address is not a multiple of its element size")
    out_offs, total = [], 0
    for numel in numels:  # each output starts 16-byte aligned
        out_offs.append(total)
        total += -(-numel // _ALIGN) * _ALIGN
    columns = (x_offs, out_offs, numels, [s.data_ptr() for s in states], p_offs, p_scale_inv)
    # Through array: 2x faster than torch.tensor(nested lists); the zeroed outputs travel in the same copy.
    flat = array.array("q", [x for row in zip(*columns, strict=True) for x in row])
    flat.extend([0] * (4 * n))
    flat = torch.frombuffer(flat, dtype=torch.int64).to(grads[0].device, non_blocking=True)
    return flat, out_offs, total, aligned


def _launch_config(interpreted: bool) -> dict:
    cfg = dict(_INTERPRETER_CONFIG if interpreted else CONFIG)
    cfg["VEC"] = max(1, cfg["BLOCK"] // (32 * cfg["NUM_WARPS"]))
    return cfg


def _run(kernel, grid: tuple[int], interpreted: bool, num_warps: int, *args, **constexprs) -> None:
    if interpreted:
        kernel[grid](*args, **constexprs)
    else:  # the fast launch path; fp contraction off: the accumulation rounds twice, as the reference
        launch.launch(kernel, grid, *args, **constexprs, num_warps=num_warps, enable_fp_fusion=False)


def grad_cast(
    grads: list[torch.Tensor],
    states: list[torch.Tensor],
    fp8_dtype: torch.dtype,
    *,
    pending_data: list[torch.Tensor] | None = None,
    pending_scale_inv: list[torch.Tensor] | None = None,
    margin: int = 0,
    count_big: bool = False,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Cast each gradient to FP8 with current scaling and record it in its packed state, in two launches.

    Same signature and bit-exact results as :func:`lightning_fp8.kernels.reference_grad_cast.grad_cast_ref` (see
    there for the arguments); the tensors are on one device. The FP8 gradients are views of one buffer.

    Raises:
        TypeError: for mixed, unsupported or non-contiguous gradient dtypes, or an unknown ``fp8_dtype``.
        ValueError: for a state count that is not the gradient count, or ``pending_data`` without its scales.
    """
    if not grads:
        from lightning_fp8.kernels.reference_grad_cast import grad_cast_ref

        return grad_cast_ref(grads, states, fp8_dtype, count_big=count_big)
    check_grad_cast(grads, states, fp8_dtype, pending_data, pending_scale_inv)
    n = len(grads)
    numels = [g.numel() for g in grads]
    flat, out_offs, total, aligned = _table(grads, states, pending_data, pending_scale_inv, numels)
    device = grads[0].device
    out = torch.empty(max(total, _ALIGN), dtype=torch.uint8, device=device)  # never empty: a valid pointer
    f32, counts = flat[n * NCOL : n * (NCOL + 1)].view(torch.float32), flat[n * (NCOL + 1) :]
    interpreted = _interpreted(_grad_cast_kernel)
    cfg = _launch_config(interpreted)
    chunk = cfg["BLOCK"] * cfg["ITERS"]
    blocks = _block_table(tuple([max(numel, 1) for numel in numels]), chunk, device)  # an empty tensor: one program
    grid = (blocks.shape[0],)
    accumulate = pending_data is not None
    p0 = pending_data[0].view(torch.uint8) if accumulate else out
    p_e4m3 = accumulate and pending_data[0].dtype == torch.float8_e4m3fn
    flags = {"ACCUM": accumulate, "P_E4M3": p_e4m3, "ALIGNED": aligned, "OFFS_64": max(numels) + chunk >= 2**31,
             "BLOCK": cfg["BLOCK"], "ITERS": cfg["ITERS"]}  # fmt: skip
    fmt = _format(fp8_dtype, int(margin), interpreted)
    _run(_grad_amax_kernel, grid, interpreted, cfg["NUM_WARPS"], flat, blocks, f32, grads[0], p0, **flags,
         EXACT_ROUND=interpreted, VEC=cfg["VEC"])  # fmt: skip
    _run(_grad_cast_kernel, grid, interpreted, cfg["NUM_WARPS"], flat, blocks, f32, counts, grads[0], out, p0, n,
         **fmt, COUNT_BIG=bool(count_big), **flags)  # fmt: skip
    fp8 = out.view(fp8_dtype)
    g_fp8 = [fp8.as_strided(g.shape, g.stride(), offset) for g, offset in zip(grads, out_offs, strict=True)]
    return g_fp8, f32[n:], f32[:n], (counts[2 * n :] if count_big else None)
