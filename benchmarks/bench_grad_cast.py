"""FP8AdamW's gradient casts: one per gradient (the hook path, ``grad_cast_bucket_mb=0``) against one batched flush.

The 48 weight gradients of a d=1024, 12-layer GPT (fp16: 3072x1024, 1024x1024, 4096x1024, 1024x4096 per layer), with a
gradient scaler, cast to E5M2 by ``FP8AdamW.accumulate_fp8_grad`` one by one, and queued then flushed together
(lightning_fp8/optim/grad_cast.py: two launches). Checks both give the same bits (FP8 data, scale_inv, amax, scaling
states, scaler counts; also accumulating onto pending gradients), then times host time (``time.perf_counter`` around
the Python calls; synchronized after) and GPU time (CUDA events), medians.

    python benchmarks/bench_grad_cast.py            # GPU
    python benchmarks/bench_grad_cast.py --toy      # CPU, tiny sizes, Triton under the interpreter: the script runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

TOY = "--toy" in sys.argv
if TOY or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    os.environ.setdefault("LIGHTNING_FP8_KERNELS", "triton")  # the Triton paths on CPU tensors
from lightning_fp8 import FP8AdamW, FP8GradScaler  # noqa: E402

SHAPES = [(3072, 1024), (1024, 1024), (4096, 1024), (1024, 4096)]


def make_optimizer(params: list[torch.Tensor], bucket_mb: float) -> FP8AdamW:
    # The params stand for FP8 weights (fp8_params): only their shapes and identities matter to the casts.
    return FP8AdamW(params, fp8_params=params, grad_scaler=FP8GradScaler(), grad_cast_bucket_mb=bucket_mb)


def per_tensor(opt: FP8AdamW, params, grads) -> None:
    for p, g in zip(params, grads, strict=True):
        opt.accumulate_fp8_grad(p, g)


def batched(opt: FP8AdamW, params, grads) -> None:
    queue = opt._grad_casts
    for p, g in zip(params, grads, strict=True):
        queue.put(opt, p, g)
    queue.flush(opt)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def check_same(a: FP8AdamW, b: FP8AdamW, params) -> None:
    for p in params:
        ea, eb = a._pending[p], b._pending[p]
        pairs = [(ea.data, eb.data), (ea.scale_inv, eb.scale_inv), (ea.amax, eb.amax)]
        pairs += list(zip(a._grad_cast_state(p), b._grad_cast_state(p), strict=True))
        for x, y in pairs:
            assert torch.equal(bits(x), bits(y)), f"batched and per-tensor casts differ for a {tuple(p.shape)} grad"
    for name in ("_found", "_n_saturated", "_no_headroom", "_numel"):
        x, y = getattr(a.grad_scaler, name), getattr(b.grad_scaler, name)
        assert torch.equal(torch.as_tensor(x).cpu(), torch.as_tensor(y).cpu()), f"scaler {name} differs"


def timed(fn, opt: FP8AdamW, iters: int, warmup: int, device: torch.device) -> tuple[float, float]:
    """Median (host us, GPU us) of ``fn()``; each call starts with no pending gradient (a step's first backward)."""
    host, gpu = [], []
    for i in range(iters + warmup):
        opt._pending.clear()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if device.type == "cuda":
            end.record()
            torch.cuda.synchronize()
        if i >= warmup:  # compilation, allocation
            host.append((t1 - t0) * 1e6)
            gpu.append(start.elapsed_time(end) * 1e3 if device.type == "cuda" else float("nan"))
    return statistics.median(host), statistics.median(gpu)


# The defaults of the flags --toy changes (argparse's defaults are None: a flag given wins over either set).
DEFAULTS, TOY_DEFAULTS = {"layers": 12, "iters": 20}, {"layers": 1, "iters": 1}


def main() -> None:
    from gpu_args import count, fill_defaults

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--toy", action="store_true", help="CPU, tiny sizes (interpreter); flags given win")
    for key in DEFAULTS:
        parser.add_argument(f"--{key}", type=count, help=f"default: {DEFAULTS[key]} (--toy: {TOY_DEFAULTS[key]})")
    args = fill_defaults(parser.parse_args(), DEFAULTS, TOY_DEFAULTS)
    device = torch.device("cpu" if args.toy else "cuda")
    shapes = [(m // 64, n // 64 + 3) for m, n in SHAPES] if args.toy else SHAPES  # toy: odd sizes
    layers, iters, warmup = args.layers, args.iters, 1 if args.toy else 3
    torch.manual_seed(0)
    params = [torch.empty(s, dtype=torch.float16, device=device) for _ in range(layers) for s in shapes]
    grads = [(torch.randn(p.shape, device=device) * 2.0 ** (i % 7 - 10)).half() for i, p in enumerate(params)]
    grads[1].view(-1)[0] = 60000.0  # at the E5M2 maximum: the scaler counts it
    one, many = make_optimizer(params, 0), make_optimizer(params, 1e9)
    for _ in range(2):  # the second round accumulates onto the pending FP8 gradients
        per_tensor(one, params, grads)
        batched(many, params, grads)
        check_same(one, many, params)
    print(f"exact: batched and per-tensor casts give the same bits ({len(params)} gradients, also accumulating)")
    n_bytes = sum(g.numel() * 3 for g in grads)  # the fewest bytes: fp16 read once, FP8 written (amax reads again)
    rows = []
    for name, fn, opt in (("per-tensor (hooks)", per_tensor, one), ("batched flush", batched, many)):
        host, gpu = timed(lambda fn=fn, opt=opt: fn(opt, params, grads), opt, iters, warmup, device)
        rows.append((name, host, gpu))
    print(f"\n{len(params)} fp16 gradients, {sum(g.numel() for g in grads) / 1e6:.1f}M values, {device}")
    print(f"{'path':20s} {'host us':>10s} {'host us/grad':>13s} {'GPU us':>10s} {'GB/s':>8s}")
    for name, host, gpu in rows:
        print(f"{name:20s} {host:10.1f} {host / len(params):13.1f} {gpu:10.1f} {n_bytes / gpu / 1e3:8.0f}")


if __name__ == "__main__":
    main()
