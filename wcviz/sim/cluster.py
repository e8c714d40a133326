"""A simulated RL cluster on 127.0.0.1: one trainer process and TP x PP (x DP) engine processes.

Real processes in one real gloo process group, engine shards in vLLM's layout, a
trainer that refits them through :mod:`wcviz.refit`'s broadcast transport, and an
agent (:class:`wcviz.agent.Agent`) on every rank, so everything wcviz does to a
real job can be done to this one::

    with Cluster(TINY, EngineLayout(tp=2, pp=2), allow_mutations=True) as c:
        c.step(); c.refit()                              # the trainer's update, transport-checked
        c.set_faults({1: LoaderFaults(skip=r"k_proj")})  # a loader bug on engine rank 1
        report = c.endstate()                            # snapshot -> reset -> reload -> compare

``Cluster.start`` brings every rank up (one call) and ``stop`` takes every one down:
on leaving the ``with`` block, on an error, on Ctrl-C, at interpreter exit, and -
through ``PR_SET_PDEATHSIG`` - when the driver process is killed outright.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wcviz._errors import WcvizError, check_deadline
from wcviz.sim import _worker
from wcviz.sim._procs import Key, RankProcesses
from wcviz.sim.engine import EngineLayout, LoaderFaults
from wcviz.sim.model import TINY, ModelConfig

log = logging.getLogger("wcviz.sim")

if TYPE_CHECKING:
    import pandas as pd

    from wcviz.endstate import EndStateReport
    from wcviz.refit.broadcast import BroadcastResult
    from wcviz.refit.faults import FaultPlan
    from wcviz.sim._fleet import ClusterFleet
    from wcviz.sources import FetchResult

__all__ = ["Cluster", "ClusterError", "RankInfo"]


class ClusterError(WcvizError, RuntimeError):
    """A rank failed to start, failed a command, or is dead; the message names the rank."""


@dataclass(frozen=True)
class RankInfo:
    """One rank of the cluster as the driver knows it."""

    role: str
    rank: int
    world_rank: int
    dp: int | None
    pp: int | None
    tp: int | None
    pid: int
    url: str | None

    @property
    def label(self) -> str:
        """``engine rank 1 (dp=0 pp=0 tp=1)``."""
        from wcviz._text import rank_label

        return rank_label(self.identity, "role rank")

    @property
    def identity(self) -> dict[str, Any]:
        """What :func:`wcviz.sources.fetch_agents` should find at :attr:`url`."""
        return {"role": self.role, "rank": self.rank, "dp": self.dp, "pp": self.pp, "tp": self.tp}


class Cluster:
    """A trainer and an engine of ``layout`` ranks (default TP 2 x PP 2), each an OS process; see the module docstring.

    ``verify``: the refit's transport check (off | log | enforce). ``agents``: start an
    HTTP agent on every rank. ``allow_mutations``: let the engine agents snapshot,
    reset and reload (destructive: a reset poisons the engine's weights) for bearer
    ``token`` (a random one when not given). ``algo``: the digest algorithm every rank
    uses. ``buffer_bytes``: the refit's staging buffer. ``timeout_s`` bounds start-up,
    every command and every collective. Every argument is checked here, before any
    process is spawned.
    """

    def __init__(
        self,
        cfg: ModelConfig = TINY,
        layout: EngineLayout | None = None,
        *,
        verify: str = "log",
        agents: bool = True,
        allow_mutations: bool = False,
        token: str | None = None,
        algo: str = "nemo-rl-v3",
        buffer_bytes: int = 1 << 20,
        timeout_s: float = 60.0,
        workdir: str | Path | None = None,
    ) -> None:
        from wcviz.refit.config import verify_mode

        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a wcviz.sim.ModelConfig, got {type(cfg).__name__}")
        layout = layout if layout is not None else EngineLayout(tp=2, pp=2)
        if not isinstance(layout, EngineLayout):
            raise TypeError(f"layout must be a wcviz.sim.EngineLayout, got {type(layout).__name__}")
        layout.check(cfg)
        timeout_s, _ = check_deadline(timeout_s)  # a deadline must be a number of seconds
        self.cfg, self.layout = cfg, layout
        self.verify = verify_mode(verify)
        self.agents, self.allow_mutations = bool(agents), bool(allow_mutations)
        self.token = token if token is not None else (secrets.token_urlsafe(16) if allow_mutations else None)
        buffer_bytes = _checked_options(algo, token, allow_mutations, buffer_bytes)
        self.algo, self.buffer_bytes, self.timeout_s = algo, buffer_bytes, float(timeout_s)
        self._workdir_given = workdir is not None
        self.workdir: Path | None = Path(workdir) if workdir is not None else None
        self.ranks: dict[Key, RankInfo] = {}
        self._procs = RankProcesses(ClusterError, self._label)
        self._stop_listeners: list[Callable[[], object]] = []
        self.step_k = 0
        self.checkpoint: Path | None = None
        self._checkpoint_step: int | None = None  # the step whose weights self.checkpoint holds
        self._engine_step: int | None = 0  # the step the engines were last refit with (None: unknown, a refit failed)

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> Cluster:
        """Spawn every rank, wait until each has joined the group, loaded step 0 and started its agent."""
        if self._procs:
            raise ClusterError("cluster already started")
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="wcviz-sim-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        store = self.workdir / f"pg-store-{secrets.token_hex(4)}"
        world = 1 + self.layout.world_size
        roles = [(_worker.TRAINER, 0)] + [(_worker.ENGINE, r) for r in range(self.layout.world_size)]
        try:
            for world_rank, (role, rank) in enumerate(roles):
                spec = _worker.Spec(
                    role=role, rank=rank, world_rank=world_rank, world_size=world, store=str(store),
                    cfg=self.cfg, layout=self.layout, verify=self.verify, buffer_bytes=self.buffer_bytes,
                    timeout_s=self.timeout_s, agent=self.agents, token=self.token,
                    allow_mutations=self.allow_mutations, host=socket.gethostname(), algo=self.algo,
                    parent_pid=os.getpid(),
                )  # fmt: skip
                self._procs.spawn((role, rank), spec)
            for key, msg in self._procs.collect(list(self._procs.procs), "start-up", self.timeout_s + 30).items():
                self.ranks[key] = RankInfo(
                    role=msg["role"], rank=msg["rank"], world_rank=msg["world_rank"], dp=msg["dp"], pp=msg["pp"],
                    tp=msg["tp"], pid=msg["pid"], url=msg["url"],
                )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every rank (politely, then SIGTERM, then SIGKILL) and remove the work folder; safe twice.

        Whoever asked with :meth:`on_stop` (a dashboard over this cluster) is told once it has stopped.
        """
        was_running = bool(self._procs)
        self._procs.stop(timeout_s)
        if self.workdir is not None and not self._workdir_given:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        if was_running:
            for listener in list(self._stop_listeners):
                try:
                    listener()
                except Exception:  # noqa: BLE001 - a listener's failure must not stop the stop
                    log.exception("a stop listener of %r failed", self)

    @property
    def running(self) -> bool:
        """Whether the cluster's processes are up (started, and not stopped since)."""
        return bool(self._procs)

    def on_stop(self, listener: Callable[[], object]) -> None:
        """Call ``listener()`` when the cluster stops (a dashboard greys itself out)."""
        self._stop_listeners.append(listener)

    def __enter__(self) -> Cluster:
        if not self._procs:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"{len(self._procs.procs) - len(self._procs.dead)} processes up" if self._procs else "stopped"
        return f"Cluster(engine tp={self.layout.tp} pp={self.layout.pp} dp={self.layout.dp} + trainer; {state})"

    # ---- talking to ranks ----------------------------------------------------------------

    def _label(self, key: Key) -> str:
        info = self.ranks.get(key)
        return info.label if info is not None else f"{key[0]} rank {key[1]}"

    def _call(self, keys: Sequence[Key], command: str, **kwargs: Any) -> dict[Key, Any]:
        """``command`` on every rank in ``keys`` (sent to all first: collectives need them all), their replies."""
        return self._procs.call(keys, command, self.timeout_s + 10, **kwargs)

    @property
    def _trainer(self) -> Key:
        return (_worker.TRAINER, 0)

    def _ranks_of(self, ranks: Sequence[int]) -> list[int]:
        return [k[1] for k in self._engine_keys(list(ranks))]

    def _engine_keys(self, ranks: Sequence[int] | None = None) -> list[Key]:
        n = self.layout.world_size
        chosen = range(n) if ranks is None else ranks
        bad = [r for r in chosen if not (isinstance(r, int) and 0 <= r < n)]
        if bad:
            raise ValueError(f"engine rank(s) {bad} outside 0..{n - 1}")
        return [(_worker.ENGINE, r) for r in chosen]

    # ---- what a user does ----------------------------------------------------------------

    @property
    def engine_ranks(self) -> list[RankInfo]:
        return [self.ranks[k] for k in self._engine_keys()]

    @property
    def trainer(self) -> RankInfo:
        return self.ranks[self._trainer]

    def urls(self, role: str | None = "engine") -> dict[str, dict[str, Any]]:
        """``{agent URL: expected identity}`` of the ranks of ``role`` (None: all), for :func:`wcviz.sources.fetch`."""
        if not self.agents:
            raise ClusterError("this cluster runs without agents (agents=False)")
        return {i.url: i.identity for i in self.ranks.values() if (role is None or i.role == role) and i.url}

    @property
    def pids(self) -> list[int]:
        """OS process ids of every rank."""
        return self._procs.pids()

    def step(self, k: int | None = None) -> int:
        """The trainer takes step ``k`` (default: the next one); engines see it at the next :meth:`refit`."""
        self.step_k = self._call([self._trainer], "step", k=k)[self._trainer]
        return self.step_k

    def refit(self, *, wire: FaultPlan | None = None) -> BroadcastResult:
        """Broadcast the trainer's weights to every engine, digests compared per rank (the transport check).

        The result's ``ranks`` are keyed by engine rank (the broadcast's own world ranks are
        one higher), and its errors and warnings name engine ranks too.

        ``wire``: transport faults (:class:`wcviz.refit.FaultPlan`) for this refit only; a
        fault's ``ranks`` are engine ranks here. A plan the broadcast cannot apply is
        refused here, before any rank is told.
        """
        from dataclasses import replace

        from wcviz.refit.faults import FaultPlan, check_broadcast

        if wire is not None:  # engine ranks -> the broadcast's world ranks
            check_broadcast(wire)
            wire = FaultPlan(tuple(replace(f, ranks=tuple(r + 1 for r in self._ranks_of(f.ranks))) for f in wire.faults))
        keys = [self._trainer, *self._engine_keys()]
        self._engine_step = None  # until the refit is through, what the engines hold is not known
        result: BroadcastResult = self._call(keys, "refit", wire=wire)[self._trainer]
        self._engine_step = self.step_k
        return replace(result, ranks={world - 1: r for world, r in result.ranks.items()})  # engine ranks, not world ranks

    def set_faults(self, faults: LoaderFaults | Mapping[int, LoaderFaults] | None) -> None:
        """Loader faults from now on: one :class:`LoaderFaults` for every engine rank, or per rank.

        ``None`` (or an empty mapping) heals every rank. Dead ranks are skipped: they load nothing.
        """
        self._set_faults(_loader_faults(faults, self.layout))

    def _set_faults(self, per_rank: Mapping[int, LoaderFaults]) -> None:
        self.dead_engines()
        for r, f in per_rank.items():
            key = self._engine_keys([r])[0]
            if not self._procs.is_dead(key):
                self._call([key], "set_faults", faults=f)

    def save_checkpoint(self, step: int | None = None) -> Path:
        """The trainer writes its current weights (or those of ``step``; it stays at its own) as safetensors;
        engine agents' ``reload`` loads them."""
        assert self.workdir is not None
        step = self.step_k if step is None else step
        path = self.workdir / f"checkpoint-step{step}"
        self._call([self._trainer], "save_checkpoint", directory=str(path), step=step)
        self._call([k for k in self._engine_keys() if not self._procs.is_dead(k)], "set_checkpoint", directory=str(path))
        self.checkpoint, self._checkpoint_step = path, step
        return path

    def _current_checkpoint(self) -> list[str]:
        """Make :attr:`checkpoint` one of the step the engines were last refit with, saved anew if it is not: a
        checkpoint of another step makes a healthy loader's reload differ from the snapshot, all "corrupted".
        What the report's notes should say about it."""
        want = self._engine_step if self._engine_step is not None else self.step_k
        if self.checkpoint is not None and self._checkpoint_step == want:
            return []
        old, old_step = self.checkpoint, self._checkpoint_step
        self.save_checkpoint(step=want)
        if old is None:
            return []
        held = "the engines were last refit with" if self._engine_step is not None else "the trainer is at"
        return [f"the last checkpoint ({old.name}) was of step {old_step}, {held} step {want}: the reload used a fresh one"]

    def digests(self, role: str = "engine", phase: str | None = None) -> pd.DataFrame:
        """Every rank's digests, asked over the command pipes (no HTTP), concatenated by rank."""
        import pandas as pd

        from wcviz.frame import validate

        keys = [k for k in self._procs.procs if k[0] == role]
        if not keys:
            raise ValueError(f"no ranks with role {role!r}; roles are trainer and engine")
        frames = self._call(keys, "digests", phase=phase)
        return validate(pd.concat([frames[k] for k in keys], ignore_index=True), f"{role} digests")

    def gather(self, phase: str | None = None) -> pd.DataFrame:
        """Every engine's digests gathered to engine rank 0 over the gloo group (in-job, no HTTP)."""
        got = self._call(self._engine_keys(), "gather", phase=phase)
        frame: pd.DataFrame = got[self._engine_keys([0])[0]]
        return frame

    def fetch(self, role: str | None = "engine", **kwargs: Any) -> FetchResult:
        """Every agent of ``role`` fetched over HTTP (:func:`wcviz.sources.fetch`), identities checked."""
        from wcviz.sources import fetch

        return fetch(self.urls(role), **kwargs)

    def expected(self) -> pd.DataFrame:
        """What every engine rank should hold now: :func:`wcviz.layouts.expected_frame` of the trainer's weights.

        The trainer saves its current weights as a checkpoint and the layout rules (written
        apart from the simulated loader) cut and digest them per rank. The sim pads the
        vocabulary to a multiple of TP only, hence ``vocab_padding=1``, and names FusedMoE
        experts as vLLM did before 0.25 (``experts.w13_weight``), hence ``names="vllm<0.25"``.
        """
        from wcviz.layouts import detect_family, expected_frame

        path = self.save_checkpoint()
        from wcviz.sim.model import parameter_shapes

        family = detect_family(list(parameter_shapes(self.cfg)))
        return expected_frame(
            path, family, tp=self.layout.tp, pp=self.layout.pp, dp=self.layout.dp,
            heads=self.cfg.heads, kv_heads=self.cfg.kv_heads, vocab_padding=1, algo=self.algo, names="vllm<0.25",
        )  # fmt: skip

    def expected_check(self) -> pd.DataFrame:
        """The expected-shard check: :meth:`expected` against every engine agent's digests (:func:`wcviz.compare`).

        Catches what the end-state check cannot: a loader bug that writes the same wrong
        shard on every load. Ranks that do not answer are ``missing`` rows here; see
        :meth:`fetch` for why.
        """
        from wcviz.verdicts import compare

        expected = self.expected()
        actual = self.fetch().frame
        return compare(expected, actual.drop(columns="url"))

    def kill(self, rank: int) -> None:
        """SIGKILL engine ``rank`` (a crashed rank, for tests and demos); the others keep running."""
        key = self._engine_keys([rank])[0]
        self._procs.kill(key)

    def endstate(
        self,
        *,
        reload: str = "refit",
        faults: LoaderFaults | Mapping[int, LoaderFaults] | None = None,
        progress: bool = False,
        **kwargs: Any,
    ) -> EndStateReport:
        """Snapshot -> reset -> reload -> compare on every engine, through the agents over HTTP.

        DESTRUCTIVE (needs ``allow_mutations=True``): the reset poisons every engine
        weight until the reload. ``reload="refit"``: the trainer refits every engine
        again (the update under test; its transport check lands in the report's
        ``transport``); ``"checkpoint"``: each engine agent reloads the last
        :meth:`save_checkpoint`, saved afresh first when it is not of the step the
        engines were last refit with (a checkpoint of another step would call a healthy
        loader corrupted; the report's ``notes`` say so). ``faults``, when given, are
        checked first and set after the reset, so they strike the update under test
        only (and stay set afterwards). Other arguments (``timeout_s``, ``retries``,
        ``allow_partial_reset``, ...) go to the agents' fleet and :func:`wcviz.endstate.run`.

        A dead engine rank cannot take part in a refit: the living ranks are then
        reloaded from a checkpoint (the report's ``notes`` say so; :mod:`wcviz.sim._fleet`).
        """
        from wcviz.endstate import EndStateSession, run

        if not self.allow_mutations:
            raise ClusterError("the end-state check resets every engine rank: start the cluster with allow_mutations=True")
        per_rank = _loader_faults(faults, self.layout) if faults is not None else None  # refused before the reset
        network = {k: kwargs.pop(k) for k in ("timeout_s", "retries", "client", "transport") if k in kwargs}
        fleet = self.fleet(reload=reload, **network)
        notes = self._current_checkpoint() if reload == "checkpoint" else []

        def inject() -> None:
            if per_rank is not None:
                self._set_faults(per_rank)

        report = run(EndStateSession(fleet), before_reload=inject, progress=progress, **kwargs)
        report.transport = fleet.transport
        report.notes.extend(notes + fleet.notes)
        return report

    def fleet(self, *, reload: str = "refit", **options: Any) -> ClusterFleet:
        """The engine agents as a fleet for :class:`wcviz.endstate.EndStateSession` (what the dashboard drives)."""
        from wcviz.sim._fleet import ClusterFleet

        if not self.agents:
            raise ClusterError("this cluster runs without agents (agents=False)")
        return ClusterFleet(self, reload=reload, **options)

    def dead_engines(self) -> list[RankInfo]:
        """The engine ranks whose process is gone (marked dead from now on)."""
        return [self.ranks[k] for k in self._engine_keys() if self._procs.is_dead(k)]


def _checked_options(algo: str, token: str | None, allow_mutations: bool, buffer_bytes: int) -> int:
    """``buffer_bytes`` once ``algo``, ``token`` and it are known good; else an error naming the one that is not.

    Each rank would refuse them too, but only once spawned, after start-up timed out.
    """
    from wcviz.digest import ALGORITHMS
    from wcviz.refit.config import check_buffer_bytes

    if algo not in ALGORITHMS:
        raise ValueError(f"algo: unknown digest algorithm {algo!r}; choose one of {', '.join(ALGORITHMS)}")
    if token is not None and not isinstance(token, str):
        raise TypeError(f"token must be a string, got {type(token).__name__}")
    if allow_mutations and token == "":  # the agents refuse mutations without a token
        raise ValueError("token must not be empty with allow_mutations=True: the mutating endpoints need one (omit it for a random one)")
    return check_buffer_bytes(buffer_bytes)


def _loader_faults(faults: LoaderFaults | Mapping[int, LoaderFaults] | None, layout: EngineLayout) -> dict[int, LoaderFaults]:
    """``faults`` as ``{engine rank: LoaderFaults}`` for every rank of ``layout``, or an error naming what is wrong:
    checked before anything is sent (or, in an end-state check, reset)."""
    n = layout.world_size
    if faults is None or isinstance(faults, LoaderFaults):
        per_rank = {r: faults or LoaderFaults() for r in range(n)}
    elif isinstance(faults, Mapping):
        per_rank = {r: LoaderFaults() for r in range(n)}
        for r, f in faults.items():
            if not isinstance(f, LoaderFaults):
                raise TypeError(f"faults for engine rank {r} must be LoaderFaults, got {type(f).__name__}")
            if not (isinstance(r, int) and 0 <= r < n):
                raise ValueError(f"engine rank(s) {[r]} outside 0..{n - 1}")
            per_rank[r] = f
    else:
        raise TypeError(f"faults must be LoaderFaults, a mapping engine rank -> LoaderFaults, or None; got {type(faults).__name__}")
    for r, f in per_rank.items():
        if f.tp_as is not None and not 0 <= f.tp_as < layout.tp:
            raise ValueError(f"engine rank {r}: LoaderFaults.tp_as={f.tp_as} is outside tp 0..{layout.tp - 1}")
    return per_rank
