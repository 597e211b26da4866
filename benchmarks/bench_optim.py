"""FP8AdamW: bytes per parameter and optimizer-step time over >= 1B parameters, against fp32 AdamW.

Memory (``torch.cuda.memory_allocated`` / ``max_memory_allocated``, divided by the parameter count) of a stack of
linear layers trained with

- baseline: fp32 parameters, bf16 autocast, ``torch.optim.AdamW(fused=True)`` (fp32 grads and moments);
- FP8-LM O2: ``convert_to_fp8`` + ``FP8AdamW`` + ``FP8GradScaler`` (fp16 master in the parameter's storage,
  E4M3 m, fp16 v, FP8 gradients).

Speed: one optimizer step over the same parameters, CUDA events, median of ``--iters``: "step" is
``FP8AdamW`` as a user calls it (its host bookkeeping included), "kernel" the multi-tensor launches alone,
back to back (GPU time). Effective bandwidth from the bytes the step must move, against a device-to-device copy.
Host: the Python time of one ``step`` for a model of 100 small FP8Linear layers (200 parameters).

    python benchmarks/bench_optim.py                   # GPU: 16 x (8192 x 8192) = 1.07B parameters
    python benchmarks/bench_optim.py --toy             # CPU, tiny sizes: the script runs
    python benchmarks/bench_optim.py --sweep           # also try kernel launch configs and diagnostic variants
    python benchmarks/bench_optim.py --emit            # only the FP8 weight copy: the step with and without it,
                                                       # and fwd+bwd of 4 FP8Linear(4096, 4096), 16384 tokens
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import inspect
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the exactness check runs on CPU
from lightning_fp8.kernels import adamw as adamw_kernels  # noqa: E402
from lightning_fp8.kernels import adamw_kernels as adamw_jit  # noqa: E402
from lightning_fp8.kernels import reference_adamw  # noqa: E402
from torch import nn  # noqa: E402

import lightning_fp8  # noqa: E402
from lightning_fp8 import weight_cache  # noqa: E402
from lightning_fp8.formats import E4M3, E5M2  # noqa: E402
from lightning_fp8.optim import master  # noqa: E402

# Bytes one step reads and writes per parameter (DESIGN.md "Optimization levels").
BYTES_FP32_ADAMW = 4 * 4 + 3 * 4  # read p, g, m, v; write p, m, v
BYTES_O2_TWO_PASS = 2 * (1 + 1 + 2 + 2) + (2 + 1 + 2)  # read g(FP8), m(E4M3), v, w(fp16) twice; write w, m, v
BYTES_O2_ONE_PASS = (1 + 1 + 2 + 2) + (2 + 1 + 2)
BYTES_EMIT = 1  # the FP8 weight copy the step writes (emit_fp8_weights=True)

# Around the default (first). Elements per thread = BLOCK / (32 NUM_WARPS): 4 or 8; 16 (the last) goes through shared
# memory for layout conversions.
SWEEP = [
    dict(adamw_kernels.CONFIG),
    {"BLOCK": 1024, "ITERS": 8, "NUM_WARPS": 4},
    {"BLOCK": 1024, "ITERS": 32, "NUM_WARPS": 4},
    {"BLOCK": 512, "ITERS": 32, "NUM_WARPS": 4},
    {"BLOCK": 2048, "ITERS": 8, "NUM_WARPS": 8},
    {"BLOCK": 256, "ITERS": 32, "NUM_WARPS": 2},
    {"BLOCK": 4096, "ITERS": 4, "NUM_WARPS": 8},
]
# Diagnostic kernels (--sweep; NOT bit-exact): the update's IEEE square root and division replaced, to see what the
# exact math costs (measured: about 2%; without any of it the kernel is no faster still, so it is memory-bound).
# Made by editing the kernel's source text.
VARIANTS = {
    "approx sqrt/div (sqrt.approx, div.full; not exact)": [
        ("tl.div_rn(m, tl.sqrt_rn(v) + eps)", "m / (tl.sqrt(v) + eps)")
    ],
    "no sqrt/div (update = m * step_size; not AdamW)": [("tl.div_rn(m, tl.sqrt_rn(v) + eps)", "m")],
}


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


def mem(device: torch.device) -> tuple[int | None, int | None]:
    """Allocated and peak bytes; None off CUDA, where torch keeps no memory counters."""
    if device.type != "cuda":
        return None, None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)


def per_param(nbytes: int | None, n: int) -> str:
    return "not measured (no CUDA memory counters)" if nbytes is None else f"{nbytes / n:.2f} B/param"


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
    log(lines, f"  params+grads+states after backward: {per_param(after_backward, n)}")
    log(lines, f"  peak during fwd+bwd (with bf16 weight copies, activations): {per_param(peak_backward, n)}")
    log(lines, f"  peak during optimizer.step: {per_param(peak_step, n)}")


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
    log(lines, f"  master+states between steps (no gradient): {per_param(persistent, n)}")
    log(lines, f"  master+states+FP8 gradient after backward: {per_param(after_backward, n)} "
               f"(gradient {grad_bytes / n:.2f} B/param)")  # fmt: skip
    log(lines, f"  peak during fwd+bwd (FP8 weight copies saved for backward, transient fp16 gradient of one "
               f"layer, activations): {per_param(peak_backward, n)}")  # fmt: skip
    log(lines, f"  peak during optimizer.step: {per_param(peak_step, n)}")


def copy_bandwidth(device: torch.device, numel: int, iters: int) -> float:
    src = torch.empty(numel, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), iters, device)
    return 2 * src.numel() * 4 / (ms * 1e-3)


def variant_module(name: str, edits: list[tuple[str, str]]):
    """kernels/adamw.py with source edits of its kernels (kernels/adamw_kernels.py), one module imported from a
    temporary file (Triton reads a kernel's source)."""
    kernels = inspect.getsource(adamw_jit)
    for old, new in edits:
        if old not in kernels:
            raise ValueError(f"variant {name!r}: {old!r} is not in kernels/adamw_kernels.py any more")
        kernels = kernels.replace(old, new)
    launcher = inspect.getsource(adamw_kernels)
    # The variant's main kernel replaces the imported one; the finalize kernel (kernels/adamw_finalize.py) is shared.
    for line in ("from __future__ import annotations\n", "from lightning_fp8.kernels.adamw_kernels import NCOL, "
                 "_adamw_kernel\n"):  # fmt: skip
        launcher = launcher.replace(line, "")
    path = os.path.join(tempfile.mkdtemp(), "adamw_variant.py")
    with open(path, "w") as f:
        f.write(kernels + "\n" + launcher)
    spec = importlib.util.spec_from_file_location(f"adamw_variant_{abs(hash(name))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def captured_launches(opt, restore) -> list[tuple[tuple, dict]]:
    """The ``adamw_step`` calls one optimizer step makes (to time the kernels without the optimizer)."""
    calls, real = [], adamw_kernels.adamw_step

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        real(*args, **kwargs)

    adamw_kernels.adamw_step = record
    try:
        restore()
        opt._fp8_step(1.0)
    finally:
        adamw_kernels.adamw_step = real
    return calls


def kernel_ms(launch, calls, iters: int, device: torch.device, repeat: int = 5) -> float:
    """GPU milliseconds per step of the launches alone: ``repeat`` steps back to back per timing (host hidden)."""

    def steps():
        for _ in range(repeat):
            for args, kwargs in calls:
                launch(*args, **kwargs)

    return timed(steps, max(2, iters // 2), device) / repeat


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

    def report(label: str, ms: float, nbytes: int) -> None:
        bw = nbytes * n / (ms * 1e-3)
        log(lines, f"  {label}: {ms:.2f} ms, {ms_ref / ms:.2f}x fused AdamW, {nbytes} B/param at {bw / 1e9:.0f} GB/s "
                   f"= {bw / copy_bw:.0%} of copy")  # fmt: skip

    model = lightning_fp8.convert_to_fp8(make_stack(layers, hidden, device))
    default = dict(adamw_kernels.CONFIG)
    for mode, nbytes in (("one_pass", BYTES_O2_ONE_PASS), ("two_pass", BYTES_O2_TWO_PASS)):
        opt = lightning_fp8.FP8AdamW(model.parameters(), lr=1e-4, scale_update=mode, fp8_grads=False)
        for p in model.parameters():
            opt.accumulate_fp8_grad(p, torch.randn(p.shape, device=device, dtype=torch.float16) * 1e-3)
        grads = dict(opt._pending)
        assert all(g.data.dtype == E5M2 for g in grads.values())

        def restore(opt=opt, grads=grads):
            opt._pending.update(grads)

        calls = captured_launches(opt, restore)  # compiles
        configs = SWEEP if sweep and device.type == "cuda" and mode == "one_pass" else [default]
        for cfg in configs:
            adamw_kernels.CONFIG.update(cfg)
            exact = check_exact(device, lines=None)
            restore()
            opt._fp8_step(1.0)  # compiles
            ms_step = timed(lambda opt=opt: opt._fp8_step(1.0), iters, device, setup=restore)
            log(lines, f"FP8AdamW O2 {mode} {cfg} (bit-exact on {device.type}: {exact})")
            report("step", ms_step, nbytes)
            if calls:  # none on CPU: the optimizer runs the reference there
                report("kernel", kernel_ms(adamw_kernels.adamw_step, calls, iters, device), nbytes)
        adamw_kernels.CONFIG.update(default)
        if sweep and device.type == "cuda" and mode == "one_pass":
            for name, edits in VARIANTS.items():
                variant = variant_module(name, edits)
                kernel_ms(variant.adamw_step, calls, 1, device)  # compiles
                report(f"diagnostic {name}, kernel", kernel_ms(variant.adamw_step, calls, iters, device), nbytes)
        del opt, grads, calls
    if device.type == "cuda":
        torch.cuda.empty_cache()


def speed_emit(layers: int, hidden: int, device: torch.device, iters: int, lines: list[str]) -> None:
    """The optimizer step with and without the FP8 weight copy (emit_fp8_weights), both scale updates."""
    n = layers * hidden * hidden
    copy_bw = copy_bandwidth(device, min(n, 2**30), iters)
    model = lightning_fp8.convert_to_fp8(make_stack(layers, hidden, device))
    for mode, nbytes in (("one_pass", BYTES_O2_ONE_PASS), ("two_pass", BYTES_O2_TWO_PASS)):
        for emit in (False, True):
            opt = lightning_fp8.FP8AdamW(model.parameters(), lr=1e-4, scale_update=mode, fp8_grads=False,
                                         emit_fp8_weights=emit)  # fmt: skip
            for p in model.parameters():
                opt.accumulate_fp8_grad(p, torch.randn(p.shape, device=device, dtype=torch.float16) * 1e-3)
            grads = dict(opt._pending)

            def restore(opt=opt, grads=grads):
                opt._pending.update(grads)

            calls = captured_launches(opt, restore)  # compiles
            ms_step = timed(lambda opt=opt: opt._fp8_step(1.0), iters, device, setup=restore)
            total = nbytes + (BYTES_EMIT if emit else 0)
            for label, ms in (("step", ms_step), ("kernel", kernel_ms(adamw_kernels.adamw_step, calls, iters, device)
                                                               if calls else float("nan"))):  # fmt: skip
                bw = total * n / (ms * 1e-3)
                log(lines, f"FP8AdamW O2 {mode} emit_fp8_weights={emit} {label}: {ms:.2f} ms, {total} B/param at "
                           f"{bw / 1e9:.0f} GB/s = {bw / copy_bw:.0%} of copy ({n / 1e9:.3f}B params)")  # fmt: skip
            del opt, grads, calls
            for p in model.parameters():
                weight_cache.drop(p)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def forward_emit(layers: int, hidden: int, tokens: int, device: torch.device, iters: int, lines: list[str]) -> None:
    """Forward + backward of FP8Linear layers with the step's FP8 weight copies against casting the weights."""
    model = lightning_fp8.convert_to_fp8(make_stack(layers, hidden, device))
    opt = lightning_fp8.FP8AdamW(model.parameters(), lr=1e-4, scale_update="two_pass", fp8_grads=False,
                                 emit_fp8_weights=True)  # fmt: skip
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)

    def fwd_bwd():
        model(x).backward(dy)

    fwd_bwd()
    opt.step()
    caches = [getattr(m.weight, weight_cache.ATTR) for m in model]
    exact = True
    for c, m in zip(caches, model, strict=True):
        cast = copy.deepcopy(m.fp8_scaling["weight"]).quantize(m.weight, False, True, master.master_scale(m.weight))[0]
        exact = exact and torch.equal(c.data.view(torch.uint8), cast.view(torch.uint8))
    log(lines, f"two-pass FP8 weight copy == the forward's weight cast bit for bit on {device.type}: {exact}")

    def clear():
        x.grad = None
        for p in model.parameters():
            p.grad = None

    def cast_all():  # as without copies
        clear()
        for m in model:
            weight_cache.drop(m.weight)

    def first_after_step():  # the copies are there, their transposes not yet
        clear()
        for m, c in zip(model, caches, strict=True):
            c.data_t = None
            setattr(m.weight, weight_cache.ATTR, c)

    ms_cast = timed(fwd_bwd, iters, device, setup=cast_all)
    ms_first = timed(fwd_bwd, iters, device, setup=first_after_step)
    ms_kept = timed(fwd_bwd, iters, device, setup=clear)  # transposes kept (micro-batches 2.. of a step)
    what = f"fwd+bwd of {layers} FP8Linear({hidden}, {hidden}), {tokens} tokens bf16"
    log(lines, f"{what}: casting the weights {ms_cast:.3f} ms; with the copies, first forward after the step "
               f"(transposes made) {ms_first:.3f} ms ({ms_cast - ms_first:+.3f} saved), "
               f"later forwards {ms_kept:.3f} ms ({ms_cast - ms_kept:+.3f} saved)")  # fmt: skip
    w = model[0].weight
    state = copy.deepcopy(model[0].fp8_scaling["weight"])
    scale = master.master_scale(w)
    ms_w = timed(lambda: state.quantize(w, True, True, scale), iters, device)
    ms_t = timed(lambda: caches[0].data.t().contiguous(), iters, device)
    ms_rec = timed(lambda: weight_cache.quantize_weight(state, w, False, scale), iters, device)
    log(lines, f"one {hidden}x{hidden} weight: cast + transposed cast (current scaling) {ms_w * 1e3:.1f} us, "
               f"FP8 byte transpose (torch) {ms_t * 1e3:.1f} us, the copy's statistics recorded {ms_rec * 1e3:.1f} us")


def host_overhead(device: torch.device, lines: list[str], layers: int = 100, hidden: int = 64) -> None:
    """Host milliseconds of ``FP8AdamW._fp8_step`` for many small parameters (perf_counter, no synchronization).

    "bookkeeping": the optimizer's Python alone, with the kernel call (the reference on CPU, the Triton launcher on a
    GPU) replaced by a no-op; on a GPU also "total", the Triton launches included (not their GPU time: the host does
    not wait for it).
    """
    model = lightning_fp8.convert_to_fp8(nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)]))
    model.to(device)
    opt = lightning_fp8.FP8AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(16, hidden, device=device)).square().mean().backward()
    pending, dense = dict(opt._pending), {p: p.grad for p in model.parameters() if p.grad is not None}

    def median_ms() -> float:
        times = []
        for _ in range(50):
            opt._pending.update(pending)
            for p, g in dense.items():
                p.grad = g
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt._fp8_step(1.0)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times[10:])

    what = f"host time of one FP8AdamW step, {layers} FP8Linear({hidden}, {hidden}) = {2 * layers} params"
    if device.type == "cuda":
        log(lines, f"{what}, total (Triton launches included): {median_ms():.3f} ms")
    real = (reference_adamw.adamw_step_ref, adamw_kernels.adamw_step)
    reference_adamw.adamw_step_ref = adamw_kernels.adamw_step = lambda *args, **kwargs: None
    try:
        log(lines, f"{what}, bookkeeping (kernel call a no-op): {median_ms():.3f} ms")
    finally:
        reference_adamw.adamw_step_ref, adamw_kernels.adamw_step = real


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bit for bit, except that any NaN equals any NaN (the payload of a NaN carries no information).
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = a.float().isnan()
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(nan, b.float().isnan()) and torch.equal(a.view(bits)[~nan], b.view(bits)[~nan])


def check_exact(device: torch.device, lines: list[str] | None) -> bool:
    """The kernel against its reference on this device, bit for bit (O2 dtypes, both scale updates), also where the
    states saturate (stored amaxes far too small for the one-pass bound) and where gradients are inf or NaN."""
    shapes = [(37, 19), (1000, 333), (4096,)] if device.type == "cuda" else [(37, 19), (130,)]
    results = []
    for case in ("two_pass", "one_pass", "saturating", "non_finite", "emit_two_pass", "emit_one_pass"):
        runs = []
        for fn in (reference_adamw.adamw_step_ref, adamw_kernels.adamw_step):
            gen = torch.Generator(device="cpu").manual_seed(0)
            p = [(torch.randn(s, generator=gen) * 2**11).half().to(device) for s in shapes]
            # The interpreter decodes E5M2 inf and NaN as finite numbers: non-finite FP8 gradients only on a GPU.
            g_dtype = torch.float16 if case == "non_finite" and device.type == "cpu" else E5M2
            g = [(torch.randn(s, generator=gen) * 2**10).to(device, g_dtype) for s in shapes]
            m = [(torch.randn(s, generator=gen) * 10).to(device, E4M3) for s in shapes]
            v = [(torch.rand(s, generator=gen) * 2**10).half().to(device) for s in shapes]
            if case == "non_finite":
                for t, bad in zip(g, (float("inf"), float("nan"), -float("inf")), strict=False):
                    t.view(-1)[3] = bad
            scales = [tuple(torch.tensor(2.0**k, device=device) for k in (16, 10, 20)) for _ in shapes]
            a = (1e-6, 1e-7, 1e-9) if case == "saturating" else (0.3, 0.02, 2e-3)
            amaxes = [tuple(torch.tensor(x, device=device) for x in a) for _ in shapes]
            gsi = [torch.tensor(2.0**-20, device=device) for _ in shapes]
            g_amax = [t.float().abs().amax() * 2.0**-20 for t in g]
            emit = case.startswith("emit")  # FP8 weight copies (emit_fp8_weights) and their records, margin 1
            fp8 = [torch.empty(s, device=device, dtype=E4M3) for s in shapes] if emit else None
            records = [torch.zeros(5, device=device, dtype=torch.int64) for _ in shapes] if emit else None
            fn(p, g, m, v, scales, amaxes, gsi, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
               step=3, grad_unscale=0.5, two_pass=case.endswith("two_pass"), grad_amaxes=g_amax, fp8_weights=fp8,
               fp8_weight_stats=records, fp8_margin=1 if emit else 0)  # fmt: skip
            runs.append(p + m + v + [x for s in scales + amaxes for x in s] + (fp8 + records if emit else []))
        same = all(_same(a, b) for a, b in zip(*runs, strict=True))
        results.append(same)
        if lines is not None:
            log(lines, f"kernel == reference bit for bit on {device} ({case}): {same}")
    return all(results)


def main(argv: list[str] | None = None) -> None:
    from gpu_args import count

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--toy", action="store_true", help="tiny sizes on CPU")
    parser.add_argument("--layers", type=count, default=16)
    parser.add_argument("--hidden", type=count, default=8192)
    parser.add_argument("--tokens", type=count, default=64, help="tokens per forward in the memory runs")
    parser.add_argument("--iters", type=count, default=10)
    parser.add_argument("--sweep", action="store_true", help="also time other launch configs and diagnostic kernels")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--out", help="also write the results to this file")
    parser.add_argument("--emit", action="store_true", help="only the FP8 weight copy (emit_fp8_weights) figures")
    parser.add_argument("--emit-layers", type=count, default=4, help="FP8Linear layers of the --emit fwd+bwd")
    parser.add_argument("--emit-hidden", type=count, default=4096)
    parser.add_argument("--emit-tokens", type=count, default=16384)
    args = parser.parse_args(argv)
    if args.toy:
        args.layers, args.hidden, args.tokens, args.iters = 2, 64, 16, 2
        args.emit_layers, args.emit_hidden, args.emit_tokens = 2, 64, 48
    device = torch.device("cuda" if torch.cuda.is_available() and not args.toy else "cpu")
    lines: list[str] = []
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    log(lines, f"command: python {' '.join(sys.argv)}")
    date = datetime.datetime.now().isoformat(timespec="seconds")
    log(lines, f"device: {name}; torch {torch.__version__}; date {date}")
    sections = [lambda: check_exact(device, lines)]
    if args.emit:
        args.skip_memory = args.skip_speed = True
        sections.append(lambda: speed_emit(args.layers, args.hidden, device, args.iters, lines))
        sections.append(lambda: forward_emit(args.emit_layers, args.emit_hidden, args.emit_tokens, device, args.iters,
                                             lines))  # fmt: skip
    if not args.skip_memory:
        sections += [lambda fn=fn: fn(args.layers, args.hidden, args.tokens, device, lines)
                     for fn in (memory_baseline, memory_fp8)]  # fmt: skip
    if not args.skip_speed:
        sections.append(lambda: speed(args.layers, args.hidden, device, args.iters, args.sweep, lines))
    if not args.emit:
        sections.append(lambda: host_overhead(device, lines))
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
