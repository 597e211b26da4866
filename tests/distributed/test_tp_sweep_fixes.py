"""Tensor-parallel FP8 layers where a sweep found them apart from one process: the first casts of zero tensors, a
tensor-parallel mesh of one rank, and plans whose block names an outer module shares.

Each 2-process check runs in one spawn (the module fixture ``two_ranks``) against the same FP8 model in one process,
given the whole batch; the plan lookup runs in process.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_fp8 import convert_to_fp8
from lightning_fp8.scaling import ScalingState
from tests.distributed.launch import part_results, run_parts, run_workers
from tests.distributed.test_tensor_parallel import (
    TP_PARITY_SQNR_DB,
    Block,
    _equalize_shard_amax,
    _full,
    _tp_mesh,
)
from tests.numerics import sqnr

WORLD = 2
D, HIDDEN, BATCH, SEQ = 64, 96, 2, 6  # 48 hidden features per rank; SEQ / WORLD = 3 tokens per rank
# With sequence parallelism the input gradient is reduce-scattered in FP8: one E5M2 rounding that one process does
# not make (~25 dB observed against it). A gradient flushed to zero by a wrong scale has 0 dB.
SP_INPUT_GRAD_SQNR_DB = 20.0
# Gradients this small flush to zero in E5M2 at the initial scale 1 (its smallest subnormal is 2**-16): a cast that
# keeps them uses their own amax.
TINY_GRAD = 2.0**-20


# ------------------------------------------------------------------------ the first casts of all-zero tensors
def _mlp_pair(zero_first_layer: bool, sequence_parallel: bool) -> tuple[nn.Module, nn.Module]:
    """(an FP8 MLP parallelized colwise -> rowwise over the ranks, the same FP8 MLP in one process)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_fp8.distributed.amax_sync import enable_fp8_amax_sync
    from lightning_fp8.distributed.tensor_parallel import FP8ColwiseParallel, FP8RowwiseParallel

    torch.manual_seed(0)
    mlp_hp = nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D))
    _equalize_shard_amax(mlp_hp, WORLD)
    if zero_first_layer:  # a zero-initialized layer: the second layer's input is all zeros at step 0
        with torch.no_grad():
            mlp_hp[0].weight.zero_()
            mlp_hp[0].bias.zero_()
    mlp = convert_to_fp8(mlp_hp)
    ref = copy.deepcopy(mlp)
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {"0": FP8ColwiseParallel(input_layouts=seq), "2": FP8RowwiseParallel(output_layouts=seq)}
    parallelize_module(mlp, _tp_mesh(), plan)
    enable_fp8_amax_sync(mlp)
    return mlp, ref


def _gather_seq(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=1)


def _zero_first_casts(role: str, sequence_parallel: bool) -> dict:
    """Three steps of the TP MLP and the one-process MLP on the same data. ``role="input"``: the second layer's input
    is all zeros at step 0 (zero-initialized first layer), an SGD step then makes it small and nonzero.
    ``role="grad_output"``: the output gradient is all zeros at step 0 and tiny afterwards."""
    mlp, ref = _mlp_pair(role == "input", sequence_parallel)
    rank, gen, steps = dist.get_rank(), torch.Generator().manual_seed(1), []
    for step in range(3):
        x = torch.randn(BATCH, SEQ, D, generator=gen)
        grad = torch.randn(BATCH, SEQ, D, generator=gen)
        if role == "grad_output":
            grad = torch.zeros_like(grad) if step == 0 else grad * TINY_GRAD
        x_ref = x.clone().requires_grad_()
        x_tp = (x.chunk(WORLD, 1)[rank] if sequence_parallel else x).clone().requires_grad_()
        y_tp, y_ref = mlp(x_tp), ref(x_ref)
        y_tp.backward(grad.chunk(WORLD, 1)[rank] if sequence_parallel else grad)
        y_ref.backward(grad)
        compared = {
            "out": (_gather_seq(y_tp) if sequence_parallel else y_tp, y_ref),
            "x.grad": (_gather_seq(x_tp.grad) if sequence_parallel else x_tp.grad, x_ref.grad),
        }
        for (name, p), p_ref in zip(mlp.named_parameters(), ref.parameters(), strict=True):
            compared[name] = (_full(p.grad), p_ref.grad)
        flags = {
            name: (state.initialized, ref.get_submodule(name).initialized)
            for name, state in mlp.named_modules()
            if isinstance(state, ScalingState) and name.endswith(role)
        }
        steps.append({"sqnr": {k: sqnr(a, b) for k, (a, b) in compared.items()}, "flags": flags})
        with torch.no_grad():  # the same SGD step on both (the TP gradients are DTensors, as their parameters)
            for p, p_ref in zip(mlp.parameters(), ref.parameters(), strict=True):
                p -= 1e-3 * p.grad
                p_ref -= 1e-3 * p_ref.grad
        mlp.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    return {"steps": steps}


def _parity_db(case: str, tensor: str) -> float:
    return SP_INPUT_GRAD_SQNR_DB if ZERO_CASES[case][1] and tensor == "x.grad" else TP_PARITY_SQNR_DB


ZERO_CASES = {f"{role}:{sp}": (role, sp == "sp") for role in ("input", "grad_output") for sp in ("tp", "sp")}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ZERO_CASES))
def test_an_all_zero_first_cast_does_not_count_under_tensor_parallelism(two_ranks, case):
    """Found by a sweep: a tensor-parallel state was initialized by any non-empty first cast, an all-zero one too
    (the input of a layer after a zero-initialized one, a zero output gradient), so the next step cast with the
    delayed scale 1 from a history of zeros and flushed small values to zero (0 dB), where one process uses the
    tensor's own amax. Now every rank decides by the whole tensor's amax, as one process does."""
    role = ZERO_CASES[case][0]
    for rank, report in enumerate(part_results(two_ranks, f"zero:{case}")):
        for step, result in enumerate(report["steps"]):
            where = f"{case}, rank {rank}, step {step}"
            for name, (tp, one) in result["flags"].items():
                assert tp == one, f"{where}: {name}.initialized is {tp} under TP, {one} in one process"
            bad = {k: round(v, 1) for k, v in result["sqnr"].items() if v < _parity_db(case, k)}
            assert not bad, f"{where}: SQNR vs the one-process FP8 model too low: {bad}"
        first = report["steps"][0]["flags"]
        assert not all(tp for tp, _ in first.values()), f"{case}: step 0 had no all-zero {role} cast: vacuous test"


# -------------------------------------------------------------------------- a tensor-parallel mesh of one rank
def _tp_mesh_of_one() -> dict:
    """A TP + SP (FP8 comm) block on mesh['tp'] of size 1 (data parallel over the 2 ranks, each with its own data),
    without amax sync: each rank's block must compute bit for bit what the same FP8 block does unparallelized."""
    from lightning_fp8 import warnings as fp8_warnings
    from lightning_fp8.distributed.tensor_parallel import apply_fp8_tensor_parallel

    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    block = convert_to_fp8(Block())
    ref = copy.deepcopy(block)
    apply_fp8_tensor_parallel(block, mesh["tp"], sequence_parallel=True, fp8_comm=True, amax_sync=False)
    warned_before = set(fp8_warnings._seen)
    gen, steps = torch.Generator().manual_seed(2 + dist.get_rank()), []
    for _ in range(3):  # step 0 casts with current scaling, later steps with delayed scales
        x, grad = torch.randn(BATCH, SEQ, 96, generator=gen), torch.randn(BATCH, SEQ, 96, generator=gen)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        ys = [block(xs[0]), ref(xs[1])]
        for y in ys:
            y.backward(grad)
        equal = {"out": torch.equal(ys[0], ys[1]), "x.grad": torch.equal(xs[0].grad, xs[1].grad)}
        for (name, p), p_ref in zip(block.named_parameters(), ref.parameters(), strict=True):
            if name.endswith("weight"):  # bias gradients: the same sum in another order (fp32 rounding)
                equal[name] = torch.equal(_full(p.grad), p_ref.grad)
        steps.append(equal)
        block.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    return {"steps": steps, "warned": sorted(set(fp8_warnings._seen) - warned_before)}


@pytest.mark.slow
def test_a_tensor_parallel_mesh_of_one_rank_is_the_unsharded_block_bit_for_bit(two_ranks):
    """Found by a sweep: on mesh['tp'] of size 1 with sequence parallelism and FP8 comm, the input gradient went
    through the FP8 reduce-scatter (an E5M2 rounding of the whole dx) although nothing is communicated, and without
    an amax sync every gathered cast warned that it had to sync its amax on its own (over one rank)."""
    for rank, report in enumerate(part_results(two_ranks, "tp_mesh_of_one")):
        for step, equal in enumerate(report["steps"]):
            assert all(equal.values()), f"rank {rank}, step {step}: not bit-identical: {equal}"
        assert report["warned"] == [], f"rank {rank}"


# ------------------------------------------------------------------- plans whose names an outer module shares
def _nested() -> nn.Sequential:
    # The root has children "0" and "2" too, as each block: Sequentials, not linear layers.
    return nn.Sequential(*(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3)))


def _nested_plan() -> dict:
    from lightning_fp8.distributed.tensor_parallel import apply_fp8_tensor_parallel

    torch.manual_seed(0)
    model_hp = _nested()
    _equalize_shard_amax(model_hp, WORLD)
    model = convert_to_fp8(model_hp)
    ref = copy.deepcopy(model)
    apply_fp8_tensor_parallel(model, _tp_mesh(), plan={"0": "colwise", "2": "rowwise"}, sequence_parallel=False)
    x = torch.randn(BATCH, SEQ, 32, generator=torch.Generator().manual_seed(3))
    return {
        "placements": {n: str(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)},
        "sqnr": sqnr(model(x), ref(x)),
    }


@pytest.mark.slow
def test_a_plan_whose_names_the_outer_module_shares_shards_the_inner_blocks(two_ranks):
    """Found by a sweep: nn.Sequential of nn.Sequential blocks with plan={"0": "colwise", "2": "rowwise"} raised
    TypeError, because the root's children "0" and "2" (Sequentials) matched the plan's names first."""
    for report in part_results(two_ranks, "nested_plan"):
        placements = report["placements"]
        for block in range(3):
            assert placements[f"{block}.0.weight"] == "(Shard(dim=0),)", placements
            assert placements[f"{block}.2.weight"] == "(Shard(dim=1),)", placements
        assert report["sqnr"] > TP_PARITY_SQNR_DB


def test_plan_blocks_skip_outer_modules_that_share_their_names():
    from lightning_fp8.distributed.tensor_parallel_plan import find_blocks

    assert find_blocks(_nested(), {"0": "colwise", "2": "rowwise"}) == ["0", "1", "2"]
    # Where every module with the plan's names holds something else under one of them, the error names the closest
    # match's (a block's GELU, not the root's Sequentials).
    with pytest.raises(TypeError, match=r"plan entry '1' \(rowwise\) is a GELU in 0; only nn.Linear"):
        find_blocks(_nested(), {"0": "colwise", "1": "rowwise"})
    with pytest.raises(TypeError, match=r"plan entry 'ln_1' \(colwise\) is a LayerNorm in Block; only nn.Linear"):
        find_blocks(Block(), {"ln_1": "colwise"})


def _refused_before_any_change() -> dict:
    """apply_fp8_tensor_parallel on a block whose mlp.fc shards into 24 features per rank: refused, and (found by a
    sweep) the layers before it were already sharded and hooked, so a retry without the MLP was refused as "parallelized
    already"."""
    from lightning_fp8.distributed.tensor_parallel import apply_fp8_tensor_parallel

    torch.manual_seed(0)
    block = Block(32, 2)
    block.mlp.fc, block.mlp.proj = nn.Linear(32, 48), nn.Linear(48, 32)  # mlp.fc: 24 output features per rank
    model = convert_to_fp8(nn.Sequential(block))
    hooks = {name: len(m._forward_pre_hooks) + len(m._forward_hooks) for name, m in model.named_modules()}
    try:
        apply_fp8_tensor_parallel(model, _tp_mesh())
        error = None
    except ValueError as exc:
        error = str(exc)
    untouched = not any(isinstance(p, DTensor) for p in model.parameters()) and hooks == {
        name: len(m._forward_pre_hooks) + len(m._forward_hooks) for name, m in model.named_modules()
    }
    plan = {"ln_1": "norm", "attn.qkv": "colwise", "attn.proj": "rowwise", "ln_2": "norm"}
    apply_fp8_tensor_parallel(model, _tp_mesh(), plan=plan)  # the message's way out: the MLP left out
    return {"error": error, "untouched": untouched, "qkv_sharded": isinstance(model[0].attn.qkv.weight, DTensor)}


def _bad_arguments() -> dict:
    """Found by a sweep: sequence_parallel="no" switched sequence parallelism on (a true string), an amax_sync_group
    that is no group failed in c10d after every layer was sharded, plan=None and module=None raised AttributeErrors."""
    from lightning_fp8.distributed.tensor_parallel import apply_fp8_tensor_parallel

    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(Block(32, 2)))
    errors = {}
    for name, kwargs in {"sequence_parallel": {"sequence_parallel": "no"}, "fp8_comm": {"fp8_comm": None},
                         "seq_dim": {"seq_dim": "1"}, "amax_sync_group": {"amax_sync_group": "x"},
                         "plan": {"plan": None}}.items():  # fmt: skip
        try:
            apply_fp8_tensor_parallel(model, _tp_mesh(), **kwargs)
            errors[name] = "no error"
        except TypeError as exc:
            errors[name] = str(exc)
    try:
        apply_fp8_tensor_parallel(None, _tp_mesh())
    except TypeError as exc:
        errors["module"] = str(exc)
    return {"errors": errors, "untouched": not any(isinstance(p, DTensor) for p in model.parameters())}


@pytest.mark.slow
def test_bad_arguments_are_type_errors_naming_them_before_any_layer_changes(two_ranks):
    for report in part_results(two_ranks, "bad_arguments"):
        errors = report["errors"]
        for name in ("sequence_parallel", "fp8_comm", "seq_dim", "amax_sync_group", "module"):
            assert errors[name].startswith(f"apply_fp8_tensor_parallel({name}="), errors
        assert errors["plan"].startswith("apply_fp8_tensor_parallel(plan=...) got a NoneType"), errors
        assert report["untouched"]


@pytest.mark.slow
def test_a_plan_refused_for_one_layers_shard_size_changes_no_layer(two_ranks):
    for report in part_results(two_ranks, "refused_before_any_change"):
        assert report["error"] is not None and "24 output features per rank" in report["error"], report
        assert report["untouched"], "layers were sharded or hooked before the refusal"
        assert report["qkv_sharded"]


# ------------------------------------------------------------------------- one spawn for the 2-rank checks
def _two_rank_worker(rank: int, world: int) -> dict:
    parts: dict[str, Callable[[], object]] = {"tp_mesh_of_one": _tp_mesh_of_one, "nested_plan": _nested_plan,
                                              "refused_before_any_change": _refused_before_any_change,
                                              "bad_arguments": _bad_arguments}
    parts |= {f"zero:{case}": partial(_zero_first_casts, *args) for case, args in ZERO_CASES.items()}
    return run_parts(parts)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_workers(_two_rank_worker, WORLD)


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_dropout_in_the_blocks_is_warned_about(p):
    """Ranks seeded alike drew the same dropout masks for their sequence shards (and heads), silently: the blocks get
    plain local tensors. The check runs on the blocks apply_fp8_tensor_parallel finds, before anything is sharded."""
    import warnings

    from lightning_fp8.distributed.tensor_parallel import _warn_about_dropout
    from lightning_fp8.distributed.tensor_parallel_plan import find_blocks, resolve_plan

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.proj, self.drop = nn.Linear(32, 64), nn.Linear(64, 32), nn.Dropout(p)

    model = nn.Sequential(Block(), Block(), nn.Dropout(0.5))  # the dropout outside the blocks runs replicated
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _warn_about_dropout(model, find_blocks(model, resolve_plan({"fc": "colwise", "proj": "rowwise"})))
    messages = [str(w.message) for w in caught if "dropout in the blocks" in str(w.message)]
    if p:
        assert len(messages) == 1 and "(0.drop, 1.drop)" in messages[0], messages
    else:
        assert not messages


@pytest.mark.parametrize("value", ["no", None, 1])
def test_a_style_s_fp8_comm_must_be_a_bool(value):
    """Found by a sweep: FP8ColwiseParallel(fp8_comm="no") was accepted and, a true string, switched the FP8
    collectives on (apply_fp8_tensor_parallel checked its own flag, the styles did not)."""
    from lightning_fp8.distributed.tensor_parallel import FP8ColwiseParallel, FP8RowwiseParallel

    for style in (FP8ColwiseParallel, FP8RowwiseParallel):
        with pytest.raises(TypeError, match=rf"{style.__name__}\(fp8_comm=.*\): must be True or False"):
            style(fp8_comm=value)
        assert style(fp8_comm=False).fp8_comm is False
