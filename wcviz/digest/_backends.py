"""Which backend digests a tensor: numba on the CPU, Triton on CUDA once it passed its self-check there,
the torch reference wherever those are not installed or do not run."""

from __future__ import annotations

import logging

from wcviz._errors import DigestError

__all__ = ["BACKENDS", "resolve_backend"]

log = logging.getLogger("wcviz.digest")

BACKENDS = ("auto", "torch", "numba", "triton")

_available: dict[str, bool] = {}


def _importable(backend: str) -> bool:
    """Whether ``backend``'s module imports here (cached; a failure is logged once)."""
    if backend not in _available:
        try:
            if backend == "numba":
                from wcviz.digest import _numba  # noqa: F401
            else:
                from wcviz.digest import _triton  # noqa: F401
        except ImportError as e:  # the torch reference still works, only slower
            log.warning("%s is unavailable (%s); digesting with the torch backend instead", backend, e)
            _available[backend] = False
        else:
            _available[backend] = True
    return _available[backend]


_trusted: dict[str, bool] = {}


def _triton_trusted() -> bool:
    """Whether ``auto`` may use the Triton kernels on CUDA: they passed :func:`_triton.self_check` there.

    Checked once per process, on the current CUDA device (one sync). If the
    kernels fail to compile or disagree with the reference, that is logged as
    an error naming the cause and ``auto`` uses the torch reference instead:
    slower, never wrong. Without CUDA there is nothing to check.
    """
    import torch

    if not torch.cuda.is_available():
        return True
    if "cuda" not in _trusted:
        from wcviz.digest import _triton

        try:
            ok = _triton.self_check(torch.device("cuda"))
            why = "its digests differ from the torch reference's"
        except Exception as e:  # noqa: BLE001 - any compile or launch failure means: do not use it
            ok, why = False, f"{type(e).__name__}: {e}"
        if not ok:
            log.error("the Triton digest kernels failed their self-check on CUDA (%s); backend 'auto' uses the torch reference there", why)
        _trusted["cuda"] = ok
    return _trusted["cuda"]


def _triton_runs_on(device_type: str) -> bool:
    """Triton kernels run on CUDA, and on the CPU only in its interpreter (``TRITON_INTERPRET=1``).

    Triton reads the variable when the kernels are defined (``_triton``'s import): set later, it would
    only get Triton's unclear "0 active drivers" error, hence a :class:`DigestError` saying so.
    """
    import os
    import sys

    asked = device_type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    module = sys.modules.get("wcviz.digest._triton")  # not yet imported: it will be, under the variable as it is now
    if asked and module is not None and not module.INTERPRETED_AT_IMPORT:
        raise DigestError("backend 'triton' on a CPU tensor needs Triton's interpreter, but TRITON_INTERPRET=1 was set "
                          "after wcviz's Triton kernels were imported; TRITON_INTERPRET=1 must be set before they are imported")
    return device_type == "cuda" or asked


def resolve_backend(backend: str, device_type: str, name: str | None = None) -> str:
    """The backend that will digest a tensor on ``device_type`` when ``backend`` is asked for.

    ``auto`` is numba on the CPU, Triton on CUDA, and the torch reference
    wherever those are not installed or do not run.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown digest backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    what = f"tensor {name!r}" if name else "the tensor"
    if backend == "auto":
        if device_type == "cpu":
            return "numba" if _importable("numba") else "torch"
        return "triton" if device_type == "cuda" and _importable("triton") and _triton_trusted() else "torch"
    if backend == "numba" and device_type != "cpu":
        raise DigestError(f"backend 'numba' runs on the CPU, but {what} is on {device_type}")
    if backend == "triton":
        if not _triton_runs_on(device_type):
            raise DigestError(
                f"backend 'triton' runs on CUDA (or on the CPU under TRITON_INTERPRET=1), but {what} is on {device_type}"
            )
        if not _importable("triton"):
            raise DigestError(f"backend 'triton' was asked for {what}, but triton is not installed (pip install triton)")
    return backend
