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

import contextlib
import os
import pickle
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wcviz._errors import WcvizError
from wcviz.sim import _worker
from wcviz.sim.engine import EngineLayout, LoaderFaults
from wcviz.sim.model import TINY, ModelConfig

if TYPE_CHECKING:
    import pandas as pd

    from wcviz.check import EndStateReport
    from wcviz.refit.broadcast import BroadcastResult
    from wcviz.refit.faults import FaultPlan
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
        coords = " ".join(f"{k}={v}" for k, v in (("dp", self.dp), ("pp", self.pp), ("tp", self.tp)) if v is not None)
        return f"{self.role} rank {self.rank}" + (f" ({coords})" if coords else "")

    @property
    def identity(self) -> dict[str, Any]:
        """What :func:`wcviz.sources.fetch_agents` should find at :attr:`url`."""
        return {"role": self.role, "rank": self.rank, "dp": self.dp, "pp": self.pp, "tp": self.tp}


_Key = tuple[str, int]  # (role, rank)
_ROOT = str(Path(__file__).resolve().parents[2])  # so the rank finds this very wcviz, installed or not


class Cluster:
    """A trainer and an engine of ``layout`` ranks (default TP 2 x PP 2), each an OS process; see the module docstring.

    ``verify``: the refit's transport check (off | log | enforce). ``agents``: start an
    HTTP agent on every rank. ``allow_mutations``: let the engine agents snapshot,
    reset and reload (destructive: a reset poisons the engine's weights) for bearer
    ``token`` (a random one when not given). ``timeout_s`` bounds start-up, every
    command and every collective.
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
        from wcviz.sim.engine import _check_layout

        for r in range(layout.world_size):
            dp, pp, tp = layout.coords(r)
            _check_layout(cfg, tp, layout.tp, pp, layout.pp, dp, layout.dp, False)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.cfg, self.layout = cfg, layout
        self.verify = verify_mode(verify)
        self.agents, self.allow_mutations = bool(agents), bool(allow_mutations)
        self.token = token if token is not None else (secrets.token_urlsafe(16) if allow_mutations else None)
        self.algo, self.buffer_bytes, self.timeout_s = algo, int(buffer_bytes), float(timeout_s)
        self._workdir_given = workdir is not None
        self.workdir: Path | None = Path(workdir) if workdir is not None else None
        self._procs: dict[_Key, subprocess.Popen[bytes]] = {}
        self._conns: dict[_Key, Connection] = {}
        self.ranks: dict[_Key, RankInfo] = {}
        self._dead: set[_Key] = set()
        self.step_k = 0
        self.checkpoint: Path | None = None
        self._finalizer: Any = None

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
        # Before the first spawn: whatever happens next, interpreter exit (or losing this object) takes the ranks down.
        self._finalizer = weakref.finalize(self, _teardown, self._procs, self._conns, None)
        try:
            for world_rank, (role, rank) in enumerate(roles):
                spec = _worker.Spec(
                    role=role, rank=rank, world_rank=world_rank, world_size=world, store=str(store),
                    cfg=self.cfg, layout=self.layout, verify=self.verify, buffer_bytes=self.buffer_bytes,
                    timeout_s=self.timeout_s, agent=self.agents, token=self.token,
                    allow_mutations=self.allow_mutations, host=socket.gethostname(), algo=self.algo,
                    parent_pid=os.getpid(),
                )  # fmt: skip
                self._procs[(role, rank)], self._conns[(role, rank)] = _spawn(spec)
            for key, msg in self._collect(list(self._procs), "start-up", self.timeout_s + 30).items():
                self.ranks[key] = RankInfo(
                    role=msg["role"], rank=msg["rank"], world_rank=msg["world_rank"], dp=msg["dp"], pp=msg["pp"],
                    tp=msg["tp"], pid=msg["pid"], url=msg["url"],
                )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every rank (politely, then SIGTERM, then SIGKILL) and remove the work folder; safe twice."""
        _teardown(self._procs, self._conns, timeout_s)
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self.workdir is not None and not self._workdir_given:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        self._procs.clear()
        self._conns.clear()

    def __enter__(self) -> Cluster:
        if not self._procs:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"{len(self._procs) - len(self._dead)} processes up" if self._procs else "stopped"
        return f"Cluster(engine tp={self.layout.tp} pp={self.layout.pp} dp={self.layout.dp} + trainer; {state})"

    # ---- talking to ranks ----------------------------------------------------------------

    def _collect(self, keys: Sequence[_Key], what: str, timeout_s: float) -> dict[_Key, Any]:
        """Read one reply from each of ``keys``; raise ClusterError naming every rank that failed."""
        deadline = time.monotonic() + timeout_s
        replies: dict[_Key, Any] = {}
        errors: dict[_Key, str] = {}
        for key in keys:
            conn, proc = self._conns[key], self._procs[key]
            while key not in replies and key not in errors:
                if conn.poll(0.05):
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        errors[key] = f"died (exit code {proc.wait(5)})"
                        continue
                    if msg[0] == "error":
                        errors[key] = f"{msg[1]}: {msg[2]}"
                    else:
                        replies[key] = msg[1]
                elif proc.poll() is not None:
                    errors[key] = f"died (exit code {proc.returncode})"
                elif time.monotonic() > deadline:
                    errors[key] = f"no answer within {timeout_s:.0f} s"
        if errors:
            for key in errors:
                if self._procs[key].poll() is not None:
                    self._dead.add(key)
            listed = "; ".join(f"{self._label(k)}: {e}" for k, e in errors.items())
            raise ClusterError(f"{what} failed on {len(errors)} rank{'s' if len(errors) != 1 else ''}: {listed}")
        return replies

    def _label(self, key: _Key) -> str:
        info = self.ranks.get(key)
        return info.label if info is not None else f"{key[0]} rank {key[1]}"

    def _call(self, keys: Sequence[_Key], command: str, **kwargs: Any) -> dict[_Key, Any]:
        """Send ``command`` to every rank in ``keys`` first (collectives need them all), then collect."""
        if not self._procs:
            raise ClusterError(f"{command}: the cluster is not running; call start() or use it in a with block")
        dead = [k for k in keys if k in self._dead or self._procs[k].poll() is not None]
        if dead:
            self._dead.update(dead)
            raise ClusterError(f"{command}: {', '.join(self._label(k) for k in dead)} is dead")
        for key in keys:
            self._conns[key].send((command, kwargs))
        return self._collect(keys, command, self.timeout_s + 10)

    @property
    def _trainer(self) -> _Key:
        return (_worker.TRAINER, 0)

    def _ranks_of(self, ranks: Sequence[int]) -> list[int]:
        return [k[1] for k in self._engine_keys(list(ranks))]

    def _engine_keys(self, ranks: Sequence[int] | None = None) -> list[_Key]:
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
        return [p.pid for p in self._procs.values()]

    def step(self, k: int | None = None) -> int:
        """The trainer takes step ``k`` (default: the next one); engines see it at the next :meth:`refit`."""
        self.step_k = self._call([self._trainer], "step", k=k)[self._trainer]
        return self.step_k

    def refit(self, *, wire: FaultPlan | None = None) -> BroadcastResult:
        """Broadcast the trainer's weights to every engine, digests compared per rank (the transport check).

        The result's ``ranks`` are keyed by engine rank (the broadcast's own world ranks are one higher).

        ``wire``: transport faults (:class:`wcviz.refit.FaultPlan`) for this refit only; a
        fault's ``ranks`` are engine ranks here.
        """
        from dataclasses import replace

        from wcviz.refit.faults import FaultPlan

        if wire is not None:  # engine ranks -> the broadcast's world ranks
            wire = FaultPlan(tuple(replace(f, ranks=tuple(r + 1 for r in self._ranks_of(f.ranks))) for f in wire.faults))
        keys = [self._trainer, *self._engine_keys()]
        result: BroadcastResult = self._call(keys, "refit", wire=wire)[self._trainer]
        return replace(result, ranks={world - 1: r for world, r in result.ranks.items()})  # engine ranks, not world ranks

    def set_faults(self, faults: LoaderFaults | Mapping[int, LoaderFaults] | None) -> None:
        """Loader faults from now on: one :class:`LoaderFaults` for every engine rank, or per rank.

        ``None`` (or an empty mapping) heals every rank. Dead ranks are skipped: they load nothing.
        """
        if faults is None or isinstance(faults, LoaderFaults):
            per_rank = {r: faults or LoaderFaults() for r in range(self.layout.world_size)}
        elif isinstance(faults, Mapping):
            per_rank = {r: LoaderFaults() for r in range(self.layout.world_size)}
            for r, f in faults.items():
                if not isinstance(f, LoaderFaults):
                    raise TypeError(f"faults for engine rank {r} must be LoaderFaults, got {type(f).__name__}")
                self._engine_keys([r])
                per_rank[r] = f
        else:
            raise TypeError(f"faults must be LoaderFaults, a mapping engine rank -> LoaderFaults, or None; got {type(faults).__name__}")
        for r, f in per_rank.items():
            if f.tp_as is not None and not 0 <= f.tp_as < self.layout.tp:
                raise ValueError(f"engine rank {r}: LoaderFaults.tp_as={f.tp_as} is outside tp 0..{self.layout.tp - 1}")
        self._dead_engines()
        for r, f in per_rank.items():
            key = self._engine_keys([r])[0]
            if key not in self._dead:
                self._call([key], "set_faults", faults=f)

    def save_checkpoint(self) -> Path:
        """The trainer writes its current weights as safetensors; engine agents' ``reload`` loads them."""
        assert self.workdir is not None
        path = self.workdir / f"checkpoint-step{self.step_k}"
        self._call([self._trainer], "save_checkpoint", directory=str(path))
        self._call([k for k in self._engine_keys() if k not in self._dead], "set_checkpoint", directory=str(path))
        self.checkpoint = path
        return path

    def digests(self, role: str = "engine", phase: str | None = None) -> pd.DataFrame:
        """Every rank's digests, asked over the command pipes (no HTTP), concatenated by rank."""
        import pandas as pd

        from wcviz.frame import validate

        keys = [k for k in self._procs if k[0] == role]
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
        vocabulary to a multiple of TP only, hence ``vocab_padding=1``.
        """
        from wcviz.layouts import detect_family, expected_frame

        path = self.save_checkpoint()
        from wcviz.sim.model import parameter_shapes

        family = detect_family(list(parameter_shapes(self.cfg)))
        return expected_frame(
            path, family, tp=self.layout.tp, pp=self.layout.pp, dp=self.layout.dp,
            heads=self.cfg.heads, kv_heads=self.cfg.kv_heads, vocab_padding=1, algo=self.algo,
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
        proc = self._procs[key]
        proc.kill()
        proc.wait(10)
        self._dead.add(key)

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
        :meth:`save_checkpoint`. ``faults``, when given, are set after the reset, so
        they strike the update under test only (and stay set afterwards). Other
        arguments go to :func:`wcviz.check.check_agents`.

        A dead engine rank cannot take part in a refit (the broadcast needs every
        rank), so when one is dead - before the check or during it - the living ranks
        are reloaded from a checkpoint of the trainer's current weights instead (the
        report's ``notes`` say so) and the dead one is ``unreachable`` under its
        coordinates: no rank is left poisoned because another died.
        """
        from wcviz.check import check_agents

        if not self.allow_mutations:
            raise ClusterError("the end-state check resets every engine rank: start the cluster with allow_mutations=True")
        if reload not in ("refit", "checkpoint"):
            raise ValueError(f"reload must be 'refit' or 'checkpoint', got {reload!r}")
        if reload == "checkpoint" and self.checkpoint is None:
            self.save_checkpoint()
        transport: list[Any] = []
        notes: list[str] = []

        def inject() -> None:
            if faults is not None:
                self.set_faults(faults)

        def by_refit() -> Any:
            dead = self._dead_engines()
            if not dead:
                try:
                    transport.append(self.refit())
                    return None
                except ClusterError as e:
                    dead = self._dead_engines()
                    if not dead:
                        raise
                    why = f"the refit failed: {e}"
            else:
                why = "a refit needs every engine rank"
            return self._reload_living(dead, why, notes)

        report = check_agents(
            self.urls("engine"), token=self.token, reload=by_refit if reload == "refit" else None,
            before_reload=inject, progress=progress, **kwargs,
        )  # fmt: skip
        report.transport = transport[0] if transport else None
        report.notes.extend(notes)
        return report

    def _dead_engines(self) -> list[_Key]:
        """Engine ranks whose process is gone (marked dead from now on)."""
        for key in self._engine_keys():
            if self._procs[key].poll() is not None:
                self._dead.add(key)
        return [k for k in self._engine_keys() if k in self._dead]

    def _reload_living(self, dead: list[_Key], why: str, notes: list[str]) -> Any:
        """Reload the living engine ranks from a checkpoint of the trainer's weights: an ActionResult for them."""
        from wcviz.sources import act

        self.save_checkpoint()  # the trainer's current weights; every living engine is pointed at it
        names = ", ".join(self._label(k) for k in dead)
        notes.append(
            f"{names} {'is' if len(dead) == 1 else 'are'} dead, so the reload could not be a refit ({why}); the living "
            f"engine ranks were reloaded from the trainer's checkpoint of step {self.step_k} instead"
        )
        living = {str(self.ranks[k].url): self.ranks[k].identity for k in self._engine_keys() if k not in dead and self.ranks[k].url}
        return act(living, "reload", token=self.token, timeout_s=self.timeout_s)


def _spawn(spec: _worker.Spec) -> tuple[subprocess.Popen[bytes], Connection]:
    """Start one rank in a fresh interpreter (:func:`wcviz.sim._worker.entry`), its command pipe a socketpair.

    A fresh interpreter rather than multiprocessing's spawn: nothing of the caller's
    ``__main__`` is re-imported, so a script without an ``if __name__ == "__main__"``
    guard, a notebook or a REPL can start a cluster. Never fork: numba/OpenMP threads
    do not survive it.
    """
    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from wcviz.sim._worker import entry; entry()", str(theirs.fileno())],
            stdin=subprocess.PIPE,
            pass_fds=(theirs.fileno(),),
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))},
        )
    finally:
        theirs.close()
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps(spec))
    proc.stdin.close()
    return proc, Connection(ours.detach())


def _teardown(procs: Mapping[_Key, subprocess.Popen[bytes]], conns: Mapping[_Key, Connection], timeout_s: float | None) -> None:
    """Ask every live rank to stop, then escalate to SIGTERM and SIGKILL; reap them all."""
    wait = 10.0 if timeout_s is None else timeout_s
    for key, proc in procs.items():
        if proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                conns[key].send(("stop", {}))
    deadline = time.monotonic() + wait
    for proc in procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.01, deadline - time.monotonic()))
    for sig in ("terminate", "kill"):
        alive = [p for p in procs.values() if p.poll() is None]
        for proc in alive:
            getattr(proc, sig)()
        for proc in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
    for conn in conns.values():
        with contextlib.suppress(OSError):
            conn.close()
