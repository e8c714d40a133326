"""Qwen2: vLLM's ``Qwen2ForCausalLM``, Llama's layout plus q/k/v biases fused into ``qkv_proj.bias``.

Qwen2's smaller checkpoints tie the head to the embedding (no ``lm_head.weight``).
Its q/k/v biases are required (``Qwen2Attention``: ``qkv_proj`` with ``bias=True``,
``o_proj`` without), which is how :func:`~wcviz.layouts.detect_family` tells a
Qwen2 checkpoint from a Llama one, whose biases are optional rules.

SGLang 0.5.23 (``sglang/srt/models/qwen2.py``) builds the head on the last stage
only, as vLLM does, but with pp > 1 a tied head there is a ``lm_head`` of its own
(535-547) loaded from ``model.embed_tokens.weight`` (670-680), while the
embedding stays on the first stage (369-383).
"""

from __future__ import annotations

from wcviz.layouts._rules import Family, Rule, Variant
from wcviz.layouts.llama import ATTENTION, DENSE_MLP, EMBEDDING, HEAD, NORMS

__all__ = ["QKV_BIAS", "QWEN2"]

_L = "model.layers.{L}."

QKV_BIAS = (
    Rule(
        _L + "self_attn.qkv_proj.bias",
        (_L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias", _L + "self_attn.v_proj.bias"),
        "qkv",
    ),
)

QWEN2 = Family(
    "qwen2",
    (*EMBEDDING, *ATTENTION, *QKV_BIAS, *NORMS, *DENSE_MLP, *HEAD),
    doc="Qwen2: Llama plus fused q/k/v biases",
    variants=(("sglang", Variant(tied_last="head")),),  # qwen2.py:535-547
)
