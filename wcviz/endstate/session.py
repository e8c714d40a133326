"""The end-state check, phase by phase, over any fleet of ranks: one session, one report.

:class:`EndStateSession` runs snapshot -> reset -> reload over a :class:`Fleet` - the
small protocol every kind of fleet implements (HTTP agents and in-process callables:
:mod:`wcviz.endstate.fleets`; the simulated cluster; vLLM's and SGLang's own checkers:
:mod:`wcviz.endstate.engines`) - and
:meth:`EndStateSession.report` classifies what it collected
(:func:`wcviz.endstate.classify`). :func:`run` is the whole check in order, and it
keeps the check honest when ranks misbehave:

- a rank that does not answer in some phase is ``unreachable`` in the verdicts (never
  silently dropped, never counted as a pass); one that answers with no parameters is
  ``empty``;
- a snapshot the report could not classify (one rank with two identities, two digest
  algorithms, a parameter listed twice, two targets claiming one rank), one a rank
  refused (a wrong token: its reset would be refused too), or one no rank answered,
  stops the check before the reset (:class:`SnapshotUnusable`): nothing is poisoned
  for a check that cannot conclude;
- a reset that leaves a parameter of an answering rank anything but fully reset voids
  the check (:class:`wcviz.endstate.ResetNotCovered`), raised only after the reload;
- once the reset has started the reload runs whatever happens (a reset or a
  ``before_reload`` hook that raises, Ctrl-C), and every way out names the ranks left
  poisoned first (:class:`EngineLeftPoisoned`, or a :class:`ResetNotCovered` whose
  message starts with them), the report's own errors included. A rank is called
  poisoned only where the digests after the reload do not disprove it, and a reload
  that ran but whose digests could not be fetched is :class:`ReloadUnverified`.

Observers (a dashboard's progress bar) pass ``on_step(phase, step)``: it is called
after each action and each fetch of digests; an observer that raises is logged and
ignored (a progress bar must not turn a good reload into a reported failure).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import pandas as pd

from wcviz._errors import WcvizError
from wcviz._text import plural, rank_label
from wcviz.endstate.classify import PHASES, ResetNotCovered, check_reset_pattern, classify, holds_reset_pattern
from wcviz.frame import IDENTITY, validate
from wcviz.sources import ActionResult, FetchResult
from wcviz.verdicts import summary as verdict_summary

__all__ = [
    "PROBLEM_COLUMNS", "EndStateReport", "EndStateSession", "EngineLeftPoisoned", "Fleet", "ReloadUnverified", "SnapshotUnusable",
    "Summary", "run",
]  # fmt: skip

log = logging.getLogger("wcviz.endstate")

PROBLEM_COLUMNS = ("phase", "step", "url", "kind", "error", "role", *IDENTITY)


class EngineLeftPoisoned(WcvizError, RuntimeError):
    """The reload (or restoring after a failed reset) failed: the engine still holds poison.

    ``poisoned`` names the ranks left poisoned, when they are known.
    """

    def __init__(self, message: str, poisoned: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.poisoned = poisoned

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.poisoned))


class ReloadUnverified(EngineLeftPoisoned):
    """The reload ran without an error, but its digests could not be fetched: whether the ranks are restored is not
    known (so it is still an :class:`EngineLeftPoisoned` to callers that only catch that; ``poisoned`` is empty)."""


class SnapshotUnusable(WcvizError, RuntimeError):
    """The snapshot cannot be classified, so the check stopped before its reset: nothing was poisoned."""


@runtime_checkable
class Fleet(Protocol):
    """What the end-state session needs of a fleet of ranks.

    ``targets``: one label per rank (an agent's URL), or one for a fleet acted on as a
    whole. ``identity(target)``: what is known of the rank there (role, rank, dp, pp,
    tp, ep). ``digests(phase)``: every rank's digests now, as a
    :class:`wcviz.sources.FetchResult` (a rank that does not answer is in its
    ``failed``). ``act(action)``: ``snapshot``, ``reset`` or ``reload`` on every rank,
    as a :class:`wcviz.sources.ActionResult`; raising means the whole fleet failed.
    ``reset_pattern``: what the reset writes (:data:`wcviz.endstate.RESET_PATTERNS`).
    Optional ``per_rank_actions`` (default False): each target is acted on by itself, so
    a target whose action answered is alive even when its digests did not come.
    """

    reset_pattern: str | int

    @property
    def targets(self) -> tuple[str, ...]: ...

    def identity(self, target: str) -> Mapping[str, Any]: ...

    def digests(self, phase: str) -> FetchResult: ...

    def act(self, action: str) -> ActionResult: ...


class Summary(str):
    """A summary line: read it as a property (``report.summary``); calling it, as before, still works."""

    def __call__(self) -> str:
        return str(self)


def _poisoned(problems: pd.DataFrame) -> pd.DataFrame:
    """Ranks a failed reload left holding the reset pattern (their reset may have run)."""
    if "poisoned" in problems:
        return problems[problems["poisoned"]].reset_index(drop=True)
    return problems[(problems["phase"] == "reload") & (problems["step"] == "reload")].reset_index(drop=True)


def _failures(failed: pd.DataFrame) -> str:
    """``engine 1 (pp=0 tp=1) at http://...: why; ...``: failed fetches, each named by its rank and where it answered."""
    out = []
    for r in failed.to_dict(orient="records"):
        label, url = rank_label(r, "role"), str(r["url"])
        out.append(f"{label if label == url else f'{label} at {url}'}: {r['error']}")
    return "; ".join(out)


def _stale_poison_note(snapshot: pd.DataFrame, pattern: str | int) -> list[str]:
    """A note for parameters whose snapshot already held wcviz's poison: what their verdicts can and cannot say."""
    if pattern != "poison" or not len(snapshot):
        return []
    held = snapshot[holds_reset_pattern(validate(snapshot, "snapshot"), "poison")]
    if not len(held):
        return []
    ranks = ", ".join(dict.fromkeys(rank_label(r) for r in held.to_dict(orient="records")))
    return [
        f"{plural(len(held), 'parameter')} on {ranks} already held the reset pattern at the snapshot (an earlier reset "
        "was never reloaded): with no reference they are unwritten if they still hold it, else unproven; check them "
        "against the trainer's expected shards (wcviz.layouts.expected_frame)"
    ]


def _labels(poisoned: pd.DataFrame) -> tuple[str, ...]:
    return tuple(dict.fromkeys(rank_label(r, "role") for r in poisoned.to_dict(orient="records")))


def _poisoned_line(poisoned: pd.DataFrame, stuck: pd.DataFrame | None = None) -> str:
    """The ranks left poisoned, first in every message: those whose reload failed, then those whose reload left
    parameters as the reset wrote them (:meth:`EndStateSession.left_in_reset`)."""
    lines = []
    if len(poisoned):
        lines.append(f"RELOAD FAILED on {', '.join(_labels(poisoned))}: still poisoned (serving the reset pattern); rerun the weight update")
    if stuck is not None and len(stuck):
        where = ", ".join(f"{rank_label(r, 'role')} ({plural(int(r['params']), 'parameter')})" for r in stuck.to_dict(orient="records"))
        lines.append(f"STILL POISONED after the reload on {where}: the reload left what the reset wrote; rerun the weight update")
    return ". ".join(lines)


def _left_poisoned(session: EndStateSession) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(ranks whose reload failed, ranks the reload left holding the reset's values); the second empty if unknown."""
    try:
        stuck = session.left_in_reset()
    except Exception:  # noqa: BLE001 - digests that cannot be compared: the failed reloads are still named
        stuck = pd.DataFrame(columns=["url", "params"])
    return session.poisoned, stuck


@dataclass
class EndStateReport:
    """What one end-state check found.

    ``verdicts``: :func:`wcviz.endstate.classify`'s frame (``unreachable`` and ``empty``
    rows for ranks that did not answer, or answered with nothing). ``frames``: the
    digest frame of each phase; ``fetches``: each phase's
    :class:`wcviz.sources.FetchResult`. ``problems``: one row per (phase, step, rank)
    that failed (:data:`PROBLEM_COLUMNS` and ``poisoned``; ``step`` is
    ``snapshot``/``reset``/``reload`` for the action, ``digests`` for the fetch).
    ``transport``: the refit's transport check, when the reload was a refit. ``notes``:
    what the driver had to do differently (a dead rank made the reload a checkpoint
    load, say).
    """

    verdicts: pd.DataFrame
    frames: dict[str, pd.DataFrame]
    problems: pd.DataFrame
    transport: Any = None
    answered: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    fetches: dict[str, FetchResult] = field(default_factory=dict)

    @property
    def poisoned(self) -> pd.DataFrame:
        """The problems of ranks whose reload failed after a reset that may have run: they hold the reset pattern."""
        return _poisoned(self.problems)

    @property
    def unreachable(self) -> pd.DataFrame:
        """The rank identities (:data:`wcviz.frame.IDENTITY`, and ``url``) that did not answer in some phase."""
        rows = self.verdicts[self.verdicts["status"] == "unreachable"]
        cols = [*IDENTITY, "url"] if "url" in rows else list(IDENTITY)  # url: a rank without coordinates
        return rows[cols].drop_duplicates().reset_index(drop=True)

    @property
    def ok(self) -> bool:
        """True only if every rank answered every phase and every parameter is a proven match."""
        return not len(self.problems) and bool(len(self.verdicts)) and bool((self.verdicts["status"] == "match").all())

    @property
    def summary(self) -> Summary:
        """Lines a person reads first: poisoned ranks, then the verdicts, then every problem and note."""
        lines = []
        if len(self.poisoned):
            lines.append(_poisoned_line(self.poisoned))
        lines.append(verdict_summary(self.verdicts))
        for r in self.problems.to_dict(orient="records"):
            lines.append(f"  {r['phase']}/{r['step']}: {rank_label(r, 'role')} {r['kind']}: {r['error']}")
        lines += [f"  note: {n}" for n in self.notes]
        return Summary("\n".join(lines))

    def details(self, limit: int = 20) -> str:
        """The rows that are not ``match``, worst first: rank, coordinates, status, name (and whose weights a swap holds)."""
        bad = self.verdicts[self.verdicts["status"] != "match"]
        if not len(bad):
            return "every parameter matches"
        lines = []
        for r in bad.head(limit).to_dict(orient="records"):
            where = rank_label(r)
            name = r["name"] if not pd.isna(r["name"]) else "(no parameter answered)"
            held = f"  <- holds {r['same_as']}'s" if "same_as" in r and not pd.isna(r["same_as"]) else ""
            lines.append(f"  {r['status']:<11} {where:<28} {name}{held}")
        if len(bad) > limit:
            lines.append(f"  ... {len(bad) - limit} more (see the verdicts frame)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return str(self.summary)


class EndStateSession:
    """The end-state check one phase at a time (what a dashboard's buttons drive); see the module docstring.

    ``fleet``: a :class:`Fleet`. For compatibility, agent URLs (with ``token``,
    ``reload`` and the network options of :class:`wcviz.endstate.AgentFleet`) still
    make an agent fleet. The reset is DESTRUCTIVE.
    """

    def __init__(self, fleet: Fleet | Any, *, on_step: Callable[[str, str], None] | None = None, **agent_options: Any) -> None:
        if not isinstance(fleet, Fleet):
            members = ("targets", "identity", "digests", "act", "reset_pattern")
            if any(hasattr(fleet, m) for m in ("digests", "act", "identity")):  # meant as a fleet, not agent URLs
                lacks = [m for m in members if not hasattr(fleet, m)]
                raise TypeError(f"{type(fleet).__name__} is not a Fleet: it lacks {', '.join(lacks)} (see wcviz.endstate.Fleet)")
            from wcviz.endstate.fleets import AgentFleet

            fleet = AgentFleet(fleet, **agent_options)
        elif agent_options:
            raise TypeError(f"options {', '.join(agent_options)} are for agent URLs, not for a fleet")
        if not fleet.targets:
            raise ValueError("the end-state check needs at least one rank to check")
        self.fleet = fleet
        self.on_step = on_step
        self.problems: list[dict[str, Any]] = []
        self.frames: dict[str, pd.DataFrame] = {}
        self.fetches: dict[str, FetchResult] = {}
        self.answered: dict[str, int] = {}
        self.unpoisoned: set[str] = set()  # targets whose reset certainly did not run: a failed reload leaves them as they were
        self.reload_ran = False  # the last reload's action returned (its per-rank failures recorded); its digests may not have

    @property
    def targets(self) -> tuple[str, ...]:
        """The fleet's targets, one per rank (or one for a fleet acted on as a whole)."""
        return tuple(self.fleet.targets)

    def _step(self, phase: str, step: str) -> None:
        if self.on_step is not None:
            try:
                self.on_step(phase, step)
            except Exception:  # an observer's bug: logged, never the check's outcome
                log.exception("end-state check: the on_step observer raised at %s/%s (ignored)", phase, step)

    def _problem(self, phase: str, step: str, target: str, kind: str, error: str) -> None:
        ident = {k: v for k, v in self.fleet.identity(target).items() if k in ("role", *IDENTITY)}
        self.problems.append({"phase": phase, "step": step, "url": target, "kind": kind, "error": error, **ident})

    def _act(self, phase: str) -> None:
        if phase == "reload":
            self.reload_ran = False
        try:
            res = self.fleet.act(phase)
        except Exception as e:  # noqa: BLE001 - recorded against every rank; the digests show the damage
            if phase != "reload":
                raise  # a snapshot or reset that failed as a whole: nothing to record per rank, the caller decides
            from wcviz._text import one_line

            for t in self.targets:
                self._problem(phase, "reload", t, "failed", f"the reload failed: {one_line(e)}")
            self.reload_ran = True  # it ran and failed: recorded against every rank
            return
        finally:
            self._step(phase, phase)
        for t, err in res.errors.items():
            kind = "refused" if t in res.not_run and t not in res.unreachable else "unreachable" if t in res.unreachable else "failed"
            if phase == "reset" and t in res.not_run:
                self.unpoisoned.add(t)
            self._problem(phase, phase, t, kind, err)
        if phase == "reload":
            self.reload_ran = True

    def _digests(self, phase: str) -> pd.DataFrame:
        res = self.fleet.digests(phase)
        for r in res.failed.to_dict(orient="records"):
            self._problem(phase, "digests", str(r["url"]), str(r["kind"]), str(r["error"]))
        self.fetches[phase] = res
        self.frames[phase] = res.frame.assign(phase=phase)
        self.answered[phase] = res.answered
        self._step(phase, "digests")
        return self.frames[phase]

    def _phase(self, phase: str) -> pd.DataFrame:
        self.problems = [p for p in self.problems if p["phase"] != phase]  # a phase run again replaces its record
        if phase == "reset":
            self.unpoisoned, self.reload_ran = set(), False
            for stale in ("reload",):  # a reload before this reset proves nothing about it: report() waits for the next
                self.frames.pop(stale, None)
                self.fetches.pop(stale, None)
                self.answered.pop(stale, None)
            self.problems = [p for p in self.problems if p["phase"] != "reload"]
        self._act(phase)
        return self._digests(phase)

    def snapshot(self) -> pd.DataFrame:
        """Every rank records, and we fetch, its digests (phase ``snapshot``); starts a new check. Raises
        :class:`SnapshotUnusable` if the report could not classify them (and :meth:`reset` then refuses too)."""
        self.problems, self.frames, self.fetches, self.answered, self.unpoisoned = [], {}, {}, {}, set()
        frame = self._phase("snapshot")
        self._refuse_unusable_snapshot()
        return frame

    def reset(self) -> pd.DataFrame:
        """DESTRUCTIVE: every rank overwrites every parameter with the reset pattern; the digests after it."""
        if "snapshot" not in self.frames:
            raise RuntimeError("reset before snapshot: take the snapshot first, or nothing can be compared")
        self._refuse_unusable_snapshot()
        check_reset_pattern(self.fleet.reset_pattern)  # a pattern the report cannot read is refused before the reset
        return self._phase("reset")

    def _refuse_unusable_snapshot(self) -> None:
        """Raise :class:`SnapshotUnusable` if the report could not classify the snapshot: found after the
        reload, that could only be raised, with ranks poisoned for a check that cannot conclude."""
        from wcviz.endstate.classify import prepare_phases

        stop = "so the check stopped before the reset (nothing was poisoned)"
        try:
            prepare_phases({"snapshot": self.frames["snapshot"]})
        except (WcvizError, ValueError) as e:
            raise SnapshotUnusable(f"the snapshot cannot be classified, {stop}: {e}") from e
        refused = [p for p in self.problems if p["phase"] == "snapshot" and p["step"] == "snapshot" and p["kind"] == "refused"]
        if refused:  # a wrong token, mutations off: the reset would be refused there too, and prove nothing
            raise SnapshotUnusable(
                f"the snapshot was refused by {plural(len(refused), 'rank')} (the reset would be too), {stop}: "
                f"{_failures(pd.DataFrame(refused))}"
            )
        mine = [p for p in self.problems if p["phase"] == "snapshot" and p["kind"] != "empty"]
        acted = {p["url"]: p["kind"] for p in mine if p["step"] == "snapshot"}
        fetched = {p["url"]: p["kind"] for p in mine if p["step"] == "digests"}
        dead = {u for u, k in fetched.items() if k == "unreachable" and acted.get(u) == "unreachable"}
        # a rank silent to its digests whose own snapshot action answered is alive: known only where the fleet
        # acts rank by rank (agents); an engine acted on as a whole says nothing of each rank's action
        each = bool(getattr(self.fleet, "per_rank_actions", False))
        broken = [p for p in mine if p["url"] not in dead and (p["step"] == "snapshot" or (each and p["kind"] == "unreachable"))]
        if broken:  # alive (it answered one of the two), yet with no snapshot to compare against: the reset would
            # poison it for a verdict that cannot come (and a reload restoring what its snapshot recorded could not
            # restore it). A dead rank, silent to both, is no reason to stop: the living ranks are checked, it is
            # reported unreachable
            named = [{**p, **{k: v for k, v in self.fleet.identity(p["url"]).items() if k in ("role", *IDENTITY)}} for p in broken]
            raise SnapshotUnusable(  # named by what its digests told (a timed-out action came before them)
                f"the snapshot failed on {plural(len({p['url'] for p in broken}), 'rank')} that otherwise answered, {stop}: "
                f"{_failures(pd.DataFrame(named))}"
            )
        failed = self.fetches["snapshot"].failed
        bad = failed[failed["kind"] == "failed"] if len(failed) else failed
        if len(bad):  # alive but unusable (a parameter listed twice, two targets claiming one rank): the reset would
            # poison ranks the check cannot conclude on
            raise SnapshotUnusable(f"the snapshot of {plural(len(bad), 'rank')} did not hold up, {stop}: {_failures(bad)}")
        snap = self.frames["snapshot"]
        if not len(snap) and not (len(failed) and (failed["kind"] == "empty").any()):
            raise SnapshotUnusable(f"no rank answered the snapshot, {stop}: {_failures(failed) if len(failed) else 'no rows'}")

    def reload(self) -> pd.DataFrame:
        """Run the weight update again on every rank; the digests after it (phase ``reload``)."""
        return self._phase("reload")

    @property
    def problem_table(self) -> pd.DataFrame:
        """:data:`PROBLEM_COLUMNS`, one row per (phase, step, rank) that failed; ``poisoned`` says whether the rank
        may hold the reset pattern after a failed reload (False where its reset certainly did not run)."""
        rows = []
        for p in self.problems:  # what was learnt of a rank after its failure (a snapshot that timed out before any
            # digests named it) still names it: never a second, coordinate-less rank
            known = {k: v for k, v in self.fleet.identity(p["url"]).items() if k in ("role", *IDENTITY)}
            rows.append({**known, **{k: v for k, v in p.items() if v is not None and not (k in known and pd.isna(v))}})
        table = pd.DataFrame(rows, columns=list(PROBLEM_COLUMNS))
        for c in PROBLEM_COLUMNS:
            table[c] = table[c].astype("Int64" if c in IDENTITY else "string")
        reload_failed = (table["phase"] == "reload") & (table["step"] == "reload")
        cleared = table["url"].isin(self.unpoisoned) | table["url"].map(self._restored).astype(bool)
        table["poisoned"] = (reload_failed & ~cleared).astype(bool)
        return table

    def _restored(self, target: object) -> bool:
        """Whether the digests after the reload prove ``target`` no longer holds the reset: every parameter its reset
        answered for answered again after the reload, and none equals its digest after the reset (a reload that raised
        after writing every weight is not "still poisoned"). Unknown is not restored."""
        reset, reload = self.frames.get("reset"), self.frames.get("reload")
        if reset is None or reload is None or "url" not in reset or "url" not in reload:
            return False
        before = reset[reset["url"] == target].set_index("name")["digest"]
        after = reload[reload["url"] == target].set_index("name")["digest"]
        if not len(before) or not before.index.is_unique or not after.index.is_unique or not before.index.isin(after.index).all():
            return False
        return bool((after.reindex(before.index).str.lower() != before.str.lower()).all())

    @property
    def poisoned(self) -> pd.DataFrame:
        """The problems of ranks whose reload failed so far after a reset that may have run."""
        return _poisoned(self.problem_table)

    def left_in_reset(self) -> pd.DataFrame:
        """Ranks whose reload did not fail there, yet whose digests after it still equal their digests after the
        reset for a parameter the reset changed (a loader that skipped a weight): one row per rank, its identity,
        ``url`` and ``params`` (how many). What every way out of a check that ends in an error must name too, since
        no verdict will. Empty until the reload's digests are in."""
        snap, rst, rel = (self.frames.get(p) for p in PHASES)
        out = pd.DataFrame(columns=["url", "params"])
        if rst is None or rel is None or not len(rst) or not len(rel):
            return out
        coords = [c for c in IDENTITY if c in rst and c in rel and rst[c].notna().any() and rel[c].notna().any()]
        by_url = "url" in rst and "url" in rel and not rst[["url", *coords]].drop_duplicates()["url"].duplicated().any()
        # a rank by its address where each address is one rank (agents: its coordinates may change between phases),
        # else by its coordinates (a fleet acted on as a whole answers every rank under one target)
        key = ["url", "name"] if by_url else [*coords, *(["url"] if "url" in rst and "url" in rel else []), "name"]
        pairs = rst[key + ["digest"]].merge(rel[key + ["digest"]], on=key, suffixes=("_reset", "_reload"))
        same = pairs["digest_reset"].str.lower() == pairs["digest_reload"].str.lower()
        if snap is not None and all(c in snap for c in key):  # a reset that changed nothing (an empty tensor) proves nothing
            before = pairs[key].merge(snap[key + ["digest"]].drop_duplicates(key), on=key, how="left")["digest"]
            same &= (before.str.lower() != pairs["digest_reset"].str.lower()).fillna(True).to_numpy()
        stuck = pairs[same.fillna(False).to_numpy(dtype=bool)]
        if "url" in stuck and len(self.poisoned):  # named already, as ranks whose reload failed
            stuck = stuck[~stuck["url"].isin(set(self.poisoned["url"]))]
        if not len(stuck):
            return out
        who = [c for c in ("role", *IDENTITY) if c in rel and c not in key]
        ids = rel.drop_duplicates(key[:-1])[key[:-1] + who]
        counted = stuck.groupby(key[:-1], dropna=False).size().rename("params").reset_index()
        return counted.merge(ids, on=key[:-1], how="left")

    @staticmethod
    def _silent(table: pd.DataFrame) -> pd.DataFrame:
        """Ranks that did not answer some phase: a failed fetch of digests, or an action with no answer."""
        return table[((table["step"] == "digests") | (table["kind"] == "unreachable")) & (table["kind"] != "empty")]

    def report(self, *, allow_partial_reset: bool = False, reset_pattern: str | int | None = None) -> EndStateReport:
        """Classify the three phases; ``reset_pattern`` defaults to the fleet's.

        Raises :class:`wcviz.endstate.ResetNotCovered` if the reset fell short; when a
        reload failed too, the message starts with the ranks left poisoned.
        """
        missing = [p for p in PHASES if p not in self.frames]
        if missing:
            raise RuntimeError(f"the end-state check has not run {', '.join(missing)} yet (order: snapshot, reset, reload)")
        table = self.problem_table
        pattern = self.fleet.reset_pattern if reset_pattern is None else reset_pattern
        try:
            verdicts = classify(
                self.frames["snapshot"], self.frames["reset"], self.frames["reload"],
                allow_partial_reset=allow_partial_reset, reset_pattern=pattern,
                unreachable=self._silent(table), empty=table[table["kind"] == "empty"],
            )  # fmt: skip
        except ResetNotCovered as e:
            poisoned, stuck = _left_poisoned(self)
            failed = table[(table["phase"] == "reset") & (table["step"] == "reset")]
            why = f"; the reset itself failed on {_failures(failed)}" if len(failed) else ""  # a 401/403/500 is the cause
            if not len(poisoned) and not len(stuck) and not why:
                raise
            first = f"{_poisoned_line(poisoned, stuck)}. Also: " if len(poisoned) or len(stuck) else ""
            raise ResetNotCovered(f"{first}{e}{why}", e.coverage, _labels(poisoned) + _labels(stuck)) from e
        except Exception as e:  # a table that does not hold up: the poisoned ranks still come first
            poisoned, stuck = _left_poisoned(self)
            if not len(poisoned) and not len(stuck):
                raise
            raise EngineLeftPoisoned(f"{_poisoned_line(poisoned, stuck)}. Also, no verdicts could be made: {e}", _labels(poisoned) + _labels(stuck)) from e
        return EndStateReport(
            verdicts=verdicts, frames=dict(self.frames), problems=table, answered=dict(self.answered),
            fetches=dict(self.fetches), notes=_stale_poison_note(self.frames["snapshot"], pattern),
        )  # fmt: skip


def run(
    session: EndStateSession,
    *,
    before_reload: Callable[[], object] | None = None,
    allow_partial_reset: bool = False,
    reset_pattern: str | int | None = None,
    progress: bool = False,
    raise_if_poisoned: bool = False,
) -> EndStateReport:
    """The whole check in order: snapshot, reset, ``before_reload()``, reload, report (see the module docstring).

    Once the reset has started, the reload runs whatever happens: the error is raised
    after it, and if ranks are left poisoned it is an :class:`EngineLeftPoisoned` that
    names them first. A reload that failed on some ranks is in the report (its summary
    says so first), or, with ``raise_if_poisoned``, an :class:`EngineLeftPoisoned`.
    """
    from tqdm.auto import tqdm

    check_reset_pattern(session.fleet.reset_pattern if reset_pattern is None else reset_pattern)  # before anything runs
    with tqdm(total=len(PHASES), desc="end-state check", disable=not progress, leave=False) as bar:
        session.snapshot()
        bar.update()
        try:
            session.reset()
            bar.update()
            if before_reload is not None:
                before_reload()
        except BaseException as e:
            _restore(session, e)
            raise
        try:
            session.reload()
        except BaseException as e:
            raise _reload_error(session, e) from e
        bar.update()
    poisoned = session.poisoned
    if raise_if_poisoned and len(poisoned):
        errors = "; ".join(dict.fromkeys(str(e) for e in poisoned["error"]))
        raise EngineLeftPoisoned(f"{_poisoned_line(poisoned)} ({errors})", _labels(poisoned))
    return session.report(allow_partial_reset=allow_partial_reset, reset_pattern=reset_pattern)


def _restore(session: EndStateSession, error: BaseException) -> None:
    """Reload after ``error`` broke the check between reset and reload; raise naming the ranks left poisoned."""
    why = f"{type(error).__name__}: {error}"
    try:
        session.reload()
    except BaseException as e:
        raise _reload_error(session, e, f". The check stopped before its reload because {why}") from error
    poisoned, stuck = _left_poisoned(session)
    if len(poisoned) or len(stuck):
        raise EngineLeftPoisoned(
            f"{_poisoned_line(poisoned, stuck)}. The check stopped before its reload because {why}; the other ranks were reloaded",
            _labels(poisoned) + _labels(stuck),
        ) from error


def _reload_error(session: EndStateSession, e: BaseException, also: str = "") -> EngineLeftPoisoned:
    """What a reload that raised means: the action itself failed (or was interrupted), so every rank may hold the
    reset pattern; or the action ran and only fetching its digests failed, which proves nothing either way."""
    if session.reload_ran:
        bad = _poisoned(session.problem_table)
        if not len(bad):
            return ReloadUnverified(
                f"the reload ran without an error on every rank, but its digests could not be fetched ({type(e).__name__}: {e}): "
                f"whether the weights are restored is not known; fetch the digests again{also}"
            )
        return EngineLeftPoisoned(f"{_poisoned_line(bad)}; then fetching the digests failed ({type(e).__name__}: {e}){also}", _labels(bad))
    return EngineLeftPoisoned(
        f"RELOAD FAILED on every rank ({type(e).__name__}: {e}): still poisoned (serving the reset pattern); rerun the weight update{also}"
    )
