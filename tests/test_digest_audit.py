"""Regressions from an audit of the digest code: numba's disk cache, ``auto`` rates, a late TRITON_INTERPRET."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter at the repository root (a new process: nothing compiled, nothing imported)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280
    )


def test_sglang_gpu_kernel_is_reused_from_numbas_disk_cache(tmp_path: Path) -> None:
    """A second process loads the tiles kernel from the cache the first wrote: one cache entry, not one per process.

    The kernel used to be defined inside a function, capturing its helpers as closure variables whose pickled form
    (part of numba's cache key) differed per process: every process recompiled and added an entry.
    """
    pytest.importorskip("numba")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env["NUMBA_CACHE_DIR"] = str(tmp_path)
    code = """
        import numpy as np
        from wcviz.digest._engines import _sglang_gpu_host, reference_sglang_gpu
        raw = np.random.default_rng(0).integers(0, 256, 5 * 8192 * 4 + 13, dtype=np.uint8)
        assert _sglang_gpu_host(raw) == reference_sglang_gpu(raw)
    """
    for i in range(2):
        done = _run(code, env)
        assert done.returncode == 0, f"run {i + 1}: {done.stderr[-2000:]}"
    entries = sorted(p.name for p in tmp_path.rglob("*tiles*.nbc"))
    assert len(entries) == 1, f"the second process compiled the sglang-gpu kernel again: cache entries {entries}"


def test_predicted_cost_measures_rates_labelled_auto() -> None:
    """``auto`` rates are measured as the backend ``auto`` picks on the CPU, and the row says which that is."""
    from wcviz import bench
    from wcviz.digest import resolve_backend

    rates = pd.DataFrame({"backend": ["auto"], "gbps": [3.0], "overhead_s": [3e-5]})
    cost = bench.predicted_cost(["sim-tiny"], rates)
    assert len(cost) == 1
    row = cost.iloc[0]
    assert row["backend"] == resolve_backend("auto", "cpu")
    assert row["measured_s"] == row["measured_s"] and row["measured_s"] > 0, "auto's measurement was not found"


def test_triton_interpret_set_after_import_is_a_digest_error() -> None:
    """TRITON_INTERPRET=1 set after the kernels were imported: a DigestError naming the cause, not Triton's '0 active drivers'."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = """
        import os, torch
        import wcviz.digest._triton  # imported before the variable is set
        os.environ["TRITON_INTERPRET"] = "1"
        from wcviz._errors import DigestError
        from wcviz.digest import digest_hex
        try:
            digest_hex(torch.arange(10.0), backend="triton")
        except DigestError as e:
            print("DigestError:", e)
        except Exception as e:
            print("other:", type(e).__name__, e)
        else:
            print("no error")
    """
    done = _run(code, env)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.strip()
    assert out.startswith("DigestError:"), out
    assert "TRITON_INTERPRET=1" in out and "before" in out and "imported" in out, out
