"""The fast CPU backend: a numba kernel, bit-identical to the torch reference.

Each chunk's tree is a perfect binary tree, so it is folded in blocks of
``BLOCK`` lanes that stay in L1, and the block roots are folded after. Blocks
of every chunk are independent, so they are spread over all cores; only the
chain across chunks is sequential, and it costs one mix per chunk.

Speed comes from the inner loop (``_level4``): it folds two tree levels per
step, both channels and all four leaves in lockstep, into separate output
arrays, so that LLVM vectorises it with AVX2 and every multiply has other
independent work beside it. After any change there, check that the vector
loop is still emitted (``vpmuludq`` on ``ymm`` registers in
``_level4.inspect_asm()``, with an empty numba cache).

All arithmetic is on ``uint64`` with ``uint64`` constants: mixing in a Python
int would silently promote to float64 under numba.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
from numba import njit, prange

from wcviz.digest import _spec

__all__ = ["lanes_digest", "set_threads", "BLOCK"]

BLOCK = 4096  # lanes folded at once: 32 KiB of input, 8 KiB of scratch per channel
_LOG_BLOCK = BLOCK.bit_length() - 1
_GROUP = 8  # blocks per parallel task, so scratch is allocated once per task

_U = np.uint64
_S30, _S27, _S31 = _U(30), _U(27), _U(31)
_K1, _K2 = _U(_spec.MIX_1), _U(_spec.MIX_2)
_LT1, _LT2 = _U(_spec.LT[0]), _U(_spec.LT[1])
_RT1, _RT2 = _U(_spec.RT[0]), _U(_spec.RT[1])
_M1, _M2 = _U(_spec.MUL[0]), _U(_spec.MUL[1])
_CH = _U(_spec.CHAIN)
_Z = _U(0)
_CHUNK = _spec.CHUNK
_PER_CHUNK = _CHUNK // BLOCK


@njit(inline="always", cache=True)
def _mix(x):  # type: ignore[no-untyped-def]
    x = (x ^ (x >> _S30)) * _K1
    x = (x ^ (x >> _S27)) * _K2
    return x ^ (x >> _S31)


@njit(inline="always", cache=True)
def _mix4(a, b, c, d):  # type: ignore[no-untyped-def]
    """``_mix`` of four independent words, step by step.

    A mix is one long chain of dependent shifts, xors and multiplies. Written
    in lockstep, four chains are in flight at once and each multiply's latency
    is hidden behind the others' work; LLVM keeps this order, whereas four
    ``_mix`` calls in a row leave the core waiting (about 25% slower).
    """
    a ^= a >> _S30
    b ^= b >> _S30
    c ^= c >> _S30
    d ^= d >> _S30
    a *= _K1
    b *= _K1
    c *= _K1
    d *= _K1
    a ^= a >> _S27
    b ^= b >> _S27
    c ^= c >> _S27
    d ^= d >> _S27
    a *= _K2
    b *= _K2
    c *= _K2
    d *= _K2
    return a ^ (a >> _S31), b ^ (b >> _S31), c ^ (c >> _S31), d ^ (d >> _S31)


@njit(inline="always", cache=True)
def _merge1(a, b):  # type: ignore[no-untyped-def]
    return _mix(_mix(a ^ _LT1) + _mix(b ^ _RT1) * _M1)


@njit(inline="always", cache=True)
def _merge2(a, b):  # type: ignore[no-untyped-def]
    return _mix(_mix(a ^ _LT2) + _mix(b ^ _RT2) * _M2)


@njit(cache=True)
def _level4(s1, s2, d1, d2, n):  # type: ignore[no-untyped-def]
    """Two tree levels at once: ``d_k[i]`` is the root of ``s_k[4i : 4i+4]``, ``i < n``.

    The four leaves and both channels are mixed in lockstep (``_mix4``), and
    the middle level never leaves registers. The loop has no carried state and
    the arrays are distinct, so LLVM vectorises it (AVX2: four steps at once).
    """
    for i in range(n):
        j = 4 * i
        a, b, c, d = _mix4(s1[j] ^ _LT1, s1[j + 1] ^ _RT1, s1[j + 2] ^ _LT1, s1[j + 3] ^ _RT1)
        e, f, g, h = _mix4(s2[j] ^ _LT2, s2[j + 1] ^ _RT2, s2[j + 2] ^ _LT2, s2[j + 3] ^ _RT2)
        a, c, e, g = _mix4(a + b * _M1, c + d * _M1, e + f * _M2, g + h * _M2)
        a, c, e, g = _mix4(a ^ _LT1, c ^ _RT1, e ^ _LT2, g ^ _RT2)
        d1[i], d2[i], _, _ = _mix4(a + c * _M1, e + g * _M2, _Z, _Z)  # unused half is dropped


@njit(cache=True)
def _fold(src1, src2, a1, a2, b1, b2):  # type: ignore[no-untyped-def]
    """Fold ``src1`` through channel 1 and ``src2`` through channel 2 to their roots.

    Both hold the same power-of-two count (>= 2) of words; for data they are the
    same array. Levels go two at a time, ping-ponging between the scratch
    ``a*`` (at least a quarter of the count) and ``b*`` (a sixteenth); an odd
    level out is the root's own merge.
    """
    n = src1.shape[0]
    while n >= 4:
        n //= 4
        _level4(src1, src2, a1, a2, n)
        src1, src2, a1, a2, b1, b2 = a1, a2, b1, b2, a1, a2
    if n == 1:
        return src1[0], src2[0]
    return _merge1(src1[0], src1[1]), _merge2(src2[0], src2[1])


@njit(cache=True)
def _zero_roots(levels):  # type: ignore[no-untyped-def]
    """Roots of all-zero perfect trees of height 0..levels, per channel."""
    z = np.zeros((2, levels + 1), dtype=np.uint64)
    for h in range(levels):
        z[0, h + 1] = _merge1(z[0, h], z[0, h])
        z[1, h + 1] = _merge2(z[1, h], z[1, h])
    return z


@njit(parallel=True, cache=True)
def _digest(lanes, s1, s2):  # type: ignore[no-untyped-def]
    n = lanes.shape[0]
    nchunks = max(1, (n + _CHUNK - 1) // _CHUNK)
    full = nchunks - 1  # chunks of exactly _CHUNK lanes
    last = n - full * _CHUNK  # lanes in the last chunk (0 for an empty tensor)
    w = 2
    while w < last:
        w *= 2
    last_blocks = w // BLOCK if w > BLOCK else 0  # a small last chunk is folded whole
    nblocks = full * _PER_CHUNK + last_blocks
    zero = _zero_roots(_LOG_BLOCK)
    roots1 = np.empty(nblocks, dtype=np.uint64)
    roots2 = np.empty(nblocks, dtype=np.uint64)
    ntasks = (nblocks + _GROUP - 1) // _GROUP
    for t in prange(ntasks):
        a1 = np.empty(BLOCK // 4, dtype=np.uint64)
        a2 = np.empty(BLOCK // 4, dtype=np.uint64)
        b1 = np.empty(BLOCK // 16, dtype=np.uint64)
        b2 = np.empty(BLOCK // 16, dtype=np.uint64)
        for j in range(t * _GROUP, min(nblocks, (t + 1) * _GROUP)):
            start = j * BLOCK
            if start + BLOCK <= n:
                src = lanes[start : start + BLOCK]
                roots1[j], roots2[j] = _fold(src, src, a1, a2, b1, b2)
            elif start >= n:  # all padding: the root of an all-zero subtree
                roots1[j] = zero[0, _LOG_BLOCK]
                roots2[j] = zero[1, _LOG_BLOCK]
            else:
                pad = np.zeros(BLOCK, dtype=np.uint64)
                pad[: n - start] = lanes[start:n]
                roots1[j], roots2[j] = _fold(pad, pad, a1, a2, b1, b2)
    quarter = max(_PER_CHUNK, w) // 4
    a1 = np.empty(quarter, dtype=np.uint64)
    a2 = np.empty(quarter, dtype=np.uint64)
    b1 = np.empty(quarter, dtype=np.uint64)
    b2 = np.empty(quarter, dtype=np.uint64)
    c1 = s1
    c2 = s2
    for c in range(nchunks):
        if c < full or last_blocks > 0:
            lo = c * _PER_CHUNK
            hi = lo + (_PER_CHUNK if c < full else last_blocks)
            r1, r2 = _fold(roots1[lo:hi], roots2[lo:hi], a1, a2, b1, b2)
        else:
            tail = np.zeros(w, dtype=np.uint64)
            tail[:last] = lanes[full * _CHUNK : n]
            r1, r2 = _fold(tail, tail, a1, a2, b1, b2)
        c1 = _mix(c1 * _CH + r1)
        c2 = _mix(c2 * _CH + r2)
    return _mix(c1), _mix(c2)


# One kernel at a time per process: numba's fallback "workqueue" threading layer
# aborts the process when two threads launch parallel kernels at once, and the
# kernel already uses every core, so serialising costs nothing.
_LOCK = threading.Lock()


def lanes_digest(lanes: np.ndarray, seed: tuple[int, int]) -> tuple[int, int]:
    """The two digest words (unsigned ints) of a ``uint64`` lane array."""
    with _LOCK:
        d1, d2 = _digest(lanes, _U(seed[0]), _U(seed[1]))
    return int(d1), int(d2)


def set_threads(n: int) -> None:
    """Threads the kernel may use (at most the cores numba found)."""
    numba.set_num_threads(n)
