"""``df.wc``: the views of a verdict or digest frame as methods, with no logic of their own.

Registered when :mod:`wcviz.views` is imported::

    import wcviz.views  # registers the accessor
    verdicts.wc.text()
    verdicts.wc.plot_topology()

On creation it checks that the frame is a verdict frame (``status`` and the
identity columns) or a digest frame (``name``, ``digest``, ``algo``); otherwise
``df.wc`` raises :class:`NotAWcvizFrame` (an ``AttributeError``, as pandas'
own accessors do, and a :class:`~wcviz.TableError`). Each method forwards to the
plain function of the same purpose.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandas as pd

from wcviz._errors import TableError
from wcviz.frame import IDENTITY, REQUIRED
from wcviz.verdicts import differences
from wcviz.views._grid import layer_rank_counts
from wcviz.views.plots import plot_layer_rank
from wcviz.views.styled import style_verdicts
from wcviz.views.text import layer_rank_text
from wcviz.views.topology import plot_topology, topology_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from pandas.io.formats.style import Styler

__all__ = ["NotAWcvizFrame", "WcAccessor"]

VERDICT_COLUMNS = ("status", *IDENTITY)


class NotAWcvizFrame(TableError, AttributeError):
    """``df.wc`` on a frame that is neither a verdict frame nor a digest frame."""


@pd.api.extensions.register_dataframe_accessor("wc")
class WcAccessor:
    """wcviz views of a verdict frame (or a digest frame) as ``df.wc.<view>()``; forwards only."""

    def __init__(self, frame: pd.DataFrame) -> None:
        columns = set(frame.columns)
        is_verdicts = all(c in columns for c in VERDICT_COLUMNS)
        is_digests = all(c in columns for c in REQUIRED)
        if not (is_verdicts or is_digests):
            lacks_v = [c for c in VERDICT_COLUMNS if c not in columns]
            lacks_d = [c for c in REQUIRED if c not in columns]
            raise NotAWcvizFrame(
                "df.wc needs a verdict frame (missing " + ", ".join(lacks_v) + ") or a digest frame (missing "
                + ", ".join(lacks_d) + "); see wcviz.compare, wcviz.endstate.classify and wcviz.frame"
            )
        self._frame = frame
        self.kind = "verdicts" if is_verdicts else "digests"

    def mismatches(self) -> pd.DataFrame:
        """The rows that are not ``match`` (:func:`wcviz.verdicts.differences`)."""
        return differences(self._frame)

    def counts(self) -> pd.DataFrame:
        """Non-match rows per (model part, rank) (:func:`wcviz.views.layer_rank_counts`)."""
        return layer_rank_counts(self._frame)

    def text(self, **kw: Any) -> str:
        """The layer × rank grid as text (:func:`wcviz.views.layer_rank_text`)."""
        return layer_rank_text(self._frame, **kw)

    def plot_layers(self, **kw: Any) -> Figure:
        """The layer × rank heatmap (:func:`wcviz.views.plot_layer_rank`)."""
        return plot_layer_rank(self._frame, **kw)

    def plot_topology(self, **kw: Any) -> Figure:
        """The engine's parallel layout (:func:`wcviz.views.plot_topology`)."""
        return plot_topology(self._frame, **kw)

    def topology_text(self) -> str:
        """The engine's parallel layout as text (:func:`wcviz.views.topology_text`)."""
        return topology_text(self._frame)

    def style(self, **kw: Any) -> Styler:
        """A styled HTML table (:func:`wcviz.views.style_verdicts`)."""
        return style_verdicts(self._frame, **kw)
