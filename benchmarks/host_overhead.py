"""Host (Python) time of FP8Linear's forward+backward on a tiny shape, where the GPU work is negligible.

    python benchmarks/host_overhead.py [--cprofile]

Prints microseconds per forward+backward against nn.Linear's, and with --cprofile the functions that take it.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import lightning_fp8 as lf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cprofile", action="store_true")
    p.add_argument("--iters", type=int, default=300)
    args = p.parse_args()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rows = []
    for name, layer in (("nn.Linear", torch.nn.Linear(256, 256).cuda()), ("FP8Linear", lf.FP8Linear(256, 256).cuda())):

        def step(layer=layer):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = layer(x)
            y.sum().backward()

        for _ in range(20):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            step()
        host = (time.perf_counter() - t0) / args.iters * 1e6
        torch.cuda.synchronize()
        rows.append((name, host))
        if args.cprofile and name == "FP8Linear":
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.iters):
                step()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    for name, host in rows:
        print(f"{name:10s} host {host:8.1f} us per forward+backward")


if __name__ == "__main__":
    main()
