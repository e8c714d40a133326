"""The "nemo-rl-v3" digest as data: constants, seeds and a pure-Python fold.

Everything here is a transcription of ``shared/digest-algorithm.md``. The
pure-Python :func:`reference_lanes_digest` is deliberately naive (Python ints,
no vectorisation): it is the independent oracle the fast backends are tested
against on small inputs, and nothing in the product calls it on real weights.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence

__all__ = [
    "ALGO",
    "CHUNK",
    "CHAIN",
    "LT",
    "RT",
    "MUL",
    "MIX_1",
    "MIX_2",
    "MASK64",
    "PERSON",
    "metadata_bytes",
    "seeds",
    "to_i64",
    "hex_of",
    "hex_pairs",
    "hex_rows",
    "chunk_width",
    "reference_lanes_digest",
]

ALGO = "nemo-rl-v3"
PERSON = b"NeMoRLrefit-v3"
MASK64 = (1 << 64) - 1

MIX_1 = 0xBF58476D1CE4E5B9
MIX_2 = 0x94D049BB133111EB
LT = (0x9E3779B97F4A7C15, 0x452821E638D01377)
RT = (0xC2B2AE3D27D4EB4F, 0xD1B54A32D192ED03)
MUL = (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)
CHAIN = 0x2545F4914F6CDD1D
CHUNK = 1 << 20  # lanes per chunk (8 MiB); part of the algorithm


def to_i64(x: int) -> int:
    """Two's-complement int64 value of a 64-bit word (for torch scalars)."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def metadata_bytes(dtype_name: str, shape: Sequence[int], nbytes: int) -> bytes:
    """The bytes the seeds are hashed from: dtype name, ndim, dims, nbytes.

    ``dtype_name`` is PyTorch's ``str(dtype)`` with the ``torch.`` prefix.
    """
    name = dtype_name.encode("ascii")
    parts = [struct.pack("<H", len(name)), name, struct.pack("<Q", len(shape))]
    parts += [struct.pack("<Q", int(d)) for d in shape]
    parts.append(struct.pack("<Q", int(nbytes)))
    return b"".join(parts)


def seeds(dtype_name: str, shape: Sequence[int], nbytes: int) -> tuple[int, int]:
    """(seed1, seed2) as unsigned 64-bit ints."""
    return _seeds(dtype_name, tuple(int(d) for d in shape), int(nbytes))


@functools.lru_cache(maxsize=4096)  # a model repeats a few shapes many times (norms, per-layer weights)
def _seeds(dtype_name: str, shape: tuple[int, ...], nbytes: int) -> tuple[int, int]:
    h = hashlib.blake2b(metadata_bytes(dtype_name, shape, nbytes), digest_size=16, person=PERSON)
    raw = h.digest()
    return int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little")


def hex_of(d1: int, d2: int) -> str:
    """The 32-character hex form of the two digest words."""
    return "%016x%016x" % (d1 & MASK64, d2 & MASK64)


def hex_pairs(rows: Sequence[Sequence[int]]) -> list[str]:
    """:func:`hex_of` of each ``[d1, d2]`` pair (``int64`` words come negative)."""
    return ["%016x%016x" % (d1 & MASK64, d2 & MASK64) for d1, d2 in rows]


def hex_rows(words: object) -> list[str]:
    """:func:`hex_of` of each ``(d1, d2)`` row of a host ``uint64`` array, formatted in one pass (many digests)."""
    import numpy as np

    h = np.ascontiguousarray(words, dtype=np.uint64).astype(">u8").tobytes().hex()
    return [h[i : i + 32] for i in range(0, len(h), 32)]


def chunk_width(n: int) -> int:
    """Lanes a chunk of ``n`` lanes is zero-padded to: a power of two, at least 2."""
    return 1 << max(1, (n - 1).bit_length())


def _mix64(x: int) -> int:
    x = ((x ^ (x >> 30)) * MIX_1) & MASK64
    x = ((x ^ (x >> 27)) * MIX_2) & MASK64
    return x ^ (x >> 31)


def reference_lanes_digest(lanes: Sequence[int], seed: tuple[int, int]) -> tuple[int, int]:
    """Digest words of a lane sequence (unsigned ints), straight from the spec."""
    out = []
    for k in range(2):
        c = seed[k]
        starts = range(0, len(lanes), CHUNK) if lanes else [0]
        for s in starts:
            chunk = list(lanes[s : s + CHUNK])
            v = chunk + [0] * (chunk_width(len(chunk)) - len(chunk))
            while len(v) > 1:
                v = [
                    _mix64((_mix64(v[i] ^ LT[k]) + _mix64(v[i + 1] ^ RT[k]) * MUL[k]) & MASK64)
                    for i in range(0, len(v), 2)
                ]
            c = _mix64((c * CHAIN + v[0]) & MASK64)
        out.append(_mix64(c))
    return out[0], out[1]
