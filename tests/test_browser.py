"""The dashboard in a real browser: JupyterLab + headless Chromium, clicked like a person would.

A JupyterLab server starts on 127.0.0.1 (a free port, a token, every Jupyter and
IPython folder in a temp dir, a ``python3`` kernelspec that is this interpreter) on a
temp copy of notebooks/02_partial_update.ipynb, so the repo's notebook is never
autosaved over. Playwright drives Debian's /usr/bin/chromium (it never downloads a
browser). First the notebook as saved, before anything runs: both dashboard outputs
show their static picture (the second with the heatmap), never a raw ``VBox(...)``.
Then every cell above the one tagged ``dashboard-driven-from-code`` runs (the cluster
comes up, the loader fault is set, the dashboard is displayed) and the numbered flow is
driven in order and out of order: only Fetch and 1 Snapshot are on at first (the
snapshot highlighted); a click on a disabled step does nothing; an invalid parameter
regex is an error that the next check clears; each step turns the next one on and
highlights it; the status line says what is happening during the reload; Compare
names the fault exactly (2 unwritten on rank 1, 40 match) with no error left; the
status filter changes the heatmap; the table and the drill-down (a chooser, "1 of 2")
name rank 1's two ``mlp.down_proj``; the topology view draws. Last, the teardown cell
stops the cluster and the dashboard says STOPPED, turns every button off and marks
its view stale. A screenshot of each step lands in tests/artifacts/ (dashboard-N-*.png,
saved-notebook.png, dashboard.png, lab.png).

The server (and with it the kernel and the cluster's processes) is shut down in
``finally``; a process left behind fails the test. The test skips only when Chromium
is not installed, naming why (``make test`` installs it first; see the Makefile's
``browser`` target and .venv/chromium-install.log).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "02_partial_update.ipynb"
STOP_TAG = "dashboard-driven-from-code"  # the browser runs every cell above the first cell with this tag
CHROMIUM = Path("/usr/bin/chromium")
INSTALL_LOG = ROOT / ".venv" / "chromium-install.log"
ARTIFACTS = ROOT / "tests" / "artifacts"
TAG_VAR = "WCVIZ_BROWSER_TEST"  # marks every process this test starts (server, kernel, cluster ranks)

SERVER_START_S = 120
CELLS_S = 300  # the cells above the dashboard: a cluster start and a refit on a slow, shared machine
ACTION_S = 180  # one dashboard action

pytestmark = pytest.mark.slow


def _chromium_missing() -> str | None:
    """Why there is no usable Chromium, or None."""
    if CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK):
        return None
    why = "`make test` (its `browser` step) has not tried to install it; run `make browser`"
    if INSTALL_LOG.exists():
        lines = [ln for ln in INSTALL_LOG.read_text(errors="replace").splitlines() if ln.strip()]
        why = f"installing it failed ({INSTALL_LOG.relative_to(ROOT)}): " + (" | ".join(lines[-3:]) or "empty log")
    return f"headless Chromium is not installed at {CHROMIUM} (Debian packages chromium, chromium-driver): {why}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _tagged_pids(tag: str) -> list[int]:
    """Processes whose environment carries this test's tag (Linux /proc)."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return found


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


class Lab:
    """A JupyterLab server on 127.0.0.1 in a temp world; ``stop`` takes it and everything it started down."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.tag = secrets.token_hex(8)
        self.base = f"http://127.0.0.1:{self.port}"
        self.root = tmp / "root"
        self.log_path = tmp / "jupyterlab.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        t = self.tmp
        dirs = {
            k: t / k.lower()
            for k in ("HOME", "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR")
        }
        for d in [*dirs.values(), self.root, t / "settings", t / "workspaces"]:
            d.mkdir(parents=True, exist_ok=True)
        shutil.copy(NOTEBOOK, self.root / NOTEBOOK.name)
        # the only python3 kernel this server knows: this very interpreter
        spec = dirs["JUPYTER_DATA_DIR"] / "kernels" / "python3"
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (wcviz browser test)", "language": "python", "metadata": {"debugger": False},
        }))  # fmt: skip
        # no news or update toasts over the notebook
        notes = t / "settings" / "@jupyterlab" / "apputils-extension"
        notes.mkdir(parents=True)
        (notes / "notification.jupyterlab-settings").write_text(
            json.dumps({"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True})
        )
        # every cell rendered, not only those in view (JupyterLab 4 windows long notebooks by default)
        tracker = t / "settings" / "@jupyterlab" / "notebook-extension"
        tracker.mkdir(parents=True)
        (tracker / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
        env = {**os.environ, **{k: str(v) for k, v in dirs.items()}, TAG_VAR: self.tag}
        env["JUPYTER_PREFER_ENV_PATH"] = "0"  # the temp data dir's kernelspec before the venv's own python3
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env.pop("MPLBACKEND", None)  # the notebook's %matplotlib inline decides
        cmd = [
            sys.executable, "-m", "jupyterlab",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}", "--ServerApp.open_browser=False", "--allow-root",
            f"--ServerApp.root_dir={self.root}", "--LabApp.expose_app_in_browser=True",
            f"--LabApp.user_settings_dir={t / 'settings'}", f"--LabApp.workspaces_dir={t / 'workspaces'}",
            "--ServerApp.terminals_enabled=False",
        ]  # fmt: skip
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            cmd, cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"JupyterLab exited with {self.proc.returncode} while starting:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError):
                status, _ = _get(f"{self.base}/api/status?token={self.token}", timeout=2)
                if status == 200:
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"JupyterLab did not answer within {SERVER_START_S} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def api(self, path: str) -> dict:
        status, body = _get(f"{self.base}{path}?token={self.token}")
        assert status == 200, f"GET {path}: HTTP {status}: {body[:300]!r}"
        return json.loads(body)

    def log_tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return "(no log)"

    def stop(self) -> list[int]:
        """Shut the server down (it shuts its kernels down), then make sure nothing it started survives.

        Returns the pids of processes that were still alive and had to be killed.
        """
        if self.proc is None:
            return []
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                req = urllib.request.Request(f"{self.base}/api/shutdown?token={self.token}", method="POST")
                urllib.request.urlopen(req, timeout=10).close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(10)
        # the kernel's cluster ranks die with their parent (PR_SET_PDEATHSIG); give them a moment
        deadline = time.monotonic() + 20
        left = _tagged_pids(self.tag)
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = _tagged_pids(self.tag)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return left


def _run_cells_above_tag(page, tag: str) -> int:
    """Select the first cell tagged ``tag`` and run every cell above it (JupyterLab's "Run All Above Selected Cell")."""
    return page.evaluate(
        """async (tag) => {
            const app = window.jupyterapp;
            const panel = app.shell.currentWidget;
            await panel.context.ready;
            await panel.sessionContext.ready;
            const nb = panel.content;
            const idx = nb.widgets.findIndex(c => (c.model.getMetadata('tags') || []).includes(tag));
            if (idx < 1) throw new Error(`no cell tagged ${tag} (or it is the first cell)`);
            nb.activeCellIndex = idx;
            await app.commands.execute('notebook:run-all-above');
            return idx;
        }""",
        tag,
    )


def _kernel_state(page) -> str:
    return page.evaluate(
        "() => { const k = window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel;"
        " return k ? `${k.name} ${k.status}` : 'none'; }"
    )


def _errors_in_notebook(page) -> str:
    """Tracebacks shown in the notebook (a cell above the dashboard failed)."""
    errs = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    return "\n".join(errs.all_inner_texts())[-3000:]


def _run_cell_tagged(page, tag: str) -> None:
    """Run the one cell tagged ``tag`` (JupyterLab's "Run Selected Cell")."""
    page.evaluate(
        """async (tag) => {
            const app = window.jupyterapp;
            const nb = app.shell.currentWidget.content;
            const idx = nb.widgets.findIndex(c => (c.model.getMetadata('tags') || []).includes(tag));
            if (idx < 0) throw new Error(`no cell tagged ${tag}`);
            nb.activeCellIndex = idx;
            await app.commands.execute('notebook:run-cell');
        }""",
        tag,
    )


def _enabled(page) -> list[str]:
    """The dashboard's buttons a person can press now."""
    names = ["fetch", "snapshot", "reset", "reload", "compare"]
    return [n for n in names if page.locator(f"button.wcviz-{n}").first.is_enabled()]


def _settled(page, enabled: list[str], highlighted: list[str], timeout_s: float = 30.0) -> None:
    """Wait until the buttons a person can press, and the highlighted ones, are these (the widgets update one by one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = (_enabled(page), _highlighted(page))
        if got == (enabled, highlighted):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"buttons on {got[0]}, highlighted {got[1]}; expected on {enabled}, highlighted {highlighted}")
        time.sleep(0.2)


def _highlighted(page) -> list[str]:
    names = ["fetch", "snapshot", "reset", "reload", "compare"]
    out = []
    for n in names:
        cls = page.locator(f"button.wcviz-{n}").first.get_attribute("class") or ""
        if "mod-primary" in cls or "mod-danger" in cls:
            out.append(n)
    return out


STEP_SHOTS = (
    "0-start", "1-snapshot", "2-reset-confirm", "3-reset", "4-reload", "5-compare", "6-filtered-heatmap",
    "7-table", "8-drilldown", "9-topology", "10-stopped",
)  # fmt: skip


def test_dashboard_in_jupyterlab_chromium(tmp_path):
    missing = _chromium_missing()
    if missing:
        pytest.skip(missing)
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / ".gitignore").write_text("*\n")  # screenshots are results, never committed
    shot, page_shot, topo_shot, saved_shot = (
        ARTIFACTS / "dashboard.png",
        ARTIFACTS / "lab.png",
        ARTIFACTS / "dashboard-topology.png",
        ARTIFACTS / "saved-notebook.png",
    )
    steps = {name: ARTIFACTS / f"dashboard-{name}.png" for name in STEP_SHOTS}
    for p in (shot, page_shot, topo_shot, saved_shot, *steps.values()):
        p.unlink(missing_ok=True)

    lab = Lab(tmp_path)
    leftovers: list[int] = []
    try:
        lab.start()
        specs = lab.api("/api/kernelspecs")
        argv = specs["kernelspecs"]["python3"]["spec"]["argv"]
        assert argv[0] == sys.executable, (
            f"the notebook's kernel would be {argv[0]}, not this interpreter {sys.executable}"
        )

        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=str(CHROMIUM),
                headless=True,
                args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"],
            )
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.set_default_timeout(ACTION_S * 1000)
                page.goto(f"{lab.base}/lab/tree/{NOTEBOOK.name}?token={lab.token}", wait_until="domcontentloaded")
                page.wait_for_function(
                    "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                    " && window.jupyterapp.shell.currentWidget.content && window.jupyterapp.shell.currentWidget.sessionContext",
                    timeout=SERVER_START_S * 1000,
                )

                # the saved notebook, before anything runs: the dashboard's picture, never a raw VBox(...) repr
                static = page.locator(".wcviz-static")
                expect(static.first).to_be_visible(timeout=60_000)
                assert static.count() == 2, "both saved dashboard outputs should show their static picture"
                assert "static picture of the wcviz dashboard" in static.first.inner_text()
                outputs = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
                assert "VBox(children" not in outputs, outputs[:500]
                after = static.nth(1)
                after.scroll_into_view_if_needed()
                assert "2 unwritten on 1 rank" in after.inner_text()
                picture = after.locator("img")
                expect(picture).to_be_visible()
                assert picture.evaluate("img => img.naturalWidth") > 200, "the saved heatmap did not load"
                after.screenshot(path=str(saved_shot))

                stop_at = _run_cells_above_tag(page, STOP_TAG)
                dashboard = page.locator(".wcviz-dashboard").first
                try:
                    dashboard.wait_for(state="visible", timeout=CELLS_S * 1000)
                except Exception as e:
                    page.screenshot(path=str(page_shot), full_page=True)
                    raise AssertionError(
                        f"the dashboard did not render after running the {stop_at} cells above it "
                        f"(kernel: {_kernel_state(page)}); notebook errors:\n{_errors_in_notebook(page)}\n"
                        f"server log:\n{lab.log_tail()}"
                    ) from e
                dashboard.scroll_into_view_if_needed()
                status = dashboard.locator(".wcviz-status-line")
                errors = dashboard.locator(".wcviz-errors")

                # the flow as it starts: Fetch and 1 Snapshot, the snapshot highlighted; the rest off, saying why
                expect(dashboard.locator("button.wcviz-snapshot")).to_be_enabled()
                _settled(page, ["fetch", "snapshot"], ["snapshot"])
                assert dashboard.locator("button.wcviz-snapshot").inner_text().strip() == "1 Snapshot"
                assert "take the snapshot first" in (dashboard.locator("button.wcviz-reset").get_attribute("title") or "")
                # out of order: a disabled step does nothing when clicked
                before = status.inner_text()
                dashboard.locator("button.wcviz-compare").click(force=True)
                dashboard.locator("button.wcviz-reset").click(force=True)
                assert not dashboard.locator(".wcviz-reset-confirm").is_visible() and status.inner_text() == before
                # a parameter filter that is not a regular expression is an error, shown
                search = dashboard.locator(".wcviz-search input")
                search.fill("down_proj(")
                search.press("Enter")
                expect(errors).to_contain_text("is not a regular expression", timeout=30_000)
                dashboard.screenshot(path=str(steps["0-start"]))

                # every text the status line shows, in order (what is happening while an action runs)
                dashboard.evaluate(
                    """d => { window.__wcvizStatus = [];
                              const line = d.querySelector('.wcviz-status-line');
                              new MutationObserver(() => window.__wcvizStatus.push(line.innerText))
                                .observe(line, {subtree: true, childList: true, characterData: true}); }"""
                )
                dashboard.locator("button.wcviz-snapshot").click()
                expect(status).to_contain_text("snapshot done", timeout=ACTION_S * 1000)
                expect(errors).to_be_hidden()  # a new check: the earlier error is gone
                _settled(page, ["fetch", "snapshot", "reset"], ["reset"])
                dashboard.screenshot(path=str(steps["1-snapshot"]))

                dashboard.locator("button.wcviz-reset").click()
                yes = dashboard.locator("button.wcviz-reset-yes")
                expect(yes).to_be_visible()
                fits = yes.evaluate("b => b.scrollWidth <= b.clientWidth + 1")
                assert fits and "Yes, overwrite every weight" in yes.inner_text(), "the confirm label is cut off"
                dashboard.screenshot(path=str(steps["2-reset-confirm"]))
                yes.click()
                expect(status).to_contain_text("reset done", timeout=ACTION_S * 1000)
                _settled(page, ["fetch", "reload"], ["reload"])  # no new snapshot while the ranks hold the reset pattern
                dashboard.screenshot(path=str(steps["3-reset"]))

                dashboard.locator("button.wcviz-reload").click()
                expect(status).to_contain_text("reload done", timeout=ACTION_S * 1000)
                seen = page.evaluate("() => window.__wcvizStatus")
                assert any("reloading" in t for t in seen), f"the status line never said what was happening: {seen}"
                assert any("snapshotting" in t for t in seen), seen
                _settled(page, ["fetch", "snapshot", "compare"], ["compare"])
                dashboard.screenshot(path=str(steps["4-reload"]))

                dashboard.locator("button.wcviz-compare").click()
                expect(status).to_contain_text("unwritten", timeout=ACTION_S * 1000)
                text = status.inner_text()
                assert "4 of 4 ranks answered" in text, text
                assert "2 unwritten on 1 rank (rank 1 (dp0 pp0 tp1))" in text, text  # the rank, named
                assert "40 match" in text, text
                expect(errors).to_be_hidden()  # no error left after a successful run
                _settled(page, ["fetch", "snapshot", "reload", "compare"], [])  # a weight still holds the reset: Reload stays on

                heatmap = dashboard.locator("img.wcviz-heatmap")
                expect(heatmap).to_be_visible()
                width, height = heatmap.evaluate("img => [img.naturalWidth, img.naturalHeight]")
                assert width > 200 and height > 100, f"the heatmap did not load ({width}x{height})"
                dashboard.screenshot(path=str(steps["5-compare"]))
                dashboard.screenshot(path=str(shot))
                page.screenshot(path=str(page_shot))

                # the status filter greys the heatmap out where it does not apply
                unfiltered = heatmap.get_attribute("src")
                labels = dashboard.locator(".wcviz-status select option").all_inner_texts()
                dashboard.locator(".wcviz-status select").select_option(label=next(x for x in labels if x.startswith("unwritten")))
                expect(heatmap).not_to_have_attribute("src", unfiltered or "", timeout=30_000)
                dashboard.screenshot(path=str(steps["6-filtered-heatmap"]))

                # which rank and which parameters: the table view, filtered to the unwritten rows
                dashboard.locator(".wcviz-view select").select_option("table")
                table = dashboard.locator(".wcviz-table table")
                expect(table.locator("tbody tr")).to_have_count(2, timeout=ACTION_S * 1000)  # the filtered table, re-drawn
                rows = table.evaluate(
                    """t => { const head = [...t.querySelectorAll('thead th')].map(th => th.innerText.trim());
                              return [...t.querySelectorAll('tbody tr')].map(tr =>
                                Object.fromEntries([...tr.querySelectorAll('td')].map((td, i) => [head[i], td.innerText.trim()]))); }"""
                )
                assert {r["rank"] for r in rows} == {"1"}, rows
                assert sorted(r["name"] for r in rows) == [
                    "model.layers.0.mlp.down_proj.weight",
                    "model.layers.1.mlp.down_proj.weight",
                ], rows
                assert {r["status"] for r in rows} == {"unwritten"}, rows
                dashboard.screenshot(path=str(steps["7-table"]))

                # the drill-down: one of the two, chosen
                dashboard.locator(".wcviz-view select").select_option("drill-down")
                drill = dashboard.locator(".wcviz-drill select")
                expect(drill).to_be_visible()
                options = [o.replace("\xa0", " ") for o in drill.locator("option").all_inner_texts()]
                assert [o.split("(")[-1] for o in options] == ["1 of 2)", "2 of 2)"], options
                first = dashboard.locator("img.wcviz-drilldown").get_attribute("src")
                drill.select_option(index=1)
                expect(dashboard.locator("img.wcviz-drilldown")).not_to_have_attribute("src", first or "", timeout=30_000)
                dashboard.screenshot(path=str(steps["8-drilldown"]))

                # the same verdicts as the engine's layout: the view selector swaps the picture
                dashboard.locator(".wcviz-view select").select_option("topology")
                topo = dashboard.locator("img.wcviz-topology")
                expect(topo).to_be_visible()
                assert topo.evaluate("img => img.naturalWidth") > 200
                dashboard.screenshot(path=str(topo_shot))
                dashboard.screenshot(path=str(steps["9-topology"]))

                # the notebook's last cell stops the cluster: the dashboard notices, says so and turns itself off
                _run_cell_tagged(page, "teardown")
                expect(status).to_contain_text("STOPPED", timeout=ACTION_S * 1000)
                expect(dashboard.locator("button.wcviz-fetch")).to_be_disabled()
                _settled(page, [], [])
                expect(dashboard.locator(".wcviz-stale")).to_be_visible()
                dashboard.scroll_into_view_if_needed()
                dashboard.screenshot(path=str(steps["10-stopped"]))
            finally:
                browser.close()
    finally:
        leftovers = lab.stop()
    assert not leftovers, f"processes left behind after the server shut down (killed now): {leftovers}"

    w, h = _png_size(shot)
    assert w >= 600 and h >= 300, f"{shot} is only {w}x{h}"
    assert shot.stat().st_size > 20_000, f"{shot} is only {shot.stat().st_size} bytes"
    for p in (topo_shot, saved_shot, *steps.values()):
        _png_size(p)
    print(f"dashboard screenshots: {', '.join(str(p) for p in steps.values())}; saved notebook: {saved_shot}")
