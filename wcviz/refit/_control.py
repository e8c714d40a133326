"""The colocated refit's control channel: a ZMQ socket over ``ipc://`` in a private directory, carrying JSON.

Every wait is bounded (a silent peer is :class:`RefitTimeout`, never a hang). A
message is a JSON object, checked field by field where it is used; nothing a peer
sends is unpickled, so a peer can send data, never code. Addresses are ``ipc://``
paths in a directory that belongs to this user and that no one else may write, so
no other user's process can bind the socket first (and answer with its own
messages) or replace it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import time
from collections.abc import Mapping
from typing import Any

import zmq

from wcviz.refit._packing import Meta
from wcviz.refit._shm import BufferHandle, HandleError
from wcviz.refit.config import check_timeout
from wcviz.refit.verify import RefitProtocolError, RefitTimeout

__all__ = ["WireLog", "check_address", "checked_digests", "checked_metadata", "ControlSocket", "refused"]

WireLog = list[tuple[str, dict[str, Any]]]  # ("send" | "recv", message): every control message of one end, in order
_MAX_MESSAGE = 256 << 20  # bytes: metadata of the largest models is a few MB; anything bigger is refused by ZMQ


def check_address(address: str) -> str:
    """``address`` if it is an ``ipc://`` path in a private directory; else :class:`RefitProtocolError` saying why.

    Private: the directory exists, belongs to this user and no one else may write
    to it, so no other user's process can bind the socket first (and answer with
    its own messages) or replace it.
    """
    if not isinstance(address, str) or not address.startswith("ipc://"):
        raise RefitProtocolError(
            f"refit address {address!r} refused: only ipc:// sockets in a private directory carry the control "
            "channel (no tcp://: any local process could connect or answer first)"
        )
    path = address.removeprefix("ipc://")
    if not path or path.startswith("@") or "\0" in path:
        raise RefitProtocolError(f"refit address {address!r} refused: abstract or empty socket names are reachable by any local process")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        st = os.stat(directory)
    except OSError as e:
        raise RefitProtocolError(f"refit address {address!r} refused: its directory {directory} cannot be used ({e.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise RefitProtocolError(f"refit address {address!r} refused: {directory} is not a directory")
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RefitProtocolError(
            f"refit address {address!r} refused: {directory} is not private (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}); use a directory of this user's that no one else can write (mkdtemp), "
            "or let IPCSender choose the address"
        )
    return address


def _to_json(obj: Any) -> Any:
    """A control message as plain JSON data: handles as dicts, tuples as lists."""
    if isinstance(obj, BufferHandle):
        return obj.to_wire()
    if isinstance(obj, dict):
        return {str(k): _to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_json(v) for v in obj]
    return obj


def _encode(msg: dict[str, Any]) -> bytes:
    return json.dumps(_to_json(msg), allow_nan=False, separators=(",", ":")).encode()


def _decode(raw: bytes, peer: str, address: str) -> dict[str, Any]:
    """Parse one control message; anything that is not a JSON object (or nests absurdly deep) is a protocol error."""
    try:
        msg = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise RefitProtocolError(f"the {peer} at {address} sent a message that is not JSON ({type(e).__name__})") from None
    if not isinstance(msg, dict):
        raise RefitProtocolError(f"the {peer} at {address} sent a JSON {type(msg).__name__}, not a message object")
    if "buffer" in msg:  # a valid handle becomes one; anything else stays as sent, for the receiver to refuse by name
        with contextlib.suppress(HandleError):
            msg["buffer"] = BufferHandle.from_wire(msg["buffer"])
    return msg


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def checked_metadata(value: Any, address: str) -> dict[str, Meta]:
    """The receiver's ``{name: (shape, dtype)}`` from the wire, every field checked."""
    if not isinstance(value, dict):
        raise RefitProtocolError(f"the receiver at {address} sent metadata that is not an object: {str(value)[:200]}")
    out: dict[str, Meta] = {}
    for name, entry in value.items():
        ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list) and isinstance(entry[1], str)
        if not ok or not all(_is_int(d) and 0 <= d < 1 << 62 for d in entry[0]):
            raise RefitProtocolError(f"the receiver at {address} sent bad metadata for {name!r}: {str(entry)[:200]}")
        try:
            out[name] = Meta.parse(entry[0], entry[1])
        except ValueError:
            raise RefitProtocolError(f"the receiver at {address} declares {name!r} with unknown dtype {entry[1]!r}") from None
    return out


def checked_digests(value: Any, address: str) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise RefitProtocolError(f"the receiver at {address} sent digests that are not {{name: hex}}: {str(value)[:200]}")
    why = malformed_digest(value)
    if why is not None:
        raise RefitProtocolError(f"the receiver at {address} sent {why}")
    return value


def malformed_digest(digests: Mapping[str, str], algo: str | None = None) -> str | None:
    """What is wrong with the first value of a receiver's ``{name: hex}`` that is not a digest of ``algo``
    (default: the refit's, "nemo-rl-v3"), or None."""
    from wcviz.digest import DEFAULT_ALGO, digest_format_error

    algo = DEFAULT_ALGO if algo is None else algo
    for name, value in digests.items():
        why = digest_format_error(algo, value)
        if why is not None:
            return f"a digest for {name!r} that is not one: {why}"
    return None


class ControlSocket:
    """A ZMQ socket whose every wait is bounded: a dead or hung peer is RefitTimeout, never a hang.

    A REQ socket correlates replies with requests (``ZMQ_REQ_CORRELATE``): a late
    reply to a request this end gave up on (a timeout) is dropped, never taken as
    the reply to the next request.
    """

    def __init__(
        self, kind: int, address: str, *, bind: bool, timeout_s: float, linger_ms: int, wire_log: WireLog | None
    ):
        self.address = check_address(address)
        self.timeout_s = check_timeout(timeout_s)
        self._timeout_ms = max(1, math.ceil(self.timeout_s * 1000))
        self.awaiting = False  # a request went out and its reply has not come back
        self._peer = "receiver" if kind == zmq.REQ else "sender"
        self._linger_ms = linger_ms
        self._wire_log = wire_log
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(kind)
        self._sock.setsockopt(zmq.LINGER, linger_ms)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE)
        if kind == zmq.REQ:
            self._sock.setsockopt(zmq.REQ_CORRELATE, 1)
            self._sock.setsockopt(zmq.REQ_RELAXED, 1)  # required with REQ_CORRELATE; a new request drops the old
        try:
            if bind:
                self._sock.bind(address)
            else:
                self._sock.connect(address)
        except BaseException:
            self.close()
            raise

    def send(self, msg: dict[str, Any], what: str) -> None:
        if not self._sock.poll(self._timeout_ms, zmq.POLLOUT):
            raise RefitTimeout(
                f"timed out after {self.timeout_s:g}s sending {what}: no {self._peer} connected at {self.address}"
            )
        self._sock.send(_encode(msg), zmq.NOBLOCK)
        self.awaiting = self._peer == "receiver"
        if self._wire_log is not None:
            self._wire_log.append(("send", msg))

    def recv(self, what: str, timeout_s: float | None = None) -> dict[str, Any]:
        """The next message; ``timeout_s`` (default: the socket's) bounds the wait."""
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + (self._timeout_ms / 1000 if timeout_s is None else timeout_s)
        while True:
            left_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(left_ms, zmq.POLLIN):
                raise RefitTimeout(
                    f"timed out after {wait_s:g}s waiting for {what} from the {self._peer} at {self.address} "
                    f"(is it alive?)"
                )
            try:
                raw = self._sock.recv(zmq.NOBLOCK)
                break
            except zmq.Again:  # readable, then nothing: a late reply to a request given up on, which the REQ
                continue  # socket drops (ZMQ_REQ_CORRELATE); wait on for this request's own reply
        self.awaiting = False
        msg = _decode(raw, self._peer, self.address)
        if self._wire_log is not None:
            self._wire_log.append(("recv", msg))
        return msg

    def close(self) -> None:
        """Close the socket and its context; waits at most the linger for a last reply to leave."""
        self._sock.close(self._linger_ms)
        self._ctx.term()


def refused(what: str, address: str, reply: dict[str, Any]) -> RefitProtocolError | None:
    if reply.get("op") == "ack" and reply.get("ok") is True:
        return None
    error = reply.get("error") or f"unexpected reply {reply!r:.200}"
    return RefitProtocolError(f"the receiver at {address} refused {what}: {error}")


