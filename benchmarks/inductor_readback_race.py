"""Inductor's read-back race, the cause of the twenty-eighth session's NaN (GPU; docs/benchmarks.md, thirtieth session).

    python benchmarks/inductor_readback_race.py

A reduction kernel of inductor that stores a buffer in one loop over the row and loads it back in a later loop (here a
residual add + LayerNorm whose normalized output the backward keeps, then that output times the weight rounded to bf16)
has no barrier between the two loops: the threads that load an element need not be the ones that stored it, and may
read what the memory held before (pytorch/pytorch#190519 adds the barrier to inductor). The kernel below is the one
inductor generated (``results/inductor_ln_kernel_h200_s30.txt``) (torch 2.11, Triton 3.6, H200) for ``blocks.2``'s
LayerNorm of a compiled GPT at d=2048 x 6 when FP8Linear rounded its fp32 input to bf16 first, with its only config
(XBLOCK 2, R0_BLOCK 2048, 16 warps). Its outputs are filled with zeros or with FP8-like bytes (0x79) before each
launch: a race-free kernel gives the same bytes every time. The same source with ``tl.debug_barrier()`` before the
read-back loop is run beside it. What it meant in the step: the read-back loop read the earlier bytes of its fp32
buffer (by their size, a freed FP8 buffer's: ~3e34 as fp32), the FP8 cast of the bf16 result took them into its amax
history, and the next steps' scales collapsed to ~1e-32 (NaN).
"""

from pathlib import Path

import torch
from gpu_args import gpu_only_args
from torch._inductor.async_compile import AsyncCompile

M, N = 16384, 2048
KERNEL = "triton_red_fused__to_copy_add_native_layer_norm_native_layer_norm_backward_view_9"
SOURCE = (Path(__file__).parent / "results" / "inductor_ln_kernel_h200_s30.txt").read_text()
READ_BACK = "    tl.store(out_ptr3 + (x0), tmp28, None)\n"


def launch_all(source: str) -> list:
    kernel = AsyncCompile().triton(KERNEL, source, device_str="cuda")
    kernel = kernel.result() if hasattr(kernel, "result") else kernel
    kernel.precompile()
    return list(kernel.launchers)


def main() -> None:
    gpu_only_args(__doc__)
    print(f"# inductor_readback_race  {torch.cuda.get_device_name()}  torch {torch.__version__}")
    assert READ_BACK in SOURCE
    torch.manual_seed(0)
    x3 = torch.randn(M * N, device="cuda")
    mlp_out = torch.randn(M * N, device="cuda").to(torch.bfloat16)
    weight = 1 + 0.1 * torch.randn(N, device="cuda")
    x_hat = torch.empty(M * N, device="cuda")
    rstd = torch.empty(M, device="cuda")
    y = torch.empty(M * N, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.layer_norm((x3 + mlp_out.float()).view(M, N), (N,), weight, eps=1e-5).to(torch.bfloat16)
    stream = torch.cuda.current_stream().cuda_stream
    print(f"{'kernel':>24} {'config':>34} {'fill':>5} {'launches':>8} {'y off the reference':>20} {'max |y|':>9}")
    barrier = SOURCE.replace(READ_BACK, READ_BACK + "    tl.debug_barrier()\n")
    for label, source in (("inductor's", SOURCE), ("+ barrier", barrier)):
        for launcher in launch_all(source):
            cfg = launcher.config
            for fill in (0x00, 0x79):
                off, biggest = 0, 0.0
                for _ in range(5):
                    for t in (x_hat, rstd, y):
                        t.view(torch.uint8).fill_(fill)
                    launcher(x3, mlp_out, weight, x_hat, rstd, y, M, N, stream=stream)
                    torch.cuda.synchronize()
                    diff = (y.view(M, N).float() - ref.float()).abs()
                    off += int((~(diff <= 0.05)).sum())
                    biggest = max(biggest, float(torch.nan_to_num(y.float().abs(), nan=float("inf")).max()))
                name = f"XBLOCK {cfg.kwargs['XBLOCK']} R0_BLOCK {cfg.kwargs['R0_BLOCK']} warps {cfg.num_warps}"
                print(f"{label:>24} {name:>34} {fill:#5x} {5:>8} {off:>20} {biggest:>9.3g}")


if __name__ == "__main__":
    main()
