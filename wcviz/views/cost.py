"""What a checksum costs: throughput per model and digest backend (a :func:`wcviz.bench.checksum_cost` frame).

::

    model        backend  device  tensors      size  seconds     GB/s
    llama-tiny   torch    cpu          30  249.2 kB   0.0800  0.00312
    llama-tiny   numba    cpu          30  249.2 kB   0.0020    0.125
    llama-small  numba    cpu          57   20.0 MB   0.0700    0.286

Reads the cost frame's columns ``model``, ``backend``, ``nbytes``, ``seconds``
(and ``device``, ``params``, ``gbps`` when present); nothing is measured here.
Rates have 3 significant figures, so a slow backend never reads ``0.00``. Several
rows of one (model, backend), say two dtypes, are all drawn: each its own bar,
named by the columns that tell them apart (``numba (bf16)``), and the table shows
those columns.
:func:`plot_predicted_cost` draws :func:`wcviz.bench.predicted_cost`'s frame:
predicted seconds per model, with the measured ones beside them.
"""

from __future__ import annotations

import math
import textwrap
from typing import TYPE_CHECKING

import pandas as pd

from wcviz._errors import TableError
from wcviz._text import size

if TYPE_CHECKING:
    from collections.abc import Callable

    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["cost_text", "plot_cost", "plot_predicted_cost"]

_REQUIRED = ("model", "backend", "nbytes", "seconds")
# Okabe-Ito, in order: one hue per backend (statuses keep their own colours)
_BACKEND_COLORS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
# what a row measured or how it is drawn: never what tells two rows of one (model, backend) apart
_MEASURED = {"model", "backend", "device", "params", "nbytes", "seconds", "gbps", "predicted_s", "measured_s",
             "overhead_s", "rate_source", "label", "series"}


def _checked(cost: pd.DataFrame) -> pd.DataFrame:
    if not isinstance(cost, pd.DataFrame):
        raise TableError(f"expected a cost DataFrame, got {type(cost).__name__}")
    missing = [c for c in _REQUIRED if c not in cost]
    if missing:
        raise TableError(f"not a cost frame: no {', '.join(repr(c) for c in missing)} column (see wcviz.bench.checksum_cost)")
    out = cost.reset_index(drop=True).copy()
    secs, size = pd.to_numeric(out["seconds"], errors="coerce"), pd.to_numeric(out["nbytes"], errors="coerce")
    bad = ~((secs > 0) & (secs < math.inf)) | ~(size >= 0)  # a measurement of no time is no rate: an infinite bar
    if bool(bad.any()):
        r = out[bad].iloc[0]
        raise TableError(f"cost row {int(bad.to_numpy().nonzero()[0][0])} ({r['model']}, {r['backend']}): seconds must be a finite "
                         f"number > 0 and nbytes >= 0, got seconds={r['seconds']}, nbytes={r['nbytes']}")  # fmt: skip
    if "gbps" not in out:
        out["gbps"] = out["nbytes"] / out["seconds"] / 1e9
    if "device" not in out:
        out["device"] = pd.NA
    out["label"] = out["model"].astype(str)
    out["series"] = out["backend"].astype(str)
    if out["device"].nunique(dropna=True) > 1:  # the same backend on two devices is two bars
        out["series"] = out["series"] + " on " + out["device"].astype(str)
    return out


def _rate(gbps: float) -> str:
    """A rate in GB/s to 3 significant figures (``0.00455``, ``22.7``, ``1,410``, ``9.09e-08``): a slow rate is never ``0.00``."""
    if pd.isna(gbps) or not math.isfinite(gbps):
        return "-"
    g = float(f"{gbps:.3g}")  # rounded first: 9.996 is 10.0, not 10.00
    if g == 0 or abs(g) >= 100:
        return f"{g:,.0f}"
    if abs(g) < 0.001:  # bytes per second, not a row of zeros
        return f"{g:.2e}"
    return f"{g:.{2 - math.floor(math.log10(abs(g)))}f}"


def _distinct_series(c: pd.DataFrame, group: str) -> tuple[pd.DataFrame, list[str]]:
    """``c`` with ``series`` told apart where a (``group``, series) has several rows (two dtypes measured, say), and the
    columns that tell them apart.

    Every row of such a series is named ``numba (bf16)`` by those columns (by its size if only that differs,
    else ``#1``, ``#2``), so each is drawn as its own bar: none is dropped, none drawn over another."""
    key = c[group].astype(str)
    dup = pd.Series(c.assign(_g=key).duplicated(["_g", "series"], keep=False).to_numpy(), index=c.index)
    if not dup.any():
        return c, []
    groups = c[dup].assign(_g=key[dup]).groupby(["_g", "series"], sort=False)
    keys = [col for col in c.columns if col not in _MEASURED and col != group
            and bool((groups[col].nunique(dropna=False) > 1).any())]
    if keys:
        suffix = c[keys].astype("object").where(c[keys].notna(), "-").astype(str).agg(" ".join, axis=1)
    elif bool((groups["nbytes"].nunique(dropna=False) > 1).any()):
        suffix = c["nbytes"].map(size)
    else:
        suffix = pd.Series("", index=c.index)
    affected = c["series"].isin(set(c.loc[dup, "series"]))
    series = c["series"].where(~affected, c["series"] + " (" + suffix + ")")
    again = pd.Series(c.assign(_g=key, _s=series).duplicated(["_g", "_s"], keep=False).to_numpy(), index=c.index)
    if again.any():  # nothing tells them apart: numbered in frame order
        n = c.assign(_g=key, _s=series).groupby(["_g", "_s"], sort=False).cumcount() + 1
        series = series.where(~again, series.str.replace(r" \(\)$", "", regex=True) + " #" + n.astype(str))
    return c.assign(series=series.str.replace(r" \(\)$", "", regex=True)), keys


def cost_text(cost: pd.DataFrame) -> str:
    """The cost frame as a terminal table: one line per (model, backend), seconds and GB/s last."""
    c = _checked(cost)
    if not len(c):
        return "no measurements"
    _, keys = _distinct_series(c, "label")  # what tells two rows of one (model, backend) apart: shown
    table = pd.DataFrame({
        "model": c["model"].astype(str),
        "backend": c["backend"].astype(str),
        "device": c["device"].astype("object").where(c["device"].notna(), "-").astype(str),
        **{str(k): c[k].astype("object").where(c[k].notna(), "-").astype(str) for k in keys},
        "tensors": c["params"].map(lambda n: "-" if pd.isna(n) else f"{int(n):,}") if "params" in c else "-",
        "size": c["nbytes"].map(size),
        "seconds": c["seconds"].map(lambda s: f"{s:.4f}"),
        "GB/s": c["gbps"].map(_rate),
    })
    right = {"tensors", "size", "seconds", "GB/s"}
    widths = {k: max(len(k), *(len(v) for v in table[k])) for k in table}

    def line(values: dict[str, str]) -> str:
        return "  ".join(v.rjust(widths[k]) if k in right else v.ljust(widths[k]) for k, v in values.items()).rstrip()

    out = [line({k: k for k in table})]
    out.extend(line(dict(row)) for _, row in table.iterrows())
    return "\n".join(out)


def _figure(ax: Axes | None, size: tuple[float, float], title: str) -> tuple[Figure, Axes]:
    """``ax``'s figure, or a new :class:`~matplotlib.figure.Figure` (not registered with pyplot), titled."""
    from matplotlib.figure import Figure

    if ax is None:
        fig = Figure(figsize=size, layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.get_figure()  # type: ignore[assignment]  # a SubFigure draws and saves alike
    fits = max(20, int((fig.figure.get_size_inches()[0] - 1.0) * 72 / (10 * 0.62)))  # 10 pt characters right of the y labels
    ax.set_title(textwrap.fill(title, fits), fontsize=10, loc="left")  # wrapped and from the axes' left: never cut off
    return fig, ax


def _grouped_bars(
    ax: Axes, c: pd.DataFrame, group: str, value: str, labels: Callable[[pd.DataFrame], list[str]]
) -> list[tuple[list[float], pd.DataFrame]]:
    """A group of bars per ``group`` value (frame order, as text), a bar per ``series``, labelled by ``labels(rows)``.

    Every row is drawn (several rows of one series and group become series of their own, see
    :func:`_distinct_series`); a group whose rows differ in size shows the range under it.
    Returns each series' bar positions and rows, for marks drawn on top.
    """
    c, _ = _distinct_series(c.assign(**{group: c[group].astype(str)}), group)
    drawn = []
    groups = list(dict.fromkeys(c[group]))
    series = list(dict.fromkeys(c["series"]))
    width = 0.8 / len(series)
    for k, name in enumerate(series):
        mine = c[c["series"] == name].set_index(group)
        xs = [groups.index(m) - 0.4 + width * (k + 0.5) for m in mine.index]
        bars = ax.bar(xs, mine[value], width=width * 0.95, label=name, color=_BACKEND_COLORS[k % len(_BACKEND_COLORS)])
        ax.bar_label(bars, labels=labels(mine), fontsize=7, padding=2)
        drawn.append((xs, mine))
    lo, hi = c.groupby(group, sort=False)["nbytes"].min(), c.groupby(group, sort=False)["nbytes"].max()
    sizes = {m: size(lo[m]) if lo[m] == hi[m] else f"{size(lo[m])}–{size(hi[m])}" for m in groups}
    ax.set_xticks(range(len(groups)), [f"{m}\n{sizes[m]}" for m in groups], fontsize=8)
    ax.spines[["top", "right"]].set_visible(False)
    return drawn


def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def plot_cost(cost: pd.DataFrame, *, ax: Axes | None = None) -> Figure:
    """Grouped bars of checksum throughput (GB/s, log scale): a group per model, a bar per backend, the time on each bar.

    Models keep the frame's order; a backend measured on several devices is one
    bar per device, and several rows of one model and backend (two dtypes) are a bar
    each, named by what tells them apart (``numba (bf16)``). A long title wraps. Draws on ``ax`` when given, else on a new
    :class:`~matplotlib.figure.Figure` (not registered with pyplot).
    """
    c = _checked(cost)
    n_bars = c["label"].nunique() * max(1, _distinct_series(c, "label")[0]["series"].nunique())
    fig, ax = _figure(ax, (min(14.0, max(5.0, 2.5 + 0.66 * n_bars)), 3.6), "checksum throughput per model and backend (time on each bar)")
    if not len(c):
        _empty(ax, "no measurements")
        return fig
    _grouped_bars(ax, c, "label", "gbps", lambda rows: [_duration(s) for s in rows["seconds"]])
    ax.set_yscale("log")  # backends differ by orders of magnitude: on a linear axis the slow one reads as zero
    ax.set_ylabel("GB/s (log)")
    ax.margins(y=0.15)
    ax.legend(title="backend", fontsize=8, title_fontsize=8, frameon=False)
    return fig


def _duration(seconds: float) -> str:
    """``28.5 min``, ``6.4 s``, ``891 µs``: a bar label that stays short across six decades."""
    if seconds >= 60:
        return f"{seconds / 60:.3g} min"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


_PREDICTED = ("model", "backend", "device", "nbytes", "predicted_s", "measured_s")


def plot_predicted_cost(cost: pd.DataFrame, *, ax: Axes | None = None) -> Figure:
    """Seconds to digest each model, per backend and device: predicted (bars) and measured (dots).

    Bars are predictions from measured rates (``wcviz bench``), on a log scale
    since models span 0.2 MB to 141 GB; a black dot marks a whole-model digest
    actually timed. Series from recorded GPU runs carry their date and device
    in the legend (``rate_source``).
    """
    if not isinstance(cost, pd.DataFrame) or any(c not in cost for c in _PREDICTED):
        missing = [c for c in _PREDICTED if not isinstance(cost, pd.DataFrame) or c not in cost]
        raise TableError(f"not a predicted-cost frame: no {', '.join(map(repr, missing))} (see wcviz.bench.predicted_cost)")
    c = cost.reset_index(drop=True).copy()
    source = c["rate_source"].astype(str) if "rate_source" in c else pd.Series("", index=c.index)
    c["series"] = c["backend"].astype(str) + " on " + c["device"].astype(str)
    c.loc[source.str.startswith("recorded"), "series"] += " (" + source + ")"
    fig, ax = _figure(ax, (min(14.0, max(7.0, 1.6 * c["model"].nunique() + 2)), 4.0),
                      "digest time per model: predicted from measured rates (bars), measured (dots)")
    if not len(c):
        _empty(ax, "no predictions")
        return fig
    for xs, mine in _grouped_bars(ax, c, "model", "predicted_s", lambda rows: [_duration(s) for s in rows["predicted_s"]]):
        seen = mine["measured_s"].notna()
        if seen.any():
            ax.scatter([x for x, ok in zip(xs, seen) if ok], mine["measured_s"][seen], color="black", marker="D", s=18,
                       edgecolors="white", linewidths=0.8, zorder=3,
                       label="measured" if "measured" not in ax.get_legend_handles_labels()[1] else None)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (log)")
    ax.margins(y=0.2)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2 if c["model"].nunique() < 4 else 4)
    return fig
