"""CPU digest throughput, side by side in one process: the numbers in BENCHMARKS.md.

    python benchmarks/cpu_digest.py [--sizes-mib 64 512] [--repeat 3]

Every method reads the same float32 tensor of random values. Reported GB/s is
bytes / best wall time over ``--repeat`` runs (after a warm-up that compiles
the numba kernel). Ratios are against the eager torch reference, measured in
the same run. The fast path is checked bit-identical to the reference first.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import numpy as np
import torch

from wcviz.digest import digest_hex
from wcviz.digest import _numba


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--reference-repeat", type=int, default=2, help="runs of the (slow) torch reference")
    args = ap.parse_args()

    import numba
    import xxhash

    cores = numba.config.NUMBA_NUM_THREADS
    print(f"Machine: {platform.machine()}, {cores} cores, torch {torch.__version__}, numba {numba.__version__}, "
          f"torch threads {torch.get_num_threads()}")
    digest_hex(torch.zeros(4096), backend="numba")  # compile / load the kernel cache
    print("| size | method | GB/s | × torch reference |")
    print("|---:|---|---:|---:|")
    for mib in args.sizes_mib:
        x = torch.from_numpy(np.random.default_rng(0).standard_normal(mib * 2**20 // 4, dtype=np.float32))
        assert digest_hex(x, backend="numba") == digest_hex(x, backend="torch"), "backends disagree"
        view = x.numpy()
        methods: dict[str, Callable[[], object]] = {
            "torch eager reference": lambda x=x: digest_hex(x, backend="torch"),
            f"numba fast path ({cores} threads)": lambda x=x: digest_hex(x, backend="numba"),
            "numba fast path (1 thread)": lambda x=x: digest_hex(x, backend="numba"),
            "xxh3_128 (1 thread)": lambda v=view: xxhash.xxh3_128(v).hexdigest(),
            "memory pass (numpy sum of uint64)": lambda v=view: v.view(np.uint64).sum(),
        }
        results = {}
        for label, fn in methods.items():
            threads = 1 if "(1 thread)" in label and "numba" in label else cores
            _numba.set_threads(threads)
            fn()  # warm
            rep = args.reference_repeat if label.startswith("torch") else args.repeat
            results[label] = x.nbytes / best_seconds(fn, rep) / 1e9
        _numba.set_threads(cores)
        ref = results["torch eager reference"]
        for label, gbs in results.items():
            print(f"| {mib} MiB | {label} | {gbs:.3f} | {gbs / ref:.1f}× |")


if __name__ == "__main__":
    main()
