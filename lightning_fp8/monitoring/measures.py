"""What :class:`~lightning_fp8.health.HealthMonitor` is given to watch, measured: the global L2 norm of gradients or
parameters (:func:`global_norm`, also what gradient clipping uses), memory use (:func:`memory_gib`) and the samples
and tokens of a batch (:func:`count_batch`, :func:`count_tokens`).

The norm reads an O2 master weight of FP8AdamW unscaled, and reduces sharded tensors (DTensors, FSDP1's flat
parameters) over their ranks.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from lightning_fp8.optim.master import master_scale


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


def _unscale_factor(t: torch.Tensor) -> torch.Tensor | None:
    """The scale an O2 master weight's storage carries (FP8AdamW keeps ``weight * scale`` in fp16), else None."""
    scale = master_scale(t)
    if scale is None:
        return None
    return scale.full_tensor() if _is_dtensor(scale) else scale


def _magnitudes(t: torch.Tensor) -> torch.Tensor:
    return t.abs() if t.is_complex() else t


def global_norm(
    tensors: Iterable[torch.Tensor], group: Any | None = None, sharded: bool = False, device: torch.device | None = None
) -> torch.Tensor:
    """L2 norm over all ``tensors`` as a 0-dim fp32 tensor, float64 when one of them is float64 or when ``sharded``
    sums across ranks (inf/NaN if any value is). The squares are summed in that dtype, as
    ``torch.nn.utils.get_total_norm`` returns float64 for float64 tensors: in fp32, a float64 gradient's norm lost its
    precision, and one past about 1.8e19 (whose square passes fp32's range) read inf.

    A parameter whose storage is an O2 master of :class:`~lightning_fp8.FP8AdamW` (it holds ``weight * scale``,
    the power-of-two scale attached to the parameter, see :mod:`lightning_fp8.optim.master`) counts with its
    unscaled value ``weight``, so a parameter norm neither reads ~``scale`` times too large nor jumps when the
    scale changes. Gradients carry no such scale and are taken as they are.

    Args:
        tensors: e.g. ``[p.grad for p in model.parameters() if p.grad is not None]`` or ``model.parameters()``
            (``None`` entries are skipped; a complex tensor counts by its magnitudes).
            DTensors (FSDP2, tensor parallel): each rank sums the squares of its shards, one all-reduce per mesh
            and set of sharded mesh dimensions adds them (every rank must pass the same tensors in the same order).
        group: the process group plain-tensor shards live in (default: the world), used when ``sharded``.
        sharded: each rank holds a different shard of the plain tensors (FSDP1's flat parameters): sum the squares
            across ranks (a collective on every rank, also one that holds none of them). Replicated tensors (DDP,
            single device) must not be reduced.
        device: where the norm is computed when ``tensors`` is empty (default: the CPU; under ``sharded`` with NCCL,
            the rank's GPU).
    """
    if isinstance(tensors, (torch.Tensor, torch.nn.Module)):
        raise TypeError(
            f"global_norm takes an iterable of tensors, got a {type(tensors).__name__}: pass e.g. model.parameters() "
            "or [p.grad for p in model.parameters() if p.grad is not None]"
        )
    plain, distributed = [], []
    for t in tensors:
        if t is None:  # a parameter without a gradient ([p.grad for p in ...] with a frozen one) adds nothing
            continue
        # The scale hangs on the parameter itself: look it up before detach() drops the attribute. A complex tensor
        # counts by its magnitudes (|z|^2), as torch.linalg.vector_norm does.
        (distributed if _is_dtensor(t) else plain).append((_magnitudes(t.detach()), _unscale_factor(t)))
    if plain or distributed:
        device = (plain or distributed)[0][0].device
    dtype = torch.float64 if any(t.dtype == torch.float64 for t, _ in plain + distributed) else torch.float32
    sq = torch.zeros((), dtype=dtype, device=device if device is not None else "cpu")
    for t, scale in plain:
        sq = sq + _divided(t.to(dtype).square().sum(), scale).to(sq.device)
    # Every rank joins the sum, also one without tensors (a rank whose shards of an optimizer's parameters got no
    # gradient): skipping it paired the others' all-reduce with the next collective.
    # The sum travels, and stays, in float64: a rank without float64 tensors (or without tensors at all) picked fp32
    # above while another may hold float64 ones, and both the all-reduce and the result must agree across ranks.
    if sharded and dist.is_available() and dist.is_initialized():
        dtype, sq = torch.float64, sq.double()
        dist.all_reduce(sq, group=group)
    if distributed:
        sq = sq + _dtensor_sum_of_squares(distributed, dtype).to(sq.device)
    return sq.sqrt()


def _divided(t_sq: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return t_sq if scale is None else t_sq / scale.float().square().to(t_sq.device)


def _dtensor_sum_of_squares(
    distributed: list[tuple[torch.Tensor, torch.Tensor | None]], dtype: torch.dtype
) -> torch.Tensor:
    """The squared norms of DTensors summed, in ``dtype``: each rank sums the squares of its local shards per mesh and
    set of sharded mesh dimensions, then one all-reduce per such group and dimension adds the ranks' sums (a replicated
    dimension holds the same values on each rank and is not added), instead of one collective per tensor (an FSDP2
    model's every parameter). A DTensor with a pending reduction (``Partial``) takes DTensor's own norm."""
    groups: dict[tuple[Any, tuple[int, ...]], torch.Tensor] = {}
    total: torch.Tensor | None = None
    for t, scale in distributed:
        if any(p.is_partial() for p in t.placements):
            t_sq = _divided(torch.linalg.vector_norm(t.to(dtype)).full_tensor().square(), scale)
            total = t_sq if total is None else total + t_sq.to(total.device)
            continue
        # Every dimension that does not replicate shards (Shard, and FSDP2's _StridedShard over tensor parallelism,
        # which is no Shard in recent torch): its ranks hold different elements, whose squares add up.
        key = (t.device_mesh, tuple(d for d, p in enumerate(t.placements) if not p.is_replicate()))
        t_sq = _divided(t.to_local().to(dtype).square().sum(), scale)
        groups[key] = t_sq if key not in groups else groups[key] + t_sq.to(groups[key].device)
    for (mesh, dims), t_sq in groups.items():  # the same order on every rank: the tensors' own
        if dims and t_sq.device.type != mesh.device_type:  # CPU-offloaded shards on an NCCL mesh
            t_sq = t_sq.to(mesh.device_type)
        for d in dims:
            dist.all_reduce(t_sq, group=mesh.get_group(d))
        total = t_sq if total is None else total + t_sq.to(total.device)
    return total


def memory_gib(device: torch.device | str) -> dict[str, float]:
    """Memory in GiB: allocated, reserved and peak on a CUDA device; the process's peak RSS on CPU (and on another
    device, whose own memory this does not read).

    Raises:
        RuntimeError: for a CUDA device when CUDA is not available (the process's RSS is not the GPU's memory).
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        # Returned the process's peak RSS as if it were the GPU's, without a word.
        raise RuntimeError(
            f"memory_gib({str(device)!r}): CUDA is not available in this process, so there is no GPU memory to "
            "read; pass the device the model is on (e.g. next(model.parameters()).device), 'cpu' for the process's "
            "peak RSS"
        )
    if device.type == "cuda":
        gib = 2.0**30
        return {
            "allocated": torch.cuda.memory_allocated(device) / gib,
            "reserved": torch.cuda.memory_reserved(device) / gib,
            "peak": torch.cuda.max_memory_allocated(device) / gib,
        }
    import resource  # POSIX only; imported here so the core imports everywhere

    # ru_maxrss is in KiB on Linux and bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"peak": peak / 2.0**30}


def _first_tensor(batch: Any, keep: Any) -> torch.Tensor | None:
    """The first tensor of ``batch`` (a tensor, or nested lists, tuples and mappings' values) for which ``keep``
    holds."""
    if isinstance(batch, torch.Tensor):
        return batch if keep(batch) else None
    # Any mapping: transformers' BatchEncoding, what its collators return, is a UserDict, not a dict (its tensors
    # were not found: no tokens counted).
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        found = _first_tensor(value, keep)
        if found is not None:
            return found
    return None


def _holds_token_ids(t: torch.Tensor) -> bool:
    # Token ids are int64 or int32 (any signed or wide integer type): not a bool attention mask, a complex tensor
    # (neither is floating point) or uint8 pixels (an image batch's (batch, channels, height, width) counted as tokens).
    return t.dim() >= 2 and not (t.is_floating_point() or t.is_complex() or t.dtype in (torch.bool, torch.uint8))


def count_tokens(batch: Any) -> int | None:
    """Tokens in ``batch``: the size of its first tensor of integer token ids of rank >= 2 (not ``bool`` nor
    ``uint8``), the (batch, sequence) ids of a language model (``None`` if there is none). ``batch``: a tensor, or
    nested lists, tuples and mappings (a dict, transformers' ``BatchEncoding``)."""
    tokens = _first_tensor(batch, _holds_token_ids)
    return None if tokens is None else tokens.numel()


def count_batch(batch: Any) -> tuple[int | None, int | None]:
    """``(samples, tokens)`` of ``batch``: the first dimension of its first tensor (1 for a 0-dim one; ``None``
    without a tensor) and :func:`count_tokens`."""
    first = _first_tensor(batch, lambda t: True)
    samples = None if first is None else (first.shape[0] if first.dim() else 1)
    return samples, count_tokens(batch)
