"""A rank's digest table on the wire, in its two forms, and the one frame built from many of them.

``GET /v1/digests`` answers one of two bodies holding the same table:

- **rows** (what every agent answers unless asked otherwise, and what every client
  reads): ``{"rows": [{column: value, ...}, ...]}``;
- **columns** (answered only when the request's ``Accept`` names
  :data:`COLUMNS_MEDIA_TYPE`): ``{"format": "columns", "count": n, "columns":
  {column: [n values]}, "same": {column: value}}``. ``same`` holds what every row
  shares (the rank's identity, host, phase), sent once; ``name`` and ``digest`` are
  always lists, so a count is never more than the body backs.

An older agent ignores the ``Accept`` header and answers rows; an older client never
sends it and gets rows: neither side needs to know the other's version. The columns
form is several times cheaper to parse (a few long lists instead of a dict per row),
and :func:`frame_of_tables` builds the one frame of every rank from the lists without
a frame per rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import pandas as pd

from wcviz.frame import COLUMNS, validate

__all__ = ["COLUMNS_MEDIA_TYPE", "RankTable", "frame_of_tables", "table_of_body"]

COLUMNS_MEDIA_TYPE = "application/vnd.wcviz.columns+json"
"""The ``Accept`` (and ``Content-Type``) of the columns form of ``/v1/digests``."""

_SCALARS = (str, int, float, bool, type(None))


class WireError(ValueError):
    """A body that is not a digest table in either form; the message names what is wrong."""


@dataclass(frozen=True)
class RankTable:
    """One rank's table as columns: ``count`` rows, ``columns`` (a list of ``count`` values each) and ``same``
    (one value for every row). A column is in one of the two, never both; every name is a schema column."""

    count: int
    columns: dict[str, list[Any]]
    same: dict[str, Any]

    def rows(self) -> list[dict[str, Any]]:
        """The table as row dicts: the rows form's ``rows``."""
        if not self.columns:
            return [dict(self.same) for _ in range(self.count)]
        names = list(self.columns)
        return [{**dict(zip(names, values)), **self.same} for values in zip(*self.columns.values())]

    def body(self) -> dict[str, Any]:
        """The columns form's body."""
        return {"format": "columns", "count": self.count, "columns": self.columns, "same": self.same}


def table_of_rows(rows: Any) -> RankTable:
    """A rows-form table (a list of row dicts with schema columns) as a :class:`RankTable`."""
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise WireError(f"did not give a list of row dicts: {str(rows)[:200]}")
    keys = set().union(*rows) if rows else set()
    _check_known(keys)
    names = [c for c in COLUMNS if c in keys]
    return RankTable(len(rows), {c: [r.get(c) for r in rows] for c in names}, {})


def table_of_columns(body: Mapping[str, Any]) -> RankTable:
    """A columns-form body as a :class:`RankTable`, every list checked against ``count``."""
    count, columns, same = body.get("count"), body.get("columns"), body.get("same", {})
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise WireError(f"gave a columns table whose count is {count!r}, not a whole number >= 0")
    if not isinstance(columns, dict) or not isinstance(same, dict):
        raise WireError("gave a columns table whose 'columns' or 'same' is not an object")
    both = sorted(set(columns) & set(same))
    if both:
        raise WireError(f"gave column(s) {', '.join(both)} both per row and once for every row")
    _check_known(set(columns) | set(same))
    if count and not {"name", "digest"} <= set(columns):  # per-row lists bound the count by the body's size
        raise WireError(f"gave a columns table of {count} rows without a list of names and a list of digests")
    for name, values in columns.items():
        if not isinstance(values, list) or len(values) != count:
            got = f"{len(values)} values" if isinstance(values, list) else f"a {type(values).__name__}"
            raise WireError(f"gave column {name!r} with {got} for {count} rows")
    for name, value in same.items():
        if not isinstance(value, _SCALARS):
            raise WireError(f"gave column {name!r} for every row as a {type(value).__name__}, not a value")
    return RankTable(count, dict(columns), dict(same))


def table_of_body(body: Any) -> RankTable:
    """The table in a ``/v1/digests`` body of either form, or a :class:`WireError` saying what is wrong."""
    if isinstance(body, dict) and body.get("format") == "columns":
        return table_of_columns(body)
    if isinstance(body, dict) and "format" in body:
        raise WireError(f"answered a table in an unknown format {str(body['format'])[:50]!r}")
    rows = body.get("rows") if isinstance(body, dict) else None
    if not isinstance(rows, list):
        raise WireError("did not answer {'rows': [...]} or a columns table")
    return table_of_rows(rows)


def wrong_identity(table: RankTable, ident: Mapping[str, Any], keys: Sequence[str]) -> tuple[str, Any] | None:
    """The first identity field (of ``keys``) some row gives otherwise than ``ident``, with the value it gives."""
    for k in keys:
        want = ident.get(k)
        if k in table.columns:
            got = next((v for v in table.columns[k] if v != want), _NOTHING)
            if got is not _NOTHING:
                return k, got
        elif table.count and table.same.get(k) != want:
            return k, table.same.get(k)
    return None


_NOTHING = object()


def frame_of_tables(tables: Sequence[tuple[str, RankTable]], source: str = "ranks") -> pd.DataFrame:
    """One validated frame of every ``(label, table)``, in that order, with a ``url`` column (the label):
    each column's lists joined once, one frame built, validated once (a :class:`~wcviz.TableError` if a value
    is not what its column holds: the caller finds whose, table by table)."""
    names = [c for c in COLUMNS if any(c in t.columns or c in t.same for _, t in tables)]
    data: dict[str, list[Any]] = {}
    for name in names:
        joined: list[Any] = []
        for _, t in tables:
            joined.extend(t.columns[name] if name in t.columns else repeat(t.same.get(name), t.count))
        data[name] = joined
    url: list[str] = []
    for label, t in tables:
        url.extend(repeat(label, t.count))
    frame = validate(pd.DataFrame(data), source=source)
    frame["url"] = pd.array(url, dtype="string")
    return frame


def _check_known(keys: set[Any]) -> None:
    unknown = sorted(str(k) for k in keys - set(COLUMNS))
    if unknown:
        raise WireError(f"is not a digest table: unknown column(s) {', '.join(unknown)}")
