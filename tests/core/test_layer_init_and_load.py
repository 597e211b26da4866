"""Building an FP8 model the ways large models are built: converted on the meta device, then materialized
(``to_empty()`` + ``reset_parameters()``, as FSDP2's recipe, Lightning and FSDP1 do) or loaded with
``load_state_dict(assign=True)``. The reference: the same model converted on the CPU, with the same weights."""

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, ScalingState, convert_to_fp8, fp8_state_dict
from lightning_fp8.optim import master


def _plain() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


def _dirty_allocator() -> None:
    # Leave non-zero bytes in the allocator's free memory, for to_empty() to hand out.
    junk = torch.full((1 << 16,), 3.0e4)
    del junk


def _materialize(model: nn.Module, flow: str) -> None:
    if flow == "root_to_empty":  # FSDP2 / torchtitan: to_empty on the root, then every module's reset_parameters
        model.to_empty(device="cpu")
        for module in model.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
    else:  # Lightning's _materialize_meta_tensors, FSDP1: each module holding tensors, which must reset them
        for module in model.modules():
            if any(t.is_meta for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]):
                module.to_empty(device="cpu", recurse=False)
                module.reset_parameters()


def _assert_trains_like(model: nn.Module, ref: nn.Module, steps: int = 4) -> None:
    for i in range(steps):
        x = torch.randn(24, 32) * 10.0 ** (i % 3 - 1)  # the delayed scales move
        outs = [m(x) for m in (model, ref)]
        assert torch.equal(outs[0], outs[1]), i
        for out in outs:
            out.square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (i, name)
    got, want = fp8_state_dict(model), fp8_state_dict(ref)
    assert got.keys() == want.keys()
    for key, value in got.items():
        assert torch.equal(value, want[key]), key


@pytest.mark.parametrize("flow", ["root_to_empty", "per_module"])
def test_meta_conversion_then_materialization_equals_cpu_conversion(flow):
    with torch.device("meta"):
        model = convert_to_fp8(_plain())
    _dirty_allocator()
    _materialize(model, flow)
    for state in (m for m in model.modules() if isinstance(m, ScalingState)):
        assert float(state.scale) == 1.0 and int(state.casts) == 0 and not state.initialized
    ref = convert_to_fp8(_plain())
    ref.load_state_dict(model.state_dict())
    _assert_trains_like(model, ref)
    assert master.is_fp8_weight(model[0].weight)


def test_reset_parameters_resets_the_scaling_state():
    """New weights make the old statistics meaningless: FP8Linear.reset_parameters starts the scaling state over."""
    layer = convert_to_fp8(_plain())[0]
    layer(torch.randn(8, 32)).sum().backward()
    layer.reset_parameters()
    fresh = convert_to_fp8(nn.Sequential(nn.Linear(32, 64)))[0]
    for key, value in fp8_state_dict(layer).items():
        assert torch.equal(value, fp8_state_dict(fresh)[key]), key
    assert not any(s.initialized for s in layer.fp8_scaling.values())


@pytest.mark.parametrize("on_meta", [False, True])
def test_load_with_assign_keeps_the_fp8_weight_marker(on_meta):
    """assign=True replaces the weight Parameter: FP8AdamW (O2) must still see an FP8 weight (FP8 and fp16 states,
    the fp16 master in the storage) and step exactly as after a load with assign=False (the reference). Converted on
    the meta device, the scaling buffers follow the weights to the CPU."""
    torch.manual_seed(0)
    sd = _plain().state_dict()
    x = torch.randn(16, 32)
    results = []
    for assign in (True, False):
        if assign and on_meta:
            with torch.device("meta"):
                model = convert_to_fp8(_plain())
        else:
            model = convert_to_fp8(_plain())
        model.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=assign)  # assign shares the tensors
        assert master.is_fp8_weight(model[0].weight) and master.is_fp8_weight(model[2].weight)
        opt = FP8AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        state = opt.state[model[0].weight]
        results.append((model.state_dict(), state["exp_avg"].dtype, model[0].weight.dtype))
    (got, got_m, got_storage), (want, want_m, want_storage) = results
    assert (got_m, got_storage) == (want_m, want_storage) == (torch.float8_e4m3fn, torch.float16)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_load_with_assign_into_a_weight_fp8adamw_holds_is_refused():
    """At O2 the weight's storage is FP8AdamW's scaled master: a new Parameter would silently detach the optimizer.
    Refused with what to do; the layer keeps its Parameter, storage and master scale."""
    model = convert_to_fp8(_plain())
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 32)).sum().backward()
    opt.step()
    weight = model[0].weight
    before = (weight.detach().clone(), master.master_scale(weight).clone())
    with pytest.raises(RuntimeError, match=r"assign=True.*'0\.weight'.*Load with assign=False"):
        model.load_state_dict(_plain().state_dict(), assign=True)
    assert model[0].weight is weight
    assert torch.equal(weight.detach(), before[0]) and torch.equal(master.master_scale(weight), before[1])
    model.load_state_dict(_plain().state_dict())  # assign=False goes on working


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_weight_loaded_into_an_fp16_master_is_refused(bad):
    """Found by the twenty-third session's sweep: at O2 the loaded weight is stored as the scaled fp16 master, and inf
    came back from state_dict() as 65504 (NaN loaded silently too). Refused with what to do; the layer keeps its
    storage and master scale. At O1 the storage is the weight itself, which takes the values as torch does."""
    model = convert_to_fp8(_plain())
    FP8AdamW(model.parameters(), lr=1e-2)
    weight = model[0].weight
    before = (weight.detach().clone(), master.master_scale(weight).clone())
    state = _plain().state_dict()
    state["0.weight"][0, 0] = bad
    with pytest.raises(ValueError, match=r"'0\.weight'.*holds inf or NaN.*Load a checkpoint"):
        model.load_state_dict(state)
    assert torch.equal(weight.detach(), before[0]) and torch.equal(master.master_scale(weight), before[1])
    o1 = convert_to_fp8(_plain(), "fp8-lm-o1")
    FP8AdamW(o1.parameters(), lr=1e-2, opt_level="O1")
    o1.load_state_dict(state)
    torch.testing.assert_close(o1.state_dict()["0.weight"], state["0.weight"], rtol=0, atol=0, equal_nan=True)


def test_fp8_and_meta_weights_load_into_an_fp16_master_as_torch_loads_them_into_nn_linear():
    """Found by a sweep: at O2 an FP8 tensor in the state dict failed in the load hook with "isfinite not implemented
    for Float8_e4m3fn", and a meta tensor with "Tensor.item() cannot be called on meta tensors"; torch copies FP8
    values into an nn.Linear's weight, and refuses a meta tensor with its own error."""
    state = _plain().state_dict()
    state["0.weight"] = state["0.weight"].to(torch.float8_e4m3fn)
    reference = _plain()
    reference.load_state_dict(state)  # torch: the FP8 values, widened
    model = convert_to_fp8(_plain())
    FP8AdamW(model.parameters(), lr=1e-2)
    model.load_state_dict(state)
    assert model[0].weight.dtype == torch.float16  # still the scaled master
    torch.testing.assert_close(model.state_dict()["0.weight"], reference[0].weight.detach(), rtol=0, atol=0)

    before = model.state_dict()["0.weight"].clone()
    meta = dict(state, **{"0.weight": torch.empty(state["0.weight"].shape, device="meta")})
    with pytest.raises(RuntimeError, match="Cannot copy out of meta tensor"):  # torch's own error, as for nn.Linear
        reference.load_state_dict(meta)
    with pytest.raises(RuntimeError, match="Cannot copy out of meta tensor"):
        model.load_state_dict(meta)
    assert torch.equal(model.state_dict()["0.weight"], before)


@pytest.mark.parametrize("recipe", ["fp8-lm", "fp8-lm-o1"])
def test_the_models_own_parameters_load_as_a_no_op_and_another_models_as_their_true_weights(recipe):
    # Found by session 68's Accelerate built-ins sweep: model.load_state_dict(dict(model.named_parameters())), a no-op
    # in torch (and what torch.distributed.checkpoint's set_model_state_dict does for the keys a partial dict lacks, as
    # Accelerate's sharded load_checkpoint_in_model), took the scaled fp16 master of O2 as a true weight and scaled it
    # again: weights ~4e4 instead of ~0.1, the master scale 1. Another O2 model's parameters were taken so too.
    torch.manual_seed(0)
    model, other = convert_to_fp8(_plain(), recipe), convert_to_fp8(_plain(), recipe)
    opts = [FP8AdamW(m.parameters(), lr=1e-2, recipe=recipe) for m in (model, other)]
    for m, opt in zip((model, other), opts, strict=True):
        m(torch.randn(8, 32)).square().mean().backward()
        opt.step()
    x = torch.randn(8, 32)
    before, state, scale = model(x), model.state_dict(), master.master_scale(model[0].weight)
    scale = None if scale is None else scale.clone()
    for own in (dict(model.named_parameters()), {k: v.detach() for k, v in model.named_parameters()}):
        model.load_state_dict(own)
        assert torch.equal(model(x), before)
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        if scale is not None:
            assert torch.equal(master.master_scale(model[0].weight), scale)
    model.load_state_dict(dict(other.named_parameters()))  # another O2 model: its true weights
    for k, v in other.state_dict().items():
        if k.endswith("bias"):
            assert torch.equal(model.state_dict()[k], v)
        else:  # stored again as a scaled fp16 master: within fp16 rounding
            torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-3, atol=0)
