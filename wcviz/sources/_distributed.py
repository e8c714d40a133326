"""A source inside the job: gather every rank's digest table to one rank over ``torch.distributed``.

No HTTP and no agent: every member of a process group calls :func:`gather_frame`
(or :func:`from_distributed`, which digests the rank's tensors first) and the
``dst`` rank gets one table of them all. The caller initialises the process
group, or passes ``group``; ``dst`` is a global rank, as in ``torch.distributed``.

What every member does, in this order (each member takes part in every step, so
no rank is left waiting on one that gave up early):

1. checks and pickles its own frame locally. A frame that is not a digest
   table (:func:`wcviz.frame.validate` fails), or tensors that cannot be
   digested (:func:`from_distributed`), do not raise here: the member sends a
   marker with the error instead of a frame;
2. a monitored barrier (gloo only), which names the ranks that never arrive:
   group rank 0 waits ``timeout_s`` for them (default: the group's own
   timeout), the others wait for its answer at most the group's timeout;
3. ``gather_object`` to ``dst``: every member's frame or marker;
4. ``broadcast_object_list`` from ``dst``: the verdict. ``dst`` checks what
   came in (any marker, a frame that does not unpickle, the same row on two
   ranks) and tells every member, so every member raises the same error, naming
   the rank at fault, or returns: the table on ``dst``, ``None`` elsewhere.

The table on ``dst``:

* rows keep their own identity columns: a rank's frame says who it is (its
  rank within its role's world, its dp/pp/tp/ep coordinates), and that need not
  be its global rank in this group. Only where ``rank`` is NA does the member
  fill in its global rank (``dist.get_rank()``), so no gathered row is
  anonymous;
* ordered by ``role`` and rank identity (``rank, dp, pp, tp, ep``, NA last),
  each rank's rows in their own order; never by the order of the gather;
* schema-valid (:func:`wcviz.frame.validate`); extra columns ride along;
* each (role, rank, dp, pp, tp, ep, name, phase) appears once. The same key on
  two ranks (two members claiming one identity) or twice on one rank is a
  :class:`~wcviz.TableError` naming the global ranks that sent it. ``role`` is
  part of the key because ``rank`` counts within a role's world: trainer rank 0
  and engine rank 0 may share one process group;
* within a role, each rank number has one set of coordinates: rank 0 at pp 0 and
  rank 0 at pp 1 (a TP x PP job numbering its processes by TP rank) is a
  :class:`~wcviz.TableError` naming the global ranks that sent them, by the rule
  that :func:`wcviz.compare` and the end-state check apply
  (:func:`wcviz.frame.check_identities`).

Errors, raised on every member alike: :class:`~wcviz.TableError` for a bad frame
or a duplicate key, :class:`~wcviz.DigestError` when a member's tensors cannot
be digested, and :class:`GatherError` (a ``RuntimeError``) when a collective
fails (a dead peer, a timeout: the step, this rank and the backend's message)
or there is no process group. Every collective runs under the group's timeout
(``init_process_group(timeout=...)`` / ``new_group(timeout=...)``); on gloo a
peer that died usually fails the collective at once ("connection closed by
peer"), else when that timeout runs out. NCCL has no monitored barrier; there
the group's timeout and NCCL's watchdog apply, and the pickled frames travel
through the current CUDA device (call ``torch.cuda.set_device`` first, as
``gather_object`` asks).
"""

from __future__ import annotations

import pickle
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import pandas as pd

from wcviz._errors import AlgorithmMismatch, CheckpointError, DigestError, GatherError, TableError, WcvizError, check_deadline
from wcviz.digest import DEFAULT_ALGO
from wcviz.frame import IDENTITY, empty_frame, identity_clash, validate
from wcviz.sources._tensors import from_named_tensors

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = ["from_distributed", "gather_frame"]

_T = TypeVar("_T")
_ORDER = ("role",) + IDENTITY  # who a row belongs to; rank counts within the role's world
_KEY = _ORDER + ("name", "phase")  # one row each
_SRC = "__wcviz_src_rank__"  # the member that sent a row, while the frames are combined
# the wcviz errors a member's failure is raised as on every rank; anything else is a GatherError
_KINDS: dict[str, type[WcvizError]] = {
    c.__name__: c for c in (TableError, DigestError, AlgorithmMismatch, CheckpointError, GatherError)
}
_SHOWN = 3  # duplicate keys named in a message


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise GatherError(
            "gather_frame needs an initialised torch.distributed process group (call init_process_group first)"
        )
    return dist


def _group_ranks(dist: Any, group: ProcessGroup | None) -> list[int]:
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _timedelta(timeout_s: float | timedelta | None) -> timedelta | None:
    if timeout_s is None or isinstance(timeout_s, timedelta):
        return timeout_s
    return timedelta(seconds=check_deadline(timeout_s)[0])


def _group_timeout(dist: Any, group: ProcessGroup | None) -> timedelta | None:
    """The gloo group's own collective timeout, if it can be read (else None: torch's default)."""
    import torch

    try:
        pg = group if group is not None else dist.group.WORLD
        timeout = pg._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None
    return timeout if isinstance(timeout, timedelta) else None


class _Member:
    """One member's view of a gather: its rank, the group, the collectives wrapped into GatherError."""

    def __init__(self, group: ProcessGroup | None, dst: int, timeout_s: float | timedelta | None) -> None:
        self.dist = _dist()
        self.group = group
        self.rank = int(self.dist.get_rank())
        self.ranks = _group_ranks(self.dist, group)
        self.dst = int(dst)
        self.timeout = _timedelta(timeout_s)
        if self.rank not in self.ranks:
            raise ValueError(f"gather_frame: rank {self.rank} is not a member of the group (ranks {self.ranks})")
        if self.dst not in self.ranks:
            raise ValueError(
                f"gather_frame: dst={self.dst} is not a member of the group (global ranks {self.ranks}); "
                "dst is a global rank"
            )

    def collective(self, step: str, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run one collective; a backend failure (timeout, a peer's closed connection) becomes GatherError."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:  # gloo and NCCL raise RuntimeError (DistBackendError) subclasses
            raise GatherError(
                f"gather_frame: {step} failed on rank {self.rank}: a peer is dead or did not answer in time ({e})"
            ) from e

    def exchange(self, payload: dict[str, Any]) -> pd.DataFrame | None:
        """Steps 2 to 4 of the module docstring; the combined frame on dst, None elsewhere."""
        dist = self.dist
        if dist.get_backend(self.group) == "gloo":
            timeout = self.timeout if self.timeout is not None else _group_timeout(dist, self.group)
            self.collective(
                "the barrier before the gather",
                dist.monitored_barrier,
                group=self.group,
                timeout=timeout,
                wait_all_ranks=True,
            )
        wire = {k: v for k, v in payload.items() if k != "exception"}  # a marker's exception stays here
        here = self.rank == self.dst
        gathered: list[Any] | None = [None] * len(self.ranks) if here else None
        self.collective("gathering the frames", dist.gather_object, wire, gathered, dst=self.dst, group=self.group)
        result: pd.DataFrame | None = None
        failure: BaseException | None = None
        verdict: dict[str, Any] = {"ok": True}
        if here:
            assert gathered is not None
            try:
                result = _combine(gathered, self.ranks)
            except WcvizError as e:  # a member's marker, a bad frame, a duplicate key: raised on every member
                verdict = {"kind": type(e).__name__, "error": str(e)}
            except Exception as e:  # noqa: BLE001 -- every member must hear of it, not only dst
                failure = e
                verdict = {
                    "kind": "GatherError",
                    "error": f"gather_frame: rank {self.rank} could not combine the frames: {type(e).__name__}: {e}",
                }
        box = [verdict]
        self.collective("the verdict from dst", dist.broadcast_object_list, box, src=self.dst, group=self.group)
        verdict = box[0] if isinstance(box[0], dict) else {"kind": "GatherError", "error": f"bad verdict {box[0]!r}"}
        if not verdict.get("ok"):
            cls = _KINDS.get(str(verdict.get("kind")), GatherError)
            raise cls(str(verdict.get("error"))) from (failure or payload.get("exception"))
        return result if here else None


def _marker(rank: int, message: str, error: BaseException) -> dict[str, Any]:
    """What a member sends instead of a frame it cannot give; ``exception`` never leaves the process."""
    return {"rank": rank, "kind": type(error).__name__, "error": message, "exception": error}


def _payload(frame: Any, rank: int, allow_empty: bool = False) -> dict[str, Any]:
    """This member's frame, validated, ``rank`` filled where NA and pickled; or a marker saying why not
    (an empty frame too, unless ``allow_empty``: a rank holding nothing is no pass)."""
    try:
        checked = validate(frame, source=f"rank {rank}'s frame")
        if not len(checked) and not allow_empty:
            message = (
                f"rank {rank} holds no parameters (an empty table): weights released or offloaded, or a mis-wired "
                "holder; pass allow_empty=True where that is expected"
            )
            return _marker(rank, message, GatherError(message))
        checked["rank"] = checked["rank"].fillna(rank)
        return {"rank": rank, "frame": pickle.dumps(checked, protocol=pickle.HIGHEST_PROTOCOL)}
    except TableError as e:
        return _marker(rank, str(e), e)
    except Exception as e:  # noqa: BLE001 -- an unpicklable extra column, say: reported on every rank
        return _marker(rank, f"rank {rank}'s frame cannot be sent: {type(e).__name__}: {e}", e)


def _describe(key: Sequence[Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in zip(_KEY, key) if not pd.isna(v))


def _combine(gathered: Sequence[Any], ranks: Sequence[int]) -> pd.DataFrame:
    """dst's half: the members' payloads (in group order) as one table, or the error every member raises."""
    problems: list[tuple[str, str]] = []  # (kind, message), in group order
    frames: list[pd.DataFrame] = []
    for src, item in zip(ranks, gathered):
        if not isinstance(item, dict) or ("frame" not in item and "error" not in item):
            problems.append(("GatherError", f"rank {src} sent {type(item).__name__}, not a frame"))
            continue
        if "error" in item:
            problems.append((str(item.get("kind")), str(item["error"])))
            continue
        try:
            frame = pickle.loads(item["frame"])
        except Exception as e:  # noqa: BLE001 -- a class this process lacks, say
            problems.append(("GatherError", f"rank {src}'s frame does not unpickle on dst: {type(e).__name__}: {e}"))
            continue
        frames.append(frame.assign(**{_SRC: src}))
    if problems:
        kind = problems[0][0] if problems[0][0] in _KINDS else "GatherError"
        raise _KINDS[kind]("gather_frame: " + "; ".join(message for _, message in problems))
    non_empty = [f for f in frames if len(f)]
    if not non_empty:
        return empty_frame()
    combined = pd.concat(non_empty, ignore_index=True)
    _check_one_sender(combined)
    _check_unique(combined)
    _check_identities(combined)
    combined = combined.sort_values([*_ORDER, _SRC], kind="stable", na_position="last")
    return validate(combined.drop(columns=[_SRC]).reset_index(drop=True), source="gathered frames")


def _check_one_sender(frame: pd.DataFrame) -> None:
    """A TableError naming every rank identity that two members sent rows for: two processes claiming one
    rank (a TP x PP job that left out ``pp``, say) would otherwise fold into one rank holding both halves."""
    ident = [k for k in _KEY if k not in ("name", "phase")]
    senders = frame.groupby(ident, dropna=False, sort=False)[_SRC].unique()
    clashes = [(key, sorted(int(s) for s in srcs)) for key, srcs in senders.items() if len(srcs) > 1]
    if not clashes:
        return
    lines = [f"ranks {', '.join(map(str, m[:-1]))} and {m[-1]} {'both' if len(m) == 2 else 'all'} claim ({_describe(key)})" for key, m in clashes]
    more = f"; and {len(lines) - _SHOWN} more" if len(lines) > _SHOWN else ""
    raise TableError(
        "gather_frame: two members claim one rank identity (give each process its own rank and coordinates): "
        + "; ".join(lines[:_SHOWN])
        + more
    )


def _check_unique(frame: pd.DataFrame) -> None:
    """A TableError naming the member ranks behind every (role, identity, name, phase) that is not unique."""
    dup = frame.duplicated(list(_KEY), keep=False)
    if not bool(dup.any()):
        return
    lines = []
    clashes = frame.loc[dup].groupby(list(_KEY), dropna=False, sort=False)[_SRC]
    for key, srcs in clashes:
        members = sorted({int(s) for s in srcs})
        if len(members) == 1:
            lines.append(f"rank {members[0]} sent {len(srcs)} rows for ({_describe(key)})")
        else:
            who = ", ".join(map(str, members[:-1])) + f" and {members[-1]}"
            lines.append(f"ranks {who} both sent rows for ({_describe(key)})")
    more = f"; and {len(lines) - _SHOWN} more" if len(lines) > _SHOWN else ""
    raise TableError(
        "gather_frame: rows are not unique per (role, rank, dp, pp, tp, ep, name, phase): "
        + "; ".join(lines[:_SHOWN])
        + more
    )


def _check_identities(frame: pd.DataFrame) -> None:
    """A TableError where, within a role, one rank number comes with two identities
    (:func:`wcviz.frame.identity_clash`, the rule compare and the end-state check apply),
    naming the global ranks that sent the rows."""

    def senders(labels: Sequence[Any]) -> str:
        members = sorted({int(frame.at[i, _SRC]) for i in labels})
        return f"the rows of global rank{'s' if len(members) > 1 else ''} " + " and ".join(map(str, members))

    for role, rows in frame.groupby("role", dropna=False, sort=False):
        why = identity_clash(rows, senders)
        if why is not None:
            whose = "the rows without a role" if pd.isna(role) else f"the {role} rows"
            raise TableError(f"gather_frame: {whose}: {why}; give each process its own rank number and coordinates")


def gather_frame(
    frame: pd.DataFrame,
    *,
    group: ProcessGroup | None = None,
    dst: int = 0,
    timeout_s: float | timedelta | None = None,
    allow_empty: bool = False,
) -> pd.DataFrame | None:
    """Gather every member's digest table to ``dst``: the combined table there, ``None`` on the others.

    Every member of ``group`` (default: the whole world) calls this with its own
    frame. ``dst`` is a global rank. ``timeout_s`` bounds how long group rank 0
    waits for every member to arrive (gloo's monitored barrier, which names the
    ranks missing; default: the group's timeout); the gather itself runs under
    the group's timeout. A frame's ``rank`` is kept; where it is NA the member's
    global rank is filled in. See the module docstring for the order, the
    duplicate check and the errors, which every member raises alike: a bad frame
    on one rank makes every rank raise :class:`~wcviz.TableError` naming it. A member
    whose frame has no rows makes every rank raise :class:`GatherError` naming it,
    unless it passes ``allow_empty=True``.
    """
    member = _Member(group, dst, timeout_s)
    return member.exchange(_payload(frame, member.rank, allow_empty))


def from_distributed(
    named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    *,
    group: ProcessGroup | None = None,
    dst: int = 0,
    role: str = "module",
    rank: int | None = None,
    dp: int | None = None,
    pp: int | None = None,
    tp: int | None = None,
    ep: int | None = None,
    host: str | None = None,
    algo: str = DEFAULT_ALGO,
    backend: str = "auto",
    phase: str | None = None,
    step: int | None = None,
    timeout_s: float | timedelta | None = None,
    allow_empty: bool = False,
) -> pd.DataFrame | None:
    """Digest this rank's tensors and gather every member's table to ``dst`` (see :func:`gather_frame`).

    ``rank`` defaults to this process's global rank, ``host`` to its host name,
    ``phase`` to ``current``. A rank whose tensors cannot be digested does not
    leave the others waiting: every member raises, naming it.
    """
    member = _Member(group, dst, timeout_s)
    me = member.rank
    info: dict[str, Any] = {
        "role": role,
        "rank": me if rank is None else int(rank),
        "dp": dp,
        "pp": pp,
        "tp": tp,
        "ep": ep,
        "host": socket.gethostname() if host is None else host,
        "step": step,
    }
    if phase is not None:
        info["phase"] = phase
    try:
        frame = from_named_tensors(named_tensors, algo=algo, backend=backend, progress=False, **info)
    except Exception as e:  # noqa: BLE001 -- reported on every rank, raised here too after the gather
        payload = _marker(me, f"rank {me} could not digest its tensors: {type(e).__name__}: {e}", e)
    else:
        payload = _payload(frame, me, allow_empty)
    return member.exchange(payload)
