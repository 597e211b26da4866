"""NaN recovery through ``Trainer(precision="fp8-lm")``, route by route, against references written here (a route
sweep; the plain PyTorch routes are in ``tests/core/test_routes_recovery.py``).

Routes: manual optimization with one optimizer and with two (only the head's sees NaNs), automatic optimization with
gradient accumulation (the poisoned micro-batch first or last of its window), an ``on_before_optimizer_step`` hook
that reads the gradients (the plugin unscales them in place for it). Checked: mu and the actions by hand, the skipped
steps leave the module's and the optimizers' state dicts bit for bit, ``"lower_lr"`` lands once on the lr the
``interval: "step"`` scheduler goes on from, the ``"bf16"`` fallback puts back the head alone, and a checkpoint saved
between the two skips or after the fallback resumes through ``Trainer.fit(ckpt_path=...)`` into a freshly converted
module exactly as the uninterrupted run went on (its plugin state loads with ``torch.load(weights_only=True)``).
"""

import copy
import logging
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_fp8 import FP8Linear
from lightning_fp8.integrations.lightning import FP8LMPrecision
from tests.numerics import same

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # fmt: skip


@pytest.fixture(autouse=True)
def _quiet_lightning():
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


class _Net(L.LightningModule):
    """Two FP8 layers. Each batch is drawn from ``global_step`` (and the micro-batch's place in its accumulation
    window), so a resumed run sees the batches the uninterrupted one saw; at the ``(global_step, micro-batch)`` in
    ``poisoned`` the head's weight gradient alone is NaN (a tensor hook)."""

    def __init__(self, poisoned: set, manual: bool = False, two_optimizers: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.automatic_optimization = not manual
        self.poisoned, self.two_optimizers = poisoned, two_optimizers
        self.losses: list[float] = []
        self._hook = None

    def training_step(self, batch, batch_idx):
        micro = batch_idx % self.trainer.accumulate_grad_batches
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * self.global_step + micro))
        if (self.global_step, micro) in self.poisoned:
            self._hook = self.net[2].weight.register_hook(lambda g: g * math.nan)
        loss = self.net(x).square().mean()
        self.losses.append(loss.item())
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
        return None

    def on_after_backward(self):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def configure_optimizers(self):
        if self.two_optimizers:
            return [torch.optim.AdamW(self.net[j].parameters(), lr=1e-2) for j in (0, 2)]
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.1, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class _Reads(_Net):
    def on_before_optimizer_step(self, optimizer):  # reads the gradients: the plugin unscales them for it
        self.grad_max = max(p.grad.abs().max().item() for p in self.parameters() if p.grad is not None)


class _Record(Callback):
    """Per batch: whether the module's and the optimizers' state dicts came out of it bit for bit as they went in,
    and the first optimizer's lr."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, bool, bool, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = copy.deepcopy((pl_module.state_dict(), [o.state_dict()["state"] for o in trainer.optimizers]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        module, states = pl_module.state_dict(), [o.state_dict()["state"] for o in trainer.optimizers]
        self.rows.append((trainer.global_step, same(self._before[0], module), same(self._before[1], states),
                          trainer.optimizers[0].param_groups[0]["lr"]))  # fmt: skip


DATA = DataLoader(torch.zeros(48, 1), batch_size=8)  # 6 batches an epoch; the module draws its own inputs


def _fit(module: _Net, fallback: str, tmp_path=None, ckpt_path=None, **kwargs) -> tuple[L.Trainer, FP8LMPrecision]:
    plugin = FP8LMPrecision(grad_scaler={"nonfinite_fallback": fallback, "fallback_after": 2, "init_scale": 16.0})
    trainer = L.Trainer(plugins=[plugin], accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, max_epochs=10,
                        enable_checkpointing=tmp_path is not None, **kwargs)  # fmt: skip
    trainer.fit(module, DATA, ckpt_path=ckpt_path)
    return trainer, plugin


def _module(seed: int = 0, **kwargs) -> _Net:
    torch.manual_seed(seed)
    return _Net(**kwargs)


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_skipped_steps_change_nothing_and_lower_lr_lands_once_where_the_scheduler_goes_on(manual):
    torch.manual_seed(0)
    module = _Reads(poisoned={(1, 0), (2, 0), (3, 0)}, manual=manual)
    record = _Record()
    trainer, plugin = _fit(module, "lower_lr", max_steps=5, callbacks=[record])
    scaler = plugin.grad_scaler
    # By hand: mu 16 halves at each of the three skips; the second consecutive one lowers the lr (0.5x) once, and the
    # third starts a new count. Lightning steps an interval-"step" scheduler after every automatic optimizer step,
    # skipped ones too (as under "16-mixed"); under manual optimization the module would step it itself: it does not.
    assert scaler.get_scale() == 2.0 and scaler.skipped_steps == 3
    assert [e["action"] for e in scaler.history] == ["skip", "skip", "fallback", "skip"]
    assert scaler.history[2]["reason"] == "2 consecutive non-finite steps: lowered the learning rate by 0.5x"
    assert [row[1:3] for row in record.rows] == [(False, False), (True, True), (True, True), (True, True),
                                                 (False, False)]  # fmt: skip
    lrs = [row[3] for row in record.rows]
    if manual:
        assert lrs == [0.1, 0.1, 0.05, 0.05, 0.05]
    else:
        assert lrs == pytest.approx([0.1 * 0.5 ** (i + 1) * (0.5 if i >= 2 else 1) for i in range(5)], rel=1e-12)
    assert trainer.optimizers[0].param_groups[0]["initial_lr"] == 0.05
    assert all(isinstance(module.net[j], FP8Linear) for j in (0, 2))


ROUTES = {
    # name -> (module arguments, Trainer arguments, where to cut, the batches that ran before the cut)
    "manual, two optimizers": ({"manual": True, "two_optimizers": True, "poisoned": {(2, 0), (4, 0)}},
                               {"max_steps": 12}, (4, 6), (2, 3)),
    "automatic, accumulating 2": ({"poisoned": {(1, 0), (2, 1)}}, {"max_steps": 6, "accumulate_grad_batches": 2},
                                  (2, 3), (4, 6)),
}  # fmt: skip


@pytest.mark.parametrize("route", list(ROUTES))
def test_bf16_fallback_puts_back_the_head_alone_and_resumes_from_its_checkpoints_as_the_uninterrupted_run(
    route, tmp_path
):
    module_args, trainer_args, cuts, batches_before = ROUTES[route]
    full = _module(**module_args)
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    first, plugin = _fit(full, "bf16", tmp_path, callbacks=[every], **trainer_args)
    scaler = plugin.grad_scaler
    # By hand: the head's optimizer steps skip twice in a row (its gradient, summed over the window when
    # accumulating, holds the NaN), mu halves each time, and the second skip puts the head alone back.
    assert [e["action"] for e in scaler.history] == ["skip", "skip", "fallback"] and scaler.get_scale() == 4.0
    assert scaler.history[-1]["reason"].endswith("put 1 layer(s) back to high precision: net.2")
    assert isinstance(full.net[0], FP8Linear) and type(full.net[2]) is nn.Linear
    head_state = first.optimizers[-1].state[full.net[2].weight]
    assert head_state["exp_avg"].dtype == torch.float32 and full.net[2].weight.dtype == torch.float32

    for cut, ran in zip(cuts, batches_before, strict=True):  # between the two skips, and after the fallback
        ckpt = tmp_path / f"step={cut}.ckpt"
        saved = torch.load(ckpt, weights_only=True)["FP8LMPrecision"]
        assert saved["fallen_back_layers"] == ([] if cut == cuts[0] else ["net.2"])
        resumed = _module(seed=123, **module_args)  # nothing from its own init
        again, resumed_plugin = _fit(resumed, "bf16", ckpt_path=ckpt, **trainer_args)
        assert type(resumed.net[2]) is nn.Linear and isinstance(resumed.net[0], FP8Linear)
        assert resumed.losses == full.losses[ran:]
        assert same(resumed.state_dict(), full.state_dict())
        assert resumed_plugin.grad_scaler.state_dict() == scaler.state_dict()
        for mine, theirs in zip(again.optimizers, first.optimizers, strict=True):
            assert same(mine.state_dict(), theirs.state_dict())


def test_gradient_clip_val_leaves_the_bf16_fallback_its_offending_layer_alone():
    module = _module(poisoned={(1, 0), (2, 0)})
    _, plugin = _fit(module, "bf16", max_steps=4, gradient_clip_val=1.0)
    assert plugin.grad_scaler.skipped_steps == 2
    assert isinstance(module.net[0], FP8Linear) and type(module.net[2]) is nn.Linear
