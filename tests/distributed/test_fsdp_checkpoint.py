"""FP8AdamW (O2) checkpoints of FSDP2 shards loaded on another number of ranks, and into an unsharded model.

Each rank's shard of a state has its own scale; the state dict spreads those scales over the sharded dimension (one
per row), so that torch.distributed.checkpoint and full state dicts reshard them with the states. A rank whose new
shard gathers rows of two saved shards must re-express them with one scale: its loaded state is the saved value
requantized (``checkpoint.quantize``), a rank whose rows all come from one saved shard gets the saved bits.

Three spawns: training and saving on 2 ranks; loading on 3 ranks (uneven shards: 64 rows as 22 + 22 + 20) and on 1;
and an unsharded run's full state dict loaded on the 3 ranks.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.launch import cpu_mesh, run_workers

pytestmark = pytest.mark.slow

SAVED_WORLD = 2
STEPS = 3
LR = 1e-2
# O2 with its E4M3 first moment (gloo moves no FP8, so only the sharded, DCP, checkpoint can hold it), and with an
# fp16 one, which the full state dict gathers on gloo. low_precision_moments="all": 1-D parameters (the norm, biases)
# get scaled moments too, with one scale per element of their sharded dimension.
CONFIGS = {
    "e4m3": {"low_precision_moments": "all"},
    "fp16": {"low_precision_moments": "fp8_weights", "exp_avg_dtype": torch.float16},
}


def _build(config: str, sharded: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    from lightning_fp8 import FP8AdamW, convert_to_fp8
    from lightning_fp8.distributed import enable_fp8_fsdp2

    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 48)))
    with torch.no_grad():  # the second saved shard's rows 3 binades larger: its master's scale differs from the first's
        model[0].weight[32:] *= 8
    if sharded:
        fully_shard(model[0], mesh=cpu_mesh())
        fully_shard(model[3], mesh=cpu_mesh())
        fully_shard(model, mesh=cpu_mesh())
        enable_fp8_fsdp2(model)
    return model, FP8AdamW(model.parameters(), lr=LR, **CONFIGS[config])


def _steps(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, first: int, n: int) -> list[float]:
    """The same global batch of 12 rows at any world size (1, 2, 3), split evenly over the ranks: FSDP2's mean of the
    ranks' gradients is the whole batch's. Returns the whole batch's losses."""
    losses = []
    for step in range(first, first + n):
        gen = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(12, 32, generator=gen), torch.randn(12, 48, generator=gen)
        rows = slice(rank * 12 // world, (rank + 1) * 12 // world)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def _state(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """``opt.state[p]``, with the master of an adopted weight (the parameter's own storage) as ``"master"``."""
    state = opt.state[p]
    return {**state, "master": p.detach()} if "master_scale" in state and "master" not in state else state


def _values(opt: torch.optim.Optimizer, model: nn.Module) -> dict[tuple[str, str], torch.Tensor]:
    """Every scaled state of every parameter, dequantized to fp32, whole (gathered from the shards)."""
    from lightning_fp8.optim import checkpoint

    out = {}
    for name, p in model.named_parameters():
        state = _state(opt, p)
        for key in ("master", "exp_avg", "exp_avg_sq"):
            if f"{key}_scale" in state:
                value = checkpoint.dequantize(state, key)
                out[(name, key)] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return out


def _save(rank: int, world: int, directory: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    out = {}
    for config in CONFIGS:
        model, opt = _build(config)
        _steps(model, opt, rank, world, 0, STEPS)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(directory, config))
        values = _values(opt, model)
        try:
            full = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            out[f"{config}_full_error"] = None
        except RuntimeError as error:  # gloo has no FP8 all-gather (torch's code, not ours)
            full, out[f"{config}_full_error"] = None, str(error)
        if rank == 0:
            torch.save({"values": values, "full": full}, os.path.join(directory, f"{config}.pt"))
        out[f"{config}_continued"] = _steps(model, opt, rank, world, STEPS, 2)
    return out


def _compare(opt: torch.optim.Optimizer, model: nn.Module, expected: dict, saved_states: dict) -> dict:
    """Per state: "exact" (the saved values), "requantized" (the saved values in one fresh scale), else "wrong"; and
    the states whose rows on this rank were saved with different scales (``saved_states``: the whole state dict)."""
    from torch.distributed.tensor import distribute_tensor

    from lightning_fp8.optim import checkpoint

    def mine(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:  # this rank's rows of the saved whole
        return distribute_tensor(whole, p.device_mesh, p.placements).to_local() if hasattr(p, "device_mesh") else whole

    out, mixed = {}, []
    for name, p in model.named_parameters():
        state = _state(opt, p)
        for key in ("master", "exp_avg", "exp_avg_sq"):
            if (name, key) not in expected:
                continue
            want = mine(p, expected[(name, key)])
            saved_scale = saved_states[name][f"{key}_scale"]
            saved_scale = saved_scale.full_tensor() if hasattr(saved_scale, "full_tensor") else saved_scale
            if saved_scale.dim() and mine(p, saved_scale).unique().numel() > 1:  # (an unsharded run's: 0-dim)
                mixed.append(f"{name}.{key}")
            got = checkpoint.dequantize(state, key)
            got = got.to_local() if hasattr(got, "to_local") else got
            stored, scale, _ = checkpoint.quantize(want, state[key].dtype)
            if torch.equal(got, want):
                verdict = "exact"
            elif torch.equal(got, stored.float() / scale):
                verdict = "requantized"
            else:
                verdict = f"wrong: max diff {float((got - want).abs().max())}"
            assert state[f"{key}_scale"].dim() == 0, "in memory, each shard keeps one 0-dim scale"
            out[f"{name}.{key}"] = verdict
    return {"states": out, "mixed": mixed}


def _guarded(fn, *args) -> dict:
    try:
        return {"ok": True, **fn(*args)}
    except Exception:
        return {"ok": False, "error": traceback.format_exc()[-3000:]}


def _from_sharded(rank: int, world: int, directory: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _build("e4m3")
    model_sd, optim_sd = get_state_dict(model, opt)  # the template DCP loads into
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=os.path.join(directory, "e4m3"))
    loaded = dict(state["optim"]["state"])  # before set_state_dict, which consumes it
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    expected = torch.load(os.path.join(directory, "e4m3.pt"), weights_only=True)["values"]
    return {**_compare(opt, model, expected, loaded), "resumed": _steps(model, opt, rank, world, STEPS, 2)}


def _from_full(rank: int, world: int, directory: str, broadcast: bool) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    saved = torch.load(os.path.join(directory, "fp16.pt"), weights_only=True)
    model, opt = _build("fp16")
    model_sd, optim_sd = saved["full"]
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    saved_states = torch.load(os.path.join(directory, "fp16.pt"), weights_only=True)["full"][1]["state"]
    return {**_compare(opt, model, saved["values"], saved_states), "resumed": _steps(model, opt, rank, world, STEPS, 2)}


def _save_unsharded(directory: str) -> list[float]:
    """In this process, no process group: the same model trained unsharded (one 0-dim scale per state), its full state
    dict saved; returns the losses of its continuation."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, opt = _build("fp16", sharded=False)
    _steps(model, opt, 0, 1, 0, STEPS)
    full = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    torch.save({"values": _values(opt, model), "full": full}, os.path.join(directory, "unsharded.pt"))
    return _steps(model, opt, 0, 1, STEPS, 2)


def _from_unsharded_full(rank: int, world: int, directory: str) -> dict:
    """An unsharded run's full state dict (0-dim scales) into the sharded model: each shard takes the one scale."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    saved = torch.load(os.path.join(directory, "unsharded.pt"), weights_only=True)
    model, opt = _build("fp16")
    model_sd, optim_sd = saved["full"]
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(full_state_dict=True))  # fmt: skip
    saved_states = torch.load(os.path.join(directory, "unsharded.pt"), weights_only=True)["full"][1]["state"]
    return {**_compare(opt, model, saved["values"], saved_states), "resumed": _steps(model, opt, rank, world, STEPS, 2)}


def _per_rank_scales_refused(rank: int, world: int, directory: str) -> dict:
    """A full state dict with one scale per saved rank (the layout before per-row scales) at another world size:
    every rank raises the same ValueError (none is left waiting in a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model_sd, optim_sd = torch.load(os.path.join(directory, "fp16.pt"), weights_only=True)["full"]
    for state in optim_sd["state"].values():
        for key, value in list(state.items()):
            if key.endswith(("_scale", "_amax")) and value.dim() == 2:  # (rows, 1): rank r held rows [r*n, (r+1)*n)
                state[key] = value.reshape(SAVED_WORLD, -1)[:, 0].clone()
    model, opt = _build("fp16")
    try:
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=StateDictOptions(full_state_dict=True))  # fmt: skip
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def _into_plain_model(rank: int, world: int, directory: str) -> dict:
    """The full state dict of the sharded run loads into the same model unsharded, with FP8AdamW's own load."""
    saved = torch.load(os.path.join(directory, "fp16.pt"), weights_only=True)
    model, opt = _build("fp16", sharded=False)
    model_sd, optim_sd = saved["full"]
    model.load_state_dict(model_sd)
    names = [name for name, _ in model.named_parameters()]
    opt.load_state_dict({
        "state": {names.index(name): state for name, state in optim_sd["state"].items()},
        "param_groups": [{**g, "params": [names.index(n) for n in g["params"]]} for g in optim_sd["param_groups"]],
    })  # fmt: skip
    saved_states = torch.load(os.path.join(directory, "fp16.pt"), weights_only=True)["full"][1]["state"]
    return {**_compare(opt, model, saved["values"], saved_states), "resumed": _steps(model, opt, 0, 1, STEPS, 2)}


def _load(rank: int, world: int, directory: str) -> dict:
    out = {
        "sharded": _guarded(_from_sharded, rank, world, directory),
        "full_broadcast": _guarded(_from_full, rank, world, directory, True),
        "full": _guarded(_from_full, rank, world, directory, False),
    }
    if world == 1:
        out["plain"] = _guarded(_into_plain_model, rank, world, directory)
    else:
        out["per_rank_scales"] = _guarded(_per_rank_scales_refused, rank, world, directory)
        out["from_unsharded"] = _guarded(_from_unsharded_full, rank, world, directory)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    directory = str(tmp_path_factory.mktemp("fsdp_reshard"))
    saved = run_workers(_save, SAVED_WORLD, directory)
    unsharded = _save_unsharded(directory)
    return {"saved": saved, "unsharded": unsharded, **{world: run_workers(_load, world, directory) for world in (3, 1)}}


def _ok(report: dict) -> dict:
    assert report["ok"], report.get("error")
    return report


@pytest.mark.parametrize("world", [3, 1])
@pytest.mark.parametrize("path", ["sharded", "full_broadcast", "full"])
def test_o2_states_reshard_to_another_number_of_ranks(runs, world, path):
    config = "e4m3" if path == "sharded" else "fp16"
    mixed = []
    for rank, report in enumerate(runs[world]):
        states = _ok(report[path])["states"]
        assert states and all(v in ("exact", "requantized") for v in states.values()), (rank, states)
        mixed += [(rank, key) for key in report[path]["mixed"]]
        # Training goes on from there: the same global batches as the saving run's continuation, whose FP8 scales
        # of activations differ (another split of the batch over ranks): the same losses to a few percent.
        continued = runs["saved"][0][f"{config}_continued"]
        assert report[path]["resumed"] == pytest.approx(continued, rel=0.05), (rank, report[path]["resumed"])
    # Vacuous unless some rank holds rows saved with different scales (64 rows as 22 + 22 + 20 from 32 + 32: rank 1).
    assert mixed, "no rank mixed rows of differently scaled saved shards"


def test_full_state_dict_of_sharded_run_loads_into_unsharded_model(runs):
    states = _ok(runs[1][0]["plain"])["states"]
    assert states and all(v in ("exact", "requantized") for v in states.values()), states
    assert runs[1][0]["plain"]["resumed"] == pytest.approx(runs["saved"][0]["fp16_continued"], rel=0.05)


def test_full_state_dict_of_unsharded_run_loads_into_sharded_model(runs):
    """One process's checkpoint continued on 3 ranks (uneven shards): every state holds the saved bits."""
    for rank, report in enumerate(runs[3]):
        states = _ok(report["from_unsharded"])["states"]
        assert states and all(v == "exact" for v in states.values()), (rank, states)
        assert report["from_unsharded"]["resumed"] == pytest.approx(runs["unsharded"], rel=0.05), rank


def test_per_rank_scales_at_another_world_size_fail_on_every_rank(runs):
    for rank, report in enumerate(runs[3]):
        error = _ok(report["per_rank_scales"])["error"]
        assert error is not None and "sharded" in error and "as many ranks" in error, (rank, error)


@pytest.mark.xfail(
    strict=True,
    reason="gloo has no FP8 collectives: torch.distributed.checkpoint.state_dict's full state dict all-gathers (and "
    "broadcast_from_rank0 broadcasts) the E4M3 first moment and fails in torch ('Invalid scalar type'). Sharded (DCP) "
    "checkpoints, which reshard, or NCCL, or exp_avg_dtype=torch.float16 avoid it (docs/guides/checkpoints.md)",
)
def test_full_state_dict_with_fp8_states_on_gloo(runs):
    for report in runs["saved"]:
        assert report["e4m3_full_error"] is None, report["e4m3_full_error"]
