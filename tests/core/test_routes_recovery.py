"""NaN detection and recovery, route by route, each against a reference written here (a route sweep).

The same recovery is reached by different routes and checked against hand-computed values, never against the code
under test: the optimizer routes (``FP8GradScaler.step`` of ``torch.optim.SGD`` / ``AdamW``, ``FP8AdamW`` at O1 and
O2 stepped by the scaler or stepping itself through ``grad_scaler=``); the non-finite sources (NaN in the input batch,
in one layer's weight gradient through a tensor hook, an infinite loss on one branch, a NaN loss, a layer excluded
from conversion, tied weights left in high precision, a layer of an ``FP8MLP``, two optimizers sharing one scaler where
only one sees NaNs); the counting (exactly ``fallback_after`` consecutive skips trigger, a finite step restarts the
count, mu halves per skip down to ``min_scale``, skipped steps leave weights and optimizer states bit for bit, the
``"lower_lr"`` factor lands once on ``lr`` and ``initial_lr`` and the scheduler goes on from there, ``history``); after
the ``"bf16"`` fallback at O2, the put-back weight is the fp16 master divided by its scale bit for bit, its moments the
FP8/fp16 states dequantized by hand, and the next steps follow ``torch.optim.AdamW`` from those values; a checkpoint
taken between two skips or after the fallback, read with ``torch.load(weights_only=True)`` and resumed into a freshly
converted model, continues bit for bit; and the arguments that cannot work are refused with what to do. The Lightning
and Accelerate routes are in ``tests/integrations/*/test_routes_recovery.py``.
"""

import copy
import io
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_fp8 import FP8MLP, FP8AdamW, FP8GradScaler, FP8Linear, FP8Recipe, convert_to_fp8
from lightning_fp8.recovery import (
    UnfusedMLP,
    fallback_to_high_precision,
    fallen_back_layers,
    put_back_to_high_precision,
)
from lightning_fp8.state import fp8_state_dict, load_fp8_state_dict
from tests.distributed.launch import cpu_mesh, part_results, run_parts, run_workers
from tests.numerics import same

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

# After the fallback the put-back layer trains in fp32 in both FP8AdamW and torch.optim.AdamW; their update formulas
# round differently in the last bit (measured: 1.5e-8 on weights of magnitude ~0.2 after three steps).
AFTER_FALLBACK_ATOL = 1e-6


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _x(i: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(i))


def _nan_grad(param: torch.Tensor):
    """A NaN in ``param``'s gradient alone (the layer's input gradient stays finite): a tensor hook, removed after one
    backward by the caller."""
    return param.register_hook(lambda g: g * math.nan)


def _states(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's per-parameter state, copied (lr and initial_lr are compared apart)."""
    return copy.deepcopy(optimizer.state_dict()["state"])


# ------------------------------------------------------------------------------------------------------- counting
# Iterations whose gradient is non-finite: two skips, a finite step (the count restarts), then three skips: with
# fallback_after=3 only the last one triggers.
BAD = (1, 2, 4, 5, 6)
MU0, MIN_MU = 2.0**3, 2.0**1
# By hand: mu halves at each skip and stops at min_scale; the finite steps keep it (growth_interval is far away).
EXPECTED_MU = [8, 4, 2, 2, 2, 2, 2, 2]
LR0, GAMMA, FACTOR = 0.1, 0.9, 0.25


def _counting_run(route: str, source: str) -> dict:
    """Eight iterations of a two-layer FP8 model (``route`` picks optimizer and how it is stepped; ``source`` where
    the non-finite values come from) with ``nonfinite_fallback="lower_lr"`` and a StepLR stepped every iteration."""
    level = "O1" if route == "FP8AdamW O1, own step" else "O2"
    model = convert_to_fp8(_mlp(), FP8Recipe(opt_level=level))
    scaler = FP8GradScaler(init_scale=MU0, min_scale=MIN_MU, nonfinite_fallback="lower_lr", fallback_after=3,
                           lr_factor=FACTOR, model=model)  # fmt: skip
    if route.startswith("FP8AdamW"):
        optimizer = FP8AdamW(model.parameters(), lr=LR0, weight_decay=0.1, grad_scaler=scaler, opt_level=level)
    else:
        extra = {"momentum": 0.9} if route.endswith("SGD") else {}  # a state that a skipped step must leave
        cls = {"SGD": torch.optim.SGD, "AdamW": torch.optim.AdamW}[route.split()[-1]]
        optimizer = cls(model.parameters(), lr=LR0, weight_decay=0.1, **extra)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    rows = []
    for i in range(8):
        before_weights = [p.detach().clone() for p in model.parameters()]
        before_states = _states(optimizer)
        x = _x(i)
        hook = None
        if i in BAD and source == "input":
            x[3, 5] = math.nan
        if i in BAD and source == "one layer's gradient":
            hook = _nan_grad(model[2].weight)
        loss = model(x).square().mean() * (math.inf if i in BAD and source == "loss" else 1.0)
        scaler.scale_loss(loss).backward()
        if hook is not None:
            hook.remove()
        if route.endswith("own step"):
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()" when the first one is skipped
            warnings.simplefilter("ignore")
            scheduler.step()
        rows.append({
            "mu": scaler.get_scale(),
            "weights kept": all(torch.equal(a, p) for a, p in zip(before_weights, model.parameters(), strict=True)),
            "states kept": same(before_states, _states(optimizer)),
            "lr": optimizer.param_groups[0]["lr"],
            "initial_lr": optimizer.param_groups[0]["initial_lr"],
        })  # fmt: skip
    return {"rows": rows, "history": scaler.history, "skipped": scaler.skipped_steps, "model": model}


ROUTES = ["scaler.step SGD", "scaler.step AdamW", "FP8AdamW O1, own step", "FP8AdamW O2, own step",
          "FP8AdamW O2, scaler.step"]  # fmt: skip


@pytest.mark.parametrize(
    ("route", "source"),
    [*((route, "one layer's gradient") for route in ROUTES), ("FP8AdamW O2, own step", "input"),
     ("scaler.step AdamW", "loss")],
)  # fmt: skip
def test_exactly_fallback_after_consecutive_skips_lower_the_lr_once_and_skips_change_nothing(route, source):
    run = _counting_run(route, source)
    rows = run["rows"]
    assert [row["mu"] for row in rows] == EXPECTED_MU
    for i, row in enumerate(rows):
        # A skipped step leaves every weight and every optimizer state as it was, bit for bit; a finite one moves them.
        assert row["weights kept"] == (i in BAD), i
        assert row["states kept"] == (i in BAD), i
        # StepLR multiplies the lr it finds by GAMMA at every iteration (skipped ones too: the loop steps it); the
        # fallback at iteration 6 (the third consecutive skip) multiplies it by FACTOR once, before that step.
        assert row["lr"] == pytest.approx(LR0 * GAMMA ** (i + 1) * (FACTOR if i >= 6 else 1.0), rel=1e-12), i
        assert row["initial_lr"] == (LR0 * FACTOR if i >= 6 else LR0), i
    assert run["skipped"] == len(BAD)
    actions = [(entry["step"], entry["action"]) for entry in run["history"]]
    # update() counts steps from 1: iteration i is step i + 1. The skips at min_scale are recorded too.
    assert actions == [(2, "skip"), (3, "skip"), (5, "skip"), (6, "skip"), (7, "skip"), (7, "fallback")]
    assert run["history"][-1]["reason"] == f"3 consecutive non-finite steps: lowered the learning rate by {FACTOR}x"
    assert run["history"][-1]["scale"] == MIN_MU
    assert all(isinstance(run["model"][j], FP8Linear) for j in (0, 2))  # "lower_lr" swaps no layer


# ------------------------------------------------------------------------------------------------ what is blamed
class _Tied(nn.Module):
    """Two layers sharing one weight (left in high precision by the conversion) and an FP8 head."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(torch.relu(self.a(x))))


class _WithMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mlp = FP8MLP(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.inp(x))


def _blame_case(case: str) -> tuple[nn.Module, callable]:
    """The model and its loss for one iteration whose non-finite values come from ``case``."""
    if case == "tied weights":
        torch.manual_seed(0)
        model = convert_to_fp8(_Tied())
        return model, lambda x: (_nan_grad(model.a.weight), model(x).square().mean())
    if case == "FP8MLP's fc":
        torch.manual_seed(0)
        model = convert_to_fp8(_WithMLP())
        return model, lambda x: (_nan_grad(model.mlp.fc.weight), model(x).square().mean())
    if case == "excluded layer":
        model = convert_to_fp8(_mlp(), module_filter_fn=lambda module, fqn: fqn != "0")
        return model, lambda x: (_nan_grad(model[0].weight), model(x).square().mean())
    model = convert_to_fp8(_mlp())
    if case == "input":
        return model, lambda x: (None, model(x.index_fill(0, torch.tensor([2]), math.nan)).square().mean())
    if case == "loss":
        return model, lambda x: (None, model(x).square().mean() * math.nan)
    if case == "infinite loss on one branch":  # only the head's gradients: its input is detached on that branch
        return model, lambda x: (
            None,
            model(x).square().mean() + model[2](model[1](model[0](x)).detach()).sum() * math.inf,
        )
    assert case == "one layer's gradient"
    return model, lambda x: (_nan_grad(model[2].weight), model(x).square().mean())


# case -> (the layers put back, by name; what the model holds there afterwards)
BLAMED = {
    "input": ["0", "2"],
    "loss": ["0", "2"],
    "one layer's gradient": ["2"],
    "infinite loss on one branch": ["2"],
    "FP8MLP's fc": ["mlp.fc"],
    "excluded layer": [],  # its gradient is no FP8 layer's: the lr is lowered instead
    "tied weights": [],  # the tied layers stayed nn.Linear; the head's gradient is finite
}


@pytest.mark.parametrize("case", list(BLAMED))
def test_the_bf16_fallback_puts_back_the_layers_the_nonfinite_values_reached_with_their_masters(case):
    model, make_loss = _blame_case(case)
    fp8_names = [name for name, m in model.named_modules() if isinstance(m, FP8Linear)]
    scaler = FP8GradScaler(init_scale=2.0**4, nonfinite_fallback="bf16", fallback_after=2, model=model)
    optimizer = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)  # O2: fp16 masters in the storage
    scaler.scale_loss(model(_x(0)).square().mean()).backward()  # one finite step: states exist
    optimizer.step()
    optimizer.zero_grad()
    # By hand (DESIGN.md's scale convention): the master is the fp16 storage divided by its power-of-two scale.
    masters = {name: model.get_submodule(name).weight.detach().float() / optimizer.state[
        model.get_submodule(name).weight]["master_scale"] for name in fp8_names}  # fmt: skip
    for i in (1, 2):
        hook, loss = make_loss(_x(i))
        scaler.scale_loss(loss).backward()
        if hook is not None:
            hook.remove()
        optimizer.step()
        optimizer.zero_grad()
    blamed = BLAMED[case]
    assert fallen_back_layers(model) == blamed
    assert [name for name, m in model.named_modules() if isinstance(m, FP8Linear)] == [
        name for name in fp8_names if name not in blamed]  # fmt: skip
    for name in blamed:
        layer = model.get_submodule(name)
        assert type(layer) is nn.Linear and layer.weight.dtype == torch.float32
        assert torch.equal(layer.weight.detach(), masters[name]), name  # bit for bit
    if case == "FP8MLP's fc":
        assert type(model.mlp) is UnfusedMLP and isinstance(model.mlp.proj, FP8Linear)
    reason = scaler.history[-1]["reason"]
    if blamed:
        assert reason.endswith(f"put {len(blamed)} layer(s) back to high precision: {', '.join(blamed)}")
        assert optimizer.param_groups[0]["lr"] == 1e-2
    else:
        assert reason.endswith("no FP8 layer had non-finite gradients; lowered the learning rate by 0.5x")
        assert optimizer.param_groups[0]["lr"] == 5e-3
    out = model(_x(9)).square().mean()  # the model still trains
    scaler.scale_loss(out).backward()
    optimizer.step()
    assert math.isfinite(out.item()) and all(torch.isfinite(p).all() for p in model.parameters())


# ------------------------------------------------------------------------------------- after the fallback, at O2
def test_after_an_o2_fallback_the_layer_follows_torch_adamw_from_its_dequantized_states():
    model = convert_to_fp8(_mlp())
    scaler = FP8GradScaler(init_scale=2.0**4, nonfinite_fallback="bf16", fallback_after=2, model=model)
    optimizer = FP8AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, grad_scaler=scaler)
    for i in range(3):
        scaler.scale_loss(model(_x(i)).square().mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
    weight = model[2].weight
    state = optimizer.state[weight]
    # By hand, x ~= x_fp8.float() / scale (exact: the scales are powers of two): the master, m (E4M3) and v (fp16).
    expected = {
        "weight": weight.detach().float() / state["master_scale"],
        "exp_avg": state["exp_avg"].float() / state["exp_avg_scale"],
        "exp_avg_sq": state["exp_avg_sq"].float() / state["exp_avg_sq_scale"],
        "step": state["step"].clone(),
    }
    for i in (3, 4):  # two skipped steps (NaN in the head's weight gradient): the fallback
        hook = _nan_grad(weight)
        scaler.scale_loss(model(_x(i)).square().mean()).backward()
        hook.remove()
        optimizer.step()
        optimizer.zero_grad()
    layer = model[2]
    assert type(layer) is nn.Linear and layer.weight is weight
    state = optimizer.state[weight]
    assert torch.equal(weight.detach(), expected["weight"])
    assert state.keys() == {"step", "exp_avg", "exp_avg_sq"}  # fp32 moments, no master (the weight is fp32)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert state[key].dtype == torch.float32 and torch.equal(state[key], expected[key]), key

    reference = nn.Parameter(expected["weight"].clone())
    torch_adamw = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.1)
    torch_adamw.state[reference] = {key: expected[key].clone() for key in ("step", "exp_avg", "exp_avg_sq")}
    for i in range(5, 8):
        scaler.scale_loss(model(_x(i)).square().mean()).backward()
        reference.grad = weight.grad.detach() / scaler.loss_scale  # the gradient FP8AdamW steps on, unscaled
        optimizer.step()
        optimizer.zero_grad()
        torch_adamw.step()
        torch.testing.assert_close(weight.detach(), reference.detach(), rtol=0, atol=AFTER_FALLBACK_ATOL)
        torch.testing.assert_close(optimizer.state[weight]["exp_avg"], torch_adamw.state[reference]["exp_avg"],
                                   rtol=0, atol=AFTER_FALLBACK_ATOL)  # fmt: skip


# ----------------------------------------------------------------------------- two optimizers and a resume
def _two_optimizers(seed: int) -> tuple[nn.Module, FP8GradScaler, list[FP8AdamW]]:
    model = convert_to_fp8(_mlp(seed))
    scaler = FP8GradScaler(init_scale=2.0**4, nonfinite_fallback="bf16", fallback_after=2, model=model)
    optimizers = [FP8AdamW(model[j].parameters(), lr=1e-2, grad_scaler=scaler) for j in (0, 2)]
    return model, scaler, optimizers


TWO_BAD = (1, 2, 4)  # the head's gradient alone: its optimizer skips, the first layer's steps every iteration


def _train_two(model, scaler, optimizers, steps) -> list[tuple[float, float, str]]:
    rows = []
    for i in steps:
        hook = _nan_grad(model[2].weight) if i in TWO_BAD else None
        loss = model(_x(i)).square().mean()
        scaler.scale_loss(loss).backward()
        if hook is not None:
            hook.remove()
        for optimizer in optimizers:
            optimizer.step()  # each steps and updates through the scaler
            optimizer.zero_grad()
        rows.append((loss.item(), scaler.get_scale(), type(model[2]).__name__))
    return rows


def _checkpoint(model, scaler, optimizers) -> dict:
    state = {
        "model": model.state_dict(),
        "optimizers": [o.state_dict() for o in optimizers],
        "scaler": scaler.state_dict(),
        "fp8": fp8_state_dict(model),
        "fallen_back_layers": fallen_back_layers(model),
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("cut", [2, 3], ids=["between the two skips", "after the fallback"])
def test_two_optimizers_one_failing_fall_back_its_layer_alone_and_resume_bit_for_bit(cut):
    model, scaler, optimizers = _two_optimizers(0)
    full = _train_two(model, scaler, optimizers, range(cut))
    ckpt = _checkpoint(model, scaler, optimizers)
    full += _train_two(model, scaler, optimizers, range(cut, 6))
    # By hand: the head's optimizer skips at 1, 2 and 4 (mu halves each time: one update of a skipped optimizer per
    # iteration), its second consecutive skip (2) puts the head back; the first layer's optimizer stepped throughout.
    assert [row[1:] for row in full] == [(16, "FP8Linear"), (8, "FP8Linear"), (4, "Linear"), (4, "Linear"),
                                         (2, "Linear"), (2, "Linear")]  # fmt: skip
    assert isinstance(model[0], FP8Linear) and fallen_back_layers(model) == ["2"]
    assert optimizers[0].state[model[0].weight]["step"] == 6 and optimizers[1].state[model[2].weight]["step"] == 3
    assert ckpt["scaler"]["nonfinite_runs"] == ([0, 1] if cut == 2 else [0, 0])
    assert ckpt["fallen_back_layers"] == ([] if cut == 2 else ["2"])

    resumed, resumed_scaler, resumed_optimizers = _two_optimizers(seed=123)  # nothing from its own init
    put_back_to_high_precision(resumed, ckpt["fallen_back_layers"], resumed_optimizers)
    resumed.load_state_dict(ckpt["model"])
    for optimizer, state in zip(resumed_optimizers, ckpt["optimizers"], strict=True):
        optimizer.load_state_dict(state)
    resumed_scaler.load_state_dict(ckpt["scaler"])
    load_fp8_state_dict(resumed, ckpt["fp8"])
    assert _train_two(resumed, resumed_scaler, resumed_optimizers, range(cut, 6)) == full[cut:]
    assert same(resumed.state_dict(), model.state_dict())
    assert resumed_scaler.state_dict() == scaler.state_dict()
    for mine, theirs in zip(resumed_optimizers, optimizers, strict=True):
        assert same(mine.state_dict(), theirs.state_dict())


# ---------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fallback_after": -1}, ValueError, r"fallback_after=-1\): must be an int >= 1"),
        ({"fallback_after": 2.5}, TypeError, r"fallback_after=2.5\): must be an int >= 1, got float"),
        ({"fallback_after": False}, TypeError, r"fallback_after=False\): must be an int >= 1, got bool"),
        ({"lr_factor": 1.5}, ValueError, r"lr_factor=1.5\): must be in \(0, 1\)"),
        ({"lr_factor": -0.5}, ValueError, r"lr_factor=-0.5\): must be in \(0, 1\)"),
        ({"lr_factor": math.nan}, ValueError, r"lr_factor=nan\): must be in \(0, 1\)"),
        ({"lr_factor": math.inf}, ValueError, r"lr_factor=inf\): must be in \(0, 1\)"),
        ({"nonfinite_fallback": "fallback_to_high_precision"}, ValueError,
         r"nonfinite_fallback='fallback_to_high_precision'\): choose one of \['lower_lr', 'bf16'\]"),
        ({"nonfinite_fallback": "bf16"}, ValueError, r"nonfinite_fallback='bf16'\) needs the model: pass model="),
        ({"nonfinite_fallback": 3}, TypeError, r"expected a string, an nn.Module or a callable"),
    ],
)  # fmt: skip
def test_recovery_arguments_that_cannot_work_are_refused_saying_what_to_pass(kwargs, error, match):
    with pytest.raises(error, match=match):
        FP8GradScaler(**kwargs)


# ------------------------------------------------------------------------------ clipping before the fallback
def test_clipping_by_norm_before_the_step_leaves_the_bf16_fallback_its_offending_layer_alone():
    model = convert_to_fp8(_mlp())
    scaler = FP8GradScaler(init_scale=2.0**4, nonfinite_fallback="bf16", fallback_after=2, model=model)
    optimizer = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)
    for i in range(2):
        hook = _nan_grad(model[2].weight)
        scaler.scale_loss(model(_x(i)).square().mean()).backward()
        hook.remove()
        assert math.isnan(scaler.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
    assert scaler.skipped_steps == 2
    assert fallen_back_layers(model) == ["2"]  # as without clipping (the "one layer's gradient" case above)


# ------------------------------------------------------------------- two gloo processes: DDP and fully_shard
def _direct_fallback_under_ddp() -> dict:
    """The recovery functions called directly (not through the scaler, which refuses any multi-process run first) on a
    DDP-wrapped O2 model whose head's gradient is NaN on both ranks."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = convert_to_fp8(_mlp())
    optimizer = FP8AdamW(model.parameters(), lr=1e-2)
    ddp = DDP(model)
    hook = _nan_grad(model[2].weight)
    ddp(_x(dist.get_rank())).square().mean().backward()
    hook.remove()
    errors = []
    for call in (lambda: fallback_to_high_precision(model, optimizer),
                 lambda: put_back_to_high_precision(model, ["2"], optimizer)):  # fmt: skip
        try:
            call()
            errors.append(None)
        except ValueError as error:
            errors.append(str(error))
    return {"errors": errors, "head": type(model[2]).__name__, "dtype": str(model[2].weight.dtype)}


def _put_back_sharded() -> dict:
    from torch.distributed.fsdp import fully_shard

    model = convert_to_fp8(_mlp())
    fully_shard(model, mesh=cpu_mesh())
    try:
        put_back_to_high_precision(model, ["0"])
        error = None
    except ValueError as e:
        error = str(e)
    return {"error": error, "first": type(model[0]).__name__}


def _lower_lr_under_ddp() -> dict:
    """NaN on rank 1 only, three times: every rank skips, halves mu and lowers the lr once, in step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = convert_to_fp8(_mlp())
    scaler = FP8GradScaler(init_scale=2.0**4, nonfinite_fallback="lower_lr", fallback_after=3, model=model)
    optimizer = FP8AdamW(model.parameters(), lr=1e-2, grad_scaler=scaler)
    ddp = DDP(model)
    lrs, mus = [], []
    for i in range(5):
        x = _x(10 * i + dist.get_rank())
        if 1 <= i <= 3 and dist.get_rank() == 1:
            x[0, 0] = math.nan
        scaler.scale_loss(ddp(x).square().mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
        lrs.append(optimizer.param_groups[0]["lr"])
        mus.append(scaler.get_scale())
    return {"lrs": lrs, "mus": mus, "history": [e["action"] for e in scaler.history],
            "weights": [p.detach().float().clone() for p in model.parameters()]}  # fmt: skip


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return run_parts({"ddp direct": _direct_fallback_under_ddp, "fully_shard": _put_back_sharded,
                      "ddp lower_lr": _lower_lr_under_ddp})  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_workers(_worker, 2)


@pytest.mark.slow
def test_putting_back_under_ddp_is_refused_before_anything_changes(two_ranks):
    for report in part_results(two_ranks, "ddp direct"):
        assert all("under DistributedDataParallel" in (error or "") for error in report["errors"]), report
        assert all("Nothing was changed; use nonfinite_fallback='lower_lr'" in error for error in report["errors"])
        assert (report["head"], report["dtype"]) == ("FP8Linear", "torch.float16")  # still FP8, its O2 master kept


@pytest.mark.slow
def test_putting_back_a_layer_sharded_by_fully_shard_is_refused_before_anything_changes(two_ranks):
    for report in part_results(two_ranks, "fully_shard"):
        assert "'0' back to nn.Linear: their parameters are DTensors" in (report["error"] or ""), report
        assert "use nonfinite_fallback='lower_lr'" in report["error"] and report["first"] == "FP8Linear"


@pytest.mark.slow
def test_lower_lr_under_ddp_acts_on_every_rank_at_the_same_step(two_ranks):
    reports = part_results(two_ranks, "ddp lower_lr")
    for report in reports:  # by hand: three skips (rank 1's NaN skips both), the third lowers the lr once
        assert report["mus"] == [16, 8, 4, 2, 2]
        assert report["lrs"] == [1e-2, 1e-2, 1e-2, 5e-3, 5e-3]
        assert report["history"] == ["skip", "skip", "skip", "fallback"]
    for a, b in zip(reports[0]["weights"], reports[1]["weights"], strict=True):
        assert torch.equal(a, b)  # DDP averaged the finite steps alike; the skipped ones moved nothing anywhere
