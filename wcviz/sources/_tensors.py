"""Sources for weights already in memory: a module or a state dict."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import pandas as pd

from wcviz.digest import DEFAULT_ALGO, digest_timed
from wcviz.frame import check_rank_info, make_frame, shape_str
from wcviz.sources._wire import RankTable

if TYPE_CHECKING:
    import torch

__all__ = ["from_module", "from_state_dict", "from_named_tensors", "named_tensor_rows", "named_tensor_table"]


def named_tensor_table(
    named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    *,
    algo: str = DEFAULT_ALGO,
    backend: str = "auto",
    progress: bool | None = None,
    **rank_info: Any,
) -> RankTable:
    """The rows of :func:`from_named_tensors` as plain JSON-able columns, without building a frame: what an agent
    sends (``rank_info`` once for every row; ``layer``, ``block`` and ``expert`` are left to
    :func:`wcviz.frame.make_frame`, which parses them)."""
    info = check_rank_info(rank_info)
    info.setdefault("phase", "current")
    items = list(named.items() if isinstance(named, Mapping) else named)
    timed = digest_timed(items, algo=algo, backend=backend, progress=progress)
    shapes: dict[Any, str] = {}
    cols: dict[str, list[Any]] = {c: [] for c in ("name", "digest", "algo", "dtype", "shape", "nbytes", "device", "seconds")}
    for name, t in items:
        d, seconds = timed[name]
        shape = shapes.get(t.shape)
        if shape is None:
            shape = shapes[t.shape] = shape_str(t.shape)
        for col, value in zip(
            cols.values(),
            (name, str(d), d.algo, str(t.dtype).removeprefix("torch."), shape, t.numel() * t.element_size(), str(t.device), seconds),
        ):
            col.append(value)
    return RankTable(len(items), cols, info)


def named_tensor_rows(
    named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    *,
    algo: str = DEFAULT_ALGO,
    backend: str = "auto",
    progress: bool | None = None,
    **rank_info: Any,
) -> list[dict[str, Any]]:
    """:func:`named_tensor_table` as row dicts: the rows form an agent sends to a client that did not ask for columns."""
    return named_tensor_table(named, algo=algo, backend=backend, progress=progress, **rank_info).rows()


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
