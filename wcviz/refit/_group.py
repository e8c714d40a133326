"""What both ends of the broadcast refit share: the process group, and collectives whose failures are named.

A collective that fails because a peer is dead or did not answer in time raises
:class:`wcviz.refit.RefitTimeout` naming the step and this rank; gloo's monitored
barrier names the ranks that never arrived. ``rank_label`` says how a message names a
global rank (``"rank 2"`` by default; a cluster that numbers its engines from 0 says
``"engine rank 1"``), so an error names the rank its reader knows.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from wcviz.refit._transport import Transport
from wcviz.refit.config import check_timeout
from wcviz.refit.faults import FaultPlan
from wcviz.refit.verify import RefitError, RefitTimeout

__all__ = ["GroupMember", "RankLabel", "abort_before_prepare", "group_ranks"]

RankLabel = Callable[[int], str]  # a global rank as messages name it

_T = TypeVar("_T")


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _timeout(timeout_s: float | timedelta | None) -> timedelta | None:
    """The barrier's timeout; a negative, zero, infinite or NaN one is an error naming ``timeout_s``."""
    if timeout_s is None:
        return None
    seconds = timeout_s.total_seconds() if isinstance(timeout_s, timedelta) else timeout_s
    return timedelta(seconds=check_timeout(seconds))


class GroupMember(Transport):
    """What sender and receiver share: the group, the collectives wrapped so a dead peer is a RefitTimeout."""

    def __init__(
        self,
        *,
        verify: Any,
        src: int,
        group: dist.ProcessGroup | None,
        faults: FaultPlan | None,
        device: torch.device | str | None,
        backend: str,
        timeout_s: float | timedelta | None,
        rank_label: RankLabel | None = None,
    ) -> None:
        super().__init__(verify)  # self.mode: off | log | enforce, refused at once if this transport cannot verify
        self.src = int(src)
        self.group = group
        self.faults = faults or FaultPlan()
        self.backend = backend
        self.timeout = _timeout(timeout_s)
        self._device = torch.device(device) if device is not None else None
        self.rank_label = rank_label

    def who(self, rank: int) -> str:
        """Global ``rank`` as this end's messages name it (``rank_label``, else ``"rank 2"``)."""
        return self.rank_label(rank) if self.rank_label is not None else f"rank {rank}"

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return dist.get_rank()

    @property
    def device(self) -> torch.device:
        """Where buckets are staged: the given device, else CUDA for an NCCL group and the CPU otherwise."""
        if self._device is None:
            if dist.get_backend(self.group) == "nccl":
                self._device = torch.device("cuda", torch.cuda.current_device())
            else:
                self._device = torch.device("cpu")
        return self._device

    def _collective(self, step: str, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run one collective; a backend failure (timeout, a peer's closed connection) becomes RefitTimeout."""
        try:
            return fn(*args, **kwargs)
        except RefitError:
            raise
        except RuntimeError as e:  # gloo and NCCL raise RuntimeError (DistBackendError) subclasses
            raise RefitTimeout(
                f"refit broadcast: {step} failed on {self.who(self.rank)}: a peer is dead or did not answer in time ({e})"
            ) from e

    def _barrier(self, step: str) -> None:
        """A monitored barrier on gloo, which names the ranks that never arrive; nothing on other backends."""
        if dist.get_backend(self.group) == "gloo":
            self._collective(
                f"the barrier opening {step}",
                dist.monitored_barrier,
                group=self.group,
                timeout=self.timeout,
                wait_all_ranks=True,
            )

    def _broadcast_object(self, step: str, obj: Any = None) -> Any:
        box = [obj]
        device = self.device if self.device.type == "cuda" else None
        self._collective(step, dist.broadcast_object_list, box, src=self.src, group=self.group, device=device)
        return box[0]

    def _broadcast_bytes(self, step: str, buf: torch.Tensor) -> None:
        if buf.numel():
            self._collective(step, dist.broadcast, buf, src=self.src, group=self.group)

    def _gather(self, step: str, obj: Any) -> list[Any] | None:
        """``gather_object`` to the sender: the list (indexed by group rank) there, None elsewhere."""
        out: list[Any] | None = [None] * len(group_ranks(self.group)) if self.rank == self.src else None
        self._collective(step, dist.gather_object, obj, out, dst=self.src, group=self.group)
        return out


def abort_before_prepare(
    error: str,
    *,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    timeout_s: float | timedelta | None = None,
) -> None:
    """The sender's end of a refit it cannot begin (building its sender failed): open prepare's barrier and send the
    abort notice where the hello goes, so every engine's ``prepare`` raises with ``error`` at once instead of waiting
    out the group's timeout, and the group stays usable for the next refit."""
    try:
        wait = _timeout(timeout_s)
    except ValueError:  # the timeout may be what failed: the group's own then
        wait = None
    member = GroupMember(verify="off", src=src, group=group, faults=None, device=None, backend="auto", timeout_s=None)
    member.timeout = wait
    if member.rank != member.src:
        raise ValueError(f"abort_before_prepare runs on the src rank {src}, this is rank {member.rank}")
    member._barrier("prepare")
    member._broadcast_object("the abort notice", {"kind": "abort", "error": error})
