"""Tensor and sequence parallelism for FP8Linear: its parallel styles and a Megatron-style plan.

:class:`~lightning_fp8.FP8Linear` works under ``torch.distributed.tensor.parallel``: when its weight is a DTensor
shard, its forward runs the FP8 GEMMs on local shards (``dtensor_forward`` and the collectives around the GEMMs,
in :mod:`~lightning_fp8.distributed.tensor_parallel_linear`). :class:`FP8ColwiseParallel` and
:class:`FP8RowwiseParallel` are the ``ColwiseParallel`` / ``RowwiseParallel`` of FP8 layers; with sequence
parallelism their activation all-gathers and gradient reduce-scatters carry FP8 (1 byte per element).
:func:`apply_fp8_tensor_parallel` applies the Megatron plan to every transformer block of a model::

    convert_to_fp8(model)
    apply_fp8_tensor_parallel(model, mesh["tp"], plan="gpt", sequence_parallel=True)
    fully_shard(...)  # optional: data parallel on mesh["dp"] (2-D)

or, with Lightning's ``ModelParallelStrategy``, call it in the ``parallelize_fn`` / ``configure_model``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import (
    DeviceMesh,
    DTensor,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Placement
from typing_extensions import override

from lightning_fp8.distributed.amax_sync import enable_fp8_amax_sync
from lightning_fp8.distributed.tensor_parallel_linear import _check_even, _LayerSettings, _shard_dim
from lightning_fp8.distributed.tensor_parallel_linear import dtensor_forward as dtensor_forward  # re-exported
from lightning_fp8.distributed.tensor_parallel_plan import GPT_PLAN as GPT_PLAN  # re-exported
from lightning_fp8.distributed.tensor_parallel_plan import LLAMA_PLAN as LLAMA_PLAN  # re-exported
from lightning_fp8.distributed.tensor_parallel_plan import PLANS as PLANS  # re-exported
from lightning_fp8.distributed.tensor_parallel_plan import check_arguments, find_blocks, resolve_plan
from lightning_fp8.linear import FP8Linear
from lightning_fp8.optim import master
from lightning_fp8.recipe import check_flag
from lightning_fp8.warnings import warn_once


# -------------------------------------------------------------------------------------------- parallel styles
def _parallelize(
    module: FP8Linear,
    mesh: DeviceMesh,
    *,
    weight: Placement,
    bias: Placement,
    input_layout: Placement,
    output_layout: Placement,
    use_local_output: bool,
) -> None:
    # Not distribute_module: it would turn the scaling buffers into replicated DTensors, but they are per rank.
    for name, placement in (("weight", weight), ("bias", bias)):
        param = getattr(module, name)
        if param is not None and not isinstance(param, DTensor):
            dist_param = nn.Parameter(distribute_tensor(param, mesh, [placement]), requires_grad=param.requires_grad)
            if master.is_fp8_weight(param):  # FP8AdamW recognises FP8 weights by this marker
                setattr(dist_param, master.MARKER, True)
            module.register_parameter(name, dist_param)
    module.register_forward_pre_hook(lambda mod, inputs: _annotate_input(input_layout, inputs, mesh))
    module.register_forward_hook(lambda mod, inputs, y: _to_output_layout(output_layout, use_local_output, y, mesh))


def _annotate_input(layout: Placement, inputs: tuple, mesh: DeviceMesh) -> tuple:
    x, *rest = inputs
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [layout], run_check=False)
    return (x, *rest)  # the layer's forward gathers or redistributes what it must


def _to_output_layout(layout: Placement, use_local_output: bool, y: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    ndim = y.ndim
    if y.placements[0] != layout and not (
        isinstance(layout, Shard) and _shard_dim(y.placements[0], ndim) == _shard_dim(layout, ndim)
    ):
        y = y.redistribute(mesh, [layout])
    return y.to_local() if use_local_output else y


class _FP8Style:
    """The constructor both FP8 styles share: torch's style arguments plus ``fp8_comm``."""

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
        fp8_comm: bool = True,
    ) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        # A truthy string such as "no" would otherwise switch the FP8 collectives on.
        self.fp8_comm = check_flag(type(self).__name__, "fp8_comm", fp8_comm)

    def _check_mesh(self, device_mesh: DeviceMesh) -> None:
        """Raise ValueError for a mesh of several dimensions, before the layer changes (torch's styles failed deep
        inside, "placements must have the same length as device_mesh.ndim", through ``parallelize_module``)."""
        if device_mesh.ndim != 1:
            raise ValueError(
                f"{type(self).__name__}: tensor parallelism runs on a 1-D mesh, got the {device_mesh.ndim}-D mesh "
                f"{device_mesh}: pass its tensor-parallel sub-mesh (e.g. mesh['tp'])"
            )


class FP8ColwiseParallel(_FP8Style, ColwiseParallel):
    """``ColwiseParallel`` for :class:`~lightning_fp8.FP8Linear`: weight ``Shard(0)``, FP8 GEMMs on the shard.

    With ``input_layouts=Shard(seq_dim)`` (sequence parallel) the input shard is cast to FP8 and all-gathered as
    1 byte per element; the gathered copy is the GEMM operand, and the input gradient is reduce-scattered in FP8.
    A plain ``nn.Linear`` or ``nn.Embedding`` (e.g. a layer that stayed in high precision) is parallelized exactly
    as ``ColwiseParallel`` does.

    Args:
        input_layouts, output_layouts, use_local_output: as ``ColwiseParallel``.
        fp8_comm: move FP8 (True) or the activation dtype (False, the baseline) in the sequence-parallel
            all-gather and reduce-scatter.
    """

    def check(self, module: nn.Module, world: int) -> None:
        """Raise what :meth:`_apply` would raise for ``module`` over ``world`` ranks, changing nothing."""
        if isinstance(module, FP8Linear):
            _check_not_parallel(module, "FP8ColwiseParallel")
            _check_shard(module, module.out_features, world, "FP8ColwiseParallel", "output")

    @override
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._check_mesh(device_mesh)
        if not isinstance(module, FP8Linear):
            return super()._apply(module, device_mesh)
        self.check(module, device_mesh.size())
        module._fp8_tensor_parallel = _LayerSettings(fp8_comm=self.fp8_comm)
        _parallelize(
            module,
            device_mesh,
            weight=Shard(0),
            bias=Shard(0),
            input_layout=self.input_layouts[0],
            output_layout=self.output_layouts[0],
            use_local_output=self.use_local_output,
        )
        return module


class FP8RowwiseParallel(_FP8Style, RowwiseParallel):
    """``RowwiseParallel`` for :class:`~lightning_fp8.FP8Linear`: weight ``Shard(1)``, bias replicated.

    The layer reduces its partial sums itself: all-reduce for a replicated output, reduce-scatter (activation
    dtype) for ``output_layouts=Shard(seq_dim)``, whose backward all-gathers the output gradient as FP8 that the
    dgrad and wgrad GEMMs consume directly. ``Shard(-1)`` (the output features) works the same way, each rank adding
    its slice of the bias. A plain ``nn.Linear`` or ``nn.Embedding`` is parallelized exactly as ``RowwiseParallel``
    does.

    Args:
        input_layouts, output_layouts, use_local_output: as ``RowwiseParallel``.
        fp8_comm: move FP8 (True) or the activation dtype (False) in the backward all-gather.
    """

    def check(self, module: nn.Module, world: int) -> None:
        """Raise what :meth:`_apply` would raise for ``module`` over ``world`` ranks, changing nothing."""
        if isinstance(module, FP8Linear):
            _check_not_parallel(module, "FP8RowwiseParallel")
            # The input features per rank are the N of both backward GEMMs (dgrad's output, wgrad's columns).
            _check_shard(module, module.in_features, world, "FP8RowwiseParallel", "input")

    @override
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._check_mesh(device_mesh)
        if not isinstance(module, FP8Linear):
            return super()._apply(module, device_mesh)
        self.check(module, device_mesh.size())
        module._fp8_tensor_parallel = _LayerSettings(fp8_comm=self.fp8_comm, output_layout=self.output_layouts[0])
        _parallelize(
            module,
            device_mesh,
            weight=Shard(1),
            bias=Replicate(),
            input_layout=self.input_layouts[0],
            output_layout=self.output_layouts[0],
            use_local_output=self.use_local_output,
        )
        return module


def _check_not_parallel(module: FP8Linear, style: str) -> None:
    """Raise ValueError if ``module`` is parallelized already: a second style would add its layout hooks to the
    first's (every later forward then fails on the first hook's local output)."""
    if isinstance(module.weight, DTensor):
        raise ValueError(
            f"{style}: this FP8Linear is parallelized already (its weight is a DTensor with placements "
            f"{tuple(module.weight.placements)}); apply one parallel style per layer, once, to the unsharded model"
        )


def _check_shard(module: FP8Linear, features: int, world: int, style: str, kind: str) -> None:
    """Raise ValueError unless ``features`` split evenly over ``world`` ranks into multiples of 16 (FP8 GEMMs need
    them: on a GPU a shard of 24 features fails in the backward's ``torch._scaled_mm``, on a CPU it would run)."""
    layer = f"FP8Linear(in_features={module.in_features}, out_features={module.out_features})"
    _check_even(features, world, f"{kind}_features of {layer}")
    if (features // world) % 16:
        raise ValueError(
            f"{style} over {world} ranks gives {layer} {features // world} {kind} features per rank; FP8 GEMMs need "
            "a multiple of 16: use fewer ranks or keep this layer in high precision"
        )


def _style(role: str, sequence_parallel: bool, seq_dim: int, fp8_comm: bool) -> ParallelStyle | None:
    seq = Shard(seq_dim)
    if role == "norm":  # without sequence parallelism norms run replicated: nothing to do
        return SequenceParallel(sequence_dim=seq_dim) if sequence_parallel else None
    if role == "colwise":
        return FP8ColwiseParallel(input_layouts=seq if sequence_parallel else Replicate(), fp8_comm=fp8_comm)
    return FP8RowwiseParallel(output_layouts=seq if sequence_parallel else Replicate(), fp8_comm=fp8_comm)


def _split_sequence_before(block: nn.Module, mesh: DeviceMesh, seq_dim: int) -> None:
    # The model outside the blocks runs replicated; the first block takes this rank's slice of the sequence
    # (backward: all-gather of the gradient).
    def hook(_module: nn.Module, args: tuple) -> tuple:
        if not args or not isinstance(args[0], torch.Tensor):
            raise TypeError(
                f"{type(block).__name__} must receive the hidden states as its first positional argument "
                "for sequence parallelism (apply_fp8_tensor_parallel)"
            )
        _check_sequence_length(args[0], mesh.size(), seq_dim, type(block).__name__)
        x = DTensor.from_local(args[0], mesh, [Replicate()], run_check=False)
        return (x.redistribute(mesh, [Shard(seq_dim)]).to_local(), *args[1:])

    block.register_forward_pre_hook(hook)


def _check_sequence_length(x: torch.Tensor, tp_size: int, seq_dim: int, block: str) -> None:
    # The hidden states are replicated here, the same shape on every rank: every rank raises, before any collective.
    # Uneven shards would reach the FP8 all-gathers (equal chunks per rank) and hang or abort the process group.
    if not -x.dim() <= seq_dim < x.dim():
        raise ValueError(
            f"apply_fp8_tensor_parallel(seq_dim={seq_dim}): the hidden states entering {block} have shape "
            f"{tuple(x.shape)}, without a dim {seq_dim}; pass the sequence dimension of the hidden states"
        )
    length = x.shape[seq_dim]
    if length % tp_size:
        raise ValueError(
            f"apply_fp8_tensor_parallel(sequence_parallel=True): the hidden states entering {block} have shape "
            f"{tuple(x.shape)}, a sequence length (dim {seq_dim}) of {length}, which does not split evenly over the "
            f"{tp_size} tensor-parallel ranks; pad the sequence to a multiple of {tp_size} "
            f"(e.g. {-(-length // tp_size) * tp_size}), or use sequence_parallel=False"
        )


def _gather_sequence_after(block: nn.Module, mesh: DeviceMesh, seq_dim: int) -> None:
    def hook(_module: nn.Module, _args: tuple, out):
        first = out[0] if isinstance(out, tuple) else out
        full = DTensor.from_local(first, mesh, [Shard(seq_dim)], run_check=False).redistribute(mesh, [Replicate()])
        # to_local() returns a view, which FSDP2 warns about (an in-place op on it would skip its backward hook).
        full = full.to_local().clone()
        return (full, *out[1:]) if isinstance(out, tuple) else full

    block.register_forward_hook(hook)


def _warn_about_dropout(module: nn.Module, blocks: list[str]) -> None:
    # The blocks compute on plain local tensors: ranks seeded alike draw the same dropout masks for different tokens
    # (sequence shards) or heads (head-split attention), silently.
    names = sorted({f"{block}.{name}".strip(".") for block in blocks
                    for name, m in module.get_submodule(block).named_modules()
                    if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0})  # fmt: skip
    if names:
        listed = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        warn_once(
            f"apply_fp8_tensor_parallel: dropout in the blocks ({listed}) draws the same masks on every "
            "tensor-parallel rank seeded alike: with sequence parallelism they repeat across the sequence shards, in "
            "the head-split attention across heads. Use dropout 0 in the blocks (as large-model pretraining usually "
            "does), or seed the sharded regions per rank yourself"
        )


def apply_fp8_tensor_parallel(
    module: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    plan: str | Mapping[str, str] = "gpt",
    sequence_parallel: bool = True,
    seq_dim: int = 1,
    fp8_comm: bool = True,
    amax_sync: bool = True,
    amax_sync_group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Shard every transformer block of ``module`` Megatron-style over ``tp_mesh``, with FP8 activation comm.

    In each block (any submodule that contains every name of ``plan``, ``module`` itself included) the attention
    and MLP input projections become column-parallel and their output projections row-parallel; with
    ``sequence_parallel`` the norms run on sequence shards and activations between blocks stay sharded, the
    first block splitting the sequence and the last gathering it, so ``module``'s inputs and outputs keep their
    layout and the layers outside the blocks (embeddings, head) run replicated. Call it after
    :func:`~lightning_fp8.convert_to_fp8` and before building the optimizer (parameters become DTensors).

    The attention code must use the local number of heads (``qkv.shape[-1] // (3 * head_dim)``), as with any
    tensor parallelism.

    The FP8 scaling state stays per rank (each rank records the amaxes of its own shards; the amax sync makes the
    delayed scales identical before each forward). Before a ``torch.distributed.checkpoint`` save of
    :func:`~lightning_fp8.fp8_state_dict`, whose plain tensors DCP writes once, call
    :func:`~lightning_fp8.distributed.amax_sync.sync_fp8_amax` on every rank, or the resumed run is not bit for bit the
    uninterrupted one (docs/guides/checkpoints.md, "Sharded checkpoints").

    Args:
        module: a model or a single block, on the device of ``tp_mesh``, initialized identically on every rank.
        tp_mesh: the 1-D tensor-parallel mesh (``mesh["tp"]`` of a 2-D data x tensor mesh).
        plan: ``"gpt"`` (:data:`GPT_PLAN`), ``"llama"`` (:data:`LLAMA_PLAN`) or a mapping from submodule name
            inside a block to ``"colwise"``, ``"rowwise"`` or ``"norm"``.
        sequence_parallel: shard activations between the projections on ``seq_dim`` (Megatron-SP). The sequence
            length must then be a multiple of the tensor-parallel size: the first block's forward raises a
            ``ValueError`` on every rank otherwise (pad the sequence).
        seq_dim: the sequence dimension of the hidden states (1 for ``(batch, seq, features)``).
        fp8_comm: FP8 in the sequence-parallel all-gathers and reduce-scatters (False: activation dtype).
        amax_sync: sync the delayed-scaling amaxes of ``module`` once per forward in one collective
            (:func:`~lightning_fp8.distributed.amax_sync.enable_fp8_amax_sync`); skipped on a single rank.
        amax_sync_group: the ranks that must agree on scales; default: the whole world (data x tensor parallel).
            A group without the tensor-parallel ranks (e.g. ``mesh["dp"].get_group()``) stays correct, but the
            layers that gather FP8 then sync their amaxes over ``tp_mesh`` themselves: one more small collective per
            such layer and step.

    Returns:
        ``module``, parallelized in place.

    Raises:
        ValueError: a mesh that is not 1-D, an unknown plan, no block matching it, or a model parallelized already.
        TypeError: a plan whose ``colwise`` or ``rowwise`` entries name something other than ``nn.Linear`` or
            ``nn.Embedding`` in every submodule that has all its names.
    """
    flags = {"sequence_parallel": sequence_parallel, "fp8_comm": fp8_comm, "amax_sync": amax_sync}
    check_arguments(module, tp_mesh, flags, seq_dim, amax_sync_group)
    roles = resolve_plan(plan)
    blocks = find_blocks(module, roles)
    _warn_about_dropout(module, blocks)
    styles = {}
    for block in blocks:
        for name, role in roles.items():
            style = _style(role, sequence_parallel, seq_dim, fp8_comm)
            if style is not None:
                styles[f"{block}.{name}" if block else name] = style
    for name, style in styles.items():  # before any layer changes: a second application would stack the styles' hooks
        target = module.get_submodule(name)
        if isinstance(getattr(target, "weight", None), DTensor):
            raise ValueError(
                f"apply_fp8_tensor_parallel: {name!r} is parallelized already (its weight is a DTensor); apply it "
                "once, to the unsharded model"
            )
        if hasattr(style, "check"):  # an FP8 layer's shard sizes, checked for every layer before the first changes
            style.check(target, tp_mesh.size())
    parallelize_module(module, tp_mesh, styles)
    if sequence_parallel:
        _split_sequence_before(module.get_submodule(blocks[0]), tp_mesh, seq_dim)
        _gather_sequence_after(module.get_submodule(blocks[-1]), tp_mesh, seq_dim)
    if amax_sync and dist.get_world_size() > 1:
        enable_fp8_amax_sync(module, amax_sync_group)
    return module
