"""SHA-256 digests of many tensors side by side on threads: the same digests, bounded, and nothing left running."""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from wcviz._errors import DigestError
from wcviz.digest import _api, _buffers, _pool, digest_buffers, digest_hex, digest_many, set_digest_threads
from wcviz.sources import _safetensors as st
from wcviz.sources import from_safetensors, from_state_dict

HASHLIB = sorted(_pool.HASHLIB_ALGOS)


def _tensors() -> dict[str, torch.Tensor]:
    """Sizes on both sides of the threaded minimum, an empty one, a non-contiguous view."""
    g = torch.Generator().manual_seed(7)
    out = {f"big.{i}": torch.randn(40_000 + 977 * i, generator=g).to(torch.bfloat16) for i in range(6)}
    out.update({f"small.{i}": torch.randn(3 + i, generator=g) for i in range(5)})
    out["empty"] = torch.zeros(0, 4)
    out["strided"] = torch.randn(300, 200, generator=g).t()
    return out


@pytest.mark.parametrize("algo", HASHLIB)
def test_digest_many_side_by_side_equals_one_at_a_time(algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: set[str] = set()
    real = _api._sha256_of

    def spy(t, name, algo):  # type: ignore[no-untyped-def]
        threads.add(threading.current_thread().name)
        return real(t, name, algo)

    monkeypatch.setattr(_api, "_sha256_of", spy)
    monkeypatch.setattr(_pool, "host_threads", lambda: 2)
    tensors = _tensors()
    got = digest_many(tensors, algo=algo)
    assert list(got) == list(tensors)  # input order
    for name, t in tensors.items():
        assert got[name] == digest_hex(t, algo=algo), name
    if algo == "vllm-sha256":  # and against hashlib itself, as vLLM hashes
        for name, t in tensors.items():
            assert str(got[name]) == hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    assert any(n.startswith("wcviz-hash") for n in threads), threads  # the big ones went to the pool
    assert threading.current_thread().name in threads  # the small ones stayed here


def test_one_thread_means_no_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """``set_digest_threads(1)`` (what the refit's worker sets) keeps every hash on the calling thread."""

    def refuse(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("a thread pool was started")

    monkeypatch.setattr(_pool, "ThreadPoolExecutor", refuse)
    seen: list[int] = []

    def worker() -> None:
        set_digest_threads(1)
        seen.append(_pool.host_threads())
        digest_many(_tensors(), algo="vllm-sha256")

    failures: list[BaseException] = []
    th = threading.Thread(target=lambda: _capture(worker, failures))
    th.start()
    th.join()
    assert failures == [] and seen == [1]


def _capture(fn, failures: list[BaseException]) -> None:  # type: ignore[no-untyped-def]
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - handed to the test's thread
        failures.append(e)


def test_jobs_are_pulled_lazily_and_bounded() -> None:
    """Never more than ``threads`` jobs in flight: a reader making one buffer per job holds at most that many."""
    lock = threading.Lock()
    state = {"pulled": 0, "finished": 0, "running": 0, "most": 0, "most_ahead": 0}

    def job(i: int):  # type: ignore[no-untyped-def]
        def run() -> int:
            with lock:
                state["running"] += 1
                state["most"] = max(state["most"], state["running"])
            time.sleep(0.002)
            with lock:
                state["running"] -= 1
                state["finished"] += 1
            return i * i

        return run

    def jobs():  # type: ignore[no-untyped-def]
        for i in range(40):
            with lock:
                state["pulled"] += 1
                state["most_ahead"] = max(state["most_ahead"], state["pulled"] - state["finished"])
            yield job(i), _pool.MIN_THREADED

    sizes: list[int] = []
    out = _pool.side_by_side(jobs(), threads=3, done=sizes.append)
    assert [v for v, _ in out] == [i * i for i in range(40)]
    assert all(s >= 0.002 for _, s in out)  # each job timed on its own
    assert sizes == [_pool.MIN_THREADED] * 40
    assert state["most"] == 3  # side by side, never more than asked
    assert state["most_ahead"] <= 4  # the three in flight and the one being made


def test_an_error_raises_and_leaves_nothing_running() -> None:
    started: list[int] = []
    finished: list[int] = []

    def job(i: int):  # type: ignore[no-untyped-def]
        def run() -> int:
            started.append(i)
            if i == 5:
                raise ValueError("tensor 5 is broken")
            time.sleep(0.01)
            finished.append(i)
            return i

        return run

    with pytest.raises(ValueError, match="tensor 5"):
        _pool.side_by_side(((job(i), _pool.MIN_THREADED) for i in range(50)), threads=2)
    assert not [t for t in threading.enumerate() if t.name.startswith("wcviz-hash")]
    assert sorted(finished) == sorted(i for i in started if i != 5)  # every job that started also ended
    assert len(started) < 50  # the rest never started


@pytest.mark.parametrize("algo", HASHLIB)
def test_checkpoint_side_by_side_equals_the_tensors(algo: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint's SHA-256 digests, several tensors at a time (memory-mapped, and read into buffers
    where it cannot be mapped), equal the tensors' own."""
    tensors = {k: v.contiguous() for k, v in _tensors().items()}
    save_file(dict(list(tensors.items())[:7]), str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(dict(list(tensors.items())[7:]), str(tmp_path / "model-00002-of-00002.safetensors"))
    monkeypatch.setattr(_pool, "host_threads", lambda: 2)
    threads: set[str] = set()
    real = _buffers.digest_buffer

    def spy(*a, **k):  # type: ignore[no-untyped-def]
        threads.add(threading.current_thread().name)
        return real(*a, **k)

    monkeypatch.setattr(_buffers, "digest_buffer", spy)
    want = from_state_dict(tensors, algo=algo, progress=False).set_index("name")["digest"]
    mapped = from_safetensors(tmp_path, algo=algo, progress=False).set_index("name")["digest"]
    assert mapped.sort_index().equals(want.sort_index())
    assert any(n.startswith("wcviz-hash") for n in threads), threads  # the reader's big tensors went to the pool

    import contextlib

    @contextlib.contextmanager
    def unmappable(f):  # type: ignore[no-untyped-def]
        yield None

    monkeypatch.setattr(st, "_mapped", unmappable)
    read = from_safetensors(tmp_path, algo=algo, progress=False).set_index("name")["digest"]
    assert read.equals(mapped)


def test_digest_buffers_in_order_with_seconds() -> None:
    raws = [np.arange(n, dtype=np.uint8) for n in (70_000, 10, 200_000, 0)]
    out = digest_buffers(((r, "uint8", (r.shape[0],), f"t{i}") for i, r in enumerate(raws)), algo="vllm-sha256")
    assert [str(d) for d, _ in out] == [hashlib.sha256(r.tobytes()).hexdigest() for r in raws]
    assert all(s >= 0 for _, s in out)


def test_digest_buffers_batches_the_numba_kernel_by_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """nemo-rl-v3 on numba: one kernel call per window of bytes, digests equal digest_buffer's one by one, every
    buffer reported done in order after its window's call, seconds shared by bytes within a window, and no
    buffer pulled before the window it belongs to is due."""
    from wcviz.digest import _numba, digest_buffer

    rng = np.random.default_rng(3)
    raws = [rng.integers(0, 256, n, dtype=np.uint8) for n in (300_000, 7, 0, 100_001, 2_000_000, 64, 90_000)]
    raws.append(np.concatenate([rng.integers(0, 256, 4096, dtype=np.uint8), np.zeros(5, np.uint8)])[:4097])  # longer than nbytes
    specs = [("bfloat16", (n // 2,)) if n % 2 == 0 else ("uint8", (n,)) for n in (r.shape[0] for r in raws)]
    specs[-1] = ("uint8", (4096,))
    want = [digest_buffer(r, d, s) for r, (d, s) in zip(raws, specs)]
    monkeypatch.setattr(_buffers, "WINDOW_BYTES", 400_000)  # windows: [0, 1, 2, 3], [4], [5, 6, 7]
    calls: list[int] = []
    real = _numba.lanes_digest_at
    monkeypatch.setattr(_numba, "lanes_digest_at", lambda a, n, s, keep: calls.append(len(a)) or real(a, n, s, keep))
    pulled: list[int] = []
    done: list[tuple[int, int]] = []  # (nbytes, buffers pulled by then)

    def buffers():  # type: ignore[no-untyped-def]
        for i, (r, (d, s)) in enumerate(zip(raws, specs)):
            pulled.append(i)
            yield r, d, s, f"t{i}"

    out = digest_buffers(buffers(), backend="numba", done=lambda n: done.append((n, len(pulled))))
    assert [d for d, _ in out] == want and all(d.algo == "nemo-rl-v3" for d, _ in out)
    assert calls == [4, 1, 3]
    sizes = [r.shape[0] if i < 7 else 4096 for i, r in enumerate(raws)]
    assert [n for n, _ in done] == sizes
    assert [p for _, p in done] == [4, 4, 4, 4, 5, 8, 8, 8]  # reported after its own window, before the next is read
    rates = [s / n for (_, s), n in zip(out, sizes) if n]
    assert all(s >= 0 for _, s in out) and rates[0] == pytest.approx(rates[1]) == pytest.approx(rates[2])
    calls.clear()
    monkeypatch.setattr(_buffers, "_MOST_HELD", 3)  # a batch also ends at a number of buffers, whatever their bytes
    again = digest_buffers(buffers(), backend="numba", window_bytes=10**9)
    assert [d for d, _ in again] == want and calls == [3, 3, 2]
    calls.clear()
    assert [d for d, _ in digest_buffers(buffers(), backend="numba", window_bytes=0)] == want and calls == [1] * 8


def test_digest_buffers_names_a_short_buffer_before_its_window_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from wcviz.digest import _numba

    calls: list[int] = []
    monkeypatch.setattr(_numba, "lanes_digest_at", lambda *a: calls.append(1))
    good = np.zeros(64, dtype=np.uint8)
    with pytest.raises(DigestError, match=r"tensor 'short'.*expected at least 8 bytes"):
        digest_buffers([(good, "uint8", (64,), "ok"), (good[:4], "float32", (2,), "short")], backend="numba")
    assert calls == []


@pytest.mark.parametrize("bad", [-1, 1.5, "512", True])
def test_digest_buffers_refuses_a_bad_window(bad: object) -> None:
    with pytest.raises(ValueError, match=r"window_bytes must be a whole number of bytes >= 0, got"):
        digest_buffers([(np.zeros(8, np.uint8), "uint8", (8,), "t")], backend="numba", window_bytes=bad)  # type: ignore[arg-type]


def test_an_unmappable_checkpoint_is_digested_one_read_tensor_at_a_time(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Where the file cannot be mapped, each tensor is a copy: each is digested (reported done) before the next is read."""
    import contextlib

    sd = {f"layers.{i}.weight": torch.randn(3000 + i) for i in range(5)}
    save_file(sd, str(tmp_path / "m.safetensors"))
    want = from_safetensors(tmp_path, progress=False).set_index("name")["digest"]

    @contextlib.contextmanager
    def unmappable(f):  # type: ignore[no-untyped-def]
        yield None

    events: list[str] = []
    real_read, real_digest = st._read, st.digest_buffers
    monkeypatch.setattr(st, "_mapped", unmappable)
    monkeypatch.setattr(st, "_read", lambda f, e: events.append("read") or real_read(f, e))
    monkeypatch.setattr(st, "digest_buffers", lambda b, **k: real_digest(b, **{**k, "done": lambda n: events.append("done")}))
    got = from_safetensors(tmp_path, progress=False).set_index("name")["digest"]
    assert got.equals(want)
    assert events == ["read", "done"] * 5
