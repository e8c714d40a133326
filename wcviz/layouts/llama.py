"""Llama and Mistral: vLLM's ``LlamaForCausalLM`` (vLLM loads ``MistralForCausalLM`` checkpoints with it).

Biases are optional rules, absent from a plain Llama checkpoint. vLLM 0.33
(``models/llama.py``, ``LlamaDecoderLayer``) builds them from the HF config:
``attention_bias`` (or ``bias``) gives ``qkv_proj`` and ``o_proj`` biases,
``qkv_bias`` (InternLM3) overrides the ``qkv_proj`` one alone, ``mlp_bias``
gives ``gate_up_proj`` and ``down_proj`` biases. As ``layers/linear.py`` holds them:
``QKVParallelLinear`` and ``MergedColumnParallelLinear`` split a bias along dim 0
exactly like their weight (k/v bias heads replicated when tp exceeds the kv heads);
``RowParallelLinear`` keeps the whole bias (``output_size``) on every rank and its
``weight_loader`` never narrows it (only TP rank 0 adds it in ``forward``).

SGLang 0.5.23 (``sglang/srt/models/llama.py``, Mistral a subclass) differs, in
:data:`SGLANG_LLAMA`: its ``LlamaMLP`` has no biases (``bias=False``, lines 101
and 109; the loader skips a ``.bias`` it has no parameter for, 756-770), it
builds ``lm_head`` on every pipeline stage (570-578, no ``is_last_rank``) and
loads it there, and a tied head is ``model.embed_tokens`` itself, which only the
first stage holds (431-439), so a later stage holds nothing for it.

The pieces are named so that other families can reuse them.
"""

from __future__ import annotations

from wcviz.layouts._rules import Family, Rule, Variant

__all__ = [
    "ATTENTION",
    "ATTENTION_BIAS",
    "DENSE_MLP",
    "EMBEDDING",
    "HEAD",
    "LLAMA",
    "MISTRAL",
    "MLP_BIAS",
    "NORMS",
    "SGLANG_LLAMA",
]

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
# attention_bias / qkv_bias: optional, each rule all-or-nothing over every layer
ATTENTION_BIAS = (
    Rule(
        _L + "self_attn.qkv_proj.bias",
        (_L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias", _L + "self_attn.v_proj.bias"),
        "qkv",
        optional=True,
    ),
    Rule(_L + "self_attn.o_proj.bias", (_L + "self_attn.o_proj.bias",), "replicated", optional=True),
)
NORMS = (
    Rule(_L + "input_layernorm.weight", (_L + "input_layernorm.weight",), "replicated"),
    Rule(_L + "post_attention_layernorm.weight", (_L + "post_attention_layernorm.weight",), "replicated"),
)
DENSE_MLP = (
    Rule(_L + "mlp.gate_up_proj.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"), "merged_column"),
    Rule(_L + "mlp.down_proj.weight", (_L + "mlp.down_proj.weight",), "row"),
)
# mlp_bias: optional
MLP_BIAS = (
    Rule(
        _L + "mlp.gate_up_proj.bias",
        (_L + "mlp.gate_proj.bias", _L + "mlp.up_proj.bias"),
        "merged_column",
        optional=True,
    ),
    Rule(_L + "mlp.down_proj.bias", (_L + "mlp.down_proj.bias",), "replicated", optional=True),
)
HEAD = (
    Rule("model.norm.weight", ("model.norm.weight",), "replicated", stage="last"),
    Rule("lm_head.weight", ("lm_head.weight",), "vocab", stage="last", optional=True),  # absent when tied
)

# SGLang's LlamaForCausalLM: the head on every stage (llama.py:570-578), no MLP biases (101, 109)
SGLANG_LLAMA = Variant(
    stages=(("lm_head.weight", "every"),), dropped=tuple(r.engine for r in MLP_BIAS), tied_last="nothing"
)

LLAMA = Family(
    "llama",
    (*EMBEDDING, *ATTENTION, *ATTENTION_BIAS, *NORMS, *DENSE_MLP, *MLP_BIAS, *HEAD),
    doc="Llama: fused qkv_proj and gate_up_proj, optional attention and MLP biases",
    variants=(("sglang", SGLANG_LLAMA),),
)
MISTRAL = Family(
    "mistral",
    LLAMA.rules,
    doc="Mistral: Llama's names and layout (vLLM loads it as Llama; SGLang's MistralForCausalLM subclasses its Llama)",
    variants=LLAMA.variants,
)
