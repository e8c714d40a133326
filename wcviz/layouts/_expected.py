"""Expected shards: what every engine rank should hold, from full weights and a family's rules.

Binding (:func:`bind`) matches the checkpoint's names to the family's rules and
checks that every tensor is used and every rule complete; :func:`expected_shards`
then walks the ranks in vLLM's order and cuts each parameter with
:mod:`wcviz.layouts._split`, as the chosen engine (:data:`ENGINES`) holds it. It
never imports the simulated engine: the sim's loader and these rules are written
apart so that one cannot hide the other's bug.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wcviz._errors import CheckpointError
from wcviz._text import listing
from wcviz.layouts._rules import ENGINES, NAMES, TIED_NAMES, W13_ORDERS, Family, LayoutError, Rule, Variant
from wcviz.layouts._split import SPLITS, Cut, padded_vocab
from wcviz.layouts._topology import Coords, expert_block, moe_place, rank_coords, stage_layers
from wcviz.layouts.llama import LLAMA, MISTRAL
from wcviz.layouts.mixtral import MIXTRAL
from wcviz.layouts.qwen2 import QWEN2
from wcviz.layouts.sim_moe import SIM_MOE

if TYPE_CHECKING:
    import pandas as pd
    import torch

__all__ = [
    "FAMILIES",
    "Binding",
    "Param",
    "bind",
    "checkpoint_weights",
    "detect_family",
    "expected_frame",
    "expected_shards",
    "get_family",
]

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, MISTRAL, QWEN2, MIXTRAL, SIM_MOE)}
_SHOWN = 5  # names an error lists before "+N more"


def get_family(family: str | Family) -> Family:
    """A family by name (``llama``, ``mistral``, ``qwen2``, ``mixtral``, ``sim-moe``) or as given."""
    if isinstance(family, Family):
        return family
    if family in FAMILIES:
        return FAMILIES[family]
    raise LayoutError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")


@dataclass(frozen=True)
class Param:
    """One engine parameter a rule makes: its name, layer, and the HF names it is cut from.

    ``sources`` holds one tuple of names, or for the FusedMoE kinds one per expert.
    """

    rule: Rule
    name: str
    layer: int | None
    sources: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Binding:
    """A family's rules bound to one checkpoint's names."""

    family: Family
    layers: int
    experts: int
    tied: bool
    params: tuple[Param, ...]  # in vLLM's order: embedding, layer by layer, final norm and head
    ignored: tuple[str, ...]  # checkpoint tensors vLLM skips (rotary buffers, a tied model's head)


def _regex(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)"))


def bind(names: Iterable[str], family: str | Family, *, tie_embeddings: bool | None = None) -> Binding:
    """Match checkpoint ``names`` to ``family``'s rules; LayoutError names any tensor left over or missing.

    The layer and expert counts are read off the names. ``tie_embeddings=None``
    infers a tied head from the head's absence.
    """
    fam = get_family(family)
    names = list(names)
    patterns = [(rule, _regex(s)) for rule in fam.rules for s in rule.sources]
    hit: set[Rule] = set()
    uncovered: list[str] = []
    layers = experts = 0
    skipped = []
    for name in names:
        if any(k in name for k in fam.skipped):
            skipped.append(name)
            continue
        found = [(rule, m) for rule, rx in patterns if (m := rx.fullmatch(name))]
        if not found:
            uncovered.append(name)
            continue
        if len(found) > 1:
            raise LayoutError(
                f"family {fam.name}: rules {found[0][0].engine} and {found[1][0].engine} both claim {name}"
            )
        rule, m = found[0]
        hit.add(rule)
        groups = m.groupdict()
        layers = max(layers, int(groups.get("L") or -1) + 1)
        experts = max(experts, int(groups.get("E") or -1) + 1)
    if uncovered:
        raise LayoutError(f"family {fam.name} has no rule for {len(uncovered)} tensor(s): {listing(uncovered, _SHOWN)}")

    head = fam.rule(fam.head)
    tied = head not in hit if tie_embeddings is None else bool(tie_embeddings)
    ignored = skipped + [n for n in names if tied and any(_regex(s).fullmatch(n) for s in head.sources)]
    present = set(names)
    missing: list[str] = []
    first = [r for r in fam.rules if r.stage in ("first", "every")]  # (every: held by each stage, placed in _rank)
    per_layer = [r for r in fam.rules if r.stage == "layer"]
    last = [r for r in fam.rules if r.stage == "last" and not (tied and r is head)]
    params: list[Param] = []

    def add(rule: Rule, layer: int | None) -> None:
        if rule not in hit and rule.optional and rule is not head:  # an untied model needs its head
            return
        for e in range(experts or 1) if "E" in rule.placeholders else [None]:
            expert_range = range(experts or 1) if rule.stacks_experts else [e]
            srcs = tuple(tuple(s.format(L=layer, E=x) for s in rule.sources) for x in expert_range)
            missing.extend(
                f"{n} (for {rule.engine.format(L=layer, E=e)})" for group in srcs for n in group if n not in present
            )
            params.append(Param(rule, rule.engine.format(L=layer, E=e), layer, srcs))

    for rule in first:
        add(rule, None)
    for layer in range(layers):
        for rule in per_layer:
            add(rule, layer)
    for rule in last:
        add(rule, None)
    if missing:
        raise LayoutError(f"family {fam.name}: the weights lack {len(missing)} tensor(s): {listing(missing, _SHOWN)}")
    return Binding(fam, layers, experts, tied, tuple(params), tuple(ignored))


def detect_family(names: Iterable[str]) -> str:
    """The most specific family whose rules fit ``names`` exactly: the one needing fewest optional rules.

    A Qwen2 checkpoint (q/k/v biases, no ``o_proj`` bias) also fits Llama, whose
    biases are optional; Qwen2 requires them, so it reads as ``qwen2``; a Llama
    with ``attention_bias`` (an ``o_proj`` bias too) fits only ``llama``. A Llama
    with ``qkv_bias`` alone reads as ``qwen2``, whose layout is the same. Ties go
    to the first in :data:`FAMILIES` order: Llama and Mistral checkpoints have
    the same names (and layouts) and read as ``llama``. When none fits, the
    error says why for each.
    """
    names = list(names)
    why = []
    fits: list[tuple[int, str]] = []
    for fam in FAMILIES.values():
        try:
            b = bind(names, fam)
        except LayoutError as e:
            why.append(str(e))
            continue
        fits.append((len({p.rule for p in b.params if p.rule.optional and p.rule.engine != fam.head}), fam.name))
    if fits:
        return min(fits, key=lambda fit: fit[0])[1]  # min keeps the first of equals
    raise LayoutError("no known family fits these weights:\n  " + "\n  ".join(why))


@dataclass(frozen=True)
class _Plan:
    """Bound rules and a checked topology: everything a rank's shard depends on."""

    binding: Binding
    tp: int
    pp: int
    dp: int
    ep: int
    heads: int
    kv_heads: int
    vocab_padding: int
    dtype: Any
    tied_names: str = "once"
    moe_w13_order: str = "w1w3"
    renamed: Mapping[str, str] = field(default_factory=dict)  # engine name -> the name reported under ``names``
    engine: str = "vllm"
    variant: Variant = field(default_factory=Variant)  # what ``engine`` builds differently from the family's rules


def _names(engine: str, names: str | None) -> str:
    """The ``names`` option as ``engine`` reports parameters: vLLM's by version, SGLang's its own."""
    if engine == "sglang":
        if names is not None:
            raise LayoutError(
                f"names={names!r} chooses between vLLM versions' names; engine='sglang' has its own "
                "(FusedMoE weights directly under .experts.): leave names unset"
            )
        return "vllm<0.25"  # SGLang's make_expert_params_mapping (fused_moe_triton/layer.py:1797-1822): experts.w13_
    return "vllm>=0.25" if names is None else names


def _rows(weights: Mapping[str, Any], name: str) -> int:
    """dim 0 of tensor ``name``, read off a checkpoint's header rather than its bytes where it can be."""
    return weights.rows(name) if isinstance(weights, _Checkpoint) else int(weights[name].shape[0])


def _plan(
    weights: Mapping[str, Any],
    family: str | Family,
    tie_embeddings: bool | None,
    dtype: Any,
    options: Mapping[str, Any],
    **sizes: int,
) -> _Plan:
    """Bind ``family`` to ``weights`` and check the topology against it, naming the first thing that does not fit."""
    for label, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise LayoutError(f"{label} must be a positive int, got {v!r}")
    if options["engine"] not in ENGINES:
        raise LayoutError(f"engine={options['engine']!r} is not known; choose one of: {', '.join(ENGINES)}")
    engine, names = options["engine"], _names(options["engine"], options["names"])
    for label, known, value in (
        ("tied_names", TIED_NAMES, options["tied_names"]),
        ("moe_w13_order", W13_ORDERS, options["moe_w13_order"]),
        ("names", NAMES, names),
    ):
        if value not in known:
            raise LayoutError(f"{label}={value!r} is not known; choose one of: {', '.join(known)}")
    b = bind(weights.keys(), family, tie_embeddings=tie_embeddings)
    legacy = b.family.engine_names(names)
    renamed = {}
    for param in b.params:
        if param.rule.engine in legacy:
            m = _regex(param.rule.engine).fullmatch(param.name)
            assert m is not None  # the name was made from this template
            renamed[param.name] = legacy[param.rule.engine].format(**m.groupdict())
    p = _Plan(
        b,
        dtype=dtype,
        tied_names=options["tied_names"],
        moe_w13_order=options["moe_w13_order"],
        renamed=renamed,
        engine=engine,
        variant=b.family.variant(engine),
        **sizes,
    )
    if p.heads % p.kv_heads:
        raise LayoutError(f"heads ({p.heads}) must be a multiple of kv_heads ({p.kv_heads})")
    if p.heads % p.tp:
        raise LayoutError(f"heads ({p.heads}) do not divide by tp={p.tp}")
    if p.kv_heads % p.tp and p.tp % p.kv_heads:
        raise LayoutError(f"tp={p.tp} must divide kv_heads ({p.kv_heads}) or be a multiple of it")
    if p.pp > b.layers:
        raise LayoutError(f"pp={p.pp} exceeds the {b.layers} layers: a stage would hold none")
    if p.ep > 1:
        if not any(param.rule.stacks_experts for param in b.params):
            raise LayoutError(f"ep={p.ep}: family {b.family.name} has no FusedMoE experts to place")
        if engine == "vllm" and p.ep != p.tp * p.dp:
            raise LayoutError(
                f"ep={p.ep}: vLLM's expert parallelism spans every TP x DP rank: ep must be 1 or tp*dp = {p.tp * p.dp}"
            )
        if engine == "sglang" and (p.tp % p.ep or b.experts % p.ep):  # fused_moe_triton/layer.py:414 asserts
            raise LayoutError(
                f"ep={p.ep}: SGLang's expert parallelism splits each replica's tp={p.tp} ranks into ep groups of "
                f"whole experts: ep must divide tp and the {b.experts} experts"
            )
    for param in b.params:  # vLLM refuses a vocabulary tp does not divide: say so now, not at the first shard
        if param.rule.kind == "vocab":
            padded_vocab(_rows(weights, param.sources[0][0]), p.vocab_padding, p.tp, engine)
    return p


def expected_shards(
    weights: Mapping[str, torch.Tensor] | str | Path,
    family: str | Family,
    *,
    tp: int,
    pp: int = 1,
    dp: int = 1,
    ep: int = 1,
    heads: int,
    kv_heads: int,
    vocab_padding: int = 64,
    tie_embeddings: bool | None = None,
    dtype: torch.dtype | None = None,
    engine: str = "vllm",
    names: str | None = None,
    tied_names: str = "once",
    moe_w13_order: str = "w1w3",
) -> Iterator[tuple[Coords, str, torch.Tensor]]:
    """(coords, engine name, tensor) for every parameter of every engine rank, in rank order.

    ``weights`` are full Hugging Face tensors (a state dict, or the path of a
    safetensors checkpoint, read lazily). ``coords`` holds ``rank``, ``dp``, ``pp``,
    ``tp`` and ``ep`` (the EP rank, None unless ``ep > 1``). ``engine``
    (:data:`~wcviz.layouts.ENGINES`) is whose layout: ``"vllm"`` (the rules as
    written) or ``"sglang"`` (its stage split, vocabulary padding, FusedMoE and
    each family's :class:`~wcviz.layouts.Variant`). vLLM spreads FusedMoE experts
    over the ``tp * dp`` ranks of a stage (``ep`` must be 1 or ``tp * dp``):
    sliced, or as blocks of whole experts under expert parallelism (ranks beyond
    the experts hold empty [0, ...] tensors); SGLang over the ``tp`` ranks of each
    DP replica, ``ep`` dividing ``tp`` and the experts.
    ``vocab_padding`` is the engines' ``DEFAULT_VOCAB_PADDING_SIZE`` (64): the
    vocabulary is padded to a multiple of it before the TP split; where tp does not
    divide that, SGLang pads to a multiple of ``vocab_padding * tp`` and vLLM cannot
    start (a LayoutError). The simulated engine pads to a multiple of ``tp`` only:
    compare it with ``vocab_padding=1``. ``dtype`` is the engine's parameter dtype
    when it differs from the weights'.

    ``names`` picks vLLM's parameter names by version
    (:data:`~wcviz.layouts.NAMES`): ``"vllm>=0.25"`` (the default) as the rules name them
    (Mixtral's ``experts.routed_experts.w13_weight``), ``"vllm<0.25"`` before the
    MoERunner refactor (``experts.w13_weight``); SGLang has its own (the latter),
    so leave it unset there. ``tied_names`` says how a tied
    head is listed: ``"once"`` as vLLM's ``/weight_checker`` and wcviz's
    worker extension do (``named_parameters()``: the embedding's name only), ``"both"``
    as ``named_parameters(remove_duplicate=False)`` does (:func:`wcviz.sources.from_module`):
    ``lm_head.weight`` too, the same tensor, where the head is the embedding.
    ``moe_w13_order="w3w1"`` gives FusedMoE ``w13_weight`` as vLLM's FlashInfer
    CUTLASS backend holds it, each expert's halves swapped. Errors are
    :class:`LayoutError` and name the tensor, dim, size or option that does not fit.
    """
    weights = checkpoint_weights(weights) if isinstance(weights, (str, Path)) else weights
    sizes = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "heads": heads, "kv_heads": kv_heads, "vocab_padding": vocab_padding}
    options = {"engine": engine, "names": names, "tied_names": tied_names, "moe_w13_order": moe_w13_order}
    plan = _plan(weights, family, tie_embeddings, dtype, options, **sizes)  # errors now, not at the first next()
    ranks = rank_coords(tp, pp, dp, ep, plan.engine)
    return ((coords, name, t) for coords in ranks for name, t in _rank(weights, plan, coords))


def _rank(weights: Mapping[str, torch.Tensor], plan: _Plan, coords: Coords) -> list[tuple[str, torch.Tensor]]:
    """One rank's parameters, cut from ``weights`` as ``plan.engine`` holds them."""
    b, v, stage, last = plan.binding, plan.variant, coords["pp"], plan.pp - 1
    own = stage_layers(b.layers, plan.pp, plan.engine)[stage]
    moe = moe_place(coords, plan.tp, plan.dp, plan.ep, plan.engine)
    experts = expert_block(b.experts, moe.ep_rank, plan.ep) if moe.ep_rank is not None else range(b.experts)
    cut = Cut(
        coords["tp"], plan.tp, plan.heads, plan.kv_heads, plan.vocab_padding, moe.moe_tp, moe.moe_tp_size,
        plan.moe_w13_order, plan.engine,
    )  # fmt: skip
    held = {"first": stage == 0, "last": stage == last, "every": True}
    tied_here = b.tied and stage == last  # with a tied head, what the last stage holds: Variant.tied_last
    out = []
    for p in b.params:
        where = v.stage(p.rule)
        on = p.layer in own if where == "layer" else held[where]
        if tied_here and p.name == b.family.embedding and v.tied_last == "embedding":
            on = True  # vLLM: a tied head is the embedding, and the last stage holds it too
        if not on or p.rule.engine in v.dropped:
            continue
        if p.rule.stacks_experts:
            # an EP rank beyond the experts holds none: cut one anyway for the trailing dims and dtype, keep [0, ...]
            local = experts or range(1)
            src: Any = [tuple(weights[n] for n in p.sources[e]) for e in local]
        else:
            src = [weights[n] for n in p.sources[0]]
        t = SPLITS[p.rule.kind](src, cut, p.name)
        if p.rule.stacks_experts and not experts:
            t = t[:0]
        out.append((plan.renamed.get(p.name, p.name), (t if plan.dtype is None else t.to(plan.dtype)).contiguous()))
    if tied_here and stage > 0 and v.tied_last == "head":  # a head of its own, loaded from the embedding (SGLang Qwen2)
        embedding = b.family.rule(b.family.embedding)
        t = SPLITS["vocab"]([weights[embedding.sources[0]]], cut, b.family.head)
        out.append((b.family.head, (t if plan.dtype is None else t.to(plan.dtype)).contiguous()))
    head_here = held[v.stage(b.family.rule(b.family.head))]
    if b.tied and plan.tied_names == "both" and head_here:  # the head is the embedding's tensor, under its name
        out += [(b.family.head, t) for n, t in out if n == b.family.embedding]
    return out


def expected_frame(
    weights: Mapping[str, torch.Tensor] | str | Path,
    family: str | Family,
    *,
    tp: int,
    pp: int = 1,
    dp: int = 1,
    ep: int = 1,
    heads: int,
    kv_heads: int,
    vocab_padding: int = 64,
    tie_embeddings: bool | None = None,
    dtype: torch.dtype | None = None,
    engine: str = "vllm",
    names: str | None = None,
    tied_names: str = "once",
    moe_w13_order: str = "w1w3",
    algo: str | None = None,
    backend: str = "auto",
    role: str = "engine",
    **rank_info: Any,
) -> pd.DataFrame:
    """The digest table every engine rank should report, ready for :func:`wcviz.compare`.

    Arguments as :func:`expected_shards`; rows carry ``rank``, ``dp``, ``pp``,
    ``tp`` (and ``ep`` when ``ep > 1``) as the engine's agents report them;
    ``rank_info`` (``host``, ``phase``, ``step``) is stamped on every row. A DP
    replica reuses the digests of the replica before it, unless FusedMoE experts
    (which vLLM spreads over DP ranks too) make them differ. ``algo`` is any of
    :data:`wcviz.digest.ALGORITHMS`, the engines' own (``vllm-sha256``,
    ``sglang-cpu``, ``sglang-gpu``) included, so the frame compares with what an
    engine's checker reports.
    """
    from wcviz.digest import DEFAULT_ALGO, digest_timed
    from wcviz.frame import check_rank_info, make_frame, shape_str

    info = check_rank_info({"role": role, **rank_info})
    info.setdefault("phase", "current")
    weights = checkpoint_weights(weights) if isinstance(weights, (str, Path)) else weights
    sizes = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "heads": heads, "kv_heads": kv_heads, "vocab_padding": vocab_padding}
    options = {"engine": engine, "names": names, "tied_names": tied_names, "moe_w13_order": moe_w13_order}
    plan = _plan(weights, family, tie_embeddings, dtype, options, **sizes)
    rows: list[dict[str, Any]] = []
    done: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    # vLLM's FusedMoE differs between DP replicas (SGLang's stays inside each replica)
    moe = plan.engine == "vllm" and any(p.rule.stacks_experts for p in plan.binding.params)
    for coords in rank_coords(tp, pp, dp, ep, plan.engine):
        key = (coords["pp"], coords["tp"], coords["dp"] if moe else None)
        if key not in done:  # one frame for all ranks: building a frame costs more than digesting a small shard
            named = _rank(weights, plan, coords)
            timed = digest_timed(named, algo=algo or DEFAULT_ALGO, backend=backend, progress=False)
            done[key] = [
                {
                    "name": n,
                    "digest": str(timed[n][0]),
                    "algo": timed[n][0].algo,
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": shape_str(t.shape),
                    "nbytes": t.numel() * t.element_size(),
                    "device": str(t.device),
                    "seconds": timed[n][1],
                }
                for n, t in named
            ]
        rows.extend({**row, **info, **coords} for row in done[key])
    return make_frame(rows)


class _Checkpoint(Mapping):
    """A safetensors checkpoint as a read-only name -> tensor mapping that reads a tensor when asked."""

    def __init__(self, path: str | Path) -> None:
        from wcviz.sources import checkpoint_files

        self.path = Path(path)
        self.where: dict[str, Path] = {}
        for f in checkpoint_files(path):
            from safetensors import safe_open

            with safe_open(str(f), "pt") as h:
                for n in h.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    if n in self.where:  # a stale leftover beside the new shards: which is the truth is unknown
                        raise CheckpointError(
                            f"{self.path}: tensor {n!r} is in both {self.where[n].name} and {f.name}; "
                            "remove the stale file (or point at the checkpoint's index)"
                        )
                    self.where[n] = f

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.where[name]), "pt") as h:
            return h.get_tensor(name)

    def rows(self, name: str) -> int:
        """dim 0 of tensor ``name``, from the file's header (the tensor is not read)."""
        from safetensors import safe_open

        with safe_open(str(self.where[name]), "pt") as h:
            return int(h.get_slice(name).get_shape()[0])

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def checkpoint_weights(path: str | Path) -> Mapping[str, torch.Tensor]:
    """A safetensors file or checkpoint directory as a lazy name -> tensor mapping."""
    return _Checkpoint(path)
