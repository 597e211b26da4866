"""Trainer(precision="fp8-lm") on a tiny GPT, single device: conversion, optimizer swap, scaling, accumulation,
clipping, manual optimization, checkpoint resume, autocast, the mocked Transformer Engine backend, errors."""

import contextlib
import math
import re
import sys
import types
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn

import lightning_fp8.warnings
from lightning_fp8 import FP8AdamW, FP8GradScaler, FP8Linear, FP8Recipe, convert_to_fp8
from lightning_fp8.integrations.lightning import FP8LMPrecision
from lightning_fp8.recovery import put_back_to_high_precision
from lightning_fp8.state import fp8_state_dict
from tests.integrations.lightning.gpt_tiny import GPTModule, loader

# FP8 GEMMs (E4M3 forward, E5M2 gradients) and an FP8/fp16-state optimizer against fp32 AdamW on the same task:
# the quantization noise is ~25 dB below the signal, and over a dozen steps the losses stay within 0.2% of each
# other (measured); 1% bounds that with margin while still catching a broken scale or unscale (10%+ off).
FP32_LOSS_RTOL = 0.01
# Runs that differ only in mu (a power of two): the fp16 weight gradients round differently where mu = 1 leaves
# them subnormal; the runs drift apart slowly (5e-4 relative after 5 steps, measured), while hooks that saw
# scaled gradients would be off by 1024x.
MU_INVARIANCE_RTOL = 1e-2


def _trainer(tmp_path=None, **kwargs) -> L.Trainer:
    defaults = {
        "precision": "fp8-lm",
        "accelerator": "cpu",
        "max_steps": 6,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    if tmp_path is not None:
        defaults["default_root_dir"] = tmp_path
    return L.Trainer(**{**defaults, **kwargs})


def _module(cls=GPTModule, **kwargs) -> GPTModule:
    torch.manual_seed(0)  # every run starts from the same weights
    return cls(**kwargs)


def _fit(module=None, train_data: int = 96, **kwargs) -> tuple[GPTModule, L.Trainer]:
    module = module or _module()
    trainer = _trainer(**kwargs)
    trainer.fit(module, loader(n=train_data))
    return module, trainer


def test_fit_converts_layers_and_replaces_adamw_keeping_hyperparameters_and_groups():
    module, trainer = _fit(_module(scheduler=True))
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 9 and all(isinstance(m, FP8Linear) for m in linears)
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, FP8AdamW)
    expected = module.param_groups()
    assert [g["name"] for g in optimizer.param_groups[:1]] == ["decay"]
    for group, want in zip(optimizer.param_groups, expected, strict=True):
        assert [id(p) for p in group["params"]] == [id(p) for p in want["params"]]
        assert group["weight_decay"] == want["weight_decay"] and group["betas"] == (0.9, 0.95)
        assert group["eps"] == 1e-8 and group["initial_lr"] == 1e-2
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.optimizer is optimizer
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * min(1.0, 7 / 4))  # the schedule advanced
    assert module.losses[-1] < module.losses[0]


def test_losses_track_fp32_adamw():
    fp8, _ = _fit(max_steps=12)
    fp32, _ = _fit(max_steps=12, precision="32-true")
    assert fp8.losses == pytest.approx(fp32.losses, rel=FP32_LOSS_RTOL)
    assert fp8.losses[-1] < fp8.losses[0] - 0.5


def _reference_run(
    steps: int, accumulate: int, clip: float | None, init_scale: float, loss_factor: float = 1.0
) -> list[float]:
    """The plugin's documented semantics written out by hand: convert, FP8AdamW, mu, bf16 autocast, clipping by the
    true gradients' norm (the gradients themselves keep carrying mu: fp16 ones are never unscaled in place), one
    optimizer step per `accumulate` micro-batches."""
    torch.manual_seed(0)
    module = GPTModule()
    model = convert_to_fp8(module.model)
    scaler = FP8GradScaler(init_scale=init_scale, model=module)
    groups = module.param_groups()
    optimizer = FP8AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, grad_scaler=scaler, fp8_grads=False)
    losses, batches = [], iter(loader())
    for _ in range(steps):
        for _ in range(accumulate):
            x, y = next(batches)
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                logits = model(x)
                loss = nn.functional.cross_entropy(logits.float().reshape(-1, 64), y.reshape(-1)) * loss_factor
            losses.append(loss.item())
            scaler.scale_loss(loss / accumulate).backward()
        if clip is not None:  # the true gradients' norm (fp32), the factor applied to the gradients carrying mu
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            mu = scaler.scale.item()
            true_norm = torch.stack([g.double().square().sum() for g in grads]).sum().sqrt() / mu
            factor = min(1.0, clip / (true_norm.item() + 1e-6))
            torch._foreach_mul_(grads, torch.tensor(factor, dtype=torch.float32))
        optimizer.step()  # through the scaler: skip on non-finite, unscale by mu, update mu
        optimizer.zero_grad()
    return losses


@pytest.mark.parametrize(("accumulate", "clip", "init_scale"), [(1, None, 1.0), (2, 0.5, 2.0**6)])
def test_plugin_matches_the_hand_written_loop(accumulate, clip, init_scale):
    plugin = FP8LMPrecision(grad_scaler={"init_scale": init_scale})
    module, _ = _fit(
        max_steps=4, precision=None, plugins=[plugin], accumulate_grad_batches=accumulate, gradient_clip_val=clip
    )
    assert module.losses == _reference_run(4, accumulate, clip, init_scale)


class _FilteredBatches(L.LightningModule):
    """Bias-free linear layers only (with ``fp8_grads`` every gradient then leaves ``param.grad`` for FP8AdamW);
    ``training_step`` returns None for the batches in ``SKIPPED`` (filtered out), and each batch records whether the
    weights changed. With 3 micro-batches per step: the second window ends on a skipped batch after two that left
    gradients, the third is skipped whole."""

    SKIPPED = (5, 6, 7, 8)

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 32, bias=False), nn.ReLU(), nn.Linear(32, 32, bias=False))
        self.changed: list[bool] = []

    def training_step(self, batch, batch_idx):
        return None if batch_idx in self.SKIPPED else self.net(batch).float().square().mean()

    def on_train_batch_start(self, batch, batch_idx):
        self._before = [p.detach().clone() for p in self.parameters()]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        after = [p.detach() for p in self.parameters()]
        self.changed.append(any(not torch.equal(a, b) for a, b in zip(self._before, after, strict=True)))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _filtered_batches_fit(**kwargs) -> list[bool]:
    torch.manual_seed(0)
    module = _FilteredBatches()
    data = torch.utils.data.DataLoader(torch.randn(36, 32, generator=torch.Generator().manual_seed(0)), batch_size=4)
    _trainer(max_steps=3, accumulate_grad_batches=3, **kwargs).fit(module, data)
    return module.changed


@pytest.mark.parametrize("fp8_grads", [False, True])
def test_a_window_ending_on_a_skipped_batch_steps_on_its_gradients_as_bf16_mixed(fp8_grads):
    """training_step returning None on the last micro-batch of an accumulation window dropped the window's step (the
    plugin took None for "no backward, nothing to step"); bf16-mixed steps on the gradients the earlier micro-batches
    accumulated, and steps nothing when the whole window was skipped. Found by a sweep."""
    reference = _filtered_batches_fit(precision="bf16-mixed")
    assert reference == [False, False, True, False, False, True, False, False, False]
    fp8 = _filtered_batches_fit(precision=None, plugins=[FP8LMPrecision(fp8_grads=fp8_grads)])
    assert fp8 == reference


class _ReadsGradients(GPTModule):
    """A loss times ``loss_factor``, and an ``on_before_optimizer_step`` hook that reads the gradients (as gradient
    norm logging does): the plugin unscales them for it."""

    loss_factor = 1.0

    def loss(self, batch):
        return super().loss(batch) * self.loss_factor

    def on_before_optimizer_step(self, optimizer):
        self.seen_max = max(p.grad.abs().max().item() for p in self.parameters() if p.grad is not None)


@pytest.mark.parametrize(
    ("init_scale", "loss_factor", "clip"),
    [(2.0**14, 1e-6, None), (2.0**14, 1e-6, 1e-8), (2.0**-12, 1e7, None), (2.0**-12, 1e7, 1e5)],
)
def test_fp16_gradients_reach_the_step_as_without_hooks(init_scale, loss_factor, clip):
    """Found by the twentieth session's sweep: the plugin unscaled every gradient in place around the hooks and the
    clipping, and scaled it back, also the FP8 weights' fp16 ones at O2, whose values mu exists for: true gradients
    below fp16's range (mu 2^14, a loss of ~1e-6) were flushed (94-97% of a weight's gradient entries became 0),
    and true gradients above 65504 (mu 2^-12) overflowed, so every step was skipped. Now the step sees what the
    hand-written loop's sees (bit for bit), hooks or not, clipping or not. (The hook itself sees the true
    gradients as fp16 holds them: 0 or inf where they are out of its range.)"""
    module = _module(_ReadsGradients)
    module.loss_factor = loss_factor
    plugin = FP8LMPrecision(grad_scaler={"init_scale": init_scale})
    _fit(module, max_steps=4, precision=None, plugins=[plugin], gradient_clip_val=clip)
    assert plugin.grad_scaler.skipped_steps == 0
    assert module.losses == _reference_run(4, 1, clip, init_scale, loss_factor)
    assert module.seen_max > 0


def test_clipping_and_hooks_see_unscaled_gradients():
    class Recorded(GPTModule):
        def on_before_optimizer_step(self, optimizer):
            self.norms.append(torch.nn.utils.get_total_norm([p.grad for p in self.parameters()]).item())

    runs = []
    for init_scale in (1.0, 2.0**10):
        module = _module(Recorded)
        module.norms = []
        _fit(
            module,
            max_steps=5,
            precision=None,
            plugins=[FP8LMPrecision(grad_scaler={"init_scale": init_scale})],
            gradient_clip_val=0.3,
        )
        runs.append(module)
    assert min(runs[0].norms) > 0.3  # clipping was active on every step
    # The hooks and the clipping see the true gradients: the same with mu = 1 and mu = 1024 (not 1024x apart).
    # Not bit for bit: the FP8 weights' gradients are fp16 (their master's dtype), where mu = 1 leaves the
    # smallest ones subnormal; that is what mu is for.
    assert runs[1].norms == pytest.approx(runs[0].norms, rel=MU_INVARIANCE_RTOL)
    assert runs[1].losses == pytest.approx(runs[0].losses, rel=MU_INVARIANCE_RTOL)


@pytest.mark.parametrize("init_scale", [2.0**-20, 2.0**16])
def test_unscaling_fp16_gradients_is_exact_across_the_range_of_mu(init_scale):
    # At O2 the FP8 weights' gradients are fp16: a factor 2^16 (or 2^-25) rounded to fp16 becomes inf (or 0), and
    # inf * 0 = NaN would skip every step. Clean data must train at any mu in the scaler's range.
    plugin = FP8LMPrecision(grad_scaler={"init_scale": init_scale})
    module, _ = _fit(max_steps=3, precision=None, plugins=[plugin], gradient_clip_val=1.0)
    assert plugin.grad_scaler.skipped_steps == 0
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_mu_doubles_after_growth_interval_with_high_precision_gradients():
    # Single device, fp8_grads=False: no FP8 cast of a gradient reports to the scaler, which measures them itself.
    plugin = FP8LMPrecision(grad_scaler={"init_scale": 1.0, "growth_interval": 2})
    _fit(max_steps=4, precision=None, plugins=[plugin])
    assert plugin.grad_scaler.skipped_steps == 0 and float(plugin.grad_scaler.scale) == 4.0


def test_manual_optimization_matches_automatic():
    auto, _ = _fit(max_steps=4, gradient_clip_val=0.5)
    manual, trainer = _fit(_module(manual=True, clip=0.5), max_steps=4)
    assert isinstance(trainer.optimizers[0], FP8AdamW)
    assert manual.losses == auto.losses


class StepIndexed(GPTModule):
    """Trains on batch number ``global_step``, whatever the loader yields: the data then depends only on state the
    checkpoint restores (Lightning re-runs part of an epoch when resuming from a plain DataLoader)."""

    def training_step(self, batch, batch_idx):
        return super().training_step(self.batches[self.global_step], batch_idx)


def test_checkpoint_resume_continues_the_same_trajectory(tmp_path):
    # mu moves during the run (it grows every 2 steps with FP8 gradients reporting their casts): restore it too.
    def plugin():
        return FP8LMPrecision(grad_scaler={"init_scale": 2.0**4, "growth_interval": 2}, fp8_grads=True)

    batches = list(loader())
    full = _module(StepIndexed)
    full.batches = batches
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    _, first = _fit(
        full,
        max_steps=8,
        precision=None,
        plugins=[plugin()],
        callbacks=[every],
        enable_checkpointing=True,
        default_root_dir=tmp_path,
    )
    ckpt = tmp_path / "epoch=0-step=4.ckpt"
    state = torch.load(ckpt, weights_only=True)["FP8LMPrecision"]  # plain tensors and numbers only
    assert state["grad_scaler"]["scale"] > 2.0**4 and any(k.endswith("amax_history") for k in state["fp8"])
    torch.manual_seed(123)  # the resumed run must not depend on the RNG for its initial weights
    resumed = StepIndexed()
    resumed.batches = batches
    trainer = _trainer(max_steps=8, precision=None, plugins=[plugin()], default_root_dir=tmp_path)
    trainer.fit(resumed, loader(), ckpt_path=ckpt)
    assert resumed.losses == full.losses[4:]
    assert trainer.precision_plugin.grad_scaler.scale == first.precision_plugin.grad_scaler.scale


def test_a_corrupt_optimizer_state_is_refused_before_the_plugin_state_loads(tmp_path):
    """FP8AdamW checks the checkpoint's optimizer state in the plugin's on_load_checkpoint: a corrupt one raises before
    mu and the FP8 scaling state are loaded (Lightning loads the weights before any plugin hook; they are not
    checked here)."""
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    _fit(_module(), max_steps=4, callbacks=[every], enable_checkpointing=True, default_root_dir=tmp_path)
    checkpoint = torch.load(tmp_path / "epoch=0-step=4.ckpt", weights_only=True)
    saved = checkpoint["optimizer_states"][0]["state"][0]
    saved["exp_avg_sq"] = (-saved["exp_avg_sq"].float() - 1).to(saved["exp_avg_sq"].dtype)
    torch.save(checkpoint, tmp_path / "bad.ckpt")
    module = _module()
    trainer = _trainer(max_steps=8, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="parameter 0's 'exp_avg_sq' holds negative values"):
        trainer.fit(module, loader(), ckpt_path=tmp_path / "bad.ckpt")
    plugin = trainer.precision_plugin
    assert plugin.grad_scaler.state_dict()["steps"] == 0  # not the checkpoint's 4
    assert all(int(state.casts) == 0 for name, state in module.named_modules() if name.endswith("fp8_scaling.input"))


def test_resuming_from_a_checkpoint_without_the_fp8_state_says_it_starts_fresh(tmp_path):
    """A training checkpoint without the plugin's entry (saved under another precision, or the entry dropped): the fit
    resumes with fresh mu and FP8 scales, as Accelerate's load_state says; it was silent."""
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    _fit(_module(), max_steps=2, callbacks=[every], enable_checkpointing=True, default_root_dir=tmp_path)
    checkpoint = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=True)
    del checkpoint["FP8LMPrecision"]
    torch.save(checkpoint, tmp_path / "no_fp8.ckpt")
    lightning_fp8.warnings._seen.clear()
    with pytest.warns(UserWarning, match="no FP8-LM precision state .* mu and the FP8 scales start fresh"):
        _trainer(max_steps=4, default_root_dir=tmp_path).fit(_module(), loader(), ckpt_path=tmp_path / "no_fp8.ckpt")


class HeadPoisoned(StepIndexed):
    """At the steps in ``poisoned``, only the output head gets gradients, and they are non-finite: the scaler skips
    those steps, and with ``fallback_after=2`` its ``"bf16"`` fallback puts the head (only) back to nn.Linear."""

    poisoned = (1, 2)

    def loss(self, batch):
        if self.global_step not in self.poisoned:
            return super().loss(batch)
        detach = self.model.lm_head.register_forward_pre_hook(lambda module, args: (args[0].detach(),))
        try:
            return super().loss(batch) * math.inf
        finally:
            detach.remove()


def _fallback_plugin(module: GPTModule) -> FP8LMPrecision:
    scaler = FP8GradScaler(nonfinite_fallback=module, fallback_after=2, init_scale=2.0**4, growth_interval=2)
    return FP8LMPrecision(grad_scaler=scaler, fp8_grads=True)


def _fit_from(ckpt, batches, tmp_path) -> tuple[GPTModule, L.Trainer]:
    torch.manual_seed(123)  # the resumed run must not depend on the RNG for its initial weights
    resumed = HeadPoisoned()
    resumed.batches = batches
    trainer = _trainer(max_steps=8, precision=None, plugins=[_fallback_plugin(resumed)], default_root_dir=tmp_path)
    trainer.fit(resumed, loader(), ckpt_path=ckpt)
    return resumed, trainer


def test_bf16_fallback_from_a_dict_of_scaler_arguments_is_the_fallback_of_a_scaler_given_the_module():
    # A dict written before the Trainer exists cannot name the model: FP8LMPrecision(grad_scaler={...
    # "nonfinite_fallback": "bf16"}) was refused ("needs the model"); the plugin gives the scaler its module.
    batches = list(loader())
    runs = []
    for make_plugin in (_fallback_plugin, lambda module: FP8LMPrecision(grad_scaler={
            "nonfinite_fallback": "bf16", "fallback_after": 2, "init_scale": 2.0**4, "growth_interval": 2},
            fp8_grads=True)):  # fmt: skip
        module = _module(HeadPoisoned)
        module.batches = batches
        _, trainer = _fit(module, max_steps=6, precision=None, plugins=[make_plugin(module)])
        runs.append((module, trainer.precision_plugin.grad_scaler))
    (given, given_scaler), (from_dict, dict_scaler) = runs
    assert type(from_dict.model.lm_head) is nn.Linear and type(given.model.lm_head) is nn.Linear
    assert dict_scaler.model is from_dict and dict_scaler.skipped_steps == given_scaler.skipped_steps == 2
    for (name, a), (_, b) in zip(given.named_parameters(), from_dict.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_resume_after_bf16_fallback_keeps_fallen_back_layers_in_high_precision(tmp_path):
    batches = list(loader())
    full = _module(HeadPoisoned)
    full.batches = batches
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    _, first = _fit(full, max_steps=8, precision=None, plugins=[_fallback_plugin(full)], callbacks=[every],
                    enable_checkpointing=True, default_root_dir=tmp_path)  # fmt: skip
    assert type(full.model.lm_head) is nn.Linear and isinstance(full.model.blocks[0].mlp[0], FP8Linear)
    ckpt = tmp_path / "epoch=0-step=4.ckpt"
    assert torch.load(ckpt, weights_only=True)["FP8LMPrecision"]["fallen_back_layers"] == ["model.lm_head"]

    resumed, trainer = _fit_from(ckpt, batches, tmp_path)
    head = resumed.model.lm_head
    assert type(head) is nn.Linear and head.weight.dtype == torch.float32
    assert sum(isinstance(m, FP8Linear) for m in resumed.modules()) == 8  # every other linear layer
    optimizer = trainer.optimizers[0]
    assert any(p is head.weight for p in optimizer.param_groups[0]["params"])  # the parameter the model uses
    assert optimizer.state[head.weight]["exp_avg"].dtype == torch.float32
    # The same trajectory, weights, scaler and optimizer states as the uninterrupted run, bit for bit.
    assert resumed.losses == full.losses[4:]
    assert trainer.precision_plugin.grad_scaler.state_dict() == first.precision_plugin.grad_scaler.state_dict()
    for (name, a), b in zip(resumed.state_dict().items(), full.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    state, full_state = optimizer.state_dict()["state"], first.optimizers[0].state_dict()["state"]
    assert state.keys() == full_state.keys()
    for index, entries in state.items():
        for key, value in entries.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(full_state[index][key])), (index, key)


def test_load_state_dict_alone_puts_fallen_back_layers_back():
    # Outside Trainer.fit (no on_load_checkpoint first): the FP8 state of the other layers must still load.
    saved, module = FP8LMPrecision(), _module()
    saved.convert_module(module)
    put_back_to_high_precision(module, ["model.blocks.1.mlp.2"])
    state = saved.state_dict()
    assert state["fallen_back_layers"] == ["model.blocks.1.mlp.2"]
    plugin, fresh = FP8LMPrecision(), _module()
    plugin.convert_module(fresh)
    _, [optimizer], _ = plugin.connect(fresh, [torch.optim.AdamW(fresh.parameters())], [])
    layer = fresh.model.blocks[1].mlp[2]
    assert layer.weight.dtype == torch.float16  # FP8AdamW (O2) holds its master in the weight's storage
    plugin.load_state_dict(state)
    layer = fresh.model.blocks[1].mlp[2]
    assert type(layer) is nn.Linear and layer.weight.dtype == torch.float32
    assert any(p is layer.weight for group in optimizer.param_groups for p in group["params"])
    loaded = fp8_state_dict(fresh)
    assert loaded.keys() == state["fp8"].keys()
    assert all(torch.equal(value, state["fp8"][key]) for key, value in loaded.items())


def test_checkpoint_without_fallen_back_layers_still_resumes(tmp_path):
    # Written before the plugin saved "fallen_back_layers": no layer had fallen back by step 1.
    batches = list(loader())
    full = _module(HeadPoisoned)
    full.batches = batches
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    _fit(full, max_steps=8, precision=None, plugins=[_fallback_plugin(full)], callbacks=[every],
         enable_checkpointing=True, default_root_dir=tmp_path)  # fmt: skip
    checkpoint = torch.load(tmp_path / "epoch=0-step=1.ckpt", weights_only=True)
    assert checkpoint["FP8LMPrecision"].pop("fallen_back_layers") == []
    torch.save(checkpoint, tmp_path / "old.ckpt")
    resumed, _ = _fit_from(tmp_path / "old.ckpt", batches, tmp_path)
    assert type(resumed.model.lm_head) is nn.Linear  # its own fallback, at step 2 as in the full run
    assert resumed.losses == full.losses[1:]  # the poisoned steps' losses are inf in both


@pytest.mark.parametrize(("precision", "level"), [("fp8-lm-o1", "O2"), ("fp8-lm", "O1")])
def test_a_user_fp8adamw_of_another_opt_level_than_the_plugins_is_kept_with_a_warning(precision, level, monkeypatch):
    """The FP8AdamW from configure_optimizers is kept as built, so its level wins over the plugin recipe's: that was
    silent (precision='fp8-lm-o1' trained the FP8 weights with O2's fp16 masters)."""

    class Own(GPTModule):
        def configure_optimizers(self):
            return FP8AdamW(self.parameters(), lr=1e-3, opt_level=self.level)

    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    module = _module(Own)
    module.level = level
    said = rf"your FP8AdamW steps at opt level {level} .*level is used.*to keep {level}, train with .*'{level}'"
    with pytest.warns(UserWarning, match=said):
        _, trainer = _fit(module, max_steps=1, precision=precision)
    assert trainer.optimizers[0].opt_level == level
    module = _module(Own)
    module.level = trainer.precision_plugin.recipe.opt_level  # the plugin's own level: nothing to say
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*your FP8AdamW steps at opt level")
        _fit(module, max_steps=1, precision=precision)


def test_non_fp8_ops_run_under_bf16_autocast_unless_disabled():
    class Probe(GPTModule):
        def training_step(self, batch, batch_idx):
            self.autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
            return super().training_step(batch, batch_idx)

    on, _ = _fit(_module(Probe), max_steps=1)
    off, _ = _fit(_module(Probe), max_steps=1, precision=None, plugins=[FP8LMPrecision(autocast=False)])
    assert on.autocast == (True, torch.bfloat16) and off.autocast[0] is False


def test_a_user_fp8adamw_is_kept_and_other_optimizers_are_errors():
    class Own(GPTModule):
        def configure_optimizers(self):
            self.own = FP8AdamW(self.parameters(), lr=1e-3)
            return self.own

    module, trainer = _fit(_module(Own), max_steps=1)
    assert trainer.optimizers[0] is module.own and module.own.grad_scaler is trainer.precision_plugin.grad_scaler
    # the optimizers' order, by which the scaler saves each one's run of non-finite steps
    assert dict(module.own.grad_scaler._optimizer_index) == {module.own: 0}
    adam, trainer = _fit(_module(optimizer="adam"), max_steps=1)
    assert isinstance(trainer.optimizers[0], FP8AdamW) and trainer.optimizers[0].param_groups[0]["weight_decay"] == 0
    for name, match in (
        ("sgd", "returned SGD: return torch.optim.AdamW"),
        ("adam_wd", "use torch.optim.AdamW"),
        ("amsgrad", r"amsgrad=True\) has no FP8AdamW equivalent"),
    ):
        with pytest.raises(ValueError, match=match):
            _fit(_module(optimizer=name), max_steps=1)
    sgd, trainer = _fit(
        _module(optimizer="sgd", lr=0.05),
        max_steps=4,
        precision=None,
        plugins=[FP8LMPrecision(replace_optimizers=False)],
    )
    assert isinstance(trainer.optimizers[0], torch.optim.SGD)
    sgd32, _ = _fit(_module(optimizer="sgd", lr=0.05), max_steps=4, precision="32-true")
    assert sgd.losses == pytest.approx(sgd32.losses, rel=FP32_LOSS_RTOL)


class _NoOptimizer(GPTModule):
    def configure_optimizers(self):
        return None  # Lightning warns and trains nothing


@pytest.mark.parametrize("replace_optimizers", [True, False])
def test_configure_optimizers_returning_none_fits_as_with_bf16_mixed(replace_optimizers):
    """Lightning steps its _MockOptimizer when configure_optimizers returns None; the plugin took it for the user's
    optimizer and refused it ("return torch.optim.AdamW ..."). The fit runs, steps nothing and leaves mu alone."""
    from lightning_fp8.callbacks import FP8ScaleMonitor, TrainingHealthMonitor

    module = _module(_NoOptimizer)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    plugin = FP8LMPrecision(replace_optimizers=replace_optimizers)
    callbacks = [FP8ScaleMonitor(log_every_n_steps=1), TrainingHealthMonitor(log_every_n_steps=1, plot=False)]
    with pytest.warns(UserWarning, match="configure_optimizers` returned `None`"):
        _, trainer = _fit(module, max_steps=3, precision=None, plugins=[plugin], callbacks=callbacks)
    assert trainer.global_step == 3 and len(module.losses) == 3
    assert all(isinstance(m, FP8Linear) for m in module.model.blocks[0].mlp if isinstance(m, nn.Linear))
    assert plugin.grad_scaler.state_dict()["steps"] == 0  # no step counted, mu left as it was
    after = module.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="backend='tensorrt'"):
        FP8LMPrecision(backend="tensorrt")
    with pytest.raises(ValueError, match="unknown FP8 recipe name"):
        FP8LMPrecision(recipe="fp8-xl")
    with pytest.raises(TypeError, match="grad_scaler"):
        FP8LMPrecision(grad_scaler=2.0)
    with pytest.raises(TypeError, match=r"module_filter_fn='net.4'\): must be a callable fn\(module, fqn\)"):
        FP8LMPrecision(module_filter_fn="net.4")
    with pytest.raises(TypeError, match=r"autocast='yes'\): must be True or False"):
        FP8LMPrecision(autocast="yes")


@pytest.mark.parametrize("recipe", [{"fp8_format": "e4m3", "margin": 1}, 1, FP8Recipe])
def test_a_recipe_of_the_wrong_type_is_refused_naming_the_plugin_and_what_to_pass(recipe):
    """Found by a sweep: a dict of recipe fields (what LightningCLI's --trainer.plugins.recipe takes as JSON) was
    refused by the core's bare "recipe must be an FP8Recipe, ..." that named neither the plugin nor the fix, where
    Accelerator(fp8_lm_recipe=...) names both."""
    match = r"FP8LMPrecision\(recipe=...\) must be an FP8Recipe, a recipe name \(\["
    with pytest.raises(TypeError, match=match) as error:
        FP8LMPrecision(recipe=recipe)
    assert ("FP8Recipe(**fields)" in str(error.value)) == isinstance(recipe, dict)


@pytest.mark.parametrize("fn", [lambda fqn: "lm_head" not in fqn, lambda module, fqn, extra: True, print])
def test_a_module_filter_fn_that_cannot_take_module_and_fqn_is_refused_when_the_plugin_is_built(fn):
    """Found by a sweep: a one-argument filter was accepted, and the fit failed in convert_module with Python's
    "<lambda>() takes 1 positional argument but 2 were given", after the Trainer was set up."""
    if fn is print:  # takes any arguments
        FP8LMPrecision(module_filter_fn=fn)
        return
    with pytest.raises(TypeError, match=r"module_filter_fn=.*is called as fn\(module, fqn\).*lambda module, fqn"):
        FP8LMPrecision(module_filter_fn=fn)


@pytest.mark.parametrize("arguments", [{"growth": 2}, {"init_scale": 4.0, "growth_intervall": 10}, {1: 2.0}])
def test_a_grad_scaler_dict_with_an_unknown_argument_is_refused_naming_it_and_the_allowed_ones(arguments):
    """Python's own error named FP8GradScaler.__init__ (not the plugin's argument) and listed nothing to choose from."""
    unknown = next(key for key in arguments if key not in ("init_scale",))
    with pytest.raises(
        TypeError, match=r"FP8LMPrecision\(grad_scaler=.*" + re.escape(repr(unknown)) + r".*growth_interval"
    ):
        FP8LMPrecision(grad_scaler=arguments)


@pytest.mark.parametrize("namespace", ["lightning", "pytorch_lightning"])
@pytest.mark.parametrize("setup", ["setup", "setup_module"])
def test_fabric_is_refused_before_the_model_is_converted(namespace, setup):
    """Fabric accepts a precision plugin: it converted the model in setup, then fabric.backward failed with
    AttributeError 'NoneType' object has no attribute 'trainer'. Fabric is refused when it is built now (below); one
    given the plugin inside a strategy instance (which the build does not look into) is refused in setup, saying what
    to use instead."""
    from lightning_fp8.integrations.lightning.precision import precision_class

    fabric_mod = L.fabric if namespace == "lightning" else pytest.importorskip("lightning_fabric")
    strategy = fabric_mod.strategies.SingleDeviceStrategy(device="cpu", precision=precision_class(namespace)())
    fabric = fabric_mod.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    args = (model, torch.optim.AdamW(model.parameters())) if setup == "setup" else (model,)
    with pytest.raises(TypeError, match=r"Trainer.*Fabric is not supported.*convert_to_fp8.*docs/guides/pytorch.md"):
        getattr(fabric, setup)(*args)
    assert not any(isinstance(m, FP8Linear) for m in model.modules())


@pytest.mark.parametrize("namespace", ["lightning", "pytorch_lightning"])
def test_fabric_with_an_fp8_precision_is_refused_when_it_is_built(namespace):
    """Fabric(precision="fp8-lm") failed with Lightning's list of its own precisions (nothing about lightning_fp8 or
    Fabric), and Fabric(plugins=[FP8LMPrecision()]) only in setup: both fail at once now, saying what to use; the
    precisions Fabric has still build."""
    from lightning_fp8.integrations.lightning.precision import precision_class

    fabric_cls = L.Fabric if namespace == "lightning" else pytest.importorskip("lightning_fabric").Fabric
    for name in [*FP8Recipe.names(), "fp8-lmm", "e4m3"]:
        with pytest.raises(ValueError, match=rf"Fabric\(precision='{name}'\).*Fabric is not supported.*convert_to_fp8"):
            fabric_cls(accelerator="cpu", devices=1, precision=name)
    for plugins in (precision_class(namespace)(), [precision_class(namespace)()]):
        with pytest.raises(TypeError, match=r"Drop FP8LMPrecision from Fabric\(plugins=...\).*FP8GradScaler"):
            fabric_cls(accelerator="cpu", devices=1, plugins=plugins)
    for name in ("32-true", "bf16-mixed", "bf16-true", "64-true", None):
        fabric_cls(accelerator="cpu", devices=1, precision=name)


def test_a_model_without_convertible_linear_layers_warns(monkeypatch):
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())  # warn_once: warn again in this test
    module = _module()
    with pytest.warns(UserWarning, match="no linear layer of GPTModule was converted to FP8"):
        _fit(module, max_steps=1, precision=None, plugins=[FP8LMPrecision(module_filter_fn=lambda m, fqn: False)])


# -- Transformer Engine backend, mocked --------------------------------------------------------------------------


def _fake_transformer_engine(calls: list) -> dict[str, types.ModuleType]:
    te, te_pytorch, common, recipe = (
        types.ModuleType(n)
        for n in (
            "transformer_engine",
            "transformer_engine.pytorch",
            "transformer_engine.common",
            "transformer_engine.common.recipe",
        )
    )

    class Format:
        HYBRID, E4M3 = "HYBRID", "E4M3"

    class DelayedScaling:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    active = []

    class Linear(nn.Linear):  # TE's Linear takes params_dtype and device keywords
        def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None):
            super().__init__(in_features, out_features, bias=bias, dtype=params_dtype, device=device)

        def forward(self, x):
            calls.append(("forward", bool(active)))
            return super().forward(x)

    @contextlib.contextmanager
    def fp8_autocast(enabled, fp8_recipe):
        calls.append(("fp8_autocast", fp8_recipe.kwargs))
        active.append(True)
        try:
            yield
        finally:
            active.pop()

    recipe.Format, recipe.DelayedScaling = Format, DelayedScaling
    te_pytorch.Linear, te_pytorch.fp8_autocast = Linear, fp8_autocast
    te.pytorch, te.common, common.recipe = te_pytorch, common, recipe
    return {m.__name__: m for m in (te, te_pytorch, common, recipe)}


def test_transformer_engine_backend_with_te_mocked(monkeypatch):
    calls: list = []
    for name, module in _fake_transformer_engine(calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    torch.manual_seed(0)
    reference = {k: v.clone() for k, v in GPTModule().model.state_dict().items()}
    plugin = FP8LMPrecision(recipe="fp8-lm-e4m3", backend="te")
    module, trainer = _fit(max_steps=2, precision=None, plugins=[plugin])
    te_linear = sys.modules["transformer_engine.pytorch"].Linear
    assert all(type(m) is te_linear for m in module.modules() if isinstance(m, nn.Linear))
    assert isinstance(trainer.optimizers[0], FP8AdamW)  # this project's optimizer stays
    assert (
        "fp8_autocast",
        {"margin": 0, "fp8_format": "E4M3", "amax_history_len": 16, "amax_compute_algo": "max"},
    ) in calls
    assert {active for kind, active in calls if kind == "forward"} == {True}  # every GEMM inside TE's region
    torch.manual_seed(0)
    fresh = GPTModule()
    FP8LMPrecision(backend="te").convert_module(fresh)
    for key, value in fresh.model.state_dict().items():  # same keys, weights copied over
        assert torch.equal(value, reference[key])


class _TiedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(80, 48)
        self.body = nn.Linear(48, 48)
        self.head = nn.Linear(48, 80, bias=False)
        self.head.weight = self.embedding.weight  # tied, as GPT-2's output head
        self.twice = nn.ModuleList([self.body])  # the same layer under a second name


def test_transformer_engine_backend_keeps_tied_weights_tied(monkeypatch):
    """backend='te' copied the tied head's weight into a new TE layer: the head no longer read the embedding (and
    trained apart from it), without a word. It stays nn.Linear, as with the native backend, with a warning; a layer
    registered under two names becomes one TE layer."""
    for name, module in _fake_transformer_engine([]).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    model = _TiedHead()
    with pytest.warns(UserWarning, match=r"backend='te' left 1 .*shared with another module \(tied weights\): head"):
        FP8LMPrecision(backend="te").convert_module(model)
    assert type(model.head) is nn.Linear and model.head.weight is model.embedding.weight
    assert type(model.body) is sys.modules["transformer_engine.pytorch"].Linear and model.twice[0] is model.body


def _no(module: nn.Module, fqn: str) -> str:
    return "no"


def _without_return(module: nn.Module, fqn: str) -> None:
    if "head" in fqn:
        pass


def _raises_at_the_second(module: nn.Module, fqn: str) -> bool:
    if fqn == "head":
        raise RuntimeError("the filter failed")
    return True


@pytest.mark.parametrize(
    ("module_filter_fn", "error", "match"),
    [
        (_no, TypeError, "module_filter_fn returned 'no' for 'body': it must return True .* or False"),
        (_without_return, TypeError, "module_filter_fn returned None for all 2 linear layers: .* return statement"),
        (_raises_at_the_second, RuntimeError, "the filter failed"),
    ],
)
def test_transformer_engine_backend_checks_the_filters_answers(monkeypatch, module_filter_fn, error, match):
    """backend='te' read the filter's answers by truthiness alone: a string ('no') converted the layer, and a filter
    without return (None everywhere) left every layer in high precision, silently, where the native backend refuses
    both; a filter that raised at a later layer left the earlier ones converted."""
    for name, module in _fake_transformer_engine([]).items():
        monkeypatch.setitem(sys.modules, name, module)
    model = nn.Sequential()
    model.add_module("body", nn.Linear(48, 48))
    model.add_module("head", nn.Linear(48, 32))
    with pytest.raises(error, match=match):
        FP8LMPrecision(backend="te", module_filter_fn=module_filter_fn).convert_module(model)
    assert [type(layer) for layer in model] == [nn.Linear, nn.Linear]  # nothing was changed


def test_transformer_engine_missing_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    with pytest.raises(ImportError, match=r"pip install lightning-fp8\[te\]"):
        FP8LMPrecision(backend="te")


def test_fully_sharded_model_without_fp8_layers_says_convert_first(tmp_path):
    # ModelParallelStrategy runs configure_model (fully_shard) before the plugin sees the model; swapping sharded
    # layers then would detach them from FSDP2, so the plugin asks for conversion inside configure_model.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        module = _module()
        fully_shard(module.model, mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(ValueError, match="convert_to_fp8.*before fully_shard"):
            FP8LMPrecision().convert_module(module)
        converted = _module()
        convert_to_fp8(converted.model)
        fully_shard(converted.model, mesh=init_device_mesh("cpu", (1,)))
        assert FP8LMPrecision().convert_module(converted) is converted  # already FP8: accepted as it is
        # ... with the plugin's recipe: another one would have trained silently with the layers' own
        with pytest.raises(ValueError, match="under fully_shard: the layers were converted in configure_model"):
            FP8LMPrecision(recipe="fp8-lm-current").convert_module(converted)
        assert all(m.recipe.scaling == "delayed" for m in converted.modules() if isinstance(m, FP8Linear))
    finally:
        dist.destroy_process_group()


def test_unscaled_gradients_divide_by_the_mu_the_loss_was_scaled_with():
    """With several optimizers on one scaler, an earlier optimizer's update may change mu before the next optimizer's
    hooks and clipping run: the gradients still carry the backward's mu (they were seen 2x off before)."""
    plugin = FP8LMPrecision(grad_scaler=FP8GradScaler(init_scale=2.0**8))
    lin = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(lin.parameters(), lr=0.1)
    plugin.grad_scaler.scale_loss(lin(torch.randn(3, 4)).square().sum()).backward()
    true = [p.grad / 2.0**8 for p in lin.parameters()]
    plugin.grad_scaler._set_scale(2.0**7, "skip", "another optimizer's step was skipped")
    with plugin.unscaled_gradients(optimizer):
        assert all(torch.equal(p.grad, t) for p, t in zip(lin.parameters(), true, strict=True))


def test_resume_under_other_scaling_settings_starts_the_scales_afresh(tmp_path, monkeypatch):
    """A checkpoint written with "fp8-lm" resumed with margin=1: its scales and amax histories mean something else
    there (load_fp8_state_dict refuses them), so they are not loaded, a warning says so, and each layer's first casts
    use their own amax, as in a fresh run."""
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    _fit(max_steps=2, callbacks=[every], enable_checkpointing=True, default_root_dir=tmp_path)
    resumed = _module()
    plugin = FP8LMPrecision(recipe=lightning_fp8.FP8Recipe(margin=1))
    trainer = _trainer(max_steps=3, precision=None, plugins=[plugin], default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="was written under other scaling settings and is not loaded"):
        trainer.fit(resumed, loader(), ckpt_path=tmp_path / "epoch=0-step=2.ckpt")
    states = [m for m in resumed.modules() if isinstance(m, lightning_fp8.ScalingState)]
    assert states and all(int(s.casts) <= 2 for s in states)  # the resumed step's casts only: nothing was loaded
    assert all(torch.isfinite(torch.tensor(loss)) for loss in resumed.losses)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_clipping_a_users_fp8adamw_holding_fp8_gradients(opt_level):
    """A user's own FP8AdamW (kept by the plugin) with fp8_grads=True, its default (O1 too), holds the FP8 weights'
    gradients outside param.grad: clipping left them out without a word (the plugin checked its own flag only), then
    was refused; by norm it now clips them too, through their scales; by value it is refused."""
    plugin = FP8LMPrecision()
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32)))
    optimizer = FP8AdamW(model.parameters(), lr=1e-2, opt_level=opt_level, grad_scaler=plugin.grad_scaler)
    plugin.grad_scaler.scale_loss(model(torch.randn(8, 32)).square().mean()).backward()
    mu = plugin.grad_scaler.loss_scale
    (held,) = optimizer.fp8_grad_norms().values()
    want = torch.linalg.vector_norm(torch.stack([held.double(), torch.linalg.vector_norm(model[0].bias.grad.double())]))
    bias = model[0].bias.grad.clone()
    plugin.clip_gradients(optimizer, clip_val=float(want / mu) / 4)
    (clipped,) = optimizer.fp8_grad_norms().values()
    torch.testing.assert_close(clipped, held / 4, rtol=1e-5, atol=0)
    torch.testing.assert_close(model[0].bias.grad, bias / 4, rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="clipping by value .* would miss the FP8 weights' gradients"):
        plugin.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.VALUE)


def test_a_fit_clipping_by_norm_with_fp8_gradients_clips_them_as_with_gradients_in_param_grad():
    """FP8LMPrecision(fp8_grads=True) with Trainer(gradient_clip_val=...) was refused; it clips the held FP8 gradients
    through their scales. Clipped to a norm far under AdamW's eps, the FP8 weights barely move (eps dominates the
    update; weight decay still moves them a little), as with fp8_grads=False, whose gradients stay in param.grad: a
    held gradient left unclipped would move its weight at AdamW's full step."""
    start = _module().state_dict()
    for fp8_grads in (True, False):
        moved = {}
        for clip in (None, 1e-12):
            module, trainer = _fit(precision=None, plugins=[FP8LMPrecision(fp8_grads=fp8_grads)], max_steps=3,
                                   gradient_clip_val=clip)  # fmt: skip
            assert trainer.optimizers[0].fp8_grads is fp8_grads and torch.isfinite(torch.tensor(module.losses)).all()
            names = [f"{name}.weight" for name, m in module.named_modules() if isinstance(m, FP8Linear)]
            state = module.state_dict()
            moved[clip] = torch.stack([(state[n].float() - start[n].float()).abs().max() for n in names])
        assert (moved[None] > 0).all() and (moved[1e-12] < 0.05 * moved[None]).all(), (fp8_grads, moved)


def test_clipping_follows_what_the_fp8adamw_holds_not_the_plugins_flag():
    """FP8LMPrecision(fp8_grads=True) whose FP8AdamW hooks no gradient (weights sharded by fully_shard keep theirs in
    param.grad) clips them: it was refused after the first backward, saying that gradients were held in FP8."""
    plugin = FP8LMPrecision(fp8_grads=True)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32)))
    optimizer = FP8AdamW(model.parameters(), lr=1e-2, fp8_grads=False)  # as for DTensor weights: no hook
    model[0].weight.grad = torch.full_like(model[0].weight, 1.0)
    model[0].bias.grad = torch.zeros_like(model[0].bias)
    plugin.clip_gradients(optimizer, clip_val=1.0)
    norm = torch.linalg.vector_norm(torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    assert norm == pytest.approx(1.0, rel=1e-3)  # mu is 1 here: the gradients as they are, clipped to norm 1


def _clip_reference(grads: list[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    # In float64: the factor min(1, max_norm / (norm + 1e-6)) applied to each gradient, rounded to its dtype.
    norm = torch.stack([g.double().square().sum() for g in grads]).sum().sqrt()
    factor = min(1.0, max_norm / (norm.item() + 1e-6))
    return [(g.double() * factor).to(g.dtype) for g in grads]


def test_clipping_scaled_fp16_gradients_sums_their_norm_in_fp32():
    """Gradients carrying mu (fp16 at O2) can have a norm past 65504: torch's clip_grad_norm_ computes it in fp16,
    gets inf and multiplies every gradient by 0. The plugin's clipping sums in fp32."""
    from lightning_fp8.integrations.clipping import clip_scaled_grad_norm_

    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.zeros(n, dtype=torch.float16)) for n in (70000, 300)]
    for p in params:
        p.grad = (torch.rand(p.shape, generator=gen) * 600 + 100).half()  # norm ~1e5 in all
    expected = _clip_reference([p.grad for p in params], 4096.0)
    total = clip_scaled_grad_norm_(params, 4096.0)
    assert total.dtype == torch.float32 and torch.isfinite(total) and total > 65504
    assert all(torch.equal(p.grad, e) for p, e in zip(params, expected, strict=True))


def test_clipping_dtensor_gradients(tmp_path):
    """FSDP2's gradients are DTensors: the fp32 norm is reduced over their mesh and the factor multiplies them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from lightning_fp8.integrations.clipping import clip_scaled_grad_norm_

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        grads = [torch.randn(64, 32, generator=torch.Generator().manual_seed(i)).half() * 500 for i in range(2)]
        expected = _clip_reference(grads, 1000.0)
        params = [nn.Parameter(distribute_tensor(torch.zeros(64, 32, dtype=torch.float16), mesh)) for _ in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = distribute_tensor(g.clone(), mesh)
        clip_scaled_grad_norm_(params, 1000.0)
        assert all(torch.equal(p.grad.full_tensor(), e) for p, e in zip(params, expected, strict=True))
    finally:
        dist.destroy_process_group()


def _fixed_mu(mu: float) -> FP8LMPrecision:
    return FP8LMPrecision(grad_scaler={"init_scale": mu, "min_scale": mu, "max_scale": mu, "growth_interval": 10**6})


def _grad_norm(params) -> float:
    return torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in params if p.grad is not None])).item()


class _InstanceHook(L.Callback):
    pass


class _MonitorSubclass(lightning_fp8.integrations.lightning.TrainingHealthMonitor):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        pl_module.norms.append(_grad_norm(pl_module.parameters()))


class LightningModule(GPTModule):  # a project's own base class, named like Lightning's
    def on_before_optimizer_step(self, optimizer):
        self.norms.append(_grad_norm(self.parameters()))


class _ClipsThenReads(GPTModule):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        self.norms.append(_grad_norm(self.parameters()))


def _reader_runs(reader: str) -> list[list[float]]:
    runs = []
    for mu in (1.0, 2.0**10):
        callbacks = []
        module = _module(LightningModule if reader == "named_like_lightning" else _ClipsThenReads)
        if reader in ("instance_hook", "monitor_subclass"):
            module = _module()
        module.norms = []
        if reader == "instance_hook":  # a hook assigned on the instance (a factory-built callback)
            callback = _InstanceHook()
            callback.on_before_optimizer_step = lambda trainer, pl_module, opt: pl_module.norms.append(
                _grad_norm(pl_module.parameters())
            )
            callbacks.append(callback)
        if reader == "monitor_subclass":
            callbacks.append(_MonitorSubclass(plot=False))
        _fit(module, max_steps=2, precision=None, plugins=[_fixed_mu(mu)], callbacks=callbacks)
        runs.append(module.norms)
    return runs


@pytest.mark.parametrize("reader", ["instance_hook", "monitor_subclass", "named_like_lightning", "clips_then_reads"])
def test_every_gradient_reader_sees_true_gradients(reader):
    """Found reviewing the twentieth session's change (unscaling only for hooks that may read gradients): a hook
    assigned on an instance, a subclass of TrainingHealthMonitor that reads gradients itself, a project's base class
    named LightningModule, and the code after self.clip_gradients in configure_gradient_clipping read gradients
    1024x too large at mu = 1024."""
    at_1, at_1024 = _reader_runs(reader)
    assert len(at_1) == 2 and at_1024 == pytest.approx(at_1, rel=MU_INVARIANCE_RTOL)


class _FillsThroughData(GPTModule):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.0)

    def on_before_optimizer_step(self, optimizer):
        for p in self.parameters():
            if p.grad is not None:
                p.grad.data.fill_(1e-3)  # through .data: the gradient's own version counter does not move


def test_a_hook_changing_gradients_through_data_is_kept():
    """A change made through ``p.grad.data`` was undone at mu != 1 (the kept scaled values were put back, the version
    counter having said nothing changed). Every gradient set to +1e-3: Adam's steps take every weight down."""
    module = _module(_FillsThroughData)
    before = {n: v.float().clone() for n, v in module.state_dict().items()}
    _fit(module, max_steps=2, precision=None, plugins=[_fixed_mu(2.0**10)])
    after = module.state_dict()
    fp8 = [f"{n}.weight" for n, m in module.named_modules() if isinstance(m, FP8Linear)]  # O2: fp16 masters
    assert fp8 and all((after[n].float() < before[n]).all() for n in fp8)


@pytest.mark.parametrize("algorithm", ["value", "norm"])
def test_clipping_does_not_hide_an_overflow(algorithm):
    """Clamping by value turned an inf gradient into a finite one before the scaler looked: the step was taken."""

    class Overflows(GPTModule):
        def on_after_backward(self):
            next(p for p in self.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")

    plugin = _fixed_mu(2.0**10)
    module = _module(Overflows)
    _fit(module, max_steps=2, precision=None, plugins=[plugin], gradient_clip_val=0.01,
         gradient_clip_algorithm=algorithm)  # fmt: skip
    assert plugin.grad_scaler.skipped_steps == 2
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_clipping_by_value_once_the_limit_times_mu_passes_fp16s_range():
    """gradient_clip_val * mu = 2^17 is past fp16's 65504: clamping the O2 weights' fp16 gradients crashed the fit
    (value cannot be converted to type c10::Half) once mu had grown that far."""
    plugin = _fixed_mu(2.0**17)
    _, trainer = _fit(max_steps=2, precision=None, plugins=[plugin], gradient_clip_val=1.0,
                      gradient_clip_algorithm="value")  # fmt: skip
    assert trainer.global_step == 2


@pytest.mark.parametrize("mu", [1.0, 2.0**-20, 2.0**10])
def test_norm_clipping_of_scaled_gradients_is_torchs_on_the_true_ones(mu):
    """torch.nn.utils.clip_grad_norm_ on the true gradients (its 1e-6 in their units), whatever mu they carry: with
    1e-6 added to the scaled norm, mu = 2^-20 clipped a norm of 0.63 to 0.19 instead of 0.5."""
    from lightning_fp8.integrations.clipping import clip_scaled_grad_norm_

    true = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 0.02
    reference = nn.Parameter(torch.zeros(64, 32))
    reference.grad = true.clone()
    torch.nn.utils.clip_grad_norm_([reference], 0.5)
    param = nn.Parameter(torch.zeros(64, 32))
    param.grad = true * mu
    clip_scaled_grad_norm_([param], 0.5, mu)
    torch.testing.assert_close(param.grad / mu, reference.grad, rtol=1e-6, atol=0)


@pytest.mark.parametrize("second", ["32-true", "fp8-lm"])
def test_a_second_fit_trains_the_weights_the_first_left(second):
    """Found by the twentieth session's sweep: after a precision="fp8-lm" fit, the FP8 weights held their fp16 masters
    times 2**18, and a second fit under another precision trained those (NaN from its second step). Now the fit's end
    gives the weights back: the module holds its unscaled weights, in its dtype, and a second fit trains them."""
    module, _ = _fit(max_steps=3)
    weights = [m.weight for m in module.modules() if isinstance(m, FP8Linear)]
    assert weights and all(w.dtype == torch.float32 for w in weights)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    assert all(torch.equal(w.detach(), state[n]) for n, w in module.named_parameters() if n in state)
    first = len(module.losses)
    _fit(module, max_steps=3, precision=second)
    losses = module.losses[first:]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < module.losses[0]


def _grad_output_states(module: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in fp8_state_dict(module).items()
            if ".grad_output." in key and torch.is_tensor(value)}  # fmt: skip


def _refit(trainer: L.Trainer, module: GPTModule, max_steps: int) -> None:
    """Fit ``module`` with ``trainer``, which has fitted another model already, up to global step ``max_steps``."""
    trainer.fit_loop.epoch_loop.max_steps = max_steps
    trainer.fit(module, loader())


def test_a_second_model_fitted_by_the_same_trainer_gets_the_grad_output_rescaling():
    """Found by a sweep: after trainer.fit(first), trainer.fit(second) left the scaler's model at the first model, so
    each change of mu during the second fit rescaled the first model's grad_output scales (silently changing it) and
    never the second's (their delayed scales off by the ratio of mu). The second model must train as it would with a
    fresh Trainer whose scaler starts from the same mu, and the first must be left alone."""
    plugin = FP8LMPrecision(grad_scaler={"init_scale": 1.0, "growth_interval": 1})
    first = _module()
    trainer = _trainer(max_steps=3, precision=None, plugins=[plugin])
    trainer.fit(first, loader())
    mu = plugin.grad_scaler.get_scale()
    first_states = _grad_output_states(first)
    torch.manual_seed(1)
    second = GPTModule()
    _refit(trainer, second, max_steps=6)

    torch.manual_seed(1)
    reference = GPTModule()
    fresh = FP8LMPrecision(grad_scaler={"init_scale": mu, "growth_interval": 1})
    _fit(reference, max_steps=3, precision=None, plugins=[fresh])
    assert plugin.grad_scaler.get_scale() == fresh.grad_scaler.get_scale() != mu  # mu moved during the second fit
    states, expected = _grad_output_states(second), _grad_output_states(reference)
    assert states.keys() == expected.keys() and states
    for key, value in expected.items():
        assert torch.equal(states[key], value), key
    assert second.losses == reference.losses
    for (name, a), (_, b) in zip(second.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    for key, value in _grad_output_states(first).items():
        assert torch.equal(value, first_states[key]), key
    assert plugin.grad_scaler.model is second


def _bf16_fallback_plugin() -> FP8LMPrecision:
    scaler = {"nonfinite_fallback": "bf16", "fallback_after": 2, "init_scale": 2.0**4, "growth_interval": 2}
    return FP8LMPrecision(grad_scaler=scaler, fp8_grads=True)


def _linear_types(module: nn.Module) -> dict[str, type]:
    return {name: type(m) for name, m in module.named_modules() if isinstance(m, nn.Linear)}


def test_the_bf16_fallback_of_a_second_fit_puts_back_the_second_models_layer():
    """Found by a sweep: in trainer.fit(second) after trainer.fit(first), nonfinite_fallback="bf16" searched the first
    model for layers with non-finite gradients, found none, and lowered the learning rate instead of putting the
    second model's head back to nn.Linear, as a fresh Trainer does."""
    batches = list(loader())
    plugin = _bf16_fallback_plugin()
    first = _module(HeadPoisoned)
    first.batches, first.poisoned = batches, ()
    trainer = _trainer(max_steps=3, precision=None, plugins=[plugin])
    trainer.fit(first, loader())
    first_layers = _linear_types(first)
    torch.manual_seed(1)
    second = HeadPoisoned()
    second.batches, second.poisoned = batches, (4, 5)  # the fit's second and third steps, as (1, 2) in a fresh one
    _refit(trainer, second, max_steps=7)

    torch.manual_seed(1)
    reference = HeadPoisoned()
    reference.batches = batches[3:]
    _, fresh = _fit(reference, max_steps=4, precision=None, plugins=[_bf16_fallback_plugin()])
    assert type(reference.model.lm_head) is nn.Linear  # the reference: the head alone is put back, lr kept
    assert _linear_types(second) == _linear_types(reference)
    assert _linear_types(first) == first_layers  # all FP8Linear: the first model is left alone
    assert all(kind is FP8Linear for kind in first_layers.values())
    [fallback] = [entry for entry in plugin.grad_scaler.history if entry["action"] == "fallback"]
    assert fallback["reason"].endswith("put 1 layer(s) back to high precision: model.lm_head")
    lrs = [group["lr"] for group in trainer.optimizers[0].param_groups]
    assert lrs == [group["lr"] for group in fresh.optimizers[0].param_groups] == [1e-2, 1e-2]
    assert plugin.state_dict()["fallen_back_layers"] == ["model.lm_head"]


class _SharedScalerModule(GPTModule):
    """Returns an FP8AdamW that brings ``scaler`` (the same one in every fit) from configure_optimizers."""

    def configure_optimizers(self):
        return FP8AdamW(self.param_groups(), lr=self.lr, grad_scaler=self.scaler)

    def validation_step(self, batch, batch_idx):
        return self.loss(batch)


def test_a_scaler_model_the_plugin_set_follows_each_fit_and_the_users_own_stays():
    # The scaler an FP8AdamW of the user's brings, with no model: the plugin gives it one, and the next fit's model.
    shared = FP8GradScaler()
    trainer = _trainer(max_steps=1, precision=None, plugins=[FP8LMPrecision()])
    modules = []
    for max_steps in (1, 2):
        module = _module(_SharedScalerModule)
        module.scaler = shared
        _refit(trainer, module, max_steps)
        assert trainer.precision_plugin.grad_scaler is shared and shared.model is module
        modules.append(module)
    trainer.validate(modules[0], loader(n=12), verbose=False)  # a stage converts it again: it is the model now
    assert shared.model is modules[0]
    # A model the user gave the scaler is theirs: no fit changes it.
    first = _module()
    scaler = FP8GradScaler(model=first)
    trainer = _trainer(max_steps=1, precision=None, plugins=[FP8LMPrecision(grad_scaler=scaler)])
    trainer.fit(first, loader())
    _refit(trainer, _module(), max_steps=2)
    assert scaler.model is first


def test_teardown_releases_early_masters_no_optimizer_holds():
    """Under DDP the plugin adopts the trainable FP8 weights before DDP wraps the model; one in no optimizer (then
    also a frozen layer's) stayed fp16 x 2**18 after the fit and a second fit under another precision went NaN (found
    reviewing the teardown release, 2 gloo processes). The teardown releases those too."""
    from lightning_fp8.optim import master

    layer = convert_to_fp8(nn.Linear(32, 32))
    weight = layer.weight.detach().clone()
    master.adopt(layer.weight, torch.float16)  # what adopt_masters_early does before DDP wraps the model
    assert layer.weight.dtype == torch.float16
    plugin = FP8LMPrecision()
    plugin._early_masters = [layer.weight]
    plugin.teardown()
    assert layer.weight.dtype == torch.float32 and master.master_scale(layer.weight) is None
    torch.testing.assert_close(layer.weight.detach(), weight, rtol=2**-10, atol=0)  # the fp16 master's rounding


def test_stochastic_weight_averaging_is_refused_at_o2_and_runs_at_o1():
    """Found by the Lightning sweep: SWA averages the parameters' storage, which at O2 holds each FP8 weight's fp16
    master times a scale that changes between steps (final weights 0.11 off the true average, silently)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    from lightning_fp8.integrations.lightning import FP8LMPrecision

    with pytest.raises(ValueError, match="cannot run with StochasticWeightAveraging.*fp8-lm-o1"):
        _fit(callbacks=[StochasticWeightAveraging(swa_lrs=1e-3)], max_steps=2)
    module, _ = _fit(
        callbacks=[StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)],
        precision=None,
        plugins=[FP8LMPrecision(recipe="fp8-lm-o1")],
        max_steps=-1,
        max_epochs=2,
    )
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_ema_weight_averaging_is_refused_at_o2_and_averages_the_true_weights_at_o1(tmp_path):
    """Found by a sweep: Lightning 2.6's EMAWeightAveraging (a WeightAveraging, not a StochasticWeightAveraging) got
    past the refusal at O2 and saved the average of the scaled fp16 masters (|max| 43072 against 0.62: a validation
    loss of 8e18 after load_from_checkpoint)."""
    callbacks = pytest.importorskip("lightning.pytorch.callbacks")
    if not hasattr(callbacks, "EMAWeightAveraging"):
        pytest.skip("EMAWeightAveraging needs Lightning >= 2.6")
    with pytest.raises(ValueError, match="cannot run with EMAWeightAveraging.*fp8-lm-o1"):
        _fit(callbacks=[callbacks.EMAWeightAveraging(decay=0.5)], max_steps=2)

    class Recording(callbacks.EMAWeightAveraging):  # the true weights after each step, to average by hand
        def __init__(self) -> None:
            super().__init__(decay=0.5, update_starting_at_step=0)
            self.seen: list[dict[str, torch.Tensor]] = []

        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            super().on_train_batch_end(trainer, pl_module, *args)
            self.seen.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    ema = Recording()
    module, _ = _fit(callbacks=[ema], precision=None, plugins=[FP8LMPrecision(recipe="fp8-lm-o1")], max_steps=4)
    name = "model.blocks.0.mlp.0.weight"
    expected = ema.seen[0][name]
    for seen in ema.seen[1:]:  # AveragedModel's EMA: avg <- decay * avg + (1 - decay) * new
        expected = 0.5 * expected + 0.5 * seen[name]
    torch.testing.assert_close(module.state_dict()[name], expected)  # the fit ends with the average swapped in


def test_model_pruning_of_converted_layers_is_refused_and_runs_on_layers_left_in_high_precision():
    """Found by a sweep: ModelPruning collects its layers in setup, before the plugin converts them; its mask went to
    the replaced nn.Linear while its pre-hook ran on the FP8Linear (AttributeError 'weight_mask' in the next
    forward, deep inside torch.nn.utils.prune)."""
    from lightning.pytorch.callbacks import ModelPruning

    module = _module()
    with pytest.raises(ValueError, match="cannot run ModelPruning on layers it converts.*module_filter_fn") as err:
        _fit(module, callbacks=[ModelPruning("l1_unstructured", amount=0.3)], max_epochs=1, max_steps=-1)
    # It names one layer and counts the others: the converted ones (all 9 linears), not ModelPruning's (layer, name)
    # pairs (weight and bias: it said "and 17 more")
    assert sum(isinstance(m, FP8Linear) for m in module.modules()) == 9
    assert " and 8 more)" in str(err.value)
    module = _module()
    head = module.model.lm_head
    pruning = ModelPruning("l1_unstructured", amount=0.5, parameters_to_prune=[(head, "weight")],
                           make_pruning_permanent=False)  # fmt: skip
    plugin = FP8LMPrecision(module_filter_fn=lambda layer, name: not name.endswith("lm_head"))
    _fit(module, callbacks=[pruning], precision=None, plugins=[plugin], max_epochs=1, max_steps=-1)
    assert module.model.lm_head is head and not isinstance(head, FP8Linear)
    assert isinstance(module.model.blocks[0].mlp[0], FP8Linear)
    assert (head.weight == 0).float().mean().item() == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("kind", ["fp8adamw", "sgd"])
def test_dcp_state_dict_of_the_lightning_optimizer_before_the_first_step(kind):
    """torch.distributed.checkpoint's get_optimizer_state_dict steps an optimizer without state on zero gradients at
    lr 0; given the LightningOptimizer, that step runs through the plugin's optimizer_step, which sent an optimizer
    that does not hold the scaler (SGD with momentum, replace_optimizers=False) to FP8GradScaler.step: refused ("no
    loss was scaled"), lr left at 0, after on_before_optimizer_step hooks on the zeros. It is the optimizer's own
    plain step now: the states exist, lr is back, the scaler and the hooks saw nothing."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    class Module(GPTModule):
        before_step_calls = 0

        def configure_optimizers(self):
            if kind == "sgd":
                return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
            return super().configure_optimizers()

        def on_before_optimizer_step(self, optimizer):
            self.before_step_calls += 1

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            raw = trainer.optimizers[0]
            lrs = [group["lr"] for group in raw.param_groups]
            state = get_optimizer_state_dict(pl_module, pl_module.optimizers())["state"]
            self.result = (len(state), [group["lr"] for group in raw.param_groups] == lrs, pl_module.before_step_calls,
                           trainer.precision_plugin.grad_scaler.history)  # fmt: skip
            raise SystemExit

    probe = Probe()
    plugins = {"precision": None, "plugins": [FP8LMPrecision(replace_optimizers=False)]} if kind == "sgd" else {}
    module = Module(optimizer="fp8adamw") if kind == "fp8adamw" else Module()
    with contextlib.suppress(SystemExit):
        _trainer(max_steps=1, callbacks=[probe], **plugins).fit(module, loader(n=8))
    trainable = sum(1 for p in module.parameters() if p.requires_grad)  # a state each
    assert probe.result == (trainable, True, 0, ())
