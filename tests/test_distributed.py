"""Gathering digest tables over torch.distributed, in real processes.

One spawned world of three ranks on 127.0.0.1 with gloo runs every scenario
below in sequence; each rank reports what it got (a frame, None or an error)
through a queue, and the tests read those reports. The last scenario kills a
rank on purpose, so it runs last, on a group of its own with a short timeout
(the world's is long, so a slow start on a busy machine is not a failure).
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import re
import socket
import time
from datetime import timedelta
from typing import Any

import pandas as pd
import pytest
import torch

WORLD = 3
WORLD_TIMEOUT_S = 60  # the world's and the sub-group's collective limit: generous, ranks start at different times
GROUP_TIMEOUT_S = 8  # the dead-rank scenario's group: how long a live rank waits at most when a peer is dead
DEAD_TIMEOUT_S = 3  # timeout_s (the barrier's) in the dead-rank scenario
DEAD = 2  # the rank that exits before the last gather
SUB = (1, 2)  # the sub-group's global ranks; rank 0 is not in it
SUB_DST = 2
WORLD_DEADLINE_S = 180  # only a guard against a hang: the world takes ~15-30 s on 2 idle cores


def coords(rank: int) -> dict[str, int]:
    """Each global rank's parallel coordinates (made up, distinct per rank)."""
    return {"dp": rank, "pp": 0, "tp": rank % 2}


def tensors_for(rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s weights: seeded, so the ranks and the test build the same ones; 2 + rank of them."""
    g = torch.Generator().manual_seed(100 + rank)
    out = {"model.embed_tokens.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16)}
    for i in range(1 + rank):
        out[f"model.layers.{i}.mlp.up_proj.weight"] = torch.randn(4, 3 + i, generator=g)
    return out


def rows_for(rank: int) -> int:
    return len(tensors_for(rank))


# --- what runs in each spawned rank ----------------------------------------------------------------------------


def _error(e: BaseException) -> dict[str, Any]:
    return {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)}


def _scenarios(rank: int, sub: Any, short: Any) -> list[tuple[str, Any]]:
    """(name, call) in the order every rank runs them; a call returns what gather_frame returned."""
    from wcviz.sources import from_distributed, from_named_tensors, gather_frame

    mine = tensors_for(rank)

    def frame(**info: Any) -> pd.DataFrame:
        return from_named_tensors(mine, progress=False, **info)

    def world_dst0() -> Any:
        return from_distributed(mine, dst=0, role="trainer", step=7, host=f"node{rank // 2}", **coords(rank))

    def reversed_identity() -> Any:  # each rank claims the rank mirrored to its global one: gather order != identity
        return gather_frame(frame(role="engine", rank=WORLD - 1 - rank, phase="received"), dst=WORLD - 1)

    def subgroup() -> Any:  # no rank on the rows: each member's global rank is filled in
        return gather_frame(frame(role="engine", tp=rank), group=sub, dst=SUB_DST)

    def duplicate() -> Any:  # ranks 1 and 2 both claim to be rank 1
        return gather_frame(frame(role="trainer", rank=1 if rank == 2 else rank), dst=0)

    def duplicate_disjoint() -> Any:  # rank 2 claims rank 1 with names rank 1 does not send: no row repeats
        f = frame(role="trainer", rank=1 if rank == 2 else rank)
        return gather_frame(f.assign(name=f["name"] + ".pp1") if rank == 2 else f, dst=0)

    def rank_reused() -> Any:  # numbered by tp alone: global ranks 0 and 2 both claim rank 0, at pp 0 and pp 1
        return from_distributed(mine, dst=0, role="engine", rank=rank % 2, pp=rank // 2, tp=rank % 2)

    def bad_frame() -> Any:
        f = frame(role="trainer", rank=rank)
        return gather_frame(f.drop(columns=["digest"]) if rank == 2 else f, dst=1)

    def undigestible() -> Any:
        named = dict(mine)
        if rank == 1:
            named["model.norm.weight"] = torch.empty(4, device="meta")
        return from_distributed(named, dst=0, role="trainer")

    def dead() -> Any:
        return from_distributed(mine, group=short, dst=0, role="trainer", timeout_s=DEAD_TIMEOUT_S)

    out = [
        ("world dst 0", world_dst0),
        ("reversed identity", reversed_identity),
        ("duplicate", duplicate),
        ("duplicate, disjoint names", duplicate_disjoint),
        ("rank reused", rank_reused),
        ("bad frame", bad_frame),
        ("undigestible", undigestible),
        ("dead", dead),
    ]
    if rank in SUB:
        out.insert(2, ("subgroup", subgroup))
    return out


def _worker(rank: int, port: int, q: Any) -> None:
    os.environ["NUMBA_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from wcviz.digest import digest_hex

    digest_hex(torch.zeros(3))  # load the numba kernels before any collective starts its clock
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=WORLD_TIMEOUT_S),
    )
    sub = dist.new_group(list(SUB), timeout=timedelta(seconds=WORLD_TIMEOUT_S))  # every rank creates both
    short = dist.new_group(list(range(WORLD)), timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    for name, call in _scenarios(rank, sub, short):
        if name == "dead":
            dist.barrier()  # every rank enters the last scenario together: only the death can fail it
        if name == "dead" and rank == DEAD:
            q.put(("dying", rank, name))
            q.close()
            q.join_thread()
            os._exit(0)
        record: dict[str, Any] = {}
        t0 = time.monotonic()
        try:
            record["result"] = call()
        except Exception as e:  # noqa: BLE001 -- reported to the test, which says what it expected
            record["error"] = _error(e)
        record["elapsed"] = time.monotonic() - t0
        q.put(("record", rank, name, record))
    q.put(("done", rank, None))
    q.close()
    q.join_thread()
    os._exit(0)  # no teardown against a dead peer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def world() -> dict[tuple[str, int], dict[str, Any]]:
    """Run the world once; ``{(scenario, rank): record}``."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, q), daemon=True) for rank in range(WORLD)]
    records: dict[tuple[str, int], dict[str, Any]] = {}
    finished: set[int] = set()
    deadline = time.monotonic() + WORLD_DEADLINE_S
    try:
        for p in procs:
            p.start()
        while len(finished) < WORLD and time.monotonic() < deadline:
            try:
                msg = q.get(timeout=1)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs):
                    break
                continue
            if msg[0] == "record":
                records[(msg[2], msg[1])] = msg[3]
            else:  # "done" or "dying": this rank sends nothing more
                finished.add(msg[1])
                if msg[0] == "dying":
                    records[(msg[2], msg[1])] = {"died": True}
    finally:
        for p in procs:
            if p.pid is not None:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    assert finished == set(range(WORLD)), (
        f"ranks {sorted(set(range(WORLD)) - finished)} never finished (a hang?); got {sorted(records)}"
    )
    return records


def rec(world: dict[tuple[str, int], dict[str, Any]], name: str, rank: int) -> dict[str, Any]:
    assert (name, rank) in world, f"no record of {name!r} from rank {rank}"
    return world[(name, rank)]


def ok(world: dict[tuple[str, int], dict[str, Any]], name: str, rank: int) -> Any:
    r = rec(world, name, rank)
    assert "error" not in r, f"{name} on rank {rank}: {r['error']}"
    return r["result"]


def expected_digests(rank: int) -> dict[str, str]:
    """What the parent computes for rank ``rank``'s tensors."""
    from wcviz.sources import from_named_tensors

    f = from_named_tensors(tensors_for(rank), progress=False)
    return dict(zip(f["name"], f["digest"]))


def digests_of(frame: pd.DataFrame, rank: int) -> dict[str, str]:
    mine = frame[frame["rank"] == rank]
    return dict(zip(mine["name"], mine["digest"]))


# --- the tests -------------------------------------------------------------------------------------------------


def test_world_gathers_every_ranks_rows_to_dst_only(world):
    from wcviz.frame import COLUMNS, validate

    frame = ok(world, "world dst 0", 0)
    for rank in range(1, WORLD):
        assert ok(world, "world dst 0", rank) is None
    assert isinstance(frame, pd.DataFrame)
    assert list(frame.columns) == list(COLUMNS)
    validate(frame)
    assert len(frame) == sum(rows_for(r) for r in range(WORLD))
    assert frame["rank"].tolist() == [r for r in range(WORLD) for _ in range(rows_for(r))]  # rank order
    for rank in range(WORLD):
        mine = frame[frame["rank"] == rank]
        assert len(mine) == rows_for(rank)
        assert list(mine["name"]) == list(tensors_for(rank))  # each rank's own order
        for col, value in coords(rank).items():
            assert (mine[col] == value).all(), (rank, col)
        assert mine["ep"].isna().all()
        assert (mine["host"] == f"node{rank // 2}").all() and (mine["role"] == "trainer").all()
        assert (mine["phase"] == "current").all() and (mine["step"] == 7).all()
        assert digests_of(frame, rank) == expected_digests(rank)
    # the ranks' tensors differ, so their digests do: nothing was mixed up between ranks
    assert frame.loc[frame["name"] == "model.embed_tokens.weight", "digest"].nunique() == WORLD


def test_rows_are_ordered_by_identity_not_gather_order(world):
    frame = ok(world, "reversed identity", WORLD - 1)
    for rank in range(WORLD - 1):
        assert ok(world, "reversed identity", rank) is None
    # global rank g claims rank WORLD - 1 - g: the table follows the claims
    claimed = {WORLD - 1 - g: g for g in range(WORLD)}
    assert frame["rank"].tolist() == [c for c in range(WORLD) for _ in range(rows_for(claimed[c]))]
    assert len(frame) == sum(rows_for(r) for r in range(WORLD))
    for c, g in claimed.items():
        assert digests_of(frame, c) == expected_digests(g)
    assert (frame["phase"] == "received").all() and (frame["role"] == "engine").all()


def test_subgroup_with_dst_not_zero_fills_missing_rank_with_the_global_rank(world):
    assert ("subgroup", 0) not in world  # rank 0 is not a member and never called it
    frame = ok(world, "subgroup", SUB_DST)
    for rank in set(SUB) - {SUB_DST}:
        assert ok(world, "subgroup", rank) is None
    assert len(frame) == sum(rows_for(r) for r in SUB)
    assert frame["rank"].tolist() == [r for r in SUB for _ in range(rows_for(r))]
    for rank in SUB:
        mine = frame[frame["rank"] == rank]
        assert (mine["tp"] == rank).all() and mine["dp"].isna().all()
        assert digests_of(frame, rank) == expected_digests(rank)


def test_two_ranks_claiming_one_identity_is_an_error_naming_both_on_every_rank(world):
    for rank in range(WORLD):
        err = rec(world, "duplicate", rank).get("error")
        assert err is not None, f"rank {rank} did not raise"
        assert err["type"] == "TableError"
        assert "ranks 1 and 2 both claim (role=trainer, rank=1)" in err["message"]
        assert "rank=0" not in err["message"] and "rank=2" not in err["message"]


def test_two_ranks_claiming_one_identity_fail_even_when_no_row_repeats(world):
    """A TP x PP job that left ``pp`` out: two stages' disjoint names used to fold into one rank holding both."""
    for rank in range(WORLD):
        err = rec(world, "duplicate, disjoint names", rank).get("error")
        assert err is not None and err["type"] == "TableError", f"rank {rank} did not raise"
        assert "two members claim one rank identity" in err["message"] and "ranks 1 and 2 both claim (role=trainer, rank=1)" in err["message"]


def test_one_rank_number_with_two_sets_of_coordinates_is_refused_at_the_gather(world):
    """What compare and the end-state check refuse later (one rank, two identities) is refused where the rows
    meet, on every member alike, naming the global ranks that sent them."""
    messages = set()
    for rank in range(WORLD):
        err = rec(world, "rank reused", rank).get("error")
        assert err is not None and err["type"] == "TableError", f"rank {rank} did not raise: {rec(world, 'rank reused', rank)}"
        messages.add(err["message"])
    assert len(messages) == 1
    (message,) = messages
    assert message.startswith("gather_frame: the engine rows: rank 0 claims two identities: (rank=0 pp=0 tp=0) in the rows of "
                              "global rank 0 and (rank=0 pp=1 tp=0) in the rows of global rank 2"), message
    assert "global rank 1" not in message


def test_a_bad_frame_on_one_rank_makes_every_rank_raise_naming_it(world):
    messages = set()
    for rank in range(WORLD):
        r = rec(world, "bad frame", rank)
        assert r.get("error") is not None, f"rank {rank} did not raise"
        assert r["error"]["type"] == "TableError" and "WcvizError" in r["error"]["mro"]
        assert r["elapsed"] < WORLD_TIMEOUT_S / 3  # nobody waited out the group's timeout
        messages.add(r["error"]["message"])
    assert len(messages) == 1  # every rank says the same
    (message,) = messages
    assert "rank 2's frame: missing required column(s) digest" in message
    assert not re.search(r"rank [01]", message)


def test_undigestible_tensors_on_one_rank_make_every_rank_raise_naming_it(world):
    for rank in range(WORLD):
        err = rec(world, "undigestible", rank).get("error")
        assert err is not None, f"rank {rank} did not raise"
        assert err["type"] == "DigestError", err
        assert "rank 1 could not digest its tensors: DigestError" in err["message"]
        assert "model.norm.weight" in err["message"]


def test_a_dead_rank_is_a_gather_error_within_the_timeout_not_a_hang(world):
    assert rec(world, "dead", DEAD) == {"died": True}
    for rank in set(range(WORLD)) - {DEAD}:
        r = rec(world, "dead", rank)
        assert r.get("error") is not None, f"rank {rank} did not raise"
        assert r["error"]["type"] == "GatherError" and "RuntimeError" in r["error"]["mro"]
        assert re.search(rf"gather_frame: .+ failed on rank {rank}: a peer is dead", r["error"]["message"])
        assert r["elapsed"] < GROUP_TIMEOUT_S + 5
    # the barrier's root sees the closed connection at once, or names the rank after timeout_s
    root = rec(world, "dead", 0)["error"]["message"]
    assert "the barrier before the gather" in root
    assert re.search(rf"Connection closed by peer|Ranks? {DEAD} failed to pass monitoredBarrier", root), root
    assert rec(world, "dead", 0)["elapsed"] < DEAD_TIMEOUT_S + 5


# --- in-process checks of the pieces ---------------------------------------------------------------------------


def test_without_a_process_group_it_is_a_gather_error():
    import torch.distributed as dist

    from wcviz._errors import GatherError
    from wcviz.sources import gather_frame

    assert not dist.is_initialized()
    with pytest.raises(GatherError, match="initialised torch.distributed process group"):
        gather_frame(pd.DataFrame())


def _payloads(frames: dict[int, pd.DataFrame], allow_empty: bool = False) -> list[dict[str, Any]]:
    from wcviz.sources._distributed import _payload

    return [_payload(f, r, allow_empty) for r, f in frames.items()]


def test_combine_orders_checks_and_fills():
    from wcviz._errors import TableError
    from wcviz.frame import make_frame
    from wcviz.sources._distributed import _combine

    a = make_frame([{"name": "w", "digest": "aa" * 32, "algo": "sha256", "role": "engine", "rank": 5}])
    b = make_frame(
        [
            {"name": "w", "digest": "bb" * 32, "algo": "sha256", "role": "engine"},
            {"name": "v", "digest": "cc" * 32, "algo": "sha256", "role": "engine"},
        ]
    )
    t = make_frame([{"name": "w", "digest": "dd" * 32, "algo": "sha256", "role": "trainer", "rank": 0}])
    out = _combine(_payloads({0: a, 1: b, 2: t}), [0, 1, 2])
    assert out["rank"].tolist() == [1, 1, 5, 0] and out["role"].tolist() == ["engine", "engine", "engine", "trainer"]
    assert out["name"].tolist() == ["w", "v", "w", "w"]  # rank 1 (filled in) keeps its own row order
    # one rank sending the same key twice is named too
    twice = pd.concat([a, a], ignore_index=True)
    with pytest.raises(TableError, match=r"rank 4 sent 2 rows for \(role=engine, rank=5, name=w\)"):
        _combine(_payloads({4: twice}), [4])
    # every bad frame is named, in group order
    with pytest.raises(TableError, match=r"rank 1's frame: .*; rank 3's frame: expected a pandas DataFrame"):
        _combine(_payloads({0: a, 1: a.drop(columns=["algo"]), 3: "nope"}), [0, 1, 3])  # type: ignore[dict-item]
    assert len(_combine(_payloads({0: a.iloc[0:0], 1: a.iloc[0:0]}, allow_empty=True), [0, 1])) == 0
    # an empty rank is no pass: named, unless the caller says empty tables are expected
    from wcviz._errors import GatherError

    with pytest.raises(GatherError, match=r"rank 1 holds no parameters"):
        _combine(_payloads({0: a, 1: a.iloc[0:0]}), [0, 1])
    assert pickle.loads(_payloads({0: a})[0]["frame"]).equals(a)


def test_combine_refuses_a_rank_number_claimed_with_two_sets_of_coordinates():
    """The rule of ``frame.check_identities``, per role (a rank counts within its role's world), naming senders."""
    from wcviz._errors import TableError
    from wcviz.frame import make_frame
    from wcviz.sources._distributed import _combine

    def shard(role: str, rank: int, **coords: int) -> pd.DataFrame:
        return make_frame([{"name": f"w{rank}", "digest": "ab" * 32, "algo": "sha256", "role": role, "rank": rank, **coords}])

    payloads = _payloads({0: shard("engine", 0, pp=0, tp=0), 1: shard("engine", 1, pp=0, tp=1), 3: shard("engine", 0, pp=1, tp=0)})
    with pytest.raises(TableError, match=r"the engine rows: rank 0 claims two identities: \(rank=0 pp=0 tp=0\) in the rows of "
                       r"global rank 0 and \(rank=0 pp=1 tp=0\) in the rows of global rank 3"):
        _combine(payloads, [0, 1, 3])
    both = pd.concat([shard("engine", 0, pp=0), shard("engine", 0, pp=1)], ignore_index=True)  # one member, two identities
    with pytest.raises(TableError, match=r"\(rank=0 pp=0\) in the rows of global rank 2 and \(rank=0 pp=1\) in the rows of global rank 2"):
        _combine(_payloads({2: both}), [2])
    # trainer rank 0 and engine rank 0 are two ranks of two worlds, whatever their coordinates
    mixed = _combine(_payloads({0: shard("trainer", 0), 1: shard("engine", 0, pp=1, tp=1)}), [0, 1])
    assert mixed["role"].tolist() == ["engine", "trainer"] and mixed["rank"].tolist() == [0, 0]


def test_a_negative_rank_is_refused_at_the_gather_naming_the_member():
    """As ``_fleet.identity_of`` refuses ``rank=-1`` from an agent, a member's frame claiming it is a bad frame."""
    from wcviz._errors import TableError
    from wcviz.frame import make_frame
    from wcviz.sources._distributed import _combine

    good = make_frame([{"name": "w", "digest": "ab" * 32, "algo": "sha256", "role": "engine", "rank": 0}])
    bad = pd.DataFrame([{"name": "w", "digest": "cd" * 32, "algo": "sha256", "role": "engine", "rank": -1}])
    with pytest.raises(TableError, match=r"rank 1's frame: column 'rank' holds -1 in row 0, not a coordinate"):
        _combine(_payloads({0: good, 1: bad}), [0, 1])
