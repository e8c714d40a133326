"""The layer × rank grid: which part of the model is wrong on which rank.

Every view of a verdict frame (text, heatmap) is drawn from one grid: the
model's parts in model order (rows), the ranks in identity order (columns) and
the worst status of each cell. Both verdict kinds are read alike: comparison
verdicts (:func:`wcviz.verdicts.compare`) and end-state verdicts
(:func:`wcviz.endstate.classify`); only the ``status`` column, the identity
columns and ``layer``/``block`` (parsed from ``name`` when absent) are used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from wcviz._errors import TableError
from wcviz._text import rank_label
from wcviz.frame import IDENTITY, parse_block, parse_layer
from wcviz.verdicts import SEVERITY, check_statuses  # worst first: both verdict kinds' statuses

__all__ = ["NO_RANKS", "SEVERITY", "layer_rank_counts", "layer_rank_grid"]

NO_RANKS = "all"  # the one column of a frame without rank coordinates

_PART_ORDER = {"embed": 0, "layer": 1, "norm": 2, "head": 3, "other": 4}


@dataclass(frozen=True)
class Grid:
    """What every view draws: rows of the frame placed in the grid.

    ``cells`` has one row per verdict row (a rank-wide row once per part) with
    ``row`` (position in the frame), ``part``, ``rank`` (column label) and
    ``severity`` (index into ``SEVERITY``);
    ``parts`` and ``ranks`` are the grid's labels in order; ``coords`` holds the
    identity values of each rank column (indexed by label), ``used`` the
    identity columns that locate ranks.
    """

    cells: pd.DataFrame
    parts: list[str]
    ranks: list[str]
    coords: pd.DataFrame
    used: list[str]


def _label(coords: pd.Series, used: list[str]) -> str:
    """``r0 pp0 tp1``: each used coordinate the rank has, prefixed by its name."""
    return rank_label({c: coords[c] for c in used}, "compact")


def _parts(v: pd.DataFrame) -> tuple[pd.Series, pd.Series, pd.Series]:
    """Each row's part label, its sort key and whether it is rank-wide (no name, layer or block)."""
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
    rank_wide = names.isna() & layer.isna() & block.isna()
    return part, key, rank_wide.astype(bool)


def _severity(v: pd.DataFrame) -> pd.Series:
    check_statuses(v)  # a status column, and no row without a status
    sev = v["status"].astype("object").map({s: i for i, s in enumerate(SEVERITY)})
    if sev.isna().any():
        bad = sorted({str(s) for s in v.loc[sev.isna(), "status"].astype("object")})
        raise TableError(f"column 'status' has {', '.join(bad)}; expected one of {', '.join(SEVERITY)}")
    return sev.astype("int64")


def grid_of(verdicts: pd.DataFrame) -> Grid:
    """Place a verdict frame's rows in the part × rank grid (the form every view reads)."""
    if not isinstance(verdicts, pd.DataFrame):
        raise TableError(f"expected a verdict DataFrame, got {type(verdicts).__name__}")
    v = verdicts.reset_index(drop=True)
    sev = _severity(v)
    ids = pd.DataFrame({c: (v[c] if c in v else pd.Series(pd.NA, index=v.index)) for c in IDENTITY})
    ids = ids.apply(lambda s: pd.to_numeric(s, errors="coerce")).astype("Int64")
    used = [c for c in IDENTITY if ids[c].notna().any()]
    if used:
        coords = ids.drop_duplicates().sort_values(list(IDENTITY), na_position="first", kind="stable")
        coords.index = [_label(row, used) for _, row in coords.iterrows()]
        labelled = coords.rename_axis("_label").reset_index()
        rank = ids.merge(labelled, on=list(IDENTITY), how="left")["_label"].set_axis(v.index)
    else:
        coords = pd.DataFrame({c: pd.Series([pd.NA] if len(v) else [], dtype="Int64") for c in IDENTITY})
        coords.index = [NO_RANKS] * len(coords)
        rank = pd.Series(NO_RANKS, index=v.index, dtype="object")
    part, key, rank_wide = _parts(v)
    cells = pd.DataFrame({"row": v.index, "part": part, "key": key, "rank": rank, "severity": sev})
    placed = cells[~rank_wide]
    order = placed[["part", "key"]].drop_duplicates().sort_values("key", kind="stable")
    parts = order["part"].tolist() or (["other"] if rank_wide.any() else [])
    if rank_wide.any():  # a row about a whole rank (one that never answered) fills every part of its column
        spread = cells[rank_wide].drop(columns=["part", "key"]).merge(pd.DataFrame({"part": parts}), how="cross")
        placed = pd.concat([placed.drop(columns="key"), spread], ignore_index=True)
    else:
        placed = placed.drop(columns="key")
    return Grid(cells=placed.reset_index(drop=True), parts=parts, ranks=coords.index.tolist(), coords=coords, used=used)


def _pivot(lay: Grid, values: pd.Series, dtype: str) -> pd.DataFrame:
    wide = values.unstack("rank") if len(values) else pd.DataFrame()
    grid = wide.reindex(index=lay.parts, columns=lay.ranks).astype(dtype)
    grid.index.name, grid.columns.name = "part", "rank"
    return grid


def _kept(lay: Grid, keep: Sequence[bool] | pd.Series | None) -> pd.DataFrame:
    """The grid's cells of the frame rows ``keep`` marks (all of them without it)."""
    if keep is None:
        return lay.cells
    mask = np.asarray(keep, dtype=bool)
    return lay.cells[mask[lay.cells["row"].to_numpy()]]


def worst_severity(lay: Grid, keep: Sequence[bool] | pd.Series | None = None) -> pd.DataFrame:
    """The grid as severity indices (``Int64``, 0 = worst): what text and plots draw from.

    ``keep``: one flag per row of the frame the grid was made from; only those rows count
    (a cell whose rows are all left out is NA, as one the rank does not hold).
    """
    cells = _kept(lay, keep)
    return _pivot(lay, cells.groupby(["part", "rank"], sort=False)["severity"].min(), "Int64")


def nonmatch_counts(lay: Grid, keep: Sequence[bool] | pd.Series | None = None) -> pd.DataFrame:
    """Non-``match`` rows per cell (``Int64``), NA where the rank holds nothing of that part (or ``keep`` leaves nothing)."""
    cells = _kept(lay, keep)
    bad = (cells["severity"] != SEVERITY.index("match")).astype("int64")
    return _pivot(lay, bad.groupby([cells["part"], cells["rank"]], sort=False).sum(), "Int64")


def layer_rank_grid(verdicts: pd.DataFrame) -> pd.DataFrame:
    """Worst status per (model part, rank): parts as rows in model order, ranks as columns.

    Rows: ``embed``, ``layer 0``, ``layer 1``, ... (numeric order), ``norm`` (the
    final norm), ``head``, ``other``; only parts that occur. Columns: ranks in
    identity order, labelled by the coordinates the frame uses (``r0 pp0 tp1``);
    a frame without rank coordinates has the one column ``all``. A cell is NA
    where the rank holds nothing of that part. A row without name, layer and
    block speaks for its whole rank (say, ``unreachable``) and fills every part.
    """
    names = dict(enumerate(SEVERITY))
    return worst_severity(grid_of(verdicts)).apply(lambda col: col.map(names, na_action="ignore")).astype("string")


def layer_rank_counts(verdicts: pd.DataFrame) -> pd.DataFrame:
    """Non-``match`` rows per (model part, rank), shaped as :func:`layer_rank_grid`; NA where nothing is held."""
    return nonmatch_counts(grid_of(verdicts))
