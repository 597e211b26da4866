"""``load_fp8_state_dict(strict=False)`` with an ``initialized`` flag of 1 but not the history and scale it refers to:
refused for a delayed state (its next cast would use a history it was not given, docs/guides/checkpoints.md), taken
for a current-scaled one (a weight's, or every role with ``scaling="current"``), whose casts compute every scale from
their tensor whatever the flag: the layer then computes what a fresh layer with the same weights computes.
"""

import pytest
import torch

from lightning_fp8 import FP8Linear, FP8Recipe, fp8_state_dict, load_fp8_state_dict


def _step(layer, x):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    out.square().sum().backward()
    return out.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_a_flag_without_its_history(scaling):
    recipe = FP8Recipe(scaling=scaling)
    layer, fresh = FP8Linear(16, 16, recipe=recipe), FP8Linear(16, 16, recipe=recipe)
    fresh.load_state_dict(layer.state_dict())
    delayed_roles = [n for n, s in layer.fp8_scaling.named_children() if s.delayed]
    assert delayed_roles == (["input", "grad_output"] if scaling == "delayed" else [])
    for role in ("input", "weight", "grad_output"):
        flag = {f"fp8_scaling.{role}.initialized": torch.tensor(1)}
        if role in delayed_roles:
            with pytest.raises(ValueError, match="without its 'amax_history' and 'scale'"):
                load_fp8_state_dict(layer, flag, strict=False)
        else:
            load_fp8_state_dict(layer, flag, strict=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randn(8, 16, generator=gen) * 100
        for got, want in zip(_step(layer, x), _step(fresh, x), strict=True):
            assert torch.equal(got, want)
    got, want = fp8_state_dict(layer), fp8_state_dict(fresh)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
