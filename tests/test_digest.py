"""The nemo-rl-v3 digest: the spec's properties, every dtype, every backend, batching."""

from __future__ import annotations

import hashlib
import pickle
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wcviz import AlgorithmMismatch, DigestError
from wcviz.digest import (
    compare_digests,
    digest_buffer,
    digest_hex,
    digest_many,
    resolve_backend,
    tensor_digest,
)
from wcviz.digest import _api, _spec

CHUNK = _spec.CHUNK
BACKENDS = ["torch", "numba"]


def oracle_hex(t: torch.Tensor) -> str:
    """The digest computed from the spec text alone: Python ints, numpy bytes."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    nbytes = t.numel() * t.element_size()
    padded = raw + b"\0" * (-len(raw) % 8)
    lanes = list(struct.unpack(f"<{len(padded) // 8}Q", padded))
    return _spec.hex_of(*_spec.reference_lanes_digest(lanes, _spec.seeds(str(t.dtype), tuple(t.shape), nbytes)))


def lanes_tensor(n: int, seed: int = 0) -> torch.Tensor:
    g = np.random.default_rng(seed)
    return torch.from_numpy(g.integers(0, 2**64 - 1, size=n, dtype=np.uint64, endpoint=True).view(np.int64))


# --- the definition ------------------------------------------------------------------


def test_metadata_bytes_layout() -> None:
    got = _spec.metadata_bytes("torch.bfloat16", (2, 3), 12)
    want = b"\x0e\x00torch.bfloat16" + struct.pack("<QQQQ", 2, 2, 3, 12)
    assert got == want


def test_seeds_are_personalised_blake2b() -> None:
    h = hashlib.blake2b(_spec.metadata_bytes("torch.float32", (4,), 16), digest_size=16, person=b"NeMoRLrefit-v3").digest()
    assert _spec.seeds("torch.float32", (4,), 16) == (int.from_bytes(h[:8], "little"), int.from_bytes(h[8:], "little"))


@pytest.mark.parametrize("n,width", [(0, 2), (1, 2), (2, 2), (3, 4), (4, 4), (5, 8), (1024, 1024), (1025, 2048)])
def test_chunk_width(n: int, width: int) -> None:
    assert _spec.chunk_width(n) == width


# Outputs of the spec oracle, pinned: a change to the algorithm or its metadata shows up here.
PIN_F32 = "1b1cdb0c9778c52dfb1683bb27fa2b41"
PIN_EMPTY = "d59dabfda6ceee36229d615ffdd7e834"
PIN_SCALAR = "0e956a3caae567b081c75c298bddbb04"


def test_known_answers() -> None:
    pinned = {
        "float32 arange(10)": (torch.arange(10, dtype=torch.float32), PIN_F32),
        "bfloat16 empty": (torch.empty(0, dtype=torch.bfloat16), PIN_EMPTY),
        "int64 0-d 7": (torch.tensor(7), PIN_SCALAR),
    }
    for label, (t, want) in pinned.items():
        assert oracle_hex(t) == want, label
        assert digest_hex(t) == want, label


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 8, 9, 31, 64, 100, 1023, 1024, 1025, 2047, 2048, 4097, 5000])
def test_backend_matches_oracle_small(backend: str, n: int) -> None:
    t = lanes_tensor(n, seed=n)
    assert digest_hex(t, backend=backend) == oracle_hex(t)


@pytest.mark.slow
def test_oracle_across_one_chunk_boundary() -> None:
    t = lanes_tensor(CHUNK + 1, seed=1)
    want = oracle_hex(t)
    assert digest_hex(t, backend="torch") == want
    assert digest_hex(t, backend="numba") == want


@pytest.mark.parametrize("n", [CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK + 5, 2 * CHUNK - 1024 + 3])
def test_backends_agree_at_chunk_boundaries(n: int) -> None:
    t = lanes_tensor(n, seed=n % 97)
    assert digest_hex(t, backend="numba") == digest_hex(t, backend="torch")


def test_chunks_are_chained_in_order() -> None:
    a, b = lanes_tensor(CHUNK, 1), lanes_tensor(CHUNK, 2)
    assert digest_hex(torch.cat([a, b]), backend="numba") != digest_hex(torch.cat([b, a]), backend="numba")


# --- what the digest detects ----------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_single_bit_flip_in_a_small_tensor_is_caught(backend: str) -> None:
    t = lanes_tensor(6, seed=3)
    base = digest_hex(t, backend=backend)
    seen = {base}
    for lane in range(t.numel()):
        for bit in range(64):
            u = t.clone()
            u[lane] ^= torch.tensor(1, dtype=torch.int64) << bit
            d = digest_hex(u, backend=backend)
            assert d != base, (lane, bit)
            seen.add(d)
    assert len(seen) == 1 + 6 * 64  # and no two flips collide


@pytest.mark.parametrize("lane", [0, 1, 1023, 1024, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 17])
def test_single_lane_change_caught_anywhere(lane: int) -> None:
    t = lanes_tensor(2 * CHUNK + 100, seed=5)
    base = digest_hex(t)
    u = t.clone()
    u[lane] += 1
    assert digest_hex(u) != base


def test_top_bit_pairs_swaps_permutations_and_moves() -> None:
    t = lanes_tensor(4096, seed=7)
    base = digest_hex(t)
    top = torch.tensor(-(2**63), dtype=torch.int64)
    for i, j in [(0, 1), (0, 2), (5, 4000), (1024, 2048)]:
        u = t.clone()
        u[i] ^= top
        u[j] ^= top
        assert digest_hex(u) != base, ("top bits", i, j)
        s = t.clone()
        s[i], s[j] = t[j].clone(), t[i].clone()
        assert digest_hex(s) != base, ("swap", i, j)
    perm = torch.randperm(4096, generator=torch.Generator().manual_seed(0))
    assert digest_hex(t[perm]) != base
    moved = torch.cat([t[512:1024], t[:512], t[1024:]])
    assert digest_hex(moved) != base


def test_appended_zero_dtype_reinterpretation_and_reshape_change_the_digest() -> None:
    x = torch.arange(12, dtype=torch.float32)
    base = digest_hex(x)
    assert digest_hex(torch.cat([x, torch.zeros(1)])) != base
    assert digest_hex(x.view(torch.int32)) != base
    assert digest_hex(x.reshape(3, 4)) != base
    assert digest_hex(x.reshape(3, 4)) != digest_hex(x.reshape(4, 3))
    assert digest_hex(torch.zeros(3, dtype=torch.uint8)) != digest_hex(torch.zeros(4, dtype=torch.uint8))


def test_empty_and_zero_d_tensors() -> None:
    shapes = [(0,), (0, 3), (3, 0), ()]
    digests = {digest_hex(torch.zeros(s)) for s in shapes}
    assert len(digests) == len(shapes)
    for s in shapes:
        t = torch.zeros(s)
        assert digest_hex(t, backend="torch") == digest_hex(t, backend="numba") == oracle_hex(t)


# --- layouts and dtypes ----------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_views_digest_like_their_contiguous_copy(backend: str) -> None:
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    views = {
        "transpose": x.t(),
        "column slice": x[:, 5:17],
        "step": x[::3, ::2],
        "expand": x[:1].expand(5, 48),
        "permute 3d": x.reshape(8, 8, 48).permute(2, 0, 1),
        "bf16 transpose": x.to(torch.bfloat16).t(),
        "complex128": torch.complex(x, x).to(torch.complex128).t(),
    }
    for label, v in views.items():
        assert not v.is_contiguous(), label
        assert digest_hex(v, backend=backend) == digest_hex(v.contiguous(), backend=backend), label


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64])
def test_slices_at_odd_storage_offsets(backend: str, dtype: torch.dtype) -> None:
    base = (torch.arange(301) % 113).to(dtype)
    for start in [1, 3, 5, 7, 9]:
        view = base[start : start + 37]
        assert view.storage_offset() == start
        assert digest_hex(view, backend=backend) == digest_hex(view.clone(), backend=backend) == oracle_hex(view.clone())


def all_dtypes() -> list[torch.dtype]:
    found = {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    return sorted(found, key=str)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes of ``dtype`` (valid values for bool), built without dtype-specific kernels."""
    es = torch.empty(0, dtype=dtype).element_size()
    n = int(np.prod(shape)) if shape else 1
    raw = np.random.default_rng(seed).integers(0, 256, size=n * es, dtype=np.uint8)
    if dtype == torch.bool:
        raw &= 1
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype.is_complex and es == 16:
        return torch.view_as_complex(torch.from_numpy(raw).view(torch.float64).reshape(*shape, 2))
    if dtype in (torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4):
        return torch.quantize_per_tensor(torch.from_numpy(raw[:n].astype(np.float32)).reshape(shape), 0.5, 3, dtype)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", all_dtypes(), ids=str)
def test_every_dtype(dtype: torch.dtype) -> None:
    t = random_tensor(dtype, (5, 6), seed=1)
    d = tensor_digest(t)
    assert d.dtype == torch.int64 and d.shape == (2,) and d.device == t.device
    hx = digest_hex(t)
    assert len(hx) == 32 and hx == hx.lower() and int(hx, 16) >= 0
    assert hx == digest_hex(t, backend="torch")
    assert hx == _spec.hex_of(*d.tolist())
    assert len(digest_hex(t, algo="sha256")) == 64
    if not t.is_quantized:
        assert hx == oracle_hex(t)
        assert digest_hex(t.t(), backend="torch") == digest_hex(t.t(), backend="numba")


def test_dtype_name_is_part_of_the_digest() -> None:
    b = torch.zeros(8, dtype=torch.uint8)
    assert len({digest_hex(b.view(d)) for d in [torch.uint8, torch.int8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]}) == 5


DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.int64, torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
    seed=st.integers(0, 2**32 - 1),
    transpose=st.booleans(),
)
def test_backends_equal_on_random_tensors(dtype: torch.dtype, shape: tuple[int, ...], seed: int, transpose: bool) -> None:
    t = random_tensor(dtype, shape, seed)
    if transpose and t.dim() >= 2:
        t = t.transpose(0, -1)
    assert digest_hex(t, backend="torch") == digest_hex(t, backend="numba")
    assert digest_hex(t) == digest_hex(t.contiguous())


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 3000), seed=st.integers(0, 2**32 - 1))
def test_numba_matches_oracle_on_random_lengths(n: int, seed: int) -> None:
    t = random_tensor(torch.uint8, (n,), seed)
    assert digest_hex(t, backend="numba") == oracle_hex(t)


# --- batches, buffers, algorithms --------------------------------------------------------


def named_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(100, 16, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.ones(16),
        "layers.0.attn.q.weight": torch.randn(16, 16, generator=g).t(),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "mask": torch.rand(33, generator=g) > 0.5,
    }


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
@pytest.mark.parametrize("algo", ["nemo-rl-v3", "sha256"])
def test_digest_many_equals_one_by_one(backend: str, algo: str) -> None:
    batch = named_batch()
    many = digest_many(batch, algo=algo, backend=backend)
    assert list(many) == list(batch)
    assert many == {n: digest_hex(t, algo=algo, backend=backend) for n, t in batch.items()}
    assert digest_many(list(batch.items()), algo=algo, backend=backend) == many
    assert all(d.algo == algo for d in many.values())


def test_digest_many_syncs_once_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch backend (the one accelerators use) brings words to the host once per device."""
    calls: list[int] = []
    inside = [False]
    real_to_host, real_tolist = _api._to_host, torch.Tensor.tolist

    def counting(words: torch.Tensor) -> list[list[int]]:
        calls.append(words.shape[0])
        inside[0] = True
        try:
            return real_to_host(words)
        finally:
            inside[0] = False

    def guarded_tolist(self: torch.Tensor) -> object:
        assert inside[0], "a host sync outside the one per device"
        return real_tolist(self)

    monkeypatch.setattr(_api, "_to_host", counting)
    monkeypatch.setattr(torch.Tensor, "tolist", guarded_tolist)
    out = digest_many(named_batch(), backend="torch")
    monkeypatch.undo()
    assert calls == [len(named_batch())]
    assert out == digest_many(named_batch(), backend="numba")


def test_digest_many_names_duplicates() -> None:
    t = torch.zeros(2)
    with pytest.raises(DigestError, match="duplicate parameter names: a, b"):
        digest_many([("a", t), ("b", t), ("a", t), ("c", t), ("b", t)])


def test_digest_many_checks_every_input_before_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_api, "tensor_digest", lambda *a, **k: pytest.fail("digested before checking"))
    with pytest.raises(DigestError, match="'w2' is on the meta device"):
        digest_many({"w1": torch.zeros(3), "w2": torch.zeros(3, device="meta")})


def test_digest_buffer_equals_tensor_digest() -> None:
    for dtype in [torch.bfloat16, torch.float32, torch.uint8, torch.bool, torch.int64]:
        t = random_tensor(dtype, (7, 3), seed=2)
        raw = t.contiguous().view(torch.uint8).reshape(-1).numpy()
        for algo in ["nemo-rl-v3", "sha256"]:
            assert digest_buffer(raw, dtype, t.shape, algo=algo) == digest_hex(t, algo=algo)
            assert digest_buffer(raw, str(dtype).removeprefix("torch."), t.shape, algo=algo) == digest_hex(t, algo=algo)
    assert digest_buffer(np.zeros(0, np.uint8), torch.float32, (0, 3)) == digest_hex(torch.zeros(0, 3))
    with pytest.raises(DigestError, match="expected at least 84 bytes"):
        digest_buffer(np.zeros(10, np.uint8), torch.float32, (7, 3))
    with pytest.raises(DigestError, match="unknown dtype 'float13'"):
        digest_buffer(np.zeros(10, np.uint8), "float13", (1,))


def test_sha256_is_sha256_of_metadata_then_bytes() -> None:
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    want = hashlib.sha256(_spec.metadata_bytes("torch.int16", (2, 3), 12) + t.numpy().tobytes()).hexdigest()
    d = digest_hex(t, algo="sha256")
    assert d == want and d.algo == "sha256"
    assert digest_hex(t.t(), algo="sha256") == digest_hex(t.t().contiguous(), algo="sha256")


def _nested(layout: torch.layout) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "nested tensors are in prototype stage"
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)


NESTED_LAYOUTS = [torch.strided, torch.jagged]


@pytest.mark.parametrize("layout", NESTED_LAYOUTS, ids=str)
@pytest.mark.parametrize("algo", ["nemo-rl-v3", "sha256", "sglang-gpu"])
def test_nested_tensors_are_refused_naming_the_tensor(layout: torch.layout, algo: str) -> None:
    """A nested tensor has no one flat buffer of elements: a DigestError naming it, not torch's own error."""
    from wcviz.digest import DigestAccumulator

    t = _nested(layout)
    with pytest.raises(DigestError, match="'model.ragged' is a nested tensor"):
        digest_hex(t, algo=algo, name="model.ragged")
    acc = DigestAccumulator(algo=algo)
    with pytest.raises(DigestError, match="'model.ragged' is a nested tensor"):
        acc.add("model.ragged", t)
        acc.hex()
    with pytest.raises(DigestError, match="'model.ragged' is a nested tensor"):
        digest_many({"w": torch.ones(2), "model.ragged": t}, algo=algo)


def test_digest_carries_its_algorithm_and_pickles() -> None:
    d = digest_hex(torch.ones(3))
    assert isinstance(d, str) and d.algo == "nemo-rl-v3"
    back = pickle.loads(pickle.dumps(d))
    assert back == d and back.algo == "nemo-rl-v3"
    assert "nemo-rl-v3" in repr(d)


def test_compare_digests() -> None:
    s = digest_many({"a": torch.ones(2), "b": torch.zeros(2), "c": torch.ones(3), "gone": torch.ones(1)})
    r = dict(s)
    r["b"] = digest_hex(torch.zeros(3))
    del r["gone"]
    r["extra"] = digest_hex(torch.ones(1))
    assert compare_digests(s, r) == ["b", "extra", "gone"]
    assert compare_digests(s, s) == []
    assert compare_digests({"x": str(s["a"]).upper()}, {"x": str(s["a"])}) == []


def test_compare_digests_refuses_mixed_algorithms() -> None:
    t = {"w": torch.ones(2)}
    with pytest.raises(AlgorithmMismatch, match="nemo-rl-v3, sha256"):
        compare_digests(digest_many(t), digest_many(t, algo="sha256"))


def test_bad_input_is_named() -> None:
    with pytest.raises(DigestError, match="'w' is on the meta device"):
        digest_hex(torch.empty(3, device="meta"), name="w")
    with pytest.raises(DigestError, match="'s' is not dense"):
        digest_hex(torch.eye(3).to_sparse(), name="s")
    with pytest.raises(DigestError, match="'x' is a list"):
        digest_many({"x": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="unknown digest algorithm 'md5'; choose one of nemo-rl-v3, sha256"):
        digest_hex(torch.ones(1), algo="md5")
    with pytest.raises(ValueError, match="unknown digest backend 'cuda'"):
        digest_hex(torch.ones(1), backend="cuda")
    with pytest.raises(DigestError, match="backend 'numba' runs on the CPU, but tensor 'w' is on cuda"):
        resolve_backend("numba", "cuda", "w")


def test_auto_backend_choice() -> None:
    assert resolve_backend("auto", "cpu") == "numba"
    import importlib.util

    has_triton = importlib.util.find_spec("triton") is not None
    assert resolve_backend("auto", "cuda") == ("triton" if has_triton else "torch")
    assert resolve_backend("auto", "mps") == "torch"
    assert resolve_backend("torch", "cpu") == "torch"


def test_tensor_digest_stays_on_device_and_needs_no_grad() -> None:
    w = torch.nn.Parameter(torch.randn(4, 4))
    d = tensor_digest(w, backend="torch")
    assert d.device == w.device and d.dtype == torch.int64 and not d.requires_grad
    assert _spec.hex_of(*d.tolist()) == digest_hex(w.detach())


def test_concurrent_digests_from_many_threads() -> None:
    """Agents digest from background threads: concurrent calls must neither crash nor mix results."""
    from concurrent.futures import ThreadPoolExecutor

    tensors = [lanes_tensor(3 * 4096 + i, seed=i) for i in range(8)]
    want = [digest_hex(t, backend="torch") for t in tensors]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda t: digest_hex(t, backend="numba"), tensors * 3))
    assert got == want * 3


def test_accumulator_collects_on_device_and_syncs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from wcviz.digest import DigestAccumulator

    calls: list[int] = []
    real = _api._to_host
    monkeypatch.setattr(_api, "_to_host", lambda w: calls.append(w.shape[0]) or real(w))
    acc = DigestAccumulator(backend="torch")
    for name, t in named_batch().items():
        acc.add(name, t)
    assert calls == []  # nothing reached the host while streaming
    got = acc.hex()
    assert calls == [len(named_batch())]  # one sync for the whole stream
    assert got == digest_many(named_batch(), backend="numba")
    with pytest.raises(DigestError, match="duplicate parameter names: scalar"):
        acc.add("scalar", torch.ones(1))
    sha = DigestAccumulator(algo="sha256")
    sha.add("w", torch.ones(2))
    assert sha.hex() == {"w": digest_hex(torch.ones(2), algo="sha256")}


def test_accumulator_add_many_digests_host_tensors_in_one_kernel_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """``add_many`` gives what ``add`` gives, in the order given, with the numba host tensors (large, small,
    strided, at an odd offset) in one batched call; a duplicate name adds nothing."""
    from wcviz.digest import DigestAccumulator, _numba

    g = torch.Generator().manual_seed(12)
    whole = torch.randn(3 * (1 << 17) + 7, generator=g)
    named = [("big", torch.randn(1 << 19, generator=g)), *named_batch().items(), ("odd", whole[1:]),
             ("big2", torch.randn(600, 1000, generator=g).to(torch.bfloat16))]
    calls: list[int] = []
    real = _numba.lanes_digest_at
    monkeypatch.setattr(_numba, "lanes_digest_at", lambda a, *rest: calls.append(len(a)) or real(a, *rest))
    acc = DigestAccumulator()
    acc.add_many(named)
    got = acc.hex()
    assert list(got) == [n for n, _ in named]
    assert got == {n: digest_hex(t, backend="torch") for n, t in named}
    assert len(calls) == 1 and calls[0] >= 5  # one kernel call read the contiguous ones in place
    with pytest.raises(DigestError, match="duplicate parameter names: big"):
        acc.add_many([("fresh", torch.ones(3)), ("big", torch.ones(1))])
    assert "fresh" not in acc
    with pytest.raises(DigestError, match="duplicate parameter names: twice"):
        acc.add_many([("twice", torch.ones(3)), ("twice", torch.ones(3))])
    assert "twice" not in acc and len(acc) == len(named)
    one = DigestAccumulator(backend="torch")  # not the numba kernel: each tensor as add digests it
    one.add_many(named[:3])
    assert one.hex() == {n: got[n] for n, _ in named[:3]}


def test_digest_many_batches_small_host_tensors_in_one_kernel_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors up to SMALL_BYTES share one numba call (contiguous ones read in place, the strided one packed);
    larger ones get their own where they are timed or a progress bar shows them, else join it; all match the
    reference."""
    from wcviz.digest import _numba

    g = torch.Generator().manual_seed(11)
    small = _api.SMALL_BYTES
    named = {
        "at_limit": torch.randint(-128, 127, (small,), dtype=torch.int8, generator=g),
        "above_limit": torch.randint(-128, 127, (small + 2,), dtype=torch.int8, generator=g),
        "norm": torch.randn(4096, generator=g).to(torch.bfloat16),
        "odd": torch.arange(7, dtype=torch.int8),
        "empty": torch.empty(0),
        "strided": torch.randn(40, 30, generator=g).t(),
    }
    batches: list[int] = []
    in_place: list[int] = []
    singles: list[int] = []
    many, at, one = _numba.lanes_digest_many, _numba.lanes_digest_at, _numba.lanes_digest
    monkeypatch.setattr(_numba, "lanes_digest_many", lambda lanes, s, c, seeds: batches.append(len(s)) or many(lanes, s, c, seeds))
    monkeypatch.setattr(_numba, "lanes_digest_at", lambda a, n, seeds, keep: in_place.append(len(a)) or at(a, n, seeds, keep))
    monkeypatch.setattr(_numba, "lanes_digest", lambda lanes, seed: singles.append(lanes.shape[0]) or one(lanes, seed))
    got = _api.digest_timed(named, backend="numba")
    assert in_place == [4] and batches == [1] and singles == [(small + 2 + 7) // 8]
    want = digest_many(named, backend="torch")
    assert {n: d for n, (d, _) in got.items()} == want
    assert all(s >= 0 for _, s in got.values()) and list(got) == list(named)
    del in_place[:], batches[:], singles[:]
    assert digest_many(named, backend="numba") == want  # untimed: the large one joins the batch too
    assert in_place == [5] and batches == [1] and singles == []
    del in_place[:], batches[:], singles[:]
    assert digest_many(named, backend="numba", progress=True) == want  # a progress bar moves per large tensor
    assert in_place == [4] and batches == [1] and singles == [(small + 2 + 7) // 8]


# --------------------------------------------------------------------------- one-element strided views


def _one_element_views() -> list[torch.Tensor]:
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return [w[::2][:1, :1], w.t()[:1, :1], w.reshape(-1)[::3][2:3], w.t()[1:2, 2:3], w[::2][:1][0, :1],
            torch.arange(10, dtype=torch.float64)[::5][1:], w.to(torch.bfloat16).t()[:1, :1], w.t()[3, 2]]  # fmt: skip


@pytest.mark.parametrize("i", range(8))
@pytest.mark.parametrize("algo", ["nemo-rl-v3", "sha256"])
def test_a_one_element_strided_view_digests_like_its_copy(i: int, algo: str) -> None:
    view = _one_element_views()[i]
    copy = view.clone(memory_format=torch.contiguous_format)
    want = digest_hex(copy, algo=algo)
    assert digest_hex(view, algo=algo) == want
    if algo == "nemo-rl-v3":
        assert digest_hex(view, backend="torch") == want
        assert digest_many({"v": view, "c": copy})["v"] == want


def test_batch_hex_forms_equal_the_one_by_one_form() -> None:
    """The batched formatters (one pass over a uint64 array; int64 pairs from a device) give hex_of's text exactly."""
    words = np.array([[0, 1], [2**64 - 1, 2**63], [0x0123456789ABCDEF, 0xFEDCBA9876543210]], dtype=np.uint64)
    want = [_spec.hex_of(int(a), int(b)) for a, b in words]
    assert want[1] == "f" * 16 + "8" + "0" * 15
    assert _spec.hex_rows(words) == want
    assert _spec.hex_pairs(words.view(np.int64).tolist()) == want  # negative int64 words, as torch gives them
    assert _spec.hex_rows(np.empty((0, 2), dtype=np.uint64)) == []


def test_digests_made_in_a_batch_are_digests() -> None:
    """``Digest.many`` (the batched path's constructor) gives what ``Digest(h, algo)`` gives, one by one."""
    hexes = [_spec.hex_of(1, 2), _spec.hex_of(2**64 - 1, 0)]
    many = _api.Digest.many(hexes, "nemo-rl-v3")
    one = [_api.Digest(h, "nemo-rl-v3") for h in hexes]
    assert many == one and [d.algo for d in many] == [d.algo for d in one] == ["nemo-rl-v3"] * 2
    assert [repr(d) for d in many] == [repr(d) for d in one]
    assert [pickle.loads(pickle.dumps(d)).algo for d in many] == ["nemo-rl-v3"] * 2
    assert _api.Digest.many([], "sha256") == []
