"""The FP8 GEMMs of a tensor-parallel linear layer, with the collectives around them.

A column-parallel layer holds a slice of the output features (weight ``Shard(0)``), the row-parallel layer after
it a slice of the input features (weight ``Shard(1)``). Both run the three FP8 GEMMs of
:class:`~lightning_fp8.FP8Linear` (forward, dgrad, wgrad) on local shards; the collectives between them are
explicit so that the FP8 copies are what travels. With sequence parallelism (activations between blocks sharded on
the sequence dimension)::

    colwise forward   x shard --cast E4M3 (shared scale)--> all-gather, 1 B/elt --> x_fp8 (full sequence) --> GEMM
                      the gathered FP8 copy is the GEMM operand (no second cast) and is kept for wgrad
    colwise backward  dx partial sums --cast (scale from the MAX-reduced amax)--> all-to-all of the FP8 chunks,
                      1 B/elt --> fp32 sum of the world-size chunks --> dx shard    (no FP8 sum: no overflow)
    rowwise forward   y partial sums --reduce-scatter in the activation dtype--> y shard (the residual stream)
    rowwise backward  dy shard --cast E5M2 (shared scale)--> all-gather, 1 B/elt --> dy_fp8 --> dgrad, wgrad

Without sequence parallelism the colwise input is replicated (its gradient all-reduced) and the rowwise output is
all-reduced, in the activation dtype. With ``fp8=False`` the sequence-parallel collectives move the activation
dtype and the full tensor is cast after the gather (the baseline the benchmark compares against).

Shared scales: a rank dequantizes gathered bytes with its own ``scale_inv``, so every rank must cast with the same
scale. With delayed scaling the root's amax sync (:mod:`~lightning_fp8.distributed.amax_sync`) makes histories
identical once per step; with current scaling (and on the first step) the amax is MAX-reduced over the group before
the cast. Either way the scale is the one a single process computes on the whole tensor. Weight scales are per
shard: a rank's GEMMs read only its shard, so the shard's own amax is exact and needs no communication.

:func:`dtensor_forward` is ``FP8Linear.forward`` for a DTensor weight: it picks the layouts and runs the above. The
collectives themselves (FP8 as its bytes on the wire) are in :mod:`~lightning_fp8.distributed.tensor_parallel_comms`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from lightning_fp8 import ops
from lightning_fp8.autograd_rules import once_differentiable
from lightning_fp8.distributed.amax_sync import claim_shared_scale, localize_buffers
from lightning_fp8.distributed.tensor_parallel_comms import _all_gather, _reduce_scatter, _reduce_scatter_fp8
from lightning_fp8.linear import (
    FP8Linear,
    current_flags,
    grad_output_current,
    note_casts,
    output_dtype,
)
from lightning_fp8.linear_checks import check_input
from lightning_fp8.optim import master
from lightning_fp8.recompute import (
    ForwardCall,
    backward_ran,
    cast_current,
    forward_call,
    replay_scales,
    restore_buffers,
)
from lightning_fp8.scale_rule import compute_scale
from lightning_fp8.scaling import ScalingState
from lightning_fp8.trace_marks import _capturing, _tracing

# How a cast operand is spread over the group: identical everywhere, a different slice per rank, or a slice whose
# FP8 bytes are gathered (its scale MUST be identical on every rank).
Layout = Literal["replicated", "sharded", "gathered"]


def _cast(
    state: ScalingState,
    t: torch.Tensor,
    transpose: bool,
    group: dist.ProcessGroup,
    current: bool,
    layout: Layout,
    replaying: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``state.quantize(t)`` with a scale identical on every rank of ``group`` wherever ``layout`` needs one.
    ``replaying``: an activation-checkpointing recompute casting with its forward's scale, which every rank shares
    already (the forward made sure of it): nothing to claim, no collective.

    Returns:
        ``(t_fp8, t_fp8_t, scale_inv, amax)``: ``amax`` is the whole tensor's (the same on every rank) where the cast
        computed its own scale (``current``), else None; :func:`_note_first_cast` decides by it.
    """
    amax = None
    if current:  # the amax of the whole (distributed) tensor, as a single process would compute it
        with torch.no_grad():
            amax = ops.amax(t)
            if layout != "replicated":  # replicated data is identical on every rank: so is its amax
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
            state.scale.copy_(compute_scale(amax, state.fp8_dtype, state.margin, state.scale))
    elif layout == "gathered" and not replaying:
        claim_shared_scale(state, group)
    return (*state.quantize(t, transpose, current=False), amax)


def _note_first_cast(state: ScalingState, amax: torch.Tensor | None, numel: int) -> None:
    """:meth:`ScalingState.note_cast` for a cast of a tensor-parallel layer, by a single process's rule: the state is
    initialized by its first cast whose amax is finite and > 0; an empty, all-zero or non-finite one does not count.
    ``amax`` is the whole tensor's, as :func:`_cast` returns it for a cast with its own scale (the only kind an
    uninitialized state makes; None otherwise: nothing to decide). Every rank of the group holds the same value, so
    the ranks agree about the next cast's path (a cast with its own amax all-reduces it), also where one rank's shard
    is all zeros. Unlike a single process, the amax history is not counted: between amax syncs it is the rank's own.

    Eagerly the amax is read at once (on a GPU a device sync, only while the state is not initialized: the first
    step, as a rule). Where it cannot be read (traced by ``torch.compile``, captured in a CUDA graph) a cast of a
    non-empty tensor counts, as with ``note_cast(by_value=False)``: the trace decides the next cast's path anyway."""
    if state.initialized or numel == 0 or amax is None:
        return
    if torch.compiler.is_compiling() or _tracing(amax) or _capturing(amax):
        state.note_cast(numel, by_value=False)
        return
    state.set_initialized(0.0 < float(amax) < math.inf)  # ops.amax gives inf for a NaN


@dataclass(frozen=True)
class Comm:
    """The collectives around one call of a tensor-parallel FP8 linear."""

    kind: Literal["colwise", "rowwise"]
    group: dist.ProcessGroup
    # colwise: the input arrives sharded on `dim` and is gathered; rowwise: the output is reduce-scattered on
    # `dim`. None: replicated (colwise input / rowwise output).
    dim: int | None
    fp8: bool  # FP8 on the wire for the gathers and the colwise input-gradient reduce-scatter
    grad_dtype: torch.dtype  # FP8 format of gradients (the recipe's backward dtype)


class TPLinearFn(torch.autograd.Function):
    """``y = x @ w^T`` on local shards with FP8 operands and the tensor-parallel collectives of ``comm``; returns
    ``(y, x_amax)``, ``x_amax`` the input cast's amax as :func:`_cast` returns it (not differentiable)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        fp8: nn.ModuleDict,
        comm: Comm,
        out_dtype: torch.dtype,
        current: tuple[bool, bool],
        master_scale: torch.Tensor | None,
        call: tuple[ForwardCall | None, bool] = (None, False),
    ):
        # current: (input, grad_output) compute their own amax this call; master_scale: see FP8Linear.forward;
        # call: see recompute.forward_call. A recompute under activation checkpointing casts with the scales its
        # forward used and records nothing (as FP8Linear): the same FP8 bytes, hence the same gradients, and no amax
        # recorded twice; replay_scales saves the buffers, restore_buffers puts them back after the casts.
        need_dgrad, need_wgrad = x.requires_grad, weight.requires_grad
        state, group, k = fp8["input"], comm.group, x.shape[-1]
        record, replaying = call
        saved = replay_scales(record, (state, fp8["weight"])) if replaying else None
        x_current = cast_current(current[0], call)
        x_fp8_t = None  # transposed copy for wgrad; made in backward from a gathered FP8 copy
        if comm.kind == "colwise" and comm.dim is not None and comm.fp8:
            x_fp8, _, x_scale_inv, x_amax = _cast(state, x, False, group, x_current, "gathered", replaying)
            x_fp8 = _all_gather(x_fp8, comm.dim, group)  # the GEMM operand itself: no second cast
            lead_shape, x_fp8 = x_fp8.shape[:-1], x_fp8.reshape(-1, k)
            if need_wgrad and torch.compiler.is_compiling():
                # dynamo (torch 2.13) cannot save a view of the gather's buffer from the Function's traced forward
                # for its backward ("aliases an input or output"): save the transposed copy the backward would make
                x_fp8_t = x_fp8.t().contiguous()
        else:
            if comm.kind == "colwise" and comm.dim is not None:
                x = _all_gather(x, comm.dim, group)
            layout = "sharded" if comm.kind == "rowwise" else "replicated"
            lead_shape = x.shape[:-1]
            x_2d = x.reshape(-1, k)
            x_fp8, x_fp8_t, x_scale_inv, x_amax = _cast(state, x_2d, need_wgrad, group, x_current, layout, replaying)
        # per shard; at O2 the storage may hold weight * master_scale (FP8AdamW's fp16 master): the cast unscales
        w_fp8, w_fp8_t, w_scale_inv = fp8["weight"].quantize(weight, need_dgrad, True, master_scale)
        restore_buffers(saved)
        if record is not None and not replaying:
            record.scale_invs = (x_scale_inv,)
        ctx.record = None if replaying else record
        # forward GEMM, fast accumulation (forward only) as in FP8Linear; a column shard's bias is fused into it
        b = None if bias is None else bias.to(out_dtype)
        fused = b if comm.kind == "colwise" else None
        y = ops.linear_forward_mm(x_fp8, w_fp8, x_scale_inv, w_scale_inv, out_dtype, bias=fused)
        y = y.reshape(*lead_shape, y.shape[-1])  # an explicit width: -1 is ambiguous with no tokens
        # rowwise: partial sums over the input-feature shards; the bias is added once, after the reduction (with a
        # feature-sharded output, this rank's slice of it)
        if comm.kind == "rowwise":
            if comm.dim is None:
                dist.all_reduce(y, group=group)
                if b is None and torch.compiler.is_compiling():
                    # dynamo traces the in-place call as a functional one and a copy_ back into y, whose result is y
                    # itself: torch 2.11 also returns it as one of the Function's intermediates and gives the
                    # output's gradient to that one (zero input and weight gradients). A new tensor ends the forward.
                    y = y.clone()
            else:
                y = _reduce_scatter(y, comm.dim, group)
            if b is not None:
                y = y + b
        ctx.bias_dtype = None if bias is None else bias.dtype
        x_saved = x_fp8_t if x_fp8_t is not None else x_fp8
        ctx.save_for_backward(x_saved if need_wgrad else None, w_fp8_t, x_scale_inv, w_scale_inv)
        ctx.x_is_transposed = x_fp8_t is not None
        ctx.comm, ctx.grad_state, ctx.grad_current = comm, fp8["grad_output"], current[1]
        ctx.lead_shape, ctx.dtypes = lead_shape, (x.dtype, weight.dtype)
        if x_amax is not None:
            ctx.mark_non_differentiable(x_amax)
        return y, x_amax  # x_amax: the input cast's, for dtensor_forward's first-cast rule (_note_first_cast)

    @staticmethod
    @once_differentiable  # the FP8 casts are not differentiable: a double backward raises (no silent 0)
    def backward(ctx: Any, dy: torch.Tensor, _x_amax_grad: Any):
        x_saved, w_fp8_t, x_scale_inv, w_scale_inv = ctx.saved_tensors  # under torch.utils.checkpoint: recomputed here
        backward_ran(ctx.record)
        need_dgrad, need_wgrad, need_bgrad = ctx.needs_input_grad[:3]
        comm, group, state = ctx.comm, ctx.comm.group, ctx.grad_state
        # As FP8Linear (linear.grad_output_current): eagerly the grad_output role decides its first cast when the
        # backward runs (every rank alike: the same calls, and _note_first_cast below), so forwards without a backward
        # do not use it up.
        current = grad_output_current(ctx.grad_current)
        note = current is None
        if note:
            current = state.needs_current_scale()
        # Bias gradient in fp32 from this rank's dy: its column shard (colwise, or rowwise with a feature-sharded
        # output: the caller gathers the slices), or its rows (rowwise, sequence parallel: a partial sum that the
        # caller marks as such), or all rows (rowwise, replicated output).
        db = dy.reshape(-1, dy.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype) if need_bgrad else None
        dy_fp8_t = None
        if comm.kind == "rowwise" and comm.dim is not None and comm.fp8:
            dy_fp8, _, dy_scale_inv, dy_amax = _cast(state, dy.contiguous(), False, group, current, "gathered")
            dy_fp8 = _all_gather(dy_fp8, comm.dim, group)
            dy_fp8 = dy_fp8.reshape(-1, dy_fp8.shape[-1])
        else:
            if comm.kind == "rowwise" and comm.dim is not None:
                dy = _all_gather(dy.contiguous(), comm.dim, group)
            layout = "sharded" if comm.kind == "colwise" else "replicated"
            dy_2d = dy.reshape(-1, dy.shape[-1]).contiguous()
            dy_fp8, dy_fp8_t, dy_scale_inv, dy_amax = _cast(state, dy_2d, need_wgrad, group, current, layout)
        if note:
            _note_first_cast(state, dy_amax, dy.numel())
        dx = dw = None
        if need_dgrad:  # dgrad: (M, N) @ (N, K), w as column-major = w_fp8_t^T
            dx = ops.scaled_mm(dy_fp8, w_fp8_t.t(), dy_scale_inv, w_scale_inv, ctx.dtypes[0])
            dx = dx.reshape(*ctx.lead_shape, dx.shape[-1])
            if comm.kind == "colwise":  # partial sums over the output-feature shards
                if comm.dim is None:
                    dist.all_reduce(dx, group=group)
                elif comm.fp8:
                    dx = _reduce_scatter_fp8(dx, comm.dim, group, comm.grad_dtype, ctx.dtypes[0])
                else:
                    dx = _reduce_scatter(dx, comm.dim, group)
        if need_wgrad:  # wgrad: (N, M) @ (M, K), x as column-major = x_fp8_t^T
            x_fp8_t = x_saved if ctx.x_is_transposed else x_saved.t().contiguous()
            if dy_fp8_t is None:
                dy_fp8_t = dy_fp8.t().contiguous()
            dw = ops.scaled_mm(dy_fp8_t, x_fp8_t.t(), dy_scale_inv, x_scale_inv, ctx.dtypes[1])
        return dx, dw, db, None, None, None, None, None, None


# ------------------------------------------------------------------------------------ the DTensor forward
@dataclass(frozen=True)
class _LayerSettings:
    """What a parallel style tells the layer's forward; stored as ``layer._fp8_tensor_parallel``."""

    fp8_comm: bool = True
    output_layout: Placement = Replicate()  # rowwise layers reduce their output into this layout themselves


_DEFAULT_SETTINGS = _LayerSettings()


def _shard_dim(placement: Placement, ndim: int) -> int | None:
    return placement.dim % ndim if isinstance(placement, Shard) else None


def _check_even(size: int, world: int, what: str) -> None:
    if size % world:
        raise ValueError(
            f"tensor parallelism over {world} ranks splits {what} of size {size} into equal shards; "
            f"make it a multiple of {world}"
        )


def _kind(weight: DTensor) -> str:
    mesh, placement = weight.device_mesh, weight.placements[0]
    if mesh.ndim != 1:
        raise ValueError(
            f"FP8Linear's weight is a DTensor on the {mesh.ndim}-D mesh {mesh}: tensor parallelism runs on a 1-D mesh; "
            "parallelize with the tensor-parallel sub-mesh (e.g. mesh['tp'])"
        )
    if placement.is_shard(0):
        return "colwise"
    if placement.is_shard(1):
        return "rowwise"
    raise NotImplementedError(
        f"FP8Linear weight placement {placement} is not supported: shard it with FP8ColwiseParallel (Shard(0)) or "
        "FP8RowwiseParallel (Shard(1)) from lightning_fp8.distributed.tensor_parallel"
    )


def _layouts(layer: FP8Linear, x: DTensor, kind: str) -> tuple[DTensor, int | None, Placement]:
    """The input in a layout the GEMM can take, the dimension the layer's collectives split, the output layout."""
    mesh, ndim = x.device_mesh, x.ndim
    if kind == "colwise":
        dim = _shard_dim(x.placements[0], ndim)
        if dim == ndim - 1:  # a feature-sharded input cannot feed a column-parallel GEMM
            dim = None
        if dim is None and not x.placements[0].is_replicate():
            x = x.redistribute(mesh, [Replicate()])
        out_placement: Placement = Shard(ndim - 1)
    else:
        if _shard_dim(x.placements[0], ndim) != ndim - 1:
            x = x.redistribute(mesh, [Shard(ndim - 1)])
        out_placement = getattr(layer, "_fp8_tensor_parallel", _DEFAULT_SETTINGS).output_layout
        if not (out_placement.is_replicate() or isinstance(out_placement, Shard)):
            raise ValueError(f"FP8RowwiseParallel output_layouts={out_placement}: use Replicate() or Shard(dim)")
        dim = _shard_dim(out_placement, ndim)
    if dim is not None:
        size = x.shape[dim] if dim != ndim - 1 else layer.out_features
        _check_even(size, mesh.size(), f"dimension {dim} of the {'input' if kind == 'colwise' else 'output'}")
    return x, dim, out_placement


def dtensor_forward(layer: FP8Linear, x: torch.Tensor) -> DTensor:
    """``FP8Linear.forward`` when its weight is a DTensor shard (tensor parallelism): FP8 GEMMs on local shards.

    Column-parallel weight (``Shard(0)``): the input is replicated, or sharded on a dimension other than the
    features (sequence parallel: gathered here, in FP8); the output is sharded on its last dimension. Row-parallel
    weight (``Shard(1)``): the input is sharded on its last dimension; the output is reduced into the layout the
    style asked for (replicated by default). A plain-tensor input is taken as this rank's part of that default
    input layout.

    Returns:
        A DTensor; the parallel style's output hook turns it into the layout (and local tensor) the user asked for.
    """
    weight = layer.weight
    kind, mesh = _kind(weight), weight.device_mesh
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate() if kind == "colwise" else Shard(-1)], run_check=False)
    check_input(layer, x, weight)  # global shape, dtype and device
    for state in layer.fp8_scaling.values():  # torch's own styles (distribute_module) made them DTensors
        localize_buffers(state)
    x, dim, out_placement = _layouts(layer, x, kind)
    fp8 = layer.fp8_scaling
    current = current_flags(fp8, by_value=False)
    fp8_comm = getattr(layer, "_fp8_tensor_parallel", _DEFAULT_SETTINGS).fp8_comm
    comm = Comm(kind, mesh.get_group(), dim, fp8_comm, layer.recipe.backward_dtype)
    out_dtype = output_dtype(x)
    master_scale = master.forward_master_scale(weight, "FP8Linear (tensor parallel)")
    bias = layer.bias
    if bias is not None and kind == "rowwise" and dim == x.ndim - 1:
        # Rowwise bias is replicated; a feature-sharded output takes this rank's slice of it (a local chunk, no
        # communication), whose gradient the backward all-gathers into the replicated bias's.
        bias = bias.redistribute(mesh, [Shard(0)]).to_local()
    elif bias is not None:
        # With a sequence-sharded output, each rank's bias gradient sums its rows only: a partial sum.
        bias = bias.to_local(grad_placements=[Partial()] if kind == "rowwise" and dim is not None else None)
    x_local = x.to_local()
    call = forward_call(fp8["input"])
    y, x_amax = TPLinearFn.apply(x_local, weight.to_local(), bias, fp8, comm, out_dtype, current, master_scale, call)
    if torch.compiler.is_compiling():
        # Traced: a cast of a non-empty tensor counts (the trace decides the path), grad_output's too (see note_casts).
        note_casts(fp8, x_local, y, by_value=False)
    elif x_local.numel():
        if not call[1]:  # a recompute records nothing
            _note_first_cast(fp8["input"], x_amax, x_local.numel())
        fp8["weight"].note_cast(x_local.numel(), by_value=False)  # current scaling every time
    return DTensor.from_local(y, mesh, [out_placement], run_check=False)
