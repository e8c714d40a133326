"""The package's shape: a small public surface, cheap to import, a README that runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import wcviz

REPO = Path(__file__).resolve().parents[1]


def test_public_names() -> None:
    assert set(wcviz.__all__) == {
        "ALGORITHMS", "BACKENDS", "COLUMNS", "Digest", "tensor_digest", "digest_hex", "digest_many", "compare_digests",
        "from_module", "from_state_dict", "from_safetensors", "compare", "read_table", "write_table",
        "WcvizError", "DigestError", "AlgorithmMismatch", "CheckpointError", "TableError", "GatherError", "__version__",
        "fetch", "check_agents", "verify_engine",
    }
    for name in wcviz.__all__:
        assert getattr(wcviz, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        wcviz.nope  # noqa: B018


def test_import_is_cheap() -> None:
    code = "import sys, wcviz; print(sorted(m for m in ('torch', 'pandas', 'numba', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_sources_load_what_is_used() -> None:
    """``wcviz.sources`` imports a source's module on first use: reading a checkpoint loads neither the HTTP client,
    nor pandas, nor torch; every public name still resolves, to the object its module defines."""
    code = (
        "import sys\n"
        "from wcviz.sources import safetensors_rows\n"
        "print(sorted(m for m in ('torch', 'pandas', 'httpx', 'wcviz.sources._http', 'wcviz.sources._vllm') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    import importlib

    import wcviz.sources as sources

    assert sorted(dir(sources)) == sorted(sources.__all__)
    for name in sources.__all__:
        value = getattr(sources, name)
        if name in sources._EXPORTS:
            module, attr = sources._EXPORTS[name]
            assert value is getattr(importlib.import_module(f"wcviz.sources.{module}"), attr), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        sources.nope  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute '_nope'"):
        sources._nope  # noqa: B018
    code = "import wcviz.sources as s; print(s._fleet.__name__, s._http.__name__)"  # submodules still reachable as attributes
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["wcviz.sources._fleet", "wcviz.sources._http"]


def test_readme_python_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    block = re.search(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert block, "README.md has no python example"
    code = block.group(1)
    assert len(code.strip().splitlines()) <= 10
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "['bias']"
    rows = {line.split()[3]: line.split()[4] for line in out[2:4]}
    assert rows == {"bias": "mismatch", "weight": "match"}


def test_public_names_are_not_shadowed_by_submodules() -> None:
    """Importing every submodule first must not replace a public function by a module of that name."""
    code = (
        "import importlib, pkgutil, types, wcviz\n"
        "for m in pkgutil.walk_packages(wcviz.__path__, 'wcviz.'):\n"
        "    if not m.name.endswith(('__main__', 'demo')): importlib.import_module(m.name)\n"
        "bad = [n for n in wcviz.__all__ if isinstance(getattr(wcviz, n), types.ModuleType)]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_make_demo_runs_the_cluster_and_finds_the_partial_update(tmp_path: Path) -> None:
    """What `make demo` runs: the transport check passes, the end-state check names rank and parameters."""
    import pandas as pd

    out_dir = tmp_path / "demo"
    run = subprocess.run(
        [sys.executable, "-m", "wcviz", "demo", "--out", str(out_dir), "--no-progress"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "transport check of the reload: 4 engine ranks verified, 30 parameters (249,216 bytes) each: every digest matches" in out
    assert "layer 0  . U - -" in out and "layer 1  . U - -" in out
    assert "end-state check: 4 ranks, 42 parameters: 2 unwritten on 1 rank (rank 1 (dp=0 pp=0 tp=1)), 40 match" in out
    verdicts = pd.read_parquet(out_dir / "verdicts.parquet")
    bad = verdicts[verdicts["status"] != "match"]
    assert sorted(bad["name"]) == ["model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    assert set(bad["rank"]) == {1} and set(bad["status"]) == {"unwritten"}
    assert (out_dir / "layer_rank.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for phase in ("snapshot", "reset", "reload"):
        assert len(pd.read_parquet(out_dir / f"{phase}.parquet")) == 42
    pids = [int(line.split("pid")[1].split()[0]) for line in out.splitlines() if " pid " in line]
    assert len(pids) == 5
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split()[2] == "Z", f"rank process {pid} outlived the demo"


def test_readme_mentions_every_notebook_and_make_target() -> None:
    text = (REPO / "README.md").read_text()
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        assert nb.stem in text, nb.name
    makefile = (REPO / "Makefile").read_text()
    for target in ("demo", "test", "lab", "bench"):
        assert f"\n{target}:" in makefile and f"make {target}" in text, target


# --------------------------------------------------------------------------- the shape of the code


def _modules() -> dict[str, Path]:
    package = REPO / "wcviz"
    out = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def test_no_module_over_600_lines_and_no_class_over_350() -> None:
    import ast

    big, classes = [], []
    for name, path in _modules().items():
        text = path.read_text()
        if len(text.splitlines()) > 600:
            big.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 350:
                classes.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert big == [] and classes == []


def test_no_private_name_is_imported_across_packages_and_no_import_circle() -> None:
    """A private module or name (``_x``) is used only by its own package and the packages inside it; the
    module-level imports between wcviz's modules form no cycle."""
    import ast

    mods = _modules()

    def package_of(mod: str) -> str:
        return mod if mods[mod].name == "__init__.py" else mod.rsplit(".", 1)[0]

    def private(mod: str) -> bool:
        return any(p.startswith("_") and not p.startswith("__") for p in mod.split("."))

    crossing, edges = [], {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        here = package_of(mod)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("wcviz")):
                continue
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                target = full if full in mods else node.module
                owner = package_of(target) if target in mods else target
                if (private(target) or (alias.name.startswith("_") and full not in mods)) and not (
                    here == owner or here.startswith(owner + ".")
                ):
                    crossing.append(f"{mod} imports {full}")
                if id(node) in top and target in mods:
                    edges[mod].add(target)
    assert crossing == []

    def cycle_from(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges[node]:
                if nxt == start:
                    return [*path, nxt]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
        return None

    cycles = [c for m in mods if (c := cycle_from(m)) is not None and c[0] == m]
    assert cycles == [], cycles[:3]


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (4, 1)])
def test_every_demo_fault_is_aimed_at_ranks_the_layout_has(tp: int, pp: int) -> None:
    """`wcviz demo --fault stale --tp 1 --pp 2` announced a fault on rank 3 of a 2-rank engine, injected nothing,
    and exited 1 as if the check had missed it."""
    from wcviz.demo import FAULTS, fault_plan
    from wcviz.sim.engine import EngineLayout

    layout = EngineLayout(tp=tp, pp=pp)
    for fault in FAULTS:
        if fault in ("swap", "fused") and tp < 2:
            with pytest.raises(ValueError, match=f"--fault {fault} needs --tp 2 or more"):
                fault_plan(fault, layout)
            continue
        what, plan = fault_plan(fault, layout)
        assert all(0 <= r < layout.world_size for r in plan), (fault, plan)
        assert (fault == "none") == (not plan)
        assert all(f"rank {r}" in what for r in plan) or fault in ("fused", "swap")


def test_demo_refuses_a_fault_its_layout_cannot_show_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    from wcviz.demo import main

    with pytest.raises(SystemExit) as e:
        main(["--fault", "swap", "--tp", "1", "--pp", "2"])
    assert e.value.code == 2 and "--fault swap needs --tp 2 or more" in capsys.readouterr().err


def test_the_demo_passes_only_the_findings_its_fault_should_give() -> None:
    """Exit 0 meant "the check failed somehow": a flip fault whose check named an unrelated down_proj skip on
    another rank (or a dead rank) passed as the flip caught."""
    import pandas as pd

    from wcviz.demo import FAULTS, fits
    from wcviz.sim.engine import EngineLayout

    layout = EngineLayout(tp=2, pp=2)
    names = ["model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight", "lm_head.weight"]

    def verdicts(bad: dict[tuple[int, str], str]) -> pd.DataFrame:
        rows = [{"rank": r, "name": n, "status": bad.get((r, n), "match")} for r in range(4) for n in names]
        return pd.DataFrame(rows).astype({"rank": "Int64", "name": "string", "status": "string"})

    caught = {
        "skip": {(1, names[2]): "unwritten"},
        "stale": {(3, n): "unwritten" for n in names},
        "fused": {(1, names[0]): "corrupted", (3, names[1]): "corrupted"},
        "swap": {(0, names[0]): "corrupted", (1, names[0]): "corrupted"},
        "cast": {(0, names[1]): "corrupted"},
        "flip": {(3, names[3]): "corrupted"},
        "none": {},
    }
    assert set(caught) == set(FAULTS)
    for fault, bad in caught.items():
        assert fits(fault, layout, verdicts(bad)) is None, fault
    assert "findings on engine ranks [1] (want [3])" in str(fits("flip", layout, verdicts({(1, names[3]): "corrupted"})))
    assert "want names matching lm_head" in str(fits("flip", layout, verdicts({(3, names[2]): "corrupted"})))
    assert "statuses unreachable" in str(fits("skip", layout, verdicts({(1, names[2]): "unwritten", (2, names[0]): "unreachable"})))
    assert fits("skip", layout, verdicts({})) == "no finding"
    assert fits("none", layout, verdicts({(0, names[0]): "corrupted"})) == "1 findings where the update was healthy"
    assert "findings on engine ranks [1] (want [0, 1])" in str(fits("swap", layout, verdicts({(1, names[0]): "corrupted"})))
