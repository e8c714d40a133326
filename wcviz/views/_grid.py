"""The layer × rank grid: which part of the model is wrong on which rank.

Every view of a verdict frame (text, heatmap) is drawn from one grid: the
model's parts in model order (rows), the ranks in identity order (columns) and
the worst status of each cell. Both verdict kinds are read alike: comparison
verdicts (:func:`wcviz.verdicts.compare`) and end-state verdicts
(:func:`wcviz.endstate.classify`); only the ``status`` column, the identity
columns, ``url`` and ``layer``/``block`` (parsed from ``name`` when absent) are used.
A rank is its identity columns; one without any coordinate is known by its ``url``
(an agent that never answered), so two such ranks stay two, labelled by their URLs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from wcviz._errors import TableError
from wcviz._text import rank_label
from wcviz.frame import IDENTITY, parse_block, parse_layer, rank_ids
from wcviz.verdicts import SEVERITY, WHOLE_RANK, check_statuses  # worst first: both verdict kinds' statuses

__all__ = ["NO_RANKS", "SEVERITY", "layer_rank_counts", "layer_rank_grid"]

NO_RANKS = "all"  # the one column of a frame without rank coordinates
KEYS = [*IDENTITY, "url"]
WHOLE_RANK_NOTE = {"unreachable": "no answer", "empty": "empty"}  # what a whole-rank row says in place of a count
assert set(WHOLE_RANK_NOTE) == set(WHOLE_RANK)  # a rank's identity: its coordinates, or where it was asked when it has none

_PART_ORDER = {"embed": 0, "layer": 1, "norm": 2, "head": 3, "other": 4}


@dataclass(frozen=True)
class Grid:
    """What every view draws: rows of the frame placed in the grid.

    ``cells`` has one row per verdict row (a whole-rank row once per part) with
    ``row`` (position in the frame), ``part``, ``rank`` (column label),
    ``severity`` (index into ``SEVERITY``) and ``whole`` (a whole-rank row: an
    ``unreachable``/``empty`` rank without a parameter, which counts as no parameter);
    ``parts`` and ``ranks`` are the grid's labels in order; ``coords`` holds the
    identity values and ``url`` of each rank column (indexed by label), ``used`` the
    identity columns that locate ranks; ``n_rows`` the frame's rows (what ``keep`` flags).
    """

    cells: pd.DataFrame
    parts: list[str]
    ranks: list[str]
    coords: pd.DataFrame
    used: list[str]
    n_rows: int = 0

    @property
    def located(self) -> bool:
        """Whether ranks are told apart: by coordinates, or by URL where a rank has none."""
        return bool(self.used) or bool(self.coords["url"].notna().any())


def _label(coords: pd.Series, used: list[str]) -> str:
    """``r0 pp0 tp1``: each used coordinate the rank has, prefixed by its name; the URL of a rank without any."""
    label = rank_label({c: coords[c] for c in used}, "compact")
    url = coords.get("url", pd.NA)
    if all(pd.isna(coords[c]) for c in IDENTITY if c in coords) and not pd.isna(url) and str(url):
        return str(url)
    return label


def _parts(v: pd.DataFrame) -> tuple[pd.Series, pd.Series, pd.Series]:
    """Each row's part label, its sort key and whether it is a whole-rank row (an ``unreachable``/``empty``
    status without name, layer or block: the rank's one row, about no parameter)."""
    names = v["name"] if "name" in v else pd.Series(pd.NA, index=v.index, dtype="string")
    text = names.astype("object")
    if "layer" in v:
        layer = pd.to_numeric(v["layer"], errors="coerce").astype("Int64")
    else:
        layer = pd.Series(text.map(lambda n: None if pd.isna(n) else parse_layer(str(n))), index=v.index).astype("Int64")
    if "block" in v:
        block = v["block"].astype("string")
    else:
        block = pd.Series(text.map(lambda n: None if pd.isna(n) else parse_block(str(n))), index=v.index, dtype="string")
    kind = block.where(block.isin(["embed", "norm", "head"]), "other").fillna("other").astype("object")
    kind = kind.where(layer.isna(), "layer")
    part = kind.where(layer.isna(), "layer " + layer.astype("string")).astype("object")
    key = kind.map(_PART_ORDER) * 1_000_000_000 + layer.fillna(0).astype("int64")
    whole = names.isna() & layer.isna() & block.isna() & v["status"].astype("object").isin(list(WHOLE_RANK))
    return part, key, whole.fillna(False).astype(bool)


def _severity(v: pd.DataFrame) -> pd.Series:
    check_statuses(v)  # a status column, every row one of SEVERITY
    return v["status"].astype("object").map({s: i for i, s in enumerate(SEVERITY)}).astype("int64")


def grid_of(verdicts: pd.DataFrame) -> Grid:
    """Place a verdict frame's rows in the part × rank grid (the form every view reads)."""
    if not isinstance(verdicts, pd.DataFrame):
        raise TableError(f"expected a verdict DataFrame, got {type(verdicts).__name__}")
    v = verdicts.reset_index(drop=True)
    sev = _severity(v)
    ids = rank_ids(v)
    used = [c for c in IDENTITY if ids[c].notna().any()]
    if used or ids["url"].notna().any():
        coords = ids.drop_duplicates().sort_values(KEYS, na_position="first", kind="stable")
        coords.index = [_label(row, used) for _, row in coords.iterrows()]
        labelled = coords.rename_axis("_label").reset_index()
        rank = ids.merge(labelled, on=KEYS, how="left")["_label"].set_axis(v.index)
    else:
        coords = ids.iloc[:1] if len(v) else ids
        coords.index = [NO_RANKS] * len(coords)
        rank = pd.Series(NO_RANKS, index=v.index, dtype="object")
    part, key, whole = _parts(v)
    cells = pd.DataFrame({"row": v.index, "part": part, "key": key, "rank": rank, "severity": sev, "whole": whole})
    placed = cells[~whole]
    order = placed[["part", "key"]].drop_duplicates().sort_values("key", kind="stable")
    parts = order["part"].tolist() or (["other"] if whole.any() else [])
    if whole.any():  # a row about a whole rank (one that never answered) fills every part of its column
        spread = cells[whole].drop(columns=["part", "key"]).merge(pd.DataFrame({"part": parts}), how="cross")
        placed = pd.concat([placed.drop(columns="key"), spread], ignore_index=True)
    else:
        placed = placed.drop(columns="key")
    return Grid(cells=placed.reset_index(drop=True), parts=parts, ranks=coords.index.tolist(), coords=coords, used=used,
                n_rows=len(v))


def _pivot(lay: Grid, values: pd.Series, dtype: str) -> pd.DataFrame:
    wide = values.unstack("rank") if len(values) else pd.DataFrame()
    grid = wide.reindex(index=lay.parts, columns=lay.ranks).astype(dtype)
    grid.index.name, grid.columns.name = "part", "rank"
    return grid


def keep_mask(keep: Sequence[bool] | pd.Series, n: int) -> np.ndarray:
    """``keep`` as a boolean array of one flag per verdict row, or a ValueError saying how many it needs.

    The one check every view makes before reading ``keep`` (a mask too short would index past its end)."""
    mask = np.asarray(keep, dtype=bool)
    if mask.shape != (n,):
        raise ValueError(f"keep needs one flag per verdict row ({n:,}), got {mask.shape[0] if mask.ndim else 0:,}")
    return mask


def _kept(lay: Grid, keep: Sequence[bool] | pd.Series | None) -> pd.DataFrame:
    """The grid's cells of the frame rows ``keep`` marks (all of them without it)."""
    if keep is None:
        return lay.cells
    mask = keep_mask(keep, lay.n_rows)
    return lay.cells[mask[lay.cells["row"].to_numpy()]]


def whole_rank_notes(lay: Grid) -> dict[str, str]:
    """Rank label -> ``no answer``/``empty`` for the ranks a whole-rank row speaks for (no parameter to count)."""
    whole = lay.cells[lay.cells["whole"]].drop_duplicates("row").sort_values("severity", kind="stable")
    notes: dict[str, list[str]] = {}
    for rank, sev in zip(whole["rank"], whole["severity"]):
        note = WHOLE_RANK_NOTE[SEVERITY[int(sev)]]
        if note not in notes.setdefault(rank, []):
            notes[rank].append(note)
    return {r: ", ".join(n) for r, n in notes.items()}


def worst_severity(lay: Grid, keep: Sequence[bool] | pd.Series | None = None) -> pd.DataFrame:
    """The grid as severity indices (``Int64``, 0 = worst): what text and plots draw from.

    ``keep``: one flag per row of the frame the grid was made from; only those rows count
    (a cell whose rows are all left out is NA, as one the rank does not hold).
    """
    cells = _kept(lay, keep)
    return _pivot(lay, cells.groupby(["part", "rank"], sort=False)["severity"].min(), "Int64")


def nonmatch_counts(lay: Grid, keep: Sequence[bool] | pd.Series | None = None) -> pd.DataFrame:
    """Non-``match`` rows about parameters per cell (``Int64``), NA where the rank holds nothing of that part (or
    ``keep`` leaves nothing). A whole-rank row (a rank that did not answer, or answered empty) is about no
    parameter: its cells count 0, however many parts it fills."""
    cells = _kept(lay, keep)
    bad = ((cells["severity"] != SEVERITY.index("match")) & ~cells["whole"]).astype("int64")
    return _pivot(lay, bad.groupby([cells["part"], cells["rank"]], sort=False).sum(), "Int64")


def layer_rank_grid(verdicts: pd.DataFrame) -> pd.DataFrame:
    """Worst status per (model part, rank): parts as rows in model order, ranks as columns.

    Rows: ``embed``, ``layer 0``, ``layer 1``, ... (numeric order), ``norm`` (the
    final norm), ``head``, ``other``; only parts that occur. Columns: ranks in
    identity order, labelled by the coordinates the frame uses (``r0 pp0 tp1``), or
    by its ``url`` for a rank without any (first); a frame without rank coordinates or
    URLs has the one column ``all``. A cell is NA where the rank holds nothing of that
    part. An ``unreachable`` or ``empty`` row without name, layer and block speaks for
    its whole rank and fills every part. Coordinates that are not whole numbers from 0
    are a :class:`~wcviz.TableError` naming the column and value.
    """
    names = dict(enumerate(SEVERITY))
    return worst_severity(grid_of(verdicts)).apply(lambda col: col.map(names, na_action="ignore")).astype("string")


def layer_rank_counts(verdicts: pd.DataFrame) -> pd.DataFrame:
    """Non-``match`` rows per (model part, rank), shaped as :func:`layer_rank_grid`; NA where nothing is held.

    A whole-rank row (``unreachable``/``empty`` without a name) counts as no parameter: 0 in every part it fills."""
    return nonmatch_counts(grid_of(verdicts))
