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


def check_deadline(timeout_s: object, retries: object = 0, what: str = "timeout_s") -> tuple[float, int]:
    """``(timeout_s, retries)`` as numbers, or a ``ValueError`` naming the one that is wrong.

    One rule for every network option, refused before any rank is touched: a timeout is
    a finite number of seconds > 0 (not NaN, inf, a bool or a string), retries an
    integer >= 0 (``1.5`` would fail every request later, one rank at a time).
    """
    import math
    import operator

    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) and not hasattr(timeout_s, "__float__"):
        raise ValueError(f"{what} must be a finite number of seconds > 0, got {timeout_s!r}")
    t = float(timeout_s)  # type: ignore[arg-type]
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"{what} must be a finite number of seconds > 0, got {timeout_s!r}")
    try:
        n = operator.index(retries)  # type: ignore[arg-type]
    except TypeError:
        n = -1
    if isinstance(retries, bool) or n < 0:
        raise ValueError(f"retries must be an integer >= 0, got {retries!r}")
    return t, n


def check_token(token: object, what: str = "token") -> str | None:
    """``token`` as it goes into ``Authorization: Bearer <token>``, or a ``ValueError`` saying what is wrong with it
    (never the token itself: it is a secret). Refused before anything is sent: a header no client can send would
    otherwise fail each request after some had run, and one a server decodes otherwise would never match."""
    if token is None or token == "":
        return None
    if not isinstance(token, str):
        raise ValueError(f"{what} must be a string, got {type(token).__name__}")
    if token != token.strip():
        raise ValueError(f"{what} has leading or trailing whitespace (a newline read from a file?): strip it")
    bad = next((i for i, c in enumerate(token) if not (" " <= c <= "~")), None)
    if bad is not None:
        raise ValueError(f"{what} holds a character that is not printable ASCII at position {bad}: HTTP clients encode such headers differently, so it could not match; use printable ASCII")
    return token
