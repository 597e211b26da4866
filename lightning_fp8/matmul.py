"""The FP8 matmul of a linear layer: its three GEMMs (forward, dgrad, wgrad: the table in ``linear.py``) and the
autograd function that runs them.

:func:`forward_gemm` and :func:`backward_gemms` are shared by :class:`~lightning_fp8.FP8Linear` (through
:class:`_FP8Matmul`) and :class:`~lightning_fp8.FP8MLP`; :func:`current_flags`, :func:`grad_output_current` and
:func:`note_casts` decide, outside and inside the autograd function, which casts use their tensor's own amax.

The switches below choose what the forward keeps for the backward and where the bias gradient comes from; the
benchmarks and tests set them at run time (``lightning_fp8.matmul.FUSED_BIAS_GRAD = False``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_fp8 import ops, weight_cache
from lightning_fp8.autograd_rules import once_differentiable
from lightning_fp8.recompute import ForwardCall, backward_ran, cast_current, replay_scales, restore_buffers
from lightning_fp8.trace_marks import backward_cast_pending, note_traced_mark

# Take the bias gradient from the grad_output cast (its fused column sums, ScalingState.quantize(column_sum=True))
# instead of a separate dy.sum(0) pass over dy. The cast walks GROUP_M row tiles of a column block, adds them in
# registers and reduces once per group (kernels/cast_kernels.py). H100, 16384 x 4096 bf16 -> E5M2 (bench_cast.py
# --sum-groups, results/h100_s8.txt): cast 116.9 us + dy.sum(0) 70.8 us against 145.9 us fused; 16384 x 16384: 611 us
# against 512 us. In FP8Linear 16384 x 4096 -> 4096 (profile_step.py): GPU busy 1.493 -> 1.470 ms per forward +
# backward. bench_linear.py times the other choice beside the default.
FUSED_BIAS_GRAD = True
# Keep the weight's transposed FP8 copy (the dgrad operand) from the forward to the backward (True), or cast the weight
# again in the backward with the forward's scale, which gives the same bytes (False, the default, as torchao does).
# Recasting costs one more pass over the weight per backward and saves a byte per weight element from the forward to
# the backward, at the peak of a training step's memory. A weight copy written by FP8AdamW(emit_fp8_weights=True) keeps
# its transpose either way.
SAVE_WEIGHT_TRANSPOSE = False
# Under torch.compile, keep the input's transposed FP8 copy (the wgrad operand) from the forward to the backward (True),
# or keep nothing of the input's cast and cast the input again in the backward with the forward's scale, the same bytes
# (False): the partitioner then keeps the high-precision input where another op keeps it anyway (an attention output
# for its backward) or recomputes it from what it keeps (a LayerNorm's or a GELU's output), one byte per element less
# at the peak for one more pass in the backward. Eagerly the copy is always kept (the input itself may be 4 bytes).
SAVE_INPUT_TRANSPOSE_COMPILED = True


class _FP8Matmul(torch.autograd.Function):
    """``y = x @ w^T`` with FP8 operands; ``x`` is 2-D (tokens, in_features)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        fp8: nn.ModuleDict,
        out_dtype: torch.dtype,
        current: tuple[bool, bool],
        master_scale: torch.Tensor | None = None,
        cache_key: int | None = None,
        call: tuple[ForwardCall | None, bool] = (None, False),
        grad_enabled: bool = True,
    ):
        # `current`: (input, grad_output) compute their tensor's own amax (current scaling, or no history yet); the
        # backward uses the second only when traced (see backward). `call`: see recompute.forward_call.
        # `grad_enabled`: torch.is_grad_enabled() of the caller (always False in here). Without it no backward runs
        # (no_grad, inference_mode, use_reentrant=True checkpointing's first forward): nothing is cast for one.
        need_dgrad, need_wgrad = x.requires_grad and grad_enabled, weight.requires_grad and grad_enabled
        record, replaying = call
        # Without the transposed copy the backward casts x again (SAVE_INPUT_TRANSPOSE_COMPILED).
        ctx.recast_input = need_wgrad and not SAVE_INPUT_TRANSPOSE_COMPILED and torch.compiler.is_compiling()
        saved = replay_scales(record, (fp8["input"], fp8["weight"])) if replaying else None
        x_fp8, x_fp8_t, x_scale_inv = fp8["input"].quantize(
            x, need_wgrad and not ctx.recast_input, cast_current(current[0], call)
        )
        ctx.input_fp8_dtype = x_fp8.dtype
        y, w_saved, ctx.weight_meta = forward_gemm(
            x_fp8, x_scale_inv, weight, bias, fp8, need_dgrad, master_scale, out_dtype, cache_key
        )
        restore_buffers(saved)
        if record is not None and not replaying:
            record.scale_invs = (x_scale_inv,)
        ctx.record = None if replaying else record
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x if ctx.recast_input else x_fp8_t, x_scale_inv, *w_saved)
        ctx.grad_state = fp8["grad_output"]
        ctx.grad_current = current[1]
        ctx.dtypes = (x.dtype, weight.dtype)
        return y

    @staticmethod
    @once_differentiable  # the FP8 casts are not differentiable: differentiating dx or dw again raises (no silent 0)
    def backward(ctx: Any, dy: torch.Tensor):
        x_fp8_t, x_scale_inv, *w_saved = ctx.saved_tensors  # under torch.utils.checkpoint: recomputed here
        backward_ran(ctx.record)
        need_dgrad, need_wgrad, need_bgrad = ctx.needs_input_grad[:3]
        if ctx.recast_input and need_wgrad:  # x_fp8_t holds x: its forward cast again, the same bytes
            x_fp8_t = ops.recast_transposed(x_fp8_t.detach(), torch.reciprocal(x_scale_inv), ctx.input_fp8_dtype)
        # With FUSED_BIAS_GRAD the bias gradient (fp32 column sums of dy) comes from the cast, which reads dy anyway.
        fused = FUSED_BIAS_GRAD and need_bgrad
        dy_fp8, dy_fp8_t, dy_scale_inv, *db = ctx.grad_state.quantize(
            dy.contiguous(), need_wgrad, grad_output_current(ctx.grad_current), column_sum=fused
        )
        dx, dw = backward_gemms(
            (dy_fp8, dy_fp8_t, dy_scale_inv), x_fp8_t, x_scale_inv, w_saved, ctx.weight_meta, need_dgrad,
            need_wgrad, ctx.dtypes,
        )  # fmt: skip
        if need_bgrad:
            db = ops.narrowed(db[0] if fused else dy.sum(0, dtype=torch.float32), ctx.bias_dtype)
        else:
            db = None
        return dx, dw, db, None, None, None, None, None, None, None


def forward_gemm(
    x_fp8: torch.Tensor,
    x_scale_inv: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    fp8: nn.ModuleDict,
    need_dgrad: bool,
    master_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
    cache_key: int | None = None,
) -> tuple[torch.Tensor, tuple, tuple[torch.dtype, int | None, int | None]]:
    """The forward GEMM of an FP8 linear layer from its input's FP8 copy: the weight's cast (``fp8``: the layer's
    scaling states), ``x @ w^T + bias``. ``cache_key``: :func:`weight_cache.compiled_key` of the weight. Returns
    ``(y, saved, weight_meta)``, ``saved`` being what :func:`backward_gemms` needs of the weight (tensors, or None, for
    ``save_for_backward``) and ``weight_meta`` the rest (Python values)."""
    b = None if bias is None else bias.to(out_dtype)
    if cache_key is not None:  # traced, a weight with an FP8 copy: the copy's validity is checked as the code runs
        state = fp8["weight"]
        y, w_scale_inv = weight_cache.compiled_forward_gemm(
            x_fp8, x_scale_inv, weight, master_scale, b, state, out_dtype, cache_key
        )
        saved = (w_scale_inv.new_empty((0,)), w_scale_inv, *((weight, master_scale) if need_dgrad else ()))
        return y, saved, (state.fp8_dtype, state.margin, cache_key)
    # At O2 the storage may hold weight * master_scale (FP8AdamW's fp16 master): the cast unscales its record.
    # The FP8 copy that FP8AdamW(emit_fp8_weights=True) wrote in its step replaces the cast while it is valid.
    w_fp8, w_fp8_t, w_scale_inv = weight_cache.quantize_weight(
        fp8["weight"], weight, need_dgrad, master_scale, keep_transpose=SAVE_WEIGHT_TRANSPOSE
    )
    y = ops.linear_forward_mm(x_fp8, w_fp8, x_scale_inv, w_scale_inv, out_dtype, bias=b)  # bias fused
    # No transposed copy from the forward (weight_cache made none): the backward casts the weight again.
    recast = (weight, master_scale) if need_dgrad and w_fp8_t.numel() == 0 else ()
    return y, (w_fp8_t, w_scale_inv, *recast), (w_fp8.dtype, None, None)


def backward_gemms(
    dy_cast: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    x_fp8_t: torch.Tensor,
    x_scale_inv: torch.Tensor,
    w_saved: list | tuple,
    weight_meta: tuple[torch.dtype, int | None, int | None],
    need_dgrad: bool,
    need_wgrad: bool,
    dtypes: tuple[torch.dtype, torch.dtype],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dgrad and wgrad of an FP8 linear layer from its output gradient's cast ``(dy_fp8, dy_fp8_t, dy_scale_inv)``, its
    input's transposed FP8 copy and what :func:`forward_gemm` saved and returned of the weight; ``dtypes``: of ``dx``
    and ``dw``."""
    dy_fp8, dy_fp8_t, dy_scale_inv = dy_cast
    w_fp8_t, w_scale_inv, *recast = w_saved
    fp8_dtype, margin, cache_key = weight_meta
    dx = dw = None
    if need_dgrad and cache_key is not None:  # traced, with the weight's FP8 copy (see forward_gemm)
        dx = weight_cache.compiled_dgrad(dy_fp8, dy_scale_inv, *recast, w_scale_inv, fp8_dtype, dtypes[0], margin,
                                         cache_key)  # fmt: skip
    elif need_dgrad:  # dgrad: (M, N) @ (N, K), w as column-major = w_fp8_t^T
        if recast:
            w_fp8_t = weight_cache.recast_weight_t(*recast, w_scale_inv, fp8_dtype)
        dx = ops.scaled_mm(dy_fp8, w_fp8_t.t(), dy_scale_inv, w_scale_inv, dtypes[0])
    if need_wgrad:  # wgrad: (N, M) @ (M, K), x as column-major = x_fp8_t^T
        dw = ops.scaled_mm(dy_fp8_t, x_fp8_t.t(), dy_scale_inv, x_scale_inv, dtypes[1])
    return dx, dw


def current_flags(scaling: nn.ModuleDict, by_value: bool = True) -> tuple[bool, bool]:
    """Whether a layer's ``(input, grad_output)`` casts compute their tensor's own amax: current scaling, or no
    history yet (the very first cast of each role). Read outside the autograd.Function: a dynamo guard when traced.

    Traced, a grad_output role that a traced forward marked (:func:`note_casts`) before any backward cast of it
    (:mod:`~lightning_fp8.trace_marks`: a layer applied again in the same graph, micro-batches whose losses are summed
    into one backward, a graph whose backward never ran) still takes its own amax: the backward runs the uses in reverse
    order, and the delayed scale of the empty history, 1, flushes gradients under 2**-16 to zero in E5M2. The role's
    own ``marked_by_trace`` is a guard (a value, the same for every layer), so a graph traced without a mark is not
    reused once one stands. ``by_value=False`` (tensor parallelism, whose casts with their own amax are collectives):
    only the role's ``initialized`` decides, the same on every rank (such roles are not marked: :func:`note_casts`)."""
    grad_output = scaling["grad_output"]
    pending = False
    if by_value and torch.compiler.is_compiling():
        pending = backward_cast_pending()  # first: it clears the marks of roles cast since, before any is read
        pending = grad_output.marked_by_trace and pending  # read either way: a guard
    return scaling["input"].needs_current_scale(), grad_output.needs_current_scale() or pending


def grad_output_current(traced_flag: bool) -> bool | None:
    """The ``current`` argument of a backward's grad_output cast. Eagerly ``None``: the role decides from its own state
    when the backward runs, and a cast of a non-empty gradient marks it initialized. Forwards without a backward
    (evaluation under no_grad, a second use of the layer, micro-batches before their one backward) do not use up its
    first cast. Traced, the backward cannot change Python state: the flag the forward read (:func:`current_flags`),
    and :func:`note_casts` marks the role after a traced forward that has a backward."""
    return traced_flag if torch.compiler.is_compiling() else None


def note_casts(
    scaling: nn.ModuleDict,
    x: torch.Tensor,
    y: torch.Tensor,
    by_value: bool = True,
    backward: bool | None = None,
    numel: int | None = None,
    grad_numel: int | None = None,
) -> None:
    """Mark the roles that the forward of input ``x`` (output ``y``) cast as initialized where the cast's amax was
    finite and > 0 (:meth:`ScalingState.note_cast`; ``by_value=False``: any cast of a non-empty tensor, the same on
    every rank of a tensor-parallel group); outside the autograd.Function, where torch.compile allows Python state to
    change. ``backward``: whether a backward will cast this layer's output gradient (default: ``y`` needs a
    gradient; an FP8MLP's fc has none where neither its input nor its parameters need one). A cast of an empty or
    all-zero tensor (amax 0: no information; an MoE expert without tokens, the output
    of a zero-initialized layer) or of a non-finite one marks nothing: the next cast still uses its own amax.
    ``numel``: the size of the input the layer cast, where ``x`` is not that input (an FP8MLP's proj: the GELU of its
    fc's output, not empty when ``x`` is empty but has tokens). ``grad_numel``: the size of the output gradient the
    backward casts, where ``y`` is not this layer's output (an FP8MLP's fc); not empty where ``x`` is empty but has
    tokens (``in_features=0``: the output is the bias on every token)."""
    n = x.numel() if numel is None else numel
    if n:
        scaling["input"].note_cast(n, by_value)
        scaling["weight"].note_cast(n, by_value=False)  # the weight's casts take its own amax every time (current)
    n_grad = y.numel() if grad_numel is None else grad_numel
    backward = y.requires_grad if backward is None else backward
    if n_grad and backward and torch.compiler.is_compiling():  # grad_output_current
        grad_output = scaling["grad_output"]
        if by_value and not grad_output.initialized:  # marked before its backward has run: see current_flags
            grad_output.marked_by_trace = True
            note_traced_mark()
        grad_output.note_cast(n_grad, by_value)
