"""Staging buffers that cross process boundaries by handle, without a copy.

The owner creates a flat ``uint8`` buffer and sends its :class:`BufferHandle`
(small; :meth:`BufferHandle.to_wire` makes it plain JSON data, so the control
channel never unpickles anything); the peer attaches it and sees the same memory. On the
CPU the buffer is a POSIX shared-memory segment whose name starts with
:data:`PREFIX` (so a leak is easy to spot in ``/dev/shm``); on a GPU it is a
CUDA allocation shared through CUDA IPC (``reduce_tensor``), which needs both
processes to see the device under the same index.

The owner frees the buffer (:meth:`OwnedBuffer.close` unlinks the segment);
the peer only lets go of its mapping (:meth:`AttachedBuffer.close`).
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import secrets
import sys
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch

__all__ = ["PREFIX", "AttachedBuffer", "BufferHandle", "OwnedBuffer"]

PREFIX = "wcviz_"
_KEY = re.compile(rf"{PREFIX}\d+_[0-9a-f]{{12}}")  # what _unique_key makes: nothing else is attached
# reduce_tensor's args for a CUDA tensor (torch.multiprocessing.reductions, read in torch 2.13):
# (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size_bytes,
#  storage_offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
#  event_sync_required). Classes and dtype are fixed (a flat uint8 torch.Tensor); the rest travels.
_CUDA_FIELDS = (
    "size", "stride", "offset", "device", "handle", "storage_size_bytes", "storage_offset_bytes",
    "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required",
)  # fmt: skip
_CUDA_AT = (1, 2, 3, 6, 7, 8, 9, 11, 12, 13, 14)  # where each field sits in the args
_BYTES = {"handle", "ref_counter_handle", "event_handle"}


class HandleError(ValueError):
    """A buffer handle from the wire that is not one this module makes."""


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

    def to_wire(self) -> dict[str, Any]:
        """Plain JSON data for the control channel (bytes as base64, no classes or functions)."""
        out: dict[str, Any] = {"kind": self.kind, "key": self.key, "nbytes": self.nbytes, "transient": self.transient}
        if self.cuda is not None:
            args = self.cuda[1]
            out["cuda"] = {
                f: (_b64(args[i]) if f in _BYTES else list(args[i]) if f in ("size", "stride") else args[i])
                for f, i in zip(_CUDA_FIELDS, _CUDA_AT)
            }
        return out

    @classmethod
    def from_wire(cls, data: Any) -> BufferHandle:
        """The handle :meth:`to_wire` described, checked field by field; :class:`HandleError` for anything else."""
        if not isinstance(data, dict) or set(data) - {"kind", "key", "nbytes", "transient", "cuda"}:
            raise HandleError(f"not a buffer handle: {str(data)[:200]}")
        kind, key, nbytes, transient = data.get("kind"), data.get("key"), data.get("nbytes"), data.get("transient")
        if kind not in ("shm", "cuda") or not isinstance(key, str) or not _KEY.fullmatch(key):
            raise HandleError(f"not a buffer this transport makes: kind {kind!r}, key {str(key)[:80]!r}")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 1 or not isinstance(transient, bool):
            raise HandleError(f"buffer handle {key}: bad size {nbytes!r} or transient flag {transient!r}")
        cuda = None
        if kind == "cuda":
            cuda = _cuda_rebuild(key, data.get("cuda"))
        elif data.get("cuda") is not None:
            raise HandleError(f"buffer handle {key}: a shared-memory buffer carries no CUDA handle")
        return cls(kind, key, int(nbytes), transient, cuda)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _b64(v: Any) -> str | None:
    return None if v is None else base64.b64encode(bytes(v)).decode("ascii")


def _cuda_rebuild(key: str, fields: Any) -> tuple[Any, tuple[Any, ...]]:
    """``(rebuild_cuda_tensor, args)`` for a flat uint8 CUDA buffer, from checked wire fields."""
    if not isinstance(fields, dict) or set(fields) != set(_CUDA_FIELDS):
        raise HandleError(f"buffer handle {key}: the CUDA handle needs exactly {', '.join(_CUDA_FIELDS)}")
    size, stride = fields["size"], fields["stride"]
    if not (isinstance(size, list) and len(size) == 1 and _is_int(size[0]) and stride == [1]):
        raise HandleError(f"buffer handle {key}: a staging buffer is flat and contiguous, got size {size!r} stride {stride!r}")
    for f in ("offset", "device", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset"):
        if not _is_int(fields[f]) or fields[f] < 0:
            raise HandleError(f"buffer handle {key}: {f} must be a non-negative integer, got {fields[f]!r}")
    if not isinstance(fields["event_sync_required"], bool):
        raise HandleError(f"buffer handle {key}: event_sync_required must be a bool")
    raw: dict[str, bytes | None] = {}
    for f in _BYTES:
        v = fields[f]
        if v is None and f == "event_handle":
            raw[f] = None
            continue
        try:
            raw[f] = base64.b64decode(v, validate=True) if isinstance(v, str) else None
        except ValueError:
            raw[f] = None
        if raw[f] is None:
            raise HandleError(f"buffer handle {key}: {f} is not base64 bytes")
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = (
        torch.Tensor, torch.Size(size), (1,), fields["offset"], torch.storage.TypedStorage, torch.uint8,
        fields["device"], raw["handle"], fields["storage_size_bytes"], fields["storage_offset_bytes"], False,
        raw["ref_counter_handle"], fields["ref_counter_offset"], raw["event_handle"], fields["event_sync_required"],
    )  # fmt: skip
    return rebuild_cuda_tensor, args


def _unique_key() -> str:
    return f"{PREFIX}{os.getpid()}_{secrets.token_hex(6)}"


class OwnedBuffer:
    """A buffer this process created and frees: ``.tensor`` (flat ``uint8``) and ``.handle`` for the peer."""

    def __init__(self, nbytes: int, device: torch.device, *, transient: bool = False) -> None:
        size = max(nbytes, 1)  # neither a segment nor frombuffer can be empty
        self.device = device
        self._shm: SharedMemory | None = None
        if device.type == "cpu":
            self._shm = SharedMemory(name=_unique_key(), create=True, size=size)
            _OWNED.add(self._shm._name)  # type: ignore[attr-defined]
            try:  # made, so freed on any way out (Ctrl-C while reserving a few GiB): never left in /dev/shm
                _reserve(self._shm, size)
                self.tensor: torch.Tensor | None = _mapped_tensor(self._shm, size)
            except BaseException:
                self.close()
                raise
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
            _OWNED.discard(shm._name)  # type: ignore[attr-defined]


def _reserve(shm: SharedMemory, size: int) -> None:
    """Back every page of a new segment now, or free it and raise naming ``/dev/shm``.

    A segment is created sparse: where ``/dev/shm`` is smaller than the buffer (64 MiB in
    a default Docker container) the first write past its end kills the process with
    SIGBUS, in the middle of a trainer's refit, leaving the segment behind."""
    fd = getattr(shm, "_fd", -1)
    if fd < 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        _close_quietly(shm)
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()
        from wcviz.refit.verify import RefitError

        free = _free_bytes("/dev/shm")
        raise RefitError(
            f"cannot reserve a {size:,}-byte refit staging buffer in shared memory ({e.strerror or e}): /dev/shm "
            f"has {free} free; make it larger (docker run --shm-size) or pass a smaller buffer_bytes"
        ) from None


def _free_bytes(path: str) -> str:
    try:
        st = os.statvfs(path)
    except OSError:
        return "an unknown number of bytes"
    return f"{st.f_bavail * st.f_frsize:,} bytes"


def _users(t: torch.Tensor | None) -> int:
    """How many tensors and storages share ``t``'s memory (torch's use count of its storage)."""
    return 0 if t is None else int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


class AttachedBuffer:
    """A peer's buffer, attached from its handle: ``.tensor`` sees the owner's memory.

    :meth:`views_alive` counts the tensors besides ``.tensor`` that still use the memory, so a
    receiver can tell a loader that kept its views; :meth:`close` never unmaps memory a view
    still reads (:func:`_mapped_tensor`).
    """

    def __init__(self, handle: BufferHandle) -> None:
        self.handle = handle
        self._shm: SharedMemory | None = None
        if handle.kind == "shm":
            self._shm = _attach_shm(handle.key)
            self.tensor: torch.Tensor | None = _mapped_tensor(self._shm, handle.nbytes)
        elif handle.kind == "cuda" and handle.cuda is not None:
            rebuild, args = handle.cuda
            self.tensor = rebuild(*args)
        else:
            raise ValueError(f"unknown buffer handle {handle!r}")
        self._own_users = _users(self.tensor)

    def views_alive(self) -> int:
        """Tensors other than ``.tensor`` that still use this buffer's memory (0 once every view is gone)."""
        return max(0, _users(self.tensor) - self._own_users) if self.tensor is not None else 0

    def close(self) -> None:
        """Let go of the mapping (the owner frees the memory); a view still alive keeps it until it goes. Idempotent."""
        self.tensor = None
        shm, self._shm = self._shm, None
        if shm is not None:
            _close_quietly(shm)


def _mapped_tensor(shm: SharedMemory, count: int) -> torch.Tensor:
    """A flat ``uint8`` tensor over a segment that keeps the mapping alive as long as any view of it lives.

    ``torch.frombuffer`` holds a reference to the object it is given, not a buffer export: given
    ``shm.buf`` itself, ``SharedMemory.close`` releases that memoryview and unmaps the segment under
    a view still alive (a loader that kept the views it was handed then crashed the engine with
    SIGSEGV at its next read). A memoryview of its own holds the export, so ``close`` refuses
    (:func:`_close_quietly`) and the mapping goes with the last view."""
    buf = shm.buf
    assert buf is not None  # an open segment
    return torch.frombuffer(memoryview(buf), dtype=torch.uint8, count=count)


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


_OWNED: set[str] = set()  # the segments this process made (and unlinks): its tracker keeps them, whoever attaches


def _attach_shm(name: str) -> SharedMemory:
    """Attach a segment another party owns, keeping this process's resource tracker out of it.

    Before Python 3.13 (``track=False``), attaching registers the segment, and the tracker
    unlinks it when this process exits, under its owner's feet (gh-82300): the registration
    is withdrawn at once. (Swapping out the tracker's ``register`` for the attach, as before,
    also dropped the registrations of segments other threads made meanwhile: left in
    ``/dev/shm`` for good when the process then died.) A segment this process made itself
    stays registered: its owner's registration is the same entry.
    """
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    shm = SharedMemory(name=name)
    if shm._name not in _OWNED:  # type: ignore[attr-defined]
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm
