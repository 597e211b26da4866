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
  stayed at least ``headroom`` times under the format maximum; and multiplies it by 16 at each update while every
  fp16 gradient's amax is under ``2**-8`` (O2's FP8 weights get their gradient in fp16 before it is cast: at a small
  mu its small values underflow; see :meth:`~FP8GradScaler.update`). ``fallback_after`` consecutive non-finite steps
  run the ``nonfinite_fallback`` action (lower the learning rate, or put the offending layers back to high
  precision).

Usage, like ``torch.amp.GradScaler``::

    scaler = FP8GradScaler(model=model)   # the model: delayed grad_output scales follow mu
    optimizer = FP8AdamW(model.parameters(), grad_scaler=scaler)
    scaler.scale_loss(loss).backward()
    scaler.step(optimizer)          # or optimizer.step(), which routes through the scaler and also updates
    scaler.update()

Several optimizers share one scaler as with ``torch.amp.GradScaler``: ``scaler.step(opt1); scaler.step(opt2);
scaler.update()``; each step decides on its own optimizer's gradients, and an optimizer is stepped at most once between
updates (docs/concepts/gradient-scaling.md, "Several optimizers").

This module holds the scaler's public surface and its step; its bases, one concern each, live beside it:
:mod:`~lightning_fp8.grad_scaling.arguments` (the arguments and the settings changed later, checked),
:mod:`~lightning_fp8.grad_scaling.readings` (mu and the counts, read-only),
:mod:`~lightning_fp8.grad_scaling.losses` (scaling the loss, and which mu the gradients carry),
:mod:`~lightning_fp8.grad_scaling.model` (the FP8 model whose ``grad_output`` scales mu changes rescale),
:mod:`~lightning_fp8.grad_scaling.reports` (what the casts and checks report, agreed across ranks),
:mod:`~lightning_fp8.grad_scaling.rules` (how :meth:`~FP8GradScaler.update` moves mu and runs the fallback),
:mod:`~lightning_fp8.grad_scaling.unscaling` (clipping and unscaling gradients outside FP8AdamW's fused step) and
:mod:`~lightning_fp8.grad_scaling.state` (the state dict, checked, and pickling).
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import torch
from torch import nn

from lightning_fp8.grad_scaling.arguments import (
    Fallback,
    _check_arguments,
    _Settings,
    check_new_scale,
    check_optimizer,
    fallback_model,
    warn_if_model_is_another,
)
from lightning_fp8.grad_scaling.losses import _LossScaling
from lightning_fp8.grad_scaling.model import _ScalerModel
from lightning_fp8.grad_scaling.readings import _Readings
from lightning_fp8.grad_scaling.reports import _Counts, _GradReports
from lightning_fp8.grad_scaling.rules import _ScaleRules
from lightning_fp8.grad_scaling.state import _HISTORY_LEN, _SCALED_LOSSES_KEPT, _ScalerState
from lightning_fp8.grad_scaling.unscaling import (
    _inner_optimizer,
    _nonfinite_flags,
    _refuse_fp16_grads,
    _step_through_public_step,
    _unscale_in_place,
    _Unscaling,
)


class FP8GradScaler(
    _Settings, _Readings, _LossScaling, _ScalerModel, _Unscaling, _GradReports, _ScaleRules, _ScalerState
):
    """Automatic power-of-two gradient scale mu with skip-on-overflow and recovery.

    Args:
        init_scale: initial mu (a power of two).
        growth_interval: consecutive steps with headroom after which mu doubles.
        saturation_threshold: fraction of gradient values at the FP8 maximum above which mu halves
            (FP8-LM uses 0.001% = 1e-5).
        headroom: mu may double only while every gradient amax is at least this factor under the format maximum.
        min_scale, max_scale: bounds of mu (powers of two from 2**-126 to 2**127: mu multiplies the loss in fp32).
        nonfinite_fallback: what ``fallback_after`` consecutive non-finite steps trigger: ``None`` (only skip and
            halve), ``"lower_lr"`` (multiply every group's learning rate by ``lr_factor``), ``"bf16"`` (put the
            FP8 layers whose gradients were non-finite back to ``nn.Linear``, or, when none of them was, lower the
            learning rate as ``"lower_lr"``; needs ``model``), an ``nn.Module`` (``"bf16"`` on that model, which is
            then ``model``), or a callable ``fn(scaler, optimizer) -> str`` returning what it did.
        process_group: the data-parallel group the decisions are agreed in (default: the world, when
            ``torch.distributed`` is initialized).
        fallback_after: consecutive non-finite steps of one optimizer that trigger the fallback.
        lr_factor: learning-rate multiplier of the ``"lower_lr"`` fallback (0 < lr_factor < 1).
        model: the FP8 model; when given, the ``grad_output`` scaling states of its FP8 layers are rescaled
            exactly whenever mu changes (their delayed scales then stay right), and ``"bf16"`` can find layers.
            Without it (and without an integration, which gives its own), the first step of an optimizer training
            FP8 layers with delayed scaling warns once: their scales lag every change of mu.

    Every argument but ``init_scale`` is also an attribute that can be changed between steps
    (``scaler.growth_interval = 500``, ``scaler.model = model``), checked as the argument is: a bad value raises at
    once and the old one stays.

    Raises:
        ValueError: for a scale that is not a power of two from 2**-126 to 2**127, bounds out of order, or a bad
            threshold or interval.
        TypeError: for an argument of another type (a string or bool for a number, a ``process_group`` that is not a
            ``torch.distributed.ProcessGroup``).
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
        nonfinite_fallback, model = fallback_model(nonfinite_fallback, model)
        _check_arguments(init_scale, growth_interval, saturation_threshold, headroom, min_scale, max_scale,
                         nonfinite_fallback, fallback_after, lr_factor, model, process_group)  # fmt: skip
        self._scale = float(init_scale)
        self.growth_interval = int(growth_interval)
        self.saturation_threshold = float(saturation_threshold)
        self.headroom = float(headroom)
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self.nonfinite_fallback = nonfinite_fallback
        self.process_group = process_group
        self.fallback_after = int(fallback_after)
        self.lr_factor = float(lr_factor)
        self._model = model
        self._model_from_integration = False  # set by _take_model, cleared by setting model
        self._init_running_state()

    def _init_running_state(self) -> None:
        """What a fresh scaler starts with: no step counted, no optimizer seen, no loss scaled, no report."""
        self._growth_tracker = 0
        self._skipped_steps = 0
        self._nonfinite_events = 0
        # Consecutive non-finite steps of each optimizer (weak, like `_owned`): where each optimizer's step()
        # updates, another optimizer's clean update must not restart the count of one that keeps failing.
        self._nonfinite_runs: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        # Consecutive non-finite updates that judged no step (reports alone).
        self._consecutive_nonfinite = 0
        # Each counted optimizer's place among the saved runs (weak; see _serial): an integration's list index
        # (_optimizer_index, kept over loads), else the order of first counting since the last load.
        self._run_order: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        self._optimizer_index: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        self._next_serial = 0
        # The saved runs no optimizer has taken since load_state_dict (or unpickling), by place: an optimizer counted
        # there takes its own. A state dict without them (saved before they were) gave the longest run alone, where
        # every optimizer's run starts: `_restored_run`.
        self._restored_runs: dict[int, int] = {}
        self._restored_run = 0
        self._steps = 0
        self._last_saturation = 0.0
        self._history: collections.deque[dict[str, Any]] = collections.deque(maxlen=_HISTORY_LEN)
        self._last_optimizer: torch.optim.Optimizer | None = None
        self._seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # every optimizer stepped (fallback)
        # Whether the last finite update that judged fp16 gradients (or found no headroom) found a large one: where
        # each optimizer's step() updates, one optimizer's underflowing fp16 gradients must not grow mu past another's
        # (rules.py: _fp16_underflows). Saved in the state dict.
        self._fp16_full = False
        self._seen_unbound: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # FP8AdamW not reporting here
        self._warned_no_model = False  # see _warn_if_no_model
        # The casts an optimizer reported of its own gradients (FP8AdamW's), kept for that optimizer's step: where
        # each optimizer's step() also updates, one optimizer's update must not judge (and drop) another's. Weak:
        # an optimizer that is dropped with gradients pending is not kept alive.
        self._owned: weakref.WeakKeyDictionary[Any, _Counts] = weakref.WeakKeyDictionary()
        # Per param.grad of an optimizer, a 0-dim flag (> 0: it held inf or NaN), taken when its step was skipped or
        # its gradients unscaled by unscale_ (weak): the "bf16" fallback blames layers by those of the skipped
        # optimizers, also where the loop zeroes the gradients before update().
        self._nonfinite_grad_flags: weakref.WeakKeyDictionary[
            torch.optim.Optimizer, dict[torch.Tensor, torch.Tensor]
        ] = weakref.WeakKeyDictionary()
        self._loss_scale: float | None = None  # mu of the last scale_loss: the one the gradients carry
        # The last one-value losses scale_loss returned, detached (the value alone: no graph is kept), each with its
        # serial number and mu; _losses_scaled counts the calls. See scaled_losses.
        self._scaled_losses: collections.deque[tuple[int, torch.Tensor, float]] = collections.deque(
            maxlen=_SCALED_LOSSES_KEPT
        )
        self._losses_scaled = 0
        self._reset_step_counters()

    def _set_optimizer_order(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """The optimizers an integration steps with this scaler, in its order (Lightning's ``trainer.optimizers``):
        each one's run of non-finite steps is saved at its index and resumed from there, however often each steps
        (a GAN's critic stepping five times per generator step); otherwise by the order of first stepping."""
        self._optimizer_index = weakref.WeakKeyDictionary({opt: i for i, opt in enumerate(optimizers)})

    # -------------------------------------------------------------------------------------------- step and update
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> bool:
        """Step ``optimizer`` with gradients unscaled by 1/mu, unless a rank saw a non-finite gradient of it.

        The decision is this optimizer's: its own gradients (FP8AdamW's FP8 gradients and ``param.grad``), and what
        the communication hooks reported since the last :meth:`update`; other optimizers' gradients do not count, as
        in ``torch.amp.GradScaler``. An :class:`~lightning_fp8.FP8AdamW` unscales inside its fused kernel; any other
        optimizer has its gradients unscaled (and checked) in place first. The step runs through
        ``optimizer.step()``, so LR schedulers and optimizer step hooks see it (not when skipped, as with torch.amp).
        A wrapper holding the optimizer as ``.optimizer`` (Accelerate's, Lightning's) is stepped through its own
        ``step()`` and counts as the optimizer inside, as in :meth:`unscale_`: ``unscale_(wrapper)`` then
        ``step(wrapper)`` unscales the gradients once.

        Returns:
            True when the optimizer stepped, False when the step was skipped.

        Raises:
            RuntimeError: when ``optimizer`` was already stepped since the last :meth:`update` (as in
                ``torch.amp.GradScaler``: its gradients would be unscaled twice). A step that raised (the error
                propagates) does not count: it can be made again, with its gradients as they were left (a plain
                optimizer's are not unscaled twice).
            RuntimeError: also when ``optimizer`` holds gradients and no loss was scaled by this scaler since its
                construction or its last :meth:`load_state_dict` (a ``loss.backward()`` in place of
                ``scaler.scale_loss(loss).backward()``): the gradients do not carry mu, and unscaling them would make
                the update 1/mu of what it should be (``torch.amp.GradScaler`` refuses this too). Raised before
                anything is changed.
            ValueError: when ``optimizer`` is not an FP8AdamW and has fp16 gradients (fp16 parameters), as
                ``torch.amp.GradScaler`` refuses them: unscaling them in fp16 would turn the small gradients mu made
                representable back to zero. Raised before anything is changed.
            TypeError: for arguments after the optimizer (a closure, which ``torch.amp.GradScaler`` refuses as a
                keyword too): the step runs ``optimizer.step()`` on the gradients of the scaled backward made.
        """
        if args or kwargs:
            given = ", ".join([*(type(a).__name__ for a in args), *kwargs])
            raise TypeError(
                f"FP8GradScaler.step(optimizer) takes the optimizer alone, got also {given}: a closure is not "
                "supported (as with torch.amp.GradScaler); compute the loss, scaler.scale_loss(loss).backward(), "
                "then scaler.step(optimizer)"
            )
        check_optimizer("step", optimizer)
        # An optimizer wrapper (Accelerate's, Lightning's) is stepped through its step(), as torch.amp steps what it
        # is given; the records are those of the optimizer inside, which unscale_(wrapper) keeps too.
        wrapper, optimizer = optimizer, _inner_optimizer(optimizer)
        if any(stepped is optimizer for stepped, _ in self._stepped):
            raise RuntimeError(
                f"FP8GradScaler.step(optimizer): step() has already been called since the last update() for this "
                f"{type(optimizer).__name__}; call scaler.update() between two steps of one optimizer"
            )
        fused = getattr(optimizer, "_fp8_step", None)
        if fused is None:  # before anything changes
            _refuse_fp16_grads(optimizer)
        self._refuse_unscaled_loss(optimizer, "step")
        self._refuse_fallback_without_model()
        if optimizer not in self._seen:
            warn_if_model_is_another(self._model, optimizer)
            self._warn_if_no_model(optimizer)
        self._last_optimizer = optimizer
        self._seen.add(optimizer)
        inv_scale = 1.0 / self.loss_scale
        self._warn_unbound(optimizer, fused)
        reported, own = self._own_counts(optimizer, fused, inv_scale)
        step_found = own.found() if self._shared.stats is None else own.found() + self._shared.found().to(
            own.found().device)  # fmt: skip
        window, active = self._window, self._active
        self._window = self._window.copy().merge(own)
        self._active = True
        skip = self._agree(step_found) > 0
        self._stepped.append((optimizer, skip))
        try:
            return self._step_or_skip(wrapper, optimizer, fused, skip, inv_scale)
        except BaseException:  # not a step: as before it (the reports kept, the optimizer free to step again)
            self._stepped.pop()
            self._window, self._active = window, active
            if reported is not None:
                self._owned[optimizer] = reported
            raise

    def _own_counts(
        self, optimizer: torch.optim.Optimizer, fused: Any, inv_scale: float
    ) -> tuple[_Counts | None, _Counts]:
        """``(reported, own)``: the casts ``optimizer`` reported since its last step (taken from ``_owned``), and
        a copy of them with the checks of its gradients now added (a plain optimizer's unscaled in place first)."""
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
        return reported, own

    def _step_or_skip(
        self, wrapper: torch.optim.Optimizer, optimizer: torch.optim.Optimizer, fused: Any, skip: bool, inv_scale: float
    ) -> bool:
        """Skip ``optimizer``'s step (dropping an FP8AdamW's pending FP8 gradients), or run it unscaled by
        ``inv_scale`` through ``wrapper.step()`` (``wrapper``: what ``step`` was given, ``optimizer`` or a wrapper of
        it). Returns whether it stepped."""
        if skip:
            self._nonfinite_grad_flags[optimizer] = _nonfinite_flags(optimizer)
            skip_fn = getattr(optimizer, "_fp8_skip", None)
            if skip_fn is not None:
                skip_fn()
            return False
        if fused is not None and not getattr(optimizer, "_fp8_in_step", False):
            _step_through_public_step(wrapper, inv_scale, optimizer)
        elif fused is not None:  # called by optimizer.step() itself (FP8AdamW(grad_scaler=self))
            fused(inv_scale)
        else:
            wrapper.step()
        return True

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Halve or grow mu as specified, run the fallback if due, and reset the per-step counters.

        ``new_scale`` (``torch.amp.GradScaler.update(new_scale)``): mu is set to it once the update has run (skipped
        steps counted, the fallback run if due), a power of two within ``[min_scale, max_scale]`` given as a number
        or a one-element tensor, and recorded in :attr:`history` as ``"set"``; the count toward ``growth_interval``
        stays as it was before this update, as in torch.amp. Every rank must pass the same value.

        Judges every optimizer stepped since the last update (mu halves if any was skipped) and what the
        communication hooks reported; with no step since, everything reported. mu is multiplied by 16 at once while
        every fp16 gradient's mu-scaled amax is positive and under ``2**-8`` (O2's FP8 weights get their gradient in
        fp16 first; the rule and when it waits: docs/concepts/gradient-scaling.md). With gradient accumulation it
        judges the accumulated gradient. An optimizer whose gradients :meth:`unscale_` checked and that was not
        stepped counts as ``torch.amp.GradScaler`` counts it: non-finite, mu halves and it counts as skipped; finite,
        as a step. A call with nothing recorded, unscaled or stepped since the last update does nothing (so calling
        both ``optimizer.step()``, which updates, and ``update()`` is harmless). The counters are reset also when the
        fallback raises (the error propagates).
        """
        if new_scale is not None:
            new_scale = check_new_scale(new_scale, self.min_scale, self.max_scale)  # before anything changes
        tracker = self._growth_tracker
        self._update(judge_unstepped=True)
        if new_scale is not None:
            self._growth_tracker = tracker  # as torch.amp: an update setting mu leaves the growth count as it was
            self._set_scale(new_scale, "set", "update(new_scale)")

    def _update(self, judge_unstepped: bool) -> None:
        """:meth:`update`; the update run right after one optimizer's step (``FP8AdamW(grad_scaler=...).step()``, the
        integrations) passes ``judge_unstepped=False``: another optimizer unscaled and not stepped yet keeps its
        unscaled gradients and its check for its own step and update (judged there, and not unscaled twice)."""
        unstepped = [(opt, flag, self._unscale_counts.get(opt)) for opt, flag in list(self._unscaled.items())
                     if not any(stepped is opt for stepped, _ in self._stepped)]  # fmt: skip
        judged, kept = (unstepped, []) if judge_unstepped else ([], unstepped)
        if not self._active and not judged:
            return
        if not self._stepped:  # reports without a step: judge them all
            for counts in list(self._owned.values()):
                self._window = self._window.merge(counts)
            self._owned.clear()
        for optimizer, flag, counts in judged:  # checked by unscale_, not stepped: judged as a step skipped or made
            if counts is None:  # a step that raised after unscaling them: measured now
                counts = self._unscaled_counts(optimizer, flag)
            self._window = self._window.copy().merge(counts.copy())
            self._active, self._agreed = True, None
            self._stepped.append((optimizer, self._agree(flag) > 0))  # its flags: taken by unscale_
        if self._agreed is None:
            self._agree()
        decision = self._agreed
        try:
            self._steps += 1
            if decision["found"] > 0:
                self._last_saturation = self._saturated_fraction(decision)  # this step's, not the last stepped one's
                self._back_off()
            else:
                self._judge_saturation_and_headroom(decision)
        finally:
            self._reset_step_counters()
            for optimizer, flag, counts in kept:
                self._unscaled[optimizer] = flag
                if counts is not None:
                    self._unscale_counts[optimizer] = counts

    def __repr__(self) -> str:
        return (
            f"FP8GradScaler(scale={self._scale}, growth_interval={self.growth_interval}, "
            f"skipped_steps={self._skipped_steps})"
        )
