"""The elementwise passes of FP8 gradient communication alone on one GPU, for launch configs of kernels/comm.py.

Run on one GPU (no process group)::

    python benchmarks/bench_comm_passes.py                  # every pass: the configs before, the defaults, a sweep
    python benchmarks/bench_comm_passes.py --sweep none     # the configs before and the defaults only

Each pass runs over ``--numel`` bf16 gradient elements cut into ``--tensors`` uneven tensors (the layout of
bench_comm.py's reduction), with the block tables of a one-slice native all-reduce (the portable path's rows for the
``rows_*`` passes, 2 ranks). Every config is checked first: bit for bit against the PyTorch references on a 16M-element
buffer with NaN, inf and unaligned segments, and on the full buffer against the first config of its pass. Times are
medians of CUDA-event timings; GB/s counts each byte read or written once; "% copy" compares with a bf16 device copy
(read + write) of the same buffer.
"""

import argparse
import json

import torch
from lightning_fp8.kernels import comm

from lightning_fp8.distributed.layout import SegmentLayout, all_reduce_plan
from lightning_fp8.distributed.quantize import segment_kernels

E5M2 = torch.float8_e5m2
REF, TRITON = segment_kernels(False), segment_kernels(True)
# The kernels' configuration before (commit 924e108): one program per 8192-element tile, 32 or 16 elements per thread.
BEFORE = {"SUB": 8192, "num_warps": 8, "PROGRAMS_PER_SM": 0, "HINT": 16, "POLICY": ""}


def _cfg(sub: int, warps: int, per_sm: int, hint=8, block=8192, policy="") -> dict:
    return {"SUB": sub, "num_warps": warps, "PROGRAMS_PER_SM": per_sm, "HINT": hint, "BLOCK": block, "POLICY": policy}


def sweep(name: str) -> list[dict]:
    """Configs tried beside BEFORE and the defaults (the survivors of the wider first sweep, run 1 in
    benchmarks/results/comm_passes_h100.txt): block sizes, one program per row against persistent grids."""
    if name == "amax":
        return [_cfg(2048, 8, 0, hint=16), _cfg(8192, 8, 0, hint=16), _cfg(2048, 8, 8, hint=16)]
    if name == "quantize":
        return [_cfg(4096, 8, 0), _cfg(2048, 8, 8), _cfg(2048, 8, 16), _cfg(1024, 4, 0)]
    if name == "dequantize":
        return [_cfg(4096, 8, 0), _cfg(8192, 8, 0), _cfg(2048, 8, 16), _cfg(4096, 8, 8), _cfg(8192, 8, 0, hint=16)]
    return [_cfg(4096, 8, 0), _cfg(2048, 8, 16)]


def tensor_sizes(numel: int, count: int) -> list[int]:
    """``count`` uneven tensor sizes summing to ``numel`` (bench_comm.py's: a few large, many small)."""
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(count, generator=g) ** 3 + 0.01
    sizes = (weights / weights.sum() * numel).long()
    sizes[0] += numel - sizes.sum()
    return sizes.tolist()


def timed(fn, iters: int, warmup: int) -> float:
    """Median milliseconds of ``fn()`` (CUDA events; a host clock on CPU, the smoke test under the interpreter)."""
    from bench_tp import median_ms  # (benchmarks/ is on the path: scripts run from there)

    return median_ms(fn, torch.device("cuda" if torch.cuda.is_available() else "cpu"), iters, warmup)


class Buffers:
    """The inputs and outputs of every pass for one layout (gradients of many magnitudes, like bench_comm.py)."""

    def __init__(self, numel: int, tensors: int, device, special: bool) -> None:
        sizes = tensor_sizes(numel, tensors)
        self.layout = SegmentLayout.per_tensor(sizes)
        g = torch.Generator(device=device).manual_seed(7)
        self.x = torch.randn(numel, generator=g, device=device, dtype=torch.bfloat16)
        mags = torch.logspace(-6, 2, len(sizes), device=device)
        self.x.mul_(torch.repeat_interleave(mags, torch.tensor(sizes, device=device)).bfloat16())
        if special:  # a NaN and an inf (their tensors' scales become 1)
            self.x[numel // 3], self.x[numel // 2] = float("nan"), float("-inf")
        self.amax = torch.zeros(tensors, device=device)
        self.q = torch.randint(0, 0x7B, (numel,), generator=g, device=device, dtype=torch.uint8)  # finite E5M2
        self.q[::4097] |= 0x80  # negative values too
        self.out = torch.empty_like(self.x)
        row = -(-numel // 32) * 16  # the portable plan's row on 2 ranks: half the buffer, rounded up to ALIGN
        self.received = torch.randint(0, 0x7B, (2, row), generator=g, device=device, dtype=torch.uint8)
        self.device, self.plans = device, {}

    def plan(self, block: int):
        if block not in self.plans:
            (native,) = all_reduce_plan(self.layout, 1, 0, 1, True, self.device, block)
            (portable,) = all_reduce_plan(self.layout, 2, 0, 1, False, self.device, block)
            self.plans[block] = (native, portable)
        return self.plans[block]


def passes(b: Buffers, block: int) -> dict:
    """Per pass: (kernel config key, bytes moved per buffer element, run(kernels) -> outputs to compare)."""
    native, portable = b.plan(block)
    rows, kernels = b.received, REF if b.x.numel() <= 1 << 24 else TRITON  # (the references need 32 B per element)
    assert rows.shape[1] == portable.row
    amax, piece = torch.zeros_like(b.amax), torch.zeros(64, device=b.device)
    kernels.segment_amax(b.x, native.cast, amax)
    kernels.rows_amax(rows, portable.sum, amax, piece, E5M2, inv_divisor=0.5)

    def run_amax(k):
        a = torch.zeros_like(amax)
        k.segment_amax(b.x, native.cast, a)
        return (a,)

    def run_quantize(k):
        n_sat = torch.zeros((), dtype=torch.int64, device=b.device)
        k.quantize(b.x, native.cast, amax / 3, E5M2, b.q, n_sat)  # a third of the amax: some values saturate
        return b.q, n_sat

    def run_dequantize(k, check=True):
        counts = torch.zeros(2, dtype=torch.int64, device=b.device) if check else None
        k.dequantize(b.q, native.decode, amax, E5M2, b.out, headroom=torch.tensor(1, device=b.device),
                     inv_divisor=0.5, counts=counts)  # fmt: skip
        return b.out, counts

    def run_rows(mode):
        def run(k):
            out = torch.zeros(64, device=b.device)
            if mode == 0:
                k.rows_amax(rows, portable.sum, amax, out, E5M2, inv_divisor=0.5)
                return (out,)
            n_sat = torch.zeros((), dtype=torch.int64, device=b.device)
            if mode == 1:
                k.rows_quantize(rows, portable.sum, amax, piece, E5M2, b.q, n_sat, inv_divisor=0.5)
                return b.q[: portable.row], n_sat
            k.rows_sum(rows, portable.sum, amax, E5M2, b.out, inv_divisor=0.5)
            return (b.out[: portable.row],)

        return run

    return {
        "amax": ("amax", 2, run_amax),
        "quantize": ("quantize", 3, run_quantize),
        "dequantize": ("dequantize", 3, run_dequantize),
        "dequantize unchecked": ("dequantize", 3, lambda k: run_dequantize(k, check=False)),
        "rows_amax": ("rows", 1, run_rows(0)),  # per buffer element: 2 rows of half the buffer
        "rows_quantize": ("rows", 1.5, run_rows(1)),
        "rows_sum": ("rows", 2, run_rows(2)),
    }


def _same(a: tuple, b: tuple) -> bool:
    """Equal bit patterns (any NaN equals any NaN: payloads differ between conversions)."""
    for x, y in zip(a, b, strict=True):
        if x is None:
            continue
        if x.is_floating_point():
            nan, view = x.isnan(), {2: torch.int16, 4: torch.int32}[x.element_size()]
            if not torch.equal(nan, y.isnan()) or not torch.equal(x.view(view)[~nan], y.view(view)[~nan]):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def _snapshot(out: tuple) -> tuple:
    return tuple(None if t is None else t.clone() for t in out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=float, default=1e9)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sweep", choices=["all", "none"], default="all")
    p.add_argument("--passes", nargs="+", default=None, help="passes to run (default: all)")
    args = p.parse_args()
    # usage errors, not an IndexError from an empty buffer or a KeyError from an unknown pass
    if args.tensors < 1 or not args.numel >= args.tensors:
        p.error(f"--numel {args.numel:g} --tensors {args.tensors}: need 1 <= --tensors <= --numel")
    if args.iters < 1 or args.warmup < 0:
        p.error(f"--iters {args.iters} --warmup {args.warmup}: need --iters >= 1 and --warmup >= 0")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: TRITON_INTERPRET=1, tiny sizes
    big = Buffers(int(args.numel), args.tensors, device, special=False)
    small = Buffers(min(1 << 24, int(args.numel)), 16, device, special=True)
    unknown = [name for name in args.passes or [] if name not in passes(small, 8192)]
    if unknown:
        p.error(f"--passes: unknown {unknown}; choose from {', '.join(passes(small, 8192))}")
    copy_ms = timed(lambda: big.out.copy_(big.x), args.iters, args.warmup)
    copy_gbps = 4 * big.x.numel() / copy_ms / 1e6
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{gpu}, torch {torch.__version__}; {big.x.numel():,} bf16 elements in "
          f"{args.tensors} tensors; bf16 copy {copy_ms:.3f} ms = {copy_gbps:.0f} GB/s", flush=True)  # fmt: skip
    defaults = {k: dict(v) for k, v in comm.CONFIGS.items()}
    rows = []
    for name in args.passes or passes(small, 8192):
        key = passes(small, 8192)[name][0]
        configs = [("before", BEFORE), ("default", defaults[key])]
        if args.sweep == "all":
            configs += [("sweep", c) for c in sweep(key)][: 2 if name.endswith("unchecked") else None]
        base = None
        for label, cfg in configs:
            block = cfg.get("BLOCK", 8192)
            comm.CONFIGS[key] = {k: v for k, v in cfg.items() if k != "BLOCK"}
            try:
                _, _, run = passes(small, block)[name]
                exact = _same(_snapshot(run(REF)), run(TRITON))
                _, nbytes, run = passes(big, block)[name]
                got = _snapshot(run(TRITON))
                base = got if base is None else base
                same = _same(base, got)
                ms = timed(lambda run=run: run(TRITON), args.iters, args.warmup)
            except Exception as e:  # report and go on
                print(f"  {name} {label} {cfg}: FAILED {type(e).__name__}: {e}", flush=True)
                continue
            gbps = nbytes * big.x.numel() / ms / 1e6
            rows.append((name, label, json.dumps(cfg), ms, gbps, 100 * gbps / copy_gbps, exact, same))
            print(f"  {name:<20} {label:<8} {ms:8.3f} ms {gbps:7.0f} GB/s {rows[-1][5]:5.1f}% copy  ref-exact "
                  f"{exact}  same {same}  {cfg}", flush=True)  # fmt: skip
        comm.CONFIGS[key] = defaults[key]
    print(f"\n{'pass':<20} {'config':<8} {'ms':>8} {'GB/s':>7} {'%copy':>6} exact same  settings")
    for name, label, cfg, ms, gbps, pct, exact, same in rows:
        print(f"{name:<20} {label:<8} {ms:8.3f} {gbps:7.0f} {pct:6.1f} {exact!s:>5} {same!s:>4}  {cfg}")


if __name__ == "__main__":
    main()
