"""FP8AdamW on sharded parameters: FSDP2 DTensor shards and FSDP1 flat parameters, with DCP checkpoints.

Each scenario runs in one 2-process spawn and reports its outcome; a scenario that raises reports the error, so
the others still run. What is known not to work yet is marked ``xfail(strict=True)``: fixing it flips the test.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.launch import cpu_mesh

pytest.importorskip("lightning_fp8.optim", reason="FP8AdamW (lightning_fp8/optim) is not in this tree")


def _model() -> nn.Module:
    from lightning_fp8 import convert_to_fp8

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 16)
    )
    return convert_to_fp8(model)


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    teacher = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(10 + rank))
    return x, torch.tanh(x @ teacher)


def _fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0], mesh=cpu_mesh())
    fully_shard(model[3], mesh=cpu_mesh())
    return fully_shard(model, mesh=cpu_mesh())


def _fsdp1(model: nn.Module, use_orig_params: bool) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(model, device_id=torch.device("cpu"), use_orig_params=use_orig_params)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, rank: int, n: int) -> list[float]:
    x, y = _data(rank)
    losses = []
    for _ in range(n):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _fp8_weights(model: nn.Module) -> list[torch.Tensor]:
    from lightning_fp8 import FP8Linear

    return [m.weight for m in model.modules() if isinstance(m, FP8Linear)]


def _fsdp2_o1_against_adamw(rank: int) -> dict:
    """O1 (fp32 states) on DTensor shards equals torch.optim.AdamW on the same shards; states are sharded."""
    from lightning_fp8 import FP8AdamW

    model = _fsdp2(_model())
    opt = FP8AdamW(model.parameters(), lr=3e-3, opt_level="O1", weight_decay=0.01)
    ref_model = _fsdp2(_model())
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=3e-3, weight_decay=0.01)
    losses, ref_losses = _steps(model, opt, rank, 5), _steps(ref_model, ref_opt, rank, 5)
    params_close = all(
        torch.allclose(p.full_tensor(), q.full_tensor(), rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True)
    )
    sharded_like_params = all(
        type(v).__name__ == "DTensor" and v.placements == p.placements and v.shape == p.shape
        for p in model.parameters()
        for k, v in opt.state[p].items()
        if k in ("exp_avg", "exp_avg_sq")
    )
    return {"losses": losses, "ref_losses": ref_losses, "params_close": params_close, "sharded": sharded_like_params}


def _fsdp2_dcp_round_trip(rank: int, directory: str) -> dict:
    """Sharded (DCP) and full (torch.save, weights_only load) checkpoints resume the same training exactly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from lightning_fp8 import FP8AdamW

    def build():
        model = _fsdp2(_model())
        return model, FP8AdamW(model.parameters(), lr=3e-3, opt_level="O1")

    model, opt = build()
    _steps(model, opt, rank, 3)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(directory, "sharded"))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    fmsd, fosd = get_state_dict(model, opt, options=full)
    if rank == 0:
        torch.save({"model": fmsd, "optim": fosd}, os.path.join(directory, "full.pt"))
    dist.barrier()
    continued = _steps(model, opt, rank, 2)

    model, opt = build()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=os.path.join(directory, "sharded"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    from_sharded = _steps(model, opt, rank, 2)

    model, opt = build()
    loaded = torch.load(os.path.join(directory, "full.pt"), weights_only=True)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"], options=options)
    from_full = _steps(model, opt, rank, 2)
    return {"continued": continued, "from_sharded": from_sharded, "from_full": from_full}


class _TiedLM(nn.Module):
    """A tiny language model: token embedding tied to the (high-precision) head, an MLP block of FP8 layers."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(40, 48)
        self.block = nn.Sequential(nn.Linear(48, 80), nn.GELU(), nn.Linear(80, 48))  # FP8 needs multiples of 16
        self.norm = nn.LayerNorm(48)
        self.lm_head = nn.Linear(48, 40, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.wte(tokens)
        return self.lm_head(self.norm(h + self.block(h)))


def _tied_lm_steps(model: nn.Module, opt: torch.optim.Optimizer, rank: int, n: int) -> list[float]:
    tokens = torch.randint(0, 40, (6, 9), generator=torch.Generator().manual_seed(20 + rank))
    losses = []
    for _ in range(n):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 40), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _local_states(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict[tuple[int, str], torch.Tensor]:
    return {
        (i, key): (value.to_local() if hasattr(value, "to_local") else value).detach().float().clone()
        for i, p in enumerate(params)
        for key, value in opt.state[p].items()
        if key != "step"
    }


def _fsdp2_o2_tied_dcp_round_trip(rank: int, directory: str, moments: str = "fp8_weights") -> dict:
    """O2 with a tied embedding/head (Accelerate's FSDP2 SHARDED_STATE_DICT path): get_optimizer_state_dict on a
    fresh optimizer is the template DCP loads into, so it must hold every parameter's states. ``moments="all"``:
    the embedding, norm and biases have low-precision moments too, with per-shard scales."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    from lightning_fp8 import FP8AdamW, convert_to_fp8

    def build():
        torch.manual_seed(0)
        model = convert_to_fp8(_TiedLM())
        fully_shard(model.block, mesh=cpu_mesh())
        fully_shard(model, mesh=cpu_mesh())
        opt = FP8AdamW(model.parameters(), lr=3e-3, fp8_params=_fp8_weights(model), low_precision_moments=moments)
        return model, opt

    def checked(model):  # the parameters whose states must come back: those with scales
        return list(model.parameters()) if moments == "all" else _fp8_weights(model)

    model, opt = build()
    _tied_lm_steps(model, opt, rank, 3)
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=directory)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}  # sharded, with the FP8 scaling state
    saved = _local_states(opt, checked(model))
    continued = _tied_lm_steps(model, opt, rank, 2)

    resumed, opt = build()
    resumed.load_state_dict(weights)  # real runs load the model checkpoint the same way
    template = {"optim": get_optimizer_state_dict(resumed, opt)}
    dcp.load(template, checkpoint_id=directory)
    set_optimizer_state_dict(resumed, opt, optim_state_dict=template["optim"])
    # The scales and amaxes are those of this rank's shard: every rank must get its own back.
    loaded = _local_states(opt, checked(resumed))
    return {
        "states_equal": loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved),
        "continued": continued,
        "resumed": _tied_lm_steps(resumed, opt, rank, 2),
        "fp8_states": [str(opt.state[p]["exp_avg"].dtype) for p in checked(resumed)],
        "template_keys": sorted(template["optim"]["state"]),
        "param_names": sorted(name for name, _ in resumed.named_parameters()),
    }


def _low_precision_run(rank: int, wrap: str) -> dict:
    """O2 (E4M3 first moment, fp16 second moment and master) under FSDP: trains like O1, states sharded."""
    from lightning_fp8 import FP8AdamW

    out = {}
    for level in ("O1", "O2"):
        model = _fsdp2(_model()) if wrap == "fsdp2" else _fsdp1(_model(), use_orig_params=(wrap == "fsdp1_orig"))
        # FSDP1 without orig params: the flat parameter is what the optimizer sees; FSDP2: the sharded weights.
        extra = list(model.parameters()) if wrap == "fsdp1_flat" else _fp8_weights(model)
        opt = FP8AdamW(model.parameters(), lr=3e-3, opt_level=level, fp8_params=extra)
        out[level] = _steps(model, opt, rank, 5)
        if level == "O2":
            states = [opt.state[p] for p in extra]
            out["exp_avg_dtypes"] = sorted({str(s["exp_avg"].dtype) for s in states if "exp_avg" in s})
            local = [p.to_local() if hasattr(p, "to_local") else p for p in extra]
            out["state_numels_match"] = all(
                (s["exp_avg"].to_local() if hasattr(s["exp_avg"], "to_local") else s["exp_avg"]).numel() == q.numel()
                for s, q in zip(states, local, strict=True)
                if "exp_avg" in s
            )
    return out


def _fsdp1_orig_default(rank: int) -> dict:
    """FSDP1 with use_orig_params=True and FP8AdamW built plainly over model.parameters() (no fp8_params): FSDP1
    puts its flat parameter's views back on every forward, so the FP8 weights' masters are kept apart (their storage
    stays FSDP1's); O2 trains like O1."""
    from lightning_fp8 import FP8AdamW
    from lightning_fp8.distributed import enable_fp8_fsdp1

    out = {}
    for level in ("O1", "O2"):
        model = _fsdp1(_model(), use_orig_params=True)
        enable_fp8_fsdp1(model)
        # O1 holds FP8 gradients in hooks by default, which torch.distributed refuses: plain gradients here.
        opt = FP8AdamW(model.parameters(), lr=3e-3, opt_level=level, fp8_grads=False if level == "O1" else None)
        out[level] = _steps(model, opt, rank, 5)
        if level == "O2":
            weights = _fp8_weights(model)
            held = [p for p in weights if p.numel()]  # a rank's view of a weight outside its shard is empty
            states = [opt.state[p] for p in held]
            out["exp_avg_dtypes"] = sorted({str(s["exp_avg"].dtype) for s in states})
            out["state_numels_match"] = all(
                s["exp_avg"].numel() == p.numel() for s, p in zip(states, held, strict=True)
            )
            out["weight_dtypes"] = sorted({str(p.dtype) for p in weights})
    return out


def _fsdp1_orig_torch_checkpoints(rank: int, directory: str) -> dict:
    """FSDP1 (use_orig_params=True) at O2 through torch's checkpoint functions: full state dicts (get_state_dict,
    torch.save, weights_only load, set_state_dict), sharded ones (DCP) and FSDP.optim_state_dict /
    optim_state_dict_to_load. torch gathers each weight's states from the ranks' parts of the flat parameter and wants
    one dtype for them and equal 0-dim values on every rank: FP8AdamW's E4M3/fp16 states with per-rank scales
    stopped it with an AssertionError. They are exported as fp32 values; a resumed run continues as the saved one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    from lightning_fp8 import FP8AdamW, fp8_state_dict, load_fp8_state_dict
    from lightning_fp8.distributed import enable_fp8_fsdp1
    from lightning_fp8.optim.checkpoint import as_stored, dequantize

    def build() -> tuple[nn.Module, FP8AdamW]:
        model = _fsdp1(_model(), use_orig_params=True)
        enable_fp8_fsdp1(model)
        return model, FP8AdamW(model.parameters(), lr=3e-3, opt_level="O2")

    def moments(opt: FP8AdamW) -> list[torch.Tensor]:
        # (Not the FP8 weights' masters: a loaded state without one takes its master from the weight, as the model's
        # state loads after or before it; the first step takes the weight's value if it was loaded after.)
        states = [opt.state[p] for group in opt.param_groups for p in group["params"] if p in opt.state]
        return [dequantize(s, k) for s in states for k in ("exp_avg", "exp_avg_sq")]

    model, opt = build()
    _steps(model, opt, rank, 3)
    weight = next(p for p in _fp8_weights(model) if p.numel())
    with as_stored(opt):
        with as_stored(opt):  # nested: the outer one still holds after the inner one ends
            pass
        index = next(i for i, q in enumerate(q for g in opt.param_groups for q in g["params"]) if q is weight)
        stored = opt.state_dict()["state"][index]
    saved_moments = [v.clone() for v in moments(opt)]
    fp8 = fp8_state_dict(model)
    full = StateDictOptions(full_state_dict=True)  # (cpu_offload crashes FSDP1 whose parameters are on the CPU)
    fmsd, fosd = get_state_dict(model, opt, options=full)
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        torch.save({"model": fmsd, "optim": fosd, "fp8": fp8}, os.path.join(directory, "full.pt"))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(directory, "sharded"))
    sharded = (StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig())
    with FSDP.state_dict_type(model, *sharded):
        legacy_model, legacy_optim = model.state_dict(), FSDP.optim_state_dict(model, opt)
    dist.barrier()
    continued = _steps(model, opt, rank, 3)

    def resumed(load) -> tuple[list[float], bool]:
        model, opt = build()
        load(model, opt)
        load_fp8_state_dict(model, fp8)
        same = all(torch.equal(a, b) for a, b in zip(moments(opt), saved_moments, strict=True))
        return _steps(model, opt, rank, 3), same

    def from_full(model: nn.Module, opt: FP8AdamW) -> None:
        loaded = torch.load(os.path.join(directory, "full.pt"), weights_only=True)
        set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"], options=full)

    def from_dcp(model: nn.Module, opt: FP8AdamW) -> None:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(directory, "sharded"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def from_legacy(model: nn.Module, opt: FP8AdamW) -> None:
        with FSDP.state_dict_type(model, *sharded):
            model.load_state_dict(legacy_model)
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, legacy_optim))

    full_weight = fosd["state"]["0.weight"]
    return {
        "continued": continued,
        "resumed": {
            name: resumed(load) for name, load in [("full", from_full), ("dcp", from_dcp), ("legacy", from_legacy)]
        },
        "full_weight_states": sorted((k, str(v.dtype), tuple(v.shape)) for k, v in full_weight.items() if v.dim()),
        "stored_dtypes": sorted(str(v.dtype) for k, v in stored.items() if k in ("master", "exp_avg", "exp_avg_sq")),
    }


def _fsdp1_flat_full_state(rank: int) -> dict:
    """FSDP1 flat parameters (use_orig_params=False) given low-precision states (fp8_params): torch's full state dict
    gathers each rank's part of a flat parameter's states. Exported as stored, the E4M3 first moment failed on gloo
    (no FP8 collectives), and fp16 moments were read under one rank's scale (values off by powers of two, no error).
    By value, the full states are every rank's values."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from lightning_fp8 import FP8AdamW
    from lightning_fp8.optim.checkpoint import dequantize

    model = _fsdp1(_model(), use_orig_params=False)
    opt = FP8AdamW(model.parameters(), lr=3e-3, opt_level="O2", fp8_params=list(model.parameters()))
    _steps(model, opt, rank, 3)
    (flat,) = list(model.parameters())
    local = {key: dequantize(opt.state[flat], key) for key in ("exp_avg", "exp_avg_sq")}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    _, full = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    names = [name for name, _ in _model().named_parameters()]
    out = {"dtypes": sorted({str(opt.state[flat][key].dtype) for key in local})}
    for key in local:
        reference = torch.cat([part[key] for part in parts])  # the flat parameter's values, padded at the end
        gathered = torch.cat([full["state"][name][key].reshape(-1) for name in names])
        out[key] = torch.equal(gathered, reference[: gathered.numel()])
    return out


def _fsdp1_one_rank_refuses(rank: int) -> dict:
    """FSDP1 (use_orig_params=True), O2: a full optimizer state dict with a NaN in a weight whose part only rank 1
    holds. Rank 1 refused its part and rank 0 loaded its own (and the saved lr): the ranks' optimizers disagreed. Every
    rank refuses, and nothing changes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_optimizer_state_dict

    from lightning_fp8 import FP8AdamW
    from lightning_fp8.distributed import enable_fp8_fsdp1

    def build(lr: float) -> tuple[nn.Module, FP8AdamW]:
        model = _fsdp1(_model(), use_orig_params=True)
        enable_fp8_fsdp1(model)
        return model, FP8AdamW(model.parameters(), lr=lr, opt_level="O2")

    full = StateDictOptions(full_state_dict=True)
    model, opt = build(3e-3)
    _steps(model, opt, rank, 3)
    _, saved = get_state_dict(model, opt, options=full)
    model, opt = build(1e-3)
    _steps(model, opt, rank, 2)
    last = model.module[5].weight  # 16 x 48 at the end of the flat parameter: rank 1's part only
    saved["state"]["5.weight"]["exp_avg"][0, 0] = float("nan")
    before = [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    try:
        set_optimizer_state_dict(model, opt, optim_state_dict=saved, options=full)
        error = None
    except ValueError as caught:
        error = str(caught)
    after = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    unchanged = len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    return {"holds_last": last.numel() > 0, "error": error, "unchanged": unchanged, "lr": opt.param_groups[0]["lr"]}


def _fsdp2_marked_without_fp8_params(rank: int) -> dict:
    """fully_shard replaces the parameters; enable_fp8_fsdp2 marks the FP8 weights again: no fp8_params needed."""
    from lightning_fp8 import FP8AdamW
    from lightning_fp8.distributed import enable_fp8_fsdp2

    model = _fsdp2(_model())
    unmarked = FP8AdamW(model.parameters(), lr=3e-3, opt_level="O2")  # before: the sharded weights carry no marker
    enable_fp8_fsdp2(model)
    opt = FP8AdamW(model.parameters(), lr=3e-3, opt_level="O2")
    losses = _steps(model, opt, rank, 3)
    weights = _fp8_weights(model)
    return {
        "unmarked_low_precision": len(unmarked._low_precision),
        "low_precision": sorted(i for i, p in enumerate(weights) if p in opt._low_precision),
        "exp_avg_dtypes": sorted({str(opt.state[p]["exp_avg"].dtype) for p in weights}),
        "losses": losses,
    }


def _fsdp2_full_state_into_shards(rank: int) -> dict:
    """An unsharded FP8AdamW state dict given to a sharded one's load_state_dict. The 1-row weight's shard on rank 0
    has the whole weight's shape (rank 1's is empty): every rank must refuse, none load and run on alone."""
    from torch.distributed.fsdp import fully_shard

    from lightning_fp8 import FP8AdamW

    def build(shard: bool) -> tuple[nn.Module, FP8AdamW]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 1, bias=False))
        if shard:
            fully_shard(model, mesh=cpu_mesh())
        return model, FP8AdamW(model.parameters(), lr=1e-2)

    def step(model: nn.Module, opt: FP8AdamW) -> None:
        model(torch.randn(4, 32, generator=torch.Generator().manual_seed(rank))).sum().backward()
        opt.step()
        opt.zero_grad()

    unsharded, unsharded_opt = build(False)
    step(unsharded, unsharded_opt)
    model, opt = build(True)
    step(model, opt)
    (p,) = model.parameters()

    def local(value: torch.Tensor) -> torch.Tensor:
        return value.to_local() if hasattr(value, "to_local") else value

    before = {key: local(value).clone() for key, value in opt.state[p].items()}
    try:
        opt.load_state_dict(unsharded_opt.state_dict())
        error = None
    except ValueError as e:
        error = str(e)
    unchanged = all(torch.equal(local(value), before[key]) for key, value in opt.state[p].items())
    return {"shard_shape": list(p.to_local().shape), "error": error, "unchanged": unchanged}


def _guarded(fn, *args) -> dict:
    try:
        return {"ok": True, **fn(*args)}
    except Exception:
        return {"ok": False, "error": traceback.format_exc()[-2000:]}


def _worker(rank: int, world: int) -> dict:
    box = [tempfile.mkdtemp(prefix="fp8_dcp_") if rank == 0 else None]
    dist.broadcast_object_list(box)  # one checkpoint directory for all ranks
    try:
        return {
            "fsdp2_o1": _guarded(_fsdp2_o1_against_adamw, rank),
            "fsdp2_dcp": _guarded(_fsdp2_dcp_round_trip, rank, box[0]),
            "fsdp2_o2_tied_dcp": _guarded(_fsdp2_o2_tied_dcp_round_trip, rank, os.path.join(box[0], "tied")),
            "fsdp2_all_tied_dcp": _guarded(_fsdp2_o2_tied_dcp_round_trip, rank, os.path.join(box[0], "all"), "all"),
            "fsdp1_flat_o2": _guarded(_low_precision_run, rank, "fsdp1_flat"),
            "fsdp1_orig_o2": _guarded(_low_precision_run, rank, "fsdp1_orig"),
            "fsdp2_o2": _guarded(_low_precision_run, rank, "fsdp2"),
            "fsdp1_orig_default": _guarded(_fsdp1_orig_default, rank),
            "fsdp1_flat_full_state": _guarded(_fsdp1_flat_full_state, rank),
            "fsdp1_one_rank_refuses": _guarded(_fsdp1_one_rank_refuses, rank),
            "fsdp1_orig_torch_checkpoints": _guarded(
                _fsdp1_orig_torch_checkpoints, rank, os.path.join(box[0], "fsdp1")
            ),
            "fsdp2_marked": _guarded(_fsdp2_marked_without_fp8_params, rank),
            "fsdp2_full_into_shards": _guarded(_fsdp2_full_state_into_shards, rank),
        }
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(box[0], ignore_errors=True)


@pytest.fixture(scope="module")
def results(spawned):
    return spawned(2, "test_fsdp_optim", "_worker")


pytestmark = pytest.mark.slow


def _ok(r: dict, key: str) -> dict:
    assert r[key]["ok"], r[key].get("error")
    return r[key]


def test_fp8_adamw_o1_on_fsdp2_shards_matches_adamw(results):
    for r in results:
        run = _ok(r, "fsdp2_o1")
        assert run["params_close"] and run["sharded"]
        assert run["losses"] == pytest.approx(run["ref_losses"], rel=1e-5)


def test_fp8_adamw_fsdp2_sharded_and_full_checkpoints_resume_exactly(results):
    for r in results:
        run = _ok(r, "fsdp2_dcp")
        assert run["from_sharded"] == run["continued"]
        assert run["from_full"] == run["continued"]


@pytest.mark.parametrize(("key", "n_scaled"), [("fsdp2_o2_tied_dcp", 2), ("fsdp2_all_tied_dcp", 7)])
def test_fp8_adamw_o2_fsdp2_tied_embedding_dcp_resumes_exactly(results, key, n_scaled):
    for r in results:
        run = _ok(r, key)
        # The template DCP loads into (a fresh optimizer's) names every parameter, the tied embedding included.
        assert "wte.weight" in run["template_keys"] and run["template_keys"] == run["param_names"]
        # Every scaled state of this rank's shards comes back (low_precision_moments="all": all 7 parameters').
        assert run["fp8_states"] == ["torch.float8_e4m3fn"] * n_scaled and run["states_equal"]
        assert run["resumed"] == run["continued"]


def _o2_trains_like_o1(run: dict) -> None:
    assert run["exp_avg_dtypes"] == ["torch.float8_e4m3fn"] and run["state_numels_match"]
    o1, o2 = run["O1"], run["O2"]
    assert o2[-1] < o2[0] and abs(o2[-1] - o1[-1]) <= 0.05 * o1[-1], (o1, o2)


def test_fp8_adamw_o2_on_fsdp1_flat_parameters(results):
    for r in results:
        _o2_trains_like_o1(_ok(r, "fsdp1_flat_o2"))


def test_fp8_adamw_o2_on_fsdp1_orig_params_built_plainly(results):
    for r in results:
        run = _ok(r, "fsdp1_orig_default")
        _o2_trains_like_o1(run)
        assert run["weight_dtypes"] == ["torch.float32"]  # the storage stays FSDP1's


def test_enable_fp8_fsdp2_marks_sharded_fp8_weights_for_fp8_adamw(results):
    for r in results:
        run = _ok(r, "fsdp2_marked")
        assert run["unmarked_low_precision"] == 0  # what fully_shard alone leaves (the failure this guards against)
        assert run["low_precision"] == [0, 1, 2] and run["exp_avg_dtypes"] == ["torch.float8_e4m3fn"], run
        assert all(math.isfinite(v) for v in run["losses"]) and run["losses"][-1] < run["losses"][0], run


def test_full_state_dict_into_fsdp2_shards_is_refused_on_every_rank(results):
    runs = [_ok(r, "fsdp2_full_into_shards") for r in results]
    assert [run["shard_shape"] for run in runs] == [[1, 32], [0, 32]]  # rank 0's shard has the whole shape
    for run in runs:
        assert run["error"] is not None and "set_optimizer_state_dict" in run["error"], run
        assert run["unchanged"]


def test_fp8_adamw_o2_on_fsdp2_dtensor_shards(results):
    for r in results:
        _o2_trains_like_o1(_ok(r, "fsdp2_o2"))


def test_fp8_adamw_o2_on_fsdp1_original_parameters(results):
    """FSDP1 use_orig_params=True: the weights are views into the flat parameter; O2 keeps their masters apart
    instead of putting the scaled fp16 master in their storage (which the layers then computed with: loss ~1e20)."""
    for r in results:
        _o2_trains_like_o1(_ok(r, "fsdp1_orig_o2"))


def test_fp8_adamw_o2_fsdp1_orig_params_checkpoints_through_torch(results):
    for r in results:
        run = _ok(r, "fsdp1_orig_torch_checkpoints")
        # The full state dict holds the whole weight's moments as fp32 values (no per-rank scale, no master: the
        # fp32 weight holds its value); as_stored keeps this rank's E4M3 / fp16 states for per-rank saving.
        assert run["full_weight_states"] == [
            ("exp_avg", "torch.float32", (64, 32)),
            ("exp_avg_sq", "torch.float32", (64, 32)),
        ]
        assert run["stored_dtypes"] == ["torch.float16", "torch.float16", "torch.float8_e4m3fn"]
        for name, (losses, same_values) in run["resumed"].items():
            assert same_values, name  # every moment has its saved value (stored again with a fresh scale)
            assert losses == pytest.approx(run["continued"], rel=1e-6), name  # and the masters (from the weights)


def test_fp8_adamw_o2_fsdp1_flat_parameters_full_state_dict_holds_every_rank_s_values(results):
    for r in results:
        run = _ok(r, "fsdp1_flat_full_state")
        assert run["dtypes"] == ["torch.float16", "torch.float8_e4m3fn"]  # the flat parameter's states are scaled
        assert run["exp_avg"] and run["exp_avg_sq"], run


def test_fsdp1_state_dict_one_rank_refuses_is_refused_on_every_rank(results):
    runs = [_ok(r, "fsdp1_one_rank_refuses") for r in results]
    assert [run["holds_last"] for run in runs] == [False, True]
    assert "holds inf or NaN" in runs[1]["error"]
    assert "another rank refused its part" in runs[0]["error"]
    for run in runs:
        assert run["unchanged"] and run["lr"] == 1e-3, run
