"""Views of verdict frames: the layer × rank grid as a table, as text and as a heatmap.

Views only read verdict frames (:func:`wcviz.verdicts.compare`,
:func:`wcviz.endstate.classify`); nothing that computes imports them. matplotlib
loads only when a plot is drawn, so importing this package stays cheap.
"""

from __future__ import annotations

from wcviz.views._grid import NO_RANKS, SEVERITY, layer_rank_counts, layer_rank_grid
from wcviz.views.plots import COLORS, NOT_HELD_COLOR, plot_layer_rank
from wcviz.views.text import MARKS, NOT_HELD, layer_rank_text, status_counts_text

__all__ = [
    "COLORS",
    "MARKS",
    "NOT_HELD",
    "NOT_HELD_COLOR",
    "NO_RANKS",
    "SEVERITY",
    "layer_rank_counts",
    "layer_rank_grid",
    "layer_rank_text",
    "plot_layer_rank",
    "status_counts_text",
]
