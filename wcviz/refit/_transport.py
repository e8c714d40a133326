"""What every refit transport shares: the verify mode, and whether the transport can honour it.

A transport that cannot digest both ends of a stream declares
``supports_verify = False``; asking it to verify is then an error at
construction, never a refit that silently runs unverified.
"""

from __future__ import annotations

from typing import Any, ClassVar

from wcviz.refit.config import verify_mode
from wcviz.refit.verify import RefitError

__all__ = ["Transport"]


class Transport:
    """Base of the refit transports: resolves ``verify`` once and refuses a mode it cannot honour."""

    supports_verify: ClassVar[bool] = True

    def __init__(self, verify: Any = "off") -> None:
        """``verify``: a mode string, a ``VerifyConfig`` or ``RefitConfig``, or None (off)."""
        self.mode = verify_mode(verify)
        if self.mode != "off" and not self.supports_verify:
            raise RefitError(
                f"transport {type(self).__name__} cannot verify a refit, but verify mode {self.mode!r} was asked for; "
                "use mode 'off' or a transport that supports verification"
            )

    @property
    def verifying(self) -> bool:
        """Whether this end digests what it sends or receives."""
        return self.mode != "off"
