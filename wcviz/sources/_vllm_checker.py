"""A source over vLLM's own weight checker: nothing of wcviz installed in the engine.

Written against vLLM 0.33.0 (``vllm/entrypoints/rl/online/api_router.py``, served only
with ``VLLM_SERVER_DEV_MODE=1``; ``vllm/v1/worker/gpu_worker.py``;
``vllm/model_executor/model_loader/weight_checksum.py``)::

    POST /weight_checker {"action": "checksum"}
      -> {"checksums": {"dp{d}:pp{p}:pcp{c}:tp{t}:<name>": <sha256 hex of the raw bytes>, ...}}
    POST /weight_checker {"action": "reset"}      -> {"status": "reset"}   (zeros every weight)
    POST /weight_checker {"action": "compare", "baseline": {key: sha256}}
      -> {"match": bool, "mismatches": [key, ...]}
    GET  /get_world_size?include_dp=true|false    -> {"world_size": N}    (TP x PP x PCP [x DP])

The checksums are gathered from every DP engine the server manages; ``dp`` in a key is
the worker's ``parallel_config.data_parallel_index`` (dense replicas all have
``data_parallel_rank`` 0: only the index tells them apart). Names are the model's
``named_parameters()`` (a tied head once, under the embedding's name); a
``SharedWeightParameter`` contributes ``<name>.<index>`` per partition, a tensor
subclass (TorchAO) ``<name>.<attr>`` per inner tensor. The digest is ``vllm-sha256``
(:mod:`wcviz.digest`), so a checkpoint cut by :mod:`wcviz.layouts` says what each key
must hold. Errors are ``{"error": {"message", "type", "param", "code"}}`` (HTTP 400 for
a bad request, 500 when two workers report one key); vLLM puts no API key on these
routes (``--api-key`` guards ``/v1`` only), but a token is sent when given (a proxy in
front may want one).

Rank identity: ``rank`` is vLLM's global rank, ``((dp * pp_size + pp) * pcp_size + pcp)
* tp_size + tp`` (``parallel_state``'s ``reshape(-1, dp, pp, pcp, tp)``), with the sizes
read off the keys and held to ``/get_world_size``; the ``url`` label keeps the key's own
prefix (``http://host:8000 dp0:pp0:pcp0:tp1``). The result is complete only when every
rank ``/get_world_size`` counts answered.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import httpx
import pandas as pd

from wcviz._names import name_filter
from wcviz.sources._engine_http import engine_request
from wcviz.sources._fleet import MAX_IMPLIED_RANKS, Failed, FetchResult, assemble, rows_frame
from wcviz.sources._vllm import EngineEndpointError

__all__ = [
    "VLLM_CHECKER_ALGO", "VLLM_VERSION", "from_vllm_weight_checker", "vllm_checksum_keys", "vllm_version", "vllm_weight_checker",
    "vllm_world_size",
]  # fmt: skip

VLLM_VERSION = "0.33.0"  # the release these shapes were read from
VLLM_CHECKER_ALGO = "vllm-sha256"
CHECKER_ACTIONS = ("checksum", "reset", "compare")
_KEY = re.compile(r"^dp(\d+):pp(\d+):pcp(\d+):tp(\d+):(.+)$", re.S)
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_DEV_MODE = (
    "vLLM serves /weight_checker and /get_world_size only in dev mode: start vLLM with VLLM_SERVER_DEV_MODE=1 "
    f"(vLLM >= {VLLM_VERSION} has the routes)"
)


def vllm_weight_checker(
    base_url: str,
    action: str,
    *,
    baseline: Mapping[str, str] | None = None,
    token: str | None = None,
    client: httpx.Client | None = None,
    transport: httpx.BaseTransport | None = None,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """POST one action to vLLM's ``/weight_checker``; its JSON answer (see the module doc).

    ``reset`` zeros every weight of every worker: DESTRUCTIVE. ``compare`` needs a
    ``baseline`` (``{key: sha256}``, e.g. :func:`vllm_checksum_keys` of an earlier
    fetch). Raises :class:`EngineEndpointError` for an engine-wide failure (``missing``:
    dev mode is off).
    """
    if action not in CHECKER_ACTIONS:
        raise ValueError(f"unknown weight_checker action {action!r}; choose one of {', '.join(CHECKER_ACTIONS)}")
    if (action == "compare") != (baseline is not None):
        raise ValueError("action 'compare' needs a baseline ({key: sha256}); the other actions take none")
    body: dict[str, Any] = {"action": action}
    if baseline is not None:
        body["baseline"] = {str(k): str(v) for k, v in baseline.items()}
    url = f"{str(base_url).rstrip('/')}/weight_checker"
    _, data = engine_request(
        "POST", url, what=f"weight_checker {action!r}", body=body, token=token, client=client, transport=transport,
        timeout_s=timeout_s, missing_hint=_DEV_MODE,
    )  # fmt: skip
    want = {"checksum": ("checksums",), "reset": ("status",), "compare": ("match", "mismatches")}[action]
    if any(k not in data for k in want):
        raise EngineEndpointError(f"weight_checker {action!r} answered {str(data)[:200]}, not {{{', '.join(map(repr, want))}: ...}} (vLLM {VLLM_VERSION})")
    return data


def vllm_world_size(
    base_url: str,
    *,
    include_dp: bool = True,
    token: str | None = None,
    client: httpx.Client | None = None,
    transport: httpx.BaseTransport | None = None,
    timeout_s: float = 30.0,
) -> int:
    """vLLM's ``GET /get_world_size``: TP x PP x PCP, times DP when ``include_dp``."""
    url = f"{str(base_url).rstrip('/')}/get_world_size?include_dp={'true' if include_dp else 'false'}"
    _, data = engine_request(
        "GET", url, what="get_world_size", token=token, client=client, transport=transport, timeout_s=timeout_s,
        missing_hint=_DEV_MODE,
    )  # fmt: skip
    n = data.get("world_size")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise EngineEndpointError(f"get_world_size answered {str(data)[:200]}, not {{'world_size': a positive int}}")
    return n


def vllm_version(
    base_url: str, *, token: str | None = None, client: httpx.Client | None = None, transport: httpx.BaseTransport | None = None,
    timeout_s: float = 30.0,
) -> str | None:
    """What vLLM's ``GET /version`` says (``"0.33.0"``), or None when the server does not answer it so. vLLM serves it
    always, dev mode or not (``entrypoints/serve/instrumentator/basic.py``); SGLang 0.5.23 has no such route."""
    try:
        _, data = engine_request("GET", f"{str(base_url).rstrip('/')}/version", what="version", token=token, client=client, transport=transport, timeout_s=timeout_s)
    except EngineEndpointError:
        return None
    return data["version"] if isinstance(data.get("version"), str) else None


def vllm_checksum_keys(frame: pd.DataFrame) -> dict[str, str]:
    """A frame of this source back to vLLM's keys (``dp0:pp0:pcp0:tp1:<name>`` -> sha256): a ``compare`` baseline."""
    if "url" not in frame:
        raise ValueError("vllm_checksum_keys needs a frame from from_vllm_weight_checker (with its url column)")
    out = {}
    for label, name, digest in zip(frame["url"], frame["name"], frame["digest"]):
        prefix = str(label).rsplit(" ", 1)[-1]
        if not _KEY.match(f"{prefix}:{name}"):
            raise ValueError(f"row {name!r} at {label!r} does not carry a vLLM checker prefix (dpD:ppP:pcpC:tpT)")
        out[f"{prefix}:{name}"] = str(digest)
    return out


def _parse(checksums: Any) -> tuple[dict[tuple[int, int, int, int], dict[str, str]], list[str]]:
    """Checksums grouped by (dp, pp, pcp, tp), and the keys that are not vLLM's (or not sha256 hex)."""
    if not isinstance(checksums, dict):
        raise EngineEndpointError(f"weight_checker 'checksum' answered checksums of type {type(checksums).__name__}, not an object")
    by_rank: dict[tuple[int, int, int, int], dict[str, str]] = {}
    bad = []
    for key, value in checksums.items():
        m = _KEY.match(str(key))
        if m is None or not isinstance(value, str) or not _HEX64.match(value):
            bad.append(str(key))
            continue
        coords = (int(m[1]), int(m[2]), int(m[3]), int(m[4]))
        by_rank.setdefault(coords, {})[m[5]] = value
    return by_rank, bad


def _sizes(ranks: list[tuple[int, int, int, int]], replica: int | None) -> tuple[int, int, int] | None:
    """(pp, pcp, tp) sizes read off the answering ranks, when they multiply to one replica's world size."""
    pp, pcp, tp = (max(r[i] for r in ranks) + 1 for i in (1, 2, 3))
    return (pp, pcp, tp) if replica is not None and pp * pcp * tp == replica else None


def from_vllm_weight_checker(
    base_url: str,
    *,
    token: str | None = None,
    client: httpx.Client | None = None,
    transport: httpx.BaseTransport | None = None,
    timeout_s: float = 120.0,
    phase: str = "current",
    name: str | None = None,
) -> FetchResult:
    """Every rank's weight checksums from a running vLLM's own ``/weight_checker`` (``VLLM_SERVER_DEV_MODE=1``).

    Rows carry algorithm ``vllm-sha256``, ``role`` ``engine``, ``dp``/``pp``/``tp`` from
    the keys and ``rank`` as vLLM numbers its ranks; ``dtype``, ``shape`` and ``nbytes``
    are unknown (NA). ``name``: a regex kept names must match (applied here). Ranks that
    ``/get_world_size?include_dp=true`` counts but that gave no checksums (another API
    server's engines, an engine that failed) are ``unreachable`` rows of ``failed``.
    Raises :class:`EngineEndpointError` only for a missing route (dev mode off) or a
    refused token; every other failure is reported (see :class:`FetchResult`).
    """
    keep = name_filter(name)
    base = str(base_url).rstrip("/")
    net: dict[str, Any] = {"token": token, "client": client, "transport": transport}
    try:
        data = vllm_weight_checker(base, "checksum", timeout_s=timeout_s, **net)
        by_rank, bad = _parse(data["checksums"])
    except EngineEndpointError as e:
        if e.kind in ("missing", "refused"):
            raise
        return assemble([], [{"url": base, "kind": e.kind, "error": str(e)}])
    failed: list[dict[str, Any]] = []
    if bad:
        failed.append({"url": base, "kind": "failed", "error": f"{len(bad)} checksum key(s) are not 'dpD:ppP:pcpC:tpT:<name>' -> sha256 hex (vLLM {VLLM_VERSION}): {', '.join(bad[:3])}"})
    world: int | None
    replica: int | None
    try:
        world = vllm_world_size(base, include_dp=True, timeout_s=min(timeout_s, 30.0), **net)
        replica = vllm_world_size(base, include_dp=False, timeout_s=min(timeout_s, 30.0), **net)
    except EngineEndpointError as e:
        world = replica = None
        failed.append({"url": f"{base} /get_world_size", "kind": e.kind, "error": f"cannot tell how many ranks the engine has, so not whether all answered: {e}"})
    ranks = sorted(by_rank)
    sizes = _sizes(ranks, replica) if ranks else None
    if ranks and replica is not None and sizes is None:
        failed.append({"url": base, "kind": "failed", "error": f"the answering ranks' coordinates do not span the {replica} ranks of one replica /get_world_size counts: cannot number the ranks"})

    def rank_of(d: int, p: int, c: int, t: int) -> int | None:
        if sizes is None:
            return None
        pp, pcp, tp = sizes
        return ((d * pp + p) * pcp + c) * tp + t

    collected = []
    for d, p, c, t in ranks:
        ident = {"role": "engine", "rank": rank_of(d, p, c, t), "dp": d, "pp": p, "tp": t, "ep": None}
        label = f"{base} dp{d}:pp{p}:pcp{c}:tp{t}"
        if c > 0:  # prefill context parallelism: every PCP rank holds its TP rank's shard, so pcp0's rows stand for it,
            # and another PCP rank is checked against pcp0 here (the tables place ranks by dp, pp, tp: no pcp)
            ref, mine = by_rank.get((d, p, 0, t), {}), by_rank[(d, p, c, t)]
            differ = sorted(n for n in ref.keys() | mine.keys() if (keep is None or keep(n)) and ref.get(n) != mine.get(n))
            experts = [n for n in differ if ".experts." in n]
            if len(experts) < len(differ):
                other = [n for n in differ if ".experts." not in n]
                failed.append({"url": label, "kind": "failed", "error": f"pcp{c} holds other weights than pcp0 of the same TP rank "
                               f"({len(other)} parameter(s): {', '.join(other[:3])})", **ident})  # fmt: skip
            elif experts:  # vLLM 0.33's expert-parallel group spans DP x PCP x TP (parallel_state.py): not placed here
                failed.append({"url": label, "kind": "failed", "error": f"pcp{c}'s experts differ from pcp0's ({len(experts)}, e.g. "
                               f"{experts[0]}): with expert parallelism vLLM spreads experts over PCP ranks too, which wcviz "
                               "does not place, so they are not checked", **ident})  # fmt: skip
            continue
        rows = [
            {"name": n, "digest": v, "algo": VLLM_CHECKER_ALGO, "phase": phase, **ident}
            for n, v in by_rank[(d, p, c, t)].items() if keep is None or keep(n)
        ]  # fmt: skip
        try:
            collected.append((label, ident, {"params": len(by_rank[(d, p, c, t)])}, rows_frame(rows, ident, label, "weight_checker")))
        except Failed as e:
            failed.append({"url": label, "kind": "failed", "error": str(e), **ident})
    if world is not None and world > MAX_IMPLIED_RANKS:  # a buggy or hostile answer: never enumerated
        failed.append({"url": base, "kind": "failed", "error": f"/get_world_size says {world} ranks, more than {MAX_IMPLIED_RANKS:,}: not an engine's answer"})
    elif sizes is not None and world is not None:
        pp, pcp, tp = sizes
        replicas, rest = divmod(world, pp * pcp * tp)
        if rest:
            failed.append({"url": base, "kind": "failed", "error": f"/get_world_size says {world} ranks across DP, not a multiple of {replica} per replica"})
        answered = set(ranks)
        for d in range(replicas):
            for p in range(pp):
                for c in range(pcp):
                    for t in range(tp):
                        if (d, p, c, t) not in answered:
                            failed.append({
                                "url": f"{base} dp{d}:pp{p}:pcp{c}:tp{t}", "kind": "unreachable",
                                "error": f"no checksums: /get_world_size counts {world} ranks, {len(answered)} answered "
                                "(an engine this API server does not manage, or one that failed)",
                                "role": "engine", "rank": rank_of(d, p, c, t), "dp": d, "pp": p, "tp": t,
                            })  # fmt: skip
    elif world is not None and len(ranks) < world:
        failed.append({"url": base, "kind": "unreachable", "error": f"/get_world_size counts {world} ranks but only {len(ranks)} answered"})
    return assemble(collected, failed, filtered=name is not None)
