"""Inference-engine ranks that hold and load weights the way vLLM (or SGLang) lays them out.

One :class:`EngineShard` is one (tensor-parallel, pipeline-parallel) rank. Its
``params`` carry vLLM's names and shapes: q/k/v (weights and, for Qwen2, biases)
fused into ``qkv_proj`` and gate/up into ``gate_up_proj`` (column-parallel),
``o_proj``/``down_proj`` row-parallel, embedding and head vocabulary-parallel,
norms and the MoE router replicated. Mixtral-style experts are held as vLLM's
FusedMoE holds them: ``experts.w13_weight`` [local experts, 2 * inter / n, hidden]
(w1 over w3) and ``experts.w2_weight`` [local experts, hidden, inter / n], where
FusedMoE spreads over all n = tp * dp ranks of a stage (vLLM shards MoE layers
across data-parallel ranks too); with expert parallelism each of those ranks
holds a contiguous block of whole experts instead of a slice of every expert.
As vLLM 0.33's ``MixtralModel`` does, a Mixtral-style model keeps its embedding,
final norm and head on every pipeline stage. With ``engine="sglang"`` a rank is
held as SGLang 0.5.23 holds it: pipeline leftovers to the last stages, the head on
every stage (Llama, Mixtral) or the last (Qwen2: q/k/v biases; tied and
pipelined, a head of its own loaded from the embedding), and FusedMoE spread
over the TP ranks of each DP replica only.
:meth:`EngineShard.load_weights` narrows and fuses full Hugging Face tensors into
them like the engines' loaders do, with optional :class:`LoaderFaults`:
the loader bugs users report, so that verification has something to catch.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch

from wcviz.sim.model import ModelConfig, parameter_shapes

__all__ = ["ENGINES", "EngineLayout", "EngineShard", "LoaderFaults", "pp_layers", "reassemble"]

ENGINES = ("vllm", "sglang")  # whose layout a shard plays

# vLLM's stacked_params_mapping: (engine param, HF param, shard id).
STACKED = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", "gate"),
    (".gate_up_proj.", ".up_proj.", "up"),
)
# Mixtral's experts.E.w1/w3 (gate, up) fuse into FusedMoE's w13_weight, w2 (down) into w2_weight.
_FUSED_MOE = re.compile(r"^(.+\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
_MOE_IDS = ("w1", "w2", "w3")
_FUSED_IDS = ("q", "k", "v", "gate", "up", "w1", "w3")  # pieces of a fused parameter
_ROW_PARALLEL = ("self_attn.o_proj.weight", "down_proj.weight")
_VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class EngineLayout:
    """How many ranks an engine spreads over; rank = (dp * pp + pp_rank) * tp + tp_rank, as in vLLM."""

    tp: int
    pp: int
    dp: int = 1

    def __post_init__(self) -> None:
        """Every size an integer >= 1 (a bool or 1.5 would make a fractional world or a rank that cannot exist)."""
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            try:
                size = operator.index(value)  # int, numpy ints; never 1.5 or "2"
            except TypeError:
                size = None
            if isinstance(value, bool) or size is None:
                raise ValueError(f"EngineLayout.{name} must be an integer >= 1, got {value!r}")
            if size < 1:
                raise ValueError(f"EngineLayout.{name} must be >= 1, got {value}")
            object.__setattr__(self, name, size)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp, pp, tp) coordinates of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        return rank // (self.pp * self.tp), rank // self.tp % self.pp, rank % self.tp

    def rank(self, dp: int, pp: int, tp: int) -> int:
        """Global rank of coordinates (dp, pp, tp)."""
        return (dp * self.pp + pp) * self.tp + tp

    def check(self, cfg: ModelConfig, engine: str = "vllm") -> None:
        """A ValueError saying what of ``cfg`` this layout cannot split (a TP size that does not divide the heads,
        more stages than layers, ...), for every rank; checked before any rank is started."""
        for r in range(self.world_size):
            dp, pp, tp = self.coords(r)
            _check_layout(cfg, tp, self.tp, pp, self.pp, dp, self.dp, False, engine)


@dataclass(frozen=True)
class LoaderFaults:
    """Loader bugs to inject; regexes are matched (``re.search``) against Hugging Face names.

    skip: matching parameters are silently not loaded.
    fused_from_rank0: the pieces of fused params (q/k/v, gate/up, FusedMoE w1/w3) take
        TP rank 0's slice on every rank.
    stale: load_weights consumes its input and writes nothing.
    cast: matching parameters round-trip through float16 on load.
    flip_bit: one bit (the lowest, of the middle element) is flipped in each matching parameter.
    tp_as: this rank narrows every TP-split weight as if it were TP rank ``tp_as``
        (give two ranks each other's index to swap them: right shapes, wrong ranks);
        expert-parallel experts are not TP-split and load as usual.
    """

    skip: str | None = None
    fused_from_rank0: bool = False
    stale: bool = False
    cast: str | None = None
    flip_bit: str | None = None
    tp_as: int | None = None

    def __str__(self) -> str:
        set_ = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if getattr(self, f.name) not in (None, False)]
        return ", ".join(set_) or "no faults"


def pp_layers(layers: int, pp_rank: int, pp_size: int, engine: str = "vllm") -> range:
    """Layers pipeline stage ``pp_rank`` owns: leftovers to the stages before the last (vLLM) or the last (SGLang)."""
    sizes = [layers // pp_size] * pp_size
    skip = 1 if engine == "vllm" else 0  # vLLM never gives the last stage (it holds the head) an extra layer
    for i in range(layers % pp_size):
        sizes[-1 - skip - i] += 1
    start = sum(sizes[:pp_rank])
    return range(start, start + sizes[pp_rank])


def _expert_block(experts: int, ep_rank: int, ep_size: int) -> range:
    """Experts EP rank ``ep_rank`` holds: vLLM's linear placement, the first ``experts % ep_size`` ranks one more."""
    sizes = [experts // ep_size + (r < experts % ep_size) for r in range(ep_size)]
    start = sum(sizes[:ep_rank])
    return range(start, start + sizes[ep_rank])


def _match(pattern: str | None, name: str) -> bool:
    return pattern is not None and re.search(pattern, name) is not None


def _flip_lowest_bit(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    out = t.clone().contiguous()
    flat = out.view(-1).view(ints)
    flat[flat.numel() // 2] ^= 1
    return out


class EngineShard:
    """The weights one engine rank holds, named and shaped as vLLM (or, with ``engine="sglang"``, SGLang) holds them.

    ``dp_rank``/``dp_size`` matter to FusedMoE experts only: vLLM spreads them over
    every TP x DP rank of a stage (group rank ``dp_rank * tp_size + tp_rank``), as
    TP slices or, with ``expert_parallel`` (vLLM's ``enable_expert_parallel``), as
    blocks of whole experts: then ``ep_rank``/``ep_size`` are that group rank and size.
    SGLang keeps them inside the replica's TP group (group rank ``tp_rank``).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        tp_rank: int,
        tp_size: int,
        pp_rank: int,
        pp_size: int,
        faults: LoaderFaults = LoaderFaults(),
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        expert_parallel: bool = False,
        engine: str = "vllm",
    ) -> None:
        _check_layout(cfg, tp_rank, tp_size, pp_rank, pp_size, dp_rank, dp_size, expert_parallel, engine)
        self.cfg, self.faults, self.engine = cfg, faults, engine
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = tp_rank, tp_size, pp_rank, pp_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.fused_moe = cfg.experts > 0 and cfg.moe_style == "mixtral"
        # FusedMoE spans the TP x DP ranks of the stage (vLLM) or the TP ranks of the replica (SGLang): every
        # expert sliced over them, or a block of whole experts each
        self.moe_group = tp_size * dp_size if engine == "vllm" else tp_size
        self.moe_slot = dp_rank * tp_size + tp_rank if engine == "vllm" else tp_rank
        self.ep_rank, self.ep_size = (self.moe_slot, self.moe_group) if expert_parallel else (0, 1)
        self.moe_tp_size = 1 if expert_parallel else self.moe_group
        self.experts = _expert_block(cfg.experts, self.ep_rank, self.ep_size) if self.fused_moe else range(cfg.experts)
        self.moe_rows = cfg.intermediate // self.moe_tp_size
        self.layers = pp_layers(cfg.layers, pp_rank, pp_size, engine)
        hd, h = cfg.head_dim, cfg.hidden
        # When tp > kv_heads each kv head is replicated over tp // kv_heads ranks.
        self.kv_replicas = max(1, tp_size // cfg.kv_heads)
        self.q_rows = cfg.heads // tp_size * hd
        self.kv_rows = max(1, cfg.kv_heads // tp_size) * hd
        self.inter_rows = cfg.intermediate // tp_size
        self.vocab_rows = -(-cfg.vocab // tp_size)  # padded vocab / tp

        shapes: dict[str, tuple[int, ...]] = {}
        embed, norm, head, self.own_tied_head = self._ends()
        if embed:
            shapes["model.embed_tokens.weight"] = (self.vocab_rows, h)
        for i in self.layers:
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "self_attn.qkv_proj.weight"] = (self.q_rows + 2 * self.kv_rows, h)
            if cfg.qkv_bias:
                shapes[p + "self_attn.qkv_proj.bias"] = (self.q_rows + 2 * self.kv_rows,)
            shapes[p + "self_attn.o_proj.weight"] = (h, self.q_rows)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            if self.fused_moe:
                moe = p + "block_sparse_moe."
                shapes[moe + "gate.weight"] = (cfg.experts, h)
                shapes[moe + "experts.w13_weight"] = (len(self.experts), 2 * self.moe_rows, h)
                shapes[moe + "experts.w2_weight"] = (len(self.experts), h, self.moe_rows)
                continue
            mlps = [p + "mlp."] if cfg.experts == 0 else [f"{p}mlp.experts.{e}." for e in range(cfg.experts)]
            if cfg.experts:
                shapes[p + "mlp.gate.weight"] = (cfg.experts, h)
            for m in mlps:
                shapes[m + "gate_up_proj.weight"] = (2 * self.inter_rows, h)
                shapes[m + "down_proj.weight"] = (h, self.inter_rows)
        if norm:
            shapes["model.norm.weight"] = (h,)
        if head or self.own_tied_head:
            shapes["lm_head.weight"] = (self.vocab_rows, h)
        self.params: dict[str, torch.Tensor] = {n: torch.zeros(s, dtype=cfg.dtype) for n, s in shapes.items()}

    def _ends(self) -> tuple[bool, bool, bool, bool]:
        """Whether this stage holds the embedding, the final norm, the head, and a tied model's head of its own."""
        first, last, tied = self.pp_rank == 0, self.pp_rank == self.pp_size - 1, self.cfg.tie_embeddings
        if self.engine == "vllm":  # Llama/Qwen2: the ends, a tied head being the embedding on the last stage too
            every = self.fused_moe  # Mixtral: every stage (vLLM 0.33 mixtral.py:316, 336, 406: no PPMissingLayer)
            return first or every or (tied and last), last or every, (last or every) and not tied, False
        qwen2 = self.cfg.qkv_bias  # SGLang: qwen2.py:535-547 the head on the last stage; llama.py:570-578 every stage
        own = tied and qwen2 and last and self.pp_size > 1  # Qwen2's own head there, loaded from the embedding
        return first, last, (last or not qwen2) and not tied, own

    def __repr__(self) -> str:
        dp = f", dp={self.dp_rank}/{self.dp_size}" if self.dp_size > 1 else ""
        ep = f", ep={self.ep_rank}/{self.ep_size}" if self.ep_size > 1 else ""
        where = f"tp={self.tp_rank}/{self.tp_size}, pp={self.pp_rank}/{self.pp_size}{dp}{ep}"
        return f"EngineShard({where}, layers={self.layers})"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Narrow and fuse full HF tensors into this rank's params; returns the engine names written.

        Names of layers (or embedding/head) another pipeline stage owns are ignored,
        as are experts another EP rank holds and ``lm_head`` of a tied model; an
        unknown name raises KeyError.
        """
        tp_as = self.faults.tp_as
        if tp_as is not None and not 0 <= tp_as < self.tp_size:
            raise ValueError(f"LoaderFaults.tp_as={tp_as} is outside tp_size {self.tp_size}")
        written: set[str] = set()
        for hf_name, full in weights:
            if self.faults.stale or _match(self.faults.skip, hf_name):
                continue
            name, shard_id, expert = _engine_name(hf_name)
            if name == "model.embed_tokens.weight" and self.own_tied_head:
                name = "lm_head.weight"  # SGLang's Qwen2 loads its own tied head from the embedding (qwen2.py:670-680)
            if name not in self.params or (expert is not None and expert not in self.experts):
                if self._owned_elsewhere(name, expert):
                    continue
                raise KeyError(f"{hf_name}: no such parameter in a {self.cfg} engine")
            dest, piece = self._place(name, shard_id, full, expert)
            if _match(self.faults.cast, hf_name):
                piece = piece.to(torch.float16)
            piece = piece.to(dest.dtype)
            if _match(self.faults.flip_bit, hf_name):
                piece = _flip_lowest_bit(piece)
            dest.copy_(piece)
            written.add(name)
        return written

    def _owned_elsewhere(self, name: str, expert: int | None = None) -> bool:
        m = _LAYER.match(name)
        if m:
            layer = int(m.group(1))
            if layer >= self.cfg.layers or (expert is not None and expert >= self.cfg.experts):
                return False
            return layer not in self.layers or (expert is not None and self.fused_moe)
        if name == "lm_head.weight" and self.cfg.tie_embeddings:
            return True  # vLLM skips a tied head: it *is* the embedding
        return name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")

    def _place(
        self, name: str, shard_id: str | None, full: torch.Tensor, expert: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(view of this rank's param to write, the slice of ``full`` that belongs there)."""
        param, r = self.params[name], self.tp_rank
        if self.faults.tp_as is not None:
            r = self.faults.tp_as
        if shard_id in _FUSED_IDS and self.faults.fused_from_rank0:
            r = 0
        if shard_id in _MOE_IDS and expert is not None:
            slot, rows = param[self.experts.index(expert)], self.moe_rows
            replica = self.dp_rank * self.tp_size if self.engine == "vllm" else 0  # vLLM's group spans DP too
            r = replica + r if self.moe_tp_size > 1 else 0  # expert parallel: whole experts
            if shard_id == "w2":
                return slot, full.narrow(1, r * rows, rows)
            offset = rows if shard_id == "w3" else 0
            return slot[offset : offset + rows], full.narrow(0, r * rows, rows)
        if shard_id == "q":
            return param[: self.q_rows], full.narrow(0, r * self.q_rows, self.q_rows)
        if shard_id in ("k", "v"):
            offset = self.q_rows + (self.kv_rows if shard_id == "v" else 0)
            head = r // self.kv_replicas
            return param[offset : offset + self.kv_rows], full.narrow(0, head * self.kv_rows, self.kv_rows)
        if shard_id in ("gate", "up"):
            offset = self.inter_rows if shard_id == "up" else 0
            return param[offset : offset + self.inter_rows], full.narrow(0, r * self.inter_rows, self.inter_rows)
        if name.endswith(_ROW_PARALLEL):
            cols = param.shape[1]
            return param, full.narrow(1, r * cols, cols)
        if name in _VOCAB_PARALLEL:
            start = r * self.vocab_rows
            piece = full[start : start + self.vocab_rows]
            pad = full.new_zeros((self.vocab_rows - piece.shape[0], *full.shape[1:]))
            return param, torch.cat([piece, pad])  # the last rank's tail is padding: zeroed on every load, as vLLM does
        return param, full  # replicated: norms, MoE router


def _engine_name(hf_name: str) -> tuple[str, str | None, int | None]:
    """(engine param, which piece of it, expert index of a FusedMoE piece) of HF name ``hf_name``."""
    m = _FUSED_MOE.match(hf_name)
    if m:
        return f"{m.group(1)}.{'w2' if m.group(3) == 'w2' else 'w13'}_weight", m.group(3), int(m.group(2))
    for engine, hf, shard_id in STACKED:
        if hf in hf_name:
            return hf_name.replace(hf, engine), shard_id, None
    return hf_name, None, None


def _check_layout(
    cfg: ModelConfig,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    expert_parallel: bool = False,
    engine: str = "vllm",
) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside tp_size {tp_size}")
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} outside pp_size {pp_size}")
    if cfg.heads % tp_size:
        raise ValueError(f"tp_size {tp_size} must divide ModelConfig.heads ({cfg.heads})")
    if cfg.kv_heads % tp_size and tp_size % cfg.kv_heads:
        raise ValueError(f"tp_size {tp_size} must divide, or be a multiple of, ModelConfig.kv_heads ({cfg.kv_heads})")
    if cfg.intermediate % tp_size:
        raise ValueError(f"tp_size {tp_size} must divide ModelConfig.intermediate ({cfg.intermediate})")
    if cfg.layers < pp_size:
        raise ValueError(f"pp_size {pp_size} exceeds ModelConfig.layers ({cfg.layers})")
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} outside dp_size {dp_size}")
    fused_moe = cfg.experts > 0 and cfg.moe_style == "mixtral"
    group, ranks = (tp_size * dp_size, "tp * dp") if engine == "vllm" else (tp_size, "tp")  # SGLang: within a replica
    if expert_parallel and not fused_moe:
        raise ValueError("expert_parallel needs FusedMoE experts: ModelConfig.experts > 0 and moe_style='mixtral'")
    if expert_parallel and group > cfg.experts:
        raise ValueError(f"expert parallelism over {ranks} = {group} ranks exceeds ModelConfig.experts ({cfg.experts})")
    if expert_parallel and engine == "sglang" and cfg.experts % group:
        raise ValueError(f"SGLang places experts in equal blocks: tp = {group} must divide ModelConfig.experts ({cfg.experts})")
    if fused_moe and not expert_parallel and cfg.intermediate % group:
        raise ValueError(f"{ranks} = {group} must divide ModelConfig.intermediate ({cfg.intermediate}): FusedMoE spans them")


def reassemble(shards: list[EngineShard]) -> dict[str, torch.Tensor]:
    """Full HF-named tensors rebuilt from every (dp, pp, tp) shard of one engine: the layout's inverse.

    Concatenates TP slices, unfuses qkv/gate_up/w13, unstacks FusedMoE experts (which
    span the DP ranks too under vLLM), keeps the first replica of each kv head (and the first
    stage's copy of a tied embedding) and strips vocab padding.
    """
    if not shards:
        raise ValueError("reassemble needs at least one shard")
    first = shards[0]
    cfg, tp, pp, dp, ep, layout = first.cfg, first.tp_size, first.pp_size, first.dp_size, first.ep_size, first.engine
    grid = {(s.dp_rank, s.pp_rank, s.tp_rank): s for s in shards}
    if len(grid) != len(shards) or set(grid) != {(d, p, t) for d in range(dp) for p in range(pp) for t in range(tp)}:
        raise ValueError(f"need exactly one shard per (dp, pp, tp) in {dp}x{pp}x{tp}, got {sorted(grid)}")
    if any((s.cfg, s.tp_size, s.pp_size, s.dp_size, s.ep_size, s.engine) != (cfg, tp, pp, dp, ep, layout) for s in shards):
        raise ValueError("shards come from different configs or layouts")

    out: dict[str, torch.Tensor] = {}
    for name in parameter_shapes(cfg):
        engine, shard_id, expert = _engine_name(name)
        stage = next(p for p in range(pp) if engine in grid[(0, p, 0)].params)
        if expert is not None:  # FusedMoE: every (dp, tp) rank of the stage (vLLM) or of replica 0 (SGLang), in order
            group = [grid[(d, stage, t)] for d in (range(dp) if layout == "vllm" else [0]) for t in range(tp)]
            if ep > 1:
                holder = next(s for s in group if expert in s.experts)
                out[name] = _own_part(holder, engine, shard_id, expert).clone()
            else:
                parts = [_own_part(s, engine, shard_id, expert) for s in group]
                out[name] = torch.cat(parts, dim=1 if shard_id == "w2" else 0)
            continue
        ranks = [grid[(0, stage, t)] for t in range(tp)]
        parts = []
        for s in ranks:
            if shard_id in ("k", "v") and s.tp_rank % s.kv_replicas:
                continue  # a replica of a head already taken
            parts.append(_own_part(s, engine, shard_id))
        if engine in _VOCAB_PARALLEL:
            out[name] = torch.cat(parts)[: cfg.vocab]
        elif engine.endswith(_ROW_PARALLEL):
            out[name] = torch.cat(parts, dim=1)
        elif shard_id is None:
            out[name] = parts[0].clone()  # replicated: norms, router
        else:
            out[name] = torch.cat(parts)
    return out


def _own_part(s: EngineShard, engine: str, shard_id: str | None, expert: int | None = None) -> torch.Tensor:
    """The slice of ``engine`` on shard ``s`` that came from the HF param ``shard_id`` (and ``expert``) names."""
    p = s.params[engine]
    if expert is not None:
        p = p[s.experts.index(expert)]
    rows = {
        "q": (0, s.q_rows),
        "k": (s.q_rows, s.kv_rows),
        "v": (s.q_rows + s.kv_rows, s.kv_rows),
        "gate": (0, s.inter_rows),
        "up": (s.inter_rows, s.inter_rows),
        "w1": (0, s.moe_rows),
        "w3": (s.moe_rows, s.moe_rows),
    }
    if shard_id in (None, "w2"):
        return p
    start, n = rows[shard_id]
    return p.narrow(0, start, n)
