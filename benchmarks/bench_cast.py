"""Bandwidth of the fused FP8 casts (kernels/cast.py) against a device copy, on one tensor.

    python benchmarks/bench_cast.py                 # 8192 x 8192 bf16 -> E4M3 on the GPU
    python benchmarks/bench_cast.py --sweep         # also sweep the launch configs, then time the best
    python benchmarks/bench_cast.py --toy           # tiny, on CPU under the Triton interpreter (a smoke test)

Each row counts the fewest bytes its work must move (input read once, each output written once) and
divides by the median time: a copy moves 2 x 2 bytes per bf16 element, a cast 2 + 1, a cast with the
transposed copy 2 + 1 + 1, an amax 2. "% copy" is that rate over the copy's rate in the same run.
Every kernel's result is checked against the reference (bit for bit) before it is timed.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from lightning_fp8.kernels import cast, reference  # noqa: E402
from lightning_fp8.kernels import quantize as fused  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# The sweep is greedy: stage 1 picks the tile shape and transpose path, stage 2 the grid and pipelining for it,
# stage 3 the statistics and load policy. (Four row-interleaved tiles with their FP8 bytes transposed as packed int32
# words were tried on 2026-11-22 and reached 29% of copy: results/cast_linear_h100_v2.txt. Moving the transposed tile
# as the FP8 values in fp16, half the shared memory of fp32, reached 65-75% against fp32's 78%:
# results/cast_h100_s4.txt.) TMA: the tiles through tensor descriptors (see kernels/cast.py).
SWEEP_STAGE1 = {
    "transpose": [
        {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "TRANSPOSE_VIA": t, "TMA": tma}
        for bm, bn, w, t, tma in [(128, 64, 8, "fp32", False), (64, 64, 8, "fp32", False), (64, 64, 4, "fp32", False),
                                  (128, 32, 4, "fp32", False), (64, 128, 8, "fp32", False), (64, 64, 8, "bytes", False),
                                  (64, 64, 4, "fp32", True), (128, 64, 8, "fp32", True), (64, 128, 4, "fp32", True),
                                  (128, 128, 8, "fp32", True), (128, 64, 4, "fp32", False), (64, 64, 4, "bytes", False)]
    ],
    "flat": [{"BLOCK": b, "num_warps": w} for b, w in [(2048, 4), (4096, 8), (8192, 16)]],
    "amax": [{"BLOCK": b, "num_warps": w} for b, w in [(4096, 8), (8192, 8)]],
}  # fmt: skip
SWEEP_STAGE2 = {
    # The persistent grid: programs that do not fit on the SMs at once wait for a whole program's tiles to finish, so
    # the grid is swept finely around the number of programs that fit (registers, shared memory).
    "transpose": [{"PROGRAMS_PER_SM": p, "NUM_STAGES": 1} for p in (4, 6, 8, 10, 12, 14, 16, 18, 20, 24, 32, 1 << 20)]
    + [{"PROGRAMS_PER_SM": 16, "NUM_STAGES": 2}]
    # GROUP_M: the row tiles a program walks down a column block (it also fixes the order of the fused column sums:
    # kernels/reference.py COLUMN_SUM_GROUP follows the default).
    + [{"PROGRAMS_PER_SM": p, "NUM_STAGES": 1, "GROUP_M": g} for g in (1, 2, 4, 16) for p in (16, 32)],
    "flat": [{"PROGRAMS_PER_SM": p, "NUM_STAGES": 1} for p in (4, 8, 12, 16, 24, 32, 1 << 20)],
    "amax": [{"PROGRAMS_PER_SM": p, "NUM_STAGES": 1} for p in (8, 16, 1 << 20)],
}
SWEEP_STAGE3 = {
    "transpose": [
        {"STATS": t, "LOAD_POLICY": p, "MAXNREG": None} for t in ("tile", "row", "element") for p in ("", "evict_first")
    ],
    "flat": [{"STATS": t, "LOAD_POLICY": p} for t in ("element", "tile") for p in ("", "evict_first")],
    "amax": [],
}


@triton.jit
def _tiled_copy_kernel(x_ptr, out_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The cast's tile loop without the cast: what Triton reaches for this access pattern (a diagnostic row).
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tiles_n, tl.num_programs(0)):
        rm = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs = rm[:, None] * N + rn[None, :]
        tl.store(out_ptr + offs, tl.load(x_ptr + offs))


def tiled_copy(x, out):
    cfg = cast.CONFIGS["transpose"]
    grid = (torch.cuda.get_device_properties(x.device).multi_processor_count * cfg["PROGRAMS_PER_SM"],)
    _tiled_copy_kernel[grid](x, out, *x.shape, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                             num_warps=cfg["num_warps"])  # fmt: skip


def kernel_resources():
    """Registers, spills and shared memory of each compiled kernel the fast launch path has seen."""
    from lightning_fp8.kernels import launch

    seen = {}
    for compiled, _ in launch._LEARNED.values():
        md = compiled.metadata
        seen[(compiled.name, compiled.n_regs, compiled.n_spills, md.shared, md.num_warps)] = None
    for name, regs, spills, shared, warps in seen:
        print(f"  {name}: {regs} registers/thread, {spills} spilled, {shared} B shared, {warps} warps")


def median_ms(fn, device, rep=200):
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def check_cast(x, scale, fp8_dtype, transpose):
    got = cast.cast_to_fp8(x, scale, fp8_dtype, transpose)
    ref = reference.cast_to_fp8_ref(x, scale, fp8_dtype, transpose)
    for g, r in zip(got[:2], ref[:2], strict=True):
        nan = torch.isnan(r.float())
        if not torch.equal(torch.isnan(g.float()), nan) or ((g.view(torch.uint8) != r.view(torch.uint8)) & ~nan).any():
            raise RuntimeError(f"cast_to_fp8(transpose={transpose}) differs from the reference")
    if not (torch.equal(got[2], ref[2]) and torch.equal(got[3], ref[3])):
        raise RuntimeError("cast_to_fp8: amax or saturation count differs from the reference")


def sweep(name, fn, nbytes, device, copy_gbs, check):
    """Time the configs of SWEEP_STAGE1, then SWEEP_STAGE2 and 3 on the best; leave the best in cast.CONFIGS."""
    best = (float("inf"), dict(cast.CONFIGS[name]))
    for stage in (SWEEP_STAGE1[name], SWEEP_STAGE2[name], SWEEP_STAGE3[name]):
        base = dict(best[1])
        for change in stage:
            cfg = {**base, **change}
            cast.CONFIGS[name] = cfg
            try:
                check()  # every variant bit-exact before it is timed
                ms = median_ms(fn, device, rep=100)
            except Exception as err:  # a config the compiler rejects (e.g. out of shared memory) is skipped
                print(f"  sweep {name:9s} {change} failed: {type(err).__name__}: {str(err)[:120]}")
                continue
            gbs = nbytes / ms / 1e6
            print(f"  sweep {name:9s} {change}  {ms * 1e3:8.1f} us  {gbs:7.0f} GB/s  {100 * gbs / copy_gbs:5.1f} %")
            if ms < best[0]:
                best = (ms, cfg)
    cast.CONFIGS[name] = best[1]
    print(f"  best {name}: {best[1]}")


SMALL_SHAPES = [(1024, 1024), (1024, 4096), (4096, 4096), (16384, 4096), (8192, 8192)]


def small_sweep(device, fp8_dtype):
    """Current-scaled casts (a weight's, a gradient's) of several sizes against MIN_ITEMS, the least work items per
    program of the amax and flat launches: on small tensors the programs' arrivals at the bookkeeping (one atomic
    ticket each, serialized) can cost more than their work. Every variant is checked against the reference first."""
    from lightning_fp8.kernels.reference import quantize_ref

    f32, i64 = {"dtype": torch.float32, "device": device}, {"dtype": torch.int64, "device": device}
    grid = [(a, f) for a in (1, 2, 4, 8, 16) for f in (1, 2, 4, 8)]
    defaults = {name: dict(cast.CONFIGS[name]) for name in ("amax", "flat")}
    speculate = fused.SPECULATIVE_CURRENT_SCALING
    print("\ncurrent-scaled quantize_ (amax launch + flat cast, record), us; columns: MIN_ITEMS (amax, flat)")
    print(f"{'shape':>12s} " + " ".join(f"{f'{a},{b}':>7s}" for a, b in grid) + f" {'spec':>7s}")
    for shape in SMALL_SHAPES:
        x = (torch.randn(shape, device=device) * 3).to(torch.bfloat16)
        times = []
        for a, f in grid + [(1, 1)]:
            cast.CONFIGS["amax"] = {**defaults["amax"], "MIN_ITEMS": a}
            cast.CONFIGS["flat"] = {**defaults["flat"], "MIN_ITEMS": f}
            fused.SPECULATIVE_CURRENT_SCALING = len(times) == len(grid)  # the last column: speculative, MIN_ITEMS 1

            def run(buffers, x=x):
                return fused.quantize_(x, *buffers, fp8_dtype, 0, True, False, True, False, None)

            state = [torch.zeros(1, **f32), torch.ones((), **f32), torch.zeros((), **f32), torch.zeros((), **f32),
                     torch.zeros((), **i64), torch.zeros((), **i64)]  # fmt: skip
            ref_state = [t.clone() for t in state]
            got, ref = run(state), quantize_ref(x, *ref_state, fp8_dtype, 0, True, False, True, False, None)
            if not (torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(got[2], ref[2])):
                raise RuntimeError(f"quantize_ with MIN_ITEMS {a},{f} differs from the reference at {shape}")
            times.append(median_ms(lambda state=state: run(state), device, rep=50) * 1e3)
        print(f"{f'{shape[0]}x{shape[1]}':>12s} " + " ".join(f"{t:7.1f}" for t in times))
    cast.CONFIGS.update(defaults)
    fused.SPECULATIVE_CURRENT_SCALING = speculate


def sum_group_sweep(x, fp8_dtype, device, groups):
    """The grad cast with and without the bias gradient fused in (quantize_(column_sum=True)) against GROUP_M, the row
    tiles each program walks down a column block (adding them up in registers before one reduction, with the sums),
    and the persistent grid, beside a separate x.sum(0): what FP8Linear's FUSED_BIAS_GRAD trades. Each variant is
    checked first: the FP8 bytes equal the default cast's, and the sums are within fp32 rounding of the exact (fp64)
    column sums."""
    f32, i64 = {"dtype": torch.float32, "device": device}, {"dtype": torch.int64, "device": device}
    exact = x.double().sum(0)
    bound = x.shape[0] * 2.0**-24 * x.double().abs().sum(0)

    # One delayed scaling state for every call (a fresh one per call would time its allocations and the host-to-device
    # copy of its scale): the same x each time, so the scale settles after the first cast.
    state = [torch.zeros(16, **f32), torch.tensor(2.0**-3, **f32), torch.zeros((), **f32), torch.zeros((), **f32),
             torch.zeros((), **i64), torch.zeros((), **i64)]  # fmt: skip

    def run(column_sum):
        return fused.quantize_(x, *state, fp8_dtype, 0, True, True, False, True, None, column_sum)

    print(f"\nfused bias gradient, {x.shape[0]} x {x.shape[1]} -> {fp8_dtype}: delayed quantize_ (cast+T, record), us")
    base = dict(cast.CONFIGS["transpose"])
    run(False)
    reference_bytes = run(False)
    t_sum = median_ms(lambda: x.sum(0, dtype=torch.float32), device) * 1e3
    print(f"  x.sum(0, dtype=float32) alone: {t_sum:.1f}")
    print(f"  {'GROUP_M':>7s} {'prog/SM':>7s} {'cast':>8s} {'+ x.sum':>8s} {'fused':>8s} {'saved':>7s}")
    for g in groups:
        for ppsm in (base["PROGRAMS_PER_SM"], 8):
            cast.CONFIGS["transpose"] = {**base, "GROUP_M": g, "PROGRAMS_PER_SM": ppsm}
            got = run(True)
            for out in (got, run(False)):
                if not all(
                    torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    for a, b in zip(out[:2], reference_bytes[:2], strict=True)
                ):
                    raise RuntimeError(f"GROUP_M {g}: the FP8 bytes differ from the default config's")
            if not ((got[3].double() - exact).abs() <= bound).all():
                raise RuntimeError(f"GROUP_M {g}: column sums off the exact ones by more than fp32 rounding")
            t_plain = median_ms(lambda: run(False), device) * 1e3
            t_fused = median_ms(lambda: run(True), device) * 1e3
            saved = t_plain + t_sum - t_fused
            print(f"  {g:7d} {ppsm:7d} {t_plain:8.1f} {t_plain + t_sum:8.1f} {t_fused:8.1f} {saved:7.1f}")
    cast.CONFIGS["transpose"] = base
    if device.type == "cuda":
        kernel_resources()


def main():
    from gpu_args import count

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=count, nargs=2, default=(8192, 8192))
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--fp8", choices=FP8, default="e4m3")
    p.add_argument("--sweep", action="store_true", help="sweep launch configs, then time the best")
    p.add_argument("--save-configs", help="with --sweep: write the best launch configs to this JSON file")
    p.add_argument("--small", action="store_true", help="sweep MIN_ITEMS on current-scaled casts of small tensors")
    p.add_argument("--sum-groups", type=count, nargs="+", help="time the fused bias gradient at these GROUP_Ms")
    p.add_argument("--toy", action="store_true", help="tiny shape (CPU smoke test)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = (48, 80) if args.toy else tuple(args.shape)
    dtype, fp8_dtype = DTYPES[args.dtype], FP8[args.fp8]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"# bench_cast  {datetime.datetime.now():%Y-%m-%d %H:%M}  {name}  torch {torch.__version__}")
    print(f"# x: {shape[0]} x {shape[1]} {args.dtype} -> {args.fp8}")

    torch.manual_seed(0)
    x = (torch.randn(shape, device=device) * torch.rand(shape, device=device).mul(8).exp2()).to(dtype)
    scale = torch.tensor(2.0**-3, device=device)
    check_cast(x, scale, fp8_dtype, False)
    check_cast(x, scale, fp8_dtype, True)
    if not torch.equal(cast.amax(x), reference.amax_ref(x)):
        sys.exit("amax differs from the reference")

    n, e = x.numel(), x.element_size()
    out = torch.empty_like(x)
    # A delayed scaling state's buffers (history, scale, amax, saturation, non-finite count, casts) for quantize_.
    f32, i64 = {"dtype": torch.float32, "device": device}, {"dtype": torch.int64, "device": device}
    state = [torch.zeros(16, **f32), scale.clone(), torch.zeros((), **f32), torch.zeros((), **f32),
             torch.zeros((), **i64), torch.zeros((), **i64)]  # fmt: skip

    def quantize(column_sum, current=False, speculate=False):
        fused.SPECULATIVE_CURRENT_SCALING = speculate
        return fused.quantize_(x, *state, fp8_dtype, 0, True, not current, current, True, None, column_sum)

    rows = [
        ("device copy (baseline)", lambda: out.copy_(x), 2 * n * e),
        ("eager (x * scale).to(fp8)", lambda: (x * scale).to(fp8_dtype), n * (e + 1)),
        ("reference cast + transpose", lambda: reference.cast_to_fp8_ref(x, scale, fp8_dtype, True), n * (e + 2)),
        ("triton cast", lambda: cast.cast_to_fp8(x, scale, fp8_dtype, False), n * (e + 1)),
        ("triton cast + transpose", lambda: cast.cast_to_fp8(x, scale, fp8_dtype, True), n * (e + 2)),
        ("triton quantize_ (cast+T, record)", lambda: quantize(False), n * (e + 2)),
        ("triton quantize_ (cast+T, record, col sum)", lambda: quantize(True), n * (e + 2)),
        # Current scaling: the amax launch, then the cast; or one speculative pass (its scale holds from call to call
        # here) and the idle redo launch. Bytes: what the cast itself must move.
        ("triton quantize_ current (amax, cast+T)", lambda: quantize(False, True, False), n * (e + 2)),
        ("triton quantize_ current, speculative", lambda: quantize(False, True, True), n * (e + 2)),
        ("eager x.abs().amax()", lambda: x.abs().amax(), n * e),
        ("triton amax", lambda: cast.amax(x), n * e),
    ]
    results = [(label, median_ms(fn, device), nbytes) for label, fn, nbytes in rows]
    copy_gbs = results[0][2] / results[0][1] / 1e6
    if args.sweep:
        print(f"defaults: {cast.CONFIGS}")

        def check_amax():
            if not torch.equal(cast.amax(x), reference.amax_ref(x)):
                raise RuntimeError("amax differs from the reference")

        sweep("transpose", lambda: cast.cast_to_fp8(x, scale, fp8_dtype, True), n * (e + 2), device, copy_gbs,
              lambda: check_cast(x, scale, fp8_dtype, True))  # fmt: skip
        sweep("flat", lambda: cast.cast_to_fp8(x, scale, fp8_dtype, False), n * (e + 1), device, copy_gbs,
              lambda: check_cast(x, scale, fp8_dtype, False))  # fmt: skip
        sweep("amax", lambda: cast.amax(x), n * e, device, copy_gbs, check_amax)
        # The best configs, checked again, then the table's Triton rows again with them.
        check_cast(x, scale, fp8_dtype, False)
        check_cast(x, scale, fp8_dtype, True)
        if not torch.equal(cast.amax(x), reference.amax_ref(x)):
            sys.exit("amax differs from the reference")
        tuned = [
            (f"{label}, swept config", median_ms(fn, device), nbytes) for label, fn, nbytes in rows if "triton" in label
        ]
        results += tuned
        if args.save_configs:
            with open(args.save_configs, "w") as f:
                json.dump(cast.CONFIGS, f, indent=1)
    if args.small and device.type == "cuda":
        small_sweep(device, fp8_dtype)
    if args.sum_groups:
        sum_group_sweep(x, fp8_dtype, device, args.sum_groups)
    if device.type == "cuda":
        cast.EXACT_ROUND_ON_GPU = True  # what the interpreter's pre-rounding would cost on the GPU
        check_cast(x, scale, fp8_dtype, True)
        fn = lambda: cast.cast_to_fp8(x, scale, fp8_dtype, True)  # noqa: E731
        results.append(("triton cast + transpose, pre-rounded", median_ms(fn, device), n * (e + 2)))
        cast.EXACT_ROUND_ON_GPU = False
        results.append(("device copy (baseline, again)", median_ms(rows[0][1], device), rows[0][2]))
        results.append(("triton tiled copy (the cast's tiles, no cast)", median_ms(lambda: tiled_copy(x, out), device),
                        2 * n * e))  # fmt: skip
        print("compiled kernels:")
        kernel_resources()

    print(f"\n{'kernel':44s} {'time (us)':>10s} {'GB/s':>8s} {'% copy':>7s}")
    for label, ms, nbytes in results:
        gbs = nbytes / ms / 1e6
        print(f"{label:44s} {ms * 1e3:10.1f} {gbs:8.0f} {100 * gbs / copy_gbs:7.1f}")


if __name__ == "__main__":
    main()
