"""The FP8 byte transpose of kernels/transpose.py against torch's ``x.t().contiguous()`` (GPU).

    python benchmarks/bench_transpose.py

Checks byte equality, then times both (median, triton.testing.do_bench); bandwidth counts bytes read + written.
"""

import torch
import triton.testing
from gpu_args import gpu_only_args
from lightning_fp8.kernels.transpose import transpose_2d


def main() -> None:
    gpu_only_args(__doc__)
    print(f"# bench_transpose  {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'shape':>12} {'torch us':>9} {'triton us':>9} {'triton GB/s':>11} {'copy GB/s':>9}")
    for m, n in [(4096, 4096), (4096, 16384), (8192, 8192)]:
        x = torch.randn(m, n, device="cuda").to(torch.float8_e4m3fn)
        assert torch.equal(transpose_2d(x).view(torch.uint8), x.view(torch.uint8).t().contiguous())
        t_torch = triton.testing.do_bench(lambda x=x: x.t().contiguous(), return_mode="median") * 1e3
        t_triton = triton.testing.do_bench(lambda x=x: transpose_2d(x), return_mode="median") * 1e3
        u = x.view(torch.uint8)
        t_copy = triton.testing.do_bench(lambda u=u: u.clone(), return_mode="median") * 1e3
        gbs = 2 * x.numel() / t_triton / 1e3
        print(f"{m:>5}x{n:<6} {t_torch:9.1f} {t_triton:9.1f} {gbs:11.0f} {2 * x.numel() / t_copy / 1e3:9.0f}")


if __name__ == "__main__":
    main()
