"""The torch backend: the reference implementation, on any device, no host sync.

It follows the spec level by level with whole-tensor ops. It is the oracle for
the compiled backends and the fallback wherever they do not run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wcviz.digest import _spec

if TYPE_CHECKING:
    import torch

__all__ = ["lanes_digest"]

_I = _spec.to_i64
_MIX = (_I(_spec.MIX_1), _I(_spec.MIX_2))
_LT = tuple(_I(v) for v in _spec.LT)
_RT = tuple(_I(v) for v in _spec.RT)
_MUL = tuple(_I(v) for v in _spec.MUL)
_CHAIN = _I(_spec.CHAIN)


def _lsr(x: torch.Tensor, b: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` is arithmetic)."""
    return (x >> b) & ((1 << (64 - b)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _lsr(x, 30)) * _MIX[0]
    x = (x ^ _lsr(x, 27)) * _MIX[1]
    return x ^ _lsr(x, 31)


def _root(chunk: torch.Tensor, k: int) -> torch.Tensor:
    """Fold one zero-padded chunk through channel ``k``'s ordered tree: a 0-d tensor."""
    v = chunk
    while v.numel() > 1:
        pairs = v.view(-1, 2)
        v = _mix64(_mix64(pairs[:, 0] ^ _LT[k]) + _mix64(pairs[:, 1] ^ _RT[k]) * _MUL[k])
    return v[0]


def lanes_digest(lanes: torch.Tensor, seed: tuple[int, int]) -> torch.Tensor:
    """The two digest words (``int64``, on ``lanes.device``) of an ``int64`` lane tensor."""
    import torch

    n = lanes.numel()
    starts = range(0, n, _spec.CHUNK) if n else [0]
    chain: list[torch.Tensor | int] = [seed[0], seed[1]]
    for s in starts:
        chunk = lanes[s : s + _spec.CHUNK]
        width = _spec.chunk_width(chunk.numel())
        if width != chunk.numel():
            chunk = torch.nn.functional.pad(chunk, (0, width - chunk.numel()))
        for k in range(2):
            c = chain[k]
            if isinstance(c, int):  # first chunk: the seed is still a host int
                acc = _root(chunk, k) + _I(c * _spec.CHAIN)
            else:
                acc = c * _CHAIN + _root(chunk, k)
            chain[k] = _mix64(acc)
    return torch.stack([_mix64(c) for c in chain])  # type: ignore[arg-type]
