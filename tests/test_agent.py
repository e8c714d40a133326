"""The per-rank HTTP agent and its client: live digests, refusals as JSON, rank identity from /v1/info."""

from __future__ import annotations

import asyncio
import random
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pandas as pd
import pytest
import torch

from wcviz.agent import Agent
from wcviz.frame import COLUMNS, validate
from wcviz.sources import FetchResult, fetch, fetch_agents, from_named_tensors

TOKEN = "s3cret"


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=g),
        "model.norm.weight": torch.ones(4),
    }


def _request(app: Any, method: str, path: str, **kw: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


# ---- in-process (ASGITransport) ------------------------------------------------------------


def test_info_reports_identity_and_live_param_count() -> None:
    weights = _weights()
    agent = Agent(lambda: weights, role="engine", rank=3, dp=1, pp=0, tp=1, host="node7")
    r = _request(agent.app, "GET", "/v1/info")
    assert r.status_code == 200
    assert r.json() == {
        "role": "engine", "rank": 3, "dp": 1, "pp": 0, "tp": 1, "ep": None, "host": "node7", "device": "cpu",
        "algo": "nemo-rl-v3", "params": 4, "mutations_allowed": False, "api": "v1",
    }
    weights["extra"] = torch.zeros(2)  # the agent reads the holder on every request
    assert _request(agent.app, "GET", "/v1/info").json()["params"] == 5


@pytest.mark.parametrize("algo", ["nemo-rl-v3", "sha256"])
def test_digest_rows_equal_from_named_tensors(algo: str) -> None:
    weights = _weights()
    agent = Agent(lambda: weights, role="engine", rank=2, tp=1, pp=0, host="h", algo=algo)
    r = _request(agent.app, "GET", "/v1/digests")
    assert r.status_code == 200
    got = validate(pd.DataFrame.from_records(r.json()["rows"]))
    want = from_named_tensors(weights, algo=algo, role="engine", rank=2, tp=1, pp=0, host="h")
    assert list(got.columns) == list(COLUMNS)
    cols = [c for c in COLUMNS if c != "seconds"]  # digest time differs run to run
    pd.testing.assert_frame_equal(got[cols], want[cols])
    assert got["digest"].str.len().eq(32 if algo == "nemo-rl-v3" else 64).all()
    assert (got["seconds"] >= 0).all()


def test_name_filter_and_bad_requests_are_json_4xx() -> None:
    agent = Agent(_weights, role="engine", rank=0)
    rows = _request(agent.app, "GET", "/v1/digests", params={"name": r"layers\.0\."}).json()["rows"]
    assert sorted(r["name"] for r in rows) == ["model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight"]
    for method, path, params, status in [
        ("GET", "/v1/digests", {"name": "(unclosed"}, 400),
        ("GET", "/v1/digests", {"nmae": "x"}, 400),
        ("GET", "/v1/info", {"verbose": "1"}, 400),
        ("GET", "/v1/nope", {}, 404),
        ("GET", "/", {}, 404),
        ("POST", "/v1/digests", {}, 405),
        ("DELETE", "/v1/info", {}, 405),
        ("GET", "/v1/reset", {}, 405),
    ]:
        r = _request(agent.app, method, path, params=params)
        assert r.status_code == status, (method, path, params, r.text)
        assert r.headers["content-type"] == "application/json"
        assert isinstance(r.json()["error"], str) and r.json()["error"]


def test_holder_raising_is_500_json_and_agent_keeps_serving() -> None:
    broken = {"on": True}

    def holder() -> dict[str, torch.Tensor]:
        if broken["on"]:
            raise RuntimeError("rank lost its weights")
        return _weights()

    agent = Agent(holder, role="trainer", rank=1)
    for path in ("/v1/digests", "/v1/info"):
        r = _request(agent.app, "GET", path)
        assert r.status_code == 500
        assert r.json() == {"error": "RuntimeError: rank lost its weights"}
    broken["on"] = False
    assert len(_request(agent.app, "GET", "/v1/digests").json()["rows"]) == 4


def test_undigestable_tensor_is_500_naming_it() -> None:
    agent = Agent(lambda: {"w": torch.empty(2, device="meta")}, role="engine", rank=0)
    r = _request(agent.app, "GET", "/v1/digests")
    assert r.status_code == 500 and "DigestError" in r.json()["error"]


def test_mutations_need_opt_in_and_token() -> None:
    calls: list[str] = []
    disabled = Agent(_weights, role="engine", rank=0, token=TOKEN, reset=lambda: calls.append("reset"))
    r = _request(disabled.app, "POST", "/v1/reset", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 403 and "mutations are disabled" in r.json()["error"]

    agent = Agent(
        _weights, role="engine", rank=0, token=TOKEN, allow_mutations=True,
        snapshot=lambda: calls.append("snapshot"), reset=lambda: calls.append("reset"),
    )
    assert _request(agent.app, "GET", "/v1/info").json()["mutations_allowed"] is True
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"}):
        r = _request(agent.app, "POST", "/v1/reset", headers=headers)
        assert r.status_code == 401, headers
        assert "token" in r.json()["error"]
    assert calls == []
    r = _request(agent.app, "POST", "/v1/reset", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.json()["ok"] is True and r.json()["action"] == "reset"
    assert calls == ["reset"]
    r = _request(agent.app, "POST", "/v1/reload", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 501 and "reload" in r.json()["error"]
    assert calls == ["reset"]


def test_mutation_callable_raising_is_500() -> None:
    def boom() -> None:
        raise OSError("disk gone")

    agent = Agent(_weights, role="engine", rank=0, token=TOKEN, allow_mutations=True, snapshot=boom)
    r = _request(agent.app, "POST", "/v1/snapshot", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 500 and r.json() == {"error": "OSError: disk gone"}


def test_constructor_checks() -> None:
    with pytest.raises(ValueError, match="needs a token"):
        Agent(_weights, role="engine", rank=0, allow_mutations=True)
    with pytest.raises(ValueError, match="unknown algo"):
        Agent(_weights, role="engine", rank=0, algo="md5")
    with pytest.raises(TypeError, match="holder must be a callable"):
        Agent(_weights(), role="engine", rank=0)  # type: ignore[arg-type]


def test_fetch_in_process_and_inside_a_running_loop() -> None:
    agent = Agent(_weights, role="engine", rank=5, tp=1)
    result = fetch(["http://agent"], transport=httpx.ASGITransport(app=agent.app))
    assert result.complete and result.summary == "1 of 1 ranks answered"
    assert set(result.frame["rank"]) == {5} and len(result.frame) == 4
    assert list(result.frame.columns) == [*COLUMNS, "url"]

    async def inside() -> None:  # a Jupyter kernel: the blocking call runs on a helper thread's loop
        in_loop = fetch(["http://agent"], transport=httpx.ASGITransport(app=agent.app))
        pd.testing.assert_frame_equal(in_loop.frame.drop(columns="seconds"), result.frame.drop(columns="seconds"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=agent.app)) as client:
            with pytest.raises(RuntimeError, match="await fetch_agents"):  # its client belongs to this loop
                fetch(["http://agent"], client=client)
            awaited = await fetch_agents("http://agent/", client=client)
            assert not client.is_closed  # a client given is the caller's to close
        assert awaited.complete and awaited.urls == ("http://agent",)
        pd.testing.assert_frame_equal(awaited.frame.drop(columns="seconds"), result.frame.drop(columns="seconds"))

    asyncio.run(inside())


def test_fetch_reports_a_failing_rank_with_its_identity() -> None:
    def holder() -> dict[str, torch.Tensor]:
        raise RuntimeError("oom")

    agent = Agent(holder, role="engine", rank=0)
    app = agent.app
    transport = httpx.ASGITransport(app=app)

    async def info_only(request: httpx.Request) -> httpx.Response:  # info answers, digests fail
        if request.url.path == "/v1/info":
            return httpx.Response(200, json={"role": "engine", "rank": 0, "tp": 2, "params": 1})
        return await transport.handle_async_request(request)

    result = fetch(["http://agent"], transport=httpx.MockTransport(info_only), retries=1, timeout_s=2)
    assert not result.complete and result.frame.empty
    assert list(result.failed["url"]) == ["http://agent"]
    row = result.failed.iloc[0]
    assert (row["kind"], row["rank"], row["tp"]) == ("failed", 0, 2)
    assert "HTTP 500" in row["error"] and "oom" in row["error"]
    assert result.summary.startswith("0 of 1 ranks answered; 1 failed: http://agent (HTTP 500")


def test_fetch_rejects_rows_that_contradict_info() -> None:
    liar = Agent(_weights, role="engine", rank=1)
    transport = httpx.ASGITransport(app=liar.app)

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/info":
            return httpx.Response(200, json={"role": "engine", "rank": 2, "params": 4})
        return await transport.handle_async_request(request)

    result = fetch(["http://liar"], transport=httpx.MockTransport(handler))
    assert not result.complete and "rank" in result.errors["http://liar"]


# ---- real servers on loopback --------------------------------------------------------------


@pytest.fixture
def cluster() -> Iterator[tuple[list[Agent], list[dict[str, torch.Tensor]]]]:
    """Four engine ranks on 127.0.0.1: rank = pp * 2 + tp, each with its own weights."""
    held = [_weights(seed=r) for r in range(4)]
    agents = [Agent(lambda w=w: w, role="engine", rank=r, pp=r // 2, tp=r % 2, host="local") for r, w in enumerate(held)]
    for a in agents:
        a.start()
    try:
        yield agents, held
    finally:
        for a in agents:
            a.stop()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fetch_real_servers_identity_from_info_not_url_order(cluster: tuple[list[Agent], list[dict]]) -> None:
    agents, held = cluster
    urls = [a.url for a in agents]
    assert all(u.startswith("http://127.0.0.1:") for u in urls)
    expected = pd.concat(
        [from_named_tensors(w, role="engine", rank=r, pp=r // 2, tp=r % 2, host="local") for r, w in enumerate(held)]
    )
    want = {(int(r.rank), int(r.pp), int(r.tp), r.name): r.digest for r in expected.itertuples()}
    rng = random.Random(7)
    for _ in range(2):
        shuffled = urls[:]
        rng.shuffle(shuffled)
        result = fetch(shuffled, timeout_s=5)
        assert result.complete and result.errors == {} and result.failed.empty
        assert result.summary == "4 of 4 ranks answered"
        got = {(int(r.rank), int(r.pp), int(r.tp), r.name): r.digest for r in result.frame.itertuples()}
        assert got == want
        assert list(result.frame["rank"].drop_duplicates()) == [0, 1, 2, 3]  # ordered by identity, not by URL
        by_url = result.frame.groupby("url")["rank"].unique().to_dict()
        assert {u: list(v) for u, v in by_url.items()} == {a.url: [a.rank] for a in agents}


def test_fetch_reports_unreachable_rank_without_dropping_it(cluster: tuple[list[Agent], list[dict]]) -> None:
    agents, _ = cluster
    dead = f"http://127.0.0.1:{_closed_port()}"
    urls = [agents[0].url, dead, agents[1].url, agents[2].url]
    result = fetch(urls, timeout_s=2, retries=1)
    assert isinstance(result, FetchResult)
    assert not result.complete and result.answered == 3
    assert set(result.frame["url"]) == {agents[0].url, agents[1].url, agents[2].url}
    assert list(result.failed["url"]) == [dead] and result.failed["kind"].tolist() == ["unreachable"]
    assert result.failed["rank"].isna().all()  # info never came: no identity is made up
    assert "ConnectError" in result.errors[dead]
    assert result.summary.startswith(f"3 of 4 ranks answered; 1 unreachable: {dead} (ConnectError")


def test_changed_weight_shows_on_exactly_that_rank(cluster: tuple[list[Agent], list[dict]]) -> None:
    agents, held = cluster
    urls = [a.url for a in agents]
    before = fetch(urls, timeout_s=5).frame.set_index(["rank", "name"])["digest"]
    held[2]["model.layers.0.mlp.up_proj.weight"][0, 0] += 1.0
    after = fetch(urls, timeout_s=5).frame.set_index(["rank", "name"])["digest"]
    changed = before[before != after]
    assert list(changed.index) == [(2, "model.layers.0.mlp.up_proj.weight")]


def test_duplicate_rank_claims_fail_both(cluster: tuple[list[Agent], list[dict]]) -> None:
    agents, held = cluster
    twin = Agent(lambda: held[1], role="engine", rank=1, pp=0, tp=1, host="local")
    with twin:
        twin_url = twin.url
        result = fetch([agents[0].url, agents[1].url, twin_url], timeout_s=5)
    assert not result.complete and result.answered == 1
    assert set(result.failed["url"]) == {agents[1].url, twin_url}
    assert set(result.frame["url"]) == {agents[0].url}
    assert "claims the same rank" in result.errors[twin_url]


def test_stop_frees_port_and_joins_thread() -> None:
    before = set(threading.enumerate())
    agent = Agent(_weights, role="engine", rank=0)
    url = agent.start()
    port = int(url.rsplit(":", 1)[1])
    assert httpx.get(f"{url}/v1/digests", timeout=5).status_code == 200  # digest work ran in a worker thread
    assert agent.running
    agent.stop()
    agent.stop()  # idempotent
    assert not agent.running and agent.url is None
    # (the digest kernel's helpers live as long as the process, whoever started them: not the agent's)
    leftover = [t for t in set(threading.enumerate()) - before if t.is_alive() and t.name != "tqdm_monitor" and not t.name.startswith("wcviz-digest-")]
    assert leftover == []
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", port))
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/v1/info", timeout=1)
    with Agent(_weights, role="engine", rank=0) as again:  # an agent can start again after another stopped
        assert httpx.get(f"{again.url}/v1/info", timeout=5).json()["rank"] == 0
    assert not again.running


def test_start_on_busy_port_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match="failed to start"):
            Agent(_weights, role="engine", rank=0).start(port=port)


def test_fetch_times_out_a_hanging_rank() -> None:
    import time

    def slow() -> dict[str, torch.Tensor]:
        time.sleep(0.5)
        return _weights()

    agent = Agent(slow, role="engine", rank=0)
    t0 = time.perf_counter()
    result = fetch(["http://slow"], transport=httpx.ASGITransport(app=agent.app), timeout_s=0.1, retries=1)
    assert time.perf_counter() - t0 < 2.0
    assert not result.complete and result.failed["kind"].tolist() == ["unreachable"]
    assert "timed out after 0.1 s" in result.errors["http://slow"]


# ---- the agent lives inside an engine: nothing a request carries may hurt the host ---------


def _in_thread(fn: Any, timeout_s: float = 60.0) -> Any:
    """Run ``fn`` in a thread and give up waiting after a generous bound: a hang fails, it never blocks the suite."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"still running after {timeout_s} s"
    return out[0]


def test_a_catastrophic_name_pattern_cannot_freeze_the_host() -> None:
    """``^(\\w+\\.?)+\\.$`` backtracks exponentially in Python's re on a long name (and holds the GIL)."""
    weights = {("a" * 40) + str(i): torch.zeros(1) for i in range(3)}  # re would need ~2^40 steps per name
    agent = Agent(lambda: weights, role="engine", rank=0)
    r = _in_thread(lambda: _request(agent.app, "GET", "/v1/digests", params={"name": r"^(\w+\.?)+\.$"}))
    assert r.status_code == 200 and r.json() == {"rows": []}
    hit = _request(agent.app, "GET", "/v1/digests", params={"name": r"^a+\d$"}).json()["rows"]
    assert len(hit) == 3


@pytest.mark.parametrize(
    ("pattern", "why"),
    [(r"(a)\1", "invalid escape"), (r"(?=a)", "missing argument to repetition operator|invalid perl operator"),
     ("([", "missing ]"), ("a" * 513, "the limit is 512")],
)  # fmt: skip
def test_name_patterns_that_could_backtrack_or_are_too_long_are_400(pattern: str, why: str) -> None:
    agent = Agent(_weights, role="engine", rank=0)
    r = _request(agent.app, "GET", "/v1/digests", params={"name": pattern})
    assert r.status_code == 400 and re.search(why, r.json()["error"]), r.json()


def test_a_query_parameter_given_twice_is_400_not_the_last_one() -> None:
    """``?name=^x$&name=`` used the last value: a filter that chose one parameter answered all of them."""
    agent = Agent(_weights, role="engine", rank=0)
    r = _request(agent.app, "GET", "/v1/digests", params=[("name", r"layers\.0\."), ("name", "")])
    assert r.status_code == 400 and r.json()["error"] == "query parameter(s) name given more than once; give each once"
    assert len(_request(agent.app, "GET", "/v1/digests", params={"name": r"layers\.0\."}).json()["rows"]) == 2


def test_a_served_agent_answers_only_its_own_host_names() -> None:
    """DNS rebinding: a web page reaches the agent under the attacker's name; the Host header gives it away."""
    with Agent(_weights, role="engine", rank=0, allowed_hosts=["node7.cluster"]) as agent:
        assert agent.url is not None
        port = agent.url.rsplit(":", 1)[1]
        for host in ("evil.example.com", f"evil.example.com:{port}", "127.0.0.1.evil.example", "", "[::1"):
            r = httpx.get(f"{agent.url}/v1/info", headers={"Host": host}, timeout=5)
            assert r.status_code == 421 and "not served here" in r.json()["error"], host
            assert httpx.get(f"{agent.url}/v1/digests", headers={"Host": host}, timeout=5).status_code == 421
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", "node7.cluster", f"node7.cluster:{port}"):
            assert httpx.get(f"{agent.url}/v1/info", headers={"Host": host}, timeout=5).status_code == 200, host
    with pytest.raises(TypeError, match="not one string"):
        Agent(_weights, role="engine", rank=0, allowed_hosts="node7")  # type: ignore[arg-type]


def test_clients_that_never_finish_their_headers_cannot_lock_out_a_real_one() -> None:
    with Agent(_weights, role="engine", rank=0, max_connections=16, header_timeout_s=1.0) as agent:
        assert agent.url is not None and agent._server is not None
        port = int(agent.url.rsplit(":", 1)[1])
        slow = []
        try:
            for _ in range(300):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"GET /v1/info HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
                slow.append(s)
            r = httpx.get(f"{agent.url}/v1/info", timeout=10)
            assert r.status_code == 200 and r.json()["rank"] == 0
            open_now = len(agent._server.server_state.connections)
            assert open_now <= 16 + 1, f"{open_now} connections held open"
            deadline = time.monotonic() + 30  # the header deadline closes what is left
            while agent._server.server_state.connections and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not agent._server.server_state.connections
        finally:
            for s in slow:
                s.close()
        assert httpx.get(f"{agent.url}/v1/info", timeout=10).status_code == 200


# ---- an empty rank is no pass ----------------------------------------------------------------


def test_a_rank_holding_nothing_makes_the_fetch_incomplete_and_is_named() -> None:
    full, empty = Agent(_weights, role="engine", rank=0, tp=0), Agent(dict, role="engine", rank=1, tp=1)
    with full, empty:
        assert full.url is not None and empty.url is not None
        result = fetch([full.url, empty.url], timeout_s=5)
        assert not result.complete and result.answered == 2
        assert result.failed[["url", "kind", "rank", "tp"]].values.tolist() == [[empty.url, "empty", 1, 1]]
        assert "1 empty" in result.summary and empty.url in result.summary and "holds no parameters" in result.summary
        assert set(result.frame["rank"]) == {0}
        # a name filter that matches nothing on a rank that holds weights is not an empty rank
        filtered = fetch([full.url], name="^nothing-matches$", timeout_s=5)
        assert filtered.complete and len(filtered.frame) == 0


def test_one_element_strided_views_are_served_like_their_copies() -> None:
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    held = {"a": w[::2][:1], "b": w.t()[:1, :1], "c": w.reshape(-1)[::3][2:3]}
    agent = Agent(lambda: held, role="engine", rank=0)
    r = _request(agent.app, "GET", "/v1/digests")
    assert r.status_code == 200, r.text
    got = {row["name"]: row["digest"] for row in r.json()["rows"]}
    copies = from_named_tensors({n: t.clone() for n, t in held.items()}, progress=False)
    assert got == dict(zip(copies["name"], copies["digest"]))


def _read_response(s: socket.socket, pause_s: float = 0.0, chunk: int = 1 << 20) -> bytes:
    """One HTTP/1.1 response's body from a raw socket (Content-Length framed), read ``chunk`` bytes at a time."""
    data = b""
    while b"\r\n\r\n" not in data:
        got = s.recv(chunk)
        assert got, "the connection closed before the headers"
        data += got
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        time.sleep(pause_s)
        got = s.recv(chunk)
        assert got, f"the connection closed after {len(body)} of {length} bytes"
        body += got
    return body


def test_clients_that_stop_reading_lose_their_slots_and_a_slow_reader_is_still_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that asks for a large /v1/digests and never reads it kept its slot forever (a close waits for the
    reply to drain): with the cap reached, real clients were refused and stop() had to force its way out."""
    import wcviz._serving

    monkeypatch.setattr(wcviz._serving, "_STALL_S", 1.0)  # (10 s in service)
    params = {f"model.layers.{i}.w": torch.full((4,), float(i)) for i in range(20000)}  # a 5.6 MB reply
    agent = Agent(lambda: params, role="engine", rank=0, max_connections=4, header_timeout_s=0.5)
    url = agent.start()
    host, port = url.split("//")[1].rsplit(":", 1)
    stuck: list[socket.socket] = []
    try:
        full = httpx.get(url + "/v1/digests", timeout=60).content
        assert len(full) > 5_000_000  # larger than the kernel's socket buffers: the reply cannot all leave unread
        for _ in range(4):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((host, int(port)))
            s.sendall(b"GET /v1/digests HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            stuck.append(s)
        time.sleep(6)  # the replies are written (1.2 s each); the idle, header and stall deadlines pass
        assert httpx.get(url + "/v1/info", timeout=5).status_code == 200
        with socket.create_connection((host, int(port))) as slow:
            slow.sendall(b"GET /v1/digests HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            got = _read_response(slow, pause_s=0.05, chunk=128 << 10)  # slow, but reading: never cut off
        digests = lambda body: [(r["name"], r["digest"]) for r in __import__("json").loads(body)["rows"]]  # noqa: E731
        assert digests(got) == digests(full) and len(digests(got)) == 20000
    finally:
        for s in stuck:
            s.close()
        agent.stop()


@pytest.mark.parametrize(
    ("coords", "said"),
    [({"rank": -1}, "rank=-1 is not a coordinate"), ({"rank": 0, "tp": -1}, "tp=-1 is not a coordinate"),
     ({"rank": 0, "tp": "1"}, "tp must be an integer coordinate, got '1'"), ({"rank": True}, "rank must be an integer"),
     ({"rank": 0, "tp": 1.5}, "tp must be an integer"), ({"rank": 0, "dp": True}, "dp must be an integer")],
)  # fmt: skip
def test_an_agent_refuses_coordinates_no_client_would_accept(coords: dict, said: str) -> None:
    """An identity every fetch would refuse (or, for rank=True, silently read as rank 1) is refused at construction."""
    with pytest.raises(ValueError, match=re.escape(said)):
        Agent(lambda: {}, role="engine", **coords)


def test_an_agent_takes_numpy_integer_coordinates_as_ints() -> None:
    import numpy as np

    agent = Agent(lambda: {}, role="engine", rank=np.int64(3), tp=np.int32(1))
    assert agent.rank == 3 and agent.coords["tp"] == 1 and type(agent.coords["tp"]) is int


@pytest.mark.parametrize(
    ("option", "said"),
    [({"header_timeout_s": float("nan")}, "header_timeout_s must be a finite number"), ({"header_timeout_s": "5"}, "header_timeout_s"),
     ({"max_connections": float("inf")}, "max_connections must be an integer"), ({"max_connections": 2.9}, "max_connections"),
     ({"token": "s3cret\n", "allow_mutations": True}, "whitespace")],
)  # fmt: skip
def test_an_agent_refuses_options_that_would_switch_its_guards_off(option: dict, said: str) -> None:
    """NaN left the header deadline off (and stop() hanging); a token with a newline could never be matched."""
    with pytest.raises(ValueError, match=said):
        Agent(lambda: {}, role="engine", rank=0, **option)


@pytest.mark.parametrize(
    ("url", "said"),
    [("http://127.0.0.1:8000/v1", "it has a path"), ("http://127.0.0.1:8000/?x=1", "it has a query"),
     ("http://127.0.0.1:8000#frag", "it has a fragment"), ("http://user:pw@127.0.0.1:8000", "user name or password")],
)  # fmt: skip
def test_an_agent_url_is_host_and_port_only(url: str, said: str) -> None:
    with pytest.raises(ValueError, match=said) as info:
        fetch([url], timeout_s=1, retries=0)
    assert "pw" not in str(info.value)


def test_retries_back_off_to_at_most_two_seconds() -> None:
    from wcviz.sources._fleet import backoff_s

    pauses = [backoff_s(k) for k in range(1, 40)]
    assert pauses[:3] == [0.1, 0.2, 0.4] and max(pauses) == 2.0 and sum(pauses) < 2.0 * 39


@pytest.mark.parametrize(
    "url",
    ["http://admin:hunter2@host:abc", "http://admin:hunter2@[::1", "admin:hunter2@host:8000", "https://admin:hunter2@host:99999"],
)
def test_a_url_that_does_not_parse_is_refused_without_its_password(url: str) -> None:
    """The parse failure quoted the URL as given, password and all (wcviz fetch, endstate and verify print it)."""
    from wcviz.sources._fleet import checked_url

    for kind in ("agent", "engine"):
        with pytest.raises(ValueError) as info:
            checked_url(url, kind)
        assert "hunter2" not in str(info.value) and "admin" not in str(info.value)


def test_a_request_in_flight_does_not_hold_up_the_hosts_stop() -> None:
    """One request waiting on a slow holder (a digest, the host's lock) made stop() wait 2 x timeout_s and then
    raise, leaving the serving thread running."""
    release = threading.Event()

    def slow() -> dict[str, torch.Tensor]:
        release.wait(60)
        return _weights()

    agent = Agent(slow, role="engine", rank=0)
    url = agent.start()
    answers: list[Any] = []
    client = threading.Thread(target=lambda: answers.append(httpx.get(f"{url}/v1/digests", timeout=60).status_code), daemon=True)
    client.start()
    time.sleep(0.5)  # the request is waiting on the holder
    try:
        agent.stop(timeout_s=1)  # returns: it used to raise "did not stop within 2 s"
        assert not agent.running and agent.url is None
    finally:
        release.set()
    client.join(10)
    assert answers in ([503], [])  # told the agent is stopping, or its connection closed: never a digest after stop


def test_an_action_that_ran_is_answered_ok_whatever_its_callable_returned() -> None:
    """A reset returning a nested numpy value ran, yet was answered HTTP 500: the client counted a poisoned rank as
    one whose reset failed."""
    import numpy as np

    ran: list[int] = []

    def reset() -> dict[str, Any]:
        ran.append(1)
        return {"per_dtype": {"float32": np.int64(2)}, "took": [np.float32(0.5), float("inf")], "src": object()}

    agent = Agent(_weights, role="engine", rank=0, token="t", allow_mutations=True, reset=reset)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=agent.app), base_url="http://x") as c:
            return await c.post("/v1/reset", headers={"Authorization": "Bearer t"})

    r = asyncio.run(go())
    assert ran == [1] and r.status_code == 200, r.text
    result = r.json()["result"]
    assert result["per_dtype"] == {"float32": 2} and result["took"][0] == 0.5 and result["took"][1] == "inf"
    assert result["src"].startswith("<object object at")
