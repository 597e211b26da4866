"""FP8AdamW.load_state_dict behaviour that a mutation audit found unpinned, each against what torch.optim.AdamW does
with the same state dict: a state dict whose groups lack ``maximize`` (saved before torch had it, or written by other
tools) loads with ``maximize=False``, as torch.optim.AdamW fills it in."""

import copy

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny tensor ops on one thread


def test_groups_without_maximize_load_with_torchs_default():
    torch.manual_seed(0)
    saved = torch.optim.AdamW([nn.Parameter(torch.randn(16))], lr=1e-2).state_dict()
    for group in saved["param_groups"]:
        del group["maximize"]
    reference = torch.optim.AdamW([nn.Parameter(torch.randn(16))], lr=1e-3, maximize=True)
    reference.load_state_dict(saved)
    opt = FP8AdamW([nn.Parameter(torch.randn(16))], lr=1e-3, maximize=True)
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["maximize"] is reference.param_groups[0]["maximize"] is False
    assert opt.state_dict()["param_groups"][0]["maximize"] is False  # saved again with it


def _saved_with_low_precision_moments():
    # A plain parameter with low_precision_moments="all": E4M3 exp_avg and fp16 exp_avg_sq, each with scale and amax.
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(16))
    opt = FP8AdamW([p], lr=1e-2, low_precision_moments="all")
    p.grad = torch.randn(16)
    opt.step()
    return opt.state_dict()


def _fresh_optimizer():
    torch.manual_seed(1)
    return FP8AdamW([nn.Parameter(torch.randn(16))], lr=1e-2, low_precision_moments="all")


def test_a_scale_of_2_to_the_127_loads_as_its_values():
    """2**127 is the largest scale FP8AdamW writes (for a state of amax below 2**-112) and the documented top of the
    range a load accepts; the loaded values are stored / scale, computed here in float64."""
    saved = _saved_with_low_precision_moments()
    state = saved["state"][0]
    values = torch.rand(16, dtype=torch.float64) * 2.0**-120 + 2.0**-122  # far below fp16's range, fp32 normals
    state["exp_avg_sq"] = (values * 2.0**127).to(torch.float16)
    state["exp_avg_sq_scale"] = torch.tensor(2.0**127)
    state["exp_avg_sq_amax"] = values.max().float()
    opt = _fresh_optimizer()
    opt.load_state_dict(saved)
    loaded = opt.to_adamw_state_dict()["state"][0]["exp_avg_sq"].double()
    expected = state["exp_avg_sq"].double() / 2.0**127
    torch.testing.assert_close(loaded, expected, rtol=2**-10, atol=0)


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_an_amax_below_the_values_beyond_the_rounding_slack_is_refused_and_changes_nothing(key):
    """The amax check allows for the storage's rounding (a factor 1.25 and a subnormal step) and no more: an amax 1.6
    times below the largest value would make the next step pick a scale 1.6 times too large and saturate the state."""
    saved = _saved_with_low_precision_moments()
    state = saved["state"][0]
    largest = (state[key].double() / state[f"{key}_scale"].double()).abs().max()
    state[f"{key}_amax"] = (largest / 1.6).float()
    opt = _fresh_optimizer()
    before = opt.state_dict()
    with pytest.raises(ValueError, match=f"'{key}_amax' is below the largest value"):
        opt.load_state_dict(saved)
    assert not opt.state and opt.state_dict()["param_groups"] == before["param_groups"]


def _bf16_run(p: nn.Parameter, opt: FP8AdamW, steps: range) -> None:
    for i in steps:
        p.grad = (torch.rand(64, generator=torch.Generator().manual_seed(i)) + 0.5).to(torch.bfloat16)
        opt.step()


def test_a_bf16_parameter_resumes_from_its_saved_fp32_master_bit_for_bit():
    """A bf16 parameter's fp32 master is saved with the state; a resumed run takes it from there, not from the bf16
    weight (which lost the updates below bf16's spacing): the resumed run continues bit for bit as the one that went
    on (the module's documented promise). Updates of 1e-3 on weights near 1, where bf16's spacing is 2**-8."""
    p = nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    opt = FP8AdamW([p], lr=1e-3, weight_decay=0.0)
    _bf16_run(p, opt, range(3))
    saved, saved_weight = copy.deepcopy(opt.state_dict()), p.detach().clone()  # (state_dict() holds references)
    _bf16_run(p, opt, range(3, 6))

    resumed = nn.Parameter(saved_weight.clone())
    resumed_opt = FP8AdamW([resumed], lr=1e-3, weight_decay=0.0)
    resumed_opt.load_state_dict(saved)
    _bf16_run(resumed, resumed_opt, range(3, 6))
    assert not torch.equal(saved["state"][0]["master"], saved_weight.float())  # the master is not the bf16 weight
    assert torch.equal(resumed_opt.state_dict()["state"][0]["master"], opt.state_dict()["state"][0]["master"])
    assert torch.equal(resumed.detach(), p.detach())
