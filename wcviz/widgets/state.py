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

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pandas as pd

from wcviz._text import plural, rank_label
from wcviz.endstate import EndStateReport, EndStateSession, Fleet, classify, reset_coverage
from wcviz.frame import IDENTITY
from wcviz.sources import FetchResult
from wcviz.verdicts import SEVERITY, compare, status_parts

__all__ = ["ALL", "NOT_MATCH", "DashboardState"]

ALL = "all"
NOT_MATCH = "not match"
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


class DashboardState:
    """The dashboard without its widgets; see the module docstring. Attributes are the frames a user keeps working with."""

    def __init__(
        self,
        source: Any,
        *,
        token: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 2,
        on_step: Callable[[], None] | None = None,
    ) -> None:
        self.on_step = on_step or (lambda: None)
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
            self.verdicts = source.reset_index(drop=True)
        elif self.kind is not None:
            self.frames = dict(source)
        else:
            self.fleet = _fleet_of(source, token, {"timeout_s": float(timeout_s), "retries": int(retries)})
            self.kind = "fleet"
            self.token = getattr(self.fleet, "token", token)
            self.session = EndStateSession(self.fleet, on_step=lambda phase, step: self.on_step())
            if hasattr(self.fleet, "info"):
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
        block = self.mutation_block if mutation else None
        if block is not None:
            raise PermissionError(f"{action} is disabled: {block}")

    # ---- actions ---------------------------------------------------------------------------

    def fetch(self) -> pd.DataFrame:
        """Every rank's digests now (no mutation); the frame is :attr:`current`."""
        self.require("fetch", mutation=False)
        assert self.fleet is not None
        res = self.fleet.digests("current")
        self.on_step()
        self.fetch_result, self.current = res, res.frame
        for u, info in res.infos.items():
            self.infos[u] = info
            self.info_errors.pop(u, None)
        kinds = [f"{int((res.failed['kind'] == k).sum())} {k}" for k in ("unreachable", "failed", "empty") if (res.failed["kind"] == k).any()]
        self.status_text = "; ".join([f"fetch: {self._answered(res.answered)}", *kinds, plural(len(res.frame), "parameter")])
        return res.frame

    def phase(self, phase: str) -> pd.DataFrame:
        """Run one phase of the check (``snapshot``, ``reset``, ``reload``) on every rank and fetch its digests."""
        self.require(phase)
        assert self.session is not None
        if phase == "reset" and "snapshot" not in self.session.frames:
            raise RuntimeError("reset before snapshot: take the snapshot first, or nothing can be compared")
        self.verdicts = self.report = None  # a phase run again makes earlier verdicts stale
        if phase == "snapshot":
            self.transport = None
        frame = getattr(self.session, phase)()
        if phase == "reload":
            self.transport = getattr(self.fleet, "transport", None)
        self.frames = dict(self.session.frames)
        self.current = frame
        self.status_text = self._phase_status(phase)
        return frame

    def compare(self) -> pd.DataFrame:
        """The verdicts: the end-state check's classification, or expected against actual."""
        if self.session is not None:
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
            try:
                cov = reset_coverage(self.session.frames["snapshot"], frame, reset_pattern=self.session.fleet.reset_pattern)
                cols = [c for c in IDENTITY if c in frame]
                answered = cov[cols].merge(_ranks(frame).assign(_in=True), on=cols, how="left")["_in"].notna().to_numpy()
                nonempty = cov[~cov["empty"].to_numpy() & answered]  # a rank that did not answer is not counted
                parts.append(f"{int(nonempty['covered'].sum()):,} of {len(nonempty):,} fully reset")
            except Exception as e:  # noqa: BLE001 - the coverage is a hint here; Compare reports the real error
                parts.append(f"reset coverage unknown ({type(e).__name__})")
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
        if (v["status"] == "empty").any():
            parts.append(f"{plural(len(_ranks(v[v['status'] == 'empty'])), 'rank')} empty (answered with no parameters)")
        rep = self.report
        if rep is not None and len(rep.poisoned):
            labels = ", ".join(sorted({rank_label(r, "role") for r in rep.poisoned.to_dict(orient="records")}))
            parts.insert(0, f"RELOAD FAILED on {labels}: still poisoned")
        named = v[v["name"].notna()] if "name" in v else v
        findings = status_parts(named[~named["status"].isin(["unreachable", "empty"])], name_ranks=False)
        if findings == [f"{len(named):,} match"] and len(named):
            findings = [f"all {len(named):,} parameters match"]
        parts += findings or (["no parameters"] if not len(named) else [])
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
        lines = [f"{action}: {type(e).__name__}: {e}" for action, e in self.exceptions]
        return "\n".join(lines + self.problem_lines)

    def empty_hint(self) -> str:
        if self.live:
            done = [p for p in ("snapshot", "reset", "reload") if p in self.frames]
            if not done:
                return "no verdicts yet: Snapshot, Reset, Reload, then Compare"
            todo = [p.capitalize() for p in ("snapshot", "reset", "reload") if p not in self.frames]
            return f"no verdicts yet ({', '.join(done)} done): " + ", ".join([*todo, "Compare"])
        return "no verdicts yet: press Compare"

    # ---- what the filters leave ------------------------------------------------------------

    def roles(self, v: pd.DataFrame) -> pd.Series:
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

    def role_options(self) -> list[tuple[str, str]]:
        v = self.verdicts
        roles: list[str] = []
        if v is not None:
            roles = sorted(str(r) for r in self.roles(v).dropna().unique())
        elif self.current is not None and "role" in self.current:
            roles = sorted(str(r) for r in self.current["role"].dropna().unique())
        return [(ALL, ALL)] + [(r, r) for r in roles]

    def status_options(self) -> list[tuple[str, str]]:
        v = self.verdicts
        opts = [(ALL, ALL)]
        if v is not None:
            counts = v["status"].astype("object").value_counts()
            opts.append((f"{NOT_MATCH} ({int(len(v) - counts.get('match', 0)):,})", NOT_MATCH))
            opts += [(f"{s} ({int(counts[s]):,})", s) for s in SEVERITY if s in counts]
        return opts

    def role_rows(self) -> pd.DataFrame | None:
        v = self.verdicts
        if v is None or self.role_filter == ALL:
            return v
        return v[(self.roles(v) == self.role_filter).fillna(False).to_numpy()].reset_index(drop=True)

    @property
    def table(self) -> pd.DataFrame | None:
        """The verdict rows the table view shows: role, status filter and parameter search applied."""
        v = self.role_rows()
        if v is None:
            return None
        if self.status_filter == NOT_MATCH:
            v = v[v["status"] != "match"]
        elif self.status_filter != ALL:
            v = v[v["status"] == self.status_filter]
        text = self.search.strip()
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

    def drill_frames(self) -> Mapping[str, pd.DataFrame]:
        """Digest frames per phase for the drill-down: the frames, else the verdicts' ``digest_<phase>`` columns."""
        if self.frames:
            return self.frames
        v = self.verdicts
        assert v is not None
        phases = [c.removeprefix("digest_") for c in v.columns if c.startswith("digest_")]
        if not phases:
            raise ValueError("the drill-down needs digests: this verdict frame has no digest_<phase> columns")
        ids = [c for c in IDENTITY if c in v]
        return {p: v[ids + ["name", f"digest_{p}"]].rename(columns={f"digest_{p}": "digest"}).dropna(subset=["digest"]) for p in phases}

    def view_text(self, view: str) -> str:
        """The text form of ``view`` (what the picture shows, for logs and notebook checks)."""
        from wcviz.views import drilldown_text, layer_rank_text, topology_text

        v = self.role_rows()
        if v is None:
            return self.empty_hint()
        if view == "layer × rank":
            return layer_rank_text(v)
        if view == "topology":
            return str(topology_text(v))
        if view == "drill-down":
            name = self.drilldown_name
            return str(drilldown_text(self.drill_frames(), name)) if name is not None else "no parameter matches the filters"
        t = self.table
        assert t is not None
        cols = [c for c in ("rank", "pp", "tp", "name", "status") if c in t]
        return t[cols].to_string(index=False) if len(t) else "no verdicts match the filters"


def _no_problems() -> pd.DataFrame:
    from wcviz.endstate import PROBLEM_COLUMNS

    return pd.DataFrame({c: pd.Series(dtype="Int64" if c in IDENTITY else "string") for c in PROBLEM_COLUMNS})
