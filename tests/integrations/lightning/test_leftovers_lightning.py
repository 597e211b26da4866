"""Defects noticed earlier and left alone, fixed with the Trainer run that shows each: the throughput of
TrainingHealthMonitor counted batches that trained nothing."""

import warnings

import lightning as L
import pytest

from lightning_fp8.callbacks import TrainingHealthMonitor
from tests.integrations.lightning.gpt_tiny import GPTModule, loader

SKIP = (1, 2, 4)  # batch indices whose training_step returns None
BATCH_SIZE, BLOCK_SIZE = 6, 24  # loader()'s batches: 6 sequences of 24 token ids


class SkipsBatches(GPTModule):
    """Returns None (Lightning's documented skip: no backward, no step) for the batches in ``SKIP``."""

    def training_step(self, batch, batch_idx):
        return None if batch_idx in SKIP else super().training_step(batch, batch_idx)


class SkipsInManualOptimization(GPTModule):
    """Manual optimization: training_step returns None on every batch, and trains on every batch."""

    def __init__(self) -> None:
        super().__init__(manual=True)

    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)


def _fit(module: L.LightningModule, tmp_path, steps: int = 6) -> TrainingHealthMonitor:
    health = TrainingHealthMonitor(log_every_n_steps=1, plot=False, smoothing_window=1)
    trainer = L.Trainer(
        precision="fp8-lm", accelerator="cpu", max_steps=steps, callbacks=[health], logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader(batch_size=BATCH_SIZE))
    return health


def test_throughput_counts_only_the_batches_that_trained(tmp_path):
    # A batch whose training_step returned None trained nothing, yet its samples counted over its (short: no backward,
    # no step) time: health/samples_per_sec showed the skipped steps as the fastest of the run.
    series = _fit(SkipsBatches(), tmp_path).monitor.series
    for name in ("samples_per_sec", "tokens_per_sec"):
        rates = dict(series[name])
        assert sorted(rates) == [1, 2, 3, 4, 5, 6]  # every step has a rate (a time passed) ...
        assert [step for step, rate in rates.items() if rate == 0.0] == [i + 1 for i in SKIP]  # ... none trained
    # The steps that trained count their samples and tokens, as before.
    tokens = [rate for _, rate in series["tokens_per_sec"]]
    assert tokens == pytest.approx([BLOCK_SIZE * rate for _, rate in series["samples_per_sec"]], rel=1e-12)
    # Consistent with the other series: no loss and no gradient norm at a skipped step.
    assert [step for step, _ in series["loss"]] == [step for step, _ in series["grad_norm"]] == [1, 4, 6]


def test_manual_optimization_counts_every_batch(tmp_path):
    # There training_step returning None says nothing about training: the module steps its optimizers itself.
    series = _fit(SkipsInManualOptimization(), tmp_path, steps=3).monitor.series
    assert len(series["samples_per_sec"]) == 3 and all(rate > 0 for _, rate in series["samples_per_sec"])
