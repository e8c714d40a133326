"""Sources turn something that holds weights into a digest table (see :mod:`wcviz.frame`).

In memory (a module, a state dict, named tensors), on disk (safetensors), in the job
(a torch.distributed group), and over a fleet of ranks (HTTP agents, vLLM workers,
SGLang schedulers, Ray actors) - including the engines' own checkers, with nothing of
wcviz installed in them (:func:`from_vllm_weight_checker`, :func:`from_sglang`). A fleet source says only how to ask its engine; what
an answer must be and the one :class:`FetchResult` it returns are shared
(:mod:`wcviz.sources._fleet`).
"""

from __future__ import annotations

from typing import Any

from wcviz.sources._distributed import from_distributed, gather_frame
from wcviz.sources._fleet import FAILED_COLUMNS, ActionResult, FetchResult, Targets
from wcviz.sources._fleet import normalize as normalize_targets
from wcviz.sources._http import act, act_agents, fetch, fetch_agents, fetch_infos
from wcviz.sources._ray import from_ray_actors
from wcviz.sources._safetensors import checkpoint_files, from_safetensors
from wcviz.sources._sglang import from_sglang, sglang_action, sglang_compare_mismatches
from wcviz.sources._tensors import from_module, from_named_tensors, from_state_dict, named_tensor_rows, named_tensor_table
from wcviz.sources._vllm import EngineEndpointError, from_vllm_http, from_vllm_llm, vllm_collective_rpc
from wcviz.sources._wire import COLUMNS_MEDIA_TYPE
from wcviz.sources._vllm_checker import from_vllm_weight_checker, vllm_checksum_keys, vllm_weight_checker, vllm_world_size

__all__ = [
    "COLUMNS_MEDIA_TYPE",
    "FAILED_COLUMNS",
    "ActionResult",
    "EngineEndpointError",
    "FetchResult",
    "SglangEndstate",
    "Targets",
    "act",
    "act_agents",
    "checkpoint_files",
    "fetch",
    "fetch_agents",
    "fetch_infos",
    "from_distributed",
    "from_module",
    "from_named_tensors",
    "from_ray_actors",
    "from_safetensors",
    "from_sglang",
    "from_state_dict",
    "from_vllm_http",
    "from_vllm_llm",
    "from_vllm_weight_checker",
    "gather_frame",
    "named_tensor_rows",
    "named_tensor_table",
    "normalize_targets",
    "sglang_action",
    "sglang_compare_mismatches",
    "sglang_endstate",
    "vllm_checksum_keys",
    "vllm_collective_rpc",
    "vllm_weight_checker",
    "vllm_world_size",
]

_MOVED = {"sglang_endstate": "wcviz.endstate", "SglangEndstate": "wcviz.endstate"}  # the end-state check lives there


def __getattr__(name: str) -> Any:
    """The SGLang end-state check moved to :mod:`wcviz.endstate`; these names still reach it (lazily: no cycle)."""
    if name in _MOVED:
        from importlib import import_module

        return getattr(import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'wcviz.sources' has no attribute {name!r}")
