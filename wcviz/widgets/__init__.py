"""The dashboard: fetch, run the end-state check and look at its verdicts, in a notebook.

::

    from wcviz.widgets import Dashboard

    dash = Dashboard(cluster)      # a started wcviz.sim.Cluster, agent URLs, a fleet, or frames in memory
    dash                           # displays itself; every button has a method:
    dash.snapshot(); dash.reset(confirm=True); dash.reload(); dash.compare()
    dash.verdicts                  # ... and everything it shows is a frame to keep working with

Two parts: :class:`DashboardState` (:mod:`wcviz.widgets.state`) knows and does
everything in plain Python, testable without ipywidgets; :class:`Dashboard`
(:mod:`wcviz.widgets.view`) draws it with ipywidgets. Every part carries a stable CSS
class (:data:`CLASSES`) so a browser test can find it. Nothing else in wcviz imports
this package.
"""

from __future__ import annotations

from typing import Any

from wcviz.widgets.state import DashboardState, MutationRefused, StepRefused

__all__ = ["CLASSES", "VIEWS", "Dashboard", "DashboardState", "MutationRefused", "StepRefused"]


def __getattr__(name: str) -> Any:
    """The ipywidgets view is imported only when asked for: the state works without ipywidgets."""
    if name in ("CLASSES", "VIEWS", "Dashboard"):
        from wcviz.widgets import view

        return getattr(view, name)
    raise AttributeError(f"module 'wcviz.widgets' has no attribute {name!r}")
