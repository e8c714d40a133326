"""The views say what they hide: replays of a review of the dashboard, plots and summaries (2026-12-02), each a
case where a picture, a count or a filter showed less than the verdicts held, or a rank in another's place."""

from __future__ import annotations

import hashlib

import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from wcviz._errors import TableError  # noqa: E402
from wcviz.frame import make_frame  # noqa: E402
from wcviz.verdicts import counts  # noqa: E402
from wcviz.views import drilldown_text, plot_layer_rank, topology_text  # noqa: E402
from wcviz.widgets import DashboardState  # noqa: E402

IDS = ("rank", "dp", "pp", "tp", "ep")


def _layer(i: int, leaf: str = "mlp.down_proj.weight") -> str:
    return f"model.layers.{i}.{leaf}"


def _verdicts(rows: list[tuple], cols: tuple[str, ...] = ("rank", "pp", "tp"), extra: tuple[str, ...] = ()) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=[*cols, "name", "status", *extra])
    for c in IDS:
        df[c] = df[c].astype("Int64") if c in df else pd.Series(pd.NA, index=df.index, dtype="Int64")
    df["status"], df["name"] = df["status"].astype("string"), df["name"].astype("string")
    for c in extra:
        df[c] = df[c].astype("string")
    return df[[*IDS, "name", "status", *extra]]


def _sha(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def test_the_role_filter_keeps_missing_rows_and_ranks_whose_role_no_one_says() -> None:
    """A missing row took the expected side's role (a checkpoint's) and an unreachable rank had none: choosing the
    engines' role hid both, and no view said anything was left out."""
    names = [_layer(0), _layer(1)]
    expected = make_frame([{"name": n, "digest": _sha(n), "algo": "sha256", "role": "checkpoint"} for n in names])
    actual = make_frame([{"name": names[0], "digest": _sha(names[0]), "algo": "sha256", "role": "engine", "rank": r, "pp": 0, "tp": r} for r in (0, 1)])
    state = DashboardState({"expected": expected, "actual": actual})
    state.compare()
    state.role_filter = "engine"
    table = state.table
    assert table is not None and sorted(table.loc[table["status"] == "missing", "rank"].tolist()) == [0, 1]
    assert "x" in state.view_text("layer × rank")
    ghost = _verdicts([(0, 0, 0, _layer(0), "match", "engine"), (None, None, None, None, "unreachable", None)], extra=("role",))
    state = DashboardState(ghost)
    state.role_filter = "engine"
    assert state.table is not None and state.table["status"].tolist() == ["match", "unreachable"]


def test_ranks_sharing_a_topology_cell_are_named_by_the_worst() -> None:
    """Four expert-parallel ranks at pp0 tp0, the mismatch on r3: the cell read 'r0+3', naming a rank that matched."""
    v = _verdicts([(r, 0, 0, r, _layer(0), "mismatch" if r == 3 else "match") for r in range(4)], cols=("rank", "pp", "tp", "ep"))
    text = str(topology_text(v))
    assert "r3+3" in text and "r0+3" not in text


def test_the_table_view_shows_every_coordinate_that_tells_ranks_apart() -> None:
    """Two replicas told apart only by dp printed as '<NA> <NA> 0 ... mismatch' for both."""
    v = _verdicts([(d, t, _layer(0), "mismatch" if d == 1 else "match") for d in (0, 1) for t in (0, 1)], cols=("dp", "tp"))
    lines = DashboardState(v).view_text("table").splitlines()
    assert lines[0].split()[:2] == ["dp", "tp"]
    assert sorted(line.split()[0] for line in lines[1:] if line.split()[-1] == "mismatch") == ["1", "1"]


def test_ranks_known_only_by_their_urls_are_counted_and_named_by_them() -> None:
    """Four ranks, two of them unreachable and known only by URL: '2 of 3 ranks answered ((no rank), (no rank))'."""
    v = _verdicts(
        [(0, 0, 0, _layer(0), "match", None), (1, 0, 1, _layer(0), "match", None),
         (None, None, None, None, "unreachable", "http://a:1"), (None, None, None, None, "unreachable", "http://b:1")],
        extra=("url",),
    )  # fmt: skip
    status = DashboardState(v).status_text
    assert status.startswith("2 of 4 ranks answered") and "http://a:1, http://b:1" in status and "(no rank)" not in status


def test_a_finding_the_filter_hides_wholly_is_hatched_not_plain_grey() -> None:
    """A cell holding only an unwritten row, with the filter on mismatches, was drawn as a cell of matches."""
    v = _verdicts([(0, 0, 0, _layer(0), "match"), (0, 0, 0, _layer(1), "mismatch"), (1, 0, 1, _layer(0), "unwritten"), (1, 0, 1, _layer(1), "match")])
    fig = plot_layer_rank(v, keep=(v["status"] == "mismatch").to_numpy())
    hatched = [c for c in fig.axes[0].collections if c.get_gid() == "filtered_problem"]
    assert len(hatched) == 1
    corners = sorted(tuple(p.vertices.min(0) + 0.5) for p in hatched[0].get_paths())
    assert corners == [(1.0, 0.0)]  # rank 1's layer 0: wholly filtered out, and not a match


def test_counts_add_up_to_the_rows_for_every_status() -> None:
    v = _verdicts([(0, 0, 0, _layer(0), s) for s in ("corrupted", "unwritten", "match")] + [(1, 0, 1, None, "unreachable")])
    c = counts(v)
    assert sum(c.values()) == len(v) and c["corrupted"] == c["unwritten"] == c["unreachable"] == c["match"] == 1
    assert list(c)[0] == "corrupted" and c["mismatch"] == 0


def test_the_drill_down_refuses_verdicts_it_cannot_judge_by() -> None:
    """A verdict frame without a status drew a drifted rank as if it held the expected digest."""
    name = _layer(0)
    expected = make_frame([{"name": name, "digest": _sha("a"), "algo": "sha256", "role": "checkpoint"}])
    actual = make_frame([{"name": name, "digest": _sha("b"), "algo": "sha256", "role": "engine", "rank": 0, "tp": 0}])
    with pytest.raises(TableError, match="no 'status' column"):
        drilldown_text({"expected": expected, "actual": actual}, name, verdicts=pd.DataFrame({"name": [name]}))
    with pytest.raises(TableError, match="expected a verdict DataFrame, got list"):
        drilldown_text({"expected": expected, "actual": actual}, name, verdicts=[1])  # type: ignore[arg-type]


@pytest.mark.parametrize("gbps,overhead", [(0.0, 0.0), (-1.0, 0.0), (float("nan"), 0.0), (1.0, -0.1)])
def test_a_cost_prediction_refuses_rates_that_cannot_be_rates(gbps: float, overhead: float) -> None:
    from wcviz.bench import predicted_cost

    rates = pd.DataFrame({"backend": ["torch"], "gbps": [gbps], "overhead_s": [overhead]})
    with pytest.raises(ValueError, match=r"rates row 0 \(torch\): gbps must be > 0 and overhead_s >= 0"):
        predicted_cost(["sim-tiny"], rates=rates)
    with pytest.raises(TypeError, match="rates must be a DataFrame"):
        predicted_cost(["sim-tiny"], rates=[1, 2])  # type: ignore[arg-type]
