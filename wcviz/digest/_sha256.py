"""The "sha256" algorithm: SHA-256 of the digest metadata followed by the logical bytes.

For interoperating with tools that speak SHA-256. It hashes exactly what
"nemo-rl-v3" hashes (the metadata bytes its seeds come from, then the
``nbytes`` logical bytes, unpadded), on the host.
"""

from __future__ import annotations

import hashlib

from wcviz.digest import _spec

__all__ = ["ALGO", "sha256_hex"]

ALGO = "sha256"


def sha256_hex(raw: memoryview | bytes, dtype_name: str, shape: tuple[int, ...], nbytes: int) -> str:
    """64 lowercase hex characters; ``raw`` holds at least ``nbytes`` bytes."""
    h = hashlib.sha256(_spec.metadata_bytes(dtype_name, shape, nbytes))
    h.update(memoryview(raw).cast("B")[:nbytes])
    return h.hexdigest()
