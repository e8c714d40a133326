"""The cluster's processes: one fresh interpreter per rank, its command pipe, and every way to take them down.

:class:`RankProcesses` starts ranks (:func:`wcviz.sim._worker.entry`), sends commands
(to every rank that takes part first, since collectives need them all), collects one
reply each within a deadline, and stops them all - politely, then SIGTERM, then
SIGKILL - on exit, error, Ctrl-C or when the object is lost.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from wcviz.sim import _worker

__all__ = ["Key", "RankProcesses"]

Key = tuple[str, int]  # (role, rank)
_ROOT = str(Path(__file__).resolve().parents[2])  # so the rank finds this very wcviz, installed or not


class RankProcesses:
    """The rank processes of one cluster, keyed by (role, rank); ``error`` makes the exception a failure raises,
    ``label`` names a rank in it."""

    def __init__(self, error: Callable[[str], Exception], label: Callable[[Key], str]) -> None:
        self.procs: dict[Key, subprocess.Popen[bytes]] = {}
        self.conns: dict[Key, Connection] = {}
        self.dead: set[Key] = set()
        self._error = error
        self._label = label
        # whatever happens next, interpreter exit (or losing this object) takes the ranks down
        self._finalizer = weakref.finalize(self, _teardown, self.procs, self.conns, None)

    def __bool__(self) -> bool:
        return bool(self.procs)

    def spawn(self, key: Key, spec: _worker.Spec) -> None:
        self.procs[key], self.conns[key] = _spawn(spec)

    def is_dead(self, key: Key) -> bool:
        """Whether the rank's process is gone (it stays marked dead)."""
        if key not in self.dead and self.procs[key].poll() is not None:
            self.dead.add(key)
        return key in self.dead

    def kill(self, key: Key) -> None:
        proc = self.procs[key]
        proc.kill()
        proc.wait(10)
        self.dead.add(key)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every rank and forget them; safe twice."""
        _teardown(self.procs, self.conns, timeout_s)
        self.procs.clear()
        self.conns.clear()

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def collect(self, keys: Sequence[Key], what: str, timeout_s: float) -> dict[Key, Any]:
        """Read one reply from each of ``keys``; raise ClusterError naming every rank that failed."""
        deadline = time.monotonic() + timeout_s
        replies: dict[Key, Any] = {}
        errors: dict[Key, str] = {}
        for key in keys:
            conn, proc = self.conns[key], self.procs[key]
            while key not in replies and key not in errors:
                if conn.poll(0.05):
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        errors[key] = f"died (exit code {proc.wait(5)})"
                        continue
                    if msg[0] == "error":
                        errors[key] = f"{msg[1]}: {msg[2]}"
                    else:
                        replies[key] = msg[1]
                elif proc.poll() is not None:
                    errors[key] = f"died (exit code {proc.returncode})"
                elif time.monotonic() > deadline:
                    errors[key] = f"no answer within {timeout_s:.0f} s"
        if errors:
            for key, error in errors.items():
                if error.startswith("no answer within") and self.procs[key].poll() is None:
                    # its late answer would be read as the next command's: out of step for good, so stopped
                    self.procs[key].kill()
                    self.procs[key].wait(5)
                    errors[key] = f"{error} (stopped: a late answer would be taken for the next command's)"
                if self.procs[key].poll() is not None:
                    self.dead.add(key)
            listed = "; ".join(f"{self._label(k)}: {e}" for k, e in errors.items())
            raise self._error(f"{what} failed on {len(errors)} rank{'s' if len(errors) != 1 else ''}: {listed}")
        return replies

    def call(self, keys: Sequence[Key], command: str, timeout_s: float, **kwargs: Any) -> dict[Key, Any]:
        """Send ``command`` to every rank in ``keys`` first (collectives need them all), then collect."""
        if not self.procs:
            raise self._error(f"{command}: the cluster is not running; call start() or use it in a with block")
        dead = [k for k in keys if k in self.dead or self.procs[k].poll() is not None]
        if dead:
            self.dead.update(dead)
            raise self._error(f"{command}: {', '.join(self._label(k) for k in dead)} is dead")
        for key in keys:
            self.conns[key].send((command, kwargs))
        return self.collect(keys, command, timeout_s)


def _spawn(spec: _worker.Spec) -> tuple[subprocess.Popen[bytes], Connection]:
    """Start one rank in a fresh interpreter (:func:`wcviz.sim._worker.entry`), its command pipe a socketpair.

    A fresh interpreter rather than multiprocessing's spawn: nothing of the caller's
    ``__main__`` is re-imported, so a script without an ``if __name__ == "__main__"``
    guard, a notebook or a REPL can start a cluster. Never fork: OpenMP threads (torch's)
    do not survive it.
    """
    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from wcviz.sim._worker import entry; entry()", str(theirs.fileno())],
            stdin=subprocess.PIPE,
            pass_fds=(theirs.fileno(),),
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))},
        )
    finally:
        theirs.close()
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps(spec))
    proc.stdin.close()
    return proc, Connection(ours.detach())


def _teardown(procs: Mapping[Key, subprocess.Popen[bytes]], conns: Mapping[Key, Connection], timeout_s: float | None) -> None:
    """Ask every live rank to stop, then escalate to SIGTERM and SIGKILL; reap them all."""
    wait = 10.0 if timeout_s is None else timeout_s
    for key, proc in procs.items():
        if proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                conns[key].send(("stop", {}))
    deadline = time.monotonic() + wait
    for proc in procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.01, deadline - time.monotonic()))
    for sig in ("terminate", "kill"):
        alive = [p for p in procs.values() if p.poll() is None]
        for proc in alive:
            getattr(proc, sig)()
        for proc in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
    for conn in conns.values():
        with contextlib.suppress(OSError):
            conn.close()
