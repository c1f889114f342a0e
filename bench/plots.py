"""Plots for the benchmarks' sections of docs/benchmarks.md.

Each function draws one figure from raw samples, writes it as a PNG named
``<bench>-<name>.png`` into ``out_dir`` (by default docs/img) and returns its path relative
to the markdown file (``img/<bench>-<name>.png``), for a ``![caption](path)`` line under the
bench's table. Matplotlib runs on the Agg backend: no display is needed.

A bench draws its plots only with ``--write``, into the ``img`` folder beside the file it
writes (:func:`img_dir`), so the pictures always match the numbers in the tables.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.axis import Axis  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter  # noqa: E402

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "img")
FIGSIZE = (7.0, 4.0)  # inches; at DPI 110: 770 x 440 px, readable at the docs' width
DPI = 110
# one colour per series, in order: the baseline first (grey), then dsec (blue), then the others
COLORS = ["#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*", "h"]
STYLE: dict[str, Any] = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linestyle": "-",
    "figure.facecolor": "white",
    "axes.facecolor": "white",
    "savefig.facecolor": "white",
}
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")

Series = Mapping[str, Sequence[float]]


def img_dir(markdown: str) -> str:
    """The folder for a results file's pictures: ``img`` beside it."""
    return os.path.join(os.path.dirname(os.path.abspath(markdown)), "img")


def image_link(caption: str, path: str) -> str:
    """The markdown line that shows a picture."""
    return f"![{caption}]({path})"


@contextmanager
def _figure(title: str, figsize: tuple[float, float] = FIGSIZE) -> Iterator[tuple[Figure, Axes]]:
    with plt.rc_context(STYLE):  # type: ignore[arg-type]  # matplotlib types the keys as literals
        fig, ax = plt.subplots(figsize=figsize, dpi=DPI)
        try:
            ax.set_title(title)
            yield fig, ax
        finally:
            plt.close(fig)


def _save(fig: Figure, bench: str, name: str, out_dir: str | None) -> str:
    for part in (bench, name):
        if not _NAME.match(part):
            raise ValueError(f"{part!r}: use lower-case letters, digits, '-', '_' and '.'")
    out_dir = out_dir or DEFAULT_DIR
    os.makedirs(out_dir, exist_ok=True)
    fname = f"{bench}-{name}.png"
    fig.tight_layout()
    # no Software/date metadata: the same figure gives the same file
    fig.savefig(os.path.join(out_dir, fname), dpi=DPI, metadata={"Software": None})
    return f"img/{fname}"


def _plain_log(axis: Axis) -> None:
    """Ticks of a log axis (after plotting) at 1, 2, 5 x 10^k, or every digit on a short
    range, written as plain numbers (20, not 2 x 10^1)."""
    lo, hi = sorted(axis.get_view_interval())
    lo = max(lo, 1e-12)
    ks = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    for subs in ((1, 2, 5), (1, 2, 3, 5, 7), tuple(range(1, 10))):
        ticks = [m * 10.0**k for k in ks for m in subs if lo <= m * 10.0**k <= hi]
        if len(ticks) >= 3:
            break
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _nonempty(series: Series) -> dict[str, list[float]]:
    out = {k: [float(v) for v in vs if v == v] for k, vs in series.items()}  # drops NaN
    out = {k: v for k, v in out.items() if v}
    if not out:
        raise ValueError("no samples to plot")
    return out


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def latency_cdf(series: Series, *, bench: str, name: str, title: str, xlabel: str = "latency (ms)",
                unit: str = "ms", logx: bool = False, out_dir: str | None = None) -> str:
    """Empirical CDFs of several latency series (e.g. baseline vs dsec), the median marked on each."""
    data = _nonempty(series)
    with _figure(title) as (fig, ax):
        for i, (label, xs) in enumerate(data.items()):
            s = sorted(xs)
            ys = [(k + 1) / len(s) for k in range(len(s))]
            med = _median(s)
            ax.step(s, ys, where="post", color=COLORS[i % len(COLORS)], linewidth=1.8,
                    label=f"{label} (n={len(s)}, p50 {_fmt(med)} {unit})")
            ax.plot([med], [0.5], marker=MARKERS[i % len(MARKERS)], color=COLORS[i % len(COLORS)], markersize=6)
        ax.axhline(0.5, color="black", linewidth=0.6, linestyle=":")
        if logx:
            ax.set_xscale("log")
            _plain_log(ax.xaxis)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel(xlabel + (" (log scale)" if logx else ""))
        ax.set_ylabel("fraction of samples <= x")
        ax.legend(loc="best")
        return _save(fig, bench, name, out_dir)


def latency_histogram(series: Series, *, bench: str, name: str, title: str, xlabel: str = "latency (ms)",
                      unit: str = "ms", bins: int = 30, logx: bool = False, out_dir: str | None = None) -> str:
    """Overlaid histograms of several latency series on shared bins (log-spaced with ``logx``)."""
    data = _nonempty(series)
    lo = min(min(v) for v in data.values())
    hi = max(max(v) for v in data.values())
    if logx and lo > 0:
        edges = [lo * (hi / lo) ** (k / bins) for k in range(bins + 1)] if hi > lo else [lo * 0.9, lo * 1.1]
    else:
        logx = False
        edges = [lo + (hi - lo) * k / bins for k in range(bins + 1)] if hi > lo else [lo - 0.5, lo + 0.5]
    with _figure(title) as (fig, ax):
        for i, (label, xs) in enumerate(data.items()):
            c = COLORS[i % len(COLORS)]
            ax.hist(xs, bins=edges, histtype="stepfilled", alpha=0.25, color=c)
            ax.hist(xs, bins=edges, histtype="step", linewidth=1.6, color=c,
                    label=f"{label} (n={len(xs)}, p50 {_fmt(_median(xs))} {unit})")
        if logx:
            ax.set_xscale("log")
            _plain_log(ax.xaxis)
        ax.set_xlabel(xlabel + (" (log scale)" if logx else ""))
        ax.set_ylabel("samples")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # headroom for the legend
        ax.legend(loc="best")
        return _save(fig, bench, name, out_dir)


def throughput_vs_concurrency(series: Mapping[str, Mapping[int, float]], *, bench: str, name: str, title: str,
                              ylabel: str = "calls/s", xlabel: str = "concurrent clients", logy: bool = False,
                              out_dir: str | None = None) -> str:
    """One line with markers per series: throughput at each concurrency (x on a log2 scale)."""
    if not any(series.values()):
        raise ValueError("no samples to plot")
    xs_all = sorted({x for pts in series.values() for x in pts})
    with _figure(title) as (fig, ax):
        for i, (label, pts) in enumerate(series.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker=MARKERS[i % len(MARKERS)], color=COLORS[i % len(COLORS)],
                    linewidth=1.8, markersize=6, label=label)
        if len(xs_all) > 1 and min(xs_all) > 0 and max(xs_all) / min(xs_all) >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs_all)
        ax.set_xticklabels([str(x) for x in xs_all])
        ax.minorticks_off()
        if logy:
            ax.set_yscale("log")
            _plain_log(ax.yaxis)
        else:
            ax.set_ylim(bottom=0)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel + (" (log scale)" if logy else ""))
        ax.legend(loc="best")
        return _save(fig, bench, name, out_dir)


def density_curve(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], *, bench: str, name: str,
                  title: str, xlabel: str = "sandboxes", ylabel: str = "memory (MiB)",
                  markers: bool = True, hlines: Mapping[str, float] | None = None,
                  styles: Mapping[str, Mapping[str, Any]] | None = None, out_dir: str | None = None) -> str:
    """Lines of y against x (e.g. memory or latency against the number of sandboxes or the
    load), one per series; ``hlines`` draws labelled horizontal references (targets, limits);
    ``styles`` overrides a series' line (``color``, ``linestyle``, ...), e.g. to pair p50 and p90."""
    if not any(len(xs) for xs, _ in series.values()):
        raise ValueError("no samples to plot")
    with _figure(title) as (fig, ax):
        for i, (label, (xs, ys)) in enumerate(series.items()):
            if len(xs) != len(ys):
                raise ValueError(f"{label}: {len(xs)} x values, {len(ys)} y values")
            many = len(xs) > 25
            kw: dict[str, Any] = {"color": COLORS[(i + 1) % len(COLORS)], "linewidth": 1.8,
                                  "marker": MARKERS[i % len(MARKERS)] if markers else None,
                                  "markersize": 3 if many else 6}
            ax.plot(xs, ys, label=label, **(kw | dict((styles or {}).get(label, {}))))
        for j, (label, y) in enumerate((hlines or {}).items()):
            ax.axhline(y, color="black", linewidth=0.9, linestyle=("--", ":", "-.")[j % 3], label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.legend(loc="best")
        return _save(fig, bench, name, out_dir)


def bar_compare(groups: Sequence[str], series: Mapping[str, Sequence[float]], *, bench: str, name: str,
                title: str, ylabel: str, logy: bool = False, errors: Mapping[str, Sequence[float]] | None = None,
                baseline_group: int | None = None, out_dir: str | None = None) -> str:
    """Grouped bars: one group per entry of ``groups``, one bar per series, the value on each bar;
    a NaN value leaves its bar out. ``errors`` (same shape) draws error bars (e.g. p90 - p50).
    With several series the first is the baseline (grey); a single series is drawn in dsec's
    colour, except the group ``baseline_group`` (grey)."""
    if not groups or not series:
        raise ValueError("no samples to plot")
    for label, vals in series.items():
        if len(vals) != len(groups):
            raise ValueError(f"{label}: {len(vals)} values for {len(groups)} groups")
    n = len(series)
    width = 0.8 / n
    with _figure(title) as (fig, ax):
        top = 0.0
        for i, (label, vals) in enumerate(series.items()):
            xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
            keep = [k for k, v in enumerate(vals) if v == v]
            err = None
            if errors and label in errors:
                err = [[0.0 for _ in keep], [errors[label][k] for k in keep]]
            if n == 1:
                color: Any = [COLORS[0] if k == baseline_group else COLORS[1] for k in keep]
            else:
                color = COLORS[i % len(COLORS)]
            bars = ax.bar([xs[k] for k in keep], [vals[k] for k in keep], width=width * 0.95,
                          color=color, label=label, yerr=err, capsize=3 if err else 0)
            ax.bar_label(bars, labels=[_fmt(vals[k]) for k in keep], padding=2, fontsize=8)
            top = max([top, *(vals[k] for k in keep)])
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups)
        if logy:
            ax.set_yscale("log")
            _plain_log(ax.yaxis)
        elif top > 0:
            ax.set_ylim(0, top * 1.15)
        ax.set_ylabel(ylabel + (" (log scale)" if logy else ""))
        ax.grid(axis="x", visible=False)
        if n > 1:
            ax.legend(loc="best")
        return _save(fig, bench, name, out_dir)


def _fmt(v: float) -> str:
    if v != v or math.isinf(v):
        return str(v)
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"
