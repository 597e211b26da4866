"""The FP8 weight cache: the FP8 copy of a weight that FP8AdamW wrote in its step, used by the next forwards.

FP8AdamW(``emit_fp8_weights=True``) writes, in the kernel that updates a weight, the E4M3 copy the FP8Linear
forward would cast from it (kernels/adamw_kernels.py) and the statistics that cast records. The copy hangs on the
weight parameter (attribute :data:`ATTR`) and the forward uses it instead of casting (:func:`quantize_weight`),
recording the same statistics in the layer's weight scaling state.

A copy is valid only for the exact stored values it was made from. It remembers the parameter's autograd version
counter, its storage and its master scale (object and version counter): any in-place change through PyTorch
(``copy_``, ``load_state_dict``, an optimizer's foreach step) bumps a version counter, ``param.data = ...`` changes
the storage, and the optimizer itself bumps the counters of what its Triton step wrote (a Triton write bumps
nothing by itself), once more when it emits (:func:`seal`), and releases the copy when it writes without emitting
(:func:`drop_all`). A valid copy keeps the storage it was made from alive, so that address cannot be reused by
another storage while the copy claims it.

Not seen: an in-place write through ``param.data`` (``p.data.mul_(0.5)``, ``p.data.copy_(ema)``). ``.data`` is an
alias with a version counter of its own, made afresh at each access, and the storage stays the same: PyTorch keeps no
trace of the write (autograd's saved-tensor checks miss it too), and only reading the weight, a device
synchronization in every forward, would tell. Write through the parameter itself under ``torch.no_grad()``, assign
``param.data = ...``, or call :func:`drop` after such a write (docs/concepts/optimizer.md says so).

Under ``torch.compile`` the same check runs when the compiled code runs, not when it is traced: a weight that has
(or had) a copy goes through two opaque ops, the forward GEMM (:func:`compiled_forward_gemm`) and the dgrad GEMM
(:func:`compiled_dgrad`), which use the copy when it is valid for the values they are given and cast (the forward) or
cast again (the backward) otherwise. The copy never leaves these ops, so the compiler cannot reuse its memory. A
parameter keeps its copy object from step to step (the step writes it in place), so the key the traced code holds
(attribute :data:`KEY_ATTR`, one dynamo guard) stays the same and nothing recompiles.

Not used (the forward casts as before) for DTensor weights (tensor parallelism, FSDP2), or when the layer's weight
scaling state has another format or margin than the copy.

The transposed copy that the dgrad GEMM needs is made lazily, by the first forward that needs it, with one FP8
byte transpose (kernels/transpose.py on CUDA), and kept with the copy until the next step: no launch in the step,
none for later micro-batches. The 1-D chunks of the step kernel cannot write it coalesced. Measured on an H100
(benchmarks/results/optim_emit_h100.txt, 4 x FP8Linear(4096, 4096), 16384 tokens): fwd+bwd 7.14 ms casting, 6.91 ms
with the copy and its transpose made; torch's byte transpose (``data.t().contiguous()``, 148 us per 4096 x 4096,
about 225 GB/s) made the first forward after a step cost as much as casting, hence the Triton transpose.
"""

from __future__ import annotations

import itertools
import sys
import weakref

import torch

from lightning_fp8 import ops
from lightning_fp8.kernels import reference, reference_adamw
from lightning_fp8.optim import master

ATTR = "_lightning_fp8_weight_cache"  # the WeightCache of a parameter
KEY_ATTR = "_lightning_fp8_weight_cache_key"  # its key (an int): what traced code holds of it
_any_sealed = False  # whether any copy was ever made in this process (optimizers that never emit skip drop_all)
_CACHES: weakref.WeakValueDictionary[int, WeightCache] = weakref.WeakValueDictionary()  # key -> copy
_KEYS = itertools.count(1)
# Forwards of compiled code served by a copy (the tests read it; a plain int: counting costs no launch).
compiled_hits = 0


class WeightCache:
    """The FP8 copy of one weight and what its validity depends on.

    Attributes:
        data: the FP8 weight, the parameter's shape (row-major: the forward GEMM's column-major ``data.t()``).
        data_t: its transpose (the dgrad GEMM's operand), made lazily; ``None`` until then.
        record: int64 [5], written by the step: see ``reference_adamw.fp8_weight_record_views``.
        margin: the margin of the copy's scale.
    """

    __slots__ = ("data", "data_t", "record", "margin", "floats", "counts", "scale_inv", "key", "_state", "_storage",
                 "_scale", "__weakref__")  # fmt: skip

    def __init__(self, param: torch.Tensor, fp8_dtype: torch.dtype, margin: int) -> None:
        self.data = torch.empty(param.shape, dtype=fp8_dtype, device=param.device)
        self.margin = margin
        self.key = next(_KEYS)
        _CACHES[self.key] = self
        self.renew()

    def __reduce__(self) -> tuple:
        # Pickling the parameter (torch.save(model)) drops the copy: its record is int64 with float32 views, which
        # torch.save refuses, and a copy is valid for one parameter object only. The next emitting step writes a new
        # one; until then the forward casts.
        return set, ()  # a class torch.load(weights_only=True) reads: unpickled, an empty set stands for no copy

    def renew(self) -> None:
        """Make the copy invalid before the step writes it again: a fresh record (the last forward's ``scale_inv``, a
        view of the old one, may wait in an autograd graph) and no transpose (one may wait there too)."""
        self.record = torch.empty(5, dtype=torch.int64, device=self.data.device)
        self.floats, self.counts = reference_adamw.fp8_weight_record_views(self.record)
        self.scale_inv = self.floats[0]
        self.invalidate()

    def invalidate(self) -> None:
        """Forget what the copy was made from: no parameter is valid for it until the next :func:`seal`."""
        self.data_t: torch.Tensor | None = None
        self._state: tuple = ()
        self._storage = self._scale = None

    @staticmethod
    def _snapshot(param: torch.Tensor, scale: torch.Tensor | None) -> tuple:
        # Python values only: comparing them costs no device synchronization.
        return (param._version, param.untyped_storage().data_ptr(), param.data_ptr(), param.shape, param.dtype,
                -1 if scale is None else scale._version)  # fmt: skip

    def valid_for(self, param: torch.Tensor, scale: torch.Tensor | None) -> bool:
        """Whether ``param`` (or a tensor sharing its storage and version counter), with ``scale`` its master scale,
        still holds the values this copy was made from (see the module docstring)."""
        return self._state == self._snapshot(param, scale) and scale is self._scale

    def transposed(self) -> torch.Tensor:
        """The copy's transpose (the dgrad operand), made by the first caller after the step and then kept."""
        if self.data_t is None:
            # Out of sight of selective checkpointing (eagerly): the recompute finds it made, and must run the
            # forward's other ops in the forward's order.
            with reference.state_writes(self.data):
                self.data_t = _transpose(self.data)
        return self.data_t

    def record_into(self, buffers: tuple[torch.Tensor, ...]) -> None:
        """Record the copy's statistics in a weight scaling state's ``(amax_history, scale, amax, saturation,
        nonfinite_count, casts)``, as its cast would: a copy whose amax is 0 or non-finite (its history entry is 0)
        leaves the state's scale as it was, where the step's record carries scale 1."""
        amax_history, scale, amax, saturation, nonfinite_count, casts = buffers
        floats, counts = self.floats, self.counts
        with torch.no_grad(), reference.state_writes(casts):  # as a cast's own record (reference.record_cast_ref)
            torch.where(floats[4] > 0, floats[2], scale, out=scale)
            torch._foreach_copy_([amax, saturation, amax_history], [floats[1], floats[3], floats[4:5]])
            torch._foreach_add_([nonfinite_count, casts], [counts[0], counts[1]])


def _cache_of(param: torch.Tensor) -> WeightCache | None:
    """``param``'s copy object, if any (an unpickled one is an empty set: see WeightCache.__reduce__)."""
    cache = getattr(param, ATTR, None)
    return cache if isinstance(cache, WeightCache) else None


def drop(param: torch.Tensor) -> None:
    """Invalidate ``param``'s FP8 copy (its next forward casts): call it after writing the weight in place through
    ``param.data``, which no version counter records (module docstring). The copy object stays, to be written again
    by the next emitting step (its key, which compiled code holds, stays the same).

    Raises:
        TypeError: if ``param`` is not a tensor (a layer in place of its weight would leave the copy in use).
    """
    if not isinstance(param, torch.Tensor):
        raise TypeError(
            f"weight_cache.drop takes the weight tensor whose FP8 copy to invalidate, e.g. drop(layer.weight), got "
            f"{type(param).__name__}"
        )
    cache = _cache_of(param)
    if cache is not None:
        cache.invalidate()


def drop_all(params: list[torch.Tensor]) -> None:
    """Release the copies of ``params``, which a step wrote without emitting (emission is off for them): the next
    forwards cast, and the copies' memory is freed (a later emitting step makes new ones, with new keys: compiled code
    compiles once more then). Nothing to do (no attribute lookups) until some step has emitted a copy."""
    if _any_sealed:
        for p in params:
            cache = _cache_of(p)
            if cache is not None:
                cache.invalidate()
                setattr(p, ATTR, None)


def allocate(param: torch.Tensor, fp8_dtype: torch.dtype, margin: int) -> WeightCache:
    """``param``'s copy, not valid until :func:`seal`, for the step to write: the one it has when that one fits (its
    bytes are written in place), else a new one."""
    cache = _cache_of(param)
    fits = cache is not None and cache.margin == margin and cache.data.dtype == fp8_dtype
    if fits and cache.data.shape == param.shape and cache.data.device == param.device:
        cache.renew()
        return cache
    if cache is not None:
        cache.invalidate()
    cache = WeightCache(param, fp8_dtype, margin)
    setattr(param, ATTR, cache)
    setattr(param, KEY_ATTR, cache.key)
    return cache


def seal(param: torch.Tensor, cache: WeightCache) -> None:
    """After the step wrote ``param`` and ``cache``: bump ``param``'s version (whatever wrote it) and make
    the copy valid for exactly the parameter's current values."""
    global _any_sealed
    _any_sealed = True
    torch.autograd.graph.increment_version(param)
    cache._scale = getattr(param, master.SCALE_ATTR, None)
    cache._state = cache._snapshot(param, cache._scale)
    cache._storage = param.untyped_storage()  # kept alive: its address cannot be reused while the copy is valid


def _dtensor(t: torch.Tensor) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def lookup(param: torch.Tensor, state: torch.nn.Module) -> WeightCache | None:
    """``param``'s valid FP8 copy for the weight scaling state ``state``, else ``None`` (an invalid one is dropped)."""
    if torch.compiler.is_compiling() or _dtensor(param):
        return None
    if state.amax_history.numel() != 1:
        return None
    return _serving(_cache_of(param), param, getattr(param, master.SCALE_ATTR, None), state.fp8_dtype,
                    state.margin)  # fmt: skip


def _serving(
    cache: WeightCache | None, weight: torch.Tensor, scale: torch.Tensor | None, fp8_dtype: torch.dtype, margin: int
) -> WeightCache | None:
    # ``cache`` if it may replace the cast of ``weight`` (master scale ``scale``) in this format and margin.
    if cache is None or cache.data.dtype != fp8_dtype or cache.margin != margin:
        return None
    if cache.valid_for(weight, scale):
        return cache
    # Invalid until the next seal: let go of the storage it was made from (held while valid; a weight changed
    # outside the optimizer, e.g. model.half(), would keep its old storage alive) and of its transposed copy.
    cache.invalidate()
    return None


def _transpose(data: torch.Tensor) -> torch.Tensor:
    if ops.use_triton(data):
        from lightning_fp8.kernels.transpose import transpose_2d

        with ops.out_of_modes_sight(), ops.on_device(data):  # as the casts' Triton paths
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
    cache.record_into(state.cast_buffers())
    data_t = cache.transposed() if transpose else cache.data.new_empty((0,))
    return cache.data, data_t, cache.scale_inv


def recast_weight_t(
    weight: torch.Tensor, master_scale: torch.Tensor | None, w_scale_inv: torch.Tensor, fp8_dtype: torch.dtype
) -> torch.Tensor:
    """The forward's transposed FP8 weight, cast again: the weight is unchanged since (autograd's version check on the
    saved tensors guarantees it), and the scale the forward cast the stored values with is ``1 / (scale_inv *
    master_scale)``, exactly (powers of two)."""
    stored_scale_inv = w_scale_inv if master_scale is None else w_scale_inv * master_scale
    return ops.recast_transposed(weight.detach(), torch.reciprocal(stored_scale_inv), fp8_dtype)


# ------------------------------------------------------------------------------------------------- torch.compile
def compiled_key(weight: torch.Tensor, state: torch.nn.Module) -> int | None:
    """Under torch.compile, the key of ``weight``'s copy when its GEMMs go through the ops below (a weight some step
    wrote a copy for, of a weight scaling state with one history entry), else None. Read where ``weight`` is the
    module's parameter (not inside an autograd.Function): dynamo guards the key's value."""
    if not torch.compiler.is_compiling() or _dtensor(weight) or state.amax_history.numel() != 1:
        return None
    return getattr(weight, KEY_ATTR, None)


def compiled_forward_gemm(
    x_fp8: torch.Tensor,
    x_scale_inv: torch.Tensor,
    weight: torch.Tensor,
    unscale: torch.Tensor | None,
    bias: torch.Tensor | None,
    state: torch.nn.Module,
    out_dtype: torch.dtype,
    key: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x @ w^T + bias, w_scale_inv)`` for traced code, ``w`` being the weight's FP8 copy when it is valid when
    this runs, else the weight's cast (recorded in ``state`` either way, as :func:`quantize_weight`)."""
    mode = (state.fp8_dtype, state.margin, state.algo == "max", state.delayed)
    return _forward_gemm_op(x_fp8, x_scale_inv, weight, unscale, bias, *state.cast_buffers(), *mode, out_dtype, key)


# The ops run Python when the compiled code runs (the validity check), once per FP8 weight and direction in every
# step: they are declared to the dispatcher by schema (torch.library.Library) rather than with
# torch.library.custom_op, whose Python wrappers around each call (autograd, version bumps of the mutated buffers,
# aliasing checks) cost more host time than the work itself: 135 and 220 us per call on the H100 machine, 17 ms per
# compiled d=1024 GPT step (benchmarks/results/h100_s15.txt run 2). The calls run inside FP8Linear's autograd
# Function under torch.compile, where none of those wrappers is needed. Tagged so that no CUDA graph captures them.
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
_LIB = torch.library.Library("lightning_fp8", "FRAGMENT")
_LIB.define(
    "cached_weight_gemm(Tensor x_fp8, Tensor x_scale_inv, Tensor weight, Tensor? unscale, Tensor? bias, "
    "Tensor(a!) amax_history, Tensor(b!) scale, Tensor(c!) last_amax, Tensor(d!) saturation, "
    "Tensor(e!) nonfinite_count, Tensor(f!) casts, ScalarType fp8_dtype, int margin, bool algo_max, bool delayed, "
    "ScalarType out_dtype, int key) -> (Tensor, Tensor)",
    tags=_TAGS,
)
_LIB.define(
    "cached_weight_dgrad(Tensor dy_fp8, Tensor dy_scale_inv, Tensor weight, Tensor? unscale, Tensor w_scale_inv, "
    "ScalarType fp8_dtype, ScalarType out_dtype, int margin, int key) -> Tensor",
    tags=_TAGS,
)


def _forward_gemm(
    x_fp8: torch.Tensor,
    x_scale_inv: torch.Tensor,
    weight: torch.Tensor,
    unscale: torch.Tensor | None,
    bias: torch.Tensor | None,
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
    out_dtype: torch.dtype,
    key: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    global compiled_hits
    buffers = (amax_history, scale, last_amax, saturation, nonfinite_count, casts)
    cache = _serving(_CACHES.get(key), weight, unscale, fp8_dtype, margin)
    if cache is None:
        w_fp8, _, w_scale_inv = ops.quantize(
            weight.detach().contiguous(), *buffers, fp8_dtype, margin, algo_max, delayed, True, False, unscale
        )
    else:
        compiled_hits += 1
        cache.record_into(buffers)
        w_fp8, w_scale_inv = cache.data, cache.scale_inv.clone()
    y = ops.linear_forward_mm(x_fp8, w_fp8, x_scale_inv, w_scale_inv, out_dtype, bias=bias)
    return y, w_scale_inv


def _forward_gemm_fake(x_fp8, x_scale_inv, weight, unscale, bias, amax_history, scale, last_amax, saturation,
                       nonfinite_count, casts, fp8_dtype, margin, algo_max, delayed, out_dtype, key):  # fmt: skip
    return x_fp8.new_empty((x_fp8.shape[0], weight.shape[0]), dtype=out_dtype), scale.new_empty(())


def _dgrad(
    dy_fp8: torch.Tensor,
    dy_scale_inv: torch.Tensor,
    weight: torch.Tensor,
    unscale: torch.Tensor | None,
    w_scale_inv: torch.Tensor,
    fp8_dtype: torch.dtype,
    out_dtype: torch.dtype,
    margin: int,
    key: int,
) -> torch.Tensor:
    cache = _serving(_CACHES.get(key), weight, unscale, fp8_dtype, margin)
    w_fp8_t = recast_weight_t(weight, unscale, w_scale_inv, fp8_dtype) if cache is None else cache.transposed()
    return ops.scaled_mm(dy_fp8, w_fp8_t.t(), dy_scale_inv, w_scale_inv, out_dtype)


def _dgrad_fake(dy_fp8, dy_scale_inv, weight, unscale, w_scale_inv, fp8_dtype, out_dtype, margin, key):  # fmt: skip
    return dy_fp8.new_empty((dy_fp8.shape[0], weight.shape[1]), dtype=out_dtype)


for _name, _impl, _fake in (("cached_weight_gemm", _forward_gemm, _forward_gemm_fake),
                            ("cached_weight_dgrad", _dgrad, _dgrad_fake)):  # fmt: skip
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"lightning_fp8::{_name}", _fake, lib=_LIB)
_forward_gemm_op = torch.ops.lightning_fp8.cached_weight_gemm.default


# ``dy @ w`` for traced code, with the FP8 weight compiled_forward_gemm used: the copy's transpose when the copy is
# valid when this runs, else the weight cast again with the forward's scale (the same bytes). Arguments as _dgrad's.
compiled_dgrad = torch.ops.lightning_fp8.cached_weight_dgrad.default
