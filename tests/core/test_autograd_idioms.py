"""FP8 layers and FP8AdamW in the autograd idioms of a hand-written training loop, against torch.optim.AdamW and
nn.Linear."""

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from lightning_fp8 import FP8MLP, FP8AdamW, FP8Linear, convert_to_fp8


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 16))


@pytest.mark.parametrize("kernels", ["reference", "triton"])
@pytest.mark.parametrize(("opt_level", "emit"), [("O1", False), ("O2", False), ("O2", True)])
def test_backward_of_a_graph_built_before_the_step_raises_as_torch_does(kernels, opt_level, emit, monkeypatch):
    # The step writes the parameters in place; torch.optim.AdamW's writes bump their version counters, so a graph that
    # saved them and is backpropagated after the step raises (a GAN's discriminator stepped between the backwards of
    # its loss and the generator's). The Triton step bumped none: on a GPU that backward ran silently, its dgrad from
    # the stepped weights (and the LayerNorm's from its new weight).
    monkeypatch.setenv("LIGHTNING_FP8_KERNELS", kernels)
    ref, model = _model(), convert_to_fp8(_model())
    x = torch.randn(8, 32, requires_grad=True)
    for net, opt in (
        (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2)),
        (model, FP8AdamW(model.parameters(), lr=1e-2, opt_level=opt_level, emit_fp8_weights=emit)),
    ):
        net(x).square().sum().backward()
        y = net(x)  # saves the weights for its backward
        versions = [p._version for p in net.parameters()]
        opt.step()
        assert all(p._version > v for p, v in zip(net.parameters(), versions, strict=True))  # the biases too
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.square().sum().backward()


def _first_weight(layer: nn.Module) -> torch.Tensor:
    return layer.weight if isinstance(layer, FP8Linear) else layer.fc.weight


def _penalty_grad(layer: nn.Module, x: torch.Tensor, wrt: str) -> None:
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)
    penalty = g.pow(2).sum()
    if wrt == "backward_inputs":
        penalty.backward(inputs=[_first_weight(layer)])
    else:
        torch.autograd.grad(penalty, x if wrt == "x" else _first_weight(layer), allow_unused=True)


@pytest.mark.parametrize("make", [lambda: FP8Linear(32, 16), lambda: FP8MLP(32, 64)], ids=["FP8Linear", "FP8MLP"])
@pytest.mark.parametrize(
    "second_order",
    [
        lambda f, x: torch.autograd.functional.hessian(lambda t: f(t).pow(2).sum(), x),
        lambda f, x: torch.autograd.functional.hvp(lambda t: f(t).pow(2).sum(), x, torch.randn_like(x)),
        lambda f, x: torch.autograd.functional.jvp(f, x, torch.randn_like(x)),  # torch's: a double backward
        lambda f, x: _penalty_grad(f, x, "x"),
        lambda f, x: _penalty_grad(f, x, "weight"),
        lambda f, x: _penalty_grad(f, x, "backward_inputs"),
    ],
    ids=["hessian", "hvp", "jvp", "penalty_grad_x", "penalty_grad_weight", "penalty_backward_inputs"],
)
def test_second_order_terms_through_an_fp8_layer_raise_whichever_way_they_are_taken(make, second_order):
    # The backward's create_graph gradients led only to detached aliases of themselves: differentiating them with
    # respect to the input or the weight never reached the error, and hessian, hvp and jvp returned zeros (nn.Linear:
    # nonzero), autograd.grad a None, backward(inputs=[weight]) no gradient, all silently.
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="differentiate twice an FP8 layer's backward"):
        second_order(make(), torch.randn(4, 32))


@pytest.mark.parametrize("make", [lambda: FP8Linear(32, 16), lambda: FP8MLP(32, 64)], ids=["FP8Linear", "FP8MLP"])
def test_create_graph_backward_under_checkpointing_gives_the_plain_gradients(make):
    # The create_graph path reads the saved tensors once for the error node's links and hands them to the backward:
    # non-reentrant checkpointing refuses a second read ("Unpack is being triggered for a tensor that was already
    # unpacked once").
    torch.manual_seed(0)
    layer = make()
    x = torch.randn(4, 32, requires_grad=True)
    grads = []
    for create_graph in (False, True):
        y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        grads.append(torch.autograd.grad(y.pow(2).sum(), [x, *layer.parameters()], create_graph=create_graph))
    for plain, created in zip(*grads, strict=True):
        assert torch.equal(plain, created.detach())
