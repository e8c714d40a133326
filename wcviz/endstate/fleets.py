"""The kinds of fleet the end-state session runs over, and the one-call checks built on them.

Each fleet implements :class:`wcviz.endstate.Fleet` - ``targets``, ``identity``,
``digests(phase)``, ``act(action)``, ``reset_pattern`` - and nothing else:

- :class:`AgentFleet`: :class:`wcviz.agent.Agent` ranks over HTTP (``check_agents``,
  ``wcviz endstate``, the dashboard); the simulated cluster's fleet extends it
  (:mod:`wcviz.sim`);
- :class:`CallableFleet`: in-process callables acting on every rank at once (``run_check``).

The engines' own checkers (vLLM's, SGLang's) are :mod:`wcviz.endstate.engines`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pandas as pd

from wcviz._errors import check_deadline, check_token
from wcviz.endstate.session import EndStateReport, EndStateSession, run
from wcviz.frame import IDENTITY
from wcviz.sources import ActionResult, FetchResult, Targets, act, fetch, fetch_infos, normalize_targets

__all__ = [
    "AgentFleet",
    "CallableFleet",
    "check_agents",
    "run_check",
]

_IDENTITY_FIELDS = ("role", *IDENTITY, "host")


def _known(row: Mapping[str, Any]) -> dict[str, Any]:
    """The identity fields of ``row`` that hold a value (NA never overwrites what is known)."""
    return {k: row[k] for k in _IDENTITY_FIELDS if k in row and row[k] is not None and not pd.isna(row[k])}


def _no_failures(rows: list[dict[str, Any]] | None = None) -> pd.DataFrame:
    from wcviz.sources import FAILED_COLUMNS

    empty = pd.DataFrame({c: pd.Series(dtype="Int64" if c in IDENTITY else "string") for c in FAILED_COLUMNS})
    if not rows:
        return empty
    return pd.DataFrame(rows, columns=list(FAILED_COLUMNS)).astype(empty.dtypes.to_dict())


def _acknowledged(action: str, targets: tuple[str, ...]) -> ActionResult:
    return ActionResult(action, targets, answers={t: {} for t in targets})


class AgentFleet:
    """:class:`wcviz.agent.Agent` ranks at ``urls``: digests by ``GET``, actions by ``POST`` with the bearer ``token``.

    ``urls`` may map each URL to the identity expected there; once a rank has answered,
    the identity it claimed is what the rank at that URL must go on claiming (and a rank
    that dies later is reported under it). ``reload``: a callable that runs the weight
    update instead of each agent's ``POST /v1/reload`` (a refit from the trainer); if it
    returns an :class:`wcviz.sources.ActionResult`, that says which ranks it reloaded.
    """

    per_rank_actions = True  # each agent is asked by itself (Fleet)

    def __init__(
        self,
        urls: Targets,
        *,
        token: str | None,
        reload: Callable[[], object] | None = None,
        reset_pattern: str | int = "poison",
        timeout_s: float = 60.0,
        retries: int = 2,
        client: Any = None,
        transport: Any = None,
    ) -> None:
        targets, expected = normalize_targets(urls)
        if not targets:
            raise ValueError("the end-state check needs at least one agent URL")
        timeout_s, retries = check_deadline(timeout_s, retries)  # refused before any rank is touched
        token = check_token(token)
        self._targets = targets
        self.token = token
        self.reload_fn = reload
        self.reset_pattern = reset_pattern
        self.retries = retries
        self.net: dict[str, Any] = {"client": client, "transport": transport, "timeout_s": timeout_s}
        self.known: dict[str, dict[str, Any]] = {u: dict(e) for u, e in zip(targets, expected)}

    @property
    def targets(self) -> tuple[str, ...]:
        return self._targets

    def identity(self, target: str) -> Mapping[str, Any]:
        return self.known.get(target, {})

    def expected(self) -> dict[str, dict[str, Any]]:
        """Every URL with the identity known for it (what a fetch checks each rank against)."""
        return {u: {k: v for k, v in self.known.get(u, {}).items() if k != "host"} for u in self._targets}

    def digests(self, phase: str) -> FetchResult:
        res = fetch(self.expected(), retries=self.retries, **self.net)
        for u, info in res.infos.items():
            self.known.setdefault(u, {}).update(_known(info))
        for r in res.failed.to_dict(orient="records"):
            self.known.setdefault(str(r["url"]), {}).update(_known(r))
        return res

    def act(self, action: str) -> ActionResult:
        if action == "reload" and self.reload_fn is not None:
            done = self.reload_fn()
            return done if isinstance(done, ActionResult) else _acknowledged(action, self._targets)
        return act(self.expected(), action, token=self.token, **self.net)

    def info(self) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """Each agent's ``/v1/info`` now (what it allows), or why there is none; no event loop needed."""
        infos, errors = fetch_infos(self._targets, **{**self.net, "timeout_s": min(float(self.net["timeout_s"]), 10.0)})
        for url, info in infos.items():
            self.known.setdefault(url, {}).update(_known(info))
        return infos, errors


    def mutation_block(self, infos: Mapping[str, Mapping[str, Any]], errors: Mapping[str, str]) -> str | None:
        """Why snapshot, reset and reload cannot be sent (given :meth:`info`'s answers), or None when they can."""
        if not self.token:
            return "no token given: Dashboard(urls, token=...) with the agents' bearer token"
        silent = [u for u in self._targets if u not in infos]
        if silent:
            why = "; ".join(f"{u} ({errors.get(u, 'no answer')})" for u in silent)
            return f"mutations are off: /v1/info did not answer on {why}"
        off = [u for u in self._targets if infos[u].get("mutations_allowed") is not True]
        if off:
            return f"mutations are off on {', '.join(off)} (start its agent with allow_mutations=True)"
        return None


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
    """Run the end-state check on the agents at ``urls`` and return an :class:`wcviz.endstate.EndStateReport`.

    DESTRUCTIVE: the reset poisons every parameter of every rank. ``urls`` may map each
    URL to the identity expected there, so a rank that never answers is still reported
    under its coordinates. ``reload``: a callable that runs the weight update again (a
    refit from the trainer); by default each agent's ``POST /v1/reload``. A failing
    ``reload`` is recorded against every rank (all are left poisoned) unless it returns
    an :class:`wcviz.sources.ActionResult` naming the ranks it could not reload; the
    digests are still fetched, so the report shows the state. ``before_reload`` runs
    between the reset and the reload (e.g. to inject a loader fault that strikes only
    the update under test). ``reset_pattern``: what the agents' reset writes (wcviz's
    ``poison`` by default), by which coverage is proven. Once the reset has started the
    reload runs whatever happens, and every way out names the ranks left poisoned first.
    """
    fleet = AgentFleet(
        urls, token=token, reload=reload, reset_pattern=reset_pattern, timeout_s=timeout_s, retries=retries,
        client=client, transport=transport,
    )  # fmt: skip
    return run(EndStateSession(fleet), before_reload=before_reload, allow_partial_reset=allow_partial_reset, progress=progress)


class CallableFleet:
    """Every rank acted on at once by callables, digested by one: the whole fleet is one target, ``every rank``.

    ``digest_fn(phase)`` returns the digest frame of every rank for that phase. An action
    that raises failed for the whole fleet.
    """

    TARGET = "every rank"

    def __init__(
        self,
        snapshot: Callable[[], object],
        reset: Callable[[], object],
        reload: Callable[[], object],
        digests: Callable[[str], pd.DataFrame],
        *,
        reset_pattern: str | int = "poison",
    ) -> None:
        self.actions = {"snapshot": snapshot, "reset": reset, "reload": reload}
        self.digest_fn = digests
        self.reset_pattern = reset_pattern

    @property
    def targets(self) -> tuple[str, ...]:
        return (self.TARGET,)

    def identity(self, target: str) -> Mapping[str, Any]:
        return {}

    def digests(self, phase: str) -> FetchResult:
        from wcviz.frame import make_frame, validate

        frame = self.digest_fn(phase)
        if len(frame):
            return FetchResult(self.targets, validate(frame, phase).assign(url=self.TARGET), _no_failures())
        # no rows at all is a fleet that holds nothing to check (released, or the wrong object digested): ``empty``,
        # never a check that passes for want of anything to compare
        why = f"digests({phase!r}) returned no rows: nothing to check"
        return FetchResult(self.targets, make_frame([]).assign(url=self.TARGET), _no_failures([{"url": self.TARGET, "kind": "empty", "error": why}]))

    def act(self, action: str) -> ActionResult:
        self.actions[action]()
        return _acknowledged(action, self.targets)


def run_check(
    snapshot_fn: Callable[[], object],
    reset_fn: Callable[[], object],
    reload_fn: Callable[[], object],
    digest_fn: Callable[[str], pd.DataFrame],
    *,
    allow_partial_reset: bool = False,
    reset_pattern: str | int = "poison",
) -> pd.DataFrame:
    """Run the end-state check over callables and return :func:`wcviz.endstate.classify`'s verdicts.

    ``digest_fn(phase)`` returns the digest frame of every rank for that phase. Order:
    snapshot, digest; reset, digest; reload, digest; classify. The reload runs even if
    the reset failed, so the engine is restored before any error is raised; a failed
    reload raises :class:`wcviz.endstate.EngineLeftPoisoned` and is never reported as a result.
    """
    fleet = CallableFleet(snapshot_fn, reset_fn, reload_fn, digest_fn, reset_pattern=reset_pattern)
    report = run(EndStateSession(fleet), allow_partial_reset=allow_partial_reset, raise_if_poisoned=True)
    return report.verdicts
