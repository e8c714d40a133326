"""The pieces every refit transport shares: the comparison, the fault plan, the buffer packing."""

from __future__ import annotations

import itertools
import logging
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wcviz import AlgorithmMismatch
from wcviz._errors import WcvizError
from wcviz.digest import Digest, digest_hex
from wcviz.refit import _packing
from wcviz.refit._packing import ALIGN, Bucket, aligned, pack, plan, unpack, walk
from wcviz.refit.faults import KINDS, POINTS, Fault, FaultPlan
from wcviz.refit.verify import (
    MODES,
    RefitDigestMismatch,
    RefitError,
    RefitProtocolError,
    RefitResult,
    check,
    verify_digests,
)


def hexes(**tensors: torch.Tensor) -> dict[str, Digest]:
    return {name: digest_hex(t, backend="torch") for name, t in tensors.items()}


@pytest.fixture
def sides() -> tuple[dict[str, Digest], dict[str, Digest]]:
    """Sender sent a, b, c, d; the receiver holds a intact, b changed, d intact, c never arrived, e unasked."""
    a, b, c, d, e = (torch.arange(4, dtype=torch.float32) + i for i in range(5))
    sender = hexes(a=a, b=b, c=c, d=d)
    receiver = hexes(a=a, b=b + 1, d=d, e=e)
    return sender, receiver


def refit_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "wcviz.refit" and r.levelno == logging.WARNING]


# --- verify.check ---------------------------------------------------------------------------------------------


def test_modes():
    assert MODES == ("off", "log", "enforce")


def test_off_compares_nothing_and_is_never_a_pass(sides, caplog):
    sender, receiver = sides
    # a comparison of digests of two algorithms would raise: off must not even look
    poisoned = {n: Digest(str(v), "sha256") for n, v in receiver.items()}
    for other in (receiver, poisoned, None, {}):
        with caplog.at_level(logging.DEBUG, logger="wcviz.refit"):
            r = verify_digests("off", sender, other, nbytes=123)
        assert (r.mode, r.params, r.nbytes, r.verified) == ("off", 4, 123, False)
        assert r.mismatched == r.missing == r.unexpected == () and r.bad == []
        assert r.ok is False
    assert refit_warnings(caplog) == []
    assert verify_digests("off", sender, dict(sender)).ok is False  # even identical sides: off is not "ok"


def test_log_reports_exactly_what_differs(sides, caplog):
    sender, receiver = sides
    with caplog.at_level(logging.WARNING, logger="wcviz.refit"):
        r = verify_digests("log", sender, receiver, nbytes=64)
    assert r.verified and not r.ok
    assert r.mismatched == ("b",)
    assert r.missing == ("c",)
    assert r.unexpected == ("e",)
    assert r.bad == ["b", "c", "e"]
    assert (r.mode, r.params, r.nbytes) == ("log", 4, 64)
    assert r.sender == sender and r.receiver == receiver
    warnings = refit_warnings(caplog)
    assert len(warnings) == 3  # one per bad parameter, none for the good ones
    for name, what in (("b", "differs"), ("c", "never received"), ("e", "never sent")):
        assert sum(f" {name} " in w and what in w for w in warnings) == 1
    assert not any(" a " in w or " d " in w for w in warnings)


def test_log_with_everything_intact(sides, caplog):
    sender, _ = sides
    with caplog.at_level(logging.WARNING, logger="wcviz.refit"):
        r = verify_digests("log", sender, dict(sender))
    assert r.ok and r.verified and r.bad == []
    assert refit_warnings(caplog) == []


def test_hex_case_does_not_matter():
    assert verify_digests("enforce", {"w": "ABCDEF"}, {"w": "abcdef"}).ok


def test_result_keeps_its_own_copy_of_both_sides(sides):
    sender, receiver = sides
    r = verify_digests("log", sender, receiver)
    sender["z"] = "00"
    receiver.clear()
    assert "z" not in r.sender and "e" in r.receiver


@pytest.mark.parametrize("many", [False, True])
def test_enforce_raises_naming_every_bad_parameter(sides, caplog, many):
    sender, receiver = sides
    if many:
        receiver = {n: "0" * 32 for n in [*sender, "x", "y"]}
    with pytest.raises(RefitDigestMismatch) as info:
        verify_digests("enforce", sender, receiver)
    err = info.value
    assert isinstance(err, RuntimeError) and isinstance(err, RefitError) and isinstance(err, WcvizError)
    assert isinstance(err.result, RefitResult) and err.result.mode == "enforce" and not err.result.ok
    bad = ["a", "b", "c", "d", "x", "y"] if many else ["b", "c", "e"]
    assert err.result.bad == bad
    for name in bad:
        assert name in str(err)
    assert str(err) == err.result.describe()


def test_enforce_passes_when_intact(sides):
    sender, _ = sides
    r = verify_digests("enforce", sender, dict(sender), nbytes=7)
    assert r.ok and r.mode == "enforce" and r.nbytes == 7


def test_a_comparison_of_nothing_is_never_verified(caplog):
    """Nothing sent, expected or received: not "verified: every digest matches" but not ok, said so; enforce raises."""
    with caplog.at_level(logging.WARNING, logger="wcviz.refit"):
        r = verify_digests("log", {}, {})
    assert r.empty and not r.ok and r.bad == []
    assert "verified nothing" in r.describe() and "every digest matches" not in r.describe()
    assert any("verified nothing" in w for w in refit_warnings(caplog))
    with pytest.raises(RefitDigestMismatch, match="verified nothing") as err:
        verify_digests("enforce", {}, {})
    assert err.value.result.empty


@pytest.mark.parametrize(
    ("declared", "expected", "why"),
    [(0, None, "the receiver declares no parameters"), (3, [], "no parameter was sent and none was expected")],
    ids=["empty-receiver", "partial-of-nothing"],
)
def test_an_empty_receiver_or_an_empty_partial_refit_is_named(declared, expected, why):
    with pytest.raises(RefitDigestMismatch, match=why):
        verify_digests("enforce", {}, {}, expected=expected, declared=declared)
    r = verify_digests("log", {}, {}, expected=expected, declared=declared)
    assert not r.ok and r.declared == declared and why in r.describe()
    off = verify_digests("off", {}, {}, expected=expected, declared=declared)
    assert not off.ok and not off.empty and "not verified" in off.describe()


def test_one_parameter_checked_is_not_empty(sides):
    sender, _ = sides
    one = {"a": sender["a"]}
    assert verify_digests("enforce", one, dict(one), declared=1).ok
    missing = verify_digests("log", {}, {}, expected=["a"], declared=1)  # declared, never sent: missing, not empty
    assert not missing.empty and missing.missing == ("a",)


def test_digest_mismatch_survives_pickling(sides):
    # raised on one side of a process boundary, reported on the other
    sender, receiver = sides
    with pytest.raises(RefitDigestMismatch) as info:
        verify_digests("enforce", sender, receiver)
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is RefitDigestMismatch
    assert back.result == info.value.result and str(back) == str(info.value)


@pytest.mark.parametrize("mode", ["log", "enforce"])
def test_no_receiver_digests_is_a_protocol_error(sides, mode):
    sender, _ = sides
    with pytest.raises(RefitProtocolError, match="no digests"):
        verify_digests(mode, sender, None)


@pytest.mark.parametrize("mode", ["", "Off", "LOG", "strict", None])
def test_unknown_mode(sides, mode):
    sender, receiver = sides
    with pytest.raises(ValueError, match="off, log, enforce") as info:
        verify_digests(mode, sender, receiver)  # type: ignore[arg-type]
    assert repr(mode) in str(info.value)


@pytest.mark.parametrize("mode", ["log", "enforce"])
def test_algorithm_mismatch_raises(mode):
    t = torch.arange(3, dtype=torch.float32)
    sender = {"w": digest_hex(t, backend="torch")}
    receiver = {"w": digest_hex(t, algo="sha256")}
    assert sender["w"].algo != receiver["w"].algo
    with pytest.raises(AlgorithmMismatch, match="sha256"):
        verify_digests(mode, sender, receiver)
    # same text, different algorithm labels: still refused
    with pytest.raises(AlgorithmMismatch):
        verify_digests(mode, {"w": Digest("ab" * 16, "nemo-rl-v3")}, {"w": Digest("ab" * 16, "sha256")})


def test_describe():
    off = RefitResult("off", params=3, nbytes=1536)
    assert off.describe() == "refit of 3 parameters (1,536 bytes), not verified (mode off)"
    good = RefitResult("log", params=2, nbytes=10, verified=True)
    assert good.describe() == "refit of 2 parameters (10 bytes) verified: every digest matches"
    bad = RefitResult(
        "log", params=4, nbytes=0, verified=True, mismatched=("b",), missing=("c", "f"), unexpected=("e",)
    )
    assert bad.describe() == (
        "refit verification failed for 4 of 4 parameters; digest differs: b; never received: c, f; never sent: e"
    )
    only_missing = RefitResult("enforce", params=1, nbytes=0, verified=True, missing=("w",))
    assert only_missing.describe() == "refit verification failed for 1 of 1 parameters; never received: w"


# --- faults ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kind": "flip", "point": "wire", "params": ("w",)}, "unknown fault kind 'flip'; choose one of flip_bit"),
        (
            {"kind": "flip_bit", "point": "network", "params": ("w",)},
            "unknown fault point 'network'; choose one of sender_after_digest",
        ),
        ({"kind": "flip_bit", "point": "wire"}, r"flip_bit needs 1 parameter name\(s\), got \[\]"),
        ({"kind": "flip_bit", "point": "wire", "params": ("a", "b")}, r"needs 1 parameter name\(s\), got \['a', 'b'\]"),
        ({"kind": "drop_param", "point": "wire"}, "drop_param needs 1"),
        ({"kind": "cast_dtype", "point": "wire", "params": ("a", "b"), "dtype": "int32"}, "cast_dtype needs 1"),
        ({"kind": "swap_params", "point": "wire", "params": ("a",)}, "swap_params needs 2"),
        ({"kind": "drop_buffer", "point": "wire", "params": ("a",), "buffer": 0}, "drop_buffer needs 0"),
        ({"kind": "drop_buffer", "point": "wire"}, "drop_buffer needs buffer=<index> and point='wire'"),
        (
            {"kind": "drop_buffer", "point": "sender_after_digest", "buffer": 1},
            "drop_buffer needs buffer=<index> and point='wire'",
        ),
        ({"kind": "cast_dtype", "point": "wire", "params": ("w",)}, "cast_dtype needs dtype=<name>"),
        ({"kind": "cast_dtype", "point": "wire", "params": ("w",), "dtype": ""}, "cast_dtype needs dtype=<name>"),
        ({"kind": "flip_bit", "point": "wire", "params": "w"}, "must be a tuple of names, got the string 'w'"),
    ],
)
def test_fault_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Fault(**kwargs)


def test_valid_faults():
    for point in POINTS:
        assert Fault("flip_bit", point, ("w",)).point == point
    for kind, kw in {
        "flip_bit": {"params": ("w",)},
        "drop_param": {"params": ("w",)},
        "drop_buffer": {"buffer": 0},
        "shift_offset": {"params": ("w",), "shift": 16},
        "cast_dtype": {"params": ("w",), "dtype": "int32"},
        "swap_params": {"params": ("a", "b")},
    }.items():
        assert Fault(kind, "wire", **kw).kind == kind
    assert set(KINDS) == {"flip_bit", "drop_param", "drop_buffer", "shift_offset", "cast_dtype", "swap_params"}
    f = Fault("swap_params", "wire", ["a", "b"])  # type: ignore[arg-type]
    assert f.params == ("a", "b") and hash(f) == hash(Fault("swap_params", "wire", ("a", "b")))


PLAN = FaultPlan(
    (
        Fault("flip_bit", "wire", ("a",), bit=3),
        Fault("drop_param", "receiver_before_load", ("b",)),
        Fault("cast_dtype", "sender_after_digest", ("a",), dtype="int32"),
        Fault("swap_params", "wire", ("b", "c")),
        Fault("drop_buffer", "wire", buffer=2),
    )
)


def test_plan_at():
    f = PLAN.faults
    assert PLAN.at("wire") == [f[0], f[3], f[4]]
    assert PLAN.at("wire", "a") == [f[0]]
    assert PLAN.at("wire", "b") == [f[3]]
    assert PLAN.at("wire", "c") == [f[3]]
    assert PLAN.at("wire", kind="drop_buffer") == [f[4]]
    assert PLAN.at("wire", "a", kind="swap_params") == []
    assert PLAN.at("sender_after_digest", "a") == [f[2]]
    assert PLAN.at("receiver_before_load") == [f[1]]
    assert PLAN.at("receiver_before_load", "a") == []
    assert FaultPlan().at("wire") == [] and FaultPlan().faults == ()


def test_drops_buffer():
    assert PLAN.drops_buffer(2)
    assert not PLAN.drops_buffer(0) and not PLAN.drops_buffer(1) and not PLAN.drops_buffer(3)
    assert not FaultPlan().drops_buffer(0)
    # only a drop_buffer fault drops a buffer, whatever else carries a buffer index
    assert not FaultPlan((Fault("flip_bit", "wire", ("a",), buffer=0),)).drops_buffer(0)


def bits_differing(x: torch.Tensor, y: torch.Tensor) -> int:
    a = x.contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    b = y.contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    return sum(v.bit_count() for v in (a ^ b).tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.uint8])
@pytest.mark.parametrize("bit", [0, 3, 8, 13, 63])
def test_flip_bit_flips_exactly_one_bit(dtype, bit):
    t = (torch.arange(24) % 7).to(dtype).reshape(4, 6)
    before = t.clone()
    plan = FaultPlan((Fault("flip_bit", "wire", ("w",), bit=bit),))
    out = plan.alter("wire", "w", t)
    assert out is not None and out is not t
    assert out.dtype == t.dtype and out.shape == t.shape
    assert bits_differing(out, t) == 1
    raw = out.reshape(-1).view(torch.uint8) ^ t.reshape(-1).view(torch.uint8)
    assert raw[bit // 8].item() == 1 << (bit % 8)  # the bit asked for, in row-major byte order
    assert torch.equal(t, before)  # the original is untouched


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # dense but not contiguous
        lambda: torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2],  # strided
        lambda: torch.tensor(2.5),  # 0-d
        lambda: torch.tensor([True, False, True]),
    ],
    ids=["transposed", "strided", "0-d", "bool"],
)
def test_flip_bit_on_any_layout(make):
    t = make()
    before = t.clone()
    out = FaultPlan((Fault("flip_bit", "wire", ("w",), bit=1),)).alter("wire", "w", t)
    assert out is not None and bits_differing(out, t) == 1
    assert torch.equal(t, before)


def test_flip_bit_wraps_past_the_end():
    t = torch.zeros(2, dtype=torch.uint8)
    out = FaultPlan((Fault("flip_bit", "wire", ("w",), bit=8 * 5 + 2),)).alter("wire", "w", t)
    assert out.tolist() == [0, 4]  # byte 5 % 2 == 1, bit 2


def test_flip_bit_on_an_empty_tensor_names_it():
    with pytest.raises(ValueError, match="'w'.*empty"):
        FaultPlan((Fault("flip_bit", "wire", ("w",)),)).alter("wire", "w", torch.empty(0, 3))


def test_drop_param():
    plan = FaultPlan((Fault("drop_param", "receiver_before_load", ("w",)),))
    assert plan.alter("receiver_before_load", "w", torch.ones(3)) is None
    t = torch.ones(3)
    assert plan.alter("wire", "w", t) is t


def test_cast_dtype_same_size():
    t = torch.tensor([1.5, -2.25, 3.0])
    out = FaultPlan((Fault("cast_dtype", "sender_after_digest", ("w",), dtype="int32"),)).alter(
        "sender_after_digest", "w", t
    )
    assert out.dtype == torch.int32 and out.tolist() == [1, -2, 3]
    assert out.element_size() == t.element_size() and out.shape == t.shape
    assert t.dtype == torch.float32 and t.tolist() == [1.5, -2.25, 3.0]
    bf = FaultPlan((Fault("cast_dtype", "wire", ("w",), dtype="torch.bfloat16"),)).alter("wire", "w", t.half())
    assert bf.dtype == torch.bfloat16


def test_cast_dtype_size_change_names_the_parameter():
    plan = FaultPlan((Fault("cast_dtype", "wire", ("layers.0.w",), dtype="float16"),))
    with pytest.raises(ValueError, match=r"'layers\.0\.w'.*float32 -> torch\.float16 changes the byte size"):
        plan.alter("wire", "layers.0.w", torch.ones(2))


def test_untouched_names_and_points_return_the_same_tensor():
    t = torch.ones(3)
    for point in POINTS:
        assert PLAN.alter(point, "zzz", t) is t
    assert PLAN.alter("receiver_before_load", "a", t) is t
    # swap_params / drop_buffer are the transport's to apply: alter leaves the tensor alone
    assert PLAN.alter("wire", "c", t) is t
    assert FaultPlan().alter("wire", "a", t) is t


def test_faults_compose_in_order():
    plan = FaultPlan(
        (
            Fault("flip_bit", "wire", ("w",), bit=0),
            Fault("cast_dtype", "wire", ("w",), dtype="int32"),
        )
    )
    out = plan.alter("wire", "w", torch.tensor([1.0]))
    # 1.0 with its lowest mantissa bit set is just above 1.0, which casts to 1
    assert out.dtype == torch.int32 and out.tolist() == [1]
    dropped = FaultPlan((Fault("flip_bit", "wire", ("w",)), Fault("drop_param", "wire", ("w",))))
    assert dropped.alter("wire", "w", torch.ones(1)) is None


def test_plans_are_picklable():
    back = pickle.loads(pickle.dumps(PLAN))
    assert back == PLAN and back is not PLAN
    assert back.drops_buffer(2) and back.at("wire", "a") == [PLAN.faults[0]]
    t = torch.arange(4, dtype=torch.float32)
    assert torch.equal(back.alter("wire", "a", t), PLAN.alter("wire", "a", t))


# --- packing --------------------------------------------------------------------------------------------------


def test_aligned():
    assert [aligned(n) for n in (0, 1, 511, 512, 513, 1024, 1025)] == [0, 512, 512, 512, 1024, 1024, 1536]
    assert ALIGN == 512


def test_plan_keeps_order_and_aligns():
    sizes = [("a", 100), ("b", 512), ("c", 1), ("d", 0), ("e", 700)]
    buckets = plan(sizes, 4096)
    assert buckets == [Bucket(("a", "b", "c", "d", "e"), (0, 512, 1024, 1536, 1536), 2560)]


def test_plan_splits_into_buckets_that_fit():
    sizes = [(f"p{i}", 1000) for i in range(7)]
    buckets = plan(sizes, 2048)
    assert [b.names for b in buckets] == [("p0", "p1"), ("p2", "p3"), ("p4", "p5"), ("p6",)]
    assert all(b.offsets[0] == 0 and b.used <= 2048 and not b.own for b in buckets)
    assert buckets[0].offsets == (0, 1024) and buckets[0].used == 2048


def test_large_parameter_travels_alone():
    buckets = plan([("a", 10), ("big", 1025), ("b", 10), ("half", 1024), ("c", 10)], 2048)
    assert buckets == [
        Bucket(("a",), (0,), 512),
        Bucket(("big",), (0,), 1536, own=True),
        Bucket(("b", "half", "c"), (0, 512, 1536), 2048),
    ]
    # larger than the whole buffer, first thing in the stream
    assert plan([("huge", 10_000), ("x", 1)], 1024) == [
        Bucket(("huge",), (0,), aligned(10_000), own=True),
        Bucket(("x",), (0,), 512),
    ]


def test_plan_with_zero_size_tensors():
    assert plan([("e1", 0), ("e2", 0)], 512) == [Bucket(("e1", "e2"), (0, 0), 0)]
    assert plan([("e", 0), ("a", 3), ("f", 0), ("b", 3)], 1024) == [
        Bucket(("e", "a", "f", "b"), (0, 0, 512, 512), 1024)
    ]
    assert plan([], 1024) == []


def test_plan_capacity_not_a_multiple_of_align():
    # 400 bytes at 0, then 400 at 512 would end at 912 <= 1000, but its aligned end (1024) does not fit
    buckets = plan([("a", 400), ("b", 400)], 1000)
    assert buckets == [Bucket(("a",), (0,), 512), Bucket(("b",), (0,), 512)]


@pytest.mark.parametrize("capacity", [0, 1, 511, -512])
def test_plan_rejects_a_tiny_buffer(capacity):
    with pytest.raises(ValueError, match=f"{capacity} bytes is smaller than the 512-byte alignment"):
        plan([("a", 1)], capacity)


def check_plan(sizes: list[tuple[str, int]], capacity: int, buckets: list[Bucket]) -> None:
    assert [n for b in buckets for n in b.names] == [n for n, _ in sizes]  # each name once, in order
    size = dict(sizes)
    for b in buckets:
        assert b.names and len(b.names) == len(b.offsets)
        assert b.offsets[0] == 0
        end = 0
        for name, off in zip(b.names, b.offsets):
            assert off % ALIGN == 0 and off >= end  # aligned, after the previous one ends
            end = off + size[name]
        assert b.used == aligned(end)
        if b.own:
            assert len(b.names) == 1 and size[b.names[0]] > capacity // 2
        else:
            assert b.used <= capacity and all(size[n] <= capacity // 2 for n in b.names)
    for b, nxt in itertools.pairwise(buckets):  # a bucket closes only when the next parameter would not fit
        if not b.own and not nxt.own:
            assert aligned(b.used + size[nxt.names[0]]) > capacity


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 5000), max_size=40),
    st.integers(ALIGN, 8192),
)
def test_plan_property(nbytes, capacity):
    sizes = [(f"p{i}", n) for i, n in enumerate(nbytes)]
    check_plan(sizes, capacity, plan(sizes, capacity))


META = {
    "w": ((4, 8), "float32"),
    "b": ((8,), "bfloat16"),
    "s": ((), "int64"),
    "e": ((0, 3), "float16"),
    "m": ((3, 3), "bool"),
}


def nbytes_of(meta) -> int:
    shape, dtype = meta
    return math.prod(shape) * getattr(torch, dtype).itemsize


def test_walk_matches_plan():
    names = list(META)
    buckets = plan([(n, nbytes_of(META[n])) for n in names], 1 << 16)
    assert len(buckets) == 1
    walked, end = walk(names, META)
    assert [w[0] for w in walked] == names
    assert tuple(w[1] for w in walked) == buckets[0].offsets
    assert [w[2] for w in walked] == [META[n] for n in names]
    assert end == buckets[0].used


def test_walk_accepts_metadata_from_json():
    walked, end = walk(["w"], {"w": ([4, 8], "torch.float32")})
    assert walked == [("w", 0, ((4, 8), "torch.float32"))] and end == 512


def test_walk_unknown_name():
    with pytest.raises(KeyError, match="'ghost'"):
        walk(["w", "ghost", "b"], META)


def test_walk_shows_drift():
    names = ["w", "b", "m"]
    base = dict(META, w=((4, 128), "float32"))  # 2048 bytes
    walked, end = walk(names, base)
    assert [o for _, o, _ in walked] == [0, 2048, 2560] and end == 3072
    # same byte size (float32 -> int32, shape transposed): the walk cannot tell, the digest will
    assert walk(names, dict(base, w=((128, 4), "int32")))[1] == end
    # a dtype or shape that changes the byte size moves what follows and the end
    shifted, wider_end = walk(names, dict(base, w=((4, 128), "float64")))
    assert [o for _, o, _ in shifted] == [0, 4096, 4608] and wider_end == end + 2048
    assert walk(names, dict(base, b=((8 * 300,), "bfloat16")))[1] == end + 4608
    assert walk(names, dict(base, m=((3, 3), "int64")))[1] == end  # 72 bytes still fit the last 512


ROUNDTRIP = [
    torch.randn(4, 8),
    torch.randn(3, 5).to(torch.bfloat16),
    torch.randn(7).half(),
    torch.randn(2, 3, dtype=torch.float64),
    torch.randint(-100, 100, (5, 2), dtype=torch.int64),
    torch.randint(-100, 100, (9,), dtype=torch.int8),
    torch.randint(0, 255, (13,), dtype=torch.uint8),
    torch.randint(-1000, 1000, (3,), dtype=torch.int32),
    torch.tensor([True, False, True, True]),
    torch.randn(4, dtype=torch.complex64),
    torch.tensor(3.25),
    torch.tensor(7, dtype=torch.int64),
    torch.empty(0),
    torch.empty(3, 0, dtype=torch.bfloat16),
    torch.randn(6, 4).t(),  # non-contiguous
    torch.randn(5, 6)[1:4, ::2],  # non-contiguous, offset storage
    torch.randn(4).expand(3, 4),  # stride 0
]


def meta_of(t: torch.Tensor):
    return tuple(t.shape), str(t.dtype).removeprefix("torch.")


def test_pack_unpack_roundtrip():
    torch.manual_seed(0)
    tensors = {f"t{i}": t for i, t in enumerate(ROUNDTRIP)}
    metas = {n: meta_of(t) for n, t in tensors.items()}
    walked, end = walk(list(tensors), metas)
    buf = torch.full((end + 512,), 0xAA, dtype=torch.uint8)
    for name, off, _ in walked:
        pack(buf, off, tensors[name])
    # nothing was written outside the parameters' bytes
    written = torch.zeros(buf.numel(), dtype=torch.bool)
    for name, off, meta in walked:
        written[off : off + nbytes_of(meta)] = True
    assert bool((buf[~written] == 0xAA).all())
    for name, off, meta in walked:
        out = unpack(buf, off, meta)
        t = tensors[name]
        assert out.dtype == t.dtype and out.shape == t.shape, name
        assert torch.equal(out, t), name


def test_unpack_is_a_view():
    buf = torch.zeros(2048, dtype=torch.uint8)
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    pack(buf, 512, t)
    out = unpack(buf, 512, ((2, 3), "float32"))
    assert out.data_ptr() == buf.data_ptr() + 512
    buf[512:516] = 0
    assert out[0, 0].item() == 0.0


def test_pack_into_a_too_small_buffer_fails():
    buf = torch.zeros(512, dtype=torch.uint8)
    with pytest.raises(RuntimeError):
        pack(buf, 0, torch.zeros(200, dtype=torch.float32))


def test_packing_exports():
    assert set(_packing.__all__) == {
        "ALIGN", "aligned", "Bucket", "plan", "walk", "pack", "unpack", "Meta", "NamedTensors", "metadata", "metadata_of",
        "named_tensors", "nbytes", "fingerprint", "framing_problems", "sendable",
    }  # fmt: skip


def test_check_is_a_deprecated_name_of_verify_digests():
    sender = {"w": "ab" * 16}
    with pytest.warns(DeprecationWarning, match="verify_digests"):
        assert check("log", sender, dict(sender)).ok
