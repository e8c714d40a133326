"""What the compiled CPU kernel asks of the vector ports, per step, against what the compute bound prices.

    python benchmarks/kernel_uops.py

Compiles ``_fold_group`` afresh (no numba cache), finds its two hot inner loops in the machine
code (the leaf step, whose loads are transposed, and the upper step, which reads a scratch
row) and counts their vector instructions. Each loop iteration is one two-level step on
16 blocks x 4 positions x 2 channels. A 64-bit vector multiply is counted as 3 µops
(``vpmullq`` on Intel's AVX-512 cores), everything else as 1.

The bound (``floor / 6.6``) prices a lane at 6.6 mixes of the floor, a mix being 12 vector
µops (two multiplies, three shifts, three xors); a leaf step does 3/4 of the merges of its
64 lanes, an upper step the same work on 64 positions. So the share of the bound a step can
reach *at most*, issuing at the floor's own rate with no memory cost, is the bound's µops
over the step's µops. Printed twice, a bracket: every µop at full price, and shuffles at
half (they issue on one of the two vector ports only, so part of their cost may hide).
AVX2 hosts compile another layout; the counts are then of that layout.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import tempfile

os.environ.setdefault("NUMBA_CACHE_DIR", tempfile.mkdtemp(prefix="wcviz-uops-"))

import numpy as np  # noqa: E402

from wcviz.digest import _numba as K  # noqa: E402
from wcviz.digest._simd import SPLIT_MUL  # noqa: E402

SHUFFLES = re.compile(r"^v(perm|shuf|insert|extract|unpck|punpck|align|pshufd|broadcast|blend|pblend|movddup|pexpand|pcompress)")
ARITH = ("vpmullq", "vpsrlq", "vpxorq", "vpternlogq", "vpaddq", "vpmulld", "vpmuludq", "vpsllq", "vpandq", "vpand", "vpxor", "vpaddd")
MUL_UOPS = {"vpmullq": 3}


def loops(asm: str) -> list[list[str]]:
    """The bodies of the loops in ``asm``: from a label to the backward jump to it (an outer loop's body
    holds the labels of its inner loops)."""
    lines = [line.strip() for line in asm.splitlines()]
    where = {line[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\.LBB\d+_\d+:", line)}
    found = []
    for i, line in enumerate(lines):
        m = re.match(r"j\w+\s+(\.LBB\d+_\d+)$", line)
        if m and m.group(1) in where and where[m.group(1)] < i:
            found.append(lines[where[m.group(1)] + 1 : i + 1])
    return found


def count(body: list[str]) -> collections.Counter[str]:
    return collections.Counter(line.split()[0] for line in body if line and not line.startswith((".", "#")))


def main() -> int:
    lanes = np.random.default_rng(0).integers(0, 2**63, K.GROUP * K.BLOCK, dtype=np.uint64)
    K._digest_serial(lanes, np.uint64(1), np.uint64(2))  # compile for this host
    asm = K._fold_group.inspect_asm(K._fold_group.signatures[0])
    innermost = [body for body in loops(asm) if not any(re.fullmatch(r"\.LBB\d+_\d+:", line) for line in body)]
    steps = [c for c in map(count, innermost) if c["vpmullq"] + c["vpmulld"] >= 20]
    if len(steps) < 2:
        print("could not find the two step loops in the machine code (another layout or compiler?)")
        return 1
    leaf = max(steps, key=lambda c: sum(n for op, n in c.items() if SHUFFLES.match(op)))
    upper = min(steps, key=lambda c: sum(n for op, n in c.items() if SHUFFLES.match(op)))
    lanes_per_step = K.GROUP * 4
    bound = 0.75 * 6.6 * lanes_per_step / 8 * 12  # the bound's µops for the merges of one step (3/4 of its lanes')
    print(f"GROUP {K.GROUP}, {lanes_per_step} lanes per step; the bound prices a step at {bound:.0f} vector µops\n")
    if SPLIT_MUL:
        print("note: this host has no 64-bit vector multiply (it is built from 32-bit ones); the prices below assume AVX-512's\n")
    print("| step | multiplies | shifts | xor / ternlog | adds | shuffles | vector µops | most of the bound | shuffles at half |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    totals = {}
    for label, c in (("leaf (transposed loads)", leaf), ("upper (scratch rows)", upper)):
        muls = c["vpmullq"] + c["vpmulld"] + c["vpmuludq"]
        shuffles = sum(n for op, n in c.items() if SHUFFLES.match(op))
        arith = sum(n * MUL_UOPS.get(op, 1) for op, n in c.items() if op in ARITH)
        uops = arith + shuffles
        totals[label] = (uops, uops - shuffles / 2)
        print(
            f"| {label} | {muls} | {c['vpsrlq']} | {c['vpxorq'] + c['vpternlogq']} | {c['vpaddq']} | {shuffles} | {uops} "
            f"| {bound / uops:.1%} | {bound / (uops - shuffles / 2):.1%} |"
        )
    (lu, lh), (uu, uh) = totals.values()
    whole = bound * 4 / 3  # a fold: the leaf steps, then a third as much work above them
    print(f"\nwhole fold (leaf steps + a third as much upper work): at most {whole / (lu + uu / 3):.1%} "
          f"of the bound, {whole / (lh + uh / 3):.1%} with shuffles at half, before memory and scheduling")
    return 0


if __name__ == "__main__":
    sys.exit(main())
