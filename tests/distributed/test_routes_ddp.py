"""DDP with ``fp8_allreduce_hook``, route by route (from a route sweep of FP8 gradient communication under DDP).

Each route is checked against an independent reference computed in the same processes: a copy of the model without
DDP run on each rank's own batch, its gradients all-gathered and averaged in float64 (zeros where a rank has none),
and, where weights are compared, the same optimizer stepped on that float64 mean. FP8 results are held to the SQNR of
two E5M2 roundings (``tolerances.py``); the same route with DDP's default fp32 all-reduce is held to the reference
too, which shows the reference itself is right.

Routes: DDP's constructor options (buckets of one tensor and one bucket for all, ``gradient_as_bucket_view``,
``static_graph``, ``find_unused_parameters`` with a branch some ranks skip, ``broadcast_buffers=False``, bf16 and
mixed-dtype parameters, ``FP8CommState(fp8_params=...)`` with the rest of a bucket reduced exactly) on a model mixing
FP8Linear layers with an embedding, a LayerNorm, biases, a frozen layer and an empty parameter; three ranks (the
world) and two (a ``new_group`` of ranks 1 and 2 of the three); gradient accumulation under ``no_sync``; uneven inputs
under ``ddp.join()``; the gradient scaler tied to the hook (a NaN or inf on one rank skips the step on every rank,
leaving bit-identical replicas; a gradient past E5M2's maximum on one rank); gradients 1e-30 to 1e30 apart, zero and
empty ones, a scalar; a checkpoint of the hook's state mid-run; one state on two models.

One spawn of three processes runs every route (process start-up dominates the runtime).
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations as objects.
import copy
import io
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed.launch import part_results, run_parts, run_workers
from tests.distributed.tolerances import ALLREDUCE_E5M2_SQNR_DB, MIN_SQNR_NUMEL
from tests.numerics import sqnr

pytestmark = pytest.mark.slow

WORLD = 3
PAIR = [1, 2]  # the two-rank process group, a new_group of the three
STEPS = 3
NAN_STEP = 1
# A tensor under MIN_SQNR_NUMEL elements is held to an elementwise bound instead: each rank's E5M2 cast and the
# requantized mean err by at most 2**-3 of the tensor's amax each; a quarter of the amax catches a flushed or wrong one.
SMALL_TENSOR_RTOL = 2.0**-2
# DDP's own fp32 all-reduce against the float64 reference: fp32 rounding of the sum (bf16 parameters: the gradients
# themselves are bf16, ~50 dB). Far above any FP8 result, so it shows the reference is the mean DDP computes.
EXACT_SQNR_DB = {torch.float32: 100.0, torch.bfloat16: 40.0}
# DDP constructor options of each route (bucket_cap_mb=0.001: 262 fp32 values, so most buckets hold one tensor).
ROUTES = {
    "small_buckets": {"bucket_cap_mb": 0.001},
    "one_bucket": {"bucket_cap_mb": 100},
    "bucket_view": {"bucket_cap_mb": 0.001, "gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
    "unused_branch": {"find_unused_parameters": True},
    "no_broadcast": {"broadcast_buffers": False},
    "bf16": {"bucket_cap_mb": 0.001},
    "mixed_dtypes": {"bucket_cap_mb": 0.001},
    # FP8CommState(fp8_params=the FP8Linear weights): the rest of each bucket is all-reduced in its own dtype.
    "fp8_params": {"bucket_cap_mb": 100, "find_unused_parameters": True, "gradient_as_bucket_view": True},
}
FP8_WEIGHTS = {"a.weight", "branch.weight", "b.weight"}


class Net(nn.Module):
    """FP8Linear layers (a, branch, b; frozen after conversion too) beside an embedding, a LayerNorm, biases and an
    empty parameter; ``branch`` runs only where ``use_branch``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 32)
        self.a = nn.Linear(32, 48)
        self.norm = nn.LayerNorm(48)
        self.branch = nn.Linear(48, 48)
        self.b = nn.Linear(48, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.empty = nn.Parameter(torch.zeros(0))

    def forward(self, ids: torch.Tensor, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = self.norm(torch.relu(self.a(x + self.emb(ids))))
        if use_branch:
            h = h + self.branch(h)
        return self.frozen(self.b(h)) + self.empty.sum()


def _model(dtype: torch.dtype = torch.float32, fp8: bool = True, mixed: bool = False) -> nn.Module:
    """``mixed``: the linear layers in ``dtype``, the embedding and the norm in fp32 (DDP buckets by dtype)."""
    from lightning_fp8 import convert_to_fp8

    torch.manual_seed(0)
    model = Net()
    for layer in (model.a, model.branch, model.b, model.frozen) if mixed else (model,):
        layer.to(dtype)
    return convert_to_fp8(model) if fp8 else model


def _batch(rank: int, step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 10, (8,), generator=gen), torch.randn(8, 32, generator=gen).to(dtype)


def _loss(model: nn.Module, rank: int, step: int, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor:
    return model(*_batch(rank, step, dtype), **kwargs).float().square().mean()


def _mean64(grad: torch.Tensor | None, like: torch.Tensor, group=None) -> torch.Tensor:
    """The float64 mean over ``group`` of each rank's ``grad`` (zeros where a rank has none)."""
    g = grad.double() if grad is not None else torch.zeros(like.shape, dtype=torch.float64)
    parts = [torch.empty_like(g) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, g, group=group)
    return sum(parts) / len(parts)


def _reference(model: nn.Module, loss_fn, group=None) -> dict[str, torch.Tensor]:
    """The float64 mean over ``group`` of the gradients of a copy of ``model`` (without DDP) under ``loss_fn``."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    loss_fn(ref).backward()
    return {n: _mean64(p.grad, p, group) for n, p in ref.named_parameters() if p.requires_grad}


def _closeness(grad: torch.Tensor, ref: torch.Tensor) -> float | bool:
    """SQNR (dB) of a tensor of MIN_SQNR_NUMEL elements or more, else whether it is within SMALL_TENSOR_RTOL."""
    if ref.numel() >= MIN_SQNR_NUMEL:
        return sqnr(grad, ref)
    return bool(((grad.double() - ref).abs() <= SMALL_TENSOR_RTOL * ref.abs().max()).all())


def _same_on_every_rank(t: torch.Tensor, group=None) -> bool:
    hi, lo = t.detach().clone(), t.detach().clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    return torch.equal(hi, lo)


def _hooked(ddp: DDP, **state_kwargs):
    from lightning_fp8.distributed import FP8CommState, fp8_allreduce_hook

    state = FP8CommState(ddp.process_group, **state_kwargs)
    ddp.register_comm_hook(state, fp8_allreduce_hook)
    return state


# ------------------------------------------------------------------------------------------------------ the routes
def _route(rank: int, group, route: str, comm: str) -> list[dict]:
    """STEPS backwards of one DDP route: per step, each gradient's closeness to the float64 mean, whether it is the
    same on every rank, and the step flag. With an unused branch the group's rank 1 skips it but at NAN_STEP."""
    kwargs = dict(ROUTES[route])
    dtype = torch.bfloat16 if route in ("bf16", "mixed_dtypes") else torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # broadcast_buffers' deprecation notice in recent torch
        ddp = DDP(_model(dtype, mixed=route == "mixed_dtypes"), process_group=group, **kwargs)
    weights = [p for n, p in ddp.module.named_parameters() if n in FP8_WEIGHTS]
    state_kwargs = {"fp8_params": weights} if route == "fp8_params" else {}
    state = _hooked(ddp, **state_kwargs) if comm == "fp8" else None
    steps = []
    for step in range(STEPS):
        use_branch = not (route in ("unused_branch", "fp8_params") and dist.get_rank(group) == 1 and step != NAN_STEP)

        def loss_fn(m, step=step, use_branch=use_branch):
            return _loss(m, rank, step, dtype, use_branch=use_branch)

        ref = _reference(ddp.module, loss_fn, group)
        ddp.zero_grad(set_to_none=True)
        loss_fn(ddp).backward()
        grads = dict(ddp.module.named_parameters())
        steps.append({
            "closeness": {n: _closeness(grads[n].grad, r) for n, r in ref.items() if r.numel()},
            "same": all(_same_on_every_rank(grads[n].grad, group) for n, r in ref.items() if r.numel()),
            "empty_grad": tuple(ddp.module.empty.grad.shape),
            "frozen_grad": ddp.module.frozen.weight.grad,
            "step_ok": state.check_step() if state is not None else True,
        })  # fmt: skip
    return steps


def _no_sync(rank: int, bucket_view: bool, nan: bool = False, k: int = 3) -> dict:
    """k micro-batches, the first k - 1 under ``no_sync``: the reduced gradient is the mean of the accumulated sums.
    With ``nan`` the last rank's first micro-batch holds a NaN: the synchronized backward flags it on every rank."""
    model = _model()
    ref = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=0.001, gradient_as_bucket_view=bucket_view)
    state = _hooked(ddp)
    flags = []
    for i in range(k):
        ids, x = _batch(rank, i)
        if nan and i == 0 and rank == WORLD - 1:
            x[0, 0] = math.nan
        if not nan:
            ref(ids, x).square().mean().backward()
        if i < k - 1:
            with ddp.no_sync():
                ddp(ids, x).square().mean().backward()
        else:
            ddp(ids, x).square().mean().backward()
        flags.append(state.check_step())
    if nan:
        return {"flags": flags}
    pairs = zip(model.named_parameters(), ref.parameters(), strict=True)
    closeness = {n: _closeness(p.grad, _mean64(q.grad, q)) for (n, p), q in pairs if q.requires_grad and q.numel()}
    return {"flags": flags, "closeness": closeness}


def _joined(rank: int, comm: str) -> list[dict[str, torch.Tensor]]:
    """Uneven inputs under ``ddp.join()``: the last rank runs one step, the others three (the joined rank shadows
    their all-reduces with zero buckets through the hook). Gradients of each step, to compare with DDP's default."""
    model = _model(fp8=False)
    ddp = DDP(model, bucket_cap_mb=0.001)
    if comm == "fp8":
        _hooked(ddp)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    grads = []
    with ddp.join():
        for step in range(1 if rank == WORLD - 1 else STEPS):
            _loss(ddp, rank, step).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()
    return grads


def _scaler_skips(rank: int, group, optimizer: str, poison: float) -> dict:
    """FP8GradScaler tied to the hook (FP8CommState(grad_scaler=...)) and to the optimizer; a non-finite input on the
    group's last rank at NAN_STEP. Every rank must skip that step alone, halve mu once, keep bit-identical weights."""
    from lightning_fp8 import FP8AdamW, FP8GradScaler

    model = _model()
    scaler = FP8GradScaler(model=model, init_scale=2.0**4, process_group=group)
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "fp8adamw":
        opt = FP8AdamW(params, lr=1e-2, grad_scaler=scaler)
    else:
        opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.001)
    _hooked(ddp, grad_scaler=scaler)
    stepped, mus = [], []
    last = dist.get_world_size(group) - 1
    for step in range(STEPS + 1):
        ids, x = _batch(rank, step)
        if step == NAN_STEP and dist.get_rank(group) == last:
            x[0, 0] = poison
        scaler.scale_loss(ddp(ids, x).square().mean()).backward()
        stepped.append(scaler.step(opt))
        scaler.update()
        opt.zero_grad()
        mus.append(float(scaler.scale))
    values = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
    return {"stepped": stepped, "mus": mus, "skipped": scaler.skipped_steps,
            "finite": all(bool(torch.isfinite(v).all()) for v in values.values()),
            "identical": {k: _same_on_every_rank(v.float(), group) for k, v in values.items()}}  # fmt: skip


def _past_e5m2_max(rank: int) -> dict:
    """Rank 0's gradients past E5M2's maximum (57344): the hook casts with the shared amax's scale, so nothing
    saturates; the scaler (growth_interval=1) sees the amax without headroom and keeps mu, then grows it after a step
    with small gradients. With SGD and no hook the scaler would measure fp32 gradients, far from fp32's maximum, and
    grow at once."""
    from lightning_fp8 import FP8GradScaler

    torch.manual_seed(0)
    layer = nn.Linear(64, 64, bias=False)
    ref = copy.deepcopy(layer)
    scaler = FP8GradScaler(growth_interval=1)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-9)
    ddp = DDP(layer)
    _hooked(ddp, grad_scaler=scaler)
    out = {"mus": []}
    for step, size in enumerate((3e4, 1e-2)):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * step + rank))
        x = x * (size if rank == 0 else 1.0)
        scaler.scale_loss(ddp(x).sum()).backward()
        ref.zero_grad()
        ref(x).sum().backward()
        mean = _mean64(ref.weight.grad, ref.weight)
        if step == 0:
            out["amax"], out["sqnr"] = float(mean.abs().max()), sqnr(layer.weight.grad, mean)
        out.setdefault("stepped", []).append(scaler.step(opt))
        scaler.update()
        opt.zero_grad()
        out["mus"].append(float(scaler.scale))
    return out


class _Coefficients(nn.Module):
    """Parameters whose gradients are the given coefficients: ``loss = sum_i (p_i * c_i).sum()``."""

    MAGNITUDES = (1e-30, 1e-10, 0.0, 1.0, 1e10, 1e30)

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        shapes = [(40,)] * len(self.MAGNITUDES) + [(0,), (), (2,)]
        self.params = nn.ParameterList([nn.Parameter(torch.randn(s)) for s in shapes])

    def forward(self, coefficients: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * c).sum() for p, c in zip(self.params, coefficients, strict=True))


def _magnitudes(rank: int) -> dict:
    """Per-tensor gradients 1e-30 to 1e30, an all-zero one, an empty one, a scalar and a 2-element one: in one bucket
    and in buckets of one tensor (the second backward, after DDP rebuilt its buckets)."""
    gen = torch.Generator().manual_seed(rank)
    mags = [*_Coefficients.MAGNITUDES, 1.0, 1.0, 1.0]
    coefficients = [torch.randn(p.shape, generator=gen) * m for p, m in zip(_Coefficients().params, mags, strict=True)]
    means = [_mean64(c, c) for c in coefficients]
    out = {}
    for cap in (0.0001, 100):
        model = _Coefficients()
        ddp = DDP(model, bucket_cap_mb=cap)
        state = _hooked(ddp)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            ddp(coefficients).backward()
        got = [p.grad for p in model.params]
        out[cap] = {
            "closeness": [_closeness(g, m) for g, m in zip(got, means, strict=True) if m.numel() and m.abs().max() > 0],
            "zero_stays_zero": bool((got[2] == 0).all()),
            "empty": tuple(got[6].shape),
            "step_ok": state.check_step(),
        }
    return out


def _sgd_weights(rank: int, comm: str) -> dict[str, float]:
    """SGD with momentum, three steps: each weight's change against the same optimizer on the float64 mean."""
    model = _model(fp8=False)
    ref = copy.deepcopy(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ddp = DDP(model, bucket_cap_mb=0.001)
    if comm == "fp8":
        _hooked(ddp)
    opt, ref_opt = (torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
                    for m in (model, ref))  # fmt: skip
    for step in range(STEPS):
        _loss(ddp, rank, step).backward()
        _loss(ref, rank, step).backward()
        for p in ref.parameters():
            if p.grad is not None:
                p.grad = _mean64(p.grad, p).float()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    pairs = zip(model.named_parameters(), ref.parameters(), strict=True)
    return {n: sqnr(p - start[n], q - start[n]) for (n, p), q in pairs if q.requires_grad and p.numel()}


def _resume(rank: int) -> dict:
    """FP8AdamW, FP8GradScaler and the hook's state saved after two steps and loaded into a fresh run: two more steps
    end bit for bit where the uninterrupted run does."""
    from lightning_fp8 import FP8AdamW, FP8GradScaler, fp8_state_dict, load_fp8_state_dict

    def build():
        model = _model()
        scaler = FP8GradScaler(model=model, init_scale=2.0**4)
        opt = FP8AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, grad_scaler=scaler)
        ddp = DDP(model)
        return model, scaler, opt, ddp, _hooked(ddp, grad_scaler=scaler)

    def train(run, steps):
        _, scaler, opt, ddp, _ = run
        for step in steps:
            scaler.scale_loss(_loss(ddp, rank, step)).backward()
            opt.step()  # routes through the scaler: step and update
            opt.zero_grad()

    whole = build()
    train(whole, range(4))
    first = build()
    train(first, range(2))
    model, scaler, opt, _, state = first
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "fp8": fp8_state_dict(model), "opt": opt.state_dict(),
                "scaler": scaler.state_dict(), "comm": state.state_dict()}, blob)  # fmt: skip
    blob.seek(0)
    saved = torch.load(blob, weights_only=True)
    resumed = build()
    model, scaler, opt, _, state = resumed
    model.load_state_dict(saved["model"])
    load_fp8_state_dict(model, saved["fp8"])
    opt.load_state_dict(saved["opt"])
    scaler.load_state_dict(saved["scaler"])
    state.load_state_dict(saved["comm"])
    train(resumed, range(2, 4))
    want, got = whole[0].state_dict(), resumed[0].state_dict()
    return {"differ": [k for k in want if not torch.equal(want[k], got[k])],
            "comm": (whole[4].state_dict(), resumed[4].state_dict())}  # fmt: skip


def _two_models(rank: int) -> dict:
    """One FP8CommState registered on two DDP models: each model's gradients are its own mean; the step flag is the
    state's, so a NaN in the second model's backward on one rank is seen by every rank."""
    from lightning_fp8.distributed import FP8CommState, fp8_allreduce_hook

    state = FP8CommState()
    models = [_model(), _model()]
    out = {}
    for i, model in enumerate(models):
        ref = _reference(model, lambda m, i=i: _loss(m, rank, i))
        ddp = DDP(model)
        ddp.register_comm_hook(state, fp8_allreduce_hook)
        _loss(ddp, rank, i).backward()
        out[i] = {n: _closeness(p.grad, ref[n]) for n, p in model.named_parameters() if n in ref and p.numel()}
        out[f"step_ok_{i}"] = state.check_step()
    ddp(*_batch(rank, 5)).square().mean().mul(math.nan if rank == 1 else 1.0).backward()
    out["nan_step_ok"] = state.check_step()
    return out


def _worker(rank: int, world: int) -> dict:
    # Two ranks: a group without rank 0, so that a group rank taken for a global one (or the reverse) shows.
    pair = dist.new_group(PAIR)  # every rank creates it; rank 0 is no member
    parts = {}
    for route in ROUTES:
        for comm in ("fp32", "fp8"):
            parts[f"{route}/{comm}/3"] = lambda route=route, comm=comm: _route(rank, None, route, comm)
            if rank in PAIR:
                parts[f"{route}/{comm}/2"] = lambda route=route, comm=comm: _route(rank, pair, route, comm)
    parts.update({
        "no_sync": lambda: _no_sync(rank, bucket_view=False),
        "no_sync_bucket_view": lambda: _no_sync(rank, bucket_view=True),
        "no_sync_nan": lambda: _no_sync(rank, bucket_view=False, nan=True),
        "join/fp32": lambda: _joined(rank, "fp32"),
        "join/fp8": lambda: _joined(rank, "fp8"),
        "scaler/fp8adamw/nan": lambda: _scaler_skips(rank, None, "fp8adamw", math.nan),
        "scaler/fp8adamw/inf": lambda: _scaler_skips(rank, None, "fp8adamw", math.inf),
        "scaler/sgd/nan": lambda: _scaler_skips(rank, None, "sgd", math.nan),
        "past_e5m2_max": lambda: _past_e5m2_max(rank),
        "magnitudes": lambda: _magnitudes(rank),
        "sgd/fp32": lambda: _sgd_weights(rank, "fp32"),
        "sgd/fp8": lambda: _sgd_weights(rank, "fp8"),
        "resume": lambda: _resume(rank),
        "two_models": lambda: _two_models(rank),
    })  # fmt: skip
    if rank in PAIR:
        parts["scaler/sgd/nan/2"] = lambda: _scaler_skips(rank, pair, "sgd", math.nan)
    return run_parts(parts)


@pytest.fixture(scope="module")
def results() -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_workers(_worker, WORLD, timeout=300)


def _ranks(results: list[dict], name: str, world: int = WORLD) -> list:
    """Every rank's result of the part ``name``: those of the world, or of PAIR where ``world`` is 2."""
    return part_results(results if world == WORLD else [results[r] for r in PAIR], name)


def _fp8_close(closeness: dict | list) -> bool:
    values = closeness.values() if isinstance(closeness, dict) else closeness
    return all(c is True or (not isinstance(c, bool) and c >= ALLREDUCE_E5M2_SQNR_DB) for c in values)


# ------------------------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("world", [3, 2])
@pytest.mark.parametrize("route", list(ROUTES))
def test_ddp_route_gives_the_mean_through_fp8(results, route, world):
    dtype = torch.bfloat16 if route in ("bf16", "mixed_dtypes") else torch.float32
    exact_runs, fp8_runs = (_ranks(results, f"{route}/{comm}/{world}", world) for comm in ("fp32", "fp8"))
    for exact, fp8 in zip(exact_runs, fp8_runs, strict=True):
        for step in exact:  # DDP's own all-reduce is the reference's mean
            assert all(c is True or c >= EXACT_SQNR_DB[dtype] for c in step["closeness"].values()), step
        for step in fp8:
            assert _fp8_close(step["closeness"]), (route, world, step["closeness"])
            assert step["same"] and step["step_ok"], step
            assert step["empty_grad"] == (0,) and step["frozen_grad"] is None, step
        assert set(fp8[0]["closeness"]) == {"emb.weight", "a.weight", "a.bias", "norm.weight", "norm.bias",
                                            "branch.weight", "branch.bias", "b.weight", "b.bias"}  # fmt: skip


@pytest.mark.parametrize("world", [3, 2])
def test_gradients_outside_fp8_params_are_reduced_exactly_beside_fp8_ones(results, world):
    for report in _ranks(results, f"fp8_params/fp8/{world}", world):
        for step in report:
            exact = {n: c for n, c in step["closeness"].items() if n not in FP8_WEIGHTS}
            assert all(c is True or c >= EXACT_SQNR_DB[torch.float32] for c in exact.values()), exact
            assert all(step["closeness"][n] < EXACT_SQNR_DB[torch.float32] for n in FP8_WEIGHTS), step  # through FP8


@pytest.mark.parametrize("name", ["no_sync", "no_sync_bucket_view"])
def test_no_sync_accumulation_reduces_the_mean_of_the_accumulated_sums(results, name):
    for report in _ranks(results, name):
        assert report["flags"] == [True, True, True]
        assert _fp8_close(report["closeness"]), report["closeness"]


def test_a_nan_accumulated_under_no_sync_is_flagged_on_every_rank_at_the_synchronized_backward(results):
    for report in _ranks(results, "no_sync_nan"):
        assert report["flags"] == [True, True, False], report


def test_uneven_inputs_under_join_track_the_default_all_reduce(results):
    for exact, fp8 in zip(_ranks(results, "join/fp32"), _ranks(results, "join/fp8"), strict=True):
        assert len(fp8) == len(exact) > 0
        for want, got in zip(exact, fp8, strict=True):
            assert want.keys() == got.keys()
            assert _fp8_close({n: _closeness(got[n], want[n].double()) for n in want if want[n].numel()})


@pytest.mark.parametrize("name", ["scaler/fp8adamw/nan", "scaler/fp8adamw/inf", "scaler/sgd/nan", "scaler/sgd/nan/2"])
def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(results, name):
    world = 2 if name.endswith("/2") else WORLD
    for report in _ranks(results, name, world):
        assert report["stepped"] == [True, False, True, True], report
        assert report["skipped"] == 1 and report["mus"] == [16.0, 8.0, 8.0, 8.0], report
        assert report["finite"] and all(report["identical"].values()), report


def test_gradients_past_the_e5m2_maximum_are_reduced_unclipped_and_hold_mu(results):
    for report in _ranks(results, "past_e5m2_max"):
        assert report["amax"] > 57344.0 and report["sqnr"] >= ALLREDUCE_E5M2_SQNR_DB, report
        assert report["stepped"] == [True, True], report
        assert report["mus"] == [1.0, 2.0], report  # no headroom: kept; then small gradients: grown


@pytest.mark.parametrize("cap", [0.0001, 100])
def test_gradients_of_every_magnitude_zero_and_empty_keep_their_own_scale(results, cap):
    for report in _ranks(results, "magnitudes"):
        run = report[cap]
        assert len(run["closeness"]) == 7 and _fp8_close(run["closeness"]), run
        assert run["zero_stays_zero"] and run["empty"] == (0,) and run["step_ok"], run


def test_sgd_weights_track_the_float64_mean(results):
    for exact, fp8 in zip(_ranks(results, "sgd/fp32"), _ranks(results, "sgd/fp8"), strict=True):
        assert all(c >= EXACT_SQNR_DB[torch.float32] for c in exact.values()), exact
        assert _fp8_close(fp8), fp8


def test_a_run_resumed_from_a_checkpoint_continues_bit_for_bit(results):
    for report in _ranks(results, "resume"):
        assert report["differ"] == [], report
        assert report["comm"][0] == report["comm"][1], report


def test_one_state_on_two_models_reduces_each_and_shares_the_step_flag(results):
    for report in _ranks(results, "two_models"):
        for i in (0, 1):
            assert _fp8_close(report[i]) and len(report[i]) == 9, report[i]
            assert report[f"step_ok_{i}"], report
        assert report["nan_step_ok"] is False, report
