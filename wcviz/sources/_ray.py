"""A source over Ray actors: call a digest method on every actor and collect every result.

Each actor is one rank. It answers ``info_method`` (default ``wcviz_info``: a dict with
``role`` and ``rank``, plus ``dp``/``pp``/``tp``/``ep``/``host``) and ``method`` (default
``wcviz_digests``) with its rows: ``{"info": ..., "rows": [...]}`` or
``{"info": ..., "error": "..."}`` as :class:`wcviz.integrations.vllm.WcvizWorkerExtension`
answers (a Ray actor class may mix it in), a list of row dicts, or a DataFrame.

Every result is collected with ``ray.get(..., timeout=...)``; a result that was not
collected is a row of :attr:`FetchResult.failed`, never a pass: ``unreachable`` for an
actor that died or did not answer in time, ``failed`` for a method that raised,
answered something that is not a digest table, or gave another number of rows than its
info counts (``params``; unless a ``name`` or ``name_regex`` that is not None chose them,
as the HTTP and vLLM sources do). Identity comes from each actor's own
info and rows, never from the order of ``actors``; give ``actors`` as a mapping
``{handle: {"role": ..., "rank": ..., ...}}`` to have an actor that is already dead
reported under the identity it should have had (and to catch an actor that claims
another). Ray is imported only when this is called.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from wcviz._errors import check_deadline
from wcviz.frame import make_frame
from wcviz.sources._fleet import (
    KEY,
    Failed,
    FetchResult,
    assemble,
    check_expected,
    checked_expected,
    count_mismatch,
    identity_of,
    key_of,
    rows_frame,
)

__all__ = ["from_ray_actors"]


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError("from_ray_actors needs Ray: pip install 'wcviz[ray]' (or 'ray[default]>=2.9')") from None
    return ray


def _label(actor: Any) -> str:
    """``Actor(ShardActor, 5f3a...)``: Ray's own name for the handle (class and actor id)."""
    return repr(actor)


def _normalize(actors: Sequence[Any] | Mapping[Any, Mapping[str, Any]]) -> list[tuple[Any, dict[str, Any]]]:
    pairs = list(actors.items()) if isinstance(actors, Mapping) else [(a, {}) for a in actors]
    seen: set[str] = set()
    out = []
    for actor, ident in pairs:
        label = _label(actor)
        if label in seen:
            raise ValueError(f"{label} is given twice; each actor must be asked once")
        seen.add(label)
        out.append((actor, checked_expected(label, ident)))
    return out


def _check_expected(ident: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """An actor must be the rank the caller says it is (a launcher that mixed handles up)."""
    check_expected(ident, expected, "the actor", "it")


def _gather(ray: Any, calls: dict[str, Any], timeout_s: float) -> dict[str, tuple[str, Any]]:
    """``label -> ("ok", value) | (kind, message)`` for every submitted call: each one is
    ``ray.get``-ed with what is left of one shared ``timeout_s``, so none is ever skipped."""
    outcomes: dict[str, tuple[str, Any]] = {}
    refs = {label: ref for label, ref in calls.items() if not isinstance(ref, BaseException)}
    for label, err in calls.items():
        if isinstance(err, BaseException):
            outcomes[label] = ("failed", f"could not call it: {type(err).__name__}: {err}")
    deadline = time.monotonic() + timeout_s
    if refs:  # let them all finish concurrently first
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    for label, ref in refs.items():
        try:
            outcomes[label] = ("ok", ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
        except ray.exceptions.RayTaskError as e:  # first: Ray 2.60 raises ``as_instanceof_cause()``, a class that
            # also inherits the cause's (ray/exceptions.py RayTaskError.as_instanceof_cause), so a method that raised a
            # GetTimeoutError or an ActorDiedError of its own would otherwise read as this actor hung or dead
            cause = getattr(e, "cause", None)
            what = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else _first_line(e)
            outcomes[label] = ("failed", f"the method raised {what}")
        except ray.exceptions.GetTimeoutError:
            outcomes[label] = ("unreachable", f"no result within {timeout_s} s (the actor is busy or hung)")
        except ray.exceptions.RayActorError as e:
            outcomes[label] = ("unreachable", f"the actor died: {_first_line(e)}")
        except Exception as e:  # noqa: BLE001 - anything else Ray raises: a failure, never a pass
            outcomes[label] = ("failed", f"{type(e).__name__}: {_first_line(e)}")
    return outcomes


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def _submit(actors: list[tuple[Any, dict[str, Any]]], method: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    calls: dict[str, Any] = {}
    for actor, _ in actors:
        try:
            calls[_label(actor)] = getattr(actor, method).remote(**kwargs)
        except Exception as e:  # noqa: BLE001 - no such method on this actor class
            calls[_label(actor)] = e
    return calls


def _table(rows: Any, what: str) -> pd.DataFrame:
    try:
        return make_frame(rows.to_dict(orient="records") if isinstance(rows, pd.DataFrame) else rows)
    except Exception as e:  # noqa: BLE001 - not rows at all, or rows off the schema
        raise Failed(f"{what} did not answer a digest table: {_first_line(e)}") from None


def _identity_from_rows(frame: pd.DataFrame) -> dict[str, Any]:
    ids = frame[list(KEY)].drop_duplicates()
    if len(ids) != 1:
        raise Failed(f"its rows claim {len(ids)} different rank identities; one actor must be one rank" if len(ids) else "no rows and no info: which rank it is cannot be told")
    row = ids.iloc[0]
    ident = {k: (None if pd.isna(row[k]) else (str(row[k]) if k == "role" else int(row[k]))) for k in KEY}
    if ident["role"] is None or ident["rank"] is None:
        raise Failed("its rows carry no role and rank; give the rows a role and rank, or answer an info method")
    hosts = frame["host"].dropna().unique()
    ident["host"] = str(hosts[0]) if len(hosts) == 1 else None
    return ident


def from_ray_actors(
    actors: Sequence[Any] | Mapping[Any, Mapping[str, Any]],
    method: str = "wcviz_digests",
    *,
    info_method: str | None = "wcviz_info",
    timeout_s: float = 60.0,
    **kwargs: Any,
) -> FetchResult:
    """Call ``method(**kwargs)`` on every actor and collect every answer (see the module doc).

    ``info_method`` is asked first (``None``: identity from the rows alone); each of
    the two rounds has ``timeout_s`` for all actors together. ``url`` labels are Ray's
    names of the handles (``Actor(Class, id)``).
    """
    timeout_s, _ = check_deadline(timeout_s)
    ray = _ray()
    targets = _normalize(actors)
    if not targets:
        raise ValueError("from_ray_actors needs at least one actor")
    failed: list[dict[str, Any]] = []
    infos: dict[str, dict[str, Any]] = {}
    idents: dict[str, dict[str, Any]] = {}

    asking = targets
    if info_method is not None:
        asking = []
        outcomes = _gather(ray, _submit(targets, info_method, {}), timeout_s)
        for actor, known in targets:
            label = _label(actor)
            kind, value = outcomes[label]
            try:
                if kind != "ok":
                    raise Failed(f"{info_method}: {value}")
                ident = identity_of(value, info_method)
                _check_expected(ident, known)
            except Failed as e:
                failed.append({"url": label, "kind": kind if kind != "ok" else "failed", "error": str(e), **known})
                continue
            infos[label], idents[label] = dict(value), ident
            asking.append((actor, known))

    outcomes = _gather(ray, _submit(asking, method, kwargs), timeout_s)
    filtered = any(kwargs.get(k) is not None for k in ("name", "name_regex"))  # a filter of None filters nothing
    collected = []
    for actor, known in asking:
        label = _label(actor)
        ident = idents.get(label, dict(known))
        kind, value = outcomes[label]
        try:
            if kind != "ok":
                raise Failed(f"{method}: {value}")
            info, rows = infos.get(label), value
            counted = info  # the info that counts what this answer must hold: the answer's own, when it counts
            if isinstance(value, dict):
                if isinstance(value.get("info"), dict):
                    claimed = identity_of(value["info"], method)
                    if info is not None and key_of(claimed) != key_of(ident):
                        raise Failed(f"{method} answered as rank {key_of(claimed)} but {info_method} said {key_of(ident)}")
                    ident, info = claimed, info or dict(value["info"])
                    params = value["info"].get("params")
                    if isinstance(params, int) and not isinstance(params, bool):  # its own count, when it gives one
                        counted = value["info"]
                if "error" in value:
                    raise Failed(f"{method} failed on this actor: {value['error']}")
                rows = value.get("rows")
            if info is None:  # no info anywhere: the rows say which rank this is
                ident = _identity_from_rows(_table(rows, method))
                info = dict(ident)
            _check_expected(ident, known)
            frame = rows_frame(rows, ident, label, method)
            if (why := count_mismatch(counted, len(frame), filtered, "the actor", method)) is not None:
                raise Failed(why)
            collected.append((label, ident, info, frame))
        except Failed as e:
            failed.append({"url": label, "kind": kind if kind != "ok" else "failed", "error": str(e), **ident})
    return assemble(collected, failed, filtered=filtered)
