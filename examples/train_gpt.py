"""Train a GPT on bytes with Lightning and FP8-LM: ``Trainer(precision="fp8-lm")``.

    python examples/train_gpt.py                       # FP8-LM; toy size on CPU, "small" on a GPU
    python examples/train_gpt.py --precision bf16-mixed
    python examples/train_gpt.py --preset gpt125m --max-steps 2000 --data my_texts/
    python examples/train_gpt.py --max-steps 400 --resume runs/train_gpt/checkpoints/last.ckpt

The default data is the source of Python's standard library read as bytes (no download, see corpus.py);
``--data`` takes your own text file or directory. On a CPU the FP8 GEMMs are emulated (same scaling
logic, fp32 matmuls); on an FP8 GPU (sm89+) they are real. Outputs under ``--out``: CSV (and TensorBoard)
logs, checkpoints (``--resume`` continues from one), and ``summary.json`` with the final train and validation loss.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from cli import float_at_least, int_at_least, output_dir
from corpus import add_data_arguments, corpus_from_args, make_loaders
from gpt import GPT, GPTConfig, adamw_with_schedule, fp8_module_filter
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from resume import check_resume
from torch.utils.data import DataLoader
from typing_extensions import override

import lightning_fp8  # noqa: F401  (registers precision="fp8-lm" with Lightning)
from lightning_fp8 import FP8LMPrecision
from lightning_fp8.callbacks import FP8ScaleMonitor, TrainingHealthMonitor
from lightning_fp8.ops import has_fp8_gemm

# --precision values that mean FP8-LM, and the recipe each names (see FP8Recipe.from_name).
FP8_PRECISIONS = ("fp8-lm", "fp8-lm-o1", "fp8-lm-current", "fp8-lm-e4m3")

# Sizes chosen by device: a CPU (FP8 emulated) gets a toy run of a few minutes, a GPU a real one.
CPU_DEFAULTS = {"preset": "toy", "batch_size": 16, "max_steps": 200, "lr": 2e-3, "val_every": 100}
GPU_DEFAULTS = {"preset": "small", "batch_size": 32, "max_steps": 2000, "lr": 1e-3, "val_every": 250}


# --8<-- [start:lit_module]
class LitGPT(L.LightningModule):
    """The GPT of gpt.py as a LightningModule: AdamW, linear warm-up then cosine decay to 10%."""

    def __init__(
        self,
        gpt: dict[str, Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
        max_steps: int = 1000,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # plain dicts and numbers: the checkpoint loads with weights_only=True
        self.model = GPT(GPTConfig(**gpt))

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        _, loss = self.model(x, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        _, loss = self.model(x, y)
        self.log("val_loss", loss, prog_bar=True)

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer, scheduler = adamw_with_schedule(
            self.model, lr=hp.lr, weight_decay=hp.weight_decay, warmup_steps=hp.warmup_steps, max_steps=hp.max_steps
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# --8<-- [end:lit_module]


class LossHistory(Callback):
    """Keeps every training loss (as floats) so the script can report a smoothed final value."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))


def data_loaders(args: argparse.Namespace, seq_len: int) -> tuple[DataLoader, DataLoader]:
    """Shuffled training windows and fixed validation windows of the corpus chosen by ``--data``."""
    corpus = corpus_from_args(args, seq_len)
    print(corpus.describe())
    return make_loaders(corpus, seq_len, args.batch_size)


# --8<-- [start:precision]
def precision_kwargs(precision: str) -> dict[str, Any]:
    """Trainer arguments for ``--precision``.

    FP8-LM is ``Trainer(precision="fp8-lm")``; the plugin form used here is the same thing with one more
    choice made: keep the output head out of FP8 (``fp8_module_filter``).
    """
    if precision in FP8_PRECISIONS:
        return {"plugins": [FP8LMPrecision(recipe=precision, module_filter_fn=fp8_module_filter)]}
    return {"precision": precision}


# --8<-- [end:precision]


def describe_device(precision: str) -> str:
    """The device the run uses, and whether its FP8 GEMMs are emulated (only FP8 precisions have FP8 GEMMs)."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    if precision in FP8_PRECISIONS and not has_fp8_gemm(device):
        name += " (FP8 GEMMs emulated)"
    return name


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    count = int_at_least(1)  # sizes and step counts
    p.add_argument(
        "--precision",
        default="fp8-lm",
        help=f"{', '.join(FP8_PRECISIONS)} or any Lightning precision (bf16-mixed, 16-mixed, 32-true)",
    )
    p.add_argument("--preset", choices=["toy", "small", "gpt125m"], help="model size (default: by device)")
    p.add_argument("--toy", action="store_true", help="the CPU toy settings on any device (quick check)")
    p.add_argument("--width", type=count)
    p.add_argument("--depth", type=count)
    p.add_argument("--heads", type=count)
    p.add_argument("--seq-len", type=count)
    p.add_argument("--batch-size", type=count)
    p.add_argument("--max-steps", type=count)
    p.add_argument("--lr", type=float_at_least(0))
    p.add_argument("--warmup-steps", type=int_at_least(0), help="default: 5%% of --max-steps")
    p.add_argument("--val-every", type=count, help="validate every N training steps")
    p.add_argument("--val-batches", type=count, default=20, help="validation batches per validation")
    add_data_arguments(p)  # --data, --max-bytes, --val-fraction
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--seed", type=int_at_least(0, 2**32 - 1), default=1234)
    p.add_argument(
        "--out", type=output_dir, default="runs/train_gpt", help="directory for logs, checkpoints, summary.json"
    )
    p.add_argument(
        "--resume",
        type=checkpoint_file,
        help="continue from a checkpoint this script wrote (e.g. OUT/checkpoints/last.ckpt), to a larger --max-steps",
    )
    p.add_argument("--no-progress-bar", action="store_true")
    return p


def checkpoint_file(text: str) -> str:
    """An argparse ``type`` for ``--resume``: an existing file."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: no such file; give a .ckpt file written by this script")
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = make_parser().parse_args(argv)
    args.given = {key for key in ("lr", "warmup_steps") if getattr(args, key) is not None}  # see check_resume
    defaults = GPU_DEFAULTS if torch.cuda.is_available() and not args.toy else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.max_steps // 20)
    return args


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig.preset(args.preset, width=args.width, depth=args.depth, heads=args.heads, seq_len=args.seq_len)


def build_trainer(
    args: argparse.Namespace, callbacks: list[Callback], loggers: list[Any] | bool, inference_mode: bool = True
) -> L.Trainer:
    """The Trainer both this script and lab.py use (lab passes its own callbacks and loggers, and
    ``inference_mode=False``: validation under ``torch.no_grad()``, which torchao's float8 tensors need)."""
    return L.Trainer(
        max_steps=args.max_steps,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,  # validate by step count, across epochs
        limit_val_batches=args.val_batches,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        log_every_n_steps=10,
        callbacks=callbacks,
        logger=loggers,
        enable_progress_bar=not args.no_progress_bar,
        enable_model_summary=False,
        default_root_dir=args.out,
        inference_mode=inference_mode,
        **precision_kwargs(args.precision),
    )


def script_trainer(args: argparse.Namespace, out: Path, history: LossHistory) -> L.Trainer:
    """This script's Trainer: CSV (and TensorBoard) logs and checkpoints under ``out``, ``history`` and, with an FP8
    --precision, the FP8 and health callbacks. A --precision that cannot be is a usage error."""
    loggers: list[Any] = [CSVLogger(out, name="csv")]
    if importlib.util.find_spec("tensorboard") is not None:
        loggers.append(TensorBoardLogger(out, name="tensorboard"))
    callbacks: list[Callback] = [
        history,
        ModelCheckpoint(dirpath=out / "checkpoints", monitor="val_loss", save_last=True),
    ]
    # --8<-- [start:callbacks]
    if args.precision in FP8_PRECISIONS:
        callbacks += [FP8ScaleMonitor(), TrainingHealthMonitor()]  # fp8/* and health/* metrics, health.png
    # --8<-- [end:callbacks]
    try:
        return build_trainer(args, callbacks, loggers)
    except ValueError as err:  # a precision Lightning does not know: its list leaves out the FP8-LM names
        make_parser().error(
            f"--precision {args.precision!r}: {err}; or one of this package's {', '.join(FP8_PRECISIONS)}"
        )
    except ModuleNotFoundError as err:  # a precision whose package is not installed
        install = " (pip install transformer-engine)" if args.precision.startswith("transformer-engine") else ""
        make_parser().error(
            f"--precision {args.precision!r} needs a package that is not installed{install}: {err}; "
            f"or choose one of {', '.join(FP8_PRECISIONS)}"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    L.seed_everything(args.seed, verbose=False)
    try:  # a model or data that cannot be: a usage error before anything trains, not a traceback
        cfg = gpt_config(args)
        if args.resume is not None:
            check_resume(args, cfg, FP8_PRECISIONS)
        train_loader, val_loader = data_loaders(args, cfg.seq_len)
    except ValueError as err:
        make_parser().error(str(err))
    lit = LitGPT(asdict(cfg), lr=args.lr, warmup_steps=args.warmup_steps, max_steps=args.max_steps)
    if args.compile:
        lit.model.compile()
    device = describe_device(args.precision)
    print(f"model: {cfg} | {lit.model.num_params() / 1e6:.1f}M parameters | precision {args.precision} | {device}")

    out = Path(args.out)
    history = LossHistory()
    trainer = script_trainer(args, out, history)
    trainer.fit(lit, train_loader, val_loader, ckpt_path=args.resume)

    val_loss = trainer.validate(lit, val_loader, verbose=False)[0]["val_loss"]
    tail = history.losses[-20:]
    summary = {
        "precision": args.precision,
        "model": asdict(cfg),
        "parameters": lit.model.num_params(),
        "steps": trainer.global_step,
        "final_train_loss": sum(tail) / len(tail),  # mean of the last 20 steps: one batch is noisy
        "final_val_loss": float(val_loss),
        "train_losses": history.losses,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(
        f"final train loss {summary['final_train_loss']:.4f} | final val loss {summary['final_val_loss']:.4f} "
        f"| uniform baseline ln(256) = {math.log(256):.4f} | logs and checkpoints in {out}"
    )
    return summary


if __name__ == "__main__":
    main()
    # Lightning leaves the process group up: end it once every rank is done (torch's advice for a clean exit).
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
