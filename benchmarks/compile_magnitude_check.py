"""A compiled FP8Linear pair against the same layers run eagerly, over steps whose input magnitude jumps (x4, x1/16).

Each row is one variant (with/without torch.utils.checkpoint around the second layer, dynamic or static shapes,
aot_eager or inductor); each step prints ``x=`` where the input gradient equals the eager one bit for bit (``x0``: all
zeros, ``x!``: different), then ``=``/``!`` per parameter gradient. Found on the GPU machine (H200, torch 2.11, CUDA,
2026-12-03): steps 2 and 3 gave a zero input gradient in every variant, on torch 2.11's CPU every step did. The cause
was not the magnitude but the output: torch 2.11's dynamo returns every intermediate of an autograd Function's traced
forward as an extra output, and the FP8 layers' fp32 output was also one of them (a ``.to`` of a tensor that had the
dtype already, after the CPU's emulated GEMM, and on the GPU after adding an fp32 bias whenever the token count needed
no padding to 16: steps 2 and 3's 16 rows); its gradient went to the extra output. Fixed in ``ops.narrowed`` and
``ops._scaled_mm_cuda``; tests/core/test_compiled_function_outputs.py checks the cause on any torch version.

    python benchmarks/compile_magnitude_check.py [cuda|cpu]
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_fp8 import FP8Linear

STEPS = [(24, 1.0), (24, 1.0), (16, 4.0), (16, 0.25), (8, 0.25)]  # (rows, input magnitude)
VARIANTS = ("nockpt", "nockpt_static", "ckpt", "ckpt_static", "ckpt_inductor")


def _row(variant: str, device: str) -> str:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(FP8Linear(32, 64), nn.GELU(), FP8Linear(64, 32)).to(device)
    ref = copy.deepcopy(model)
    backend = "inductor" if "inductor" in variant else "aot_eager"
    dynamic = False if "static" in variant else None
    if variant.startswith("nockpt"):
        f = torch.compile(lambda x: model[1:](model[0](x)), backend=backend, dynamic=dynamic)
    else:
        f = torch.compile(lambda x: checkpoint(model[1:], model[0](x), use_reentrant=False), backend=backend,
                          dynamic=dynamic)  # fmt: skip
    out = []
    for i, (rows, magnitude) in enumerate(STEPS):
        x = torch.randn(rows, 32, device=device) * magnitude
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        f(xa).square().mean().backward()
        ref(xb).square().mean().backward()
        mark = "=" if torch.equal(xa.grad, xb.grad) else ("0" if (xa.grad == 0).all() else "!")
        grads = zip(model.parameters(), ref.parameters(), strict=True)
        out.append(f"{i}:x{mark}" + "".join("=" if torch.equal(p.grad, q.grad) else "!" for p, q in grads))
        model.zero_grad()
        ref.zero_grad()
    return f"{variant} " + " ".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The device, checked: ``--help`` and a device torch lacks were tracebacks from ``.to(device)``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("device", nargs="?", choices=["cuda", "cpu"], default=default, help=f"default: {default}")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("device 'cuda': torch.cuda.is_available() is False here; run with cpu")
    return args


if __name__ == "__main__":
    device = parse_args().device
    for variant in VARIANTS:
        print(_row(variant, device), flush=True)
