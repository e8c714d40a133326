"""What building one validated frame from an agent's answer costs: the client's share of a fan-out.

    python benchmarks/frame.py [--rows 500] [--repeat 7] [--inner 20]

Builds the rows an agent sends for ``--rows`` bf16 parameters (JSON in, JSON out, as
over HTTP) and times :func:`wcviz.frame.make_frame` on them (best of ``--repeat``
rounds of ``--inner`` calls), and, in the same process, the part of it that checks
every digest against its algorithm's format. To compare two versions of wcviz, run it
against each in alternation, e.g. ``PYTHONPATH=/path/to/other/checkout python
benchmarks/frame.py`` (BENCHMARKS.md, "Hardening").
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


if __name__ == "__main__":
    main()
