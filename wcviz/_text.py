"""The few ways wcviz puts things into words: counts, lists, rank labels, an exception in one line.

One owner for each, so a rank reads the same in a summary, an error and a view.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["SHOWN", "aligned", "listing", "one_line", "plural", "rank_label", "shape_str", "size"]

SHOWN = 8  # items a list names before "+N more"

_COORDS = ("dp", "pp", "tp", "ep")
_PREFIX = {"rank": "r", "dp": "dp", "pp": "pp", "tp": "tp", "ep": "ep"}


def plural(n: int, word: str) -> str:
    """``1 rank``, ``2 ranks``, ``1,500 parameters``."""
    return f"{n:,} {word}{'s' if n != 1 else ''}"


def size(nbytes: float) -> str:
    """``141.0 GB``, ``3.2 MB``, ``512 B``: a byte count a person reads at a glance."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{int(nbytes)} B"


def listing(items: Sequence[str], shown: int = SHOWN) -> str:
    """``a, b, c`` with at most ``shown`` items, then ``+N more``."""
    more = len(items) - shown
    return ", ".join(items[:shown]) + (f", +{more} more" if more > 0 else "")


def shape_str(shape: Sequence[int]) -> str:
    """The table form of a shape: a JSON list, ``[4096, 1024]``."""
    return json.dumps([int(d) for d in shape])


_ESCAPES = str.maketrans({"\t": "\\t", "\r": "\\r", "\n": "\\n"})


def aligned(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """``rows`` as a text table: a header, one line per row, every column right-aligned.

    The same text as pandas' ``frame[columns].to_string(index=False)`` for columns of
    strings or integers (an integer column's header gets pandas' leading sign space;
    tabs and line breaks in a value are shown escaped, so a row stays one line), without
    importing pandas: ``wcviz digest`` prints its table with this.
    """
    heads = []
    for c in columns:
        numeric = bool(rows) and all(isinstance(r[c], int) and not isinstance(r[c], bool) for r in rows)
        heads.append(" " + c if numeric else c)
    cells = [[str(r[c]).translate(_ESCAPES) for c in columns] for r in rows]
    widths = [max([len(h), *(len(line[i]) for line in cells)]) for i, h in enumerate(heads)]
    return "\n".join(" ".join(v.rjust(w) for v, w in zip(line, widths)) for line in [heads, *cells])


def one_line(exc: BaseException) -> str:
    """``TypeName: message`` (or the type alone), for reports that show an exception in a line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _int(v: Any) -> int | None:
    if v is None:
        return None
    import pandas as pd  # here, not at the top: importing this module stays cheap

    return None if pd.isna(v) else int(v)


def rank_label(row: Mapping[str, Any], style: str = "rank") -> str:
    """How a rank is named, from whatever identity ``row`` holds (``rank``, ``dp``, ``pp``, ``tp``, ``ep``, ``role``, ``url``).

    ``style``:

    - ``rank``: ``rank 3 (pp=0 tp=1)`` (coordinates alone without a rank; verdicts, summaries);
    - ``role``: ``engine 3 (pp=0 tp=1)`` (the URL without a rank; problems of a check);
    - ``role rank``: ``engine rank 3 (pp=0 tp=1)`` (a process of the simulated cluster);
    - ``compact``: ``r3 pp0 tp1`` (grid columns);
    - ``short``: ``rank 3 (pp0 tp1)`` (a status line);
    - ``coords``: ``(rank=3 pp=0 tp=1)`` (error messages about table rows).
    """
    rank = _int(row.get("rank"))
    coords = {c: _int(row.get(c)) for c in _COORDS}
    shown = " ".join(f"{c}={v}" for c, v in coords.items() if v is not None)
    url = row.get("url")
    nowhere = str(url) if isinstance(url, str) and url else "(no rank)"  # a rank known only by its address
    if style == "compact":
        pieces = [f"{_PREFIX[c]}{v}" for c, v in (("rank", rank), *coords.items()) if v is not None]
        return " ".join(pieces) or nowhere
    if style == "short":
        where = " ".join(f"{_PREFIX[c]}{v}" for c, v in coords.items() if v is not None)
        at = f"rank {rank}" if rank is not None else ""
        return (f"{at} ({where})" if at and where else at or where) or nowhere
    if style == "coords":
        everything = " ".join(f"{c}={v}" for c, v in (("rank", rank), *coords.items()) if v is not None)
        return f"({everything or 'no coordinates'})"
    role = row.get("role")
    role = role if isinstance(role, str) and role else None
    if style == "rank":
        if rank is None:
            url = row.get("url")
            return shown or (str(url) if isinstance(url, str) and url else "(no rank coordinates)")
        who = f"rank {rank}"
    elif style == "role":
        if rank is None:
            return str(row.get("url"))
        who = f"{role or 'rank'} {rank}"
    elif style == "role rank":
        who = f"{role} rank {rank}" if role else f"rank {rank}"
    else:
        raise ValueError(f"unknown rank label style {style!r}; choose rank, role, role rank, compact, short or coords")
    return who + (f" ({shown})" if shown else "")
