"""Files out of an engine's released wheel, for tests that hold wcviz to the engine's own code.

The wheel is downloaded once with ``pip download --no-deps`` (PyPI), the files the tests
read are extracted into a cache (``$WCVIZ_TEST_CACHE``, default ``~/.cache/wcviz-tests``)
and the wheel is deleted. A test that cannot have them skips, saying why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SGLANG_VERSION = "0.5.23"
SGLANG_FILES = (  # inside the sglang wheel
    "sglang/kernels/ops/memory/gpu_tensor_hash.py",
    "sglang/srt/utils/weight_checker.py",
    "sglang/srt/managers/io_struct.py",
)


def sglang_file(path: str) -> Path:
    """``path`` (one of :data:`SGLANG_FILES`) from the sglang wheel, downloaded and cached once."""
    assert path in SGLANG_FILES, path
    cache = Path(os.environ.get("WCVIZ_TEST_CACHE", Path.home() / ".cache" / "wcviz-tests")) / f"sglang-{SGLANG_VERSION}"
    out = cache / path
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    wheels = list(cache.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "-d", str(cache), f"sglang=={SGLANG_VERSION}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.skip(f"downloading the sglang=={SGLANG_VERSION} wheel took over 600 s")
        wheels = list(cache.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if done.returncode or not wheels:
            pytest.skip(f"cannot download the sglang=={SGLANG_VERSION} wheel to read it: {(done.stderr or done.stdout).strip()[-300:]}")
    with zipfile.ZipFile(wheels[0]) as z:
        for member in SGLANG_FILES:
            target = cache / member
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(member))
    wheels[0].unlink()  # 39 MB; the few files are all the tests read
    return out
