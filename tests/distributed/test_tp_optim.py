"""FP8AdamW (O2) on tensor-parallel FP8 models, and DCP checkpoints of them with optimizer and scaling states.

Tensor parallelism hands FP8AdamW DTensor parameters: FP8 linear weights sharded on dim 0 (column-parallel) or
dim 1 (row-parallel), whose O2 states (fp16 master, E4M3 first moment, fp16 second moment, each with a per-shard
scale) are sharded the same way; and replicated norms and biases, whose gradients arrive as partial sums under
sequence parallelism. Each worker trains the tiny GPT of ``test_tensor_parallel`` parallelized with the Megatron
plan beside the same FP8 model in one process, then checkpoints with torch.distributed.checkpoint and resumes.

Two spawns of 2 gloo processes (training, checkpoints); each case reports its outcome, so one failure does not hide
the others. On a 2-D (data x tensor) mesh ``test_tensor_parallel.test_2d_mesh_trains_gpt`` covers training (with
torch.optim.AdamW; 4 processes are too slow to repeat it for FP8AdamW); here 4 processes run only a short DCP
round trip, because FSDP2 shards column-parallel weights there with a placement of its own (``_StridedShard``).
"""

from __future__ import annotations

import copy
import os
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.distributed.launch import run_workers
from tests.distributed.test_tensor_parallel import GPT, _batch, _delayed_states, _full, _gather_all, _loss

pytestmark = pytest.mark.slow

WORLD = 2
STEPS = 10
BATCH_ROWS = 3
LR = 3e-3
# The TP model and the single-process one start identical and see the same data, but do not compute the same bits:
# each rank casts its weight shard (and stores its O2 master and moments) with the shard's own power-of-two scale
# where the single process uses the whole tensor's, TP keeps an fp32 copy of the weight beside the fp16 master
# (the single process computes with the rounded master), and with sequence parallelism the input gradients are
# reduce-scattered in E5M2. Those FP8 rounding differences move the loss by < 0.2% over 10 steps (observed); 1%.
LOSS_RTOL = 0.01
# Final weights, per tensor: ||w_tp - w_one|| / ||w_one - w_init||, the difference as a fraction of how far training
# moved the weight. Early AdamW steps are ~lr * sign(gradient), so a gradient element near 0 whose FP8 rounding
# differs flips its update: 0.06 observed for TP, 0.19 for SP with FP8 comm (the single-process FP8 model is 0.18
# from the fp32 model by the same measure: one more rounding's worth of noise). A replicated parameter stepped with
# its rank's partial gradient instead of the sum drifts by 0.8 to 1.
WEIGHT_DRIFT_RTOL = 0.3

CASES = {"tp": {"sequence_parallel": False}, "sp": {"sequence_parallel": True}}


def _build(seed: int, **tp_kwargs) -> tuple[nn.Module, nn.Module]:
    """(the FP8 GPT parallelized over all ranks, the same FP8 GPT unparallelized); head in high precision."""
    from lightning_fp8 import convert_to_fp8
    from lightning_fp8.distributed.tensor_parallel import apply_fp8_tensor_parallel

    torch.manual_seed(seed)
    model = convert_to_fp8(GPT(), module_filter_fn=lambda m, fqn: fqn != "head")
    ref = copy.deepcopy(model)
    apply_fp8_tensor_parallel(model, init_device_mesh("cpu", (dist.get_world_size(),)), **tp_kwargs)
    return model, ref


def _optimizer(model: nn.Module, **kwargs) -> torch.optim.Optimizer:
    from lightning_fp8 import FP8AdamW

    return FP8AdamW(model.parameters(), lr=LR, opt_level="O2", **kwargs)


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    loss = _loss(model, *batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _guarded(fn, *args) -> tuple[str, object]:
    try:
        return "ok", fn(*args)
    except Exception:  # one failing case must not hide the others' results
        return "error", traceback.format_exc()


def _report(results: list[dict], case: str) -> list:
    for rank, reports in enumerate(results):
        status, value = reports[case]
        if status == "error":
            pytest.fail(f"{case} failed on rank {rank}:\n{value}")
    return [reports[case][1] for reports in results]


def _all_equal(t: torch.Tensor) -> bool:
    return all(torch.equal(x, t) for x in _gather_all(t))


# --------------------------------------------------------------------------------------------------- training
def _replicated(model: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """Every value that must be the same on all ranks after a step: replicated parameters and their states."""
    values = []
    for p in model.parameters():
        if isinstance(p, DTensor) and any(placement.is_shard() for placement in p.placements):
            continue
        state = opt.state[p]
        values += [_local(p), _local(state["exp_avg"]), _local(state["exp_avg_sq"])]
    return torch.cat([v.detach().float().flatten() for v in values])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _snapshot(states: dict) -> torch.Tensor:
    return torch.cat([torch.cat([s.scale.view(1), s.amax_history]) for s in states.values()])


def _train(case: str) -> dict:
    model, ref = _build(0, **CASES[case])
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    # TP weights keep their gradient in the parameter's dtype (fp32); so does the reference (fp16, its master's).
    opt, ref_opt = _optimizer(model), _optimizer(ref, fp8_grads=False)
    states, synced = _delayed_states(model), {}
    # After the root's amax-sync hook (registered first): what every rank casts activations and gradients with.
    model.register_forward_pre_hook(lambda *_: synced.update(after=_snapshot(states)))
    model.register_forward_pre_hook(lambda *_: synced.update(before=_snapshot(states)), prepend=True)
    gen = torch.Generator().manual_seed(3)
    report: dict = {"losses": [], "ref_losses": [], "replicated_identical": [], "scales_identical": []}
    report["scales_differed"] = False
    for _ in range(STEPS):
        batch = _batch(gen, BATCH_ROWS)
        report["losses"].append(_step(model, opt, batch))
        report["ref_losses"].append(_step(ref, ref_opt, batch))
        report["replicated_identical"].append(_all_equal(_replicated(model, opt)))
        report["scales_identical"].append(_all_equal(synced["after"]))
        report["scales_differed"] |= not _all_equal(synced["before"])
    sd, ref_sd = model.state_dict(), ref.state_dict()
    report["drift"] = {
        k: ((_full(sd[k]).float() - ref_sd[k].float()).norm() / (ref_sd[k].float() - init[k].float()).norm()).item()
        for k in ref_sd
    }
    report["fp8_states"] = sorted(
        {
            (str(p.placements), str(opt.state[p]["master"].dtype), str(opt.state[p]["exp_avg"].dtype),
             str(opt.state[p]["exp_avg_sq"].dtype), opt.state[p]["exp_avg"].placements == p.placements)
            for p in opt._low_precision
        }
    )  # fmt: skip
    return report


def _train_worker(rank: int, world: int) -> dict:
    return {case: _guarded(_train, case) for case in CASES}


@pytest.fixture(scope="module")
def trained() -> list[dict]:
    return run_workers(_train_worker, WORLD)


@pytest.mark.parametrize("case", list(CASES))
def test_tp_fp8_adamw_tracks_single_process(trained, case):
    """10 O2 steps of a TP (or TP+SP) FP8 GPT against the same model in one process: losses and final weights."""
    for rank, report in enumerate(_report(trained, case)):
        losses, ref_losses = report["losses"], report["ref_losses"]
        assert losses[-1] < 0.8 * losses[0], f"rank {rank}: did not train: {losses}"
        assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL), f"rank {rank}"
        drift = {k: round(v, 3) for k, v in report["drift"].items() if v > WEIGHT_DRIFT_RTOL}
        assert not drift, f"rank {rank}: weights further from the single-process model than {WEIGHT_DRIFT_RTOL}"
        # O2 states of both weight layouts, sharded like their parameters.
        assert report["fp8_states"] == [
            (f"({placement},)", "torch.float16", "torch.float8_e4m3fn", "torch.float16", True)
            for placement in ("Shard(dim=0)", "Shard(dim=1)")
        ], report["fp8_states"]


@pytest.mark.parametrize("case", list(CASES))
def test_tp_fp8_adamw_keeps_ranks_consistent(trained, case):
    """Identical on all ranks: replicated parameters and their AdamW states after every step, and the delayed scales
    and amax histories every step casts activations and gradients with (weight scales are per shard by design)."""
    for rank, report in enumerate(_report(trained, case)):
        assert all(report["replicated_identical"]), f"rank {rank}: replicas drifted apart: {report}"
        assert all(report["scales_identical"]), f"rank {rank}: scales differ after the sync: {report}"
        assert report["scales_differed"], "the ranks' local amaxes never differed: vacuous test"


# ------------------------------------------------------------------------------------------------ checkpoints
def _opt_states(opt: torch.optim.Optimizer, model: nn.Module) -> dict[tuple[str, str], torch.Tensor]:
    """This rank's optimizer states by (parameter name, key), as plain tensors."""
    return {
        (name, key): _local(value).detach().clone()
        for name, p in model.named_parameters()
        for key, value in opt.state[p].items()
    }


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
        if a[k].dtype.itemsize == 1  # FP8 has no equality kernel on CPU: compare the bytes
        else torch.equal(a[k], b[k])
        for k in a
    )


def _resume(case: str, directory: str, saved_after: int = 3, resumed: int = 3) -> dict:
    """Train, save (model, FP8AdamW, FP8 scaling state) with DCP, continue; load into a fresh model, continue."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from lightning_fp8 import fp8_state_dict, load_fp8_state_dict
    from lightning_fp8.distributed.amax_sync import sync_fp8_amax

    gen = torch.Generator().manual_seed(4)
    batches = [_batch(gen, BATCH_ROWS) for _ in range(saved_after + resumed)]
    model = _build(0, **CASES[case])[0]
    opt = _optimizer(model)
    for batch in batches[:saved_after]:
        _step(model, opt, batch)
    # The delayed scales are per rank until the next forward's sync; DCP keeps one copy of plain tensors: sync first.
    sync_fp8_amax(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    saved_fp8 = fp8_state_dict(model)
    dcp.save({"model": model_sd, "optim": optim_sd, "fp8": saved_fp8}, checkpoint_id=directory)
    saved = _opt_states(opt, model)
    continued = [_step(model, opt, batch) for batch in batches[saved_after:]]

    restored = _build(1, **CASES[case])[0]  # another seed: everything must come from the checkpoint
    restored_opt = _optimizer(restored)
    model_sd, optim_sd = get_state_dict(restored, restored_opt)  # the template (creates the optimizer's states)
    state = {"model": model_sd, "optim": optim_sd, "fp8": fp8_state_dict(restored)}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(restored, restored_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    load_fp8_state_dict(restored, state["fp8"])
    loaded = _opt_states(restored_opt, restored)
    restored_fp8 = fp8_state_dict(restored)
    per_shard = torch.stack([v for (_, k), v in saved.items() if k.endswith(("_scale", "_amax"))])
    return {
        "loaded_equal": _equal(loaded, saved),
        "fp8_state_lost": sorted(k for k, v in saved_fp8.items() if not torch.equal(v, restored_fp8[k])),
        "per_shard_scalars_differ": not _all_equal(per_shard),  # else the test could not tell ranks' scalars apart
        "continued": continued,
        "resumed": [_step(restored, restored_opt, batch) for batch in batches[saved_after:]],
        "params_equal": all(
            torch.equal(_local(a), _local(b)) for a, b in zip(model.parameters(), restored.parameters(), strict=True)
        ),
        "states_equal": _equal(_opt_states(opt, model), _opt_states(restored_opt, restored)),
        "scales_equal": all(
            torch.equal(a.scale, b.scale) and torch.equal(a.amax_history, b.amax_history)
            for a, b in zip(_delayed_states(model).values(), _delayed_states(restored).values(), strict=True)
        ),
    }


def _checkpoint_worker(rank: int, world: int, directory: str) -> dict:
    return {case: _guarded(_resume, case, os.path.join(directory, case)) for case in CASES}


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory) -> list[dict]:
    return run_workers(_checkpoint_worker, WORLD, str(tmp_path_factory.mktemp("tp_dcp")))


@pytest.mark.parametrize("case", list(CASES))
def test_tp_fp8_adamw_dcp_resume_is_bit_identical(checkpointed, case):
    """DCP save of the TP model, FP8AdamW (O2) and the FP8 scaling state, load into a fresh model: same bits."""
    for rank, report in enumerate(_report(checkpointed, case)):
        assert report["per_shard_scalars_differ"], "every rank had the same state scales: vacuous test"
        # Each rank gets its own shards and its own per-shard scales and amaxes back (Shard(0) and Shard(1)).
        assert report["loaded_equal"], f"rank {rank}: loaded optimizer states differ from the saved ones"
        assert report["resumed"] == report["continued"], f"rank {rank}"
        assert report["params_equal"] and report["states_equal"] and report["scales_equal"], f"rank {rank}: {report}"


@pytest.mark.xfail(
    strict=True,
    reason="fp8_state_dict holds plain tensors, which DCP takes for replicated values and saves once: the per-rank "
    "statistics (each role's last amax, saturation; a weight shard's amax history) come back as one rank's on every "
    "rank. The numerics do not depend on them (delayed scales are synced before saving, weights use current scaling: "
    "the resume is bit-identical), but FP8 statistics logged after a resume are another rank's for up to "
    "amax_history_len steps. Fix: export them per rank (a DTensor of one row per rank, as FP8AdamW does its scales).",
)
@pytest.mark.parametrize("case", list(CASES))
def test_tp_fp8_scaling_statistics_survive_dcp(checkpointed, case):
    for rank, report in enumerate(_report(checkpointed, case)):
        assert not report["fp8_state_lost"], f"rank {rank}: {report['fp8_state_lost']}"


# ------------------------------------------------------------------------------------------ 2-D (data x tensor)
def _resume_2d(rank: int, world: int, directory: str, saved_after: int = 2, resumed: int = 2) -> dict:
    """FSDP2 over TP on a 2 x 2 mesh: FSDP2 shards colwise weights with ``_StridedShard``, rowwise with Shard."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from lightning_fp8 import FP8AdamW, FP8Linear, fp8_state_dict, load_fp8_state_dict
    from lightning_fp8.distributed.amax_sync import sync_fp8_amax
    from tests.distributed.test_tensor_parallel import _gpt_2d

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))

    def build(seed: int):
        model = _gpt_2d(mesh, seed)[0]
        # fully_shard makes new parameters without FP8Linear's marker: name the FP8 weights.
        weights = [m.weight for m in model.modules() if isinstance(m, FP8Linear)]
        return model, FP8AdamW(model.parameters(), lr=LR, fp8_params=weights)

    gen, dp_rank = torch.Generator().manual_seed(5), mesh["dp"].get_local_rank()
    batches = [tuple(t[dp_rank::2] for t in _batch(gen, 2 * BATCH_ROWS)) for _ in range(saved_after + resumed)]
    model, opt = build(0)
    for batch in batches[:saved_after]:
        _step(model, opt, batch)
    sync_fp8_amax(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "fp8": fp8_state_dict(model)}, checkpoint_id=directory)
    saved = _opt_states(opt, model)
    continued = [_step(model, opt, batch) for batch in batches[saved_after:]]
    restored, restored_opt = build(1)
    model_sd, optim_sd = get_state_dict(restored, restored_opt)
    state = {"model": model_sd, "optim": optim_sd, "fp8": fp8_state_dict(restored)}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(restored, restored_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    load_fp8_state_dict(restored, state["fp8"])
    return {
        "placements": sorted({str(p.placements) for p in opt._low_precision}),
        "loaded_equal": _equal(_opt_states(restored_opt, restored), saved),
        "continued": continued,
        "resumed": [_step(restored, restored_opt, batch) for batch in batches[saved_after:]],
    }


def test_2d_mesh_dcp_resume_is_bit_identical(tmp_path):
    """2 x 2 data x tensor mesh: every rank gets its own per-shard scales back; the run continues bit-identically."""
    for rank, report in enumerate(run_workers(_resume_2d, 4, str(tmp_path))):
        assert any("_StridedShard" in p for p in report["placements"]), report["placements"]
        assert report["loaded_equal"], f"rank {rank}: loaded optimizer states differ from the saved ones"
        assert report["resumed"] == report["continued"], f"rank {rank}"
