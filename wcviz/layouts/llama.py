"""Llama and Mistral: vLLM's ``LlamaForCausalLM`` (vLLM loads ``MistralForCausalLM`` checkpoints with it).

The pieces are named so that other families can reuse them.
"""

from __future__ import annotations

from wcviz.layouts._rules import Family, Rule

__all__ = ["ATTENTION", "DENSE_MLP", "EMBEDDING", "HEAD", "LLAMA", "MISTRAL", "NORMS"]

_L = "model.layers.{L}."

EMBEDDING = (Rule("model.embed_tokens.weight", ("model.embed_tokens.weight",), "vocab", stage="first"),)
ATTENTION = (
    Rule(
        _L + "self_attn.qkv_proj.weight",
        (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"),
        "qkv",
    ),
    Rule(_L + "self_attn.o_proj.weight", (_L + "self_attn.o_proj.weight",), "row"),
)
NORMS = (
    Rule(_L + "input_layernorm.weight", (_L + "input_layernorm.weight",), "replicated"),
    Rule(_L + "post_attention_layernorm.weight", (_L + "post_attention_layernorm.weight",), "replicated"),
)
DENSE_MLP = (
    Rule(_L + "mlp.gate_up_proj.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"), "merged_column"),
    Rule(_L + "mlp.down_proj.weight", (_L + "mlp.down_proj.weight",), "row"),
)
HEAD = (
    Rule("model.norm.weight", ("model.norm.weight",), "replicated", stage="last"),
    Rule("lm_head.weight", ("lm_head.weight",), "vocab", stage="last", optional=True),  # absent when tied
)

LLAMA = Family(
    "llama", (*EMBEDDING, *ATTENTION, *NORMS, *DENSE_MLP, *HEAD), doc="Llama: fused qkv_proj and gate_up_proj"
)
MISTRAL = Family("mistral", LLAMA.rules, doc="Mistral: Llama's names and layout (vLLM loads it as Llama)")
