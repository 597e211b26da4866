"""End-to-end GPT training step: BF16 autocast vs torchao float8 vs FP8-LM O1/O2 (issue 8).

Each (size, variant, compile) runs in its own subprocess so peak memory is clean; the parent prints a
table of tokens/s, step time and peak memory with ratios against BF16 of the same compile setting.

    python benchmarks/train_step.py                         # the three sizes on a GPU
    python benchmarks/train_step.py --sizes 2048x16 --compile both
    python benchmarks/train_step.py --sizes 1024x12 --compile yes --compile-mode reduce-overhead   # CUDA graphs
    python benchmarks/train_step.py --toy                   # CPU smoke run (tests use it)

Variants: ``bf16`` (autocast bf16, fp32 params, fused AdamW), ``torchao`` (torchao float8 tensorwise, when
installed), ``o1`` / ``o2`` (lightning_fp8: FP8Linear + FP8AdamW at that opt level, bf16 autocast for the rest),
``o2w`` (O2 with ``FP8AdamW(emit_fp8_weights=True)``: the step writes the FP8 weight copies the next forward uses
instead of casting; compiled, through lightning_fp8/weight_cache.py's ops), ``o2mw`` (``o2m`` with those copies),
``o2mwb`` (``o2mw`` with the gradient casts batched, as ``o2bt``),
``o2op`` (O2 with each cast an opaque custom op under torch.compile instead of the triton_op that inductor launches
itself: lightning_fp8/scaling.py TRACE_TRITON_CASTS; the same as ``o2`` eagerly), ``o2fc`` (O2 with the compiled
casts of activations and gradients fused by inductor into the kernels around them: lightning_fp8/scaling.py
FUSED_CASTS), ``o2ri`` (O2 compiled with the inputs' FP8 casts made again in the backward: lightning_fp8/matmul.py
SAVE_INPUT_TRANSPOSE_COMPILED), ``o2se`` (O2 with
speculative current scaling for eager casts only, the default before the eleventh session: kernels/quantize.py),
``o2bt`` (O2 with FP8AdamW's gradient casts batched: ``grad_cast_bucket_mb=64``), ``o2m`` (O2 with low-precision
moments for every parameter, the tied embedding/head included, as MS-AMP's O2 optimizer does:
``FP8AdamW(low_precision_moments="all")``), ``o2mf`` (``o2m`` with each block's MLP an ``FP8MLP``: the GELU fused
into the FP8 casts around it, lightning_fp8/mlp.py; dropout is 0 here), ``o2mh`` (``o2mf`` with
``FP8MLP(fp8_hidden=True)``: the GELU's input kept in FP8 for the backward), ``o2mn`` / ``o2mhn`` (``o2m`` / ``o2mh``
with ``FP8AdamW(fp8_grads=False)``: the weights' gradients stay fp16 for the optimizer; compiled, the gradient hooks
run only after the whole backward, so their casts free nothing early), ``o2ma`` (``o2m`` with the linear layers that
torchao's tensorwise auto filter expects no FP8 gain from kept in high precision: ``small_layer`` below, at d=1024 all
but the MLP's down projection). The output head stays in high
precision in every FP8 variant. Each result also gives the time of the warm-up steps (``warmup_s``; compiled, it
includes the compilation).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

VARIANTS = ("bf16", "torchao", "o1", "o2", "o2w", "o2op", "o2fc", "o2ri", "o2se", "o2bt", "o2m", "o2mf", "o2mh",
            "o2mw", "o2mwb", "o2mn", "o2mhn", "o2ma")


def build(variant: str, width: int, depth: int, seq: int, vocab: int, device: str):
    from gpt import GPT, GPTConfig, fp8_module_filter

    heads = max(1, width // 128)
    cfg = GPTConfig(vocab_size=vocab, seq_len=seq, depth=depth, width=width, heads=heads, bias=False)
    model = GPT(cfg).to(device)
    lr, wd = 3e-4, 0.1
    if variant == "bf16":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, fused=device == "cuda")
    elif variant == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=fp8_module_filter)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, fused=device == "cuda")
    else:
        import lightning_fp8 as lf
        from lightning_fp8 import scaling

        if variant == "o2op":
            scaling.TRACE_TRITON_CASTS = False
        if variant == "o2fc":
            scaling.FUSED_CASTS = True
        if variant == "o2ri":
            from lightning_fp8 import matmul

            matmul.SAVE_INPUT_TRANSPOSE_COMPILED = False
        if variant == "o2se" and device == "cuda":
            from lightning_fp8.kernels import quantize

            quantize.SPECULATIVE_CURRENT_SCALING = "eager"
        recipe = lf.FP8Recipe(opt_level=variant[:2].upper())
        keep = small_layer if variant == "o2ma" else lambda module: False
        lf.convert_to_fp8(model, recipe, module_filter_fn=lambda m, fqn: fp8_module_filter(m, fqn) and not keep(m))
        emit = variant in ("o2w", "o2mw", "o2mwb")
        # o2bt, o2mwb: the gradient casts batched (FP8AdamW's default: each cast in its hook)
        bucket = 64 if variant in ("o2bt", "o2mwb") else 0
        moments = "all" if variant.startswith("o2m") else "fp8_weights"
        if variant in ("o2mf", "o2mh", "o2mhn"):  # o2m with each block's MLP an FP8MLP (the GELU fused into its casts)
            hidden = variant in ("o2mh", "o2mhn")
            for block in model.blocks:
                block.mlp = lf.FP8MLP.from_modules(block.mlp.fc, block.mlp.proj, fp8_hidden=hidden)
        opt = lf.FP8AdamW(model.parameters(), lr=lr, weight_decay=wd, opt_level=recipe.opt_level, emit_fp8_weights=emit,
                          grad_cast_bucket_mb=bucket, low_precision_moments=moments,
                          fp8_grads=False if variant in ("o2mn", "o2mhn") else None)  # fmt: skip
    return model, opt


def small_layer(module: torch.nn.Module) -> bool:
    """Whether torchao's tensorwise auto filter (``torchao.float8._auto_filter_for_tensorwise``, from its H100
    microbenchmarks) keeps this linear layer out of float8: ``out_features <= 4096 and in_features <= 1024``."""
    out_features, in_features = module.weight.shape
    return out_features <= 4096 and in_features <= 1024


def build_run(variant: str, size: str, seq: int, vocab: int, batch: int, device: str):
    """``build`` for a ``WIDTHxDEPTH`` size from seed 0, and a batch of token ids: ``(model, opt, idx)``."""
    width, depth = (int(v) for v in size.split("x"))
    torch.manual_seed(0)
    model, opt = build(variant, width, depth, seq, vocab, device)
    return model, opt, torch.randint(0, vocab, (batch, seq), device=device)


def compile_once(model: torch.nn.Module, step, mode: str | None = None):
    """Run ``step(model)`` once eagerly, then compile ``model``: ``(step's result, compiled model)``.

    In the eager step FP8 layers leave their first-cast path (no amax history yet), so torch.compile compiles the
    model once instead of twice (the first-cast flag is a dynamo guard).
    """
    first = step(model)
    return first, torch.compile(model, mode=mode)


def run_one(args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, opt, idx = build_run(args.variant, args.size, args.seq, args.vocab, args.batch, device)
    tgt = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)

    graphs = args.compiled and args.compile_mode == "reduce-overhead"

    def step(step_fn=model):
        if graphs:  # a new iteration: the last replay's outputs (the loss) are no longer read
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device, dtype=torch.bfloat16):
            _, loss = step_fn(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    losses = []
    if args.compiled:  # every variant the same way
        first, compiled = compile_once(model, step, args.compile_mode)
        losses.append(first.item())
        step = functools.partial(step, compiled)
    t0 = time.perf_counter()
    losses += [step().item() for _ in range(args.warmup)]
    warmup_s = time.perf_counter() - t0  # compiled: includes the compilation
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    hits = _copy_hits()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    losses.append(loss.item())
    times.sort()
    step_s = times[len(times) // 2]
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return {
        "size": args.size,
        "variant": args.variant,
        "compiled": _compiled_label(args.compiled, args.compile_mode),
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "step_ms": step_s * 1e3,
        "warmup_s": warmup_s,
        "tok_s": args.batch * args.seq / step_s,
        "peak_gib": peak,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        # compiled forwards served by the weights' FP8 copies per timed step (emitting variants; 0 eagerly)
        "copy_hits": (_copy_hits() - hits) / args.steps,
        # compiled: graph breaks and graphs dynamo made (a break splits the step, a recompile compiles it again)
        **_dynamo_counts(),
        "compile_s": _compile_phases(),
    }


def _compile_phases() -> dict:
    """Compiled: seconds in the phases of dynamo, AOTAutograd and inductor that do not nest in one another (the
    tracing, the joint graph and its partition, lowering, scheduling and code generation, the kernels' compilation):
    where the warm-up's compile time goes."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    times = dict(zip(names, (float(v) for v in values), strict=True))
    return {name: round(times[name], 1) for name in _PHASES if times.get(name, 0.0) >= 0.05}


_PHASES = (
    "bytecode_tracing", "aot_trace_joint_graph", "_recursive_joint_graph_passes", "min_cut_rematerialization_partition",
    "_recursive_post_grad_passes", "GraphLowering.run", "Scheduler.__init__", "Scheduler.codegen",
    "async_compile.wait", "PyCodeCache.load_by_key_path", "compile_file", "build_guards",
)  # fmt: skip


def _dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"graph_breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"]}


def _copy_hits() -> int:
    from lightning_fp8 import weight_cache

    return weight_cache.compiled_hits


def _params(millions: float) -> str:
    """The params column: whole millions from 10M up, two decimals below (a toy model is not ``0M``)."""
    return f"{millions:.0f}M" if millions >= 10 else f"{millions:.2f}M"


def table(rows: list[dict]) -> str:
    base = {(r["size"], r["compiled"]): r for r in rows if r["variant"] == "bf16" and "error" not in r}
    lines = [
        f"{'size':>9} {'variant':>8} {'compile':>15} {'params':>7} {'step ms':>8} {'tok/s':>9} {'x bf16':>6} "
        f"{'peak GiB':>8} {'x bf16':>6} {'loss':>6}"
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['size']:>9} {r['variant']:>8} {r['compiled']!s:>15}  ERROR {r['error'][:80]}")
            continue
        b = base.get((r["size"], r["compiled"]))
        tok_ratio = r["tok_s"] / b["tok_s"] if b else float("nan")
        mem_ratio = r["peak_gib"] / b["peak_gib"] if b else float("nan")
        lines.append(
            f"{r['size']:>9} {r['variant']:>8} {r['compiled']!s:>15} {_params(r['params_m']):>7} {r['step_ms']:>8.1f} "
            f"{r['tok_s']:>9.0f} {tok_ratio:>6.2f} {r['peak_gib']:>8.2f} {mem_ratio:>6.2f} {r['last_loss']:>6.2f}"
        )
    return "\n".join(lines)


# The defaults of the flags --toy changes (argparse's defaults are None: a flag given wins over either set).
DEFAULTS = {"sizes": "1024x12,2048x16,4096x8", "seq": 2048, "batch": 8, "vocab": 50304, "steps": 20, "warmup": 5,
            "compile": "both"}  # fmt: skip
TOY_DEFAULTS = {"sizes": "64x2", "seq": 64, "batch": 2, "vocab": 256, "steps": 2, "warmup": 1, "compile": "no"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from gpu_args import at_least_0, count, fill_defaults

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    toy_sizes = TOY_DEFAULTS["sizes"]
    p.add_argument("--sizes", help=f"comma list of WIDTHxDEPTH; default: {DEFAULTS['sizes']} (--toy: {toy_sizes})")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of variants (default: all)")
    p.add_argument("--compile", choices=("no", "yes", "both"), help="default: both (--toy: no)")
    p.add_argument(
        "--compile-mode",
        default=None,
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        help="torch.compile mode (reduce-overhead: CUDA graphs)",
    )
    for key, kind in (("seq", count), ("batch", count), ("vocab", count), ("steps", count), ("warmup", at_least_0)):
        p.add_argument(f"--{key}", type=kind, help=f"default: {DEFAULTS[key]} (--toy: {TOY_DEFAULTS[key]})")
    p.add_argument("--timeout", type=count, default=900, help="seconds per configuration")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--toy", action="store_true", help="tiny CPU-sized run (smoke test); flags given win")
    # internal: run a single configuration and print its JSON row
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    args = fill_defaults(p.parse_args(argv), DEFAULTS, TOY_DEFAULTS)
    if args.one:
        return args
    check_variants_and_sizes(p, args.variants, args.sizes)
    return args


def check_variants_and_sizes(p: argparse.ArgumentParser, variants: str, sizes: str, flags=("--variants", "--sizes")):
    """Usage errors for a comma list of variants and one of WIDTHxDEPTH sizes (this script's and the scripts that
    build its model: memory_breakdown.py, step_phases.py, kernel_trace.py), before any model is built."""
    unknown = [v for v in variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"{flags[0]}: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    bad = [s for s in sizes.split(",") if not re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*", s)]
    if bad:
        p.error(f"{flags[1]}: {bad} are not WIDTHxDEPTH (positive integers, e.g. 1024x12)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.one:
        print("ROW " + json.dumps(run_one(args)))
        return
    compiled = {"no": [False], "yes": [True], "both": [False, True]}[args.compile]
    rows = []
    for size in args.sizes.split(","):
        for c in compiled:
            for variant in args.variants.split(","):
                if variant == "torchao" and not _has_torchao():
                    continue
                cmd = [sys.executable, __file__, "--one", "--size", size, "--variant", variant]
                cmd += ["--seq", str(args.seq), "--batch", str(args.batch), "--vocab", str(args.vocab)]
                cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--compiled"] if c else [])
                cmd += ["--compile-mode", args.compile_mode] if args.compile_mode else []
                label = _compiled_label(c, args.compile_mode)
                row = _run_child(cmd, args.timeout) | {"size": size, "variant": variant, "compiled": label}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(table(rows))
    if any("error" in r for r in rows):
        sys.exit(1)


def _compiled_label(compiled: bool, mode: str | None) -> bool | str:
    """The table's compile column: False, True (default mode) or the mode's name."""
    return mode if compiled and mode not in (None, "default") else compiled


def _run_child(cmd: list[str], timeout: int) -> dict:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout}s"}
    for line in out.stdout.splitlines():
        if line.startswith("ROW "):
            return json.loads(line[4:])
    tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
    return {"error": " | ".join(tail)}


def _has_torchao() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
