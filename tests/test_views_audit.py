"""Views of verdict frames, as an audit found them wanting: ranks known only by URL, whole-rank rows counted as
parameters, filters hiding findings, short ``keep`` masks, drill-downs deaf to the verdicts, rank coordinates
that are not integers, and cost plots that drop rows or cut their title."""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

import wcviz.views.cost  # noqa: E402
from wcviz._errors import TableError  # noqa: E402
from wcviz.digest._fill import fill_digest  # noqa: E402
from wcviz.endstate import classify  # noqa: E402
from wcviz.frame import make_frame  # noqa: E402
from test_views import _layer, verdicts  # noqa: E402
from wcviz.views import (  # noqa: E402
    COLORS,
    cost_text,
    drilldown_text,
    layer_rank_counts,
    layer_rank_grid,
    layer_rank_text,
    plot_cost,
    plot_drilldown,
    plot_layer_rank,
    plot_predicted_cost,
    plot_topology,
    status_counts_text,
    style_verdicts,
    topology_text,
)

ROOT = Path(__file__).resolve().parents[1]
EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
POISONED = fill_digest("nemo-rl-v3", "float32", [16], 64, 0xA5)
NODE_A, NODE_B = "http://node-a:8001", "http://node-b:8001"




def _phase(phase: str, digests: dict[tuple[int, str], str]) -> pd.DataFrame:
    return make_frame(
        {"name": n, "digest": d, "algo": "nemo-rl-v3", "rank": r, "pp": 0, "tp": r, "phase": phase,
         "nbytes": 64, "dtype": "float32", "shape": "[16]"}
        for (r, n), d in digests.items()
    )  # fmt: skip


def _endstate(names: list[str], reload: dict[tuple[int, str], str] | None = None, **ranks: list[dict]) -> pd.DataFrame:
    """classify() of two healthy ranks (0, 1) holding ``names``, with ``unreachable``/``empty`` ranks as given."""
    keys = [(r, n) for r in (0, 1) for n in names]
    snap = {k: f"{i:032x}" for i, k in enumerate(keys)}
    return classify(_phase("snapshot", snap), _phase("reset", {k: POISONED for k in keys}),
                    _phase("reload", {**snap, **(reload or {})}), **ranks)  # type: ignore[arg-type]


def _url_ranks() -> pd.DataFrame:
    return _endstate([EMBED, _layer(0), HEAD], unreachable=[{"rank": None, "url": NODE_A}, {"rank": None, "url": NODE_B}])


def _gid(items: list, gid: str) -> list:
    return [i for i in items if i.get_gid() == gid]


# --------------------------------------------------------------------------- 1: ranks known only by their URL


def test_ranks_known_only_by_url_are_columns_of_their_own_named_by_url() -> None:
    v = _url_ranks()
    grid = layer_rank_grid(v)
    assert list(grid.columns) == [NODE_A, NODE_B, "r0 pp0 tp0", "r1 pp0 tp1"]  # was one "(no rank)" column
    assert list(grid[NODE_A]) == list(grid[NODE_B]) == ["unreachable"] * 3
    text = layer_rank_text(v).splitlines()
    assert text[3] == "url      0 1"
    assert f"url 0 {NODE_A}; url 1 {NODE_B}" in text
    assert f"? unreachable  2 on 2 ranks: {NODE_A}, {NODE_B}" in text
    assert status_counts_text(v).startswith("4 ranks, 8 verdicts: 2 unreachable on 2 ranks")
    ticks = [t.get_text() for t in plot_layer_rank(v).axes[0].get_xticklabels()]
    assert ticks[:2] == [f"{NODE_A} (no answer)", f"{NODE_B} (no answer)"]


def test_the_topology_never_draws_a_rank_without_coordinates_on_rank_0() -> None:
    v = _url_ranks()
    text = topology_text(v).splitlines()
    assert text[0] == "topology: 4 ranks (2 unplaced), pp 1 × tp 2, hosts not reported"
    assert text[3].split() == ["pp0", "r0", ".", "r1", "."]  # was "r?+2 ? no answer": r0 drawn as unreachable
    assert text[4:7] == ["unplaced (no rank coordinates)", f"  {NODE_A} ? no answer", f"  {NODE_B} ? no answer"]
    ax = plot_topology(v).axes[0]
    cells = [t.get_text() for t in _gid(ax.texts, "cell")]
    assert cells == ["r0", "r1", "no answer", "no answer"]
    colors = [to_hex(p.get_facecolor()) for p in _gid(ax.patches, "cell")]
    assert colors == [COLORS["match"].lower()] * 2 + [COLORS["unreachable"].lower()] * 2
    assert {NODE_A, NODE_B} <= {t.get_text() for t in _gid(ax.texts, "row")}
    assert "unplaced" in {t.get_text() for t in _gid(ax.texts, "host")}


def test_a_rank_missing_a_layout_coordinate_is_unplaced_not_put_at_0() -> None:
    v = verdicts([(0, 0, 0, EMBED, "match"), (1, 0, 1, EMBED, "match"), (5, None, None, EMBED, "unwritten")])
    text = topology_text(v).splitlines()
    assert text[3].split() == ["pp0", "r0", ".", "r1", "."]  # was "r0+1 U1": rank 5 on top of rank 0
    assert text[4:6] == ["unplaced (no rank coordinates)", "  r5  U1"]


def test_the_styled_table_shows_the_url_of_a_rank_known_only_by_it() -> None:
    v = _url_ranks()
    data = style_verdicts(v).data
    assert "url" in data.columns and set(data["url"].dropna()) == {NODE_A, NODE_B}
    assert "url" not in style_verdicts(v[v["url"].isna()]).data.columns  # nothing to show: not shown


# --------------------------------------------------------------------------- 2: a whole-rank row is no parameter


def test_a_rank_that_did_not_answer_is_drawn_in_every_part_but_counted_in_none() -> None:
    names = [EMBED, _layer(0), _layer(1), HEAD]
    v = _endstate(names, reload={(1, _layer(0)): POISONED},
                  unreachable=[{"rank": 2, "pp": 0, "tp": 2}], empty=[{"rank": 3, "pp": 0, "tp": 3}])
    counts = layer_rank_counts(v)
    assert int(counts.sum().sum()) == 1  # the one unwritten parameter; was 9: each whole-rank row once per part
    assert list(counts["r2 pp0 tp2"]) == list(counts["r3 pp0 tp3"]) == [0] * 4
    assert list(layer_rank_grid(v)["r2 pp0 tp2"]) == ["unreachable"] * 4  # still drawn: the colour says it
    ax = plot_layer_rank(v).axes[0]
    assert [t.get_text() for t in ax.texts] == ["1"]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks[2:] == ["r2 pp0 tp2 (no answer)", "r3 pp0 tp3 (empty)"]


# --------------------------------------------------------------------------- 3, 4: filters and keep masks


def test_ranks_left_out_of_the_text_keep_their_findings_under_a_filter() -> None:
    v = verdicts([(0, 0, 0, _layer(0), "corrupted"), (1, 0, 1, _layer(0), "unwritten"), (2, 0, 2, _layer(0), "match")])
    keep = (v["status"] != "unwritten").to_numpy()
    assert "2 of 3 ranks not shown (1 with findings)" in layer_rank_text(v, max_ranks=1, keep=keep).splitlines()


@pytest.mark.parametrize("n", [2, 4])
def test_a_keep_mask_of_the_wrong_length_is_named_by_every_view(n: int) -> None:
    v = verdicts([(0, 0, 0, _layer(0), "match"), (1, 0, 1, _layer(0), "unwritten"), (2, 0, 2, _layer(0), "match")])
    want = rf"keep needs one flag per verdict row \(3\), got {n}"
    with pytest.raises(ValueError, match=want):
        plot_layer_rank(v, keep=[True] * n)  # a short one was an IndexError
    with pytest.raises(ValueError, match=want):
        layer_rank_text(v, keep=[True] * n)


# --------------------------------------------------------------------------- 5: the drill-down draws what the verdicts say


def test_the_endstate_drilldown_draws_missing_unexpected_and_unreachable_as_the_verdicts_say() -> None:
    n = _layer(0)

    def phase(p: str, d: dict[int, str]) -> pd.DataFrame:
        return _phase(p, {(r, n): x for r, x in d.items()})

    frames = {"snapshot": phase("snapshot", {0: "11" * 16, 1: "22" * 16, 3: "44" * 16}),
              "reset": phase("reset", {0: POISONED, 1: POISONED, 3: POISONED}),
              "reload": phase("reload", {0: "11" * 16, 2: "33" * 16})}  # fmt: skip
    v = verdicts([(0, 0, 0, n, "match"), (1, 0, 1, n, "missing"), (2, 0, 2, n, "unexpected"), (3, 0, 3, n, "unreachable")])
    v = pd.concat([v, pd.DataFrame({"status": ["unreachable"], "url": [NODE_A]})], ignore_index=True)  # never answered
    text = drilldown_text(frames, n, verdicts=v).splitlines()
    assert text[3].endswith("- x") and text[4].endswith("33333333 +") and text[5].endswith("- !")  # were "-", "?", "-"
    assert text[-1] == f"not in the digests: 1 rank unreachable ({NODE_A})"
    ax = plot_drilldown(frames, n, verdicts=v).axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"expected, but absent (missing)", "not expected (unexpected)", "the rank did not answer (unreachable)"} <= set(legend)
    assert "no snapshot digest to compare with" not in legend
    assert ax.xaxis.label.get_text() == f"not in the digests: 1 rank unreachable ({NODE_A})"
    # without verdicts the digests alone judge: a reload nobody snapshotted has nothing to compare with
    assert drilldown_text(frames, n).splitlines()[4].endswith("33333333 ?")


# --------------------------------------------------------------------------- 6: rank coordinates that are not integers


@pytest.mark.parametrize(("values", "shown"), [(["gpu-a", "gpu-b"], "'gpu-a'"), ([0.5, 1.5], "0.5"), ([0, -1], "-1")])
def test_rank_coordinates_that_are_not_integers_are_named(values: list, shown: str) -> None:
    v = pd.DataFrame({"rank": values, "name": [_layer(0)] * 2, "status": ["match", "unwritten"]})
    for view in (layer_rank_grid, topology_text, status_counts_text, plot_layer_rank):
        with pytest.raises(TableError, match=rf"column 'rank' holds {re.escape(shown)} in row \d"):
            view(v)


# --------------------------------------------------------------------------- 7, 8: cost plots and their docs


def _titles_inside(fig: object) -> bool:
    FigureCanvasAgg(fig)  # type: ignore[arg-type]
    fig.canvas.draw()  # type: ignore[attr-defined]  # the layout placed, as a saved image has it
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    ax = fig.axes[0]  # type: ignore[attr-defined]
    boxes = [t.get_window_extent(renderer) for t in (ax.title, ax._left_title, ax._right_title) if t.get_text()]
    return bool(boxes) and all(b.x0 >= 0 and b.x1 <= fig.bbox.width for b in boxes)  # type: ignore[attr-defined]


def test_the_cost_title_fits_the_figure() -> None:
    c = pd.DataFrame({"model": ["llama-tiny"] * 2, "backend": ["torch", "numba"], "device": "cpu",
                      "params": [30, 30], "nbytes": [249_200] * 2, "seconds": [0.08, 0.002]})  # fmt: skip
    assert _titles_inside(plot_cost(c))


def test_every_row_of_one_model_and_backend_is_drawn_and_named() -> None:
    dup = pd.DataFrame({"model": ["m"] * 4, "backend": ["numba", "numba", "torch", "torch"], "device": "cpu",
                        "nbytes": [2000, 4000, 2000, 4000], "seconds": [1.0, 1.0, 10.0, 10.0],
                        "dtype": ["bf16", "fp32", "bf16", "fp32"]})  # fmt: skip
    ax = plot_cost(dup).axes[0]
    assert sorted(p.get_height() for p in ax.patches) == pytest.approx([2e-7, 4e-7, 2e-6, 4e-6])  # was 2 bars
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["numba (bf16)", "numba (fp32)", "torch (bf16)", "torch (fp32)"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["m\n2.0 kB–4.0 kB"]  # was the first row's size alone
    assert cost_text(dup).splitlines()[0].split()[:4] == ["model", "backend", "device", "dtype"]
    same = dup.drop(columns="dtype").assign(nbytes=2000)  # nothing tells them apart: numbered
    labels = [t.get_text() for t in plot_cost(same).axes[0].get_legend().get_texts()]
    assert labels == ["numba #1", "numba #2", "torch #1", "torch #2"]


def test_a_model_named_by_a_number_is_drawn() -> None:
    num = pd.DataFrame({"model": [1, 2], "backend": ["numba"] * 2, "device": ["cpu"] * 2, "params": [1, 1],
                        "nbytes": [10, 20], "predicted_s": [1.0, 2.0], "measured_s": [np.nan, 1.5]})  # fmt: skip
    ax = plot_predicted_cost(num).axes[0]  # was ValueError: 1 is not in list
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1\n10 B", "2\n20 B"]
    assert len(ax.patches) == 2


def test_the_cost_docstring_shows_what_cost_text_prints() -> None:
    block = re.search(r"::\n\n((?:    .*\n)+)", wcviz.views.cost.__doc__ or "")
    assert block
    lines = [line[4:] for line in block.group(1).splitlines()]
    rows = [line.split() for line in lines[1:]]
    frame = pd.DataFrame({
        "model": [r[0] for r in rows], "backend": [r[1] for r in rows], "device": [r[2] for r in rows],
        "params": [int(r[3]) for r in rows],
        "nbytes": [round(float(r[4]) * {"kB": 1e3, "MB": 1e6}[r[5]]) for r in rows],  # 249.2 kB: the size shown
        "seconds": [float(r[6]) for r in rows],
    })  # fmt: skip
    assert cost_text(frame).splitlines() == lines


def test_notebook_04_saved_cost_table_has_no_rate_of_zero() -> None:
    nb = json.loads((ROOT / "notebooks" / "04_checksum_cost.ipynb").read_text(encoding="utf-8"))
    texts = ["".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    tables = [t for t in texts if t.lstrip().startswith("model") and "GB/s" in t.splitlines()[0]]
    assert tables, "notebook 04 shows no saved cost table"
    for table in tables:
        rates = [line.split()[-1] for line in table.strip().splitlines()[1:]]
        assert rates and all(float(r) > 0 for r in rates if r != "-"), table  # was 0.00: a slow backend read as free


@pytest.mark.parametrize("seconds", [0, float("nan"), -1.0, float("inf")])
def test_a_cost_row_of_no_time_is_refused_not_drawn_as_an_infinite_bar(seconds: float) -> None:
    cost = pd.DataFrame({"model": ["m"], "backend": ["numba"], "nbytes": [100], "seconds": [seconds]})
    for view in (cost_text, plot_cost):
        with pytest.raises(TableError, match=r"cost row 0 \(m, numba\): seconds must be a finite number > 0"):
            view(cost)
