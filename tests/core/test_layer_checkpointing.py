"""Activation checkpointing (torch.utils.checkpoint, use_reentrant=False: Lightning's and FSDP's) is transparent for
FP8 layers with delayed scaling: the recompute in the backward casts with the scales the forward used and records no
statistics, so gradients and scaling states are bit for bit those of the same model run without checkpointing (the
reference), while the input magnitudes move every delayed scale."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_fp8 import FP8MLP, FP8Linear, ScalingState
from tests.markers import XFAIL_TORCH_211_CPU_COMPILE

MAGNITUDES = (1.0, 1.0, 4.0, 0.25, 0.25, 8.0)  # the delayed scales move at most steps


def _model(kind: str, device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    if kind == "linear":
        model = nn.Sequential(FP8Linear(32, 64), nn.GELU(), FP8Linear(64, 32))
    else:
        model = nn.Sequential(FP8MLP(32, 64), nn.LayerNorm(32), FP8Linear(32, 32))
    return model.to(device)


def _ckpt(module, x):
    return checkpoint(module, x, use_reentrant=False)


def _same(model: nn.Module, ref: nn.Module, step: int) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), (step, name)
    assert any(isinstance(m, ScalingState) for m in model.modules())  # the buffers below include the scaling states'
    for name, buf in model.named_buffers():
        assert torch.equal(buf, ref.get_buffer(name)), (step, name)


def _train(model: nn.Module, ref: nn.Module, forward, steps=MAGNITUDES) -> None:
    device = next(model.parameters()).device
    for i, magnitude in enumerate(steps):
        x = torch.randn(24, 32, device=device) * magnitude
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        for m, xi, ckpt in ((model, xs[0], True), (ref, xs[1], False)):
            forward(m, xi, ckpt).square().mean().backward()
        assert torch.equal(xs[0].grad, xs[1].grad), i
        _same(model, ref, i)
        model.zero_grad()
        ref.zero_grad()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_checkpointed_model_equals_the_model_without_checkpointing(kind, device):
    model = _model(kind, device)
    ref = copy.deepcopy(model)
    _train(model, ref, lambda m, x, ckpt: _ckpt(m, x) if ckpt else m(x))
    casts = model[0].fc.fp8_scaling["input"].casts if kind == "mlp" else model[0].fp8_scaling["input"].casts
    assert int(casts) == len(MAGNITUDES)  # recorded once per step, not twice


def test_each_block_checkpointed_and_micro_batches_summed_into_one_backward():
    """Three micro-batches through blocks checkpointed one by one, one backward of their summed loss: the backward
    recomputes the last micro-batch's blocks first, each with its own forward's scales."""
    model = _model("linear")
    ref = copy.deepcopy(model)

    def forward(m, x, ckpt):
        outs = []
        for chunk in x.chunk(3):
            h = _ckpt(m[0], chunk) if ckpt else m[0](chunk)
            h = m[1](h)
            outs.append(_ckpt(m[2], h) if ckpt else m[2](h))
        return torch.cat(outs)

    _train(model, ref, forward)


def test_layer_shared_by_two_checkpointed_regions():
    """One layer applied twice (weight sharing, a looped block), each application its own checkpointed region."""
    torch.manual_seed(0)
    model = nn.Sequential(FP8Linear(32, 32))
    ref = copy.deepcopy(model)

    def forward(m, x, ckpt):
        layer = m[0]
        h = _ckpt(layer, x) if ckpt else layer(x)
        h = torch.tanh(h)
        return _ckpt(layer, h) if ckpt else layer(h)

    _train(model, ref, forward)


def test_layer_twice_inside_one_checkpointed_region_warns():
    """Inside one region the recompute cannot tell the calls of a layer apart: a warning says so."""
    layer = FP8Linear(32, 32)
    x = torch.randn(8, 32, requires_grad=True)
    with pytest.warns(UserWarning, match="more than once inside one activation-checkpointed region"):
        checkpoint(lambda v: layer(torch.tanh(layer(v))), x, use_reentrant=False).sum().backward()


@XFAIL_TORCH_211_CPU_COMPILE
def test_compiled_checkpointed_model_equals_the_model_without_checkpointing():
    """A checkpointed region under torch.compile (which runs it eagerly: it does not trace the region) trains as the
    eager model without checkpointing."""
    torch._dynamo.reset()
    model = _model("linear")
    ref = copy.deepcopy(model)
    compiled = torch.compile(lambda x: _ckpt(model, x), backend="aot_eager")
    _train(model, ref, lambda m, x, ckpt: compiled(x) if ckpt else m(x))
