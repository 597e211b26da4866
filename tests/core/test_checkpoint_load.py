"""FP8AdamW.load_state_dict: everything is checked before anything is loaded (a bad checkpoint raises a ValueError
that says what is wrong and changes nothing), and the per-row scales of a sharded run's full state dict load into an
unsharded model by value."""

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


# Parameter 2 is the second layer's weight (FP8, adopted master): the first two parameters load first, so a check that
# came late would have changed them. Parameter 0 is the first layer's weight.
CORRUPTIONS = {
    "scale_per_rank": (2, lambda s: s.update(master_scale=_per_rank(s["master_scale"])), "one number per rank"),
    "moment_scale_per_rank": (0, lambda s: s.update(exp_avg_scale=_per_rank(s["exp_avg_scale"])), "as many ranks"),
    "amax_shape": (2, lambda s: s.update(exp_avg_sq_amax=torch.ones(3)), r"has shape \(3,\)"),
    "amax_nan": (2, lambda s: s.update(exp_avg_amax=torch.tensor(float("nan"))), "not finite and >= 0"),
    "master_int": (2, lambda s: s.update(master=s["master"].to(torch.int16)), "not a floating-point tensor"),
    "transposed": (2, lambda s: s.update(exp_avg_sq=s["exp_avg_sq"].t().contiguous()), r"has shape \(64, 48\)"),
    "moment_missing": (2, lambda s: s.pop("exp_avg_sq"), r"without \['exp_avg_sq'\]"),
    "step_vector": (0, lambda s: s.update(step=torch.tensor([1.0, 2.0])), "step is"),
    "scale_string": (2, lambda s: s.update(exp_avg_scale="1.0"), "not a floating-point tensor"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_bad_state_raises_and_changes_nothing(case):
    index, change, match = CORRUPTIONS[case]
    saved = _saved()
    bad = copy.deepcopy(saved)
    change(bad["state"][index])
    model, opt = _trained(seed=1)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=match) as error:
        opt.load_state_dict(bad)
    assert f"parameter {index}" in str(error.value)
    _assert_unchanged(before, _snapshot(model, opt))
    opt.load_state_dict(saved)  # the intact checkpoint loads
    (model(torch.randn(8, 32)) ** 2).mean().backward()
    opt.step()


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
