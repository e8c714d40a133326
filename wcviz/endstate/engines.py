"""The end-state check through the engines' own weight checkers: nothing of wcviz installed in the engine.

Two more :class:`wcviz.endstate.Fleet` implementations, run by the same session:

- :class:`VllmCheckerFleet`: vLLM's ``/weight_checker`` (vLLM 0.33.0, dev mode). vLLM has
  no snapshot action: the checksums before the reset are the snapshot. Its reset writes
  zeros, and the ``vllm-sha256`` of N zero bytes is computable, so the reset's coverage
  is proven wherever a parameter's byte count is known: vLLM's answer has no sizes, so
  give ``sizes`` (a frame with ``dp``, ``pp``, ``tp``, ``name``, ``nbytes``: the
  :func:`wcviz.layouts.expected_frame` of the checkpoint) or every match stays
  ``unproven``. After the reload, vLLM's own ``compare`` against the snapshot's
  checksums is reported beside the verdicts.
- :class:`SglangFleet`: SGLang's ``/weights_checker`` (SGLang 0.5.23): ``snapshot``, then
  ``reset_tensors`` (random values: nothing proves coverage, so a reload equal to its
  snapshot is ``unproven``, never ``match``; ``unwritten`` and ``corrupted`` stand), the
  reload, and SGLang's own ``compare`` against its snapshot beside the verdicts. SGLang
  answers that compare for TP rank 0 of pipeline stage 0 of each DP scheduler only (the
  other ranks compare too, but their failures are only logged), so its line says so; the
  per-rank verdicts are what cover every rank.

:func:`vllm_endstate` and :func:`sglang_endstate` run the whole check and return an
:class:`EngineEndstate` (calling them is the opt-in). A fleet made by hand mutates a
live engine (DESTRUCTIVE) only when made with ``allow_mutations=True`` and a ``reload``:
until then its snapshot, reset and reload raise ``PermissionError`` and a dashboard's
buttons stay off.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from wcviz._text import rank_label
from wcviz.endstate.session import EndStateReport, EndStateSession, run
from wcviz.frame import IDENTITY
from wcviz.sources import ActionResult, EngineEndpointError, FetchResult

__all__ = ["EngineEndstate", "SglangEndstate", "SglangFleet", "VllmCheckerFleet", "sglang_endstate", "vllm_endstate"]

_IDENTITY_FIELDS = ("role", *IDENTITY, "host")
_SIZE_KEY = ["dp", "pp", "tp", "name"]


def _known(row: Mapping[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in _IDENTITY_FIELDS if k in row and row[k] is not None and not pd.isna(row[k])}


class _EngineFleet:
    """What both engines' fleets share: ranks learnt from the answers, the caller's reload, an opt-in to mutate."""

    reset_pattern: str | int = "unknown"
    engine = "engine"

    def __init__(self, base_url: str, reload: Callable[[], object] | None, allow_mutations: bool) -> None:
        if reload is not None and not callable(reload):
            raise TypeError(f"reload must be a callable that runs the weight update, got {type(reload).__name__}")
        self.base = str(base_url).rstrip("/")
        self.reload_fn = reload
        self.allow_mutations = bool(allow_mutations)
        self.known: dict[str, dict[str, Any]] = {}

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(self.known) or (self.base,)

    def identity(self, target: str) -> Mapping[str, Any]:
        return self.known.get(target, {})

    def mutation_block(self, infos: Mapping[str, Any] = {}, errors: Mapping[str, str] = {}) -> str | None:  # noqa: B006 - read only
        """Why the dashboard must not snapshot, reset or reload this engine, or None."""
        if not self.allow_mutations:
            return f"mutations are off: the reset overwrites every weight of the live {self.engine}; pass allow_mutations=True to the fleet"
        if self.reload_fn is None:
            return "no reload given: the fleet needs reload=<a callable that runs the weight update again>"
        return None

    def _require(self, action: str) -> None:
        """Refuse ``action`` unless the fleet was made to mutate (and, for the reload, given one)."""
        block = self.mutation_block()
        if block is not None:
            raise PermissionError(f"{action} refused: {block}")

    def _learn(self, res: FetchResult, phase: str) -> FetchResult:
        gone = [
            {"url": label, "kind": "unreachable", "error": f"gave no checksums in phase {phase} (it did before)", **ident}
            for label, ident in self.known.items() if label not in res.urls
        ]  # fmt: skip
        whole = res.failed[res.failed["url"] == self.base]
        if gone and len(whole):  # the engine's own error explains the ranks gone: say it on them, not as one more "rank"
            said = "; ".join(str(e) for e in whole["error"])
            gone = [{**g, "error": f"{g['error']}: {said}"} for g in gone]
            kept = res.failed[res.failed["url"] != self.base].reset_index(drop=True)
            errors = {u: e for u, e in res.errors.items() if u != self.base}
            res = FetchResult(tuple(u for u in res.urls if u != self.base), res.frame, kept, errors, dict(res.infos))
        for r in res.frame.drop_duplicates("url").to_dict(orient="records"):
            self.known[str(r["url"])] = _known(r)
        for r in res.failed.to_dict(orient="records"):
            self.known.setdefault(str(r["url"]), {}).update(_known(r))
        return res.with_failed(gone)

    def _reload(self) -> ActionResult:
        if self.reload_fn is None:
            raise RuntimeError(f"no reload given: {type(self).__name__}(..., reload=<the weight update>)")
        done = self.reload_fn()
        if isinstance(done, ActionResult):
            return done
        return ActionResult("reload", self.targets, answers={t: {} for t in self.targets})


class VllmCheckerFleet(_EngineFleet):
    """vLLM's own ``/weight_checker`` at ``base_url`` (dev mode), and the caller's ``reload``; see the module doc."""

    reset_pattern = "zeros"
    engine = "vLLM"

    def __init__(
        self,
        base_url: str,
        reload: Callable[[], object] | None = None,
        *,
        sizes: pd.DataFrame | None = None,
        token: str | None = None,
        allow_mutations: bool = False,
        timeout_s: float = 120.0,
        client: Any = None,
        transport: Any = None,
    ) -> None:
        super().__init__(base_url, reload, allow_mutations)
        if sizes is not None:
            missing = [c for c in (*_SIZE_KEY, "nbytes") if c not in sizes]
            if missing:
                raise ValueError(f"sizes needs the columns {', '.join(_SIZE_KEY)}, nbytes (an expected_frame); it lacks {', '.join(missing)}")
            sizes = sizes[[*_SIZE_KEY, "nbytes"]].drop_duplicates(_SIZE_KEY)
        self.sizes = sizes
        self.net: dict[str, Any] = {"token": token, "timeout_s": timeout_s, "client": client, "transport": transport}
        self.baseline: dict[str, str] | None = None

    def digests(self, phase: str) -> FetchResult:
        from wcviz.sources import from_vllm_weight_checker, vllm_checksum_keys

        res = from_vllm_weight_checker(self.base, phase=phase, **self.net)
        if phase == "snapshot":
            if not len(res.frame):
                raise EngineEndpointError(f"no rank gave snapshot checksums, nothing was changed: {res.summary}")
            self.baseline = vllm_checksum_keys(res.frame)
        if self.sizes is not None and len(res.frame):
            frame = res.frame.drop(columns="nbytes").merge(self.sizes, on=_SIZE_KEY, how="left")
            frame["nbytes"] = frame["nbytes"].astype("Int64")
            unsized = frame[frame["nbytes"].isna()]
            if phase == "snapshot" and len(unsized):  # sizes for another topology or model: refused before any reset
                at = ", ".join(dict.fromkeys(rank_label(r, "short") for r in unsized.to_dict(orient="records")))
                raise ValueError(
                    f"sizes do not fit this engine: {len(unsized):,} of {len(frame):,} parameters it answered for have no "
                    f"size row (on {at}; e.g. {unsized['name'].iloc[0]}): cut them with expected_frame for this engine's "
                    "topology (tp, pp, dp). Nothing was reset"
                )
            res = FetchResult(res.urls, frame, res.failed, dict(res.errors), dict(res.infos))
        return self._learn(res, phase)

    def act(self, action: str) -> ActionResult:
        from wcviz.sources import vllm_weight_checker

        self._require(action)
        if action == "snapshot":  # vLLM keeps no snapshot: the checksums fetched now are it
            return ActionResult(action, self.targets, answers={t: {} for t in self.targets})
        if action == "reset":
            vllm_weight_checker(self.base, "reset", **self.net)  # raises for the whole engine: {"status": "reset"} or nothing
            return ActionResult(action, self.targets, answers={t: {"status": "reset"} for t in self.targets})
        return self._reload()

    def compare(self) -> ActionResult:
        """vLLM's own ``compare`` of the weights now against the snapshot's checksums: one engine-wide answer."""
        from wcviz.sources import vllm_weight_checker

        out = ActionResult("compare", (self.base,))
        if self.baseline is None:
            out.errors[self.base] = "no snapshot was taken: nothing to compare against"
            return out
        try:
            data = vllm_weight_checker(self.base, "compare", baseline=self.baseline, **self.net)
        except EngineEndpointError as e:
            out.record(self.base, e)
            return out
        if data.get("match") is True:
            out.answers[self.base] = data
        else:
            keys = [str(k) for k in data.get("mismatches") or []]
            shown = ", ".join(keys[:5]) + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else "")
            out.errors[self.base] = f"{len(keys)} checksum(s) differ from the snapshot: {shown}"
        return out


class SglangFleet(_EngineFleet):
    """SGLang's own ``/weights_checker`` at ``base_url``, and the caller's ``reload``; see the module doc.

    ``token``: the admin API key; ``selector`` and ``skip`` go to every request
    (SGLang's ``selector`` and ``skip_tensor_list``).
    """

    reset_pattern = "unknown"
    engine = "SGLang"
    compare_scope = "it answers for TP rank 0 of pipeline stage 0 of each DP replica only; wcviz's per-rank checksums cover every rank"

    def __init__(
        self,
        base_url: str,
        reload: Callable[[], object] | None = None,
        *,
        token: str | None = None,
        selector: str = "all",
        skip: Sequence[str] | None = None,
        algo: str = "sglang-gpu",
        allow_mutations: bool = False,
        timeout_s: float = 120.0,
        client: Any = None,
        transport: Any = None,
    ) -> None:
        super().__init__(base_url, reload, allow_mutations)
        self.net: dict[str, Any] = {"token": token, "selector": selector, "skip": skip, "timeout_s": timeout_s, "client": client, "transport": transport}
        self.algo = algo

    def digests(self, phase: str) -> FetchResult:
        from wcviz.sources import from_sglang

        res = from_sglang(self.base, phase=phase, algo=self.algo, **self.net)
        if phase == "snapshot" and not len(res.frame):
            raise EngineEndpointError(
                f"no rank gave snapshot checksums, no weight was changed (SGLang holds its snapshot in host memory until "
                f"a compare passes or it restarts): {res.summary}"
            )
        return self._learn(res, phase)

    def act(self, action: str) -> ActionResult:
        from wcviz.sources import sglang_action

        self._require(action)
        if action == "reload":
            return self._reload()
        res = sglang_action(self.base, "reset_tensors" if action == "reset" else action, **self.net)
        if action == "snapshot" and res.errors:
            raise EngineEndpointError(f"snapshot failed, no weight was changed: {res.summary}")
        if action == "reset" and res.errors:
            raise EngineEndpointError(f"reset_tensors did not complete (some weights may be random now), the check is void: {res.summary}")
        return ActionResult(action, self.targets, answers={t: res.answers[self.base] for t in self.targets})

    def compare(self) -> ActionResult:
        """SGLang's own ``compare`` against its snapshot (which a passing compare frees)."""
        from wcviz.sources import sglang_action

        return sglang_action(self.base, "compare", **{k: v for k, v in self.net.items()})


@dataclass
class EngineEndstate(EndStateReport):
    """An end-state report through an engine's own checker, with the engine's own ``compare`` beside the verdicts."""

    compare: ActionResult | None = None
    engine: str = ""
    compare_scope: str = ""  # which ranks the engine's own compare answers for, when not every rank

    @property
    def compare_line(self) -> str | None:
        """One line: what the engine's own compare said (``passed``, or ``FAILED:`` and why), or None if not run."""
        if self.compare is None:
            return None
        if not self.compare.errors:  # a failure's message says where it was found
            return f"{self.engine}'s own compare: passed{f' ({self.compare_scope})' if self.compare_scope else ''}"
        said = " ".join(" ".join(self.compare.errors.values()).split())
        return f"{self.engine}'s own compare: FAILED: {said[:400]}{'...' if len(said) > 400 else ''}"

    @property
    def ok(self) -> bool:
        """The verdicts' ``ok``, and the engine's own compare (when run) passed: a pass beside "FAILED" is no pass."""
        return super().ok and (self.compare is None or not self.compare.errors)

    @property
    def summary(self) -> Any:
        line = super().summary
        if self.compare is not None:
            line = type(line)(f"{line}\n  {self.compare_line}")
        return line


SglangEndstate = EngineEndstate  # the name of wcviz 0.1


def _native(fleet: VllmCheckerFleet | SglangFleet, compare: bool, allow_partial_reset: bool, progress: bool) -> EngineEndstate:
    report = run(EndStateSession(fleet), allow_partial_reset=allow_partial_reset, raise_if_poisoned=True, progress=progress)
    compared = fleet.compare() if compare else None
    notes = list(report.notes)
    if isinstance(fleet, SglangFleet) and compared is not None and compared.errors:
        notes.append("SGLang keeps its snapshot (a host copy of every weight) after a compare that failed: a compare that passes, or a restart, frees it")
    elif isinstance(fleet, SglangFleet) and compared is not None and not set(report.verdicts["status"]) <= {"match", "unproven"}:
        notes.append(
            "SGLang's compare passed on TP rank 0 of pipeline stage 0, but the verdicts find problems: a rank whose own compare "
            "failed (SGLang only logs it) keeps its snapshot (a host copy of every weight) until a compare passes there or a restart"
        )
    fields = {f: getattr(report, f) for f in EndStateReport.__dataclass_fields__}
    return EngineEndstate(**{**fields, "notes": notes}, compare=compared, engine=fleet.engine, compare_scope=getattr(fleet, "compare_scope", ""))


def vllm_endstate(
    base_url: str,
    reload: Callable[[], object],
    *,
    sizes: pd.DataFrame | None = None,
    token: str | None = None,
    timeout_s: float = 120.0,
    allow_partial_reset: bool = False,
    compare: bool = True,
    progress: bool = False,
    client: Any = None,
    transport: Any = None,
) -> EngineEndstate:
    """The end-state check on a running vLLM through its own ``/weight_checker`` (:class:`VllmCheckerFleet`).

    checksum (phase ``snapshot``); reset (zeros), checksum (``reset``); ``reload()`` - the
    caller's weight update, e.g. the trainer sending its weights again - then checksum
    (``reload``); and, if ``compare``, vLLM's own ``compare`` against the snapshot.
    ``sizes`` (the checkpoint's :func:`wcviz.layouts.expected_frame`) makes the reset's
    coverage provable. DESTRUCTIVE. A failed reload raises
    :class:`wcviz.endstate.EngineLeftPoisoned` (the engine then serves zeros).
    """
    fleet = VllmCheckerFleet(
        base_url, reload, sizes=sizes, token=token, allow_mutations=True, timeout_s=timeout_s, client=client, transport=transport,
    )  # fmt: skip
    return _native(fleet, compare, allow_partial_reset, progress)


def sglang_endstate(
    base_url: str,
    reload: Callable[[], object],
    *,
    token: str | None = None,
    selector: str = "all",
    skip: Sequence[str] | None = None,
    algo: str = "sglang-gpu",
    client: Any = None,
    transport: Any = None,
    timeout_s: float = 120.0,
    allow_partial_reset: bool = False,
    compare: bool = True,
    progress: bool = False,
) -> EngineEndstate:
    """The end-state check on a running SGLang through its own ``/weights_checker`` (:class:`SglangFleet`).

    snapshot, checksum (phase ``snapshot``); reset_tensors, checksum (``reset``);
    ``reload()`` then checksum (``reload``); and, if ``compare``, SGLang's own
    ``compare``, reported beside the verdicts. A rank that failed, or went missing, in a
    phase is ``unreachable``; pipeline stages after the first never answer. The reload
    runs even when the reset failed; a failed reload raises
    :class:`wcviz.endstate.EngineLeftPoisoned`.
    """
    fleet = SglangFleet(
        base_url, reload, token=token, selector=selector, skip=skip, algo=algo, allow_mutations=True, timeout_s=timeout_s,
        client=client, transport=transport,
    )  # fmt: skip
    return _native(fleet, compare, allow_partial_reset, progress)
