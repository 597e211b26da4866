"""The ops a cast of :class:`~lightning_fp8.scaling.ScalingState` becomes under ``torch.compile``.

Eagerly a cast calls ``ops.quantize`` (a Triton kernel on CUDA, ``kernels/reference.py`` elsewhere). Traced, it is
one of three things; ``ScalingState._quantize`` picks it, reading the switches of ``lightning_fp8/scaling.py``:

- :func:`quantize_op_for` with ``TRACE_TRITON_CASTS`` on (the default) and a non-empty CUDA tensor: the triton_op of
  ``kernels/quantize.py``, whose kernels inductor launches from the generated code, no Python per cast;
- otherwise :func:`quantize_op`, an opaque custom op that runs the eager cast (the CPU's path);
- :func:`fused_quantize` with ``FUSED_CASTS`` on (off by default): the data pass as tensor ops that inductor fuses into
  the kernel producing the input (a LayerNorm or a GELU writes FP8 and folds the amax; DESIGN.md "Kernel fusion"),
  for the casts of delayed scaling states (activations, gradients; not weights, not the grad casts that sum a bias
  gradient). The transposed copy is a pass of its own (kernels/transpose.py: transpose_op) and the bookkeeping one
  small launch (kernels/record.py).

Why ``FUSED_CASTS`` is off: it does not pay on an H100 (benchmarks/train_step.py variant o2fc, compiled GPT d=1024 x
12, results/h100_s10.txt): 63.7-65.4 ms per step against 53.7 ms with every cast one kernel. Hopper's FP8 GEMMs need
both layouts of every activation and gradient: fused into a row-wise kernel, inductor writes the transposed copy slowly
(its kernel of a residual add, LayerNorm and cast of 16384 x 1024, by the ops in its name: 363 us a call, 124 us
without the transposed write); as passes of their own the transposes take 4.9 ms per step (96 launches), as much as
the fused producers save, and inductor's kernels with the casts and their amax and saturation reductions took 19.8 ms
per step against 12.9 ms without them.

Why ``TRACE_TRITON_CASTS`` is on: measured on an H100 (benchmarks/results/h100_s5.txt, bench_linear.py --compile,
16384 x 4096 -> 4096 fwd+bwd), 1.47x nn.Linear with the traced casts against 1.19x with the opaque op;
tests/core/test_linear.py checks the compiled path bit for bit.

The custom ops are registered (by name, ``lightning_fp8::...``) when this module is imported, which
``lightning_fp8.scaling`` does.
"""

from __future__ import annotations

import torch

from lightning_fp8 import ops
from lightning_fp8.formats import fp8_max
from lightning_fp8.kernels import reference


def fused_quantize(
    x: torch.Tensor,
    buffers: tuple[torch.Tensor, ...],
    fp8_dtype: torch.dtype,
    margin: int,
    algo_max: bool,
    delayed: bool,
    current: bool,
    transpose: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``reference.quantize_ref`` (no unscale, no column sums, non-empty ``x``) for torch.compile to trace: the data
    pass as tensor ops, the scale it uses from an op the backward cannot recompute (``scale`` changes in the same
    graph), the bookkeeping as one op. ``buffers``: the state's, in ``quantize_ref``'s order (``amax_history, scale,
    last_amax, saturation, nonfinite_count, casts``)."""
    fmax = fp8_max(fp8_dtype)
    scale = buffers[1]
    triton = ops.use_triton(x)
    if x.dtype in (torch.bfloat16, torch.float16):  # widened through its bits (ops.rounded_to): the fused cast reads
        x = ops.rounded_to(x, x.dtype)  # what eager's reads (inductor would drop a rounding of the fp32 producer)
    if triton:
        from lightning_fp8.kernels import record

        used = record.used_scale_op(scale)
    else:
        used = _used_scale(scale)
    if current:
        used = reference.pow2_scale_ref(reference.amax_ref(x), fmax, margin, used)
    x_fp8, x_fp8_t, amax, n_saturated = reference.cast_to_fp8_ref(x, used, fp8_dtype, transpose and not triton)
    if triton:
        if transpose:  # a pass of its own: fused into a row-wise producer the transposed writes crawl
            from lightning_fp8.kernels import transpose as fp8_transpose

            x_fp8_t = fp8_transpose.transpose_op(x_fp8)
        scale_inv = record.record_op(amax, n_saturated, used, *buffers, x.numel(), fp8_dtype, margin, algo_max, delayed)
    else:
        if current:
            scale.copy_(used)
        scale_inv = reference.record_cast_ref(
            amax, n_saturated, x.numel(), used, *buffers, fmax, margin, algo_max, delayed
        )
    return x_fp8, x_fp8_t, scale_inv


@torch.library.custom_op("lightning_fp8::used_scale_ref", mutates_args=())
def _used_scale(scale: torch.Tensor) -> torch.Tensor:
    # kernels/record.py: used_scale_op without Triton. A copy as an op: the partitioner recomputes a traced clone.
    return scale.clone()


@_used_scale.register_fake
def _(scale):
    return torch.empty_like(scale)


def quantize_op_for(x: torch.Tensor, trace_triton: bool):
    """The op torch.compile records for a cast of ``x``: ``kernels/quantize.py``'s triton_op where ``trace_triton``
    (``scaling.TRACE_TRITON_CASTS``) and ``x`` is a non-empty CUDA tensor the Triton kernels take, else
    :func:`quantize_op`. Both take :func:`quantize_op`'s arguments."""
    if trace_triton and x.is_cuda and x.numel() > 0 and ops.use_triton(x):
        from lightning_fp8.kernels import quantize as fused

        return fused.quantize_op
    return quantize_op


# One opaque op per cast: torch.compile saves its outputs for the backward instead of recomputing them from the scale
# buffer, which this op updates (AOT autograd recomputes cheap ops from graph inputs after their mutation otherwise).
@torch.library.custom_op(
    "lightning_fp8::quantize",
    mutates_args=("amax_history", "scale", "last_amax", "saturation", "nonfinite_count", "casts"),
)
def quantize_op(
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
    unscale: torch.Tensor | None,
    column_sum: bool,
    activation: str = "",
    activation_input: torch.Tensor | None = None,
    activation_scale_inv: torch.Tensor | None = None,
    keep_input: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # A fixed schema: the fourth output is the column sums, the kept input or empty; activation "" for none.
    out = ops.quantize(
        x, amax_history, scale, last_amax, saturation, nonfinite_count, casts, fp8_dtype, margin, algo_max, delayed,
        current, transpose, unscale, column_sum, activation or None, activation_input, activation_scale_inv,
        keep_input,
    )  # fmt: skip
    return out if column_sum or keep_input else (*out, scale.new_empty((0,)))


@quantize_op.register_fake
def _(x, amax_history, scale, last_amax, saturation, nonfinite_count, casts, fp8_dtype, margin, algo_max, delayed,
      current, transpose, unscale, column_sum, activation="", activation_input=None, activation_scale_inv=None,
      keep_input=False):  # fmt: skip
    x_fp8 = torch.empty_like(x, dtype=fp8_dtype, memory_format=torch.contiguous_format)
    t_shape = (x.shape[1], x.shape[0]) if transpose else (0,)
    if keep_input:
        fourth = torch.empty_like(x, dtype=fp8_dtype, memory_format=torch.contiguous_format)
    else:
        fourth = scale.new_empty((x.shape[1],) if column_sum else (0,))
    return x_fp8, x.new_empty(t_shape, dtype=fp8_dtype), scale.new_empty(()), fourth
