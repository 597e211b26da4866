"""How :meth:`FP8GradScaler.update <lightning_fp8.FP8GradScaler.update>` moves mu once it has agreed on a step.

A non-finite step halves mu and counts toward the ``nonfinite_fallback`` (run after ``fallback_after`` consecutive
non-finite steps of one optimizer); a finite one halves mu when the saturated fraction passed
``saturation_threshold``, multiplies it by 16 while fp16 gradients underflow (:meth:`_ScaleRules._fp16_underflows`),
and doubles it after ``growth_interval`` steps with headroom. Every change of mu rescales the
``grad_output`` scaling states of the model's FP8 layers by the same power of two, so their delayed scales stay exact.
:class:`_ScaleRules` is a base of the scaler and reads its settings and counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn

from lightning_fp8 import load_pairing
from lightning_fp8.grad_scaling.reports import SMALL_FP16_AMAX

if TYPE_CHECKING:
    from lightning_fp8.scaling import ScalingState


class _ScaleRules:
    """The update rules of mu (see the module docstring); the attributes are ``FP8GradScaler``'s."""

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
            self._restored_runs = dict.fromkeys(self._restored_runs, 0)
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
                if opt not in self._run_order:  # counted for the first time: it takes its saved run
                    self._run_order[opt] = serial = self._serial(opt)
                    if serial in self._restored_runs:
                        runs[opt] = self._restored_runs.pop(serial)
                start = max(self._restored_run, self._consecutive_nonfinite)  # an optimizer not counted yet
                runs[opt] = runs.get(opt, start) + 1 if failed else 0
            self._consecutive_nonfinite = 0
        else:
            for opt in list(runs):
                runs[opt] = runs[opt] + 1 if nonfinite else 0
            self._restored_runs = {k: run + 1 if nonfinite else 0 for k, run in self._restored_runs.items()}
            self._consecutive_nonfinite = self._consecutive_nonfinite + 1 if nonfinite else 0

    def _serial(self, optimizer: object) -> int:
        """Where ``optimizer``'s run is saved: its index in the integration's list (:meth:`_set_optimizer_order`),
        else the next place no optimizer holds, in the order they were first counted (since the last load)."""
        index = self._optimizer_index.get(optimizer)
        if index is not None:
            return index
        taken = {*self._run_order.values(), *self._optimizer_index.values()}
        while self._next_serial in taken:
            self._next_serial += 1
        self._next_serial += 1
        return self._next_serial - 1

    def _runs_in_order(self) -> list[int]:
        """Each optimizer's run of consecutive non-finite steps in the order of their places (:meth:`_serial`), with
        the saved runs no optimizer has taken since the load in theirs: what is saved."""
        start = max(self._restored_run, self._consecutive_nonfinite)  # where a cleared optimizer's run continues
        runs = {serial: self._nonfinite_runs.get(opt, start) for opt, serial in self._run_order.items()}
        runs.update(self._restored_runs)
        return [runs[serial] for serial in sorted(runs)]

    def _longest_nonfinite_run(self) -> int:
        """The most consecutive non-finite steps of any one optimizer (what ``fallback_after`` is compared with); the
        restored run while no optimizer has been counted since the restore."""
        runs = self._nonfinite_runs
        return max((*runs.values(), self._consecutive_nonfinite, 0 if runs else self._restored_run))

    @staticmethod
    def _fp16_judged_full(decision: dict[str, float]) -> bool:
        """Whether this update's fp16 gradients leave no room to grow mu: one is large, or one has no headroom."""
        return bool(decision["fp16_large"] or decision["no_headroom"])

    def _fp16_underflows(self, decision: dict[str, float]) -> bool:
        """Whether mu grows 16x at this finite update: there were fp16 gradients with a positive amax, every one
        under ``SMALL_FP16_AMAX``; the last update that judged fp16 gradients (another optimizer's, where each
        optimizer's step() updates) did not find a larger one or a gradient without headroom; and mu was not halved
        within ``growth_interval`` updates."""
        small, full = bool(decision["fp16_small"]), self._fp16_judged_full(decision)
        return small and not full and not self._fp16_full and not self._backed_off_recently()

    def _note_fp16_verdict(self, decision: dict[str, float]) -> None:
        """Keep this update's fp16 verdict for the next one (``_fp16_full``); an update without fp16 gradients keeps
        the verdict it found."""
        full = self._fp16_judged_full(decision)
        if decision["fp16_small"] or full:
            self._fp16_full = full

    @staticmethod
    def _saturated_fraction(decision: dict[str, float]) -> float:
        """The fraction of the values the step's FP8 casts held that saturated (:attr:`last_saturation`)."""
        return decision["n_saturated"] / decision["cast_numel"] if decision["cast_numel"] else 0.0

    def _judge_saturation_and_headroom(self, decision: dict[str, float]) -> None:
        self._count_nonfinite_runs(nonfinite=False)
        underflows = self._fp16_underflows(decision)
        self._note_fp16_verdict(decision)
        numel = decision["numel"]  # all values measured (cast_numel: those an FP8 cast held)
        self._last_saturation = self._saturated_fraction(decision)
        if self._last_saturation > self.saturation_threshold:
            self._growth_tracker = 0
            self._set_scale(self._scale / 2, "halve", f"saturated fraction {self._last_saturation:.3g}")
        elif numel and underflows:
            # fp16 gradients underflow at this mu (reports.SMALL_FP16_AMAX): grow now, not after growth_interval, by
            # 2**4 (their amaxes stay under 2**-4, far from fp16's 65504)
            self._growth_tracker = 0
            self._set_scale(self._scale * 16, "grow", f"every fp16 gradient amax under {SMALL_FP16_AMAX:g}")
        elif numel and decision["no_headroom"] == 0:
            self._growth_tracker += 1
            if self._growth_tracker >= self.growth_interval:
                self._growth_tracker = 0
                self._set_scale(self._scale * 2, "double", f"headroom for {self.growth_interval} steps")
        elif numel or decision["no_headroom"]:  # a gradient without headroom; an update that measured none (an
            # optimizer stepped without gradients, where each optimizer's step() updates) leaves the count as it was
            self._growth_tracker = 0

    def _backed_off_recently(self) -> bool:
        """Whether mu was halved (a skipped step, saturation) within the last ``growth_interval`` updates: the fast
        growth of underflowing fp16 gradients then waits, as the usual growth does, so that gradients which overflow
        elsewhere at the grown mu (fp16 activations) do not make mu grow and fall back at every step."""
        for entry in reversed(self._history):
            if self._steps - entry["step"] >= self.growth_interval:
                return False
            if entry["action"] in ("skip", "halve"):
                return True
        return False

    def _set_scale(self, new_scale: float, action: str, reason: str) -> None:
        new_scale = min(max(new_scale, self.min_scale), self.max_scale)
        ratio = new_scale / self._scale
        self._scale = new_scale
        # A skip is an event whatever mu does; a halving or doubling held at min_scale / max_scale did not happen,
        # and recording it every growth_interval steps would push the real entries out of the history.
        if action == "skip" or ratio != 1.0:
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
            targets = skipped or [optimizer]
            flags = {p: f for opt in targets for p, f in self._nonfinite_grad_flags.get(opt, {}).items()}
            what = recovery.fallback_to_high_precision(
                self.model, [*self._seen] or optimizer, self.lr_factor, skipped=targets, nonfinite_grads=flags
            )
        else:
            what = str(fallback(self, optimizer))
        reason = f"{self.fallback_after} consecutive non-finite steps"
        self._history.append(
            {"step": self._steps, "action": "fallback", "reason": f"{reason}: {what}", "scale": self._scale}
        )


# The buffers of a grad_output scaling state that a change of mu rescales (rescale_grad_output_state).
RESCALED_BUFFERS = ("amax_history", "amax", "scale")


def rescale_grad_output_state(state: ScalingState, ratio: float) -> None:
    """mu changed by ``ratio`` (a power of two): rescale one ``grad_output`` state's :data:`RESCALED_BUFFERS`, its
    scale within the range :func:`lightning_fp8.compute_scale` clamps to (a scale at 2**127, a tiny gradient's, would
    become inf when mu halves, and every later gradient NaN). The one rescale of every change of mu, at runtime or
    on a load (:func:`_rescale_grad_output_states`, :func:`lightning_fp8.load_fp8_state_dict`)."""
    state.amax_history.mul_(ratio)
    state.amax.mul_(ratio)
    state.scale.div_(ratio).clamp_(2.0**-126, 2.0**127)


def _rescale_grad_output_states(model: nn.Module, ratio: float, loading: bool = False, correction: float = 1.0) -> None:
    """mu changed by ``ratio`` (a power of two), so every loss gradient did too: keep delayed scales exact
    (:func:`rescale_grad_output_state`).

    With ``loading`` (a scaler state was loaded), a state that :func:`~lightning_fp8.load_fp8_state_dict` filled since
    its last cast holds the values saved beside the checkpoint's mu (the same checkpoint): it is rescaled by
    ``correction`` (the loaded mu over the saved one: 1 unless the saved mu was brought within this scaler's bounds)
    instead of ``ratio``. An FP8 state load still to come does the same (:mod:`lightning_fp8.load_pairing`)."""
    from lightning_fp8.scaling import ScalingState

    for name, state in model.named_modules():
        if isinstance(state, ScalingState) and load_pairing.is_grad_output(name):
            if loading:
                factor = load_pairing.scaler_loaded(state, ratio, correction)
            else:
                load_pairing.forget_loads(state)
                factor = ratio
            if factor != 1.0:
                rescale_grad_output_state(state, factor)
