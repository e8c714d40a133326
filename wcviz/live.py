"""Expected against live, read-only: does a running engine hold what a checkpoint and a topology say it must?

:func:`verify_engine` cuts the trainer's checkpoint the way the engine lays it out
(:mod:`wcviz.layouts`), digests every rank's expected shard in the engine's own
checksum algorithm (``vllm-sha256``, ``sglang-gpu``), asks the engine's own checker
what each rank holds (:func:`wcviz.sources.from_vllm_weight_checker`,
:func:`wcviz.sources.from_sglang`) and compares. Nothing is reset, nothing of wcviz is
installed in the engine: it catches what an end-state check cannot, the persistent
bugs - a loader that always takes the wrong TP shard, a replica still serving an old
step - in production.

The expected shards are cut as the engine that answers lays them out
(``expected_frame(engine=...)``: vLLM's or SGLang's stage split, vocabulary padding,
FusedMoE and model classes), and its served dtype is what that engine makes of
``--dtype auto``. Ranks are matched by ``dp``, ``pp``, ``tp`` and the name (a rank's
place in the topology is what both sides state; the verdicts' ``rank`` is then the
layout's, vLLM's global numbering).
A rank that did not answer is ``unreachable`` - its expected rows are not ``missing``,
nothing about them is known - and SGLang's draft-model rows are left out (a trainer's
checkpoint is the target model's).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from wcviz._errors import WcvizError

__all__ = ["ENGINES", "LiveReport", "checkpoint_config", "verify_engine"]

ENGINES = ("auto", "vllm", "sglang")
_ALGO = {"vllm": "vllm-sha256", "sglang": "sglang-gpu"}
_ALGOS = {"vllm": ("vllm-sha256",), "sglang": ("sglang-gpu", "sglang-cpu")}  # what each engine's checker computes


def _engine_algo(engine: str, algo: str) -> str:
    """``algo`` when ``engine`` (``auto``: either) computes it, else a :class:`WcvizError` naming the ones it does."""
    allowed = [a for e, algos in _ALGOS.items() if engine in ("auto", e) for a in algos]
    if algo not in allowed:
        whose = "vLLM's and SGLang's checkers compute" if engine == "auto" else f"{'vLLM' if engine == 'vllm' else 'SGLang'}'s checker computes"
        raise WcvizError(f"{whose} {', '.join(allowed)}, not {algo!r} (sglang-cpu: an SGLang whose weights are on the CPU)")
    return algo
_FAMILY = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "mixtral": "mixtral"}  # config.json model_type -> family


@dataclass
class LiveReport:
    """What :func:`verify_engine` found: ``verdicts`` (:func:`wcviz.compare`'s frame, ``unreachable`` rows for
    ranks that did not answer), the ``fetch`` from the engine, the ``expected`` frame, and what was assumed."""

    engine: str
    url: str
    verdicts: pd.DataFrame
    fetch: Any
    expected: pd.DataFrame
    assumed: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True only when every rank answered and every expected parameter matches."""
        return bool(len(self.verdicts)) and self.fetch.complete and bool((self.verdicts["status"] == "match").all())

    @property
    def summary(self) -> str:
        """The verdicts' summary line, then the ranks that did not answer and what was assumed."""
        from wcviz.verdicts import summary

        lines = [summary(self.verdicts, title=f"{self.engine} at {self.url} against the checkpoint")]
        if not self.fetch.complete:
            lines.append(f"  {self.fetch.summary}")
        lines.append("  assumed: " + ", ".join(f"{k}={v}" for k, v in self.assumed.items()))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary


def checkpoint_config(path: str | Path) -> dict[str, Any]:
    """The checkpoint's ``config.json`` (beside a file, or in a directory), or ``{}`` when it has none."""
    p = Path(path)
    cfg = (p if p.is_dir() else p.parent) / "config.json"
    if not cfg.is_file():
        return {}
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise WcvizError(f"{cfg}: not readable JSON ({e})") from None
    return data if isinstance(data, dict) else {}


_CONFIG_DTYPES = {"half": "float16", "float16": "float16", "float": "float32", "float32": "float32", "bfloat16": "bfloat16"}


def _engine_dtype(
    config: Mapping[str, Any], dtype: str | None, engine: str = "vllm", checkpoint: Any = None
) -> str | None:
    """What the engine serves: ``dtype`` as given, or what ``auto`` resolves to in ``engine``.

    vLLM (``transformers_utils/model_arch_config_convertor.py:201-239``, then
    ``config/model.py:2423-2464``): config.json's dtype, else the common dtype of the
    checkpoint's tensors, else float32; float32, or a dtype the GPU lacks, is served
    as bfloat16 - on an Ampere-or-newer GPU. Before Ampere vLLM serves float16
    instead, which wcviz cannot see from here: give ``dtype`` there. SGLang
    (``configs/model_config.py:2284-2321``): config.json's dtype; float32, or none,
    is served as float16. With no config.json at hand (``config`` empty: a state
    dict), the checkpoint's tensors stand in for the engine's config dtype.
    """
    if dtype not in (None, "auto"):
        return dtype
    if engine == "sglang":
        said = config.get("dtype") or config.get("torch_dtype")
        if not config and checkpoint is not None:
            said = _common_dtype(_tensor_dtypes(checkpoint))
        said = _CONFIG_DTYPES.get(said) if isinstance(said, str) else None
        return "float16" if said in (None, "float32") else said
    said = config.get("torch_dtype") or config.get("dtype")
    if isinstance(said, str):
        said = _CONFIG_DTYPES.get(said, said)
    elif checkpoint is not None:
        said = _common_dtype(_tensor_dtypes(checkpoint))
    return said if said in ("bfloat16", "float16") else "bfloat16"  # supported_dtypes[0] on sm >= 80: bfloat16


def _tensor_dtypes(checkpoint: Any) -> set[Any]:
    """The torch dtypes of a state dict's tensors, or of a safetensors checkpoint's (read off the headers)."""
    import torch

    if isinstance(checkpoint, Mapping):
        return {t.dtype for t in checkpoint.values() if isinstance(t, torch.Tensor)}
    from wcviz.sources import checkpoint_files, read_header

    names = {e.dtype for f in checkpoint_files(checkpoint) for e in read_header(f)}
    found = {getattr(torch, n, None) for n in names}
    return {d for d in found if isinstance(d, torch.dtype)}


def _common_dtype(dtypes: set[Any]) -> str | None:
    """vLLM's ``common_broadcastable_dtype`` (``utils/torch_utils.py:352-396``): the dtype the most others cast
    to without loss; None for no dtypes."""
    import torch

    def level(d: torch.dtype) -> int:  # bool 0, int 1, float 2, complex 3
        return int(d != torch.bool) + int(d.is_floating_point) + 2 * int(d.is_complex)

    def lossless(src: torch.dtype, tgt: torch.dtype) -> bool:
        if src == tgt or level(src) != level(tgt):
            return src == tgt or level(src) < level(tgt)
        s, t = (torch.iinfo(src), torch.iinfo(tgt)) if level(src) == 1 else (torch.finfo(src), torch.finfo(tgt))
        return s.min >= t.min and s.max <= t.max and (level(src) == 1 or s.resolution >= t.resolution)  # type: ignore[union-attr]

    if not dtypes:
        return None
    best = max(sorted(dtypes, key=str), key=lambda d: sum(lossless(x, d) for x in dtypes))
    return str(best).removeprefix("torch.")


def _which_engine(url: str, net: Mapping[str, Any]) -> str | None:
    """``vllm`` when ``/get_world_size`` answers (dev mode), ``sglang`` when the server answers otherwise, None
    when nothing answers at all (which engine it is cannot be told then; every rank is unreachable either way)."""
    from wcviz.sources import EngineEndpointError, vllm_version, vllm_world_size

    opts: dict[str, Any] = {
        "token": net.get("token"), "client": net.get("client"), "transport": net.get("transport"),
        "timeout_s": min(float(net.get("timeout_s", 30)), 30.0),
    }  # fmt: skip
    try:
        vllm_world_size(url, **opts)
        return "vllm"
    except EngineEndpointError as e:
        if e.kind == "unreachable":
            return None
        if vllm_version(url, **opts) is not None:  # a vLLM without dev mode (404) or refusing the token: its error says what to do
            raise
    return "sglang"


def verify_engine(
    url: str,
    checkpoint: str | Path | Mapping[str, Any],
    *,
    tp: int,
    pp: int = 1,
    dp: int = 1,
    ep: int = 1,
    family: str | None = None,
    engine: str = "auto",
    heads: int | None = None,
    kv_heads: int | None = None,
    dtype: str | None = "auto",
    vocab_padding: int = 64,
    tie_embeddings: bool | None = None,
    token: str | None = None,
    algo: str | None = None,
    timeout_s: float = 120.0,
    client: Any = None,
    transport: Any = None,
    **layout: Any,
) -> LiveReport:
    """Compare what a running vLLM or SGLang holds, rank by rank, with ``checkpoint`` cut for ``tp``/``pp``/``dp``/``ep``.

    ``checkpoint``: a safetensors file or directory (its ``config.json`` gives ``family``,
    ``heads``, ``kv_heads``, ``tie_embeddings`` and the served ``dtype`` unless given) or
    a state dict. ``engine``: ``vllm`` (its ``/weight_checker``, dev mode), ``sglang``
    (``/weights_checker``, ``token`` = its admin key) or ``auto``; the expected shards are
    cut as that engine lays them out. ``dtype="auto"`` is what that engine serves for
    ``--dtype auto`` (:func:`_engine_dtype`; on a vLLM older than Ampere GPUs give it).
    ``algo``: the engine's checksum (default: ``vllm-sha256`` for vLLM, ``sglang-gpu`` for
    SGLang); give ``sglang-cpu`` for an SGLang whose weights live on the CPU (a CPU engine:
    SGLang hashes a CPU tensor with SHA-256, ``mm_utils.py`` ``tensor_hash``). ``layout``:
    more options of :func:`wcviz.layouts.expected_frame`. Read-only.
    """
    import torch

    from wcviz.layouts import detect_family, expected_frame
    from wcviz.sources import from_sglang, from_vllm_weight_checker
    from wcviz.verdicts import compare, worst_first

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if algo is not None:
        _engine_algo(engine, algo)  # before asking the engine anything
    net: dict[str, Any] = {"token": token, "timeout_s": timeout_s, "client": client, "transport": transport}
    config = checkpoint_config(checkpoint) if isinstance(checkpoint, (str, Path)) else {}
    if family is None:
        family = _FAMILY.get(str(config.get("model_type", "")))
    if family is None:
        from wcviz.layouts import checkpoint_weights

        names = checkpoint_weights(checkpoint) if isinstance(checkpoint, (str, Path)) else checkpoint
        family = detect_family(list(names))
    heads = heads if heads is not None else config.get("num_attention_heads")
    if kv_heads is None:  # absent or null in config.json: as many as the attention heads, as transformers reads it
        kv_heads = config.get("num_key_value_heads") if config.get("num_key_value_heads") is not None else heads
    if not isinstance(heads, int) or isinstance(heads, bool):
        if not config or config.get("num_attention_heads") is None:
            raise WcvizError("the checkpoint has no config.json with num_attention_heads: give heads= (and kv_heads=)")
        raise WcvizError(f"config.json gives num_attention_heads={heads!r}, not a whole number of heads: give heads= (and kv_heads=)")
    if not isinstance(kv_heads, int) or isinstance(kv_heads, bool):
        raise WcvizError(f"config.json gives num_key_value_heads={kv_heads!r}, not a whole number: give kv_heads=")
    if tie_embeddings is None and isinstance(config.get("tie_word_embeddings"), bool):
        tie_embeddings = config["tie_word_embeddings"]
    dtypes = {n: v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}  # no getattr: no torch warnings
    if dtype not in (None, "auto") and dtype not in dtypes:
        raise WcvizError(f"the served dtype {dtype!r} (--dtype) is not a torch dtype")
    found = _which_engine(url, net) if engine == "auto" else engine
    # nothing answered: vLLM's fetch (SGLang's, if an SGLang algo was given) reports each rank unreachable, with the error
    which = found or ("sglang" if algo in _ALGOS["sglang"] else "vllm")
    label = found or "the engine (vllm or sglang: it did not answer)"
    algo = _ALGO[which] if algo is None else _engine_algo(which, algo)
    served = _engine_dtype(config, dtype, which, checkpoint)  # --dtype as given, else one the engine serves
    expected = expected_frame(
        checkpoint, family, tp=tp, pp=pp, dp=dp, ep=ep, heads=heads, kv_heads=kv_heads, vocab_padding=vocab_padding,
        tie_embeddings=tie_embeddings, dtype=dtypes[served] if served else None, algo=algo, engine=which, **layout,
    )  # fmt: skip
    if which == "vllm":
        fetched = from_vllm_weight_checker(url, **net)
        actual = fetched.frame
    else:
        fetched = from_sglang(url, algo=algo, **net)
        drafts = tuple({f"{r}." for info in fetched.infos.values() for r in info.get("roles", []) if r != "target"})
        actual = fetched.frame[~fetched.frame["name"].str.startswith(drafts)] if drafts else fetched.frame
    verdicts = compare(_by_place(expected), _by_place(actual))
    verdicts = worst_first(_ranked(_unreachable(verdicts, fetched.failed, actual), expected))
    assumed = {"family": family, "tp": tp, "pp": pp, "dp": dp, "ep": ep, "heads": heads, "kv_heads": kv_heads,
               "dtype": served or "as in the checkpoint", "vocab_padding": vocab_padding,
               "algo": algo if found else f"{algo} (the engine did not answer: {'SGLang' if which == 'sglang' else 'vLLM'}'s checksum assumed)"}  # fmt: skip
    return LiveReport(label, str(url).rstrip("/"), verdicts, fetched, expected, assumed)


def _by_place(frame: pd.DataFrame) -> pd.DataFrame:
    """A frame keyed by the rank's place (dp, pp, tp): ``rank`` and ``ep`` set aside, ``role`` one value."""
    out = frame.drop(columns=[c for c in ("url",) if c in frame]).copy()
    for c in ("rank", "ep"):
        out[c] = pd.Series(pd.NA, index=out.index, dtype="Int64")
    out["role"] = "engine"
    return out


def _ranked(verdicts: pd.DataFrame, expected: pd.DataFrame) -> pd.DataFrame:
    """Each verdict's ``rank`` as the layout numbers it (vLLM's global numbering), from its place (dp, pp, tp)."""
    places = expected[["dp", "pp", "tp", "rank"]].drop_duplicates(["dp", "pp", "tp"])
    out = verdicts.drop(columns="rank").merge(places, on=["dp", "pp", "tp"], how="left")
    return out[list(verdicts.columns)]


def _unreachable(verdicts: pd.DataFrame, failed: pd.DataFrame, actual: pd.DataFrame) -> pd.DataFrame:
    """Expected rows of a rank that did not answer are ``unreachable``, not ``missing``. A failure of the whole
    engine (no coordinates: an HTTP 500, a failing DP scheduler) silences every rank that gave no rows."""
    if not len(failed):
        return verdicts
    silent_rows = failed[failed["kind"] != "empty"]
    where = ["dp", "pp", "tp"]
    silent = silent_rows[where].dropna().drop_duplicates()
    if bool(silent_rows[where].isna().all(axis=1).any()):
        answered = actual[where].drop_duplicates() if len(actual) else pd.DataFrame(columns=where)
        ranks = verdicts[where].dropna().drop_duplicates()
        gave_nothing = ranks.merge(answered.astype(ranks.dtypes.to_dict()), on=where, how="left", indicator=True)
        silent = pd.concat([silent, gave_nothing[gave_nothing["_merge"] == "left_only"][where]]).drop_duplicates()
    if len(silent) and len(actual):  # a place that gave rows answered: its missing rows stay missing (two ranks may
        # share a place, differing only in a coordinate the verdicts do not carry: vLLM's pcp)
        gave = actual[where].dropna().drop_duplicates().astype(silent.dtypes.to_dict()).assign(_gave=True)
        silent = silent[silent.merge(gave, on=where, how="left")["_gave"].isna().to_numpy()]
    if not len(silent):
        return verdicts
    hit = verdicts[["dp", "pp", "tp"]].merge(silent.assign(_silent=True), on=["dp", "pp", "tp"], how="left")["_silent"]
    on_silent = pd.Series(hit.notna().to_numpy(), index=verdicts.index) & (verdicts["status"] == "missing")
    out = verdicts.copy()
    out.loc[on_silent, "status"] = "unreachable"
    return out

