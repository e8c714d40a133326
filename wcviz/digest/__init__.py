"""The refit digest: the same 32 hex characters for the same tensor, on any device.

"nemo-rl-v3" is bit-compatible with NeMo-RL's refit verification (see
``shared/digest-algorithm.md``); "sha256" hashes the same metadata and bytes
with SHA-256 on the host. The engines' own checksums, bit-identical, by name:
"vllm-sha256" (vLLM's ``/weight_checker``), "sglang-cpu" and "sglang-gpu"
(SGLang's ``/weights_checker`` on a CPU and on a CUDA tensor); see
:mod:`wcviz.digest._engines`. Backends for "nemo-rl-v3": ``torch`` (the reference, any device),
``numba`` (the fast CPU path) and ``triton`` (CUDA, a whole batch in three
launches); ``auto`` picks the fastest that runs there.
"""

from __future__ import annotations

from wcviz.digest._api import (
    ALGORITHMS,
    BACKENDS,
    DEFAULT_ALGO,
    DIGEST_FORMATS,
    Digest,
    DigestAccumulator,
    NamedTensors,
    TensorMeta,
    as_pairs,
    compare_digests,
    digest_format_error,
    digest_hex,
    digest_many,
    digest_timed,
    parse_dtype,
    resolve_backend,
    tensor_digest,
)
from wcviz.digest._buffers import digest_buffer, digest_buffers
from wcviz.digest._engines import ENGINE_ALGORITHMS, reference_sglang_gpu
from wcviz.digest._fill import FILL_ALGORITHMS, fill_digest
from wcviz.digest._lanes import check_digestible, logical_bytes

__all__ = [
    "ENGINE_ALGORITHMS",
    "FILL_ALGORITHMS",
    "ALGORITHMS",
    "BACKENDS",
    "DEFAULT_ALGO",
    "DIGEST_FORMATS",
    "Digest",
    "DigestAccumulator",
    "NamedTensors",
    "TensorMeta",
    "as_pairs",
    "check_digestible",
    "compare_digests",
    "digest_buffer",
    "digest_buffers",
    "digest_format_error",
    "digest_hex",
    "digest_many",
    "digest_timed",
    "fill_digest",
    "logical_bytes",
    "parse_dtype",
    "reference_sglang_gpu",
    "resolve_backend",
    "set_digest_threads",
    "tensor_digest",
]


def set_digest_threads(n: int) -> None:
    """Threads the numba CPU kernel may use for digests called from *this* thread.

    numba counts threads per calling thread; 1 runs the serial kernel and wakes no
    helper thread (what the refit's digest beside the copy does). numba is imported
    here, not with this package. Nothing to set without numba.
    """
    try:
        from wcviz.digest import _numba
    except ImportError:
        return
    _numba.set_threads(n)
