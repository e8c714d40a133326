"""Mixtral: vLLM's ``MixtralForCausalLM``, Llama's attention with a FusedMoE block.

Hugging Face keeps every expert apart (``block_sparse_moe.experts.E.w1/w2/w3``);
vLLM's ``FusedMoE`` stacks a rank's experts into two parameters:
``experts.w13_weight`` [local experts, 2 * intermediate / tp, hidden] (per
expert w1, the gate, over w3, the up projection, each split along dim 0) and
``experts.w2_weight`` [local experts, hidden, intermediate / tp] (split along
dim 1). The router ``block_sparse_moe.gate`` is replicated.
"""

from __future__ import annotations

from wcviz.layouts._rules import Family, Rule
from wcviz.layouts.llama import ATTENTION, EMBEDDING, HEAD, NORMS

__all__ = ["FUSED_MOE", "MIXTRAL"]

_M = "model.layers.{L}.block_sparse_moe."

FUSED_MOE = (
    Rule(_M + "gate.weight", (_M + "gate.weight",), "replicated"),
    Rule(_M + "experts.w13_weight", (_M + "experts.{E}.w1.weight", _M + "experts.{E}.w3.weight"), "moe_w13"),
    Rule(_M + "experts.w2_weight", (_M + "experts.{E}.w2.weight",), "moe_w2"),
)

MIXTRAL = Family(
    "mixtral", (*EMBEDDING, *ATTENTION, *NORMS, *FUSED_MOE, *HEAD), doc="Mixtral: FusedMoE w13/w2, expert parallel"
)
