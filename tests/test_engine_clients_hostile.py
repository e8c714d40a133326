"""The engines' HTTP clients against servers that misbehave: ``timeout_s`` bounds the whole exchange, and a body
that cannot be read is the module's :class:`EngineEndpointError` naming the endpoint, never a raw Python error.

httpx's timeouts bound each read: a server that drips its answer a byte at a time (or its headers) used to hold
``vllm_weight_checker``, ``vllm_collective_rpc``, ``sglang_request`` and ``wcviz verify`` forever, and JSON nested
100,000 deep escaped as a ``RecursionError``. Each call here runs on a thread joined with a generous bound (20 s
for ``timeout_s=1``): the assertion is that it ends, not how fast.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

import wcviz.sources._engine_http as engine_http
from wcviz._serving import serve_in_thread
from wcviz.cli import main
from wcviz.sources import EngineEndpointError, from_sglang, vllm_collective_rpc, vllm_weight_checker
from wcviz.sources._fleet import message_of
from wcviz.sources._sglang import sglang_request

ENDS_WITHIN_S = 20.0  # "it ends": far above timeout_s=1 (+ the collective_rpc grace of 5 s)
ROUTES = ("/weight_checker", "/collective_rpc", "/weights_checker")

CLIENTS: dict[str, Callable[..., Any]] = {
    "vllm_weight_checker": lambda url, **kw: vllm_weight_checker(url, "checksum", **kw),
    "vllm_collective_rpc": lambda url, **kw: vllm_collective_rpc(url, "wcviz_info", **kw),
    "sglang_request": lambda url, **kw: sglang_request(url, "checksum", **kw),
}
ROUTE_OF = {"vllm_weight_checker": "/weight_checker", "vllm_collective_rpc": "/collective_rpc", "sglang_request": "/weights_checker"}


def _ends(fn: Callable[[], Any]) -> BaseException | Any:
    """What ``fn()`` returned or raised; fails the test when it is still running after :data:`ENDS_WITHIN_S`."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(ENDS_WITHIN_S)
    assert not t.is_alive(), f"still blocked after {ENDS_WITHIN_S} s: the timeout does not bound the whole request"
    return box[0]


async def _drip(request: Any) -> StreamingResponse:
    """A JSON answer that starts at once, then comes one byte every 0.2 s for a minute."""

    async def body() -> Any:
        yield b'{"checksums": {}'
        for _ in range(300):
            await asyncio.sleep(0.2)
            yield b" "
        yield b"}"

    return StreamingResponse(body(), media_type="application/json")


@pytest.fixture(scope="module")
def dripping() -> Iterator[str]:
    routes = [Route(p, _drip, methods=["POST"]) for p in ROUTES]
    app = Starlette(routes=[*routes, Route("/get_world_size", lambda r: JSONResponse({"world_size": 1}))])
    server, thread, url = serve_in_thread(app, "127.0.0.1", 0, name="dripping engine")
    yield url
    server.should_exit = server.force_exit = True  # its streams are still dripping: no graceful wait
    thread.join(10)


@pytest.fixture()
def dripping_headers() -> Iterator[str]:
    """A server that reads the request, then sends its status line and headers one byte every 0.2 s."""
    stop = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)

    def serve() -> None:
        conns = []
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            conns.append(conn)
            conn.recv(65536)
            threading.Thread(target=drip, args=(conn,), daemon=True).start()
        for c in conns:
            c.close()

    def drip(conn: socket.socket) -> None:
        head = b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 4000
        for byte in head:
            if stop.wait(0.2):
                return
            try:
                conn.sendall(bytes([byte]))
            except OSError:
                return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(5)
    listener.close()


@pytest.mark.parametrize("client", list(CLIENTS))
def test_a_dripping_answer_ends_at_the_deadline_as_unreachable(dripping: str, client: str) -> None:
    got = _ends(lambda: CLIENTS[client](dripping, timeout_s=1))
    assert isinstance(got, EngineEndpointError), got
    assert got.kind == "unreachable" and f"{dripping}{ROUTE_OF[client]}" in str(got) and "no whole answer" in str(got), str(got)


@pytest.mark.parametrize("client", list(CLIENTS))
def test_dripping_headers_end_at_the_deadline_too(dripping_headers: str, client: str) -> None:
    got = _ends(lambda: CLIENTS[client](dripping_headers, timeout_s=1))
    assert isinstance(got, EngineEndpointError) and got.kind == "unreachable", got
    assert f"{dripping_headers}{ROUTE_OF[client]}" in str(got)


def test_from_sglang_reports_a_dripping_engine_as_an_unreachable_row(dripping: str) -> None:
    res = _ends(lambda: from_sglang(dripping, timeout_s=1))
    assert not isinstance(res, BaseException), res
    assert not res.complete and list(res.failed["kind"]) == ["unreachable"], res.failed


def test_a_dripping_answer_ends_inside_a_running_event_loop(dripping: str) -> None:
    """A Jupyter cell runs inside an event loop: the blocking clients must still end there."""

    async def cell() -> BaseException | Any:
        return _ends(lambda: vllm_weight_checker(dripping, "checksum", timeout_s=1))

    got = asyncio.run(cell())
    assert isinstance(got, EngineEndpointError) and got.kind == "unreachable", got


def test_verify_with_timeout_ends_against_a_dripping_engine(dripping: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from wcviz.sim.model import ModelConfig, build_state_dict, save_checkpoint

    cfg = ModelConfig(vocab=64, hidden=16, layers=1, heads=2, kv_heads=2, intermediate=32)
    ck = save_checkpoint(build_state_dict(cfg), tmp_path / "ck", shards=1, config=cfg)
    rc = _ends(lambda: main(["verify", dripping, "--checkpoint", str(ck), "--tp", "1", "--engine", "vllm", "--timeout", "1"]))
    assert rc == 1, rc
    assert "no whole answer within 1.0 s" in capsys.readouterr().out


def _answering(body: bytes, status: int = 200) -> httpx.MockTransport:
    return httpx.MockTransport(lambda r: httpx.Response(status, content=body, headers={"content-type": "application/json"}))


DEEP = {
    "past the parser": b"[" * 100_000 + b"]" * 100_000,  # json.loads: RecursionError
    "parsed, too deep to print": b"[" * 900 + b"]" * 900,  # json.loads takes it; str() of it is a RecursionError
    "in an object": b'{"checksums": {}, "status": "x", "success": true, "message": "", "results": ' + b"[" * 900 + b"]" * 900 + b"}",
}


@pytest.mark.parametrize("body", list(DEEP))
@pytest.mark.parametrize("client", list(CLIENTS))
def test_deep_json_is_an_endpoint_error_naming_the_endpoint(client: str, body: str) -> None:
    with pytest.raises(EngineEndpointError) as info:
        CLIENTS[client]("http://engine:8000", transport=_answering(DEEP[body]), timeout_s=5)
    assert info.value.kind == "failed" and f"http://engine:8000{ROUTE_OF[client]}" in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("client", list(CLIENTS))
def test_an_error_answer_with_deep_json_still_says_its_status(client: str) -> None:
    for body in (DEEP["past the parser"], b'{"error": ' + b"[" * 900 + b"]" * 900 + b"}"):
        with pytest.raises(EngineEndpointError, match="HTTP 500"):
            CLIENTS[client]("http://engine:8000", transport=_answering(body, 500), timeout_s=5)


def test_message_of_never_raises_for_the_body() -> None:
    for body in (b"[" * 100_000, b'{"error": ' + b"[" * 900 + b"]" * 900 + b"}", b'{"detail": 1' + b"1" * 5000 + b"}", b"\xff\xfe"):
        said = message_of(httpx.Response(500, content=body))
        assert isinstance(said, str) and said, body[:20]


@pytest.mark.parametrize("client", list(CLIENTS))
def test_an_answer_past_the_size_cap_is_refused_naming_the_endpoint(client: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_http, "MAX_ANSWER_BYTES", 1000)
    body = b'{"checksums": {}, "status": "x", "success": true, "message": "' + b"x" * 5000 + b'", "results": []}'
    with pytest.raises(EngineEndpointError, match="more than 1,000 bytes") as info:
        CLIENTS[client]("http://engine:8000", transport=_answering(body), timeout_s=5)
    assert f"http://engine:8000{ROUTE_OF[client]}" in str(info.value)


def test_answers_under_the_caps_read_as_before() -> None:
    """The whole-exchange reader keeps the answer: status, charset and JSON (SGLang's 400 with success false)."""
    sg = {"success": False, "message": "café", "ranks": []}
    ok, data = sglang_request("http://sg", "compare", transport=httpx.MockTransport(lambda r: httpx.Response(400, json=sg)), timeout_s=5)
    assert ok is False and data == sg
    latin_1 = {"content-type": "text/plain; charset=latin-1"}
    latin = httpx.MockTransport(lambda r: httpx.Response(500, content="é".encode("latin-1"), headers=latin_1))
    with pytest.raises(EngineEndpointError, match="HTTP 500: é"):
        vllm_weight_checker("http://v", "checksum", transport=latin, timeout_s=5)
    assert vllm_collective_rpc("http://v", "m", transport=_answering(b'{"results": [1, {"a": [2]}]}'), timeout_s=5) == [1, {"a": [2]}]


@pytest.mark.parametrize("token", ["TOPSECRET-KEY\n", " TOPSECRET-KEY", "TOPSECRET-KÉY"])
def test_an_engine_key_no_header_can_carry_is_refused_before_anything_is_sent_and_never_echoed(token: str) -> None:
    """A key read from a mounted secret (a trailing newline) went into the header; the client's error quoted the
    header, key and all, and the CLI printed it."""
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json={})

    transport = httpx.MockTransport(handler)
    calls: list[Callable[[], Any]] = [
        lambda: vllm_weight_checker("http://engine:8000", "checksum", token=token, transport=transport),
        lambda: sglang_request("http://engine:30000", "checksum", token=token, transport=transport),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"token \(the engine's API key\)") as info:
            call()
        assert "TOPSECRET" not in str(info.value)
    assert sent == []
