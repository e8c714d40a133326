"""One rank's digests over HTTP: a small Starlette app a trainer or engine rank can host.

The agent never caches: every request calls ``holder()`` and digests the rank's live
weights, so what it reports is what the rank holds at that moment. Endpoints (JSON,
versioned under ``/v1/``):

=====================  =====================================================================
``GET /v1/info``       role, rank, dp, pp, tp, ep, host, device, algo, params, mutations_allowed
``GET /v1/digests``    ``{"rows": [...]}`` in the :mod:`wcviz.frame` schema, or the same
                       table as columns when ``Accept`` names ``COLUMNS_MEDIA_TYPE`` (what
                       :func:`wcviz.sources.fetch_agents` asks for; an older client gets
                       rows); ``?name=REGEX`` keeps the parameters whose name an RE2
                       pattern finds a match in (linear time, at most 512 characters:
                       :mod:`wcviz._names`)
``POST /v1/snapshot``  run the ``snapshot`` callable; likewise ``/v1/reset`` and ``/v1/reload``
=====================  =====================================================================

Mutating endpoints change what the rank holds, so they need two keys: the opt-in at
construction (``allow_mutations=True``, else 403) and ``Authorization: Bearer <token>``
(else 401). Every error is a JSON ``{"error": ...}`` with a 4xx/5xx status; nothing a
client sends can take down the hosting process or the server thread.

Security model, for an agent that lives inside an engine or trainer process:

- **Reads** (``info``, ``digests``) need no token: digests are not secrets, but they
  cost the host CPU, so the name filter runs in bounded time (RE2, no backtracking:
  Python's ``re`` would hold the GIL and freeze every thread of the host).
- **Mutations** need the opt-in at construction *and* the bearer token.
- **Host header**: once served, a request whose ``Host`` is not the bound address,
  a loopback name (``localhost``, ``127.0.0.1``, ``::1``) or one of ``allowed_hosts``
  gets 421: a web page cannot reach the agent through DNS rebinding. (When bound to
  a wildcard address the machine's own host name and addresses are allowed too.)
  ``agent.app`` called in-process (``httpx.ASGITransport``) has no network peer and
  is not checked.
- **Connections**: at most ``max_connections`` at once; a connection must finish its
  request headers within ``header_timeout_s`` (and an idle keep-alive one is closed
  after a few seconds). When the cap is reached, the connection that has waited longest
  without sending a request is dropped for the new one, so clients that never finish
  their headers cannot hold the host's file descriptors or lock real clients out; and a
  client that stops reading its response (none of it taken for 10 s) loses its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import operator
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from wcviz._errors import check_deadline, check_token
from wcviz._names import NameFilterError, name_filter
from wcviz.digest import ALGORITHMS, DEFAULT_ALGO

if TYPE_CHECKING:
    import torch
    import uvicorn

__all__ = ["Agent", "API_VERSION", "MUTATIONS", "LOOPBACK_HOSTS"]

API_VERSION = "v1"
MUTATIONS = ("snapshot", "reset", "reload")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
MAX_CONNECTIONS = 64
HEADER_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 5.0

Holder = Callable[[], "Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]"]
Endpoint = Callable[[Request], Awaitable[JSONResponse]]


class _ClientError(Exception):
    """A request the agent refuses, with the status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _check_params(request: Request, allowed: Iterable[str]) -> None:
    """Refuse query parameters the endpoint does not know (a typo must not be ignored silently), or given twice."""
    unknown = sorted(set(request.query_params) - set(allowed))
    if unknown:
        known = ", ".join(allowed) or "none"
        raise _ClientError(400, f"unknown query parameter(s) {', '.join(unknown)}; allowed: {known}")
    twice = sorted({k for k in request.query_params if len(request.query_params.getlist(k)) > 1})
    if twice:  # which one would count? ``?name=^x$&name=`` must not quietly become "every parameter"
        raise _ClientError(400, f"query parameter(s) {', '.join(twice)} given more than once; give each once")


def _guarded(fn: Endpoint) -> Endpoint:
    """Turn refusals into 4xx JSON and any exception into a 500 JSON naming it."""

    async def endpoint(request: Request) -> JSONResponse:
        try:
            return await fn(request)
        except _ClientError as e:
            return _error(e.status, e.message)
        except Exception as e:  # noqa: BLE001 - the holder, the digest or a callable failed: report, keep serving
            return _error(500, f"{type(e).__name__}: {e}")

    return endpoint


def _host_of(value: str) -> str | None:
    """The host part of a ``Host`` header (``name``, ``name:port``, ``[v6]:port``), lowercase; None if malformed."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6] or [v6]:port
        host, closed, rest = value[1:].partition("]")
        port = rest.removeprefix(":")
        if not host or not closed or (rest and not rest.startswith(":")) or (port and not port.isdigit()):
            return None
        return host
    host, _, port = value.partition(":")
    if port and not port.isdigit():
        return None
    return host.rstrip(".") or None


class _HostGuard:
    """ASGI middleware: refuse (421) a request whose ``Host`` is not one the agent serves.

    ``hosts()`` returns the allowed host names, or None when the agent is not served
    over the network (an in-process transport: nothing to rebind).
    """

    def __init__(self, app: Any, hosts: Callable[[], frozenset[str] | None], stopping: Callable[[], bool] = lambda: False) -> None:
        self.app = app
        self.hosts = hosts
        self.stopping = stopping

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        allowed = self.hosts() if scope["type"] in ("http", "websocket") else None
        if allowed is not None:
            raw = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
            host = _host_of(raw)
            if host is None or host not in allowed:
                shown = raw if len(raw) <= 80 else raw[:77] + "..."
                response = _error(421, f"Host {shown!r} is not served here (allowed: {', '.join(sorted(allowed))}); "
                                       "start the agent with allowed_hosts=[...] to serve another name")  # fmt: skip
                await response(scope, receive, send)
                return
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if not self.stopping():  # a client that gave up (an in-process transport's timeout): cancelled, as asked
                raise
            # the agent's stop cancelled this request: answered, not logged as a crash in the host's log
            with contextlib.suppress(Exception):
                await _error(503, "the agent is stopping")(scope, receive, send)


def _machine_names() -> set[str]:
    """This machine's host name, FQDN and the addresses they resolve to (for an agent bound to a wildcard)."""
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    for name in list(names):
        try:
            names |= {str(info[4][0]).lower() for info in socket.getaddrinfo(name, None)}
        except OSError:
            continue
    return {n for n in names if n}


async def _in_thread(fn: Callable[[], Any]) -> Any:
    """Run blocking work (digesting, a reset) off the event loop, in the loop's default executor.

    On stop the serving thread cancels the requests still waiting here and shuts the executor down without
    waiting: work a request started (a digest, a holder blocked on the host's lock) cannot hold up the host's stop;
    it ends on its own, its answer dropped.
    """
    return await asyncio.get_running_loop().run_in_executor(None, fn)


def _said(v: Any, depth: int = 0) -> Any:
    """What an action's callable returned, as JSON whatever it holds: numpy values as numbers, nested containers
    followed (8 deep), a non-finite float or anything else as its (short) text."""
    import math

    if isinstance(v, dict) and depth < 8:
        return {str(k): _said(x, depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple)) and depth < 8:
        return [_said(x, depth + 1) for x in v]
    if hasattr(v, "item") and getattr(v, "size", 1) == 1 and not isinstance(v, (str, bytes)):
        with contextlib.suppress(Exception):
            v = v.item()
    if v is None or isinstance(v, (bool, int, str)) or (isinstance(v, float) and math.isfinite(v)):
        return v
    return repr(v)[:200]


def _json_value(v: Any) -> Any:
    """A frame cell as JSON (:func:`wcviz.frame.json_cell`), imported only when rows are sent."""
    from wcviz.frame import json_cell

    return json_cell(v)


class Agent:
    """Serve one rank's live weight digests over HTTP.

    ``holder`` returns the rank's current ``{name: tensor}`` (or ``(name, tensor)`` pairs)
    and is called on every request. ``snapshot``/``reset``/``reload`` are optional
    callables behind the mutating endpoints; they only run when ``allow_mutations`` is
    set and the request carries ``token``; a dict they return is passed back as ``result``.
    ``lock`` guards every read and mutation; pass the one the host holds while it writes
    the weights itself.
    """

    def __init__(
        self,
        holder: Holder,
        *,
        role: str,
        rank: int,
        dp: int | None = None,
        pp: int | None = None,
        tp: int | None = None,
        ep: int | None = None,
        host: str | None = None,
        algo: str = DEFAULT_ALGO,
        token: str | None = None,
        allow_mutations: bool = False,
        snapshot: Callable[[], Any] | None = None,
        reset: Callable[[], Any] | None = None,
        reload: Callable[[], Any] | None = None,
        lock: threading.Lock | threading.RLock | None = None,
        allowed_hosts: Iterable[str] = (),
        max_connections: int = MAX_CONNECTIONS,
        header_timeout_s: float = HEADER_TIMEOUT_S,
    ) -> None:
        if not callable(holder):
            raise TypeError(f"holder must be a callable returning the rank's named tensors, got {type(holder).__name__}")
        if not role or not isinstance(role, str):
            raise ValueError("role must be a non-empty string (trainer, engine, ...)")
        if algo not in ALGORITHMS:
            raise ValueError(f"unknown algo {algo!r}; choose one of {', '.join(ALGORITHMS)}")
        token = check_token(token, "the agent's token")  # what no client could send in a header would never match
        if allow_mutations and not token:
            raise ValueError("allow_mutations=True needs a token: mutating endpoints must be authenticated")
        for label, fn in (("snapshot", snapshot), ("reset", reset), ("reload", reload)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{label} must be callable or None, got {type(fn).__name__}")
        if isinstance(allowed_hosts, str):
            raise TypeError("allowed_hosts must be a list of host names, not one string")
        extra = [_host_of(str(h)) for h in allowed_hosts]
        if any(h is None for h in extra):
            raise ValueError(f"allowed_hosts holds a name that is not a host: {list(allowed_hosts)!r}")
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 2:
            raise ValueError(f"max_connections must be an integer >= 2, got {max_connections!r}")
        header_timeout_s, _ = check_deadline(header_timeout_s, what="header_timeout_s")  # NaN would switch the deadline off (and stop() with it)
        from wcviz.frame import coordinate_problem

        given: dict[str, Any] = {"rank": rank, "dp": dp, "pp": pp, "tp": tp, "ep": ep}
        coords: dict[str, int | None] = {}
        for k, v in given.items():  # what every client accepts (sources._fleet.identity_of), refused here by name
            if v is None and k != "rank":
                coords[k] = None
                continue
            if isinstance(v, bool) or not hasattr(v, "__index__"):  # numpy integers too; never True, "1" or 1.0
                raise ValueError(f"{k} must be an integer coordinate, got {v!r}")
            n = coords[k] = operator.index(v)
            if (why := coordinate_problem(k, n)) is not None:
                raise ValueError(f"{k}={v!r} is {why}")
        self.holder = holder
        self.role = role
        self.rank = operator.index(rank)
        del coords["rank"]
        self.coords = coords
        self.host = host if host is not None else socket.gethostname()
        self.algo = algo
        self.allow_mutations = bool(allow_mutations)
        self._token = token
        self._actions: dict[str, Callable[[], Any] | None] = {"snapshot": snapshot, "reset": reset, "reload": reload}
        # A digest never reads weights halfway through a reset/reload; a host that also writes the
        # weights elsewhere (a refit in its main thread) passes its own lock to share.
        self._lock = lock if lock is not None else threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None
        self.allowed_hosts = frozenset(h for h in extra if h)
        self.max_connections = int(max_connections)
        self.header_timeout_s = float(header_timeout_s)
        self._served_hosts: frozenset[str] | None = None  # set while served over the network
        self._stopping = False  # stop() is cancelling what requests still run
        self.app = self._make_app()

    # ---- the app -------------------------------------------------------------------------

    def _make_app(self) -> Starlette:
        routes = [
            Route(f"/{API_VERSION}/info", _guarded(self._info), methods=["GET"]),
            Route(f"/{API_VERSION}/digests", _guarded(self._digests), methods=["GET"]),
        ]
        for action in MUTATIONS:
            routes.append(Route(f"/{API_VERSION}/{action}", _guarded(self._mutation(action)), methods=["POST"]))

        async def http_error(request: Request, exc: Exception) -> JSONResponse:
            assert isinstance(exc, HTTPException)
            if exc.status_code == 405:
                return _error(405, f"method {request.method} not allowed on {request.url.path}")
            if exc.status_code == 404:
                return _error(404, f"no such endpoint {request.url.path}; see /{API_VERSION}/info")
            return _error(exc.status_code, str(exc.detail))

        from starlette.middleware import Middleware

        guard = Middleware(_HostGuard, hosts=lambda: self._served_hosts, stopping=lambda: self._stopping)
        return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, middleware=[guard])

    def _identity(self) -> dict[str, Any]:
        return {"role": self.role, "rank": self.rank, **self.coords, "host": self.host}

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        """The rank's tensors now, as a list of pairs."""
        held = self.holder()
        items = list(held.items() if isinstance(held, Mapping) else held)
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise TypeError(f"holder must return name -> tensor pairs, got an item {type(item).__name__}")
        return items

    async def _info(self, request: Request) -> JSONResponse:
        _check_params(request, ())

        def read() -> dict[str, Any]:
            with self._lock:
                items = self._named()
            devices = sorted({str(t.device) for _, t in items})
            return {
                **self._identity(),
                "device": ",".join(devices) if devices else None,
                "algo": self.algo,
                "params": len(items),
                "mutations_allowed": self.allow_mutations,
                "api": API_VERSION,
            }

        return JSONResponse(await _in_thread(read))

    async def _digests(self, request: Request) -> JSONResponse:
        _check_params(request, ("name",))
        try:
            keep = name_filter(request.query_params.get("name"))
        except NameFilterError as e:
            raise _ClientError(400, str(e)) from None

        accept = request.headers.get("accept", "")

        def digest() -> tuple[dict[str, Any], str | None]:
            from wcviz.sources import COLUMNS_MEDIA_TYPE, named_tensor_table  # imported on first use, off the event loop

            with self._lock:
                items = self._named()
                if keep is not None:
                    items = [(n, t) for n, t in items if keep(n)]
                table = named_tensor_table(items, algo=self.algo, progress=False, **self._identity())  # plain JSON values
            if COLUMNS_MEDIA_TYPE in accept:
                return table.body(), COLUMNS_MEDIA_TYPE
            return {"rows": table.rows()}, None

        body, media_type = await _in_thread(digest)
        return JSONResponse(body, media_type=media_type)

    def _authorized(self, request: Request) -> bool:
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given or self._token is None:
            return False
        return hmac.compare_digest(given.strip().encode(), self._token.encode())

    def _mutation(self, action: str) -> Endpoint:
        async def endpoint(request: Request) -> JSONResponse:
            _check_params(request, ())
            if not self.allow_mutations:
                raise _ClientError(403, f"mutations are disabled on this agent ({action} refused); start it with allow_mutations=True")
            if not self._authorized(request):
                raise _ClientError(401, f"{action} needs 'Authorization: Bearer <token>' with this agent's token")
            fn = self._actions[action]
            if fn is None:
                raise _ClientError(501, f"this agent has no {action} callable configured")

            def run() -> Any:
                with self._lock:
                    return fn()

            result = await _in_thread(run)
            body = {"ok": True, "action": action, **self._identity()}
            if isinstance(result, dict):  # what the callable says it did (counts, the source reloaded from): the action
                body["result"] = _said(result)  # ran, so whatever it returned must not turn its answer into an error
            return JSONResponse(body)

        return endpoint

    # ---- serving -------------------------------------------------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 0, *, timeout_s: float = 10.0) -> str:
        """Serve in a background daemon thread; return the base URL once it accepts connections."""
        if self._thread is not None:
            raise RuntimeError(f"agent already running at {self.url}")
        from wcviz._serving import guarded_protocol, serve_in_thread

        server, thread, url = serve_in_thread(
            self.app, host, port, name=f"agent for {self.role} rank {self.rank}", timeout_s=timeout_s,
            http=guarded_protocol(self.max_connections, self.header_timeout_s), timeout_keep_alive=int(IDLE_TIMEOUT_S),
        )  # fmt: skip
        self._server, self._thread, self.url = server, thread, url
        self._served_hosts = self._hosts_for(str(server.servers[0].sockets[0].getsockname()[0]), host)
        return self.url

    def _hosts_for(self, bound: str, asked: str) -> frozenset[str]:
        """What a ``Host`` header may name: the bound address, loopback names, the operator's names."""
        names = {bound.lower(), str(asked).lower(), *LOOPBACK_HOSTS, *self.allowed_hosts}
        try:
            wildcard = ipaddress.ip_address(bound).is_unspecified
        except ValueError:
            wildcard = False
        if wildcard:
            names |= _machine_names()
        return frozenset(n for n in names if n)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut the server down and join its thread; safe to call twice."""
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        from wcviz._serving import stop_server

        self._stopping = True
        try:
            stop_server(server, thread, f"agent at {self.url}", timeout_s)
        finally:
            self._stopping = False
        self._server = self._thread = None
        self.url = None
        self._served_hosts = None

    @property
    def running(self) -> bool:
        """Whether the server thread is up."""
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> Agent:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        coords = ", ".join(f"{k}={v}" for k, v in self.coords.items() if v is not None)
        where = self.url or "not started"
        return f"Agent({self.role} rank {self.rank}{', ' + coords if coords else ''}; {where})"
