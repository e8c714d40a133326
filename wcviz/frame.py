"""The digest table: one tidy schema that every source produces and every view reads.

One row per (rank, parameter, phase). Columns, in order:

============  ========  ==========================================================
column        dtype     meaning
============  ========  ==========================================================
name          str       parameter name as its holder calls it
digest        str       lowercase hex digest in its algorithm's format (32 chars for
                        nemo-rl-v3, 64 for sha256; see ``wcviz.digest.DIGEST_FORMATS``)
algo          str       algorithm that made ``digest``: a key of ``DIGEST_FORMATS``
                        (``nemo-rl-v3``, ``sha256``, the engines' ``vllm-sha256``,
                        ``sglang-cpu``, ``sglang-gpu``, ``sglang``); nothing else
dtype         str       PyTorch dtype without ``torch.`` (``bfloat16``)
shape         str       JSON list of dims: ``[4096, 4096]``; ``[]`` for a 0-d tensor
nbytes        Int64     ``numel * element_size``
role          str       who holds it: ``trainer``, ``engine``, ``checkpoint``, ``module``
rank          Int64     global rank within the role's world (NA when not a rank)
dp, pp, tp,   Int64     data-, pipeline-, tensor-, expert-parallel coordinates (NA if
ep                      unknown); rank identity comes from these, never list order.
                        ``rank`` and these count from 0: a negative one is refused
host          str       host name the rank runs on
device        str       device the tensor was digested on (``cpu``, ``cuda:3``)
layer         Int64     transformer layer parsed from the name (``layers.N``, ``h.N``,
                        ``blocks.N``, ``decoder.layers.N``, ...), NA elsewhere
block         str       embed, attn, mlp, norm, head, expert, router or other
expert        Int64     expert index parsed from ``experts.N``, NA elsewhere
phase         str       when it was taken: ``current``, ``snapshot``, ``reset``,
                        ``reload``, ``sent``, ``received``, ...
step          Int64     training step the weights belong to, if known
seconds       float64   what digesting this tensor cost on that rank (a device
                        backend that syncs once shares its total out by bytes)
============  ========  ==========================================================

Frames fetched from running ranks (agents, the engines' checkers) carry one more
column, ``url`` (str): where each row was fetched from.

Missing strings are NA (never ``""``), so a table survives CSV, parquet and JSON
unchanged: :func:`write_table` / :func:`read_table` roundtrip exactly. A digest
that is not in its algorithm's format (``"error"``, a sha256 labelled
nemo-rl-v3, an unknown algorithm) is a :class:`TableError` naming the row:
never a value that could match another garbage value.
"""

from __future__ import annotations

import csv
import functools
import json
import math
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from wcviz import _json
from wcviz._errors import TableError
from wcviz._text import shape_str

__all__ = [
    "COLUMNS",
    "IDENTITY",
    "RANK_FIELDS",
    "empty_frame",
    "make_frame",
    "validate",
    "parse_layer",
    "parse_block",
    "parse_expert",
    "shape_str",
    "read_table",
    "write_table",
    "table_text",
    "json_cell",
    "check_identities",
    "check_rank_info",
    "coordinate_problem",
    "identity_clash",
    "check_unique_keys",
    "TABLE_SUFFIXES",
]

_STR = "string"
COLUMNS: dict[str, str] = {
    "name": _STR,
    "digest": _STR,
    "algo": _STR,
    "dtype": _STR,
    "shape": _STR,
    "nbytes": "Int64",
    "role": _STR,
    "rank": "Int64",
    "dp": "Int64",
    "pp": "Int64",
    "tp": "Int64",
    "ep": "Int64",
    "host": _STR,
    "device": _STR,
    "layer": "Int64",
    "block": _STR,
    "expert": "Int64",
    "phase": _STR,
    "step": "Int64",
    "seconds": "float64",
}
REQUIRED = ("name", "digest", "algo")
IDENTITY = ("rank", "dp", "pp", "tp", "ep")  # which rank a row belongs to
RANK_FIELDS = ("role", "rank", "dp", "pp", "tp", "ep", "host", "phase", "step")  # what a source may be told
BLOCKS = ("embed", "attn", "mlp", "norm", "head", "expert", "router", "other")
TABLE_SUFFIXES = (".csv", ".parquet", ".json")

_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")
_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)(?:\.|$)")
_ROUTER = re.compile(r"(?:^|\.)(?:router|gate)(?:\.(?:weight|bias|e_score_correction_bias))?$|\.router\.|shared_expert_gate")
_EXPERTS = re.compile(r"(?:^|\.)experts\.")  # also fused experts.gate_up_proj etc. (no index)
_NORM = re.compile(r"(?i:norm)|(?:^|\.)ln_?\w*(?:\.|$)")  # (?i) for BERT's LayerNorm
_EMBED = re.compile(r"embed|(?:^|\.)(?:wte|wpe|tok_embeddings|word_embeddings)(?:\.|$)")
_HEAD = re.compile(r"(?:^|\.)(?:lm_head|output|head|score|cls|classifier)(?:\.|$)")
_ATTN = re.compile(r"attn|attention|(?:^|\.)(?:q_proj|k_proj|v_proj|o_proj|qkv_proj|wq|wk|wv|wo|c_attn)(?:\.|$)")
_MLP = re.compile(
    r"mlp|feed_forward|ffn|(?:^|\.)(?:gate_proj|up_proj|down_proj|gate_up_proj|fc1|fc2|c_fc|w1|w2|w3|intermediate)(?:\.|$)"
    r"|(?:^|\.)output\.dense(?:\.|$)"  # BERT: layer.N.output.dense is the MLP's second linear
)


@functools.lru_cache(maxsize=1 << 16)  # names repeat on every rank
def parse_layer(name: str) -> int | None:
    """Layer index from ``layers.N`` / ``h.N`` / ``blocks.N`` / ``layer.N``; the last wins."""
    found = _LAYER.findall(name)
    return int(found[-1]) if found else None


@functools.lru_cache(maxsize=1 << 16)  # names repeat on every rank
def parse_expert(name: str) -> int | None:
    """Expert index from ``experts.N``."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


@functools.lru_cache(maxsize=1 << 16)  # names repeat on every rank
def parse_block(name: str) -> str:
    """Which part of the model a parameter belongs to (one of ``BLOCKS``)."""
    if _EXPERTS.search(name):
        return "expert"
    for block, pattern in (("router", _ROUTER), ("norm", _NORM), ("embed", _EMBED), ("attn", _ATTN), ("mlp", _MLP), ("head", _HEAD)):
        if pattern.search(name):
            return block
    return "other"


def empty_frame() -> pd.DataFrame:
    """A frame with every column and no rows."""
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in COLUMNS.items()})


def make_frame(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """A schema-conforming frame from row dicts; missing columns become NA.

    ``layer``, ``block`` and ``expert`` are parsed from ``name`` unless given.
    """
    records = list(rows)
    unknown = sorted({k for row in records for k in row} - set(COLUMNS))
    if unknown:
        raise TableError(f"unknown column(s) {', '.join(unknown)}; the schema has {', '.join(COLUMNS)}")
    if not records:
        return empty_frame()
    return validate(pd.DataFrame.from_records(records), source="rows")


def _coerce(df: pd.DataFrame, source: str) -> pd.DataFrame:
    """Cast to the schema's dtypes and column order, or raise naming the column.

    Works on each column's array, not on Series (a small table's cost is the per-operation
    overhead); a column already of its dtype is copied, never shared with ``df``."""
    n = len(df)
    out: dict[str, Any] = {}
    for col, dtype in COLUMNS.items():
        if col not in df:
            out[col] = _all_missing(dtype, n)
            continue
        s = df[col]
        try:
            if str(s.dtype) == dtype:
                arr = s.array.copy()
            elif dtype == _STR:
                arr = _as_strings(s)
            elif dtype == "Int64":
                arr = _as_int64(s, col, source)
            else:
                arr = pd.to_numeric(s, errors="raise").astype(dtype).array
            if dtype == _STR:
                empty = arr == ""
                if bool(empty.any()):  # an empty name or digest is a missing one (a row with none is refused below)
                    arr = pd.Series(arr).mask(pd.Series(empty)).array
        except TableError:
            raise
        except OverflowError:
            raise TableError(f"{source}: column {col!r} holds a number that does not fit in int64") from None
        except (TypeError, ValueError) as e:
            raise TableError(f"{source}: column {col!r} cannot be read as {dtype}: {e}") from None
        out[col] = arr
    for c in df.columns:  # extra columns ride along untouched (a user's annotations)
        if c not in COLUMNS:
            out[c] = df[c].array.copy()
    return pd.DataFrame(out, copy=False)  # every array is new: positional, nothing shared with df


_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


def _as_int64(s: pd.Series, col: str, source: str) -> Any:
    """A column as an ``Int64`` array, checked before any cast: every value an integer within int64.

    A bool, a fraction, an infinity or a number beyond int64 is a :class:`TableError` naming the
    column and row (a plain cast would warn, wrap or round instead). Missing values become NA."""

    def refuse(i: int, v: Any, why: str) -> TableError:
        shown = str(v) if len(str(v)) <= 40 else str(v)[:37] + "..."
        return TableError(f"{source}: column {col!r} holds {shown} in row {i}, {why}")

    if s.dtype == object or pd.api.types.is_string_dtype(s.dtype):
        kind = pd.api.types.infer_dtype(s, skipna=True)
        if kind == "empty":  # nothing but missing values (a column no row gave)
            return _all_missing("Int64", len(s))
        if kind == "string":  # text (a CSV read as text): parsed in one pass, then checked as numbers below
            num, text = pd.to_numeric(s, errors="coerce"), s.notna().to_numpy(dtype=bool)
            if (bad := np.flatnonzero(num.isna().to_numpy(dtype=bool) & text)).size:
                raise refuse(int(bad[0]), repr(s.iloc[int(bad[0])]), "not an integer")
            s = num
        if s.dtype == object:  # Python values (a JSON table, a wire column, ints beyond uint64): exact, no float64 on the way
            return _python_ints(s, refuse)
    num = pd.to_numeric(s, errors="raise")
    kind = num.dtype.kind
    if kind == "b":
        raise refuse(0, num.iloc[0], "not an integer (a boolean column)")
    if kind == "i":
        return num.astype("Int64").array
    if kind == "u":
        big = np.flatnonzero(np.asarray(num.fillna(0) > _I64_MAX, dtype=bool))
        if len(big):
            raise refuse(int(big[0]), num.iloc[int(big[0])], "a number that does not fit in int64")
        return num.astype("Int64").array
    if kind != "f":
        raise TypeError(f"dtype {num.dtype} is not numeric")
    values = num.to_numpy(dtype=np.float64, na_value=np.nan)
    missing = np.isnan(values)
    fraction = ~missing & (np.isinf(values) | (np.floor(values) != values))
    outside = ~missing & ~fraction & ((values < -(2.0**63)) | (values >= 2.0**63))
    if fraction.any():
        i = int(np.flatnonzero(fraction)[0])
        raise refuse(i, values[i], "not an integer")
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        raise refuse(i, values[i], "a number that does not fit in int64")
    ints = np.where(missing, 0.0, values).astype(np.int64)  # every value integral and in range: exact, no warning
    return pd.arrays.IntegerArray(ints, missing)


def _python_ints(s: pd.Series, refuse: Any) -> Any:
    """An object column of Python numbers as an ``Int64`` array, value by value (exact for every int64)."""
    values = s.to_numpy(dtype=object)
    missing = np.asarray(pd.isna(s), dtype=bool)
    ints = np.zeros(len(values), dtype=np.int64)
    present = values[~missing]
    if pd.api.types.infer_dtype(present, skipna=False) == "integer" and _I64_MIN <= min(present) and max(present) <= _I64_MAX:
        ints[~missing] = present.astype(np.int64)  # ints only (no bools), all in range: one cast, exact
        return pd.arrays.IntegerArray(ints, missing)
    for i, v in enumerate(values):
        if missing[i]:
            continue
        if isinstance(v, (bool, np.bool_)):
            raise refuse(i, v, "not an integer")
        given = v  # as the table holds it: 1e300, not the 301 digits of int(1e300)
        if isinstance(v, (float, np.floating)):
            if not (math.isfinite(v) and float(v).is_integer()):
                raise refuse(i, v, "not an integer")
            v = int(v)
        if not isinstance(v, (int, np.integer)):
            raise refuse(i, repr(v), f"not a number (a {type(v).__name__})")
        if not _I64_MIN <= int(v) <= _I64_MAX:
            raise refuse(i, given, "a number that does not fit in int64")
        ints[i] = int(v)
    return pd.arrays.IntegerArray(ints, missing)


def _as_strings(s: pd.Series) -> Any:
    """A column of another dtype as the schema's string array: NaN and None become NA, other values their ``str``."""
    typed = pd.api.types.is_string_dtype(s.dtype) and s.dtype != object
    if not typed and s.dtype == object and pd.api.types.infer_dtype(s, skipna=False) == "string":
        typed = True  # only str values and no missing ones (one pass in C): the plain cast is the same
    return (s.astype(_STR) if typed else s.astype("object").where(s.notna(), None).astype(_STR)).array


def _all_missing(dtype: str, n: int) -> Any:
    """A column of ``n`` missing values of the schema's ``dtype`` (NA; NaN for floats), built without a Python loop."""
    if dtype == "Int64":
        return pd.arrays.IntegerArray(np.zeros(n, dtype=np.int64), np.ones(n, dtype=bool))
    if dtype == "float64":
        return np.full(n, np.nan)
    return pd.array([None] * n, dtype=dtype)


_SCALAR_KINDS = {"string", "empty", "integer", "floating", "mixed-integer-float", "boolean", "decimal"}


def _refuse_nested(df: pd.DataFrame, source: str) -> None:
    """Cells of schema columns are scalars: a list or object (from a JSON table, say) is named, not stringified."""
    for col in df.columns:
        if col not in COLUMNS or df[col].dtype != object:
            continue  # typed columns (what sources build) hold scalars by construction
        if pd.api.types.infer_dtype(df[col], skipna=True) in _SCALAR_KINDS:
            continue  # one pass in C: only a column of mixed kinds is looked at cell by cell
        nested = df[col].map(lambda v: isinstance(v, (list, tuple, dict, set, bytes)))
        if bool(nested.any()):
            i = int(nested.to_numpy().nonzero()[0][0])
            raise TableError(f"{source}: column {col!r} holds a {type(df[col].iloc[i]).__name__} in row {i}, not a value")


def validate(df: pd.DataFrame, source: str = "table") -> pd.DataFrame:
    """Check a frame against the schema and return it coerced; errors name the column."""
    if not isinstance(df, pd.DataFrame):
        raise TableError(f"{source}: expected a pandas DataFrame, got {type(df).__name__}")
    if df.columns.has_duplicates:
        raise TableError(f"{source}: column {df.columns[df.columns.duplicated()][0]!r} appears more than once")
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise TableError(f"{source}: missing required column(s) {', '.join(missing)}")
    _refuse_nested(df, source)
    parsed = {"layer": parse_layer, "block": parse_block, "expert": parse_expert}
    absent = [c for c in parsed if c not in df.columns]
    if absent:  # a table from elsewhere: derive them from the names, as make_frame does (each distinct name parsed once)
        column = df["name"].astype("object")
        names, missing = column.tolist(), column.isna().tolist()
        distinct = {n for n, na in zip(names, missing) if not na}
        derived = {}
        for c in absent:
            found = {n: parsed[c](str(n)) for n in distinct}
            derived[c] = pd.array([None if na else found[n] for n, na in zip(names, missing)], dtype=COLUMNS[c])
        df = df.assign(**derived)
    frame = _coerce(df, source)
    _check_coordinates(frame, source)
    for col in REQUIRED:
        na = np.asarray(frame[col].array.isna())
        if na.any():
            raise TableError(f"{source}: column {col!r} is empty in row {int(np.flatnonzero(na)[0])}")
    blocks = frame["block"].array
    if any(not pd.isna(b) and b not in BLOCKS for b in blocks.unique()):  # the few distinct values, not every row
        bad = frame.loc[frame["block"].notna() & ~frame["block"].isin(BLOCKS), "block"]
        raise TableError(f"{source}: column 'block' has {bad.iloc[0]!r}; expected one of {', '.join(BLOCKS)}")
    frame["digest"] = _checked_digests(frame, source)
    return frame


def coordinate_problem(column: str, value: int) -> str | None:
    """Why ``value`` cannot be a rank's ``column`` (rank, dp, pp, tp, ep), or None: they count from 0 and fit in
    int64. The one rule for a table's rows and for what a rank's info claims (``sources._fleet.identity_of``)."""
    return None if 0 <= value < 2**63 else f"not a coordinate (0 <= {column} < 2**63)"


def rank_ids(frame: pd.DataFrame, source: str = "verdicts") -> pd.DataFrame:
    """Each row's rank, the one rule every view and summary places ranks by: :data:`IDENTITY` as ``Int64`` (checked as
    :func:`validate` checks them: ``"gpu-a"``, ``0.5`` or ``-1`` is a TableError naming the row), and ``url`` where a
    row has no coordinate at all (a rank known only by the address it was asked at), so two such ranks stay two."""
    ids = pd.DataFrame({c: _as_int64(frame[c].reset_index(drop=True), c, source) if c in frame else _all_missing("Int64", len(frame)) for c in IDENTITY})
    _check_coordinates(ids, source)
    url = frame["url"].astype("string").reset_index(drop=True) if "url" in frame else pd.Series(pd.NA, index=ids.index, dtype="string")
    ids["url"] = url.where(ids.isna().all(axis=1) & (url.fillna("") != ""), pd.NA)
    return ids.set_axis(frame.index)


def _check_coordinates(frame: pd.DataFrame, source: str) -> None:
    """A TableError naming the column and row of the first identity value :func:`coordinate_problem` refuses
    (``rank=-1``): each distinct value is asked once, so a large table costs a ``unique`` per column."""
    for col in IDENTITY:
        values = frame[col]
        bad = [v for v in values.dropna().unique() if coordinate_problem(col, int(v)) is not None]
        if bad:
            i = int(np.flatnonzero(values.isin(bad).fillna(False).to_numpy(dtype=bool))[0])
            value = int(values.iloc[i])
            raise TableError(f"{source}: column {col!r} holds {value} in row {i}, {coordinate_problem(col, value)}")


def _checked_digests(frame: pd.DataFrame, source: str) -> pd.Series:
    """The digest column in lowercase, once every digest is in its algorithm's format; else a TableError naming the row."""
    from wcviz.digest import DIGEST_FORMATS, digest_format_error

    digests, algos = frame["digest"], frame["algo"]
    present = [a for a in algos.unique() if a in DIGEST_FORMATS]
    for attempt in range(2):  # as given (lowercase: the common case), then lowercased
        if len(present) == 1:  # one algorithm, as a table nearly always has
            good = digests.str.fullmatch(DIGEST_FORMATS[present[0]][1].pattern) & (algos == present[0])
        else:
            good = pd.Series(False, index=frame.index)
            for algo in present:
                good |= (algos == algo) & digests.str.fullmatch(DIGEST_FORMATS[algo][1].pattern)
        good = good.fillna(False).astype(bool)
        if bool(good.all()):
            return digests
        if attempt == 0:
            digests = digests.str.lower()
    i = int(frame.index[~good][0])
    raise TableError(f"{source}: row {i} ({frame['name'].iloc[i]!r}): {digest_format_error(algos.iloc[i], frame['digest'].iloc[i])}")


def check_rank_info(rank_info: Mapping[str, Any]) -> dict[str, Any]:
    """The rank fields a source was given (:data:`RANK_FIELDS`), or a ``TypeError`` naming the unknown ones."""
    unknown = sorted(set(rank_info) - set(RANK_FIELDS))
    if unknown:
        raise TypeError(f"unknown rank field(s) {', '.join(unknown)}; allowed: {', '.join(RANK_FIELDS)}")
    return dict(rank_info)


def check_unique_keys(df: pd.DataFrame, keys: Sequence[str], source: str) -> None:
    """Refuse rows that share ``keys`` (a rank's parameter twice): a TableError naming the first."""
    dup = df.duplicated(list(keys), keep=False)
    if dup.any():
        first = df.loc[dup, list(keys)].iloc[0].to_dict()
        where = ", ".join(f"{k}={v}" for k, v in first.items() if not pd.isna(v))
        raise TableError(
            f"{source} table has {int(dup.sum())} rows that share a (rank, name) key, first: {where}; "
            "select one phase/step before comparing"
        )


def _coords(row: Mapping[str, Any]) -> str:
    from wcviz._text import rank_label

    return rank_label(row, "coords")


def _rows(labels: Sequence[Any]) -> str:
    return f"row {labels[0]}" if len(labels) == 1 else "rows " + " and ".join(map(str, labels))


def identity_clash(df: pd.DataFrame, where: Callable[[Sequence[Any]], str] = _rows) -> str | None:
    """What is wrong where one rank claims two identities in ``df`` (see :func:`check_identities`), or None.

    ``where(labels)`` names rows by their index labels (``row 3``, ``rows 3 and 7``), so a caller that knows
    where rows came from (the member that sent them) can say so with the same rule."""
    ids = list(IDENTITY)
    ranked = df[df["rank"].notna()]
    if len(ranked):
        per = ranked[ids].drop_duplicates()
        clash = per[per["rank"].duplicated(keep=False)]
        if len(clash):
            first, second = clash[clash["rank"] == clash["rank"].iloc[0]].index[:2]
            return (
                f"rank {int(df.at[first, 'rank'])} claims two identities: {_coords(df.loc[first])} in {where([first])} "
                f"and {_coords(df.loc[second])} in {where([second])}"
            )
    for col in ("role", "host"):
        if col not in df.columns:
            continue
        per = df[ids + [col]].dropna(subset=[col]).drop_duplicates()
        clash = per[per.duplicated(ids, keep=False)]
        if len(clash):
            first = clash.index[0]
            key = clash.loc[first, ids]
            same = clash[(clash[ids] == key).fillna(clash[ids].isna() & key.isna()).all(axis=1)]
            second = same.index[1]
            return (
                f"{where([first, second])} claim the same rank {_coords(df.loc[first])} with "
                f"{col} {df.at[first, col]!r} and {df.at[second, col]!r}: two ranks cannot share coordinates"
            )
    return None


def check_identities(df: pd.DataFrame, source: str = "table") -> None:
    """Refuse a table in which one rank claims two identities: a rank number with two sets of
    coordinates, or one rank (number and coordinates) with two roles or hosts.

    Verdicts match ranks by their coordinates, so such rows would silently be merged into
    one rank or split into two; raises a :class:`TableError` naming both rows.
    """
    why = identity_clash(df)
    if why is not None:
        raise TableError(f"{source}: {why}")


def json_cell(v: Any) -> Any:
    """A frame cell as a JSON value: NA/NaN -> null, numpy scalars -> Python (agents and engine adapters send rows so)."""
    if v is None or v is pd.NA:
        return None
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and v != v:
        return None
    return v


def write_table(df: pd.DataFrame, path: str | Path) -> Path:
    """Write a frame as CSV, parquet or JSON (by suffix); :func:`read_table` reads it back unchanged."""
    path = Path(path)
    frame = validate(df)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        frame.to_parquet(path, index=False)
    elif suffix in (".csv", ".json"):
        path.write_text(table_text(frame, suffix[1:]))
    else:
        raise TableError(f"{path}: unknown table format {suffix or '(no suffix)'}; use one of {', '.join(TABLE_SUFFIXES)}")
    return path


def table_text(df: pd.DataFrame, fmt: str) -> str:
    """A table as ``csv`` or ``json`` text, exactly as :func:`write_table` writes it."""
    frame = validate(df)
    if fmt == "csv":
        # a bare \r is no line end to the csv writer (it only quotes what holds its "\n"), but it is one to every
        # reader: a table holding one quotes every text field, so it reads back unchanged (others stay as they were)
        return frame.to_csv(index=False, quoting=csv.QUOTE_NONNUMERIC if _holds_cr(frame) else csv.QUOTE_MINIMAL)
    if fmt == "json":
        return _to_json(frame) + "\n"
    raise TableError(f"unknown text format {fmt!r}; use csv or json")


def _holds_cr(frame: pd.DataFrame) -> bool:
    """Whether a text cell (or a column name) of ``frame`` holds a carriage return."""
    if any("\r" in str(c) for c in frame.columns):
        return True
    for col in frame.columns:
        s = frame[col]
        if pd.api.types.is_string_dtype(s.dtype) and s.dtype != object:
            if bool(s.str.contains("\r", regex=False).fillna(False).any()):
                return True
        elif s.dtype == object and bool(s.map(lambda v: isinstance(v, str) and "\r" in v).any()):
            return True
    return False


def _to_json(frame: pd.DataFrame) -> str:
    """JSON records with NA as null and floats written exactly (``to_json`` keeps only 10 digits)."""
    records = frame.to_dict(orient="records")
    for rec in records:
        for k, v in rec.items():
            if v is pd.NA or (isinstance(v, float) and v != v):
                rec[k] = None
    return json.dumps(records, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o))


def _refuse_repeated_csv_columns(path: Path) -> None:
    """A CSV header naming a column twice is refused (pandas would rename the second ``digest.1`` and use the first)."""
    try:
        head = pd.read_csv(path, header=None, nrows=1, dtype="object", keep_default_na=False)
    except pd.errors.EmptyDataError:
        return  # no header at all: read_csv says so, with the file's name
    names = [str(v) for v in head.iloc[0].tolist()] if len(head) else []
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise TableError(f"{path}: column {name!r} appears more than once in the header")
        seen.add(name)


def _refuse_repeated_keys(path: Path, records: list[Any], first: str) -> None:
    """A JSON table whose record gives a column twice is refused, naming the column and record (json keeps the last)."""
    for i, rec in enumerate(records):
        if _json.repeated(rec):
            raise TableError(f"{path}: record {i} gives column {_json.repeated(rec)[0]!r} more than once")
    raise TableError(f"{path}: a JSON object in the table gives key {first!r} more than once")


def read_table(path: str | Path) -> pd.DataFrame:
    """Read a table written by :func:`write_table` (or any file with the required columns)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if not path.is_file():
        raise TableError(f"{path}: no such file")
    try:
        if suffix == ".csv":
            _refuse_repeated_csv_columns(path)
            try:
                with warnings.catch_warnings():  # numpy's cast warning for a value like 1e300 is a value its column cannot hold
                    warnings.simplefilter("error", RuntimeWarning)
                    df = pd.read_csv(path, dtype={c: ("object" if t == _STR else t) for c, t in COLUMNS.items()}, keep_default_na=False, na_values=[""])
            except (TypeError, ValueError, OverflowError, RuntimeWarning):  # a value its column cannot hold: read as text so validate names the column
                df = pd.read_csv(path, dtype="object", keep_default_na=False, na_values=[""])
        elif suffix == ".parquet":
            df = pd.read_parquet(path)
        elif suffix == ".json":
            try:
                records = _json.loads(path.read_text())
            except RecursionError:
                raise TableError(f"{path}: not a readable json table: it nests too deeply") from None
            if not isinstance(records, list):
                raise TableError(f"{path}: not a table: expected a JSON list of records, got a JSON {type(records).__name__}")
            if (first := _json.first_repeated(records)) is not None:
                _refuse_repeated_keys(path, records, first)
            df = empty_frame() if records == [] else pd.DataFrame.from_records(records)
        else:
            raise TableError(f"{path}: unknown table format {suffix or '(no suffix)'}; use one of {', '.join(TABLE_SUFFIXES)}")
    except TableError:
        raise
    except Exception as e:  # pandas/pyarrow/json errors, reworded with the file's name
        raise TableError(f"{path}: not a readable {suffix[1:]} table: {e}") from None
    return validate(df, source=str(path))
