"""The digest-table schema: columns, name parsing, validation and file roundtrips."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pandas as pd
import pytest

from wcviz._errors import TableError, WcvizError
from wcviz.frame import (
    COLUMNS,
    empty_frame,
    make_frame,
    parse_block,
    parse_expert,
    parse_layer,
    read_table,
    shape_str,
    table_text,
    validate,
    write_table,
)

SUFFIXES = (".csv", ".parquet", ".json")
NULLABLE = [c for c in COLUMNS if c not in ("name", "digest", "algo")]


def _full_row(**over):
    row = {
        "name": "model.layers.3.self_attn.q_proj.weight",
        "digest": "0f" * 16,
        "algo": "nemo-rl-v3",
        "dtype": "bfloat16",
        "shape": "[64, 64]",
        "nbytes": 8192,
        "role": "engine",
        "rank": 5,
        "dp": 1,
        "pp": 0,
        "tp": 1,
        "ep": 0,
        "host": "node-07",
        "device": "cuda:1",
        "phase": "received",
        "step": 12,
        "seconds": 0.000123456789012345678,
    }
    row.update(over)
    return row


def _all_na_row(name="x"):
    """Every nullable column NA, layer/block/expert included (given explicitly, so not parsed)."""
    return {"name": name, "digest": "ab" * 16, "algo": "nemo-rl-v3", **{c: None for c in NULLABLE}}


def _tricky_frame():
    rows = [
        _full_row(),
        _all_na_row("model.layers.0.mlp.gate.weight"),
        # a digest made only of digits, with leading zeros: must stay a string
        _full_row(name="lm_head.weight", digest="00123456789012345678901234567890", rank=0, nbytes=2**40 + 1),
        # strings that CSV readers like to turn into NA
        _full_row(name="NA", digest="0000" * 8, host="nan", role="null", phase="None", seconds=0.0),
    ]
    return make_frame(rows)


# ---------------------------------------------------------------------------- schema


def test_make_frame_has_exactly_the_schema_columns_and_dtypes():
    df = make_frame([_full_row(), _full_row(name="model.norm.weight", rank=6)])
    assert list(df.columns) == list(COLUMNS)
    assert {c: str(df[c].dtype) for c in df.columns} == {c: str(pd.Series(dtype=t).dtype) for c, t in COLUMNS.items()}
    assert len(df) == 2
    assert df["rank"].tolist() == [5, 6]


def test_empty_frame_has_the_schema():
    df = empty_frame()
    assert list(df.columns) == list(COLUMNS)
    assert len(df) == 0
    assert make_frame([]).columns.tolist() == list(COLUMNS)


def test_missing_columns_become_na_not_empty_strings():
    df = make_frame([{"name": "w", "digest": "00" * 32, "algo": "sha256"}])
    for col in ("dtype", "shape", "role", "host", "device", "phase"):
        assert df[col].isna().all(), col
    for col in ("rank", "dp", "pp", "tp", "ep", "step", "nbytes"):
        assert df[col].isna().all(), col
    assert df["seconds"].isna().all()


def test_empty_strings_are_stored_as_na():
    df = make_frame([{"name": "w", "digest": "00" * 32, "algo": "sha256", "host": ""}])
    assert df["host"].isna().all()


def test_validated_frame_shares_nothing_with_its_input():
    """``validate`` copies the columns it does not cast: writing into its result never changes the caller's frame."""
    given = pd.DataFrame(
        {
            "name": pd.array(["model.layers.0.mlp.w", "model.layers.1.mlp.w"], dtype="string"),
            "digest": pd.array(["00" * 16, "11" * 16], dtype="string"),
            "algo": pd.array(["nemo-rl-v3"] * 2, dtype="string"),
            "rank": pd.array([3, 4], dtype="Int64"),
            "seconds": [0.5, 0.25],
            "note": ["a", "b"],  # an extra column rides along
        },
        index=[7, 9],
    )
    kept = given.copy(deep=True)
    out = validate(given)
    assert list(out.index) == [0, 1] and list(out.columns) == [*COLUMNS, "note"]
    assert out["layer"].tolist() == [0, 1] and out["block"].tolist() == ["mlp", "mlp"]
    out.loc[0, "rank"] = 99
    out.loc[0, "seconds"] = 9.0
    out.loc[0, "note"] = "changed"
    out.loc[0, "digest"] = "22" * 16
    pd.testing.assert_frame_equal(given, kept)


def test_make_frame_rejects_unknown_columns_naming_them():
    with pytest.raises(TableError, match="colour"):
        make_frame([{"name": "w", "digest": "00" * 32, "algo": "sha256", "colour": "red"}])


def test_shape_str_is_a_json_list():
    assert shape_str((4, 3)) == "[4, 3]"
    assert shape_str(()) == "[]"
    assert json.loads(shape_str([0, 7])) == [0, 7]


@pytest.mark.parametrize(
    "names, sizes",
    [
        (["lm_head.weight", "model.layers.0.input_layernorm.weight"], [524288, 512]),
        (["a" * 90, "x\ny", "tab\there", " lead", "trail ", "", "é漢字", "cr\rhere", "a'q\"\\b"], [0, 1, 22, 333, 4, 5, 6, 7, 8]),
        (["w"], [7]),  # values narrower than the header
        (["w", "v"], [-3, 123456789012]),
    ],
)
def test_aligned_text_is_what_pandas_prints(names, sizes):
    """``wcviz digest`` prints its table without pandas; the text must be pandas' own, escapes and the integer
    column's sign space included."""
    from wcviz._text import aligned

    rows = [{"name": n, "digest": f"{i:032x}", "shape": shape_str([i, 2]), "nbytes": b} for i, (n, b) in enumerate(zip(names, sizes))]
    cols = ["name", "digest", "shape", "nbytes"]
    frame = pd.DataFrame({"name": pd.array(names, dtype="string"), "digest": pd.array([r["digest"] for r in rows], dtype="string"),
                          "shape": pd.array([r["shape"] for r in rows], dtype="string"), "nbytes": pd.array(sizes, dtype="Int64")})  # fmt: skip
    assert aligned(rows, cols) == frame[cols].to_string(index=False)
    assert aligned(rows, cols).count("\n") == len(rows)  # one line per row, whatever a name holds


# ---------------------------------------------------------------------------- name parsing

LAYERS = [
    ("model.layers.0.self_attn.q_proj.weight", 0),
    ("model.layers.17.mlp.down_proj.weight", 17),
    ("transformer.h.11.attn.c_attn.weight", 11),
    ("h.3.mlp.c_fc.bias", 3),
    ("blocks.2.attn.qkv.weight", 2),
    ("model.decoder.layers.4.fc1.weight", 4),
    ("decoder.layers.5.self_attn.v_proj.weight", 5),
    ("bert.encoder.layer.2.attention.self.query.weight", 2),
    ("encoder.layer.9.output.dense.weight", 9),
    ("model.layers.3.block_sparse_moe.experts.6.w1.weight", 3),
    ("model.embed_tokens.weight", None),
    ("model.norm.weight", None),
    ("lm_head.weight", None),
    ("transformer.wte.weight", None),
    ("mhc.4.weight", None),  # "h" must be a whole component
]


@pytest.mark.parametrize(("name", "layer"), LAYERS)
def test_parse_layer(name, layer):
    assert parse_layer(name) == layer
    got = make_frame([{"name": name, "digest": "00" * 32, "algo": "sha256"}])["layer"].iloc[0]
    assert (pd.isna(got) and layer is None) or got == layer


BLOCKS = [
    # Llama
    ("model.embed_tokens.weight", "embed", None),
    ("model.layers.0.self_attn.q_proj.weight", "attn", None),
    ("model.layers.0.self_attn.o_proj.weight", "attn", None),
    ("model.layers.0.mlp.gate_proj.weight", "mlp", None),
    ("model.layers.0.mlp.up_proj.weight", "mlp", None),
    ("model.layers.0.mlp.down_proj.weight", "mlp", None),
    ("model.layers.0.input_layernorm.weight", "norm", None),
    ("model.layers.0.post_attention_layernorm.weight", "norm", None),
    ("model.norm.weight", "norm", None),
    ("lm_head.weight", "head", None),
    # Mixtral
    ("model.layers.1.block_sparse_moe.gate.weight", "router", None),
    ("model.layers.1.block_sparse_moe.experts.3.w1.weight", "expert", 3),
    ("model.layers.1.block_sparse_moe.experts.7.w2.weight", "expert", 7),
    # Qwen-MoE
    ("model.layers.0.mlp.gate.weight", "router", None),
    ("model.layers.0.mlp.experts.12.gate_proj.weight", "expert", 12),
    ("model.layers.0.mlp.shared_expert.up_proj.weight", "mlp", None),
    ("model.layers.0.mlp.shared_expert_gate.weight", "router", None),
    # GPT-2
    ("transformer.wte.weight", "embed", None),
    ("transformer.wpe.weight", "embed", None),
    ("transformer.h.5.ln_1.weight", "norm", None),
    ("transformer.h.5.attn.c_attn.weight", "attn", None),
    ("transformer.h.5.attn.c_proj.weight", "attn", None),
    ("transformer.h.5.mlp.c_fc.weight", "mlp", None),
    ("transformer.h.5.mlp.c_proj.weight", "mlp", None),
    ("transformer.ln_f.weight", "norm", None),
    # BERT
    ("bert.embeddings.word_embeddings.weight", "embed", None),
    ("bert.embeddings.LayerNorm.weight", "norm", None),
    ("encoder.layer.2.attention.self.query.weight", "attn", None),
    ("encoder.layer.2.attention.output.dense.weight", "attn", None),
    ("encoder.layer.2.attention.output.LayerNorm.weight", "norm", None),
    ("encoder.layer.2.intermediate.dense.weight", "mlp", None),
    ("encoder.layer.2.output.dense.weight", "mlp", None),
    ("encoder.layer.2.output.LayerNorm.bias", "norm", None),
    # nothing recognisable
    ("some.custom.thing", "other", None),
]


@pytest.mark.parametrize(("name", "block", "expert"), BLOCKS)
def test_parse_block_and_expert(name, block, expert):
    assert parse_block(name) == block
    assert parse_expert(name) == expert
    row = make_frame([{"name": name, "digest": "00" * 32, "algo": "sha256"}]).iloc[0]
    assert row["block"] == block
    assert (pd.isna(row["expert"]) and expert is None) or row["expert"] == expert


def test_given_layer_block_expert_are_not_overwritten():
    row = make_frame([{"name": "lm_head.weight", "digest": "00" * 32, "algo": "sha256", "layer": 9, "block": "mlp", "expert": 2}]).iloc[0]
    assert (row["layer"], row["block"], row["expert"]) == (9, "mlp", 2)


# ---------------------------------------------------------------------------- roundtrips


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_roundtrip_is_exact(tmp_path, suffix):
    df = _tricky_frame()
    # every nullable column really holds an NA somewhere, so the roundtrip covers it
    assert all(df[c].isna().any() for c in NULLABLE)
    path = write_table(df, tmp_path / f"t{suffix}")
    assert path.is_file()
    back = read_table(path)
    pd.testing.assert_frame_equal(back, df, check_exact=True)
    assert back.loc[2, "digest"] == "00123456789012345678901234567890"
    assert back.loc[3, "name"] == "NA" and back.loc[3, "host"] == "nan" and back.loc[3, "role"] == "null"
    assert back.loc[2, "nbytes"] == 2**40 + 1


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_roundtrip_of_an_empty_table(tmp_path, suffix):
    path = write_table(empty_frame(), tmp_path / f"e{suffix}")
    pd.testing.assert_frame_equal(read_table(path), empty_frame())


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_roundtrip_keeps_extra_columns(tmp_path, suffix):
    df = make_frame([_full_row()])
    df["note"] = ["checked"]
    back = read_table(write_table(df, tmp_path / f"x{suffix}"))
    assert back["note"].tolist() == ["checked"]
    pd.testing.assert_frame_equal(back[list(COLUMNS)], df[list(COLUMNS)], check_exact=True)


def test_suffix_is_case_insensitive(tmp_path):
    df = _tricky_frame()
    pd.testing.assert_frame_equal(read_table(write_table(df, tmp_path / "T.CSV")), df, check_exact=True)


def test_read_table_accepts_a_minimal_hand_written_csv(tmp_path):
    p = tmp_path / "min.csv"
    p.write_text("name,digest,algo,rank\nmodel.layers.1.mlp.up_proj.weight," + "0099" * 16 + ",sha256,3\n")
    df = read_table(p)
    assert list(df.columns) == list(COLUMNS)
    row = df.iloc[0]
    assert (row["digest"], row["rank"], row["layer"], row["block"]) == ("0099" * 16, 3, 1, "mlp")
    assert pd.isna(row["tp"]) and pd.isna(row["host"])


# ---------------------------------------------------------------------------- bad tables


@pytest.mark.parametrize("col", ["name", "digest", "algo"])
def test_missing_required_column_names_it(tmp_path, col):
    df = pd.DataFrame({"name": ["w"], "digest": ["00" * 32], "algo": ["sha256"]}).drop(columns=col)
    with pytest.raises(TableError, match=col):
        validate(df)
    p = tmp_path / "t.csv"
    df.to_csv(p, index=False)
    with pytest.raises(TableError, match=col) as info:
        read_table(p)
    assert str(p) in str(info.value)


@pytest.mark.parametrize("col", ["name", "digest", "algo"])
def test_empty_required_value_names_the_column(col):
    df = pd.DataFrame({"name": ["w", "v"], "digest": ["00" * 32, "01" * 32], "algo": ["sha256", "sha256"]})
    df.loc[1, col] = None
    with pytest.raises(TableError, match=rf"'{col}'.*row 1"):
        validate(df)


@pytest.mark.parametrize("col", ["rank", "tp", "step", "nbytes"])
def test_non_numeric_integer_column_names_it(col):
    df = pd.DataFrame({"name": ["w"], "digest": ["00" * 32], "algo": ["sha256"], col: ["three"]})
    with pytest.raises(TableError, match=f"'{col}'"):
        validate(df)


def test_fractional_rank_is_rejected_naming_it():
    df = pd.DataFrame({"name": ["w"], "digest": ["00" * 32], "algo": ["sha256"], "rank": [1.5]})
    with pytest.raises(TableError, match="'rank'"):
        validate(df)


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_non_numeric_rank_in_a_file_names_the_column_and_file(tmp_path, suffix):
    p = tmp_path / f"bad{suffix}"
    rows = [{"name": "w", "digest": "00" * 32, "algo": "sha256", "rank": "0"}, {"name": "v", "digest": "01" * 32, "algo": "sha256", "rank": "zero"}]
    if suffix == ".csv":
        pd.DataFrame(rows).to_csv(p, index=False)
    else:
        p.write_text(json.dumps(rows))
    with pytest.raises(TableError, match="'rank'") as info:
        read_table(p)
    assert str(p) in str(info.value)


def test_non_numeric_seconds_names_the_column(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("name,digest,algo,seconds\nw,00,sha256,fast\n")
    with pytest.raises(TableError, match="'seconds'"):
        read_table(p)


def test_unknown_block_names_the_column_and_value(tmp_path):
    df = pd.DataFrame({"name": ["w"], "digest": ["00" * 32], "algo": ["sha256"], "block": ["encoder"]})
    with pytest.raises(TableError, match="'block'.*encoder"):
        validate(df)
    p = tmp_path / "b.csv"
    df.to_csv(p, index=False)
    with pytest.raises(TableError, match="'block'"):
        read_table(p)
    with pytest.raises(TableError, match="'block'"):
        write_table(df, tmp_path / "out.csv")


def test_validate_rejects_non_frames():
    with pytest.raises(TableError, match="DataFrame"):
        validate([{"name": "w"}])


@pytest.mark.parametrize("name", ["t.txt", "t.xlsx", "t"])
def test_unknown_suffix_is_an_error_naming_it(tmp_path, name):
    df = make_frame([_full_row()])
    with pytest.raises(TableError) as info:
        write_table(df, tmp_path / name)
    suffix = name.partition(".")[2]
    assert (suffix and f".{suffix}" in str(info.value)) or (not suffix and "no suffix" in str(info.value))
    assert not (tmp_path / name).exists()
    (tmp_path / name).write_text("name,digest,algo\nw,00,sha256\n")
    with pytest.raises(TableError) as info:
        read_table(tmp_path / name)
    assert str(tmp_path / name) in str(info.value)
    assert (suffix and f".{suffix}" in str(info.value)) or (not suffix and "no suffix" in str(info.value))


def test_missing_file_is_an_error_naming_it(tmp_path):
    p = tmp_path / "nope.csv"
    with pytest.raises(TableError, match="nope.csv"):
        read_table(p)


@pytest.mark.parametrize(("suffix", "content"), [(".csv", ""), (".json", "{not json"), (".parquet", "not parquet"), (".json", '{"name": "w"}')])
def test_unreadable_file_is_a_table_error_naming_it(tmp_path, suffix, content):
    p = tmp_path / f"junk{suffix}"
    p.write_text(content)
    with pytest.raises(TableError) as info:
        read_table(p)
    assert str(p) in str(info.value)


def test_table_error_is_a_wcviz_error():
    assert issubclass(TableError, WcvizError)
    assert issubclass(TableError, ValueError)


# ---------------------------------------------------------------------------- audit: round trips and hostile tables

AWKWARD_NAMES = ["cr\rret", "crlf\r\nx", "\rlead", "trail\r", "new\nline", 'quo"te', "com,ma", " lead", "tab\tx", "\u2028sep", "NA", ""]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_every_name_roundtrips_exactly_even_with_a_bare_carriage_return(tmp_path, suffix):
    """A bare ``\\r`` is a line end to CSV readers: ``wcviz digest --out x.csv`` must quote it, or the table cannot be read back."""
    rows = [_full_row(name=n, host="h\rst" if i == 0 else None) for i, n in enumerate(AWKWARD_NAMES[:-1])]
    df = make_frame(rows)
    back = read_table(write_table(df, tmp_path / f"t{suffix}"))
    pd.testing.assert_frame_equal(back, df, check_exact=True)
    assert back["name"].tolist() == AWKWARD_NAMES[:-1]


def test_csv_text_of_a_table_with_a_carriage_return_reads_back(tmp_path):
    df = make_frame([_full_row(name="a\rb"), _all_na_row("plain")])
    p = tmp_path / "t.csv"
    p.write_text(table_text(df, "csv"))
    pd.testing.assert_frame_equal(read_table(p), df, check_exact=True)


def test_csv_of_a_table_without_carriage_returns_is_unchanged():
    """Quoting every field is kept for tables that need it: other tables are written as before."""
    df = make_frame([_full_row(), _all_na_row("w")])
    text = table_text(df, "csv")
    assert text == df.to_csv(index=False)  # minimal quoting: only "[64, 64]" is quoted
    assert text.count('"') == 2 and text.splitlines()[0] == ",".join(COLUMNS)


HOSTILE_INTS = [1e300, -1e19, 2.0**63, float("inf"), -float("inf"), True, 2**63, -(2**63) - 1, 2**70, 0.5]


@pytest.mark.parametrize("value", HOSTILE_INTS, ids=[repr(v) for v in HOSTILE_INTS])
@pytest.mark.parametrize("col", ["rank", "nbytes"])
def test_integer_columns_refuse_what_is_not_an_int64_without_a_warning(tmp_path, col, value):
    """Checked before any cast: a TableError naming the column, never a numpy RuntimeWarning first."""
    rows = [{"name": "w", "digest": "00" * 16, "algo": "nemo-rl-v3", col: value}]
    p = tmp_path / "t.json"
    p.write_text(json.dumps(rows))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        with pytest.raises(TableError, match=f"column '{col}'") as info:
            read_table(p)
        assert str(p) in str(info.value)
        for frame in (pd.DataFrame(rows), pd.DataFrame(rows, dtype=object)):
            with pytest.raises(TableError, match=f"column '{col}'"):
                validate(frame)


def test_integer_columns_keep_every_int64_exactly():
    """The ends of int64 beside a missing value: read exactly, not through float64."""
    rows = [{"name": "a", "digest": "00" * 16, "algo": "nemo-rl-v3", "step": -(2**63), "rank": 2**63 - 1},
            {"name": "b", "digest": "00" * 16, "algo": "nemo-rl-v3", "step": None, "rank": 2**53 + 1}]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        frame = validate(pd.DataFrame(rows, dtype=object))
        assert frame["step"].tolist() == [-(2**63), pd.NA]
        assert frame["rank"].tolist() == [2**63 - 1, 2**53 + 1]
        assert validate(pd.DataFrame({"name": ["w"], "digest": ["00" * 16], "algo": ["nemo-rl-v3"], "rank": [3.0]}))["rank"].tolist() == [3]


@pytest.mark.parametrize("col", ["rank", "dp", "pp", "tp", "ep"])
def test_a_negative_rank_or_coordinate_is_refused_naming_the_column_and_row(tmp_path, col):
    """Ranks and coordinates count from 0, in a table as in a rank's info (``_fleet.identity_of``): -1 is no rank."""
    from wcviz.sources._fleet import Failed, identity_of

    rows = [_full_row(), _full_row(name="lm_head.weight", **{col: -1})]
    why = rf"column '{col}' holds -1 in row 1, not a coordinate \(0 <= {col} < 2\*\*63\)"
    with pytest.raises(TableError, match=rf"^rows: {why}$"):
        make_frame(rows)
    with pytest.raises(TableError, match=why):
        validate(pd.DataFrame(rows))
    p = tmp_path / "t.csv"
    pd.DataFrame(rows).to_csv(p, index=False)
    with pytest.raises(TableError, match=rf"{p}: {why}"):
        read_table(p)
    with pytest.raises(Failed, match=rf"has {col}=-1, not a coordinate \(0 <= {col} < 2\*\*63\)"):
        identity_of({"role": "engine", "rank": 0, col: -1}, "/v1/info")
    assert make_frame([_full_row(**{col: 0})])[col].tolist() == [0]


def test_cli_compare_of_a_table_with_a_huge_rank_is_one_line_and_exit_2(tmp_path):
    base, bad = tmp_path / "base.csv", tmp_path / "bad.json"
    base.write_text("name,digest,algo\nw," + "0" * 32 + ",nemo-rl-v3\n")
    bad.write_text(json.dumps([{"name": "w", "digest": "0" * 32, "algo": "nemo-rl-v3", "rank": 1e300}]))
    run = subprocess.run([sys.executable, "-m", "wcviz", "compare", str(base), str(bad)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("wcviz: error: "), run.stderr
    assert "bad.json" in run.stderr and "'rank'" in run.stderr


def test_a_csv_header_naming_a_column_twice_is_refused(tmp_path):
    """pandas would read the second as ``digest.1`` and compare the first: which one was meant is unknown."""
    p = tmp_path / "dup.csv"
    p.write_text("name,digest,algo,digest\nw," + "0" * 32 + ",nemo-rl-v3," + "1" * 32 + "\n")
    with pytest.raises(TableError, match="column 'digest' appears more than once") as info:
        read_table(p)
    assert str(p) in str(info.value)


def test_a_legitimate_column_named_like_a_pandas_rename_is_kept(tmp_path):
    p = tmp_path / "ok.csv"
    p.write_text("name,digest,algo,digest.1\nw," + "0" * 32 + ",nemo-rl-v3,note\n")
    assert read_table(p)["digest.1"].tolist() == ["note"]


def test_a_json_record_giving_a_column_twice_is_refused(tmp_path):
    p = tmp_path / "dup.json"
    p.write_text('[{"name":"w","digest":"' + "0" * 32 + '","algo":"nemo-rl-v3"},'
                 '{"name":"v","digest":"' + "1" * 32 + '","algo":"nemo-rl-v3","digest":"' + "0" * 32 + '"}]')  # fmt: skip
    with pytest.raises(TableError, match="record 1 gives column 'digest' more than once") as info:
        read_table(p)
    assert str(p) in str(info.value)


def test_a_frame_with_a_repeated_column_is_refused():
    df = pd.DataFrame([["w", "0" * 32, "nemo-rl-v3", "1" * 32]], columns=["name", "digest", "algo", "digest"])
    with pytest.raises(TableError, match="column 'digest' appears more than once"):
        validate(df)


def test_a_number_beyond_int64_is_named_as_the_table_holds_it_with_no_numpy_warning_first(tmp_path: Path) -> None:
    """A CSV ``rank`` of 1e+300 printed numpy's "invalid value encountered in cast" twice before the error (and
    under ``-W error`` the error named the warning, not the column); an object column holding 1e300 was shown as
    the 40 first digits of ``int(1e300)``."""
    path = tmp_path / "big.csv"
    path.write_text("name,digest,algo,rank\nw," + "0" * 32 + ",nemo-rl-v3,1e+300\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TableError, match=r"column 'rank' holds 1e\+300 in row 0, a number that does not fit in int64"):
            read_table(path)
        df = pd.DataFrame({"name": ["w"], "digest": ["0" * 32], "algo": ["nemo-rl-v3"], "rank": pd.Series([1e300], dtype=object)})
        with pytest.raises(TableError, match=r"column 'rank' holds 1e\+300 in row 0"):
            validate(df)
