"""Fan-out: many agents' digest tables fetched concurrently into one frame, against one at a time.

    python benchmarks/fanout.py [--agents 256] [--params 500] [--procs 8] [--repeat 3] [--seq-sample 32]

``--procs`` worker processes (multiprocessing *spawn*) each host ``agents / procs``
:class:`wcviz.agent.Agent` servers on 127.0.0.1 (each its own uvicorn server and port;
agents share processes only for this measurement; rank ``r`` in process ``r % procs``). Agent ``r`` is rank ``r`` with
``tp = r % 8``, ``pp = (r // 8) % 4``, ``dp = r // 32`` and holds ``--params`` bf16
tensors of ``--elements`` values with Llama-like names, its own values (seeded by rank).

This process times ``fetch_agents(urls, client=...)`` (what :func:`wcviz.sources.fetch`
runs) with a fresh ``httpx.AsyncClient`` whose connection limits admit every agent at
once, ``--repeat`` times, and reports the median. The result is checked before any
figure is printed: every agent answered, ``agents x params`` rows, ``(rank, name)``
unique, each rank's names, coordinates and URL as hosted. The reference is the same kind
of client fetching agents one at a time; ``--seq-sample K`` times K of them (spread over
the processes and ranks) and extrapolates to all agents, and says so (``--seq-sample 0``:
all agents). CPU seconds of this process and of the workers are printed with each run.

Every worker process is stopped at the end, also on an error, Ctrl-C or SIGTERM; a worker
whose parent died without stopping it (SIGKILL) exits by itself within a second.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import queue
import resource
import signal
import statistics
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pandas as pd

# Workers are spawned: they import this module afresh, and numba reads its thread count once,
# at import. Nothing numba-related is imported at module level; workers set the variable first.
_LAYER_PARTS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
ROLE = "trainer"
HOST = "bench"


def param_names(params: int) -> list[str]:
    """``params`` Llama-like names: embedding, then layer after layer, then final norm and head."""
    if params < 3:
        return [f"model.layers.0.{_LAYER_PARTS[i]}" for i in range(params)]
    names = ["model.embed_tokens.weight"]
    names += [f"model.layers.{i // len(_LAYER_PARTS)}.{_LAYER_PARTS[i % len(_LAYER_PARTS)]}" for i in range(params - 3)]
    return names + ["model.norm.weight", "lm_head.weight"]


def coords(rank: int) -> dict[str, int]:
    """The parallel coordinates of a rank: tp 8 wide, pp 4 deep, dp the rest."""
    return {"dp": rank // 32, "pp": (rank // 8) % 4, "tp": rank % 8}


def weights(rank: int, params: int, elements: int) -> dict[str, Any]:
    """The tensors agent ``rank`` holds: bf16, ``elements`` values each, seeded by rank (deterministic)."""
    import torch

    g = torch.Generator().manual_seed(rank)
    block = torch.randn(params, elements, generator=g).to(torch.bfloat16)
    side = int(elements**0.5)
    out = {}
    for i, name in enumerate(param_names(params)):
        t = block[i].clone()
        if "norm" not in name and side * side == elements:
            t = t.view(side, side)  # matrices 2-D, norms 1-D
        out[name] = t
    return out


def _worker(index: int, ranks: Sequence[int], params: int, elements: int, report: Any, stop: Any, parent: int) -> None:
    """Host one Agent per rank in this process, report their URLs, serve until ``stop`` is set
    or the parent process (pid ``parent``) is gone."""
    os.environ["NUMBA_NUM_THREADS"] = "1"  # before numba is imported (by the first digest)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent stops us via ``stop``
    try:
        import torch

        torch.set_num_threads(1)
        from wcviz.agent import Agent
        from wcviz.sources import from_named_tensors

        held = {r: weights(r, params, elements) for r in ranks}
        if ranks:  # load numba's cached kernel and pandas' code paths before the clock runs anywhere
            from_named_tensors(held[ranks[0]], role=ROLE, rank=ranks[0], progress=False)
        agents = []
        for r in ranks:
            a = Agent(lambda w=held[r]: w, role=ROLE, rank=r, host=HOST, **coords(r))
            a.start()
            agents.append(a)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails loudly
        report.put((index, None, f"{type(e).__name__}: {e}"))
        return
    report.put((index, [(a.rank, a.url) for a in agents], None))
    try:
        # A parent killed outright (SIGKILL) cannot set stop: we notice that we were reparented.
        while not stop.wait(1.0) and os.getppid() == parent:
            continue
    finally:
        from concurrent.futures import ThreadPoolExecutor

        def halt(a: Any) -> None:
            try:
                a.stop(timeout_s=5)
            except Exception as e:  # noqa: BLE001 - the process exits anyway, and its server threads are daemons
                print(f"fanout worker {index}: {a!r} did not stop cleanly: {e}", file=sys.stderr)

        with ThreadPoolExecutor(max(1, len(agents))) as pool:  # all at once: each stop waits for a server tick
            list(pool.map(halt, agents))


def shares(agents: int, procs: int) -> list[list[int]]:
    """The ranks each worker process hosts: round robin, so rank ``r`` lives in process ``r % procs``."""
    procs = min(procs, agents)
    return [list(range(agents))[i::procs] for i in range(procs)]


def sample_ranks(agents: int, procs: int, k: int) -> list[int]:
    """``k`` ranks spread over the processes (one of each in turn) and, within each, over its ranks."""
    hosted = shares(agents, procs)
    per = -(-k // len(hosted))  # turns needed, each taking one rank from every process
    picks = [[share[j * len(share) // min(per, len(share))] for j in range(min(per, len(share)))] for share in hosted]
    turns = [[p[j] for p in picks if j < len(p)] for j in range(per)]
    return [r for turn in turns for r in turn][:k]


@contextmanager
def fleet(
    agents: int, params: int, procs: int, *, elements: int = 256, start_timeout_s: float = 180.0
) -> Iterator[list[str]]:
    """Start ``agents`` agents over ``procs`` spawned processes; yield their URLs in rank order.

    On leaving (normally, on an error or on Ctrl-C) every worker is told to stop, joined
    with a timeout, then killed if still alive.
    """
    if agents < 1 or params < 1 or procs < 1:
        raise ValueError("agents, params and procs must be >= 1")
    procs = min(procs, agents)
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    stop = ctx.Event()
    hosted = shares(agents, procs)
    workers = [
        ctx.Process(
            target=_worker,
            args=(i, hosted[i], params, elements, report, stop, os.getpid()),
            name=f"fanout-{i}",
            daemon=True,
        )
        for i in range(procs)
    ]
    try:
        for w in workers:
            w.start()
        urls: dict[int, str] = {}
        pending = set(range(procs))
        deadline = time.monotonic() + start_timeout_s
        while pending:
            try:
                index, reported, error = report.get(timeout=1.0)
            except queue.Empty:
                dead = [w.name for i, w in enumerate(workers) if i in pending and not w.is_alive()]
                if dead:
                    raise RuntimeError(f"worker(s) {', '.join(dead)} exited before reporting their agents") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"workers {sorted(pending)} did not start their agents within {start_timeout_s} s"
                    ) from None
                continue
            if error is not None:
                raise RuntimeError(f"worker {index} failed to start its agents: {error}")
            urls.update(dict(reported))
            pending.discard(index)
        if sorted(urls) != list(range(agents)):
            raise RuntimeError(f"expected ranks 0..{agents - 1}, workers reported {len(urls)}")
        yield [urls[r] for r in range(agents)]
    finally:
        stop.set()
        for w in workers:
            if w.pid is not None:
                w.join(timeout=10)
        for w in workers:
            if w.is_alive():
                w.kill()
                w.join(timeout=5)
        report.close()
        report.join_thread()


def _client(concurrency: int, timeout_s: float) -> Any:
    """One httpx client that admits ``concurrency`` connections at once.

    No keep-alive: each agent gets two requests (info, then digests) and a loaded client can
    take longer than uvicorn's idle keep-alive (5 s) between them, so the agent may close the
    pooled connection just as the second request goes out ("Server disconnected without
    sending a response"), which with ``retries=0`` is a failed rank. A fresh connection per
    request costs a local TCP handshake. ``trust_env=False``: no proxy from the environment
    between us and 127.0.0.1.
    """
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    return httpx.AsyncClient(limits=limits, timeout=timeout_s, trust_env=False)


def fetch_concurrent(urls: Sequence[str], *, timeout_s: float = 120.0) -> tuple[Any, float]:
    """One fan-out: every agent at once through one client. Returns the FetchResult and its wall seconds."""
    from wcviz.sources import fetch_agents

    async def go() -> tuple[Any, float]:
        async with _client(len(urls), timeout_s) as client:
            t0 = time.perf_counter()
            result = await fetch_agents(urls, client=client, timeout_s=timeout_s, retries=0)
            return result, time.perf_counter() - t0

    return asyncio.run(go())


def fetch_sequential(urls: Sequence[str], *, timeout_s: float = 120.0) -> tuple[list[Any], float]:
    """The reference: the same agents one after the other through one client. Results and total seconds."""
    from wcviz.sources import fetch_agents

    async def go() -> tuple[list[Any], float]:
        async with _client(1, timeout_s) as client:
            results = []
            t0 = time.perf_counter()
            for u in urls:
                results.append(await fetch_agents([u], client=client, timeout_s=timeout_s, retries=0))
            return results, time.perf_counter() - t0

    return asyncio.run(go())


def verify(result: Any, expected: Mapping[int, str], params: int) -> None:
    """Raise unless ``result`` holds every expected rank's every parameter exactly once, with its identity.

    ``expected`` maps each rank to the URL of the agent hosting it.
    """
    agents = len(expected)
    if not result.complete or result.answered != agents or set(result.urls) != set(expected.values()):
        raise RuntimeError(f"incomplete fetch: {result.summary}")
    frame = result.frame
    if len(frame) != agents * params:
        raise RuntimeError(f"expected {agents} x {params} = {agents * params} rows, got {len(frame)}")
    dup = frame.duplicated(["rank", "name"])
    if bool(dup.any()):
        first = frame[dup].iloc[0]
        raise RuntimeError(
            f"{int(dup.sum())} duplicated (rank, name) rows, first: rank {first['rank']} {first['name']}"
        )
    # unique (rank, name) pairs, agents x params of them, all from the expected ranks and names: each one exactly once
    if frame["rank"].isna().any() or not frame["rank"].isin(list(expected)).all():
        raise RuntimeError(f"rows of ranks other than the {agents} expected")
    if not frame["name"].isin(param_names(params)).all():
        raise RuntimeError("rows of parameters that no agent hosts")
    rank = frame["rank"].astype("int64")
    want = {"dp": rank // 32, "pp": (rank // 8) % 4, "tp": rank % 8, "url": rank.map(expected)}  # as coords()
    for col, values in want.items():
        got = frame[col].astype("object").to_numpy()
        wrong = frame[col].isna().to_numpy() | (got != values.astype("object").to_numpy())
        if wrong.any():
            i = int(wrong.argmax())
            raise RuntimeError(
                f"rank {rank.iloc[i]}: column {col} is {frame[col].iloc[i]!r}, expected {values.iloc[i]!r}"
            )
    if frame["ep"].notna().any() or (frame["role"] != ROLE).any() or (frame["host"] != HOST).any():
        raise RuntimeError("rows with the wrong role, host or ep")
    if frame["digest"].isna().any() or not frame["digest"].str.fullmatch(r"[0-9a-f]{32}").all():
        raise RuntimeError("some digests are missing or not 32 hex characters")


def _cpu_seconds(pids: Sequence[int]) -> float | None:
    """User + system CPU seconds of this process (``pids`` empty) or of the given processes; None off Linux."""
    if not pids:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    try:
        total = 0
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
        return total / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Figures:
    """What :func:`measure` found; every fan-out in ``times`` was verified."""

    agents: int
    params: int
    procs: int
    rows: int
    start_seconds: float
    times: list[float]
    client_cpu: list[float]
    agents_cpu: list[float | None]
    seq_agents: int
    seq_seconds: float
    seq_cpu: float | None  # client + agents CPU seconds of the one-at-a-time run
    frame: pd.DataFrame  # the last fan-out's frame

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def seq_total(self) -> float:
        """Sequential seconds for all agents (extrapolated when only a sample was timed)."""
        return self.seq_seconds / self.seq_agents * self.agents


def measure(agents: int, params: int, procs: int, repeat: int, seq_sample: int, *, elements: int = 256,
            timeout_s: float = 120.0, log: Any = print) -> Figures:
    """Start the fleet, time ``repeat`` verified fan-outs, then the sequential reference on a sample."""
    t0 = time.perf_counter()
    with fleet(agents, params, procs, elements=elements) as urls:
        started = time.perf_counter() - t0
        pids = [p.pid for p in mp.active_children() if p.name.startswith("fanout-") and p.pid is not None]
        log(f"started {agents} agents in {min(procs, agents)} processes in {started:.1f} s")
        k = agents if seq_sample <= 0 else min(seq_sample, agents)
        sample = {r: urls[r] for r in sample_ranks(agents, procs, k)}  # spread over processes and ranks
        warm = {share[0]: urls[share[0]] for share in shares(agents, procs)}  # one agent per process, not timed
        for (r, u), result in zip(warm.items(), fetch_sequential(list(warm.values()), timeout_s=timeout_s)[0]):
            verify(result, {r: u}, params)
        times: list[float] = []
        client_cpu: list[float] = []
        agents_cpu: list[float | None] = []
        frame = None
        for i in range(repeat):
            c0, w0 = _cpu_seconds(()), _cpu_seconds(pids)
            result, seconds = fetch_concurrent(urls, timeout_s=timeout_s)
            c1, w1 = _cpu_seconds(()), _cpu_seconds(pids)
            verify(result, dict(enumerate(urls)), params)  # never report a figure that was not checked
            times.append(seconds)
            client_cpu.append(c1 - c0)  # type: ignore[operator]
            agents_cpu.append(None if w0 is None or w1 is None else w1 - w0)
            frame = result.frame
            log(f"  fan-out {i + 1}/{repeat}: {seconds:.2f} s, {len(frame)} rows verified "
                f"(CPU s: client {client_cpu[-1]:.1f}, agents {_fmt(agents_cpu[-1])}; load {_load()})")
            del result
        c0, w0 = _cpu_seconds(()), _cpu_seconds(pids)
        seq, seq_seconds = fetch_sequential(list(sample.values()), timeout_s=timeout_s)
        c1, w1 = _cpu_seconds(()), _cpu_seconds(pids)
        seq_cpu = None if w0 is None or w1 is None else (c1 - c0) + (w1 - w0)  # type: ignore[operator]
        for (r, u), result in zip(sample.items(), seq):
            verify(result, {r: u}, params)
        log(f"  one at a time: {k} agents in {seq_seconds:.2f} s, {k * params} rows verified "
            f"(CPU s: {_fmt(seq_cpu)}; load {_load()})")
    assert frame is not None
    return Figures(agents, params, min(procs, agents), agents * params, started, times, client_cpu, agents_cpu,
                   k, seq_seconds, seq_cpu, frame)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=256)
    ap.add_argument("--params", type=int, default=500, help="parameters per agent")
    ap.add_argument("--procs", type=int, default=8, help="worker processes hosting the agents")
    ap.add_argument("--repeat", type=int, default=3, help="fan-outs timed; the median is reported")
    ap.add_argument("--seq-sample", type=int, default=32,
                    help="agents timed one at a time for the reference, extrapolated to all (0: all agents)")
    ap.add_argument("--elements", type=int, default=256, help="values per tensor (bf16)")
    ap.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, seconds")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")

    def terminated(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")  # unwinds through fleet()'s cleanup, like Ctrl-C

    signal.signal(signal.SIGTERM, terminated)
    import httpx
    import torch
    import uvicorn

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"torch {torch.__version__}, pandas {pd.__version__}, httpx {httpx.__version__}, "
          f"uvicorn {uvicorn.__version__}; load average {_load()}")
    f = measure(args.agents, args.params, args.procs, args.repeat, args.seq_sample,
                elements=args.elements, timeout_s=args.timeout)
    seq_label = "all agents" if f.seq_agents == f.agents else f"extrapolated from {f.seq_agents} agents"
    print()
    print(f"agents: {f.agents}   params per agent: {f.params}   processes: {f.procs}   "
          f"rows: {f.rows} (every fan-out verified)")
    print("| fetch | seconds | rows/s | × one at a time |")
    print("|---|---:|---:|---:|")
    print(f"| concurrent, one client (median of {len(f.times)}) "
          f"| {f.median:.2f} | {f.rows / f.median:,.0f} | {f.seq_total / f.median:.2f}× |")
    print(f"| one at a time ({seq_label}) | {f.seq_total:.2f} | {f.rows / f.seq_total:,.0f} | 1.00× |")
    runs = ", ".join(f"{t:.2f}" for t in f.times)
    print(f"fan-out runs: {runs} s; start-up of the agents {f.start_seconds:.1f} s (not timed)")
    cpu = [c + w for c, w in zip(f.client_cpu, f.agents_cpu) if w is not None]
    if cpu:
        client, total = statistics.median(f.client_cpu), statistics.median(cpu)
        print(f"CPU per fan-out (median): {total:.1f} s in all, {client:.1f} s of it in the client "
              f"({total / f.agents * 1000:.0f} ms per agent); {total / f.median:.2f} cores busy on average")
    if f.seq_cpu is not None:
        print(f"CPU one at a time: {f.seq_cpu / f.seq_agents * 1000:.0f} ms per agent; "
              f"{f.seq_cpu / f.seq_seconds:.2f} cores busy on average")
    return 0


if __name__ == "__main__":
    sys.exit(main())
