"""The engine's ranks drawn as its parallel layout: hosts, DP replicas, PP stages × TP ranks.

::

    topology: 4 ranks, pp 2 × tp 2, on 1 host
    host node-a (trainer on this host)
          tp0   tp1
      pp0 r0 .  r1 U1
      pp1 r2 x1 r3 C2
    legend: C corrupted  U unwritten  x missing  . match
    trainer on 1 host: node-a; colocated with the engine on node-a

Each cell is one engine rank: its rank, the mark (:data:`~wcviz.views.MARKS`) or
colour (:data:`~wcviz.views.COLORS`) of its worst status and how many of its rows
are not ``match`` (``no answer`` / ``empty`` for a rank that did not answer or held
no parameters: its one row is no parameter). Rows are (DP replica, PP stage), columns TP ranks, grouped under
the host that runs them; without any TP coordinate a row's ranks stand side by side in rank order.
A rank without a coordinate the layout uses (an agent known only by its URL, say) is never
guessed into place: it is drawn last, under ``unplaced (no rank coordinates)``, one row each,
named by its URL (or its label). Rows of
role ``trainer`` (column ``role``, else ``role_actual``) are not drawn: they mark the
hosts the trainer shares with the engine, and a note under the drawing says what they
hold (``not shown: trainer rows: 1 mismatch on 1 rank (rank 1 (pp=0 tp=1)), 3 match``),
so a finding on a trainer rank is never hidden (a frame of trainer rows only is drawn as
it is). Both verdict kinds are read; only ``status``, the identity columns,
``host`` and the role column are used.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pandas as pd

from wcviz._errors import TableError
from wcviz._text import plural
from wcviz.verdicts import status_parts
from wcviz.views._grid import SEVERITY, WHOLE_RANK_NOTE, _severity, grid_of
from wcviz.views.plots import COLORS, _ink
from wcviz.views.text import MARKS

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_topology", "topology_text"]

TRAINER = "trainer"
COLOCATED = "trainer on this host"
_NO_HOST = "\x00no host"  # groups ranks that never said where they run; never shown
UNPLACED = "unplaced (no rank coordinates)"  # the group of ranks that cannot be put at a (dp, pp, tp)
_MATCH = SEVERITY.index("match")


@dataclass(frozen=True)
class HostGroup:
    """The engine ranks one host runs: ``host`` (None when not reported), whether the
    trainer runs there too, and its rows as (DP replica, PP stage) with their labels.
    ``unplaced``: the group of ranks without the coordinates to place them (a row each,
    labelled by the rank: its URL when it has no coordinate at all)."""

    host: str | None
    colocated: bool
    rows: list[str]
    dps: list[int]
    unplaced: bool = False

    @property
    def title(self) -> str:
        if self.unplaced:
            return UNPLACED
        return "host unknown" if self.host is None else f"host {self.host}"


@dataclass(frozen=True)
class Topology:
    """Where every engine rank is drawn: what :func:`topology_text` and :func:`plot_topology` read.

    ``cells``: one row per cell with ``group`` (index into ``groups``), ``row``
    (index into the group's ``rows``), ``col`` (index into ``columns``), ``label``
    (``r5``; ``r5+2`` when several ranks share a position), ``severity`` (worst,
    index into ``SEVERITY``), ``count`` (non-match rows about parameters) and ``note``
    (``no answer``/``empty`` where a whole-rank row speaks for the rank, else "").
    ``groups``: one per host, in the order of their lowest rank (unreported hosts
    last, then the unplaced ranks). ``not_shown``: what the rows left out of the drawing (trainer ranks) hold,
    or None; ``not_shown_bad``: whether any of them is not ``match``.
    """

    cells: pd.DataFrame
    groups: list[HostGroup]
    columns: list[str]
    n_ranks: int
    located: bool
    sizes: dict[str, int]
    trainer_hosts: list[str]
    not_shown: str | None = None
    not_shown_bad: bool = False
    unplaced: int = 0

    @property
    def colocated(self) -> list[str]:
        return [g.host for g in self.groups if g.colocated and g.host is not None]

    @property
    def known_hosts(self) -> int:
        return sum(g.host is not None for g in self.groups)


def _roles(v: pd.DataFrame) -> pd.Series:
    for col in ("role", "role_actual"):
        if col in v:
            return v[col].astype("object")
    return pd.Series(pd.NA, index=v.index, dtype="object")


def _hosts(v: pd.DataFrame) -> pd.Series:
    if "host" not in v:
        return pd.Series(pd.NA, index=v.index, dtype="object")
    return v["host"].astype("object").where(v["host"].notna(), pd.NA)


def _rank_name(rank: object) -> str:
    return "r?" if pd.isna(rank) else f"r{int(rank)}"  # type: ignore[call-overload]


def topology(verdicts: pd.DataFrame) -> Topology:
    """Place a verdict frame's engine ranks: the form :func:`topology_text` and :func:`plot_topology` draw."""
    if not isinstance(verdicts, pd.DataFrame):
        raise TableError(f"expected a verdict DataFrame, got {type(verdicts).__name__}")
    v = verdicts.reset_index(drop=True)
    trainer = (_roles(v) == TRAINER).fillna(False).astype(bool)
    hosts = _hosts(v)
    _severity(v)  # refuses a malformed frame (no status, an unknown one) before anything is left out
    split = bool((~trainer).any() and trainer.any())
    engine = v[~trainer] if split else v
    trainer_hosts = sorted({str(h) for h in hosts[trainer].dropna()}) if split else []
    not_shown, not_shown_bad = None, False
    if split:  # left out of the drawing, never out of sight: what they hold is said under it
        left_out = v[trainer.to_numpy()]
        not_shown = "not shown: trainer rows: " + ", ".join(status_parts(left_out, name_ranks=True))
        not_shown_bad = bool((left_out["status"] != "match").any())
    engine_hosts = hosts[engine.index].reset_index(drop=True)
    engine = engine.reset_index(drop=True)
    lay = grid_of(engine)
    rows = lay.cells.drop_duplicates("row")
    if not len(rows):
        empty = pd.DataFrame(columns=["group", "row", "col", "label", "severity", "count", "note"])
        return Topology(empty, [], [], 0, False, {}, trainer_hosts, not_shown, not_shown_bad)

    status = engine["status"].astype("object").to_numpy()[rows["row"].to_numpy()]
    whole = rows["whole"].to_numpy(dtype=bool)  # no parameter: a rank's one row
    per_rank = pd.DataFrame({
        "rank_label": rows["rank"].to_numpy(),
        "severity": rows["severity"].to_numpy(),
        "bad": ((rows["severity"] != _MATCH).to_numpy() & ~whole).astype("int64"),
        "whole": [WHOLE_RANK_NOTE[str(st)] if w else "" for st, w in zip(status, whole)],
        "host": engine_hosts.loc[rows["row"]].to_numpy(),
    })
    ranks = per_rank.groupby("rank_label", sort=False).agg(
        severity=("severity", "min"), count=("bad", "sum"), host=("host", "first"),  # first non-NA host
        note=("whole", lambda w: ", ".join(dict.fromkeys(x for x in w if x))),
    )
    coords = lay.coords.loc[lay.ranks]
    ranks = ranks.reindex(lay.ranks)
    ranks["order"] = range(len(ranks))
    ranks["name"] = [_rank_name(r) for r in coords["rank"]] if lay.located else ["all"] * len(ranks)
    used = set(lay.used)
    layout = [c for c in ("dp", "pp", "tp") if c in used]
    # a rank without a coordinate the layout uses (or without any) is not put at 0, on top of another rank
    unplaced = (coords[layout].isna().any(axis=1) | coords[list(used)].isna().all(axis=1)) if lay.located else coords["url"].notna()
    unplaced = unplaced.to_numpy(dtype=bool)
    for c in ("dp", "pp"):
        ranks[c] = coords[c].fillna(0).astype("int64").to_numpy()
    ranks["host"] = ranks["host"].astype("object").where(ranks["host"].notna(), _NO_HOST)

    if "tp" in used:
        ranks["col"] = coords["tp"].fillna(0).astype("int64").to_numpy()
        col_name = "tp{}"
    else:  # no tensor-parallel coordinate: the ranks of a row side by side, in rank order
        ranks["col"] = 0
        ranks.loc[~unplaced, "col"] = ranks[~unplaced].groupby(["host", "dp", "pp"], sort=False).cumcount()
        col_name = "#{}"
    placed, loose = ranks[~unplaced], ranks[unplaced]
    cols = sorted(placed["col"].unique())
    col_index = {c: i for i, c in enumerate(cols)}

    first = placed.groupby("host", sort=False)["order"].min()
    host_order = first.sort_values(kind="stable").index.tolist()
    if _NO_HOST in host_order:  # ranks that never said where they run come last
        host_order = [h for h in host_order if h != _NO_HOST] + [_NO_HOST]
    dp_shown, pp_shown = "dp" in used, "pp" in used

    def row_label(dp: int, pp: int) -> str:
        return " ".join([f"dp{dp}"] * dp_shown + [f"pp{pp}"] * pp_shown) or "ranks"

    colocated = set(trainer_hosts)
    groups: list[HostGroup] = []
    pieces = []
    for g, host in enumerate(host_order):
        mine = placed[placed["host"] == host]
        keys = mine[["dp", "pp"]].drop_duplicates().sort_values(["dp", "pp"]).itertuples(index=False)
        row_index = {(k.dp, k.pp): i for i, k in enumerate(keys)}
        name = None if host == _NO_HOST else str(host)
        groups.append(HostGroup(name, name in colocated, [row_label(dp, pp) for dp, pp in row_index], [dp for dp, _ in row_index]))
        cell = mine.assign(group=g, row=[row_index[(d, p)] for d, p in zip(mine["dp"], mine["pp"])])
        pieces.append(cell)
    if len(loose):  # a row each, named by the rank's label (its URL without coordinates), in the first column
        groups.append(HostGroup(None, False, [str(r) for r in loose.index], [-1] * len(loose), unplaced=True))
        pieces.append(loose.assign(group=len(groups) - 1, row=range(len(loose)), col=cols[0] if cols else 0, name=""))
        col_index.setdefault(cols[0] if cols else 0, 0)
    cells = pd.concat(pieces)
    # ranks sharing a cell (they differ only in ep, or in rank where dp is not reported) are named by the worst
    agg = cells.sort_values(["severity", "order"]).groupby(["group", "row", "col"], sort=True).agg(
        severity=("severity", "min"), count=("count", "sum"), first=("name", "first"), n=("order", "size"),
        note=("note", lambda w: ", ".join(dict.fromkeys(x for x in w if x))),
    ).reset_index()
    agg["label"] = [name + (f"+{n - 1}" if n > 1 else "") for name, n in zip(agg["first"], agg["n"])]
    agg["col"] = agg["col"].map(col_index)
    sizes: dict[str, int] = {c: int(coords[c].nunique()) for c in ("dp", "pp", "tp") if c in used}
    return Topology(
        cells=agg[["group", "row", "col", "label", "severity", "count", "note"]].astype({"severity": "int64", "count": "int64"}),
        groups=groups,
        columns=[col_name.format(c) for c in cols],
        n_ranks=len(ranks),
        located=lay.located,
        sizes=sizes,
        trainer_hosts=trainer_hosts,
        not_shown=not_shown,
        not_shown_bad=not_shown_bad,
        unplaced=len(loose),
    )


def _headline(top: Topology) -> str:
    shape = " × ".join(f"{c} {n}" for c, n in top.sizes.items())
    hosts = f"on {plural(top.known_hosts, 'host')}" if top.known_hosts else "hosts not reported"
    if top.known_hosts and top.known_hosts < len(top.groups):
        hosts += " (some not reported)"
    ranks = plural(top.n_ranks, "rank") if top.located else "no rank coordinates"
    if top.unplaced:
        ranks += f" ({top.unplaced:,} unplaced)"
    return f"topology: {ranks}" + (f", {shape}" if shape else "") + f", {hosts}"


def _trainer_line(top: Topology) -> str | None:
    if not top.trainer_hosts:
        return None
    shared = top.colocated
    line = f"trainer on {plural(len(top.trainer_hosts), 'host')}: {', '.join(top.trainer_hosts)}"
    return line + (f"; colocated with the engine on {', '.join(shared)}" if shared else "; none shared with the engine")


def topology_text(verdicts: pd.DataFrame) -> str:
    """The engine's ranks as text: a block per host, a line per (DP replica, PP stage), a column per TP rank.

    Each cell is ``r<rank> <mark><non-match count>`` (``r5 U3``; ``r5 .`` when all
    match); a host the trainer also runs on is marked ``(trainer on this host)``.
    """
    top = topology(verdicts)
    if not top.groups:
        return "no verdicts" + (f"\n{top.not_shown}" if top.not_shown else "")
    cells = top.cells.assign(text=[
        " ".join(t for t in (label, f"{MARKS[SEVERITY[s]]}{count if count else ''}", note) if t)
        for label, s, count, note in zip(top.cells["label"], top.cells["severity"], top.cells["count"], top.cells["note"])
    ])
    width = max(len(t) for t in [*cells["text"], *top.columns])
    label_w = max(len(r) for g in top.groups for r in g.rows)
    out = [_headline(top)]
    header = None
    for g, group in enumerate(top.groups):
        out.append(group.title + (f" ({COLOCATED})" if group.colocated else ""))
        mine = cells[cells["group"] == g]
        present = sorted(mine["col"].unique())
        if group.unplaced:  # no columns to head: a line per rank, named by its URL
            header = None
        elif present != header:  # the column header again only where the columns change
            out.append((" " * (2 + label_w) + " " + " ".join(top.columns[c].ljust(width) for c in present)).rstrip())
            header = present
        for i, name in enumerate(group.rows):
            texts = dict(zip(mine.loc[mine["row"] == i, "col"], mine.loc[mine["row"] == i, "text"]))
            out.append((f"  {name:<{label_w}} " + " ".join(texts.get(c, "-").ljust(width) for c in present)).rstrip())
    drawn = set(top.cells["severity"])
    out.append("legend: " + "  ".join(f"{MARKS[s]} {s}" for i, s in enumerate(SEVERITY) if i in drawn))
    trainer = _trainer_line(top)
    if trainer:
        out.append(trainer)
    if top.not_shown:
        out.append(top.not_shown)
    return "\n".join(out)


# --------------------------------------------------------------------------- plot

_ROW_H = 0.34  # inches per cell row
_GAP_HOST = 0.3  # between host groups, in cell heights
_GAP_DP = 0.7  # where the DP replica changes
_PANEL_SLOTS = 36.0  # cell heights in one panel before the host groups wrap into another
_COLOCATED_EDGE = "#000000"
_HOST_EDGE = "#9A9A9A"


def _rows_y(top: Topology) -> tuple[list[list[float]], list[float]]:
    """Each group's row tops (from 0 within the group) and each group's gap above it."""
    tops, gaps = [], []
    last_dp = None
    for group in top.groups:
        ys, y = [], 0.0
        for i, dp in enumerate(group.dps):
            if i and dp != group.dps[i - 1]:
                y += _GAP_DP
            ys.append(y)
            y += 1.0
        tops.append(ys)
        gaps.append(0.0 if last_dp is None else (_GAP_DP if group.dps[0] != last_dp else _GAP_HOST))
        last_dp = group.dps[-1]
    return tops, gaps


def _panels(heights: list[float], gaps: list[float]) -> list[list[int]]:
    """Host groups split into side-by-side panels of about equal height (a group is never split)."""
    total = sum(heights) + sum(gaps)
    target = total / max(1, math.ceil(total / _PANEL_SLOTS))
    panels: list[list[int]] = [[]]
    used = 0.0
    for g, h in enumerate(heights):
        if panels[-1] and used + gaps[g] + h > target * 1.05:
            panels.append([])
            used = 0.0
        used += (gaps[g] if panels[-1] else 0.0) + h
        panels[-1].append(g)
    return panels


def plot_topology(verdicts: pd.DataFrame, *, ax: Axes | None = None, title: str | None = None) -> Figure:
    """The engine's ranks as its parallel layout, coloured by worst status; returns the figure drawn on.

    One row per (DP replica, PP stage), one column per TP rank, grouped by host:
    the host's name on the left of its rows, its cells outlined (black and dashed,
    with "+ trainer" under the name, where the trainer runs too); a wider gap where
    the DP replica changes. Each cell names its rank and, below, how many of its rows
    are not ``match``. Ranks without the coordinates to place them come last, under
    ``unplaced``: a row each, labelled by the rank (its URL), the cell across all columns. Colours are :data:`~wcviz.views.COLORS`; the legend lists the
    statuses drawn. Many hosts wrap into side-by-side panels, so 8 DP × 4 PP × 8 TP
    stays readable. Draws on ``ax`` when given, else on a new
    :class:`~matplotlib.figure.Figure` (not registered with pyplot). Cells are
    patches with gid ``cell`` and host outlines gid ``host``; texts have gids
    ``cell``, ``row``, ``column`` and ``host``.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    top = topology(verdicts)
    n_cols = max(1, len(top.columns))
    cell_in = max(0.4, min(0.7, 7.0 / n_cols))
    font = 8.5 if cell_in >= 0.6 else 7.0
    one_host = len(top.groups) == 1 and not top.colocated and not top.groups[0].unplaced  # the title names the host
    tops, gaps = _rows_y(top)
    heights = [ys[-1] + 1.0 for ys in tops]
    panels = _panels(heights, gaps) if top.groups else []
    names = [("unplaced" if g.unplaced else "unknown" if g.host is None else g.host) for g in top.groups]
    char = font * 0.62 / 72 / cell_in  # one character, in cell widths
    host_w = 0.1 if one_host else max([len(n) for n in names] + [9 if top.colocated else 4]) * char + 0.4
    row_w = max(len(r) for g in top.groups for r in g.rows) * char + 0.4 if top.groups else 1.0
    panel_w = host_w + row_w + n_cols + 0.8
    slots = max((sum(heights[g] + (gaps[g] if i else 0.0) for i, g in enumerate(p)) for p in panels), default=1.0)
    if ax is None:
        width = min(22.0, max(4.5, len(panels) * panel_w * cell_in + 1.9))
        height = min(16.0, max(2.0, (slots + 1.0) * _ROW_H + 0.7)) + (0.5 if top.not_shown else 0.0)
        fig = Figure(figsize=(width, height), layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.get_figure()  # type: ignore[assignment]  # a SubFigure draws and saves alike
    shown_title = title if title is not None else "engine ranks: worst status per rank"
    if one_host and names and names[0] != "unknown":
        shown_title += f" (host {names[0]})"
    fits = max(20, int(fig.figure.get_size_inches()[0] * 72 / (10 * 0.62)))  # characters of a 10 pt title across the figure
    ax.set_title(textwrap.fill(shown_title, fits), fontsize=10, loc="left")  # from the left edge: never cut off there
    ax.set_axis_off()
    if top.not_shown:  # rows not drawn (trainer ranks): what they hold, under the drawing, red when it is a finding
        ax.text(0.0, -0.02, textwrap.fill(top.not_shown, int(fits * 1.1)), transform=ax.transAxes, ha="left", va="top",
                fontsize=9, color="#B2182B" if top.not_shown_bad else "#555555",
                fontweight="bold" if top.not_shown_bad else "normal", gid="note")
    if not top.groups:
        ax.text(0.5, 0.5, "no verdicts", ha="center", va="center", transform=ax.transAxes)
        return fig

    for p, members in enumerate(panels):
        left = p * panel_w
        x0 = left + host_w + row_w  # first cell column
        if not one_host:
            ax.text(left + 0.1, -0.15, "host", ha="left", va="bottom", fontsize=font, color="#555555", gid="column")
        for c, name in enumerate(top.columns):
            ax.text(x0 + c + 0.5, -0.15, name, ha="center", va="bottom", fontsize=font, color="#555555", gid="column")
        y = 0.0
        for i, g in enumerate(members):
            group = top.groups[g]
            y += gaps[g] if i else 0.0
            ys = [y + t for t in tops[g]]
            label = names[g] + ("\n+ trainer" if group.colocated else "")
            if not one_host:
                ax.text(left + 0.1, (ys[0] + ys[-1] + 1.0) / 2, label, ha="left", va="center", fontsize=font,
                        fontweight="bold", linespacing=0.95, gid="host")
            for row, row_y in zip(group.rows, ys):
                ax.text(x0 - 0.15, row_y + 0.5, row, ha="right", va="center", fontsize=font, gid="row")
            mine = top.cells[top.cells["group"] == g]
            span = n_cols if group.unplaced else 1  # an unplaced rank has no column: its cell spans them all
            for r in mine.itertuples(index=False):
                color = COLORS[SEVERITY[r.severity]]
                cy = ys[r.row]
                ax.add_patch(Rectangle((x0 + r.col + 0.04, cy + 0.05), span - 0.08, 0.9, facecolor=color,
                                       edgecolor="white", linewidth=0.5, gid="cell"))
                under = ", ".join([str(r.count)] * bool(r.count) + [r.note] * bool(r.note))  # a count, or why there is none
                ax.text(x0 + r.col + span / 2, cy + 0.5, "\n".join(t for t in (r.label, under) if t), ha="center",
                        va="center", fontsize=font, color=_ink(color), linespacing=0.9, gid="cell")
            ax.add_patch(Rectangle(
                (x0 - 0.03, ys[0] - 0.02), n_cols + 0.06, ys[-1] + 1.04 - ys[0], fill=False,
                linewidth=1.1 if group.colocated else 0.6, linestyle="--" if group.colocated else "-",
                edgecolor=_COLOCATED_EDGE if group.colocated else _HOST_EDGE, gid="host",
            ))
            y = ys[-1] + 1.0
    ax.set_xlim(0, len(panels) * panel_w)
    ax.set_ylim(slots + 0.1, -0.9)

    drawn = sorted(set(top.cells["severity"]))
    handles = [Patch(facecolor=COLORS[SEVERITY[s]], edgecolor="#888888", label=SEVERITY[s]) for s in drawn]
    if top.colocated:
        handles.append(Patch(facecolor="none", edgecolor=_COLOCATED_EDGE, linestyle="--", label=COLOCATED))
    if (top.cells["count"] > 0).any():
        handles.append(Patch(facecolor="none", edgecolor="none", label="number under a rank:\nits parameters not match"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8,
              title="status", title_fontsize=8)
    return fig
