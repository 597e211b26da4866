"""FP8LMPrecision's checkpoint state when it is corrupt: the error says it comes from the checkpoint, and nothing
changes."""

import pytest

from tests.integrations.lightning.test_precision_state_loads import _saved_state, assert_refused_unchanged


@pytest.mark.parametrize(
    ("recipe", "error"),
    [
        ("fp8-lm", TypeError),  # a name, not to_dict()'s mapping
        (None, TypeError),
        ({"margin": -1}, ValueError),
        ({"fp8_format": "e3m4"}, ValueError),
        ({"opt_level": "O2", "unknown_field": 1}, ValueError),
    ],
)
@pytest.mark.parametrize("hook", ["load_state_dict", "on_load_checkpoint"])
def test_a_corrupt_saved_recipe_names_the_checkpoint_and_changes_nothing(recipe, error, hook):
    # FP8Recipe's own message ("FP8Recipe(margin=-1) must be >= 0") named a setting the user never passed, and said
    # neither that it came from the checkpoint nor what to do.
    state = {**_saved_state(), "recipe": recipe}
    match = r"checkpoint's 'recipe' .* the checkpoint is corrupt\. Resume from an earlier"
    assert_refused_unchanged(state, hook, error, match)
