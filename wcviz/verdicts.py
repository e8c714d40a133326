"""Verdicts: turn an expected and an actual digest table into one row per (rank, name).

Statuses (see :data:`STATUSES`):

- ``match``       same digest, same dtype and shape;
- ``mismatch``    same dtype and shape, different digest: the values differ;
- ``drift``       same name, different dtype or shape;
- ``missing``     expected but absent on that rank;
- ``unexpected``  present on that rank but never expected.

Verdict columns: the identity columns (``rank``, ``dp``, ``pp``, ``tp``,
``ep``), ``name``, ``status``, ``algo``, then ``digest``/``dtype``/``shape``/
``nbytes`` with ``_expected`` and ``_actual`` suffixes side by side, and
``layer``, ``block``, ``expert``, ``role_actual``, ``host`` for grouping.
Comparison never fetches: it only reads frames.
"""

from __future__ import annotations

import pandas as pd

from wcviz._errors import AlgorithmMismatch, TableError
from wcviz.frame import IDENTITY, check_identities, validate

__all__ = ["SEVERITY", "STATUSES", "compare", "differences", "counts"]

STATUSES = ("mismatch", "drift", "missing", "unexpected", "match")  # most severe first
# Every status a verdict frame may hold, worst first: compare()'s and the end-state check's
# (wcviz.endstate.ENDSTATE_STATUSES), one order for every view.
SEVERITY = (
    "corrupted", "mismatch", "drift", "unwritten", "missing", "empty", "unreachable", "unexpected", "unproven", "match",
)  # fmt: skip
_SIDE = ("digest", "dtype", "shape", "nbytes", "role", "phase")


def _algo(df: pd.DataFrame, label: str) -> str | None:
    algos = sorted(df["algo"].dropna().unique())
    if len(algos) > 1:
        raise AlgorithmMismatch(f"{label} table mixes digest algorithms: {', '.join(algos)}")
    return algos[0] if algos else None


def _check_unique(df: pd.DataFrame, keys: list[str], label: str) -> None:
    dup = df.duplicated(keys, keep=False)
    if dup.any():
        first = df.loc[dup, keys].iloc[0].to_dict()
        where = ", ".join(f"{k}={v}" for k, v in first.items() if not pd.isna(v))
        raise TableError(
            f"{label} table has {int(dup.sum())} rows that share a (rank, name) key, first: {where}; "
            "select one phase/step before comparing"
        )


def _broadcast(expected: pd.DataFrame, actual: pd.DataFrame) -> pd.DataFrame:
    """Expected rows with no rank identity apply to every rank that ``actual`` has."""
    ids = list(IDENTITY)
    if expected[ids].notna().any().any() or not actual[ids].notna().any().any():
        return expected
    ranks = actual[ids].drop_duplicates()
    return expected.drop(columns=ids).merge(ranks, how="cross")


def _check_coordinates(exp: pd.DataFrame, act: pd.DataFrame) -> None:
    """Both tables must locate ranks by the same coordinates, or nothing would line up."""
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


def compare(expected: pd.DataFrame, actual: pd.DataFrame) -> pd.DataFrame:
    """One verdict per (rank identity, name), most severe first, both digests side by side.

    A table without rank coordinates (a checkpoint, a trainer's module) is what
    every rank of the other table should hold. Mixed algorithms are an error.
    """
    exp = validate(expected, "expected")
    act = validate(actual, "actual")
    check_identities(exp, "expected")
    check_identities(act, "actual")
    a_exp, a_act = _algo(exp, "expected"), _algo(act, "actual")
    if a_exp and a_act and a_exp != a_act:
        raise AlgorithmMismatch(f"cannot compare {a_exp} digests (expected) with {a_act} digests (actual)")
    exp = _broadcast(exp, act)
    _check_coordinates(exp, act)
    keys = [*IDENTITY, "name"]
    _check_unique(exp, keys, "expected")
    _check_unique(act, keys, "actual")
    side = list(_SIDE)
    left = exp[keys + side + ["layer", "block", "expert"]]
    right = act[keys + side + ["host", "layer", "block", "expert"]]
    m = left.merge(right, on=keys, how="outer", suffixes=("_expected", "_actual"), indicator=True)
    both = m["_merge"] == "both"
    # drift needs both sides to state a dtype/shape and disagree: a table that omits them (NA) is not drift
    same_kind = ~(_differs(m, "dtype") | _differs(m, "shape"))
    same_digest = m["digest_expected"].str.lower() == m["digest_actual"].str.lower()
    status = pd.Series("missing", index=m.index, dtype="string")
    status[m["_merge"] == "right_only"] = "unexpected"
    same_digest = same_digest.fillna(False).astype(bool)
    status[both & ~same_kind] = "drift"
    status[both & same_kind & ~same_digest] = "mismatch"
    status[both & same_kind & same_digest] = "match"
    out = m[keys].copy()
    out["status"] = status
    out["algo"] = pd.Series(a_exp or a_act, index=m.index, dtype="string")
    for col in side:
        out[f"{col}_expected"] = m[f"{col}_expected"]
        out[f"{col}_actual"] = m[f"{col}_actual"]
    for col in ("layer", "block", "expert"):
        out[col] = m[f"{col}_expected"].fillna(m[f"{col}_actual"])
    out["host"] = m["host"]
    order = out["status"].map({s: i for i, s in enumerate(STATUSES)}).astype(int)
    out = out.assign(_o=order).sort_values(["_o", *IDENTITY, "name"], na_position="first", kind="stable")
    return out.drop(columns="_o").reset_index(drop=True)


def differences(verdicts: pd.DataFrame) -> pd.DataFrame:
    """The verdict rows that are not ``match``."""
    return verdicts[verdicts["status"] != "match"].reset_index(drop=True)


def counts(verdicts: pd.DataFrame) -> dict[str, int]:
    """Rows per status, every status present (zeros included), most severe first."""
    vc = verdicts["status"].value_counts()
    return {s: int(vc.get(s, 0)) for s in STATUSES}
