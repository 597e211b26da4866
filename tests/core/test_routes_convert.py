"""Building a model and converting it, from a route sweep: the ways a user constructs a model and calls
``convert_to_fp8`` on it, each checked against an independent reference (the unconverted model with the same weights,
the same weights converted after a plain construction, ``torch.optim.AdamW`` on the unconverted copy) or against what
``convert_to_fp8``'s docstring promises:

- construction: plainly; on the meta device (``torch.device("meta")``, accelerate's ``init_empty_weights()``),
  materialized with ``to_empty()`` then ``load_state_dict`` or ``reset_parameters()``, converted before or after it
  leaves the meta device; in bfloat16 or float16 (``torch.set_default_dtype``, ``.half()``, ``.to(torch.bfloat16)``);
  in Lightning's ``configure_model`` hook (``precision="32-true"`` with an FP8AdamW of the module's, and
  ``precision="fp8-lm"``);
- containers: ``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``, nested modules, a layer under several names, a
  bare ``nn.Linear``, empty models and models with nothing to convert;
- eligibility: every reason the docstring gives for leaving a layer as ``nn.Linear``, all in one model, each named in
  its warning while the rest converts; code around a layer that reads its weight in other spellings; a layer
  wrapped by ``torch.compile``; sizes of exactly 16, no bias, large non-square shapes; filters of every kind of
  callable, and filters that raise (nothing changes);
- repeated and partial conversion, recipes that differ, an optimizer built before the conversion;
- what the conversion keeps: parameter objects, requires_grad, modes, dtypes, hooks, state_dict keys (through
  ``torch.load(weights_only=True)`` both ways), deep copies and pickles, parameter order, repr;
- numerics: outputs and gradients against the unconverted model (SQNR), FP8AdamW training against
  ``torch.optim.AdamW``.

Routes pinned elsewhere are not repeated here: each reason for leaving a layer on its own and the filter's refusals
(test_convert.py), the meta-device flows with garbage memory and ``assign=True`` (test_linear_meta_load.py,
test_layer_init_and_load.py), ``from_linear`` (test_linear_wrapping.py), module protocol routes on converted models
(test_routes_module_protocol.py), an FP8AdamW built before the conversion (test_leftovers.py), Hugging Face models
(tests/integrations/test_routes_hugging_face.py).
"""

import copy
import functools
import io
import pickle
import re
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from lightning_fp8 import FP8AdamW, FP8Linear, ScalingState, convert_to_fp8, fp8_modules
from tests.numerics import BACKWARD_SQNR_DB, FORWARD_SQNR_DB, assert_same, sqnr

IN, HIDDEN, OUT, TOKENS = 48, 64, 32, 24  # multiples of 16, not all powers of two
# Two FP8 GEMMs in series (with a GELU between), each ~27 dB against fp32: 25-26 dB together (as test_convert.py).
TWO_GEMMS_SQNR_DB = 20.0
# The losses of a few FP8AdamW steps against torch.optim.AdamW on the unconverted model, same batches (as
# test_routes_hugging_face.py): FP8 rounding of the GEMMs and gradients moves each step a little; measured below 0.4%
# here, bf16 and fp16 models included.
LOSS_RTOL = 0.02


def _mlp(seed: int = 0, **factory) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN, **factory), nn.GELU(), nn.Linear(HIDDEN, OUT, **factory))


def _batches(steps: int, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fresh seeded inputs and the targets of a fixed teacher (a loss that training lowers)."""
    gen = torch.Generator().manual_seed(11)
    teacher = torch.randn(OUT, IN, generator=gen) / IN**0.5
    batches = []
    for _ in range(steps):
        x = torch.randn(TOKENS, IN, generator=gen)
        batches.append((x.to(dtype), torch.tanh(x @ teacher.t()) * 2))
    return batches


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 4, dtype=torch.float32) -> list[float]:
    losses = []
    for x, y in _batches(steps, dtype):
        loss = (model(x).float() - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _quiet_convert(model: nn.Module, *args, **kwargs) -> nn.Module:
    """convert_to_fp8 without its warnings (asserted where they matter)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert_to_fp8(model, *args, **kwargs)


def _messages(model: nn.Module, *args, **kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        convert_to_fp8(model, *args, **kwargs)
    return [str(w.message) for w in record]


def _types(model: nn.Module) -> dict[str, type]:
    return {name: type(m) for name, m in model.named_modules()}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------------------------------
# Construction routes


def _built_plainly(sd: dict) -> nn.Module:
    model = _mlp(seed=1)
    model.load_state_dict(sd)
    return convert_to_fp8(model)


def _meta_converted_then_loaded(sd: dict) -> nn.Module:
    with torch.device("meta"):
        model = convert_to_fp8(_mlp())
    model.to_empty(device="cpu")
    model.load_state_dict(sd)
    return model


def _to_empty_converted_then_loaded(sd: dict) -> nn.Module:
    with torch.device("meta"):
        model = _mlp()
    model.to_empty(device="cpu")  # converted off the meta device, its weights still uninitialized memory
    convert_to_fp8(model)
    model.load_state_dict(sd)
    return model


def _meta_converted_then_reset(sd: dict) -> nn.Module:
    # The weights come from reset_parameters() under the seed _mlp(0) draws them with: those of sd, in module order.
    with torch.device("meta"):
        model = convert_to_fp8(_mlp())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for module in model.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
    return model


def _init_empty_weights(convert_inside: bool):
    def build(sd: dict) -> nn.Module:
        accelerate = pytest.importorskip("accelerate")
        with accelerate.init_empty_weights():
            model = _mlp()
            if convert_inside:
                convert_to_fp8(model)
        if not convert_inside:
            convert_to_fp8(model)
        assert model[0].weight.is_meta
        model.to_empty(device="cpu")
        model.load_state_dict(sd)
        return model

    return build


BUILDS = {
    "plain": _built_plainly,
    "meta_converted_then_loaded": _meta_converted_then_loaded,
    "to_empty_converted_then_loaded": _to_empty_converted_then_loaded,
    "meta_converted_then_reset_parameters": _meta_converted_then_reset,
    "init_empty_weights_converted_inside": _init_empty_weights(convert_inside=True),
    "init_empty_weights_converted_after": _init_empty_weights(convert_inside=False),
}


@pytest.mark.parametrize("build", BUILDS)
def test_each_construction_route_gives_the_plainly_converted_model(build):
    """Whatever the route, the model has the weights it was given, fresh scaling states on the CPU, the unconverted
    model's output within FP8 error, trains as the plainly converted model does (bit for bit), and within LOSS_RTOL of
    torch.optim.AdamW on the unconverted model."""
    plain = _mlp()
    sd = plain.state_dict()
    model = BUILDS[build](sd)
    reference = convert_to_fp8(copy.deepcopy(plain))
    assert _types(model) == _types(reference)
    assert_same(_state(model), _state(reference))
    states = [m for m in model.modules() if isinstance(m, ScalingState)]
    assert len(states) == 6 and all(b.device.type == "cpu" for b in model.buffers())
    assert all(float(s.scale) == 1.0 and int(s.casts) == 0 and not s.amax_history.any() for s in states)
    x = torch.randn(TOKENS, IN) * 3
    with torch.no_grad():
        assert sqnr(model(x), plain(x)) > TWO_GEMMS_SQNR_DB
    for state in states:  # forget that evaluation: both train from fresh states
        state.reset()
    losses = _train(model, FP8AdamW(model.parameters(), lr=1e-2))
    assert losses == _train(reference, FP8AdamW(reference.parameters(), lr=1e-2))
    expected = _train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    assert losses[-1] < losses[0] and losses == pytest.approx(expected, rel=LOSS_RTOL)


def test_accelerate_loading_into_a_model_converted_on_meta_is_refused_and_converting_after_it_works():
    """accelerate's loader (``set_module_tensor_to_device``, what ``load_checkpoint_in_model`` calls) sets the
    parameters only: the scaling states of a model converted under ``init_empty_weights()`` stay on the meta device,
    and the first forward says what to do. Converting after the load is the plain route."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils import set_module_tensor_to_device

    plain = _mlp()
    for convert_first in (True, False):
        with accelerate.init_empty_weights():
            model = _mlp()
        if convert_first:
            convert_to_fp8(model)
        for key, value in plain.state_dict().items():
            set_module_tensor_to_device(model, key, "cpu", value=value)
        if convert_first:
            with pytest.raises(ValueError, match=r"weight is on cpu but the FP8 scaling state on meta.*to_empty"):
                model(torch.randn(TOKENS, IN))
            continue
        convert_to_fp8(model)
        x = torch.randn(TOKENS, IN)
        with torch.no_grad():
            assert torch.equal(model(x), convert_to_fp8(copy.deepcopy(plain))(x))


DTYPE_BUILDS = {
    "default_dtype_bfloat16": (torch.bfloat16, "default"),
    "default_dtype_float16": (torch.float16, "default"),
    "half": (torch.float16, "half"),
    "to_bfloat16": (torch.bfloat16, "to"),
}


@pytest.mark.parametrize("route", DTYPE_BUILDS)
def test_a_model_built_or_cast_in_16_bits_converts_and_trains_like_adamw(route):
    """The layers keep their dtype, the scaling states stay fp32 (built under the 16-bit default dtype too), the
    output is in the input's dtype within FP8 error of the fp32 model, and FP8AdamW trains it as AdamW trains the
    fp32 model."""
    dtype, how = DTYPE_BUILDS[route]
    fp32 = _mlp()
    if how == "default":
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = convert_to_fp8(_mlp())
        finally:
            torch.set_default_dtype(default)
    else:
        model = convert_to_fp8(fp32.half() if how == "half" else fp32.to(torch.bfloat16))
        fp32 = _mlp()
    assert set(fp8_modules(model)) == {"0", "2"}
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert {b.dtype for b in model.buffers()} == {torch.float32, torch.int64}
    x = torch.randn(TOKENS, IN)
    rounded = _mlp()  # the fp32 model given the 16-bit weights: what is left is the FP8 error (and the input's)
    rounded.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.no_grad():
        y = model(x.to(dtype))
        assert y.dtype == dtype and sqnr(y.float(), rounded(x.to(dtype).float())) > TWO_GEMMS_SQNR_DB
    losses = _train(model, FP8AdamW(model.parameters(), lr=1e-2), dtype=dtype)
    expected = _train(fp32, torch.optim.AdamW(fp32.parameters(), lr=1e-2))
    assert losses[-1] < losses[0] and losses == pytest.approx(expected, rel=LOSS_RTOL)


def test_under_a_float64_default_dtype_layers_are_left_then_convert_after_float(fresh_warnings):
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = _mlp()
        plain = copy.deepcopy(model).float()
        messages = _messages(model)
        assert any(m.endswith(": 0 (torch.float64), 2 (torch.float64); to run them in FP8, convert the model first "
                              "(model.float() or model.bfloat16())") for m in messages), messages  # fmt: skip
        assert not fp8_modules(model)
        convert_to_fp8(model.float())  # what the warning says, the default dtype still float64
        assert set(fp8_modules(model)) == {"0", "2"}
        assert {b.dtype for b in model.buffers()} == {torch.float32, torch.int64}
    finally:
        torch.set_default_dtype(default)
    x = torch.randn(TOKENS, IN)
    with torch.no_grad():
        assert model(x).dtype == torch.float32 and sqnr(model(x), plain(x)) > TWO_GEMMS_SQNR_DB


# ---------------------------------------------------------------------------------------------------------------------
# Lightning's configure_model


def _lightning_fit(precision: str, in_configure_model: bool, recipe=None, steps: int = 3) -> tuple[list, nn.Module]:
    L = pytest.importorskip("lightning")

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = None if in_configure_model else _mlp()
            self.losses = []

        def configure_model(self):
            if self.model is None:
                self.model = _mlp()
                convert_to_fp8(self.model, recipe)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = (self.model(x).float() - y).square().mean()
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            if precision == "32-true":  # no plugin: the module brings its FP8AdamW, as in a plain loop
                return FP8AdamW(self.parameters(), lr=1e-2)
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    xs, ys = zip(*_batches(steps), strict=True)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys)), TOKENS)
    lit = Lit()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision=precision, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and the like
        trainer.fit(lit, train_dataloaders=loader)
    return lit.losses, lit.model


def test_conversion_in_configure_model_trains_as_the_plain_loop():
    """``precision="32-true"``: convert_to_fp8 in configure_model and an FP8AdamW from configure_optimizers train as
    the same model and optimizer in a plain loop, bit for bit."""
    losses, model = _lightning_fit("32-true", in_configure_model=True)
    assert set(fp8_modules(model)) == {"0", "2"}
    plain = convert_to_fp8(_mlp())
    assert losses == _train(plain, FP8AdamW(plain.parameters(), lr=1e-2), steps=3)


def test_conversion_in_configure_model_under_fp8_lm_trains_as_the_plugins_own_conversion():
    """``precision="fp8-lm"``: a model converted in configure_model (with the plugin's recipe) trains as the plugin's
    own conversion of the same model, bit for bit; with another recipe the fit is refused, naming it."""
    pytest.importorskip("lightning")
    converted_there, model = _lightning_fit("fp8-lm", in_configure_model=True)
    by_plugin, plugin_model = _lightning_fit("fp8-lm", in_configure_model=False)
    assert set(fp8_modules(model)) == set(fp8_modules(plugin_model)) == {"0", "2"}
    assert converted_there == by_plugin and converted_there[-1] < converted_there[0]
    with pytest.raises(ValueError, match=r"'model.0' is already an FP8 layer, converted with scaling='current'"):
        _lightning_fit("fp8-lm", in_configure_model=True, recipe="fp8-lm-current")


# ---------------------------------------------------------------------------------------------------------------------
# Containers


class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU()) for _ in range(2)])
        self.heads = nn.ModuleDict({"main": nn.Linear(HIDDEN, OUT), "aux-head": nn.Linear(HIDDEN, OUT)})

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.heads["main"](h) + self.heads["aux-head"](h)


class _Aliased(nn.Module):
    """One layer under three names: an attribute, a ModuleList entry twice, and a ModuleDict value."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        shared = nn.Linear(HIDDEN, HIDDEN)
        self.shared = shared
        self.repeat = nn.ModuleList([shared, nn.GELU(), shared])
        self.by_name = nn.ModuleDict({"again": shared})
        self.out = nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.repeat:
            h = layer(h)
        return self.out(self.by_name["again"](h))


CONTAINERS = {
    "sequential": (lambda: _mlp(), {"0", "2"}),
    "nested": (_Nested, {"embed", "blocks.0.0", "blocks.1.0", "heads.main", "heads.aux-head"}),
    "aliased": (_Aliased, {"inp", "shared", "out"}),
}


@pytest.mark.parametrize("container", CONTAINERS)
def test_every_container_converts_in_place_sharing_parameters(container):
    build, expected = CONTAINERS[container]
    torch.manual_seed(0)
    model = build()
    plain = copy.deepcopy(model)
    params = dict(model.named_parameters())
    assert convert_to_fp8(model) is model
    assert set(fp8_modules(model)) == expected
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert all(params[name] is p for name, p in model.named_parameters())
    assert list(params) == [name for name, _ in model.named_parameters()]
    if container == "aliased":
        assert model.shared is model.repeat[0] is model.repeat[2] is model.by_name["again"]
    x = torch.randn(TOKENS, IN)
    with torch.no_grad():
        assert sqnr(model(x), plain(x)) > TWO_GEMMS_SQNR_DB  # up to four GEMMs in series, residuals: 25-30 dB


def test_a_bare_linear_returns_its_fp8_layer_with_its_hooks_and_parameters():
    torch.manual_seed(0)
    layer = nn.Linear(IN, OUT)
    plain = copy.deepcopy(layer)
    seen = []
    handles = [
        layer.register_forward_pre_hook(lambda m, args: (args[0] * 2,)),
        layer.register_forward_hook(lambda m, args, out: seen.append(type(m).__name__)),
    ]
    new = convert_to_fp8(layer)
    assert isinstance(new, FP8Linear) and new is not layer
    assert new.weight is layer.weight and new.bias is layer.bias
    x = torch.randn(TOKENS, IN)
    with torch.no_grad():
        assert sqnr(new(x), plain(x * 2)) > FORWARD_SQNR_DB and seen == ["FP8Linear"]
        for handle in handles:
            handle.remove()
        assert sqnr(new(x), plain(x)) > FORWARD_SQNR_DB
    assert seen == ["FP8Linear"]
    assert convert_to_fp8(new) is new  # already FP8: as it is


@pytest.mark.parametrize(
    "build", [nn.Sequential, nn.Module, nn.ModuleList, nn.ModuleDict, nn.GELU, lambda: nn.Sequential(nn.LayerNorm(16))]
)
def test_a_model_without_linear_layers_is_returned_as_it_was_without_a_word(build, fresh_warnings):
    model = build()
    before = _types(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert convert_to_fp8(model) is model
    assert _types(model) == before and "_ddp_params_and_buffers_to_ignore" not in vars(model)


def test_a_model_with_no_eligible_layer_is_left_named_and_unchanged(fresh_warnings):
    model = nn.Sequential(nn.Linear(40, 16), nn.ReLU(), nn.Linear(16, 24))
    plain = copy.deepcopy(model)
    messages = _messages(model)
    assert messages == ["convert_to_fp8 left 2 linear layer(s) in high precision because their feature sizes are not "
                        "multiples of 16: 0 (40->16), 2 (16->24)"]  # fmt: skip
    assert _types(model) == _types(plain) and not fp8_modules(model)
    assert "_ddp_params_and_buffers_to_ignore" not in vars(model)
    x = torch.randn(TOKENS, 40)
    assert torch.equal(model(x), plain(x))


# ---------------------------------------------------------------------------------------------------------------------
# Eligibility: every reason in one model


class _TaggedLinear(nn.Linear):
    """Adds nothing, but a subclass all the same."""


class _ReadsProj(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.other = nn.Linear(32, 32)

    def forward(self, x):
        return self.other(x) + nn.functional.linear(x, self.proj.weight)


class _CastsToProj(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        return self.proj(x.to(self.proj.weight.dtype))


class _KeepsWo(nn.Module):
    _keep_in_fp32_modules = ["wo"]

    def __init__(self):
        super().__init__()
        self.wi = nn.Linear(32, 64)
        self.wo = nn.Linear(64, 32)


class Conv1D(nn.Module):
    """transformers' Conv1D as GPT-2 holds it: y = x @ weight + bias, weight (nx, nf)."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = 4
        self.gate_up_proj = nn.Parameter(torch.randn(4, 64, 32))


def _zoo() -> nn.ModuleDict:
    torch.manual_seed(0)
    emb, head = nn.Embedding(64, 32), nn.Linear(32, 64, bias=False)
    head.weight = emb.weight
    buffer_weight = nn.Linear(32, 32)
    weight = buffer_weight.weight.detach().clone()
    del buffer_weight.weight
    buffer_weight.register_buffer("weight", weight)
    added = nn.Linear(32, 32)
    added.register_buffer("mask", torch.ones(32, 32))
    hooked = nn.Linear(32, 32)
    hooked.register_state_dict_post_hook(lambda module, sd, prefix, local_metadata: None)
    instance_forward = nn.Linear(32, 32)
    instance_forward.forward = functools.partial(nn.Linear.forward, instance_forward)
    compiled = nn.Linear(32, 32)
    compiled.compile()
    return nn.ModuleDict({
        "ok": nn.Linear(32, 32), "odd": nn.Linear(32, 10), "f64": nn.Linear(32, 32).double(), "emb": emb,
        "head": head, "weight_norm": parametrizations.weight_norm(nn.Linear(32, 32)), "lazy": nn.LazyLinear(32),
        "tagged": _TaggedLinear(32, 32), "buffer_weight": buffer_weight, "added": added,
        "enc": nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, batch_first=True), "reader": _ReadsProj(),
        "caster": _CastsToProj(), "hooked": hooked, "instance_forward": instance_forward, "compiled": compiled,
        "t5": _KeepsWo(), "conv1d": Conv1D(32, 32), "moe": _Experts(),
    })  # fmt: skip


# what each warning says (a fragment), and the layers it must name, in named_modules() order
LEFT = {
    "shared with another module": "head",
    "not multiples of 16": "odd (32->10)",
    "not float32, bfloat16 or float16": "f64 (torch.float64)",
    "computed from other parameters": "weight_norm",
    "nn.LazyLinear layers not initialized": "lazy",
    "subclasses of nn.Linear": "tagged (_TaggedLinear), enc.self_attn.out_proj (NonDynamicallyQuantizableLinear)",
    "is not an nn.Parameter": "buffer_weight",
    "besides weight and bias": "added",
    "belong to an nn.TransformerEncoderLayer": "enc.linear1, enc.linear2",
    "reads their weight itself": "reader.proj",
    "casts their input to their weight's dtype": "caster.proj",
    "state_dict hooks, an instance forward": "hooked, instance_forward, compiled",
    "keeps them in float32": "t5.wo",
    "transformers' Conv1D": "conv1d (32->32)",
    "input projections": "enc.self_attn (in_proj_weight)",
    "mixture of experts": "moe (4 experts)",
}


def test_every_reason_to_leave_a_layer_in_one_model_is_named_once_and_the_rest_converts(fresh_warnings):
    """One warning per reason the docstring lists, each naming exactly its layers; those stay the same objects, and
    the eligible layers (one next to each kind of left one) convert."""
    model = _zoo()
    before = dict(model.named_modules())
    messages = _messages(model)
    assert len(messages) == len(LEFT), messages
    for fragment, names in LEFT.items():
        found = [m for m in messages if fragment in m]
        assert len(found) == 1, (fragment, messages)
        count = len(names.split(", "))
        assert found[0].startswith(f"convert_to_fp8 left {count} linear layer(s) in high precision because")
        assert re.search(rf": {re.escape(names)}(; |$)", found[0]), (names, found[0])
    assert set(fp8_modules(model)) == {"ok", "reader.other", "t5.wi"}
    for name, module in model.named_modules():
        if not name.startswith(("ok", "reader.other", "t5.wi")):
            assert before[name] is module, name
    x = torch.randn(TOKENS, 32)
    with torch.no_grad():
        assert sqnr(model["ok"](x), nn.functional.linear(x, model["ok"].weight, model["ok"].bias)) > FORWARD_SQNR_DB


# ---------------------------------------------------------------------------------------------------------------------
# Code around a layer that reads its weight, in other spellings


class _Direct(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        return x @ self.proj.weight.t()


class _AnnotatedLocal(_Direct):
    def forward(self, x):
        proj: nn.Linear = self.proj
        return x @ proj.weight.t()


class _UnpackedLocals(_Direct):
    def forward(self, x):
        proj, scale = self.proj, 1.0
        return x @ proj.weight.t() * scale


class _SuperForward(_Direct):
    def forward(self, x):
        return super().forward(x) * 2.0


class _LoopOverLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 32), nn.Linear(32, 32)])

    def forward(self, x):
        for layer in self.layers:
            x = x @ layer.weight.t()
        return x


class _StackedWeights(_LoopOverLayers):
    def forward(self, x):
        return x @ sum(layer.weight.t() for layer in self.layers)


WEIGHT_READS = {
    "direct": _Direct,  # the spelling found today: the reference
    # Found by this sweep: forward_weight_reads followed `x = self.p` assignments and `self.p.weight` only, and methods
    # by name (super().forward was the subclass's own forward); these layers became FP8, and at O2 the parent's forward
    # computed with FP8AdamW's scaled fp16 master (values ~2**18 times too large under autocast), silently.
    "annotated_local": _AnnotatedLocal,
    "unpacked_locals": _UnpackedLocals,
    "super_forward": _SuperForward,
    "loop_over_layers": _LoopOverLayers,
    "comprehension_over_layers": _StackedWeights,
}


@pytest.mark.parametrize("spelling", WEIGHT_READS)
def test_a_weight_read_by_the_holding_module_in_any_spelling_leaves_the_layer(spelling, fresh_warnings):
    """convert_to_fp8's docstring: layers whose weight the code of a module holding them computes with itself (read
    from the source of the modules' forward and the methods it calls) stay nn.Linear, named. The reference: the
    unconverted module, whose output the converted one must give (within FP8 error; exactly where the layer is left)
    once FP8AdamW (O2) holds the model."""
    torch.manual_seed(0)
    model = nn.Sequential(WEIGHT_READS[spelling]())
    plain = copy.deepcopy(model)
    messages = _messages(model)
    FP8AdamW(model.parameters(), lr=1e-3)  # O2: takes the storage of the FP8 weights it is given
    x = torch.randn(TOKENS, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y, expected = model(x).float(), plain(x).float()
    assert sqnr(y, expected) > FORWARD_SQNR_DB, (y.abs().max(), expected.abs().max())
    assert not fp8_modules(model)
    assert any("reads their weight itself" in m for m in messages), messages


def test_a_layer_wrapped_by_torch_compile_is_not_reported_fp8_while_the_nn_linear_runs():
    # Found by this sweep: torch.compile(layer) registered in a model holds the layer as `_orig_mod`, and its forward
    # is bound to the nn.Linear's __call__ when it is built. convert_to_fp8 replaced `_orig_mod` by an FP8Linear
    # (fp8_modules listed "0._orig_mod") without a word, but the wrapper kept calling the old nn.Linear: no FP8 cast
    # recorded, and at O2 the nn.Linear computed with the scaled fp16 master. It is left and named, as layer.compile().
    torch.manual_seed(0)
    model = nn.Sequential(torch.compile(nn.Linear(32, 32), backend="eager"), nn.GELU(), nn.Linear(32, 16))
    plain = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
    plain.load_state_dict({k.replace("_orig_mod.", ""): v for k, v in model.state_dict().items()})
    _quiet_convert(model)
    x = torch.randn(TOKENS, 32)
    with torch.no_grad():
        model(x)
    for name, layer in fp8_modules(model).items():  # a layer reported FP8 runs FP8 GEMMs
        assert int(layer.fp8_scaling["input"].casts) == 1, name
    FP8AdamW(model.parameters(), lr=1e-3)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert sqnr(model(x).float(), plain(x).float()) > TWO_GEMMS_SQNR_DB


def test_a_layer_whose_weight_was_replaced_by_one_of_another_size_runs_as_before(fresh_warnings):
    # Found by this sweep: a layer pruned by hand (weight and bias replaced by their first 40 rows, out_features left at
    # 64, which nn.Linear's forward never reads) was converted without a word (the sizes check read in_features and
    # out_features), and the converted model's forward raised "FP8Linear(in_features=48, out_features=64) holds a
    # weight (40, 48)" where the unconverted model ran. Layers are judged by their weight's sizes.
    torch.manual_seed(0)
    model = _mlp()
    with torch.no_grad():
        model[0].weight = nn.Parameter(model[0].weight[:40].clone())
        model[0].bias = nn.Parameter(model[0].bias[:40].clone())
        model[2].weight = nn.Parameter(model[2].weight[:, :40].clone())
    plain = copy.deepcopy(model)
    x = torch.randn(TOKENS, IN)
    messages = _messages(model)
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))
    assert any("not multiples of 16" in m and ": 0 (48->40), 2 (40->32)" in m for m in messages), messages


def test_a_layer_pruned_by_hand_to_sizes_of_16_converts_with_its_weight_sizes(fresh_warnings):
    """Rows cut to 32 (a multiple of 16): the FP8 layer takes the weight's sizes as its features and computes what the
    pruned nn.Linear did (within FP8 error); its repr and the GEMMs agree."""
    torch.manual_seed(0)
    model = _mlp()
    with torch.no_grad():
        model[0].weight = nn.Parameter(model[0].weight[:32].clone())
        model[0].bias = nn.Parameter(model[0].bias[:32].clone())
        model[2].weight = nn.Parameter(model[2].weight[:, :32].clone())
    plain = copy.deepcopy(model)
    assert _messages(model) == []
    assert (model[0].in_features, model[0].out_features) == (IN, 32)
    assert (model[2].in_features, model[2].out_features) == (32, OUT)
    x = torch.randn(TOKENS, IN)
    with torch.no_grad():
        assert sqnr(model(x), plain(x)) > TWO_GEMMS_SQNR_DB


def test_a_bare_layer_compiled_by_torch_compile_is_left_and_named(fresh_warnings):
    """convert_to_fp8(torch.compile(layer)): the wrapper is the root; its layer stays nn.Linear, named, and the
    wrapper computes what it did."""
    torch.manual_seed(0)
    compiled = torch.compile(nn.Linear(32, 32), backend="eager")
    layer = compiled._orig_mod
    messages = _messages(compiled)
    assert compiled._orig_mod is layer and type(layer) is nn.Linear
    assert any("torch.compile(layer)" in m and ": _orig_mod;" in m for m in messages), messages
    x = torch.randn(TOKENS, 32)
    assert torch.equal(compiled(x), nn.functional.linear(x, layer.weight, layer.bias))


# ---------------------------------------------------------------------------------------------------------------------
# Shapes


@pytest.mark.parametrize(("in_features", "out_features", "bias"), [(16, 16, True), (16, 16, False), (16, 512, True),
                                                                    (784, 16, False), (48, 80, True)])  # fmt: skip
def test_sizes_of_16_no_bias_and_large_non_square_layers_convert_within_fp8_error(in_features, out_features, bias):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(in_features, out_features, bias=bias))
    plain = copy.deepcopy(model)
    convert_to_fp8(model)
    assert isinstance(model[0], FP8Linear) and (model[0].bias is None) == (not bias) and "bias" in model[0]._parameters
    assert list(model.state_dict()) == list(plain.state_dict())
    x = (torch.randn(TOKENS, in_features) * 3).requires_grad_()
    x_plain = x.detach().clone().requires_grad_()
    dy = torch.randn(TOKENS, out_features)
    y, y_plain = model(x), plain(x_plain)
    y.backward(dy)
    y_plain.backward(dy)
    assert sqnr(y, y_plain) > FORWARD_SQNR_DB
    assert sqnr(x.grad, x_plain.grad) > BACKWARD_SQNR_DB
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert sqnr(p.grad, q.grad) > BACKWARD_SQNR_DB


# ---------------------------------------------------------------------------------------------------------------------
# Filters


def _four() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.Linear(32, 16))


def _not_in(module: nn.Module, fqn: str, names: tuple[str, ...] = ("2",)) -> bool:
    return fqn not in names


class _ByName:
    def __init__(self, left: str):
        self.left = left

    def __call__(self, module: nn.Module, fqn: str) -> bool:
        return fqn != self.left

    def keep(self, module: nn.Module, fqn: str) -> bool:
        return fqn != self.left

    @staticmethod
    def static(module: nn.Module, fqn: str) -> bool:
        return fqn != "3"

    @classmethod
    def classmethod_(cls, module: nn.Module, fqn: str) -> bool:
        return fqn != "0"


FILTERS = {
    "by_fqn": (lambda m, fqn: fqn != "3", {"0", "2"}),
    "by_type": (lambda m, fqn: type(m) is nn.Linear, {"0", "2", "3"}),
    "by_shape": (lambda m, fqn: m.in_features == 32, {"0", "3"}),
    "lambda_with_default": (lambda m, fqn, left=("0", "3"): fqn not in left, {"2"}),
    "partial_keyword": (functools.partial(_not_in, names=("0",)), {"2", "3"}),
    "partial_positional": (functools.partial(lambda left, m, fqn: fqn != left, "2"), {"0", "3"}),
    "bound_method": (_ByName("0").keep, {"2", "3"}),
    "callable_object": (_ByName("2"), {"0", "3"}),
    "staticmethod": (_ByName.static, {"0", "2"}),
    "classmethod": (_ByName.classmethod_, {"2", "3"}),
    "varargs": (lambda *args: args[1] != "0", {"2", "3"}),
}


@pytest.mark.parametrize("kind", FILTERS)
def test_every_kind_of_callable_filters_as_a_function(kind):
    fn, expected = FILTERS[kind]
    model = _four()
    convert_to_fp8(model, module_filter_fn=fn)
    assert set(fp8_modules(model)) == expected
    assert {n for n, m in model.named_children() if type(m) is nn.Linear} == {"0", "2", "3"} - expected


def _raises_on_last(module, fqn):
    if fqn == "3":
        raise RuntimeError("filter failed on '3'")
    return True


RAISING = {
    "on_the_last_layer": (_raises_on_last, RuntimeError),
    "key_error": (lambda m, fqn: {"0": True, "2": False}[fqn], KeyError),
    "on_an_fp8_layer_of_another_recipe": (lambda m, fqn: m.not_an_attribute, AttributeError),
}


@pytest.mark.parametrize("kind", RAISING)
def test_a_filter_that_raises_leaves_the_model_as_it_was(kind):
    fn, error = RAISING[kind]
    model = _four()
    if kind == "on_an_fp8_layer_of_another_recipe":  # asked first about the FP8 layer whose recipe differs
        convert_to_fp8(model, "fp8-lm-current", module_filter_fn=lambda m, fqn: fqn == "0")
    types, state, attrs = _types(model), _state(model), dict(vars(model))
    with pytest.raises(error):
        convert_to_fp8(model, module_filter_fn=fn)
    assert _types(model) == types and vars(model).keys() == attrs.keys()
    assert_same(_state(model), state)
    assert {n for n, m in model.named_modules() if isinstance(m, ScalingState)} == {
        n for n in types if types[n] is ScalingState
    }


# ---------------------------------------------------------------------------------------------------------------------
# Repeated and partial conversion


def test_converting_again_changes_nothing_not_even_the_scaling_state():
    model = convert_to_fp8(_mlp())
    with torch.no_grad():
        model(torch.randn(TOKENS, IN) * 3)
    layers, buffers = dict(fp8_modules(model)), {k: v.clone() for k, v in model.named_buffers()}
    ignored = list(model._ddp_params_and_buffers_to_ignore)
    assert convert_to_fp8(model) is model
    assert fp8_modules(model) == layers and all(fp8_modules(model)[n] is layers[n] for n in layers)
    assert_same({k: v.clone() for k, v in model.named_buffers()}, buffers)
    assert model._ddp_params_and_buffers_to_ignore == ignored


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _mlp()
        self.head = nn.Linear(OUT, 16)

    def forward(self, x):
        return self.head(self.block(x))


def test_a_submodule_then_the_whole_model_equals_the_whole_model_at_once():
    model = _Outer()
    at_once = copy.deepcopy(model)
    convert_to_fp8(model.block)
    assert set(fp8_modules(model)) == {"block.0", "block.2"}
    inner = dict(fp8_modules(model.block))
    convert_to_fp8(model)
    convert_to_fp8(at_once)
    assert set(fp8_modules(model)) == {"block.0", "block.2", "head"}
    assert model.block[0] is inner["0"] and model.block[2] is inner["2"]
    assert set(model._ddp_params_and_buffers_to_ignore) == set(at_once._ddp_params_and_buffers_to_ignore)
    x = torch.randn(TOKENS, IN)
    for _ in range(2):
        y, y_at_once = model(x), at_once(x)
        assert torch.equal(y, y_at_once)
        y.square().sum().backward()
        y_at_once.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), at_once.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_filtered_then_unfiltered_conversion_and_the_recipe_rules():
    """A second call converts what the first left out, with its own recipe; a recipe whose scaling differs from an
    FP8 layer's is refused (nothing changed, the layer left out before included) unless the filter leaves that layer
    out; one that differs in opt_level only is taken, each layer keeping the recipe it was converted with."""
    model = _four()
    convert_to_fp8(model, "fp8-lm-current", module_filter_fn=lambda m, fqn: fqn == "0")
    types = _types(model)
    with pytest.raises(ValueError, match=r"'0' is already an FP8 layer, converted with scaling='current'.*nothing was"):
        convert_to_fp8(model, "fp8-lm")
    assert _types(model) == types
    convert_to_fp8(model, "fp8-lm", module_filter_fn=lambda m, fqn: not isinstance(m, FP8Linear) and fqn != "3")
    assert model[0].recipe.scaling == "current" and model[2].recipe.scaling == "delayed" and type(model[3]) is nn.Linear
    convert_to_fp8(model, "fp8-lm-current", module_filter_fn=lambda m, fqn: fqn != "2")
    assert model[3].recipe.scaling == "current"

    model = _four()
    convert_to_fp8(model, "fp8-lm-o1", module_filter_fn=lambda m, fqn: fqn == "0")
    convert_to_fp8(model, "fp8-lm")  # opt_level differs only
    assert [model[i].recipe.opt_level for i in (0, 2, 3)] == ["O1", "O2", "O2"]


def test_an_adamw_built_before_the_conversion_trains_the_fp8_layers_as_one_built_after():
    """The FP8 layers hold the Parameters the optimizer holds: torch.optim.AdamW built before convert_to_fp8 trains
    them, bit for bit as one built after it."""
    before, after = _mlp(), _mlp()
    opt_before = torch.optim.AdamW(before.parameters(), lr=1e-2)
    params = list(before.parameters())
    convert_to_fp8(before)
    convert_to_fp8(after)
    assert all(p is q for p, q in zip(before.parameters(), params, strict=True))
    losses = _train(before, opt_before)
    assert losses == _train(after, torch.optim.AdamW(after.parameters(), lr=1e-2)) and losses[-1] < losses[0]
    assert_same(_state(before), _state(after))


# ---------------------------------------------------------------------------------------------------------------------
# What the conversion keeps


def test_frozen_layers_modes_and_dtypes_are_kept_and_frozen_layers_stay_frozen_in_training():
    model = _mlp()
    model[0].requires_grad_(False)
    model[2].eval()
    frozen = _state(model[0])
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    convert_to_fp8(model)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    assert model[0].training and all(m.training for m in model[0].modules())
    assert not any(m.training for m in model[2].modules())
    trained = _state(model[2])
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(TOKENS, IN, requires_grad=True)
    losses = _train(model, opt, steps=3)
    assert losses[-1] < losses[0]
    assert_same(_state(model[0]), frozen)  # not even rounded to an fp16 master
    assert not any(torch.equal(a, b) for a, b in zip(_state(model[2]).values(), trained.values(), strict=True))
    model(x).sum().backward()  # dgrad through the frozen FP8 layer
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_checkpoints_cross_the_conversion_both_ways_through_weights_only_loads(opt_level):
    """A checkpoint of the unconverted model (torch.save, then torch.load(weights_only=True)) loads strictly into the
    converted one and gives its forward; one of the converted model trained by FP8AdamW loads into an unconverted model
    with the true weights (fp32, the keys in the same order)."""

    def through_file(sd):
        buffer = io.BytesIO()
        torch.save(sd, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)

    plain = _mlp(seed=3)
    model = convert_to_fp8(_mlp(), f"fp8-lm{'-o1' if opt_level == 'O1' else ''}")
    model.load_state_dict(through_file(plain.state_dict()))
    x = torch.randn(TOKENS, IN)
    with torch.no_grad():
        assert torch.equal(model(x), convert_to_fp8(copy.deepcopy(plain))(x))
    _train(model, FP8AdamW(model.parameters(), lr=1e-2, opt_level=opt_level), steps=2)
    sd = through_file(model.state_dict())
    assert list(sd) == list(plain.state_dict()) and all(v.dtype == torch.float32 for v in sd.values())
    fresh = _mlp(seed=5)
    fresh.load_state_dict(sd)
    with torch.no_grad():
        assert sqnr(model(x), fresh(x)) > TWO_GEMMS_SQNR_DB


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_converted_model_keeps_one_layer_under_several_names_and_its_hooks(how):
    torch.manual_seed(0)
    model = _Aliased()
    model.out.register_forward_hook(_add_one)
    plain = copy.deepcopy(model)
    convert_to_fp8(model)
    copied = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    assert copied.shared is copied.repeat[0] is copied.repeat[2] is copied.by_name["again"]
    assert isinstance(copied.shared, FP8Linear) and copied.shared is not model.shared
    assert [n for n, _ in copied.named_parameters()] == [n for n, _ in model.named_parameters()]
    x = torch.randn(TOKENS, IN)
    with torch.no_grad():
        y = copied(x)
        assert torch.equal(y, model(x)) and sqnr(y, plain(x)) > TWO_GEMMS_SQNR_DB


def _add_one(module, args, out):  # picklable
    return out + 1


def test_repr_shows_the_fp8_layers_with_nn_linears_fields():
    plain = nn.Sequential(nn.Linear(32, 48, bias=False), nn.Linear(48, 16))
    model = convert_to_fp8(copy.deepcopy(plain), "fp8-lm-current")
    text = repr(model)
    for line in (
        "(0): FP8Linear(\n    in_features=32, out_features=48, bias=False, fp8_format=hybrid, scaling=current",
        "(1): FP8Linear(\n    in_features=48, out_features=16, bias=True, fp8_format=hybrid, scaling=current",
    ):
        assert line in text, text  # fmt: skip
