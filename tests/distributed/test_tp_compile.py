"""Tensor-parallel FP8 layers under torch.compile (dynamo's eager backend, two gloo ranks) train as they do eagerly.

Found by a sweep on 2026-12-03: a rowwise layer without a bias ended its autograd Function's forward with the
all-reduce's in-place result, which torch 2.11 also returns as an intermediate and then gives the output's gradient
(zero input and weight gradients; tests/core/test_compiled_function_outputs.py says why); a sequence-parallel colwise
layer with FP8 communication saved a view of the gather's buffer for its backward, which dynamo (torch 2.13) refused
at the second step (an internal error on every rank).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import parallelize_module

from lightning_fp8 import FP8Linear
from lightning_fp8.distributed.tensor_parallel import FP8ColwiseParallel, FP8RowwiseParallel
from tests.distributed.launch import cpu_mesh, part_results, run_parts, run_workers
from tests.fx_outputs import forward_outputs


def _compiled_and_eager(model: nn.Module, inputs: list[torch.Tensor]) -> dict:
    """Train ``model`` compiled and a copy eagerly on the same inputs (sum of squares, no optimizer step): whether
    outputs, input gradients and weight gradients agree bit for bit at each step, and the traced forwards' counts."""
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    equal, counts = [], []
    with forward_outputs() as runs:
        for x in inputs:
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            ya, yb = compiled(xa), eager(xb)
            ya.square().sum().backward()
            yb.square().sum().backward()
            grads = [torch.equal(p.grad.to_local(), q.grad.to_local()) for p, q in
                     zip(model.parameters(), eager.parameters(), strict=True)]  # fmt: skip
            equal.append((torch.equal(ya, yb), torch.equal(xa.grad, xb.grad), all(grads), bool(xa.grad.any())))
            model.zero_grad()
            eager.zero_grad()
        counts = [count for _, count in runs]
    return {"equal": equal, "counts": counts}


def _rowwise_without_bias() -> dict:
    torch.manual_seed(0)
    layer = parallelize_module(FP8Linear(32, 32, bias=False), cpu_mesh(), FP8RowwiseParallel())
    return _compiled_and_eager(layer, [torch.randn(16, 16) for _ in range(3)])  # this rank's half of the features


def _sequence_parallel_fp8_comm() -> dict:
    torch.manual_seed(0)
    layer = FP8Linear(32, 64)
    layer = parallelize_module(layer, cpu_mesh(), FP8ColwiseParallel(input_layouts=Shard(1), fp8_comm=True))
    return _compiled_and_eager(layer, [torch.randn(2, 4, 32) for _ in range(3)])  # steps 1, 2: delayed scaling


def _worker(rank: int, world: int) -> dict:
    return run_parts({"rowwise": _rowwise_without_bias, "sequence_parallel": _sequence_parallel_fp8_comm})


@pytest.fixture(scope="module")
def two_ranks():
    return run_workers(_worker, 2, timeout=400.0)


@pytest.mark.parametrize("part", ["rowwise", "sequence_parallel"])
def test_compiled_tensor_parallel_layer_trains_as_eagerly(two_ranks, part):
    for result in part_results(two_ranks, part):
        assert result["counts"] and all(c == 1 for c in result["counts"]), result["counts"]
        # output, input gradient, weight gradients bit for bit; the input gradient not all zeros
        assert result["equal"] == [(True, True, True, True)] * 3
