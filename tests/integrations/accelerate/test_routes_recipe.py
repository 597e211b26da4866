"""A recipe whose strings come from NumPy goes through ``save_state`` / ``load_state`` as the same recipe written with
plain strings: the run continues exactly as the uninterrupted one."""

import numpy as np
import torch
from accelerate.state import AcceleratorState, GradientState
from torch import nn

from lightning_fp8 import FP8Recipe
from lightning_fp8.accelerate import Accelerator
from tests.integrations.accelerate.test_accelerator import _fresh_accelerate_state  # noqa: F401 (autouse fixture)


def _prepared(recipe: FP8Recipe, seed: int):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, fp8_lm_recipe=recipe)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(48, 80), nn.ReLU(), nn.Linear(80, 16))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return accelerator, model, optimizer


def _train(accelerator, model, optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, 48, generator=g), torch.randint(0, 16, (12,), generator=g)
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def test_a_recipe_of_numpy_strings_saves_and_loads_as_the_recipe_of_plain_strings(tmp_path):
    # The NumPy strings went into the FP8 state file pickled as NumPy objects: load_state (which reads it with
    # weights_only=True) refused the run's own checkpoint as unreadable.
    recipe = FP8Recipe(scaling=np.str_("current"), opt_level=np.str_("O1"))
    accelerator, model, optimizer = _prepared(recipe, seed=0)
    _train(accelerator, model, optimizer, range(2))
    accelerator.save_state(str(tmp_path / "ckpt"))
    state = torch.load(tmp_path / "ckpt" / "lightning_fp8" / "rank0.pt", weights_only=True)
    assert state["recipe"] == FP8Recipe(scaling="current", opt_level="O1").to_dict()
    _train(accelerator, model, optimizer, range(2, 4))
    uninterrupted = {key: value.clone() for key, value in model.state_dict().items()}

    accelerator, model, optimizer = _prepared(recipe, seed=1)
    accelerator.load_state(str(tmp_path / "ckpt"))
    _train(accelerator, model, optimizer, range(2, 4))
    assert all(torch.equal(value, uninterrupted[key]) for key, value in model.state_dict().items())
