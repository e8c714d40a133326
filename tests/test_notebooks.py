"""The notebooks in notebooks/ run clean under nbval, with this interpreter as their kernel.

One nbval run (a pytest subprocess: ``--nbval-lax --nbval-current-env`` and the
sanitize file tests/nbval_sanitize.cfg) executes every notebook top to bottom in
a fresh kernel of ``sys.executable``. In lax mode every code cell must run without
an error, and the cells tagged ``nbval-check-output`` (counts, verdicts) must
reproduce their saved output; no test plumbing sits in a cell's source. Each notebook then gets its own test that finds all
of its cells in the run's JUnit report and passed, so an empty or partial nbval
run (nothing collected, a notebook skipped) fails instead of passing quietly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS_DIR = ROOT / "notebooks"
SANITIZE = ROOT / "tests" / "nbval_sanitize.cfg"
NOTEBOOKS = [
    "01_quickstart.ipynb", "02_partial_update.ipynb", "03_topology.ipynb", "04_checksum_cost.ipynb",
    "05_expected_shards.ipynb", "06_your_engine.ipynb",
]
CHECK_TAG = "nbval-check-output"  # nbval compares these cells' output with the saved one (under --nbval-lax)
CELL_TIMEOUT_S = 300
RUN_TIMEOUT_S = 900

pytestmark = pytest.mark.slow


def _load(name: str) -> dict:
    return json.loads((NOTEBOOKS_DIR / name).read_text(encoding="utf-8"))


def _code_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def _source(cell: dict) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def test_notebook_set_is_the_documented_one():
    found = sorted(p.name for p in NOTEBOOKS_DIR.glob("*.ipynb"))
    assert found == sorted(NOTEBOOKS), "every notebook in notebooks/ must be listed in NOTEBOOKS (and exist)"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_saved_from_a_clean_run(name):
    """Outputs saved, cells numbered 1..n in order (one top-to-bottom run), kernel python3, %matplotlib inline first."""
    nb = _load(name)
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    cells = _code_cells(nb)
    assert cells, f"{name} has no code cells"
    assert _source(cells[0]).lstrip().startswith("%matplotlib inline"), (
        f"{name}: the first code cell must start with %matplotlib inline"
    )
    counts = [c.get("execution_count") for c in cells]
    assert counts == list(range(1, len(cells) + 1)), f"{name}: not saved from one clean run (execution counts {counts})"
    errors = [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{name} was saved with an error output: {errors[0].get('ename')}: {errors[0].get('evalue')}"
    checked = [c for c in cells if CHECK_TAG in c.get("metadata", {}).get("tags", [])]
    assert checked, f"{name}: no cell's output is checked (tag {CHECK_TAG})"
    for c in checked:
        assert c.get("outputs"), f"{name}: a checked cell was saved without output:\n{_source(c)}"
    plumbing = [_source(c)[:80] for c in nb["cells"] if "NBVAL" in _source(c)]
    assert not plumbing, f"{name}: test plumbing in a cell's source (use cell tags, e.g. {CHECK_TAG}): {plumbing}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_ends_with_what_to_do_next(name):
    last = _load(name)["cells"][-1]
    assert last["cell_type"] == "markdown", f"{name}: the last cell is not a note on what to do next"
    text = _source(last)
    assert text.startswith(("## What next", "## Conclusion")), f"{name}: ends with {text[:60]!r}"
    if name != "06_your_engine.ipynb":
        assert "06_your_engine" in text, f"{name}: its next steps do not point to the notebook for a real engine"


@pytest.fixture(scope="module")
def nbval_run(tmp_path_factory):
    """Run nbval once over every notebook; return (per-notebook results, the run's output)."""
    tmp = tmp_path_factory.mktemp("nbval")
    junit = tmp / "nbval.xml"
    cmd = [
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--color=no",
        "--nbval-lax", "--nbval-current-env", f"--nbval-sanitize-with={SANITIZE}",
        f"--nbval-cell-timeout={CELL_TIMEOUT_S}", f"--junitxml={junit}", "-o", "junit_family=xunit2",
        *[str(NOTEBOOKS_DIR / n) for n in NOTEBOOKS],
    ]  # fmt: skip
    env = dict(os.environ)
    # the kernel (this interpreter) imports this checkout's wcviz, installed or not
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("MPLBACKEND", "Agg")
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    output = proc.stdout + proc.stderr
    results: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            file = case.get("file") or case.get("classname", "")
            notebook = next((n for n in NOTEBOOKS if n in file or n.replace(".ipynb", "") in file), file)
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = child.tag
            results[notebook][outcome].append(case.get("name", "?"))
    return proc.returncode, results, output


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_under_nbval(nbval_run, name):
    rc, results, output = nbval_run
    tail = output[-6000:]
    got = results.get(name)
    assert got is not None, f"nbval ran no cell of {name} (exit code {rc}):\n{tail}"
    bad = {k: v for k, v in got.items() if k != "passed"}
    assert not bad, f"{name}: {bad} (nbval exit code {rc}):\n{tail}"
    expected = len(_code_cells(_load(name)))
    assert len(got["passed"]) == expected, f"{name}: {len(got['passed'])} of {expected} cells passed:\n{tail}"
    assert rc == 0, f"nbval exit code {rc}:\n{tail}"
