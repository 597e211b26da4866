"""The FP8 weight cache: the FP8 copy of a weight that FP8AdamW wrote in its step, used by the next forwards.

FP8AdamW(``emit_fp8_weights=True``) writes, in the kernel that updates a weight, the E4M3 copy the FP8Linear
forward would cast from it (kernels/adamw_kernels.py) and the statistics that cast records. The copy hangs on the
weight parameter (attribute :data:`ATTR`) and the forward uses it instead of casting (:func:`quantize_weight`),
recording the same statistics in the layer's weight scaling state.

A copy is valid only for the exact stored values it was made from. It remembers the parameter's autograd version
counter, its storage and its master scale (object and version counter): any in-place change through PyTorch
(``copy_``, ``load_state_dict``, an optimizer's foreach step) bumps a version counter, ``param.data = ...`` changes
the storage, and the optimizer itself, whose Triton writes bump nothing, bumps the counter when it emits
(:func:`seal`) and drops the copy when it writes without emitting (:func:`drop`). The copy keeps the old storage
alive until the next forward drops it, so an address cannot be reused by another storage in between.

Not used (the forward casts as before) under ``torch.compile`` tracing, for DTensor weights (tensor parallelism,
FSDP2), or when the layer's weight scaling state has another format or margin than the copy.

The transposed copy that the dgrad GEMM needs is made lazily, by the first forward that needs it, with one FP8
byte transpose (kernels/transpose.py on CUDA), and kept with the copy until the next step: no launch in the step,
none for later micro-batches. The 1-D chunks of the step kernel cannot write it coalesced. Measured on an H100
(benchmarks/results/optim_emit_h100.txt, 4 x FP8Linear(4096, 4096), 16384 tokens): fwd+bwd 7.14 ms casting, 6.91 ms
with the copy and its transpose made; torch's byte transpose (``data.t().contiguous()``, 148 us per 4096 x 4096,
about 225 GB/s) made the first forward after a step cost as much as casting, hence the Triton transpose.
"""

from __future__ import annotations

import sys

import torch

from lightning_fp8 import ops
from lightning_fp8.kernels import reference_adamw
from lightning_fp8.optim import master

ATTR = "_lightning_fp8_weight_cache"  # the WeightCache of a parameter
_any_sealed = False  # whether any copy was ever made in this process (optimizers that never emit skip drop_all)


class WeightCache:
    """The FP8 copy of one weight and what its validity depends on.

    Attributes:
        data: the FP8 weight, the parameter's shape (row-major: the forward GEMM's column-major ``data.t()``).
        data_t: its transpose (the dgrad GEMM's operand), made lazily; ``None`` until then.
        record: int64 [5], written by the step: see ``reference_adamw.fp8_weight_record_views``.
        margin: the margin of the copy's scale.
    """

    __slots__ = ("data", "data_t", "record", "margin", "floats", "counts", "scale_inv", "_state", "_storage", "_scale")

    def __init__(self, param: torch.Tensor, fp8_dtype: torch.dtype, margin: int) -> None:
        self.data = torch.empty(param.shape, dtype=fp8_dtype, device=param.device)
        self.data_t: torch.Tensor | None = None
        self.record = torch.empty(5, dtype=torch.int64, device=param.device)
        self.margin = margin
        self.floats, self.counts = reference_adamw.fp8_weight_record_views(self.record)
        self.scale_inv = self.floats[0]
        self._state: tuple = ()
        self._storage = self._scale = None

    @staticmethod
    def _snapshot(param: torch.Tensor) -> tuple:
        # Python values only: comparing them costs no device synchronization.
        scale = getattr(param, master.SCALE_ATTR, None)
        return (param._version, param.untyped_storage().data_ptr(), param.data_ptr(), param.shape, param.dtype,
                -1 if scale is None else scale._version)  # fmt: skip

    def valid_for(self, param: torch.Tensor) -> bool:
        """Whether ``param`` still holds the values this copy was made from (see the module docstring)."""
        return self._state == self._snapshot(param) and getattr(param, master.SCALE_ATTR, None) is self._scale


def drop(param: torch.Tensor) -> None:
    """Forget ``param``'s FP8 copy (its next forward casts)."""
    if getattr(param, ATTR, None) is not None:
        setattr(param, ATTR, None)


def drop_all(params: list[torch.Tensor]) -> None:
    """:func:`drop` for each of ``params``; nothing to do (no attribute lookups) until some step has emitted a copy."""
    if _any_sealed:
        for p in params:
            drop(p)


def allocate(param: torch.Tensor, fp8_dtype: torch.dtype, margin: int) -> WeightCache:
    """A new, not yet valid copy for ``param`` (the old one is dropped first, so its memory is reused)."""
    drop(param)
    return WeightCache(param, fp8_dtype, margin)


def seal(param: torch.Tensor, cache: WeightCache) -> None:
    """After the step wrote ``param`` and ``cache``: bump ``param``'s version (a Triton write does not) and make
    the copy valid for exactly the parameter's current values."""
    global _any_sealed
    _any_sealed = True
    torch.autograd.graph.increment_version(param)
    cache._state = cache._snapshot(param)
    cache._scale = getattr(param, master.SCALE_ATTR, None)
    cache._storage = param.untyped_storage()  # kept alive: its address cannot be reused while the copy exists
    setattr(param, ATTR, cache)


def _dtensor(t: torch.Tensor) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def lookup(param: torch.Tensor, state: torch.nn.Module) -> WeightCache | None:
    """``param``'s valid FP8 copy for the weight scaling state ``state``, else ``None`` (an invalid one is dropped)."""
    if torch.compiler.is_compiling() or _dtensor(param):
        return None
    cache = getattr(param, ATTR, None)
    if cache is None:
        return None
    if not cache.valid_for(param):
        drop(param)
        return None
    if cache.data.dtype != state.fp8_dtype or cache.margin != state.margin or state.amax_history.numel() != 1:
        return None
    return cache


def _transpose(data: torch.Tensor) -> torch.Tensor:
    if ops.use_triton(data):
        from lightning_fp8.kernels.transpose import transpose_2d

        return transpose_2d(data)
    return data.t().contiguous()


def quantize_weight(
    state: torch.nn.Module,
    weight: torch.Tensor,
    transpose: bool,
    unscale: torch.Tensor | None,
    keep_transpose: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``state.quantize(weight, transpose and keep_transpose, True, unscale)`` (the forward's weight cast), served
    from the weight's valid FP8 copy when it has one: then no cast runs, the copy's transpose is returned when
    ``transpose`` (made once, kept with the copy), and ``state`` records the statistics of the copy (the same numbers
    the cast would record when the step ran two passes).

    Returns:
        ``(w_fp8, w_fp8_t, scale_inv)`` as :meth:`~lightning_fp8.scaling.ScalingState.quantize`; ``w_fp8_t`` is empty
        when the cast made none (``keep_transpose=False``: the caller casts again when it needs it).
    """
    cache = lookup(weight, state) if _any_sealed else None  # no attribute lookups until some step emitted a copy
    if cache is None:
        return state.quantize(weight, transpose and keep_transpose, True, unscale)
    floats, counts = cache.floats, cache.counts
    with torch.no_grad():
        torch._foreach_copy_([state.amax, state.scale, state.saturation, state.amax_history],
                             [floats[1], floats[2], floats[3], floats[4:5]])  # fmt: skip
        torch._foreach_add_([state.nonfinite_count, state.casts], [counts[0], counts[1]])
    if transpose and cache.data_t is None:
        cache.data_t = _transpose(cache.data)
    data_t = cache.data_t if transpose else cache.data.new_empty((0,))
    return cache.data, data_t, cache.scale_inv
