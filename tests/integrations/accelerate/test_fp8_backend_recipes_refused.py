"""A recipe of one of Accelerate's own FP8 backends (``AORecipeKwargs``, ``TERecipeKwargs``) in
``Accelerator(kwargs_handlers=...)`` under FP8-LM: refused before Accelerate sets anything up, naming the handler and
what to do. Accelerate itself refuses such a recipe without ``mixed_precision="fp8"`` except under FSDP and DeepSpeed
(accelerate/accelerator.py), so under FSDP2 with FP8-LM the recipe was taken and its settings ignored without a word.
The handlers are built without their ``__post_init__``, which needs torchao / Transformer Engine installed."""

import pytest
from accelerate.utils import AORecipeKwargs, TERecipeKwargs

from lightning_fp8.accelerate import Accelerator
from tests.integrations.accelerate.test_accelerator import _fresh_accelerate_state  # noqa: F401 (autouse fixture)


@pytest.mark.parametrize("handler", [AORecipeKwargs, TERecipeKwargs])
def test_an_fp8_backend_recipe_is_refused_with_fp8_lm(handler):
    with pytest.raises(ValueError, match=rf"{handler.__name__} configures one of Accelerate's own FP8 backends") as e:
        Accelerator(cpu=True, fp8_lm_recipe="fp8-lm", kwargs_handlers=[handler.__new__(handler)])
    assert "Drop it" in str(e.value) and "=none and mixed_precision='fp8'" in str(e.value)
