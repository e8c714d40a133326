"""The fast CPU backend: numba kernels, bit-identical to the torch reference.

Layout of the work. A chunk's tree is a perfect binary tree, so it can be cut
into subtrees ("blocks") whose roots are folded afterwards. Blocks are folded
``GROUP`` at a time, *vertically*: element ``k`` of every vector belongs to
block ``k``, so a tree level is plain element-wise arithmetic between two
vectors, with no shuffling inside a level. The only transpose is at the load
(``_simd.load_cols``: ``GROUP`` rows of 4 lanes become 4 tree positions).
Both channels ride in the same vector (``[channel 1 x GROUP, channel 2 x
GROUP]``: only the tweaks and the multiplier differ, as per-element constants),
so one ``_step`` folds 2 levels for 2 channels x 4 blocks on ``Vec(32)``
values: 8 AVX2 registers of independent work that hide each multiply's
latency while leaving registers for the multiply's temporaries (8 blocks,
16 registers, spilled to the stack and measured ~10% slower on two threads).
With AVX-512 (32 registers of 8 lanes, a native 64-bit multiply of 15 cycles'
latency) ``GROUP`` is 16: 16 registers of independent work (55% -> 73% of the
compute bound on a 2-core Xeon; 8 blocks gave 64%, 32 no more than 16).
``_simd`` also supplies the cheaper 64-bit multiply.

Two things keep the vector ports fed (measured on that Xeon, BENCHMARKS.md):
each level pair is a software-pipelined loop, the first half of step ``i``
(``_step_a``: 16 chains at the leaves) written beside the second half of step
``i - 1`` (``_step_b``: 4 chains waiting on their multiplies), so the scheduler
always holds independent work (75% -> 82-87% of the bound; the same code under
AVX2 code generation 64% -> 78%); and a tweak joins the first xor-shift of its
mix as one three-way xor (``_mix_tweaked``), which also lets the two channels
of a leaf share its shift (+2 points).

Where the rows are (measured on a 2-core AVX-512 Zen 5, BENCHMARKS.md): a block's
rows are read ``_SUB`` lanes at a time (rows within 32 KiB, not a block apart: rows
4 KiB-aligned apart share one L1 set), with the next sub-group prefetched; from
memory 52-60% -> 70-77% of the bound on one thread, 53-59% -> 68-76% on two.

- A chunk of width ``w >= 4 * GROUP`` lanes is cut into ``GROUP`` blocks of
  ``min(BLOCK, w / GROUP)`` lanes each group; groups wholly past the data are
  all-zero subtrees (a known root), a group straddling the end is copied into a
  zero-padded buffer. The block roots (at most ``CHUNK / BLOCK`` per chunk) are
  folded with scalar code, as is a chunk narrower than ``4 * GROUP`` lanes.
- The threads are ``_threads``': the calling thread and helpers that sleep when idle
  (no numba parallel loop: its OpenMP threads spin between calls), each claiming
  work items (a group, a tensor) from an atomic counter inside the kernel.
  ``lanes_digest`` spreads the groups of all chunks of one tensor over the
  threads; only the chain across chunks is sequential (one fold of block roots
  and a mix per chunk). ``lanes_digest_many`` spreads whole tensors over the
  threads and digests each one serially with the same code. ``lanes_digest_at``
  (tensors read where they live) does the same for its small tensors and spreads
  the groups of all its large ones over the threads in one pass, then chains each
  one's chunks: one call for a checkpoint's worth of tensors, large or small.
- ``_floor.floor_rate`` measures the compute floor the kernel is judged against: one
  mix per lane of an in-cache array, the same vector arithmetic.

After a change, check that the vector code is still what runs: with an empty
numba cache, ``_fold_group.inspect_asm(_fold_group.signatures[0])`` should be
``vpmulld``/``vpmuludq``/``vpsrlq`` on ``ymm`` registers, with no scalar
``imul`` in the loops (``vpmullq`` on ``zmm`` with AVX-512). Measured: 72-88%
of the compute bound on a 2-core AVX2 EPYC before the pipelining, 82-87% on a
2-core AVX-512 Xeon after it (90% with the input in cache; BENCHMARKS.md).

All arithmetic is on ``uint64`` with ``uint64`` constants: mixing in a Python
int would silently promote to float64 under numba. ``_mix`` works on scalars
and on ``_simd.Vec`` values alike.
"""

from __future__ import annotations

import os

import numba
import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from wcviz.digest import _spec
from wcviz.digest._threads import arrive, claim, leave, finished, spread, threads_here, wait
from wcviz.digest._simd import WIDE, cat, load, load_cols, prefetch, splat, split, store

__all__ = ["BLOCK", "GROUP", "lanes_digest", "lanes_digest_at", "lanes_digest_many", "set_threads"]

BLOCK = 4096  # lanes per block (a subtree), the most a group uses: 4 blocks = 128 KiB of input
# Blocks folded side by side, one per vector element: 4 where a vector register holds 4 lanes and there are
# 16 of them (AVX2; 8 spilled), 16 where it holds 8 and there are 32 (AVX-512: 16 chains of multiplies in
# flight hide their 15-cycle latency). ``WCVIZ_NUMBA_GROUP`` overrides it, for the tests that check every
# layout gives the same digest; an override compiles afresh and never touches numba's cache on disk.
_GROUP_ASKED = os.environ.get("WCVIZ_NUMBA_GROUP", "")
GROUP = (int(_GROUP_ASKED) if _GROUP_ASKED.strip().isdigit() else -1) if _GROUP_ASKED else (16 if WIDE else 4)
if GROUP not in (2, 4, 8, 16, 32):
    raise ValueError(f"WCVIZ_NUMBA_GROUP={_GROUP_ASKED!r}: blocks folded side by side must be 2, 4, 8, 16 or 32")
# Lanes of each block read side by side: the GROUP rows of a sub-group lie within 32 KiB, so they spread
# over the L1 cache's sets (see ``_fold_group``). ``WCVIZ_NUMBA_SUB`` overrides it, for the tests and for
# benchmarks that time the layouts (``WCVIZ_NUMBA_SUB=4096``: the rows a whole block apart, as before).
_SUB_ASKED = os.environ.get("WCVIZ_NUMBA_SUB", "")
_SUB = (int(_SUB_ASKED) if _SUB_ASKED.strip().isdigit() else -1) if _SUB_ASKED else min(BLOCK, 4096 // GROUP)
if not (8 <= _SUB <= BLOCK and _SUB & (_SUB - 1) == 0):  # (8 or more: the scratch then holds both folds)
    raise ValueError(f"WCVIZ_NUMBA_SUB={_SUB_ASKED!r}: lanes read side by side must be a power of two from 8 to {BLOCK}")
_CACHE = not _GROUP_ASKED and not _SUB_ASKED
_W = 2 * GROUP  # one tree position for both channels: [channel 1 x GROUP, channel 2 x GROUP]
_W2, _W4 = 2 * _W, 4 * _W  # (vector widths must be plain constants)
_PF = GROUP // 2  # cache lines of the next sub-group to prefetch per step: all of it by the end of this one
_SMALL = 4 * GROUP  # chunks narrower than this are folded by scalar code
_CHUNK = _spec.CHUNK
_PER_CHUNK = _CHUNK // BLOCK  # blocks in a full chunk
_GROUPS_PER_CHUNK = _PER_CHUNK // GROUP
_SERIAL_BELOW = 1 << 15  # lanes: smaller tensors are not worth waking a helper thread

_U = np.uint64
_S30, _S27, _S31 = _U(30), _U(27), _U(31)
_K1, _K2 = _U(_spec.MIX_1), _U(_spec.MIX_2)
_LT1, _LT2 = _U(_spec.LT[0]), _U(_spec.LT[1])
_RT1, _RT2 = _U(_spec.RT[0]), _U(_spec.RT[1])
_M1, _M2 = _U(_spec.MUL[0]), _U(_spec.MUL[1])
_CH = _U(_spec.CHAIN)
_Z = _U(0)


def _zero_root(k: int, height: int) -> int:
    """Root of an all-zero perfect tree of ``2**height`` leaves, channel ``k`` (plain Python)."""
    m = _spec.MASK64
    r = 0
    for _ in range(height):
        r = _spec._mix64((_spec._mix64(r ^ _spec.LT[k]) + _spec._mix64(r ^ _spec.RT[k]) * _spec.MUL[k]) & m)
    return r


_ZB1 = _U(_zero_root(0, BLOCK.bit_length() - 1))  # an all-zero block's roots
_ZB2 = _U(_zero_root(1, BLOCK.bit_length() - 1))


@njit(cache=_CACHE)
def _mix(x):  # type: ignore[no-untyped-def]
    x = (x ^ (x >> _S30)) * _K1
    x = (x ^ (x >> _S27)) * _K2
    return x ^ (x >> _S31)


@njit(cache=_CACHE)
def _mix_tweaked(x, c):  # type: ignore[no-untyped-def]
    """``_mix(x ^ t)`` given ``c = t ^ (t >> 30)``: a logical shift distributes over xor, so the tweak
    joins the first xor-shift as one three-way xor (``vpternlogq``) instead of an xor of its own."""
    x = (x ^ (x >> _S30) ^ c) * _K1
    x = (x ^ (x >> _S27)) * _K2
    return x ^ (x >> _S31)


@njit(cache=_CACHE)
def _merge1(a, b):  # type: ignore[no-untyped-def]
    return _mix(_mix(a ^ _LT1) + _mix(b ^ _RT1) * _M1)


@njit(cache=_CACHE)
def _merge2(a, b):  # type: ignore[no-untyped-def]
    return _mix(_mix(a ^ _LT2) + _mix(b ^ _RT2) * _M2)


# ---------------------------------------------------------------- vertical fold


@njit(cache=_CACHE)
def _tweaks():  # type: ignore[no-untyped-def]
    """Per-element left tweak, right tweak and multiplier of one tree position (``Vec(_W)``)."""
    lt = cat(splat(_LT1, GROUP), splat(_LT2, GROUP))
    rt = cat(splat(_RT1, GROUP), splat(_RT2, GROUP))
    m = cat(splat(_M1, GROUP), splat(_M2, GROUP))
    return lt, rt, m


@njit(cache=_CACHE)
def _step_a(x):  # type: ignore[no-untyped-def]
    """First half of a two-level step: 4 positions (``Vec(4 * _W)``, position-major) to the 2 merged
    positions of the level above (``Vec(2 * _W)``), already xor-ed with their tweaks for level 2 (where
    the last xor-shift of their mix joins it in one three-way xor)."""
    lt, rt, m = _tweaks()
    ltrt = cat(lt, rt)
    c = ltrt ^ (ltrt >> _S30)
    x = _mix_tweaked(x, cat(c, c))  # the leaves' own mixes, all 4 positions at once
    h01, h23 = split(x)
    p0, p1 = split(h01)
    p2, p3 = split(h23)
    return _mix(cat(p0, p2) + cat(p1, p3) * cat(m, m)) ^ ltrt  # level 1: positions (0, 1) and (2, 3)


@njit(cache=_CACHE)
def _step_b(y):  # type: ignore[no-untyped-def]
    """Second half: the 2 tweaked positions of ``_step_a`` to their root (``Vec(_W)``), level 2."""
    lt, rt, m = _tweaks()
    left, right = split(_mix(y))
    return _mix(left + right * m)


@njit(cache=_CACHE)
def _step(x):  # type: ignore[no-untyped-def]
    """Two tree levels: 4 positions (``Vec(4 * _W)``, position-major) to their root (``Vec(_W)``)."""
    return _step_b(_step_a(x))


@njit(cache=_CACHE)
def _both_channels(x):  # type: ignore[no-untyped-def]
    """``[pos][block]`` (``Vec(4 * GROUP)``) to ``[pos][channel][block]`` (``Vec(4 * _W)``)."""
    h01, h23 = split(x)
    x0, x1 = split(h01)
    x2, x3 = split(h23)
    return cat(cat(cat(x0, x0), cat(x1, x1)), cat(cat(x2, x2), cat(x3, x3)))


@njit(cache=_CACHE)
def _leaf_levels(src, lo, b, s, ahead):  # type: ignore[no-untyped-def]
    """The two lowest levels of the ``GROUP`` blocks of ``b`` lanes at ``src[lo:]`` (``b`` a power of two
    >= 4): their ``b // 4`` nodes, each ``Vec(_W)``, into ``s`` (position-major).

    One software-pipelined loop: the first half of step ``i`` (independent work for every block and
    channel) is written beside the second half of step ``i - 1`` (a quarter as many chains, each waiting
    on its multiplies), so the scheduler always holds work of both kinds.
    """
    n = b // 4
    y = _step_a(_both_channels(load_cols(src, lo, b, 0, GROUP)))
    for i in range(1, n):
        if ahead >= 0:
            for k in range(_PF):
                prefetch(src, ahead + ((i - 1) * _PF + k) * 8)
        y_next = _step_a(_both_channels(load_cols(src, lo, b, 4 * i, GROUP)))
        store(s, (i - 1) * _W, _step_b(y))
        y = y_next
    store(s, (n - 1) * _W, _step_b(y))


@njit(cache=_CACHE)
def _upper_levels(s, n):  # type: ignore[no-untyped-def]
    """Fold ``n`` nodes per block (``s[: n * _W]``, position-major; ``n`` a power of two) to the blocks'
    roots in ``s[:_W]``: two levels at a time, in place (node ``j - 1`` is written after ``4j - 4 ..
    4j - 1`` were read), pipelined as ``_leaf_levels``."""
    while n >= 4:
        n //= 4
        y = _step_a(load(s, 0, _W4))
        for j in range(1, n):
            y_next = _step_a(load(s, 4 * j * _W, _W4))
            store(s, (j - 1) * _W, _step_b(y))
            y = y_next
        store(s, (n - 1) * _W, _step_b(y))
    if n == 2:  # an odd level out
        lt, rt, m = _tweaks()
        left, right = split(_mix(load(s, 0, _W2) ^ cat(lt, rt)))
        store(s, 0, _mix(left + right * m))


@njit(cache=_CACHE)
def _fold_group(src, lo, b, s):  # type: ignore[no-untyped-def]
    """Roots of the ``GROUP`` blocks of ``b`` lanes at ``src[lo:]`` (``b`` a power of two >= 4).

    Leaves ``[roots channel 1 x GROUP, roots channel 2 x GROUP]`` in ``s[:_W]``;
    ``s`` is scratch of at least ``b // 4 * _W`` words.

    Blocks wider than ``_SUB`` lanes are not read side by side whole: their rows would lie a power of
    two of 4 KiB or more apart, all in one set of the L1 cache, and with more rows than the set has
    ways, each cache line is evicted between its two steps (a 2-core Zen 5: leaf steps at 66% of the
    bound in cache, 84% with the rows 2 KiB apart). So the group is folded ``GROUP`` consecutive
    sub-blocks of ``_SUB`` lanes at a time (rows ``_SUB`` lanes apart, 32 KiB in all), while the next
    sub-group is prefetched (its rows are not streams a hardware prefetcher follows: without it, from
    memory, slower than before); each block's sub-block roots, put in position-major order, are then
    folded as the upper levels are.
    """
    if b <= _SUB:
        _leaf_levels(src, lo, b, s, -1)
        _upper_levels(s, b // 4)
        return
    m = b // _SUB  # sub-blocks per block
    roots = s[_SUB // 4 * _W : _SUB // 4 * _W + m * _W]
    for q0 in range(0, GROUP * m, GROUP):  # sub-blocks q0 .. q0 + GROUP - 1 of the group
        nxt = lo + (q0 + GROUP) * _SUB
        _leaf_levels(src, lo + q0 * _SUB, _SUB, s, nxt if nxt + GROUP * _SUB <= src.shape[0] else -1)
        _upper_levels(s, _SUB // 4)
        for e in range(GROUP):
            at = (q0 + e) % m * _W + (q0 + e) // m  # node (q0 + e) % m of block (q0 + e) // m
            roots[at] = s[e]
            roots[at + GROUP] = s[GROUP + e]
    _upper_levels(roots, m)
    s[:_W] = roots[:_W]


# ---------------------------------------------------------------- plan and chain


@njit(cache=_CACHE)
def _width(m):  # type: ignore[no-untyped-def]
    """Lanes a chunk of ``m`` lanes is zero-padded to: a power of two, at least 2."""
    w = 2
    while w < m:
        w *= 2
    return w


@njit(cache=_CACHE)
def _plan(n):  # type: ignore[no-untyped-def]
    """(full chunks, lanes in the last chunk, its block size or 0, its groups, all groups)."""
    nchunks = max(1, (n + _CHUNK - 1) // _CHUNK)
    full = nchunks - 1
    last = n - full * _CHUNK  # 0 only for an empty tensor
    w = _width(last)
    b = 0 if w < _SMALL else min(BLOCK, w // GROUP)
    groups = 0 if b == 0 else w // (GROUP * b)
    return full, last, b, groups, full * _GROUPS_PER_CHUNK + groups


@njit(cache=_CACHE)
def _group(lanes, t, full, b_last, s, r1, r2):  # type: ignore[no-untyped-def]
    """Block roots of group ``t`` (counted over all chunks) into ``r1/r2[t * GROUP :]``."""
    n = lanes.shape[0]
    if t < full * _GROUPS_PER_CHUNK:
        b = BLOCK
        lo = t * (GROUP * BLOCK)
    else:
        b = b_last
        lo = full * _CHUNK + (t - full * _GROUPS_PER_CHUNK) * (GROUP * b)
    at = t * GROUP
    if lo >= n:  # all padding (only when the chunk has several groups, so b == BLOCK)
        for k in range(GROUP):
            r1[at + k] = _ZB1
            r2[at + k] = _ZB2
        return
    if lo + GROUP * b <= n:
        _fold_group(lanes, lo, b, s)
    else:
        pad = np.zeros(GROUP * b, dtype=np.uint64)
        pad[: n - lo] = lanes[lo:n]
        _fold_group(pad, 0, b, s)
    for k in range(GROUP):
        r1[at + k] = s[k]
        r2[at + k] = s[GROUP + k]


@njit(cache=_CACHE)
def _fold_scalar(v1, v2):  # type: ignore[no-untyped-def]
    """Roots of ``v1`` (channel 1) and ``v2`` (channel 2), power-of-two length >= 1; overwritten."""
    n = v1.shape[0]
    while n > 1:
        n //= 2
        for i in range(n):
            v1[i] = _merge1(v1[2 * i], v1[2 * i + 1])
            v2[i] = _merge2(v2[2 * i], v2[2 * i + 1])
    return v1[0], v2[0]


@njit(cache=_CACHE)
def _chain(lanes, s1, s2, full, last, groups, r1, r2):  # type: ignore[no-untyped-def]
    """Fold each chunk's block roots, chain the chunk roots, finish: the digest words."""
    c1 = s1
    c2 = s2
    for c in range(full + 1):
        if c < full:
            lo = c * _PER_CHUNK
            x1, x2 = _fold_scalar(r1[lo : lo + _PER_CHUNK], r2[lo : lo + _PER_CHUNK])
        elif groups > 0:
            lo = full * _PER_CHUNK
            x1, x2 = _fold_scalar(r1[lo : lo + groups * GROUP], r2[lo : lo + groups * GROUP])
        else:  # a narrow last chunk: fold its lanes directly
            w = _width(last)
            v1 = np.zeros(w, dtype=np.uint64)
            v1[:last] = lanes[full * _CHUNK :]
            v2 = v1.copy()
            x1, x2 = _fold_scalar(v1, v2)
        c1 = _mix(c1 * _CH + x1)
        c2 = _mix(c2 * _CH + x2)
    return _mix(c1), _mix(c2)


@njit(nogil=True, cache=_CACHE)
def _digest_serial(lanes, s1, s2):  # type: ignore[no-untyped-def]
    """The digest words of one tensor, on the calling thread."""
    full, last, b_last, groups, total = _plan(lanes.shape[0])
    r1 = np.empty(total * GROUP, dtype=np.uint64)
    r2 = np.empty(total * GROUP, dtype=np.uint64)
    s = np.empty((BLOCK if full else max(b_last, 4)) // 4 * _W, dtype=np.uint64)
    for t in range(total):
        _group(lanes, t, full, b_last, s, r1, r2)
    return _chain(lanes, s1, s2, full, last, groups, r1, r2)


@njit(nogil=True, cache=_CACHE)
def _groups_claimed(lanes, full, b_last, total, r1, r2, ctr, bell, helper):  # type: ignore[no-untyped-def]
    """Block roots of the groups of one tensor, claimed one at a time (``_threads``) until none is left."""
    arrive(bell, helper)
    s = np.empty(BLOCK // 4 * _W, dtype=np.uint64)
    t = claim(ctr, 0)
    while t < total:
        _group(lanes, t, full, b_last, s, r1, r2)
        finished(ctr, 0)
        t = claim(ctr, 0)
    leave(bell, helper)


@njit(nogil=True, cache=_CACHE)
def _many_claimed(lanes, starts, counts, seeds, out, ctr, bell, helper):  # type: ignore[no-untyped-def]
    """Packed tensors, claimed one at a time, each digested serially."""
    arrive(bell, helper)
    i = claim(ctr, 0)
    while i < starts.shape[0]:
        a = starts[i]
        out[i, 0], out[i, 1] = _digest_serial(lanes[a : a + counts[i]], seeds[i, 0], seeds[i, 1])
        finished(ctr, 0)
        i = claim(ctr, 0)
    leave(bell, helper)


@intrinsic
def _void_ptr(typingctx, address):  # type: ignore[no-untyped-def]
    """An integer address as a ``void*`` (what ``numba.carray`` needs to view memory it did not allocate)."""
    from numba.core import cgutils

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen


@njit(nogil=True, cache=_CACHE)
def _digest_one_at(address, n, s1, s2):  # type: ignore[no-untyped-def]
    """The digest words of the ``n`` bytes at ``address``: whole aligned lanes read in place, else copied
    (an odd tail, an unaligned start) into zero-padded lanes. Apart from the parallel loop, so its
    allocation stays per tensor."""
    if n % 8 == 0 and address % 8 == 0:
        return _digest_serial(numba.carray(_void_ptr(address), (n // 8,), np.uint64), s1, s2)
    lanes = np.zeros((n + 7) // 8, dtype=np.uint64)
    if n:
        lanes.view(np.uint8)[:n] = numba.carray(_void_ptr(address), (n,), np.uint8)
    return _digest_serial(lanes, s1, s2)


@njit(nogil=True, cache=_CACHE)
def _at_plan(addresses, nbytes):  # type: ignore[no-untyped-def]
    """How ``_at_claimed`` splits tensors read in place: the rest (small, or to be copied: an odd tail, an
    unaligned start; each one item, digested serially), the large ones (``_SERIAL_BELOW`` lanes or more, as
    ``lanes_digest`` draws the line), their plans (full chunks, lanes in the last, its block size, its
    groups), where each one's groups start among all of theirs, and each group's owner."""
    n = addresses.shape[0]
    large = np.zeros(n, dtype=np.bool_)
    for i in range(n):
        large[i] = nbytes[i] % 8 == 0 and addresses[i] % 8 == 0 and nbytes[i] // 8 >= _SERIAL_BELOW
    big = np.flatnonzero(large)
    rest = np.flatnonzero(~large)
    m = big.shape[0]
    plans = np.zeros((m, 4), dtype=np.int64)
    first = np.zeros(m + 1, dtype=np.int64)  # large tensor j's groups are [first[j], first[j + 1]) of all
    for j in range(m):
        full, last, b_last, groups, total = _plan(nbytes[big[j]] // 8)
        plans[j, 0], plans[j, 1], plans[j, 2], plans[j, 3] = full, last, b_last, groups
        first[j + 1] = first[j] + total
    owner = np.empty(first[m], dtype=np.int64)
    for j in range(m):
        owner[first[j] : first[j + 1]] = j
    return rest, big, plans, first, owner


@njit(nogil=True, cache=_CACHE)
def _at_claimed(addresses, nbytes, seeds, out, rest, big, plans, first, owner, r1, r2, ctr, bell, helper):  # type: ignore[no-untyped-def]
    """Phase 0: the rest, one tensor per item, then the groups of all large tensors as if one tensor (no
    thread start and no idle tail per tensor); phase 1, once all of phase 0 is done: each large tensor's
    chain of chunks."""
    arrive(bell, helper)
    k, m = rest.shape[0], big.shape[0]
    items = k + first[m]
    g = claim(ctr, 0)
    while g < items:
        if g < k:
            i = rest[g]
            out[i, 0], out[i, 1] = _digest_one_at(addresses[i], nbytes[i], seeds[i, 0], seeds[i, 1])
        else:
            j = owner[g - k]
            lanes = numba.carray(_void_ptr(addresses[big[j]]), (nbytes[big[j]] // 8,), np.uint64)
            s = np.empty((BLOCK if plans[j, 0] else plans[j, 2]) // 4 * _W, dtype=np.uint64)  # as _digest_serial's
            lo, hi = first[j] * GROUP, first[j + 1] * GROUP
            _group(lanes, g - k - first[j], plans[j, 0], plans[j, 2], s, r1[lo:hi], r2[lo:hi])
        finished(ctr, 0)
        g = claim(ctr, 0)
    j = claim(ctr, 1) if m > 0 and wait(ctr, 0, items) else m  # (none, after a helper failed)
    while j < m:
        i = big[j]
        lanes = numba.carray(_void_ptr(addresses[i]), (nbytes[i] // 8,), np.uint64)
        lo, hi = first[j] * GROUP, first[j + 1] * GROUP
        out[i, 0], out[i, 1] = _chain(lanes, seeds[i, 0], seeds[i, 1], plans[j, 0], plans[j, 1], plans[j, 3], r1[lo:hi], r2[lo:hi])
        finished(ctr, 1)
        j = claim(ctr, 1)
    leave(bell, helper)


# ---------------------------------------------------------------- Python API

# No numba parallel loop and no lock: ``_threads`` runs the claiming kernels on this thread and on helper
# threads that sleep when idle. The serial kernel (small tensors; a thread set to one numba thread, as the
# refit's digest beside the copy is) wakes no helper. Every kernel releases the GIL.


def lanes_digest(lanes: np.ndarray, seed: tuple[int, int]) -> tuple[int, int]:
    """The two digest words (unsigned ints) of a ``uint64`` lane array."""
    lanes = np.ascontiguousarray(lanes, dtype=np.uint64).reshape(-1)
    if lanes.shape[0] < _SERIAL_BELOW or threads_here() == 1:
        d1, d2 = _digest_serial(lanes, _U(seed[0]), _U(seed[1]))  # no helper woken, and the GIL released
    else:
        d1, d2 = _digest_parallel(lanes, _U(seed[0]), _U(seed[1]))
    return int(d1), int(d2)


def _digest_parallel(lanes: np.ndarray, s1: np.uint64, s2: np.uint64) -> tuple[np.uint64, np.uint64]:
    """The digest words of one tensor, its groups spread over the threads (``_threads``), then chained."""
    full, last, b_last, groups, total = _plan(lanes.shape[0])
    r1 = np.empty(total * GROUP, dtype=np.uint64)
    r2 = np.empty(total * GROUP, dtype=np.uint64)
    spread(_groups_claimed, (lanes, full, b_last, total, r1, r2), total)
    return _chain(lanes, s1, s2, full, last, groups, r1, r2)


def lanes_digest_many(lanes: np.ndarray, starts: np.ndarray, counts: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """Digest words (``(n, 2)`` ``uint64``) of ``n`` tensors packed in one lane array.

    Tensor ``i`` is ``lanes[starts[i] : starts[i] + counts[i]]`` (a count of 0
    is an empty tensor), seeded with ``seeds[i]``. Tensors are spread over the
    threads, one at a time each, so this suits many small tensors; a large one
    is better served by :func:`lanes_digest`.
    """
    lanes = np.ascontiguousarray(lanes, dtype=np.uint64).reshape(-1)
    starts = np.ascontiguousarray(starts, dtype=np.int64).reshape(-1)
    counts = np.ascontiguousarray(counts, dtype=np.int64).reshape(-1)
    seeds = np.ascontiguousarray(seeds, dtype=np.uint64).reshape(-1, 2)
    n = starts.shape[0]
    if counts.shape[0] != n or seeds.shape[0] != n:
        raise ValueError(f"starts, counts and seeds disagree on the tensor count ({n}, {counts.shape[0]}, {seeds.shape[0]})")
    if n and (starts.min() < 0 or counts.min() < 0 or int((starts + counts).max()) > lanes.shape[0]):
        raise ValueError("a tensor's lanes fall outside the lane array")
    out = np.empty((n, 2), dtype=np.uint64)
    if n:
        spread(_many_claimed, (lanes, starts, counts, seeds, out), n)  # tensors of mixed sizes: one by one
    return out


def lanes_digest_at(addresses: np.ndarray, nbytes: np.ndarray, seeds: np.ndarray, keep_alive: object) -> np.ndarray:
    """Digest words (``(n, 2)`` ``uint64``) of ``n`` tensors read where they live.

    Tensor ``i`` is the ``nbytes[i]`` bytes at host address ``addresses[i]``: memory
    that ``keep_alive`` (the tensors) holds for the duration of the call, contiguous
    (the caller checks). Whole aligned lanes are read in place; the groups of every
    large tensor are spread over the threads together (each split as by
    :func:`lanes_digest`, with no thread start per tensor); a small one is digested
    serially by one thread, as in :func:`lanes_digest_many`, and so is one with an
    odd tail or an unaligned start, copied into zero-padded lanes inside the kernel.
    """
    addresses = np.ascontiguousarray(addresses, dtype=np.uint64).reshape(-1)
    nbytes = np.ascontiguousarray(nbytes, dtype=np.int64).reshape(-1)
    seeds = np.ascontiguousarray(seeds, dtype=np.uint64).reshape(-1, 2)
    n = addresses.shape[0]
    if nbytes.shape[0] != n or seeds.shape[0] != n:
        raise ValueError(f"addresses, nbytes and seeds disagree on the tensor count ({n}, {nbytes.shape[0]}, {seeds.shape[0]})")
    if n and (nbytes.min() < 0 or bool(((addresses == 0) & (nbytes > 0)).any())):
        raise ValueError("every byte count must be >= 0, and an address non-null where there are bytes")
    out = np.empty((n, 2), dtype=np.uint64)
    if n:
        rest, big, plans, first, owner = _at_plan(addresses, nbytes)
        r1 = np.empty(first[-1] * GROUP, dtype=np.uint64)
        r2 = np.empty(first[-1] * GROUP, dtype=np.uint64)
        items, m = rest.shape[0] + int(first[-1]), big.shape[0]
        spread(_at_claimed, (addresses, nbytes, seeds, out, rest, big, plans, first, owner, r1, r2), items,
               last=(1, m) if m else (0, items))
    del keep_alive  # held until here: the kernel read the tensors' memory
    return out


def set_threads(n: int) -> None:
    """Threads the kernel may use (at most the cores numba found)."""
    numba.set_num_threads(n)
