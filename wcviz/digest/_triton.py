"""The GPU backend: the digest of a whole batch of tensors in three Triton launches.

Each chunk's tree is a perfect binary tree, so it is folded in three steps,
each one launch for every tensor of the batch at once:

1. ``_blocks``: one program per block of ``BLOCK`` lanes folds both channels'
   subtrees in registers (a tail or padding reads as zeros, as the spec pads);
2. ``_chunks``: one program per chunk folds that chunk's block roots;
3. ``_chain``: one program per tensor chains its chunk roots and finalises.

A batch is described by a small ``int64`` table (lane address, lane count,
seeds, where each tensor's blocks and chunks start), copied to the device
without a host sync; programs find their tensor by binary search in it. So
a model of hundreds of tensors costs three launches, not three per tensor,
and nothing waits for the device until the caller reads the words.

A chunk shorter than a block (a small tensor, or a short last chunk) has a
smaller tree: its root is the first value at its own height, taken on the way
up. That path is only compiled in, never taken, for full blocks.

:func:`self_check` compares the kernels with the torch reference on inputs
that take every path; ``auto`` runs it once per process before using them.

Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (Triton's
interpreter): that is how the tests check them against the reference on a
machine without a GPU. The variable must be set before this module is imported.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import triton
import triton.language as tl

from wcviz.digest import _spec

if not hasattr(tl, "split"):  # the tree levels need tl.split (Triton 3.0); ``auto`` falls back to torch
    raise ImportError(f"triton {triton.__version__} is too old for wcviz's kernels (needs triton >= 3.0)")

if TYPE_CHECKING:
    import torch

__all__ = ["BLOCK", "INTERPRETED_AT_IMPORT", "NUM_WARPS", "interpreting", "lanes_digest", "lanes_digest_many", "self_check"]

BLOCK = 1024  # lanes one program folds: 8 KiB of input
NUM_WARPS = 4
_LOG_CHUNK = _spec.CHUNK.bit_length() - 1

# Rows of the batch table, each ``ntensors + 1`` long (prefix rows use the extra entry).
_ADDR, _NLANES, _SEED1, _SEED2, _LAST_LEVELS, _BLOCK_BASE, _CHUNK_BASE = range(7)
_ROWS = 7


# Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so what counts is its value at this import:
# kernels defined without it are compiled for a GPU whatever the variable says later.
INTERPRETED_AT_IMPORT = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    """Whether the kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1`` was set when they were defined."""
    return INTERPRETED_AT_IMPORT


@triton.jit
def _mix(x):
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _level(v, N: tl.constexpr, CH: tl.constexpr):
    """One tree level of channel ``CH`` (1 or 2): ``N`` values in, ``N // 2`` out."""
    left, right = tl.split(tl.reshape(v, (N // 2, 2)))  # even positions, odd positions
    if CH == 1:
        return _mix(_mix(left ^ 0x9E3779B97F4A7C15) + _mix(right ^ 0xC2B2AE3D27D4EB4F) * 0xFF51AFD7ED558CCD)
    else:
        return _mix(_mix(left ^ 0x452821E638D01377) + _mix(right ^ 0xD1B54A32D192ED03) * 0xC4CEB9FE1A85EC53)


@triton.jit
def _fold_all(v, N: tl.constexpr, LOG_N: tl.constexpr, CH: tl.constexpr):
    """Root of the perfect tree over all ``N = 2**LOG_N`` values (``LOG_N >= 1``)."""
    for i in tl.static_range(LOG_N):
        v = _level(v, N >> i, CH)
    return tl.sum(v, axis=0)  # the one value left


@triton.jit
def _fold_to(v, levels, N: tl.constexpr, LOG_N: tl.constexpr, CH: tl.constexpr):
    """Root of the perfect tree over the first ``2**levels`` values (``1 <= levels <= LOG_N``)."""
    root = levels.to(tl.uint64) * 0
    for i in tl.static_range(LOG_N):
        v = _level(v, N >> i, CH)
        first = tl.sum(tl.where(tl.arange(0, N >> (i + 1)) == 0, v, 0), axis=0)
        root = tl.where(levels == i + 1, first, root)
    return root


@triton.jit
def _fold(v, levels, N: tl.constexpr, LOG_N: tl.constexpr, CH: tl.constexpr):
    if levels == LOG_N:
        root = _fold_all(v, N, LOG_N, CH)
    else:
        root = _fold_to(v, levels, N, LOG_N, CH)
    return root


@triton.jit
def _find(base, x, T, LOG_T: tl.constexpr):
    """The tensor ``t`` with ``base[t] <= x < base[t + 1]`` (``base``: ``T + 1`` increasing values)."""
    lo = x * 0
    for i in tl.static_range(LOG_T):
        cand = tl.minimum(lo + (1 << (LOG_T - 1 - i)), T)
        lo = tl.where(tl.load(base + cand) <= x, cand, lo)
    return lo


@triton.jit
def _chunk_levels(table, S, t, c):
    """Height of chunk ``c``'s tree: ``log2(CHUNK)`` for all but a tensor's last chunk."""
    nchunks = tl.load(table + 6 * S + t + 1) - tl.load(table + 6 * S + t)
    return tl.where(c < nchunks - 1, 20, tl.load(table + 4 * S + t))


@triton.jit
def _blocks(table, roots, S, T, NB, LOG_T: tl.constexpr, BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr):
    """Block roots of every tensor: ``roots[k * NB + b]`` for channel ``k + 1``, global block ``b``."""
    pid = tl.program_id(0).to(tl.int64)
    t = _find(table + 5 * S, pid, T, LOG_T)
    j = pid - tl.load(table + 5 * S + t)  # block index within the tensor
    per_chunk = (1 << 20) // BLOCK
    c = j // per_chunk
    start = c * (1 << 20) + (j % per_chunk) * BLOCK
    n = tl.load(table + S + t)
    lanes = tl.load(table + t).to(tl.pointer_type(tl.int64))
    offs = start + tl.arange(0, BLOCK)
    x = tl.load(lanes + offs, mask=offs < n, other=0).to(tl.uint64, bitcast=True)
    levels = tl.minimum(_chunk_levels(table, S, t, c), LOG_BLOCK)
    r1 = _fold(x, levels, BLOCK, LOG_BLOCK, 1)
    r2 = _fold(x, levels, BLOCK, LOG_BLOCK, 2)
    tl.store(roots + pid, r1.to(tl.int64, bitcast=True))
    tl.store(roots + NB + pid, r2.to(tl.int64, bitcast=True))


@triton.jit
def _chunks(table, roots, croots, S, T, NB, NC, LOG_T: tl.constexpr, PER_CHUNK: tl.constexpr, LOG_PER: tl.constexpr, LOG_BLOCK: tl.constexpr):
    """Chunk roots from block roots: ``croots[k * NC + g]`` for global chunk ``g``."""
    pid = tl.program_id(0).to(tl.int64)
    t = _find(table + 6 * S, pid, T, LOG_T)
    c = pid - tl.load(table + 6 * S + t)
    first = tl.load(table + 5 * S + t) + c * PER_CHUNK
    levels = _chunk_levels(table, S, t, c) - LOG_BLOCK  # tree levels above the blocks
    if levels > 0:
        idx = tl.arange(0, PER_CHUNK)
        mask = idx < (1 << levels)
        v1 = tl.load(roots + first + idx, mask=mask, other=0).to(tl.uint64, bitcast=True)
        v2 = tl.load(roots + NB + first + idx, mask=mask, other=0).to(tl.uint64, bitcast=True)
        r1 = _fold(v1, levels, PER_CHUNK, LOG_PER, 1).to(tl.int64, bitcast=True)
        r2 = _fold(v2, levels, PER_CHUNK, LOG_PER, 2).to(tl.int64, bitcast=True)
    else:  # the chunk fits in one block, whose root is the chunk's
        r1 = tl.load(roots + first)
        r2 = tl.load(roots + NB + first)
    tl.store(croots + pid, r1)
    tl.store(croots + NC + pid, r2)


@triton.jit
def _chain(table, croots, out, S, NC):
    """Chain each tensor's chunk roots from its seeds and finalise: ``out[t] = (d1, d2)``."""
    t = tl.program_id(0).to(tl.int64)
    c1 = tl.load(table + 2 * S + t).to(tl.uint64, bitcast=True)
    c2 = tl.load(table + 3 * S + t).to(tl.uint64, bitcast=True)
    for g in range(tl.load(table + 6 * S + t), tl.load(table + 6 * S + t + 1)):
        r1 = tl.load(croots + g).to(tl.uint64, bitcast=True)
        r2 = tl.load(croots + NC + g).to(tl.uint64, bitcast=True)
        c1 = _mix(c1 * 0x2545F4914F6CDD1D + r1)
        c2 = _mix(c2 * 0x2545F4914F6CDD1D + r2)
    tl.store(out + 2 * t, _mix(c1).to(tl.int64, bitcast=True))
    tl.store(out + 2 * t + 1, _mix(c2).to(tl.int64, bitcast=True))


def _layout(n: int, block: int) -> tuple[int, int, int]:
    """(chunks, blocks, height of the last chunk's tree) of a tensor of ``n`` lanes."""
    chunks = max(1, -(-n // _spec.CHUNK))
    last = n - (chunks - 1) * _spec.CHUNK
    levels = max(1, (last - 1).bit_length())
    return chunks, (chunks - 1) * (_spec.CHUNK // block) + max(1, (1 << levels) // block), levels


def lanes_digest_many(
    lanes: Sequence[torch.Tensor], seeds: Sequence[tuple[int, int]], *, block: int = BLOCK, num_warps: int = NUM_WARPS
) -> torch.Tensor:
    """Digest words of many ``int64`` lane tensors on one device: ``(len(lanes), 2)`` ``int64``.

    Three launches for the whole batch and no host sync. Every lane tensor must
    be contiguous, 8-byte aligned and stay alive until the result is read (the
    kernels run on the current stream, as later work that might reuse it does).
    """
    import torch

    if not 2 <= block <= _spec.CHUNK // 2 or block & (block - 1):
        raise ValueError(f"block must be a power of two in [2, {_spec.CHUNK // 2}], got {block}")
    if len(lanes) != len(seeds):
        raise ValueError(f"{len(lanes)} lane tensors but {len(seeds)} seeds")
    if not lanes:
        raise ValueError("lanes_digest_many needs at least one tensor")
    device = lanes[0].device
    T = len(lanes)
    table = torch.zeros((_ROWS, T + 1), dtype=torch.int64)
    rows = table.numpy()
    nblocks = nchunks = 0
    for i, (x, seed) in enumerate(zip(lanes, seeds)):
        if x.device != device or x.dtype != torch.int64 or x.dim() != 1 or not x.is_contiguous():
            raise ValueError(f"lane tensor {i}: expected contiguous 1-D int64 on {device}, got {x.dtype} {tuple(x.shape)} on {x.device}")
        chunks, blocks, levels = _layout(x.numel(), block)
        rows[_ADDR, i] = x.data_ptr()
        rows[_NLANES, i] = x.numel()
        rows[_SEED1, i] = _spec.to_i64(seed[0])
        rows[_SEED2, i] = _spec.to_i64(seed[1])
        rows[_LAST_LEVELS, i] = levels
        rows[_BLOCK_BASE, i] = nblocks
        rows[_CHUNK_BASE, i] = nchunks
        nblocks += blocks
        nchunks += chunks
    rows[_BLOCK_BASE, T] = nblocks
    rows[_CHUNK_BASE, T] = nchunks
    if device.type == "cuda":  # pinned and async: the copy does not wait for the device
        table = table.pin_memory().to(device, non_blocking=True)
    roots = torch.empty(2 * nblocks, dtype=torch.int64, device=device)
    croots = torch.empty(2 * nchunks, dtype=torch.int64, device=device)
    out = torch.empty((T, 2), dtype=torch.int64, device=device)
    log_t = max(1, math.ceil(math.log2(T + 1)))
    per_chunk = _spec.CHUNK // block
    S = T + 1
    _blocks[(nblocks,)](table, roots, S, T, nblocks, LOG_T=log_t, BLOCK=block, LOG_BLOCK=block.bit_length() - 1, num_warps=num_warps)
    _chunks[(nchunks,)](
        table, roots, croots, S, T, nblocks, nchunks,
        LOG_T=log_t, PER_CHUNK=per_chunk, LOG_PER=per_chunk.bit_length() - 1, LOG_BLOCK=block.bit_length() - 1,
        num_warps=num_warps,
    )  # fmt: skip
    _chain[(T,)](table, croots, out, S, nchunks, num_warps=1)
    return out


def lanes_digest(lanes: torch.Tensor, seed: tuple[int, int]) -> torch.Tensor:
    """The two digest words (``int64``, on ``lanes.device``) of one lane tensor."""
    return lanes_digest_many([lanes], [seed])[0]


def self_check(device: torch.device | str, *, block: int = BLOCK) -> bool:
    """Whether the kernels give the torch reference's words on ``device``, on inputs that take every path.

    Empty, one lane, a chunk narrower than a block, several blocks with a
    padded tail, and two chunks (the chain) in one batch. ``auto`` runs this
    once per process before trusting the kernels with a device's digests: a
    kernel miscompiled by some Triton/driver combination must not report
    mismatches (or worse, matches) that are not there.
    """
    import torch

    from wcviz.digest import _torch

    g = torch.Generator().manual_seed(20261129)
    sizes = [0, 1, 5, 3 * block + 7, _spec.CHUNK + 1]
    xs = [torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64, generator=g).to(device) for n in sizes]
    seeds = [((0x9E3779B97F4A7C15 * (i + 1)) & _spec.MASK64, (1 << 63) + i) for i in range(len(xs))]
    got = lanes_digest_many(xs, seeds, block=block)
    want = torch.stack([_torch.lanes_digest(x, s) for x, s in zip(xs, seeds)])
    return bool(torch.equal(got, want))
