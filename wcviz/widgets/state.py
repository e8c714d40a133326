"""What the dashboard knows and does, in plain Python: testable without ipywidgets, drawn by :mod:`wcviz.widgets.view`.

A :class:`DashboardState` holds a source - a live fleet (:class:`wcviz.endstate.Fleet`:
agent URLs, a started :class:`wcviz.sim.Cluster`, any fleet) or frames in memory - and
everything the check produced: the last fetch, the phases' frames, the verdicts, the
report, the filters a person chose and the lines the dashboard shows (status, errors).
Its actions (:meth:`fetch`, :meth:`snapshot`, :meth:`reset`, :meth:`reload`,
:meth:`compare`) do the work through the end-state session and raise on failure; the
view records what fails. ``on_step`` is called after each action and each fetch of a
phase (the progress bar).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pandas as pd

from wcviz._text import plural, rank_label
from wcviz.endstate import PHASES, EndStateReport, EndStateSession, Fleet, SnapshotUnusable, classify, reset_coverage
from wcviz.frame import IDENTITY
from wcviz.sources import FetchResult
from wcviz.verdicts import check_statuses, compare, n_parameters, status_parts
from wcviz.widgets.filters import ALL, NOT_MATCH, VerdictFilters

__all__ = ["ALL", "FLOW", "NOT_MATCH", "DashboardState"]

FLOW = ("snapshot", "reset", "reload", "compare")  # the end-state check's steps, in order (numbered 1..4)
_DOING = {"snapshot": "snapshotting", "reset": "resetting", "reload": "reloading"}
_FRAME_KINDS = {frozenset({"snapshot", "reset", "reload"}): "endstate", frozenset({"expected", "actual"}): "compare"}


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
        kind = _FRAME_KINDS.get(frozenset(source))
        if kind is None:
            raise ValueError(
                f"frames in memory need the keys snapshot, reset, reload or expected, actual; got {', '.join(map(str, source))}"
            )
        return kind
    return None


def _fleet_of(source: Any, token: str | None, net: dict[str, Any]) -> Fleet:
    """The fleet a live source stands for: a fleet itself, something that makes one (a cluster), or agent URLs."""
    from wcviz.endstate import AgentFleet

    if isinstance(source, Fleet):
        return source
    make = getattr(source, "fleet", None)
    if callable(make) and not isinstance(source, (str, Mapping, Sequence)):
        return make(**net)
    if isinstance(source, (str, Sequence, Mapping)) and not isinstance(source, bytes):
        return AgentFleet([source] if isinstance(source, str) else source, token=token, **net)
    raise TypeError(
        "Dashboard needs a started wcviz.sim.Cluster, agent URLs (a list, or a mapping URL -> identity), an "
        f"end-state fleet or frames in memory; got {type(source).__name__}"
    )


def _ranks(df: pd.DataFrame) -> pd.DataFrame:
    """The distinct rank identities of a frame (NA coordinates are one value)."""
    cols = [c for c in IDENTITY if c in df]
    return df[cols].drop_duplicates() if cols else pd.DataFrame(index=[0])


class DashboardState(VerdictFilters):
    """The dashboard without its widgets; see the module docstring. Attributes are the frames a user keeps working with.

    What the filters leave (:attr:`table`, the drill-down's parameters, the views' text)
    is :class:`wcviz.widgets.filters.VerdictFilters`'.
    """

    def __init__(
        self,
        source: Any,
        *,
        token: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 2,
        on_step: Callable[[], None] | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.on_step = on_step or (lambda: None)
        self.on_change = on_change or (lambda: None)  # told when the source changes by itself (a cluster stopped)
        self.stopped: str | None = None  # why no rank can answer any more, once known
        self.reset_started = False  # a reset was sent in this check (it may have poisoned): Reload is the way back
        self.unusable: str | None = None  # why this check's snapshot cannot be compared (so no reset may follow it)
        self.activity = ""  # what is happening now, while an action runs
        self.drill_choice: str | None = None
        self.current: pd.DataFrame | None = None
        self.fetch_result: FetchResult | None = None
        self.frames: dict[str, pd.DataFrame] = {}
        self.verdicts: pd.DataFrame | None = None
        self.report: EndStateReport | None = None
        self.transport: Any = None  # the reload's refit transport check, where the fleet refits
        self.exceptions: list[tuple[str, BaseException]] = []
        self.infos: dict[str, dict[str, Any]] = {}
        self.info_errors: dict[str, str] = {}
        self.session: EndStateSession | None = None
        self.fleet: Fleet | None = None
        self.role_filter, self.status_filter, self.search = ALL, ALL, ""
        self.status_text = ""
        self.kind = _frames_kind(source)
        self.token = token
        if self.kind == "verdicts":
            check_statuses(source)  # a row without a status is malformed: refused here, never drawn as neither
            self.verdicts = source.reset_index(drop=True)
        elif self.kind is not None:
            self.frames = dict(source)
        else:
            self.fleet = _fleet_of(source, token, {"timeout_s": float(timeout_s), "retries": int(retries)})
            self.kind = "fleet"
            self.token = getattr(self.fleet, "token", token)
            self.session = EndStateSession(self.fleet, on_step=self._stepped)
            if callable(getattr(self.fleet, "on_stop", None)):
                self.fleet.on_stop(self._fleet_stopped)  # type: ignore[attr-defined]
            self.check_alive()
            if hasattr(self.fleet, "info") and self.stopped is None:
                self.infos, self.info_errors = self.fleet.info()
            self.status_text = self.initial_status()
        if self.kind == "verdicts":
            self.status_text = self.verdict_status()

    # ---- what the source allows ------------------------------------------------------------

    @property
    def live(self) -> bool:
        """Whether there are ranks to fetch from and act on (not frames in memory)."""
        return self.fleet is not None

    @property
    def targets(self) -> tuple[str, ...]:
        return self.session.targets if self.session is not None else ()

    @property
    def mutation_block(self) -> str | None:
        """Why Snapshot, Reset and Reload are off, or None when they are on."""
        if not self.live:
            return "frames in memory: there are no agents to act on"
        block = getattr(self.fleet, "mutation_block", None)
        return block(self.infos, self.info_errors) if callable(block) else None

    def require(self, action: str, *, mutation: bool = True) -> None:
        if not self.live:
            raise RuntimeError(f"{action} is disabled: frames in memory have no agents to fetch from or act on")
        if self.stopped is not None:
            raise RuntimeError(f"{action} is disabled: {self.stopped}")
        block = self.mutation_block if mutation else None
        if block is not None:
            raise PermissionError(f"{action} is disabled: {block}")

    # ---- the flow: 1 Snapshot -> 2 Reset -> 3 Reload -> 4 Compare; Fetch any time ----------------

    def _done(self, step: str) -> bool:
        return self.verdicts is not None if step == "compare" else step in self.frames

    def step_block(self, step: str) -> str | None:
        """Why ``step`` (``fetch`` or one of :data:`FLOW`) cannot run now, in words; None when it can."""
        if step not in ("fetch", *FLOW):
            raise ValueError(f"unknown step {step!r}; choose fetch or one of {', '.join(FLOW)}")
        if not self.live:
            return None if step == "compare" else "frames in memory: there are no agents to fetch from or act on"
        if self.stopped is not None:
            return self.stopped
        if step == "fetch":
            return None
        if step != "compare" and self.mutation_block is not None:
            return self.mutation_block
        if step == "snapshot" and self.reset_started and not self.reloaded:
            return "reload first: the ranks hold the reset pattern (3 Reload writes the weights back)"
        if step == "reset":
            if "snapshot" not in self.frames:
                return "take the snapshot first (1 Snapshot): without it nothing can be compared"
            if self.reset_started:
                return "this check is reset already: 3 Reload writes the weights back (a new check starts with 1 Snapshot)"
            if self.unusable is not None:
                return f"the snapshot cannot be compared, so nothing may be reset: {self.unusable}; take it again (1 Snapshot)"
        if step == "reload":
            if not self.reset_started:
                return "reset first (2 Reset): Reload writes back what the reset overwrote"
            if "reload" in self.frames and self.session is not None and not len(self.session.poisoned):
                if self.verdicts is None:
                    return "reloaded: 4 Compare says what it wrote"
                if bool((self.verdicts["status"] == "match").all()):
                    return "reloaded, and every weight matches: a new check starts with 1 Snapshot"
                # verdicts that are not all match: a weight may still hold the reset pattern, so reloading again is valid
        if step == "compare":
            todo = [f"{i} {p.capitalize()}" for i, p in enumerate(PHASES, 1) if p not in self.frames]
            if todo:
                return f"run {', '.join(todo)} first"
        return None

    @property
    def reloaded(self) -> bool:
        """Whether a reload ran to its digests since the reset, and left no rank poisoned."""
        return "reload" in self.frames and (self.session is None or not len(self.session.poisoned))

    @property
    def next_step(self) -> str | None:
        """The step of the flow to take next (the one the dashboard highlights), or None when the check is done."""
        if self.unusable is not None and self.step_block("snapshot") is None:
            return "snapshot"  # the snapshot cannot be compared: take it again
        for step in FLOW:
            if not self._done(step):
                return step if self.step_block(step) is None else None
        return None

    def require_step(self, step: str) -> None:
        """Raise, saying why, unless ``step`` may run now (:meth:`step_block`)."""
        why = self.step_block(step)
        if why is not None:
            error = PermissionError if why == self.mutation_block else RuntimeError
            raise error(f"{step} is disabled: {why}")

    # ---- a source that stops -------------------------------------------------------------------

    def _fleet_stopped(self) -> None:
        self.check_alive()
        self.on_change()

    def check_alive(self) -> str | None:
        """Ask the fleet whether it still runs (a cluster knows); what stopped it, or None."""
        ask = getattr(self.fleet, "stopped", None)
        why = ask() if callable(ask) else None
        if why:
            self.stopped = str(why)
            self.status_text = f"STOPPED: {self.stopped}; the views show the last results (stale)"
        return self.stopped

    def _noticed_silence(self, res: FetchResult) -> None:
        """A fetch in which no rank answered and every one is unreachable: the fleet has stopped."""
        if res.answered == 0 and len(res.failed) and bool((res.failed["kind"] == "unreachable").all()):
            self.stopped = f"no rank answers ({plural(len(res.failed), 'rank')} unreachable): the agents or the cluster have stopped"

    def plan(self, action: str) -> str:
        """What ``action`` is about to do, in words (the status line while it runs)."""
        n = plural(len(self.targets), "rank")
        if action == "fetch":
            return f"fetching the digests of {n}…"
        if action == "compare":
            return "comparing…"
        how = "refit" if getattr(self.fleet, "transport", False) is not False else "the weight update"
        what = {"snapshot": "every rank records its digests", "reset": "overwriting every weight", "reload": how}[action]
        return f"{_DOING[action]}: {what}, then fetching the digests of {n}…"

    def _stepped(self, phase: str, step: str) -> None:
        """The session finished ``step`` of ``phase``: say what comes next, tick the progress."""
        n = plural(len(self.targets), "rank")
        if step == phase:
            self.activity = f"{_DOING[phase]}: {phase} done, fetching the digests of {n}…"
        self.on_step()

    # ---- actions ---------------------------------------------------------------------------

    def fetch(self) -> pd.DataFrame:
        """Every rank's digests now (no mutation); the frame is :attr:`current`."""
        if self.check_alive() is None:
            self.require_step("fetch")
        else:
            self.require("fetch", mutation=False)
        assert self.fleet is not None
        self.activity = self.plan("fetch")
        res = self.fleet.digests("current")
        self.on_step()
        self._noticed_silence(res)
        self.fetch_result, self.current = res, res.frame
        for u, info in res.infos.items():
            self.infos[u] = info
            self.info_errors.pop(u, None)
        kinds = [f"{int((res.failed['kind'] == k).sum())} {k}" for k in ("unreachable", "failed", "empty") if (res.failed["kind"] == k).any()]
        self.status_text = "; ".join([f"fetch: {self._answered(res.answered)}", *kinds, plural(len(res.frame), "parameter")])
        if self.stopped is not None:
            self.status_text = f"STOPPED: {self.stopped}; the views show the last results (stale)"
        return res.frame

    def phase(self, phase: str) -> pd.DataFrame:
        """Run one phase of the check (``snapshot``, ``reset``, ``reload``) on every rank and fetch its digests."""
        self.check_alive()
        self.require_step(phase)
        assert self.session is not None
        self.verdicts = self.report = None  # a phase run again makes earlier verdicts stale
        if phase == "snapshot":
            self.transport = None
            self.reset_started = False
            self.unusable = None
            self.frames = {}
        if phase == "reset":
            self.reset_started = True  # from here on the ranks may hold the reset pattern: Reload is the way back
        self.activity = self.plan(phase)
        try:
            frame = getattr(self.session, phase)()
        except SnapshotUnusable as e:  # refused before any reset was sent: nothing is poisoned
            self.unusable = str(e).split(": ", 1)[-1]
            if phase == "reset":
                self.reset_started = False
            raise
        finally:
            self.frames = dict(self.session.frames)
        if phase == "reload":
            self.transport = getattr(self.fleet, "transport", None)
        fetched = self.session.fetches.get(phase)
        if fetched is not None:
            self._noticed_silence(fetched)
        self.current = frame
        self.status_text = self._phase_status(phase)
        if self.stopped is not None:
            self.status_text = f"STOPPED: {self.stopped}; {self.status_text}"
        return frame

    def compare(self) -> pd.DataFrame:
        """The verdicts: the end-state check's classification, or expected against actual."""
        self.activity = "comparing…"
        if self.session is not None:
            self.require_step("compare")
            report = self.session.report()
            report.transport = self.transport
            self.report, self.verdicts = report, report.verdicts
        elif self.kind == "endstate":
            f = self.frames
            self.verdicts = classify(f["snapshot"], f["reset"], f["reload"])
            self.report = EndStateReport(verdicts=self.verdicts, frames=dict(f), problems=_no_problems())
        elif self.kind == "compare":
            self.verdicts = compare(self.frames["expected"], self.frames["actual"])
        assert self.verdicts is not None
        self.on_step()
        self.status_text = self.verdict_status()
        return self.verdicts

    @property
    def bad(self) -> bool:
        """Whether the verdicts hold anything but a match, or the check has problems."""
        found = self.verdicts is not None and bool((self.verdicts["status"] != "match").any())
        return found or (self.report is not None and bool(len(self.report.problems)))

    # ---- what the dashboard says -----------------------------------------------------------

    def initial_status(self) -> str:
        if self.kind == "verdicts":
            return self.verdict_status()
        line = f"{plural(len(self.targets), 'agent')}; nothing fetched yet"
        block = self.mutation_block
        return line + (f"; Snapshot, Reset and Reload are off: {block}" if block else "")

    def _answered(self, answered: int) -> str:
        return f"{answered:,} of {len(self.targets):,} ranks answered"

    def _phase_status(self, phase: str) -> str:
        assert self.session is not None
        frame = self.session.frames[phase]
        problems = self.session.problem_table
        acted = problems[(problems["phase"] == phase) & (problems["step"] == phase)]
        parts = []
        if len(acted):
            still = " (still poisoned)" if phase == "reload" else ""
            parts.append(f"{phase} FAILED on {acted['url'].nunique()} of {len(self.targets)} ranks{still}")
        else:
            parts.append(f"{phase} done")
        parts.append(self._answered(self.session.answered.get(phase, 0)))
        parts.append(plural(len(frame), "parameter"))
        if phase == "reset" and "snapshot" in self.session.frames:
            parts.append(_coverage_hint(self.session.frames["snapshot"], frame, self.session.fleet.reset_pattern))
        return "; ".join(parts)

    def verdict_status(self) -> str:
        """Ranks, then findings worst first (:func:`wcviz.verdicts.status_parts`), then the report's problems."""
        v = self.verdicts
        assert v is not None
        n = len(_ranks(v))
        if (v["status"] == "unreachable").any():
            head = f"{n - len(_ranks(v[v['status'] == 'unreachable'])):,} of {n:,} ranks answered"
        elif self.report is not None and self.live:
            head = f"{n:,} of {n:,} ranks answered"
        else:
            head = plural(n, "rank")
        parts = [head]
        rep = self.report
        if rep is not None and len(rep.poisoned):
            labels = ", ".join(sorted({rank_label(r, "role") for r in rep.poisoned.to_dict(orient="records")}))
            parts.insert(0, f"RELOAD FAILED on {labels}: still poisoned")
        # every row counts, a finding without a name and a whole rank (unreachable, empty: named) included
        findings = status_parts(v, name_ranks=True, style="short", most=3)
        n_params = n_parameters(v)
        if len(v) and bool((v["status"] == "match").all()):
            findings = [f"all {plural(n_params, 'parameter')} match" if n_params != 1 else "the 1 parameter matches"]
        parts += findings or ["no parameters"]
        if rep is not None and len(rep.problems) > len(rep.poisoned):
            parts.append(f"{plural(len(rep.problems) - len(rep.poisoned), 'problem')} (see errors)")
        return "; ".join(parts)

    @property
    def problem_lines(self) -> list[str]:
        """Rank problems: the check's (phase/step, rank, kind, error) and the last fetch's failed ranks."""
        lines = [f"info: {u}: {err}" for u, err in self.info_errors.items()]
        if self.session is not None:
            for r in self.session.problem_table.to_dict(orient="records"):
                lines.append(f"{r['phase']}/{r['step']}: {rank_label(r, 'role')} {r['kind']}: {r['error']}")
        if self.fetch_result is not None:
            for r in self.fetch_result.failed.to_dict(orient="records"):
                lines.append(f"fetch: {rank_label(r, 'role')} {r['kind']}: {r['error']}")
        return lines

    @property
    def error_text(self) -> str:
        """What the errors area shows, as plain text: exceptions (oldest first), then rank problems."""
        lines = [f"{action}: {_said(e)}" for action, e in self.exceptions]
        return "\n".join(lines + self.problem_lines)

    def empty_hint(self) -> str:
        if self.live:
            done = [p for p in ("snapshot", "reset", "reload") if p in self.frames]
            if not done:
                return "no verdicts yet: Snapshot, Reset, Reload, then Compare"
            todo = [p.capitalize() for p in ("snapshot", "reset", "reload") if p not in self.frames]
            return f"no verdicts yet ({', '.join(done)} done): " + ", ".join([*todo, "Compare"])
        return "no verdicts yet: press Compare"


def _coverage_hint(snapshot: pd.DataFrame, reset: pd.DataFrame, pattern: Any) -> str:
    """``N of M fully reset`` over the ranks that answered the reset: a hint in the status line (Compare judges)."""
    try:
        cov = reset_coverage(snapshot, reset, reset_pattern=pattern)
        cols = [c for c in IDENTITY if c in reset]
        answered = cov[cols].merge(_ranks(reset).assign(_in=True), on=cols, how="left")["_in"].notna().to_numpy()
        nonempty = cov[~cov["empty"].to_numpy() & answered]  # a rank that did not answer is not counted
        return f"{int(nonempty['covered'].sum()):,} of {len(nonempty):,} fully reset"
    except Exception as e:  # noqa: BLE001 - the coverage is a hint here; Compare reports the real error
        return f"reset coverage unknown ({_said(e)})"


def _said(e: BaseException) -> str:
    """What an exception says, for a person: its message (the class name only when it says nothing)."""
    text = " ".join(str(e).split())
    return text or type(e).__name__


def _no_problems() -> pd.DataFrame:
    from wcviz.endstate import PROBLEM_COLUMNS

    return pd.DataFrame({c: pd.Series(dtype="Int64" if c in IDENTITY else "string") for c in PROBLEM_COLUMNS})
