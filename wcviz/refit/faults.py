"""A small, explicit fault plan: what to break, where in the stream, for tests and demos.

A :class:`FaultPlan` is plain, picklable data that both ends of a transport
receive; each end applies the faults of the points it owns:

- ``sender_after_digest``: the sender has digested the parameter, then what it
  packs is altered (so its digest describes the intended value);
- ``wire``: the staging buffer or the control message is altered in flight;
- ``receiver_before_load``: the receiver alters what it sliced before it
  digests and loads it.

Kinds: ``flip_bit`` (one bit of one parameter), ``drop_param`` (a parameter
never arrives / is never loaded), ``drop_buffer`` (a whole buffer message is
never delivered: ``buffer`` is its 0-based index in the stream), ``shift_offset``
(the bytes of one parameter arrive ``shift`` bytes late), ``cast_dtype`` (a
parameter is cast to ``dtype`` on that path, same byte size), ``swap_params``
(two same-size parameters' bytes trade places).

``ranks`` limits a fault to some receivers where a transport has several (the
broadcast); empty, the default, strikes every receiver. Every fault must break
something, or the refit would pass as if it had been tried: :func:`check_plan`
refuses, at each send and before anything is sent, a fault naming a parameter
that is not sent or a rank that does not receive, and faults that leave the
bytes as they were (a cast to the parameter's own dtype, a swap of identical
bytes, two flips of one bit, a shift of zeros); :func:`check_buffers` a
``drop_buffer`` past the stream's last buffer.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:
    import torch

__all__ = [
    "POINTS", "KINDS", "Fault", "FaultPlan", "Swapper", "as_like", "check_broadcast", "check_buffers", "check_names", "check_one_receiver", "check_plan",
    "pack_shifted", "shifted", "strike", "swap_named",
]  # fmt: skip

POINTS = ("sender_after_digest", "wire", "receiver_before_load")
KINDS = ("flip_bit", "drop_param", "drop_buffer", "shift_offset", "cast_dtype", "swap_params")


@dataclass(frozen=True)
class Fault:
    """One fault: a kind, the point where it strikes, and what it strikes."""

    kind: str
    point: str
    params: tuple[str, ...] = ()
    buffer: int | None = None
    bit: int = 0
    shift: int = 8
    dtype: str | None = None
    ranks: tuple[int, ...] = ()  # the receiver ranks it strikes, where a transport has several; empty: all

    def __post_init__(self) -> None:
        if isinstance(self.ranks, (int, str)):
            raise ValueError(f"fault {self.kind} ranks must be a tuple of ranks, got {self.ranks!r}")
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if isinstance(self.params, str):  # "w" would pass the count check and then match by substring
            raise ValueError(f"fault {self.kind} params must be a tuple of names, got the string {self.params!r}")
        object.__setattr__(self, "params", tuple(self.params))
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.point not in POINTS:
            raise ValueError(f"unknown fault point {self.point!r}; choose one of {', '.join(POINTS)}")
        need = {"swap_params": 2, "drop_buffer": 0}.get(self.kind, 1)
        if len(self.params) != need:
            raise ValueError(f"fault {self.kind} needs {need} parameter name(s), got {list(self.params)}")
        if self.kind == "drop_buffer" and (self.buffer is None or self.point != "wire"):
            raise ValueError("fault drop_buffer needs buffer=<index> and point='wire'")
        if self.kind == "drop_buffer" and not (_is_int(self.buffer) and self.buffer >= 0):  # -1 would drop nothing
            raise ValueError(f"fault drop_buffer needs a buffer index >= 0, got {self.buffer!r}")
        if self.kind == "flip_bit" and not (_is_int(self.bit) and self.bit >= 0):
            raise ValueError(f"fault flip_bit needs a bit index >= 0, got {self.bit!r}")
        if self.kind == "shift_offset" and not (_is_int(self.shift) and self.shift > 0):
            # 0 moves nothing; a negative shift would write into the parameter before it and blame the wrong name
            raise ValueError(f"fault shift_offset needs shift > 0 bytes, got {self.shift!r}")
        if self.kind == "swap_params" and self.params[0] == self.params[1]:
            raise ValueError(f"fault swap_params needs two different parameters, got {self.params[0]!r} twice")
        if self.kind == "cast_dtype" and not self.dtype:
            raise ValueError("fault cast_dtype needs dtype=<name>, e.g. 'float16'")


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class FaultPlan:
    """The faults of one run. Empty by default: a plan that breaks nothing."""

    faults: tuple[Fault, ...] = field(default_factory=tuple)

    def at(self, point: str, name: str | None = None, kind: str | None = None) -> list[Fault]:
        """The faults that strike at ``point`` (on parameter ``name``, of ``kind``, if given)."""
        return [
            f
            for f in self.faults
            if f.point == point and (name is None or name in f.params) and (kind is None or f.kind == kind)
        ]

    def drops_buffer(self, index: int) -> bool:
        """Whether buffer message ``index`` is lost on the wire."""
        return any(f.kind == "drop_buffer" and f.buffer == index for f in self.faults)

    def alter(self, point: str, name: str, t: torch.Tensor) -> torch.Tensor | None:
        """``t`` as the faults at ``point`` leave it: a changed copy, ``t`` itself, or None if dropped.

        Handles the per-parameter kinds (flip_bit, drop_param, cast_dtype);
        swap_params and shift_offset move bytes between parameters and are
        applied by the transport, which holds the buffer.
        """
        import torch

        out = t
        for f in self.at(point, name):
            if f.kind == "drop_param":
                return None
            if f.kind == "flip_bit":
                if out.numel() == 0:
                    raise ValueError(f"fault flip_bit on {name!r}: the tensor is empty, it has no bit to flip")
                # contiguous: reshape(-1) of a strided (e.g. transposed) clone would copy and the flip would be lost
                out = out.detach().clone(memory_format=torch.contiguous_format)
                flat = out.reshape(-1).view(torch.uint8)
                flat[(f.bit // 8) % flat.numel()] ^= 1 << (f.bit % 8)
            elif f.kind == "cast_dtype":
                from wcviz.digest import parse_dtype

                target = parse_dtype(f.dtype or "")
                if target.itemsize != out.element_size():
                    raise ValueError(f"fault cast_dtype on {name!r}: {out.dtype} -> {target} changes the byte size")
                out = out.detach().to(target)
        return out


def check_broadcast(plan: FaultPlan | None) -> FaultPlan:
    """``plan`` (None: an empty one) if the broadcast can apply every fault of it, else a ValueError naming the fault.

    The sender packs one buffer for every engine, so a ``sender_after_digest`` fault
    cannot be limited to ``ranks``. Checked where the plan is given: by the sender,
    and by whoever hands it on (the simulated cluster, before any rank is told).
    """
    if plan is None:
        return FaultPlan()
    if not isinstance(plan, FaultPlan):
        raise TypeError(f"faults must be a wcviz.refit.FaultPlan, got {type(plan).__name__}")
    ranked = [f for f in plan.faults if f.ranks and f.point == "sender_after_digest"]
    if ranked:
        raise ValueError(
            f"fault {ranked[0].kind} at sender_after_digest cannot be limited to ranks {list(ranked[0].ranks)}: "
            "the sender packs one buffer for every engine; use point 'wire' or 'receiver_before_load'"
        )
    return plan


def check_one_receiver(plan: FaultPlan | None) -> FaultPlan:
    """``plan`` (None: an empty one) for a transport with one receiver (IPC), where ``ranks`` cannot choose whom a
    fault strikes: a fault limited to ranks is a ValueError, not a fault applied to whoever receives."""
    if plan is None:
        return FaultPlan()
    if not isinstance(plan, FaultPlan):
        raise TypeError(f"faults must be a wcviz.refit.FaultPlan, got {type(plan).__name__}")
    for f in plan.faults:
        if f.ranks:
            raise ValueError(
                f"fault {f.kind} at {f.point} names ranks {list(f.ranks)}, but this transport has one receiver: "
                "leave ranks empty"
            )
    return plan


def check_names(plan: FaultPlan, sent: Iterable[str]) -> None:
    """A ValueError naming the first parameter a fault of ``plan`` names that is not in ``sent``, with the nearest
    names sent: a fault on a parameter that never passes would be a silent no-op (a typo, a passing refit)."""
    names = list(sent)
    known = set(names)
    for f in plan.faults:
        for p in f.params:
            if p not in known:
                near = difflib.get_close_matches(p, names, n=3, cutoff=0.6)
                hint = f" (nearest: {', '.join(near)})" if near else ""
                raise ValueError(f"fault {f.kind} at {f.point} names {p!r}, which is not among the {len(names)} parameters sent{hint}")


def check_buffers(plan: FaultPlan, count: int) -> None:
    """A ValueError naming a ``drop_buffer`` fault whose buffer index is not among the ``count`` buffers of this send:
    it would drop nothing (a passing refit), as a fault on a name never sent would."""
    for f in plan.faults:
        if f.kind == "drop_buffer" and f.buffer is not None and not 0 <= f.buffer < count:
            raise ValueError(f"fault drop_buffer names buffer {f.buffer}, but this send packs {count} buffer(s) (0..{count - 1}): it would drop nothing")


def check_plan(plan: FaultPlan, tensors: Sequence[tuple[str, torch.Tensor]], receivers: Iterable[int] | None = None) -> None:
    """A ValueError, before anything is sent, naming a fault of ``plan`` that would break nothing in a send of ``tensors``.

    ``receivers``: the ranks that receive (the broadcast's engines), whom ``ranks`` may
    name; None for a transport with one receiver, where ``ranks`` cannot choose. A
    fault that breaks nothing leaves the refit passing as if it had been tried: a
    name that is not sent, a rank that does not receive, a flip in an empty
    parameter, a cast to the parameter's own dtype or to another byte size, a swap of
    parameters whose bytes are the same, and faults that together leave a parameter's
    bytes as they were on some receiver (two flips of one bit; a cast or a shift of
    zeros). The tensors are read only for the parameters the faults name.
    """
    check_names(plan, (n for n, _ in tensors))
    tensor = dict(tensors)
    ranks = None if receivers is None else sorted(set(receivers))
    if ranks is None:
        check_one_receiver(plan)
    for f in plan.faults:
        if ranks is not None and (stray := [r for r in f.ranks if r not in ranks]):
            raise ValueError(
                f"fault {f.kind} at {f.point} names rank(s) {stray}, which receive nothing; the receivers are {ranks}"
            )
        if f.kind == "swap_params":
            a, b = (tensor[p] for p in f.params)
            ra, rb = _bytes(a), _bytes(b)
            if ra.numel() != rb.numel():
                raise ValueError(f"fault swap_params: {f.params[0]!r} ({ra.numel()} bytes) and {f.params[1]!r} ({rb.numel()} bytes) differ in size")
            if _same_bytes(ra, rb):
                raise ValueError(
                    f"fault swap_params at {f.point}: {f.params[0]!r} and {f.params[1]!r} hold the same bytes, "
                    "so swapping them changes nothing"
                )
    for group in _strike_groups(plan, ranks):
        for name in dict.fromkeys(p for f in group for p in f.params if f.kind in _PER_PARAM):
            _check_changes(FaultPlan(group), name, tensor[name])


_PER_PARAM = ("flip_bit", "cast_dtype", "shift_offset")


def _strike_groups(plan: FaultPlan, ranks: list[int] | None) -> list[tuple[Fault, ...]]:
    """The distinct sets of faults that strike one receiver: every fault where there is one receiver, else per rank."""
    if ranks is None:
        return [plan.faults]
    groups = {tuple(f for f in plan.faults if not f.ranks or r in f.ranks) for r in ranks}
    return [g for g in groups if g]


def _check_changes(group: FaultPlan, name: str, t: torch.Tensor) -> None:
    """A ValueError if the per-parameter faults of ``group`` on ``name``, applied in stream order, leave its bytes as they were."""
    faults = [f for f in group.faults if name in f.params and f.kind in _PER_PARAM]
    if any(f.kind == "drop_param" for f in group.faults if name in f.params):
        return  # it never arrives: that is a change
    described = ", ".join(f"{f.kind} at {f.point}" for f in faults)
    out: torch.Tensor | None = t
    for f in faults:
        if f.kind == "flip_bit" and t.numel() == 0:
            raise ValueError(f"fault flip_bit at {f.point} on {name!r}: the parameter is empty, it has no bit to flip")
        if f.kind == "cast_dtype":
            from wcviz.digest import parse_dtype

            target = parse_dtype(f.dtype or "")
            if target == t.dtype:
                raise ValueError(f"fault cast_dtype at {f.point} on {name!r}: it is {t.dtype} already, the cast changes nothing")
            if target.itemsize != t.element_size():
                raise ValueError(f"fault cast_dtype at {f.point} on {name!r}: {t.dtype} -> {target} changes the byte size")
    for point in POINTS:
        if out is not None:
            out = strike(group, point, name, out)
    if out is not None and _same_bytes(_bytes(out), _bytes(t)):
        raise ValueError(
            f"faults on {name!r} ({described}) leave its bytes as they were, so they would test nothing "
            "(two flips of one bit cancel; a cast or a shift of zeros reads the same)"
        )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    from wcviz.digest import logical_bytes

    return logical_bytes(t)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two byte tensors are equal (moved to ``a``'s device first)."""
    import torch

    return a.numel() == b.numel() and bool(torch.equal(a, b.to(a.device)))


def as_like(src: torch.Tensor, like: torch.Tensor, what: str = "") -> torch.Tensor:
    """``src``'s bytes read as ``like``'s dtype and shape: how swapped parameters arrive."""
    from wcviz.digest import logical_bytes

    raw = logical_bytes(src)
    need = like.numel() * like.element_size()
    if raw.numel() != need:
        raise ValueError(f"fault swap_params{' on ' + what if what else ''}: {raw.numel()} and {need} bytes differ")
    if need == 0:
        return like.new_empty(like.shape)
    return raw.view(like.dtype).reshape(like.shape)


def shifted(t: torch.Tensor, shift: int) -> torch.Tensor:
    """``t`` as it reads when its bytes arrive ``shift`` bytes late (zeros first, its tail lost)."""
    import torch

    from wcviz.digest import logical_bytes

    raw = logical_bytes(t)
    out = torch.zeros_like(raw)
    if shift < raw.numel():
        out[shift:] = raw[: raw.numel() - shift]
    return as_like(out, t)


def pack_shifted(buf: torch.Tensor, offset: int, t: torch.Tensor, shift: int) -> None:
    """Pack ``t`` ``shift`` bytes late, clipped to the end of its aligned slot (the fault shift_offset)."""
    from wcviz.digest import logical_bytes
    from wcviz.refit._packing import aligned

    raw = logical_bytes(t)
    start = offset + shift
    end = aligned(offset + raw.numel())
    buf[offset : min(start, end)].zero_()  # zeros first, as :func:`shifted` reads: never what a kept buffer held before
    n = max(0, min(raw.numel(), end - start))
    buf[start : start + n].copy_(raw[:n], non_blocking=True)


def swap_named(named: list[tuple[str, torch.Tensor]], a: str, b: str) -> None:
    """Trade the tensors of ``a`` and ``b`` in place (the fault swap_params); a no-op if either is absent."""
    where = {n: i for i, (n, _) in enumerate(named)}
    if a not in where or b not in where:
        return
    from wcviz.refit._packing import nbytes

    i, j = where[a], where[b]
    ta, tb = named[i][1], named[j][1]
    if nbytes(ta) != nbytes(tb):
        raise ValueError(f"fault swap_params: {a} ({nbytes(ta)} bytes) and {b} ({nbytes(tb)} bytes) differ in size")
    named[i], named[j] = (a, tb), (b, ta)


def strike(faults: FaultPlan, point: str, name: str, t: torch.Tensor) -> torch.Tensor | None:
    """``t`` after the per-parameter faults at ``point``: flip_bit, cast_dtype, drop_param, then shift_offset."""
    out = faults.alter(point, name, t)
    if out is None:
        return None
    shift = sum(f.shift for f in faults.at(point, name, kind="shift_offset"))
    return shifted(out, shift) if shift else out


class Swapper:
    """swap_params on a stream: the first of a pair waits (as a copy) until its partner passes by."""

    def __init__(self, faults: Iterable[Fault]) -> None:
        self.partner: dict[str, str] = {}
        for f in faults:
            a, b = f.params
            self.partner[a], self.partner[b] = b, a
        self.held: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        other = self.partner.get(name)
        if other is None:
            return [(name, t)]
        if other not in self.held:
            self.held[name] = t.clone()
            return []
        theirs = self.held.pop(other)
        what = f"{other!r} and {name!r}"
        return [(other, as_like(t, theirs, what)), (name, as_like(theirs, t, what))]

    def flush(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters whose partner never came, unswapped."""
        out, self.held = list(self.held.items()), {}
        return out
