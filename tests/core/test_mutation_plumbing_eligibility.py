"""Which layers convert_to_fp8 keeps in high precision, and the one warning per reason naming them
(lightning_fp8/eligibility.py, weight_reads.py): behaviour a mutation audit found unpinned. The reference is the
documented reason (docs/ and eligibility._LEFT_BECAUSE): a layer whose weight some module computes with is named under
"reads their weight itself", also where another module casts a tensor to the same weight's dtype."""

import re
import warnings

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Linear, convert_to_fp8


def _messages(model: nn.Module) -> list[str]:
    with pytest.warns(UserWarning) as record:
        convert_to_fp8(model)
    return [str(w.message) for w in record]


class _CastsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(self.proj.weight.dtype))


class _ReadsInnerWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _CastsInput()
        self.other = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + x @ self.inner.proj.weight.t() + self.other(x)


def test_a_weight_read_by_its_grandparent_and_cast_to_by_its_parent_is_named_as_read(fresh_warnings):
    # The outer module (seen first) computes with the weight, the inner one casts to its dtype: the weight's values
    # are read bypassing the layer, which is the reason to name (a dtype cast alone would be the lesser one).
    model = _ReadsInnerWeight()
    messages = _messages(model)
    assert any(re.search(r"reads their weight itself.*: inner\.proj$", m) for m in messages), messages
    assert not any("casts their input to their weight's dtype" in m for m in messages), messages
    assert type(model.inner.proj) is nn.Linear and isinstance(model.other, FP8Linear)


class _ReadsWeightInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.proj.weight.t()


class _CallsTheLayer(_ReadsWeightInForward):
    # Its forward replaces the base's (Python's method resolution): the layer is called, its weight never read.
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self.proj.weight, "quant_state"):  # a check of an attribute (as bitsandbytes' is): no value read
            raise AssertionError("not reached")
        return self.proj(x)


def test_the_forward_that_runs_is_the_subclass_s_and_attribute_checks_read_no_weight():
    model = nn.Sequential(_CallsTheLayer())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left in high precision, nothing to name
        convert_to_fp8(model)
    assert isinstance(model[0].proj, FP8Linear)
    assert model(torch.randn(4, 32)).shape == (4, 32)


def test_a_base_forward_that_reads_the_weight_leaves_the_layer(fresh_warnings):
    # The reverse, so that the previous test cannot pass by missing every read.
    model = nn.Sequential(_ReadsWeightInForward())
    messages = _messages(model)
    assert any(re.search(r"reads their weight itself.*: 0\.proj$", m) for m in messages), messages
    assert type(model[0].proj) is nn.Linear


class _Router(nn.Module):
    # A mixture of experts' router as transformers 5 holds it: num_experts and a 2-D weight (num_experts, hidden).
    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 4
        self.weight = nn.Parameter(torch.randn(4, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight).softmax(-1)


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 4
        self.gate_up_proj = nn.Parameter(torch.randn(4, 64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ti,eoi->teo", x, self.gate_up_proj).mean(1)


def test_only_3d_expert_weights_are_named_as_experts_not_a_router(fresh_warnings):
    # docs: "one 3-D parameter (experts, out, in) per projection"; a router's (experts, hidden) is no expert weight.
    model = nn.ModuleDict({"router": _Router(), "experts": _Experts()})
    messages = _messages(model)
    experts = [m for m in messages if "expert weights" in m]
    assert len(experts) == 1 and experts[0].startswith("convert_to_fp8 left 1 linear layer(s)"), messages
    assert ": experts (4 experts)" in experts[0] and "router" not in " ".join(messages), messages


class _ReadsAndCasts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.proj.weight.t()  # a read of the weight's values (met first in the source's syntax tree)
        return torch.relu(torch.relu(y.to(self.proj.weight.dtype)))  # and a cast to its dtype


def test_a_forward_that_reads_the_weight_and_casts_to_its_dtype_is_named_as_reading_it(fresh_warnings):
    model = nn.Sequential(_ReadsAndCasts())
    messages = _messages(model)
    assert any(re.search(r"reads their weight itself.*: 0\.proj$", m) for m in messages), messages
    assert not any("casts their input to their weight's dtype" in m for m in messages), messages


class _KeepsStrict(nn.Module):
    # transformers' stricter form of _keep_in_fp32_modules (kept in fp32 also under a bf16/fp16 model dtype).
    _keep_in_fp32_modules_strict = ["wo"]

    def __init__(self) -> None:
        super().__init__()
        self.wi = nn.Linear(32, 32)
        self.wo = nn.Linear(32, 32)


def test_a_layer_in_keep_in_fp32_modules_strict_is_left_and_named(fresh_warnings):
    model = _KeepsStrict()
    messages = _messages(model)
    assert any("keeps them in float32" in m and m.endswith("overflow: wo") for m in messages), messages
    assert isinstance(model.wi, FP8Linear) and type(model.wo) is nn.Linear
