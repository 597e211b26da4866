"""What a mutation audit of weight_marks.py found unpinned: the FP8-weight marker of a weight two FP8 layers share.
LayerMark's rule ("true while an FP8Linear holding it exists"; mark_weight: "a weight two FP8 layers share keeps both")
is the reference: with either layer gone, the other still holds the weight, and FP8AdamW at O2 adopts it (an fp16
master in its storage, as for any FP8 layer's weight); with both gone it is an ordinary parameter again."""

import gc

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8Linear
from lightning_fp8.optim import master


@pytest.mark.parametrize("dropped", ["first", "second"])
def test_a_shared_weight_stays_marked_while_one_of_its_fp8_layers_lives(dropped):
    torch.manual_seed(0)
    linear = nn.Linear(32, 32)
    layers = [FP8Linear.from_linear(linear), FP8Linear.from_linear(linear)]
    assert layers[0].weight is layers[1].weight is linear.weight
    kept = layers.pop(1 if dropped == "first" else 0)
    layers.clear()
    gc.collect()
    assert bool(getattr(linear.weight, master.MARKER))
    FP8AdamW(kept.parameters(), lr=1e-3)
    assert master.master_scale(kept.weight) is not None  # adopted: an FP8 layer holds it


def test_a_shared_weight_is_unmarked_once_both_layers_are_gone():
    linear = nn.Linear(32, 32)
    layers = [FP8Linear.from_linear(linear), FP8Linear.from_linear(linear)]
    layers.clear()
    gc.collect()
    assert not bool(getattr(linear.weight, master.MARKER))
    FP8AdamW(linear.parameters(), lr=1e-3)
    assert master.master_scale(linear.weight) is None and linear.weight.dtype == torch.float32
