"""Run by test_fsdp2.py under torchrun with two CPU processes: lightning_fp8's Accelerator on an FSDP2 model.

Accelerate 1.15 only sets up FSDP on GPUs (``DistributedType.FSDP`` is chosen for multi-GPU runs only), so on
CPU this script declares the FSDP2 plugin and then marks the process state as FSDP, the one thing Accelerate
would have done on GPUs. Everything after that is Accelerate's own FSDP2 path (``fully_shard`` per Block).

It checks the prepared model's forward against the unsharded FP8 model, then runs STEPS full training steps
(forward, ``accelerator.backward``, ``optimizer.step``, ``zero_grad``) beside an unsharded FP8AdamW reference.
"""

import copy
import sys
from pathlib import Path

import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]
from gpt import GPT, GPTConfig  # noqa: E402

from lightning_fp8 import E4M3, FP8Linear, compute_scale, convert_to_fp8  # noqa: E402
from lightning_fp8.accelerate import Accelerator  # noqa: E402
from lightning_fp8.optim import FP8AdamW  # noqa: E402
from tests.distributed.launch import exit_worker  # noqa: E402

LR, WEIGHT_DECAY, STEPS = 1e-3, 0.05, 4


def fsdp2_accelerator() -> Accelerator:
    """lightning_fp8's Accelerator with FP8-LM on FSDP2 (``fully_shard`` per Block), declared on CPU."""
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]
    )
    accelerator = Accelerator(fsdp_plugin=plugin, fp8_lm_recipe="fp8-lm")
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2
    return accelerator


def main() -> None:
    accelerator = fsdp2_accelerator()

    torch.manual_seed(0)
    model = GPT(GPTConfig(depth=2, width=64, heads=2, seq_len=32))
    reference = convert_to_fp8(copy.deepcopy(model), "fp8-lm", lambda m, fqn: not fqn.endswith("lm_head"))
    reference_model = copy.deepcopy(reference)  # trained unsharded in this process, for train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    report = accelerator.fp8_report
    assert report["converted_layers"] == 8 and report["high_precision_linears"] == ["lm_head"], report
    assert "FP8 weight all-gather (8 weights)" in report["fsdp2_collectives"], report
    inner = optimizer.optimizer
    assert isinstance(inner, FP8AdamW) and scheduler.scheduler.optimizer is inner
    assert inner.param_groups[0]["weight_decay"] == 0.05
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert len(layers) == 8 and all(type(m.weight).__name__ == "DTensor" for m in layers)
    # FP8AdamW was built on the shards: the FP8 weights are the DTensor parameters it got told about.
    assert {id(m.weight) for m in layers} <= inner._extra_fp8_params

    # The weights come through the FP8 all-gather on the E4M3 grid of their global scale, which the layers' own
    # weight cast (current scaling) reproduces: the sharded forward equals the unsharded one.
    on_grid = []

    def check_gathered_weight(layer: FP8Linear, args: tuple) -> None:
        w = layer.weight.detach().float()  # unsharded inside forward
        scale = compute_scale(w.abs().max(), E4M3)
        on_grid.append(torch.equal((w * scale).to(E4M3).float() / scale, w))

    for layer in layers:
        layer.register_forward_pre_hook(check_gathered_weight)
    x = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(accelerator.process_index))
    with torch.no_grad():
        logits, _ = model(x)
        expected, _ = reference(x)
    assert on_grid == [True] * 8, on_grid  # the weights arrived as E4M3 values (fp32 weights are not on that grid)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    print(f"rank {accelerator.process_index}: fsdp2 forward ok", flush=True)
    train(accelerator, model, optimizer, scheduler, reference_model)
    print(f"rank {accelerator.process_index}: fsdp2 ok", flush=True)


# FSDP2 path vs the unsharded reference, loss per step: both are FP8-LM (same FP8 GEMMs, FP8AdamW O2), but the
# sharded gradients are summed from two E5M2 reduce-scatter inputs and the optimizer's low-precision states get
# one power-of-two scale per shard instead of per tensor. Observed gap <= 7e-4 over 4 steps; allowed 5e-3, which
# is still far below one step's loss decrease (> 0.1 here), so a missing or wrong update fails the comparison.
LOSS_ATOL = 5e-3


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s fixed batch (3 windows of 31 tokens): the same on every step, so the loss must fall."""
    tokens = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(100 + rank))
    return tokens[:, :-1], tokens[:, 1:]


def train(accelerator, model, optimizer, scheduler, reference_model) -> None:
    """STEPS full steps on the shards, beside the same steps of an unsharded model on both ranks' batches."""
    world, rank = accelerator.num_processes, accelerator.process_index
    ref_optimizer = FP8AdamW(reference_model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    x, y = batch(rank)
    all_x, all_y = (torch.cat(t) for t in zip(*(batch(r) for r in range(world)), strict=True))
    losses, ref_losses = [], []
    for _ in range(STEPS):
        _, loss = model(x, y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.detach())

        _, ref_loss = reference_model(all_x, all_y)
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ref_losses.append(ref_loss.detach())

    # Equal local batch sizes: the mean of the ranks' losses is the loss of the global batch the reference sees.
    mean = torch.stack(losses)
    torch.distributed.all_reduce(mean)
    mean /= world
    ref = torch.stack(ref_losses)
    print(f"rank {rank}: losses {mean.tolist()} reference {ref.tolist()}", flush=True)
    assert torch.isfinite(mean).all(), mean
    assert (mean.diff() < 0).all(), mean
    torch.testing.assert_close(mean, ref, rtol=0, atol=LOSS_ATOL)

    # Both ranks hold the same view of the run: the same global losses, mu and optimizer step count.
    scaler = accelerator.fp8_grad_scaler
    assert scaler.skipped_steps == 0, scaler.history
    inner = optimizer.optimizer
    summary = torch.cat([mean, scaler.scale.view(1), inner.state[inner.param_groups[0]["params"][0]]["step"].view(1)])
    gathered = [torch.empty_like(summary) for _ in range(world)]
    torch.distributed.all_gather(gathered, summary)
    assert all(torch.equal(g, summary) for g in gathered), gathered
    assert summary[-1].item() == STEPS, summary

    # FP8AdamW stepped on the shards: the FP8 weights' first moments are E4M3 DTensors sharded like the weights.
    for layer in (m for m in model.modules() if isinstance(m, FP8Linear)):
        exp_avg = inner.state[layer.weight]["exp_avg"]
        assert type(exp_avg).__name__ == "DTensor" and exp_avg.dtype == E4M3, (type(exp_avg), exp_avg.dtype)
        assert exp_avg.to_local().shape == layer.weight.to_local().shape
        assert exp_avg.to_local().float().abs().max() > 0


if __name__ == "__main__":
    main()
    exit_worker()  # every rank done: leave without the interpreter's teardown (see tests/distributed/launch.py)
