"""The end-state check's judgement: from three phases' digest frames to one verdict per (rank, parameter).

Order of the check, for every engine rank (the session that runs it is
:mod:`wcviz.endstate.session`):

1. **snapshot** - digest what the rank holds (phase ``snapshot``);
2. **reset** - overwrite every parameter with a known pattern
   (:func:`wcviz.endstate.poison_`) and digest again (phase ``reset``). The pattern's
   bytes, each parameter's dtype and shape are known, so the digest a *fully* reset
   parameter must have is computable (:func:`wcviz.digest.fill_digest`); the check
   is void when a reset digest is anything else (:func:`reset_coverage`,
   :class:`ResetNotCovered`): a parameter the reset changed only in part cannot show
   whether the update wrote the rest;
3. **reload** - run the weight update again and digest (phase ``reload``);
4. **classify** - compare reload with snapshot per (rank, parameter). The statuses
   (``corrupted``, ``unwritten``, ``missing``, ``empty``, ``unreachable``,
   ``unexpected``, ``unproven``, ``match``) and the verdict columns are
   :mod:`wcviz.verdicts`'. A parameter whose snapshot already held wcviz's poison (an
   earlier check's reload failed there) has no reference: ``unwritten`` if it still
   holds the pattern after the reload, else ``unproven`` (never ``corrupted`` or
   ``match``).

Ranks are matched by their coordinates (:data:`wcviz.frame.IDENTITY`), never by row
order. Nothing here fetches or acts: it reads frames.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from wcviz._errors import AlgorithmMismatch, TableError, WcvizError
from wcviz._text import listing, rank_label
from wcviz.endstate.poison import POISON_BYTES
from wcviz.frame import IDENTITY, check_identities, check_unique_keys, validate
from wcviz.verdicts import ENDSTATE_STATUSES, worst_first

__all__ = ["PHASES", "RESET_PATTERNS", "ResetNotCovered", "classify", "reset_coverage"]

PHASES = ("snapshot", "reset", "reload")
# What a reset writes: wcviz's poison (either byte), zeros (vLLM's own reset), one given byte
# (an int), or "unknown" (SGLang's random values): then no reset can prove coverage.
RESET_PATTERNS = ("poison", "zeros", "unknown")

_KEYS = [*IDENTITY, "name"]


class ResetNotCovered(WcvizError, RuntimeError):
    """The reset did not fully overwrite some parameters, so the end-state check is void.

    ``coverage`` is the :func:`reset_coverage` frame the verdict was drawn from;
    ``poisoned`` names the ranks a failed reload left poisoned (said first in the message).
    """

    def __init__(self, message: str, coverage: pd.DataFrame, poisoned: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.coverage = coverage
        self.poisoned = poisoned

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.coverage, self.poisoned))


def _empty_tensor(nbytes: pd.Series, shape: pd.Series) -> pd.Series:
    """Rows of tensors without bytes: ``nbytes`` 0 where the shape does not say otherwise, else a zero in ``shape``.
    A row that claims no bytes for a shape with elements proves nothing by being empty: it is not empty."""

    def elements(s: Any) -> int | None:
        if pd.isna(s):
            return None
        try:
            return int(math.prod(json.loads(str(s))))
        except (ValueError, TypeError, OverflowError, RecursionError):
            return None

    counts = [elements(s) for s in shape]
    by_shape = pd.Series([n == 0 for n in counts], index=shape.index, dtype=bool)
    has_elements = pd.Series([n is not None and n > 0 for n in counts], index=shape.index, dtype=bool)
    return ((nbytes == 0) & ~has_elements).fillna(by_shape).astype(bool)


def prepare_phases(frames: Mapping[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """Validate each phase's frame; one algorithm, one coordinate system, unique keys, one identity per rank."""
    out = {phase: validate(df, phase) for phase, df in frames.items()}
    algos: dict[str, str] = {}
    for phase, df in out.items():
        found = sorted(df["algo"].dropna().unique())
        if len(found) > 1:
            raise AlgorithmMismatch(f"{phase} table mixes digest algorithms: {', '.join(found)}")
        if found:
            algos[phase] = found[0]
    if len(set(algos.values())) > 1:
        raise AlgorithmMismatch("end-state tables use different digest algorithms: " + ", ".join(f"{p} {a}" for p, a in algos.items()))
    used = {phase: [c for c in IDENTITY if df[c].notna().any()] for phase, df in out.items() if len(df)}
    if len({tuple(u) for u in used.values()}) > 1:
        raise TableError(
            "end-state tables locate ranks by different coordinates: "
            + "; ".join(f"{p} by ({', '.join(u) or 'nothing'})" for p, u in used.items())
            + ": digest every phase with the same rank fields"
        )
    for phase, df in out.items():
        check_unique_keys(df, _KEYS, phase)
        check_identities(df, phase)
    return out


def check_reset_pattern(pattern: Any) -> None:
    """Raise the ValueError :func:`classify` would, for a ``reset_pattern`` it cannot read: before a reset, not after."""
    _pattern_bytes(pattern)


def _pattern_bytes(pattern: str | int) -> tuple[int, ...]:
    """The bytes a reset of ``pattern`` may leave in every byte of a parameter (empty: not computable)."""
    if isinstance(pattern, bool):
        raise ValueError(f"reset_pattern must be one of {', '.join(RESET_PATTERNS)} or a byte 0..255, got {pattern!r}")
    if isinstance(pattern, int):
        if not 0 <= pattern <= 255:
            raise ValueError(f"reset_pattern byte must be 0..255, got {pattern}")
        return (pattern,)
    if pattern == "poison":
        return POISON_BYTES
    if pattern == "zeros":
        return (0,)
    if pattern == "unknown":
        return ()
    raise ValueError(f"reset_pattern must be one of {', '.join(RESET_PATTERNS)} or a byte 0..255, got {pattern!r}")


def _pattern_digests(rows: pd.DataFrame, fill: tuple[int, ...]) -> pd.Series:
    """Per row (``algo``, ``dtype``, ``shape``, ``nbytes``): the digests a parameter fully reset to one of
    ``fill``'s bytes must have, as a tuple; None where they cannot be computed (another algorithm, no
    dtype or shape; for the engines' algorithms, which hash bytes alone, no ``nbytes``). Computed once
    per distinct (algo, dtype, shape, nbytes)."""
    from wcviz.digest import ENGINE_ALGORITHMS, FILL_ALGORITHMS, fill_digest, parse_dtype

    cols = ["algo", "dtype", "shape", "nbytes"]
    if not fill or not len(rows):
        return pd.Series([None] * len(rows), index=rows.index, dtype="object")
    keys = rows[cols].astype("object").where(rows[cols].notna(), None)
    distinct = keys.drop_duplicates()

    def digests(algo: Any, dtype: Any, shape: Any, nbytes: Any) -> Any:
        try:
            size = None if nbytes is None else int(nbytes)
            if size is not None and dtype is not None and shape is not None:
                try:
                    implied = math.prod(int(d) for d in json.loads(str(shape))) * parse_dtype(str(dtype)).itemsize
                except (ValueError, TypeError, RecursionError, WcvizError):
                    implied = size  # a dtype this PyTorch cannot read: the byte count stands alone
                if implied != size:
                    return None  # a row that contradicts itself proves nothing (and its count is not to be trusted)
            if size is not None and size < 0:
                return None
            if algo in ENGINE_ALGORITHMS and size is not None:  # the engines hash bytes alone: the count is all it takes
                return tuple(fill_digest(str(algo), "uint8", [size], size, b) for b in fill)
            if algo not in FILL_ALGORITHMS or dtype is None or shape is None:
                return None
            dims = [int(d) for d in json.loads(str(shape))]
            size = math.prod(dims) * parse_dtype(str(dtype)).itemsize if size is None else size
            return tuple(fill_digest(str(algo), str(dtype), dims, size, b) for b in fill)
        except (ValueError, TypeError, RecursionError, OverflowError, WcvizError):
            return None  # a shape, dtype or count this PyTorch cannot read: not computable

    distinct = distinct.assign(_expected=[digests(*k) for k in distinct.itertuples(index=False, name=None)])
    merged = keys.merge(distinct, on=cols, how="left")["_expected"]
    return pd.Series(merged.to_numpy(), index=rows.index, dtype="object")


def holds_reset_pattern(frame: pd.DataFrame, pattern: str | int) -> pd.Series:
    """Which rows (with bytes) digest as the tensor fully overwritten with ``pattern``: a rank that serves it is still
    poisoned from an earlier reset. False where it cannot be computed."""
    expected = _pattern_digests(frame, _pattern_bytes(pattern))
    hits = [e is not None and isinstance(d, str) and d.lower() in e for e, d in zip(expected, frame["digest"])]
    return pd.Series(hits, index=frame.index, dtype=bool) & ~_empty_tensor(frame["nbytes"], frame["shape"])


def _coverage(snap: pd.DataFrame, reset: pd.DataFrame, pattern: str | int = "poison") -> pd.DataFrame:
    fill = _pattern_bytes(pattern)
    left = snap[_KEYS + ["digest", "algo", "dtype", "shape", "nbytes"]]
    m = left.merge(reset[_KEYS + ["digest", "dtype", "shape"]], on=_KEYS, how="left", suffixes=("_snapshot", "_reset"))
    out = m[_KEYS].copy()
    out["digest_snapshot"] = m["digest_snapshot"]
    out["digest_reset"] = m["digest_reset"]
    out["empty"] = _empty_tensor(m["nbytes"], m["shape_snapshot"])
    present = m["digest_reset"].notna()
    snapshot, after = m["digest_snapshot"].str.lower(), m["digest_reset"].str.lower()
    out["changed"] = (present & (snapshot != after)).fillna(False).astype(bool)
    shapes = m.assign(dtype=m["dtype_reset"].fillna(m["dtype_snapshot"]), shape=m["shape_reset"].fillna(m["shape_snapshot"]))
    expected = _pattern_digests(shapes, fill)
    # a row that claims no bytes proves itself only if its digest is the digest of no bytes (where that can be
    # computed): a size row of 0 for a parameter whose digest is of real bytes is not an empty tensor
    contradicted = [bool(e is not None and isinstance(d, str) and d not in e) for e, d in zip(expected, snapshot)]
    out["empty"] = out["empty"] & ~pd.Series(contradicted, index=m.index, dtype=bool)
    provable = expected.map(lambda e: e is not None).astype(bool)
    hits = [e is not None and isinstance(a, str) and a in e for e, a in zip(expected, after)]
    full = pd.Series(hits, index=m.index, dtype=bool)
    out["digest_pattern"] = pd.Series(
        [pd.NA if e is None else (a if hit else e[0]) for e, a, hit in zip(expected, after, hits)], index=m.index, dtype="string"
    )
    out["full"] = full & present
    out["covered"] = out["full"] & out["changed"] & ~out["empty"]
    # void: the reset fell short of its pattern (or, unprovable, changed nothing at all)
    out["void"] = ~out["empty"] & (~present | (provable & ~out["full"]) | (~provable & ~out["changed"]))
    out["why"] = pd.Series(pd.NA, index=m.index, dtype="string")
    out.loc[~present, "why"] = "absent after reset"
    out.loc[present & ~out["changed"], "why"] = "unchanged by the reset"
    out.loc[present & out["changed"] & provable & ~out["full"], "why"] = "only partly reset"
    out.loc[present & out["full"] & ~out["changed"], "why"] = "already held the reset pattern"
    out.loc[present & out["changed"] & ~provable, "why"] = "reset pattern not computable"
    out.loc[out["empty"], "why"] = "holds no bytes"
    return out.sort_values(_KEYS, na_position="first", kind="stable").reset_index(drop=True)


def reset_coverage(snapshot: pd.DataFrame, reset: pd.DataFrame, *, reset_pattern: str | int = "poison") -> pd.DataFrame:
    """Per (rank identity, name) of the snapshot: did the reset overwrite all of it?

    Columns: identity, ``name``, ``digest_snapshot``, ``digest_reset`` (NA if the
    parameter was absent after the reset), ``digest_pattern`` (the digest a parameter
    fully reset to ``reset_pattern`` must have; NA where it cannot be computed),
    ``empty`` (no bytes), ``changed``, ``full`` (the reset digest is the pattern's),
    ``covered`` (full, changed and not empty: a later match proves the update wrote
    it), ``void`` (the reset fell short: the check cannot stand) and ``why`` (a few
    words when not covered). ``reset_pattern``: see :data:`RESET_PATTERNS`.
    """
    p = prepare_phases({"snapshot": snapshot, "reset": reset})
    return _coverage(p["snapshot"], p["reset"], reset_pattern)


def _raise_if_uncovered(cov: pd.DataFrame) -> None:
    bad = cov[cov["void"]]
    if not len(bad):
        return
    nonempty = int((~cov["empty"]).sum())
    groups = []
    for why, said in (("unchanged by the reset", "unchanged"), ("only partly reset", "only partly reset"), ("absent after reset", "absent after reset")):
        rows = bad[bad["why"] == why]
        if len(rows):
            ranks = len(rows[list(IDENTITY)].drop_duplicates())
            where = listing([f"{r['name']} on {rank_label(r)}" for _, r in rows.iterrows()])
            groups.append(f"{len(rows):,} {said} on {ranks} rank{'s' if ranks != 1 else ''}: {where}")
    msg = (
        f"reset fully overwrote only {nonempty - len(bad):,} of {nonempty:,} parameters; the end-state check is void: "
        + "; ".join(groups)
    )
    if (bad["why"] == "only partly reset").any():
        msg += " (only partly reset: the digest after the reset is not that of the tensor fully overwritten with the reset pattern)"
    empty = cov[cov["empty"]]
    if len(empty):
        msg += f"; {len(empty):,} empty tensor(s) hold no bytes to reset: " + listing([f"{r['name']} on {rank_label(r)}" for _, r in empty.iterrows()])
    raise ResetNotCovered(msg, cov)


def _identities(ranks: pd.DataFrame | Iterable[Mapping[str, Any]] | None) -> pd.DataFrame:
    """Distinct rank identities (the :data:`IDENTITY` columns, Int64) of ``ranks``."""
    if ranks is None:
        return pd.DataFrame({c: pd.Series(dtype="Int64") for c in IDENTITY})
    df = ranks if isinstance(ranks, pd.DataFrame) else pd.DataFrame.from_records(list(ranks))
    if len(df) and not any(c in df.columns for c in IDENTITY):
        raise TableError(f"ranks need identity columns ({', '.join(IDENTITY)}); got {', '.join(map(str, df.columns))}")
    out = pd.DataFrame({c: pd.to_numeric(df[c]).astype("Int64") if c in df else pd.Series(pd.NA, index=df.index, dtype="Int64") for c in IDENTITY})
    if "url" in df:  # a rank with no coordinates at all is known only by where it was asked: two such stay two
        out["url"] = df["url"].astype("string").where(out.isna().all(axis=1), pd.NA)
    return out.drop_duplicates().reset_index(drop=True)


def _on_ranks(df: pd.DataFrame, ranks: pd.DataFrame) -> pd.Series:
    """Which rows of ``df`` belong to one of ``ranks`` (NA coordinates match NA)."""
    if not len(ranks):
        return pd.Series(False, index=df.index)
    hit = df[list(IDENTITY)].merge(ranks[list(IDENTITY)].drop_duplicates().assign(_hit=True), on=list(IDENTITY), how="left")["_hit"]
    return pd.Series(hit.notna().to_numpy(), index=df.index)


def _same_as(out: pd.DataFrame, snap: pd.DataFrame) -> pd.Series:
    """For corrupted rows: labels of the other ranks whose snapshot of the same name equals the reload."""
    result = pd.Series(pd.NA, index=out.index, dtype="string")
    bad = out[out["status"] == "corrupted"]
    if not len(bad):
        return result
    left = bad[_KEYS + ["digest_reload"]].assign(_row=bad.index, _digest=bad["digest_reload"].str.lower())
    right = snap[_KEYS + ["digest"]].assign(_digest=snap["digest"].str.lower()).drop(columns="digest")
    m = left.merge(right, on=["name", "_digest"], suffixes=("", "_other"))
    other = [f"{c}_other" for c in IDENTITY]
    same = pd.Series(True, index=m.index)
    for c in IDENTITY:
        a, b = m[c], m[f"{c}_other"]
        same &= ((a == b) | (a.isna() & b.isna())).fillna(False).astype(bool)
    m = m[~same]
    for row_id, group in m.groupby("_row", sort=False):
        labels = [rank_label(dict(zip(IDENTITY, r))) for r in group[other].itertuples(index=False)]
        result[row_id] = ", ".join(sorted(set(labels)))
    return result


def _zero_byte_ranks(snap: pd.DataFrame) -> pd.DataFrame:
    """Ranks whose every snapshot parameter is zero bytes: released or offloaded to size 0, they hold nothing to
    check (an empty tensor alone proves itself; a rank of nothing else is ``empty``, whatever fleet gave it)."""
    if not len(snap):
        return _identities(None)
    keys = list(IDENTITY)
    zero = (snap["nbytes"] == 0).fillna(False).astype(bool) & _empty_tensor(snap["nbytes"], snap["shape"])
    per_rank = zero.groupby([snap[k] for k in keys], dropna=False, sort=False).all()
    return _identities(per_rank[per_rank].index.to_frame(index=False))


def _whole_ranks(out: pd.DataFrame, ranks: pd.DataFrame, status: str) -> pd.DataFrame:
    """Every row of ``ranks`` gets ``status``; a rank with no row at all gets one with no name."""
    if not len(ranks):
        return out
    out.loc[_on_ranks(out, ranks), "status"] = status
    silent = ranks.merge(out[list(IDENTITY)].drop_duplicates(), on=list(IDENTITY), how="left", indicator=True)
    silent = silent[silent["_merge"] == "left_only"].drop(columns="_merge")
    if len(silent):  # a rank without rows still gets one: absent is not the same as fine
        ghost = silent.assign(status=status, reset_covered=False, rank_absent=True)
        out = pd.concat([out, ghost.astype({c: "Int64" for c in IDENTITY})], ignore_index=True)
        for col in ("status", "name", "algo", "same_as", "url"):
            if col in out:
                out[col] = out[col].astype("string")
    return out


def classify(
    snapshot: pd.DataFrame,
    reset: pd.DataFrame,
    reload: pd.DataFrame,
    *,
    allow_partial_reset: bool = False,
    reset_pattern: str | int = "poison",
    unreachable: pd.DataFrame | Iterable[Mapping[str, Any]] | None = None,
    empty: pd.DataFrame | Iterable[Mapping[str, Any]] | None = None,
) -> pd.DataFrame:
    """One end-state verdict per (rank identity, name), most severe first.

    Columns: identity, ``name``, ``status`` (:data:`ENDSTATE_STATUSES`), ``algo``,
    ``digest_snapshot``, ``digest_reset``, ``digest_reload``, ``dtype``, ``shape``,
    ``nbytes``, ``host`` (the snapshot's, else the reload's), ``dtype_reload``,
    ``shape_reload``, ``layer``, ``block``, ``expert``, ``reset_covered`` (the reset
    provably overwrote all of it: what makes a ``match`` a proof), ``rank_absent``
    (the rank has no rows at all after the reload) and ``same_as`` (for a corrupted row:
    the other ranks whose snapshot held exactly what this rank reloaded, e.g. two ranks
    that swapped shards), ``url`` (for a rank known only by the address it was asked at:
    no coordinates, e.g. an agent that never answered; NA otherwise).

    ``reset_pattern`` is what the reset writes (:data:`RESET_PATTERNS`: wcviz's
    ``poison``, vLLM's ``zeros``, a byte, or ``unknown`` for random values). Raises
    :class:`ResetNotCovered` if the reset left a non-empty parameter of an answering
    rank anything but fully reset (unchanged, partly reset, absent), unless
    ``allow_partial_reset``: then those parameters are ``unproven`` where the reload
    equals the snapshot. ``unreachable`` and ``empty`` name ranks (rows with identity
    columns, e.g. :attr:`wcviz.sources.FetchResult.failed`) that did not answer, or
    answered with no parameters, in some phase: all their rows get that status and
    they are left out of the reset coverage. A rank whose snapshot holds only
    zero-byte parameters is ``empty`` too.
    """
    p = prepare_phases({"snapshot": snapshot, "reset": reset, "reload": reload})
    snap, rst, rel = p["snapshot"], p["reset"], p["reload"]
    dead = _identities(unreachable)
    hollow = pd.concat([_identities(empty), _zero_byte_ranks(snap)], ignore_index=True).drop_duplicates()
    cov = _coverage(snap, rst, reset_pattern)
    if not allow_partial_reset:
        _raise_if_uncovered(cov[~_on_ranks(cov, dead) & ~_on_ranks(cov, hollow)])
    extra = ["digest", "dtype", "shape", "nbytes", "layer", "block", "expert", "host"]
    m = snap[_KEYS + extra].merge(rel[_KEYS + extra], on=_KEYS, how="outer", suffixes=("_snapshot", "_reload"), indicator=True)
    m = m.merge(rst[_KEYS + ["digest"]].rename(columns={"digest": "digest_reset"}), on=_KEYS, how="left")
    m = m.merge(cov[_KEYS + ["covered", "empty"]], on=_KEYS, how="left")

    s, r, z = (m[f"digest_{p}"].str.lower() for p in ("snapshot", "reset", "reload"))
    both = m["_merge"] == "both"
    proven = (m["covered"].fillna(False) | m["empty"].fillna(False)).astype(bool)
    status = pd.Series("missing", index=m.index, dtype="string")
    status[m["_merge"] == "right_only"] = "unexpected"
    same_snap = (z == s).fillna(False).astype(bool)
    same_reset = (z == r).fillna(False).astype(bool)
    status[both & ~same_snap & ~same_reset] = "corrupted"
    status[both & ~same_snap & same_reset] = "unwritten"
    status[both & same_snap & ~proven] = "unproven"
    status[both & same_snap & proven] = "match"
    if reset_pattern == "poison":  # wcviz's poison never occurs in real weights: a snapshot of it is no reference
        algo_of = pd.concat([snap["algo"], rel["algo"]]).dropna()
        rows = lambda side: pd.DataFrame(  # noqa: E731 - the pattern's columns from one side of the merge
            {"algo": algo_of.iloc[0] if len(algo_of) else pd.NA, **{c: m[f"{c}_{side}"] for c in ("digest", "dtype", "shape", "nbytes")}}
        )
        stale = both & holds_reset_pattern(rows("snapshot"), "poison")  # an earlier reset that was never reloaded
        still = same_reset | holds_reset_pattern(rows("reload"), "poison")
        status[stale & still] = "unwritten"  # the rank serves the reset pattern after this reload too
        status[stale & ~still] = "unproven"  # rewritten, but with nothing to compare it to

    out = m[_KEYS].copy()
    out["status"] = status
    algo = pd.concat([snap["algo"], rst["algo"], rel["algo"]]).dropna()
    out["algo"] = pd.Series(algo.iloc[0] if len(algo) else pd.NA, index=m.index, dtype="string")
    out["digest_snapshot"] = m["digest_snapshot"]
    out["digest_reset"] = m["digest_reset"]
    out["digest_reload"] = m["digest_reload"]
    for col in ("dtype", "shape", "nbytes", "layer", "block", "expert", "host"):
        out[col] = m[f"{col}_snapshot"].fillna(m[f"{col}_reload"])
    out["dtype_reload"] = m["dtype_reload"]
    out["shape_reload"] = m["shape_reload"]
    out["reset_covered"] = m["covered"].fillna(False).astype(bool)  # unexpected rows were never reset
    reload_ranks = rel[list(IDENTITY)].drop_duplicates().assign(_present=True)
    present = out[list(IDENTITY)].merge(reload_ranks, on=list(IDENTITY), how="left")["_present"]
    out["rank_absent"] = present.isna().to_numpy()
    out["same_as"] = _same_as(out, snap)
    out["url"] = pd.Series(pd.NA, index=out.index, dtype="string")
    out = _whole_ranks(out, dead, "unreachable")
    out = _whole_ranks(out, hollow, "empty")
    return worst_first(out, ENDSTATE_STATUSES)
