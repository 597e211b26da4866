"""The lab's report: PNG plots and a markdown summary from the ``runs/<variant>.json`` files lab.py writes.

    python examples/lab_report.py runs/lab       # rebuild the report of a lab directory

Files written into the lab directory: ``summary.md``, ``loss.png`` (train and validation loss),
``throughput.png``, ``memory.png``, and ``scales_<variant>.png`` (per-layer log2 scale histories and the
gradient scale mu) for each FP8 variant.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

BASELINE = "bf16"
TARGET = 0.01  # FP8-LM's final validation loss should be within 1% of BF16's (issue 7, real-size run)
ROLES = ("input", "weight", "grad_output")


def _load_run(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:  # a run killed while writing it (or a file edited by hand)
        raise ValueError(f"{path} is not a lab run ({err}): run its variant again with lab.py, or delete it") from None


def load_runs(out: Path) -> list[dict[str, Any]]:
    order = ["bf16", "fp8-lm", "fp8-lm-o1", "torchao"]
    runs = [_load_run(p) for p in sorted((out / "runs").glob("*.json"))]
    return sorted(runs, key=lambda r: order.index(r["variant"]) if r["variant"] in order else len(order))


def _ema(values: list[float], alpha: float) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None or not math.isfinite(acc) else alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def plot_loss(runs: list[dict[str, Any]], path: Path) -> None:
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        s = r["series"]
        alpha = min(1.0, 20 / max(1, len(s["steps"])))  # smooth over ~5% of the run
        line = ax_train.plot(s["steps"], _ema(s["train_loss"], alpha), label=r["label"])[0]
        ax_train.plot(s["steps"], s["train_loss"], color=line.get_color(), alpha=0.15, linewidth=0.7)
        if s["val"]:
            steps, losses = zip(*s["val"], strict=True)
            ax_val.plot(steps, losses, marker="o", label=r["label"], color=line.get_color())
    ax_train.set(title="training loss (smoothed; raw faint)", xlabel="step", ylabel="cross-entropy (nats/byte)")
    ax_val.set(title="validation loss", xlabel="step", ylabel="cross-entropy (nats/byte)")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # no validation during the runs: no line to name (matplotlib warns)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bars(runs: list[dict[str, Any]], path: Path, panels: list[tuple[str, str]]) -> None:
    """One bar panel per (result key, title); a panel with no values says so instead of inventing zeros."""
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels, strict=True):
        pairs = [(r["label"], r[key]) for r in runs if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        ax.set_title(title)
        if not pairs:
            ax.text(0.5, 0.5, "not measured on this device", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        labels, values = zip(*pairs, strict=True)
        bars = ax.bar(labels, values, color=[f"C{i}" for i in range(len(values))])
        ax.bar_label(bars, fmt="%.3g")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scales(run: dict[str, Any], path: Path) -> None:
    s = run["series"]
    scales, steps = s["log2_scales"], s["scale_steps"]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    cmap = plt.get_cmap("viridis")
    for ax, role in zip(axes, ROLES, strict=False):
        layers = [layer for layer in scales if role in scales[layer]]
        for i, layer in enumerate(layers):
            ax.plot(
                steps,
                scales[layer][role],
                color=cmap(i / max(1, len(layers) - 1)),
                linewidth=0.9,
                drawstyle="steps-post",  # a scale holds until the next recorded step
                label=layer if len(layers) <= 8 else None,
            )
        ax.set(title=f"{role}: log2(scale) per layer", xlabel="step")
        if 0 < len(layers) <= 8:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    ax = axes[3]
    if s["grad_scale"]:
        mu_steps, mu = zip(*s["grad_scale"], strict=True)
        ax.plot(mu_steps, [math.log2(v) for v in mu], drawstyle="steps-post")
    ax.set(title="gradient scale: log2(mu)", xlabel="step")
    ax.grid(alpha=0.3)
    fig.suptitle(f"{run['label']}: scale histories (colour: layer depth, dark = first)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(value: Any, spec: str) -> str:
    return "-" if not isinstance(value, (int, float)) or not math.isfinite(value) else format(value, spec)


def _relative_loss(run: dict[str, Any], base: dict[str, Any] | None) -> float | str:
    """``run``'s final validation loss relative to ``base``'s (0.01: 1% higher), or why there is none: "n/a"
    without a BF16 run, "diverged" when either loss is not finite."""
    if base is None:
        return "n/a"
    if not (math.isfinite(run["final_val_loss"]) and math.isfinite(base["final_val_loss"])):
        return "diverged"
    return run["final_val_loss"] / base["final_val_loss"] - 1


def _fmt_vs(value: float | str, spec: str, suffix: str = "") -> str:
    if isinstance(value, str):
        return value
    text = _fmt(value, spec)
    return text if text == "-" else text + suffix


def summary_table(runs: list[dict[str, Any]]) -> list[str]:
    base = next((r for r in runs if r["variant"] == BASELINE and r["status"] == "ok"), None)
    rows = [
        "| variant | status | final val loss | vs BF16 | final train loss | tokens/s | vs BF16 | peak GPU memory (GiB) "
        "| bytes/param, linear weights | bytes/param, all | skipped steps | non-finite losses | health events |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        if r["status"] != "ok":
            rows.append(f"| {r['label']} | {r['status']} |" + " - |" * 11)
            continue
        rel_loss = _relative_loss(r, base)
        speed_ratio = "n/a" if base is None else r["tokens_per_sec"] / base["tokens_per_sec"]
        events = ", ".join(f"{e['kind']}@{e['step']} ({e['action']})" for e in r["health_events"][:5]) or "none"
        rows.append(
            f"| {r['label']} | ok | {_fmt(r['final_val_loss'], '.4f')} | {_fmt_vs(rel_loss, '+.2%')} "
            f"| {_fmt(r['final_train_loss'], '.4f')} | {_fmt(r['tokens_per_sec'], ',.0f')} "
            f"| {_fmt_vs(speed_ratio, '.2f', 'x')} "
            f"| {_fmt(r['peak_memory_gib'], '.2f')} | {_fmt(r['linear_bytes_per_param'], '.2f')} "
            f"| {_fmt(r['bytes_per_param'], '.2f')} "
            f"| {r['skipped_steps']} | {r['nonfinite_losses']} | {events} |"
        )
    return rows


def verdicts(runs: list[dict[str, Any]]) -> list[str]:
    base = next((r for r in runs if r["variant"] == BASELINE and r["status"] == "ok"), None)
    if base is None:
        return ["No BF16 baseline in this directory: run `--variants bf16` with the same `--out` to compare."]
    lines = []
    for r in runs:
        if r["variant"] == BASELINE or r["status"] != "ok":
            continue
        rel = _relative_loss(r, base)
        if isinstance(rel, str):  # diverged: no ratio to compare
            which = "its" if not math.isfinite(r["final_val_loss"]) else "BF16's"
            lines.append(
                f"- {r['label']}: diverged ({which} final validation loss is not finite): NOT within {TARGET:.0%}."
            )
            continue
        verdict = "within" if abs(rel) <= TARGET else "NOT within"
        lines.append(f"- {r['label']}: final validation loss {rel:+.2%} relative to BF16: {verdict} {TARGET:.0%}.")
    return lines


def write_report(out: Path) -> Path:
    """Plots and ``summary.md`` for every run in ``out/runs``; returns the summary's path."""
    out = Path(out)
    runs = load_runs(out)
    if not runs:
        raise FileNotFoundError(f"no lab runs in {out / 'runs'}: run examples/lab.py --out {out} first")
    ok = [r for r in runs if r["status"] == "ok"]
    first = runs[0]
    lines = [
        "# Lab: BF16 vs FP8",
        "",
        f"- command: `{first['command']}`",
        f"- device: {first['device']}; FP8 GEMMs {first['fp8_gemms']}; torch {first['torch']}; {first['date']}",
        f"- model: {first['model']}",
        f"- training: {first['config']}",
    ]
    if len({json.dumps([r["model"], r["config"], r["device"]]) for r in runs}) > 1:
        lines.append(
            "- WARNING: the runs in this directory used different models, settings or devices; "
            "see runs/*.json before comparing them."
        )
    if "CPU" in first["device"]:
        lines.append(
            "- CPU run: FP8 is emulated and CPU bf16 matmuls are slow, so throughput and memory here say "
            "nothing about a GPU; the loss curves are what this run checks."
        )
    lines += [
        "- bytes/param: the parameter's storage plus its optimizer states, measured after the first steps, per"
        " parameter of the blocks' linear layers (the FP8 ones) and of the whole model; gradients are transient"
        " and not included (the optimization-level table of the docs adds 4 bytes for an fp32 gradient, 1 for FP8).",
        "",
        *summary_table(runs),
        "",
        *verdicts(runs),
        "",
    ]
    if ok:
        plot_loss(ok, out / "loss.png")
        plot_bars(ok, out / "throughput.png", [("tokens_per_sec", "training throughput (tokens/s, median)")])
        plot_bars(
            ok,
            out / "memory.png",
            [
                ("peak_memory_gib", "peak GPU memory allocated (GiB)"),
                ("linear_bytes_per_param", "parameter + optimizer states, bytes per linear weight"),
            ],
        )
        lines += ["![loss](loss.png)", "", "![throughput](throughput.png) ![memory](memory.png)", ""]
    for r in ok:
        if r["series"]["scale_steps"]:
            plot_scales(r, out / f"scales_{r['variant']}.png")
            lines += [f"![{r['label']} scales](scales_{r['variant']}.png)", ""]
    summary = out / "summary.md"
    summary.write_text("\n".join(lines))
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lab_dir", type=Path, help="a directory lab.py wrote (its --out), holding runs/*.json")
    lab_dir = parser.parse_args().lab_dir
    if not any((lab_dir / "runs").glob("*.json")):
        parser.error(f"no runs in {lab_dir}: expected {lab_dir / 'runs'}/<variant>.json, as lab.py --out writes")
    try:
        print(write_report(lab_dir).read_text())
    except ValueError as err:
        parser.error(str(err))
