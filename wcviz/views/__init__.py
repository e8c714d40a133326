"""Views of verdict and digest frames: grids, topology, drill-downs, cost, styled tables, ``df.wc``.

Views only read frames (:func:`wcviz.verdicts.compare`,
:func:`wcviz.endstate.classify`, digest frames, :func:`wcviz.bench.checksum_cost`);
nothing that computes imports them. Every plot has a text form. matplotlib loads
only when a plot is drawn and pandas' Styler only when a table is styled, so
importing this package stays cheap; importing it registers the ``df.wc`` accessor.
"""

from __future__ import annotations

from wcviz.views._grid import NO_RANKS, SEVERITY, layer_rank_counts, layer_rank_grid
from wcviz.views.accessor import NotAWcvizFrame, WcAccessor
from wcviz.views.cost import cost_text, plot_cost, plot_predicted_cost
from wcviz.views.drilldown import DRILLDOWN_COLORS, DRILLDOWN_KINDS, drilldown_text, plot_drilldown
from wcviz.views.plots import COLORS, NOT_HELD_COLOR, plot_layer_rank
from wcviz.views.styled import style_verdicts
from wcviz.views.text import MARKS, NOT_HELD, layer_rank_text, status_counts_text
from wcviz.views.topology import plot_topology, topology_text

__all__ = [
    "COLORS",
    "DRILLDOWN_COLORS",
    "DRILLDOWN_KINDS",
    "MARKS",
    "NOT_HELD",
    "NOT_HELD_COLOR",
    "NO_RANKS",
    "SEVERITY",
    "NotAWcvizFrame",
    "WcAccessor",
    "cost_text",
    "drilldown_text",
    "layer_rank_counts",
    "layer_rank_grid",
    "layer_rank_text",
    "plot_cost",
    "plot_predicted_cost",
    "plot_drilldown",
    "plot_layer_rank",
    "plot_topology",
    "status_counts_text",
    "style_verdicts",
    "topology_text",
]
