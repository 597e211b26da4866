"""The gather all-reduce through CUDA symmetric memory (copy-engine copies, signal-pad hand-offs) on two GPUs.

Two NCCL processes, one GPU each. The copy-engine transport must give the bytes of the all-gather transport and of
the independent one-rounding reference (test_gather.py), for every slicing, over repeated calls that reuse and grow
its buffer; and DDP training through ``FP8CommState(algorithm="gather")`` must match the all-gather transport step
for step. Needs two GPUs: on CPU the same path runs through all-gathers (test_gather.py, test_ddp.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.distributed.launch import run_workers
from tests.distributed.test_comm import SIZES, _bucket, _same_everywhere

E5M2 = torch.float8_e5m2


def _train(rank: int, rows_kind: str) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_fp8.distributed import FP8CommState, fp8_allreduce_hook
    from lightning_fp8.distributed.exchange import CollectiveRows

    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).to(device)
    ddp = DDP(model, device_ids=[rank], bucket_cap_mb=0.02)  # several buckets of different sizes
    state = FP8CommState(algorithm="gather")
    if rows_kind == "collective":
        state._rows[device] = CollectiveRows(None)
    ddp.register_comm_hook(state, fp8_allreduce_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    g = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(128, 64, device=device, generator=g)
    y = torch.tanh(x[:, :8])
    losses = []
    for _ in range(8):
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        assert state.check_step()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _worker(rank: int, world: int) -> dict:
    from lightning_fp8.distributed import SegmentLayout, all_reduce_fp8, all_reduce_fp8_gather
    from lightning_fp8.distributed.exchange import SymmetricChunks, SymmetricRows
    from tests.distributed.test_gather import one_rounding_mean

    device = torch.device("cuda", rank)
    res: dict = {}
    chunks = SymmetricChunks(None, device)
    transports = {"push": SymmetricRows(None, device), "pull": SymmetricRows(None, device, push=False, priority=0),
                  "push2": SymmetricRows(None, device, copy_streams=2),
                  "pull3": SymmetricRows(None, device, push=False, copy_streams=3)}  # fmt: skip
    for scale in (1, 512):  # the second bucket (5.6 MB of rows) outgrows the first allocation (1 MiB)
        xs = [t.to(device).repeat(scale) for t in _bucket(rank)]
        layout = SegmentLayout.per_tensor([t.numel() for t in xs])
        x = torch.cat(xs).bfloat16()
        want = one_rounding_mean([t.bfloat16() for t in xs], E5M2, torch.bfloat16)
        collective = all_reduce_fp8_gather(x, layout, None, E5M2, fused=True, slices=3)[0]
        res[f"x{scale}_collective_exact"] = torch.equal(collective, want)
        # The portable path through copy engines (SymmetricChunks) against its collectives, slice count by slice count
        # (the requantization's pieces depend on where the chunks fall).
        same = True
        for n in (1, 3, 3, 20):
            want_portable = all_reduce_fp8(x, layout, None, E5M2, fused=True, slices=n)[0]
            got = all_reduce_fp8(x, layout, None, E5M2, fused=True, slices=n, chunks=chunks)[0]
            same &= torch.equal(got, want_portable) and _same_everywhere(got)
        res[f"x{scale}_chunks_exact"] = same
        for name, rows in transports.items():
            got = [all_reduce_fp8_gather(x, layout, None, E5M2, fused=True, slices=n, rows=rows)[0]
                   for n in (1, 3, 3, 20)]  # fmt: skip  # 20 slices: the 15 signal channels are reused
            res[f"x{scale}_{name}_exact"] = all(torch.equal(g, want) for g in got)
            res[f"x{scale}_{name}_identical"] = all(_same_everywhere(g) for g in got)
    res["buffer_bytes"] = min(rows.buffer.numel() for rows in transports.values())
    res["grown"] = all(rows.allocations == 2 for rows in transports.values())
    res["chunks_grown"] = chunks.allocations == 2
    from lightning_fp8.distributed import FP8CommState

    auto = FP8CommState()  # two ranks of one host with peer access: "auto" takes the gather path, copy engines
    res["auto"] = (auto.resolved_algorithm(device), type(auto.gather_rows(device)).__name__)
    res["losses_symmetric"] = _train(rank, "symmetric")
    res["losses_collective"] = _train(rank, "collective")
    torch.cuda.synchronize()
    return res


@pytest.fixture(scope="module")
def results():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (CUDA symmetric memory between them); run by benchmarks/run_multi.sh")
    return run_workers(_worker, 2, backend="nccl", timeout=300)


pytestmark = pytest.mark.gpu


def test_symmetric_memory_gather_gives_the_reference_bytes(results):
    for r in results:
        for scale in (1, 512):
            assert r[f"x{scale}_collective_exact"], r
            for name in ("push", "pull", "push2", "pull3"):  # pushing/pulling on one, two, three copy streams
                assert r[f"x{scale}_{name}_exact"] and r[f"x{scale}_{name}_identical"], (name, r)
        assert r["buffer_bytes"] >= 2 * 512 * sum(SIZES) and r["grown"]  # grown once, for the larger bucket


def test_symmetric_memory_portable_path_gives_its_collectives_bytes(results):
    for r in results:
        assert r["x1_chunks_exact"] and r["x512_chunks_exact"], r
        assert r["chunks_grown"]


def test_auto_takes_the_copy_engine_gather_on_two_gpus_of_one_host(results):
    assert all(r["auto"] == ("gather", "SymmetricRows") for r in results)


def test_ddp_training_through_symmetric_memory_matches_all_gathers(results):
    for r in results:
        assert r["losses_symmetric"] == r["losses_collective"]
        assert r["losses_symmetric"][-1] < 0.5 * r["losses_symmetric"][0]
