"""The ``wcviz`` command: digest and compare, exit statuses 0 / 1 / 2."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from wcviz.cli import main
from wcviz.digest import digest_hex
from wcviz.sim.model import ModelConfig, build_state_dict
from wcviz.sim.model import save_checkpoint as write_sharded
from wcviz.frame import read_table
from wcviz.sources import from_safetensors

VICTIM = "model.layers.1.self_attn.k_proj.weight"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sd():
    return build_state_dict(ModelConfig(vocab=24, hidden=16, layers=2, heads=2, kv_heads=1, intermediate=48))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, sd):
    return write_sharded(sd, tmp_path_factory.mktemp("cli") / "sent")


@pytest.fixture(scope="module")
def served(tmp_path_factory, sd):
    bad = dict(sd)
    bad[VICTIM] = sd[VICTIM].clone()
    bad[VICTIM].view(torch.int16).view(-1)[3] ^= 1
    return write_sharded(bad, tmp_path_factory.mktemp("cli") / "served")


@pytest.fixture(scope="module")
def truth(ckpt):
    return from_safetensors(ckpt, progress=False)


def _run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_clean_error(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("wcviz: error: "), err
    assert "Traceback" not in err
    for f in fragments:
        assert f in lines[0], (f, err)


# ---------------------------------------------------------------------------- digest


def test_digest_table_format(capsys, ckpt, truth):
    rc, out, _ = _run(capsys, "digest", ckpt, "--no-progress")
    assert rc == 0
    for name, digest in zip(truth["name"], truth["digest"]):
        line = next(ln for ln in out.splitlines() if f" {name} " in f" {ln} ")
        assert digest in line
    assert f"{len(truth)} tensors" in out
    assert f"{int(truth['nbytes'].sum()):,} bytes" in out


def test_digest_csv_format(capsys, ckpt, truth):
    rc, out, _ = _run(capsys, "digest", ckpt, "--format", "csv", "--no-progress")
    assert rc == 0
    df = pd.read_csv(io.StringIO(out), dtype=str)
    assert df["name"].tolist() == truth["name"].tolist()
    assert df["digest"].tolist() == truth["digest"].tolist()


def test_digest_json_format(capsys, ckpt, truth):
    rc, out, _ = _run(capsys, "digest", ckpt, "--format", "json", "--no-progress")
    assert rc == 0
    records = json.loads(out)
    assert [r["name"] for r in records] == truth["name"].tolist()
    assert [r["digest"] for r in records] == truth["digest"].tolist()
    assert {r["algo"] for r in records} == {"nemo-rl-v3"}


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".json"])
def test_digest_out_roundtrips_through_read_table(capsys, tmp_path, ckpt, truth, suffix):
    out_file = tmp_path / f"digests{suffix}"
    rc, out, err = _run(capsys, "digest", ckpt, "--out", out_file, "--no-progress")
    assert rc == 0 and out == ""
    assert str(out_file) in err
    back = read_table(out_file)
    pd.testing.assert_frame_equal(back.drop(columns="seconds"), truth.drop(columns="seconds"))
    assert (back["seconds"] >= 0).all()


def test_digest_sha256(capsys, tmp_path, ckpt):
    out_file = tmp_path / "sha.csv"
    rc, _, _ = _run(capsys, "digest", ckpt, "--algo", "sha256", "--out", out_file, "--no-progress")
    assert rc == 0
    back = read_table(out_file)
    ref = from_safetensors(ckpt, algo="sha256", progress=False)
    assert set(back["algo"]) == {"sha256"}
    assert back["digest"].tolist() == ref["digest"].tolist()
    assert all(len(d) == 64 for d in back["digest"])


def test_digest_of_a_single_file(capsys, tmp_path, sd):
    from safetensors.torch import save_file

    p = tmp_path / "one.safetensors"
    save_file({"w": sd["lm_head.weight"]}, str(p))
    rc, out, _ = _run(capsys, "digest", p, "--format", "csv", "--no-progress")
    assert rc == 0
    assert pd.read_csv(io.StringIO(out), dtype=str)["digest"].tolist() == from_safetensors(p, progress=False)["digest"].tolist()


def test_digest_bad_input_exits_2(capsys, tmp_path):
    p = tmp_path / "broken.safetensors"
    p.write_bytes(b"\x00\x01")
    rc, out, err = _run(capsys, "digest", p, "--no-progress")
    assert rc == 2 and out == ""
    _assert_clean_error(err, str(p))


def test_digest_unknown_out_suffix_writes_text(capsys, tmp_path, ckpt, truth):
    out_file = tmp_path / "digests.txt"
    rc, _, _ = _run(capsys, "digest", ckpt, "--out", out_file, "--no-progress")
    assert rc == 0
    text = out_file.read_text()
    assert all(d in text for d in truth["digest"])


# ---------------------------------------------------------------------------- compare


@pytest.fixture(scope="module")
def saved(tmp_path_factory, truth):
    from wcviz.frame import write_table

    d = tmp_path_factory.mktemp("saved")
    return {s: write_table(truth, d / f"sent{s}") for s in (".csv", ".parquet", ".json")}


def test_compare_checkpoint_with_itself_exits_0(capsys, ckpt, truth):
    rc, out, err = _run(capsys, "compare", ckpt, ckpt, "--no-progress")
    assert rc == 0, (out, err)
    assert f"{len(truth)} match" in out
    assert not any(n in out for n in truth["name"])  # matches are not listed without --all


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".json"])
def test_compare_table_with_checkpoint(capsys, saved, ckpt, served, suffix):
    rc, out, err = _run(capsys, "compare", saved[suffix], ckpt, "--no-progress")
    assert rc == 0, (out, err)
    rc, out, err = _run(capsys, "compare", saved[suffix], served, "--no-progress")
    assert rc == 1, (out, err)
    assert VICTIM in out
    assert "mismatch" in out
    assert "1 mismatch" in out


def test_compare_table_with_table(capsys, tmp_path, saved, served):
    from wcviz.frame import write_table

    actual = write_table(from_safetensors(served, progress=False), tmp_path / "served.parquet")
    rc, out, _ = _run(capsys, "compare", saved[".csv"], actual)
    assert rc == 1 and VICTIM in out
    rc, out, _ = _run(capsys, "compare", saved[".csv"], saved[".json"])
    assert rc == 0


def test_compare_all_lists_matches_and_out_writes_verdicts(capsys, tmp_path, ckpt, served, truth):
    out_file = tmp_path / "verdicts.csv"
    rc, out, _ = _run(capsys, "compare", ckpt, served, "--all", "--out", out_file, "--no-progress")
    assert rc == 1
    assert all(n in out for n in truth["name"])
    verdicts = pd.read_csv(out_file, dtype=str)
    assert len(verdicts) == len(truth)
    assert dict(zip(verdicts["name"], verdicts["status"]))[VICTIM] == "mismatch"
    assert (verdicts["status"] != "match").sum() == 1


def test_compare_missing_and_unexpected_exit_1(capsys, tmp_path, truth, saved):
    from wcviz.frame import write_table

    fewer = write_table(truth.iloc[1:], tmp_path / "fewer.csv")
    rc, out, _ = _run(capsys, "compare", saved[".csv"], fewer)
    assert rc == 1 and truth["name"].iloc[0] in out and "missing" in out
    rc, out, _ = _run(capsys, "compare", fewer, saved[".csv"])
    assert rc == 1 and truth["name"].iloc[0] in out and "unexpected" in out


def test_compare_missing_file_exits_2(capsys, tmp_path, ckpt):
    for missing in (tmp_path / "nope.csv", tmp_path / "nope-dir"):
        rc, out, err = _run(capsys, "compare", ckpt, missing, "--no-progress")
        assert rc == 2 and out == ""
        _assert_clean_error(err, str(missing))


def test_compare_corrupt_checkpoint_exits_2(capsys, tmp_path, ckpt, saved):
    bad = tmp_path / "bad.safetensors"
    data = (ckpt / "model-00001-of-00002.safetensors").read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    rc, out, err = _run(capsys, "compare", saved[".csv"], bad, "--no-progress")
    assert rc == 2 and out == ""
    _assert_clean_error(err, str(bad), "truncated")


def test_compare_table_missing_columns_exits_2(capsys, tmp_path, saved):
    bad = tmp_path / "cols.csv"
    pd.read_csv(saved[".csv"], dtype=str).drop(columns="digest").to_csv(bad, index=False)
    rc, out, err = _run(capsys, "compare", bad, saved[".csv"])
    assert rc == 2 and out == ""
    _assert_clean_error(err, str(bad), "digest")


def test_compare_different_algorithms_exits_2(capsys, tmp_path, ckpt, saved):
    rc, out, err = _run(capsys, "compare", saved[".csv"], ckpt, "--algo", "sha256", "--no-progress")
    assert rc == 2 and out == ""
    _assert_clean_error(err, "sha256", "nemo-rl-v3")


def test_compare_checkpoint_uses_the_saved_tables_algorithm(capsys, tmp_path, ckpt, served):
    rc, _, _ = _run(capsys, "digest", ckpt, "--algo", "sha256", "--out", tmp_path / "sha.csv", "--no-progress")
    assert rc == 0 and set(read_table(tmp_path / "sha.csv")["algo"]) == {"sha256"}
    rc, out, err = _run(capsys, "compare", tmp_path / "sha.csv", ckpt, "--no-progress")
    assert rc == 0, err
    rc, out, err = _run(capsys, "compare", tmp_path / "sha.csv", served, "--no-progress")
    assert rc == 1 and VICTIM in out


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


# ---------------------------------------------------------------------------- python -m wcviz


def test_module_entry_point_exit_codes(tmp_path, ckpt, served, saved):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    run = lambda *a: subprocess.run([sys.executable, "-m", "wcviz", *map(str, a)], capture_output=True, text=True, env=env, timeout=120)  # noqa: E731
    differs = run("compare", saved[".csv"], served, "--no-progress")
    assert differs.returncode == 1, differs.stderr
    assert VICTIM in differs.stdout
    bad = run("compare", saved[".csv"], tmp_path / "missing.safetensors", "--no-progress")
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert bad.stderr.startswith("wcviz: error: ") and "Traceback" not in bad.stderr
    assert "missing.safetensors" in bad.stderr


# --------------------------------------------------------------------------- bad input: exit 2 and one line, never a traceback


def _header_file(path: Path, header: bytes | dict) -> Path:
    import struct

    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


BAD_CHECKPOINTS = {
    "dim beyond int64 beside a zero": ({"w": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}}, "does not fit in int64"),
    "dtype that is a list": ({"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, "unknown dtype \\['F32'\\] \\(a JSON list\\)"),
    "dtype that is a dict": ({"w": {"dtype": {"F32": 1}, "shape": [1], "data_offsets": [0, 4]}}, "unknown dtype"),
    "header nested 100,000 deep": (b"[" * 100_000 + b"]" * 100_000, "nests JSON too deeply"),
    "100,000 dimensions": ({"w": {"dtype": "F32", "shape": [1] * 100_000, "data_offsets": [0, 4]}}, "100,000 dimensions"),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_a_hostile_checkpoint_header_exits_2_naming_it(capsys, tmp_path, case):
    header, why = BAD_CHECKPOINTS[case]
    path = _header_file(tmp_path / "bad.safetensors", header)
    for argv in (("digest", path), ("compare", path, path)):
        rc, _, err = _run(capsys, *argv)
        assert rc == 2, (case, argv, err)
        _assert_clean_error(err, "bad.safetensors")
        assert re.search(why, err), err


def test_a_hostile_index_exits_2(capsys, tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
    rc, _, err = _run(capsys, "digest", d)
    assert rc == 2
    _assert_clean_error(err, "index", "nests too deeply")


@pytest.mark.parametrize(
    ("name", "text", "why"),
    [
        ("big.csv", "name,digest,algo,nbytes\nw," + "0" * 32 + ",nemo-rl-v3,99999999999999999999999\n", "does not fit in int64"),
        ("big.json", json.dumps([{"name": "w", "digest": "0" * 32, "algo": "nemo-rl-v3", "rank": 2**70}]), "does not fit in int64"),
        ("deep.json", "[" * 100_000 + "]" * 100_000, "nests too deeply"),
        ("garbage.csv", "name,digest,algo\nw,error,nemo-rl-v3\n", "'error' is not a nemo-rl-v3 digest"),
    ],
)
def test_a_hostile_table_exits_2_naming_it(capsys, tmp_path, name, text, why):
    path = tmp_path / name
    path.write_text(text)
    rc, _, err = _run(capsys, "compare", path, path)
    assert rc == 2
    _assert_clean_error(err, name, why)


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["fetch", "not-a-url"], "'not-a-url' is not an agent URL"),
        (["fetch", "ftp://host:1"], "is not an agent URL"),
        (["fetch", "http://127.0.0.1:9", "--name", "(["], "bad name filter '\\(\\[': missing \\]"),
        (["fetch", "http://127.0.0.1:9", "--name", "(a)\\1"], "bad name filter"),
        (["endstate", "not-a-url", "--yes-reset", "--token", "t"], "is not an agent URL"),
    ],
)
def test_bad_fetch_and_endstate_arguments_exit_2_before_any_request(capsys, argv, why):
    rc, _, err = _run(capsys, *argv)
    assert rc == 2
    _assert_clean_error(err)
    assert re.search(why, err), err


def test_digest_prints_its_table_without_pandas_and_as_pandas_would(tmp_path: Path) -> None:
    """``wcviz digest``'s table is printed from rows (no frame, neither pandas nor torch imported, so it starts
    at once), and it is the text pandas renders for the same rows: names, digests and byte counts as before."""
    import subprocess
    import sys

    from wcviz.frame import make_frame
    from wcviz.sim.model import TINY, build_state_dict, save_checkpoint
    from wcviz.sources import from_safetensors

    ck = save_checkpoint(build_state_dict(TINY), tmp_path / "ck")
    code = (
        "import sys\n"
        "from wcviz.cli import main\n"
        f"rc = main(['digest', {str(ck)!r}, '--no-progress'])\n"
        "print(rc, sorted(m for m in ('torch', 'pandas') if m in sys.modules), file=sys.stderr)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stderr.strip().splitlines()[-1] == "0 []"
    df = from_safetensors(ck, progress=False)
    cols = ["name", "digest", "algo", "dtype", "shape", "nbytes"]
    footer = f"{len(df)} tensors, {int(df['nbytes'].sum()):,} bytes, nemo-rl-v3"
    assert run.stdout == make_frame(df.to_dict("records"))[cols].to_string(index=False) + "\n" + footer + "\n"
    for name, digest in zip(df["name"], df["digest"]):  # every tensor, its digest beside it
        assert re.search(rf"^ *{re.escape(name)} {digest} nemo-rl-v3 ", run.stdout, re.M), name


def test_digest_and_compare_on_safetensors_never_import_torch(tmp_path: Path) -> None:
    """The CLI on checkpoints reads headers, a file and the compiled kernel: torch is never imported, so it
    starts at once; the digests are the ones PyTorch's tensors give (the rest of this file checks them)."""
    import subprocess
    import sys

    from wcviz.sim.model import TINY, build_state_dict, save_checkpoint

    a = save_checkpoint(build_state_dict(TINY), tmp_path / "a")
    b = save_checkpoint(build_state_dict(TINY), tmp_path / "b")
    code = (
        "import sys\n"
        "from wcviz.cli import main\n"
        f"assert main(['digest', {str(a)!r}, '--no-progress', '--out', {str(tmp_path / 'a.csv')!r}]) == 0\n"
        f"assert main(['compare', {str(a)!r}, {str(b)!r}, '--no-progress']) == 0\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"
    from wcviz import read_table
    from wcviz.sources import from_state_dict

    got = read_table(tmp_path / "a.csv").set_index("name")["digest"].to_dict()
    assert got == from_state_dict(build_state_dict(TINY), progress=False).set_index("name")["digest"].to_dict()


# --------------------------------------------------------------------------- what the safetensors library writes


@pytest.mark.parametrize("dtype", ["float8_e4m3fnuz", "float8_e5m2fnuz", "float4_e2m1fn_x2"])
def test_every_dtype_the_safetensors_library_writes_for_pytorch_digests_as_pytorch_loads_it(capsys, tmp_path, dtype):
    """F8_E4M3FNUZ / F8_E5M2FNUZ (ROCm's float8) and F4 were "unknown dtype" to wcviz. F4 counts 4-bit values:
    safetensors writes float4_e2m1fn_x2 [2, 3] as F4 [2, 6] and loads it back as [2, 3], which the digest hashes."""
    from safetensors.torch import load_file, save_file

    t = torch.arange(6 * 64, dtype=torch.uint8).view(getattr(torch, dtype)).view(2, 3, 64)
    path = tmp_path / "w.safetensors"
    save_file({"w": t, "b": torch.ones(3)}, str(path))
    want = {n: digest_hex(x) for n, x in load_file(str(path)).items()}
    assert want["w"] == digest_hex(t)
    rc, out, err = _run(capsys, "digest", path, "--format", "csv", "--no-progress")
    assert rc == 0, err
    got = pd.read_csv(io.StringIO(out), dtype={"digest": str})
    assert dict(zip(got["name"], got["digest"])) == want
    row = got.set_index("name").loc["w"]
    assert row["dtype"] == dtype and row["shape"] == "[2, 3, 64]" and row["nbytes"] == t.numel() * t.element_size()


def test_an_f4_tensor_with_an_odd_last_dimension_and_a_tensor_with_no_name_are_refused_naming_the_file(capsys, tmp_path):
    odd = tmp_path / "odd.safetensors"
    raw = json.dumps({"w": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}).encode()
    odd.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0\0\0")
    from safetensors.torch import save_file

    unnamed = tmp_path / "unnamed.safetensors"
    save_file({"": torch.ones(2), "b": torch.ones(2)}, str(unnamed))  # the library writes and loads it
    for path, why in ((odd, "last dimension must be a multiple of 2"), (unnamed, "a tensor has an empty name")):
        for argv in (("digest", path), ("digest", path, "--format", "csv"), ("compare", path, path)):
            rc, _, err = _run(capsys, *argv, "--no-progress")
            assert rc == 2, (argv, err)
            _assert_clean_error(err, path.name, why)


def test_a_checkpoint_directory_whose_name_ends_like_a_table_is_read_as_a_checkpoint(capsys, tmp_path, sd):
    d = write_sharded(sd, tmp_path / "ck.csv")
    assert d.is_dir()
    rc, out, err = _run(capsys, "compare", d, d, "--no-progress")
    assert rc == 0, err
    assert f"{len(sd)} match" in out


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--models", "llama-3-8B"], "unknown model 'llama-3-8B'"),
        (["--out", "cost.txt"], "unknown table format .txt"),
        (["--plot", "cost.foo"], "matplotlib cannot write foo"),
        (["--out", "no/such/dir/cost.csv"], "does not exist"),
    ],
)
def test_bench_refuses_bad_arguments_before_measuring_anything(capsys, monkeypatch, tmp_path, argv, why):
    import wcviz.bench

    def measured(*a, **k):
        raise AssertionError("measured before the arguments were checked")

    monkeypatch.setattr(wcviz.bench, "throughput", measured)
    monkeypatch.chdir(tmp_path)
    rc, _, err = _run(capsys, "bench", "--quick", *argv)
    assert rc == 2
    _assert_clean_error(err, why)


def test_fetch_with_a_name_filter_that_matches_nothing_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    """A typo in --name printed no row and '1 of 1 ranks answered', exit 0: read as a clean fetch."""
    from wcviz.agent import Agent

    with Agent(lambda: {"model.layers.0.mlp.up_proj.weight": torch.zeros(2)}, role="engine", rank=0) as agent:
        assert main(["fetch", str(agent.url), "--name", r"layers\.99\."]) == 1
        err = capsys.readouterr().err
        assert "no parameter name matches --name 'layers\\\\.99\\\\.' on any of the 1 rank(s) that answered" in err
        assert main(["fetch", str(agent.url), "--name", r"layers\.0\."]) == 0


def test_verify_reads_a_null_num_key_value_heads_as_the_attention_heads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A config.json with "num_key_value_heads": null (as transformers writes it for "as many as the heads") was
    refused saying the checkpoint had no config.json."""
    from wcviz.sim.model import hf_config

    cfg = ModelConfig(vocab=256, hidden=32, layers=2, heads=4, kv_heads=4, intermediate=64)
    write_sharded(build_state_dict(cfg), tmp_path)
    config = hf_config(cfg)
    config["num_key_value_heads"] = None
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc = main(["verify", "http://127.0.0.1:9", "--checkpoint", str(tmp_path), "--tp", "2", "--engine", "vllm", "--timeout", "2"])
    out = capsys.readouterr()
    assert rc == 1 and "heads=4, kv_heads=4" in out.out and "no config.json" not in out.err  # read; the engine is down


@pytest.mark.parametrize("command", ["compare", "digest"])
def test_an_out_path_that_cannot_be_written_is_refused_before_the_digesting(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """compare checked --out only after digesting both sides: exit 2 ("bad input") and no verdicts, where a real
    difference had been found."""
    cfg = ModelConfig(vocab=64, hidden=16, layers=1, heads=2, kv_heads=2, intermediate=32)
    ckpt = tmp_path / "ckpt"
    write_sharded(build_state_dict(cfg), ckpt)
    out = str(tmp_path / "no" / "such" / "dir" / "verdicts.csv")
    argv = ["compare", str(ckpt), str(ckpt), "--out", out] if command == "compare" else ["digest", str(ckpt), "--out", out]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "does not exist or cannot be written" in err
