"""SGLang's own weight checker, as SGLang 0.5.23 answers it, over real HTTP on loopback.

The server is :class:`wcviz.sim.SimSglang`, written from SGLang 0.5.23's
``sglang/srt/entrypoints/http_server.py`` (``check_weights``: HTTP 200, or 400 when
``success`` is false), ``managers/tokenizer_control_mixin.py`` (``ranks``,
``per_engine_checksum``, messages joined by `` | ``),
``managers/scheduler_components/weight_updater.py`` (one entry per TP rank, draft keys
prefixed by role), ``utils/weight_checker.py`` (``per_gpu_checksum``, the compare
message, the random reset) and ``utils/auth.py`` (``ADMIN_OPTIONAL``). What it answers,
and what wcviz sends, are validated against SGLang's own wire structs, read out of the
released wheel (``sglang/srt/managers/io_struct.py``: ``CheckWeightsReqInput``,
``ChecksumInfo``, ``ParallelismInfo``; ``sglang/srt/utils/weight_checker.py``: the
strict pydantic ``ParallelismInfo``). No live SGLang was run.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import sys
import types
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from wcviz import digest_hex
from wcviz._errors import AlgorithmMismatch, WcvizError
from wcviz.endstate import EngineLeftPoisoned, SglangFleet, sglang_endstate
from wcviz.live import verify_engine
from wcviz.sim import SimSglang
from wcviz.sim.engine import LoaderFaults
from wcviz.sim.model import TINY, build_state_dict
from wcviz.sources import EngineEndpointError, from_named_tensors, from_sglang, sglang_action, sglang_compare_mismatches
from wcviz.verdicts import compare

from _wheels import sglang_file

DRAFT = dataclasses.replace(TINY, layers=1, seed=5)
DOWN = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(TINY.layers)]


# --------------------------------------------------------------------------- SGLang's own structs, from the wheel


def _classes(path: str, names: tuple[str, ...], namespace: dict[str, Any]) -> dict[str, Any]:
    """The classes ``names`` of a file in the sglang wheel, executed alone in ``namespace`` (no sglang import)."""
    tree = ast.parse(sglang_file(path).read_text())
    found = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in names}
    assert set(found) == set(names), f"{path} lacks {set(names) - set(found)}"
    module = ast.Module(body=[found[n] for n in names], type_ignores=[])
    exec(compile(module, path, "exec"), namespace)  # noqa: S102 - SGLang's own class bodies, nothing else
    return {n: namespace[n] for n in names}


@pytest.fixture(scope="module")
def sglang_structs() -> dict[str, Any]:
    msgspec = pytest.importorskip("msgspec", reason="SGLang's wire structs are msgspec Structs")
    from typing import Dict, List, Literal, Optional

    from pydantic import BaseModel, ConfigDict

    types_ = {"msgspec": msgspec, "Optional": Optional, "List": List, "Dict": Dict, "Literal": Literal}
    module = types.ModuleType("sglang_wire_structs")  # msgspec resolves annotations in the class's module
    sys.modules[module.__name__] = module
    base = module.__dict__
    base.update(types_)
    exec(  # noqa: S102 - io_struct.BaseReq's fields, without its IPC tagging; unknown fields refused
        "class BaseReq(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):\n"
        "    rid: Optional[str] = None\n    http_worker_ipc: Optional[str] = None\n",
        base,
    )
    wire = _classes("sglang/srt/managers/io_struct.py", ("CheckWeightsReqInput", "ParallelismInfo", "ChecksumInfo"), base)
    types_ = dict(types_)
    strict = _classes("sglang/srt/utils/weight_checker.py", ("_StrictBaseModel", "ParallelismInfo"), {**types_, "BaseModel": BaseModel, "ConfigDict": ConfigDict})
    return {**wire, "StrictParallelismInfo": strict["ParallelismInfo"], "msgspec": msgspec}


def _validate(structs: dict[str, Any], sim: SimSglang, answer: dict[str, Any]) -> None:
    """Every request the server got is a CheckWeightsReqInput; every rank entry a ChecksumInfo."""
    msgspec = structs["msgspec"]
    for req in sim.requests:
        msgspec.convert(req["body"], structs["CheckWeightsReqInput"])
    for entry in answer.get("ranks", []):
        msgspec.convert(entry, structs["ChecksumInfo"])
        infos = entry["parallelism_info"]
        for info in infos if isinstance(infos, list) else [infos]:
            structs["StrictParallelismInfo"].model_validate(info)


def _raw(url: str, body: dict[str, Any], token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{url}/weights_checker", json=body, headers=headers, timeout=30)


def test_the_fake_answers_as_sglangs_own_structs_say(sglang_structs: dict[str, Any]) -> None:
    sim = SimSglang(TINY, tp=2, pp=2, draft=DRAFT)
    with sim as url:
        answer = _raw(url, {"action": "checksum"}).json()
        res = from_sglang(url)  # what wcviz sends is a valid request too
        legacy = SimSglang(TINY, tp=2, legacy_info=True)
        with legacy as url2:
            old = _raw(url2, {"action": "checksum"}).json()
    _validate(sglang_structs, sim, answer)
    msgspec = sglang_structs["msgspec"]
    assert answer["success"] is True and answer["message"] == "Success."
    assert len(answer["ranks"]) == 2  # one per TP rank of pipeline stage 0
    assert [i["role"] for i in answer["ranks"][0]["parallelism_info"]] == ["target", "draft"]
    with pytest.raises(msgspec.ValidationError):  # the older single-dict form is not today's wire shape ...
        msgspec.convert(old["ranks"][0], sglang_structs["ChecksumInfo"])
    sglang_structs["StrictParallelismInfo"].model_validate(old["ranks"][0]["parallelism_info"])  # ... but each dict is
    assert res.answered == 2 and len(res.frame) and not res.complete  # pp 1 never answers


def test_checksums_become_one_row_per_rank_and_parameter_roles_apart() -> None:
    sim = SimSglang(TINY, tp=2, draft=DRAFT)
    with sim as url:
        res = from_sglang(url, phase="snapshot")
    assert res.complete, res.summary
    assert set(res.frame["algo"]) == {"sglang-gpu"} and set(res.frame["phase"]) == {"snapshot"}
    assert set(res.frame["role"]) == {"engine"}
    for tp, rows in res.frame.groupby("tp"):
        want = {n: str(digest_hex(t, algo="sglang-gpu")) for n, t in sim.shards[(0, 0, tp)].params.items()}
        want |= {f"draft.{n}": str(digest_hex(t, algo="sglang-gpu")) for n, t in sim.drafts[(0, 0, tp)].params.items()}
        assert dict(zip(rows["name"], rows["digest"])) == want  # the draft under SGLang's own keys, apart from the target
        assert set(rows["rank"]) == {tp} and set(rows["dp"]) == {0} and set(rows["pp"]) == {0}
    assert res.frame["dtype"].isna().all() and res.frame["ep"].isna().all()
    assert res.urls == (f"{url} dp=0 pp=0 tp=0", f"{url} dp=0 pp=0 tp=1")
    assert res.infos[f"{url} dp=0 pp=0 tp=1"]["roles"] == ["target", "draft"]


def test_legacy_parallelism_info_and_selector() -> None:
    sim = SimSglang(TINY, tp=2, legacy_info=True)
    with sim as url:
        res = from_sglang(url, selector="target", skip=["layernorm"])
    assert res.complete and not res.frame["name"].str.startswith("draft.").any()
    assert not res.frame["name"].str.contains("layernorm").any()
    body = sim.requests[-1]["body"]
    assert body == {"action": "checksum", "allow_quant_error": False, "skip_tensor_list": ["layernorm"], "selector": "target"}
    cpu = SimSglang(TINY, tp=1, device="cpu")
    with cpu as url:
        res = from_sglang(url, algo="sglang-cpu")
    t = cpu.shards[(0, 0, 0)].params["model.norm.weight"]
    got = res.frame.set_index("name").loc["model.norm.weight", "digest"]
    assert got == str(digest_hex(t, algo="sglang-cpu"))


def test_later_pipeline_stages_are_listed_as_not_reported() -> None:
    sim = SimSglang(TINY, tp=2, pp=2)
    with sim as url:
        res = from_sglang(url)
    assert res.answered == 2 and not res.complete
    assert list(zip(res.failed["pp"], res.failed["tp"])) == [(1, 0), (1, 1)]
    assert set(res.failed["kind"]) == {"unreachable"}
    assert all("pipeline stage 0 only" in e for e in res.failed["error"])


def test_data_parallel_schedulers_and_a_failing_one() -> None:
    sim = SimSglang(TINY, tp=2, dp=2, failing=[1])
    with sim as url:
        raw = _raw(url, {"action": "checksum"})
        res = from_sglang(url)
    assert raw.status_code == 400 and raw.json()["success"] is False and len(raw.json()["ranks"]) == 2
    assert raw.json()["message"] == "Success. | check_weights failed on DP rank 1"
    assert res.answered == 2 and not res.complete and set(res.frame["dp"]) == {0}
    assert list(res.failed["url"]) == [url] and "check_weights failed on DP rank 1" in res.failed["error"].iloc[0]
    sim.failing = set()
    with sim as url:
        res = from_sglang(url)
    assert res.complete and set(res.frame["dp"]) == {0, 1} and res.answered == 4


def test_admin_key_is_sent_as_a_bearer_token_and_a_refusal_is_clear() -> None:
    sim = SimSglang(TINY, admin_api_key="admin-secret", api_key="user-key")
    with sim as url:
        with pytest.raises(EngineEndpointError, match=r"give the engine.s API key \(--token, or token=\.\.\.\)") as err:
            from_sglang(url)
        assert err.value.kind == "refused"
        with pytest.raises(EngineEndpointError, match="not the engine's key"):
            from_sglang(url, token="user-key")  # with both keys set, only the admin key opens the route
        assert from_sglang(url, token="admin-secret").complete
        assert sim.requests[-1]["headers"]["authorization"] == "Bearer admin-secret"
        assert _raw(url, {"action": "checksum"}).json() == {"error": "Unauthorized"}


def _fetched_from_checker_answering(body: dict[str, Any]) -> tuple[Any, str]:
    """``from_sglang`` of a server whose ``/weights_checker`` answers ``body`` to every request, and its URL."""
    from wcviz._serving import serve_in_thread, stop_server

    async def answer(request: Request) -> JSONResponse:
        return JSONResponse(body)

    server, thread, url = serve_in_thread(Starlette(routes=[Route("/weights_checker", answer, methods=["POST"])]), "127.0.0.1", 0, name="checker")
    try:
        return from_sglang(url), url
    finally:
        stop_server(server, thread, "checker")


def test_an_altered_answer_is_refused_rank_by_rank() -> None:
    sim = SimSglang(TINY, tp=2)
    with sim as real:
        good = _raw(real, {"action": "checksum"}).json()

    body = {**good, "ranks": [dict(r) for r in good["ranks"]]}
    body["ranks"][1]["checksums"] = {**body["ranks"][1]["checksums"], "model.norm.weight": "0" * 16}
    res, url = _fetched_from_checker_answering(body)
    assert res.answered == 1 and not res.complete
    errors = " ".join(res.failed["error"])
    assert "per_gpu_checksum is not the sha256 of its checksums" in errors
    # the tampered entry's own parallelism_info held up: the failure is named by that rank, and only once (never
    # a second "not reported" row for the same TP rank, nor a rank without coordinates)
    (row,) = res.failed.to_dict(orient="records")
    assert row["url"] == f"{url} dp=0 pp=0 tp=1" and (row["kind"], row["rank"], row["dp"], row["pp"], row["tp"]) == ("failed", 1, 0, 0, 1)


def test_actions_answer_for_tp_rank_0_of_stage_0_and_compare_names_what_differs() -> None:
    # Every rank runs the action, but only the scheduler with pp_rank == 0 and attn_tp_rank == 0 has a socket to
    # the tokenizer (SGLang 0.5.23 srt/managers/scheduler.py:816-839, scheduler_components/ipc_channels.py:36-72;
    # the others' SenderWrapper(None).send_output returns without sending, output_sender.py:17-18): the answer is
    # that rank's; another rank's failure is only logged.
    sim = SimSglang(TINY, tp=2)
    with sim as url:
        first = sglang_action(url, "compare")
        assert not first.complete and "no snapshot was taken" in first.errors[url]
        snap = sglang_action(url, "snapshot")
        assert snap.complete and snap.urls == (url,) and snap.answers[url]["message"] == "Success."
        before = {n: t.clone() for n, t in sim.shards[(0, 0, 1)].params.items()}
        reset = sglang_action(url, "reset_tensors")
        assert reset.complete  # 200 without payload: TP rank 0 did it; every rank ran it
        assert all(not torch.equal(before[n], t) for n, t in sim.shards[(0, 0, 1)].params.items())
        sim.shards[(0, 0, 1)].faults = LoaderFaults(skip=r"down_proj")
        sim.load()
        on_rank_1 = sglang_action(url, "compare")
        assert on_rank_1.complete  # TP rank 1's compare failed, but SGLang does not answer for it
        assert ("target", (0, 0, 1)) in sim.snapshots and ("target", (0, 0, 0)) not in sim.snapshots  # a failed compare keeps it
        assert sglang_action(url, "snapshot").complete and sglang_action(url, "reset_tensors").complete
        sim.shards[(0, 0, 0)].faults = LoaderFaults(skip=r"down_proj")
        sim.load()
        cmp = sglang_action(url, "compare")
    assert not cmp.complete and cmp.errors[url].startswith("compare failed on TP rank 0 of pipeline stage 0")
    assert "check tensor equality failed" in cmp.errors[url]
    assert sorted(sglang_compare_mismatches(cmp.errors[url])) == DOWN
    with pytest.raises(ValueError, match="choose snapshot, reset_tensors or compare"):
        sglang_action(url, "checksum")


def test_compare_without_a_snapshot_under_dp_is_explained() -> None:
    # each DP scheduler's TP rank 0 fails `assert self._snapshot_tensors is not None` (utils/weight_checker.py:190)
    # with an empty message (weight_updater.py:453-456); the tokenizer joins them with " | " (communicator.py:106-110)
    sim = SimSglang(TINY, dp=2)
    with sim as url:
        assert _raw(url, {"action": "compare"}).json() == {"success": False, "message": " | "}
        res = sglang_action(url, "compare")
    assert "no snapshot was taken" in res.errors[url] and "|" not in res.errors[url]


def test_draft_selector_on_an_engine_without_a_draft_model_is_empty_never_a_pass() -> None:
    # no draft worker: _select_runners returns no runner (weight_updater.py:178-185), payload stays None (433):
    # 200 {"success": true, "message": "Success."} with no ranks
    sim = SimSglang(TINY, tp=2)
    with sim as url:
        assert _raw(url, {"action": "checksum", "selector": "draft"}).json() == {"success": True, "message": "Success."}
        res = from_sglang(url, selector="draft")
    assert not res.complete and not len(res.frame)
    assert list(res.failed["kind"]) == ["empty"] and "the engine has no draft model" in res.failed["error"].iloc[0]
    assert "not SGLang" not in res.summary


def test_the_fake_refuses_a_body_sglangs_pydantic_model_refuses() -> None:
    # CheckWeightsReqInput (io_struct.py:2217-2223: selector Literal["target", "draft", "all"], skip_tensor_list
    # Optional[List[str]]) is validated by FastAPI; a RequestValidationError is HTTP 400 with SGLang's
    # ErrorResponse (http_server.py:635-691; entrypoints/openai/protocol.py:106-111)
    sim = SimSglang(TINY)
    with sim as url:
        for body, field in (({"action": "checksum", "selector": "bogus"}, "selector"), ({"action": "checksum", "skip_tensor_list": "norm"}, "skip_tensor_list")):
            r = _raw(url, body)
            assert r.status_code == 400, body
            got = r.json()
            assert set(got) == {"object", "message", "type", "param", "code"} and "success" not in got
            assert got["object"] == "error" and got["type"] == "Bad Request" and got["code"] == 400 and field in got["message"]
        assert _raw(url, {"action": "checksum", "skip_tensor_list": ["norm"], "selector": "target"}).status_code == 200


def test_verify_a_cpu_sglang_with_algo_sglang_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # SGLang hashes a CPU tensor with SHA-256 (srt/managers/mm_utils.py:921-928; offloaded parameters live on the
    # host, srt/utils/offloader.py:170-179,476-477): wcviz's sglang-cpu
    from wcviz.cli import main
    from wcviz.sim.model import save_checkpoint

    ck = save_checkpoint(build_state_dict(TINY), tmp_path / "ck", config=TINY)
    with SimSglang(TINY, tp=2, device="cpu") as url:
        assumed = verify_engine(url, ck, tp=2, vocab_padding=1)
        assert not assumed.ok  # sglang-gpu expected: every digest differs
        report = verify_engine(url, ck, tp=2, vocab_padding=1, algo="sglang-cpu")
        assert report.ok and set(report.verdicts["status"]) == {"match"} and report.assumed["algo"] == "sglang-cpu"
        assert main(["verify", url, "--checkpoint", str(ck), "--tp", "2", "--vocab-padding", "1", "--algo", "sglang-cpu"]) == 0
        with pytest.raises(WcvizError, match="SGLang's checker computes sglang-gpu, sglang-cpu, not 'vllm-sha256'"):
            verify_engine(url, ck, tp=2, vocab_padding=1, algo="vllm-sha256")
    with pytest.raises(WcvizError, match="vLLM's checker computes vllm-sha256, not 'sglang-cpu'"):
        verify_engine("http://127.0.0.1:9", ck, tp=2, engine="vllm", algo="sglang-cpu")
    with pytest.raises(WcvizError, match="not 'nemo-rl-v3'"):
        verify_engine("http://127.0.0.1:9", ck, tp=2, algo="nemo-rl-v3")
    capsys.readouterr()


def test_missing_endpoint_and_a_server_that_is_down() -> None:
    from wcviz._serving import serve_in_thread, stop_server

    server, thread, url = serve_in_thread(Starlette(routes=[]), "127.0.0.1", 0, name="no checker")
    try:
        with pytest.raises(EngineEndpointError, match="no /weights_checker") as err:
            from_sglang(url)
        assert err.value.kind == "missing"
    finally:
        stop_server(server, thread, "no checker")
    res = from_sglang(url, timeout_s=2)  # nothing listens there now
    assert list(res.failed["kind"]) == ["unreachable"] and not res.complete
    act = sglang_action(url, "snapshot", timeout_s=2)
    assert act.unreachable == {url} and not act.complete


def test_sglang_checksums_are_never_compared_with_nemo_digests() -> None:
    sim = SimSglang(TINY, tp=1)
    with sim as url:
        res = from_sglang(url)
    ours = from_named_tensors(sim.shards[(0, 0, 0)].params, role="engine", rank=0, dp=0, pp=0, tp=0)
    with pytest.raises(AlgorithmMismatch):
        compare(ours, res.frame)


# --------------------------------------------------------------------------- the end-state check through SGLang's checker


def test_endstate_finds_the_rank_whose_reload_skipped_a_weight() -> None:  # while SGLang's compare, on TP rank 0, passes
    sim = SimSglang(TINY, tp=2)

    def reload() -> None:
        sim.shards[(0, 0, 1)].faults = LoaderFaults(skip=r"down_proj")
        sim.load()

    with sim as url:
        result = sglang_endstate(url, reload)
    v = result.verdicts
    # SGLang's reset writes random values: no reset digest proves a whole parameter was overwritten,
    # so what reloads equal to its snapshot is "unproven", never "match"; the unwritten ones still stand out
    assert set(v["status"]) == {"unwritten", "unproven"}
    bad = v[v["status"] == "unwritten"]
    assert set(zip(bad["pp"], bad["tp"])) == {(0, 1)}
    assert sorted(bad["name"]) == DOWN
    assert (v["algo"] == "sglang-gpu").all() and len(result.unreachable) == 0
    # SGLang answers compare for TP rank 0 of stage 0 only (scheduler.py:816-839, output_sender.py:17-18): TP rank 1's
    # failed compare is only logged, so SGLang's compare passes; the per-rank verdicts above are what find TP rank 1
    assert result.compare is not None and result.compare.complete
    assert "SGLang's own compare: passed (it answers for TP rank 0 of pipeline stage 0" in result.summary
    assert "per-rank checksums cover every rank" in result.summary
    assert ("target", (0, 0, 1)) in sim.snapshots  # TP rank 1's compare failed: SGLang keeps its snapshot there
    assert any("keeps its snapshot" in n for n in result.notes)
    assert [r["body"]["action"] for r in sim.requests] == ["snapshot", "checksum", "reset_tensors", "checksum", "checksum", "compare"]


def test_endstate_clean_reload_compare_passes_and_frees_the_snapshot() -> None:
    sim = SimSglang(TINY, tp=2, draft=DRAFT)
    with sim as url:
        result = sglang_endstate(url, lambda: (sim.load(), sim.load_draft()))
    assert set(result.verdicts["status"]) == {"unproven"} and not result.ok
    assert result.compare is not None and result.compare.complete and "compare: passed" in result.summary
    assert sim.snapshots == {} and not result.notes
    assert result.frames["reload"]["name"].str.startswith("draft.").any()


def test_endstate_a_scheduler_that_stops_answering_is_unreachable() -> None:
    sim = SimSglang(TINY, tp=1, dp=2)

    def reload() -> None:
        sim.load()
        sim.failing = {1}  # DP scheduler 1 fails every request from now on

    with sim as url:
        result = sglang_endstate(url, reload, compare=False)
    v = result.verdicts
    gone = v[v["status"] == "unreachable"]
    assert set(gone["dp"]) == {1} and len(result.unreachable) == 1
    assert (v.loc[v["status"] != "unreachable", "status"] == "unproven").all()


def test_endstate_reset_failure_reloads_then_raises_and_failed_reload_says_poisoned() -> None:
    sim = SimSglang(TINY, tp=1, dp=2)
    reloads = []

    def fail_reset() -> None:
        reloads.append(1)

    with sim as url:
        original = sim._handle

        def broken_reset(action: str, *a: Any) -> Any:
            if action == "reset_tensors" and a[-1][0] == 1:
                raise RuntimeError("cuda error on DP rank 1")
            return original(action, *a)

        sim._handle = broken_reset  # type: ignore[method-assign]
        with pytest.raises(EngineEndpointError, match="reset_tensors did not complete"):
            sglang_endstate(url, fail_reset)
        assert reloads == [1]  # the reload ran before the error was raised
        sim._handle = original  # type: ignore[method-assign]

        def broken() -> None:
            raise RuntimeError("trainer gone")

        with pytest.raises(EngineLeftPoisoned, match="trainer gone"):
            sglang_endstate(url, broken)


def test_the_fleet_refuses_mutations_unless_allowed() -> None:
    fleet = SglangFleet("http://127.0.0.1:1", None, allow_mutations=False)
    assert "allow_mutations=True" in (fleet.mutation_block() or "")
    with pytest.raises(PermissionError, match="allow_mutations=True"):
        fleet.act("reset")  # refused before anything is sent: nothing listens there anyway
    assert "allow_mutations=True" in (SglangFleet("http://127.0.0.1:1", lambda: None).mutation_block() or "")
    fleet = SglangFleet("http://127.0.0.1:1", None, allow_mutations=True)
    assert "no reload given" in (fleet.mutation_block() or "")
    assert SglangFleet("http://127.0.0.1:1", lambda: None, allow_mutations=True).mutation_block() is None


def test_per_engine_checksum_is_sglangs() -> None:
    sim = SimSglang(TINY, tp=2, dp=2)
    with sim as url:
        body = _raw(url, {"action": "checksum"}).json()
    h = hashlib.sha256()
    for entry in body["ranks"]:
        h.update(entry["per_gpu_checksum"].encode())
    assert body["per_engine_checksum"] == h.hexdigest()
    assert pd.Series([e["parallelism_info"][0]["dp_rank"] for e in body["ranks"]]).tolist() == [0, 0, 1, 1]
    assert build_state_dict(TINY)  # the weights every rank loaded


def _attention_dp_answer(tp: int, groups: int, alter: bool = False) -> dict[str, Any]:
    """SGLang 0.5.23 with attention DP: every attention-DP group's leader answers (``scheduler.py``
    ``is_rank_zero``; the tokenizer fans out to ``num_dp_ranks``), each with the ``all_gather`` of the whole TP
    group (``weight_updater.py`` ``check_weights``), so ``ranks`` lists every TP rank once per group."""

    def overall(c: dict[str, str]) -> str:
        h = hashlib.sha256()
        for n in sorted(c):
            h.update(n.encode())
            h.update(c[n].encode())
        return h.hexdigest()

    entries = []
    for t in range(tp):
        c = {"model.layers.0.mlp.down_proj.weight": f"{t + 1:016x}"}
        info = {"role": "target", "tp_rank": t, "tp_size": tp, "dp_rank": t // (tp // groups), "dp_size": groups,
                "pp_rank": 0, "pp_size": 1, "rank": t, "size": tp}  # fmt: skip
        entries.append({"checksums": c, "per_gpu_checksum": overall(c), "parallelism_info": [info]})
    ranks = [dict(e) for _ in range(groups) for e in entries]
    if alter:  # the second copy of rank 0 holds something else: not the same answer twice
        c = {"model.layers.0.mlp.down_proj.weight": f"{99:016x}"}
        ranks[tp] = {**ranks[tp], "checksums": c, "per_gpu_checksum": overall(c)}
    per_engine = hashlib.sha256("".join(r["per_gpu_checksum"] for r in ranks).encode()).hexdigest()
    return {"success": True, "message": " | ".join(["Success."] * groups), "ranks": ranks, "per_engine_checksum": per_engine}


def test_attention_dp_lists_each_rank_once_per_group_and_reads_as_one_rank_each() -> None:
    body = _attention_dp_answer(tp=4, groups=2)
    res = from_sglang("http://sg", transport=httpx.MockTransport(lambda r: httpx.Response(200, json=body)))
    assert res.complete and res.answered == 4, res.summary
    got = res.frame.sort_values("tp")
    assert got["tp"].tolist() == [0, 1, 2, 3] and got["dp"].tolist() == [0, 0, 1, 1] and got["rank"].tolist() == [0, 1, 2, 3]
    assert got["digest"].tolist() == [f"{t + 1:016x}" for t in range(4)]
    body = _attention_dp_answer(tp=4, groups=2, alter=True)  # two different answers for one rank: neither is trusted
    res = from_sglang("http://sg", transport=httpx.MockTransport(lambda r: httpx.Response(200, json=body)))
    assert not res.complete and sorted(res.failed["tp"].dropna().tolist()) == [0, 0]
    assert all("claims the same rank" in e for e in res.failed["error"])


def test_an_answer_implying_absurd_sizes_is_one_failed_row_not_a_million() -> None:
    """tp_size 1000 x pp_size 500 in parallelism_info made the client list 499,999 'not reported' ranks (seconds of
    CPU, and memory growing with the claim): an answer beyond MAX_IMPLIED_RANKS is refused as a whole."""
    from wcviz.sources._sglang import _overall

    sums = {"w": "0123456789abcdef"}
    info = {"role": "target", "tp_rank": 0, "tp_size": 1000, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 500, "rank": 0, "size": 1}
    body = {"success": True, "message": "Success.", "ranks": [{"checksums": sums, "per_gpu_checksum": _overall(sums), "parallelism_info": [info]}]}
    res, _ = _fetched_from_checker_answering(body)
    assert len(res.failed) == 1 and not res.complete
    assert "more than 65,536" in res.failed["error"].iloc[0]


def test_an_endstate_over_stages_the_checker_never_hears_reports_them_unreachable() -> None:
    """SGLang 0.5.23's checker answers from pipeline stage 0 only: a rank silent to the checksum, under an action
    sent to the whole engine, was taken for a living rank whose snapshot failed, and every pp > 1 engine was refused
    ("failed on 1 rank that otherwise answered")."""
    from wcviz.sim import SimSglang
    from wcviz.sim.model import TINY

    sim = SimSglang(TINY, tp=1, pp=2)
    with sim as url:
        report = sglang_endstate(url, sim.load, compare=False)
    assert "1 rank unreachable (rank 1 (dp=0 pp=1 tp=0): did not answer)" in report.summary
    assert [q["body"]["action"] for q in sim.requests][:3] == ["snapshot", "checksum", "reset_tensors"]
