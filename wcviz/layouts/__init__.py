"""Layout rules: what every engine rank should hold, from full Hugging Face weights.

A model family's rules are data (:class:`Rule`: which HF tensors fuse into which
engine parameter, and how it splits over ranks), one module per family:
:mod:`~wcviz.layouts.llama` (Llama, Mistral), :mod:`~wcviz.layouts.qwen2`,
:mod:`~wcviz.layouts.mixtral` and :mod:`~wcviz.layouts.sim_moe` (the simulated
engine's own MoE). Given a topology (TP, PP, DP, EP), :func:`expected_shards`
cuts every rank's parameters as vLLM lays them out, and :func:`expected_frame`
digests them into the frame schema, so ``wcviz.compare(expected_frame(...),
actual)`` says which parameter on which rank is not what the rules predict. That
catches what an end-state (reset/reload) check cannot: a loader that writes the
wrong TP shard writes it again on reload.

These rules never import :mod:`wcviz.sim`: the simulated engine's loader and
the rules are written apart, so a bug in one cannot hide the same bug in the other.

As vLLM lays them out: fused ``qkv_proj`` (k/v heads replicated when tp exceeds
the kv heads) and ``gate_up_proj``, column/row splits, vocabulary-parallel
embedding and head zero-padded to ``vocab_padding`` (64), tied embeddings (the
last stage holds the embedding too), pipeline stages split as ``get_pp_indices``
does, and FusedMoE ``w13_weight``/``w2_weight`` spread over all tp * dp ranks of
a stage (sliced, or as contiguous blocks of whole experts under expert
parallelism, where ep = tp * dp).

Where this differs from vLLM, plainly:

- when tp does not divide the padded vocabulary vLLM refuses; here it is
  rounded up to a multiple of tp as well (which is all the simulated engine
  does: compare it with ``vocab_padding=1``);
- only vLLM's default expert placement (linear, not ``round_robin``) and
  stage split (no ``VLLM_PP_LAYER_PARTITION``);
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
from wcviz.layouts._rules import KINDS, Family, LayoutError, Rule
from wcviz.layouts._split import padded_vocab
from wcviz.layouts._topology import expert_block, stage_layers
from wcviz.layouts.llama import LLAMA, MISTRAL
from wcviz.layouts.mixtral import MIXTRAL
from wcviz.layouts.qwen2 import QWEN2
from wcviz.layouts.sim_moe import SIM_MOE

__all__ = [
    "FAMILIES",
    "KINDS",
    "LLAMA",
    "MISTRAL",
    "MIXTRAL",
    "QWEN2",
    "SIM_MOE",
    "Binding",
    "Family",
    "LayoutError",
    "Param",
    "Rule",
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
