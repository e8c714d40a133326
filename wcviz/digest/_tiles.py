"""The numba kernel of ``sglang-gpu`` on the CPU: each tile's packed 64-bit value.

A module of its own, imported on first use (numba's import and compile cost is paid
only by a process that digests with ``sglang-gpu``). The kernels and their constants
are module-level so numba's disk cache finds them again in a new process: defined in
a function, they captured nested dispatchers as closure variables, whose pickled
form (part of the cache key) differs from one process to the next, so every process
compiled afresh (~2.5 s) and left one more cache file behind.

Each thread claims ``_STREAMS`` neighbouring tiles at a time and walks them side by side:
four memory streams and four independent sums instead of one, which is what lets it read
from memory at its in-cache rate (one tile at a time it streamed at 0.4x of it: 2.4 against
5.9 GB/s on 2 threads). The tiles left over are summed one by one.

All arithmetic is on ``uint64`` with ``uint64`` constants: a Python int would promote to
float64 under numba.
"""

from __future__ import annotations

import numba
import numpy as np

from wcviz.digest._threads import arrive, claim, leave, finished, spread
from wcviz.digest._engines import _FM1, _FM2, _M32, _POS1, _POS2, _SEED1, _SEED2, TILE

__all__ = ["tiles"]

_STREAMS = 4  # tiles read side by side by one thread
_U32 = np.uint64(_M32)
_UFM1, _UFM2 = np.uint64(_FM1), np.uint64(_FM2)
_UPOS1, _UPOS2 = np.uint64(_POS1), np.uint64(_POS2)
_USEED1, _USEED2 = np.uint64(_SEED1), np.uint64(_SEED2)


@numba.njit(cache=True, inline="always")
def _fmix(x):  # type: ignore[no-untyped-def]
    x ^= x >> np.uint64(16)
    x = (x * _UFM1) & _U32
    x ^= x >> np.uint64(13)
    x = (x * _UFM2) & _U32
    return x ^ (x >> np.uint64(16))


@numba.njit(cache=True, inline="always")
def _keyed(words, j):  # type: ignore[no-untyped-def]
    """Word ``j`` mixed under both position keys."""
    i = np.uint64(j) & _U32
    v = np.uint64(words[j])
    r15 = ((i << np.uint64(15)) | (i >> np.uint64(17))) & _U32
    r13 = ((i << np.uint64(13)) | (i >> np.uint64(19))) & _U32
    p1 = ((i * _UPOS1 + _USEED1) & _U32) ^ r15
    p2 = ((i * _UPOS2 + _USEED2) & _U32) ^ r13
    return _fmix(v ^ p1), _fmix(v ^ p2)


@numba.njit(cache=True, inline="always")
def _packed(h1, h2, nbytes):  # type: ignore[no-untyped-def]
    return (_fmix((h1 & _U32) ^ nbytes) << np.uint64(32)) | _fmix((h2 & _U32) ^ nbytes)


@numba.njit(nogil=True, cache=True)
def _tiles_claimed(words, out, ctr, bell, helper):  # type: ignore[no-untyped-def]
    """Items claimed one at a time (``_threads``): first the groups of ``_STREAMS`` whole tiles, then the tiles
    left over (the last may be short), one item each."""
    arrive(bell, helper)
    n = words.shape[0]
    nbytes = np.uint64((n * 4) & _M32)
    groups = n // (TILE * _STREAMS)  # groups of whole tiles
    items = groups + out.shape[0] - groups * _STREAMS
    g = claim(ctr, 0)
    while g < items:
        if g < groups:
            lo = g * _STREAMS * TILE
            a0 = b0 = a1 = b1 = a2 = b2 = a3 = b3 = np.uint64(0)
            for j in range(lo, lo + TILE):
                x, y = _keyed(words, j)
                a0 += x
                b0 += y
                x, y = _keyed(words, j + TILE)
                a1 += x
                b1 += y
                x, y = _keyed(words, j + 2 * TILE)
                a2 += x
                b2 += y
                x, y = _keyed(words, j + 3 * TILE)
                a3 += x
                b3 += y
            t = g * _STREAMS
            out[t] = _packed(a0, b0, nbytes)
            out[t + 1] = _packed(a1, b1, nbytes)
            out[t + 2] = _packed(a2, b2, nbytes)
            out[t + 3] = _packed(a3, b3, nbytes)
        else:
            t = g - groups + groups * _STREAMS
            h1 = h2 = np.uint64(0)
            for j in range(t * TILE, min(n, (t + 1) * TILE)):
                x, y = _keyed(words, j)
                h1 += x
                h2 += y
            out[t] = _packed(h1, h2, nbytes)
        finished(ctr, 0)
        g = claim(ctr, 0)
    leave(bell, helper)


def tiles(words: np.ndarray, out: np.ndarray) -> None:
    """Each tile's packed value of the uint32 ``words`` into ``out`` (one element per tile), on the kernels'
    threads (``_threads``: helpers that sleep when idle)."""
    groups = words.shape[0] // (TILE * _STREAMS)
    items = groups + out.shape[0] - groups * _STREAMS
    if items:
        spread(_tiles_claimed, (words, out), items)
