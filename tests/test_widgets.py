"""The dashboard (wcviz.widgets) driven without a browser: clicks, methods and value changes.

Agents run in this process on loopback over small dicts of tensors; one test drives a
real simulated cluster. Assertions are on the state the widgets hold after each click.
"""

from __future__ import annotations

import ast
import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import ipywidgets as widgets
import pandas as pd
import pytest
import torch

import wcviz
from wcviz.agent import Agent
from wcviz.endstate import poison_
from wcviz.sources import fetch, from_named_tensors
from wcviz.widgets import CLASSES, VIEWS, Dashboard

TOKEN = "s3cret"
PNG = b"\x89PNG\r\n\x1a\n"
NAMES = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(3)] + ["model.norm.weight"]


class Rank:
    """One rank's weights behind an agent: reset poisons, reload restores from a copy (minus ``skip``)."""

    def __init__(self, rank: int, *, mutations: bool = True) -> None:
        g = torch.Generator().manual_seed(rank)
        self.truth = {
            n: torch.randn(8, 8, generator=g) if "layers" in n else torch.randn(8, generator=g) for n in NAMES
        }
        self.params = {n: t.clone() for n, t in self.truth.items()}
        self.skip: str | None = None
        self.agent = Agent(
            lambda: self.params, role="engine", rank=rank, pp=0, tp=rank,
            token=TOKEN if mutations else None, allow_mutations=mutations,
            snapshot=lambda: {"params": len(self.params)}, reset=lambda: poison_(self.params), reload=self.reload,
        )  # fmt: skip

    def reload(self) -> dict:
        for n, t in self.truth.items():
            if self.skip is None or self.skip not in n:
                self.params[n].copy_(t)
        return {"written": len(self.params)}

    def intact(self) -> bool:
        return all(torch.equal(self.params[n], self.truth[n]) for n in NAMES)


def _start(ranks: list[Rank]) -> Iterator[list[Rank]]:
    for r in ranks:
        r.agent.start()
    yield ranks
    for r in ranks:
        r.agent.stop()


@pytest.fixture
def ranks() -> Iterator[list[Rank]]:
    yield from _start([Rank(0), Rank(1)])


@pytest.fixture
def readonly() -> Iterator[list[Rank]]:
    yield from _start([Rank(0, mutations=False), Rank(1, mutations=False)])


def _urls(ranks: list[Rank]) -> dict[str, dict]:
    return {r.agent.url: {"role": "engine", "rank": r.agent.rank, "pp": 0, "tp": r.agent.rank} for r in ranks}


def _classes(w: widgets.Widget) -> set[str]:
    return set(w._dom_classes)


def _find(root: widgets.Widget, css: str) -> list[widgets.Widget]:
    """Every widget under ``root`` (itself included) with CSS class ``css``."""
    found = [root] if css in _classes(root) else []
    for child in getattr(root, "children", ()):
        found += _find(child, css)
    return found


def _shown(dash: Dashboard) -> widgets.Widget:
    """The view itself: the last child of the view area (a note or a stale banner may stand above it)."""
    *_, child = dash.view_area.children
    return child


def _check(dash: Dashboard) -> None:
    dash.buttons["snapshot"].click()
    dash.reset(confirm=True)
    dash.buttons["reload"].click()
    dash.buttons["compare"].click()


# --------------------------------------------------------------------------- agents


def test_every_part_has_its_css_class(ranks: list[Rank]) -> None:
    dash = Dashboard(_urls(ranks), token=TOKEN)
    assert _classes(dash.widget) == {"wcviz-dashboard"} and isinstance(dash.widget, widgets.VBox)
    for key, css in CLASSES.items():
        if key in ("dashboard", "heatmap", "topology", "drilldown", "table", "stale", "note"):
            continue  # the view area holds one view at a time (a note, a stale banner only when there is one)
        assert len(_find(dash.widget, css)) == 1, css
    assert dash.buttons["reset"] is _find(dash.widget, "wcviz-reset")[0]
    assert _find(dash.widget, "wcviz-reset-yes")[0].description == "Yes, overwrite every weight"
    assert _find(dash.widget, "wcviz-reset-yes")[0].button_style == "danger"
    assert _find(dash.widget, "wcviz-reset-yes")[0].layout.width == "auto"  # the label is never cut off
    assert isinstance(dash.progress, widgets.IntProgress) and dash.progress.layout.display == "none"
    assert list(dash.view.options) == list(VIEWS)
    assert dash.status_text == "2 agents; nothing fetched yet"
    assert "wcviz-empty" in _classes(_shown(dash)) and dash.verdicts is None
    assert dash.error_text == "" and dash.errors.layout.display == "none"
    bundle = dash._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == dash.widget.model_id
    assert "static picture of the wcviz dashboard" in bundle["text/html"]  # where widgets do not run (GitHub, unrun)
    assert bundle["text/plain"].startswith("Dashboard(") and "VBox" not in bundle["text/plain"]


def test_the_flow_is_numbered_and_each_step_on_only_when_valid(ranks: list[Rank]) -> None:
    dash = Dashboard(_urls(ranks), token=TOKEN)
    b = dash.buttons
    assert [b[n].description for n in ("fetch", "snapshot", "reset", "reload", "compare")] == [
        "Fetch", "1 Snapshot", "2 Reset", "3 Reload", "4 Compare",
    ]  # fmt: skip

    def on() -> list[str]:
        return [n for n in ("fetch", "snapshot", "reset", "reload", "compare") if not b[n].disabled]

    def primary() -> list[str]:
        return [n for n in b if b[n].button_style in ("primary", "danger")]

    assert on() == ["fetch", "snapshot"] and primary() == ["snapshot"]
    assert b["reset"].tooltip.startswith("disabled: take the snapshot first")
    assert b["compare"].tooltip == "disabled: run 1 Snapshot, 2 Reset, 3 Reload first"
    with pytest.raises(RuntimeError, match="run 1 Snapshot, 2 Reset, 3 Reload first"):
        dash.compare()  # out of order from Python: refused, saying why, nothing run
    with pytest.raises(RuntimeError, match="reset first"):
        dash.reload()
    assert all(r.intact() for r in ranks)
    dash.snapshot()
    assert dash.error_text == ""  # a new check: the refused clicks before it are gone
    assert on() == ["fetch", "snapshot", "reset"] and primary() == ["reset"] and b["reset"].button_style == "danger"
    dash.reset(confirm=True)
    # a second reset: no; a snapshot of the poison: no; reload: yes
    assert on() == ["fetch", "reload"] and primary() == ["reload"]
    assert b["snapshot"].tooltip.startswith("disabled: reload first: the ranks hold the reset pattern")
    dash.reload()
    assert on() == ["fetch", "snapshot", "compare"] and primary() == ["compare"]
    dash.compare()
    assert on() == ["fetch", "snapshot", "compare"] and primary() == []  # all match: nothing to reload
    assert dash.error_text == "" and dash.status_text == "2 of 2 ranks answered; all 8 parameters match"


def test_fetch_button_fills_current(ranks: list[Rank]) -> None:
    dash = Dashboard([r.agent.url for r in ranks], token=TOKEN)
    dash.buttons["fetch"].click()
    assert dash.status_text == "fetch: 2 of 2 ranks answered; 8 parameters"
    assert len(dash.current) == 8 and dash.fetch_result.complete
    assert sorted(dash.current["rank"].unique().tolist()) == [0, 1]
    assert list(dash.role.options) == [("all", "all"), ("engine", "engine")]


def test_reset_asks_first_and_changes_nothing_until_confirmed(ranks: list[Rank]) -> None:
    dash = Dashboard(_urls(ranks), token=TOKEN)
    snap = dash.snapshot()
    assert dash.status_text == "snapshot done; 2 of 2 ranks answered; 8 parameters"
    assert not dash.confirm_open
    dash.buttons["reset"].click()
    assert dash.confirm_open and "overwrites every weight on 2 ranks" in dash.confirm_text.value
    assert dash.reset() is None and "reset" not in dash.frames
    assert all(r.intact() for r in ranks)
    now = fetch(_urls(ranks)).frame
    assert now["digest"].tolist() == snap["digest"].tolist()  # the agents' digests did not move
    dash.reset_cancel.click()
    assert not dash.confirm_open and all(r.intact() for r in ranks)
    assert dash.status_text == "snapshot done; 2 of 2 ranks answered; 8 parameters"

    seen: list[int] = []
    dash.progress.observe(lambda c: seen.append(c["new"]), names="value")
    dash.buttons["reset"].click()
    dash.reset_yes.click()
    assert not dash.confirm_open and seen == [0, 1, 2]  # acted, then fetched
    assert not any(torch.equal(r.params[n], r.truth[n]) for r in ranks for n in NAMES)
    assert dash.status_text == "reset done; 2 of 2 ranks answered; 8 parameters; 8 of 8 fully reset"
    assert not set(dash.frames["reset"]["digest"]) & set(snap["digest"])
    assert dash.progress.layout.display == "none"


def test_reload_and_compare_name_the_skipped_parameter(ranks: list[Rank]) -> None:
    ranks[1].skip = "layers.2."
    dash = Dashboard(_urls(ranks), token=TOKEN)
    _check(dash)
    v = dash.verdicts
    assert v["status"].value_counts().to_dict() == {"match": 7, "unwritten": 1}
    bad = v[v["status"] != "match"]
    assert [(int(r.rank), int(r.tp), r.name) for r in bad.itertuples()] == [
        (1, 1, "model.layers.2.mlp.down_proj.weight")
    ]
    assert dash.status_text == "2 of 2 ranks answered; 1 unwritten on 1 rank (rank 1 (pp0 tp1)); 7 match"
    assert dash.report is not None and not dash.report.ok and set(dash.frames) == {"snapshot", "reset", "reload"}
    assert "unwritten on 1 rank (rank 1 (pp=0 tp=1))" in dash.report.summary
    assert dash.error_text == ""
    assert "wcviz-heatmap" in _classes(_shown(dash)) and bytes(_shown(dash).value[:8]) == PNG
    assert list(dash.status.options) == [
        ("all", "all"),
        ("not match (1)", "not match"),
        ("unwritten (1)", "unwritten"),
        ("match (7)", "match"),
    ]
    # a weight still holds the reset pattern: Reload stays on; healed, the next check starts clean
    assert not dash.buttons["reload"].disabled
    ranks[1].skip = None
    dash.reload()
    _check(dash)
    assert dash.status_text == "2 of 2 ranks answered; all 8 parameters match" and dash.report.ok


def test_view_switching_filters_and_search(ranks: list[Rank]) -> None:
    ranks[0].skip = "norm"
    dash = Dashboard(_urls(ranks), token=TOKEN)
    _check(dash)
    dash.set_view("table")
    table = _shown(dash)
    assert isinstance(table, widgets.HTML) and "wcviz-table" in _classes(table)
    assert "8 of 8 verdicts" in table.value and 'id="T_wcviz-verdicts' in table.value
    dash.status.value = "unwritten"
    assert dash.table[["rank", "name"]].values.tolist() == [[0, "model.norm.weight"]]
    html = _shown(dash).value
    assert "1 of 8 verdicts" in html and "model.norm.weight" in html and "down_proj" not in html
    dash.status.value = "all"
    dash.search.value = r"layers\.[01]\."
    assert len(dash.table) == 4 and "4 of 8 verdicts" in _shown(dash).value
    dash.search.value = "layers.2"
    assert sorted(dash.table["rank"].tolist()) == [0, 1]
    for view, css in (
        ("topology", "wcviz-topology"),
        ("drill-down", "wcviz-drilldown"),
        ("layer × rank", "wcviz-heatmap"),
    ):
        dash.set_view(view)
        shown = _shown(dash)
        assert isinstance(shown, widgets.Image) and css in _classes(shown), view
        assert bytes(shown.value[:8]) == PNG
    dash.set_view("drill-down")
    dash.search.value = ""
    assert dash.drilldown_name == "model.norm.weight"  # the worst row when nothing is searched
    dash.search.value = "no-such-parameter"
    assert "wcviz-empty" in _classes(_shown(dash)) and dash.drilldown_name is None
    with pytest.raises(ValueError, match="unknown view 'pie'"):
        dash.set_view("pie")
    assert dash.error_text == ""


def test_wrong_token_fails_the_phases_never_as_success(ranks: list[Rank]) -> None:
    from wcviz.widgets import StepRefused

    dash = Dashboard(_urls(ranks), token="wrong")
    dash.buttons["snapshot"].click()  # refused by every rank: the check stops before any reset
    assert dash.status_text.startswith("snapshot FAILED: the snapshot was refused by 2 ranks")
    assert "#B2182B" in dash.status_line.value
    lines = dash.error_text.splitlines()
    assert all("HTTP 401" in line for line in lines) and "SnapshotUnusable" not in dash.error_text
    assert any(line.startswith("snapshot/snapshot: engine 0 (pp=0 tp=0) refused: HTTP 401: snapshot needs") for line in lines)
    assert dash.buttons["reset"].disabled and "the snapshot cannot be compared" in dash.buttons["reset"].tooltip
    assert dash.state.next_step == "snapshot" and dash.buttons["snapshot"].button_style == "primary"
    with pytest.raises(StepRefused, match="reset is disabled: the snapshot cannot be compared"):
        dash.reset(confirm=True)
    assert all(r.intact() for r in ranks)
    dash.clear_errors()
    assert dash.error_text == "" and dash.errors.layout.display == "none"


def test_reset_before_snapshot_is_an_error_not_a_reset(ranks: list[Rank]) -> None:
    dash = Dashboard(_urls(ranks), token=TOKEN)
    dash.buttons["reset"].click()
    assert not dash.confirm_open and all(r.intact() for r in ranks)
    assert dash.buttons["reset"].disabled  # a person cannot click it; a click that reaches it does nothing
    assert dash.error_text == "" and dash.status_text == "2 agents; nothing fetched yet"
    with pytest.raises(RuntimeError, match="reset is disabled: take the snapshot first"):
        dash.reset(confirm=True)  # from code it is refused, saying why: in the errors, the status line as it was
    assert (
        dash.error_text
        == "reset: reset is disabled: take the snapshot first (1 Snapshot): without it nothing can be compared"
    )
    assert dash.status_text == "2 agents; nothing fetched yet"


def test_readonly_agents_disable_the_mutations(readonly: list[Rank]) -> None:
    dash = Dashboard(_urls(readonly), token=TOKEN)
    for name in ("snapshot", "reset", "reload"):
        b = dash.buttons[name]
        assert b.disabled and "start its agent with allow_mutations=True" in b.tooltip, name
    assert not dash.buttons["fetch"].disabled and dash.buttons["compare"].disabled  # nothing to compare yet
    assert dash.status_text.startswith(
        "2 agents; nothing fetched yet; Snapshot, Reset and Reload are off: mutations are off on http://"
    )
    dash.buttons["reset"].click()  # a click that reaches a disabled button changes nothing
    assert not dash.confirm_open and all(r.intact() for r in readonly) and dash.error_text == ""
    with pytest.raises(PermissionError, match="reset is disabled: mutations are off on"):
        dash.reset()
    assert dash.error_text.startswith("reset: reset is disabled: mutations are off on")
    dash.fetch()
    assert dash.status_text == "fetch: 2 of 2 ranks answered; 8 parameters"


def test_no_token_disables_the_mutations(ranks: list[Rank]) -> None:
    dash = Dashboard([r.agent.url for r in ranks])
    assert dash.buttons["reset"].disabled and "no token given" in dash.buttons["reset"].tooltip
    with pytest.raises(PermissionError, match="no token given"):
        dash.reset(confirm=True)
    assert all(r.intact() for r in ranks)


def test_an_agent_that_died_shows_in_errors_and_verdicts(ranks: list[Rank]) -> None:
    dash = Dashboard(_urls(ranks), token=TOKEN, timeout_s=5, retries=0)
    dash.snapshot()
    ranks[1].agent.stop()
    dash.fetch()
    assert dash.status_text == "fetch: 1 of 2 ranks answered; 1 unreachable; 4 parameters"
    assert re.search(r"^fetch: engine 1 \(pp=0 tp=1\) unreachable: All connection attempts failed", dash.error_text, re.MULTILINE)
    assert "ConnectError" not in dash.error_text  # a person reads the message, not the exception's class
    dash.reset(confirm=True)
    assert (
        dash.status_text
        == "reset FAILED on 1 of 2 ranks; 1 of 2 ranks answered; 4 parameters; 4 of 4 fully reset"
    )
    dash.reload()
    dash.compare()
    v = dash.verdicts
    assert {int(k): set(g) for k, g in v.groupby("rank")["status"]} == {0: {"match"}, 1: {"unreachable"}}
    # its reset never reached it (connection refused), so its failed reload leaves nothing poisoned
    assert dash.status_text == (
        "1 of 2 ranks answered; 4 unreachable on 1 rank (rank 1 (pp0 tp1)); 4 match; 4 problems (see errors)"
    )
    assert "reload/reload: engine 1 (pp=0 tp=1) unreachable" in dash.error_text
    assert not len(dash.report.poisoned)


def test_works_inside_a_running_event_loop(ranks: list[Rank]) -> None:
    """A Jupyter kernel runs cells inside an event loop, where the blocking fetchers cannot run."""
    dash = Dashboard(_urls(ranks), token=TOKEN)

    async def cell() -> None:
        dash.fetch()
        _check(dash)

    asyncio.run(cell())
    assert dash.status_text == "2 of 2 ranks answered; all 8 parameters match" and dash.error_text == ""


# --------------------------------------------------------------------------- frames in memory


def _frame(tensors: dict[str, torch.Tensor], phase: str, **ident: int) -> pd.DataFrame:
    return from_named_tensors(tensors, role="engine", phase=phase, progress=False, **ident)


def _phases() -> dict[str, pd.DataFrame]:
    out: dict[str, list[pd.DataFrame]] = {"snapshot": [], "reset": [], "reload": []}
    for rank in (0, 1):
        r = Rank(rank)
        out["snapshot"].append(_frame(r.params, "snapshot", rank=rank, pp=0, tp=rank))
        poison_(r.params)
        out["reset"].append(_frame(r.params, "reset", rank=rank, pp=0, tp=rank))
        r.skip = "layers.1." if rank == 0 else None
        r.reload()
        out["reload"].append(_frame(r.params, "reload", rank=rank, pp=0, tp=rank))
    return {p: pd.concat(fs, ignore_index=True) for p, fs in out.items()}


def test_endstate_frames_in_memory() -> None:
    dash = Dashboard(_phases())
    for name in ("fetch", "snapshot", "reset", "reload"):
        b = dash.buttons[name]
        assert b.disabled and b.tooltip == "disabled: frames in memory: there are no agents to fetch from or act on", name
    assert not dash.buttons["compare"].disabled
    assert dash.status_text == "2 ranks; 1 unwritten on 1 rank (rank 0 (pp0 tp0)); 7 match"
    assert dash.report is not None and "unwritten on 1 rank (rank 0 (pp=0 tp=0))" in dash.report.summary
    dash.verdicts = None
    dash.buttons["compare"].click()
    assert dash.verdicts["status"].value_counts().to_dict() == {"match": 7, "unwritten": 1}
    assert bytes(_shown(dash).value[:8]) == PNG
    dash.buttons["fetch"].click()  # off: nothing happens
    assert dash.error_text == ""
    with pytest.raises(RuntimeError, match="fetch is disabled: frames in memory"):
        dash.fetch()
    assert dash.error_text == "fetch: fetch is disabled: frames in memory: there are no agents to fetch from or act on"
    with pytest.raises(RuntimeError, match="reset is disabled"):
        dash.reset(confirm=True)


def test_expected_actual_frames_and_role_filter() -> None:
    g = torch.Generator().manual_seed(7)
    weights = {n: torch.randn(4, generator=g) for n in NAMES}
    expected = from_named_tensors(weights, role="checkpoint", progress=False)
    bent = {**weights, NAMES[1]: weights[NAMES[1]] + 1}
    actual = pd.concat(
        [
            _frame(weights, "current", rank=0, pp=0, tp=0),
            _frame(bent, "current", rank=1, pp=0, tp=1).assign(role="trainer"),
        ],
        ignore_index=True,
    )
    dash = Dashboard({"expected": expected, "actual": actual})
    assert dash.status_text == "2 ranks; 1 mismatch on 1 rank (rank 1 (pp0 tp1)); 7 match"
    assert list(dash.role.options) == [("all", "all"), ("engine", "engine"), ("trainer", "trainer")]
    dash.set_view("table")
    dash.role.value = "engine"
    assert len(dash.table) == 4 and set(dash.table["status"]) == {"match"}
    dash.role.value = "trainer"
    dash.status.value = "mismatch"
    assert dash.table["name"].tolist() == [NAMES[1]]
    dash.set_view("drill-down")
    assert dash.drilldown_name == NAMES[1] and "wcviz-drilldown" in _classes(_shown(dash))
    assert "expected" in dash.view_text and "actual" in dash.view_text
    dash.set_view("topology")
    assert "wcviz-topology" in _classes(_shown(dash)) and dash.error_text == ""


def test_verdict_frame_in_memory() -> None:
    v = pd.DataFrame({
        "rank": pd.array([0, 0, 1, 1], dtype="Int64"), "dp": pd.array([pd.NA] * 4, dtype="Int64"),
        "pp": pd.array([0, 0, 0, 0], dtype="Int64"), "tp": pd.array([0, 0, 1, 1], dtype="Int64"),
        "ep": pd.array([pd.NA] * 4, dtype="Int64"), "name": pd.array([NAMES[0], NAMES[3]] * 2, dtype="string"),
        "status": pd.array(["match", "match", "corrupted", "match"], dtype="string"),
    })  # fmt: skip
    dash = Dashboard(v)
    assert dash.status_text == "2 ranks; 1 corrupted on 1 rank (rank 1 (pp0 tp1)); 3 match"
    assert "wcviz-heatmap" in _classes(_shown(dash))
    dash.set_view("table")
    dash.status.value = "not match"
    assert dash.table["name"].tolist() == [NAMES[0]] and int(dash.table["rank"].iloc[0]) == 1
    with pytest.raises(ValueError, match="no digest_<phase> columns"):
        dash.set_view("drill-down")  # a verdict frame without digests has nothing to drill into
    assert "the drill-down view failed: the drill-down needs digests" in _shown(dash).value
    assert dash.error_text == "view: the drill-down needs digests: this verdict frame has no digest_<phase> columns"
    assert dash.status_text == "2 ranks; 1 corrupted on 1 rank (rank 1 (pp0 tp1)); 3 match"  # the status stays the check's


def test_source_errors() -> None:
    with pytest.raises(TypeError, match="verdict frame"):
        Dashboard(pd.DataFrame({"name": ["a"]}))
    with pytest.raises(ValueError, match="snapshot, reset, reload or expected, actual"):
        Dashboard({"snapshot": pd.DataFrame()})
    with pytest.raises(TypeError, match="got int"):
        Dashboard(3)


def test_nothing_else_in_wcviz_imports_the_widgets() -> None:
    """ipywidgets stays optional: only the widget modules (view.py and its view area, _area.py) import it, and nothing
    outside wcviz/widgets imports them."""
    package = Path(wcviz.__file__).parent
    offenders = []
    for path in sorted(package.rglob("*.py")):
        inside = path.parent == package / "widgets"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            ipy = any(n.split(".")[0] == "ipywidgets" for n in names)
            ours = any(n.startswith("wcviz.widgets") for n in names)
            if (ipy and path.name not in ("view.py", "_area.py")) or (ours and not inside):
                offenders.append(f"{path.relative_to(package)}:{node.lineno}")
    assert offenders == []


def test_the_state_works_without_ipywidgets() -> None:
    """The dashboard's logic is plain Python: the state runs in a process where ipywidgets cannot be imported."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['ipywidgets'] = None\n"
        "import pandas as pd\n"
        "from wcviz.widgets.state import DashboardState\n"
        "v = pd.DataFrame({'rank': pd.array([0, 1], dtype='Int64'), 'tp': pd.array([0, 1], dtype='Int64'),\n"
        "                  'name': ['a.weight', 'a.weight'], 'status': ['match', 'unwritten']})\n"
        "s = DashboardState(v); s.status_filter = 'unwritten'\n"
        "print(s.status_text); print(s.table['rank'].tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["2 ranks; 1 unwritten on 1 rank (rank 1 (tp1)); 1 match", "[1]"]


# --------------------------------------------------------------------------- a real cluster


@pytest.mark.slow
def test_cluster_dashboard_finds_the_loader_fault() -> None:
    from wcviz.sim import TINY, Cluster, EngineLayout, LoaderFaults

    with Cluster(TINY, EngineLayout(tp=2, pp=1), allow_mutations=True, timeout_s=60) as cluster:
        cluster.set_faults({1: LoaderFaults(skip=r"mlp\.down_proj")})
        dash = Dashboard(cluster)
        assert dash.token == cluster.token and not dash.buttons["snapshot"].disabled and dash.buttons["reset"].disabled
        assert dash.status_text == "2 agents; nothing fetched yet"
        _check(dash)
        assert dash.error_text == ""
        assert dash.transport is not None and dash.transport.ok and dash.report.transport is dash.transport
        v = dash.verdicts
        bad = v[v["status"] != "match"]
        n = len(v)
        assert sorted(bad["name"]) == [f"model.layers.{i}.mlp.down_proj.weight" for i in range(TINY.layers)]
        assert set(bad["rank"]) == {1} and set(bad["status"]) == {"unwritten"}
        assert (
            dash.status_text
            == f"2 of 2 ranks answered; {len(bad)} unwritten on 1 rank (rank 1 (dp0 pp0 tp1)); {n - len(bad)} match"
        )
        dash.set_view("topology")
        assert "wcviz-topology" in _classes(_shown(dash)) and bytes(_shown(dash).value[:8]) == PNG
        # the cluster stops under the dashboard (a notebook's last cell): it notices, says so, turns everything off
        cluster.stop()
        assert dash.state.stopped is not None and "the cluster has stopped" in dash.status_text
        assert dash.status_text.startswith("STOPPED")
        assert all(b.disabled for b in dash.buttons.values() if b is not dash.buttons["compare"])
        assert dash.buttons["fetch"].disabled and "the cluster has stopped" in dash.buttons["fetch"].tooltip
        stale = _find(dash.widget, "wcviz-stale")
        assert len(stale) == 1 and "These are the last results" in stale[0].value
        with pytest.raises(RuntimeError, match="the cluster has stopped"):
            dash.fetch()


def test_filters_grey_the_heatmap_and_a_bad_regex_is_an_error(ranks: list[Rank]) -> None:
    ranks[1].skip = "layers.2."
    dash = Dashboard(_urls(ranks), token=TOKEN)
    _check(dash)
    everything = bytes(_shown(dash).value)
    dash.status.value = "unwritten"  # the heatmap view: the filter greys out every other cell
    filtered = bytes(_shown(dash).value)
    assert filtered[:8] == PNG and filtered != everything
    from wcviz.views.plots import FILTERED_COLOR

    fig = dash.figure
    assert fig is not None and "filtered out" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert FILTERED_COLOR.startswith("#")
    dash.status.value = "all"
    assert bytes(_shown(dash).value) == everything
    dash.search.value = "down_proj"
    assert dash.state.search == "down_proj" and bytes(_shown(dash).value) != everything
    dash.search.value = "layers.(2"  # not a regular expression: an error, and the filter stays what it was
    assert dash.state.search == "down_proj" and dash.search.value == "down_proj"
    assert "filter: the parameter filter 'layers.(2' is not a regular expression" in dash.error_text
    dash.set_view("topology")
    assert "do not apply here" in dash.view_area.children[0].value  # said, not silently ignored


def test_drilldown_chooses_among_the_filtered_parameters(ranks: list[Rank]) -> None:
    ranks[1].skip = "down_proj"
    dash = Dashboard(_urls(ranks), token=TOKEN)
    _check(dash)
    dash.status.value = "unwritten"
    dash.set_view("drill-down")
    assert dash.drill.layout.display != "none"
    labels = [label for label, _ in dash.drill.options]
    assert labels == [f"model.layers.{i}.mlp.down_proj.weight  ({i + 1} of 3)" for i in range(3)]
    first = bytes(_shown(dash).value)
    dash.drill.value = "model.layers.2.mlp.down_proj.weight"
    assert dash.drilldown_name == "model.layers.2.mlp.down_proj.weight" and bytes(_shown(dash).value) != first
    assert "model.layers.2.mlp.down_proj.weight" in dash.view_text
    dash.set_view("table")
    assert dash.drill.layout.display == "none"


def test_the_status_line_says_what_is_happening(ranks: list[Rank]) -> None:
    dash = Dashboard(_urls(ranks), token=TOKEN)
    seen: list[str] = []
    dash.status_line.observe(lambda change: seen.append(change["new"]), names="value")
    dash.snapshot()
    working = [s for s in seen if "wcviz-working" in s]
    assert any("snapshotting: every rank records its digests, then fetching the digests of 2 ranks" in s for s in working), seen
    assert any("snapshot done, fetching the digests of 2 ranks" in s for s in working), seen
    assert "snapshot done; 2 of 2 ranks answered" in seen[-1]
    assert dash.progress.description.startswith("snapshot ")  # labelled, "snapshot 2/2" at its end


# --------------------------------------------------------------------------- never hide a problem, never mislead


class _FakeFleet:
    """Two in-process ranks behind the end-state fleet protocol: reset poisons, reload writes the truth back."""

    reset_pattern = "poison"

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.truth = [{n: torch.randn(8, generator=g) for n in NAMES} for _ in range(2)]
        self.params = [{n: t.clone() for n, t in d.items()} for d in self.truth]
        self.resets = 0

    @property
    def targets(self) -> tuple[str, ...]:
        return ("http://r0", "http://r1")

    def identity(self, target: str) -> dict:
        i = int(target[-1])
        return {"role": "engine", "rank": i, "pp": 0, "tp": i}

    def digests(self, phase: str):  # noqa: ANN201 - a FetchResult
        from wcviz.endstate.fleets import _no_failures
        from wcviz.sources._fleet import FetchResult

        frames = [_frame(p, phase, rank=i, pp=0, tp=i).assign(url=f"http://r{i}") for i, p in enumerate(self.params)]
        return FetchResult(self.targets, pd.concat(frames, ignore_index=True), _no_failures())

    def act(self, action: str):  # noqa: ANN201 - an ActionResult
        from wcviz.sources._fleet import ActionResult

        if action == "reset":
            for p in self.params:
                poison_(p, byte=0xA5 if self.resets % 2 == 0 else 0x5A)
            self.resets += 1
        elif action == "reload":
            for p, t in zip(self.params, self.truth):
                for n in NAMES:
                    p[n].copy_(t[n])
        return ActionResult(action, self.targets, answers={t: {} for t in self.targets})


def test_snapshot_is_off_while_the_ranks_hold_the_reset_pattern() -> None:
    from wcviz.widgets import DashboardState

    fleet = _FakeFleet()
    s = DashboardState(fleet)
    s.phase("snapshot")
    s.phase("reset")
    assert s.step_block("snapshot") == "reload first: the ranks hold the reset pattern (3 Reload writes the weights back)"
    with pytest.raises(RuntimeError, match="reload first"):
        s.phase("snapshot")  # was: a snapshot of the poison, Reload off while the engine serves it
    assert s.reset_started and s.step_block("reload") is None
    s.phase("reload")
    assert s.step_block("snapshot") is None
    s.compare()
    assert s.status_text == "2 of 2 ranks answered; all 8 parameters match"


def _verdict_frame(rows: list[tuple]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=["rank", "pp", "tp", "name", "status"])
    for c in ("rank", "dp", "pp", "tp", "ep"):
        df[c] = df[c].astype("Int64") if c in df else pd.Series(pd.NA, index=df.index, dtype="Int64")
    return df.astype({"name": "string", "status": "string"})


def test_the_status_line_counts_unnamed_findings_and_names_silent_ranks() -> None:
    from wcviz.widgets import DashboardState

    unnamed = _verdict_frame([(0, 0, 0, NAMES[0], "match"), (0, 0, 0, None, "mismatch"), (1, 0, 1, NAMES[0], "match")])
    assert DashboardState(unnamed).status_text == "2 ranks; 1 mismatch on 1 rank (rank 0 (pp0 tp0)); 2 match"  # was: all 2 match
    rows = [(r, 0, r, n, "match") for r in (0, 1) for n in NAMES[:3]] + [(2, 0, 2, None, "unreachable"), (3, 0, 3, None, "empty")]
    assert DashboardState(_verdict_frame(rows)).status_text == (
        "3 of 4 ranks answered; 1 rank empty (rank 3 (pp0 tp3): answered with no parameters); "
        "1 rank unreachable (rank 2 (pp0 tp2): did not answer); 6 match"
    )


def test_a_verdict_frame_without_a_status_is_refused() -> None:
    from wcviz._errors import TableError
    from wcviz.widgets import DashboardState

    v = _verdict_frame([(0, 0, 0, NAMES[0], "match"), (1, 0, 1, NAMES[0], None)])
    for make in (DashboardState, Dashboard):
        with pytest.raises(TableError, match=r"row 1 \(rank 1 \(pp=0 tp=1\), parameter .*\) has no status"):
            make(v)


def test_a_view_or_filter_that_works_clears_its_earlier_error() -> None:
    dash = Dashboard(_verdict_frame([(0, 0, 0, NAMES[0], "match"), (1, 0, 1, NAMES[0], "corrupted")]))
    with pytest.raises(ValueError, match="no digest_<phase> columns"):
        dash.set_view("drill-down")
    dash.set_view("layer × rank")
    assert dash.error_text == "" and dash.errors.layout.display == "none"
    dash.search.value = "("
    assert dash.error_text.startswith("filter: the parameter filter '(' is not a regular expression")
    dash.search.value = "layers"
    assert dash.error_text == ""
