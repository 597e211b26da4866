"""Every kernel of a compiled GPT training step, in launch order: where the step's GPU time goes, kernel by kernel.

    python benchmarks/kernel_trace.py --variant o2m --size 2048x16 --out /tmp/out     # on a GPU

Profiles ``--steps`` steps of ``train_step.py``'s model (after a warm-up that compiles it), writes each kernel as a
line ``start_us, duration_us, name, grid, block, stream`` to ``OUT/kernels_VARIANT_SIZE.tsv.gz``, and prints: the
step's wall time, GPU busy time and span (first kernel's start to last kernel's end), the time by kind
(``profile_step.kernel_kind``), the casts' and other small kernels by (name, grid) with their count per step (a
persistent cast's grid tells its tensor's size class apart; the kernel names do not), and the idle gaps between
kernels. profile_step.py gives the operator tables; this gives what each launch cost and where it sits.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_step import gpt_case, kernel_kind  # noqa: E402

# Kinds whose kernels are listed by (name, grid): the casts and what is not a GEMM, attention or inductor's code.
_LISTED = ("fp8 cast", "grad cast", "optimizer", "other", "copy/fill")


def kernel_rows(trace_events: list[dict]) -> list[tuple]:
    """``(start_us, duration_us, name, grid, block, stream)`` of the kernels of a chrome trace, in start order."""
    kernels = [e for e in trace_events if e.get("cat") == "kernel"]
    kernels.sort(key=lambda e: e["ts"])
    return [(e["ts"], e["dur"], e["name"], tuple(e["args"].get("grid", ())), tuple(e["args"].get("block", ())),
             e["args"].get("stream")) for e in kernels]  # fmt: skip


def summary(rows: list[tuple], steps: int, gap_us: float = 20.0) -> str:
    """The printed report of ``rows`` (:func:`kernel_rows`) over ``steps`` steps."""
    busy = sum(r[1] for r in rows) / 1e3 / steps
    span = (rows[-1][0] + rows[-1][1] - rows[0][0]) / 1e3 / steps
    lines = [f"{len(rows) / steps:.0f} kernels/step, GPU busy {busy:.2f} ms/step, span {span:.2f} ms/step"]
    kinds: dict[str, float] = defaultdict(float)
    groups: dict[tuple, list] = defaultdict(lambda: [0, 0.0])
    for _, dur, name, grid, _block, _stream in rows:
        kind = kernel_kind(name)
        kinds[kind] += dur / 1e3 / steps
        if kind in _LISTED:
            group = groups[(name[:50], grid)]
            group[0] += 1
            group[1] += dur
    ranked = sorted(kinds.items(), key=lambda kv: -kv[1])
    lines.append("by kind (ms/step): " + ", ".join(f"{k} {v:.2f}" for k, v in ranked))
    lines.append(f"{'kernel':50s} {'grid':16s} {'per step':>8s} {'ms/step':>8s} {'mean us':>8s}")
    for (name, grid), (n, total) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:30]:
        lines.append(f"{name:50s} {str(grid):16s} {n / steps:8.1f} {total / 1e3 / steps:8.2f} {total / n:8.1f}")
    gaps = [(b[0] - a[0] - a[1], a[2][:40], b[2][:40]) for a, b in zip(rows, rows[1:], strict=False)]
    gaps = [g for g in gaps if g[0] > gap_us]
    idle = sum(g[0] for g in gaps) / 1e3 / steps
    lines.append(f"idle gaps over {gap_us:.0f} us: {len(gaps) / steps:.0f}/step, {idle:.2f} ms/step; largest:")
    lines += [f"  {g:8.0f} us after {a} before {b}" for g, a, b in sorted(gaps, reverse=True)[:8]]
    return "\n".join(lines)


def main() -> None:
    from gpu_args import count, require_cuda

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="o2m", help="a train_step.py variant")
    p.add_argument("--size", default="2048x16", help="WIDTHxDEPTH")
    p.add_argument("--steps", type=count, default=3)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of the kernel list")
    args = p.parse_args()
    from train_step import check_variants_and_sizes

    check_variants_and_sizes(p, args.variant, args.size, flags=("--variant", "--size"))
    require_cuda(p)  # was an AssertionError from torch.cuda.synchronize
    width, depth = map(int, args.size.split("x"))
    t0 = time.time()
    step = gpt_case(args.variant, width, depth, 2048, 8, compile=True)
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    print(f"warm-up (compilation included) {time.time() - t0:.0f} s")
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    print(f"{args.variant} {args.size}, compiled: wall {(time.perf_counter() - t0) / args.steps * 1e3:.1f} ms/step")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        with open(f"{tmp}/trace.json") as f:
            rows = kernel_rows(json.load(f)["traceEvents"])
    with gzip.open(Path(args.out) / f"kernels_{args.variant}_{args.size}.tsv.gz", "wt") as f:
        f.writelines("\t".join(map(str, r)) + "\n" for r in rows)
    print(summary(rows, args.steps))


if __name__ == "__main__":
    main()
