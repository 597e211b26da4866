"""Where the memory of a GPT training step goes: BF16 autocast against FP8-LM (issue 8).

    python benchmarks/memory_breakdown.py --size 2048x16 --variants bf16,o2     # a GPU
    python benchmarks/memory_breakdown.py --toy                                 # CPU smoke run (tests use it)

Per variant, in its own process (train_step.py builds the model and optimizer), after two warm-up steps:

- before the step: parameters by dtype, gradients, optimizer states by name and dtype;
- what the forward saves for the backward (autograd's saved tensors that are not parameters), by dtype;
- on a GPU, the step's peak (``torch.cuda.max_memory_allocated``) and the allocations alive at that moment, grouped
  by the Python line that made them (``torch.cuda.memory._record_memory_history``): the step's own allocations,
  on top of what was allocated when it began.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
MIB = 2**20
# Frames from these parts of a path name the line that allocated (the first such frame from the top of the stack).
OWN_CODE = ("lightning_fp8", "kernels/", "examples/", "benchmarks/", "torch/nn/", "torch/optim/")


def static_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes held between steps, by kind: parameters and gradients by dtype, optimizer states by name and dtype."""
    out: Counter[str] = Counter()
    for p in model.parameters():
        out[f"parameters {p.dtype}"] += p.numel() * p.element_size()
        if p.grad is not None:
            out[f"gradients {p.grad.dtype}"] += p.grad.numel() * p.grad.element_size()
    for state in opt.state.values():
        for name, t in state.items():
            if isinstance(t, torch.Tensor) and t.numel() > 1:
                out[f"optimizer {name} {t.dtype}"] += t.numel() * t.element_size()
    return dict(out)


def saved_bytes(model: torch.nn.Module, forward) -> dict[str, int]:
    """Bytes of the tensors the forward saves for the backward, parameters left out, each storage counted once."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, str]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), (storage.nbytes(), str(t.dtype)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    loss.backward()  # frees them
    out: Counter[str] = Counter()
    for nbytes, dtype in seen.values():
        out[f"saved {dtype}"] += nbytes
    return dict(out)


def live_at_peak(trace: list[dict]) -> tuple[int, list[tuple[int, list[dict]]]]:
    """Replay an allocator trace: the largest total of the blocks it allocated and had not freed, and those blocks
    as ``(size, frames)``. Blocks allocated before the trace began are not in it (they count as a baseline)."""
    live: dict[int, tuple[int, list[dict]]] = {}
    total = peak = peak_at = 0
    for i, entry in enumerate(trace):
        if entry["action"] == "alloc":
            live[entry["addr"]] = (entry["size"], entry.get("frames", []))
            total += entry["size"]
            if total > peak:
                peak, peak_at = total, i + 1
        elif entry["action"] == "free_requested" and entry["addr"] in live:
            total -= live.pop(entry["addr"])[0]
    live.clear()
    for entry in trace[:peak_at]:  # again, up to the peak, keeping what is alive there
        if entry["action"] == "alloc":
            live[entry["addr"]] = (entry["size"], entry.get("frames", []))
        elif entry["action"] == "free_requested":
            live.pop(entry["addr"], None)
    return peak, list(live.values())


def by_line(blocks: list[tuple[int, list[dict]]]) -> list[tuple[str, int]]:
    """Bytes per allocating line: the first frame of the project, an example, or torch.nn / torch.optim."""
    out: defaultdict[str, int] = defaultdict(int)
    for size, frames in blocks:
        frame = next((f for f in frames if any(k in f["filename"] for k in OWN_CODE)), frames[0] if frames else None)
        where = f"{Path(frame['filename']).name}:{frame['line']} {frame['name']}" if frame else "(no Python frame)"
        out[where] += size
    return sorted(out.items(), key=lambda kv: -kv[1])


def run_one(args) -> dict:
    from train_step import build_run

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, opt, idx = build_run(args.variant, args.size, args.seq, args.vocab, args.batch, device)

    def forward():
        with torch.autocast(device, dtype=torch.bfloat16):
            return model(idx, idx)[1]

    def step():
        forward().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    row = {"variant": args.variant, "size": args.size, "static": static_bytes(model, opt)}
    row["saved"] = saved_bytes(model, forward)
    opt.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        row["before_step"] = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=1_000_000)
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        row["peak"] = torch.cuda.max_memory_allocated()
        trace = snapshot["device_traces"][torch.cuda.current_device()]
        row["trace_peak"], blocks = live_at_peak(trace)
        row["at_peak"] = by_line(blocks)[: args.top]
    return row


def report(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        lines.append(f"== {r['variant']} {r['size']}")
        for key in ("static", "saved"):
            for name, nbytes in sorted(r[key].items(), key=lambda kv: -kv[1]):
                lines.append(f"   {key:7s} {name:45s} {nbytes / MIB:10.1f} MiB")
        if "peak" in r:
            lines.append(f"   peak {r['peak'] / MIB:.1f} MiB = {r['before_step'] / MIB:.1f} MiB when the step began "
                         f"+ {r['trace_peak'] / MIB:.1f} MiB of the step's own allocations, of which:")  # fmt: skip
            lines += [f"      {nbytes / MIB:10.1f} MiB  {where}" for where, nbytes in r["at_peak"]]
    base = next((r for r in rows if r["variant"] == "bf16"), None)
    if base is not None:
        for r in rows:
            saved = sum(r["saved"].values()) / max(1, sum(base["saved"].values()))
            static = sum(r["static"].values()) / max(1, sum(base["static"].values()))
            peak = f", peak {r['peak'] / base['peak']:.2f}x" if "peak" in r else ""
            lines.append(f"{r['variant']:>6s} vs bf16: static {static:.2f}x, saved activations {saved:.2f}x{peak}")
    return "\n".join(lines)


# The defaults of the flags --toy changes (argparse's defaults are None: a flag given wins over either set).
DEFAULTS = {"size": "2048x16", "seq": 2048, "batch": 8, "vocab": 50304}
TOY_DEFAULTS = {"size": "64x2", "seq": 64, "batch": 2, "vocab": 256}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from gpu_args import count, fill_defaults

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", help=f"WIDTHxDEPTH; default: {DEFAULTS['size']} (--toy: {TOY_DEFAULTS['size']})")
    p.add_argument("--variants", default="bf16,o2")
    for key in ("seq", "batch", "vocab"):
        p.add_argument(f"--{key}", type=count, help=f"default: {DEFAULTS[key]} (--toy: {TOY_DEFAULTS[key]})")
    p.add_argument("--top", type=count, default=15, help="allocating lines listed at the peak")
    p.add_argument("--toy", action="store_true", help="tiny CPU-sized run (smoke test); flags given win")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = fill_defaults(p.parse_args(argv), DEFAULTS, TOY_DEFAULTS)
    if not args.one:  # a usage error, not a ValueError from the first child (FP8Recipe(opt_level='BO') for "bogus")
        from train_step import check_variants_and_sizes

        check_variants_and_sizes(p, args.variants, args.size, flags=("--variants", "--size"))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.one:
        print("ROW " + json.dumps(run_one(args)))
        return
    rows = []
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--one", "--variant", variant, "--size", args.size, "--seq", str(args.seq),
               "--batch", str(args.batch), "--vocab", str(args.vocab), "--top", str(args.top)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True)
        row = next((json.loads(line[4:]) for line in out.stdout.splitlines() if line.startswith("ROW ")), None)
        if row is None:
            sys.exit(f"{variant} failed:\n{out.stderr[-3000:]}")
        rows.append(row)
    print(report(rows))


if __name__ == "__main__":
    main()
