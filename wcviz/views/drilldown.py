"""One parameter, every rank, every phase: where did its value go wrong?

::

    model.layers.1.mlp.down_proj.weight (nemo-rl-v3)
    rank        snapshot    reset       reload
    r0 pp0 tp0  00000002 .  a5a5a5a5 U  00000002 .
    r1 pp0 tp1  00000007 .  a5a5a5a5 U  a5a5a5a5 U
    legend: . same as snapshot  U equal to the reset (unwritten)

Reads digest frames only: ``{phase: frame}`` (the key names the phase, as
:attr:`wcviz.endstate.EndStateReport.frames`) or one long frame with a ``phase``
column. Each cell is the first 8 hex characters of the digest, judged against the
same rank's snapshot and reset digests of that parameter (full digests compared).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pandas as pd

from wcviz._errors import TableError
from wcviz.frame import IDENTITY
from wcviz.views._grid import NO_RANKS, _label
from wcviz.views.plots import _ANNOTATE_BELOW, _FONT, COLORS, NOT_HELD_COLOR, _ink, _ticks

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["DRILLDOWN_COLORS", "DRILLDOWN_KINDS", "drilldown_text", "plot_drilldown"]

PHASE_ORDER = ("snapshot", "reset", "reload")
HEX = 8  # hex characters shown per digest

# kind -> (text mark, legend): how a cell's digest relates to the rank's snapshot and reset
DRILLDOWN_KINDS = {
    "match": (".", "same as snapshot"),
    "reset": ("r", "the reset pattern (as the reset should leave it)"),
    "unproven": ("~", "same as snapshot, but the reset did not change it (unproven)"),
    "unwritten": ("U", "equal to the reset (unwritten)"),
    "corrupted": ("C", "a third value (corrupted)"),
    "unknown": ("?", "no snapshot to compare with"),
    "absent": ("-", "absent"),
}
DRILLDOWN_COLORS = {
    "match": COLORS["match"],
    "reset": "#DCE3EC",  # neutral blue-grey: the reset column holds the reset pattern, nothing to alarm
    "unproven": COLORS["unproven"],  # pale violet: equal to the snapshot, but nothing proves it was rewritten
    "unwritten": COLORS["unwritten"],
    "corrupted": COLORS["corrupted"],
    "unknown": "#BDBDBD",
    "absent": NOT_HELD_COLOR,
}
_KINDS = tuple(DRILLDOWN_KINDS)


@dataclass(frozen=True)
class Drilldown:
    """One parameter's digests: ``digests`` and ``kinds`` are rank label × phase (NA/``absent`` where no row)."""

    name: str
    algos: list[str]
    digests: pd.DataFrame
    kinds: pd.DataFrame


def _long(frames: Mapping[str, pd.DataFrame] | pd.DataFrame) -> pd.DataFrame:
    """One frame with a ``phase`` column, the phases' own order kept."""
    if isinstance(frames, pd.DataFrame):
        if "phase" not in frames:
            raise TableError("a single digest frame needs a 'phase' column; or pass {phase: frame}")
        parts = {"(frame)": frames}
    elif isinstance(frames, Mapping):
        parts = dict(frames)
    else:
        raise TypeError(f"expected {{phase: digest frame}} or one frame with a 'phase' column, got {type(frames).__name__}")
    out = []
    for phase, df in parts.items():
        where = "the frame" if phase == "(frame)" else f"phase {phase!r}"
        if not isinstance(df, pd.DataFrame):
            raise TableError(f"{where}: expected a digest DataFrame, got {type(df).__name__}")
        missing = [c for c in ("name", "digest") if c not in df]
        if missing:
            raise TableError(f"{where}: not a digest frame: no {', '.join(repr(c) for c in missing)} column")
        if phase != "(frame)":
            df = df.assign(phase=str(phase))
        out.append(df)
    if not out:
        raise TableError("no digest frames given")
    return pd.concat(out, ignore_index=True)


def _unknown_name(name: str, names: list[str]) -> ValueError:
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
    if close:
        hint = f"did you mean {', '.join(repr(c) for c in close)}?"
    elif names:
        hint = f"the frames hold {len(names):,} parameters, e.g. {', '.join(repr(n) for n in names[:3])}"
    else:
        hint = "the frames hold no parameters"
    return ValueError(f"no parameter {name!r} in the frames; {hint}")


def _judge(digest: object, snap: object, reset: object) -> str:
    if pd.isna(digest):  # type: ignore[call-overload]
        return "absent"
    d = str(digest).lower()
    if not pd.isna(snap) and d == str(snap).lower():  # type: ignore[call-overload]
        return "match"
    if not pd.isna(reset) and d == str(reset).lower():  # type: ignore[call-overload]
        return "unwritten"
    return "unknown" if pd.isna(snap) else "corrupted"  # type: ignore[call-overload]


def drilldown(frames: Mapping[str, pd.DataFrame] | pd.DataFrame, name: str) -> Drilldown:
    """The digests of parameter ``name`` per rank and phase, each judged: what both drill-down views draw."""
    long = _long(frames)
    names = long["name"].dropna().astype(str)
    if name not in set(names):
        raise _unknown_name(name, sorted(names.unique()))
    rows = long[long["name"].astype("object") == name].reset_index(drop=True)
    ids = pd.DataFrame({c: pd.to_numeric(rows[c], errors="coerce") if c in rows else pd.NA for c in IDENTITY}, index=rows.index)
    ids = ids.astype("Int64")
    used = [c for c in IDENTITY if ids[c].notna().any()]
    labels = pd.Series([_label(r, used) for _, r in ids.iterrows()] if used else [NO_RANKS] * len(rows), index=rows.index)
    order = ids.assign(_label=labels).drop_duplicates().sort_values(list(IDENTITY), na_position="first", kind="stable")
    ranks = order["_label"].tolist()
    phase = rows["phase"].astype("object").where(rows["phase"].notna(), "(no phase)").astype(str)
    seen = list(dict.fromkeys(phase))
    phases = [p for p in PHASE_ORDER if p in seen] + [p for p in seen if p not in PHASE_ORDER]
    cells = pd.DataFrame({"rank": labels, "phase": phase, "digest": rows["digest"].astype("object")})
    dup = cells.duplicated(["rank", "phase"], keep=False)
    if dup.any():
        first = cells[dup].iloc[0]
        raise TableError(
            f"{name}: {int(dup.sum())} rows share a (rank, phase), first {first['rank']} in phase {first['phase']!r}; "
            "select one step before drilling down"
        )
    digests = cells.pivot(index="rank", columns="phase", values="digest").reindex(index=ranks, columns=phases)
    digests.index.name, digests.columns.name = "rank", "phase"
    snap = digests["snapshot"] if "snapshot" in digests else pd.Series(pd.NA, index=digests.index)
    reset = digests["reset"] if "reset" in digests else pd.Series(pd.NA, index=digests.index)
    kinds = digests.apply(lambda col: pd.Series([_judge(d, s, r) for d, s, r in zip(col, snap, reset)], index=col.index))
    if "reset" in kinds:  # in the reset phase, holding the reset pattern is what a reset does: neutral, not "unwritten"
        kinds["reset"] = kinds["reset"].where(kinds["reset"] != "unwritten", "reset")
        # a reset that left the snapshot's value proves nothing: it, and a later phase equal to the snapshot, are unproven
        same = (kinds["reset"] == "match").to_numpy()
        after = list(kinds.columns)[list(kinds.columns).index("reset"):]  # the phases run snapshot, reset, reload, others
        for p in after:
            kinds[p] = kinds[p].where(~(same & (kinds[p] == "match").to_numpy()), "unproven")
    algos = sorted(rows["algo"].dropna().astype(str).unique()) if "algo" in rows else []
    return Drilldown(name=name, algos=algos, digests=digests, kinds=kinds.reindex(columns=phases))


def _wrap(text: str, width: int) -> str:
    """``text`` in lines of at most ``width`` characters, broken after a dot or a space where it can."""
    lines, line = [], ""
    for piece in re.findall(r"[^.\s]*(?:\.|\s+|$)", text):
        while len(piece) > width:  # one piece longer than a line: cut it
            if line:
                lines.append(line)
                line = ""
            lines.append(piece[:width])
            piece = piece[width:]
        if len(line) + len(piece) > width and line:
            lines.append(line)
            line = ""
        line += piece
    lines.append(line)
    return "\n".join(x.rstrip() for x in lines if x.strip())


def _title(d: Drilldown) -> str:
    return d.name + (f" ({', '.join(d.algos)})" if d.algos else "")


def drilldown_text(frames: Mapping[str, pd.DataFrame] | pd.DataFrame, name: str) -> str:
    """One parameter's digest per rank (lines) and phase (columns), each ``<8 hex> <mark>``.

    Phases run snapshot, reset, reload, then any others in the order given. Marks:
    ``.`` same as the rank's snapshot, ``r`` the reset pattern in the reset phase (what
    a reset leaves), ``~`` same as the snapshot where the reset left the snapshot's value
    (unproven: the reset, and a reload equal to the snapshot after it),
    ``U`` equal to its reset after it (unwritten), ``C`` a third value
    (corrupted), ``?`` no snapshot to compare with, ``-`` no row.
    Raises ``ValueError`` naming an unknown parameter and suggesting close names.
    """
    d = drilldown(frames, name)
    texts = pd.DataFrame(
        [[("-" if k == "absent" else f"{str(v)[:HEX]} {DRILLDOWN_KINDS[k][0]}") for v, k in zip(dv, kv)]
         for dv, kv in zip(d.digests.itertuples(index=False), d.kinds.itertuples(index=False))],
        index=d.digests.index, columns=d.digests.columns,
    )
    width = max([len(p) for p in d.digests.columns] + [len(t) for t in texts.to_numpy().ravel()])
    label = max(len(t) for t in ["rank", *d.digests.index])
    out = [_title(d), ("rank".ljust(label) + "  " + "  ".join(p.ljust(width) for p in d.digests.columns)).rstrip()]
    for rank, row in texts.iterrows():
        out.append((str(rank).ljust(label) + "  " + "  ".join(t.ljust(width) for t in row)).rstrip())
    drawn = set(d.kinds.to_numpy().ravel())
    out.append("legend: " + "  ".join(f"{mark} {what}" for k, (mark, what) in DRILLDOWN_KINDS.items() if k in drawn))
    return "\n".join(out)


def plot_drilldown(frames: Mapping[str, pd.DataFrame] | pd.DataFrame, name: str, *, ax: Axes | None = None) -> Figure:
    """One parameter's digest per rank (rows) and phase (columns), coloured by what it equals.

    Grey-green: the rank's snapshot; blue-grey: the reset pattern in the reset
    column; pale violet: the snapshot's value where the reset did not change it
    (unproven); orange: its reset digest (unwritten); red: a third value
    (corrupted); light grey: no snapshot to compare with; white: no row. A long
    name wraps in the title, never cut off. Cells show the first 8 hex characters (up to 400 cells). Rows are
    labelled by rank coordinates, thinned to what fits. Draws on ``ax`` when
    given, else on a new :class:`~matplotlib.figure.Figure`.
    """
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    d = drilldown(frames, name)
    n_rows, n_cols = d.digests.shape
    if ax is None:
        width = min(14.0, max(5.0, 2.0 + 1.15 * n_cols + 2.4))
        height = min(14.0, max(2.2, 1.3 + 0.24 * n_rows))
        fig = Figure(figsize=(width, height), layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.get_figure()  # type: ignore[assignment]  # a SubFigure draws and saves alike
    fits = max(20, int((fig.figure.get_size_inches()[0] - 1.0) * 72 / (9 * 0.62)))  # characters of a 9 pt title right of the rank labels
    ax.set_title(_wrap(_title(d), fits), fontsize=9, loc="left")
    colors = [DRILLDOWN_COLORS[k] for k in _KINDS]
    codes = d.kinds.apply(lambda col: col.map(_KINDS.index)).to_numpy(dtype=int)
    norm = BoundaryNorm([i - 0.5 for i in range(len(colors) + 1)], len(colors))
    ax.imshow(codes, cmap=ListedColormap(colors), norm=norm, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(n_cols), list(d.digests.columns), fontsize=8)
    ax.xaxis.tick_top()
    size = fig.figure.get_size_inches()
    rows = _ticks(list(d.digests.index), ax.get_position().height * size[1], layered=False)
    ax.set_yticks(rows, [d.digests.index[i] for i in rows], fontsize=_FONT)
    ax.set_ylabel("rank")
    ax.tick_params(length=0)
    ax.set_xticks([i - 0.5 for i in range(1, n_cols)], minor=True)
    if n_rows * n_cols < _ANNOTATE_BELOW:
        ax.set_yticks([i - 0.5 for i in range(1, n_rows)], minor=True)
        for i in range(n_rows):
            for j in range(n_cols):
                v = d.digests.iat[i, j]
                if not pd.isna(v):
                    ax.text(j, i, str(v)[:HEX], ha="center", va="center", fontsize=_FONT, family="monospace",
                            color=_ink(colors[codes[i, j]]))
    ax.grid(which="minor", color="white", linewidth=1.0)
    ax.tick_params(which="minor", length=0)
    drawn = sorted({int(c) for c in codes.ravel()})
    handles = [Patch(facecolor=colors[c], edgecolor="#888888", label=DRILLDOWN_KINDS[_KINDS[c]][1]) for c in drawn]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)
    return fig
