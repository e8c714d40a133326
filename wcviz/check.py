"""The end-state check driven over HTTP: snapshot -> reset -> reload -> compare on every agent.

:mod:`wcviz.endstate` classifies frames; this module drives live ranks through their
agents (:class:`wcviz.agent.Agent`) and keeps the check honest when ranks misbehave:

- a rank that does not answer in some phase is ``unreachable`` in the verdicts (never
  silently dropped, never counted as a pass);
- a reset that leaves a parameter of an answering rank unchanged voids the check
  (:class:`wcviz.endstate.ResetNotCovered`), raised only after the reload has run;
- a reload that fails on a rank leaves that rank poisoned: the report names it in
  :attr:`EndStateReport.poisoned` and its summary says so first; every exception that
  leaves :func:`check_agents` while ranks are poisoned names them first too (a void
  check, a failing ``before_reload`` hook: the reload runs whatever happened before it);
- a rank that answers with no parameters (released or offloaded weights, a mis-wired
  holder) is ``empty`` in the verdicts, never a pass;
- a rank keeps the identity it first answered with: once known it is what the rank at
  that URL must claim, and a rank that dies later is reported under it.

The reset is destructive: it overwrites every engine weight with a poison pattern.
The agents must have been started with ``allow_mutations=True`` and a token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from wcviz.endstate import PHASES, EngineLeftPoisoned, ResetNotCovered, classify, summary
from wcviz.frame import IDENTITY
from wcviz.sources._http import FAILED_COLUMNS, ActionResult, Targets, _normalize, act, fetch

__all__ = ["PROBLEM_COLUMNS", "EndStateReport", "EndStateSession", "check_agents"]

PROBLEM_COLUMNS = ("phase", "step", "url", "kind", "error", "role", "rank", "dp", "pp", "tp", "ep")


@dataclass
class EndStateReport:
    """What one end-state check found.

    ``verdicts``: :func:`wcviz.endstate.classify`'s frame (``unreachable`` rows for
    ranks that did not answer). ``frames``: the digest frame of each phase.
    ``problems``: one row per (phase, step, rank) that failed (:data:`PROBLEM_COLUMNS`;
    ``step`` is ``snapshot``/``reset``/``reload`` for the action, ``digests`` for the
    fetch). ``poisoned``: the problems of ranks whose reload failed - they still hold
    the reset pattern. ``transport``: the refit's transport check, when the reload
    was a refit. ``notes``: what the driver had to do differently (a dead rank made
    the reload a checkpoint load, say), printed in the summary.
    """

    verdicts: pd.DataFrame
    frames: dict[str, pd.DataFrame]
    problems: pd.DataFrame
    transport: Any = None
    answered: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def poisoned(self) -> pd.DataFrame:
        """The problems of ranks whose reload failed: they still hold the reset pattern."""
        return _poisoned(self.problems)

    @property
    def ok(self) -> bool:
        """True only if every rank answered every phase and every parameter matches."""
        return not len(self.problems) and bool(len(self.verdicts)) and bool((self.verdicts["status"] == "match").all())

    def summary(self) -> str:
        """Lines a person reads first: poisoned ranks, then the verdicts, then every problem."""
        lines = []
        if len(self.poisoned):
            lines.append(_poisoned_line(self.poisoned))
        lines.append(summary(self.verdicts))
        for _, r in self.problems.iterrows():
            lines.append(f"  {r['phase']}/{r['step']}: {_label(r)} {r['kind']}: {r['error']}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def details(self, limit: int = 20) -> str:
        """The rows that are not ``match``, worst first: rank, coordinates, status, name (and whose weights a swap holds)."""
        bad = self.verdicts[self.verdicts["status"] != "match"]
        if not len(bad):
            return "every parameter matches"
        lines = []
        for _, r in bad.head(limit).iterrows():
            where = _label({**r, "role": "rank"})
            name = r["name"] if not pd.isna(r["name"]) else "(no parameter answered)"
            held = f"  <- holds {r['same_as']}'s" if "same_as" in r and not pd.isna(r["same_as"]) else ""
            lines.append(f"  {r['status']:<11} {where:<28} {name}{held}")
        if len(bad) > limit:
            lines.append(f"  ... {len(bad) - limit} more (see the verdicts frame)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _label(row: Mapping[str, Any]) -> str:
    coords = " ".join(f"{c}={int(row[c])}" for c in IDENTITY[1:] if not pd.isna(row.get(c)))
    role = row.get("role")
    who = f"{role if isinstance(role, str) and role else 'rank'} {int(row['rank'])}" if not pd.isna(row.get("rank")) else str(row.get("url"))
    return who + (f" ({coords})" if coords else "")


def _poisoned(problems: pd.DataFrame) -> pd.DataFrame:
    """Ranks a failed reload left holding the reset pattern (its reset may have run)."""
    if "poisoned" in problems:
        return problems[problems["poisoned"]].reset_index(drop=True)
    return problems[(problems["phase"] == "reload") & (problems["step"] == "reload")].reset_index(drop=True)


def _poisoned_line(poisoned: pd.DataFrame) -> str:
    ranks = ", ".join(dict.fromkeys(_label(r) for _, r in poisoned.iterrows()))
    return f"RELOAD FAILED on {ranks}: still poisoned (serving the reset pattern); rerun the weight update"


def _known(row: Mapping[str, Any]) -> dict[str, Any]:
    """The identity fields of ``row`` that hold a value (NA never overwrites what is known)."""
    return {k: row[k] for k in ("role", *IDENTITY, "host") if k in row and row[k] is not None and not pd.isna(row[k])}


class EndStateSession:
    """The end-state check one phase at a time (what a dashboard's buttons drive).

    :meth:`snapshot`, :meth:`reset`, :meth:`reload` each act on every agent and fetch
    its digests; :meth:`report` classifies what was collected. The reset is
    DESTRUCTIVE; see :func:`check_agents` for the arguments.
    """

    def __init__(
        self,
        urls: Targets,
        *,
        token: str | None,
        reload: Callable[[], object] | None = None,
        timeout_s: float = 60.0,
        retries: int = 2,
        client: Any = None,
        transport: Any = None,
    ) -> None:
        self.targets, expected = _normalize(urls)
        if not self.targets:
            raise ValueError("the end-state check needs at least one agent URL")
        self.urls = urls
        self.token = token
        self.reload_fn = reload
        self.retries = retries
        self.net: dict[str, Any] = {"client": client, "transport": transport, "timeout_s": timeout_s}
        self.known: dict[str, dict[str, Any]] = {u: dict(e) for u, e in zip(self.targets, expected)}
        self.problems: list[dict[str, Any]] = []
        self.frames: dict[str, pd.DataFrame] = {}
        self.answered: dict[str, int] = {}
        self.unpoisoned: set[str] = set()  # URLs whose reset certainly did not run: a failed reload leaves them as they were

    def _problem(self, phase: str, step: str, url: str, kind: str, error: str) -> None:
        self.problems.append({"phase": phase, "step": step, "url": url, "kind": kind, "error": error, **self.known.get(url, {})})

    def _act(self, phase: str) -> None:
        if phase == "reload" and self.reload_fn is not None:
            try:
                done = self.reload_fn()
            except Exception as e:  # noqa: BLE001 - recorded against every rank; the digests show the damage
                for u in self.targets:
                    self._problem(phase, "reload", u, "failed", f"the reload callable failed: {type(e).__name__}: {e}")
                return
            if isinstance(done, ActionResult):  # a callable that says which ranks it reloaded, and which it could not
                self._record(phase, done)
            return
        self._record(phase, act(self._targets(), phase, token=self.token, **self.net))

    def _record(self, phase: str, res: ActionResult) -> None:
        for u, err in res.errors.items():
            kind = "refused" if u in res.not_run and u not in res.unreachable else "unreachable" if u in res.unreachable else "failed"
            if phase == "reset" and u in res.not_run:
                self.unpoisoned.add(u)
            self._problem(phase, phase, u, kind, err)

    def _targets(self) -> dict[str, dict[str, Any]]:
        """Every URL with the identity known for it: a rank must go on claiming what it first claimed."""
        return {u: {k: v for k, v in self.known.get(u, {}).items() if k != "host"} for u in self.targets}

    def _digests(self, phase: str) -> pd.DataFrame:
        res = fetch(self._targets(), retries=self.retries, **self.net)
        for u, info in res.infos.items():
            self.known.setdefault(u, {}).update(_known(info))
        for r in res.failed.to_dict(orient="records"):
            self.known.setdefault(str(r["url"]), {}).update(_known({k: r[k] for k in FAILED_COLUMNS if k in IDENTITY or k == "role"}))
            self._problem(phase, "digests", str(r["url"]), str(r["kind"]), str(r["error"]))
        self.frames[phase] = res.frame.assign(phase=phase)
        self.answered[phase] = res.answered
        return self.frames[phase]

    def _phase(self, phase: str) -> pd.DataFrame:
        self.problems = [p for p in self.problems if p["phase"] != phase]  # a phase run again replaces its record
        if phase == "reset":
            self.unpoisoned = set()
        self._act(phase)
        return self._digests(phase)

    def snapshot(self) -> pd.DataFrame:
        """Every agent records, and we fetch, its digests (phase ``snapshot``); starts a new check."""
        self.problems, self.frames, self.answered, self.unpoisoned = [], {}, {}, set()
        return self._phase("snapshot")

    def reset(self) -> pd.DataFrame:
        """DESTRUCTIVE: every agent poisons every parameter; the digests after it (phase ``reset``)."""
        if "snapshot" not in self.frames:
            raise RuntimeError("reset before snapshot: take the snapshot first, or nothing can be compared")
        return self._phase("reset")

    def reload(self) -> pd.DataFrame:
        """Run the update again (the ``reload`` callable, else each agent's reload); the digests after it."""
        return self._phase("reload")

    @property
    def problem_table(self) -> pd.DataFrame:
        """:data:`PROBLEM_COLUMNS`, one row per (phase, step, rank) that failed; ``poisoned`` says whether the rank
        may hold the reset pattern after a failed reload (False where its reset certainly did not run)."""
        table = pd.DataFrame(self.problems, columns=list(PROBLEM_COLUMNS))
        for c in PROBLEM_COLUMNS:
            table[c] = table[c].astype("Int64" if c in IDENTITY else "string")
        table["poisoned"] = ((table["phase"] == "reload") & (table["step"] == "reload") & ~table["url"].isin(self.unpoisoned)).astype(bool)
        return table

    @property
    def poisoned(self) -> pd.DataFrame:
        """The problems of ranks whose reload failed so far after a reset that may have run: they hold the reset pattern."""
        return _poisoned(self.problem_table)

    def report(self, *, allow_partial_reset: bool = False, reset_pattern: str | int = "poison") -> EndStateReport:
        """Classify the three phases (``reset_pattern``: what the agents' reset writes, see
        :data:`wcviz.endstate.RESET_PATTERNS`).

        Raises :class:`wcviz.endstate.ResetNotCovered` if the reset fell short; when a
        reload failed too, the message starts with the ranks left poisoned.
        """
        missing = [p for p in PHASES if p not in self.frames]
        if missing:
            raise RuntimeError(f"the end-state check has not run {', '.join(missing)} yet (order: snapshot, reset, reload)")
        table = self.problem_table
        hollow = table[table["kind"] == "empty"]
        silent = table[((table["step"] == "digests") | (table["kind"] == "unreachable")) & (table["kind"] != "empty")]
        try:
            verdicts = classify(
                self.frames["snapshot"], self.frames["reset"], self.frames["reload"],
                allow_partial_reset=allow_partial_reset, reset_pattern=reset_pattern, unreachable=silent, empty=hollow,
            )  # fmt: skip
        except ResetNotCovered as e:
            poisoned = _poisoned(table)
            if not len(poisoned):
                raise
            labels = tuple(dict.fromkeys(_label(r) for _, r in poisoned.iterrows()))
            raise ResetNotCovered(f"{_poisoned_line(poisoned)}. Also: {e}", e.coverage, labels) from e
        return EndStateReport(verdicts=verdicts, frames=dict(self.frames), problems=table, answered=dict(self.answered))


def check_agents(
    urls: Targets,
    *,
    token: str | None,
    reload: Callable[[], object] | None = None,
    before_reload: Callable[[], object] | None = None,
    allow_partial_reset: bool = False,
    reset_pattern: str | int = "poison",
    timeout_s: float = 60.0,
    retries: int = 2,
    progress: bool = False,
    client: Any = None,
    transport: Any = None,
) -> EndStateReport:
    """Run the end-state check on the agents at ``urls`` and return an :class:`EndStateReport`.

    DESTRUCTIVE: the reset poisons every parameter of every rank. ``urls`` may map each
    URL to the identity expected there, so a rank that never answers is still reported
    under its coordinates. ``reload``: a callable that runs the weight update again (a
    refit from the trainer); by default each agent's ``POST /v1/reload`` (e.g. from a
    checkpoint). A failing ``reload`` callable is recorded against every rank (all are
    left poisoned) unless it returns an :class:`wcviz.sources.ActionResult` naming the
    ranks it could not reload; the digests are still fetched, so the report shows the
    state. ``before_reload`` runs between the reset and the reload (e.g. to inject a
    loader fault that strikes only the update under test). ``reset_pattern``: what
    the agents' reset writes (wcviz's ``poison`` by default; ``zeros``, a byte, or
    ``unknown`` for an engine's own reset), by which coverage is proven.

    Once the reset has started, the reload runs whatever happens (a reset or a
    ``before_reload`` hook that raises, Ctrl-C): the error is raised after it, and if
    ranks are left poisoned it is an :class:`wcviz.endstate.EngineLeftPoisoned` that
    names them first.
    """
    from tqdm.auto import tqdm

    session = EndStateSession(
        urls, token=token, reload=reload, timeout_s=timeout_s, retries=retries, client=client, transport=transport
    )
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
            raise EngineLeftPoisoned(
                f"RELOAD FAILED on every rank ({type(e).__name__}: {e}): still poisoned (serving the reset pattern); "
                "rerun the weight update"
            ) from e
        bar.update()
    return session.report(allow_partial_reset=allow_partial_reset, reset_pattern=reset_pattern)


def _restore(session: EndStateSession, error: BaseException) -> None:
    """Reload after ``error`` broke the check between reset and reload; raise naming the ranks left poisoned."""
    why = f"{type(error).__name__}: {error}"
    try:
        session.reload()
    except BaseException as e:
        raise EngineLeftPoisoned(
            f"RELOAD FAILED on every rank ({type(e).__name__}: {e}): still poisoned (serving the reset pattern); rerun "
            f"the weight update. The check stopped before its reload because {why}"
        ) from error
    poisoned = session.poisoned
    if len(poisoned):
        labels = tuple(dict.fromkeys(_label(r) for _, r in poisoned.iterrows()))
        raise EngineLeftPoisoned(
            f"{_poisoned_line(poisoned)}. The check stopped before its reload because {why}; the other ranks were reloaded",
            labels,
        ) from error
