"""Verdicts as a styled HTML table for notebooks: each status cell in its colour, stable HTML.

The table's uuid is fixed (``set_uuid``), so the same frame renders to the same
HTML in every run: notebooks diff cleanly and nbval can check the output.
pandas' Styler (which needs jinja2) is imported only when a table is styled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pandas as pd

from wcviz._errors import TableError
from wcviz.frame import IDENTITY
from wcviz.verdicts import check_statuses
from wcviz.views.plots import COLORS

if TYPE_CHECKING:
    from pandas.io.formats.style import Styler

__all__ = ["STYLE_COLUMNS", "style_verdicts"]

# shown by default, in this order, when the frame has them
STYLE_COLUMNS = (
    *IDENTITY, "url", "name", "status", "digest_expected", "digest_actual", "digest_snapshot", "digest_reset", "digest_reload",
    "same_as", "host",
)
_HEX = 8  # digest characters shown


def _ink(color: str) -> str:
    """Black or white text on ``color`` (``#RRGGBB``), as the plots choose it, without matplotlib."""
    r, g, b = (int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


_CSS = {status: f"background-color: {color}; color: {_ink(color)}" for status, color in COLORS.items()}


def style_verdicts(verdicts: pd.DataFrame, *, uuid: str = "wcviz-verdicts", columns: Sequence[str] | None = None) -> Styler:
    """A :class:`~pandas.io.formats.style.Styler` of a verdict frame: status cells coloured as the plots colour them.

    ``columns`` picks and orders the columns shown; by default the identity
    columns the frame uses, ``url`` (a rank known only by where it was asked), ``name``, ``status``, the digest columns of either
    verdict kind, ``same_as`` and ``host``, where they hold a value. Digests show their first
    8 hex characters; missing values show as empty. The uuid is fixed, so
    ``to_html()`` gives the same HTML for the same frame in every run.
    """
    check_statuses(verdicts)  # a verdict frame, every row one of the statuses a check gives
    if columns is None:
        shown = [c for c in STYLE_COLUMNS if c in verdicts and not (c != "status" and verdicts[c].isna().all())]  # nothing to show
    else:
        shown = list(columns)
        missing = [c for c in shown if c not in verdicts]
        if missing:
            raise TableError(f"no column {', '.join(repr(c) for c in missing)} in the verdicts; they have {', '.join(map(str, verdicts.columns))}")
    frame = verdicts.reset_index(drop=True)[shown]
    styler = frame.style.set_uuid(uuid).hide(axis="index")
    if "status" in shown:
        styler = styler.map(lambda s: _CSS.get(str(s), ""), subset=["status"])
    digests = [c for c in shown if str(c).startswith("digest")]
    if digests:
        styler = styler.format(lambda d: str(d)[:_HEX], subset=digests, na_rep="")
    others = [c for c in shown if c not in digests]
    if others:
        styler = styler.format(na_rep="", subset=others)
    return styler.set_table_attributes('class="wcviz-verdicts"')
