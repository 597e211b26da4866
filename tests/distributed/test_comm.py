"""The FP8 collectives against fp32 collectives, on 2 and 4 gloo processes.

One spawn per world size runs every scenario (spawning costs seconds); the tests assert on its results.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.distributed import tolerances as tol
from tests.numerics import sqnr

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# Tensor sizes of a bucket: uneven, empty, single-element, one larger than a chunk.
SIZES = [37, 0, 1000, 5, 333, 4097, 1]


def _bucket(rank: int, magnitudes: bool = True) -> list[torch.Tensor]:
    """Gradients spanning 12 orders of magnitude across tensors and 4 within each (log-uniform)."""
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for i, n in enumerate(SIZES):
        spread = 10.0 ** (4 * torch.rand(n, generator=g) - 2) if magnitudes else 1.0
        out.append(torch.randn(n, generator=g) * spread * 10.0 ** (2 * i - 6))
    return out


def _mean(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    flat = torch.cat(xs).double()
    dist.all_reduce(flat)
    return list((flat / dist.get_world_size()).split([x.numel() for x in xs]))


def _same_everywhere(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(gathered[0], other) for other in gathered)


def _per_tensor_sqnr(out: torch.Tensor, ref: list[torch.Tensor]) -> list[float]:
    # SQNR is a statistic: only for tensors of some size (a 1-element tensor is checked by _within_rounding).
    parts = out.split([r.numel() for r in ref])
    return [sqnr(o, r) for o, r in zip(parts, ref, strict=True) if r.numel() >= tol.MIN_SQNR_NUMEL]


def _within_rounding(out: torch.Tensor, xs: list[torch.Tensor], ref: list[torch.Tensor], fp8_dtype) -> bool:
    """Elementwise bound of the two roundings: each rank's cast errs by at most 2**-(m+1) of the tensor's
    shared amax A, the requantized mean by 2**-(m+1) of itself: |out - ref| <= 2**-(m+1) (1.2 A + |ref|)."""
    eps = 2.0 ** -(4 if fp8_dtype == E4M3 else 3)
    ok = True
    for x, o, r in zip(xs, out.split([t.numel() for t in xs]), ref, strict=True):
        if not x.numel():
            continue
        amax = x.abs().amax().double()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        ok &= bool(((o.double() - r).abs() <= eps * (1.2 * amax + r.abs())).all())
    return ok


def _emulate_nccl_fp8_sum(q: torch.Tensor, group=None) -> None:
    """NCCL's float8 all-reduce as measured on two H200s: the fp32 sum of the FP8 inputs, rounded once to FP8."""
    world = dist.get_world_size(group)
    gathered = torch.empty(world * q.numel(), dtype=torch.uint8)
    dist.all_gather_into_tensor(gathered, q.view(torch.uint8).reshape(-1), group=group)
    total = gathered.view(world, -1).view(q.dtype).float().sum(0)
    q.copy_(total.to(q.dtype).view(q.shape))


class _WireCounter:
    """Wraps the collectives on ``torch.distributed`` and counts the bytes this rank sends.

    Normalized like bus bandwidth: an all-reduce of n elements of dtype d counts ``2 (N-1)/N n itemsize(d)``
    bytes (ring), an all-to-all ``(N-1)/N`` of its input, an all-gather ``N-1`` times its input.
    """

    NAMES = ("all_reduce", "all_to_all_single", "all_gather_into_tensor", "all_gather_single")

    def __init__(self) -> None:
        self.sent = 0.0
        self.calls: list[tuple[str, int]] = []
        self._orig = {}

    def __enter__(self) -> _WireCounter:
        world = dist.get_world_size()
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._orig[name] = fn
            factor = {"all_reduce": 2 * (world - 1) / world, "all_to_all_single": (world - 1) / world}.get(
                name, world - 1
            )
            setattr(dist, name, self._wrap(name, fn, factor))
        return self

    def _wrap(self, name, fn, factor):
        def counted(*args, **kwargs):
            tensor = args[1] if name != "all_reduce" else args[0]
            nbytes = tensor.numel() * tensor.element_size()
            self.sent += factor * nbytes
            self.calls.append((name, nbytes))
            return fn(*args, **kwargs)

        return counted

    def __exit__(self, *exc) -> None:
        for name, fn in self._orig.items():
            setattr(dist, name, fn)


def _worker(rank: int, world: int) -> dict:
    from lightning_fp8.distributed import SegmentLayout, all_reduce_fp8, all_reduce_fp8_native, reduce_scatter_fp8

    res: dict = {}
    xs = _bucket(rank)
    x, ref = torch.cat(xs), _mean(xs)
    layout = SegmentLayout.per_tensor(SIZES)
    for name, dtype in (("e5m2", E5M2), ("e4m3", E4M3)):
        out, stats = all_reduce_fp8(x, layout, None, dtype)
        res[f"allreduce_{name}_sqnr"] = _per_tensor_sqnr(out, ref)
        res[f"allreduce_{name}_bounded"] = _within_rounding(out, xs, ref, dtype)
        res[f"allreduce_{name}_identical"] = _same_everywhere(out)
        res[f"allreduce_{name}_found"] = bool(stats.found_nonfinite)
    # Pipelined in slices, and in place: the first cast is the same, the requantization has other pieces.
    inplace = x.clone()
    out, _ = all_reduce_fp8(inplace, layout, None, E5M2, slices=3, out=inplace)
    res["sliced_sqnr"] = _per_tensor_sqnr(out, ref)
    res["sliced_identical"] = _same_everywhere(out) and out.data_ptr() == inplace.data_ptr()
    amax_group = dist.new_group(list(range(world)))  # the amaxes' all-reduces on a second communicator
    got, _ = all_reduce_fp8(x, layout, None, E5M2, slices=3, amax_group=amax_group)
    res["amax_group_equal"] = torch.equal(got, out)
    other = dist.new_group([0])  # not the group's ranks: refused before anything is sent
    if rank == 0:
        try:
            all_reduce_fp8(x, layout, None, E5M2, amax_group=other)
        except ValueError as e:
            res["amax_group_refused"] = "same ranks" in str(e)
    out, _ = all_reduce_fp8(x.bfloat16(), layout, None, E5M2)
    res["allreduce_bf16_dtype"] = str(out.dtype)
    res["allreduce_bf16_sqnr"] = min(_per_tensor_sqnr(out.float(), ref))

    # Reduce-scatter over FSDP2's row layout: row r holds each parameter's r-th shard (uneven: 3 columns).
    columns = [17, 0, 250, 3]
    rows = torch.cat([t for t in _bucket(rank)[: world * len(columns)]])[: world * sum(columns)]
    chunk_sum, _ = reduce_scatter_fp8(rows, SegmentLayout.rows(world, columns), None, E5M2)
    full = rows.double().clone()
    dist.all_reduce(full)
    res["reduce_scatter_sqnr"] = sqnr(chunk_sum, full.view(world, -1)[rank])

    want, _ = reduce_scatter_fp8(rows, SegmentLayout.rows(world, columns), None, E5M2, slices=2, divisor=world)
    res["reduce_scatter_sliced_mean_sqnr"] = sqnr(want, full.view(world, -1)[rank] / world)
    # The Triton kernels (interpreted: slow, so on 2 ranks only) through the whole pipeline: the reference bytes.
    for name, dtype, slices in (("e5m2", E5M2, 1), ("e4m3", E4M3, 3)) if world == 2 else ():
        expected, expected_stats = all_reduce_fp8(x, layout, None, dtype, slices=slices)
        got, got_stats = all_reduce_fp8(x, layout, None, dtype, slices=slices, fused=True)
        same_sat = torch.equal(got_stats.n_saturated, expected_stats.n_saturated)
        res[f"fused_{name}_equal"] = torch.equal(got, expected) and same_sat
    if world == 2:
        got, _ = reduce_scatter_fp8(rows, SegmentLayout.rows(world, columns), None, E5M2, slices=2, divisor=world,
                                    fused=True, out=torch.empty(sum(columns), dtype=torch.bfloat16))  # fmt: skip
        res["fused_reduce_scatter_equal"] = torch.equal(got, want.bfloat16())

    res.update(_naive_failure_modes(rank, world))
    res.update(_nonfinite(rank, world))
    res.update(_wire_bytes(rank, world))

    # The native FP8-sum path, with NCCL's float8 all-reduce emulated on gloo.
    orig = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if tensor.dtype in (E4M3, E5M2):
            return _emulate_nccl_fp8_sum(tensor, group)
        return orig(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = all_reduce
    try:
        out, stats = all_reduce_fp8_native(x, layout, None, E5M2)
        res["native_sqnr"] = _per_tensor_sqnr(out, ref)
        res["native_found"] = bool(stats.found_nonfinite)
        res["native_sliced_equal"] = torch.equal(all_reduce_fp8_native(x, layout, None, E5M2, slices=4)[0], out)
        got, _ = all_reduce_fp8_native(x, layout, None, E5M2, slices=4, amax_group=amax_group)
        res["native_sliced_equal"] &= torch.equal(got, out)
        if world == 2:
            fused, fused_stats = all_reduce_fp8_native(x, layout, None, E5M2, slices=2, fused=True)
            same_sat = int(fused_stats.n_saturated) == int(stats.n_saturated)
            res["native_fused_equal"] = torch.equal(fused, out) and same_sat
        # Fully correlated gradients: every rank holds the same values, so the FP8 sum is N times each input;
        # with N = 4 the 1/sqrt(N) pre-scale leaves max/2 * 4 = 2 max: the sum overflows and must be caught.
        same = _bucket(0)[2].abs() + 1.0
        out, stats = all_reduce_fp8_native(same, SegmentLayout.per_tensor([same.numel()]), None, E5M2)
        res["native_correlated_found"] = bool(stats.found_nonfinite)
        res["native_correlated_saturated"] = int(stats.n_saturated)
        out, stats = all_reduce_fp8_native(
            same, SegmentLayout.per_tensor([same.numel()]), None, E5M2, extra_headroom=1
        )
        res["native_correlated_headroom_sqnr"] = sqnr(out, same)
    finally:
        dist.all_reduce = orig
    return res


def _naive_failure_modes(rank: int, world: int) -> dict:
    """The two ways a mean in FP8 fails without shared scaling, and the shared-scale path on the same data."""
    from lightning_fp8.distributed import SegmentLayout, all_reduce_fp8

    g = torch.Generator().manual_seed(7 + rank)
    big = torch.randn(999, generator=torch.Generator().manual_seed(7)) * 1.2e4  # near E5M2's max (57344)...
    big = big + 100 * torch.randn(999, generator=g)  # ...and correlated across ranks, as gradients are
    tiny = torch.randn(999, generator=g) * 1e-6  # under E5M2's smallest subnormal (1.5e-5) once divided by N
    res = {}
    for name, grad in (("overflow", big), ("underflow", tiny)):
        ref = _mean([grad])[0]
        layout = SegmentLayout.per_tensor([grad.numel()])
        res[f"shared_{name}_sqnr"] = sqnr(all_reduce_fp8(grad, layout, None, E5M2)[0], ref)
        if name == "overflow":  # divide after an FP8 sum: the sum leaves the format
            q = grad.to(E5M2)
            _emulate_nccl_fp8_sum(q)
            naive = q.float() / world
            res["naive_overflow_nonfinite"] = int((~torch.isfinite(naive)).sum())
        else:  # divide each g_i first: the quotient underflows to zero
            q = (grad / world).to(E5M2).float()
            dist.all_reduce(q)
            res["naive_underflow_sqnr"] = sqnr(q, ref)
    return res


class _SendSpy:
    """Records, at each all-to-all (gradient bytes leaving), whether a shared amax this rank reduced is non-finite.

    The MAX all-reduces may be asynchronous: their tensors are read when the data is sent, so a rank that sent
    before waiting for its amax all-reduce would be caught reading its own (finite) amaxes.
    """

    def __init__(self) -> None:
        self.reduced: list[torch.Tensor] = []
        self.known_at_send: list[bool] = []

    def __enter__(self) -> _SendSpy:
        self._reduce, self._a2a = dist.all_reduce, dist.all_to_all_single

        def all_reduce(tensor, *args, **kwargs):
            if kwargs.get("op") == dist.ReduceOp.MAX:  # the shared-amax all-reduce
                self.reduced.append(tensor)
            return self._reduce(tensor, *args, **kwargs)

        def all_to_all_single(*args, **kwargs):
            self.known_at_send.append(any(not bool(torch.isfinite(t).all()) for t in self.reduced))
            return self._a2a(*args, **kwargs)

        dist.all_reduce, dist.all_to_all_single = all_reduce, all_to_all_single
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce, dist.all_to_all_single = self._reduce, self._a2a


def _nonfinite(rank: int, world: int) -> dict:
    """A NaN or inf on one rank: every rank learns it from the shared-amax all-reduce before the tensor's bytes move."""
    from lightning_fp8.distributed import SegmentLayout, all_reduce_fp8, reduce_scatter_fp8

    res = {}
    for name, bad in (("nan", math.nan), ("inf", math.inf)):
        xs = _bucket(rank, magnitudes=False)
        if rank == world - 1:
            xs[2][17] = bad
        x = torch.cat(xs)
        with _SendSpy() as spy:
            _, stats = all_reduce_fp8(x, SegmentLayout.per_tensor(SIZES), None, E5M2)
        res[f"{name}_found"] = bool(stats.found_nonfinite)
        res[f"{name}_known_before_send"] = bool(spy.known_at_send) and all(spy.known_at_send)
        padded = torch.nn.functional.pad(x, (0, (-x.numel()) % world))
        with _SendSpy() as spy:
            _, stats = reduce_scatter_fp8(padded, SegmentLayout.per_tensor(SIZES).padded(padded.numel()), None, E5M2,
                                          slices=2)  # fmt: skip
        res[f"{name}_reduce_scatter_found"] = bool(stats.found_nonfinite)
        res[f"{name}_reduce_scatter_known_before_send"] = len(spy.known_at_send) == 2 and all(spy.known_at_send)
    # Pipelined: the amaxes are reduced stage by stage; the last tensor (in the last slice) is poisoned. Its amax is
    # known before the slice holding it leaves, and the step's flag is set everywhere.
    xs = _bucket(rank, magnitudes=False)
    if rank == 0:
        xs[-1][0] = math.nan
    with _SendSpy() as spy:
        _, stats = all_reduce_fp8(torch.cat(xs), SegmentLayout.per_tensor(SIZES), None, E5M2, slices=3)
    res["sliced_nan_found"] = bool(stats.found_nonfinite)
    res["sliced_known_at_send"] = spy.known_at_send
    return res


def _wire_bytes(rank: int, world: int) -> dict:
    from lightning_fp8.distributed import SegmentLayout, all_reduce_fp8

    n_sizes = [20000, 777, 31000, 5, 8192, 1]
    x = torch.randn(sum(n_sizes))
    res = {}
    for name in ("fp32", "bf16"):
        with _WireCounter() as counter:
            dist.all_reduce(x.clone() if name == "fp32" else x.bfloat16())
        res[f"wire_{name}"] = counter.sent / (2 * (world - 1) / world * x.numel())
    with _WireCounter() as counter:
        all_reduce_fp8(x, SegmentLayout.per_tensor(n_sizes), None, E5M2)
    res["wire_fp8"] = counter.sent / (2 * (world - 1) / world * x.numel())
    res["wire_fp8_calls"] = counter.calls
    return res


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request, spawned):
    return request.param, spawned(request.param, "test_comm", "_worker")


pytestmark = pytest.mark.slow


def test_all_reduce_matches_fp32_mean_across_orders_of_magnitude(results):
    _, per_rank = results
    for r in per_rank:
        assert min(r["allreduce_e5m2_sqnr"]) >= tol.ALLREDUCE_E5M2_SQNR_DB, r["allreduce_e5m2_sqnr"]
        assert min(r["allreduce_e4m3_sqnr"]) >= tol.ALLREDUCE_E4M3_SQNR_DB, r["allreduce_e4m3_sqnr"]
        assert r["allreduce_e5m2_bounded"] and r["allreduce_e4m3_bounded"]
        assert r["allreduce_bf16_dtype"] == "torch.bfloat16"
        assert r["allreduce_bf16_sqnr"] >= tol.ALLREDUCE_E5M2_SQNR_DB
        assert not r["allreduce_e5m2_found"]


def test_all_reduce_result_is_identical_on_every_rank(results):
    _, per_rank = results
    assert all(r["allreduce_e5m2_identical"] and r["allreduce_e4m3_identical"] for r in per_rank)


def test_pipelined_in_place_all_reduce(results):
    _, per_rank = results
    for r in per_rank:
        assert min(r["sliced_sqnr"]) >= tol.ALLREDUCE_E5M2_SQNR_DB and r["sliced_identical"]
        assert r["native_sliced_equal"]  # the native path's values do not depend on the slicing (nor amax_group)
        assert r["amax_group_equal"]  # nor where the amaxes are all-reduced
    assert per_rank[0]["amax_group_refused"]


def test_reduce_scatter_uneven_rows_matches_fp32_sum(results):
    _, per_rank = results
    for r in per_rank:
        assert r["reduce_scatter_sqnr"] >= tol.REDUCE_SCATTER_E5M2_SQNR_DB
        assert r["reduce_scatter_sliced_mean_sqnr"] >= tol.REDUCE_SCATTER_E5M2_SQNR_DB


def test_triton_kernels_give_the_reference_bytes_through_every_collective(results):
    world, per_rank = results
    if world != 2:
        pytest.skip("the interpreted kernels run on 2 ranks only (their 4-rank sums: test_comm_kernels.py)")
    for r in per_rank:
        assert r["fused_e5m2_equal"] and r["fused_e4m3_equal"]  # portable all-reduce, one and three slices
        assert r["fused_reduce_scatter_equal"]  # two slices, the mean written in bf16
        assert r["native_fused_equal"]  # the FP8-sum path (NCCL's sum emulated)


def test_naive_fp8_mean_overflows_or_underflows_and_shared_scale_does_not(results):
    _, per_rank = results
    for r in per_rank:
        assert r["naive_overflow_nonfinite"] > 0  # divide after the FP8 sum: overflow
        assert r["naive_underflow_sqnr"] < tol.BROKEN_SQNR_DB  # divide each g_i first: underflow
        assert r["shared_overflow_sqnr"] >= tol.ALLREDUCE_E5M2_SQNR_DB
        assert r["shared_underflow_sqnr"] >= tol.ALLREDUCE_E5M2_SQNR_DB


def test_nonfinite_on_one_rank_is_known_everywhere_before_data_is_sent(results):
    _, per_rank = results
    for r in per_rank:
        for name in ("nan", "inf"):
            assert r[f"{name}_found"] and r[f"{name}_reduce_scatter_found"]
            assert r[f"{name}_known_before_send"] and r[f"{name}_reduce_scatter_known_before_send"]
        assert r["sliced_nan_found"]
        assert len(r["sliced_known_at_send"]) == 3 and r["sliced_known_at_send"][-1]


def test_bytes_on_the_wire(results):
    world, per_rank = results
    for r in per_rank:
        assert r["wire_fp32"] == pytest.approx(4.0) and r["wire_bf16"] == pytest.approx(2.0)  # the counter
        assert r["wire_fp8"] <= tol.MAX_WIRE_BYTES_PER_ELEMENT, (r["wire_fp8"], r["wire_fp8_calls"])
        names = [name for name, _ in r["wire_fp8_calls"]]
        assert names == ["all_reduce", "all_to_all_single", names[2]], names  # amax, data, data + scales


def test_native_fp8_sum_path(results):
    world, per_rank = results
    for r in per_rank:
        assert min(r["native_sqnr"]) >= tol.ALLREDUCE_E5M2_SQNR_DB
        assert not r["native_found"]
        if world == 4:  # 1/sqrt(N) headroom is not enough for fully correlated gradients on 4 ranks
            assert r["native_correlated_found"] and r["native_correlated_saturated"] > 0
        else:
            assert not r["native_correlated_found"]
        assert r["native_correlated_headroom_sqnr"] >= tol.ALLREDUCE_E5M2_SQNR_DB


@pytest.mark.parametrize(
    ("backend", "world", "expected"),
    [("nccl", 2, "native"), ("nccl", 4, "portable"), ("nccl", 8, "portable"), ("gloo", 2, "portable")],
)
def test_auto_algorithm_per_backend_and_world_size(monkeypatch, backend, world, expected):
    """"auto": NCCL's FP8 sum only where it is as accurate as the portable path (two ranks: one rounding)."""
    from lightning_fp8.distributed import FP8CommState

    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: world)
    assert FP8CommState().resolved_algorithm() == expected
    assert FP8CommState(algorithm="portable").resolved_algorithm() == "portable"
