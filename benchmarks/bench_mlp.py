"""A transformer MLP (fc -> GELU -> proj) forward + backward: FP8MLP (the GELU fused into the FP8 casts) against the
same FP8Linear layers with torch's GELU between them, and against nn.Linear, under bf16 autocast.

    python benchmarks/bench_mlp.py                       # 16384 tokens, widths 1024, 2048, 4096 (hidden 4x), eager
    python benchmarks/bench_mlp.py --compile             # also each under torch.compile
    python benchmarks/bench_mlp.py --toy                 # tiny, on CPU (a smoke test)

Setup: bf16 input (tokens, width) with requires_grad, fp32 parameters, biases, a fixed bf16 output gradient, recipe
"fp8-lm". One step = forward + backward; median over many steps (triton.testing.do_bench), and the peak memory of one
step above what was allocated before it. Before timing, each FP8 variant's output is checked against nn.Linear's
(SQNR). Prints a table (ms, x of bf16, x of the unfused FP8 layers) and writes JSON lines with --out.
"""

import argparse
import copy
import datetime
import json
import sys

import torch
import torch.nn.functional as F
from bench_linear import MIN_SQNR_DB, median_ms, sqnr_db
from torch import nn

from lightning_fp8 import FP8MLP

WIDTHS = (1024, 2048, 4096)
VARIANTS = ("bf16", "fp8", "fp8mlp")


class _Plain(nn.Module):
    def __init__(self, fc: nn.Module, proj: nn.Module) -> None:
        super().__init__()
        self.fc, self.proj = fc, proj

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


def build(variant: str, width: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    fc, proj = nn.Linear(width, 4 * width, device=device), nn.Linear(4 * width, width, device=device)
    if variant == "bf16":
        return _Plain(fc, proj)
    fused = FP8MLP.from_modules(fc, proj)
    return fused if variant == "fp8mlp" else _Plain(fused.fc, fused.proj)


def peak_mib(step, device) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main() -> None:
    from gpu_args import count

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=count, default=16384)
    p.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    p.add_argument("--compile", action="store_true", help="also time each variant under torch.compile")
    p.add_argument("--toy", action="store_true", help="tiny shapes on CPU")
    p.add_argument("--out", help="append JSON lines here")
    args = p.parse_args()
    device = torch.device("cpu" if args.toy or not torch.cuda.is_available() else "cuda")
    tokens, widths = (64, (32, 64)) if args.toy else (args.tokens, tuple(int(w) for w in args.widths.split(",")))
    rows = []
    for width in widths:
        x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
        ref_y = None
        for compiled in (False, True) if args.compile else (False,):
            base = {}
            for variant in VARIANTS:
                module = build(variant, width, device)
                fn = torch.compile(copy.deepcopy(module)) if compiled else module

                def step(fn=fn, x=x, dy=dy):
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        y = fn(x)
                    y.backward(dy)
                    return y

                y = step()
                if variant == "bf16" and not compiled:
                    ref_y = y.detach().float()
                quality = sqnr_db(y.detach().float(), ref_y)
                if variant != "bf16" and quality < MIN_SQNR_DB:
                    sys.exit(f"{variant} width {width}: output SQNR {quality:.1f} dB against nn.Linear's")
                ms = median_ms(step, device, grads=[x, *fn.parameters()])
                base[variant] = ms
                row = {"width": width, "tokens": tokens, "variant": variant, "compiled": compiled, "ms": ms,
                       "peak_mib": peak_mib(step, device), "sqnr_db": quality, "device": str(device),
                       "name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}  # fmt: skip
                rows.append(row)
            for r in rows[-len(VARIANTS) :]:
                r["x_bf16"] = base["bf16"] / r["ms"]
                r["x_fp8"] = base["fp8"] / r["ms"]
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    head = ("width", "variant", "compile", "ms", "x bf16", "x fp8", "peak MiB", "SQNR")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (6, 7, 7, 8, 7, 6, 9, 6), strict=True)))
    for r in rows:
        print(f"{r['width']:>6} {r['variant']:>7} {r['compiled']!s:>7} {r['ms']:>8.3f} {r['x_bf16']:>7.3f} "
              f"{r['x_fp8']:>6.3f} {r['peak_mib']:>9.1f} {r['sqnr_db']:>6.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
