"""Train the GPT of examples/gpt.py with a plain Hugging Face Accelerate loop; FP8-LM comes from the launch.

The one line that differs from an ordinary Accelerate script is the import of ``Accelerator``. Whether FP8-LM is
on, and with which recipe, is decided by how the script is launched (see docs/accelerate.md):

    # one process (CPU here: FP8 GEMMs emulated; on an FP8 GPU they are real)
    lightning-fp8 launch --config_file examples/accelerate/single_process.yaml examples/accelerate/train_gpt.py
    # two CPU processes, DDP with FP8 gradient all-reduce
    lightning-fp8 launch --config_file examples/accelerate/ddp_cpu.yaml examples/accelerate/train_gpt.py
    # FSDP2 on GPUs, FP8 weight all-gather
    lightning-fp8 launch --config_file examples/accelerate/fsdp2.yaml examples/accelerate/train_gpt.py
    # plain accelerate launch, recipe from the environment
    LIGHTNING_FP8_RECIPE=fp8-lm LIGHTNING_FP8_EXCLUDE=lm_head accelerate launch --cpu examples/accelerate/train_gpt.py

The data is the source of Python's standard library read as bytes, or your own text with ``--data PATH``; the
validation split is evaluated every ``--val-every`` steps and at the end. Outputs under ``--out``: ``metrics.jsonl``
(every ``accelerator.log`` call: the training and validation loss, and with FP8-LM the scales, mu and health
statistics the accelerator adds) and checkpoints from ``accelerator.save_state`` (``--save-every``); ``--resume DIR``
continues from one, with its run's --batch-size, --grad-accum, --lr and --weight-decay (others are a usage error).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate.tracking import GeneralTracker
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Subset
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, for gpt.py and corpus.py
from cli import float_at_least, int_at_least, output_dir  # noqa: E402
from corpus import Corpus, add_data_arguments, corpus_from_args, make_loaders  # noqa: E402
from gpt import GPT, GPTConfig, adamw_with_schedule, evaluate  # noqa: E402

from lightning_fp8.accelerate import Accelerator  # noqa: E402  (was: from accelerate import Accelerator)


class JsonlTracker(GeneralTracker):
    """An Accelerate tracker that appends each ``accelerator.log`` call to a JSON-lines file."""

    name = "jsonl"
    requires_logging_directory = False

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    @property
    def tracker(self) -> Path:
        return self.path

    def store_init_configuration(self, values: dict) -> None:
        self.log({"config": values})

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")


class TrainState:
    """The loop's position (optimizer steps, micro-batches read), saved by ``accelerator.save_state`` with the
    --batch-size and --grad-accum that give it its meaning (``parse_args`` holds a resumed run to them)."""

    def __init__(self, batch_size: int, grad_accum: int) -> None:
        self.step = 0
        self.batches = 0
        self.batch_size, self.grad_accum = batch_size, grad_accum

    def state_dict(self) -> dict[str, int]:
        return {
            "step": self.step,
            "batches": self.batches,
            "batch_size": self.batch_size,
            "grad_accum": self.grad_accum,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.batches = int(state["step"]), int(state["batches"])


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    count, at_least_0 = int_at_least(1), int_at_least(0)  # sizes and step counts; 0 allowed
    p.add_argument("--preset", default="toy", choices=["toy", "small", "gpt125m"], help="GPTConfig preset")
    p.add_argument("--depth", type=count, default=None)
    p.add_argument("--width", type=count, default=None)
    p.add_argument("--heads", type=count, default=None)
    p.add_argument("--seq-len", type=count, default=None)
    p.add_argument("--batch-size", type=count, help="per process (default: 16; a resumed run's is the checkpoint's)")
    p.add_argument(
        "--grad-accum",
        type=count,
        help="micro-batches per optimizer step (default: 1; a resumed run's is the checkpoint's)",
    )
    p.add_argument("--steps", type=count, default=200, help="optimizer steps")
    non_negative = float_at_least(0)  # learning rate, weight decay, gradient norm
    p.add_argument("--lr", type=non_negative, help="default: 2e-3; a resumed run's is the checkpoint's")
    p.add_argument("--weight-decay", type=non_negative, help="default: 0.1; a resumed run's is the checkpoint's")
    p.add_argument("--warmup", type=at_least_0, default=20)
    p.add_argument("--clip", type=non_negative, default=1.0, help="max gradient norm (0: no clipping)")
    add_data_arguments(p)  # --data, --max-bytes, --val-fraction
    p.add_argument("--log-every", type=count, default=10)
    p.add_argument("--val-every", type=count, default=100, help="evaluate the validation split every N steps")
    p.add_argument("--val-batches", type=count, default=20, help="batches per process per validation")
    p.add_argument("--save-every", type=at_least_0, default=0, help="save_state every N steps (0: only at the end)")
    p.add_argument("--out", type=output_dir, default=Path("runs/accelerate_gpt"))
    p.add_argument("--resume", type=Path, default=None, help="a checkpoint folder written by save_state")
    p.add_argument("--seed", type=int_at_least(0, 2**32 - 1), default=0)
    p.add_argument("--no-progress-bar", action="store_true")
    return p


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Corpus]:
    """The arguments and the corpus they name: a model or data that cannot be is a usage error now."""
    p = make_parser()
    args = p.parse_args(argv)
    if args.resume is not None and not args.resume.is_dir():
        p.error(f"--resume {str(args.resume)!r}: no such directory; give a checkpoint folder written by save_state")
    # save_state always writes each process's RNG state: a folder without one is no checkpoint, and load_state
    # would fail with a FileNotFoundError after --out and its metrics.jsonl were created
    if args.resume is not None and not list(args.resume.glob("random_states_*.pkl")):
        p.error(
            f"--resume {str(args.resume)!r} is not a checkpoint folder written by save_state (no random_states_*.pkl "
            "in it); give one this script wrote, e.g. --out/checkpoint_final"
        )
    done, saved = saved_run(args.resume) if args.resume is not None else (0, {})
    if done >= args.steps:  # the loop trained nothing, saved checkpoint_final again and printed a loss of nan
        p.error(
            f"--resume {str(args.resume)!r} is at step {done} already: give a --steps above it "
            "(the run's optimizer steps in all, those before the resume too)"
        )
    # load_state restores the optimizer's and the schedule's hyper-parameters: new values would only be logged. The
    # saved step and data position count micro-batches of the run's size: another size would go on at another place
    # in the data and schedule. A checkpoint written before the sizes were saved is not checked: the flags hold.
    defaults = {"lr": 2e-3, "weight_decay": 0.1, "batch_size": 16, "grad_accum": 1}
    for key, default in defaults.items():
        given, kept = getattr(args, key), saved.get(key)
        if given is not None and kept is not None and given != kept:
            flag = "--" + key.replace("_", "-")
            p.error(f"--resume {str(args.resume)!r} goes on with its own {flag} {kept}, not {given}: leave {flag} out")
        setattr(args, key, given if given is not None else kept if kept is not None else default)
    try:  # after the sizes are known: the corpus must hold a batch of --batch-size
        corpus = corpus_from_args(args, model_config(args).seq_len)
    except ValueError as err:
        p.error(str(err))
    return args, corpus


def saved_run(folder: Path) -> tuple[int, dict[str, float]]:
    """A checkpoint folder's optimizer steps, batch size and gradient accumulation (its TrainState, the first object
    registered for checkpointing), learning rate (the schedule's) and weight decay (the first param group's); 0 and
    none where the files do not say (load_state then says what is wrong; an older TrainState holds no sizes)."""

    def read(name: str) -> dict:
        path = folder / name
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True) if path.is_file() else None
        return state if isinstance(state, dict) else {}

    saved = {"lr": (read("scheduler.bin").get("base_lrs") or [None])[0]}
    saved["weight_decay"] = ((read("optimizer.bin").get("param_groups") or [{}])[0]).get("weight_decay")
    train_state = read("custom_checkpoint_0.pkl")
    saved |= {key: train_state.get(key) for key in ("batch_size", "grad_accum")}
    return int(train_state.get("step", 0)), saved


def model_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig.preset(args.preset, depth=args.depth, width=args.width, heads=args.heads, seq_len=args.seq_len)


def build(args: argparse.Namespace) -> tuple[GPT, torch.optim.Optimizer, Any]:
    cfg = model_config(args)
    model = GPT(cfg)
    optimizer, scheduler = adamw_with_schedule(
        model, lr=args.lr, weight_decay=args.weight_decay, warmup_steps=args.warmup, max_steps=args.steps
    )
    return model, optimizer, scheduler


def validation_loader(loader: DataLoader, batches: int) -> DataLoader:
    """The first ``batches`` batches of ``loader`` (all processes together): each validation reads its loader to the
    end, as Accelerate expects of a prepared loader (one left half-read stays the one whose end ``accumulate``
    watches, and the last micro-batches of a training epoch would not be synchronized)."""
    n = min(len(loader.dataset), batches * loader.batch_size)
    return DataLoader(Subset(loader.dataset, range(n)), loader.batch_size, drop_last=True, pin_memory=loader.pin_memory)


def validate(accelerator: Accelerator, model: torch.nn.Module, loader: DataLoader) -> float:
    """Mean validation loss over every process's batches (each reads its own share of the loader)."""
    return accelerator.reduce(evaluate(model, loader), reduction="mean").item()


def check_shares(accelerator: Accelerator, loaders: dict[str, DataLoader]) -> None:
    """Every process needs a batch of each split (Accelerate shards them and drops an uneven last round)."""
    for flag, loader in loaders.items():
        if len(loader) == 0:
            raise SystemExit(
                f"the {flag} split leaves no batch of --batch-size for each of the {accelerator.num_processes} "
                "processes: lower --batch-size or --seq-len, or give more text (--data, --max-bytes, --val-fraction)"
            )


def setup(
    args: argparse.Namespace, corpus: Corpus, generator: torch.Generator
) -> tuple[Accelerator, Any, Any, DataLoader, DataLoader, Any]:
    """The Accelerator and the prepared model, optimizer, loaders (training batches drawn with ``generator``) and
    scheduler."""
    args.out.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.grad_accum,
        log_with=[JsonlTracker(args.out / "metrics.jsonl")],
        step_scheduler_with_optimizer=False,  # the schedule counts optimizer steps, whatever the process count
    )
    accelerator.init_trackers("train_gpt", config={k: str(v) for k, v in vars(args).items()})
    accelerator.print(corpus.describe())
    model, optimizer, scheduler = build(args)
    loader, val_loader = make_loaders(corpus, model.cfg.seq_len, args.batch_size, generator=generator)
    val_loader = validation_loader(val_loader, args.val_batches * accelerator.num_processes)
    prepared = accelerator.prepare(model, optimizer, loader, val_loader, scheduler)
    check_shares(accelerator, {"training": prepared[2], "validation": prepared[3]})
    return accelerator, *prepared


def main(argv: list[str] | None = None) -> None:
    args, corpus = parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.INFO)
    set_seed(args.seed)
    # The shuffle generator is re-seeded every epoch (seed + epoch): an epoch's order is the same whether the run was
    # resumed or not.
    generator = torch.Generator()
    accelerator, model, optimizer, loader, val_loader, scheduler = setup(args, corpus, generator)
    state = TrainState(args.batch_size, args.grad_accum)
    accelerator.register_for_checkpointing(state)
    if args.resume is not None:
        accelerator.load_state(str(args.resume))
        accelerator.print(f"resumed from {args.resume} at step {state.step}")
    accelerator.print(f"optimizer: {type(optimizer.optimizer).__name__}, processes: {accelerator.num_processes}")

    model.train()
    loss_sum, micro, mean_loss, val_loss = torch.zeros((), device=accelerator.device), 0, float("nan"), float("nan")
    bar = tqdm(
        total=args.steps,
        initial=state.step,
        desc="steps",
        disable=args.no_progress_bar or not accelerator.is_local_main_process,
    )
    while state.step < args.steps:
        epoch, skip = divmod(state.batches, len(loader))
        generator.manual_seed(args.seed + epoch)
        for x, y in accelerator.skip_first_batches(loader, skip) if skip else loader:
            state.batches += 1
            with accelerator.accumulate(model):
                _, loss = model(x, y)
                accelerator.backward(loss)
                loss_sum, micro = loss_sum + loss.detach(), micro + 1
                grad_norm = None
                if accelerator.sync_gradients and args.clip > 0:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            if not accelerator.optimizer_step_was_skipped:
                scheduler.step()
            state.step += 1
            bar.update()
            last = state.step == args.steps
            values: dict[str, float] = {}  # one accelerator.log call per step: one metrics row
            if state.step % args.log_every == 0 or last:
                mean_loss = accelerator.reduce(loss_sum / micro, reduction="mean").item()
                values = {"train/loss": mean_loss, "train/lr": scheduler.get_last_lr()[0]}
                if grad_norm is not None:
                    values["train/grad_norm"] = float(grad_norm)
            if state.step % args.val_every == 0 or last:
                values["val/loss"] = val_loss = validate(accelerator, model, val_loader)
            if values:
                accelerator.log(values, step=state.step)
                bar.set_postfix(loss=f"{mean_loss:.4f}", val_loss=f"{val_loss:.4f}", refresh=False)
                if accelerator.is_local_main_process:  # above the bar, not through it
                    bar.write(f"step {state.step} " + " ".join(f"{k} {v:.4g}" for k, v in values.items()))
            loss_sum, micro = torch.zeros((), device=accelerator.device), 0
            if args.save_every and state.step % args.save_every == 0:
                accelerator.save_state(str(args.out / f"checkpoint_{state.step}"))
            if state.step >= args.steps:
                break
    bar.close()
    accelerator.save_state(str(args.out / "checkpoint_final"))
    accelerator.print(f"done: {state.step} steps, final loss {mean_loss:.4f}, final val loss {val_loss:.4f}")
    accelerator.wait_for_everyone()  # every rank done with its collectives before the process group goes
    accelerator.end_training()


if __name__ == "__main__":
    main()
