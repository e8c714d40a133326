"""The compute floor the CPU kernel is judged against (``benchmarks/cpu_digest.py``, ``fold_parts.py``).

One SplitMix64 mix per 64-bit lane of an array that stays in cache, with the
kernel's own vector arithmetic (``_numba._mix`` on ``_simd`` vectors), one copy of
the work per thread, all threads started together: what the cores can do at best.
"""

from __future__ import annotations

import threading
import time

import numba
import numpy as np
from numba import njit

from wcviz.digest._numba import _CACHE, _Z, _mix
from wcviz.digest._simd import load, splat, store
from wcviz.digest._threads import arrive, claim, claimed, finished, spread

__all__ = ["floor_rate"]

# One floor at a time: each waits at its start gate until all its tasks are claimed, so two floors whose
# helper requests interleave in the queue could each hold a helper the other waits for.
_ONE_AT_A_TIME = threading.Lock()

_FLOOR_WIDTH = 32  # lanes per vector expression: 8 AVX2 registers in flight


@njit(cache=_CACHE)
def _floor_pass(a, reps):  # type: ignore[no-untyped-def]
    """``reps`` times over ``a``: one ``_mix`` per lane, xor-accumulated (no carried multiply)."""
    acc = splat(_Z, _FLOOR_WIDTH)
    for _ in range(reps):
        for i in range(0, a.shape[0], _FLOOR_WIDTH):
            acc = acc ^ _mix(load(a, i, _FLOOR_WIDTH))
    out = np.empty(_FLOOR_WIDTH, dtype=np.uint64)
    store(out, 0, acc)
    x = _Z
    for v in out:
        x ^= v
    return x


@njit(nogil=True, cache=_CACHE)
def _floor_claimed(a, reps, tasks, out, ctr, bell, helper):  # type: ignore[no-untyped-def]
    """One ``_floor_pass`` per participant, all started together (each claims its task, then waits until
    every task is claimed): the floor is ``tasks`` threads at once, never one doing two in turn."""
    arrive(bell, helper)
    t = claim(ctr, 0)
    if t >= tasks:
        return
    while claimed(ctr, 0) < tasks:
        continue  # the start gate: spin (a few µs) until every task has its thread
    out[t] = _floor_pass(a, reps)
    finished(ctr, 0)


def floor_rate(threads: int | None = None, seconds: float = 0.2) -> float:
    """Lanes per second of the compute floor on ``threads`` threads (default: all).

    The floor is one SplitMix64 mix per 64-bit lane of a 32 KiB array that
    stays in cache, with the kernels' vector arithmetic, one copy of the work
    per thread: what the cores can do at best. A digest costs about 6.6 times
    that per lane (6 mixes and 2 multiplies for its two channels), so
    ``8 * floor_rate() / 6.6`` bytes/s bounds any kernel built from them.
    Best of several runs of about ``seconds / 5`` each.
    """
    a = np.random.default_rng(0).integers(0, 2**63, 4096, dtype=np.uint64)
    before = numba.get_num_threads()
    tasks = before if threads is None else threads
    with _ONE_AT_A_TIME:
        out = np.empty(tasks, dtype=np.uint64)
        numba.set_num_threads(tasks)
        try:
            spread(_floor_claimed, (a, 1, tasks, out), tasks)  # compile / warm
            reps = 16
            while True:
                t0 = time.perf_counter()
                spread(_floor_claimed, (a, reps, tasks, out), tasks)
                dt = time.perf_counter() - t0
                if dt >= seconds / 10 or reps >= 1 << 24:
                    break
                reps *= 2
            best = dt
            for _ in range(5):
                t0 = time.perf_counter()
                spread(_floor_claimed, (a, reps, tasks, out), tasks)
                best = min(best, time.perf_counter() - t0)
        finally:
            numba.set_num_threads(before)
    return tasks * reps * a.shape[0] / best
