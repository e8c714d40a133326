"""vLLM's own weight checker, as vLLM 0.33.0 answers it, over real HTTP on loopback; and expected against live.

The server is :class:`wcviz.sim.SimVllm`, written from vLLM 0.33.0's
``vllm/entrypoints/rl/online/api_router.py`` (``weight_checker``: ``checksum`` ->
``{"checksums"}``, ``reset`` -> ``{"status": "reset"}``, ``compare`` -> ``{"match",
"mismatches"}``, 400 for a compare without baseline; ``get_world_size``),
``vllm/v1/worker/gpu_worker.py`` (``dp{data_parallel_index}:pp{}:pcp{}:tp{}:`` key
prefixes), ``vllm/model_executor/model_loader/weight_checksum.py`` (sha256 of the raw
bytes; the reset zeros ``named_parameters()``),
``vllm/v1/engine/core_client.py`` (every DP engine the API server manages) and
``vllm/entrypoints/serve/exception_handling`` (``{"error": {"message", "type",
"param", "code"}}``). vLLM answers these routes with plain ``JSONResponse`` dicts: there
is no response model in the wheel to validate the fake against. No live vLLM was run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest

from wcviz.cli import main
from wcviz.endstate import VllmCheckerFleet, vllm_endstate
from wcviz.layouts import expected_frame
from wcviz.live import verify_engine
from wcviz.sim import SimSglang, SimVllm
from wcviz.sim.engine import LoaderFaults
from wcviz.sim.model import TINY, build_state_dict, save_checkpoint, step
from wcviz.sources import EngineEndpointError, from_vllm_weight_checker, vllm_checksum_keys, vllm_weight_checker
from wcviz.widgets import DashboardState

SD = build_state_dict(TINY)


def _sha(t) -> str:  # noqa: ANN001 - vLLM's compute_tensor_digests, as written there
    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(__import__("torch").uint8).numpy()).hexdigest()


def test_checksums_become_rows_under_dp_pp_tp_with_vllms_rank_numbering() -> None:
    sim = SimVllm(TINY, tp=2, pp=2, dp=2)
    with sim as url:
        res = from_vllm_weight_checker(url, phase="snapshot")
    assert res.complete and res.answered == 8, res.summary
    assert set(res.frame["algo"]) == {"vllm-sha256"} and set(res.frame["phase"]) == {"snapshot"}
    for (d, p, t), rows in res.frame.groupby(["dp", "pp", "tp"]):
        shard = sim.shards[(d, p, t)]
        assert dict(zip(rows["name"], rows["digest"])) == {n: _sha(w) for n, w in shard.params.items()}
        assert set(rows["rank"]) == {(d * 2 + p) * 2 + t}  # vLLM's reshape(-1, dp, pp, pcp, tp)
        assert set(rows["url"]) == {f"{url} dp{d}:pp{p}:pcp0:tp{t}"}
    assert res.frame["nbytes"].isna().all() and res.frame["ep"].isna().all()
    keys = vllm_checksum_keys(res.frame)
    assert len(keys) == len(res.frame) and "dp1:pp1:pcp0:tp1:model.norm.weight" in keys


def test_a_server_that_reaches_only_its_own_engine_is_not_complete() -> None:
    """External DP load balancing: each API server manages one engine, /get_world_size counts them all."""
    sim = SimVllm(TINY, tp=2, dp=2, managed=[0])
    with sim as url:
        res = from_vllm_weight_checker(url)
    assert res.answered == 2 and not res.complete
    assert list(zip(res.failed["dp"], res.failed["tp"], res.failed["rank"])) == [(1, 0, 2), (1, 1, 3)]
    assert set(res.failed["kind"]) == {"unreachable"} and "counts 4 ranks, 2 answered" in res.failed["error"].iloc[0]


def test_dev_mode_off_is_explained_and_a_down_server_is_reported() -> None:
    sim = SimVllm(TINY, dev_mode=False)
    with sim as url:
        with pytest.raises(EngineEndpointError, match="VLLM_SERVER_DEV_MODE=1") as err:
            from_vllm_weight_checker(url)
        assert err.value.kind == "missing"
        assert httpx.get(f"{url}/get_world_size").json() == {"detail": "Not Found"}  # no vLLM error handler for 404
    res = from_vllm_weight_checker(url, timeout_s=2)
    assert list(res.failed["kind"]) == ["unreachable"] and not res.complete


def test_reset_compare_and_vllms_error_bodies() -> None:
    sim = SimVllm(TINY, tp=2)
    with sim as url:
        before = vllm_checksum_keys(from_vllm_weight_checker(url).frame)
        assert vllm_weight_checker(url, "compare", baseline=before) == {"match": True, "mismatches": []}
        assert vllm_weight_checker(url, "reset") == {"status": "reset"}
        assert all(float(w.abs().sum()) == 0 for s in sim.shards.values() for w in s.params.values())
        after = vllm_weight_checker(url, "compare", baseline=before)
        assert after["match"] is False and after["mismatches"] == sorted(before)
        bad = httpx.post(f"{url}/weight_checker", json={"action": "compare"})
        assert bad.status_code == 400 and bad.json()["error"]["message"] == "action='compare' requires a 'baseline' object"
        wrong = httpx.post(f"{url}/weight_checker", json={"action": "delete"})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "body.action"
        with pytest.raises(ValueError, match="needs a baseline"):
            vllm_weight_checker(url, "compare")
        with pytest.raises(ValueError, match="unknown weight_checker action"):
            vllm_weight_checker(url, "delete")


def test_a_token_is_sent_when_given() -> None:
    sim = SimVllm(TINY)
    with sim as url:
        from_vllm_weight_checker(url, token="proxy-key")
    assert {r["headers"].get("authorization") for r in sim.requests} == {"Bearer proxy-key"}


# --------------------------------------------------------------------------- the end-state check through vLLM's checker


def _skip_on_reload(sim: SimVllm, coords: tuple[int, int, int], pattern: str):  # noqa: ANN202
    def reload() -> None:
        sim.shards[coords].faults = LoaderFaults(skip=pattern)
        sim.load()

    return reload


def test_endstate_with_sizes_proves_coverage_and_finds_the_unwritten_weight() -> None:
    sim = SimVllm(TINY, tp=2)
    sizes = expected_frame(SD, "llama", tp=2, heads=TINY.heads, kv_heads=TINY.kv_heads, vocab_padding=1, algo="vllm-sha256")
    with sim as url:
        report = vllm_endstate(url, _skip_on_reload(sim, (0, 0, 1), r"layers\.1\.mlp\.down"), sizes=sizes)
    v = report.verdicts
    assert set(v["status"]) == {"unwritten", "match"}  # zeros are computable: every other weight is proven rewritten
    bad = v[v["status"] == "unwritten"]
    assert list(zip(bad["tp"], bad["name"])) == [(1, "model.layers.1.mlp.down_proj.weight")]
    assert report.compare is not None and "dp0:pp0:pcp0:tp1:model.layers.1.mlp.down_proj.weight" in report.compare.errors[url]
    assert "vLLM's own compare: FAILED" in report.summary
    assert [r["body"]["action"] for r in sim.requests if r["path"] == "/weight_checker"] == ["checksum", "reset", "checksum", "checksum", "compare"]


def test_endstate_without_sizes_is_unproven_but_still_finds_the_unwritten_weight() -> None:
    sim = SimVllm(TINY, tp=2)
    with sim as url:
        report = vllm_endstate(url, _skip_on_reload(sim, (0, 0, 0), r"layers\.0\.self_attn\.o_proj"))
    v = report.verdicts
    assert set(v["status"]) == {"unwritten", "unproven"} and not report.ok
    assert list(v.loc[v["status"] == "unwritten", "name"]) == ["model.layers.0.self_attn.o_proj.weight"]


def test_endstate_clean_reload_passes_with_vllms_compare() -> None:
    sim = SimVllm(TINY, tp=2, pp=2)
    sizes = expected_frame(SD, "llama", tp=2, pp=2, heads=TINY.heads, kv_heads=TINY.kv_heads, vocab_padding=1, algo="vllm-sha256")
    with sim as url:
        report = vllm_endstate(url, sim.load, sizes=sizes)
    assert report.ok and set(report.verdicts["status"]) == {"match"}, report.summary
    assert "vLLM's own compare: passed" in report.summary


def test_dashboard_drives_the_native_fleets() -> None:
    sim = SimVllm(TINY, tp=2)
    with sim as url:
        state = DashboardState(VllmCheckerFleet(url, sim.load, allow_mutations=True))
        assert state.mutation_block is None
        frame = state.fetch()
        assert len(frame) and set(frame["algo"]) == {"vllm-sha256"}
        for phase in ("snapshot", "reset", "reload"):
            state.phase(phase)
        state.compare()
        assert state.verdicts is not None and set(state.verdicts["status"]) == {"unproven"}
        locked = DashboardState(VllmCheckerFleet(url, sim.load))  # mutations are opt-in
        assert "allow_mutations=True" in (locked.mutation_block or "")
        with pytest.raises(PermissionError):
            locked.phase("snapshot")


# --------------------------------------------------------------------------- expected against live, read-only


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(SD, tmp_path_factory.mktemp("ckpt"), config=TINY)


def test_verify_a_clean_engine_matches_every_rank(checkpoint: Path) -> None:
    for engine, sim in (("vllm", SimVllm(TINY, tp=2, pp=2)), ("sglang", SimSglang(TINY, tp=2))):
        with sim as url:
            report = verify_engine(url, checkpoint, tp=2, pp=2 if engine == "vllm" else 1, vocab_padding=1)
        assert report.engine == engine and report.ok, report.summary
        assert set(report.verdicts["status"]) == {"match"}
        assert report.assumed["family"] == "llama" and report.assumed["dtype"] == "bfloat16"
        assert not any(r["body"] and r["body"].get("action") in ("reset", "reset_tensors", "snapshot") for r in sim.requests)


def test_verify_catches_the_persistent_wrong_shard_and_the_stale_replica(checkpoint: Path) -> None:
    swapped = {(0, 0, 0): LoaderFaults(tp_as=1), (0, 0, 1): LoaderFaults(tp_as=0)}  # right shapes, wrong ranks, every load
    sim = SimVllm(TINY, tp=2, dp=2, faults=swapped)
    sim.load(step(SD, 1), ranks=[(1, 0, 0), (1, 0, 1)])  # replica 1 is one step ahead of the checkpoint
    with sim as url:
        report = verify_engine(url, checkpoint, tp=2, dp=2, vocab_padding=1)
    v = report.verdicts
    assert not report.ok
    wrong = v[(v["dp"] == 0) & (v["status"] == "mismatch")]
    assert set(wrong["tp"]) == {0, 1} and wrong["name"].str.contains("qkv_proj|o_proj|down_proj|gate_up_proj|embed|lm_head").all()
    assert set(v.loc[(v["dp"] == 0) & v["name"].str.contains("norm"), "status"]) == {"match"}  # replicated: no shard to take wrongly
    stale = v[v["dp"] == 1]
    assert set(stale["status"]) == {"mismatch"}


def test_verify_marks_ranks_that_did_not_answer_unreachable(checkpoint: Path) -> None:
    sim = SimSglang(TINY, tp=2, pp=2)
    with sim as url:
        report = verify_engine(url, checkpoint, tp=2, pp=2, vocab_padding=1)
    v = report.verdicts
    assert set(v.loc[v["pp"] == 1, "status"]) == {"unreachable"} and set(v.loc[v["pp"] == 0, "status"]) == {"match"}
    assert not report.ok and "pipeline stage 0 only" in report.summary


def test_cli_verify_exit_codes(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sim = SimVllm(TINY, tp=2, faults={(0, 0, 1): LoaderFaults(fused_from_rank0=True)})
    with sim as url:
        out = tmp_path / "verdicts.csv"
        assert main(["verify", url, "--checkpoint", str(checkpoint), "--tp", "2", "--vocab-padding", "1", "--out", str(out)]) == 1
        text = capsys.readouterr().out
        assert "mismatch" in text and "qkv_proj" in text and "vllm at" in text
        assert (pd.read_csv(out)["status"] == "mismatch").any()
        sim.shards[(0, 0, 1)].faults = LoaderFaults()
        sim.load()
        assert main(["verify", url, "--checkpoint", str(checkpoint), "--tp", "2", "--vocab-padding", "1"]) == 0
        bare = tmp_path / "bare"
        save_checkpoint(SD, bare)  # no config.json: heads must be given
        assert main(["verify", url, "--checkpoint", str(bare), "--tp", "2"]) == 2
        assert "num_attention_heads" in capsys.readouterr().err
        assert main(["verify", url, "--checkpoint", str(checkpoint), "--tp", "3", "--vocab-padding", "1"]) == 2
    assert json.loads((checkpoint / "config.json").read_text())["num_attention_heads"] == TINY.heads


def test_verify_an_engine_that_fails_as_a_whole_is_unreachable_by_rank_and_exits_1(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An HTTP 500 for the whole engine left no rows: the comparison refused the empty table ("locates ranks by
    nothing") and the CLI said bad input (2), hiding the engine's own error."""

    async def oops(request: object) -> object:
        from starlette.responses import PlainTextResponse

        return PlainTextResponse("oops", status_code=500)

    from starlette.applications import Starlette
    from starlette.routing import Route

    app = Starlette(routes=[Route(p, oops, methods=["GET", "POST"]) for p in ("/get_world_size", "/weight_checker")])
    from test_vllm import serve  # a loopback uvicorn for any app

    with serve(app) as url:
        report = verify_engine(url, checkpoint, tp=2, engine="vllm", vocab_padding=1)
        assert main(["verify", url, "--checkpoint", str(checkpoint), "--tp", "2", "--engine", "vllm", "--vocab-padding", "1"]) == 1
    assert not report.ok and set(report.verdicts["status"]) == {"unreachable"}
    assert sorted(report.verdicts["tp"].unique()) == [0, 1]
    assert "HTTP 500: oops" in capsys.readouterr().out


def test_verify_an_engine_nothing_answers_for_is_unreachable_and_exits_1_whatever_engine_is_named(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With ``--engine auto`` a refused connection used to leave the detection step as bad input (exit 2); the
    exit code must not depend on whether the user named the engine."""
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    for engine in ("auto", "vllm", "sglang"):
        assert main(["verify", url, "--checkpoint", str(checkpoint), "--tp", "2", "--engine", engine, "--vocab-padding", "1", "--timeout", "5"]) == 1, engine
        out = capsys.readouterr().out
        assert "unreachable" in out, (engine, out)
    report = verify_engine(url, checkpoint, tp=2, vocab_padding=1, timeout_s=5)
    assert not report.ok and set(report.verdicts["status"]) == {"unreachable"}
    assert "did not answer" in report.summary


def test_verify_a_failing_dp_replica_is_unreachable_not_missing(checkpoint: Path) -> None:
    sim = SimSglang(TINY, tp=2, dp=2, failing=[1])
    with sim as url:
        report = verify_engine(url, checkpoint, tp=2, dp=2, vocab_padding=1)
    v = report.verdicts
    assert set(v.loc[v["dp"] == 1, "status"]) == {"unreachable"} and set(v.loc[v["dp"] == 0, "status"]) == {"match"}


def test_verify_refuses_a_served_dtype_that_is_not_one(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with SimVllm(TINY, tp=2) as url:
        for dtype in ("junk", "Tensor"):
            assert main(["verify", url, "--checkpoint", str(checkpoint), "--tp", "2", "--dtype", dtype]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"the served dtype {dtype!r}" in err


def _pcp_app(sums: dict[str, str], spoil: str | None = None):  # noqa: ANN202 - a Starlette app
    """vLLM 0.33 with --prefill-context-parallel-size 2: every key once per PCP rank (the same TP shard), world 4."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    both = {**sums, **{k.replace(":pcp0:", ":pcp1:"): v for k, v in sums.items()}}
    if spoil is not None:
        both[spoil] = "0" * 64

    async def checker(request: object) -> JSONResponse:
        return JSONResponse({"checksums": both})

    async def world(request: object) -> JSONResponse:
        return JSONResponse({"world_size": 4})  # TP x PP x PCP, DP 1: the same with or without include_dp

    return Starlette(routes=[Route("/weight_checker", checker, methods=["POST"]), Route("/get_world_size", world, methods=["GET"])])


def test_prefill_context_parallel_ranks_are_checked_against_pcp0_not_collided(checkpoint: Path) -> None:
    """PCP ranks carry the same dp/pp/tp: two rows per (rank, name) made verify exit 2 ("share a key"). Now
    pcp0 stands for the shard and every other PCP rank must hold exactly what pcp0 holds."""
    from test_vllm import serve

    sim = SimVllm(TINY, tp=2)
    with sim as url0:
        sums = httpx.post(url0 + "/weight_checker", json={"action": "checksum"}).json()["checksums"]
    with serve(_pcp_app(sums)) as url:
        assert main(["verify", url, "--checkpoint", str(checkpoint), "--tp", "2", "--engine", "vllm", "--vocab-padding", "1"]) == 0
    spoiled = next(k for k in sums if k.startswith("dp0:pp0:pcp0:tp1:")).replace(":pcp0:", ":pcp1:")
    with serve(_pcp_app(sums, spoil=spoiled)) as url:
        res = from_vllm_weight_checker(url)
        report = verify_engine(url, checkpoint, tp=2, engine="vllm", vocab_padding=1)
    assert not res.complete and "pcp1 holds other weights than pcp0" in " ".join(res.failed["error"])
    assert not report.ok


def test_auto_names_a_vllm_without_dev_mode_as_vllm_with_the_dev_mode_hint(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM always serves GET /version; without dev mode it was taken for an SGLang with no /weights_checker."""
    with SimVllm(TINY, tp=2, dev_mode=False) as url:
        assert main(["verify", url, "--checkpoint", str(checkpoint), "--tp", "2", "--vocab-padding", "1"]) == 2
    err = capsys.readouterr().err
    assert "VLLM_SERVER_DEV_MODE=1" in err and "SGLang" not in err


def test_endstate_ok_is_false_when_vllms_own_compare_failed() -> None:
    """A pass printed beside "vLLM's own compare: FAILED" was ``ok``."""
    from wcviz.endstate.engines import EngineEndstate
    from wcviz.sources import ActionResult

    failed = ActionResult("compare", ("http://e",))
    failed.errors["http://e"] = "1 checksum(s) differ from the snapshot"
    passed = ActionResult("compare", ("http://e",), answers={"http://e": {}})
    verdicts = pd.DataFrame({"rank": pd.array([0], dtype="Int64"), "name": ["w"], "status": ["match"]})
    empty = pd.DataFrame({c: [] for c in ("phase", "step", "url", "kind", "error", "rank")})
    assert EngineEndstate(verdicts=verdicts, frames={}, problems=empty, compare=passed, engine="vLLM").ok
    assert not EngineEndstate(verdicts=verdicts, frames={}, problems=empty, compare=failed, engine="vLLM").ok


@pytest.mark.parametrize(("url", "said"), [("127.0.0.1:8000", "is not an engine URL"), ("http://127.0.0.1:99999", "port 99999")])
def test_verify_refuses_a_bad_url_and_out_before_digesting(checkpoint: Path, capsys: pytest.CaptureFixture[str], url: str, said: str) -> None:
    assert main(["verify", url, "--checkpoint", str(checkpoint), "--tp", "2"]) == 2
    assert said in capsys.readouterr().err
    assert main(["verify", "http://127.0.0.1:9", "--checkpoint", str(checkpoint), "--tp", "2", "--out", "/nonexistent/x.csv"]) == 2
    assert "/nonexistent" in capsys.readouterr().err


def test_pcp_ranks_whose_experts_differ_are_said_not_checked_never_passed() -> None:
    """vLLM 0.33's expert-parallel group spans DP x PCP x TP (distributed/parallel_state.py): PCP ranks then hold
    other experts, which wcviz does not place. A failed row says so; the result is never complete."""
    from test_vllm import serve

    h = "ab" * 32
    sums = {f"dp0:pp0:pcp0:tp{t}:{n}": h for t in (0, 1) for n in ("model.norm.weight", "model.layers.0.mlp.experts.w13_weight")}
    spoiled = "dp0:pp0:pcp1:tp1:model.layers.0.mlp.experts.w13_weight"
    with serve(_pcp_app(sums, spoil=spoiled)) as url:
        res = from_vllm_weight_checker(url)
    (row,) = res.failed.to_dict(orient="records")
    assert "pcp1's experts differ from pcp0's" in row["error"] and "not checked" in row["error"] and not res.complete


def test_a_rank_that_answered_keeps_its_missing_rows_when_a_rank_at_the_same_place_is_silent(tmp_path: Path) -> None:
    """With vLLM's PCP, two ranks share (dp, pp, tp): the silent pcp1 rank turned the answering pcp0 rank's missing
    weight into 'unreachable', which says the rank did not answer."""
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from test_vllm import serve
    from wcviz.sim.model import TINY, build_state_dict, save_checkpoint

    ckpt = save_checkpoint(build_state_dict(TINY), tmp_path, config=TINY)
    with SimVllm(TINY, tp=2) as url:
        sums = httpx.post(url + "/weight_checker", json={"action": "checksum"}).json()["checksums"]
    gone = next(k for k in sums if k.startswith("dp0:pp0:pcp0:tp1:") and "down_proj" in k)
    both = {**sums, **{k.replace(":pcp0:", ":pcp1:"): v for k, v in sums.items()}}
    answered = {k: v for k, v in both.items() if k != gone and not k.startswith("dp0:pp0:pcp1:tp1:")}

    async def checker(request: Any) -> JSONResponse:
        return JSONResponse({"checksums": answered})

    async def world(request: Any) -> JSONResponse:
        return JSONResponse({"world_size": 4})

    app = Starlette(routes=[Route("/weight_checker", checker, methods=["POST"]), Route("/get_world_size", world, methods=["GET"])])
    with serve(app) as url:
        report = verify_engine(url, ckpt, tp=2, engine="vllm", vocab_padding=1)
    v = report.verdicts
    assert v.loc[(v["tp"] == 1) & (v["name"] == gone.split(":", 4)[4]), "status"].tolist() == ["missing"]
