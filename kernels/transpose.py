"""Transpose of a 2-D 1-byte tensor (an FP8 weight copy) in Triton.

``FP8AdamW(emit_fp8_weights=True)`` writes each FP8 weight row-major; the dgrad GEMM needs its (K, N) transpose.
torch's copy of a transposed 1-byte tensor runs at about 225 GB/s on an H100 (148 us for 4096 x 4096); a tiled
copy through registers reads and writes whole rows of each tile instead. Bytes are moved as ``uint8`` (FP8 has
no Triton loads of its own on every version), so the result is the exact transpose.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lightning_fp8.kernels.cast import _launchable

# Tiles of 64 x 64 bytes: each program reads 64 rows of 64 contiguous bytes and writes 64 rows of 64 contiguous
# bytes of the transpose.
BLOCK = 64


@triton.jit
def _transpose_kernel(x_ptr, y_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One grid axis: CUDA caps the second and third at 65535 programs, which a (cdiv(M, 64), cdiv(N, 64)) grid
    # passes beyond 4.19M columns. Row tiles vary fastest, the order the two-axis grid launched them in.
    pid = tl.program_id(0)
    row_tiles = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % row_tiles, pid // row_tiles
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tile = tl.load(x_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask)
    # y[c, r] = x[r, c]: y is (N, M) row-major
    tl.store(y_ptr + cols[:, None].to(tl.int64) * M + rows[None, :], tl.trans(tile), mask=tl.trans(mask))


def transpose_2d(x: torch.Tensor, traced: bool = False) -> torch.Tensor:
    """``x.t().contiguous()`` for a contiguous 2-D tensor of a 1-byte dtype (FP8, int8, uint8). ``traced``: the launch
    of a ``triton_op`` (:func:`transpose_op`)."""
    if x.dim() != 2 or x.element_size() != 1 or not x.is_contiguous():
        raise ValueError(
            f"transpose_2d: expected a contiguous 2-D tensor of a 1-byte dtype, got shape {tuple(x.shape)}, "
            f"dtype {x.dtype}, contiguous={x.is_contiguous()}"
        )
    m, n = x.shape
    y = torch.empty((n, m), dtype=x.dtype, device=x.device)
    if x.numel():
        grid = (triton.cdiv(m, BLOCK) * triton.cdiv(n, BLOCK),)
        kernel = _launchable(_transpose_kernel) if traced else _transpose_kernel
        kernel[grid](x.view(torch.uint8), y.view(torch.uint8), m, n, BLOCK_M=BLOCK, BLOCK_N=BLOCK)
    return y


@torch.library.triton_op("lightning_fp8::transpose_1byte", mutates_args=())
def transpose_op(x: torch.Tensor) -> torch.Tensor:
    """:func:`transpose_2d` as a ``triton_op``: under torch.compile inductor launches the kernel and fuses nothing into
    it (lightning_fp8/scaling.py FUSED_CASTS: fused into inductor's kernel of a residual add, LayerNorm and cast of
    16384 x 1024, the transposed copy took that kernel from 124 to 363 us a call on an H100)."""
    return transpose_2d(x, traced=True)
