"""What building one validated frame from an agent's answer costs: the client's share of a fan-out.

    python benchmarks/frame.py [--rows 500] [--repeat 7] [--inner 20]

Builds the rows an agent sends for ``--rows`` bf16 parameters (JSON in, JSON out, as
over HTTP) and times :func:`wcviz.frame.make_frame` on them (best of ``--repeat``
rounds of ``--inner`` calls), and, in the same process, the part of it that checks
every digest against its algorithm's format; then the same for the rows a checkpoint
reader makes (``layer``, ``block`` and ``expert`` parsed from the names, as
``from_safetensors`` has them). To compare two versions of wcviz, run it against each in
alternation, e.g. ``PYTHONPATH=/path/to/other/checkout python benchmarks/frame.py``
(BENCHMARKS.md, "Hardening").

``--after`` also times ``make_frame`` of the checkpoint rows where a reader builds it: right
after the numba kernel has read 2 GiB (the caches then hold none of pandas), after a 0.3 s
sleep and after 0.3 s of a busy Python loop, against back to back (best of ``--repeat``
single calls each, with the most minor page faults one call took).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any


def _best(fn: Callable[[], Any], repeat: int, inner: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--after", action="store_true", help="also time make_frame after a 2 GiB digest and after a sleep")
    args = ap.parse_args()

    import pandas as pd
    import torch

    import wcviz
    import wcviz.frame
    from wcviz.frame import json_cell, make_frame, validate
    from wcviz.sources import from_named_tensors

    g = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i // 10}.mlp.p{i}.weight": torch.randn(256, generator=g).to(torch.bfloat16) for i in range(args.rows)}
    frame = from_named_tensors(tensors, role="engine", rank=3, dp=0, pp=0, tp=1, host="node0", progress=False)
    rows = json.loads(json.dumps([{k: json_cell(v) for k, v in r.items()} for r in frame.to_dict(orient="records")]))
    built = make_frame(rows)
    assert len(built) == args.rows and built["digest"].tolist() == frame["digest"].tolist()
    whole = _best(lambda: make_frame(rows), args.repeat, args.inner)
    print(f"wcviz at {wcviz.__file__}")
    print(f"make_frame of {args.rows} agent rows: {whole * 1e3:.2f} ms (best of {args.repeat} x {args.inner})")
    checked = getattr(wcviz.frame, "_checked_digests", None)  # absent in versions without the check
    if checked is not None:
        typed = validate(pd.DataFrame.from_records(rows))
        part = _best(lambda: checked(typed, "rows"), args.repeat, args.inner)
        print(f"  of which the digest-format check: {part * 1e3:.2f} ms ({part / whole:.0%})")
    ckpt = [
        {k: r[k] for k in ("name", "digest", "algo", "dtype", "shape", "nbytes", "device", "seconds")} | {"role": "checkpoint", "phase": "current"}
        for r in rows
    ]
    assert make_frame(ckpt)["layer"].tolist() == frame["layer"].tolist()
    reader = _best(lambda: make_frame(ckpt), args.repeat, args.inner)
    print(f"make_frame of {args.rows} checkpoint rows (layer, block, expert parsed): {reader * 1e3:.2f} ms (best of {args.repeat} x {args.inner})")
    if args.after:
        _after(lambda: make_frame(ckpt), args.rows, args.repeat)


def _after(build: Callable[[], Any], n: int, repeat: int) -> None:
    import resource

    import numpy as np

    from wcviz.digest._numba import lanes_digest

    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            continue

    big = np.ones(2 << 30 >> 3, dtype=np.uint64)
    lanes_digest(big, (1, 2))
    for label, before in (
        ("back to back", lambda: None),
        ("right after the kernel read 2 GiB", lambda: lanes_digest(big, (1, 2))),
        ("after a 0.3 s sleep", lambda: time.sleep(0.3)),
        ("after 0.3 s of a busy Python loop", lambda: spin(0.3)),
    ):
        best, faults = float("inf"), 0
        for _ in range(repeat):
            before()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            build()
            best = min(best, time.perf_counter() - t0)
            faults = max(faults, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        print(f"  make_frame of {n} checkpoint rows, {label}: {best * 1e3:.2f} ms (best of {repeat}; at most {faults} page faults)")


if __name__ == "__main__":
    main()
