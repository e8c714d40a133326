"""Layout rules: what every engine rank should hold, from full Hugging Face weights.

A model family's rules are data (:class:`Rule`: which HF tensors fuse into which
engine parameter, and how it splits over ranks), one module per family:
:mod:`~wcviz.layouts.llama` (Llama, Mistral), :mod:`~wcviz.layouts.qwen2`,
:mod:`~wcviz.layouts.mixtral` and :mod:`~wcviz.layouts.sim_moe` (the simulated
engine's own MoE). Given a topology (TP, PP, DP, EP), :func:`expected_shards`
cuts every rank's parameters as vLLM (or, with ``engine="sglang"``, SGLang) lays
them out, and :func:`expected_frame`
digests them into the frame schema, so ``wcviz.compare(expected_frame(...),
actual)`` says which parameter on which rank is not what the rules predict. That
catches what an end-state (reset/reload) check cannot: a loader that writes the
wrong TP shard writes it again on reload.

These rules never import :mod:`wcviz.sim`: the simulated engine's loader and
the rules are written apart, so a bug in one cannot hide the same bug in the other.

As vLLM lays them out: fused ``qkv_proj`` (k/v heads replicated when tp exceeds
the kv heads) and ``gate_up_proj``, with their biases where the checkpoint has
them (Llama's ``attention_bias``/``qkv_bias``/``mlp_bias``, Qwen2's q/k/v
biases; ``o_proj`` and ``down_proj`` biases whole on every rank), column/row
splits, vocabulary-parallel embedding and head zero-padded to ``vocab_padding``
(64), tied embeddings (the last stage holds the embedding too), pipeline stages
split as ``get_pp_indices`` does, and FusedMoE ``w13_weight``/``w2_weight``
spread over all tp * dp ranks of a stage (sliced, or as contiguous blocks of
whole experts under expert parallelism, where ep = tp * dp; ranks beyond the
experts hold empty [0, ...] tensors). Mixtral keeps its embedding, norm and head
on every pipeline stage, as vLLM 0.33's ``MixtralModel`` does.

Which engine, ``engine=`` (:data:`ENGINES`): ``"vllm"`` (the default) or
``"sglang"`` (SGLang 0.5.23, read from its source): pipeline leftovers go to the
last stages, a vocabulary tp does not divide is padded to a multiple of 64 * tp
(vLLM cannot start there: a :class:`LayoutError`), FusedMoE weights are named
``experts.w13_weight`` and spread over each DP replica's tp ranks (``ep``
dividing tp: ep groups of whole experts, each sliced over tp / ep), and each
family's :class:`Variant` says what else SGLang builds differently (Llama's
head on every stage and no MLP biases; Qwen2's own head on the last stage of a
tied, pipelined model; Mixtral's head on every stage).

Engine versions and options. Each :class:`Family` names the engine whose source
its rules were read from (``Family.engine``: ``"vllm 0.33.0"``; ``sim-moe`` is
the simulated engine's). Names that changed between vLLM versions are chosen
with ``names=`` on :func:`expected_shards` and :func:`expected_frame`
(:data:`NAMES`; SGLang has its own, so it is left unset there):
``"vllm>=0.25"`` (the default, the rules' own names: Mixtral's
``block_sparse_moe.experts.routed_experts.w13_weight``, since vLLM's MoERunner
refactor) or ``"vllm<0.25"`` (``block_sparse_moe.experts.w13_weight``, each
family's ``legacy_names``; the boundary is approximate, see
:mod:`~wcviz.layouts.mixtral`). It is an option, not a second family: the
checkpoint names and the layout are the same, so two families would fit the
same weights and :func:`detect_family` could not choose. A tied head is listed as the reporter lists it,
``tied_names=`` (:data:`TIED_NAMES`): ``"once"`` (the default: vLLM's
``/weight_checker`` and wcviz's vLLM worker extension walk ``named_parameters()``,
which yields a shared tensor once, as ``model.embed_tokens.weight``) or ``"both"``
(``named_parameters(remove_duplicate=False)``, as :func:`wcviz.sources.from_module`
lists a module: ``lm_head.weight`` too, the same tensor, on the last stage). ``moe_w13_order=`` (:data:`W13_ORDERS`)
is ``"w1w3"`` (FusedMoE as loaded) or ``"w3w1"`` (vLLM's FlashInfer CUTLASS MoE
backend, which swaps each expert's halves after loading). An unknown value of
any of them is a :class:`LayoutError` listing the known ones.

Where this differs from the engines, plainly:

- ``vocab_padding=1`` (the simulated engine's) pads to a multiple of tp, as
  SGLang would with that padding, for either engine;
- only the default expert placement (vLLM's linear, not ``round_robin``;
  SGLang's without EPLB's redundant experts) and stage split (no
  ``VLLM_PP_LAYER_PARTITION`` / ``SGLANG_PP_LAYER_PARTITION``);
- MoE backends that pad or reshuffle expert weights after loading (AITER,
  FlashInfer TRT-LLM, MXFP4, SGLang's ``triton_kernels``) are not modelled,
  the [w3 ; w1] swap aside (``moe_w13_order``); nor SGLang's attention DP,
  ``moe_dp`` or a tied Mixtral (whose head SGLang leaves unloaded);
- quantized weights, LoRA, added vocabulary and per-layer head sizes are not
  modelled; ``sim-moe`` is the simulated engine's own layout, not vLLM's.
"""

from __future__ import annotations

from wcviz.layouts._expected import (
    FAMILIES,
    Binding,
    Param,
    bind,
    checkpoint_weights,
    detect_family,
    expected_frame,
    expected_shards,
    get_family,
)
from wcviz.layouts._rules import (
    ENGINE,
    ENGINES,
    KINDS,
    NAMES,
    TIED_NAMES,
    W13_ORDERS,
    Family,
    LayoutError,
    Rule,
    Variant,
)
from wcviz.layouts._split import padded_vocab
from wcviz.layouts._topology import expert_block, stage_layers
from wcviz.layouts.llama import LLAMA, MISTRAL
from wcviz.layouts.mixtral import MIXTRAL
from wcviz.layouts.qwen2 import QWEN2
from wcviz.layouts.sim_moe import SIM_MOE

__all__ = [
    "ENGINE",
    "ENGINES",
    "FAMILIES",
    "KINDS",
    "LLAMA",
    "MISTRAL",
    "MIXTRAL",
    "NAMES",
    "QWEN2",
    "SIM_MOE",
    "TIED_NAMES",
    "W13_ORDERS",
    "Binding",
    "Family",
    "LayoutError",
    "Param",
    "Rule",
    "Variant",
    "bind",
    "checkpoint_weights",
    "detect_family",
    "expected_frame",
    "expected_shards",
    "expert_block",
    "get_family",
    "padded_vocab",
    "stage_layers",
]
