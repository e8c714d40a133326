"""``wcviz demo`` (``make demo``): a partial weight update caught on a simulated cluster.

Starts a trainer and an engine of TP 2 x PP 2 by default (``--tp``, ``--pp``) as real processes in one gloo group on
127.0.0.1, with an HTTP agent on every rank. The trainer takes a step and refits the
engine (transport check ``log``: both ends digest every parameter). Then the
end-state check runs over the agents: snapshot, reset (poison every weight), reload
by a refit with a loader fault injected, compare. The transport check of that reload
passes - the bytes arrived - and the end-state check names the layer, rank and
parameter the loader left behind (nothing, with ``--fault none``). Frames go to parquet
and the layer x rank view to a PNG in ``--out``; every process is stopped at the end.
Exit 0 when the verdicts are what the fault should give (its statuses, on the engine ranks and
parameters it strikes, and nothing else; no finding with ``--fault none``), 1 otherwise, 2 for
bad flags, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from wcviz.sim.engine import EngineLayout, LoaderFaults

__all__ = ["FAULTS", "fault_plan", "fits", "main", "run"]

# --fault choices: what each one injects into the update under test, aimed at engine ranks the layout has
# (the last rank holds the last pipeline stage, so lm_head); swap and fused need two TP ranks to differ.
FAULTS: dict[str, str] = {
    "skip": "mlp.down_proj is skipped on engine rank {one} (a dropped bucket)",
    "stale": "engine rank {last} ignores the update (woke from sleep with stale weights)",
    "fused": "fused qkv/gate_up take TP rank 0's slice on every rank",
    "swap": "engine ranks 0 and 1 load each other's TP shard",
    "cast": "every weight passes through float16 on engine rank 0 (tiny values lose bits)",
    "flip": "one bit flips in lm_head on engine rank {last}",
    "none": "no fault: a healthy update",
}


def fault_plan(fault: str, layout: EngineLayout) -> tuple[str, dict[int, LoaderFaults]]:
    """What ``fault`` injects on ``layout``: its description and ``{engine rank: LoaderFaults}``, every rank one
    the layout has; a ValueError naming the fault when the layout cannot show it (one TP rank cannot swap)."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}")
    if fault in ("swap", "fused") and layout.tp < 2:
        raise ValueError(f"--fault {fault} needs --tp 2 or more: with one TP rank there is no other shard to take")
    last, one = layout.world_size - 1, min(1, layout.world_size - 1)
    plans: dict[str, dict[int, LoaderFaults]] = {
        "skip": {one: LoaderFaults(skip=r"mlp\.down_proj")},
        "stale": {last: LoaderFaults(stale=True)},
        "fused": {r: LoaderFaults(fused_from_rank0=True) for r in range(layout.world_size)},
        "swap": {0: LoaderFaults(tp_as=1), 1: LoaderFaults(tp_as=0)},
        "cast": {0: LoaderFaults(cast=r".")},
        "flip": {last: LoaderFaults(flip_bit=r"lm_head")},
        "none": {},
    }
    return FAULTS[fault].format(one=one, last=last), plans[fault]


def fits(fault: str, layout: EngineLayout, verdicts: Any) -> str | None:
    """Why ``verdicts`` are not what ``fault`` on ``layout`` should give, or None when they are: the statuses,
    the engine ranks and the parameters it must name, and nothing else (a dead rank or an unrelated finding is
    not the injected fault caught)."""
    import re

    bad = verdicts[verdicts["status"] != "match"]
    if fault == "none":
        return None if not len(bad) else f"{len(bad)} findings where the update was healthy"
    if not len(bad):
        return "no finding"
    last, one = layout.world_size - 1, min(1, layout.world_size - 1)
    tp_of = {r: r % layout.tp for r in range(layout.world_size)}  # engine ranks: tp fastest, then pp
    want: dict[str, tuple[set[str], Any, str]] = {  # statuses, the ranks that must hold findings (all of them), names
        "skip": ({"unwritten"}, {one}, r"mlp\.down_proj"),
        "stale": ({"unwritten"}, {last}, r"."),
        "fused": ({"corrupted"}, {r for r, t in tp_of.items() if t != 0}, r"qkv_proj|gate_up_proj"),
        "swap": ({"corrupted"}, {0, 1}, r"."),
        "cast": ({"corrupted"}, {0}, r"."),
        "flip": ({"corrupted"}, {last}, r"lm_head"),
    }
    statuses, ranks, names = want[fault]
    found_ranks = {int(r) for r in bad["rank"].dropna()}
    problems = []
    if other := sorted(set(bad["status"].astype(str)) - statuses):
        problems.append(f"statuses {', '.join(other)} (want {', '.join(sorted(statuses))})")
    if bad["rank"].isna().any() or found_ranks != ranks:
        problems.append(f"findings on engine ranks {sorted(found_ranks)} (want {sorted(ranks)})")
    if stray := sorted({str(n) for n in bad["name"].dropna() if not re.search(names, str(n))}):
        problems.append(f"findings on {', '.join(stray[:3])}{', ...' if len(stray) > 3 else ''} (want names matching {names})")
    if fault == "flip" and len(bad) != 1:
        problems.append(f"{len(bad)} findings (one bit flips in one parameter)")
    return "; ".join(problems) or None


def _say(msg: str) -> None:
    print(msg, flush=True)


def _transport(result: Any) -> str:
    """The transport check in one line: per rank only when something is wrong."""
    if result.verified and result.ok:
        r = next(iter(result.ranks.values()))
        return f"{len(result.ranks)} engine ranks verified, {r.params} parameters ({r.nbytes:,} bytes) each: every digest matches"
    return result.describe()


def run(fault: str = "skip", out: str | Path = "demo-out", *, tp: int = 2, pp: int = 2, progress: bool = True) -> int:
    """Run the demo; returns 0 if the verdicts are what the injected fault should give, else 1."""
    from wcviz.frame import write_table
    from wcviz.sim import Cluster
    from wcviz.views import layer_rank_text, plot_layer_rank

    layout = EngineLayout(tp=tp, pp=pp)
    what, faults = fault_plan(fault, layout)  # before anything starts: a fault the layout cannot show is refused
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    _say(f"wcviz demo: a trainer + an engine of TP {tp} x PP {pp} on 127.0.0.1, fault: {fault}")
    with Cluster(layout=layout, verify="log", allow_mutations=True) as cluster:
        _say(f"[1] up in {time.monotonic() - t0:.1f} s: {1 + layout.world_size} processes in one gloo group, an agent on each")
        for info in cluster.ranks.values():
            _say(f"      {info.label:<32} pid {info.pid:<7} {info.url}")
        cluster.step()
        first = cluster.refit()
        _say(f"[2] trainer step {cluster.step_k}, refit (verify=log): {_transport(first)}")
        fetched = cluster.fetch()
        _say(f"[3] fetched over HTTP: {fetched.summary}; {len(fetched.frame)} rows")
        _say(f"[4] end-state check: snapshot -> reset (poison) -> reload by refit with the fault -> compare\n      fault: {what}")
        report = cluster.endstate(reload="refit", faults=faults, progress=progress)
        _say(f"      transport check of the reload: {_transport(report.transport)}")
        _say("")
        _say(layer_rank_text(report.verdicts))
        _say("")
        _say(report.details())
        _say(report.summary)
        paths = [write_table(f, out / f"{phase}.parquet") for phase, f in report.frames.items()]
        report.verdicts.to_parquet(out / "verdicts.parquet", index=False)
        paths.append(out / "verdicts.parquet")
        fig = plot_layer_rank(report.verdicts, title=f"end-state check, fault: {fault}")
        fig.savefig(out / "layer_rank.png", dpi=120, bbox_inches="tight")
        paths.append(out / "layer_rank.png")
        pids = cluster.pids
    _say(f"[5] wrote {', '.join(str(p) for p in paths)}")
    _say(f"[6] stopped {len(pids)} processes; {time.monotonic() - t0:.1f} s in all")
    why = fits(fault, layout, report.verdicts)
    if why is None:
        _say(f"the end-state check found {'what the fault should give' if fault != 'none' else 'no problem'} (as expected)")
    else:
        _say(f"the end-state check did NOT find what --fault {fault} should give: {why}")
    _say("next: `make lab` opens JupyterLab on notebooks/; 02_partial_update.ipynb runs this check from a dashboard")
    return 0 if why is None else 1


def _flag_error(fault: str, out: str | Path, tp: int, pp: int) -> str | None:
    """What is wrong with the demo's flags, naming the flag, or None: checked before any process starts.

    ``--tp``/``--pp`` against the demo's model (TINY: each size must split it), ``--fault``
    against the layout, ``--out`` as a folder this process can write into (created here).
    """
    from wcviz.cli import _writable_dir
    from wcviz.sim.model import TINY

    for flag, value, (t, p) in (("--tp", tp, (tp, 1)), ("--pp", pp, (1, pp))):
        if value < 1:
            return f"{flag} {value}: must be 1 or more"
        try:
            EngineLayout(tp=t, pp=p).check(TINY)
        except ValueError as e:
            return f"{flag} {value}: the demo's model cannot be split so: {e}"
    layout = EngineLayout(tp=tp, pp=pp)
    try:
        layout.check(TINY)  # both at once, as the cluster checks them
    except ValueError as e:
        return f"--tp {tp} --pp {pp}: the demo's model cannot be split so: {e}"
    try:
        fault_plan(fault, layout)  # names --fault itself
        _writable_dir(str(out))  # names --out itself
    except ValueError as e:
        return str(e)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """``wcviz demo``: 0 the verdicts are as the fault should give, 1 they are not; bad flags: one line and exit 2."""
    ap = argparse.ArgumentParser(prog="wcviz demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fault", choices=list(FAULTS), default="skip", help="loader fault injected into the update under test (default skip)")
    ap.add_argument("--out", default="demo-out", help="folder for the parquet frames and the PNG (default demo-out/)")
    ap.add_argument("--tp", type=int, default=2, help="engine tensor-parallel size (default 2)")
    ap.add_argument("--pp", type=int, default=2, help="engine pipeline-parallel size (default 2)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    why = _flag_error(args.fault, args.out, args.tp, args.pp)
    if why is not None:  # bad flags: one line and exit 2, before any process starts
        ap.exit(2, f"{ap.prog}: error: {why}\n")
    return run(args.fault, args.out, tp=args.tp, pp=args.pp, progress=not args.no_progress)


if __name__ == "__main__":
    sys.exit(main())
