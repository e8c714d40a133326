"""Views of verdict frames: the layer × rank grid, its text form and its heatmap."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import wcviz.views
from wcviz._errors import TableError
from wcviz.digest._fill import fill_digest
from wcviz.endstate import classify
from wcviz.frame import make_frame
from wcviz.views import (
    COLORS,
    MARKS,
    SEVERITY,
    layer_rank_counts,
    layer_rank_grid,
    layer_rank_text,
    plot_layer_rank,
    status_counts_text,
)

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
NORM = "model.norm.weight"


def _layer(n: int, leaf: str = "mlp.down_proj.weight") -> str:
    return f"model.layers.{n}.{leaf}"


def verdicts(rows: list[tuple], coords: tuple[str, ...] = ("rank", "pp", "tp")) -> pd.DataFrame:
    """A verdict frame from (*coordinates, name, status) tuples; other identity columns are NA."""
    df = pd.DataFrame(rows, columns=[*coords, "name", "status"])
    for c in ("rank", "dp", "pp", "tp", "ep"):
        df[c] = df[c].astype("Int64") if c in df else pd.Series(pd.NA, index=df.index, dtype="Int64")
    df["status"] = df["status"].astype("string")
    df["name"] = df["name"].astype("string")
    return df[["rank", "dp", "pp", "tp", "ep", "name", "status"]]


TINY = verdicts([
    (0, 0, 0, EMBED, "match"),
    (0, 0, 0, _layer(0), "match"),
    (1, 0, 1, EMBED, "match"),
    (1, 0, 1, _layer(0), "unwritten"),
    (2, 1, 0, _layer(1), "missing"),
    (2, 1, 0, HEAD, "match"),
    (3, 1, 1, _layer(1), "corrupted"),
    (3, 1, 1, _layer(1, "self_attn.q_proj.weight"), "unwritten"),
    (3, 1, 1, HEAD, "match"),
])


def lines(*rows: str) -> str:
    return "\n".join(rows)


def _grid(cells: dict[str, list], columns: list[str]) -> pd.DataFrame:
    g = pd.DataFrame.from_dict(cells, orient="index", columns=columns).astype("string")
    g.index.name, g.columns.name = "part", "rank"
    return g


# --------------------------------------------------------------------------- grid


def test_severity_covers_both_verdict_kinds_worst_first() -> None:
    from wcviz.endstate import ENDSTATE_STATUSES
    from wcviz.verdicts import STATUSES

    assert set(STATUSES) | set(ENDSTATE_STATUSES) | {"unreachable"} == set(SEVERITY)
    assert SEVERITY[0] == "corrupted" and SEVERITY[-1] == "match"
    for kind in (STATUSES, ENDSTATE_STATUSES):  # each kind's own order is kept
        assert sorted(kind, key=SEVERITY.index) == list(kind)
    assert set(MARKS) == set(COLORS) == set(SEVERITY)
    assert len(set(MARKS.values())) == len(MARKS) and len(set(COLORS.values())) == len(COLORS)


def test_grid_cells_are_the_worst_status_of_their_rows() -> None:
    na = pd.NA
    expected = _grid(
        {
            "embed": ["match", "match", na, na],
            "layer 0": ["match", "unwritten", na, na],
            "layer 1": [na, na, "missing", "corrupted"],
            "head": [na, na, "match", "match"],
        },
        ["r0 pp0 tp0", "r1 pp0 tp1", "r2 pp1 tp0", "r3 pp1 tp1"],
    )
    pd.testing.assert_frame_equal(layer_rank_grid(TINY), expected)


@pytest.mark.parametrize(
    ("statuses", "worst"),
    [
        (["match", "corrupted", "unwritten"], "corrupted"),
        (["match", "unexpected", "missing"], "missing"),
        (["unexpected", "unreachable", "match"], "unreachable"),
        (["drift", "mismatch"], "mismatch"),
        (["unwritten", "missing", "match"], "unwritten"),
        (["match", "match"], "match"),
    ],
)
def test_worst_status_wins(statuses: list[str], worst: str) -> None:
    v = verdicts([(0, 0, 0, _layer(3, f"mlp.w{i}.weight"), s) for i, s in enumerate(statuses)])
    assert layer_rank_grid(v).loc["layer 3", "r0 pp0 tp0"] == worst


def test_parts_follow_model_order_not_string_order() -> None:
    names = ["model.rotary_emb.inv_freq", HEAD, NORM, _layer(10), _layer(2, "input_layernorm.weight"), _layer(2), EMBED]
    v = verdicts([(0, 0, 0, n, "match") for n in names])
    grid = layer_rank_grid(v)
    assert list(grid.index) == ["embed", "layer 2", "layer 10", "norm", "head", "other"]
    assert grid.index.name == "part" and grid.columns.name == "rank"


def test_only_parts_that_occur_are_rows() -> None:
    v = verdicts([(0, 0, 0, _layer(7), "match"), (0, 0, 0, HEAD, "match")])
    assert list(layer_rank_grid(v).index) == ["layer 7", "head"]


def test_rank_labels_come_from_coordinates_in_identity_order() -> None:
    v = verdicts([(r, r // 2, r % 2, EMBED, "match") for r in (10, 2, 3, 11)])
    assert list(layer_rank_grid(v).columns) == ["r2 pp1 tp0", "r3 pp1 tp1", "r10 pp5 tp0", "r11 pp5 tp1"]
    with_dp = verdicts([(r, 0, r, 0, EMBED, "match") for r in (1, 0)], coords=("rank", "dp", "pp", "tp"))
    assert list(layer_rank_grid(with_dp).columns) == ["r0 dp0 pp0 tp0", "r1 dp0 pp1 tp0"]
    no_rank = verdicts([(1, 0, EMBED, "match"), (0, 1, EMBED, "match")], coords=("pp", "tp"))
    assert list(layer_rank_grid(no_rank).columns) == ["pp0 tp1", "pp1 tp0"]
    nothing = verdicts([(EMBED, "match"), (HEAD, "unwritten")], coords=())
    assert list(layer_rank_grid(nothing).columns) == ["all"]
    assert layer_rank_grid(nothing).loc["head", "all"] == "unwritten"


def test_rank_identity_never_comes_from_row_order() -> None:
    shuffled = TINY.sample(frac=1, random_state=7).reset_index(drop=True)
    assert not shuffled["name"].equals(TINY["name"])
    pd.testing.assert_frame_equal(layer_rank_grid(shuffled), layer_rank_grid(TINY))
    pd.testing.assert_frame_equal(layer_rank_counts(shuffled), layer_rank_counts(TINY))
    assert layer_rank_text(shuffled) == layer_rank_text(TINY)


def test_counts_are_non_match_rows_per_cell() -> None:
    counts = layer_rank_counts(TINY)
    assert counts.dtypes.eq("Int64").all()
    assert counts.loc["layer 1", "r3 pp1 tp1"] == 2
    assert counts.loc["layer 0", "r1 pp0 tp1"] == 1
    assert counts.loc["embed", "r0 pp0 tp0"] == 0
    assert pd.isna(counts.loc["embed", "r3 pp1 tp1"])
    assert counts.isna().equals(layer_rank_grid(TINY).isna())


def test_layer_and_block_columns_are_used_when_present() -> None:
    v = TINY.assign(layer=pd.array([pd.NA, 4, pd.NA, 4, 5, pd.NA, 5, 5, pd.NA], dtype="Int64"))
    v["block"] = pd.array(["embed", "mlp", "embed", "mlp", "mlp", "head", "mlp", "attn", "head"], dtype="string")
    assert list(layer_rank_grid(v).index) == ["embed", "layer 4", "layer 5", "head"]


def test_a_rank_wide_row_fills_its_column() -> None:
    v = pd.concat([TINY, verdicts([(4, 2, 0, None, "unreachable")])], ignore_index=True)
    grid = layer_rank_grid(v)
    assert list(grid["r4 pp2 tp0"]) == ["unreachable"] * 4
    assert list(layer_rank_grid(TINY).index) == list(grid.index)
    assert status_counts_text(v) == "5 ranks, 10 verdicts: 1 corrupted on 1 rank, 2 unwritten on 2 ranks, 1 missing on 1 rank, 1 unreachable on 1 rank, 5 match"


def test_unknown_status_is_named() -> None:
    with pytest.raises(TableError, match=r"has the status 'bogus', which no check gives; every row needs one of corrupted"):
        layer_rank_grid(verdicts([(0, 0, 0, EMBED, "bogus")]))
    with pytest.raises(TableError, match="no 'status' column"):
        layer_rank_grid(TINY.drop(columns="status"))


def test_empty_frame() -> None:
    empty = TINY.iloc[:0]
    assert layer_rank_grid(empty).shape == (0, 0)
    assert layer_rank_text(empty) == "no verdicts"
    assert status_counts_text(empty) == "0 verdicts: nothing to check"
    assert plot_layer_rank(empty).axes[0].texts[0].get_text() == "no verdicts"


# what a float32 [16] parameter reads after wcviz's reset: every byte 0xA5 (the check proves coverage by it)
POISONED = fill_digest("nemo-rl-v3", "float32", [16], 64, 0xA5)


def _phase(phase: str, digests: dict[tuple[int, str], str]) -> pd.DataFrame:
    return make_frame(
        {"name": n, "digest": d, "algo": "nemo-rl-v3", "rank": r, "pp": 0, "tp": r, "phase": phase, "nbytes": 64,
         "dtype": "float32", "shape": "[16]"}
        for (r, n), d in digests.items()
    )


def test_endstate_verdicts_from_classify() -> None:
    names = [EMBED, _layer(0), _layer(1), NORM, HEAD]
    keys = [(r, n) for r in (0, 1) for n in names]
    snap = {k: f"{i:032x}" for i, k in enumerate(keys)}
    reset = {k: POISONED for k in keys}
    reload = dict(snap)
    reload[(1, _layer(1))] = reset[(1, _layer(1))]  # never written
    reload[(0, _layer(0))] = "f" * 32  # a third value
    del reload[(1, HEAD)]
    v = classify(_phase("snapshot", snap), _phase("reset", reset), _phase("reload", reload))
    expected = _grid(
        {
            "embed": ["match", "match"],
            "layer 0": ["corrupted", "match"],
            "layer 1": ["match", "unwritten"],
            "norm": ["match", "match"],
            "head": ["match", "missing"],
        },
        ["r0 pp0 tp0", "r1 pp0 tp1"],
    )
    pd.testing.assert_frame_equal(layer_rank_grid(v), expected)
    assert layer_rank_text(v) == lines(
        "rank     0 1",
        "pp       0 0",
        "tp       0 1",
        "embed    . .",
        "layer 0  C .",
        "layer 1  . U",
        "norm     . .",
        "head     . x",
        "legend: C corrupted  U unwritten  x missing  . match",
        "C corrupted  1 on 1 rank: r0 pp0 tp0",
        "U unwritten  1 on 1 rank: r1 pp0 tp1",
        "x missing    1 on 1 rank: r1 pp0 tp1",
        ". match      7 on 2 ranks",
    )


def test_endstate_verdicts_with_an_unreachable_rank() -> None:
    names = [EMBED, _layer(0), HEAD]
    keys = [(r, n) for r in (0, 1) for n in names]
    snap = {k: f"{i:032x}" for i, k in enumerate(keys)}
    phases = [_phase(p, d) for p, d in (("snapshot", snap), ("reset", {k: POISONED for k in keys}), ("reload", snap))]
    dead = [{"rank": 1, "pp": 0, "tp": 1}, {"rank": 2, "pp": 0, "tp": 2}]  # rank 2 never answered at all
    v = classify(*phases, unreachable=dead)
    grid = layer_rank_grid(v)
    assert list(grid.columns) == ["r0 pp0 tp0", "r1 pp0 tp1", "r2 pp0 tp2"]
    assert list(grid.index) == ["embed", "layer 0", "head"]
    assert list(grid["r0 pp0 tp0"]) == ["match"] * 3
    assert list(grid["r1 pp0 tp1"]) == list(grid["r2 pp0 tp2"]) == ["unreachable"] * 3
    assert "? unreachable  4 on 2 ranks: r1 pp0 tp1, r2 pp0 tp2" in layer_rank_text(v).splitlines()


# --------------------------------------------------------------------------- text


def test_text_of_a_tiny_frame() -> None:
    assert layer_rank_text(TINY) == lines(
        "rank     0 1 2 3",
        "pp       0 0 1 1",
        "tp       0 1 0 1",
        "embed    . . - -",
        "layer 0  . U - -",
        "layer 1  - - x C",
        "head     - - . .",
        "legend: C corrupted  U unwritten  x missing  . match  - not held",
        "C corrupted  1 on 1 rank: r3 pp1 tp1",
        "U unwritten  2 on 2 ranks: r1 pp0 tp1, r3 pp1 tp1",
        "x missing    1 on 1 rank: r2 pp1 tp0",
        ". match      5 on 4 ranks",
    )
    assert status_counts_text(TINY) == "4 ranks, 9 verdicts: 1 corrupted on 1 rank, 2 unwritten on 2 ranks, 1 missing on 1 rank, 5 match"


def test_text_without_rank_coordinates() -> None:
    v = verdicts([(EMBED, "match"), (_layer(0), "mismatch"), (_layer(0, "mlp.up_proj.weight"), "drift")], coords=())
    assert layer_rank_text(v) == lines(
        "rank     all",
        "embed    .",
        "layer 0  M",
        "legend: M mismatch  . match",
        "M mismatch  1",
        "D drift     1",
        ". match     1",
    )
    assert status_counts_text(v) == "3 verdicts: 1 mismatch, 1 drift, 1 match"


def _cluster(n_ranks: int, n_layers: int, tp: int = 16) -> pd.DataFrame:
    rows = [(r, r // tp, r % tp, _layer(layer), "match") for r in range(n_ranks) for layer in range(n_layers)]
    return verdicts(rows)


def test_many_ranks_fit_a_terminal() -> None:
    v = _cluster(45, 3)
    v.loc[(v["rank"] == 37) & (v["name"] == _layer(1)), "status"] = "unwritten"
    lines = layer_rank_text(v).splitlines()
    assert max(map(len, lines)) <= 100
    assert lines[0].strip() == " ".join(["1"] * 10 + ["2"] * 10 + ["3"] * 10 + ["4"] * 5)  # tens above units
    assert lines[1].startswith("rank     0 1 2 3 4 5 6 7 8 9 0 1")
    assert lines[3] == (" " * 9 + " ".join("1" if r % 16 >= 10 else " " for r in range(45))).rstrip()  # tp's tens
    assert lines[4].startswith("tp       0 1 2")
    assert lines[6] == "layer 1  " + " ".join("U" if r == 37 else "." for r in range(45))
    assert lines[-1] == ". match      134 on 45 ranks"


def test_max_ranks_keeps_the_ranks_with_findings() -> None:
    v = _cluster(64, 2)
    v.loc[(v["rank"] == 50) & (v["name"] == _layer(0)), "status"] = "corrupted"
    v.loc[(v["rank"] == 60) & (v["name"] == _layer(1)), "status"] = "missing"
    lines = layer_rank_text(v, max_ranks=4).splitlines()
    assert lines[:7] == [
        "             5 6",
        "rank     0 1 0 0",
        "pp       0 0 3 3",
        "               1",
        "tp       0 1 2 2",  # the 1 of tp 12 (rank 60)
        "layer 0  . . C .",
        "layer 1  . . . x",
    ]
    assert "60 of 64 ranks not shown (all match)" in lines
    assert "C corrupted    1 on 1 rank: r50 pp3 tp2" in lines
    assert "63 of 64 ranks not shown (1 with findings)" in layer_rank_text(v, max_ranks=1).splitlines()
    assert layer_rank_text(v, max_ranks=64) == layer_rank_text(v)
    with pytest.raises(ValueError, match="max_ranks"):
        layer_rank_text(v, max_ranks=0)


# --------------------------------------------------------------------------- plots


def _legend(fig: object) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]  # type: ignore[attr-defined]


def test_heatmap_cells_ticks_legend_and_png(tmp_path: Path) -> None:
    fig = plot_layer_rank(TINY, title="tiny")
    ax = fig.axes[0]
    assert ax.images[0].get_array().shape == (4, 4)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["embed", "layer 0", "layer 1", "head"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["r0 pp0 tp0", "r1 pp0 tp1", "r2 pp1 tp0", "r3 pp1 tp1"]
    assert _legend(fig) == ["corrupted", "unwritten", "missing", "match", "not held"]
    assert sorted(t.get_text() for t in ax.texts) == ["1", "1", "2"]  # non-match rows per cell
    assert ax.get_title() == "tiny"
    out = tmp_path / "tiny.png"
    fig.savefig(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_heatmap_colours_are_fixed_per_status() -> None:
    from matplotlib.colors import to_hex

    fig = plot_layer_rank(verdicts([(0, 0, 0, EMBED, "unwritten"), (1, 0, 1, EMBED, "unreachable")]))
    patches = fig.axes[0].get_legend().get_patches()
    assert [to_hex(p.get_facecolor()) for p in patches] == [COLORS["unwritten"].lower(), COLORS["unreachable"].lower()]
    assert fig.axes[0].texts[0].get_color() != fig.axes[0].texts[1].get_color()  # ink reads on each colour


def test_heatmap_draws_on_a_given_axes() -> None:
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot()
    assert plot_layer_rank(TINY, ax=ax) is fig
    assert ax.images[0].get_array().shape == (4, 4)


def test_heatmap_of_64_ranks_and_80_layers(tmp_path: Path) -> None:
    v = pd.concat([_cluster(64, 80), verdicts([(r, r // 16, r % 16, EMBED, "match") for r in range(64)])], ignore_index=True)
    v.loc[v["rank"] == 37, "status"] = "unwritten"
    fig = plot_layer_rank(v)
    ax = fig.axes[0]
    assert ax.images[0].get_array().shape == (81, 64)
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert rows[0] == "embed" and 10 < len(rows) < 81  # thinned, parts that are not layers always named
    layers = [int(r.split()[1]) for r in rows[1:]]
    step = layers[1] - layers[0]
    assert step > 1 and all(n % step == 0 for n in layers)
    assert len(ax.get_xticklabels()) <= 64
    assert not ax.texts  # too many cells to annotate
    assert _legend(fig) == ["unwritten", "match"]
    fig.savefig(tmp_path / "big.png", dpi=50)
    assert (tmp_path / "big.png").read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------- package


def test_public_names() -> None:
    assert set(wcviz.views.__all__) == {
        "COLORS", "MARKS", "NOT_HELD", "NOT_HELD_COLOR", "NO_RANKS", "SEVERITY",
        "layer_rank_counts", "layer_rank_grid", "layer_rank_text", "plot_layer_rank", "status_counts_text",
        "DRILLDOWN_COLORS", "DRILLDOWN_KINDS", "NotAWcvizFrame", "WcAccessor", "cost_text", "drilldown_text",
        "plot_cost", "plot_predicted_cost", "plot_drilldown", "plot_topology", "style_verdicts", "topology_text",
    }


def test_import_is_cheap_and_plots_leave_pyplot_alone() -> None:
    code = (
        "import sys, wcviz.views as v\n"
        "print(sorted(m for m in ('matplotlib', 'torch', 'wcviz.sources', 'wcviz.agent') if m in sys.modules))\n"
        "import pandas as pd\n"
        "v.plot_layer_rank(pd.DataFrame({'rank': [0], 'name': ['lm_head.weight'], 'status': ['match']}))\n"
        "print('matplotlib' in sys.modules, 'matplotlib.pyplot' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["[]", "True False"]


def test_computation_never_imports_views() -> None:
    root = Path(wcviz.views.__file__).resolve().parents[1]
    computing = ["digest", "frame.py", "verdicts.py", "endstate.py", "sources", "refit", "agent.py", "sim", "layouts", "compare.py"]
    for part in computing:
        for path in [root / part] if part.endswith(".py") else sorted((root / part).rglob("*.py")):
            if path.is_file():
                assert "wcviz.views" not in path.read_text(), path
