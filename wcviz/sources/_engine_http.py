"""One request to an engine's own HTTP endpoint, with the failures every engine source names the same way.

Sent once and never retried (the engines' checkers mutate: a reset sent twice is two
resets). A missing route is :class:`EngineEndpointError` ``missing`` with the caller's
hint, a refused key ``refused``, no answer ``unreachable``, anything else that is not a
JSON object ``failed``. Error answers are returned, not raised, when the caller says
which statuses carry a body it reads (SGLang answers a failed check with HTTP 400 and
``success: false``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import httpx

from wcviz._text import one_line
from wcviz.sources._fleet import message_of
from wcviz.sources._vllm import EngineEndpointError

__all__ = ["engine_request"]


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
    engine's message).
    """
    if not 0 < timeout_s < float("inf"):  # NaN and inf too
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s}")
    if client is not None and transport is not None:
        raise ValueError("give client or transport, not both")
    if token is not None and (not isinstance(token, str) or not token):
        raise ValueError("token must be a non-empty string (the engine's API key) or None")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    own = client is None
    http = client if client is not None else httpx.Client(transport=transport)
    try:
        resp = http.request(method, url, json=body, headers=headers, timeout=timeout_s)
    except httpx.TimeoutException as e:
        raise EngineEndpointError(f"{method} {url} ({what}) got no answer within {timeout_s} s", "unreachable") from e
    except httpx.TransportError as e:
        raise EngineEndpointError(f"{method} {url} ({what}): {one_line(e)}", "unreachable") from e
    finally:
        if own:
            http.close()
    if resp.status_code == 404:
        raise EngineEndpointError(f"{method} {url} answered 404 (no such route){': ' + missing_hint if missing_hint else ''}", "missing")
    if resp.status_code in (401, 403):
        said = message_of(resp)
        hint = "pass token=... (the engine's API key)" if not token else "the token given is not the engine's key for this route"
        raise EngineEndpointError(f"{what} refused: HTTP {resp.status_code} {said}: {hint}", "refused")
    if resp.status_code not in answered:
        raise EngineEndpointError(f"{what} failed for the whole engine: HTTP {resp.status_code}: {message_of(resp)}")
    try:
        data = resp.json()
    except ValueError:
        raise EngineEndpointError(f"{what} did not answer JSON (HTTP {resp.status_code}): {resp.text[:200]!r}") from None
    if not isinstance(data, dict):
        raise EngineEndpointError(f"{what} did not answer a JSON object: {str(data)[:200]}")
    return resp.status_code, data
