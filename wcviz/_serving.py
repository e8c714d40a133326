"""Serving on a background thread, and the agent's HTTP connections bounded: a connection cap and a header deadline.

:func:`serve_in_thread` / :func:`stop_server` run any ASGI app (an agent, the simulated
engines' checkers) on its own event loop in a daemon thread. The rest of this module is
the agent's guard:

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
  request is never dropped), or, if every one is busy, is itself closed at once;
- aborts a connection whose client stops reading: a response it has not taken
  (bytes left in the write buffer, none taken for ``_STALL_S``, 10 s) would
  otherwise hold its slot forever, since a plain close waits for them to drain.

So a client that sends a request promptly is served even while others hold the rest.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["guarded_protocol", "serve_in_thread", "stop_server"]

_STALL_S = 10.0  # a client that takes none of a response for this long has stopped reading: its slot is freed
_IDLE_JOIN_S = 0.2  # how long a stopping server waits for its idle workers to exit (a busy one is not waited for)


def serve_in_thread(
    app: Any, host: str, port: int, *, name: str, timeout_s: float = 10.0, **config: Any
) -> tuple[Any, threading.Thread, str]:
    """``(server, thread, base URL)`` once ``app`` accepts connections on ``host:port`` (0: any free port).

    ``config``: more ``uvicorn.Config`` options. Raises RuntimeError naming ``name`` when
    the server cannot bind or does not start within ``timeout_s``.
    """
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off", **config))
    failure: list[BaseException] = []

    prefix = f"{name}-work-{id(server):x}"

    def serve() -> None:
        # A fresh loop in this thread; uvicorn installs signal handlers only on the main thread.
        loop = asyncio.new_event_loop()
        executor = ThreadPoolExecutor(thread_name_prefix=prefix)  # the requests' blocking work (run_in_executor)
        loop.set_default_executor(executor)
        try:
            loop.run_until_complete(server.serve())
        except BaseException as e:  # noqa: BLE001 - includes uvicorn's SystemExit on bind failure
            failure.append(e)
        finally:  # never waits for work a request started (a digest of the host's weights, a holder blocked on the
            # host's lock): cancelled requests are let go of, idle workers joined, a busy one left to end on its own
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=0.5))
            executor.shutdown(wait=False, cancel_futures=True)
            loop.close()
            deadline = time.monotonic() + _IDLE_JOIN_S
            for worker in [t for t in threading.enumerate() if t.name.startswith(prefix)]:
                worker.join(max(0.0, deadline - time.monotonic()))

    thread = threading.Thread(target=serve, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive():
            why = f"{type(failure[0]).__name__}: {failure[0]}" if failure else "server thread exited"
            raise RuntimeError(f"{name} failed to start on {host}:{port} ({why})")
        if time.monotonic() > deadline:
            server.should_exit = True
            thread.join(timeout=5)
            raise RuntimeError(f"{name} did not start on {host}:{port} within {timeout_s} s")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    return server, thread, f"http://{shown}:{bound[1]}"


def stop_server(server: Any, thread: threading.Thread, what: str, timeout_s: float = 10.0) -> None:
    """Shut a server from :func:`serve_in_thread` down and join its thread (forcing it after ``timeout_s``)."""
    server.should_exit = True
    thread.join(timeout=timeout_s)
    if thread.is_alive():
        server.force_exit = True
        thread.join(timeout=timeout_s)
        if thread.is_alive():
            raise RuntimeError(f"{what} did not stop within {2 * timeout_s} s")


def guarded_protocol(max_connections: int, header_timeout_s: float) -> type[Any]:
    """An h11 protocol class for ``uvicorn.Config(http=...)`` with the limits in the module docstring."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    stall_s = _STALL_S

    class GuardedH11Protocol(H11Protocol):  # type: ignore[misc]
        _wc_refused = False
        _wc_since = 0.0
        _wc_timer: Any = None
        _wc_watch: Any = None
        _wc_unread = -1  # bytes left in the write buffer at the last look (-1: no look yet)
        _wc_drained = False  # the buffer drained below its low-water mark since the last look: the client reads

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            if len(self.connections) >= max_connections and not self._wc_make_room():
                self._wc_refused = True  # every connection is serving a request: this one waits its turn elsewhere
                self.transport = transport
                transport.close()
                return
            super().connection_made(transport)
            self._wc_arm()
            self._wc_watch = self.loop.call_later(stall_s, self._wc_check_reading)

        def _wc_make_room(self) -> bool:
            mine = [c for c in self.connections if isinstance(c, GuardedH11Protocol)]
            stuck = [c for c in mine if c._wc_stuck()]
            if stuck:  # closing, but its client never took the last response: it holds a slot until aborted
                stuck[0].transport.abort()
                return True
            waiting = [c for c in mine if c._wc_waiting()]
            if not waiting:
                return False
            min(waiting, key=lambda c: c._wc_since).transport.close()
            return True

        def _wc_unsent(self) -> int:
            try:
                return int(self.transport.get_write_buffer_size()) if self.transport is not None else 0
            except Exception:  # noqa: BLE001 - a transport that cannot say: assume it drains
                return 0

        def _wc_stuck(self) -> bool:
            """Closed by the server (a timeout) but its unsent response keeps it open: the client is not reading."""
            return self.transport is not None and self.transport.is_closing() and self._wc_unsent() > 0

        def _wc_check_reading(self) -> None:
            """Every ``stall_s``: abort if bytes wait to be sent and the client took none since the last look."""
            self._wc_watch = None
            if self.transport is None:
                return
            unsent = self._wc_unsent()
            if unsent and 0 <= self._wc_unread <= unsent and not self._wc_drained:
                self.transport.abort()  # a slow reader takes some; one that takes nothing holds the slot for good
                return
            self._wc_unread, self._wc_drained = unsent, False
            self._wc_watch = self.loop.call_later(stall_s, self._wc_check_reading)

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

        def resume_writing(self) -> None:
            self._wc_drained = True
            super().resume_writing()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._wc_waiting():
                self._wc_arm()

        def connection_lost(self, exc: Exception | None) -> None:
            for timer in (self._wc_timer, self._wc_watch):
                if timer is not None:
                    timer.cancel()
            self._wc_timer = self._wc_watch = None
            if self._wc_refused:
                return
            super().connection_lost(exc)

    return GuardedH11Protocol
