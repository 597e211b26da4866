"""FP8AdamW.load_state_dict against torch.optim.AdamW's: the load_state_dict hooks run as torch runs them (the
pre-hooks on the whole state dict, which they may replace, before FP8AdamW checks it; the post-hooks once everything
is loaded), and a torch.optim.AdamW state dict of an fp16 model (fp16 moments, no scales) loads as its values."""

import copy
import io

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, convert_to_fp8

OPTIMIZERS = {
    "torch_adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "fp8_adamw_o2": lambda params: FP8AdamW(params, lr=1e-2),
    "fp8_adamw_o1": lambda params: FP8AdamW(params, lr=1e-2, opt_level="O1"),
}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.LayerNorm(48), nn.Linear(48, 16)))


def _trained(name: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(seed)
    opt = OPTIMIZERS[name](model.parameters())
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        opt.zero_grad()
        (model(torch.randn(8, 32, generator=gen)) ** 2).mean().backward()
        opt.step()
    return model, opt


def _hooked(opt: torch.optim.Optimizer, seen: dict) -> None:
    """A migration hook before the load (it resets the first moments in a copy it returns) and a hook after it."""

    def pre(optimizer, state_dict):
        seen["pre: states"] = len(state_dict["state"])
        state_dict = copy.deepcopy(state_dict)
        for state in state_dict["state"].values():
            state["exp_avg"] = torch.zeros_like(state["exp_avg"])
        return state_dict

    def post(optimizer):
        seen["post: states"] = len(optimizer.state)
        # FP8 has no comparison kernel on CPU: compare the bytes of the zeros
        seen["post: exp_avg zero"] = all(
            not s["exp_avg"].reshape(-1).view(torch.uint8).any() for s in optimizer.state.values()
        )

    opt.register_load_state_dict_pre_hook(pre)
    opt.register_load_state_dict_post_hook(post)


@pytest.mark.parametrize("name", ["fp8_adamw_o2", "fp8_adamw_o1"])
def test_load_hooks_see_and_replace_the_state_dict_as_torch_adamw_hooks_do(name):
    records = {}
    for which in ("torch_adamw", name):
        saved = _trained(which)[1].state_dict()
        _, opt = _trained(which, seed=1)
        records[which] = {}
        _hooked(opt, records[which])
        opt.load_state_dict(saved)
        assert all(not s["exp_avg"].reshape(-1).view(torch.uint8).any() for s in opt.state.values())
    assert records[name] == records["torch_adamw"] == {"pre: states": 6, "post: states": 6, "post: exp_avg zero": True}


@pytest.mark.parametrize("name", ["torch_adamw", "fp8_adamw_o2"])
def test_a_pre_hook_repairs_a_state_dict_before_it_is_checked(name):
    """A state dict through JSON has string keys, which FP8AdamW refuses: a pre-hook that turns them back into
    integers runs before that check, in load_state_dict and check_state_dict alike; the caller's dict stays as it was
    (the hooks get a shallow copy)."""
    saved = _trained(name)[1].state_dict()
    stringly = {**saved, "state": {str(k): v for k, v in saved["state"].items()}}
    model, opt = _trained(name, seed=1)

    def repair(optimizer, state_dict):
        state_dict["state"] = {int(k): v for k, v in state_dict["state"].items()}

    if isinstance(opt, FP8AdamW):
        with pytest.raises(ValueError, match="which no parameter group lists"):
            opt.check_state_dict(stringly)
    opt.register_load_state_dict_pre_hook(repair)
    if isinstance(opt, FP8AdamW):
        opt.check_state_dict(stringly)
    opt.load_state_dict(stringly)
    assert list(stringly["state"]) == ["0", "1", "2", "3", "4", "5"]
    for index, p in enumerate(model.parameters()):
        assert torch.equal(opt.state[p]["step"], saved["state"][index]["step"])


def _fp16_adamw_state_dict() -> dict:
    """torch.optim.AdamW's state dict, through torch.save and torch.load, of an fp16 model: fp16 moments, no scale."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.LayerNorm(48), nn.Linear(48, 16)).half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 32).half()).float().square().mean().backward()
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert {saved["state"][0][key].dtype for key in ("exp_avg", "exp_avg_sq")} == {torch.float16}
    return saved


def _as_fp32(saved: dict) -> dict:
    """The same state dict with fp32 moments (what torch.optim.AdamW of an fp32 model saves), which loads already."""
    state = {i: {k: v.float() if k != "step" else v for k, v in s.items()} for i, s in saved["state"].items()}
    return {**saved, "state": state}


@pytest.mark.parametrize("opt_level", ["O2", "O1"])
@pytest.mark.parametrize("model_dtype", [torch.float16, torch.float32], ids=["fp16_model", "fp32_model"])
def test_a_torch_adamw_state_dict_with_fp16_moments_loads_as_their_values(opt_level, model_dtype):
    """The fp16 moments load as the fp32 moments of the same values do (scale 1), bit for bit, and the next steps are
    the same; the FP8 weights' moments are stored with fresh scales in FP8AdamW's dtypes at O2."""
    saved = _fp16_adamw_state_dict()
    runs = []
    for state_dict in (saved, _as_fp32(saved)):
        model = _model(seed=1).to(model_dtype)
        opt = FP8AdamW(model.parameters(), lr=1e-3, eps=1e-4, opt_level=opt_level)
        opt.check_state_dict(state_dict)
        opt.load_state_dict(state_dict)
        gen = torch.Generator().manual_seed(2)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 32, generator=gen).to(model_dtype)).float().square().mean().backward()
            opt.step()
        runs.append((model, opt))
    (model, opt), (want_model, want_opt) = runs
    for p, q in zip(model.parameters(), want_model.parameters(), strict=True):
        assert torch.equal(p, q)
        for key, value in want_opt.state[q].items():  # FP8 has no equality kernel on CPU: compare the bytes
            assert torch.equal(opt.state[p][key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8))


def test_fp16_moments_without_scales_in_a_state_of_fp8adamw_stay_refused():
    """A state with FP8AdamW's own keys (a master, scales, amaxes) that lacks a moment's scale is corrupt: its fp16
    moment holds value * scale, not the value."""
    model, opt = _trained("fp8_adamw_o2")
    saved = copy.deepcopy(opt.state_dict())
    for key in ("exp_avg_sq_scale", "exp_avg_sq_amax"):
        saved["state"][0].pop(key)
    assert saved["state"][0]["exp_avg_sq"].dtype == torch.float16 and "master" in saved["state"][0]
    with pytest.raises(ValueError, match="without its 'exp_avg_sq_scale'.*FP8AdamW's, not torch.optim.AdamW's"):
        opt.check_state_dict(saved)
    with pytest.raises(ValueError, match="without its 'exp_avg_sq_scale'"):
        opt.load_state_dict(saved)
    # FP8 moments without a scale: not torch.optim.AdamW's either
    adamw_keys_only = {0: {k: saved["state"][0][k] for k in ("step", "exp_avg", "exp_avg_sq")}}
    with pytest.raises(ValueError, match="without its 'exp_avg_scale'.*torch.optim.AdamW keeps no FP8 moments"):
        opt.load_state_dict({**saved, "state": adamw_keys_only})


@pytest.mark.parametrize("other", ["sgd", "rmsprop"])
def test_another_optimizers_state_dict_is_refused_as_such_and_nothing_changes(other):
    # SGD's groups have no betas or eps (RMSprop's no betas): refused as another optimizer's state, not with a
    # complaint about one hyper-parameter, and the FP8AdamW keeps its own state and groups.
    model, opt = _trained("fp8_adamw_o2")
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "rmsprop": lambda p: torch.optim.RMSprop(p)}
    foreign = make[other](_model(1).parameters())
    (_model(1)(torch.randn(4, 32)) ** 2).mean().backward()
    before = io.BytesIO()
    torch.save(opt.state_dict(), before)
    with pytest.raises(ValueError, match="not the state of an AdamW"):
        opt.load_state_dict(foreign.state_dict())
    after = io.BytesIO()
    torch.save(opt.state_dict(), after)
    assert before.getvalue() == after.getvalue()
