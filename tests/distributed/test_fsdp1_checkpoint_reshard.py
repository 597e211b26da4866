"""FP8AdamW (O2) under FSDP1 with ``use_orig_params=True``: a full state dict saved on 2 ranks loads on 3 and on 1.

torch gathers each original parameter's states from the ranks' parts of its flat parameter; FP8AdamW exports them as
fp32 values (``lightning_fp8.optim.checkpoint.fsdp1_by_value``), so the saved whole tensors do not depend on the
ranks that wrote them. On another number of ranks every moment keeps its saved value, and so does every master: an
fp32 model's FP8 weights take theirs from the loaded weights (the state has none), a bf16 model's are in the state.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests.distributed.launch import run_workers

pytestmark = pytest.mark.slow


def _build(dtype: torch.dtype) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from lightning_fp8 import FP8AdamW, convert_to_fp8
    from lightning_fp8.distributed import enable_fp8_fsdp1

    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 16))
    model = FSDP(convert_to_fp8(layers).to(dtype), device_id=torch.device("cpu"), use_orig_params=True)
    enable_fp8_fsdp1(model)
    return model, FP8AdamW(model.parameters(), lr=3e-3, opt_level="O2")


def _steps(model: nn.Module, opt: torch.optim.Optimizer, rank: int, dtype: torch.dtype, n: int) -> list[float]:
    generator, losses = torch.Generator().manual_seed(rank), []
    for _ in range(n):
        loss = model(torch.randn(8, 32, generator=generator).to(dtype)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))


def _save(rank: int, world: int, directory: str, dtype: torch.dtype) -> dict:
    model, opt = _build(dtype)
    _steps(model, opt, rank, dtype, 3)
    model_sd, optim_sd = _full(model, opt)
    if rank == 0:
        torch.save({"model": model_sd, "optim": optim_sd}, os.path.join(directory, f"{dtype}.pt"))
    weight = optim_sd["state"]["0.weight"]
    return {"weight_states": sorted((key, str(value.dtype)) for key, value in weight.items() if value.dim())}


def _load(rank: int, world: int, directory: str, dtype: torch.dtype) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    saved = torch.load(os.path.join(directory, f"{dtype}.pt"), weights_only=True)
    model, opt = _build(dtype)
    options = StateDictOptions(full_state_dict=True)
    set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"], options=options)
    _, optim_sd = _full(model, opt)
    moments_equal = all(
        torch.equal(optim_sd["state"][name][key], state[key])
        for name, state in saved["optim"]["state"].items()
        for key in ("exp_avg", "exp_avg_sq", "master")
        if key in state
    )
    # A step at a tiny lr writes every weight from its master (lr 0 leaves the weights alone): a master not taken from
    # the loaded weight (the state has none for an fp32 model) would put the freshly built model's weights back.
    for group in opt.param_groups:
        group["lr"] = 1e-9
    _steps(model, opt, rank, dtype, 1)
    model_sd, _ = _full(model, opt)
    tolerance = {"rtol": 2**-10, "atol": 1e-8} if dtype == torch.float32 else {"rtol": 0, "atol": 0}  # fp16 masters
    weights_kept = all(torch.allclose(model_sd[name], value, **tolerance) for name, value in saved["model"].items())
    for group in opt.param_groups:
        group["lr"] = 3e-3
    return {"moments_equal": moments_equal, "weights_kept": weights_kept, "losses": _steps(model, opt, rank, dtype, 3)}


def _unsharded_into_fsdp1(rank: int, world: int, directory: str) -> str:
    """A DCP checkpoint of an unsharded O2 run (scaled states, their scales beside them) read into FSDP1's template:
    DCP reads into the template's fp32 values and its scales (1) from the checkpoint's. Read as values, the first
    moments would have been 2**17 times too large: refused."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from lightning_fp8 import FP8AdamW, convert_to_fp8

    torch.manual_seed(0)
    plain = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 16)))
    plain_opt = FP8AdamW(plain.parameters(), lr=3e-3, opt_level="O2")
    _steps(plain, plain_opt, rank, torch.float32, 3)
    model_sd, optim_sd = get_state_dict(plain, plain_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(directory, "unsharded"))
    model, opt = _build(torch.float32)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=os.path.join(directory, "unsharded"))
    try:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except ValueError as error:
        return str(error)
    return "loaded"


def _into_plain_model(rank: int, world: int, directory: str) -> dict:
    """The 2-rank fp32 full state dict into a model FSDP1 does not wrap. torch's set_state_dict copies each saved
    tensor into this optimizer's own (E4M3/fp16) states, without their scales: refused, saying what loads it;
    optimizer.load_state_dict does (the states' names map by position, as torch.optim's do)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from lightning_fp8 import FP8AdamW, convert_to_fp8
    from lightning_fp8.optim.checkpoint import dequantize

    saved = torch.load(os.path.join(directory, f"{torch.float32}.pt"), weights_only=True)

    def build() -> tuple[nn.Module, FP8AdamW]:
        torch.manual_seed(0)
        layers = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 16))
        model = convert_to_fp8(layers)
        return model, FP8AdamW(model.parameters(), lr=3e-3, opt_level="O2")

    model, opt = build()
    try:
        options = StateDictOptions(full_state_dict=True)
        set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"], options=options)
        error = None
    except ValueError as caught:
        error = str(caught)
    model, opt = build()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    names = [name for name, _ in model.named_parameters()]
    moments_equal = all(
        torch.equal(dequantize(opt.state[p], key), saved["optim"]["state"][name][key])
        for name, p in zip(names, model.parameters(), strict=True)
        for key in ("exp_avg", "exp_avg_sq")
    )
    return {"error": error, "moments_equal": moments_equal, "losses": _steps(model, opt, 0, torch.float32, 3)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    directory = str(tmp_path_factory.mktemp("fsdp1_reshard"))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        out[dtype] = {"saved": run_workers(_save, 2, directory, dtype)}
        out[dtype].update({world: run_workers(_load, world, directory, dtype) for world in (3, 1)})
    out["unsharded_into_fsdp1"] = run_workers(_unsharded_into_fsdp1, 1, directory)[0]
    out["into_plain"] = run_workers(_into_plain_model, 1, directory)[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [3, 1])
def test_fsdp1_o2_full_state_dict_loads_on_another_number_of_ranks(runs, dtype, world):
    saved = runs[dtype]["saved"][0]["weight_states"]
    # By value, in fp32; the fp32 weights hold their masters' values (no master saved), a bf16 model's are saved.
    master = [("master", "torch.float32")] if dtype == torch.bfloat16 else []
    assert saved == sorted([("exp_avg", "torch.float32"), ("exp_avg_sq", "torch.float32"), *master])
    for report in runs[dtype][world]:
        assert report["moments_equal"], report
        assert report["weights_kept"], report
        assert all(torch.isfinite(torch.tensor(report["losses"]))), report


def test_scaled_checkpoint_read_into_fsdp1_fp32_template_is_refused(runs):
    assert "was read into this optimizer's fp32 ones" in runs["unsharded_into_fsdp1"]


def test_fsdp1_full_state_dict_into_a_plain_model_loads_through_load_state_dict(runs):
    report = runs["into_plain"]
    assert "hand such a full state dict to optimizer.load_state_dict" in report["error"]
    assert report["moments_equal"] and all(torch.isfinite(torch.tensor(report["losses"]))), report
