"""FP8Recipe values that a mutation audit of the core layer found unpinned, against the documentation: the named
recipes' fields as docs/concepts/formats.md and the recipe's docstring give them (``"fp8-lm-e4m3"`` is
``fp8_format="e4m3"``, E4M3 gradients too; ``"fp8-lm"`` uses the ``"max"`` of a 16-step window), and the margin's
documented range, 0 to ``MAX_MARGIN`` inclusive (a bound of ``margin >= MAX_MARGIN`` passed the suite)."""

import pytest
import torch

from lightning_fp8 import FP8Recipe
from lightning_fp8.recipe import MAX_MARGIN
from lightning_fp8.scaling import ScalingState


def test_the_e4m3_recipe_casts_gradients_in_e4m3_and_differs_from_fp8_lm_only_there():
    r = FP8Recipe.from_name("fp8-lm-e4m3")
    assert r.fp8_format == "e4m3"
    assert r.backward_dtype == torch.float8_e4m3fn and r.forward_dtype == torch.float8_e4m3fn
    assert r.replace(fp8_format="hybrid") == FP8Recipe()
    assert not r.same_scaling("fp8-lm")


def test_the_default_recipe_takes_the_max_of_a_16_step_delayed_window():
    r = FP8Recipe.from_name("fp8-lm")
    assert (r.scaling, r.amax_history_len, r.amax_compute_algo, r.margin) == ("delayed", 16, "max", 0)
    assert r.backward_dtype == torch.float8_e5m2


def test_margin_takes_every_value_up_to_max_margin_and_refuses_the_next():
    assert MAX_MARGIN == 16  # the recipe's docstring: 0 to MAX_MARGIN; E4M3 spans about 18 binades
    for margin in (0, 1, MAX_MARGIN - 1, MAX_MARGIN):
        assert FP8Recipe(margin=margin).margin == margin
        assert ScalingState(torch.float8_e4m3fn, 16, margin, "max", True).margin == margin
    with pytest.raises(ValueError, match=rf"margin={MAX_MARGIN + 1}\) must be <= {MAX_MARGIN}"):
        FP8Recipe(margin=MAX_MARGIN + 1)
    with pytest.raises(ValueError, match=rf"margin={MAX_MARGIN + 1}"):
        ScalingState(torch.float8_e4m3fn, 16, MAX_MARGIN + 1, "max", True)
