"""More views: topology, per-parameter drill-down, checksum cost, styled tables, the ``df.wc`` accessor."""

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
from wcviz.verdicts import compare, differences
from wcviz.views import (
    COLORS,
    DRILLDOWN_COLORS,
    NotAWcvizFrame,
    cost_text,
    drilldown_text,
    layer_rank_counts,
    layer_rank_text,
    plot_cost,
    plot_drilldown,
    plot_layer_rank,
    plot_topology,
    style_verdicts,
    topology_text,
)

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
NORM = "model.norm.weight"


def _layer(n: int, leaf: str = "mlp.down_proj.weight") -> str:
    return f"model.layers.{n}.{leaf}"


def verdicts(rows: list[tuple], coords: tuple[str, ...] = ("rank", "pp", "tp"), extra: tuple[str, ...] = ()) -> pd.DataFrame:
    """A verdict frame from (*coordinates, name, status, *extra) tuples; other identity columns are NA."""
    df = pd.DataFrame(rows, columns=[*coords, "name", "status", *extra])
    for c in ("rank", "dp", "pp", "tp", "ep"):
        df[c] = df[c].astype("Int64") if c in df else pd.Series(pd.NA, index=df.index, dtype="Int64")
    df["status"] = df["status"].astype("string")
    return df[["rank", "dp", "pp", "tp", "ep", "name", "status", *extra]]


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


def _gid(items: list, gid: str) -> list:
    return [i for i in items if i.get_gid() == gid]


def _legend(fig: object) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]  # type: ignore[attr-defined]


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# what a float32 [16] parameter reads after wcviz's reset: every byte 0xA5 (the check proves coverage by it)
POISONED = fill_digest("nemo-rl-v3", "float32", [16], 64, 0xA5)


def _phase(phase: str, digests: dict[tuple[int, str], str]) -> pd.DataFrame:
    return make_frame(
        {"name": n, "digest": d, "algo": "nemo-rl-v3", "rank": r, "pp": 0, "tp": r, "phase": phase, "nbytes": 64,
         "dtype": "float32", "shape": "[16]"}
        for (r, n), d in digests.items()
    )


def _endstate() -> tuple[dict[str, pd.DataFrame], pd.DataFrame]:
    """Two ranks: r0's layer 0 reloads a third value, r1's layer 1 keeps the poison, r1 loses the head."""
    names = [EMBED, _layer(0), _layer(1), HEAD]
    keys = [(r, n) for r in (0, 1) for n in names]
    snap = {k: f"{i + 1:08x}" + "0" * 24 for i, k in enumerate(keys)}
    reset = {k: POISONED for k in keys}
    reload = dict(snap)
    reload[(1, _layer(1))] = reset[(1, _layer(1))]
    reload[(0, _layer(0))] = "f" * 32
    del reload[(1, HEAD)]
    frames = {p: _phase(p, d) for p, d in (("snapshot", snap), ("reset", reset), ("reload", reload))}
    return frames, classify(frames["snapshot"], frames["reset"], frames["reload"])


# --------------------------------------------------------------------------- topology


def test_topology_text_of_a_tiny_frame() -> None:
    assert topology_text(TINY) == lines(
        "topology: 4 ranks, pp 2 × tp 2, hosts not reported",
        "host unknown",
        "      tp0   tp1",
        "  pp0 r0 .  r1 U1",
        "  pp1 r2 x1 r3 C2",
        "legend: C corrupted  U unwritten  x missing  . match",
    )


def test_topology_groups_by_host_and_marks_the_trainer() -> None:
    rows = [(r, r // 4, (r // 2) % 2, r % 2, EMBED, "unwritten" if r == 5 else "match", f"node-{r // 4}", "engine") for r in range(8)]
    rows.append((0, None, None, None, EMBED, "match", "node-1", "trainer"))  # the trainer shares node-1
    v = verdicts(rows, coords=("rank", "dp", "pp", "tp"), extra=("host", "role"))
    assert topology_text(v) == lines(
        "topology: 8 ranks, dp 2 × pp 2 × tp 2, on 2 hosts",
        "host node-0",
        "          tp0   tp1",
        "  dp0 pp0 r0 .  r1 .",
        "  dp0 pp1 r2 .  r3 .",
        "host node-1 (trainer on this host)",
        "  dp1 pp0 r4 .  r5 U1",
        "  dp1 pp1 r6 .  r7 .",
        "legend: U unwritten  . match",
        "trainer on 1 host: node-1; colocated with the engine on node-1",
        "not shown: trainer rows: 1 match",
    )
    fig = plot_topology(v)
    ax = fig.axes[0]
    assert len(_gid(ax.patches, "cell")) == 8  # the trainer's row is not an engine rank
    hosts = _gid(ax.patches, "host")
    assert len(hosts) == 2 and [h.get_linestyle() for h in hosts] == ["-", "--"]
    assert [t.get_text() for t in _gid(ax.texts, "host")] == ["node-0", "node-1\n+ trainer"]
    assert _legend(fig) == ["unwritten", "match", "trainer on this host", "number under a rank:\nits parameters not match"]


def test_topology_reads_role_actual_and_hosts_of_other_trainers() -> None:
    v = verdicts(
        [(0, 0, 0, EMBED, "match", "gpu-a", "engine"), (1, 0, 1, EMBED, "match", "gpu-a", "engine"),
         (0, None, None, EMBED, "match", "gpu-b", "trainer")],
        extra=("host", "role_actual"),
    )
    text = topology_text(v).splitlines()
    assert text[1] == "host gpu-a"
    assert text[-2:] == ["trainer on 1 host: gpu-b; none shared with the engine", "not shown: trainer rows: 1 match"]
    assert "trainer on this host" not in _legend(plot_topology(v))


def test_topology_without_coordinates_or_tp() -> None:
    ranks_only = verdicts([(r, EMBED, "missing" if r == 2 else "match") for r in (2, 0, 1)], coords=("rank",))
    assert topology_text(ranks_only) == lines(
        "topology: 3 ranks, hosts not reported",
        "host unknown",
        "        #0    #1    #2",
        "  ranks r0 .  r1 .  r2 x1",
        "legend: x missing  . match",
    )
    nothing = verdicts([(EMBED, "match"), (HEAD, "unwritten")], coords=())
    assert topology_text(nothing).splitlines()[0] == "topology: no rank coordinates, hosts not reported"
    assert topology_text(nothing).splitlines()[3] == "  ranks all U1"
    assert topology_text(TINY.iloc[:0]) == "no verdicts"
    assert plot_topology(TINY.iloc[:0]).axes[0].texts[0].get_text() == "no verdicts"


def test_topology_of_both_verdict_kinds() -> None:
    _, v = _endstate()
    assert topology_text(v) == lines(
        "topology: 2 ranks, pp 1 × tp 2, hosts not reported",
        "host unknown",
        "      tp0   tp1",
        "  pp0 r0 C1 r1 U2",
        "legend: C corrupted  U unwritten",
    )
    expected = make_frame([{"name": EMBED, "digest": "1" * 32, "algo": "nemo-rl-v3", "role": "trainer"}])
    actual = make_frame(
        {"name": EMBED, "digest": "1" * 32 if r else "2" * 32, "algo": "nemo-rl-v3", "role": "engine", "rank": r, "tp": r, "host": "h0"}
        for r in range(2)
    )
    assert topology_text(compare(expected, actual)).splitlines()[1:4] == ["host h0", "        tp0   tp1", "  ranks r0 M1 r1 ."]


def test_topology_figure_cells_texts_and_png(tmp_path: Path) -> None:
    fig = plot_topology(TINY, title="tiny")
    ax = fig.axes[0]
    cells = _gid(ax.patches, "cell")
    assert len(cells) == 4
    assert sorted(t.get_text() for t in _gid(ax.texts, "cell")) == ["r0", "r1\n1", "r2\n1", "r3\n2"]
    assert [t.get_text() for t in _gid(ax.texts, "row")] == ["pp0", "pp1"]
    assert [t.get_text() for t in _gid(ax.texts, "column")] == ["tp0", "tp1"]  # one host: no host column to fill
    assert not _gid(ax.texts, "host")
    assert _legend(fig) == ["corrupted", "unwritten", "missing", "match", "number under a rank:\nits parameters not match"]
    from matplotlib.colors import to_hex

    assert sorted(to_hex(c.get_facecolor()) for c in cells) == sorted(
        COLORS[s].lower() for s in ("match", "unwritten", "missing", "corrupted")
    )
    assert ax.get_title(loc="left") == "tiny"  # from the left edge, never cut off
    fig.savefig(tmp_path / "topology.png")
    assert _is_png(tmp_path / "topology.png")


def test_topology_of_8_dp_4_pp_8_tp_stays_readable() -> None:
    rows = [
        (dp * 32 + pp * 8 + tp, dp, pp, tp, EMBED, "unwritten" if (dp, pp, tp) == (2, 1, 5) else "match", f"node-{dp * 4 + pp}")
        for dp in range(8) for pp in range(4) for tp in range(8)
    ]
    v = verdicts(rows, coords=("rank", "dp", "pp", "tp"), extra=("host",))
    text = topology_text(v).splitlines()
    assert text[0] == "topology: 256 ranks, dp 8 × pp 4 × tp 8, on 32 hosts"
    assert max(map(len, text)) <= 100
    assert "  dp2 pp1 r72 .  r73 .  r74 .  r75 .  r76 .  r77 U1 r78 .  r79 ." in text
    assert sum(line.startswith("          tp0") for line in text) == 1  # one column header: columns never change
    fig = plot_topology(v)
    ax = fig.axes[0]
    assert len(_gid(ax.patches, "cell")) == 256 and len(_gid(ax.patches, "host")) == 32
    assert len(_gid(ax.texts, "host")) == 32
    width, height = fig.get_size_inches()
    assert width <= 22 and height <= 16
    assert min(t.get_fontsize() for t in ax.texts) >= 5.5


def test_topology_draws_on_a_given_axes() -> None:
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot()
    assert plot_topology(TINY, ax=ax) is fig
    assert len(_gid(ax.patches, "cell")) == 4


def test_topology_refuses_a_frame_without_status() -> None:
    with pytest.raises(TableError, match="no 'status' column"):
        topology_text(TINY.drop(columns="status"))
    with pytest.raises(TableError, match="expected a verdict DataFrame, got list"):
        plot_topology([1, 2])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- drill-down


def test_drilldown_text_per_case() -> None:
    frames, _ = _endstate()
    assert drilldown_text(frames, _layer(0)) == lines(
        "model.layers.0.mlp.down_proj.weight (nemo-rl-v3)",
        "rank        snapshot    reset       reload",
        f"r0 pp0 tp0  00000002 .  {POISONED[:8]} r  ffffffff C",
        f"r1 pp0 tp1  00000006 .  {POISONED[:8]} r  00000006 .",
        "legend: . same as snapshot  r the reset pattern (as the reset should leave it)  C a third value (corrupted)",
    )
    assert drilldown_text(frames, HEAD).splitlines()[2:] == [
        f"r0 pp0 tp0  00000004 .  {POISONED[:8]} r  00000004 .",
        f"r1 pp0 tp1  00000008 .  {POISONED[:8]} r  -",
        "legend: . same as snapshot  r the reset pattern (as the reset should leave it)  - absent",
    ]


def test_drilldown_reads_one_long_frame_and_orders_phases() -> None:
    frames, _ = _endstate()
    shuffled = {p: frames[p] for p in ("reload", "reset", "snapshot")}
    long = pd.concat([f.assign(phase=p) for p, f in shuffled.items()], ignore_index=True)
    assert drilldown_text(long, _layer(1)) == drilldown_text(frames, _layer(1))
    extra = {"sent": frames["snapshot"], **frames}
    assert drilldown_text(extra, EMBED).splitlines()[1].split() == ["rank", "snapshot", "reset", "reload", "sent"]


def test_drilldown_colours_per_case(tmp_path: Path) -> None:
    from matplotlib.colors import to_hex

    frames, _ = _endstate()
    fig = plot_drilldown(frames, _layer(1))
    ax = fig.axes[0]
    image = ax.images[0]
    assert image.get_array().shape == (2, 3)
    rgba = image.to_rgba(image.get_array())
    colours = [[to_hex(rgba[i, j]) for j in range(3)] for i in range(2)]
    match, unwritten = DRILLDOWN_COLORS["match"].lower(), DRILLDOWN_COLORS["unwritten"].lower()
    reset = DRILLDOWN_COLORS["reset"].lower()  # neutral: the reset column holds what a reset leaves
    assert colours == [
        [match, reset, match],  # r0: reloaded
        [match, reset, unwritten],  # r1: never written (the one alarming cell)
    ]
    corrupted = plot_drilldown(frames, _layer(0)).axes[0].images[0]
    assert to_hex(corrupted.to_rgba(corrupted.get_array())[0, 2]) == COLORS["corrupted"].lower()
    assert DRILLDOWN_COLORS["unwritten"] == COLORS["unwritten"] and DRILLDOWN_COLORS["match"] == COLORS["match"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["snapshot", "reset", "reload"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["r0 pp0 tp0", "r1 pp0 tp1"]
    assert [t.get_text() for t in ax.texts] == ["00000003", POISONED[:8], "00000003", "00000007", POISONED[:8], POISONED[:8]]
    assert _legend(fig) == ["same as snapshot", "the reset pattern (as the reset should leave it)", "equal to the reset (unwritten)"]
    fig.savefig(tmp_path / "drill.png")
    assert _is_png(tmp_path / "drill.png")


def test_drilldown_bad_inputs_are_named() -> None:
    frames, _ = _endstate()
    with pytest.raises(ValueError, match=r"no parameter 'model\.layers\.0\.mlp\.down_proj\.wieght'.*did you mean 'model\.layers\.0\.mlp\.down_proj\.weight'"):
        drilldown_text(frames, _layer(0, "mlp.down_proj.wieght"))
    with pytest.raises(ValueError, match="no parameter 'zzz'.*hold 4 parameters, e.g. 'lm_head.weight'"):
        plot_drilldown(frames, "zzz")
    with pytest.raises(TableError, match="needs a 'phase' column"):
        drilldown_text(frames["snapshot"].drop(columns="phase"), EMBED)
    with pytest.raises(TableError, match="phase 'reset': not a digest frame: no 'digest' column"):
        drilldown_text({**frames, "reset": frames["reset"].drop(columns="digest")}, EMBED)
    twice = pd.concat([frames["snapshot"], frames["snapshot"]], ignore_index=True)
    with pytest.raises(TableError, match="share a .rank, phase., first r0 pp0 tp0 in phase 'snapshot'"):
        drilldown_text(twice, EMBED)


# --------------------------------------------------------------------------- cost


COST = pd.DataFrame({
    "model": ["llama-tiny", "llama-tiny", "llama-small", "llama-small"],
    "backend": ["torch", "numba", "torch", "numba"],
    "device": "cpu",
    "params": [30, 30, 57, 57],
    "numel": [124_608, 124_608, 9_997_568, 9_997_568],
    "nbytes": [249_216, 249_216, 19_995_136, 19_995_136],
    "seconds": [0.08, 0.002, 1.0, 0.07],
})
COST["gbps"] = COST["nbytes"] / COST["seconds"] / 1e9


def test_cost_text() -> None:
    assert cost_text(COST) == lines(
        "model        backend  device  tensors      size  seconds     GB/s",
        "llama-tiny   torch    cpu          30  249.2 kB   0.0800  0.00312",
        "llama-tiny   numba    cpu          30  249.2 kB   0.0020    0.125",
        "llama-small  torch    cpu          57   20.0 MB   1.0000   0.0200",
        "llama-small  numba    cpu          57   20.0 MB   0.0700    0.286",
    )
    assert cost_text(COST.iloc[:0]) == "no measurements"


def test_cost_plot_bars_labels_legend(tmp_path: Path) -> None:
    fig = plot_cost(COST)
    ax = fig.axes[0]
    assert len(ax.patches) == 4
    heights = sorted(round(p.get_height(), 6) for p in ax.patches)
    assert heights == sorted(round(g, 6) for g in COST["gbps"])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["llama-tiny\n249.2 kB", "llama-small\n20.0 MB"]
    assert sorted(t.get_text() for t in ax.texts) == ["1 s", "2 ms", "70 ms", "80 ms"]
    assert _legend(fig) == ["torch", "numba"]
    assert ax.get_ylabel() == "GB/s (log)" and ax.get_yscale() == "log"  # a slow backend never reads as zero
    fig.savefig(tmp_path / "cost.png")
    assert _is_png(tmp_path / "cost.png")


def test_cost_refuses_a_frame_without_its_columns() -> None:
    with pytest.raises(TableError, match="not a cost frame: no 'seconds' column"):
        cost_text(COST.drop(columns="seconds"))


def test_checksum_cost_on_a_tiny_model() -> None:
    from wcviz.bench import COST_COLUMNS, checksum_cost

    cost = checksum_cost(["llama-tiny"], repeat=1)
    assert tuple(cost.columns) == COST_COLUMNS
    assert list(cost["backend"]) == ["torch", "numba"] and set(cost["model"]) == {"llama-tiny"}
    assert (cost["seconds"] > 0).all() and (cost["gbps"] > 0).all()
    assert cost["nbytes"].nunique() == 1 and cost["params"].nunique() == 1 and cost["numel"].nunique() == 1
    assert cost["nbytes"].iloc[0] == 2 * cost["numel"].iloc[0]  # bfloat16
    assert cost_text(cost).splitlines()[1].startswith("llama-tiny  torch    cpu          30  249.2 kB")


def test_model_zoo_sizes() -> None:
    import math

    from wcviz.bench import MODELS
    from wcviz.sim.model import parameter_shapes

    assert set(MODELS) >= {"llama-tiny", "llama-small", "moe-tiny"}
    nbytes = {k: sum(math.prod(s) for s in parameter_shapes(cfg).values()) * 2 for k, cfg in MODELS.items()}
    assert 19e6 <= nbytes["llama-small"] <= 50e6
    assert MODELS["moe-tiny"].experts > 0


def test_checksum_cost_names_bad_inputs() -> None:
    from wcviz.bench import checksum_cost

    with pytest.raises(ValueError, match="unknown model 'gpt-9'; choose from llama-tiny"):
        checksum_cost(["gpt-9"])
    with pytest.raises(ValueError, match="unknown digest backend 'cuda'; choose from auto, torch, numba"):
        checksum_cost(["llama-tiny"], backends=("torch", "cuda"))
    with pytest.raises(ValueError, match="repeat must be an int >= 1, got 0"):
        checksum_cost(["llama-tiny"], repeat=0)


# --------------------------------------------------------------------------- styled table


def test_styled_html_is_stable_and_coloured() -> None:
    _, v = _endstate()
    html = style_verdicts(v).to_html()
    assert html == style_verdicts(v.copy()).to_html()
    assert 'id="T_wcviz-verdicts"' in html and 'class="wcviz-verdicts"' in html
    for status in ("corrupted", "unwritten", "missing", "match"):
        assert f"background-color: {COLORS[status]}" in html
    assert ">ffffffff<" in html and "f" * 32 not in html  # digests shortened
    custom = style_verdicts(v, uuid="run-7", columns=["rank", "name", "status"])
    assert 'id="T_run-7"' in custom.to_html()
    assert list(custom.data.columns) == ["rank", "name", "status"]
    assert list(style_verdicts(TINY).data.columns) == ["rank", "pp", "tp", "name", "status"]  # NA coordinates left out


def test_styled_refuses_bad_frames() -> None:
    with pytest.raises(TableError, match="no 'status' column"):
        style_verdicts(TINY.drop(columns="status"))
    with pytest.raises(TableError, match="no column 'bogus' in the verdicts"):
        style_verdicts(TINY, columns=["name", "bogus"])


# --------------------------------------------------------------------------- accessor


def test_accessor_forwards_to_the_plain_functions() -> None:
    _, v = _endstate()
    pd.testing.assert_frame_equal(v.wc.mismatches(), differences(v))
    pd.testing.assert_frame_equal(v.wc.counts(), layer_rank_counts(v))
    assert v.wc.text() == layer_rank_text(v)
    assert v.wc.topology_text() == topology_text(v)
    assert v.wc.style().to_html() == style_verdicts(v).to_html()
    assert v.wc.style(uuid="x").to_html() == style_verdicts(v, uuid="x").to_html()
    fig = v.wc.plot_layers(title="t")
    assert fig.axes[0].get_title() == "t" and fig.axes[0].images[0].get_array().shape == plot_layer_rank(v).axes[0].images[0].get_array().shape
    assert len(_gid(v.wc.plot_topology().axes[0].patches, "cell")) == 2


def test_accessor_refuses_a_frame_without_the_columns() -> None:
    frame = pd.DataFrame({"name": [EMBED], "status": ["match"]})
    with pytest.raises(NotAWcvizFrame, match=r"verdict frame \(missing rank, dp, pp, tp, ep\) or a digest frame \(missing digest, algo\)"):
        frame.wc  # noqa: B018
    assert not hasattr(frame, "wc")  # an AttributeError, as pandas' own accessors raise
    assert issubclass(NotAWcvizFrame, TableError)
    frames, _ = _endstate()
    assert frames["snapshot"].wc.kind == "digests"
    assert TINY.wc.kind == "verdicts"


# --------------------------------------------------------------------------- package


def test_public_names() -> None:
    assert {
        "plot_topology", "topology_text", "plot_drilldown", "drilldown_text", "plot_cost", "cost_text",
        "style_verdicts", "WcAccessor", "NotAWcvizFrame", "DRILLDOWN_COLORS", "DRILLDOWN_KINDS",
    } <= set(wcviz.views.__all__)
    assert all(hasattr(wcviz.views, n) for n in wcviz.views.__all__)


def test_import_stays_cheap_and_registers_the_accessor() -> None:
    code = (
        "import sys, pandas as pd, wcviz.views\n"
        "heavy = ('matplotlib', 'torch', 'jinja2', 'wcviz.bench', 'wcviz.sim', 'wcviz.sources', 'wcviz.agent')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "v = pd.DataFrame({'rank': [0], 'dp': [0], 'pp': [0], 'tp': [0], 'ep': [None], 'name': ['lm_head.weight'], 'status': ['match']})\n"
        "print(v.wc.topology_text().splitlines()[-1])\n"
        "v.wc.plot_topology()\n"
        "print('matplotlib' in sys.modules, 'matplotlib.pyplot' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["[]", "legend: . match", "True False"]


def test_zoo_matches_published_parameter_counts() -> None:
    import math

    from wcviz.bench import ZOO
    from wcviz.sim.model import parameter_shapes

    counts = {n: sum(math.prod(s) for s in parameter_shapes(c).values()) for n, c in ZOO.items() if n != "sim-tiny"}
    assert counts == {"llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496,
                      "qwen2.5-7b": 7_615_616_512, "mixtral-8x7b": 46_702_792_704}


def test_predicted_cost_from_given_rates_and_measured_where_small() -> None:
    from wcviz.bench import PREDICTED_COLUMNS, predicted_cost, predicted_text

    rates = pd.DataFrame({"backend": ["numba"], "device": ["cpu"], "gbps": [2.0], "overhead_s": [1e-4]})
    cost = predicted_cost(["llama-3-8b", "sim-tiny"], rates)
    assert tuple(cost.columns) == PREDICTED_COLUMNS
    big = cost[cost["model"] == "llama-3-8b"].iloc[0]
    assert big["nbytes"] == 2 * 8_030_261_248 and big["params"] == 291
    assert big["predicted_s"] == pytest.approx(2 * 8_030_261_248 / 2e9 + 291 * 1e-4)
    assert pd.isna(big["measured_s"])  # 16 GB is never built here
    assert cost[cost["model"] == "sim-tiny"]["measured_s"].iloc[0] > 0
    text = predicted_text(cost)
    assert "llama-3-8b     numba   cpu        291   16.1 GB" in text and "predicted = bytes / measured GB/s" in text
    assert "GPU: not measured on a GPU yet" in text
    with pytest.raises(ValueError, match="unknown model 'gpt-5'"):
        predicted_cost(["gpt-5"], rates)
    with pytest.raises(ValueError, match="rates lack column"):
        predicted_cost(["sim-tiny"], rates.drop(columns="gbps"))


def test_cli_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from wcviz.cli import main as cli

    assert cli(["bench", "--models", "sim-tiny", "--backends", "numba", "--big-mib", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("measured: numba ") and "sim-tiny       numba   cpu         30" in out


def _runs_file(tmp_path: Path) -> Path:
    import json

    path = tmp_path / "gpu_runs.json"
    path.write_text(json.dumps({"runs": [
        {"date": "2026-11-30", "device": "NVIDIA H200", "backend": "triton", "gbps": 500.0, "overhead_s": 2e-5},
        {"date": "2026-12-01", "device": "NVIDIA H200", "backend": "triton", "gbps": 1200.0, "overhead_s": 1e-5},
    ]}))
    return path


def test_recorded_gpu_rates_are_labelled_and_never_measured_here(tmp_path: Path) -> None:
    from wcviz.bench import RATE_COLUMNS, predicted_cost, predicted_text, recorded_rates

    gpu = recorded_rates(_runs_file(tmp_path))
    assert tuple(gpu.columns) == RATE_COLUMNS and len(gpu) == 1  # the latest run per device and backend
    assert gpu.iloc[0]["gbps"] == 1200.0 and gpu.iloc[0]["rate_source"] == "recorded 2026-12-01 on NVIDIA H200"
    cpu = pd.DataFrame({"backend": ["numba"], "device": ["cpu"], "gbps": [2.0], "overhead_s": [1e-4], "rate_source": ["measured here"]})
    cost = predicted_cost(["sim-tiny", "llama-3-70b"], pd.concat([cpu, gpu], ignore_index=True))
    on_gpu = cost[cost["device"] == "cuda"]
    assert len(on_gpu) == 2 and on_gpu["measured_s"].isna().all()  # no GPU here: predicted only
    assert on_gpu[on_gpu["model"] == "llama-3-70b"]["predicted_s"].iloc[0] == pytest.approx(141_107_412_992 / 1.2e12 + 723 * 1e-5)
    assert cost[(cost["device"] == "cpu") & (cost["model"] == "sim-tiny")]["measured_s"].iloc[0] > 0
    text = predicted_text(cost)
    assert "triton on cuda: 1200.00 GB/s, 0.010 ms per tensor, recorded 2026-12-01 on NVIDIA H200" in text
    assert "not measured on a GPU yet" not in text


def test_every_recorded_gpu_figure_carries_its_own_date_and_device(tmp_path: Path) -> None:
    """Two recorded GPUs (as ``benchmarks/gpu.py --record`` appends them): each row and each rate line says which run
    its figure comes from; the two ``triton cuda`` rows no longer look alike and neither rate line is dropped."""
    import json

    from wcviz.bench import predicted_cost, predicted_text, recorded_rates

    runs = tmp_path / "gpu_runs.json"
    runs.write_text(json.dumps({"runs": [
        {"date": "2026-11-29", "device": "NVIDIA H100 80GB HBM3", "backend": "triton", "gbps": 900.0, "overhead_s": 2e-5},
        {"date": "2026-12-01", "device": "NVIDIA H200", "backend": "triton", "gbps": 1400.0, "overhead_s": 1e-5},
    ]}))
    cpu = pd.DataFrame({"backend": ["numba"], "device": ["cpu"], "gbps": [3.0], "overhead_s": [3e-6], "rate_source": ["measured here"]})
    text = predicted_text(predicted_cost(["llama-3-8b"], pd.concat([cpu, recorded_rates(runs)], ignore_index=True)))
    rows = [line for line in text.splitlines() if line.startswith("llama-3-8b ")]
    assert [line.split("-  ")[-1] for line in rows] == [
        "measured here", "recorded 2026-11-29 on NVIDIA H100 80GB HBM3", "recorded 2026-12-01 on NVIDIA H200"]
    assert rows[1].startswith("llama-3-8b     triton  cuda       291   16.1 GB       0.0237")
    assert rows[2].startswith("llama-3-8b     triton  cuda       291   16.1 GB       0.0144")
    assert "  triton on cuda: 900.00 GB/s, 0.020 ms per tensor, recorded 2026-11-29 on NVIDIA H100 80GB HBM3" in text
    assert "  triton on cuda: 1400.00 GB/s, 0.010 ms per tensor, recorded 2026-12-01 on NVIDIA H200" in text


def test_recorded_rates_file_errors_name_the_file(tmp_path: Path) -> None:
    from wcviz.bench import GPU_RUNS, recorded_rates

    bad = tmp_path / "runs.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"runs.json: not a recorded-runs file"):
        recorded_rates(bad)
    bad.write_text('{"runs": [{"date": "2026-12-01", "device": "H200"}]}')
    with pytest.raises(ValueError, match=r"run 0 lacks backend, gbps, overhead_s"):
        recorded_rates(bad)
    assert GPU_RUNS.exists()  # shipped with the package, and readable
    assert set(recorded_rates()["device"]) <= {"cuda"}


def test_plot_predicted_cost_bars_dots_and_recorded_labels(tmp_path: Path) -> None:
    from matplotlib.figure import Figure

    from wcviz._errors import TableError
    from wcviz.bench import predicted_cost, recorded_rates
    from wcviz.views import plot_predicted_cost

    cpu = pd.DataFrame({"backend": ["torch", "numba"], "device": ["cpu", "cpu"], "gbps": [0.1, 3.0],
                        "overhead_s": [1e-3, 1e-4], "rate_source": ["measured here"] * 2})
    cost = predicted_cost(["sim-tiny", "llama-3-8b"], pd.concat([cpu, recorded_rates(_runs_file(tmp_path))], ignore_index=True))
    fig = plot_predicted_cost(cost)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    labels = ax.get_legend_handles_labels()[1]
    assert sorted(labels) == ["measured", "numba on cpu", "torch on cpu", "triton on cuda (recorded 2026-12-01 on NVIDIA H200)"]
    assert len(ax.patches) == 2 * 3  # a bar per model per series
    dots = [c for c in ax.collections if len(c.get_offsets())]
    assert sum(len(c.get_offsets()) for c in dots) == 2  # sim-tiny measured with torch and numba; nothing else
    fig.savefig(tmp_path / "cost.png")
    with pytest.raises(TableError, match="not a predicted-cost frame: no 'predicted_s'"):
        plot_predicted_cost(cost.drop(columns="predicted_s"))


def test_bench_measures_every_algorithm_and_the_cli_start_up() -> None:
    """What `wcviz bench` prints beside the backends: a rate per digest algorithm (the engines' too) and the CLI's
    start-up against `import torch` alone; measured, never asserted as a speed."""
    from wcviz.bench import algorithm_rates, cli_startup
    from wcviz.digest import ALGORITHMS

    rates = algorithm_rates(big_mib=1, repeat=1)
    assert list(rates["algo"]) == list(ALGORITHMS) and (rates["gbps"] > 0).all()
    start = cli_startup(repeat=1)
    assert set(start) == {"wcviz digest", "import torch"} and all(v > 0 for v in start.values())


# --------------------------------------------------------------------------- nothing hidden, nothing looks like a match


def test_topology_says_what_the_trainer_ranks_it_does_not_draw_hold() -> None:
    v = verdicts(
        [(0, 0, 0, _layer(0), "match", "engine"), (0, 0, 0, _layer(1), "match", "engine"),
         (1, 0, 1, _layer(0), "match", "trainer"), (1, 0, 1, _layer(1), "mismatch", "trainer")],
        extra=("role_actual",),
    )
    text = topology_text(v)
    assert text.splitlines()[-1] == "not shown: trainer rows: 1 mismatch on 1 rank (rank 1 (pp=0 tp=1)), 1 match"
    ax = plot_topology(v).axes[0]
    (note,) = _gid(ax.texts, "note")
    assert "1 mismatch on 1 rank (rank 1 (pp=0 tp=1))" in note.get_text().replace("\n", " ")
    assert note.get_color() == "#B2182B"  # a finding: the alarm colour, not a grey footnote


def test_topology_names_a_rank_that_did_not_answer_instead_of_counting_it() -> None:
    rows = [(r, 0, r, _layer(i), "match") for r in (0, 1) for i in range(3)]
    rows += [(2, 0, 2, None, "unreachable"), (3, 0, 3, None, "empty")]
    v = verdicts(rows)
    assert topology_text(v).splitlines()[3] == "  pp0 r0 .           r1 .           r2 ? no answer r3 0 empty"
    texts = [t.get_text() for t in _gid(plot_topology(v).axes[0].texts, "cell")]
    assert texts == ["r0", "r1", "r2\nno answer", "r3\nempty"]  # was "r2\n1": a rank counted as one parameter


def _hatched(ax: object, gid: str) -> set[tuple[int, int]]:
    """(row, column) of the cells a hatch collection of ``gid`` covers."""
    out = set()
    for coll in _gid(ax.collections, gid):  # type: ignore[attr-defined]
        for path in coll.get_paths():
            (x0, y0), (x1, y1) = path.vertices.min(axis=0), path.vertices.max(axis=0)
            out.add((round((y0 + y1) / 2), round((x0 + x1) / 2)))
    return out


def test_a_partly_filtered_cell_hiding_a_finding_is_not_drawn_as_a_match() -> None:
    v = verdicts([
        (0, 0, 0, _layer(0, "q.weight"), "unwritten"), (0, 0, 0, _layer(0, "k.weight"), "match"),
        (1, 0, 1, _layer(0, "q.weight"), "match"), (1, 0, 1, _layer(0, "k.weight"), "match"),
    ])
    keep = v["name"].str.contains("k.weight", regex=False).to_numpy()
    ax = plot_layer_rank(v, keep=keep).axes[0]
    assert _hatched(ax, "filtered_problem") == {(0, 0)}  # r0's unwritten q is filtered out: marked in the alarm colour
    assert _hatched(ax, "filtered") == {(0, 1)}  # r1's filtered q matches: marked as partly filtered only
    assert ax.get_title().endswith("(filtered)")
    assert "filtered out here:\nrows not match" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert not _hatched(plot_layer_rank(v).axes[0], "filtered_problem")


def test_every_finding_stays_visible_among_thousands_of_ranks() -> None:
    import numpy as np

    rows = [(r, r // 8, r % 8, _layer(i), "unwritten" if (r, i) == (1001, 1) else "match") for r in range(1536) for i in range(3)]
    v = verdicts(rows, coords=("rank", "dp", "tp"))
    ax = plot_layer_rank(v).axes[0]
    (marks,) = _gid(ax.collections, "nonmatch")
    assert np.asarray(marks.get_offsets()).tolist() == [[1001.0, 1.0]]  # column, row of the one finding
    assert marks.get_sizes()[0] >= 9  # points², whatever the width of a cell
    assert ax.get_xlim() == (-0.5, 1535.5)


def _two_ranks(name: str, digests: list[str]) -> pd.DataFrame:
    """One phase's digest frame: ``name`` on ranks 0 and 1 (tp 0 and 1)."""
    ids = {c: pd.array([0, 1], dtype="Int64") for c in ("rank", "tp")}
    return pd.DataFrame({**ids, "name": [name, name], "digest": digests})


def test_drilldown_marks_a_reset_that_changed_nothing_unproven() -> None:
    n = _layer(1)
    frames = {"snapshot": _two_ranks(n, ["aaaaaaaa11", "bbbbbbbb22"]), "reset": _two_ranks(n, ["aaaaaaaa11", "a5a5a5a5ff"]),
              "reload": _two_ranks(n, ["aaaaaaaa11", "bbbbbbbb22"])}  # fmt: skip
    assert drilldown_text(frames, n).splitlines()[2] == "r0 tp0  aaaaaaaa .  aaaaaaaa ~  aaaaaaaa ~"
    ax = plot_drilldown(frames, n).axes[0]
    im = ax.images[0]
    from matplotlib.colors import to_hex

    colours = [[to_hex(im.cmap(im.norm(c))) for c in row] for row in im.get_array()]
    assert colours[0][1] != COLORS["match"].lower() and colours[0][2] != COLORS["match"].lower()
    assert colours[0][1] == DRILLDOWN_COLORS["unproven"].lower()
    assert colours[1] == [COLORS["match"].lower(), DRILLDOWN_COLORS["reset"].lower(), COLORS["match"].lower()]
    assert any("unproven" in t.get_text() for t in ax.get_legend().get_texts())


def test_drilldown_wraps_a_long_name_in_its_title() -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    n = "model.language_model.decoder.transformer_blocks_with_a_really_long_module_path_name." * 2
    n += "layers.1.mlp.down_proj.weight"
    phases = {"snapshot": ["aa", "bb"], "reset": ["a5", "a5"], "reload": ["aa", "a5"]}
    fig = plot_drilldown({p: _two_ranks(n, ds).assign(algo="nemo-rl-v3") for p, ds in phases.items()}, n)
    ax = fig.axes[0]
    title = next(t for t in (ax.title, ax._left_title, ax._right_title) if t.get_text())
    assert title.get_text().replace("\n", "") == n + " (nemo-rl-v3)"  # every character, only broken into lines
    FigureCanvasAgg(fig).draw()
    box = title.get_window_extent(fig.canvas.get_renderer())
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width


def test_the_grid_plots_draw_on_axes_of_a_subfigure() -> None:
    """Axes on a SubFigure are supported (a dashboard lays views out that way); its size is the root figure's."""
    import torch
    from matplotlib.figure import Figure

    from wcviz.sources import from_named_tensors
    from wcviz.views import plot_layer_rank

    weights = {f"model.layers.{i}.mlp.weight": torch.full((4,), float(i)) for i in range(3)}
    expected = from_named_tensors(weights, role="engine", rank=0, backend="torch")
    weights["model.layers.1.mlp.weight"] += 1
    actual = from_named_tensors(weights, role="engine", rank=0, backend="torch")
    verdicts = compare(expected, actual)
    left, _ = Figure(figsize=(10, 4)).subfigures(1, 2)
    ax = left.add_subplot()
    fig = plot_layer_rank(verdicts, ax=ax)
    assert fig is not None and len(ax.images) == 1
