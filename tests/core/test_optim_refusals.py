"""What FP8AdamW refuses on every path in, not only in its constructor: AMSGrad (FP8AdamW implements AdamW without it)
through add_param_group and through a loaded state dict, before anything changes."""

import copy

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, convert_to_fp8
from tests.numerics import assert_same

NO_AMSGRAD = "FP8AdamW\\(amsgrad=True\\) is not supported"  # the constructor's message


def _model() -> nn.Module:
    torch.manual_seed(0)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()


def _snapshot(model: nn.Module, opt: FP8AdamW) -> tuple:
    return copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())


def test_add_param_group_refuses_amsgrad_as_the_constructor_does():
    """It was kept in the group and ignored: the group stepped as AdamW."""
    a, b = nn.Parameter(torch.randn(16)), nn.Parameter(torch.randn(16))
    opt = FP8AdamW([a])
    with pytest.raises(ValueError, match=NO_AMSGRAD):
        opt.add_param_group({"params": [b], "amsgrad": True})
    assert len(opt.param_groups) == 1  # not kept
    with pytest.raises(ValueError, match=NO_AMSGRAD):
        FP8AdamW([{"params": [a]}, {"params": [b], "amsgrad": True}])
    opt.add_param_group({"params": [b], "amsgrad": False})  # torch.optim.AdamW's default, spelled out
    assert opt.param_groups[1]["params"] == [b]


@pytest.mark.parametrize("saved", ["amsgrad_adamw", "max_exp_avg_sq_only"])
def test_load_state_dict_refuses_amsgrad_before_anything_changes(saved):
    """A torch.optim.AdamW(amsgrad=True) state dict loaded with its running maximum ('max_exp_avg_sq') dropped and
    stepped on as AdamW. Refused: the optimizer and the weights are those of an optimizer that never tried."""
    source = copy.deepcopy(_model())
    adamw = torch.optim.AdamW(source.parameters(), lr=1e-2, amsgrad=True)
    for _ in range(2):
        _step(source, adamw)
    state_dict = adamw.state_dict()
    if saved == "max_exp_avg_sq_only":  # a state with AMSGrad's maximum whose groups say amsgrad=False
        for group in state_dict["param_groups"]:
            group["amsgrad"] = False
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=3e-3)
    _step(model, opt)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match="AMSGrad") as raised:
        opt.load_state_dict(state_dict)
    assert "amsgrad" in str(raised.value) and "max_exp_avg_sq" in str(raised.value)  # says what to do
    assert_same(_snapshot(model, opt), before)


def test_load_state_dict_takes_torch_adamw_groups_with_amsgrad_false():
    """torch.optim.AdamW saves amsgrad=False in its groups: such a state dict loads, and FP8AdamW continues as
    torch.optim.AdamW (fp32 states of parameters that are not FP8 weights)."""
    torch.manual_seed(0)
    ref = nn.Linear(32, 16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(8, 32)
    ref(x).square().mean().backward()
    ref_opt.step()
    assert ref_opt.state_dict()["param_groups"][0]["amsgrad"] is False
    model = copy.deepcopy(ref)
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # not ref_opt's live tensors (torch's loads alias them)
    for m, o in ((ref, ref_opt), (model, opt)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_adamw_performance_arguments_are_accepted_and_step_as_without_them():
    """Code written for torch.optim.AdamW passes foreach= or fused=: FP8AdamW raised TypeError (unexpected keyword)
    though it takes AdamW's arguments. They have no effect (the step is always fused): the same bits as without them;
    capturable=True and differentiable=True are refused, saying what to do."""
    runs = []
    for kwargs in ({}, {"foreach": True, "fused": True}, {"foreach": False, "fused": False, "capturable": False}):
        torch.manual_seed(0)
        model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16)))
        opt = FP8AdamW(model.parameters(), lr=1e-2, **kwargs)
        for _ in range(2):
            _step(model, opt)
        runs.append(_snapshot(model, opt))
    assert_same(runs[1], runs[0])
    assert_same(runs[2], runs[0])
    for name in ("capturable", "differentiable"):
        with pytest.raises(ValueError, match=f"FP8AdamW\\({name}=True\\) is not supported"):
            FP8AdamW(nn.Linear(4, 4).parameters(), **{name: True})
