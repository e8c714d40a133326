"""What a digest costs in floor units on this CPU: one mix, one mix and a multiply, side by side in one process.

    python benchmarks/mix_cost.py

The compute bound of ``benchmarks/cpu_digest.py`` is ``floor / 6.6``: the floor is one mix per lane,
and a digest does 6 mixes and 2 multiplies per lane (both channels), a multiply being counted as 0.3
of a mix. Here the floor loop is timed as is and with one more multiply per lane, with the kernels'
vector arithmetic (32 lanes per expression), over a 32 KiB array in cache; the difference prices a
multiply, and ``6 + 2 * (multiply / mix)`` is the work per lane the kernel really has on this CPU.

A second table asks whether the floor is the machine's or only the vector ports': the same loop
with ``k`` scalar lanes mixed beside every 32 vector lanes (a 64-bit ``imul`` and the scalar shifts
run on ports the vector code leaves free). Lanes per second of both together, against the floor
alone, in alternation. LLVM's SLP vectorizer is turned off for this script, or it packs the scalar
lanes back into vectors; the table says how many scalar ``imul`` the loop body really has.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("NUMBA_SLP_VECTORIZE", "0")  # (before numba is imported) keep the scalar lanes scalar

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from wcviz.digest._numba import _M1, _Z, _mix  # noqa: E402
from wcviz.digest._simd import load, splat, store  # noqa: E402

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


def _beside(k: int):  # type: ignore[no-untyped-def]
    """The floor loop with ``k`` (0-4) scalar lanes mixed beside each 32 vector lanes."""

    @njit(cache=False)
    def run(a, b, reps):  # type: ignore[no-untyped-def]
        acc = splat(_Z, W)
        s0 = s1 = s2 = s3 = _Z
        for _ in range(reps):
            j = 0
            for i in range(0, a.shape[0], W):
                acc = acc ^ _mix(load(a, i, W))
                if k >= 1:
                    s0 ^= _mix(b[j])
                if k >= 2:
                    s1 ^= _mix(b[j + 1])
                if k >= 3:
                    s2 ^= _mix(b[j + 2])
                if k >= 4:
                    s3 ^= _mix(b[j + 3])
                j += k
        out = np.empty(W, dtype=np.uint64)
        store(out, 0, acc)
        return out[0] ^ s0 ^ s1 ^ s2 ^ s3

    return run


def _scalar_muls(f) -> int:  # type: ignore[no-untyped-def]
    """Scalar 64-bit multiplies in the basic block of ``f``'s machine code that has the most (the loop body)."""
    blocks = f.inspect_asm(f.signatures[0]).split("\n.LBB")
    return max(sum(line.split()[:1] == ["imulq"] for line in b.splitlines()) for b in blocks)


def beside() -> None:
    a = np.random.default_rng(1).integers(0, 2**63, 4096, dtype=np.uint64)
    b = np.random.default_rng(2).integers(0, 2**63, 4 * 4096 // W, dtype=np.uint64)
    loops = {k: _beside(k) for k in range(5)}
    best = dict.fromkeys(loops, float("inf"))
    for f in loops.values():
        f(a, b, 1)
    for _ in range(7):
        for k, f in loops.items():
            t0 = time.perf_counter()
            f(a, b, 2000)
            best[k] = min(best[k], time.perf_counter() - t0)
    rate = {k: 2000 * a.shape[0] * (1 + k / W) / v for k, v in best.items()}
    print("\n| scalar lanes beside 32 vector lanes (1 thread) | scalar `imul` in the loop | lane mixes per ns | × the floor alone |")
    print("|---:|---:|---:|---:|")
    for k, r in rate.items():
        print(f"| {k} | {_scalar_muls(loops[k])} | {r / 1e9:.3f} | {r / rate[0]:.3f}× |")


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
    beside()


if __name__ == "__main__":
    main()
