"""Activation checkpointing (torch.utils.checkpoint, use_reentrant=False) of tensor-parallel FP8 layers.

The recompute in the backward must cast with the scales its forward used and record nothing (lightning_fp8.recompute),
as a plain FP8Linear does: the reference is the same parallel model run without checkpointing, from the same init on
the same data, whose gradients and scaling buffers the checkpointed run must reproduce bit for bit, step after step,
with delayed scaling (the scale moves after every forward: a recompute that cast with the moved scale, or recorded its
amax again, would show). With sequence parallelism the recompute must not synchronize the amax on its own either
(claim_shared_scale's collective and its warning).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.distributed.launch import part_results, run_parts, run_workers

pytestmark = pytest.mark.slow

WORLD, STEPS = 2, 4
D, HIDDEN, SEQ, BATCH = 48, 160, 6, 3  # not powers of two (FP8 GEMMs take multiples of 16); 3 tokens per rank


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, HIDDEN)
        self.proj = nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Checkpointed(nn.Module):
    def __init__(self, mlp: nn.Module, ckpt: bool) -> None:
        super().__init__()
        self.mlp, self.ckpt = mlp, ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.mlp, x, use_reentrant=False) if self.ckpt else self.mlp(x)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _steps(rank: int, sequence_parallel: bool) -> dict:
    """Gradients per step and the final scaling buffers of the parallel MLP without and with checkpointing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_fp8 import convert_to_fp8
    from lightning_fp8.distributed.amax_sync import enable_fp8_amax_sync
    from lightning_fp8.distributed.tensor_parallel import FP8ColwiseParallel, FP8RowwiseParallel
    from lightning_fp8.scaling import ScalingState

    torch.manual_seed(0)
    base = convert_to_fp8(MLP())
    assert base.fc.fp8_scaling["input"].delayed, "the test needs delayed scaling: the scale moves between casts"
    layout = Shard(1) if sequence_parallel else Replicate()
    plan = {"fc": FP8ColwiseParallel(input_layouts=layout), "proj": FP8RowwiseParallel(output_layouts=layout)}
    runs = {}
    for ckpt in (False, True):
        mlp = parallelize_module(copy.deepcopy(base), init_device_mesh("cpu", (WORLD,)), plan)
        model = Checkpointed(mlp, ckpt)
        enable_fp8_amax_sync(model)
        forwards = []
        mlp.fc.register_forward_hook(lambda *_, calls=forwards: calls.append(1))
        gen = torch.Generator().manual_seed(1)  # the same data for both runs
        grads = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(STEPS):
                x = torch.randn(BATCH, SEQ, D, generator=gen) * (1 + 3 * step)  # a new amax every step
                dy = torch.randn(BATCH, SEQ, D, generator=gen)
                if sequence_parallel:
                    rows = slice(rank * SEQ // WORLD, (rank + 1) * SEQ // WORLD)
                    x, dy = x[:, rows], dy[:, rows]
                model(x).backward(dy)
                grads.append({n: _full(p.grad).clone() for n, p in model.named_parameters()})
                model.zero_grad(set_to_none=True)
        buffers = {
            f"{name}.{b}": _local(buf).clone()
            for name, m in model.named_modules() if isinstance(m, ScalingState)
            for b, buf in m.named_buffers()
        }  # fmt: skip
        runs[ckpt] = {
            "grads": grads,
            "buffers": buffers,
            "fc_forwards": len(forwards),
            "warnings": [str(w.message) for w in caught if any(k in str(w.message) for k in ("FP8", "fp8", "amax"))],
        }
    return runs


def _worker(rank: int, world: int) -> dict:
    return run_parts({f"sp={sp}": lambda sp=sp: _steps(rank, sp) for sp in (False, True)})


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_workers(_worker, WORLD, timeout=300)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_checkpointed_tp_layers_match_the_unchecked_run_bit_for_bit(two_ranks, sequence_parallel):
    for rank, runs in enumerate(part_results(two_ranks, f"sp={sequence_parallel}")):
        plain, ckpt = runs[False], runs[True]
        assert ckpt["fc_forwards"] == 2 * plain["fc_forwards"] == 2 * STEPS, "the checkpointed run must recompute"
        for step, (g_ref, g) in enumerate(zip(plain["grads"], ckpt["grads"], strict=True)):
            for name, ref in g_ref.items():
                assert ref.abs().sum() > 0, f"rank {rank} step {step}: {name} got no gradient"
                assert torch.equal(g[name], ref), f"rank {rank} step {step}: {name} differs under checkpointing"
        # Each forward recorded its amaxes once: the histories, scales and cast counters are the unchecked run's.
        for name, ref in plain["buffers"].items():
            assert torch.equal(ckpt["buffers"][name], ref), f"rank {rank}: scaling buffer {name} differs"
        assert ckpt["warnings"] == plain["warnings"] == [], f"rank {rank}: {ckpt['warnings']}"
