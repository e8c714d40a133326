"""A Llama-family decoder built in code: the weights a simulated trainer owns and refits.

Names and shapes follow Hugging Face (``model.layers.N.self_attn.q_proj.weight``, ...),
with grouped-query attention, optional q/k/v biases (Qwen2) and, when ``experts > 0``,
a mixture of experts named either the sim's own way (``mlp.experts.E.gate_proj``, with
router ``mlp.gate``) or Mixtral's (``block_sparse_moe.experts.E.w1/w2/w3``, router
``block_sparse_moe.gate``). Everything is deterministic from the config's seed, so two
processes that build the same config hold bit-identical weights without talking.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, fields
from pathlib import Path

import torch

__all__ = [
    "MOE_STYLES",
    "TINY",
    "TINY_MOE",
    "ModelConfig",
    "build_state_dict",
    "hf_config",
    "parameter_shapes",
    "save_checkpoint",
    "step",
]

MOE_STYLES = ("sim", "mixtral")
_SIZES = ("vocab", "hidden", "layers", "heads", "kv_heads", "intermediate")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a Llama-family decoder; ``experts == 0`` means a dense MLP.

    ``qkv_bias`` adds Qwen2's q/k/v biases; ``moe_style`` names the experts the sim's
    way (``"sim"``) or Mixtral's (``"mixtral"``: the engine then holds them as vLLM's
    FusedMoE does, and can place them expert-parallel).
    """

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    dtype: torch.dtype = torch.bfloat16
    experts: int = 0
    tie_embeddings: bool = False
    seed: int = 0
    qkv_bias: bool = False
    moe_style: str = "sim"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _SIZES and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"ModelConfig.{f.name} must be a positive int, got {value!r}")
        if not isinstance(self.experts, int) or self.experts < 0:
            raise ValueError(f"ModelConfig.experts must be an int >= 0, got {self.experts!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"ModelConfig.dtype must be a floating torch.dtype, got {self.dtype!r}")
        if self.moe_style not in MOE_STYLES:
            raise ValueError(f"ModelConfig.moe_style must be one of {', '.join(MOE_STYLES)}, got {self.moe_style!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelConfig.heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.hidden % self.heads:
            raise ValueError(f"ModelConfig.hidden ({self.hidden}) must be a multiple of heads ({self.heads})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# Small enough for fast tests (~250 KB each); vocab 250 is no multiple of 4 so that
# vocabulary-parallel padding is exercised, and 3 layers split unevenly over 2 stages.
TINY = ModelConfig(vocab=250, hidden=64, layers=3, heads=4, kv_heads=2, intermediate=96)
TINY_MOE = ModelConfig(vocab=250, hidden=64, layers=3, heads=4, kv_heads=2, intermediate=32, experts=4)


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of ``cfg``, in checkpoint order."""
    h, hd, inter = cfg.hidden, cfg.head_dim, cfg.intermediate
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab, h)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.heads * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.kv_heads * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.kv_heads * hd, h)
        if cfg.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (cfg.heads * hd,)
            shapes[p + "self_attn.k_proj.bias"] = (cfg.kv_heads * hd,)
            shapes[p + "self_attn.v_proj.bias"] = (cfg.kv_heads * hd,)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.heads * hd)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.experts and cfg.moe_style == "mixtral":
            moe = p + "block_sparse_moe."
            shapes[moe + "gate.weight"] = (cfg.experts, h)
            for e in range(cfg.experts):
                shapes[f"{moe}experts.{e}.w1.weight"] = (inter, h)
                shapes[f"{moe}experts.{e}.w2.weight"] = (h, inter)
                shapes[f"{moe}experts.{e}.w3.weight"] = (inter, h)
            continue
        mlps = [p + "mlp."] if cfg.experts == 0 else [f"{p}mlp.experts.{e}." for e in range(cfg.experts)]
        if cfg.experts:
            shapes[p + "mlp.gate.weight"] = (cfg.experts, h)
        for m in mlps:
            shapes[m + "gate_proj.weight"] = (inter, h)
            shapes[m + "up_proj.weight"] = (inter, h)
            shapes[m + "down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_embeddings:  # a tied head is saved once, as the embedding (as HF checkpoints do)
        shapes["lm_head.weight"] = (cfg.vocab, h)
    return shapes


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def build_state_dict(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The initial weights of ``cfg``: N(0, 0.02) matrices, norms near 1, same bits for the same seed."""
    g = torch.Generator().manual_seed(cfg.seed)
    sd = {}
    for name, shape in parameter_shapes(cfg).items():
        t = torch.randn(shape, generator=g) * 0.02
        sd[name] = (t + 1 if _is_norm(name) else t).to(cfg.dtype)
    return sd


def step(sd: dict[str, torch.Tensor], k: int, scale: float = 0.01) -> dict[str, torch.Tensor]:
    """The weights after trainer step ``k``: each tensor plus a seeded N(0, scale) delta.

    The delta is added in float32 and cast back, and is seeded by ``(k, name)`` only,
    so every process computes the same step; ``scale`` is large enough to change
    every bfloat16 parameter, norms included.
    """
    out = {}
    for name, t in sd.items():
        g = torch.Generator().manual_seed(zlib.crc32(f"{k}/{name}".encode()))
        delta = torch.randn(t.shape, generator=g) * scale
        out[name] = (t.float() + delta).to(t.dtype)
    return out


def hf_config(cfg: ModelConfig) -> dict[str, object]:
    """The Hugging Face ``config.json`` of a model built from ``cfg`` (the fields wcviz and the engines read)."""
    model_type = "mixtral" if cfg.experts and cfg.moe_style == "mixtral" else "qwen2" if cfg.qkv_bias else "llama"
    out: dict[str, object] = {
        "model_type": model_type, "vocab_size": cfg.vocab, "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "intermediate_size": cfg.intermediate,
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": str(cfg.dtype).removeprefix("torch."),
    }  # fmt: skip
    if cfg.experts:
        out["num_local_experts"] = cfg.experts
    return out


def save_checkpoint(sd: dict[str, torch.Tensor], directory: str | Path, shards: int = 2, config: ModelConfig | None = None) -> Path:
    """Write ``sd`` as ``shards`` safetensors files plus a Hugging Face ``model.safetensors.index.json``
    (and, given the model's ``config``, its ``config.json``)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = list(sd)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: sd[n].contiguous() for n in names[s::shards]}
        save_file(part, str(directory / fname))
        weight_map.update({n: fname for n in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(hf_config(config), indent=1))
    return directory
