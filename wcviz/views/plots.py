"""Verdicts as a heatmap: model parts down, ranks across, one fixed colour per status.

matplotlib is imported inside the function, so ``import wcviz.views`` stays
cheap; figures are made with ``matplotlib.figure.Figure`` (never pyplot), so
none is left registered and nothing needs a display.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from wcviz.views._grid import SEVERITY, grid_of, keep_mask, nonmatch_counts, whole_rank_notes, worst_severity

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["COLORS", "FILTERED_COLOR", "NOT_HELD_COLOR", "plot_layer_rank"]

# Okabe-Ito hues where they fit: red and orange are the alarms, black a rank that never answered
COLORS = {
    "corrupted": "#B2182B",  # dark red: a third value
    "mismatch": "#CC79A7",  # reddish purple
    "drift": "#F0E442",  # yellow: dtype or shape changed
    "unwritten": "#E69F00",  # orange: still the poison
    "missing": "#0072B2",  # blue
    "empty": "#666666",  # dark grey: the rank answered with nothing
    "unreachable": "#222222",  # near black: the rank did not answer
    "unexpected": "#56B4E9",  # sky blue
    "unproven": "#C9B8E0",  # pale violet: looks right, but the reset proved nothing
    "match": "#D9E6D9",  # light grey-green
}
NOT_HELD_COLOR = "#FFFFFF"
FILTERED_COLOR = "#F2F2F2"  # a cell whose rows a filter left out: there, but not what is being looked at
assert set(COLORS) == set(SEVERITY)

_ANNOTATE_BELOW = 400  # cells; above this, counts would not be legible
_FONT = 7.0  # points, tick labels


def _ticks(labels: list[str], room_in: float, layered: bool) -> list[int]:
    """Positions to label so labels do not overlap in ``room_in`` inches; layers thin on round numbers."""
    fit = max(1, int(room_in / (_FONT * 1.5 / 72)))
    step = max(1, math.ceil(len(labels) / fit))
    if step == 1:
        return list(range(len(labels)))
    if not layered:
        return list(range(0, len(labels), step))
    named = [i for i, name in enumerate(labels) if not name.startswith("layer ")]  # embed, norm, head, other
    round_layers = [
        i for i, name in enumerate(labels)
        if name.startswith("layer ") and int(name.split()[1]) % step == 0 and all(abs(i - j) >= step for j in named)
    ]
    return sorted(named + round_layers)


def _ink(color: str) -> str:
    """Black or white text, whichever reads on ``color``."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(color)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


_PROBLEM_EDGE = "#B2182B"
_MIN_CELL_PX = 4.0  # a cell narrower or lower than this may vanish in the image: its findings get a marker
_MARKER_PT = 4.0


def _cells(ax: Axes, where: np.ndarray, hatch: str, edge: str, gid: str) -> None:
    """Hatch the cells ``where`` marks (a part × rank boolean array) with one collection."""
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    rects = [Rectangle((j - 0.5, i - 0.5), 1.0, 1.0) for i, j in zip(*where.nonzero())]
    coll = PatchCollection(rects, facecolor="none", edgecolor=edge, hatch=hatch, linewidth=0.0)
    coll.set_gid(gid)
    ax.add_collection(coll, autolim=False)


def _hatch_partly(ax: Axes, worst: pd.DataFrame, partly: pd.DataFrame) -> list:
    """Cells with rows both kept and filtered out: hatched grey; and every cell whose filtered-out rows are not
    all match, partly or wholly filtered out, hatched dark red (a finding the filter hides is never plain grey)."""
    from matplotlib.patches import Patch

    mixed = (worst.notna() & partly.notna()).to_numpy()
    hidden_bad = partly.notna().to_numpy() & (partly.fillna(len(SEVERITY)).to_numpy() != SEVERITY.index("match"))
    handles = []
    if (mixed & ~hidden_bad).any():
        _cells(ax, mixed & ~hidden_bad, "///", "#8C8C8C", "filtered")
        handles.append(Patch(facecolor="white", edgecolor="#8C8C8C", hatch="///", label="partly filtered out"))
    if hidden_bad.any():
        _cells(ax, hidden_bad, "xxx", _PROBLEM_EDGE, "filtered_problem")
        handles.append(Patch(facecolor="white", edgecolor=_PROBLEM_EDGE, hatch="xxx", label="filtered out here:\nrows not match"))
    return handles


def _mark_nonmatch(ax: Axes, fig: Figure, worst: pd.DataFrame, colors: list[str]) -> list:
    """Where cells are smaller than a few pixels, every non-match cell again as a marker that stays visible."""
    from matplotlib.lines import Line2D

    n_rows, n_cols = worst.shape
    box = ax.get_position()
    w_in, h_in = fig.figure.get_size_inches()
    cell_w = box.width * w_in * fig.figure.dpi / max(1, n_cols)
    cell_h = box.height * h_in * fig.figure.dpi / max(1, n_rows)
    if min(cell_w, cell_h) >= _MIN_CELL_PX:
        return []
    sev = worst.fillna(len(SEVERITY)).to_numpy(dtype=int)
    bad = sev < SEVERITY.index("match")
    if not bad.any():
        return []
    rows, cols = bad.nonzero()
    order = np.argsort(-sev[rows, cols], kind="stable")  # the worst drawn last, on top
    rows, cols = rows[order], cols[order]
    lims = ax.get_xlim(), ax.get_ylim()
    points = ax.scatter(cols, rows, s=_MARKER_PT**2, marker="s", c=[colors[k] for k in sev[rows, cols]],
                        edgecolors="black", linewidths=0.3, zorder=3)
    points.set_gid("nonmatch")
    ax.set_xlim(*lims[0])
    ax.set_ylim(*lims[1])  # the image's extent, not the markers'
    return [Line2D([], [], linestyle="none", marker="s", markersize=_MARKER_PT, markerfacecolor="white", markeredgecolor="black",
                   label="cell not match\n(enlarged: the cells\nare too small to see)")]


def plot_layer_rank(
    verdicts: pd.DataFrame, *, ax: Axes | None = None, title: str | None = None, keep: Sequence[bool] | pd.Series | None = None
) -> Figure:
    """A heatmap of the worst status per (model part, rank); returns the figure drawn on.

    Rows are model parts in model order, columns ranks in identity order
    labelled by coordinates (as :func:`wcviz.views.layer_rank_grid`); colours
    are :data:`COLORS` (white where the rank holds nothing of that part). The
    legend lists the statuses drawn. Grids under 400 cells show the count of
    non-``match`` rows about parameters in each cell: a rank that did not answer, or
    answered with nothing (a whole-rank ``unreachable``/``empty`` row), is drawn in its
    colour in every part and labelled ``(no answer)``/``(empty)`` under it, never counted. Tick labels are thinned to what fits, so
    64 ranks × 80 layers stays readable. Draws on ``ax`` when given, else on a
    new :class:`~matplotlib.figure.Figure` sized to the grid (not registered
    with pyplot). ``keep``: one flag per verdict row, what a filter keeps; cells
    whose rows are all filtered out are drawn in :data:`FILTERED_COLOR` (light grey,
    "filtered out"), counts count the kept rows only, and a cell that is only partly
    filtered is hatched (gid ``filtered``; in dark red, gid ``filtered_problem``, where
    the rows filtered out of it are not all ``match``), so no filter makes a finding
    look like a match; the title then says "(filtered)". Where the grid has more
    ranks or parts than the image has pixels, every non-``match`` cell is drawn again
    as a marker of a few points (gid ``nonmatch``), so none is lost in the resampling.
    """
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    lay = grid_of(verdicts)
    kept = None if keep is None else keep_mask(keep, lay.n_rows)  # checked before anything reads it
    held = worst_severity(lay)
    worst = worst_severity(lay, kept) if kept is not None else held
    n_rows, n_cols = worst.shape
    notes = whole_rank_notes(lay)  # a rank that did not answer (or held nothing): said under it, not counted in its cells
    xlabels = [r + (f" ({notes[r]})" if r in notes else "") for r in lay.ranks]
    if ax is None:
        width = min(16.0, max(5.0, 3.5 + 0.22 * n_cols))
        longer = max([len(x) - 12 for x in xlabels] + [0]) * _FONT * 0.6 / 72  # a URL under a column needs the room
        height = min(14.0, max(2.5, 1.4 + 0.2 * n_rows) + longer)
        fig = Figure(figsize=(width, height), layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.get_figure()  # type: ignore[assignment]  # a SubFigure draws and saves alike
    if kept is not None:
        cut = ~kept
        partly = worst_severity(lay, cut) if cut.any() else None  # worst status of what the filter left out, per cell
    else:
        partly = None
    filtered = partly is not None and bool(partly.notna().to_numpy().any())
    shown_title = title if title is not None else "worst status per model part and rank"
    ax.set_title(shown_title + (" (filtered)" if filtered and title is None else ""))
    if not n_rows:
        ax.text(0.5, 0.5, "no verdicts", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return fig

    colors = [COLORS[s] for s in SEVERITY] + [NOT_HELD_COLOR, FILTERED_COLOR]
    codes = worst.fillna(len(SEVERITY)).astype(int).to_numpy().copy()
    codes[(worst.isna() & held.notna()).to_numpy()] = len(SEVERITY) + 1  # held, but every row filtered out
    cmap = ListedColormap(colors)
    norm = BoundaryNorm([i - 0.5 for i in range(len(colors) + 1)], len(colors))
    ax.imshow(codes, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")

    size = fig.figure.get_size_inches()
    box = ax.get_position()
    rows = _ticks(lay.parts, box.height * size[1], layered=True)
    cols = _ticks(lay.ranks, box.width * size[0], layered=False)
    ax.set_yticks(rows, [lay.parts[i] for i in rows], fontsize=_FONT)
    ax.set_xticks(cols, [xlabels[i] for i in cols], fontsize=_FONT, rotation=90)
    ax.set_xlabel("rank")
    ax.set_ylabel("model part")
    ax.tick_params(length=2)

    if n_rows * n_cols < _ANNOTATE_BELOW:
        ax.set_xticks([i - 0.5 for i in range(1, n_cols)], minor=True)
        ax.set_yticks([i - 0.5 for i in range(1, n_rows)], minor=True)
        ax.grid(which="minor", color="white", linewidth=0.8)
        ax.tick_params(which="minor", length=0)
        counts = nonmatch_counts(lay, kept).to_numpy()
        for i in range(n_rows):
            for j in range(n_cols):
                n = counts[i, j]
                if not pd.isna(n) and n > 0:
                    ax.text(j, i, str(int(n)), ha="center", va="center", fontsize=_FONT, color=_ink(colors[codes[i, j]]))

    drawn = sorted({int(c) for c in codes.ravel()})
    extra = {len(SEVERITY): "not held", len(SEVERITY) + 1: "filtered out"}
    handles = [Patch(facecolor=colors[c], edgecolor="#888888", label=SEVERITY[c] if c < len(SEVERITY) else extra[c]) for c in drawn]
    if partly is not None:
        handles += _hatch_partly(ax, worst, partly)
    handles += _mark_nonmatch(ax, fig, worst, colors)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8, title="status", title_fontsize=8)
    return fig
