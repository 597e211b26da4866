"""Fit the tiny GPT with precision="fp8-lm" on 2 CPU processes (gloo); run by test_distributed.py.

Lightning launches the second process itself by re-running this script (``accelerator="cpu", devices=2``).
Every rank writes ``<out>/rank<r>.json``: its losses, a checksum of its parameters (full, gathered under FSDP),
what the FP8 plugin installed, and the gradient scaler's bookkeeping.

    python tests/integrations/lightning/distributed_fit.py --strategy ddp --out /tmp/run
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

import lightning_fp8  # noqa: E402,F401  (registers precision="fp8-lm", strategy="fsdp_fp8")
from lightning_fp8 import FP8GradScaler, FP8Linear, FP8LMPrecision, convert_to_fp8  # noqa: E402
from lightning_fp8.callbacks import TrainingHealthMonitor  # noqa: E402
from tests.distributed.launch import exit_worker  # noqa: E402
from tests.integrations.lightning.gpt_tiny import Block, CountingTokens, GPTModule  # noqa: E402


class DataParallelGPT(GPTModule):
    """Rank r trains on samples r, r + 2, r + 4...: together the ranks see the single-process batches of 12.

    Step ``s`` always trains on batch ``s`` of this rank (whatever the loader yields), so a resumed run sees the
    same data as an uninterrupted one (Lightning restarts a plain DataLoader's epoch when resuming mid-epoch).
    """

    def train_dataloader(self) -> DataLoader:
        data = CountingTokens(48, self.cfg)
        sampler = DistributedSampler(data, num_replicas=self.trainer.world_size, rank=self.global_rank, shuffle=False)
        loader = DataLoader(data, batch_size=6, sampler=sampler)
        self.batches = list(loader)
        return loader

    def training_step(self, batch, batch_idx):
        return super().training_step(self.batches[self.global_step % len(self.batches)], batch_idx)


class ShardedGPT(DataParallelGPT):
    """For ModelParallelStrategy: FSDP2 (fully_shard) per block and at the root, FP8 layers converted first."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        convert_to_fp8(self.model)  # before sharding: FSDP2 keeps references to the modules it shards
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


# FP8FSDPStrategy(device_mesh=...) of a --device-mesh run (a tuple of process counts), else none.
_DEVICE_MESH: tuple[int, ...] | None = None


def _strategy(name: str):
    if name == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    if name == "fsdp_fp8":
        from lightning_fp8 import FP8FSDPStrategy

        if _DEVICE_MESH is not None:
            return FP8FSDPStrategy(auto_wrap_policy={Block}, device_mesh=_DEVICE_MESH)
        return FP8FSDPStrategy(auto_wrap_policy={Block})
    return name


def _full_params(module: torch.nn.Module, strategy: str) -> list[torch.Tensor]:
    if strategy == "fsdp_fp8":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(module.trainer.strategy.model, writeback=False):
            return [p.detach().clone() for p in module.parameters()]
    return [p.full_tensor() if hasattr(p, "full_tensor") else p for p in module.parameters()]


def _fit(
    strategy: str,
    steps: int,
    seed: int = 0,
    ckpt_path: str | None = None,
    callbacks: list | None = None,
    root_dir: str | None = None,
    optimizer: str = "adamw",
) -> tuple[GPTModule, L.Trainer]:
    torch.manual_seed(seed)
    module = (ShardedGPT if strategy == "model_parallel" else DataParallelGPT)(optimizer=optimizer)
    trainer = L.Trainer(
        precision="fp8-lm",
        accelerator="cpu",
        devices=2,
        strategy=_strategy(strategy),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0 if strategy != "model_parallel" else None,
        use_distributed_sampler=False,
        callbacks=callbacks,
        default_root_dir=root_dir,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer


def _refused_bf16_fallback(out: str, strategy: str = "ddp") -> None:
    """DDP or fsdp_fp8 with ``FP8GradScaler(nonfinite_fallback="bf16")``: fit must refuse it before any step; writes
    each rank's error and the steps it ran to ``<out>/rank<r>.json``."""
    torch.manual_seed(0)
    module = DataParallelGPT()
    plugin = FP8LMPrecision(grad_scaler=FP8GradScaler(nonfinite_fallback=module, fallback_after=1))
    trainer = L.Trainer(
        plugins=[plugin],
        accelerator="cpu",
        devices=2,
        strategy=_strategy(strategy),
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    error = None
    try:
        trainer.fit(module)
    except ValueError as err:
        error = str(err)
    result = {"rank": trainer.global_rank, "error": error, "steps": trainer.global_step, "losses": module.losses}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


class _ManualClipMLP(L.LightningModule):
    # Every parameter in a linear layer that FSDP1 wraps on its own. ``manual``: clip by norm in training_step;
    # otherwise automatic optimization (the Trainer clips).
    def __init__(self, manual: bool = True) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
        self.automatic_optimization = not manual
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.net(batch).square().mean()
        self.losses.append(loss.item())
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt.step()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(16, 32), batch_size=4)


def _manual_norm_clip(out: str) -> None:
    """strategy="fsdp_fp8" with manual optimization clipping by norm in training_step, and the same model with
    automatic optimization clipping at the same norm: each rank's losses and error to ``<out>/rank<r>.json``."""
    from lightning_fp8 import FP8FSDPStrategy

    result = {}
    for manual in (True, False):
        torch.manual_seed(0)
        module = _ManualClipMLP(manual)
        trainer = L.Trainer(
            precision="fp8-lm", accelerator="cpu", devices=2,
            strategy=FP8FSDPStrategy(auto_wrap_policy={torch.nn.Linear}), max_steps=3, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False, **({} if manual else {"gradient_clip_val": 0.05}),
        )  # fmt: skip
        error = None
        try:
            trainer.fit(module)
        except ValueError as err:
            error = str(err)
        result["manual" if manual else "automatic"] = {"error": error, "steps": trainer.global_step,
                                                       "losses": module.losses}  # fmt: skip
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


class _PartlyFrozen(L.LightningModule):
    """Three FP8 layers: ``frozen`` never trains, ``late`` trains from the second epoch on (:class:`_UnfreezeLate`),
    ``head`` throughout. configure_optimizers takes the parameters that require gradients, as finetuning code does."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen, self.late, self.head = (torch.nn.Linear(32, 32) for _ in range(3))
        self.frozen.requires_grad_(False)
        self.head_dtype_at_start = self.late_dtype_at_end = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.late(torch.relu(self.frozen(x)))))

    def training_step(self, batch, batch_idx):
        return self(batch).float().square().mean()

    validation_step = test_step = training_step

    def predict_step(self, batch, batch_idx):
        return self(batch)

    def on_train_start(self) -> None:
        self.head_dtype_at_start = str(self.head.weight.dtype)

    def on_train_end(self) -> None:  # before the plugin's teardown gives the weights their storage back
        self.late_dtype_at_end = str(self.late.weight.dtype)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _unfreeze_late_callback() -> L.Callback:
    from lightning.pytorch.callbacks import BaseFinetuning

    class _UnfreezeLate(BaseFinetuning):
        def freeze_before_training(self, module: _PartlyFrozen) -> None:
            self.freeze(module.late)

        def finetune_function(self, module: _PartlyFrozen, epoch: int, optimizer: torch.optim.Optimizer) -> None:
            if epoch == 1:  # a new param group (lr 1e-3): FP8AdamW adopts the weight now, as on one device
                self.unfreeze_and_add_param_group(module.late, optimizer)

    return _UnfreezeLate()


def _frozen_and_evaluation(out: str) -> None:
    """DDP with FP8 weights that no optimizer trains: ``trainer.validate/test/predict`` without a fit, then a fit with
    a frozen layer and one unfrozen in the second epoch. Writes, per rank, whether each kept its initial weights bit
    for bit, and how the trained ones were held, to ``<out>/rank<r>.json``."""
    torch.manual_seed(0)
    module = _PartlyFrozen()
    initial = {name: value.clone() for name, value in module.state_dict().items()}
    data = DataLoader(torch.randn(16, 32, generator=torch.Generator().manual_seed(0)), batch_size=4)
    kwargs = {"precision": "fp8-lm", "accelerator": "cpu", "devices": 2, "strategy": "ddp", "logger": False,
              "enable_progress_bar": False, "enable_model_summary": False}  # fmt: skip
    evaluation = {}
    for stage in ("validate", "test", "predict"):
        getattr(L.Trainer(**kwargs), stage)(module, data)
        evaluation[stage] = all(torch.equal(initial[n], v) for n, v in module.state_dict().items())
    trainer = L.Trainer(**kwargs, max_epochs=2, enable_checkpointing=False, callbacks=[_unfreeze_late_callback()])
    trainer.fit(module, data)
    path = os.path.join(out, "fit.ckpt")
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["state_dict"]
    state = module.state_dict()
    late_state = trainer.optimizers[0].state[module.late.weight]
    result = {
        "rank": trainer.global_rank,
        "evaluation_kept_weights": evaluation,
        "frozen_kept": all(torch.equal(initial[n], state[n]) for n in ("frozen.weight", "frozen.bias")),
        "frozen_saved_kept": all(torch.equal(initial[n], saved[n]) for n in ("frozen.weight", "frozen.bias")),
        "head_dtype_at_start": module.head_dtype_at_start,
        "late_dtype_at_end": module.late_dtype_at_end,
        "late_exp_avg_dtype": str(late_state["exp_avg"].dtype),
        "late_change": float((state["late.weight"] - initial["late.weight"]).abs().max()),
        "finite": all(bool(torch.isfinite(v).all()) for v in state.values()),
        "comm": trainer.precision_plugin.comm_hooks,
    }
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True, choices=["ddp", "ddp_spawn", "fsdp_fp8", "model_parallel"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--resume", action="store_true", help="also: half the steps, save, resume in a new Trainer")
    parser.add_argument(
        "--health", action="store_true", help="with a TrainingHealthMonitor logging every step, plotting to <out>"
    )
    parser.add_argument("--bf16-fallback", action="store_true", help="only: fit with nonfinite_fallback='bf16'")
    parser.add_argument("--own-fp8adamw", action="store_true", help="configure_optimizers returns an FP8AdamW")
    parser.add_argument("--manual-norm-clip", action="store_true", help="only: fsdp_fp8, manual clip by norm")
    parser.add_argument("--frozen", action="store_true", help="only: ddp, frozen weights and evaluation-only runs")
    parser.add_argument("--device-mesh", help="fsdp_fp8: FP8FSDPStrategy(device_mesh=...), process counts as '2,1'")
    args = parser.parse_args()
    if args.device_mesh:
        global _DEVICE_MESH
        _DEVICE_MESH = tuple(int(size) for size in args.device_mesh.split(","))
    if args.frozen:
        os.makedirs(args.out, exist_ok=True)
        _frozen_and_evaluation(args.out)
        return
    if args.bf16_fallback:
        _refused_bf16_fallback(args.out, args.strategy)
        return
    if args.manual_norm_clip:
        _manual_norm_clip(args.out)
        return

    # The plot goes to the Trainer's log_dir (no logger: default_root_dir), which every rank must ask for.
    health = TrainingHealthMonitor(log_every_n_steps=1) if args.health else None
    optimizer = "fp8adamw" if args.own_fp8adamw else "adamw"
    try:
        module, trainer = _fit(args.strategy, args.steps, callbacks=[health] if health else None, root_dir=args.out,
                               optimizer=optimizer)  # fmt: skip
    except ValueError as error:  # a refusal at setup: each rank reports it
        os.makedirs(args.out, exist_ok=True)
        rank = int(os.environ.get("LOCAL_RANK", 0))
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "error": str(error)}, f)
        return
    resumed_losses = None
    if args.resume:
        half, first = _fit(args.strategy, args.steps // 2)
        path = os.path.join(args.out, "half.ckpt")
        first.save_checkpoint(path)
        resumed, _ = _fit(args.strategy, args.steps, seed=123, ckpt_path=path)
        resumed_losses = resumed.losses
    plugin = trainer.precision_plugin
    params = _full_params(module, args.strategy)
    optimizer = trainer.optimizers[0]
    fp8_weights = [m.weight for m in module.modules() if isinstance(m, FP8Linear)]
    moments = {
        f"{k}:{optimizer.state[w][k].dtype}"
        for w in fp8_weights
        if w in optimizer.state
        for k in ("exp_avg", "exp_avg_sq")
    }
    result = {
        "rank": trainer.global_rank,
        "losses": module.losses,
        "checksum": float(sum(p.detach().double().sum() for p in params)),
        "fp8_layers": sum(isinstance(m, FP8Linear) for m in module.modules()),
        "optimizer": type(optimizer).__name__,
        "fp8_moment_dtypes": sorted(moments),  # O2: E4M3 and fp16 (fp32 ones: the weights were not seen as FP8)
        "comm": plugin.comm_hooks,
        "reductions": getattr(plugin.comm_state, "reductions", 0),
        "skipped_steps": plugin.grad_scaler.skipped_steps,
        "finite": all(bool(torch.isfinite(p).all()) for p in params),
        "resumed_losses": resumed_losses,
        "health_loss_smooth": health.last_metrics.get("health/loss_smooth") if health else None,
        "health_losses": [v for _, v in health.monitor.series["loss"]] if health else None,
        "callback_loss_smooth": trainer.callback_metrics["health/loss_smooth"].item() if health else None,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    exit_worker()  # every rank done: leave without the interpreter's teardown (see tests/distributed/launch.py)
