"""What the gradient casts and checks report to :class:`~lightning_fp8.FP8GradScaler` between two updates.

Every FP8 cast of a gradient that mu governs, every non-finite check, and the scaler's own measurement of the
optimizer's high-precision gradients add to a :class:`_Counts`: one per source (the communication hooks' shared one,
one per optimizer that owns its casts, and the window that ``update()`` judges), summed on the device so that adding
needs no host synchronization. :class:`_GradReports` (a base of the scaler) keeps them and agrees on them across
the data-parallel ranks with one small all-reduce per decision (:meth:`_GradReports._agree`).
"""

from __future__ import annotations

import collections
import numbers
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist

from lightning_fp8 import ops
from lightning_fp8.formats import fp8_max


def _narrower_than_fp32(dtype: torch.dtype) -> bool:
    """Whether ``dtype``'s range is narrower than fp32's (fp16, FP8): fp32, bf16 and fp64 reach past 2**127."""
    return torch.finfo(dtype).max < 2.0**127


# An fp16 gradient (O2's FP8 weights: the GEMM writes it in the parameter's fp16 storage, before any scale of its own)
# whose mu-scaled amax is under this keeps no value more than 16 binades below its amax (fp16's smallest subnormal is
# 2**-24), and loses mantissa bits from 6 binades below: FP8GradScaler.update then multiplies mu by 16.
SMALL_FP16_AMAX = 2.0**-8


def fp16_amax_levels(amax: torch.Tensor, dtype: torch.dtype | None) -> tuple[torch.Tensor | None, ...]:
    """``(small, large)``: how many of the gradient amaxes ``amax`` (mu-scaled, 0-dim or 1-D) of tensors stored in
    ``dtype`` are positive and under :data:`SMALL_FP16_AMAX`, and how many are finite and at or above it; ``None``
    each for a dtype other than fp16 (fp32 and bf16 reach 2**-126 and below). An amax of 0 is in neither: a gradient
    flushed whole and one that is 0 (a branch gated off, a zero loss) cannot be told apart."""
    if dtype != torch.float16:
        return None, None
    small = amax < SMALL_FP16_AMAX
    return (small & (amax > 0)).sum(), (torch.isfinite(amax) & ~small).sum()


class _Counts:
    """What the gradient casts and checks of one source reported since the last update, summed on the device (adding
    needs no host synchronization). ``stats``: float64 ``[non-finite flags, saturated values, casts without
    headroom, fp16 gradients with a small amax, with a larger one]`` (integers: exact in any order; see
    :func:`fp16_amax_levels`), ``None`` until something is reported; ``numel``: values measured; ``cast_numel``: those
    of them that an FP8 cast reported."""

    __slots__ = ("stats", "numel", "cast_numel")

    def __init__(self) -> None:
        self.stats: torch.Tensor | None = None
        self.numel = 0
        self.cast_numel = 0

    def add(self, found: torch.Tensor, n_saturated: torch.Tensor | None = None,
            no_headroom: torch.Tensor | None = None, numel: int = 0, cast: bool = False,
            fp16_levels: tuple[torch.Tensor | None, ...] = (None, None)) -> None:  # fmt: skip
        """Add 0-dim counts (``None``: 0), all on one device."""
        parts = (found, n_saturated, no_headroom, *fp16_levels)
        zero = found.new_zeros((), dtype=torch.float64) if any(t is None for t in parts) else None
        row = torch.stack([zero if t is None else t.to(torch.float64) for t in parts])
        if self.stats is None:
            self.stats = row
        else:
            self.stats.add_(row.to(self.stats.device))
        self.numel += int(numel)
        self.cast_numel += int(numel) if cast else 0

    def copy(self) -> _Counts:
        new = _Counts()
        new.stats = None if self.stats is None else self.stats.clone()
        new.numel, new.cast_numel = self.numel, self.cast_numel
        return new

    def merge(self, other: _Counts) -> _Counts:
        """``self`` plus ``other``; ``other`` itself when ``self`` is empty (no launch), so do not reuse ``other``."""
        if self.stats is None and not self.numel:
            return other
        if other.stats is not None:
            self.stats = other.stats if self.stats is None else self.stats + other.stats.to(self.stats.device)
        self.numel += other.numel
        self.cast_numel += other.cast_numel
        return self

    def found(self) -> torch.Tensor | None:
        return None if self.stats is None else self.stats[0]


class _GradReports:
    """The reports FP8GradScaler judges: taken from the casts and checks (:meth:`record_gradient_cast`,
    :meth:`record_nonfinite`, the public reporting API), kept per source (:meth:`_counts`), measured
    (:meth:`_record_high_precision_grads`) and agreed across ranks (:meth:`_agree`). The attributes are set by
    :meth:`_reset_step_counters` and ``FP8GradScaler.__init__``."""

    def record_gradient_cast(
        self,
        amax: torch.Tensor,
        n_saturated: torch.Tensor,
        numel: int,
        fp8_dtype: torch.dtype,
        scale: torch.Tensor | float | None = None,
        *,
        owner: Any = None,
        source_dtype: torch.dtype | None = None,
    ) -> None:
        """Report one FP8 cast of a gradient that mu governs (no host synchronization); or several at once.

        Args:
            amax: 0-dim, ``max|g|`` of the mu-scaled gradient as it entered the cast (what ``ops.cast_to_fp8``
                returns); non-finite marks the step non-finite. 1-D: the amaxes of several casts (FP8AdamW's
                batched gradient casts), the same as one call per cast.
            n_saturated: 0-dim count of values that reached the format maximum (1-D: one count per cast).
            numel: number of values cast (all casts together).
            fp8_dtype: the FP8 format of the cast (its maximum is the reference for saturation and headroom).
            scale: the cast's own scale, when it used one besides mu (``amax * scale`` is then compared with the
                format maximum); ``None`` means 1 (mu is the only scale).
            owner: the optimizer that holds the cast gradient and checks it in its own :meth:`step` (FP8AdamW):
                the cast then counts for that optimizer's step alone. ``None`` (the communication hooks): every
                optimizer stepped before the next :meth:`update` skips on a non-finite amax.
            source_dtype: the dtype the gradient was stored in before the cast (``param.grad``'s). fp16 gradients
                lose small values at a small mu: while every fp16 gradient's amax is under ``2**-8``, each update
                multiplies mu by 16 (see :meth:`update`).

        Raises:
            TypeError: for an ``amax`` or ``n_saturated`` that is not a tensor, a ``numel`` that is not an int.
            ValueError: for a negative ``numel``.
        """
        # Cheap checks only (this runs per cast, without a host sync): a Python number failed with "'float' object has
        # no attribute 'detach'", and a negative numel passed, making the saturated fraction negative or past 1.
        for name, value in (("amax", amax), ("n_saturated", n_saturated)):
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"FP8GradScaler.record_gradient_cast({name}={value!r}): pass a tensor (0-dim for one cast, 1-D for "
                    f"several), e.g. torch.as_tensor({name}); nothing was recorded"
                )
        if isinstance(numel, bool) or not isinstance(numel, numbers.Integral) or numel < 0:
            error = ValueError if isinstance(numel, numbers.Integral) and not isinstance(numel, bool) else TypeError
            raise error(
                f"FP8GradScaler.record_gradient_cast(numel={numel!r}): pass the number of values cast, an int >= 0; "
                "nothing was recorded"
            )
        amax = amax.detach().float()
        scaled = amax if scale is None else amax * torch.as_tensor(scale, dtype=torch.float32, device=amax.device)
        found = (~torch.isfinite(amax)).float()
        n_saturated = n_saturated.detach().to(amax.device)
        no_headroom = scaled * self.headroom > fp8_max(fp8_dtype)
        levels = fp16_amax_levels(amax, source_dtype)
        if amax.dim():  # several casts: sums of 0/1 flags and integer counts, exact in any order
            found, n_saturated, no_headroom = found.sum(), n_saturated.sum(), no_headroom.sum()
        self._counts(owner).add(found, n_saturated, no_headroom, numel, cast=True, fp16_levels=levels)

    def _warn_unbound(self, optimizer: torch.optim.Optimizer, fused: Any) -> None:
        """Warn once per FP8AdamW whose gradient casts report to no scaler or another one."""
        bound = getattr(optimizer, "grad_scaler", None)
        if fused is not None and bound is not self and optimizer not in self._seen_unbound:
            self._seen_unbound.add(optimizer)
            warnings.warn(
                f"FP8GradScaler.step: this {type(optimizer).__name__} reports its FP8 gradient casts to "
                f"{'no scaler' if bound is None else 'another scaler'}, so mu does "
                "not see how many of them saturate (it grows until a step overflows, then halves). Create it with "
                "FP8AdamW(..., grad_scaler=scaler) for this scaler",
                stacklevel=3,
            )

    def record_nonfinite(self, found: torch.Tensor) -> None:
        """Report a non-finite gradient check: a 0-dim tensor, > 0 when a non-finite value was seen. Every optimizer
        stepped before the next :meth:`update` skips on it.

        Raises:
            TypeError: for a ``found`` that is not a tensor (a Python bool failed with "'bool' object has no attribute
                'detach'").
        """
        if not isinstance(found, torch.Tensor):
            raise TypeError(
                f"FP8GradScaler.record_nonfinite(found={found!r}): pass a 0-dim tensor, > 0 where a non-finite value "
                "was seen (e.g. torch.as_tensor(found, dtype=torch.float32)); nothing was recorded"
            )
        self._counts(None).add((found.detach().float() > 0).float())

    def _counts(self, owner: Any) -> _Counts:
        """The counts a report of ``owner`` adds to (see :meth:`record_gradient_cast`); marks the step active."""
        self._active = True
        self._agreed = None  # the next decision needs a fresh all-reduce
        if owner is None:
            return self._shared
        counts = self._owned.get(owner)
        if counts is None:
            counts = self._owned[owner] = _Counts()
        return counts

    def _discard(self, owner: Any) -> None:
        """Forget the casts ``owner`` reported since its last step: it dropped those gradients (``zero_grad``)."""
        self._owned.pop(owner, None)

    def _record_high_precision_grads(
        self, optimizer: torch.optim.Optimizer, counts: _Counts, narrow_only: bool = False
    ) -> None:
        """Add the headroom of ``optimizer``'s mu-scaled ``param.grad`` under their dtype's maximum to ``counts``.

        One ``_foreach_norm(inf)`` per (device, dtype) and no host synchronization: the per-step all-reduce in
        :meth:`_agree` reads the counters. Counted as measured values, not as cast ones (high-precision values do not
        clamp: past the maximum they become inf, which marks the step non-finite), so they take part in the headroom
        and non-finite rules but not in the saturated fraction.

        ``narrow_only`` (FP8 casts were reported in this step, so mu's growth is judged on them already): only the
        gradients whose dtype's range is narrower than fp32's (fp16) are measured. They are the ones mu can push past
        their maximum (an fp16 gradient of 30 overflows at mu = 4096), and no cast reports them: the optimizer's FP8
        gradients have left ``param.grad``. fp32, bf16 and fp64 gradients reach 3.4e38: no finite gradient times mu
        (at most ``max_scale``) comes within the headroom of it, and an infinite one is caught by the step's
        non-finite check of every ``param.grad`` anyway; measuring them would only add a pass over every gradient.
        """
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = collections.defaultdict(list)
        for group in optimizer.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is None or not grad.is_floating_point():
                    continue
                if narrow_only and not _narrower_than_fp32(grad.dtype):  # before any work on it
                    continue
                if grad.is_sparse:  # its stored values (duplicates summed, as the dense gradient holds them)
                    grad = grad.coalesce()._values()
                grad = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor: this rank's shard
                if grad.numel():
                    by_kind[(grad.device, grad.dtype)].append(grad)
        for (_, dtype), grads in by_kind.items():
            amax = torch.stack(ops.amaxes(grads))  # NaN counted as inf
            no_headroom = (amax * self.headroom > torch.finfo(dtype).max).sum()
            counts.add((~torch.isfinite(amax)).any().float(), None, no_headroom, sum(g.numel() for g in grads),
                       fp16_levels=fp16_amax_levels(amax, dtype))  # fmt: skip

    def _reset_step_counters(self) -> None:
        self._active = False  # something was recorded or stepped since the last update
        self._shared = _Counts()  # reports no optimizer owns (communication hooks): every step heeds them
        self._window = _Counts()  # the stepped optimizers' own reports and checks: what update() judges
        self._stepped: list[tuple[torch.optim.Optimizer, bool]] = []  # (optimizer, skipped) since the last update
        # Plain optimizers whose gradients are unscaled (by unscale_ or a step that raised) -> their non-finite flag.
        self._unscaled: weakref.WeakKeyDictionary[torch.optim.Optimizer, torch.Tensor] = weakref.WeakKeyDictionary()
        # What unscale_ measured of them (headroom, the flag): update() judges an optimizer not stepped on it.
        self._unscale_counts: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Counts] = weakref.WeakKeyDictionary()
        self._agreed: dict[str, float] | None = None  # the totals of the last all-reduce, while no report came since

    # What every source reported since the last update (for tests and debugging: each reads the device).
    def _total(self, index: int) -> torch.Tensor:
        stats = [c.stats[index] for c in (self._shared, self._window, *self._owned.values()) if c.stats is not None]
        return torch.stack([s.cpu() for s in stats]).sum() if stats else torch.zeros((), dtype=torch.float64)

    _found = property(lambda self: self._total(0), doc="Non-finite flags (0-dim float64).")
    _n_saturated = property(lambda self: self._total(1), doc="Saturated values (0-dim float64).")
    _no_headroom = property(lambda self: self._total(2), doc="Casts without headroom (0-dim float64).")
    _numel = property(lambda self: sum(c.numel for c in (self._shared, self._window, *self._owned.values())),
                      doc="Values measured (an int).")  # fmt: skip

    def _agree(self, step_found: torch.Tensor | None = None) -> float:
        """Sum over the data-parallel ranks, in one all-reduce and one host sync, of ``step_found`` (the non-finite
        flags of the optimizer being stepped) and of what :meth:`update` judges (kept in ``self._agreed``).

        Every rank steps the same optimizers in the same order, so the collectives match and so do the decisions.

        Returns:
            ``step_found`` summed over the ranks (0.0 when ``None``).
        """
        parts = [c.stats for c in (self._window, self._shared) if c.stats is not None]
        device = next((t.device for t in (step_found, *parts) if t is not None), torch.device("cpu"))
        stats = sum((p.to(device) for p in parts[1:]), parts[0].to(device)) if parts else torch.zeros(
            5, dtype=torch.float64, device=device)  # fmt: skip
        flag = step_found.to(device, torch.float64).reshape(1) if step_found is not None else stats.new_zeros(1)
        numel = float(self._window.numel + self._shared.numel)
        cast_numel = float(self._window.cast_numel + self._shared.cast_numel)
        numels = torch.tensor([numel, cast_numel], dtype=torch.float64, device=device)
        packed = torch.cat([flag, stats, numels])
        if dist.is_available() and dist.is_initialized():
            group = self.process_group
            if dist.get_world_size(group) > 1:
                if dist.get_backend(group) == "nccl" and packed.device.type != "cuda":
                    packed = packed.cuda()
                dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        flag_sum, found, n_sat, no_headroom, fp16_small, fp16_large, numel, cast_numel = packed.tolist()
        self._agreed = {"found": found, "n_saturated": n_sat, "numel": numel, "cast_numel": cast_numel,
                        "no_headroom": no_headroom, "fp16_small": fp16_small, "fp16_large": fp16_large}  # fmt: skip
        return flag_sum
