"""The dashboard's view area: which view is drawn, how (figures from :mod:`wcviz.views`), and its static picture.

Mixed into :class:`wcviz.widgets.Dashboard`: the widgets it draws into (``view``,
``view_area``, ``drill``, ``role``, ``status``) and the state it reads are the
dashboard's. Nothing here changes the check.
"""

from __future__ import annotations

import html
import io
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from wcviz.widgets.state import DashboardState

__all__ = ["CLASSES", "TABLE_ROWS", "VIEWS", "ViewArea"]

VIEWS = ("layer × rank", "topology", "table", "drill-down")
_VIEW_ALIASES = {"layer x rank": "layer × rank", "layer-rank": "layer × rank", "heatmap": "layer × rank", "drilldown": "drill-down"}
TABLE_ROWS = 200  # rows the table view renders; the filtered frame is Dashboard.table
CLASSES = {
    name: f"wcviz-{name.replace('_', '-')}"
    for name in (
        "dashboard", "fetch", "snapshot", "reset", "reload", "compare", "reset_confirm", "reset_yes", "reset_cancel",
        "view", "role", "status", "search", "drill", "status_line", "progress", "errors", "clear_errors", "view_area",
        "heatmap", "topology", "drilldown", "table", "empty", "stale", "note",
    )
}  # fmt: skip
_VIEW_CLASS = {"layer × rank": "heatmap", "topology": "topology", "drill-down": "drilldown"}  # keys of CLASSES


def _classed(widget: Any, name: str) -> Any:
    widget.add_class(CLASSES[name])
    return widget


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


class ViewArea:
    """Draws the chosen view of the dashboard's verdicts into its view area; see the module docstring."""

    state: DashboardState
    view: widgets.Dropdown
    view_area: widgets.VBox
    drill: widgets.Dropdown
    role: widgets.Dropdown
    status: widgets.Dropdown
    exceptions: list[tuple[str, BaseException]]
    _figure: Figure | None
    _drill_sync: bool
    _busy: bool

    def static_html(self) -> str:
        """The dashboard as it stands, as static HTML: the steps, the status line, the view (a PNG, or the table)."""
        import base64

        from wcviz.widgets.state import FLOW

        steps = " → ".join(
            f"<b>{i} {s.capitalize()}</b>" if s == self.state.next_step else f"{i} {s.capitalize()}" for i, s in enumerate(FLOW, 1)
        )
        body = ""
        if self._figure is not None and self.view.value != "table":
            data = base64.b64encode(_png(self._figure)).decode()
            body = f'<img alt="{html.escape(self.view.value)}" src="data:image/png;base64,{data}" style="max-width:100%">'
        elif self.view.value == "table" and self.state.table is not None:
            from wcviz.views import style_verdicts

            body = style_verdicts(self.state.table.head(TABLE_ROWS), uuid="wcviz-static").to_html()
        note = "a static picture of the wcviz dashboard: run the notebook for the live one"
        return (
            f'<div class="wcviz-static"><div style="color:#555"><i>{html.escape(note)}</i></div>'
            f"<div>steps: {steps}</div><div>{html.escape(self.state.status_text)}</div>{body}</div>"
        )

    def set_view(self, name: str) -> None:
        """Show one of :data:`VIEWS` ("layer × rank", "topology", "table", "drill-down")."""
        key = _VIEW_ALIASES.get(name, name)
        if key not in VIEWS:
            raise ValueError(f"unknown view {name!r}; choose one of {', '.join(VIEWS)}")
        last = self.exceptions[-1][1] if self.exceptions else None
        self.view.value = key  # renders through the observer, which records what fails
        if self.exceptions and self.exceptions[-1][1] is not last and self.exceptions[-1][0] == "view":
            raise self.exceptions[-1][1]

    def _update_choices(self) -> None:
        """Role and status options from what the frames hold (a value no longer present falls back to all)."""
        _options(self.role, self.state.role_options())
        _options(self.status, self.state.status_options())
        self.state.role_filter, self.state.status_filter = self.role.value, self.status.value

    def _placeholder(self, text: str) -> widgets.HTML:
        return _classed(widgets.HTML(f"<i>{html.escape(text)}</i>"), "empty")

    def _show_view(self) -> None:
        """Draw the view; a view that fails is recorded (as ``view``), never as the failure of the action that drew it.

        A view drawn without error clears the errors of views drawn before it (they no
        longer describe what is shown); the errors of actions stay.
        """
        self._figure = None
        try:
            self._draw()
        except Exception as e:  # noqa: BLE001 - shown in the errors area and the view area
            self.view_area.children = (self._placeholder(f"the {self.view.value} view failed: {' '.join(str(e).split())}"),)
            self.exceptions.append(("view", e))
        else:
            self.exceptions[:] = [(a, e) for a, e in self.exceptions if a != "view"]
        banner = None  # what is drawn is from before the source fell silent: say so above it (nothing drawn: nothing to say)
        if self.state.verdicts is not None and self.state.stopped is not None:
            banner = f"stale: {self.state.stopped}. These are the last results."
        elif self.state.verdicts is not None and self.state.silent is not None:
            banner = "stale: no rank answered the last fetch. These are the results from before it."
        if banner is not None:
            self.view_area.children = (_classed(widgets.HTML(f"<b>{html.escape(banner)}</b>"), "stale"), *self.view_area.children)

    def _draw(self) -> None:
        from wcviz.views import plot_drilldown, plot_layer_rank, plot_topology, style_verdicts

        view, v = self.view.value, self.state.role_rows()
        self.drill.layout.display = "none"
        if v is None:
            self.view_area.children = (self._placeholder(self.state.empty_hint()),)
            return
        if view == "table":
            t = self.state.table
            assert t is not None
            shown = t.head(TABLE_ROWS)
            caption = f"{len(t):,} of {len(self.state.verdicts):,} verdicts"  # type: ignore[arg-type]  # v is not None
            if len(t) > len(shown):
                caption += f"; the first {len(shown):,} shown (all of them: Dashboard.table)"
            body = style_verdicts(shown, uuid="wcviz-verdicts").to_html() if len(shown) else "<i>no verdicts match the filters</i>"
            page = f'<div class="wcviz-table-caption">{html.escape(caption)}</div>' + body
            self.view_area.children = (_classed(widgets.HTML(page), "table"),)
            return
        note = None
        if view == "drill-down":
            name = self.state.drilldown_name
            if name is None:
                self.view_area.children = (self._placeholder("no parameter matches the filters: change the status or the search"),)
                return
            names = self.state.drill_names
            self._drill_sync = True
            try:
                _options(self.drill, [(f"{n}  ({i} of {len(names)})", n) for i, n in enumerate(names, 1)], value=name)
            finally:
                self._drill_sync = False
            self.drill.layout.display = None
            fig = plot_drilldown(self.state.drill_frames(), name, verdicts=self.state.verdicts)
        elif view == "layer × rank":
            fig = plot_layer_rank(v, keep=self.state.keep(v) if self.state.filtering else None)
        else:
            fig = plot_topology(v)
            if self.state.filtering:
                note = "the status and parameter filters do not apply here: the topology shows each rank's worst status"
        self._figure = fig
        picture = widgets.Image(value=_png(fig), format="png", layout=widgets.Layout(max_width="100%", height="auto"))
        drawn: tuple[Any, ...] = (_classed(picture, _VIEW_CLASS[view]),)  # its own size, smaller only where it must be
        if note:
            drawn = (_classed(widgets.HTML(f"<i>{html.escape(note)}</i>"), "note"), *drawn)
        self.view_area.children = drawn

    @property
    def figure(self) -> Figure | None:
        """The matplotlib figure the view area shows (None for the table)."""
        return self._figure if self.view.value != "table" else None

    @property
    def view_text(self) -> str:
        """The text form of the current view (what the picture shows, for logs and notebook checks)."""
        return self.state.view_text(self.view.value)



def _options(dropdown: widgets.Dropdown, options: list[tuple[str, str]], value: str | None = None) -> None:
    """Replace a dropdown's options, keeping its value (or taking ``value``) when it is offered (one render, not two)."""
    want = dropdown.value if value is None else value
    values = [v for _, v in options]
    if [tuple(o) for o in dropdown.options] == options and dropdown.value == want:
        return
    if [tuple(o) for o in dropdown.options] != options:
        with dropdown.hold_trait_notifications():
            dropdown.options = options  # the value falls back to the first option (or None)
    if want in values and dropdown.value != want:
        dropdown.value = want
