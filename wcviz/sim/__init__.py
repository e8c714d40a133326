"""A simulated cluster built in code: a trainer's model and the engine ranks that serve it.

:mod:`wcviz.sim.model` builds Llama-family weights (dense or MoE) and trainer steps;
:mod:`wcviz.sim.engine` holds them the way vLLM's tensor/pipeline-parallel ranks do,
with injectable loader faults, so verification can be tested against known bugs.
"""

from __future__ import annotations

from wcviz.sim.engine import EngineLayout, EngineShard, LoaderFaults, pp_layers, reassemble
from wcviz.sim.model import TINY, TINY_MOE, ModelConfig, build_state_dict, parameter_shapes, step

__all__ = [
    "TINY",
    "TINY_MOE",
    "EngineLayout",
    "EngineShard",
    "LoaderFaults",
    "ModelConfig",
    "build_state_dict",
    "parameter_shapes",
    "pp_layers",
    "reassemble",
    "step",
]
