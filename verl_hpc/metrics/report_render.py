"""Draw `report.Panel`s into one PNG, and wrap it with the summary in a self-contained HTML page.

Why one PNG and base64 in the HTML: the report is copied off a cluster by scp or attached
to an issue; a single file with nothing to fetch survives both. Agg only: login and
compute nodes have no display.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verl_hpc.metrics.report import Panel, Series, load_run, report_panels_of, summary_text

COLUMNS = 2
PANEL_W, PANEL_H, DPI = 7.0, 3.6, 100  # inches per panel; 1400 px wide for two columns


def figure_size(n_panels: int) -> tuple[int, int]:
    """The PNG's width and height in pixels for `n_panels` (tests check the file against it)."""
    rows = math.ceil(n_panels / COLUMNS)
    return int(COLUMNS * PANEL_W * DPI), int(rows * PANEL_H * DPI)


def render_png(panels: Sequence[Panel], path: str | Path, title: str, xlabel: str) -> Path:
    """One grid of panels, every panel with the restart lines; returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = math.ceil(len(panels) / COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(COLUMNS * PANEL_W, rows * PANEL_H), dpi=DPI, squeeze=False)
    try:
        xlim = _shared_xlim(panels)
        for ax, panel in zip(axes.flat, panels, strict=False):
            _draw_panel(ax, panel, xlabel)
            if xlim is not None:
                ax.set_xlim(*xlim)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        fig.suptitle(title)
        fig.tight_layout(rect=(0, 0, 1, 0.98))
        path = Path(path)
        fig.savefig(path, dpi=DPI)  # no bbox_inches="tight": the pixel size stays what figure_size says
    finally:
        plt.close(fig)
    return path


def _shared_xlim(panels: Sequence[Panel]) -> tuple[float, float] | None:
    """One x range for all panels, so a restart line sits at the same place in each of them."""
    xs = [x for p in panels for s in p.series for x in s.x] + [m.x for p in panels for m in p.markers]
    if not xs:
        return None
    pad = (max(xs) - min(xs)) * 0.02 or 0.5
    return min(xs) - pad, max(xs) + pad


def _draw_panel(ax: Any, panel: Panel, xlabel: str) -> None:
    ax.set_title(panel.title, fontsize=10)
    ax.set_ylabel(panel.ylabel)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    if not panel.has_data:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray", fontsize=14)
    else:
        _draw_stack(ax, [s for s in panel.series if s.style == "stack" and s.y], [m.x for m in panel.markers])
        for s in panel.series:
            if s.y and s.style == "line":
                xs, ys = _broken_at(s, [m.x for m in panel.markers])
                ax.plot(xs, ys, label=s.label, linewidth=1.2, marker="." if len(s.y) < 50 else None)
            elif s.y and s.style == "points":
                ax.scatter(s.x, s.y, label=s.label, s=24, zorder=3)
    for marker in panel.markers:
        ax.axvline(marker.x, color="red", linestyle="--", linewidth=1)
        ax.annotate(marker.label, xy=(marker.x, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                    va="top", ha="right", fontsize=7, color="red")
    if panel.has_data:
        ax.legend(fontsize=7, loc="best")


def _broken_at(s: Series, cuts: list[float]) -> tuple[list[float], list[float]]:
    """The series with a NaN at each restart: no line drawn across the time the run was down."""
    points = sorted([*zip(s.x, s.y, strict=True), *((c, math.nan) for c in cuts)])
    return [p[0] for p in points], [p[1] for p in points]


def _draw_stack(ax: Any, stack: list[Series], cuts: list[float]) -> None:
    """Stage seconds stacked on the union of their x values (a stage absent at a step counts 0),
    one stack per stretch between restarts: no area drawn across the time the run was down."""
    if not stack:
        return
    import matplotlib

    colors = [c["color"] for c in matplotlib.rcParams["axes.prop_cycle"]]
    xs = sorted({x for s in stack for x in s.x})
    edges = [-math.inf, *sorted(cuts), math.inf]
    labels: list[str] = [s.label for s in stack]  # on the first stretch only: one legend entry per stage
    for lo, hi in zip(edges, edges[1:], strict=False):
        part = [x for x in xs if lo <= x < hi]
        if part:
            ys = [[dict(zip(s.x, s.y, strict=True)).get(x, 0.0) for x in part] for s in stack]
            ax.stackplot(part, ys, labels=labels, alpha=0.8,
                         colors=[colors[i % len(colors)] for i in range(len(stack))])
            labels = []


def write_html(png: Path, summary: str, path: str | Path, title: str) -> Path:
    """The summary and the PNG (inline, base64) in one page that needs nothing else."""
    data = base64.b64encode(Path(png).read_bytes()).decode("ascii")
    page = (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title></head>\n"
            f"<body style=\"font-family: sans-serif\">\n<h1>{html.escape(title)}</h1>\n"
            f"<pre>{html.escape(summary)}</pre>\n"
            f"<img alt=\"run report\" style=\"max-width: 100%\" src=\"data:image/png;base64,{data}\">\n"
            "</body></html>\n")
    path = Path(path)
    path.write_text(page)
    return path


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> tuple[str, Path, Path]:
    """The summary, `report.png` and `report.html` (in `out_dir`, default RUN_DIR/report)."""
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    summary = summary_text(run)
    title = f"verl-hpc run {run.run_dir.resolve().name}"
    png = render_png(report_panels_of(run), out / "report.png", title, f"wall-clock {run.unit[0]}"
                     if run.t0 is not None else "step")
    return summary, png, write_html(png, summary, out / "report.html", title)
