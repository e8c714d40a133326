"""A source over vLLM: every worker's digests through ``collective_rpc``.

The workers run :class:`wcviz.integrations.vllm.WcvizWorkerExtension` (vLLM's
``worker_extension_cls``). Two ways to reach them:

- :func:`from_vllm_http` - a running server's dev-mode ``POST /collective_rpc``
  (``VLLM_SERVER_DEV_MODE=1``), request ``{"method": ..., "args": [str, ...],
  "kwargs": {str: str}, "timeout": seconds}``, answer ``{"results": [one per worker]}``;
- :func:`from_vllm_llm` - an in-process ``vllm.LLM`` (``llm.collective_rpc(method,
  timeout=..., args=(...), kwargs={...})`` returns the list of per-worker results).

Both ask ``wcviz_info`` first, then ``wcviz_digests``, and count the ranks the way the
engine's front end does (``GET /get_world_size?include_dp=true|false``, or
``llm.get_world_size(include_dp=...)``). That count is what makes a result complete: with
dense data parallelism each replica's workers are reconfigured as if they were alone
(vLLM 0.33 ``v1/engine/core.py``: ``reconfigure_for_independent_dp_rank`` sets their
``data_parallel_size`` to 1), so no worker knows the other replicas exist, and
``collective_rpc`` answers for DP engine 0 only. Every rank the count names and no
worker answered for is a row of :attr:`FetchResult.failed`; a count that cannot be read
is one too (never a silent pass). Rank identity comes from each
worker's own answer (its info travels with its rows), never from the position in the
results list. Every worker is accounted for, as in :func:`wcviz.sources.fetch`: its rows
go to :attr:`FetchResult.frame`, or it gets a row in :attr:`FetchResult.failed` (with
the identity ``wcviz_info`` gave, when it gave one). The ``url`` column holds a label
per worker, ``<where> rank <N>``.

Everything an answer must be, and the :class:`FetchResult` built from the answers, is
:mod:`wcviz.sources._fleet`'s; :class:`EngineEndpointError` (an engine endpoint that
fails as a whole) is shared with the SGLang source.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from wcviz._errors import WcvizError, check_deadline
from wcviz._text import one_line
from wcviz.digest import DEFAULT_ALGO
from wcviz.frame import IDENTITY
from wcviz.sources._fleet import (
    Failed,
    FetchResult,
    assemble,
    backoff_s,
    count_mismatch,
    identity_of,
    key_of,
    message_of,
    rows_frame,
)

__all__ = ["EngineEndpointError", "from_vllm_http", "from_vllm_llm", "vllm_collective_rpc"]

EXTENSION = "wcviz.integrations.vllm.WcvizWorkerExtension"
_VERSION = "0.33"  # the vLLM release the shapes here were read from
_GRACE_S = 5.0  # the HTTP wait beyond the RPC's own timeout, so vLLM's timeout error comes through


class EngineEndpointError(WcvizError, RuntimeError):
    """An engine endpoint is missing, unreachable or answered an error for the whole engine.

    ``kind`` is ``missing`` (the route does not exist: a configuration to fix),
    ``unreachable`` (no HTTP answer) or ``failed`` (an error answer, a malformed body).
    """

    def __init__(self, message: str, kind: str = "failed") -> None:
        super().__init__(message)
        self.kind = kind


def target_label(where: str, ident: Mapping[str, Any]) -> str:
    """``<where> rank N`` (or ``<where> dp=0 tp=1 ...`` without a rank): names one rank behind one endpoint."""
    if ident.get("rank") is not None:
        return f"{where} rank {ident['rank']}"
    coords = " ".join(f"{k}={ident[k]}" for k in IDENTITY[1:] if ident.get(k) is not None)
    return f"{where} {coords}" if coords else where


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
    mutation is never repeated behind the caller's back). Each try, answer read whole, ends
    within ``timeout_s`` plus a few seconds' grace, however slowly the server answers. Raises
    :class:`EngineEndpointError` (``kind`` missing, unreachable or failed) for the whole call.
    """
    kwargs = {} if kwargs is None else kwargs
    _check_strings(method, args, kwargs)
    timeout_s, retries = check_deadline(timeout_s, retries)
    if client is not None and transport is not None:
        raise ValueError("give client or transport, not both")
    from wcviz.sources._engine_http import json_of, send  # (that module builds on this one)

    url = f"{str(base_url).rstrip('/')}/collective_rpc"
    body = {"method": method, "args": list(args), "kwargs": dict(kwargs), "timeout": timeout_s}
    own = client is None
    http = client if client is not None else httpx.Client(transport=transport)
    try:
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(backoff_s(attempt))
            try:  # the whole exchange within the RPC's timeout and the grace: a dripping answer cannot hold the caller
                resp = send(http, "POST", url, what=f"collective_rpc {method!r}", body=body, timeout_s=timeout_s + _GRACE_S)
                break
            except httpx.TimeoutException as e:
                raise EngineEndpointError(f"POST {url} ({method}) gave no whole answer within {timeout_s + _GRACE_S} s", "unreachable") from e
            except httpx.TransportError as e:
                if attempt == retries:
                    raise EngineEndpointError(f"POST {url} ({method}): {one_line(e)}", "unreachable") from e
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
        raise EngineEndpointError(f"collective_rpc {method!r} failed for the whole engine: HTTP {resp.status_code}: {message_of(resp)}")
    answer = json_of(resp, f"POST {url} (collective_rpc {method!r})")
    results = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(results, list):
        raise EngineEndpointError(f"collective_rpc {method!r} did not answer {{'results': [...]}}: {str(answer)[:200]}")
    return results


Call = Callable[[str, dict[str, str]], list[Any]]


def _hint(method: str, e: BaseException) -> str:
    return f"collective_rpc {method!r} failed for the whole engine: {e if isinstance(e, EngineEndpointError) else one_line(e)}"


def _checked_sizes(across: Any, replica: Any, what: str) -> tuple[int, int] | str:
    """``(ranks across DP, ranks per replica)`` as the engine's front end counts them, or why they are unusable."""
    for n in (across, replica):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            return f"{what} gave {across!r} across data-parallel replicas and {replica!r} per replica, not positive ints"
    if across % replica:
        return f"{what} gave {across} ranks across data-parallel replicas, not a multiple of its {replica} per replica"
    return across, replica


def _http_sizes(base: str, http: httpx.Client, timeout_s: float) -> tuple[int, int] | str:
    """vLLM 0.33's dev-mode ``GET /get_world_size`` (served by the API server, whose config no replica reconfigures)."""
    from wcviz.sources._vllm_checker import vllm_world_size  # (that module builds on this one)

    try:
        across = vllm_world_size(base, include_dp=True, client=http, timeout_s=timeout_s)
        replica = vllm_world_size(base, include_dp=False, client=http, timeout_s=timeout_s)
    except EngineEndpointError as e:
        return str(e)
    return _checked_sizes(across, replica, f"GET {base}/get_world_size")


def _llm_sizes(llm: Any) -> tuple[int, int] | str:
    """``vllm.LLM.get_world_size(include_dp=True|False)`` (vLLM 0.33 ``entrypoints/llm.py``)."""
    get = getattr(llm, "get_world_size", None)
    if not callable(get):
        return f"{type(llm).__name__} has no get_world_size(include_dp=...), which vllm.LLM {_VERSION} has"
    try:
        across, replica = get(include_dp=True), get(include_dp=False)
    except Exception as e:  # noqa: BLE001 - reported as an incomplete result, never raised into the caller's job
        return f"get_world_size failed: {one_line(e)}"
    return _checked_sizes(across, replica, "get_world_size")


def _timed_out(e: BaseException) -> bool:
    """Whether an in-process ``collective_rpc`` failed by a timeout: a TimeoutError with the in-process engine client;
    with vLLM 0.33's default multiprocessing client, the executor's TimeoutError (``multiproc_executor.py``: "RPC call
    to ... timed out.") reaches us re-raised as a plain Exception ("Call to collective_rpc method failed: ...",
    ``v1/engine/core.py`` ``_invoke_utility_method``)."""
    said = str(e)
    return isinstance(e, TimeoutError) or (said.startswith("Call to collective_rpc method failed:") and "timed out" in said)


def _collect(call: Call, where: str, kwargs: dict[str, str], name: str | None, count: Callable[[], tuple[int, int] | str]) -> FetchResult:
    """``wcviz_info`` then ``wcviz_digests`` on every worker; every rank ``count()`` names accounted for (module
    doc). ``count`` is asked once the workers answered ``wcviz_info``: an engine that is down is one row."""
    try:
        infos = call("wcviz_info", {})
    except EngineEndpointError as e:
        if e.kind == "missing":
            raise
        msg = _hint("wcviz_info", e) + (f" (are the workers started with worker_extension_cls={EXTENSION}?)" if e.kind == "failed" else "")
        return assemble([], [{"url": where, "kind": e.kind, "error": msg}])
    except Exception as e:  # noqa: BLE001 - in-process: any worker error fails the whole call
        kind = "unreachable" if _timed_out(e) else "failed"
        msg = _hint("wcviz_info", e) + (f" (are the workers started with worker_extension_cls={EXTENSION}?)" if kind == "failed" else "")
        return assemble([], [{"url": where, "kind": kind, "error": msg}])
    if not isinstance(infos, list):
        return assemble([], [{"url": where, "kind": "failed", "error": f"collective_rpc 'wcviz_info' did not give a list: {str(infos)[:200]}"}])

    sizes = count()
    failed: list[dict[str, Any]] = []
    known: list[dict[str, Any]] = []  # the identities wcviz_info gave (duplicates fail later, in assemble)
    for i, info in enumerate(infos):
        try:
            known.append(identity_of(info, "wcviz_info"))
        except Failed as e:
            failed.append({"url": f"{where} worker result {i}", "kind": "failed", "error": str(e)})

    try:
        results = call("wcviz_digests", kwargs)
    except Exception as e:  # the whole call failed: every worker wcviz_info named fails with it
        if isinstance(e, EngineEndpointError) and e.kind == "missing":
            raise
        kind = e.kind if isinstance(e, EngineEndpointError) else "unreachable" if _timed_out(e) else "failed"
        rows = [{"url": target_label(where, ident), "kind": kind, "error": _hint("wcviz_digests", e), **ident} for ident in known]
        rows = rows or [{"url": where, "kind": kind, "error": _hint("wcviz_digests", e)}]
        return assemble([], failed + rows + _never_reached(where, infos, known, sizes))
    if not isinstance(results, list):
        results = [results]

    listed = {key_of(ident) for ident in known}
    collected = []
    answered: set[tuple[Any, ...]] = set()
    for i, res in enumerate(results):
        ident: dict[str, Any] = {}
        label = f"{where} worker result {i}"
        try:
            if not isinstance(res, dict) or not isinstance(res.get("info"), dict):
                raise Failed(f"wcviz_digests answered {str(res)[:200]!r}, not {{'info': ..., 'rows': [...]}}")
            ident = identity_of(res["info"], "wcviz_digests")
            label = target_label(where, ident)
            answered.add(key_of(ident))
            if key_of(ident) not in listed:
                raise Failed("answered wcviz_digests but was not among the workers wcviz_info listed")
            if "error" in res:
                raise Failed(f"wcviz_digests failed on this worker: {res['error']}")
            frame = rows_frame(res.get("rows"), ident, label, "wcviz_digests")
            why = count_mismatch(res["info"], len(frame), name is not None, "the worker", "wcviz_digests")
            if why is not None:
                raise Failed(why)
            collected.append((label, ident, res["info"], frame))
        except Failed as e:
            failed.append({"url": label, "kind": "failed", "error": str(e), **ident})
    for ident in known:
        if key_of(ident) not in answered:
            failed.append({"url": target_label(where, ident), "kind": "failed", "error": "gave wcviz_info but no wcviz_digests result", **ident})
    failed += _never_reached(where, infos, known, sizes)
    return assemble(collected, failed, filtered=name is not None)


def _never_reached(where: str, infos: list[Any], known: list[dict[str, Any]], sizes: tuple[int, int] | str) -> list[dict[str, Any]]:
    """Ranks the engine counts that no worker claimed: collective_rpc never reached them.

    The count is the larger of the workers' own ``world_size`` and the front end's
    ``sizes``. With data parallelism the usual cause is vLLM itself: its
    ``collective_rpc`` answers with DP engine 0's workers only, so the other replicas'
    ranks are named with their ``dp`` and that reason. ``sizes`` that could not be read
    make one row of their own: without them, the other replicas cannot be counted.
    """
    good = [i for i in infos if isinstance(i, dict)]
    worlds = {i["world_size"] for i in good if isinstance(i.get("world_size"), int) and not isinstance(i.get("world_size"), bool)}
    dp_sizes = {i["dp_size"] for i in good if isinstance(i.get("dp_size"), int) and not isinstance(i.get("dp_size"), bool)}
    dp_size = max(dp_sizes) if dp_sizes else 1
    if isinstance(sizes, str):
        unknown = [{
            "url": where, "kind": "failed",
            "error": f"cannot count the ranks across data-parallel replicas ({sizes}); vLLM's collective_rpc answers for "
            "DP engine 0 only, so other replicas may be unchecked: from_vllm_weight_checker reaches every replica",
        }]  # fmt: skip
        across = None
    else:
        unknown, (across, per_replica) = [], sizes
        if across // per_replica > 1:
            dp_size = across // per_replica
    world = max(worlds | ({across} if across else set()), default=0)
    if not world:
        return unknown
    seen = {ident["rank"] for ident in known}
    roles = {ident["role"] for ident in known}
    role = roles.pop() if len(roles) == 1 else None
    replica = world // dp_size if dp_size > 1 and world % dp_size == 0 else None
    whence = "the workers' world_size" if across is None or world in worlds else "get_world_size (across data-parallel replicas)"
    msg = f"no answer: {whence} is {world} but collective_rpc reached {len(seen)} of them"
    if replica is not None:
        msg += (
            f"; with data parallelism ({dp_size} replicas) vLLM's collective_rpc returns DP engine 0's workers only "
            "(vLLM 0.33 call_utility_async): from_vllm_weight_checker reaches every replica"
        )
    return unknown + [
        {"url": f"{where} rank {r}", "kind": "unreachable", "error": msg, "role": role, "rank": r, "dp": r // replica if replica else None}
        for r in range(world) if r not in seen
    ]  # fmt: skip


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

    Complete only when every rank the server's ``GET /get_world_size`` counts answered,
    across data-parallel replicas (see the module doc). ``name`` is a regex the workers filter parameter names by; ``algo`` and ``phase`` are
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

        return _collect(call, base, kwargs, name, lambda: _http_sizes(base, http, timeout_s))
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

    The ranks are counted by ``llm.get_world_size(include_dp=True|False)``; an object
    without it gives a result that is not complete, saying why.

    ``where`` prefixes each worker's label in the ``url`` column.
    """
    rpc = getattr(llm, "collective_rpc", None)
    if not callable(rpc):
        raise TypeError(f"from_vllm_llm needs a vllm.LLM (something with collective_rpc), got {type(llm).__name__}")
    kwargs = _digest_kwargs(name, algo, phase)

    def call(method: str, kw: dict[str, str]) -> list[Any]:
        return list(rpc(method, timeout=timeout_s, args=(), kwargs=kw))

    return _collect(call, where, kwargs, name, lambda: _llm_sizes(llm))
