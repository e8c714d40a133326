"""A simulated cluster built in code: a trainer's model and the engine ranks that serve it.

:mod:`wcviz.sim.model` builds Llama-family weights (dense or MoE) and trainer steps;
:mod:`wcviz.sim.engine` holds them the way vLLM's tensor/pipeline-parallel ranks do,
with injectable loader faults, so verification can be tested against known bugs;
:mod:`wcviz.sim.cluster` runs them as real processes with an agent on every rank;
:mod:`wcviz.sim.checkers` serves them as vLLM's and SGLang's own weight checkers answer.
"""

from __future__ import annotations

from wcviz.sim.checkers import SimSglang, SimVllm
from wcviz.sim.cluster import Cluster, ClusterError, RankInfo
from wcviz.sim.engine import EngineLayout, EngineShard, LoaderFaults, pp_layers, reassemble
from wcviz.sim.model import TINY, TINY_MOE, ModelConfig, build_state_dict, parameter_shapes, save_checkpoint, step

__all__ = [
    "TINY",
    "TINY_MOE",
    "Cluster",
    "ClusterError",
    "EngineLayout",
    "EngineShard",
    "LoaderFaults",
    "ModelConfig",
    "RankInfo",
    "SimSglang",
    "SimVllm",
    "build_state_dict",
    "parameter_shapes",
    "pp_layers",
    "reassemble",
    "save_checkpoint",
    "step",
]
