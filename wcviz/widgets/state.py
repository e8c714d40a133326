"""What the dashboard knows and does, in plain Python: testable without ipywidgets, drawn by :mod:`wcviz.widgets.view`.

A :class:`DashboardState` holds a source - a live fleet (:class:`wcviz.endstate.Fleet`:
agent URLs, a started :class:`wcviz.sim.Cluster`, any fleet) or frames in memory - and
everything the check produced: the last fetch, the phases' frames, the verdicts, the
report, the filters a person chose and the lines the dashboard shows (status, errors).
Its actions (:meth:`fetch`, :meth:`snapshot`, :meth:`reset`, :meth:`reload`,
:meth:`compare`) do the work through the end-state session and raise on failure; a
step that may not run now raises :class:`StepRefused` before anything is sent. The view
records what fails. ``on_step`` is called after each action and each fetch of a phase
(the progress bar).

A source that stops for good (a :class:`wcviz.sim.Cluster` says so) turns every step
off; a fetch that no rank answers only says so (:attr:`DashboardState.silent`): an agent
restart or a network blip must not take Reload, the way back from the reset, away.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pandas as pd

from wcviz._text import plural
from wcviz.endstate import PHASES, EndStateReport, EndStateSession, Fleet, ResetNotCovered, SnapshotUnusable, classify
from wcviz.endstate.classify import check_reset_pattern
from wcviz.frame import IDENTITY
from wcviz.sources import FetchResult
from wcviz.verdicts import check_statuses, compare
from wcviz.widgets._words import DOING, DashboardWords, said
from wcviz.widgets.filters import ALL, NOT_MATCH, VerdictFilters

__all__ = ["ALL", "FLOW", "NOT_MATCH", "DashboardState", "MutationRefused", "StepRefused"]

FLOW = ("snapshot", "reset", "reload", "compare")  # the end-state check's steps, in order (numbered 1..4)
_FRAME_KINDS = {frozenset({"snapshot", "reset", "reload"}): "endstate", frozenset({"expected", "actual"}): "compare"}
_VOID = "void: the reset did not overwrite every parameter, so this check cannot give verdicts"
_ACCEPTED = (
    "give {'snapshot': frame, 'reset': frame, 'reload': frame}, {'expected': frame, 'actual': frame} or one verdict frame"
)


class StepRefused(RuntimeError):
    """A step that may not run now (its button is off; the message says why): nothing was sent, nothing changed."""


class MutationRefused(StepRefused, PermissionError):
    """Snapshot, reset or reload refused because the source does not allow mutations."""


def _frames_kind(source: Any) -> str | None:
    """``endstate``/``compare``/``verdicts`` for frames in memory, None for anything else."""
    if isinstance(source, pd.DataFrame):
        if "status" not in source:
            raise TypeError(
                "a single frame must be a verdict frame (with a 'status' column); "
                "give {'expected': frame, 'actual': frame} to compare two digest frames"
            )
        return "verdicts"
    values = list(source.values()) if isinstance(source, Mapping) else list(source) if isinstance(source, (list, tuple)) else []
    if any(isinstance(v, pd.DataFrame) for v in values):
        if not isinstance(source, Mapping):
            raise TypeError(f"a {type(source).__name__} of frames is not accepted: {_ACCEPTED}")
        kind = _FRAME_KINDS.get(frozenset(source))
        if kind is None or not all(isinstance(v, pd.DataFrame) for v in values):
            got = ", ".join(f"{k}: {type(v).__name__}" for k, v in source.items())
            raise ValueError(f"frames in memory need the keys snapshot, reset, reload or expected, actual, each a frame; got {got}")
        return kind
    return None


def _network(timeout_s: Any, retries: Any) -> dict[str, Any]:
    """The fetch options, each refused by its name when it is not a number."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) and not hasattr(timeout_s, "__float__"):
        raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    if isinstance(retries, bool) or not hasattr(retries, "__index__"):
        raise ValueError(f"retries must be an integer >= 0, got {retries!r}")
    return {"timeout_s": float(timeout_s), "retries": int(retries)}


def _fleet_of(source: Any, token: str | None, net: Callable[[], dict[str, Any]]) -> Fleet:
    """The fleet a live source stands for: a fleet itself, something that makes one (a cluster), or agent URLs."""
    from wcviz.endstate import AgentFleet

    if isinstance(source, Fleet):
        return source
    make = getattr(source, "fleet", None)
    if callable(make) and not isinstance(source, (str, Mapping, Sequence)):
        return make(**net())
    if isinstance(source, (str, Sequence, Mapping)) and not isinstance(source, bytes):
        return AgentFleet([source] if isinstance(source, str) else source, token=token, **net())
    raise TypeError(
        "Dashboard needs a started wcviz.sim.Cluster, agent URLs (a list, or a mapping URL -> identity), an "
        f"end-state fleet or frames in memory; got {type(source).__name__}"
    )


class DashboardState(DashboardWords, VerdictFilters):
    """The dashboard without its widgets; see the module docstring. Attributes are the frames a user keeps working with.

    ``reset_pattern``/``allow_partial_reset``: as in :meth:`wcviz.endstate.EndStateSession.report`
    (a fleet's own pattern by default; ``"poison"`` for frames in memory: give ``"zeros"``
    for a vLLM check's frames). What the filters leave (:attr:`table`, the drill-down's
    parameters, the views' text) is :class:`wcviz.widgets.filters.VerdictFilters`'; what
    it says, :class:`wcviz.widgets._words.DashboardWords`'.
    """

    def __init__(
        self,
        source: Any,
        *,
        token: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 2,
        reset_pattern: str | int | None = None,
        allow_partial_reset: bool = False,
        on_step: Callable[[], None] | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.on_step = on_step or (lambda: None)
        self.on_change = on_change or (lambda: None)  # told when the source changes by itself (a cluster stopped)
        self.stopped: str | None = None  # why no rank can answer any more (the source stopped for good), once known
        self.silent: str | None = None  # no rank answered the last fetch: said until one does; every step stays available
        self.reset_started = False  # a reset ran on some rank in this check (it may have poisoned): Reload is the way back
        self.unusable: str | None = None  # why this check's snapshot cannot be compared (so no reset may follow it)
        self.void: str | None = None  # why this check's Compare can only fail (its reset did not cover every parameter)
        self.activity = ""  # what is happening now, while an action runs
        self.drill_choice: str | None = None
        self.current: pd.DataFrame | None = None
        self.fetch_result: FetchResult | None = None
        self.shown_fetch: FetchResult | None = None  # the fetch whose failed ranks the errors show
        self.frames: dict[str, pd.DataFrame] = {}
        self.verdicts: pd.DataFrame | None = None
        self.report: EndStateReport | None = None
        self.transport: Any = None  # this check's reload's refit transport check, where the fleet refits
        self.notes: list[str] = []  # what the fleet did differently in this check's reload (a dead rank: a checkpoint load)
        self.exceptions: list[tuple[str, BaseException]] = []
        self.cleared: list[Any] = []  # the session's problem records a person cleared (Clear errors)
        self.cleared_info: set[tuple[str, str]] = set()
        self.infos: dict[str, dict[str, Any]] = {}
        self.info_errors: dict[str, str] = {}
        self.session: EndStateSession | None = None
        self.fleet: Fleet | None = None
        self.role_filter, self.status_filter, self.search = ALL, ALL, ""
        self.status_text = ""
        self.kind = _frames_kind(source)
        if reset_pattern is not None:
            if self.kind in ("verdicts", "compare"):
                raise ValueError(f"reset_pattern is for an end-state check; these frames ({self.kind}) have no reset")
            check_reset_pattern(reset_pattern)
        self.reset_pattern, self.allow_partial_reset = reset_pattern, bool(allow_partial_reset)
        self.token = token
        if self.kind == "verdicts":
            check_statuses(source)  # a row without a status is malformed: refused here, never drawn as neither
            self.verdicts = source.reset_index(drop=True)
        elif self.kind is not None:
            self.frames = dict(source)
        else:
            self.fleet = _fleet_of(source, token, lambda: _network(timeout_s, retries))
            self.kind = "fleet"
            self.token = getattr(self.fleet, "token", token)
            self.session = EndStateSession(self.fleet, on_step=self._stepped)
            if callable(getattr(self.fleet, "on_stop", None)):
                self.fleet.on_stop(self._fleet_stopped)  # type: ignore[attr-defined]
            self.check_alive()
            if hasattr(self.fleet, "info") and self.stopped is None:
                self.infos, self.info_errors = self.fleet.info()
        self.status_text = self.initial_status()

    # ---- what the source allows ------------------------------------------------------------

    @property
    def mutation_block(self) -> str | None:
        """Why Snapshot, Reset and Reload are off, or None when they are on."""
        if not self.live:
            return "frames in memory: there are no agents to act on"
        block = getattr(self.fleet, "mutation_block", None)
        return block(self.infos, self.info_errors) if callable(block) else None

    def require(self, action: str, *, mutation: bool = True) -> None:
        if not self.live:
            raise StepRefused(f"{action} is disabled: frames in memory have no agents to fetch from or act on")
        if self.stopped is not None:
            raise StepRefused(f"{action} is disabled: {self.stopped}")
        block = self.mutation_block if mutation else None
        if block is not None:
            raise MutationRefused(f"{action} is disabled: {block}")

    # ---- the flow: 1 Snapshot -> 2 Reset -> 3 Reload -> 4 Compare; Fetch any time ----------------

    def _done(self, step: str) -> bool:
        if step == "compare":
            return self.verdicts is not None
        return step in self.frames and (step != "reset" or self.reset_started)  # a reset every rank refused is not done

    def step_block(self, step: str) -> str | None:
        """Why ``step`` (``fetch`` or one of :data:`FLOW`) cannot run now, in words; None when it can."""
        if step not in ("fetch", *FLOW):
            raise ValueError(f"unknown step {step!r}; choose fetch or one of {', '.join(FLOW)}")
        if not self.live:
            if step != "compare":
                return "frames in memory: there are no agents to fetch from or act on"
            return None if self.void is None else f"{_VOID}: these frames cannot be compared"
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
                if self.void is not None:
                    return f"reloaded; {_VOID}: start a new check (1 Snapshot)"
                if self.verdicts is None:
                    return "reloaded: 4 Compare says what it wrote"
                if bool((self.verdicts["status"] == "match").all()):
                    return "reloaded, and every weight matches: a new check starts with 1 Snapshot"
                # verdicts that are not all match: a weight may still hold the reset pattern, so reloading again is valid
        if step == "compare":
            if self.void is not None:
                return f"{_VOID}: start a new check (1 Snapshot)"
            todo = [f"{i} {p.capitalize()}" for i, p in enumerate(PHASES, 1) if not self._done(p)]
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
        if self.unusable is not None or self.void is not None:  # this check cannot conclude: a new one (after a reload)
            return next((s for s in ("snapshot", "reload") if self.live and self.step_block(s) is None), None)
        for step in FLOW:
            if not self._done(step):
                return step if self.step_block(step) is None else None
        return None

    def require_step(self, step: str) -> None:
        """Raise :class:`StepRefused` (:class:`MutationRefused`), saying why, unless ``step`` may run now."""
        why = self.step_block(step)
        if why is not None:
            error = MutationRefused if why == self.mutation_block else StepRefused
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
            self.status_text = self.stopped_status()
        return self.stopped

    def _heard(self, res: FetchResult) -> None:
        """Whether any rank answered ``res``: none (every one unreachable) is said until a later fetch gets an answer."""
        if res.answered == 0 and len(res.failed) and bool((res.failed["kind"] == "unreachable").all()):
            n = plural(len(res.failed), "rank") if self.ranks_known else "every rank"
            self.silent = f"no rank answers ({n} unreachable): the agents or the network may be down; Fetch asks again"
        elif res.answered:
            self.silent = None

    def _stepped(self, phase: str, step: str) -> None:
        """The session finished ``step`` of ``phase``: say what comes next, tick the progress."""
        if step == phase:
            self.activity = f"{DOING[phase]}: {phase} done, fetching the digests of {self.ranks_words()}…"
            if phase == "reset":  # the reset was sent (whatever it answered): the ranks may hold its pattern
                self.reset_started = True
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
        self._heard(res)
        self.fetch_result, self.shown_fetch, self.current = res, res, res.frame
        for u, info in res.infos.items():
            self.infos[u] = info
            self.info_errors.pop(u, None)
        kinds = [f"{int((res.failed['kind'] == k).sum())} {k}" for k in ("unreachable", "failed", "empty") if (res.failed["kind"] == k).any()]
        self.status_text = "; ".join([f"fetch: {self.answered_words(res.answered)}", *kinds, plural(len(res.frame), "parameter")])
        if self.silent is not None:
            self.status_text = self.silent_status(self.status_text)
        if self.check_alive() is not None:
            self.status_text = self.stopped_status()
        return res.frame

    def phase(self, phase: str) -> pd.DataFrame:
        """Run one phase of the check (``snapshot``, ``reset``, ``reload``) on every rank and fetch its digests."""
        self.check_alive()
        self.require_step(phase)
        assert self.session is not None
        self.verdicts = self.report = None  # a phase run again makes earlier verdicts stale
        if phase == "snapshot":  # a new check: what the one before it found, failed or cleared is history
            self.reset_started, self.unusable, self.void, self.frames = False, None, None, {}
            self.shown_fetch, self.cleared = None, []
        if phase in ("snapshot", "reload"):
            self.transport, self.notes = None, []
        notes = getattr(self.fleet, "notes", None)
        seen = len(notes) if isinstance(notes, list) else 0
        self.activity = self.plan(phase)
        try:
            frame = getattr(self.session, phase)()
        except SnapshotUnusable as e:  # refused before any reset was sent: nothing is poisoned
            self.unusable = said(e).split(": ", 1)[-1]
            raise
        finally:
            self.frames = dict(self.session.frames)
            if phase == "reset" and self.targets and set(self.targets) <= self.session.unpoisoned:
                self.reset_started = False  # every rank refused the reset (a wrong token): nothing holds the pattern
        if phase == "reload":
            self.transport = getattr(self.fleet, "transport", None)
            self.notes = list(notes[seen:]) if isinstance(notes, list) else []
        fetched = self.session.fetches.get(phase)
        if fetched is not None:
            self._heard(fetched)
        self.current = frame
        self.status_text = self.phase_status(phase)
        if self.silent is not None:
            self.status_text = self.silent_status(self.status_text)
        if self.check_alive() is not None:
            self.status_text = f"{self.stopped_status()}; {self.status_text}"
        return frame

    def compare(self) -> pd.DataFrame:
        """The verdicts: the end-state check's classification, or expected against actual.

        A reset that did not cover every parameter voids the check
        (:class:`wcviz.endstate.ResetNotCovered`): Compare is then off until a new check.
        """
        self.activity = "comparing…"
        self.require_step("compare")
        try:
            if self.session is not None:
                report = self.session.report(allow_partial_reset=self.allow_partial_reset, reset_pattern=self.reset_pattern)
                report.transport = self.transport
                report.notes.extend(self.notes)
                self.report, self.verdicts = report, report.verdicts
            elif self.kind == "endstate":
                f = self.frames
                pattern = "poison" if self.reset_pattern is None else self.reset_pattern
                self.verdicts = classify(
                    f["snapshot"], f["reset"], f["reload"], allow_partial_reset=self.allow_partial_reset, reset_pattern=pattern
                )
                self.report = EndStateReport(verdicts=self.verdicts, frames=dict(f), problems=_no_problems())
            elif self.kind == "compare":
                self.verdicts = compare(self.frames["expected"], self.frames["actual"])
        except ResetNotCovered as e:
            self.void = said(e)
            raise
        assert self.verdicts is not None
        self.on_step()
        self.status_text = self.verdict_status()
        return self.verdicts

    def clear_errors(self) -> None:
        """Forget what the errors area shows: the exceptions, the check's rank problems and the last fetch's failures."""
        self.exceptions.clear()
        if self.session is not None:
            self.cleared.extend(self.session.problems)
        self.cleared_info |= set(self.info_errors.items())
        self.shown_fetch = None

    @property
    def bad(self) -> bool:
        """Whether the verdicts hold anything but a match, or the check has problems."""
        found = self.verdicts is not None and bool((self.verdicts["status"] != "match").any())
        return found or (self.report is not None and bool(len(self.report.problems)))


def _no_problems() -> pd.DataFrame:
    from wcviz.endstate import PROBLEM_COLUMNS

    return pd.DataFrame({c: pd.Series(dtype="Int64" if c in IDENTITY else "string") for c in PROBLEM_COLUMNS})
