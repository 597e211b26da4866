"""Input that must not silently go wrong: dtype changes of a converted model, rejected optimizer groups, corrupt
checkpoints of the scaling states, the optimizer and the gradient scaler (each refused before anything is loaded)."""

import copy
import io

import pytest
import torch
from torch import nn

import lightning_fp8 as lf
from lightning_fp8 import FP8AdamW, FP8GradScaler, FP8Linear, convert_to_fp8, fp8_state_dict, load_fp8_state_dict
from tests.numerics import sqnr


def _model(seed=0):
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 32)))


@pytest.mark.parametrize("convert", ["half", "bfloat16", "to_float16"])
def test_dtype_conversion_keeps_the_scaling_states_fp32(convert):
    """model.half() (or .to(fp16), .bfloat16()) after conversion: the scales and amaxes stay fp32 (a gradient scale of
    2**20 is inf in fp16, which made every gradient 0), and the layer's gradients track an fp32 nn.Linear's."""
    ref = nn.Linear(64, 32)
    layer = convert_to_fp8(nn.Sequential(copy.deepcopy(ref)))
    layer = layer.to(torch.float16) if convert == "to_float16" else getattr(layer, convert)()
    dtype = layer[0].weight.dtype
    for state in layer[0].fp8_scaling.values():
        assert all(b.dtype in (torch.float32, torch.int64) for b in state.buffers())
    x = torch.randn(32, 64)
    dy = torch.randn(32, 32) * 1e-2
    x_lp = x.to(dtype).requires_grad_()
    layer(x_lp).backward(dy.to(dtype))
    x_ref = x.clone().requires_grad_()
    ref(x_ref).backward(dy)
    assert sqnr(x_lp.grad.float(), x_ref.grad) > 18
    assert sqnr(layer[0].weight.grad.float(), ref.weight.grad) > 18


def test_dtype_change_after_the_optimizer_took_the_weights_is_refused():
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=1e-2)  # O2: the weights' storage is the optimizer's fp16 master
    model.float()
    (model(torch.randn(8, 64)) ** 2).mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="was cast to torch.float32"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_vector_to_parameters_after_the_optimizer_took_the_weights_names_itself():
    """vector_to_parameters replaces each weight's .data by a slice of the (fp32) vector: the refusal named only
    casts of the model, which the user never made."""
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    params = list(model.parameters())
    torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(params).float(), params)
    (model(torch.randn(8, 64)) ** 2).mean().backward()
    with pytest.raises(RuntimeError, match=r"\.data replaced by a torch.float32 tensor \(torch.nn.utils.vector_to"):
        opt.step()


def test_fx_symbolic_trace_says_how_to_trace_fp8_layers():
    """torch.fx traces into modules outside torch.nn, and the layer refused the Proxy as "expects a tensor input":
    the error says to keep FP8 layers as leaves, which traces to the same outputs."""
    model = _model()
    with pytest.raises(TypeError, match="symbolic_trace.*is_leaf_module"):
        torch.fx.symbolic_trace(model)

    class LeafTracer(torch.fx.Tracer):
        def is_leaf_module(self, m, name):
            return isinstance(m, FP8Linear) or super().is_leaf_module(m, name)

    traced = torch.fx.GraphModule(model, LeafTracer().trace(model))
    x = torch.randn(8, 64)
    reference = copy.deepcopy(model)
    torch.testing.assert_close(traced(x), reference(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("group", "error"),
    [({"lr": -1.0}, ValueError), ({"lr": "0.1"}, TypeError), ({"eps": None}, TypeError),
     ({"betas": ("0.9", 0.99)}, TypeError), ({"weight_decay": None}, TypeError)],
)  # fmt: skip
def test_a_rejected_param_group_is_not_kept(group, error):
    m = nn.Linear(16, 16)
    opt = FP8AdamW([m.weight], lr=1e-2)
    with pytest.raises(error):
        opt.add_param_group({"params": [m.bias], **group})
    assert len(opt.param_groups) == 1
    with pytest.raises(error):
        FP8AdamW(m.parameters(), **group)


def _scaling_checkpoint():
    model = _model()
    model(torch.randn(8, 64)).sum().backward()
    return model, fp8_state_dict(model)


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [("0.fp8_scaling.weight.scale", torch.tensor(float("nan")), ValueError),
     ("0.fp8_scaling.input.scale", torch.tensor(-2.0), ValueError),
     ("0.fp8_scaling.input.scale", torch.tensor(3.0), ValueError),
     ("2.fp8_scaling.grad_output.amax_history", torch.full((16,), float("nan")), ValueError),
     # a cast records a non-finite amax as 0: an inf in the history would keep the delayed scale for 16 casts
     ("0.fp8_scaling.input.amax_history", torch.tensor([float("inf")] + [1.0] * 15), ValueError),
     ("2.fp8_scaling.input.saturation", torch.tensor(1.5), ValueError),
     ("2.fp8_scaling.input.casts", torch.tensor(-1), ValueError),
     ("2.fp8_scaling.input.casts", torch.tensor(1.0), TypeError),
     ("0.fp8_scaling.input.scale", "1.0", TypeError)],
)  # fmt: skip
def test_corrupt_scaling_state_is_refused_and_nothing_loads(key, value, error):
    model, saved = _scaling_checkpoint()
    other = _model(seed=1)
    before = fp8_state_dict(other)
    history = saved[key].shape if key.endswith("amax_history") else None
    bad = {**saved, key: value if history is None else value[: history[0]]}
    with pytest.raises(error, match="scaling state"):
        load_fp8_state_dict(other, bad)
    after = fp8_state_dict(other)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the good entries before the bad one: not loaded
    load_fp8_state_dict(other, saved)  # the intact checkpoint loads
    assert all(torch.equal(saved[k], v) for k, v in fp8_state_dict(other).items())


def test_scaler_refuses_a_scale_that_is_not_a_power_of_two():
    scaler = FP8GradScaler()
    saved = scaler.state_dict()
    for bad in (3.0, -1.0, float("inf"), 0.0):
        with pytest.raises(ValueError, match="power of two"):
            scaler.load_state_dict({**saved, "scale": bad})
    assert float(scaler.scale) == float(saved["scale"])


def _optimizer_checkpoint():
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    (model(torch.randn(8, 64)) ** 2).mean().backward()
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _corrupt(saved, change):
    bad = copy.deepcopy(saved)
    change(bad["state"][0])  # the first Linear's weight: FP8 and fp16 moments with scales
    return bad


@pytest.mark.parametrize(
    ("change", "match"),
    [(lambda s: s.pop("exp_avg_scale"), "without its 'exp_avg_scale'"),
     (lambda s: s.__setitem__("exp_avg_sq_scale", torch.tensor(float("nan"))), "not finite and positive"),
     (lambda s: s.__setitem__("exp_avg", s["exp_avg"][:3]), "its parameter"),
     (lambda s: s.__setitem__("step", torch.tensor(float("nan"))), "step")],
    ids=["scale_missing", "scale_nan", "truncated", "step_nan"],
)  # fmt: skip
def test_corrupt_optimizer_state_is_refused_and_nothing_loads(change, match):
    saved = _optimizer_checkpoint()
    model = _model(seed=1)
    opt = FP8AdamW(model.parameters(), lr=3e-3)
    (model(torch.randn(8, 64)) ** 2).mean().backward()
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(_corrupt(saved, change))
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for index, state in before["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(after["state"][index][key]), torch.as_tensor(value)), (index, key)
    opt.load_state_dict(saved)  # the intact checkpoint loads
    loaded = opt.state_dict()["state"][0]
    assert all(torch.equal(loaded[k], v) for k, v in saved["state"][0].items() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("opt_level", ["O2", "O1"])
def test_zero_grad_without_none_steps_every_parameter_as_torch_adamw(opt_level):
    """zero_grad(set_to_none=False) leaves every parameter that had a gradient with a zero one, so the next step still
    applies momentum and weight decay to it, as torch.optim.AdamW does (the FP8 weights' gradients, held by the
    optimizer in FP8, included)."""
    model = _model()
    ref = copy.deepcopy(model)
    opt = FP8AdamW(model.parameters(), lr=1e-2, opt_level=opt_level)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(8, 64)
    for m, o in ((model, opt), (ref, ref_opt)):
        (m(x) ** 2).mean().backward()
        o.step()
        before = [p.detach().clone() for p in m.state_dict().values()]
        o.zero_grad(set_to_none=False)
        o.step()
        moved = [(b - a).abs().max().item() for b, a in zip(before, m.state_dict().values(), strict=True)]
        assert all(v > 0 for v in moved), moved


def test_deepcopy_keeps_what_fp8_training_set_on_the_weights():
    """copy.deepcopy of a converted model (an EMA or best-model copy): at O2 the copy's forward and state_dict() are
    the original's (its weights' storage holds the fp16 master times its scale, which the copy keeps); before any
    optimizer, an FP8AdamW given the copy still finds its FP8 weights (and gives them O2 states)."""
    model = _model()
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 64)
    (model(x) ** 2).mean().backward()
    opt.step()
    twin = copy.deepcopy(model)
    for (key, value), twin_value in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(value, twin_value), key
    assert torch.equal(model(x), twin(x))
    fresh = copy.deepcopy(_model())
    FP8AdamW(fresh.parameters(), lr=1e-2)
    assert [p.dtype for p in fresh.parameters()] == [torch.float16, torch.float32, torch.float16, torch.float32]


def test_a_layer_registered_twice_becomes_one_fp8_layer():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(32, 32)
            self.seq = nn.Sequential(self.layer, nn.ReLU())

    model = convert_to_fp8(Twice())
    assert isinstance(model.layer, FP8Linear) and model.layer is model.seq[0]


def test_wrong_argument_types_say_what_is_expected():
    with pytest.raises(TypeError, match="recipe name"):
        lf.FP8Recipe.from_name(["fp8-lm"])
    with pytest.raises(TypeError, match="must be a number"):
        FP8GradScaler(init_scale="1.0")


def test_scaler_get_scale_is_mu():
    scaler = FP8GradScaler(init_scale=2.0**12)
    assert scaler.get_scale() == 4096.0 == float(scaler.scale)
    assert float(scaler.scale_loss(torch.tensor(0.5))) == 2048.0


def test_recipe_margin_is_bounded():
    assert lf.FP8Recipe(margin=16).margin == 16
    with pytest.raises(ValueError, match="margin=17"):
        lf.FP8Recipe(margin=17)


def test_a_model_cast_to_float64_names_the_weight_not_the_input():
    """After model.double() the first error told the user to cast the input (x.float()), which then failed in the
    next LayerNorm or again on the weight: the float64 weight is the cause and the error says so."""
    model = _model().double()
    for x in (torch.randn(4, 64, dtype=torch.float64), torch.randn(4, 64)):
        with pytest.raises(TypeError, match=r"weight has dtype torch.float64.*model.float\(\)"):
            model(x)
    assert model.float()(torch.randn(4, 64)).dtype == torch.float32  # and cast back, it runs


def test_from_linear_of_a_subclass_with_its_own_init_is_refused():
    class Masked(FP8Linear):
        def __init__(self, in_features, out_features):
            super().__init__(in_features, out_features)
            self.register_buffer("mask", torch.ones(out_features))

        def forward(self, x):
            return super().forward(x) * self.mask

    with pytest.raises(TypeError, match="without calling Masked.__init__"):
        Masked.from_linear(nn.Linear(32, 32))

    class MaskedFromLinear(Masked):  # its own from_linear sets up what its __init__ adds
        @classmethod
        def from_linear(cls, linear, recipe=None):
            new = super().from_linear(linear, recipe)
            new.register_buffer("mask", torch.ones(linear.out_features))
            return new

    layer = MaskedFromLinear.from_linear(nn.Linear(32, 32))
    assert type(layer) is MaskedFromLinear and layer(torch.randn(2, 32)).shape == (2, 32)

    class Tagged(FP8Linear):  # no __init__ of its own: nothing to skip
        pass

    layer = Tagged.from_linear(nn.Linear(32, 32))
    assert type(layer) is Tagged and layer(torch.randn(2, 32)).shape == (2, 32)
