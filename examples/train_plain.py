"""Train the GPT with plain PyTorch and FP8-LM: no trainer, every FP8 piece in sight.

    python examples/train_plain.py                     # toy size on CPU, "small" on a GPU
    python examples/train_plain.py --max-steps 100 --out runs/plain

The four FP8-LM pieces, in the order they appear below: ``convert_to_fp8`` (FP8 GEMMs), ``FP8GradScaler``
(the automatic gradient scale mu), ``FP8AdamW`` (FP8/fp16 optimizer states), and ``fp8_state_dict`` (the
scaling state in the checkpoint). ``fp8_stats`` reads the scales for the log line.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from cli import float_at_least, int_at_least, output_dir
from corpus import Corpus, add_data_arguments, corpus_from_args, make_loaders
from gpt import GPT, GPTConfig, evaluate, fp8_module_filter
from torch.utils.data import DataLoader

from lightning_fp8 import (
    FP8AdamW,
    FP8GradScaler,
    FP8Recipe,
    convert_to_fp8,
    fp8_state_dict,
    fp8_stats,
    load_fp8_state_dict,
)


def batches(loader: DataLoader, device: torch.device):
    """Endless (x, y) batches on ``device``, reshuffled every pass over the data."""
    while True:
        yield from on_device(loader, device)


def on_device(loader: DataLoader, device: torch.device):
    """The loader's (x, y) batches on ``device``."""
    for x, y in loader:
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, GPTConfig, Corpus]:
    """The arguments, and the model and data they name: a model or data that cannot be is a usage error now."""
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    count = int_at_least(1)  # sizes and step counts
    p.add_argument("--preset", default="small" if gpu else "toy", choices=["toy", "small", "gpt125m"])
    p.add_argument("--width", type=count)
    p.add_argument("--depth", type=count)
    p.add_argument("--heads", type=count)
    p.add_argument("--seq-len", type=count)
    p.add_argument("--batch-size", type=count, default=32 if gpu else 16)
    p.add_argument("--max-steps", type=count, default=1000 if gpu else 200)
    p.add_argument("--lr", type=float_at_least(0), default=1e-3 if gpu else 2e-3)
    p.add_argument("--recipe", default="fp8-lm", choices=FP8Recipe.names(), help="an FP8 recipe name")
    p.add_argument("--val-batches", type=count, default=20)
    add_data_arguments(p)  # --data, --max-bytes, --val-fraction
    p.add_argument("--out", type=output_dir, default=Path("runs/train_plain"))
    args = p.parse_args(argv)
    try:  # a model or data that cannot be: a usage error before anything trains, not a traceback
        cfg = GPTConfig.preset(args.preset, width=args.width, depth=args.depth, heads=args.heads, seq_len=args.seq_len)
        corpus = corpus_from_args(args, cfg.seq_len)
    except ValueError as err:
        p.error(str(err))
    return args, cfg, corpus


def train(
    model: GPT,
    optimizer: FP8AdamW,
    scaler: FP8GradScaler,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    data: Iterator[tuple[torch.Tensor, torch.Tensor]],
    args: argparse.Namespace,
) -> list[float]:
    """``--max-steps`` optimizer steps on ``data``'s batches, a log line every tenth of them; returns the losses."""
    device = next(model.parameters()).device
    tokens_per_step = args.batch_size * model.cfg.seq_len
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(1, args.max_steps + 1):
        x, y = next(data)
        # --8<-- [start:step]
        with torch.autocast(device.type, dtype=torch.bfloat16):  # the ops that are not FP8 GEMMs run in bf16
            _, loss = model(x, y)
        scaler.scale_loss(loss).backward()  # loss * mu: small gradients stay representable in FP8
        # With its grad_scaler, FP8AdamW.step() is scaler.step(optimizer) + scaler.update(): it unscales by mu,
        # skips the step (on every rank) if a gradient was non-finite, and halves or doubles mu.
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # --8<-- [end:step]
        schedule.step()
        losses.append(loss.item())
        if step % max(1, args.max_steps // 10) == 0 or step == args.max_steps:
            s = fp8_stats(model, grad_scaler=scaler)
            rate = step * tokens_per_step / (time.perf_counter() - start)
            # No FP8 layer (feature sizes not multiples of 16 stay in high precision): no grad_output scales
            g = s["summary"].get("grad_output")
            scales = f"2^{math.log2(g['scale_min']):.0f}..2^{math.log2(g['scale_max']):.0f}" if g else "none"
            print(
                f"step {step:5d} | loss {sum(losses[-10:]) / len(losses[-10:]):.4f} | {rate:,.0f} tok/s "
                f"| mu {s['grad_scaler']['scale']:g} | skipped {s['grad_scaler']['skipped_steps']} "
                f"| grad_output scales {scales}"
            )
    return losses


def save_and_reload(model: GPT, optimizer: FP8AdamW, scaler: FP8GradScaler, out: Path) -> Path:
    """Write ``out/checkpoint.pt`` and load it back into the model, optimizer and scaler (what a resume does)."""
    # --8<-- [start:checkpoint]
    out.mkdir(parents=True, exist_ok=True)
    path, partial = out / "checkpoint.pt", out / "checkpoint.pt.partial"
    torch.save(
        {
            "model": model.state_dict(),  # the same keys as the unconverted GPT
            "fp8": fp8_state_dict(model),  # scales and amax histories, for resuming
            "optimizer": optimizer.state_dict(),
            "grad_scaler": scaler.state_dict(),
        },
        partial,
    )
    os.replace(partial, path)  # whole or not at all: a save cut short leaves the earlier checkpoint as it was
    ckpt = torch.load(path, weights_only=True)  # plain tensors and numbers: no pickled classes
    model.load_state_dict(ckpt["model"])
    load_fp8_state_dict(model, ckpt["fp8"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scaler.load_state_dict(ckpt["grad_scaler"])
    # --8<-- [end:checkpoint]
    return path


def main(argv: list[str] | None = None) -> dict[str, float]:
    args, cfg, corpus = parse_args(argv)
    torch.manual_seed(1234)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_loader, val_loader = make_loaders(corpus, cfg.seq_len, args.batch_size)

    # --8<-- [start:setup]
    model = GPT(cfg).to(device)
    convert_to_fp8(model, args.recipe, module_filter_fn=fp8_module_filter)  # nn.Linear -> FP8Linear, in place
    scaler = FP8GradScaler(model=model)  # mu; with the model it keeps delayed grad scales exact when mu changes
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = FP8AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        recipe=args.recipe,
        grad_scaler=scaler,
    )
    # --8<-- [end:setup]
    warmup = max(1, args.max_steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    print(f"{model.num_params() / 1e6:.1f}M parameters, recipe {args.recipe}, {device}")

    losses = train(model, optimizer, scaler, schedule, batches(train_loader, device), args)
    path = save_and_reload(model, optimizer, scaler, args.out)
    with torch.autocast(device.type, dtype=torch.bfloat16):  # as in training
        val_loss = evaluate(model, on_device(val_loader, device), args.val_batches).item()
    final = {"final_train_loss": sum(losses[-20:]) / len(losses[-20:]), "final_val_loss": val_loss}
    print(f"final train loss {final['final_train_loss']:.4f} | final val loss {val_loss:.4f} | checkpoint {path}")
    return final


if __name__ == "__main__":
    main()
