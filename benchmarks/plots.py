"""Figures of the convoy experiment (seed 000): TTFT CDFs per policy (its figure 9) and
TTFT over arrival time (its figure 1b), written as PNG files.

Figures are built with matplotlib's object API on an Agg canvas (no pyplot), so nothing
global is touched and no display is needed.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from medha_jax.latency_report import LatencyRecord

REQUEST_CLASSES = ("short", "long", "all")


def _select(records: Sequence[LatencyRecord], request_class: str) -> list[LatencyRecord]:
    if request_class not in REQUEST_CLASSES:
        raise ValueError(f"request_class must be one of {REQUEST_CLASSES}, got {request_class!r}")
    if request_class == "all":
        return list(records)
    return [r for r in records if r.is_long == (request_class == "long")]


def _save(fig: Figure, path: str | os.PathLike) -> str:
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120)
    return path


def plot_ttft_cdfs(panels: Mapping[str, Mapping[str, Sequence[LatencyRecord]]],
                   path: str | os.PathLike, *, request_class: str = "short",
                   title: str = "") -> str:
    """One panel per entry of `panels` (e.g. per QPS), one CDF curve per policy in it.

    panels: {panel title: {policy: records}}. The x axis (TTFT, s) is logarithmic, as in
    the paper: convoys show as curves pushed right by orders of magnitude. A curve ends
    below 1 when some requests never got a first token (a truncated CDF).
    Returns the path written.
    """
    fig = Figure(figsize=(4.5 * max(len(panels), 1), 3.8), layout="constrained")
    axes = fig.subplots(1, max(len(panels), 1), squeeze=False)[0]
    for ax, (panel_title, runs) in zip(axes, panels.items()):
        for policy, records in runs.items():
            chosen = _select(records, request_class)
            ttfts = np.sort([r.ttft_s for r in chosen if r.ttft_s is not None])
            if not len(ttfts):
                continue
            # Fraction of all requests of the class, so unfinished ones truncate the curve.
            cdf = np.arange(1, len(ttfts) + 1) / len(chosen)
            ax.step(np.maximum(ttfts, 1e-4), cdf, where="post", label=policy)
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel(f"TTFT of {request_class} requests (s)")
        ax.set_ylabel("CDF")
        ax.set_title(panel_title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_ttft_over_time(runs: Mapping[str, Sequence[LatencyRecord]],
                        path: str | os.PathLike, *, title: str = "") -> str:
    """TTFT of short requests against their arrival time, one series per policy; the
    arrivals of long requests are marked, so a convoy reads as a spike after one.
    Returns the path written."""
    fig = Figure(figsize=(9, 3.8), layout="constrained")
    ax = fig.subplots()
    long_arrivals: set[float] = set()
    for policy, records in runs.items():
        short = [r for r in records if not r.is_long and r.ttft_s is not None]
        ax.plot([r.arrival_s for r in short], [max(r.ttft_s, 1e-4) for r in short],
                marker=".", markersize=3, linewidth=0.6, label=policy)
        long_arrivals.update(r.arrival_s for r in records if r.is_long)
    for i, t in enumerate(sorted(long_arrivals)):
        ax.axvline(t, color="gray", alpha=0.35, linewidth=0.8,
                   label="long request arrives" if i == 0 else None)
    ax.set_yscale("log")
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("TTFT of short requests (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    if title:
        ax.set_title(title)
    return _save(fig, path)
