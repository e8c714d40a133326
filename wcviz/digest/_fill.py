"""The digest a tensor must have when every one of its bytes is the same value, without the tensor.

The end-state check's reset writes a known byte over every parameter (0xA5 or
0x5A with wcviz's poison, zeros with vLLM's own reset). Whether a reset covered
a parameter *entirely* is then a question of equality: its digest after the
reset must be exactly the digest of a tensor of its dtype and shape filled
with that byte. A partial reset gives another digest.

Computing that digest by digesting a filled tensor would cost as much as
digesting the model again, on the client. For "nemo-rl-v3" it does not need
to: every level of a chunk's tree holds at most a few runs of equal values (the
fill, one partly filled last lane, the zero padding), so the fold runs on runs,
O(log chunk) per chunk, and all full chunks share one root. "sha256" has no such
shortcut; it is hashed from a repeated block, once per (dtype, shape, byte).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence

from wcviz._errors import DigestError
from wcviz.digest import _spec
from wcviz.digest._api import parse_dtype, whole_dims
from wcviz.digest._spec import CHAIN, CHUNK, LT, MASK64, MUL, RT, chunk_width

__all__ = ["FILL_ALGORITHMS", "fill_digest"]

FILL_ALGORITHMS = (_spec.ALGO, "sha256", "vllm-sha256", "sglang-cpu", "sglang-gpu")  # every algorithm wcviz computes

Runs = list[tuple[int, int]]  # (lane value, how many in a row)


def _mix64(x: int) -> int:
    x = ((x ^ (x >> 30)) * _spec.MIX_1) & MASK64
    x = ((x ^ (x >> 27)) * _spec.MIX_2) & MASK64
    return x ^ (x >> 31)


def _merge(left: int, right: int, k: int) -> int:
    return _mix64((_mix64(left ^ LT[k]) + _mix64(right ^ RT[k]) * MUL[k]) & MASK64)


def _push(out: Runs, value: int, count: int) -> None:
    if out and out[-1][0] == value:
        out[-1] = (value, out[-1][1] + count)
    else:
        out.append((value, count))


def _fold_runs(runs: Runs, k: int) -> int:
    """The root of channel ``k``'s tree over lanes given as runs (their total a power of two)."""
    while sum(n for _, n in runs) > 1:
        nxt: Runs = []
        left: int | None = None  # a left child waiting for its right sibling from the next run
        for value, n in runs:
            if left is not None:
                _push(nxt, _merge(left, value, k), 1)
                n -= 1
                left = None
            if n >= 2:
                _push(nxt, _merge(value, value, k), n // 2)
            if n % 2:
                left = value
        runs = nxt
    return runs[0][0]


def _chunk_roots(fill_lane: int, tail_lane: int | None, lanes: int, k: int) -> list[tuple[int, int]]:
    """``(root, how many chunks in a row)`` for ``lanes`` lanes of ``fill_lane``, the last one ``tail_lane``."""
    if lanes == 0:
        return [(_fold_runs([(0, 2)], k), 1)]
    full, rest = divmod(lanes, CHUNK)
    out: list[tuple[int, int]] = []

    def root(n: int, last_is_tail: bool) -> int:
        runs: Runs = []
        body = n - 1 if last_is_tail else n
        if body:
            _push(runs, fill_lane, body)
        if last_is_tail:
            assert tail_lane is not None
            _push(runs, tail_lane, 1)
        pad = chunk_width(n) - n
        if pad:
            _push(runs, 0, pad)
        return _fold_runs(runs, k)

    tail = tail_lane is not None
    if rest:
        if full:
            out.append((root(CHUNK, False), full))
        out.append((root(rest, tail), 1))
    else:
        if full - tail:
            out.append((root(CHUNK, False), full - tail))
        if tail:
            out.append((root(CHUNK, True), 1))
    return out


@functools.lru_cache(maxsize=1024)  # a model repeats few (dtype, shape) pairs
def _nemo(dtype_name: str, shape: tuple[int, ...], nbytes: int, byte: int) -> str:
    full_lane = int.from_bytes(bytes([byte]) * 8, "little")
    lanes, odd = divmod(nbytes, 8)
    tail_lane = None
    if odd:
        lanes += 1
        tail_lane = int.from_bytes(bytes([byte]) * odd + bytes(8 - odd), "little")
    words = []
    for k, seed in enumerate(_spec.seeds(dtype_name, shape, nbytes)):
        c = seed
        for root, repeat in _chunk_roots(full_lane, tail_lane, lanes, k):
            for _ in range(repeat):
                c = _mix64((c * CHAIN + root) & MASK64)
        words.append(_mix64(c))
    return _spec.hex_of(words[0], words[1])


_BLOCK = 1 << 20


@functools.lru_cache(maxsize=256)
def _sha256(dtype_name: str, shape: tuple[int, ...], nbytes: int, byte: int) -> str:
    h = hashlib.sha256(_spec.metadata_bytes(dtype_name, shape, nbytes))
    block = bytes([byte]) * min(nbytes, _BLOCK)
    left = nbytes
    while left:
        n = min(left, len(block))
        h.update(block if n == len(block) else block[:n])
        left -= n
    return h.hexdigest()


def _width(name: str) -> int | None:
    """Bytes per element of ``torch.<name>``, or None for a name this PyTorch does not know (its digest can
    still be computed: the seeds take the name as written, and the byte count stands alone)."""
    from wcviz.digest._buffers import _WIDTHS

    bare = name.removeprefix("torch.")
    if bare in _WIDTHS:
        return _WIDTHS[bare]
    try:
        return int(parse_dtype(bare).itemsize)
    except DigestError:
        return None


def fill_digest(algo: str, dtype_name: str, shape: Sequence[int], nbytes: int, byte: int) -> str:
    """The hex digest, under ``algo``, of a tensor of ``dtype_name`` and ``shape`` whose every byte is ``byte``.

    ``dtype_name`` is PyTorch's ``str(dtype)`` with or without ``torch.``;
    ``nbytes`` is ``numel * element_size``. Equal to :func:`wcviz.digest_hex` of
    ``torch.full`` of those bytes. Raises ``ValueError`` for an algorithm not in
    :data:`FILL_ALGORITHMS`.
    """
    if not 0 <= int(byte) <= 255:
        raise ValueError(f"a fill byte is 0..255, got {byte!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    name = dtype_name if dtype_name.startswith("torch.") else f"torch.{dtype_name}"
    dims = whole_dims(shape, f"a filled {name}")
    width = _width(name)
    if width is not None and int(nbytes) != math.prod(dims) * width:
        raise ValueError(f"nbytes {nbytes} contradicts {name} {list(dims)} ({math.prod(dims) * width} bytes)")
    if algo == _spec.ALGO:
        return _nemo(name, dims, int(nbytes), int(byte))
    if algo == "sha256":
        return _sha256(name, dims, int(nbytes), int(byte))
    if algo in ("vllm-sha256", "sglang-cpu", "sglang-gpu"):  # the engines hash bytes alone: only nbytes counts
        from wcviz.digest._engines import engine_fill_digest

        return engine_fill_digest(algo, int(nbytes), int(byte))
    raise ValueError(f"the digest of a filled tensor is computable for {', '.join(FILL_ALGORITHMS)}, not {algo!r}")
