"""The engine's end of the colocated refit (:class:`IPCReceiver`); the protocol is :mod:`wcviz.refit.ipc`'s."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import zmq

from wcviz.digest import DigestAccumulator
from wcviz.refit._beside import Beside, settle
from wcviz.refit._control import ControlSocket, WireLog
from wcviz.refit._packing import Meta, fingerprint, unpack, walk
from wcviz.refit._packing import metadata as declared_metadata
from wcviz.refit._shm import AttachedBuffer, BufferHandle, HandleError
from wcviz.refit._transport import Transport
from wcviz.refit.config import DEFAULT_TIMEOUT_S, check_timeout
from wcviz.refit.faults import FaultPlan, as_like, check_one_receiver, shifted
from wcviz.refit.verify import RefitProtocolError

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["IPCReceiver"]

SENDER, WIRE, RECEIVER = "sender_after_digest", "wire", "receiver_before_load"
_REPLY_LINGER_MS = 500  # the receiver's last reply must leave even if it closes at once; bounded, never a hang

LoadWeights = Callable[[list[tuple[str, torch.Tensor]]], None]


def _describe(name: str, meta: Meta) -> str:
    return f"{name} {Meta(*meta).describe()}"


def _sync(buf: torch.Tensor) -> None:
    """Wait for the queued copies into (or reads of) ``buf``: the peer works on another CUDA stream."""
    if buf.is_cuda:
        torch.cuda.current_stream(buf.device).synchronize()


def _add_all(acc: DigestAccumulator, named: list[tuple[str, torch.Tensor]]) -> None:
    """Digest each tensor, the host ones in one batched call (a name that comes twice is the accumulator's
    error, naming it)."""
    acc.add_many(named)


@dataclass
class _Stream:
    """The receiver's state for one stream."""

    acc: DigestAccumulator | None
    metadata: dict[str, Meta]  # what the receiver declared in this stream's prepare: every batch is sliced with it
    fingerprint: str  # fingerprint(metadata): COMPLETE checks the receiver still declares it
    held: dict[str, torch.Tensor] = field(default_factory=dict)  # swap_params: the first of a pair, until its partner
    loaded: bool = False  # load_weights was called in this stream: the model may hold part of it


class IPCReceiver(Transport):
    """The engine's end: answers :class:`IPCSender`, slices each batch with its own metadata, hands it to ``load_weights``.

    ``metadata`` is ``{name: (shape, dtype)}`` for what its model expects;
    ``load_weights`` gets a list of ``(name, tensor)`` views into the shared
    buffer, valid only during the call (copy them: the sender reuses the buffer; a
    ``load_weights`` that keeps one is answered with an error, and the memory stays
    mapped while the kept views live). With verification on, the
    receiver digests every view it loads, before loading it, and returns the
    digests in the final ack. ``overlap=True`` (CPU buffers) digests on a worker
    thread while ``load_weights`` reads the same views (``_beside``): only for a
    ``load_weights`` that never writes into its inputs.
    """

    def __init__(
        self,
        address: str,
        metadata: Mapping[str, tuple[Iterable[int], Any]],
        load_weights: LoadWeights,
        *,
        verify: Any = "off",
        faults: FaultPlan | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        wire_log: WireLog | None = None,
        overlap: bool = False,
    ) -> None:
        super().__init__(verify)
        self.timeout_s = check_timeout(timeout_s)
        self.overlap = overlap
        self._beside = Beside()
        self.address = address
        self.metadata: dict[str, Meta] = declared_metadata(metadata)
        self.load_weights = load_weights
        self.faults = check_one_receiver(faults)
        self._partners: dict[str, str] = {}
        for f in self.faults.at(RECEIVER, kind="swap_params"):
            a, b = f.params
            self._partners.update({a: b, b: a})
        self._buffers: dict[str, AttachedBuffer] = {}
        self._sock: ControlSocket | None = ControlSocket(
            zmq.REP, address, bind=False, timeout_s=self.timeout_s, linger_ms=_REPLY_LINGER_MS, wire_log=wire_log
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Let go of every attached buffer and close the socket. Idempotent."""
        self._beside.close()
        self._release()
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def serve(self) -> dict[str, str] | None:
        """Answer requests until one stream completes; the digests sent back (None when not verifying).

        Waits at most ``timeout_s`` for each request. The stream must begin with a
        prepare (a batch or COMPLETE before one is refused): it is where the sender
        learns what this receiver declares. A batch it refuses or
        cannot load is answered with an error, then raised here: the stream is
        over and the model may hold part of it. So is a sender's ``abort`` (it
        failed after a batch went out): :class:`RefitProtocolError` naming its
        cause. Call again for the next refit.
        """
        if self._sock is None:
            raise RefitProtocolError(f"receiver at {self.address} is closed")
        sock = self._sock
        stream: _Stream | None = None  # until this serve's prepare
        try:
            while True:
                try:
                    msg = sock.recv("the next request")
                except RefitProtocolError as e:  # a message that is not one: it still gets its (error) reply
                    sock.send({"op": "ack", "ok": False, "error": str(e)}, "an error reply")
                    raise
                op = msg.get("op")
                if op == "prepare":  # also where a sender starts over after a failed stream
                    self._release()
                    stream = None
                    try:
                        declared = self._declared_now()
                        stream = _Stream(DigestAccumulator() if self.verifying else None, declared, fingerprint(declared))
                    except BaseException as e:  # a REP socket owes a reply, even to a Ctrl-C: unanswered, it could
                        sock.send({"op": "ack", "ok": False, "error": str(e) or repr(e)}, "an error reply")  # never serve again
                        raise
                    if msg.get("known") == stream.fingerprint:
                        sock.send({"op": "info", "unchanged": True}, "the reply to prepare")
                    else:
                        sock.send({"op": "info", "metadata": declared}, "the reply to prepare")
                elif op in ("batch", "complete"):
                    try:
                        if stream is None:
                            raise RefitProtocolError(
                                f"{op} before prepare from the sender at {self.address}: every refit stream begins "
                                "with prepare, so the sender checks against what this receiver declares now"
                            )
                        reply = self._batch(msg, stream) if op == "batch" else self._complete(stream)
                    except BaseException as e:  # the sender learns at once (a REP socket owes a reply, even to a
                        # Ctrl-C inside load_weights: unanswered, it could never serve again); then it is raised here
                        sock.send({"op": "ack", "ok": False, "error": str(e) or repr(e)}, "an error reply")
                        raise
                    sock.send(reply, "the ack" if op == "batch" else "the final ack")
                    if op == "complete":
                        return reply.get("digests")
                elif op == "abort":  # the sender refused its own input or failed after prepare: nothing more comes
                    sock.send({"op": "ack", "ok": True}, "the reply to the abort notice")
                    why = str(msg.get("error") or "no reason given")[:2000]
                    held = "this model may hold part of it" if stream is not None and stream.loaded else "nothing was loaded"
                    raise RefitProtocolError(f"the sender at {self.address} aborted the refit ({why}); {held}")
                else:
                    error = RefitProtocolError(f"unknown request {op!r} from the sender at {self.address}")
                    sock.send({"op": "ack", "ok": False, "error": str(error)}, "an error reply")
                    raise error
        finally:
            self._release()

    def _batch(self, msg: dict[str, Any], stream: _Stream) -> dict[str, Any]:
        """Check the batch against this receiver's metadata, slice it, apply faults, digest, load; the ack."""
        names, used = msg.get("names"), msg.get("used")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise RefitProtocolError(f"malformed batch from the sender: names {str(names)[:120]}, used {used!r}")
        if not isinstance(used, int) or isinstance(used, bool) or used < 0:
            raise RefitProtocolError(f"malformed batch from the sender: names {str(names)[:120]}, used {used!r}")
        try:
            handle = msg.get("buffer")
            if not isinstance(handle, BufferHandle):
                handle = BufferHandle.from_wire(handle)
        except HandleError as e:
            raise RefitProtocolError(f"the sender at {self.address} sent a bad buffer handle: {e}") from None
        unknown = [n for n in names if n not in stream.metadata]
        if unknown:
            raise RefitProtocolError(f"batch names parameters this receiver does not have: {', '.join(unknown)}")
        entries, end = walk(names, stream.metadata)
        if end != used:
            raise RefitProtocolError(
                f"batch does not add up: by this receiver's metadata its parameters end at byte {end}, the sender "
                f"says {used}; the batch holds {', '.join(_describe(n, m) for n, _, m in entries)}"
            )
        if used > handle.nbytes:
            raise RefitProtocolError(f"batch claims {used} bytes of a {handle.nbytes}-byte buffer")
        buf = self._attach(handle)
        try:
            assert buf.tensor is not None
            views = self._faulted([(n, unpack(buf.tensor, off, m)) for n, off, m in entries], stream)
            loaded = [n for n, _ in views]
            job = None
            if stream.acc is not None and self.overlap and not buf.tensor.is_cuda:
                job = self._beside.submit(_add_all, stream.acc, list(views))  # its own list: load_weights may consume it
            elif stream.acc is not None:
                _add_all(stream.acc, views)
            try:
                if views:
                    stream.loaded = True
                    self.load_weights(views)
            finally:
                if job is not None:  # it reads the buffer: done before the buffer is freed or acknowledged
                    settle([job], raise_errors=False)
            if job is not None:
                failure, job = job.exception(), None  # no reference cycle through this frame: the failure's
                if failure is not None:  # traceback holds the views, which keep the buffer mapped until it goes
                    try:
                        raise failure
                    finally:
                        failure = None
            _sync(buf.tensor)  # the sender may overwrite the buffer once we ack
            del views  # this receiver's references: what still uses the buffer now, the loader kept
            kept = buf.views_alive()
            if kept:
                raise RefitProtocolError(
                    f"the engine's load_weights kept views of the staging buffer after it returned ({kept} still use its memory; its "
                    f"batch: {', '.join(loaded[:5])}{', ...' if len(loaded) > 5 else ''}): the sender reuses the "
                    "buffer, so what they hold would change under them; copy what you keep (t.clone()). This "
                    "refit is not verified"
                )
        finally:
            if handle.transient:
                buf.close()
        return {"op": "ack", "ok": True}

    def _faulted(self, views: list[tuple[str, torch.Tensor]], stream: _Stream) -> list[tuple[str, torch.Tensor]]:
        """The views as the receiver_before_load faults leave them (swap_params may hold one back a batch or more)."""
        out = []
        for name, t in views:
            altered = self.faults.alter(RECEIVER, name, t)
            if altered is None:
                continue
            shift = sum(f.shift for f in self.faults.at(RECEIVER, name, kind="shift_offset"))
            if shift:
                altered = shifted(altered, shift)
            partner = self._partners.get(name)
            if partner is None:
                out.append((name, altered))
            elif partner not in stream.held:
                stream.held[name] = altered.clone()  # the buffer will be reused; wait for the partner
            else:
                theirs = stream.held.pop(partner)
                out += [(partner, as_like(altered, theirs)), (name, as_like(theirs, altered))]
        return out

    def _declared_now(self) -> dict[str, Meta]:
        """What this receiver declares now, in its exact form (``self.metadata`` may have been reassigned, in any
        spelling); a RefitProtocolError naming it when it is not metadata."""
        try:
            return declared_metadata(self.metadata)
        except Exception as e:  # noqa: BLE001 -- a reassigned metadata that does not parse: the sender hears why
            raise RefitProtocolError(f"the receiver at {self.address} declares metadata that does not parse: {e}") from None

    def _complete(self, stream: _Stream) -> dict[str, Any]:
        """Load anything still held back; the final ack, with the digests when verifying (one host sync per device).

        Refused if this receiver's metadata changed during the stream: its batches were sliced, and the
        sender checks, against what it declared at the stream's prepare, not what it declares now."""
        try:
            now = fingerprint(self._declared_now())
        except RefitProtocolError:
            now = None
        if now != stream.fingerprint:
            raise RefitProtocolError(
                f"the receiver at {self.address} changed its metadata during the refit (after its prepare): what it "
                "loaded was sliced by the old metadata and cannot be checked against the new; refit again"
            )
        if stream.held:
            held = list(stream.held.items())
            if stream.acc is not None:
                for name, t in held:
                    stream.acc.add(name, t)
            self.load_weights(held)
        if stream.acc is None:
            return {"op": "ack", "ok": True}
        return {"op": "ack", "ok": True, "digests": dict(stream.acc.hex())}

    def _attach(self, handle: BufferHandle) -> AttachedBuffer:
        """The buffer behind ``handle``: staging buffers are attached once per stream, temporary ones per batch."""
        if handle.key in self._buffers:
            return self._buffers[handle.key]
        try:
            buf = AttachedBuffer(handle)
        except FileNotFoundError:
            raise RefitProtocolError(
                f"the batch's buffer {handle.key} no longer exists: the sender freed it (did it fail?)"
            ) from None
        if not handle.transient:
            self._buffers[handle.key] = buf
        return buf

    def _release(self) -> None:
        while self._buffers:
            self._buffers.popitem()[1].close()
