"""Colocated refit: trainer and engine share a machine, and the weights cross in shared staging buffers.

The path NeMo-RL, veRL and vLLM take when trainer and engine are colocated.
Bytes move through buffers both processes map (POSIX shared memory on the CPU,
CUDA IPC on a GPU; see :mod:`wcviz.refit._shm`); a ZMQ socket over ``ipc://``
carries small control messages as JSON objects (never pickles: a peer's message is
data, checked field by field, and cannot run code here). The sender binds a REQ socket,
the receiver connects a REP socket: every request gets exactly one reply, and
every wait is bounded by ``timeout_s`` (a silent peer is :class:`RefitTimeout`).

Wire protocol, sender -> receiver, then the reply::

    {"op": "prepare"}
        -> {"op": "info", "metadata": {name: (shape, dtype)}}      what the receiver's model expects
    {"op": "prepare", "known": sha256}                             the fingerprint of the metadata the sender holds
        -> {"op": "info", "unchanged": True}                       the receiver still declares exactly that
        -> {"op": "info", "metadata": {name: (shape, dtype)}}      it declares something else now
    {"op": "batch", "buffer": BufferHandle, "names": [...], "used": nbytes}
        -> {"op": "ack", "ok": True}
        -> {"op": "ack", "ok": False, "error": "..."}              batch refused or failed; nothing more follows
    {"op": "complete"}
        -> {"op": "ack", "ok": True}                               receiver not verifying
        -> {"op": "ack", "ok": True, "digests": {name: hex}}       receiver verifying

Every stream begins with ``prepare``, and the receiver refuses a batch or COMPLETE
that no prepare of the same :meth:`IPCReceiver.serve` preceded: the sender always
checks against what the receiver declares *now* (a restarted engine at the same
address, with another model, is never checked against the old one's metadata).
The metadata itself travels only when it changed (:func:`fingerprint`: SHA-256 of
names, shapes and dtypes). A batch names the parameters packed into
a buffer, each at a 512-byte-aligned offset, and the aligned end of the last
one (``used``); the receiver recomputes the offsets from *its own* metadata and
refuses a batch whose end does not add up. Batches alternate between two
staging buffers, so the sender packs batch k+1 while the receiver loads batch k;
a parameter larger than half a staging buffer travels alone in a temporary one.
With verification off the messages are exactly the above without ``digests``,
and neither end digests anything.

Addresses are ``ipc://`` paths in a private directory only (owned by this user,
writable by no one else; the default is a fresh ``mkdtemp``): another user's process
can neither bind the path first nor connect to it. ``tcp://``, abstract sockets
(``ipc://@name``) and shared directories such as ``/tmp`` itself are refused.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import zmq

from wcviz.digest import DigestAccumulator
from wcviz.refit._beside import Beside, settle
from wcviz.refit._control import ControlSocket, WireLog, check_address, checked_digests, checked_metadata, refused
from wcviz.refit._ipc_receiver import SENDER, WIRE, IPCReceiver, _sync
from wcviz.refit._packing import Bucket, Meta, fingerprint, framing_problems, nbytes, pack, plan, sendable
from wcviz.refit._shm import OwnedBuffer
from wcviz.refit._transport import Transport
from wcviz.refit.config import DEFAULT_BUFFER_BYTES, DEFAULT_TIMEOUT_S, check_buffer_bytes, check_timeout
from wcviz.refit.faults import FaultPlan, check_buffers, check_one_receiver, check_plan, pack_shifted, swap_named
from wcviz.refit.verify import RefitProtocolError, RefitResult, RefitTimeout, expected_names, verify_digests

if TYPE_CHECKING:
    from concurrent.futures import Future

    from typing_extensions import Self

__all__ = ["DEFAULT_BUFFER_BYTES", "DEFAULT_TIMEOUT_S", "IPCReceiver", "IPCSender", "check_address"]

_ABORT_WAIT_S = 5.0  # how long a failed send waits for the receiver to take its abort notice



class IPCSender(Transport):
    """The trainer's end: packs named tensors into shared staging buffers and streams them to an :class:`IPCReceiver`.

    ``address`` is an ``ipc://`` endpoint to bind; by default one in a private
    temporary directory (``.address`` says which, for the receiver). Use as a
    context manager, or call :meth:`close`. With verification on and every tensor
    on the CPU, ``overlap=True`` digests on a worker thread, on one core, while
    this thread packs (``_beside``); by default each bucket is digested on this
    thread with every core numba has (BENCHMARKS.md, issue 16 part 7: on 2 cores
    neither is faster). ``keep_buffers`` (the default) keeps the two CPU staging
    buffers from one send to the next, so a refit does not fault in and zero
    ``2 * buffer_bytes`` of fresh shared memory each time (off: 0.36-0.42 s -> 0.22-0.32 s
    per GiB on 2 cores); they are freed by :meth:`close`, after a send that failed,
    and when a send needs another size. CUDA staging buffers are freed after each send.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        verify: Any = "off",
        faults: FaultPlan | None = None,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        device: torch.device | str | None = None,
        wire_log: WireLog | None = None,
        overlap: bool = False,
        keep_buffers: bool = True,
    ) -> None:
        super().__init__(verify)
        self.timeout_s = check_timeout(timeout_s)  # before anything is created: nothing to clean up
        self.faults = check_one_receiver(faults)
        self.overlap = overlap
        self.keep_buffers = keep_buffers
        self._kept: list[OwnedBuffer] = []  # the staging buffers, between sends
        self._beside = Beside()
        self.buffer_bytes = check_buffer_bytes(buffer_bytes)  # not at the first send, after prepare went out
        self.device = torch.device(device) if device is not None else None
        self.wire_log = wire_log
        self._tmpdir = tempfile.mkdtemp(prefix="wcviz_refit_") if address is None else None
        self.address = address or f"ipc://{self._tmpdir}/refit.sock"
        self.metadata: dict[str, Meta] | None = None  # the receiver's, as its last prepare said (a copy, to read)
        self._declared: dict[str, Meta] | None = None  # the same, kept here: what sends are checked against
        self._fingerprint: str | None = None  # fingerprint(self._declared)
        self._sock: ControlSocket | None = None
        self._closed = False
        self._streaming = False  # a batch of the current send went out: a failure from then on aborts the receiver's stream
        try:
            self._open_socket()  # bind now, so the receiver can connect as soon as it knows the address
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open_socket(self) -> ControlSocket:
        if self._closed:
            raise RefitProtocolError(f"sender at {self.address} is closed")
        if self._sock is None:
            self._sock = ControlSocket(
                zmq.REQ, self.address, bind=True, timeout_s=self.timeout_s, linger_ms=0, wire_log=self.wire_log
            )
        return self._sock

    def _close_socket(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
            if self.address.startswith("ipc://"):  # libzmq leaves the socket file behind
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.address.removeprefix("ipc://"))

    def close(self) -> None:
        """Close the socket and remove its file (and the temporary directory). Idempotent."""
        self._closed = True
        try:
            self._beside.close()
            self._free_staging()
            self._close_socket()
        finally:
            if self._tmpdir is not None:
                shutil.rmtree(self._tmpdir, ignore_errors=True)
                self._tmpdir = None

    def prepare(self) -> dict[str, Meta]:
        """Ask the receiver what its model expects now, ``{name: (shape, dtype)}``; every :meth:`send` does.

        The metadata travels only when it differs from what this sender already
        holds (its fingerprint goes along with the request).
        """
        sock = self._open_socket()
        known = self._fingerprint if self._declared is not None else None
        try:
            sock.send({"op": "prepare"} if known is None else {"op": "prepare", "known": known}, "the prepare request")
            reply = sock.recv("the reply to prepare")
        except BaseException:
            self._close_socket()
            raise
        if reply.get("op") == "info" and reply.get("unchanged") is True and known is not None:
            pass  # the receiver computed the same fingerprint from what it declares now
        elif reply.get("op") == "info" and isinstance(reply.get("metadata"), dict):
            self._declared = checked_metadata(reply["metadata"], self.address)
            self._fingerprint = fingerprint(self._declared)
        else:
            self.metadata = self._declared = self._fingerprint = None
            raise RefitProtocolError(f"the receiver at {self.address} answered prepare with {reply!r:.200}")
        assert self._declared is not None
        self.metadata = dict(self._declared)
        return dict(self._declared)  # copies: an edit of what was returned cannot change what sends are checked against

    def send(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        partial: bool = False,
        expected: Iterable[str] | None = None,
    ) -> RefitResult:
        """Stream ``named_tensors`` to the receiver; with verification on, compare both ends' digests.

        Every parameter the receiver declares (asked anew by :meth:`prepare` at the
        start of each send) must arrive: one that was not sent (or was lost) is
        ``missing`` and the refit is not ok; a refit that checked nothing (a receiver
        that declares no parameters) is not ok either. To update a subset on
        purpose, say so: ``partial=True`` (exactly what is sent must arrive) or
        ``expected=[names]`` (exactly those). ``log`` warns naming each parameter that
        did not arrive intact and returns the result; ``enforce`` raises
        :class:`RefitDigestMismatch`. A receiver that refuses a batch is
        :class:`RefitProtocolError`, a silent one :class:`RefitTimeout`. A fault naming a
        parameter that is not sent is a ValueError before anything is sent.
        """
        tensors = sendable(named_tensors)  # the input and the fault plan are checked before the receiver is asked
        check_plan(self.faults, tensors)  # a fault that breaks nothing would pass as if it had been tried
        wire = self._outgoing(tensors)
        buckets = plan([(n, nbytes(t)) for n, t in wire], self.buffer_bytes)
        check_buffers(self.faults, len(buckets))
        self._streaming = False
        try:
            metadata = self.prepare()  # what the receiver declares now, never what an earlier one declared (a copy)
            self._check_framing(tensors, metadata)
            want = expected_names(metadata, (n for n, _ in tensors), partial=partial, expected=expected)
            acc = DigestAccumulator() if self.verifying else None
            reply = self._stream(wire, buckets, dict(tensors), acc)
        except BaseException as e:
            if self._sock is not None and self._streaming and not isinstance(e, (RefitProtocolError, RefitTimeout)):
                # this end's own failure after a batch went out: the receiver, once done with the batch in flight
                # (its buffer still there), is told its stream is over (refused before any batch, it still waits
                # at the start of its stream for the next prepare; a refusal or a silence of its own needs no notice)
                self._abort(e)
            self._free_staging()  # a receiver that gave up mid-batch may still read them: fresh ones next time
            if self._sock is not None and self._sock.awaiting:  # a REQ socket cannot send again before its reply
                self._close_socket()
            raise
        size = sum(nbytes(t) for _, t in tensors)
        if acc is None:
            return RefitResult(self.mode, params=len(tensors), nbytes=size, expected=len(want), declared=len(metadata))
        theirs = checked_digests(reply.get("digests"), self.address)
        return verify_digests(self.mode, acc.hex(), theirs, nbytes=size, expected=want, declared=len(metadata))

    def _abort(self, error: BaseException) -> None:
        """Tell a receiver waiting for this stream's next request that the stream is over, so it raises ``error``'s
        cause at once instead of waiting out its timeout (a receiver that does not answer soon is left to it)."""
        sock = self._sock
        assert sock is not None
        wait = min(self.timeout_s, _ABORT_WAIT_S)
        try:
            if sock.awaiting:  # the ack of the batch in flight is owed first; a refusal means the stream is over there
                if refused("", self.address, sock.recv("the ack of the batch in flight", timeout_s=wait)) is not None:
                    return
            sock.send({"op": "abort", "error": f"{type(error).__name__}: {error}"[:2000]}, "the abort notice")
            sock.recv("the reply to the abort notice", timeout_s=wait)
        except Exception:  # the original error is what the caller needs; a socket in doubt is not reused
            self._close_socket()

    def _free_staging(self) -> None:
        kept, self._kept = self._kept, []
        for buf in kept:
            buf.close()

    def _check_framing(self, tensors: list[tuple[str, torch.Tensor]], metadata: Mapping[str, Meta]) -> None:
        """Refuse, before anything is sent, names the receiver lacks and byte sizes it does not expect."""
        if problems := framing_problems(tensors, metadata):
            raise RefitProtocolError(f"refit to {self.address} not started: {'; '.join(problems)}")

    def _outgoing(self, tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """What goes on the wire: each tensor as the sender-side faults leave it."""
        out = []
        for name, t in tensors:
            sent: torch.Tensor | None = self.faults.alter(SENDER, name, t)
            for f in self.faults.at(WIRE, name):
                if sent is not None and f.kind in ("drop_param", "cast_dtype"):  # a wire flip_bit strikes the buffer
                    sent = FaultPlan((f,)).alter(WIRE, name, sent)
            if sent is not None:
                out.append((name, sent))
        for f in self.faults.faults:
            if f.kind == "swap_params" and f.point in (SENDER, WIRE):
                swap_named(out, *f.params)
        return out

    def _stream(
        self,
        wire: list[tuple[str, torch.Tensor]],
        buckets: list[Bucket],
        originals: Mapping[str, torch.Tensor],
        acc: DigestAccumulator | None,
    ) -> dict[str, Any]:
        """Send every bucket, ping-ponging between two staging buffers, then COMPLETE; the final ack.

        With ``acc``, the sender digests each parameter as given (``originals``,
        before any fault) as it packs its bucket: on the worker thread while this
        one packs (CPU tensors, ``overlap``), else on this thread, queued on the
        tensor's device. Either way it overlaps the receiver's loading of the
        previous bucket.
        """
        sock = self._open_socket()
        beside = acc is not None and self.overlap and all(t.device.type == "cpu" for t in originals.values())
        jobs: list[Future[None]] = []

        def digest(names: Iterable[str]) -> None:
            if acc is not None:
                todo = [(n, originals[n]) for n in names]
                if beside:
                    jobs.append(self._beside.submit(_add_new, acc, todo))
                else:
                    _add_new(acc, todo)  # queued on the tensor's device; no host sync until acc.hex()

        tensors = dict(wire)
        device = self.device or (wire[0][1].device if wire else torch.device("cpu"))
        staging_size = max((b.used for b in buckets if not b.own), default=0)
        staging: list[OwnedBuffer] = []
        if any(b.handle.nbytes != max(staging_size, 1) or b.device != device for b in self._kept):
            self._free_staging()
        pending: tuple[int, OwnedBuffer | None] | None = None  # the batch whose ack is due, and its temporary buffer

        def acknowledged() -> None:
            nonlocal pending
            if pending is not None:
                k, temp = pending
                pending = None
                reply = sock.recv(f"the ack of batch {k}")
                if temp is not None:
                    temp.close()
                if (error := refused(f"batch {k} ({', '.join(buckets[k].names)})", self.address, reply)) is not None:
                    raise error

        with contextlib.ExitStack() as cleanup:
            cleanup.callback(lambda: settle(jobs, raise_errors=False))  # last out: nothing left reading the tensors
            for k, bucket in enumerate(buckets):
                temp = None
                if bucket.own:
                    acknowledged()  # at most one temporary buffer alive at a time
                    temp = buf = OwnedBuffer(bucket.used, device, transient=True)
                    cleanup.callback(temp.close)
                else:  # ping-pong: the buffer whose batch was acknowledged before the last one went out
                    if len(staging) < len(self._kept):
                        buf = self._kept[len(staging)]
                    elif len(staging) < 2:
                        buf = OwnedBuffer(staging_size, device)
                        self._kept.append(buf)  # freed by _free_staging: after this send, or the next
                    else:
                        buf = staging.pop(0)
                    staging.append(buf)
                assert buf.tensor is not None
                digest(bucket.names)
                self._pack(buf.tensor, bucket, tensors)
                _sync(buf.tensor)
                acknowledged()  # batch k-1 was loading while we packed and digested batch k
                if self.faults.drops_buffer(k):  # lost on the wire: its names count as sent, never arrive
                    if temp is not None:
                        temp.close()
                    continue
                self._streaming = True
                sock.send(
                    {"op": "batch", "buffer": buf.handle, "names": list(bucket.names), "used": bucket.used},
                    f"batch {k}",
                )
                pending = (k, temp)
            acknowledged()
            digest(originals)  # what never went on the wire (dropped) is still part of what was sent
            sock.send({"op": "complete"}, "COMPLETE")
            reply = sock.recv("the final ack")
            self._streaming = False  # the receiver's stream is over, whatever happens here next
            settle(jobs)  # the worker's digests, and its errors
        if not (self.keep_buffers and device.type == "cpu"):
            self._free_staging()
        if (error := refused("the end of the stream", self.address, reply)) is not None:
            raise error
        return reply

    def _pack(self, buf: torch.Tensor, bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy the bucket's tensors to their offsets; shift_offset and wire flip_bit strike here."""
        for name, offset in zip(bucket.names, bucket.offsets):
            t = tensors[name]
            shift = sum(f.shift for p in (SENDER, WIRE) for f in self.faults.at(p, name, kind="shift_offset"))
            if shift:
                pack_shifted(buf, offset, t, shift)
            else:
                pack(buf, offset, t)
            for f in self.faults.at(WIRE, name, kind="flip_bit"):
                n = nbytes(t)
                if n == 0:
                    raise ValueError(f"fault flip_bit on {name!r}: the parameter has no bytes to flip")
                i = offset + (f.bit // 8) % n
                buf[i : i + 1].bitwise_xor_(1 << (f.bit % 8))


def _add_new(acc: DigestAccumulator, named: list[tuple[str, torch.Tensor]]) -> None:
    """Digest each tensor not digested yet (the sender's last pass covers what was never packed)."""
    acc.add_many([(n, t) for n, t in named if n not in acc])
