"""torch.export of trained FP8 models, and TorchScript's refusal.

torch.export (non-strict, torch's default) traces the forward with stand-ins for the parameters, which carry no Python
attributes: at O2 the stand-in of a weight FP8AdamW holds is its scaled fp16 storage, and the master scale that hangs on
the parameter was not seen: the exported program computed with weight * 2**17 (outputs ~1e5 times too large). The
reference: the same model run eagerly, and the unconverted model loaded with its state_dict (the weights themselves).
"""

import copy
import warnings

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8MLP, FP8AdamW, FP8Linear, convert_to_fp8
from tests.numerics import FORWARD_SQNR_DB, sqnr

# Two FP8 layers in a row (each about FP8's 25-30 dB; the O2 bug gave an output ~1e5 times too large: below -90 dB)
TWO_LAYERS_SQNR_DB = FORWARD_SQNR_DB - 5


def _plain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def _trained(opt_level: str, mlp: bool) -> tuple[nn.Module, nn.Module]:
    """(FP8 model after 3 FP8AdamW steps, the unconverted model with its weights)."""
    recipe = "fp8-lm" if opt_level == "O2" else "fp8-lm-o1"
    plain = _plain()
    if mlp:
        layers = copy.deepcopy(plain)  # from_modules shares the parameters: keep the unconverted ones apart
        model = nn.Sequential(FP8MLP.from_modules(layers[0], layers[2], recipe=recipe))
    else:
        model = convert_to_fp8(copy.deepcopy(plain), recipe=recipe)
    opt = FP8AdamW(model.parameters(), lr=1e-2, recipe=recipe)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        model(torch.randn(8, 32, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    weights = model.state_dict()  # the weights, unscaled (O2's storage is weight * master scale)
    plain.load_state_dict(weights if not mlp else {k.replace("0.fc.", "0.").replace("0.proj.", "2."): v
                                                   for k, v in weights.items()})  # fmt: skip
    return model.eval(), plain.eval()


@pytest.mark.parametrize("strict", [False, True], ids=["non_strict", "strict"])
@pytest.mark.parametrize("mlp", [False, True], ids=["linear", "fused_mlp"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_exported_trained_model_computes_as_the_eager_model(opt_level, mlp, strict):
    model, plain = _trained(opt_level, mlp)
    eager = copy.deepcopy(model)
    xs = [torch.randn(8, 32) * s for s in (1.0, 100.0, 0.01)]  # the delayed input scale moves between calls
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.export.export(copy.deepcopy(model), (xs[0],), strict=strict).module()
    with torch.no_grad():
        for i, x in enumerate(xs):
            want, got = eager(x), exported(x)
            assert torch.equal(got, want), (got - want).abs().max()
            if i == 0:  # independently: the weights themselves, in high precision, within FP8's error (the later
                # inputs saturate the delayed scale the first one left, in both models alike)
                assert sqnr(got, plain(x)) > TWO_LAYERS_SQNR_DB


def test_a_released_weight_exports_without_its_former_scale():
    """The layer's copy of the master scale goes with the master: a weight given back (FP8AdamW.release) exports as
    the plain weight it is again."""
    model, plain = _trained("O2", mlp=False)
    opt = FP8AdamW(model.parameters(), lr=1e-2)  # holds the masters (the first optimizer is gone: take them again)
    for layer in model.modules():
        if isinstance(layer, FP8Linear):
            opt.release(layer.weight)
    x = torch.randn(8, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.export.export(model, (x,)).module()
    with torch.no_grad():
        assert sqnr(exported(x), plain(x)) > TWO_LAYERS_SQNR_DB


@pytest.mark.parametrize("mlp", [False, True], ids=["linear", "fused_mlp"])
def test_torch_jit_trace_is_refused_saying_what_to_do(mlp):
    model, _ = _trained("O1", mlp)
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="cannot be traced by torch.jit.trace.*export"):
        warnings.simplefilter("ignore")
        torch.jit.trace(model, torch.randn(8, 32))


def test_a_weight_assigned_after_training_exports_without_the_old_weights_scale():
    """A new Parameter assigned as the weight of a layer whose former weight was an O2 master (Hugging Face's
    tie_weights() after conversion does this): the exported program divided it by the former weight's scale."""
    model, _ = _trained("O2", mlp=False)
    model[0].weight = nn.Parameter(torch.randn(64, 32) * 0.1)
    x = torch.randn(8, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.export.export(copy.deepcopy(model), (x,)).module()
    with torch.no_grad():
        assert torch.equal(exported(x), copy.deepcopy(model)(x))


def test_an_exported_program_saved_and_loaded_computes_the_same(tmp_path):
    """torch.export.save / load of an O2-trained model's program (loading needs lightning_fp8 imported: it registers
    the lightning_fp8 custom ops the program calls)."""
    model, _ = _trained("O2", mlp=True)
    x = torch.randn(8, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.save(torch.export.export(copy.deepcopy(model), (x,)), tmp_path / "model.pt2")
        loaded = torch.export.load(tmp_path / "model.pt2").module()
    with torch.no_grad():
        assert torch.equal(loaded(x), copy.deepcopy(model)(x))
