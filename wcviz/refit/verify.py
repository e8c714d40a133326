"""The comparison at the end of a refit: the sender's digests against the receiver's.

Transports call :func:`check` once per stream with both sides' ``{name: hex}``.
``off`` returns without looking (and transports compute nothing in that mode);
``log`` warns once per bad parameter and returns the result; ``enforce`` raises
:class:`RefitDigestMismatch` before anything downstream can use the weights.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from wcviz._errors import WcvizError
from wcviz.digest import compare_digests

__all__ = ["MODES", "RefitResult", "RefitError", "RefitProtocolError", "RefitTimeout", "RefitDigestMismatch", "check"]

log = logging.getLogger("wcviz.refit")

MODES = ("off", "log", "enforce")


class RefitError(WcvizError, RuntimeError):
    """A refit that did not complete as the protocol says."""


class RefitProtocolError(RefitError):
    """A peer broke the protocol: a missing digest, an offset that does not add up, an error reply."""


class RefitTimeout(RefitError):
    """A peer did not answer in time (dead or hung)."""


@dataclass(frozen=True)
class RefitResult:
    """What one refit stream did and, when verified, what did not arrive intact.

    ``mismatched``: both sides digested it and the digests differ.
    ``missing``: the sender sent it, the receiver never saw it.
    ``unexpected``: the receiver saw it, the sender never sent it.
    """

    mode: str
    params: int
    nbytes: int
    verified: bool = False
    mismatched: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    sender: Mapping[str, str] = field(default_factory=dict, repr=False)
    receiver: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def bad(self) -> list[str]:
        """Every parameter that did not arrive intact, sorted."""
        return sorted({*self.mismatched, *self.missing, *self.unexpected})

    @property
    def ok(self) -> bool:
        """True only when verification ran and found nothing: ``off`` is never "ok"."""
        return self.verified and not self.bad

    def describe(self) -> str:
        """One line for logs and error messages."""
        if not self.verified:
            return f"refit of {self.params} parameters ({self.nbytes:,} bytes), not verified (mode {self.mode})"
        if not self.bad:
            return f"refit of {self.params} parameters ({self.nbytes:,} bytes) verified: every digest matches"
        parts = [
            f"{label}: {', '.join(names)}"
            for label, names in (("digest differs", self.mismatched), ("never received", self.missing), ("never sent", self.unexpected))
            if names
        ]
        return f"refit verification failed for {len(self.bad)} of {self.params} parameters; " + "; ".join(parts)


class RefitDigestMismatch(RefitError):
    """``enforce``: the receiver does not hold what the sender sent. ``.result`` says what."""

    def __init__(self, result: RefitResult) -> None:
        super().__init__(result.describe())
        self.result = result

    def __reduce__(self) -> tuple[type[RefitDigestMismatch], tuple[RefitResult]]:
        return (type(self), (self.result,))  # it crosses process boundaries; args alone would lose .result


def check(mode: str, sender: Mapping[str, str], receiver: Mapping[str, str] | None, *, nbytes: int = 0) -> RefitResult:
    """Compare the two sides' digests as ``mode`` says; see the module docstring."""
    if mode not in MODES:
        raise ValueError(f"unknown verify mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "off":
        return RefitResult(mode, params=len(sender), nbytes=nbytes)
    if receiver is None:
        raise RefitProtocolError("verification is on but the receiver's final acknowledgment carried no digests")
    differ = set(compare_digests(sender, receiver))
    result = RefitResult(
        mode,
        params=len(sender),
        nbytes=nbytes,
        verified=True,
        mismatched=tuple(sorted(n for n in differ if n in sender and n in receiver)),
        missing=tuple(sorted(n for n in differ if n not in receiver)),
        unexpected=tuple(sorted(n for n in differ if n not in sender)),
        sender=dict(sender),
        receiver=dict(receiver),
    )
    if result.bad and mode == "enforce":
        raise RefitDigestMismatch(result)
    for name in result.mismatched:
        log.warning("refit verification: %s differs between sender and receiver", name)
    for name in result.missing:
        log.warning("refit verification: %s was sent but never received", name)
    for name in result.unexpected:
        log.warning("refit verification: %s was received but never sent", name)
    return result
