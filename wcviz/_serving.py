"""The agent's HTTP connections, bounded: a cap on open connections and a deadline for request headers.

uvicorn (checked against 0.54's ``uvicorn.protocols.http.h11_impl.H11Protocol``;
the attributes used here - ``connections``, ``cycle``, ``transport``, ``loop`` and
``on_response_complete`` - are unchanged since 0.29) keeps a connection open for as
long as its client wants while the request headers are incomplete, and counts
connections only when a request arrives. 1,100 clients that never finish their
headers then hold 1,100 file descriptors of the process the agent lives in (an
engine!) until its own file writes fail. This protocol:

- gives every connection ``header_timeout_s`` to finish its request headers, from
  when it opens or its last response ended; then closes it;
- keeps at most ``max_connections`` open: a new connection beyond the cap closes the
  one that has waited longest without sending a request (a connection serving a
  request is never dropped), or, if every one is busy, is itself closed at once.

So a client that sends a request promptly is served even while others hold the rest.
"""

from __future__ import annotations

from typing import Any

__all__ = ["guarded_protocol"]


def guarded_protocol(max_connections: int, header_timeout_s: float) -> type[Any]:
    """An h11 protocol class for ``uvicorn.Config(http=...)`` with the limits in the module docstring."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):  # type: ignore[misc]
        _wc_refused = False
        _wc_since = 0.0
        _wc_timer: Any = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            if len(self.connections) >= max_connections and not self._wc_make_room():
                self._wc_refused = True  # every connection is serving a request: this one waits its turn elsewhere
                self.transport = transport
                transport.close()
                return
            super().connection_made(transport)
            self._wc_arm()

        def _wc_make_room(self) -> bool:
            waiting = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and c._wc_waiting()]
            if not waiting:
                return False
            min(waiting, key=lambda c: c._wc_since).transport.close()
            return True

        def _wc_waiting(self) -> bool:
            """Open, and not in the middle of a request: headers not yet complete, or idle after a response."""
            if self.transport is None or self.transport.is_closing():
                return False
            return self.cycle is None or self.cycle.response_complete

        def _wc_arm(self) -> None:
            self._wc_since = self.loop.time()
            if self._wc_timer is not None:
                self._wc_timer.cancel()
            self._wc_timer = self.loop.call_later(header_timeout_s, self._wc_expire)

        def _wc_expire(self) -> None:
            self._wc_timer = None
            if self._wc_waiting() and self.loop.time() - self._wc_since >= header_timeout_s * 0.99:
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._wc_waiting():
                self._wc_arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._wc_timer is not None:
                self._wc_timer.cancel()
                self._wc_timer = None
            if self._wc_refused:
                return
            super().connection_lost(exc)

    return GuardedH11Protocol
