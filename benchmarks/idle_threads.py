"""CPU a host process pays between digests for OpenMP threads that spin when idle (libgomp's default).

    python benchmarks/idle_threads.py                          # as the host is configured
    OMP_WAIT_POLICY=PASSIVE python benchmarks/idle_threads.py  # every OpenMP pool in it sleeps when idle

A host (a trainer, an engine) digests a 4 MiB tensor, then does 2 ms of its own single-threaded
work, 300 times. Reported: wall time, this process's CPU time, and the CPU beyond what the work
itself needs (the digests' share measured alone, plus the host's 2 ms each time).
"""

from __future__ import annotations

import os
import resource
import time

import torch

from wcviz.digest import digest_hex


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def host_work(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    x = torch.randn(1 << 20)
    digest_hex(x)
    n = 300
    c0, t0 = cpu(), time.perf_counter()
    for _ in range(n):
        digest_hex(x)
    digests_cpu, digests_wall = cpu() - c0, time.perf_counter() - t0
    c0, t0 = cpu(), time.perf_counter()
    for _ in range(n):
        digest_hex(x)
        host_work(0.002)
    wall, used = time.perf_counter() - t0, cpu() - c0
    extra = used - digests_cpu - n * 0.002
    print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')} GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '(unset)')}")
    print(f"{n} digests alone: {digests_wall:.3f} s wall, {digests_cpu:.3f} s CPU")
    print(f"{n} x (digest + 2 ms of host work): {wall:.3f} s wall, {used:.3f} s CPU, "
          f"{extra:.3f} s CPU beyond the digests and the host's work ({extra / (n * 0.002):.0%} of the host's work)")


if __name__ == "__main__":
    main()
