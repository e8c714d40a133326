"""A source over vLLM: every worker's digests through ``collective_rpc``.

The workers run :class:`wcviz.integrations.vllm.WcvizWorkerExtension` (vLLM's
``worker_extension_cls``). Two ways to reach them:

- :func:`from_vllm_http` - a running server's dev-mode ``POST /collective_rpc``
  (``VLLM_SERVER_DEV_MODE=1``), request ``{"method": ..., "args": [str, ...],
  "kwargs": {str: str}, "timeout": seconds}``, answer ``{"results": [one per worker]}``;
- :func:`from_vllm_llm` - an in-process ``vllm.LLM`` (``llm.collective_rpc(method,
  timeout=..., args=(...), kwargs={...})`` returns the list of per-worker results).

Both ask ``wcviz_info`` first, then ``wcviz_digests``. Rank identity comes from each
worker's own answer (its info travels with its rows), never from the position in the
results list. Every worker is accounted for, as in :func:`wcviz.sources.fetch`: its rows
go to :attr:`FetchResult.frame`, or it gets a row in :attr:`FetchResult.failed` (with
the identity ``wcviz_info`` gave, when it gave one). The ``url`` column holds a label
per worker, ``<where> rank <N>``.

This module also holds the pieces the other engine sources (SGLang, Ray) share: the
:class:`EngineEndpointError` and the assembly of a :class:`FetchResult` from per-rank
outcomes.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
import pandas as pd

from wcviz._errors import TableError, WcvizError
from wcviz.digest import DEFAULT_ALGO
from wcviz.frame import IDENTITY, make_frame, validate
from wcviz.sources._http import _KEY, FAILED_COLUMNS, FetchResult, _Failed, _message, _short, empty_reason

__all__ = ["EngineEndpointError", "from_vllm_http", "from_vllm_llm", "vllm_collective_rpc"]

EXTENSION = "wcviz.integrations.vllm.WcvizWorkerExtension"
_GRACE_S = 5.0  # the HTTP wait beyond the RPC's own timeout, so vLLM's timeout error comes through
_BACKOFF_S = 0.1


class EngineEndpointError(WcvizError, RuntimeError):
    """An engine endpoint is missing, unreachable or answered an error for the whole engine.

    ``kind`` is ``missing`` (the route does not exist: a configuration to fix),
    ``unreachable`` (no HTTP answer) or ``failed`` (an error answer, a malformed body).
    """

    def __init__(self, message: str, kind: str = "failed") -> None:
        super().__init__(message)
        self.kind = kind


# --------------------------------------------------------------------------- shared assembly


def _identity_of(info: Any, what: str) -> dict[str, Any]:
    """The identity a worker's info claims (role, rank, dp, pp, tp, ep, host), or ``_Failed``."""
    if not isinstance(info, dict):
        raise _Failed(f"{what} answered {str(info)[:200]!r}, not a worker's info")
    if info.get("rank") is None and "error" in info:
        raise _Failed(f"{what} answered an error: {info['error']}")
    if not isinstance(info.get("role"), str) or not isinstance(info.get("rank"), int) or isinstance(info.get("rank"), bool):
        raise _Failed(f"{what} is not a worker's info (needs a role and an integer rank): {str(info)[:200]}")
    for k in ("dp", "pp", "tp", "ep"):
        if info.get(k) is not None and (not isinstance(info[k], int) or isinstance(info[k], bool)):
            raise _Failed(f"{what} has a non-integer {k}: {info[k]!r}")
    return {k: info.get(k) for k in ("role", "rank", "dp", "pp", "tp", "ep", "host")}


def _rows_frame(rows: Any, ident: Mapping[str, Any], label: str, what: str) -> pd.DataFrame:
    """Rows as a schema-valid frame that carries exactly ``ident``, with a ``url`` column."""
    if isinstance(rows, pd.DataFrame):
        rows = rows.to_dict(orient="records")
    if not isinstance(rows, list) or not all(isinstance(r, Mapping) for r in rows):
        raise _Failed(f"{what} did not give a list of row dicts: {str(rows)[:200]}")
    try:
        frame = make_frame(rows)
    except TableError as e:
        raise _Failed(f"{what} is not a digest table: {e}") from None
    for k in _KEY:
        want = ident.get(k)
        col = frame[k]
        wrong = col.notna() if want is None else (col.isna() | (col != want))
        if bool(wrong.any()):
            raise _Failed(f"{what} rows claim {k}={col[wrong].iloc[0]!r} but the worker's info says {k}={want!r}")
    frame["url"] = label
    return frame


def _rank_label(where: str, ident: Mapping[str, Any]) -> str:
    if ident.get("rank") is not None:
        return f"{where} rank {ident['rank']}"
    coords = " ".join(f"{k}={ident[k]}" for k in ("dp", "pp", "tp", "ep") if ident.get(k) is not None)
    return f"{where} {coords}" if coords else where


def _key(ident: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(ident.get(k) for k in _KEY)


def _sortable(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """An identity key that sorts with None last (role, then rank, dp, pp, tp, ep)."""
    return tuple((v is None, v if v is not None else 0) for v in key)


def _assemble(
    collected: Sequence[tuple[str, dict[str, Any], dict[str, Any], pd.DataFrame]],
    failed: Sequence[dict[str, Any]],
    *,
    filtered: bool = False,
) -> FetchResult:
    """A :class:`FetchResult` from ``(label, identity, info, frame)`` of the ranks collected and
    failure rows (``url``, ``kind``, ``error`` and the identity known); two claims of one rank
    fail both, and a rank with no parameters is ``empty`` (``filtered``: the rows were filtered
    by name, so no rows alone does not make a rank empty). Labels given twice get `` #1``,
    `` #2``, so each names one target."""
    failures = [dict(f) for f in failed]
    kept_collected = []
    for label, ident, info, frame in collected:
        why = empty_reason(info, len(frame), filtered)
        if why is None:
            kept_collected.append((label, ident, info, frame))
        else:
            failures.append({"url": label, "kind": "empty", "error": why, **ident})
    collected = kept_collected
    kept: list[tuple[str, dict[str, Any], pd.DataFrame]] = []
    by_key: dict[tuple[Any, ...], list[tuple[str, dict[str, Any], dict[str, Any], pd.DataFrame]]] = {}
    for item in collected:
        by_key.setdefault(_key(item[1]), []).append(item)
    for key, claims in sorted(by_key.items(), key=lambda kv: _sortable(kv[0])):
        if len(claims) > 1:  # neither can be trusted to be that rank
            rank = ", ".join(f"{k}={v}" for k, v in zip(_KEY, key) if v is not None)
            for label, ident, _, _ in claims:
                failures.append({"url": label, "kind": "failed", "error": f"{len(claims)} answers claim the same rank ({rank})", **ident})
            continue
        label, _, info, frame = claims[0]
        kept.append((label, info, frame))

    counts = Counter([lb for lb, _, _ in kept] + [str(f["url"]) for f in failures])
    seen: Counter[str] = Counter()

    def unique(label: str) -> str:
        if counts[label] == 1:
            return label
        seen[label] += 1
        return f"{label} #{seen[label]}"

    kept = [(unique(lb), info, frame) for lb, info, frame in kept]
    for f in failures:
        f["url"] = unique(str(f["url"]))
    frames = []
    for label, _, frame in kept:
        frame["url"] = label
        if len(frame):
            frames.append(frame)
    if frames:  # ordered by rank identity, never by arrival
        frame = pd.concat(frames, ignore_index=True).sort_values(list(_KEY), kind="stable", na_position="last")
        frame = validate(frame.reset_index(drop=True), source="engine")
    else:
        frame = make_frame([])
        frame["url"] = pd.Series(dtype="string")
    frame["url"] = frame["url"].astype("string")

    failures.sort(key=lambda row: (_sortable(_key(row)), str(row["url"])))
    failed_frame = pd.DataFrame([{c: row.get(c) for c in FAILED_COLUMNS} for row in failures], columns=list(FAILED_COLUMNS))
    for c in FAILED_COLUMNS:
        failed_frame[c] = failed_frame[c].astype("Int64" if c in IDENTITY else "string")
    return FetchResult(
        urls=tuple([lb for lb, _, _ in kept] + [str(f["url"]) for f in failures]),
        frame=frame,
        failed=failed_frame,
        errors={str(f["url"]): str(f["error"]) for f in failures},
        infos={lb: info for lb, info, _ in kept},
    )


# --------------------------------------------------------------------------- vLLM


def _check_strings(method: Any, args: Any, kwargs: Any) -> None:
    """vLLM's HTTP /collective_rpc passes strings only: refuse anything else here, clearly."""
    if not isinstance(method, str) or not method:
        raise TypeError(f"method must be a non-empty string, got {type(method).__name__} {method!r}")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"args must be a list or tuple of strings, got {type(args).__name__} {args!r}")
    for i, a in enumerate(args):
        if not isinstance(a, str):
            raise TypeError(
                f"vLLM's /collective_rpc passes strings only, but args[{i}] is {type(a).__name__} {a!r}; "
                f"send {str(a)!r} and parse it in the worker method"
            )
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a mapping of strings to strings, got {type(kwargs).__name__}")
    for k, v in kwargs.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(
                f"vLLM's /collective_rpc passes strings only, but kwargs[{k!r}] is {type(v).__name__} {v!r}; "
                f"send {str(v)!r} and parse it in the worker method"
            )


def vllm_collective_rpc(
    base_url: str,
    method: str,
    args: Sequence[str] = (),
    kwargs: Mapping[str, str] | None = None,
    *,
    client: httpx.Client | None = None,
    transport: httpx.BaseTransport | None = None,
    timeout_s: float = 60.0,
    retries: int = 0,
) -> list[Any]:
    """Call ``method`` on every worker of the vLLM server at ``base_url``; the per-worker results.

    Posts ``{"method", "args", "kwargs", "timeout": timeout_s}`` to ``/collective_rpc``
    (served only with ``VLLM_SERVER_DEV_MODE=1``). ``args`` and ``kwargs`` values must be
    strings, as vLLM's endpoint passes nothing else: anything else is refused here with a
    ``TypeError``. ``retries`` re-sends after a connection error only (default 0: a
    mutation is never repeated behind the caller's back). Raises
    :class:`EngineEndpointError` (``kind`` missing, unreachable or failed) for the whole call.
    """
    kwargs = {} if kwargs is None else kwargs
    _check_strings(method, args, kwargs)
    if timeout_s <= 0 or retries < 0:
        raise ValueError("timeout_s must be > 0 and retries >= 0")
    if client is not None and transport is not None:
        raise ValueError("give client or transport, not both")
    url = f"{str(base_url).rstrip('/')}/collective_rpc"
    body = {"method": method, "args": list(args), "kwargs": dict(kwargs), "timeout": timeout_s}
    own = client is None
    http = client if client is not None else httpx.Client(transport=transport)
    try:
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(_BACKOFF_S * 2 ** (attempt - 1))
            try:
                resp = http.post(url, json=body, timeout=timeout_s + _GRACE_S)
                break
            except httpx.TimeoutException as e:
                raise EngineEndpointError(f"POST {url} ({method}) got no answer within {timeout_s + _GRACE_S} s", "unreachable") from e
            except httpx.TransportError as e:
                if attempt == retries:
                    raise EngineEndpointError(f"POST {url} ({method}): {_short(e)}", "unreachable") from e
    finally:
        if own:
            http.close()
    if resp.status_code == 404:
        raise EngineEndpointError(
            f"POST {url} answered 404: vLLM serves /collective_rpc only in dev mode; restart the server "
            f"with VLLM_SERVER_DEV_MODE=1 (and --worker-extension-cls {EXTENSION})",
            "missing",
        )
    if resp.status_code != 200:
        raise EngineEndpointError(f"collective_rpc {method!r} failed for the whole engine: HTTP {resp.status_code}: {_message(resp)}")
    try:
        answer = resp.json()
    except ValueError:
        raise EngineEndpointError(f"collective_rpc {method!r} did not answer JSON: {resp.text[:200]!r}") from None
    results = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(results, list):
        raise EngineEndpointError(f"collective_rpc {method!r} did not answer {{'results': [...]}}: {str(answer)[:200]}")
    return results


Call = Callable[[str, dict[str, str]], list[Any]]


def _hint(method: str, e: BaseException) -> str:
    return f"collective_rpc {method!r} failed for the whole engine: {e if isinstance(e, EngineEndpointError) else _short(e)}"


def _collect(call: Call, where: str, kwargs: dict[str, str], name: str | None) -> FetchResult:
    """``wcviz_info`` then ``wcviz_digests`` on every worker; see the module doc."""
    try:
        infos = call("wcviz_info", {})
    except EngineEndpointError as e:
        if e.kind == "missing":
            raise
        msg = _hint("wcviz_info", e) + (f" (are the workers started with worker_extension_cls={EXTENSION}?)" if e.kind == "failed" else "")
        return _assemble([], [{"url": where, "kind": e.kind, "error": msg}])
    except Exception as e:  # noqa: BLE001 - in-process: any worker error fails the whole call
        kind = "unreachable" if isinstance(e, TimeoutError) else "failed"
        msg = _hint("wcviz_info", e) + (f" (are the workers started with worker_extension_cls={EXTENSION}?)" if kind == "failed" else "")
        return _assemble([], [{"url": where, "kind": kind, "error": msg}])
    if not isinstance(infos, list):
        return _assemble([], [{"url": where, "kind": "failed", "error": f"collective_rpc 'wcviz_info' did not give a list: {str(infos)[:200]}"}])

    failed: list[dict[str, Any]] = []
    known: list[dict[str, Any]] = []  # the identities wcviz_info gave (duplicates fail later, in _assemble)
    for i, info in enumerate(infos):
        try:
            known.append(_identity_of(info, "wcviz_info"))
        except _Failed as e:
            failed.append({"url": f"{where} worker result {i}", "kind": "failed", "error": str(e)})

    try:
        results = call("wcviz_digests", kwargs)
    except Exception as e:  # the whole call failed: every worker wcviz_info named fails with it
        if isinstance(e, EngineEndpointError) and e.kind == "missing":
            raise
        kind = e.kind if isinstance(e, EngineEndpointError) else "unreachable" if isinstance(e, TimeoutError) else "failed"
        rows = [{"url": _rank_label(where, ident), "kind": kind, "error": _hint("wcviz_digests", e), **ident} for ident in known]
        rows = rows or [{"url": where, "kind": kind, "error": _hint("wcviz_digests", e)}]
        return _assemble([], failed + rows + _never_reached(where, infos, known))
    if not isinstance(results, list):
        results = [results]

    listed = {_key(ident) for ident in known}
    collected = []
    answered: set[tuple[Any, ...]] = set()
    for i, res in enumerate(results):
        ident: dict[str, Any] = {}
        label = f"{where} worker result {i}"
        try:
            if not isinstance(res, dict) or not isinstance(res.get("info"), dict):
                raise _Failed(f"wcviz_digests answered {str(res)[:200]!r}, not {{'info': ..., 'rows': [...]}}")
            ident = _identity_of(res["info"], "wcviz_digests")
            label = _rank_label(where, ident)
            answered.add(_key(ident))
            if _key(ident) not in listed:
                raise _Failed("answered wcviz_digests but was not among the workers wcviz_info listed")
            if "error" in res:
                raise _Failed(f"wcviz_digests failed on this worker: {res['error']}")
            frame = _rows_frame(res.get("rows"), ident, label, "wcviz_digests")
            params = res["info"].get("params")
            if name is None and isinstance(params, int) and len(frame) != params:
                raise _Failed(f"the worker counts {params} parameters but wcviz_digests gave {len(frame)} rows")
            collected.append((label, ident, res["info"], frame))
        except _Failed as e:
            failed.append({"url": label, "kind": "failed", "error": str(e), **ident})
    for ident in known:
        if _key(ident) not in answered:
            failed.append({"url": _rank_label(where, ident), "kind": "failed", "error": "gave wcviz_info but no wcviz_digests result", **ident})
    failed += _never_reached(where, infos, known)
    return _assemble(collected, failed, filtered=name is not None)


def _never_reached(where: str, infos: list[Any], known: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ranks below the workers' ``world_size`` that no worker claimed: collective_rpc never reached them."""
    sizes = {i["world_size"] for i in infos if isinstance(i, dict) and isinstance(i.get("world_size"), int)}
    if not sizes:
        return []
    world = max(sizes)
    seen = {ident["rank"] for ident in known}
    roles = {ident["role"] for ident in known}
    role = roles.pop() if len(roles) == 1 else None
    msg = f"no answer: the workers' world_size is {world} but collective_rpc reached {len(seen)} of them"
    return [{"url": f"{where} rank {r}", "kind": "unreachable", "error": msg, "role": role, "rank": r} for r in range(world) if r not in seen]


def _digest_kwargs(name: str | None, algo: str, phase: str) -> dict[str, str]:
    for label, value in (("algo", algo), ("phase", phase)):
        if not isinstance(value, str):
            raise TypeError(f"{label} must be a string, got {type(value).__name__}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a regex string or None, got {type(name).__name__}")
    kwargs = {"algo": algo, "phase": phase}
    if name is not None:
        kwargs["name_regex"] = name
    return kwargs


def from_vllm_http(
    base_url: str,
    *,
    client: httpx.Client | None = None,
    transport: httpx.BaseTransport | None = None,
    timeout_s: float = 60.0,
    retries: int = 2,
    name: str | None = None,
    algo: str = DEFAULT_ALGO,
    phase: str = "current",
) -> FetchResult:
    """Every worker's digests from the vLLM server at ``base_url`` (dev-mode ``/collective_rpc``).

    ``name`` is a regex the workers filter parameter names by; ``algo`` and ``phase`` are
    stamped by the workers. ``timeout_s`` bounds each RPC (vLLM's own ``timeout``; the
    HTTP wait adds a few seconds), and connection errors are retried ``retries`` times.
    Raises :class:`EngineEndpointError` only when the endpoint is missing (404: dev mode
    off); every other failure is reported per worker (see :class:`FetchResult`).
    """
    kwargs = _digest_kwargs(name, algo, phase)
    base = str(base_url).rstrip("/")
    if client is not None and transport is not None:
        raise ValueError("give client or transport, not both")
    own = client is None
    http = client if client is not None else httpx.Client(transport=transport)
    try:

        def call(method: str, kw: dict[str, str]) -> list[Any]:
            return vllm_collective_rpc(base, method, (), kw, client=http, timeout_s=timeout_s, retries=retries)

        return _collect(call, base, kwargs, name)
    finally:
        if own:
            http.close()


def from_vllm_llm(
    llm: Any,
    *,
    timeout_s: float | None = None,
    name: str | None = None,
    algo: str = DEFAULT_ALGO,
    phase: str = "current",
    where: str = "vllm",
) -> FetchResult:
    """Every worker's digests from an in-process ``vllm.LLM`` (anything with vLLM's
    ``collective_rpc(method, timeout=None, args=(), kwargs=None)``); see :func:`from_vllm_http`.

    ``where`` prefixes each worker's label in the ``url`` column.
    """
    rpc = getattr(llm, "collective_rpc", None)
    if not callable(rpc):
        raise TypeError(f"from_vllm_llm needs a vllm.LLM (something with collective_rpc), got {type(llm).__name__}")
    kwargs = _digest_kwargs(name, algo, phase)

    def call(method: str, kw: dict[str, str]) -> list[Any]:
        return list(rpc(method, timeout=timeout_s, args=(), kwargs=kw))

    return _collect(call, where, kwargs, name)
