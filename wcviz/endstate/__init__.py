"""The end-state check: prove, rank by rank, that a reload writes every weight back.

As SGLang's weight checker, NeMo-RL's value check and slime's
``--check-weight-update-equal`` do it, for every engine rank: snapshot (digest what it
holds), reset (overwrite every parameter with a known pattern), reload (run the weight
update again), classify (reload against snapshot, per parameter). Five parts:

- :mod:`~wcviz.endstate.poison` - what a rank runs for the reset (no pandas);
- :mod:`~wcviz.endstate.classify` - frames in, verdicts out; proves the reset covered
  every parameter from the digest a fully reset one must have;
- :mod:`~wcviz.endstate.session` - one session over a small fleet protocol
  (:class:`Fleet`), and :func:`run`, the whole check in order;
- :mod:`~wcviz.endstate.fleets` - the fleets of wcviz's own ranks: HTTP agents,
  callables, and the one-call checks on them (:func:`check_agents`, :func:`run_check`);
- :mod:`~wcviz.endstate.engines` - the engines' own checkers, nothing of wcviz installed
  in the engine: vLLM's (:class:`VllmCheckerFleet`, :func:`vllm_endstate`) and SGLang's
  (:class:`SglangFleet`, :func:`sglang_endstate`).

The statuses and the verdict columns are :mod:`wcviz.verdicts`'.
"""

from __future__ import annotations

from wcviz.endstate.classify import PHASES, RESET_PATTERNS, ResetNotCovered, classify, reset_coverage
from wcviz.endstate.engines import (
    EngineEndstate,
    SglangEndstate,
    SglangFleet,
    VllmCheckerFleet,
    sglang_endstate,
    vllm_endstate,
)
from wcviz.endstate.fleets import AgentFleet, CallableFleet, check_agents, run_check
from wcviz.endstate.poison import POISON_BYTE, POISON_BYTES, poison_
from wcviz.endstate.session import PROBLEM_COLUMNS, EndStateReport, EndStateSession, EngineLeftPoisoned, Fleet, ReloadUnverified, SnapshotUnusable, run
from wcviz.verdicts import ENDSTATE_STATUSES
from wcviz.verdicts import summary as summary

__all__ = [
    "ENDSTATE_STATUSES",
    "PHASES",
    "POISON_BYTE",
    "POISON_BYTES",
    "PROBLEM_COLUMNS",
    "RESET_PATTERNS",
    "AgentFleet",
    "CallableFleet",
    "EndStateReport",
    "EndStateSession",
    "EngineEndstate",
    "EngineLeftPoisoned",
    "ReloadUnverified",
    "Fleet",
    "ResetNotCovered",
    "SglangEndstate",
    "SglangFleet",
    "SnapshotUnusable",
    "VllmCheckerFleet",
    "check_agents",
    "classify",
    "poison_",
    "reset_coverage",
    "run",
    "run_check",
    "sglang_endstate",
    "summary",
    "vllm_endstate",
]
