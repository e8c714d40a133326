"""Staging buffers that cross process boundaries by handle, without a copy.

The owner creates a flat ``uint8`` buffer and sends its :class:`BufferHandle`
(small and picklable); the peer attaches it and sees the same memory. On the
CPU the buffer is a POSIX shared-memory segment whose name starts with
:data:`PREFIX` (so a leak is easy to spot in ``/dev/shm``); on a GPU it is a
CUDA allocation shared through CUDA IPC (``reduce_tensor``), which needs both
processes to see the device under the same index.

The owner frees the buffer (:meth:`OwnedBuffer.close` unlinks the segment);
the peer only lets go of its mapping (:meth:`AttachedBuffer.close`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch

__all__ = ["PREFIX", "AttachedBuffer", "BufferHandle", "OwnedBuffer"]

PREFIX = "wcviz_"


@dataclass(frozen=True)
class BufferHandle:
    """How a peer finds a buffer: its kind, a unique key, its size in bytes.

    ``transient`` marks a temporary buffer (one oversized parameter): the peer
    attaches it for one batch and lets go before acknowledging, instead of
    caching it. ``cuda`` is ``reduce_tensor``'s ``(rebuild, args)`` for a CUDA buffer.
    """

    kind: str  # "shm" | "cuda"
    key: str
    nbytes: int
    transient: bool = False
    cuda: tuple[Any, tuple[Any, ...]] | None = None


def _unique_key() -> str:
    return f"{PREFIX}{os.getpid()}_{secrets.token_hex(6)}"


class OwnedBuffer:
    """A buffer this process created and frees: ``.tensor`` (flat ``uint8``) and ``.handle`` for the peer."""

    def __init__(self, nbytes: int, device: torch.device, *, transient: bool = False) -> None:
        size = max(nbytes, 1)  # neither a segment nor frombuffer can be empty
        self._shm: SharedMemory | None = None
        if device.type == "cpu":
            self._shm = SharedMemory(name=_unique_key(), create=True, size=size)
            self.tensor: torch.Tensor | None = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=size)
            self.handle = BufferHandle("shm", self._shm.name, size, transient)
        elif device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            self.tensor = torch.empty(size, dtype=torch.uint8, device=device)
            self.handle = BufferHandle("cuda", _unique_key(), size, transient, cuda=reduce_tensor(self.tensor))
        else:
            raise ValueError(f"cannot share a staging buffer on device {device}: only cpu and cuda")

    def close(self) -> None:
        """Free the buffer (unlink the segment). Idempotent."""
        self.tensor = None
        shm, self._shm = self._shm, None
        if shm is not None:
            _close_quietly(shm)
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()


class AttachedBuffer:
    """A peer's buffer, attached from its handle: ``.tensor`` sees the owner's memory."""

    def __init__(self, handle: BufferHandle) -> None:
        self.handle = handle
        self._shm: SharedMemory | None = None
        if handle.kind == "shm":
            self._shm = _attach_shm(handle.key)
            self.tensor: torch.Tensor | None = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=handle.nbytes)
        elif handle.kind == "cuda" and handle.cuda is not None:
            rebuild, args = handle.cuda
            self.tensor = rebuild(*args)
        else:
            raise ValueError(f"unknown buffer handle {handle!r}")

    def close(self) -> None:
        """Let go of the mapping (the owner frees the memory). Idempotent."""
        self.tensor = None
        shm, self._shm = self._shm, None
        if shm is not None:
            _close_quietly(shm)


def _close_quietly(shm: SharedMemory) -> None:
    """Unmap ``shm``, or, while a view of it is still alive (say, in an exception's traceback), leave the map to that view.

    ``SharedMemory.close`` refuses while a view exists, and its ``__del__`` would
    retry and complain; dropping its references lets the map go with the last view.
    """
    try:
        shm.close()
    except BufferError:
        shm._buf = shm._mmap = None  # type: ignore[attr-defined]
        shm.close()  # now only closes the file descriptor


_tracker_lock = threading.Lock()


@contextlib.contextmanager
def _untracked() -> Iterator[None]:
    """Keep this process's resource tracker out of a segment it merely attaches.

    Before Python 3.13 (``track=False``), attaching registers the segment, and the
    tracker unlinks it when this process exits, under its owner's feet (gh-82300).
    """
    with _tracker_lock:
        register = resource_tracker.register
        resource_tracker.register = lambda name, rtype: None  # type: ignore[assignment]
        try:
            yield
        finally:
            resource_tracker.register = register  # type: ignore[assignment]


def _attach_shm(name: str) -> SharedMemory:
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    with _untracked():
        return SharedMemory(name=name)
