"""Sources for weights already in memory: a module or a state dict."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import pandas as pd

from wcviz.digest import DEFAULT_ALGO, digest_timed
from wcviz.frame import check_rank_info, make_frame, shape_str

if TYPE_CHECKING:
    import torch

__all__ = ["from_module", "from_state_dict", "from_named_tensors"]


def named_tensor_rows(
    named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    *,
    algo: str = DEFAULT_ALGO,
    backend: str = "auto",
    progress: bool | None = None,
    **rank_info: Any,
) -> list[dict[str, Any]]:
    """The rows of :func:`from_named_tensors`, as plain JSON-able dicts, without building a frame: what an agent
    sends (``layer``, ``block`` and ``expert`` are left to :func:`wcviz.frame.make_frame`, which parses them)."""
    info = check_rank_info(rank_info)
    info.setdefault("phase", "current")
    items = list(named.items() if isinstance(named, Mapping) else named)
    timed = digest_timed(items, algo=algo, backend=backend, progress=progress)
    shapes: dict[Any, str] = {}
    rows = []
    for name, t in items:
        d, seconds = timed[name]
        shape = shapes.get(t.shape)
        if shape is None:
            shape = shapes[t.shape] = shape_str(t.shape)
        rows.append(
            {
                "name": name,
                "digest": str(d),
                "algo": d.algo,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": shape,
                "nbytes": t.numel() * t.element_size(),
                "device": str(t.device),
                "seconds": seconds,
                **info,
            }
        )
    return rows


def from_named_tensors(
    named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    *,
    algo: str = DEFAULT_ALGO,
    backend: str = "auto",
    progress: bool | None = None,
    **rank_info: Any,
) -> pd.DataFrame:
    """A digest table of named tensors; ``rank_info`` (role, rank, dp, pp, tp, ep, host,
    phase, step) is stamped on every row."""
    return make_frame(named_tensor_rows(named, algo=algo, backend=backend, progress=progress, **rank_info))


def from_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    *,
    algo: str = DEFAULT_ALGO,
    backend: str = "auto",
    progress: bool | None = None,
    **rank_info: Any,
) -> pd.DataFrame:
    """A digest table of a state dict (every entry, in its order)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"from_state_dict expects a mapping of name -> tensor, got {type(state_dict).__name__}")
    rank_info.setdefault("role", "module")
    return from_named_tensors(state_dict, algo=algo, backend=backend, progress=progress, **rank_info)


def from_module(
    module: torch.nn.Module,
    *,
    algo: str = DEFAULT_ALGO,
    backend: str = "auto",
    include_buffers: bool = False,
    progress: bool | None = None,
    **rank_info: Any,
) -> pd.DataFrame:
    """A digest table of a module's parameters (and buffers, if asked).

    Tied parameters are listed under every name they have, as in a state dict.
    """
    import torch

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"from_module expects a torch.nn.Module, got {type(module).__name__}")
    named: list[tuple[str, torch.Tensor]] = list(module.named_parameters(remove_duplicate=False))
    if include_buffers:
        named += list(module.named_buffers(remove_duplicate=False))
    rank_info.setdefault("role", "module")
    return from_named_tensors(named, algo=algo, backend=backend, progress=progress, **rank_info)
