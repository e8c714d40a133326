"""Packing named tensors into a staging buffer, slicing them back out, and the metadata both ends slice with.

Shared by every transport that moves bytes in buckets. Each tensor starts at
an offset aligned to :data:`ALIGN` bytes. The sender plans buckets from its
tensors' sizes; the receiver walks the names it is told with *its own*
metadata, so a shape or dtype that drifted on one side shows up (as a digest
mismatch when the byte size is unchanged, as an offset that does not add up
when it is not).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wcviz.digest import NamedTensors, TensorMeta, as_pairs, logical_bytes

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALIGN", "Bucket", "Meta", "NamedTensors", "aligned", "fingerprint", "framing_problems", "metadata", "metadata_of", "named_tensors", "nbytes", "pack",
    "plan", "sendable", "unpack", "walk",
]  # fmt: skip

ALIGN = 512
Meta = TensorMeta  # (shape, dtype name without "torch."): what a receiver declares for each parameter


def nbytes(t: torch.Tensor) -> int:
    """A tensor's logical bytes: ``numel * element_size``."""
    return t.numel() * t.element_size()


def named_tensors(items: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    """What a transport sends, as ``(name, tensor)`` pairs: each name once, each value a tensor."""
    import torch

    pairs = as_pairs(items)
    for name, t in pairs:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected (str, torch.Tensor) pairs, got ({name!r:.60}, {type(t).__name__})")
    return pairs


def sendable(items: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    """:func:`named_tensors`, each of which has bytes to send: a meta, sparse or nested tensor, or a subclass whose
    bytes are not its own storage, is a TypeError naming it, before anything is sent (mid-stream, the receiver would
    already hold part of the refit)."""
    from wcviz._errors import DigestError
    from wcviz.digest import check_digestible

    pairs = named_tensors(items)
    for name, t in pairs:
        try:
            check_digestible(t, name)
        except DigestError as e:
            raise TypeError(f"cannot send {e}") from None
    return pairs


def metadata_of(items: NamedTensors) -> dict[str, Meta]:
    """``{name: Meta}`` of an engine's weights: what a receiver slices with."""
    return {name: Meta.of(t) for name, t in named_tensors(items)}


def metadata(declared: Mapping[str, tuple[Iterable[int], Any]]) -> dict[str, Meta]:
    """Declared ``{name: (shape, dtype)}`` in its exact form (shape tuples of ints, dtype names without ``torch.``)."""
    return {name: Meta.parse(list(shape), dtype) for name, (shape, dtype) in declared.items()}


def fingerprint(declared: Mapping[str, Meta]) -> str:
    """SHA-256 (hex) of a receiver's declared metadata in a canonical form: names, shapes and dtypes.

    Both ends compute it to learn, without sending the metadata again, whether a
    receiver still declares what it declared when the sender learnt it. Raises
    what :func:`metadata` raises for metadata that is not metadata.
    """
    import hashlib
    import json

    exact = metadata(declared)  # one form for every spelling: (1, 2) and [1, 2], torch.float and "float32"
    canonical = {name: [[int(d) for d in shape], str(dtype)] for name, (shape, dtype) in exact.items()}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def framing_problems(tensors: Sequence[tuple[str, torch.Tensor]], declared: Mapping[str, Meta]) -> list[str]:
    """What stops a receiver that ``declared`` this metadata from slicing ``tensors``: unknown names, other byte sizes.

    The framing must agree for the receiver to slice the buffers; a shape or
    dtype that drifted at the same byte size is the digest's to catch.
    """
    unknown = [n for n, _ in tensors if n not in declared]
    resized = [
        f"{n} ({Meta.of(t).describe()} here; the receiver expects {Meta(*declared[n]).describe()})"
        for n, t in tensors
        if n in declared and nbytes(t) != Meta(*declared[n]).nbytes
    ]
    problems = []
    if unknown:
        problems.append(f"the receiver has no parameter {', '.join(unknown)}")
    if resized:
        problems.append(f"byte sizes differ for {'; '.join(resized)}")
    return problems


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
    out = []
    used = 0
    for name in names:
        if name not in metadata:
            raise KeyError(name)
        shape, dtype = metadata[name]
        meta = Meta(tuple(int(d) for d in shape), str(dtype))
        out.append((name, used, meta))
        used = aligned(used + meta.nbytes)
    return out, used


def pack(buf: torch.Tensor, offset: int, t: torch.Tensor) -> None:
    """Copy ``t``'s logical bytes into the ``uint8`` buffer at ``offset``."""
    raw = logical_bytes(t)
    buf[offset : offset + raw.numel()].copy_(raw, non_blocking=True)


def unpack(buf: torch.Tensor, offset: int, meta: Meta) -> torch.Tensor:
    """A view of the buffer at ``offset`` as ``meta`` says: no copy."""
    import math

    import torch

    from wcviz.digest import parse_dtype

    shape, dtype = meta
    dt = parse_dtype(dtype)
    size = math.prod(shape) * dt.itemsize
    if size == 0:
        return torch.empty(shape, dtype=dt, device=buf.device)
    return buf[offset : offset + size].view(dt).reshape(shape)
