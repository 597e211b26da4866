"""The numbers lightning_fp8 reports about a run, checked against references written here from DESIGN.md's formulas,
and the errors of the calls that read them (fp8_stats with arguments in the wrong place)."""

import math

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, FP8Recipe, convert_to_fp8, fp8_stats


def _model() -> nn.Module:
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 16)))


def test_a_grad_scaler_passed_as_the_optimizer_is_refused_saying_to_pass_it_as_grad_scaler():
    # fp8_stats(model, scaler): the second positional argument is the optimizer. The error said "for several, call
    # fp8_stats once per optimizer", which does not apply to a scaler and does not say where it goes.
    model = _model()
    with pytest.raises(TypeError, match=r"got FP8GradScaler.*grad_scaler=") as error:
        fp8_stats(model, FP8GradScaler())
    assert "once per optimizer" not in str(error.value)


def test_a_model_passed_as_the_optimizer_is_refused_saying_what_the_arguments_are():
    model = _model()
    with pytest.raises(TypeError, match=r"got Sequential.*fp8_stats\(model, optimizer, grad_scaler\)") as error:
        fp8_stats(model, model)
    assert "once per optimizer" not in str(error.value)


@pytest.mark.parametrize("optimizers", [[], ()], ids=["list", "tuple"])
def test_several_optimizers_are_refused_saying_to_call_once_per_optimizer(optimizers):
    model = _model()
    optimizers = type(optimizers)([torch.optim.SGD(model.parameters(), lr=0.1)] * 2)
    with pytest.raises(TypeError, match=r"got (list|tuple): for several, call fp8_stats once per optimizer"):
        fp8_stats(model, optimizers)


def _pow2_scale(amax: float, fmax: float, margin: int = 0) -> float:
    # DESIGN.md's scale, written out independently: 2 ** (floor(log2(fp8_max / amax)) - margin).
    return 2.0 ** (math.floor(math.log2(fmax / amax)) - margin)


@pytest.mark.parametrize("history_len", [1, 16])
def test_input_statistics_follow_the_delayed_scaling_rule_through_an_amax_jump(history_len):
    # Inputs whose amax is set by hand (one large value among small ones): the scale a cast used comes from the amaxes
    # of earlier casts (the first cast: its own), the scale reported after it from the window including this one.
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 16)), FP8Recipe(amax_history_len=history_len, margin=1))
    amaxes = []
    for step, big in enumerate([1.0, 1000.0, 3.0, 0.01, 5.0]):
        x = torch.randn(8, 32) * 0.1
        x[0, 0] = big
        amaxes.append(x.abs().max().item())
        model(x).sum().backward()
        used = _pow2_scale(max(amaxes[:-1][-history_len:] or amaxes), 448.0, 1)
        state = fp8_stats(model)["layers"]["0"]["input"]
        assert state["amax"] == amaxes[-1] and state["casts"] == step + 1
        assert state["scale"] == _pow2_scale(max(amaxes[-history_len:]), 448.0, 1)
        assert state["saturation"] == pytest.approx(((x * used).abs() >= 448.0).float().mean().item(), abs=0)
        expected_history = amaxes[::-1][:history_len]
        assert state["amax_history"] == expected_history + [0.0] * (history_len - len(expected_history))


def test_weight_statistics_after_a_step_are_those_of_the_last_forward_cast():
    # docs/guides/monitoring.md: a weight's scale is computed from the weight at every forward, so after the optimizer
    # step the reported one is that of the last cast (the weights before the step), not of the weights now.
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 48)))
    scaler = FP8GradScaler(model=model)
    optimizer = FP8AdamW(model.parameters(), lr=0.05, grad_scaler=scaler)
    before = model.state_dict()["0.weight"].float().abs().max().item()
    scaler.scale_loss(model(torch.randn(8, 32)).square().mean()).backward()
    optimizer.step()
    state = fp8_stats(model)["layers"]["0"]["weight"]
    assert model.state_dict()["0.weight"].float().abs().max().item() != before  # the step moved the weights
    assert state["amax"] == before
    assert state["scale"] == _pow2_scale(before, 448.0)


def test_last_saturation_after_a_skipped_step_is_that_steps():
    """A step skipped for a non-finite gradient kept the previous step's saturated fraction in
    ``FP8GradScaler.last_saturation`` (logged as ``fp8/grad_scaler/last_saturation``), though none of its casts
    saturated. Found by the reported-numbers sweep."""
    recipe = FP8Recipe(scaling="current", opt_level="O1")
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 16, bias=False)), recipe)
    scaler = FP8GradScaler(init_scale=4.0, model=model)
    opt = FP8AdamW(model.parameters(), grad_scaler=scaler, recipe=recipe)
    x = torch.randn(8, 32)

    def step(weights: torch.Tensor) -> float:
        scaler.scale_loss((model(x) * weights).sum()).backward()
        opt.step()
        opt.zero_grad()
        return scaler.last_saturation

    spiked = torch.ones(8, 16)
    spiked[0] = 1e4  # one row of the weight gradient far past E5M2's 57344 at mu = 4
    grad = (4.0 * spiked.t() @ x).abs()  # the weight gradient the optimizer's cast holds, as mu scaled it
    assert step(spiked) == float((grad >= 57344).float().mean()) > 0
    poisoned = torch.ones(8, 16)
    poisoned[0, 0] = float("nan")
    assert step(poisoned) == 0.0 and scaler.skipped_steps == 1
