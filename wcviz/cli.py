"""The ``wcviz`` command: digest checkpoints, compare tables, fetch agents, verify an engine, run the end-state check.

``digest`` and ``compare`` work on files; ``fetch`` and ``endstate`` on running
agents (``endstate`` is destructive and asks for ``--yes-reset``); ``verify`` compares
a running vLLM or SGLang with a checkpoint through the engine's own checker, read-only;
``demo`` runs the
simulated-cluster demo. Exit status: 0 all match (every rank answered), 1 something
differs or a rank did not answer, 2 bad input (a clear one-line error naming the
file, tensor, column or flag; never a traceback), 130 on Ctrl-C. For ``demo``, 0 means
the check found what the injected fault should give, 1 that it did not.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pandas loads only where a command needs a frame: ``wcviz digest`` prints its table without it
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

    f = sub.add_parser("fetch", help="fetch the digests of running agents over HTTP; exit 1 if a rank did not answer or holds nothing, or --name matched nothing")
    f.add_argument("urls", nargs="+", metavar="URL", help="agent base URLs (http://host:port)")
    f.add_argument("--out", metavar="FILE", help="write the frame here (.csv/.parquet/.json)")
    f.add_argument("--name", metavar="REGEX", help="only parameters whose name matches")
    f.add_argument("--timeout", type=float, default=10.0, metavar="S", help="per-request timeout in seconds (default 10)")
    f.add_argument("--retries", type=int, default=2, help="retries per request on connection errors, timeouts and 5xx (default 2; the pause doubles from 0.1 s to at most 2 s)")

    v = sub.add_parser(
        "verify",
        help="read-only: does a running vLLM or SGLang hold what a checkpoint says each rank must? exit 1 if not",
        description="Cut the checkpoint as the engine lays it out for the topology, digest each rank's expected shard "
        "in the engine's own checksum, ask the engine's own checker (vLLM: /weight_checker with VLLM_SERVER_DEV_MODE=1; "
        "SGLang: /weights_checker) and compare. Nothing is reset; nothing is installed in the engine.",
    )
    v.add_argument("url", metavar="URL", help="the engine's HTTP server (http://host:port)")
    v.add_argument("--checkpoint", required=True, metavar="DIR", help="the trainer's safetensors checkpoint (file or directory, with config.json)")
    v.add_argument("--tp", type=int, required=True, help="tensor-parallel size the engine runs with")
    v.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    v.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    v.add_argument("--ep", type=int, default=1, help="expert-parallel size (default 1): vLLM with --enable-expert-parallel tp*dp; SGLang --ep-size, which divides tp")
    v.add_argument("--family", help="model family (llama, mistral, qwen2, mixtral; default: config.json's model_type)")
    v.add_argument("--engine", choices=("auto", "vllm", "sglang"), default="auto", help="which engine (default: ask the server)")
    v.add_argument("--heads", type=int, help="attention heads (default: config.json)")
    v.add_argument("--kv-heads", type=int, help="key/value heads (default: config.json)")
    v.add_argument("--dtype", default="auto", help="the dtype the engine serves (default auto: as the engine resolves --dtype auto; vLLM: config.json's, else the checkpoint's, float32 served as bfloat16 (give it on pre-Ampere GPUs); SGLang: config.json's, float32 served as float16)")
    v.add_argument("--vocab-padding", type=int, default=64, help="vocabulary padding (vLLM's DEFAULT_VOCAB_PADDING_SIZE, 64)")
    v.add_argument("--token", help="the engine's API key, sent as a bearer token (SGLang: the admin key; default $WCVIZ_ENGINE_TOKEN)")
    v.add_argument(
        "--algo", choices=("vllm-sha256", "sglang-gpu", "sglang-cpu"), default=None,
        help="the engine's checksum (default: vllm-sha256 for vLLM, sglang-gpu for SGLang; sglang-cpu: an SGLang whose weights are on the CPU)",
    )  # fmt: skip
    v.add_argument("--timeout", type=float, default=120.0, metavar="S", help="per-request timeout in seconds (default 120)")
    v.add_argument("--out", metavar="FILE", help="also write the verdict table here (.csv/.parquet/.json)")
    v.add_argument("--all", action="store_true", help="list matching rows too")

    e = sub.add_parser(
        "endstate",
        help="DESTRUCTIVE: snapshot, reset (poison every weight), reload and compare on running agents",
        description="The end-state check over agents: snapshot -> reset -> reload -> compare. The reset overwrites "
        "every weight of every rank with a poison pattern until the reload; a failed reload leaves those ranks "
        "poisoned (the report names them). Needs agents started with mutations allowed, their token, and --yes-reset.",
    )
    e.add_argument("urls", nargs="+", metavar="URL", help="engine agent base URLs")
    e.add_argument("--token", help="the agents' bearer token (default: $WCVIZ_TOKEN)")
    e.add_argument("--yes-reset", action="store_true", help="confirm: every weight is poisoned until the reload")
    e.add_argument("--out", metavar="DIR", help="write the verdicts and each phase's digests here as parquet")
    e.add_argument("--timeout", type=float, default=60.0, metavar="S", help="per-request timeout in seconds (default 60)")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")

    b = sub.add_parser("bench", help="what digesting real models costs here: measured rates, predicted per model")
    b.add_argument("--models", nargs="+", metavar="NAME", help="models from wcviz.bench.ZOO (default: all)")
    b.add_argument("--backends", nargs="+", default=["torch", "numba"], choices=BACKENDS, help="digest backends (default torch numba)")
    b.add_argument("--big-mib", type=int, default=64, help="size of the large tensor the rate is measured on (default 64)")
    b.add_argument("--out", metavar="FILE", help="also write the frame (.csv/.parquet/.json)")
    b.add_argument("--plot", metavar="PNG", help="also draw the cost plot (predicted bars, measured dots) here")
    b.add_argument("--quick", action="store_true", help="backends only: no per-algorithm rates, no CLI start-up timing")

    m = sub.add_parser("demo", help="run the simulated-cluster demo (what `make demo` runs)", add_help=False)
    m.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the demo (see wcviz demo --help)")
    return p


def _is_table(path: str) -> bool:
    from wcviz.frame import TABLE_SUFFIXES

    return (
        Path(path).suffix.lower() in TABLE_SUFFIXES
        and not path.endswith(".safetensors.index.json")
        and not Path(path).is_dir()  # a checkpoint directory named "ck.csv" is still a checkpoint
    )


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
    progress = False if args.no_progress else None
    as_table = bool(args.out) and _is_table(args.out)
    if as_table:  # refused before the digesting, not after it
        _check_table_out(args.out)
    elif args.out:
        _check_out_dir(args.out)
    if args.format == "table" and not as_table:  # the common case: rows printed as they are, no frame, no pandas
        from wcviz._text import aligned
        from wcviz.sources import safetensors_rows

        rows = safetensors_rows(args.path, algo=args.algo, backend=args.backend, progress=progress)
        total = sum(r["nbytes"] for r in rows)
        text = aligned(rows, _TABLE_COLUMNS) + f"\n{len(rows)} tensors, {total:,} bytes, {rows[0]['algo']}\n"
        count = len(rows)
    else:
        from wcviz.frame import table_text, write_table
        from wcviz.sources import from_safetensors

        df = from_safetensors(args.path, algo=args.algo, backend=args.backend, progress=progress)
        if as_table:
            write_table(df, args.out)
            print(f"wrote {len(df)} digests to {args.out}", file=sys.stderr)
            return 0
        text = table_text(df, args.format)
        count = len(df)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {count} digests to {args.out}", file=sys.stderr)
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

    _check_table_out(args.out)  # before the digesting: a bad --out after it hid the verdicts behind exit 2
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


def _fetch(args: argparse.Namespace) -> int:
    from wcviz.frame import IDENTITY, write_table
    from wcviz.sources import fetch

    _check_table_out(args.out)
    res = fetch(args.urls, timeout_s=args.timeout, retries=args.retries, name=args.name)
    if args.out:
        write_table(res.frame, args.out)
        print(f"wrote {len(res.frame)} digests to {args.out}", file=sys.stderr)
    elif len(res.frame):
        cols = ["role", "rank"] + [c for c in IDENTITY[1:] if res.frame[c].notna().any()] + _TABLE_COLUMNS
        print(res.frame[cols].to_string(index=False))
    print(res.summary)
    if args.name is not None and res.answered and not len(res.frame):  # a typo in the filter is not an empty fleet's pass
        print(f"wcviz: no parameter name matches --name {args.name!r} on any of the {res.answered} rank(s) that answered", file=sys.stderr)
        return 1
    return 0 if res.complete else 1


def _endstate(args: argparse.Namespace) -> int:
    from wcviz.endstate import check_agents
    from wcviz.views import layer_rank_text

    if not args.yes_reset:
        raise ValueError(
            "the end-state check poisons every weight of every rank until the reload; "
            "pass --yes-reset to confirm (and only against ranks that can be reloaded)"
        )
    token = args.token or os.environ.get("WCVIZ_TOKEN")
    if not token:
        raise ValueError("the agents' mutating endpoints need their bearer token: pass --token or set WCVIZ_TOKEN")
    out = _writable_dir(args.out) if args.out else None  # before anything is poisoned, not after the reload
    report = check_agents(args.urls, token=token, timeout_s=args.timeout, progress=not args.no_progress)
    if len(report.poisoned):
        print(str(report.summary).splitlines()[0])  # a rank left poisoned, before any table
    print(layer_rank_text(report.verdicts))
    print(report.details())
    print(report.summary)  # first: a rank left poisoned is said even if the tables cannot be written
    if out is not None:
        from wcviz.frame import write_table

        try:
            for phase, frame in report.frames.items():
                write_table(frame, out / f"{phase}.parquet")
            report.verdicts.to_parquet(out / "verdicts.parquet", index=False)
        except OSError as e:
            print(f"wcviz: could not write the tables to {out}: {e}", file=sys.stderr)
            return 1
        print(f"wrote verdicts and {len(report.frames)} phase tables to {out}", file=sys.stderr)
    return 0 if report.ok else 1


def _writable_dir(path: str) -> Path:
    """``path`` as a directory this process can write into (created if need be), or a ValueError naming it."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {path}: cannot create that directory ({e.strerror or e})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path}: this process cannot write into that directory")
    return out


def _check_table_out(out: str | None) -> None:
    """``--out`` as a table file that can be written (.csv, .parquet or .json, in a directory that exists and is
    writable): refused before minutes of digesting, not after them."""
    if not out:
        return
    from wcviz._errors import TableError

    suffix = Path(out).suffix.lower()
    if suffix not in (".csv", ".parquet", ".json"):
        raise TableError(f"{out}: unknown table format {suffix or '(no suffix)'}; use .csv, .parquet or .json")
    _check_out_dir(out)


def _check_out_dir(out: str) -> None:
    parent = Path(out).resolve().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: the directory {parent} does not exist or cannot be written")


def _verify(args: argparse.Namespace) -> int:
    from wcviz.live import verify_engine
    from wcviz.sources import checked_url

    checked_url(args.url, "engine")
    _check_table_out(args.out)
    report = verify_engine(
        args.url, args.checkpoint, tp=args.tp, pp=args.pp, dp=args.dp, ep=args.ep, family=args.family, engine=args.engine,
        heads=args.heads, kv_heads=args.kv_heads, dtype=args.dtype, vocab_padding=args.vocab_padding,
        token=args.token or os.environ.get("WCVIZ_ENGINE_TOKEN"), algo=args.algo, timeout_s=args.timeout,
    )  # fmt: skip
    if args.out:
        _write_verdicts(report.verdicts, args.out)
    shown = report.verdicts if args.all else report.verdicts[report.verdicts["status"] != "match"]
    if len(shown):
        cols = [c for c in ("dp", "pp", "tp", "name", "status", "digest_expected", "digest_actual") if c in shown]
        print(shown[cols].to_string(index=False, max_rows=200))
    print(report.summary)
    return 0 if report.ok else 1


def _bench(args: argparse.Namespace) -> int:
    import pandas as pd

    from wcviz.bench import ZOO, predicted_cost, predicted_text, recorded_rates, throughput

    _check_bench_args(args, ZOO)  # before a minute of measuring, not after
    rates = throughput(args.backends, big_mib=args.big_mib)
    for r in rates.itertuples(index=False):
        print(f"measured: {r.backend} {r.gbps:.2f} GB/s on {args.big_mib} MiB of bf16, {r.overhead_s * 1e3:.3f} ms per extra tensor")
    if not args.quick:
        from wcviz.bench import algorithm_rates, cli_startup

        for r in algorithm_rates(big_mib=args.big_mib).itertuples(index=False):
            print(f"algorithm: {r.algo} {r.gbps:.2f} GB/s on {args.big_mib} MiB of bf16 (this CPU)")
        start = cli_startup()
        print(f"start-up: wcviz digest of a 4.6 MB checkpoint {start['wcviz digest']:.2f} s; import torch alone {start['import torch']:.2f} s")
    gpu = recorded_rates()
    for r in gpu.itertuples(index=False):
        print(f"{r.rate_source}: {r.backend} {r.gbps:.2f} GB/s, {r.overhead_s * 1e3:.3f} ms per extra tensor")
    cost = predicted_cost(args.models, pd.concat([rates, gpu], ignore_index=True) if len(gpu) else rates)
    print(predicted_text(cost))
    if args.out:
        _write_verdicts(cost, args.out)
    if args.plot:
        from wcviz.views import plot_predicted_cost

        plot_predicted_cost(cost).savefig(args.plot, dpi=110)
        print(f"wrote the cost plot to {args.plot}", file=sys.stderr)
    return 0


def _check_bench_args(args: argparse.Namespace, zoo: Mapping[str, Any]) -> None:
    """``--models``, ``--out`` and ``--plot`` refused by name before anything is measured."""
    from wcviz._errors import TableError

    unknown = [n for n in args.models or () if n not in zoo]
    if unknown:
        raise ValueError(f"unknown model {', '.join(map(repr, unknown))}; choose from {', '.join(zoo)}")
    if args.out and Path(args.out).suffix.lower() not in (".csv", ".parquet", ".json"):
        raise TableError(f"{args.out}: unknown table format {Path(args.out).suffix or '(no suffix)'}; use .csv, .parquet or .json")
    if args.plot:
        from matplotlib.figure import Figure

        kinds = Figure().canvas.get_supported_filetypes()
        kind = Path(args.plot).suffix.lower().lstrip(".")
        if kind and kind not in kinds:  # no suffix: matplotlib writes its default format (png)
            raise ValueError(f"--plot {args.plot}: matplotlib cannot write {kind}; use one of .{', .'.join(sorted(kinds))}")
    for path in (args.out, args.plot):
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{path}: the directory {Path(path).resolve().parent} does not exist")


def _check_did_not_pass(e: BaseException) -> bool:
    """Whether ``e`` says an end-state check ran and failed (exit 1), not that its input was bad (exit 2).
    Looked up only once such an error exists: ``wcviz digest`` never loads the end-state check."""
    if "wcviz.endstate" not in sys.modules:
        return False
    from wcviz.endstate import EngineLeftPoisoned, ResetNotCovered, SnapshotUnusable

    return isinstance(e, (EngineLeftPoisoned, ResetNotCovered, SnapshotUnusable))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    from wcviz._errors import WcvizError

    argv = list(sys.argv[1:] if argv is None else argv)
    demo = argv[:1] == ["demo"]  # the demo parses its own flags; its errors and Ctrl-C are handled below too
    args = None if demo else _parser().parse_args(argv)
    commands = {"digest": _digest, "compare": _compare, "fetch": _fetch, "verify": _verify, "endstate": _endstate, "bench": _bench}
    try:
        if args is None:
            from wcviz.demo import main as run_demo

            return run_demo(argv[1:])
        return commands[args.command](args)
    except WcvizError as e:
        if _check_did_not_pass(e):  # not bad input: the check ran and did not pass
            print(f"wcviz: {e}", file=sys.stderr)
            return 1
        print(f"wcviz: error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"wcviz: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("wcviz: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, never a traceback in the middle of an incident
        if os.environ.get("WCVIZ_DEBUG"):
            raise
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        print(f"wcviz: error: {type(e).__name__}: {first} (set WCVIZ_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
