"""The simulated engine's own mixture of experts (``wcviz.sim`` with ``moe_style="sim"``).

Each expert keeps its own fused ``gate_up_proj`` and ``down_proj``, TP-split like
a dense MLP, under ``mlp.experts.E``; the router ``mlp.gate`` is replicated. This
is how vLLM held experts before FusedMoE, not a layout current vLLM uses (its
Qwen2-MoE and Mixtral stack experts: see :mod:`wcviz.layouts.mixtral`); it has no
expert parallelism. Its ``engine`` is the sim, and its names never change with
the ``names`` option. Played as SGLang, the sim holds it as SGLang holds Llama
(the head on every stage).
"""

from __future__ import annotations

from wcviz.layouts._rules import Family, Rule, Variant
from wcviz.layouts.llama import ATTENTION, EMBEDDING, HEAD, NORMS

__all__ = ["PER_EXPERT_MLP", "SIM_MOE"]

_X = "model.layers.{L}.mlp.experts.{E}."

PER_EXPERT_MLP = (
    Rule("model.layers.{L}.mlp.gate.weight", ("model.layers.{L}.mlp.gate.weight",), "replicated"),
    Rule(_X + "gate_up_proj.weight", (_X + "gate_proj.weight", _X + "up_proj.weight"), "merged_column"),
    Rule(_X + "down_proj.weight", (_X + "down_proj.weight",), "row"),
)

SIM_MOE = Family(
    "sim-moe",
    (*EMBEDDING, *ATTENTION, *NORMS, *PER_EXPERT_MLP, *HEAD),
    doc="the sim's per-expert MoE",
    engine="wcviz.sim (moe_style='sim')",
    variants=(("sglang", Variant(stages=(("lm_head.weight", "every"),), tied_last="nothing")),),
)
