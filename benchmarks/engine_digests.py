"""What the engines' own checksums cost on the CPU, side by side in one process.

    python benchmarks/engine_digests.py [--mib 256] [--repeat 5]

One bf16 tensor of ``--mib`` MiB, best of ``--repeat``: ``sglang-gpu`` (SGLang's Triton
tensor hash) in wcviz's compiled numba kernel, in its vectorised torch path (what runs
on CUDA, here on the CPU) and in the plain numpy transcription the tests hold both to;
``vllm-sha256`` / ``sglang-cpu`` (hashlib SHA-256 of the bytes, as the engines compute
them); and wcviz's own ``nemo-rl-v3`` (numba). The reference for the ratios is
hashlib's SHA-256 over the same bytes: the engines' CPU path.

Then each algorithm against its own bound, measured in the same run: its compute bound is
the same computation over 1 MiB that stays in cache (called again and again: no memory
traffic; for SHA-256, hashlib on one core, as SHA-256 of one stream cannot be split), its
memory bound one pass of numpy over the big tensor's bytes; the big tensor's rate is
reported as a percentage of the lower of the two.

Then why one SHA-256 stream reads below its in-cache rate: hashlib over the big tensor
in one call, in pieces of 64 KiB, each 512 KiB piece first copied into a buffer that
stays in L2, and 1 MiB in cache.

Last, many tensors (``--tensors`` of ``--mib / --tensors`` MiB each, the same bytes): one
SHA-256 stream cannot be split, but tensors can run side by side. The public
``digest_many`` (threads: the digest kernel's count) against hashlib one tensor after
the other, and against hashlib on one thread per CPU by hand (the bound for this).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from collections.abc import Callable
from typing import Any


def _best(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # compile / warm
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tensors", type=int, default=8, help="tensors the big one is cut into for the many-tensor table")
    args = ap.parse_args()

    import torch

    from wcviz.digest import digest_hex, reference_sglang_gpu
    from wcviz.digest._engines import sglang_gpu_words

    t = torch.randn(args.mib * (1 << 20) // 2, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    raw = t.view(torch.uint8).numpy()
    nbytes = raw.nbytes
    small = raw[: 16 << 20]  # the numpy reference is slow: timed on 16 MiB
    runs = {
        "hashlib sha256 (vllm-sha256, sglang-cpu): the reference": (lambda: hashlib.sha256(raw).hexdigest(), nbytes),
        "sglang-gpu, numba kernel (wcviz on CPU)": (lambda: digest_hex(t, algo="sglang-gpu"), nbytes),
        "sglang-gpu, torch path (what runs on CUDA)": (lambda: sglang_gpu_words(t), nbytes),
        "sglang-gpu, numpy transcription (16 MiB)": (lambda: reference_sglang_gpu(small), small.nbytes),
        "nemo-rl-v3, numba": (lambda: digest_hex(t, backend="numba"), nbytes),
    }
    print(f"{args.mib} MiB bf16, best of {args.repeat}, {os.cpu_count()} CPU(s), torch {torch.__version__}")
    ref = None
    for label, (fn, n) in runs.items():
        gbps = n / _best(fn, args.repeat) / 1e9
        ref = gbps if ref is None else ref
        print(f"  {label:<58} {gbps:6.2f} GB/s  {gbps / ref:5.2f}x")
    bounds(t, args.repeat)
    stream(t, args.repeat)
    many(t, args.tensors, args.repeat)


def stream(t: Any, repeat: int) -> None:
    """One SHA-256 stream over the big tensor: whole, in pieces, copied to L2 piece by piece, and in cache."""
    import numpy as np
    import torch

    raw = t.view(torch.uint8).numpy()
    want = hashlib.sha256(raw).hexdigest()

    def pieces(step: int) -> str:
        h = hashlib.sha256()
        for i in range(0, raw.shape[0], step):
            h.update(raw[i : i + step])
        return h.hexdigest()

    def copied(step: int = 1 << 19) -> str:
        h = hashlib.sha256()
        scratch = np.empty(step, dtype=np.uint8)
        for i in range(0, raw.shape[0], step):
            piece = raw[i : i + step]
            if piece.shape[0] == step:
                np.copyto(scratch, piece)
                h.update(scratch)
            else:
                h.update(piece)
        return h.hexdigest()

    assert pieces(1 << 16) == copied() == want
    hot = raw[: 1 << 20].copy()
    runs = {
        "one call (what the engines do)": (lambda: hashlib.sha256(raw).hexdigest(), raw.nbytes),
        "pieces of 64 KiB": (lambda: pieces(1 << 16), raw.nbytes),
        "each 512 KiB piece copied into an L2 buffer, then hashed": (copied, raw.nbytes),
        "1 MiB in cache, 64 times": (lambda: [hashlib.sha256(hot).digest() for _ in range(64)], 64 * hot.nbytes),
    }
    print("\none SHA-256 stream over the big tensor, one thread")
    print("| how | GB/s |")
    print("|---|---:|")
    for label, (fn, n) in runs.items():
        print(f"| {label} | {n / _best(fn, repeat) / 1e9:.2f} |")


def many(t: Any, count: int, repeat: int) -> None:
    """SHA-256 over ``count`` tensors: one after the other, ``digest_many``, and one thread per CPU by hand."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from wcviz.digest import digest_many
    from wcviz.digest._pool import host_threads

    parts = {f"t{i}": p.clone() for i, p in enumerate(t.chunk(count))}
    raws = [p.view(torch.uint8).numpy() for p in parts.values()]
    nbytes = sum(r.nbytes for r in raws)
    threads = host_threads()
    with ThreadPoolExecutor(threads) as pool:
        runs = {
            "hashlib, one tensor after the other (before)": lambda: [hashlib.sha256(r).hexdigest() for r in raws],
            f"hashlib, {threads} threads by hand (the bound)": lambda: list(pool.map(lambda r: hashlib.sha256(r).hexdigest(), raws)),
            "digest_many(algo='vllm-sha256')": lambda: digest_many(parts, algo="vllm-sha256"),
            "digest_many(algo='sglang-cpu')": lambda: digest_many(parts, algo="sglang-cpu"),
        }
        print(f"\n{count} tensors of {nbytes / count / (1 << 20):.0f} MiB, {threads} thread(s) for host hashes")
        print("| how | GB/s | x one after the other |")
        print("|---|---:|---:|")
        ref = None
        for label, fn in runs.items():
            gbps = nbytes / _best(fn, repeat) / 1e9
            ref = gbps if ref is None else ref
            print(f"| {label} | {gbps:.2f} | {gbps / ref:.2f}x |")


def bounds(t: Any, repeat: int) -> None:
    """Each algorithm's streaming rate as a share of min(its in-cache rate, one memory pass)."""
    import numpy as np
    import torch

    from wcviz.digest import digest_hex

    hot = t[: (1 << 20) // 2].clone()  # 1 MiB of bf16: stays in this machine's L2
    lanes = t.view(torch.uint8).numpy().view(np.uint64)
    memory = lanes.nbytes / _best(lambda: np.bitwise_xor.reduce(lanes), repeat) / 1e9
    calls = 64
    print(f"\nagainst their bounds (memory pass {memory:.2f} GB/s; in cache: 1 MiB digested {calls} times per run)")
    print("| algorithm | streaming GB/s | in cache GB/s | bound GB/s | % of bound |")
    print("|---|---:|---:|---:|---:|")
    for algo in ("vllm-sha256", "sglang-cpu", "sglang-gpu", "nemo-rl-v3"):
        streaming = t.numel() * 2 / _best(lambda a=algo: digest_hex(t, algo=a), repeat) / 1e9

        def in_cache(a: str = algo) -> None:
            for _ in range(calls):
                digest_hex(hot, algo=a)

        cached = calls * hot.numel() * 2 / _best(in_cache, repeat) / 1e9
        bound = min(cached, memory)
        print(f"| {algo} | {streaming:.2f} | {cached:.2f} | {bound:.2f} | {streaming / bound:.0%} |")


if __name__ == "__main__":
    main()
