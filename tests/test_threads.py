"""The kernels' threads (``wcviz.digest._threads``): work claimed from an atomic counter, helpers that sleep.

What must hold: every item is done exactly once whoever claims it; the caller never waits for
a helper that has not claimed anything (so a busy or missing helper cannot stall a digest); a
helper's error reaches the caller; helpers burn no CPU while idle (numba's OpenMP pool spun
a second core beside the host's own work); and a forked child gets helpers of its own.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from wcviz.digest import _numba, _threads
from wcviz.digest._threads import claim, finished, spread


def _helper_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("wcviz-digest-")]


def test_every_item_is_done_once_whoever_claims_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(_threads, "threads_here", lambda: 3)
    done: list[int] = []
    roles: list[tuple[bool, bool]] = []

    def work(n: int, ctr: np.ndarray, bell: np.ndarray, helper: bool) -> None:
        slow = threading.current_thread().name.startswith("wcviz-digest-")
        roles.append((slow, helper))  # the kernels ring the bell as the caller and listen after it as a helper
        while (i := claim(ctr, 0)) < n:
            time.sleep(0.02 if slow else 0.001)  # a helper's item still in flight when the caller runs out
            done.append(int(i))
            finished(ctr, 0)

    spread(work, (50,), 50)
    assert sorted(done) == list(range(50))  # all written before spread returned
    assert (False, False) in roles and all(on_helper == helper for on_helper, helper in roles)


def test_a_helper_that_fails_raises_its_error_in_the_caller(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(_threads, "threads_here", lambda: 2)
    helper_claimed = threading.Event()

    def work(n: int, ctr: np.ndarray, bell: np.ndarray, helper: bool) -> None:
        on_helper = threading.current_thread().name.startswith("wcviz-digest-")
        if not on_helper:
            assert helper_claimed.wait(30)  # the helper claims first, then fails holding its item
        while (i := claim(ctr, 0)) < n:
            if on_helper:
                helper_claimed.set()
                raise RuntimeError(f"helper broke on item {i}")
            finished(ctr, 0)

    with pytest.raises(RuntimeError, match="helper broke on item 0"):
        spread(work, (4,), 4)


def test_a_caller_that_fails_closes_its_call_before_raising(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The caller's kernel raises holding an item it never finishes, while a helper waits for that phase to end
    (as ``_at_claimed`` does between its phases): the helper's wait returns, and the error is raised only once
    no helper is inside the call any more (none may read the call's memory after it returned)."""
    monkeypatch.setattr(_threads, "threads_here", lambda: 2)
    _compiled()
    helper_in, caller_claimed = threading.Event(), threading.Event()
    events: list[str] = []

    def work(n: int, ctr: np.ndarray, bell: np.ndarray, helper: bool) -> None:
        if not helper:
            assert helper_in.wait(30)
            claim(ctr, 0)
            caller_claimed.set()
            raise RuntimeError("caller broke")
        helper_in.set()
        assert caller_claimed.wait(30)
        while claim(ctr, 0) < n:
            time.sleep(0.05)  # an item still in flight when the caller fails
            finished(ctr, 0)
        events.append(f"helper's wait returned {_threads.wait(ctr, 0, n)}")

    with pytest.raises(RuntimeError, match="caller broke"):
        spread(work, (3,), 3)
    events.append("raised")
    assert events == ["helper's wait returned False", "raised"]


def _compiled() -> None:
    """Compile the protocol's own kernels first, so a test's timing is the protocol's, not numba's compiler's."""
    done = np.zeros(_threads.SLOTS, dtype=np.int64)
    _threads.wait(done, 0, 0)
    _threads._close(done)


def test_a_helper_that_fails_stops_the_others_before_the_error_is_raised(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(_threads, "threads_here", lambda: 3)
    _compiled()
    events: list[str] = []
    both_in = threading.Barrier(2, timeout=30)

    def work(n: int, ctr: np.ndarray, bell: np.ndarray, helper: bool) -> None:
        if not helper:
            while _threads.claimed(ctr, 0) < n:  # the caller claims nothing: the two helpers share the items
                time.sleep(0.001)
            return
        both_in.wait()
        i = claim(ctr, 0)
        if i == 0:
            raise RuntimeError("helper broke")
        while i < n:
            time.sleep(0.2 if i == n - 1 else 0.01)  # the last item still in flight when the caller gets to wait
            finished(ctr, 0)
            i = claim(ctr, 0)
        events.append("the other helper stopped")

    with pytest.raises(RuntimeError, match="helper broke"):
        spread(work, (20,), 20)
    events.append("raised")
    assert events == ["the other helper stopped", "raised"]


def test_the_caller_does_not_wait_for_a_helper_that_has_not_started(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(_threads, "threads_here", lambda: 2)
    go = threading.Event()
    woke: list[str] = []
    ask = _threads._HELPERS.ask

    def late(k, work, args, errors):  # type: ignore[no-untyped-def]
        def slow(*a):  # type: ignore[no-untyped-def]
            go.wait(30)
            woke.append(threading.current_thread().name)
            work(*a)

        ask(k, slow, args, errors)

    monkeypatch.setattr(_threads._HELPERS, "ask", late)
    done: list[tuple[int, str]] = []

    def work(n: int, ctr: np.ndarray, bell: np.ndarray, helper: bool) -> None:
        while (i := claim(ctr, 0)) < n:
            done.append((int(i), threading.current_thread().name))
            finished(ctr, 0)

    spread(work, (5,), 5)  # returns with the helper still asleep: a wait for it would never end here
    assert woke == []
    assert sorted(i for i, _ in done) == list(range(5)) and {who for _, who in done} == {threading.current_thread().name}
    go.set()
    for _ in range(300):
        if woke:
            break
        time.sleep(0.01)
    assert len(woke) == 1 and len(done) == 5  # it woke, found nothing left, and did nothing


def _ticks(tid: int) -> int:
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15 of stat)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread CPU times from /proc (Linux)")
def test_helpers_burn_no_cpu_while_idle() -> None:
    if _threads.threads_here() < 2:
        pytest.skip("needs 2 or more kernel threads (NUMBA_NUM_THREADS, CPUs): with one, no helper exists to watch")
    lanes = np.random.default_rng(3).integers(0, 2**63, 8 * _numba._SERIAL_BELOW, dtype=np.uint64)
    for _ in range(20):
        _numba.lanes_digest(lanes, (1, 2))
    helpers = _helper_threads()
    assert helpers, "a parallel digest woke no helper"
    before = sum(_ticks(t.native_id) for t in helpers if t.native_id)
    time.sleep(0.5)
    after = sum(_ticks(t.native_id) for t in helpers if t.native_id)
    assert after - before <= 3, f"idle helpers used {after - before} clock ticks in 0.5 s"  # a spinning one: ~50


def _child_digest(n: int) -> tuple[tuple[int, int], int]:
    from wcviz.digest import set_digest_threads

    set_digest_threads(2)
    lanes = np.random.default_rng(5).integers(0, 2**63, n, dtype=np.uint64)
    got = _numba.lanes_digest(lanes, (3, 4))
    return got, sum(t.is_alive() for t in _helper_threads())


@pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="needs the fork start method (POSIX)")
def test_a_forked_child_gets_helpers_of_its_own() -> None:
    if _numba.numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 or more kernel threads (NUMBA_NUM_THREADS, CPUs): with one, a child starts no helper")
    n = 8 * _numba._SERIAL_BELOW + 5
    lanes = np.random.default_rng(5).integers(0, 2**63, n, dtype=np.uint64)
    want = _numba._digest_serial(lanes, np.uint64(3), np.uint64(4))
    _numba.lanes_digest(lanes, (3, 4))  # this process's helpers exist before the fork
    with mp.get_context("fork").Pool(1) as pool:
        got, helpers = pool.apply_async(_child_digest, (n,)).get(timeout=300)
    assert got == (int(want[0]), int(want[1]))
    assert helpers >= 1  # helper threads started in the child (a fork carries none over)


def test_threads_digesting_at_once_get_their_own_digests_and_leave_no_request_behind() -> None:
    """Callers on several threads share the helpers; every request queued for a helper is taken (the count a
    listening helper checks, so it does not listen while work waits for it, returns to zero)."""
    n = 4 * _numba.GROUP * _numba.BLOCK + 3
    arrays = [np.random.default_rng(40 + i).integers(0, 2**63, n, dtype=np.uint64) for i in range(4)]
    want = [tuple(int(w) for w in _numba._digest_serial(a, np.uint64(i), np.uint64(7))) for i, a in enumerate(arrays)]
    bad: list[int] = []

    def work(i: int) -> None:
        for _ in range(15):
            if _numba.lanes_digest(arrays[i], (i, 7)) != want[i]:
                bad.append(i)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    [t.start() for t in ts]
    [t.join(120) for t in ts]
    assert not bad and not any(t.is_alive() for t in ts)
    for _ in range(500):
        if _threads._BELL[1] == 0:
            break
        time.sleep(0.01)
    assert _threads._BELL[1] == 0


def test_an_interrupt_between_queueing_and_counting_leaves_no_count_behind() -> None:
    """The count of requests queued for helpers was kept by each side; an interrupt just after a put left it off by
    one for good (a helper then listened while work waited for it, or never listened at all)."""
    import os
    import queue as queue_mod

    n = 4 * _numba.GROUP * _numba.BLOCK + 3
    lanes = np.random.default_rng(3).integers(0, 2**63, n, dtype=np.uint64)
    want = _numba.lanes_digest(lanes, (1, 2))  # helpers started

    class InterruptAfterPut:
        def __init__(self, q: queue_mod.SimpleQueue) -> None:  # type: ignore[type-arg]
            self.q, self.armed = q, True

        def put(self, item: object) -> None:
            self.q.put(item)
            if self.armed:
                self.armed = False
                raise KeyboardInterrupt

        def qsize(self) -> int:
            return self.q.qsize()

    helpers = _threads._HELPERS
    real = helpers._queue
    helpers._queue, helpers._pid = InterruptAfterPut(real), os.getpid()  # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            _numba.lanes_digest(lanes, (1, 2))
    finally:
        helpers._queue = real
    for _ in range(3):
        assert _numba.lanes_digest(lanes, (1, 2)) == want
    for _ in range(500):
        if _threads._BELL[1] == 0:
            break
        time.sleep(0.01)
    assert _threads._BELL[1] == 0 and real.qsize() == 0


def test_the_failure_path_is_compiled_before_the_first_call_with_helpers() -> None:
    """Compiled lazily, the close of a failed call ran the compiler (or loaded its cache) first: a second Ctrl-C
    there left helpers reading the call's memory after the call had raised. A fresh process, whose first call
    with helpers succeeds, holds them compiled."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import numpy as np
        from wcviz.digest import _numba, _threads
        assert not _threads._close.signatures
        _numba.set_threads(2)
        _numba.lanes_digest(np.ones(4 * _numba.GROUP * _numba.BLOCK + 3, dtype=np.uint64), (1, 2))
        print(len(_threads._close.signatures), len(_threads._fail.signatures), len(_threads.wait.signatures))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "1"]
