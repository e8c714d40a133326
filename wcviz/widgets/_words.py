"""What the dashboard says: its status lines, error lines and hints, in the words a person reads.

Mixed into :class:`wcviz.widgets.DashboardState`, whose check it reads; it changes
nothing. Errors are shown by their message alone (:func:`said`): the class names that
errors carry elsewhere (``ConnectError: ...``, wcviz's reports, logs) are dropped here.
An engine's own checker (vLLM, SGLang) is one URL until its first answer names the
ranks behind it: the dashboard calls it "the engine at URL" and its ranks "every rank"
until then, never "1 agent" or "1 rank".
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import pandas as pd

from wcviz._text import plural, rank_label
from wcviz.endstate import AgentFleet, reset_coverage
from wcviz.frame import IDENTITY, rank_ids
from wcviz.verdicts import n_parameters, status_parts

if TYPE_CHECKING:
    from wcviz.endstate import EndStateReport, EndStateSession, Fleet
    from wcviz.sources import FetchResult

__all__ = ["DashboardWords", "coverage_hint", "ranks_of", "said"]

DOING = {"snapshot": "snapshotting", "reset": "resetting", "reload": "reloading"}
# an exception's class name where an error was put in one line (``ConnectError: ...``, ``(RuntimeError: ...)``)
_CLASS_NAME = re.compile(
    r"(?<![\w.])(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Timeout|Exit|Interrupt|Warning|Unusable|Poisoned|NotCovered"
    r"|Mismatch|Unverified): "
)


def said(what: BaseException | str) -> str:
    """What an error says, for a person: its message in one line, without exception class names."""
    text = _CLASS_NAME.sub("", " ".join(str(what).split()))
    return text or "(an error without a message)"


def ranks_of(df: pd.DataFrame) -> pd.DataFrame:
    """The distinct ranks of a frame by :func:`wcviz.frame.rank_ids` (two ranks known only by their URLs are two)."""
    if not any(c in df for c in (*IDENTITY, "url")):
        return pd.DataFrame(index=[0])
    return rank_ids(df).drop_duplicates()


def coverage_hint(snapshot: pd.DataFrame, reset: pd.DataFrame, pattern: Any) -> str:
    """``N of M fully reset`` over the ranks that answered the reset: a hint in the status line (Compare judges).

    Where the digest a fully reset parameter must have cannot be computed (a reset of
    unknown values, like SGLang's; zeros without the parameters' sizes, like vLLM's
    checker without ``sizes``) the hint says coverage cannot be proven, never "0 fully reset".
    """
    try:
        cov = reset_coverage(snapshot, reset, reset_pattern=pattern)
        cols = [c for c in IDENTITY if c in reset]
        answered = cov[cols].merge(reset[cols].drop_duplicates().assign(_in=True), on=cols, how="left")["_in"].notna().to_numpy()
        nonempty = cov[~cov["empty"].to_numpy() & answered]  # a rank that did not answer is not counted
        provable = nonempty[nonempty["digest_pattern"].notna().to_numpy()]
        blind = len(nonempty) - len(provable)
        if not blind:
            return f"{int(provable['covered'].sum()):,} of {len(provable):,} fully reset"
        why = "the reset writes values nobody knows" if pattern == "unknown" else "the digest of a full reset cannot be computed without sizes"
        unproven = f"reset coverage cannot be proven for {plural(blind, 'parameter')} ({why})"
        return unproven if not len(provable) else f"{int(provable['covered'].sum()):,} of {len(provable):,} fully reset; {unproven}"
    except Exception as e:  # noqa: BLE001 - the coverage is a hint here; Compare reports the real error
        return f"reset coverage unknown ({said(e)})"


class DashboardWords:
    """The dashboard's words over the state it is mixed into; see the module docstring."""

    fleet: Fleet | None
    session: EndStateSession | None
    kind: str | None
    stopped: str | None
    silent: str | None
    verdicts: pd.DataFrame | None
    report: EndStateReport | None
    frames: dict[str, pd.DataFrame]
    exceptions: list[tuple[str, BaseException]]
    info_errors: dict[str, str]
    shown_fetch: FetchResult | None
    cleared: list[Any]
    cleared_info: set[tuple[str, str]]
    notes: list[str]
    reset_pattern: str | int | None

    if TYPE_CHECKING:  # DashboardState's property: declared for the type checker only, never shadowing it

        @property
        def mutation_block(self) -> str | None: ...

    @property
    def targets(self) -> tuple[str, ...]:
        return self.session.targets if self.session is not None else ()

    @property
    def live(self) -> bool:
        """Whether there are ranks to fetch from and act on (not frames in memory)."""
        return self.fleet is not None

    @property
    def ranks_known(self) -> bool:
        """Whether the targets are the ranks; False for an engine's checker that has not yet named its ranks."""
        base = getattr(self.fleet, "base", None)
        return not (isinstance(base, str) and self.targets == (base,))

    def ranks_words(self) -> str:
        """``2 ranks``, or ``every rank`` while an engine has not said how many it has."""
        return plural(len(self.targets), "rank") if self.ranks_known else "every rank"

    def source_words(self) -> str:
        """What the dashboard is over: ``2 agents``, ``the vLLM engine at URL`` (an engine is never an agent)."""
        base = getattr(self.fleet, "base", None)
        if isinstance(base, str):
            engine = str(getattr(self.fleet, "engine", "engine"))
            where = f"the {'' if engine == 'engine' else engine + ' '}engine at {base}"
            return where if not self.ranks_known else f"{plural(len(self.targets), 'rank')} of {where}"
        return plural(len(self.targets), "agent" if isinstance(self.fleet, AgentFleet) else "rank")

    def plan(self, action: str) -> str:
        """What ``action`` is about to do, in words (the status line while it runs)."""
        n = self.ranks_words()
        if action == "fetch":
            return f"fetching the digests of {n}…"
        if action == "compare":
            return "comparing…"
        how = "refit" if getattr(self.fleet, "transport", False) is not False else "the weight update"
        what = {"snapshot": "every rank records its digests", "reset": "overwriting every weight", "reload": how}[action]
        return f"{DOING[action]}: {what}, then fetching the digests of {n}…"

    def stopped_status(self) -> str:
        return f"STOPPED: {self.stopped}" + ("; the views show the last results (stale)" if self.verdicts is not None else "")

    def silent_status(self, then: str) -> str:
        return f"NO ANSWER: {self.silent}; {then}"

    def initial_status(self) -> str:
        if self.kind == "verdicts":
            return self.verdict_status()
        if self.stopped is not None:
            return self.stopped_status()
        if not self.live:
            return "frames in memory: 4 Compare classifies them"
        line = f"{self.source_words()}; nothing fetched yet"
        block = self.mutation_block
        return line + (f"; Snapshot, Reset and Reload are off: {block}" if block else "")

    def answered_words(self, answered: int) -> str:
        if not self.ranks_known:
            return f"{plural(answered, 'rank')} answered" if answered else "no rank answered"
        return f"{answered:,} of {len(self.targets):,} ranks answered"

    def phase_status(self, phase: str) -> str:
        """``reset done; 2 of 2 ranks answered; 8 parameters; 8 of 8 fully reset``: one phase, as the session recorded it."""
        assert self.session is not None
        s = self.session
        frame = s.frames[phase]
        problems = s.problem_table
        acted = problems[(problems["phase"] == phase) & (problems["step"] == phase)]
        parts = []
        if len(acted):
            n_failed = acted["url"].nunique()
            line = f"{phase} FAILED on {n_failed} of {len(self.targets)} ranks"
            if phase == "reload":
                held = s.poisoned["url"].nunique()  # the session's own record: a rank whose reset never ran is not poisoned
                line += " (still poisoned)" if held and held == n_failed else f" ({held} of them still poisoned)" if held else ""
            if phase == "reset" and set(self.targets) <= s.unpoisoned:
                line += " (refused: nothing was reset)"
            parts.append(line)
        else:
            parts.append(f"{phase} done")
        parts.append(self.answered_words(s.answered.get(phase, 0)))
        parts.append(plural(len(frame), "parameter"))
        if phase == "reset" and "snapshot" in s.frames and not set(self.targets) <= s.unpoisoned:
            pattern = s.fleet.reset_pattern if self.reset_pattern is None else self.reset_pattern
            parts.append(coverage_hint(s.frames["snapshot"], frame, pattern))
        if phase == "reload":
            parts += [f"note: {n}" for n in self.notes]
        return "; ".join(parts)

    def verdict_status(self) -> str:
        """Ranks, then findings worst first (:func:`wcviz.verdicts.status_parts`), then the report's problems."""
        v = self.verdicts
        assert v is not None
        n = len(ranks_of(v))
        if (v["status"] == "unreachable").any():
            head = f"{n - len(ranks_of(v[v['status'] == 'unreachable'])):,} of {n:,} ranks answered"
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
        """Rank problems: the check's (phase/step, rank, kind, error) and the last fetch's failed ranks.

        What a person cleared (Clear errors) stays out, and a new check (1 Snapshot)
        drops the failures of fetches made before it.
        """
        lines = [f"info: {u}: {said(err)}" for u, err in self.info_errors.items() if (u, err) not in self.cleared_info]
        if self.session is not None:
            for r in self.session.problems:  # the session's own records: a cleared one is that very record
                if not any(r is c for c in self.cleared):
                    lines.append(f"{r['phase']}/{r['step']}: {rank_label(r, 'role')} {r['kind']}: {said(r['error'])}")
        if self.shown_fetch is not None:
            for r in self.shown_fetch.failed.to_dict(orient="records"):
                lines.append(f"fetch: {rank_label(r, 'role')} {r['kind']}: {said(r['error'])}")
        return lines

    @property
    def error_text(self) -> str:
        """What the errors area shows, as plain text: exceptions (oldest first), then rank problems."""
        lines = [f"{action}: {said(e)}" for action, e in self.exceptions]
        return "\n".join(lines + self.problem_lines)

    def empty_hint(self) -> str:
        if self.stopped is not None:
            return f"nothing to show: {self.stopped}"
        if self.live:
            done = [p for p in ("snapshot", "reset", "reload") if p in self.frames]
            if not done:
                return "no verdicts yet: Snapshot, Reset, Reload, then Compare"
            todo = [p.capitalize() for p in ("snapshot", "reset", "reload") if p not in self.frames]
            return f"no verdicts yet ({', '.join(done)} done): " + ", ".join([*todo, "Compare"])
        return "no verdicts yet: press Compare"
