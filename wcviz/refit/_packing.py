"""Packing named tensors into a staging buffer, and slicing them back out.

Shared by every transport that moves bytes in buckets. Each tensor starts at
an offset aligned to :data:`ALIGN` bytes. The sender plans buckets from its
tensors' sizes; the receiver walks the names it is told with *its own*
metadata, so a shape or dtype that drifted on one side shows up (as a digest
mismatch when the byte size is unchanged, as an offset that does not add up
when it is not).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["ALIGN", "aligned", "Bucket", "plan", "walk", "pack", "unpack", "Meta"]

ALIGN = 512
Meta = tuple[tuple[int, ...], str]  # (shape, dtype name without "torch.")


def aligned(n: int) -> int:
    """``n`` rounded up to the next multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Bucket:
    """Names packed together, their offsets, and the bytes used (aligned end of the last one).

    ``own`` marks a parameter larger than half the staging buffer: it travels
    alone, through a temporary buffer of its own.
    """

    names: tuple[str, ...]
    offsets: tuple[int, ...]
    used: int
    own: bool = False


def plan(sizes: Sequence[tuple[str, int]], capacity: int) -> list[Bucket]:
    """Group ``(name, nbytes)`` in order into buckets that fit ``capacity`` bytes."""
    if capacity < ALIGN:
        raise ValueError(f"staging buffer of {capacity} bytes is smaller than the {ALIGN}-byte alignment")
    out: list[Bucket] = []
    names: list[str] = []
    offsets: list[int] = []
    used = 0
    for name, nbytes in sizes:
        if nbytes > capacity // 2:
            if names:
                out.append(Bucket(tuple(names), tuple(offsets), used))
                names, offsets, used = [], [], 0
            out.append(Bucket((name,), (0,), aligned(nbytes), own=True))
            continue
        if aligned(used + nbytes) > capacity:  # the aligned end too: capacity need not be a multiple of ALIGN
            out.append(Bucket(tuple(names), tuple(offsets), used))
            names, offsets, used = [], [], 0
        names.append(name)
        offsets.append(used)
        used = aligned(used + nbytes)
    if names:
        out.append(Bucket(tuple(names), tuple(offsets), used))
    return out


def walk(names: Sequence[str], metadata: Mapping[str, Meta]) -> tuple[list[tuple[str, int, Meta]], int]:
    """Offsets of ``names`` computed from ``metadata`` alone, and the aligned end.

    Raises ``KeyError`` naming the first name the metadata does not know.
    """
    import math

    from wcviz.digest import parse_dtype

    out = []
    used = 0
    for name in names:
        if name not in metadata:
            raise KeyError(name)
        shape, dtype = metadata[name]
        out.append((name, used, (tuple(shape), dtype)))
        used = aligned(used + math.prod(shape) * parse_dtype(dtype).itemsize)
    return out, used


def pack(buf: torch.Tensor, offset: int, t: torch.Tensor) -> None:
    """Copy ``t``'s logical bytes into the ``uint8`` buffer at ``offset``."""
    from wcviz.digest._lanes import logical_bytes

    raw = logical_bytes(t)
    buf[offset : offset + raw.numel()].copy_(raw, non_blocking=True)


def unpack(buf: torch.Tensor, offset: int, meta: Meta) -> torch.Tensor:
    """A view of the buffer at ``offset`` as ``meta`` says: no copy."""
    import math

    import torch

    from wcviz.digest import parse_dtype

    shape, dtype = meta
    dt = parse_dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dt, device=buf.device)
    return buf[offset : offset + nbytes].view(dt).reshape(shape)
