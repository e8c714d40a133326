"""Layout rules (wcviz.layouts) against the simulated engine's loader, written apart from them.

The rules predict every rank's parameters from full weights; the sim's EngineShard
loads the same weights its own way. Clean loads must agree everywhere, and each
loader fault must show up as exactly the (rank, name) mismatches worked out here by
hand from what the fault does (never by running the rules a second time).
"""

from __future__ import annotations

import dataclasses
import re

import numba
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wcviz.digest import _numba, digest_many
from wcviz.endstate import classify, poison_
from wcviz.frame import make_frame, shape_str
from wcviz.layouts import (
    FAMILIES,
    KINDS,
    LLAMA,
    Family,
    LayoutError,
    Rule,
    bind,
    detect_family,
    expected_frame,
    expected_shards,
    expert_block,
    padded_vocab,
    stage_layers,
)
from wcviz.sim import EngineLayout, EngineShard, LoaderFaults, ModelConfig, build_state_dict, save_checkpoint
from wcviz.sources import from_named_tensors
from wcviz.verdicts import compare

# Sizes that let tp be 1, 2, 4 or 8 (heads 8, intermediate 64) and pp up to 8 (8 layers,
# split unevenly over 3, 5, 6, 7 stages); vocab 250 is no multiple of 4 or 8.
_BASE = ModelConfig(vocab=250, hidden=32, layers=8, heads=8, kv_heads=2, intermediate=64)
CONFIGS = {
    "llama": dataclasses.replace(_BASE, seed=1),
    "mistral": dataclasses.replace(_BASE, kv_heads=4, seed=2),  # tp 8 replicates kv heads, tp 4 does not
    "qwen2": dataclasses.replace(_BASE, qkv_bias=True, tie_embeddings=True, seed=3),
    "mixtral": dataclasses.replace(_BASE, intermediate=32, experts=4, moe_style="mixtral", seed=4),
    "sim-moe": dataclasses.replace(_BASE, intermediate=32, experts=2, seed=5),
}
TOPOLOGIES = [(tp, pp) for tp in (1, 2, 4, 8) for pp in range(1, 9) if tp * pp <= 8]
SIM_NAMES = "vllm<0.25"  # the sim names FusedMoE weights as vLLM did before its MoERunner refactor (experts.w13_weight)
_WEIGHTS: dict[str, dict[str, torch.Tensor]] = {}


@pytest.fixture(autouse=True, scope="module")
def _one_digest_thread():
    """Thousands of tiny tensors: numba's thread pool costs more than it saves (and stalls on a busy box)."""
    before = numba.get_num_threads()
    _numba.set_threads(1)
    yield
    _numba.set_threads(before)


def _weights(family: str, **over) -> dict[str, torch.Tensor]:
    key = f"{family}{over}"
    if key not in _WEIGHTS:
        _WEIGHTS[key] = build_state_dict(dataclasses.replace(CONFIGS[family], **over))
    return _WEIGHTS[key]


def _engine(
    cfg: ModelConfig, sd: dict, tp: int, pp: int, dp: int = 1, ep: int = 1, faults: dict | None = None
) -> dict[int, tuple]:
    """The sim's shards by global rank, loaded from ``sd``: {rank: (coords, shard)}; ``faults`` by rank."""
    lay, faults = EngineLayout(tp=tp, pp=pp, dp=dp), faults or {}
    out = {}
    for r in range(lay.world_size):
        d, p, t = lay.coords(r)
        shard = EngineShard(
            cfg, t, tp, p, pp, faults.get(r, LoaderFaults()), dp_rank=d, dp_size=dp, expert_parallel=ep > 1
        )
        coords = {"rank": r, "dp": d, "pp": p, "tp": t, "ep": shard.ep_rank if ep > 1 else None}
        shard.load_weights(sd.items())
        out[r] = (coords, shard)
    return out


def _agents(engine: dict[int, tuple]) -> pd.DataFrame:
    """What the engine's agents report: from_named_tensors on each rank, stamped with its coordinates."""
    frames = [from_named_tensors(s.params, progress=False, role="engine", **c) for c, s in engine.values()]
    return pd.concat(frames, ignore_index=True)


def _rows(engine: dict[int, tuple], phase: str = "current", **stamp) -> list[dict]:
    """:func:`_agents`' rows, to build one frame for many ranks (a frame per rank costs more than its digests)."""
    rows = []
    for coords, shard in engine.values():
        digests = digest_many(shard.params)
        rows += [
            {
                "name": n,
                "digest": str(digests[n]),
                "algo": digests[n].algo,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": shape_str(t.shape),
                "role": "engine",
                "phase": phase,
                **coords,
                **stamp,
            }
            for n, t in shard.params.items()
        ]
    return rows


def _actual(engine: dict[int, tuple], phase: str = "current") -> pd.DataFrame:
    return make_frame(_rows(engine, phase))


def _expected(family: str, sd: dict, tp: int, pp: int, dp: int = 1, ep: int = 1) -> pd.DataFrame:
    cfg = CONFIGS[family]
    return expected_frame(
        sd, family, tp=tp, pp=pp, dp=dp, ep=ep, heads=cfg.heads, kv_heads=cfg.kv_heads, vocab_padding=1, names=SIM_NAMES
    )


def _bad(verdicts: pd.DataFrame) -> set[tuple[int, str, str]]:
    rows = verdicts[verdicts["status"] != "match"]
    return {(int(r), n, s) for r, n, s in zip(rows["rank"], rows["name"], rows["status"])}


# --- clean loads: the rules and the loader agree on every rank -----------------------------


def _stack(frames: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Frames of several cases as one: ranks offset by 1000 per case, its label in ``host``."""
    return pd.concat(
        [f.assign(rank=f["rank"] + 1000 * k, host=label) for k, (label, f) in enumerate(frames.items())],
        ignore_index=True,
    )


def _stack_engines(engines: dict[str, dict[int, tuple]]) -> pd.DataFrame:
    """:func:`_stack` of the engines' reports, built as one frame."""
    rows = []
    for k, (label, engine) in enumerate(engines.items()):
        rows += [{**row, "rank": row["rank"] + 1000 * k} for row in _rows(engine, host=label)]
    return make_frame(rows)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_rules_match_the_sim_loader_on_every_rank_of_every_topology(family: str) -> None:
    """Every (tp, pp) with tp * pp <= 8, in one compare (a frame per topology costs more than its digests)."""
    cfg, sd = CONFIGS[family], _weights(family)
    expected, engines = {}, {}
    for tp, pp in TOPOLOGIES:
        label = f"tp{tp}pp{pp}"
        expected[label] = _expected(family, sd, tp, pp)
        engines[label] = _engine(cfg, sd, tp, pp)
        assert set(expected[label]["rank"]) == set(range(tp * pp)), label
    actual = _stack_engines(engines)
    cols = ["rank", "name", "digest", "shape"]  # the one-frame shortcut reports what the agents' source does
    shortcut = actual.loc[actual["host"] == "tp2pp2", cols].assign(rank=lambda f: f["rank"] % 1000)
    assert shortcut.reset_index(drop=True).equals(_agents(engines["tp2pp2"])[cols])
    v = compare(_stack(expected), actual)
    bad = v[v["status"] != "match"]
    assert bad.empty, bad[["host", "rank", "name", "status"]].head(20).to_string()
    assert len(v) == len(actual) == sum(len(s.params) for e in engines.values() for _, s in e.values())


@pytest.mark.parametrize(
    ("family", "tp", "pp", "dp", "ep", "experts"),
    [
        ("llama", 2, 2, 2, 1, 4),
        ("mixtral", 2, 2, 2, 1, 4),
        ("mixtral", 2, 1, 2, 4, 4),
        ("mixtral", 4, 2, 1, 4, 4),
        ("mixtral", 2, 2, 2, 4, 6),
        ("mixtral", 1, 1, 4, 4, 6),
    ],
)
def test_data_and_expert_parallel_ranks_line_up(family: str, tp: int, pp: int, dp: int, ep: int, experts: int) -> None:
    cfg = dataclasses.replace(CONFIGS[family], experts=experts) if CONFIGS[family].experts else CONFIGS[family]
    sd = build_state_dict(cfg)
    expected = expected_frame(
        sd, family, tp=tp, pp=pp, dp=dp, ep=ep, heads=cfg.heads, kv_heads=cfg.kv_heads, vocab_padding=1, names=SIM_NAMES
    )
    assert _bad(compare(expected, _actual(_engine(cfg, sd, tp, pp, dp, ep)))) == set()
    if ep == 1:
        assert expected["ep"].isna().all()
        if cfg.experts:  # FusedMoE without EP: every expert sliced over all tp * dp = 4 ranks, attention over tp = 2
            shapes = set(expected.loc[expected["name"].str.endswith("w2_weight"), "shape"])
            assert shapes == {f"[{experts}, {cfg.hidden}, {cfg.intermediate // (tp * dp)}]"}
        return
    by_rank = expected.drop_duplicates("rank").set_index("rank")
    assert all(by_rank.loc[r, "ep"] == by_rank.loc[r, "dp"] * tp + by_rank.loc[r, "tp"] for r in by_rank.index)
    # each EP rank holds whole experts: w13 [local experts, 2 * intermediate, hidden], blocks of 6 over 4 ranks: 2, 2, 1, 1
    w13 = expected[expected["name"] == "model.layers.0.block_sparse_moe.experts.w13_weight"]
    local = {6: [2, 2, 1, 1], 4: [1, 1, 1, 1]}[experts]
    assert {int(e): s for e, s in zip(w13["ep"], w13["shape"])} == {
        e: f"[{n}, {2 * cfg.intermediate}, {cfg.hidden}]" for e, n in enumerate(local)
    }


# --- loader faults: each caught on exactly the ranks and names it touches ------------------

TP, PP, F = 4, 2, 6  # the fault topology: 8 ranks, kv heads replicated (kv 2 < tp 4); rank 6 is (pp 1, tp 2)
LAYERS = 3  # over 2 stages: 2 and 1
# params fused from several HF tensors, and params split over TP ranks
FUSED = ("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight", "w13_weight")
TP_SPLIT = ("embed_tokens", "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head", "w13_weight", "w2_weight")


def _fault_cases(ep: int) -> dict:
    """fault -> (faults by rank, float32 weights?, which (coords, name) must mismatch), reasoned from each fault."""
    moe_split = ep == 1  # under expert parallelism experts are whole: no TP slice to get wrong
    return {
        # a skipped HF tensor leaves its (part of the) engine param at its initial zeros
        "skip": (
            {F: LoaderFaults(skip=r"\.k_proj\.|post_attention_layernorm")},
            False,
            lambda c, n: c["rank"] == F and ("qkv_proj" in n or "post_attention_layernorm" in n),
        ),
        # rank 0's slice is right on rank 0 only; q rows differ on every other rank even where kv heads are shared
        "fused_from_rank0": (
            {r: LoaderFaults(fused_from_rank0=True) for r in range(TP * PP)},
            False,
            lambda c, n: c["tp"] > 0 and n.endswith(FUSED) and (moe_split or "experts" not in n),
        ),
        "stale": ({F: LoaderFaults(stale=True)}, False, lambda c, n: c["rank"] == F),  # nothing written: all zeros
        # float32 through float16 loses mantissa bits in every element
        "cast": (
            {F: LoaderFaults(cast=r"(gate|up|down)_proj|\.w[123]\.")},
            True,
            lambda c, n: c["rank"] == F and re.search(r"gate_up_proj|down_proj|w13_weight|w2_weight", n) is not None,
        ),
        "flip_bit": (
            {F: LoaderFaults(flip_bit=r"\.v_proj\.|norm")},
            False,
            lambda c, n: c["rank"] == F and ("qkv_proj" in n or "norm" in n),
        ),
        # ranks 4 and 5 (pp 1, tp 0 and 1) narrow as each other: every TP-split param is the other's; norms and routers are whole
        "tp_as": (
            {4: LoaderFaults(tp_as=1), 5: LoaderFaults(tp_as=0)},
            False,
            lambda c, n: c["rank"] in (4, 5) and any(s in n for s in TP_SPLIT) and (moe_split or "experts" not in n),
        ),
    }


@pytest.mark.parametrize(("family", "ep"), [(f, 1) for f in CONFIGS] + [("mixtral", 4)], ids=[*CONFIGS, "mixtral-ep4"])
def test_each_loader_fault_is_caught_on_exactly_its_ranks_and_names(family: str, ep: int) -> None:
    cfg = CONFIGS[family]
    expected, engines, want = {}, {}, set()
    for fault, (faults, f32, hit) in _fault_cases(ep).items():
        over = {"layers": LAYERS, "dtype": torch.float32 if f32 else cfg.dtype}
        sd = _weights(family, **over)
        if f32 not in expected:
            expected[f32] = expected_frame(
                sd,
                family,
                tp=TP,
                pp=PP,
                ep=ep,
                heads=cfg.heads,
                kv_heads=cfg.kv_heads,
                vocab_padding=1,
                names=SIM_NAMES,
            )
        engines[fault] = engine = _engine(dataclasses.replace(cfg, **over), sd, TP, PP, ep=ep, faults=faults)
        want |= {(fault, c["rank"], n, "mismatch") for c, s in engine.values() for n in s.params if hit(c, n)}
        assert any(w[0] == fault for w in want), f"{fault}: the case must touch something"
    v = compare(_stack({f: expected[_fault_cases(ep)[f][1]] for f in engines}), _stack_engines(engines))
    bad = v[v["status"] != "match"]
    got = {(h, int(r) % 1000, n, s) for h, r, n, s in zip(bad["host"], bad["rank"], bad["name"], bad["status"])}
    assert got == want, (
        f"caught but not predicted: {sorted(got - want)[:5]}; predicted but not caught: {sorted(want - got)[:5]}"
    )


@pytest.mark.parametrize("fault", ["tp_as", "fused_from_rank0"])
def test_a_wrong_tp_shard_passes_the_reload_check_but_not_the_expected_shards(fault: str) -> None:
    """The headline: the loader writes the same wrong shard on reload, so snapshot == reload everywhere,
    while the rules (which know which shard each rank should hold) flag exactly the wrong ranks."""
    cfg = dataclasses.replace(CONFIGS["llama"], layers=LAYERS)
    sd = _weights("llama", layers=LAYERS)
    faults, _, hit = _fault_cases(1)[fault]
    engine = _engine(cfg, sd, TP, PP, faults=faults)
    snapshot = _actual(engine, "snapshot")
    for _, shard in engine.values():
        poison_(shard.params)
    reset = _actual(engine, "reset")
    for _, shard in engine.values():
        shard.load_weights(sd.items())  # the reload: the same (faulty) loader again
    endstate = classify(snapshot, reset, _actual(engine, "reload"))
    assert set(endstate["status"]) == {"match"} and len(endstate) == len(snapshot)

    v = compare(
        expected_frame(sd, "llama", tp=TP, pp=PP, heads=cfg.heads, kv_heads=cfg.kv_heads, vocab_padding=1), snapshot
    )
    assert _bad(v) == {(c["rank"], n, "mismatch") for c, s in engine.values() for n in s.params if hit(c, n)} != set()


# --- vocabulary padding and tied embeddings ------------------------------------------------


def _tiny(vocab: int = 250, **over) -> ModelConfig:
    return ModelConfig(
        **{"vocab": vocab, "hidden": 8, "layers": 2, "heads": 2, "kv_heads": 1, "intermediate": 8, **over}
    )


def _pieces(sd: dict, name: str, tp: int, pp: int = 1, **kw) -> dict[tuple[int, int], torch.Tensor]:
    """{(pp, tp): piece} of engine parameter ``name``."""
    out = {}
    for c, n, t in expected_shards(sd, "llama", tp=tp, pp=pp, heads=2, kv_heads=1, **kw):
        if n == name:
            out[(c["pp"], c["tp"])] = t
    return out


@settings(max_examples=25, deadline=None)
@given(vocab=st.integers(1, 300), tp=st.sampled_from([1, 2]), padding=st.sampled_from([1, 2, 3, 64, 128]))
def test_vocab_parallel_pieces_are_padded_with_zeros_and_reassemble(vocab: int, tp: int, padding: int) -> None:
    sd = build_state_dict(_tiny(vocab))
    if -(-vocab // padding) * padding % tp and padding != 1:  # vLLM's divide() asserts: it cannot start
        with pytest.raises(LayoutError, match=f"vLLM cannot start with tp={tp}"):
            _pieces(sd, "lm_head.weight", tp, vocab_padding=padding)
        return
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        pieces = _pieces(sd, name, tp, vocab_padding=padding)
        rows = {p.shape[0] for p in pieces.values()}
        assert len(pieces) == tp and len(rows) == 1  # every rank holds the same number of rows
        total = rows.pop() * tp
        whole = torch.cat([pieces[(0, t)] for t in range(tp)])
        assert torch.equal(whole[:vocab], sd[name]) and not whole[vocab:].any()
        # the least multiple of tp that is at least the least multiple of ``padding`` holding the vocabulary
        at_least = -(-vocab // padding) * padding
        assert total >= at_least and total % tp == 0 and total - tp < at_least
        if padding % tp == 0:  # vLLM's case: tp divides the padding, the padded vocab is a multiple of it
            assert total % padding == 0 and total - padding < vocab


def test_vocab_padding_matches_vllm_sizes() -> None:
    assert padded_vocab(32000, 64, 8) == 32000  # Llama 2: already a multiple of 64
    assert padded_vocab(32001, 64, 8) == 32064
    assert padded_vocab(151936, 64, 4) == 151936  # Qwen2
    assert padded_vocab(250, 1, 4) == 252  # the simulated engine: to a multiple of tp only
    sd = build_state_dict(_tiny(250))
    pieces = _pieces(sd, "model.embed_tokens.weight", 2)  # vocab_padding=64 by default: 256 rows, 128 per rank
    assert torch.equal(pieces[(0, 1)][:122], sd["model.embed_tokens.weight"][128:]) and not pieces[(0, 1)][122:].any()
    assert pieces[(0, 0)].shape == (128, 8)


@pytest.mark.parametrize("pp", [1, 2, 3])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_tied_embedding_is_held_by_the_first_and_last_stage_and_no_head(tp: int, pp: int) -> None:
    tied = build_state_dict(_tiny(tie_embeddings=True, layers=3))
    names = {(c["pp"], c["tp"], n): t for c, n, t in expected_shards(tied, "llama", tp=tp, pp=pp, heads=2, kv_heads=1)}
    assert not any(n == "lm_head.weight" for _, _, n in names)
    holders = {(p, t) for p, t, n in names if n == "model.embed_tokens.weight"}
    assert holders == {(p, t) for p in {0, pp - 1} for t in range(tp)}
    for t in range(tp):
        assert torch.equal(names[(0, t, "model.embed_tokens.weight")], names[(pp - 1, t, "model.embed_tokens.weight")])
    assert bind(tied, "llama").tied
    # a checkpoint that also saved the head: told it is tied, the head is ignored as vLLM ignores it
    untied = build_state_dict(_tiny(layers=3))
    b = bind(untied, "llama", tie_embeddings=True)
    assert b.tied and b.ignored == ("lm_head.weight",) and not any(p.name == "lm_head.weight" for p in b.params)
    last = _pieces(untied, "model.embed_tokens.weight", tp, pp, tie_embeddings=True)
    assert set(last) == holders
    with pytest.raises(LayoutError, match=r"lack 1 tensor\(s\): lm_head\.weight"):
        bind(tied, "llama", tie_embeddings=False)


def test_the_engine_dtype_and_a_checkpoint_on_disk(tmp_path) -> None:
    """float32 weights into a bfloat16 engine (vLLM copies into its params' dtype); a safetensors directory as input."""
    cfg = dataclasses.replace(CONFIGS["qwen2"], layers=2)
    sd32 = build_state_dict(dataclasses.replace(cfg, dtype=torch.float32))
    kw = {"tp": 2, "pp": 2, "heads": cfg.heads, "kv_heads": cfg.kv_heads, "vocab_padding": 1}
    actual = _actual(_engine(cfg, sd32, 2, 2))
    assert _bad(compare(expected_frame(sd32, "qwen2", dtype=torch.bfloat16, **kw), actual)) == set()
    assert _bad(compare(expected_frame(sd32, "qwen2", **kw), actual)) == {
        (r, n, "drift") for r, n in zip(actual["rank"], actual["name"])
    }
    sd = build_state_dict(cfg)
    save_checkpoint({**sd, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2)}, tmp_path / "ckpt")
    from_disk = expected_frame(tmp_path / "ckpt", "qwen2", **kw)
    assert _bad(compare(from_disk, _actual(_engine(cfg, sd, 2, 2)))) == set()


# --- the rules themselves ------------------------------------------------------------------


def test_families_and_detection() -> None:
    assert list(FAMILIES) == ["llama", "mistral", "qwen2", "mixtral", "sim-moe"]
    assert {r.kind for f in FAMILIES.values() for r in f.rules} == set(KINDS) - {"column"}  # column: see the next test
    for family, cfg in CONFIGS.items():
        names = list(build_state_dict(dataclasses.replace(cfg, layers=1)))
        assert detect_family(names) == ("llama" if family == "mistral" else family)  # Mistral's names are Llama's
    with pytest.raises(
        LayoutError, match=r"no known family(.|\n)*llama has no rule for 1 tensor\(s\): model\.vision\.weight"
    ):
        detect_family(["model.vision.weight"])
    b = bind(_weights("mixtral"), "mixtral")
    assert (b.layers, b.experts, b.tied) == (8, 4, False)
    w13 = next(p for p in b.params if p.name == "model.layers.7.block_sparse_moe.experts.routed_experts.w13_weight")
    assert w13.sources[3] == (
        "model.layers.7.block_sparse_moe.experts.3.w1.weight",
        "model.layers.7.block_sparse_moe.experts.3.w3.weight",
    )


def test_a_family_of_your_own() -> None:
    """Rules are data: a family that keeps gate and up apart (plain column-parallel) is a few lines."""
    mlp = "model.layers.{L}.mlp."
    split = (
        Rule(mlp + "gate_proj.weight", (mlp + "gate_proj.weight",), "column"),
        Rule(mlp + "up_proj.weight", (mlp + "up_proj.weight",), "column"),
    )
    mine = Family("unfused", tuple(r for r in LLAMA.rules if "gate_up" not in r.engine) + split)
    sd = build_state_dict(_tiny(layers=1))
    pieces = {
        (c["tp"], n): t
        for c, n, t in expected_shards(sd, mine, tp=2, heads=2, kv_heads=1)
        if n.endswith(("gate_proj.weight", "up_proj.weight"))
    }
    for t in range(2):
        assert torch.equal(
            pieces[(t, "model.layers.0.mlp.up_proj.weight")], sd["model.layers.0.mlp.up_proj.weight"][4 * t : 4 * t + 4]
        )
    assert len(pieces) == 4


def test_the_rules_never_import_the_simulated_engine() -> None:
    from pathlib import Path

    import wcviz.layouts

    for path in Path(wcviz.layouts.__file__).parent.glob("*.py"):
        assert not re.search(r"^\s*(from|import) wcviz\.sim", path.read_text(), re.MULTILINE), path


def test_pipeline_stages_and_expert_blocks_follow_vllm() -> None:
    assert [len(r) for r in stage_layers(10, 4)] == [2, 3, 3, 2]  # leftovers to the stages before the last
    assert [list(r) for r in stage_layers(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [len(r) for r in stage_layers(8, 5)] == [1, 2, 2, 2, 1]
    assert [list(expert_block(6, r, 4)) for r in range(4)] == [[0, 1], [2, 3], [4], [5]]


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 64), parts=st.integers(1, 16))
def test_stages_and_expert_blocks_partition_evenly(n: int, parts: int) -> None:
    for split in (stage_layers(n, parts), [expert_block(n, r, parts) for r in range(parts)]):
        assert [i for r in split for i in r] == list(range(n))
        assert max(map(len, split)) - min(map(len, split)) <= 1
    assert len(stage_layers(n, parts)[-1]) == n // parts  # the last stage (it also holds the head) never gets extra
    assert len(expert_block(n, 0, parts)) == -(-n // parts)  # the first EP ranks do


# --- bad input: errors name what is wrong ---------------------------------------------------

_KW = {"tp": 2, "heads": 8, "kv_heads": 2}


def _fail(sd: dict, family: str = "llama", **kw) -> str:
    with pytest.raises(LayoutError) as e:
        list(expected_shards(sd, family, **{**_KW, **kw}))
    return str(e.value)


def test_bad_input_errors_name_the_problem() -> None:
    sd = {
        n: t for n, t in _weights("llama").items() if int(re.sub(r"\D.*", "", n.removeprefix("model.layers.")) or 0) < 2
    }
    assert "known: llama, mistral, qwen2, mixtral, sim-moe" in _fail(sd, "gpt2")
    assert "has no rule for 1 tensor(s): model.layers.0.self_attn.bogus.weight" in _fail(
        {**sd, "model.layers.0.self_attn.bogus.weight": torch.zeros(1)}
    )
    assert "q_proj.bias" in _fail(_weights("llama"), "qwen2")  # Qwen2 requires them (Llama's are optional)
    no_k = {n: t for n, t in sd.items() if n != "model.layers.1.self_attn.k_proj.weight"}
    assert "model.layers.1.self_attn.k_proj.weight (for model.layers.1.self_attn.qkv_proj.weight)" in _fail(no_k)
    no_layer0 = {n: t for n, t in sd.items() if not n.startswith("model.layers.0.")}
    assert "lack 9 tensor(s): model.layers.0.self_attn.q_proj.weight" in _fail(no_layer0)
    assert "model.embed_tokens.weight" in _fail({n: t for n, t in sd.items() if "embed" not in n})
    assert "heads (8) do not divide by tp=3" in _fail(sd, tp=3)
    assert "tp=6 must divide kv_heads (4) or be a multiple of it" in _fail(sd, tp=6, heads=12, kv_heads=4)
    assert "check heads and kv_heads" in _fail(sd, kv_heads=4)
    assert "pp=3 exceeds the 2 layers" in _fail(sd, pp=3)
    assert "tp must be a positive int, got 0" in _fail(sd, tp=0)
    assert "no FusedMoE experts" in _fail(sd, ep=2)
    moe = _weights("mixtral")
    assert "ep must be 1 or tp*dp = 2" in _fail(moe, "mixtral", ep=4)
    assert "names='vllm 0.33'" in _fail(moe, "mixtral", names="vllm 0.33")
    odd = build_state_dict(dataclasses.replace(CONFIGS["llama"], layers=1, intermediate=36))
    assert "model.layers.0.mlp.gate_up_proj.weight (tp=8): dim 0 (36) does not divide by 8" in _fail(odd, tp=8)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("x.{L}.w", ("x.{L}.a",), "diagonal"), "unknown kind 'diagonal'"),
        (("x.{L}.qkv", ("x.{L}.q", "x.{L}.k"), "qkv"), "kind qkv cannot fuse 2 source"),
        (("x.{L}.e.{E}.w13", ("x.{L}.e.{E}.w1", "x.{L}.e.{E}.w3"), "moe_w13"), "stacks experts"),
        (("x.{L}.w", ("x.w",), "column"), "must carry the placeholders ['L']"),
        (("x.norm", ("x.norm",), "replicated"), "stage must be"),
        (("x.{L}.w", "x.{L}.w", "row"), "non-empty tuple"),
    ],
)
def test_malformed_rules_are_refused(args: tuple, match: str) -> None:
    with pytest.raises(LayoutError, match=re.escape(match)):
        Rule(*args)


def test_malformed_families_are_refused() -> None:
    with pytest.raises(LayoutError, match="more than one rule for lm_head.weight"):
        Family("twice", (*LLAMA.rules, LLAMA.rules[-1]))
    with pytest.raises(LayoutError, match="has no rule for lm_head.weight"):
        Family("headless", LLAMA.rules[:-1])


def test_a_stale_copy_of_a_tensor_beside_the_checkpoint_is_refused_not_taken_as_the_truth(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A leftover model.safetensors holding the old final norm, beside the new shard: the last file in sorted order
    won, so an engine serving the stale norm was a match."""
    import json

    from safetensors.torch import save_file

    from wcviz import CheckpointError
    from wcviz.sim.model import hf_config, step

    cfg = ModelConfig(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96)
    old = build_state_dict(cfg)
    save_file({k: v.contiguous() for k, v in step(old, 1).items()}, str(tmp_path / "model-00001-of-00001.safetensors"))
    save_file({"model.norm.weight": old["model.norm.weight"].contiguous()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(cfg)))
    with pytest.raises(CheckpointError, match="tensor 'model.norm.weight' is in both model-00001-of-00001.safetensors and model.safetensors"):
        expected_frame(tmp_path, "llama", tp=1, heads=4, kv_heads=2)


def test_a_rule_held_by_every_stage_is_expected_on_every_stage() -> None:
    """Rule(stage="every") was accepted, then dropped by bind(): an engine without that parameter matched."""
    from wcviz.layouts import Family, Rule

    rules = tuple(Rule(r.engine, r.sources, r.kind, stage="every") if r.engine == "model.norm.weight" else r for r in LLAMA.rules)
    fam = Family("llama-every-norm", rules)
    sd = build_state_dict(ModelConfig(vocab=256, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64))
    shards = expected_shards(sd, fam, tp=1, pp=2, heads=4, kv_heads=2)
    stages = sorted(coords["pp"] for coords, name, _ in shards if name == "model.norm.weight")
    assert stages == [0, 1]
    exp = expected_frame(sd, fam, tp=1, pp=2, heads=4, kv_heads=2, vocab_padding=1)
    act = expected_frame(sd, "llama", tp=1, pp=2, heads=4, kv_heads=2, vocab_padding=1)
    v = compare(exp, act[act["name"] != "model.norm.weight"])
    assert v.loc[v["name"] == "model.norm.weight", "status"].tolist() == ["missing", "missing"]
