"""The routes to a tensor-parallel FP8 model on 2 gloo processes, against each other and the single-process model.

Routes: ``apply_fp8_tensor_parallel`` with the default GPT plan and with the same plan spelled out, torch's
``parallelize_module`` with FP8ColwiseParallel / FP8RowwiseParallel or torch's ColwiseParallel on FP8 layers, and the
conversion after the parallelization (FP8 GEMMs under the styles the layers were given, said in a warning). Also
the gradient norm across tensor-parallel ranks, FP8GradScaler skipping on every rank when one sees a NaN, and an
FP8AdamW checkpoint saved with torch.save and read with ``weights_only=True``. One spawn runs every part.
"""

from __future__ import annotations

import io
import warnings
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from tests.distributed.launch import part_results, run_parts, run_workers
from tests.distributed.test_tensor_parallel import GPT, _batch, _full, _loss, _tp_mesh

pytestmark = pytest.mark.slow

WORLD, STEPS, LR = 2, 4, 3e-3
# TP and the single-process FP8 model differ by fp32 summation order, per-shard weight scales and (with sequence
# parallelism) one E5M2 rounding of input gradients: their losses differed by < 5e-4 relative over 4 steps, about as
# much as the single-process FP8 model differs from the fp32 one (< 5e-4). A loss is allowed 3x that FP8 difference.
FP8_NOISE_FACTOR = 3.0
# The same clipping norm summed over shards instead of whole tensors: 3e-5 relative observed with FP8 comm.
NORM_RTOL = 1e-3


def _gpt(convert: bool = True) -> nn.Module:
    from lightning_fp8 import convert_to_fp8

    torch.manual_seed(0)
    model = GPT()
    return convert_to_fp8(model, module_filter_fn=lambda m, fqn: fqn != "head") if convert else model


def _styles_plan(model: nn.Module, colwise: type) -> dict:
    from lightning_fp8.distributed.tensor_parallel import FP8RowwiseParallel

    plan = {}
    for i in range(len(model.blocks)):
        plan |= {f"blocks.{i}.attn.qkv": colwise(), f"blocks.{i}.attn.proj": FP8RowwiseParallel()}
        plan |= {f"blocks.{i}.mlp.fc": colwise(), f"blocks.{i}.mlp.proj": FP8RowwiseParallel()}
    return plan


def _parallel(route: str) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from lightning_fp8.distributed.amax_sync import enable_fp8_amax_sync
    from lightning_fp8.distributed.tensor_parallel import GPT_PLAN, FP8ColwiseParallel, apply_fp8_tensor_parallel

    model = _gpt()
    if route == "gpt":
        apply_fp8_tensor_parallel(model, _tp_mesh())
    elif route == "explicit_plan":
        apply_fp8_tensor_parallel(model, _tp_mesh(), plan=dict(GPT_PLAN))
    elif route == "gpt_no_sp":
        apply_fp8_tensor_parallel(model, _tp_mesh(), sequence_parallel=False)
    else:  # "fp8_styles", "torch_colwise"
        colwise = FP8ColwiseParallel if route == "fp8_styles" else ColwiseParallel
        parallelize_module(model, _tp_mesh(), _styles_plan(model, colwise))
        enable_fp8_amax_sync(model)
    return model


def _train(model: nn.Module, fp8: bool = True) -> dict:
    from lightning_fp8 import FP8AdamW

    opt = FP8AdamW(model.parameters(), lr=LR) if fp8 else torch.optim.AdamW(model.parameters(), lr=LR)
    gen, losses = torch.Generator().manual_seed(3), []
    for _ in range(STEPS):
        loss = _loss(model, *_batch(gen, 3))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: _full(v).detach().float() for k, v in model.state_dict().items()}}


ROUTES = ("gpt", "explicit_plan", "gpt_no_sp", "fp8_styles", "torch_colwise")


def _convert_after() -> dict:
    from lightning_fp8 import FP8Linear, convert_to_fp8
    from lightning_fp8.distributed.tensor_parallel import apply_fp8_tensor_parallel

    model = apply_fp8_tensor_parallel(_gpt(convert=False), _tp_mesh())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_to_fp8(model, module_filter_fn=lambda m, fqn: fqn != "head")
    return {
        "fp8_layers": sum(isinstance(m, FP8Linear) for m in model.modules()),
        "warnings": [str(w.message) for w in caught],
        "trained": _train(model),
    }


def _two_dim_mesh() -> dict:
    """The FP8 styles through parallelize_module on a 2-D mesh: the error, and whether any weight became a DTensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_fp8.distributed.tensor_parallel import FP8ColwiseParallel

    model = _gpt()
    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    try:
        parallelize_module(model, mesh, _styles_plan(model, FP8ColwiseParallel))
        error = None
    except Exception as e:  # the test checks its type and words
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "sharded": [n for n, p in model.named_parameters() if isinstance(p, DTensor)]}


def _clip_norms() -> dict:
    from lightning_fp8 import FP8GradScaler
    from lightning_fp8.integrations.clipping import clip_scaled_grad_norm_

    model, ref = _parallel("gpt"), _gpt()
    batch = _batch(torch.Generator().manual_seed(3), 3)
    norms = {}
    for name, m in (("tp", model), ("one", ref)):
        scaler = FP8GradScaler(init_scale=2.0**10)
        scaler.scale_loss(_loss(m, *batch)).backward()
        norms[name] = float(scaler.clip_grad_norm_(m.parameters(), 0.5))  # the norm before clipping
        norms[f"{name}_clipped"] = float(clip_scaled_grad_norm_(list(m.parameters()), 1e9, scaler.loss_scale))
        norms[f"{name}_clipped"] /= scaler.loss_scale
    return norms


def _nan_on_one_rank() -> dict:
    from lightning_fp8 import FP8AdamW, FP8GradScaler

    model = _parallel("gpt")
    scaler = FP8GradScaler(init_scale=2.0**10)
    opt = FP8AdamW(model.parameters(), lr=LR, grad_scaler=scaler)
    before = [_local(p).clone() for p in model.parameters()]
    scaler.scale_loss(_loss(model, *_batch(torch.Generator().manual_seed(3), 3))).backward()
    if dist.get_rank() == 1:  # only this rank's shard of one weight gradient
        model.blocks[0].mlp.fc.weight.grad.to_local()[0, 0] = float("nan")
    stepped = scaler.step(opt)
    scaler.update()
    unchanged = all(torch.equal(b, _local(p)) for b, p in zip(before, model.parameters(), strict=True))
    return {"stepped": stepped, "unchanged": unchanged, "scale": scaler.get_scale(), "skipped": scaler.skipped_steps}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _weights_only_resume() -> dict:
    from lightning_fp8 import FP8AdamW, fp8_state_dict, load_fp8_state_dict

    model = _parallel("gpt")
    opt = FP8AdamW(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(3)
    batches = [_batch(gen, 3) for _ in range(4)]

    def steps(m: nn.Module, o: torch.optim.Optimizer, part: list) -> list[float]:
        losses = []
        for batch in part:
            loss = _loss(m, *batch)
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        return losses

    steps(model, opt, batches[:2])
    state = opt.state[model.blocks[0].mlp.fc.weight]
    shapes = {k: (tuple(v.shape), tuple(getattr(v, "placements", ()))) for k, v in state.items() if v.dim() == 2}
    buf = io.BytesIO()
    # each rank its own file (docs/guides/checkpoints.md): the per-shard FP8 scaling state too
    torch.save({"model": model.state_dict(), "fp8": fp8_state_dict(model), "optimizer": opt.state_dict()}, buf)
    continued = steps(model, opt, batches[2:])
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed_model = _parallel("gpt")
    resumed_opt = FP8AdamW(resumed_model.parameters(), lr=LR)
    resumed_model.load_state_dict(saved["model"])
    load_fp8_state_dict(resumed_model, saved["fp8"])
    resumed_opt.load_state_dict(saved["optimizer"])
    return {"shapes": shapes, "continued": continued, "resumed": steps(resumed_model, resumed_opt, batches[2:])}


def _worker(rank: int, world: int) -> dict:
    parts = {route: partial(lambda r: _train(_parallel(r)), route) for route in ROUTES}
    parts |= {"one_fp8": lambda: _train(_gpt()), "one_fp32": lambda: _train(_gpt(convert=False), fp8=False)}
    parts |= {"convert_after": _convert_after, "clip": _clip_norms, "nan": _nan_on_one_rank}
    parts["two_dim_mesh"] = _two_dim_mesh
    parts["weights_only"] = _weights_only_resume
    return run_parts(parts)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_workers(_worker, WORLD)


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_every_route_trains_like_one_process_and_like_the_routes_running_the_same_ops(two_ranks):
    one, fp32 = part_results(two_ranks, "one_fp8")[0], part_results(two_ranks, "one_fp32")[0]
    tolerance = FP8_NOISE_FACTOR * _max_rel(one["losses"], fp32["losses"])
    runs = {route: part_results(two_ranks, route) for route in ROUTES}
    for route, ranks in runs.items():
        assert ranks[0]["losses"] == ranks[1]["losses"], route  # one model: the same loss on both ranks
        assert _max_rel(ranks[0]["losses"], one["losses"]) <= tolerance, (route, ranks[0]["losses"], one["losses"])
    # The same plan spelled out is the default plan; without sequence parallelism the three spellings run the same
    # ops (torch's ColwiseParallel on an FP8Linear runs the FP8 forward too): bit for bit.
    same = [("explicit_plan", "gpt"), ("fp8_styles", "gpt_no_sp"), ("torch_colwise", "gpt_no_sp")]
    for route, like in same:
        a, b = runs[route][0], runs[like][0]
        assert a["losses"] == b["losses"], (route, like)
        assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in b["weights"]), (route, like)


def test_converting_after_parallelizing_says_the_activations_travel_in_high_precision(two_ranks):
    """An FP8Linear made from a sharded nn.Linear keeps the styles the nn.Linear was given: FP8 GEMMs on the shards,
    none of the FP8 activation communication that sequence parallelism was asked for, which went unsaid. It trains
    as the FP8 layers parallelized without sequence parallelism do (the same ops), and a warning says to convert
    first."""
    no_sp = part_results(two_ranks, "gpt_no_sp")[0]
    reports = part_results(two_ranks, "convert_after")
    for report in reports:
        assert report["fp8_layers"] == 8, report["warnings"]  # the blocks' four layers, twice; not the head
        assert report["trained"]["losses"] == no_sp["losses"]
    assert any(
        "sharded already" in w and "travel in high precision" in w and "call convert_to_fp8 first" in w
        for report in reports
        for w in report["warnings"]
    ), [r["warnings"] for r in reports]


def test_gradient_norm_over_tensor_parallel_ranks_is_the_single_process_norm(two_ranks):
    for norms in part_results(two_ranks, "clip"):
        assert norms["tp"] == pytest.approx(norms["one"], rel=NORM_RTOL), norms
        assert norms["tp_clipped"] == pytest.approx(0.5, rel=1e-4) and norms["one_clipped"] == pytest.approx(0.5)


def test_a_nan_on_one_rank_skips_the_step_on_every_rank(two_ranks):
    for report in part_results(two_ranks, "nan"):
        assert report == {"stepped": False, "unchanged": True, "scale": 2.0**9, "skipped": 1}, report


def test_fp8_adamw_state_of_dtensors_loads_with_weights_only_and_resumes_bit_for_bit(two_ranks):
    for report in part_results(two_ranks, "weights_only"):
        for key in ("exp_avg", "exp_avg_sq", "master"):  # sharded like the column-parallel weight (384, 96)
            assert report["shapes"][key] == ((384, 96), (Shard(0),)), report["shapes"]
        assert report["resumed"] == report["continued"]


def test_the_fp8_styles_on_a_two_dimensional_mesh_are_refused_before_any_layer_changes(two_ranks):
    # torch's own error came from deep inside ("placements must have the same length as device_mesh.ndim").
    for report in part_results(two_ranks, "two_dim_mesh"):
        assert report["error"] is not None and report["error"].startswith(
            "ValueError: FP8ColwiseParallel: tensor parallelism runs on a 1-D mesh"
        ), report
        assert "mesh['tp']" in report["error"] and report["sharded"] == [], report
