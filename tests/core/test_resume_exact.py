"""Resuming plain-PyTorch FP8 training from state dicts that are valid but unusual: they load as torch.optim.AdamW
loads them, and the resumed run continues as the saved one."""

import io

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8AdamW, FP8GradScaler, convert_to_fp8


def _round_trip(state: dict) -> dict:
    """``state`` through torch.save and torch.load(weights_only=True), as a checkpoint."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _build(seed: int) -> tuple[nn.Module, FP8AdamW]:
    torch.manual_seed(seed)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 48), nn.LayerNorm(48), nn.GELU(), nn.Linear(48, 16)))
    scaler = FP8GradScaler(model=model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    return model, FP8AdamW(groups, lr=1e-2, grad_scaler=scaler)


def _train(model: nn.Module, optimizer: FP8AdamW, steps: range) -> None:
    for i in steps:
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)
        optimizer.grad_scaler.scale_loss((model(x) - y).square().mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_parameter_groups_listing_their_indices_in_tuples_load_as_lists_do():
    # torch.optim.Optimizer.load_state_dict takes a group's "params" as any sequence of indices; FP8AdamW refused a
    # tuple, saying the groups held "[None, 4] parameters" where the optimizer's held [2, 4].
    saved_model, saved = _build(0)
    _train(saved_model, saved, range(3))
    checkpoint = _round_trip({"model": saved_model.state_dict(), "optimizer": saved.state_dict()})
    runs = []
    for tuples in (False, True):
        state = _round_trip(checkpoint)  # each its own tensors: a loaded state may keep them, as torch's does
        if tuples:
            groups = state["optimizer"]["param_groups"]
            state["optimizer"]["param_groups"] = [{**g, "params": tuple(g["params"])} for g in groups]
        model, optimizer = _build(1)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        _train(model, optimizer, range(3, 6))
        runs.append(model.state_dict())
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(value, runs[1][key]) for key, value in runs[0].items())


def test_a_torch_amp_grad_scaler_state_is_refused_saying_what_it_is_and_what_to_do():
    # A run moving from fp16 AMP to FP8 resumes its checkpoint: the KeyError asked "is this a scaler state dict?" of
    # a scaler's state dict, and said nothing of what to do.
    amp = torch.amp.GradScaler("cpu", init_scale=2.0**12).state_dict()
    scaler = FP8GradScaler(init_scale=4.0)
    before = scaler.state_dict()
    with pytest.raises(KeyError, match=r"torch\.amp\.GradScaler's state dict .* Leave it out .*init_scale="):
        scaler.load_state_dict(_round_trip(amp))
    with pytest.raises(KeyError, match=r"missing entries .* load the dict that FP8GradScaler\.state_dict\(\) returned"):
        scaler.load_state_dict({"scale": 8.0})
    assert scaler.state_dict() == before
