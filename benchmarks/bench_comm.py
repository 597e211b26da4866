"""FP8 gradient communication against NCCL all-reduce / reduce-scatter in bf16 and fp32.

Run on one host with several GPUs (NVLink multicast off, as the GPU README asks; the script sets both variables
unless they are set already)::

    torchrun --nproc-per-node 2 benchmarks/bench_comm.py              # 1B elements, plus ~1B GPT training steps
    torchrun --nproc-per-node 4 benchmarks/bench_comm.py --no-gpt
    torchrun --nproc-per-node 2 benchmarks/bench_comm.py --no-gpt --sweep   # + grids, slices, NCCL settings
    torchrun --nproc-per-node 2 benchmarks/bench_comm.py --toy        # CPU, gloo, small sizes (a smoke test)

What it measures, in one run:

- first, on GPU, the Triton kernels (kernels/comm.py) against their PyTorch references through every FP8
  collective, bit for bit, and whether every rank holds the same result;
- the gradient reduction of ``--numel`` elements (bf16 gradients cut into ``--tensors`` tensors of uneven sizes),
  each FP8 variant checked against the fp32 mean (SQNR) on the same data before it is timed: NCCL all-reduce in
  fp32 and bf16; the portable FP8 path (FP8 all-to-all, fp32 sum, FP8 all-gather) in E5M2 and E4M3, pipelined in
  ``--slices``; the native FP8 path (NCCL's float8 all-reduce); the gather path (every rank's FP8 bytes summed on
  every rank) through all-gathers and, on NCCL, through copy-engine copies out of CUDA symmetric memory; the raw
  FP8 collectives alone (their lower bound);
  reduce-scatter bf16 against the FP8 reduce-scatter (FSDP's collective); each elementwise pass alone (amax,
  cast, decode) against a device copy, as HBM bandwidth;
- with ``--sweep`` (NCCL): the native FP8 all-reduce over the comm kernels' persistent grids, slice counts and
  NCCL settings (the amax all-reduces on a second communicator, high-priority NCCL streams, NCCL's CTAs capped),
  and the portable one over grids: how the kernels and NCCL share the GPU;
- with ``--gpt`` (default on GPU; benchmarks/bench_comm_gpt.py): a training step (forward, backward, AdamW) of a
  ~1B-parameter GPT under DDP (fp32 all-reduce, bf16 compression hook, FP8 hook portable and native; for each
  ``--bucket-mb``) and FSDP2 (bf16 reduce-scatter, FP8 reduce-scatter [+ FP8 weight all-gather with
  ``--fp8-linear``]).

Times are medians of CUDA-event timings after warm-up, the slowest rank's. Bus bandwidth follows nccl-tests: an
all-reduce moves ``2 (N-1)/N`` of its bytes per rank, a reduce-scatter ``(N-1)/N``; FP8 variants count 1 byte per
element. The table comes last; the full log goes to ``--log-file``.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from lightning_fp8.distributed import (
    SegmentLayout,
    all_reduce_fp8,
    all_reduce_fp8_gather,
    all_reduce_fp8_native,
    reduce_scatter_fp8,
)
from lightning_fp8.distributed.exchange import SymmetricChunks, SymmetricRows
from lightning_fp8.distributed.layout import all_reduce_plan
from lightning_fp8.formats import E4M3, E5M2

LOG: list[str] = []


def log(msg: str) -> None:
    LOG.append(msg)
    if dist.get_rank() == 0:
        print(msg, flush=True)


def timed(fn, iters: int, warmup: int, device: torch.device) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs after ``warmup`` runs (all ranks in step)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    ms = torch.tensor(statistics.median(times), dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the slowest rank is the collective's time
    return ms.item()


def sqnr_db(out: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 26) -> float:
    """SQNR in dB over all ranks, chunk by chunk (a 1B-element float64 copy would not fit comfortably)."""
    sums = torch.zeros(2, dtype=torch.float64, device=ref.device)
    for o, r in zip(out.split(chunk), ref.split(chunk), strict=True):
        r32 = r.float()
        sums[0] += r32.square().sum().double()
        sums[1] += (o.float() - r32).square().sum().double()
    dist.all_reduce(sums)
    return float("inf") if sums[1] == 0 else 10 * torch.log10(sums[0] / sums[1]).item()


def tensor_sizes(numel: int, count: int, world: int) -> list[int]:
    """``count`` uneven tensor sizes summing to ``numel`` (sizes like a model's: a few large, many small)."""
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(count, generator=g) ** 3 + 0.01
    sizes = (weights / weights.sum() * numel).long()
    sizes[0] += numel - sizes.sum()
    return sizes.tolist()


def gradients(numel: int, count: int, device: torch.device) -> tuple[torch.Tensor, SegmentLayout]:
    """This rank's flat bf16 gradient of ``count`` tensors (:func:`tensor_sizes`), each of its own magnitude over 8
    orders, and its layout (one scale group per tensor)."""
    sizes = tensor_sizes(numel, count, dist.get_world_size())
    g = torch.Generator(device=device).manual_seed(1234 + dist.get_rank())
    grads = torch.randn(numel, generator=g, device=device, dtype=torch.bfloat16)
    mags = torch.logspace(-6, 2, len(sizes), device=device, dtype=torch.float32)
    grads.mul_(torch.repeat_interleave(mags, torch.tensor(sizes, device=device)).bfloat16())
    return grads, SegmentLayout.per_tensor(sizes)


def same_on_every_rank(t: torch.Tensor) -> bool:
    """Whether every rank holds the same bytes (compared through two checksums of the raw bits)."""
    sums = torch.zeros(2, dtype=torch.int64, device=t.device)
    for part in t.reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32).split(1 << 26):
        bits = part.to(torch.int64)
        sums += torch.stack([bits.sum(), (bits * bits).sum()])
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(torch.equal(low, high))


def check_kernels(device: torch.device, world: int) -> None:
    """The Triton kernels against their PyTorch references through every FP8 collective, bit for bit (16M elements)."""
    sizes = tensor_sizes(1 << 24, 16, world)
    layout = SegmentLayout.per_tensor(sizes)
    g = torch.Generator(device=device).manual_seed(99 + dist.get_rank())
    x = torch.randn(1 << 24, generator=g, device=device, dtype=torch.bfloat16)
    x.mul_(torch.repeat_interleave(torch.logspace(-9, 3, len(sizes), device=device), torch.tensor(sizes, device=device))
           .bfloat16())  # fmt: skip
    results = []
    for name, fn in (
        ("portable e5m2", lambda f: all_reduce_fp8(x, layout, None, E5M2, fused=f, slices=3)),
        ("portable e4m3", lambda f: all_reduce_fp8(x, layout, None, E4M3, fused=f)),
        ("native e5m2", lambda f: all_reduce_fp8_native(x, layout, None, E5M2, fused=f, slices=3)),
        ("gather e5m2", lambda f: all_reduce_fp8_gather(x, layout, None, E5M2, fused=f, slices=3)),
        ("reduce_scatter", lambda f: reduce_scatter_fp8(x, layout, None, E5M2, fused=f, slices=2)),
    ):
        (ref, ref_stats), (got, got_stats) = fn(False), fn(True)
        exact = torch.equal(ref.view(torch.int16 if ref.element_size() == 2 else torch.int32),
                            got.view(torch.int16 if got.element_size() == 2 else torch.int32))  # fmt: skip
        exact = exact and torch.equal(ref_stats.n_saturated, got_stats.n_saturated)
        results.append(f"{name}: {'bit-exact' if exact else 'MISMATCH'}")
        if name != "reduce_scatter":
            results[-1] += f", identical on every rank: {same_on_every_rank(got)}"
    if dist.get_backend() == "nccl":  # the copy-engine transport against the all-gather one, same kernels
        want = all_reduce_fp8_gather(x, layout, None, E5M2, fused=True, slices=3)[0]
        sym = SymmetricRows(None, device)
        got = [all_reduce_fp8_gather(x, layout, None, E5M2, fused=True, slices=s, rows=sym)[0] for s in (3, 3, 1, 8)]
        same = all(torch.equal(g.view(torch.int16), want.view(torch.int16)) for g in got)
        results.append(f"gather through symmetric memory (4 calls, 1-8 slices): {'bit-exact' if same else 'MISMATCH'}")
        chunks = SymmetricChunks(None, device)
        portable = [(all_reduce_fp8(x, layout, None, E5M2, fused=True, slices=s, chunks=chunks)[0],
                     all_reduce_fp8(x, layout, None, E5M2, fused=True, slices=s)[0]) for s in (3, 1, 8)]  # fmt: skip
        same = all(torch.equal(got, want) for got, want in portable)
        results.append(f"portable through symmetric memory (1-8 slices): {'bit-exact' if same else 'MISMATCH'}")
    log("Triton kernels vs PyTorch references (16M elements, 16 tensors): " + "; ".join(results))


def bench_passes(grads: torch.Tensor, layout: SegmentLayout, args, device, rows: list[tuple]) -> None:
    """Each elementwise pass of the FP8 all-reduce alone over the whole buffer, as achieved memory bandwidth."""
    from lightning_fp8.distributed.layout import all_reduce_plan
    from lightning_fp8.distributed.quantize import segment_kernels

    kernels = segment_kernels(True)
    (plan,) = all_reduce_plan(layout, 1, 0, 1, True, device)  # one slice, no chunking: the whole buffer
    amax = torch.zeros(layout.num_groups, device=device)
    kernels.segment_amax(grads, plan.cast, amax)
    q = torch.empty(grads.numel(), dtype=torch.uint8, device=device)
    out = torch.empty_like(grads)
    n, counts = torch.zeros((), dtype=torch.int64, device=device), torch.zeros(2, dtype=torch.int64, device=device)
    size = grads.element_size()
    for name, fn, nbytes in (
        ("pass: segment amax (read bf16)", lambda: kernels.segment_amax(grads, plan.cast, amax), size),
        ("pass: quantize (bf16 -> fp8)", lambda: kernels.quantize(grads, plan.cast, amax, E5M2, q, n), size + 1),
        ("pass: dequantize (fp8 -> bf16)", lambda: kernels.dequantize(q, plan.decode, amax, E5M2, out), size + 1),
        ("pass: dequantize, checked (native)", lambda: kernels.dequantize(q, plan.decode, amax, E5M2, out,
                                                                          counts=counts), size + 1),  # fmt: skip
        ("pass: device copy (bf16)", lambda: out.copy_(grads), 2 * size),
    ):
        ms = timed(fn, args.iters, args.warmup, device)
        gbps = grads.numel() * nbytes / (ms * 1e-3) / 1e9
        rows.append(("memory pass", name, ms, gbps, "GB/s of HBM traffic"))
        log(f"  {name:<42} {ms:9.3f} ms  {gbps:8.1f} GB/s HBM")


def _with_grid(programs_per_sm: int, fn):
    """``fn`` run with every comm kernel's persistent grid at ``programs_per_sm`` (0: one program per tile)."""
    from lightning_fp8.kernels import comm

    def run():
        saved = {k: dict(v) for k, v in comm.CONFIGS.items()}
        for cfg in comm.CONFIGS.values():
            cfg["PROGRAMS_PER_SM"] = programs_per_sm
        try:
            return fn()
        finally:
            comm.CONFIGS.update(saved)

    return run


def _nccl_group(high_priority: bool = False, max_ctas: int | None = None):
    """A second NCCL communicator over all ranks, its stream of high priority or its CTAs capped."""
    opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)
    if max_ctas:
        opts.config.max_ctas = max_ctas
    return dist.new_group(backend="nccl", pg_options=opts)


def sweep_variants(grads: torch.Tensor, layout: SegmentLayout, args) -> list[tuple]:
    """The FP8 all-reduces over kernel grids (--sweep-programs), slices (--sweep-slices) and NCCL settings: the amax
    all-reduces on their own communicator ("amax comm"), both communicators' streams of high priority ("hp"), NCCL's
    CTAs capped ("ctas N"). How the kernels and NCCL share the GPU decides how much of the passes the pipeline hides.
    """
    amax_comm, hp, hp_amax = _nccl_group(), _nccl_group(True), _nccl_group(True)
    settings = [("", None, None), ("amax comm", None, amax_comm), ("hp amax comm", hp, hp_amax)]
    out = []
    for label, group, amax_group in settings:
        for ppsm in args.sweep_programs:
            for slices in args.sweep_slices:
                fn = _with_grid(ppsm, lambda g=group, a=amax_group, s=slices: all_reduce_fp8_native(
                    grads, layout, g, E5M2, slices=s, fused=True, amax_group=a)[0])  # fmt: skip
                name = f"FP8 native {slices} sl, grid {ppsm or 'tiles'}/SM {label}".rstrip()
                out.append(("all_reduce", name, fn, 1, fn))
    for ppsm in args.sweep_programs[1:]:  # the portable path (FP8CommState's choice on more than 2 ranks)
        fn = _with_grid(ppsm, lambda: all_reduce_fp8(grads, layout, None, E5M2, slices=8, fused=True,
                                                     amax_group=amax_comm)[0])  # fmt: skip
        out.append(("all_reduce", f"FP8 portable 8 sl, grid {ppsm}/SM amax comm", fn, 1, fn))
    for ctas in (8, 16):
        try:
            capped = _nccl_group(True, ctas)
        except Exception as e:  # an older torch without the option: report and go on
            log(f"  NCCL max_ctas={ctas}: not available ({type(e).__name__}: {e})")
            continue
        q8 = grads.to(E5M2)
        out.append(("all_reduce", f"comm only: all_reduce float8, ctas {ctas}", lambda c=capped, q=q8: dist.all_reduce(
            q, group=c), 1, None))  # fmt: skip
        for ppsm in args.sweep_programs[1:]:
            fn = _with_grid(ppsm, lambda c=capped: all_reduce_fp8_native(grads, layout, c, E5M2, slices=8, fused=True,
                                                                         amax_group=hp_amax)[0])  # fmt: skip
            out.append(("all_reduce", f"FP8 native 8 sl, grid {ppsm}/SM hp amax comm ctas {ctas}", fn, 1, fn))
    return out


def bench_reduction(args, device: torch.device, rows: list[tuple]) -> None:
    world = dist.get_world_size()
    nccl = dist.get_backend() == "nccl"
    grads, layout = gradients(args.numel, args.tensors, device)
    log(f"reduction: {args.numel:,} bf16 gradient elements in {layout.num_groups} tensors, {world} ranks, "
        f"{device.type}")
    fused = device.type == "cuda" and not args.eager
    if fused:
        check_kernels(device, world)

    ref = grads.float()
    dist.all_reduce(ref)
    ref.div_(world)
    avg = dist.ReduceOp.AVG if nccl else dist.ReduceOp.SUM  # gloo has no AVG; values stay bounded either way

    x32, x16 = grads.float(), grads.clone()
    # (kind, name, fn, wire bytes per element, check): a kind's "bf16" row is its baseline in the table.
    variants = [
        ("all_reduce", "all_reduce fp32", lambda: dist.all_reduce(x32, op=avg), 4, None),
        ("all_reduce", "all_reduce bf16", lambda: dist.all_reduce(x16, op=avg), 2, None),
    ]
    kw = {"fused": fused}
    portable = [("e5m2", E5M2, 1), ("e4m3", E4M3, 1)] + [("e5m2", E5M2, s) for s in args.slices]
    for name, dtype, slices in portable:
        fn = lambda dtype=dtype, slices=slices: all_reduce_fp8(grads, layout, None, dtype, slices=slices, **kw)[0]  # noqa: E731
        variants.append(("all_reduce", f"FP8 portable {name}, {slices} slice(s)", fn, 1, fn))
    for slices in [1, *args.slices] if nccl else ():
        fn = lambda slices=slices: all_reduce_fp8_native(grads, layout, None, E5M2, slices=slices, **kw)[0]  # noqa: E731
        variants.append(("all_reduce", f"FP8 native e5m2 (NCCL fp8 sum), {slices} slice(s)", fn, 1, fn))
    # The gather path receives N - 1 rows: world / 2 bytes per element in the all-reduce's bus-bandwidth terms.
    for slices in [1, *args.slices]:
        fn = lambda slices=slices: all_reduce_fp8_gather(grads, layout, None, E5M2, slices=slices, **kw)[0]  # noqa: E731
        variants.append(("all_reduce", f"FP8 gather e5m2 (all_gather), {slices} slice(s)", fn, world / 2, fn))
    if nccl:
        q8 = grads.to(E5M2)
        variants.append(("all_reduce", "comm only: all_reduce float8", lambda: dist.all_reduce(q8), 1, None))
        sym = SymmetricRows(None, device)  # the transport's defaults: pushing on one high-priority copy stream
        pull = SymmetricRows(None, device, push=False, priority=0)  # pulling at default priority (before)
        for slices in [1, 2, *args.slices]:
            fn = lambda slices=slices: all_reduce_fp8_gather(grads, layout, None, E5M2, slices=slices, rows=sym,  # noqa: E731
                                                             **kw)[0]  # fmt: skip
            variants.append(("all_reduce", f"FP8 gather e5m2 (copy engines), {slices} slice(s)", fn, world / 2, fn))
        for slices in args.slices:
            fn = lambda slices=slices: all_reduce_fp8_gather(grads, layout, None, E5M2, slices=slices, rows=pull,  # noqa: E731
                                                             **kw)[0]  # fmt: skip
            variants.append(("all_reduce", f"FP8 gather e5m2 (copy engines, pulling), {slices} slice(s)", fn,
                             world / 2, None))  # fmt: skip
        chunks = SymmetricChunks(None, device)  # the portable path (2 (N - 1) / N bytes received per element)
        for slices in args.slices:
            fn = lambda slices=slices: all_reduce_fp8(grads, layout, None, E5M2, slices=slices, chunks=chunks, **kw)[0]  # noqa: E731
            variants.append(("all_reduce", f"FP8 portable e5m2 (copy engines), {slices} slice(s)", fn, 1, fn))
        one = all_reduce_plan(layout, world, dist.get_rank(), 1, True, device)

        def raw_copy_engines():  # the signals and copies alone, without the cast and the sum
            sym.begin(one, device)
            sym.received(0, sym.send(0))

        variants.append(("all_reduce", "comm only: copy-engine copies of N-1 rows", raw_copy_engines, world / 2, None))
    u8 = torch.randint(0, 120, (args.numel - args.numel % world,), device=device, dtype=torch.uint8)
    recv, shard = torch.empty_like(u8), u8[: u8.numel() // world]
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def raw_portable():
        dist.all_to_all_single(recv, u8)
        gather(recv, shard)

    variants.append(("all_reduce", "comm only: all_to_all + all_gather u8", raw_portable, 1, None))
    rs_in = grads[: u8.numel()]
    rs_out = torch.empty(rs_in.numel() // world, dtype=torch.bfloat16, device=device)
    rs_layout = layout.slice(0, rs_in.numel())  # the same tensors (cut to a multiple of the world size)
    rs = getattr(dist, "reduce_scatter_single", None)
    if nccl:
        rs_fn = (lambda: rs(output=rs_out, input=rs_in)) if rs else (lambda: dist.reduce_scatter_tensor(rs_out, rs_in))
        variants.append(("reduce_scatter", "reduce_scatter bf16", rs_fn, 2, None))
    for slices in (1, max(args.slices)):
        fn = lambda slices=slices: reduce_scatter_fp8(rs_in, rs_layout, None, E5M2, slices=slices, out=rs_out, **kw)  # noqa: E731
        variants.append(("reduce_scatter", f"FP8 reduce_scatter e5m2, {slices} slice(s)", fn, 1, None))

    if nccl and args.sweep:
        variants += sweep_variants(grads, layout, args)
    for kind, name, fn, wire_bytes, check in variants:
        quality = ""
        if check is not None:  # accuracy (and agreement between ranks) on the same data before timing
            out = check()
            agree = "ranks agree" if same_on_every_rank(out) else "RANKS DIFFER"
            quality = f"{sqnr_db(out, ref):.1f} dB vs fp32 mean, {agree}"
            del out
        ms = timed(fn, args.iters, args.warmup, device)
        factor = (2 if kind == "all_reduce" else 1) * (world - 1) / world
        busbw = args.numel * wire_bytes * factor / (ms * 1e-3) / 1e9
        rows.append((kind, name, ms, busbw, quality))
        log(f"  {name:<48} {ms:9.3f} ms  busbw {busbw:8.1f} GB/s  {quality}")
    if fused:
        bench_passes(grads, layout, args, device, rows)


BASELINES = ("all_reduce bf16", "reduce_scatter bf16", "bf16 reduce_scatter", "bf16 compress hook")


def print_table(rows: list[tuple]) -> None:
    lines = ["", f"{'what':<14} {'variant':<52} {'time ms':>10} {'busbw GB/s':>11} {'vs bf16':>8}  accuracy"]
    def group(kind: str, name: str) -> tuple[str, str]:  # DDP rows compare within one bucket size
        return kind, name.split("buckets")[-1] if "buckets" in name else ""

    base = {group(kind, name): ms for kind, name, ms, _, _ in rows if name.startswith(BASELINES)}
    for kind, name, ms, busbw, quality in rows:
        key = group(kind, name)
        speed = f"{base[key] / ms:6.2f}x" if key in base else ""
        bw = f"{busbw:11.1f}" if busbw == busbw else f"{'':>11}"
        lines.append(f"{kind:<14} {name:<52} {ms:10.3f} {bw} {speed:>8}  {quality}")
    for line in lines:
        log(line)


def parse_args(argv=None):
    from gpu_args import at_least_0, count, float_count

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--toy", action="store_true", help="CPU + gloo, small sizes")
    p.add_argument("--numel", type=float_count, default=1e9, help="gradient elements of the reduction benchmark")
    p.add_argument("--tensors", type=count, default=64, help="tensors (scale groups) the gradient is cut into")
    p.add_argument("--iters", type=count, default=10)
    p.add_argument("--warmup", type=at_least_0, default=3)
    p.add_argument("--slices", type=count, nargs="+", default=[4, 8, 16], help="slices of the pipelined FP8 variants")
    p.add_argument("--sweep", action="store_true", help="NCCL: FP8 native/portable over grids, slices, NCCL settings")
    p.add_argument(
        "--sweep-programs", type=at_least_0, nargs="+", default=[0, 2, 4, 8], help="programs per SM (0: per tile)"
    )
    p.add_argument("--sweep-slices", type=count, nargs="+", default=[4, 8, 16])
    p.add_argument("--eager", action="store_true", help="the PyTorch reference kernels instead of Triton")
    p.add_argument("--gpt", action=argparse.BooleanOptionalAction, default=None, help="GPT steps (default: on GPU)")
    p.add_argument("--fp8-linear", action="store_true", help="GPT with FP8Linear layers (FP8 weight all-gather)")
    p.add_argument("--d", type=count, default=2048)
    p.add_argument("--layers", type=count, default=16)
    p.add_argument("--heads", type=count, default=16)
    p.add_argument("--vocab", type=count, default=32768)
    p.add_argument("--seq", type=count, default=1024)
    p.add_argument("--batch", type=count, default=4)
    p.add_argument("--gpt-iters", type=count, default=5)
    p.add_argument("--bucket-mb", type=count, nargs="+", default=[25, 100], help="DDP bucket caps to run")
    p.add_argument("--log-file", default=None, help="log file (default: bench_comm_<backend>_<N>.log)")
    args = p.parse_args(argv)
    if args.toy:
        args.numel, args.tensors, args.iters, args.warmup = min(args.numel, 1 << 20), 8, 3, 1
        args.d, args.layers, args.heads, args.vocab, args.seq, args.batch, args.gpt_iters = 64, 2, 4, 256, 32, 2, 2
        args.gpt = True if args.gpt is None else args.gpt
    args.numel = int(args.numel)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    use_cuda = torch.cuda.is_available() and not args.toy
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    if args.gpt is None:
        args.gpt = use_cuda
    log(
        f"torch {torch.__version__}, {dist.get_backend()}, world {dist.get_world_size()}, "
        f"{torch.cuda.get_device_name() if use_cuda else 'cpu'}, NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}, "
        f"argv={' '.join(sys.argv[1:])}"
    )
    rows: list[tuple] = []
    bench_reduction(args, device, rows)
    if args.gpt:
        from bench_comm_gpt import bench_gpt  # (benchmarks/ is on the path: scripts run from there)

        bench_gpt(args, device, rows, log, timed)
    print_table(rows)
    if dist.get_rank() == 0:
        path = args.log_file or f"bench_comm_{dist.get_backend()}_{dist.get_world_size()}.log"
        with open(path, "w") as f:
            f.write("\n".join(LOG) + "\n")
        print(f"log written to {path}")
    # Every rank done with its collectives before the group goes (a gloo rank tearing it down while the other still
    # wrote its log aborted once in CI: "terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
