"""FP8WeightAllGather (FSDP2's custom all-gather) with a weight margin, on 2 gloo processes, against its docstring
computed here with plain torch: an FP8Linear weight travels as E4M3 bytes cast with the power-of-two scale of its
*global* amax and the layer's weight margin, ``s = 2**(floor(log2(448 / amax)) - margin)``, and each rank decodes
every rank's bytes with that scale; other parameters travel as their own bytes. A mutation audit of the distributed
layer found the margin unpinned (a cast that ignored it, while the decode applied it, scaled every gathered weight by
``2**margin`` and passed the suite: its models all have margin 0). The comm is called directly with a parameter group
of a weight shard and a bias shard.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.distributed.launch import run_workers

pytestmark = pytest.mark.slow
E4M3 = torch.float8_e4m3fn
W, B, MARGIN = 48, 8, 2  # elements of the weight's and the bias's shard; the weight role's margin


def _shards(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(W, generator=g) * (1 + 3 * rank), torch.randn(B, generator=g)


def _worker(rank: int, world: int) -> dict:
    from lightning_fp8.distributed.fsdp2_comms import FP8WeightAllGather

    weight, bias = _shards(rank)
    params = [SimpleNamespace(sharded_param=torch.nn.Parameter(t.clone()), padded_sharded_param_size=t.shape)
              for t in (weight, bias)]  # fmt: skip
    comm = FP8WeightAllGather(SimpleNamespace(fsdp_params=params), {id(params[0].sharded_param): MARGIN}, fused=False)
    out = torch.empty(world * (W + B))
    comm(out, torch.cat([weight, bias]), dist.group.WORLD)
    return {"rows": out.view(world, W + B)}


def _expected(world: int) -> torch.Tensor:
    shards = [_shards(r) for r in range(world)]
    amax = max(w.abs().max().item() for w, _ in shards)  # the global amax: every rank's bytes share the scale
    scale = 2.0 ** (math.floor(math.log2(448.0 / amax)) - MARGIN)
    rows = [torch.cat([(w.double() * scale).float().to(E4M3).double().div(scale).float(), b]) for w, b in shards]
    return torch.stack(rows)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_workers(_worker, 2, timeout=120)


def test_gathered_weight_is_on_the_fp8_grid_of_the_global_scale_with_the_margin(two_ranks):
    want = _expected(2)
    for r in two_ranks:
        assert torch.equal(r["rows"], want)
