"""What every fleet source shares (``wcviz.sources._fleet``) and the end-state session's ways out, against
answers a rank should never give: each case was found by an audit (2026-12-02) as a pass or a crash."""

from __future__ import annotations

import time
from typing import Any

import pandas as pd
import pytest
import torch

from wcviz.endstate import EndStateSession, EngineLeftPoisoned, classify, poison_, run
from wcviz.endstate.fleets import CallableFleet
from wcviz.frame import make_frame
from wcviz.sources import named_tensor_table
from wcviz.sources._fleet import Failed, assemble, checked_url, identity_of
from wcviz.sources._tensors import from_named_tensors


def _rank(rank: int, tensors: dict[str, torch.Tensor]) -> tuple[str, dict[str, Any], dict[str, Any], pd.DataFrame]:
    info = {"role": "engine", "rank": rank, "tp": rank, "params": len(tensors)}
    frame = from_named_tensors(tensors, role="engine", rank=rank, tp=rank, backend="torch")
    return f"http://r{rank}:1", identity_of(info, "info"), info, frame


def test_a_rank_whose_table_cannot_be_trusted_fails_alone() -> None:
    good = _rank(0, {"a": torch.ones(3), "b": torch.zeros(2)})
    twice = _rank(1, {"a": torch.ones(3)})
    twice = (*twice[:3], pd.concat([twice[3], twice[3]], ignore_index=True))  # lists "a" twice
    hollow = _rank(2, {"a": torch.empty(0), "b": torch.empty(0, 5)})  # released to size 0, names kept
    negative = _rank(3, {"a": torch.ones(3)})
    negative[3]["nbytes"] = pd.array([-5], dtype="Int64")
    res = assemble([good, twice, hollow, negative], [])
    assert sorted(res.frame["rank"].unique()) == [0] and len(res.frame) == 2
    by_rank = {int(r["rank"]): r for r in res.failed.to_dict(orient="records")}
    assert (by_rank[1]["kind"], by_rank[2]["kind"], by_rank[3]["kind"]) == ("failed", "empty", "failed")
    assert "lists parameter 'a' more than once" in by_rank[1]["error"]
    assert "holds only zero-byte parameters" in by_rank[2]["error"]
    assert "byte count of -5" in by_rank[3]["error"]
    assert by_rank[2]["tp"] == 2 and by_rank[2]["url"] == "http://r2:1"
    assert not res.complete and res.answered == 2  # the good rank, and the empty one (it answered, holding nothing)
    one_zero = _rank(4, {"a": torch.ones(3), "e": torch.empty(0)})
    assert len(assemble([good, one_zero], []).failed) == 0  # one empty tensor beside real ones is fine
    assert len(assemble([hollow], [], filtered=True).failed) == 0  # a name filter chose them


def test_coordinates_must_fit_the_table() -> None:
    for bad in ({"rank": 2**70}, {"rank": -1}, {"rank": 0, "tp": 2**63}, {"rank": 0, "dp": -3}):
        with pytest.raises(Failed, match="not a coordinate"):
            identity_of({"role": "engine", **bad}, "/v1/info")
    assert identity_of({"role": "engine", "rank": 2**63 - 1}, "/v1/info")["rank"] == 2**63 - 1


def test_one_rank_listed_twice_under_one_label_says_so() -> None:
    """SGLang's attention DP lists a TP rank once per attention-DP group, all behind one URL."""
    r = _rank(0, {"a": torch.ones(3)})
    res = assemble([r, r], [])
    assert res.failed["kind"].tolist() == ["failed", "failed"]
    assert all(e.endswith("claims the same rank (role=engine, rank=0, tp=0) 2 times under this one label (one rank listed more than once)") for e in res.failed["error"])


@pytest.mark.parametrize("url", ["http://127.0.0.1:332330000", "http://h:0", "http://h:65536"])
def test_a_port_out_of_range_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match=r"port \d+ is not 1\.\.65535"):
        checked_url(url)
    assert checked_url("http://h:65535/") == "http://h:65535"


def test_a_byte_count_that_contradicts_its_row_proves_nothing_and_costs_nothing() -> None:
    """vLLM's checker hashes bytes alone, so the poison's digest is computed from ``nbytes``: a negative count
    raised out of the report, and a claimed 1 TiB hashed for minutes. Both are now unproven, at once."""
    w = torch.randn(4, 4)
    p = w.clone()
    poison_({"x": p})

    def frame(t: torch.Tensor, **over: Any) -> pd.DataFrame:
        rows = named_tensor_table([("x.weight", t)], algo="vllm-sha256", progress=False, role="engine", rank=0).rows()
        return make_frame([dict(r, **over) for r in rows])

    assert classify(frame(w), frame(p), frame(w))["status"].tolist() == ["match"]  # the honest row is proven
    for nbytes in (-1, 2**40, 63):
        t0 = time.process_time()
        v = classify(frame(w, nbytes=nbytes), frame(p), frame(w, nbytes=nbytes), allow_partial_reset=True)
        assert v["status"].tolist() == ["unproven"] and time.process_time() - t0 < 30  # (a hang guard, not a timing)


def test_a_report_that_cannot_be_made_still_names_the_poisoned_ranks_first() -> None:
    """The reload failed (the engine holds poison) and its digests mix two algorithms: the report's own error
    used to come out alone, and the poisoned ranks with it were never named."""
    weights = {"a": torch.ones(8), "b": torch.full((8,), 2.0)}
    state = {"w": {n: t.clone() for n, t in weights.items()}}

    def digests(phase: str) -> pd.DataFrame:
        frame = from_named_tensors(state["w"], role="engine", rank=0, backend="torch", phase=phase)
        if phase == "reload":
            other = from_named_tensors({"c": torch.ones(2)}, role="engine", rank=0, backend="torch", algo="sha256", phase=phase)
            frame = pd.concat([frame, other], ignore_index=True)
        return frame

    def reload() -> None:
        raise OSError("shard 3 unreadable")

    fleet = CallableFleet(lambda: None, lambda: poison_(state["w"]), reload, digests)
    with pytest.raises(EngineLeftPoisoned, match=r"^RELOAD FAILED on every rank: still poisoned.*Also, no verdicts could be made: .*mixes digest algorithms") as e:
        run(EndStateSession(fleet))
    assert e.value.poisoned == ("every rank",)


def _callable_fleet(params: dict[str, torch.Tensor], digests: Any, actions: list[str]) -> CallableFleet:
    return CallableFleet(
        lambda: actions.append("snapshot"),
        lambda: actions.append("reset") or poison_(params),
        lambda: actions.append("reload"),
        digests,
    )


def test_a_reset_after_the_reload_leaves_no_reload_to_report_on() -> None:
    """snapshot, reset, reload, reset: the report used the reload from before the second reset, "all match" over
    an engine holding the poison."""
    params = {"a": torch.ones(8), "b": torch.full((4,), 2.0)}
    truth = {n: t.clone() for n, t in params.items()}
    actions: list[str] = []

    def digests(phase: str) -> pd.DataFrame:
        return from_named_tensors(params, role="engine", rank=0, backend="torch", phase=phase)

    session = EndStateSession(_callable_fleet(params, digests, actions))
    session.snapshot()
    session.reset()
    for n, t in truth.items():
        params[n].copy_(t)
    session.reload()
    session.reset()
    with pytest.raises(RuntimeError, match="has not run reload yet"):
        session.report()


def test_a_rank_of_zero_byte_parameters_is_empty_whatever_fleet_gave_it() -> None:
    params = {"w0": torch.randn(8)}
    hollow = {"w1": torch.empty(0), "w2": torch.empty(0, 3)}

    def digests(phase: str) -> pd.DataFrame:
        return pd.concat(
            [from_named_tensors(params, role="engine", rank=0, backend="torch"),
             from_named_tensors(hollow, role="engine", rank=1, backend="torch")],
            ignore_index=True,
        )  # fmt: skip

    truth = {n: t.clone() for n, t in params.items()}

    def reload() -> None:
        for n, t in truth.items():
            params[n].copy_(t)

    fleet = CallableFleet(lambda: None, lambda: poison_(params), reload, digests)
    v = run(EndStateSession(fleet)).verdicts
    assert set(v.loc[v["rank"] == 1, "status"]) == {"empty"} and set(v.loc[v["rank"] == 0, "status"]) == {"match"}


def test_a_reset_pattern_the_report_cannot_read_is_refused_before_anything_runs() -> None:
    params = {"a": torch.ones(8)}
    actions: list[str] = []
    fleet = _callable_fleet(params, lambda phase: from_named_tensors(params, role="engine", rank=0, backend="torch"), actions)
    fleet.reset_pattern = "poisonn"
    with pytest.raises(ValueError, match="reset_pattern must be one of"):
        run(EndStateSession(fleet))
    assert actions == []
    session = EndStateSession(_callable_fleet(params, lambda phase: from_named_tensors(params, role="engine", rank=0, backend="torch"), actions))
    session.snapshot()
    session.fleet.reset_pattern = 256
    with pytest.raises(ValueError, match="reset_pattern byte must be 0..255"):
        session.reset()
    assert actions == ["snapshot"]


def test_the_dashboard_refuses_reset_after_an_unusable_snapshot_and_says_nothing_is_poisoned() -> None:
    from wcviz.endstate import SnapshotUnusable
    from wcviz.widgets.state import DashboardState

    params = {"w0": torch.randn(4), "w1": torch.randn(4)}

    def digests(phase: str) -> pd.DataFrame:  # two algorithms in one snapshot: it cannot be classified
        return pd.concat(
            [from_named_tensors({"w0": params["w0"]}, role="engine", rank=0, backend="torch"),
             from_named_tensors({"w1": params["w1"]}, role="engine", rank=0, backend="torch", algo="sha256")],
            ignore_index=True,
        )  # fmt: skip

    actions: list[str] = []
    state = DashboardState(_callable_fleet(params, digests, actions))
    with pytest.raises(SnapshotUnusable):
        state.phase("snapshot")
    assert "the snapshot cannot be compared, so nothing may be reset" in (state.step_block("reset") or "")
    with pytest.raises(RuntimeError, match="reset is disabled"):
        state.phase("reset")
    assert "reset" not in actions and not state.reset_started
    assert state.step_block("snapshot") is None and state.next_step == "snapshot"
