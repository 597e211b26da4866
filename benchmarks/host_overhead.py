"""Host (Python) time of FP8Linear's forward+backward on a tiny shape, where the GPU work is negligible.

    python benchmarks/host_overhead.py [--cprofile]

Prints microseconds per forward+backward against nn.Linear's, for FP8Linear with the fast launch path of the cast
kernels (kernels/launch.py) off, on, and on with the casts' replays (kernels/quantize.py, the default), and with
--cprofile the functions that take the time (the default path).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from lightning_fp8.kernels import launch, quantize

import lightning_fp8 as lf


def main() -> None:
    from gpu_args import count

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cprofile", action="store_true")
    p.add_argument("--iters", type=count, default=300)
    args = p.parse_args()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rows = []
    variants = (
        ("nn.Linear", torch.nn.Linear(256, 256).cuda(), True),
        ("FP8Linear (fast launch off)", lf.FP8Linear(256, 256).cuda(), False),
        ("FP8Linear (no replays)", lf.FP8Linear(256, 256).cuda(), "no replays"),
        ("FP8Linear", lf.FP8Linear(256, 256).cuda(), True),
    )
    for name, layer, fast in variants:
        launch.ENABLED = fast is not False
        quantize.REPLAY = fast is True
        launch.clear()

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
        rows.append((name, host, dict(launch.COUNTS)))
        if args.cprofile and name == "FP8Linear":
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.iters):
                step()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    for name, host, counts in rows:
        print(f"{name:28s} host {host:8.1f} us per forward+backward  (cast launches: {counts})")


if __name__ == "__main__":
    main()
