"""Cut one rank's piece of an engine parameter out of full Hugging Face tensors, one function per kind.

Each function takes the rule's source tensors (for the FusedMoE kinds: one tuple
per local expert) and the rank's :class:`Cut`, and returns the piece. Nothing
here knows names, stages or checkpoints; errors say which dim does not divide.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from wcviz.layouts._rules import KINDS, LayoutError

__all__ = ["SPLITS", "Cut", "padded_vocab"]


@dataclass(frozen=True)
class Cut:
    """What a rank's piece depends on: its TP slot (and the MoE's own), heads, vocab padding."""

    tp: int
    tp_size: int
    heads: int
    kv_heads: int
    vocab_padding: int
    moe_tp: int  # the slice of each FusedMoE expert: the rank's slot among the stage's tp * dp ranks (0 under EP)
    moe_tp_size: int  # in how many slices each expert is cut (vLLM: tp * dp, SGLang: tp / ep; 1: whole experts)
    w13_order: str = "w1w3"  # each expert's w13 halves: "w1w3" as loaded, "w3w1" as FlashInfer CUTLASS swaps them
    engine: str = "vllm"  # whose vocabulary padding


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def padded_vocab(vocab: int, padding: int, tp: int, engine: str = "vllm") -> int:
    """Rows of a vocab-parallel parameter over all ranks: ``vocab`` rounded up to ``padding``, as ``engine`` pads it.

    When tp does not divide that, SGLang pads to a multiple of ``padding * tp``
    instead (``sglang/srt/layers/vocab_parallel_embedding.py:273-274``) and vLLM
    cannot start (``vllm/.../vocab_parallel_embedding.py:304``: ``divide()`` asserts):
    a LayoutError. ``padding=1`` is the simulated engine's, which pads to a multiple
    of tp as SGLang does, whichever engine it plays.
    """
    rows = _round_up(vocab, padding)
    if rows % tp == 0:
        return rows
    if engine == "vllm" and padding != 1:
        raise LayoutError(
            f"vLLM cannot start with tp={tp} and this vocabulary: {vocab} rows padded to a multiple of {padding} "
            f"are {rows}, which tp={tp} does not divide (VocabParallelEmbedding's divide() asserts)"
        )
    return _round_up(vocab, padding * tp)


def _part(t: torch.Tensor, dim: int, index: int, parts: int, what: str) -> torch.Tensor:
    """Part ``index`` of ``parts`` equal parts of ``t`` along ``dim``."""
    n = t.shape[dim]
    if n % parts:
        raise LayoutError(f"{what}: dim {dim} ({n}) does not divide by {parts}")
    size = n // parts
    return t.narrow(dim, index * size, size)


def _replicated(src: Sequence[torch.Tensor], c: Cut, what: str) -> torch.Tensor:
    return src[0]


def _column(src: Sequence[torch.Tensor], c: Cut, what: str) -> torch.Tensor:
    return _part(src[0], 0, c.tp, c.tp_size, f"{what} (tp={c.tp_size})")


def _row(src: Sequence[torch.Tensor], c: Cut, what: str) -> torch.Tensor:
    return _part(src[0], 1, c.tp, c.tp_size, f"{what} (tp={c.tp_size})")


def _merged_column(src: Sequence[torch.Tensor], c: Cut, what: str) -> torch.Tensor:
    return torch.cat([_part(s, 0, c.tp, c.tp_size, f"{what} (tp={c.tp_size})") for s in src])


def _vocab(src: Sequence[torch.Tensor], c: Cut, what: str) -> torch.Tensor:
    full = src[0]
    rows = padded_vocab(full.shape[0], c.vocab_padding, c.tp_size, c.engine) // c.tp_size
    piece = full[c.tp * rows : (c.tp + 1) * rows]
    out = torch.zeros((rows, *full.shape[1:]), dtype=full.dtype, device=full.device)  # vLLM zero-fills padding
    out[: piece.shape[0]] = piece
    return out


def _heads(t: torch.Tensor, heads: int, what: str) -> int:
    """Rows per head of a q/k/v tensor of ``heads`` heads."""
    if t.shape[0] % heads:
        raise LayoutError(f"{what}: dim 0 ({t.shape[0]}) does not divide by {heads} heads")
    return t.shape[0] // heads


def _qkv(src: Sequence[torch.Tensor], c: Cut, what: str) -> torch.Tensor:
    q, k, v = src
    size = _heads(q, c.heads, f"{what} q")
    if _heads(k, c.kv_heads, f"{what} k") != size or _heads(v, c.kv_heads, f"{what} v") != size:
        raise LayoutError(
            f"{what}: heads={c.heads} and kv_heads={c.kv_heads} give q {size} rows per head but k "
            f"{k.shape[0] // c.kv_heads} and v {v.shape[0] // c.kv_heads}: check heads and kv_heads"
        )
    q_heads = c.heads // c.tp_size
    if c.tp_size <= c.kv_heads:  # kv heads split like q heads
        kv_heads, kv_slot = c.kv_heads // c.tp_size, c.tp
    else:  # one kv head per rank, each replicated over tp // kv_heads consecutive ranks
        kv_heads, kv_slot = 1, c.tp // (c.tp_size // c.kv_heads)
    return torch.cat(
        [
            q.narrow(0, c.tp * q_heads * size, q_heads * size),
            k.narrow(0, kv_slot * kv_heads * size, kv_heads * size),
            v.narrow(0, kv_slot * kv_heads * size, kv_heads * size),
        ]
    )


def _moe_w13(experts: Sequence[Sequence[torch.Tensor]], c: Cut, what: str) -> torch.Tensor:
    w = f"{what} (moe tp={c.moe_tp_size})"
    ordered = [pair if c.w13_order == "w1w3" else pair[::-1] for pair in experts]  # sources are (w1, w3)
    return torch.stack([torch.cat([_part(s, 0, c.moe_tp, c.moe_tp_size, w) for s in pair]) for pair in ordered])


def _moe_w2(experts: Sequence[Sequence[torch.Tensor]], c: Cut, what: str) -> torch.Tensor:
    w = f"{what} (moe tp={c.moe_tp_size})"
    return torch.stack([_part(one[0], 1, c.moe_tp, c.moe_tp_size, w) for one in experts])


SPLITS: dict[str, Callable[..., torch.Tensor]] = {
    "replicated": _replicated,
    "column": _column,
    "row": _row,
    "vocab": _vocab,
    "qkv": _qkv,
    "merged_column": _merged_column,
    "moe_w13": _moe_w13,
    "moe_w2": _moe_w2,
}
assert set(SPLITS) == set(KINDS)
