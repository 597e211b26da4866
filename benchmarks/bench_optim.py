"""FP8AdamW: bytes per parameter and optimizer-step time over >= 1B parameters, against fp32 AdamW.

Memory (``torch.cuda.memory_allocated`` / ``max_memory_allocated``, divided by the parameter count) of a stack of
linear layers trained with

- baseline: fp32 parameters, bf16 autocast, ``torch.optim.AdamW(fused=True)`` (fp32 grads and moments);
- FP8-LM O2: ``convert_to_fp8`` + ``FP8AdamW`` + ``FP8GradScaler`` (fp16 master in the parameter's storage,
  E4M3 m, fp16 v, FP8 gradients).

Speed: one optimizer step over the same parameters, CUDA events, median of ``--iters``; effective bandwidth
from the bytes the step must move, against a device-to-device copy.

    python benchmarks/bench_optim.py                   # GPU: 16 x (8192 x 8192) = 1.07B parameters
    python benchmarks/bench_optim.py --toy             # CPU, tiny sizes: the script runs
    python benchmarks/bench_optim.py --sweep           # also try kernel launch configs
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
import traceback

import torch
from lightning_fp8.kernels import adamw as adamw_kernels
from torch import nn

import lightning_fp8
from lightning_fp8.formats import E5M2

# Bytes one step reads and writes per parameter (DESIGN.md "Optimization levels").
BYTES_FP32_ADAMW = 4 * 4 + 3 * 4  # read p, g, m, v; write p, m, v
BYTES_O2_TWO_PASS = 2 * (1 + 1 + 2 + 2) + (2 + 1 + 2)  # read g(FP8), m(E4M3), v, w(fp16) twice; write w, m, v
BYTES_O2_ONE_PASS = (1 + 1 + 2 + 2) + (2 + 1 + 2)

SWEEP = [
    {"BLOCK": 1024, "ITERS": 8, "NUM_WARPS": 4},
    {"BLOCK": 2048, "ITERS": 4, "NUM_WARPS": 8},
    {"BLOCK": 4096, "ITERS": 2, "NUM_WARPS": 8},
    {"BLOCK": 2048, "ITERS": 8, "NUM_WARPS": 8},
    {"BLOCK": 512, "ITERS": 16, "NUM_WARPS": 4},
]


def log(lines: list[str], text: str) -> None:
    print(text, flush=True)
    lines.append(text)


def make_stack(layers: int, hidden: int, device: torch.device) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(hidden, hidden, bias=False, device=device) for _ in range(layers)])


def timed(fn, iters: int, device: torch.device, setup=None) -> float:
    """Median milliseconds of ``fn()`` (``setup()`` runs before each call, untimed)."""
    times = []
    for i in range(iters + 2):
        if setup is not None:
            setup()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= 2:  # warm-up: compilation, allocation
            times.append(ms)
    return statistics.median(times)


def mem(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return 0, 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)


def memory_baseline(layers: int, hidden: int, tokens: int, device: torch.device, lines: list[str]) -> None:
    model = make_stack(layers, hidden, device)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    x = torch.randn(tokens, hidden, device=device)

    def fwd_bwd():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()

    for _ in range(2):
        fwd_bwd()
        opt.step()
        opt.zero_grad()
    reset_peak(device)
    fwd_bwd()
    after_backward, peak_backward = mem(device)
    reset_peak(device)
    opt.step()
    _, peak_step = mem(device)
    log(lines, f"baseline bf16 autocast + AdamW(fused) fp32: {n / 1e9:.3f}B params")
    log(lines, f"  params+grads+states after backward: {after_backward / n:.2f} B/param")
    log(lines, f"  peak during fwd+bwd (with bf16 weight copies, activations): {peak_backward / n:.2f} B/param")
    log(lines, f"  peak during optimizer.step: {peak_step / n:.2f} B/param")


def memory_fp8(layers: int, hidden: int, tokens: int, device: torch.device, lines: list[str]) -> None:
    model = lightning_fp8.convert_to_fp8(make_stack(layers, hidden, device))
    n = sum(p.numel() for p in model.parameters())
    scaler = lightning_fp8.FP8GradScaler(model=model)
    opt = lightning_fp8.FP8AdamW(model.parameters(), lr=1e-4, grad_scaler=scaler)
    x = torch.randn(tokens, hidden, device=device)

    def fwd_bwd():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        scaler.scale_loss(loss).backward()

    for _ in range(2):
        fwd_bwd()
        opt.step()
        opt.zero_grad()
    persistent, _ = mem(device)
    reset_peak(device)
    fwd_bwd()
    after_backward, peak_backward = mem(device)
    grad_bytes = sum(e.data.numel() * e.data.element_size() for e in opt._pending.values())
    reset_peak(device)
    opt.step()
    _, peak_step = mem(device)
    dtypes = {str(p.dtype) for p in model.parameters()}
    log(lines, f"FP8-LM O2 (FP8AdamW + FP8GradScaler): {n / 1e9:.3f}B params, parameter storage {dtypes}")
    log(lines, f"  master+states between steps (no gradient): {persistent / n:.2f} B/param")
    log(lines, f"  master+states+FP8 gradient after backward: {after_backward / n:.2f} B/param "
               f"(gradient {grad_bytes / n:.2f})")  # fmt: skip
    log(lines, f"  peak during fwd+bwd (FP8 weight copies saved for backward, transient fp16 gradient of one "
               f"layer, activations): {peak_backward / n:.2f} B/param")  # fmt: skip
    log(lines, f"  peak during optimizer.step: {peak_step / n:.2f} B/param")


def copy_bandwidth(device: torch.device, numel: int, iters: int) -> float:
    src = torch.empty(numel, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), iters, device)
    return 2 * src.numel() * 4 / (ms * 1e-3)


def speed(layers: int, hidden: int, device: torch.device, iters: int, sweep: bool, lines: list[str]) -> None:
    n = layers * hidden * hidden
    copy_bw = copy_bandwidth(device, min(n, 2**30), iters)
    log(lines, f"copy bandwidth (device to device, fp32): {copy_bw / 1e9:.0f} GB/s")
    baseline = make_stack(layers, hidden, device)
    for p in baseline.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    ref = torch.optim.AdamW(baseline.parameters(), lr=1e-4, fused=device.type == "cuda")
    ms_ref = timed(ref.step, iters, device)
    log(lines, f"torch.optim.AdamW(fused=True) fp32, {n / 1e9:.3f}B params: {ms_ref:.2f} ms "
               f"({BYTES_FP32_ADAMW * n / (ms_ref * 1e-3) / 1e9:.0f} GB/s effective)")  # fmt: skip
    del baseline, ref
    torch.cuda.empty_cache() if device.type == "cuda" else None

    model = lightning_fp8.convert_to_fp8(make_stack(layers, hidden, device))
    for mode, nbytes in (("one_pass", BYTES_O2_ONE_PASS), ("two_pass", BYTES_O2_TWO_PASS)):
        opt = lightning_fp8.FP8AdamW(model.parameters(), lr=1e-4, scale_update=mode, fp8_grads=False)
        for p in model.parameters():
            opt.accumulate_fp8_grad(p, torch.randn(p.shape, device=device, dtype=torch.float16) * 1e-3)
        grads = dict(opt._pending)
        assert all(g.data.dtype == E5M2 for g in grads.values())

        def restore(opt=opt, grads=grads):
            opt._pending.update(grads)

        configs = SWEEP if sweep and device.type == "cuda" else [dict(adamw_kernels.CONFIG)]
        default = dict(adamw_kernels.CONFIG)
        for cfg in configs:
            adamw_kernels.CONFIG.update(cfg)
            restore()
            opt._fp8_step(1.0)  # compiles
            ms = timed(lambda opt=opt: opt._fp8_step(1.0), iters, device, setup=restore)
            bw = nbytes * n / (ms * 1e-3)
            log(lines, f"FP8AdamW O2 {mode} {cfg}: {ms:.2f} ms, {ms_ref / ms:.2f}x faster than fused AdamW, "
                       f"{nbytes} B/param moved at {bw / 1e9:.0f} GB/s = {bw / copy_bw:.0%} of copy")  # fmt: skip
        adamw_kernels.CONFIG.update(default)
        del opt, grads
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_exact(device: torch.device, lines: list[str]) -> None:
    """The kernel against its reference on this device, bit for bit (O2 dtypes, both scale updates)."""
    from lightning_fp8.kernels import reference

    gen = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(37, 19), (1000, 333), (4096,)] if device.type == "cuda" else [(37, 19), (130,)]
    for two_pass in (True, False):
        runs = []
        for fn in (reference.adamw_step_ref, adamw_kernels.adamw_step):
            torch.manual_seed(0)
            p = [(torch.randn(s, generator=gen) * 2**11).half().to(device) for s in shapes]
            g = [(torch.randn(s, generator=gen) * 2**10).to(device, E5M2) for s in shapes]
            m = [(torch.randn(s, generator=gen) * 10).to(device, torch.float8_e4m3fn) for s in shapes]
            v = [(torch.rand(s, generator=gen) * 2**10).half().to(device) for s in shapes]
            scales = [tuple(torch.tensor(2.0**k, device=device) for k in (16, 10, 20)) for _ in shapes]
            amaxes = [tuple(torch.tensor(a, device=device) for a in (0.3, 0.02, 2e-3)) for _ in shapes]
            gsi = [torch.tensor(2.0**-20, device=device) for _ in shapes]
            g_amax = [t.float().abs().max() * 2.0**-20 for t in g]
            fn(p, g, m, v, scales, amaxes, gsi, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
               step=3, grad_unscale=0.5, two_pass=two_pass, grad_amaxes=g_amax)  # fmt: skip
            gen.manual_seed(0)
            runs.append([t.view(torch.uint8) if t.element_size() == 1 else t for t in p + m + v] +
                        [x for s in scales + amaxes for x in s])  # fmt: skip
        same = all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
        log(lines, f"kernel == reference bit for bit on {device} (two_pass={two_pass}): {same}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--toy", action="store_true", help="tiny sizes on CPU")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per forward in the memory runs")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's other launch configs")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--out", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.toy:
        args.layers, args.hidden, args.tokens, args.iters = 2, 64, 16, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.toy else "cpu")
    lines: list[str] = []
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    log(lines, f"command: python {' '.join(sys.argv)}")
    date = datetime.datetime.now().isoformat(timespec="seconds")
    log(lines, f"device: {name}; torch {torch.__version__}; date {date}")
    sections = [lambda: check_exact(device, lines)]
    if not args.skip_memory:
        sections += [lambda fn=fn: fn(args.layers, args.hidden, args.tokens, device, lines)
                     for fn in (memory_baseline, memory_fp8)]  # fmt: skip
    sections.append(lambda: speed(args.layers, args.hidden, device, args.iters, args.sweep, lines))
    failed = False
    for section in sections:
        try:  # one failing section still leaves the others' figures
            section()
        except Exception:
            failed = True
            log(lines, traceback.format_exc())
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
