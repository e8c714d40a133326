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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import ipywidgets as widgets
import pandas as pd

from wcviz.widgets._area import CLASSES, VIEWS, ViewArea, _classed
from wcviz.widgets._words import said
from wcviz.widgets.state import ALL, DashboardState, StepRefused

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["CLASSES", "VIEWS", "Dashboard"]

_BUTTONS = {  # name: (label, tooltip, icon); the end-state check's steps are numbered in order, Fetch is free
    "fetch": ("Fetch", "fetch every rank's digests now (changes nothing)", "download"),
    "snapshot": ("1 Snapshot", "every rank records its digests: starts a new end-state check", "camera"),
    "reset": ("2 Reset", "DESTRUCTIVE: overwrite every weight on every rank (asks first)", "bomb"),
    "reload": ("3 Reload", "run the weight update again, then fetch the digests", "refresh"),
    "compare": ("4 Compare", "classify the frames into verdicts", "balance-scale"),
}
_ERROR_STYLE = "color:#B2182B;white-space:pre-wrap;word-break:normal;overflow-wrap:normal;overflow-x:auto;margin:0"
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


def _state(name: str, doc: str) -> property:
    """An attribute of the dashboard that is the state's (readable and, for the frames, settable)."""
    return property(lambda self: getattr(self.state, name), lambda self, v: setattr(self.state, name, v), doc=doc)


class Dashboard(ViewArea):
    """The dashboard in a notebook: ``Dashboard(cluster)``, ``Dashboard(urls, token=...)``, ``Dashboard(frames)``.

    ``source``: a started :class:`wcviz.sim.Cluster`, agent URLs (list, or mapping URL
    -> expected identity), an end-state fleet, or frames in memory
    (``{"snapshot", "reset", "reload"}`` digest frames, ``{"expected", "actual"}`` or a
    verdict frame; then only Compare and the views work). ``token``: the agents' bearer
    token (a cluster's own by default). ``progress``: show the progress bar while
    working. ``timeout_s``/``retries``: per request, as in :func:`wcviz.sources.fetch`.
    ``reset_pattern``/``allow_partial_reset``: how Compare judges the reset, as in
    :meth:`wcviz.endstate.EndStateSession.report` (the fleet's pattern by default;
    ``"poison"`` for frames in memory, so give ``reset_pattern="zeros"`` for a vLLM check's frames).
    A click on a step that is off does nothing; called from Python, it raises
    :class:`wcviz.widgets.StepRefused` and leaves the status line as it was.
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

    def __init__(
        self,
        source: Any,
        *,
        token: str | None = None,
        progress: bool = True,
        timeout_s: float = 60.0,
        retries: int = 2,
        reset_pattern: str | int | None = None,
        allow_partial_reset: bool = False,
    ) -> None:
        self.progress_enabled = bool(progress)
        self._busy = False
        self._reverting = False  # the search box put back after an invalid filter (not a person's choice)
        self._drill_sync = False
        self._figure: Figure | None = None
        self._build()
        self.state = DashboardState(
            source, token=token, timeout_s=timeout_s, retries=retries, reset_pattern=reset_pattern,
            allow_partial_reset=allow_partial_reset, on_step=self._tick, on_change=self._source_changed,
        )  # fmt: skip
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
        self.confirm_text = widgets.HTML()
        wide = widgets.Layout(width="auto")  # the whole label, never cut off
        self.reset_yes = _classed(
            widgets.Button(description="Yes, overwrite every weight", button_style="danger", icon="bomb", layout=wide), "reset_yes"
        )
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
        drill = widgets.Dropdown(options=[], description="parameter", layout=widgets.Layout(display="none", width="auto"))
        self.drill = _classed(drill, "drill")
        self.drill.observe(self._on_drill, names="value")
        self.status_line = _classed(widgets.HTML(), "status_line")
        self.progress = _classed(widgets.IntProgress(value=0, min=0, max=1, layout=widgets.Layout(display="none")), "progress")
        self.errors = _classed(widgets.HTML(layout=widgets.Layout(display="none")), "errors")
        self.clear_button = _classed(widgets.Button(description="Clear errors", layout=widgets.Layout(display="none")), "clear_errors")
        self.clear_button.on_click(lambda _b: self._click("clear_errors"))
        self.view_area = _classed(widgets.VBox(layout=widgets.Layout(align_items="flex-start")), "view_area")  # a note above, never beside
        for w in (self.view, self.role, self.status, self.search):
            w.observe(self._on_choice, names="value")
        rows = [
            widgets.HBox(list(self.buttons.values())), self.reset_confirm, self.status_line, self.progress,
            widgets.HBox([self.errors, self.clear_button]), widgets.HBox([self.view, self.role, self.status, self.search]),
            self.drill, self.view_area,
        ]  # fmt: skip
        self.widget = _classed(widgets.VBox(rows), "dashboard")

    def _on_choice(self, change: Any) -> None:
        """A selector or the search changed: hand it to the state, draw again (an action in progress draws once at its end).

        A parameter filter that is not a regular expression is an error in the errors
        area; the filter stays what it was. A valid one clears earlier filter errors, and
        a view drawn without error clears earlier view errors.
        """
        self.state.role_filter, self.state.status_filter = self.role.value, self.status.value
        if change["owner"] is self.search:
            try:
                self.state.set_search(self.search.value)
            except ValueError as e:
                self.exceptions.append(("filter", e))
                self._show_errors()
                self._reverting = True
                try:
                    self.search.value = self.state.search  # the box shows the filter that applies (the error says what was typed)
                finally:
                    self._reverting = False
                return
            if not self._reverting:  # a valid filter typed: earlier filter errors no longer apply
                self.exceptions[:] = [(a, e) for a, e in self.exceptions if a != "filter"]
        if self._busy:
            return
        self._show_view()
        self._show_errors()

    def _on_drill(self, change: Any) -> None:
        """The drill-down's parameter chosen by a person: draw it (the dashboard's own updates are not a choice)."""
        if self._drill_sync or change["new"] is None or change["new"] == self.state.drill_choice:
            return
        self.state.drill_choice = change["new"]
        if not self._busy and self.view.value == "drill-down":
            self._show_view()

    def _source_changed(self) -> None:
        """The source changed by itself (a cluster stopped): say so, turn the buttons off, mark the view stale."""
        self._show_status(bad=True)
        self._refresh_buttons()
        if not self._busy:
            self._show_view()

    def _refresh_buttons(self) -> None:
        """Each step on only when it may run now (its tooltip says why not); the next step of the flow highlighted."""
        nxt = self.state.next_step
        for name, (_, tooltip, _) in _BUTTONS.items():
            b = self.buttons[name]
            why = self.state.step_block(name)
            b.disabled = self._busy or why is not None
            b.tooltip = tooltip if why is None else f"disabled: {why}"
            b.button_style = ("danger" if name == "reset" else "primary") if name == nxt and not self._busy else ""
        self.reset_yes.disabled = self._busy or self.state.step_block("reset") is not None

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        """The live widget, and a static HTML picture of it for where widgets do not run (a saved notebook, GitHub)."""
        bundle = dict(self.widget._repr_mimebundle_(**kwargs))
        bundle["text/html"] = self.static_html()
        bundle["text/plain"] = repr(self)
        return bundle

    def close(self) -> None:
        """Close every widget of the dashboard (the frames stay)."""
        _close_tree(self.widget)

    def __repr__(self) -> str:
        return f"Dashboard({self.kind}; {self.status_text})"

    # ---- clicks, errors and progress -------------------------------------------------------

    def _click(self, name: str) -> None:
        """What a button runs: the method, its errors already recorded, never raised into the kernel log.

        A click on a step that may not run now (a double click, a click that reaches a
        button that is off) does nothing: the result on show stays, the tooltip says why.
        """
        step = "reset" if name == "reset_yes" else name
        if step in _BUTTONS and self.state.step_block(step) is not None:
            return
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
        if action == "snapshot" and self.state.step_block("snapshot") is None:
            self.exceptions.clear()  # a new check: what failed before it is history
        if steps:
            self._show_activity(self.state.plan(action) if self.state.live else f"{action}…")
            if self.progress_enabled:
                self.progress.max, self.progress.value = steps, 0
                self.progress.description, self.progress.bar_style = f"{action} 0/{steps}", "info"
                self.progress.layout.display = None
        try:
            out = fn()
            self.exceptions.clear()  # it worked: earlier failures no longer describe the dashboard
            self._show_status()
            self._update_choices()
            self._show_view()
            return out, None
        except Exception as e:  # noqa: BLE001 - shown in the errors area and the status line
            self.exceptions.append((action, e))
            # a view that fails leaves a note in the view area, and a step refused ran nothing: the status stays the check's
            if isinstance(e, StepRefused):
                self._show_status()  # what it said before the refused step's "working" line
            elif action != "view":
                self.state.status_text = f"{action} FAILED: {said(e)}"
                self._show_status(bad=True)
                try:  # the picture and the choices follow the state: a failed step cleared the verdicts it made stale
                    self._update_choices()
                    self._show_view()
                except Exception as again:  # noqa: BLE001 - the step's failure is what is reported
                    self.exceptions.append(("view", again))
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
        """One step of the action done: the progress bar and the status line say what comes next."""
        self.progress.value = min(self.progress.max, self.progress.value + 1)
        self.progress.description = f"{self.progress.description.split(' ')[0]} {self.progress.value}/{self.progress.max}"
        if self.state.activity:
            self._show_activity(self.state.activity)

    def _show_activity(self, text: str) -> None:
        """What is happening now, in the status line (blue, until the action's own status replaces it)."""
        self.status_line.value = f'<span class="wcviz-status-text wcviz-working" style="color:#1f5fa8">{html.escape(text)}</span>'

    def clear_errors(self) -> None:
        """Forget what the errors area shows: exceptions and rank problems (the session's record of them stays)."""
        self.state.clear_errors()
        self._show_errors()

    def _show_errors(self) -> None:
        text = self.error_text
        self.errors.value = f'<pre class="wcviz-error-text" style="{_ERROR_STYLE}">{html.escape(text)}</pre>' if text else ""
        self.errors.layout.display = None if text else "none"
        self.clear_button.layout.display = None if text else "none"

    def _show_status(self, *, bad: bool | None = None) -> None:
        text = self.status_text
        if bad is None:
            bad = any(w in text for w in ("FAILED", "STOPPED", "NO ANSWER")) or self.state.bad or (text.startswith("fetch:") and self.fetch_result is not None and not self.fetch_result.complete)
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
        and changes nothing; its "Yes, overwrite every weight" button runs ``reset(confirm=True)``.
        """

        def work() -> pd.DataFrame | None:
            self.state.check_alive()
            self.state.require_step("reset")
            if not confirm:
                self.confirm_text.value = (
                    f"<b>Reset overwrites every weight on {self.state.ranks_words()}.</b> "
                    "They serve the reset pattern until 3 Reload writes the weights again."
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

def _close_tree(w: widgets.Widget) -> None:
    for child in getattr(w, "children", ()):
        _close_tree(child)
    w.close()
