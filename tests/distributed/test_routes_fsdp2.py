"""FSDP2 (``fully_shard``) with FP8 communication and FP8AdamW, route by route (from a route sweep of FSDP2 with FP8).

Each route trains a few steps and is checked against independent references computed in the same processes: the same
model without FSDP, in one process, on the concatenated global batch, with the same recipe (FP8Linear, FP8AdamW); the
same FSDP2 route with FP8 communication off; and routes that must be bit-identical to each other. FP8 results are held
to the SQNR of the FP8 roundings they add (``tolerances.py``).

Routes: ``fully_shard`` per block then the root, and the root only; ``reshard_after_forward`` True and False (an int
must be a divisor of the shard size other than 1 and itself, which 2 and 3 ranks do not have; 2 on 4 ranks trained bit
for bit as True when checked by hand, its backward re-gather falling back to the weights' own dtype with a warning:
not run here, it needs a fourth process); 2 and 3 ranks (3: shards of uneven rows, and a head of 2 rows, so one rank
holds an empty shard); ``MixedPrecisionPolicy(bf16, fp32)``; a bf16 model; FP8 and non-FP8 parameters mixed
(embedding, LayerNorm, biases, a frozen FP8 layer, a head left out of the conversion), their gradients all in FP8 or
only the FP8Linear weights' (``FP8CommState(fp8_params=...)``); low-precision moments for every parameter; a model
built on the meta device, sharded, then materialized; gradient accumulation under ``set_requires_gradient_sync(False)``,
with and without ``set_reshard_after_backward(False)``; a full state dict (``torch.save`` /
``torch.load(weights_only=True)``) and a sharded checkpoint (torch.distributed.checkpoint) saved mid-run and loaded
into a fresh model and optimizer, the full one into a plain model too; a NaN on one rank (through the reduce-scatter
and in one rank's gradient shard) with an FP8GradScaler; ``clip_grad_norm_`` (torch's and FP8GradScaler's) over DTensor
gradients.

One spawn per world size runs every route (process start-up dominates the runtime).
"""

from __future__ import annotations

import functools
import io
import math
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import routes
from tests.distributed.launch import cpu_mesh, part_results, run_parts, run_workers
from tests.distributed.tolerances import GRAD_BF16_SQNR_DB, GRAD_SQNR_DB, LOSS_RTOL, NORM_RTOL, UPDATE_SQNR_DB

pytestmark = pytest.mark.slow

STEPS = 3
LR = 1e-2
ROWS = 8  # each rank's batch


class Net(nn.Module):
    """FP8Linear blocks (``a``, ``b``) beside an embedding, a LayerNorm, biases, a frozen FP8 layer and a 2-row head
    left out of the conversion. Rows 10, 48, 32 and 2: uneven on 3 ranks, and the head has fewer rows than ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 32)
        self.a = nn.Linear(32, 48)
        self.norm = nn.LayerNorm(48)
        self.b = nn.Linear(48, 32)
        self.frozen = nn.Linear(32, 32)
        self.head = nn.Linear(32, 2)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.a(x + self.emb(ids))))
        return self.head(self.frozen(torch.relu(self.b(h))))


def _model(dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    from lightning_fp8 import convert_to_fp8

    torch.manual_seed(0)
    with torch.device(device):
        model = Net().to(dtype)
    model = convert_to_fp8(model, module_filter_fn=lambda module, name: name != "head")
    model.frozen.requires_grad_(False)
    return model


_batch = functools.partial(routes.batch, rows=ROWS)
_loss = routes.loss


def _optimizer(model: nn.Module, **kwargs):
    from lightning_fp8 import FP8AdamW

    return FP8AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, **kwargs)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().clone()


def _weight(p: torch.Tensor) -> torch.Tensor:
    """The value of ``p``: at O2 an FP8 weight's storage holds its fp16 master times a scale (each shard its own)."""
    from lightning_fp8.optim import master, shards

    local = shards.local(p).detach().float()
    scale = master.master_scale(p)
    return _full(shards.like(p, local / scale if scale is not None else local))


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _weight(p) for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------------------- the reference
def _reference(world: int, dtype: torch.dtype = torch.float32, accum: int = 1, skip: tuple = (), **opt_kwargs) -> dict:
    """The model without FSDP on the global batch (every rank's micro-batches), FP8AdamW: the losses, the first step's
    gradients and norm, and the weights after STEPS (no step at the steps in ``skip``)."""
    model = _model(dtype)
    return routes.reference(model, _optimizer(model, **opt_kwargs), _weights, world, STEPS, ROWS, dtype, accum, skip)


# ------------------------------------------------------------------------------------------------- the FSDP2 runs
def _sharded(wrap: str = "blocks", dtype: torch.dtype = torch.float32, meta: bool = False, **shard_kwargs):
    """The model under ``fully_shard``: per block (``a``, ``b``) then the root, or the root only."""
    from torch.distributed.fsdp import fully_shard

    model = _model(dtype, "meta" if meta else "cpu")
    mesh = cpu_mesh()
    if wrap == "blocks":
        for block in (model.a, model.b):
            fully_shard(block, mesh=mesh, **shard_kwargs)
    fully_shard(model, mesh=mesh, **shard_kwargs)
    return model


def _materialize(model: nn.Module, dtype: torch.dtype) -> None:
    """``to_empty`` then each shard taken from the model built normally (same seed)."""
    from torch.distributed.tensor import distribute_tensor

    model.to_empty(device="cpu")
    full = dict(_model(dtype).named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(distribute_tensor(full[name].detach(), p.device_mesh, p.placements).to_local())


def _run(rank: int, world: int, *, wrap: str = "blocks", dtype: torch.dtype = torch.float32, meta: bool = False,
         comm: bool = True, accum: int = 1, moments: str = "fp8_weights", keep_unsharded: bool = False,
         weights_only: bool = False, **shard_kwargs) -> dict:  # fmt: skip
    """STEPS steps of one FSDP2 route: every rank's mean loss, the first step's gradients, the weights after.
    ``keep_unsharded``: no resharding after the backward of the micro-batches that do not synchronize.
    ``weights_only``: ``FP8CommState(fp8_params=...)`` of the FP8Linear weights (the other gradients in fp32)."""
    from lightning_fp8 import FP8Linear
    from lightning_fp8.distributed import FP8CommState, enable_fp8_fsdp2

    model = _sharded(wrap, dtype, meta, **shard_kwargs)
    weights = [m.weight for m in model.modules() if isinstance(m, FP8Linear)]
    state = FP8CommState(fp8_params=weights) if weights_only else None
    enable_fp8_fsdp2(model, state, reduce_scatter=comm, weight_all_gather=comm)
    if meta:
        _materialize(model, dtype)
    opt = _optimizer(model, low_precision_moments=moments)
    out: dict = {"losses": []}
    for step in range(STEPS):
        total = torch.zeros(())
        for m in range(accum):
            model.set_requires_gradient_sync(m == accum - 1)
            if keep_unsharded:
                model.set_reshard_after_backward(m == accum - 1)
            loss = _loss(model, _batch(rank, step * accum + m, dtype)) / accum
            loss.backward()
            total += loss.detach()
        dist.all_reduce(total)
        out["losses"].append(total.item() / world)
        if step == 0:
            out["grads"] = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    out["weights"] = _weights(model)
    return out


def _nan_run(rank: int, world: int) -> dict:
    """A NaN in rank 1's input at step 1 (through the FP8 reduce-scatter) and in rank 1's gradient shard of ``a`` at
    step 2 (after it): an FP8GradScaler skips both steps on every rank."""
    from lightning_fp8 import FP8GradScaler
    from lightning_fp8.distributed import FP8CommState, enable_fp8_fsdp2

    model = _sharded()
    scaler = FP8GradScaler(init_scale=2.0**4)
    enable_fp8_fsdp2(model, FP8CommState(grad_scaler=scaler))
    opt = _optimizer(model)
    stepped = []
    for step in range(STEPS):
        ids, x = _batch(rank, step, torch.float32)
        if step == 1 and rank == 1:
            x[2, 3] = math.nan
        scaler.scale_loss(_loss(model, (ids, x))).backward()
        if step == 2 and rank == 1:
            model.a.weight.grad.to_local().view(-1)[0] = math.nan
        stepped.append(scaler.step(opt))
        scaler.update()
        opt.zero_grad()
    local = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    return {"stepped": stepped, "weights": _weights(model), "local": local, "scale": scaler.scale}


def _clip_run(rank: int, world: int) -> dict:
    """torch's clip_grad_norm_ and FP8GradScaler.clip_grad_norm_ (mu = 16) over the DTensor gradients of one step."""
    from lightning_fp8 import FP8GradScaler
    from lightning_fp8.distributed import FP8CommState, enable_fp8_fsdp2

    out = {}
    for how in ("torch", "scaler"):
        model = _sharded()
        scaler = FP8GradScaler(init_scale=2.0**4)
        enable_fp8_fsdp2(model, FP8CommState(grad_scaler=scaler))
        params = [p for p in model.parameters() if p.requires_grad]
        loss = _loss(model, _batch(rank, 0, torch.float32))
        if how == "torch":
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm=0.01)
            mu = 1.0
        else:
            scaler.scale_loss(loss).backward()
            norm = scaler.clip_grad_norm_(params, max_norm=0.01)
            mu = scaler.loss_scale
        after = torch.stack([_full(p.grad).norm() for p in params]).norm().item() / mu
        out[how] = {"norm": _full(norm).item(), "after": after}
    return out


_steps = functools.partial(routes.steps, rows=ROWS)


def _resume_run(rank: int, world: int) -> dict:
    """A full state dict (model and FP8AdamW, fp16 moments; the layers' scaling states beside it) saved after step 1,
    through torch.save / torch.load(weights_only=True), loaded into a fresh FSDP2 model and optimizer: the next steps'
    losses and weights against the uninterrupted run; and loaded into a plain model: its output against the sharded
    model's.

    Every rank gathers the full state dict and loads its own copy: with ``cpu_offload`` only rank 0 holds it, and
    ``set_state_dict(..., broadcast_from_rank0=True)`` with empty dicts on the other ranks hangs in torch 2.13 (they
    take ``optim_only=not model_state_dict`` and skip the model's broadcast that rank 0 enters), with a plain model
    and torch's AdamW too."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from lightning_fp8 import fp8_state_dict, load_fp8_state_dict
    from lightning_fp8.distributed import enable_fp8_fsdp2

    def build():
        model = _sharded()
        enable_fp8_fsdp2(model)
        # fp16 first moments: gloo has no FP8 collectives, which a full state dict gathers (test_fsdp_checkpoint.py)
        return model, _optimizer(model, exp_avg_dtype=torch.float16)

    model, opt = build()
    _steps(rank, model, opt, 0, 1)
    options = StateDictOptions(full_state_dict=True)  # every rank's (cpu_offload: rank 0's only)
    msd, osd = get_state_dict(model, opt, options=options)
    buffer = io.BytesIO()
    torch.save({"model": msd, "optim": osd, "fp8": fp8_state_dict(model)}, buffer)  # scaling states: this rank's
    continued = _steps(rank, model, opt, 1, 2)
    weights = _weights(model)  # before a forward without backward, which leaves the root's parameters unsharded
    batch = _batch(rank, 9, torch.float32)
    with torch.no_grad():
        sharded_out = model(*batch)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    fresh, fresh_opt = build()
    set_state_dict(fresh, fresh_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"],
                   options=options)  # fmt: skip
    load_fp8_state_dict(fresh, loaded["fp8"])
    resumed = _steps(rank, fresh, fresh_opt, 1, 2)
    plain = _model()
    plain.load_state_dict(get_state_dict(fresh, fresh_opt, options=options)[0])
    load_fp8_state_dict(plain, fp8_state_dict(fresh))
    with torch.no_grad():
        plain_out = plain(*batch)
    return {
        "continued": continued, "resumed": resumed, "weights": weights, "resumed_weights": _weights(fresh),
        "sharded_out": sharded_out, "plain_out": plain_out,
    }  # fmt: skip


def _sharded_resume_run(rank: int, world: int) -> dict:
    """A sharded checkpoint (torch.distributed.checkpoint; E4M3 and fp16 moments for every parameter, each shard's
    scales) saved after step 1 and loaded into a fresh FSDP2 model and optimizer: the next steps against the
    uninterrupted run."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from lightning_fp8 import fp8_state_dict, load_fp8_state_dict
    from lightning_fp8.distributed import enable_fp8_fsdp2

    def build():
        model = _sharded()
        enable_fp8_fsdp2(model)
        return model, _optimizer(model, low_precision_moments="all")

    directory = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(directory)
    model, opt = build()
    _steps(rank, model, opt, 0, 1)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory[0])
    scaling = fp8_state_dict(model)
    continued = _steps(rank, model, opt, 1, 2)
    fresh, fresh_opt = build()
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=directory[0])
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    load_fp8_state_dict(fresh, scaling)
    resumed = _steps(rank, fresh, fresh_opt, 1, 2)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(directory[0])
    return {"continued": continued, "resumed": resumed, "weights": _weights(model), "resumed_weights": _weights(fresh)}


ROUTES = {
    "blocks": {},
    "root": {"wrap": "root"},
    "no_reshard": {"reshard_after_forward": False},
    "root_no_reshard": {"wrap": "root", "reshard_after_forward": False},
    "comm_off": {"comm": False},
    "meta": {"meta": True},
    "accum": {"accum": 3},
    "accum_comm_off": {"accum": 3, "comm": False},
    "accum_unsharded": {"accum": 3, "keep_unsharded": True},
    "bf16": {"dtype": torch.bfloat16},
    "bf16_comm_off": {"dtype": torch.bfloat16, "comm": False},
    "mp_policy": {"mp_policy": "bf16"},
    "mp_policy_comm_off": {"mp_policy": "bf16", "comm": False},
    # E4M3 / fp16 moments for every parameter, the 2-row head's too (an empty shard on 3 ranks)
    "all_moments": {"moments": "all"},
    # only the FP8Linear weights' gradients in FP8, the others beside them in fp32 (in the same FSDP modules)
    "fp8_weights_only": {"weights_only": True},
    "root_fp8_weights_only": {"wrap": "root", "weights_only": True},
}


def _route(rank: int, world: int, name: str) -> dict:
    kwargs = dict(ROUTES[name])
    if kwargs.get("mp_policy") == "bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return _run(rank, world, **kwargs)


def _worker(rank: int, world: int) -> dict:
    parts = {name: (lambda name=name: _route(rank, world, name)) for name in ROUTES}
    parts["reference"] = lambda: _reference(world)
    parts["reference_accum"] = lambda: _reference(world, accum=3)
    parts["reference_bf16"] = lambda: _reference(world, torch.bfloat16)
    parts["reference_skip"] = lambda: _reference(world, skip=(1, 2))
    parts["reference_all_moments"] = lambda: _reference(world, low_precision_moments="all")
    parts["nan"] = lambda: _nan_run(rank, world)
    parts["clip"] = lambda: _clip_run(rank, world)
    parts["resume"] = lambda: _resume_run(rank, world)
    parts["sharded_resume"] = lambda: _sharded_resume_run(rank, world)
    return run_parts(parts)


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    return {world: run_workers(_worker, world, timeout=600) for world in (2, 3)}


_close = routes.far_from


def _result(runs: dict, world: int, name: str) -> list:
    return part_results(runs[world], name)


REFERENCE = {"accum": "reference_accum", "accum_comm_off": "reference_accum", "accum_unsharded": "reference_accum",
             "bf16": "reference_bf16",
             "bf16_comm_off": "reference_bf16", "all_moments": "reference_all_moments"}  # fmt: skip


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("route", list(ROUTES))
def test_route_matches_the_unsharded_model_on_the_global_batch(runs, world, route):
    got = _result(runs, world, route)
    ref = _result(runs, world, REFERENCE.get(route, "reference"))[0]
    low = "bf16" in route or "mp_policy" in route
    grad_db = GRAD_BF16_SQNR_DB if low else GRAD_SQNR_DB
    for rank, run in enumerate(got):
        assert run["grads"].keys() == ref["grads"].keys()  # the frozen layer has none, every other parameter one
        assert _close(run["grads"], ref["grads"], grad_db) == {}, rank
        assert run["losses"][0] == pytest.approx(ref["losses"][0], rel=LOSS_RTOL)
        start = ref["start"]
        updates = {n: w - start[n] for n, w in run["weights"].items() if n in ref["grads"]}
        ref_updates = {n: ref["weights"][n] - start[n] for n in updates}
        assert _close(updates, ref_updates, UPDATE_SQNR_DB) == {}, rank
        assert all(torch.equal(run["weights"][n], start[n]) for n in start if n.startswith("frozen"))
        # every rank gathers the same full weights
        assert all(torch.equal(run["weights"][n], got[0]["weights"][n]) for n in start)


# Routes that must train bit for bit alike: where the per-parameter FP8 scales come from global amaxes, neither the
# grouping of parameters into FSDP modules, nor resharding after the forward or the backward, nor materializing from
# the meta device changes a value.
IDENTICAL = [("blocks", "root"), ("blocks", "no_reshard"), ("blocks", "root_no_reshard"), ("blocks", "meta"),
             ("accum", "accum_unsharded"), ("fp8_weights_only", "root_fp8_weights_only")]  # fmt: skip


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("one", "other"), IDENTICAL, ids=["-".join(pair) for pair in IDENTICAL])
def test_routes_that_must_agree_bit_for_bit(runs, world, one, other):
    for a, b in zip(_result(runs, world, one), _result(runs, world, other), strict=True):
        assert a["losses"] == b["losses"]
        for key in ("grads", "weights"):
            assert a[key].keys() == b[key].keys()
            assert all(torch.equal(a[key][n], b[key][n]) for n in a[key]), key


@pytest.mark.parametrize("world", [2, 3])
def test_fp8_communication_stays_close_to_the_same_route_without_it(runs, world):
    for fp8, off in zip(_result(runs, world, "blocks"), _result(runs, world, "comm_off"), strict=True):
        assert _close(fp8["grads"], off["grads"], GRAD_SQNR_DB) == {}


@pytest.mark.parametrize("world", [2, 3])
def test_a_nan_on_one_rank_skips_the_step_on_every_rank(runs, world):
    got = _result(runs, world, "nan")
    ref = _result(runs, world, "reference_skip")[0]
    for run in got:
        assert run["stepped"] == [True, False, False]
        assert run["scale"] == got[0]["scale"] < 2.0**4
        assert all(bool(torch.isfinite(t).all()) for t in run["local"].values())
        start = ref["start"]
        updates = {n: run["weights"][n] - start[n] for n in ref["grads"]}
        ref_updates = {n: ref["weights"][n] - start[n] for n in updates}
        assert _close(updates, ref_updates, UPDATE_SQNR_DB) == {}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("how", ["torch", "scaler"])
def test_clip_grad_norm_over_dtensor_gradients(runs, world, how):
    ref = _result(runs, world, "reference")[0]
    for run in _result(runs, world, "clip"):
        assert run[how]["norm"] == pytest.approx(ref["norm"], rel=NORM_RTOL)
        assert run[how]["after"] == pytest.approx(0.01, rel=1e-3)


@pytest.mark.parametrize("world", [2, 3])
def test_a_sharded_checkpoint_saved_mid_run_resumes_bit_for_bit(runs, world):
    for run in _result(runs, world, "sharded_resume"):
        assert run["resumed"] == run["continued"]
        assert all(torch.equal(run["resumed_weights"][n], w) for n, w in run["weights"].items())


@pytest.mark.parametrize("world", [2, 3])
def test_a_full_state_dict_saved_mid_run_resumes_bit_for_bit(runs, world):
    for run in _result(runs, world, "resume"):
        assert run["resumed"] == run["continued"]
        assert all(torch.equal(run["resumed_weights"][n], w) for n, w in run["weights"].items())
        # a plain model from the full state dict: the sharded model's output, up to its FP8 casts (the same values)
        torch.testing.assert_close(run["plain_out"], run["sharded_out"], rtol=0, atol=0)
