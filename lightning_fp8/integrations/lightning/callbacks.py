"""Callbacks that log FP8 scaling and training health through the Trainer's loggers.

Both only *read* what the core exposes (:func:`lightning_fp8.fp8_stats`, :class:`lightning_fp8.HealthMonitor`)
and work with any logger (TensorBoard, CSV, W&B...); without a logger they warn once and keep their values
in memory (``.last_metrics``, ``.alerts`` / ``.monitor``).

Logged keys (``fp8/`` and ``health/`` prefixes), see the class docstrings.
"""

from __future__ import annotations

import copy
import math
import numbers
import sys
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_fp8.monitoring.config import MonitorArgumentTypeError
from lightning_fp8.monitoring.scale_jumps import ScaleJumps
from lightning_fp8.recipe import as_count, check_flag
from lightning_fp8.recovery import fallen_back_layers
from lightning_fp8.stats import fp8_stats
from lightning_fp8.warnings import warn_once

SUMMARY_FIELDS = ("scale_min", "scale_max", "amax_max", "saturation_max", "saturation_mean", "nonfinite_count")
LAYER_FIELDS = ("scale", "amax", "saturation")
SCALER_FIELDS = ("scale", "skipped_steps", "last_saturation", "nonfinite_events")


# The attribute reads_scaled_gradients sets on a hook function (FP8LMPrecision looks for it).
SCALED_GRADIENTS_MARK = "_reads_scaled_gradients"


def reads_scaled_gradients(hook: Callable) -> Callable:
    """Mark a callback's ``on_before_optimizer_step`` that reads gradients as they are and divides by
    ``FP8LMPrecision.gradient_factor()`` itself: the plugin then does not unscale them for it (a subclass that
    overrides the hook is a reader again)."""
    setattr(hook, SCALED_GRADIENTS_MARK, True)
    return hook


def _check_count(owner: str, name: str, value: Any, low: int, meaning: str = "") -> int:
    """``value`` as an ``int`` (a NumPy integer too, not a bool) of at least ``low``, or raise naming
    ``owner(name=value)``: :class:`MonitorArgumentTypeError` for another type, ``ValueError`` below ``low``."""
    value = as_count(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise MonitorArgumentTypeError(
            f"{owner}({name}={value!r}) must be an int >= {low}{meaning}, got {type(value).__name__}"
        )
    if value < low:
        raise ValueError(f"{owner}({name}={value!r}) must be an int >= {low}{meaning}")
    return value


def _unwrap_optimizer(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer -> torch optimizer


def grad_scaler_of(trainer: Trainer) -> Any | None:
    """The FP8GradScaler of the run: the precision plugin's, else the first optimizer's (``grad_scaler``)."""
    scaler = getattr(trainer.precision_plugin, "grad_scaler", None)
    if scaler is None:
        for optimizer in trainer.optimizers:
            scaler = getattr(_unwrap_optimizer(optimizer), "grad_scaler", None)
            if scaler is not None:
                break
    return scaler if hasattr(scaler, "scale_loss") else None


def batches_stepped(trainer: Trainer) -> int:
    """Training batches whose optimizer step is done, the current one included when called from
    ``on_train_batch_end``: what ``Trainer(log_every_n_steps)`` counts.

    Lightning counts a batch once however many optimizers stepped in it (manual optimization with two optimizers
    advances ``global_step`` by 2 per batch), and restores the count when resuming. Its logger connector reads the
    same private counter (``_LoggerConnector.should_update_logs``); a test fails loudly if it moves.
    """
    return trainer.fit_loop.epoch_loop._batches_that_stepped + 1


class _LoggingCallback(Callback):
    """Shared: when to log (every ``log_every_n_steps`` batches that stepped, counted as Lightning counts them),
    and logging with or without loggers."""

    def __init__(self, log_every_n_steps: int | None) -> None:
        if log_every_n_steps is not None:
            log_every_n_steps = _check_count(type(self).__name__, "log_every_n_steps", log_every_n_steps, 1)
        self.log_every_n_steps = log_every_n_steps
        self.last_metrics: dict[str, float] = {}
        self._last_step = -1
        self._published: set[str] = set()  # the keys of the last _publish, replaced by the next one's
        # Batch counts (batches_stepped) of this and of the previous observed optimizer step; None before the first.
        self._batch: int | None = None
        self._previous_batch = 0

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A new training (another Trainer starting below the steps this callback observed, no checkpoint resumed):
        # the previous one's series, alerts and last scales are not this one's to continue.
        if trainer.global_step < self._last_step and trainer.ckpt_path is None:
            self._start_afresh()
        # The step count fit starts from (0, or a resumed run's): no optimizer step has happened at it yet.
        self._last_step = trainer.global_step
        self._batch = None

    def _start_afresh(self) -> None:
        """Forget what the previous training observed; the settings stay."""
        self.last_metrics = {}

    def _stepped(self, trainer: Trainer) -> bool:
        """True once per batch whose optimizers stepped (not per accumulated micro-batch); call it from
        ``on_train_batch_end``."""
        if trainer.global_step == self._last_step:
            return False
        self._last_step = trainer.global_step
        batch = batches_stepped(trainer)
        # First step of a fit: the batch before it was observed (by this run, or by the run that saved the
        # checkpoint), whichever count Lightning resumed from.
        self._previous_batch, self._batch = (self._batch if self._batch is not None else batch - 1), batch
        return True

    def _due(self, trainer: Trainer) -> bool:
        """Whether the step :meth:`_stepped` just observed is one to log: a multiple of the period was reached
        since the previous one (so a batch that stepped nothing does not make the callback miss its turn)."""
        every = self.log_every_n_steps if self.log_every_n_steps is not None else trainer.log_every_n_steps
        if not every:  # Trainer(log_every_n_steps=0), or barebones=True: Lightning logs nothing, nor do we
            return False
        return self._batch // every > self._previous_batch // every or trainer.should_stop

    @property
    @override
    def state_key(self) -> str:
        # Each instance files its state under its own key, as ModelCheckpoint does (Lightning refused a second instance
        # sharing one: a summary every step beside all layers every 100). The key names only the settings that differ
        # from the defaults, so a monitor with default settings keeps the class name, the key older versions wrote.
        changed = {name: value for name, (value, default) in self._settings().items() if value != default}
        return self._generate_state_key(**changed) if changed else type(self).__qualname__

    def _settings(self) -> dict[str, tuple[Any, Any]]:
        """The constructor arguments that tell two instances apart: ``{name: (value, default)}``."""
        return {"log_every_n_steps": (self.log_every_n_steps, None)}

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # Older versions filed the state under the class name whatever the settings: a checkpoint holding that key
        # alone for this class is one of them (or of a default monitor), and its state is this monitor's to resume.
        # Lightning loads only the state under state_key, right after this hook.
        states = checkpoint.get("callbacks") or {}
        name = type(self).__qualname__
        legacy = states.get(name)
        others = [key for key in states if isinstance(key, str) and key.startswith(name + "{")]
        if self.state_key not in states and legacy and not others:
            self.load_state_dict(copy.deepcopy(legacy))

    def _publish(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """Keep ``metrics`` in ``trainer.callback_metrics`` (what ``EarlyStopping`` and ``ModelCheckpoint(monitor=...)``
        read, on each rank), in place of this callback's previous ones: a value this step does not have (the gradient
        norm of a skipped step) is absent, not the last step's."""
        for key in self._published:
            if key not in metrics:
                trainer.callback_metrics.pop(key, None)
        # float32 whatever the default dtype (an fp16 default made a scale of 2**20 inf), as Lightning's logged values
        published = {key: torch.tensor(value, dtype=torch.float32) for key, value in metrics.items()}
        trainer.callback_metrics.update(published)
        self._published = set(metrics)

    def _log(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """:meth:`_publish` ``metrics`` on every rank and send them to the loggers on rank zero."""
        self.last_metrics = metrics
        self._publish(trainer, metrics)
        if not trainer.is_global_zero:
            return
        if not trainer.loggers:
            warn_once(
                f"{type(self).__name__}: the Trainer has no logger, so its metrics are only kept in "
                "`.last_metrics`; pass Trainer(logger=...) (TensorBoard, CSV...) to record them"
            )
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def _checked_jump_factor(jump_factor: Any) -> float:
    meaning = " (the scale ratio between two logs that counts as sudden)"
    if isinstance(jump_factor, bool) or not isinstance(jump_factor, numbers.Real):
        raise MonitorArgumentTypeError(
            f"FP8ScaleMonitor(jump_factor={jump_factor!r}) must be a number > 1{meaning}, got "
            f"{type(jump_factor).__name__}"
        )
    too_big = isinstance(jump_factor, numbers.Integral) and jump_factor > sys.float_info.max  # float(): overflow
    if too_big or not (math.isfinite(jump_factor) and jump_factor > 1):  # inf: no ratio reaches it, no alert
        raise ValueError(f"FP8ScaleMonitor(jump_factor={jump_factor!r}) must be a finite number > 1{meaning}")
    return float(jump_factor)


def _checked_alert_after(alert_after_steps: Any) -> int:
    return _check_count("FP8ScaleMonitor", "alert_after_steps", alert_after_steps, 0,
                        " (the warm-up in optimizer steps before scale jumps are alerted)")  # fmt: skip


class FP8ScaleMonitor(_LoggingCallback):
    """Logs FP8 scales, amaxes and saturation per role, mu, skipped steps and optimizer-state scales.

    Every ``log_every_n_steps`` training batches that stepped (default: the Trainer's; counted as Lightning counts
    its own logging: once per batch however many optimizers stepped in it), on global rank zero, it logs at the
    ``global_step`` reached (every rank also keeps them, its own values, in ``trainer.callback_metrics``, so
    ``EarlyStopping`` and ``ModelCheckpoint`` can monitor them; refreshed at these steps only: monitor them with a
    ``log_every_n_steps`` no longer than the interval of the checks):

    - ``fp8/{role}/{field}`` for role in ``input``, ``weight``, ``grad_output`` and field in ``scale_min``,
      ``scale_max``, ``amax_max``, ``saturation_max``, ``saturation_mean``, ``nonfinite_count``: the compact
      summary over all FP8 layers;
    - ``fp8/layers/{layer}/{role}/{scale,amax,saturation}`` for every layer, with ``all_layers=True``;
    - ``fp8/grad_scaler/{scale,skipped_steps,last_saturation,nonfinite_events}``: mu and its bookkeeping;
    - ``fp8/optimizer/{key}/{min,max}`` over the parameters, for each scale the first optimizer keeps per
      parameter (FP8AdamW at O2: ``exp_avg_scale``, ``exp_avg_sq_scale``, ``master_scale``);
    - ``fp8/alerts/scale_drops`` and ``fp8/alerts/scale_rises``: layers whose scale moved by at least
      ``jump_factor`` since the previous log (a ``grad_output`` scale's move net of mu's, which moves it without
      any amax moving). A drop means the amax jumped (overflow is near); a rise means it collapsed (values underflow).
      Every alert is kept in ``.alerts``; the first drop and the first rise are also warned, once, on rank zero
      (later ones only counted, so a long run does not warn every log).

    Scales normally move a lot while training starts (activations and gradients find their range, the delayed
    amax history fills), so no alert is raised before global step ``alert_after_steps``; the scales are still
    logged and tracked meanwhile.

    Args:
        log_every_n_steps: log period in training batches that stepped, i.e. in optimizer steps with one optimizer
            (default: ``Trainer(log_every_n_steps=...)``).
        all_layers: also log every layer, not only the summary.
        jump_factor: scale ratio between two logs that counts as sudden, > 1 (default 2**4; scales move in powers of
            two, so a power of two reads naturally).
        alert_after_steps: warm-up, in optimizer steps, before scale drops and rises are alerted (default 100;
            0 alerts from the first comparison).

    The counts take Python or NumPy integers, ``jump_factor`` any real number (a NumPy float too).

    Raises:
        TypeError: for an argument of the wrong type (not an integer, not a number, ``all_layers`` not a bool); it is
            also a ``ValueError``, as these errors were before.
        ValueError: for a value out of range (a count below its minimum, ``jump_factor`` not a finite number > 1).
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        all_layers: bool = False,
        jump_factor: float = 16.0,
        alert_after_steps: int = 100,
    ) -> None:
        super().__init__(log_every_n_steps)
        jump_factor, alert_after_steps = _checked_jump_factor(jump_factor), _checked_alert_after(alert_after_steps)
        self.all_layers = check_flag("FP8ScaleMonitor", "all_layers", all_layers, MonitorArgumentTypeError)
        self._jumps = ScaleJumps(jump_factor, alert_after_steps, "FP8ScaleMonitor", "FP8ScaleMonitor.alerts")

    @property
    def jump_factor(self) -> float:
        """The scale ratio between two logs that counts as sudden (its :class:`ScaleJumps`'s); checked when assigned,
        as the constructor's argument (the old value kept on an error)."""
        return self._jumps.jump_factor

    @jump_factor.setter
    def jump_factor(self, value: float) -> None:
        self._jumps.jump_factor = _checked_jump_factor(value)

    @property
    def alert_after_steps(self) -> int:
        """The warm-up in optimizer steps before scale jumps are alerted (its :class:`ScaleJumps`'s); checked when
        assigned, as the constructor's argument."""
        return self._jumps.alert_after_steps

    @alert_after_steps.setter
    def alert_after_steps(self, value: int) -> None:
        self._jumps.alert_after_steps = _checked_alert_after(value)

    @property
    def alerts(self) -> list[dict[str, Any]]:
        """Every scale-jump alert so far: ``{"step", "layer", "role", "kind", "from", "to"}``."""
        return self._jumps.alerts

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._stepped(trainer) or not self._due(trainer):
            return
        optimizer = _unwrap_optimizer(trainer.optimizers[0]) if trainer.optimizers else None
        stats = fp8_stats(pl_module, optimizer=optimizer, grad_scaler=grad_scaler_of(trainer))
        if not stats["layers"]:
            fallen = fallen_back_layers(pl_module)
            if fallen:  # converted, then all put back (FP8GradScaler(nonfinite_fallback="bf16")): not "converted none"
                warn_once(
                    f"FP8ScaleMonitor: all FP8 layers ({len(fallen)}) were put back to high precision by the "
                    "gradient scaler's fallback (nonfinite_fallback='bf16'), so the model has no FP8 layers left: the "
                    "fp8/{role}/* and fp8/layers/* series stop here"
                )
            elif getattr(trainer.precision_plugin, "precision", None) == "fp8-lm":
                warn_once(
                    "FP8ScaleMonitor: the model has no FP8 layers: precision='fp8-lm' converted no linear layer "
                    "(convert_to_fp8's warnings say why for each)"
                )
            else:
                warn_once("FP8ScaleMonitor: the model has no FP8 layers; use Trainer(precision='fp8-lm')")
        self._log(trainer, self._metrics(stats, trainer.global_step))

    def _metrics(self, stats: dict[str, Any], step: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for role, summary in stats["summary"].items():
            metrics.update({f"fp8/{role}/{field}": float(summary[field]) for field in SUMMARY_FIELDS})
        if self.all_layers:
            for layer, roles in stats["layers"].items():
                for role, values in roles.items():
                    metrics.update({f"fp8/layers/{layer}/{role}/{f}": float(values[f]) for f in LAYER_FIELDS})
        for field, value in stats.get("grad_scaler", {}).items():
            if field in SCALER_FIELDS:
                metrics[f"fp8/grad_scaler/{field}"] = float(value)
        for key, bounds in stats.get("optimizer", {}).get("summary", {}).items():
            metrics[f"fp8/optimizer/{key}/min"] = float(bounds["min"])
            metrics[f"fp8/optimizer/{key}/max"] = float(bounds["max"])
        kinds = [kind for _, kind in self._jumps.flag(stats["layers"], step, stats.get("grad_scaler", {}).get("scale"))]
        metrics["fp8/alerts/scale_drops"] = float(kinds.count("drop"))
        metrics["fp8/alerts/scale_rises"] = float(kinds.count("rise"))
        return metrics

    @override
    def _start_afresh(self) -> None:
        super()._start_afresh()
        self._jumps = ScaleJumps(self.jump_factor, self.alert_after_steps, "FP8ScaleMonitor", "FP8ScaleMonitor.alerts")

    @override
    def _settings(self) -> dict[str, tuple[Any, Any]]:
        return {**super()._settings(), "all_layers": (self.all_layers, False), "jump_factor": (self.jump_factor, 16.0),
                "alert_after_steps": (self.alert_after_steps, 100)}  # fmt: skip

    @override
    def state_dict(self) -> dict[str, Any]:
        """The alerts and the scales and mu of the last log, which the first log after a resume compares against;
        plain lists, strings and numbers (``torch.load(weights_only=True)`` reads them)."""
        return self._jumps.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved. Every entry is checked before any is loaded: on an error the monitor
        is left as it was.

        Raises:
            TypeError: when ``state_dict`` is not a dict, or an entry has the wrong type (an alert that is not a dict
                of the fields ``.alerts`` holds, a previous scale that is not a ``[layer, role, scale]`` triple).
            ValueError: for an entry it does not hold, or a value out of range (an unknown role or alert kind, a
                scale that is not a finite positive number).
        """
        self._jumps.load_state_dict(state_dict)
