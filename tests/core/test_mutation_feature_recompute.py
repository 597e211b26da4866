"""Activation checkpointing of FP8 layers (lightning_fp8/recompute.py) where a mutation audit found its rules unpinned,
against torch.utils.checkpoint's unchecked run of the same layer (bit for bit) and the float64 weight gradient
``dy^T x``:

- a recompute that cannot be matched to its forward (always so for use_reentrant=True) casts with the recomputed
  input's own amax, "whatever the delayed scale did meanwhile" (the module docstring): a recompute that took the
  delayed scale instead passed the suite, whose magnitudes never left that scale's range (here the delayed scale is
  set by inputs 2**14 times larger, and the recomputed input underflows with it);
- a forward whose backward freed its graph waits for no backward, even while an output still holds that graph: a
  recompute that counted it as waiting passed the suite, where torch.utils.checkpoint's frames tell the forwards apart
  anyway (here they cannot, as where torch's internals moved: several forwards waiting would make it warn and cast
  with its own amax, other bytes than the unchecked run's); nor does, in a backward, a forward whose graph that
  backward ran through and retained (retain_graph=True): a backward that noted no such run passed the suite."""

import copy
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lightning_fp8 import FP8Linear
from lightning_fp8 import warnings as lf_warnings


def test_reentrant_recompute_casts_with_its_own_amax_outside_the_delayed_scales_range(monkeypatch):
    monkeypatch.setattr(lf_warnings, "_seen", set())  # warn_once: this case warns
    torch.manual_seed(0)
    layer = FP8Linear(32, 32)
    for _ in range(2):  # delayed scales for inputs near 2**12 from now on (E4M3: a scale of 2**-4 or so)
        layer(torch.randn(8, 32) * 2.0**12).sum().backward()
    layer.zero_grad()
    x = (torch.randn(8, 32) * 2.0**-2).requires_grad_()  # with that scale: under E4M3's smallest subnormal, 0 in FP8
    w = torch.linspace(-1, 1, 32)  # the loss sum(y * w): dy = w for every token, whatever y is
    with pytest.warns(UserWarning, match="use_reentrant=True"):
        (checkpoint(layer, x, use_reentrant=True) * w).sum().backward()
    exact = (w.double().expand(8, 32).t() @ x.detach().double()).float()  # dW = dy^T x
    assert float(exact.abs().max()) > 0.1
    torch.testing.assert_close(layer.weight.grad, exact, rtol=0.1, atol=0.1 * float(exact.abs().max()))


def test_a_freed_graph_held_by_its_output_is_not_waiting_without_the_regions_order(monkeypatch):
    from lightning_fp8 import recompute

    monkeypatch.setattr(lf_warnings, "_seen", set())
    monkeypatch.setattr(recompute, "_closure_value", lambda fn, name: None)  # no region order: the pending forwards
    torch.manual_seed(0)
    layer = FP8Linear(32, 32)
    plain = copy.deepcopy(layer)
    kept = []
    for step, magnitude in enumerate((1.0, 8.0, 0.125)):  # the delayed scale moves every step
        x = torch.randn(16, 32) * magnitude
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "forwards of an FP8 layer wait" warning
            out = checkpoint(layer, x, use_reentrant=False)
            out.square().mean().backward()
        kept.append(out)  # held after its backward (a loss kept for logging): its freed graph and forward with it
        plain(x).square().mean().backward()
        assert torch.equal(layer.weight.grad, plain.weight.grad), step
        for name, buf in layer.named_buffers():
            assert torch.equal(buf, plain.get_buffer(name)), (step, name)
        layer.zero_grad()
        plain.zero_grad()


def test_a_retained_graph_the_backward_ran_through_is_not_waiting_without_the_regions_order(monkeypatch):
    # A checkpointed forward and a plain one of the layer, their losses summed, one backward with retain_graph=True: the
    # plain forward's node runs first (created last), its graph stays (retained), but this backward has run through
    # it, so the recompute that follows has one forward waiting, its own, and repeats it exactly.
    from lightning_fp8 import recompute

    monkeypatch.setattr(lf_warnings, "_seen", set())
    monkeypatch.setattr(recompute, "_closure_value", lambda fn, name: None)  # no region order: the pending forwards
    torch.manual_seed(0)
    layer = FP8Linear(32, 32)
    layer(torch.randn(8, 32) * 64).sum().backward()  # delayed scales from now on
    layer.zero_grad()
    plain = copy.deepcopy(layer)
    xs = [torch.randn(16, 32) * 4, torch.randn(16, 32) * 0.25]  # other amaxes than the delayed scale's
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "forwards of an FP8 layer wait" warning
        loss = checkpoint(layer, xs[0], use_reentrant=False).square().mean() + layer(xs[1]).square().mean()
        loss.backward(retain_graph=True)
    (plain(xs[0]).square().mean() + plain(xs[1]).square().mean()).backward(retain_graph=True)
    assert torch.equal(layer.weight.grad, plain.weight.grad)
    for name, buf in layer.named_buffers():
        assert torch.equal(buf, plain.get_buffer(name)), name
