"""Where ranks sit and what each owns: pure arithmetic, written from vLLM's and SGLang's rules.

- Ranks: vLLM orders a (DP, PP, TP) world TP-fastest, so global
  ``rank = (dp * pp_size + pp) * tp_size + tp``.
- Pipeline stages: every stage gets ``layers // pp`` layers. vLLM
  (``vllm/distributed/utils.py:198-241`` ``get_pp_indices``, without
  ``VLLM_PP_LAYER_PARTITION``) gives the ``layers % pp`` leftovers one each to the
  stages *before the last*, counting back from it (10 layers over 4 stages: 2, 3,
  3, 2); SGLang (``sglang/srt/distributed/utils.py:110-150``, without
  ``SGLANG_PP_LAYER_PARTITION``) to the *last* stages (2, 2, 3, 3).
- Experts (``FusedMoE``): vLLM spreads MoE layers over every TP x DP rank of a
  stage, group rank ``dp * tp_size + tp`` (with DP, attention is replicated but
  the experts are not). Without expert parallelism each expert is sliced over
  all ``tp * dp`` of them; with ``enable_expert_parallel`` the same group ranks
  are the EP ranks, and each holds a contiguous block of whole experts (linear
  placement): ``experts // ep`` each, the first ``experts % ep`` ranks one more.
  SGLang keeps the experts inside each DP replica's TP group: ``--ep-size`` ranks
  of ``tp / ep`` each, EP rank ``tp // (tp / ep)`` holding a block of
  ``experts / ep`` experts, each sliced over ``tp / ep`` ranks
  (``sglang/srt/runtime_context.py:128-133``,
  ``layers/moe/fused_moe_triton/layer.py:390-428``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Coords", "MoePlace", "expert_block", "moe_place", "rank_coords", "stage_layers"]

Coords = dict  # {"rank", "dp", "pp", "tp", "ep"}: a rank's identity, as the frame's IDENTITY columns


def stage_layers(layers: int, pp: int, engine: str = "vllm") -> list[range]:
    """The layers each of ``pp`` pipeline stages owns, in stage order, as ``engine`` splits them."""
    sizes = [layers // pp] * pp
    for back in range(layers % pp):
        if engine == "sglang":
            sizes[pp - 1 - back] += 1  # the last stage, then the one before it (SGLang utils.py:140-145)
        else:
            sizes[pp - 2 - back] += 1  # the stage before the last, then the one before it (vLLM utils.py:228-230)
    starts = [sum(sizes[:p]) for p in range(pp)]
    return [range(s, s + n) for s, n in zip(starts, sizes)]


def expert_block(experts: int, ep_rank: int, ep: int) -> range:
    """The contiguous experts EP rank ``ep_rank`` of ``ep`` holds."""
    base, extra = divmod(experts, ep)
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + base + (ep_rank < extra))


@dataclass(frozen=True)
class MoePlace:
    """A rank's part of a FusedMoE layer: its EP rank (None without EP) and its slice of each local expert."""

    ep_rank: int | None
    moe_tp: int  # which slice of each expert
    moe_tp_size: int  # in how many slices each expert is cut


def moe_place(coords: Coords, tp: int, dp: int, ep: int, engine: str = "vllm") -> MoePlace:
    """Where a rank sits in its FusedMoE group: vLLM's tp * dp ranks of a stage, or SGLang's tp ranks of a replica."""
    if engine == "sglang":  # runtime_context.py:128-133 with moe_dp_size 1
        per = tp // ep
        return MoePlace(coords["tp"] // per if ep > 1 else None, coords["tp"] % per, per)
    slot = coords["dp"] * tp + coords["tp"]  # vLLM fused_moe/config.py:1106-1245
    return MoePlace(slot, 0, 1) if ep > 1 else MoePlace(None, slot, tp * dp)


def rank_coords(tp: int, pp: int, dp: int, ep: int, engine: str = "vllm") -> Iterator[Coords]:
    """Every rank's coordinates in global rank order; ``ep`` is the EP rank, None unless ep > 1."""
    for d in range(dp):
        for p in range(pp):
            for t in range(tp):
                coords = {"rank": (d * pp + p) * tp + t, "dp": d, "pp": p, "tp": t}
                yield {**coords, "ep": moe_place({**coords, "ep": None}, tp, dp, ep, engine).ep_rank}
