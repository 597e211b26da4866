"""put_back_to_high_precision (lightning_fp8/fallback_layers.py) behaviour that a mutation audit found unpinned: the
nn.Linear put in place of an FP8 layer keeps the layer's train/eval mode, as torch's own modules keep theirs when
moved (nn.Module.training is per module, and model.eval() set it on the FP8 layer)."""

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8Linear, convert_to_fp8
from lightning_fp8.recovery import put_back_to_high_precision


@pytest.mark.parametrize("training", [False, True])
def test_a_layer_put_back_keeps_its_train_or_eval_mode(training):
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)))
    model.train(training)
    assert put_back_to_high_precision(model, ["0"]) == ["0"]
    assert type(model[0]) is nn.Linear and isinstance(model[2], FP8Linear)
    assert model[0].training is training and all(m.training is training for m in model.modules())


def test_an_fp8adamw_created_after_the_put_back_steps_the_layer_as_a_plain_parameter():
    """The layer put back is an nn.Linear reading its weight as it is: an FP8AdamW (O2) created afterwards must not
    make the weight's storage its scaled fp16 master (the layer would compute with weight * scale). Reference:
    torch.nn.functional.linear on the weight's values before the optimizer was created."""
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)))
    fp8_layer = model[0]  # still referenced (by the caller, a callback's list of FP8 layers...)
    put_back_to_high_precision(model, ["0"])
    assert model[0] is not fp8_layer
    x = torch.randn(4, 32)
    weight, bias = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    FP8AdamW(model.parameters(), lr=1e-3, opt_level="O2")
    assert model[0].weight.dtype == torch.float32
    torch.testing.assert_close(model[0](x), nn.functional.linear(x, weight, bias), rtol=0, atol=0)
