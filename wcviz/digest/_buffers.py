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
from wcviz.digest._api import DEFAULT_ALGO, Digest, _check_algo, _hex_words, _words, parse_dtype, resolve_backend, whole_dims
from wcviz.digest._sha256 import sha256_hex

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["digest_buffer", "digest_buffers"]

# PyTorch's names of the dtypes checkpoints hold, with their widths: what digest_buffer needs without torch
_WIDTHS = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "float16": 2, "bfloat16": 2, "uint32": 4, "int32": 4,
    "float32": 4, "uint64": 8, "int64": 8, "float64": 8, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "float8_e8m0fnu": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float4_e2m1fn_x2": 1,
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

    dtype_name, shape, nbytes = _checked(raw, dtype, shape, name)  # torch is imported only for a dtype name it alone knows
    if raw.strides[0] != 1 and raw.shape[0] > 1:  # a strided view: its bytes in order, in one piece
        raw = np.ascontiguousarray(raw[:nbytes])
    if _check_algo(algo, backend) == "sha256":
        return Digest(sha256_hex(raw.data, dtype_name, shape, nbytes), "sha256")
    if algo != _spec.ALGO:
        from wcviz.digest._engines import engine_digest

        return Digest(engine_digest(algo, raw[:nbytes]), algo)
    lanes = _lanes(raw, nbytes)
    seed = _spec.seeds(dtype_name, shape, nbytes)
    chosen = resolve_backend(backend, "cpu", name)
    if chosen == "numba":  # no torch at all: a checkpoint reader (the CLI) starts at once
        from wcviz.digest import _numba

        return _hex_words(list(_numba.lanes_digest(lanes, seed)))
    import warnings

    import torch

    with warnings.catch_warnings():  # a read-only memory map: the digest only reads it, as PyTorch's warning fears not
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        lanes_t = torch.from_numpy(lanes.view(np.int64))
    return _hex_words(_words(lanes_t, seed, chosen).tolist())


WINDOW_BYTES = 512 << 20
"""Bytes of buffers :func:`digest_buffers` digests in one numba kernel call by default: views of a memory-mapped
checkpoint cost no memory, and a few calls per file keep its progress bar moving."""
_MOST_HELD = 4096  # buffers in one batch, whatever their bytes


def digest_buffers(
    buffers: Iterable[tuple[np.ndarray, torch.dtype | str, Sequence[int], str | None]],
    *,
    algo: str = DEFAULT_ALGO,
    backend: str = "auto",
    done: Callable[[int], None] | None = None,
    window_bytes: int | None = None,
) -> list[tuple[Digest, float]]:
    """:func:`digest_buffer` of each ``(raw, dtype, shape, name)``: ``[(digest, seconds)]`` in order.

    "nemo-rl-v3" on the numba backend digests the buffers in batches: a batch ends at
    the first buffer that brings it to ``window_bytes`` (default :data:`WINDOW_BYTES`;
    0: every buffer alone), and one kernel call spreads the work of all its buffers
    over the threads (no thread start-up and no idle tail per buffer); the batch's
    seconds are shared out by bytes. The SHA-256 algorithms (one stream per buffer) run
    several buffers side by side, on as many threads as the numba kernel may use, each
    timed on its own; the rest run one buffer at a time. ``buffers`` is read lazily: a
    batch's buffers, or as many as there are threads, are held at once (pass a small
    ``window_bytes`` when each buffer is a copy). ``done(nbytes)`` is called as each
    finishes.
    """
    if window_bytes is not None and (isinstance(window_bytes, bool) or not isinstance(window_bytes, int) or window_bytes < 0):
        raise ValueError(f"window_bytes must be a whole number of bytes >= 0, got {window_bytes!r}")
    if _check_algo(algo, backend) == _spec.ALGO and resolve_backend(backend, "cpu") == "numba":
        return _batched(buffers, done, WINDOW_BYTES if window_bytes is None else window_bytes)
    threads = None if algo in _pool.HASHLIB_ALGOS else 1
    jobs = (
        (functools.partial(digest_buffer, raw, dtype, shape, algo=algo, backend=backend, name=name), _nbytes(_dtype_of(dtype)[1], shape))
        for raw, dtype, shape, name in buffers
    )
    return _pool.side_by_side(jobs, threads=threads, done=done)


def _batched(
    buffers: Iterable[tuple[np.ndarray, torch.dtype | str, Sequence[int], str | None]],
    done: Callable[[int], None] | None,
    window_bytes: int,
) -> list[tuple[Digest, float]]:
    """The numba path of :func:`digest_buffers`: batches of buffers, one ``lanes_digest_at`` call each."""
    import time

    import numpy as np

    from wcviz.digest import _numba

    out: list[tuple[Digest, float]] = []
    held: list[np.ndarray] = []  # the batch's lanes (views of the buffers, or padded copies): alive until its call returns
    sizes: list[int] = []
    seeds: list[tuple[int, int]] = []

    def flush() -> None:
        t0 = time.perf_counter()
        words = _numba.lanes_digest_at(
            np.array([a.ctypes.data for a in held], dtype=np.uint64),
            np.array([a.shape[0] * 8 for a in held], dtype=np.int64),  # whole lanes: the tail is zero-padded already
            np.array(seeds, dtype=np.uint64).reshape(-1, 2),
            held,
        )
        per_byte = (time.perf_counter() - t0) / (sum(sizes) or 1)
        for d, n in zip(Digest.many(_spec.hex_rows(words), _spec.ALGO), sizes):
            out.append((d, n * per_byte))
            if done is not None:
                done(n)
        held.clear()
        sizes.clear()
        seeds.clear()

    batch = 0
    for raw, dtype, shape, name in buffers:
        dtype_name, shape, nbytes = _checked(raw, dtype, shape, name)
        held.append(_lanes(raw, nbytes))
        sizes.append(nbytes)
        seeds.append(_spec.seeds(dtype_name, shape, nbytes))
        batch += nbytes
        if batch >= window_bytes or len(held) >= _MOST_HELD:
            flush()
            batch = 0
    if held:
        flush()
    return out


def _checked(raw: np.ndarray, dtype: torch.dtype | str, shape: Sequence[int], name: str | None) -> tuple[str, tuple[int, ...], int]:
    """``(dtype name, shape, nbytes)`` of a buffer, or a :class:`DigestError` naming it when ``raw`` is not
    at least that many ``uint8``."""
    import numpy as np

    what = f"tensor {name!r}" if name else "buffer"
    dtype_name, itemsize = _dtype_of(dtype)
    dims = whole_dims(shape, what)
    nbytes = _nbytes(itemsize, dims)
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 1:
        got = f"a {raw.ndim}-d {raw.dtype} array of shape {list(raw.shape)}" if isinstance(raw, np.ndarray) else f"a {type(raw).__name__}"
        raise DigestError(f"{what}: expected a 1-d uint8 array of at least {nbytes} bytes for {dtype_name} {list(dims)}, got {got}")
    if raw.shape[0] < nbytes:
        raise DigestError(f"{what}: expected at least {nbytes} bytes of uint8 for {dtype_name} {list(dims)}, got {raw.shape[0]}")
    return dtype_name, dims, nbytes


def _lanes(raw: np.ndarray, nbytes: int) -> np.ndarray:
    """The ``uint64`` lanes the digest folds: a view of ``raw`` where it is aligned and zero after ``nbytes``
    up to whole lanes, else a zero-padded copy."""
    import numpy as np

    padded = (nbytes + 7) // 8 * 8
    contiguous = raw.strides[0] == 1 or raw.shape[0] <= 1  # a strided view (``raw[::2]``) is read through a copy
    if contiguous and raw.shape[0] >= padded and raw.ctypes.data % 8 == 0 and not raw[nbytes:padded].any():
        return raw[:padded].view(np.uint64)
    buf = np.zeros(padded, dtype=np.uint8)
    buf[:nbytes] = raw[:nbytes]
    return buf.view(np.uint64)


def _nbytes(itemsize: int, shape: Sequence[int]) -> int:
    """Bytes of a tensor, in Python integers (no int64 product that could wrap for a header's absurd shape)."""
    n = itemsize
    for d in shape:
        n *= int(d)
    return n
