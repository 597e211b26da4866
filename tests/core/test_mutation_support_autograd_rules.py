"""What a mutation audit of autograd_rules.py found unpinned: a double backward whose only path to the weight runs
through what the backward saved. With a loss linear in the layer's output the output gradient is a constant, yet dx
(= dy @ W) depends on the weight: nn.Linear, the reference, gives the penalty |dx|^2 a nonzero weight gradient, and the
FP8 layers must raise (their casts are not differentiable) rather than report the weight unused or drop the term."""

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8MLP, FP8Linear


def _first_weight(layer: nn.Module) -> torch.Tensor:
    return layer.weight if isinstance(layer, (nn.Linear, FP8Linear)) else layer.fc.weight


def _penalty_weight_grad(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(layer(x).sum(), x, create_graph=True)  # dy: ones, no graph of its own
    return torch.autograd.grad(g.pow(2).sum(), _first_weight(layer))[0]


def test_the_reference_has_the_second_order_term():
    torch.manual_seed(0)
    assert _penalty_weight_grad(nn.Linear(32, 16), torch.randn(4, 32)).abs().sum() > 0


@pytest.mark.parametrize("make", [lambda: FP8Linear(32, 16), lambda: FP8MLP(32, 64)], ids=["FP8Linear", "FP8MLP"])
def test_a_penalty_through_the_saved_weight_alone_raises(make):
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="differentiate twice an FP8 layer's backward"):
        _penalty_weight_grad(make(), torch.randn(4, 32))
