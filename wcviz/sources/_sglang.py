"""A source over SGLang's own weight checker: ``POST /weights_checker``, nothing of wcviz installed in the engine.

Written against SGLang 0.5.23 (``sglang/srt/entrypoints/http_server.py`` ``check_weights``,
``managers/tokenizer_control_mixin.py``, ``managers/scheduler_components/weight_updater.py``,
``utils/weight_checker.py``, ``managers/io_struct.py``)::

    request  {"action": "checksum" | "snapshot" | "reset_tensors" | "compare",
              "allow_quant_error": false, "skip_tensor_list": null | [substring, ...],
              "selector": "target" | "draft" | "all"}
    answer   {"success": bool, "message": str}                       HTTP 200, or 400 when success is false
             checksum adds "ranks": [one per TP rank of each DP scheduler:
                 {"checksums": {name: 16 hex}, "per_gpu_checksum": sha256 hex over the sorted (name, checksum),
                  "parallelism_info": [{"role", "tp_rank", "tp_size", "dp_rank", "dp_size",
                                        "pp_rank", "pp_size", "rank", "size"}, ...]}]   (one per role; older: one dict)
             and "per_engine_checksum": sha256 hex over the ranks' per_gpu_checksum, in order.

Only pipeline stage 0 answers: the ranks of later stages are listed here as not
reported (``unreachable``), so a pipelined engine's result is never complete. A draft
model's keys carry its role as a prefix (``draft.``, ``draft_step_0.``), and its rows keep
those keys as names (role ``engine``, the GPU's rank), so target and draft stay apart. Actions other
than ``checksum`` answer only ``success``/``message``, and only for TP rank 0 of pipeline
stage 0 of each DP scheduler: every rank runs the action, but only that rank has a socket
to the tokenizer (``scheduler.py`` ``is_rank_zero``, ``ipc_channels.py``), so another
rank's failure is only logged in SGLang. 200 says that rank did it; 400 is its failure
with SGLang's message (for ``compare``, the names that differ on that rank; with no
snapshot taken, an empty message - joined by `` | `` across DP schedulers). Only
``checksum`` gathers every TP rank: wcviz's per-rank checksums are what cover every rank.
Every failure of a DP scheduler fails the whole answer (``success`` false), though the
other schedulers' ranks still come with it. ``selector="draft"`` on an engine with no
draft model runs nothing and answers ``success`` without ``ranks``.

SGLang's checksum of a CUDA tensor is ``sglang-gpu``, of a CPU tensor ``sglang-cpu``
(:mod:`wcviz.digest`); rows are labelled ``algo`` (``sglang-gpu`` by default: SGLang
serves from CUDA). Checked are ``named_parameters()`` and ``named_buffers()`` minus
SGLang's non-persistent buffers (``cos_sin_cache``, ``inv_freq``, ``freqs_cis``, ...) and
the ``skip_tensor_list`` substrings; quantized weights are hashed dequantized. The route
is ``ADMIN_OPTIONAL``: with ``--admin-api-key`` (else ``--api-key``) set, send it as
``token`` (a Bearer token); a refused key is HTTP 401 ``{"error": "Unauthorized"}``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from wcviz._names import name_filter
from wcviz.sources._engine_http import engine_request
from wcviz.sources._fleet import MAX_IMPLIED_RANKS, ActionResult, Failed, FetchResult, assemble, rows_frame
from wcviz.sources._vllm import EngineEndpointError

__all__ = [
    "ACTIONS",
    "SGLANG_ALGO",
    "SGLANG_VERSION",
    "from_sglang",
    "sglang_action",
    "sglang_compare_mismatches",
    "sglang_request",
]

SGLANG_VERSION = "0.5.23"  # the release these shapes were read from
SGLANG_ALGO = "sglang-gpu"
ACTIONS = ("checksum", "snapshot", "reset_tensors", "compare")
SELECTORS = ("target", "draft", "all")
_INFO_FIELDS = ("role", "tp_rank", "tp_size", "dp_rank", "dp_size", "pp_rank", "pp_size", "rank", "size")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_MISMATCH = re.compile(r"name=(\S+) max_abs_err=")
_SCOPE = "on TP rank 0 of pipeline stage 0, the only rank SGLang answers for (per DP scheduler)"
_NO_SNAPSHOT = "no snapshot was taken (or it was used by an earlier compare)"
_MISSING = f"this SGLang has no /weights_checker with a checksum action (wcviz reads SGLang {SGLANG_VERSION}'s)"


def sglang_request(
    base_url: str,
    action: str,
    *,
    token: str | None = None,
    selector: str = "all",
    skip: Sequence[str] | None = None,
    allow_quant_error: bool = False,
    client: httpx.Client | None = None,
    transport: httpx.BaseTransport | None = None,
    timeout_s: float = 120.0,
) -> tuple[bool, dict[str, Any]]:
    """POST one action to ``/weights_checker``; ``(success, body)``: HTTP 200 is success, 400 SGLang's failure.

    Sent once, never retried: actions mutate. Raises :class:`EngineEndpointError` when
    the engine gave no such answer (``missing``, ``refused``, ``unreachable``, ``failed``).
    """
    if action not in ACTIONS:
        raise ValueError(f"unknown weights_checker action {action!r}; choose one of {', '.join(ACTIONS)}")
    if selector not in SELECTORS:
        raise ValueError(f"unknown selector {selector!r}; choose one of {', '.join(SELECTORS)}")
    if skip is not None and (isinstance(skip, str) or not all(isinstance(s, str) and s for s in skip)):
        raise TypeError("skip must be a list of non-empty name substrings (SGLang's skip_tensor_list) or None")
    body = {"action": action, "allow_quant_error": bool(allow_quant_error), "skip_tensor_list": list(skip) if skip is not None else None, "selector": selector}
    status, data = engine_request(
        "POST", f"{str(base_url).rstrip('/')}/weights_checker", what=f"weights_checker {action!r}", body=body,
        token=token, client=client, transport=transport, timeout_s=timeout_s, missing_hint=_MISSING, answered=(200, 400),
    )  # fmt: skip
    if not isinstance(data.get("success"), bool) or not isinstance(data.get("message"), str):
        raise EngineEndpointError(f"weights_checker {action!r} answered {str(data)[:200]}, not {{'success': bool, 'message': str}} (SGLang {SGLANG_VERSION})")
    if data["success"] != (status == 200):
        raise EngineEndpointError(f"weights_checker {action!r} answered HTTP {status} with success={data['success']}: not SGLang {SGLANG_VERSION}'s answer")
    return data["success"], data


def sglang_compare_mismatches(message: str) -> list[str]:
    """The parameter names SGLang's failed ``compare`` lists in its message (``name=<name> max_abs_err=...``)."""
    return _MISMATCH.findall(message)


def _overall(checksums: dict[str, str]) -> str:
    """SGLang's ``overall_checksum``: sha256 over each sorted name and its checksum, UTF-8."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def _infos(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """A rank's ``parallelism_info``, one dict per role (the older single dict is a list of one)."""
    info = entry.get("parallelism_info")
    infos = [info] if isinstance(info, dict) else info
    if not isinstance(infos, list) or not infos:
        raise Failed(f"no parallelism_info: {str(entry)[:200]}")
    for i in infos:
        if not isinstance(i, dict):
            raise Failed(f"parallelism_info holds {str(i)[:100]!r}, not an object")
        for k in _INFO_FIELDS[1:]:
            v = i.get(k)
            if not isinstance(v, int) or isinstance(v, bool):
                raise Failed(f"parallelism_info has no integer {k}: {str(i)[:200]}")
        if not isinstance(i.get("role", "target"), str):
            raise Failed(f"parallelism_info has a non-string role: {i.get('role')!r}")
    return infos


def _identity(info: dict[str, Any]) -> dict[str, Any]:
    """A rank's identity from its ``parallelism_info``. ``rank`` is numbered across DP: SGLang's ``rank`` is the
    rank in its own process group, and DP replicas (``dp_size`` 1: no attention DP) each have their own, so a
    replica's ranks are offset by ``dp_rank * size`` - vLLM's numbering, ``(dp * pp_size + pp) * tp_size + tp``."""
    rank = info["rank"] + (info["dp_rank"] * info["size"] if info["dp_size"] == 1 else 0)
    return {"role": "engine", "rank": rank, "dp": info["dp_rank"], "pp": info["pp_rank"], "tp": info["tp_rank"], "ep": None}


def _label(base: str, ident: dict[str, Any]) -> str:
    return f"{base} dp={ident['dp']} pp={ident['pp']} tp={ident['tp']}"


class _RankFailed(Failed):
    """A ranks entry whose identity held up but whose checksums did not."""

    def __init__(self, message: str, info: dict[str, Any]) -> None:
        super().__init__(message)
        self.info = info


def _rank_rows(
    base: str, entry: Any, phase: str, algo: str, keep: Callable[[str], bool] | None
) -> tuple[tuple[str, dict[str, Any], dict[str, Any], Any], dict[str, Any]]:
    """One ``ranks`` entry: its collected table and the ``parallelism_info`` its identity comes from.

    Every role on the GPU (the target and its drafts) is the same rank: one table, the
    draft's rows under SGLang's own keys (``draft.<name>``), the roles in its info.
    """
    if not isinstance(entry, dict):
        raise Failed(f"a ranks entry is {str(entry)[:200]!r}, not an object")
    infos = _infos(entry)
    where = {(i["rank"], i["dp_rank"], i["pp_rank"], i["tp_rank"], i["dp_size"], i["size"]) for i in infos}
    if len(where) > 1:
        raise Failed(f"its roles claim different ranks: {str(infos)[:200]}")
    try:
        return _checked_rows(base, entry, infos, phase, algo, keep)
    except Failed as e:  # the rank is known: its failure is named by it, and its sizes still count
        raise _RankFailed(str(e), infos[0]) from None


def _checked_rows(
    base: str, entry: dict[str, Any], infos: list[dict[str, Any]], phase: str, algo: str, keep: Callable[[str], bool] | None
) -> tuple[tuple[str, dict[str, Any], dict[str, Any], Any], dict[str, Any]]:
    sums = entry.get("checksums")
    if not isinstance(sums, dict):
        raise Failed(f"no checksums object: {str(entry)[:200]}")
    bad = [k for k, v in sums.items() if not isinstance(v, str) or not _HEX16.match(v)]
    if bad:
        raise Failed(f"{len(bad)} checksum(s) are not 16 lowercase hex: {', '.join(map(str, bad[:3]))}")
    if entry.get("per_gpu_checksum") != _overall(sums):
        raise Failed("per_gpu_checksum is not the sha256 of its checksums: the answer was altered or cut short")
    roles = [str(i.get("role", "target")) for i in infos]
    drafts = tuple(r + "." for r in roles if r != "target")
    if "target" not in roles and drafts and not all(k.startswith(drafts) for k in sums):
        raise Failed(f"checksum keys without a role prefix ({', '.join(drafts)}) but no target role answered")
    info = infos[0]
    ident = _identity(info)
    label = _label(base, ident)
    rows = [{"name": n, "digest": v, "algo": algo, "phase": phase, **ident} for n, v in sums.items() if keep is None or keep(n)]
    meta = {**info, "roles": roles, "params": len(sums)}
    return (label, ident, meta, rows_frame(rows, ident, label, "weights_checker")), info


def _not_reported(base: str, infos: list[dict[str, Any]], answered: set[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Ranks the answering ones' sizes imply but that gave nothing: later pipeline stages, a TP rank that is absent."""
    out = []
    seen: set[tuple[Any, ...]] = set()
    for info in infos:
        dp_size, tp_size, size = info["dp_size"], info["tp_size"], info["size"]
        if info["pp_size"] * tp_size > MAX_IMPLIED_RANKS:  # a buggy or hostile answer: never enumerated
            why = f"parallelism_info implies {info['pp_size']} x {tp_size} ranks, more than {MAX_IMPLIED_RANKS:,}: not SGLang's answer"
            out.append({"url": base, "kind": "failed", "error": why})
            continue
        attn_tp = tp_size // dp_size if dp_size > 1 and tp_size % dp_size == 0 else None  # attention DP splits the TP group
        for pp in range(info["pp_size"]):
            for tp in range(tp_size):
                dp = tp // attn_tp if attn_tp else info["dp_rank"]
                key = (dp, pp, tp)
                if key in answered or key in seen:
                    continue
                seen.add(key)
                why = (
                    f"not reported: SGLang {SGLANG_VERSION}'s weights checker answers from pipeline stage 0 only"
                    if pp > 0 else f"not reported: tp_size is {tp_size} but this TP rank is not among SGLang's ranks"
                )  # fmt: skip
                rank = pp * tp_size + tp + (info["dp_rank"] * size if dp_size == 1 else 0)  # SGLang: pp_rank * tp_size + tp_rank
                ident = {"role": "engine", "rank": rank, "dp": dp, "pp": pp, "tp": tp}
                out.append({"url": _label(base, ident), "kind": "unreachable", "error": why, **ident})
    return out


def from_sglang(
    base_url: str,
    *,
    token: str | None = None,
    selector: str = "all",
    skip: Sequence[str] | None = None,
    algo: str = SGLANG_ALGO,
    client: httpx.Client | None = None,
    transport: httpx.BaseTransport | None = None,
    timeout_s: float = 120.0,
    phase: str = "current",
    name: str | None = None,
) -> FetchResult:
    """Every rank's checksums from a running SGLang's own ``/weights_checker`` (see the module doc).

    One row per (rank, role, parameter), ``algo`` ``sglang-gpu`` (give ``sglang-cpu`` for
    an engine on CPU); ``dtype``, ``shape`` and ``nbytes`` are unknown (NA). ``name``: a
    regex kept names must match (applied here). A rank whose entry does not hold up (its
    ``per_gpu_checksum`` is checked) is ``failed``; ranks the sizes imply but that did not
    answer (pipeline stages after the first) are ``unreachable``, and a failed answer
    adds an engine-wide ``failed`` row with SGLang's message: the result is then never
    complete. Raises :class:`EngineEndpointError` only for a missing route or a refused
    token.
    """
    if algo not in ("sglang-gpu", "sglang-cpu"):
        raise ValueError(f"SGLang's checksums are sglang-gpu (a CUDA engine) or sglang-cpu, not {algo!r}")
    keep = name_filter(name)
    base = str(base_url).rstrip("/")
    try:
        ok, data = sglang_request(base, "checksum", token=token, selector=selector, skip=skip, client=client, transport=transport, timeout_s=timeout_s)
    except EngineEndpointError as e:
        if e.kind in ("missing", "refused"):
            raise
        return assemble([], [{"url": base, "kind": e.kind, "error": str(e)}])
    failed: list[dict[str, Any]] = []
    if not ok:
        failed.append({"url": base, "kind": "failed", "error": f"SGLang's checksum failed: {data['message'] or '(no message)'}"})
    ranks = data.get("ranks")
    if ranks is None:
        ranks = []
        if ok and selector == "draft":  # weight_updater.py:178-185: no draft worker, no runner, no payload (433)
            failed.append({"url": base, "kind": "empty", "error": "the engine has no draft model: selector='draft' checked nothing"})
        elif ok:
            failed.append({"url": base, "kind": "failed", "error": f"checksum answered success without ranks (not SGLang {SGLANG_VERSION}'s answer): {str(data)[:200]}"})
    if not isinstance(ranks, list):
        return assemble([], [*failed, {"url": base, "kind": "failed", "error": f"ranks is {type(ranks).__name__}, not a list"}])
    per_gpu = [r.get("per_gpu_checksum") if isinstance(r, dict) else None for r in ranks]
    if ranks and data.get("per_engine_checksum") is not None and all(isinstance(p, str) for p in per_gpu):
        if data["per_engine_checksum"] != hashlib.sha256("".join(per_gpu).encode()).hexdigest():  # type: ignore[arg-type]
            failed.append({"url": base, "kind": "failed", "error": "per_engine_checksum is not the sha256 of the ranks' per_gpu_checksum: the answer was altered"})
    collected: list[Any] = []
    infos: list[dict[str, Any]] = []
    known: set[tuple[Any, ...]] = set()
    seen: set[str] = set()
    for i, entry in enumerate(ranks):
        same = json.dumps(entry, sort_keys=True, default=str)
        if same in seen:  # attention DP: each attention-DP leader answers with the all_gather of the whole TP group
            continue  # (scheduler.py is_rank_zero, weight_updater.py check_weights), so a rank is listed once per group, identically
        seen.add(same)
        try:
            got, info = _rank_rows(base, entry, phase, algo, keep)
            collected.append(got)
            infos.append(info)
        except _RankFailed as e:  # named by its own coordinates, so it is neither a rank without identity nor "not reported"
            ident = _identity(e.info)
            failed.append({"url": _label(base, ident), "kind": "failed", "error": str(e), **ident})
            infos.append(e.info)
            known.add((ident["dp"], ident["pp"], ident["tp"]))
        except Failed as e:
            failed.append({"url": f"{base} ranks[{i}]", "kind": "failed", "error": str(e)})
    answered = known | {(ident["dp"], ident["pp"], ident["tp"]) for _, ident, _, _ in collected}
    failed += _not_reported(base, infos, answered)
    return assemble(collected, failed, filtered=name is not None)


def sglang_action(
    base_url: str,
    action: str,
    *,
    token: str | None = None,
    selector: str = "all",
    skip: Sequence[str] | None = None,
    allow_quant_error: bool = False,
    client: httpx.Client | None = None,
    transport: httpx.BaseTransport | None = None,
    timeout_s: float = 120.0,
) -> ActionResult:
    """Run ``snapshot``, ``reset_tensors`` or ``compare`` on the whole engine; one target, the engine's URL.

    Every rank runs the action, but SGLang answers for TP rank 0 of pipeline stage 0 of
    each DP scheduler only (its other ranks' failures are only logged): HTTP 200
    (``success`` true, no payload) says those ranks did it, 400 is their failure with
    SGLang's message (a ``compare`` that found differences there names them;
    :func:`sglang_compare_mismatches` reads them out). Per-rank checksums
    (:func:`from_sglang`) are what cover every rank. No answer
    is ``unreachable``. ``reset_tensors`` writes random values into every weight:
    DESTRUCTIVE; ``snapshot`` keeps a host copy of every weight in SGLang until a
    ``compare`` succeeds. Raises :class:`EngineEndpointError` for a missing route or a
    refused token.
    """
    if action not in ACTIONS or action == "checksum":
        raise ValueError(f"unknown action {action!r}; choose snapshot, reset_tensors or compare (checksums: from_sglang)")
    base = str(base_url).rstrip("/")
    out = ActionResult(action, (base,))
    try:
        ok, data = sglang_request(
            base, action, token=token, selector=selector, skip=skip, allow_quant_error=allow_quant_error,
            client=client, transport=transport, timeout_s=timeout_s,
        )  # fmt: skip
    except EngineEndpointError as e:
        if e.kind in ("missing", "refused"):
            raise
        out.record(base, e)
        if e.kind == "unreachable":
            out.unreachable.add(base)
        return out
    if ok:
        out.answers[base] = data
    elif action == "compare" and not any(data["message"].split(" | ")):  # one empty message per DP scheduler, joined
        out.errors[base] = f"SGLang's compare failed without a message {_SCOPE}: {_NO_SNAPSHOT}"
    else:
        parts = data["message"].split(" | ")
        said = data["message"] or "(no message)"
        if action == "compare" and "" in parts:  # some DP schedulers' TP rank 0 had no snapshot: an empty message
            said = " | ".join(p or f"(empty: {_NO_SNAPSHOT})" for p in parts)
        out.errors[base] = f"{action} failed {_SCOPE}: {said}"
    return out
