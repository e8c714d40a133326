"""Sources turn something that holds weights into a digest table (see :mod:`wcviz.frame`).

In memory (a module, a state dict, named tensors), on disk (safetensors), in the job
(a torch.distributed group), and over a fleet of ranks (HTTP agents, vLLM workers,
SGLang schedulers, Ray actors) - including the engines' own checkers, with nothing of
wcviz installed in them (:func:`from_vllm_weight_checker`, :func:`from_sglang`). A fleet source says only how to ask its engine; what
an answer must be and the one :class:`FetchResult` it returns are shared
(:mod:`wcviz.sources._fleet`).
"""

from __future__ import annotations

from importlib import import_module
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any

# public name -> (private module, its name there). Loaded on first use, so that reading a checkpoint
# (``wcviz digest``) does not import the HTTP client, pandas or the engines' adapters.
_EXPORTS = {
    "from_distributed": ("_distributed", "from_distributed"),
    "gather_frame": ("_distributed", "gather_frame"),
    "FAILED_COLUMNS": ("_fleet", "FAILED_COLUMNS"),
    "ActionResult": ("_fleet", "ActionResult"),
    "FetchResult": ("_fleet", "FetchResult"),
    "Targets": ("_fleet", "Targets"),
    "normalize_targets": ("_fleet", "normalize"),
    "checked_url": ("_fleet", "checked_url"),
    "act": ("_http", "act"),
    "act_agents": ("_http", "act_agents"),
    "fetch": ("_http", "fetch"),
    "fetch_agents": ("_http", "fetch_agents"),
    "fetch_infos": ("_http", "fetch_infos"),
    "from_ray_actors": ("_ray", "from_ray_actors"),
    "checkpoint_files": ("_safetensors", "checkpoint_files"),
    "from_safetensors": ("_safetensors", "from_safetensors"),
    "safetensors_rows": ("_safetensors", "safetensors_rows"),
    "read_header": ("_safetensors", "read_header"),
    "from_sglang": ("_sglang", "from_sglang"),
    "sglang_action": ("_sglang", "sglang_action"),
    "sglang_compare_mismatches": ("_sglang", "sglang_compare_mismatches"),
    "from_module": ("_tensors", "from_module"),
    "from_named_tensors": ("_tensors", "from_named_tensors"),
    "from_state_dict": ("_tensors", "from_state_dict"),
    "named_tensor_rows": ("_tensors", "named_tensor_rows"),
    "named_tensor_table": ("_tensors", "named_tensor_table"),
    "EngineEndpointError": ("_vllm", "EngineEndpointError"),
    "from_vllm_http": ("_vllm", "from_vllm_http"),
    "from_vllm_llm": ("_vllm", "from_vllm_llm"),
    "vllm_collective_rpc": ("_vllm", "vllm_collective_rpc"),
    "COLUMNS_MEDIA_TYPE": ("_wire", "COLUMNS_MEDIA_TYPE"),
    "from_vllm_weight_checker": ("_vllm_checker", "from_vllm_weight_checker"),
    "vllm_checksum_keys": ("_vllm_checker", "vllm_checksum_keys"),
    "vllm_weight_checker": ("_vllm_checker", "vllm_weight_checker"),
    "vllm_world_size": ("_vllm_checker", "vllm_world_size"),
    "vllm_version": ("_vllm_checker", "vllm_version"),
}

if TYPE_CHECKING:
    from wcviz.sources._distributed import from_distributed, gather_frame
    from wcviz.sources._fleet import FAILED_COLUMNS, ActionResult, FetchResult, Targets
    from wcviz.sources._fleet import checked_url
    from wcviz.sources._fleet import normalize as normalize_targets
    from wcviz.sources._http import act, act_agents, fetch, fetch_agents, fetch_infos
    from wcviz.sources._ray import from_ray_actors
    from wcviz.sources._safetensors import checkpoint_files, from_safetensors, read_header, safetensors_rows
    from wcviz.sources._sglang import from_sglang, sglang_action, sglang_compare_mismatches
    from wcviz.sources._tensors import from_module, from_named_tensors, from_state_dict, named_tensor_rows, named_tensor_table
    from wcviz.sources._vllm import EngineEndpointError, from_vllm_http, from_vllm_llm, vllm_collective_rpc
    from wcviz.sources._wire import COLUMNS_MEDIA_TYPE
    from wcviz.sources._vllm_checker import from_vllm_weight_checker, vllm_checksum_keys, vllm_version, vllm_weight_checker, vllm_world_size

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
    "checked_url",
    "safetensors_rows",
    "read_header",
    "sglang_action",
    "sglang_compare_mismatches",
    "sglang_endstate",
    "vllm_checksum_keys",
    "vllm_collective_rpc",
    "vllm_weight_checker",
    "vllm_version",
    "vllm_world_size",
]

_MOVED = {"sglang_endstate": "wcviz.endstate", "SglangEndstate": "wcviz.endstate"}  # the end-state check lives there


assert set(__all__) == {*_EXPORTS, *_MOVED}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use; the SGLang end-state check moved to
    :mod:`wcviz.endstate`, and its names still reach it."""
    if name in _MOVED:
        return getattr(import_module(_MOVED[name]), name)
    if name not in _EXPORTS:
        if name.startswith("_") and name[1:2].isalpha() and find_spec(f"wcviz.sources.{name}") is not None:
            return import_module(f"wcviz.sources.{name}")  # a submodule, reached as an attribute as before
        raise AttributeError(f"module 'wcviz.sources' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(import_module(f"wcviz.sources.{module}"), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
