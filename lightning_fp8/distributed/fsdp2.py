"""FSDP2 (``fully_shard``): FP8 gradient reduce-scatter and FP8 weight all-gather through FSDP2's comm hooks.

::

    from lightning_fp8.distributed import enable_fp8_fsdp2

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = enable_fp8_fsdp2(model)      # before the first forward

- **Gradients**: :class:`FP8ReduceScatter` replaces each FSDP module's reduce-scatter
  (``FSDPModule.set_custom_reduce_scatter``): one MAX all-reduce of the per-parameter amaxes, the FP8 bytes of
  every shard to its owner by an all-to-all, and an fp32 sum there (:func:`~.comm.reduce_scatter_fp8`). FSDP
  itself divides by the world size (``set_force_sum_reduction_for_comms``).
- **Weights**: :class:`FP8WeightAllGather` replaces the all-gather (``set_custom_all_gather``). The weight of
  every :class:`~lightning_fp8.FP8Linear` travels as E4M3 bytes with a whole-tensor scale from its global amax
  (one MAX all-reduce for all weights of the module, so every rank already holds the scale of every rank's
  bytes: no scale travels); other parameters (biases, norms, embeddings) travel in their own dtype in the
  same collective. Each rank decodes the gathered bytes into the unsharded weight, whose values then lie on the FP8
  grid of that scale: the forward's own weight cast (FP8Linear, current scaling) reproduces the same FP8 values
  without any further communication.

Both hooks work on the module's flat buffers and need each parameter's place in them; they read it from
FSDP2's parameter group (``FSDPParam.padded_sharded_param_size``). Where that does not match the buffer, the
all-gather falls back to FSDP's default, with a warning. So does the reduce-scatter where FSDP leaves out the
gradients of parameters that got none in the backward (an unused submodule; unless
``set_reduce_scatter_unused_params(True)``, which sends zeros for them): with ``fp8_params`` naming some of the
module's parameters it reduces all its gradients in their own dtype (those outside ``fp8_params`` must not go
through FP8), else through FP8 with one scale per block.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from lightning_fp8.distributed.comm import CastStats, all_reduce_max, cast_stats, local_amax, reduce_scatter_fp8
from lightning_fp8.distributed.comm_state import FP8CommState, check_state
from lightning_fp8.distributed.comm_state_checks import empty_fp8_params_message, refuse_layer_swaps
from lightning_fp8.distributed.layout import SegmentLayout
from lightning_fp8.distributed.quantize import segment_kernels
from lightning_fp8.formats import E4M3
from lightning_fp8.kernels.comm_table import BlockTable, block_table
from lightning_fp8.linear import FP8Linear
from lightning_fp8.optim import master
from lightning_fp8.recipe import check_flag
from lightning_fp8.warnings import warn_once

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

try:  # the Comm interfaces are importable from here in torch 2.8+ (not re-exported publicly)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - older torch: duck-typed
    AllGather = ReduceScatter = object  # type: ignore[misc,assignment]

_FALLBACK_BLOCK = 1 << 16


def _param_groups(module: nn.Module) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.12: at most one group
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def _shard_numel(fsdp_param) -> int:
    return fsdp_param.padded_sharded_param_size.numel()


class FP8ReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter of gradients through FP8 (sum; FSDP divides by the world size).

    Gradients outside ``state.fp8_params`` are reduce-scattered in their own dtype; their non-finite check rides
    on the FP8 gradients' amax all-reduce (or, in a module without FP8 gradients, on a MAX all-reduce of one
    value), so every rank of the shard group agrees on the step.

    Args:
        state: the communication state (dtype, margin, grad scaler, ``fp8_params``, step flag).
        param_group: the FSDP parameter group whose gradients this comm reduces.
        replicate_group: HSDP only: the group FSDP all-reduces the reduced shards over afterwards, in their own
            dtype and outside this comm; the step's non-finite flag is MAX-reduced over it as well (one value),
            so that every rank of the mesh agrees.
        fp8: False: every gradient in its own dtype (``enable_fp8_fsdp2(reduce_scatter=False)``), still checked
            for non-finite values into ``state``.
    """

    def __init__(
        self, state: FP8CommState, param_group, replicate_group: dist.ProcessGroup | None = None, *, fp8: bool = True
    ) -> None:
        self.state = state
        self.param_group = param_group
        self.replicate_group = replicate_group
        self.fp8 = fp8

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        world = group.size()
        if op == dist.ReduceOp.AVG:
            divide = float(world)
        elif op == dist.ReduceOp.SUM:
            divide = 1.0
        else:
            raise NotImplementedError(
                f"FP8ReduceScatter got reduce op {op}; it implements SUM and AVG. Keep "
                "set_force_sum_reduction_for_comms(True) (enable_fp8_fsdp2 sets it) so FSDP divides itself"
            )
        chunk = output_tensor.numel()
        params = [p for p in self.param_group.fsdp_params if p.sharded_param.requires_grad]
        columns = [_shard_numel(p) for p in params]
        fp8 = [self.fp8 and self.state.is_fp8(p.sharded_param) for p in params]
        out = output_tensor.view(-1)
        if not any(fp8):  # e.g. the root unit of a transformer (embeddings, final norm, head), or fp8=False
            stats = _reduce_scatter_high_precision(out, input_tensor.view(-1), group, divide)
        elif sum(columns) != chunk:  # FSDP left out the gradients of parameters that got none: which, is not known
            if all(fp8):  # every gradient of the module travels in FP8 anyway
                self._warn_unplaced(chunk, f"sent through FP8 with one scale per block of {_FALLBACK_BLOCK} elements")
                layout = SegmentLayout.blocks(world * chunk, _FALLBACK_BLOCK)
                _, stats = self._fp8(input_tensor.view(-1), layout, group, out, divide)
            else:  # never quantize the gradients fp8_params leaves out ("reduced in their own dtype")
                self._warn_unplaced(chunk, "reduce-scattered in their own dtype, the FP8Linear weights' too")
                stats = _reduce_scatter_high_precision(out, input_tensor.view(-1), group, divide)
        elif all(fp8):
            _, stats = self._fp8(input_tensor.view(-1), SegmentLayout.rows(world, columns), group, out, divide)
        else:
            stats = self._mixed(out, input_tensor.view(world, chunk), columns, fp8, group, divide)
        self._record(stats)
        return None

    def _warn_unplaced(self, chunk: int, instead: str) -> None:
        from torch.distributed.fsdp import FSDPModule

        fqn = getattr(self.param_group, "_module_fqn", None)  # "" for the root module
        module = "" if fqn is None else f" ({fqn or 'the root module'})"
        # Not set by enable_fp8_fsdp2: FSDP then gives such parameters zero gradients instead of None, which an
        # optimizer does not skip (weight decay and momentum move them), unlike plain FSDP2.
        flag = hasattr(FSDPModule, "set_reduce_scatter_unused_params")
        fix = (
            "call model.set_reduce_scatter_unused_params(True) (such parameters then get zero gradients instead "
            "of None: weight decay and momentum still move them), or "
            if flag
            else ""
        )
        warn_once(
            f"FP8ReduceScatter{module}: some parameters of this FSDP module got no gradient in the backward (an "
            f"unused submodule?), and FSDP left them out of the reduce-scatter buffer ({chunk} elements per rank), so "
            f"the place of each gradient in it is not known: this module's gradients are {instead}, not each with "
            f"its own FP8 scale. To keep the FP8 reduce-scatter, {fix}call requires_grad_(False) on the parameters "
            "that take no part in training"
        )

    def _fp8(self, flat: torch.Tensor, layout: SegmentLayout, group, out, divide: float,
             other_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, CastStats]:  # fmt: skip
        state = self.state
        return reduce_scatter_fp8(
            flat, layout, group, state.fp8_dtype, margin=state.margin, fused=state.use_fused(flat.device),
            slices=state.slices(flat.numel()), out=out, divisor=divide, other_amax=other_amax,
        )  # fmt: skip

    def _mixed(self, out, rows, columns, fp8, group, divide) -> CastStats:
        # FP8 columns go through FP8; the others through one reduce-scatter in their own dtype, their local amax
        # riding on the FP8 columns' amax all-reduce.
        world = rows.shape[0]
        starts = [sum(columns[:i]) for i in range(len(columns))]
        blocks = [rows[:, s : s + n] for s, n in zip(starts, columns, strict=True)]
        fp8_blocks = [b for b, m in zip(blocks, fp8, strict=True) if m]
        other_blocks = [b for b, m in zip(blocks, fp8, strict=True) if not m]
        fp8_cols = [b.shape[1] for b in fp8_blocks]
        other_cols = [b.shape[1] for b in other_blocks]
        other_in = torch.cat(other_blocks, dim=1).reshape(-1)
        fp8_in = torch.cat(fp8_blocks, dim=1).reshape(-1)
        layout = SegmentLayout.rows(world, fp8_cols)
        fp8_out, stats = self._fp8(fp8_in, layout, group, None, divide, other_amax=local_amax(other_in))
        other_out = other_in.new_empty(sum(other_cols))
        _reduce_scatter(other_out, other_in, group)
        other_out.div_(divide)
        fp8_parts = iter(fp8_out.split(fp8_cols))
        other_parts = iter(other_out.split(other_cols))
        for s, n, m in zip(starts, columns, fp8, strict=True):
            out[s : s + n].copy_(next(fp8_parts) if m else next(other_parts))
        return stats

    def _record(self, stats: CastStats) -> None:
        if self.replicate_group is not None:
            found = stats.found_nonfinite.float()  # MAX all-reduce: any replica's flag
            all_reduce_max(found, self.replicate_group)
            stats = replace(stats, found_nonfinite=found > 0)
        self.state.record(stats)


def _reduce_scatter_high_precision(out: torch.Tensor, flat: torch.Tensor, group, divide: float) -> CastStats:
    # Each rank receives a different shard, so a local check of the result would not agree across ranks: the
    # flag travels in a MAX all-reduce of this rank's amax instead (one value, beside the data).
    amax = local_amax(flat)
    all_reduce_max(amax, group)
    _reduce_scatter(out, flat, group)
    out.div_(divide)
    return cast_stats(amax, torch.zeros((), dtype=torch.int64, device=flat.device), 0)


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None)
    if fn is not None:
        fn(output=output, input=input, group=group)
    else:
        dist.reduce_scatter_tensor(output, input, group=group)


class FP8WeightAllGather(AllGather):
    """FSDP2 all-gather that sends FP8Linear weights as E4M3 bytes with a whole-tensor scale beside them.

    Args:
        param_group: the FSDP parameter group this comm gathers.
        fp8_weights: ``{id(sharded weight): margin}`` of the FP8Linear weights (the margin of the layer's weight
            role, so the gathered weight's scale is the one the layer's own weight cast computes).
        fused: run the Triton cast and decode kernels (``kernels/comm.py``) instead of their references.
    """

    def __init__(self, param_group, fp8_weights: dict[int, int], fused: bool = False) -> None:
        self.param_group = param_group
        self.fp8_weights = fp8_weights
        self.fused = fused
        self._plans: dict = {}

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        params = self.param_group.fsdp_params
        numels = [_shard_numel(p) for p in params]
        if input_tensor.dtype == torch.uint8 or sum(numels) != input_tensor.numel():
            warn_once(
                "FP8WeightAllGather: the all-gather buffer does not hold one padded shard per parameter in one "
                "floating-point dtype; gathering this module in its own dtype instead"
            )
            return _all_gather(output_tensor, input_tensor, group)
        margins = [self.fp8_weights.get(id(p.sharded_param)) for p in params]
        with torch.no_grad():
            self._gather(output_tensor, input_tensor, group, numels, margins)
        return None

    def _gather(self, output, shard, group, numels, margins) -> None:
        # Sent by each rank: every parameter's shard, E4M3 bytes for FP8 weights and its own bytes otherwise. The
        # scales come from the global amax (one MAX all-reduce of the shards' amaxes), so every rank already holds
        # the scale of every rank's bytes: one launch casts all FP8 weights, one decodes all of them.
        world = group.size()
        plan = self._plan(numels, margins, world, shard)
        kernels = segment_kernels(self.fused)
        amax = torch.zeros(plan.num_fp8, dtype=torch.float32, device=shard.device)
        kernels.segment_amax(shard, plan.amax, amax)
        all_reduce_max(amax, group)
        send = torch.empty(plan.send_bytes, dtype=torch.uint8, device=shard.device)
        n_sat = torch.zeros((), dtype=torch.int64, device=shard.device)  # weights: rounding only, nothing to report
        for margin, table in plan.quantize:
            kernels.quantize(shard, table, amax, E4M3, send, n_sat, margin=margin)
        for start, n, offset in plan.copies:
            send[offset : offset + n * shard.element_size()].copy_(shard[start : start + n].view(torch.uint8))
        gathered = torch.empty(world * plan.send_bytes, dtype=torch.uint8, device=shard.device)
        _all_gather(gathered, send, group)
        for margin, table in plan.decode:
            kernels.dequantize(gathered, table, amax, E4M3, output.view(-1), margin=margin)
        rows_in, rows_out = gathered.view(world, -1), output.view(world, -1)
        for start, n, offset in plan.copies:
            width = n * shard.element_size()
            rows_out[:, start : start + n].view(torch.uint8).copy_(rows_in[:, offset : offset + width])

    def _plan(self, numels, margins, world, shard) -> _GatherPlan:
        key = (tuple(numels), tuple(margins), world, shard.device, shard.dtype)
        if self._plans.get("key") != key:
            self._plans = {"key": key, "plan": _gather_plan(numels, margins, world, shard)}
        return self._plans["plan"]


@dataclass(frozen=True)
class _GatherPlan:
    num_fp8: int
    send_bytes: int
    amax: BlockTable  # each FP8 weight's shard -> its amax slot
    quantize: list[tuple[int, BlockTable]]  # per margin: shard -> send bytes
    decode: list[tuple[int, BlockTable]]  # per margin: every rank's bytes -> the unsharded output
    copies: list[tuple[int, int, int]]  # other parameters: (start in the shard, elements, byte offset in send)


def _gather_plan(numels, margins, world, shard) -> _GatherPlan:
    starts = [sum(numels[:i]) for i in range(len(numels))]
    total = sum(numels)
    offsets, offset, copies, fp8 = [], 0, [], []
    for i, (start, n) in enumerate(zip(starts, numels, strict=True)):
        offsets.append(offset)
        if margins[i] is None:
            copies.append((start, n, offset))
            offset += n * shard.element_size()
        else:
            fp8.append(i)
            offset += n
    slot = {i: k for k, i in enumerate(fp8)}
    dev = shard.device

    def table(entries):
        columns = list(zip(*entries, strict=True)) if entries else [(), (), (), ()]
        return block_table(*columns, device=dev)

    quantize, decode = [], []
    for margin in sorted({margins[i] for i in fp8}):
        mine = [i for i in fp8 if margins[i] == margin]
        quantize.append((margin, table([(starts[i], offsets[i], numels[i], slot[i]) for i in mine])))
        decode.append((margin, table([(r * offset + offsets[i], r * total + starts[i], numels[i], slot[i])
                                      for r in range(world) for i in mine])))  # fmt: skip
    amax = table([(starts[i], starts[i], numels[i], slot[i]) for i in fp8])
    return _GatherPlan(len(fp8), offset, amax, quantize, decode, copies)


def _all_gather(output: torch.Tensor, input: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input, group=group)


def fp8_linear_weights(model: nn.Module) -> dict[int, int]:
    """``{id(weight): margin}`` of every :class:`~lightning_fp8.FP8Linear` weight in ``model``."""
    return {id(m.weight): int(m.fp8_scaling["weight"].margin) for m in model.modules() if isinstance(m, FP8Linear)}


def mark_fp8_weights(model: nn.Module) -> None:
    """Mark the weights of ``model``'s FP8Linear layers as FP8 weights (:data:`master.MARKER`): ``fully_shard`` put new
    (DTensor) Parameters in their place, without the mark, and an FP8AdamW created without it gives them fp32 states
    (O1's 16 bytes per parameter instead of O2's 6). Call it before creating the optimizer."""
    for module in model.modules():
        if isinstance(module, FP8Linear):
            setattr(module.weight, master.MARKER, True)


def enable_fp8_fsdp2(
    model: nn.Module,
    state: FP8CommState | None = None,
    *,
    reduce_scatter: bool = True,
    weight_all_gather: bool = True,
) -> FP8CommState:
    """Turn on FP8 gradient reduce-scatter and FP8 weight all-gather for every FSDP2 module of ``model``.

    Call after ``fully_shard`` has been applied (to ``model`` and any submodules) and before the first forward
    and before creating :class:`~lightning_fp8.FP8AdamW`: ``fully_shard`` replaces every parameter with a sharded
    one, and this marks the new FP8Linear weights again, so that ``FP8AdamW(model.parameters())`` gives them their
    low-precision states without ``fp8_params``. For the same reason, take ``FP8CommState(fp8_params=...)`` from
    the sharded model.

    Every rank agrees on ``state.check_step()``: with HSDP (a 2-D replicate x shard mesh) the step's flag is also
    reduced over the replicas (one value per module and step); with tensor parallelism (parameters that are DTensors
    over a data x tensor parallel mesh) ``check_step()`` reduces it over that whole mesh (one value per step), so
    every rank of the mesh must call it. Where the shard group has one rank (one process, or HSDP with a shard size
    of 1), FSDP runs no reduce-scatter; the gradients are checked in FSDP's all-reduce hook instead
    (``set_all_reduce_hook``: do not set another one on these modules).

    Args:
        model: a model whose modules were wrapped by ``torch.distributed.fsdp.fully_shard``.
        state: the communication state (default: a new :class:`FP8CommState`). Its ``process_group`` is not
            used here: FSDP passes its own.
        reduce_scatter: reduce-scatter the gradients through FP8. False: in their own dtype, still by
            :class:`FP8ReduceScatter`, which checks them for non-finite values (one MAX all-reduce of one value per
            FSDP module), so that ``state.check_step()`` and the state's grad scaler still see a NaN or inf gradient.
        weight_all_gather: replace the parameter all-gather (FP8Linear weights in E4M3).

    Returns:
        The state: per step, read ``state.check_step()`` or let its grad scaler decide.

    Raises:
        TypeError: if no module of ``model`` was wrapped by ``fully_shard``, ``state`` is not an FP8CommState, or
            ``reduce_scatter`` or ``weight_all_gather`` is not a bool.
        ValueError: if ``state.fp8_params`` holds none of ``model``'s parameters (e.g. taken before ``fully_shard``),
            or if ``state.grad_scaler`` has ``nonfinite_fallback="bf16"``, which cannot swap the layers of a sharded
            model.
        RuntimeError: if this torch's FSDP2 has no custom-collective hooks (torch < 2.8).
    """
    from torch.distributed.fsdp import FSDPModule

    # A truthy string such as "no" would otherwise switch a collective to FP8.
    check_flag("enable_fp8_fsdp2", "reduce_scatter", reduce_scatter)
    check_flag("enable_fp8_fsdp2", "weight_all_gather", weight_all_gather)
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not fsdp_modules:
        raise TypeError(
            f"enable_fp8_fsdp2: no module of {type(model).__name__} was wrapped by fully_shard; call "
            "fully_shard(...) first (for FullyShardedDataParallel, use enable_fp8_fsdp1)"
        )
    if not hasattr(fsdp_modules[0], "set_custom_reduce_scatter"):
        raise RuntimeError(
            f"enable_fp8_fsdp2 needs FSDPModule.set_custom_reduce_scatter / set_custom_all_gather (torch >= 2.8); "
            f"this is torch {torch.__version__}"
        )
    state = state if state is not None else FP8CommState()
    check_state(state, "enable_fp8_fsdp2")
    _check_state(model, state)
    mark_fp8_weights(model)
    weights = fp8_linear_weights(model)
    wider: list[DeviceMesh] = []  # meshes of parameters spread beyond FSDP's groups (tensor parallel)
    for module in fsdp_modules:
        groups = _param_groups(module)
        if not groups:
            continue
        if len(groups) > 1:
            raise ValueError(
                f"enable_fp8_fsdp2: {type(module).__name__} has {len(groups)} FSDP parameter groups (a per-parameter "
                "mesh); FSDP's custom collectives need one group per module"
            )
        # Installed also without FP8 gradients: FSDP's own reduce-scatter would leave state.check_step() blind to
        # non-finite gradients (True on a step whose gradients are NaN on every rank).
        _install_reduce_scatter(module, groups[0], state, fp8=reduce_scatter)
        wider += _mesh_beyond_fsdp(groups[0])
        if weight_all_gather and any(id(p.sharded_param) in weights for p in groups[0].fsdp_params):
            fused = state.use_fused(groups[0].fsdp_params[0].sharded_param.device)
            module.set_custom_all_gather(FP8WeightAllGather(groups[0], weights, fused))
    # Over the widest mesh, or (a state used before on a tensor-parallel model) back to the hooks' groups alone
    state._agree_over_mesh(max(wider, key=lambda mesh: mesh.size()) if wider else None)
    return state


def _mesh_beyond_fsdp(param_group: FSDPParamGroup) -> list[DeviceMesh]:
    """``[mesh]``: the device mesh of the group's parameters where it holds more ranks than FSDP's own (the data
    parallel x tensor parallel mesh of FSDP2 + TP), else ``[]``. FSDP's collectives, and so the non-finite flag
    riding on them, reach only the ranks of FSDP's mesh; the tensor-parallel peers hold other pieces of the same
    gradients and must take the same decision."""
    fsdp_size = param_group.mesh_info.mesh.size()
    for fsdp_param in param_group.fsdp_params:
        mesh = getattr(fsdp_param.sharded_param, "device_mesh", None)  # a DTensor over FSDP's mesh, or FSDP + TP's
        if mesh is not None and mesh.size() > fsdp_size:
            return [mesh]
    return []


def _check_state(model: nn.Module, state: FP8CommState) -> None:
    # Both checked before anything is changed.
    if state.leaves_out_fp8_weights(any(isinstance(m, FP8Linear) for m in model.modules())):
        warn_once(empty_fp8_params_message("enable_fp8_fsdp2"))
    if not state.names_fp8_params(model.parameters()):
        raise ValueError(
            f"enable_fp8_fsdp2: none of the {len(state._fp8_param_ids)} tensors in FP8CommState(fp8_params=...) is a "
            f"parameter of {type(model).__name__}; fully_shard replaces every parameter by a sharded one, so build "
            "the state after fully_shard: FP8CommState(fp8_params=[m.weight for m in model.modules() if "
            "isinstance(m, FP8Linear)])"
        )
    refuse_layer_swaps(state, "enable_fp8_fsdp2", "FSDP2 keeps references to the modules it shards")


def _install_reduce_scatter(module: nn.Module, param_group, state: FP8CommState, fp8: bool) -> None:
    mesh_info = param_group.mesh_info
    if getattr(mesh_info, "shard_mesh_size", 1) == 1:
        # FSDP skips the reduce-scatter of a one-rank shard group, so the comm below would never see a gradient.
        # Its all-reduce hook sees the result instead, the same on every replica (after HSDP's all-reduce, if any):
        # a local check agrees everywhere.
        module.set_all_reduce_hook(state.record_reduced)
    replicate_group = getattr(mesh_info, "replicate_process_group", None)
    module.set_custom_reduce_scatter(FP8ReduceScatter(state, param_group, replicate_group, fp8=fp8))
    if hasattr(module, "set_force_sum_reduction_for_comms"):
        module.set_force_sum_reduction_for_comms(True)
