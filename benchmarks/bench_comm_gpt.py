"""The GPT training steps of bench_comm.py (``--gpt``): DDP and FSDP2 steps of a ~1B-parameter GPT with bf16 and FP8
gradient communication. ``bench_gpt`` is called by bench_comm.py with its ``log`` and ``timed``."""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations as objects.
import torch
import torch.distributed as dist
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def gpt_step_fn(model: nn.Module, args, device: torch.device):
    """One training step: forward, backward (where the gradient communication runs), AdamW step."""
    g = torch.Generator(device=device).manual_seed(dist.get_rank())
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(idx)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), idx.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def new_gpt(args, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):  # initialized on the GPU: a 1B-parameter init on the CPU takes many seconds
        model = GPT(args.vocab, args.d, args.layers, args.heads, args.seq)
    if args.fp8_linear:
        from lightning_fp8 import convert_to_fp8

        convert_to_fp8(model)
    return model


def _bf16_hook(group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    half = buffer.bfloat16()
    dist.all_reduce(half, group=group)
    buffer.copy_(half.float() / dist.get_world_size(group))
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def _gpt_variant(kind: str, name: str, build, args, device, rows: list[tuple], log, timed) -> None:
    try:
        model = build()
        ms = timed(gpt_step_fn(model, args, device), args.gpt_iters, args.warmup, device)
        rows.append((kind, name, ms, float("nan"), ""))
        log(f"  {kind} {name:<44} {ms:9.1f} ms")
        del model
    except Exception as e:  # report and go on: the other variants still run
        log(f"  {kind} {name}: FAILED {type(e).__name__}: {e}")
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_gpt(args, device: torch.device, rows: list[tuple], log, timed) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_fp8.distributed import FP8CommState, enable_fp8_fsdp2, fp8_allreduce_hook

    with torch.device("meta"):
        n_params = sum(p.numel() for p in GPT(args.vocab, args.d, args.layers, args.heads, args.seq).parameters())
    log(
        f"GPT training step (forward, backward, AdamW): d={args.d} layers={args.layers} vocab={args.vocab} "
        f"seq={args.seq} batch={args.batch} per rank ({n_params / 1e9:.2f}B parameters, fp8_linear={args.fp8_linear})"
    )
    bf16_hook = bf16_compress_hook if dist.get_backend() == "nccl" else _bf16_hook  # torch's hook is NCCL-only

    def ddp(hook, state, bucket_mb):
        def build():
            model = DDP(new_gpt(args, device), device_ids=[device.index] if device.type == "cuda" else None,
                        bucket_cap_mb=bucket_mb)  # fmt: skip
            if hook is not None:
                model.register_comm_hook(state, hook)
            return model

        return build

    for bucket_mb in args.bucket_mb:
        # FP8CommState checks its backend when built: the native float8 all-reduce is NCCL's only.
        algorithms = ("auto", "portable", *(("native",) if dist.get_backend() == "nccl" else ()), "gather")
        for name, hook, state in (
            ("fp32 all_reduce", None, None),
            ("bf16 compress hook", bf16_hook, dist.group.WORLD),
            *((f"FP8 hook ({a})", fp8_allreduce_hook, FP8CommState(algorithm=a)) for a in algorithms),
        ):
            label = f"{name}, buckets {bucket_mb} MB"
            _gpt_variant("DDP step", label, ddp(hook, state, bucket_mb), args, device, rows, log, timed)

    def fsdp(fp8: bool):
        def build():
            model = new_gpt(args, device)
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            for block in model.blocks:
                fully_shard(block, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            if fp8:
                enable_fp8_fsdp2(model, weight_all_gather=args.fp8_linear)
            return model

        return build

    _gpt_variant("FSDP2 step", "bf16 reduce_scatter", fsdp(False), args, device, rows, log, timed)
    label = "FP8 reduce_scatter" + (" + FP8 weight all_gather" if args.fp8_linear else "")
    _gpt_variant("FSDP2 step", label, fsdp(True), args, device, rows, log, timed)
