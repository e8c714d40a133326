"""The dashboard's widgets: buttons, selectors, a status line, errors and one view, over a :class:`DashboardState`.

Only this module imports ipywidgets, and it holds no logic of the check: every button
runs the state's action of the same name, every selector sets the state's filter, and
what the state holds is drawn (figures from :mod:`wcviz.views`). What fails (an
exception, a rank that refused or did not answer) lands in the errors area
(``wcviz-errors``) and the status line, never in the kernel log and never as a success;
called from Python, a method that fails records the error the same way and then raises it.
Network work runs in a helper thread when the caller's thread runs an event loop (a
Jupyter kernel does), since the blocking fetchers cannot run inside one.
"""

from __future__ import annotations

import asyncio
import html
import io
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import ipywidgets as widgets
import pandas as pd

from wcviz._text import plural
from wcviz.widgets.state import ALL, DashboardState

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["CLASSES", "VIEWS", "Dashboard"]

VIEWS = ("layer × rank", "topology", "table", "drill-down")
_VIEW_ALIASES = {"layer x rank": "layer × rank", "layer-rank": "layer × rank", "heatmap": "layer × rank", "drilldown": "drill-down"}
TABLE_ROWS = 200  # rows the table view renders; the filtered frame is Dashboard.table
CLASSES = {
    name: f"wcviz-{name.replace('_', '-')}"
    for name in (
        "dashboard", "fetch", "snapshot", "reset", "reload", "compare", "reset_confirm", "reset_yes", "reset_cancel",
        "view", "role", "status", "search", "status_line", "progress", "errors", "clear_errors", "view_area", "heatmap",
        "topology", "drilldown", "table", "empty",
    )
}  # fmt: skip
_VIEW_CLASS = {"layer × rank": "heatmap", "topology": "topology", "drill-down": "drilldown"}  # keys of CLASSES
_BUTTONS = {  # name: (label, tooltip, icon)
    "fetch": ("Fetch", "fetch every rank's digests now", "download"),
    "snapshot": ("Snapshot", "every rank records its digests: starts a new end-state check", "camera"),
    "reset": ("Reset", "DESTRUCTIVE: poison every weight on every rank (asks first)", "bomb"),
    "reload": ("Reload", "run the weight update again, then fetch the digests", "refresh"),
    "compare": ("Compare", "classify the frames into verdicts", "balance-scale"),
}
_FRAMES_ONLY = "frames in memory: there are no agents to fetch from or act on"

T = TypeVar("T")


def _off_loop(fn: Callable[[], T]) -> T:
    """Run ``fn`` here, or in a helper thread when this thread runs an event loop (a Jupyter kernel)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn()
    with ThreadPoolExecutor(1, thread_name_prefix="wcviz-dashboard") as pool:
        return pool.submit(fn).result()


def _classed(widget: Any, name: str) -> Any:
    widget.add_class(CLASSES[name])
    return widget


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _state(name: str, doc: str) -> property:
    """An attribute of the dashboard that is the state's (readable and, for the frames, settable)."""
    return property(lambda self: getattr(self.state, name), lambda self, v: setattr(self.state, name, v), doc=doc)


class Dashboard:
    """The dashboard in a notebook: ``Dashboard(cluster)``, ``Dashboard(urls, token=...)``, ``Dashboard(frames)``.

    ``source``: a started :class:`wcviz.sim.Cluster`, agent URLs (list, or mapping URL
    -> expected identity), an end-state fleet, or frames in memory
    (``{"snapshot", "reset", "reload"}`` digest frames, ``{"expected", "actual"}`` or a
    verdict frame; then only Compare and the views work). ``token``: the agents' bearer
    token (a cluster's own by default). ``progress``: show the progress bar while
    working. ``timeout_s``/``retries``: per request, as in :func:`wcviz.sources.fetch`.
    Every button has a method (``dash.snapshot(); dash.reset(confirm=True); ...``); what
    the check produced is on :attr:`state` and here (:attr:`verdicts`, :attr:`report`,
    :attr:`frames`, :attr:`table`, ...). The widget is :attr:`widget`.
    """

    current = _state("current", "the last fetch's (or phase's) frame")
    fetch_result = _state("fetch_result", "the last fetch's FetchResult")
    frames = _state("frames", "{phase: frame} of the end-state check")
    verdicts = _state("verdicts", "the verdict frame, once compared")
    report = _state("report", "the end-state check's EndStateReport")
    transport = _state("transport", "the reload's refit transport check (a cluster)")
    exceptions = _state("exceptions", "(action, exception) of what failed, oldest first")
    session = _state("session", "the EndStateSession of a live source")
    infos = _state("infos", "each agent's /v1/info")
    kind = _state("kind", "fleet, verdicts, endstate or compare")
    token = _state("token", "the agents' bearer token")
    status_text = _state("status_text", "the status line as plain text")
    table = _state("table", "the verdict rows the table view shows (filters applied)")
    drilldown_name = _state("drilldown_name", "the parameter the drill-down shows")
    error_text = _state("error_text", "what the errors area shows, as plain text")
    live = _state("live", "whether there are ranks to fetch from and act on")
    mutation_block = _state("mutation_block", "why Snapshot, Reset and Reload are off, or None")

    def __init__(self, source: Any, *, token: str | None = None, progress: bool = True, timeout_s: float = 60.0, retries: int = 2) -> None:
        self.progress_enabled = bool(progress)
        self._busy = False
        self._figure: Figure | None = None
        self._build()
        self.state = DashboardState(source, token=token, timeout_s=timeout_s, retries=retries, on_step=self._tick)
        self._refresh_buttons()
        if self.kind in ("endstate", "compare"):
            self._guarded("compare", self.state.compare)
        self._show_status()
        self._update_choices()
        self._show_view()
        self._show_errors()

    # ---- the widget ------------------------------------------------------------------------

    def _build(self) -> None:
        self.buttons = {}
        for name, (label, tooltip, icon) in _BUTTONS.items():
            b = _classed(widgets.Button(description=label, tooltip=tooltip, icon=icon), name)
            b.on_click(lambda _b, n=name: self._click(n))
            self.buttons[name] = b
        self.buttons["reset"].button_style = "warning"
        self.confirm_text = widgets.HTML()
        self.reset_yes = _classed(widgets.Button(description="Yes, poison every weight", button_style="danger", icon="bomb"), "reset_yes")
        self.reset_cancel = _classed(widgets.Button(description="Cancel"), "reset_cancel")
        self.reset_yes.on_click(lambda _b: self._click("reset_yes"))
        self.reset_cancel.on_click(lambda _b: self._click("reset_cancel"))
        confirm = [self.confirm_text, widgets.HBox([self.reset_yes, self.reset_cancel])]
        self.reset_confirm = _classed(widgets.VBox(confirm, layout=widgets.Layout(display="none")), "reset_confirm")
        self.view = _classed(widgets.Dropdown(options=list(VIEWS), value=VIEWS[0], description="view"), "view")
        self.role = _classed(widgets.Dropdown(options=[ALL], value=ALL, description="role"), "role")
        self.status = _classed(widgets.Dropdown(options=[ALL], value=ALL, description="status"), "status")
        search = widgets.Text(value="", placeholder="parameter name (regex)", description="parameter", continuous_update=False)
        self.search = _classed(search, "search")
        self.status_line = _classed(widgets.HTML(), "status_line")
        self.progress = _classed(widgets.IntProgress(value=0, min=0, max=1, layout=widgets.Layout(display="none")), "progress")
        self.errors = _classed(widgets.HTML(layout=widgets.Layout(display="none")), "errors")
        self.clear_button = _classed(widgets.Button(description="Clear errors", layout=widgets.Layout(display="none")), "clear_errors")
        self.clear_button.on_click(lambda _b: self._click("clear_errors"))
        self.view_area = _classed(widgets.Box(), "view_area")
        for w in (self.view, self.role, self.status, self.search):
            w.observe(self._on_choice, names="value")
        rows = [
            widgets.HBox(list(self.buttons.values())), self.reset_confirm, self.status_line, self.progress,
            widgets.HBox([self.errors, self.clear_button]), widgets.HBox([self.view, self.role, self.status, self.search]),
            self.view_area,
        ]  # fmt: skip
        self.widget = _classed(widgets.VBox(rows), "dashboard")

    def _on_choice(self, change: Any) -> None:
        """A selector or the search changed: hand it to the state, draw again (an action in progress draws once at its end)."""
        self.state.role_filter, self.state.status_filter, self.state.search = self.role.value, self.status.value, self.search.value
        if self._busy:
            return
        if change["owner"] in (self.status, self.search) and self.view.value not in ("table", "drill-down"):
            return  # the status filter and the search narrow the table and the drill-down only
        self._show_view()
        self._show_errors()

    def _refresh_buttons(self) -> None:
        block = self.mutation_block
        for name, (_, tooltip, _) in _BUTTONS.items():
            b = self.buttons[name]
            if self._busy:
                b.disabled = True
            elif name != "compare" and not self.live:
                b.disabled, b.tooltip = True, _FRAMES_ONLY
            elif name not in ("fetch", "compare") and block is not None:
                b.disabled, b.tooltip = True, f"disabled: {block}"
            else:
                b.disabled, b.tooltip = False, tooltip
        self.reset_yes.disabled = self._busy

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def close(self) -> None:
        """Close every widget of the dashboard (the frames stay)."""
        _close_tree(self.widget)

    def __repr__(self) -> str:
        return f"Dashboard({self.kind}; {self.status_text})"

    # ---- clicks, errors and progress -------------------------------------------------------

    def _click(self, name: str) -> None:
        """What a button runs: the method, its errors already recorded, never raised into the kernel log."""
        actions: dict[str, Callable[[], Any]] = {
            "fetch": self.fetch, "snapshot": self.snapshot, "reset": self.reset, "reset_yes": lambda: self.reset(confirm=True),
            "reset_cancel": self.cancel_reset, "reload": self.reload, "compare": self.compare, "clear_errors": self.clear_errors,
        }  # fmt: skip
        try:
            actions[name]()
        except Exception as e:  # noqa: BLE001 - shown in the errors area, never raised into the kernel log
            if not any(seen is e for _, seen in self.exceptions):  # the actions record their own
                self.exceptions.append((name, e))
                self._show_errors()

    def _guarded(self, action: str, fn: Callable[[], T], *, steps: int = 0) -> tuple[T | None, Exception | None]:
        """Run one action: busy buttons, progress, status; an exception is recorded, shown and returned."""
        if self._busy:  # inside another action: that one records what fails
            return fn(), None
        self._busy = True
        self._refresh_buttons()
        if steps and self.progress_enabled:
            self.progress.max, self.progress.value = steps, 0
            self.progress.description, self.progress.bar_style = action, "info"
            self.progress.layout.display = None
        try:
            out = fn()
            self._show_status()
            self._update_choices()
            self._show_view()
            return out, None
        except Exception as e:  # noqa: BLE001 - shown in the errors area and the status line
            self.exceptions.append((action, e))
            if action != "view":  # a view that fails leaves a note in the view area; the status stays the check's
                self.state.status_text = f"{action} FAILED: {type(e).__name__}: {e}"
                self._show_status(bad=True)
            return None, e
        finally:
            self._busy = False
            self.progress.layout.display = "none"
            self._refresh_buttons()
            self._show_errors()

    def _run(self, action: str, fn: Callable[[], T], *, steps: int = 0) -> T:
        """A method's body: :meth:`_guarded`, then the exception (if any) raised to the Python caller too."""
        out, err = self._guarded(action, fn, steps=steps)
        if err is not None:
            raise err
        return out  # type: ignore[return-value]

    def _tick(self) -> None:
        self.progress.value = min(self.progress.max, self.progress.value + 1)

    def clear_errors(self) -> None:
        """Forget the exceptions shown (rank problems stay until their phase runs again)."""
        self.exceptions.clear()
        self._show_errors()

    def _show_errors(self) -> None:
        text = self.error_text
        style = "color:#B2182B;white-space:pre-wrap;margin:0"
        self.errors.value = f'<pre class="wcviz-error-text" style="{style}">{html.escape(text)}</pre>' if text else ""
        self.errors.layout.display = None if text else "none"
        self.clear_button.layout.display = None if self.exceptions else "none"

    def _show_status(self, *, bad: bool | None = None) -> None:
        text = self.status_text
        if bad is None:
            bad = "FAILED" in text or self.state.bad or (text.startswith("fetch:") and self.fetch_result is not None and not self.fetch_result.complete)
        color = "#B2182B" if bad else "inherit"
        self.status_line.value = f'<span class="wcviz-status-text" style="color:{color}">{html.escape(text)}</span>'

    # ---- actions ---------------------------------------------------------------------------

    def fetch(self) -> pd.DataFrame:
        """Fetch every rank's digests now (no mutation); the frame is :attr:`current`."""
        return self._run("fetch", lambda: _off_loop(self.state.fetch), steps=1)

    def snapshot(self) -> pd.DataFrame:
        """Every rank records its digests (phase ``snapshot``): starts a new end-state check."""
        self.cancel_reset()
        return self._run("snapshot", lambda: _off_loop(lambda: self.state.phase("snapshot")), steps=2)

    def reset(self, confirm: bool = False) -> pd.DataFrame | None:
        """DESTRUCTIVE with ``confirm=True``: poison every weight on every rank (phase ``reset``).

        Without ``confirm`` it only opens the confirmation box (``wcviz-reset-confirm``)
        and changes nothing; its "Yes, poison every weight" button runs ``reset(confirm=True)``.
        """

        def work() -> pd.DataFrame | None:
            self.state.require("reset")
            if "snapshot" not in self.state.frames:
                raise RuntimeError("reset before snapshot: take the snapshot first, or nothing can be compared")
            if not confirm:
                self.confirm_text.value = (
                    f"<b>Reset poisons every weight on {plural(len(self.state.targets), 'rank')}.</b> "
                    "They serve the poison pattern until Reload writes the weights again."
                )
                self.reset_confirm.layout.display = None
                return None
            self.cancel_reset()
            return _off_loop(lambda: self.state.phase("reset"))

        return self._run("reset", work, steps=2 if confirm else 0)

    @property
    def confirm_open(self) -> bool:
        """Whether the reset's confirmation box is showing."""
        return self.reset_confirm.layout.display != "none"

    def cancel_reset(self) -> None:
        """Close the confirmation box; nothing is reset."""
        self.reset_confirm.layout.display = "none"

    def reload(self) -> pd.DataFrame:
        """Run the weight update again (a cluster's refit, else each agent's reload) and fetch (phase ``reload``)."""
        self.cancel_reset()
        return self._run("reload", lambda: _off_loop(lambda: self.state.phase("reload")), steps=2)

    def compare(self) -> pd.DataFrame:
        """The verdicts: the end-state check's classification, or expected against actual."""
        return self._run("compare", self.state.compare, steps=1)

    # ---- views -----------------------------------------------------------------------------

    def set_view(self, name: str) -> None:
        """Show one of :data:`VIEWS` ("layer × rank", "topology", "table", "drill-down")."""
        key = _VIEW_ALIASES.get(name, name)
        if key not in VIEWS:
            raise ValueError(f"unknown view {name!r}; choose one of {', '.join(VIEWS)}")
        failed = len(self.exceptions)
        self.view.value = key  # renders through the observer, which records what fails
        if len(self.exceptions) > failed:
            raise self.exceptions[-1][1]

    def _update_choices(self) -> None:
        """Role and status options from what the frames hold (a value no longer present falls back to all)."""
        _options(self.role, self.state.role_options())
        _options(self.status, self.state.status_options())
        self.state.role_filter, self.state.status_filter = self.role.value, self.status.value

    def _placeholder(self, text: str) -> widgets.HTML:
        return _classed(widgets.HTML(f"<i>{html.escape(text)}</i>"), "empty")

    def _show_view(self) -> None:
        """Draw the view; a view that fails is recorded (as ``view``), never as the failure of the action that drew it."""
        self._figure = None
        try:
            self._draw()
        except Exception as e:  # noqa: BLE001 - shown in the errors area and the view area
            self.view_area.children = (self._placeholder(f"the {self.view.value} view failed: {type(e).__name__}: {e}"),)
            self.exceptions.append(("view", e))

    def _draw(self) -> None:
        from wcviz.views import plot_drilldown, plot_layer_rank, plot_topology, style_verdicts

        view, v = self.view.value, self.state.role_rows()
        if v is None:
            self.view_area.children = (self._placeholder(self.state.empty_hint()),)
            return
        if view == "table":
            t = self.table
            shown = t.head(TABLE_ROWS)
            caption = f"{len(t):,} of {len(self.verdicts):,} verdicts"
            if len(t) > len(shown):
                caption += f"; the first {len(shown):,} shown (all of them: Dashboard.table)"
            body = style_verdicts(shown, uuid="wcviz-verdicts").to_html() if len(shown) else "<i>no verdicts match the filters</i>"
            page = f'<div class="wcviz-table-caption">{html.escape(caption)}</div>' + body
            self.view_area.children = (_classed(widgets.HTML(page), "table"),)
            return
        if view == "drill-down":
            name = self.drilldown_name
            if name is None:
                self.view_area.children = (self._placeholder("no parameter matches the filters: change the status or the search"),)
                return
            fig = plot_drilldown(self.state.drill_frames(), name)
        else:
            fig = plot_layer_rank(v) if view == "layer × rank" else plot_topology(v)
        self._figure = fig
        self.view_area.children = (_classed(widgets.Image(value=_png(fig), format="png"), _VIEW_CLASS[view]),)

    @property
    def figure(self) -> Figure | None:
        """The matplotlib figure the view area shows (None for the table)."""
        return self._figure if self.view.value != "table" else None

    @property
    def view_text(self) -> str:
        """The text form of the current view (what the picture shows, for logs and notebook checks)."""
        return self.state.view_text(self.view.value)


def _options(dropdown: widgets.Dropdown, options: list[tuple[str, str]]) -> None:
    """Replace a dropdown's options, keeping its value when it is still offered (one render, not two)."""
    old = dropdown.value
    values = [v for _, v in options]
    if [tuple(o) for o in dropdown.options] == options:
        return
    with dropdown.hold_trait_notifications():
        dropdown.options = options
        dropdown.value = old if old in values else values[0]


def _close_tree(w: widgets.Widget) -> None:
    for child in getattr(w, "children", ()):
        _close_tree(child)
    w.close()
