"""What every source that asks many ranks shares: targets, identity, rows, and the one result type.

A source over a fleet of ranks (HTTP agents, vLLM workers, SGLang schedulers, Ray
actors) says only how to ask its engine; this module says what an answer must be:

- **targets**: URLs (or labels) to ask, each with the identity the caller expects there;
- **identity**: what a rank claims (``role``, ``rank``, ``dp``, ``pp``, ``tp``, ``ep``,
  ``host``), checked the same way everywhere (integers, never booleans) and against
  what was expected;
- **rows**: a rank's answer as a schema-valid frame that carries exactly its identity;
- **the result**: :class:`FetchResult` (one frame of every rank that answered, one
  ``failed`` frame for every rank that did not, or answered nothing) and
  :class:`ActionResult` for a mutation sent to every rank.

Kinds of failure, in ``FetchResult.failed``: ``unreachable`` (no answer), ``failed`` (an
error answer, a table that does not hold up, a claim another rank also makes) and
``empty`` (it answered, holding no parameters: released or offloaded weights).
"""

from __future__ import annotations

import re

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd

from wcviz._errors import TableError
from wcviz.frame import IDENTITY, coordinate_problem, make_frame, validate
from wcviz.sources._wire import RankTable, frame_of_tables

if TYPE_CHECKING:
    import httpx

__all__ = [
    "FAILED_COLUMNS",
    "KEY",
    "ActionResult",
    "Empty",
    "Failed",
    "FetchResult",
    "NotDelivered",
    "NotRun",
    "Refused",
    "Targets",
    "Unreachable",
    "assemble",
    "assemble_tables",
    "check_expected",
    "checked_url",
    "count_mismatch",
    "empty_reason",
    "identity_of",
    "key_of",
    "message_of",
    "normalize",
    "rows_frame",
]

FAILED_COLUMNS = ("url", "kind", "error", "role", *IDENTITY, "host")
KEY = ("role",) + IDENTITY  # what makes two ranks the same rank
_IDENTITY_FIELDS = (*KEY, "host")

Targets = Sequence[str] | str | Mapping[str, Mapping[str, Any]]


# --------------------------------------------------------------------------- what can go wrong with one rank


class Unreachable(Exception):
    """No answer at all: refused, reset or timed out (after the retries)."""


class Failed(Exception):
    """An answer that is an error, or not a valid digest table."""


class Empty(Failed):
    """An answer with no parameters at all: the rank holds nothing to check."""


class NotRun(Exception):
    """Mixed in where a request certainly did not run its action (refused, or never delivered)."""


class Refused(Failed, NotRun):
    """A 4xx answer to a mutation: the agent refused it before running anything."""


class NotDelivered(Unreachable, NotRun):
    """The connection was refused: the request never reached the rank."""


MAX_IMPLIED_RANKS = 65_536  # an answer implying more ranks than this is not listed rank by rank (nor trusted)
_BACKOFF_S = 0.1
_BACKOFF_MAX_S = 2.0  # the pause before a retry doubles up to this: --retries 20 costs ~20 timeouts, not a day


def backoff_s(attempt: int) -> float:
    """The pause before retry ``attempt`` (1, 2, ...) of a read: doubling from 0.1 s, never above 2 s."""
    return min(_BACKOFF_S * 2.0 ** min(attempt - 1, 32), _BACKOFF_MAX_S)


def kind_of(error: BaseException) -> str:
    """``unreachable``, ``empty`` or ``failed``: the ``kind`` column of a failed rank."""
    if isinstance(error, Unreachable):
        return "unreachable"
    return "empty" if isinstance(error, Empty) else "failed"


def message_of(resp: httpx.Response) -> str:
    """An HTTP error answer's JSON ``error`` (its ``message`` when it is an object, as vLLM's are), ``message`` or
    ``detail``, or the start of whatever else the body holds. Never raises for the body: one the parser refuses
    (not JSON, a number past Python's digit limit, nesting past its recursion limit) is shown as text."""
    try:
        body = resp.json()
    except (ValueError, RecursionError):
        body = None
    if isinstance(body, dict):
        for k in ("error", "message", "detail"):
            if k in body:
                said = body[k]
                if isinstance(said, dict) and "message" in said:  # vLLM: {"error": {"message", "type", "param", "code"}}
                    said = said["message"]
                try:
                    return str(said)
                except (ValueError, RecursionError):  # a value nested too deep to print: shown as text below
                    break
    return resp.text[:200] or resp.reason_phrase


# --------------------------------------------------------------------------- targets


_CREDENTIALS = re.compile(r"^(\s*(?:[A-Za-z][A-Za-z0-9+.-]*:)?//)?[^/?#\s]*@")  # what precedes a host's last @


def checked_url(url: Any, kind: str = "agent") -> str:
    """``url`` without a trailing slash, once it is an ``http(s)://host[:port]`` address (``kind="engine"``: with an
    optional path prefix, as behind an ingress); else a ValueError naming it (never echoing a password in it)."""
    import httpx

    text = str(url).strip().rstrip("/")
    shown = _CREDENTIALS.sub(r"\1<credentials>@", text)[:200]  # what errors quote: never a password
    try:
        parsed = httpx.URL(text)
    except (httpx.InvalidURL, TypeError, ValueError) as e:
        said, m = str(e), _CREDENTIALS.match(text)
        for secret in filter(None, re.split(r"[:@]", m.group(0)[len(m.group(1) or "") :]) if m else ()):
            said = said.replace(secret, "<credentials>")  # httpx may quote any part of what it could not parse
        raise ValueError(f"{shown!r} is not a URL ({said})") from None
    if parsed.userinfo:
        raise ValueError(f"the {kind} URL for {parsed.host} holds a user name or password: pass a bearer token (token=...), not URL credentials")
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{shown!r} is not an {kind} URL: expected http://host:port (or https://)")
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise ValueError(f"{shown!r} is not an {kind} URL: port {parsed.port} is not 1..65535")
    path = kind == "agent" and parsed.path not in ("", "/")
    extra = [what for what, there in (("a path", path), ("a query", parsed.query), ("a fragment", parsed.fragment)) if there]
    if extra:
        root = " (the agent serves /v1/... at its root)" if kind == "agent" else ""
        raise ValueError(f"{shown!r} is not an {kind} URL: it has {' and '.join(extra)}; expected http://host:port{root}")
    return text


def checked_expected(label: str, ident: Any) -> dict[str, Any]:
    """The identity a caller expects of one target, checked for its keys."""
    if not isinstance(ident, Mapping):
        raise TypeError(f"the identity expected at {label} must be a mapping (role, rank, dp, pp, tp, ep), got {type(ident).__name__}")
    unknown = sorted(set(ident) - set(_IDENTITY_FIELDS))
    if unknown:
        raise ValueError(f"the identity expected at {label} has unknown key(s) {', '.join(unknown)}; allowed: {', '.join(KEY)}, host")
    return dict(ident)


def normalize(urls: Targets) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
    """The URLs (checked, each once), and the identity expected at each (empty when only URLs are given)."""
    if isinstance(urls, str):
        urls = [urls]
    pairs = list(urls.items()) if isinstance(urls, Mapping) else [(u, {}) for u in urls]
    out = tuple(checked_url(u) for u, _ in pairs)
    seen: set[str] = set()
    for u in out:
        if u in seen:
            raise ValueError(f"URL {u} is given twice; each rank must be fetched once")
        seen.add(u)
    return out, [checked_expected(u, ident) for u, (_, ident) in zip(out, pairs)]


# --------------------------------------------------------------------------- identity and rows


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def identity_of(info: Any, what: str) -> dict[str, Any]:
    """The identity a rank's info claims (role, rank, dp, pp, tp, ep, host), or :class:`Failed` saying why not."""
    if not isinstance(info, dict):
        raise Failed(f"{what} answered {str(info)[:200]!r}, not a rank's info")
    if info.get("rank") is None and "error" in info:
        raise Failed(f"{what} answered an error: {info['error']}")
    if not isinstance(info.get("role"), str) or not _is_int(info.get("rank")):
        raise Failed(f"{what} is not a rank's info (needs a role and an integer rank): {str(info)[:200]}")
    for k in IDENTITY[1:]:
        if info.get(k) is not None and not _is_int(info[k]):
            raise Failed(f"{what} has a non-integer {k}: {info[k]!r}")
    for k in IDENTITY:
        if info.get(k) is not None and (why := coordinate_problem(k, info[k])) is not None:
            raise Failed(f"{what} has {k}={info[k]!r}, {why}")
    return {k: info.get(k) for k in _IDENTITY_FIELDS}


def key_of(ident: Mapping[str, Any]) -> tuple[Any, ...]:
    """What makes two ranks the same rank: (role, rank, dp, pp, tp, ep)."""
    return tuple(ident.get(k) for k in KEY)


def check_expected(ident: Mapping[str, Any], expected: Mapping[str, Any], said_by: str, target: str = "this URL") -> None:
    """A rank must be the one the caller says lives at ``target`` (a launcher that mixed ranks up)."""
    wrong = [k for k in KEY if expected.get(k) is not None and ident.get(k) != expected[k]]
    if wrong:
        said = ", ".join(f"{k}={ident.get(k)}" for k in wrong)
        want = ", ".join(f"{k}={expected[k]}" for k in wrong)
        raise Failed(f"{said_by} says {said} but {target} was expected to serve {want}")


def rows_frame(rows: Any, ident: Mapping[str, Any], label: str, what: str) -> pd.DataFrame:
    """A rank's rows as a schema-valid frame that carries exactly ``ident``, with a ``url`` column (``label``)."""
    if isinstance(rows, pd.DataFrame):
        rows = rows.to_dict(orient="records")
    if not isinstance(rows, list) or not all(isinstance(r, Mapping) for r in rows):
        raise Failed(f"{what} did not give a list of row dicts: {str(rows)[:200]}")
    try:
        frame = make_frame(rows)
    except TableError as e:
        raise Failed(f"{what} is not a digest table: {e}") from None
    for k in KEY:
        want = ident.get(k)
        col = frame[k]
        wrong = col.notna() if want is None else (col.isna() | (col != want))
        if bool(wrong.any()):
            raise Failed(f"{what} rows claim {k}={col[wrong].iloc[0]!r} but the rank's info says {k}={want!r}")
    frame["url"] = label
    return frame


def count_mismatch(
    info: Mapping[str, Any] | None, rows: int, filtered: bool, counted_by: str, answered_by: str
) -> str | None:
    """Why a rank's answer cannot be all it holds (its info counts ``params`` parameters, the answer gave another
    number of rows: lost or added on the way), or None. Rows a name filter chose (``filtered``) are not counted."""
    params = info.get("params") if isinstance(info, Mapping) else None
    if filtered or not _is_int(params) or params == rows:
        return None
    return f"{counted_by} counts {params} parameters but {answered_by} gave {rows} rows"


def empty_reason(info: Mapping[str, Any] | None, rows: int, filtered: bool) -> str | None:
    """Why a rank that answered counts as empty (its info counts no parameters, or it gave no rows
    unfiltered), or None. A name filter that matches nothing on a rank is not an empty rank."""
    params = info.get("params") if isinstance(info, Mapping) else None
    if _is_int(params) and params == 0:
        return "holds no parameters (its info counts 0): weights released or offloaded, or a mis-wired holder"
    if not filtered and rows == 0:
        return "answered with no parameters: weights released or offloaded, or a mis-wired holder"
    return None


# --------------------------------------------------------------------------- results


@dataclass
class FetchResult:
    """What a fetch collected: the rows of the ranks that answered, and the ranks that did not.

    ``frame`` is schema-valid (:func:`wcviz.frame.validate`) with an extra ``url`` column;
    ``failed`` has :data:`FAILED_COLUMNS` with ``kind`` ``unreachable`` (no answer),
    ``failed`` (an error answer or a table that does not hold up) or ``empty`` (it
    answered, holding no parameters); ``errors`` maps those URLs to their message;
    ``infos`` maps each answering URL to its info. Every target is in exactly one of
    the two frames.
    """

    urls: tuple[str, ...]
    frame: pd.DataFrame
    failed: pd.DataFrame
    errors: dict[str, str] = field(default_factory=dict)
    infos: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def answered(self) -> int:
        """How many ranks answered with a digest table (an empty one included)."""
        silent = int((self.failed["kind"] != "empty").sum()) if len(self.failed) else 0
        return len(self.urls) - silent

    @property
    def complete(self) -> bool:
        """True only when every target was collected, none empty (and at least one was given)."""
        return bool(self.urls) and not self.errors

    @property
    def summary(self) -> str:
        """One line: ``3 of 4 ranks answered; 1 unreachable: URL (why)``."""
        parts = [f"{self.answered} of {len(self.urls)} ranks answered"]
        for kind in ("unreachable", "failed", "empty"):
            rows = self.failed[self.failed["kind"] == kind]
            if len(rows):
                listed = ", ".join(f"{r.url} ({r.error})" for r in rows.itertuples())
                parts.append(f"{len(rows)} {kind}: {listed}")
        return "; ".join(parts)

    def __str__(self) -> str:
        return self.summary

    def with_failed(self, rows: Sequence[Mapping[str, Any]]) -> FetchResult:
        """This result and more ranks that did not answer (each row: ``url``, ``kind``, ``error`` and its identity)."""
        if not rows:
            return self
        extra = _failed_frame(rows)
        return FetchResult(
            urls=self.urls + tuple(str(r["url"]) for r in rows),
            frame=self.frame,
            failed=pd.concat([self.failed, extra], ignore_index=True) if len(self.failed) else extra,
            errors={**self.errors, **{str(r["url"]): str(r["error"]) for r in rows}},
            infos=dict(self.infos),
        )


def _failed_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    frame = pd.DataFrame([{c: row.get(c) for c in FAILED_COLUMNS} for row in rows], columns=list(FAILED_COLUMNS))
    for c in FAILED_COLUMNS:
        frame[c] = frame[c].astype("Int64" if c in IDENTITY else "string")
    return frame


@dataclass
class ActionResult:
    """What one mutation sent to many ranks did: each target's answer body, or its error.

    ``unreachable``: the targets that gave no answer. ``not_run``: the targets where
    the action certainly did not run (refused with a 4xx, or the connection was
    refused): a reset there poisoned nothing.
    """

    action: str
    urls: tuple[str, ...]
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    unreachable: set[str] = field(default_factory=set)
    not_run: set[str] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        """True only when every target acknowledged the action."""
        return bool(self.urls) and not self.errors

    @property
    def summary(self) -> str:
        """One line: ``reset: 3 of 4 ranks acknowledged; URL (why)``."""
        parts = [f"{self.action}: {len(self.answers)} of {len(self.urls)} ranks acknowledged"]
        if self.errors:
            parts.append(", ".join(f"{u} ({e})" for u, e in self.errors.items()))
        return "; ".join(parts)

    def record(self, url: str, outcome: Any) -> None:
        """File one target's outcome: an answer dict, or the exception its request ended in."""
        if not isinstance(outcome, BaseException):
            self.answers[url] = outcome
            return
        self.errors[url] = str(outcome) if isinstance(outcome, (Unreachable, Failed)) else _one_line(outcome)
        if isinstance(outcome, Unreachable):
            self.unreachable.add(url)
        if isinstance(outcome, NotRun):
            self.not_run.add(url)


def _one_line(e: BaseException) -> str:
    from wcviz._text import one_line

    return one_line(e)


Collected = tuple[str, dict[str, Any], dict[str, Any], pd.DataFrame]  # (label, identity, info, frame)


def _sortable(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """An identity key that sorts with None last (role, then rank, dp, pp, tp, ep)."""
    return tuple((v is None, v if v is not None else 0) for v in key)


def assemble(
    collected: Sequence[Collected],
    failed: Sequence[dict[str, Any]],
    *,
    filtered: bool = False,
    targets: Sequence[str] | None = None,
) -> FetchResult:
    """The one :class:`FetchResult` from the ranks collected and the failure rows (``url``, ``kind``,
    ``error`` and the identity known).

    Two answers that claim one rank fail both (neither can be trusted to be it); a
    rank with no parameters is ``empty`` (``filtered``: the rows were filtered by name,
    so no rows alone does not make a rank empty). The frame is ordered by rank
    identity, never by arrival. ``targets``: the targets in the caller's order (the
    result's ``urls``, and the order of ``failed``); without them, labels given twice
    get `` #1``, `` #2`` so each names one target, and ``failed`` is ordered by identity.
    """
    kept, failures, urls = _triage([(lb, ident, info, frame, len(frame)) for lb, ident, info, frame in collected], failed, filtered, targets)
    frames = []
    for label, _, frame in kept:
        frame["url"] = label
        if len(frame):
            frames.append(frame)
    if frames:
        frame = pd.concat(frames, ignore_index=True).sort_values(list(KEY), kind="stable", na_position="last")
        frame = validate(frame.reset_index(drop=True), source="ranks")
    else:
        frame = _no_rows()
    frame["url"] = frame["url"].astype("string")
    return _result(urls, *_audit(frame, failures, kept, filtered))


def assemble_tables(
    collected: Sequence[tuple[str, dict[str, Any], dict[str, Any], RankTable]],
    failed: Sequence[dict[str, Any]],
    what: str,
    *,
    filtered: bool = False,
    targets: Sequence[str] | None = None,
) -> FetchResult:
    """:func:`assemble` for ranks that answered tables (:class:`~wcviz.sources._wire.RankTable`, already checked
    against their identity): the ranks kept, in identity order, become one frame built and validated once. Only
    when a value does not hold up is each rank's table made a frame of its own, to fail the rank it came from
    (``what`` names the answer in that rank's error)."""
    kept, failures, urls = _triage([(lb, ident, info, t, t.count) for lb, ident, info, t in collected], failed, filtered, targets)
    tables = [(label, table) for label, _, table in kept if table.count]
    try:
        frame = frame_of_tables(tables) if tables else _no_rows()
    except TableError:  # someone's values are bad: find whose, rank by rank (the slow way, only now)
        frames: list[Collected] = []
        bad: list[dict[str, Any]] = []
        for label, ident, info, table in collected:
            try:
                frames.append((label, ident, info, rows_frame(table.rows(), ident, label, what)))
            except Failed as e:
                bad.append({"url": label, "kind": "failed", "error": str(e), **ident})
        return assemble(frames, [*failed, *bad], filtered=filtered, targets=targets)
    return _result(urls, *_audit(frame, failures, kept, filtered))


def _audit(
    frame: pd.DataFrame, failures: list[dict[str, Any]], kept: Sequence[tuple[str, dict[str, Any], Any]], filtered: bool
) -> tuple[pd.DataFrame, list[dict[str, Any]], list[tuple[str, dict[str, Any], Any]]]:
    """What no single row shows, rank by rank (``url``): a parameter listed twice or a negative byte count fail
    the rank (its table cannot be trusted to say what it holds), and a rank whose every parameter is zero bytes
    is ``empty`` unless a name filter chose them (weights released or offloaded to size 0 still list their
    names). Those ranks' rows leave the frame; vectorised, so a fleet's frame costs one pass."""
    if not len(frame):
        return frame, failures, list(kept)
    why: dict[str, tuple[str, str]] = {}
    dup = frame.duplicated(["url", "name"], keep=False)  # one answer is one phase: a name twice under two is twice
    for url, name in frame.loc[dup, ["url", "name"]].drop_duplicates("url").itertuples(index=False):
        why[str(url)] = ("failed", f"lists parameter {name!r} more than once: its table cannot say what it holds")
    negative = frame["nbytes"].notna() & (frame["nbytes"].fillna(0) < 0)
    for url, name, n in frame.loc[negative, ["url", "name", "nbytes"]].drop_duplicates("url").itertuples(index=False):
        why.setdefault(str(url), ("failed", f"gives parameter {name!r} a byte count of {n}"))
    if not filtered:
        zero = (frame["nbytes"] == 0).fillna(False).groupby(frame["url"], sort=False).all()
        for url in zero.index[zero.to_numpy()]:
            why.setdefault(str(url), ("empty", "holds only zero-byte parameters: weights released or offloaded, or a mis-wired holder"))
    if not why:
        return frame, failures, list(kept)
    idents = frame.drop_duplicates("url").set_index("url")
    for url, (kind, error) in why.items():
        row = idents.loc[url]
        ident = {k: (None if pd.isna(row[k]) else (int(row[k]) if k in IDENTITY else str(row[k]))) for k in _IDENTITY_FIELDS if k in row}
        failures.append({"url": url, "kind": kind, "error": error, **ident})
    frame = frame[~frame["url"].isin(list(why))].reset_index(drop=True)
    return frame, failures, [k for k in kept if k[0] not in why]


def _no_rows() -> pd.DataFrame:
    frame = make_frame([])
    frame["url"] = pd.Series(dtype="string")
    return frame


def _result(urls: tuple[str, ...], frame: pd.DataFrame, failures: list[dict[str, Any]], kept: Sequence[tuple[str, dict[str, Any], Any]]) -> FetchResult:
    return FetchResult(
        urls=urls,
        frame=frame,
        failed=_failed_frame(failures),
        errors={str(f["url"]): str(f["error"]) for f in failures},
        infos={lb: info for lb, info, _ in kept},
    )


def _triage(
    collected: Sequence[tuple[str, dict[str, Any], dict[str, Any], Any, int]],
    failed: Sequence[dict[str, Any]],
    filtered: bool,
    targets: Sequence[str] | None,
) -> tuple[list[tuple[str, dict[str, Any], Any]], list[dict[str, Any]], tuple[str, ...]]:
    """Which ranks are kept (``(label, info, payload)`` in identity order), every failure row, and the result's
    urls: what :func:`assemble` decides before any frame is touched (``collected``: label, identity, info,
    payload, its row count)."""
    failures = [dict(f) for f in failed]
    by_key: dict[tuple[Any, ...], list[tuple[str, dict[str, Any], dict[str, Any], Any]]] = {}
    for label, ident, info, payload, count in collected:
        why = empty_reason(info, count, filtered)
        if why is not None:
            failures.append({"url": label, "kind": "empty", "error": why, **ident})
        else:
            by_key.setdefault(key_of(ident), []).append((label, ident, info, payload))
    kept: list[tuple[str, dict[str, Any], Any]] = []
    for key, claims in sorted(by_key.items(), key=lambda kv: _sortable(kv[0])):
        if len(claims) > 1:
            rank = ", ".join(f"{k}={v}" for k, v in zip(KEY, key) if v is not None)
            for label, ident, _, _ in claims:
                others = ", ".join(lb for lb, *_ in claims if lb != label)
                why = f"as {others}" if others else f"{len(claims)} times under this one label (one rank listed more than once)"
                failures.append({"url": label, "kind": "failed", "error": f"claims the same rank ({rank}) {why}", **ident})
            continue
        label, _, info, payload = claims[0]
        kept.append((label, info, payload))
    if targets is None:
        kept, failures = _unique_labels(kept, failures)
        failures.sort(key=lambda row: (_sortable(key_of(row)), str(row["url"])))
        urls = tuple([lb for lb, _, _ in kept] + [str(f["url"]) for f in failures])
    else:
        order = {u: i for i, u in enumerate(targets)}
        failures.sort(key=lambda row: order.get(str(row["url"]), len(order)))
        urls = tuple(targets)
    return kept, failures, urls


def _unique_labels(kept: list[tuple[str, dict[str, Any], Any]], failures: list[dict[str, Any]]) -> tuple[list[tuple[str, dict[str, Any], Any]], list[dict[str, Any]]]:
    """Labels given twice (two workers with one label) become `` #1``, `` #2``: each names one target."""
    from collections import Counter

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
    return kept, failures
