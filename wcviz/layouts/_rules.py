"""The vocabulary layout rules are written in: :class:`Rule`, :class:`Family` and the split kinds.

A rule says which Hugging Face tensors an engine parameter is built from, and how
one rank's piece is cut out of them. It is data: nothing here touches a tensor.
Names are templates: ``{L}`` stands for a layer index, ``{E}`` for an expert index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wcviz._errors import WcvizError

__all__ = [
    "ENGINE",
    "ENGINES",
    "KINDS",
    "NAMES",
    "STAGES",
    "TIED_NAMES",
    "W13_ORDERS",
    "Family",
    "LayoutError",
    "Rule",
    "Variant",
]

ENGINE = "vllm 0.33.0"  # the engine version the vLLM families' rules were checked against
# Which engine lays the weights out (option ``engine``). The rules are vLLM's; a family's Variant says what
# another engine builds differently, and the topology, vocabulary and FusedMoE differences are here by engine.
ENGINES = {
    "vllm": "vLLM 0.33.0 (the default): the rules as written",
    "sglang": (
        "SGLang 0.5.23: pipeline leftovers to the last stages, a vocabulary tp does not divide padded to 64 * tp, "
        "each family's Variant, FusedMoE under .experts. sliced over tp / ep within each DP replica"
    ),
}

# How one rank's piece of an engine parameter is cut from its sources (vLLM's layer class in brackets).
KINDS = {
    "replicated": "the source, whole, on every rank [ReplicatedLinear, RMSNorm, a RowParallelLinear bias]",
    "column": "dim 0 split into tp equal parts [ColumnParallelLinear]",
    "row": "dim 1 split into tp equal parts [RowParallelLinear]",
    "vocab": "dim 0 zero-padded to a multiple of vocab_padding, then split into tp parts [VocabParallelEmbedding, ParallelLMHead]",
    "qkv": "q split by heads, k and v by kv heads (a kv head replicated over tp // kv_heads ranks), concatenated [QKVParallelLinear]",
    "merged_column": "each source split along dim 0, then concatenated [MergedColumnParallelLinear]",
    "moe_w13": "per local expert: [w1 ; w3] each split along dim 0, stacked over experts [FusedMoE w13_weight]",
    "moe_w2": "per local expert: w2 split along dim 1, stacked over experts [FusedMoE w2_weight]",
}
# Which engine names to use (option ``names``): a family's rules name parameters as the newer vLLM does.
NAMES = {
    "vllm>=0.25": "the names in the rules (vLLM with the MoERunner refactor, PR #41184: FusedMoE weights under .routed_experts.)",
    "vllm<0.25": "the names before that refactor (each family's legacy_names: FusedMoE weights directly under .experts.)",
}
# How a tied head is listed (option ``tied_names``): vLLM's named_parameters() yields a shared tensor once.
TIED_NAMES = {
    "once": "the embedding's name only, as vLLM's /weight_checker (named_parameters()) lists it",
    "both": "the head's name too, the same tensor, on the ranks holding the head (named_parameters(remove_duplicate=False))",
}
# How FusedMoE w13 is ordered per expert (option ``moe_w13_order``).
W13_ORDERS = {
    "w1w3": "[w1 ; w3], gate over up, as FusedMoE loads it (vLLM's default Triton backend)",
    "w3w1": "[w3 ; w1], as vLLM's FlashInfer CUTLASS backend swaps it after loading (swap_w13_to_w31)",
}
# Which pipeline stages hold a parameter: the one owning its layer, the first, the last, or every stage.
STAGES = ("layer", "first", "last", "every")
# With pp > 1, what the last stage holds of a tied head (Variant.tied_last).
TIED_LAST = ("embedding", "head", "nothing")
_STACKED_OVER_EXPERTS = ("moe_w13", "moe_w2")
_ARITY = {"qkv": (3,), "moe_w13": (2,), "merged_column": range(2, 9)}  # how many sources a kind fuses; others take 1


class LayoutError(WcvizError, ValueError):
    """Weights, a topology or a family's rules that do not fit together; the message names what."""


@dataclass(frozen=True)
class Rule:
    """One engine parameter: its name, the HF tensors it is made of (in order), and how it splits.

    ``engine`` and ``sources`` may hold ``{L}`` (layer) and ``{E}`` (expert). The
    FusedMoE kinds stack experts: ``{E}`` is in their sources only, and one engine
    parameter per layer holds the rank's experts. Elsewhere both sides carry the
    same placeholders. ``stage`` defaults to ``layer`` for names with ``{L}``;
    other parameters must say ``first`` or ``last``. An ``optional`` rule may be
    absent from a checkpoint as a whole (a tied head); if any of its tensors is
    present, all of them must be.
    """

    engine: str
    sources: tuple[str, ...]
    kind: str
    stage: str = ""
    optional: bool = False
    placeholders: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LayoutError(f"rule {self.engine}: unknown kind {self.kind!r}; kinds: {', '.join(KINDS)}")
        if not self.sources or isinstance(self.sources, str):
            raise LayoutError(f"rule {self.engine}: sources must be a non-empty tuple of names")
        n = len(self.sources)
        if n not in _ARITY.get(self.kind, (1,)):
            raise LayoutError(f"rule {self.engine}: kind {self.kind} cannot fuse {n} source(s)")
        engine = _placeholders(self.engine)
        if self.stacks_experts and "E" in engine:
            raise LayoutError(f"rule {self.engine}: a {self.kind} parameter stacks experts, its name has no {{E}}")
        want = engine | {"E"} if self.stacks_experts else engine
        for s in self.sources:
            if _placeholders(s) != want:
                raise LayoutError(f"rule {self.engine}: source {s} must carry the placeholders {sorted(want)}")
        stage = self.stage or ("layer" if "L" in engine else "")
        if stage not in STAGES or (stage == "layer") != ("L" in engine):
            raise LayoutError(
                f"rule {self.engine}: stage must be 'layer' for a name with {{L}}, else 'first', 'last' or 'every'"
            )
        object.__setattr__(self, "stage", stage)
        object.__setattr__(self, "placeholders", engine)

    @property
    def stacks_experts(self) -> bool:
        """True for FusedMoE rules: one engine parameter holds every local expert."""
        return self.kind in _STACKED_OVER_EXPERTS


@dataclass(frozen=True)
class Variant:
    """What one engine builds differently from a family's rules (which are vLLM's), read off its model file.

    ``stages`` moves a parameter that belongs to no layer to another stage on this
    engine (``first``, ``last`` or ``every``). ``dropped`` names parameters the engine
    does not build: their checkpoint tensors are bound as usual, then skipped as the
    engine's loader skips them. ``tied_last``: with pp > 1 and a tied head, the last
    stage holds the ``embedding`` itself (vLLM), a ``head`` of its own loaded from the
    embedding, or ``nothing``.
    """

    stages: tuple[tuple[str, str], ...] = ()
    dropped: tuple[str, ...] = ()
    tied_last: str = "embedding"

    def stage(self, rule: Rule) -> str:
        """Where this engine holds ``rule``'s parameter."""
        return dict(self.stages).get(rule.engine, rule.stage)


@dataclass(frozen=True)
class Family:
    """A model family's rules, plus what a tied embedding changes and which engine they describe.

    When the checkpoint has no tensor for the ``head`` rule (or ``tie_embeddings``
    is given), the head is the embedding: vLLM holds no separate head parameter and
    ignores a head tensor in the checkpoint, and when pp > 1 its last stage holds
    the ``embedding`` parameter as well as the first (vLLM's Llama-family models).
    Checkpoint names containing one of ``skipped`` are not weights (old checkpoints
    saved rotary buffers); vLLM's loader skips them, and so do the rules.

    ``engine`` names the engine (and version) whose names and layout the rules
    describe, read off its source: parameter names change between versions.
    ``legacy_names`` pairs an engine name template of ``rules`` with the name an
    older vLLM gave the same parameter (see :data:`NAMES`; chosen with
    ``names="vllm<0.25"``); parameters not listed kept their names.
    ``variants`` pairs an engine of :data:`ENGINES` with the :class:`Variant` it
    builds; an engine not listed builds the rules as written.
    """

    name: str
    rules: tuple[Rule, ...]
    doc: str = ""
    head: str = "lm_head.weight"
    embedding: str = "model.embed_tokens.weight"
    skipped: tuple[str, ...] = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
    engine: str = ENGINE
    legacy_names: tuple[tuple[str, str], ...] = ()
    variants: tuple[tuple[str, Variant], ...] = ()

    def __post_init__(self) -> None:
        engines = [r.engine for r in self.rules]
        dup = sorted({e for e in engines if engines.count(e) > 1})
        if dup:
            raise LayoutError(f"family {self.name}: more than one rule for {', '.join(dup)}")
        sources = [s for r in self.rules for s in r.sources]
        dup = sorted({s for s in sources if sources.count(s) > 1})
        if dup:
            raise LayoutError(f"family {self.name}: {', '.join(dup)} feed more than one rule")
        for role, name, stage in (("head", self.head, "last"), ("embedding", self.embedding, "first")):
            rule = self.rule(name)
            if rule.kind != "vocab" or rule.stage != stage:
                raise LayoutError(f"family {self.name}: the {role} {name} must be a vocab rule on the {stage} stage")
        for new, old in self.legacy_names:
            if _placeholders(old) != self.rule(new).placeholders:
                raise LayoutError(f"family {self.name}: legacy name {old} must carry the placeholders of {new}")
        olds = [old for _, old in self.legacy_names]
        if len(set(olds)) < len(olds) or set(olds) & (set(engines) - {new for new, _ in self.legacy_names}):
            raise LayoutError(f"family {self.name}: legacy_names would give two parameters one name")
        for engine, v in self.variants:
            where = f"family {self.name}, engine {engine}"
            if engine not in ENGINES:
                raise LayoutError(f"{where}: not one of {', '.join(ENGINES)}")
            for name, stage in v.stages:
                if self.rule(name).stage == "layer" or stage not in STAGES[1:]:
                    raise LayoutError(f"{where}: {name} can move to 'first', 'last' or 'every', not a layer's stage")
            for name in v.dropped:
                self.rule(name)
            if v.tied_last not in TIED_LAST:
                raise LayoutError(f"{where}: tied_last must be one of {', '.join(TIED_LAST)}")

    def engine_names(self, names: str) -> dict[str, str]:
        """{template in the rules: template to report} under ``names`` (one of :data:`NAMES`); renamed ones only."""
        if names not in NAMES:
            raise LayoutError(f"names={names!r} is not known; choose one of: {', '.join(NAMES)}")
        return dict(self.legacy_names) if names == "vllm<0.25" else {}

    def variant(self, engine: str) -> Variant:
        """What ``engine`` (one of :data:`ENGINES`) builds differently from the rules."""
        if engine not in ENGINES:
            raise LayoutError(f"engine={engine!r} is not known; choose one of: {', '.join(ENGINES)}")
        return dict(self.variants).get(engine, Variant())

    def rule(self, engine: str) -> Rule:
        """The rule that makes engine parameter ``engine`` (a template name)."""
        for r in self.rules:
            if r.engine == engine:
                return r
        raise LayoutError(f"family {self.name} has no rule for {engine}")


def _placeholders(template: str) -> frozenset[str]:
    return frozenset(p for p in ("L", "E") if "{" + p + "}" in template)
