"""One simulated rank's process: joins the gloo group, holds weights, serves an agent, obeys the driver.

:class:`wcviz.sim.cluster.Cluster` spawns one process per rank running :func:`main`.
World rank 0 is the trainer; world rank ``1 + i`` is engine rank ``i``. Every rank
answers commands from the driver over its pipe: ``(command, kwargs)`` in,
``("ok", value)`` or ``("error", type, message, traceback)`` out. Collective commands
(``refit``, ``gather``) are sent to every rank that takes part before any reply is read.

A rank dies with its driver: ``PR_SET_PDEATHSIG`` on Linux, and the command loop ends
when the pipe closes. It ignores SIGINT, so a Ctrl-C reaches the driver, which stops
every rank in order.
"""

from __future__ import annotations

import abc
import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    import pandas as pd
    import torch

    from wcviz.sim.engine import EngineLayout, LoaderFaults
    from wcviz.sim.model import ModelConfig

TRAINER = "trainer"
ENGINE = "engine"


def world_label(world_rank: int) -> str:
    """A broadcast world rank as the cluster names it: world rank 0 is the trainer, world rank ``1 + i`` engine rank
    ``i`` (so a refit error names the engine rank the driver's user knows, never the world rank)."""
    return f"{TRAINER} rank 0" if world_rank == 0 else f"{ENGINE} rank {world_rank - 1}"


@dataclass(frozen=True)
class Spec:
    """Everything a rank process needs to start (picklable: it crosses the spawn)."""

    role: str
    rank: int  # within its role
    world_rank: int
    world_size: int
    store: str  # torch.distributed FileStore path, fresh per cluster
    cfg: ModelConfig
    layout: EngineLayout
    verify: str
    buffer_bytes: int
    timeout_s: float
    agent: bool
    token: str | None
    allow_mutations: bool
    host: str
    algo: str
    parent_pid: int


def _die_with_parent(parent_pid: int) -> None:
    """End this process when the driver process dies: a watchdog thread that looks every 0.5 s (a busy rank does
    not read its closed pipe). Not PR_SET_PDEATHSIG: it fires when the *thread* that spawned the rank exits, so a
    cluster started from a worker thread (a web handler, ``asyncio.to_thread``) lost every rank with that thread."""
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="wcviz-parent-watch", daemon=True).start()


class _Rank(abc.ABC):
    """What trainer and engine ranks share: identity, a lock over the weights, the agent, digests."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.lock = threading.RLock()  # held by loads here and by the agent's reads and mutations
        self.agent: Any = None
        self.coords: dict[str, int | None] = {"dp": None, "pp": None, "tp": None, "ep": None}

    @abc.abstractmethod
    def named(self) -> dict[str, torch.Tensor]:
        """The rank's weights by name, live (the agent digests what this returns)."""

    def identity(self) -> dict[str, Any]:
        return {"role": self.spec.role, "rank": self.spec.rank, **self.coords, "host": self.spec.host}

    def digests(self, phase: str | None = None, name: str | None = None) -> pd.DataFrame:
        from wcviz._names import name_filter
        from wcviz.sources import from_named_tensors

        keep = name_filter(name)
        with self.lock:
            items = [(n, t) for n, t in self.named().items() if keep is None or keep(n)]
            return from_named_tensors(items, algo=self.spec.algo, progress=False, phase=phase, **self.identity())

    def start_agent(self, **actions: Any) -> str | None:
        if not self.spec.agent:
            return None
        from wcviz.agent import Agent

        self.agent = Agent(
            self.named,
            **self.identity(),
            algo=self.spec.algo,
            token=self.spec.token,
            allow_mutations=self.spec.allow_mutations and bool(actions),
            lock=self.lock,
            **actions,
        )
        return self.agent.start("127.0.0.1", 0)



class Trainer(_Rank):
    """World rank 0: owns the full model, takes steps, refits every engine over a gloo broadcast."""

    def __init__(self, spec: Spec) -> None:
        from wcviz.sim.model import build_state_dict

        super().__init__(spec)
        self.base = build_state_dict(spec.cfg)
        self.weights = self.base
        self.step_k = 0

    def named(self) -> dict[str, torch.Tensor]:
        return self.weights

    def step(self, k: int | None = None) -> int:
        """Advance to step ``k`` (default: the next); step k's weights depend on k only."""
        k = self.step_k + 1 if k is None else int(k)
        weights = self._weights_at(k)
        with self.lock:
            self.weights, self.step_k = weights, k
        return k

    def _weights_at(self, k: int) -> dict[str, torch.Tensor]:
        """The weights of step ``k``, computed from the base (step k's weights depend on k only)."""
        from wcviz.sim.model import step

        if k < 0:
            raise ValueError(f"step must be >= 0, got {k}")
        weights = self.base
        for i in range(1, k + 1):
            weights = step(weights, i)
        return weights

    def refit(self, wire: Any = None) -> Any:
        """Broadcast the current weights to every engine; the :class:`BroadcastResult` (transport check).

        The engines already wait in prepare's barrier: if the sender cannot be built (a
        fault plan it refuses), they are told so there, never left to wait out the
        timeout with the group broken for every later refit.
        """
        from wcviz.refit import BroadcastSender
        from wcviz.refit.broadcast import abort_before_prepare

        try:
            tx = BroadcastSender(
                verify=self.spec.verify, src=0, buffer_bytes=self.spec.buffer_bytes, faults=wire, algo=self.spec.algo,
                timeout_s=self.spec.timeout_s, rank_label=world_label,
            )  # fmt: skip
        except Exception as e:
            why = f"the trainer could not start the refit: {type(e).__name__}: {e}"
            with contextlib.suppress(Exception):  # the engines cannot be told (one is dead): the trainer's error says why
                abort_before_prepare(why, timeout_s=self.spec.timeout_s)
            raise
        tx.prepare()
        with self.lock:
            return tx.send(self.weights)

    def save_checkpoint(self, directory: str, step: int | None = None) -> str:
        """Write the current weights (or step ``step``'s: the trainer stays where it is) as a Hugging Face style
        safetensors checkpoint."""
        from wcviz.sim.model import save_checkpoint

        with self.lock:
            weights = self.weights if step is None or step == self.step_k else self._weights_at(step)
            save_checkpoint(weights, directory, shards=2)
        return directory


class Engine(_Rank):
    """World rank ``1 + rank``: one (dp, pp, tp) shard in vLLM's layout, loading what it receives."""

    def __init__(self, spec: Spec) -> None:
        from wcviz.sim.engine import EngineShard
        from wcviz.sim.model import parameter_shapes

        super().__init__(spec)
        dp, pp, tp = spec.layout.coords(spec.rank)
        self.coords = {"dp": dp, "pp": pp, "tp": tp, "ep": None}
        self.shard = EngineShard(spec.cfg, tp, spec.layout.tp, pp, spec.layout.pp, dp_rank=dp, dp_size=spec.layout.dp)
        dtype = str(spec.cfg.dtype).removeprefix("torch.")
        self.metadata = {n: (s, dtype) for n, s in parameter_shapes(spec.cfg).items()}  # full HF tensors arrive
        self.checkpoint: str | None = None
        self.written: set[str] = set()
        self.resets = 0

    def named(self) -> dict[str, torch.Tensor]:
        return self.shard.params

    def load(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        with self.lock:
            self.written |= self.shard.load_weights(batch)

    def refit(self, wire: Any = None) -> dict[str, Any]:
        from wcviz.refit import BroadcastReceiver

        rx = BroadcastReceiver(
            self.metadata, self.load, verify=self.spec.verify, src=0, faults=wire, timeout_s=self.spec.timeout_s, rank_label=world_label
        )
        rx.prepare()
        self.written = set()
        got = rx.receive()
        return {"rank": self.spec.rank, "params": got.params, "nbytes": got.nbytes, "written": len(self.written)}

    def gather(self, phase: str | None = None) -> pd.DataFrame | None:
        """In-job collection: every engine's digests to engine rank 0 (world rank 1) over gloo, no HTTP."""
        from wcviz.sources import gather_frame

        return gather_frame(self.digests(phase), group=_ENGINES, dst=1, timeout_s=self.spec.timeout_s)

    def set_faults(self, faults: LoaderFaults) -> str:
        with self.lock:
            self.shard.faults = faults
        return str(faults)

    def set_checkpoint(self, directory: str | None) -> None:
        self.checkpoint = directory

    # -- the end-state actions, also behind the agent's POST endpoints --

    def snapshot(self) -> dict[str, Any]:
        """Digests only (no copy of the weights): the driver fetches them as phase ``snapshot``."""
        return {"params": len(self.shard.params)}

    def reset(self) -> dict[str, Any]:
        """Poison every parameter, alternating the byte so a leftover poison from the last check changes too."""
        from wcviz.endstate import POISON_BYTES, poison_

        byte = POISON_BYTES[self.resets % len(POISON_BYTES)]
        with self.lock:
            poison_(self.shard.params, byte=byte)
            self.resets += 1
        return {"params": len(self.shard.params), "byte": byte}

    def reload(self) -> dict[str, Any]:
        """Load the last checkpoint the driver pointed this rank at, through the same (faulty) loader."""
        from safetensors import safe_open

        if self.checkpoint is None:
            raise RuntimeError(f"engine rank {self.spec.rank} has no checkpoint to reload from; save one or reload by refit")
        files = sorted(Path(self.checkpoint).glob("*.safetensors"))
        if not files:
            raise RuntimeError(f"engine rank {self.spec.rank}: no *.safetensors files in {self.checkpoint}")
        written: set[str] = set()
        with self.lock:
            for path in files:
                with safe_open(str(path), framework="pt") as f:
                    written |= self.shard.load_weights((k, f.get_tensor(k)) for k in f.keys())  # noqa: SIM118
        return {"source": self.checkpoint, "written": len(written)}


_ENGINES: Any = None  # the engines' sub-group, made by every rank in the same order at start


def _serve(rank: _Rank, conn: Connection) -> None:
    """The command loop; returns on ``stop`` or when the driver's end of the pipe closes."""
    while True:
        try:
            command, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        if command == "stop":
            conn.send(("ok", None))
            return
        try:
            fn = getattr(rank, command, None)
            if command.startswith("_") or not callable(fn):
                raise ValueError(f"{type(rank).__name__} rank has no command {command!r}")
            value = fn(**kwargs)
        except Exception as e:  # noqa: BLE001 - reported to the driver, which raises it naming this rank
            conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))
        else:
            conn.send(("ok", value))


def main(spec: Spec, conn: Connection) -> None:
    """Process entry point: set up, report ``ready`` with the agent's URL, serve commands."""
    global _ENGINES
    _die_with_parent(spec.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank: _Rank | None = None
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{spec.store}",
            rank=spec.world_rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.timeout_s),
        )
        _ENGINES = dist.new_group(ranks=list(range(1, spec.world_size)))
        rank = Trainer(spec) if spec.role == TRAINER else Engine(spec)
        rank.refit()  # the first load: every engine starts from the trainer's step 0
        if isinstance(rank, Engine):
            url = rank.start_agent(snapshot=rank.snapshot, reset=rank.reset, reload=rank.reload)
        else:
            url = rank.start_agent()
        conn.send(("ready", {**rank.identity(), "world_rank": spec.world_rank, "pid": os.getpid(), "url": url}))
        _serve(rank, conn)
    except BaseException as e:  # noqa: BLE001 - the driver must hear why this rank did not come up
        with contextlib.suppress(OSError, ValueError):
            conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))
    finally:
        if rank is not None and rank.agent is not None:
            rank.agent.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()



def entry() -> None:
    """``python -c 'from wcviz.sim._worker import entry; entry()' FD``, the Spec pickled on stdin."""
    import pickle
    import socket
    from multiprocessing.connection import Connection

    spec = pickle.loads(sys.stdin.buffer.read())
    main(spec, Connection(socket.socket(fileno=int(sys.argv[1])).detach()))
