"""Digests of raw bytes, for readers that hold bytes rather than tensors (checkpoints).

The result equals :func:`wcviz.digest.digest_hex` of the tensor the bytes encode.
Nothing here imports torch unless a dtype name is one only torch knows: the CLI
digests a checkpoint with numpy arrays and the numba kernel alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from wcviz._errors import DigestError
from wcviz.digest import _pool, _spec
from wcviz.digest._api import DEFAULT_ALGO, Digest, _check_algo, _hex_words, _words, parse_dtype, resolve_backend
from wcviz.digest._sha256 import sha256_hex

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["digest_buffer", "digest_buffers"]

# PyTorch's names of the dtypes checkpoints hold, with their widths: what digest_buffer needs without torch
_WIDTHS = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "float16": 2, "bfloat16": 2, "uint32": 4, "int32": 4,
    "float32": 4, "uint64": 8, "int64": 8, "float64": 8, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "float8_e8m0fnu": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}  # fmt: skip


def _dtype_of(dtype: Any) -> tuple[str, int]:
    """``("torch.<name>", bytes per element)`` of a dtype or its name, importing torch only for names not listed."""
    if isinstance(dtype, str):
        bare = dtype.removeprefix("torch.")
        if bare in _WIDTHS:
            return f"torch.{bare}", _WIDTHS[bare]
    dt = parse_dtype(dtype)
    return str(dt), dt.itemsize


def digest_buffer(
    raw: np.ndarray,
    dtype: torch.dtype | str,
    shape: Sequence[int],
    *,
    algo: str = DEFAULT_ALGO,
    backend: str = "auto",
    name: str | None = None,
) -> Digest:
    """Digest raw little-endian bytes as a tensor of ``dtype`` and ``shape`` would be.

    For readers (checkpoints) that hold bytes, not tensors: the result equals
    :func:`digest_hex` of the tensor those bytes encode. ``raw`` is a 1-D
    ``uint8`` array of exactly ``nbytes``, or longer with zero padding after.
    """
    import numpy as np

    dtype_name, itemsize = _dtype_of(dtype)  # torch is imported only for a dtype name it alone knows
    shape = tuple(int(d) for d in shape)
    nbytes = _nbytes(itemsize, shape)
    if raw.dtype != np.uint8 or raw.ndim != 1 or raw.shape[0] < nbytes:
        what = f"tensor {name!r}" if name else "buffer"
        raise DigestError(f"{what}: expected at least {nbytes} bytes of uint8 for {dtype_name} {list(shape)}, got {raw.shape[0]} {raw.dtype}")
    if _check_algo(algo) == "sha256":
        return Digest(sha256_hex(raw.data, dtype_name, shape, nbytes), "sha256")
    if algo != _spec.ALGO:
        from wcviz.digest._engines import engine_digest

        return Digest(engine_digest(algo, raw[:nbytes]), algo)
    padded = (nbytes + 7) // 8 * 8
    if raw.shape[0] >= padded and raw.ctypes.data % 8 == 0 and not raw[nbytes:padded].any():
        lanes = raw[:padded].view(np.uint64)
    else:
        buf = np.zeros(padded, dtype=np.uint8)
        buf[:nbytes] = raw[:nbytes]
        lanes = buf.view(np.uint64)
    seed = _spec.seeds(dtype_name, shape, nbytes)
    chosen = resolve_backend(backend, "cpu", name)
    if chosen == "numba":  # no torch at all: a checkpoint reader (the CLI) starts at once
        from wcviz.digest import _numba

        return _hex_words(list(_numba.lanes_digest(lanes, seed)))
    import torch

    return _hex_words(_words(torch.from_numpy(lanes.view(np.int64)), seed, chosen).tolist())


def digest_buffers(
    buffers: Iterable[tuple[np.ndarray, torch.dtype | str, Sequence[int], str | None]],
    *,
    algo: str = DEFAULT_ALGO,
    backend: str = "auto",
    done: Callable[[int], None] | None = None,
) -> list[tuple[Digest, float]]:
    """:func:`digest_buffer` of each ``(raw, dtype, shape, name)``: ``[(digest, seconds)]`` in order.

    The SHA-256 algorithms (one stream per buffer) run several buffers side by side, on
    as many threads as the numba kernel may use; "nemo-rl-v3" and "sglang-gpu" run one
    buffer at a time (their kernels use every thread on each). ``buffers`` is read
    lazily, never more buffers held in flight than threads. ``done(nbytes)`` is called
    as each finishes.
    """
    threads = None if _check_algo(algo) in _pool.HASHLIB_ALGOS else 1
    jobs = (
        (functools.partial(digest_buffer, raw, dtype, shape, algo=algo, backend=backend, name=name), _nbytes(_dtype_of(dtype)[1], shape))
        for raw, dtype, shape, name in buffers
    )
    return _pool.side_by_side(jobs, threads=threads, done=done)


def _nbytes(itemsize: int, shape: Sequence[int]) -> int:
    """Bytes of a tensor, in Python integers (no int64 product that could wrap for a header's absurd shape)."""
    n = itemsize
    for d in shape:
        n *= int(d)
    return n
