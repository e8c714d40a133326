"""What the broadcast sender checks around a stream: what each engine must end up holding, and what each sent back.

Kept apart from :mod:`wcviz.refit.broadcast` (which holds the protocol itself) so both stay short.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from wcviz.refit._control import malformed_digest
from wcviz.refit._packing import Meta
from wcviz.refit.verify import RefitProtocolError, expected_names

__all__ = ["expected_per_rank", "received_digests"]


def expected_per_rank(
    metadata: Mapping[int, Mapping[str, Meta]], sent: list[str], partial: bool, expected: Iterable[str] | None
) -> dict[int, set[str]]:
    """What each engine must hold after the stream: all it declares, or the caller's partial refit.

    ``expected`` names apply to each engine as far as it declares them (pipeline stages
    declare different names); one that no engine declares is an error.
    """
    if expected is None:
        return {rank: expected_names(meta, sent, partial=partial) for rank, meta in metadata.items()}
    if isinstance(expected, str):
        raise TypeError("expected must be a list of parameter names, not one string")
    names = set(expected)
    declared = set().union(*(set(m) for m in metadata.values())) if metadata else set()
    expected_names(declared, sent, partial=partial, expected=names)  # the checks: unknown names, sends outside the list
    return {rank: names & set(meta) for rank, meta in metadata.items()}


def received_digests(who: str, digests: Any, algo: str) -> Mapping[str, str]:
    """An engine's ``{name: hex}`` report, every value a digest of ``algo``; else RefitProtocolError naming ``who``."""
    if not isinstance(digests, Mapping) or not all(isinstance(n, str) and isinstance(d, str) for n, d in digests.items()):
        raise RefitProtocolError(f"refit broadcast: {who} sent digests that are not {{name: hex}}: {str(digests)[:200]}")
    why = malformed_digest(digests, algo)
    if why is not None:
        raise RefitProtocolError(f"refit broadcast: {who} sent {why}")
    return digests
