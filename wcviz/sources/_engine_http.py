"""One request to an engine's own HTTP endpoint, with the failures every engine source names the same way.

Sent once and never retried (the engines' checkers mutate: a reset sent twice is two
resets). A missing route is :class:`EngineEndpointError` ``missing`` with the caller's
hint, a refused key ``refused``, no answer ``unreachable``, anything else that is not a
JSON object ``failed``. Error answers are returned, not raised, when the caller says
which statuses carry a body it reads (SGLang answers a failed check with HTTP 400 and
``success: false``).

``timeout_s`` bounds the whole exchange, not each read: httpx's timeouts are per
operation, so a server that drips its answer a byte at a time would otherwise hold the
caller forever (:func:`send`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Mapping
from typing import Any

import httpx

from wcviz._errors import check_deadline, check_token
from wcviz._text import one_line
from wcviz.sources._fleet import message_of
from wcviz.sources._vllm import EngineEndpointError

__all__ = ["MAX_ANSWER_BYTES", "MAX_DEPTH", "engine_request", "json_of", "send"]

MAX_ANSWER_BYTES = 512 << 20  # an engine's answer past this is refused, not buffered (a real one is tens of MiB)
MAX_DEPTH = 64  # lists and objects in one answer; the engines' nest five deep


class _Late(httpx.TimeoutException):
    """The deadline of :func:`send` passed while the answer was still coming."""


def _read(http: httpx.Client, request: httpx.Request, deadline: float, late: threading.Event, what: str) -> httpx.Response:
    """The answer to ``request``, its body read whole; stops at the deadline or past :data:`MAX_ANSWER_BYTES`."""
    resp = http.send(request, stream=True)
    try:
        chunks: list[bytes] = []
        size = 0
        for chunk in resp.iter_bytes():
            if late.is_set() or time.monotonic() > deadline:
                raise _Late(f"the answer was still coming at the deadline ({size:,} bytes in)", request=request)
            size += len(chunk)
            if size > MAX_ANSWER_BYTES:
                raise EngineEndpointError(
                    f"{request.method} {request.url} ({what}) answered more than {MAX_ANSWER_BYTES:,} bytes: refused, not read"
                )
            chunks.append(chunk)
    finally:
        resp.close()
    kept = {"content-type": resp.headers["content-type"]} if "content-type" in resp.headers else {}  # the body is decoded
    return httpx.Response(resp.status_code, headers=kept, content=b"".join(chunks), request=request)


def send(
    http: httpx.Client, method: str, url: str, *, what: str, timeout_s: float, body: Any = None, headers: Mapping[str, str] | None = None
) -> httpx.Response:
    """The answer to one request, body read whole, within ``timeout_s`` in all (else ``httpx.TimeoutException``).

    The exchange runs on a helper thread the caller waits for until the deadline: a
    server that drips its headers or its body cannot hold the caller past it. A helper
    left behind stops at its next chunk (or read timeout); an own client closed by the
    caller ends it sooner. Transport errors are raised as httpx raises them; a body over
    :data:`MAX_ANSWER_BYTES` is :class:`EngineEndpointError` ``failed``.
    """
    deadline = time.monotonic() + timeout_s
    request = http.build_request(method, url, json=body, headers=headers, timeout=timeout_s)
    late = threading.Event()
    box: list[httpx.Response] = []
    error: list[BaseException] = []

    def fetch() -> None:
        try:
            box.append(_read(http, request, deadline, late, what))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread, which raises it
            error.append(e)

    worker = threading.Thread(target=fetch, name=f"wcviz-{what}", daemon=True)
    worker.start()
    try:
        worker.join(max(0.0, deadline - time.monotonic()))
    finally:
        late.set()  # the helper stops at its next chunk, whatever ended the wait
    if worker.is_alive():
        raise _Late(f"no whole answer within {timeout_s} s", request=request)
    if error:
        raise error[0]
    return box[0]


def _too_deep(value: Any) -> bool:
    """Whether ``value`` nests lists and objects past :data:`MAX_DEPTH` (walked iteratively: no recursion here)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > MAX_DEPTH:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def json_of(resp: httpx.Response, what: str) -> Any:
    """The answer's JSON, or :class:`EngineEndpointError` ``failed`` naming ``what`` for any body that does not
    parse (not JSON, a number past Python's digit limit, nesting deeper than the parser goes) or nests past
    :data:`MAX_DEPTH` (a value the parser takes can still be too deep for ``str``, which every message uses)."""
    try:
        data = resp.json()
    except (ValueError, RecursionError) as e:
        why = "its JSON nests too deeply to read" if isinstance(e, RecursionError) else one_line(e)
        raise EngineEndpointError(f"{what} did not answer JSON (HTTP {resp.status_code}, {why}): {resp.text[:200]!r}") from None
    if _too_deep(data):
        raise EngineEndpointError(f"{what} answered JSON nested more than {MAX_DEPTH} deep, which no engine answer is: {resp.text[:200]!r}")
    return data


def engine_request(
    method: str,
    url: str,
    *,
    what: str,
    body: dict[str, Any] | None = None,
    token: str | None = None,
    client: httpx.Client | None = None,
    transport: httpx.BaseTransport | None = None,
    timeout_s: float = 120.0,
    missing_hint: str = "",
    answered: Collection[int] = (200,),
) -> tuple[int, dict[str, Any]]:
    """``(status, JSON object)`` of one ``method`` request to ``url``; see the module doc.

    ``what`` names the request in errors (``"weight_checker 'checksum'"``); ``answered``:
    the statuses whose JSON body the caller reads (others raise ``failed`` with the
    engine's message). ``timeout_s`` bounds the whole exchange.
    """
    timeout_s, _ = check_deadline(timeout_s)
    if client is not None and transport is not None:
        raise ValueError("give client or transport, not both")
    if token is not None and (not isinstance(token, str) or not token):
        raise ValueError("token must be a non-empty string (the engine's API key) or None")
    token = check_token(token, "token (the engine's API key)")  # refused, never echoed: a header no client can send
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    own = client is None
    http = client if client is not None else httpx.Client(transport=transport)
    try:
        resp = send(http, method, url, what=what, body=body, headers=headers, timeout_s=timeout_s)
    except httpx.TimeoutException as e:
        raise EngineEndpointError(f"{method} {url} ({what}) gave no whole answer within {timeout_s} s", "unreachable") from e
    except httpx.TransportError as e:
        said = one_line(e).replace(token, "<token>") if token else one_line(e)  # a client's error may quote its headers
        raise EngineEndpointError(f"{method} {url} ({what}): {said}", "unreachable") from None
    finally:
        if own:
            http.close()
    if resp.status_code == 404:
        raise EngineEndpointError(f"{method} {url} answered 404 (no such route){': ' + missing_hint if missing_hint else ''}", "missing")
    if resp.status_code in (401, 403):
        said = message_of(resp)
        hint = "give the engine's API key (--token, or token=...)" if not token else "the token given is not the engine's key for this route"
        raise EngineEndpointError(f"{what} refused: HTTP {resp.status_code} {said}: {hint}", "refused")
    if resp.status_code not in answered:
        raise EngineEndpointError(f"{what} failed for the whole engine: HTTP {resp.status_code}: {message_of(resp)}")
    data = json_of(resp, f"{method} {url} ({what})")
    if not isinstance(data, dict):
        raise EngineEndpointError(f"{what} did not answer a JSON object: {str(data)[:200]}")
    return resp.status_code, data
