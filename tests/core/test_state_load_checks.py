"""load_fp8_state_dict's refusals of inputs it cannot load (meta tensors, bool counters, a list or non-string keys),
and check_fp8_state_dict, which raises the same and changes nothing; FP8AdamW.load_state_dict's refusal of a step that
is not a number of steps."""

import copy

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, convert_to_fp8, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.state import check_fp8_state_dict
from tests.numerics import assert_same


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48)))
    model(torch.randn(8, 32)).square().mean().backward()
    return model


def _unchanged(model: nn.Module, before: dict) -> bool:
    after = fp8_state_dict(model)
    return after.keys() == before.keys() and all(torch.equal(v, after[k]) for k, v in before.items())


def test_a_model_on_the_meta_device_is_refused_clearly():
    # Comparing the settings copied meta tensors to the CPU: a raw NotImplementedError.
    with torch.device("meta"):
        model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48)))
    with pytest.raises(ValueError, match="on the meta device .* materialize the model first"):
        load_fp8_state_dict(model, fp8_state_dict(_model(0)))


def test_a_state_loaded_onto_the_meta_device_is_refused_clearly():
    saved = {key: value.to("meta") for key, value in fp8_state_dict(_model(0)).items()}
    model = _model(1)
    before = fp8_state_dict(model)
    with pytest.raises(ValueError, match="on the meta device .* map_location='cpu'"):
        load_fp8_state_dict(model, saved)
    assert _unchanged(model, before)


@pytest.mark.parametrize(("corrupt", "match"), [
    (lambda sd: {**sd, "0.fp8_scaling.input.casts": torch.tensor(True)}, "is a torch.bool tensor"),
    (lambda sd: list(sd.values()), "is a list, not a dict"),
    (lambda sd: {**sd, 3: torch.tensor(1.0)}, r"keys that are not strings \[3\]"),
], ids=["bool counter", "list", "int key"])  # fmt: skip
def test_inputs_that_are_not_a_state_dict_are_refused_and_change_nothing(corrupt, match):
    saved, model = fp8_state_dict(_model(0)), _model(1)
    before = fp8_state_dict(model)
    with pytest.raises(TypeError, match=match):
        load_fp8_state_dict(model, corrupt(saved))
    assert _unchanged(model, before)


@pytest.mark.parametrize(("key", "value"), [
    ("0.fp8_scaling.input.initialized", lambda v: torch.tensor(True)),
    ("0.fp8_scaling.input.margin", lambda v: torch.tensor(False)),
    ("0.fp8_scaling.input.delayed", lambda v: torch.tensor(True)),
    ("0.fp8_scaling.input.amax_history", lambda v: v.to_sparse()),
    ("0.fp8_scaling.input.amax_history", lambda v: v.reshape(1, -1).to_sparse_csr()),
    ("0.fp8_scaling.input.margin", lambda v: v.reshape(1).to_sparse()),
    ("0.fp8_scaling.input.initialized", lambda v: v.reshape(1).to_sparse()),
    ("0.fp8_scaling.input.amax_history", lambda v: torch.nested.nested_tensor([v], layout=torch.jagged)),
], ids=["bool initialized", "bool margin", "bool delayed", "sparse history", "sparse csr history", "sparse margin",
        "sparse initialized", "nested history"])  # fmt: skip
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
def test_bool_sparse_and_nested_values_are_refused_with_a_type_error(key, value):
    # Equal to what the model has (a bool True is 1, a sparse tensor holds the same numbers): only their kind is wrong.
    saved, model = fp8_state_dict(_model(0)), _model(1)
    before = fp8_state_dict(model)
    with pytest.raises(TypeError, match=f"FP8 scaling state '{key}' is a"):
        load_fp8_state_dict(model, {**saved, key: value(saved[key])})
    assert _unchanged(model, before)


def test_check_raises_what_load_raises_and_changes_nothing():
    saved, model = fp8_state_dict(_model(0)), _model(1)
    before = fp8_state_dict(model)
    check_fp8_state_dict(model, saved)  # a good state passes, and is not loaded
    assert _unchanged(model, before)
    bad = {**saved, "2.fp8_scaling.grad_output.scale": torch.tensor(3.0)}
    with pytest.raises(ValueError, match="must be a power of two"):
        check_fp8_state_dict(model, bad)
    # A layer about to be put back to nn.Linear: its states are not expected in the checkpoint.
    without_layer_2 = {key: value for key, value in saved.items() if not key.startswith("2.")}
    with pytest.raises(KeyError, match="missing"):
        check_fp8_state_dict(model, without_layer_2)
    check_fp8_state_dict(model, without_layer_2, leaving_out=[model[2]])
    assert _unchanged(model, before)


def _optimizer(seed: int) -> tuple[nn.Module, FP8AdamW]:
    model = _model(seed)
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    opt.step()
    return model, opt


@pytest.mark.parametrize(
    "step", [1.5, True, 1e30, -1, float("nan"), float("inf"), torch.tensor(2.0**24 + 2), torch.tensor(-3.0)]
)
def test_optimizer_load_refuses_a_step_that_is_no_count_of_steps_and_changes_nothing(step):
    """FP8AdamW.load_state_dict took a step of 1.5, True or 1e30 (any finite number >= 0): the bias correction then
    ran with a non-integer or absurd t. Refused before anything loads; its own and torch.optim.AdamW's steps load."""
    model, opt = _optimizer(0)
    saved = opt.state_dict()
    adamw = torch.optim.AdamW(_model(0).parameters())
    adamw.step()
    assert adamw.state_dict()["state"][0]["step"].dtype == torch.float32
    model, opt = _optimizer(1)
    before = copy.deepcopy((opt.state_dict(), model.state_dict()))
    bad = copy.deepcopy(saved)
    bad["state"][3]["step"] = step
    with pytest.raises(ValueError, match="parameter 3's step is .*not a whole number of steps from 0 to 2\\*\\*24"):
        opt.load_state_dict(bad)
    assert_same(copy.deepcopy((opt.state_dict(), model.state_dict())), before)
    opt.load_state_dict(saved)
    opt.load_state_dict(copy.deepcopy(adamw.state_dict()))
    assert float(opt.state[model[0].weight]["step"]) == 1.0


def test_an_initialized_flag_without_its_history_is_refused_and_changes_nothing():
    # strict=False with the flag alone: a fresh state told "use your history" would cast with scale 1 and saturate.
    from lightning_fp8 import FP8Linear

    torch.manual_seed(0)
    src = FP8Linear(32, 16)
    src(torch.randn(4, 32) * 1000)
    saved = fp8_state_dict(src)
    dst = FP8Linear(32, 16)
    before = fp8_state_dict(dst)
    for keep in (("input.initialized",), ("input.initialized", "input.scale"), ("input.initialized", "input.amax")):
        partial = {k: v for k, v in saved.items() if k.endswith(keep)}
        with pytest.raises(ValueError, match="'initialized' = 1 without its 'amax_history' and 'scale'"):
            load_fp8_state_dict(dst, partial, strict=False)
        assert all(torch.equal(v, before[k]) for k, v in fp8_state_dict(dst).items())
        assert not dst.fp8_scaling["input"].initialized
    # with its history and scale, or a flag of 0, the partial load goes through
    load_fp8_state_dict(dst, {k: v for k, v in saved.items() if ".input." in k}, strict=False)
    assert dst.fp8_scaling["input"].initialized
    assert torch.equal(dst.fp8_scaling["input"].scale, src.fp8_scaling["input"].scale)
    load_fp8_state_dict(FP8Linear(32, 16), {"fp8_scaling.input.initialized": torch.tensor(0)}, strict=False)


def test_a_state_saved_through_a_wrapper_loads_into_the_plain_model_and_back():
    # fp8_state_dict of DDP(model) or torch.compile(model) names the states "module.0..." / "_orig_mod.0...": strict,
    # the load failed with a "same layers and recipe?" KeyError; strict=False loaded nothing, without a word.
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16)))
    for _ in range(3):
        model(torch.randn(8, 32)).sum().backward()
    wrapped = nn.Module()
    wrapped.module = nn.Module()
    wrapped.module._orig_mod = model  # the names DDP(torch.compile(model)) gives
    saved = fp8_state_dict(wrapped)
    assert next(iter(saved)).startswith("module._orig_mod.0.fp8_scaling")
    for strict in (True, False):
        fresh = convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16)))
        load_fp8_state_dict(fresh, saved, strict=strict)
        assert_same(fp8_state_dict(fresh), fp8_state_dict(model))
    back = copy.deepcopy(wrapped)
    for state in back.modules():
        if hasattr(state, "amax_history"):
            state.amax_history.zero_()
    load_fp8_state_dict(back, fp8_state_dict(model))
    assert_same(fp8_state_dict(back), saved)


@pytest.mark.parametrize("strict", ["no", None, 0, 1])
def test_a_strict_that_is_not_a_bool_is_refused_and_changes_nothing(strict):
    # Found by a sweep: strict was taken for its truth value, so strict="no" checked every key and strict=None skipped
    # the key checks, silently.
    saved, model = fp8_state_dict(_model(0)), _model(1)
    before = fp8_state_dict(model)
    with pytest.raises(TypeError, match=rf"load_fp8_state_dict\(strict={strict!r}\): must be True or False"):
        load_fp8_state_dict(model, saved, strict=strict)
    with pytest.raises(TypeError, match="must be True or False"):
        check_fp8_state_dict(model, saved, strict=strict)
    assert _unchanged(model, before)


def test_arguments_that_are_not_a_model_are_refused_clearly():
    # Found by a sweep: a raw AttributeError ("'dict' object has no attribute 'named_modules'"), e.g. for the two
    # arguments swapped.
    model = _model(0)
    saved, before = fp8_state_dict(model), fp8_state_dict(model)
    with pytest.raises(TypeError, match=r"load_fp8_state_dict takes the model .* got dict: call load_fp8_state_dict"):
        load_fp8_state_dict(saved, model)
    with pytest.raises(TypeError, match=r"fp8_state_dict takes the model .* got str"):
        fp8_state_dict("model")
    assert _unchanged(model, before)


def test_a_scale_of_another_shape_is_called_corrupt_not_another_history_length():
    # Found by a sweep: every shape mismatch suggested "amax_history_len differs?", also for a scale of shape (1,).
    model = _model(1)
    saved, before = fp8_state_dict(_model(0)), fp8_state_dict(model)
    saved["0.fp8_scaling.input.scale"] = saved["0.fp8_scaling.input.scale"].reshape(1)
    with pytest.raises(ValueError, match=r"shape \(1,\) in the checkpoint but \(\) in the model \(the checkpoint is"):
        load_fp8_state_dict(model, saved)
    saved = fp8_state_dict(_model(0))
    saved["0.fp8_scaling.input.amax_history"] = saved["0.fp8_scaling.input.amax_history"][:8]
    with pytest.raises(ValueError, match=r"\(amax_history_len differs\?\)"):
        load_fp8_state_dict(model, saved)
    assert _unchanged(model, before)
