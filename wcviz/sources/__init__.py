"""Sources turn something that holds weights into a digest table (see :mod:`wcviz.frame`)."""

from __future__ import annotations

from wcviz.sources._distributed import from_distributed, gather_frame
from wcviz.sources._http import ActionResult, FetchResult, act, act_agents, fetch, fetch_agents
from wcviz.sources._safetensors import from_safetensors
from wcviz.sources._tensors import from_module, from_named_tensors, from_state_dict

__all__ = [
    "ActionResult",
    "FetchResult",
    "act",
    "act_agents",
    "fetch",
    "fetch_agents",
    "from_distributed",
    "from_module",
    "from_named_tensors",
    "from_safetensors",
    "from_state_dict",
    "gather_frame",
]
