"""The colocated IPC refit: a real receiver process, a real socket, bytes that provably arrive.

One receiver process (multiprocessing *spawn*: numba/OpenMP threads and fork do
not mix) serves every stream its test sends it a command for, and reports back
what its model holds byte for byte, the messages it saw, how many digests it
computed and whether it still maps any staging buffer. Only the tests that kill
a receiver start processes of their own.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from collections.abc import Callable
from typing import Any

import pytest
import torch

from wcviz import DigestError
from wcviz.refit import (
    Fault,
    FaultPlan,
    RefitDigestMismatch,
    RefitError,
    RefitProtocolError,
    RefitResult,
    RefitTimeout,
    _ipc_receiver,
    _packing,
    ipc,
)
from wcviz.refit._transport import Transport
from wcviz.refit.ipc import IPCReceiver, IPCSender

BUFFER = 32 << 10  # tiny staging buffers: several ping-pong batches, and 32 KiB parameters travel alone
FAST = 2.0  # seconds: the timeouts of the tests where a peer goes silent
SLACK = 5.0  # what a timeout may overrun by on a loaded 2-core machine (still proves: no hang)


def build_model() -> dict[str, torch.Tensor]:
    """A small Llama-like state dict: mixed dtypes, a 0-d and an empty tensor, two parameters too big to share a buffer."""
    g = torch.Generator().manual_seed(0)

    def rnd(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if dtype.is_floating_point:
            return torch.randn(shape, generator=g).to(dtype)
        return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)

    m = {"model.embed_tokens.weight": rnd((128, 128), torch.bfloat16)}
    for i in range(4):
        p = f"model.layers.{i}."
        m |= {
            p + "input_layernorm.weight": rnd((32,), torch.float32),
            p + "self_attn.q_proj.weight": rnd((32, 32), torch.float32),
            p + "self_attn.k_proj.weight": rnd((16, 32), torch.bfloat16),
            p + "self_attn.v_proj.weight": rnd((16, 32), torch.float16),
            p + "self_attn.o_proj.weight": rnd((32, 32), torch.float32),
            p + "post_attention_layernorm.weight": rnd((32,), torch.float32),
            p + "mlp.gate_proj.weight": rnd((64, 32), torch.bfloat16),
            p + "mlp.up_proj.weight": rnd((64, 32), torch.bfloat16),
            p + "mlp.down_proj.weight": rnd((32, 64), torch.float32),
        }
        if i == 0:
            m |= {
                p + "self_attn.qk_norm.weight": rnd((4, 8), torch.float32),
                p + "self_attn.o_proj.bias": rnd((0,), torch.float32),
                p + "mlp.expert_ids": rnd((7,), torch.int64),
            }
    m |= {
        "model.rotary_emb.scale": rnd((), torch.float32),
        "model.norm.weight": rnd((32,), torch.float32),
        "lm_head.weight": rnd((64, 128), torch.float32),
    }
    return m


MODEL = build_model()
META = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in MODEL.items()}
BUCKETS = _packing.plan([(n, t.numel() * t.element_size()) for n, t in MODEL.items()], BUFFER)

FLIP = "model.layers.1.mlp.down_proj.weight"
DROP = "model.layers.2.self_attn.q_proj.weight"
NORM = "model.norm.weight"  # 128 bytes: room to shift inside its 512-byte slot
CAST = "model.layers.1.mlp.gate_proj.weight"  # bf16
K0, V0, V3 = (
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.3.self_attn.v_proj.weight",
)
QK_NORM = "model.layers.0.self_attn.qk_norm.weight"


def raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def shm_leftovers() -> list[str]:
    """Segments this test process created and never unlinked."""
    return sorted(p for p in os.listdir("/dev/shm") if p.startswith(f"wcviz_{os.getpid()}_"))


# --- the receiver process --------------------------------------------------------------


class DyingReceiver(IPCReceiver):
    """Dies (SIGKILL) on COMPLETE, before it can answer."""

    def _complete(self, stream: Any) -> dict[str, Any]:
        os.kill(os.getpid(), signal.SIGKILL)
        return {}


def count_digests(calls: list[int], put: Callable[[str, Any], None]) -> None:
    """Count in ``calls[0]`` every tensor wcviz digests: one per call of ``_words`` or ``_sha256_of``, one per
    tensor of a batched ``_words_many`` call; ``put(name, fn)`` installs each counting wrapper."""
    from wcviz.digest import _api

    for fn, tensors in (("_words", lambda a: 1), ("_sha256_of", lambda a: 1), ("_words_many", lambda a: len(a[0]))):
        original = getattr(_api, fn)

        def counted(*a: Any, _original: Any = original, _tensors: Any = tensors, **k: Any) -> Any:
            calls[0] += _tensors(a)
            return _original(*a, **k)

        put(fn, counted)


def receiver_main(conn: Any) -> None:
    """Serve one refit per command from the test until told to stop (None); report each."""
    from wcviz.digest import _api, digest_hex

    digest_hex(torch.ones(3))  # load numba now, not inside a timed wait
    calls = [0]
    count_digests(calls, lambda fn, f: setattr(_api, fn, f))
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        conn.send(serve(cmd, calls))


def serve(cmd: dict[str, Any], calls: list[int]) -> dict[str, Any]:
    meta = cmd["metadata"]
    model = {n: torch.zeros(shape, dtype=getattr(torch, dtype)) for n, (shape, dtype) in meta.items()}
    loads: list[list[str]] = []

    def load_weights(batch: list[tuple[str, torch.Tensor]]) -> None:
        action = cmd["on_load"].get(len(loads))
        loads.append([n for n, _ in batch])
        if action == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "interrupt":
            raise KeyboardInterrupt
        if action == "fail":
            raise RuntimeError("out of memory loading the batch")
        if action == "hang":
            time.sleep(cmd["hang_s"])
        for name, t in batch:
            model[name].copy_(t)

    beside: list[tuple[bool, bool]] = []  # per digested batch: (on the serving thread, its load had begun)
    original_add_all = _ipc_receiver._add_all

    def probed(acc: Any, views: list[tuple[str, torch.Tensor]]) -> None:
        if not views:  # nothing to load: load_weights is not called for this batch
            return original_add_all(acc, views)
        i = len(beside)
        on_main = threading.current_thread() is threading.main_thread()
        deadline = time.monotonic() + 10.0
        while not on_main and len(loads) <= i and time.monotonic() < deadline:
            time.sleep(0.001)  # beside the load: wait until the engine is loading this very batch
        beside.append((on_main, len(loads) > i))
        if cmd["slow_digest_s"]:
            time.sleep(cmd["slow_digest_s"])
        if cmd["break_digest"]:
            raise DigestError(f"tensor {views[0][0]!r} cannot be read")
        return original_add_all(acc, views)

    _ipc_receiver._add_all = probed
    wire: list[tuple[str, dict[str, Any]]] = []
    before = calls[0]
    digests: list[Any] = []
    error = None
    cls = DyingReceiver if cmd["die_on_complete"] else IPCReceiver
    with cls(
        cmd["address"],
        meta,
        load_weights,
        verify=cmd["verify"],
        faults=cmd["faults"],
        timeout_s=cmd["timeout_s"],
        wire_log=wire,
        overlap=cmd["overlap"],
    ) as receiver:
        try:
            for _ in range(cmd["serves"]):
                digests.append(receiver.serve())
        except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt too: report it
            error = f"{type(e).__name__}: {e}"
        finally:
            _ipc_receiver._add_all = original_add_all
        # the receiver is still open: serve() itself must have let go of every buffer
        mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if "wcviz_" in line]
    return {
        "beside": beside,
        "error": error,
        "digests": [dict(d) if d is not None else None for d in digests],
        "model": {n: raw(t) for n, t in model.items()},
        "wire": wire,
        "digest_calls": calls[0] - before,
        "mapped": mapped,
        "loads": loads,
    }


@dataclass
class Worker:
    proc: Any
    conn: Any

    def start(self, address: str, **cmd: Any) -> None:
        defaults = {
            "metadata": META,
            "verify": "log",
            "faults": FaultPlan(),
            "timeout_s": 10.0,
            "serves": 1,
            "on_load": {},
            "hang_s": 0.0,
            "die_on_complete": False,
            "overlap": False,
            "slow_digest_s": 0.0,
            "break_digest": False,
        }
        self.conn.send({**defaults, **cmd, "address": address})

    def report(self, timeout: float = 30.0) -> dict[str, Any]:
        assert self.conn.poll(timeout), "the receiver process did not report"
        return self.conn.recv()


def spawn_receiver() -> Worker:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(there,), daemon=True)
    proc.start()
    assert here.poll(120) and here.recv() == "ready", "the receiver process did not start"
    return Worker(proc, here)


@pytest.fixture(scope="module", autouse=True)
def numba_loaded() -> None:
    """Load the digest's numba kernels before any timed wait (a receiver waits on the sender's digests)."""
    from wcviz.digest import digest_hex

    digest_hex(torch.ones(3))


@pytest.fixture(scope="module")
def worker():
    w = spawn_receiver()
    yield w
    w.conn.send(None)
    w.proc.join(10)
    if w.proc.is_alive():
        w.proc.kill()


@pytest.fixture
def sender_digests(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the digests computed in this (the sender's) process."""
    from wcviz.digest import _api

    calls = [0]
    count_digests(calls, lambda fn, f: monkeypatch.setattr(_api, fn, f))
    return calls


class TimedLog(list):
    """A wire log that also notes when each message went out or came in."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def append(self, entry: Any) -> None:
        self.times.append(time.monotonic())
        super().append(entry)

    def silence(self) -> float:
        """Seconds since the last message: how long a timed-out wait lasted."""
        return time.monotonic() - self.times[-1]


@dataclass
class Run:
    results: list[RefitResult | None]
    errors: list[BaseException | None]
    waited: list[float]  # from the last message of each send() to its end
    report: dict[str, Any]
    wire: list[tuple[str, dict[str, Any]]]
    socket: Path
    leftovers: list[str] = field(default_factory=list)

    @property
    def result(self) -> RefitResult | None:
        return self.results[0]

    @property
    def error(self) -> BaseException | None:
        return self.errors[0]


def refit(
    worker: Worker,
    *sends: dict[str, torch.Tensor],
    verify: str = "log",
    receiver_verify: str | None = None,
    faults: FaultPlan | None = None,
    timeout_s: float = 10.0,
    receiver_timeout_s: float = 10.0,
    send_kwargs: dict[str, Any] | None = None,
    overlap: bool = False,
    **cmd: Any,
) -> Run:
    """Stream each of ``sends`` (default: the model once) from this process to the worker; gather both ends.

    ``overlap`` is both ends' (digest beside the copy, or before it)."""
    sends = sends or (MODEL,)
    faults = faults or FaultPlan()
    cmd |= {"verify": receiver_verify or verify, "faults": faults, "timeout_s": receiver_timeout_s, "overlap": overlap}
    wire = TimedLog()
    results, errors, waited = [], [], []
    with IPCSender(
        verify=verify, faults=faults, buffer_bytes=BUFFER, timeout_s=timeout_s, wire_log=wire, overlap=overlap
    ) as sender:
        worker.start(sender.address, **cmd)
        for tensors in sends:
            try:
                results.append(sender.send(tensors, **(send_kwargs or {})))
                errors.append(None)
            except RefitError as e:
                results.append(None)
                errors.append(e)
            waited.append(wire.silence())
        socket = Path(sender.address.removeprefix("ipc://"))
    report = worker.report(timeout=cmd.get("timeout_s", 10.0) + cmd.get("hang_s", 0.0) + 20)
    return Run(results, errors, waited, report, wire, socket, shm_leftovers())


def assert_arrived(
    report: dict[str, Any], expect: dict[str, torch.Tensor], *, except_for: set[str] = frozenset()
) -> None:
    """The receiver's model holds ``expect``'s bytes exactly (but for ``except_for``)."""
    wrong = sorted(n for n, t in expect.items() if n not in except_for and report["model"][n] != raw(t))
    assert wrong == []


def assert_clean(run: Run) -> None:
    """Nothing left behind on either end: segments, socket file, the receiver's mappings."""
    assert run.leftovers == []
    assert not run.socket.exists() and not run.socket.parent.exists()
    assert run.report["mapped"] == []


def normalized(wire: list[tuple[str, dict[str, Any]]], *, drop: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Messages with buffer handles reduced to what they say (kind, size, transient) and ``drop`` removed."""
    out = []
    for direction, msg in wire:
        m = {k: v for k, v in msg.items() if k != drop}
        if "buffer" in m:
            m["buffer"] = (m["buffer"].kind, m["buffer"].nbytes, m["buffer"].transient)
        out.append((direction, m))
    return out


# --- the model exercises every path ----------------------------------------------------


def test_the_model_exercises_ping_pong_and_temporary_buffers() -> None:
    staging = [b for b in BUCKETS if not b.own]
    own = [b for b in BUCKETS if b.own]
    assert len(staging) >= 3 and len(own) == 2
    assert BUCKETS[0].own and BUCKETS[-1].own  # temporary buffers at both ends of the stream
    assert any(MODEL[n].ndim == 0 for n in MODEL) and any(MODEL[n].numel() == 0 for n in MODEL)


# --- 1. every mode delivers every byte; off digests nothing and says nothing more -------


@pytest.mark.parametrize("mode", ["off", "log", "enforce"])
def test_every_mode_delivers_every_byte(worker: Worker, mode: str, sender_digests: list[int]) -> None:
    run = refit(worker, verify=mode)
    assert run.error is None and run.report["error"] is None
    assert_arrived(run.report, MODEL)
    result = run.result
    assert result is not None and result.params == len(MODEL)
    assert result.nbytes == sum(t.numel() * t.element_size() for t in MODEL.values())
    if mode == "off":
        assert not result.verified and sender_digests[0] == 0 and run.report["digest_calls"] == 0
        assert run.report["digests"] == [None]
    else:
        assert result.ok and set(result.receiver) == set(MODEL)
        assert sender_digests[0] == len(MODEL) and run.report["digest_calls"] == len(MODEL)
    assert_clean(run)

    # what the sender sent is what the receiver got, through staging buffers that alternate
    sent = [m for d, m in run.wire if d == "send"]
    assert sent == [m for d, m in run.report["wire"] if d == "recv"]
    assert [m["op"] for m in sent] == ["prepare"] + ["batch"] * len(BUCKETS) + ["complete"]
    batches = [m for m in sent if m["op"] == "batch"]
    assert [m["names"] for m in batches] == [list(b.names) for b in BUCKETS]
    assert [m["used"] for m in batches] == [b.used for b in BUCKETS]
    assert [m["buffer"].transient for m in batches] == [b.own for b in BUCKETS]
    staging = [m["buffer"].key for m in batches if not m["buffer"].transient]
    assert len(set(staging)) == 2 and all(a != b for a, b in itertools.pairwise(staging))


def test_off_sends_exactly_the_messages_of_an_unverified_transport(worker: Worker) -> None:
    off, on = refit(worker, verify="off"), refit(worker, verify="log")
    assert off.result is not None and on.result is not None and on.result.ok
    for a, b in ((off.wire, on.wire), (off.report["wire"], on.report["wire"])):
        assert normalized(a) == normalized(b, drop="digests")
        assert not any("digests" in m for _, m in a)
    final = on.wire[-1][1]
    assert final["op"] == "ack" and set(final["digests"]) == set(MODEL)


def test_one_receiver_serves_refit_after_refit(worker: Worker) -> None:
    second = {n: t + 1 if t.is_floating_point() else t * 2 for n, t in MODEL.items()}
    run = refit(worker, MODEL, second, serves=2)
    assert run.errors == [None, None] and all(r is not None and r.ok for r in run.results)
    prepares = [m for d, m in run.wire if d == "send" and m["op"] == "prepare"]
    assert len(prepares) == 2 and "known" in prepares[1]  # asked every refit, with what the sender already holds
    infos = [m for d, m in run.wire if d == "recv" and m["op"] == "info"]
    assert "metadata" in infos[0] and infos[1] == {"op": "info", "unchanged": True}  # the metadata travelled once
    assert_arrived(run.report, second)
    assert_clean(run)


# --- 2. every fault at every point where it applies, with the exact names --------------

POINTS = ("sender_after_digest", "wire", "receiver_before_load")
CASES: list[tuple[str, tuple[Fault, ...], set[str], set[str]]] = []  # (id, faults, mismatched, missing)
for _point in POINTS:
    CASES += [
        (f"flip_bit-{_point}", (Fault("flip_bit", _point, (FLIP,), bit=13),), {FLIP}, set()),
        (f"drop_param-{_point}", (Fault("drop_param", _point, (DROP,)),), set(), {DROP}),
        (f"shift_offset-{_point}", (Fault("shift_offset", _point, (NORM,)),), {NORM}, set()),
        (f"cast_dtype-{_point}", (Fault("cast_dtype", _point, (CAST,), dtype="float16"),), {CAST}, set()),
        (f"swap_params-across-batches-{_point}", (Fault("swap_params", _point, (K0, V3)),), {K0, V3}, set()),
    ]
CASES += [
    ("swap_params-same-batch-receiver", (Fault("swap_params", "receiver_before_load", (K0, V0)),), {K0, V0}, set()),
    ("drop_buffer-staging", (Fault("drop_buffer", "wire", buffer=2),), set(), set(BUCKETS[2].names)),
    ("drop_buffer-temporary", (Fault("drop_buffer", "wire", buffer=0),), set(), set(BUCKETS[0].names)),
    (
        "shift_offset-no-room-clipped",
        (Fault("shift_offset", "wire", ("model.layers.2.mlp.down_proj.weight",)),),
        {"model.layers.2.mlp.down_proj.weight"},
        set(),
    ),
    (
        "shift_offset-temporary-buffer",
        (Fault("shift_offset", "wire", ("lm_head.weight",), shift=100),),
        {"lm_head.weight"},
        set(),
    ),
    (
        "flip_bit-0d-wire",
        (Fault("flip_bit", "wire", ("model.rotary_emb.scale",), bit=30),),
        {"model.rotary_emb.scale"},
        set(),
    ),
    (
        "flip_bit-and-drop_param",
        (Fault("flip_bit", "sender_after_digest", (FLIP,)), Fault("drop_param", "receiver_before_load", (DROP,))),
        {FLIP},
        {DROP},
    ),
]
assert len(BUCKETS[2].names) >= 2


@pytest.mark.parametrize("mode", ["log", "enforce"])
@pytest.mark.parametrize("faults,mismatched,missing", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_fault_is_reported_with_exact_names(
    worker: Worker,
    caplog: pytest.LogCaptureFixture,
    mode: str,
    faults: tuple[Fault, ...],
    mismatched: set[str],
    missing: set[str],
) -> None:
    with caplog.at_level(logging.WARNING, logger="wcviz.refit"):
        run = refit(worker, verify=mode, faults=FaultPlan(faults))
    assert run.report["error"] is None  # the receiver completed the stream
    bad = mismatched | missing
    if mode == "enforce":
        assert isinstance(run.error, RefitDigestMismatch)
        result = run.error.result
        assert all(name in str(run.error) for name in bad)
    else:
        assert run.error is None and run.result is not None
        result = run.result
        warned = {
            r.getMessage().split()[2]
            for r in caplog.records
            if r.name == "wcviz.refit" and r.levelno == logging.WARNING
        }
        assert warned == bad
    assert (set(result.mismatched), set(result.missing), result.unexpected) == (mismatched, missing, ())
    assert result.params == len(MODEL) and not result.ok
    assert_arrived(run.report, MODEL, except_for=bad)  # the faults struck only where they were aimed
    recast = {n for f in faults if f.kind == "cast_dtype" and f.point == "receiver_before_load" for n in f.params}
    for name in bad - missing - recast:  # (a bf16 -> fp16 cast may round-trip exactly when loaded back into bf16)
        assert run.report["model"][name] != raw(MODEL[name])
    assert_clean(run)


# --- 3. metadata drift after prepare ---------------------------------------------------


@pytest.mark.parametrize(
    "name,drifted",
    [(QK_NORM, MODEL[QK_NORM].reshape(8, 4)), (K0, MODEL[K0].to(torch.float16))],
    ids=["shape-same-bytes", "dtype-same-bytes"],
)
def test_same_size_drift_is_a_digest_mismatch(worker: Worker, name: str, drifted: torch.Tensor) -> None:
    run = refit(worker, {**MODEL, name: drifted})
    assert run.error is None and run.result is not None
    assert (run.result.mismatched, run.result.missing, run.result.unexpected) == ((name,), (), ())


@pytest.mark.parametrize(
    "tensors,named",
    [
        ({**MODEL, QK_NORM: MODEL[QK_NORM][:, :4]}, QK_NORM),
        ({**MODEL, "model.extra.weight": torch.ones(3)}, "model.extra.weight"),
    ],
    ids=["byte-size", "unknown-name"],
)
def test_framing_drift_is_refused_before_anything_is_sent(
    worker: Worker, tensors: dict[str, torch.Tensor], named: str
) -> None:
    run = refit(worker, tensors, MODEL)  # the refused refit, then a good one the same receiver serves
    assert isinstance(run.errors[0], RefitProtocolError) and named in str(run.errors[0])
    assert run.errors[1] is None and run.results[1] is not None and run.results[1].ok
    ops = [m["op"] for d, m in run.wire if d == "send"]
    assert ops[:2] == ["prepare", "prepare"]  # nothing but prepare went out for the refused refit
    assert run.report["error"] is None
    assert_arrived(run.report, MODEL)
    assert_clean(run)


class _UncheckedSender(IPCSender):
    """A sender with a bug: it never checks its tensors against the receiver's metadata before sending."""

    def _check_framing(self, tensors: Any, metadata: Any) -> None:
        return None  # the bug under test: nothing checked here, so the receiver must refuse the batch itself


def test_a_restarted_receiver_with_another_model_is_prepared_anew(worker: Worker) -> None:
    """A receiver at the same address now declares another size: the next send learns it and refuses up front."""
    name = "model.layers.1.mlp.down_proj.weight"
    wire: list[tuple[str, dict[str, Any]]] = []
    with IPCSender(verify="log", buffer_bytes=BUFFER, timeout_s=10, wire_log=wire) as sender:
        worker.start(sender.address)
        assert sender.send(MODEL).ok
        assert worker.report()["error"] is None
        worker.start(sender.address, metadata={**META, name: ((32, 32), "float32")})
        with pytest.raises(RefitProtocolError, match=rf"not started: byte sizes differ for {name} .*\[32, 32\]"):
            sender.send(MODEL)
        assert sender.send({**MODEL, name: MODEL[name][:, :32]}).ok  # what it declares now arrives intact
        report = worker.report()
    assert report["error"] is None and sender.metadata is not None and sender.metadata[name].shape == (32, 32)
    first = len(BUCKETS) + 2  # the first refit: prepare, its batches, COMPLETE
    assert [m["op"] for d, m in wire if d == "send"][first : first + 3] == ["prepare", "prepare", "batch"]


def test_receiver_refuses_a_batch_that_does_not_add_up(worker: Worker) -> None:
    """A sender that does not check framing (a bug) sends a batch this receiver's metadata slices otherwise."""
    name = "model.layers.1.mlp.down_proj.weight"
    wire: list[tuple[str, dict[str, Any]]] = []
    with _UncheckedSender(verify="log", buffer_bytes=BUFFER, timeout_s=10, wire_log=wire) as sender:
        worker.start(sender.address)
        assert sender.send(MODEL).ok
        assert worker.report()["error"] is None
        worker.start(sender.address, metadata={**META, name: ((32, 32), "float32")})  # 4096 bytes, not 8192
        with pytest.raises(
            RefitProtocolError, match=rf"refused batch \d+ \(.*{name}.*\).*{name} float32 \[32, 32\] \(4096 bytes\)"
        ):
            sender.send(MODEL)
        report = worker.report()
    assert report["error"].startswith("RefitProtocolError") and name in report["error"]
    assert report["loads"] and all(name not in names for names in report["loads"])  # the refused batch was never loaded
    assert wire[-1][1]["ok"] is False


# --- 4. a sender that verifies, a receiver that does not ---------------------------------


def test_receiver_without_digests_is_a_protocol_error(worker: Worker) -> None:
    run = refit(worker, verify="enforce", receiver_verify="off")
    assert isinstance(run.error, RefitProtocolError) and not isinstance(run.error, RefitDigestMismatch)
    assert "no digests" in str(run.error)
    assert run.report["digest_calls"] == 0 and run.report["error"] is None
    assert_arrived(run.report, MODEL)


# --- 5. dead and hung receivers ----------------------------------------------------------


@pytest.mark.parametrize("where", ["mid-stream", "before-complete"])
def test_dead_receiver_is_a_timeout(where: str) -> None:
    dying = spawn_receiver()
    try:
        wire = TimedLog()
        with IPCSender(verify="log", buffer_bytes=BUFFER, timeout_s=FAST, wire_log=wire) as sender:
            kw = {"on_load": {1: "die"}} if where == "mid-stream" else {"die_on_complete": True}
            dying.start(sender.address, **kw)
            t0 = time.monotonic()
            with pytest.raises(RefitTimeout) as err:
                sender.send(MODEL)
            waited, elapsed = wire.silence(), time.monotonic() - t0
            socket = Path(sender.address.removeprefix("ipc://"))
        dying.proc.join(10)
        assert dying.proc.exitcode == -signal.SIGKILL
    finally:
        if dying.proc.is_alive():
            dying.proc.kill()
    awaited = "the ack of batch 1" if where == "mid-stream" else "the final ack"
    assert awaited in str(err.value) and sender.address in str(err.value)
    assert wire[-1][1]["op"] == ("batch" if where == "mid-stream" else "complete")
    assert FAST <= waited < FAST + SLACK and elapsed < 30
    assert shm_leftovers() == [] and not socket.exists() and not socket.parent.exists()


def test_hung_receiver_is_a_timeout_and_the_receiver_gives_up_too(worker: Worker) -> None:
    run = refit(worker, timeout_s=FAST, receiver_timeout_s=FAST, on_load={1: "hang"}, hang_s=FAST + 1)
    assert isinstance(run.error, RefitTimeout) and "the ack of batch 1" in str(run.error)
    assert FAST <= run.waited[0] < FAST + SLACK
    assert run.report["error"].startswith("RefitTimeout") and "waiting for the next request" in run.report["error"]
    assert_clean(run)


def test_load_failure_is_reported_at_once_not_as_a_timeout(worker: Worker) -> None:
    run = refit(worker, timeout_s=30.0, on_load={1: "fail"})
    assert isinstance(run.error, RefitProtocolError)
    assert "refused batch 1" in str(run.error) and "out of memory loading the batch" in str(run.error)
    assert run.waited[0] < 5.0  # the error reply, not the 30-second timeout
    assert run.report["error"].startswith("RuntimeError")
    assert_clean(run)


# --- staging buffers kept from one send to the next -----------------------------------


def _staging_keys(wire: list[tuple[str, dict[str, Any]]]) -> list[set[str]]:
    """The staging buffers (not the temporary ones) each stream's batches went out in, stream by stream."""
    streams: list[set[str]] = [set()]
    for direction, m in wire:
        if direction == "send" and m["op"] == "batch" and not m["buffer"].transient:
            streams[-1].add(m["buffer"].key)
        elif direction == "send" and m["op"] == "complete":
            streams.append(set())
    return streams[:-1]


@pytest.mark.parametrize("keep", [True, False])
def test_staging_buffers_are_kept_between_sends_unless_asked_not_to(worker: Worker, keep: bool) -> None:
    second = {n: t + 1 if t.is_floating_point() else t * 2 for n, t in MODEL.items()}
    wire = TimedLog()
    with IPCSender(verify="log", buffer_bytes=BUFFER, timeout_s=10.0, wire_log=wire, keep_buffers=keep) as sender:
        worker.start(sender.address, serves=2)
        first_result = sender.send(MODEL)
        between = shm_leftovers()  # what this process holds while the trainer trains
        second_result = sender.send(second)
    report = worker.report()
    assert first_result.ok and second_result.ok and report["error"] is None
    assert_arrived(report, second)
    keys = _staging_keys(wire)
    assert len(keys) == 2 and all(len(k) == 2 for k in keys)
    if keep:
        assert keys[0] == keys[1] and sorted(between) == sorted(keys[0])
    else:
        assert not keys[0] & keys[1] and between == []
    assert shm_leftovers() == [] and report["mapped"] == []  # close() freed them; the receiver let go after each stream


def test_a_failed_send_frees_its_staging_buffers(worker: Worker) -> None:
    with IPCSender(verify="log", buffer_bytes=BUFFER, timeout_s=10.0) as sender:
        worker.start(sender.address, on_load={1: "fail"})
        with pytest.raises(RefitProtocolError, match="out of memory loading the batch"):
            sender.send(MODEL)
        assert shm_leftovers() == []  # nothing kept that a receiver which gave up mid-batch might still read
        assert sender._kept == []
    assert worker.report()["error"].startswith("RuntimeError")


# --- digesting beside the copy: the same digests, on another thread, never past the buffer ----


@pytest.mark.parametrize("overlap", [True, False])
def test_the_receiver_digests_each_batch_while_the_engine_loads_it(worker: Worker, overlap: bool) -> None:
    run = refit(worker, overlap=overlap)
    assert run.result is not None and run.result.ok and run.report["error"] is None
    if overlap:  # on the worker thread, while load_weights was loading that very batch
        assert run.report["beside"] == [(False, True)] * len(BUCKETS)
    else:  # on the serving thread, before load_weights was called for it
        assert run.report["beside"] == [(True, False)] * len(BUCKETS)
    assert_clean(run)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_sender_digests_beside_its_packing_only_when_asked(
    worker: Worker, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[bool] = []
    original = ipc._add_new

    def noted(acc: Any, named: list[tuple[str, torch.Tensor]]) -> None:
        threads.append(threading.current_thread() is threading.main_thread())
        original(acc, named)

    monkeypatch.setattr(ipc, "_add_new", noted)
    run = refit(worker, overlap=overlap)
    assert run.result is not None and run.result.ok
    assert len(threads) == len(BUCKETS) + 1  # each bucket, then whatever never went out (nothing here)
    assert set(threads) == {not overlap}


def test_digests_and_verdicts_do_not_depend_on_where_the_digest_ran(worker: Worker) -> None:
    from wcviz.digest import digest_many

    want = {n: str(d) for n, d in digest_many(MODEL).items()}
    flip = FaultPlan([Fault("flip_bit", "wire", (FLIP,), bit=13)])
    for overlap in (True, False):
        clean, faulted = refit(worker, overlap=overlap), refit(worker, overlap=overlap, faults=flip)
        assert clean.result is not None and clean.result.ok
        assert dict(clean.result.sender) == want and dict(clean.result.receiver) == want
        assert faulted.result is not None and faulted.result.mismatched == (FLIP,)
        assert dict(faulted.result.sender) == want
        assert {n for n, d in faulted.result.receiver.items() if d != want[n]} == {FLIP}


def test_a_failed_load_waits_for_the_digest_still_reading_the_buffer(worker: Worker) -> None:
    # the digest still reads batch 1's buffer when the load fails: the receiver must not unmap
    # it under the digest (that would kill the process, and no report would come back)
    run = refit(worker, timeout_s=30.0, on_load={1: "fail"}, slow_digest_s=0.3, overlap=True)
    assert isinstance(run.error, RefitProtocolError) and "out of memory loading the batch" in str(run.error)
    assert run.report["error"].startswith("RuntimeError")
    assert run.report["beside"][:2] == [(False, True), (False, True)]
    assert_clean(run)


def test_an_error_on_the_receivers_digest_thread_is_its_answer(worker: Worker) -> None:
    run = refit(worker, overlap=True, break_digest=True)
    assert isinstance(run.error, RefitProtocolError) and "refused batch 0" in str(run.error)
    assert "cannot be read" in str(run.error) and run.report["error"].startswith("DigestError")
    assert_clean(run)


def test_an_error_on_the_senders_digest_thread_reaches_the_caller(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(acc: Any, named: list[tuple[str, torch.Tensor]]) -> None:
        raise DigestError(f"tensor {named[0][0]!r} cannot be read")

    monkeypatch.setattr(ipc, "_add_new", broken)
    with IPCSender(verify="log", buffer_bytes=BUFFER, timeout_s=10.0, overlap=True) as sender:
        worker.start(sender.address)
        with pytest.raises(DigestError, match="cannot be read"):
            sender.send(MODEL)
    report = worker.report()
    assert report["error"] is None  # the receiver got the whole stream; the sender could not digest it
    assert_arrived(report, MODEL)
    assert shm_leftovers() == [] and report["mapped"] == []


def test_no_receiver_is_a_timeout() -> None:
    with IPCSender(verify="log", timeout_s=0.5) as sender:
        t0 = time.monotonic()
        with pytest.raises(RefitTimeout, match=r"sending the prepare request: no receiver connected at ipc://"):
            sender.send(MODEL)
        assert time.monotonic() - t0 < 0.5 + SLACK


# --- 6. interruption ----------------------------------------------------------------------


def test_sender_interrupted_mid_stream_leaves_nothing(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    # Strike while packing the 4th staging batch: the batch still loading is in a buffer the receiver
    # attached before; the sender takes its ack, then tells the receiver the stream is over.
    victim = MODEL[[b for b in BUCKETS if not b.own][3].names[0]]
    real_pack = ipc.pack

    def pack(buf: torch.Tensor, offset: int, t: torch.Tensor) -> None:
        if t is victim:
            raise KeyboardInterrupt
        real_pack(buf, offset, t)

    monkeypatch.setattr(ipc, "pack", pack)
    with IPCSender(verify="log", buffer_bytes=BUFFER, timeout_s=10) as sender:
        worker.start(sender.address, timeout_s=FAST)
        with pytest.raises(KeyboardInterrupt):
            sender.send(MODEL)
        assert shm_leftovers() == []  # freed by send() itself, before close()
        socket = Path(sender.address.removeprefix("ipc://"))
    report = worker.report()
    # told at once, not left to wait out its timeout
    assert report["error"].startswith("RefitProtocolError") and "aborted the refit (KeyboardInterrupt" in report["error"]
    assert report["mapped"] == []
    assert len(report["loads"]) >= 3  # it was interrupted mid-stream, not before
    assert shm_leftovers() == [] and not socket.exists() and not socket.parent.exists()


def test_receiver_interrupted_mid_stream_lets_go_of_its_buffers(worker: Worker) -> None:
    run = refit(worker, timeout_s=FAST, on_load={2: "interrupt"})
    # the sender hears at once (the REP socket answers even a Ctrl-C), not after its timeout
    assert isinstance(run.error, RefitProtocolError) and not isinstance(run.error, RefitTimeout)
    assert "refused batch 2" in str(run.error) and "KeyboardInterrupt" in str(run.error)
    assert run.report["error"].startswith("KeyboardInterrupt")
    assert_clean(run)  # including: the receiver, still open, maps no staging buffer


# --- 7. a transport that cannot verify refuses to be asked to --------------------------


@dataclass
class VerifyConfigLike:
    mode: str


@pytest.mark.parametrize("verify", ["log", "enforce", VerifyConfigLike("enforce")])
def test_transport_without_verification_refuses_a_verify_mode(tmp_path: Path, verify: Any) -> None:
    class BlindSender(IPCSender):
        supports_verify = False

    class BlindReceiver(IPCReceiver):
        supports_verify = False

    mode = getattr(verify, "mode", verify)
    with pytest.raises(RefitError, match=rf"BlindSender.*{mode!r}"):
        BlindSender(verify=verify)
    with pytest.raises(RefitError, match=rf"BlindReceiver.*{mode!r}"):
        BlindReceiver(f"ipc://{tmp_path}/x.sock", META, lambda batch: None, verify=verify)
    with (
        BlindSender(verify="off") as s,
        BlindReceiver(s.address, META, lambda batch: None, verify=VerifyConfigLike("off")) as r,
    ):
        assert s.mode == r.mode == "off"
    assert IPCSender.supports_verify and IPCReceiver.supports_verify and issubclass(IPCSender, Transport)
    with pytest.raises(ValueError, match="invalid value for verify.mode: 'loud'"):
        IPCSender(verify="loud")


# --------------------------------------------------------------------------- what the receiver declares must arrive


SUBSET = {n: t for n, t in MODEL.items() if n not in (NORM, DROP)}


@pytest.mark.parametrize("sent", ["subset", "nothing"])
def test_declared_parameters_that_were_never_sent_are_missing_by_name(worker: Worker, sent: str) -> None:
    """The dropped-bucket bug: a refit that sends less than the receiver declares is not "verified"."""
    tensors = SUBSET if sent == "subset" else {}
    run = refit(worker, tensors, verify="log")
    result = run.result
    assert result is not None and result.verified and not result.ok
    never = sorted(set(MODEL) - set(tensors))
    assert list(result.missing) == never and list(result.unsent) == never
    assert not result.mismatched and not result.unexpected
    assert "declared by the receiver, never sent" in result.describe() and NORM in result.describe()
    assert "every digest matches" not in result.describe()
    enforced = refit(worker, tensors, verify="enforce")
    assert isinstance(enforced.error, RefitDigestMismatch) and list(enforced.error.result.missing) == never
    assert NORM in str(enforced.error)


def test_a_stated_partial_refit_is_checked_against_what_it_states(worker: Worker) -> None:
    run = refit(worker, SUBSET, verify="enforce", send_kwargs={"partial": True})
    assert run.error is None and run.result is not None and run.result.ok
    assert run.result.expected == len(SUBSET)
    listed = refit(worker, SUBSET, verify="log", send_kwargs={"expected": [*SUBSET, NORM]})
    assert listed.result is not None and not listed.result.ok and list(listed.result.missing) == [NORM]


def test_an_impossible_expected_list_is_refused_before_anything_is_sent() -> None:
    cases = [
        ({"expected": ["model.nope"]}, SUBSET, "does not declare: model.nope"),
        ({"expected": [NORM]}, {DROP: MODEL[DROP], NORM: MODEL[NORM]}, f"outside the expected names: .*{DROP}"),
        ({"partial": True, "expected": list(SUBSET)}, SUBSET, "not both"),
    ]
    import threading

    wire: list[tuple[str, dict[str, Any]]] = []
    served: list[Any] = []
    with IPCSender(verify="log", timeout_s=10, wire_log=wire) as sender:
        receiver = IPCReceiver(sender.address, META, lambda batch: None, verify="log", timeout_s=10)
        engine = threading.Thread(target=lambda: served.append(receiver.serve()))
        engine.start()
        try:
            for kwargs, tensors, why in cases:
                with pytest.raises(ValueError, match=why):
                    sender.send(tensors, **kwargs)
            assert sender.send(SUBSET, partial=True).ok  # the receiver is still at the start of its stream
        finally:
            engine.join(20)
            receiver.close()
    ops = [m["op"] for d, m in wire if d == "send"]
    assert ops[: len(cases) + 1] == ["prepare"] * (len(cases) + 1) and served and set(served[0]) == set(SUBSET)


def test_a_fault_on_a_parameter_not_sent_is_refused_before_anything_is_sent() -> None:
    """A misspelt fault (or one on a parameter this refit leaves out, or on a buffer past the last) was a silent
    no-op: the refit passed."""
    import threading

    wire: list[tuple[str, dict[str, Any]]] = []
    served: list[Any] = []
    typo = FaultPlan([Fault("flip_bit", "wire", ("model.nrom.weight",))])
    with IPCSender(verify="enforce", faults=typo, timeout_s=10, wire_log=wire) as sender:
        receiver = IPCReceiver(sender.address, META, lambda batch: None, verify="enforce", timeout_s=10)
        engine = threading.Thread(target=lambda: served.append(receiver.serve()))
        engine.start()
        try:
            with pytest.raises(ValueError, match=rf"^fault flip_bit at wire names 'model.nrom.weight', which is not among the {len(MODEL)} parameters sent \(nearest: {NORM}"):
                sender.send(MODEL)
            sender.faults = FaultPlan([Fault("drop_param", "sender_after_digest", (NORM,))])
            with pytest.raises(ValueError, match=f"names '{NORM}', which is not among the {len(SUBSET)} parameters sent"):
                sender.send(SUBSET, partial=True)  # a real name, left out of this refit
            sender.faults = FaultPlan([Fault("drop_buffer", "wire", buffer=99)])  # a buffer this send never reaches
            with pytest.raises(ValueError, match=r"^fault drop_buffer names buffer 99, but this send packs \d+ buffer\(s\) \(0\.\.\d+\): it would drop nothing"):
                sender.send(MODEL)
            sender.faults = FaultPlan()
            assert sender.send(SUBSET, partial=True).ok  # the receiver is still at the start of its stream
        finally:
            engine.join(20)
            receiver.close()
    ops = [m["op"] for d, m in wire if d == "send"]
    assert ops.count("prepare") == 1 and ops[-1] == "complete"  # a refused send sent nothing, not even its prepare
    assert served and set(served[0]) == set(SUBSET)


def test_one_element_strided_views_travel_like_their_copies(worker: Worker) -> None:
    big = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    views = {n: t.clone() for n, t in MODEL.items()}
    views["model.rotary_emb.scale"] = big.t()[:1, :1].reshape(())  # 0-d view with a stride
    run = refit(worker, views, verify="enforce")
    assert run.error is None and run.result is not None and run.result.ok


# --------------------------------------------------------------------------- the control channel carries data, not code


@pytest.mark.parametrize(
    "address",
    ["tcp://127.0.0.1:5555", "ipc://@wcviz-abstract", "ipc:///tmp/wcviz-refit.sock", "ipc:///no/such/dir/x.sock", ""],
)
def test_only_ipc_in_a_private_directory_is_accepted(address: str) -> None:
    with pytest.raises(RefitProtocolError, match="refused"):
        IPCSender(address)
    with pytest.raises(RefitProtocolError, match="refused"):
        IPCReceiver(address, META, lambda batch: None)


def test_a_group_writable_directory_is_not_private(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)
    with pytest.raises(RefitProtocolError, match="not private"):
        IPCSender(f"ipc://{shared}/refit.sock")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with IPCSender(f"ipc://{private}/refit.sock") as sender:
        assert sender.address.endswith("private/refit.sock")


class _Boom:
    """A pickle that touches a file when it is loaded: proof that a peer's message ran code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def test_a_peer_that_answers_with_a_pickle_runs_nothing_here(tmp_path: Path) -> None:
    import pickle
    import threading

    import zmq

    touched = tmp_path / "pwned"
    with IPCSender(verify="log", timeout_s=5) as sender:
        ctx = zmq.Context()
        rep = ctx.socket(zmq.REP)
        rep.connect(sender.address)

        def evil_receiver() -> None:
            if rep.poll(5000):
                rep.recv()
                rep.send(pickle.dumps({"op": "info", "metadata": _Boom(touched)}))

        peer = threading.Thread(target=evil_receiver)
        peer.start()
        try:
            with pytest.raises(RefitProtocolError, match="not JSON"):
                sender.prepare()
        finally:
            peer.join(10)
            rep.close(0)
            ctx.term()
    assert not touched.exists()


@pytest.mark.parametrize(
    ("message", "why"),
    [
        ({"op": "batch", "names": ["x"], "used": 512, "buffer": {"kind": "shm", "key": "../../etc/passwd", "nbytes": 512, "transient": False}}, "bad buffer handle"),
        ({"op": "batch", "names": "x", "used": 512, "buffer": None}, "malformed batch"),
        ({"op": "batch", "names": ["x"], "used": -1}, "malformed batch"),
    ],
)
def test_a_receiver_refuses_a_malformed_batch_naming_it(tmp_path: Path, message: dict[str, Any], why: str) -> None:
    replies = _serve_raw(tmp_path, [{"op": "prepare"}, message], why)  # a stream begins with prepare: then the malformed batch
    assert replies[0]["op"] == "info" and replies[1]["ok"] is False and why in replies[1]["error"]


def _serve_raw(tmp_path: Path, messages: list[dict[str, Any]], match: str, verify: str = "off") -> list[dict[str, Any]]:
    """An IPCReceiver answering a bare REQ socket that sends ``messages`` (JSON) one by one: its replies, once
    ``serve()`` raised the RefitProtocolError ``match`` names."""
    import json

    import zmq

    private = tmp_path / "p"
    private.mkdir(mode=0o700)
    address = f"ipc://{private}/refit.sock"
    ctx = zmq.Context()
    req = ctx.socket(zmq.REQ)
    req.bind(address)
    replies: list[Any] = []

    def peer_main() -> None:
        for msg in messages:
            req.send(json.dumps(msg).encode())
            if not req.poll(5000):
                return
            replies.append(json.loads(req.recv()))

    peer = threading.Thread(target=peer_main)
    peer.start()
    try:
        with IPCReceiver(address, {"x": ((128,), "float32")}, lambda batch: None, verify=verify, timeout_s=5) as rx:
            with pytest.raises(RefitProtocolError, match=match):
                rx.serve()
    finally:
        peer.join(10)
        req.close(0)
        ctx.term()
    return replies


def test_a_cuda_handle_travels_as_plain_json_and_rebuilds_the_same_args() -> None:
    """CUDA IPC handles cross as base64 fields of a fixed schema (torch 2.13's reduce_tensor args), not a pickle."""
    import json

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from wcviz.refit._shm import BufferHandle, HandleError

    args = (
        torch.Tensor, torch.Size([4096]), (1,), 0, torch.storage.TypedStorage, torch.uint8, 0, b"\x01" * 64,
        4096, 512, False, b"\x02" * 64, 8, b"\x03" * 64, True,
    )  # fmt: skip
    handle = BufferHandle("cuda", "wcviz_1_0123456789ab", 4096, False, cuda=(rebuild_cuda_tensor, args))
    wire = json.loads(json.dumps(handle.to_wire()))
    back = BufferHandle.from_wire(wire)
    assert back.cuda is not None and back.cuda[0] is rebuild_cuda_tensor and back.cuda[1] == args
    assert (back.kind, back.key, back.nbytes, back.transient) == ("cuda", handle.key, 4096, False)
    for bad in ({**wire, "cuda": {**wire["cuda"], "handle": "%%%"}}, {**wire, "cuda": {**wire["cuda"], "stride": [2]}},
                {**wire, "key": "wcviz_1_../../x"}, {**wire, "extra": 1}):  # fmt: skip
        with pytest.raises(HandleError):
            BufferHandle.from_wire(bad)


# --------------------------------------------------------------------------- checked against what the receiver declares now


def _serve_in_thread(address: str, metadata: dict[str, Any], verify: str = "log") -> tuple[Any, dict[str, Any]]:
    """An in-process receiver serving one stream on a thread; ``out`` gets its digests or its error."""
    import threading

    out: dict[str, Any] = {"loaded": []}

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:
        out["loaded"] += [n for n, _ in batch]

    def run() -> None:
        try:
            with IPCReceiver(address, metadata, load, verify=verify, timeout_s=10) as receiver:
                out["digests"] = receiver.serve()
        except Exception as e:  # noqa: BLE001 -- the test reads it
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_a_new_receiver_declaring_more_is_checked_against_what_it_declares_now() -> None:
    """One sender refits an engine declaring {a}; a restarted engine at the same address declares {a, b}.

    Sending only a must not be "verified: every digest matches" against the first engine's metadata.
    """
    a, b = torch.randn(4, 8), torch.randn(5)
    with IPCSender(verify="enforce", buffer_bytes=BUFFER, timeout_s=10) as sender:
        thread, out = _serve_in_thread(sender.address, {"a": ((4, 8), "float32")}, "enforce")
        assert sender.send({"a": a}).ok
        thread.join(20)
        thread, out = _serve_in_thread(sender.address, {"a": ((4, 8), "float32"), "b": ((5,), "float32")}, "enforce")
        with pytest.raises(RefitDigestMismatch, match="declared by the receiver, never sent: b") as err:
            sender.send({"a": a})
        thread.join(20)
        assert err.value.result.missing == ("b",) and out["loaded"] == ["a"] and "error" not in out
        thread, out = _serve_in_thread(sender.address, {"a": ((4, 8), "float32"), "b": ((5,), "float32")}, "enforce")
        assert sender.send({"a": a, "b": b}).ok  # and the whole model is verified against it
        thread.join(20)


@pytest.mark.parametrize("op", ["batch", "complete"])
def test_a_receiver_refuses_a_stream_that_does_not_begin_with_prepare(tmp_path: Path, op: str) -> None:
    """Without a prepare in the stream, the sender would be checking against metadata it learnt earlier."""
    message = {"op": op} if op == "complete" else {"op": "batch", "names": [], "used": 0, "buffer": None}
    replies = _serve_raw(tmp_path, [message], f"{op} before prepare", verify="log")
    assert replies and replies[0]["ok"] is False and "digests" not in replies[0]


@pytest.mark.parametrize("mode", ["log", "enforce"])
def test_a_receiver_that_declares_nothing_is_not_a_verified_refit(caplog: pytest.LogCaptureFixture, mode: str) -> None:
    """Released or offloaded weights, a mis-wired holder: an empty refit to an empty engine is not ok, and says why."""
    with caplog.at_level(logging.WARNING, logger="wcviz.refit"), IPCSender(verify=mode, timeout_s=10) as sender:
        thread, out = _serve_in_thread(sender.address, {}, mode)
        try:
            if mode == "enforce":
                with pytest.raises(RefitDigestMismatch, match="receiver declares no parameters") as err:
                    sender.send({})
                result = err.value.result
            else:
                result = sender.send({})
        finally:
            thread.join(20)
    assert result.verified and result.empty and not result.ok and result.declared == 0
    assert "every digest matches" not in result.describe()
    assert mode == "enforce" or any("declares no parameters" in r.getMessage() for r in caplog.records)


def test_a_stated_partial_refit_of_nothing_is_not_verified() -> None:
    with IPCSender(verify="log", timeout_s=10) as sender:
        thread, out = _serve_in_thread(sender.address, {"a": ((3,), "float32")})
        result = sender.send({}, partial=True)
        thread.join(20)
    assert not result.ok and "none was expected" in result.describe() and "error" not in out


def test_a_late_reply_to_a_request_given_up_on_is_not_the_next_reply() -> None:
    """After a RefitTimeout, the engine's late answer to the old request must not answer the next prepare."""
    import json
    import threading

    import zmq
    from zmq.utils.monitor import recv_monitor_message

    with IPCSender(verify="log", timeout_s=0.5) as sender:
        ctx = zmq.Context()
        rep = ctx.socket(zmq.REP)
        monitor = rep.get_monitor_socket(zmq.EVENT_CONNECTED)
        rep.connect(sender.address)
        gave_up, ready = threading.Event(), threading.Event()
        seen: list[Any] = []

        def connected() -> bool:
            if monitor.poll(10_000):
                recv_monitor_message(monitor)
                return True
            return False

        def slow_engine() -> None:
            connected()
            ready.set()  # connected: the sender's first request goes out (and times out waiting for its reply)
            seen.append(json.loads(rep.recv()))  # the first prepare: answered only after the sender gave up
            gave_up.wait(10)
            seen.append(connected())  # the sender's new socket
            rep.send(json.dumps({"op": "ack", "ok": True}).encode())  # the late answer to the old request
            if rep.poll(10_000):
                seen.append(json.loads(rep.recv()))
                rep.send(json.dumps({"op": "info", "metadata": {"a": [[3], "float32"]}}).encode())

        engine = threading.Thread(target=slow_engine)
        engine.start()
        try:
            assert ready.wait(20)
            with pytest.raises(RefitTimeout, match="the reply to prepare"):
                sender.prepare()
            gave_up.set()
            assert sender.prepare() == {"a": ((3,), "float32")}
        finally:
            gave_up.set()
            engine.join(20)
            monitor.close(0)
            rep.close(0)
            ctx.term()
    assert seen == [{"op": "prepare"}, True, {"op": "prepare"}]


def _receiver_on_thread(address: str, metadata: dict[str, Any], load: Any, serves: int) -> tuple[Any, Any, dict[str, Any]]:
    """A receiver (returned, for the test to alter) serving ``serves`` streams on a thread; errors land in ``out``."""
    receiver = IPCReceiver(address, metadata, load, verify="enforce", timeout_s=10)
    out: dict[str, Any] = {"errors": []}

    def run() -> None:
        for _ in range(serves):
            try:
                receiver.serve()
            except BaseException as e:  # noqa: BLE001 -- the test reads it
                out["errors"].append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return receiver, thread, out


def test_editing_what_prepare_returned_changes_nothing_the_sender_checks() -> None:
    """prepare() returned the sender's own cache: trimming it to what one sends made the next prepare "unchanged"
    and the declared b, never sent, went unreported."""
    w = {"a": torch.randn(8), "b": torch.randn(8)}
    with IPCSender(verify="enforce", timeout_s=10) as sender:
        receiver, thread, out = _receiver_on_thread(sender.address, {n: ((8,), "float32") for n in w}, lambda batch: None, 2)
        with receiver:
            assert sender.send(w).ok
            declared = sender.prepare()
            declared.pop("b")
            sender.metadata = declared  # a caller's own copy, however it got it
            with pytest.raises(RefitDigestMismatch, match="declared by the receiver, never sent: b"):
                sender.send({"a": w["a"]})
            thread.join(20)
    assert out["errors"] == []


def test_a_receiver_whose_metadata_changes_while_it_loads_is_refused_not_verified() -> None:
    w = {"a": torch.randn(8), "b": torch.randn(8)}
    holder: list[Any] = []

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:  # the engine re-declares b and adds c mid-stream
        holder[0].metadata = {"a": ((8,), "float32"), "b": ((8,), "int32"), "c": ((4,), "float32")}

    with IPCSender(verify="enforce", timeout_s=10) as sender:
        receiver, thread, out = _receiver_on_thread(sender.address, {n: ((8,), "float32") for n in w}, load, 1)
        holder.append(receiver)
        with receiver:
            with pytest.raises(RefitProtocolError, match="changed its metadata during the refit"):
                sender.send(w)
            thread.join(20)
    assert len(out["errors"]) == 1 and "changed its metadata during the refit" in str(out["errors"][0])


def test_the_same_metadata_in_another_spelling_is_unchanged_and_served() -> None:
    """Reassigned as list shapes and torch dtypes, the metadata could not be sent as JSON: the sender waited out
    its timeout. It is the same metadata: one form, one fingerprint, nothing resent."""
    w = {"a": torch.randn(4, 8)}
    wire: list[tuple[str, dict[str, Any]]] = []
    with IPCSender(verify="enforce", timeout_s=10, wire_log=wire) as sender:
        receiver, thread, out = _receiver_on_thread(sender.address, {"a": ((4, 8), "float32")}, lambda batch: None, 2)
        with receiver:
            assert sender.send(w).ok
            receiver.metadata = {"a": ([4, 8], torch.float)}
            assert sender.send(w).ok
            thread.join(20)
    assert out["errors"] == []
    replies = [body for kind, body in wire if kind == "recv" and body.get("op") == "info"]
    assert "metadata" in replies[0] and replies[1] == {"op": "info", "unchanged": True}


def test_a_ctrl_c_inside_load_weights_leaves_a_receiver_that_serves_again() -> None:
    """Its REP socket owed the sender a reply; unanswered, every later serve and prepare timed out."""
    w = {"a": torch.randn(8)}
    calls = {"n": 0}

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt

    with IPCSender(verify="enforce", timeout_s=10) as sender:
        receiver, thread, out = _receiver_on_thread(sender.address, {"a": ((8,), "float32")}, load, 2)
        with receiver:
            with pytest.raises(RefitProtocolError, match="KeyboardInterrupt"):
                sender.send(w)
            assert sender.send(w).ok
            thread.join(20)
    assert [type(e) for e in out["errors"]] == [KeyboardInterrupt]


_KEEPS_VIEWS = """
import sys, threading, torch
from wcviz.refit.ipc import IPCReceiver, IPCSender
from wcviz.refit.verify import RefitProtocolError
w = {f"w{i}": torch.full((300,), float(i)) for i in range(8)}
meta = {n: (list(t.shape), "float32") for n, t in w.items()}
kept = {}
def load_weights(batch):
    for n, t in batch:
        kept[n] = t  # a zero-copy loader: keeps the views it was handed, against the contract
with IPCSender(verify="enforce", buffer_bytes=4096, timeout_s=20) as s:
    r = IPCReceiver(s.address, meta, load_weights, verify="enforce", timeout_s=20)
    errors = []
    def serve():
        try:
            r.serve()
        except RefitProtocolError as e:
            errors.append(e)
    th = threading.Thread(target=serve)
    th.start()
    try:
        s.send(w)
        print("SENT AS VERIFIED")
    except RefitProtocolError as e:
        print("SENDER:", e)
    th.join(30)
    r.close()
print("RECEIVER:", errors[0] if errors else None)
print("READ:", [float(t.sum()) for t in kept.values()])  # the engine goes on using its weights
"""


def test_a_loader_that_keeps_its_views_is_refused_and_never_crashes_the_engine() -> None:
    """The views ``load_weights`` gets live in a staging buffer the sender reuses. A loader that kept them was
    "verified" while its held views changed under it (a q shard then read v's bytes), and once the receiver let
    go of the buffer the next read of a kept weight killed the engine with SIGSEGV (the segment was unmapped)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _KEEPS_VIEWS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -11 was the segfault
    out = done.stdout
    assert "SENT AS VERIFIED" not in out
    assert "SENDER:" in out and "load_weights kept views of the staging buffer" in out and "w0" in out
    assert "RECEIVER:" in out and "copy what you keep" in out.split("RECEIVER:")[1]
    assert "READ:" in out  # the kept views still read memory that is mapped


def test_a_staging_buffer_is_backed_when_created_or_refused_naming_dev_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sparse segment larger than /dev/shm's free space (64 MiB in a default Docker container) killed the
    trainer with SIGBUS at the first write past the end, and left the segment behind."""
    import errno

    from wcviz.refit import _shm
    from wcviz.refit.verify import RefitError

    buf = _shm.OwnedBuffer(1 << 20, torch.device("cpu"))
    try:
        assert buf._shm is not None
        assert os.fstat(buf._shm._fd).st_blocks * 512 >= 1 << 20  # every page reserved now, not at first write
    finally:
        buf.close()

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    before = set(shm_leftovers())
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(RefitError, match=r"cannot reserve a 1,048,576-byte refit staging buffer .*/dev/shm has .* free"):
        _shm.OwnedBuffer(1 << 20, torch.device("cpu"))
    assert set(shm_leftovers()) == before  # the segment it could not back is gone



# --- faults that would break nothing; input and a sender failing mid-stream -------------

BIAS = "model.layers.0.self_attn.o_proj.bias"  # no elements
NOOPS = [
    ("cast-to-own-dtype", MODEL, (Fault("cast_dtype", "wire", (FLIP,), dtype="float32"),), rf"fault cast_dtype at wire on '{FLIP}': it is torch.float32 already"),
    ("cast-changes-size", MODEL, (Fault("cast_dtype", "sender_after_digest", (FLIP,), dtype="float16"),), "changes the byte size"),
    (
        "two-flips-of-one-bit",
        MODEL,
        (Fault("flip_bit", "sender_after_digest", (FLIP,), bit=5), Fault("flip_bit", "receiver_before_load", (FLIP,), bit=5)),
        rf"faults on '{FLIP}' \(flip_bit at sender_after_digest, flip_bit at receiver_before_load\) leave its bytes as they were",
    ),
    ("cast-of-zeros", {**MODEL, CAST: torch.zeros_like(MODEL[CAST])}, (Fault("cast_dtype", "wire", (CAST,), dtype="float16"),), "leave its bytes as they were"),
    ("shift-of-zeros", {**MODEL, NORM: torch.zeros_like(MODEL[NORM])}, (Fault("shift_offset", "receiver_before_load", (NORM,)),), "leave its bytes as they were"),
    ("flip-in-an-empty-parameter", MODEL, (Fault("flip_bit", "wire", (BIAS,)),), f"on '{BIAS}': the parameter is empty"),
    (
        "swap-of-identical-bytes",
        {**MODEL, V3: MODEL[K0].view(torch.float16)},
        (Fault("swap_params", "wire", (K0, V3)),),
        f"'{K0}' and '{V3}' hold the same bytes, so swapping them changes nothing",
    ),
    ("swap-of-other-sizes", MODEL, (Fault("swap_params", "receiver_before_load", (K0, NORM)),), "differ in size"),
]


@pytest.mark.parametrize("tensors,faults,why", [c[1:] for c in NOOPS], ids=[c[0] for c in NOOPS])
def test_a_fault_that_changes_nothing_is_refused_before_anything_is_sent(
    tensors: dict[str, torch.Tensor], faults: tuple[Fault, ...], why: str
) -> None:
    """Each of these was accepted and the refit verified: the receiver held exactly the sender's bytes, as if the
    fault had been tried and caught. Refused now, naming the fault and the parameter, before even the prepare."""
    wire: list[tuple[str, dict[str, Any]]] = []
    with IPCSender(verify="enforce", faults=FaultPlan(faults), timeout_s=FAST, wire_log=wire) as sender:
        with pytest.raises(ValueError, match=why):
            sender.send(tensors)
    assert wire == []


def test_faults_that_do_change_the_bytes_pass_the_plan_check() -> None:
    from wcviz.refit.faults import check_plan

    two_bits = (Fault("flip_bit", "wire", (FLIP,), bit=5), Fault("flip_bit", "receiver_before_load", (FLIP,), bit=6))
    check_plan(FaultPlan(two_bits), list(MODEL.items()))
    same_bit_other_ranks = (Fault("flip_bit", "wire", (FLIP,), bit=5, ranks=(1,)), Fault("flip_bit", "receiver_before_load", (FLIP,), bit=5, ranks=(2,)))
    check_plan(FaultPlan(same_bit_other_ranks), list(MODEL.items()), receivers=[1, 2])  # neither rank gets both
    with pytest.raises(ValueError, match="leave its bytes as they were"):  # rank 2 gets both
        check_plan(FaultPlan((*same_bit_other_ranks[:1], replace(same_bit_other_ranks[1], ranks=(1,)))), list(MODEL.items()), receivers=[1, 2])
    check_plan(FaultPlan((Fault("cast_dtype", "wire", (CAST,), dtype="float16"),)), list(MODEL.items()))


@pytest.mark.parametrize(
    "kwargs,why",
    [
        ({"kind": "shift_offset", "params": (NORM,), "shift": 0}, r"shift_offset needs shift > 0 bytes, got 0"),
        ({"kind": "shift_offset", "params": (NORM,), "shift": -8}, r"shift_offset needs shift > 0 bytes, got -8"),
        ({"kind": "shift_offset", "params": (NORM,), "shift": True}, r"shift_offset needs shift > 0 bytes, got True"),
        ({"kind": "flip_bit", "params": (NORM,), "bit": -1}, r"flip_bit needs a bit index >= 0, got -1"),
        ({"kind": "drop_buffer", "buffer": -1}, r"drop_buffer needs a buffer index >= 0, got -1"),
        ({"kind": "swap_params", "params": (NORM, NORM)}, rf"swap_params needs two different parameters, got '{NORM}' twice"),
    ],
)
def test_a_fault_that_cannot_mean_anything_is_refused_when_made(kwargs: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        Fault(point="wire", **kwargs)


def test_construction_refuses_what_a_send_would_refuse_after_prepare() -> None:
    """A bad buffer_bytes was refused only at the first send, after its prepare went out: the receiver then waited
    out its timeout. And IPC has one receiver: a fault limited to ranks struck it whatever the ranks said."""
    from wcviz.refit import RefitConfigError

    for bad in (100, True, -5, 1e9):
        with pytest.raises(RefitConfigError, match=rf"invalid value for buffer_bytes: {bad!r}"):
            IPCSender(buffer_bytes=bad)  # type: ignore[arg-type]
    ranked = FaultPlan((Fault("flip_bit", "wire", (NORM,), ranks=(1,)),))
    with pytest.raises(ValueError, match=r"names ranks \[1\], but this transport has one receiver"):
        IPCSender(faults=ranked)
    with pytest.raises(ValueError, match=r"names ranks \[1\], but this transport has one receiver"):
        IPCReceiver("ipc:///tmp/wcviz-never.sock", META, lambda batch: None, faults=ranked)


@pytest.mark.parametrize("mode", ["off", "log"])
def test_a_tensor_with_no_bytes_is_refused_by_name_before_anything_is_sent(mode: str) -> None:
    """A meta tensor in the third batch was refused only when packed (off: without its name), after the receiver had
    loaded the batches before it."""
    wire: list[tuple[str, dict[str, Any]]] = []
    tensors = {**MODEL, FLIP: torch.empty(MODEL[FLIP].shape, device="meta")}
    with IPCSender(verify=mode, timeout_s=FAST, wire_log=wire) as sender:
        with pytest.raises(TypeError, match=rf"cannot send tensor '{FLIP}' is on the meta device"):
            sender.send(tensors)
    assert wire == []


def _engine(receiver: IPCReceiver, serves: int, outcomes: list[BaseException | None]) -> threading.Thread:
    """A started thread that serves ``serves`` refits, appending each one's outcome (None, or what it raised)."""

    def serve() -> None:
        for _ in range(serves):
            try:
                receiver.serve()
                outcomes.append(None)
            except BaseException as e:  # noqa: BLE001 - what the engine would see
                outcomes.append(e)

    engine = threading.Thread(target=serve)
    engine.start()
    return engine


def test_a_sender_failing_mid_stream_tells_the_receiver_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver waited out its whole timeout, then blamed the sender's silence ("is it alive?")."""
    served: list[BaseException | None] = []
    receiver_timeout = 60.0
    original = IPCSender._pack
    calls = [0]

    def pack_then_fail(self: IPCSender, *args: Any) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise MemoryError("no room for batch 2")
        original(self, *args)

    monkeypatch.setattr(IPCSender, "_pack", pack_then_fail)
    loaded: list[str] = []
    with IPCSender(verify="log", buffer_bytes=BUFFER, timeout_s=FAST) as sender:
        receiver = IPCReceiver(sender.address, META, lambda batch: loaded.extend(n for n, _ in batch), verify="log", timeout_s=receiver_timeout)
        engine = _engine(receiver, 1, served)
        try:
            with pytest.raises(MemoryError, match="no room for batch 2"):
                sender.send(MODEL)
        finally:
            engine.join(receiver_timeout + 5)
            receiver.close()
    assert not engine.is_alive() and len(served) == 1
    error = served[0]
    assert isinstance(error, RefitProtocolError) and not isinstance(error, RefitTimeout)
    assert "aborted the refit (MemoryError: no room for batch 2); this model may hold part of it" in str(error)
    assert loaded  # batches before the failure were loaded: the message says so


def test_a_shift_never_reads_what_a_kept_buffer_held_before() -> None:
    """With the staging buffers kept between sends, a shift_offset fault wrote only part of the parameter's slot; the
    rest still held the previous send's right bytes, and a shift past the slot left it all: the refit verified."""
    received: list[dict[str, torch.Tensor]] = []
    with IPCSender(verify="log", buffer_bytes=BUFFER, timeout_s=10) as sender:
        receiver = IPCReceiver(sender.address, META, lambda batch: received[-1].update((n, t.clone()) for n, t in batch), verify="log", timeout_s=10)

        def serve() -> None:
            for _ in range(2):
                received.append({})
                receiver.serve()

        engine = threading.Thread(target=serve)
        engine.start()
        try:
            assert sender.send(MODEL).ok
            sender.faults = FaultPlan((Fault("shift_offset", "wire", (NORM,), shift=1024),))  # past its 512-byte slot
            result = sender.send(MODEL)
        finally:
            engine.join(20)
            receiver.close()
    assert (result.mismatched, result.missing) == ((NORM,), ())
    assert torch.count_nonzero(received[1][NORM]) == 0  # it arrives as zeros, as the fault says


def test_segments_made_while_another_thread_attaches_are_still_freed_when_the_process_dies() -> None:
    """Attaching swapped out the resource tracker's register for the whole process: segments another thread made
    meanwhile went unregistered, and stayed in /dev/shm for good once the process died (SIGKILL, an OOM kill)."""
    import glob
    import subprocess
    import sys
    import textwrap

    child = textwrap.dedent("""
        import os, signal, threading, time, torch
        from wcviz.refit._shm import AttachedBuffer, OwnedBuffer
        owner = OwnedBuffer(4096, torch.device("cpu"))
        stop = False
        def attacher():
            while not stop:
                AttachedBuffer(owner.handle).close()
        threading.Thread(target=attacher, daemon=True).start()
        kept = []
        for _ in range(20):
            time.sleep(0.001)
            kept.append(OwnedBuffer(4096, torch.device("cpu")))
        print(os.getpid(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    before = set(glob.glob("/dev/shm/wcviz_*"))
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    pid = run.stdout.strip()
    assert run.returncode == -9 and pid, run.stderr
    for _ in range(100):  # the dead process's resource tracker unlinks what it registered
        left = [f for f in set(glob.glob(f"/dev/shm/wcviz_{pid}_*")) - before]
        if not left:
            break
        time.sleep(0.05)
    for f in left:
        os.unlink(f)
    assert left == []


def test_a_staging_buffer_interrupted_while_it_is_made_leaves_nothing_in_dev_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C while a few GiB were reserved left the new segment in /dev/shm until the process exited."""
    import glob

    from wcviz.refit import _shm

    def interrupted(shm: Any, size: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_shm, "_reserve", interrupted)
    before, owned = set(glob.glob(f"/dev/shm/wcviz_{os.getpid()}_*")), set(_shm._OWNED)
    with pytest.raises(KeyboardInterrupt):
        _shm.OwnedBuffer(1 << 20, torch.device("cpu"))
    assert set(glob.glob(f"/dev/shm/wcviz_{os.getpid()}_*")) == before and _shm._OWNED == owned


def test_a_receiver_interrupted_at_prepare_answers_it_and_can_serve_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a protocol error at prepare was answered: a Ctrl-C there left the REP socket owing a reply, so the
    receiver could never serve again."""
    calls = [0]
    original = IPCReceiver._declared_now

    def interrupted_once(self: IPCReceiver) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(IPCReceiver, "_declared_now", interrupted_once)
    seen: list[BaseException | None] = []
    with IPCSender(verify="log", buffer_bytes=BUFFER, timeout_s=10) as sender:
        receiver = IPCReceiver(sender.address, META, lambda batch: None, verify="log", timeout_s=10)
        engine = _engine(receiver, 2, seen)
        try:
            with pytest.raises(RefitProtocolError, match="refused|KeyboardInterrupt"):
                sender.send(MODEL)
            assert sender.send(MODEL).ok  # the same receiver serves the next refit
        finally:
            engine.join(20)
            receiver.close()
    assert isinstance(seen[0], KeyboardInterrupt) and seen[1] is None
