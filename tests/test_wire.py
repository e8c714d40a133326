"""The two forms of ``/v1/digests`` (rows, and columns when asked for): one table either way, either side older.

An agent answers columns only when ``Accept`` names the columns media type; a client reads
both. Each bad columns body fails its own rank, named, and no other.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pandas as pd
import pytest
import torch

from wcviz.agent import Agent
from wcviz.frame import COLUMNS
from wcviz.sources import COLUMNS_MEDIA_TYPE, fetch, from_named_tensors, named_tensor_rows, named_tensor_table
from wcviz.sim.model import TINY_MOE, build_state_dict, step
from wcviz.sources._wire import RankTable, WireError, table_of_body


def _weights(seed: int) -> dict[str, torch.Tensor]:
    """The simulator's tiny MoE model, a training step per seed: each rank holds other values."""
    return step(build_state_dict(TINY_MOE), seed)


N = len(build_state_dict(TINY_MOE))


def _get(agent: Agent, headers: dict[str, str] | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=agent.app), base_url="http://agent") as c:
            return await c.get("/v1/digests", headers=headers)

    return asyncio.run(go())


def _untimed(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.drop(columns="seconds")  # what digesting cost differs call to call


def test_agent_answers_columns_only_when_asked_and_both_forms_hold_one_table() -> None:
    agent = Agent(lambda: _weights(0), role="engine", rank=3, dp=1, pp=0, tp=1, host="node7")
    plain = _get(agent)  # an older client: no Accept of ours
    assert plain.headers["content-type"].startswith("application/json") and set(plain.json()) == {"rows"}
    asked = _get(agent, {"accept": f"{COLUMNS_MEDIA_TYPE}, application/json;q=0.5"})
    assert asked.headers["content-type"].startswith(COLUMNS_MEDIA_TYPE)
    body = asked.json()
    assert body["format"] == "columns" and body["count"] == N
    assert body["same"] == {"role": "engine", "rank": 3, "dp": 1, "pp": 0, "tp": 1, "ep": None, "host": "node7", "phase": "current"}
    assert all(len(v) == N for v in body["columns"].values())
    rows, cols = table_of_body(plain.json()), table_of_body(body)
    assert [{k: v for k, v in r.items() if k != "seconds"} for r in rows.rows()] == [
        {k: v for k, v in r.items() if k != "seconds"} for r in cols.rows()
    ]
    want = from_named_tensors(_weights(0), role="engine", rank=3, dp=1, pp=0, tp=1, host="node7")
    got = pd.DataFrame(cols.rows())
    assert got["digest"].tolist() == want["digest"].tolist() and got["name"].tolist() == want["name"].tolist()


def test_named_tensor_rows_are_the_table_as_rows() -> None:
    w = _weights(1)
    table = named_tensor_table(w, role="trainer", rank=0)
    rows = named_tensor_rows(w, role="trainer", rank=0)
    assert [r["digest"] for r in rows] == table.columns["digest"]
    assert list(rows[0]) == ["name", "digest", "algo", "dtype", "shape", "nbytes", "device", "seconds", "role", "rank", "phase"]


def _fleet(n: int = 3) -> list[Agent]:
    return [Agent(lambda r=r: _weights(r), role="engine", rank=r, tp=r, pp=0, host="h") for r in range(n)]


def _route(agents: list[Agent], rewrite: Callable[[int, httpx.Request, httpx.Response], httpx.Response] | None = None, seen: list | None = None) -> httpx.MockTransport:
    """Each ``http://rN`` served by agent N in process; ``rewrite`` may change an answer of /v1/digests."""
    transports = [httpx.ASGITransport(app=a.app) for a in agents]

    async def handler(request: httpx.Request) -> httpx.Response:
        i = int(request.url.host[1:])
        resp = await transports[i].handle_async_request(request)
        if request.url.path == "/v1/digests":
            await resp.aread()
            if seen is not None:
                seen.append((request.headers.get("accept"), resp.headers.get("content-type")))
            if rewrite is not None:
                return rewrite(i, request, resp)
        return resp

    return httpx.MockTransport(handler)


def _urls(n: int = 3) -> list[str]:
    return [f"http://r{i}" for i in range(n)]


def test_fetch_asks_for_columns_and_reads_an_older_agent_that_answers_rows() -> None:
    agents = _fleet()
    seen: list[tuple[Any, Any]] = []
    new = fetch(_urls(), transport=_route(agents, seen=seen))
    assert new.complete and len(new.frame) == 3 * N
    assert len(seen) == 3 and all(COLUMNS_MEDIA_TYPE in accept and ctype.startswith(COLUMNS_MEDIA_TYPE) for accept, ctype in seen)

    def older(i: int, request: httpx.Request, resp: httpx.Response) -> httpx.Response:  # ignores Accept: rows, always
        if i != 1:
            return resp
        rows = table_of_body(resp.json()).rows()
        return httpx.Response(200, json={"rows": rows})

    mixed = fetch(_urls(), transport=_route(agents, older))
    assert mixed.complete
    assert list(mixed.frame.columns) == [*COLUMNS, "url"]
    pd.testing.assert_frame_equal(_untimed(mixed.frame), _untimed(new.frame))
    assert mixed.frame["rank"].tolist() == [0] * N + [1] * N + [2] * N  # identity order, not arrival
    assert mixed.frame.groupby("url")["rank"].unique().map(list).to_dict() == {f"http://r{r}": [r] for r in range(3)}


def _a_billion_rows_of_nothing(body: dict[str, Any]) -> None:
    """A count that no list backs: every value 'the same for every row' (the client must not build it)."""
    columns = body.pop("columns")
    body.update(count=10**9, columns={}, same={**body["same"], **{k: v[0] for k, v in columns.items()}})


@pytest.mark.parametrize(
    "spoil, why",
    [
        (lambda b: b.update(count=b["count"] + 1), f"column 'name' with {N} values for {N + 1} rows"),
        (lambda b: b.update(count=True), "count is True"),
        (lambda b: b.update(count=-1), "count is -1"),
        (lambda b: b["columns"].update(colour=["red"] * N), "unknown column(s) colour"),
        (lambda b: b["columns"].update(host=["h"] * N), "column(s) host both per row and once"),
        (lambda b: b["columns"].update(digest="0" * 32), f"column 'digest' with a str for {N} rows"),
        (lambda b: b["same"].update(step=[1, 2]), "column 'step' for every row as a list"),
        (lambda b: b.update(columns=[]), "'columns' or 'same' is not an object"),
        (lambda b: b.update(format="arrow"), "unknown format 'arrow'"),
        (_a_billion_rows_of_nothing, "columns table of 1000000000 rows without a list of names and a list of digests"),
        (lambda b: b["same"].update(tp=5), "rows claim tp=5 but the rank's info says tp=1"),
        (lambda b: (b["same"].pop("rank"), b["columns"].update(rank=[1] * (N - 1) + [9])), "rows claim rank=9 but the rank's info says rank=1"),
        (lambda b: b["columns"]["nbytes"].__setitem__(2, "lots"), "column 'nbytes' holds 'lots' in row 2, not a number"),
        (lambda b: b["columns"]["digest"].__setitem__(0, "error"), "row 0 ('model.embed_tokens.weight')"),
    ],
)
def test_a_bad_columns_table_fails_its_own_rank_naming_why(spoil: Callable[[dict[str, Any]], Any], why: str) -> None:
    agents = _fleet()

    def bad(i: int, request: httpx.Request, resp: httpx.Response) -> httpx.Response:
        if i != 1:
            return resp
        body = json.loads(resp.content)
        spoil(body)
        return httpx.Response(200, json=body)

    result = fetch(_urls(), transport=_route(agents, bad))
    assert not result.complete and result.answered == 2
    assert result.failed[["url", "kind", "rank"]].values.tolist() == [["http://r1", "failed", 1]]
    assert why in result.errors["http://r1"], result.errors
    assert result.errors["http://r1"].startswith("/v1/digests"), result.errors
    assert set(result.frame["rank"]) == {0, 2} and len(result.frame) == 2 * N  # the others are whole


def test_wire_tables_round_trip_and_refuse_what_is_not_a_table() -> None:
    t = RankTable(2, {"name": ["a", "b"], "digest": ["0" * 32, "1" * 32]}, {"algo": "nemo-rl-v3", "rank": 0})
    assert table_of_body(json.loads(json.dumps(t.body()))) == t
    assert table_of_body({"rows": t.rows()}).rows() == t.rows()
    assert RankTable(2, {}, {"rank": 0}).rows() == [{"rank": 0}, {"rank": 0}]
    for body, why in (([], "did not answer {'rows'"), ({"rows": [1]}, "list of row dicts"), ({"rows": [{"x": 1}]}, "unknown column(s) x")):
        with pytest.raises(WireError, match=why.replace("(", r"\(").replace(")", r"\)")):
            table_of_body(body)


def test_a_rank_listing_a_name_under_two_phases_in_one_answer_fails_that_rank() -> None:
    """Duplicates were keyed by (url, name, phase): an answer listing 'a' twice, once as 'snapshot', with its info
    counting 2 parameters, passed as complete while 'b' was never listed."""
    digest = "0" * 32
    same = {"algo": "nemo-rl-v3", "role": "engine", "rank": 0, "dp": None, "pp": None, "tp": 0, "ep": None, "host": "h", "phase": "current"}
    info = {"role": "engine", "rank": 0, "dp": None, "pp": None, "tp": 0, "ep": None, "host": "h", "params": 2}
    body = {"rows": [{**same, "name": "a", "digest": digest}, {**same, "name": "a", "digest": digest, "phase": "snapshot"}]}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=info if request.url.path == "/v1/info" else body)

    res = fetch(["http://a:1"], transport=httpx.MockTransport(handler), retries=0)
    assert not res.complete and len(res.frame) == 0
    assert res.failed["kind"].tolist() == ["failed"] and "lists parameter 'a' more than once" in res.errors["http://a:1"]
