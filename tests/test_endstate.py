"""The end-state check: poison, coverage, classification, summary and orchestration."""

from __future__ import annotations

import re
from collections.abc import Callable

import pandas as pd
import pytest
import torch

from wcviz._errors import AlgorithmMismatch, TableError, WcvizError
from wcviz.endstate import (
    ENDSTATE_STATUSES,
    CallableFleet,
    EndStateSession,
    EngineLeftPoisoned,
    ResetNotCovered,
    classify,
    poison_,
    reset_coverage,
    run,
    run_check,
    summary,
)
from wcviz.sources._tensors import from_named_tensors

COORDS = [(pp, tp) for pp in (0, 1) for tp in (0, 1)]  # rank = 2 * pp + tp


def _shard(pp: int, tp: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * pp + tp)
    return {
        f"model.layers.{pp}.self_attn.q_proj.weight": torch.randn(4, 8, generator=g),
        f"model.layers.{pp}.mlp.down_proj.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
        f"model.layers.{pp}.input_layernorm.weight": torch.ones(8),
        f"model.layers.{pp}.mlp.bias": torch.zeros(8),  # all-zero still must be poisoned
    }


class Engine:
    """Four in-process shards that a 'trainer' (``truth``) can reload, with fault hooks."""

    def __init__(self) -> None:
        self.truth = {c: _shard(*c) for c in COORDS}
        self.shards = {c: {n: t.clone() for n, t in d.items()} for c, d in self.truth.items()}
        self.skip: dict[tuple[int, int], set[str]] = {}
        self.reload_error: Exception | None = None
        self.reset_error: Exception | None = None
        self.reloads = 0

    def snapshot(self) -> None:
        """Nothing to do: the snapshot is the digests the check takes next."""

    def reset(self) -> None:
        if self.reset_error:
            raise self.reset_error
        for d in self.shards.values():
            poison_(d)

    def reload(self) -> None:
        self.reloads += 1
        if self.reload_error:
            raise self.reload_error
        for c, d in self.shards.items():
            for n, t in d.items():
                if n not in self.skip.get(c, set()):
                    t.copy_(self.truth[c][n])

    def digest(self, phase: str, shards: dict | None = None) -> pd.DataFrame:
        shards = self.shards if shards is None else shards
        frames = [_digest_rank(phase, pp, tp, _content(d)) for (pp, tp), d in shards.items()]
        return pd.concat(frames, ignore_index=True)


def _content(d: dict[str, torch.Tensor]) -> tuple:
    """A hashable copy of a shard's names, dtypes, shapes and bytes (a digest cache key)."""
    return tuple((n, t.dtype, tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) for n, t in d.items())


_CACHE: dict[tuple, pd.DataFrame] = {}


def _digest_rank(phase: str, pp: int, tp: int, content: tuple) -> pd.DataFrame:
    """``from_named_tensors`` of one rank, cached by content: the same bytes digest the same."""
    key = (phase, pp, tp, content)
    if key not in _CACHE:
        tensors = {n: torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape) if raw else torch.empty(shape, dtype=dt)
                   for n, dt, shape, raw in content}
        _CACHE[key] = from_named_tensors(tensors, role="engine", rank=2 * pp + tp, pp=pp, tp=tp, phase=phase, backend="torch")
    return _CACHE[key].copy()


def _phases(engine: Engine, between: Callable[[Engine], None] | None = None) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    snap = engine.digest("snapshot")
    engine.reset()
    reset = engine.digest("reset")
    engine.reload()
    if between:
        between(engine)
    return snap, reset, engine.digest("reload")


def _bad(v: pd.DataFrame) -> set[tuple[int, str, str]]:
    rows = v[v["status"] != "match"]
    return {(int(r["rank"]), r["name"], r["status"]) for _, r in rows.iterrows()}


def test_clean_reload_all_match():
    v = classify(*_phases(Engine()))
    assert len(v) == 16 and set(v["status"]) == {"match"}
    assert v["reset_covered"].all() and not v["rank_absent"].any()
    assert (v["digest_reset"] != v["digest_snapshot"]).all()
    assert list(v.columns[:6]) == ["rank", "dp", "pp", "tp", "ep", "name"]


def test_skipped_params_are_unwritten_on_that_rank_only():
    e = Engine()
    names = sorted(e.truth[(1, 0)])[:2]
    e.skip[(1, 0)] = set(names)
    v = classify(*_phases(e))
    assert _bad(v) == {(2, n, "unwritten") for n in names}
    assert list(v["status"][:2]) == ["unwritten", "unwritten"]  # most severe first


def test_wrong_values_are_corrupted():
    def swap(e: Engine) -> None:  # rank 1 got rank 0's slice of the same layer
        name = "model.layers.0.self_attn.q_proj.weight"
        e.shards[(0, 1)][name].copy_(e.truth[(0, 0)][name])

    v = classify(*_phases(Engine(), swap))
    assert _bad(v) == {(1, "model.layers.0.self_attn.q_proj.weight", "corrupted")}
    assert v.iloc[0]["status"] == "corrupted"


def test_dropped_param_missing_and_new_param_unexpected():
    def change(e: Engine) -> None:
        del e.shards[(1, 1)]["model.layers.1.mlp.bias"]
        e.shards[(0, 0)]["model.layers.0.extra.weight"] = torch.ones(2)

    v = classify(*_phases(Engine(), change))
    assert _bad(v) == {(3, "model.layers.1.mlp.bias", "missing"), (0, "model.layers.0.extra.weight", "unexpected")}
    new = v[v["status"] == "unexpected"].iloc[0]
    assert pd.isna(new["digest_snapshot"]) and not new["reset_covered"] and new["dtype"] == "float32"


def test_absent_rank_is_all_missing_and_named():
    e = Engine()
    snap, reset, reload = _phases(e)
    reload = reload[reload["rank"] != 3]
    v = classify(snap, reset, reload)
    assert _bad(v) == {(3, n, "missing") for n in e.truth[(1, 1)]}
    assert v.loc[v["rank"] == 3, "rank_absent"].all() and not v.loc[v["rank"] != 3, "rank_absent"].any()
    assert "4 missing on 1 rank (rank 3 (pp=1 tp=1): rank absent after reload)" in summary(v)


def test_row_and_rank_order_do_not_matter():
    e = Engine()
    e.skip[(0, 1)] = {"model.layers.0.mlp.bias"}
    snap, reset, reload = _phases(e)
    expected = classify(snap, reset, reload)
    # ranks listed in another order, rows shuffled within each phase
    shuffled = [df.sample(frac=1, random_state=i).reset_index(drop=True) for i, df in enumerate((snap, reset, reload))]
    got = classify(*shuffled)
    pd.testing.assert_frame_equal(got, expected)
    reordered = e.digest("reload", dict(reversed(list(e.shards.items()))))
    assert reordered["rank"].iloc[0] == 3
    pd.testing.assert_frame_equal(classify(snap, reset, reordered), expected)
    assert _bad(got) == {(1, "model.layers.0.mlp.bias", "unwritten")}


def test_poison_changes_every_nonempty_tensor_of_every_dtype():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensors = {
        "bool_false": torch.zeros(5, dtype=torch.bool),
        "bool_true": torch.ones(5, dtype=torch.bool),
        "uint8": torch.zeros(3, dtype=torch.uint8),
        "bf16": torch.randn(4, 4).to(torch.bfloat16),
        "fp32_zeros": torch.zeros(7),
        "int64": torch.arange(6),
        "fp8": torch.randn(3, 3).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(0.0),
        "scalar_int": torch.tensor(3),
        "strided": base[:, ::2],
        "empty": torch.empty(0, 4),
    }
    before = from_named_tensors(tensors, backend="torch").set_index("name")["digest"]
    untouched = base[:, 1::2].clone()
    poison_(tensors)
    after = from_named_tensors(tensors, backend="torch").set_index("name")["digest"]
    changed = before != after
    assert changed.drop("empty").all(), list(changed[~changed].index)
    assert not changed["empty"]
    assert torch.equal(base[:, 1::2], untouched)  # a view poisons only its own elements
    assert tensors["fp32_zeros"].isfinite().all() and tensors["bf16"].float().isfinite().all()
    for name, t in tensors.items():  # every byte is the one deterministic pattern
        if t.numel():
            raw = t.contiguous().reshape(-1).view(torch.uint8)
            assert (raw == 0xA5).all(), name


def test_poison_module_parameters():
    m = torch.nn.Linear(3, 2)
    m.register_buffer("scale", torch.ones(2))
    poison_(m)
    assert (m.weight.detach().view(torch.uint8) == 0xA5).all() and (m.bias.detach().view(torch.uint8) == 0xA5).all()
    assert torch.equal(m.scale, torch.ones(2))  # buffers only when asked
    poison_(m, include_buffers=True)
    assert (m.scale.view(torch.uint8) == 0xA5).all()


def _reset_misses(e: Engine, coord: tuple[int, int], name: str) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    snap = e.digest("snapshot")
    keep = e.shards[coord][name].clone()
    e.reset()
    e.shards[coord][name].copy_(keep)  # the reset did not reach it
    reset = e.digest("reset")
    e.reload()
    return snap, reset, e.digest("reload")


def test_reset_coverage_failure_names_param_and_rank():
    e = Engine()
    e.shards[(0, 0)]["model.layers.0.empty"] = torch.empty(0)
    e.truth[(0, 0)]["model.layers.0.empty"] = torch.empty(0)
    name = "model.layers.1.input_layernorm.weight"
    snap, reset, reload = _reset_misses(e, (1, 0), name)
    cov = reset_coverage(snap, reset)
    assert len(cov) == 17
    assert set(cov.loc[~cov["covered"], "name"]) == {name, "model.layers.0.empty"}
    assert bool(cov.loc[cov["name"] == "model.layers.0.empty", "empty"].iloc[0])
    with pytest.raises(ResetNotCovered) as info:
        classify(snap, reset, reload)
    msg = str(info.value)
    assert f"{name} on rank 2 (pp=1 tp=0)" in msg and "15 of 16" in msg and "void" in msg
    assert "empty" in msg and "model.layers.0.empty" in msg
    assert isinstance(info.value, WcvizError) and isinstance(info.value, RuntimeError)
    assert len(info.value.coverage) == 17


def test_empty_tensor_alone_does_not_void_the_check():
    e = Engine()
    e.shards[(0, 0)]["model.layers.0.empty"] = torch.empty(0)
    e.truth[(0, 0)]["model.layers.0.empty"] = torch.empty(0)
    v = classify(*_phases(e))
    row = v[v["name"] == "model.layers.0.empty"].iloc[0]
    assert row["status"] == "match" and not row["reset_covered"]
    assert "1 not covered by the reset" in summary(v)


def test_allow_partial_reset_classifies_and_flags():
    name = "model.layers.1.input_layernorm.weight"
    snap, reset, reload = _reset_misses(Engine(), (1, 0), name)
    v = classify(snap, reset, reload, allow_partial_reset=True)
    assert set(v["status"]) == {"match", "unproven"}  # never "match": the reset proved nothing about it
    flagged = v.loc[~v["reset_covered"], ["rank", "name", "status"]].to_records(index=False).tolist()
    assert flagged == [(2, name, "unproven")]
    assert v["status"].iloc[0] == "unproven"  # sorted before the matches


def test_param_absent_after_reset_is_not_covered():
    e = Engine()
    snap, reset, reload = _phases(e)
    reset = reset[~((reset["rank"] == 1) & (reset["name"] == "model.layers.0.mlp.bias"))]
    with pytest.raises(ResetNotCovered, match=r"1 absent after reset on 1 rank: model\.layers\.0\.mlp\.bias on rank 1 "):
        classify(snap, reset, reload)


def test_algorithm_mismatch():
    snap, reset, reload = _phases(Engine())
    other = reload.assign(algo="sha256", digest=reload["digest"].str.pad(64, fillchar="0"))
    with pytest.raises(AlgorithmMismatch, match="sha256"):
        classify(snap, reset, other)
    first = reset.iloc[:1]
    mixed = pd.concat([first.assign(algo="sha256", digest=first["digest"].str.pad(64, fillchar="0")), reset.iloc[1:]], ignore_index=True)
    with pytest.raises(AlgorithmMismatch, match="reset table mixes"):
        classify(snap, mixed, reload)


def test_duplicates_are_refused_naming_the_key():
    snap, reset, reload = _phases(Engine())
    dup = pd.concat([reload, reload.iloc[[5]]], ignore_index=True)
    name = reload.iloc[5]["name"]
    with pytest.raises(TableError, match=rf"reload table .*{name}"):
        classify(snap, reset, dup)
    with pytest.raises(TableError, match="snapshot table"):
        reset_coverage(pd.concat([snap, snap.iloc[[0]]]), reset)


def test_different_coordinates_are_refused():
    snap, reset, reload = _phases(Engine())
    with pytest.raises(TableError, match="coordinates"):
        classify(snap, reset, reload.assign(pp=pd.NA))


def test_summary_text():
    e = Engine()
    e.skip[(0, 1)] = {"model.layers.0.mlp.bias"}
    e.skip[(1, 1)] = {"model.layers.1.mlp.bias", "model.layers.1.input_layernorm.weight"}
    v = classify(*_phases(e))
    assert summary(v) == (
        "end-state check: 4 ranks, 16 parameters: 3 unwritten on 2 ranks "
        "(rank 1 (pp=0 tp=1), rank 3 (pp=1 tp=1)), 13 match"
    )
    assert summary(classify(*_phases(Engine()))) == "end-state check: 4 ranks, 16 parameters: 16 match"
    assert tuple(ENDSTATE_STATUSES) == (
        "corrupted", "unwritten", "missing", "empty", "unreachable", "unexpected", "unproven", "match"
    )  # fmt: skip


def test_summary_thousands_separator():
    rows = pd.DataFrame({"rank": [0] * 1500, "dp": pd.NA, "pp": pd.NA, "tp": pd.NA, "ep": pd.NA,
                         "name": [f"p{i}" for i in range(1500)], "status": ["match"] * 1500,
                         "reset_covered": True, "rank_absent": False})
    assert summary(rows) == "end-state check: 1 rank, 1,500 parameters: 1,500 match"


def test_run_check_happy_path_and_fault():
    e = Engine()
    calls: list[str] = []

    def digest(phase: str) -> pd.DataFrame:
        calls.append(phase)
        return e.digest(phase)

    v = run_check(e.snapshot, e.reset, e.reload, digest)
    assert calls == ["snapshot", "reset", "reload"]
    assert len(v) == 16 and set(v["status"]) == {"match"}
    e.skip[(1, 0)] = {"model.layers.1.mlp.down_proj.weight"}
    v = run_check(e.snapshot, e.reset, e.reload, digest)
    assert _bad(v) == {(2, "model.layers.1.mlp.down_proj.weight", "unwritten")}


def test_run_check_failing_reload_says_poisoned():
    e = Engine()
    e.reload_error = ConnectionError("rank 2 unreachable")
    with pytest.raises(EngineLeftPoisoned, match="poisoned") as info:
        run_check(e.snapshot, e.reset, e.reload, e.digest)
    assert "rank 2 unreachable" in str(info.value) and "ConnectionError" in str(info.value)
    assert (e.shards[(0, 0)]["model.layers.0.mlp.bias"].view(torch.uint8) == 0xA5).all()


def test_run_check_failing_reset_restores_then_reraises():
    e = Engine()
    e.reset_error = RuntimeError("reset endpoint 500")
    with pytest.raises(RuntimeError, match="reset endpoint 500"):
        run_check(e.snapshot, e.reset, e.reload, e.digest)
    assert e.reloads == 1
    e.reload_error = OSError("down")
    with pytest.raises(EngineLeftPoisoned, match="poisoned.*|.*reset endpoint 500"):
        run_check(e.snapshot, e.reset, e.reload, e.digest)


def test_run_check_uncovered_reset_reloads_before_raising():
    e = Engine()

    def partial_reset() -> None:
        for c, d in e.shards.items():
            poison_({n: t for n, t in d.items() if not (c == (0, 1) and n.endswith("bias"))})

    with pytest.raises(ResetNotCovered, match=r"model\.layers\.0\.mlp\.bias on rank 1"):
        run_check(e.snapshot, partial_reset, e.reload, e.digest)
    assert e.reloads == 1 and torch.equal(e.shards[(1, 1)]["model.layers.1.self_attn.q_proj.weight"], e.truth[(1, 1)]["model.layers.1.self_attn.q_proj.weight"])


# --------------------------------------------------------------------------- coverage is proven, never assumed


def test_fill_digest_equals_the_digest_of_a_filled_tensor():
    from wcviz.digest import digest_hex
    from wcviz.digest._fill import fill_digest
    from wcviz.digest._spec import CHUNK

    cases = [(torch.bfloat16, (3, 5)), (torch.float32, ()), (torch.bool, (7,)), (torch.float64, (0, 4)),
             (torch.int16, (CHUNK * 4 + 3,)), (torch.uint8, (CHUNK * 16 - 3,)), (torch.uint8, (CHUNK * 8 + 8,)),
             (torch.complex128, (3,)), (torch.float8_e4m3fn, (5, 5))]  # fmt: skip
    for dtype, shape in cases:
        for byte in (0xA5, 0x5A, 0x00):
            t = torch.empty(shape, dtype=dtype)
            flat = torch.view_as_real(t) if t.is_complex() else t
            if t.numel():
                flat.reshape(-1).view(torch.uint8).fill_(byte)
            nbytes = t.numel() * t.element_size()
            for algo in ("nemo-rl-v3", "sha256"):
                assert fill_digest(algo, str(dtype), shape, nbytes, byte) == digest_hex(t, algo=algo), (dtype, shape, byte, algo)
    with pytest.raises(ValueError, match="computable for"):
        fill_digest("sglang", "float32", (1,), 4, 0)


def _half_poisoned(name: str, coord: tuple[int, int]) -> tuple[Engine, Callable[[], None], Callable[[], None]]:
    """A reset that poisons only the first half of ``name`` on ``coord``, and a loader that writes only that half:
    the reload equals the snapshot, yet the second half was never written."""
    e = Engine()

    def half(t: torch.Tensor) -> torch.Tensor:
        return t[: t.shape[0] // 2]

    def reset() -> None:
        for c, d in e.shards.items():
            for n, t in d.items():
                poison_({n: half(t) if (c, n) == (coord, name) else t})

    def reload() -> None:
        for c, d in e.shards.items():
            for n, t in d.items():
                (half(t) if (c, n) == (coord, name) else t).copy_(half(e.truth[c][n]) if (c, n) == (coord, name) else e.truth[c][n])

    return e, reset, reload


def test_a_partial_reset_voids_the_check_naming_the_parameter():
    """A digest that *changed* is not coverage: only the digest of a fully poisoned tensor proves the reset."""
    name = "model.layers.1.self_attn.q_proj.weight"
    e, reset, reload = _half_poisoned(name, (1, 0))
    snap = e.digest("snapshot")
    reset()
    rst = e.digest("reset")
    reload()
    rel = e.digest("reload")
    cov = reset_coverage(snap, rst)
    row = cov[(cov["name"] == name) & (cov["rank"] == 2)].iloc[0]
    assert row["changed"] and not row["full"] and not row["covered"] and row["void"] and row["why"] == "only partly reset"
    assert cov.loc[cov["name"] != name, "covered"].all()
    with pytest.raises(ResetNotCovered, match=rf"1 only partly reset on 1 rank: {re.escape(name)} on rank 2 \(pp=1 tp=0\)"):
        classify(snap, rst, rel)
    v = classify(snap, rst, rel, allow_partial_reset=True)
    bad = v[v["status"] != "match"]
    assert bad[["rank", "name", "status"]].values.tolist() == [[2, name, "unproven"]]  # never "match"
    assert "1 unproven on 1 rank (rank 2 (pp=1 tp=0))" in summary(v)


def test_the_same_in_run_check():
    name = "model.layers.0.mlp.down_proj.weight"
    e, reset, reload = _half_poisoned(name, (0, 1))
    with pytest.raises(ResetNotCovered, match=re.escape(name)):
        run_check(e.snapshot, reset, reload, e.digest)


def test_an_engines_zero_reset_is_judged_by_zeros():
    """vLLM's own reset writes zeros: computable, so coverage is proven by it; a zero bias stays unproven."""
    e = Engine()
    snap = e.digest("snapshot")
    for d in e.shards.values():
        for t in d.values():
            t.zero_()
    rst = e.digest("reset")
    e.reload()
    rel = e.digest("reload")
    with pytest.raises(ResetNotCovered, match="only partly reset"):
        classify(snap, rst, rel)  # judged by the poison it is not
    v = classify(snap, rst, rel, reset_pattern="zeros")
    unproven = v[v["status"] == "unproven"]
    assert set(unproven["name"].str.rsplit(".", n=1).str[0]) == {"model.layers.0.mlp", "model.layers.1.mlp"}
    assert set(unproven["name"]) == {"model.layers.0.mlp.bias", "model.layers.1.mlp.bias"}  # all-zero: nothing to see
    assert set(v["status"]) == {"match", "unproven"} and (v.loc[v["status"] == "match", "reset_covered"]).all()


def test_a_random_reset_proves_nothing_so_matches_are_unproven():
    """SGLang's reset writes random values: a changed digest is all there is, so nothing reaches "match"."""
    e = Engine()
    snap = e.digest("snapshot")
    g = torch.Generator().manual_seed(3)
    for d in e.shards.values():
        for t in d.values():
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    rst = e.digest("reset")
    e.skip[(0, 0)] = {"model.layers.0.mlp.bias"}
    e.reload()
    v = classify(snap, rst, e.digest("reload"), reset_pattern="unknown")
    assert set(v["status"]) == {"unwritten", "unproven"}
    assert v.loc[v["status"] == "unwritten", ["rank", "name"]].values.tolist() == [[0, "model.layers.0.mlp.bias"]]
    with pytest.raises(ValueError, match="reset_pattern"):
        classify(snap, rst, rst, reset_pattern="random")


def test_an_empty_rank_is_named_never_a_pass():
    e = Engine()
    snap, rst, rel = _phases(e)
    v = classify(snap, rst, rel, empty=[{"rank": 4, "pp": 2, "tp": 0}])
    ghost = v[v["rank"] == 4]
    assert len(ghost) == 1 and ghost["status"].iloc[0] == "empty" and pd.isna(ghost["name"].iloc[0])
    assert "1 rank empty (rank 4 (pp=2 tp=0): answered with no parameters)" in summary(v)
    assert "empty" in ENDSTATE_STATUSES


def test_summary_is_a_property_and_calling_it_still_works():
    """``EndStateReport.summary`` is a property like every other summary; ``report.summary()`` keeps working."""
    from wcviz.endstate import EndStateReport, PROBLEM_COLUMNS

    v = classify(*_phases(Engine()))
    problems = pd.DataFrame({c: pd.Series(dtype="string") for c in PROBLEM_COLUMNS})
    report = EndStateReport(verdicts=v, frames={}, problems=problems)
    assert report.summary == "end-state check: 4 ranks, 16 parameters: 16 match"
    assert report.summary() == report.summary and str(report) == report.summary


# --- a rank the reload left holding the reset's values is named on every way out (a review, 2026-12-02) -------

DOWN = "model.layers.1.mlp.down_proj.weight"


def _skipping() -> Engine:
    e = Engine()
    e.skip[(1, 0)] = {DOWN}  # rank 2 (pp=1 tp=0): its loader skips one weight, which keeps the poison
    return e


def _named_rank_2(message: str) -> bool:
    return message.startswith("STILL POISONED after the reload on engine 2 (pp=1 tp=0") and "(1 parameter)" in message


def test_a_failing_hook_names_the_rank_the_reload_left_poisoned() -> None:
    """The reload ran without an error, so only the hook's error was raised: rank 2, still poisoned, went unnamed."""
    e = _skipping()

    def hook() -> None:
        raise RuntimeError("before_reload hook failed")

    with pytest.raises(EngineLeftPoisoned) as info:
        run(EndStateSession(CallableFleet(e.snapshot, e.reset, e.reload, e.digest)), before_reload=hook)
    assert _named_rank_2(str(info.value)) and "before_reload hook failed" in str(info.value)
    assert info.value.poisoned == ("engine 2 (pp=1 tp=0)",)


def test_a_void_check_and_a_report_that_cannot_be_built_name_the_rank_the_reload_left_poisoned() -> None:
    e = _skipping()
    original_reset = e.reset

    def reset_missing_one() -> None:  # the reset misses one parameter on rank 1: the check is void
        original_reset()
        shard = e.shards[(0, 1)]
        name = next(iter(shard))
        shard[name].copy_(e.truth[(0, 1)][name])

    with pytest.raises(ResetNotCovered) as void:
        run(EndStateSession(CallableFleet(e.snapshot, reset_missing_one, e.reload, e.digest)))
    assert _named_rank_2(str(void.value)) and "the end-state check is void" in str(void.value)

    e = _skipping()

    def digest(phase: str) -> pd.DataFrame:  # the reloaded workers report ep too: no verdict can be made
        frame = e.digest(phase)
        return frame.assign(ep=0) if phase == "reload" else frame

    with pytest.raises(EngineLeftPoisoned) as broken:
        run(EndStateSession(CallableFleet(e.snapshot, e.reset, e.reload, digest)))
    assert "STILL POISONED after the reload on engine 2 (pp=1 tp=0 ep=0) (1 parameter)" in str(broken.value)
    assert "no verdicts could be made" in str(broken.value)


def test_a_row_claiming_no_bytes_whose_digest_is_of_bytes_is_not_an_empty_tensor() -> None:
    """A size row of 0 bytes for a parameter whose checksum is of 64 real bytes, untouched by reset and reload: it
    was judged match, proven by nothing."""
    import hashlib

    real = hashlib.sha256(b"\x01" * 64).hexdigest()
    other = {"snapshot": hashlib.sha256(b"\x02" * 8).hexdigest(), "reset": hashlib.sha256(b"\x00" * 8).hexdigest()}
    other["reload"] = other["snapshot"]

    def frame(phase: str) -> pd.DataFrame:
        return pd.DataFrame({"role": ["engine"] * 2, "rank": [0] * 2, "dp": [0] * 2, "pp": [0] * 2, "tp": [0] * 2, "name": ["w", "v"],
                             "digest": [real, other[phase]], "algo": ["vllm-sha256"] * 2, "phase": [phase] * 2, "nbytes": [0, 8]})  # fmt: skip

    with pytest.raises(ResetNotCovered, match="1 unchanged on 1 rank: w on rank 0"):
        classify(frame("snapshot"), frame("reset"), frame("reload"), reset_pattern="zeros")
    empty = hashlib.sha256(b"").hexdigest()
    rows = [frame(p).assign(digest=[empty, other[p]]) for p in ("snapshot", "reset", "reload")]
    v = classify(*rows, reset_pattern="zeros")
    assert v.set_index("name")["status"].to_dict() == {"w": "match", "v": "match"}  # a true empty tensor proves itself
