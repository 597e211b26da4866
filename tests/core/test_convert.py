import warnings

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Linear, convert_to_fp8, fp8_modules


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


def test_converts_in_place_and_shares_parameters():
    model = Block()
    up_weight = model.up.weight
    with pytest.warns(UserWarning, match=r"left 1 linear layer.*odd \(32->10\)"):
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
