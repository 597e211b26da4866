"""FP8GradScaler: the automatic gradient scale mu of FP8-LM (DESIGN.md "Automatic gradient scaling").

FP8 (and fp16) gradients have a narrow range. mu multiplies the loss, so every gradient computed from it is
multiplied by mu; the optimizer divides it out again. mu is a power of two, so scaling and unscaling are exact.

- Every FP8 cast of a gradient that mu governs reports its amax and saturation count
  (:meth:`FP8GradScaler.record_gradient_cast`): the optimizer's gradient cast, the FP8 communication hooks.
- The optimizer's gradients in ``param.grad`` (high precision) are measured by :meth:`~FP8GradScaler.step` itself, in
  one fused amax reduction per device and dtype, against their own dtype's maximum (fp16: 65504): all of them when
  no FP8 cast was reported in the step (e.g. FP8AdamW with ``fp8_grads=False`` and no FP8 communication), else those
  whose dtype has a narrower range than fp32 (fp16), the ones mu can overflow (see
  :meth:`~FP8GradScaler._record_high_precision_grads`). They cannot saturate (a value past the maximum becomes inf, a
  non-finite step), so for them only the headroom and non-finite rules apply; the saturated fraction is that of the
  FP8 casts' values.
- :meth:`~FP8GradScaler.step` checks the optimizer's own gradients (and what the communication hooks reported),
  agrees across data-parallel ranks with one small all-reduce, then skips that optimizer's step when any rank saw a
  non-finite value, else steps it (through its ``step()``, so LR schedulers and step hooks see it) with the
  gradients unscaled by 1/mu.
- :meth:`~FP8GradScaler.update` halves mu after a skipped step or when the saturated fraction exceeded
  ``saturation_threshold``; doubles it after ``growth_interval`` consecutive steps in which every gradient amax
  stayed at least ``headroom`` times under the format maximum. ``fallback_after`` consecutive non-finite steps run
  the ``nonfinite_fallback`` action (lower the learning rate, or put the offending layers back to high precision).

Usage, like ``torch.amp.GradScaler``::

    scaler = FP8GradScaler()
    optimizer = FP8AdamW(model.parameters(), grad_scaler=scaler)
    scaler.scale_loss(loss).backward()
    scaler.step(optimizer)          # or optimizer.step(), which routes through the scaler and also updates
    scaler.update()

Several optimizers share one scaler as with ``torch.amp.GradScaler``: ``scaler.step(opt1); scaler.step(opt2);
scaler.update()``. Each step decides on that optimizer's gradients alone (one all-reduce each), and the update
halves mu if any of them was skipped. Where each optimizer's ``step()`` updates (``FP8AdamW(grad_scaler=...)``,
the Lightning and Accelerate integrations), mu is updated after each optimizer's step, judged on the gradients of
that optimizer (and of the communication hooks): ``growth_interval`` then counts optimizer steps. Either way
``fallback_after`` counts each optimizer's own consecutive non-finite steps, and the gradients are unscaled by the mu
they were scaled with (the one of the last :meth:`~FP8GradScaler.scale_loss`), even where another optimizer's update
has changed mu since. An optimizer is stepped at most once between updates (a second step raises, as in torch.amp).
"""

from __future__ import annotations

import collections
import math
import numbers
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_fp8 import ops
from lightning_fp8.formats import fp8_max

# Actions kept in `history` (oldest dropped first): enough for monitoring, bounded for long runs.
_HISTORY_LEN = 1000
_FALLBACKS = ("lower_lr", "bf16")
# The state dict entries that count (ints >= 0).
_COUNTERS = ("growth_tracker", "skipped_steps", "nonfinite_events", "consecutive_nonfinite", "steps")

Fallback = str | nn.Module | Callable[["FP8GradScaler", torch.optim.Optimizer], str]


def _is_power_of_two(x: float) -> bool:
    return x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5


def _narrower_than_fp32(dtype: torch.dtype) -> bool:
    """Whether ``dtype``'s range is narrower than fp32's (fp16, FP8): fp32, bf16 and fp64 reach past 2**127."""
    return torch.finfo(dtype).max < 2.0**127


class _Counts:
    """What the gradient casts and checks of one source reported since the last update, summed on the device (adding
    needs no host synchronization). ``stats``: float64 ``[non-finite flags, saturated values, casts without
    headroom]`` (integers: exact in any order), ``None`` until something is reported; ``numel``: values measured;
    ``cast_numel``: those of them that an FP8 cast reported."""

    __slots__ = ("stats", "numel", "cast_numel")

    def __init__(self) -> None:
        self.stats: torch.Tensor | None = None
        self.numel = 0
        self.cast_numel = 0

    def add(self, found: torch.Tensor, n_saturated: torch.Tensor | None = None,
            no_headroom: torch.Tensor | None = None, numel: int = 0, cast: bool = False) -> None:  # fmt: skip
        """Add 0-dim counts (``None``: 0), all on one device."""
        parts = (found, n_saturated, no_headroom)
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


class FP8GradScaler:
    """Automatic power-of-two gradient scale mu with skip-on-overflow and recovery.

    Args:
        init_scale: initial mu (a power of two).
        growth_interval: consecutive steps with headroom after which mu doubles.
        saturation_threshold: fraction of gradient values at the FP8 maximum above which mu halves
            (FP8-LM uses 0.001% = 1e-5).
        headroom: mu may double only while every gradient amax is at least this factor under the format maximum.
        min_scale, max_scale: bounds of mu (powers of two).
        nonfinite_fallback: what ``fallback_after`` consecutive non-finite steps trigger: ``None`` (only skip and
            halve), ``"lower_lr"`` (multiply every group's learning rate by ``lr_factor``), ``"bf16"`` (put the
            FP8 layers whose gradients were non-finite back to ``nn.Linear``; needs ``model``), an ``nn.Module``
            (``"bf16"`` on that model), or a callable ``fn(scaler, optimizer) -> str`` returning what it did.
        process_group: the data-parallel group the decisions are agreed in (default: the world, when
            ``torch.distributed`` is initialized).
        fallback_after: consecutive non-finite steps of one optimizer that trigger the fallback.
        lr_factor: learning-rate multiplier of the ``"lower_lr"`` fallback (0 < lr_factor < 1).
        model: the FP8 model; when given, the ``grad_output`` scaling states of its FP8 layers are rescaled
            exactly whenever mu changes (their delayed scales then stay right), and ``"bf16"`` can find layers.

    Raises:
        ValueError: for a scale that is not a power of two, bounds out of order, or a bad threshold or interval.
    """

    def __init__(
        self,
        init_scale: float = 1.0,
        growth_interval: int = 1000,
        saturation_threshold: float = 1e-5,
        headroom: float = 2.0,
        min_scale: float = 2.0**-24,
        max_scale: float = 2.0**24,
        nonfinite_fallback: Fallback | None = None,
        process_group: Any = None,
        *,
        fallback_after: int = 3,
        lr_factor: float = 0.5,
        model: nn.Module | None = None,
    ) -> None:
        for name, value in (("init_scale", init_scale), ("min_scale", min_scale), ("max_scale", max_scale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"FP8GradScaler({name}={value!r}): must be a number, a positive power of two")
            if not _is_power_of_two(float(value)):
                raise ValueError(f"FP8GradScaler({name}={value!r}): must be a positive power of two (e.g. 1.0, 2**16)")
        if not min_scale <= init_scale <= max_scale:
            raise ValueError(
                f"FP8GradScaler: need min_scale <= init_scale <= max_scale, got {min_scale}, {init_scale}, {max_scale}"
            )
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"FP8GradScaler(growth_interval={growth_interval!r}): must be an int >= 1")
        if not 0.0 <= saturation_threshold < 1.0:
            raise ValueError(f"FP8GradScaler(saturation_threshold={saturation_threshold!r}): must be in [0, 1)")
        if not headroom >= 1.0:
            raise ValueError(f"FP8GradScaler(headroom={headroom!r}): must be >= 1 (a factor under the format max)")
        if not isinstance(fallback_after, int) or fallback_after < 1:
            raise ValueError(f"FP8GradScaler(fallback_after={fallback_after!r}): must be an int >= 1")
        if not 0.0 < lr_factor < 1.0:
            raise ValueError(f"FP8GradScaler(lr_factor={lr_factor!r}): must be in (0, 1)")
        if isinstance(nonfinite_fallback, nn.Module):
            model, nonfinite_fallback = nonfinite_fallback, "bf16"
        if isinstance(nonfinite_fallback, str) and nonfinite_fallback not in _FALLBACKS:
            raise ValueError(
                f"FP8GradScaler(nonfinite_fallback={nonfinite_fallback!r}): choose one of {list(_FALLBACKS)}, "
                "an nn.Module, a callable fn(scaler, optimizer) -> str, or None"
            )
        if nonfinite_fallback == "bf16" and model is None:
            raise ValueError("FP8GradScaler(nonfinite_fallback='bf16') needs the model: pass model=... as well")
        if nonfinite_fallback is not None and not isinstance(nonfinite_fallback, str) and not callable(
            nonfinite_fallback
        ):
            raise TypeError(
                f"FP8GradScaler(nonfinite_fallback=...) got a {type(nonfinite_fallback).__name__}: expected a string, "
                "an nn.Module or a callable"
            )
        self._scale = float(init_scale)
        self.growth_interval = growth_interval
        self.saturation_threshold = float(saturation_threshold)
        self.headroom = float(headroom)
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self.nonfinite_fallback = nonfinite_fallback
        self.process_group = process_group
        self.fallback_after = fallback_after
        self.lr_factor = float(lr_factor)
        self.model = model
        self._growth_tracker = 0
        self._skipped_steps = 0
        self._nonfinite_events = 0
        # Consecutive non-finite steps of each optimizer (weak, like `_owned`): where each optimizer's step()
        # updates, another optimizer's clean update must not restart the count of one that keeps failing.
        self._nonfinite_runs: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        # Consecutive non-finite updates that judged no step (reports alone).
        self._consecutive_nonfinite = 0
        # Where the run of an optimizer not counted since load_state_dict (or unpickling) starts: the longest run saved.
        self._restored_run = 0
        self._steps = 0
        self._last_saturation = 0.0
        self._history: collections.deque[dict[str, Any]] = collections.deque(maxlen=_HISTORY_LEN)
        self._last_optimizer: torch.optim.Optimizer | None = None
        self._seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # every optimizer stepped (fallback)
        self._seen_unbound: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # FP8AdamW not reporting here
        # The casts an optimizer reported of its own gradients (FP8AdamW's), kept for that optimizer's step: where
        # each optimizer's step() also updates, one optimizer's update must not judge (and drop) another's. Weak:
        # an optimizer that is dropped with gradients pending is not kept alive.
        self._owned: weakref.WeakKeyDictionary[Any, _Counts] = weakref.WeakKeyDictionary()
        self._loss_scale: float | None = None  # mu of the last scale_loss: the one the gradients carry
        self._reset_step_counters()

    # ----------------------------------------------------------------------------------------------- read-only stats
    @property
    def scale(self) -> torch.Tensor:
        """mu, a 0-dim fp32 tensor (a power of two)."""
        return torch.tensor(self._scale, dtype=torch.float32)

    @property
    def loss_scale(self) -> float:
        """The mu the current gradients carry: that of the last :meth:`scale_loss` (another optimizer's
        :meth:`update` may have changed :attr:`scale` since), else mu. What unscaling them divides by."""
        return self._loss_scale if self._loss_scale is not None else self._scale

    @property
    def loss_was_scaled(self) -> bool:
        """Whether :meth:`scale_loss` was called (since construction or the last :meth:`load_state_dict`): the
        gradients then carry :attr:`loss_scale`; a loop that never scales its loss leaves them unscaled."""
        return self._loss_scale is not None

    def get_scale(self) -> float:
        """mu as a Python float (``torch.amp.GradScaler.get_scale``'s spelling; the loss is scaled by
        :meth:`scale_loss`, since ``scale`` is this property)."""
        return self._scale

    @property
    def skipped_steps(self) -> int:
        return self._skipped_steps

    @property
    def nonfinite_events(self) -> int:
        return self._nonfinite_events

    @property
    def last_saturation(self) -> float:
        """Fraction of gradient values at the FP8 maximum in the last step's casts (over all ranks)."""
        return self._last_saturation

    @property
    def growth_tracker(self) -> int:
        """Consecutive steps with headroom so far (mu doubles at ``growth_interval``)."""
        return self._growth_tracker

    @property
    def history(self) -> tuple[dict[str, Any], ...]:
        """Actions taken, oldest first: ``{"step", "action", "reason", "scale"}`` (the last 1000)."""
        return tuple(dict(entry) for entry in self._history)

    # ------------------------------------------------------------------------------------------------- recording
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * mu``: call ``.backward()`` on the result. The gradients are later unscaled by this mu, even when
        another optimizer's :meth:`update` has changed mu before their step; gradients summed over several backwards
        are all unscaled by the last one's mu (see docs/concepts/gradient-scaling.md)."""
        self._loss_scale = self._scale
        return loss * self._scale

    def clip_grad_norm_(self, parameters: Any, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(parameters, max_norm)`` (L2) of gradients that carry this scaler's mu
        (:attr:`loss_scale`), applied as if they did not: the plain-PyTorch spelling of unscale-then-clip, between
        the backward and the step. Each ``param.grad`` is multiplied by ``min(1, max_norm / (true norm + 1e-6))``;
        returns the true total norm (of the unscaled gradients), a 0-dim fp32 tensor. The norm is summed in fp32:
        ``torch.nn.utils.clip_grad_norm_(params, mu * max_norm)`` on O2's fp16 gradients computes each tensor's norm
        in fp16, which is inf once mu times it passes 65504, and then multiplies every gradient by 0. Only
        ``param.grad`` is clipped: with ``FP8AdamW(fp8_grads=True)`` the FP8 weights' gradients are held by the
        optimizer (``param.grad`` None), and this raises ValueError: build it with ``fp8_grads=False`` to clip.
        Gradients that :meth:`unscale_` unscaled already are clipped as they are (:meth:`grad_factor`)."""
        from lightning_fp8.integrations.clipping import clip_scaled_grad_norm_  # torch only (no Lightning import)
        from lightning_fp8.optim.adamw import GRAD_OWNER_ATTR

        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        held = [p for p in params if p.grad is None and getattr(p, GRAD_OWNER_ATTR, None) is not None]
        if held:  # an FP8AdamW(fp8_grads=True) took their gradients in FP8 as they were computed
            raise ValueError(
                f"FP8GradScaler.clip_grad_norm_ would miss the gradients of {len(held)} FP8 weight(s) (the first of "
                f"shape {tuple(held[0].shape)}), which FP8AdamW holds in FP8 (fp8_grads=True: they leave param.grad "
                "as soon as they are computed): create the FP8AdamW with fp8_grads=False to clip, or do not clip"
            )
        mu = self.grad_factor(params)
        return clip_scaled_grad_norm_(params, max_norm, mu).float() / mu

    def grad_factor(self, parameters: Any) -> float:
        """The factor the gradients of ``parameters`` (a tensor or an iterable of them) carry now: :attr:`loss_scale`
        (mu), or 1 where :meth:`unscale_` has unscaled them (their optimizer's, since the last :meth:`update`).

        Raises:
            ValueError: when some of the gradients are unscaled and others are not: clip or read the two sets
                separately.
        """
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        unscaled = {id(p) for opt in list(self._unscaled) for group in opt.param_groups for p in group["params"]}
        kinds = {id(p) in unscaled for p in params if p.grad is not None}
        if kinds == {True, False}:
            raise ValueError(
                "FP8GradScaler: some of these gradients were unscaled by unscale_(optimizer) and others still carry "
                "mu; clip the two sets separately (torch.nn.utils.clip_grad_norm_ for the unscaled ones, the scaler's "
                "clip_grad_norm_ for the others), or unscale_ none of them"
            )
        return 1.0 if kinds == {True} else self.loss_scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by mu in place, as ``torch.amp.GradScaler.unscale_`` does, for clipping or
        reading them between the backward and :meth:`step` (which then steps on them as they are, checking them for
        non-finite values again). At most once per optimizer between two :meth:`update` calls, and not after its
        step.

        For optimizers other than :class:`~lightning_fp8.FP8AdamW`, with fp32 or bf16 gradients (fp16 gradients are
        refused, as by :meth:`step`).

        Raises:
            ValueError: for an FP8AdamW, which unscales each gradient in fp32 inside its fused step (at O2 its FP8
                weights' gradients are fp16, which only mu keeps representable, or held in FP8 by the optimizer):
                clip with :meth:`clip_grad_norm_`, read true values as ``param.grad / scaler.loss_scale``. Also for
                fp16 gradients.
            RuntimeError: when called twice for one optimizer since the last :meth:`update`, or after its step.
        """
        while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
            optimizer = optimizer.optimizer  # Accelerate's and Lightning's wrappers step the one inside
        if getattr(optimizer, "_fp8_step", None) is not None:
            raise ValueError(
                f"FP8GradScaler.unscale_({type(optimizer).__name__}): FP8AdamW unscales each gradient in fp32 inside "
                "its fused step, and its FP8 weights' gradients (fp16 at O2, or held in FP8 with fp8_grads=True) "
                "cannot be unscaled in place without losing the values only mu keeps representable. To clip, call "
                "scaler.clip_grad_norm_(parameters, max_norm) between the backward and the step; to read a true "
                "gradient, divide param.grad by scaler.loss_scale"
            )
        if any(stepped is optimizer for stepped, _ in self._stepped):
            raise RuntimeError("FP8GradScaler.unscale_(optimizer) is being called after step(): call it before")
        if optimizer in self._unscaled:
            raise RuntimeError(
                "FP8GradScaler.unscale_(optimizer) has already been called on this optimizer since the last update()"
            )
        _refuse_fp16_grads(optimizer, "unscale_")
        # step() adds the flag to its own check: clipping may have made the gradients finite since.
        self._unscaled[optimizer] = _unscale_in_place(optimizer, 1.0 / self.loss_scale)

    def record_gradient_cast(
        self,
        amax: torch.Tensor,
        n_saturated: torch.Tensor,
        numel: int,
        fp8_dtype: torch.dtype,
        scale: torch.Tensor | float | None = None,
        *,
        owner: Any = None,
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
        """
        amax = amax.detach().float()
        scaled = amax if scale is None else amax * torch.as_tensor(scale, dtype=torch.float32, device=amax.device)
        found = (~torch.isfinite(amax)).float()
        n_saturated = n_saturated.detach().to(amax.device)
        no_headroom = scaled * self.headroom > fp8_max(fp8_dtype)
        if amax.dim():  # several casts: sums of 0/1 flags and integer counts, exact in any order
            found, n_saturated, no_headroom = found.sum(), n_saturated.sum(), no_headroom.sum()
        self._counts(owner).add(found, n_saturated, no_headroom, numel, cast=True)

    def record_nonfinite(self, found: torch.Tensor) -> None:
        """Report a non-finite gradient check: a 0-dim tensor, > 0 when a non-finite value was seen. Every optimizer
        stepped before the next :meth:`update` skips on it."""
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
            counts.add((~torch.isfinite(amax)).any().float(), None, no_headroom, sum(g.numel() for g in grads))

    def _reset_step_counters(self) -> None:
        self._active = False  # something was recorded or stepped since the last update
        self._shared = _Counts()  # reports no optimizer owns (communication hooks): every step heeds them
        self._window = _Counts()  # the stepped optimizers' own reports and checks: what update() judges
        self._stepped: list[tuple[torch.optim.Optimizer, bool]] = []  # (optimizer, skipped) since the last update
        # Plain optimizers whose gradients are unscaled (by unscale_ or a step that raised) -> their non-finite flag.
        self._unscaled: weakref.WeakKeyDictionary[torch.optim.Optimizer, torch.Tensor] = weakref.WeakKeyDictionary()
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

    # -------------------------------------------------------------------------------------------- step and update
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
            3, dtype=torch.float64, device=device)  # fmt: skip
        flag = step_found.to(device, torch.float64).reshape(1) if step_found is not None else stats.new_zeros(1)
        numel = float(self._window.numel + self._shared.numel)
        cast_numel = float(self._window.cast_numel + self._shared.cast_numel)
        packed = torch.cat([flag, stats, torch.tensor([numel, cast_numel], dtype=torch.float64, device=device)])
        if dist.is_available() and dist.is_initialized():
            group = self.process_group
            if dist.get_world_size(group) > 1:
                if dist.get_backend(group) == "nccl" and packed.device.type != "cuda":
                    packed = packed.cuda()
                dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        flag_sum, found, n_sat, no_headroom, numel, cast_numel = packed.tolist()
        self._agreed = {"found": found, "n_saturated": n_sat, "numel": numel, "cast_numel": cast_numel,
                        "no_headroom": no_headroom}  # fmt: skip
        return flag_sum

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step ``optimizer`` with gradients unscaled by 1/mu, unless a rank saw a non-finite gradient of it.

        The decision is this optimizer's: its own gradients (FP8AdamW's FP8 gradients and ``param.grad``), and what
        the communication hooks reported since the last :meth:`update`; other optimizers' gradients do not count, as
        in ``torch.amp.GradScaler``. An :class:`~lightning_fp8.FP8AdamW` unscales inside its fused kernel; any other
        optimizer has its gradients unscaled (and checked) in place first. The step runs through
        ``optimizer.step()``, so LR schedulers and optimizer step hooks see it (not when skipped, as with torch.amp).

        Returns:
            True when the optimizer stepped, False when the step was skipped.

        Raises:
            RuntimeError: when ``optimizer`` was already stepped since the last :meth:`update` (as in
                ``torch.amp.GradScaler``: its gradients would be unscaled twice). A step that raised (the error
                propagates) does not count: it can be made again, with its gradients as they were left (a plain
                optimizer's are not unscaled twice).
            ValueError: when ``optimizer`` is not an FP8AdamW and has fp16 gradients (fp16 parameters), as
                ``torch.amp.GradScaler`` refuses them: unscaling them in fp16 would turn the small gradients mu made
                representable back to zero. Raised before anything is changed.
        """
        if any(stepped is optimizer for stepped, _ in self._stepped):
            raise RuntimeError(
                f"FP8GradScaler.step(optimizer): step() has already been called since the last update() for this "
                f"{type(optimizer).__name__}; call scaler.update() between two steps of one optimizer"
            )
        fused = getattr(optimizer, "_fp8_step", None)
        if fused is None:  # before anything changes
            _refuse_fp16_grads(optimizer)
        self._last_optimizer = optimizer
        self._seen.add(optimizer)
        inv_scale = 1.0 / self.loss_scale
        bound = getattr(optimizer, "grad_scaler", None)
        if fused is not None and bound is not self and optimizer not in self._seen_unbound:
            self._seen_unbound.add(optimizer)
            warnings.warn(
                f"FP8GradScaler.step: this {type(optimizer).__name__} reports its FP8 gradient casts to "
                f"{'no scaler' if bound is None else 'another scaler'}, so mu does "
                "not see how many of them saturate (it grows until a step overflows, then halves). Create it with "
                "FP8AdamW(..., grad_scaler=scaler) for this scaler",
                stacklevel=2,
            )
        found = optimizer._nonfinite_grads() if fused is not None else None  # flushes FP8AdamW's queued casts first
        reported = self._owned.pop(optimizer, None)
        own = _Counts() if reported is None else reported.copy()
        # Its param.grad, in place: every one when no FP8 cast was reported (they are all mu is judged on), else the
        # fp16 ones (the casts do not see them, and they overflow as mu grows); see _record_high_precision_grads.
        # (After unscale_ they are measured unscaled: only fp32 and bf16 ones, which no finite gradient times mu brings
        # near their maximum, so the headroom rule decides the same; their non-finite check is the same.)
        self._record_high_precision_grads(optimizer, own, narrow_only=bool(own.cast_numel or self._shared.cast_numel))
        if fused is None:  # unscaled once: a step made again after raising only checks them
            earlier = self._unscaled.get(optimizer)
            found = _unscale_in_place(optimizer, 1.0 if earlier is not None else inv_scale)
            found = found if earlier is None else found + earlier.to(found.device)
            self._unscaled[optimizer] = found
        own.add((found > 0).float())
        step_found = own.found() if self._shared.stats is None else own.found() + self._shared.found().to(
            own.found().device)  # fmt: skip
        window, active = self._window, self._active
        self._window = self._window.copy().merge(own)
        self._active = True
        skip = self._agree(step_found) > 0
        self._stepped.append((optimizer, skip))
        try:
            if skip:
                skip_fn = getattr(optimizer, "_fp8_skip", None)
                if skip_fn is not None:
                    skip_fn()
                return False
            if fused is not None and not getattr(optimizer, "_fp8_in_step", False):
                _step_through_public_step(optimizer, inv_scale)
            elif fused is not None:  # called by optimizer.step() itself (FP8AdamW(grad_scaler=self))
                fused(inv_scale)
            else:
                optimizer.step()
        except BaseException:  # not a step: as before it (the reports kept, the optimizer free to step again)
            self._stepped.pop()
            self._window, self._active = window, active
            if reported is not None:
                self._owned[optimizer] = reported
            raise
        return True

    def update(self) -> None:
        """Halve or double mu as specified, run the fallback if due, and reset the per-step counters.

        Judges every optimizer stepped since the last update (mu halves if any was skipped) and what the
        communication hooks reported; with no step since, everything reported. A call with nothing recorded and no
        :meth:`step` since the last update does nothing (so calling both ``optimizer.step()``, which updates, and
        ``update()`` is harmless). The counters are reset also when the fallback raises (the error propagates).
        """
        if not self._active:
            self._unscaled = weakref.WeakKeyDictionary()  # unscale_ without a step: the next backward's are scaled
            return
        if not self._stepped:  # reports without a step: judge them all
            for counts in list(self._owned.values()):
                self._window = self._window.merge(counts)
            self._owned.clear()
        if self._agreed is None:
            self._agree()
        decision = self._agreed
        try:
            self._steps += 1
            if decision["found"] > 0:
                self._back_off()
            else:
                self._judge_saturation_and_headroom(decision)
        finally:
            self._reset_step_counters()

    def _back_off(self) -> None:
        """A skipped (non-finite) step: halve mu, count it, and run the fallback when due."""
        self._skipped_steps += 1
        self._nonfinite_events += 1
        self._count_nonfinite_runs(nonfinite=True)
        self._growth_tracker = 0
        self._set_scale(self._scale / 2, "skip", "non-finite gradient")
        if self._longest_nonfinite_run() >= self.fallback_after and self.nonfinite_fallback is not None:
            self._nonfinite_runs.clear()  # also when the fallback raises: every count starts again
            self._consecutive_nonfinite = self._restored_run = 0
            self._run_fallback()

    def _count_nonfinite_runs(self, nonfinite: bool) -> None:
        """Count this update in the runs of consecutive non-finite steps of the optimizers it judges: those stepped
        since the last update (a skipped one's run grows, a stepped one's restarts), or, with no step, all."""
        runs = self._nonfinite_runs
        if self._stepped:
            if any(opt in runs for opt, _ in self._stepped):
                # An optimizer counted before since the restore: every optimizer the restored run may belong to has
                # been counted (updated with its own step), so it no longer applies (to an optimizer built later).
                self._restored_run = 0
            skipped = [opt for opt, was_skipped in self._stepped if was_skipped]
            for opt, _ in self._stepped:
                failed = nonfinite and (opt in skipped or not skipped)  # none skipped: a report came after the steps
                start = max(self._restored_run, self._consecutive_nonfinite)  # an optimizer not counted yet
                runs[opt] = runs.get(opt, start) + 1 if failed else 0
            self._consecutive_nonfinite = 0
        else:
            for opt in list(runs):
                runs[opt] = runs[opt] + 1 if nonfinite else 0
            self._consecutive_nonfinite = self._consecutive_nonfinite + 1 if nonfinite else 0

    def _longest_nonfinite_run(self) -> int:
        """The most consecutive non-finite steps of any one optimizer (what ``fallback_after`` is compared with); the
        restored run while no optimizer has been counted since the restore."""
        runs = self._nonfinite_runs
        return max((*runs.values(), self._consecutive_nonfinite, 0 if runs else self._restored_run))

    def _judge_saturation_and_headroom(self, decision: dict[str, float]) -> None:
        self._count_nonfinite_runs(nonfinite=False)
        numel, cast_numel = decision["numel"], decision["cast_numel"]  # all values measured; those an FP8 cast held
        self._last_saturation = decision["n_saturated"] / cast_numel if cast_numel else 0.0
        if self._last_saturation > self.saturation_threshold:
            self._growth_tracker = 0
            self._set_scale(self._scale / 2, "halve", f"saturated fraction {self._last_saturation:.3g}")
        elif numel and decision["no_headroom"] == 0:
            self._growth_tracker += 1
            if self._growth_tracker >= self.growth_interval:
                self._growth_tracker = 0
                self._set_scale(self._scale * 2, "double", f"headroom for {self.growth_interval} steps")
        else:
            self._growth_tracker = 0

    def _set_scale(self, new_scale: float, action: str, reason: str) -> None:
        new_scale = min(max(new_scale, self.min_scale), self.max_scale)
        ratio = new_scale / self._scale
        self._scale = new_scale
        self._history.append({"step": self._steps, "action": action, "reason": reason, "scale": new_scale})
        if ratio != 1.0 and self.model is not None:
            _rescale_grad_output_states(self.model, ratio)

    def _run_fallback(self) -> None:
        from lightning_fp8 import recovery

        # The optimizers skipped since the last update (several where several share this scaler); else the last one.
        skipped = list({id(opt): opt for opt, was_skipped in self._stepped if was_skipped}.values())
        optimizer = skipped[-1] if skipped else self._last_optimizer
        fallback = self.nonfinite_fallback
        if optimizer is None and fallback in ("lower_lr", "bf16"):  # reports alone (record_nonfinite), no step yet
            what = "no optimizer has stepped through this scaler: nothing to change"
        elif fallback == "lower_lr":
            targets = skipped or [optimizer]
            what = [recovery.lower_lr(opt, self.lr_factor) for opt in targets][-1]
            what += f" in {len(targets)} optimizers" if len(targets) > 1 else ""
        elif fallback == "bf16":  # every optimizer stepped with this scaler: each gives back the masters it holds
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                # Every rank gets here at the same step (the skip decision is agreed); each would pick the layers from
                # its own gradients or shard, and the ranks' models would differ: refuse on every rank alike.
                raise ValueError(
                    f"FP8GradScaler(nonfinite_fallback='bf16') cannot run with {dist.get_world_size()} processes: each "
                    "rank would choose the layers to put back from its own gradients, and wrapped or sharded models "
                    "(DDP, FSDP, tensor parallelism) cannot swap layers. Use nonfinite_fallback='lower_lr' (or a "
                    "callable) in multi-process training; 'bf16' works in one process"
                )
            what = recovery.fallback_to_high_precision(
                self.model, [*self._seen] or optimizer, self.lr_factor, skipped=skipped or [optimizer]
            )
        else:
            what = str(fallback(self, optimizer))
        reason = f"{self.fallback_after} consecutive non-finite steps"
        self._history.append({"step": self._steps, "action": "fallback", "reason": f"{reason}: {what}",
                              "scale": self._scale})

    # ------------------------------------------------------------------------------------------------ checkpoints
    # Pickling (Lightning's spawned processes pickle the precision plugin and its scaler): the weak collections of
    # optimizers are per-process bookkeeping that cannot be pickled; a copy starts with them empty, and every
    # optimizer's non-finite run there starts from the longest one (as after load_state_dict).
    _WEAK = ("_owned", "_seen", "_seen_unbound", "_nonfinite_runs", "_unscaled")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in self._WEAK:
            state.pop(name, None)
        state["_last_optimizer"], state["_stepped"] = None, []  # the optimizers are not pickled with the scaler
        state["_restored_run"] = self._longest_nonfinite_run()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_restored_run", 0)
        self._owned = weakref.WeakKeyDictionary()
        self._seen, self._seen_unbound = weakref.WeakSet(), weakref.WeakSet()
        self._nonfinite_runs = weakref.WeakKeyDictionary()
        self._unscaled = weakref.WeakKeyDictionary()

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values (loads with ``torch.load(weights_only=True)``). ``consecutive_nonfinite`` is the
        longest run of non-finite steps of any optimizer: where every optimizer's run starts after a load."""
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "skipped_steps": self._skipped_steps,
            "nonfinite_events": self._nonfinite_events,
            "consecutive_nonfinite": self._longest_nonfinite_run(),
            "steps": self._steps,
            "last_saturation": self._last_saturation,
            "history": [dict(entry) for entry in self._history],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved. Every entry is checked before any is loaded: on an error the
        scaler is left as it was.

        Raises:
            KeyError: when an entry is missing (not an FP8GradScaler state dict).
            TypeError: when ``state_dict`` is not a dict, or for an entry of the wrong type (e.g. a counter that is
                not an int).
            ValueError: for an entry out of range (a scale that is not a positive power of two, a negative counter,
                a saturation outside [0, 1]).

        A scale outside this scaler's ``[min_scale, max_scale]`` (saved under other bounds) is brought within them,
        with a warning.
        """
        scale, counters, saturation, history = self._checked_state(state_dict)
        if not self.min_scale <= scale <= self.max_scale:  # saved under other bounds: this scaler's apply
            bounded = min(max(scale, self.min_scale), self.max_scale)
            warnings.warn(
                f"FP8GradScaler.load_state_dict: the saved scale {scale} is outside this scaler's [min_scale, "
                f"max_scale] = [{self.min_scale}, {self.max_scale}]; resuming from {bounded}",
                stacklevel=2,
            )
            scale = bounded
        self._scale = scale
        self._loss_scale = None  # a loss scaled before the load no longer tells the gradients' mu
        self._growth_tracker = counters["growth_tracker"]
        self._skipped_steps = counters["skipped_steps"]
        self._nonfinite_events = counters["nonfinite_events"]
        self._nonfinite_runs.clear()  # the saved run (the longest) is where every optimizer's run starts
        self._restored_run, self._consecutive_nonfinite = counters["consecutive_nonfinite"], 0
        self._steps = counters["steps"]
        self._last_saturation = saturation
        self._history = collections.deque(history, maxlen=_HISTORY_LEN)

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state_dict``, changing nothing: so that a load of
        several parts (mu, the FP8 scaling state, ...) checks every part before it loads any."""
        self._checked_state(state_dict)

    def _checked_state(self, state_dict: Any) -> tuple[float, dict[str, int], float, list[dict[str, Any]]]:
        """``state_dict``'s scale, counters, saturation and history, checked (see :meth:`load_state_dict`)."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"FP8GradScaler.load_state_dict: got {type(state_dict).__name__}, expected the dict that "
                "FP8GradScaler.state_dict() returned (the checkpoint may be corrupt). Nothing was loaded."
            )
        missing = sorted(set(self.state_dict()) - set(state_dict))
        if missing:
            raise KeyError(f"FP8GradScaler.load_state_dict: missing entries {missing}; is this a scaler state dict?")
        scale = _checked_entry("scale", state_dict["scale"], numbers.Real, "a positive power of two", _is_power_of_two)
        counters = {name: _checked_entry(name, state_dict[name], numbers.Integral, "an int >= 0", lambda n: n >= 0)
                    for name in _COUNTERS}  # fmt: skip
        saturation = _checked_entry("last_saturation", state_dict["last_saturation"], numbers.Real,
                                    "a fraction in [0, 1]", lambda x: 0.0 <= x <= 1.0)  # fmt: skip
        return scale, counters, saturation, _checked_history(state_dict["history"])

    def __repr__(self) -> str:
        return (
            f"FP8GradScaler(scale={self._scale}, growth_interval={self.growth_interval}, "
            f"skipped_steps={self._skipped_steps})"
        )


def _checked_entry(name: str, value: Any, kind: type, expected: str, valid: Callable[[Any], bool]) -> Any:
    """``value`` as an int (``kind`` ``numbers.Integral``) or a float (``numbers.Real``) when it is one and
    ``valid``; else a TypeError or ValueError that names the state dict entry ``name``."""
    error = TypeError if isinstance(value, bool) or not isinstance(value, kind) else None
    if error is None:
        value = int(value) if kind is numbers.Integral else float(value)
        error = None if valid(value) else ValueError
    if error is not None:
        raise error(
            f"FP8GradScaler.load_state_dict: entry {name!r} is {repr(value)[:200]}, expected {expected}; load the dict "
            "that FP8GradScaler.state_dict() returned (the checkpoint may be corrupt). Nothing was loaded."
        )
    return value


def _checked_history(history: Any) -> list[dict[str, Any]]:
    """The ``history`` entry of a state dict, checked: a list of ``{"step", "action", "reason", "scale"}``."""
    keys = ["action", "reason", "scale", "step"]
    shaped = isinstance(history, (list, tuple)) and all(
        isinstance(e, dict) and sorted(e) == keys and isinstance(e["action"], str) and isinstance(e["reason"], str)
        for e in history
    )
    if not shaped:
        raise TypeError(
            f"FP8GradScaler.load_state_dict: entry 'history' is {repr(history)[:200]}, expected a list of dicts "
            f"with keys {keys} (action and reason strings); load the dict that FP8GradScaler.state_dict() returned "
            "(the checkpoint may be corrupt). Nothing was loaded."
        )
    return [
        {"step": _checked_entry("history step", e["step"], numbers.Integral, "an int >= 0", lambda n: n >= 0),
         "action": e["action"], "reason": e["reason"],
         "scale": _checked_entry("history scale", e["scale"], numbers.Real, "a positive power of two",
                                 _is_power_of_two)}
        for e in history
    ]  # fmt: skip


def _step_through_public_step(optimizer: torch.optim.Optimizer, inv_scale: float) -> None:
    """Run an FP8AdamW's update through its ``step()``, as torch.amp runs ``optimizer.step()``: an LR scheduler's
    wrapper then marks the optimizer as stepped (no "lr_scheduler.step() before optimizer.step()" warning), and
    optimizer step hooks and the profiler see the step. ``_fp8_unscale`` tells that step to unscale by
    ``inv_scale`` and not to route through a gradient scaler again."""
    optimizer._fp8_unscale = inv_scale  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        optimizer._fp8_unscale = None  # type: ignore[attr-defined]


def _refuse_fp16_grads(optimizer: torch.optim.Optimizer, caller: str = "step") -> None:
    """Raise a ValueError if a plain optimizer has fp16 gradients, which :func:`_unscale_in_place` cannot unscale.

    mu is there for the gradients fp16 cannot hold unscaled: ``g * mu`` is representable where ``g`` (below fp16's
    smallest subnormal, 6e-8, or among its subnormals) is not, and multiplying by ``1 / mu`` in fp16 storage rounds
    them to zero (or to a few bits) again, silently. ``torch.amp.GradScaler`` refuses them ("Attempting to unscale
    FP16 gradients"); bf16 has fp32's range, so unscaling it by a power of two is exact."""
    fp16 = [p for group in optimizer.param_groups for p in group["params"]
            if p.grad is not None and p.grad.dtype == torch.float16]  # fmt: skip
    if fp16:
        raise ValueError(
            f"FP8GradScaler.{caller}: this {type(optimizer).__name__} has fp16 gradients ({len(fp16)} parameter(s) in "
            f"fp16, e.g. one of shape {tuple(fp16[0].shape)}). Its gradients would be unscaled by 1/mu in place, in "
            "fp16, which turns the small gradients that mu made representable (below ~6e-8 unscaled) back into zero, "
            "silently; torch.amp.GradScaler refuses them too ('Attempting to unscale FP16 gradients'). Keep these "
            "parameters in fp32 (compute in fp16/bf16 with torch.autocast), or train them with "
            "lightning_fp8.FP8AdamW(..., grad_scaler=scaler), which unscales each gradient in fp32 inside its step "
            "(and keeps fp16 masters with per-tensor scales for the FP8 weights at O2). Nothing was changed."
        )


def _unscale_in_place(optimizer: torch.optim.Optimizer, inv_scale: float) -> torch.Tensor:
    """Multiply every gradient of a plain optimizer by ``inv_scale``; return a 0-dim non-finite flag.

    A sparse gradient (``nn.Embedding(sparse=True)``) has its values unscaled in place, as in
    ``torch.amp.GradScaler``. fp16 gradients never come here (:func:`_refuse_fp16_grads`): fp32 and bf16 values are
    unscaled exactly, and the sums of a sparse gradient's repeated values overflow only where its values nearly do
    (past 1.7e38), so they are left uncoalesced, as torch.amp leaves them."""
    found = torch.zeros(())
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    for p in params:
        values = p.grad._values() if p.grad.is_sparse else p.grad
        values.mul_(inv_scale)
        bad = (~torch.isfinite(values)).any().float()
        found = found.to(bad.device) + bad
    return found


def _rescale_grad_output_states(model: nn.Module, ratio: float) -> None:
    """mu changed by ``ratio`` (a power of two), so every loss gradient did too: keep delayed scales exact, within
    the range :func:`lightning_fp8.compute_scale` clamps to (a scale at 2**127, a tiny gradient's, would become inf
    when mu halves, and every later gradient NaN)."""
    from lightning_fp8.scaling import ScalingState

    for name, state in model.named_modules():
        if isinstance(state, ScalingState) and name.endswith("grad_output"):
            state.amax_history.mul_(ratio)
            state.amax.mul_(ratio)
            state.scale.div_(ratio).clamp_(2.0**-126, 2.0**127)
