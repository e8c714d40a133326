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

A warm rate depends on how the file came into the page cache: where the OS keeps a file in
2 MiB folios (Linux 6.x on ext4 and others) a mapping takes one fault per 2 MiB and huge TLB
entries, in 4 KiB pages one fault per 64 KiB. So the warm reader is timed twice more after
the evicted runs, the cache as its own cold read left it: once reading with the advice the
reader gave before (``MADV_SEQUENTIAL`` only; its rows walk the file in an order that makes
readahead choose small folios), once with the reader's advice (``MADV_HUGEPAGE`` too), each
with the minor faults of one pass over the file and the share of it mapped in 2 MiB pieces.

``--parts`` then says where the warm reader's time goes, each part timed in alternation
(one run of each per round, best of ``--repeat`` rounds): the kernel on one tensor of the
bytes, the kernel per tensor on anonymous memory, the kernel per tensor on numpy views
of the mapped file and nothing else, the same views in one batched call (what the reader
does with each window of them), ``safetensors_rows`` (the reader without the frame), the
same with a kernel call per tensor (what it did before it batched them), ``from_safetensors``; and the kernel on anonymous memory in huge pages against
4 KiB pages (``MADV_NOHUGEPAGE``), the page size the page cache is mapped with.
"""

from __future__ import annotations

import argparse
import contextlib
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
    ap.add_argument("--parts", action="store_true", help="also time the reader's parts in alternation")
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
        pair = {"kernel": lambda: digest_hex(whole, backend="numba"), "reader": lambda: from_safetensors(path, progress=False)}
        warm = {"as the writer left it": (_alternating(pair, args.repeat), _cache_state(path))}
        cold = None
        if _evict(path):
            times = []
            for _ in range(args.repeat):
                _evict(path)
                t0 = time.perf_counter()
                from_safetensors(path, progress=False)
                times.append(time.perf_counter() - t0)
            cold = min(times)
            for label, advice in (("as a cold read with MADV_SEQUENTIAL only (the advice before) left it", _sequential_only),
                                  ("as a cold read with the reader's advice left it", None)):
                _evict(path)
                with _advice(advice):
                    from_safetensors(path, progress=False)  # the cold read that fills the page cache
                warm[label] = (_alternating(pair, args.repeat), _cache_state(path))
        serial, sha = _sha256_rates(path, args.repeat)
        parts = _parts(path, whole, args.repeat) if args.parts else None
    kernel = warm["as the writer left it"][0]["kernel"]
    print(f"{nbytes / 2**20:.0f} MiB checkpoint, best of {args.repeat}, {os.cpu_count()} CPU(s), torch {torch.__version__}")
    print(f"  kernel alone (one tensor of the same bytes)   {nbytes / kernel / 1e9:6.2f} GB/s  1.00x")
    if cold is not None:
        print(f"  from_safetensors, file evicted (disk-bound)   {nbytes / cold / 1e9:6.2f} GB/s  {kernel / cold:.2f}x")
    print("\nfrom_safetensors with the file in the page cache, timed in alternation with the kernel alone")
    print("| page cache | GB/s | x kernel (same rounds) | minor faults per pass | mapped in 2 MiB pieces |")
    print("|---|---:|---:|---:|---:|")
    for label, (best, (faults, pmd)) in warm.items():
        print(f"| {label} | {nbytes / best['reader'] / 1e9:.2f} | {best['kernel'] / best['reader']:.2f}x | {faults} | {pmd:.0%} |")
    print()
    print(f"  vllm-sha256, hashlib per tensor one after the other   {nbytes / serial / 1e9:6.2f} GB/s  1.00x")
    print(f"  vllm-sha256, from_safetensors (side by side)          {nbytes / sha / 1e9:6.2f} GB/s  {serial / sha:.2f}x")
    if parts is not None:
        print(f"\nwhere the warm reader's time goes, in alternation, best of {args.repeat} rounds")
        print("| what | GB/s | x kernel |")
        print("|---|---:|---:|")
        for label, seconds in parts.items():
            print(f"| {label} | {nbytes / seconds / 1e9:.2f} | {parts['kernel on one tensor of the bytes'] / seconds:.2f}x |")
        pages = _page_sizes(args.repeat)
        print("\nthe kernel on 1 GiB of anonymous memory: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in pages.items()))


def _alternating(runs, repeat: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Best seconds of each of ``runs``, one timed run of each per round (a slow minute of the host hits all of
    them), each after an untimed run of the same: on this project's VMs the first run after another kind of
    work is the slower one, whatever it is, which would favour whichever comes second."""
    best = {k: float("inf") for k in runs}
    for _ in range(repeat):
        for k, fn in runs.items():
            fn()
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def _sequential_only(mm) -> None:  # type: ignore[no-untyped-def]
    import mmap

    mm.madvise(mmap.MADV_SEQUENTIAL)


@contextlib.contextmanager
def _advice(advise):  # type: ignore[no-untyped-def]
    """The reader's mapping advice replaced by ``advise`` for the block (None: left as it is)."""
    from wcviz.sources import _safetensors

    kept = _safetensors._advise
    if advise is not None:
        _safetensors._advise = advise
    try:
        yield
    finally:
        _safetensors._advise = kept


def _cache_state(path: Path) -> tuple[int, float]:
    """Minor faults of one pass over the file through a fresh mapping (one read per 4 KiB page, no advice), and the
    share of the file that mapping held in 2 MiB pieces (``FilePmdMapped`` of ``/proc/self/smaps``; 0 where absent)."""
    import mmap
    import resource

    import numpy as np

    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        data = np.frombuffer(mm, dtype=np.uint8)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        int(data[::4096].sum())
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        pmd_kib = _pmd_mapped_kib(data.ctypes.data)
        del data
        mm.close()
    return faults, pmd_kib * 1024 / max(1, path.stat().st_size)


def _pmd_mapped_kib(address: int) -> int:
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            inside = lo <= address < hi
        elif inside and head[:1] == ["FilePmdMapped:"]:
            return int(head[1])
    return 0


def _parts(path: Path, whole, repeat: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Best seconds of each part of the warm reader, timed in alternation."""
    import mmap

    import numpy as np

    from wcviz.digest import _spec
    from wcviz.digest._numba import lanes_digest
    from wcviz.sources import from_safetensors, safetensors_rows
    from wcviz.sources._safetensors import read_header

    entries = read_header(path)
    seeds = [_spec.seeds(f"torch.{e.dtype}", e.shape, e.nbytes) for e in entries]
    lanes = whole.view(-1).view(__import__("torch").int64).numpy().view(np.uint64)
    offsets = np.cumsum([0] + [e.nbytes // 8 for e in entries])
    anon = [lanes[offsets[i] : offsets[i + 1]] for i in range(len(entries))]

    import ctypes
    import resource

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    faults: dict[str, int] = {}

    def mapped_loop(populate: bool = False) -> None:
        label = "populated" if populate else "faulted"
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            data = np.frombuffer(mm, dtype=np.uint8)
            base = data.ctypes.data
            for e, seed in zip(entries, seeds):
                if populate:  # MADV_POPULATE_READ (22, Linux 5.14): the tensor's pages mapped in one call first
                    start = (base + e.start) & ~4095
                    libc.madvise(start, base + e.start + e.nbytes - start, 22)
                lanes_digest(data[e.start : e.start + e.nbytes].view(np.uint64), seed)
            del data
            _close(mm)
        faults[label] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    def mapped_batch() -> None:  # what the reader does with each window of views: one kernel call for all of them
        from wcviz.digest._numba import lanes_digest_at

        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            data = np.frombuffer(mm, dtype=np.uint8)
            views = [data[e.start : e.start + e.nbytes] for e in entries]
            lanes_digest_at(np.array([v.ctypes.data for v in views], dtype=np.uint64), np.array([v.nbytes for v in views]),
                            np.array(seeds, dtype=np.uint64), views)
            del data, views
            _close(mm)

    runs = {
        "kernel on one tensor of the bytes": lambda: lanes_digest(lanes, (1, 2)),
        "kernel per tensor, anonymous memory": lambda: [lanes_digest(a, s) for a, s in zip(anon, seeds)],
        "kernel per tensor, views of the mapped file": mapped_loop,
        "the same, each tensor's pages populated first (MADV_POPULATE_READ)": lambda: mapped_loop(populate=True),
        "views of the mapped file, all in one batched call (lanes_digest_at)": mapped_batch,
        "safetensors_rows (the reader, no frame)": lambda: safetensors_rows(path, progress=False),
        "the same, one kernel call per tensor (as before its windows)": lambda: _one_window(0, lambda: safetensors_rows(path, progress=False)),
        "from_safetensors": lambda: from_safetensors(path, progress=False),
    }
    best = _alternating(runs, repeat)
    print(f"minor page faults per pass over the mapped file: {faults}")
    return best


def _close(mm) -> None:  # type: ignore[no-untyped-def]
    """Close a map whose views are gone; once a run saw one still exported until a garbage collection."""
    import gc

    try:
        mm.close()
    except BufferError:
        gc.collect()
        mm.close()


def _one_window(window: int, fn):  # type: ignore[no-untyped-def]
    """``fn()`` with the reader's batches of views cut to ``window`` bytes (0: a kernel call per tensor)."""
    from wcviz.digest import _buffers

    before = _buffers.WINDOW_BYTES
    _buffers.WINDOW_BYTES = window
    try:
        return fn()
    finally:
        _buffers.WINDOW_BYTES = before


def _page_sizes(repeat: int) -> dict[str, float]:
    """GB/s of the kernel on 1 GiB of anonymous memory in huge pages and in 4 KiB pages, in alternation."""
    import mmap

    import numpy as np

    from wcviz.digest._numba import lanes_digest

    n = 1 << 30
    arrays = {}
    for label, advice in (("huge pages", getattr(mmap, "MADV_HUGEPAGE", None)), ("4 KiB pages", getattr(mmap, "MADV_NOHUGEPAGE", None))):
        mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if advice is not None:
            mm.madvise(advice)
        a = np.frombuffer(mm, dtype=np.uint64)
        a[:] = np.arange(a.size, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        arrays[label] = a
    best = {k: float("inf") for k in arrays}
    for _ in range(repeat + 1):
        for k, a in arrays.items():
            t0 = time.perf_counter()
            lanes_digest(a, (1, 2))
            best[k] = min(best[k], time.perf_counter() - t0)
    return {k: n / v / 1e9 for k, v in best.items()}


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
