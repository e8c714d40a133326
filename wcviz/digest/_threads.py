"""The CPU kernels' threads: helpers that sleep when idle, work handed out by an atomic counter.

Why not numba's parallel loops. Their usual runtime, GNU OpenMP, keeps its threads
spinning after every parallel loop (its default wait policy): a host that digests a
tensor and then does its own work pays a second core spinning beside it
(``benchmarks/idle_threads.py``: 104% of the host's own work in CPU burned on a 2-core
Xeon), and in a refit the spinning of one process takes the core the other process
needs. ``OMP_WAIT_POLICY=PASSIVE`` cures it, but only for a whole process, torch
included, and only if set before start: not a library's to set.

Here a parallel call puts its work on a queue that up to ``threads - 1`` helper threads
block on (no CPU while idle), then works on it itself. Every participant claims items
(a group of blocks, a tensor) from a shared counter with an atomic add *inside* the
compiled, GIL-free kernel: a helper that wakes late takes fewer items, one that wakes
after the work is gone takes none, and the caller never waits for a helper that has
not claimed anything. The caller returns when every item is finished, spinning only
for the items still in flight on helpers (one each at most).

Between calls. A helper done with a call listens ~0.15 ms for the next one inside the
kernel (``leave``), where it holds no GIL, unless work is already queued for it; the
caller rings for it on entering the kernel (``arrive``), once it no longer holds the
GIL itself. Back-to-back digests then neither wake a sleeping thread nor hand the GIL
back and forth.

The counter is an ``int64`` array: slot 0 is set when a participant failed (its error is
raised by the caller); phase ``p`` (at most 3) claims from slot ``1 + 2p`` and counts
finished items in slot ``2 + 2p``; slot 7 counts the helpers inside the call's kernel.
A call that fails (the caller's kernel raised, a helper failed, an interrupt) is closed
before its error is raised: nothing is left to claim, every wait returns, and the caller
waits for the helpers still inside, so none reads the call's memory after it returned. A kernel with two phases (groups, then the chains
that need all of them) waits for the first to finish before claiming in the second
(:func:`wait`).

As for ``_simd``: the kernels inline ``claim``, ``arrive`` and ``leave``, and numba keys a
kernel's disk cache by the kernel's own source file, so after changing code here clear
the ``__pycache__`` of the modules that use it.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["SLOTS", "claim", "claimed", "finished", "arrive", "leave", "wait", "spread", "threads_here"]

SLOTS = 8  # the failure flag, (next, finished) for up to 3 phases, then helpers inside the call's kernel
# A helper done with its work listens for the next call this many reads (~150 us) inside the kernel before
# it goes back to Python and sleeps. Waking a sleeping thread costs ~0.2 ms in a VM, and a helper back in
# Python takes the GIL from a caller still busy between two calls: back-to-back digests of a few MiB each
# would pay either every call. Bounded, so an idle host pays at most that once per call, not a core.
_POLLS = 30_000
# [0]: rung by the caller of every kernel that may have helpers (``arrive``); [1]: requests queued for helpers
# and not yet taken (``_count_queued``; read by ``leave``: a helper with work waiting does not listen)
_BELL = np.zeros(2, dtype=np.int64)


@intrinsic
def _fetch_add(typingctx, ctr, i, v):  # type: ignore[no-untyped-def]
    """``ctr[i] += v`` as one sequentially consistent atomic step; the value before."""
    if not (isinstance(ctr, types.Array) and ctr.dtype == types.int64 and ctr.ndim == 1):
        return None
    if not (isinstance(i, types.Integer) and isinstance(v, types.Integer)):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        index = context.cast(builder, args[1], sig.args[1], types.intp)
        value = context.cast(builder, args[2], sig.args[2], types.int64)
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], arr, [index])
        return builder.atomic_rmw("add", ptr, value, "seq_cst")

    return types.int64(ctr, i, v), codegen


@njit(cache=True, inline="always")
def claim(ctr, p):  # type: ignore[no-untyped-def]
    """The next item of phase ``p`` (past the last when none is left)."""
    return _fetch_add(ctr, 1 + 2 * p, 1)


@njit(cache=True, inline="always")
def arrive(bell, helper):  # type: ignore[no-untyped-def]
    """A claiming kernel's first step: the caller (it queued the work, then entered the kernel) rings ``bell``
    for the helpers listening since their last call. Rung here, where the caller no longer holds the GIL, a
    helper that hears it takes the GIL at once instead of sleeping until it is free."""
    if not helper:
        _fetch_add(bell, 0, 1)


@njit(cache=True, inline="always")
def leave(bell, helper):  # type: ignore[no-untyped-def]
    """A claiming kernel's last step: a helper listens a while for the next call before it goes back to Python,
    where it would take the GIL from a caller still busy with this call's results."""
    if helper:
        seen = _fetch_add(bell, 0, 0)
        for _ in range(_POLLS):
            if _fetch_add(bell, 0, 0) != seen or _fetch_add(bell, 1, 0) > 0:
                return


@njit(cache=True, inline="always")
def claimed(ctr, p):  # type: ignore[no-untyped-def]
    """Claims made so far in phase ``p`` (including those that found nothing left)."""
    return _fetch_add(ctr, 1 + 2 * p, 0)


@njit(cache=True, inline="always")
def finished(ctr, p):  # type: ignore[no-untyped-def]
    """Count one item of phase ``p`` as done (after its results were written)."""
    _fetch_add(ctr, 2 + 2 * p, 1)


@njit(nogil=True, cache=True)
def wait(ctr, p, n):  # type: ignore[no-untyped-def]
    """Until ``n`` items of phase ``p`` are done (True) or a helper failed (False)."""
    while _fetch_add(ctr, 2 + 2 * p, 0) < n:
        if _fetch_add(ctr, 0, 0):
            return False
    return True


@njit(nogil=True, cache=True)
def _fail(ctr):  # type: ignore[no-untyped-def]
    _fetch_add(ctr, 0, 1)


@njit(nogil=True, cache=True)
def _close(ctr):  # type: ignore[no-untyped-def]
    """A failed call: flag it (in-kernel waits return), leave nothing to claim, and wait for the helpers inside
    to finish their item in flight."""
    _fetch_add(ctr, 0, 1)
    for p in range(3):
        _fetch_add(ctr, 1 + 2 * p, 1 << 40)
    while _fetch_add(ctr, 7, 0) > 0:
        continue  # spin: each helper inside finishes at most its item in flight, then listens at most _POLLS reads


def _failure_path() -> None:
    """Compile (or load from the disk cache) what closes a failed call, before the first call with helpers: it
    must run at once, never after a compile that a second Ctrl-C could interrupt while helpers still read the
    call's memory. Each kernel is called from Python, as ``spread`` calls it, on a counter of its own."""
    ctr = np.zeros(SLOTS, dtype=np.int64)
    _fail(ctr)
    _close(ctr)
    wait(ctr, 0, 0)


@njit(nogil=True, cache=True)
def _inside(ctr, k):  # type: ignore[no-untyped-def]
    """A helper enters (``k = 1``) or leaves (``k = -1``) a call's kernel."""
    _fetch_add(ctr, 7, k)


_BELL_LOCK = threading.Lock()


def _count_queued(q: queue.SimpleQueue[Any]) -> None:
    """Set ``_BELL[1]`` to the requests queued for helpers now. Read and written under one lock by whoever last
    changed the queue, the count is right once the queue is still, even after an interrupt between a put (or a
    get) and its count: a running count kept by each side would drift for good."""
    with _BELL_LOCK:
        _BELL[1] = q.qsize()


def threads_here() -> int:
    """Threads the kernels may use from the calling thread: numba's count for it (``set_digest_threads``)."""
    import numba

    return max(1, int(numba.get_num_threads()))


class _Helpers:
    """Daemon threads blocked on one queue, started as needed, new after a fork (threads do not survive one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._queue: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...], list[BaseException]]] = queue.SimpleQueue()
        self._count = 0

    def ask(self, k: int, work: Callable[..., None], args: tuple[Any, ...], errors: list[BaseException]) -> None:
        """Have ``k`` helpers call ``work(*args)`` (each claims what is left when it wakes)."""
        with self._lock:
            if self._pid != os.getpid():
                self._pid, self._queue, self._count = os.getpid(), queue.SimpleQueue(), 0
            while self._count < k:
                threading.Thread(target=self._serve, args=(self._queue,), name=f"wcviz-digest-{self._count}", daemon=True).start()
                self._count += 1
            q = self._queue
        try:
            for _ in range(k):
                q.put((work, args, errors))
        finally:
            _count_queued(q)

    def forget(self) -> None:
        """In a forked child: no helper came along, and the lock may have been held by a thread that did not."""
        self._lock = threading.Lock()
        self._pid, self._queue, self._count = os.getpid(), queue.SimpleQueue(), 0
        _BELL[1] = 0

    @staticmethod
    def _serve(q: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...], list[BaseException]]]) -> None:
        while True:
            work, args, errors = q.get()  # sleeps: no CPU while idle (the kernel listened a while first)
            _count_queued(q)
            ctr = args[-3]
            _inside(ctr, 1)
            try:
                work(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
                errors.append(e)
                _fail(ctr)
            finally:
                _inside(ctr, -1)
            del work, args, errors, ctr  # hold no tensor while idle


_HELPERS = _Helpers()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_HELPERS.forget)


def spread(work: Callable[..., None], args: tuple[Any, ...], items: int, *, last: tuple[int, int] | None = None) -> None:
    """Run the claiming kernel ``work(*args, ctr, bell, helper)`` on this thread and on helpers, until all is done.

    The kernel calls :func:`arrive` on entry, before its first claim, and :func:`leave` last.

    ``items`` bounds the participants (no helper for work of one item); ``last`` is
    ``(phase, items)`` of the phase whose end means the whole work is done (default:
    phase 0, ``items``). Raises a helper's error, if one failed.
    """
    ctr = np.zeros(SLOTS, dtype=np.int64)
    k = min(threads_here(), items) - 1
    if k <= 0:
        work(*args, ctr, _BELL, False)
        return
    if not _close.signatures:
        _failure_path()
    errors: list[BaseException] = []
    phase, n = last if last is not None else (0, items)
    try:
        _HELPERS.ask(k, work, (*args, ctr, _BELL, True), errors)
        work(*args, ctr, _BELL, False)
        done = wait(ctr, phase, n)
    except BaseException:
        _close(ctr)  # (the caller failed, or was interrupted: no helper may go on reading the call's memory)
        raise
    if not done:
        _close(ctr)
        raise errors[0] if errors else RuntimeError("a digest helper thread failed")
