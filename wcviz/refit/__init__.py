"""Refit verification: both ends of a weight transfer digest what they hold, the sender compares.

A library module a training framework adopts: a config block (``verify.mode``:
off | log | enforce), transports that move named tensors from a trainer to an
engine (colocated IPC through shared buffers; a torch.distributed broadcast),
and the comparison itself. It uses the digest; it knows nothing of frames.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "MODES": "wcviz.refit.verify",
    "RefitResult": "wcviz.refit.verify",
    "RefitError": "wcviz.refit.verify",
    "RefitProtocolError": "wcviz.refit.verify",
    "RefitTimeout": "wcviz.refit.verify",
    "RefitDigestMismatch": "wcviz.refit.verify",
    "check": "wcviz.refit.verify",
    "compare": "wcviz.refit.verify",
    "verify_digests": "wcviz.refit.verify",
    "Fault": "wcviz.refit.faults",
    "FaultPlan": "wcviz.refit.faults",
    "VerifyConfig": "wcviz.refit.config",
    "RefitConfig": "wcviz.refit.config",
    "RefitConfigError": "wcviz.refit.config",
    "parse_refit_config": "wcviz.refit.config",
    "IPCSender": "wcviz.refit.ipc",
    "IPCReceiver": "wcviz.refit.ipc",
    "BroadcastSender": "wcviz.refit.broadcast",
    "BroadcastReceiver": "wcviz.refit.broadcast",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'wcviz.refit' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
