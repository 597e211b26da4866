"""The FP8 Accelerator's clipping, logging, throughput and resumed health events, pinned where a mutation audit of
the integrations found them unpinned (each mutant passed the suite), against ``torch.nn.utils.clip_grad_value_`` /
``clip_grad_norm_`` on the true gradients of an fp32 copy of the model (plain autograd) and docs/accelerate.md:
``accelerator.clip_grad_value_`` clamps the gradients, which carry mu, at ``clip_value * mu`` (not at ``clip_value``,
mu times too tight); ``clip_grad_norm_`` of any order leaves gradients under ``max_norm`` as they are (torch's
coefficient is at most 1); ``Accelerator(fp8_stats_in_log=False)`` logs only the script's values; the throughput
counts every training forward between two steps and no evaluation time between them (counted by the batches' own
shapes); a skip after ``load_state`` does not report the saved run's fallback again. The clipping tests' layer sizes
are not multiples of 16, so none becomes FP8 and mu = 2^6 scales every gradient exactly."""

import copy
import math
import time
import warnings

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from torch import nn

from lightning_fp8.accelerate import Accelerator
from tests.integrations.accelerate.test_accelerator import _fresh_accelerate_state, _memory_tracker  # noqa: F401 (autouse fixture)
from tests.integrations.accelerate.test_health_values import TokenNet

MU = 2.0**6


def _scaled_backward(seed: int = 0):
    """The accelerator's backward (gradients times mu) and plain autograd's true gradients of the same loss."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 5))
    reference = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no layer converted: said once, not what this test is about
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.fp8_grad_scaler.load_state_dict({**accelerator.fp8_grad_scaler.state_dict(), "scale": MU})
    x, y = torch.randn(9, 12), torch.randn(9, 5)
    accelerator.backward(((model(x) - y) ** 2).mean())
    ((reference(x) - y) ** 2).mean().backward()
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, r.grad * MU)  # the premise: mu scales exactly
    return accelerator, model, reference


def test_clip_grad_value_clamps_the_true_gradients_at_clip_value():
    accelerator, model, reference = _scaled_backward()
    limit = 0.5 * float(max(r.grad.abs().max() for r in reference.parameters()))
    torch.nn.utils.clip_grad_value_(reference.parameters(), limit)
    accelerator.clip_grad_value_(model.parameters(), limit)
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad / MU, r.grad, rtol=0, atol=0)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_clip_grad_norm_under_max_norm_leaves_the_gradients_as_they_are(norm_type):
    accelerator, model, reference = _scaled_backward(1)
    before = [p.grad.clone() for p in model.parameters()]
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e6, norm_type=norm_type)
    total = accelerator.clip_grad_norm_(model.parameters(), 1e6, norm_type=norm_type)
    torch.testing.assert_close(total, want, rtol=1e-6, atol=0)
    for p, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.grad, old)


@pytest.mark.parametrize("in_log", [True, False])
def test_fp8_stats_in_log_false_logs_only_the_scripts_values(in_log):
    """docs/accelerate.md: ``log`` adds the FP8 and health statistics, turned off with fp8_stats_in_log=False."""
    tracker = _memory_tracker()
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm", log_with=[tracker], fp8_stats_in_log=in_log)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    accelerator.init_trackers("t")
    accelerator.backward(model(torch.randn(8, 16)).square().mean())
    optimizer.step()
    accelerator.log({"loss": 1.5}, step=1)
    ((step, row),) = tracker.rows
    assert step == 1 and row["loss"] == 1.5
    if in_log:
        assert row["fp8/grad_scaler/scale"] == accelerator.fp8_grad_scaler.loss_scale and "health/loss" in row
    else:
        assert row == {"loss": 1.5}


def test_throughput_counts_every_training_forward_of_a_step_and_not_an_evaluation_between_them():
    """Two training forwards (4 samples of 6 tokens each) per optimizer step, with an evaluation forward and 1 s
    between them: the window counts 8 samples and 48 tokens (docs/accelerate.md: the training forwards between two
    steps; the clock stops at an evaluation forward and restarts with the next training forward), so the rate is above
    8 samples / 1 s (the evaluation's second counted, it is below), and tokens per sample stay the batches' 6. The
    first window is left out of the rate check (first-call costs on a loaded machine)."""
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    torch.manual_seed(0)
    net = TokenNet()
    model, optimizer = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    for _ in range(3):
        for micro in range(2):
            ids = torch.randint(0, 32, (4, 6))
            loss = nn.functional.cross_entropy(model(input_ids=ids).flatten(0, 1), ids.flatten())
            accelerator.backward(loss)
            if micro == 0:
                model.eval()
                with torch.no_grad():
                    model(input_ids=torch.randint(0, 32, (64, 6)))
                    time.sleep(1.0)
                model.train()
        optimizer.step()
        optimizer.zero_grad()
    series = accelerator.fp8_health.series
    assert len(series["samples_per_sec"]) == 3
    for i, ((_, samples), (_, tokens)) in enumerate(zip(series["samples_per_sec"], series["tokens_per_sec"],
                                                         strict=True)):  # fmt: skip
        assert tokens == pytest.approx(6 * samples, rel=1e-9)
        assert i == 0 or samples > 8 / 1.0


def test_a_fallback_of_the_saved_run_is_not_reported_again_by_a_skip_after_load_state(tmp_path):
    """The saved run's bf16 fallback (at its skipped step 1) is in the scaler's restored history; a step the resumed
    run skips without a fallback (the fallback turned off) is reported as what the scaler did then: skip_step+lower_mu
    (the events' rule, :func:`lightning_fp8.health.skipped_step_action` of that step's fallbacks: none)."""
    from tests.integrations.accelerate.test_accelerator import _batch, _fc2_poisoned_loss, _loss
    from tests.integrations.accelerate.test_accelerator import _setup as _setup_net

    def run(poisoned: set[int], steps: range, fallback: bool, load=None, save=None):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator, model, optimizer, _ = _setup_net()
        if load is not None:
            accelerator.load_state(str(load))
        scaler = accelerator.fp8_grad_scaler
        scaler.nonfinite_fallback, scaler.fallback_after = ("bf16", 1) if fallback else (None, scaler.fallback_after)
        for i in steps:
            accelerator.backward((_fc2_poisoned_loss if i in poisoned else _loss)(model, _batch()))
            optimizer.step()
            optimizer.zero_grad()
        if save is not None:
            accelerator.save_state(str(save))
        return accelerator

    torch.manual_seed(0)
    saved = run({1}, range(3), fallback=True, save=tmp_path / "ckpt")
    assert [e.action for e in saved.fp8_health.events if e.kind == "nonfinite_grad"] == [
        "skip_step+lower_mu+fallback_bf16"
    ]  # the premise: the saved run's skip ran the fallback
    resumed = run({4}, range(3, 6), fallback=False, load=tmp_path / "ckpt")
    events = [(e.step, e.action) for e in resumed.fp8_health.events if e.kind == "nonfinite_grad"]
    assert events[-1] == (4, "skip_step+lower_mu")
