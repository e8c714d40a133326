"""What a digest costs in floor units on this CPU: one mix, one mix and a multiply, side by side in one process.

    python benchmarks/mix_cost.py

The compute bound of ``benchmarks/cpu_digest.py`` is ``floor / 6.6``: the floor is one mix per lane,
and a digest does 6 mixes and 2 multiplies per lane (both channels), a multiply being counted as 0.3
of a mix. Here the floor loop is timed as is and with one more multiply per lane, with the kernels'
vector arithmetic (32 lanes per expression), over a 32 KiB array in cache; the difference prices a
multiply, and ``6 + 2 * (multiply / mix)`` is the work per lane the kernel really has on this CPU.
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit

from wcviz.digest._numba import _M1, _Z, _mix
from wcviz.digest._simd import load, splat, store

W = 32


@njit(cache=False)
def _plain(x):  # type: ignore[no-untyped-def]
    return _mix(x)


@njit(cache=False)
def _times_m(x):  # type: ignore[no-untyped-def]
    return _mix(x) * _M1


def _loop(g):  # type: ignore[no-untyped-def]
    @njit(cache=False)
    def run(a, reps):  # type: ignore[no-untyped-def]
        acc = splat(_Z, W)
        for _ in range(reps):
            for i in range(0, a.shape[0], W):
                acc = acc ^ g(load(a, i, W))
        out = np.empty(W, dtype=np.uint64)
        store(out, 0, acc)
        return out[0]

    return run


def main() -> None:
    a = np.random.default_rng(0).integers(0, 2**63, 4096, dtype=np.uint64)
    loops = {"mix": _loop(_plain), "mix then multiply": _loop(_times_m)}
    best = dict.fromkeys(loops, float("inf"))
    for f in loops.values():
        f(a, 1)
    for _ in range(7):  # in alternation: the host's speed drifts
        for k, f in loops.items():
            t0 = time.perf_counter()
            f(a, 2000)
            best[k] = min(best[k], time.perf_counter() - t0)
    ns = {k: v / (2000 * a.shape[0]) * 1e9 for k, v in best.items()}
    mul = ns["mix then multiply"] - ns["mix"]
    print("| loop (1 thread) | ns per lane | GB/s |")
    print("|---|---:|---:|")
    for k, v in ns.items():
        print(f"| {k} | {v:.4f} | {8 / v:.1f} |")
    work = 6 + 2 * mul / ns["mix"]
    print(f"\na multiply costs {mul / ns['mix']:.2f} of a mix here: a digest is {work:.2f} floors per lane, "
          f"so at best {6.6 / work:.0%} of the bound floor / 6.6")


if __name__ == "__main__":
    main()
