"""FP8AdamW.load_state_dict: everything is checked before anything is loaded (a bad checkpoint, in its states or its
group settings, raises a ValueError that says what is wrong and changes nothing), and the per-row scales of a sharded
run's full state dict load into an unsharded model by value."""

import copy
import io

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, convert_to_fp8
from lightning_fp8.optim import checkpoint, master


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48)))


def _trained(seed: int = 0, **kwargs) -> tuple[nn.Module, FP8AdamW]:
    model = _model(seed)
    opt = FP8AdamW(model.parameters(), lr=1e-2, **kwargs)
    for _ in range(2):
        (model(torch.randn(8, 32)) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _saved(**kwargs) -> dict:
    buf = io.BytesIO()
    torch.save(_trained(**kwargs)[1].state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _snapshot(model: nn.Module, opt: FP8AdamW) -> dict:
    """Everything a load could change: raw parameter storage, adopted masters' scales, every state, the groups."""
    out = {f"param {i}": p.detach().clone() for i, p in enumerate(model.parameters())}
    for i, p in enumerate(model.parameters()):
        if master.master_scale(p) is not None:
            out[f"master scale {i}"] = master.master_scale(p).clone()
            out[f"master amax {i}"] = getattr(p, master.AMAX_ATTR).clone()
        for key, value in opt.state[p].items():
            out[f"state {i} {key}"] = torch.as_tensor(value).clone()
    out["groups"] = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    return out


def _assert_unchanged(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        if isinstance(value, torch.Tensor):  # FP8 has no equality kernel on CPU: compare the bytes
            assert torch.equal(value.reshape(-1).view(torch.uint8), after[key].reshape(-1).view(torch.uint8)), key
        else:
            assert value == after[key], key


def _per_rank(value: torch.Tensor) -> torch.Tensor:
    """A 0-dim scale as a full state dict of FSDP2 on 2 ranks held it before per-row scales: one per rank."""
    return torch.stack([value, value * 2])


def _filled(value: torch.Tensor, what: str) -> torch.Tensor:
    return torch.full(value.shape, float(what)).to(value.dtype)


# Parameter 2 is the second layer's weight (FP8, adopted master): the first two parameters load first, so a check that
# came late would have changed them. Parameter 0 is the first layer's weight.
CORRUPTIONS = {
    "scale_per_rank": (2, lambda s: s.update(master_scale=_per_rank(s["master_scale"])), "one number per rank"),
    "moment_scale_per_rank": (0, lambda s: s.update(exp_avg_scale=_per_rank(s["exp_avg_scale"])), "as many ranks"),
    "amax_shape": (2, lambda s: s.update(exp_avg_sq_amax=torch.ones(3)), r"has shape \(3,\)"),
    # A state a non-finite step wrote records a non-finite amax: the message says the run had diverged.
    "amax_nan": (2, lambda s: s.update(exp_avg_amax=torch.tensor(float("nan"))), "not finite and >= 0: the run had di"),
    "amax_negative": (2, lambda s: s.update(exp_avg_amax=torch.tensor(-1.0)), r">= 0: the checkpoint is"),
    "master_int": (2, lambda s: s.update(master=s["master"].to(torch.int16)), "not a floating-point tensor"),
    "transposed": (2, lambda s: s.update(exp_avg_sq=s["exp_avg_sq"].t().contiguous()), r"has shape \(64, 48\)"),
    "moment_missing": (2, lambda s: s.pop("exp_avg_sq"), r"without \['exp_avg_sq'\]"),
    "step_vector": (0, lambda s: s.update(step=torch.tensor([1.0, 2.0])), "step is"),
    "scale_string": (2, lambda s: s.update(exp_avg_scale="1.0"), "not a floating-point tensor"),
    # (the value checks raised NotImplementedError on it)
    "moment_sparse": (3, lambda s: s.update(exp_avg=s["exp_avg"].to_sparse()), "sparse_coo tensor; optimizer states"),
    "master_sparse": (2, lambda s: s.update(master=s["master"].float().to_sparse()), "sparse_coo tensor; optimizer st"),
    # The fp16 storage of an adopted master is weight * scale: without the scale it would load as 2**k times the weight.
    "master_without_scale": (2, lambda s: [s.pop("master_scale"), s.pop("master_amax")], "without its 'master_scale'"),
    "moment_nan": (2, lambda s: s.update(exp_avg=_filled(s["exp_avg"], "nan")), "holds inf or NaN"),
    "master_inf": (2, lambda s: s.update(master=_filled(s["master"], "inf")), "holds inf or NaN"),
    "fp32_moment_nan": (3, lambda s: s.update(exp_avg=_filled(s["exp_avg"], "nan")), "holds inf or NaN"),
    "second_moment_negative": (2, lambda s: s.update(exp_avg_sq=-s["exp_avg_sq"] - 1), "holds negative values"),
    "fp32_second_moment_negative": (3, lambda s: s.update(exp_avg_sq=-s["exp_avg_sq"] - 1), "holds negative values"),
    # The one-pass scale update bounds the next values from the amax: an understated one saturates the next step.
    "amax_zero": (2, lambda s: s.update(exp_avg_amax=torch.zeros(())), "'exp_avg_amax' is below the largest value"),
    "master_amax_understated": (2, lambda s: s.update(master_amax=s["master_amax"] / 4), "'master_amax' is below"),
    "fp8_fnuz": (2, lambda s: s.update(exp_avg=s["exp_avg"].float().to(torch.float8_e4m3fnuz)), "does not store"),
    "fp8_e5m2fnuz": (2, lambda s: s.update(exp_avg=s["exp_avg"].float().to(torch.float8_e5m2fnuz)), "does not store"),
    "unscaled_with_scale": (
        2,
        lambda s: s.update(exp_avg_sq=checkpoint.dequantize(s, "exp_avg_sq"), exp_avg_sq_scale=torch.tensor(4.0)),
        "stores unscaled",
    ),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_bad_state_raises_and_changes_nothing(case):
    index, change, match = CORRUPTIONS[case]
    saved = _saved()
    bad = copy.deepcopy(saved)
    change(bad["state"][index])
    model, opt = _trained(seed=1)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=match):
        opt.check_state_dict(bad)  # what load_state_dict raises, without loading
    with pytest.raises(ValueError, match=match) as error:
        opt.load_state_dict(bad)
    assert f"parameter {index}" in str(error.value)
    _assert_unchanged(before, _snapshot(model, opt))
    opt.check_state_dict(saved)
    opt.load_state_dict(saved)  # the intact checkpoint loads
    (model(torch.randn(8, 32)) ** 2).mean().backward()
    opt.step()


GROUP_CORRUPTIONS = {
    "lr_nan": ("lr", float("nan"), "Invalid learning rate: nan"),
    "lr_inf": ("lr", float("inf"), "Invalid learning rate: inf"),
    "weight_decay_inf": ("weight_decay", float("inf"), "Invalid weight_decay value: inf"),
    "betas_out_of_range": ("betas", (1.5, 2.0), "Invalid beta parameter at index 0: 1.5"),
    "eps_string": ("eps", "x", "eps must be a number"),
}


@pytest.mark.parametrize("case", list(GROUP_CORRUPTIONS))
def test_bad_group_setting_raises_and_changes_nothing(case):
    name, value, match = GROUP_CORRUPTIONS[case]
    bad = _saved()
    bad["param_groups"][0][name] = value
    model, opt = _trained(seed=1)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=match) as error:
        opt.load_state_dict(bad)
    assert "parameter group 0" in str(error.value) and "param_groups'][0]" in str(error.value)
    _assert_unchanged(before, _snapshot(model, opt))


def test_groups_of_other_sizes_are_refused_before_anything_changes():
    saved = _saved()
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48)))
    opt = FP8AdamW([{"params": list(model.parameters())[:2]}, {"params": list(model.parameters())[2:]}], lr=1e-2)
    with pytest.raises(ValueError, match=r"parameter groups hold \[4\] parameters, this optimizer's \[2, 2\]"):
        opt.check_state_dict(saved)
    with pytest.raises(ValueError, match="another grouping of its parameters"):
        opt.load_state_dict(saved)


@pytest.mark.parametrize("case", ["string_keys", "extra_index"])
def test_states_no_group_lists_are_refused(case):
    """States under keys the groups do not list would be dropped: keys made strings by a JSON round trip (every
    parameter would restart its moments), or an index past the parameters."""
    saved = _saved()
    bad = copy.deepcopy(saved)
    if case == "string_keys":
        bad["state"] = {str(k): v for k, v in bad["state"].items()}
    else:
        bad["state"][99] = bad["state"][0]
    model, opt = _trained(seed=1)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match="which no parameter group lists") as error:
        opt.load_state_dict(bad)
    assert ("'0'" if case == "string_keys" else "99") in str(error.value)
    _assert_unchanged(before, _snapshot(model, opt))


def test_an_understated_amax_deleted_is_measured_on_loading():
    """What the refusal of an understated amax says to do: without the amax, the values load and it is measured."""
    saved = _saved()
    del saved["state"][2]["exp_avg_amax"]
    model, opt = _trained(seed=1)
    opt.load_state_dict(saved)
    state = opt.state[list(model.parameters())[2]]
    assert torch.equal(state["exp_avg"].view(torch.uint8), saved["state"][2]["exp_avg"].view(torch.uint8))
    assert torch.equal(state["exp_avg_amax"], checkpoint.dequantize(state, "exp_avg").abs().max())


@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16])
def test_an_unscaled_master_loads_without_a_scale(master_dtype):
    """Only scaled (fp16, FP8) masters need their scale: an fp32 or bf16 master without one is the weight itself."""
    saved = _saved()
    state = saved["state"][2]
    want = checkpoint.dequantize(state, "master")
    state["master"] = want.to(master_dtype)
    del state["master_scale"], state["master_amax"]
    model, opt = _trained(seed=1)
    opt.load_state_dict(saved)
    got = master.export(list(model.parameters())[2]).float()
    torch.testing.assert_close(got, want, rtol=2**-7 if master_dtype == torch.bfloat16 else 2**-10, atol=0)


def test_an_unscaled_master_with_a_scale_other_than_1_is_refused():
    """A bf16 master (adopted) is stored unscaled with scale 1; its forward would divide by another scale."""
    saved = _saved(master_dtype=torch.bfloat16)
    assert saved["state"][2]["master"].dtype == torch.bfloat16
    model, opt = _trained(seed=1, master_dtype=torch.bfloat16)
    opt.load_state_dict(copy.deepcopy(saved))  # scale 1: loads
    saved["state"][2]["master_scale"] = torch.tensor(4.0)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match="'master_scale' is 4.0 for a torch.bfloat16 state"):
        opt.load_state_dict(saved)
    _assert_unchanged(before, _snapshot(model, opt))


def test_a_state_dict_that_is_not_one_says_so():
    model, opt = _trained()
    with pytest.raises(ValueError, match="expects a dict with 'state' and 'param_groups'"):
        opt.load_state_dict(model.state_dict())


def _per_row(saved: dict, index: int, halve: bool) -> dict:
    """``saved`` with parameter ``index``'s scales and amaxes one per row, as the full state dict of a run whose
    parameter was sharded on rows holds them; with ``halve``, the second half of the rows (a second shard) is stored
    with half the scale (its stored values halved: what that shard would hold with a smaller scale)."""
    out = copy.deepcopy(saved)
    state = out["state"][index]
    rows = state["exp_avg"].shape[0]
    for key in ("master", "exp_avg", "exp_avg_sq"):
        scale = state[f"{key}_scale"].expand(rows, 1).clone()
        state[f"{key}_amax"] = state[f"{key}_amax"].expand(rows, 1).clone()
        if halve:
            scale[rows // 2 :] /= 2
            stored = state[key].float()
            stored[rows // 2 :] /= 2
            state[key] = stored.to(state[key].dtype)
        state[f"{key}_scale"] = scale
    return out


@pytest.mark.parametrize("halve", [False, True], ids=["one_scale", "two_scales"])
def test_per_row_scales_of_a_sharded_run_load_by_value(halve):
    saved = _saved()
    index = 2  # the second layer's weight: FP8 first moment, fp16 second moment and master (adopted)
    rows = _per_row(saved, index, halve)
    model, opt = _trained(seed=1)
    opt.load_state_dict(rows)
    p = list(model.parameters())[index]
    state = {**opt.state[p], "master": p.detach()}
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert state[f"{key}_scale"].dim() == 0, "in memory, one 0-dim scale per tensor"
        want = checkpoint.dequantize(rows["state"][index], key)  # stored / scale, row by row
        got = checkpoint.dequantize(state, key)
        if not halve:  # one scale after all: the saved bits, as from a 0-dim scale
            assert torch.equal(state[key].view(torch.uint8), saved["state"][index][key].view(torch.uint8)), key
        stored, scale, _ = checkpoint.quantize(want, state[key].dtype)
        assert torch.equal(got, want) or torch.equal(got, stored.float() / scale), key
    (model(torch.randn(8, 32)) ** 2).mean().backward()
    opt.step()
    assert all(torch.isfinite(t).all() for t in (p, state["exp_avg_sq"].float()))
