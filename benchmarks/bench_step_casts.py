"""The FP8 casts of one GPT block's training step (benchmarks/train_step.py's model), each timed alone, eagerly and
compiled, against a device copy of its input in the same run.

    python benchmarks/bench_step_casts.py --width 4096 --tokens 16384    # on a GPU
    python benchmarks/bench_step_casts.py --toy                           # tiny, on CPU (a smoke test)

A block casts, per step: the inputs of its four linear layers (E4M3, delayed scaling, with the transposed copy the
weight gradient needs), the gradients of their outputs (E5M2, the same), and the four weights (E4M3, current scaling,
the fp16 master unscaled; the backward casts each again transposed). Each row times ``ScalingState.quantize`` as
FP8Linear calls it, eagerly (``quantize_``: one launch, or two with current scaling) and inside ``torch.compile``
(the triton_op inductor launches), checks that both give the same bytes, and counts the fewest bytes the cast must
move (input read once, each FP8 output written once). "% copy" is that rate over a device copy's in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cast import median_ms  # noqa: E402 (sets TRITON_INTERPRET on CPU before triton is imported)

from lightning_fp8 import ops  # noqa: E402
from lightning_fp8.scaling import ScalingState  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def cases(width: int, tokens: int) -> list[tuple[str, tuple[int, int], torch.dtype, torch.dtype, str, int]]:
    """``(name, shape, input dtype, FP8 dtype, kind, casts per block and step)`` of one block's casts; kind: ``act``
    (delayed, transposed), ``weight`` (current, unscaled fp16 master, flat) or ``recast`` (the backward's transposed
    weight cast). LayerNorm outputs are fp32 under autocast."""
    d, t, bf16 = width, tokens, torch.bfloat16
    rows = [
        ("ln out -> qkv, fc1", (t, d), torch.float32, E4M3, "act", 2),
        ("attention out -> proj", (t, d), bf16, E4M3, "act", 1),
        ("gelu out -> fc2", (t, 4 * d), bf16, E4M3, "act", 1),
        ("grad qkv", (t, 3 * d), bf16, E5M2, "act", 1),
        ("grad proj, fc2 (residual)", (t, d), bf16, E5M2, "act", 2),
        ("grad fc1", (t, 4 * d), bf16, E5M2, "act", 1),
    ]
    for name, shape in (("qkv", (3 * d, d)), ("proj", (d, d)), ("fc1", (4 * d, d)), ("fc2", (d, 4 * d))):
        rows.append((f"weight {name}", shape, torch.float16, E4M3, "weight", 1))
        rows.append((f"weight {name}, backward recast", shape, torch.float16, E4M3, "recast", 1))
    return rows


def _cast_fn(kind: str, state: ScalingState, unscale: torch.Tensor):
    if kind == "act":
        return lambda x: state.quantize(x, True, False)[:2]
    if kind == "weight":
        return lambda x: state.quantize(x, False, True, unscale)[:1]
    return lambda x: (ops.recast_transposed(x, torch.reciprocal(state.scale_inv * unscale), state.fp8_dtype),)


def kernel_ms(fn, device, iters: int = 20) -> float:
    """GPU time of ``fn``'s kernels per call (profiler), host time left out; NaN on CPU."""
    if device.type != "cuda":
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / iters / 1e3


def run_case(shape, dtype, fp8_dtype, kind, device, rep) -> tuple[float, float, float, bool, float, float]:
    """``(eager ms, compiled ms, copy ms, same bytes, eager kernels ms, compiled kernels ms)`` of one cast: the first
    three timed end to end (a host-bound call counts its host time), the last two the GPU time of the kernels."""
    x = torch.randn(shape, device=device).mul_(3).to(dtype)
    unscale = torch.tensor(0.25, device=device)
    states = [ScalingState(fp8_dtype, 16 if kind == "act" else 1, 0, "max", kind == "act", device) for _ in range(2)]
    for s in states:  # the step's state: a history, so a delayed cast uses it
        s.quantize(x, kind == "act", True, None if kind == "act" else unscale)
    eager_fn = _cast_fn(kind, states[0], unscale)
    torch._dynamo.reset()  # each case compiles afresh (the lambdas share a code object: no recompile limit)
    compiled_fn = torch.compile(_cast_fn(kind, states[1], unscale), fullgraph=True)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(eager_fn(x), compiled_fn(x), strict=True))  # fmt: skip
    out = torch.empty_like(x)
    return (median_ms(lambda: eager_fn(x), device, rep), median_ms(lambda: compiled_fn(x), device, rep),
            median_ms(lambda: out.copy_(x), device, rep), same, kernel_ms(lambda: eager_fn(x), device),
            kernel_ms(lambda: compiled_fn(x), device))  # fmt: skip


# The defaults of the flags --toy changes (argparse's defaults are None: a flag given wins over either set).
DEFAULTS, TOY_DEFAULTS = {"width": 4096, "tokens": 16384}, {"width": 32, "tokens": 64}


def main() -> None:
    from gpu_args import count, fill_defaults

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=count, help="default: 4096 (--toy: 32)")
    p.add_argument("--tokens", type=count, help="batch x sequence (train_step.py: 8 x 2048); default 16384 (--toy: 64)")
    p.add_argument("--toy", action="store_true", help="width 32, 64 tokens, on CPU; flags given win")
    p.add_argument("--speculate", choices=("True", "eager", "False"), default="True",
                   help="kernels/quantize.py SPECULATIVE_CURRENT_SCALING (eager: compiled casts do not speculate)")
    args = fill_defaults(p.parse_args(), DEFAULTS, TOY_DEFAULTS)
    from lightning_fp8.kernels import quantize

    quantize.SPECULATIVE_CURRENT_SCALING = {"True": True, "eager": "eager", "False": False}[args.speculate]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rep = 100 if device.type == "cuda" else 1
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"width {args.width}, {args.tokens} tokens, speculative current scaling: {args.speculate}")  # fmt: skip
    print(f"{'cast':>40} {'shape':>13} {'in':>8} {'eager us':>9} {'compiled':>9} {'% copy':>7} {'compiled':>9} same"
          f" {'kernels: eager us':>17} {'compiled':>9}")  # fmt: skip
    totals = [0.0, 0.0]
    for label, shape, dtype, fp8_dtype, kind, per_step in cases(args.width, args.tokens):
        eager, compiled, copy, same, k_eager, k_compiled = run_case(shape, dtype, fp8_dtype, kind, device, rep)
        numel, size = shape[0] * shape[1], torch.empty((), dtype=dtype).element_size()
        moved = numel * (size + (2 if kind == "act" else 1))  # bytes the cast must move
        copied = 2 * numel * size
        pct = [100 * (moved / ms) / (copied / copy) for ms in (eager, compiled)]
        totals[0] += per_step * k_eager
        totals[1] += per_step * k_compiled
        print(f"{label:>40} {'x'.join(map(str, shape)):>13} {str(dtype)[6:]:>8} {eager * 1e3:9.1f} "
              f"{compiled * 1e3:9.1f} {pct[0]:6.1f}% {pct[1]:8.1f}% {same!s:>4} {k_eager * 1e3:17.1f} "
              f"{k_compiled * 1e3:9.1f}")  # fmt: skip
    print(
        f"one block's casts per step, GPU time of their kernels: eager {totals[0]:.3f} ms, compiled {totals[1]:.3f} ms"
    )


if __name__ == "__main__":
    main()
