"""Where ranks sit and what each owns: pure arithmetic, written from vLLM's rules.

- Ranks: vLLM orders a (DP, PP, TP) world TP-fastest, so global
  ``rank = (dp * pp_size + pp) * tp_size + tp``.
- Pipeline stages (``vllm.distributed.utils.get_pp_indices`` without
  ``VLLM_PP_LAYER_PARTITION``): every stage gets ``layers // pp`` layers and the
  ``layers % pp`` leftovers go one each to the stages *before the last*, counting
  back from it (10 layers over 4 stages: 2, 3, 3, 2).
- Experts (``FusedMoE``): vLLM spreads MoE layers over every TP x DP rank of a
  stage, group rank ``dp * tp_size + tp`` (with DP, attention is replicated but
  the experts are not). Without expert parallelism each expert is sliced over
  all ``tp * dp`` of them; with ``enable_expert_parallel`` the same group ranks
  are the EP ranks, and each holds a contiguous block of whole experts (linear
  placement): ``experts // ep`` each, the first ``experts % ep`` ranks one more.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["Coords", "expert_block", "moe_slot", "rank_coords", "stage_layers"]

Coords = dict  # {"rank", "dp", "pp", "tp", "ep"}: a rank's identity, as the frame's IDENTITY columns


def stage_layers(layers: int, pp: int) -> list[range]:
    """The layers each of ``pp`` pipeline stages owns, in stage order."""
    sizes = [layers // pp] * pp
    for back in range(layers % pp):
        sizes[pp - 2 - back] += 1  # the stage before the last, then the one before it, ...
    starts = [sum(sizes[:p]) for p in range(pp)]
    return [range(s, s + n) for s, n in zip(starts, sizes)]


def expert_block(experts: int, ep_rank: int, ep: int) -> range:
    """The contiguous experts EP rank ``ep_rank`` of ``ep`` holds."""
    base, extra = divmod(experts, ep)
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + base + (ep_rank < extra))


def moe_slot(coords: Coords, tp: int) -> int:
    """A rank's place in its stage's FusedMoE group of tp * dp ranks (its EP rank under expert parallelism)."""
    return coords["dp"] * tp + coords["tp"]


def rank_coords(tp: int, pp: int, dp: int, ep: int) -> Iterator[Coords]:
    """Every rank's coordinates in global rank order; ``ep`` is None unless ep > 1."""
    for d in range(dp):
        for p in range(pp):
            for t in range(tp):
                yield {"rank": (d * pp + p) * tp + t, "dp": d, "pp": p, "tp": t, "ep": d * tp + t if ep > 1 else None}
