"""The ``wcviz`` command: digest checkpoints and compare tables from a shell.

Exit status: 0 all match, 1 something differs, 2 bad input (a clear one-line
error naming the file, tensor or column; never a traceback).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

__all__ = ["main"]

_TABLE_COLUMNS = ["name", "digest", "algo", "dtype", "shape", "nbytes"]
_VERDICT_COLUMNS = ["rank", "tp", "pp", "dp", "ep", "name", "status", "digest_expected", "digest_actual", "dtype_expected", "dtype_actual", "shape_expected", "shape_actual"]


def _parser() -> argparse.ArgumentParser:
    from wcviz.digest import ALGORITHMS, BACKENDS, DEFAULT_ALGO

    p = argparse.ArgumentParser(prog="wcviz", description="Digest weights and find where two sets of weights differ.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("digest", help="digest a safetensors checkpoint (file or directory of shards) into a table")
    d.add_argument("path", help="a .safetensors file, or a directory of shards (with or without an index)")
    d.add_argument("--algo", choices=ALGORITHMS, default=DEFAULT_ALGO, help=f"digest algorithm (default {DEFAULT_ALGO})")
    d.add_argument("--backend", choices=BACKENDS, default="auto", help="digest backend (default auto)")
    d.add_argument("--format", choices=("table", "csv", "json"), default="table", help="output format (default table)")
    d.add_argument("--out", metavar="FILE", help="write here instead of stdout (.csv/.parquet/.json pick the format)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")

    c = sub.add_parser("compare", help="compare two checkpoints or saved tables; exit 1 if anything differs")
    c.add_argument("expected", help="checkpoint or saved table (.csv/.parquet/.json) taken as the truth")
    c.add_argument("actual", help="checkpoint or saved table to check against it")
    c.add_argument("--algo", choices=ALGORITHMS, default=None, help="algorithm for checkpoints (default: the saved table's, else nemo-rl-v3)")
    c.add_argument("--backend", choices=BACKENDS, default="auto", help="digest backend for checkpoints")
    c.add_argument("--all", action="store_true", help="list matching rows too")
    c.add_argument("--out", metavar="FILE", help="also write the verdict table here (.csv/.parquet/.json)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _is_table(path: str) -> bool:
    from wcviz.frame import TABLE_SUFFIXES

    return Path(path).suffix.lower() in TABLE_SUFFIXES and not path.endswith(".safetensors.index.json")


def _load_pair(args: argparse.Namespace) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Both sides; a checkpoint is digested with ``--algo``, else with the other side's table algorithm."""
    from wcviz.digest import DEFAULT_ALGO
    from wcviz.frame import read_table
    from wcviz.sources import from_safetensors

    paths = (args.expected, args.actual)
    tables = {p: read_table(p) for p in paths if _is_table(p)}
    algo = args.algo
    if algo is None:
        known = sorted({a for t in tables.values() for a in t["algo"].dropna().unique()})
        algo = known[0] if len(known) == 1 else DEFAULT_ALGO
    progress = False if args.no_progress else None
    loaded = [tables[p] if p in tables else from_safetensors(p, algo=algo, backend=args.backend, progress=progress) for p in paths]
    return loaded[0], loaded[1]


def _digest(args: argparse.Namespace) -> int:
    from wcviz.frame import table_text, write_table
    from wcviz.sources import from_safetensors

    df = from_safetensors(args.path, algo=args.algo, backend=args.backend, progress=False if args.no_progress else None)
    if args.out and Path(args.out).suffix.lower() in (".csv", ".parquet", ".json"):
        write_table(df, args.out)
        print(f"wrote {len(df)} digests to {args.out}", file=sys.stderr)
        return 0
    if args.format in ("csv", "json"):
        text = table_text(df, args.format)
    else:
        total = int(df["nbytes"].sum())
        text = df[_TABLE_COLUMNS].to_string(index=False) + f"\n{len(df)} tensors, {total:,} bytes, {df['algo'].iloc[0]}\n"
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {len(df)} digests to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _write_verdicts(verdicts: pd.DataFrame, out: str) -> None:
    from wcviz._errors import TableError

    suffix = Path(out).suffix.lower()
    if suffix == ".csv":
        verdicts.to_csv(out, index=False)
    elif suffix == ".parquet":
        verdicts.to_parquet(out, index=False)
    elif suffix == ".json":
        Path(out).write_text(verdicts.to_json(orient="records", indent=1))
    else:
        raise TableError(f"{out}: unknown table format {suffix or '(no suffix)'}; use .csv, .parquet or .json")


def _compare(args: argparse.Namespace) -> int:
    from wcviz._errors import TableError
    from wcviz.verdicts import compare, counts

    expected, actual = _load_pair(args)
    verdicts = compare(expected, actual)
    if verdicts.empty:
        raise TableError(f"{args.expected} and {args.actual} hold no digests: nothing was compared")
    if args.out:
        _write_verdicts(verdicts, args.out)
    shown = verdicts if args.all else verdicts[verdicts["status"] != "match"]
    ids = ("rank", "tp", "pp", "dp", "ep")
    cols = [c for c in _VERDICT_COLUMNS if c not in ids or verdicts[c].notna().any()]
    if len(shown):
        print(shown[cols].to_string(index=False))
    n = counts(verdicts)
    print(", ".join(f"{v} {k}" for k, v in n.items() if v))
    return 0 if n["match"] == len(verdicts) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    from wcviz._errors import WcvizError

    args = _parser().parse_args(argv)
    try:
        return _digest(args) if args.command == "digest" else _compare(args)
    except WcvizError as e:
        print(f"wcviz: error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"wcviz: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("wcviz: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
