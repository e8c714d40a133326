"""Verdicts: what a comparison or an end-state check concluded, one row per (rank, parameter).

This module owns the vocabulary every verdict frame speaks and every view reads: the
statuses, their order of severity, the columns, and the one-line summary.

Statuses, worst first (:data:`SEVERITY`):

============  =================================================================  ==========
status        meaning                                                            made by
============  =================================================================  ==========
corrupted     the reload holds a third value: neither the snapshot nor the reset  end-state
mismatch      same dtype and shape, different digest: the values differ          compare
drift         same name, different dtype or shape                                compare
unwritten     the reload still holds the reset pattern: the update never wrote it end-state
missing       expected (or in the snapshot), absent on that rank                 both
empty         the rank answered with no parameters at all                        end-state
unreachable   the rank did not answer: nothing about it is proven                end-state
unexpected    present on that rank, never expected (or not in the snapshot)      both
unproven      equal to the snapshot, but the reset did not prove it was rewritten end-state
match         same digest (and, in the end-state check, a reset that proves it)  both
============  =================================================================  ==========

Verdict columns, both kinds: the identity columns (``rank``, ``dp``, ``pp``, ``tp``,
``ep``), ``name``, ``status``, ``algo``, ``layer``, ``block``, ``expert``, ``host``.
Then, from :func:`compare`: ``digest``/``dtype``/``shape``/``nbytes``/``role``/``phase``
with ``_expected`` and ``_actual`` suffixes side by side; from
:func:`wcviz.endstate.classify`: ``digest_snapshot``, ``digest_reset``,
``digest_reload``, ``dtype``, ``shape``, ``nbytes``, ``dtype_reload``,
``shape_reload``, ``reset_covered``, ``rank_absent``, ``same_as``. A whole-rank status
(``empty``, ``unreachable``) on a rank without rows is one row with no ``name``.

Nothing here fetches: verdicts are made from frames and read by views.
"""

from __future__ import annotations

import pandas as pd

from wcviz._errors import AlgorithmMismatch, TableError
from wcviz._text import SHOWN, listing, plural, rank_label
from wcviz.frame import IDENTITY, check_identities, check_unique_keys, rank_ids, validate

__all__ = [
    "ENDSTATE_STATUSES",
    "SEVERITY",
    "STATUSES",
    "WHOLE_RANK",
    "check_statuses",
    "compare",
    "counts",
    "differences",
    "n_parameters",
    "status_parts",
    "summary",
]

STATUSES = ("mismatch", "drift", "missing", "unexpected", "match")  # compare(), most severe first
ENDSTATE_STATUSES = (  # the end-state check, most severe first
    "corrupted", "unwritten", "missing", "empty", "unreachable", "unexpected", "unproven", "match",
)  # fmt: skip
SEVERITY = (  # every status a verdict frame may hold, worst first: one order for every view
    "corrupted", "mismatch", "drift", "unwritten", "missing", "empty", "unreachable", "unexpected", "unproven", "match",
)  # fmt: skip
WHOLE_RANK = {"unreachable": "did not answer", "empty": "answered with no parameters"}  # statuses of a whole rank
_SIDE = ("digest", "dtype", "shape", "nbytes", "role", "phase")
_KEYS = [*IDENTITY, "name"]


def _algo(df: pd.DataFrame, label: str) -> str | None:
    algos = sorted(df["algo"].dropna().unique())
    if len(algos) > 1:
        raise AlgorithmMismatch(f"{label} table mixes digest algorithms: {', '.join(algos)}")
    return algos[0] if algos else None


def _check_url_only(df: pd.DataFrame, label: str) -> None:
    """A TableError if ``df`` holds more than one rank known only by its URL (no coordinate at all): ranks line up
    by their coordinates here, so such ranks' rows would answer for one another (a false match)."""
    if "url" not in df or not len(df):
        return
    coords = [c for c in IDENTITY if c in df]
    bare = (df[coords].isna().all(axis=1).to_numpy() if coords else True) & df["url"].notna().to_numpy()
    urls = list(dict.fromkeys(str(u) for u in df.loc[bare, "url"]))
    if len(urls) > 1:
        raise TableError(
            f"{label} table holds {len(urls)} ranks known only by their URL ({', '.join(urls[:3])}{', ...' if len(urls) > 3 else ''}): "
            "a comparison lines ranks up by their coordinates (rank, dp, pp, tp, ep), so their rows would answer for "
            "one another; give each rank its coordinates, or compare one such rank at a time"
        )


def _broadcast(expected: pd.DataFrame, actual: pd.DataFrame) -> pd.DataFrame:
    """Expected rows with no rank identity apply to every rank that ``actual`` has."""
    ids = list(IDENTITY)
    if expected[ids].notna().any().any() or not actual[ids].notna().any().any():
        return expected
    ranks = actual[ids].drop_duplicates()
    return expected.drop(columns=ids).merge(ranks, how="cross")


def _check_coordinates(exp: pd.DataFrame, act: pd.DataFrame) -> None:
    """Both tables must locate ranks by the same coordinates, or nothing would line up. An empty table locates
    nothing and lines up with anything: all of the other's rows are then missing (or unexpected)."""
    if not len(exp) or not len(act):
        return
    used_e = [c for c in IDENTITY if exp[c].notna().any()]
    used_a = [c for c in IDENTITY if act[c].notna().any()]
    if used_e != used_a:
        raise TableError(
            f"expected table locates ranks by ({', '.join(used_e) or 'nothing'}) but actual by "
            f"({', '.join(used_a) or 'nothing'}): give both the same coordinates, or give expected "
            "none to apply it to every rank"
        )


def _differs(m: pd.DataFrame, col: str) -> pd.Series:
    left, right = m[f"{col}_expected"], m[f"{col}_actual"]
    return (left.notna() & right.notna() & (left != right)).fillna(False).astype(bool)


def worst_first(out: pd.DataFrame, order: tuple[str, ...] = SEVERITY) -> pd.DataFrame:
    """``out`` sorted most severe first, then by rank identity and name (NA first)."""
    rank = out["status"].map({s: i for i, s in enumerate(order)}).astype(int)
    out = out.assign(_o=rank).sort_values(["_o", *IDENTITY, "name"], na_position="first", kind="stable")
    return out.drop(columns="_o").reset_index(drop=True)


def compare(expected: pd.DataFrame, actual: pd.DataFrame) -> pd.DataFrame:
    """One verdict per (rank identity, name), most severe first, both digests side by side.

    A table without rank coordinates (a checkpoint, a trainer's module) is what
    every rank of the other table should hold. Mixed algorithms are an error.
    """
    exp = validate(expected, "expected")
    act = validate(actual, "actual")
    check_identities(exp, "expected")
    check_identities(act, "actual")
    _check_url_only(expected, "expected")
    _check_url_only(actual, "actual")
    a_exp, a_act = _algo(exp, "expected"), _algo(act, "actual")
    if a_exp and a_act and a_exp != a_act:
        raise AlgorithmMismatch(f"cannot compare {a_exp} digests (expected) with {a_act} digests (actual)")
    exp = _broadcast(exp, act)
    _check_coordinates(exp, act)
    check_unique_keys(exp, _KEYS, "expected")
    check_unique_keys(act, _KEYS, "actual")
    side = list(_SIDE)
    left = exp[_KEYS + side + ["layer", "block", "expert"]]
    right = act[_KEYS + side + ["host", "layer", "block", "expert"]]
    m = left.merge(right, on=_KEYS, how="outer", suffixes=("_expected", "_actual"), indicator=True)
    both = m["_merge"] == "both"
    # drift needs both sides to state a dtype/shape and disagree: a table that omits them (NA) is not drift
    same_kind = ~(_differs(m, "dtype") | _differs(m, "shape"))
    same_digest = (m["digest_expected"].str.lower() == m["digest_actual"].str.lower()).fillna(False).astype(bool)
    status = pd.Series("missing", index=m.index, dtype="string")
    status[m["_merge"] == "right_only"] = "unexpected"
    status[both & ~same_kind] = "drift"
    status[both & same_kind & ~same_digest] = "mismatch"
    status[both & same_kind & same_digest] = "match"
    out = m[_KEYS].copy()
    out["status"] = status
    out["algo"] = pd.Series(a_exp or a_act, index=m.index, dtype="string")
    for col in side:
        out[f"{col}_expected"] = m[f"{col}_expected"]
        out[f"{col}_actual"] = m[f"{col}_actual"]
    for col in ("layer", "block", "expert"):
        out[col] = m[f"{col}_expected"].fillna(m[f"{col}_actual"])
    out["host"] = m["host"]
    return worst_first(out, STATUSES)


def check_statuses(verdicts: pd.DataFrame) -> None:
    """Refuse a malformed verdict frame: no ``status`` column, a row without a status, or one no check gives.

    A missing status is neither a match nor a finding, so no view may count it as either:
    :class:`~wcviz.TableError` names the first such row (its position, rank and name).
    """
    if not isinstance(verdicts, pd.DataFrame):
        raise TableError(f"expected a verdict DataFrame, got {type(verdicts).__name__}")
    if "status" not in verdicts:
        raise TableError(f"not a verdict frame: no 'status' column (columns: {', '.join(map(str, verdicts.columns))})")
    na = verdicts["status"].isna().to_numpy()
    unknown = ~na & ~verdicts["status"].isin(SEVERITY).to_numpy(dtype=bool)  # "ok" is neither a match nor a finding
    for bad, said in ((na, "has no status"), (unknown, "has the status {!r}, which no check gives")):
        if not bad.any():
            continue
        v = verdicts.reset_index(drop=True)
        pos = int(bad.nonzero()[0][0])
        row = v.iloc[pos]
        name = row["name"] if "name" in v else pd.NA
        where = rank_label({c: row[c] for c in IDENTITY if c in v})
        what = f"{where}, " + (f"parameter {name}" if not pd.isna(name) else "no parameter name")
        more = f" (and {int(bad.sum()) - 1:,} more)" if int(bad.sum()) > 1 else ""
        raise TableError(
            f"malformed verdict frame: row {pos} ({what}) {said.format(row['status'])}{more}; every row needs one of "
            f"{', '.join(SEVERITY)}"
        )


def differences(verdicts: pd.DataFrame) -> pd.DataFrame:
    """The verdict rows that are not ``match``; a row without a status is refused (:func:`check_statuses`)."""
    check_statuses(verdicts)
    return verdicts[(verdicts["status"] != "match").to_numpy(dtype=bool)].reset_index(drop=True)


def counts(verdicts: pd.DataFrame) -> dict[str, int]:
    """Rows per status, most severe first: every :func:`compare` status (zeros included) and each other status the
    rows hold (the end-state check's), so the counts always add up to the rows."""
    check_statuses(verdicts)
    vc = verdicts["status"].value_counts()
    return {s: int(vc.get(s, 0)) for s in SEVERITY if s in STATUSES or s in vc}


def _ids(v: pd.DataFrame) -> pd.DataFrame:
    """Each row's rank (:func:`wcviz.frame.rank_ids`: coordinates, and ``url`` for a rank known only by it)."""
    return rank_ids(v)


def status_parts(verdicts: pd.DataFrame, *, name_ranks: bool = True, style: str = "rank", most: int = SHOWN) -> list[str]:
    """Each status that occurs, worst first: ``2 unwritten on 1 rank (rank 1 (pp=0 tp=1))``, ..., ``40 match``.

    ``name_ranks``: name the ranks (and a rank absent after a reload) and give whole-rank
    statuses their own form (``1 rank unreachable (rank 2 (tp=2): did not answer)``);
    without it, every status is a count of rows and of the ranks they are on. ``style``: how a
    rank is named (:func:`wcviz._text.rank_label`); ``most``: ranks named before ``+N more``.
    A row without a name counts as a row of its status (only a whole-rank status without
    names takes the whole-rank form). A row without a status is refused (:func:`check_statuses`).
    """
    check_statuses(verdicts)
    v = verdicts.reset_index(drop=True)
    ids = _ids(v)
    located = bool(ids.notna().any().any())
    names = v["name"] if "name" in v else pd.Series("", index=v.index)
    absent_col = v["rank_absent"] if "rank_absent" in v else pd.Series(False, index=v.index)
    parts = []
    for st in SEVERITY:
        hit = (v["status"] == st).to_numpy(dtype=bool)
        if not bool(hit.any()):
            continue
        rows = ids[hit]
        n = int(hit.sum())
        if st == "match":
            parts.append(f"{n:,} match")
            continue
        ranks = rows.drop_duplicates()
        if not name_ranks:
            parts.append(f"{n:,} {st}" + (f" on {plural(len(ranks), 'rank')}" if located else ""))
            continue
        absent = absent_col[hit].to_numpy()
        labelled = rows.assign(_absent=absent).drop_duplicates([*IDENTITY, "url"]).sort_values([*IDENTITY, "url"], na_position="first")
        labels = [
            rank_label(r, style) + (": rank absent after reload" if st not in WHOLE_RANK and bool(r["_absent"]) else "")
            for r in labelled.to_dict(orient="records")
        ]
        named = int(names[hit].notna().sum())
        if st not in WHOLE_RANK or named:  # a finding without a name is still a finding: count its rows
            parts.append(f"{(named if st in WHOLE_RANK else n):,} {st} on {plural(len(ranks), 'rank')} ({listing(labels, most)})")
        else:  # ranks without rows (dead, empty): no parameter to count
            parts.append(f"{plural(len(ranks), 'rank')} {st} ({listing(labels, most)}: {WHOLE_RANK.get(st, st)})")
    return parts


def n_parameters(verdicts: pd.DataFrame) -> int:
    """Rows about a parameter: every row but a whole-rank row (an ``unreachable``/``empty`` rank without a name)."""
    v = verdicts
    if "name" not in v:
        return len(v)
    whole = v["name"].isna().to_numpy() & v["status"].isin(list(WHOLE_RANK)).to_numpy(dtype=bool)
    return int((~whole).sum())


def summary(verdicts: pd.DataFrame, title: str = "end-state check") -> str:
    """The one line a person reads first: ranks, parameters, then each status with the ranks it is on.

    ``end-state check: 4 ranks, 24 parameters: 3 unwritten on 1 rank (rank 1 (pp=0 tp=1)), 21 match``,
    then what a reader must not miss: ranks holding another rank's snapshot (swapped
    shards), parameters the reset did not prove, tensors without bytes.
    """
    v = verdicts
    parts = status_parts(v, name_ranks=True)
    n_ranks = len(_ids(v).drop_duplicates())
    line = f"{title}: {plural(n_ranks, 'rank')}, {plural(n_parameters(v), 'parameter')}: {', '.join(parts) or 'nothing to check'}"
    swapped = v[v["same_as"].notna()] if "same_as" in v else v.iloc[:0]
    if len(swapped):
        pairs = sorted({f"{rank_label(r)} holds {r['same_as']}'s" for r in swapped.to_dict(orient="records")})
        line += f"; {len(swapped):,} corrupted parameters hold another rank's snapshot ({listing(pairs)})"
    if (v["status"] == "unproven").any():
        line += "; unproven: the reset did not prove the update rewrote them"
    if "reset_covered" in v:
        bare = int(((v["status"] == "match") & ~v["reset_covered"].astype(bool)).sum())
        if bare:
            line += f"; {bare:,} not covered by the reset (tensors without bytes: they match by dtype and shape only)"
    return line
