"""FP8ScaleMonitor, pinned where a mutation audit of the integrations found it unpinned: the logged
``fp8/optimizer/<key>/min`` and ``/max`` are the smallest and largest of that scale over the optimizer's per-parameter
states (read here from ``optimizer.state`` itself; a ``/max`` that logged the minimum passed the suite), and a fit
that stops early (``trainer.should_stop``) logs its last step as Lightning's own logging does (reference: the steps
at which the Trainer logs the module's ``self.log`` values), also off the ``log_every_n_steps`` period."""

import lightning as L
import torch
from lightning.pytorch.loggers import Logger

from lightning_fp8.callbacks import FP8ScaleMonitor
from tests.integrations.lightning.gpt_tiny import GPTModule, loader


class _MemoryLogger(Logger):
    """Keeps each ``log_metrics`` call as ``(step, metrics)``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))

    def steps_with(self, prefix: str) -> list[int]:
        return sorted({step for step, metrics in self.rows if any(k.startswith(prefix) for k in metrics)})


def _trainer(tmp_path, logger, monitor, **kwargs) -> L.Trainer:
    options = {"precision": "fp8-lm", "accelerator": "cpu", "logger": logger, "callbacks": [monitor],
               "enable_progress_bar": False, "enable_checkpointing": False, "enable_model_summary": False,
               "default_root_dir": tmp_path}  # fmt: skip
    return L.Trainer(**{**options, **kwargs})


def test_optimizer_scale_bounds_are_the_min_and_max_over_the_parameters_states(tmp_path):
    torch.manual_seed(0)
    module, logger = GPTModule(), _MemoryLogger()
    trainer = _trainer(tmp_path, logger, FP8ScaleMonitor(), max_steps=3, log_every_n_steps=1)
    trainer.fit(module, loader(n=48))
    step, logged = [(step, metrics) for step, metrics in logger.rows if "fp8/grad_scaler/scale" in metrics][-1]
    assert step == 3  # the last step: the optimizer's states are those it left
    optimizer = trainer.optimizers[0]
    bounds: dict[str, list[float]] = {}
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() == 0 and value.is_floating_point() and "scale" in key:
                bounds.setdefault(key, []).append(float(value))
    assert bounds and any(min(v) < max(v) for v in bounds.values())  # some scale differs between parameters
    for key, values in bounds.items():
        assert logged[f"fp8/optimizer/{key}/min"] == min(values), key
        assert logged[f"fp8/optimizer/{key}/max"] == max(values), key


class _StopsAtThirdBatch(GPTModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("reference_loss", loss.detach(), on_step=True)
        if batch_idx == 2:
            self.trainer.should_stop = True  # as EarlyStopping sets it
        return loss


def test_a_fit_that_stops_early_logs_its_last_step_as_lightning_does(tmp_path):
    torch.manual_seed(0)
    module, logger = _StopsAtThirdBatch(), _MemoryLogger()
    trainer = _trainer(tmp_path, logger, FP8ScaleMonitor(), max_steps=10, log_every_n_steps=5)
    trainer.fit(module, loader(n=96))
    assert trainer.global_step == 3
    assert logger.steps_with("reference_loss") == [2]  # Lightning logs the step it stops at (its step counts from 0)
    assert logger.steps_with("fp8/") == [3]  # the monitor logs at the global_step reached, that same batch
