"""Ray: from_ray_actors against a real local Ray, with actors that hold small engine shards.

Skips when Ray is not installed (``pip install 'wcviz[ray]'``); ``make test`` installs it.
One local Ray per module (``num_cpus=2``, no dashboard), two actor processes in all.
"""

from __future__ import annotations

import socket
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

import pandas as pd
import pytest
import torch

from wcviz.integrations.vllm import WcvizWorkerExtension
from wcviz.sim.engine import EngineLayout, EngineShard
from wcviz.sim.model import TINY, build_state_dict
from wcviz.sources import from_named_tensors
from wcviz.sources._ray import from_ray_actors

LAYOUT = EngineLayout(tp=2, pp=2)
HOST = socket.gethostname()


def shard_of(rank: int) -> tuple[EngineShard, tuple[int, int, int]]:
    dp, pp, tp = LAYOUT.coords(rank)
    shard = EngineShard(TINY, tp, LAYOUT.tp, pp, LAYOUT.pp)
    shard.load_weights(build_state_dict(TINY).items())
    return shard, (dp, pp, tp)


def module_of(params: dict[str, torch.Tensor]) -> torch.nn.Module:
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


class ShardWorker(WcvizWorkerExtension):
    """An actor body: one engine rank, with the extension's wcviz_info / wcviz_digests."""

    def __init__(self, rank: int) -> None:
        self.shard, (self.dp_rank, self.pp_rank, self.tp_rank) = shard_of(rank)
        self.rank = rank
        self.model_runner = types.SimpleNamespace(model=module_of(self.shard.params))

    def boom(self) -> None:
        raise ValueError(f"rank {self.rank} cannot digest today")

    def nap(self, hang_rank: int, seconds: float) -> dict[str, Any]:
        if self.rank == hang_rank:
            time.sleep(seconds)
        return self.wcviz_digests()

    def rows_only(self, as_frame: bool = False) -> Any:
        frame = from_named_tensors(self.shard.params, role="engine", rank=self.rank, pp=self.pp_rank, tp=self.tp_rank, progress=False)
        return frame if as_frame else frame.astype(object).where(frame.notna(), None).to_dict(orient="records")

    def not_rows(self) -> str:
        return "hello"

    def inner_timeout(self) -> None:
        import ray

        raise ray.exceptions.GetTimeoutError("a ray.get of its own, inside the method, timed out")

    def resized(self, extra: int, name_regex: str | None = None, uncounted: bool = False) -> dict[str, Any]:
        """The extension's own answer (its info counts every parameter) with ``extra`` rows more (renamed copies)
        or, below 0, fewer: a digest table that lost or gained rows on the way. ``uncounted``: its info's
        ``params`` is None (the count wcviz_info gave still stands)."""
        answer = self.wcviz_digests(name_regex)
        rows = answer["rows"]
        rows = rows[:extra] if extra < 0 else rows + [{**r, "name": f"{r['name']}.copy"} for r in rows[:extra]]
        info = {**answer["info"], "params": None} if uncounted else answer["info"]
        return {**answer, "info": info, "rows": rows}

    def holds_nothing(self, name_regex: str | None = None) -> dict[str, Any]:
        """An answer with no rows and an info that does not count parameters: a rank whose weights are released."""
        info = {k: v for k, v in self.wcviz_info().items() if k != "params"}
        return {"info": info, "rows": []}


@pytest.fixture(scope="module")
def ray() -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'wcviz[ray]' to run the Ray tests")
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test file
    for attempt in (1, 2):  # once more if a busy machine made the raylet give up on its dashboard agent
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config={"enable_worker_prestart": False})
            break
        except Exception as e:  # Ray raises a bare Exception when its node does not start
            ray.shutdown()
            if attempt == 2:
                raise RuntimeError(
                    f"a local Ray did not start, twice ({e}); on a busy 2-core machine the raylet's fixed 15 s wait "
                    "for its dashboard agent can expire (see docs/engines.md)"
                ) from e
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def actors(ray: Any) -> list[Any]:
    Remote = ray.remote(num_cpus=0, max_concurrency=2)(ShardWorker)
    handles = [Remote.remote(r) for r in range(2)]
    ray.get([h.wcviz_info.remote() for h in handles], timeout=120)  # all started
    return handles


def expected(ranks: list[int], phase: str = "current") -> pd.DataFrame:
    frames = []
    for r in ranks:
        shard, (dp, pp, tp) = shard_of(r)
        frames.append(from_named_tensors(shard.params, role="engine", rank=r, dp=dp, pp=pp, tp=tp, host=HOST, phase=phase, progress=False))
    return _norm(pd.concat(frames, ignore_index=True))


def _norm(df: pd.DataFrame) -> pd.DataFrame:
    return df.drop(columns=["seconds", "url"], errors="ignore").sort_values(["rank", "name"]).reset_index(drop=True)


def test_every_actor_is_collected_identity_from_its_own_info(actors: list[Any]) -> None:
    res = from_ray_actors(list(reversed(actors)), timeout_s=60, phase="snapshot")
    assert res.complete and res.answered == 2, res.summary
    pd.testing.assert_frame_equal(_norm(res.frame), expected([0, 1], "snapshot"))
    assert res.urls == tuple(repr(a) for a in actors)  # ordered by rank, not by the order given
    assert [res.infos[repr(a)]["rank"] for a in actors] == [0, 1]
    part = from_ray_actors(actors, name_regex="norm")
    assert part.complete and part.frame["name"].str.contains("norm").all()


def test_a_method_that_raises_is_failed_under_the_actors_identity(actors: list[Any]) -> None:
    res = from_ray_actors(actors[:2], "boom")
    assert res.answered == 0 and list(res.failed["rank"]) == [0, 1] and set(res.failed["kind"]) == {"failed"}
    assert "ValueError: rank 1 cannot digest today" in res.failed["error"].iloc[1]
    bad = from_ray_actors(actors[:1], "not_rows")
    assert "not {'info'" not in bad.failed["error"].iloc[0] and "did not give a list of row dicts" in bad.failed["error"].iloc[0]
    missing = from_ray_actors(actors[:1], "no_such_method")
    assert "could not call it" in missing.failed["error"].iloc[0] and missing.failed["rank"].iloc[0] == 0


def test_a_method_raising_a_timeout_of_its_own_is_failed_not_hung(actors: list[Any]) -> None:
    """Ray 2.60 raises ``RayTaskError.as_instanceof_cause()``: a class that is also a GetTimeoutError here. The
    actor answered at once; the method failed. Not "no result within 30 s", not unreachable."""
    res = from_ray_actors(actors[:1], "inner_timeout", timeout_s=30)
    assert res.failed["kind"].tolist() == ["failed"], res.summary
    assert "the method raised GetTimeoutError: a ray.get of its own, inside the method, timed out" in res.failed["error"].iloc[0]


def test_a_result_not_collected_in_time_is_unreachable_never_a_pass(actors: list[Any]) -> None:
    t0 = time.monotonic()
    res = from_ray_actors(actors[:2], "nap", timeout_s=1.5, hang_rank=1, seconds=6.0)
    assert time.monotonic() - t0 < 5
    assert not res.complete and list(res.frame["rank"].unique()) == [0]
    row = res.failed.iloc[0]
    assert (row["rank"], row["tp"], row["kind"]) == (1, 1, "unreachable") and "no result within 1.5 s" in row["error"]


def test_rows_alone_identify_the_actor(actors: list[Any]) -> None:
    res = from_ray_actors(actors[:2], "rows_only", info_method=None)
    assert res.complete and sorted(res.frame["rank"].unique()) == [0, 1]
    frames = from_ray_actors(actors[:1], "rows_only", info_method=None, as_frame=True)
    assert frames.complete and len(frames.frame) == len(shard_of(0)[0].params)


def test_expected_identity_is_checked(actors: list[Any]) -> None:
    res = from_ray_actors({actors[0]: {"role": "engine", "rank": 0}, actors[1]: {"role": "engine", "rank": 5}})
    assert res.answered == 1
    assert "the actor says rank=1 but it was expected to serve rank=5" in res.failed["error"].iloc[0]
    with pytest.raises(ValueError, match="unknown key"):
        from_ray_actors({actors[0]: {"tensor": 0}})
    with pytest.raises(ValueError, match="given twice"):
        from_ray_actors([actors[0], actors[0]])


def test_a_row_count_other_than_the_info_counts_fails_the_actor(actors: list[Any]) -> None:
    """As the HTTP and vLLM sources: an actor whose info counts N parameters but answers fewer (or more) rows
    cannot be trusted to say what it holds, and is no pass; a name filter chooses rows on purpose."""
    n = len(shard_of(0)[0].params)
    for extra in (-2, 1):
        # a filter of None filters nothing; an answer whose own info gives no count is held to wcviz_info's
        for kwargs in ({}, {"name_regex": None}, {"uncounted": True}):
            res = from_ray_actors(actors[:1], "resized", extra=extra, **kwargs)
            assert not res.complete and res.failed["kind"].tolist() == ["failed"], (extra, kwargs, res.summary)
            assert res.failed["error"].iloc[0] == f"the actor counts {n} parameters but resized gave {n + extra} rows"
            assert res.failed["rank"].iloc[0] == 0 and len(res.frame) == 0
    part = from_ray_actors(actors[:1], "resized", extra=0, name_regex="norm")
    assert part.complete and 0 < len(part.frame) < n and part.frame["name"].str.contains("norm").all()


def test_only_a_name_filter_that_is_given_makes_no_rows_no_empty_rank(actors: list[Any]) -> None:
    """``name_regex=None`` is no filter: an actor answering no rows is ``empty``, as with no keyword at all."""
    for kwargs in ({}, {"name_regex": None}):
        res = from_ray_actors(actors[:1], "holds_nothing", info_method=None, **kwargs)
        assert not res.complete and res.failed["kind"].tolist() == ["empty"], (kwargs, res.summary)
    assert from_ray_actors(actors[:1], "holds_nothing", info_method=None, name_regex="nothing matches").complete


def test_a_killed_actor_is_unreachable_with_its_identity_if_known(ray: Any, actors: list[Any]) -> None:
    victim = actors[1]
    ray.kill(victim)
    res = from_ray_actors({actors[0]: {}, victim: {"role": "engine", "rank": 1, "dp": 0, "pp": 0, "tp": 1}}, timeout_s=30)
    assert res.answered == 1 and list(res.frame["rank"].unique()) == [0]
    row = res.failed.iloc[0]
    assert (row["url"], row["kind"], row["rank"], row["tp"]) == (repr(victim), "unreachable", 1, 1)
    assert "the actor died" in row["error"]
    unknown = from_ray_actors([victim], timeout_s=30)
    assert unknown.failed["rank"].isna().all() and list(unknown.failed["kind"]) == ["unreachable"]
    assert unknown.summary.startswith("0 of 1 ranks answered; 1 unreachable: Actor(")


def test_without_ray_the_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"pip install 'wcviz\[ray\]'"):
        from_ray_actors([object()])
