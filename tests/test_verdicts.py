"""Verdicts: expected vs actual digest tables, keyed by (rank identity, name)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from wcviz._errors import AlgorithmMismatch, TableError
from wcviz.verdicts import STATUSES, compare, counts, differences
from wcviz.digest import digest_hex
from wcviz.frame import IDENTITY, make_frame
from wcviz.sources import from_safetensors, from_state_dict


def _sd():
    g = torch.Generator().manual_seed(3)
    return {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=g).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=g).bfloat16(),
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=g).bfloat16(),
        "model.layers.1.mlp.down_proj.weight": torch.randn(4, 6, generator=g).bfloat16(),
        "model.layers.1.input_layernorm.weight": torch.ones(4, dtype=torch.bfloat16),
        "model.norm.weight": torch.ones(4, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(8, 4, generator=g).bfloat16(),
    }


def _flip_bit(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(torch.int16).view(-1)[1] ^= 1
    return t


def _faulty(sd):
    """One of each status: mismatch, drift (dtype), drift (shape), missing, unexpected."""
    bad = dict(sd)
    bad["model.layers.0.self_attn.q_proj.weight"] = _flip_bit(sd["model.layers.0.self_attn.q_proj.weight"])
    bad["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].float()
    bad["model.layers.1.mlp.down_proj.weight"] = sd["model.layers.1.mlp.down_proj.weight"].reshape(6, 4)
    del bad["model.norm.weight"]
    bad["model.extra.weight"] = torch.zeros(2)
    return bad


EXPECTED_STATUS = {
    "model.embed_tokens.weight": "match",
    "model.layers.0.self_attn.q_proj.weight": "mismatch",
    "model.layers.0.mlp.up_proj.weight": "drift",
    "model.layers.1.mlp.down_proj.weight": "drift",
    "model.layers.1.input_layernorm.weight": "match",
    "model.norm.weight": "missing",
    "lm_head.weight": "match",
    "model.extra.weight": "unexpected",
}


def _status(v: pd.DataFrame) -> dict[str, str]:
    return dict(zip(v["name"], v["status"]))


def test_every_status():
    sd = _sd()
    bad = _faulty(sd)
    v = compare(from_state_dict(sd), from_state_dict(bad))
    assert _status(v) == EXPECTED_STATUS
    assert len(v) == len(EXPECTED_STATUS)
    row = v.set_index("name")
    # both digests side by side
    q = "model.layers.0.self_attn.q_proj.weight"
    assert row.loc[q, "digest_expected"] == digest_hex(sd[q])
    assert row.loc[q, "digest_actual"] == digest_hex(bad[q])
    assert row.loc[q, "digest_expected"] != row.loc[q, "digest_actual"]
    # drift: dtype change and shape change, each visible
    up = "model.layers.0.mlp.up_proj.weight"
    assert (row.loc[up, "dtype_expected"], row.loc[up, "dtype_actual"]) == ("bfloat16", "float32")
    down = "model.layers.1.mlp.down_proj.weight"
    assert (row.loc[down, "shape_expected"], row.loc[down, "shape_actual"]) == ("[4, 6]", "[6, 4]")
    assert row.loc[down, "dtype_expected"] == row.loc[down, "dtype_actual"]
    # missing / unexpected: one side empty
    assert row.loc["model.norm.weight", "digest_expected"] == digest_hex(sd["model.norm.weight"])
    assert pd.isna(row.loc["model.norm.weight", "digest_actual"])
    assert pd.isna(row.loc["model.extra.weight", "digest_expected"])
    assert row.loc["model.extra.weight", "digest_actual"] == digest_hex(bad["model.extra.weight"])
    # match: the same digest on both sides
    assert row.loc["lm_head.weight", "digest_expected"] == row.loc["lm_head.weight", "digest_actual"]
    # grouping columns come along
    assert row.loc[up, "layer"] == 0 and row.loc[up, "block"] == "mlp"
    assert row.loc["model.extra.weight", "block"] == "other"
    assert set(v["algo"]) == {"nemo-rl-v3"}


def test_results_are_ordered_most_severe_first():
    v = compare(from_state_dict(_sd()), from_state_dict(_faulty(_sd())))
    order = [STATUSES.index(s) for s in v["status"]]
    assert order == sorted(order)
    assert v["status"].iloc[0] == "mismatch" and v["status"].iloc[-1] == "match"
    assert STATUSES[0] == "mismatch" and STATUSES[-1] == "match"


def test_counts_include_zero_entries():
    sd = _sd()
    c = counts(compare(from_state_dict(sd), from_state_dict(sd)))
    assert list(c) == list(STATUSES)
    assert c == {"mismatch": 0, "drift": 0, "missing": 0, "unexpected": 0, "match": len(sd)}
    c = counts(compare(from_state_dict(sd), from_state_dict(_faulty(sd))))
    assert c == {"mismatch": 1, "drift": 2, "missing": 1, "unexpected": 1, "match": 3}


def test_differences_drops_matches():
    v = compare(from_state_dict(_sd()), from_state_dict(_faulty(_sd())))
    d = differences(v)
    assert "match" not in set(d["status"])
    assert len(d) == 5 and list(d.index) == list(range(5))


def test_rankless_expected_is_broadcast_to_every_rank(tmp_path):
    """A checkpoint compared with two tp ranks: a fault on tp=1 shows up on tp=1 only."""
    from safetensors.torch import save_file

    sd = _sd()
    save_file(sd, str(tmp_path / "ck.safetensors"))
    expected = from_safetensors(tmp_path / "ck.safetensors", progress=False)
    assert expected["rank"].isna().all()
    victim = "model.layers.1.mlp.down_proj.weight"
    rank1 = dict(sd, **{victim: _flip_bit(sd[victim])})
    actual = pd.concat(
        [
            from_state_dict(sd, role="engine", rank=0, tp=0, host="a"),
            from_state_dict(rank1, role="engine", rank=1, tp=1, host="b"),
        ],
        ignore_index=True,
    )
    v = compare(expected, actual)
    assert len(v) == 2 * len(sd)
    assert not v[["rank", "name"]].duplicated().any()
    diff = differences(v)
    assert len(diff) == 1
    bad = diff.iloc[0]
    assert (bad["name"], bad["status"], bad["tp"], bad["rank"], bad["host"]) == (victim, "mismatch", 1, 1, "b")
    on_tp0 = v[v["tp"] == 0]
    assert len(on_tp0) == len(sd) and (on_tp0["status"] == "match").all()
    assert (v["role_expected"] == "checkpoint").all() and (v["role_actual"] == "engine").all()


def test_keyed_by_rank_coordinates_not_row_order():
    sd = _sd()
    victim = "model.embed_tokens.weight"
    expected = pd.concat([from_state_dict(sd, rank=r, tp=r) for r in (0, 1, 2)], ignore_index=True)
    actual = pd.concat(
        [from_state_dict(dict(sd, **{victim: _flip_bit(sd[victim])}) if r == 2 else sd, rank=r, tp=r) for r in (2, 0, 1)],
        ignore_index=True,
    ).sample(frac=1, random_state=0)
    v = compare(expected, actual)
    assert len(v) == 3 * len(sd)
    diff = differences(v)
    assert diff[["rank", "tp", "name", "status"]].values.tolist() == [[2, 2, victim, "mismatch"]]


def test_rank_missing_entirely_is_missing_on_that_rank_only():
    sd = _sd()
    expected = pd.concat([from_state_dict(sd, rank=r, tp=r) for r in (0, 1)], ignore_index=True)
    actual = from_state_dict(sd, rank=0, tp=0)
    v = compare(expected, actual)
    assert set(v.loc[v["rank"] == 1, "status"]) == {"missing"}
    assert set(v.loc[v["rank"] == 0, "status"]) == {"match"}


def test_tables_without_dtype_and_shape_compare_by_digest():
    e = make_frame([{"name": n, "digest": d, "algo": "sha256"} for n, d in [("a", "00" * 32), ("b", "11" * 32)]])
    a = make_frame([{"name": n, "digest": d, "algo": "sha256"} for n, d in [("a", "00" * 32), ("b", "12" * 32)]])
    assert _status(compare(e, a)) == {"a": "match", "b": "mismatch"}


def test_digest_case_does_not_matter():
    e = make_frame([{"name": "a", "digest": "abcdef" * 10 + "abcd", "algo": "sha256"}])
    a = make_frame([{"name": "a", "digest": "ABCDEF" * 10 + "ABCD", "algo": "sha256"}])
    assert _status(compare(e, a)) == {"a": "match"}


def test_different_algorithms_raise():
    sd = _sd()
    with pytest.raises(AlgorithmMismatch, match="sha256"):
        compare(from_state_dict(sd), from_state_dict(sd, algo="sha256"))


def test_mixed_algorithms_in_one_table_raise():
    sd = _sd()
    mixed = pd.concat([from_state_dict(sd, rank=0), from_state_dict(sd, rank=1, algo="sha256")], ignore_index=True)
    with pytest.raises(AlgorithmMismatch):
        compare(from_state_dict(sd), mixed)


@pytest.mark.parametrize("side", ["expected", "actual"])
def test_duplicate_rank_name_rows_raise(side):
    sd = _sd()
    one = from_state_dict(sd, rank=0, tp=0)
    two_phases = pd.concat([from_state_dict(sd, rank=0, tp=0, phase="sent"), from_state_dict(sd, rank=0, tp=0, phase="received")], ignore_index=True)
    e, a = (two_phases, one) if side == "expected" else (one, two_phases)
    with pytest.raises(TableError, match=side) as info:
        compare(e, a)
    assert "rank=0" in str(info.value)


def test_inputs_are_validated():
    good = make_frame([{"name": "a", "digest": "00" * 32, "algo": "sha256"}])
    with pytest.raises(TableError, match="digest"):
        compare(good, pd.DataFrame({"name": ["a"], "algo": ["sha256"]}))
    with pytest.raises(TableError, match="block"):
        compare(pd.DataFrame({"name": ["a"], "digest": ["00" * 32], "algo": ["sha256"], "block": ["bogus"]}), good)


def test_verdict_columns():
    v = compare(from_state_dict(_sd()), from_state_dict(_sd()))
    for col in [*IDENTITY, "name", "status", "algo", "digest_expected", "digest_actual", "dtype_expected", "dtype_actual", "shape_expected", "shape_actual", "nbytes_expected", "nbytes_actual", "layer", "block", "expert", "host"]:
        assert col in v.columns, col


def test_tables_with_different_rank_coordinates_are_refused():
    sd = _sd()
    by_tp = pd.concat([from_state_dict(sd, tp=r) for r in (0, 1)], ignore_index=True)
    by_rank_tp = pd.concat([from_state_dict(sd, rank=r, tp=r) for r in (0, 1)], ignore_index=True)
    with pytest.raises(TableError, match=r"expected table locates ranks by \(tp\) but actual by \(rank, tp\)"):
        compare(by_tp, by_rank_tp)
    with pytest.raises(TableError, match=r"by \(rank, tp\) but actual by \(nothing\)"):
        compare(by_rank_tp, from_state_dict(sd))


# --------------------------------------------------------------------------- digests are validated, never matched blindly


@pytest.mark.parametrize(
    ("digest", "algo", "why"),
    [
        ("error", "nemo-rl-v3", "is not a nemo-rl-v3 digest"),
        ("", "nemo-rl-v3", "is empty"),
        ("ab" * 32, "nemo-rl-v3", "is not a nemo-rl-v3 digest \\(32 hex characters\\)"),
        ("zz" * 16, "nemo-rl-v3", "is not a nemo-rl-v3 digest"),
        ("ab" * 16, "sha256", "is not a sha256 digest \\(64 hex characters\\)"),
        ("ab" * 16, "md5", "unknown digest algorithm 'md5'"),
        ("00" * 9, "sglang", "is not a sglang digest"),
    ],
)
def test_a_digest_not_in_its_algorithms_format_is_a_table_error_naming_the_row(digest: str, algo: str, why: str) -> None:
    good = make_frame([{"name": "a", "digest": "0" * 32, "algo": "nemo-rl-v3"}])
    bad = pd.DataFrame({"name": ["a", "b"], "digest": ["0" * 32, digest], "algo": ["nemo-rl-v3", algo]})
    with pytest.raises(TableError, match=rf"row 1 \('b'\): .*{why}" if why != "is empty" else "column 'digest' is empty in row 1"):
        compare(good, bad)


def test_error_strings_never_match_each_other() -> None:
    garbage = pd.DataFrame({"name": ["w"], "digest": ["error"], "algo": ["nemo-rl-v3"]})
    with pytest.raises(TableError, match="'error' is not a nemo-rl-v3 digest"):
        compare(garbage, garbage)


def test_uppercase_hex_is_read_as_lowercase() -> None:
    frame = make_frame([{"name": "w", "digest": "AB" * 16, "algo": "nemo-rl-v3"}])
    assert frame["digest"].iloc[0] == "ab" * 16


def _rank_row(name: str, rank: int, tp: int, host: str = "h0", role: str = "engine") -> dict:
    return {"name": name, "digest": "0" * 32, "algo": "nemo-rl-v3", "rank": rank, "tp": tp, "host": host, "role": role}


@pytest.mark.parametrize(
    ("rows", "why"),
    [
        ([_rank_row("w", 1, 0), _rank_row("v", 1, 1)], r"rank 1 claims two identities: \(rank=1 tp=0\) in row 0 and \(rank=1 tp=1\) in row 1"),
        ([_rank_row("w", 1, 0, host="a"), _rank_row("v", 1, 0, host="b")], "rows 0 and 1 claim the same rank .* host 'a' and 'b'"),
        ([_rank_row("w", 0, 0, role="trainer"), _rank_row("v", 0, 0)], "rows 0 and 1 claim the same rank .* role 'trainer' and 'engine'"),
    ],
)
def test_one_rank_with_two_identities_is_an_error(rows: list[dict], why: str) -> None:
    table = make_frame(rows)
    with pytest.raises(TableError, match=why):
        compare(table, table)
    with pytest.raises(TableError, match=why):
        compare(make_frame([_rank_row("w", 5, 5)]), table)


# --------------------------------------------------------------------------- malformed and unnamed rows


def _verdict_rows(rows: list[tuple]) -> pd.DataFrame:
    """(rank, tp, name, status) tuples as a verdict frame; NA where None."""
    df = pd.DataFrame(rows, columns=["rank", "tp", "name", "status"])
    for c in IDENTITY:
        df[c] = df[c].astype("Int64") if c in df else pd.Series(pd.NA, index=df.index, dtype="Int64")
    df["name"] = df["name"].astype("string")
    df["status"] = df["status"].astype("string")
    return df


def test_a_row_without_a_status_is_refused_naming_the_row() -> None:
    import wcviz.views  # noqa: F401 - registers df.wc
    from wcviz.verdicts import status_parts, summary

    v = _verdict_rows([(0, 0, "model.layers.0.w", "match"), (1, 1, "model.layers.0.w", None)])
    for view in (summary, status_parts, differences, counts):
        with pytest.raises(TableError, match=r"row 1 \(rank 1 \(tp=1\), parameter model\.layers\.0\.w\) has no status"):
            view(v)
    with pytest.raises(TableError, match="row 1"):
        v.wc.mismatches()  # was: the row silently dropped


def test_a_finding_without_a_name_is_counted() -> None:
    from wcviz.verdicts import status_parts, summary

    v = _verdict_rows([(0, 0, "model.layers.0.w", "match"), (0, 0, None, "mismatch"), (1, 1, "model.layers.0.w", "match")])
    assert status_parts(v) == ["1 mismatch on 1 rank (rank 0 (tp=0))", "2 match"]
    assert summary(v) == "end-state check: 2 ranks, 3 parameters: 1 mismatch on 1 rank (rank 0 (tp=0)), 2 match"


def test_summary_says_one_parameter() -> None:
    from wcviz.verdicts import summary

    v = _verdict_rows([(0, 0, "model.layers.0.w", "unwritten")])
    assert summary(v) == "end-state check: 1 rank, 1 parameter: 1 unwritten on 1 rank (rank 0 (tp=0))"


def test_ranks_known_only_by_their_urls_are_refused_not_merged_into_one() -> None:
    """compare lined ranks up by coordinates alone: two ranks known only by URL became one, and a checkpoint
    against rank a holding w and rank b holding v was "1 rank, 2 match" (each rank lacks one parameter)."""
    import hashlib

    from wcviz._errors import TableError
    from wcviz.frame import make_frame

    def row(name: str, **ident: object) -> dict:
        return {"name": name, "digest": hashlib.sha256(name.encode()).hexdigest(), "algo": "sha256", **ident}

    checkpoint = make_frame([row("w"), row("v")])
    ranks = make_frame([row("w"), row("v")]).assign(url=["http://a", "http://b"])  # as a fetch gives them
    with pytest.raises(TableError, match=r"actual table holds 2 ranks known only by their URL \(http://a, http://b\)"):
        compare(checkpoint, ranks)
    with pytest.raises(TableError, match="expected table holds 2 ranks known only by their URL"):
        compare(ranks, ranks)
    one = make_frame([row("w"), row("v")]).assign(url=["http://a", "http://a"])
    assert set(compare(checkpoint, one)["status"]) == {"match"}  # one such rank is one rank
