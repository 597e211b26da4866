"""The lab: train the same GPT in BF16 and in FP8 and compare (loss, speed, memory, scales, health).

    python examples/lab.py                                        # CPU: toy size, a few minutes
    python examples/lab.py --preset gpt125m --max-steps 2000 --out runs/lab/gpt125m    # an FP8 GPU

Every variant starts from the same initial weights and sees the same batches in the same order:

    bf16        precision="bf16-mixed" (the baseline)
    fp8-lm      FP8-LM O2: FP8 GEMMs, FP8 gradients, FP8AdamW with FP8 m / fp16 v / fp16 master weights
    fp8-lm-o1   FP8-LM O1: FP8 GEMMs and gradients, fp32 optimizer states
    torchao     torchao float8 training (tensorwise), when torchao is installed

Results go to ``--out``: ``runs/<variant>.json`` (raw series, recorded by lab_recorder.py) and, from all runs found
there, the report (``summary.md`` and PNG plots; see lab_report.py). Variants can be run one per call with the same
``--out`` (``--variants bf16``, then ``--variants fp8-lm`` ...); the report always covers every run in the directory.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from cli import flags_given, float_at_least, int_at_least, output_dir
from corpus import add_data_arguments
from gpt import fp8_module_filter
from lab_recorder import LabRecorder, grad_scaler
from lab_report import write_report
from lightning.pytorch.loggers import CSVLogger
from train_gpt import LitGPT, build_trainer, data_loaders, gpt_config

from lightning_fp8.callbacks import TrainingHealthMonitor

VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": {"precision": "bf16-mixed", "label": "BF16 mixed"},
    "fp8-lm": {"precision": "fp8-lm", "label": "FP8-LM O2"},
    "fp8-lm-o1": {"precision": "fp8-lm-o1", "label": "FP8-LM O1"},
    "torchao": {"precision": "bf16-mixed", "label": "torchao float8", "torchao": True},
}
# CPU: small enough that BF16 (slow matmuls on most CPUs) and emulated FP8 each take well under a minute.
CPU_DEFAULTS = {
    "preset": "toy",
    "width": 64,
    "depth": 2,
    "seq_len": 64,
    "batch_size": 16,
    "max_steps": 200,
    "lr": 2e-3,
    "val_every": 50,
}
# Settings recorded with each run (the report warns when runs in one directory differ in them).
_CONFIG_KEYS = (
    "batch_size max_steps lr warmup_steps val_every val_batches seed compile data max_bytes val_fraction".split()
)
GPU_DEFAULTS = {"preset": "small", "batch_size": 32, "max_steps": 1000, "lr": 1e-3, "val_every": 100}


def _convert_torchao(model: torch.nn.Module) -> None:
    from torchao.float8 import convert_to_float8_training  # optional dependency, checked by the caller

    convert_to_float8_training(model, module_filter_fn=fp8_module_filter)


def run_variant(name: str, args: argparse.Namespace, loaders: tuple[Any, Any]) -> dict[str, Any]:
    """Train one variant from the common seed; returns its results (raw series included)."""
    spec = VARIANTS[name]
    L.seed_everything(args.seed, verbose=False)  # same initial weights and batch order for every variant
    cfg = gpt_config(args)
    lit = LitGPT(asdict(cfg), lr=args.lr, warmup_steps=args.warmup_steps, max_steps=args.max_steps)
    if spec.get("torchao"):
        _convert_torchao(lit.model)
    if args.compile:
        lit.model.compile()
    recorder = LabRecorder(args.batch_size * cfg.seq_len, scale_every=max(1, args.max_steps // 100))
    health = TrainingHealthMonitor(plot_path=str(args.out / f"health_{name}.png"))
    run_args = argparse.Namespace(**{**vars(args), "precision": spec["precision"], "out": str(args.out / "lightning")})
    # The CSV logs hold what the callbacks log (health/*, fp8/*) beside the report's own series. Validation runs
    # under no_grad, not inference_mode (Lightning's default), in every variant alike: torchao's float8 tensors
    # fail under inference_mode with bf16 autocast ("attempting to run aten.to.dtype").
    logger = CSVLogger(args.out / "logs", name=name)
    trainer = build_trainer(run_args, [recorder, health], loggers=[logger], inference_mode=False)
    if torch.cuda.is_available():
        gc.collect()  # the previous variant's model and optimizer must not count towards this one's peak
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.fit(lit, *loaders)
    wall = time.perf_counter() - start
    final_val = trainer.validate(lit, loaders[1], verbose=False)[0]["val_loss"]
    scaler = grad_scaler(trainer)
    return {
        "variant": name,
        "label": spec["label"],
        "status": "ok",
        "precision": spec["precision"],
        "parameters": lit.model.num_params(),
        "final_val_loss": float(final_val),
        "final_train_loss": statistics.fmean(recorder.train_loss[-20:]),
        "tokens_per_sec": recorder.tokens_per_second(),
        "wall_seconds": wall,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "bytes_per_param": recorder.bytes_per_param["all"],
        "linear_bytes_per_param": recorder.bytes_per_param["linear"],
        "nonfinite_losses": sum(not math.isfinite(v) for v in recorder.train_loss),
        "skipped_steps": int(getattr(scaler, "skipped_steps", 0)) if scaler is not None else 0,
        "health_events": [e.to_dict() for e in health.monitor.events],
        "series": {
            "steps": recorder.steps,
            "train_loss": recorder.train_loss,
            "step_seconds": recorder.step_seconds,
            "val": recorder.val,
            "grad_scale": recorder.grad_scale,
            "scale_steps": recorder.scale_steps,
            "log2_scales": recorder.scales,
        },
    }


def environment(args: argparse.Namespace, cfg: Any) -> dict[str, Any]:
    """What a reader needs to reproduce a figure: command, device, versions, date, configuration."""
    cpu = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu
    return {
        "command": "python " + " ".join(sys.argv),
        "device": device,
        "fp8_gemms": "real (torch._scaled_mm)"
        if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
        else "emulated (fp32 matmul on dequantized FP8)",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": asdict(cfg),
        "config": {k: getattr(args, k) for k in _CONFIG_KEYS},
    }


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--variants",
        default="bf16,fp8-lm,fp8-lm-o1,torchao",
        help=f"comma-separated subset of {','.join(VARIANTS)} (torchao is skipped when not installed)",
    )
    p.add_argument("--preset", choices=["toy", "small", "gpt125m"], help="model size (default: by device)")
    count = int_at_least(1)  # sizes and step counts
    for flag in "--width --depth --heads --seq-len --batch-size --max-steps --val-every".split():
        p.add_argument(flag, type=count)
    p.add_argument("--warmup-steps", type=int_at_least(0))
    p.add_argument("--lr", type=float_at_least(0))
    p.add_argument("--val-batches", type=count, default=20, help="batches per validation (the final one too)")
    add_data_arguments(p)  # --data, --max-bytes, --val-fraction
    p.add_argument("--compile", action="store_true", help="torch.compile every variant's model")
    p.add_argument("--seed", type=int_at_least(0, 2**32 - 1), default=1234)
    p.add_argument("--out", type=output_dir, default=Path("runs/lab"))
    p.add_argument(
        "--report-only", action="store_true", help="rebuild the report from --out/runs/*.json (no other flag)"
    )
    p.add_argument("--progress-bar", action="store_true")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = make_parser()
    args = p.parse_args(argv)
    unused = sorted(set(flags_given(p, argv)) - {"--out", "--report-only"}) if args.report_only else []
    if unused:  # the report reads --out's runs alone: these would be silently ignored
        p.error(
            f"--report-only rebuilds the report from {args.out}'s runs and trains nothing: it does not use "
            f"{', '.join(unused)}; give --report-only with --out alone, or leave --report-only out to train"
        )
    preset_given = args.preset is not None
    if args.lr is None and args.preset == "gpt125m":
        args.lr = 6e-4  # GPT-2 small's learning rate
    defaults = GPU_DEFAULTS if torch.cuda.is_available() else CPU_DEFAULTS
    for key, value in defaults.items():
        if key in ("width", "depth", "seq_len") and preset_given:
            continue  # an explicit --preset means its own shape
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.max_steps // 20)
    args.no_progress_bar = not args.progress_bar
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    if args.report_only and not any((args.out / "runs").glob("*.json")):  # before anything is written
        p.error(f"--report-only: no runs in {args.out}: expected {args.out / 'runs'}/<variant>.json (lab.py --out)")
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    if not args.report_only:
        try:  # a model or data that cannot be: a usage error before anything is written, not a traceback
            cfg = gpt_config(args)
            loaders = data_loaders(args, cfg.seq_len)
        except ValueError as err:
            make_parser().error(str(err))
        runs_dir = args.out / "runs"
        runs_dir.mkdir(parents=True, exist_ok=True)
        env = environment(args, cfg)
        for name in args.variants.split(","):
            print(f"=== {name}: {VARIANTS[name]['label']} ===", flush=True)
            if VARIANTS[name].get("torchao") and importlib.util.find_spec("torchao") is None:
                result = {"variant": name, "label": VARIANTS[name]["label"], "status": "skipped: torchao not installed"}
            else:
                try:
                    result = run_variant(name, args, loaders)
                except Exception as err:  # one failing variant must not lose the others' results
                    traceback.print_exc()
                    result = {
                        "variant": name,
                        "label": VARIANTS[name]["label"],
                        "status": f"failed: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}",
                    }
            path = runs_dir / f"{name}.json"
            path.with_suffix(".partial").write_text(json.dumps({**env, **result}, indent=1))
            path.with_suffix(".partial").replace(path)  # whole or not at all: the report reads every runs/*.json
    try:
        summary = write_report(args.out)
    except ValueError as err:  # a runs/*.json that does not parse
        make_parser().error(str(err))
    print(summary.read_text())
    return summary


if __name__ == "__main__":
    main()
