"""One parameter, every rank, every phase: where did its value go wrong?

::

    model.layers.1.mlp.down_proj.weight (nemo-rl-v3)
    rank        snapshot    reset       reload
    r0 pp0 tp0  00000002 .  a5a5a5a5 U  00000002 .
    r1 pp0 tp1  00000007 .  a5a5a5a5 U  a5a5a5a5 U
    legend: . same as snapshot  U equal to the reset (unwritten)

Reads digest frames only: ``{phase: frame}`` (the key names the phase, as
:attr:`wcviz.endstate.EndStateReport.frames`, or ``expected``/``actual``) or one long
frame with a ``phase`` column. Each cell is the first 8 hex characters of the digest,
judged against the same rank's reference (its snapshot; for expected against actual,
the expected digest) and reset digests of that parameter (full digests compared). A
phase whose rows have no rank coordinates (a checkpoint's expected digests) is what
every rank should hold: it is drawn on each rank's row, never as a row of its own.
With ``verdicts`` (the check's verdict frame) a cell is drawn as its verdict says: the
judged cell (the reload; for expected against actual, the actual digest) takes the
rank's status for the parameter (``unwritten``, ``corrupted``, ``drift``, ``missing``,
``unexpected``, ``unreachable``, ``empty``, ``mismatch``, ...); a later value equal to
the snapshot is ``unproven`` where the verdict is (a reset that proved nothing); a rank
the verdicts say did not answer (``unreachable``) or held nothing (``empty``), by a row
for the parameter or a whole-rank row, has each absent cell drawn so. Ranks the verdicts
name for the parameter that no digest frame holds (an agent that never answered) are
listed in a note under the drawing, never left out silently.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pandas as pd

from wcviz._errors import TableError
from wcviz._text import listing, plural, rank_label
from wcviz.frame import IDENTITY, rank_ids
from wcviz.verdicts import SEVERITY, WHOLE_RANK, check_statuses
from wcviz.views._grid import KEYS, NO_RANKS, _label
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
    "unproven": ("~", "same as snapshot, but the reset proved nothing (unproven)"),
    "unwritten": ("U", "equal to the reset (unwritten)"),
    "corrupted": ("C", "a third value (corrupted)"),
    "mismatch": ("M", "differs from expected (mismatch)"),
    "drift": ("D", "another dtype or shape than expected (drift)"),
    "missing": ("x", "expected, but absent (missing)"),
    "unexpected": ("+", "not expected (unexpected)"),
    "unreachable": ("!", "the rank did not answer (unreachable)"),
    "empty": ("0", "the rank answered with no parameters (empty)"),
    "unknown": ("?", "no snapshot digest to compare with"),
    "absent": ("-", "absent"),
}
DRILLDOWN_COLORS = {
    "match": COLORS["match"],
    "reset": "#DCE3EC",  # neutral blue-grey: the reset column holds the reset pattern, nothing to alarm
    "unproven": COLORS["unproven"],  # pale violet: equal to the snapshot, but nothing proves it was rewritten
    "unwritten": COLORS["unwritten"],
    "corrupted": COLORS["corrupted"],
    "mismatch": COLORS["mismatch"],
    "drift": COLORS["drift"],
    "missing": COLORS["missing"],
    "unexpected": COLORS["unexpected"],
    "unreachable": COLORS["unreachable"],
    "empty": COLORS["empty"],
    "unknown": "#BDBDBD",
    "absent": NOT_HELD_COLOR,
}
_KINDS = tuple(DRILLDOWN_KINDS)
assert len({mark for mark, _ in DRILLDOWN_KINDS.values()}) == len(DRILLDOWN_KINDS)  # one mark, one meaning
_VERDICT_KINDS = [k for k in DRILLDOWN_KINDS if k in SEVERITY]  # verdict statuses a judged cell is drawn as


@dataclass(frozen=True)
class Drilldown:
    """One parameter's digests: ``digests`` and ``kinds`` are rank label × phase (NA/``absent`` where no row).

    ``reference``: the phase each cell is judged against (``snapshot``, or ``expected``);
    ``note``: ranks the verdicts name for the parameter that no frame holds (None when there are none),
    ``note_bad`` whether any of them is not ``match``.
    """

    name: str
    algos: list[str]
    digests: pd.DataFrame
    kinds: pd.DataFrame
    reference: str = "snapshot"
    note: str | None = None
    note_bad: bool = False

    def legend(self, kind: str) -> str:
        """What ``kind`` means here, in words (``same as expected`` when the reference is expected)."""
        text = DRILLDOWN_KINDS[kind][1]
        return text if self.reference == "snapshot" else text.replace("snapshot", self.reference)


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


def _judge(digest: object, ref: object, reset: object, other: str) -> str:
    """A cell against its rank's reference (snapshot or expected) and reset digests; ``other``: a third value's kind."""
    if pd.isna(digest):  # type: ignore[call-overload]
        return "absent"
    d = str(digest).lower()
    if not pd.isna(ref) and d == str(ref).lower():  # type: ignore[call-overload]
        return "match"
    if not pd.isna(reset) and d == str(reset).lower():  # type: ignore[call-overload]
        return "unwritten"
    return "unknown" if pd.isna(ref) else other  # type: ignore[call-overload]


def _spread(rows: pd.DataFrame, phase: pd.Series) -> tuple[pd.DataFrame, pd.Series]:
    """Rows of a phase without rank coordinates, when other phases have them, put on every rank of those (as
    :func:`wcviz.verdicts.compare` reads an expected frame without ranks): never a row of their own."""
    cols = [c for c in IDENTITY if c in rows]
    placed = rows[cols].notna().any(axis=1) if cols else pd.Series(False, index=rows.index)
    if not placed.any() or placed.all():
        return rows, phase
    rankless = [p for p in phase.unique() if not placed[phase == p].any()]
    if not rankless:
        return rows, phase
    ranks = rows.loc[placed, cols].drop_duplicates()
    moved = phase.isin(rankless)
    spread = rows[moved].assign(_phase=phase[moved]).drop(columns=cols).merge(ranks, how="cross")
    out = pd.concat([rows[~moved].assign(_phase=phase[~moved]), spread], ignore_index=True)
    return out.drop(columns="_phase"), out["_phase"].astype(str)


def _verdict_of(verdicts: pd.DataFrame | None, name: str, ranks: pd.DataFrame) -> tuple[pd.Series, list[tuple[str, str]]]:
    """Each drawn rank's verdict status for ``name`` (NA where the verdicts have none), and (status, rank) of the
    ranks the verdicts name for it that are not drawn. ``ranks``: the drawn ranks' :data:`KEYS`, indexed by label.

    A row for ``name`` wins over a whole-rank row (an ``unreachable``/``empty`` rank without a name), which
    speaks for every parameter of its rank; of several rows, the worst."""
    none = pd.Series(pd.NA, index=ranks.index, dtype="object")
    if verdicts is None or not len(verdicts) or "status" not in verdicts:
        return none, []
    v = verdicts.reset_index(drop=True)
    ids = rank_ids(v, "verdicts")
    names = v["name"].astype("object") if "name" in v else pd.Series(pd.NA, index=v.index, dtype="object")
    status = v["status"].astype("object")
    whole = (names.isna() & status.isin(list(WHOLE_RANK))).to_numpy(dtype=bool)
    mine = (names == name).fillna(False).to_numpy(dtype=bool) | whole
    if not mine.any():
        return none, []
    rows = ids[mine].assign(_status=status[mine].to_numpy(), _named=~whole[mine],
                            _sev=status[mine].map({s: i for i, s in enumerate(SEVERITY)}).fillna(len(SEVERITY)).to_numpy())
    rows = rows.sort_values(["_named", "_sev"], ascending=[False, True], kind="stable").drop_duplicates(KEYS)
    drawn = ranks.rename_axis("_label").reset_index()
    hit = drawn.merge(rows, on=KEYS, how="left").set_index("_label")["_status"]
    gone = rows.merge(drawn, on=KEYS, how="left")
    gone = gone[gone["_label"].isna()]
    missed = [(str(st), rank_label(r)) for st, r in zip(gone["_status"], gone[KEYS].to_dict(orient="records"))]
    return hit.reindex(ranks.index).astype("object"), missed


def _judged(phases: list[str], reference: str) -> str | None:
    """The phase a verdict judges: the actual digests against expected ones, else the reload (or the last phase after
    the reset)."""
    if reference == "expected":
        return "actual" if "actual" in phases else None
    if "reload" in phases:
        return "reload"
    later = [p for p in phases if p not in ("snapshot", "reset")]
    return later[-1] if later else None


def _not_drawn(missed: list[tuple[str, str]]) -> str | None:
    """``not in the digests: 1 rank unreachable (http://node-a:8001)``: what the verdicts say of ranks not drawn."""
    if not missed:
        return None
    parts = []
    for st in [s for s in SEVERITY if any(m[0] == s for m in missed)] + sorted({m[0] for m in missed} - set(SEVERITY)):
        labels = [label for s, label in missed if s == st]
        parts.append(f"{plural(len(labels), 'rank')} {st} ({listing(labels)})")
    return "not in the digests: " + ", ".join(parts)


def drilldown(frames: Mapping[str, pd.DataFrame] | pd.DataFrame, name: str, *, verdicts: pd.DataFrame | None = None) -> Drilldown:
    """The digests of parameter ``name`` per rank and phase, each judged (with ``verdicts``, as they judged it):
    what both drill-down views draw."""
    if verdicts is not None:  # judged by them, or refused: never quietly drawn as if no verdict said anything
        check_statuses(verdicts)
    long = _long(frames)
    names = long["name"].dropna().astype(str)
    if name not in set(names):
        raise _unknown_name(name, sorted(names.unique()))
    rows = long[long["name"].astype("object") == name].reset_index(drop=True)
    phase = rows["phase"].astype("object").where(rows["phase"].notna(), "(no phase)").astype(str)
    seen = list(dict.fromkeys(phase))  # the phases in the order given
    rows, phase = _spread(rows, phase)
    ids = rank_ids(rows, "digests")
    used = [c for c in IDENTITY if ids[c].notna().any()]
    located = bool(used) or bool(ids["url"].notna().any())
    labels = pd.Series([_label(r, used) for _, r in ids.iterrows()] if located else [NO_RANKS] * len(rows), index=rows.index)
    order = ids.assign(_label=labels).drop_duplicates().sort_values(KEYS, na_position="first", kind="stable")
    ranks = order["_label"].tolist()
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
    reference = "expected" if "snapshot" not in digests and "expected" in digests else "snapshot"
    other = "mismatch" if reference == "expected" else "corrupted"
    ref = digests[reference] if reference in digests else pd.Series(pd.NA, index=digests.index)
    reset = digests["reset"] if "reset" in digests else pd.Series(pd.NA, index=digests.index)
    kinds = digests.apply(lambda col: pd.Series([_judge(d, s, r, other) for d, s, r in zip(col, ref, reset)], index=col.index))
    status, missed = _verdict_of(verdicts, name, order.drop_duplicates("_label").set_index("_label")[KEYS])
    if "reset" in kinds:  # in the reset phase, holding the reset pattern is what a reset does: neutral, not "unwritten"
        kinds["reset"] = kinds["reset"].where(kinds["reset"] != "unwritten", "reset")
        # a reset that left the snapshot's value proves nothing: it, and a later phase equal to the snapshot, are unproven
        same = (kinds["reset"] == "match").to_numpy()
        after = list(kinds.columns)[list(kinds.columns).index("reset"):]  # the phases run snapshot, reset, reload, others
        for p in after:
            kinds[p] = kinds[p].where(~(same & (kinds[p] == "match").to_numpy()), "unproven")
    if reference == "snapshot":  # the verdict says the reset proved nothing: a later value equal to the snapshot neither
        later = [p for p in kinds.columns if p not in ("snapshot", "reset")]
        for p in later:
            kinds[p] = kinds[p].where(~((status == "unproven").to_numpy() & (kinds[p] == "match").to_numpy()), "unproven")
    lost = status.isin(list(WHOLE_RANK)).to_numpy()  # the rank did not answer, or held nothing: why its cells are absent
    for p in kinds.columns:
        kinds[p] = kinds[p].where(~(lost & (kinds[p] == "absent").to_numpy()), status)
    judged = _judged(list(kinds.columns), reference)
    if judged is not None:  # the cell the verdict judged: what the verdict found it
        said = status.where(status.isin(_VERDICT_KINDS))
        kinds[judged] = said.where(said.notna(), kinds[judged])
    algos = sorted(rows["algo"].dropna().astype(str).unique()) if "algo" in rows else []
    return Drilldown(name=name, algos=algos, digests=digests, kinds=kinds.reindex(columns=phases), reference=reference,
                     note=_not_drawn(missed), note_bad=any(st != "match" for st, _ in missed))


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


def drilldown_text(frames: Mapping[str, pd.DataFrame] | pd.DataFrame, name: str, *, verdicts: pd.DataFrame | None = None) -> str:
    """One parameter's digest per rank (lines) and phase (columns), each ``<8 hex> <mark>``.

    Phases run snapshot, reset, reload, then any others in the order given. Marks:
    ``.`` same as the rank's snapshot, ``r`` the reset pattern in the reset phase (what
    a reset leaves), ``~`` same as the snapshot where the reset proved nothing
    (unproven: the reset left the snapshot's value, or ``verdicts`` say so),
    ``U`` equal to its reset after it (unwritten), ``C`` a third value
    (corrupted), ``?`` no snapshot to compare with, ``-`` no row. Expected against
    actual: ``.`` same as expected, ``M`` mismatch, ``D`` drift, ``x`` missing,
    ``+`` unexpected. Raises ``ValueError`` naming an unknown parameter and suggesting close names.
    """
    d = drilldown(frames, name, verdicts=verdicts)
    texts = pd.DataFrame(
        [[("-" if k == "absent" else f"{'-' if pd.isna(v) else str(v)[:HEX]} {DRILLDOWN_KINDS[k][0]}") for v, k in zip(dv, kv)]
         for dv, kv in zip(d.digests.itertuples(index=False), d.kinds.itertuples(index=False))],
        index=d.digests.index, columns=d.digests.columns,
    )
    width = max([len(p) for p in d.digests.columns] + [len(t) for t in texts.to_numpy().ravel()])
    label = max(len(t) for t in ["rank", *d.digests.index])
    out = [_title(d), ("rank".ljust(label) + "  " + "  ".join(p.ljust(width) for p in d.digests.columns)).rstrip()]
    for rank, row in texts.iterrows():
        out.append((str(rank).ljust(label) + "  " + "  ".join(t.ljust(width) for t in row)).rstrip())
    drawn = set(d.kinds.to_numpy().ravel())
    out.append("legend: " + "  ".join(f"{mark} {d.legend(k)}" for k, (mark, _) in DRILLDOWN_KINDS.items() if k in drawn))
    if d.note:
        out.append(d.note)
    return "\n".join(out)


def plot_drilldown(
    frames: Mapping[str, pd.DataFrame] | pd.DataFrame, name: str, *, verdicts: pd.DataFrame | None = None, ax: Axes | None = None
) -> Figure:
    """One parameter's digest per rank (rows) and phase (columns), coloured by what it equals.

    Grey-green: the rank's snapshot; blue-grey: the reset pattern in the reset
    column; pale violet: the snapshot's value where the reset did not change it
    (unproven); orange: its reset digest (unwritten); red: a third value
    (corrupted); light grey: no snapshot to compare with; white: no row. Expected
    against actual: each actual cell in its status's colour (:data:`wcviz.views.COLORS`).
    ``verdicts``: judge the cells as the verdicts did (see the module docstring). A long
    name wraps in the title, never cut off. Cells show the first 8 hex characters (up to 400 cells). Rows are
    labelled by rank coordinates, thinned to what fits. Draws on ``ax`` when
    given, else on a new :class:`~matplotlib.figure.Figure`.
    """
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    d = drilldown(frames, name, verdicts=verdicts)
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
    handles = [Patch(facecolor=colors[c], edgecolor="#888888", label=d.legend(_KINDS[c])) for c in drawn]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)
    if d.note:  # ranks the verdicts name that no frame holds: under the drawing (room kept by the layout), red when a finding
        ax.xaxis.set_label_position("bottom")
        ax.set_xlabel(_wrap(d.note, fits + 10), fontsize=8, loc="left", color="#B2182B" if d.note_bad else "#555555",
                      gid="note")
    return fig
