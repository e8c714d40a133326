"""The end-state check says only what it measured: replays of an audit of issue 13 ("one end-state engine over any
fleet"), each a case where the check poisoned ranks it could not conclude on, or said something its own digests
disprove.

Agents run in this process on loopback (the ``Rank`` of tests/test_check.py, counting what reached it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pandas as pd
import pytest
import torch

from test_check import TOKEN, Rank, _dead_url, _urls
from wcviz._errors import TableError
from wcviz.endstate import (
    CallableFleet,
    EndStateSession,
    EngineLeftPoisoned,
    ReloadUnverified,
    ResetNotCovered,
    SnapshotUnusable,
    check_agents,
    run,
    run_check,
)
from wcviz.frame import make_frame
from wcviz.sources import fetch_infos, from_state_dict
from wcviz.verdicts import summary


class Counting(Rank):
    """A rank that counts the resets and reloads that reached it."""

    def __init__(self, rank: int, tp: int) -> None:
        self.resets = 0
        self.reloads = 0
        super().__init__(rank, tp)

    def reset(self) -> None:
        self.resets += 1
        super().reset()

    def reload(self) -> dict:
        self.reloads += 1
        return super().reload()

    def intact(self) -> bool:
        return all(torch.equal(self.params[n], self.truth[n]) for n in self.truth)


@pytest.fixture
def two() -> Iterator[list[Counting]]:
    rs = [Counting(0, 0), Counting(1, 1)]
    for r in rs:
        r.agent.start()
    yield rs
    for r in rs:
        r.agent.stop()


def test_two_agents_claiming_one_rank_stop_the_check_before_any_reset() -> None:
    a, b = Counting(0, 0), Counting(0, 0)  # both say rank 0 tp 0: neither snapshot can be placed
    b.fail_reload = True  # had it been reset, it would stay poisoned
    with a.agent, b.agent:
        with pytest.raises(SnapshotUnusable, match=r"did not hold up.*nothing was poisoned.*claims the same rank"):
            check_agents([a.agent.url, b.agent.url], token=TOKEN)
    assert a.resets == b.resets == 0 and a.intact() and b.intact()


def test_one_agent_under_two_spellings_is_not_reset_twice() -> None:
    a = Counting(0, 0)
    with a.agent:
        other = a.agent.url.replace("127.0.0.1", "localhost")
        with pytest.raises(SnapshotUnusable, match="claims the same rank"):
            check_agents([a.agent.url, other], token=TOKEN)
    assert a.resets == 0 and a.intact()


def test_no_rank_answering_the_snapshot_resets_nothing() -> None:
    with pytest.raises(SnapshotUnusable, match=r"no rank answered the snapshot.*nothing was poisoned"):
        check_agents([_dead_url(), _dead_url()], token=TOKEN, timeout_s=2, retries=0)


@pytest.mark.parametrize(("option", "value", "said"), [("retries", 1.5, "retries"), ("retries", True, "retries"), ("timeout_s", "abc", "timeout_s")])
def test_network_options_are_refused_by_name_before_any_rank_is_touched(two: list[Counting], option: str, value: object, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        check_agents(_urls(two), token=TOKEN, **{option: value})
    assert [r.resets for r in two] == [0, 0] and all(r.intact() for r in two)
    with pytest.raises(ValueError, match="timeout_s"):
        fetch_infos([two[0].agent.url], timeout_s=float("nan"))


def test_two_ranks_known_only_by_url_stay_two(two: list[Counting]) -> None:
    dead = [_dead_url(), _dead_url()]
    report = check_agents([r.agent.url for r in two] + dead, token=TOKEN, timeout_s=2, retries=0)
    assert sorted(report.unreachable["url"]) == sorted(dead)
    line = report.summary.splitlines()[0]
    assert line.startswith("end-state check: 4 ranks, 8 parameters: 2 ranks unreachable (") and all(u in line for u in dead)
    ghosts = report.verdicts[report.verdicts["status"] == "unreachable"]
    assert sorted(ghosts["url"]) == sorted(dead) and ghosts["rank"].isna().all()


def test_callables_that_digest_nothing_are_empty_not_a_pass() -> None:
    v = run_check(lambda: None, lambda: None, lambda: None, lambda phase: make_frame([]))
    assert list(v["status"]) == ["empty"]
    report = run(EndStateSession(CallableFleet(lambda: None, lambda: None, lambda: None, lambda p: make_frame([]))))
    assert not report.ok and "1 rank empty" in report.summary


class LateFailure(Counting):
    """A reload that writes every weight back, then fails in its own bookkeeping."""

    def reload(self) -> dict:
        super().reload()
        raise RuntimeError("could not update the version counter")


def test_a_reload_that_raises_after_restoring_every_weight_is_not_called_poisoned() -> None:
    two = [Counting(0, 0), LateFailure(1, 1)]
    with two[0].agent, two[1].agent:
        report = check_agents(_urls(two), token=TOKEN)
    assert two[1].intact() and not len(report.poisoned)
    assert "still poisoned" not in report.summary and "could not update the version counter" in report.summary
    assert set(report.verdicts["status"]) == {"match"} and not report.ok  # the failure is still a problem of the check


def test_a_failed_reload_that_leaves_the_pattern_is_still_called_poisoned(two: list[Counting]) -> None:
    two[0].fail_reload = True
    report = check_agents(_urls(two), token=TOKEN)
    assert report.poisoned["rank"].tolist() == [0] and report.summary.startswith("RELOAD FAILED on engine 0")


def test_a_reload_whose_digests_cannot_be_fetched_is_unverified_not_failed() -> None:
    params = {"w": torch.randn(4, 4), "b": torch.randn(4)}
    truth = {n: t.clone() for n, t in params.items()}
    from wcviz.endstate import poison_

    def digests(phase: str) -> pd.DataFrame:
        if phase == "reload":
            raise ConnectionError("digest service restarted")
        return from_state_dict(params).assign(phase=phase)

    fleet = CallableFleet(lambda: None, lambda: poison_(params), lambda: [params[n].copy_(truth[n]) for n in params], digests)
    with pytest.raises(ReloadUnverified, match=r"the reload ran without an error.*digest service restarted.*not known") as info:
        run(EndStateSession(fleet))
    assert isinstance(info.value, EngineLeftPoisoned) and info.value.poisoned == ()
    assert "RELOAD FAILED" not in str(info.value)


def test_a_snapshot_that_already_holds_the_poison_is_no_reference(two: list[Counting]) -> None:
    two[1].fail_reload = True
    first = check_agents(_urls(two), token=TOKEN)  # rank 1 is left poisoned
    assert first.poisoned["rank"].tolist() == [1]
    two[1].fail_reload = False
    second = check_agents(_urls(two), token=TOKEN)  # its snapshot is the poison; its reload is right
    v = second.verdicts
    assert two[1].intact()
    assert set(v.loc[v["rank"] == 1, "status"]) == {"unproven"}  # never "corrupted": it holds the trainer's weights
    assert any("already held the reset pattern at the snapshot" in n for n in second.notes)
    two[1].skip = "down_proj"  # and where the reload still leaves the pattern, that is what it says
    two[1].fail_reload = True
    check_agents(_urls(two), token=TOKEN)
    two[1].fail_reload = False
    third = check_agents(_urls(two), token=TOKEN)
    bad = third.verdicts[third.verdicts["rank"] == 1]
    assert set(bad.loc[bad["name"].str.contains("down_proj"), "status"]) == {"unwritten"}


def test_a_refused_reset_names_its_cause(two: list[Counting]) -> None:
    two[1].agent._actions["reset"] = None  # type: ignore[attr-defined]  # the agent answers 501 to a reset
    with pytest.raises(ResetNotCovered, match=r"4 unchanged on 1 rank.*the reset itself failed on engine 1 .* HTTP 501"):
        check_agents(_urls(two), token=TOKEN)
    assert all(r.intact() for r in two)


def test_a_snapshot_refused_by_a_rank_stops_the_check_before_any_reset(two: list[Counting]) -> None:
    two[1].agent.allow_mutations = False  # 403 to every mutation: its reset would be refused too
    with pytest.raises(SnapshotUnusable, match=r"the snapshot was refused by 1 rank .*nothing was poisoned.*HTTP 403"):
        check_agents(_urls(two), token=TOKEN)
    assert [r.resets for r in two] == [0, 0]


def test_a_fleet_missing_a_member_is_named_not_taken_for_urls() -> None:
    class Half:
        targets = ("x",)

        def identity(self, target: str) -> dict:
            return {}

        def digests(self, phase: str) -> None: ...

        def act(self, action: str) -> None: ...

    with pytest.raises(TypeError, match=r"Half is not a Fleet: it lacks reset_pattern"):
        EndStateSession(Half())


def test_a_verdict_status_no_check_gives_is_refused() -> None:
    with pytest.raises(TableError, match="has the status 'ok', which no check gives"):
        summary(pd.DataFrame({"rank": [0], "name": ["a"], "status": ["ok"]}))


def test_vllm_sizes_cut_for_another_topology_are_refused_before_the_reset() -> None:
    from wcviz.endstate import vllm_endstate
    from wcviz.layouts import expected_frame
    from wcviz.sim import SimVllm
    from wcviz.sim.model import TINY, build_state_dict

    sizes = expected_frame(build_state_dict(TINY), "llama", tp=1, heads=TINY.heads, kv_heads=TINY.kv_heads, vocab_padding=1, algo="vllm-sha256")
    sim = SimVllm(TINY, tp=2)
    with sim as url:
        resets = []
        with pytest.raises(ValueError, match=r"sizes do not fit this engine: 21 of 42 .*rank 1 .*Nothing was reset"):
            vllm_endstate(url, lambda: resets.append("reload"), sizes=sizes)
        assert resets == []


def test_agent_fleet_info_goes_through_the_fleets_transport() -> None:
    """Every fetch takes a client or transport (issue 4): the dashboard's mutation check asks /v1/info through it too."""
    import httpx

    from wcviz.agent import Agent
    from wcviz.endstate import AgentFleet

    agent = Agent(lambda: {"a.weight": torch.ones(8)}, role="engine", rank=0, tp=0, token=TOKEN, allow_mutations=True,
                  reset=lambda: None, snapshot=lambda: None, reload=lambda: None)  # fmt: skip
    fleet = AgentFleet(["http://agent0"], token=TOKEN, transport=httpx.ASGITransport(app=agent.app), timeout_s=2, retries=0)
    infos, errors = fleet.info()
    assert errors == {} and infos["http://agent0"]["mutations_allowed"] is True
    assert fleet.mutation_block(infos, errors) is None


def test_a_row_claiming_no_bytes_for_a_shape_with_elements_proves_nothing() -> None:
    """nbytes=0 beside shape [64, 64]: not an empty tensor (which needs no reset), so an unreset parameter voids the check."""
    from wcviz.endstate import classify, poison_

    big, norm = torch.randn(64, 64), torch.ones(8)

    def frame(phase: str) -> pd.DataFrame:
        f = from_state_dict({"big": big, "norm": norm}, role="engine", rank=0, tp=0, phase=phase)
        f.loc[f["name"] == "big", "nbytes"] = 0  # the row lies about its size
        return f

    snap = frame("snapshot")
    saved = norm.clone()
    poison_({"n": norm})  # the reset reaches only norm
    rst = frame("reset")
    norm.copy_(saved)
    with pytest.raises(ResetNotCovered, match=r"1 unchanged on 1 rank: big on rank 0"):
        classify(snap, rst, frame("reload"))


def test_a_rank_whose_first_action_timed_out_keeps_its_coordinates() -> None:
    """A snapshot action that outlasts the timeout, before any digests named the rank: named by its coordinates (not
    a third rank without them), and, its snapshot in doubt, nothing is reset."""
    import time as _time

    class Slow(Counting):
        def __init__(self, rank: int, tp: int) -> None:
            super().__init__(rank, tp)
            self.agent._actions["snapshot"] = lambda: _time.sleep(4)  # type: ignore[attr-defined]

    two = [Counting(0, 0), Slow(1, 1)]
    with two[0].agent, two[1].agent:
        # alive (its digests answered) but its snapshot is in doubt: stopped before the reset, named by its rank
        with pytest.raises(SnapshotUnusable, match=r"the snapshot failed on 1 rank that otherwise answered.*nothing was poisoned\): engine 1 \(pp=0 tp=1\) at http.*timed out") as info:
            check_agents([r.agent.url for r in two], token=TOKEN, timeout_s=2, retries=0)
    assert "engine 0" not in str(info.value) and [r.resets for r in two] == [0, 0]


@pytest.mark.parametrize("token", [TOKEN + "\n", " " + TOKEN, "pässwort"])
def test_a_token_no_header_can_carry_is_refused_before_any_rank_is_touched(two: list[Counting], token: str) -> None:
    with pytest.raises(ValueError, match="token") as info:
        check_agents(_urls(two), token=token)
    assert token.strip() not in str(info.value)  # a secret is never echoed
    assert [r.resets for r in two] == [0, 0] and all(r.intact() for r in two)


def test_a_snapshot_that_failed_on_a_living_rank_stops_the_check_before_any_reset() -> None:
    """A rank whose snapshot raised (HTTP 500) was still reset: a reload that restores what its snapshot recorded
    then left it poisoned, for a check that could not conclude."""

    class NoRoom(Counting):
        def __init__(self, rank: int, tp: int) -> None:
            super().__init__(rank, tp)

            def snapshot() -> None:
                raise MemoryError("cannot hold a host copy of the weights")

            self.agent._actions["snapshot"] = snapshot  # type: ignore[attr-defined]

    two = [Counting(0, 0), NoRoom(1, 1)]
    with two[0].agent, two[1].agent:
        with pytest.raises(SnapshotUnusable, match=r"the snapshot failed on 1 rank that otherwise answered.*nothing was poisoned\): engine 1 \(pp=0 tp=1\) at http.*HTTP 500: MemoryError: cannot hold"):
            check_agents([r.agent.url for r in two], token=TOKEN, retries=0)
    assert [r.resets for r in two] == [0, 0] and all(r.intact() for r in two)


def test_a_living_rank_whose_snapshot_digests_did_not_come_stops_the_check_but_a_dead_rank_does_not() -> None:
    """A rank that took the snapshot action but whose digests timed out was reset with nothing to compare against.
    A rank silent to both (dead) is still reported unreachable while the living ranks are checked."""
    import httpx

    two = [Counting(0, 0), Counting(1, 1)]
    first = {"dropped": False}

    class DropFirstGet(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if str(request.url).startswith(str(two[1].agent.url)) and request.method == "GET" and not first["dropped"]:
                first["dropped"] = True
                raise httpx.ConnectTimeout("timed out (transient)", request=request)
            return await super().handle_async_request(request)

    with two[0].agent, two[1].agent:
        with pytest.raises(SnapshotUnusable, match=rf"failed on 1 rank that otherwise answered.*\): {two[1].agent.url}: ConnectTimeout"):
            check_agents([r.agent.url for r in two], token=TOKEN, retries=0, transport=DropFirstGet())
        assert first["dropped"] and [r.resets for r in two] == [0, 0]
        report = check_agents([r.agent.url for r in two] + [_dead_url()], token=TOKEN, timeout_s=2, retries=0)
    assert [r.resets for r in two] == [1, 1] and all(r.intact() for r in two)
    assert len(report.unreachable) == 1 and set(report.verdicts.loc[report.verdicts["rank"].notna(), "status"]) == {"match"}
