"""Digesting a safetensors checkpoint against the kernel alone, in one process: page cache warm, and cold.

    python benchmarks/checkpoint.py [--mib 512] [--repeat 3]

Writes a checkpoint of ``--mib`` MiB (32 MiB bf16 matrices and their small norms) to a
temp folder, then times, best of ``--repeat``: the numba kernel alone on one tensor of
the same bytes (the reference for the ratio), :func:`wcviz.sources.from_safetensors`
with the file in the page cache, and the same with the file evicted from the page cache
first (``posix_fadvise(DONTNEED)``: the disk-bound rate, where the OS honours it).
Then the engines' SHA-256 (``vllm-sha256``), file in the page cache: hashlib over each
tensor of the mapped file one after the other (what the reader did before) against
``from_safetensors(algo="vllm-sha256")``, which runs tensors side by side on threads.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def _best(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _evict(path: Path) -> bool:
    """Drop the file's pages from the page cache; whether the OS offers that."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    from wcviz.digest import digest_hex
    from wcviz.sources import from_safetensors

    g = torch.Generator().manual_seed(0)
    sd = {}
    for layer in range(max(1, args.mib // 32)):
        sd[f"model.layers.{layer}.mlp.weight"] = torch.randn(4096, 4096, generator=g).to(torch.bfloat16)
        sd[f"model.layers.{layer}.norm.weight"] = torch.randn(4096, generator=g).to(torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        save_file(sd, str(path))
        whole = torch.cat([t.reshape(-1) for t in sd.values()])
        del sd
        digest_hex(whole, backend="numba")  # compile / load the kernels' cache
        from_safetensors(path, progress=False)
        kernel = _best(lambda: digest_hex(whole, backend="numba"), args.repeat)
        warm = _best(lambda: from_safetensors(path, progress=False), args.repeat)
        cold = None
        if _evict(path):
            times = []
            for _ in range(args.repeat):
                _evict(path)
                t0 = time.perf_counter()
                from_safetensors(path, progress=False)
                times.append(time.perf_counter() - t0)
            cold = min(times)
        serial, sha = _sha256_rates(path, args.repeat)
    print(f"{nbytes / 2**20:.0f} MiB checkpoint, best of {args.repeat}, {os.cpu_count()} CPU(s), torch {torch.__version__}")
    print(f"  kernel alone (one tensor of the same bytes)   {nbytes / kernel / 1e9:6.2f} GB/s  1.00x")
    print(f"  from_safetensors, file in the page cache      {nbytes / warm / 1e9:6.2f} GB/s  {kernel / warm:.2f}x")
    if cold is not None:
        print(f"  from_safetensors, file evicted (disk-bound)   {nbytes / cold / 1e9:6.2f} GB/s  {kernel / cold:.2f}x")
    print(f"  vllm-sha256, hashlib per tensor one after the other   {nbytes / serial / 1e9:6.2f} GB/s  1.00x")
    print(f"  vllm-sha256, from_safetensors (side by side)          {nbytes / sha / 1e9:6.2f} GB/s  {serial / sha:.2f}x")


def _sha256_rates(path: Path, repeat: int) -> tuple[float, float]:
    """Seconds for the checkpoint's vllm-sha256 digests: hashlib one tensor after the other, and from_safetensors."""
    import hashlib

    import numpy as np

    from wcviz.sources import from_safetensors
    from wcviz.sources._safetensors import read_header

    entries = read_header(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    one_by_one = [hashlib.sha256(mapped[e.start : e.start + e.nbytes]).hexdigest() for e in entries]
    got = from_safetensors(path, algo="vllm-sha256", progress=False)
    assert list(got["digest"]) == one_by_one, "the side-by-side digests differ from hashlib's"
    serial = _best(lambda: [hashlib.sha256(mapped[e.start : e.start + e.nbytes]).hexdigest() for e in entries], repeat)
    return serial, _best(lambda: from_safetensors(path, algo="vllm-sha256", progress=False), repeat)


if __name__ == "__main__":
    main()
