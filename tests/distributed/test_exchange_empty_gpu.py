"""The copy-engine transports (CUDA symmetric memory) with an empty buffer: no element to copy, but the hand-off still
happens (a 0-byte copy was cut into no piece and the transports indexed the first one: IndexError).

One NCCL process on one GPU: symmetric memory works with a group of one rank, and an empty all-reduce through
``SymmetricChunks`` copies this rank's own (empty) chunk; the pulling ``SymmetricRows`` waits on its signals the same
way. The results are checked against the collectives' path (``CollectiveChunks`` / ``CollectiveRows``), which runs on
CPU too (test_gather.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_workers

pytestmark = pytest.mark.gpu

E5M2 = torch.float8_e5m2


def _worker(rank: int, world: int) -> dict:
    from lightning_fp8.distributed import SegmentLayout, all_reduce_fp8, all_reduce_fp8_gather
    from lightning_fp8.distributed.exchange import SymmetricChunks, SymmetricRows

    device = torch.device("cuda", rank)
    chunks = SymmetricChunks(None, device)
    rows = {"push": SymmetricRows(None, device), "pull": SymmetricRows(None, device, push=False)}
    res: dict = {}
    # The empty call first: the transports' first buffer is made by it; then a call with elements grows it.
    for sizes in ((0,), (0, 0), (0, 40), (24, 0, 40)):
        layout = SegmentLayout.per_tensor(sizes)
        x = torch.randn(sum(sizes), device=device).bfloat16()
        key = "x".join(map(str, sizes))
        want = all_reduce_fp8(x, layout, None, E5M2)[0]
        res[f"{key}_chunks"] = torch.equal(all_reduce_fp8(x, layout, None, E5M2, chunks=chunks)[0], want)
        want_gather = all_reduce_fp8_gather(x, layout, None, E5M2)[0]
        for name, transport in rows.items():
            got = all_reduce_fp8_gather(x, layout, None, E5M2, rows=transport)[0]
            res[f"{key}_{name}"] = got.shape == x.shape and torch.equal(got, want_gather)
    torch.cuda.synchronize()
    return res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA symmetric memory)")
def test_symmetric_memory_transports_hand_off_an_empty_buffer():
    (res,) = run_workers(_worker, 1, backend="nccl", timeout=240)
    assert res and all(res.values()), res
