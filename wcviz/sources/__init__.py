"""Sources turn something that holds weights into a digest table (see :mod:`wcviz.frame`)."""

from __future__ import annotations

from wcviz.sources._distributed import from_distributed, gather_frame
from wcviz.sources._http import ActionResult, FetchResult, act, act_agents, fetch, fetch_agents
from wcviz.sources._ray import from_ray_actors
from wcviz.sources._safetensors import from_safetensors
from wcviz.sources._sglang import SglangEndstate, from_sglang, sglang_action, sglang_endstate
from wcviz.sources._tensors import from_module, from_named_tensors, from_state_dict
from wcviz.sources._vllm import EngineEndpointError, from_vllm_http, from_vllm_llm, vllm_collective_rpc

__all__ = [
    "ActionResult",
    "EngineEndpointError",
    "SglangEndstate",
    "FetchResult",
    "act",
    "act_agents",
    "fetch",
    "fetch_agents",
    "from_distributed",
    "from_module",
    "from_ray_actors",
    "from_sglang",
    "from_vllm_http",
    "from_vllm_llm",
    "from_named_tensors",
    "from_safetensors",
    "from_state_dict",
    "gather_frame",
    "sglang_action",
    "sglang_endstate",
    "vllm_collective_rpc",
]
