"""Refit over ``torch.distributed``: one trainer rank broadcasts buckets of weights to engine ranks.

The second transport next to the colocated IPC one, with the same verification
semantics. Every member of the process group (the caller initialises it, or
passes ``group``) takes part in every collective below, in this order; the
sender is the ``src`` rank, every other member is an engine (a receiver).
Ranks are global ranks throughout.

Prepare (once, :meth:`BroadcastSender.prepare` / :meth:`BroadcastReceiver.prepare`):

1. a monitored barrier (gloo only): a rank that never arrives is named;
2. ``broadcast_object_list`` from ``src``: ``{"algo": ...}``, the digest
   algorithm every receiver uses, so both sides' digests compare (or, from a
   trainer that could not build its sender, the abort notice: every side raises);
3. ``gather_object`` to ``src``: each engine's own metadata
   ``{name: (shape, dtype)}``. The receivers slice with it; the sender keeps
   it to name each parameter whose byte size differs on an engine (also when
   the difference hides inside the alignment padding and the walk adds up).

Stream (each :meth:`BroadcastSender.send` / :meth:`BroadcastReceiver.receive`):

1. a monitored barrier (gloo only). An engine whose metadata changed since its
   prepare (the sender would check it against the old one) loads nothing and
   reports that as an error: prepare again after changing it;
2. per bucket (planned by :func:`wcviz.refit._packing.plan` over
   ``buffer_bytes``, 512-aligned offsets, a parameter larger than half the
   buffer alone in its own bucket): a header
   ``{"kind": "bucket", "index", "names", "used"}`` by
   ``broadcast_object_list``, then ``used`` bytes by ``broadcast`` (skipped
   when ``used`` is 0). Each receiver walks ``names`` with its own metadata;
   a name it does not know, or a walked end other than ``used``, means the
   bucket is not loaded and the error is kept for the end (the receiver still
   takes part in every collective, so nothing deadlocks). Otherwise it slices
   views, applies its faults, digests them (when it verifies) and calls
   ``load_weights([(name, tensor), ...])``.
3. ``{"kind": "complete"}`` (or ``{"kind": "abort", "error"}`` when the sender
   refused its input or failed: then every side raises and nothing follows);
4. ``gather_object`` to ``src``: each engine's report ``{"errors": [...]}``,
   plus ``"digests": {name: hex}`` only when that engine verifies. With
   ``off`` everywhere no digest is computed and none is sent.

The sender then raises :class:`RefitProtocolError` naming rank and parameters
for any receiver error or size drift, and, when it verifies, for a receiver
that sent no digests; otherwise it compares each rank's digests with its own
(:func:`wcviz.refit.verify.compare`) and returns a :class:`BroadcastResult` with
one :class:`RefitResult` per engine rank. A rank where nothing was checked (it
declares no parameters, or a stated partial refit sent it none) is not ok.
``log`` warns once per bad parameter and rank; ``enforce`` raises
:class:`BroadcastDigestMismatch` (a :class:`RefitDigestMismatch`) naming every
bad rank and parameter.

Timeouts: every collective runs under the process group's timeout (set it with
``init_process_group(timeout=...)`` or ``new_group(timeout=...)``); on gloo a
dead peer fails the collective at once ("connection closed/reset by peer") or
when that timeout runs out, and either surfaces as :class:`RefitTimeout`
naming the step and the rank it failed on. The monitored barrier that opens
prepare and each stream names the ranks that did not arrive: group rank 0
(normally the trainer) waits ``timeout_s`` for them (default: the default
group's timeout), the others wait for its answer at most the group's timeout.
So a dead engine costs the trainer at most ``timeout_s`` before a stream and
the group's timeout within one, and a live engine at most the group's timeout.
NCCL has no monitored barrier; there the group timeout and NCCL's watchdog
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``) apply.

``rank_label`` (both ends) names a global rank in errors and warnings (default ``rank 2``).

Faults (:class:`wcviz.refit.faults.FaultPlan`, given to both sides; each must name a parameter sent):
``sender_after_digest`` alters what the sender packs after digesting it;
``wire`` alters the packed bucket (``drop_param`` and ``swap_params`` act as
the bucket is packed, ``drop_buffer`` skips a bucket the sender still counts
as sent); ``receiver_before_load`` alters the sliced views. A fault with
``ranks`` strikes only those engine ranks; that works for
``receiver_before_load`` and for ``wire`` (the named ranks corrupt the bucket
as it reaches them), not for ``sender_after_digest`` (one buffer goes to all).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from wcviz._errors import DigestError
from wcviz.digest import DEFAULT_ALGO, DigestAccumulator, logical_bytes
from wcviz.refit._checks import expected_per_rank, received_digests
from wcviz.refit._group import GroupMember, RankLabel, abort_before_prepare, group_ranks
from wcviz.refit._packing import ALIGN, Meta, NamedTensors, fingerprint, metadata_of, pack, plan, unpack, walk
from wcviz.refit._packing import metadata as declared_metadata
from wcviz.refit._packing import sendable
from wcviz.refit.config import DEFAULT_BUFFER_BYTES
from wcviz.refit.faults import FaultPlan, Swapper, check_broadcast, check_buffers, check_plan, strike
from wcviz.refit.verify import RefitDigestMismatch, RefitError, RefitProtocolError, RefitResult, RefitTimeout, compare, warn

__all__ = [
    "BroadcastDigestMismatch", "BroadcastDuplicateNames", "BroadcastReceiver", "BroadcastResult", "BroadcastSender",
    "Received", "abort_before_prepare", "backend_for", "metadata_of",
]  # fmt: skip

log = logging.getLogger("wcviz.refit")

LoadWeights = Callable[[list[tuple[str, torch.Tensor]]], Any]


# --- helpers both sides use ------------------------------------------------------------------------------------


def backend_for(device: torch.device | str) -> str:
    """The process-group backend for staging buffers on ``device``: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


# --- results ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BroadcastResult:
    """One broadcast refit: the sender's totals and a :class:`RefitResult` per engine, keyed by global rank."""

    mode: str
    params: int
    nbytes: int
    ranks: Mapping[int, RefitResult]

    def __getitem__(self, rank: int) -> RefitResult:
        return self.ranks[rank]

    @property
    def verified(self) -> bool:
        """Whether every engine's digests were compared."""
        return bool(self.ranks) and all(r.verified for r in self.ranks.values())

    @property
    def bad(self) -> dict[int, list[str]]:
        """``{rank: sorted names that did not arrive intact there}``, only ranks with any."""
        return {rank: r.bad for rank, r in self.ranks.items() if r.bad}

    @property
    def ok(self) -> bool:
        """True only when every engine was verified, had something checked and holds exactly what was sent."""
        return self.verified and all(r.ok for r in self.ranks.values())

    def describe(self) -> str:
        """One line per engine rank, joined."""
        if not self.ranks:
            return f"refit of {self.params} parameters to no engine rank: nothing verified"
        return "; ".join(f"rank {rank}: {r.describe()}" for rank, r in self.ranks.items())


class BroadcastDigestMismatch(RefitDigestMismatch):
    """``enforce`` on a broadcast: some engines do not hold what was sent.

    ``.broadcast`` is the whole :class:`BroadcastResult`, ``.ranks`` the bad
    ranks (a mismatch, or nothing checked), ``.result`` the first bad rank's :class:`RefitResult`.
    ``labels``: how the message names each global rank (default ``rank 2``).
    """

    def __init__(self, broadcast: BroadcastResult, labels: Mapping[int, str] | None = None) -> None:
        bad = {rank: r for rank, r in broadcast.ranks.items() if not r.ok}
        self.labels = dict(labels or {})
        RefitError.__init__(self, "; ".join(f"{self.labels.get(k, f'rank {k}')}: {r.describe()}" for k, r in bad.items()))
        self.broadcast = broadcast
        self.ranks = tuple(bad)
        self.result = next(iter(bad.values()))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.broadcast, self.labels))


class BroadcastDuplicateNames(RefitError, DigestError):
    """``send`` was given a parameter name twice (named): a :class:`RefitError`, and still a ``DigestError``."""


@dataclass(frozen=True)
class Received:
    """What one engine took in during a stream: buckets and parameters loaded, and its digests when it verifies."""

    rank: int
    buckets: int
    params: int
    nbytes: int
    digests: Mapping[str, str] | None = None


def _pairs(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    try:
        return sendable(named_tensors)
    except DigestError as e:  # what as_pairs raises for a name given twice (anything else is a TypeError)
        raise BroadcastDuplicateNames(str(e)) from e


def _received(rank: int, digests: Any, algo: str) -> Mapping[str, str]:
    """:func:`wcviz.refit._checks.received_digests` naming global ``rank`` as ``rank 2``."""
    return received_digests(f"rank {rank}", digests, algo)


# --- sender ----------------------------------------------------------------------------------------------------


class BroadcastSender(GroupMember):
    """The trainer's end: :meth:`prepare` once, then :meth:`send` the weights for every refit.

    ``verify``: off | log | enforce (or a config with ``.mode``). ``src``: this process's global rank (the
    broadcast root). ``buffer_bytes``: the staging buffer a bucket fills.
    ``timeout_s``: the monitored barrier's timeout (default: the default group's).
    """

    def __init__(
        self,
        *,
        verify: Any = "off",
        src: int = 0,
        group: dist.ProcessGroup | None = None,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        faults: FaultPlan | None = None,
        device: torch.device | str | None = None,
        algo: str = DEFAULT_ALGO,
        backend: str = "auto",
        timeout_s: float | timedelta | None = None,
        rank_label: RankLabel | None = None,
    ) -> None:
        super().__init__(verify=verify, src=src, group=group, faults=check_broadcast(faults), device=device,
                         backend=backend, timeout_s=timeout_s, rank_label=rank_label)  # fmt: skip
        if buffer_bytes < ALIGN:
            raise ValueError(f"buffer_bytes={buffer_bytes} is smaller than the {ALIGN}-byte alignment")
        self.buffer_bytes = int(buffer_bytes)
        self.algo = algo
        self.metadata: dict[int, dict[str, Meta]] | None = None
        self._mine = FaultPlan(tuple(f for f in self.faults.faults if not f.ranks))  # engines apply the ranked ones
        self._buf: torch.Tensor | None = None

    @property
    def receivers(self) -> list[int]:
        """The engines' global ranks: every member of the group but ``src``."""
        return [r for r in group_ranks(self.group) if r != self.src]

    def prepare(self) -> dict[int, dict[str, Meta]]:
        """Meet the engines: announce the digest algorithm, learn each engine's metadata (by global rank)."""
        if self.rank != self.src:
            raise ValueError(f"BroadcastSender runs on the src rank {self.src}, this is rank {self.rank}")
        self._barrier("prepare")
        self._broadcast_object("prepare: the sender's hello", {"algo": self.algo})
        gathered = self._gather("prepare: the engines' metadata", None)
        assert gathered is not None
        ranks = group_ranks(self.group)
        self.metadata = {ranks[i]: declared_metadata(m) for i, m in enumerate(gathered) if ranks[i] != self.src}
        return self.metadata

    def send(self, named_tensors: NamedTensors, *, partial: bool = False, expected: Iterable[str] | None = None) -> BroadcastResult:
        """Broadcast ``named_tensors`` to every engine and check what each one received (see the module docstring).

        Every parameter an engine declares must arrive there: one that was not sent
        (or was lost on the way to that rank) is ``missing`` on that rank. To update
        a subset on purpose: ``partial=True`` (exactly what is sent must arrive) or
        ``expected=[names]`` (exactly those, on every engine).

        Input it refuses (a name given twice, a non-tensor, a bad ``expected``) aborts the stream on every engine too.
        """
        if self.metadata is None:
            raise RefitProtocolError("BroadcastSender.send before prepare(): the engines' metadata is unknown")
        self._barrier("the stream")  # the engines wait here: the caller's input is checked after it, so they are told
        why = "the trainer refused its own input, nothing was sent: "
        try:
            items = _pairs(named_tensors)
            want = expected_per_rank(self.metadata, [name for name, _ in items], partial, expected)
            check_plan(self.faults, items, self.receivers)  # a fault that breaks nothing would pass as if it had been tried
            why = ""
            sent = {name: Meta.of(t) for name, t in items}
            nbytes = sum(m.nbytes for m in sent.values())
            digests = self._stream(items)
        except RefitTimeout:
            raise
        except Exception as e:  # tell the engines, so they raise too instead of waiting out the timeout
            self._broadcast_object("the abort notice", {"kind": "abort", "error": f"{why}{type(e).__name__}: {e}"})
            raise
        self._broadcast_object("the completion header", {"kind": "complete"})
        gathered = self._gather("the engines' reports", None)
        assert gathered is not None
        ranks = group_ranks(self.group)
        reports = {ranks[i]: rep for i, rep in enumerate(gathered) if ranks[i] != self.src}
        return self._finish(reports, sent, digests, nbytes, want)

    def _stream(self, items: list[tuple[str, torch.Tensor]]) -> Mapping[str, str]:
        """Digest, fault, pack and broadcast every bucket; the sender's digests (empty when off)."""
        faults = self._mine
        acc = DigestAccumulator(algo=self.algo, backend=self.backend) if self.verifying else None
        swap = Swapper(faults.at("sender_after_digest", kind="swap_params") + faults.at("wire", kind="swap_params"))
        outgoing: list[tuple[str, torch.Tensor]] = []

        def emit(passing: list[tuple[str, torch.Tensor]]) -> None:
            for n, u in passing:
                altered = (
                    None if faults.at("wire", n, kind="drop_param") else strike(faults, "sender_after_digest", n, u)
                )
                if altered is not None:
                    outgoing.append((n, altered))

        for name, t in items:
            if acc is not None:
                acc.add(name, t)  # what the sender means to send, before any fault
            emit(swap(name, t))
        emit(swap.flush())
        tensors = dict(outgoing)
        buckets = plan([(n, u.numel() * u.element_size()) for n, u in outgoing], self.buffer_bytes)
        check_buffers(self.faults, len(buckets))  # every rank's drops, before any bucket goes out: the engines get the abort notice
        for index, bucket in enumerate(buckets):
            buf = self._staging(bucket.used, bucket.own)
            for name, offset in zip(bucket.names, bucket.offsets):
                pack(buf, offset, tensors[name])
                if faults.at("wire", name):
                    self._strike_wire(buf, offset, name, tensors[name])
            if faults.drops_buffer(index):
                continue  # counted as sent, never broadcast
            header = {"kind": "bucket", "index": index, "names": list(bucket.names), "used": bucket.used}
            self._broadcast_object(f"bucket {index}'s header", header)
            self._broadcast_bytes(f"bucket {index}'s {bucket.used} bytes", buf)
        return acc.hex() if acc is not None else {}

    def _staging(self, used: int, own: bool) -> torch.Tensor:
        """The first ``used`` bytes of the reusable staging buffer, or a buffer of its own for a large parameter."""
        if own:
            return torch.empty(used, dtype=torch.uint8, device=self.device)
        if self._buf is None:
            self._buf = torch.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device)
        return self._buf[:used]

    def _strike_wire(self, buf: torch.Tensor, offset: int, name: str, t: torch.Tensor) -> None:
        """flip_bit, cast_dtype and shift_offset on the packed bytes of ``name``."""
        region = unpack(buf, offset, Meta.of(t))
        altered = strike(self._mine, "wire", name, region)
        if altered is not None and altered is not region:
            raw = logical_bytes(altered)
            buf[offset : offset + raw.numel()].copy_(raw)

    def _drift(self, rank: int, sent: Mapping[str, Meta]) -> list[str]:
        """Parameters whose byte size differs on ``rank`` (or that it does not know): what it cannot slice right."""
        theirs = (self.metadata or {}).get(rank, {})
        out = []
        for name, meta in sent.items():
            if name not in theirs:
                out.append(f"{name} is not in its metadata")
            elif theirs[name].nbytes != meta.nbytes:
                out.append(f"{name} is {theirs[name].describe()} there, {meta.describe()} sent")
        return out

    def _finish(
        self,
        reports: Mapping[int, Any],
        sent: Mapping[str, Meta],
        digests: Mapping[str, str],
        nbytes: int,
        want: Mapping[int, set[str]],
    ) -> BroadcastResult:
        """Protocol errors first, then each rank's digests against the sender's, as the mode says."""
        problems = {}
        for rank, report in reports.items():
            lines = (
                list(report.get("errors", ())) + self._drift(rank, sent) if isinstance(report, dict) else ["no report"]
            )
            if lines:
                problems[rank] = lines
        if problems:
            raise RefitProtocolError(
                "refit broadcast: " + "; ".join(f"{self.who(rank)}: {'; '.join(lines)}" for rank, lines in problems.items())
            )
        if self.mode == "off":
            return BroadcastResult(
                "off", len(sent), nbytes, {r: RefitResult("off", len(sent), nbytes, expected=len(want[r])) for r in reports}
            )
        silent = [rank for rank, report in reports.items() if report.get("digests") is None]
        if silent:
            raise RefitProtocolError(
                f"refit broadcast: verification is on but {', '.join(map(self.who, silent))} sent no digests "
                "(is verify off on that engine?)"
            )
        if not reports:
            raise RefitProtocolError("refit broadcast: the group has no engine rank: there is nothing to verify")
        result = BroadcastResult(
            self.mode,
            len(sent),
            nbytes,
            {
                rank: compare(
                    self.mode,
                    digests,
                    received_digests(self.who(rank), report["digests"], self.algo),
                    nbytes=nbytes,
                    expected=want[rank],
                    declared=len((self.metadata or {}).get(rank, {})),
                )
                for rank, report in reports.items()
            },
        )
        if not result.ok and self.mode == "enforce":
            raise BroadcastDigestMismatch(result, {rank: self.who(rank) for rank in result.ranks})
        for rank, r in result.ranks.items():
            warn(r, f"refit broadcast: {self.who(rank)}: ")
        return result


# --- receiver --------------------------------------------------------------------------------------------------


class BroadcastReceiver(GroupMember):
    """An engine's end: :meth:`prepare` once, then :meth:`receive` for every refit.

    ``metadata``: this engine's own ``{name: (shape, dtype)}`` (see
    :func:`metadata_of`); every bucket is sliced with it. ``load_weights`` is
    called once per bucket with ``[(name, tensor), ...]`` views that are only
    valid during the call (copy them). ``verify``: whether this engine digests
    what it loads and sends the digests back.
    """

    def __init__(
        self,
        metadata: Mapping[str, Meta],
        load_weights: LoadWeights,
        *,
        verify: Any = "off",
        src: int = 0,
        group: dist.ProcessGroup | None = None,
        faults: FaultPlan | None = None,
        device: torch.device | str | None = None,
        backend: str = "auto",
        timeout_s: float | timedelta | None = None,
        rank_label: RankLabel | None = None,
    ) -> None:
        super().__init__(verify=verify, src=src, group=group, faults=faults, device=device, backend=backend,
                         timeout_s=timeout_s, rank_label=rank_label)  # fmt: skip
        self.metadata = declared_metadata(metadata)
        self.load_weights = load_weights
        self.algo: str | None = None
        self._prepared: str | None = None  # fingerprint of the metadata the sender learnt at prepare

    def _faults_here(self) -> tuple[FaultPlan, set[int]]:
        """The faults that strike here, all as receiver_before_load, and the buckets dropped on the way here.

        A ``wire`` fault limited to ranks is applied by those ranks to the bytes they received.
        """
        rank = self.rank
        here = [f for f in self.faults.faults if not f.ranks or rank in f.ranks]
        local = [f for f in here if f.point == "receiver_before_load"]
        local += [
            replace(f, point="receiver_before_load")
            for f in here
            if f.point == "wire" and f.ranks and f.kind != "drop_buffer"
        ]
        dropped = {f.buffer for f in here if f.kind == "drop_buffer" and f.ranks and f.buffer is not None}
        return FaultPlan(tuple(local)), dropped

    def prepare(self) -> None:
        """Meet the sender: learn its digest algorithm, give it this engine's metadata."""
        if self.rank == self.src:
            raise ValueError(f"BroadcastReceiver runs on an engine rank, this is the src rank {self.src}")
        self._barrier("prepare")
        hello = self._broadcast_object("prepare: the sender's hello")
        if hello.get("kind") == "abort":  # the trainer could not build its sender
            raise RefitProtocolError(f"refit broadcast: the sender aborted the refit at prepare ({hello.get('error')})")
        self.algo = hello["algo"]
        declared = self._declared_now()
        self._prepared = fingerprint(declared) if declared is not None else None
        self._gather("prepare: the engines' metadata", declared if declared is not None else {})

    def _declared_now(self) -> dict[str, Meta] | None:
        """This engine's metadata now, in its exact form (``self.metadata`` may have been reassigned in any
        spelling), or None when it does not parse (reported, never raised mid-collective)."""
        try:
            return declared_metadata(self.metadata)
        except Exception:  # noqa: BLE001
            return None

    def receive(self) -> Received:
        """Take one stream in, load it bucket by bucket, report back; raises RefitProtocolError on any error here."""
        if self.algo is None:
            raise RefitProtocolError("BroadcastReceiver.receive before prepare(): the sender's algorithm is unknown")
        self._barrier("the stream")
        faults, dropped = self._faults_here()
        swap = Swapper(faults.at("receiver_before_load", kind="swap_params"))
        acc = DigestAccumulator(algo=self.algo, backend=self.backend) if self.verifying else None
        errors: list[str] = []
        declared = self._declared_now() or {}
        stale = self._prepared is None or fingerprint(declared) != self._prepared
        if stale:  # the sender would check this engine against what it declared at prepare: load nothing
            errors.append("this engine's metadata changed since prepare() (or does not parse): nothing loaded; call prepare() again")
        buckets = params = nbytes = 0
        while True:
            header = self._broadcast_object("waiting for a bucket header")
            kind = header.get("kind")
            if kind == "abort":
                raise RefitProtocolError(f"refit broadcast: the sender aborted the stream ({header.get('error')})")
            if kind == "complete":
                break
            if kind != "bucket":
                raise RefitProtocolError(f"refit broadcast: unexpected header from the sender: {header!r:.200}")
            index, names, used = header["index"], header["names"], header["used"]
            buf = torch.empty(used, dtype=torch.uint8, device=self.device)
            self._broadcast_bytes(f"bucket {index}'s {used} bytes", buf)
            if index in dropped or stale:
                continue  # lost on the way to this rank, or not to be loaded against stale metadata
            try:
                batch = self._slice(index, names, used, buf, faults, swap, acc, declared)
                if batch:
                    self.load_weights(batch)
            except Exception as e:  # noqa: BLE001 -- kept for the end: raising now would strand the others
                errors.append(f"bucket {index} ({', '.join(names)}) not loaded: {e}")
                continue
            buckets += 1
            params += len(batch)
            nbytes += sum(t.numel() * t.element_size() for _, t in batch)
        try:
            rest = self._faulted(swap.flush(), faults, acc)
            if rest:
                self.load_weights(rest)
                params += len(rest)
        except Exception as e:  # noqa: BLE001 -- as above: reported at the end, not raised mid-collective
            errors.append(f"swapped parameters not loaded: {e}")
        now = self._declared_now()
        if not stale and (now is None or fingerprint(now) != self._prepared):  # changed while the stream was loaded
            errors.append("this engine's metadata changed during the refit: what it loaded was sliced by the old metadata")
        report: dict[str, Any] = {"errors": errors}
        digests = acc.hex() if acc is not None else None
        if digests is not None:
            report["digests"] = digests
        self._gather("sending the report", report)
        if errors:
            raise RefitProtocolError(f"refit broadcast: {self.who(self.rank)}: " + "; ".join(errors))
        return Received(self.rank, buckets, params, nbytes, digests)

    def _slice(
        self,
        index: int,
        names: Sequence[str],
        used: int,
        buf: torch.Tensor,
        faults: FaultPlan,
        swap: Swapper,
        acc: DigestAccumulator | None,
        declared: dict[str, Meta],
    ) -> list[tuple[str, torch.Tensor]]:
        """The bucket's views by this engine's metadata (as of the stream's start), after its faults; raises if the
        layout does not add up."""
        try:
            layout, end = walk(names, declared)
        except KeyError as e:
            raise RefitProtocolError(f"{e.args[0]!r} is not in this engine's metadata") from None
        if end != used:
            raise RefitProtocolError(
                f"this engine's metadata puts the bucket's end at {end} bytes, the sender used {used}"
            )
        views: list[tuple[str, torch.Tensor]] = []
        for name, offset, meta in layout:
            views += swap(name, unpack(buf, offset, meta))
        return self._faulted(views, faults, acc)

    def _faulted(
        self, views: list[tuple[str, torch.Tensor]], faults: FaultPlan, acc: DigestAccumulator | None
    ) -> list[tuple[str, torch.Tensor]]:
        """Per-parameter faults, then the digest of exactly what is loaded."""
        out = []
        for name, t in views:
            altered = strike(faults, "receiver_before_load", name, t)
            if altered is None:
                continue
            if acc is not None:
                acc.add(name, altered)
            out.append((name, altered))
        return out
