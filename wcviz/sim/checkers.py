"""Simulated engines that answer as vLLM's and SGLang's own weight checkers do, over real HTTP on loopback.

Each holds simulated engine ranks (:class:`wcviz.sim.engine.EngineShard`, loader faults
injectable) and serves the engine's routes with the bodies, keys, status codes and errors
the named release answers with, read from its source. What the ranks hold is the simulator's
layout, which differs from the engine's in two places: the vocabulary is padded to a
multiple of TP only (both engines pad to 64; pass ``vocab_padding=1`` to the expected
shards), and vLLM's fused MoE experts keep the names of vLLM before 0.25 (``names="vllm<0.25"``;
0.33 names them ``experts.routed_experts.w13_weight``). The routes:

- :class:`SimVllm`: vLLM 0.33.0 with ``VLLM_SERVER_DEV_MODE=1``
  (``vllm/entrypoints/rl/online/api_router.py``: ``POST /weight_checker``, ``GET
  /get_world_size``; ``vllm/v1/worker/gpu_worker.py`` for the key prefix;
  ``model_loader/weight_checksum.py`` for the digest and the reset;
  ``entrypoints/serve/exception_handling`` for the error bodies);
- :class:`SimSglang`: SGLang 0.5.23 (``srt/entrypoints/http_server.py``
  ``check_weights``; ``managers/tokenizer_control_mixin.py``,
  ``scheduler_components/weight_updater.py``, ``utils/weight_checker.py``,
  ``utils/auth.py``).

They are what the tests and ``notebooks/06_your_engine.ipynb`` run against; they never
import wcviz's sources or layouts, and compute the engines' digests the way the engines
write them (``hashlib`` here, SGLang's kernel as its numpy transcription).
:meth:`load` is the trainer's weight update (every rank loads the full weights).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from wcviz.sim.engine import EngineShard, LoaderFaults
from wcviz.sim.model import ModelConfig, build_state_dict

__all__ = ["SGLANG_VERSION", "VLLM_VERSION", "SimSglang", "SimVllm"]

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"
Coords = tuple[int, int, int]  # (dp, pp, tp)


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()


class _Served:
    """An engine's ranks and the Starlette app that answers for them, served in a background thread."""

    name = "engine"
    layout = "vllm"  # whose layout the ranks play (EngineShard's engine)

    def __init__(self, cfg: ModelConfig, *, tp: int, pp: int, dp: int, faults: Mapping[Coords, LoaderFaults] | None, expert_parallel: bool) -> None:
        self.cfg = cfg
        self.tp, self.pp, self.dp = tp, pp, dp
        self.faults = dict(faults or {})
        self.shards: dict[Coords, EngineShard] = {
            (d, p, t): EngineShard(cfg, t, tp, p, pp, self.faults.get((d, p, t), LoaderFaults()), dp_rank=d, dp_size=dp, expert_parallel=expert_parallel, engine=self.layout)
            for d in range(dp) for p in range(pp) for t in range(tp)
        }  # fmt: skip
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []  # every request received: (path, body, headers) for the tests
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None
        self.load()

    def load(
        self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None = None, *, ranks: Iterable[Coords] | None = None
    ) -> None:
        """The trainer's weight update: every rank (or only ``ranks``, (dp, pp, tp) each) loads ``weights``
        (default: the config's own), with its faults."""
        if weights is None:
            weights = build_state_dict(self.cfg)
        items = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
        chosen = set(self.shards) if ranks is None else set(ranks)
        unknown = chosen - set(self.shards)
        if unknown:
            raise ValueError(f"no such ranks (dp, pp, tp): {sorted(unknown)}")
        with self.lock:
            for coords in sorted(chosen):
                self.shards[coords].load_weights(items)

    def app(self) -> Any:
        """The engine's HTTP routes (a Starlette app): each fake engine (SimVllm, SimSglang) defines its own."""
        raise NotImplementedError(f"{type(self).__name__} must define app(): the routes of the engine it fakes")

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0: a free port); the base URL."""
        from wcviz._serving import serve_in_thread

        if self._thread is not None:
            raise RuntimeError(f"{self.name} already serving at {self.url}")
        self._server, self._thread, self.url = serve_in_thread(self.app(), host, port, name=f"simulated {self.name}")
        return self.url

    def stop(self) -> None:
        """Stop serving; safe to call twice."""
        from wcviz._serving import stop_server

        if self._server is not None and self._thread is not None:
            stop_server(self._server, self._thread, f"simulated {self.name} at {self.url}")
        self._server = self._thread = self.url = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SimVllm(_Served):
    """A vLLM 0.33.0 API server in dev mode: ``/weight_checker`` and ``/get_world_size`` over simulated ranks.

    ``dp`` replicas of ``tp`` x ``pp`` ranks; ``managed``: the DP indices this API
    server's engine client reaches (default all; fewer is an external load balancer
    with one API server per engine). ``dev_mode=False`` serves neither route (404), only ``GET /version`` (which vLLM always serves), as
    vLLM without ``VLLM_SERVER_DEV_MODE=1``.
    """

    name = "vLLM"

    def __init__(
        self, cfg: ModelConfig, *, tp: int = 1, pp: int = 1, dp: int = 1, faults: Mapping[Coords, LoaderFaults] | None = None,
        managed: Iterable[int] | None = None, dev_mode: bool = True, expert_parallel: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(cfg, tp=tp, pp=pp, dp=dp, faults=faults, expert_parallel=expert_parallel)
        self.managed = sorted(set(range(dp) if managed is None else managed))
        self.dev_mode = dev_mode

    def _checksums(self) -> dict[str, str]:
        """``compute_weight_checksums`` of every managed engine, worker by worker, merged as the route does."""
        out: dict[str, str] = {}
        for (d, p, t), shard in sorted(self.shards.items()):
            if d not in self.managed:
                continue
            prefix = f"dp{d}:pp{p}:pcp0:tp{t}:"  # gpu_worker._weight_checksum_prefix: data_parallel_index, pp, pcp, tp
            for name, w in shard.params.items():
                out[prefix + name] = hashlib.sha256(_raw(w).tobytes()).hexdigest()
        return out

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        def error(message: str, status: int, param: str | None = None) -> JSONResponse:
            phrase = {400: "Bad Request", 500: "Internal Server Error"}[status]  # ErrorResponse(ErrorInfo(...)).model_dump()
            return JSONResponse({"error": {"message": message, "type": phrase, "param": param, "code": status}}, status_code=status)

        async def weight_checker(request: Request) -> JSONResponse:
            try:
                body = await request.json()
            except ValueError:
                body = None
            self.requests.append({"path": "/weight_checker", "body": body, "headers": dict(request.headers)})
            action = body.get("action") if isinstance(body, dict) else None
            if action not in ("checksum", "reset", "compare"):  # FastAPI's RequestValidationError -> vLLM's handler
                detail = {"type": "literal_error", "loc": ("body", "action"), "msg": "Input should be 'checksum', 'reset' or 'compare'", "input": action}
                return error(f"1 validation error:\n  {detail}", 400, "body.action")
            baseline = body.get("baseline")
            with self.lock:
                if action == "reset":
                    for (d, _, _), shard in self.shards.items():
                        if d in self.managed:  # zero_weights on every worker the engine client reaches
                            for w in shard.params.values():
                                w.zero_()
                    return JSONResponse({"status": "reset"})
                if action == "compare" and baseline is None:
                    return error("action='compare' requires a 'baseline' object", 400)
                checksums = self._checksums()
            if action == "checksum":
                return JSONResponse({"checksums": checksums})
            mismatches = sorted(k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k))
            return JSONResponse({"match": not mismatches, "mismatches": mismatches})

        async def world_size(request: Request) -> JSONResponse:
            self.requests.append({"path": "/get_world_size", "body": dict(request.query_params), "headers": dict(request.headers)})
            include_dp = request.query_params.get("include_dp", "true").lower() not in ("false", "0", "no", "off")
            per_replica = self.tp * self.pp  # parallel_config.world_size (pcp 1)
            return JSONResponse({"world_size": per_replica * self.dp if include_dp else per_replica})

        async def not_found(request: Request, exc: Exception) -> JSONResponse:  # FastAPI's default for a route it lacks
            return JSONResponse({"detail": "Not Found"}, status_code=404)

        async def version(request: Request) -> JSONResponse:  # entrypoints/serve/instrumentator/basic.py: always served
            return JSONResponse({"version": "0.33.0"})

        routes = [Route("/weight_checker", weight_checker, methods=["POST"]), Route("/get_world_size", world_size, methods=["GET"])]
        always = [Route("/version", version, methods=["GET"])]
        return Starlette(routes=always + (routes if self.dev_mode else []), exception_handlers={404: not_found})


def _sglang_gpu(raw: np.ndarray) -> str:
    from wcviz.digest import reference_sglang_gpu  # the plain numpy transcription of SGLang's kernel

    return f"{reference_sglang_gpu(raw):016x}"


def _sglang_cpu(raw: np.ndarray) -> str:  # mm_utils.tensor_hash on a CPU tensor
    return f"{int.from_bytes(hashlib.sha256(raw.tobytes()).digest()[:8], byteorder='big', signed=False):016x}"


def _overall(checksums: Mapping[str, str]) -> str:  # weight_checker.overall_checksum
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def _invalid_request(body: Any) -> str | None:
    """What SGLang's pydantic validation of ``CheckWeightsReqInput`` refuses (io_struct.py: ``action: str``,
    ``allow_quant_error: bool``, ``skip_tensor_list: Optional[List[str]]``, ``selector: Literal["target", "draft",
    "all"]``), as a message; None when the body parses."""
    if not isinstance(body, dict):
        return f"1 validation error for CheckWeightsReqInput\n  Input should be an object [type=model_type, input_value={body!r}]"
    problems = []
    if not isinstance(body.get("action", "checksum"), str):
        problems.append(("action", "Input should be a valid string"))
    if not isinstance(body.get("allow_quant_error", False), bool):
        problems.append(("allow_quant_error", "Input should be a valid boolean"))
    skip = body.get("skip_tensor_list")
    if skip is not None and (not isinstance(skip, list) or not all(isinstance(s, str) for s in skip)):
        problems.append(("skip_tensor_list", "Input should be a valid list of strings"))
    if body.get("selector", "all") not in ("target", "draft", "all"):
        problems.append(("selector", "Input should be 'target', 'draft' or 'all'"))
    if not problems:
        return None
    lines = [f"{len(problems)} validation error{'s' if len(problems) > 1 else ''} for CheckWeightsReqInput"]
    lines += [f"{field}\n  {msg} [input_value={body.get(field)!r}]" for field, msg in problems]
    return "\n".join(lines)


class SimSglang(_Served):
    """An SGLang 0.5.23 server's ``POST /weights_checker`` over simulated ranks.

    ``dp`` data-parallel schedulers of ``tp`` x ``pp`` ranks. Every rank runs an action;
    the answer is TP rank 0 of pipeline stage 0's (per DP scheduler: its ``success`` and
    ``message``; for ``checksum``, the all_gather of stage 0's TP group), as SGLang answers:
    another rank's failure is only logged there. A body SGLang's pydantic model refuses is
    HTTP 400 with SGLang's generic error shape. ``draft``: a draft model's config (speculative decoding: role ``draft``,
    its keys prefixed ``draft.``). ``admin_api_key``/``api_key``: the server's keys
    (the route is ``ADMIN_OPTIONAL``). ``device``: ``cuda`` (checksums by SGLang's
    Triton kernel, ``sglang-gpu``) or ``cpu`` (``sglang-cpu``). ``legacy_info``: answer
    ``parallelism_info`` as one dict (SGLang before draft roles). ``failing``: DP
    schedulers whose every request fails (``success: false``, their error message).
    """

    name = "SGLang"
    layout = "sglang"

    def __init__(
        self, cfg: ModelConfig, *, tp: int = 1, pp: int = 1, dp: int = 1, faults: Mapping[Coords, LoaderFaults] | None = None,
        draft: ModelConfig | None = None, admin_api_key: str | None = None, api_key: str | None = None,
        device: str = "cuda", legacy_info: bool = False, failing: Iterable[int] = (),
    ) -> None:  # fmt: skip
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
        super().__init__(cfg, tp=tp, pp=pp, dp=dp, faults=faults, expert_parallel=False)
        self.draft_cfg = draft
        self.drafts = {c: EngineShard(draft, c[2], tp, 0, 1, engine="sglang") for c in self.shards if c[1] == 0} if draft else {}
        if draft is not None:
            self.load_draft()
        self.admin_api_key, self.api_key = admin_api_key, api_key
        self.hash = _sglang_gpu if device == "cuda" else _sglang_cpu
        self.legacy_info = legacy_info
        self.failing = set(failing)
        self.snapshots: dict[tuple[str, Coords], dict[str, torch.Tensor]] = {}
        self.generator = torch.Generator().manual_seed(0)

    def load_draft(self) -> None:
        """The draft model's weight update."""
        assert self.draft_cfg is not None
        items = list(build_state_dict(self.draft_cfg).items())
        with self.lock:
            for shard in self.drafts.values():
                shard.load_weights(items)

    def _runners(self, selector: str, coords: Coords) -> list[tuple[str, EngineShard]]:  # weight_updater._select_runners
        roles = {"all": ("target", "draft"), "target": ("target",), "draft": ("draft",)}[selector]
        out = [("target", self.shards[coords])] if "target" in roles else []
        if "draft" in roles and coords in self.drafts:
            out.append(("draft", self.drafts[coords]))
        return out

    def _info(self, role: str, coords: Coords) -> dict[str, Any]:
        d, p, t = coords
        return {"role": role, "tp_rank": t, "tp_size": self.tp, "dp_rank": d, "dp_size": 1, "pp_rank": p, "pp_size": self.pp, "rank": p * self.tp + t, "size": self.tp * self.pp}

    def _handle(self, action: str, selector: str, skip: list[str], coords: Coords) -> dict[str, Any] | None:
        """One rank's ``WeightChecker.handle`` for each selected runner, merged as ``_merge_checksum_payloads`` does."""
        merged: dict[str, str] = {}
        infos = []
        for role, shard in self._runners(selector, coords):
            params = {n: w for n, w in shard.params.items() if not any(s in n for s in skip)}
            key = (role, coords)
            if action == "snapshot":
                self.snapshots[key] = {n: w.clone() for n, w in shard.params.items()}
            elif action == "reset_tensors":
                for w in params.values():  # _random_like: uniform floats in [0, 1)
                    w.copy_(torch.rand(w.shape, generator=self.generator, dtype=torch.float32).to(w.dtype))
            elif action == "compare":
                snap = self.snapshots.get(key)
                assert snap is not None  # WeightChecker._compare: an AssertionError without a message
                bad = [
                    f"name={n} max_abs_err={(w.float() - snap[n].float()).abs().max().item()} mean_abs_err=... num_exceed=... expect=... actual=... "
                    for n, w in params.items() if not torch.equal(w, snap[n])
                ]  # fmt: skip
                if bad:
                    raise RuntimeError("check tensor equality failed:\n" + "\n".join(bad))
            elif action == "checksum":
                sums = {n: self.hash(_raw(w)) for n, w in params.items()}
                merged.update({(n if role == "target" else f"{role}.{n}"): v for n, v in sums.items()})
                infos.append(self._info(role, coords))
            else:
                raise RuntimeError(f"Unsupported action={action!r}")
        if action == "compare":
            for role, _ in self._runners(selector, coords):
                self.snapshots.pop((role, coords), None)  # a compare that passed frees the snapshot
        if action != "checksum" or not infos:
            return None
        return {"checksums": merged, "per_gpu_checksum": _overall(merged), "parallelism_info": infos[0] if self.legacy_info else infos}

    def app(self) -> Any:
        import secrets

        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        def allowed(header: str | None) -> bool:  # auth.decide_request_auth for ADMIN_OPTIONAL
            key = self.admin_api_key or self.api_key
            if not key:
                return True
            parts = (header or "").split(" ", 1)
            return len(parts) == 2 and parts[0].lower() == "bearer" and secrets.compare_digest(parts[1], key)

        async def check_weights(request: Request) -> JSONResponse:
            raw = await request.body()
            body = json.loads(raw) if raw else None
            self.requests.append({"path": "/weights_checker", "body": body, "headers": dict(request.headers)})
            if not allowed(request.headers.get("authorization")):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            body = {} if body is None else body
            invalid = _invalid_request(body)
            if invalid is not None:  # FastAPI's RequestValidationError -> http_server.py:635-691: 400, ErrorResponse
                return JSONResponse({"object": "error", "message": invalid, "type": "Bad Request", "param": None, "code": 400}, status_code=400)
            action, selector = body.get("action", "checksum"), body.get("selector", "all")
            skip = body.get("skip_tensor_list") or []
            results: list[tuple[bool, str, list[dict[str, Any]] | None]] = []  # one CheckWeightsReqOutput per DP scheduler
            with self.lock:
                for d in range(self.dp):
                    if d in self.failing:
                        results.append((False, f"check_weights failed on DP rank {d}", None))
                        continue
                    # Every rank runs the action; only TP rank 0 of pipeline stage 0 has a socket to the
                    # tokenizer (scheduler.py:816-839, ipc_channels.py:36-72; the others' SenderWrapper(None)
                    # drops its output, output_sender.py:17-18), so another rank's failure is only logged.
                    # checksum all_gathers the TP group of stage 0 (weight_updater.py:436-442).
                    outcome: dict[tuple[int, int], tuple[bool, str, dict[str, Any] | None]] = {}
                    for p in range(self.pp):
                        for t in range(self.tp):
                            try:
                                outcome[(p, t)] = (True, "Success.", self._handle(action, selector, skip, (d, p, t)))
                            except Exception as e:  # noqa: BLE001 - the scheduler answers its error as the message
                                outcome[(p, t)] = (False, f"{e}", None)
                    ok, message, _ = outcome[(0, 0)]
                    gathered = [g for t in range(self.tp) if (g := outcome[(0, t)][2]) is not None] if ok else []
                    results.append((ok, message, gathered or None))
            success = all(ok for ok, _, _ in results)
            out: dict[str, Any] = {"success": success, "message": " | ".join(m for _, m, _ in results)}
            if any(p is not None for _, _, p in results):
                ranks = [info for _, _, p in results if p is not None for info in p]
                h = hashlib.sha256()
                for info in ranks:
                    h.update(info["per_gpu_checksum"].encode())
                out["ranks"], out["per_engine_checksum"] = ranks, h.hexdigest()
            return JSONResponse(out, status_code=200 if success else 400)

        return Starlette(routes=[Route("/weights_checker", check_weights, methods=["GET", "POST"])])
