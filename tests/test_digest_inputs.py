"""What the digest functions do with inputs that are not plain tensors or plain buffers: refuse them by name,
or digest exactly what a plain input with the same logical value gives."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
import torch

from wcviz import DigestError
from wcviz.digest import DigestAccumulator, TensorMeta, compare_digests, digest_buffer, digest_buffers, digest_hex, digest_many, fill_digest
from wcviz.refit._control import checked_digests
from wcviz.refit.verify import RefitProtocolError

ALGOS = ["nemo-rl-v3", "sha256", "vllm-sha256", "sglang-cpu", "sglang-gpu"]


# ------------------------------------------------------------------ tensors whose bytes are not their own storage


def _entry_points(t: torch.Tensor, name: str) -> dict[str, object]:
    return {
        "digest_hex": lambda: digest_hex(t, name=name),
        "digest_hex torch": lambda: digest_hex(t, name=name, backend="torch"),
        "digest_hex sha256": lambda: digest_hex(t, name=name, algo="sha256"),
        "digest_many": lambda: digest_many({name: t}),
        "digest_many torch": lambda: digest_many({name: t}, backend="torch"),
        "digest_many sglang-gpu": lambda: digest_many({name: t}, algo="sglang-gpu"),
        "accumulator": lambda: DigestAccumulator().add(name, t),
    }


def _refused_everywhere(t: torch.Tensor, name: str, *needles: str) -> None:
    for label, call in _entry_points(t, name).items():
        with pytest.raises(DigestError) as e:
            call()  # type: ignore[operator]
        for needle in (repr(name), *needles):
            assert needle in str(e.value), (label, str(e.value))


def test_a_dtensor_is_refused_by_name_with_what_to_digest_instead() -> None:
    """FSDP2 / DTensor-policy weights: before, the batch path said "every byte count must be >= 0" (naming no tensor)
    and the single path failed inside ``.numpy()``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    fd, path = tempfile.mkstemp()
    os.close(fd)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        w = distribute_tensor(torch.randn(4, 6), init_device_mesh("cpu", (1,)), [Shard(0)])
        _refused_everywhere(w, "layers.0.w", "DTensor", "to_local()", "full_tensor()")
        assert digest_hex(w.to_local()) == digest_hex(w.full_tensor())  # the hint works (one rank: the same bytes)
    finally:
        dist.destroy_process_group()
        os.unlink(path)


def test_a_fake_tensor_a_zero_tensor_and_a_lazy_parameter_are_refused_by_name() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(4)
    _refused_everywhere(fake, "fake.w", "FakeTensor")
    _refused_everywhere(torch._efficientzerotensor(4), "grad.w", "ZeroTensor")  # data_ptr() is 0
    _refused_everywhere(torch.nn.LazyLinear(3).weight, "lazy.w", "uninitialized")


def test_a_subclass_over_real_storage_digests_as_its_plain_tensor() -> None:
    class Tagged(torch.Tensor):
        """A subclass that adds nothing but its name: its bytes are its own storage."""

    x = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    tagged = x.as_subclass(Tagged)
    for algo in ALGOS:
        want = digest_hex(x, algo=algo)
        assert digest_hex(tagged, algo=algo) == want
        assert digest_many({"a": tagged, "b": torch.nn.Parameter(x)}, algo=algo) == {"a": want, "b": want}


# ------------------------------------------------------------------ raw buffers


def test_a_buffers_shape_must_be_whole_non_negative_dimensions() -> None:
    raw = np.arange(64, dtype=np.uint8)
    for shape in [(-1, 4), (-2, -2), (4.7,), (True, 4), ("4",)]:
        for call in (
            lambda: digest_buffer(raw, "float32", shape, name="w"),
            lambda: digest_buffers([(raw, "float32", shape, "w")]),
            lambda: digest_buffer(raw, "float32", shape, name="w", algo="sha256"),
        ):
            with pytest.raises(DigestError, match=r"tensor 'w': shape .* not a whole dimension >= 0"):
                call()
    with pytest.raises(DigestError, match=r"tensor 'w': expected a 1-d uint8 array .* got a 2-d uint8 array of shape \[8, 8\]"):
        digest_buffer(raw.reshape(8, 8), "float32", (4,), name="w")


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("offset", [0, 1])
def test_a_strided_buffer_digests_as_its_bytes_in_order(algo: str, offset: int) -> None:
    """``raw[::2]`` raised a numpy error when its start was aligned, and digested correctly when it was not."""
    raw = np.random.default_rng(3).integers(0, 256, 200, dtype=np.uint8)
    strided = raw[offset::2]
    want = digest_hex(torch.from_numpy(strided[:64].copy()).view(torch.float32).reshape(4, 4), algo=algo)
    assert digest_buffer(strided, "float32", (4, 4), algo=algo, name="w") == want
    assert digest_buffers([(strided, "float32", (4, 4), "w")], algo=algo)[0][0] == want


def test_an_unknown_backend_is_refused_for_every_algorithm() -> None:
    x = torch.ones(3)
    for algo in ALGOS:
        for call in (
            lambda: digest_hex(x, algo=algo, backend="bogus"),
            lambda: digest_many({"x": x}, algo=algo, backend="bogus"),
            lambda: DigestAccumulator(algo=algo, backend="bogus"),
            lambda: digest_buffer(np.zeros(12, dtype=np.uint8), "float32", (3,), algo=algo, backend="bogus"),
        ):
            with pytest.raises(ValueError, match="unknown digest backend 'bogus'"):
                call()


def test_metadata_and_fills_refuse_shapes_and_counts_that_contradict_each_other() -> None:
    with pytest.raises(DigestError, match=r"shape \[-1, 3\] has -1"):
        TensorMeta.parse((-1, 3), "float32")
    with pytest.raises(ValueError, match="nbytes 10 contradicts torch.bfloat16 \\[2, 3\\] \\(12 bytes\\)"):
        fill_digest("nemo-rl-v3", "bfloat16", [2, 3], 10, 0)
    assert fill_digest("nemo-rl-v3", "bfloat16", [2, 3], 12, 0) == digest_hex(torch.zeros(2, 3, dtype=torch.bfloat16))
    # a dtype this PyTorch does not know still has a digest: the seeds take its name as written
    assert len(fill_digest("nemo-rl-v3", "float99_future", [2], 7, 0)) == 32


# ------------------------------------------------------------------ comparing values that are not digests


@pytest.mark.parametrize("bad", [None, "", "error", "n/a", "0" * 31, 7])
def test_compare_digests_never_matches_two_values_that_are_not_digests(bad: object) -> None:
    """Two failures written the same way on both sides compared equal: "no difference"."""
    with pytest.raises(DigestError, match="sender digest of 'w'"):
        compare_digests({"w": bad, "v": "0" * 32}, {"w": bad, "v": "0" * 32})  # type: ignore[dict-item]
    with pytest.raises(DigestError, match="receiver digest of 'w'"):
        compare_digests({"w": "1" * 32}, {"w": bad})  # type: ignore[dict-item]
    assert compare_digests({"w": "A" * 32, "v": "0" * 32}, {"w": "a" * 32, "v": "1" * 32}) == ["v"]


def test_a_receiver_that_sends_something_other_than_digests_is_a_protocol_error() -> None:
    assert checked_digests({"w": "0" * 32}, "ipc:///x") == {"w": "0" * 32}
    for bad in ("", "error", "0" * 64):
        with pytest.raises(RefitProtocolError, match="a digest for 'w' that is not one"):
            checked_digests({"w": bad}, "ipc:///x")
    from wcviz.refit.broadcast import _received  # the broadcast's ranks, in the sender's algorithm

    assert _received(2, {"w": "0" * 16}, "sglang-cpu") == {"w": "0" * 16}
    for bad, algo in (("error", "nemo-rl-v3"), ("0" * 32, "sglang-cpu"), ("0" * 16, "nemo-rl-v3")):
        with pytest.raises(RefitProtocolError, match="rank 2 sent a digest for 'w' that is not one"):
            _received(2, {"w": bad}, algo)


# ------------------------------------------------------------------ the sglang-gpu kernel under numba's own thread pool


def test_threads_digesting_at_once_agree_and_do_not_abort_the_process() -> None:
    """numba's workqueue layer (where no OpenMP or TBB runtime is installed) aborts the whole process when two
    threads launch parallel kernels at once; the sglang-gpu kernel once took no lock (SIGABRT, exit 134). The
    kernels now run no numba parallel loop: threads that digest at once share the helper threads (``_threads``)
    and each gets its own digests, under that layer as under any."""
    script = textwrap.dedent(
        """
        import threading
        import torch
        from wcviz.digest import digest_hex, digest_many
        x = torch.randn(1 << 20)
        many = {f"w{i}": torch.randn(100 + 37 * i) for i in range(40)}
        want = {a: digest_hex(x, algo=a) for a in ("sglang-gpu", "nemo-rl-v3")}
        want_many = {k: str(v) for k, v in digest_many(many).items()}
        bad = []
        def work(algo):
            for _ in range(6):
                d = digest_hex(x, algo=algo)
                if d != want[algo]:
                    bad.append((algo, d))
                if {k: str(v) for k, v in digest_many(many).items()} != want_many:
                    bad.append((algo, "many"))
        ts = [threading.Thread(target=work, args=(a,)) for a in ("sglang-gpu", "nemo-rl-v3", "sglang-gpu", "nemo-rl-v3")]
        [t.start() for t in ts]
        [t.join() for t in ts]
        assert not bad, bad
        print("agreed", len(ts))
        """
    )
    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue", "NUMBA_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "agreed 4" in done.stdout


@pytest.mark.parametrize("storage", [0, 64])
def test_a_tensor_whose_storage_was_freed_under_it_is_refused_by_name_on_every_path(storage: int) -> None:
    """FSDP frees a resharded parameter with ``untyped_storage().resize_(0)``. The numba path read the tensor's bytes
    where it said they were: a segfault, or (storage shrunk to a little) a different digest on every call."""
    big = torch.randn(1 << 22)
    big.untyped_storage().resize_(storage)
    view = torch.randn(4096)[8:].t()  # a strided view over storage that is then freed: the torch path copies it
    view.untyped_storage().resize_(storage)
    why = rf"tensor 'w' \(torch.float32 \[4194304\]\) reaches 16777216 bytes into its storage, which holds {storage}: its storage was freed"
    for backend in ("numba", "torch"):
        with pytest.raises(DigestError, match=why.replace("tensor 'w'", "tensor")):
            digest_hex(big, backend=backend)
    with pytest.raises(DigestError, match=why):
        digest_many({"ok": torch.ones(3), "w": big})
    with pytest.raises(DigestError, match=r"tensor 'v' \(torch.float32 \[4088\]\) reaches 16384 bytes"):
        digest_many([("v", view), ("ok", torch.ones(3))], backend="torch")
    acc = DigestAccumulator()
    with pytest.raises(DigestError, match=why):
        acc.add_many([("ok", torch.ones(3)), ("w", big)])
    assert len(acc) == 0


def test_add_many_adds_all_or_nothing_and_takes_a_mapping() -> None:
    """A failed add_many left the tensors before the bad one added, so the corrected retry was refused as duplicates;
    a mapping (as digest_many takes) was read as its keys."""
    a, b, c = torch.randn(4), torch.randn(5), torch.randn(6)
    acc = DigestAccumulator()
    for bad in (torch.empty(3, device="meta"), torch.randn(3).to_sparse()):
        with pytest.raises(DigestError, match="tensor 'bad' is"):
            acc.add_many([("a", a), ("b", b), ("bad", bad), ("c", c)])
        assert len(acc) == 0
    acc.add_many({"a": a, "b": b, "bad": torch.zeros(3), "c": c})  # the retry, as a mapping
    assert acc.hex() == digest_many([("a", a), ("b", b), ("bad", torch.zeros(3)), ("c", c)])
    with pytest.raises(DigestError, match="duplicate parameter names: a, c"):
        acc.add_many({"a": a, "d": torch.ones(1), "c": c})
    assert len(acc) == 4
