"""The numba kernels against the torch reference, at every structural boundary.

Boundaries of the fast path: chunks narrower than ``4 * GROUP`` lanes are
folded by scalar code; up to ``GROUP * BLOCK`` lanes a chunk is one group of
``GROUP`` smaller blocks; above that, groups of ``GROUP`` blocks of ``BLOCK``
lanes, whole groups past the data being all-zero subtrees; and ``CHUNK``.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
import numba
from numba import njit

from wcviz.digest import _floor, _numba, _simd, _spec, _torch, digest_hex, set_digest_threads

B, G, C, SUB = _numba.BLOCK, _numba.GROUP, _spec.CHUNK, _numba._SUB
SMALL = 4 * G  # narrowest chunk the vector kernel folds
SIZES = sorted(
    {0, 1, 2, 3, 4, 5}
    | {SMALL // 2 + d for d in (-1, 0, 1)}  # scalar / vector switch: widths 16 and 32
    | {SMALL + d for d in (-1, 0, 1)}
    | {B + d for d in (-1, 0, 1)}
    | {G * B + d for d in (-1, 0, 1)}  # one group of full blocks / several groups
    | {2 * G * B + 3, 5 * G * B - 7}
    | {G * SUB * m + d for m in (1, 2, 4, 8) for d in (-3, 1)}  # blocks of 1 to 16 sub-blocks
    | {C - 1, C, C + 1, 3 * C + 5}
)


def _random_lanes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)


def _reference(lanes: np.ndarray, seed: tuple[int, int]) -> tuple[int, int]:
    words = _torch.lanes_digest(torch.from_numpy(lanes.view(np.int64)), seed).tolist()
    return words[0] & _spec.MASK64, words[1] & _spec.MASK64


def _seed(i: int) -> tuple[int, int]:
    rng = np.random.default_rng(1000 + i)
    return int(rng.integers(0, 2**63)) * 2 + 1, int(rng.integers(0, 2**63))


@pytest.fixture(scope="module")
def cases() -> list[tuple[np.ndarray, tuple[int, int], tuple[int, int]]]:
    out = []
    for i, n in enumerate(SIZES):
        lanes, seed = _random_lanes(n, i), _seed(i)
        out.append((lanes, seed, _reference(lanes, seed)))
    return out


def test_sizes_cover_the_boundaries() -> None:
    assert 0 in SIZES and C + 1 in SIZES and G * B + 1 in SIZES
    assert max(SIZES) == 3 * C + 5


def test_lanes_digest_matches_reference(cases) -> None:  # type: ignore[no-untyped-def]
    for lanes, seed, want in cases:
        assert _numba.lanes_digest(lanes, seed) == want, len(lanes)


def test_serial_and_parallel_paths_agree(cases) -> None:  # type: ignore[no-untyped-def]
    for lanes, seed, want in cases:
        s = (np.uint64(seed[0]), np.uint64(seed[1]))
        assert tuple(int(w) for w in _numba._digest_serial(lanes, *s)) == want, len(lanes)
        assert tuple(int(w) for w in _numba._digest_parallel(lanes, *s)) == want, len(lanes)


def test_one_and_two_threads_agree() -> None:
    lanes, seed = _random_lanes(2 * C + G * B + 9, 77), _seed(77)
    before = _numba.numba.get_num_threads()
    try:
        _numba.set_threads(1)
        one = _numba.lanes_digest(lanes, seed)
        many_one = _numba.lanes_digest_many(lanes, np.array([0]), np.array([lanes.size]), np.array([seed], dtype=np.uint64))
        _numba.set_threads(min(2, _numba.numba.config.NUMBA_NUM_THREADS))
        two = _numba.lanes_digest(lanes, seed)
    finally:
        _numba.set_threads(before)
    assert one == two == _reference(lanes, seed)
    assert tuple(int(w) for w in many_one[0]) == one


def test_the_kernels_release_the_gil() -> None:
    # a digest on one thread must leave the host's other Python threads running (and lets the
    # refit digest beside its copy)
    from wcviz.digest import _threads, _tiles

    for kernel in (_numba._digest_serial, _numba._groups_claimed, _numba._many_claimed, _numba._digest_one_at,
                   _numba._at_claimed, _floor._floor_claimed, _tiles._tiles_claimed, _threads.wait):
        assert kernel.targetoptions.get("nogil") is True, kernel.py_func.__name__


def test_a_thread_on_one_numba_thread_digests_without_waking_a_helper(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from wcviz.digest import _threads

    lanes = _random_lanes(4 * _numba._SERIAL_BELOW + 3, 11)
    before = numba.get_num_threads()
    asked: list[int] = []
    ask = _threads._HELPERS.ask
    monkeypatch.setattr(_threads._HELPERS, "ask", lambda k, *rest: (asked.append(k), ask(k, *rest)))
    want = _numba.lanes_digest(lanes, (5, 6))  # this thread's count: helpers woken when it is above 1
    assert asked == ([before - 1] if before > 1 else [])
    got: list[tuple[int, int]] = []

    def one_thread() -> None:
        set_digest_threads(1)  # numba's thread count belongs to the calling thread
        got.append(_numba.lanes_digest(lanes, (5, 6)))

    t = threading.Thread(target=one_thread, daemon=True)
    t.start()
    t.join(60)
    assert got == [want] and want == _reference(lanes, (5, 6))
    assert asked == ([before - 1] if before > 1 else [])  # the one-thread digest woke nobody
    assert numba.get_num_threads() == before  # this thread's count is untouched


def test_non_contiguous_input_is_read_as_its_copy() -> None:
    base = _random_lanes(2 * (G * B + 5), 5)
    view = base[::2]
    assert _numba.lanes_digest(view, (1, 2)) == _reference(np.ascontiguousarray(view), (1, 2))


def test_zero_lanes_past_the_data_are_padding_not_ignored() -> None:
    # A tensor and the same tensor with its zero padding appended differ only in length.
    lanes = _random_lanes(G * B + 3, 9)
    padded = np.concatenate([lanes, np.zeros(2 * G * B - lanes.size, np.uint64)])
    assert _numba.lanes_digest(lanes, (3, 4)) == _reference(lanes, (3, 4))
    assert _numba.lanes_digest(padded, (3, 4)) == _reference(padded, (3, 4))


def test_many_matches_reference_on_mixed_sizes(cases) -> None:  # type: ignore[no-untyped-def]
    picked = [c for c in cases if c[0].size <= C + 1] + [cases[0], cases[3]]  # zeros and repeats included
    picked = picked[::-1] + picked[:2]  # the same tensors twice, in another order
    packed = np.concatenate([c[0] for c in picked])
    counts = np.array([c[0].size for c in picked], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    seeds = np.array([c[1] for c in picked], dtype=np.uint64)
    out = _numba.lanes_digest_many(packed, starts, counts, seeds)
    assert out.shape == (len(picked), 2) and out.dtype == np.uint64
    for row, (_, _, want) in zip(out, picked):
        assert (int(row[0]), int(row[1])) == want


def test_many_with_overlapping_and_large_tensors() -> None:
    lanes = _random_lanes(3 * C + 5, 21)
    starts = np.array([0, 0, 7, 3 * C + 5, C - 1], dtype=np.int64)
    counts = np.array([3 * C + 5, 1025, 0, 0, C + 2], dtype=np.int64)
    seeds = np.array([_seed(i) for i in range(5)], dtype=np.uint64)
    out = _numba.lanes_digest_many(lanes, starts, counts, seeds)
    for i in range(5):
        want = _reference(lanes[starts[i] : starts[i] + counts[i]], _seed(i))
        assert (int(out[i, 0]), int(out[i, 1])) == want


def test_many_edge_inputs() -> None:
    empty = _numba.lanes_digest_many(np.empty(0, np.uint64), np.empty(0, np.int64), np.empty(0, np.int64), np.empty((0, 2), np.uint64))
    assert empty.shape == (0, 2)
    with pytest.raises(ValueError, match="outside"):
        _numba.lanes_digest_many(np.zeros(4, np.uint64), np.array([2]), np.array([3]), np.zeros((1, 2), np.uint64))
    with pytest.raises(ValueError, match="disagree"):
        _numba.lanes_digest_many(np.zeros(4, np.uint64), np.array([0, 1]), np.array([1]), np.zeros((2, 2), np.uint64))


def test_digest_at_spreads_the_groups_of_every_tensor_bit_identically(cases) -> None:  # type: ignore[no-untyped-def]
    """One ``lanes_digest_at`` call over tensors of every boundary size (several chunks, one group, scalar-only),
    read in place, beside ones it must copy (an odd tail, an unaligned start, both): each equals the reference,
    in the order given, with one thread and with two."""
    raw = np.random.default_rng(7).integers(0, 256, 8 * (G * B + 9) + 3, dtype=np.uint8)
    copied = [(raw[:1001], 1001), (raw[1 : 1 + 8 * (G * B + 1)], 8 * (G * B + 1)), (raw[3 : 3 + 8 * 40 + 5], 8 * 40 + 5)]
    picked = list(cases)[::-1] + [cases[4], cases[-1]]  # every size, two of them again
    arrays = [c[0] for c in picked] + [r for r, _ in copied]
    nbytes = [c[0].nbytes for c in picked] + [n for _, n in copied]
    seeds = [c[1] for c in picked] + [_seed(90 + i) for i in range(len(copied))]
    wants = [c[2] for c in picked]
    for (r, n), seed in zip(copied, seeds[len(picked) :]):
        padded = np.zeros((n + 7) // 8 * 8, dtype=np.uint8)
        padded[:n] = r[:n]
        wants.append(_reference(padded.view(np.uint64), seed))
    assert any(a.ctypes.data % 8 for a in arrays) and any(n % 8 for n in nbytes)
    before = numba.get_num_threads()
    try:
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            _numba.set_threads(threads)
            out = _numba.lanes_digest_at(np.array([a.ctypes.data for a in arrays], dtype=np.uint64), np.array(nbytes),
                                         np.array(seeds, dtype=np.uint64), arrays)
            assert [(int(a), int(b)) for a, b in out] == wants, f"{threads} thread(s)"
    finally:
        _numba.set_threads(before)


def test_public_path_small_tensors_match_torch() -> None:
    for shape, dtype in (((4096,), torch.bfloat16), ((1024,), torch.bfloat16), ((3,), torch.bfloat16), ((0,), torch.float32), ((33, 7), torch.float32)):
        t = torch.randn(shape).to(dtype)
        assert digest_hex(t, backend="numba") == digest_hex(t, backend="torch")


def test_floor_rate_is_positive_and_finite() -> None:
    for threads in (1, None):
        rate = _floor.floor_rate(threads, seconds=0.02)
        assert math.isfinite(rate) and rate > 0


# ------------------------------------------------------------------- _simd

EDGES = [0, 1, 2, 3, 2**32 - 1, 2**32, 2**32 + 1, 2**63, 2**64 - 1, 2**64 - 2, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB]


@njit
def _vec_ops(a, b, out_split, out_plain, out_star, out_misc):  # type: ignore[no-untyped-def]
    for i in range(0, a.shape[0], 8):
        x = _simd.load(a, i, 8)
        y = _simd.load(b, i, 8)
        _simd.store(out_split, i, _simd.mul_split(x, y))
        _simd.store(out_plain, i, _simd.mul_plain(x, y))
        _simd.store(out_star, i, x * y)
        _simd.store(out_misc, i, ((x ^ y) + (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB))


def _pairs() -> tuple[np.ndarray, np.ndarray]:
    e = np.array(EDGES, dtype=np.uint64)
    a = np.repeat(e, len(e))
    b = np.tile(e, len(e))
    rnd = np.random.default_rng(3).integers(0, 2**64 - 1, (2, 4096), dtype=np.uint64, endpoint=True)
    a, b = np.concatenate([a, rnd[0]]), np.concatenate([b, rnd[1]])
    pad = -a.size % 8
    return np.concatenate([a, np.zeros(pad, np.uint64)]), np.concatenate([b, np.ones(pad, np.uint64)])


def test_simd_multiplies_match_uint64_multiplication() -> None:
    a, b = _pairs()
    outs = [np.empty_like(a) for _ in range(4)]
    _vec_ops(a, b, *outs)
    with np.errstate(over="ignore"):
        want = a * b
        misc = ((a ^ b) + (a >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    np.testing.assert_array_equal(outs[0], want)
    np.testing.assert_array_equal(outs[1], want)
    np.testing.assert_array_equal(outs[2], want)
    np.testing.assert_array_equal(outs[3], misc)


@njit
def _shapes(a):  # type: ignore[no-untyped-def]
    out = np.zeros(64, dtype=np.uint64)
    lo, hi = _simd.split(_simd.load(a, 0, 8))
    _simd.store(out, 0, _simd.cat(hi, lo))
    _simd.store(out, 8, _simd.splat(np.uint64(7), 4))
    _simd.store(out, 16, _simd.load_cols(a, 1, 8, 2, 4))  # rows at 1, 9, 17, 25; lanes 2..5
    return out


def test_simd_shapes() -> None:
    a = np.arange(64, dtype=np.uint64)
    out = _shapes(a)
    assert out[:8].tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    assert out[8:12].tolist() == [7] * 4
    want = [1 + 8 * k + 2 + p for p in range(4) for k in range(4)]
    assert out[16:32].tolist() == want


@njit
def _cols(a, base, stride, i, out8, out16, out32):  # type: ignore[no-untyped-def]
    _simd.prefetch(a, base)  # a hint only: changes nothing
    _simd.prefetch(a, a.shape[0] + 4096)  # past the end: never faults
    _simd.store(out8, 0, _simd.load_cols(a, base, stride, i, 8))
    _simd.store(out16, 0, _simd.load_cols(a, base, stride, i, 16))
    _simd.store(out32, 0, _simd.load_cols(a, base, stride, i, 32))


@pytest.mark.parametrize("base, stride, i", [(0, 4, 0), (3, 37, 5), (1, 256, 8)])
def test_load_cols_staged_transpose(base: int, stride: int, i: int) -> None:
    """8 rows or more take the three-stage transpose: element ``p * g + k`` is row ``k``, lane ``p``."""
    a = np.random.default_rng(stride).integers(0, 2**63, base + 32 * stride + i + 4, dtype=np.uint64)
    kept = a.copy()
    outs = {g: np.zeros(4 * g, dtype=np.uint64) for g in (8, 16, 32)}
    _cols(a, base, stride, i, outs[8], outs[16], outs[32])
    for g, out in outs.items():
        want = [a[base + k * stride + i + p] for p in range(4) for k in range(g)]
        assert out.tolist() == want, g
    np.testing.assert_array_equal(a, kept)


def test_mix_on_vectors_matches_scalar() -> None:
    @njit
    def both(a):  # type: ignore[no-untyped-def]
        out = np.empty_like(a)
        for i in range(0, a.shape[0], 16):
            _simd.store(out, i, _numba._mix(_simd.load(a, i, 16)))
        ref = np.empty_like(a)
        for i in range(a.shape[0]):
            ref[i] = _numba._mix(a[i])
        return out, ref

    a, _ = _pairs()
    a = a[: a.size // 16 * 16]
    vec, scalar = both(a)
    np.testing.assert_array_equal(vec, scalar)
    assert [int(v) for v in scalar[:4]] == [_spec._mix64(int(x)) for x in a[:4]]


def test_a_tweak_folded_into_the_first_shift_is_the_same_mix() -> None:
    """``_mix_tweaked(x, t ^ (t >> 30)) == _mix(x ^ t)``, on scalars and on vectors, for the kernel's tweaks and random ones."""
    a, b = _pairs()

    @njit
    def both(a, t):  # type: ignore[no-untyped-def]
        out = np.empty_like(a)
        ref = np.empty_like(a)
        for i in range(0, a.shape[0] - 15, 16):
            tv = _simd.load(t, i, 16)
            _simd.store(out, i, _numba._mix_tweaked(_simd.load(a, i, 16), tv ^ (tv >> np.uint64(30))))
        for i in range(a.shape[0]):
            ref[i] = _numba._mix(a[i] ^ t[i])
        return out, ref

    n = a.size // 16 * 16
    tweaks = b[:n].copy()
    tweaks[:4] = [_spec.LT[0], _spec.RT[0], _spec.LT[1], _spec.RT[1]]
    vec, ref = both(a[:n], tweaks)
    np.testing.assert_array_equal(vec, ref)
    t = _spec.LT[0]
    assert int(_numba._mix_tweaked(a[0], np.uint64(t ^ (t >> 30)))) == _spec._mix64(int(a[0]) ^ t)


def test_digest_many_reads_tensors_where_they_live_bit_identically() -> None:
    """The batched host path reads contiguous tensors in place (aligned or not, odd tails copied in the kernel) and
    packs the rest; every kind of tensor digests as the torch reference does, in the order given."""
    import torch

    from wcviz.digest import digest_hex, digest_many

    g = torch.Generator().manual_seed(11)
    base = torch.randn(64, 33, generator=g)
    whole = torch.randint(0, 255, (1001,), generator=g, dtype=torch.uint8)
    named = {
        "aligned": torch.randn(4096, generator=g).to(torch.bfloat16),
        "odd-tail": torch.randn(3, generator=g).to(torch.bfloat16),  # 6 bytes
        "unaligned": whole[1:],  # contiguous, starting 1 byte into its storage
        "unaligned-odd": whole[3:10],
        "transposed": base.t(),  # not contiguous: packed
        "sliced": base[:, 1::2],
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "bool": torch.rand(17, generator=g) > 0.5,
        "conj": torch.randn(5, dtype=torch.complex64, generator=g).conj(),  # a lazy conjugate: packed, resolved
        "neg": torch.randn(8, generator=g).to(torch.complex64).conj().imag,  # a lazy negation
        "int64": torch.randint(-(2**40), 2**40, (9,), generator=g),
    }
    many = digest_many(named, backend="numba")
    assert list(many) == list(named)
    for name, t in named.items():
        assert str(many[name]) == str(digest_hex(t, backend="torch")), name


_LAYOUT_SCRIPT = """
import json, sys
import numpy as np
from wcviz.digest import _numba
B, G, C, S = _numba.BLOCK, _numba.GROUP, _numba._CHUNK, _numba._SUB
sizes = sorted({0, 1, 3, 5, 2 * G - 1, 4 * G - 1, 4 * G, 4 * G + 1, G * S - 1, G * S + 1, 2 * G * S + 1, 4 * G * S - 3,
                B - 1, B + 1, G * B - 1, G * B, G * B + 1,
                2 * G * B + 3, C - 1, C + 1, 2 * C + 5})
out = []
for i, n in enumerate(sizes):
    lanes = np.random.default_rng(i).integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
    seed = (2 * i + 1, 7 * i)
    words = [list(map(int, _numba.lanes_digest(lanes, seed))), list(map(int, _numba._digest_serial(lanes, np.uint64(seed[0]), np.uint64(seed[1]))))]
    out.append([n, seed, words])
arrays = [np.random.default_rng(i).integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True) for i, n in enumerate(sizes)]
at = _numba.lanes_digest_at(np.array([a.ctypes.data for a in arrays], dtype=np.uint64), np.array([a.nbytes for a in arrays]),
                            np.array([c[1] for c in out], dtype=np.uint64), arrays)
for case, row in zip(out, at):
    case[2].append([int(row[0]), int(row[1])])
print(json.dumps({"group": G, "sub": _numba._SUB, "cache": _numba._CACHE, "cases": out}))
"""


@pytest.mark.parametrize("sub", ["", "8", "4096"])
def test_every_block_layout_gives_the_reference_digest(tmp_path, sub: str) -> None:  # type: ignore[no-untyped-def]
    """The layout not chosen for this host (4 blocks on AVX2, 16 on AVX-512) is bit-identical too, with
    its blocks read side by side whole, in the host's sub-blocks, or in the narrowest ones."""
    import json
    import os
    import subprocess
    import sys

    other = 4 if G == 16 else 16
    env = {**os.environ, "WCVIZ_NUMBA_GROUP": str(other), "NUMBA_CACHE_DIR": str(tmp_path)}
    if sub:
        env["WCVIZ_NUMBA_SUB"] = sub
    done = subprocess.run([sys.executable, "-c", _LAYOUT_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout)
    assert answer["group"] == other and answer["cache"] is False  # an override never uses the cache on disk
    assert answer["sub"] == (int(sub) if sub else min(4096, 4096 // other))
    assert not [f.name for f in tmp_path.rglob("*") if "_numba" in f.name]  # (the layout-free _threads may cache)
    assert len(answer["cases"]) >= 15
    for i, (n, seed, words) in enumerate(answer["cases"]):
        lanes = np.random.default_rng(i).integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
        want = list(_reference(lanes, tuple(seed)))
        assert words == [want, want, want], f"GROUP={other}, {n} lanes"  # alone, serial, and in one batch of all


@pytest.mark.parametrize(
    "name, bad",
    [("WCVIZ_NUMBA_GROUP", "5"), ("WCVIZ_NUMBA_GROUP", "sixteen"), ("WCVIZ_NUMBA_GROUP", "-4"),
     ("WCVIZ_NUMBA_SUB", "4"), ("WCVIZ_NUMBA_SUB", "96"), ("WCVIZ_NUMBA_SUB", "8192"), ("WCVIZ_NUMBA_SUB", "all")],
)
def test_a_bad_block_layout_override_is_named(name: str, bad: str) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, name: bad}
    done = subprocess.run([sys.executable, "-c", "import wcviz.digest._numba"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and f"{name}={bad!r}" in done.stderr, done.stderr[-2000:]

