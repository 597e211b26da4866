"""A tensor- and sequence-parallel FP8 GPT layer: FP8 activation communication against bf16 (issue 9).

Run with torchrun on one host (NVLink multicast stays off: the script sets NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless they are set)::

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py              # TP=2, d=8192, seq=8192, batch 1 (NCCL)
    torchrun --nproc-per-node 4 benchmarks/bench_tp.py              # TP=4
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --toy        # CPU, gloo, tiny shapes (a smoke test)

One GPT layer (LayerNorm, fused per-head QKV, causal SDPA, output projection, LayerNorm, 4x GELU MLP), bf16
parameters and activations, Megatron tensor + sequence parallel: activations enter and leave the layer sharded on
the sequence (as between layers of a model), norms run on shards, QKV and fc are column-parallel, the projections
row-parallel. Modes:

- ``fp8-comm``: FP8Linear, FP8 all-gathers before QKV/fc, FP8 reduce-scatter of their input gradients (all-to-all
  of E5M2 + fp32 sum), FP8 all-gather of the projections' output gradients; bf16 reduce-scatter of their outputs;
- ``bf16-comm``: the same FP8 GEMMs, every sequence-parallel collective in bf16 (the full tensor is cast after the
  all-gather);
- ``bf16``: nn.Linear under torch's own ColwiseParallel / RowwiseParallel / SequenceParallel (no FP8 at all).

Per mode (rank 0 prints, one JSON line each, then a table): median time of a forward+backward of the layer
(CUDA events, after warm-up), the communication time inside it (GPU: NCCL kernel time from torch.profiler, which
includes waiting for peers; CPU: wall time of each collective call), the bytes each rank hands to collectives, and
the SQNR of the output against the bf16 mode. Also the amax synchronization: one batched MAX all-reduce of the
delayed-scaling amaxes, timed for this layer and for 48 layers' worth of scaling states.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_fp8 import FP8Linear, convert_to_fp8
from lightning_fp8.distributed.amax_sync import AmaxSync, enable_fp8_amax_sync
from lightning_fp8.distributed.tensor_parallel import FP8ColwiseParallel, FP8RowwiseParallel

MODES = ("fp8-comm", "bf16-comm", "bf16")


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.qkv = nn.Linear(d, 3 * d)  # output laid out per head [q_h k_h v_h]: a column shard holds whole heads
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)  # (b, local heads, s, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def build(mode: str, args, mesh, device) -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank and in every mode
    with torch.device(device):
        block = Block(args.d, args.heads).to(torch.bfloat16)
    seq = Shard(1)
    if mode == "bf16":
        col = lambda: ColwiseParallel(input_layouts=seq)
        row = lambda: RowwiseParallel(output_layouts=seq)
    else:
        convert_to_fp8(block)
        fp8_comm = mode == "fp8-comm"
        col = lambda: FP8ColwiseParallel(input_layouts=seq, fp8_comm=fp8_comm)
        row = lambda: FP8RowwiseParallel(output_layouts=seq, fp8_comm=fp8_comm)
    plan = {"ln_1": SequenceParallel(), "attn.qkv": col(), "attn.proj": row(), "ln_2": SequenceParallel()}
    plan |= {"mlp.0": col(), "mlp.2": row()}
    parallelize_module(block, mesh, plan)
    if mode != "bf16":
        enable_fp8_amax_sync(block)
    return block


class CollectiveLog(TorchDispatchMode):
    """Bytes each collective is handed (its input), and its wall time (meaningful on CPU: gloo is synchronous)."""

    _INPUT_ARG = {"_allgather_base_": 1, "_reduce_scatter_base_": 1, "alltoall_base_": 1, "allreduce_": 0}

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace not in ("c10d", "_c10d_functional") or name in ("wait_tensor", "_wrap_tensor_autograd"):
            return func(*args, **(kwargs or {}))
        inputs = args[self._INPUT_ARG.get(name, 0)]
        for t in inputs if isinstance(inputs, (list, tuple)) else [inputs]:
            self.bytes[name] += t.numel() * t.element_size()
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds += time.perf_counter() - t0
        return out


def median_ms(fn, device, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def nccl_ms(fn, iters: int) -> float:
    """NCCL kernel time per call of ``fn`` (torch.profiler, CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total_us = 0.0
    for event in prof.key_averages():  # GPU kernels only: CPU-side "nccl:..." ranges would count them twice
        if event.device_type == torch.autograd.DeviceType.CUDA and "nccl" in event.key.lower():
            total_us += getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
    return total_us / 1e3 / iters


def bench_mode(mode: str, args, mesh, device, x_local, dy_local) -> tuple[dict, torch.Tensor]:
    block = build(mode, args, mesh, device)
    x = x_local.clone().requires_grad_()

    def step():
        block(x).backward(dy_local)
        x.grad = None
        for p in block.parameters():
            p.grad = None

    layer_ms = median_ms(step, device, args.iters, args.warmup)
    log = CollectiveLog()
    with log:
        step()
    comm_ms = nccl_ms(step, args.iters) if device.type == "cuda" else log.seconds * 1e3
    with torch.no_grad():
        out = block(x_local).float()
    row = {"mode": mode, "layer_ms": layer_ms, "comm_ms": comm_ms, "comm_bytes": dict(log.bytes)}
    if mode != "bf16":
        sync = AmaxSync(block)
        row["amax_sync_ms"] = median_ms(sync.sync, device, args.iters, args.warmup)
        row["amax_sync_states"] = len(sync)
    return row, out


def bench_amax_sync_48_layers(device, args) -> float:
    # 48 layers x 4 FP8 linears x 2 delayed roles (input, grad_output) = 384 scaling states, synced in one collective.
    with torch.device(device):
        layers = nn.ModuleList(FP8Linear(16, 16) for _ in range(48 * 4))
    for layer in layers:  # give them some history to reduce
        for state in layer.fp8_scaling.values():
            state.amax_history.uniform_(0, 10)
    return median_ms(AmaxSync(layers).sync, device, args.iters, args.warmup)


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (10 * torch.log10(ref.double().square().sum() / (x.double() - ref.double()).square().sum())).item()


def main() -> None:
    from gpu_args import at_least_0, count

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=count, default=8192)
    p.add_argument("--heads", type=count, default=64)
    p.add_argument("--seq", type=count, default=8192)
    p.add_argument("--batch", type=count, default=1)
    p.add_argument("--iters", type=count, default=10)
    p.add_argument("--warmup", type=at_least_0, default=3)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--toy", action="store_true", help="CPU, gloo, d=256, seq=64, batch 2 (a smoke test)")
    args = p.parse_args()
    if args.toy:
        args.d, args.heads, args.seq, args.batch, args.iters, args.warmup = 256, 4, 64, 2, 3, 1
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    use_cuda = torch.cuda.is_available() and not args.toy
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (tp,))
    if args.seq % tp:
        raise SystemExit(f"--seq {args.seq} must divide by the tensor-parallel size {tp}")

    gen = torch.Generator(device=device).manual_seed(1)
    shard = (args.batch, args.seq // tp, args.d)
    x_local = torch.randn(shard, generator=gen, device=device, dtype=torch.bfloat16)  # this rank's sequence shard
    dy_local = torch.randn(shard, generator=gen, device=device, dtype=torch.bfloat16)
    name = torch.cuda.get_device_name() if use_cuda else "cpu (emulated FP8 GEMMs)"
    if rank == 0:
        print(f"# bench_tp  {datetime.datetime.now():%Y-%m-%d %H:%M}  {tp} x {name}  torch {torch.__version__}")
        print(f"# one GPT layer, d={args.d} heads={args.heads} seq={args.seq} batch={args.batch}, bf16, TP+SP={tp}")
    rows, outs = [], {}
    for mode in args.modes:
        row, outs[mode] = bench_mode(mode, args, mesh, device, x_local, dy_local)
        row |= {"tp": tp, "d": args.d, "seq": args.seq, "batch": args.batch, "device": name}
        rows.append(row)
        if use_cuda:
            torch.cuda.empty_cache()
    if "bf16" in outs:
        for row in rows:
            row["out_sqnr_db_vs_bf16"] = sqnr_db(outs[row["mode"]], outs["bf16"])
    amax_48 = bench_amax_sync_48_layers(device, args)
    if rank == 0:
        for row in rows:
            print(json.dumps(row))
        print(json.dumps({"amax_sync_ms_48_layers": amax_48, "states": 48 * 4 * 2, "tp": tp}))
        print(
            f"\n{'mode':10s} {'layer ms':>9s} {'comm ms':>8s} {'comm MB/rank':>12s} {'amax sync ms':>12s} {'SQNR':>6s}"
        )
        for row in rows:
            mb = sum(row["comm_bytes"].values()) / 2**20
            sync = f"{row['amax_sync_ms']:12.3f}" if "amax_sync_ms" in row else f"{'-':>12s}"
            db = row.get("out_sqnr_db_vs_bf16", float("nan"))
            print(f"{row['mode']:10s} {row['layer_ms']:9.2f} {row['comm_ms']:8.2f} {mb:12.1f} {sync} {db:6.1f}")
        print(f"amax sync of 48 layers ({48 * 8} scaling states, one all-reduce): {amax_48:.3f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
