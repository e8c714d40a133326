"""A source over SGLang's weight checker: ``POST /weights_checker``.

**The wire shapes below are assumed, not verified against a real SGLang** (none was
reachable when this was written); ``docs/engines.md`` says the same. They follow
SGLang's documented ``WeightChecker`` (actions ``snapshot``, ``reset_tensors``,
``compare``) plus a ``checksum`` action, with one result per rank::

    request   {"action": "checksum" | "snapshot" | "reset_tensors" | "compare"}
    answer    {"success": true, "message": "...",
               "results": [{"parallelism_info": {"tp_rank": 0, "pp_rank": 0, "dp_rank": 0,
                                                 "ep_rank": 0, "rank": 0, ...},
                            "success": true, "message": "...",
                            "checksums": {"model.layers.0.mlp.down_proj.weight": "9f2c...", ...}},
                           ...]}

``checksums`` comes with ``checksum`` only. ``rank`` (or ``global_rank`` / ``world_rank``)
in ``parallelism_info`` is optional; the other coordinates come from ``tp_rank``,
``pp_rank``, ``dp_rank``, ``ep_rank`` and rank identity is never taken from the order of
``results``. A checksum value is a hex string (an integer is written as hex). Digests get
the algorithm label ``sglang``: they are SGLang's own checksums, so
:func:`wcviz.compare` refuses to compare them with ``nemo-rl-v3`` tables, as it should.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from wcviz._names import name_filter
from wcviz._text import one_line
from wcviz.frame import IDENTITY
from wcviz.sources._fleet import ActionResult, Failed, FetchResult, assemble, message_of, rows_frame
from wcviz.sources._vllm import EngineEndpointError, target_label

__all__ = ["ACTIONS", "SGLANG_ALGO", "from_sglang", "sglang_action", "sglang_request"]

SGLANG_ALGO = "sglang"
ACTIONS = ("checksum", "snapshot", "reset_tensors", "compare")
_RANK_KEYS = ("rank", "global_rank", "world_rank")
_COORD_KEYS = {"dp": "dp_rank", "pp": "pp_rank", "tp": "tp_rank", "ep": "ep_rank"}
_HEX = re.compile(r"^[0-9a-fA-F]+$")


def sglang_request(
    base_url: str,
    action: str,
    *,
    client: httpx.Client | None = None,
    transport: httpx.BaseTransport | None = None,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """POST ``{"action": action}`` to ``/weights_checker`` once; the JSON answer.

    Raises :class:`EngineEndpointError` (``kind`` missing, unreachable or failed) when the
    engine as a whole did not answer as assumed. Sent once, never retried: actions mutate.
    """
    if action not in ACTIONS:
        raise ValueError(f"unknown weights_checker action {action!r}; choose one of {', '.join(ACTIONS)}")
    if timeout_s <= 0:
        raise ValueError("timeout_s must be > 0")
    if client is not None and transport is not None:
        raise ValueError("give client or transport, not both")
    url = f"{str(base_url).rstrip('/')}/weights_checker"
    own = client is None
    http = client if client is not None else httpx.Client(transport=transport)
    try:
        resp = http.post(url, json={"action": action}, timeout=timeout_s)
    except httpx.TimeoutException as e:
        raise EngineEndpointError(f"POST {url} ({action}) got no answer within {timeout_s} s", "unreachable") from e
    except httpx.TransportError as e:
        raise EngineEndpointError(f"POST {url} ({action}): {one_line(e)}", "unreachable") from e
    finally:
        if own:
            http.close()
    if resp.status_code == 404:
        raise EngineEndpointError(
            f"POST {url} answered 404: this SGLang server has no weight checker (a version without "
            "/weights_checker); see docs/engines.md for the request wcviz assumes",
            "missing",
        )
    if resp.status_code != 200:
        raise EngineEndpointError(f"weights_checker {action!r} failed: HTTP {resp.status_code}: {message_of(resp)}")
    try:
        body = resp.json()
    except ValueError:
        raise EngineEndpointError(f"weights_checker {action!r} did not answer JSON: {resp.text[:200]!r}") from None
    if not isinstance(body, dict):
        raise EngineEndpointError(f"weights_checker {action!r} did not answer a JSON object: {str(body)[:200]}")
    return body


def _per_rank(body: dict[str, Any], action: str) -> list[Any]:
    results = body.get("results")
    if isinstance(results, list) and results:
        return results
    if body.get("success") is False:
        raise EngineEndpointError(f"weights_checker {action!r} failed: {body.get('message') or str(body)[:200]}")
    raise EngineEndpointError(
        f"weights_checker {action!r} answered without per-rank results ({str(body)[:200]}); wcviz assumes "
        "{'results': [{'parallelism_info': {...}, ...}, ...]} (see docs/engines.md)"
    )


def _parallel_identity(result: Any) -> dict[str, Any]:
    """role, rank, dp, pp, tp, ep (and host) from one rank's ``parallelism_info``."""
    info = result.get("parallelism_info") if isinstance(result, dict) else None
    if not isinstance(info, dict):
        raise Failed(f"a result without parallelism_info: {str(result)[:200]}")
    ident: dict[str, Any] = {"role": "engine"}
    rank = next((info[k] for k in _RANK_KEYS if info.get(k) is not None), None)
    for col, value in (("rank", rank), *((c, info.get(k)) for c, k in _COORD_KEYS.items())):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise Failed(f"parallelism_info has a non-integer {col}: {value!r}")
        ident[col] = value
    if all(ident[c] is None for c in IDENTITY):
        raise Failed(f"parallelism_info names no rank coordinate (tp_rank, pp_rank, dp_rank, ep_rank, rank): {str(info)[:200]}")
    host = info.get("host") or info.get("hostname")
    ident["host"] = str(host) if host is not None else None
    return ident


def _checksum_rows(result: dict[str, Any], ident: Mapping[str, Any], phase: str, regex: Callable[[str], bool] | None) -> list[dict[str, Any]]:
    sums = result.get("checksums")
    if not isinstance(sums, dict):
        raise Failed(f"no checksums in this rank's result: {str(result)[:200]}")
    rows = []
    for name, value in sums.items():
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            value = format(value, "x")
        if not isinstance(value, str) or not _HEX.match(value):
            raise Failed(f"checksum of {name!r} is not hex: {value!r}")
        if regex is None or regex(str(name)):
            rows.append({"name": str(name), "digest": value.lower(), "algo": SGLANG_ALGO, "phase": phase, **ident})
    return rows


def from_sglang(
    base_url: str,
    *,
    client: httpx.Client | None = None,
    transport: httpx.BaseTransport | None = None,
    timeout_s: float = 120.0,
    phase: str = "current",
    name: str | None = None,
) -> FetchResult:
    """Every rank's checksums (action ``checksum``) as a digest table with algorithm ``sglang``.

    ``name`` is a regex kept parameters must match (applied here: SGLang checksums
    everything). ``dtype``, ``shape`` and ``nbytes`` are unknown (NA). Raises
    :class:`EngineEndpointError` only for a missing endpoint (404); every other failure
    is reported (see :class:`FetchResult`): a rank whose result is malformed or says
    ``success: false`` has a row in ``failed`` with the identity its ``parallelism_info`` gives.
    """
    regex = name_filter(name)
    base = str(base_url).rstrip("/")
    try:
        results = _per_rank(sglang_request(base, "checksum", client=client, transport=transport, timeout_s=timeout_s), "checksum")
    except EngineEndpointError as e:
        if e.kind == "missing":
            raise
        return assemble([], [{"url": base, "kind": e.kind, "error": str(e)}])
    collected, failed = [], []
    for i, result in enumerate(results):
        ident: dict[str, Any] = {}
        label = f"{base} result {i}"
        try:
            ident = _parallel_identity(result)
            label = target_label(base, ident)
            if result.get("success") is False:
                raise Failed(f"checksum failed on this rank: {result.get('message') or 'no message'}")
            rows = _checksum_rows(result, ident, phase, regex)
            collected.append((label, ident, dict(result["parallelism_info"]), rows_frame(rows, ident, label, "checksum")))
        except Failed as e:
            failed.append({"url": label, "kind": "failed", "error": str(e), **ident})
    return assemble(collected, failed, filtered=name is not None)


def sglang_action(
    base_url: str,
    action: str,
    *,
    client: httpx.Client | None = None,
    transport: httpx.BaseTransport | None = None,
    timeout_s: float = 120.0,
) -> ActionResult:
    """Run ``snapshot``, ``reset_tensors`` or ``compare`` on every rank; each rank's answer or error.

    ``answers``/``errors`` are keyed by a per-rank label (``<base_url> tp=1 pp=0 ...``);
    a failure of the whole request is one error under ``base_url`` (a 404 raises
    :class:`EngineEndpointError`). For ``compare``, a rank that found a mismatch
    answers ``success: false`` and is an error, with SGLang's message.
    """
    if action not in ACTIONS or action == "checksum":
        raise ValueError(f"unknown action {action!r}; choose snapshot, reset_tensors or compare (checksums: from_sglang)")
    base = str(base_url).rstrip("/")
    try:
        results = _per_rank(sglang_request(base, action, client=client, transport=transport, timeout_s=timeout_s), action)
    except EngineEndpointError as e:
        if e.kind == "missing":
            raise
        out = ActionResult(action, (base,), errors={base: str(e)})
        if e.kind == "unreachable":
            out.unreachable.add(base)
        return out
    labelled: list[tuple[str, Any, str | None]] = []
    for i, result in enumerate(results):
        try:
            label, error = target_label(base, _parallel_identity(result)), None
            if result.get("success") is False:
                error = f"{action} failed on this rank: {result.get('message') or 'no message'}"
        except Failed as e:
            label, error = f"{base} result {i}", str(e)
        labelled.append((label, result, error))
    labels = [lb for lb, _, _ in labelled]
    out = ActionResult(action, tuple(labels))
    for label, result, error in labelled:
        if labels.count(label) > 1:
            error = f"{labels.count(label)} results claim the same rank"
        if error is None:
            out.answers[label] = result
        else:
            out.errors[label] = error
    return out
