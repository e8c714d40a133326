"""Layout rules against facts read from vLLM 0.33's source, on tiny Hugging Face-style state dicts built here.

Each test states the vLLM fact it checks (the file and function are named in the
rule modules' docstrings): FusedMoE names per version, Llama's optional biases,
how a tied head is listed, expert-parallel ranks beyond the experts, FlashInfer
CUTLASS's swapped w13, and the engines' own digests in :func:`expected_frame`.
"""

from __future__ import annotations

import hashlib
import re

import pytest
import torch

from wcviz.digest import digest_many
from wcviz.layouts import (
    ENGINE,
    FAMILIES,
    MIXTRAL,
    NAMES,
    TIED_NAMES,
    W13_ORDERS,
    Family,
    LayoutError,
    Rule,
    bind,
    detect_family,
    expected_frame,
    expected_shards,
)

H, HEADS, KV, HD, INTER, VOCAB = 16, 4, 2, 4, 8, 100  # hidden 16 = 4 heads x 4; tp 4 replicates the 2 kv heads
_M = "model.layers.{L}.block_sparse_moe."


def _rand(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=g)


def _llama(
    layers: int = 2,
    *,
    attention_bias: bool = False,
    qkv_bias: bool = False,
    mlp_bias: bool = False,
    tied: bool = False,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A tiny HF Llama state dict. Each q/k/v and gate/up bias is its weight's first column, so that a bias
    piece split like its weight is that weight piece's first column."""
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": _rand(g, VOCAB, H)}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = _rand(g, H)
        for proj, rows in (("q", HEADS * HD), ("k", KV * HD), ("v", KV * HD)):
            sd[f"{p}self_attn.{proj}_proj.weight"] = w = _rand(g, rows, H)
            if attention_bias or qkv_bias:
                sd[f"{p}self_attn.{proj}_proj.bias"] = w[:, 0].clone()
        sd[p + "self_attn.o_proj.weight"] = _rand(g, H, HEADS * HD)
        if attention_bias:
            sd[p + "self_attn.o_proj.bias"] = _rand(g, H)
        sd[p + "post_attention_layernorm.weight"] = _rand(g, H)
        for proj in ("gate", "up"):
            sd[f"{p}mlp.{proj}_proj.weight"] = w = _rand(g, INTER, H)
            if mlp_bias:
                sd[f"{p}mlp.{proj}_proj.bias"] = w[:, 0].clone()
        sd[p + "mlp.down_proj.weight"] = _rand(g, H, INTER)
        if mlp_bias:
            sd[p + "mlp.down_proj.bias"] = _rand(g, H)
    sd["model.norm.weight"] = _rand(g, H)
    if not tied:
        sd["lm_head.weight"] = _rand(g, VOCAB, H)
    return sd


def _mixtral(experts: int = 4, layers: int = 2, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A tiny HF Mixtral state dict: Llama's attention, per-expert w1/w2/w3 under block_sparse_moe."""
    sd = {n: t for n, t in _llama(layers, seed=1).items() if ".mlp." not in n}
    g = torch.Generator().manual_seed(2)
    for i in range(layers):
        m = _M.format(L=i)
        sd[m + "gate.weight"] = _rand(g, experts, H)
        for e in range(experts):
            sd[f"{m}experts.{e}.w1.weight"] = _rand(g, INTER, H)
            sd[f"{m}experts.{e}.w2.weight"] = _rand(g, H, INTER)
            sd[f"{m}experts.{e}.w3.weight"] = _rand(g, INTER, H)
    return {n: t.to(dtype) for n, t in sd.items()}


def _shards(sd: dict, family: str, tp: int, **kw) -> dict[tuple[int, str], torch.Tensor]:
    """{(rank, name): tensor} of every rank."""
    return {(c["rank"], n): t for c, n, t in expected_shards(sd, family, tp=tp, heads=HEADS, kv_heads=KV, **kw)}


# --- 1. FusedMoE names by vLLM version ---------------------------------------------------------


def test_every_family_names_the_engine_its_rules_describe() -> None:
    assert ENGINE == "vllm 0.33.0"
    assert {f.name: f.engine for f in FAMILIES.values()} == {
        "llama": ENGINE,
        "mistral": ENGINE,
        "qwen2": ENGINE,
        "mixtral": ENGINE,
        "sim-moe": "wcviz.sim (moe_style='sim')",
    }
    assert set(NAMES) == {"vllm>=0.25", "vllm<0.25"}


def test_mixtral_names_follow_the_moerunner_refactor_and_the_old_names_are_one_option_away() -> None:
    sd = _mixtral()
    new = _shards(sd, "mixtral", tp=2)
    old = _shards(sd, "mixtral", tp=2, names="vllm<0.25")
    assert _shards(sd, "mixtral", tp=2, names="vllm>=0.25").keys() == new.keys()  # the default
    moe_new = {n for _, n in new if "experts" in n}
    assert moe_new == {
        f"model.layers.{i}.block_sparse_moe.experts.routed_experts.{w}"
        for i in range(2)
        for w in ("w13_weight", "w2_weight")
    }
    # the same tensors under the names vLLM gave them before; every other name unchanged
    rename = {n: n.replace(".experts.routed_experts.", ".experts.") for _, n in new}
    assert {(r, rename[n]) for r, n in new} == set(old)
    for (r, n), t in new.items():
        assert torch.equal(old[(r, rename[n])], t)
    assert len(moe_new) == 4 and not any("routed_experts" in n for _, n in old)
    # bind speaks the rules' (vLLM 0.33) names
    assert any(p.name.endswith("experts.routed_experts.w2_weight") for p in bind(sd, "mixtral").params)
    frame = expected_frame(sd, "mixtral", tp=2, heads=HEADS, kv_heads=KV, names="vllm<0.25")
    assert "model.layers.1.block_sparse_moe.experts.w13_weight" in set(frame["name"])


def test_sim_moe_names_never_change() -> None:
    from wcviz.sim import TINY_MOE, build_state_dict

    sd = build_state_dict(TINY_MOE)
    kw = {"tp": 2, "heads": TINY_MOE.heads, "kv_heads": TINY_MOE.kv_heads}
    names = [[n for _, n, _ in expected_shards(sd, "sim-moe", names=v, **kw)] for v in NAMES]
    assert names[0] == names[1] and "model.layers.0.mlp.experts.3.gate_up_proj.weight" in names[0]
    assert FAMILIES["sim-moe"].legacy_names == ()


def test_unknown_names_and_bad_legacy_names_are_refused() -> None:
    with pytest.raises(
        LayoutError, match=re.escape("names='vllm-0.20' is not known; choose one of: vllm>=0.25, vllm<0.25")
    ):
        list(expected_shards(_mixtral(), "mixtral", tp=1, heads=HEADS, kv_heads=KV, names="vllm-0.20"))
    with pytest.raises(LayoutError, match="names="):
        expected_frame(_llama(), "llama", tp=1, heads=HEADS, kv_heads=KV, names="0.33")
    w13 = _M + "experts.routed_experts.w13_weight"
    with pytest.raises(LayoutError, match="must carry the placeholders"):
        Family("bad", MIXTRAL.rules, legacy_names=((w13, "experts.w13_weight"),))
    with pytest.raises(LayoutError, match="two parameters one name"):
        Family("bad", MIXTRAL.rules, legacy_names=((w13, _M + "gate.weight"),))
    with pytest.raises(LayoutError, match="has no rule for x.{L}.w"):
        Family("bad", MIXTRAL.rules, legacy_names=(("x.{L}.w", "y.{L}.w"),))


# --- 2. Llama's optional biases ------------------------------------------------------------------


def test_llama_biases_split_like_their_weights_and_row_parallel_biases_stay_whole() -> None:
    sd = _llama(attention_bias=True, mlp_bias=True)
    tp = 4  # 4 q heads, 1 per rank; 2 kv heads, each replicated over 2 ranks
    got = _shards(sd, "llama", tp=tp)
    for r in range(tp):
        for i in range(2):
            p = f"model.layers.{i}."
            qkv_b, qkv_w = got[(r, p + "self_attn.qkv_proj.bias")], got[(r, p + "self_attn.qkv_proj.weight")]
            assert qkv_b.shape == (HD + 2 * HD,) and torch.equal(qkv_b, qkv_w[:, 0])  # split exactly like the weight
            kv = r // 2  # by hand: rank r holds q head r and kv head r // 2
            assert torch.equal(
                qkv_b,
                torch.cat(
                    [
                        sd[p + "self_attn.q_proj.bias"][r * HD : (r + 1) * HD],
                        sd[p + "self_attn.k_proj.bias"][kv * HD : (kv + 1) * HD],
                        sd[p + "self_attn.v_proj.bias"][kv * HD : (kv + 1) * HD],
                    ]
                ),
            )
            gate_up_b = got[(r, p + "mlp.gate_up_proj.bias")]
            assert torch.equal(gate_up_b, got[(r, p + "mlp.gate_up_proj.weight")][:, 0])
            n = INTER // tp
            assert torch.equal(
                gate_up_b,
                torch.cat(
                    [sd[p + "mlp.gate_proj.bias"][r * n : (r + 1) * n], sd[p + "mlp.up_proj.bias"][r * n : (r + 1) * n]]
                ),
            )
            # RowParallelLinear: the full bias on every rank
            for whole in ("self_attn.o_proj.bias", "mlp.down_proj.bias"):
                assert torch.equal(got[(r, p + whole)], sd[p + whole])
    plain = {n for _, n in _shards(_llama(), "llama", tp=2)}
    assert not any(n.endswith(".bias") for n in plain)
    # each bias rule stands alone: attention biases without MLP ones, MLP ones without attention ones
    names = {n for _, n in _shards(_llama(mlp_bias=True), "llama", tp=2)}
    assert {n.split(".", 3)[3] for n in names if n.endswith(".bias")} == {"mlp.gate_up_proj.bias", "mlp.down_proj.bias"}


def test_bias_parameters_sit_on_their_layers_stage() -> None:
    sd = _llama(layers=3, attention_bias=True)
    held = {(c["pp"], n) for c, n, _ in expected_shards(sd, "llama", tp=1, pp=2, heads=HEADS, kv_heads=KV)}
    assert (0, "model.layers.1.self_attn.o_proj.bias") in held and (1, "model.layers.2.self_attn.o_proj.bias") in held
    assert (1, "model.layers.1.self_attn.o_proj.bias") not in held


def test_a_bias_in_some_layers_only_is_an_error_naming_the_missing_tensors() -> None:
    sd = _llama(layers=2, attention_bias=True)
    del sd["model.layers.1.self_attn.o_proj.bias"]
    with pytest.raises(
        LayoutError, match=re.escape("model.layers.1.self_attn.o_proj.bias (for model.layers.1.self_attn.o_proj.bias)")
    ):
        bind(sd, "llama")
    q_only = {n: t for n, t in _llama(qkv_bias=True).items() if not re.search(r"[kv]_proj\.bias", n)}
    with pytest.raises(LayoutError, match=r"lack 4 tensor\(s\): model\.layers\.0\.self_attn\.k_proj\.bias"):
        bind(q_only, "llama")


def test_detection_tells_qwen2_from_llama_with_biases() -> None:
    qwen2 = _llama(qkv_bias=True, tied=True)  # q/k/v biases, no o_proj bias: Qwen2 (it fits Llama's optional rules too)
    assert bind(qwen2, "llama") and detect_family(qwen2) == "qwen2"
    assert detect_family(_llama(attention_bias=True)) == "llama"  # an o_proj bias: Qwen2 has no rule for it
    assert detect_family(_llama(attention_bias=True, mlp_bias=True)) == "llama"
    assert detect_family(_llama(mlp_bias=True)) == "llama"
    assert detect_family(_llama()) == "llama"  # Mistral has the same names: ties go to FAMILIES order
    assert detect_family(_mixtral()) == "mixtral"


# --- 3. a tied head, listed once or under both names ---------------------------------------------


def _module(named: list[tuple[str, torch.Tensor]], tie: tuple[str, str]) -> torch.nn.Module:
    """A module tree holding ``named`` as parameters, the second name of ``tie`` sharing the first's (as vLLM ties)."""
    root = torch.nn.Module()
    params: dict[str, torch.nn.Parameter] = {}
    for name in [n for n, _ in named] + [tie[1]]:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        if name == tie[1]:
            mod.register_parameter(leaf, params[tie[0]])  # lm_head.weight = embed_tokens.weight
        else:
            params[name] = torch.nn.Parameter(dict(named)[name], requires_grad=False)
            mod.register_parameter(leaf, params[name])
    return root


@pytest.mark.parametrize("pp", [1, 2])
def test_a_tied_head_is_listed_once_by_default_and_under_both_names_on_request(pp: int) -> None:
    sd = _llama(layers=2, tied=True)
    kw = {"tp": 2, "pp": pp, "heads": HEADS, "kv_heads": KV}
    once = [(c["pp"], c["tp"], n, t) for c, n, t in expected_shards(sd, "llama", **kw)]
    both = [(c["pp"], c["tp"], n, t) for c, n, t in expected_shards(sd, "llama", tied_names="both", **kw)]
    explicit = [(c["pp"], c["tp"], n) for c, n, _ in expected_shards(sd, "llama", tied_names="once", **kw)]
    assert [x[:3] for x in once] == explicit  # "once" is the default
    assert not any(n == "lm_head.weight" for _, _, n, _ in once)
    heads = [(p, t, x) for p, t, n, x in both if n == "lm_head.weight"]
    assert {(p, t) for p, t, _ in heads} == {(pp - 1, 0), (pp - 1, 1)}  # on the stage that holds the head only
    embed = {(p, t): x for p, t, n, x in once if n == "model.embed_tokens.weight"}
    assert {(p, t) for p, t in embed} == {(s, t) for s in {0, pp - 1} for t in range(2)}
    for p, t, x in heads:
        assert torch.equal(x, embed[(p, t)])
    assert [x[:3] for x in both if x[2] != "lm_head.weight"] == [x[:3] for x in once]
    frame = expected_frame(sd, "llama", tied_names="both", **kw)
    last = frame[frame["pp"] == pp - 1].set_index(["tp", "name"])["digest"]
    assert all(last[(t, "lm_head.weight")] == last[(t, "model.embed_tokens.weight")] for t in range(2))
    # an untied model has a head of its own either way
    untied = _llama(layers=2)
    assert [n for _, n, _ in expected_shards(untied, "llama", tied_names="both", **kw)] == [
        n for _, n, _ in expected_shards(untied, "llama", **kw)
    ]


def test_the_two_listings_are_what_named_parameters_gives_with_and_without_duplicates() -> None:
    """vLLM's /weight_checker walks named_parameters(); wcviz's worker extension, remove_duplicate=False."""
    sd = _llama(layers=1, tied=True)
    kw = {"tp": 1, "heads": HEADS, "kv_heads": KV}
    once = [(n, t) for _, n, t in expected_shards(sd, "llama", **kw)]
    model = _module(once, ("model.embed_tokens.weight", "lm_head.weight"))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in once]
    both = [n for _, n, _ in expected_shards(sd, "llama", tied_names="both", **kw)]
    assert sorted(n for n, _ in model.named_parameters(remove_duplicate=False)) == sorted(both)
    assert set(TIED_NAMES) == {"once", "both"}
    with pytest.raises(LayoutError, match=re.escape("tied_names='twice' is not known; choose one of: once, both")):
        list(expected_shards(sd, "llama", tied_names="twice", **kw))


# --- 4. more EP ranks than experts ---------------------------------------------------------------


def test_ep_ranks_beyond_the_experts_hold_empty_expert_tensors() -> None:
    sd = _mixtral(experts=2, layers=1)
    got = _shards(sd, "mixtral", tp=4, ep=4)
    w13, w2 = _M.format(L=0) + "experts.routed_experts.w13_weight", _M.format(L=0) + "experts.routed_experts.w2_weight"
    for r in (0, 1):  # linear placement: 2 // 4 = 0 each, the first 2 % 4 ranks one more
        assert got[(r, w13)].shape == (1, 2 * INTER, H)
        e = _M.format(L=0) + f"experts.{r}."
        assert torch.equal(got[(r, w13)][0], torch.cat([sd[e + "w1.weight"], sd[e + "w3.weight"]]))
        assert torch.equal(got[(r, w2)][0], sd[e + "w2.weight"])
    for r in (2, 3):
        assert got[(r, w13)].shape == (0, 2 * INTER, H) and got[(r, w2)].shape == (0, H, INTER)
        assert got[(r, w13)].dtype == got[(r, w2)].dtype == torch.bfloat16
    half = _shards(sd, "mixtral", tp=4, ep=4, dtype=torch.float16)
    assert half[(3, w2)].dtype == torch.float16 and half[(3, w2)].shape == (0, H, INTER)
    # with DP: EP spans tp * dp ranks, the second replica's ranks hold none
    dp = {
        (c["dp"], c["tp"], n): t
        for c, n, t in expected_shards(sd, "mixtral", tp=2, dp=2, ep=4, heads=HEADS, kv_heads=KV)
    }
    assert [dp[(d, t, w2)].shape[0] for d in range(2) for t in range(2)] == [1, 1, 0, 0]
    frame = expected_frame(sd, "mixtral", tp=4, ep=4, heads=HEADS, kv_heads=KV, algo="vllm-sha256")
    empty = frame[(frame["name"] == w13) & (frame["rank"] == 3)].iloc[0]
    assert (empty["shape"], int(empty["nbytes"])) == (f"[0, {2 * INTER}, {H}]", 0)
    assert empty["digest"] == hashlib.sha256(b"").hexdigest()
    default_algo = expected_frame(sd, "mixtral", tp=4, ep=4, heads=HEADS, kv_heads=KV)
    assert len(default_algo) == len(frame)


# --- 5. FlashInfer CUTLASS's [w3 ; w1] ------------------------------------------------------------


def _swap_w13_to_w31(x: torch.Tensor) -> torch.Tensor:
    """vLLM's ``quantization/utils/flashinfer_utils.py::swap_w13_to_w31``, as the FlashInfer CUTLASS backend applies it."""
    return x.reshape(-1, 2, x.shape[-2] // 2, x.shape[-1]).flip(dims=[1]).reshape(x.shape)


@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (2, 2)])
def test_the_flashinfer_cutlass_w13_order_swaps_each_experts_halves(tp: int, ep: int) -> None:
    sd = _mixtral(experts=4, layers=1)
    assert set(W13_ORDERS) == {"w1w3", "w3w1"}
    plain = _shards(sd, "mixtral", tp=tp, ep=ep)
    assert _shards(sd, "mixtral", tp=tp, ep=ep, moe_w13_order="w1w3").keys() == plain.keys()
    swapped = _shards(sd, "mixtral", tp=tp, ep=ep, moe_w13_order="w3w1")
    w13 = _M.format(L=0) + "experts.routed_experts.w13_weight"
    for r in range(tp):
        a, b = plain[(r, w13)], swapped[(r, w13)]
        assert a.shape == b.shape and not torch.equal(a, b)
        assert torch.equal(b, _swap_w13_to_w31(a))
        rows = INTER // (tp if ep == 1 else 1)
        experts = range(4) if ep == 1 else range(2 * r, 2 * r + 2)
        for k, e in enumerate(experts):  # by hand: each local expert is [its w3 part ; its w1 part]
            cut = slice(r * rows, (r + 1) * rows) if ep == 1 else slice(None)
            x = _M.format(L=0) + f"experts.{e}."
            assert torch.equal(b[k], torch.cat([sd[x + "w3.weight"][cut], sd[x + "w1.weight"][cut]]))
    assert all(torch.equal(swapped[k], t) for k, t in plain.items() if k[1] != w13)  # nothing else moves
    with pytest.raises(LayoutError, match=re.escape("moe_w13_order='w13' is not known; choose one of: w1w3, w3w1")):
        list(expected_shards(sd, "mixtral", tp=tp, heads=HEADS, kv_heads=KV, moe_w13_order="w13"))


# --- 6. the engines' own digests ---------------------------------------------------------------------


def test_expected_frame_digests_with_the_engines_algorithms() -> None:
    sd = _mixtral(experts=2, layers=1)
    kw = {"tp": 2, "heads": HEADS, "kv_heads": KV}
    shards = {(c["rank"], n): t for c, n, t in expected_shards(sd, "mixtral", **kw)}
    vllm = expected_frame(sd, "mixtral", algo="vllm-sha256", **kw)
    assert set(vllm["algo"]) == {"vllm-sha256"} and len(vllm) == len(shards)
    for r, n, d in zip(vllm["rank"], vllm["name"], vllm["digest"]):
        t = shards[(int(r), n)]
        assert d == hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()  # vLLM's checker
    cpu = expected_frame(sd, "mixtral", algo="sglang-cpu", **kw)
    for r, n, d in zip(cpu["rank"], cpu["name"], cpu["digest"]):
        raw = shards[(int(r), n)].contiguous().view(-1).view(torch.uint8).numpy()
        assert d == f"{int.from_bytes(hashlib.sha256(raw).digest()[:8], 'big'):016x}"
    gpu = expected_frame(sd, "mixtral", algo="sglang-gpu", **kw)
    for rank in (0, 1):
        rows = gpu[gpu["rank"] == rank]
        want = digest_many({n: shards[(rank, n)] for n in rows["name"]}, algo="sglang-gpu")
        assert dict(zip(rows["name"], rows["digest"])) == {n: str(d) for n, d in want.items()}
        assert all(re.fullmatch(r"[0-9a-f]{16}", d) for d in rows["digest"])


def test_a_bias_rule_is_optional_only_as_a_whole() -> None:
    """Rule.optional as Llama's bias rules use it: declared on the rule, not per layer."""
    rules = {r.engine: r for r in FAMILIES["llama"].rules}
    for name in ("qkv_proj.bias", "o_proj.bias", "gate_up_proj.bias", "down_proj.bias"):
        rule = next(r for e, r in rules.items() if e.endswith(name))
        assert rule.optional and isinstance(rule, Rule)
    assert not next(r for r in FAMILIES["qwen2"].rules if r.engine.endswith("qkv_proj.bias")).optional
