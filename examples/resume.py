"""``train_gpt.py --resume``: the checks of a checkpoint before anything trains. Lightning would otherwise train nothing
(a run at --max-steps already), train with the checkpoint's learning rate while recording another, or load FP8AdamW's
scaled moments into torch's AdamW; a file that is no checkpoint of the script would be a traceback."""

from __future__ import annotations

import argparse
from dataclasses import asdict

import torch
from gpt import GPTConfig


def check_resume(args: argparse.Namespace, cfg: GPTConfig, fp8_precisions: tuple[str, ...]) -> None:
    """Raise ``ValueError``, before anything trains, for a ``--resume`` checkpoint this run cannot continue: a file that
    is no checkpoint, another model, a run at --max-steps already (Lightning trained nothing), another --lr (ignored),
    FP8AdamW's moments (stored as value * scale) for torch's AdamW. Sets ``args.lr`` (and ``args.warmup_steps`` when
    not given) to the checkpoint's."""
    where = f"--resume {args.resume!r}"
    try:  # mmap: the tensors stay on disk, only the small entries checked here are read
        ckpt = torch.load(args.resume, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch.load's errors for a file it cannot read are of many types
        raise ValueError(
            f"{where} does not load ({type(err).__name__}: {err}); give a .ckpt file this script wrote"
        ) from None
    hparams = ckpt.get("hyper_parameters") if isinstance(ckpt, dict) else None
    saved = hparams.get("gpt") if isinstance(hparams, dict) else None
    if not isinstance(saved, dict) or not isinstance(ckpt.get("global_step"), int):
        raise ValueError(f"{where} is not a checkpoint of this script (no GPT hyper-parameters or global_step)")
    if saved != asdict(cfg):
        raise ValueError(
            f"{where} holds the model {saved}, but the flags give {asdict(cfg)}: resume with the run's "
            "--preset/--width/--depth/--heads/--seq-len"
        )
    if ckpt["global_step"] >= args.max_steps:
        raise ValueError(
            f"{where} is at step {ckpt['global_step']} already: give a --max-steps above it (it counts every step "
            "of the run, those before the resume too)"
        )
    # Lightning restores the optimizer's and the schedule's learning rates: a new --lr would not train, only be recorded
    lr = hparams.get("lr", args.lr)
    if "lr" in args.given and lr != args.lr:
        raise ValueError(
            f"{where} goes on with its own learning rate {lr} (the optimizer and schedule state load with it), "
            f"not --lr {args.lr}: leave --lr out to resume"
        )
    # Not given: the run's own (the default warm-up, 5% of a larger --max-steps, could send the LR back into warm-up)
    args.lr = lr
    if "warmup_steps" not in args.given:
        args.warmup_steps = hparams.get("warmup_steps", args.warmup_steps)
    states = [s for o in ckpt.get("optimizer_states", []) for s in o.get("state", {}).values() if isinstance(s, dict)]
    scaled = any(f"{key}_scale" in state for state in states for key in ("exp_avg", "exp_avg_sq"))
    if scaled and args.precision not in fp8_precisions:
        raise ValueError(
            f"{where} holds FP8AdamW's moments (stored as value * scale), which --precision {args.precision!r} "
            f"(torch's AdamW) would read as the moments: resume with one of {', '.join(fp8_precisions)}, or convert "
            "the checkpoint's optimizer_states with lightning_fp8.optim.adamw_state_dict (docs/guides/checkpoints.md)"
        )
