"""wcviz inside vLLM's workers: methods for ``worker_extension_cls``, called through ``collective_rpc``.

Start vLLM with this class mixed into its workers::

    LLM(model, worker_extension_cls="wcviz.integrations.vllm.WcvizWorkerExtension")
    # or: VLLM_SERVER_DEV_MODE=1 vllm serve MODEL \\
    #         --worker-extension-cls wcviz.integrations.vllm.WcvizWorkerExtension

and every worker answers (``llm.collective_rpc("wcviz_digests")`` returns one result per
worker; :func:`wcviz.sources.from_vllm_llm` / :func:`wcviz.sources.from_vllm_http` turn
them into a digest table):

=======================================  ===================================================
``wcviz_info()``                         role, rank, dp, pp, tp, ep, world_size, host,
                                         device, device_uuid, params, pid, coords_from
``wcviz_digests(name_regex, algo,        ``{"info": {...}, "rows": [...]}`` in the
phase)``                                 :mod:`wcviz.frame` schema, or
                                         ``{"info": {...}, "error": "..."}``
``wcviz_snapshot(algo)``                 ``wcviz_digests`` with phase ``snapshot``
``wcviz_reset(byte="0xa5")``             poison every parameter in place
                                         (:func:`wcviz.endstate.poison_`)
=======================================  ===================================================

Every argument is a string (or has a string form), because vLLM's HTTP
``/collective_rpc`` passes strings only. The read methods never raise: a worker that
raised would fail vLLM's whole ``collective_rpc`` call and hide which rank it was, so
they answer an ``error`` next to the worker's identity instead. ``wcviz_reset`` does
raise: a mutation that failed must stop the caller (the end-state check then reloads).

A framework that already sets its own extension (NeMo-RL does) combines both::

    class MyExtension(NemoRLExtension, WcvizWorkerExtension):
        'NemoRLExtension: the class your framework already passes.'

and passes ``worker_extension_cls="my_module.MyExtension"``. Every name here starts with
``wcviz_`` or ``_wcviz_`` and the class has no ``__init__``, so it clashes with neither
vLLM's worker nor the other extension.

Where the coordinates come from (:func:`worker_coords`), first that applies:

1. ``self.wcviz_coords``: a mapping with ``rank`` and any of ``dp``, ``pp``, ``tp``,
   ``ep``, ``world_size`` (set it when the defaults below are wrong for your deployment);
2. vLLM's ``vllm.distributed.parallel_state`` when it is already imported and
   initialised (it is on a vLLM worker; wcviz never imports vLLM itself):
   ``get_tensor_model_parallel_rank()``, ``get_pp_group().rank_in_group``, DP from
   ``parallel_config.data_parallel_index`` (else ``get_dp_group().rank_in_group``,
   else ``data_parallel_rank``), ``get_ep_group().rank_in_group`` only when
   ``enable_expert_parallel`` is set, and the rank and world across DP
   (``data_parallel_index * parallel_config.world_size`` + the local rank, of
   ``world_size_across_dp``; else ``torch.distributed``'s, else ``self.rank``);
3. the worker's attributes ``rank``, ``dp_rank``, ``pp_rank``, ``tp_rank``,
   ``ep_rank``, ``world_size`` (absent ones are unknown): the contract the tests'
   ``SimWorker`` holds.

``world_size`` (across DP) lets a client notice ranks that ``collective_rpc`` never
reached: a worker that gave no answer at all is reported, not silently absent. With
data parallelism that matters: vLLM 0.33's ``/collective_rpc`` (and ``LLM.collective_rpc``)
returns the results of DP engine 0's workers only (``v1/engine/core_client.py``:
``call_utility_async`` answers with the first engine's result), so every other
replica's ranks are reported as not reached; :func:`wcviz.sources.from_vllm_weight_checker`
reaches them all.

The model comes from ``self.model_runner.get_model()`` (else ``self.model_runner.model``).
"""

from __future__ import annotations

import operator
import os
import socket
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from wcviz._names import name_filter
from wcviz._text import one_line

if TYPE_CHECKING:
    import torch

__all__ = ["WcvizWorkerExtension", "worker_coords"]

_ATTRS = {
    "rank": "rank", "dp": "dp_rank", "pp": "pp_rank", "tp": "tp_rank", "ep": "ep_rank", "world_size": "world_size",
    "dp_size": "dp_size",
}  # fmt: skip


def _int_or_none(v: Any, what: str) -> int | None:
    if v is None:
        return None
    try:
        if isinstance(v, bool):
            raise TypeError
        return operator.index(v)  # ints and numpy/torch integer scalars, never floats
    except TypeError:
        raise TypeError(f"{what} must be an int or None, got {type(v).__name__} {v!r}") from None


def _vllm_coords(worker: Any) -> dict[str, int | None] | None:
    """Coordinates from vLLM's parallel state, or None when it is not imported or not initialised.

    DP as vLLM 0.33 numbers it (``vllm/v1/worker/gpu_worker.py``, ``config/parallel.py``):
    ``parallel_config.data_parallel_index`` - dense replicas all have
    ``data_parallel_rank`` 0 and a DP group of one, only the index tells them apart -
    and the global rank across DP, ``index * world_size + local rank`` (``parallel_state``'s
    ``reshape(-1, dp, pp, pcp, tp)``), of ``world_size_across_dp``. That world spans the
    replicas for an MoE model only: a dense replica is reconfigured to stand alone
    (``v1/engine/core.py``, ``reconfigure_for_independent_dp_rank``: ``data_parallel_size``
    1), so its workers cannot count the others; the sources ask the front end for that.
    """
    ps = sys.modules.get("vllm.distributed.parallel_state")
    if ps is None:
        return None
    try:
        tp = ps.get_tensor_model_parallel_rank()
        pp = ps.get_pp_group().rank_in_group
    except Exception:  # noqa: BLE001 - groups not initialised: this process is no vLLM worker
        return None
    parallel = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
    dp = getattr(parallel, "data_parallel_index", None)
    if dp is None:
        try:
            dp = ps.get_dp_group().rank_in_group
        except Exception:  # noqa: BLE001 - older vLLM without a DP group
            dp = getattr(parallel, "data_parallel_rank", None)
    ep = None
    if getattr(parallel, "enable_expert_parallel", False):
        try:
            ep = ps.get_ep_group().rank_in_group
        except Exception:  # noqa: BLE001 - no EP group in this vLLM
            ep = None
    rank = world = None
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001
        rank = world = None
    if rank is None:
        rank = getattr(worker, "rank", None)
    replica, across = getattr(parallel, "world_size", None), getattr(parallel, "world_size_across_dp", None)
    dp_size = getattr(parallel, "data_parallel_size", None)
    external = getattr(parallel, "distributed_executor_backend", None) == "external_launcher"
    if external and isinstance(rank, int) and isinstance(world, int) and isinstance(replica, int) and replica > 0:
        # One process per rank of one torch world (verl-style SPMD): vLLM multiplies world_size by DP there
        # (config/parallel.py:970), so world_size_across_dp counts DP twice; the torch rank is the global rank
        # (parallel_state.py:2158: reshape(-1, dp, pp, pcp, tp)), and a replica (internal DP, or the external
        # DP of several engines in one world) is every world_size // dp of them.
        per = replica // dp_size if isinstance(dp_size, int) and dp_size > 0 and replica % dp_size == 0 else replica
        return {"rank": rank, "dp": rank // per, "pp": pp, "tp": tp, "ep": ep, "world_size": world, "dp_size": world // per}
    if isinstance(replica, int) and replica > 0 and isinstance(dp, int) and isinstance(rank, int):
        rank = dp * replica + rank % replica  # one numbering across DP, as vLLM's own checker keys imply
        world = across if isinstance(across, int) else world
    return {"rank": rank, "dp": dp, "pp": pp, "tp": tp, "ep": ep, "world_size": world, "dp_size": dp_size}


def worker_coords(worker: Any) -> tuple[dict[str, int | None], str]:
    """``({"rank", "dp", "pp", "tp", "ep", "world_size", "dp_size"}, where they came from)`` for a worker (see the module doc)."""
    explicit = getattr(worker, "wcviz_coords", None)
    if explicit is not None:
        if not isinstance(explicit, Mapping):
            raise TypeError(f"wcviz_coords must be a mapping of rank, dp, pp, tp, ep; got {type(explicit).__name__}")
        unknown = sorted(set(explicit) - set(_ATTRS))
        if unknown:
            raise ValueError(f"wcviz_coords has unknown key(s) {', '.join(map(str, unknown))}; allowed: {', '.join(_ATTRS)}")
        coords, source = {k: explicit.get(k) for k in _ATTRS}, "wcviz_coords"
    else:
        found = _vllm_coords(worker)
        if found is not None:
            coords, source = found, "vllm"
        else:
            coords, source = {k: getattr(worker, attr, None) for k, attr in _ATTRS.items()}, "attributes"
    return {k: _int_or_none(v, f"{k} ({source})") for k, v in coords.items()}, source


def _device_uuid(device: torch.device) -> str | None:
    """The GPU's UUID as ``nvidia-smi -L`` prints it (``GPU-...``), or None off CUDA."""
    if device.type != "cuda":
        return None
    import torch

    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:  # noqa: BLE001 - old torch without .uuid: ask vLLM's platform, if loaded
        platforms = sys.modules.get("vllm.platforms")
        try:
            uuid = str(platforms.current_platform.get_device_uuid(device.index or 0)) if platforms else ""
        except Exception:  # noqa: BLE001
            uuid = ""
    if not uuid:
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def _inner_tensors(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The tensors that hold a parameter's bytes, named as vLLM 0.33's checker names them
    (``model_executor/model_loader/weight_checksum.py``, ``_tensors``): a ``SharedWeightParameter``
    (no data of its own) by its partitions, ``<name>.<index>``; a traceable wrapper subclass (TorchAO's
    quantized weights) by its inner tensors, ``<name>.<attr>``; any other parameter as itself."""
    shared = any(c.__name__ == "SharedWeightParameter" for c in type(t).__mro__)  # wcviz never imports vLLM
    partitions = getattr(t, "partitions", None)
    if shared and isinstance(partitions, Mapping):
        return [pair for index, part in partitions.items() for pair in _inner_tensors(f"{name}.{index}", part)]
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        return [pair for attr in t.__tensor_flatten__()[0] for pair in _inner_tensors(f"{name}.{attr}", getattr(t, attr))]
    return [(name, t)]


class WcvizWorkerExtension:
    """Methods vLLM mixes into each worker (``worker_extension_cls``); see the module doc."""

    wcviz_role = "engine"

    # ---- helpers (prefixed: vLLM refuses extension names its worker already has) ----

    def _wcviz_model(self) -> torch.nn.Module:
        runner = getattr(self, "model_runner", None)
        if runner is None:
            raise AttributeError("this worker has no model_runner (is the model loaded yet?)")
        get_model = getattr(runner, "get_model", None)
        model = get_model() if callable(get_model) else getattr(runner, "model", None)
        if model is None:
            raise AttributeError("model_runner holds no model (is the model loaded yet?)")
        return model

    def _wcviz_named(self) -> list[tuple[str, torch.Tensor]]:
        # A tied parameter once, under its first name, as vLLM's own /weight_checker lists it
        # (named_parameters()): one rule for every engine source, and expected_frame's default.
        # Parameters whose bytes live in inner tensors are listed by those, under vLLM's names.
        return [pair for name, p in self._wcviz_model().named_parameters() for pair in _inner_tensors(name, p)]

    def _wcviz_identity(self) -> dict[str, Any]:
        coords, source = worker_coords(self)
        return {"role": self.wcviz_role, **coords, "host": socket.gethostname(), "coords_from": source}

    def _wcviz_info(self, named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        info = self._wcviz_identity()
        device = getattr(self, "device", None)
        if device is None and named:
            device = named[0][1].device
        if device is not None:
            import torch

            device = torch.device(device)
        info.update(
            device=str(device) if device is not None else None,
            device_uuid=_device_uuid(device) if device is not None else None,
            params=len(named),
            pid=os.getpid(),
        )
        return info

    # ---- what collective_rpc calls ----------------------------------------------------------

    def wcviz_info(self) -> dict[str, Any]:
        """This worker's identity, device and parameter count; ``error`` instead of raising."""
        try:
            return self._wcviz_info(self._wcviz_named())
        except Exception as e:  # noqa: BLE001 - answer, don't fail the whole collective_rpc
            try:
                partial = self._wcviz_identity()
            except Exception:  # noqa: BLE001
                partial = {"role": self.wcviz_role, "host": socket.gethostname(), "pid": os.getpid()}
            return {**partial, "error": one_line(e)}

    def wcviz_digests(self, name_regex: str | None = None, algo: str = "nemo-rl-v3", phase: str = "current") -> dict[str, Any]:
        """``{"info": ..., "rows": [...]}``: digests of the live parameters whose name matches
        ``name_regex`` (an RE2 search, :func:`wcviz._names.name_filter`; all when None), or
        ``{"info": ..., "error": ...}``."""
        info: dict[str, Any] = {}
        try:
            named = self._wcviz_named()
            info = self._wcviz_info(named)
            keep = name_filter(name_regex)  # RE2: linear time, whatever the request carries
            if keep is not None:
                named = [(n, t) for n, t in named if keep(n)]
            from wcviz.frame import IDENTITY
            from wcviz.sources import named_tensor_rows

            ident = {k: info[k] for k in ("role", *IDENTITY, "host")}  # no world_size: not a column
            rows = named_tensor_rows(named, algo=algo, progress=False, phase=phase, **ident)  # plain JSON values
            return {"info": info, "rows": rows}
        except Exception as e:  # noqa: BLE001 - answer, don't fail the whole collective_rpc
            return {"info": info or self.wcviz_info(), "error": one_line(e)}

    def wcviz_snapshot(self, algo: str = "nemo-rl-v3") -> dict[str, Any]:
        """:meth:`wcviz_digests` of every parameter, stamped phase ``snapshot``."""
        return self.wcviz_digests(None, algo, "snapshot")

    def wcviz_reset(self, byte: str | int = "0xa5") -> dict[str, Any]:
        """Overwrite every parameter in place with ``byte`` (``"0xa5"`` or ``"0x5a"``).

        Raises on failure (naming this rank): a mutation must not fail quietly.
        """
        from wcviz.endstate import POISON_BYTES, poison_

        value = int(byte, 0) if isinstance(byte, str) else int(byte)
        if value not in POISON_BYTES:
            raise ValueError(f"poison byte must be one of {', '.join(hex(b) for b in POISON_BYTES)}, got {byte!r}")
        named = self._wcviz_named()
        info = self._wcviz_info(named)
        try:
            poison_(named, byte=value)
        except Exception as e:
            raise RuntimeError(f"wcviz_reset failed on {info['role']} rank {info['rank']} (pid {info['pid']}): {one_line(e)}") from e
        return {"info": info, "ok": True, "params": len(named), "byte": hex(value)}
