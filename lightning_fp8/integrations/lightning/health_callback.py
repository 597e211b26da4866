"""TrainingHealthMonitor: loss, gradient norm, parameter norm, throughput and memory, with alerts.

A thin Lightning adapter over :class:`lightning_fp8.HealthMonitor` (which detects spikes, plateaus and
non-finite events, and keeps the series that the running means are taken over); a PNG of the series is written at
the end of fit.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_fp8.health import (
    SKIP_ACTION,
    HealthConfig,
    HealthMonitor,
    global_norm,
    memory_gib,
    scaler_fallbacks,
    skipped_step_action,
)
from lightning_fp8.integrations.lightning.callbacks import (
    MonitorArgumentTypeError,
    _check_count,
    _LoggingCallback,
    _unwrap_optimizer,
    grad_scaler_of,
    reads_scaled_gradients,
)
from lightning_fp8.integrations.lightning.health_args import _checked_plot_path, _checked_tokens, plot_file_for
from lightning_fp8.integrations.lightning.health_inputs import _grad_scalers, _true_loss, count_samples
from lightning_fp8.monitoring.measures import count_tokens
from lightning_fp8.monitoring.report import health_log_values
from lightning_fp8.recipe import check_flag
from lightning_fp8.warnings import warn_once


class TrainingHealthMonitor(_LoggingCallback):
    """Logs training health and alerts on gradient-norm spikes, loss plateaus and non-finite steps.

    Every training batch that stepped it observes the loss (mean over the accumulated micro-batches; one that
    ``training_step`` returned from an FP8GradScaler's ``scale_loss`` divided by the mu that call applied), the global
    gradient norm over the parameters of the optimizers stepped (of the true gradients: under FP8LMPrecision the
    norm of the gradients as they are, divided by the mu they carry; under another precision, divided by the mu of
    a loss the user scaled with the optimizer's FP8GradScaler; those FP8AdamW holds in FP8 with ``fp8_grads``
    included, dequantized; none for a batch without any gradient, as ``training_step`` returning ``None`` makes it),
    the parameter norm, the training throughput and the memory in use; every ``log_every_n_steps`` such batches
    (counted as Lightning counts its own logging) it logs, on global rank zero, at the ``global_step`` reached (every
    rank also keeps them, its own values of every step, in ``trainer.callback_metrics``:
    ``EarlyStopping(monitor="health/loss_smooth")`` works):

    - ``health/loss``, ``health/loss_smooth`` (running mean over the last ``smoothing_window`` steps, by
      torchmetrics' ``MeanMetric``: :mod:`lightning_fp8.monitoring.report`; NaN and
      inf left out), ``health/grad_norm``, ``health/param_norm`` (both taken before the optimizer steps: the
      norm of the parameters the batch's loss was computed with; ``FP8ScaleMonitor``'s ``fp8/*`` are read after it;
      a step the gradient scaler skipped logs its non-finite ``health/grad_norm``, so that ``EarlyStopping`` and
      ``ModelCheckpoint`` watching it find a value as under ``"bf16-mixed"``, but leaves it out of the series);
    - ``health/samples_per_sec`` and, when batches carry token ids (or ``tokens_fn`` is given),
      ``health/tokens_per_sec`` (running means) of the batches that trained: one whose ``training_step`` returned
      ``None`` (automatic optimization: Lightning skips its backward and step) counts no samples, its time all the
      same. Validation and checkpoint saving are not training: the clock stops when they start and restarts with
      the next training batch;
    - ``health/memory_gib`` (peak allocated on GPU, peak RSS on CPU);
    - ``health/events/{grad_norm_spike,loss_plateau,nonfinite_loss,nonfinite_grad}``: counts so far.

    Alerts are warned on rank zero as they happen and kept in ``.monitor.events`` with the recovery action
    (a skipped step halves mu: ``"skip_step+lower_mu"``; when that step also ran the scaler's fallback, its action
    is added to the same event: ``"skip_step+lower_mu+lower_lr"``, ``"...+fallback_bf16"``). At the end of fit a PNG
    of the series is written to ``plot_path`` (default ``<log_dir>/health.png``; needs matplotlib, else a warning)
    and the path of the file written kept in ``.plot_file``; a fit that observed no step (``max_steps=0``) and a
    ``fast_dev_run`` (which suppresses logging) write none (``None``).

    The series travel in the Trainer's checkpoints, so a resumed run's running means and alerts continue those of
    the run that saved it.

    Args:
        config: thresholds (:class:`lightning_fp8.health.HealthConfig`).
        log_every_n_steps: log period in training batches that stepped, i.e. in optimizer steps with one optimizer
            (default: the Trainer's).
        smoothing_window: steps of the running means (an int >= 1).
        tokens_fn: ``fn(batch) -> int | None``, the tokens in a batch (a number or a one-element tensor; ``None``:
            not known); default: the size of the first integer tensor of rank >= 2, if any.
        plot: write the plot at the end of fit (True or False).
        plot_path: where to write it (a str or ``os.PathLike``): a file (a name without suffix gets ``.png``, as
            matplotlib adds it; another suffix chooses matplotlib's format, e.g. ``.svg``), or a folder (an existing
            one, or a path ending in ``/``) to write ``health.png`` in. ``.plot_file`` is the file written.

    Raises:
        TypeError: for an argument of the wrong type (``tokens_fn`` not callable, ``plot`` not a bool, ``plot_path``
            not a path, a count not an int); it is also a ``ValueError``, as these errors were before. During fit,
            when ``tokens_fn`` returns something else than a count or ``None``.
        ValueError: for a value out of range (a count below its minimum, a ``plot_path`` suffix matplotlib cannot
            write); during fit, when ``tokens_fn`` returns a negative count.
    """

    def __init__(
        self,
        config: HealthConfig | None = None,
        log_every_n_steps: int | None = None,
        smoothing_window: int = 20,
        tokens_fn: Callable[[Any], int | None] | None = None,
        plot: bool = True,
        plot_path: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(log_every_n_steps)
        smoothing_window = _check_count("TrainingHealthMonitor", "smoothing_window", smoothing_window, 1,
                                        " (steps averaged)")  # fmt: skip
        if tokens_fn is not None and not callable(tokens_fn):
            raise MonitorArgumentTypeError(
                f"TrainingHealthMonitor(tokens_fn={tokens_fn!r}) must be a function batch -> number of tokens (or "
                f"None), got {type(tokens_fn).__name__}"
            )
        _checked_plot_path(plot_path)
        if config is not None and not isinstance(config, HealthConfig):
            raise MonitorArgumentTypeError(
                f"TrainingHealthMonitor(config=...) expects a HealthConfig, got {type(config).__name__}"
                + (": e.g. HealthConfig(**config)" if isinstance(config, dict) else "")
            )
        self.monitor = HealthMonitor(config)
        self.smoothing_window = smoothing_window
        self.tokens_fn = tokens_fn or count_tokens
        self.plot = check_flag("TrainingHealthMonitor", "plot", plot, MonitorArgumentTypeError)
        self.plot_path = plot_path
        self.plot_file: str | None = None
        self._reset_window()
        self._t0: float | None = None
        self._paused_at: float | None = None
        self._skipped_seen = 0
        self._fallback_seen = -1
        # Each scaler's losses_scaled when the batch started and at its last backward (None: none yet)
        self._scaling_marks: list[tuple[Any, int, int | None]] = []

    @override
    def _start_afresh(self) -> None:
        super()._start_afresh()
        self.monitor = HealthMonitor(self.monitor.config)
        self.plot_file = None

    def _reset_window(self) -> None:
        self._losses: list[torch.Tensor] = []
        self._samples: int | None = 0  # None once a batch of the window had no size to count
        self._tokens: int | None = None
        # This batch's gradient norm of each optimizer stepped (keyed by id), and the parameter norm; kept as
        # tensors until the step is observed.
        self._grad_norms: dict[int, torch.Tensor] = {}
        self._param_norm: torch.Tensor | None = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._t0 = time.perf_counter()
        self._paused_at = None
        scaler = grad_scaler_of(trainer)
        self._skipped_seen = scaler.skipped_steps if scaler is not None else 0
        self._fallback_seen = scaler_fallbacks(scaler.history, -1)[1] if scaler is not None else -1

    # -- the training clock: validation and checkpoint saving are not training time --------------------------

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause_clock()

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._pause_clock()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._paused_at is not None:  # restart the clock where it stopped
            self._t0 = (self._t0 or self._paused_at) + time.perf_counter() - self._paused_at
            self._paused_at = None
        # A loss training_step scales is scaled after this and before the backward (on_before_backward): a loss the
        # module's backward scales comes after, and is not the one training_step returned.
        self._scaling_marks = [(scaler, scaler.losses_scaled, None) for scaler in _grad_scalers(trainer)]

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._scaling_marks = [(scaler, mark, scaler.losses_scaled) for scaler, mark, _ in self._scaling_marks]

    def _pause_clock(self) -> None:
        if self._t0 is not None and self._paused_at is None:  # the sanity check runs before the clock starts
            self._paused_at = time.perf_counter()

    # -- observing a step -------------------------------------------------------------------------------------

    @override
    @reads_scaled_gradients  # divides its gradient norm by FP8LMPrecision.gradient_factor()
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # Called for each optimizer stepped (its gradients as FP8LMPrecision.gradient_factor says; the other
        # optimizers' may differ): take the norm over its parameters, and add the optimizers
        # of the batch up in _observe. All ranks: FSDP1's flat shards are reduced across ranks (FSDP2's DTensors
        # reduce themselves).
        sharded = any(cls.__name__ == "FSDPStrategy" for cls in type(trainer.strategy).__mro__)  # either namespace
        torch_optimizer = _unwrap_optimizer(optimizer)
        params = [p for group in torch_optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        # The gradients FP8AdamW holds in FP8 (fp8_grads: their param.grad is None), dequantized; they carry the
        # backward's mu whatever gradient_factor() says (an unscaled region divides param.grad only).
        fp8_norms = list(getattr(torch_optimizer, "fp8_grad_norms", dict)().values())
        if self._param_norm is None:  # before the batch's first optimizer steps: the weights the loss came from
            self._param_norm = global_norm(pl_module.parameters(), sharded=sharded, device=pl_module.device)
        if not grads and not fp8_norms and not sharded:
            # No gradient at all (training_step returned None: Lightning skips the backward): no norm for this
            # step, as no loss. Sharded runs take the norm on every rank (a collective) and decide after it.
            return
        # Under FP8LMPrecision the gradients may still carry mu (reads_scaled_gradients: the plugin does not unscale
        # them, and round fp16 ones, for this callback alone): divide the fp32 norm instead. Under another
        # precision, a loop that scales its loss with its optimizer's FP8GradScaler leaves that mu in them.
        plugin = trainer.precision_plugin
        if hasattr(plugin, "gradient_factor"):
            factor, scaler = plugin.gradient_factor(), getattr(plugin, "grad_scaler", None)
            mu = scaler.loss_scale if scaler is not None else 1.0  # what the FP8-held gradients carry
        else:
            scaler = getattr(torch_optimizer, "grad_scaler", None)
            factor = mu = scaler.loss_scale if getattr(scaler, "loss_was_scaled", False) else 1.0
        norm = global_norm(grads, sharded=sharded, device=pl_module.device) / factor
        if fp8_norms:
            fp8_norm = torch.linalg.vector_norm(torch.stack([n.to(norm.device) for n in fp8_norms])) / mu
            norm = torch.linalg.vector_norm(torch.stack([norm, fp8_norm]))
        elif not grads and norm.item() == 0.0:  # sharded: no rank had a gradient (a skipped batch)
            return
        self._grad_norms[id(optimizer)] = norm

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            # Automatic optimization: Lightning divided it by accumulate_grad_batches, undone here. A loss that
            # training_step returned scaled (scaler.scale_loss(loss)) carries mu; one scaled in backward does not
            # (an overridden backward scales after on_before_backward, which ends the records looked at here;
            # FP8LMPrecision's scaling records none).
            normalize = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
            scaled = [record for scaler, mark, until in self._scaling_marks
                      for record in scaler.scaled_losses(since=mark, until=until)]  # fmt: skip
            self._losses.append(_true_loss(loss.detach(), normalize, scaled))
        samples = count_samples(batch)
        if samples is None:
            warn_once(
                f"TrainingHealthMonitor: cannot count the samples of a {type(batch).__name__} batch (it holds no "
                "tensor and is not a flat list), so health/samples_per_sec is left out"
            )
        # A batch whose training_step returned None (automatic optimization: no backward, nothing trained) counts no
        # samples or tokens, its time all the same: the rates are of the batches that trained.
        trained = loss is not None or not pl_module.automatic_optimization  # (Lightning hands on {} for that batch)
        if samples is None or self._samples is None:
            self._samples = None
        elif trained:
            self._samples += samples
        tokens = self.tokens_fn(batch)
        if tokens is not None:
            tokens = _checked_tokens(tokens, self.tokens_fn)
            self._tokens = (self._tokens or 0) + (tokens if trained else 0)
        if self._stepped(trainer):
            self._observe(trainer, pl_module)

    def _grad_norm(self) -> float | None:
        """The global gradient norm of this batch: the optimizers' norms combined (sqrt of the sum of squares)."""
        norms = list(self._grad_norms.values())
        if not norms:
            return None
        if len(norms) == 1:
            return norms[0].item()
        return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms])).item()

    def _observe(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step = trainer.global_step
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # time the GPU work, not its launch
        now = time.perf_counter()
        seconds, self._t0 = now - (self._t0 or now), now
        loss = torch.stack(self._losses).mean().item() if self._losses else None
        grad_norm = self._grad_norm()
        param_norm = self._param_norm.item() if self._param_norm is not None else None
        scaler = grad_scaler_of(trainer)
        skipped_norm = None  # a step the scaler skipped: its non-finite norm
        if scaler is not None and grad_norm is not None and not math.isfinite(grad_norm):
            skipped_norm, grad_norm = grad_norm, None  # reported below as the scaler's skipped step, with its action
        events = self.monitor.observe(
            step,
            loss=loss,
            grad_norm=grad_norm,
            param_norm=param_norm,
            samples=self._samples,
            tokens=self._tokens,
            seconds=seconds,
            memory_gib=memory_gib(pl_module.device)["peak"],
        )
        events += self._scaler_events(step, scaler)
        for event in events:
            if trainer.is_global_zero:
                rank_zero_warn(f"TrainingHealthMonitor: {event.message} (action: {event.action})")
        self._reset_window()
        metrics = self._metrics()
        if skipped_norm is not None:
            # Still this step's value, non-finite as its health/loss may be: absent, EarlyStopping and ModelCheckpoint
            # watching health/grad_norm raised that the metric is not available, ending the fit at a routine skip.
            metrics["health/grad_norm"] = skipped_norm
        if self._due(trainer):
            self._log(trainer, metrics)
        else:  # every step: a check between two logged steps reads this step's values
            self._publish(trainer, metrics)

    def _scaler_events(self, step: int, scaler: Any) -> list[Any]:
        """One ``nonfinite_grad`` event per step the scaler skipped since the last observation; a fallback the
        scaler ran (it runs on a skipped step) adds its action to that step's event instead of counting again."""
        if scaler is None:
            return []
        skipped = scaler.skipped_steps - self._skipped_seen
        self._skipped_seen = scaler.skipped_steps
        fallbacks = self._new_fallback_actions(scaler)
        if skipped <= 0:  # not expected from FP8GradScaler; still shown, as its own event
            return [self.monitor.record_nonfinite(step, "grad", action) for action in fallbacks]
        events = [self.monitor.record_nonfinite(step, "grad", SKIP_ACTION) for _ in range(skipped - 1)]
        return [*events, self.monitor.record_nonfinite(step, "grad", skipped_step_action(fallbacks))]

    def _new_fallback_actions(self, scaler: Any) -> list[str]:
        actions, self._fallback_seen = scaler_fallbacks(scaler.history, self._fallback_seen)
        return actions

    def _metrics(self) -> dict[str, float]:
        return health_log_values(self.monitor, self._last_step, self.smoothing_window)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.plot or trainer.fast_dev_run:  # fast_dev_run suppresses logging: no file either
            return
        # On every rank: Trainer.log_dir is a collective (it broadcasts rank zero's directory), so rank zero alone
        # reading it would wait for the other ranks forever (NCCL) or fail once they have left (gloo).
        if self.plot_path:
            path = plot_file_for(self.plot_path)
        else:  # the log directory may not exist yet: a folder by name, whatever plot_file_for would make of it
            path = os.path.join(trainer.log_dir or trainer.default_root_dir, "health.png")
        if not trainer.is_global_zero:
            return
        try:
            from lightning_fp8.integrations.lightning.health_plot import plot_health
        except ImportError:
            warn_once("TrainingHealthMonitor: matplotlib is not installed, so no health.png; pip install matplotlib")
            return
        if not any(self.monitor.series.values()):  # a fit that stepped no optimizer (max_steps=0): nothing to plot
            return
        self.plot_file = plot_health(self.monitor, path)

    @override
    def _settings(self) -> dict[str, tuple[Any, Any]]:
        # Left out: tokens_fn (a callable's repr is not the same from run to run: a resume would not find its state)
        # and plot (on or off, the same monitor; keys of older checkpoints stay).
        return {**super()._settings(), "config": (self.monitor.config, HealthConfig()),
                "smoothing_window": (self.smoothing_window, 20), "plot_path": (self.plot_path, None)}  # fmt: skip

    @override
    def state_dict(self) -> dict[str, Any]:
        """The monitor's series, events and alert windows (the running means are taken over the series)."""
        return {"monitor": self.monitor.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the monitor's entries are checked before any is loaded.

        Raises:
            TypeError, KeyError, ValueError: for anything but a dict of one ``"monitor"`` entry, or for an entry of
                that one that :meth:`lightning_fp8.HealthMonitor.load_state_dict` refuses; nothing is loaded.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(_state_error(f"got {type(state_dict).__name__}, expected a dict"))
        if "monitor" not in state_dict:
            raise KeyError(_state_error(f"missing entry 'monitor' (got {sorted(state_dict, key=repr)})"))
        if set(state_dict) != {"monitor"}:
            unknown = sorted(set(state_dict) - {"monitor"}, key=repr)
            raise ValueError(_state_error(f"unknown entries {unknown}, expected 'monitor' only"))
        self.monitor.load_state_dict(state_dict["monitor"])


def _state_error(what: str) -> str:
    return (
        f"TrainingHealthMonitor.load_state_dict: {what}; load the dict that TrainingHealthMonitor.state_dict() "
        "returned (the checkpoint may be corrupt). Nothing was loaded."
    )
