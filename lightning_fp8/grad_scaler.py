"""FP8GradScaler: the automatic gradient scale mu of FP8-LM (DESIGN.md "Automatic gradient scaling").

FP8 (and fp16) gradients have a narrow range. mu multiplies the loss, so every gradient computed from it is
multiplied by mu; the optimizer divides it out again. mu is a power of two, so scaling and unscaling are exact.

- Every FP8 cast of a gradient that mu governs reports its amax and saturation count
  (:meth:`FP8GradScaler.record_gradient_cast`): the optimizer's gradient cast, the FP8 communication hooks.
- Gradients that stay in high precision (no FP8 cast of them reported in a step, e.g. FP8AdamW with
  ``fp8_grads=False`` and no FP8 communication) are measured by :meth:`~FP8GradScaler.step` itself, in one fused
  amax reduction per device and dtype, against their own dtype's maximum (fp16: 65504). They cannot saturate (a
  value past the maximum becomes inf, a non-finite step), so for them only the headroom and non-finite rules apply.
- :meth:`~FP8GradScaler.step` agrees across data-parallel ranks with one small all-reduce, then skips the
  optimizer step when any rank saw a non-finite gradient, else steps with the gradients unscaled by 1/mu.
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
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_fp8 import ops
from lightning_fp8.formats import fp8_max

# Actions kept in `history` (oldest dropped first): enough for monitoring, bounded for long runs.
_HISTORY_LEN = 1000
_FALLBACKS = ("lower_lr", "bf16")

Fallback = str | nn.Module | Callable[["FP8GradScaler", torch.optim.Optimizer], str]


def _is_power_of_two(x: float) -> bool:
    return x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5


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
        fallback_after: consecutive non-finite steps that trigger the fallback.
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
        self._consecutive_nonfinite = 0
        self._steps = 0
        self._last_saturation = 0.0
        self._history: collections.deque[dict[str, Any]] = collections.deque(maxlen=_HISTORY_LEN)
        self._last_optimizer: torch.optim.Optimizer | None = None
        self._reset_step_counters()

    # ----------------------------------------------------------------------------------------------- read-only stats
    @property
    def scale(self) -> torch.Tensor:
        """mu, a 0-dim fp32 tensor (a power of two)."""
        return torch.tensor(self._scale, dtype=torch.float32)

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
        """``loss * mu``: call ``.backward()`` on the result."""
        return loss * self._scale

    def record_gradient_cast(
        self,
        amax: torch.Tensor,
        n_saturated: torch.Tensor,
        numel: int,
        fp8_dtype: torch.dtype,
        scale: torch.Tensor | float | None = None,
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
        """
        amax = amax.detach().float()
        self._ensure_device(amax.device)
        fmax = fp8_max(fp8_dtype)
        self._active = True
        scaled = amax if scale is None else amax * torch.as_tensor(scale, dtype=torch.float32, device=amax.device)
        found = (~torch.isfinite(amax)).float()
        n_saturated = n_saturated.detach().to(self._n_saturated.device, torch.float64)
        no_headroom = (scaled * self.headroom > fmax).to(torch.float64)
        if amax.dim():  # several casts: sums of 0/1 flags and integer counts, exact in any order
            found, n_saturated, no_headroom = found.sum(), n_saturated.sum(), no_headroom.sum()
        self._found.add_(found)
        self._n_saturated.add_(n_saturated)
        self._no_headroom.add_(no_headroom)
        self._numel += int(numel)

    def record_nonfinite(self, found: torch.Tensor) -> None:
        """Report a non-finite gradient check: a 0-dim tensor, > 0 when a non-finite value was seen."""
        found = found.detach()
        self._ensure_device(found.device)
        self._active = True
        self._found.add_((found.float() > 0).float().to(self._found.device))

    def _record_high_precision_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """Report the headroom of ``optimizer``'s mu-scaled ``param.grad`` under their dtype's maximum.

        One ``_foreach_norm(inf)`` per (device, dtype) and no host synchronization: the per-step all-reduce in
        :meth:`_agree` reads the counters. Counts as casts with no saturated values (high-precision values do not
        clamp: past the maximum they become inf, which marks the step non-finite).
        """
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = collections.defaultdict(list)
        for group in optimizer.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is None or grad.is_sparse:
                    continue
                grad = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor: this rank's shard
                if grad.numel() and grad.is_floating_point():
                    by_kind[(grad.device, grad.dtype)].append(grad)
        for (device, dtype), grads in by_kind.items():
            self._ensure_device(device)
            amax = torch.stack(ops.amaxes(grads)).to(self._found.device)  # NaN counted as inf
            self._found.add_((~torch.isfinite(amax)).any().float())
            no_headroom = (amax * self.headroom > torch.finfo(dtype).max).sum()
            self._no_headroom.add_(no_headroom.to(torch.float64))
            self._numel += sum(grad.numel() for grad in grads)
        self._active = self._active or bool(by_kind)

    def _ensure_device(self, device: torch.device) -> None:
        if self._device is None:
            self._device = device
            self._found = self._found.to(device)
            self._n_saturated = self._n_saturated.to(device)
            self._no_headroom = self._no_headroom.to(device)

    def _reset_step_counters(self) -> None:
        self._device: torch.device | None = None
        self._active = False  # something was recorded or stepped since the last update
        self._found = torch.zeros((), dtype=torch.float32)
        self._n_saturated = torch.zeros((), dtype=torch.float64)
        self._no_headroom = torch.zeros((), dtype=torch.float64)
        self._numel = 0
        self._decision: dict[str, float] | None = None

    # -------------------------------------------------------------------------------------------- step and update
    def _agree(self) -> dict[str, float]:
        """The step's statistics summed over the data-parallel ranks: one all-reduce and one host sync."""
        if self._decision is not None:
            return self._decision
        device = self._device if self._device is not None else torch.device("cpu")
        packed = torch.stack(
            [
                self._found.to(device, torch.float64),
                self._n_saturated.to(device),
                torch.tensor(float(self._numel), dtype=torch.float64, device=device),
                self._no_headroom.to(device),
            ]
        )
        if dist.is_available() and dist.is_initialized():
            group = self.process_group
            if dist.get_world_size(group) > 1:
                if dist.get_backend(group) == "nccl" and packed.device.type != "cuda":
                    packed = packed.cuda()
                dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        found, n_sat, numel, no_headroom = packed.tolist()
        self._decision = {"found": found, "n_saturated": n_sat, "numel": numel, "no_headroom": no_headroom}
        return self._decision

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step ``optimizer`` with gradients unscaled by 1/mu, unless a rank saw a non-finite gradient.

        An :class:`~lightning_fp8.FP8AdamW` unscales inside its fused kernel; any other optimizer has its
        gradients unscaled (and checked) in place first.

        Returns:
            True when the optimizer stepped, False when the step was skipped.
        """
        self._last_optimizer = optimizer
        inv_scale = 1.0 / self._scale
        fused = getattr(optimizer, "_fp8_step", None)
        if fused is not None:
            self.record_nonfinite(optimizer._nonfinite_grads())  # flushes FP8AdamW's queued gradient casts first
        if self._numel == 0:  # no FP8 gradient cast this step: judge the headroom of the high-precision gradients
            self._record_high_precision_grads(optimizer)
        if fused is None:
            self.record_nonfinite(_unscale_in_place(optimizer, inv_scale))
        decision = self._agree()
        self._active = True
        if decision["found"] > 0:
            decision["skipped"] = 1.0
            skip = getattr(optimizer, "_fp8_skip", None)
            if skip is not None:
                skip()
            return False
        if fused is not None:
            fused(inv_scale)
        else:
            optimizer.step()
        return True

    def update(self) -> None:
        """Halve or double mu as specified, run the fallback if due, and reset the per-step counters.

        A call with nothing recorded and no :meth:`step` since the last update does nothing (so calling both
        ``optimizer.step()``, which updates, and ``update()`` is harmless).
        """
        if not self._active:
            return
        decision = self._agree()
        self._steps += 1
        if decision.get("skipped") or decision["found"] > 0:
            self._skipped_steps += 1
            self._nonfinite_events += 1
            self._consecutive_nonfinite += 1
            self._growth_tracker = 0
            self._set_scale(self._scale / 2, "skip", "non-finite gradient")
            if self._consecutive_nonfinite >= self.fallback_after and self.nonfinite_fallback is not None:
                self._run_fallback()
                self._consecutive_nonfinite = 0
        else:
            self._consecutive_nonfinite = 0
            numel = decision["numel"]
            self._last_saturation = decision["n_saturated"] / numel if numel else 0.0
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
        self._reset_step_counters()

    def _set_scale(self, new_scale: float, action: str, reason: str) -> None:
        new_scale = min(max(new_scale, self.min_scale), self.max_scale)
        ratio = new_scale / self._scale
        self._scale = new_scale
        self._history.append({"step": self._steps, "action": action, "reason": reason, "scale": new_scale})
        if ratio != 1.0 and self.model is not None:
            _rescale_grad_output_states(self.model, ratio)

    def _run_fallback(self) -> None:
        from lightning_fp8 import recovery

        optimizer = self._last_optimizer
        fallback = self.nonfinite_fallback
        if fallback == "lower_lr":
            what = recovery.lower_lr(optimizer, self.lr_factor)
        elif fallback == "bf16":
            what = recovery.fallback_to_high_precision(self.model, optimizer, self.lr_factor)
        else:
            what = str(fallback(self, optimizer))
        reason = f"{self.fallback_after} consecutive non-finite steps"
        self._history.append({"step": self._steps, "action": "fallback", "reason": f"{reason}: {what}",
                              "scale": self._scale})

    # ------------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain Python values (loads with ``torch.load(weights_only=True)``)."""
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "skipped_steps": self._skipped_steps,
            "nonfinite_events": self._nonfinite_events,
            "consecutive_nonfinite": self._consecutive_nonfinite,
            "steps": self._steps,
            "last_saturation": self._last_saturation,
            "history": [dict(entry) for entry in self._history],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved.

        Raises:
            KeyError: when an entry is missing (not an FP8GradScaler state dict).
            ValueError: for a scale that is not a positive power of two (nothing is loaded).
        """
        missing = sorted(set(self.state_dict()) - set(state_dict))
        if missing:
            raise KeyError(f"FP8GradScaler.load_state_dict: missing entries {missing}; is this a scaler state dict?")
        scale = float(state_dict["scale"])
        if not _is_power_of_two(scale):
            raise ValueError(
                f"FP8GradScaler.load_state_dict: scale {scale!r} is not a positive power of two: the checkpoint is "
                "corrupt or not an FP8GradScaler state dict"
            )
        self._scale = scale
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._skipped_steps = int(state_dict["skipped_steps"])
        self._nonfinite_events = int(state_dict["nonfinite_events"])
        self._consecutive_nonfinite = int(state_dict["consecutive_nonfinite"])
        self._steps = int(state_dict["steps"])
        self._last_saturation = float(state_dict["last_saturation"])
        self._history = collections.deque((dict(e) for e in state_dict["history"]), maxlen=_HISTORY_LEN)

    def __repr__(self) -> str:
        return (
            f"FP8GradScaler(scale={self._scale}, growth_interval={self.growth_interval}, "
            f"skipped_steps={self._skipped_steps})"
        )


def _unscale_in_place(optimizer: torch.optim.Optimizer, inv_scale: float) -> torch.Tensor:
    """Multiply every gradient of a plain optimizer by ``inv_scale``; return a 0-dim non-finite flag."""
    found = torch.zeros(())
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    for grad in grads:
        if grad.is_sparse:
            grad = grad.coalesce()._values()
        grad.mul_(inv_scale)
        bad = (~torch.isfinite(grad)).any().float()
        found = found.to(bad.device) + bad
    return found


def _rescale_grad_output_states(model: nn.Module, ratio: float) -> None:
    """mu changed by ``ratio`` (a power of two), so every loss gradient did too: keep delayed scales exact."""
    from lightning_fp8.scaling import ScalingState

    for name, state in model.named_modules():
        if isinstance(state, ScalingState) and name.endswith("grad_output"):
            state.amax_history.mul_(ratio)
            state.amax.mul_(ratio)
            state.scale.div_(ratio)
