"""Run by test_tensor_parallel.py under torchrun with two CPU processes: lightning_fp8's Accelerator with
Accelerate's tensor-parallel config (``ParallelismConfig(tp_size=2)``, from the launch's environment).

Accelerate 1.15 accepts a ParallelismConfig only on GPUs (its check lists the MULTI_<device> types), so on CPU this
script lets that one check see a multi-device run; every other check and all of Accelerate's tensor-parallel
preparation run as they would on GPUs. Each rank initializes its model from its own seed: prepare() must make the
ranks agree (rank 0's weights) before sharding.

The prepared model trains beside the same FP8 model in one process (rank 0's initial weights, the same batches),
then saves, continues, reloads and repeats the continuation, which must be bit-identical.
"""

import sys
from pathlib import Path

import torch
from accelerate.parallelism_config import ParallelismConfig

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]
from gpt import GPT, GPTConfig  # noqa: E402

from lightning_fp8 import FP8Linear, convert_to_fp8  # noqa: E402
from lightning_fp8.accelerate import Accelerator  # noqa: E402
from lightning_fp8.optim import FP8AdamW  # noqa: E402
from tests.distributed.launch import exit_worker  # noqa: E402

LR, WEIGHT_DECAY, MAX_NORM = 3e-3, 0.05, 1.0
CONFIG = GPTConfig(depth=2, width=64, heads=4, seq_len=32, vocab_size=256)
# The tensor-parallel model and the single-process one start identical and see the same data, but each rank casts
# its weight shard and stores its optimizer states with the shard's own power-of-two scales, and the sequence-
# parallel activation gradients travel in E5M2: tests/distributed/test_tp_optim.py measures < 0.2% loss difference
# over 10 steps from that; 1% here too.
LOSS_RTOL = 0.01
# The clipped gradient norm moves more: the sequence-parallel input gradients are E5M2 (0.07% off at the first step,
# where the weights are equal) and the weights drift apart a little more each step (1.2% at the third, observed).
GRAD_NORM_RTOL = 0.03
_validate = ParallelismConfig._validate_accelerator


def _validate_on_cpu(self, accelerator):
    type(accelerator).multi_device = property(lambda a: True)
    try:
        _validate(self, accelerator)
    finally:
        del type(accelerator).multi_device


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, t.contiguous())
    return out


def main(checkpoint_dir: str, sharded_by: str) -> None:
    ParallelismConfig._validate_accelerator = _validate_on_cpu
    accelerator = Accelerator()
    rank = accelerator.process_index
    assert accelerator.parallelism_config.tp_size == 2

    torch.manual_seed(0)
    reference = convert_to_fp8(GPT(CONFIG), "fp8-lm", lambda m, fqn: not fqn.endswith("lm_head"))
    if sharded_by == "accelerator":
        torch.manual_seed(rank)  # rank 1 starts from other weights: prepare() must take rank 0's
        model = GPT(CONFIG)
        model.register_buffer("noise", torch.randn(8), persistent=False)  # and other buffers (only the weights were)
    else:  # LIGHTNING_FP8_TP_PLAN=none: the script converts and shards, on Accelerate's mesh
        from lightning_fp8.distributed.tensor_parallel import apply_fp8_tensor_parallel

        torch.manual_seed(0)
        model = convert_to_fp8(GPT(CONFIG), "fp8-lm", lambda m, fqn: not fqn.endswith("lm_head"))
        apply_fp8_tensor_parallel(model, accelerator.torch_device_mesh["tp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    tokens = torch.randint(0, 256, (24, 33), generator=torch.Generator().manual_seed(5))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    report = accelerator.fp8_report
    assert report["converted_layers"] == 8, report
    if sharded_by == "accelerator":
        assert "plan 'gpt' over tp_size=2" in report["tensor_parallel"], report
    else:
        assert "tensor_parallel" not in report and model.tp_size == 2, report
    assert report["optimizer"] == "AdamW -> FP8AdamW", report
    inner = optimizer.optimizer
    assert isinstance(inner, FP8AdamW) and scheduler.scheduler.optimizer is inner
    layers = {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    placements = {name: str(m.weight.placements) for name, m in layers.items()}
    assert placements["blocks.0.attn.qkv"] == "(Shard(dim=0),)", placements
    assert placements["blocks.0.mlp.proj"] == "(Shard(dim=1),)", placements
    # The optimizer holds exactly the sharded parameters, FP8 weights at O2 (FP8 first moment after a step).
    assert [id(p) for g in inner.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]

    if sharded_by == "accelerator":
        noise = _gathered(model.noise)
        assert torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], torch.zeros(8)), noise
    # rank 0's weights everywhere: replicated parameters equal, shards cut from rank 0's (= the reference's) weights
    for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        assert torch.equal(full.detach(), ref.detach()), name

    batches = list(loader)
    assert len(batches) == 6, len(batches)  # every rank of the tensor-parallel group gets every batch
    assert all(torch.equal(a, b) for a, b in zip(*_gathered(batches[0][0]), strict=False))
    losses, norms = train(accelerator, model, optimizer, scheduler, batches[:3])
    ref_losses, ref_norms = train_reference(reference, batches[:3])
    print(f"rank {rank}: losses {losses} norms {norms} reference {ref_losses} {ref_norms}", flush=True)
    assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL), (losses, ref_losses)
    assert torch.allclose(torch.tensor(norms), torch.tensor(ref_norms), rtol=GRAD_NORM_RTOL), (norms, ref_norms)
    assert inner.state[layers["blocks.0.attn.qkv"].weight]["exp_avg"].dtype == torch.float8_e4m3fn
    print(f"rank {rank}: tp train ok", flush=True)

    check_resume(accelerator, model, optimizer, scheduler, batches[3:], checkpoint_dir)
    print(f"rank {rank}: tp checkpoint ok", flush=True)


def train(accelerator, model, optimizer, scheduler, batches) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for x, y in batches:
        _, loss = model(x, y)
        accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms


def train_reference(reference, batches) -> tuple[list[float], list[float]]:
    opt = FP8AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for x, y in batches:
        _, loss = reference(x, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def check_resume(accelerator, model, optimizer, scheduler, batches, checkpoint_dir: str) -> None:
    accelerator.save_state(checkpoint_dir)
    full = {k: v.detach().clone() for k, v in accelerator.get_state_dict(model).items()}
    continued = train(accelerator, model, optimizer, scheduler, batches)
    accelerator.load_state(checkpoint_dir)
    resumed = train(accelerator, model, optimizer, scheduler, batches)
    assert resumed == continued, (resumed, continued)

    # The model file holds the full weights (plain tensors): it loads into an unsharded GPT.
    saved = torch.load(Path(checkpoint_dir) / "pytorch_model.bin", weights_only=True)
    assert all(not hasattr(v, "placements") for v in saved.values())
    assert all(torch.equal(saved[k], full[k]) for k in saved), [k for k in saved if not torch.equal(saved[k], full[k])]
    plain = GPT(CONFIG)
    plain.load_state_dict(saved, strict=False)  # the tied head was saved once, under wte.weight
    assert torch.equal(plain.lm_head.weight, full["wte.weight"])
    assert torch.load(Path(checkpoint_dir) / "optimizer.bin", weights_only=True)["groups"][0]["lr"] == LR


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_worker()  # every rank done: leave without the interpreter's teardown (see tests/distributed/launch.py)
