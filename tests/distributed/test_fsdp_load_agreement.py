"""FP8AdamW.load_state_dict under FSDP2 when one rank's part of a state dict is bad: every rank checks its own shards,
and the ranks agree before any loads. Before, the rank holding the bad rows refused while the other loaded its shard
and then died in the next collective (a gloo connection error), its optimizer half-loaded."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from tests.distributed.launch import run_workers

pytestmark = pytest.mark.slow


def _build():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_fp8 import FP8AdamW, convert_to_fp8
    from lightning_fp8.distributed import enable_fp8_fsdp2

    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48)))
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))  # CPU also where CUDA is
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    enable_fp8_fsdp2(model)
    return model, FP8AdamW(model.parameters(), lr=1e-2, exp_avg_dtype=torch.float16)  # gloo gathers no FP8


def _steps(model, opt, rank, n):
    for i in range(n):
        gen = torch.Generator().manual_seed(100 * rank + i)
        nn.functional.mse_loss(model(torch.randn(6, 32, generator=gen)), torch.randn(6, 48, generator=gen)).backward()
        opt.step()
        opt.zero_grad()


def _local_states(opt):
    return [
        {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in state.items()}
        for state in opt.state.values()
    ]


def _worker(rank: int, world: int) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    full = StateDictOptions(full_state_dict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = _build()
        _steps(model, opt, rank, 2)
        model_sd, optim_sd = get_state_dict(model, opt, options=full)
        optim_sd = copy.deepcopy(optim_sd)
        optim_sd["state"]["2.weight"]["exp_avg"][40, 0] = float("nan")  # rows 24-47 of 48: rank 1's shard
        restored, restored_opt = _build()
        _steps(restored, restored_opt, rank, 1)
        before = _local_states(restored_opt)
        try:
            set_state_dict(restored, restored_opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=full)
            error = None
        except ValueError as caught:
            error = str(caught)
        after = _local_states(restored_opt)
        unchanged = len(before) == len(after) and all(
            b.keys() == a.keys() and all(torch.equal(b[k], a[k]) for k in b) for b, a in zip(before, after, strict=True)
        )
        # The ranks go on together: a collective after the refusal completes (it hung or failed before).
        _steps(restored, restored_opt, rank, 1)
    return {"error": error, "unchanged": unchanged}


def test_a_bad_shard_on_one_rank_is_refused_on_every_rank():
    reports = run_workers(_worker, 2)
    assert "holds inf or NaN" in (reports[1]["error"] or ""), reports[1]
    assert "another rank refused its part" in (reports[0]["error"] or ""), reports[0]
    assert all(report["unchanged"] for report in reports), reports
