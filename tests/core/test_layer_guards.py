"""Calls the FP8 layers cannot serve, refused before a cast records anything: forward-mode AD tangents, and scaling
states left on another device than the weight (parameters replaced on a module built on meta)."""

import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

from lightning_fp8 import FP8MLP, FP8Linear, convert_to_fp8, fp8_stats
from lightning_fp8.scaling import ScalingState


def _buffers(module):
    return {n: b.clone() for n, b in module.named_buffers()}


def _same(before, module):
    after = dict(module.named_buffers())
    return before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


def _dual_call(module, x, tangent_of):
    # One forward with a tangent on the input ("x") or on a parameter (by name, through functional_call).
    with fwAD.dual_level():
        if tangent_of == "x":
            return module(fwAD.make_dual(x, torch.ones_like(x)))
        params = dict(module.named_parameters())
        params[tangent_of] = fwAD.make_dual(params[tangent_of].detach(), torch.ones_like(params[tangent_of]))
        return torch.func.functional_call(module, params, (x,))


@pytest.mark.parametrize(
    "make, tangent_of",
    [(lambda: FP8Linear(16, 16), "x"), (lambda: FP8Linear(16, 16), "weight"), (lambda: FP8Linear(16, 16), "bias"),
     (lambda: FP8MLP(16, 32), "x"), (lambda: FP8MLP(16, 32), "proj.weight"), (lambda: FP8MLP(16, 32), "fc.bias")],
    ids=["linear-x", "linear-weight", "linear-bias", "mlp-x", "mlp-proj.weight", "mlp-fc.bias"],
)  # fmt: skip
def test_forward_mode_ad_is_refused_before_any_cast(make, tangent_of):
    """Forward-mode AD ran the input cast, recorded its amax into the delayed-scaling history (a 1e5 input: the next
    15 casts used its scale, output errors 24-33% instead of 5%) and only then failed in PyTorch's generic "implement
    the jvp" error. Now a RuntimeError that names the layer comes first and the scaling state is untouched: the next
    ordinary forwards give what a fresh layer's give."""
    torch.manual_seed(0)
    module = make()
    fresh = copy.deepcopy(module)
    before = _buffers(module)
    name = type(module).__name__
    with pytest.raises(RuntimeError, match=rf"{name} does not support forward-mode AD.*module_filter_fn"):
        _dual_call(module, torch.randn(4, 16) * 1e5, tangent_of)
    assert _same(before, module)
    for _ in range(3):
        x = torch.randn(4, 16)
        with torch.no_grad():
            assert torch.equal(module(x), fresh(x))
    # A dual level open around tangent-free inputs is no forward AD of the layer: it runs.
    x = torch.randn(4, 16)
    with fwAD.dual_level(), torch.no_grad():
        assert torch.equal(module(x), fresh(x))


def _materialized_by_assignment():
    # Built on meta, then given real parameters by assignment: the scaling states (buffers) stay on meta.
    with torch.device("meta"):
        layer = FP8Linear(16, 16)
    layer.weight = nn.Parameter(torch.randn(16, 16))
    layer.bias = nn.Parameter(torch.zeros(16))
    return layer


def test_scaling_state_on_another_device_than_the_weight_is_refused():
    """PyTorch's device-mismatch error came from inside the cast; the message says which state and what to do."""
    layer = _materialized_by_assignment()
    with pytest.raises(ValueError, match=r"FP8 scaling state on meta.*to_empty"):
        layer(torch.randn(2, 16))
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert layer(torch.randn(2, 16)).shape == (2, 16)


def test_quantize_of_a_tensor_on_another_device_changes_nothing():
    """ScalingState.quantize of x on another device than the state added to its cast count before failing."""
    state = ScalingState(torch.float8_e4m3fn, history_len=4, margin=0, algo="max", delayed=True)
    state.quantize(torch.full((4, 4), 2.0))
    before = _buffers(state)
    with pytest.raises(ValueError, match=r"x is on meta but the scaling state on cpu"):
        state.quantize(torch.empty(4, 4, device="meta"))
    assert _same(before, state)


def test_fp8_stats_of_an_unmaterialized_model_says_so():
    with torch.device("meta"):
        model = convert_to_fp8(nn.Sequential(nn.Linear(16, 16)))
    with pytest.raises(ValueError, match=r"layer '0' \(input\) is on the meta device.*to_empty"):
        fp8_stats(model)


def test_a_dual_level_without_tangents_compiles_no_new_graph():
    """The forward-mode AD check reads torch.autograd.forward_ad's level only eagerly: traced, it read it first and
    dynamo guarded on it, so a call inside an open dual level (no tangents) compiled the layer once more."""
    compiled_graphs = []

    def backend(gm, example_inputs):
        compiled_graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    layer = FP8Linear(16, 16)
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    x = torch.randn(4, 16)
    with torch.no_grad():
        compiled(x)
        compiled(x)  # the second compile: the first cast is made with current scaling (the state's initialized flag)
        count = len(compiled_graphs)
        with fwAD.dual_level():
            compiled(x)
        compiled(x)
    assert len(compiled_graphs) == count
