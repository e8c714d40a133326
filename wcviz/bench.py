"""What a checksum costs: a small model zoo built in code and the time to digest each model.

Nothing is downloaded: every model is a :class:`wcviz.sim.model.ModelConfig`
whose weights :func:`wcviz.sim.model.build_state_dict` makes from a seed.
:func:`checksum_cost` returns a tidy frame that
:func:`wcviz.views.plot_cost` and :func:`wcviz.views.cost_text` draw.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence

import pandas as pd

from wcviz.digest import BACKENDS, digest_many, resolve_backend
from wcviz.sim.model import TINY, TINY_MOE, ModelConfig, build_state_dict

__all__ = ["COST_COLUMNS", "MODELS", "checksum_cost"]

MODELS: dict[str, ModelConfig] = {
    "llama-tiny": TINY,  # ~0.2 MB bf16, 29 tensors
    "llama-small": ModelConfig(vocab=8000, hidden=256, layers=6, heads=4, kv_heads=2, intermediate=1024),  # ~20 MB bf16
    "moe-tiny": TINY_MOE,  # ~0.4 MB bf16, 4 experts per layer
}
COST_COLUMNS = ("model", "backend", "device", "params", "numel", "nbytes", "seconds", "gbps")


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
