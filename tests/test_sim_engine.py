"""The simulated cluster's model and vLLM-style engine ranks: layout, loader and loader faults."""

from __future__ import annotations

import dataclasses
import pickle
import re

import pytest
import torch

from wcviz.sim import (
    TINY,
    TINY_MOE,
    EngineLayout,
    EngineShard,
    LoaderFaults,
    ModelConfig,
    build_state_dict,
    parameter_shapes,
    pp_layers,
    reassemble,
    step,
)

TIED = dataclasses.replace(TINY, tie_embeddings=True, seed=3)
ONE_KV = dataclasses.replace(TINY, kv_heads=1, seed=4)  # multi-query: every tp > 1 replicates
QWEN2ISH = dataclasses.replace(TINY, qkv_bias=True, tie_embeddings=True, seed=5)
MIXTRAL = dataclasses.replace(TINY_MOE, moe_style="mixtral", seed=6)
CONFIGS = {"dense": TINY, "moe": TINY_MOE, "tied": TIED, "one_kv": ONE_KV, "qkv_bias": QWEN2ISH, "mixtral": MIXTRAL}


def _shards(cfg: ModelConfig, tp: int, pp: int, faulty: dict | None = None) -> list[EngineShard]:
    """All (pp, tp) shards of one engine; ``faulty`` maps (pp, tp) to that shard's LoaderFaults."""
    faulty = faulty or {}
    return [EngineShard(cfg, t, tp, p, pp, faulty.get((p, t), LoaderFaults())) for p in range(pp) for t in range(tp)]


def _load(shards: list[EngineShard], sd: dict) -> list[set[str]]:
    return [s.load_weights(sd.items()) for s in shards]


def _expected_shape(cfg: ModelConfig, name: str, tp: int) -> tuple[int, ...]:
    """What vLLM would hold on one TP rank, written from the brief's formulas."""
    hd, h = cfg.head_dim, cfg.hidden
    if name.endswith("qkv_proj.weight"):
        return ((cfg.heads // tp + 2 * max(1, cfg.kv_heads // tp)) * hd, h)
    if name.endswith("qkv_proj.bias"):
        return ((cfg.heads // tp + 2 * max(1, cfg.kv_heads // tp)) * hd,)
    if name.endswith("experts.w13_weight"):
        return (cfg.experts, 2 * cfg.intermediate // tp, h)
    if name.endswith("experts.w2_weight"):
        return (cfg.experts, h, cfg.intermediate // tp)
    if name.endswith("o_proj.weight"):
        return (h, cfg.heads // tp * hd)
    if name.endswith("gate_up_proj.weight"):
        return (2 * cfg.intermediate // tp, h)
    if name.endswith("down_proj.weight"):
        return (h, cfg.intermediate // tp)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return ((cfg.vocab + tp - 1) // tp, h)
    if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
        return (cfg.experts, h)
    assert name.endswith("norm.weight"), name
    return (h,)


def _bits(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of bits that differ between two same-dtype tensors."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    x = (a.contiguous().view(ints) ^ b.contiguous().view(ints)).to(torch.int64) & ((1 << (8 * a.element_size())) - 1)
    return sum(int(((x >> i) & 1).sum()) for i in range(8 * a.element_size()))


# --- the model -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("over", "field"),
    [({"heads": 3}, "kv_heads"), ({"hidden": 66}, "heads"), ({"vocab": 0}, "vocab"),
     ({"layers": -1}, "layers"), ({"experts": -2}, "experts"), ({"intermediate": 1.5}, "intermediate"),
     ({"moe_style": "deepseek"}, "moe_style")],
)
def test_config_errors_name_the_field(over: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(TINY, **over)


def test_build_is_deterministic_small_and_hf_named() -> None:
    a, b = build_state_dict(TINY), build_state_dict(TINY)
    assert list(a) == list(b) and all(torch.equal(a[n], b[n]) for n in a)
    other = build_state_dict(dataclasses.replace(TINY, seed=1))
    assert all(not torch.equal(a[n], other[n]) for n in a)
    for cfg in (TINY, TINY_MOE):
        sd = build_state_dict(cfg)
        assert sum(t.numel() * t.element_size() for t in sd.values()) < 400_000
        assert {n: tuple(t.shape) for n, t in sd.items()} == parameter_shapes(cfg)
        assert all(t.dtype == torch.bfloat16 for t in sd.values())
    dense, moe = build_state_dict(TINY), build_state_dict(TINY_MOE)
    assert dense["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert "model.layers.2.mlp.down_proj.weight" in dense and "lm_head.weight" in dense
    assert moe["model.layers.1.mlp.gate.weight"].shape == (4, 64)
    assert moe["model.layers.1.mlp.experts.3.up_proj.weight"].shape == (32, 64)
    assert not any(n.startswith("model.layers.0.mlp.") and "experts" not in n and n != "model.layers.0.mlp.gate.weight" for n in moe)
    assert "lm_head.weight" not in build_state_dict(TIED)
    biased, mixtral = build_state_dict(QWEN2ISH), build_state_dict(MIXTRAL)
    assert biased["model.layers.0.self_attn.k_proj.bias"].shape == (32,) and "lm_head.weight" not in biased
    assert mixtral["model.layers.2.block_sparse_moe.experts.3.w2.weight"].shape == (64, 32)
    assert mixtral["model.layers.2.block_sparse_moe.gate.weight"].shape == (4, 64)
    assert not any(".mlp." in n for n in mixtral)
    # the new fields leave the old configs' weights bit for bit as they were
    assert all(torch.equal(a[n], build_state_dict(dataclasses.replace(TINY, qkv_bias=False, moe_style="sim"))[n]) for n in a)


def test_step_changes_every_parameter_deterministically() -> None:
    sd = build_state_dict(TINY_MOE)
    s1, s2 = step(sd, 1), step(step(sd, 1), 2)
    for n in sd:
        assert s1[n].dtype == sd[n].dtype and s1[n].shape == sd[n].shape
        assert not torch.equal(s1[n], sd[n]) and not torch.equal(s2[n], s1[n]), n
        assert torch.equal(step(sd, 1)[n], s1[n])
        assert (s1[n].float() - sd[n].float()).abs().max() < 0.1  # a small update, not new weights
    assert any(not torch.equal(step(sd, 1)[n], step(sd, 2)[n]) for n in sd)


# --- the layout ------------------------------------------------------------------


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("pp", [1, 2])
def test_load_then_reassemble_is_exact(cfg_name: str, tp: int, pp: int) -> None:
    cfg = CONFIGS[cfg_name]
    sd = build_state_dict(cfg)
    shards = _shards(cfg, tp, pp)
    written = _load(shards, sd)
    full = reassemble(shards)
    assert list(full) == list(sd)
    assert all(torch.equal(full[n], sd[n]) for n in sd)
    for s, w in zip(shards, written):
        assert w == set(s.params), s
        for name, p in s.params.items():
            assert tuple(p.shape) == _expected_shape(cfg, name, tp), name
            padding = torch.zeros(p.shape, dtype=torch.bool)
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                padding[max(0, cfg.vocab - s.tp_rank * p.shape[0]) :] = True
            assert torch.equal(p == 0, padding), f"{s} {name}: zero where not padding, or padding not zero"
    # every replica of a kv head carries that head; a tied embedding is whole on both end stages
    by = {(s.pp_rank, s.tp_rank): s for s in shards}
    q, kv = cfg.heads // tp * cfg.head_dim, max(1, cfg.kv_heads // tp) * cfg.head_dim
    for s in shards:
        for i in s.layers:
            qkv = s.params[f"model.layers.{i}.self_attn.qkv_proj.weight"]
            head = s.tp_rank * cfg.kv_heads // tp if tp > cfg.kv_heads else s.tp_rank
            for j, part in enumerate(("k", "v")):
                full_kv = sd[f"model.layers.{i}.self_attn.{part}_proj.weight"]
                assert torch.equal(qkv[q + j * kv : q + (j + 1) * kv], full_kv[head * kv : (head + 1) * kv])
        for name, p in s.params.items():  # replicated params are whole on every rank
            if name.endswith(("norm.weight", "mlp.gate.weight", "moe.gate.weight")):
                assert torch.equal(p, sd[name]), (s, name)
    if cfg.tie_embeddings:
        for t in range(tp):
            assert torch.equal(by[(0, t)].params["model.embed_tokens.weight"], by[(pp - 1, t)].params["model.embed_tokens.weight"])
        assert all("lm_head.weight" not in s.params for s in shards)


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_pipeline_stages_own_contiguous_layers_and_the_ends(pp: int) -> None:
    want = {1: [[0, 1, 2]], 2: [[0, 1], [2]], 3: [[0], [1], [2]]}[pp]
    for p in range(pp):
        s = EngineShard(TINY, 0, 1, p, pp)
        layers = sorted({int(n.split(".")[2]) for n in s.params if n.startswith("model.layers.")})
        assert layers == want[p] == list(s.layers) == list(pp_layers(3, p, pp))
        assert ("model.embed_tokens.weight" in s.params) == (p == 0)
        assert ("model.norm.weight" in s.params) == ("lm_head.weight" in s.params) == (p == pp - 1)
    assert [len(pp_layers(10, p, 4)) for p in range(4)] == [2, 3, 3, 2]  # vLLM: leftovers go to the stages before the last
    assert [list(pp_layers(5, p, 2)) for p in range(2)] == [[0, 1, 2], [3, 4]]


def test_loader_ignores_other_stages_and_rejects_unknown_names() -> None:
    sd = build_state_dict(TINY)
    last = EngineShard(TINY, 1, 2, 1, 2)
    assert last.load_weights(sd.items()) == set(last.params)
    assert last.load_weights([("model.layers.0.self_attn.q_proj.weight", sd["model.layers.0.self_attn.q_proj.weight"])]) == set()
    with pytest.raises(KeyError, match="model.layers.2.self_attn.bogus"):
        last.load_weights([("model.layers.2.self_attn.bogus.weight", torch.zeros(1))])
    with pytest.raises(KeyError, match="model.layers.9"):
        last.load_weights([("model.layers.9.input_layernorm.weight", torch.zeros(64))])


@pytest.mark.parametrize(
    ("args", "field"),
    [((TINY, 0, 8, 0, 1), "heads"), ((TINY, 0, 3, 0, 1), "heads"), ((TINY, 2, 2, 0, 1), "tp_rank"),
     ((TINY, 0, 1, 0, 4), "layers"), ((dataclasses.replace(TINY, hidden=96, heads=12, kv_heads=6), 0, 4, 0, 1), "kv_heads"),
     ((TINY, 0, 64, 0, 1), "heads"), ((dataclasses.replace(TINY, intermediate=98), 0, 4, 0, 1), "intermediate")],
)
def test_impossible_layouts_are_refused(args: tuple, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineShard(*args)


@pytest.mark.parametrize(
    ("cfg", "kw", "match"),
    [(TINY_MOE, {"expert_parallel": True}, "moe_style='mixtral'"), (TINY, {"expert_parallel": True}, "experts > 0"),
     (MIXTRAL, {"dp_size": 8, "expert_parallel": True}, "tp * dp = 8 ranks exceeds ModelConfig.experts (4)"),
     (dataclasses.replace(MIXTRAL, intermediate=12), {"dp_size": 8}, "tp * dp = 8 must divide ModelConfig.intermediate (12)"),
     (MIXTRAL, {"dp_rank": 2, "dp_size": 2}, "dp_rank 2 outside"), (MIXTRAL, {"dp_size": 0}, "dp_size 0")],
)
def test_impossible_expert_layouts_are_refused(cfg: ModelConfig, kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        EngineShard(cfg, 0, 1, 0, 1, **kw)


def _moe_engine(cfg: ModelConfig, tp: int, pp: int, dp: int, ep: bool, faults: dict | None = None) -> list[EngineShard]:
    faults = faults or {}
    return [EngineShard(cfg, t, tp, p, pp, faults.get((d, p, t), LoaderFaults()), dp_rank=d, dp_size=dp, expert_parallel=ep)
            for d in range(dp) for p in range(pp) for t in range(tp)]


def test_expert_parallel_ranks_hold_whole_contiguous_experts() -> None:
    """tp 2 x dp 2 with expert parallelism over 6 experts: blocks 2, 2, 1, 1 (vLLM's linear placement), not sliced."""
    cfg = dataclasses.replace(MIXTRAL, experts=6)
    sd = build_state_dict(cfg)
    blocks = {0: [0, 1], 1: [2, 3], 2: [4], 3: [5]}
    shards = _moe_engine(cfg, 2, 2, 2, True)
    for s in shards:
        assert s.load_weights(sd.items()) == set(s.params)
        assert (s.ep_rank, s.ep_size, list(s.experts)) == (s.dp_rank * 2 + s.tp_rank, 4, blocks[s.dp_rank * 2 + s.tp_rank])
        for i in s.layers:
            m = f"model.layers.{i}.block_sparse_moe."
            w13, w2 = s.params[m + "experts.w13_weight"], s.params[m + "experts.w2_weight"]
            assert w13.shape == (len(s.experts), 64, 64) and w2.shape == (len(s.experts), 64, 32)
            for j, e in enumerate(s.experts):
                assert torch.equal(w13[j], torch.cat([sd[f"{m}experts.{e}.w1.weight"], sd[f"{m}experts.{e}.w3.weight"]]))
                assert torch.equal(w2[j], sd[f"{m}experts.{e}.w2.weight"])
            assert s.params[f"model.layers.{i}.self_attn.o_proj.weight"].shape == (64, 32)  # attention stays TP-split
    full = reassemble(shards)
    assert list(full) == list(sd) and all(torch.equal(full[n], sd[n]) for n in sd)
    # faults that narrow TP slices leave whole experts alone
    tp_split = ("embed_tokens", "qkv_proj", "o_proj", "lm_head")
    clean = {(s.dp_rank, s.pp_rank, s.tp_rank): s for s in shards}
    for faults, hit in ((LoaderFaults(fused_from_rank0=True), ("qkv_proj",)), (LoaderFaults(tp_as=0), tp_split)):
        faulty = EngineShard(cfg, 1, 2, 0, 2, faults, dp_rank=1, dp_size=2, expert_parallel=True)
        faulty.load_weights(sd.items())
        for name, p in faulty.params.items():
            assert torch.equal(p, clean[(1, 0, 1)].params[name]) != any(h in name for h in hit), (faults, name)


def test_fused_moe_without_expert_parallelism_is_sliced_over_tp_and_dp() -> None:
    """vLLM shards MoE layers across DP ranks too: tp 2 x dp 2 slices every expert in 4, attention in 2."""
    sd = build_state_dict(MIXTRAL)
    shards = _moe_engine(MIXTRAL, 2, 1, 2, False)
    _load(shards, sd)
    for s in shards:
        slot = s.dp_rank * 2 + s.tp_rank
        w13 = s.params["model.layers.0.block_sparse_moe.experts.w13_weight"]
        assert w13.shape == (4, 16, 64) and s.params["model.layers.0.self_attn.o_proj.weight"].shape == (64, 32)
        w1 = sd["model.layers.0.block_sparse_moe.experts.3.w1.weight"]
        assert torch.equal(w13[3, :8], w1[8 * slot : 8 * slot + 8])
    full = reassemble(shards)
    assert all(torch.equal(full[n], sd[n]) for n in sd)


def test_reassemble_needs_every_shard() -> None:
    shards = _shards(TINY, 2, 2)
    with pytest.raises(ValueError, match="one shard per"):
        reassemble(shards[:-1])
    with pytest.raises(ValueError, match="one shard per"):
        reassemble(shards + shards[:1])


def test_engine_layout_ranks_are_vllm_ordered() -> None:
    lay = EngineLayout(tp=2, pp=3, dp=2)
    assert lay.world_size == 12
    assert [lay.coords(r) for r in (0, 1, 2, 5, 6, 11)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 2, 1), (1, 0, 0), (1, 2, 1)]
    assert all(lay.rank(*lay.coords(r)) == r for r in range(12))
    with pytest.raises(ValueError, match="tp"):
        EngineLayout(tp=0, pp=1)
    with pytest.raises(ValueError, match="rank 12"):
        lay.coords(12)


@pytest.mark.parametrize(
    ("sizes", "field"),
    [({"tp": 1.5, "pp": 1}, "tp"), ({"tp": True, "pp": 1}, "tp"), ({"tp": 2, "pp": 1, "dp": 2.0}, "dp"),
     ({"tp": 1, "pp": "2"}, "pp"), ({"tp": 1, "pp": None}, "pp")],
)  # fmt: skip
def test_engine_layout_sizes_are_integers_named_when_not(sizes: dict, field: str) -> None:
    """EngineLayout(tp=1.5) had a world size of 1.5; tp=True passed as 1; the error came later, naming no field."""
    with pytest.raises(ValueError, match=rf"^EngineLayout\.{field} must be an integer >= 1, got {sizes[field]!r}$"):
        EngineLayout(**sizes)


def test_engine_layout_takes_any_integer_and_keeps_a_plain_int() -> None:
    import numpy as np

    lay = EngineLayout(tp=np.int64(2), pp=1)
    assert type(lay.tp) is int and lay.world_size == 2 and lay == EngineLayout(tp=2, pp=1)


# --- loader faults ---------------------------------------------------------------


def test_faults_are_picklable() -> None:
    f = LoaderFaults(skip="k_proj", fused_from_rank0=True, stale=True, cast="mlp", flip_bit="down")
    assert pickle.loads(pickle.dumps(f)) == f


@pytest.mark.parametrize("pattern", [r"layers\.\d+\.mlp\.down_proj", r"k_proj", r"lm_head"])
def test_skip_leaves_matching_params_stale_on_the_faulty_shard_only(pattern: str) -> None:
    """A refit with skip on shard (pp 1, tp 1): its matching params keep step-0 values, all else is step 1."""
    v0 = build_state_dict(TINY)
    v1 = step(v0, 1)
    old, new, faulty = _shards(TINY, 2, 2), _shards(TINY, 2, 2), _shards(TINY, 2, 2)
    _load(old, v0), _load(new, v0), _load(new, v1), _load(faulty, v0)
    faulty[3].faults = LoaderFaults(skip=pattern)  # the bug sits in the refit path only
    written = _load(faulty, v1)
    stale_names = set()
    for o, n, f, w in zip(old, new, faulty, written):
        for name, p in f.params.items():
            want = n.params[name].clone()
            if f is faulty[3]:
                if pattern == "k_proj" and "qkv_proj" in name:  # only the k rows of the fused param are old
                    rows = slice(f.q_rows, f.q_rows + f.kv_rows)
                    want[rows] = o.params[name][rows]
                    stale_names.add(name)
                elif pattern != "k_proj" and re.search(pattern, name):
                    want = o.params[name]
                    stale_names.add(name)
                    assert name not in w
            assert torch.equal(p, want), (f, name)
    assert stale_names and all(not torch.equal(new[3].params[x], faulty[3].params[x]) for x in stale_names)
    assert len(stale_names) == 1  # stage 1 holds layer 2 and the head only


@pytest.mark.parametrize("cfg", [TINY_MOE, MIXTRAL, QWEN2ISH], ids=["moe", "mixtral", "qkv_bias"])
def test_fused_from_rank0_copies_rank0_fused_slices_only(cfg: ModelConfig) -> None:
    sd = build_state_dict(cfg)
    for tp in (2, 4):  # tp 4 > kv_heads 2: kv heads replicated
        clean = _shards(cfg, tp, 1)
        faulty = _shards(cfg, tp, 1, {(0, t): LoaderFaults(fused_from_rank0=True) for t in range(tp)})
        _load(clean, sd), _load(faulty, sd)
        for c, f in zip(clean, faulty):
            for name, p in f.params.items():
                fused = name.endswith(("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight", "w13_weight"))
                want = clean[0].params[name] if fused else c.params[name]
                assert torch.equal(p, want), (f, name)
                if fused and f.tp_rank > 0:
                    assert not torch.equal(p, c.params[name]), (f, name)  # right shape, wrong values


def test_stale_loader_consumes_its_input_and_writes_nothing() -> None:
    sd = build_state_dict(TINY)
    shard = EngineShard(TINY, 0, 2, 0, 1)
    shard.load_weights(sd.items())
    before = {n: p.clone() for n, p in shard.params.items()}
    shard.faults = LoaderFaults(stale=True)
    sent = iter(step(sd, 1).items())
    assert shard.load_weights(sent) == set()
    assert next(sent, None) is None  # a receiver that stops early would hang a broadcast
    assert all(torch.equal(before[n], p) for n, p in shard.params.items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cast_rounds_matching_params_through_float16(dtype: torch.dtype) -> None:
    cfg = dataclasses.replace(TINY, dtype=dtype)
    sd = build_state_dict(cfg)
    clean, faulty = _shards(cfg, 2, 1), _shards(cfg, 2, 1, {(0, 1): LoaderFaults(cast=r"\.mlp\.")})
    _load(clean, sd), _load(faulty, sd)
    differs = 0
    for c, f in zip(clean, faulty):
        for name, p in f.params.items():
            lossy = f.tp_rank == 1 and ".mlp." in name
            want = c.params[name].to(torch.float16).to(dtype) if lossy else c.params[name]
            assert torch.equal(p, want), (f, name)
            differs += lossy and not torch.equal(p, c.params[name])
    # float32 loses mantissa nearly everywhere (gate_up and down of 3 layers); bfloat16 only in tiny values
    assert differs == 6 if dtype == torch.float32 else differs > 0


def test_flip_bit_flips_exactly_one_bit_per_matching_param() -> None:
    sd = build_state_dict(TINY)
    faults = LoaderFaults(flip_bit=r"down_proj|q_proj")
    clean, faulty = _shards(TINY, 4, 2), _shards(TINY, 4, 2, {k: faults for k in [(0, 0), (1, 3)]})
    _load(clean, sd), _load(faulty, sd)
    for c, f in zip(clean, faulty):
        hit = f.faults == faults
        for name, p in f.params.items():
            want = c.params[name]
            if hit and "qkv_proj" in name:  # q rows only: one bit; k and v rows untouched
                assert _bits(p[: f.q_rows], want[: f.q_rows]) == 1, name
                assert torch.equal(p[f.q_rows :], want[f.q_rows :]), name
            elif hit and "down_proj" in name:
                assert _bits(p, want) == 1, name
            else:
                assert torch.equal(p, want), (f, name)
