"""The torch.distributed broadcast transport, end to end, in real processes.

One spawned world of three ranks on 127.0.0.1 with gloo (rank 0 the trainer,
ranks 1 and 2 engines) runs every scenario below in sequence; each rank
reports what happened through a queue, and the tests read those reports. The
engines' models are sent back byte for byte, so a test can see that what the
digests say matches what was actually loaded. The last two scenarios kill a
peer on purpose, so they run last.
"""

from __future__ import annotations

import logging
import math
import os
import queue as queue_mod
import re
import socket
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from wcviz.refit import _packing
from wcviz.refit.faults import Fault, FaultPlan

WORLD = 3
ENGINES = (1, 2)
BUFFER = 3072  # a parameter above 1536 bytes travels alone
GROUP_TIMEOUT_S = 12  # every collective's limit: how long a live engine waits when a peer is dead
DEAD_TIMEOUT_S = 3  # the barrier's timeout in the dead-peer scenarios
SUB_TIMEOUT_S = 4  # the small group's collective timeout in the mid-stream death
WORLD_DEADLINE_S = 240

BF16, F16, F32, I64 = torch.bfloat16, torch.float16, torch.float32, torch.int64
EMBED = "model.embed_tokens.weight"
LN = "model.layers.0.input_layernorm.weight"
Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"
V = "model.layers.0.self_attn.v_proj.weight"
O = "model.layers.0.self_attn.o_proj.weight"
INV = "model.layers.0.self_attn.rotary_emb.inv_freq"
POST = "model.layers.0.post_attention_layernorm.weight"
GATE = "model.layers.0.mlp.gate_proj.weight"
UP = "model.layers.0.mlp.up_proj.weight"
DOWN = "model.layers.0.mlp.down_proj.weight"
SCALE = "model.layers.0.mlp.scale"  # 0-d
BIAS = "model.layers.0.mlp.bias"  # empty
NORM = "model.norm.weight"
STEPS = "model.steps"  # an int64 buffer, 0-d
HEAD = "lm_head.weight"

SPECS: list[tuple[str, tuple[int, ...], torch.dtype]] = [
    (EMBED, (128, 16), BF16),
    (LN, (16,), F32),
    (Q, (16, 16), BF16),
    (K, (8, 16), BF16),
    (V, (8, 16), BF16),
    (O, (16, 16), BF16),
    (INV, (4,), F32),
    (POST, (16,), F16),
    (GATE, (32, 16), F32),
    (UP, (16, 32), F32),
    (DOWN, (16, 16), F32),
    (SCALE, (), F32),
    (BIAS, (0,), F32),
    (NORM, (16,), BF16),
    (STEPS, (), I64),
    (HEAD, (128, 16), BF16),
]
BUFFERS = {INV, STEPS}


def bucket_names() -> list[tuple[str, ...]]:
    """The names of each bucket the sender plans for the trainer's weights."""
    sizes = [(n, math.prod(s) * torch.empty(0, dtype=d).element_size()) for n, s, d in SPECS]
    return [b.names for b in _packing.plan(sizes, BUFFER)]


def trainer_weights() -> dict[str, torch.Tensor]:
    """The trainer's tensors: seeded, so every process (and the test) builds the same ones."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, shape, dtype in SPECS:
        if dtype == I64:
            out[name] = torch.randint(1, 1 << 40, shape, generator=g, dtype=I64)
        else:
            out[name] = (torch.randn(shape, generator=g) + 3).to(dtype)  # never 0, never the engines' 7
    return out


class TinyLlama(torch.nn.Module):
    """An engine's model: Llama-like names as nested modules, parameters and buffers, all set to 7."""

    def __init__(self, drift: dict[str, tuple[tuple[int, ...], torch.dtype] | None] | None = None) -> None:
        super().__init__()
        drift = drift or {}
        for name, shape, dtype in SPECS:
            if name in drift:
                if drift[name] is None:
                    continue  # this engine does not have it
                shape, dtype = drift[name]  # type: ignore[misc]
            *path, leaf = name.split(".")
            mod: torch.nn.Module = self
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            t = torch.full(shape, 7, dtype=dtype)
            if name in BUFFERS:
                mod.register_buffer(leaf, t)
            else:
                mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))

    def weights(self) -> dict[str, torch.Tensor]:
        return {**dict(self.named_parameters()), **dict(self.named_buffers())}

    def load_weights(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        """What an engine does with a bucket: copy each tensor into its own weight."""
        mine = self.weights()
        with torch.no_grad():
            for name, t in batch:
                mine[name].copy_(t)


def raw(t: torch.Tensor) -> bytes:
    from wcviz.digest._lanes import logical_bytes

    return bytes(logical_bytes(t).numpy().tobytes())


# --- scenarios: plain data every rank reads from this module ---------------------------------------------------


def both(kind: str, *names: str) -> dict[int, dict[str, tuple[str, ...]]]:
    """What a fault that strikes every engine leaves: ``kind`` ("mismatched" or "missing") of ``names`` on each."""
    return {rank: {kind: names} for rank in ENGINES}


# (label, fault, {engine rank: {"mismatched"|"missing": names}}); a rank the fault spares is absent
FAULTS: list[tuple[str, Fault, dict[int, dict[str, tuple[str, ...]]]]] = [
    ("flip_bit@sender", Fault("flip_bit", "sender_after_digest", (Q,)), both("mismatched", Q)),
    ("flip_bit@wire", Fault("flip_bit", "wire", (EMBED,), bit=13), both("mismatched", EMBED)),
    ("flip_bit@receiver", Fault("flip_bit", "receiver_before_load", (SCALE,)), both("mismatched", SCALE)),
    ("drop_param@sender", Fault("drop_param", "sender_after_digest", (NORM,)), both("missing", NORM)),
    ("drop_param@receiver", Fault("drop_param", "receiver_before_load", (INV,)), both("missing", INV)),
    ("swap_params@sender", Fault("swap_params", "sender_after_digest", (K, V)), both("mismatched", K, V)),
    # gate and up travel in different buckets: the receiver holds the first until the second arrives
    ("swap_params@receiver", Fault("swap_params", "receiver_before_load", (GATE, UP)), both("mismatched", GATE, UP)),
    ("cast_dtype@wire", Fault("cast_dtype", "wire", (DOWN,), dtype="int32"), both("mismatched", DOWN)),
    ("cast_dtype@sender", Fault("cast_dtype", "sender_after_digest", (Q,), dtype="float16"), both("mismatched", Q)),
    ("drop_buffer@wire", Fault("drop_buffer", "wire", buffer=1), both("missing", *bucket_names()[1])),
    ("shift_offset@wire", Fault("shift_offset", "wire", (O,), shift=8), both("mismatched", O)),
    (
        "shift_offset@receiver",
        Fault("shift_offset", "receiver_before_load", (HEAD,), shift=3),
        both("mismatched", HEAD),
    ),
    # limited to one engine: the other one must come out clean
    (
        "flip_bit@receiver rank 2",
        Fault("flip_bit", "receiver_before_load", (K,), ranks=(2,)),
        {2: {"mismatched": (K,)}},
    ),
    ("flip_bit@wire rank 1", Fault("flip_bit", "wire", (UP,), bit=77, ranks=(1,)), {1: {"mismatched": (UP,)}}),
    (
        "drop_buffer@wire rank 1",
        Fault("drop_buffer", "wire", buffer=5, ranks=(1,)),
        {1: {"missing": bucket_names()[5]}},
    ),
]


def _scenarios() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": f"clean {mode}", "verify": mode} for mode in ("off", "log", "enforce")]
    for mode in ("log", "enforce"):
        out += [
            {"name": f"{label} {mode}", "verify": mode, "faults": FaultPlan((fault,))} for label, fault, _ in FAULTS
        ]
    subset = [n for n, _, _ in SPECS if n not in (NORM, HEAD)]
    for mode in ("log", "enforce"):
        out += [
            # the "dropped bucket" bug: the trainer sends less than every engine declares
            {"name": f"subset {mode}", "verify": mode, "send": subset},
            {"name": f"nothing {mode}", "verify": mode, "send": []},
            # a partial refit the caller states is checked against exactly what it says
            {"name": f"partial {mode}", "verify": mode, "send": subset, "send_kwargs": {"partial": True}},
            {"name": f"expected {mode}", "verify": mode, "send": subset[:3], "send_kwargs": {"expected": [*subset[:3], NORM]}},
        ]
    nothing_declared = {rank: {n: None for n, _, _ in SPECS} for rank in ENGINES}  # released or offloaded weights
    out += [
        {"name": f"empty engines {mode}", "verify": mode, "send": [], "drift": nothing_declared} for mode in ("log", "enforce")
    ]
    out += [
        {"name": "partial nothing enforce", "verify": "enforce", "send": [], "send_kwargs": {"partial": True}},
        # rank 2 declares one more parameter after prepare: the sender must not check it against the old metadata
        {"name": "metadata changed after prepare", "verify": "enforce", "stale": 2},
        # rank 2's engine declares one more parameter while it loads: its batches were sliced by the old metadata
        {"name": "metadata changed during the stream", "verify": "enforce", "midstream": 2},
        # rank 1 re-declares the same metadata in another spelling: nothing changed, nothing to refuse
        {"name": "metadata respelled after prepare", "verify": "enforce", "respelled": 1},
        {"name": "no digests", "verify": "log", "engine_verify": {2: "off"}},
        {"name": "drift same size", "verify": "log", "drift": {2: {GATE: ((16, 32), F32)}}},
        # rank 2: k_proj's aligned size changes and model.steps is unknown (its walk fails); rank 1: v_proj
        # grows inside its alignment padding (its walk adds up; the sender's size check still names it)
        {
            "name": "drift other size",
            "verify": "off",
            "drift": {2: {K: ((24, 16), BF16), STEPS: None}, 1: {V: ((12, 16), BF16)}},
        },
        # different byte sizes cannot swap: the sender fails mid-stream and tells the engines
        {
            "name": "sender aborts",
            "verify": "log",
            "faults": FaultPlan((Fault("swap_params", "sender_after_digest", (Q, K)),)),
        },
        # input send() refuses before a byte moves, while the engines already wait in the stream's barrier
        {"name": "refused duplicate", "verify": "enforce", "refused": "duplicate"},
        {"name": "refused not a tensor", "verify": "log", "refused": "not a tensor"},
        {"name": "refused expected", "verify": "enforce", "send_kwargs": {"expected": [NORM, "model.unknown.weight"]}},
        # the trainer cannot build its sender (a plan it refuses) while the engines already wait in prepare's barrier
        {"name": "unbuildable sender", "verify": "log", "faults": FaultPlan((Fault("flip_bit", "sender_after_digest", (Q,), ranks=(2,)),))},
        # a fault on a parameter that is not sent (a typo, or one left out of this refit) would break nothing
        {"name": "fault on a name never sent", "verify": "enforce", "faults": FaultPlan((Fault("flip_bit", "wire", ("model.nrom.weight",)),))},
        {
            "name": "fault on a name not sent this time",
            "verify": "log",
            "send": [LN, Q],
            "send_kwargs": {"partial": True},
            "faults": FaultPlan((Fault("drop_param", "receiver_before_load", (NORM,), ranks=(1,)),)),
        },
        # faults that would strike no one: a buffer past the last one for one rank, a rank that is not an engine
        {"name": "ranked drop past the end", "verify": "enforce", "faults": FaultPlan((Fault("drop_buffer", "wire", buffer=99, ranks=(1,)),))},
        {"name": "fault on a rank not receiving", "verify": "enforce", "faults": FaultPlan((Fault("flip_bit", "wire", (NORM,), ranks=(7,)),))},
        {"name": "fault on the sender's rank", "verify": "log", "faults": FaultPlan((Fault("flip_bit", "receiver_before_load", (NORM,), ranks=(0,)),))},
        # the caller's names for the ranks (a cluster numbers its engines from 0), in warnings and errors
        {"name": "labelled log", "verify": "log", "label": True, "faults": FaultPlan((Fault("flip_bit", "wire", (NORM,), ranks=(2,)),))},
        {"name": "labelled enforce", "verify": "enforce", "label": True, "faults": FaultPlan((Fault("flip_bit", "wire", (NORM,), ranks=(2,)),))},
        {"name": "labelled no digests", "verify": "log", "label": True, "engine_verify": {2: "off"}},
        {"name": "labelled stale", "verify": "enforce", "label": True, "stale": 2},
        {"name": "dead before stream", "verify": "log", "dead": 2, "barrier_timeout_s": DEAD_TIMEOUT_S},
        # rank 1 reaches this barrier up to GROUP_TIMEOUT_S after rank 0 (it waited out the scenario before), so
        # the barrier waits longer; the stream's collectives run under the small group's SUB_TIMEOUT_S
        {
            "name": "dead mid stream",
            "verify": "log",
            "dead": 1,
            "subgroup": True,
            "barrier_timeout_s": 3 * GROUP_TIMEOUT_S,
        },
    ]
    return out


SCENARIOS = _scenarios()


# --- what runs in each spawned rank ----------------------------------------------------------------------------


class _Counters:
    """Counts every digest computed in this process and records what goes through gather_object."""

    def __init__(self) -> None:
        import torch.distributed as dist

        from wcviz.digest import _api

        self.digests = 0
        self.gathered: list[Any] = []
        words, sha = _api._words, _api._sha256_of
        gather = dist.gather_object

        def counted_words(*a: Any, **k: Any) -> Any:
            self.digests += 1
            return words(*a, **k)

        def counted_sha(*a: Any, **k: Any) -> Any:
            self.digests += 1
            return sha(*a, **k)

        def spied_gather(obj: Any, object_gather_list: Any = None, *a: Any, **k: Any) -> Any:
            out = gather(obj, object_gather_list, *a, **k)
            for item in [obj] + list(object_gather_list or []):
                if isinstance(item, dict) and "errors" in item:  # a stream's report, not prepare's metadata
                    self.gathered.append(sorted(item))
            return out

        _api._words, _api._sha256_of = counted_words, counted_sha  # type: ignore[assignment]
        dist.gather_object = spied_gather  # type: ignore[assignment]

    def reset(self) -> None:
        self.digests, self.gathered = 0, []


def _label(rank: int) -> str:
    """Global ranks as a caller that numbers its engines from 0 names them."""
    return "trainer" if rank == 0 else f"engine rank {rank - 1}"


def _error(e: BaseException) -> dict[str, Any]:
    return {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)}


def _refused(kind: str, weights: dict[str, torch.Tensor]) -> list[tuple[str, Any]]:
    """The trainer's weights as pairs send() refuses: layernorm's name twice, or the scale as a Python float."""
    if kind == "duplicate":
        return [*weights.items(), (LN, weights[LN])]
    return [(n, t.item() if n == SCALE else t) for n, t in weights.items()]


def _run_sender(sc: dict[str, Any], group: Any, warnings: list[str]) -> dict[str, Any]:
    from wcviz.refit.broadcast import BroadcastDigestMismatch, BroadcastSender, abort_before_prepare

    try:
        sender = BroadcastSender(
            verify=sc["verify"],
            src=0,
            group=group,
            buffer_bytes=BUFFER,
            faults=sc.get("faults"),
            timeout_s=sc.get("barrier_timeout_s"),
            rank_label=_label if sc.get("label") else None,
        )
    except ValueError as e:  # what a trainer does when it cannot build its sender: tell the engines, waiting in prepare
        abort_before_prepare(f"{type(e).__name__}: {e}", group=group, timeout_s=sc.get("barrier_timeout_s"))
        return {"error": _error(e)}
    record: dict[str, Any] = {}
    sender.prepare()
    t0 = time.monotonic()
    weights = trainer_weights()
    if "send" in sc:
        weights = {n: weights[n] for n in sc["send"]}
    try:
        items = _refused(sc["refused"], weights) if "refused" in sc else weights
        result = sender.send(items, **sc.get("send_kwargs", {}))
    except BroadcastDigestMismatch as e:
        record["error"] = _error(e)
        result = e.broadcast
    except Exception as e:  # noqa: BLE001 -- reported to the test, which says what it expected
        record["error"] = _error(e)
        result = None
    record["elapsed"] = time.monotonic() - t0
    if result is not None:
        record["ok"], record["verified"] = result.ok, result.verified
        record["ranks"] = sorted(result.ranks)
        record["bad"] = {
            rank: {k: tuple(getattr(r, k)) for k in ("mismatched", "missing", "unexpected") if getattr(r, k)}
            for rank, r in result.ranks.items()
            if r.bad
        }
    record["warnings"] = list(warnings)
    return record


def _run_engine(rank: int, sc: dict[str, Any], group: Any, q: Any) -> dict[str, Any]:
    from wcviz.refit.broadcast import BroadcastReceiver, metadata_of

    model = TinyLlama(sc.get("drift", {}).get(rank))
    dies_loading = sc.get("dead") == rank and sc.get("subgroup")
    me: list[Any] = []  # the receiver, once made (for a load that changes its metadata mid-stream)

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:
        if sc.get("midstream") == rank and me:
            me[0].metadata = {**me[0].metadata, "model.extra.weight": _packing.Meta((3,), "float32")}
        if dies_loading:
            q.put(("dying", rank, sc["name"]))
            q.close()
            q.join_thread()
            os._exit(0)
        model.load_weights(batch)

    receiver = BroadcastReceiver(
        metadata_of(model.weights()),
        load,
        verify=sc.get("engine_verify", {}).get(rank, sc["verify"]),
        src=0,
        group=group,
        faults=sc.get("faults"),
        timeout_s=sc.get("barrier_timeout_s"),
        rank_label=_label if sc.get("label") else None,
    )
    me.append(receiver)
    receiver.prepare()
    if sc.get("stale") == rank:
        receiver.metadata = {**receiver.metadata, "model.extra.weight": _packing.Meta((3,), "float32")}
    if sc.get("respelled") == rank:  # the same metadata in another spelling: list shapes, torch dtypes
        receiver.metadata = {n: (list(m.shape), getattr(torch, m.dtype)) for n, m in receiver.metadata.items()}
    if sc.get("dead") == rank and not sc.get("subgroup"):
        q.put(("dying", rank, sc["name"]))
        q.close()
        q.join_thread()
        os._exit(0)
    record: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        got = receiver.receive()
        record["params"] = got.params
    except Exception as e:  # noqa: BLE001 -- reported to the test
        record["error"] = _error(e)
    record["elapsed"] = time.monotonic() - t0
    record["state"] = {name: raw(t) for name, t in model.weights().items()}
    return record


def _worker(rank: int, port: int, q: Any) -> None:
    """One rank of the world: every scenario in order, a record for each on the queue."""
    os.environ["NUMBA_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from wcviz.digest import digest_hex

    digest_hex(torch.zeros(3))  # load the numba kernels before any collective starts its clock
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    sub = dist.new_group([0, 1], timeout=timedelta(seconds=SUB_TIMEOUT_S))
    counters = _Counters()
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("wcviz.refit").addHandler(Collect(logging.WARNING))
    for sc in SCENARIOS:
        if sc.get("subgroup") and rank not in (0, 1):
            continue
        group = sub if sc.get("subgroup") else None
        counters.reset()
        warnings.clear()
        try:
            record = _run_sender(sc, group, warnings) if rank == 0 else _run_engine(rank, sc, group, q)
        except Exception as e:  # noqa: BLE001 -- a failure outside send/receive (prepare, say): report it, keep going
            record = {"error": _error(e), "outside": True}
        record["digests"] = counters.digests
        record["gathered"] = list(counters.gathered)
        q.put(("record", rank, sc["name"], record))
    q.put(("done", rank, None))
    q.close()
    q.join_thread()
    os._exit(0)  # no teardown against dead peers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def world() -> dict[tuple[str, int], dict[str, Any]]:
    """Run the world once; ``{(scenario, rank): record}``."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, q), daemon=True) for rank in range(WORLD)]
    for p in procs:
        p.start()
    records: dict[tuple[str, int], dict[str, Any]] = {}
    finished: set[int] = set()
    deadline = time.monotonic() + WORLD_DEADLINE_S
    try:
        while len(finished) < WORLD and time.monotonic() < deadline:
            try:
                msg = q.get(timeout=1)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs):
                    break
                continue
            if msg[0] == "record":
                records[(msg[2], msg[1])] = msg[3]
            else:  # "done" or "dying": this rank sends nothing more
                finished.add(msg[1])
                if msg[0] == "dying":
                    records[(msg[2], msg[1])] = {"died": True}
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert finished == set(range(WORLD)), (
        f"ranks {sorted(set(range(WORLD)) - finished)} never finished; got {sorted(records)}"
    )
    return records


def rec(world: dict[tuple[str, int], dict[str, Any]], name: str, rank: int) -> dict[str, Any]:
    assert (name, rank) in world, f"no record of {name!r} from rank {rank}"
    return world[(name, rank)]


def differing(state: dict[str, bytes]) -> set[str]:
    """Names whose loaded bytes are not the trainer's."""
    want = {n: raw(t) for n, t in trainer_weights().items()}
    return {n for n in want if state.get(n) != want[n]}


# --- the tests -------------------------------------------------------------------------------------------------


def test_plan_has_the_buckets_the_scenarios_assume():
    buckets = bucket_names()
    assert buckets[0] == (EMBED,) and buckets[-1] == (HEAD,)  # each larger than half the buffer: alone
    assert buckets[1] == (LN, Q, K, V, O, INV) and buckets[5] == (DOWN, SCALE, BIAS, NORM, STEPS)
    assert (GATE,) in buckets and (UP,) in buckets


@pytest.mark.parametrize("mode", ["off", "log", "enforce"])
def test_clean_refit_loads_the_trainers_bytes_on_every_engine(world, mode):
    sent = rec(world, f"clean {mode}", 0)
    assert "error" not in sent, sent.get("error")
    assert sent["ranks"] == list(ENGINES)
    assert sent["ok"] is (mode != "off") and sent["verified"] is (mode != "off")
    assert not sent["bad"] and not sent["warnings"]
    for rank in ENGINES:
        got = rec(world, f"clean {mode}", rank)
        assert "error" not in got, got.get("error")
        assert got["params"] == len(SPECS)
        assert differing(got["state"]) == set(), f"rank {rank} did not load the trainer's weights"


def test_off_computes_no_digest_and_sends_none(world):
    for rank in range(WORLD):
        assert rec(world, "clean off", rank)["digests"] == 0, f"rank {rank} computed a digest with verify off"
        assert rec(world, "clean log", rank)["digests"] >= len(SPECS)  # the counter does count
    # the receivers' reports: no digests in off, digests in log (seen on both ends of the gather)
    for rank in range(WORLD):
        off, log = rec(world, "clean off", rank)["gathered"], rec(world, "clean log", rank)["gathered"]
        assert off and all(keys == ["errors"] for keys in off)
        assert log and all(keys == ["digests", "errors"] for keys in log)
    assert len(rec(world, "clean off", 0)["gathered"]) == len(ENGINES)


def _expected_warnings(bad: dict[int, dict[str, tuple[str, ...]]]) -> set[tuple[int, str]]:
    return {(rank, name) for rank, kinds in bad.items() for names in kinds.values() for name in names}


@pytest.mark.parametrize("mode", ["log", "enforce"])
@pytest.mark.parametrize(("label", "fault", "bad"), FAULTS, ids=[f[0] for f in FAULTS])
def test_fault_is_detected_with_exact_names_on_the_right_ranks(world, label, fault, bad, mode):
    sent = rec(world, f"{label} {mode}", 0)
    expected = {rank: {k: tuple(sorted(v)) for k, v in kinds.items()} for rank, kinds in bad.items()}
    assert sent["bad"] == expected
    assert sent["ranks"] == list(ENGINES)
    named = {
        (int(m[1]), m[2]) for w in sent["warnings"] for m in [re.match(r"refit broadcast: rank (\d+): (\S+) ", w)] if m
    }
    if mode == "log":
        assert "error" not in sent, sent.get("error")
        assert named == _expected_warnings(bad) and len(sent["warnings"]) == len(named)
    else:
        assert sent["error"]["type"] == "BroadcastDigestMismatch" and "RefitDigestMismatch" in sent["error"]["mro"]
        assert not sent["warnings"]
        message = sent["error"]["message"]
        for rank, names in _expected_warnings(bad):
            assert f"rank {rank}:" in message and names in message
        for rank in set(ENGINES) - set(bad):
            assert f"rank {rank}:" not in message
    # what the engines hold agrees with the verdict: exactly the named parameters are not the trainer's
    for rank in ENGINES:
        got = rec(world, f"{label} {mode}", rank)
        assert "error" not in got, got.get("error")
        named_here = {name for _, name in _expected_warnings({rank: bad.get(rank, {})})}
        assert differing(got["state"]) == named_here - {BIAS}  # an empty tensor cannot hold other bytes


@pytest.mark.parametrize("mode", ["log", "enforce"])
def test_a_subset_or_nothing_sent_is_missing_by_name_on_every_engine(world, mode):
    """The README's dropped-bucket bug: what an engine declares and never got is missing, never "verified"."""
    for label, missing in (("subset", {NORM, HEAD}), ("nothing", {n for n, _, _ in SPECS})):
        sent = rec(world, f"{label} {mode}", 0)
        assert sent["bad"] == {rank: {"missing": tuple(sorted(missing))} for rank in ENGINES}, label
        assert sent["ok"] is False
        if mode == "enforce":
            assert sent["error"]["type"] == "BroadcastDigestMismatch", sent.get("error")
            assert "declared by the receiver, never sent" in sent["error"]["message"]
            assert all(f"rank {rank}:" in sent["error"]["message"] for rank in ENGINES)
        else:
            assert "error" not in sent, sent.get("error")
            assert {(r, n) for r in ENGINES for n in missing} == {
                (int(m[1]), m[2]) for w in sent["warnings"] for m in [re.match(r"refit broadcast: rank (\d+): (\S+) is declared", w)] if m
            }


@pytest.mark.parametrize("mode", ["log", "enforce"])
def test_a_stated_partial_refit_expects_exactly_what_it_says(world, mode):
    partial = rec(world, f"partial {mode}", 0)
    assert "error" not in partial and partial["ok"] is True and not partial["bad"]
    listed = rec(world, f"expected {mode}", 0)  # three sent, four expected: the fourth is missing
    assert listed["bad"] == {rank: {"missing": (NORM,)} for rank in ENGINES}
    assert listed["ok"] is False and (mode == "log") is ("error" not in listed)


@pytest.mark.parametrize("mode", ["log", "enforce"])
def test_engines_that_declare_nothing_are_not_a_verified_refit(world, mode):
    """An empty refit to engines with no parameters was "refit of 0 parameters verified" on every rank."""
    sent = rec(world, f"empty engines {mode}", 0)
    assert sent["ok"] is False and sent["verified"] is True and sent["ranks"] == list(ENGINES)
    if mode == "enforce":
        assert sent["error"]["type"] == "BroadcastDigestMismatch", sent.get("error")
        message = sent["error"]["message"]
    else:
        assert "error" not in sent, sent.get("error")
        message = " ".join(sent["warnings"])
    for rank in ENGINES:
        assert f"rank {rank}: refit verified nothing, not ok: the receiver declares no parameters" in message
    assert "every digest matches" not in message


def test_a_stated_partial_refit_of_nothing_is_not_verified_on_any_engine(world):
    sent = rec(world, "partial nothing enforce", 0)
    assert sent["ok"] is False and sent["error"]["type"] == "BroadcastDigestMismatch", sent.get("error")
    assert all(f"rank {rank}: refit verified nothing" in sent["error"]["message"] for rank in ENGINES)
    assert "none was expected" in sent["error"]["message"]


def test_an_engine_whose_metadata_changes_while_it_loads_is_named_not_passed(world):
    sent = rec(world, "metadata changed during the stream", 0)
    assert sent["error"]["type"] == "RefitProtocolError", sent
    assert "rank 2: this engine's metadata changed during the refit" in sent["error"]["message"]
    assert rec(world, "metadata changed during the stream", 2)["error"]["type"] == "RefitProtocolError"


def test_the_same_metadata_in_another_spelling_is_not_a_change(world):
    sent = rec(world, "metadata respelled after prepare", 0)
    assert sent.get("ok") is True and "error" not in sent, sent
    assert "error" not in rec(world, "metadata respelled after prepare", 1)


def test_an_engine_whose_metadata_changed_after_prepare_is_named_not_passed(world):
    """Rank 2 declares one more parameter after prepare; the sender knew only the old metadata."""
    sent = rec(world, "metadata changed after prepare", 0)
    assert sent["error"]["type"] == "RefitProtocolError", sent.get("error")
    assert "rank 2: this engine's metadata changed since prepare()" in sent["error"]["message"]
    assert "rank 1" not in sent["error"]["message"]
    stale = rec(world, "metadata changed after prepare", 2)
    assert stale["error"]["type"] == "RefitProtocolError" and "changed since prepare" in stale["error"]["message"]
    assert set(stale["state"]) - {"model.extra.weight"} <= differing(stale["state"]) | {BIAS}  # nothing loaded there
    assert differing(rec(world, "metadata changed after prepare", 1)["state"]) == set()


def test_an_engine_that_sends_no_digests_is_a_protocol_error_naming_it(world):
    sent = rec(world, "no digests", 0)
    assert sent["error"]["type"] == "RefitProtocolError"
    assert "verification is on but rank 2 sent no digests" in sent["error"]["message"]
    assert rec(world, "no digests", 2)["digests"] == 0 and rec(world, "no digests", 1)["digests"] > 0
    for rank in ENGINES:  # the bytes still arrived
        assert differing(rec(world, "no digests", rank)["state"]) == set()


def test_metadata_drift_of_the_same_size_is_a_mismatch_on_that_rank_only(world):
    sent = rec(world, "drift same size", 0)
    assert "error" not in sent
    assert sent["bad"] == {2: {"mismatched": (GATE,)}}
    assert any(w.startswith(f"refit broadcast: rank 2: {GATE} differs") for w in sent["warnings"])


def test_metadata_drift_of_another_size_is_a_protocol_error_naming_rank_and_parameter(world):
    sent = rec(world, "drift other size", 0)
    assert sent["error"]["type"] == "RefitProtocolError", sent.get("error")
    message = sent["error"]["message"]
    parts = dict(re.findall(r"rank (\d+): (.*?)(?=; rank \d+: |$)", message))
    assert sorted(parts) == ["1", "2"], message
    rank1, rank2 = parts["1"], parts["2"]
    assert f"{V} is bfloat16 [12, 16] (384 bytes) there, bfloat16 [8, 16] (256 bytes) sent" in rank1
    assert f"{K} is bfloat16 [24, 16] (768 bytes) there" in rank2 and f"{STEPS} is not in its metadata" in rank2
    assert "bucket 1 (" in rank2 and "bucket 5 (" in rank2 and "not loaded" in rank2
    # rank 2 did not load the two buckets it could not slice, and says so itself
    engine2 = rec(world, "drift other size", 2)
    assert engine2["error"]["type"] == "RefitProtocolError" and "rank 2" in engine2["error"]["message"]
    assert engine2["state"][Q] == raw(torch.full((16, 16), 7, dtype=BF16))
    assert engine2["state"][HEAD] == raw(trainer_weights()[HEAD])
    # rank 1's walk added up: it loaded, but its v_proj is not the trainer's
    assert "error" not in rec(world, "drift other size", 1)


def test_a_failing_sender_aborts_the_stream_on_every_engine(world):
    sent = rec(world, "sender aborts", 0)
    assert sent["error"]["type"] == "ValueError" and "swap_params" in sent["error"]["message"]
    for rank in ENGINES:
        got = rec(world, "sender aborts", rank)
        assert got["error"]["type"] == "RefitProtocolError" and "aborted" in got["error"]["message"]
    # and the world stayed in step: the scenarios after it ran
    assert "error" in rec(world, "dead before stream", 0)


@pytest.mark.parametrize(
    "name, error, reason",
    [
        ("refused duplicate", "BroadcastDuplicateNames", f"duplicate parameter names: {LN}"),
        ("refused not a tensor", "TypeError", f"expected (str, torch.Tensor) pairs, got ({SCALE!r}, float)"),
        ("refused expected", "ValueError", "expected names the receiver does not declare: model.unknown.weight"),
    ],
)
def test_input_the_sender_refuses_aborts_every_engine_at_once(world, name, error, reason):
    # the engines wait in the stream's barrier: the trainer must still open it and tell them why, not leave them
    # to wait out the group's timeout and report a dead peer
    sent = rec(world, name, 0)
    assert sent["error"]["type"] == error and reason in sent["error"]["message"], sent.get("error")
    assert sent["elapsed"] < GROUP_TIMEOUT_S / 3 and not sent["warnings"]
    if error == "BroadcastDuplicateNames":  # a RefitError for a trainer that catches those, still a DigestError
        assert {"RefitError", "DigestError"} <= set(sent["error"]["mro"])
    untouched = {n: raw(t) for n, t in TinyLlama().weights().items()}
    for rank in ENGINES:
        got = rec(world, name, rank)
        assert got["error"]["type"] == "RefitProtocolError", got.get("error")
        message = got["error"]["message"]
        assert "the sender aborted the stream" in message and "refused its own input" in message, message
        assert f"{error}: {reason}" in message and "peer is dead" not in message
        assert got["elapsed"] < GROUP_TIMEOUT_S / 3, f"rank {rank} waited {got['elapsed']:.1f}s"
        assert got["state"] == untouched and got["gathered"] == []  # nothing loaded, no report


def test_a_trainer_that_cannot_build_its_sender_aborts_every_engine_at_prepare(world):
    """The trainer raised before prepare's barrier: the engines waited there out the group's timeout, and the group
    was broken for every later refit. Now they are told why at once, and the next scenarios run as usual."""
    sent = rec(world, "unbuildable sender", 0)
    assert sent["error"]["type"] == "ValueError" and "cannot be limited to ranks [2]" in sent["error"]["message"]
    for rank in ENGINES:
        got = rec(world, "unbuildable sender", rank)
        assert got["error"]["type"] == "RefitProtocolError", got["error"]
        message = got["error"]["message"]
        assert message.startswith("refit broadcast: the sender aborted the refit at prepare (ValueError: fault flip_bit")
        assert "peer is dead" not in message
    nxt = rec(world, "labelled log", 0)
    assert "error" not in nxt and nxt["ranks"] == list(ENGINES), nxt.get("error")


def test_a_fault_on_a_parameter_not_sent_is_refused_naming_the_nearest(world):
    """A misspelt fault was a silent no-op: the refit verified, as if the fault had been caught or tried."""
    sent = rec(world, "fault on a name never sent", 0)
    assert sent["error"]["type"] == "ValueError", sent.get("error")
    assert sent["error"]["message"].startswith(  # the nearest names sent, closest first
        f"fault flip_bit at wire names 'model.nrom.weight', which is not among the {len(SPECS)} parameters sent "
        f"(nearest: {NORM}, "
    )
    untouched = {n: raw(t) for n, t in TinyLlama().weights().items()}
    for rank in ENGINES:
        got = rec(world, "fault on a name never sent", rank)
        assert got["error"]["type"] == "RefitProtocolError" and "the sender aborted the stream" in got["error"]["message"]
        assert "names 'model.nrom.weight'" in got["error"]["message"] and got["state"] == untouched
    partial = rec(world, "fault on a name not sent this time", 0)
    assert partial["error"]["type"] == "ValueError", partial.get("error")
    assert f"fault drop_param at receiver_before_load names '{NORM}', which is not among the 2 parameters sent" in partial["error"]["message"]


def test_ranks_are_named_by_the_callers_label_in_warnings_and_errors(world):
    """A cluster numbers its engines from 0: "rank 2" in its errors was engine rank 1."""
    logged = rec(world, "labelled log", 0)
    assert logged["bad"] == {2: {"mismatched": (NORM,)}}  # the result stays keyed by global rank
    assert logged["warnings"] == [f"refit broadcast: engine rank 1: {NORM} differs between sender and receiver"]
    enforced = rec(world, "labelled enforce", 0)["error"]
    assert enforced["type"] == "BroadcastDigestMismatch", enforced
    assert enforced["message"].startswith("engine rank 1: refit verification failed for 1 of") and "rank 2" not in enforced["message"]
    silent = rec(world, "labelled no digests", 0)["error"]
    assert "verification is on but engine rank 1 sent no digests" in silent["message"], silent
    stale = rec(world, "labelled stale", 0)["error"]
    assert stale["type"] == "RefitProtocolError" and "engine rank 1: this engine's metadata changed since prepare()" in stale["message"]
    assert "rank 2" not in stale["message"]
    engine = rec(world, "labelled stale", 2)["error"]
    assert engine["message"].startswith("refit broadcast: engine rank 1: this engine's metadata changed"), engine


def test_a_peer_dead_before_the_stream_is_named_within_the_timeout(world):
    assert rec(world, "dead before stream", 2) == {"died": True}
    sent = rec(world, "dead before stream", 0)
    assert sent["error"]["type"] == "RefitTimeout", sent.get("error")
    assert re.search(r"Ranks? 2 failed to pass monitoredBarrier", sent["error"]["message"]), sent["error"]["message"]
    assert sent["elapsed"] < DEAD_TIMEOUT_S + 10
    # a live engine is not told by the trainer: it waits for it at most the group's timeout
    engine = rec(world, "dead before stream", 1)
    assert engine["error"]["type"] == "RefitTimeout" and engine["elapsed"] < GROUP_TIMEOUT_S + 10


def test_a_peer_dying_mid_stream_is_a_timeout_not_a_hang(world):
    assert rec(world, "dead mid stream", 1) == {"died": True}
    sent = rec(world, "dead mid stream", 0)
    assert sent["error"]["type"] == "RefitTimeout", sent.get("error")
    step = r"(bucket \d+'s .*|the completion header|the engines' reports)"  # where the death shows depends on timing
    assert re.search(step + " failed on rank 0: a peer is dead or did not answer in time", sent["error"]["message"])
    assert sent["elapsed"] < SUB_TIMEOUT_S + 10


# --- in-process checks of the pieces ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,reason",
    [
        ("ranked drop past the end", r"fault drop_buffer names buffer 99, but this send packs \d+ buffer\(s\)"),
        ("fault on a rank not receiving", r"fault flip_bit at wire names rank\(s\) \[7\], which receive nothing; the receivers are \[1, 2\]"),
        ("fault on the sender's rank", r"fault flip_bit at receiver_before_load names rank\(s\) \[0\], which receive nothing"),
    ],
)
def test_a_fault_that_strikes_no_engine_is_refused_before_anything_is_sent(world, name, reason):
    """A drop_buffer past the last buffer limited to some ranks (the sender checked only its own faults) and a fault
    on a rank that receives nothing were silent no-ops: the refit verified as if the fault had been tried."""
    sent = rec(world, name, 0)
    assert sent["error"]["type"] == "ValueError" and re.search(reason, sent["error"]["message"]), sent.get("error")
    untouched = {n: raw(t) for n, t in TinyLlama().weights().items()}
    for rank in ENGINES:
        got = rec(world, name, rank)
        assert got["error"]["type"] == "RefitProtocolError" and "the sender aborted the stream" in got["error"]["message"]
        assert got["state"] == untouched


def test_construction_checks():
    from wcviz.refit.broadcast import BroadcastReceiver, BroadcastSender

    with pytest.raises(ValueError, match="invalid value for verify.mode"):
        BroadcastSender(verify="Enforce")
    with pytest.raises(ValueError, match="alignment"):
        BroadcastSender(buffer_bytes=100)
    with pytest.raises(ValueError, match="cannot be limited to ranks"):
        BroadcastSender(faults=FaultPlan((Fault("flip_bit", "sender_after_digest", (Q,), ranks=(1,)),)))
    with pytest.raises(ValueError, match="invalid value for verify.mode"):
        BroadcastReceiver({}, lambda batch: None, verify="on")
    assert BroadcastSender.supports_verify and BroadcastReceiver.supports_verify
    assert Fault("flip_bit", "wire", (Q,), ranks=[2]).ranks == (2,)  # type: ignore[arg-type]
    assert Fault("flip_bit", "wire", (Q,)).ranks == ()


def test_a_name_given_twice_is_a_refit_error_and_still_a_digest_error():
    from wcviz import DigestError
    from wcviz.refit import RefitError
    from wcviz.refit.broadcast import BroadcastDuplicateNames, BroadcastSender

    sender = BroadcastSender(verify="enforce")
    sender.metadata = {1: {}}
    notices: list[Any] = []
    sender._barrier = lambda step: None  # type: ignore[method-assign]
    sender._broadcast_object = lambda step, obj=None: notices.append((step, obj))  # type: ignore[method-assign]
    w = torch.ones(2)
    with pytest.raises(BroadcastDuplicateNames, match="^duplicate parameter names: a, b$") as info:
        sender.send([("a", w), ("b", w), ("a", w), ("b", w)])
    assert isinstance(info.value, RefitError) and isinstance(info.value, DigestError)
    why = "the trainer refused its own input, nothing was sent: BroadcastDuplicateNames: duplicate parameter names: a, b"
    assert notices == [("the abort notice", {"kind": "abort", "error": why})]


def test_shift_and_swap_helpers():
    from wcviz.refit.faults import Swapper, shifted

    t = torch.arange(1, 5, dtype=torch.int32)
    assert shifted(t, 4).tolist() == [0, 1, 2, 3]
    assert shifted(t, 100).tolist() == [0, 0, 0, 0]
    swap = Swapper([Fault("swap_params", "wire", ("a", "b"))])
    a, b = torch.ones(2, dtype=torch.float32), torch.tensor([5, 6], dtype=torch.int32)
    assert swap("x", t) == [("x", t)]
    assert swap("a", a) == []
    (n1, t1), (n2, t2) = swap("b", b)
    assert (n1, n2) == ("a", "b") and t1.dtype == torch.float32 and t2.dtype == torch.int32
    assert raw(t1) == raw(b) and raw(t2) == raw(a)
    assert swap.flush() == []


def test_broadcast_mismatch_pickles_with_every_rank():
    import pickle

    from wcviz.refit.broadcast import BroadcastDigestMismatch, BroadcastResult
    from wcviz.refit.verify import RefitDigestMismatch, RefitResult

    r1 = RefitResult("enforce", 2, 8, verified=True)
    r2 = RefitResult("enforce", 2, 8, verified=True, mismatched=("w",))
    e = pickle.loads(pickle.dumps(BroadcastDigestMismatch(BroadcastResult("enforce", 2, 8, {1: r1, 2: r2}))))
    assert isinstance(e, RefitDigestMismatch) and e.ranks == (2,) and e.result == r2
    assert str(e).startswith("rank 2: ") and "w" in str(e) and "rank 1" not in str(e)
    assert e.broadcast.bad == {2: ["w"]} and not e.broadcast.ok
    named = pickle.loads(pickle.dumps(BroadcastDigestMismatch(e.broadcast, {1: "engine rank 0", 2: "engine rank 1"})))
    assert str(named).startswith("engine rank 1: ") and "rank 2" not in str(named) and named.ranks == (2,)
