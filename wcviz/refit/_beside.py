"""Digesting beside the copy: one worker thread per transport end, on the CPU transport.

A refit end with verification on both copies every byte (the sender's pack, the
engine's ``load_weights``) and digests it. Done one after the other, the digest
waits for the copy, and the two cores take turns between the kernel's threads and
the copy's. Here the digest runs on one worker
thread, on one numba thread (numba's thread count belongs to the calling
thread), while the calling thread copies: the kernels release the GIL, so the
two run on two cores at once, and nothing spins.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["Beside", "settle"]


def _one_numba_thread() -> None:
    from wcviz.digest import set_digest_threads

    set_digest_threads(1)


class Beside:
    """A single worker thread, started on first use, that runs digests in the order submitted."""

    def __init__(self) -> None:
        self._pool: cf.ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> cf.Future[Any]:
        """Run ``fn(*args)`` on the worker; a caller must :func:`settle` the future before it frees what ``fn`` reads."""
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="wcviz-digest", initializer=_one_numba_thread)
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        """Wait for anything still running, then stop the worker. Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def settle(futures: Iterable[cf.Future[Any]], *, raise_errors: bool = True) -> None:
    """Wait until every future is done; then, with ``raise_errors``, raise the first one's error (in order given)."""
    futures = list(futures)
    cf.wait(futures)
    if raise_errors:
        for f in futures:
            f.result()
