"""A source over HTTP: collect the digest tables of many :class:`wcviz.agent.Agent` ranks at once.

Rank identity comes from each agent's ``/v1/info``, never from the order of the URLs.

Design choice for ranks that do not answer: the digest schema requires ``name``,
``digest`` and ``algo`` on every row, and a rank that was not collected has none of
them, so it cannot be a row of :attr:`FetchResult.frame` without a made-up digest. Such
ranks go to a separate :attr:`FetchResult.failed` frame instead (one row per URL: url,
kind, error and whatever identity is known), and :attr:`FetchResult.complete` and
:attr:`FetchResult.summary` account for them. Every URL given ends up in exactly one
of the two frames; none is dropped.

A rank that answers with no parameters at all (an engine that released or offloaded
its weights, a holder wired to the wrong object) is no pass either: it is a
``failed`` row of kind ``empty``, and the fetch is not complete.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import pandas as pd

from wcviz._errors import TableError
from wcviz._names import name_filter
from wcviz.frame import IDENTITY, make_frame, validate

__all__ = ["FAILED_COLUMNS", "ActionResult", "FetchResult", "act", "act_agents", "fetch", "fetch_agents"]

FAILED_COLUMNS = ("url", "kind", "error", "role", "rank", "dp", "pp", "tp", "ep", "host")
_KEY = ("role",) + IDENTITY  # what makes two ranks the same rank
_BACKOFF_S = 0.1


class _Unreachable(Exception):
    """No HTTP answer at all: refused, reset or timed out (after the retries)."""


class _Failed(Exception):
    """An answer that is an error or not a valid digest table."""


class _NotRun(Exception):
    """Mixed in where the request certainly did not run its action (refused, or never delivered)."""


class _Refused(_Failed, _NotRun):
    """A 4xx answer to a mutation: the agent refused it before running anything."""


class _NotDelivered(_Unreachable, _NotRun):
    """The connection was refused: the request never reached the agent."""


class _Empty(_Failed):
    """An answer with no parameters at all: the rank holds nothing to check."""


def empty_reason(info: Mapping[str, Any] | None, rows: int, filtered: bool) -> str | None:
    """Why a rank that answered counts as empty (its info counts no parameters, or it gave no rows
    unfiltered), or None. A name filter that matches nothing on a rank is not an empty rank."""
    params = info.get("params") if isinstance(info, Mapping) else None
    if isinstance(params, int) and not isinstance(params, bool) and params == 0:
        return "holds no parameters (its info counts 0): weights released or offloaded, or a mis-wired holder"
    if not filtered and rows == 0:
        return "answered with no parameters: weights released or offloaded, or a mis-wired holder"
    return None


@dataclass
class FetchResult:
    """What a fetch collected: the rows of the ranks that answered, and the ranks that did not.

    ``frame`` is schema-valid (:func:`wcviz.frame.validate`) with an extra ``url`` column;
    ``failed`` has :data:`FAILED_COLUMNS` with ``kind`` ``unreachable`` (no HTTP answer),
    ``failed`` (an error answer or a table that does not hold up) or ``empty`` (it
    answered, holding no parameters); ``errors`` maps those URLs to their message;
    ``infos`` maps each answering URL to its ``/v1/info``.
    """

    urls: tuple[str, ...]
    frame: pd.DataFrame
    failed: pd.DataFrame
    errors: dict[str, str] = field(default_factory=dict)
    infos: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def answered(self) -> int:
        """How many ranks answered with a digest table (an empty one included)."""
        silent = int((self.failed["kind"] != "empty").sum()) if len(self.failed) else 0
        return len(self.urls) - silent

    @property
    def complete(self) -> bool:
        """True only when every URL given was collected (and at least one was given)."""
        return bool(self.urls) and not self.errors

    @property
    def summary(self) -> str:
        """One line: ``3 of 4 ranks answered; 1 unreachable: URL (why)``."""
        parts = [f"{self.answered} of {len(self.urls)} ranks answered"]
        for kind in ("unreachable", "failed", "empty"):
            rows = self.failed[self.failed["kind"] == kind]
            if len(rows):
                listed = ", ".join(f"{r.url} ({r.error})" for r in rows.itertuples())
                parts.append(f"{len(rows)} {kind}: {listed}")
        return "; ".join(parts)

    def __str__(self) -> str:
        return self.summary


def _short(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__} {text}" if text else type(exc).__name__


def _message(resp: httpx.Response) -> str:
    """The agent's JSON ``error``, or the start of whatever else the body holds."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "error" in body:
        return str(body["error"])
    return resp.text[:200] or resp.reason_phrase


async def _get(client: httpx.AsyncClient, url: str, params: Mapping[str, str], timeout_s: float, retries: int) -> Any:
    """GET a JSON body; retry connection errors, timeouts and 5xx with a small backoff."""
    last: BaseException | None = None
    for attempt in range(retries + 1):
        if attempt:
            await asyncio.sleep(_BACKOFF_S * 2 ** (attempt - 1))
        try:
            # wait_for too: a transport without timeouts (ASGITransport) must not hang a rank
            resp = await asyncio.wait_for(client.get(url, params=params, timeout=timeout_s), timeout_s)
        except (httpx.TransportError, asyncio.TimeoutError) as e:
            last = _Unreachable(_short(e) if not isinstance(e, asyncio.TimeoutError) else f"timed out after {timeout_s} s")
            continue
        if resp.status_code >= 500:
            last = _Failed(f"HTTP {resp.status_code}: {_message(resp)}")
            continue
        if resp.status_code != 200:
            raise _Failed(f"HTTP {resp.status_code}: {_message(resp)}")
        try:
            return resp.json()
        except ValueError:
            raise _Failed(f"{url} did not answer JSON") from None
    assert last is not None
    raise last


def _identity(info: Any) -> dict[str, Any]:
    """The rank identity an agent claims, checked."""
    if not isinstance(info, dict) or not isinstance(info.get("role"), str) or not isinstance(info.get("rank"), int):
        raise _Failed(f"/v1/info is not an agent's info (needs role and rank): {str(info)[:200]}")
    for k in ("dp", "pp", "tp", "ep"):
        if info.get(k) is not None and not isinstance(info[k], int):
            raise _Failed(f"/v1/info has a non-integer {k}: {info[k]!r}")
    return {k: info.get(k) for k in ("role", "rank", "dp", "pp", "tp", "ep", "host")}


def _check_expected(ident: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """An agent must be the rank the caller says lives at its URL (a launcher that mixed ranks up)."""
    wrong = [k for k in _KEY if k in expected and expected[k] is not None and ident.get(k) != expected[k]]
    if wrong:
        said = ", ".join(f"{k}={ident.get(k)}" for k in wrong)
        want = ", ".join(f"{k}={expected[k]}" for k in wrong)
        raise _Failed(f"/v1/info says {said} but this URL was expected to serve {want}")


async def _fetch_one(
    client: httpx.AsyncClient, url: str, name: str | None, timeout_s: float, retries: int, known: dict[str, Any]
) -> tuple[dict[str, Any], pd.DataFrame]:
    """Info, then digests, of one agent; the rows must carry the identity the info claimed.

    ``known`` holds the identity expected at ``url`` (possibly empty) and is updated with
    what the agent claims, so a failure is reported with the best identity there is.
    """
    info = await _get(client, f"{url}/v1/info", {}, timeout_s, retries)
    ident = _identity(info)
    _check_expected(ident, dict(known))
    known.update(ident)
    body = await _get(client, f"{url}/v1/digests", {"name": name} if name is not None else {}, timeout_s, retries)
    rows = body.get("rows") if isinstance(body, dict) else None
    if not isinstance(rows, list):
        raise _Failed("/v1/digests did not answer {'rows': [...]}")
    try:
        frame = make_frame(rows)
    except TableError as e:
        raise _Failed(f"/v1/digests is not a digest table: {e}") from None
    if name is None and isinstance(info.get("params"), int) and len(frame) != info["params"]:
        raise _Failed(f"/v1/info counts {info['params']} parameters but /v1/digests gave {len(frame)} rows")
    if (why := empty_reason(info, len(frame), name is not None)) is not None:
        raise _Empty(why)
    for k in _KEY:
        want = ident[k]
        col = frame[k]
        wrong = col.notna() if want is None else (col.isna() | (col != want))
        if bool(wrong.any()):
            raise _Failed(f"/v1/digests rows claim {k}={col[wrong].iloc[0]!r} but /v1/info says {k}={want!r}")
    frame["url"] = url
    return info, frame


Targets = Sequence[str] | str | Mapping[str, Mapping[str, Any]]


def _checked_url(url: Any) -> str:
    """``url`` without a trailing slash, once it is an ``http(s)://host[:port]`` address; else a ValueError naming it."""
    text = str(url).strip().rstrip("/")
    try:
        parsed = httpx.URL(text)
    except (httpx.InvalidURL, TypeError, ValueError) as e:
        raise ValueError(f"{str(url)[:200]!r} is not a URL ({e})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{str(url)[:200]!r} is not an agent URL: expected http://host:port (or https://)")
    return text


def _normalize(urls: Targets) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
    """The URLs, and the identity expected at each (empty when only URLs are given)."""
    if isinstance(urls, str):
        urls = [urls]
    pairs = list(urls.items()) if isinstance(urls, Mapping) else [(u, {}) for u in urls]
    out = tuple(_checked_url(u) for u, _ in pairs)
    seen: set[str] = set()
    for u in out:
        if u in seen:
            raise ValueError(f"URL {u} is given twice; each rank must be fetched once")
        seen.add(u)
    expected = []
    for u, ident in pairs:
        if not isinstance(ident, Mapping):
            raise TypeError(f"the identity expected at {u} must be a mapping (role, rank, dp, pp, tp, ep), got {type(ident).__name__}")
        unknown = sorted(set(ident) - set(_KEY) - {"host"})
        if unknown:
            raise ValueError(f"the identity expected at {u} has unknown key(s) {', '.join(unknown)}; allowed: {', '.join(_KEY)}, host")
        expected.append(dict(ident))
    return out, expected


async def fetch_agents(
    urls: Targets,
    *,
    client: httpx.AsyncClient | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    timeout_s: float = 10.0,
    retries: int = 2,
    name: str | None = None,
) -> FetchResult:
    """Collect the digest tables of the agents at ``urls``, concurrently.

    ``urls`` may map each URL to the identity expected there (``{"role": "engine",
    "rank": 3, "pp": 1, "tp": 1}``): an agent claiming another identity is ``failed``,
    and a rank that does not answer is reported under the identity it should have had.
    Identity still comes from each agent's ``/v1/info``, never from the order of URLs.
    ``client`` (kept open) or ``transport`` choose how to reach them (e.g.
    ``httpx.ASGITransport(app=agent.app)``); ``timeout_s`` bounds each request, which is
    retried ``retries`` times on connection errors, timeouts and 5xx. ``name`` is a regex
    the agents filter parameter names by. Never raises for a rank that fails: see
    :class:`FetchResult`.
    """
    if retries < 0 or timeout_s <= 0:
        raise ValueError("retries must be >= 0 and timeout_s > 0")
    if client is not None and transport is not None:
        raise ValueError("give client or transport, not both")
    name_filter(name)  # a bad pattern is the caller's error, named here, not one failure per rank
    targets, knowns = _normalize(urls)
    own = client is None
    http = client if client is not None else httpx.AsyncClient(transport=transport, timeout=timeout_s)
    try:
        outcomes = await asyncio.gather(
            *(_fetch_one(http, u, name, timeout_s, retries, k) for u, k in zip(targets, knowns)), return_exceptions=True
        )
    finally:
        if own:
            await http.aclose()

    failed: list[dict[str, Any]] = []
    collected: dict[tuple[Any, ...], list[tuple[str, dict[str, Any], dict[str, Any], pd.DataFrame]]] = {}
    for url, known, outcome in zip(targets, knowns, outcomes):
        if isinstance(outcome, BaseException):
            if not isinstance(outcome, Exception):  # cancellation, KeyboardInterrupt: not ours to swallow
                raise outcome
            kind = "unreachable" if isinstance(outcome, _Unreachable) else "empty" if isinstance(outcome, _Empty) else "failed"
            message = str(outcome) if isinstance(outcome, (_Unreachable, _Failed)) else _short(outcome)
            failed.append({"url": url, "kind": kind, "error": message, **known})
        else:
            collected.setdefault(tuple(known.get(k) for k in _KEY), []).append((url, known, *outcome))

    frames: list[pd.DataFrame] = []
    infos: dict[str, dict[str, Any]] = {}
    for key, claims in collected.items():
        if len(claims) > 1:  # two URLs claiming one rank: neither can be trusted to be that rank
            rank = ", ".join(f"{k}={v}" for k, v in zip(_KEY, key) if v is not None)
            for url, known, _, _ in claims:
                others = ", ".join(u for u, *_ in claims if u != url)
                failed.append({"url": url, "kind": "failed", "error": f"claims the same rank ({rank}) as {others}", **known})
            continue
        url, _, info, frame = claims[0]
        infos[url] = info
        frames.append(frame)

    errors = {row["url"]: row["error"] for row in failed}
    non_empty = [f for f in frames if len(f)]
    if non_empty:  # ordered by rank identity, so the table does not depend on the order of the URLs
        frame = pd.concat(non_empty, ignore_index=True).sort_values(list(_KEY), kind="stable", na_position="last")
        frame = validate(frame.reset_index(drop=True), source="agents")
    else:
        frame = make_frame([])
        frame["url"] = pd.Series(dtype="string")
    frame["url"] = frame["url"].astype("string")
    order = {u: i for i, u in enumerate(targets)}
    failed_frame = pd.DataFrame(
        sorted(({c: row.get(c) for c in FAILED_COLUMNS} for row in failed), key=lambda r: order[str(r["url"])]),
        columns=list(FAILED_COLUMNS),
    )
    for c in FAILED_COLUMNS:
        failed_frame[c] = failed_frame[c].astype("Int64" if c in IDENTITY else "string")
    return FetchResult(urls=targets, frame=frame, failed=failed_frame, errors=errors, infos=infos)


def _blocking(what: str, coro_fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``coro_fn`` to completion; inside a running loop (a Jupyter kernel), on a fresh loop in a helper thread.

    A caller-provided ``client`` is bound to its own loop, so it cannot be used from the helper thread.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro_fn(*args, **kwargs))
    if kwargs.get("client") is not None:
        raise RuntimeError(f"{what}() with a client was called inside a running event loop; use 'await {coro_fn.__name__}(...)' there")
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"wcviz-{what}") as pool:
        return pool.submit(asyncio.run, coro_fn(*args, **kwargs)).result()


def fetch(urls: Targets, **kwargs: Any) -> FetchResult:
    """Blocking :func:`fetch_agents` (same arguments), for scripts and the CLI."""
    return _blocking("fetch", fetch_agents, urls, **kwargs)


@dataclass
class ActionResult:
    """What one POST to many agents did: each URL's answer body, or its error.

    ``unreachable``: the URLs that gave no HTTP answer. ``not_run``: the URLs where
    the action certainly did not run (the agent refused it with a 4xx, or the
    connection was refused): a reset there poisoned nothing.
    """

    action: str
    urls: tuple[str, ...]
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    unreachable: set[str] = field(default_factory=set)
    not_run: set[str] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        """True only when every URL acknowledged the action."""
        return bool(self.urls) and not self.errors

    @property
    def summary(self) -> str:
        parts = [f"{self.action}: {len(self.answers)} of {len(self.urls)} ranks acknowledged"]
        if self.errors:
            parts.append(", ".join(f"{u} ({e})" for u, e in self.errors.items()))
        return "; ".join(parts)


async def _post(client: httpx.AsyncClient, url: str, action: str, token: str | None, timeout_s: float) -> dict[str, Any]:
    """POST one mutation, once: a reset or reload is not retried behind the caller's back."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = await asyncio.wait_for(client.post(f"{url}/v1/{action}", headers=headers, timeout=timeout_s), timeout_s)
    except httpx.ConnectError as e:
        raise _NotDelivered(_short(e)) from None
    except (httpx.TransportError, asyncio.TimeoutError) as e:
        raise _Unreachable(_short(e) if not isinstance(e, asyncio.TimeoutError) else f"timed out after {timeout_s} s") from None
    if 400 <= resp.status_code < 500:
        raise _Refused(f"HTTP {resp.status_code}: {_message(resp)}")
    if resp.status_code != 200:
        raise _Failed(f"HTTP {resp.status_code}: {_message(resp)}")
    try:
        body = resp.json()
    except ValueError:
        raise _Failed(f"{url} did not answer JSON") from None
    if not isinstance(body, dict) or body.get("ok") is not True:
        raise _Failed(f"{action} was not acknowledged: {str(body)[:200]}")
    return body


async def act_agents(
    urls: Targets,
    action: str,
    *,
    token: str | None,
    client: httpx.AsyncClient | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    timeout_s: float = 60.0,
) -> ActionResult:
    """POST ``/v1/<action>`` (snapshot, reset or reload) to every agent at once, with the bearer ``token``.

    Mutations are sent once and never retried. Every URL ends up in ``answers`` or
    ``errors`` (``unreachable`` marks those that gave no HTTP answer at all).
    """
    if action not in ("snapshot", "reset", "reload"):
        raise ValueError(f"unknown action {action!r}; choose snapshot, reset or reload")
    if client is not None and transport is not None:
        raise ValueError("give client or transport, not both")
    targets, _ = _normalize(urls)
    own = client is None
    http = client if client is not None else httpx.AsyncClient(transport=transport, timeout=timeout_s)
    try:
        outcomes = await asyncio.gather(*(_post(http, u, action, token, timeout_s) for u in targets), return_exceptions=True)
    finally:
        if own:
            await http.aclose()
    result = ActionResult(action, targets)
    for url, outcome in zip(targets, outcomes):
        if isinstance(outcome, BaseException):
            if not isinstance(outcome, Exception):
                raise outcome
            result.errors[url] = str(outcome) if isinstance(outcome, (_Unreachable, _Failed)) else _short(outcome)
            if isinstance(outcome, _Unreachable):
                result.unreachable.add(url)
            if isinstance(outcome, _NotRun):
                result.not_run.add(url)
        else:
            result.answers[url] = outcome
    return result


def act(urls: Targets, action: str, **kwargs: Any) -> ActionResult:
    """Blocking :func:`act_agents` (same arguments)."""
    return _blocking("act", act_agents, urls, action, **kwargs)
