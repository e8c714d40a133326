"""Mixtral: vLLM's ``MixtralForCausalLM``, Llama's attention with a FusedMoE block.

Hugging Face keeps every expert apart (``block_sparse_moe.experts.E.w1/w2/w3``);
vLLM stacks a rank's experts into two parameters: ``w13_weight`` [local experts,
2 * intermediate / tp, hidden] (per expert w1, the gate, over w3, the up
projection, each split along dim 0: ``RoutedExperts._load_w13``) and
``w2_weight`` [local experts, hidden, intermediate / tp] (split along dim 1).
The router ``block_sparse_moe.gate`` (``GateLinear``, a ``ReplicatedLinear``)
is replicated.

Names, by vLLM version. In vLLM 0.33 ``FusedMoEFactory`` returns a ``MoERunner``
that owns the weights in a ``RoutedExperts`` submodule
(``fused_moe/runner/moe_runner.py``: ``self.routed_experts``), so the parameters
are ``block_sparse_moe.experts.routed_experts.w13_weight`` and ``...w2_weight``:
the names in :data:`MIXTRAL`. Before the MoERunner refactor (vLLM PR #41184)
``FusedMoE`` held them itself: ``block_sparse_moe.experts.w13_weight`` and
``...w2_weight``, given by ``names="vllm<0.25"`` (:data:`MIXTRAL`'s
``legacy_names``; vLLM's ``weight_utils.maybe_remap_moe_expert_param_name``
maps old names to new the same way). The 0.25 boundary is NeMo-RL's: its bump
from vLLM 0.20.0 to 0.25.1 added the ``.routed_experts.`` segment; the first
release with it is not pinned down here, so for a version between those, look
for ``.routed_experts.`` in ``named_parameters()``.

The w13 order depends on the MoE backend. vLLM's FlashInfer CUTLASS backend swaps
each expert's halves to [w3 ; w1] after loading
(``fused_moe/oracle/unquantized.py``, ``convert_to_unquantized_kernel_format``,
``UnquantizedMoeBackend.FLASHINFER_CUTLASS``, with
``quantization/utils/flashinfer_utils.py``'s ``swap_w13_to_w31``), so the
parameter a digest reads holds [w3 ; w1]: pass ``moe_w13_order="w3w1"``.

Under expert parallelism a rank beyond the experts holds none: vLLM's
``determine_expert_map`` gives it ``local_num_experts`` 0 and
``UnquantizedFusedMoEMethod.create_weights`` makes [0, 2 * intermediate,
hidden] and [0, hidden, intermediate] tensors.

Pipeline stages. vLLM 0.33's ``MixtralModel`` builds ``embed_tokens`` (mixtral.py:316),
``norm`` (336) and ``MixtralForCausalLM.lm_head`` (406, tied to the embedding when
``tie_word_embeddings``) on every stage, with no ``PPMissingLayer``, and its
``AutoWeightsLoader`` loads them there: :data:`VLLM_MIXTRAL` holds them on every
stage. SGLang 0.5.23 (``sglang/srt/models/mixtral.py``) keeps the embedding on the
first stage (289-296) and the norm on the last (308-311) but builds ``lm_head`` on
every stage (355), untied whatever the config says (a tied checkpoint's head stays
unloaded there: not modelled). SGLang names the FusedMoE weights as vLLM did before
0.25 (``experts.w13_weight``: ``make_expert_params_mapping``,
``fused_moe_triton/layer.py:1797-1822``) and loads w1 over w3 (``_load_w13``, 788-879).
"""

from __future__ import annotations

from wcviz.layouts._rules import Family, Rule, Variant
from wcviz.layouts.llama import ATTENTION, EMBEDDING, HEAD, NORMS

__all__ = ["FUSED_MOE", "LEGACY_NAMES", "MIXTRAL", "VLLM_MIXTRAL"]

_M = "model.layers.{L}.block_sparse_moe."

FUSED_MOE = (
    Rule(_M + "gate.weight", (_M + "gate.weight",), "replicated"),
    Rule(
        _M + "experts.routed_experts.w13_weight",
        (_M + "experts.{E}.w1.weight", _M + "experts.{E}.w3.weight"),
        "moe_w13",
    ),
    Rule(_M + "experts.routed_experts.w2_weight", (_M + "experts.{E}.w2.weight",), "moe_w2"),
)
# the same parameters before vLLM's MoERunner refactor (names="vllm<0.25")
LEGACY_NAMES = (
    (_M + "experts.routed_experts.w13_weight", _M + "experts.w13_weight"),
    (_M + "experts.routed_experts.w2_weight", _M + "experts.w2_weight"),
)

# vLLM's MixtralModel: embedding, norm and head on every stage (mixtral.py:316, 336, 406)
VLLM_MIXTRAL = Variant(stages=tuple((r.engine, "every") for r in (*EMBEDDING, *HEAD)))

MIXTRAL = Family(
    "mixtral",
    (*EMBEDDING, *ATTENTION, *NORMS, *FUSED_MOE, *HEAD),
    doc="Mixtral: FusedMoE w13/w2, expert parallel",
    legacy_names=LEGACY_NAMES,
    variants=(("vllm", VLLM_MIXTRAL), ("sglang", Variant(stages=(("lm_head.weight", "every"),), tied_last="nothing"))),
)
