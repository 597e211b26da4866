"""Training-loop forms a LightningModule and Trainer write with ``precision="fp8-lm"``, each against an independent
reference (found by a sweep of loop forms; they held): the same training written by hand with ``convert_to_fp8``,
``FP8AdamW`` and ``FP8GradScaler``, or Lightning's own behaviour under ``precision="bf16-mixed"`` where that is what
to match (global steps, learning rates).

Covered: gradient accumulation with a last partial window at the epoch end (and over two epochs), clipping by norm and
by value with mu far from 1, manual optimization with two optimizers (``toggle_optimizer``, ``clip_gradients``, a
non-finite step) and with accumulation by hand and a scheduler, one backward stepped by two optimizers, LR schedulers
(per epoch, ``frequency``, ``ReduceLROnPlateau`` on a validation metric, ``SequentialLR`` over two param groups), a
non-finite batch under a per-step scheduler, a plain SGD kept with ``replace_optimizers=False``, an overridden
``optimizer_step`` (LR warm-up, a step every other batch), and validate, fit with validation inside an accumulation
window, then test.
"""

import copy

import lightning as L
import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8
from lightning_fp8.integrations.lightning import FP8LMPrecision
from tests.integrations.accelerate.test_routes_loop_forms import Net  # the same net as Accelerate's loop forms

LR = 1e-2
LOSS_FACTOR = 30.0  # gradients large enough that AdamW's eps plays no part
# Clipping by norm: the plugin sums the squared gradients in fp32, the reference in fp64; the clip factors differ by an
# ulp, the weights by ~1e-8 (measured). A clip acting on gradients that still carry mu (2^10 here) would be 1000x off.
CLIP_NORM_ATOL = 1e-6


torch.manual_seed(0)
_BASE = Net()
_DATA = [(torch.randn(8, 48), torch.randint(0, 10, (8,))) for _ in range(12)]


def _with_nonfinite(index: int, value: float = float("inf")) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = list(_DATA)
    data[index] = (torch.full_like(_DATA[index][0], value), _DATA[index][1])
    return data


def _loss(net: nn.Module, batch, target_shift: int = 0) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(net(x).float(), (y + target_shift) % 10) * LOSS_FACTOR


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = copy.deepcopy(_BASE)
        self.losses: list[float] = []
        self.lrs: list[list[float]] = []

    def training_step(self, batch, batch_idx):
        loss = _loss(self.net, batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.lrs.append([group["lr"] for group in self.trainer.optimizers[0].param_groups])


def _loader(data=_DATA) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(data, batch_size=None)


def _trainer(precision="fp8-lm", **kwargs) -> L.Trainer:
    defaults = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
                "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0}  # fmt: skip
    if not isinstance(precision, str):  # the plugin
        kwargs["plugins"], precision = [precision], None
    return L.Trainer(precision=precision, **{**defaults, **kwargs})


def _weights(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().double().clone() for k, v in net.state_dict().items()}


def _assert_weights_equal(got: nn.Module, want: nn.Module, atol: float = 0.0) -> None:
    got_w, want_w = _weights(got), _weights(want)
    assert list(got_w) == list(want_w)
    for key in want_w:
        torch.testing.assert_close(got_w[key], want_w[key], rtol=0, atol=atol, equal_nan=True, msg=key)


def _finite(losses: list[float]) -> list[float]:
    return [loss for loss in losses if loss == loss and abs(loss) != float("inf")]


class Hand:
    """The plugin's recipe written out by hand: converted layers, bf16 autocast, one FP8GradScaler scaling every
    backward, FP8AdamW bound to it (or a plain optimizer stepped through it), clipping the gradients that carry mu."""

    def __init__(self, init_scale: float = 1.0, growth_interval: int = 1000, optimizer=None) -> None:
        self.net = copy.deepcopy(_BASE)
        convert_to_fp8(self.net)
        self.scaler = FP8GradScaler(init_scale=init_scale, growth_interval=growth_interval, model=self.net)
        self.optimizer = optimizer(self.net) if optimizer else self.fp8_adamw(self.net.parameters())
        self.losses: list[float] = []
        self.clipped: list[bool] = []

    def fp8_adamw(self, params, lr: float = LR) -> FP8AdamW:
        return FP8AdamW(params, lr=lr, grad_scaler=self.scaler, fp8_grads=False)

    def backward(self, batch, divisor: float = 1.0, target_shift: int = 0) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            loss = _loss(self.net, batch, target_shift)
        self.losses.append(loss.item())
        self.scaler.scale_loss(loss / divisor).backward()

    def clip(self, clip_val: float, algorithm: str = "norm", params=None) -> None:
        mu = self.scaler.loss_scale
        grads = [p.grad for p in (params or self.net.parameters()) if p.grad is not None]
        if algorithm == "norm":  # torch's clip_grad_norm_ on the true gradients: min(1, clip / (norm + 1e-6))
            norm = torch.stack([g.double().square().sum() for g in grads]).sum().sqrt().item() / mu
            factor = min(1.0, clip_val / (norm + 1e-6))
            torch._foreach_mul_(grads, torch.tensor(factor, dtype=torch.float32))
            self.clipped.append(factor < 1.0)
        else:
            self.clipped.append(any(bool((g.abs() > clip_val * mu).any()) for g in grads))
            for g in grads:
                g.clamp_(-clip_val * mu, clip_val * mu)

    def step(self, optimizer=None) -> None:
        optimizer = optimizer or self.optimizer
        if isinstance(optimizer, FP8AdamW):
            optimizer.step()  # through its scaler: skip on non-finite gradients, unscale, update mu
        else:
            self.scaler.step(optimizer)
            self.scaler.update()
        optimizer.zero_grad()

    def evaluate(self, batches) -> list[torch.Tensor]:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            return [self.net(x) for x, _ in batches]

    def train(self, windows: list[int], data=_DATA, divisor=None, clip=None, algorithm="norm", scheduler=None):
        batches = iter(data)
        for window in windows:
            for _ in range(window):
                self.backward(next(batches), divisor or window)
            if clip is not None:
                self.clip(clip, algorithm)
            self.step()
            if scheduler is not None:
                scheduler.step()
        return self


# -- gradient accumulation and clipping ----------------------------------------------------------------------------


@pytest.mark.parametrize(("accumulate", "epochs", "batches"), [(2, 1, 11), (3, 2, 5)])
def test_accumulation_ending_an_epoch_on_a_partial_window_matches_the_hand_written_loop(accumulate, epochs, batches):
    module = Module()
    trainer = _trainer(max_epochs=epochs, limit_train_batches=batches, accumulate_grad_batches=accumulate)
    trainer.fit(module, _loader())
    # Lightning steps on the partial window that ends each epoch, its loss divided by accumulate_grad_batches still
    windows = ([accumulate] * (batches // accumulate) + [batches % accumulate]) * epochs
    data = _DATA[:batches] * epochs
    hand = Hand().train(windows, data=data, divisor=accumulate)
    assert trainer.global_step == len(windows)
    assert module.losses == hand.losses
    _assert_weights_equal(module.net, hand.net)


@pytest.mark.parametrize(("algorithm", "clip"), [("norm", 0.5), ("value", 0.003)])
def test_clipping_under_accumulation_with_mu_far_from_one_clips_the_true_gradients(algorithm, clip):
    module = Module()
    plugin = FP8LMPrecision(grad_scaler={"init_scale": 2.0**10})
    trainer = _trainer(plugin, max_epochs=1, limit_train_batches=8, accumulate_grad_batches=2,
                       gradient_clip_val=clip, gradient_clip_algorithm=algorithm)  # fmt: skip
    trainer.fit(module, _loader())
    hand = Hand(init_scale=2.0**10).train([2] * 4, clip=clip, algorithm=algorithm)
    assert all(hand.clipped)  # the threshold bites on every step
    assert module.losses == hand.losses
    _assert_weights_equal(module.net, hand.net, atol=CLIP_NORM_ATOL if algorithm == "norm" else 0.0)


# -- manual optimization -------------------------------------------------------------------------------------------


class TwoOptimizers(Module):
    """GAN-like: fc1 and fc2 ("generator") and the head ("discriminator") each with its optimizer and loss, each
    optimizer toggled, its gradients clipped by norm; the generator's batch of ``bad_step`` is all inf."""

    bad_step = 2

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self):
        generator = [*self.net.fc1.parameters(), *self.net.fc2.parameters()]
        return torch.optim.AdamW(generator, lr=LR), torch.optim.AdamW(self.net.head.parameters(), lr=2 * LR)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx == self.bad_step:
            x = torch.full_like(x, float("inf"))
        for optimizer, shift in zip(self.optimizers(), (0, 1), strict=True):
            self.toggle_optimizer(optimizer)
            loss = _loss(self.net, (x, y), shift)
            self.losses.append(loss.item())
            self.manual_backward(loss)
            self.clip_gradients(optimizer, 0.5, "norm")
            optimizer.step()
            optimizer.zero_grad()
            self.untoggle_optimizer(optimizer)


def test_manual_optimization_with_two_toggled_optimizers_and_a_nonfinite_step_matches_the_hand_written_loop():
    module = TwoOptimizers()
    plugin = FP8LMPrecision(grad_scaler={"init_scale": 2.0**10, "growth_interval": 2})
    trainer = _trainer(plugin, max_epochs=1, limit_train_batches=5)
    trainer.fit(module, _loader())

    hand = Hand(init_scale=2.0**10, growth_interval=2)
    generator = [*hand.net.fc1.parameters(), *hand.net.fc2.parameters()]
    head = list(hand.net.head.parameters())
    optimizers = (hand.fp8_adamw(generator), hand.fp8_adamw(head, lr=2 * LR))
    turns = list(zip(optimizers, (generator, head), (head, generator), (0, 1), strict=True))
    for i, (x, y) in enumerate(_DATA[:5]):
        x = torch.full_like(x, float("inf")) if i == TwoOptimizers.bad_step else x
        for optimizer, params, others, shift in turns:
            for p in others:  # toggle_optimizer
                p.requires_grad_(False)
            hand.backward((x, y), target_shift=shift)
            for p in others:
                p.requires_grad_(True)
            hand.clip(0.5, params=params)
            hand.step(optimizer)
    assert trainer.global_step == 10  # each optimizer step counts in manual optimization, as Lightning counts them
    assert plugin.grad_scaler.skipped_steps == hand.scaler.skipped_steps == 2
    assert plugin.grad_scaler.loss_scale == hand.scaler.loss_scale
    assert _finite(module.losses) == _finite(hand.losses) and len(_finite(hand.losses)) == 8
    _assert_weights_equal(module.net, hand.net, atol=CLIP_NORM_ATOL)


class AccumulatesByHand(Module):
    """Manual optimization: two micro-batches per step, clipped, a StepLR stepped by hand after each step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR)
        return [optimizer], [lr_scheduler.StepLR(optimizer, 1, gamma=0.5)]

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = _loss(self.net, batch)
        self.losses.append(loss.item())
        self.manual_backward(loss / 2)
        if batch_idx % 2 == 1:
            self.clip_gradients(optimizer, 0.5, "norm")
            optimizer.step()
            optimizer.zero_grad()
            self.lr_schedulers().step()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if batch_idx % 2 == 1:
            super().on_train_batch_end(outputs, batch, batch_idx)


def test_manual_accumulation_with_a_scheduler_and_a_nonfinite_micro_batch_matches_the_hand_written_loop():
    data = _with_nonfinite(1)
    module = AccumulatesByHand()
    plugin = FP8LMPrecision(grad_scaler={"init_scale": 2.0**10})
    _trainer(plugin, max_epochs=1, limit_train_batches=8).fit(module, _loader(data))
    hand = Hand(init_scale=2.0**10)
    scheduler = lr_scheduler.StepLR(hand.optimizer, 1, gamma=0.5)
    hand.train([2] * 4, data=data, clip=0.5, scheduler=scheduler)
    lrs = [[LR * 0.5 ** (step + 1)] for step in range(4)]  # the scheduler steps after a skipped step too
    assert module.lrs == lrs and hand.optimizer.param_groups[0]["lr"] == lrs[-1][0]
    assert plugin.grad_scaler.skipped_steps == hand.scaler.skipped_steps == 1
    assert _finite(module.losses) == _finite(hand.losses)
    _assert_weights_equal(module.net, hand.net, atol=CLIP_NORM_ATOL)


class SharedBackward(Module):
    """Manual optimization: one backward, then the generator's and the head's SGD each step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self):
        generator = [*self.net.fc1.parameters(), *self.net.fc2.parameters()]
        return torch.optim.SGD(generator, lr=0.05), torch.optim.SGD(self.net.head.parameters(), lr=0.05)

    def training_step(self, batch, batch_idx):
        self.manual_backward(_loss(self.net, batch))
        for optimizer in self.optimizers():
            optimizer.step()
            optimizer.zero_grad()


def test_one_backward_stepped_by_two_optimizers_unscales_each_by_the_mu_it_carries():
    """mu grows after every optimizer step (growth_interval=1; Lightning updates the scaler after each ``opt.step()``,
    as its AMP plugin does): the second optimizer's gradients still carry the backward's mu, not the grown one. SGD
    shows a wrong unscaling where AdamW's normalized update would hide it."""
    module = SharedBackward()
    plugin = FP8LMPrecision(replace_optimizers=False, grad_scaler={"init_scale": 2.0**10, "growth_interval": 1})
    _trainer(plugin, max_epochs=1, limit_train_batches=5).fit(module, _loader())

    def two_sgds(net):
        return [torch.optim.SGD([*net.fc1.parameters(), *net.fc2.parameters()], lr=0.05),
                torch.optim.SGD(net.head.parameters(), lr=0.05)]  # fmt: skip

    hand = Hand(init_scale=2.0**10, growth_interval=1, optimizer=two_sgds)
    for batch in _DATA[:5]:
        hand.backward(batch)
        for optimizer in hand.optimizer:
            hand.scaler.step(optimizer)
        hand.scaler.update()
        for optimizer in hand.optimizer:
            optimizer.zero_grad()
    assert float(plugin.grad_scaler.scale) == 2.0**10 * 4**5  # grown twice per training step
    _assert_weights_equal(module.net, hand.net)


# -- LR schedulers, non-finite steps, other optimizers ---------------------------------------------------------------


class Scheduled(Module):
    kind = "epoch"

    def configure_optimizers(self):
        groups = [{"params": [*self.net.fc1.parameters(), *self.net.fc2.parameters()]},
                  {"params": self.net.head.parameters(), "lr": 3e-3, "weight_decay": 0.0}]  # fmt: skip
        optimizer = torch.optim.AdamW(groups, lr=LR)
        return {"optimizer": optimizer, "lr_scheduler": _scheduler(self.kind, optimizer)}

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", _loss(self.net, batch))


def _scheduler(kind: str, optimizer: torch.optim.Optimizer) -> dict:
    if kind == "epoch":
        return {"scheduler": lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}
    if kind == "frequency":
        return {"scheduler": lr_scheduler.StepLR(optimizer, 1, gamma=0.5), "interval": "step", "frequency": 3}
    if kind == "plateau":  # no loss is 1e9 below the best: reduces after every epoch but the first
        plateau = lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=1e9, threshold_mode="abs")
        return {"scheduler": plateau, "monitor": "val_loss"}
    warmup = lr_scheduler.LinearLR(optimizer, 0.1, 1.0, total_iters=3)
    cosine = lr_scheduler.CosineAnnealingLR(optimizer, T_max=6)
    return {"scheduler": lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[3]), "interval": "step"}


@pytest.mark.parametrize("kind", ["epoch", "frequency", "plateau", "sequential"])
def test_lr_schedulers_follow_the_schedule_of_bf16_mixed(kind):
    lrs = {}
    for precision in ("fp8-lm", "bf16-mixed"):
        module = Scheduled()
        module.kind = kind
        trainer = _trainer(precision, max_epochs=3, limit_train_batches=3, limit_val_batches=2)
        trainer.fit(module, _loader(), _loader(_DATA[10:]) if kind == "plateau" else None)
        lrs[precision] = module.lrs
        assert trainer.global_step == 9
    assert lrs["fp8-lm"] == lrs["bf16-mixed"]
    assert len({tuple(lr) for lr in lrs["fp8-lm"]}) >= 2  # the schedule moved


def test_a_sequential_schedule_over_two_param_groups_trains_as_the_hand_written_loop():
    module = Scheduled()
    module.kind = "sequential"
    _trainer(max_steps=8).fit(module, _loader())
    hand = Hand()
    head = list(hand.net.head.parameters())
    generator = [p for p in hand.net.parameters() if all(p is not h for h in head)]
    hand.optimizer = hand.fp8_adamw([{"params": generator}, {"params": head, "lr": 3e-3, "weight_decay": 0.0}])
    hand.train([1] * 8, scheduler=_scheduler("sequential", hand.optimizer)["scheduler"])
    assert module.losses == hand.losses
    _assert_weights_equal(module.net, hand.net)


class StepScheduled(Module):
    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR)
        scheduler = lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("bad", [0, 3])
def test_a_nonfinite_batch_skips_its_step_and_the_schedule_goes_on_as_with_bf16_mixed(bad):
    data = _with_nonfinite(bad, float("nan") if bad == 0 else float("inf"))
    module = StepScheduled()
    trainer = _trainer(max_epochs=1, limit_train_batches=6)
    trainer.fit(module, _loader(data))
    hand = Hand()
    hand.train([1] * 6, data=data, scheduler=lr_scheduler.StepLR(hand.optimizer, 1, gamma=0.5))
    assert trainer.precision_plugin.grad_scaler.skipped_steps == hand.scaler.skipped_steps == 1
    assert trainer.precision_plugin.grad_scaler.loss_scale == hand.scaler.loss_scale == 0.5
    assert trainer.global_step == 6  # a skipped step counts, as under Lightning's AMP
    assert module.lrs == [[LR * 0.5 ** (i + 1)] for i in range(6)]
    assert _finite(module.losses) == _finite(hand.losses)
    _assert_weights_equal(module.net, hand.net)


class SGDModule(Module):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def test_a_plain_sgd_kept_by_replace_optimizers_false_clips_skips_and_steps_as_the_hand_written_loop():
    data = _with_nonfinite(2)
    module = SGDModule()
    plugin = FP8LMPrecision(replace_optimizers=False, grad_scaler={"init_scale": 2.0**10})
    trainer = _trainer(plugin, max_epochs=1, limit_train_batches=8, accumulate_grad_batches=2, gradient_clip_val=0.5)
    trainer.fit(module, _loader(data))
    assert type(trainer.optimizers[0]) is torch.optim.SGD

    def sgd(net):
        return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

    hand = Hand(init_scale=2.0**10, optimizer=sgd).train([2] * 4, data=data, clip=0.5)
    assert plugin.grad_scaler.skipped_steps == hand.scaler.skipped_steps == 1
    assert plugin.grad_scaler.loss_scale == hand.scaler.loss_scale == 2.0**9
    _assert_weights_equal(module.net, hand.net, atol=CLIP_NORM_ATOL)


# -- overridden hooks ------------------------------------------------------------------------------------------------


class WarmsUp(Module):
    """The LR warm-up of Lightning's docs: ``optimizer_step`` overridden, the LR set after each step."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)
        for group in optimizer.param_groups:
            group["lr"] = LR * min(1.0, (self.trainer.global_step + 1) / 4)


class StepsEveryOtherBatch(Module):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        if batch_idx % 2 == 1:
            optimizer.step(closure=optimizer_closure)
        else:
            optimizer_closure()  # forward and backward, no step: the next batch's closure zeroes the gradients


@pytest.mark.parametrize("init_scale", [1.0, 2.0**10])
def test_an_overridden_optimizer_step_trains_as_the_hand_written_loop(init_scale):
    warm = WarmsUp()
    _trainer(FP8LMPrecision(grad_scaler={"init_scale": init_scale}), max_steps=6).fit(warm, _loader())
    hand = Hand(init_scale=init_scale)
    for step, batch in enumerate(_DATA[:6]):
        hand.backward(batch)
        hand.step()
        for group in hand.optimizer.param_groups:
            group["lr"] = LR * min(1.0, (step + 1) / 4)  # global_step inside optimizer_step: this step not counted yet
    assert warm.losses == hand.losses
    _assert_weights_equal(warm.net, hand.net)

    every_other = StepsEveryOtherBatch()
    trainer = _trainer(FP8LMPrecision(grad_scaler={"init_scale": init_scale}), max_epochs=1, limit_train_batches=6)
    trainer.fit(every_other, _loader())
    hand = Hand(init_scale=init_scale)
    for i, batch in enumerate(_DATA[:6]):
        hand.optimizer.zero_grad()
        hand.backward(batch)
        if i % 2 == 1:
            hand.step()
    assert every_other.losses == hand.losses
    _assert_weights_equal(every_other.net, hand.net)


# -- evaluation ------------------------------------------------------------------------------------------------------


class Evaluated(Module):
    def __init__(self) -> None:
        super().__init__()
        self.outputs: dict[str, list[torch.Tensor]] = {"val": [], "test": []}

    def validation_step(self, batch, batch_idx):
        self.outputs["val"].append(self.net(batch[0]).detach().clone())

    def test_step(self, batch, batch_idx):
        self.outputs["test"].append(self.net(batch[0]).detach().clone())

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])


def test_validate_fit_with_validation_inside_accumulation_windows_test_and_predict_match_the_hand_written_loop():
    """Every evaluation forward records its amaxes into the delayed-scaling histories the training forwards use (as
    documented), so the outputs and weights match only if each evaluation ran at the same point as by hand."""
    val, test = _DATA[10:12], _DATA[8:10]
    module = Evaluated()
    trainer = _trainer(max_epochs=1, limit_train_batches=9, accumulate_grad_batches=2, val_check_interval=3)
    trainer.validate(module, _loader(val))
    trainer.fit(module, _loader(), _loader(val))
    trainer.test(module, _loader(test))
    predictions = trainer.predict(module, _loader(test))

    hand = Hand(optimizer=lambda net: None)
    expected_val = hand.evaluate(val)  # the weights as they are: FP8AdamW's O2 masters (fp16) come with the fit
    hand.optimizer = hand.fp8_adamw(hand.net.parameters())
    for i, batch in enumerate(_DATA[:9]):
        hand.backward(batch, divisor=2)
        if i % 2 == 1 or i == 8:  # the last, partial window steps at the epoch's end
            hand.step()
        if (i + 1) % 3 == 0:  # val_check_interval=3 batches: twice inside a window
            expected_val += hand.evaluate(val)
    expected_test, expected_predictions = hand.evaluate(test), hand.evaluate(test)
    assert trainer.global_step == 5
    assert module.losses == hand.losses
    _assert_weights_equal(module.net, hand.net)
    for got, want in [(module.outputs["val"], expected_val), (module.outputs["test"], expected_test),
                      (predictions, expected_predictions)]:  # fmt: skip
        assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
