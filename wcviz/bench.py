"""What a checksum costs: a small model zoo built in code and the time to digest each model.

Nothing is downloaded: every model is a :class:`wcviz.sim.model.ModelConfig`
whose weights :func:`wcviz.sim.model.build_state_dict` makes from a seed.
:func:`checksum_cost` returns a tidy frame that
:func:`wcviz.views.plot_cost` and :func:`wcviz.views.cost_text` draw.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import pandas as pd

from wcviz.digest import ALGORITHMS, BACKENDS, digest_many, resolve_backend
from wcviz.sim.model import TINY, TINY_MOE, ModelConfig, build_state_dict

__all__ = [
    "COST_COLUMNS",
    "MODELS",
    "algorithm_rates",
    "cli_startup",
    "PREDICTED_COLUMNS",
    "ZOO",
    "checksum_cost",
    "predicted_cost",
    "predicted_text",
    "recorded_rates",
    "throughput",
]

MODELS: dict[str, ModelConfig] = {
    "llama-tiny": TINY,  # ~0.2 MB bf16, 30 tensors
    "llama-small": ModelConfig(vocab=8000, hidden=256, layers=6, heads=4, kv_heads=2, intermediate=1024),  # ~20 MB bf16
    "moe-tiny": TINY_MOE,  # ~0.4 MB bf16, 4 experts per layer
}
COST_COLUMNS = ("model", "backend", "device", "params", "numel", "nbytes", "seconds", "gbps")

# Real models by their config numbers alone (never materialised unless small): parameter
# counts match the published ones (8.03 B, 70.55 B, 7.62 B, 46.70 B), bf16 as served.
ZOO: dict[str, ModelConfig] = {
    "llama-3-8b": ModelConfig(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
    "llama-3-70b": ModelConfig(vocab=128256, hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672),
    "qwen2.5-7b": ModelConfig(vocab=152064, hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, qkv_bias=True),
    "mixtral-8x7b": ModelConfig(
        vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, experts=8, moe_style="mixtral"
    ),
    "sim-tiny": TINY,  # the simulated cluster's model
}
PREDICTED_COLUMNS = (
    "model", "backend", "device", "params", "nbytes", "predicted_s", "measured_s", "gbps", "overhead_s", "rate_source",
)
RATE_COLUMNS = ("backend", "device", "gbps", "overhead_s", "rate_source")
MEASURED_HERE = "measured here"
# Rates measured on lent GPUs, appended by `benchmarks/gpu.py --record` (this machine has none).
GPU_RUNS = Path(__file__).with_name("gpu_runs.json")


def _models(models: Iterable[str] | Mapping[str, ModelConfig] | None) -> dict[str, ModelConfig]:
    if models is None:
        return dict(MODELS)
    if isinstance(models, Mapping):
        bad = [k for k, v in models.items() if not isinstance(v, ModelConfig)]
        if bad:
            raise TypeError(f"models {', '.join(map(repr, bad))}: expected a wcviz.sim.ModelConfig each")
        return {str(k): v for k, v in models.items()}
    if isinstance(models, str):
        models = [models]
    names = list(models)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise ValueError(f"unknown model {', '.join(map(repr, unknown))}; choose from {', '.join(MODELS)} (or pass {{name: ModelConfig}})")
    if not names:
        raise ValueError(f"no models to measure; choose from {', '.join(MODELS)}")
    return {n: MODELS[n] for n in names}


def _backends(backends: Sequence[str] | str) -> list[str]:
    chosen = [backends] if isinstance(backends, str) else list(backends)
    unknown = [b for b in chosen if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown digest backend {', '.join(map(repr, unknown))}; choose from {', '.join(BACKENDS)}")
    if not chosen:
        raise ValueError(f"no backends to measure; choose from {', '.join(BACKENDS)}")
    return list(dict.fromkeys(resolve_backend(b, "cpu") for b in chosen))


def checksum_cost(
    models: Iterable[str] | Mapping[str, ModelConfig] | None = None,
    backends: Sequence[str] = ("torch", "numba"),
    *,
    repeat: int = 3,
    progress: bool = False,
) -> pd.DataFrame:
    """Seconds and GB/s to digest every tensor of each model with each backend, on the CPU.

    ``models``: names from :data:`MODELS` (default: all of them) or
    ``{name: ModelConfig}``. ``backends``: from :data:`wcviz.digest.BACKENDS`
    (``auto`` is recorded as the backend it picks). Each (model, backend) is
    digested once untimed (JIT compilation, caches), then ``repeat`` times;
    ``seconds`` is the median of the whole-model times. One row per (model,
    backend), columns :data:`COST_COLUMNS`: ``params`` counts tensors, ``numel``
    their elements, ``nbytes`` their bytes, ``gbps`` is ``nbytes / seconds / 1e9``.
    """
    from tqdm.auto import tqdm

    zoo = _models(models)
    chosen = _backends(backends)
    if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1:
        raise ValueError(f"repeat must be an int >= 1, got {repeat!r}")
    rows = []
    with tqdm(total=len(zoo) * len(chosen), desc="checksum cost", unit="run", disable=not progress) as bar:
        for name, cfg in zoo.items():
            sd = build_state_dict(cfg)
            numel = sum(t.numel() for t in sd.values())
            nbytes = sum(t.numel() * t.element_size() for t in sd.values())
            smallest = min(sd, key=lambda n: sd[n].numel())
            for backend in chosen:
                digest_many({smallest: sd[smallest]}, backend=backend)  # warm: JIT compilation, caches
                times = []
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    digest_many(sd, backend=backend)
                    times.append(time.perf_counter() - t0)
                seconds = statistics.median(times)
                rows.append({
                    "model": name, "backend": backend, "device": "cpu", "params": len(sd), "numel": numel,
                    "nbytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9 if seconds > 0 else float("inf"),
                })
                bar.update()
    out = pd.DataFrame(rows, columns=list(COST_COLUMNS))
    return out.astype({"model": "string", "backend": "string", "device": "string", "params": "int64",
                       "numel": "int64", "nbytes": "int64", "seconds": "float64", "gbps": "float64"})


def throughput(
    backends: Sequence[str] = ("torch", "numba"), *, big_mib: int = 64, small_numel: int = 4096, n_small: int = 200, repeat: int = 3
) -> pd.DataFrame:
    """Per backend on this machine's CPU: GB/s on one large bf16 tensor, and the fixed cost per tensor.

    ``gbps`` is the median over ``repeat`` digests of a ``big_mib`` MiB tensor; ``overhead_s``
    is what each of ``n_small`` small tensors (``small_numel`` bf16 values) costs beyond its
    bytes at that rate. Columns: backend, device, gbps, overhead_s.
    """
    import torch

    chosen = _backends(backends)
    if big_mib < 1 or small_numel < 1 or n_small < 1 or repeat < 1:
        raise ValueError("big_mib, small_numel, n_small and repeat must all be >= 1")
    big = {"big": torch.randn(big_mib << 19).to(torch.bfloat16)}  # MiB of bf16 = 2**19 values
    small = {f"s{i}": torch.randn(small_numel).to(torch.bfloat16) for i in range(n_small)}
    rows = []
    for backend in chosen:
        digest_many({"warm": small["s0"]}, backend=backend)

        def timed(tensors: dict, backend: str = backend) -> float:
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                digest_many(tensors, backend=backend)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        big_s = timed(big)
        gbps = (big_mib << 20) / big_s / 1e9
        per_small = timed(small) / n_small - small_numel * 2 / (gbps * 1e9)
        rows.append({"backend": backend, "device": "cpu", "gbps": gbps, "overhead_s": max(per_small, 0.0), "rate_source": MEASURED_HERE})
    return pd.DataFrame(rows, columns=list(RATE_COLUMNS)).astype({"backend": "string", "device": "string", "rate_source": "string"})


def algorithm_rates(*, big_mib: int = 64, repeat: int = 3) -> pd.DataFrame:
    """GB/s of every digest algorithm (:data:`wcviz.digest.ALGORITHMS`) on one ``big_mib`` MiB bf16 tensor on this
    CPU, the median of ``repeat``: wcviz's own (nemo-rl-v3 on the fastest backend, sha256) beside the engines'
    (vllm-sha256, sglang-cpu, sglang-gpu). Columns: algo, device, gbps."""
    import torch

    if big_mib < 1 or repeat < 1:
        raise ValueError("big_mib and repeat must be >= 1")
    big = {"big": torch.randn(big_mib << 19).to(torch.bfloat16)}
    rows = []
    for algo in ALGORITHMS:
        digest_many({"warm": big["big"][:4096]}, algo=algo)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            digest_many(big, algo=algo)
            times.append(time.perf_counter() - t0)
        rows.append({"algo": algo, "device": "cpu", "gbps": (big_mib << 20) / statistics.median(times) / 1e9})
    return pd.DataFrame(rows).astype({"algo": "string", "device": "string"})


def cli_startup(repeat: int = 3) -> dict[str, float]:
    """Seconds, best of ``repeat`` fresh processes: ``wcviz digest`` of a 4.6 MB checkpoint, and ``import torch``
    alone (what the CLI no longer pays on checkpoints)."""
    import dataclasses
    import subprocess
    import sys
    import tempfile

    from wcviz.sim.model import save_checkpoint

    cfg = dataclasses.replace(TINY, hidden=256, intermediate=512, vocab=1024)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_checkpoint(build_state_dict(cfg), Path(tmp) / "ckpt", shards=1)
        runs = {
            "wcviz digest": [sys.executable, "-m", "wcviz", "digest", str(path), "--no-progress", "--out", str(Path(tmp) / "t.csv")],
            "import torch": [sys.executable, "-c", "import torch"],
        }
        out = {}
        for label, cmd in runs.items():
            best = float("inf")
            for _ in range(max(1, repeat)):
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, capture_output=True)
                best = min(best, time.perf_counter() - t0)
            out[label] = best
    return out


def recorded_rates(path: str | Path | None = None) -> pd.DataFrame:
    """GPU rates from recorded device runs (``benchmarks/gpu.py --record``), the latest per device and backend.

    Same columns as :func:`throughput` (:data:`RATE_COLUMNS`); ``device`` is
    ``cuda`` and ``rate_source`` says when and on which GPU, e.g. ``recorded
    2026-11-29 on NVIDIA H200``. Empty when no GPU run has been recorded.
    """
    path = Path(path) if path is not None else GPU_RUNS
    try:
        runs = json.loads(path.read_text())["runs"] if path.exists() else []
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a recorded-runs file (expected {{\"runs\": [...]}}): {e}") from None
    latest: dict[tuple[str, str], dict] = {}
    for i, r in enumerate(runs):
        missing = {"date", "device", "backend", "gbps", "overhead_s"} - set(r)
        if missing:
            raise ValueError(f"{path}: run {i} lacks {', '.join(sorted(missing))}")
        latest[(r["device"], r["backend"])] = r
    rows = [
        {"backend": r["backend"], "device": "cuda", "gbps": float(r["gbps"]), "overhead_s": float(r["overhead_s"]),
         "rate_source": f"recorded {r['date']} on {r['device']}"}
        for r in latest.values()
    ]
    return pd.DataFrame(rows, columns=list(RATE_COLUMNS)).astype(
        {"backend": "string", "device": "string", "gbps": "float64", "overhead_s": "float64", "rate_source": "string"}
    )


def predicted_cost(
    models: Iterable[str] | Mapping[str, ModelConfig] | None = None,
    rates: pd.DataFrame | None = None,
    *,
    measure_below_bytes: int = 64 << 20,
) -> pd.DataFrame:
    """What digesting each model costs per backend: predicted from measured rates, measured where small.

    ``models``: names from :data:`ZOO` (default: all) or ``{name: ModelConfig}``; only shapes
    are used, nothing is built unless the model has fewer than ``measure_below_bytes`` bytes.
    ``rates``: :func:`throughput`'s frame (measured now when None).
    ``predicted_s = nbytes / gbps + params * overhead_s`` (a prediction, labelled so);
    ``measured_s`` is a real whole-model digest time, NA where the model was not built.
    Columns :data:`PREDICTED_COLUMNS`.
    """
    import math

    from wcviz.sim.model import parameter_shapes

    if models is None:
        zoo = dict(ZOO)
    elif isinstance(models, Mapping):
        zoo = _models(models)
    else:
        names = [models] if isinstance(models, str) else list(models)
        unknown = [n for n in names if n not in ZOO]
        if unknown or not names:
            raise ValueError(f"unknown model {', '.join(map(repr, unknown)) or '(none given)'}; choose from {', '.join(ZOO)}")
        zoo = {n: ZOO[n] for n in names}
    rates = throughput() if rates is None else rates
    if not isinstance(rates, pd.DataFrame):
        raise TypeError(f"rates must be a DataFrame (wcviz.bench.throughput()'s), got {type(rates).__name__}")
    missing = {"backend", "gbps", "overhead_s"} - set(rates.columns)
    if missing:
        raise ValueError(f"rates lack column(s) {', '.join(sorted(missing))}; pass wcviz.bench.throughput()'s frame")
    rates = rates.copy()
    for i, r in enumerate(rates[["backend", "gbps", "overhead_s"]].itertuples(index=False)):
        gbps, overhead = pd.to_numeric(pd.Series([r.gbps, r.overhead_s]), errors="coerce")
        if not (math.isfinite(gbps) and gbps > 0) or not (math.isfinite(overhead) and overhead >= 0):
            raise ValueError(f"rates row {i} ({r.backend}): gbps must be > 0 and overhead_s >= 0, both finite; got {r.gbps!r}, {r.overhead_s!r}")
    if "device" not in rates:
        rates["device"] = "cpu"
    if "rate_source" not in rates:
        rates["rate_source"] = MEASURED_HERE
    # ``auto`` is measured (and labelled) as the backend it picks on the row's device, so look it up by that name
    rates["backend"] = [
        resolve_backend(b, d) if b == "auto" else b for b, d in zip(rates["backend"].astype(str), rates["device"].astype(str))
    ]
    here = list(dict.fromkeys(rates[rates["device"] == "cpu"]["backend"]))  # only these can be measured here
    rows = []
    for name, cfg in zoo.items():
        shapes = parameter_shapes(cfg)
        width = cfg.dtype.itemsize
        nbytes = sum(math.prod(s) for s in shapes.values()) * width
        small = nbytes < measure_below_bytes and bool(here)
        measured = checksum_cost({name: cfg}, here, repeat=3) if small else None
        for r in rates.itertuples(index=False):
            m = measured[measured["backend"] == r.backend]["seconds"] if measured is not None and r.device == "cpu" else None
            rows.append({
                "model": name, "backend": r.backend, "device": r.device, "params": len(shapes),
                "nbytes": nbytes, "predicted_s": nbytes / (r.gbps * 1e9) + len(shapes) * r.overhead_s,
                "measured_s": float(m.iloc[0]) if m is not None and len(m) else float("nan"),
                "gbps": r.gbps, "overhead_s": r.overhead_s, "rate_source": r.rate_source,
            })
    return pd.DataFrame(rows, columns=list(PREDICTED_COLUMNS)).astype(
        {"model": "string", "backend": "string", "device": "string", "rate_source": "string"}
    )


def predicted_text(cost: pd.DataFrame) -> str:
    """The prediction as a terminal table: one line per (model, backend, device), predictions marked as such.

    Where any rate was not measured here (a recorded GPU run), every line ends with where its rates come from, so
    two GPUs of one backend (``triton cuda``) are told apart by date and device; a rate line is given per source."""
    from wcviz._text import size

    elsewhere = bool((cost["rate_source"] != MEASURED_HERE).any())
    header = f"{'model':<14} {'backend':<7} {'device':<6} {'tensors':>7} {'size':>9} {'predicted s':>12} {'measured s':>11}"
    lines = [header + ("  rates" if elsewhere else "")]
    for r in cost.itertuples(index=False):
        measured = "-" if math.isnan(r.measured_s) else _secs(r.measured_s)
        lines.append(
            f"{r.model:<14} {r.backend:<7} {r.device:<6} {r.params:>7} {size(r.nbytes):>9} {_secs(r.predicted_s):>12} {measured:>11}"
            + (f"  {r.rate_source}" if elsewhere else "")
        )
    lines.append("predicted = bytes / measured GB/s + tensors x measured per-tensor cost; measured = a whole-model digest here")
    sources = cost.drop_duplicates(["backend", "device", "rate_source"])
    for r in sources.itertuples(index=False):
        lines.append(f"  {r.backend} on {r.device}: {r.gbps:.2f} GB/s, {r.overhead_s * 1e3:.3f} ms per tensor, {r.rate_source}")
    if not (cost["device"] != "cpu").any():
        lines.append("  GPU: not measured on a GPU yet (no recorded device run; benchmarks/gpu.py --record adds one)")
    return "\n".join(lines)


def _secs(x: float) -> str:
    return f"{x:.2f}" if x >= 1 else f"{x:.4f}"
