"""The engines' own weight checksums, bit-identical, so wcviz can say what a live engine's checker must report.

Three algorithms, each over a tensor's raw bytes in row-major order (no dtype, no
shape: two tensors with the same bytes hash alike):

- ``vllm-sha256``: vLLM 0.33's ``/weight_checker`` (``model_loader/weight_checksum.py``):
  ``sha256(weight.detach().cpu().contiguous().view(-1).view(torch.uint8))``, 64 hex.
- ``sglang-cpu``: SGLang 0.5.23's checksum of a tensor on the CPU
  (``managers/mm_utils.py`` ``tensor_hash``): the first 8 bytes of SHA-256 of the raw
  bytes, read big-endian, as 16 hex.
- ``sglang-gpu``: SGLang 0.5.23's checksum of a CUDA tensor
  (``sglang/kernels/ops/memory/gpu_tensor_hash.py``), as 16 hex. The bytes are zero
  padded to 32-bit little-endian words; word ``i`` (its index in the whole tensor) is
  mixed twice, ``fmix32(v ^ p1(i))`` and ``fmix32(v ^ p2(i))`` with position keys
  ``p1 = (i*0x27D4EB2D + s1) ^ rotl(i, 15)``, ``p2 = (i*0x165667B1 + s2) ^ rotl(i, 13)``
  (``s1 = 0x243F6A88``, ``s2 = (s1*0x9E3779B1) ^ 0xDEADBEEF``, all mod 2^32); each tile
  of 8192 words sums both lanes mod 2^32, xors in the padded byte count, mixes them
  (``fmix32``) and packs ``lane1 << 32 | lane2``; the tiles are summed mod 2^64 and the
  sum goes through SplitMix64's finaliser. An empty tensor is ``0``. (SGLang indexes
  words in int32: tensors of 8 GiB and more overflow there; here they do not.)

On the CPU ``sglang-gpu`` runs in a compiled numba kernel (threads across tiles); on
CUDA in vectorised torch, chunk by chunk, on the device. :func:`reference_sglang_gpu`
is the plain numpy transcription the tests hold both to.
"""

from __future__ import annotations

import functools
import hashlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["ENGINE_ALGORITHMS", "engine_digest", "engine_fill_digest", "reference_sglang_gpu", "sglang_gpu_words"]

ENGINE_ALGORITHMS = ("vllm-sha256", "sglang-cpu", "sglang-gpu")

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_SEED1 = 0x243F6A88
_SEED2 = ((_SEED1 * 0x9E3779B1) ^ 0xDEADBEEF) & _M32
_POS1, _POS2 = 0x27D4EB2D, 0x165667B1
_FM1, _FM2 = 0x85EBCA6B, 0xC2B2AE35
TILE = 8192  # words per tile: part of the algorithm (the tile sums are mixed before they are added)


def _final64(x: int) -> int:
    x &= _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _words(raw: np.ndarray) -> np.ndarray:
    """Raw bytes as little-endian uint32 words, zero padded to a multiple of 4."""
    n = raw.shape[0]
    if n % 4:
        padded = np.zeros(n + 4 - n % 4, dtype=np.uint8)
        padded[:n] = raw
        raw = padded
    elif raw.ctypes.data % 4:
        raw = raw.copy()
    return raw.view("<u4")


# --------------------------------------------------------------------------- the numpy reference


def _fmix32_np(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(_FM1)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(_FM2)
    return x ^ (x >> np.uint32(16))


def reference_sglang_gpu(raw: np.ndarray) -> int:
    """``sglang-gpu`` of raw bytes, straight from the algorithm in numpy (the tests' oracle; small inputs)."""
    words = _words(np.ascontiguousarray(raw, dtype=np.uint8))
    n = words.shape[0]
    if n == 0:
        return 0
    with np.errstate(over="ignore"):
        i = np.arange(n, dtype=np.uint32)
        rot15 = (i << np.uint32(15)) | (i >> np.uint32(17))
        rot13 = (i << np.uint32(13)) | (i >> np.uint32(19))
        k1 = _fmix32_np(words ^ ((i * np.uint32(_POS1) + np.uint32(_SEED1)) ^ rot15))
        k2 = _fmix32_np(words ^ ((i * np.uint32(_POS2) + np.uint32(_SEED2)) ^ rot13))
    total = 0
    nbytes = (n * 4) & _M32
    for start in range(0, n, TILE):
        h1 = int(k1[start : start + TILE].sum(dtype=np.uint64)) & _M32
        h2 = int(k2[start : start + TILE].sum(dtype=np.uint64)) & _M32
        h1 = int(_fmix32_np(np.array([h1 ^ nbytes], dtype=np.uint32))[0])
        h2 = int(_fmix32_np(np.array([h2 ^ nbytes], dtype=np.uint32))[0])
        total = (total + ((h1 << 32) | h2)) & _M64
    return _final64(total)


# --------------------------------------------------------------------------- the compiled CPU kernel


def _sglang_gpu_host(raw: np.ndarray) -> int:
    words = _words(np.ascontiguousarray(raw, dtype=np.uint8))
    n = words.shape[0]
    if n == 0:
        return 0
    out = np.empty((n + TILE - 1) // TILE, dtype=np.uint64)
    from wcviz.digest._tiles import tiles  # compiled once, then from numba's cache on disk

    tiles(words, out)
    return _final64(int(out.sum(dtype=np.uint64)))


# --------------------------------------------------------------------------- on a CUDA device


def sglang_gpu_words(t: torch.Tensor, chunk_words: int = 1 << 22) -> int:
    """``sglang-gpu`` of a tensor on its device (CUDA), in vectorised torch, ``chunk_words`` at a time; one sync.

    A chunk of 4 Mi words keeps the temporaries near 200 MB of device memory: an engine's
    GPU is nearly full, and a check must not be what runs it out of memory.
    """
    import torch

    from wcviz.digest._lanes import logical_bytes

    raw = logical_bytes(t)
    n_bytes = raw.numel()
    if n_bytes == 0:
        return 0
    if n_bytes % 4:
        padded = torch.zeros(n_bytes + 4 - n_bytes % 4, dtype=torch.uint8, device=raw.device)
        padded[:n_bytes] = raw
        raw = padded
    elif raw.storage_offset() % 4 or raw.data_ptr() % 4:  # a slice's bytes keep its offset; int32 views need 4-aligned
        raw = raw.clone()
    words = raw.view(torch.int32).to(torch.int64) & _M32
    n = words.numel()
    chunk_words = max(TILE, chunk_words // TILE * TILE)
    tiles = []

    def fmix(x: torch.Tensor) -> torch.Tensor:
        x = x ^ (x >> 16)
        x = (x * _FM1) & _M32
        x = x ^ (x >> 13)
        x = (x * _FM2) & _M32
        return x ^ (x >> 16)

    for start in range(0, n, chunk_words):
        v = words[start : start + chunk_words]
        i = torch.arange(start, start + v.numel(), dtype=torch.int64, device=v.device) & _M32
        r15 = ((i << 15) | (i >> 17)) & _M32
        r13 = ((i << 13) | (i >> 19)) & _M32
        k1 = fmix(v ^ (((i * _POS1 + _SEED1) & _M32) ^ r15))
        k2 = fmix(v ^ (((i * _POS2 + _SEED2) & _M32) ^ r13))
        pad = (-v.numel()) % TILE
        if pad:
            k1 = torch.nn.functional.pad(k1, (0, pad))
            k2 = torch.nn.functional.pad(k2, (0, pad))
        tiles.append(torch.stack([k1.view(-1, TILE).sum(1) & _M32, k2.view(-1, TILE).sum(1) & _M32], 1))
    mixed = fmix(torch.cat(tiles) ^ ((n * 4) & _M32)).cpu().numpy().astype(np.uint64)  # the one sync
    packed = (mixed[:, 0] << np.uint64(32)) | mixed[:, 1]
    return _final64(int(packed.sum(dtype=np.uint64)))


# --------------------------------------------------------------------------- the public face


def engine_digest(algo: str, raw: np.ndarray | memoryview | bytes) -> str:
    """The hex digest of raw bytes (a 1-D uint8 array or a buffer) under one of :data:`ENGINE_ALGORITHMS`."""
    data = raw if isinstance(raw, bytes) else memoryview(raw).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers
    if algo == "vllm-sha256":
        return hashlib.sha256(data).hexdigest()
    if algo == "sglang-cpu":
        digest = hashlib.sha256(data).digest()
        return f"{int.from_bytes(digest[:8], 'big'):016x}"
    if algo == "sglang-gpu":
        array = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
        return f"{_sglang_gpu_host(array):016x}"
    raise ValueError(f"unknown engine algorithm {algo!r}; choose one of {', '.join(ENGINE_ALGORITHMS)}")


@functools.lru_cache(maxsize=256)
def engine_fill_digest(algo: str, nbytes: int, byte: int) -> str:
    """The digest of ``nbytes`` bytes that all hold ``byte`` (what a zero reset leaves, for vLLM's zeros)."""
    if algo in ("vllm-sha256", "sglang-cpu"):
        h = hashlib.sha256()
        block = bytes([byte]) * min(nbytes, 1 << 20)
        left = nbytes
        while left:
            n = min(left, len(block))
            h.update(block if n == len(block) else block[:n])
            left -= n
        return h.hexdigest() if algo == "vllm-sha256" else f"{int.from_bytes(h.digest()[:8], 'big'):016x}"
    return engine_digest(algo, np.full(nbytes, byte, dtype=np.uint8))
