"""vLLM: the worker extension against a test double, over a real loopback /collective_rpc and in-process.

No vLLM here. ``SimWorker`` holds what the extension reads from a vLLM worker: a
``model_runner.model`` (an ``nn.Module`` whose parameters are an ``EngineShard``'s
tensors) and the rank attributes. The loopback server serves vLLM's dev-mode
``POST /collective_rpc`` request/response shape and dispatches to those workers.
"""

from __future__ import annotations

import inspect
import json
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pandas as pd
import pytest
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from wcviz.digest import DEFAULT_ALGO
from wcviz.endstate import classify, summary
from wcviz.integrations.vllm import WcvizWorkerExtension, worker_coords
from wcviz.sim.engine import EngineLayout, EngineShard, LoaderFaults
from wcviz.sim.model import TINY, build_state_dict
from wcviz.sources import from_named_tensors
from wcviz.sources._vllm import EngineEndpointError, from_vllm_http, from_vllm_llm, vllm_collective_rpc

LAYOUT = EngineLayout(tp=2, pp=2)
HOST = socket.gethostname()
SD = build_state_dict(TINY)


# --------------------------------------------------------------------------- the test double


def module_of(params: dict[str, torch.Tensor]) -> torch.nn.Module:
    """An ``nn.Module`` whose parameters share storage with ``params`` (dotted names become submodules)."""
    root = torch.nn.Module()
    for name, t in params.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


class SimWorker(WcvizWorkerExtension):
    """What the extension reads from a vLLM worker: ``model_runner.model``, ``device`` and the ranks."""

    def __init__(self, rank: int, faults: LoaderFaults | None = None) -> None:
        self.dp_rank, self.pp_rank, self.tp_rank = LAYOUT.coords(rank)
        self.rank, self.world_size = rank, LAYOUT.world_size
        self.shard = EngineShard(TINY, self.tp_rank, LAYOUT.tp, self.pp_rank, LAYOUT.pp, faults=faults or LoaderFaults())
        self.shard.load_weights(SD.items())
        self.model_runner = types.SimpleNamespace(model=module_of(self.shard.params))
        self.device = torch.device("cpu")

    def reload(self) -> None:
        self.shard.load_weights(SD.items())


def workers(faults: dict[int, LoaderFaults] | None = None) -> list[SimWorker]:
    faults = faults or {}
    return [SimWorker(r, faults.get(r, LoaderFaults())) for r in range(LAYOUT.world_size)]


def expected(ws: list[SimWorker], phase: str = "current") -> pd.DataFrame:
    """The digest table built straight from each shard's tensors (not through the extension)."""
    frames = [
        from_named_tensors(w.shard.params, role="engine", rank=w.rank, dp=w.dp_rank, pp=w.pp_rank, tp=w.tp_rank, host=HOST, phase=phase)
        for w in ws
    ]
    return _norm(pd.concat(frames, ignore_index=True))


def _norm(df: pd.DataFrame) -> pd.DataFrame:
    out = df.drop(columns=[c for c in ("seconds", "url") if c in df.columns])
    return out.sort_values(["rank", "name"]).reset_index(drop=True)


def dispatch(ws: list[Any], method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    return [getattr(w, method)(*args, **kwargs) for w in ws]


# --------------------------------------------------------------------------- a vLLM-shaped server


def collective_rpc_app(
    ws: list[Any], order: Callable[[int, int], list[int]] | None = None, world: tuple[int, int] | None = None
) -> Starlette:
    """vLLM's dev-mode ``POST /collective_rpc``: ``{"method", "args", "kwargs", "timeout"}`` ->
    ``{"results": [...]}``, each result a dict/list/None as is, anything else ``str()``; a
    worker raising fails the whole call with a 500 (as vLLM's executor does). ``order(call, n)``
    permutes the results of each call, to show identity never comes from list order.

    Also ``GET /get_world_size?include_dp=true|false`` -> ``{"world_size": N}`` (vLLM 0.33
    ``entrypoints/rl/online/api_router.py``, dev mode too): ``world`` is the API server's
    ``(world_size_across_dp, world_size)``, by default one replica of ``len(ws)`` ranks."""
    calls = {"n": 0}
    across, replica = world if world is not None else (len(ws), len(ws))

    def error(message: str, status: int, kind: str, param: str | None = None) -> JSONResponse:
        # vLLM 0.33 registers its own handlers (entrypoints/serve/exception_handling): every error is an
        # ErrorResponse(ErrorInfo(message, type, param, code)).model_dump()
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)

    async def world_size(request: Request) -> Response:
        raw = request.query_params.get("include_dp", "true").lower()  # pydantic's bool: its validation error is a 400
        if raw not in ("true", "false", "1", "0", "yes", "no", "on", "off", "t", "f", "y", "n"):
            said = {"type": "bool_parsing", "loc": "query.include_dp", "msg": "Input should be a valid boolean, unable to interpret input", "input": raw}
            return error(f"1 validation error:\n  {said}", 400, "Bad Request", "query.include_dp")
        return JSONResponse({"world_size": across if raw in ("true", "1", "yes", "on", "t", "y") else replica})

    async def rpc(request: Request) -> Response:  # serve/dev/rpc/api_router.py collective_rpc
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return error(f"JSON decode error: {e}", 400, "Bad Request")
        if not isinstance(body, dict):
            return error("Request body must be a JSON object", 400, "Bad Request")
        method = body.get("method")
        if method is None:
            return error("Missing 'method' in request body", 400, "Bad Request")
        args, kwargs = body.get("args", []), body.get("kwargs", {})
        try:
            results = dispatch(ws, method, tuple(args), kwargs)
        except Exception as e:  # noqa: BLE001 - the executor's RuntimeError, re-raised by the engine client as a plain
            # Exception (core.py _invoke_utility_method's failure_message), then exception_handler's 500
            why = f"Worker failed with error '{e}', please check the stack trace above for the root cause"
            return error(f"Call to collective_rpc method failed: {why}", 500, "InternalServerError")
        calls["n"] += 1
        idx = order(calls["n"], len(results)) if order else list(range(len(results)))
        out = [r if r is None or isinstance(r, (dict, list)) else str(r) for r in (results[i] for i in idx)]
        return JSONResponse({"results": out})

    return Starlette(routes=[Route("/collective_rpc", rpc, methods=["POST"]), Route("/get_world_size", world_size, methods=["GET"])])


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


def reversed_then_rotated(call: int, n: int) -> list[int]:
    return list(reversed(range(n))) if call % 2 else [(i + call) % n for i in range(n)]


class FakeLLM:
    """``vllm.LLM.collective_rpc(method, timeout=None, args=(), kwargs=None)`` over SimWorkers, and
    ``get_world_size(include_dp=True)`` (vLLM 0.33 ``entrypoints/llm.py``: ``world_size_across_dp``,
    or ``world_size`` without DP, of the front end's parallel config)."""

    def __init__(self, ws: list[Any], world: tuple[int, int] | None = None) -> None:
        self.ws = ws
        self.world = world if world is not None else (len(ws), len(ws))
        self.calls: list[tuple[str, float | None, tuple[Any, ...], dict[str, Any]]] = []

    def get_world_size(self, include_dp: bool = True) -> int:
        return self.world[0] if include_dp else self.world[1]

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        self.calls.append((method, timeout, args, dict(kwargs or {})))
        return list(reversed(dispatch(self.ws, method, args, kwargs or {})))


# --------------------------------------------------------------------------- tests


def test_http_frames_are_exact_and_identity_comes_from_each_worker() -> None:
    ws = workers()
    with serve(collective_rpc_app(ws, order=reversed_then_rotated)) as url:
        res = from_vllm_http(url, timeout_s=10)
    assert res.complete and res.answered == 4 and len(res.failed) == 0, res.summary
    pd.testing.assert_frame_equal(_norm(res.frame), expected(ws))
    assert res.urls == tuple(f"{url} rank {r}" for r in range(4))
    assert set(res.frame["url"]) == set(res.urls)
    info = res.infos[f"{url} rank 3"]
    assert (info["rank"], info["dp"], info["pp"], info["tp"], info["ep"]) == (3, 0, 1, 1, None)
    assert info["params"] == len(ws[3].shard.params) and info["device"] == "cpu" and info["device_uuid"] is None
    assert info["coords_from"] == "attributes"
    assert res.summary == "4 of 4 ranks answered"


def test_http_name_filter_and_phase() -> None:
    ws = workers()
    with serve(collective_rpc_app(ws)) as url:
        res = from_vllm_http(url, name=r"mlp\.down_proj", phase="reload")
    assert res.complete
    want = expected(ws, phase="reload")
    pd.testing.assert_frame_equal(_norm(res.frame), want[want["name"].str.contains(r"mlp\.down_proj")].reset_index(drop=True))


def test_worker_that_cannot_digest_is_reported_with_its_identity_others_kept() -> None:
    ws = workers()
    ws[2].model_runner.model.register_parameter("bad", torch.nn.Parameter(torch.empty(3, device="meta"), requires_grad=False))
    with serve(collective_rpc_app(ws, order=reversed_then_rotated)) as url:
        res = from_vllm_http(url)
    assert not res.complete and res.answered == 3
    assert sorted(res.frame["rank"].unique()) == [0, 1, 3]
    pd.testing.assert_frame_equal(_norm(res.frame), expected([ws[0], ws[1], ws[3]]))
    row = res.failed.iloc[0]
    assert (row["url"], row["kind"], row["rank"], row["pp"], row["tp"]) == (f"{url} rank 2", "failed", 2, 1, 0)
    assert "wcviz_digests failed on this worker" in row["error"] and "meta" in row["error"]
    assert res.summary.startswith("3 of 4 ranks answered; 1 failed: ")


class RaisingWorker(SimWorker):
    def wcviz_digests(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_worker_raising_fails_the_whole_rpc_and_every_worker_is_reported() -> None:
    """In vLLM one worker raising fails collective_rpc for all: every worker is reported, none dropped."""
    ws = workers()
    ws[1] = RaisingWorker(1)
    with serve(collective_rpc_app(ws)) as url:
        res = from_vllm_http(url)
    assert res.answered == 0 and len(res.frame) == 0 and not res.complete
    assert list(res.failed["rank"]) == [0, 1, 2, 3] and set(res.failed["kind"]) == {"failed"}
    assert all("HTTP 500" in e for e in res.failed["error"])
    # what vLLM says reaches the report: the worker's own error, inside the engine client's and executor's words
    assert all("Call to collective_rpc method failed: Worker failed with error" in e and "illegal memory access" in e for e in res.failed["error"])
    llm_res = from_vllm_llm(FakeLLM(ws))
    assert list(llm_res.failed["rank"]) == [0, 1, 2, 3]
    assert "illegal memory access" in llm_res.failed["error"].iloc[0]


class OddWorker(SimWorker):
    def wcviz_digests(self, *args: Any, **kwargs: Any) -> Any:
        return 42  # vLLM's route str()s what is not a dict or list


def test_malformed_and_missing_results_are_reported() -> None:
    ws = workers()
    ws[0] = OddWorker(0)
    with serve(collective_rpc_app(ws)) as url:
        res = from_vllm_http(url)
    assert res.answered == 3 and len(res.urls) == 5  # 3 collected, result '42', rank 0 with no rows
    by_url = dict(zip(res.failed["url"], res.failed["error"]))
    assert "not {'info': ..., 'rows': [...]}" in by_url[f"{url} worker result 0"]
    assert by_url[f"{url} rank 0"] == "gave wcviz_info but no wcviz_digests result"
    assert res.failed.set_index("url").loc[f"{url} rank 0", "tp"] == 0


def test_a_worker_collective_rpc_never_reached_is_reported_from_world_size() -> None:
    ws = workers()
    with serve(collective_rpc_app([ws[0], ws[1], ws[3]])) as url:  # rank 2 never answers at all
        res = from_vllm_http(url)
    assert res.answered == 3 and not res.complete
    row = res.failed.iloc[0]
    assert (row["url"], row["kind"], row["rank"], row["role"]) == (f"{url} rank 2", "unreachable", 2, "engine")
    assert "world_size is 4 but collective_rpc reached 3" in row["error"]


def test_dense_data_parallel_reports_every_replica_collective_rpc_does_not_reach() -> None:
    """vLLM 0.33: /collective_rpc answers with DP engine 0's workers only (v1/engine/core_client.py,
    ``call_utility_async``), and a dense replica's workers do not know the others exist: ``v1/engine/core.py``
    runs ``reconfigure_for_independent_dp_rank()`` (``config/parallel.py``: ``data_parallel_size = 1``), so
    their ``world_size_across_dp`` is TP x PP. Only the API server's ``GET /get_world_size`` counts every
    replica. Two dense replicas of TP 2 x PP 2: the result is not complete, and replica 1's ranks 4..7 are
    named with dp=1 and the reason, over HTTP and in-process alike.
    """
    ws = workers()
    for w in ws:
        w.world_size, w.dp_size = 4, 1  # what the extension reads from a reconfigured dense replica's parallel_config
    with serve(collective_rpc_app(ws, world=(8, 4))) as url:
        over_http = from_vllm_http(url)
    for res in (over_http, from_vllm_llm(FakeLLM(ws, world=(8, 4)))):
        assert res.answered == 4 and not res.complete
        missing = res.failed.sort_values("rank")
        assert list(missing["rank"]) == [4, 5, 6, 7] and set(missing["dp"]) == {1}
        assert set(missing["kind"]) == {"unreachable"}
        assert all("get_world_size (across data-parallel replicas) is 8" in e for e in missing["error"])
        assert all("DP engine 0's workers only" in e and "from_vllm_weight_checker" in e for e in missing["error"])


def test_moe_data_parallel_workers_count_every_replica_themselves() -> None:
    """An MoE model under DP keeps its DP config (vLLM 0.33 ``v1/engine/core.py``: ``DPEngineCoreProc``): the
    workers' own world size already spans the replicas, and the server's count agrees."""
    ws = workers()
    for w in ws:
        w.world_size, w.dp_size = 8, 2
    with serve(collective_rpc_app(ws, world=(8, 4))) as url:
        res = from_vllm_http(url)
    assert not res.complete and sorted(res.failed["rank"]) == [4, 5, 6, 7] and set(res.failed["dp"]) == {1}
    assert all("the workers' world_size is 8" in e for e in res.failed["error"])


def test_a_world_size_that_cannot_be_read_is_not_complete() -> None:
    """Without the front end's count the other DP replicas cannot be counted: never a silent pass."""
    ws = workers()
    plain = Starlette(routes=[r for r in collective_rpc_app(ws).routes if getattr(r, "path", "") != "/get_world_size"])
    with serve(plain) as url:
        res = from_vllm_http(url)
    assert res.answered == 4 and not res.complete and len(res.failed) == 1
    row = res.failed.iloc[0]
    assert row["url"] == url and row["kind"] == "failed"
    assert "get_world_size" in row["error"] and "404" in row["error"] and "from_vllm_weight_checker" in row["error"]

    class NoCount(FakeLLM):
        get_world_size = None  # type: ignore[assignment]

    class BadCount(FakeLLM):
        def get_world_size(self, include_dp: bool = True) -> int:
            return 6 if include_dp else 4

    for llm, why in ((NoCount(ws), "has no get_world_size"), (BadCount(ws), "not a multiple of its 4 per replica")):
        res = from_vllm_llm(llm)
        assert res.answered == 4 and not res.complete and why in res.failed["error"].iloc[0], res.failed


def test_duplicate_rank_claims_fail_both() -> None:
    ws = workers()
    ws[3].rank = 2
    ws[3].tp_rank, ws[3].pp_rank = ws[2].tp_rank, ws[2].pp_rank
    with serve(collective_rpc_app(ws)) as url:
        res = from_vllm_http(url)
    assert sorted(res.frame["rank"].unique()) == [0, 1]
    assert list(res.failed["url"]) == [f"{url} rank 2 #1", f"{url} rank 2 #2", f"{url} rank 3"]
    assert all("claims the same rank" in e for e in res.failed["error"][:2])
    assert list(res.failed["kind"]) == ["failed", "failed", "unreachable"]  # rank 3: nobody answered as it


def test_non_string_args_are_refused_before_sending() -> None:
    def never(request: httpx.Request) -> httpx.Response:
        raise AssertionError("nothing may be sent")

    t = httpx.MockTransport(never)
    with pytest.raises(TypeError, match=r"strings only, but args\[0\] is int 165; send '165'"):
        vllm_collective_rpc("http://x", "wcviz_reset", [0xA5], transport=t)
    with pytest.raises(TypeError, match=r"strings only, but kwargs\['byte'\] is int"):
        vllm_collective_rpc("http://x", "wcviz_reset", kwargs={"byte": 0xA5}, transport=t)
    with pytest.raises(TypeError, match="args must be a list or tuple of strings"):
        vllm_collective_rpc("http://x", "wcviz_reset", "0xa5", transport=t)
    with pytest.raises(TypeError, match="name must be a regex string"):
        from_vllm_http("http://x", name=3, transport=t)  # type: ignore[arg-type]


def test_dev_mode_off_404_is_a_clear_error() -> None:
    with serve(Starlette(routes=[])) as url, pytest.raises(EngineEndpointError, match="VLLM_SERVER_DEV_MODE=1") as err:
        from_vllm_http(url)
    assert err.value.kind == "missing"
    assert "worker-extension-cls wcviz.integrations.vllm.WcvizWorkerExtension" in str(err.value)


def test_unreachable_server_is_reported_not_raised() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the with ends: nothing listens there
    res = from_vllm_http(f"http://127.0.0.1:{port}", retries=0, timeout_s=2)
    assert not res.complete and list(res.failed["kind"]) == ["unreachable"]
    assert "ConnectError" in res.failed["error"].iloc[0] and res.summary.startswith("0 of 1 ranks answered; 1 unreachable")


def test_workers_without_the_extension_get_a_hint() -> None:
    class Plain:
        rank = 0

    res = from_vllm_llm(FakeLLM([Plain()]))
    assert "AttributeError" in res.failed["error"].iloc[0]
    assert "worker_extension_cls=wcviz.integrations.vllm.WcvizWorkerExtension" in res.failed["error"].iloc[0]


def test_request_shape_is_vllms() -> None:
    seen: list[Any] = []
    ws = workers()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            seen.append(f"GET {request.url.path}?{request.url.query.decode()}")
            return httpx.Response(200, json={"world_size": 4})
        body = json.loads(request.content)
        seen.append(body)
        return httpx.Response(200, json={"results": dispatch(ws, body["method"], tuple(body["args"]), body["kwargs"])})

    res = from_vllm_http("http://engine:8000/", transport=httpx.MockTransport(handler), timeout_s=7, name="norm")
    assert res.complete
    assert seen[0] == {"method": "wcviz_info", "args": [], "kwargs": {}, "timeout": 7}
    assert seen[1:3] == ["GET /get_world_size?include_dp=true", "GET /get_world_size?include_dp=false"]
    assert seen[3] == {"method": "wcviz_digests", "args": [], "kwargs": {"algo": "nemo-rl-v3", "phase": "current", "name_regex": "norm"}, "timeout": 7}


def test_in_process_llm_gives_the_same_table() -> None:
    ws = workers()
    llm = FakeLLM(ws)
    res = from_vllm_llm(llm, timeout_s=5)
    assert res.complete and res.urls == tuple(f"vllm rank {r}" for r in range(4))
    pd.testing.assert_frame_equal(_norm(res.frame), expected(ws))
    assert [c[:2] for c in llm.calls] == [("wcviz_info", 5), ("wcviz_digests", 5)]
    with pytest.raises(TypeError, match="collective_rpc"):
        from_vllm_llm(object())


def test_endstate_through_the_extension_names_the_unwritten_rank() -> None:
    """snapshot -> wcviz_reset -> reload (rank 1 skips down_proj) -> classify."""
    ws = workers({1: LoaderFaults(skip=r"down_proj")})
    llm = FakeLLM(ws)
    snap = from_vllm_llm(llm, phase="snapshot")
    acks = llm.collective_rpc("wcviz_reset", kwargs={"byte": "0xa5"})
    assert sorted(a["info"]["rank"] for a in acks) == [0, 1, 2, 3] and {a["byte"] for a in acks} == {"0xa5"}
    reset = from_vllm_llm(llm, phase="reset")
    for w in ws:
        w.reload()
    reload = from_vllm_llm(llm, phase="reload")
    verdicts = classify(snap.frame, reset.frame, reload.frame)
    bad = verdicts[verdicts["status"] != "match"]
    assert set(bad["status"]) == {"unwritten"} and set(bad["rank"]) == {1}
    assert sorted(bad["name"]) == ["model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    assert "2 unwritten on 1 rank (rank 1 (dp=0 pp=0 tp=1))" in summary(verdicts)


def test_reset_bytes_and_refusals() -> None:
    w = SimWorker(0)
    before = w.wcviz_digests()["rows"]
    assert w.wcviz_reset("0x5a")["byte"] == "0x5a"
    assert all(bool((t.view(torch.uint8) == 0x5A).all()) for t in w.shard.params.values())
    after = w.wcviz_digests()["rows"]
    assert all(a["digest"] != b["digest"] for a, b in zip(before, after))
    with pytest.raises(ValueError, match="poison byte"):
        w.wcviz_reset("0x00")
    assert w.wcviz_snapshot()["rows"][0]["phase"] == "snapshot"
    assert "error" in w.wcviz_digests(name_regex="(")


def test_coords_explicit_then_vllm_then_attributes(monkeypatch: pytest.MonkeyPatch) -> None:
    w = SimWorker(3)
    assert worker_coords(w) == ({"rank": 3, "dp": 0, "pp": 1, "tp": 1, "ep": None, "world_size": 4, "dp_size": None}, "attributes")

    group = lambda r: types.SimpleNamespace(rank_in_group=r)
    ps = types.ModuleType("vllm.distributed.parallel_state")
    ps.get_tensor_model_parallel_rank = lambda: 1  # type: ignore[attr-defined]
    ps.get_pp_group = lambda: group(0)  # type: ignore[attr-defined]
    ps.get_dp_group = lambda: group(2)  # type: ignore[attr-defined]
    ps.get_ep_group = lambda: group(5)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", ps)
    assert worker_coords(w) == ({"rank": 3, "dp": 2, "pp": 0, "tp": 1, "ep": None, "world_size": None, "dp_size": None}, "vllm")  # ep: expert parallel only
    w.vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(enable_expert_parallel=True, data_parallel_rank=2))
    assert worker_coords(w)[0]["ep"] == 5
    # vLLM 0.33 dense DP (v1/engine/core.py, config/parallel.py reconfigure_for_independent_dp_rank): each replica's
    # config says data_parallel_rank 0 and data_parallel_size 1 (so world_size_across_dp == world_size); only
    # data_parallel_index tells replicas apart. Ranks still number across DP; the world is the replica's.
    ps.get_dp_group = lambda: group(0)  # type: ignore[attr-defined]
    w.vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(
        data_parallel_rank=0, data_parallel_index=1, data_parallel_size=1, world_size=4, world_size_across_dp=4,
    ))  # fmt: skip
    assert worker_coords(w) == ({"rank": 7, "dp": 1, "pp": 0, "tp": 1, "ep": None, "world_size": 4, "dp_size": 1}, "vllm")
    # An MoE model keeps its DP config (DPEngineCoreProc): data_parallel_rank and the size across DP are real.
    w.vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(
        data_parallel_rank=1, data_parallel_index=1, data_parallel_size=2, world_size=4, world_size_across_dp=8,
    ))  # fmt: skip
    assert worker_coords(w) == ({"rank": 7, "dp": 1, "pp": 0, "tp": 1, "ep": None, "world_size": 8, "dp_size": 2}, "vllm")

    def not_initialised() -> int:
        raise AssertionError("tensor model parallel group is not initialized")

    ps.get_tensor_model_parallel_rank = not_initialised  # type: ignore[attr-defined]
    assert worker_coords(w)[1] == "attributes"
    w.wcviz_coords = {"rank": 7, "tp": 0}
    assert worker_coords(w) == ({"rank": 7, "dp": None, "pp": None, "tp": 0, "ep": None, "world_size": None, "dp_size": None}, "wcviz_coords")
    w.wcviz_coords = {"rank": 7, "tensor": 0}
    with pytest.raises(ValueError, match="unknown key"):
        worker_coords(w)
    w.wcviz_coords = {"rank": 1.5}
    with pytest.raises(TypeError, match="must be an int"):
        worker_coords(w)


def test_coords_under_an_external_launcher_are_the_torch_global_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``distributed_executor_backend="external_launcher"`` (verl-style SPMD, one process per rank of one torch
    world): vLLM multiplies ``world_size`` by DP there (``config/parallel.py:970``), so ``world_size_across_dp``
    counts DP twice. TP 2 x DP 2 on a torch world of 4 was numbered 0, 1, 6, 7 of 8."""
    group = lambda r: types.SimpleNamespace(rank_in_group=r)
    ps = types.ModuleType("vllm.distributed.parallel_state")
    ps.get_pp_group = lambda: group(0)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", ps)
    got = []
    for torch_rank in range(4):
        tp, dp = torch_rank % 2, torch_rank // 2
        ps.get_tensor_model_parallel_rank = lambda tp=tp: tp  # type: ignore[attr-defined]
        ps.get_dp_group = lambda dp=dp: group(dp)  # type: ignore[attr-defined]
        dist = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                                     get_rank=lambda r=torch_rank: r, get_world_size=lambda: 4)  # fmt: skip
        monkeypatch.setitem(sys.modules, "torch.distributed", dist)
        w = SimWorker(0)
        w.vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(  # as config/parallel.py sets it
            distributed_executor_backend="external_launcher", tensor_parallel_size=2, data_parallel_size=2,
            data_parallel_rank=dp, data_parallel_index=dp, world_size=2 * 2, world_size_across_dp=2 * 2 * 2,
        ))  # fmt: skip
        got.append(worker_coords(w)[0])
    assert [(c["rank"], c["dp"], c["tp"], c["world_size"], c["dp_size"]) for c in got] == [
        (0, 0, 0, 4, 2), (1, 0, 1, 4, 2), (2, 1, 0, 4, 2), (3, 1, 1, 4, 2),
    ]


def test_parameters_whose_bytes_live_in_inner_tensors_are_listed_as_vllms_checker_lists_them() -> None:
    """vLLM 0.33's checker (``model_loader/weight_checksum.py``, ``_tensors``) lists a ``SharedWeightParameter`` by its
    partitions (``<name>.<index>``) and a traceable wrapper subclass (TorchAO) by its inner tensors
    (``<name>.<attr>``). The extension listed the parameter itself: the wrapper failed the whole rank, and the
    shared parameter was an empty tensor whose partitions were never digested (or poisoned)."""
    import hashlib

    from torch.testing._internal.two_tensor import TwoTensor

    class SharedWeightParameter(torch.nn.Parameter):
        """As vllm/model_executor/parameter.py builds it: no data of its own, its bytes in ``partitions``."""

    def vllm_checker(model: torch.nn.Module) -> dict[str, str]:  # weight_checksum.py, as written there
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        def inner(name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
            if isinstance(t, SharedWeightParameter):
                for index, part in t.partitions.items():
                    yield from inner(f"{name}.{index}", part)
            elif is_traceable_wrapper_subclass(t):
                for attr in t.__tensor_flatten__()[0]:
                    yield from inner(f"{name}.{attr}", getattr(t, attr))
            else:
                yield name, t

        return {
            n: hashlib.sha256(w.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for name, p in model.named_parameters() for n, w in inner(name, p)
        }  # fmt: skip

    m = torch.nn.Module()
    m.lin = torch.nn.Linear(4, 4, bias=False)
    m.q = torch.nn.Parameter(TwoTensor(torch.randn(4, 4), torch.randn(4, 4)), requires_grad=False)
    shared = SharedWeightParameter(torch.empty(0), requires_grad=False)
    shared.partitions = {0: torch.nn.Parameter(torch.randn(3, 3), requires_grad=False)}
    m.t = torch.nn.Module()
    m.t.weight = shared
    w = SimWorker(0)
    w.model_runner = types.SimpleNamespace(model=m)
    res = w.wcviz_digests(algo="vllm-sha256")
    assert "error" not in res, res.get("error")
    assert {r["name"]: r["digest"] for r in res["rows"]} == vllm_checker(m)
    assert res["info"]["params"] == 4
    w.wcviz_reset("0xa5")
    assert bool((shared.partitions[0].view(torch.uint8) == 0xA5).all()) and bool((m.q.a.view(torch.uint8) == 0xA5).all())


def test_extension_mixes_into_another_frameworks_extension() -> None:
    """vLLM refuses extension attributes its worker already has: ours are all wcviz_-prefixed, no __init__."""
    names = [n for n in vars(WcvizWorkerExtension) if not n.startswith("__")]
    assert names and all(n.startswith(("wcviz_", "_wcviz_")) for n in names)
    assert "__init__" not in vars(WcvizWorkerExtension)
    assert inspect.signature(WcvizWorkerExtension.wcviz_digests).parameters["algo"].default == DEFAULT_ALGO

    class FrameworkExtension:
        def update_weights_from_ipc(self) -> str:
            return "theirs"

    class Combined(FrameworkExtension, WcvizWorkerExtension):
        """Theirs first, then ours: how NeMo-RL's own extension would be combined."""

    class Worker(SimWorker, Combined):
        """A worker carrying the combined extension, as vLLM would build it."""

    w = Worker(0)
    assert w.update_weights_from_ipc() == "theirs" and len(w.wcviz_digests()["rows"]) == len(w.shard.params)


def test_importing_the_adapters_stays_cheap() -> None:
    code = (
        "import sys, wcviz.sources, wcviz.integrations.vllm, wcviz.sources._vllm\n"
        "print(sorted(m for m in ('vllm', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    code = "import sys, wcviz.integrations.vllm; print(sorted(m for m in ('torch', 'pandas', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_worker_that_released_its_weights_is_empty_not_a_pass() -> None:
    """A sleeping or offloaded engine answers with no parameters: named, and the fetch is not complete."""
    ws = workers()
    ws[1].model_runner.model = torch.nn.Module()  # what a worker with released weights lists
    llm = FakeLLM(ws)
    res = from_vllm_llm(llm)
    assert not res.complete and res.answered == 4
    row = res.failed.iloc[0]
    assert (row["kind"], int(row["rank"])) == ("empty", 1) and "no parameters" in row["error"]
    assert "1 empty" in res.summary
    filtered = from_vllm_llm(FakeLLM(workers()), name="^no-such-parameter$")
    assert filtered.complete and len(filtered.frame) == 0  # a filter that matches nothing is not an empty rank


def test_extension_lists_a_tied_parameter_once_as_vllms_checker_and_expected_frame_do() -> None:
    """vLLM 0.33 weight_checksum.py walks model.named_parameters(): a tied head once, under the embedding's name."""

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Module()
            self.model.embed_tokens = torch.nn.Embedding(8, 4)
            self.lm_head = torch.nn.Linear(4, 8, bias=False)
            self.lm_head.weight = self.model.embed_tokens.weight

    w = SimWorker(0)
    w.model_runner = types.SimpleNamespace(model=Tied())
    rows = w.wcviz_digests()["rows"]
    assert [r["name"] for r in rows] == ["model.embed_tokens.weight"]
    assert w.wcviz_info()["params"] == 1


@pytest.mark.parametrize("when", ["wcviz_info", "wcviz_digests"])
def test_an_rpc_timeout_through_the_multiprocessing_client_is_unreachable_not_failed(when: str) -> None:
    """vLLM 0.33's default engine client re-raises the executor's TimeoutError as a plain Exception
    ("Call to collective_rpc method failed: RPC call to ... timed out."): it read as a worker that failed."""

    class TimingOut(FakeLLM):
        def collective_rpc(self, method: str, timeout: float | None = None, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
            if method == when:
                raise Exception(f"Call to collective_rpc method failed: RPC call to {method} timed out.")  # noqa: TRY002 - as vLLM raises it
            return super().collective_rpc(method, timeout, args, kwargs)

    res = from_vllm_llm(TimingOut(workers()))
    assert not res.complete and set(res.failed["kind"]) == {"unreachable"} and "timed out" in res.failed["error"].iloc[0]
