"""Where the CPU kernel's time goes, in cache, on one thread: the whole fold, its leaf steps, its upper steps.

    python benchmarks/fold_parts.py [--rounds 3]

Each figure is a share of the compute bound (``floor / 6.6``, the floor timed in
the same round). One group of ``GROUP`` blocks of ``BLOCK`` lanes (512 KiB with
16 blocks: in L2) is folded again and again, so memory is out of the picture:

- *whole fold*: ``_fold_group`` as the kernel runs it;
- *leaf steps*: only the two-level steps that read the input rows (their
  transpose at the load included), results dropped into 4 slots; they do 3/4 of
  a fold's merges and are credited with that share. Three ways: as the kernel
  reads the rows (``GROUP`` sub-blocks of ``_SUB`` lanes side by side, rows
  ``_SUB`` lanes apart), with the rows a whole block apart (the layout before
  sub-blocks: 4 KiB-aligned rows share one L1 set), and with plain contiguous
  loads instead of the transpose (not a digest: what the transpose costs);
- *upper steps*: the same step on positions read back from a scratch row (no
  transpose), as the levels above the leaves do, credited the same way.

Each kind of step is timed as the kernel runs it (software-pipelined: the first
half of step ``i`` beside the second half of step ``i - 1``) and one step after
the other (``_step`` whole), which is what the pipelining bought.

A step that runs below the bound with its inputs in L1 is limited by its own
instructions (how they share the vector ports), not by memory or latency.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from numba import njit

from wcviz.digest import _numba as K
from wcviz.digest._floor import floor_rate
from wcviz.digest._simd import load, load_cols, store

G, W, W4 = K.GROUP, K._W, K._W4
G4 = 4 * G


@njit(cache=False)
def _leaf_input(src, lo, rows, i):  # type: ignore[no-untyped-def]
    """Step ``i`` at the leaves: 4 positions of every block, transposed from ``GROUP`` rows ``rows`` lanes apart."""
    return K._both_channels(load_cols(src, lo, rows, 4 * i, G))


@njit(cache=False)
def _plain_input(src, lo, rows, i):  # type: ignore[no-untyped-def]
    """The same amount of input as one leaf step, loaded contiguously (no transpose; not a digest)."""
    return K._both_channels(load(src, lo + G4 * i, G4))


@njit(cache=False)
def _upper_input(src, lo, rows, i):  # type: ignore[no-untyped-def]
    """Step ``i`` above the leaves: 4 positions read back from a scratch row, no transpose."""
    return load(src, 4 * i * W, W4)


def _steps(step_input, quarter: int, pipelined: bool):  # type: ignore[no-untyped-def]
    """Loops of ``rows // quarter`` steps on ``step_input``, one per ``GROUP * rows`` lanes of ``src`` (one
    loop for the upper steps), results dropped into 4 slots: as the kernel writes them (``pipelined``:
    first half of step i beside the second half of step i - 1) or one by one."""

    @njit(cache=False)
    def run(src, rows, reps, s):  # type: ignore[no-untyped-def]
        n = rows // quarter
        span = src.shape[0] if quarter == 16 else G * rows
        for _ in range(reps):
            for lo in range(0, src.shape[0], span):
                if pipelined:
                    y = K._step_a(step_input(src, lo, rows, 0))
                    for i in range(1, n):
                        y_next = K._step_a(step_input(src, lo, rows, i))
                        store(s, ((i - 1) & 3) * W, K._step_b(y))
                        y = y_next
                    store(s, 3 * W, K._step_b(y))
                else:
                    for i in range(n):
                        store(s, (i & 3) * W, K._step(step_input(src, lo, rows, i)))

    return run


_leaves_piped, _leaves = _steps(_leaf_input, 4, True), _steps(_leaf_input, 4, False)
_plain_piped = _steps(_plain_input, 4, True)
_uppers_piped, _uppers = _steps(_upper_input, 16, True), _steps(_upper_input, 16, False)


@njit(cache=False)
def _whole(src, b, reps, s):  # type: ignore[no-untyped-def]
    for _ in range(reps):
        K._fold_group(src, 0, b, s)


def _lanes_per_second(f, src: np.ndarray, b: int, lanes: int, s: np.ndarray, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    f(src, b, 1, s)  # compile, warm
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        f(src, b, reps, s)
        best = min(best, time.perf_counter() - t0)
    return lanes * reps / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    b = K.BLOCK
    src = np.random.default_rng(0).integers(0, 2**63, G * b, dtype=np.uint64)
    s = np.empty(b // 4 * W, dtype=np.uint64)
    numba.set_num_threads(1)
    print(f"GROUP {G} blocks of {b} lanes side by side ({G * b * 8 >> 10} KiB), read in sub-blocks of {K._SUB} lanes, "
          "1 thread; % of floor / 6.6 in the same round")
    print("| round | whole fold | leaf steps, pipelined | …rows a block apart | …plain loads, no transpose "
          "| upper steps, pipelined | leaf steps, one by one | upper steps, one by one |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in range(args.rounds):
        bound = floor_rate(1) / 6.6  # lanes per second
        whole = _lanes_per_second(_whole, src, b, G * b, s) / bound
        parts = [
            0.75 * _lanes_per_second(f, src, rows, lanes, s) / bound
            for f, rows, lanes in (
                (_leaves_piped, K._SUB, G * b),
                (_leaves_piped, b, G * b),
                (_plain_piped, K._SUB, G * b),
                (_uppers_piped, b, G * b // 4),
                (_leaves, K._SUB, G * b),
                (_uppers, b, G * b // 4),
            )
        ]
        print(f"| {r + 1} | {whole:.0%} | " + " | ".join(f"{p:.0%}" for p in parts) + " |")


if __name__ == "__main__":
    main()
