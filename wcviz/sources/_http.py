"""A source over HTTP: collect the digest tables of many :class:`wcviz.agent.Agent` ranks at once.

Rank identity comes from each agent's ``/v1/info``, never from the order of the URLs.
What an answer must be, and the result every source returns, are
:mod:`wcviz.sources._fleet`'s; this module says only how to ask an agent.

Design choice for ranks that do not answer: the digest schema requires ``name``,
``digest`` and ``algo`` on every row, and a rank that was not collected has none of
them, so it cannot be a row of :attr:`FetchResult.frame` without a made-up digest. Such
ranks go to a separate :attr:`FetchResult.failed` frame instead (one row per URL: url,
kind, error and whatever identity is known), and :attr:`FetchResult.complete` and
:attr:`FetchResult.summary` account for them. Every URL given ends up in exactly one
of the two frames; none is dropped. A rank that answers with no parameters at all (an
engine that released or offloaded its weights, a holder wired to the wrong object) is
no pass either: a ``failed`` row of kind ``empty``, and the fetch is not complete.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import httpx

from wcviz._errors import check_deadline, check_token
from wcviz._names import name_filter
from wcviz._text import one_line
from wcviz.sources._fleet import (
    FAILED_COLUMNS,
    KEY,
    ActionResult,
    Empty,
    Failed,
    FetchResult,
    NotDelivered,
    Refused,
    Targets,
    Unreachable,
    assemble_tables,
    backoff_s,
    check_expected,
    count_mismatch,
    empty_reason,
    identity_of,
    kind_of,
    message_of,
    normalize,
)
from wcviz.sources._wire import COLUMNS_MEDIA_TYPE, RankTable, WireError, table_of_body, wrong_identity

__all__ = ["FAILED_COLUMNS", "ActionResult", "FetchResult", "Targets", "act", "act_agents", "fetch", "fetch_agents", "fetch_infos"]


async def _get(
    client: httpx.AsyncClient, url: str, params: Mapping[str, str], timeout_s: float, retries: int, headers: Mapping[str, str] | None = None
) -> Any:
    """GET a JSON body; retry connection errors, timeouts and 5xx with a small backoff."""
    last: BaseException | None = None
    for attempt in range(retries + 1):
        if attempt:
            await asyncio.sleep(backoff_s(attempt))
        try:
            # wait_for too: a transport without timeouts (ASGITransport) must not hang a rank
            resp = await asyncio.wait_for(client.get(url, params=params, headers=headers, timeout=timeout_s), timeout_s)
        except (httpx.TransportError, asyncio.TimeoutError) as e:
            last = Unreachable(one_line(e) if not isinstance(e, asyncio.TimeoutError) else f"timed out after {timeout_s} s")
            continue
        if resp.status_code >= 500:
            last = Failed(f"HTTP {resp.status_code}: {message_of(resp)}")
            continue
        if resp.status_code != 200:
            raise Failed(f"HTTP {resp.status_code}: {message_of(resp)}")
        try:
            return resp.json()
        except ValueError:
            raise Failed(f"{url} did not answer JSON") from None
    assert last is not None
    raise last


# Either form of the table is read (an older agent answers rows whatever it is asked); columns are preferred.
_ACCEPT = {"accept": f"{COLUMNS_MEDIA_TYPE}, application/json;q=0.5"}


async def _fetch_one(
    client: httpx.AsyncClient, url: str, name: str | None, timeout_s: float, retries: int, known: dict[str, Any]
) -> tuple[str, dict[str, Any], dict[str, Any], RankTable]:
    """Info, then digests, of one agent: ``(url, identity, info, table)``; the rows must carry the identity the info claimed.

    ``known`` holds the identity expected at ``url`` (possibly empty) and is updated with
    what the agent claims, so a failure is reported with the best identity there is.
    """
    info = await _get(client, f"{url}/v1/info", {}, timeout_s, retries)
    ident = identity_of(info, "/v1/info")
    check_expected(ident, dict(known), "/v1/info")
    known.update(ident)
    body = await _get(client, f"{url}/v1/digests", {"name": name} if name is not None else {}, timeout_s, retries, _ACCEPT)
    try:
        table = table_of_body(body)
    except WireError as e:
        raise Failed(f"/v1/digests {e}") from None
    wrong = wrong_identity(table, ident, KEY)
    if wrong is not None:
        raise Failed(f"/v1/digests rows claim {wrong[0]}={wrong[1]!r} but the rank's info says {wrong[0]}={ident.get(wrong[0])!r}")
    if (why := count_mismatch(info, table.count, name is not None, "/v1/info", "/v1/digests")) is not None:
        raise Failed(why)
    if (why := empty_reason(info, table.count, name is not None)) is not None:
        raise Empty(why)
    return url, ident, info, table


def _client(client: Any, transport: Any, timeout_s: float) -> tuple[httpx.AsyncClient, bool]:
    if client is not None and transport is not None:
        raise ValueError("give client or transport, not both")
    if client is not None:
        return client, False
    return httpx.AsyncClient(transport=transport, timeout=timeout_s), True


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
    retried ``retries`` times on connection errors, timeouts and 5xx. ``name`` is an RE2
    pattern the agents filter parameter names by. Never raises for a rank that fails:
    see :class:`FetchResult`.
    """
    timeout_s, retries = check_deadline(timeout_s, retries)
    name_filter(name)  # a bad pattern is the caller's error, named here, not one failure per rank
    targets, knowns = normalize(urls)
    http, own = _client(client, transport, timeout_s)
    try:
        outcomes = await asyncio.gather(
            *(_fetch_one(http, u, name, timeout_s, retries, k) for u, k in zip(targets, knowns)), return_exceptions=True
        )
    finally:
        if own:
            await http.aclose()
    failed: list[dict[str, Any]] = []
    collected = []
    for url, known, outcome in zip(targets, knowns, outcomes):
        if isinstance(outcome, BaseException):
            if not isinstance(outcome, Exception):  # cancellation, KeyboardInterrupt: not ours to swallow
                raise outcome
            message = str(outcome) if isinstance(outcome, (Unreachable, Failed)) else one_line(outcome)
            failed.append({"url": url, "kind": kind_of(outcome), "error": message, **known})
        else:
            collected.append(outcome)
    return assemble_tables(collected, failed, "/v1/digests", filtered=name is not None, targets=targets)


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


async def fetch_infos_async(
    urls: Targets, *, client: httpx.AsyncClient | None = None, transport: httpx.AsyncBaseTransport | None = None, timeout_s: float = 10.0
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Each agent's ``/v1/info`` now (who it is, whether it allows mutations), or why there is none; all at once, one
    try each (a fleet of silent ranks costs one timeout). ``client``/``transport`` as for :func:`fetch_agents`."""
    timeout_s, _ = check_deadline(timeout_s)
    targets, _ = normalize(urls)
    http, own = _client(client, transport, timeout_s)
    try:
        outcomes = await asyncio.gather(*(_get(http, f"{u}/v1/info", {}, timeout_s, 0) for u in targets), return_exceptions=True)
    finally:
        if own:
            await http.aclose()
    infos: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for url, outcome in zip(targets, outcomes):
        if isinstance(outcome, BaseException):
            if not isinstance(outcome, Exception):  # cancellation, KeyboardInterrupt: not ours to swallow
                raise outcome
            errors[url] = str(outcome) if isinstance(outcome, (Unreachable, Failed)) else one_line(outcome)
        elif not isinstance(outcome, dict):
            errors[url] = "/v1/info is not an object"
        else:
            infos[url] = outcome
    return infos, errors


def fetch_infos(
    urls: Targets, *, client: httpx.AsyncClient | None = None, transport: httpx.AsyncBaseTransport | None = None, timeout_s: float = 10.0
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Blocking :func:`fetch_infos_async` (same arguments): a Jupyter kernel can call it anywhere (without a client)."""
    found: tuple[dict[str, dict[str, Any]], dict[str, str]] = _blocking(
        "fetch_infos", fetch_infos_async, urls, client=client, transport=transport, timeout_s=timeout_s
    )
    return found


async def _post(client: httpx.AsyncClient, url: str, action: str, token: str | None, timeout_s: float) -> dict[str, Any]:
    """POST one mutation, once: a reset or reload is not retried behind the caller's back."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = await asyncio.wait_for(client.post(f"{url}/v1/{action}", headers=headers, timeout=timeout_s), timeout_s)
    except (httpx.ConnectError, httpx.LocalProtocolError, UnicodeEncodeError) as e:  # never sent: the action did not run
        raise NotDelivered(one_line(e)) from None
    except (httpx.TransportError, asyncio.TimeoutError) as e:
        raise Unreachable(one_line(e) if not isinstance(e, asyncio.TimeoutError) else f"timed out after {timeout_s} s") from None
    if 400 <= resp.status_code < 500:
        raise Refused(f"HTTP {resp.status_code}: {message_of(resp)}")
    if resp.status_code != 200:
        raise Failed(f"HTTP {resp.status_code}: {message_of(resp)}")
    try:
        body = resp.json()
    except ValueError:
        raise Failed(f"{url} did not answer JSON") from None
    if not isinstance(body, dict) or body.get("ok") is not True:
        raise Failed(f"{action} was not acknowledged: {str(body)[:200]}")
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
    ``errors`` (``unreachable`` marks those that gave no HTTP answer at all, ``not_run``
    those where the action certainly did not run).
    """
    if action not in ("snapshot", "reset", "reload"):
        raise ValueError(f"unknown action {action!r}; choose snapshot, reset or reload")
    token = check_token(token)  # before any rank is touched
    timeout_s, _ = check_deadline(timeout_s)
    targets, _ = normalize(urls)
    http, own = _client(client, transport, timeout_s)
    try:
        outcomes = await asyncio.gather(*(_post(http, u, action, token, timeout_s) for u in targets), return_exceptions=True)
    finally:
        if own:
            await http.aclose()
    result = ActionResult(action, targets)
    for url, outcome in zip(targets, outcomes):
        if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
            raise outcome
        result.record(url, outcome)
    return result


def act(urls: Targets, action: str, **kwargs: Any) -> ActionResult:
    """Blocking :func:`act_agents` (same arguments)."""
    return _blocking("act", act_agents, urls, action, **kwargs)
