import copy
import functools
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, prune

import lightning_fp8.warnings
from lightning_fp8 import FP8AdamW, FP8Linear, convert_to_fp8, fp8_modules
from tests.numerics import BACKWARD_SQNR_DB, FORWARD_SQNR_DB, sqnr

# Two FP8 GEMMs in series (with a GELU between): each adds its own rounding noise (~27 dB apiece, tests/numerics.py),
# measured 25-26 dB together against the unconverted model.
TWO_GEMMS_SQNR_DB = 20.0


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.odd = nn.Linear(32, 10)  # not a multiple of 16
        self.attn = nn.MultiheadAttention(32, 2, batch_first=True)

    def forward(self, x):
        h = self.down(torch.relu(self.up(self.norm(x))))
        return self.odd(h + self.attn(h, h, h)[0])


def test_converts_in_place_and_shares_parameters(fresh_warnings):
    model = Block()
    up_weight = model.up.weight
    with (
        pytest.warns(UserWarning, match=r"left 1 linear layer.*odd \(32->10\)"),
        pytest.warns(UserWarning, match=r"subclasses of nn.Linear.*attn.out_proj \(NonDynamicallyQuantizableLinear\)"),
    ):
        out = convert_to_fp8(model, "fp8-lm-current")
    assert out is model
    assert set(fp8_modules(model)) == {"up", "down"}
    assert model.up.weight is up_weight
    assert type(model.odd) is nn.Linear
    assert not isinstance(model.attn.out_proj, FP8Linear)  # MHA bypasses its forward
    assert model.up.recipe.scaling == "current"
    model(torch.randn(2, 5, 32)).sum().backward()
    assert model.up.weight.grad is not None


def test_idempotent():
    model = Block()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert_to_fp8(model)
    first = dict(fp8_modules(model))
    convert_to_fp8(model)
    assert fp8_modules(model) == first


def test_a_filter_that_raises_leaves_every_layer_as_it_was():
    # Found by a sweep: the filter was asked layer by layer while converting, so one raising on the second layer left
    # the first converted (a half-converted model, e.g. Accelerate's prepare with a filter of the wrong signature).
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))

    def flaky(module, fqn):
        if fqn == "2":
            raise RuntimeError("the filter failed on '2'")
        return True

    with pytest.raises(RuntimeError, match="the filter failed on '2'"):
        convert_to_fp8(model, module_filter_fn=flaky)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]
    with pytest.raises(TypeError):
        convert_to_fp8(model, module_filter_fn=lambda module: True)  # the wrong signature
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]
    assert [type(m) for m in convert_to_fp8(model, module_filter_fn=lambda m, fqn: fqn != "2")] == [
        FP8Linear,
        nn.ReLU,
        nn.Linear,
    ]


@pytest.mark.parametrize("answer", [None, "no", b""])
def test_a_filter_answering_a_string_or_always_none_is_refused_and_changes_nothing(answer):
    # Found by a sweep: a filter that forgot its `return` (None for every layer) silently kept every layer in high
    # precision, and one answering "no" converted them.
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    message = r"returned None for all 2 linear layers.*return statement" if answer is None else r"returned .* for '0'"
    with pytest.raises(TypeError, match=message):
        convert_to_fp8(model, module_filter_fn=lambda m, fqn: answer)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]


def test_a_filter_that_cannot_take_module_and_name_is_refused_before_any_layer():
    # Python's bare "<lambda>() takes 1 positional argument but 2 were given" came from the first layer asked.
    model = nn.Sequential(nn.Linear(16, 32))
    with pytest.raises(TypeError, match=r"called as fn\(module, fqn\).*lambda module, fqn"):
        convert_to_fp8(model, module_filter_fn=lambda fqn: True)
    assert type(model[0]) is nn.Linear


def test_a_filter_is_read_by_truthiness_as_torchaos():
    # A NumPy bool, a re.search match (None where it does not match) and a one-element tensor answer as bool() reads
    # them, as torchao's convert_to_float8_training does.
    def by_regex(m, fqn):
        return re.search(r"^0$", fqn)

    for fn in (lambda m, fqn: np.bool_(fqn == "0"), by_regex, lambda m, fqn: torch.tensor(fqn == "0")):
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        convert_to_fp8(model, module_filter_fn=fn)
        assert [type(m) for m in model] == [FP8Linear, nn.ReLU, nn.Linear]


def test_fp8_modules_of_something_else_than_a_module_is_a_type_error():
    # Found by a sweep: fp8_modules("model") raised AttributeError: 'str' object has no attribute 'named_modules'.
    with pytest.raises(TypeError, match=r"fp8_modules expects an nn.Module \(the model\), got str"):
        fp8_modules("model")


def test_filter_fn_receives_fqn():
    model = nn.Sequential(nn.Linear(16, 32), nn.Sequential(nn.Linear(32, 16)))
    seen = []
    convert_to_fp8(model, module_filter_fn=lambda m, fqn: seen.append(fqn) or fqn != "1.0")
    assert sorted(seen) == ["0", "1.0"]
    assert isinstance(model[0], FP8Linear) and type(model[1][0]) is nn.Linear


def test_bare_linear_returns_new_module():
    lin = nn.Linear(16, 16)
    out = convert_to_fp8(lin)
    assert isinstance(out, FP8Linear) and out.weight is lin.weight


def test_checkpoint_before_and_after_conversion():
    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16))
    sd = src.state_dict()
    # checkpoint of a plain model loaded into a converted one
    converted = convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)))
    converted.load_state_dict(sd)
    # converted after loading
    loaded_then_converted = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16))
    loaded_then_converted.load_state_dict(sd)
    convert_to_fp8(loaded_then_converted)
    x = torch.randn(8, 32)
    assert torch.equal(converted(x), loaded_then_converted(x))
    # and a converted model's checkpoint loads into a plain one
    plain = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16))
    plain.load_state_dict(converted.state_dict())
    torch.testing.assert_close(plain(x), src(x))


def test_rejects_non_module():
    with pytest.raises(TypeError, match="expects an nn.Module"):
        convert_to_fp8(torch.randn(3))


def test_tied_weight_stays_high_precision():
    emb = nn.Embedding(64, 32)
    head = nn.Linear(32, 64, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head, "mlp": nn.Linear(32, 32)})
    with pytest.warns(UserWarning, match=r"shared with another module.*head"):
        convert_to_fp8(model)
    assert type(model["head"]) is nn.Linear and isinstance(model["mlp"], FP8Linear)


# ------------------------------------------------------------------------------- a layer under several names
class Reused(nn.Module):
    """``lin(gelu(lin(x)))`` with ``lin`` registered under each of ``names`` (under one: the reference)."""

    def __init__(self, lin: nn.Linear, names: tuple[str, ...]):
        super().__init__()
        for name in names:
            setattr(self, name, lin)
        self.names = names

    def forward(self, x):
        return getattr(self, self.names[-1])(F.gelu(getattr(self, self.names[0])(x)))


REUSES = {
    "alias": lambda lin: Reused(lin, ("shared", "alias")),  # e.g. weight-shared blocks
    "sequential": lambda lin: nn.Sequential(lin, nn.GELU(), lin),
}


def _train_o2_autocast(model: nn.Module, x: torch.Tensor, steps: int = 4) -> list[float]:
    """The documented loop at O2 under bf16 autocast: FP8AdamW keeps each FP8 weight's fp16 master in its storage."""
    optimizer = FP8AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (model(x).float() - 1).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("reuse", REUSES)
def test_a_layer_under_several_names_becomes_one_fp8_layer_under_all(reuse):
    lin = nn.Linear(32, 32)
    model, plain = REUSES[reuse](lin), REUSES[reuse](copy.deepcopy(lin))
    once = Reused(copy.deepcopy(lin), ("shared",))  # the same computation, the layer registered under one name
    convert_to_fp8(model)
    convert_to_fp8(once)
    layers = [child for child in model._modules.values() if isinstance(child, nn.Linear)]
    assert len(layers) == 2 and layers[0] is layers[1] and isinstance(layers[0], FP8Linear)
    x = torch.randn(8, 32)
    with torch.no_grad():  # a graph would hold the weights, which FP8AdamW (O2) refuses to adopt then
        y = model(x)
        assert torch.equal(y, once(x)) and sqnr(y, plain(x)) > TWO_GEMMS_SQNR_DB

    assert _train_o2_autocast(model, x) == _train_o2_autocast(once, x)
    assert layers[0].weight.dtype == torch.float16  # the O2 master: an nn.Linear left under one name would read it
    plain.load_state_dict(model.state_dict())  # the true weights: state_dict exports the master unscaled
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert sqnr(model(x).float(), plain(x).float()) > TWO_GEMMS_SQNR_DB


# ------------------------------------------------------------------------- layers left in high precision
REPARAMETRIZATIONS = {
    "weight_norm": nn.utils.weight_norm,  # hook-based: still an nn.Linear, its weight computed by a pre-hook
    "spectral_norm": nn.utils.spectral_norm,
    "pruning": lambda layer: prune.l1_unstructured(layer, "weight", amount=0.3),
    "parametrizations.weight_norm": parametrizations.weight_norm,  # a ParametrizedLinear subclass
    "parametrizations.spectral_norm": parametrizations.spectral_norm,
}


@pytest.mark.parametrize("kind", REPARAMETRIZATIONS)
def test_reparametrized_layers_stay_in_high_precision_and_train(kind, fresh_warnings):
    def build():
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # nn.utils.weight_norm's deprecation
            return nn.Sequential(REPARAMETRIZATIONS[kind](nn.Linear(32, 32)), nn.GELU(), nn.Linear(32, 16))

    model, reference = build(), build()
    layer, names = model[0], [name for name, _ in model.named_parameters()]
    with pytest.warns(UserWarning, match=r"computed from other parameters.*: 0; to run them in FP8, remove"):
        convert_to_fp8(model)
    convert_to_fp8(reference, module_filter_fn=lambda m, fqn: fqn != "0")  # left out on purpose
    assert [name for name, _ in model.named_parameters()] == names
    assert model[0] is layer and isinstance(model[2], FP8Linear)

    losses = {}
    for key, m in (("converted", model), ("reference", reference)):
        optimizer = FP8AdamW(m.parameters(), lr=1e-2)
        losses[key] = []
        for step in range(3):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
            loss = m(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[key].append(loss.item())
    assert losses["converted"] == losses["reference"] and len(set(losses["converted"])) == 3  # it trains
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_float64_layers_stay_in_high_precision(fresh_warnings):
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16)).double()
    plain = copy.deepcopy(model)
    expected = r"not float32, bfloat16 or float16.*: 0 \(torch.float64\), 2 \(torch.float64\); to run them in FP8"
    with pytest.warns(UserWarning, match=expected):
        convert_to_fp8(model)
    assert not fp8_modules(model)
    x = torch.randn(8, 32, dtype=torch.float64)
    assert torch.equal(model(x), plain(x))
    convert_to_fp8(model.float())  # what the warning says to do
    assert set(fp8_modules(model)) == {"0", "2"}
    assert sqnr(model(x.float()), plain(x)) > TWO_GEMMS_SQNR_DB


# ----------------------------------------------------------------------------------------------------- hooks
def _add_hooks(layer: nn.Linear, log: list) -> list:
    """A pre-hook and a hook that change the input and the output, a kwargs hook and a full backward hook that log."""
    return [
        layer.register_forward_pre_hook(lambda m, args: (args[0] * 2,)),
        layer.register_forward_hook(lambda m, args, out: out + 1),
        layer.register_forward_hook(
            lambda m, args, kwargs, out: log.append(("forward", type(m).__name__)), with_kwargs=True
        ),
        layer.register_full_backward_hook(lambda m, grad_in, grad_out: log.append(("backward", grad_out[0].shape))),
    ]


def test_forward_and_backward_hooks_carry_over_to_the_fp8_layer():
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    plain = copy.deepcopy(model)
    log, plain_log = [], []
    handles = _add_hooks(model[0], log)
    _add_hooks(plain[0], plain_log)
    convert_to_fp8(model)
    assert isinstance(model[0], FP8Linear)
    x = torch.randn(8, 32, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()
    y, y_plain = model(x), plain(x_plain)
    assert sqnr(y, y_plain) > TWO_GEMMS_SQNR_DB  # without the hooks' x * 2 and + 1 it is about 6 dB
    y.square().sum().backward()
    y_plain.square().sum().backward()
    assert sqnr(x.grad, x_plain.grad) > BACKWARD_SQNR_DB
    assert log == [("forward", "FP8Linear"), ("backward", (8, 64))]
    assert plain_log == [("forward", "Linear"), ("backward", (8, 64))]

    for handle in handles:  # the handles returned before the conversion remove the hooks from the FP8 layer
        handle.remove()
    log.clear()
    unhooked = copy.deepcopy(plain)
    unhooked[0]._forward_hooks.clear()
    unhooked[0]._forward_pre_hooks.clear()
    assert sqnr(model(x), unhooked(x)) > TWO_GEMMS_SQNR_DB and log == []


def test_layers_with_state_dict_hooks_or_an_instance_forward_stay_in_high_precision(fresh_warnings):
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))
    model[0].register_state_dict_post_hook(lambda m, sd, prefix, meta: sd.update({prefix + "step": torch.tensor(3)}))
    model[1].forward = functools.partial(lambda m, x: nn.Linear.forward(m, x) * 3, model[1])  # e.g. accelerate's
    plain = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"state_dict hooks, an instance forward.*: 0, 1; to run them in FP8, "
                      r"register those \(or call .compile\(\)\) after convert_to_fp8"):  # fmt: skip
        convert_to_fp8(model)
    assert set(fp8_modules(model)) == {"2"}
    assert model.state_dict().keys() == plain.state_dict().keys() and "0.step" in model.state_dict()
    x = torch.randn(8, 32)
    assert sqnr(model(x), plain(x)) > FORWARD_SQNR_DB
    assert torch.equal(model[1](x), plain[1](x))


def test_transformer_encoder_layer_linears_stay_in_high_precision(fresh_warnings):
    """nn.TransformerEncoderLayer's inference fast path (eval under no_grad) reads linear1/linear2's weights itself,
    bypassing the layers: at O2 it read FP8AdamW's scaled fp16 master (a dtype error, or garbage). They stay nn.Linear,
    named in a warning, and evaluation equals the unconverted model's."""
    torch.manual_seed(0)
    block = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True)
    ref = copy.deepcopy(block)
    model = nn.Sequential(block, nn.Linear(32, 32))
    with (
        pytest.warns(UserWarning, match="nn.TransformerEncoderLayer, whose inference fast path"),
        pytest.warns(UserWarning, match=r"subclasses of nn.Linear.*0.self_attn.out_proj"),
    ):
        convert_to_fp8(model)
    assert type(block.linear1) is nn.Linear and type(block.linear2) is nn.Linear and isinstance(model[1], FP8Linear)
    FP8AdamW(model.parameters(), lr=1e-3)  # O2: adopts the FP8 weights it is given
    model.eval()
    ref.eval()
    x = torch.randn(4, 6, 32)
    with torch.no_grad():
        assert torch.equal(model[0](x), ref(x))


# --------------------------------------------------------------------------------- subclasses, non-parameters
class LoRALinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, rank: int = 4):
        super().__init__(in_features, out_features)
        self.lora_a = nn.Parameter(torch.randn(rank, in_features) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank))

    def forward(self, x):
        return super().forward(x) + x @ self.lora_a.t() @ self.lora_b.t()


class TaggedLinear(nn.Linear):
    """Adds nothing, but convert_to_fp8 cannot tell: left out like any subclass."""


def test_linear_subclasses_stay_in_high_precision_named(fresh_warnings):
    """Left out silently before, though the docstring promises every nn.Linear: now named, with their type."""
    model = nn.ModuleDict(
        {"lora": LoRALinear(32, 32), "tagged": TaggedLinear(32, 32), "attn": nn.MultiheadAttention(32, 2),
         "plain": nn.Linear(32, 32)}
    )  # fmt: skip
    expected = (r"subclasses of nn.Linear.*: lora \(LoRALinear\), tagged \(TaggedLinear\), attn.out_proj "
                r"\(NonDynamicallyQuantizableLinear\); to run one in FP8, make it a plain nn.Linear")  # fmt: skip
    with pytest.warns(UserWarning, match=expected):
        convert_to_fp8(model)
    assert set(fp8_modules(model)) == {"plain"}
    assert type(model["lora"]) is LoRALinear and type(model["tagged"]) is TaggedLinear


def test_an_uninitialized_lazy_linear_is_named_with_what_to_do_and_converts_once_initialized(fresh_warnings):
    """A LazyLinear is a subclass of nn.Linear until its first forward: the warning says to run one, after which a
    second convert_to_fp8 converts it (it is an nn.Linear then)."""
    model = nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.Linear(32, 16))
    with pytest.warns(UserWarning, match=r"nn.LazyLinear layers not initialized yet.*: 0; to run them in FP8, run one"):
        convert_to_fp8(model)
    assert set(fp8_modules(model)) == {"2"}
    model(torch.randn(4, 48))
    convert_to_fp8(model)
    assert set(fp8_modules(model)) == {"0", "2"} and model[0].in_features == 48


def _frozen_as_buffer(layer: nn.Linear, name: str) -> nn.Linear:
    tensor = getattr(layer, name).detach().clone()
    delattr(layer, name)
    layer.register_buffer(name, tensor)
    return layer


def test_weight_or_bias_that_is_not_a_parameter_stays_in_high_precision(fresh_warnings):
    """An FP8Linear registers weight and bias as parameters: a buffer weight (a frozen base weight) left the
    state_dict, and .to() no longer moved it."""
    model = nn.Sequential(
        _frozen_as_buffer(nn.Linear(32, 32), "weight"), _frozen_as_buffer(nn.Linear(32, 32), "bias"), nn.Linear(32, 32)
    )
    plain = copy.deepcopy(model)
    keys = list(model.state_dict())
    with pytest.warns(UserWarning, match=r"weight or bias is not an nn.Parameter.*: 0, 1; to run them in FP8, make it"):
        convert_to_fp8(model)
    assert set(fp8_modules(model)) == {"2"}
    assert list(model.state_dict()) == keys
    x = torch.randn(8, 32)
    assert torch.equal(model[:2](x), plain[:2](x))
    model.to(torch.bfloat16)
    assert model[0].weight.dtype == model[1].bias.dtype == torch.bfloat16


def test_layers_with_added_state_stay_in_high_precision_and_plain_attributes_carry_over(fresh_warnings):
    """A parameter, buffer or submodule registered on a plain nn.Linear besides weight and bias (a mask, a gain) would
    leave the state_dict, .to() and the optimizer in an FP8Linear: such layers stay, named. A plain attribute (a tag
    other code reads) goes with the layer into its FP8Linear."""
    masked, gained, plain = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
    masked.register_buffer("mask", torch.ones(32, 32))
    gained.gain = nn.Parameter(torch.full((32,), 2.0))
    plain.tag = "keep-me"
    model = nn.Sequential(masked, gained, plain)
    keys, n_params = list(model.state_dict()), len(list(model.parameters()))
    with pytest.warns(UserWarning, match=r"parameters, buffers or submodules besides weight and bias.*: 0, 1; to run"):
        convert_to_fp8(model)
    assert set(fp8_modules(model)) == {"2"} and model[2].tag == "keep-me"
    assert list(model.state_dict()) == keys and len(list(model.parameters())) == n_params
    with pytest.raises(ValueError, match="besides weight and bias"):
        FP8Linear.from_linear(masked)


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D's shape (GPT-2's projections): y = x @ weight + bias, weight (nx, nf)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


class _T5LikeFF(nn.Module):
    _keep_in_fp32_modules = ["wo"]  # as transformers' T5PreTrainedModel declares it

    def __init__(self) -> None:
        super().__init__()
        self.wi = nn.Linear(32, 64)
        self.wo = nn.Linear(64, 32)
        self.proj = Conv1D(32, 32)


def test_hugging_face_layers_kept_in_fp32_and_conv1d_are_left_and_named(monkeypatch):
    """Found by the twentieth session's sweep with transformers models: T5's wo (declared in _keep_in_fp32_modules,
    its input cast to its weight's dtype) became FP8 and at O2 its input fp16, overflowing to inf on every step; GPT-2's
    Conv1D projections stayed high precision without a word (the model had no FP8 layer at all)."""
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    model = _T5LikeFF()
    with pytest.warns(UserWarning) as record:
        convert_to_fp8(model)
    messages = [str(w.message) for w in record]
    assert isinstance(model.wi, FP8Linear) and type(model.wo) is nn.Linear and type(model.proj) is Conv1D
    assert any("keeps them in float32" in m and ": wo" in m for m in messages), messages
    assert any("transformers' Conv1D" in m and "proj (32->32)" in m for m in messages), messages


class _DottedKeep(nn.Module):
    # As transformers' DeepSeek-V3.2 declares it: a dotted entry, matched against parameter names by whole components.
    _keep_in_fp32_modules = ["indexer.weights_proj", "router.*.gate"]

    def __init__(self) -> None:
        super().__init__()
        self.indexer = nn.ModuleDict({"weights_proj": nn.Linear(32, 32), "q": nn.Linear(32, 32)})
        self.other = nn.ModuleDict({"weights_proj": nn.Linear(32, 32)})  # not under "indexer": converted
        self.router = nn.ModuleDict({"expert": nn.ModuleDict({"gate": nn.Linear(32, 32)})})
        self.my_indexer = nn.ModuleDict({"weights_proj": nn.Linear(32, 32)})  # "my_indexer" is not "indexer"


def test_a_dotted_keep_in_fp32_entry_leaves_the_layer_it_names(monkeypatch):
    """An entry with a dot ("indexer.weights_proj") never equalled one name component, so the layer became FP8
    (found by a sweep with a tiny DeepSeek-V3.2, whose forward casts that layer's input to its weight's dtype)."""
    monkeypatch.setattr(lightning_fp8.warnings, "_seen", set())
    model = _DottedKeep()
    with pytest.warns(UserWarning, match="keeps them in float32") as record:
        convert_to_fp8(model)
    kept = {"indexer.weights_proj", "router.expert.gate"}
    for name, layer in model.named_modules():
        if isinstance(layer, nn.Linear):
            assert isinstance(layer, FP8Linear) == (name not in kept), name
    assert any("indexer.weights_proj" in str(w.message) for w in record)


def test_a_bare_linear_converted_keeps_its_scaling_buffers_out_of_ddps_broadcast():
    """convert_to_fp8(nn.Linear) returned the new layer before naming its scaling buffers for DDP to leave alone (as
    it does for a model): DDP(layer) then overwrote every rank's amax history with rank 0's (found by a sweep)."""
    layer = convert_to_fp8(nn.Linear(32, 16))
    in_model = convert_to_fp8(nn.Sequential(nn.Linear(32, 16)))
    expected = {name.removeprefix("0.") for name in in_model._ddp_params_and_buffers_to_ignore}
    scaling = {name for name, _ in layer.named_buffers() if "fp8_scaling" in name}
    assert scaling and set(layer._ddp_params_and_buffers_to_ignore) == expected >= scaling


def test_a_layer_compiled_in_place_is_left_in_high_precision_and_refused_by_from_linear():
    # nn.Module.compile() keeps a compiled call of the nn.Linear in the instance, which the FP8Linear took over as a
    # plain attribute: it ran the nn.Linear (no cast recorded), and at O2 read the scaled fp16 master as the weight.
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
    model[0].compile()
    with pytest.warns(UserWarning, match=r"compiled in place \(layer.compile\(\)\).*: 0; to run them in FP8"):
        convert_to_fp8(model)
    assert type(model[0]) is nn.Linear and isinstance(model[2], FP8Linear)
    with pytest.raises(ValueError, match=r"compiled in place.*call \.compile\(\)\) after convert_to_fp8"):
        FP8Linear.from_linear(model[0])


def test_a_layer_under_two_names_is_asked_about_under_its_first_name_in_named_modules():
    # The walk met the layer first under its shallower name ("b"), where named_modules() (and convertible_linears,
    # which the Accelerate report uses) names it "a.lin".
    model = nn.Module()
    model.a = nn.Module()
    model.a.lin = nn.Linear(32, 32)
    model.b = model.a.lin
    asked = []
    convert_to_fp8(model, module_filter_fn=lambda m, fqn: asked.append(fqn) or fqn != "a.lin")
    assert asked == ["a.lin"] and type(model.a.lin) is nn.Linear and model.b is model.a.lin


def test_conversion_in_eval_mode_leaves_every_new_module_in_eval_mode():
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU()).eval()
    convert_to_fp8(model)
    assert {name: m.training for name, m in model.named_modules() if m.training} == {}


def test_recipe_is_read_only_after_conversion():
    """The scaling states are built from the recipe at conversion: assigning another recipe to layer.recipe changed the
    repr and fooled convert_to_fp8's recipe check while every cast kept the old states. It is refused now."""
    model = nn.Sequential(nn.Linear(32, 16))
    convert_to_fp8(model)  # fp8-lm: hybrid, delayed
    layer = model[0]
    before = layer.recipe
    with pytest.raises(AttributeError, match=r"scaling states were built from the recipe.*Convert a fresh nn.Linear"):
        layer.recipe = "fp8-lm-current"
    assert layer.recipe is before and "scaling=delayed" in repr(layer)
    with pytest.raises(ValueError, match="already an FP8 layer"):  # the check still sees the recipe the states have
        convert_to_fp8(model, "fp8-lm-current")
    for copied in (copy.deepcopy(layer), FP8Linear.from_linear(nn.Linear(32, 16), "fp8-lm-current")):
        with pytest.raises(AttributeError, match="cannot be set"):
            copied.recipe = before
    assert copy.deepcopy(layer).recipe == before


@pytest.mark.parametrize(("not_callable", "example"), [("head", "'head'"), (["0"], "'lm_head'"), (True, "'lm_head'")])
def test_a_filter_that_is_not_callable_is_refused_before_any_change(not_callable, example):
    # Found by a sweep: a layer name passed as the filter raised "'str' object is not callable" from inside the walk
    # (FP8LMPrecision(module_filter_fn=...) says what to pass). The example keeps the layer a string names; for
    # anything else it names lm_head (it once read "fqn != True").
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    match = rf"convert_to_fp8\(module_filter_fn=.*\): must be a callable .* e.g. lambda module, fqn: fqn != {example}"
    with pytest.raises(TypeError, match=match):
        convert_to_fp8(model, module_filter_fn=not_callable)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]


class _ReadsWeight(nn.Module):
    """Computes with two layers' weights in its forward (one in a method the forward calls), casts a third one's input
    to its weight's dtype, and reads two others' only for their shape, to initialize them, or outside the forward (a
    LoRA layer's merge)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(32, 32)
        self.proj = nn.Linear(32, 32)
        self.adapted = nn.Linear(32, 32)
        self.cast = nn.Linear(32, 32)
        self.inner = nn.Module()
        self.inner.out = nn.Linear(32, 32)
        nn.init.zeros_(self.proj.weight)

    def merged_weight(self) -> torch.Tensor:
        return self.adapted.weight + 1.0

    def _gated(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.gate.weight.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, self.proj.weight.shape[1])
        y = self.proj(self._gated(x)) + self.inner.out(x) @ self.inner.out.weight + self.adapted(x)
        return y + self.cast(y.to(dtype=self.cast.weight.dtype))


def test_a_linear_layer_whose_weight_its_parent_computes_with_is_left_and_named(fresh_warnings):
    """Code that computes with a layer's weight itself (Mamba's ``self.dt_proj.weight @ x``, DETR's conv2d over
    ``k_proj.weight``) bypassed the FP8 layer, and at O2 read FP8AdamW's scaled fp16 master: wrong values, or a dtype
    error in the second step. Code that casts a layer's input to its weight's dtype (T5's feed-forward, without T5's
    _keep_in_fp32_modules in LongT5, SwitchTransformers, Pix2Struct) cast it to float16 at O2, where it overflows.
    Found by a sweep with tiny transformers models (tests/integrations/test_hugging_face.py)."""
    model = _ReadsWeight()
    with pytest.warns(UserWarning) as record:
        convert_to_fp8(model)
    messages = [str(w.message) for w in record]
    assert any(re.search(r"reads their weight itself.*: gate, inner\.out$", m) for m in messages), messages
    assert any(re.search(r"casts their input to their weight's dtype.*: cast$", m) for m in messages), messages
    assert type(model.gate) is nn.Linear and type(model.inner.out) is nn.Linear and type(model.cast) is nn.Linear
    assert isinstance(model.proj, FP8Linear) and isinstance(model.adapted, FP8Linear)
    assert model(torch.randn(4, 32)).shape == (4, 32)


class _LoraLinear(nn.Module):
    """A layer with adapters as peft 0.21's ``lora.Linear`` builds and runs them: ``lora_A``/``lora_B`` are ModuleDicts
    of linear layers by adapter name, and its forward casts the adapter's input to ``lora_A.weight.dtype`` through a
    helper, reading the layer from the container into a local first."""

    def __init__(self, base: nn.Linear, rank: int = 16) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, rank, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, base.out_features, bias=False)})
        nn.init.normal_(self.lora_B["default"].weight, std=0.02)

    def _cast_input_dtype(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x if x.dtype == dtype else x.to(dtype=dtype)

    def merged(self) -> torch.Tensor:  # peft's get_delta_weight: outside the forward
        return self.base_layer.weight + self.lora_B["default"].weight @ self.lora_A["default"].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        for adapter in self.lora_A:
            lora_A = self.lora_A[adapter]
            lora_B = self.lora_B[adapter]
            x = self._cast_input_dtype(x, lora_A.weight.dtype)
            result = result + lora_B(lora_A(x)) * 2.0
        return result


def test_peft_style_adapters_whose_input_is_cast_to_their_weight_dtype_are_left(fresh_warnings):
    """A model with PEFT LoRA adapters of rank 16, converted: ``lora_A`` became an FP8 layer, and at O2 peft's forward
    cast its input to its weight's dtype, FP8AdamW's float16 (activations beyond 65504 became inf). The source scan
    missed the weight read through a local taken from the container (``lora_A = self.lora_A[adapter]``) and the cast
    through a helper. ``lora_B``, whose input is ``lora_A``'s output, stays an FP8 layer: merging reads its true
    weight after ``release_weights()`` (docs/guides/checkpoints.md). Found by a lifecycle sweep with peft."""
    model = nn.Sequential(_LoraLinear(nn.Linear(32, 64)), nn.ReLU(), _LoraLinear(nn.Linear(64, 32)))
    with pytest.warns(UserWarning, match="casts their input to their weight's dtype") as record:
        convert_to_fp8(model)
    message = next(str(w.message) for w in record if "weight's dtype" in str(w.message))
    assert message.endswith(": 0.lora_A.default, 2.lora_A.default"), message
    assert type(model[0].lora_A["default"]) is nn.Linear and type(model[2].lora_A["default"]) is nn.Linear
    assert all(isinstance(m.base_layer, FP8Linear) and isinstance(m.lora_B["default"], FP8Linear) for m in model[::2])
    model.requires_grad_(False)
    adapters = [p for m in model[::2] for p in (m.lora_A["default"].weight, m.lora_B["default"].weight)]
    for p in adapters:
        p.requires_grad_(True)
    opt = FP8AdamW(adapters, lr=1e-3, opt_level="O2")
    x = torch.randn(4, 32) * 1e5  # an input float16 cannot hold, as the adapters' own
    (model(x).sum() * 1e-4).backward()  # weight gradients that the O2 storage's float16 holds
    opt.step()
    assert torch.isfinite(model(x)).all()
    true_b = [m.lora_B["default"].state_dict()["weight"] for m in model[::2]]
    opt.release_weights()
    for m, b in zip(model[::2], true_b, strict=True):
        torch.testing.assert_close(m.merged(), m.base_layer.weight + b @ m.lora_A["default"].weight)


def test_multihead_attention_input_projections_are_named_in_a_warning(fresh_warnings):
    """nn.MultiheadAttention's input projections (in_proj_weight: three quarters of its weights) are parameters its
    attention function multiplies with itself: they stayed in high precision without a word, while the warning named
    its out_proj alone."""
    model = nn.ModuleDict(
        {"self_attn": nn.MultiheadAttention(32, 2), "cross": nn.MultiheadAttention(32, 2, kdim=16, vdim=16)}
    )
    with pytest.warns(UserWarning, match="input projections") as record:
        convert_to_fp8(model)
    message = next(str(w.message) for w in record if "input projections" in str(w.message))
    assert message.startswith("convert_to_fp8 left 2 linear layer(s) in high precision because")
    assert "self_attn (in_proj_weight), cross (q/k/v_proj_weight); to run them in FP8" in message
    # the filter is asked about linear layers only (out_proj): one that reads in_features does not meet the attention
    lightning_fp8.warnings._seen.clear()
    asked = []
    with pytest.warns(UserWarning, match="input projections"):
        convert_to_fp8(nn.MultiheadAttention(32, 2), module_filter_fn=lambda m, fqn: asked.append(fqn) or m.in_features)
    assert asked == ["out_proj"]
