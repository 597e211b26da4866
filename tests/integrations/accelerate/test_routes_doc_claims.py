"""The checkable claims of docs/accelerate.md (with docs/guides/checkpoints.md, docs/api/accelerate.md) that no other
test checks, each test quoting its claim and naming its page, each against an independent reference (plain
``torch.optim.AdamW`` / ``Adam`` param groups, a freshly prepared model, or the value the page states).

Most of both pages' claims (about 45 checked) are already tested elsewhere (tests/core/test_state_*.py,
test_checkpoint_load.py, tests/integrations/accelerate/test_accelerator.py, test_checkpoint_*.py,
test_load_state_atomic.py, test_save_state_interrupted.py, test_schedulers.py, test_health_values.py, ...).

Pages and claim groups covered here:

- docs/accelerate.md, ``save_state`` / ``load_state``: loaded under another recipe it warns once; the FP8 scaling
  state loads where only ``opt_level`` differs and starts fresh where ``margin``, the format, the history length or
  the scaling differ; mu and the optimizer state load either way; no warning under the same recipe.
- docs/accelerate.md, ``prepare(optimizer)``: ``AdamW`` / ``Adam`` become ``FP8AdamW`` with the same hyper-parameters
  and param groups (extra group keys and ``maximize`` kept, ``foreach`` dropped); AMSGrad and ``differentiable=True``
  refused.

Findings: none (no ``# BUG:`` or ``# DOCS:``). Noted: loading mu into a model whose FP8 state "starts fresh" rescales
its unused grad_output scales (1 -> 1/mu); harmless, as the next backward casts exactly as a fresh state does.
"""

import copy
import warnings

import pytest
import torch
from torch import nn

from lightning_fp8 import fp8_state_dict
from lightning_fp8.accelerate import Accelerator
from lightning_fp8.optim import FP8AdamW
from lightning_fp8.recipe import FP8Recipe
from tests.integrations.accelerate.test_routes_loop_forms import (  # noqa: F401 (an autouse fixture)
    _fresh_accelerate_state,
    _reset,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 10)  # 10 outputs: stays nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


torch.manual_seed(0)
_BASE = Net()
_DATA = [(torch.randn(8, 32), torch.randint(0, 10, (8,))) for _ in range(3)]


def _train(accelerator, model, optimizer, steps: int) -> None:
    for x, y in _DATA[:steps]:
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def _prepare(recipe):
    _reset()
    accelerator = Accelerator(cpu=True, fp8_lm_recipe=recipe)
    model = copy.deepcopy(_BASE)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return accelerator, model, optimizer


def _fp8(accelerator, model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in fp8_state_dict(accelerator.unwrap_model(model)).items()}


def _assert_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0, atol=0, msg=key)


# ============================================================ docs/accelerate.md: save_state / load_state, recipes


def _saved_run(tmp_path, recipe="fp8-lm"):
    accelerator, model, optimizer = _prepare(recipe)
    _train(accelerator, model, optimizer, 2)
    scaler = accelerator.fp8_grad_scaler
    scaler.load_state_dict({**scaler.state_dict(), "scale": 32.0})
    accelerator.save_state(str(tmp_path / "ckpt"))
    return _fp8(accelerator, model), optimizer.optimizer.state_dict()


@pytest.mark.parametrize(
    "other",
    [FP8Recipe(margin=1), FP8Recipe(fp8_format="e4m3"), FP8Recipe(amax_history_len=8), FP8Recipe(scaling="current")],
    ids=["margin", "format", "history_len", "scaling"],
)
def test_load_state_under_other_scaling_settings_warns_once_keeps_fresh_scales_and_loads_mu(
    tmp_path, fresh_warnings, other
):
    """docs/accelerate.md (save_state/load_state row): "Loaded under another recipe, it warns once: [...] starts fresh
    where the format, scaling, history length, amax_compute_algo or margin differ (mu and the optimizer state load
    either way)"."""
    _, saved_optimizer = _saved_run(tmp_path)
    accelerator, model, optimizer = _prepare(other)
    fresh = _fp8(accelerator, model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.load_state(str(tmp_path / "ckpt"))
        accelerator.load_state(str(tmp_path / "ckpt"))
    recipe_warnings = [w for w in caught if "trained with FP8 recipe" in str(w.message)]
    assert len(recipe_warnings) == 1 and "not loaded" in str(recipe_warnings[0].message)
    after = _fp8(accelerator, model)
    # Loading mu (1 -> 32) rescales the still unused grad_output scales (1 -> 1/32): every other entry is the fresh
    # one, and the next backward casts exactly as a truly fresh state (the scale computed from the tensor) does.
    changed = {k for k in fresh if not torch.equal(after[k], fresh[k])}
    assert changed <= {"fc1.fp8_scaling.grad_output.scale", "fc2.fp8_scaling.grad_output.scale"}
    net = accelerator.unwrap_model(model)
    reference = copy.deepcopy(net)
    reference.load_state_dict(net.state_dict())
    for layer in (reference.fc1, reference.fc2):
        layer.fp8_scaling.grad_output.scale.fill_(1.0)  # as before the load
    x, y = _DATA[2]
    for module in (net, reference):
        (nn.functional.cross_entropy(module(x), y) * 32).backward()
    for name in ("fc1", "fc2"):
        got, want = getattr(net, name), getattr(reference, name)
        torch.testing.assert_close(got.weight.grad, want.weight.grad, rtol=0, atol=0)
        assert torch.equal(got.fp8_scaling.grad_output.scale, want.fp8_scaling.grad_output.scale)
    assert float(accelerator.fp8_grad_scaler.scale) == 32.0
    loaded = optimizer.optimizer.state_dict()
    assert [s["step"] for s in loaded["state"].values()] == [s["step"] for s in saved_optimizer["state"].values()]


def test_load_state_where_only_opt_level_differs_loads_the_scaling_state(tmp_path, fresh_warnings):
    """docs/accelerate.md (save_state/load_state row): "the FP8 scaling state loads where only opt_level differs"
    (an O2 checkpoint resumed at O1), with the warning; mu loads too."""
    saved_fp8, _ = _saved_run(tmp_path, "fp8-lm")
    accelerator, model, optimizer = _prepare("fp8-lm-o1")
    with pytest.warns(UserWarning, match=r"trained with FP8 recipe .*the saved scaling state is loaded"):
        accelerator.load_state(str(tmp_path / "ckpt"))
    _assert_equal(_fp8(accelerator, model), saved_fp8)
    assert float(accelerator.fp8_grad_scaler.scale) == 32.0


def test_load_state_under_the_same_recipe_does_not_warn(tmp_path, fresh_warnings):
    """docs/accelerate.md: the recipe warning is for a checkpoint "Loaded under another recipe" only."""
    saved_fp8, _ = _saved_run(tmp_path)
    accelerator, model, _ = _prepare("fp8-lm")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.load_state(str(tmp_path / "ckpt"))
    assert not [w for w in caught if "trained with FP8 recipe" in str(w.message)]
    _assert_equal(_fp8(accelerator, model), saved_fp8)


# ============================================================ docs/accelerate.md: prepare(optimizer)


def test_prepare_swaps_adamw_keeping_hyper_parameters_group_keys_and_maximize_dropping_foreach():
    """docs/accelerate.md (prepare(optimizer) row): "AdamW/Adam becomes FP8AdamW with the same hyper-parameters and
    param groups (extra group keys and maximize kept, foreach/fused/capturable dropped)"."""
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    model = copy.deepcopy(_BASE)
    groups = [
        {"params": [model.fc1.weight, model.fc2.weight], "lr": 3e-3, "name": "fp8"},
        {"params": [model.fc1.bias, model.fc2.bias, *model.head.parameters()], "weight_decay": 0.0, "name": "rest"},
    ]
    plain = torch.optim.AdamW(
        groups, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05, maximize=True, foreach=True
    )
    expected = [{k: v for k, v in g.items() if k != "params"} for g in plain.param_groups]
    model, optimizer = accelerator.prepare(model, plain)
    inner = optimizer.optimizer
    assert isinstance(inner, FP8AdamW) and len(inner.param_groups) == 2
    for group, want in zip(inner.param_groups, expected, strict=True):
        for key in ("lr", "betas", "eps", "weight_decay", "maximize", "name"):
            assert group[key] == want[key], key
    assert inner.param_groups[0]["maximize"] is True
    assert all(not group.get(k) for group in inner.param_groups for k in ("foreach", "fused", "capturable"))


def test_prepare_swaps_adam_without_weight_decay():
    """docs/accelerate.md (prepare(optimizer) row): "AdamW/Adam becomes FP8AdamW with the same hyper-parameters"
    (Adam without weight decay: no coupled L2 to refuse)."""
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    model = copy.deepcopy(_BASE)
    model, optimizer = accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=2e-3, betas=(0.7, 0.9)))
    group = optimizer.optimizer.param_groups[0]
    assert isinstance(optimizer.optimizer, FP8AdamW)
    assert (group["lr"], group["betas"], group["weight_decay"]) == (2e-3, (0.7, 0.9), 0.0)


@pytest.mark.parametrize("kwargs", [{"amsgrad": True}, {"differentiable": True}], ids=["amsgrad", "differentiable"])
def test_prepare_refuses_amsgrad_and_differentiable(kwargs):
    """docs/accelerate.md (prepare(optimizer) row): "AMSGrad, differentiable=True [...] are errors"."""
    accelerator = Accelerator(cpu=True, fp8_lm_recipe="fp8-lm")
    model = copy.deepcopy(_BASE)
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, **kwargs))
