"""The simulated cluster as real processes: agents, fetch, in-job gather, the end-state check, teardown.

One TP 2 x PP 2 cluster (5 processes) serves most tests; tests that kill ranks or the
driver start their own, smaller ones. Expected ranks and names are written out by
hand from the layout: TINY has 3 layers, so pipeline stage 0 holds the embedding and
layers 0-1, stage 1 holds layer 2, the final norm and lm_head.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pandas as pd
import pytest
import torch

from wcviz.endstate import check_agents
from wcviz.sim import TINY, Cluster, ClusterError, EngineLayout, EngineShard, LoaderFaults, build_state_dict, step
from wcviz.sources import act, fetch

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = EngineLayout(tp=2, pp=2)
L01 = ("model.layers.0.", "model.layers.1.")


@pytest.fixture(scope="module")
def cluster():
    with Cluster(TINY, LAYOUT, verify="log", allow_mutations=True, timeout_s=60) as c:
        c.step()
        c.refit()
        yield c
    assert all(not _alive(pid) for pid in c.pids), "a rank outlived the with block"


@pytest.fixture
def healthy(cluster: Cluster) -> Cluster:
    """The module cluster with no loader faults and every engine holding the trainer's weights."""
    cluster.set_faults(None)
    cluster.refit()
    return cluster


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes (its parent has not reaped it yet)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _bad(report) -> set[tuple[int, str, str]]:
    v = report.verdicts
    v = v[v["status"] != "match"]
    return {(int(r.rank), r.name, r.status) for r in v.itertuples()}


# --------------------------------------------------------------------------- layout and identity


def test_ranks_have_vllm_coordinates_and_agents(cluster: Cluster) -> None:
    assert [(i.rank, i.dp, i.pp, i.tp) for i in cluster.engine_ranks] == [(0, 0, 0, 0), (1, 0, 0, 1), (2, 0, 1, 0), (3, 0, 1, 1)]
    assert cluster.trainer.role == "trainer" and cluster.trainer.world_rank == 0
    assert len(set(cluster.pids)) == 5 and all(_alive(p) for p in cluster.pids)
    assert len(cluster.urls("engine")) == 4 and len(cluster.urls(None)) == 5


def test_fetch_identity_comes_from_info_not_url_order(healthy: Cluster) -> None:
    urls = list(healthy.urls("engine"))
    a = fetch(urls)
    shuffled = urls[:]
    random.Random(3).shuffle(shuffled)
    b = fetch(shuffled[::-1] if shuffled == urls else shuffled)
    assert a.complete and b.complete and a.summary == "4 of 4 ranks answered"
    timing = ["url", "seconds"]  # where and how fast differ; what each rank holds must not
    pd.testing.assert_frame_equal(a.frame.drop(columns=timing), b.frame.drop(columns=timing))
    per_rank = a.frame.groupby("rank")["name"].count().to_dict()
    assert per_rank == {0: 13, 1: 13, 2: 8, 3: 8}  # embed + 2 layers x 6; layer 2 x 6 + norm + head
    stage0 = set(a.frame.loc[a.frame["pp"] == 0, "name"])
    assert "model.embed_tokens.weight" in stage0 and "lm_head.weight" not in stage0
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"} <= stage0


def test_a_swapped_pair_of_agent_urls_is_caught(healthy: Cluster) -> None:
    """A launcher that mixed up which rank lives where: the expected identities say so."""
    expect = healthy.urls("engine")
    u0, u1 = list(expect)[:2]
    swapped = {**expect, u0: expect[u1], u1: expect[u0]}
    res = fetch(swapped)
    assert res.answered == 2 and set(res.errors) == {u0, u1}
    assert "/v1/info says rank=0, tp=0 but this URL was expected to serve rank=1, tp=1" in res.errors[u0]


def test_in_job_gather_equals_http_fetch(healthy: Cluster) -> None:
    gathered = healthy.gather(phase="current")
    fetched = fetch(healthy.urls("engine")).frame
    keys = ["rank", "pp", "tp", "name"]
    a = gathered.sort_values(keys)[keys + ["digest"]].reset_index(drop=True)
    b = fetched.sort_values(keys)[keys + ["digest"]].reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b)
    assert len(a) == 42 and (gathered["phase"] == "current").all()


def test_engines_hold_the_trainers_weights_after_a_refit(healthy: Cluster) -> None:
    """Digests of each rank's params equal those of a shard loaded in this process from the trainer's step."""
    weights = build_state_dict(TINY)
    for k in range(1, healthy.step_k + 1):
        weights = step(weights, k)
    fetched = fetch(healthy.urls("engine")).frame
    from wcviz.digest import digest_hex

    for info in healthy.engine_ranks:
        shard = EngineShard(TINY, info.tp, 2, info.pp, 2)
        shard.load_weights(weights.items())
        mine = fetched[fetched["rank"] == info.rank].set_index("name")["digest"].to_dict()
        assert mine == {n: digest_hex(t) for n, t in shard.params.items()}


# --------------------------------------------------------------------------- loader faults, classified


def test_healthy_update_all_match_and_transport_verified(healthy: Cluster) -> None:
    report = healthy.endstate()
    assert report.ok and len(report.verdicts) == 42 and _bad(report) == set()
    assert report.transport.verified and report.transport.ok and sorted(report.transport.ranks) == [0, 1, 2, 3]
    assert report.summary == "end-state check: 4 ranks, 42 parameters: 42 match"


def _expected(fault: str) -> set[tuple[int, str, str]]:
    attn = "self_attn.qkv_proj.weight"
    if fault == "skip_down_proj":
        return {(1, f"{p}mlp.down_proj.weight", "unwritten") for p in L01}
    if fault == "skip_k_proj":  # q and v rows are written, k rows keep the poison: a third value
        return {(1, f"{p}{attn}", "corrupted") for p in L01}
    if fault == "stale":
        held = ["input_layernorm", "self_attn.qkv_proj", "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_up_proj", "mlp.down_proj"]
        return {(3, f"model.layers.2.{h}.weight", "unwritten") for h in held} | {(3, "model.norm.weight", "unwritten"), (3, "lm_head.weight", "unwritten")}
    if fault == "fused_from_rank0":  # only the TP rank 1 shards differ; rank 0's slice is rank 0's
        fused = [attn, "mlp.gate_up_proj.weight"]
        return {(1, f"{p}{f}", "corrupted") for p in L01 for f in fused} | {(3, f"model.layers.2.{f}", "corrupted") for f in fused}
    if fault == "flip_lm_head":
        return {(3, "lm_head.weight", "corrupted")}
    if fault == "swap":  # every TP-split weight of stage 0; the replicated norms still match
        split = [attn, "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight"]
        names = ["model.embed_tokens.weight"] + [f"{p}{s}" for p in L01 for s in split]
        return {(r, n, "corrupted") for r in (0, 1) for n in names}
    raise KeyError(fault)


FAULTS = {
    "skip_down_proj": {1: LoaderFaults(skip=r"mlp\.down_proj")},
    "skip_k_proj": {1: LoaderFaults(skip=r"self_attn\.k_proj")},
    "stale": {3: LoaderFaults(stale=True)},
    "fused_from_rank0": {r: LoaderFaults(fused_from_rank0=True) for r in range(4)},
    "flip_lm_head": {3: LoaderFaults(flip_bit=r"lm_head")},
    "swap": {0: LoaderFaults(tp_as=1), 1: LoaderFaults(tp_as=0)},
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_loader_fault_is_classified_exactly(healthy: Cluster, fault: str) -> None:
    report = healthy.endstate(faults=FAULTS[fault])
    assert _bad(report) == _expected(fault)
    assert report.transport.verified and report.transport.ok  # the bytes arrived: only the loader is wrong
    assert not report.ok and not len(report.problems)
    assert report.verdicts["reset_covered"].all()


def test_swapped_ranks_are_named_as_holding_each_other(healthy: Cluster) -> None:
    report = healthy.endstate(faults=FAULTS["swap"])
    bad = report.verdicts[report.verdicts["status"] == "corrupted"]
    on0 = set(bad.loc[bad["rank"] == 0, "same_as"])
    on1 = set(bad.loc[bad["rank"] == 1, "same_as"])
    assert on0 == {"rank 1 (dp=0 pp=0 tp=1)"} and on1 == {"rank 0 (dp=0 pp=0 tp=0)"}
    assert "hold another rank's snapshot" in report.summary


def test_cast_fault_corrupts_exactly_the_params_whose_bits_change(healthy: Cluster) -> None:
    """float16 holds most bfloat16 values exactly: only parameters with a value it cannot hold change."""
    faults = LoaderFaults(cast=r".")  # every weight of engine rank 0 goes through float16
    weights = build_state_dict(TINY)
    for k in range(1, healthy.step_k + 1):
        weights = step(weights, k)
    clean, faulty = EngineShard(TINY, 0, 2, 0, 2), EngineShard(TINY, 0, 2, 0, 2, faults)
    clean.load_weights(weights.items())
    faulty.load_weights(weights.items())
    changed = {(0, n, "corrupted") for n in clean.params if not torch.equal(clean.params[n], faulty.params[n])}
    assert 0 < len(changed) < len(clean.params)  # tiny values lose bits; the norms (near 1) survive
    report = healthy.endstate(faults={0: faults})
    assert _bad(report) == changed


def test_persistent_fused_fault_passes_the_endstate_check(healthy: Cluster) -> None:
    """The check's limit, stated as a test: a deterministic wrong shard reloads the same wrong values."""
    healthy.set_faults(FAULTS["fused_from_rank0"])
    healthy.refit()
    report = healthy.endstate()
    assert report.ok  # needs expected per-shard digests to catch (computed from the trainer's weights)


# --------------------------------------------------------------------------- failures on the way


def test_failed_reload_leaves_the_report_pointing_at_the_poisoned_ranks(healthy: Cluster) -> None:
    """Agents with no checkpoint to reload from: every reload fails, the report says so first."""
    report = check_agents(healthy.urls("engine"), token=healthy.token)
    assert sorted(report.poisoned["rank"].tolist()) == [0, 1, 2, 3]
    assert report.summary.startswith("RELOAD FAILED on engine 0 (dp=0 pp=0 tp=0), engine 1 (dp=0 pp=0 tp=1)")
    assert "no checkpoint to reload from" in report.poisoned["error"].iloc[0]
    assert set(report.verdicts["status"]) == {"unwritten"} and not report.ok
    healthy.refit()  # heal: the engines are poisoned until the update runs again
    after = fetch(healthy.urls("engine")).frame
    assert len(after) == 42 and not set(after["digest"]) & set(report.frames["reset"]["digest"])


def test_mutations_need_the_token(healthy: Cluster) -> None:
    res = act(healthy.urls("engine"), "reset", token="wrong")
    assert not res.answers and len(res.errors) == 4
    assert all(e.startswith("HTTP 401") for e in res.errors.values())
    r = httpx.post(f"{healthy.engine_ranks[0].url}/v1/reset")
    assert r.status_code == 401


def test_cluster_without_opt_in_refuses_the_check() -> None:
    with pytest.raises(ClusterError, match="allow_mutations=True"):
        Cluster(TINY, EngineLayout(tp=1, pp=1)).endstate()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"layout": EngineLayout(tp=3, pp=1)}, ValueError, "tp_size 3 must divide ModelConfig.heads"),
        ({"layout": EngineLayout(tp=1, pp=4)}, ValueError, "pp_size 4 exceeds ModelConfig.layers"),
        ({"verify": "sometimes"}, ValueError, "sometimes"),
        ({"timeout_s": 0}, ValueError, "timeout_s"),
        # each of these used to be accepted here and refused only by the spawned ranks, after start-up timed out
        ({"algo": "md5"}, ValueError, "algo: unknown digest algorithm 'md5'; choose one of nemo-rl-v3, "),
        ({"token": "", "allow_mutations": True}, ValueError, "token must not be empty with allow_mutations=True"),
        ({"token": 7}, TypeError, "token must be a string, got int"),
        ({"buffer_bytes": 100}, ValueError, "invalid value for buffer_bytes: 100; it must be an integer number of bytes >= 512"),
        ({"buffer_bytes": 4096.0}, ValueError, "invalid value for buffer_bytes: 4096.0"),
    ],
)
def test_bad_cluster_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Cluster(TINY, **{"layout": LAYOUT, **kwargs})


def test_good_cluster_arguments_are_kept_as_given() -> None:
    c = Cluster(TINY, LAYOUT, algo="vllm-sha256", buffer_bytes=512, token="", timeout_s=5)  # no mutations: no token needed
    assert (c.algo, c.buffer_bytes, c.token, c.running) == ("vllm-sha256", 512, "", False)


def test_bad_fault_arguments(cluster: Cluster) -> None:
    with pytest.raises(ValueError, match=r"engine rank\(s\) \[9\] outside 0..3"):
        cluster.set_faults({9: LoaderFaults(stale=True)})
    with pytest.raises(TypeError, match="LoaderFaults"):
        cluster.set_faults("stale")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"engine rank 0: LoaderFaults.tp_as=5 is outside tp 0..1"):
        cluster.set_faults({0: LoaderFaults(tp_as=5)})


# --------------------------------------------------------------------------- dead ranks and teardown


def test_dead_rank_is_unreachable_in_fetch_and_verdicts() -> None:
    with Cluster(TINY, EngineLayout(tp=2, pp=1), allow_mutations=True, timeout_s=30) as c:
        c.save_checkpoint()
        victim = c.engine_ranks[1]
        c.kill(1)
        res = c.fetch(timeout_s=2, retries=0)
        assert res.answered == 1 and res.errors.keys() == {victim.url}
        row = res.failed.iloc[0]
        assert (row["kind"], int(row["rank"]), int(row["tp"]), int(row["pp"])) == ("unreachable", 1, 1, 0)
        assert res.summary.startswith("1 of 2 ranks answered; 1 unreachable: " + victim.url)
        report = c.endstate(reload="checkpoint", timeout_s=2, retries=0)
        v = report.verdicts
        assert set(v.loc[v["rank"] == 1, "status"]) == {"unreachable"} and v.loc[v["rank"] == 1, "name"].isna().all()
        assert set(v.loc[v["rank"] == 0, "status"]) == {"match"} and (v["rank"] == 0).sum() == 21
        assert "2 ranks, 21 parameters: 1 rank unreachable (rank 1 (dp=0 pp=0 tp=1): did not answer), 21 match" in report.summary
        assert not report.ok and set(report.problems["rank"]) == {1}
        with pytest.raises(ClusterError, match=r"engine rank 1 \(dp=0 pp=0 tp=1\) is dead"):
            c.refit()
        # the update under test by refit, with a loader fault to inject: one dead rank must not leave the other
        # poisoned (a refit needs every rank; the living one is reloaded from the trainer's checkpoint instead)
        report = c.endstate(faults={0: LoaderFaults(), 1: LoaderFaults(skip="k_proj")}, timeout_s=2, retries=0)
        v = report.verdicts
        assert set(v.loc[v["rank"] == 0, "status"]) == {"match"} and (v["rank"] == 0).sum() == 21
        assert v.loc[v["rank"] == 1, ["status", "dp", "pp", "tp"]].values.tolist() == [["unreachable", 0, 0, 1]]
        assert not len(report.poisoned) and report.transport is None
        assert any("is dead, so the reload could not be a refit" in n for n in report.notes)
        assert "note: engine rank 1 (dp=0 pp=0 tp=1) is dead" in report.summary


DRIVER = textwrap.dedent(
    """
    import os, signal, sys, time
    from wcviz.sim import Cluster, EngineLayout
    how = sys.argv[1]
    c = Cluster(layout=EngineLayout(tp=2, pp=1), timeout_s=30)
    with c:
        print(" ".join(map(str, c.pids)), flush=True)
        if how == "error":
            raise RuntimeError("the job failed")
        time.sleep(120)  # waits for SIGINT / SIGKILL
    """
)


@pytest.mark.parametrize("how", ["error", "sigint", "sigkill"])
def test_no_orphan_processes(tmp_path: Path, how: str) -> None:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    driver = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert driver.stdout is not None
        line = driver.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 3, f"driver did not report its ranks: {line!r} {driver.stderr.read() if driver.poll() is not None else ''}"
        if how == "sigint":
            driver.send_signal(signal.SIGINT)
        elif how == "sigkill":
            driver.kill()
        driver.wait(60)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in pids if _alive(p)] == [], f"orphans after {how}"
        if how == "error":
            assert driver.returncode == 1 and "the job failed" in driver.stderr.read()
        if how == "sigint":
            assert "KeyboardInterrupt" in driver.stderr.read()
    finally:
        if driver.poll() is None:
            driver.kill()


def test_moe_engine_with_data_parallel_replicas() -> None:
    """Experts and a router on two DP replicas of TP 2: a stale replica rank is found by its coordinates."""
    from wcviz.sim import TINY_MOE

    with Cluster(TINY_MOE, EngineLayout(tp=2, pp=1, dp=2), allow_mutations=True, timeout_s=60) as c:
        assert [(i.dp, i.pp, i.tp) for i in c.engine_ranks] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
        report = c.endstate(faults={3: LoaderFaults(stale=True)})
        v = report.verdicts
        held = v[v["rank"] == 3]
        assert set(held["status"]) == {"unwritten"} and set(v.loc[v["rank"] != 3, "status"]) == {"match"}
        assert (held["dp"] == 1).all() and (held["tp"] == 1).all()
        names = set(held["name"])
        assert "model.layers.0.mlp.gate.weight" in names and "model.layers.2.mlp.experts.3.gate_up_proj.weight" in names
        assert len(names) == 1 + 3 * (5 + 4 * 2) + 2  # embed; per layer 2 norms, qkv, o, router, 4 experts x 2; norm, head


def test_a_second_check_after_a_partial_reload_is_not_void(healthy: Cluster) -> None:
    """The skipped parameters still hold the first reset's poison; the next reset uses the other byte."""
    first = healthy.endstate(faults=FAULTS["skip_down_proj"])
    second = healthy.endstate()
    assert _bad(first) == _bad(second) == _expected("skip_down_proj")


def test_expected_shard_check_catches_a_persistent_wrong_shard_the_endstate_check_passes(healthy: Cluster) -> None:
    assert set(healthy.expected_check()["status"]) == {"match"}
    healthy.set_faults(FAULTS["fused_from_rank0"])
    healthy.refit()  # the wrong shard is in place before the snapshot, and is written again on reload
    assert healthy.endstate().ok
    verdicts = healthy.expected_check()
    bad = {(int(r.rank), r.name, r.status) for r in verdicts[verdicts["status"] != "match"].itertuples()}
    assert bad == {(rank, name, "mismatch") for rank, name, _ in _expected("fused_from_rank0")}


def test_a_rank_that_gave_no_answer_in_time_is_stopped_not_left_to_answer_the_next_command() -> None:
    """Its late reply stayed in the pipe and was read as the answer to the next command: every answer from that
    rank then belonged to the command before it (a step count, digests of the wrong phase)."""
    import socket
    import subprocess
    import sys
    from multiprocessing.connection import Connection

    from wcviz.sim._procs import RankProcesses

    ours, theirs = socket.socketpair()
    # a "rank" that answers each command only after 2 s
    code = "import socket, sys, time, pickle\nfrom multiprocessing.connection import Connection\nc = Connection(int(sys.argv[1]))\nwhile True:\n    cmd = c.recv()\n    time.sleep(2)\n    c.send(('ok', cmd[0]))\n"
    proc = subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno())], pass_fds=(theirs.fileno(),))
    theirs.close()
    ranks = RankProcesses(RuntimeError, lambda k: f"{k[0]} rank {k[1]}")
    key = ("trainer", 0)
    ranks.procs[key], ranks.conns[key] = proc, Connection(ours.detach())
    try:
        with pytest.raises(RuntimeError, match="no answer within 0 s \\(stopped: a late answer would be taken"):
            ranks.call([key], "first", timeout_s=0.2)
        assert ranks.is_dead(key) and proc.poll() is not None
        with pytest.raises(RuntimeError, match="trainer rank 0 is dead"):
            ranks.call([key], "second", timeout_s=5)
    finally:
        ranks.stop(1)


def test_a_cluster_started_from_a_thread_outlives_that_thread() -> None:
    """Ranks asked the kernel to kill them when their parent died (PR_SET_PDEATHSIG), which fires when the parent
    *thread* exits: a cluster started from a worker thread lost every rank with it."""
    import threading

    box: list[Cluster] = []
    starter = threading.Thread(target=lambda: box.append(Cluster(layout=EngineLayout(tp=1, pp=1), agents=False).start()))
    starter.start()
    starter.join(300)
    (cluster,) = box
    try:
        time.sleep(1.5)  # a rank killed with its parent thread is gone by now
        assert all(_alive(pid) for pid in cluster.pids)
        assert cluster.step() == 1
    finally:
        cluster.stop()
    for _ in range(100):  # and they still end with the cluster
        if not any(_alive(pid) for pid in cluster.pids):
            break
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in cluster.pids)
