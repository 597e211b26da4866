"""Check that torch.compile'd FP8Linear matches eager: bit for bit, bias grad up to fp32 summation order.

    python benchmarks/check_compile.py            # cpu, and cuda when present; aot_eager and inductor

Prints one line per (device, backend, step) with the largest difference of each tensor; exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import sys

import torch

from lightning_fp8 import FP8Linear


def check(device: str, backend: str, steps: int = 3) -> bool:
    torch.manual_seed(0)
    eager = FP8Linear(32, 48, device=device)
    src = FP8Linear(32, 48, device=device)
    src.load_state_dict(eager.state_dict())
    compiled = torch.compile(src, fullgraph=True, backend=backend)
    ok = True
    for step in range(steps):
        x1 = torch.randn(24, 32, device=device, requires_grad=True)
        x2 = x1.detach().clone().requires_grad_()
        y1, y2 = eager(x1), compiled(x2)
        y1.square().sum().backward()
        y2.square().sum().backward()
        pairs = {
            "y": (y1, y2),
            "dx": (x1.grad, x2.grad),
            "dw": (eager.weight.grad, src.weight.grad),
            "db": (eager.bias.grad, src.bias.grad),
            "grad_scale": (eager.fp8_scaling["grad_output"].scale, src.fp8_scaling["grad_output"].scale),
            "input_scale": (eager.fp8_scaling["input"].scale, src.fp8_scaling["input"].scale),
        }
        diffs = {k: (a.float() - b.float()).abs().max().item() for k, (a, b) in pairs.items()}
        # Everything is bit-exact except the bias gradient, a plain fp32 sum that inductor may reorder.
        ok &= all(d == 0 for k, d in diffs.items() if k != "db")
        ok &= torch.allclose(*pairs["db"], rtol=1e-5, atol=1e-5)
        print(device, backend, step, " ".join(f"{k}={v:.3g}" for k, v in diffs.items()), flush=True)
        eager.zero_grad()
        src.zero_grad()
    return ok


def main() -> None:
    # no options; --help shows the docstring (the checks ran instead)
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    results = [check(d, b) for d in devices for b in ("aot_eager", "inductor")]
    print("torch", torch.__version__, "all equal" if all(results) else "MISMATCH")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
