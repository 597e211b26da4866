"""A PNG of a :class:`~lightning_fp8.HealthMonitor`'s series, one panel per series, events marked."""

from __future__ import annotations

import os

# A Figure of its own, not pyplot: drawn to a file (no window on headless nodes, CI), and the process's matplotlib
# backend (a notebook's inline one) stays the user's.
from matplotlib.figure import Figure

from lightning_fp8.health import HealthMonitor

_EVENT_COLORS = {
    "grad_norm_spike": "tab:red",
    "loss_plateau": "tab:orange",
    "nonfinite_loss": "black",
    "nonfinite_grad": "black",
}


def plot_health(monitor: HealthMonitor, path: str | os.PathLike[str]) -> str:
    """Write the plot to ``path`` (directories are created; a name without suffix gets ``.png``, as ``savefig``
    would add it); returns the path of the file written.

    A monitor that observed nothing (a fit that stepped no optimizer) gets one empty panel saying so.
    """
    path = os.fspath(path)
    if not os.path.splitext(path)[1]:
        path += ".png"
    series = {name: points for name, points in monitor.series.items() if points}
    fig = Figure(figsize=(8, 2.2 * max(len(series), 1)))
    axes = fig.subplots(max(len(series), 1), 1, sharex=True, squeeze=False)
    if not series:
        axes[0, 0].text(0.5, 0.5, "no steps observed", ha="center", va="center", transform=axes[0, 0].transAxes)
    for ax, (name, points) in zip(axes[: len(series), 0], series.items(), strict=True):
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, linewidth=1)
        ax.set_ylabel(name, fontsize=8)
        for event in monitor.events:
            ax.axvline(event.step, color=_EVENT_COLORS.get(event.kind, "gray"), alpha=0.4, linewidth=1)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle("training health (lines: alerts)", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    return path
