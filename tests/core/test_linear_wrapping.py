"""What ``FP8Linear.from_linear`` refuses and carries over (as ``convert_to_fp8`` does), and an FP8Linear
reparametrized after the conversion, which its forward refuses."""

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize, prune

from lightning_fp8 import FP8AdamW, FP8Linear, convert_to_fp8
from tests.numerics import FORWARD_SQNR_DB, sqnr


class LoRALinear(nn.Linear):
    """An nn.Linear subclass adding parameters and its own forward: an FP8Linear would drop both."""

    def __init__(self, in_features: int, out_features: int, rank: int = 4):
        super().__init__(in_features, out_features)
        self.lora_a = nn.Parameter(torch.randn(rank, in_features))
        self.lora_b = nn.Parameter(torch.randn(out_features, rank))

    def forward(self, x):
        return super().forward(x) + x @ self.lora_a.t() @ self.lora_b.t()


class TaggedLinear(nn.Linear):
    """A subclass that adds nothing: left out all the same (convert_to_fp8 cannot tell)."""


def _buffer_weight() -> nn.Linear:
    layer = nn.Linear(32, 32)
    weight = layer.weight.detach().clone()
    del layer.weight
    layer.register_buffer("weight", weight)  # a frozen base weight
    return layer


def _no_weight(deleted: bool) -> nn.Linear:
    layer = nn.Linear(32, 32)
    if deleted:
        del layer.weight
    else:
        layer.weight = None
    return layer


def _hook_weight_norm(layer: nn.Linear) -> nn.Linear:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # nn.utils.weight_norm's deprecation
        return nn.utils.weight_norm(layer)


REFUSED = {  # kind: (build the layer, its type's name, the reason's words)
    "parametrizations.weight_norm": (
        lambda: parametrizations.weight_norm(nn.Linear(32, 32)),
        "ParametrizedLinear",
        "computed from other parameters",
    ),
    "nn.utils.weight_norm": (lambda: _hook_weight_norm(nn.Linear(32, 32)), "Linear", "computed from other parameters"),
    "lora subclass": (lambda: LoRALinear(32, 32), "LoRALinear", "subclasses of nn.Linear"),
    "bare subclass": (lambda: TaggedLinear(32, 32), "TaggedLinear", "subclasses of nn.Linear"),
    "buffer weight": (_buffer_weight, "Linear", r"not an nn.Parameter.*nn.Parameter\(tensor, requires_grad=False\)"),
    # Found by session 68's review of the sweeps' left-overs: both raised a raw AttributeError (the weight's dtype was
    # read before the reasons); convert_to_fp8 left such layers already.
    "weight None": (lambda: _no_weight(deleted=False), "Linear", "not an nn.Parameter"),
    "weight deleted": (lambda: _no_weight(deleted=True), "Linear", "not an nn.Parameter"),
}


@pytest.mark.parametrize("kind", REFUSED)
def test_from_linear_refuses_what_it_would_drop(kind):
    make, name, reason = REFUSED[kind]
    layer = make()
    params = dict(layer.named_parameters())
    match = rf"FP8Linear.from_linear: {name}\(in_features=32, out_features=32\) cannot become an FP8Linear; .*{reason}"
    with pytest.raises(ValueError, match=match):
        FP8Linear.from_linear(layer)
    assert dict(layer.named_parameters()) == params


def test_from_linear_refuses_a_non_linear():
    with pytest.raises(TypeError, match="takes an nn.Linear, got Conv1d"):
        FP8Linear.from_linear(nn.Conv1d(32, 32, 1))


def test_from_linear_and_from_modules_refuse_a_float64_weight_and_take_a_float64_bias():
    # As FP8Linear(dtype=torch.float64) does: every forward would refuse the weight (convert_to_fp8 leaves the layer).
    # A float64 bias is cast to the output dtype by the forward: such a layer wraps and runs, as it did.
    from lightning_fp8 import FP8MLP

    layer = nn.Linear(32, 32)
    layer.weight.data = layer.weight.data.double()
    with pytest.raises(TypeError, match=r"FP8Linear.from_linear: Linear\(in_features=32.* has a torch.float64 weight"):
        FP8Linear.from_linear(layer)
    with pytest.raises(TypeError, match=r"FP8MLP.from_modules \(proj\): .* has a torch.float64 weight"):
        FP8MLP.from_modules(nn.Linear(32, 32), layer)
    assert layer.weight.dtype == torch.float64
    torch.manual_seed(0)
    plain = nn.Linear(32, 32)
    plain.bias.data = plain.bias.data.double()
    wrapped = FP8Linear.from_linear(plain)
    x = torch.randn(4, 32)
    y = wrapped(x)
    reference = x @ plain.weight.t() + plain.bias.float()
    assert y.dtype == torch.float32 and sqnr(y, reference) > FORWARD_SQNR_DB


def test_from_linear_carries_the_hooks_over():
    torch.manual_seed(0)
    layer = nn.Linear(32, 32)
    log = []
    handles = [
        layer.register_forward_pre_hook(lambda m, args: (args[0] * 2,)),
        layer.register_full_backward_hook(lambda m, grad_in, grad_out: log.append(type(m).__name__)),
    ]
    fp8 = FP8Linear.from_linear(layer)
    x = torch.randn(8, 32, requires_grad=True)
    y = fp8(x)
    assert sqnr(y, layer(x)) > FORWARD_SQNR_DB  # both double the input
    log.clear()
    y.sum().backward()
    assert log == ["FP8Linear"]
    for handle in handles:  # the handles remove the hooks from the FP8 layer too
        handle.remove()
    assert sqnr(fp8(x), nn.functional.linear(x, layer.weight, layer.bias)) > FORWARD_SQNR_DB


AFTER_CONVERSION = {
    "parametrize": lambda layer: parametrize.register_parametrization(layer, "weight", _Half()),
    "parametrizations.weight_norm": parametrizations.weight_norm,
    "parametrizations.spectral_norm": parametrizations.spectral_norm,
    "nn.utils.weight_norm": _hook_weight_norm,
    "pruning": lambda layer: prune.l1_unstructured(layer, "weight", amount=0.3),
}


class _Half(nn.Module):
    def forward(self, w):
        return 0.5 * w


REPARAMETRIZED_AFTER = r"FP8Linear\(in_features=32, out_features=64\) was reparametrized after the conversion.*filter"


@pytest.mark.parametrize("kind", AFTER_CONVERSION)
def test_forward_refuses_a_reparametrization_after_conversion(kind):
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))
    model[0] = AFTER_CONVERSION[kind](model[0])
    with pytest.raises(RuntimeError, match=REPARAMETRIZED_AFTER):
        model(torch.randn(8, 32))


def test_parametrized_after_conversion_at_o2_raises_instead_of_computing_garbage():
    """The FP8-weight marker stays on the parameter the weight is computed from: FP8AdamW (O2) kept its scaled fp16
    master there, and the layer computed its weight from the scaled storage (no error, garbage output). Now
    FP8AdamW refuses such a layer, a reparametrization of a weight the optimizer holds as a master (O2) is refused
    as it is put (session 68), and a layer reparametrized otherwise (at O1) refuses its forward."""
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))
    parametrize.register_parametrization(model[0], "weight", _Half())
    with pytest.raises(ValueError, match="reparametrized after the conversion"):
        FP8AdamW(model.parameters(), lr=0.0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))
    FP8AdamW(model.parameters(), lr=0.0)
    with pytest.raises(ValueError, match=r"cannot be reparametrized .*release_weights"):
        parametrize.register_parametrization(model[0], "weight", _Half())
    assert not parametrize.is_parametrized(model[0])
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)), "fp8-lm-o1")
    FP8AdamW(model.parameters(), lr=0.0, recipe="fp8-lm-o1")
    parametrize.register_parametrization(model[0], "weight", _Half())
    with pytest.raises(RuntimeError, match=REPARAMETRIZED_AFTER), torch.no_grad():
        model(torch.randn(8, 32))


def test_from_linear_of_an_fp8_linear_says_it_is_one_already():
    """It was refused as a subclass of nn.Linear (a LoRA layer...), a reason that does not apply."""
    layer = FP8Linear(32, 16)
    with pytest.raises(ValueError, match=r"FP8Linear\(in_features=32, out_features=16\) is already an FP8Linear; use"):
        FP8Linear.from_linear(layer)
    assert convert_to_fp8(layer) is layer  # what convert_to_fp8 does with one


@pytest.mark.parametrize("how", ["from_linear", "convert_to_fp8"])
def test_a_bias_less_layer_keeps_bias_registered_as_nn_linear_does(how):
    # bias was set as a plain attribute (None): assigning a tensor then was accepted silently, added by the forward
    # but missing from state_dict() and parameters() and left behind by .to(); nn.Linear refuses it.
    plain = nn.Linear(32, 16, bias=False)
    layer = FP8Linear.from_linear(plain) if how == "from_linear" else convert_to_fp8(nn.Sequential(plain))[0]
    assert "bias" in layer._parameters and layer.bias is None
    for module in (plain, layer):
        with pytest.raises(TypeError, match="cannot assign"):
            module.bias = torch.zeros(16)
    layer.bias = nn.Parameter(torch.ones(16))  # as on nn.Linear: a parameter, in the state dict
    assert "bias" in layer.state_dict() and any(p is layer.bias for p in layer.parameters())


def test_from_linear_of_a_parametrized_layer_refuses_without_computing_its_weight():
    # Reading a ParametrizedLinear's weight runs the parametrization; the refusal must not need it.
    layer = parametrizations.weight_norm(nn.Linear(32, 32))
    calls = []
    parametrize.register_parametrization(layer, "weight", _Counted(calls))
    calls.clear()  # registering ran it once, to check its output
    with pytest.raises(ValueError, match="cannot become an FP8Linear"):
        FP8Linear.from_linear(layer)
    assert calls == []


class _Counted(nn.Module):
    def __init__(self, calls: list) -> None:
        super().__init__()
        self.calls = calls

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        self.calls.append(1)
        return weight
