"""The gather FP8 all-reduce (every rank's FP8 bytes summed on every rank) on 2 and 4 gloo processes.

The reference is written here with plain torch: each rank's tensor cast with the power-of-two scale of the global
amax, the FP8 values of every rank summed in fp32 in rank order, times ``1 / (N scale)``. The copy-engine transport
(CUDA symmetric memory) is checked against the all-gather one on two GPUs in test_gather_gpu.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.distributed import tolerances as tol
from tests.distributed.test_comm import SIZES, _bucket, _mean, _per_tensor_sqnr, _same_everywhere, _WireCounter

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def one_rounding_mean(xs: list[torch.Tensor], fp8_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """The gather path's result, independently: shared scale, one cast per rank, exact fp32 sum in rank order."""
    from lightning_fp8.formats import fp8_max

    world, out = dist.get_world_size(), []
    for x in xs:
        amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        # 2**floor(log2(max / amax)) written out (not lightning_fp8.scaling.compute_scale); 1 for amax 0
        scale = 2.0 ** math.floor(math.log2(fp8_max(fp8_dtype) / amax.item())) if amax > 0 else 1.0
        q = (x.float() * scale).to(fp8_dtype).view(torch.uint8)
        rows = [torch.empty_like(q) for _ in range(world)]
        dist.all_gather(rows, q)
        total = rows[0].view(fp8_dtype).float()
        for r in rows[1:]:
            total = total + r.view(fp8_dtype).float()
        out.append((total * torch.tensor(1.0 / (world * scale), dtype=torch.float32)).to(dtype))
    return torch.cat(out)


def _worker(rank: int, world: int) -> dict:
    from lightning_fp8.distributed import SegmentLayout, all_reduce_fp8, all_reduce_fp8_gather
    from lightning_fp8.distributed.exchange import CollectiveChunks, CollectiveRows, SymmetricChunks, SymmetricRows

    res: dict = {}
    xs = _bucket(rank)
    x, layout = torch.cat(xs), SegmentLayout.per_tensor(SIZES)
    for name, dtype in (("e5m2", E5M2), ("e4m3", E4M3)):
        want = one_rounding_mean(xs, dtype, torch.float32)
        out, stats = all_reduce_fp8_gather(x, layout, None, dtype)
        res[f"{name}_exact"] = torch.equal(out, want)
        res[f"{name}_identical"] = _same_everywhere(out)
        res[f"{name}_found"] = bool(stats.found_nonfinite)
        res[f"{name}_sqnr"] = _per_tensor_sqnr(out, _mean(xs))
        res[f"{name}_portable_sqnr"] = _per_tensor_sqnr(all_reduce_fp8(x, layout, None, dtype)[0], _mean(xs))
    want = one_rounding_mean(xs, E5M2, torch.float32)
    # Sliced, in place, with the amaxes on another group: the same bytes.
    inplace = x.clone()
    amax_group = dist.new_group(list(range(world)))
    out, _ = all_reduce_fp8_gather(inplace, layout, None, E5M2, slices=3, out=inplace, amax_group=amax_group)
    res["sliced_inplace_exact"] = torch.equal(out, want) and out.data_ptr() == inplace.data_ptr()
    # bf16 in, bf16 out: the fp32 mean rounded once to bf16.
    xs16 = [t.bfloat16() for t in xs]
    out, _ = all_reduce_fp8_gather(torch.cat(xs16), layout, None, E5M2, slices=2)
    res["bf16_exact"] = out.dtype == torch.bfloat16 and torch.equal(out, one_rounding_mean(xs16, E5M2, torch.bfloat16))
    if world == 2:  # the Triton kernels (interpreted: slow) through the pipeline
        got, got_stats = all_reduce_fp8_gather(x, layout, None, E5M2, slices=2, fused=True)
        _, ref_stats = all_reduce_fp8_gather(x, layout, None, E5M2, slices=2)
        res["fused_exact"] = torch.equal(got, want) and torch.equal(got_stats.n_saturated, ref_stats.n_saturated)
    # A NaN or inf on the last rank: every rank's step flag, from the shared-amax all-reduce.
    for name, bad in (("nan", math.nan), ("inf", math.inf)):
        poisoned = [t.clone() for t in xs]
        if rank == world - 1:
            poisoned[2][17] = bad
        _, stats = all_reduce_fp8_gather(torch.cat(poisoned), layout, None, E5M2, slices=3)
        res[f"{name}_found"] = bool(stats.found_nonfinite)
    # Finite gradients whose FP8 rounding reaches the next power of two above the output dtype's range (65536 in
    # fp16, 2**128 in bf16): saturated at the dtype's maximum, never inf (an inf would pass every non-finite check).
    for dtype, value in ((torch.float16, 62000.0), (torch.bfloat16, torch.finfo(torch.bfloat16).max)):
        big = [torch.full((40,), value, dtype=dtype), torch.full((24,), -value, dtype=dtype)]
        limit = torch.finfo(dtype).max
        want_big = one_rounding_mean([t.float() for t in big], E5M2, torch.float32).clamp(-limit, limit).to(dtype)
        ok = True
        for algorithm in (all_reduce_fp8_gather, all_reduce_fp8):
            for fused in (False, True) if world == 2 else (False,):
                got, stats = algorithm(torch.cat(big), SegmentLayout.per_tensor([40, 24]), None, E5M2, fused=fused)
                ok &= bool(torch.isfinite(got).all()) and torch.equal(got, want_big) and not stats.found_nonfinite
        res[f"saturated_{dtype}"] = ok
    n_sizes = [20000, 777, 31000, 5, 8192, 1]
    with _WireCounter() as counter:
        all_reduce_fp8_gather(torch.randn(sum(n_sizes)), SegmentLayout.per_tensor(n_sizes), None, E5M2, slices=2)
    res["received_per_element"] = counter.sent / sum(n_sizes)  # an all-gather counts N - 1 times its input
    res["wire_calls"] = [name for name, _ in counter.calls]
    try:
        SymmetricRows(None, torch.device("cpu"))
    except ValueError as e:
        res["symmetric_refused"] = str(e)
    # A transport made for another group (the first half of the ranks) is refused on every rank, in it or not; one of
    # another communicator of the same ranks exchanges the same bytes.
    half = dist.new_group(list(range(world // 2)))
    try:
        all_reduce_fp8_gather(x, layout, None, E5M2, rows=CollectiveRows(half))
    except ValueError as e:
        res["foreign_rows_refused"] = str(e)
    same_ranks = dist.new_group(list(range(world)))
    res["same_ranks_rows_exact"] = torch.equal(
        all_reduce_fp8_gather(x, layout, None, E5M2, rows=CollectiveRows(same_ranks))[0], want
    )
    # The portable path's transport (CollectiveChunks, its default): the same checks, the same bytes as without it.
    try:
        all_reduce_fp8(x, layout, None, E5M2, chunks=CollectiveChunks(half))
    except ValueError as e:
        res["foreign_chunks_refused"] = str(e)
    portable = all_reduce_fp8(x, layout, None, E5M2, slices=3)[0]
    res["same_ranks_chunks_exact"] = torch.equal(
        all_reduce_fp8(x, layout, None, E5M2, slices=3, chunks=CollectiveChunks(same_ranks))[0], portable
    )
    try:
        SymmetricChunks(None, torch.device("cpu"))
    except ValueError as e:
        res["symmetric_chunks_refused"] = str(e)
    return res


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request, spawned):
    return request.param, spawned(request.param, "test_gather", "_worker")


pytestmark = pytest.mark.slow


def test_gather_all_reduce_is_the_one_rounding_mean(results):
    _, per_rank = results
    for r in per_rank:
        assert r["e5m2_exact"] and r["e4m3_exact"]
        assert r["e5m2_identical"] and r["e4m3_identical"]
        assert not r["e5m2_found"] and not r["e4m3_found"]
        assert r["sliced_inplace_exact"] and r["bf16_exact"]


def test_gather_is_more_accurate_than_the_portable_path(results):
    """One rounding instead of two: at least the portable path's SQNR on every tensor, more on average."""
    _, per_rank = results
    for r in per_rank:
        for name in ("e5m2", "e4m3"):
            got, portable = r[f"{name}_sqnr"], r[f"{name}_portable_sqnr"]
            assert min(got) >= tol.REDUCE_SCATTER_E5M2_SQNR_DB if name == "e5m2" else min(got) >= min(portable)
            assert sum(got) / len(got) > sum(portable) / len(portable) + 1.0, (got, portable)


def test_gather_fused_kernels_give_the_reference_bytes(results):
    world, per_rank = results
    if world != 2:
        pytest.skip("the interpreted kernels run on 2 ranks only")
    assert all(r["fused_exact"] for r in per_rank)


def test_means_saturate_at_the_output_dtype_maximum(results):
    """fp16 gradients of 62000 (E5M2 rounds their mean to 65536, inf in fp16) and bf16's maximum (rounds to 2**128):
    the gather and portable paths store the dtype's maximum, as the one-rounding mean clamped to it."""
    _, per_rank = results
    assert all(r["saturated_torch.float16"] and r["saturated_torch.bfloat16"] for r in per_rank)


def test_gather_nonfinite_on_one_rank_is_found_everywhere(results):
    _, per_rank = results
    assert all(r["nan_found"] and r["inf_found"] for r in per_rank)


def test_gather_bytes_on_the_wire(results):
    """N - 1 bytes received per element (the rows of the other ranks), plus the amaxes and row padding."""
    world, per_rank = results
    for r in per_rank:
        assert world - 1 <= r["received_per_element"] <= (world - 1) * 1.01, r["received_per_element"]
        assert r["wire_calls"][0] == "all_reduce" and set(r["wire_calls"][1:]) <= {
            "all_reduce", "all_gather_into_tensor", "all_gather_single"}  # fmt: skip


def test_symmetric_memory_transport_refuses_gloo(results):
    _, per_rank = results
    for r in per_rank:
        assert "not NCCL" in r["symmetric_refused"] and "CollectiveRows" in r["symmetric_refused"]
        assert "not NCCL" in r["symmetric_chunks_refused"] and "CollectiveChunks" in r["symmetric_chunks_refused"]


def test_gather_refuses_a_transport_made_for_another_group(results):
    """rows made for another group exchanged over its ranks without a word (a rank's row summed as another's, or ranks
    outside the group waiting). Refused before any exchange, on every rank, saying what to do."""
    world, per_rank = results
    for rank, r in enumerate(per_rank):
        made_for = "a group without this rank" if rank >= world // 2 else f"the ranks {list(range(world // 2))}"
        assert made_for in r["foreign_rows_refused"], r.get("foreign_rows_refused")
        assert f"group has the ranks {list(range(world))}" in r["foreign_rows_refused"]
        assert "CollectiveRows(group, ...)" in r["foreign_rows_refused"]
        assert r["same_ranks_rows_exact"]
        assert made_for in r["foreign_chunks_refused"] and "CollectiveChunks(group, ...)" in r["foreign_chunks_refused"]
        assert r["same_ranks_chunks_exact"]


@pytest.mark.parametrize(
    ("backend", "world", "shared", "expected"),
    [("nccl", 2, True, "gather"), ("nccl", 2, False, "native"), ("nccl", 4, True, "portable"),
     ("gloo", 2, True, "portable")],
)  # fmt: skip
def test_auto_takes_gather_where_ranks_share_symmetric_memory(monkeypatch, backend, world, shared, expected):
    """"auto" on two NCCL ranks of one host with peer access: the gather path (measured fastest there); the probe is
    asked once per device, and without a device (the construction-time check) "auto" answers as before."""
    from lightning_fp8.distributed import FP8CommState, comm_state

    asked = []

    def reason(group, device):
        asked.append(device)
        return None if shared else "the group spans 2 hosts"

    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(comm_state, "symmetric_memory_reason", reason)
    state = FP8CommState()
    device = torch.device("cuda", 0)
    assert [state.resolved_algorithm(device) for _ in range(3)] == [expected] * 3
    assert len(asked) <= 1
    assert state.resolved_algorithm() == ("native" if (backend, world) == ("nccl", 2) else "portable")
    assert FP8CommState(algorithm="gather").resolved_algorithm(device) == "gather"


@pytest.mark.parametrize(
    ("everyone", "visible", "peer_access", "trial", "expected"),
    [
        ([("h", "GPU-a"), ("h", "GPU-b")], ["GPU-a", "GPU-b"], True, True, None),
        ([("h", "GPU-a"), ("g", "GPU-b")], ["GPU-a", "GPU-b"], True, True, "spans 2 hosts"),
        ([("h", "GPU-a"), ("h", "GPU-a")], ["GPU-a"], True, True, "share a GPU"),
        ([("h", "GPU-a"), ("h", "GPU-b")], ["GPU-a"], True, True, "does not see"),  # CUDA_VISIBLE_DEVICES=own GPU
        ([("h", "GPU-a"), ("h", "GPU-b")], ["GPU-a", "GPU-b"], False, True, "cannot access"),
        ([("h", "GPU-a"), ("h", "GPU-b")], ["GPU-a", "GPU-b"], True, False, "trial rendezvous failed"),
    ],
)
def test_symmetric_memory_probe_needs_one_host_and_peer_access(
    monkeypatch, everyone, visible, peer_access, trial, expected
):
    """The probe's decision (rank 0 of two, on GPU-a), with what the ranks would report stubbed in."""
    from types import SimpleNamespace

    from lightning_fp8.distributed import exchange

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: len(everyone))
    monkeypatch.setattr(exchange, "symmetric_memory_error", lambda group: None)

    def all_gather_object(out, obj, group=None):
        out[:] = everyone

    def all_reduce(t, op=None, group=None):  # this rank's flag is the MAX: the other rank is like it here
        return None

    def trial_rendezvous(*args, **kwargs):
        if not trial:
            raise RuntimeError("handle passing refused")

    class _SymmMem:  # the trial allocation and rendezvous
        empty = staticmethod(lambda *a, **k: None)
        rendezvous = staticmethod(trial_rendezvous)

    import torch.distributed._symmetric_memory  # noqa: F401 (the attribute exists, then is replaced)

    monkeypatch.setitem(__import__("sys").modules, "torch.distributed._symmetric_memory", _SymmMem)
    monkeypatch.setattr(torch.distributed, "_symmetric_memory", _SymmMem)

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=visible[i]))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: peer_access)
    monkeypatch.setattr(torch, "tensor", lambda value, device=None: torch.as_tensor(value))
    monkeypatch.setattr(torch.cuda, "device", lambda index: __import__("contextlib").nullcontext())
    reason = exchange.symmetric_memory_reason(None, torch.device("cuda", 0))
    assert reason is None if expected is None else expected in reason
