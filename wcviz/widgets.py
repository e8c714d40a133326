"""The dashboard: fetch, run the end-state check and look at its verdicts, in a notebook.

::

    from wcviz.widgets import Dashboard

    dash = Dashboard(cluster)      # a started wcviz.sim.Cluster, agent URLs, or frames in memory
    dash                           # displays itself; every button has a method:
    dash.snapshot(); dash.reset(confirm=True); dash.reload(); dash.compare()
    dash.verdicts                  # ... and everything it shows is a frame to keep working with

Sources:

- a started :class:`wcviz.sim.Cluster`: its engine agents; Reload is ``cluster.refit()``
  (the update under test); mutations are allowed iff ``cluster.allow_mutations``;
- agent URLs (a list, or a mapping URL -> expected identity): Reload is each agent's
  ``POST /v1/reload``; mutations are allowed iff a ``token`` was given and every
  agent's ``/v1/info`` says ``mutations_allowed``;
- frames in memory: ``{"snapshot", "reset", "reload"}`` digest frames (classified),
  ``{"expected", "actual"}`` (compared) or a verdict frame. Only Compare and the views
  work; Fetch, Snapshot, Reset and Reload are disabled, their tooltip says why.

Every part carries a stable CSS class (:data:`CLASSES`) so a browser test can find it.
Every click runs the method of the same name; what fails (an exception, a rank that
refused or did not answer) lands in the errors area (``wcviz-errors``,
:attr:`Dashboard.error_text`) and the status line (:attr:`Dashboard.status_text`),
never in the kernel log and never as a success. Called from Python, a method that
fails records the error the same way and then raises it.

Network work runs in a helper thread when the caller's thread runs an event loop (a
Jupyter kernel does), since the blocking fetchers cannot run inside one.

Only this module imports ipywidgets; nothing else in wcviz imports this module.
"""

from __future__ import annotations

import asyncio
import html
import io
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import ipywidgets as widgets
import pandas as pd

from wcviz.frame import IDENTITY

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from wcviz.check import EndStateReport, EndStateSession
    from wcviz.sources import FetchResult

__all__ = ["CLASSES", "VIEWS", "Dashboard"]

VIEWS = ("layer × rank", "topology", "table", "drill-down")
_VIEW_ALIASES = {
    "layer x rank": "layer × rank",
    "layer-rank": "layer × rank",
    "heatmap": "layer × rank",
    "drilldown": "drill-down",
}
ALL = "all"
NOT_MATCH = "not match"
TABLE_ROWS = 200  # rows the table view renders; the filtered frame is Dashboard.table

CLASSES = {
    "dashboard": "wcviz-dashboard",
    "fetch": "wcviz-fetch",
    "snapshot": "wcviz-snapshot",
    "reset": "wcviz-reset",
    "reload": "wcviz-reload",
    "compare": "wcviz-compare",
    "reset_confirm": "wcviz-reset-confirm",
    "reset_yes": "wcviz-reset-yes",
    "reset_cancel": "wcviz-reset-cancel",
    "view": "wcviz-view",
    "role": "wcviz-role",
    "status": "wcviz-status",
    "search": "wcviz-search",
    "status_line": "wcviz-status-line",
    "progress": "wcviz-progress",
    "errors": "wcviz-errors",
    "clear_errors": "wcviz-clear-errors",
    "view_area": "wcviz-view-area",
    "heatmap": "wcviz-heatmap",
    "topology": "wcviz-topology",
    "drilldown": "wcviz-drilldown",
    "table": "wcviz-table",
    "empty": "wcviz-empty",
}
_VIEW_CLASS = {"layer × rank": "heatmap", "topology": "topology", "drill-down": "drilldown"}  # keys of CLASSES

T = TypeVar("T")


# --------------------------------------------------------------------------- helpers


def _off_loop(fn: Callable[[], T]) -> T:
    """Run ``fn`` here, or in a helper thread when this thread runs an event loop (a Jupyter kernel)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn()
    with ThreadPoolExecutor(1, thread_name_prefix="wcviz-dashboard") as pool:
        return pool.submit(fn).result()


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'s' if n != 1 else ''}"


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _classed(widget: widgets.DOMWidget, name: str) -> Any:
    widget.add_class(CLASSES[name])
    return widget


def _rank_label(row: Mapping[str, Any]) -> str:
    """``engine 1 (pp=0 tp=1)`` from whatever identity a problem row has."""
    coords = " ".join(f"{c}={int(row[c])}" for c in IDENTITY[1:] if c in row and not pd.isna(row[c]))
    role = row.get("role")
    who = (
        f"{role if isinstance(role, str) and role else 'rank'} {int(row['rank'])}"
        if not pd.isna(row.get("rank"))
        else str(row.get("url"))
    )
    return who + (f" ({coords})" if coords else "")


def _ranks(df: pd.DataFrame) -> pd.DataFrame:
    """The distinct rank identities of a frame (NA coordinates are one value)."""
    cols = [c for c in IDENTITY if c in df]
    return df[cols].drop_duplicates() if cols else pd.DataFrame(index=[0])


def _frames_kind(source: Any) -> str | None:
    """``endstate``/``compare``/``verdicts`` for frames in memory, None for anything else."""
    if isinstance(source, pd.DataFrame):
        if "status" not in source:
            raise TypeError(
                "a single frame must be a verdict frame (with a 'status' column); "
                "give {'expected': frame, 'actual': frame} to compare two digest frames"
            )
        return "verdicts"
    if isinstance(source, Mapping) and source and all(isinstance(v, pd.DataFrame) for v in source.values()):
        keys = set(source)
        if keys == {"snapshot", "reset", "reload"}:
            return "endstate"
        if keys == {"expected", "actual"}:
            return "compare"
        raise ValueError(
            f"frames in memory need the keys snapshot, reset, reload or expected, actual; got {', '.join(map(str, source))}"
        )
    return None


def _is_cluster(source: Any) -> bool:
    mod = sys.modules.get("wcviz.sim.cluster")  # only a user who has a Cluster has imported it
    return mod is not None and isinstance(source, mod.Cluster)


def _probe_infos(urls: Sequence[str], timeout_s: float) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Each agent's ``/v1/info`` (plain httpx, no event loop), or why there is none."""
    import httpx

    def one(url: str) -> tuple[str, dict[str, Any] | None, str | None]:
        try:
            resp = httpx.get(f"{url}/v1/info", timeout=timeout_s)
        except httpx.HTTPError as e:
            return url, None, f"{type(e).__name__}: {e}"
        if resp.status_code != 200:
            return url, None, f"HTTP {resp.status_code}"
        try:
            body = resp.json()
        except ValueError:
            return url, None, "/v1/info did not answer JSON"
        return (url, body, None) if isinstance(body, dict) else (url, None, "/v1/info is not an object")

    infos: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    with ThreadPoolExecutor(min(16, max(1, len(urls))), thread_name_prefix="wcviz-info") as pool:
        for url, info, err in pool.map(one, urls):
            if info is not None:
                infos[url] = info
            else:
                errors[url] = str(err)
    return infos, errors


def _ticking_session(urls: Any, tick: Callable[[], None], **kwargs: Any) -> EndStateSession:
    """An :class:`wcviz.check.EndStateSession` that calls ``tick`` after each action and each fetch (the progress bar)."""
    from wcviz.check import EndStateSession

    class TickingSession(EndStateSession):
        def _act(self, phase: str) -> None:
            super()._act(phase)
            tick()

        def _digests(self, phase: str) -> pd.DataFrame:
            frame = super()._digests(phase)
            tick()
            return frame

    return TickingSession(urls, **kwargs)


def _no_problems() -> pd.DataFrame:
    from wcviz.check import PROBLEM_COLUMNS

    return pd.DataFrame({c: pd.Series(dtype="Int64" if c in IDENTITY else "string") for c in PROBLEM_COLUMNS})


# --------------------------------------------------------------------------- the dashboard


class Dashboard:
    """Buttons, selectors, a status line, errors and one view of the verdicts; see the module docstring.

    ``source``: a started :class:`wcviz.sim.Cluster`, agent URLs (list, or mapping URL
    -> expected identity) or frames in memory. ``token``: the agents' bearer token (a
    cluster's own by default). ``progress``: show the progress bar while working.
    ``timeout_s``/``retries``: per request, as in :func:`wcviz.sources.fetch`.

    State a user keeps working with: :attr:`current` (the last fetch's frame),
    :attr:`fetch_result`, :attr:`frames` (``{phase: frame}``), :attr:`verdicts`,
    :attr:`report` (an :class:`wcviz.check.EndStateReport` for the end-state check),
    :attr:`table` (the rows the table view shows), :attr:`status_text`,
    :attr:`error_text`, :attr:`exceptions`. The widget is :attr:`widget`.
    """

    def __init__(
        self,
        source: Any,
        *,
        token: str | None = None,
        progress: bool = True,
        timeout_s: float = 60.0,
        retries: int = 2,
    ) -> None:
        self.progress_enabled = bool(progress)
        self.current: pd.DataFrame | None = None
        self.fetch_result: FetchResult | None = None
        self.frames: dict[str, pd.DataFrame] = {}
        self.verdicts: pd.DataFrame | None = None
        self.report: EndStateReport | None = None
        self.transport: Any = None  # a cluster's refit transport check, from the last Reload
        self.exceptions: list[tuple[str, BaseException]] = []
        self.cluster: Any = None
        self.session: EndStateSession | None = None
        self.infos: dict[str, dict[str, Any]] = {}
        self._info_errors: dict[str, str] = {}
        self._net = {"timeout_s": float(timeout_s), "retries": int(retries)}
        self._status = ""
        self._busy = False
        self._figure: Figure | None = None

        self.kind = _frames_kind(source)
        if self.kind is not None:
            self.token = token
            self.urls: Any = None
            if self.kind == "verdicts":
                self.verdicts = source.reset_index(drop=True)
            else:
                self.frames = dict(source)
        elif _is_cluster(source):
            self.kind = "cluster"
            self.cluster = source
            self.token = token if token is not None else source.token
            self.urls = source.urls("engine")
            if not self.urls:
                raise ValueError("the cluster has no engine agents: start it first (Cluster.start or a with block)")
        elif isinstance(source, (str, Sequence, Mapping)) and not isinstance(source, (bytes, pd.DataFrame)):
            self.kind = "agents"
            self.token = token
            self.urls = [source] if isinstance(source, str) else source
        else:
            raise TypeError(
                "Dashboard needs a started wcviz.sim.Cluster, agent URLs (a list, or a mapping URL -> identity) "
                f"or frames in memory; got {type(source).__name__}"
            )
        if self.live:
            reload_fn = self._refit if self.kind == "cluster" else None
            self.session = _ticking_session(self.urls, self._tick, token=self.token, reload=reload_fn, **self._net)
            if self.kind == "agents":
                self.infos, self._info_errors = _probe_infos(self.session.targets, min(self._net["timeout_s"], 10.0))

        self._build()
        self._refresh_buttons()
        if self.kind in ("endstate", "compare"):
            self._guarded("compare", self._compare)
        else:
            self._set_status(self._initial_status())
            self._update_choices()
            self._show_view()
        self._show_errors()

    # ---- what the source allows ------------------------------------------------------------

    @property
    def live(self) -> bool:
        """Whether there are agents to fetch from and act on (not frames in memory)."""
        return self.kind in ("cluster", "agents")

    @property
    def mutations_allowed(self) -> bool:
        return self.mutation_block is None

    @property
    def mutation_block(self) -> str | None:
        """Why Snapshot, Reset and Reload are off, or None when they are on."""
        if not self.live:
            return "frames in memory: there are no agents to act on"
        if self.kind == "cluster":
            return None if self.cluster.allow_mutations else "the cluster was started without allow_mutations=True"
        if not self.token:
            return "no token given: Dashboard(urls, token=...) with the agents' bearer token"
        assert self.session is not None
        silent = [u for u in self.session.targets if u not in self.infos]
        if silent:
            why = "; ".join(f"{u} ({self._info_errors.get(u, 'no answer')})" for u in silent)
            return f"mutations are off: /v1/info did not answer on {why}"
        off = [u for u in self.session.targets if self.infos[u].get("mutations_allowed") is not True]
        if off:
            return f"mutations are off on {', '.join(off)} (start its agent with allow_mutations=True)"
        return None

    # ---- the widget ------------------------------------------------------------------------

    def _button(self, name: str, description: str, tooltip: str, icon: str) -> widgets.Button:
        self._tooltips[name] = tooltip
        b = _classed(widgets.Button(description=description, tooltip=tooltip, icon=icon), name)
        b.on_click(lambda _b, n=name: self._click(n))
        return b

    def _build(self) -> None:
        self._tooltips: dict[str, str] = {}
        self.buttons = {
            "fetch": self._button("fetch", "Fetch", "fetch every rank's digests now", "download"),
            "snapshot": self._button(
                "snapshot", "Snapshot", "every rank records its digests: starts a new end-state check", "camera"
            ),
            "reset": self._button(
                "reset", "Reset", "DESTRUCTIVE: poison every weight on every rank (asks first)", "bomb"
            ),
            "reload": self._button(
                "reload", "Reload", "run the weight update again, then fetch the digests", "refresh"
            ),
            "compare": self._button("compare", "Compare", "classify the frames into verdicts", "balance-scale"),
        }
        self.buttons["reset"].button_style = "warning"
        self.confirm_text = widgets.HTML()
        self.reset_yes = _classed(
            widgets.Button(description="Yes, poison every weight", button_style="danger", icon="bomb"), "reset_yes"
        )
        self.reset_cancel = _classed(widgets.Button(description="Cancel"), "reset_cancel")
        self.reset_yes.on_click(lambda _b: self._click("reset_yes"))
        self.reset_cancel.on_click(lambda _b: self._click("reset_cancel"))
        self.reset_confirm = _classed(
            widgets.VBox(
                [self.confirm_text, widgets.HBox([self.reset_yes, self.reset_cancel])],
                layout=widgets.Layout(display="none"),
            ),
            "reset_confirm",
        )
        self.view = _classed(widgets.Dropdown(options=list(VIEWS), value=VIEWS[0], description="view"), "view")
        self.role = _classed(widgets.Dropdown(options=[ALL], value=ALL, description="role"), "role")
        self.status = _classed(widgets.Dropdown(options=[ALL], value=ALL, description="status"), "status")
        self.search = _classed(
            widgets.Text(
                value="", placeholder="parameter name (regex)", description="parameter", continuous_update=False
            ),
            "search",
        )
        self.status_line = _classed(widgets.HTML(), "status_line")
        self.progress = _classed(
            widgets.IntProgress(value=0, min=0, max=1, layout=widgets.Layout(display="none")), "progress"
        )
        self.errors = _classed(widgets.HTML(layout=widgets.Layout(display="none")), "errors")
        self.clear_button = _classed(
            widgets.Button(description="Clear errors", layout=widgets.Layout(display="none")), "clear_errors"
        )
        self.clear_button.on_click(lambda _b: self._click("clear_errors"))
        self.view_area = _classed(widgets.Box(), "view_area")
        for w in (self.view, self.role, self.status, self.search):
            w.observe(self._on_choice, names="value")
        self.widget = _classed(
            widgets.VBox([
                widgets.HBox(list(self.buttons.values())),
                self.reset_confirm,
                self.status_line,
                self.progress,
                widgets.HBox([self.errors, self.clear_button]),
                widgets.HBox([self.view, self.role, self.status, self.search]),
                self.view_area,
            ]),
            "dashboard",
        )  # fmt: skip

    def _on_choice(self, change: Any) -> None:
        """A selector or the search changed: draw the view again (an action in progress draws once at its end)."""
        if self._busy:
            return
        if change["owner"] in (self.status, self.search) and self.view.value not in ("table", "drill-down"):
            return  # the status filter and the search narrow the table and the drill-down only
        self._show_view()
        self._show_errors()

    def _refresh_buttons(self) -> None:
        block = self.mutation_block
        for name in ("fetch", "snapshot", "reset", "reload", "compare"):
            b = self.buttons[name]
            if self._busy:
                b.disabled = True
                continue
            if name != "compare" and not self.live:
                b.disabled, b.tooltip = True, "frames in memory: there are no agents to fetch from or act on"
            elif name not in ("fetch", "compare") and block is not None:
                b.disabled, b.tooltip = True, f"disabled: {block}"
            else:
                b.disabled, b.tooltip = False, self._tooltips[name]
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

    # ---- clicks and errors -----------------------------------------------------------------

    def _click(self, name: str) -> None:
        """What a button runs: the method, its errors already recorded, never raised into the kernel log."""
        actions: dict[str, Callable[[], Any]] = {
            "fetch": self.fetch,
            "snapshot": self.snapshot,
            "reset": self.reset,
            "reset_yes": lambda: self.reset(confirm=True),
            "reset_cancel": self.cancel_reset,
            "reload": self.reload,
            "compare": self.compare,
            "clear_errors": self.clear_errors,
        }
        try:
            actions[name]()
        except Exception as e:  # noqa: BLE001 - shown in the errors area, never raised into the kernel log
            if not any(seen is e for _, seen in self.exceptions):  # the actions record their own
                self.exceptions.append((name, e))
                self._show_errors()

    def _guarded(
        self, action: str, fn: Callable[[], T], *, progress_steps: int = 0
    ) -> tuple[T | None, Exception | None]:
        """Run one action: busy buttons, progress, status; an exception is recorded, shown and returned."""
        if self._busy:  # inside another action: that one records what fails
            return fn(), None
        self._busy = True
        self._refresh_buttons()
        if progress_steps and self.progress_enabled:
            self.progress.max, self.progress.value = progress_steps, 0
            self.progress.description, self.progress.bar_style = action, "info"
            self.progress.layout.display = None
        try:
            return fn(), None
        except Exception as e:  # noqa: BLE001 - shown in the errors area and the status line
            self.exceptions.append((action, e))
            if action != "view":  # a view that fails leaves a note in the view area; the status stays the check's
                self._set_status(f"{action} FAILED: {type(e).__name__}: {e}")
            return None, e
        finally:
            self._busy = False
            self.progress.layout.display = "none"
            self._refresh_buttons()
            self._show_errors()

    def _run(self, action: str, fn: Callable[[], T], *, progress_steps: int = 0) -> T:
        """A method's body: :meth:`_guarded`, then the exception (if any) raised to the Python caller too."""
        out, err = self._guarded(action, fn, progress_steps=progress_steps)
        if err is not None:
            raise err
        return out  # type: ignore[return-value]

    def _tick(self) -> None:
        self.progress.value = min(self.progress.max, self.progress.value + 1)

    def _require_live(self, action: str) -> None:
        if not self.live:
            raise RuntimeError(f"{action} is disabled: frames in memory have no agents to fetch from or act on")

    def _require_mutations(self, action: str) -> None:
        self._require_live(action)
        block = self.mutation_block
        if block is not None:
            raise PermissionError(f"{action} is disabled: {block}")

    def clear_errors(self) -> None:
        """Forget the exceptions shown (rank problems stay until their phase runs again)."""
        self.exceptions.clear()
        self._show_errors()

    @property
    def problem_lines(self) -> list[str]:
        """Rank problems: the check's (phase/step, rank, kind, error) and the last fetch's failed ranks."""
        lines = [f"info: {u}: {err}" for u, err in self._info_errors.items()]
        if self.session is not None:
            for r in self.session.problem_table.to_dict(orient="records"):
                lines.append(f"{r['phase']}/{r['step']}: {_rank_label(r)} {r['kind']}: {r['error']}")
        if self.fetch_result is not None:
            for r in self.fetch_result.failed.to_dict(orient="records"):
                lines.append(f"fetch: {_rank_label(r)} {r['kind']}: {r['error']}")
        return lines

    @property
    def error_text(self) -> str:
        """What the errors area shows, as plain text: exceptions (oldest first), then rank problems."""
        lines = [f"{action}: {type(e).__name__}: {e}" for action, e in self.exceptions]
        return "\n".join(lines + self.problem_lines)

    def _show_errors(self) -> None:
        text = self.error_text
        self.errors.value = (
            '<pre class="wcviz-error-text" style="color:#B2182B;white-space:pre-wrap;margin:0">'
            + html.escape(text)
            + "</pre>"
            if text
            else ""
        )
        self.errors.layout.display = None if text else "none"
        self.clear_button.layout.display = None if self.exceptions else "none"

    # ---- the status line -------------------------------------------------------------------

    @property
    def status_text(self) -> str:
        """The status line as plain text."""
        return self._status

    def _set_status(self, text: str, *, bad: bool | None = None) -> None:
        self._status = text
        if bad is None:
            bad = "FAILED" in text
        color = "#B2182B" if bad else "inherit"
        self.status_line.value = f'<span class="wcviz-status-text" style="color:{color}">{html.escape(text)}</span>'

    def _initial_status(self) -> str:
        if self.kind == "verdicts":
            return self._verdict_status()
        assert self.session is not None
        line = f"{_plural(len(self.session.targets), 'agent')}; nothing fetched yet"
        block = self.mutation_block
        return line + (f"; Snapshot, Reset and Reload are off: {block}" if block else "")

    def _answered(self, answered: int) -> str:
        assert self.session is not None
        return f"{answered:,} of {len(self.session.targets):,} ranks answered"

    def _phase_status(self, phase: str) -> str:
        assert self.session is not None
        frame = self.session.frames[phase]
        problems = self.session.problem_table
        acted = problems[(problems["phase"] == phase) & (problems["step"] == phase)]
        parts = []
        if len(acted):
            n = acted["url"].nunique()
            still = " (still poisoned)" if phase == "reload" else ""
            parts.append(f"{phase} FAILED on {n} of {len(self.session.targets)} ranks{still}")
        else:
            parts.append(f"{phase} done")
        parts.append(self._answered(self.session.answered.get(phase, 0)))
        parts.append(_plural(len(frame), "parameter"))
        if phase == "reset" and "snapshot" in self.session.frames:
            try:
                from wcviz.endstate import reset_coverage

                cov = reset_coverage(self.session.frames["snapshot"], frame)
                cols = [c for c in IDENTITY if c in frame]
                answered = (
                    cov[cols].merge(_ranks(frame).assign(_in=True), on=cols, how="left")["_in"].notna().to_numpy()
                )
                nonempty = cov[~cov["empty"].to_numpy() & answered]  # a rank that did not answer is not counted
                parts.append(f"{int(nonempty['covered'].sum()):,} of {len(nonempty):,} fully reset")
            except Exception as e:  # noqa: BLE001 - the coverage is a hint here; Compare reports the real error
                parts.append(f"reset coverage unknown ({type(e).__name__})")
        return "; ".join(parts)

    def _verdict_status(self) -> str:
        """Counts from the verdicts (and the report's problems): ranks, then findings worst first."""
        from wcviz.views import SEVERITY

        v = self.verdicts
        assert v is not None
        ranks = _ranks(v)
        n = len(ranks)
        if "status" in v and (v["status"] == "unreachable").any():
            silent = len(_ranks(v[v["status"] == "unreachable"]))
            head = f"{n - silent:,} of {n:,} ranks answered"
        elif self.report is not None and self.live:
            head = f"{n:,} of {n:,} ranks answered"
        else:
            head = _plural(n, "rank")
        parts = [head]
        if "status" in v and (v["status"] == "empty").any():
            parts.append(f"{_plural(len(_ranks(v[v['status'] == 'empty'])), 'rank')} empty (answered with no parameters)")
        rep = self.report
        if rep is not None and len(rep.poisoned):
            labels = ", ".join(sorted({_rank_label(r) for r in rep.poisoned.to_dict(orient="records")}))
            parts.insert(0, f"RELOAD FAILED on {labels}: still poisoned")
        named = v[v["name"].notna()] if "name" in v else v
        for st in SEVERITY:
            if st in ("match", "unreachable"):
                continue
            rows = named[named["status"] == st]
            if len(rows):
                parts.append(f"{_plural(len(rows), 'parameter')} {st} on {_plural(len(_ranks(rows)), 'rank')}")
        matches = int((named["status"] == "match").sum())
        if matches:
            parts.append(f"{matches:,} match" if matches != len(named) else f"all {matches:,} parameters match")
        elif not len(named):
            parts.append("no parameters")
        if rep is not None:
            other = len(rep.problems) - len(rep.poisoned)
            if other:
                parts.append(f"{_plural(other, 'problem')} (see errors)")
        return "; ".join(parts)

    # ---- actions ---------------------------------------------------------------------------

    def fetch(self) -> pd.DataFrame:
        """Fetch every rank's digests now (no mutation); the frame is :attr:`current`."""

        def work() -> pd.DataFrame:
            self._require_live("fetch")
            from wcviz.sources import fetch

            assert self.session is not None
            res = _off_loop(lambda: fetch(self.urls, **self._net))
            self._tick()
            self.fetch_result, self.current = res, res.frame
            for u, info in res.infos.items():
                self.infos[u] = info
                self._info_errors.pop(u, None)
            kinds = [
                f"{int((res.failed['kind'] == k).sum())} {k}"
                for k in ("unreachable", "failed", "empty")
                if (res.failed["kind"] == k).any()
            ]
            self._set_status(
                "; ".join([f"fetch: {self._answered(res.answered)}", *kinds, _plural(len(res.frame), "parameter")]),
                bad=bool(kinds),
            )
            self._update_choices()
            self._show_view()
            return res.frame

        return self._run("fetch", work, progress_steps=1)

    def _phase(self, phase: str) -> pd.DataFrame:
        assert self.session is not None
        self.verdicts = self.report = None  # a phase run again makes earlier verdicts stale
        if phase == "snapshot":
            self.transport = None
        frame = _off_loop(getattr(self.session, phase))
        self.frames = dict(self.session.frames)
        self.current = frame
        self._set_status(self._phase_status(phase))
        self._update_choices()
        self._show_view()
        return frame

    def snapshot(self) -> pd.DataFrame:
        """Every rank records its digests (phase ``snapshot``): starts a new end-state check."""

        def work() -> pd.DataFrame:
            self._require_mutations("snapshot")
            self.cancel_reset()
            return self._phase("snapshot")

        return self._run("snapshot", work, progress_steps=2)

    def reset(self, confirm: bool = False) -> pd.DataFrame | None:
        """DESTRUCTIVE with ``confirm=True``: poison every weight on every rank (phase ``reset``).

        Without ``confirm`` it only opens the confirmation box (``wcviz-reset-confirm``)
        and changes nothing; its "Yes, poison every weight" button runs ``reset(confirm=True)``.
        """

        def work() -> pd.DataFrame | None:
            self._require_mutations("reset")
            assert self.session is not None
            if "snapshot" not in self.session.frames:
                raise RuntimeError("reset before snapshot: take the snapshot first, or nothing can be compared")
            if not confirm:
                n = len(self.session.targets)
                self.confirm_text.value = (
                    f"<b>Reset poisons every weight on {_plural(n, 'rank')}.</b> "
                    "They serve the poison pattern until Reload writes the weights again."
                )
                self.reset_confirm.layout.display = None
                return None
            self.cancel_reset()
            return self._phase("reset")

        return self._run("reset", work, progress_steps=2 if confirm else 0)

    @property
    def confirm_open(self) -> bool:
        """Whether the reset's confirmation box is showing."""
        return self.reset_confirm.layout.display != "none"

    def cancel_reset(self) -> None:
        """Close the confirmation box; nothing is reset."""
        self.reset_confirm.layout.display = "none"

    def reload(self) -> pd.DataFrame:
        """Run the weight update again (a cluster's refit, else each agent's reload) and fetch (phase ``reload``)."""

        def work() -> pd.DataFrame:
            self._require_mutations("reload")
            self.cancel_reset()
            return self._phase("reload")

        return self._run("reload", work, progress_steps=2)

    def _refit(self) -> None:
        self.transport = self.cluster.refit()

    def compare(self) -> pd.DataFrame:
        """The verdicts: the end-state check's classification, or expected against actual."""
        return self._run("compare", self._compare, progress_steps=1)

    def _compare(self) -> pd.DataFrame:
        if self.live:
            assert self.session is not None
            report = self.session.report()
            report.transport = self.transport
            self.report, self.verdicts = report, report.verdicts
        elif self.kind == "endstate":
            from wcviz.check import EndStateReport
            from wcviz.endstate import classify

            f = self.frames
            verdicts = classify(f["snapshot"], f["reset"], f["reload"])
            self.report = EndStateReport(verdicts=verdicts, frames=dict(f), problems=_no_problems())
            self.verdicts = verdicts
        elif self.kind == "compare":
            from wcviz.verdicts import compare

            self.verdicts = compare(self.frames["expected"], self.frames["actual"])
        assert self.verdicts is not None
        self._tick()
        self._set_status(
            self._verdict_status(), bad=bool((self.verdicts["status"] != "match").any() or self._status_bad())
        )
        self._update_choices()
        self._show_view()
        return self.verdicts

    def _status_bad(self) -> bool:
        return self.report is not None and bool(len(self.report.problems))

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

    def _roles(self, v: pd.DataFrame) -> pd.Series:
        """The role of each verdict row: its own column, else the role its rank has in the frames."""
        if "role" in v:
            return v["role"].astype("string")
        if "role_actual" in v:
            return v["role_actual"].fillna(v.get("role_expected")).astype("string")
        known = [f for f in [*self.frames.values(), self.current] if f is not None and "role" in f and len(f)]
        cols = [c for c in IDENTITY if c in v]
        if not known or not cols:
            return pd.Series(pd.NA, index=v.index, dtype="string")
        pairs = pd.concat([f[cols + ["role"]] for f in known]).drop_duplicates(cols)
        merged = v[cols].merge(pairs, on=cols, how="left")["role"]
        return pd.Series(merged.to_numpy(), index=v.index, dtype="string")

    def _update_choices(self) -> None:
        """Role and status options from what the frames hold (a value no longer present falls back to all)."""
        from wcviz.views import SEVERITY

        v = self.verdicts
        roles: list[str] = []
        if v is not None:
            roles = sorted(str(r) for r in self._roles(v).dropna().unique())
        elif self.current is not None and "role" in self.current:
            roles = sorted(str(r) for r in self.current["role"].dropna().unique())
        _options(self.role, [(ALL, ALL)] + [(r, r) for r in roles])
        opts = [(ALL, ALL)]
        if v is not None:
            counts = v["status"].astype("object").value_counts()
            bad = int(len(v) - counts.get("match", 0))
            opts.append((f"{NOT_MATCH} ({bad:,})", NOT_MATCH))
            opts += [(f"{s} ({int(counts[s]):,})", s) for s in SEVERITY if s in counts]
        _options(self.status, opts)

    def _role_rows(self) -> pd.DataFrame | None:
        v = self.verdicts
        if v is None or self.role.value == ALL:
            return v
        return v[(self._roles(v) == self.role.value).fillna(False).to_numpy()].reset_index(drop=True)

    @property
    def table(self) -> pd.DataFrame | None:
        """The verdict rows the table view shows: role, status filter and parameter search applied."""
        v = self._role_rows()
        if v is None:
            return None
        st = self.status.value
        if st == NOT_MATCH:
            v = v[v["status"] != "match"]
        elif st != ALL:
            v = v[v["status"] == st]
        text = self.search.value.strip()
        if text:
            try:
                pattern = re.compile(text)
                hit = v["name"].map(lambda n: not pd.isna(n) and bool(pattern.search(str(n))))
            except re.error:  # not a regex: a plain substring
                hit = v["name"].map(lambda n: not pd.isna(n) and text in str(n))
            v = v[hit.astype(bool)]
        return v.reset_index(drop=True)

    @property
    def drilldown_name(self) -> str | None:
        """The parameter the drill-down shows: the first (worst) row of :attr:`table` that has a name."""
        t = self.table
        if t is None:
            return None
        names = t["name"].dropna()
        return str(names.iloc[0]) if len(names) else None

    def _drill_frames(self) -> Mapping[str, pd.DataFrame]:
        """Digest frames per phase for the drill-down: the frames, else the verdicts' ``digest_<phase>`` columns."""
        if self.frames:
            return self.frames
        v = self.verdicts
        assert v is not None
        phases = [c.removeprefix("digest_") for c in v.columns if c.startswith("digest_")]
        if not phases:
            raise ValueError("the drill-down needs digests: this verdict frame has no digest_<phase> columns")
        ids = [c for c in IDENTITY if c in v]
        return {
            p: v[ids + ["name", f"digest_{p}"]].rename(columns={f"digest_{p}": "digest"}).dropna(subset=["digest"])
            for p in phases
        }

    def _placeholder(self, text: str) -> widgets.HTML:
        return _classed(widgets.HTML(f"<i>{html.escape(text)}</i>"), "empty")

    def _empty_hint(self) -> str:
        if self.live:
            done = [p for p in ("snapshot", "reset", "reload") if p in self.frames]
            if not done:
                return "no verdicts yet: Snapshot, Reset, Reload, then Compare"
            todo = [p.capitalize() for p in ("snapshot", "reset", "reload") if p not in self.frames]
            return f"no verdicts yet ({', '.join(done)} done): " + ", ".join([*todo, "Compare"])
        return "no verdicts yet: press Compare"

    def _show_view(self) -> None:
        """Draw the view; a view that fails is recorded (as ``view``), never as the failure of the action that drew it."""
        try:
            self._render()
        except Exception as e:  # noqa: BLE001 - shown in the errors area and the view area
            self.exceptions.append(("view", e))

    def _render(self) -> None:
        """Put the selected view of the verdicts in the view area (a view that fails leaves a note, not a stale view)."""
        self._figure = None
        try:
            self._draw()
        except Exception as e:
            self.view_area.children = (
                self._placeholder(f"the {self.view.value} view failed: {type(e).__name__}: {e}"),
            )
            raise

    def _draw(self) -> None:
        view = self.view.value
        v = self._role_rows()
        if v is None:
            self.view_area.children = (self._placeholder(self._empty_hint()),)
            return
        if view == "table":
            from wcviz.views import style_verdicts

            t = self.table
            assert t is not None
            shown = t.head(TABLE_ROWS)
            caption = f"{len(t):,} of {len(self.verdicts):,} verdicts" if self.verdicts is not None else ""
            if len(t) > len(shown):
                caption += f"; the first {len(shown):,} shown (all of them: Dashboard.table)"
            body = (
                style_verdicts(shown, uuid="wcviz-verdicts").to_html()
                if len(shown)
                else "<i>no verdicts match the filters</i>"
            )
            self.view_area.children = (
                _classed(
                    widgets.HTML(f'<div class="wcviz-table-caption">{html.escape(caption)}</div>' + body), "table"
                ),
            )
            return
        if view == "layer × rank":
            from wcviz.views import plot_layer_rank

            fig = plot_layer_rank(v)
        elif view == "topology":
            from wcviz.views import plot_topology

            fig = plot_topology(v)
        else:
            from wcviz.views import plot_drilldown

            name = self.drilldown_name
            if name is None:
                self.view_area.children = (
                    self._placeholder("no parameter matches the filters: change the status or the search"),
                )
                return
            fig = plot_drilldown(self._drill_frames(), name)
        self._figure = fig
        self.view_area.children = (_classed(widgets.Image(value=_png(fig), format="png"), _VIEW_CLASS[view]),)

    @property
    def figure(self) -> Figure | None:
        """The matplotlib figure the view area shows (None for the table)."""
        return self._figure if self.view.value != "table" else None

    @property
    def view_text(self) -> str:
        """The text form of the current view (what the picture shows, for logs and notebook checks)."""
        v = self._role_rows()
        if v is None:
            return self._empty_hint()
        view = self.view.value
        if view == "layer × rank":
            from wcviz.views import layer_rank_text

            return layer_rank_text(v)
        if view == "topology":
            from wcviz.views import topology_text

            return str(topology_text(v))
        if view == "drill-down":
            from wcviz.views import drilldown_text

            name = self.drilldown_name
            return (
                str(drilldown_text(self._drill_frames(), name))
                if name is not None
                else "no parameter matches the filters"
            )
        t = self.table
        assert t is not None
        cols = [c for c in ("rank", "pp", "tp", "name", "status") if c in t]
        return t[cols].to_string(index=False) if len(t) else "no verdicts match the filters"


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
