"""The end-state check over HTTP agents (wcviz.endstate.check_agents) and its CLI (`wcviz endstate`, `wcviz fetch`).

Agents run in this process on loopback, each over a small dict of tensors whose
reload can be told to misbehave, so every branch is exercised without processes.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch

from wcviz.agent import Agent
from wcviz.endstate import check_agents
from wcviz.cli import main as cli
from wcviz.endstate import EngineLeftPoisoned, ResetNotCovered, SnapshotUnusable, poison_
from wcviz.sources import fetch

TOKEN = "s3cret"


class Rank:
    """One rank's weights, with a reload that can skip names, fail, or do nothing to the reset."""

    def __init__(self, rank: int, tp: int) -> None:
        g = torch.Generator().manual_seed(rank)
        self.truth = {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(8, 8, generator=g) for i in range(3)}
        self.truth["model.norm.weight"] = torch.randn(8, generator=g)
        self.params = {n: t.clone() for n, t in self.truth.items()}
        self.skip: str | None = None
        self.fail_reload = False
        self.ignore_reset = False
        self.agent = Agent(
            lambda: self.params, role="engine", rank=rank, pp=0, tp=tp, token=TOKEN, allow_mutations=True,
            snapshot=lambda: {"params": len(self.params)}, reset=self.reset, reload=self.reload,
        )  # fmt: skip

    def reset(self) -> None:
        if not self.ignore_reset:
            poison_(self.params)

    def reload(self) -> dict:
        if self.fail_reload:
            raise OSError("checkpoint shard 2 is unreadable")
        for n, t in self.truth.items():
            if self.skip is None or self.skip not in n:
                self.params[n].copy_(t)
        return {"written": len(self.params)}


@pytest.fixture
def ranks() -> Iterator[list[Rank]]:
    rs = [Rank(0, 0), Rank(1, 1)]
    for r in rs:
        r.agent.start()
    yield rs
    for r in rs:
        r.agent.stop()


def _urls(ranks: list[Rank]) -> dict[str, dict]:
    return {r.agent.url: {"role": "engine", "rank": r.agent.rank, "pp": 0, "tp": r.agent.coords["tp"]} for r in ranks}


def _dead_url() -> str:
    with socket.socket() as s:  # a port that was free a moment ago and has no listener
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_healthy_ranks_all_match(ranks: list[Rank]) -> None:
    report = check_agents(_urls(ranks), token=TOKEN)
    assert report.ok and len(report.verdicts) == 8 and not len(report.problems)
    assert report.answered == {"snapshot": 2, "reset": 2, "reload": 2}
    assert set(report.frames) == {"snapshot", "reset", "reload"}
    assert (report.frames["reset"]["phase"] == "reset").all()


def test_a_skipped_parameter_is_unwritten_on_its_rank_only(ranks: list[Rank]) -> None:
    ranks[1].skip = "layers.2."
    report = check_agents(_urls(ranks), token=TOKEN)
    bad = report.verdicts[report.verdicts["status"] != "match"]
    assert [(int(r.rank), r.name, r.status) for r in bad.itertuples()] == [(1, "model.layers.2.mlp.down_proj.weight", "unwritten")]
    assert "unwritten   rank 1 (pp=0 tp=1)" in report.details()


def test_failed_reload_on_one_rank_is_reported_as_poisoned(ranks: list[Rank]) -> None:
    ranks[0].fail_reload = True
    report = check_agents(_urls(ranks), token=TOKEN)
    assert report.poisoned["rank"].tolist() == [0]
    assert "checkpoint shard 2 is unreadable" in report.poisoned["error"].iloc[0]
    assert report.summary.splitlines()[0].startswith("RELOAD FAILED on engine 0 (pp=0 tp=0): still poisoned")
    v = report.verdicts
    assert set(v.loc[v["rank"] == 0, "status"]) == {"unwritten"} and set(v.loc[v["rank"] == 1, "status"]) == {"match"}


def test_reset_that_changes_nothing_voids_the_check_after_reloading(ranks: list[Rank]) -> None:
    ranks[1].ignore_reset = True
    ranks[0].params["model.norm.weight"].add_(1)  # would be restored by the reload that still runs
    with pytest.raises(ResetNotCovered, match="4 unchanged on 1 rank"):
        check_agents(_urls(ranks), token=TOKEN)
    assert torch.equal(ranks[0].params["model.norm.weight"], ranks[0].truth["model.norm.weight"])


def test_a_rank_that_never_answers_is_unreachable_not_missing(ranks: list[Rank]) -> None:
    dead = _dead_url()
    urls = {**_urls(ranks), dead: {"role": "engine", "rank": 2, "pp": 0, "tp": 2}}
    report = check_agents(urls, token=TOKEN, timeout_s=2, retries=0)
    v = report.verdicts
    ghost = v[v["rank"] == 2]
    assert len(ghost) == 1 and ghost["status"].iloc[0] == "unreachable" and pd.isna(ghost["name"].iloc[0])
    assert int(ghost["tp"].iloc[0]) == 2
    assert set(v.loc[v["rank"] != 2, "status"]) == {"match"}
    assert set(report.problems["url"]) == {dead} and not report.ok
    assert "end-state check: 3 ranks, 8 parameters: 1 rank unreachable (rank 2 (pp=0 tp=2): did not answer), 8 match" in report.summary


def test_wrong_token_is_a_problem_on_every_rank_not_a_pass(ranks: list[Rank]) -> None:
    # the snapshot is refused (401) by every rank: the reset would be too, so the check stops there, naming the cause
    with pytest.raises(SnapshotUnusable, match=r"the snapshot was refused by 2 ranks .*nothing was poisoned.*HTTP 401"):
        check_agents(_urls(ranks), token="nope")


# --------------------------------------------------------------------------- CLI


def test_cli_fetch(ranks: list[Rank], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    urls = [r.agent.url for r in ranks]
    assert cli(["fetch", *urls]) == 0
    assert capsys.readouterr().out.strip().endswith("2 of 2 ranks answered")
    dead = _dead_url()
    assert cli(["fetch", *urls, dead, "--timeout", "2", "--retries", "0", "--out", str(tmp_path / "f.parquet")]) == 1
    out = capsys.readouterr().out
    assert f"2 of 3 ranks answered; 1 unreachable: {dead}" in out
    assert len(pd.read_parquet(tmp_path / "f.parquet")) == 8


def test_cli_endstate_needs_confirmation_and_token(ranks: list[Rank], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WCVIZ_TOKEN", raising=False)
    urls = [r.agent.url for r in ranks]
    assert cli(["endstate", *urls, "--token", TOKEN]) == 2
    assert "pass --yes-reset to confirm" in capsys.readouterr().err
    assert cli(["endstate", *urls, "--yes-reset"]) == 2
    assert "bearer token" in capsys.readouterr().err
    assert all(torch.equal(r.params[n], r.truth[n]) for r in ranks for n in r.truth)  # nothing was touched


def test_cli_endstate_reports_and_exits_1_on_a_partial_reload(ranks: list[Rank], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WCVIZ_TOKEN", TOKEN)
    urls = [r.agent.url for r in ranks]
    assert cli(["endstate", *urls, "--yes-reset", "--no-progress"]) == 0
    assert "8 match" in capsys.readouterr().out
    ranks[0].skip = "norm"
    assert cli(["endstate", *urls, "--yes-reset", "--no-progress", "--out", str(tmp_path / "es")]) == 1
    out = capsys.readouterr().out
    assert re.search(r"unwritten +rank 0 \(pp=0 tp=0\) +model\.norm\.weight", out)
    assert "1 unwritten on 1 rank (rank 0 (pp=0 tp=0))" in out
    v = pd.read_parquet(tmp_path / "es" / "verdicts.parquet")
    assert v.loc[v["status"] == "unwritten", "name"].tolist() == ["model.norm.weight"]


def test_check_runs_inside_a_running_event_loop(ranks: list[Rank]) -> None:
    """A Jupyter kernel runs an event loop: the blocking API must still work there."""
    import asyncio

    async def in_kernel() -> object:
        return check_agents(_urls(ranks), token=TOKEN)

    assert asyncio.run(in_kernel()).ok


# --------------------------------------------------------------------------- every way out names the poisoned ranks first


def _restored(ranks: list[Rank]) -> bool:
    return all(torch.equal(r.params[n], r.truth[n]) for r in ranks for n in r.truth)


def test_a_void_check_with_a_failed_reload_names_the_poisoned_rank_first(ranks: list[Rank]) -> None:
    ranks[0].ignore_reset = True  # rank 0's reset changes nothing: the check is void...
    ranks[1].fail_reload = True  # ...and rank 1 is left poisoned
    with pytest.raises(ResetNotCovered) as info:
        check_agents(_urls(ranks), token=TOKEN)
    message = str(info.value)
    assert message.startswith("RELOAD FAILED on engine 1 (pp=0 tp=1): still poisoned"), message
    assert "void" in message and info.value.poisoned == ("engine 1 (pp=0 tp=1)",)
    assert (ranks[1].params["model.norm.weight"].view(torch.uint8) == 0xA5).all()


def test_a_before_reload_hook_that_raises_still_reloads_every_rank(ranks: list[Rank]) -> None:
    def boom() -> None:
        raise RuntimeError("fault injection failed")

    with pytest.raises(RuntimeError, match="fault injection failed"):
        check_agents(_urls(ranks), token=TOKEN, before_reload=boom)
    assert _restored(ranks)  # the reload ran although the hook failed
    ranks[1].fail_reload = True
    with pytest.raises(EngineLeftPoisoned) as info:
        check_agents(_urls(ranks), token=TOKEN, before_reload=boom)
    message = str(info.value)
    assert message.startswith("RELOAD FAILED on engine 1 (pp=0 tp=1): still poisoned"), message
    assert "fault injection failed" in message and isinstance(info.value.__cause__, RuntimeError)
    assert torch.equal(ranks[0].params["model.norm.weight"], ranks[0].truth["model.norm.weight"])


def test_a_rank_that_dies_after_its_reset_keeps_its_coordinates(ranks: list[Rank], capsys: pytest.CaptureFixture[str]) -> None:
    """`wcviz endstate URL URL`: identities come from /v1/info, and a rank that dies later is still that rank."""
    import threading

    dying = ranks[1]
    plain_reset = dying.reset

    def reset_then_die() -> None:
        plain_reset()
        listener = dying.agent._server.servers[0]
        threading.Thread(target=dying.agent.stop, daemon=True).start()
        deadline = time.monotonic() + 10
        while listener.is_serving() and time.monotonic() < deadline:  # gone before the reload, not merely going
            time.sleep(0.01)
        assert not listener.is_serving()

    dying.agent._actions["reset"] = reset_then_die
    urls = [r.agent.url for r in ranks]
    assert cli(["endstate", *urls, "--yes-reset", "--token", TOKEN, "--no-progress", "--timeout", "5"]) == 1
    out = capsys.readouterr().out
    assert "end-state check: 2 ranks," in out, out
    assert "rank 1 (pp=0 tp=1)" in out and "no rank coordinates" not in out
    assert "4 unreachable on 1 rank (rank 1 (pp=0 tp=1)), 4 match" in out, out
    assert "RELOAD FAILED on engine 1 (pp=0 tp=1)" in out  # reset, then never reloaded


def test_an_empty_rank_fails_the_check_by_name(ranks: list[Rank]) -> None:
    hollow = Agent(dict, role="engine", rank=2, pp=0, tp=2, token=TOKEN, allow_mutations=True,
                   snapshot=lambda: None, reset=lambda: None, reload=lambda: None)  # fmt: skip
    with hollow:
        urls = {**_urls(ranks), hollow.url: {"role": "engine", "rank": 2, "pp": 0, "tp": 2}}
        report = check_agents(urls, token=TOKEN)
    assert not report.ok
    v = report.verdicts
    assert v.loc[v["rank"] == 2, "status"].tolist() == ["empty"]
    assert "1 rank empty (rank 2 (pp=0 tp=2): answered with no parameters)" in report.summary


# --------------------------------------------------------------------------- found by an audit (2026-12-02)


class Counting(Rank):
    """A rank that remembers which actions reached it."""

    def __init__(self, rank: int, tp: int) -> None:
        self.actions: list[str] = []
        super().__init__(rank, tp)

    def reset(self) -> None:
        self.actions.append("reset")
        super().reset()


def test_a_snapshot_that_cannot_be_classified_stops_the_check_before_any_reset() -> None:
    """Two DP replicas both calling themselves rank 0 (rank 0 with two identities): found only after the reload,
    the error hid a rank left poisoned. Now the check stops after the snapshot: nothing is poisoned."""
    a, b = Counting(0, 0), Counting(0, 0)
    b.agent.coords["dp"] = 1  # rank 0 again, another replica's coordinates
    b.fail_reload = True  # had it been reset, it would stay poisoned
    with a.agent, b.agent:
        with pytest.raises(SnapshotUnusable, match=r"nothing was poisoned.*rank 0 claims two identities"):
            check_agents([a.agent.url, b.agent.url], token=TOKEN)
    assert a.actions == b.actions == []
    assert all(torch.equal(b.params[n], b.truth[n]) for n in b.truth)


def test_cli_endstate_refuses_an_unwritable_out_and_a_nan_timeout_before_any_reset(
    ranks: list[Rank], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("WCVIZ_TOKEN", TOKEN)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    urls = [r.agent.url for r in ranks]
    assert cli(["endstate", *urls, "--yes-reset", "--no-progress", "--out", str(blocker)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {blocker}: cannot create that directory" in err
    assert all(torch.equal(r.params[n], r.truth[n]) for r in ranks for n in r.truth)  # nothing was reset
    for bad in (["--timeout", "nan"], ["--timeout", "inf"]):
        assert cli(["endstate", *urls, "--yes-reset", "--no-progress", *bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "timeout_s must be a finite number of seconds > 0" in err


def test_cli_endstate_names_a_poisoned_rank_before_any_table(ranks: list[Rank], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WCVIZ_TOKEN", TOKEN)
    ranks[1].fail_reload = True
    assert cli(["endstate", *[r.agent.url for r in ranks], "--yes-reset", "--no-progress"]) == 1
    assert capsys.readouterr().out.splitlines()[0].startswith("RELOAD FAILED on engine 1 (pp=0 tp=1): still poisoned")


def test_a_rank_of_zero_byte_tensors_is_empty_not_a_pass(ranks: list[Rank]) -> None:
    """An engine that released its weights to size 0 still lists their names: that rank holds nothing."""
    hollow = Agent(lambda: {"w": torch.empty(0), "b": torch.empty(0, 4)}, role="engine", rank=2, pp=0, tp=2, token=TOKEN,
                   allow_mutations=True, snapshot=lambda: None, reset=lambda: None, reload=lambda: None)  # fmt: skip
    with hollow:
        urls = {**_urls(ranks), hollow.url: {"role": "engine", "rank": 2, "pp": 0, "tp": 2}}
        fetched = fetch(urls)
        report = check_agents(urls, token=TOKEN)
        filtered = fetch(urls, name="^w$")
    assert not fetched.complete and fetched.failed["kind"].tolist() == ["empty"]
    assert "holds only zero-byte parameters" in fetched.failed["error"].iloc[0]
    assert not report.ok and report.verdicts.loc[report.verdicts["rank"] == 2, "status"].tolist() == ["empty"]
    assert len(filtered.failed) == 0  # a filter that chose only empty tensors: not an empty rank


def test_an_observer_that_raises_does_not_turn_a_good_reload_into_a_failure(ranks: list[Rank]) -> None:
    from wcviz.endstate import AgentFleet, EndStateSession, run

    def observer(phase: str, step: str) -> None:
        if (phase, step) == ("reload", "reload"):
            raise RuntimeError("the progress bar was closed")

    report = run(EndStateSession(AgentFleet(_urls(ranks), token=TOKEN), on_step=observer))
    assert report.ok and len(report.poisoned) == 0
