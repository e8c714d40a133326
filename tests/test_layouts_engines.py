"""Layout rules against the engines' own loaders, ported here line by line: vLLM 0.33.0 and SGLang 0.5.23.

The reference functions below are a few lines each of the engines' sources (the wheels, unzipped),
cited by file:line; every expectation comes from them, never from :mod:`wcviz.layouts`. End to end,
:func:`wcviz.live.verify_engine` checks a simulated server whose ranks hold the reference's tensors
(the sim only answers over HTTP as the engine does), so a wrong default on the engine's path shows as
the false ``missing``/``unexpected`` rows a user would see.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from wcviz.layouts import LayoutError, expected_shards, stage_layers
from wcviz.live import LiveReport, verify_engine
from wcviz.sim import EngineShard, SimSglang, SimVllm, reassemble
from wcviz.sim.model import ModelConfig, build_state_dict, save_checkpoint

LLAMA_CFG = ModelConfig(vocab=250, hidden=64, layers=5, heads=4, kv_heads=2, intermediate=32, seed=11)
MIXTRAL_CFG = ModelConfig(
    vocab=250, hidden=64, layers=3, heads=4, kv_heads=2, intermediate=32, experts=4, moe_style="mixtral", seed=12
)
QWEN2_CFG = ModelConfig(vocab=1000, hidden=96, layers=2, heads=12, kv_heads=2, intermediate=192, qkv_bias=True, seed=13)


# --- the engines, ported ---------------------------------------------------------------------------------


def _divide(a: int, b: int) -> int:  # vllm/distributed/utils.py divide(): ensure_divisibility asserts
    assert a % b == 0, f"{a} is not divisible by {b}"
    return a // b


def _vllm_pp_indices(layers: int, rank: int, size: int) -> tuple[int, int]:
    """vllm/distributed/utils.py:198-241 get_pp_indices (no VLLM_PP_LAYER_PARTITION)."""
    parts = [layers // size] * size
    if rem := layers % size:
        for i in range(2, rem + 2):
            parts[-i] += 1
    start = sum(parts[:rank])
    return start, start + parts[rank]


def _sglang_pp_indices(layers: int, rank: int, size: int) -> tuple[int, int]:
    """sglang/srt/distributed/utils.py:110-150 get_pp_indices (no SGLANG_PP_LAYER_PARTITION)."""
    base, rem = layers // size, layers % size
    if rank >= size - rem:
        start = rank * (base + 1) - (size - rem)
        return start, start + base + 1
    return rank * base, rank * base + base


def _pad(v: int, pad: int) -> int:  # vocab_parallel_embedding.py pad_vocab_size (both engines)
    return ((v + pad - 1) // pad) * pad


def _vocab(full: torch.Tensor, tp_rank: int, tp: int, engine: str, padding: int = 64) -> torch.Tensor:
    """VocabParallelEmbedding.__init__ + weight_loader (vLLM vocab_parallel_embedding.py:286-304, 518-520)."""
    org = full.shape[0]
    if engine == "sglang" and _pad(org, padding) % tp != 0:  # sglang vocab_parallel_embedding.py:273-274
        padding *= tp
    padded = _pad(_pad(org, padding), padding)
    per = _divide(padded, tp)  # vLLM :304 divide(num_embeddings_padded, tp_size)
    start, end = min(tp_rank * per, org), min((tp_rank + 1) * per, org)
    out = torch.full((per, *full.shape[1:]), float("nan"), dtype=full.dtype)
    out[: end - start] = full[start:end]
    out[end - start :] = 0
    return out


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv: int, r: int, tp: int) -> torch.Tensor:
    """QKVParallelLinear (vLLM linear.py:1063-1077, weight_loader 1281-1323; SGLang's is the same)."""
    hs = q.shape[0] // heads
    nh = _divide(heads, tp)
    nkv, rep = (1, _divide(tp, kv)) if tp >= kv else (_divide(kv, tp), 1)
    return torch.cat([q.narrow(0, r * nh * hs, nh * hs), *(w.narrow(0, (r // rep) * nkv * hs, nkv * hs) for w in (k, v))])


def _merged(srcs: list[torch.Tensor], r: int, tp: int) -> torch.Tensor:  # MergedColumnParallelLinear, linear.py:835-869
    return torch.cat([s.narrow(0, r * _divide(s.shape[0], tp), s.shape[0] // tp) for s in srcs])


def _row(w: torch.Tensor, r: int, tp: int) -> torch.Tensor:  # RowParallelLinear, linear.py:1772-1788: a bias whole
    return w.clone() if w.ndim == 1 else w.narrow(1, r * _divide(w.shape[1], tp), w.shape[1] // tp).clone()


def _vllm_moe(w1s: list, w2s: list, w3s: list, slot: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM FusedMoE without EP (fused_moe/config.py:1106-1245: sliced over tp * dp; routed_experts.py:529-610)."""
    per = _divide(w1s[0].shape[0], group)
    w13 = torch.stack([torch.cat([w.narrow(0, per * slot, per) for w in (w1, w3)]) for w1, w3 in zip(w1s, w3s)])
    return w13, torch.stack([w.narrow(1, per * slot, per) for w in w2s])


def _sglang_moe(w1s: list, w2s: list, w3s: list, tp_rank: int, tp: int, ep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's FusedMoE (fused_moe_triton/layer.py) with the default Triton runner and no moe_dp."""
    moe_tp = tp // ep  # layer.py:390-392 moe_ep_size, moe_tp_size; within one DP replica's TP group
    ep_rank, moe_tp_rank = tp_rank // moe_tp, tp_rank % moe_tp  # runtime_context.py:128-133 (moe_dp_size 1)
    local = _divide(len(w1s), ep)  # layer.py:414-415 (asserts)
    first = ep_rank * local  # layer.py:1153-1161 _map_global_expert_id_to_local_expert_id
    ipp = _divide(w1s[0].shape[0], moe_tp)  # layer.py:428 intermediate_size_per_partition
    w13 = torch.full((local, 2 * ipp, w1s[0].shape[1]), float("nan"), dtype=w1s[0].dtype)
    w2 = torch.full((local, w2s[0].shape[0], ipp), float("nan"), dtype=w2s[0].dtype)
    for li, e in enumerate(range(first, first + local)):
        for sid, w in (("w1", w1s[e]), ("w3", w3s[e])):  # _load_w13 :788-879: w1 in the first half, w3 the second
            size = w.shape[0] // moe_tp
            w13[li].narrow(0, 0 if sid == "w1" else ipp, ipp).copy_(w.narrow(0, size * moe_tp_rank, size))
        size = w2s[e].shape[1] // moe_tp  # _load_w2 :881-960: narrowed along dim 1
        w2[li].copy_(w2s[e].narrow(1, size * moe_tp_rank, size))
    return w13, w2


def engine_rank(
    sd: dict, family: str, engine: str, *, tp: int, pp: int = 1, dp: int = 1, ep: int = 1, tp_rank: int = 0,
    pp_rank: int = 0, dp_rank: int = 0, heads: int, kv: int, padding: int = 64,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """{name: tensor} as the engine's ``named_parameters()`` on one rank (bf16 checkpoints, dtype as given)."""
    layers = 1 + max(int(m.group(1)) for n in sd if (m := re.match(r"model\.layers\.(\d+)\.", n)))
    split = _vllm_pp_indices if engine == "vllm" else _sglang_pp_indices
    start, end = split(layers, pp_rank, pp)
    first, last = pp_rank == 0, pp_rank == pp - 1
    tied, mixtral = "lm_head.weight" not in sd, family == "mixtral"
    out = {}
    if engine == "vllm":  # llama.py:377-388 (first, or tied and last); mixtral.py:316 every stage
        embed, norm, head = first or mixtral or (tied and last), last or mixtral, (last or mixtral) and not tied
    else:  # llama.py:431-439, mixtral.py:289-296, qwen2.py:369-383 embedding first; norm last (llama.py:459-462)
        # the head: llama.py:570-578 and mixtral.py:355 build it on every stage; qwen2.py:535-547 on the last only
        embed, norm, head = first, last, (family != "qwen2" or last) and not tied
    if embed:
        out["model.embed_tokens.weight"] = _vocab(sd["model.embed_tokens.weight"], tp_rank, tp, engine, padding)
    for L in range(start, end):
        a, p = f"model.layers.{L}.self_attn.", f"model.layers.{L}."
        for kind in ("weight", "bias"):
            if f"{a}q_proj.{kind}" in sd:
                qkv = [sd[f"{a}{x}_proj.{kind}"] for x in "qkv"]
                out[f"{a}qkv_proj.{kind}"] = _qkv(*qkv, heads, kv, tp_rank, tp)
            if f"{a}o_proj.{kind}" in sd:
                out[f"{a}o_proj.{kind}"] = _row(sd[f"{a}o_proj.{kind}"], tp_rank, tp)
        if mixtral:
            m = p + "block_sparse_moe."
            out[m + "gate.weight"] = sd[m + "gate.weight"].clone()  # ReplicatedLinear
            n = sum(1 for k in sd if re.fullmatch(re.escape(m) + r"experts\.\d+\.w1\.weight", k))
            w = {x: [sd[f"{m}experts.{e}.{x}.weight"] for e in range(n)] for x in ("w1", "w2", "w3")}
            if engine == "vllm":
                w13, w2 = _vllm_moe(w["w1"], w["w2"], w["w3"], dp_rank * tp + tp_rank, tp * dp)
                mid = "experts.routed_experts."  # vLLM's MoERunner (fused_moe/runner/moe_runner.py)
            else:
                w13, w2 = _sglang_moe(w["w1"], w["w2"], w["w3"], tp_rank, tp, ep)
                mid = "experts."  # layer.py:1797-1822 make_expert_params_mapping: "experts.w13_", "experts.w2_"
            out[m + mid + "w13_weight"], out[m + mid + "w2_weight"] = w13, w2
        else:
            mm = p + "mlp."
            out[mm + "gate_up_proj.weight"] = _merged([sd[mm + "gate_proj.weight"], sd[mm + "up_proj.weight"]], tp_rank, tp)
            out[mm + "down_proj.weight"] = _row(sd[mm + "down_proj.weight"], tp_rank, tp)
            if engine == "vllm" and mm + "gate_proj.bias" in sd:  # SGLang's LlamaMLP: bias=False (llama.py:101,109)
                out[mm + "gate_up_proj.bias"] = _merged([sd[mm + "gate_proj.bias"], sd[mm + "up_proj.bias"]], tp_rank, tp)
                out[mm + "down_proj.bias"] = _row(sd[mm + "down_proj.bias"], tp_rank, tp)
        for nm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + nm] = sd[p + nm].clone()
    if norm:
        out["model.norm.weight"] = sd["model.norm.weight"].clone()
    if head:
        out["lm_head.weight"] = _vocab(sd["lm_head.weight"], tp_rank, tp, engine, padding)
    if engine == "sglang" and family == "qwen2" and tied and last and pp > 1:  # qwen2.py:539, loaded from the embedding :670-680
        out["lm_head.weight"] = _vocab(sd["model.embed_tokens.weight"], tp_rank, tp, engine, padding)
    return out


def _wcviz(sd: dict, family: str, **kw) -> dict[tuple[int, int, int], dict[str, torch.Tensor]]:
    """expected_shards grouped by (dp, pp, tp)."""
    out: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
    for c, n, t in expected_shards(sd, family, **kw):
        out.setdefault((c["dp"], c["pp"], c["tp"]), {})[n] = t
    return out


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    assert sorted(got) == sorted(want), f"{where}: only wcviz {sorted(set(got) - set(want))}, only the engine {sorted(set(want) - set(got))}"
    for n in want:
        assert not torch.isnan(want[n].float()).any(), f"{where} {n}: the reference left rows unloaded"
        assert got[n].shape == want[n].shape and torch.equal(got[n], want[n]), f"{where} {n}"


def _mlp_bias(sd: dict, layers: int) -> dict:
    g = torch.Generator().manual_seed(7)
    sd = dict(sd)
    for i in range(layers):
        m = f"model.layers.{i}.mlp."
        for proj in ("gate", "up"):
            sd[f"{m}{proj}_proj.bias"] = torch.randn(sd[f"{m}{proj}_proj.weight"].shape[0], generator=g).to(torch.bfloat16)
        sd[m + "down_proj.bias"] = torch.randn(sd[m + "down_proj.weight"].shape[0], generator=g).to(torch.bfloat16)
    return sd


# --- 1. vLLM's Mixtral: embedding, norm and head on every pipeline stage -------------------------------


@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("tied", [False, True])
def test_vllm_mixtral_holds_embedding_norm_and_head_on_every_stage(pp: int, tied: bool) -> None:
    sd = build_state_dict(dataclasses.replace(MIXTRAL_CFG, tie_embeddings=tied))
    got = _wcviz(sd, "mixtral", tp=2, pp=pp, heads=4, kv_heads=2)
    for p in range(pp):
        for t in range(2):
            _same(got[(0, p, t)], engine_rank(sd, "mixtral", "vllm", tp=2, pp=pp, tp_rank=t, pp_rank=p, heads=4, kv=2), f"pp{p} tp{t}")


def test_the_simulated_vllm_mixtral_holds_them_on_every_stage_too() -> None:
    sd = build_state_dict(MIXTRAL_CFG)
    shards = [EngineShard(MIXTRAL_CFG, t, 2, p, 2) for p in range(2) for t in range(2)]
    for s in shards:
        assert s.load_weights(sd.items()) == set(s.params)
        assert {n for n in s.params if not n.startswith("model.layers.")} == {
            "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
        }, s  # fmt: skip
    for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        for t in range(2):
            assert torch.equal(shards[t].params[n], shards[2 + t].params[n]), n


# --- 2. SGLang's pipeline split: leftovers to the last stages --------------------------------------------


def test_sglang_splits_leftover_layers_to_the_last_stages() -> None:
    for layers in range(1, 13):
        for pp in range(1, layers + 1):
            for engine, ref in (("vllm", _vllm_pp_indices), ("sglang", _sglang_pp_indices)):
                want = [range(*ref(layers, r, pp)) for r in range(pp)]
                assert stage_layers(layers, pp, engine=engine) == want, (engine, layers, pp)
    sd = build_state_dict(LLAMA_CFG)
    got = _wcviz(sd, "llama", tp=2, pp=2, heads=4, kv_heads=2, engine="sglang")
    for p in range(2):
        for t in range(2):
            want = engine_rank(sd, "llama", "sglang", tp=2, pp=2, tp_rank=t, pp_rank=p, heads=4, kv=2)
            _same(got[(0, p, t)], want, f"pp{p} tp{t}")


def _serve_reference(sim: SimSglang, sd: dict, family: str, heads: int, kv: int, ep: int = 1) -> SimSglang:
    """The simulated SGLang's ranks hold what the ported SGLang holds (it answers over HTTP as SGLang does)."""
    for (d, p, t), shard in sim.shards.items():
        shard.params = engine_rank(
            sd, family, "sglang", tp=sim.tp, pp=sim.pp, dp=sim.dp, ep=ep, tp_rank=t, pp_rank=p, dp_rank=d, heads=heads, kv=kv
        )
    return sim


def _verify_sglang(
    tmp_path: Path, cfg: ModelConfig, sd: dict, family: str, *, tp: int, pp: int = 1, dp: int = 1, ep: int = 1
) -> LiveReport:
    """verify_engine, by default (engine auto), against a simulated SGLang holding the port's tensors."""
    ckpt = save_checkpoint(sd, tmp_path / "ckpt", config=cfg)
    sim = _serve_reference(SimSglang(cfg, tp=tp, pp=pp, dp=dp), sd, family, cfg.heads, cfg.kv_heads, ep)
    with sim as url:
        report = verify_engine(url, ckpt, tp=tp, pp=pp, dp=dp, ep=ep)
    v = report.verdicts
    assert report.engine == "sglang"
    assert set(v.loc[v["pp"] == 0, "status"]) == {"match"}, v[v["status"] != "match"][["pp", "tp", "name", "status"]].head(12).to_string()
    assert set(v.loc[v["pp"] > 0, "status"]) <= {"unreachable"}  # SGLang's checker answers for stage 0 only
    return report


def test_verify_a_pipelined_sglang_whose_layers_do_not_divide_matches_on_the_stage_it_reports(tmp_path: Path) -> None:
    """5 layers over 2 stages: SGLang's stage 0 holds layers 0-1 (and Llama's head), not vLLM's 0-2."""
    _verify_sglang(tmp_path, LLAMA_CFG, build_state_dict(LLAMA_CFG), "llama", tp=2, pp=2)


# --- 3. vocabulary padding when tp does not divide the 64-padded vocabulary -------------------------------


def test_sglang_pads_the_vocabulary_to_a_multiple_of_64_tp_and_vllm_refuses_to_start(tmp_path: Path) -> None:
    sd = build_state_dict(QWEN2_CFG)  # vocab 1000: padded to 1024, which tp 6 does not divide
    kw = {"tp": 6, "heads": 12, "kv_heads": 2}
    got = _wcviz(sd, "qwen2", engine="sglang", **kw)
    for t in range(6):
        want = engine_rank(sd, "qwen2", "sglang", tp=6, tp_rank=t, heads=12, kv=2)
        assert want["model.embed_tokens.weight"].shape == (192, 96)  # 1000 padded to a multiple of 64 * 6: 1152
        _same(got[(0, 0, t)], want, f"tp{t}")
    with pytest.raises(AssertionError, match="1024 is not divisible by 6"):
        engine_rank(sd, "qwen2", "vllm", tp=6, heads=12, kv=2)  # what vLLM does
    with pytest.raises(LayoutError, match=r"vLLM cannot start with tp=6.*1000.*1024"):
        list(expected_shards(sd, "qwen2", **kw))
    # the simulated engine's padding (vocab_padding=1): to a multiple of tp, as SGLang pads with padding 1
    sim = _wcviz(sd, "qwen2", vocab_padding=1, **kw)
    assert torch.equal(sim[(0, 0, 5)]["lm_head.weight"], _vocab(sd["lm_head.weight"], 5, 6, "sglang", padding=1))
    _verify_sglang(tmp_path, QWEN2_CFG, sd, "qwen2", tp=6)


# --- 4. SGLang's Llama has no MLP biases -------------------------------------------------------------------


def test_sglang_llama_builds_no_mlp_biases(tmp_path: Path) -> None:
    cfg = dataclasses.replace(LLAMA_CFG, layers=2)
    sd = _mlp_bias(build_state_dict(cfg), 2)
    got = _wcviz(sd, "llama", tp=2, heads=4, kv_heads=2, engine="sglang")
    for t in range(2):
        _same(got[(0, 0, t)], engine_rank(sd, "llama", "sglang", tp=2, tp_rank=t, heads=4, kv=2), f"tp{t}")
    vllm = _wcviz(sd, "llama", tp=2, heads=4, kv_heads=2)  # vLLM builds them (the rules' own)
    _same(vllm[(0, 0, 1)], engine_rank(sd, "llama", "vllm", tp=2, tp_rank=1, heads=4, kv=2), "vllm tp1")
    _verify_sglang(tmp_path, cfg, sd, "llama", tp=2)


# --- 5. SGLang's FusedMoE: its own names, sliced over tp / ep within a DP replica --------------------------


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (4, 4)])
def test_sglang_fused_moe_names_and_slices(tp: int, ep: int) -> None:
    sd = build_state_dict(MIXTRAL_CFG)
    got = _wcviz(sd, "mixtral", tp=tp, ep=ep, dp=2, heads=4, kv_heads=2, engine="sglang")
    for d in range(2):
        for t in range(tp):
            want = engine_rank(sd, "mixtral", "sglang", tp=tp, dp=2, ep=ep, tp_rank=t, dp_rank=d, heads=4, kv=2)
            _same(got[(d, 0, t)], want, f"dp{d} tp{t}")


def test_verify_sglang_mixtral_with_expert_parallelism_and_dp(tmp_path: Path) -> None:
    _verify_sglang(tmp_path, MIXTRAL_CFG, build_state_dict(MIXTRAL_CFG), "mixtral", tp=4, dp=2, ep=2)


def test_verify_a_pipelined_sglang_mixtral(tmp_path: Path) -> None:
    _verify_sglang(tmp_path, MIXTRAL_CFG, build_state_dict(MIXTRAL_CFG), "mixtral", tp=2, pp=2)


# --- 6. dtype "auto" when config.json names no dtype ------------------------------------------------------


def _vllm_auto_dtype(config: dict, tensor_dtypes: set[torch.dtype]) -> torch.dtype:
    """vLLM on an Ampere-or-newer GPU: transformers_utils/model_arch_config_convertor.py:201-239 get_torch_dtype
    (the config's dtype, else the safetensors tensors' common_broadcastable_dtype, else float32), then
    config/model.py:2423-2464 _resolve_auto_dtype (float32 -> supported_dtypes[0], bfloat16)."""
    said = config.get("torch_dtype") or config.get("dtype")
    dtype = getattr(torch, said) if said else None
    if dtype is None and tensor_dtypes:  # utils/torch_utils.py:358-396, for floating-point dtypes

        def lossless(src: torch.dtype, tgt: torch.dtype) -> bool:
            s, t = torch.finfo(src), torch.finfo(tgt)
            return src == tgt or (s.min >= t.min and s.max <= t.max and s.resolution >= t.resolution)

        dtype = max(tensor_dtypes, key=lambda d: sum(lossless(x, d) for x in tensor_dtypes))
    dtype = dtype or torch.float32
    return torch.bfloat16 if dtype == torch.float32 else dtype


def _sglang_auto_dtype(config: dict) -> torch.dtype:
    """SGLang configs/model_config.py:2284-2321 _get_and_verify_dtype: float32 (or no dtype) -> float16."""
    said = config.get("dtype") or config.get("torch_dtype")
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(said or "float32", torch.float32)
    return torch.float16 if dtype == torch.float32 else dtype


def test_auto_dtype_matches_the_ported_rules() -> None:
    from wcviz.live import _engine_dtype

    for tensors in ({torch.float32}, {torch.bfloat16}, {torch.float16}, {torch.bfloat16, torch.float32}, set()):
        sd = {f"t{i}": torch.zeros(1, dtype=d) for i, d in enumerate(sorted(tensors, key=str))}
        for said in (None, "float32", "bfloat16", "float16"):
            config = {"model_type": "llama", **({"torch_dtype": said} if said else {})}
            vllm, sglang = _vllm_auto_dtype(config, tensors), _sglang_auto_dtype(config)
            assert _engine_dtype(config, "auto", "vllm", sd) == str(vllm).removeprefix("torch."), (tensors, said)
            assert _engine_dtype(config, "auto", "sglang", sd) == str(sglang).removeprefix("torch."), (tensors, said)
    assert _engine_dtype({}, "float32", "sglang", {}) == "float32"  # --dtype as given


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("config_dtype", [None, "float32"])
def test_auto_dtype_follows_the_engine(tmp_path: Path, engine: str, config_dtype: str | None) -> None:
    cfg32 = dataclasses.replace(LLAMA_CFG, layers=2, dtype=torch.float32)
    sd32 = build_state_dict(cfg32)
    ckpt = save_checkpoint(sd32, tmp_path / "ckpt", config=cfg32)
    config = json.loads((ckpt / "config.json").read_text())
    del config["torch_dtype"]
    if config_dtype:
        config["torch_dtype"] = config_dtype
    (ckpt / "config.json").write_text(json.dumps(config))
    served = _vllm_auto_dtype(config, {t.dtype for t in sd32.values()}) if engine == "vllm" else _sglang_auto_dtype(config)
    sim_cls = SimVllm if engine == "vllm" else SimSglang
    sim = sim_cls(dataclasses.replace(cfg32, dtype=served), tp=2)
    sim.load(sd32)  # the engine copies the float32 checkpoint into its params' dtype
    with sim as url:
        report = verify_engine(url, ckpt, tp=2, vocab_padding=1)
    assert report.engine == engine and report.assumed["dtype"] == str(served).removeprefix("torch.")
    assert report.ok, report.summary


# --- the simulated engine playing SGLang: its loader, written apart from the rules, agrees with them -------

_SIM = {
    "llama": dataclasses.replace(LLAMA_CFG, layers=8),
    "qwen2": ModelConfig(vocab=250, hidden=64, layers=8, heads=4, kv_heads=2, intermediate=32, qkv_bias=True, tie_embeddings=True),
    "mixtral": dataclasses.replace(MIXTRAL_CFG, layers=8),
    "sim-moe": ModelConfig(vocab=250, hidden=64, layers=8, heads=4, kv_heads=2, intermediate=32, experts=2, seed=14),
}


@pytest.mark.parametrize("family", list(_SIM))
def test_the_sim_playing_sglang_holds_what_the_rules_say(family: str) -> None:
    cfg = _SIM[family]
    sd = build_state_dict(cfg)
    topologies = [(1, 1, 1, 1), (2, 2, 1, 1), (2, 3, 2, 1), (4, 2, 1, 1), (1, 5, 1, 1)]
    if family == "mixtral":
        topologies += [(4, 2, 2, 4), (2, 1, 2, 2)]
    for tp, pp, dp, ep in topologies:
        want = _wcviz(sd, family, tp=tp, pp=pp, dp=dp, ep=ep, heads=4, kv_heads=2, vocab_padding=1, engine="sglang")
        shards = []
        for (d, p, t), params in want.items():
            s = EngineShard(cfg, t, tp, p, pp, dp_rank=d, dp_size=dp, expert_parallel=ep > 1, engine="sglang")
            assert s.load_weights(sd.items()) == set(s.params)
            _same(s.params, params, f"tp{tp} pp{pp} dp{dp} ep{ep}: dp{d} pp{p} tp{t}")
            shards.append(s)
        full = reassemble(shards)
        assert list(full) == list(sd) and all(torch.equal(full[n], sd[n]) for n in sd)


def test_the_sim_playing_sglang_refuses_what_sglang_refuses() -> None:
    with pytest.raises(ValueError, match=re.escape("tp = 4 must divide ModelConfig.experts (6)")):
        EngineShard(dataclasses.replace(MIXTRAL_CFG, experts=6), 0, 4, 0, 1, expert_parallel=True, engine="sglang")
    with pytest.raises(ValueError, match="engine must be one of vllm, sglang"):
        EngineShard(LLAMA_CFG, 0, 1, 0, 1, engine="trtllm")
    with pytest.raises(LayoutError, match=r"ep=2: SGLang's expert parallelism .* must divide tp and the 3 experts"):
        list(expected_shards(build_state_dict(dataclasses.replace(MIXTRAL_CFG, experts=3)), "mixtral", tp=2, ep=2, heads=4, kv_heads=2, engine="sglang"))
    with pytest.raises(LayoutError, match="engine='trtllm' is not known; choose one of: vllm, sglang"):
        list(expected_shards(build_state_dict(LLAMA_CFG), "llama", tp=1, heads=4, kv_heads=2, engine="trtllm"))
    with pytest.raises(LayoutError, match="names='vllm>=0.25' chooses between vLLM versions' names"):
        list(expected_shards(build_state_dict(MIXTRAL_CFG), "mixtral", tp=1, heads=4, kv_heads=2, engine="sglang", names="vllm>=0.25"))
