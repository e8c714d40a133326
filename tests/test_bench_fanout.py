"""benchmarks/fanout.py at a tiny size: spawned agent servers, one concurrent fetch, a complete frame.

No timing is asserted (the machine is shared); the rows are, exactly: every rank's every
parameter once, with the rank's coordinates and the digest of the tensors it hosts.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pandas as pd
import pytest

from wcviz.sources import from_named_tensors

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def fanout(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    # importable by name, so the spawned workers (which get this sys.path) can unpickle fanout._worker
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("fanout")


@pytest.mark.slow
def test_fanout_frame_is_complete_with_the_expected_rows(fanout: ModuleType) -> None:
    agents, params, elements = 4, 10, 64
    f = fanout.measure(
        agents, params, procs=2, repeat=1, seq_sample=2, elements=elements, timeout_s=60, log=lambda *_: None
    )

    assert (f.agents, f.params, f.procs, f.rows, len(f.times), f.seq_agents) == (4, 10, 2, 40, 1, 2)
    expected = pd.concat(
        [
            from_named_tensors(fanout.weights(r, params, elements), role="trainer", rank=r, host="bench",
                               progress=False, **fanout.coords(r))
            for r in range(agents)
        ],
        ignore_index=True,
    )
    cols = ["rank", "dp", "pp", "tp", "ep", "role", "host", "name", "digest", "algo", "dtype", "shape", "nbytes",
            "layer", "block"]
    got = f.frame[cols].sort_values(["rank", "name"]).reset_index(drop=True)
    want = expected[cols].sort_values(["rank", "name"]).reset_index(drop=True)
    pd.testing.assert_frame_equal(got, want)
    assert len(got) == 40 and not got.duplicated(["rank", "name"]).any()
    assert list(got.drop_duplicates("rank")[["dp", "pp", "tp"]].itertuples(index=False, name=None)) == [
        (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3)
    ]
    assert set(got["dtype"]) == {"bfloat16"} and set(got["shape"]) == {"[8, 8]", "[64]"}
    assert got["digest"].nunique() == 40  # each rank holds its own values
    assert f.frame["url"].nunique() == 4


def test_verify_rejects_a_frame_missing_a_rank(fanout: ModuleType) -> None:
    class Result:  # what verify reads of a FetchResult: all answered, but one rank's rows are gone
        complete, answered, urls, summary = True, 2, ("http://a", "http://b"), "2 of 2 ranks answered"
        frame = pd.DataFrame({"rank": [0] * 3, "name": fanout.param_names(3)})

    with pytest.raises(RuntimeError, match="expected 2 x 3 = 6 rows, got 3"):
        fanout.verify(Result(), {0: "http://a", 1: "http://b"}, 3)
    assert fanout.param_names(10)[0] == "model.embed_tokens.weight" and fanout.param_names(10)[-1] == "lm_head.weight"
    assert len(set(fanout.param_names(500))) == 500
    assert fanout.sample_ranks(256, 8, 32)[:9] == [0, 1, 2, 3, 4, 5, 6, 7, 64]  # every process, then further ranks
    assert sorted(fanout.sample_ranks(10, 3, 10)) == list(range(10))
