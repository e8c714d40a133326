"""Host hashes of many tensors side by side, on as many threads as the digest kernel may use.

SHA-256 (``sha256``, and the engines' ``vllm-sha256`` and ``sglang-cpu``) is one
stream per tensor: it cannot be split, so one tensor runs on one core, at about 1-2
GB/s. Many tensors can run side by side: ``hashlib`` releases the GIL while it hashes
a buffer of more than 2 KiB, so threads give one stream per core (2 cores: 1.0 ->
2.0 GB/s over 8 tensors of 32 MiB, ``benchmarks/engine_digests.py``). The thread
count is the numba kernel's for the calling thread (:func:`wcviz.digest.set_digest_threads`
lowers both), else the CPUs this process may run on.

Jobs are pulled from their iterable lazily, never more in flight than threads, so a
reader that makes one buffer per job holds at most that many at once.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

__all__ = ["HASHLIB_ALGOS", "MIN_THREADED", "host_threads", "side_by_side"]

HASHLIB_ALGOS = frozenset({"sha256", "vllm-sha256", "sglang-cpu"})
"""Algorithms that are one SHA-256 stream per tensor: the ones worth running side by side."""

MIN_THREADED = 1 << 16
"""Bytes below which a job runs on the calling thread: handing it to a thread costs more than hashing it."""

T = TypeVar("T")


def host_threads() -> int:
    """Threads host hashes may use from the calling thread: the numba kernel's count here, else the usable CPUs."""
    numba = sys.modules.get("numba")  # loaded by the kernel or by set_digest_threads; not imported for this
    if numba is not None:
        return max(1, int(numba.get_num_threads()))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def _timed(job: Callable[[], T]) -> tuple[T, float]:
    t0 = time.perf_counter()
    value = job()
    return value, time.perf_counter() - t0


def side_by_side(
    jobs: Iterable[tuple[Callable[[], T], int]],
    *,
    threads: int | None = None,
    done: Callable[[int], None] | None = None,
) -> list[tuple[T, float]]:
    """Run ``(job, nbytes)`` pairs, each on its own, up to ``threads`` at once; ``[(result, seconds)]`` in job order.

    A job of fewer than :data:`MIN_THREADED` bytes, or every job when there is one thread,
    runs on the calling thread. ``done(nbytes)`` is called on the calling thread as jobs
    finish (a progress bar). A job's error raises here once the jobs already started have
    finished (those not started never start): nothing is left running behind the caller.
    """
    n = host_threads() if threads is None else max(1, threads)
    results: dict[int, tuple[T, float]] = {}
    if n == 1:
        out = []
        for job, nbytes in jobs:
            out.append(_timed(job))
            del job  # its buffer goes before the next one is made
            if done is not None:
                done(nbytes)
        return out
    pending: deque[tuple[int, Future[tuple[T, float]], int]] = deque()
    count = 0
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="wcviz-hash") as pool:
        try:
            for job, nbytes in jobs:
                if nbytes < MIN_THREADED:
                    results[count] = _timed(job)
                    if done is not None:
                        done(nbytes)
                else:
                    while len(pending) >= n:  # at most n buffers in flight
                        i, fut, size = pending.popleft()
                        results[i] = fut.result()
                        if done is not None:
                            done(size)
                    pending.append((count, pool.submit(_timed, job), nbytes))
                count += 1
            while pending:
                i, fut, size = pending.popleft()
                results[i] = fut.result()
                if done is not None:
                    done(size)
        finally:
            for _, fut, _ in pending:  # on an error: those not started never start; the pool waits for the rest
                fut.cancel()
    return [results[i] for i in range(count)]
