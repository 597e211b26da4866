"""Where the time goes: torch.profiler tables of FP8Linear forward+backward and of one GPT training step.

    python benchmarks/profile_step.py                    # GPU: 16384 x 4096 -> 4096 layer, GPT d=1024 O2 step
    python benchmarks/profile_step.py --what gpt --width 2048 --depth 16 [--compile]

Prints, per case: the wall time of one iteration, the CPU time to enqueue it (no synchronisation), the GPU
busy time (sum of kernel times), the number of kernel launches, and the top operators by self CPU time and by
device time. A wall time well above the GPU busy time means the host (Python, launches) is the limit.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _timed(fn, iters: int) -> tuple[float, float]:
    """(wall ms per iteration with a sync at the end, host ms per iteration to enqueue)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    enqueue = (time.perf_counter() - t0) / iters * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / iters * 1e3
    return wall, enqueue


def report(name: str, fn, iters: int = 10, rows: int = 18) -> None:
    wall, enqueue = _timed(fn, iters)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    # Device events less the GPU-side spans of user annotations (an optimizer's step): those are not kernels, and
    # counting them added the span of Optimizer.step (1.4-2.2 ms per GPT step) to "GPU busy" before the ninth session.
    kernels = [e for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    busy = sum(e.device_time for e in kernels) / iters / 1e3
    print(f"\n=== {name}: wall {wall:.3f} ms/iter, host enqueue {enqueue:.3f} ms/iter, GPU busy {busy:.3f} ms/iter, "
          f"{len(kernels) / iters:.0f} kernels/iter")
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70))
    print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70))
    totals: dict[str, float] = {}
    for e in kernels:
        kind = kernel_kind(e.name)
        totals[kind] = totals.get(kind, 0.0) + e.device_time / iters / 1e3
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    print("GPU time by kind (ms/iter): " + ", ".join(f"{k} {v:.2f}" for k, v in ranked))


# Kernel name fragments -> kind, first match wins (names as CUDA, cuBLAS, Triton and inductor give them).
_KINDS = (
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("fp8 gemm", ("e4m3", "e5m2", "f8f8", "fp8", "nvjet_sm90_q")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_")),
    ("grad cast", ("_grad_amax", "_grad_cast")),
    ("fp8 cast", ("_cast_transpose", "_cast_flat", "_amax_kernel", "_transpose_kernel")),
    ("optimizer", ("adam", "_finalize", "multi_tensor", "foreach")),
    ("inductor reduction", ("triton_red", "triton_per")),
    ("inductor pointwise", ("triton_poi", "triton_tem")),
    ("copy/fill", ("copy", "fill", "memset", "memcpy", "catarray", "cat_")),
    ("elementwise (eager)", ("elementwise", "vectorized", "unrolled")),
    ("reduction (eager)", ("reduce", "layer_norm", "softmax", "nll", "cross_entropy")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, fragments in _KINDS:
        if any(f in low for f in fragments):
            return kind
    return "other"


def linear_case(tokens: int, k: int, n: int, compile: bool = False, fp8: bool = True):
    """Forward + backward of FP8Linear (``fp8``) or nn.Linear under bf16 autocast, optionally compiled."""
    import lightning_fp8 as lf

    layer = (lf.FP8Linear if fp8 else torch.nn.Linear)(k, n, device="cuda")
    layer = torch.compile(layer) if compile else layer
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = layer.weight.grad = layer.bias.grad = None  # as zero_grad(set_to_none=True): no accumulation kernels
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(dy)

    return step


def gpt_case(variant: str, width: int, depth: int, seq: int, batch: int, compile: bool = False):
    from train_step import build, compile_once

    model, opt = build(variant, width, depth, seq, 50304, "cuda")
    idx = torch.randint(0, 50304, (batch, seq), device="cuda")

    def step(module=model):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = module(idx, idx)
            loss = loss[1] if isinstance(loss, tuple) else loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if not compile:
        return step
    _, compiled = compile_once(model, step)
    return lambda: step(compiled)


def main() -> None:
    from gpu_args import count, require_cuda

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    kinds = "linear, linear_fused, linear_unfused, linear_compile, linear_bf16, gpt"
    p.add_argument("--what", default="linear,gpt", help=f"comma list: {kinds}")
    p.add_argument("--shape", type=count, nargs=3, default=(16384, 4096, 4096), metavar=("TOKENS", "IN", "OUT"))
    p.add_argument("--variants", default="bf16,o2")
    p.add_argument("--width", type=count, default=1024)
    p.add_argument("--depth", type=count, default=12)
    p.add_argument("--seq", type=count, default=2048)
    p.add_argument("--batch", type=count, default=8)
    p.add_argument("--rows", type=count, default=18)
    p.add_argument("--compile", action="store_true", help="compile the GPT model (gpt only)")
    args = p.parse_args()
    what = args.what.split(",")
    # an unknown kind profiled nothing without a word; a variant or no GPU failed after the other kinds had run
    unknown = [w for w in what if w not in kinds.split(", ")]
    if unknown:
        p.error(f"--what: unknown {unknown}; choose from {kinds}")
    if "gpt" in what:
        from train_step import check_variants_and_sizes

        size = f"{args.width}x{args.depth}"
        check_variants_and_sizes(p, args.variants, size, flags=("--variants", "--width/--depth"))

    require_cuda(p)
    if "linear" in what:
        report(f"FP8Linear {args.shape}", linear_case(*args.shape), rows=args.rows)
    if "linear_compile" in what:  # torch.compile: what the compiled step adds or removes
        report(f"FP8Linear {args.shape}, torch.compile", linear_case(*args.shape, compile=True), rows=args.rows)
    for fused in (True, False):  # the bias gradient from the grad cast or dy.sum(0) (lightning_fp8/matmul.py)
        if ("linear_fused" if fused else "linear_unfused") in what:
            from lightning_fp8 import matmul as fp8_matmul

            default, fp8_matmul.FUSED_BIAS_GRAD = fp8_matmul.FUSED_BIAS_GRAD, fused
            label = "fused bias gradient" if fused else "bias gradient by dy.sum(0)"
            report(f"FP8Linear {args.shape}, {label}", linear_case(*args.shape), rows=args.rows)
            fp8_matmul.FUSED_BIAS_GRAD = default
    if "linear_bf16" in what:  # the baseline: nn.Linear under bf16 autocast
        report(f"nn.Linear {args.shape}", linear_case(*args.shape, fp8=False), rows=args.rows)
    if "gpt" in what:
        for variant in args.variants.split(","):
            fn = gpt_case(variant, args.width, args.depth, args.seq, args.batch, args.compile)
            label = ", compiled" if args.compile else ""
            report(f"GPT {variant} d={args.width} x {args.depth}{label}", fn, iters=5, rows=args.rows)
            del fn
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
