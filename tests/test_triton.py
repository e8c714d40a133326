"""The Triton kernels against the torch reference, in Triton's CPU interpreter.

There is no GPU here, so the kernels run under ``TRITON_INTERPRET=1`` on CPU
tensors: the same kernel code, program by program. The variable has to be set
before the kernels are defined, hence at the top of this module. The compiled
kernels are checked on a real GPU by ``benchmarks/gpu.py``.
"""

from __future__ import annotations

import os
import platform

os.environ["TRITON_INTERPRET"] = "1"  # before the first import of wcviz.digest._triton

import pytest
import torch

pytest.importorskip(
    "triton",
    reason=f"Triton cannot be installed here: it ships wheels for Linux x86_64/aarch64 only "
    f"(this is {platform.system()} {platform.machine()})",
)

from wcviz._errors import DigestError
from wcviz.digest import DigestAccumulator, _spec, _torch, _triton, digest_hex, digest_many, resolve_backend

C = _spec.CHUNK


def _lanes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64, generator=g)


def _seeds(k: int) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(1000 + k)
    raw = torch.randint(0, 2**62, (k, 2), generator=g).tolist()
    return [(a * 4 + 3, b * 2 + 1) for a, b in raw]  # odd and above 2**63 too


def _reference(xs: list[torch.Tensor], seeds: list[tuple[int, int]]) -> torch.Tensor:
    return torch.stack([_torch.lanes_digest(x, s) for x, s in zip(xs, seeds)])


def test_kernels_are_interpreted() -> None:
    assert _triton.interpreting()
    assert type(_triton._blocks).__name__ == "InterpretedFunction", "kernels were defined before TRITON_INTERPRET was set"


@pytest.mark.parametrize("block", [4, 8])
def test_small_tensors_in_one_batch_match_reference(block: int) -> None:
    """Chunks narrower than, equal to and wider than a block, side by side in one batch."""
    sizes = [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100]
    xs = [_lanes(n, i) for i, n in enumerate(sizes)]
    seeds = _seeds(len(xs))
    got = _triton.lanes_digest_many(xs, seeds, block=block)
    want = _reference(xs, seeds)
    wrong = [n for n, a, b in zip(sizes, got, want) if not torch.equal(a, b)]
    assert not wrong, f"lane counts whose digest differs from the reference: {wrong}"


def test_chunk_boundaries_match_reference() -> None:
    """CHUNK - 1, CHUNK, CHUNK + 1 and several chunks: the chain and the short last chunk."""
    sizes = [C - 1, C, C + 1, 3 * C + 5]
    xs = [_lanes(n, 50 + i) for i, n in enumerate(sizes)]
    seeds = _seeds(len(xs))
    got = _triton.lanes_digest_many(xs, seeds, block=1 << 18)  # big blocks: the interpreter is slow per program
    want = _reference(xs, seeds)
    wrong = [n for n, a, b in zip(sizes, got, want) if not torch.equal(a, b)]
    assert not wrong, f"lane counts whose digest differs from the reference: {wrong}"


def test_default_block_and_a_flipped_bit() -> None:
    x = _lanes(3000, 7)  # three blocks of 1024, the last one part padding
    seed = _seeds(1)[0]
    base = _triton.lanes_digest(x, seed)
    assert torch.equal(base, _torch.lanes_digest(x, seed))
    y = x.clone()
    y[2047] ^= 1 << 40
    assert not torch.equal(_triton.lanes_digest(y, seed), base)


def test_public_api_with_backend_triton_matches_torch() -> None:
    """Every way in (one tensor, a batch, the accumulator) gives the reference's hex."""
    g = torch.Generator().manual_seed(3)
    tensors = {
        "embed": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "transposed": torch.randn(33, 17, generator=g).t(),
        "odd_bytes": torch.randint(-100, 100, (13,), dtype=torch.int8, generator=g),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "mask": torch.rand(9, generator=g) > 0.5,
        "slice_at_odd_offset": torch.arange(40, dtype=torch.int16)[3:30],
    }
    want = digest_many(tensors, backend="torch")
    assert digest_many(tensors, backend="triton") == want
    assert digest_hex(tensors["embed"], backend="triton") == want["embed"]
    acc = DigestAccumulator(backend="triton")
    for name, t in tensors.items():
        acc.add(name, t)
    assert acc.hex() == want


def test_auto_stays_numba_on_the_cpu() -> None:
    assert resolve_backend("auto", "cpu") == "numba"
    assert resolve_backend("auto", "cuda") == "triton"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(DigestError, match=r"'triton' runs on CUDA.*tensor 'w' is on cpu"):
        resolve_backend("triton", "cpu", "w")


def test_bad_batches_are_named() -> None:
    seed = _seeds(1)[0]
    with pytest.raises(ValueError, match="lane tensor 1: expected contiguous 1-D int64"):
        _triton.lanes_digest_many([_lanes(8, 0), _lanes(16, 1)[::2]], [seed, seed])
    with pytest.raises(ValueError, match="block must be a power of two"):
        _triton.lanes_digest_many([_lanes(8, 0)], [seed], block=6)
    with pytest.raises(ValueError, match="2 lane tensors but 1 seeds"):
        _triton.lanes_digest_many([_lanes(8, 0), _lanes(8, 1)], [seed])


@pytest.mark.slow
def test_gpu_benchmark_script_runs_in_the_interpreter(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """benchmarks/gpu.py is only ever run on a lent GPU: its smoke mode keeps it from rotting here."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "gpu.py"), "--device", "cpu", "--smoke", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["identity"] and all(c["ok"] for c in result["identity"])
    assert {"eager torch reference, same device", "device-to-device copy (bytes read)", "one mix per lane (compute floor)"} <= set(result["speed_gbps"])
    assert [b["case"] for b in result["batching"]] == ["sim-tiny (bf16)", "small tensors (4096 bf16 each)"]
    assert "## Identity with the CPU (numba)" in proc.stdout and "## Whole-model batching" in proc.stdout
    engines = result["engines"]  # the engines' own checksums: the same on the device as on the host, and timed
    assert engines["identity"] and all(engines["identity"].values())
    assert {"vllm-sha256 on cpu", "sglang-cpu on cpu", "sglang-gpu on cpu"} <= set(engines["gbps"])


def test_self_check_passes_in_the_interpreter() -> None:
    assert _triton.self_check(torch.device("cpu"), block=1 << 18)


def test_auto_falls_back_to_torch_when_the_kernels_fail_their_self_check(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A miscompiled or crashing kernel on a real GPU must not be what ``auto`` digests with."""
    from wcviz.digest import _backends

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for failure in (lambda device: False, lambda device: 1 / 0):
        monkeypatch.setattr(_backends, "_trusted", {})
        monkeypatch.setattr(_triton, "self_check", failure)
        with caplog.at_level("ERROR", logger="wcviz.digest"):
            assert resolve_backend("auto", "cuda") == "torch"
        assert "failed their self-check on CUDA" in caplog.text
        caplog.clear()
    monkeypatch.setattr(_backends, "_trusted", {})
    monkeypatch.setattr(_triton, "self_check", lambda device: True)
    assert resolve_backend("auto", "cuda") == "triton"
    assert resolve_backend("triton", "cuda") == "triton"  # asked for by name: no self-check in the way
