"""A tensor's logical bytes, and the 64-bit lanes the digest folds.

Every dtype PyTorch has becomes bytes the same way: reinterpret the elements as
an integer type of the same width (a view, legal for any strides), make that
contiguous (integer copies exist on every device), and view it as ``uint8``.
So a transposed view digests like its contiguous copy, and no float kernel is
ever asked to copy an exotic dtype (float8, uint3, bits16, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wcviz._errors import DigestError

if TYPE_CHECKING:
    import torch

__all__ = ["check_digestible", "check_storage", "logical_bytes", "lanes_of", "seed_args"]



def _label(name: str | None) -> str:
    return f"tensor {name!r}" if name is not None else "tensor"


def check_digestible(t: object, name: str | None = None) -> None:
    """Raise a :class:`DigestError` naming ``name`` if ``t`` has no bytes to digest."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise DigestError(f"{_label(name)} is a {type(t).__name__}, not a torch.Tensor")
    if t.is_nested:  # layout strided or jagged: either way no one flat buffer of elements
        raise DigestError(
            f"{_label(name)} is a nested tensor (layout {t.layout}); digest its components "
            "(t.unbind()) separately"
        )
    if t.layout != torch.strided:
        raise DigestError(
            f"{_label(name)} is not dense (layout {t.layout}); digest t.to_dense() or its "
            "indices and values separately"
        )
    if t.device.type == "meta":
        raise DigestError(f"{_label(name)} is on the meta device: it holds no data to digest")
    kind = type(t)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter:
        _check_subclass(t, kind, name)
    if t._is_zerotensor():
        raise DigestError(
            f"{_label(name)} is a ZeroTensor (autograd's all-zero placeholder, with no storage); "
            "digest torch.zeros(t.shape, dtype=t.dtype) if its zeros are what you mean"
        )
    check_storage(t, name)


def check_storage(t: torch.Tensor, name: str | None = None) -> None:
    """A :class:`DigestError` naming ``name`` if ``t``'s storage is smaller than its elements reach: storage freed
    or shrunk under a live tensor (FSDP frees a resharded parameter with ``untyped_storage().resize_(0)``). Read
    anyway, such a tensor crashes the process or digests whatever memory lies beyond."""
    if t.numel() == 0 or t.is_quantized:  # (quint4x2 packs elements in a byte: read through int_repr, checked by torch)
        return
    reach = t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    need, have = reach * t.element_size(), t.untyped_storage().nbytes()
    if have < need:
        raise DigestError(
            f"{_label(name)} ({t.dtype} {list(t.shape)}) reaches {need} bytes into its storage, which holds {have}: "
            "its storage was freed or resized under it (a resharded FSDP parameter?); digest it where its data is whole"
        )


def _check_subclass(t: torch.Tensor, kind: type, name: str | None) -> None:
    """Refuse a tensor subclass whose bytes are not its own storage: a wrapper that dispatches every op
    itself (DTensor, FakeTensor, FunctionalTensor, quantized-weight wrappers) or a lazy module's
    uninitialized parameter. A subclass that only adds Python behaviour over real storage is digested."""
    import torch

    if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):  # type: ignore[attr-defined]
        raise DigestError(f"{_label(name)} is an uninitialized parameter of a lazy module: run the module once first")
    if getattr(kind, "__torch_dispatch__", None) is getattr(torch.Tensor, "__torch_dispatch__", None):
        return
    hint = ": digest a plain tensor of the value you mean (unwrap it, or dequantize it)"
    if kind.__name__ == "DTensor":
        hint = ": digest t.to_local() for this rank's shard, or t.full_tensor() for the whole parameter"
    raise DigestError(
        f"{_label(name)} is a {kind.__module__}.{kind.__qualname__}, a tensor subclass whose bytes are not "
        f"its own storage{hint}"
    )


def seed_args(t: torch.Tensor) -> tuple[str, tuple[int, ...], int]:
    """What the seeds are made from: ``(str(dtype), shape, nbytes)`` (the dtype with its ``torch.`` prefix)."""
    return str(t.dtype), tuple(int(d) for d in t.shape), t.numel() * t.element_size()


def logical_bytes(t: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Flat contiguous ``uint8`` tensor of ``t``'s elements in row-major order, on its device."""
    import torch

    check_digestible(t, name)
    t = t.detach()
    if t.is_conj() or t.is_neg():  # lazy conjugate / negative views: their values, as every other path sees them
        t = t.resolve_conj().resolve_neg()
    if t.is_quantized:
        t = t.int_repr()
    if t.is_complex() and t.element_size() == 16:
        t = torch.view_as_real(t)  # complex128 -> (..., 2) float64: same bytes, same order
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    if width is None:
        raise DigestError(f"{_label(name)} has dtype {t.dtype} of {t.element_size()} bytes per element, which wcviz cannot read")
    if t.dtype != width:
        t = t.view(width)
    if t.numel() == 0:  # an empty view may carry stride 0, which view(uint8) rejects
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    flat = t.contiguous().reshape(-1)
    if flat.stride(0) != 1:  # one element: "contiguous" whatever its stride, so nothing above copied it
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def lanes_of(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian 64-bit lanes (as ``int64``) of a flat ``uint8`` tensor, zero-padded.

    Aligned data whose length is a multiple of 8 is viewed in place; anything
    else (an odd tail, a slice at an unaligned storage offset) is copied once.
    """
    import torch

    n = raw.numel()
    if n % 8 == 0 and raw.storage_offset() % 8 == 0 and raw.data_ptr() % 8 == 0:
        return raw.view(torch.int64)
    buf = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=raw.device)
    buf[:n] = raw
    return buf.view(torch.int64)
