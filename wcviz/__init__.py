"""wcviz: prove, rank by rank, that the weights an engine serves are the weights the trainer sent.

The public surface, small on purpose. Heavy pieces (torch, numba, pandas)
load when first used, so ``import wcviz`` stays cheap.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "tensor_digest": "wcviz.digest",
    "digest_hex": "wcviz.digest",
    "digest_many": "wcviz.digest",
    "compare_digests": "wcviz.digest",
    "Digest": "wcviz.digest",
    "ALGORITHMS": "wcviz.digest",
    "BACKENDS": "wcviz.digest",
    "from_module": "wcviz.sources",
    "from_state_dict": "wcviz.sources",
    "from_safetensors": "wcviz.sources",
    "compare": "wcviz.verdicts",
    "fetch": "wcviz.sources",
    "check_agents": "wcviz.endstate",
    "verify_engine": "wcviz.live",
    "GatherError": "wcviz._errors",
    "read_table": "wcviz.frame",
    "write_table": "wcviz.frame",
    "COLUMNS": "wcviz.frame",
    "WcvizError": "wcviz._errors",
    "DigestError": "wcviz._errors",
    "AlgorithmMismatch": "wcviz._errors",
    "CheckpointError": "wcviz._errors",
    "TableError": "wcviz._errors",
}

__all__ = [
    "ALGORITHMS",
    "BACKENDS",
    "COLUMNS",
    "AlgorithmMismatch",
    "CheckpointError",
    "Digest",
    "DigestError",
    "GatherError",
    "TableError",
    "WcvizError",
    "__version__",
    "check_agents",
    "compare",
    "compare_digests",
    "digest_hex",
    "digest_many",
    "fetch",
    "from_module",
    "from_safetensors",
    "from_state_dict",
    "verify_engine",
    "read_table",
    "tensor_digest",
    "write_table",
]
assert set(__all__) == {*_EXPORTS, "__version__"}

if TYPE_CHECKING:
    from wcviz._errors import AlgorithmMismatch, CheckpointError, DigestError, GatherError, TableError, WcvizError
    from wcviz.endstate import check_agents
    from wcviz.verdicts import compare
    from wcviz.digest import ALGORITHMS, BACKENDS, Digest, compare_digests, digest_hex, digest_many, tensor_digest
    from wcviz.frame import COLUMNS, read_table, write_table
    from wcviz.live import verify_engine
    from wcviz.sources import fetch, from_module, from_safetensors, from_state_dict


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'wcviz' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
