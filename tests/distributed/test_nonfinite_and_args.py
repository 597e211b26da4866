"""Non-finite gradients seen on every rank whatever their path, and arguments refused before they can do harm.

- A NaN in a gradient reduced in its own dtype (outside ``fp8_params``), on a one-rank FSDP2 shard group, in
  HSDP, or on one tensor-parallel rank of FSDP2 + TP: ``check_step()`` is False on every rank.
- Arguments that the hooks could only trip over mid-backward (a backend without FP8 sums, fp8_params that name
  nothing, a margin past the formats' range, the bf16 fallback of a sharded model, a state over other ranks than
  the DDP or FSDP1 wrapper's group) raise where they are given,
  with what to do. (A sequence that does not split over the tensor-parallel ranks: test_tensor_parallel.py.)

The multi-process scenarios run in the shared spawns of ``conftest.py`` (worlds 1, 2 and 4); each part reports its
own error, so that one failing part does not hide the others' results.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_fp8.distributed import FP8CommState
from tests.distributed import tolerances as tol
from tests.distributed.launch import cpu_mesh, part_results, run_parts
from tests.numerics import sqnr


class _Vec(nn.Module):
    """``<p, c>``: the gradient of ``p`` is the coefficient ``c`` itself, NaN where it is NaN."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(n))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.p * c).sum()


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w, self.b = _Vec(64), _Vec(8)  # w: the FP8 gradient; b: one in its own dtype

    def forward(self, cw: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
        return self.w(cw) + self.b(cb)


def _coefficients(rank: int, nan_rank: int | None, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh coefficients per rank; a NaN in ``where`` (``"w"`` or ``"b"``) on ``nan_rank`` only."""
    gen = torch.Generator().manual_seed(100 + rank)
    cw, cb = torch.randn(64, generator=gen), torch.randn(8, generator=gen)
    if rank == nan_rank:
        (cw if where == "w" else cb)[5] = math.nan
    return cw, cb


def _fsdp2_steps(rank: int, shard, fp8_params, cases, mesh=None) -> dict:
    """``check_step()`` after one backward per case ``(nan_rank, where)``; ``shard(model, mesh)`` wraps the model."""
    from lightning_fp8.distributed import enable_fp8_fsdp2

    out = {}
    for nan_rank, where in cases:
        model = _Pair()
        shard(model, mesh)
        state = enable_fp8_fsdp2(model, FP8CommState(fp8_params=fp8_params(model)))
        model(*_coefficients(rank, nan_rank, where)).backward()
        out[(nan_rank, where)] = state.check_step()
    return out


def _shard_both(model: nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh)  # one unit holding w and b: FP8 and own-dtype gradients mixed


def _shard_apart(model: nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.w, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root unit holds only b: no FP8 gradient in it


def _fp8_model(shard: bool) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    from lightning_fp8 import convert_to_fp8

    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))
    if shard:
        fully_shard(model[0], mesh=cpu_mesh())
        fully_shard(model[2], mesh=cpu_mesh())
        fully_shard(model, mesh=cpu_mesh())
    return model


def _error(fn) -> str:
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


# ------------------------------------------------------------------------------------------------------- one rank
def _sharded_model_refuses_bf16_fallback(rank: int) -> dict:
    from lightning_fp8 import FP8GradScaler, FP8Linear, recovery
    from lightning_fp8.distributed import enable_fp8_fsdp2

    model = _fp8_model(shard=True)
    scaler = FP8GradScaler(nonfinite_fallback="bf16", model=model)
    up_front = _error(lambda: enable_fp8_fsdp2(model, FP8CommState(grad_scaler=scaler)))
    enable_fp8_fsdp2(model)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    model[0].fp8_scaling["grad_output"].amax.fill_(math.inf)  # blames layer 0, as a non-finite gradient would
    at_fallback = _error(lambda: recovery.fallback_to_high_precision(model, None))
    return {
        "up_front": up_front,
        "at_fallback": at_fallback,
        "unchanged": isinstance(model[0], FP8Linear),
        "still_runs": bool(torch.isfinite(model(x)).all()),
    }


def _wrapped_model_refuses_bf16_fallback() -> dict:
    """Found by a sweep: enable_fp8_ddp and enable_fp8_fsdp1 took such a scaler, which then failed mid-training, at
    its first fallback (enable_fp8_fsdp2 refused it up front)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    from lightning_fp8 import FP8GradScaler
    from lightning_fp8.distributed import enable_fp8_ddp, enable_fp8_fsdp1, fp8_allreduce_hook

    out, models = {}, {}
    for name, enable, wrap in (
        ("ddp", enable_fp8_ddp, DistributedDataParallel),
        ("fsdp1", enable_fp8_fsdp1, lambda m: FullyShardedDataParallel(m, device_id=torch.device("cpu"))),
    ):
        model = models[name] = wrap(_fp8_model(shard=False))
        scaler = FP8GradScaler(nonfinite_fallback="bf16", model=model)
        out[name] = _error(lambda: enable(model, FP8CommState(grad_scaler=scaler)))  # noqa: B023
    # Refused before the hook was registered: the model still takes one (torch allows a single registration).
    out["fsdp1_no_hook"] = getattr(models["fsdp1"], "_comm_hook", None) is None
    out["ddp_no_hook"] = _error(lambda: models["ddp"].register_comm_hook(FP8CommState(), fp8_allreduce_hook))
    return out


def _fp8_params_before_fully_shard() -> str:
    from torch.distributed.fsdp import fully_shard

    from lightning_fp8 import FP8Linear
    from lightning_fp8.distributed import enable_fp8_fsdp2

    model = _fp8_model(shard=False)
    before_shard = [m.weight for m in model.modules() if isinstance(m, FP8Linear)]
    for layer in (model[0], model[2], model):  # the same model, sharded after its weights were collected
        fully_shard(layer, mesh=cpu_mesh())
    return _error(lambda: enable_fp8_fsdp2(model, FP8CommState(fp8_params=before_shard)))


def _wrong_kinds_of_state_and_group() -> dict:
    """Found by a sweep: a process group passed where the state goes (FP8CommState's own first argument is the group)
    failed with "'ProcessGroup' object has no attribute 'check_wrapper_group'"; an amax-sync group that is no group
    replaced the working hook, and every later forward failed deep in c10d."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_fp8.distributed import enable_fp8_ddp, enable_fp8_fsdp2
    from lightning_fp8.distributed.amax_sync import _HOOK_ATTR, enable_fp8_amax_sync

    model = _fp8_model(shard=False)
    handle = enable_fp8_amax_sync(model)
    with warnings.catch_warnings(record=True) as caught:  # warn_once: a fresh message per call site
        warnings.simplefilter("always")
        enable_fp8_fsdp2(_fp8_model(shard=True), FP8CommState(fp8_params=[]))
        plain = nn.Sequential(nn.Linear(32, 16))
        fully_shard(plain, mesh=cpu_mesh())
        enable_fp8_fsdp2(plain, FP8CommState(fp8_params=[]))  # no FP8 layer: nothing is left out
    empty = [str(w.message) for w in caught if "fp8_params=...) is empty" in str(w.message)]
    return {
        "empty": empty,
        "ddp": _error(lambda: enable_fp8_ddp(DDP(_fp8_model(shard=False)), dist.group.WORLD)),
        "fsdp2": _error(lambda: enable_fp8_fsdp2(_fp8_model(shard=True), dist.group.WORLD)),
        "amax_group": _error(lambda: enable_fp8_amax_sync(model, "bad group")),
        "hook_kept": getattr(model, _HOOK_ATTR) is handle and bool(model[0](torch.randn(2, 32)).isfinite().all()),
    }


def _worker1(rank: int, world: int) -> dict:
    return run_parts({
        # FSDP runs no reduce-scatter on one rank: the gradients are checked in its all-reduce hook.
        "fsdp2": lambda: _fsdp2_steps(rank, _shard_apart, lambda m: [m.w.p], [(None, "w"), (0, "w"), (0, "b")]),
        "native_on_gloo": lambda: _error(lambda: FP8CommState(algorithm="native")),
        "fp8_params_before_fully_shard": _fp8_params_before_fully_shard,
        "wrong_kinds": _wrong_kinds_of_state_and_group,
        "fallback": lambda: _sharded_model_refuses_bf16_fallback(rank),
        "fallback_wrapped": _wrapped_model_refuses_bf16_fallback,
    })  # fmt: skip


# ------------------------------------------------------------------------------------------------------ two ranks
def _ddp_steps(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_fp8.distributed import fp8_allreduce_hook

    out = {}
    for nan_rank, where in [(None, "b"), (1, "b"), (1, "w")]:
        model = _Pair()
        ddp = DDP(model)  # one bucket: w in FP8, b all-reduced in fp32
        state = FP8CommState(fp8_params=[model.w.p])
        ddp.register_comm_hook(state, fp8_allreduce_hook)
        ddp(*_coefficients(rank, nan_rank, where)).backward()
        out[(nan_rank, where)] = state.check_step()
    return out


def _ddp_fp8_params_of_another_model(rank: int) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_fp8.distributed import fp8_allreduce_hook

    other = _Pair()
    seen = []
    for fp8_params in ([other.w.p], None):  # then the model's own: no warning
        model = _Pair()
        ddp = DDP(model)
        ddp.register_comm_hook(FP8CommState(fp8_params=fp8_params or [model.w.p]), fp8_allreduce_hook)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):  # checked in the first backward only
                ddp(*_coefficients(rank, None, "w")).backward()
        seen.append([str(w.message) for w in caught if "fp8_params" in str(w.message)])
    return seen


def _worker2(rank: int, world: int) -> dict:
    cases = [(None, "b"), (1, "b")]
    return run_parts({
        "ddp": lambda: _ddp_steps(rank),
        "fsdp2_mixed_unit": lambda: _fsdp2_steps(rank, _shard_both, lambda m: [m.w.p], cases),
        "fsdp2_unit_without_fp8": lambda: _fsdp2_steps(rank, _shard_apart, lambda m: [m.w.p], cases),
        "ddp_fp8_params_warning": lambda: _ddp_fp8_params_of_another_model(rank),
    })  # fmt: skip


# ----------------------------------------------------------------------------------------------------- four ranks
def _hsdp_gradients(rank: int, world: int, mesh) -> dict:
    """The reduced gradients of HSDP with FP8 reduce-scatters, against the fp32 mean over all ranks."""
    from torch.distributed.fsdp import fully_shard

    from lightning_fp8.distributed import enable_fp8_fsdp2

    cw, cb = _coefficients(rank, None, "w")
    mean_w, mean_b = cw.clone(), cb.clone()
    for t in (mean_w, mean_b):
        dist.all_reduce(t)
        t /= world
    model = _Pair()
    fully_shard(model.w, mesh=mesh)
    fully_shard(model, mesh=mesh)
    enable_fp8_fsdp2(model, FP8CommState(fp8_params=[model.w.p]))
    model(cw, cb).backward()
    w, b = model.w.p.grad.full_tensor(), model.b.p.grad.full_tensor()
    return {"w_sqnr": sqnr(w, mean_w), "b_exact": torch.allclose(b, mean_b, rtol=1e-6, atol=0)}


class _TPMLP(nn.Module):
    """fc column-parallel, proj row-parallel: each tensor-parallel rank holds its own half of fc's gradients."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(nn.functional.gelu(self.fc(x)))


def _fsdp2_tp_steps(rank: int, mesh) -> dict:
    """``check_step()`` of FSDP2 (over mesh['dp']) + tensor parallel (over mesh['tp']) after one backward, with a NaN
    planted in the gradient of fc's output shard of one rank: only the ranks of its data-parallel group see it in
    FSDP's collectives. The input needs no gradient, so the NaN reaches no tensor-parallel collective either."""
    from torch.distributed.fsdp import fully_shard

    from lightning_fp8 import convert_to_fp8
    from lightning_fp8.distributed import enable_fp8_fsdp2
    from lightning_fp8.distributed.tensor_parallel import apply_fp8_tensor_parallel

    def plant_nan(_module, _inputs, y: torch.Tensor) -> None:
        y.register_hook(lambda g: g.index_fill(-1, torch.tensor([3]), math.nan))

    out = {}
    for nan_rank in (None, 1):
        torch.manual_seed(0)
        model = convert_to_fp8(_TPMLP())
        apply_fp8_tensor_parallel(model, mesh["tp"], plan={"fc": "colwise", "proj": "rowwise"})
        fully_shard(model, mesh=mesh["dp"])
        state = enable_fp8_fsdp2(model)
        if rank == nan_rank:
            model.fc.register_forward_hook(plant_nan)  # after TP's hook: y is fc's local output shard
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(mesh["dp"].get_local_rank()))
        model(x).square().mean().backward()
        out[nan_rank] = state.check_step()
    return out


def _wrapper_groups(rank: int) -> dict:
    """enable_fp8_ddp / enable_fp8_fsdp1 given a state over other ranks than the wrapper's group, or over the same."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_fp8.distributed import enable_fp8_ddp, enable_fp8_fsdp1, fp8_reduce_scatter_hook

    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both, in the same order
    half, same_ranks = halves[rank // 2], dist.new_group([0, 1, 2, 3])

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))

    def fsdp1(group=None) -> nn.Module:
        return FSDP(model(), process_group=group, device_id=torch.device("cpu"), use_orig_params=True)

    def backward(wrapped: nn.Module) -> torch.Tensor:
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
        wrapped(x).square().mean().backward()
        return wrapped.module[0].weight.grad  # DDP: the mean over the wrapper's group

    def ddp_mean_over_half() -> bool:
        ddp = DDP(model(), process_group=half)
        state = enable_fp8_ddp(ddp)  # no state: one is built on DDP's group
        grad = backward(ddp)
        ref = model()
        ref(torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
        mean = ref[0].weight.grad.clone()
        dist.all_reduce(mean, group=half)
        return state.check_step() and sqnr(grad, mean / 2) >= tol.ALLREDUCE_E5M2_SQNR_DB

    def fsdp1_direct_hook() -> None:
        wrapped = fsdp1()
        wrapped.register_comm_hook(FP8CommState(half), fp8_reduce_scatter_hook)
        backward(wrapped)

    return {
        "ddp_other_ranks": _error(lambda: enable_fp8_ddp(DDP(model()), FP8CommState(half))),
        "ddp_default_state_world": _error(lambda: enable_fp8_ddp(DDP(model(), process_group=half), FP8CommState())),
        "ddp_same_ranks": _error(lambda: enable_fp8_ddp(DDP(model()), FP8CommState(same_ranks))),
        "ddp_default_state": _error(lambda: enable_fp8_ddp(DDP(model()), FP8CommState())),
        "ddp_mean_over_half": ddp_mean_over_half(),
        "fsdp1_other_ranks": _error(lambda: enable_fp8_fsdp1(fsdp1(), FP8CommState(half))),
        "fsdp1_default_state_world": _error(lambda: enable_fp8_fsdp1(fsdp1(half), FP8CommState())),
        "fsdp1_same_group": _error(lambda: enable_fp8_fsdp1(fsdp1(half), FP8CommState(half))),
        "fsdp1_direct_hook_other_size": _error(fsdp1_direct_hook),
    }


def _worker4(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicas = init_device_mesh("cpu", (4, 1), mesh_dim_names=("replicate", "shard"))
    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cases = [(None, "w"), (3, "w"), (3, "b")]
    pair = dist.new_group([0, 1])  # every rank creates it; ranks 0 and 1 pass it as an amax group of 4 ranks
    return run_parts({
        "hsdp": lambda: _fsdp2_steps(rank, _shard_apart, lambda m: [m.w.p], cases, hsdp),
        "hsdp_mixed_unit": lambda: _fsdp2_steps(rank, _shard_both, lambda m: [m.w.p], cases, hsdp),
        "hsdp_one_shard": lambda: _fsdp2_steps(rank, _shard_apart, lambda m: [m.w.p], cases, replicas),
        "hsdp_gradients": lambda: _hsdp_gradients(rank, world, hsdp),
        "fsdp2_tp": lambda: _fsdp2_tp_steps(rank, dp_tp),
        "wrapper_groups": lambda: _wrapper_groups(rank),
        "amax_group_of_other_ranks": lambda: _error(lambda: FP8CommState(amax_group=pair)) if rank < 2 else None,
    })  # fmt: skip


@pytest.fixture(scope="module")
def one(spawned):
    return spawned(1, "test_nonfinite_and_args", "_worker1")


@pytest.fixture(scope="module")
def two(spawned):
    return spawned(2, "test_nonfinite_and_args", "_worker2")


@pytest.fixture(scope="module")
def four(spawned):
    return spawned(4, "test_nonfinite_and_args", "_worker4")


# ---------------------------------------------------------------------------------------------- non-finite flags
@pytest.mark.slow
def test_ddp_flags_a_nan_in_a_gradient_reduced_in_its_own_dtype(two):
    for r in part_results(two, "ddp"):
        assert r == {(None, "b"): True, (1, "b"): False, (1, "w"): False}


@pytest.mark.slow
@pytest.mark.parametrize("unit", ["fsdp2_mixed_unit", "fsdp2_unit_without_fp8"])
def test_fsdp2_flags_a_nan_in_a_gradient_reduced_in_its_own_dtype(two, unit):
    for r in part_results(two, unit):
        assert r == {(None, "b"): True, (1, "b"): False}


@pytest.mark.slow
def test_fsdp2_on_one_rank_flags_a_nan(one):
    assert part_results(one, "fsdp2")[0] == {(None, "w"): True, (0, "w"): False, (0, "b"): False}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["hsdp", "hsdp_mixed_unit", "hsdp_one_shard"])
def test_hsdp_every_rank_agrees_on_a_nan_of_one_rank(four, case):
    """A NaN on rank 3 of a (2 replicas x 2 shards) mesh: ranks 0 and 1 share no shard group with it."""
    for r in part_results(four, case):
        assert r == {(None, "w"): True, (3, "w"): False, (3, "b"): False}


@pytest.mark.slow
def test_fsdp2_with_tensor_parallel_every_rank_agrees_on_a_nan_of_one_rank(four):
    """A NaN in fc's gradient shard on rank 1 of a (2 dp x 2 tp) mesh: FSDP's collectives reach rank 3 (its data
    parallel peer) but not ranks 0 and 2, which hold the other halves of the same gradients. Before check_step
    reduced over the mesh, ranks 0 and 2 stepped while 1 and 3 skipped: replicas diverged silently."""
    assert part_results(four, "fsdp2_tp") == [{None: True, 1: False}] * 4


@pytest.mark.slow
def test_a_state_over_other_ranks_than_the_wrappers_group_is_refused(four):
    """DDP and FSDP1 given an FP8CommState over other ranks than their own group: found by review, it averaged the
    gradients and shared their scales over the state's ranks without a word."""
    for rank, r in enumerate(part_results(four, "wrapper_groups")):
        half = [0, 1] if rank < 2 else [2, 3]
        for wrapper in ("ddp", "fsdp1"):
            other, default = r[f"{wrapper}_other_ranks"], r[f"{wrapper}_default_state_world"]
            assert other.startswith(f"ValueError: enable_fp8_{wrapper}: FP8CommState(process_group=...) is a group "
                                    f"of the ranks {half}, but the model's wrapper reduces its gradients over the "
                                    "ranks [0, 1, 2, 3]"), other  # fmt: skip
            assert "FP8CommState(model.process_group" in other
            assert default.startswith(f"ValueError: enable_fp8_{wrapper}: FP8CommState(process_group=...) is the "
                                      f"default (the world) of the ranks [0, 1, 2, 3], but the model's wrapper "
                                      f"reduces its gradients over the ranks {half}"), default  # fmt: skip
        assert r["ddp_same_ranks"] == r["ddp_default_state"] == r["fsdp1_same_group"] == "no error"
        assert r["ddp_mean_over_half"]
        direct = r["fsdp1_direct_hook_other_size"]
        assert "a group of 4 ranks, but FP8CommState(process_group=...) has 2" in direct, direct


@pytest.mark.slow
def test_hsdp_fp8_reduce_scatter_gives_the_mean_over_the_mesh(four):
    for grads in part_results(four, "hsdp_gradients"):
        assert grads["w_sqnr"] >= tol.REDUCE_SCATTER_E5M2_SQNR_DB and grads["b_exact"], grads


# ---------------------------------------------------------------------------------------------------- arguments
def test_comm_state_margin_is_bounded_like_the_recipe():
    from lightning_fp8.recipe import MAX_MARGIN

    assert FP8CommState(margin=MAX_MARGIN).margin == MAX_MARGIN
    with pytest.raises(ValueError, match=f"margin={MAX_MARGIN + 1}\\) must be <= {MAX_MARGIN}"):
        FP8CommState(margin=MAX_MARGIN + 1)


@pytest.mark.parametrize(
    ("fp8_params", "what"),
    [(["0.weight"], "holds a str"), (nn.Sequential(nn.Linear(2, 2)), "got a Sequential"),
     (torch.zeros(3), "got a Tensor"), (5, "got a int"), ([nn.Linear(2, 2)], "holds a Linear")],
)  # fmt: skip
def test_comm_state_fp8_params_must_be_tensors(fp8_params, what):
    with pytest.raises(TypeError, match=f"fp8_params=...\\) {what}.*pass the parameters themselves"):
        FP8CommState(fp8_params=fp8_params)


@pytest.mark.slow
def test_native_algorithm_on_gloo_is_refused_at_construction(one):
    error = part_results(one, "native_on_gloo")[0]
    assert error.startswith("ValueError: FP8CommState(algorithm='native') needs the NCCL")


@pytest.mark.slow
def test_amax_group_of_other_ranks_is_refused_at_construction(four):
    for message in part_results(four, "amax_group_of_other_ranks")[:2]:
        assert message.startswith("ValueError:") and "amax_group has ranks [0, 1]" in message


@pytest.mark.slow
def test_fsdp2_refuses_fp8_params_taken_before_fully_shard(one):
    message = part_results(one, "fp8_params_before_fully_shard")[0]
    assert message.startswith("ValueError: enable_fp8_fsdp2: none of the 2 tensors") and "after fully_shard" in message


@pytest.mark.slow
def test_a_group_given_as_the_state_or_a_bad_amax_group_is_refused_changing_nothing(one):
    report = part_results(one, "wrong_kinds")[0]
    for where in ("ddp", "fsdp2"):
        assert report[where].startswith(f"TypeError: enable_fp8_{where}(model, state=...) got a ProcessGroup"), report
    assert report["amax_group"].startswith("TypeError: AmaxSync(process_group=...) got a str"), report
    assert report["hook_kept"], "the working amax-sync hook was replaced by the refused one"
    empty = report["empty"]  # the FP8 model's call only
    assert len(empty) == 1 and empty[0].startswith("enable_fp8_fsdp2: FP8CommState(fp8_params=...) is empty"), empty


def test_comm_state_takes_numpy_integers_and_refuses_a_grad_scaler_missing_a_method(recwarn):
    np = pytest.importorskip("numpy")
    state = FP8CommState(margin=np.int64(2), slice_numel=np.int32(1024))
    assert (state.margin, state.slice_numel) == (2, 1024) and type(state.margin) is int

    class OnlyCasts:  # a DDP hook calling the missing record_nonfinite broke DDP's reducer for good
        def record_gradient_cast(self, *args):
            pass

    with pytest.raises(TypeError, match=r"grad_scaler=\.\.\.\) got a OnlyCasts: pass an FP8GradScaler"):
        FP8CommState(grad_scaler=OnlyCasts())


def test_empty_fp8_params_are_a_mistake_only_where_the_model_has_fp8_layers(recwarn):
    # [m.weight for m in model.modules() if isinstance(m, FP8Linear)] taken before convert_to_fp8 is empty: every
    # gradient then went in its own dtype without a word. The integrations pass an empty list for a model whose
    # layers are all excluded: no mistake, no warning (the hooks check against the model: see the "empty" part).
    state = FP8CommState(fp8_params=[])
    assert not [w for w in recwarn if "is empty" in str(w.message)] and not state.is_fp8(torch.zeros(1))
    assert state.leaves_out_fp8_weights(True) and not state.leaves_out_fp8_weights(False)
    assert not FP8CommState().leaves_out_fp8_weights(True)  # fp8_params not given: every gradient travels in FP8


@pytest.mark.slow
def test_ddp_warns_when_fp8_params_name_no_parameter_of_the_model(two):
    (other_model, own), rank1 = part_results(two, "ddp_fp8_params_warning")
    assert len(other_model) == 1 and "none of the 1 tensors" in other_model[0]  # once, on rank 0
    assert own == [] and rank1 == [[], []]


@pytest.mark.slow
def test_bf16_fallback_is_refused_for_a_sharded_model_before_changing_it(one):
    fallback = part_results(one, "fallback")[0]
    assert fallback["up_front"].startswith("ValueError: enable_fp8_fsdp2: FP8CommState(grad_scaler=...) has "
                                           "nonfinite_fallback='bf16'")  # fmt: skip
    assert fallback["at_fallback"].startswith("ValueError: FP8GradScaler(nonfinite_fallback='bf16') cannot put '0'")
    assert fallback["unchanged"] and fallback["still_runs"]


@pytest.mark.slow
def test_bf16_fallback_is_refused_by_enable_fp8_ddp_and_fsdp1_up_front(one):
    refused = part_results(one, "fallback_wrapped")[0]
    for name, wrapper in (("ddp", "DistributedDataParallel"), ("fsdp1", "FullyShardedDataParallel")):
        assert refused[name].startswith(f"ValueError: enable_fp8_{name}: FP8CommState(grad_scaler=...) has "
                                        f"nonfinite_fallback='bf16'"), refused[name]  # fmt: skip
        assert wrapper in refused[name] and "nonfinite_fallback='lower_lr'" in refused[name]
    assert refused["fsdp1_no_hook"] and refused["ddp_no_hook"] == "no error"
