"""Defects noticed earlier and left alone, each fixed with the test that shows it: configuration values out of their
meaningful range, optimizers that stayed alive through their gradient hooks, an optimizer built before the model was
converted, a weight tied after conversion."""

import gc
import math
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8Linear, FP8Recipe, HealthConfig, convert_to_fp8

# --- HealthConfig ranges ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        # A relative improvement of a positive loss is at most 1: 2.0 was taken, and every window was a plateau.
        ("plateau_min_improvement", 2.0, r"in \[0, 1\)"),
        ("plateau_min_improvement", 1.0, r"in \[0, 1\)"),
        ("plateau_min_improvement", -0.1, r"in \[0, 1\)"),
        ("plateau_grad_norm_drop", 1.5, r"in \[0, 1\]"),
        # A spike is above the mean already: a ratio below 1 tested nothing.
        ("spike_ratio", 0.5, ">= 1"),
        ("spike_zscore", math.nan, ">= 0"),
        ("spike_zscore", True, ">= 0"),
        ("window", True, "an int >= 2"),
        ("warmup_steps", 2.0, "an int >= 0"),
    ],
)
def test_health_config_refuses_values_out_of_range(name, value, allowed):
    with pytest.raises(ValueError, match=rf"HealthConfig\({name}={value!r}\) must be .*{allowed}"):
        HealthConfig(**{name: value})


def test_health_config_takes_the_edges_of_each_range():
    config = HealthConfig(
        window=np.int64(2), warmup_steps=0, spike_zscore=0, spike_ratio=1, spike_patience=1, plateau_window=2,
        plateau_min_improvement=0.0, plateau_grad_norm_drop=np.float32(1.0),
    )  # fmt: skip
    assert (config.spike_ratio, config.plateau_grad_norm_drop) == (1.0, 1.0)
    assert isinstance(config.window, int) and isinstance(config.spike_zscore, float)


# --- Gradient hooks of optimizers built over the same weights -------------------------------------------------------


def _fp8_model(opt_level: str = "O2", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 16)), FP8Recipe(opt_level=opt_level))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        opt.zero_grad()
        (model(torch.randn(8, 32)) ** 2).mean().backward()
        opt.step()


def _grad_hooks(p: torch.Tensor) -> int:
    return len(p._post_accumulate_grad_hooks or {})


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("keep", [False, True], ids=["dropped", "kept"])
def test_a_new_optimizer_removes_the_gradient_hooks_of_the_old_one(opt_level, keep):
    # A hyper-parameter search: one optimizer per trial over one model. Each left its hook on every FP8 weight (a no-op
    # called at every backward): 20 trials, 20 hooks per weight.
    model = _fp8_model(opt_level)
    kept, first = [], None
    for trial in range(20):
        opt = FP8AdamW(model.parameters(), lr=1e-3 * (trial + 1), recipe=FP8Recipe(opt_level=opt_level))
        first = first or weakref.ref(opt)
        _train(model, opt)
        if keep:
            kept.append(opt)
    assert [_grad_hooks(layer.weight) for layer in model] == [1, 1]
    if not keep:  # the hooks held the optimizer weakly: nothing kept it alive
        gc.collect()
        assert first() is None
    # The newest optimizer still takes the gradients in FP8, and steps them.
    before = model[0].weight.detach().float().clone()
    _train(model, opt)
    assert model[0].weight.grad is None and not torch.equal(model[0].weight.detach().float(), before)


def test_an_optimizer_without_fp8_grads_removes_the_old_hook_too():
    model = _fp8_model()
    old = FP8AdamW(model.parameters())
    new = FP8AdamW(model.parameters(), fp8_grads=False)  # takes the gradients back into param.grad
    assert _grad_hooks(model[0].weight) == 0 and not old.holds_fp8_grads
    (model(torch.randn(8, 32)) ** 2).mean().backward()
    assert model[0].weight.grad is not None
    new.step()


# --- An optimizer built before the conversion ------------------------------------------------------------------------


def _plain_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 16))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
def test_a_step_refuses_weights_converted_after_the_optimizer_was_built(opt_level, stepped):
    # It took them for plain parameters: fp32 states (16 bytes per parameter at O2, not 6) and high-precision
    # gradients, without a word.
    recipe = FP8Recipe(opt_level=opt_level)
    model = _plain_model()
    opt = FP8AdamW(model.parameters(), recipe=recipe)
    if stepped:
        _train(model, opt)
    convert_to_fp8(model, recipe)
    before = [p.detach().float().clone() for p in model.parameters()]
    opt.zero_grad()
    (model(torch.randn(8, 32)) ** 2).mean().backward()
    refusal = r"parameter 0 of parameter group 0 \(shape \(48, 32\)\) became an FP8 layer's weight .*Convert the model "
    with pytest.raises(RuntimeError, match=refusal + "first, then build the optimizer.*Nothing was stepped"):
        opt.step()
    assert all(torch.equal(p.detach().float(), b) for p, b in zip(model.parameters(), before, strict=True))
    # Built after the conversion, as the docs say: the weights are FP8 weights to it.
    opt = FP8AdamW(model.parameters(), recipe=recipe)
    _train(model, opt, steps=2)
    assert (model[0].weight.dtype == torch.float16) == (opt_level == "O2")


def test_a_layer_made_with_from_linear_after_the_optimizer_is_refused_too():
    # FP8Linear.from_linear, the conversion's building block, takes the layer's parameter objects as they are: an
    # optimizer built before over them would step them as plain parameters (fp32 states), as after convert_to_fp8.
    model = _plain_model()
    opt = FP8AdamW(model.parameters())
    model[1] = FP8Linear.from_linear(model[1], "fp8-lm")
    opt.zero_grad()
    (model(torch.randn(8, 32)) ** 2).mean().backward()
    with pytest.raises(RuntimeError, match=r"parameter 2 of parameter group 0 \(shape \(16, 48\)\) became an FP8"):
        opt.step()


def test_a_conversion_elsewhere_or_of_layers_left_out_does_not_stop_an_optimizer():
    # The check runs after any conversion, but only weights this optimizer took in as plain ones that became FP8
    # weights refuse: a layer the filter left out, another model, an optimizer keeping fp32 states without fp8_grads.
    model = _plain_model()
    fp32 = FP8AdamW(model.parameters(), recipe=FP8Recipe(opt_level="O1"), fp8_grads=False)
    convert_to_fp8(model, "fp8-lm-o1")  # at O1 without fp8_grads an FP8 weight gets what a plain one gets
    _train(model, fp32, steps=2)
    model = _plain_model()
    opt = FP8AdamW(model.parameters())
    convert_to_fp8(model, module_filter_fn=lambda module, fqn: False)
    convert_to_fp8(_plain_model(seed=1))
    _train(model, opt, steps=2)
