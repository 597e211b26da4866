"""TrainingHealthMonitor: loss, gradient norm, parameter norm, throughput and memory, with alerts.

A thin Lightning adapter over :class:`lightning_fp8.HealthMonitor` (which detects spikes, plateaus and
non-finite events); running means come from ``torchmetrics``; a PNG of the series is written at the end of fit.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from torchmetrics.aggregation import RunningMean
from typing_extensions import override

from lightning_fp8.health import HealthConfig, HealthMonitor, global_norm, memory_gib
from lightning_fp8.integrations.lightning.callbacks import _LoggingCallback, grad_scaler_of
from lightning_fp8.warnings import warn_once

# The recovery a skipped step implies: FP8GradScaler skips the update and halves mu.
_SKIP_ACTION = "skip_step+lower_mu"
# FP8GradScaler fallback descriptions -> HealthMonitor action names.
_FALLBACK_ACTIONS = (
    ("learning rate", "lower_lr"),
    ("lr", "lower_lr"),
    ("high precision", "fallback_bf16"),
    ("bf16", "fallback_bf16"),
)


def _first_token_tensor(batch: Any) -> torch.Tensor | None:
    # Heuristic for language models: the first integer tensor of rank >= 2 is (batch, sequence) token ids.
    if isinstance(batch, torch.Tensor):
        return batch if batch.dim() >= 2 and not batch.is_floating_point() else None
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        found = _first_token_tensor(value)
        if found is not None:
            return found
    return None


def count_tokens(batch: Any) -> int | None:
    """Tokens in ``batch``: the size of its first integer tensor of rank >= 2 (``None`` if there is none)."""
    tokens = _first_token_tensor(batch)
    return None if tokens is None else tokens.numel()


class TrainingHealthMonitor(_LoggingCallback):
    """Logs training health and alerts on gradient-norm spikes, loss plateaus and non-finite steps.

    Every optimizer step it observes the loss (mean over the accumulated micro-batches), the global gradient
    norm (unscaled: FP8LMPrecision unscales before ``on_before_optimizer_step``), the parameter norm, the
    throughput and the memory in use; every ``log_every_n_steps`` it logs, on global rank zero:

    - ``health/loss``, ``health/loss_smooth`` (torchmetrics running mean over ``smoothing_window`` steps),
      ``health/grad_norm``, ``health/param_norm``;
    - ``health/samples_per_sec`` and, when batches carry token ids (or ``tokens_fn`` is given),
      ``health/tokens_per_sec`` (running means);
    - ``health/memory_gib`` (peak allocated on GPU, peak RSS on CPU);
    - ``health/events/{grad_norm_spike,loss_plateau,nonfinite_loss,nonfinite_grad}``: counts so far.

    Alerts are warned on rank zero as they happen and kept in ``.monitor.events`` with the recovery action
    (a skipped step halves mu: ``"skip_step+lower_mu"``; the scaler's fallbacks: ``"lower_lr"``,
    ``"fallback_bf16"``). At the end of fit a PNG of the series is written to ``plot_path`` (default
    ``<log_dir>/health.png``; needs matplotlib, else a warning).

    Args:
        config: thresholds (:class:`lightning_fp8.health.HealthConfig`).
        log_every_n_steps: log period in optimizer steps (default: the Trainer's).
        smoothing_window: steps of the running means.
        tokens_fn: ``fn(batch) -> int`` tokens in a batch (default: the size of the first integer tensor of rank
            >= 2, if any).
        plot: write the PNG at the end of fit.
        plot_path: where to write it.
    """

    def __init__(
        self,
        config: HealthConfig | None = None,
        log_every_n_steps: int | None = None,
        smoothing_window: int = 20,
        tokens_fn: Callable[[Any], int | None] | None = None,
        plot: bool = True,
        plot_path: str | None = None,
    ) -> None:
        super().__init__(log_every_n_steps)
        self.monitor = HealthMonitor(config)
        self.smoothing_window = smoothing_window
        self.tokens_fn = tokens_fn or count_tokens
        self.plot = plot
        self.plot_path = plot_path
        self._running = {
            # Each rank's own running mean, like the other health values: compute() then runs on rank zero alone
            # (where it logs) without waiting for a cross-rank sync the other ranks never join.
            name: RunningMean(window=smoothing_window, nan_strategy="ignore", sync_on_compute=False)
            for name in ("loss_smooth", "samples_per_sec", "tokens_per_sec")
        }
        self._running_updates = dict.fromkeys(self._running, 0)
        self._reset_window()
        self._t0: float | None = None
        self._norms: tuple[torch.Tensor, torch.Tensor] | None = None
        self._skipped_seen = 0
        self._fallback_seen = -1

    def _reset_window(self) -> None:
        self._losses: list[torch.Tensor] = []
        self._samples = 0
        self._tokens: int | None = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._t0 = time.perf_counter()
        scaler = grad_scaler_of(trainer)
        self._skipped_seen = scaler.skipped_steps if scaler is not None else 0
        fallbacks = [e["step"] for e in scaler.history if e.get("action") == "fallback"] if scaler is not None else []
        self._fallback_seen = max(fallbacks, default=-1)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # All ranks: FSDP1's flat shards are reduced across ranks (FSDP2's DTensors reduce themselves). Kept as
        # tensors until the step is observed.
        sharded = any(cls.__name__ == "FSDPStrategy" for cls in type(trainer.strategy).__mro__)  # either namespace
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self._norms = (global_norm(grads, sharded=sharded), global_norm(pl_module.parameters(), sharded=sharded))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            if pl_module.automatic_optimization:  # Lightning divided it by accumulate_grad_batches: undo that
                loss = loss.detach().float() * trainer.accumulate_grad_batches
            self._losses.append(loss.detach().float())
        self._samples += extract_batch_size(batch)
        tokens = self.tokens_fn(batch)
        if tokens is not None:
            self._tokens = (self._tokens or 0) + tokens
        if self._stepped(trainer):
            self._observe(trainer, pl_module)

    def _observe(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step = trainer.global_step
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # time the GPU work, not its launch
        now = time.perf_counter()
        seconds, self._t0 = now - (self._t0 or now), now
        loss = torch.stack(self._losses).mean().item() if self._losses else None
        grad_norm, param_norm = (t.item() for t in self._norms) if self._norms is not None else (None, None)
        scaler = grad_scaler_of(trainer)
        if scaler is not None and grad_norm is not None and not torch.isfinite(torch.tensor(grad_norm)):
            grad_norm = None  # reported below as the scaler's skipped step, with its recovery action
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
        self._update_running(loss, seconds)
        self._reset_window()
        self._norms = None
        if self._due(trainer) and trainer.is_global_zero:
            self._log(trainer, self._metrics())

    def _scaler_events(self, step: int, scaler: Any) -> list[Any]:
        if scaler is None:
            return []
        events = []
        for _ in range(scaler.skipped_steps - self._skipped_seen):
            events.append(self.monitor.record_nonfinite(step, "grad", _SKIP_ACTION))
        self._skipped_seen = scaler.skipped_steps
        for entry in scaler.history:
            if entry.get("action") == "fallback" and entry.get("step", 0) > self._fallback_seen:
                reason = str(entry.get("reason", "")).lower()
                action = next((a for key, a in _FALLBACK_ACTIONS if key in reason), "none")
                events.append(self.monitor.record_nonfinite(step, "grad", action))
                self._fallback_seen = entry["step"]
        return events

    def _update_running(self, loss: float | None, seconds: float) -> None:
        last = {name: points[-1][1] for name, points in self.monitor.series.items() if points}
        values = {"loss_smooth": loss}
        for name in ("samples_per_sec", "tokens_per_sec"):
            if name in last and seconds > 0 and self.monitor.series[name][-1][0] == self._last_step:
                values[name] = last[name]
        for name, value in values.items():
            if value is not None:
                self._running[name].update(torch.tensor(value))
                self._running_updates[name] += 1

    def _metrics(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for name in ("loss", "grad_norm", "param_norm", "memory_gib"):
            points = self.monitor.series[name]
            if points and points[-1][0] == self._last_step:
                metrics[f"health/{name}"] = points[-1][1]
        for name, running in self._running.items():
            if self._running_updates[name]:
                metrics[f"health/{name}"] = running.compute().item()
        for kind, count in self.monitor.summary()["events"].items():
            metrics[f"health/events/{kind}"] = float(count)
        return metrics

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.plot or not trainer.is_global_zero:
            return
        path = self.plot_path or os.path.join(trainer.log_dir or trainer.default_root_dir, "health.png")
        try:
            from lightning_fp8.integrations.lightning.health_plot import plot_health
        except ImportError:
            warn_once("TrainingHealthMonitor: matplotlib is not installed, so no health.png; pip install matplotlib")
            return
        plot_health(self.monitor, path)
        self.plot_file = path

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.monitor.load_state_dict(state_dict["monitor"])
