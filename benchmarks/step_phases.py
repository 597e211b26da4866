"""Where a GPT training step waits: host and GPU time of each phase (forward, backward, optimizer step, zero_grad).

    python benchmarks/step_phases.py --size 1024x12 --variants bf16,o2m [--compile-mode reduce-overhead]
    python benchmarks/step_phases.py --toy            # CPU smoke run (tests use it)

The model is built and compiled as ``train_step.py`` builds it (``--compile-mode eager``: not compiled). Two passes
of ``--steps`` steps each, medians per phase:

- free-running, one synchronization per step as ``train_step.py`` times it: ``step`` is its wall time, ``host`` the
  time each phase's Python call took to return (to enqueue its work);
- synchronized before and after each phase: ``alone`` is each phase's wall time on an idle GPU (its host time, or its
  GPU time where that is longer).

A phase whose ``host`` is close to its ``alone`` is host-bound: the GPU waits for its launches. A step whose wall time
is close to the sum of its host times is host-bound as a whole.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

PHASES = ("forward", "backward", "optimizer", "zero_grad")


def phases(variant: str, size: str, seq: int, vocab: int, batch: int, steps: int, compile_mode: str | None):
    """Medians over ``steps`` steps: ``{"step": ms, "host": {phase: ms}, "alone": {phase: ms}}``."""
    from train_step import build_run, compile_once

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, opt, idx = build_run(variant, size, seq, vocab, batch, device)
    graphs = compile_mode == "reduce-overhead"

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def step(module, marks: list[float], synced: bool = False):
        def mark():
            if synced:
                sync()
            marks.append(time.perf_counter())

        mark()
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device, dtype=torch.bfloat16):
            _, loss = module(idx, idx)
        mark()
        loss.backward()
        mark()
        opt.step()
        mark()
        opt.zero_grad(set_to_none=True)
        mark()

    module = model
    if compile_mode != "eager":
        mode = None if compile_mode == "default" else compile_mode
        _, module = compile_once(model, functools.partial(step, marks=[]), mode)
    for _ in range(3):
        step(module, [])
    sync()
    hits = _copy_hits()
    host = {p: [] for p in PHASES}
    alone = {p: [] for p in PHASES}
    walls = []
    for _ in range(steps):
        marks: list[float] = []
        step(module, marks)
        sync()
        walls.append((time.perf_counter() - marks[0]) * 1e3)
        for p, a, b in zip(PHASES, marks[:-1], marks[1:], strict=True):
            host[p].append((b - a) * 1e3)
    for _ in range(steps):
        marks = []
        step(module, marks, synced=True)
        for p, a, b in zip(PHASES, marks[:-1], marks[1:], strict=True):
            alone[p].append((b - a) * 1e3)
    med = statistics.median
    return {"step": med(walls), "host": {p: med(v) for p, v in host.items()},
            "alone": {p: med(v) for p, v in alone.items()},
            "copy_hits": (_copy_hits() - hits) / (2 * steps)}  # fmt: skip


def _copy_hits() -> int:
    # compiled forwards served by the weights' FP8 copies (emitting variants), per step in the result
    from lightning_fp8 import weight_cache

    return weight_cache.compiled_hits


def table(rows: list[tuple[str, dict]]) -> str:
    phases_head = " ".join(f"{p + ' host/alone':>21}" for p in PHASES)
    lines = [f"{'variant':>8} {'step ms':>8} {phases_head} {'host sum':>8}"]
    for name, r in rows:
        cells = " ".join(f"{r['host'][p]:>10.2f}/{r['alone'][p]:<10.2f}" for p in PHASES)
        lines.append(f"{name:>8} {r['step']:>8.2f} {cells} {sum(r['host'].values()):>8.2f}")
    return "\n".join(lines)


# The defaults of the flags --toy changes (argparse's defaults are None: a flag given wins over either set).
DEFAULTS = {"size": "1024x12", "seq": 2048, "batch": 8, "vocab": 50304, "steps": 10, "compile_mode": "default"}
TOY_DEFAULTS = {"size": "64x2", "seq": 64, "batch": 2, "vocab": 256, "steps": 2, "compile_mode": "eager"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from gpu_args import count, fill_defaults

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", help=f"WIDTHxDEPTH; default: {DEFAULTS['size']} (--toy: {TOY_DEFAULTS['size']})")
    p.add_argument("--variants", default="bf16,o2m", help="train_step.py variants")
    p.add_argument(
        "--compile-mode",
        choices=("eager", "default", "reduce-overhead"),
        help=f"default: {DEFAULTS['compile_mode']} (--toy: {TOY_DEFAULTS['compile_mode']})",
    )
    for key in ("seq", "batch", "vocab", "steps"):
        p.add_argument(f"--{key}", type=count, help=f"default: {DEFAULTS[key]} (--toy: {TOY_DEFAULTS[key]})")
    p.add_argument("--toy", action="store_true", help="tiny CPU-sized run (smoke test); flags given win")
    args = fill_defaults(p.parse_args(argv), DEFAULTS, TOY_DEFAULTS)
    from train_step import check_variants_and_sizes

    # a usage error, not a ValueError from building the model (FP8Recipe(opt_level='BO') for "bogus")
    check_variants_and_sizes(p, args.variants, args.size, flags=("--variants", "--size"))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = []
    for variant in args.variants.split(","):
        r = phases(variant, args.size, args.seq, args.vocab, args.batch, args.steps, args.compile_mode)
        rows.append((variant, r))
        print(variant, r, flush=True)
    print(f"{args.size}, compile: {args.compile_mode}")
    print(table(rows))


if __name__ == "__main__":
    main()
