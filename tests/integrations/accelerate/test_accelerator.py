"""lightning_fp8.accelerate.Accelerator in one process: what prepare, backward, step, clipping, logging and
checkpoints do with FP8-LM on, checked against plain torch computations."""

import copy
import logging
import math
import warnings
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from torch import nn

import lightning_fp8.warnings
from lightning_fp8 import FP8Linear, FP8Recipe, convert_to_fp8, fp8_state_dict
from lightning_fp8.accelerate import Accelerator
from lightning_fp8.integrations.accelerate.config import ENV_EXCLUDE, ENV_RECIPE
from lightning_fp8.optim import FP8AdamW, adamw_state_dict
from tests.integrations.accelerate.torchrun import run_two_processes

# Multiplying the loss by a power of two multiplies every fp32 gradient by it exactly (no overflow here).
EXACT = {"rtol": 0.0, "atol": 0.0}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(48, 80)
        self.norm = nn.LayerNorm(80)
        self.fc2 = nn.Linear(80, 48)
        self.head = nn.Linear(48, 10)  # 10 outputs: not a multiple of 16, stays nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(self.norm(torch.relu(self.fc1(x))))))


@pytest.fixture(autouse=True)
def _fresh_accelerate_state(monkeypatch):
    monkeypatch.delenv(ENV_RECIPE, raising=False)
    monkeypatch.delenv(ENV_EXCLUDE, raising=False)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _setup(grad_accum: int = 1, lr: float = 1e-2, **kwargs):
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm", gradient_accumulation_steps=grad_accum, **kwargs)
    model = Net()
    optimizer = torch.optim.AdamW(
        [
            {"params": [model.fc1.weight, model.fc2.weight], "weight_decay": 0.1, "name": "matrices"},
            {"params": [p for n, p in model.named_parameters() if not n.endswith(("fc1.weight", "fc2.weight"))]},
        ],
        lr=lr,
        betas=(0.8, 0.95),
        eps=1e-7,
        weight_decay=0.0,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def _train(accelerator, model, optimizer, scheduler, steps: int) -> None:
    for _ in range(steps):
        accelerator.backward(_loss(model, _batch()))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _batch(n: int = 12):
    return torch.randn(n, 48), torch.randint(0, 10, (n,))


def _loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def test_prepare_converts_swaps_optimizer_and_rebinds_scheduler():
    accelerator, model, optimizer, scheduler = _setup()
    assert isinstance(model.fc1, FP8Linear) and isinstance(model.fc2, FP8Linear)
    assert type(model.head) is nn.Linear
    assert accelerator.fp8_report["converted_layers"] == 2
    assert accelerator.fp8_report["high_precision_linears"] == ["head"]
    inner = optimizer.optimizer
    assert isinstance(inner, FP8AdamW) and accelerator.fp8_report["optimizer"] == "AdamW -> FP8AdamW"
    assert [g["weight_decay"] for g in inner.param_groups] == [0.1, 0.0]
    assert inner.param_groups[0]["name"] == "matrices"
    assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-7 and g["lr"] == 1e-2 for g in inner.param_groups)
    assert scheduler.scheduler.optimizer is inner
    accelerator.backward(_loss(model, _batch()))
    optimizer.step()
    scheduler.step()
    # The rebound schedule drives FP8AdamW's learning rate.
    assert [g["lr"] for g in inner.param_groups] == [5e-3, 5e-3]


def test_backward_scales_gradients_by_mu_exactly():
    accelerator, model, optimizer, _ = _setup()
    batch = _batch()
    saved = fp8_state_dict(model)

    def grads(mu: float) -> dict[str, torch.Tensor]:
        from lightning_fp8 import load_fp8_state_dict

        load_fp8_state_dict(model, saved)  # same starting scales for both backward passes
        accelerator.fp8_grad_scaler.load_state_dict({**accelerator.fp8_grad_scaler.state_dict(), "scale": mu})
        optimizer.zero_grad()
        accelerator.backward(_loss(model, batch))
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    g1, g8 = grads(1.0), grads(8.0)
    assert set(g1) == {n for n, _ in model.named_parameters()}
    for name, grad in g1.items():
        if grad.dtype == torch.float32:
            torch.testing.assert_close(g8[name], grad * 8, **EXACT, msg=name)
        else:  # O2: FP8 weights are fp16 masters; fp16 gradients round where mu moves them across subnormals
            torch.testing.assert_close(g8[name].float(), grad.float() * 8, rtol=2e-3, atol=1e-6, msg=name)


def test_clip_grad_norm_acts_on_unscaled_gradients():
    accelerator, model, optimizer, _ = _setup()
    accelerator.fp8_grad_scaler.load_state_dict({**accelerator.fp8_grad_scaler.state_dict(), "scale": 4.0})
    accelerator.backward(_loss(model, _batch()))
    true = [p.grad.float() / 4.0 for p in model.parameters()]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in true]))
    max_norm = float(expected) / 3
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0.0)
    after = [torch.linalg.vector_norm(p.grad.float() / 4.0) for p in model.parameters()]
    torch.testing.assert_close(
        torch.linalg.vector_norm(torch.stack(after)), torch.tensor(max_norm), rtol=1e-3, atol=0.0
    )
    assert "health/grad_norm" not in accelerator.fp8_log_values()
    optimizer.step()  # the health monitor sees the unscaled norm once the step is taken
    assert math.isclose(accelerator.fp8_log_values()["health/grad_norm"], float(expected), rel_tol=1e-6)
    # A later step without clipping logs its own norm (the one clipping would have returned), not the earlier one's
    optimizer.zero_grad()
    loss = _loss(model, _batch())
    accelerator.backward(loss)
    mu = accelerator.fp8_grad_scaler.loss_scale
    unclipped = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()])) / mu
    optimizer.step()
    values = accelerator.fp8_log_values()
    assert math.isclose(values["health/grad_norm"], float(unclipped), rel_tol=1e-5)
    assert math.isclose(values["health/loss"], float(loss), rel_tol=1e-6)


def test_clip_grad_norm_takes_the_norm_type_as_torch_does_a_string_too():
    """torch's clip_grad_norm_ (so plain Accelerate's) takes norm_type='inf' (its docs: "Can be 'inf'"); under FP8-LM
    it crashed in torch.linalg.vector_norm (must be Number, not str)."""
    accelerator, model, _, _ = _setup()
    accelerator.fp8_grad_scaler.load_state_dict({**accelerator.fp8_grad_scaler.state_dict(), "scale": 4.0})
    accelerator.backward(_loss(model, _batch()))
    true = [p.grad.float() / 4.0 for p in model.parameters()]
    expected = torch.stack([g.abs().max() for g in true]).max()
    norm = accelerator.clip_grad_norm_(model.parameters(), float(expected) / 2, norm_type="inf")
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0.0)
    after = torch.stack([(p.grad.float() / 4.0).abs().max() for p in model.parameters()]).max()
    torch.testing.assert_close(after, expected / 2, rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("norm_type", [0, -2.0, True, "two"])
def test_clip_grad_norm_refuses_a_norm_type_that_is_no_norm_and_clips_nothing(norm_type):
    """Order 0 (torch's count of nonzero elements) came back as 394.7 (the count times the largest gradient, over mu)
    and clipped by it; True passed for order 1. Refused as FP8GradScaler.clip_grad_norm_ refuses them."""
    accelerator, model, _, _ = _setup()
    accelerator.backward(_loss(model, _batch()))
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"accelerator\.clip_grad_norm_\(norm_type=.*expected a number > 0"):
        accelerator.clip_grad_norm_(model.parameters(), 1e-3, norm_type=norm_type)
    for param, grad in zip(model.parameters(), grads, strict=True):
        assert torch.equal(param.grad, grad)


def test_nonfinite_gradient_skips_step_halves_mu_and_holds_the_scheduler(caplog):
    caplog.set_level(logging.WARNING, logger="lightning_fp8.accelerate")
    accelerator, model, optimizer, scheduler = _setup()
    accelerator.fp8_grad_scaler.load_state_dict({**accelerator.fp8_grad_scaler.state_dict(), "scale": 2.0**10})
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    accelerator.backward(_loss(model, _batch()) * float("inf"))
    optimizer.step()
    scheduler.step()
    assert accelerator.optimizer_step_was_skipped
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], **EXACT, msg=name)
    assert float(accelerator.fp8_grad_scaler.scale) == 2.0**9
    assert scheduler.scheduler.last_epoch == 0 and optimizer.param_groups[0]["lr"] == 1e-2
    stats = accelerator.fp8_log_values()
    assert stats["fp8/grad_scaler/skipped_steps"] == 1 and stats["health/events/nonfinite_grad"] == 1
    # The skipped step is warned with what was done (found by a sweep: only observe()'s events were warned)
    assert any("non-finite grad" in r.getMessage() and "skip_step" in r.getMessage() for r in caplog.records)
    optimizer.zero_grad()
    accelerator.backward(_loss(model, _batch()))
    optimizer.step()
    assert not accelerator.optimizer_step_was_skipped
    assert not torch.equal(model.state_dict()["fc1.weight"], before["fc1.weight"])


def test_gradient_accumulation_steps_once_per_window():
    accelerator, model, optimizer, _ = _setup(grad_accum=2)
    weights = []
    for _ in range(4):
        with accelerator.accumulate(model):
            accelerator.backward(_loss(model, _batch()))
            optimizer.step()
            optimizer.zero_grad()
        weights.append(model.state_dict()["fc2.weight"].clone())
    initial_changed = [not torch.equal(a, b) for a, b in zip(weights, weights[1:], strict=False)]
    assert initial_changed == [True, False, True]  # steps after micro-batches 2 and 4 only
    assert accelerator.fp8_grad_scaler.state_dict()["steps"] == 2


def test_save_and_load_state_restore_scaling_state_and_mu(tmp_path):
    accelerator, model, optimizer, scheduler = _setup()
    _train(accelerator, model, optimizer, scheduler, steps=3)
    accelerator.fp8_grad_scaler.load_state_dict({**accelerator.fp8_grad_scaler.state_dict(), "scale": 32.0})
    saved_fp8, saved_scaler = fp8_state_dict(model), accelerator.fp8_grad_scaler.state_dict()
    accelerator.save_state(str(tmp_path / "ckpt"))
    state = torch.load(tmp_path / "ckpt" / "lightning_fp8" / "rank0.pt", weights_only=True)
    assert state["recipe"] == FP8Recipe().to_dict() and state["optimizer_steps"] == 3

    for _ in range(2):  # move everything on, then come back
        accelerator.backward(_loss(model, _batch()))
        optimizer.step()
        optimizer.zero_grad()
    assert fp8_state_dict(model)["fc1.fp8_scaling.input.casts"] != saved_fp8["fc1.fp8_scaling.input.casts"]
    accelerator.load_state(str(tmp_path / "ckpt"))
    for key, value in fp8_state_dict(model).items():
        torch.testing.assert_close(value, saved_fp8[key], **EXACT, msg=key)
    assert accelerator.fp8_grad_scaler.state_dict() == saved_scaler
    assert accelerator.fp8_health.summary()["last"]["loss"] == state["health"]["series"]["loss"][-1][1]


def test_dcp_state_dict_of_the_prepared_optimizer_before_any_step():
    """torch.distributed.checkpoint's get_state_dict steps an optimizer without state on zero gradients at lr 0 (its
    template); through the prepared optimizer that step went to the FP8GradScaler, which refused it ("no loss was
    scaled") and left lr at 0. The template now has every state; the lr and the scaler are as they were."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    accelerator, model, optimizer, scheduler = _setup()
    _, optim_sd = get_state_dict(model, optimizer)
    assert set(optim_sd["state"]) == {name for name, _ in model.named_parameters()}
    assert [group["lr"] for group in optimizer.param_groups] == [1e-2, 1e-2]
    assert accelerator.fp8_grad_scaler.history == () and all(p.grad is None for p in model.parameters())


def _fc2_poisoned_loss(model, batch):
    """A non-finite loss whose non-finite gradients reach fc2 (and the layers after it) but not fc1."""
    x, y = batch
    h = model.fc2(model.norm(torch.relu(model.fc1(x)).detach()))
    return nn.functional.cross_entropy(model.head(torch.relu(h)), y) * math.inf


def test_save_and_load_state_after_a_bf16_fallback_continue_like_the_uninterrupted_run(tmp_path):
    # FP8GradScaler(nonfinite_fallback="bf16") puts fc2 back to nn.Linear at step 1. A model prepared afresh has it in
    # FP8 again: load_state must put it back before the FP8, weight and optimizer states go in.
    torch.manual_seed(1)
    batches = [_batch() for _ in range(6)]

    def run(steps, load=None, save=None):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        torch.manual_seed(0 if load is None else 123)  # the resumed run takes nothing from its own init
        accelerator, model, optimizer, scheduler = _setup()
        scaler = accelerator.fp8_grad_scaler
        scaler.nonfinite_fallback, scaler.fallback_after = "bf16", 1
        if load is not None:
            accelerator.load_state(str(load))
        losses = []
        for i in steps:
            loss = (_fc2_poisoned_loss if i == 1 else _loss)(model, batches[i])
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        if save is not None:
            accelerator.save_state(str(save))
        return accelerator, model, optimizer, losses

    full, full_model, full_optimizer, full_losses = run(range(6))
    assert type(full_model.fc2) is nn.Linear and isinstance(full_model.fc1, FP8Linear)  # the fallback ran
    # The skipped step's health event names the fallback it ran, as Lightning's TrainingHealthMonitor does.
    grad_events = [(e.step, e.action) for e in full.fp8_health.events if e.kind == "nonfinite_grad"]
    assert grad_events == [(1, "skip_step+lower_mu+fallback_bf16")]
    run(range(3), save=tmp_path / "ckpt")
    state = torch.load(tmp_path / "ckpt" / "lightning_fp8" / "rank0.pt", weights_only=True)
    assert state["fallen_back_layers"] == [["fc2"]]

    resumed, model, optimizer, losses = run(range(3, 6), load=tmp_path / "ckpt")
    assert type(model.fc2) is nn.Linear and model.fc2.weight.dtype == torch.float32
    assert isinstance(model.fc1, FP8Linear)
    assert losses == full_losses[3:]
    for (name, value), expected in zip(model.state_dict().items(), full_model.state_dict().values(), strict=True):
        torch.testing.assert_close(value, expected, **EXACT, msg=name)
    assert fp8_state_dict(model).keys() == fp8_state_dict(full_model).keys()
    assert resumed.fp8_grad_scaler.state_dict() == full.fp8_grad_scaler.state_dict()
    assert [e.action for e in resumed.fp8_health.events] == [e.action for e in full.fp8_health.events]
    state, full_state = optimizer.state_dict()["state"], full_optimizer.state_dict()["state"]
    assert state.keys() == full_state.keys()
    for index, entries in state.items():
        for key, value in entries.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(full_state[index][key])), (index, key)


def _is_power_of_two(x: float) -> bool:
    return x > 0 and math.frexp(x)[0] == 0.5


def _memory_tracker():
    """An Accelerate tracker keeping each log call's (step, values) in ``.rows``."""
    from accelerate.tracking import GeneralTracker

    class Memory(GeneralTracker):
        name, requires_logging_directory = "memory", False

        def __init__(self):
            super().__init__()
            self.rows = []

        @property
        def tracker(self):
            return self.rows

        def log(self, values, step=None, **kwargs):
            self.rows.append((step, dict(values)))

    return Memory()


def test_log_adds_fp8_and_health_statistics_to_the_trackers():
    tracker = _memory_tracker()
    accelerator, model, optimizer, _ = _setup(log_with=[tracker])
    accelerator.init_trackers("t")
    accelerator.backward(_loss(model, _batch()))
    optimizer.step()
    accelerator.log({"loss": 1.5}, step=1)
    logged = accelerator.log_fp8_stats(step=2, layers=True)
    (step1, row1), (step2, row2) = tracker.rows
    assert (step1, step2, row1["loss"]) == (1, 2, 1.5)
    assert row2 == logged
    assert {k for k in logged if "/layers/" not in k} <= set(row1)  # log() carries the same statistics
    for role in ("input", "weight", "grad_output"):
        assert _is_power_of_two(row1[f"fp8/{role}/scale_min"]) and _is_power_of_two(row1[f"fp8/{role}/scale_max"])
    assert row1["fp8/grad_scaler/scale"] == 1.0 and row1["fp8/grad_scaler/skipped_steps"] == 0
    assert _is_power_of_two(row1["fp8/optimizer/exp_avg_scale/min"])
    assert "fp8/layers/fc1/input/scale" in logged and "health/events/grad_norm_spike" in row1


@pytest.mark.parametrize("layers", ["no", 0, None])
def test_a_layers_flag_that_is_no_bool_is_refused_and_logs_nothing(layers):
    # Accepted before: the truthy "no" logged every layer's statistics, None and 0 logged none, without a word.
    tracker = _memory_tracker()
    accelerator, model, optimizer, _ = _setup(log_with=[tracker])
    accelerator.init_trackers("t")
    accelerator.backward(_loss(model, _batch()))
    optimizer.step()
    for method in ("log_fp8_stats", "fp8_log_values"):
        with pytest.raises(TypeError, match=rf"accelerator.{method}\(layers={layers!r}\): must be True or False"):
            getattr(accelerator, method)(layers=layers)
    assert tracker.rows == []


def test_log_keeps_the_values_the_script_passed_under_a_statistic_s_name():
    """A script logging its own health/loss (e.g. the loss averaged over the processes) had it replaced by the
    accelerator's statistic of the same name, without a word: what the script passes is what it logs."""
    tracker = _memory_tracker()
    accelerator, model, optimizer, _ = _setup(log_with=[tracker])
    accelerator.init_trackers("t")
    accelerator.backward(_loss(model, _batch()))
    optimizer.step()
    assert accelerator.fp8_log_values()["health/loss"] != 7.0
    accelerator.log({"health/loss": 7.0, "fp8/grad_scaler/scale": 3.0}, step=1)
    ((_, row),) = tracker.rows
    assert row["health/loss"] == 7.0 and row["fp8/grad_scaler/scale"] == 3.0
    assert "health/grad_norm" in row  # the statistics the script did not name are added


def test_tied_output_head_stays_high_precision(recwarn):
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    model = nn.Sequential(nn.Embedding(32, 48), nn.Linear(48, 48), nn.Linear(48, 32, bias=False))
    model[2].weight = model[0].weight  # a tied head (32 x 48)
    model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    assert isinstance(model[1], FP8Linear) and type(model[2]) is nn.Linear
    assert any("2 stays in high precision because its weight is shared" in str(w.message) for w in recwarn)


def test_a_model_compiled_before_prepare_is_converted_under_its_own_layer_names(monkeypatch, recwarn):
    """The patterns, a user's filter and the report saw torch.compile's "_orig_mod." names: a qualified pattern kept
    nothing in high precision (and a warning suggested a typo)."""
    monkeypatch.setenv(ENV_EXCLUDE, "net.fc1")
    seen = []
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm", fp8_module_filter=lambda m, fqn: not seen.append(fqn))
    model = nn.Sequential()
    model.add_module("net", Net())
    compiled = torch.compile(model, backend="eager")
    compiled, _ = accelerator.prepare(compiled, torch.optim.AdamW(compiled.parameters()))
    assert type(model.net.fc1) is nn.Linear and isinstance(model.net.fc2, FP8Linear)
    assert accelerator.fp8_report["high_precision_linears"] == ["net.fc1", "net.head"]  # head: 10 outputs
    assert seen and all(name.startswith("net.") for name in seen), seen
    assert not [w for w in recwarn if "match no linear layer" in str(w.message)]


def test_an_exclude_pattern_that_matches_no_linear_layer_is_named_in_a_warning(monkeypatch, recwarn):
    monkeypatch.setenv(ENV_EXCLUDE, "fc1,norm,*.fc_2")  # fc1 matches; norm is no linear layer; fc_2 is misspelt
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    model = Net()
    model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    assert type(model.fc1) is nn.Linear and isinstance(model.fc2, FP8Linear)
    messages = [str(w.message) for w in recwarn if "match no linear layer" in str(w.message)]
    assert len(messages) == 1 and "['norm', '*.fc_2']" in messages[0] and "of Net" in messages[0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mixed_precision": "fp16"}, r"mixed_precision='fp16' cannot be combined with FP8-LM.*'bf16'"),
        (
            {"fp8_lm_recipe": "fp8-lm-o3"},
            r"Accelerator\(fp8_lm_recipe='fp8-lm-o3'\): unknown FP8 recipe name 'fp8-lm-o3': choose one of .*'none'",
        ),
        ({"fp8_lm_recipe": ""}, r"Accelerator\(fp8_lm_recipe=''\): unknown FP8 recipe name"),  # named (a sweep)
    ],
)
def test_bad_configurations_are_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Accelerator(cpu=True, **{"fp8_lm_recipe": "fp8-lm", **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fp8_module_filter": 3}, r"fp8_module_filter=3\): must be a callable fn\(module, fqn\) -> bool"),
        # prepare() failed with Python's "<lambda>() takes 1 positional argument but 2 were given", naming nothing
        ({"fp8_module_filter": lambda module: True}, r"fp8_module_filter=<function .*: must be a callable fn\(module"),
        ({"fp8_stats_in_log": "no"}, r"fp8_stats_in_log='no'\): must be True or False"),  # "no" is truthy: logged
    ],
)
def test_bad_fp8_arguments_are_type_errors_before_accelerate_starts(kwargs, match):
    # Accepted before: a filter that is no callable failed inside prepare ("'int' object is not callable").
    with pytest.raises(TypeError, match=match):
        Accelerator(cpu=True, fp8_lm_recipe="fp8-lm", **kwargs)
    assert not AcceleratorState._shared_state


def test_a_recipe_of_another_type_is_named_as_the_accelerators_argument():
    # It said "recipe must be an FP8Recipe, ..." without naming fp8_lm_recipe.
    with pytest.raises(TypeError, match=r"fp8_lm_recipe=\.\.\.\) must be an FP8Recipe.*got dict: e\.g\. FP8Recipe"):
        Accelerator(cpu=True, fp8_lm_recipe={"margin": 1})
    assert not AcceleratorState._shared_state


def test_rejected_mixed_precision_leaves_accelerate_state_untouched():
    with pytest.raises(ValueError, match=r"mixed_precision='fp16' cannot be combined with FP8-LM"):
        Accelerator(cpu=True, fp8_lm_recipe="fp8-lm", mixed_precision="fp16")
    assert not AcceleratorState._shared_state  # the corrected call can still choose its precision
    assert Accelerator(cpu=True, fp8_lm_recipe="fp8-lm", mixed_precision="bf16").mixed_precision == "bf16"


def test_optimizer_prepared_before_the_model_is_an_error():
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"prepare\(AdamW\) before the model.*prepare\(model, optimizer\)"):
        accelerator.prepare(optimizer)
    with pytest.raises(ValueError, match=r"prepare\(AdamW\) before the model"):
        accelerator.prepare_optimizer(optimizer)
    model, optimizer = accelerator.prepare(model, optimizer)  # the right order still works afterwards
    assert isinstance(optimizer.optimizer, FP8AdamW) and accelerator.fp8_grad_scaler.model is model


def test_mu_grows_back_after_a_nonfinite_step():
    # FP8AdamW under Accelerate keeps gradients in high precision (fp8_grads=False): the scaler measures them.
    accelerator, model, optimizer, _ = _setup()
    scaler = accelerator.fp8_grad_scaler
    scaler.growth_interval = 2
    for step in range(5):
        accelerator.backward(_loss(model, _batch()) * (float("nan") if step == 0 else 1.0))
        optimizer.step()
        optimizer.zero_grad()
    assert scaler.skipped_steps == 1 and float(scaler.scale) == 2.0  # 1 -> 0.5, then doubled twice


def test_bad_recipe_in_the_environment_fails_before_accelerate_starts(monkeypatch):
    monkeypatch.setenv(ENV_RECIPE, "fp8_lm")
    with pytest.raises(ValueError, match=r"LIGHTNING_FP8_RECIPE='fp8_lm' is not a known FP8 recipe: choose one of"):
        Accelerator(cpu=True)
    assert not AcceleratorState._shared_state  # nothing was initialized


def test_without_a_recipe_it_is_accelerates_accelerator_and_says_so():
    with pytest.warns(UserWarning, match="FP8-LM is off because the launch chose no recipe"):
        accelerator = Accelerator(cpu=True)
    model = Net()
    reference = copy.deepcopy(model)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    assert not accelerator.fp8_lm_enabled and type(model.fc1) is nn.Linear
    assert type(optimizer.optimizer) is torch.optim.AdamW
    batch = _batch()
    torch.testing.assert_close(model(batch[0]), reference(batch[0]), **EXACT)


def test_bf16_mixed_precision_runs_the_other_ops_in_bf16():
    accelerator, model, optimizer, _ = _setup(mixed_precision="bf16")
    outputs = {}
    model.fc2.register_forward_hook(lambda m, i, o: outputs.update(fc2=o.dtype))
    before = model.state_dict()["fc2.weight"].clone()
    loss = _loss(model, _batch())
    accelerator.backward(loss)
    optimizer.step()
    assert outputs["fc2"] == torch.bfloat16 and math.isfinite(loss.item())
    assert not accelerator.optimizer_step_was_skipped
    assert not torch.equal(model.state_dict()["fc2.weight"], before)


def test_free_memory_lets_a_new_training_prepare_again():
    accelerator, *_ = _setup()
    accelerator.free_memory()
    net = Net()
    _, optimizer2 = accelerator.prepare(net, torch.optim.AdamW(net.parameters()))
    assert isinstance(optimizer2.optimizer, FP8AdamW) and accelerator.fp8_grad_scaler is not None
    with pytest.raises(ValueError, match="trains with one optimizer"):
        accelerator.prepare(torch.optim.AdamW(Net().parameters()))


def test_two_optimizers_in_one_prepare_are_refused_before_anything_changes():
    # The second optimizer was found only after the model had been converted and the first one replaced.
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    net = Net()
    weights = {name: p.detach().clone() for name, p in net.named_parameters()}
    opt1 = torch.optim.AdamW([net.fc1.weight, net.fc2.weight])
    opt2 = torch.optim.SGD(net.head.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="trains with one optimizer.*AdamW, SGD.*Nothing was converted"):
        accelerator.prepare(net, opt1, opt2)
    assert type(net.fc1) is nn.Linear and type(net.fc2) is nn.Linear
    assert "converted_layers" not in accelerator.fp8_report
    assert all(torch.equal(p, weights[name]) and p.dtype == torch.float32 for name, p in net.named_parameters())
    assert not opt1.state and accelerator.fp8_grad_scaler is None
    # One optimizer then prepares as usual.
    model, optimizer = accelerator.prepare(net, opt1)
    assert isinstance(model.fc1, FP8Linear) and isinstance(optimizer.optimizer, FP8AdamW)


def test_other_optimizers_are_kept_and_stepped_with_unscaled_gradients():
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    net = Net()
    with pytest.warns(UserWarning, match="SGD is not AdamW/Adam, so it is kept"):
        model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert type(optimizer.optimizer) is torch.optim.SGD
    accelerator.fp8_grad_scaler.load_state_dict({**accelerator.fp8_grad_scaler.state_dict(), "scale": 4.0})
    accelerator.backward(_loss(model, _batch()))
    bias, scaled_grad = model.head.bias.detach().clone(), model.head.bias.grad.clone()
    optimizer.step()
    # SGD's fused multiply-add rounds once; the reference rounds twice (an update that kept mu would be 4x off).
    torch.testing.assert_close(model.head.bias.detach(), bias - 0.1 * (scaled_grad / 4.0), rtol=1e-6, atol=1e-9)


def test_adam_with_coupled_weight_decay_is_an_error():
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    net = Net()
    with pytest.raises(ValueError, match=r"Adam\(weight_decay=0.1\) adds an L2 term.*use torch.optim.AdamW"):
        accelerator.prepare(net, torch.optim.Adam(net.parameters(), weight_decay=0.1))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_clipping_by_norm_counts_the_gradients_an_fp8adamw_holds_in_fp8(opt_level):
    """A user's own FP8AdamW with fp8_grads=True (its default, O1 too) holds the FP8 weights' gradients outside
    param.grad: accelerator.clip_grad_norm_ left them out of the norm without a word (7.2 instead of 19.0), then
    refused them; now it counts them and clips them through their scales. Clipping by value is refused."""
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    model = convert_to_fp8(Net())  # converted first, so that the user's FP8AdamW takes its FP8 weights as such
    model, optimizer = accelerator.prepare(model, FP8AdamW(model.parameters(), lr=1e-2, opt_level=opt_level))
    accelerator.backward(_loss(model, _batch()))
    held = optimizer.optimizer.fp8_grad_norms()
    assert len(held) == 2
    mu = accelerator.fp8_grad_scaler.loss_scale
    norms = [torch.linalg.vector_norm(p.grad.double()) for p in model.parameters() if p.grad is not None]
    want = torch.linalg.vector_norm(torch.stack(norms + [n.double() for n in held.values()])) / mu
    norm = accelerator.clip_grad_norm_(model.parameters(), float(want) / 2)
    torch.testing.assert_close(norm.double(), want, rtol=1e-5, atol=0)
    for p, n in optimizer.optimizer.fp8_grad_norms().items():  # halved (up to torch's 1e-6 in the factor)
        torch.testing.assert_close(n, held[p] / 2, rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="clip_grad_value_ would miss the FP8 weights' gradients"):
        accelerator.clip_grad_value_(model.parameters(), 1.0)


def test_prepare_refuses_an_fp8adamw_built_before_the_conversion():
    """Found by the twentieth session's docs sweep: an FP8AdamW built on the plain model (prepare converts it later)
    took the weights for ordinary parameters and trained them with fp32 states, no fp16 master, without a word."""
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    net = Net()
    with pytest.raises(ValueError, match="built before the model's conversion.*Build it after"):
        accelerator.prepare(net, FP8AdamW(net.parameters(), lr=1e-2, fp8_grads=False))
    model = convert_to_fp8(Net())  # converted first: its FP8 weights get O2 states and fp16 masters
    model, optimizer = accelerator.prepare(model, FP8AdamW(model.parameters(), lr=1e-2, fp8_grads=False))
    weights = [m.weight for m in model.modules() if isinstance(m, FP8Linear)]
    assert weights and all(w.dtype == torch.float16 for w in weights)


@pytest.mark.parametrize(("launch", "level"), [("fp8-lm-o1", "O2"), ("fp8-lm", "O1")])
def test_prepare_warns_when_the_users_fp8adamw_has_another_opt_level_than_the_launch(launch, level, monkeypatch):
    """The script's own FP8AdamW(opt_level=...) is kept as built, so its level wins over the launch recipe's: that
    was silent (a launch asking for O1 trained the FP8 weights with O2's fp16 masters)."""
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    accelerator = Accelerator(cpu=True, fp8_lm_recipe=launch)
    model = accelerator.prepare(Net())
    with pytest.warns(UserWarning, match=rf"your FP8AdamW steps at opt level {level} .* but the run's recipe has "
                      rf"opt_level='{accelerator.fp8_lm_recipe.opt_level}': the FP8AdamW's level is used.*"
                      rf"build it with opt_level=.*to keep {level}, launch with opt_level='{level}'"):  # fmt: skip
        optimizer = accelerator.prepare(FP8AdamW(model.parameters(), lr=1e-2, opt_level=level, fp8_grads=False))
    assert optimizer.optimizer.opt_level == level
    # The launch's level, given explicitly or through its recipe: nothing to say.
    for kwargs in ({"opt_level": accelerator.fp8_lm_recipe.opt_level}, {"recipe": accelerator.fp8_lm_recipe}):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = Accelerator(cpu=True, fp8_lm_recipe=launch)
        model = accelerator.prepare(Net())
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*your FP8AdamW steps at opt level")
            accelerator.prepare(FP8AdamW(model.parameters(), lr=1e-2, fp8_grads=False, **kwargs))


def test_clip_grad_value_leaves_an_overflow_for_the_scaler():
    """Found by the twentieth session's review: clamping turned an inf gradient into clip_value * mu, so the step
    was taken on it instead of skipped (torch's clip_grad_value_ clamps infinities too)."""
    accelerator, model, optimizer, _ = _setup()
    accelerator.backward(_loss(model, _batch()))
    model.fc1.weight.grad.view(-1)[0] = float("inf")
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    accelerator.clip_grad_value_(model.parameters(), 1e-3)
    assert torch.isinf(model.fc1.weight.grad).any()
    assert model.fc2.weight.grad.abs().max() <= 1e-3 * accelerator.fp8_grad_scaler.loss_scale  # clamped
    optimizer.step()
    assert accelerator.fp8_grad_scaler.skipped_steps == 1
    assert all(torch.equal(model.state_dict()[n], v) for n, v in before.items() if "weight" in n or "bias" in n)


@pytest.mark.parametrize("limit", [-1.0, float("nan")])
@pytest.mark.parametrize("method", ["clip_grad_norm_", "clip_grad_value_"])
def test_a_negative_or_nan_clipping_limit_is_refused_and_nothing_clipped(method, limit):
    # A negative max_norm flipped every gradient's sign (the step climbed the loss), NaN made them NaN: silently.
    accelerator, model, optimizer, _ = _setup()
    accelerator.backward(_loss(model, _batch()))
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=rf"accelerator.{method}\(.*must be >= 0"):
        getattr(accelerator, method)(model.parameters(), limit)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))


def test_free_memory_gives_the_model_its_weights_back():
    """After free_memory the FP8 weights hold the unscaled weights in the model's dtype (they held their fp16 masters
    times a scale, which a later optimizer or plain Accelerator trained as the weights)."""
    accelerator, model, optimizer, _ = _setup()
    for _ in range(2):
        accelerator.backward(_loss(model, _batch()))
        optimizer.step()
        optimizer.zero_grad()
    assert model.fc1.weight.dtype == torch.float16
    state = {k: v.clone() for k, v in model.state_dict().items()}
    accelerator.free_memory()
    assert model.fc1.weight.dtype == torch.float32 and torch.equal(model.fc1.weight.detach(), state["fc1.weight"])
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = model.fc1.weight.detach().clone()
    _loss(model, _batch()).backward()
    plain.step()
    torch.testing.assert_close((model.fc1.weight - before).abs().max(), torch.tensor(1e-2), rtol=0.05, atol=0)


def test_unscale_of_a_prepared_optimizer_then_clip_steps_on_the_clipped_true_gradients():
    """torch.amp's pattern through the prepared optimizer: scaler.unscale_(opt) recorded the wrapper, the wrapper's
    step unscaled the gradients a second time, and accelerator.clip_grad_norm_ took the unscaled gradients for
    mu-scaled ones (clipping mu times too loose)."""
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    accelerator.fp8_grad_scaler._scale = 2.0**8  # mu = 256
    x = torch.randn(8, 32)
    accelerator.backward(model(x).float().square().mean())
    accelerator.fp8_grad_scaler.unscale_(opt)
    norm = accelerator.clip_grad_norm_(model.parameters(), 0.01)
    before = [p.detach().clone() for p in model.parameters()]
    clipped = [p.grad.detach().clone() for p in model.parameters()]
    opt.step()
    for w0, g, p in zip(before, clipped, model.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), w0 - 0.1 * g)  # stepped on the clipped gradients, unscaled once
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in clipped]))
    assert float(total) == pytest.approx(0.01, rel=1e-3)  # clipped in true units
    reference(x).float().square().mean().backward()  # the true gradients' norm (FP8 forward aside): same size
    true_grads = [torch.linalg.vector_norm(p.grad) for p in reference.parameters()]
    true_norm = torch.linalg.vector_norm(torch.stack(true_grads))
    assert float(norm) == pytest.approx(float(true_norm), rel=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("compiled", ["eager", "dynamo"])
def test_an_optimizer_prepared_after_its_ddp_model_is_refused_with_the_fix(tmp_path, compiled):
    """Found by a sweep: model = prepare(model); optimizer = prepare(optimizer) under DDP failed inside FP8AdamW with
    advice for plain PyTorch (create FP8AdamW before wrapping in DDP), which an Accelerate script does not do. With
    dynamo_backend the DDP model came back compiled (OptimizedModule(DDP)): neither that refusal nor the FP8
    all-reduce hook saw the DDP wrapper (gradients went in fp32 without a word)."""
    log = run_two_processes(Path(__file__).with_name("prepare_order_worker.py"), tmp_path, compiled)
    assert "rank 0: prepare order ok" in log and "rank 1: prepare order ok" in log, log[-3000:]


def test_a_run_without_fp8_refuses_an_fp8_checkpoints_scaled_moments_until_converted(tmp_path, monkeypatch):
    # A plain AdamW took FP8AdamW's file without a word and read its stored moments (value * scale) as the moments.
    accelerator, model, optimizer, scheduler = _setup()
    _train(accelerator, model, optimizer, scheduler, steps=2)
    adamw_form = optimizer.optimizer.to_adamw_state_dict()
    accelerator.save_state(str(tmp_path / "ckpt"))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()

    monkeypatch.setenv(ENV_RECIPE, "none")
    plain = Accelerator(cpu=True)
    net = Net()
    before = copy.deepcopy(net.state_dict())
    groups = [
        {"params": [net.fc1.weight, net.fc2.weight], "weight_decay": 0.1, "name": "matrices"},
        {"params": [p for n, p in net.named_parameters() if not n.endswith(("fc1.weight", "fc2.weight"))]},
    ]
    net, adamw = plain.prepare(net, torch.optim.AdamW(groups, lr=1e-2, betas=(0.8, 0.95), eps=1e-7))
    path = tmp_path / "ckpt" / "optimizer.bin"
    with pytest.raises(ValueError, match="holds FP8AdamW's optimizer states") as info:
        plain.load_state(str(tmp_path / "ckpt"))
    assert str(path) in str(info.value) and "adamw_state_dict" in str(info.value)
    for key, value in net.state_dict().items():  # nothing was loaded
        torch.testing.assert_close(value, before[key], **EXACT)
    assert not adamw.optimizer.state

    torch.save(adamw_state_dict(torch.load(path, weights_only=True)), path)  # the documented conversion
    plain.load_state(str(tmp_path / "ckpt"))
    loaded = adamw.optimizer.state_dict()["state"]
    assert loaded.keys() == adamw_form["state"].keys()
    for index, state in adamw_form["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(loaded[index][key], state[key], **EXACT)


@pytest.mark.parametrize("how", ["env", "filter"])
def test_a_model_converted_before_prepare_with_a_layer_the_launch_excludes_is_refused(monkeypatch, how):
    # convert_to_fp8 leaves FP8 layers as they are: the excluded layer trained in FP8, silently, and fp8_report named
    # nothing in high precision.
    kwargs = {}
    if how == "env":
        monkeypatch.setenv(ENV_EXCLUDE, "fc2")
    else:
        kwargs["fp8_module_filter"] = lambda module, fqn: fqn != "fc2"
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm", **kwargs)
    model = convert_to_fp8(Net(), "fp8-lm")
    with pytest.raises(ValueError, match=r"already has FP8 layers that this launch keeps in high precision.*\['fc2'\]"):
        accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert model.fc2.weight.dtype == torch.float32  # nothing changed: no optimizer took the weights


def test_a_model_converted_before_prepare_with_another_recipe_says_where_the_recipes_come_from():
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    model = convert_to_fp8(Net(), "fp8-lm-current")
    with pytest.raises(ValueError, match=r"already converted, its layer 'fc1'.*fp8_lm_recipe= / LIGHTNING_FP8_RECIPE"):
        accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    same = convert_to_fp8(Net(), "fp8-lm")  # the launch's recipe: taken as it is
    same, _ = accelerator.prepare(same, torch.optim.AdamW(same.parameters(), lr=1e-3))
    assert isinstance(same.fc1, FP8Linear)
