"""The comparison at the end of a refit: the sender's digests against the receiver's.

Transports call :func:`verify_digests` once per stream with both sides' ``{name: hex}`` and
the names the receiver must end up holding (``expected``: every parameter its
metadata declares, unless the caller states a partial refit). ``off`` returns
without looking (and transports compute nothing in that mode); ``log`` warns once
per bad parameter and returns the result; ``enforce`` raises
:class:`RefitDigestMismatch` before anything downstream can use the weights.

A declared parameter that never arrived is ``missing`` - a dropped bucket, a refit
that sent a subset or nothing at all - and the result is not ok: a refit is only
verified when everything the receiver expects arrived intact. A refit that
checked nothing (a receiver that declares no parameters: released or offloaded
weights, a mis-wired holder; or a stated partial refit of nothing) is never
"verified": it is not ok, says so, and ``enforce`` raises.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from wcviz._errors import WcvizError
from wcviz.digest import compare_digests

__all__ = [
    "MODES", "RefitResult", "RefitError", "RefitProtocolError", "RefitTimeout", "RefitDigestMismatch", "check",
    "compare", "expected_names", "verify_digests", "warn",
]  # fmt: skip

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
    ``missing``: the receiver was to hold it and never saw it: sent and lost, or
    declared by the receiver and never sent (those are also in ``unsent``).
    ``unexpected``: the receiver saw it, the sender never sent it.
    ``expected``: how many parameters the receiver was to hold.
    ``declared``: how many parameters the receiver declares, where the transport knows.
    """

    mode: str
    params: int
    nbytes: int
    verified: bool = False
    mismatched: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    unsent: tuple[str, ...] = ()
    expected: int | None = None
    declared: int | None = None
    sender: Mapping[str, str] = field(default_factory=dict, repr=False)
    receiver: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def bad(self) -> list[str]:
        """Every parameter that did not arrive intact, sorted."""
        return sorted({*self.mismatched, *self.missing, *self.unexpected})

    @property
    def empty(self) -> bool:
        """Verification ran but had nothing to check: nothing sent, expected or received."""
        return self.verified and not self.params and not self.expected and not self.receiver and not self.bad

    @property
    def ok(self) -> bool:
        """True only when verification ran, checked something and found nothing wrong: ``off`` is never "ok"."""
        return self.verified and not self.bad and not self.empty

    def _nothing(self) -> str:
        """Why a verified refit checked nothing, for :meth:`describe`."""
        if self.declared == 0:
            why = "the receiver declares no parameters (released or offloaded weights? a mis-wired holder?)"
        elif self.declared:
            why = f"no parameter was sent and none was expected (the receiver declares {self.declared})"
        else:
            why = "no parameter was sent, expected or received"
        return f"refit verified nothing, not ok: {why}"

    def describe(self) -> str:
        """One line for logs and error messages."""
        if not self.verified:
            return f"refit of {self.params} parameters ({self.nbytes:,} bytes), not verified (mode {self.mode})"
        if self.empty:
            return self._nothing()
        if not self.bad:
            return f"refit of {self.params} parameters ({self.nbytes:,} bytes) verified: every digest matches"
        unsent = set(self.unsent)
        lost = tuple(n for n in self.missing if n not in unsent)
        parts = [
            f"{label}: {', '.join(names)}"
            for label, names in (
                ("digest differs", self.mismatched),
                ("never received", lost),
                ("declared by the receiver, never sent", self.unsent),
                ("never sent", self.unexpected),
            )
            if names
        ]
        total = max(self.params, self.expected or 0)
        return f"refit verification failed for {len(self.bad)} of {total} parameters; " + "; ".join(parts)


class RefitDigestMismatch(RefitError):
    """``enforce``: the receiver does not hold what the sender sent, or nothing was verified. ``.result`` says what."""

    def __init__(self, result: RefitResult) -> None:
        super().__init__(result.describe())
        self.result = result

    def __reduce__(self) -> tuple[type[RefitDigestMismatch], tuple[RefitResult]]:
        return (type(self), (self.result,))  # it crosses process boundaries; args alone would lose .result


def expected_names(
    declared: Iterable[str], sent: Iterable[str], *, partial: bool = False, expected: Iterable[str] | None = None
) -> set[str]:
    """The names a receiver must hold after a stream: all it ``declared``, unless the caller states otherwise.

    ``partial=True``: exactly what was ``sent``. ``expected``: exactly those names, each
    one the receiver declares and covering everything sent (anything else is a
    ``ValueError`` naming it, raised before a byte moves).
    """
    declared = set(declared)
    sent = set(sent)
    if expected is not None:
        if partial:
            raise ValueError("give partial=True or the list of expected names, not both")
        if isinstance(expected, str):
            raise TypeError("expected must be a list of parameter names, not one string")
        names = set(expected)
        unknown = sorted(names - declared)
        if unknown:
            raise ValueError(f"expected names the receiver does not declare: {', '.join(unknown[:20])}")
        extra = sorted(sent - names)
        if extra:
            raise ValueError(f"sending parameters outside the expected names: {', '.join(extra[:20])}")
        return names
    return sent if partial else declared


def compare(
    mode: str,
    sender: Mapping[str, str],
    receiver: Mapping[str, str],
    *,
    nbytes: int = 0,
    expected: Iterable[str] | None = None,
    declared: int | None = None,
) -> RefitResult:
    """The comparison alone: what did not arrive intact, as a verified :class:`RefitResult` (no logging, no raising).

    ``expected``: the names the receiver must hold (default: what was sent); a name
    in it that the receiver does not report is ``missing``, sent or not. ``declared``:
    how many parameters the receiver declares (named in the message when it is 0).
    """
    want = set(sender) if expected is None else set(expected)
    differ = set(compare_digests(sender, receiver))
    unsent = want - set(sender) - set(receiver)
    return RefitResult(
        mode,
        params=len(sender),
        nbytes=nbytes,
        verified=True,
        mismatched=tuple(sorted(n for n in differ if n in sender and n in receiver)),
        missing=tuple(sorted({n for n in differ if n not in receiver} | unsent)),
        unexpected=tuple(sorted(n for n in differ if n not in sender)),
        unsent=tuple(sorted(unsent)),
        expected=len(want),
        declared=declared,
        sender=dict(sender),
        receiver=dict(receiver),
    )


def warn(result: RefitResult, prefix: str = "refit verification: ") -> None:
    """``log``: one warning per parameter that did not arrive intact, each line starting with ``prefix``."""
    if result.empty:
        log.warning("%s%s", prefix, result.describe())
    unsent = set(result.unsent)
    for name in result.mismatched:
        log.warning("%s%s differs between sender and receiver", prefix, name)
    for name in result.missing:
        if name in unsent:
            log.warning("%s%s is declared by the receiver but was never sent", prefix, name)
        else:
            log.warning("%s%s was sent but never received", prefix, name)
    for name in result.unexpected:
        log.warning("%s%s was received but never sent", prefix, name)


def verify_digests(
    mode: str,
    sender: Mapping[str, str],
    receiver: Mapping[str, str] | None,
    *,
    nbytes: int = 0,
    expected: Iterable[str] | None = None,
    declared: int | None = None,
) -> RefitResult:
    """Compare the two sides' digests (:func:`compare`) and apply ``mode``; see the module docstring."""
    if mode not in MODES:
        raise ValueError(f"unknown verify mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "off":
        want = set(sender) if expected is None else set(expected)
        return RefitResult(mode, params=len(sender), nbytes=nbytes, expected=len(want), declared=declared)
    if receiver is None:
        raise RefitProtocolError("verification is on but the receiver's final acknowledgment carried no digests")
    result = compare(mode, sender, receiver, nbytes=nbytes, expected=expected, declared=declared)
    if not result.ok and mode == "enforce":  # a mismatch, or nothing checked at all
        raise RefitDigestMismatch(result)
    warn(result)
    return result


def check(*args: Any, **kwargs: Any) -> RefitResult:
    """Deprecated name of :func:`verify_digests` (``check`` said too little next to the end-state check)."""
    import warnings

    warnings.warn("wcviz.refit.check is deprecated: use wcviz.refit.verify_digests", DeprecationWarning, stacklevel=2)
    return verify_digests(*args, **kwargs)
