"""The exceptions wcviz raises on bad input: each names the thing that is wrong."""

from __future__ import annotations

__all__ = ["WcvizError", "DigestError", "AlgorithmMismatch", "CheckpointError", "TableError", "GatherError"]


class WcvizError(Exception):
    """Base of every error wcviz raises for bad input."""


class DigestError(WcvizError, ValueError):
    """A tensor that cannot be digested (meta, sparse, unsupported dtype, ...)."""


class AlgorithmMismatch(WcvizError, ValueError):
    """Digests of two different algorithms were compared."""


class CheckpointError(WcvizError, ValueError):
    """A checkpoint file or directory that is missing, truncated or lies."""


class TableError(WcvizError, ValueError):
    """A digest table that does not follow the schema."""


class GatherError(WcvizError, RuntimeError):
    """Gathering digest tables over ``torch.distributed`` failed: no process group, a dead peer, a timeout."""
