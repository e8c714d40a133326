"""Which execution ports the digest's vector instructions use on this CPU, and how full the floor keeps them.

    python benchmarks/ports.py [--chains 24]

The compute bound of ``benchmarks/cpu_digest.py`` (``floor / 6.6``) assumes the floor keeps the
vector units as busy as anything can. This script checks that directly, where no performance
counters are available (the project's VMs have none): it writes a small C program of AVX-512
intrinsics, compiles it with the system's C compiler (``cc -O2 -march=native``) and times loops of
``--chains`` independent dependency chains of one instruction each, so each loop is limited by the
instruction's throughput, not its latency. Then pairs of instructions: two that share a port take
the sum of their times, two on different ports the larger. The clock comes from a chain of
dependent scalar ``imul`` (3 cycles each on every x86 core of the last decade); times are in
cycles of it. Last, the floor's own loop (one SplitMix64 mix per 8 lanes, xor-accumulated: 12
vector µops counting a 64-bit multiply as 3) in cycles per 8 lanes, i.e. vector µops per cycle.

Needs an x86-64 CPU with AVX-512 (F, DQ) and a C compiler; says so and stops otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

OPS = {  # name: (C expression of X, what it is)
    "shift": ("_mm512_srli_epi64(X, 30)", "vpsrlq: the mix's shifts"),
    "xor": ("_mm512_xor_si512(X, c)", "vpxorq"),
    "ternlog": ("_mm512_ternarylogic_epi64(X, c, idx, 0x96)", "vpternlogq: a three-way xor"),
    "add": ("_mm512_add_epi64(X, c)", "vpaddq: the merge's sum"),
    "mul": ("_mm512_mullo_epi64(X, c)", "vpmullq: the 64-bit multiply"),
    "perm": ("_mm512_permutexvar_epi64(idx, X)", "vpermq: a transpose's shuffle"),
    "unpack": ("_mm512_unpacklo_epi64(X, c)", "vpunpcklqdq: a transpose's shuffle"),
    "shuf128": ("_mm512_shuffle_i64x2(X, c, 0x4e)", "vshufi64x2: a transpose's shuffle"),
}
PAIRS = [("shift", "perm"), ("shift", "xor"), ("xor", "perm"), ("mul", "perm"), ("mul", "shift"), ("mul", "xor")]

_PRELUDE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
volatile uint64_t sink;
#define ITERS 4000000L
static double clock_hz(void) {  /* a chain of dependent imul: 3 cycles each */
    uint64_t x = 3; double t = now();
    for (long i = 0; i < ITERS * 10; i++)
        __asm__ volatile("imul %0,%0\n\timul %0,%0\n\timul %0,%0\n\timul %0,%0" : "+r"(x));
    t = now() - t; sink = x; return ITERS * 10.0 * 4 * 3 / t;
}
"""


def _loop(name: str, body: list[str], chains: int, per_iter: int) -> str:
    """A C function timing ``ITERS`` rounds of ``body`` over ``chains`` registers; seconds per instruction."""
    lines = [f"static double b_{name}(void) {{",
             "  __m512i c = _mm512_set1_epi64(0x9E3779B97F4A7C15ULL), idx = _mm512_set_epi64(3, 7, 2, 6, 1, 5, 0, 4);",
             "  __m512i k1 = _mm512_set1_epi64(0xBF58476D1CE4E5B9ULL), k2 = _mm512_set1_epi64(0x94D049BB133111EBULL);",
             "  (void)c; (void)idx; (void)k1; (void)k2;"]
    lines += [f"  __m512i v{j} = _mm512_set1_epi64({j + 1});" for j in range(chains)]
    lines.append("  double t = now();\n  for (long i = 0; i < ITERS; i++) {")
    lines += ["    " + stmt for stmt in body]
    lines.append('    __asm__ volatile("" :: ' + ", ".join(f'"v"(v{j})' for j in range(chains)) + ");\n  }")
    lines.append("  t = now() - t; __m512i s = v0;" + "".join(f" s = _mm512_add_epi64(s, v{j});" for j in range(1, chains)))
    lines.append(f"  sink = _mm512_reduce_add_epi64(s);\n  return t / (ITERS * {per_iter}.0);\n}}")
    return "\n".join(lines)


def _source(chains: int) -> tuple[str, list[tuple[str, str]]]:
    parts, rows = [_PRELUDE], []
    for name, (expr, what) in OPS.items():
        parts.append(_loop(name, [f"v{j} = {expr.replace('X', f'v{j}')};" for j in range(chains)], chains, chains))
        rows.append((name, what))
    for a, b in PAIRS:
        body = [f"v{j} = {OPS[(a, b)[j % 2]][0].replace('X', f'v{j}')};" for j in range(chains)]
        parts.append(_loop(f"{a}_{b}", body, chains, chains))
        rows.append((f"{a}_{b}", f"{a} and {b} alternating"))
    floor_chains = max(4, chains // 2)  # the mix needs a temporary per chain
    body = []
    for j in range(floor_chains):
        x = f"v{j}"
        body += [f"{{ __m512i x = {x};",
                 "  x = _mm512_mullo_epi64(_mm512_xor_si512(x, _mm512_srli_epi64(x, 30)), k1);",
                 "  x = _mm512_mullo_epi64(_mm512_xor_si512(x, _mm512_srli_epi64(x, 27)), k2);",
                 f"  {x} = _mm512_ternarylogic_epi64(x, _mm512_srli_epi64(x, 31), {x}, 0x96); }}"]
    parts.append(_loop("floor", body, floor_chains, floor_chains))
    rows.append(("floor", "one mix per 8 lanes, xor-accumulated (12 vector µops)"))
    main = ["int main(void) {", "  double hz = clock_hz();", '  printf("clock %.3f\\n", hz / 1e9);']
    for name, _ in rows:
        main.append(f'  {{ double b = 1e9; for (int r = 0; r < 5; r++) {{ double x = b_{name}(); if (x < b) b = x; }} '
                    f'printf("{name} %.4f\\n", b * hz); }}')
    main.append("  return 0;\n}")
    return "\n".join(parts + ["\n".join(main)]), rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chains", type=int, default=24, help="independent chains per loop (at most 28: 32 registers)")
    args = ap.parse_args()
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    cc = shutil.which("cc") or shutil.which("gcc")
    if " avx512dq" not in flags or cc is None:
        print("needs an x86-64 CPU with AVX-512 (F, DQ) and a C compiler (cc); this machine has "
              + ("no C compiler" if cc is None else "no AVX-512DQ"))
        sys.exit(0)
    src, rows = _source(args.chains)
    with tempfile.TemporaryDirectory() as tmp:
        c, exe = os.path.join(tmp, "ports.c"), os.path.join(tmp, "ports")
        with open(c, "w") as f:
            f.write(src)
        subprocess.run([cc, "-O2", "-march=native", "-o", exe, c], check=True)
        out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout.split("\n")
    got = dict(line.split() for line in out if line.strip())
    print(f"clock {float(got.pop('clock')):.2f} GHz (from dependent imul), {args.chains} independent chains per loop\n")
    print("| loop | what | cycles per instruction |")
    print("|---|---|---:|")
    for name, what in rows[:-1]:
        print(f"| {name} | {what} | {float(got[name]):.2f} |")
    floor = float(got["floor"])  # per mix of one chain: 8 lanes
    print(f"\nfloor loop: {floor:.2f} cycles per mix of 8 lanes = {12 / floor:.2f} vector µops per cycle (12 per mix)")


if __name__ == "__main__":
    main()
