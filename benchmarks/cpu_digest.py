"""CPU digest throughput, side by side in one process: the numbers in BENCHMARKS.md.

    python benchmarks/cpu_digest.py [--sizes-mib 64 512] [--repeat 3] [--reference-repeat 2]

Every method reads the same float32 tensor of random values. Reported GB/s is
bytes / best wall time over ``--repeat`` runs (after a warm-up that compiles
the numba kernels). Ratios are against the eager torch reference and xxh3_128,
measured in the same run. The fast path is checked bit-identical to the
reference first.

The compute bound: ``floor_rate`` times one SplitMix64 mix per 64-bit lane of
an in-cache array, with the kernel's own vector arithmetic, on 1 thread and on
all. A digest needs about 6.6 times that work per lane (6 mixes and 2 extra
multiplies, both channels), so ``bound = floor GB/s / 6.6``; the fast path is
reported as a percentage of it. Floor and fast path are timed in alternation
(best of each over several rounds), as the machine's speed drifts.

Then many small tensors (Llama-like norms and biases): before batching, one
call per tensor (the public ``digest_hex``, and the bare kernel
``lanes_digest``); after, ``digest_many`` (the public path, which now batches
host tensors up to 1 MiB) and one bare ``lanes_digest_many`` call (packing
included). Each of these takes about a millisecond, so each is the best of at
least 30 runs (of 5 it moved by a third from run to run).
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import numpy as np
import torch

from wcviz.digest import _floor, _numba, _simd, _spec, digest_hex, digest_many

WORK_PER_LANE = 6.6  # floor mixes per digested lane (see the docstring)


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def throughput(args: argparse.Namespace, cores: int) -> dict[int, torch.Tensor]:
    import xxhash

    print("| size | method | GB/s | × torch reference | × xxh3_128 |")
    print("|---:|---|---:|---:|---:|")
    fast: dict[int, torch.Tensor] = {}
    for mib in args.sizes_mib:
        x = torch.from_numpy(np.random.default_rng(0).standard_normal(mib * 2**20 // 4, dtype=np.float32))
        assert digest_hex(x, backend="numba") == digest_hex(x, backend="torch"), "backends disagree"
        view = x.numpy()
        methods: dict[str, tuple[int, Callable[[], object]]] = {
            "torch eager reference": (cores, lambda x=x: digest_hex(x, backend="torch")),
            f"numba fast path ({cores} threads)": (cores, lambda x=x: digest_hex(x, backend="numba")),
            "numba fast path (1 thread)": (1, lambda x=x: digest_hex(x, backend="numba")),
            "xxh3_128 (1 thread)": (cores, lambda v=view: xxhash.xxh3_128(v).hexdigest()),
            "memory pass (numpy sum of uint64)": (cores, lambda v=view: v.view(np.uint64).sum()),
        }
        results = {}
        for label, (threads, fn) in methods.items():
            _numba.set_threads(threads)
            fn()  # warm
            rep = args.reference_repeat if label.startswith("torch") else args.repeat
            results[label] = x.nbytes / best_seconds(fn, rep) / 1e9
        _numba.set_threads(cores)
        ref, xxh = results["torch eager reference"], results["xxh3_128 (1 thread)"]
        for label, gbs in results.items():
            print(f"| {mib} MiB | {label} | {gbs:.3f} | {gbs / ref:.1f}× | {gbs / xxh:.2f}× |")
        fast[mib] = x
    return fast


def compute_bound(tensors: dict[int, torch.Tensor], cores: int, rounds: int) -> None:
    """Floor and fast path measured in alternation (best of each), so that both see the same machine."""
    print()
    sizes = list(tensors)
    head = " | ".join(f"fast path {mib} MiB GB/s | % of bound" for mib in sizes)
    print(f"| threads | compute floor: mix GB/s | compute bound GB/s (floor / {WORK_PER_LANE}) | {head} |")
    print("|---:|---:|---:|" + "---:|---:|" * len(sizes))
    for threads in (1, cores):
        floor = 0.0
        fast = dict.fromkeys(sizes, 0.0)
        for _ in range(rounds):
            floor = max(floor, _floor.floor_rate(threads, seconds=0.1) * 8 / 1e9)
            _numba.set_threads(threads)
            for mib, x in tensors.items():
                # best of 3 back to back, as floor_rate takes the best of its runs: the first call after
                # the thread count changed also pays for waking the pool
                fast[mib] = max(fast[mib], x.nbytes / best_seconds(lambda x=x: digest_hex(x, backend="numba"), 3) / 1e9)
            _numba.set_threads(cores)
        bound = floor / WORK_PER_LANE
        cells = " | ".join(f"{fast[mib]:.3f} | {100 * fast[mib] / bound:.0f}%" for mib in sizes)
        print(f"| {threads} | {floor:.2f} | {bound:.3f} | {cells} |")


def small_tensors(args: argparse.Namespace, cores: int) -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = [(4096,)] * 400 + [(1024,)] * 100 + [(3,)] * 50
    tensors = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def lanes_of(t: torch.Tensor) -> np.ndarray:
        raw = t.contiguous().view(torch.uint8).numpy()
        buf = np.zeros((raw.size + 7) // 8 * 8, np.uint8)
        buf[: raw.size] = raw
        return buf.view(np.uint64)

    lanes = [lanes_of(t) for t in tensors]
    seeds = [_spec.seeds(str(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for t in tensors]

    def public() -> list[str]:
        return [digest_hex(t, backend="numba") for t in tensors]

    named = {f"t{i}": t for i, t in enumerate(tensors)}

    def public_batched() -> list[str]:
        return list(digest_many(named, backend="numba").values())

    def one_call_each() -> list[tuple[int, int]]:
        return [_numba.lanes_digest(x, s) for x, s in zip(lanes, seeds)]

    def batched() -> np.ndarray:
        counts = np.fromiter((x.size for x in lanes), np.int64, len(lanes))
        starts = np.zeros_like(counts)
        np.cumsum(counts[:-1], out=starts[1:])
        packed = np.concatenate(lanes)
        return _numba.lanes_digest_many(packed, starts, counts, np.array(seeds, dtype=np.uint64))

    want = [_spec.hex_of(*w) for w in one_call_each()]
    assert public() == want and public_batched() == want, "public path disagrees"
    assert [_spec.hex_of(int(a), int(b)) for a, b in batched()] == want, "batch kernel disagrees"
    methods = {
        "before: `digest_hex` per tensor (public path, one kernel call each)": public,
        "after: `digest_many` (public path, batched)": public_batched,
        "`lanes_digest` per tensor (bare kernel call)": one_call_each,
        "one `lanes_digest_many` call (pack + kernel)": batched,
    }
    times = {label: best_seconds(fn, max(30, args.repeat)) for label, fn in methods.items()}  # ~1 ms each: best of many
    print()
    print(f"Small tensors: {len(tensors)} bf16 tensors (400 × 4096, 100 × 1024, 50 × 3 elements), "
          f"{nbytes / 2**20:.2f} MiB, {cores} threads")
    print()
    print("| method | ms | tensors/s | GB/s | × one `lanes_digest_many` call |")
    print("|---|---:|---:|---:|---:|")
    batch = times["one `lanes_digest_many` call (pack + kernel)"]
    for label, sec in times.items():
        print(f"| {label} | {sec * 1e3:.2f} | {len(tensors) / sec:,.0f} | {nbytes / sec / 1e9:.3f} | {sec / batch:.1f}× slower |"
              if sec != batch else f"| {label} | {sec * 1e3:.2f} | {len(tensors) / sec:,.0f} | {nbytes / sec / 1e9:.3f} | 1.0× |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--reference-repeat", type=int, default=2, help="runs of the (slow) torch reference")
    args = ap.parse_args()

    import numba

    cores = numba.config.NUMBA_NUM_THREADS
    print(f"Machine: {platform.machine()}, {cores} cores, torch {torch.__version__}, numba {numba.__version__}, "
          f"torch threads {torch.get_num_threads()}, split 64-bit multiply: {_simd.SPLIT_MUL}, "
          f"AVX-512: {_simd.WIDE}, blocks side by side: {_numba.GROUP}")
    print()
    digest_hex(torch.zeros(4096), backend="numba")  # compile / load the kernel cache
    fast = throughput(args, cores)
    compute_bound(fast, cores, rounds=max(6, 2 * args.repeat))
    small_tensors(args, cores)


if __name__ == "__main__":
    main()
