"""What a rank runs for the end-state check's reset: overwrite every byte of every weight with a known byte.

This is the rank side (an agent's reset callable, the vLLM worker extension, the
simulated engine): torch only, no pandas. Everything that judges the result is
:mod:`wcviz.endstate.classify`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["POISON_BYTE", "POISON_BYTES", "poison_"]

POISON_BYTE = 0xA5  # 1010_0101: no float8/16/32/64 NaN, no common init value, never all-zero
POISON_BYTES = (POISON_BYTE, 0x5A)  # alternate resets use the other: a leftover poison still changes


def _named(tensors: Any, include_buffers: bool) -> list[tuple[str, torch.Tensor]]:
    import torch

    if isinstance(tensors, torch.nn.Module):
        named: list[tuple[str, torch.Tensor]] = list(tensors.named_parameters(remove_duplicate=False))
        if include_buffers:
            named += list(tensors.named_buffers(remove_duplicate=False))
        return named
    if isinstance(tensors, Mapping):
        return list(tensors.items())
    if isinstance(tensors, Iterable):
        return list(tensors)
    raise TypeError(f"poison_ expects a module, a mapping of name -> tensor or (name, tensor) pairs, got {type(tensors).__name__}")


def poison_(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | torch.nn.Module,
    *,
    include_buffers: bool = False,
    byte: int = POISON_BYTE,
) -> None:
    """Overwrite every byte of every tensor, in place, with ``byte`` (one of :data:`POISON_BYTES`).

    Alternate the byte between resets: a parameter a failed reload left holding the
    last poison would not change under the same poison again, and the check would be void.

    Works on bytes (each tensor is viewed as a same-width integer), so every dtype
    is poisoned alike - bool, float8, bf16, 0-d, all-zero, strided views - and the
    pattern is deterministic, finite for every float format and unlike any trained
    or initialised weight. Poisoned values are not meant to be computed with (a
    bool holds byte 0xA5). Empty tensors hold no bytes and cannot change: the
    reset does not *cover* them (:func:`wcviz.endstate.reset_coverage` lists them apart). A
    module's buffers are left alone unless ``include_buffers``: a weight update
    usually does not resend them. A tensor that already holds only 0xA5 bytes does
    not change either; the coverage check reports it.
    """
    import torch

    if byte not in POISON_BYTES:
        raise ValueError(f"poison byte must be one of {', '.join(hex(b) for b in POISON_BYTES)} (never NaN in any float format), got {byte!r}")
    widths = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    with torch.no_grad():
        for name, t in _named(tensors, include_buffers):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
            if t.numel() == 0:
                continue
            w = t.detach()
            if w.is_quantized or w.is_sparse or w.device.type == "meta":
                raise TypeError(f"{name}: cannot poison a {'quantized' if w.is_quantized else 'sparse' if w.is_sparse else 'meta'} tensor in place")
            if w.is_complex() and w.element_size() == 16:
                w = torch.view_as_real(w)
            width = widths.get(w.element_size())
            if width is None:
                raise TypeError(f"{name}: dtype {t.dtype} has {w.element_size()} bytes per element, which poison_ cannot fill")
            if w.dtype != width:
                w = w.view(width)
            n = w.element_size()
            w.fill_(byte if n == 1 else int.from_bytes(bytes([byte]) * n, "little", signed=True))
