"""The simulated cluster as a fleet for the end-state session: its engine agents, and the trainer's refit as the reload.

What :meth:`wcviz.sim.Cluster.endstate` and the dashboard run the check over. A dead
engine rank cannot take part in a refit (the broadcast needs every rank), so when one
is dead - before the check or during it - the living ranks are reloaded from a
checkpoint of the trainer's current weights instead, and ``notes`` say so: no rank is
left poisoned because another died.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from wcviz.endstate import AgentFleet
from wcviz.sources import ActionResult, act

if TYPE_CHECKING:
    from wcviz.sim.cluster import Cluster

__all__ = ["ClusterFleet"]


class ClusterFleet(AgentFleet):
    """The engine agents of ``cluster``; ``reload="refit"``: the trainer refits every engine (the update under test,
    its transport check kept in :attr:`transport`), ``"checkpoint"``: each agent reloads the last checkpoint."""

    def __init__(self, cluster: Cluster, *, reload: str = "refit", **options: Any) -> None:
        from wcviz.sim.cluster import ClusterError

        if reload not in ("refit", "checkpoint"):
            raise ValueError(f"reload must be 'refit' or 'checkpoint', got {reload!r}")
        if not cluster.running and not cluster.urls("engine"):
            raise ClusterError("the cluster is not started: call cluster.start() (or use `with Cluster(...) as cluster:`) first")
        super().__init__(cluster.urls("engine"), token=cluster.token, reload=self._refit if reload == "refit" else None, **options)
        self.cluster = cluster
        self.transport: Any = None  # the last reload's refit BroadcastResult (None when that reload was no refit)
        self.notes: list[str] = []  # appended to, one per reload that had to differ; a caller takes those of its reload

    def stopped(self) -> str | None:
        """Why no rank can answer (the cluster was stopped), or None while it runs."""
        return None if self.cluster.running else "the cluster has stopped: start a new one and a new Dashboard"

    def on_stop(self, listener: Any) -> None:
        """Call ``listener()`` when the cluster stops."""
        self.cluster.on_stop(listener)

    def mutation_block(self, infos: Mapping[str, Mapping[str, Any]], errors: Mapping[str, str]) -> str | None:
        """The cluster says: its engine agents allow mutations iff it was started with ``allow_mutations=True``."""
        return None if self.cluster.allow_mutations else "the cluster was started without allow_mutations=True"

    def _refit(self) -> ActionResult | None:
        self.transport = None  # this reload's own: an earlier refit's check never stands for a checkpoint load
        dead = self.cluster.dead_engines()
        if not dead:
            try:
                self.transport = self.cluster.refit()
                return None
            except Exception as e:  # noqa: BLE001 - a rank that died during the refit: the living ones still need weights
                dead = self.cluster.dead_engines()
                if not dead:
                    raise
                why = f"the refit failed: {e}"
        else:
            why = "a refit needs every engine rank"
        return self._reload_living(dead, why)

    def _reload_living(self, dead: list[Any], why: str) -> ActionResult:
        """Reload the living engine ranks from a checkpoint of the trainer's weights: an ActionResult for them."""
        c = self.cluster
        c.save_checkpoint()  # the trainer's current weights; every living engine is pointed at it
        names = ", ".join(r.label for r in dead)
        self.notes.append(
            f"{names} {'is' if len(dead) == 1 else 'are'} dead, so the reload could not be a refit ({why}); the living "
            f"engine ranks were reloaded from the trainer's checkpoint of step {c.step_k} instead"
        )
        gone = {r.rank for r in dead}
        living = {str(r.url): r.identity for r in c.engine_ranks if r.rank not in gone and r.url}
        return act(living, "reload", token=self.token, timeout_s=c.timeout_s)
