"""SGLang's weight checker: the client against a loopback server with simulated ranks.

The request/response shapes are the ones wcviz assumes (see wcviz/sources/_sglang.py and
docs/engines.md); no real SGLang was available to check them against.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pandas as pd
import pytest
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from wcviz._errors import AlgorithmMismatch
from wcviz.endstate import EngineLeftPoisoned, sglang_endstate
from wcviz.sim.engine import EngineShard, LoaderFaults
from wcviz.sim.model import TINY, build_state_dict
from wcviz.sources import EngineEndpointError, from_named_tensors, from_sglang, sglang_action
from wcviz.verdicts import compare

SD = build_state_dict(TINY)


def checksum(t: torch.Tensor) -> str:
    """The simulated engine's own checksum (any byte hash will do: it is its own algorithm)."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


class SimRank:
    """One SGLang scheduler rank: its shard, its snapshot, its parallelism_info."""

    def __init__(self, tp: int, pp: int, faults: LoaderFaults | None = None) -> None:
        self.shard = EngineShard(TINY, tp, 2, pp, 2, faults=faults or LoaderFaults())
        self.shard.load_weights(SD.items())
        self.info = {"tp_rank": tp, "pp_rank": pp, "dp_rank": 0, "ep_rank": 0, "tp_size": 2, "pp_size": 2}
        self.snap: dict[str, torch.Tensor] | None = None
        self.fail: set[str] = set()

    def handle(self, action: str) -> dict[str, Any]:
        out: dict[str, Any] = {"parallelism_info": self.info, "success": True}
        if action in self.fail:
            return {**out, "success": False, "message": f"{action} exploded"}
        params = self.shard.params
        if action == "checksum":
            out["checksums"] = {n: checksum(t) for n, t in params.items()}
        elif action == "snapshot":
            self.snap = {n: t.clone() for n, t in params.items()}
        elif action == "reset_tensors":
            g = torch.Generator().manual_seed(7)
            for t in params.values():
                t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        elif action == "compare":
            assert self.snap is not None
            bad = [n for n, t in params.items() if not torch.equal(t, self.snap[n])]
            if bad:
                out.update(success=False, message=f"{len(bad)} tensors differ from the snapshot: {', '.join(bad)}")
        return out


def sim_ranks(faults: dict[tuple[int, int], LoaderFaults] | None = None) -> list[SimRank]:
    faults = faults or {}
    return [SimRank(tp, pp, faults.get((tp, pp), LoaderFaults())) for pp in range(2) for tp in range(2)]


def reload_all(ranks: list[SimRank]) -> None:
    for r in ranks:
        r.shard.load_weights(SD.items())


def weights_checker_app(ranks: list[SimRank], hide: dict[str, set[int]] | None = None, extra: list[Any] | None = None) -> Starlette:
    """``POST /weights_checker {"action"}`` -> ``{"success", "message", "results": [per rank]}``, in a
    shuffled order each call; ``hide[action]`` drops those ranks' results; ``extra`` adds results."""
    calls = {"n": 0}

    async def checker(request: Request) -> JSONResponse:
        action = (await request.json()).get("action")
        if action not in ("checksum", "snapshot", "reset_tensors", "compare"):
            return JSONResponse({"success": False, "message": f"unknown action {action}"}, status_code=400)
        calls["n"] += 1
        hidden = (hide or {}).get(action, set())
        results = [r.handle(action) for i, r in enumerate(ranks) if i not in hidden] + list(extra or [])
        k = calls["n"] % len(results)
        results = results[k:] + results[:k]
        return JSONResponse({"success": all(r.get("success", False) for r in results if isinstance(r, dict)), "message": "", "results": results})

    return Starlette(routes=[Route("/weights_checker", checker, methods=["POST"])])


@contextmanager
def serve(app: Any) -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "loopback server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def expected(ranks: list[SimRank], phase: str = "current") -> pd.DataFrame:
    rows = [
        {"name": n, "digest": checksum(t), "algo": "sglang", "role": "engine", "dp": 0, "pp": r.info["pp_rank"], "tp": r.info["tp_rank"], "ep": 0, "phase": phase}
        for r in ranks
        for n, t in r.shard.params.items()
    ]
    return _norm(pd.DataFrame(rows))


def _norm(df: pd.DataFrame) -> pd.DataFrame:
    from wcviz.frame import validate

    out = validate(df).drop(columns=["url"], errors="ignore")
    return out.sort_values(["pp", "tp", "name"]).reset_index(drop=True)


def test_checksums_become_a_table_keyed_by_parallelism_info() -> None:
    ranks = sim_ranks()
    with serve(weights_checker_app(ranks)) as url:
        res = from_sglang(url, phase="snapshot")
    assert res.complete and res.answered == 4, res.summary
    pd.testing.assert_frame_equal(_norm(res.frame), expected(ranks, "snapshot"))
    assert res.urls == tuple(f"{url} dp=0 pp={pp} tp={tp} ep=0" for pp in range(2) for tp in range(2))
    assert res.frame["rank"].isna().all() and res.frame["dtype"].isna().all()
    assert res.infos[f"{url} dp=0 pp=1 tp=0 ep=0"]["tp_size"] == 2


def test_name_filter_and_global_rank_when_given() -> None:
    ranks = sim_ranks()
    for i, r in enumerate(ranks):
        r.info = {**r.info, "rank": i}
    with serve(weights_checker_app(ranks)) as url:
        res = from_sglang(url, name=r"norm")
    assert res.complete and set(res.frame["rank"]) == {0, 1, 2, 3}
    assert res.frame["name"].str.contains("norm").all() and len(res.frame)
    assert res.urls[0] == f"{url} rank 0"


def test_failing_and_malformed_ranks_are_reported_not_dropped() -> None:
    ranks = sim_ranks()
    ranks[3].fail = {"checksum"}
    extra = [{"checksums": {"x": "ab"}}, {"parallelism_info": {"tp_rank": 5, "pp_rank": 0}, "checksums": {"x": "not-hex"}}]
    with serve(weights_checker_app(ranks, extra=extra)) as url:
        res = from_sglang(url)
    assert res.answered == 3 and not res.complete
    pd.testing.assert_frame_equal(_norm(res.frame), expected(ranks[:3]))
    f = res.failed
    assert list(zip(f["pp"], f["tp"])) == [(1, 1), (0, 5), (pd.NA, pd.NA)]  # by identity; unknown coordinates last
    assert "checksum failed on this rank: checksum exploded" in f["error"].iloc[0]
    assert "not hex" in f["error"].iloc[1] and "without parallelism_info" in f["error"].iloc[2]


def test_missing_endpoint_is_a_clear_error_and_a_down_server_is_reported() -> None:
    with serve(Starlette(routes=[])) as url:
        with pytest.raises(EngineEndpointError, match="no weight checker") as err:
            from_sglang(url)
        assert err.value.kind == "missing"
    res = from_sglang(url, timeout_s=2)  # the server has stopped
    assert list(res.failed["kind"]) == ["unreachable"] and not res.complete
    with pytest.raises(ValueError, match="choose snapshot, reset_tensors or compare"):
        sglang_action(url, "checksum")


def test_sglang_checksums_are_never_compared_with_nemo_digests() -> None:
    ranks = sim_ranks()
    with serve(weights_checker_app(ranks)) as url:
        res = from_sglang(url)
    r = ranks[0]
    ours = from_named_tensors(r.shard.params, role="engine", dp=0, pp=0, tp=0, ep=0)
    with pytest.raises(AlgorithmMismatch):
        compare(ours, res.frame[(res.frame["pp"] == 0) & (res.frame["tp"] == 0)])


def test_endstate_finds_the_rank_whose_reload_skipped_a_weight() -> None:
    ranks = sim_ranks({(1, 0): LoaderFaults(skip=r"down_proj")})
    with serve(weights_checker_app(ranks)) as url:
        result = sglang_endstate(url, lambda: reload_all(ranks))
    v = result.verdicts
    # SGLang's reset writes random values: no reset digest proves a whole parameter was overwritten,
    # so what reloads equal to its snapshot is "unproven", never "match"; the unwritten ones still stand out
    assert "match" not in set(v["status"]) and set(v["status"]) == {"unwritten", "unproven"}
    bad = v[v["status"] == "unwritten"]
    assert set(zip(bad["pp"], bad["tp"])) == {(0, 1)}
    assert sorted(bad["name"]) == ["model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    assert (v["algo"] == "sglang").all() and len(result.unreachable) == 0
    assert set(result.fetches) == {"snapshot", "reset", "reload"}
    assert result.compare is not None and list(result.compare.errors) == [f"{url} dp=0 pp=0 tp=1 ep=0"]
    assert "2 tensors differ" in result.compare.errors[f"{url} dp=0 pp=0 tp=1 ep=0"]
    assert "2 unwritten on 1 rank (dp=0 pp=0 tp=1 ep=0)" in result.summary
    assert "SGLang's compare: compare: 3 of 4 ranks acknowledged" in result.summary


def test_endstate_rank_missing_after_reload_is_unreachable() -> None:
    ranks = sim_ranks()
    state = {"reloaded": False}
    hide: dict[str, set[int]] = {}

    def reload() -> None:
        reload_all(ranks)
        hide["checksum"] = {2}  # from now on rank (pp=1, tp=0) no longer answers checksum
        state["reloaded"] = True

    with serve(weights_checker_app(ranks, hide=hide)) as url:
        result = sglang_endstate(url, reload, compare=False)
    assert state["reloaded"] and result.compare is None
    v = result.verdicts
    assert set(zip(v.loc[v["status"] == "unreachable", "pp"], v.loc[v["status"] == "unreachable", "tp"])) == {(1, 0)}
    assert (v.loc[v["status"] != "unreachable", "status"] == "unproven").all()  # random reset: nothing proven
    assert list(zip(result.unreachable["pp"], result.unreachable["tp"])) == [(1, 0)]


def test_endstate_reset_failure_reloads_then_raises_and_failed_reload_says_poisoned() -> None:
    ranks = sim_ranks()
    ranks[1].fail = {"reset_tensors"}
    reloads = []
    with serve(weights_checker_app(ranks)) as url:
        with pytest.raises(EngineEndpointError, match="reset_tensors did not complete"):
            sglang_endstate(url, lambda: reloads.append(1))
        assert reloads == [1]
        ranks[1].fail = set()

        def broken() -> None:
            raise RuntimeError("trainer gone")

        with pytest.raises(EngineLeftPoisoned, match="trainer gone"):
            sglang_endstate(url, broken)
