"""Sources: from_module / from_state_dict / from_safetensors produce schema tables of true digests."""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
import sys
import tracemalloc
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file

import wcviz.sources._safetensors as st
from wcviz._errors import CheckpointError, DigestError, WcvizError
from wcviz.sim.model import ModelConfig, build_state_dict
from wcviz.sim.model import save_checkpoint as write_sharded
from wcviz.digest import digest_hex
from wcviz.frame import COLUMNS, RANK_FIELDS, validate
from wcviz.sources import from_module, from_safetensors, from_state_dict

ALGOS = ("nemo-rl-v3", "sha256")


def _dtype_zoo() -> dict[str, torch.Tensor]:
    """Small tensors of many dtypes, with odd byte counts, a 0-d and empty tensors."""
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "bf16.odd": r(3, 5).bfloat16(),  # 30 bytes
        "f16.odd": r(7).half(),  # 14 bytes
        "f32.odd": r(3),  # 12 bytes
        "f32.scalar": torch.tensor(3.25),  # 0-d
        "f32.empty": torch.zeros(0, 4),
        "bf16.empty": torch.zeros(5, 0, dtype=torch.bfloat16),
        "i64": torch.arange(-2, 3),
        "i64.scalar": torch.tensor(-7),
        "bool.odd": torch.tensor([True, False, True, True, False]),
        "u8.odd": torch.arange(11, dtype=torch.uint8),
        "f8.odd": r(13).to(torch.float8_e4m3fn),
        "f8.scalar": torch.tensor(0.5).to(torch.float8_e4m3fn),
        "i8": torch.arange(-4, 5, dtype=torch.int8),
        "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "f64": r(2, 2).double(),
    }


def _raw_file(path: Path, header: object, data: bytes = b"", hlen: int | None = None) -> Path:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h) if hlen is None else hlen) + h + data)
    return path


def _digests(df: pd.DataFrame) -> dict[str, str]:
    return dict(zip(df["name"], df["digest"]))


@pytest.fixture(scope="module")
def tiny_sd():
    return build_state_dict(ModelConfig(vocab=24, hidden=16, layers=2, heads=2, kv_heads=1, intermediate=48))


# ---------------------------------------------------------------------------- in-memory sources


def test_from_state_dict_digests_and_columns(tiny_sd):
    df = from_state_dict(tiny_sd)
    assert list(df.columns) == list(COLUMNS)
    pd.testing.assert_frame_equal(validate(df), df)
    assert df["name"].tolist() == list(tiny_sd)  # one row per entry, in order
    for _, row in df.iterrows():
        t = tiny_sd[row["name"]]
        assert row["digest"] == digest_hex(t)
        assert row["algo"] == "nemo-rl-v3"
        assert row["dtype"] == "bfloat16"
        assert json.loads(row["shape"]) == list(t.shape)
        assert row["nbytes"] == t.numel() * t.element_size()
        assert row["device"] == "cpu"
        assert row["seconds"] >= 0
    assert (df["role"] == "module").all() and (df["phase"] == "current").all()
    assert df.loc[df["name"] == "model.layers.1.mlp.up_proj.weight", ["layer", "block"]].values.tolist() == [[1, "mlp"]]


def test_from_state_dict_sha256(tiny_sd):
    df = from_state_dict(tiny_sd, algo="sha256")
    assert (df["algo"] == "sha256").all()
    assert all(len(d) == 64 for d in df["digest"])
    assert _digests(df) == {n: digest_hex(t, algo="sha256") for n, t in tiny_sd.items()}


def test_rank_info_is_stamped_on_every_row(tiny_sd):
    info = dict(role="engine", rank=7, dp=1, pp=0, tp=3, ep=2, host="node-3", phase="received", step=42)
    assert set(info) == set(RANK_FIELDS)
    for df in (from_state_dict(tiny_sd, **info), from_module(torch.nn.Linear(2, 3), **info)):
        for k, v in info.items():
            assert (df[k] == v).all(), k


def test_from_state_dict_of_distinct_ranks_and_phases_has_one_row_per_key(tiny_sd):
    frames = [from_state_dict(tiny_sd, rank=r, tp=r, phase=p) for r in (0, 1) for p in ("sent", "received")]
    df = pd.concat(frames, ignore_index=True)
    assert len(df) == 4 * len(tiny_sd)
    assert not df.duplicated(["rank", "name", "phase"]).any()


@pytest.mark.parametrize("source", ["state_dict", "module", "safetensors"])
def test_unknown_rank_fields_are_a_type_error_naming_them(tmp_path, source):
    sd = {"w": torch.zeros(2)}
    with pytest.raises(TypeError) as info:
        if source == "state_dict":
            from_state_dict(sd, rnak=1, gpu=0)
        elif source == "module":
            from_module(torch.nn.Linear(2, 2), rnak=1, gpu=0)
        else:
            save_file(sd, str(tmp_path / "m.safetensors"))
            from_safetensors(tmp_path / "m.safetensors", rnak=1, gpu=0)
    assert "rnak" in str(info.value) and "gpu" in str(info.value)


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.proj = torch.nn.Linear(4, 4)
        self.lm_head = torch.nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.tensor([2.0, 3.0]))


def test_from_module_lists_tied_weights_under_both_names():
    m = _Tied()
    df = from_module(m)
    names = df["name"].tolist()
    assert "embed.weight" in names and "lm_head.weight" in names
    d = _digests(df)
    assert d["embed.weight"] == d["lm_head.weight"] == digest_hex(m.embed.weight)
    assert set(names) == set(m.state_dict(keep_vars=True)) - {"scale"}
    assert (df["role"] == "module").all()
    assert (df["device"] == "cpu").all() and (df["seconds"] >= 0).all()
    assert df.loc[df["name"] == "lm_head.weight", "block"].item() == "head"
    assert df.loc[df["name"] == "embed.weight", "block"].item() == "embed"


def test_from_module_buffers_on_request():
    m = _Tied()
    assert "scale" not in from_module(m)["name"].tolist()
    df = from_module(m, include_buffers=True)
    assert _digests(df)["scale"] == digest_hex(m.scale)


def test_from_module_and_state_dict_agree():
    m = _Tied()
    a = from_module(m, include_buffers=True)
    b = from_state_dict(m.state_dict())
    assert _digests(a) == _digests(b)


def test_non_contiguous_tensor_digests_like_its_copy():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    df = from_state_dict({"t": t.T, "c": t.T.contiguous()})
    assert df["digest"].iloc[0] == df["digest"].iloc[1] == digest_hex(t.T.contiguous())


def test_wrong_argument_types():
    with pytest.raises(TypeError, match="mapping"):
        from_state_dict([("w", torch.zeros(1))])
    with pytest.raises(TypeError, match="Module"):
        from_module({"w": torch.zeros(1)})


@pytest.mark.parametrize(
    "bad",
    [
        lambda: torch.zeros(4, 4).to_sparse(),
        lambda: torch.zeros(4, 4).to_sparse_csr(),
        lambda: torch.empty(4, 4, device="meta"),
    ],
    ids=["sparse_coo", "sparse_csr", "meta"],
)
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support:UserWarning")
def test_sparse_and_meta_tensors_raise_naming_the_tensor(bad):
    sd = {"good.weight": torch.ones(3), "model.layers.0.bad.weight": bad(), "after.weight": torch.ones(2)}
    with pytest.raises(DigestError, match=r"model\.layers\.0\.bad\.weight"):
        from_state_dict(sd)


def test_non_tensor_value_raises_naming_it():
    with pytest.raises(DigestError, match="step_count"):
        from_state_dict({"w": torch.ones(2), "step_count": 3})


# ---------------------------------------------------------------------------- safetensors: digests


@pytest.fixture(scope="module")
def zoo_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("zoo") / "zoo.safetensors"
    save_file(_dtype_zoo(), str(path))
    return path


@pytest.mark.parametrize("algo", ALGOS)
def test_from_safetensors_digests_equal_loaded_tensors(zoo_file, algo):
    df = from_safetensors(zoo_file, algo=algo, progress=False)
    loaded = load_file(str(zoo_file))
    assert sorted(df["name"]) == sorted(loaded)
    assert list(df.columns) == list(COLUMNS)
    pd.testing.assert_frame_equal(validate(df), df)
    for _, row in df.iterrows():
        t = loaded[row["name"]]
        assert row["digest"] == digest_hex(t, algo=algo), row["name"]
        assert row["algo"] == algo
        assert row["dtype"] == str(t.dtype).removeprefix("torch.")
        assert json.loads(row["shape"]) == list(t.shape)
        assert row["nbytes"] == t.numel() * t.element_size()
        assert row["device"] == "cpu"
        assert row["seconds"] >= 0
    assert (df["role"] == "checkpoint").all() and (df["phase"] == "current").all()
    assert df["rank"].isna().all() and df["tp"].isna().all()


def test_from_safetensors_matches_from_state_dict(zoo_file):
    assert _digests(from_safetensors(zoo_file, progress=False)) == _digests(from_state_dict(_dtype_zoo()))


def test_from_safetensors_rank_info(zoo_file):
    df = from_safetensors(zoo_file, role="engine", rank=3, tp=1, host="n1", step=9, progress=False)
    assert (df["role"] == "engine").all() and (df["rank"] == 3).all() and (df["tp"] == 1).all()
    assert (df["host"] == "n1").all() and (df["step"] == 9).all()


class _AdviceSpy:
    """Stands in for an ``mmap.mmap``: records the advice it is given, refusing what it is told to refuse."""

    def __init__(self, refuse: tuple[int, ...] = ()) -> None:
        self.given: list[int] = []
        self.refuse = refuse

    def madvise(self, advice: int) -> None:
        self.given.append(advice)
        if advice in self.refuse:
            raise OSError(22, "Invalid argument")


def test_mapping_advice_asks_for_readahead_and_2mib_folios():
    import mmap

    wanted = [getattr(mmap, n) for n in ("MADV_HUGEPAGE", "MADV_SEQUENTIAL") if hasattr(mmap, n)]
    spy = _AdviceSpy()
    st._advise(spy)
    assert spy.given == wanted
    if sys.platform == "linux":
        assert mmap.MADV_HUGEPAGE in spy.given and mmap.MADV_SEQUENTIAL in spy.given


def test_mapping_advice_the_os_refuses_changes_nothing_read(zoo_file, monkeypatch):
    """A kernel without transparent huge pages answers EINVAL: the other advice is still given, and the digests
    are the same as with every piece of advice taken."""
    import mmap

    hugepage = getattr(mmap, "MADV_HUGEPAGE", -1)
    spy = _AdviceSpy(refuse=(hugepage,))
    st._advise(spy)  # does not raise
    assert spy.given[-1] == getattr(mmap, "MADV_SEQUENTIAL", spy.given[-1])
    st._advise(object())  # an mmap without madvise (older Pythons, other systems): nothing to do
    want = _digests(from_safetensors(zoo_file, progress=False))
    real = st._advise

    def refusing(mm):  # type: ignore[no-untyped-def]
        real(_AdviceSpy(refuse=(hugepage,)))  # what a refusing kernel leaves: no advice on the real map

    monkeypatch.setattr(st, "_advise", refusing)
    assert _digests(from_safetensors(zoo_file, progress=False)) == want


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps to see a mapping's flags")
def test_the_reader_s_mapping_carries_the_advice(zoo_file, monkeypatch):
    """On Linux the live mapping shows the advice in its ``VmFlags``: ``sr`` (read sequentially) always, ``hg``
    (2 MiB folios) where the kernel has transparent huge pages."""
    seen: list[set[str]] = []
    real = st._mapped

    @contextlib.contextmanager
    def watching(f):  # type: ignore[no-untyped-def]
        with real(f) as data:
            if data is not None:
                seen.append(_vm_flags(data.ctypes.data))
            yield data

    monkeypatch.setattr(st, "_mapped", watching)
    from_safetensors(zoo_file, progress=False)
    assert seen and "sr" in seen[0], seen
    if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        assert "hg" in seen[0], seen


def _vm_flags(address: int) -> set[str]:
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            inside = lo <= address < hi
        elif inside and head[:1] == ["VmFlags:"]:
            return set(head[1:])
    return set()


def test_every_value_bit_matters(tmp_path):
    a = {"w": torch.arange(9, dtype=torch.int16)}
    b = {"w": a["w"].clone()}
    b["w"][8] ^= 1
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    for algo in ALGOS:
        da = from_safetensors(tmp_path / "a.safetensors", algo=algo, progress=False)["digest"].item()
        db = from_safetensors(tmp_path / "b.safetensors", algo=algo, progress=False)["digest"].item()
        assert da != db


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tiny_sd):
    return write_sharded(tiny_sd, tmp_path_factory.mktemp("ck") / "sharded", shards=3)


def test_directory_with_index(sharded, tiny_sd):
    df = from_safetensors(sharded, progress=False)
    assert len(df) == len(tiny_sd)
    assert _digests(df) == {n: digest_hex(t) for n, t in tiny_sd.items()}


def test_index_file_path(sharded, tiny_sd):
    df = from_safetensors(sharded / "model.safetensors.index.json", progress=False)
    assert _digests(df) == {n: digest_hex(t) for n, t in tiny_sd.items()}


def test_directory_without_index(tmp_path, sharded, tiny_sd):
    d = tmp_path / "noindex"
    shutil.copytree(sharded, d)
    (d / "model.safetensors.index.json").unlink()
    df = from_safetensors(d, progress=False)
    assert len(df) == len(tiny_sd)
    assert _digests(df) == {n: digest_hex(t) for n, t in tiny_sd.items()}


def test_index_uses_only_the_listed_shards(tmp_path, sharded, tiny_sd):
    d = tmp_path / "extra"
    shutil.copytree(sharded, d)
    save_file({"stray": torch.zeros(2)}, str(d / "unrelated.safetensors"))
    assert "stray" not in from_safetensors(d, progress=False)["name"].tolist()


def test_single_file_and_shards_agree(tmp_path, sharded, tiny_sd):
    save_file({k: v.contiguous() for k, v in tiny_sd.items()}, str(tmp_path / "one.safetensors"))
    assert _digests(from_safetensors(tmp_path / "one.safetensors", progress=False)) == _digests(from_safetensors(sharded, progress=False))


# ---------------------------------------------------------------------------- safetensors: lazy reading


@pytest.fixture(scope="module")
def many_tensor_file(tmp_path_factory):
    """16 tensors of 64 KiB (1 MiB of data); the largest single tensor is 64 KiB."""
    sd = {f"model.layers.{i}.mlp.up_proj.weight": torch.full((16384,), float(i)) for i in range(16)}
    path = tmp_path_factory.mktemp("big") / "many.safetensors"
    save_file(sd, str(path))
    return path, 16384 * 4


def test_reads_one_tensor_at_a_time(monkeypatch, many_tensor_file):
    path, largest = many_tensor_file
    sizes = []
    real = st.digest_buffers

    def spy(buffers, **k):
        def seen():
            for raw, *rest in buffers:
                sizes.append(raw.nbytes)
                yield (raw, *rest)

        return real(seen(), **k)

    monkeypatch.setattr(st, "digest_buffers", spy)
    reads = []
    real_open = open

    class Handle:
        def __init__(self, f):
            self._f = f

        def read(self, n=-1):
            out = self._f.read(n)
            reads.append(len(out))
            return out

        def readinto(self, b):
            got = self._f.readinto(b)
            reads.append(got)
            return got

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    monkeypatch.setattr(st, "open", lambda *a, **k: Handle(real_open(*a, **k)), raising=False)
    df = from_safetensors(path, progress=False)
    assert len(df) == 16
    assert len(sizes) == 16 and max(sizes) <= largest + 8
    assert reads and max(reads) <= largest  # no read of the whole file (or of more than one tensor)


def test_peak_memory_is_far_below_file_size(many_tensor_file):
    path, largest = many_tensor_file
    from_safetensors(path, progress=False)  # warm up imports and JIT caches outside the measurement
    tracemalloc.start()
    try:
        df = from_safetensors(path, progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = path.stat().st_size
    assert len(df) == 16
    assert peak < size / 4, f"peak {peak} bytes for a {size}-byte file"
    assert peak < 4 * largest


# ---------------------------------------------------------------------------- safetensors: bad input


def _good(tmp_path: Path) -> Path:
    p = tmp_path / "good.safetensors"
    save_file({"alpha": torch.arange(4, dtype=torch.float32), "beta": torch.arange(6, dtype=torch.int16)}, str(p))
    return p


def _truncated_mid_data(tmp_path):
    full = _good(tmp_path).read_bytes()
    p = tmp_path / "trunc.safetensors"
    p.write_bytes(full[:-3])
    return p, ["truncated", "'beta'"]


def _shorter_than_8(tmp_path):
    p = tmp_path / "tiny.safetensors"
    p.write_bytes(b"\x05\x00\x00")
    return p, ["truncated"]


def _empty_file(tmp_path):
    p = tmp_path / "empty.safetensors"
    p.write_bytes(b"")
    return p, []


def _header_longer_than_file(tmp_path):
    return _raw_file(tmp_path / "hlen.safetensors", {}, hlen=10_000), ["header length"]


def _header_not_json(tmp_path):
    p = tmp_path / "nojson.safetensors"
    p.write_bytes(struct.pack("<Q", 6) + b"{oops!")
    return p, ["JSON"]


def _header_not_object(tmp_path):
    return _raw_file(tmp_path / "list.safetensors", [1, 2]), ["list"]


def _span_wrong(tmp_path):
    return _raw_file(tmp_path / "span.safetensors", {"w.span": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}, b"\0" * 12), ["'w.span'", "12"]


def _end_beyond_file(tmp_path):
    return _raw_file(tmp_path / "end.safetensors", {"w.end": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8), ["'w.end'"]


def _overlap(tmp_path):
    hdr = {
        "w.one": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "w.two": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    return _raw_file(tmp_path / "ovl.safetensors", hdr, b"\0" * 12), ["'w.one'", "'w.two'", "overlap"]


def _raw_text(path: Path, header: str, data: bytes = b"") -> Path:
    """A file whose header is ``header`` verbatim (JSON that ``json.dumps`` cannot write, such as a repeated key)."""
    h = header.encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


def _tensor_named_twice(tmp_path):
    # json.loads keeps the second entry: the first one's bytes (all 0x01) would never be digested
    hdr = '{"w.twice":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w.twice":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}'
    return _raw_text(tmp_path / "twice.safetensors", hdr, b"\x01" * 4 + b"\0" * 4), ["'w.twice'", "more than once"]


def _entry_field_twice(tmp_path):
    hdr = '{"w.field":{"dtype":"F32","dtype":"I32","shape":[1],"data_offsets":[0,4]}}'
    return _raw_text(tmp_path / "field.safetensors", hdr, b"\0" * 4), ["'w.field'", "'dtype'", "more than once"]


def _gap_between_tensors(tmp_path):
    hdr = {"w.a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "w.b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}
    return _raw_file(tmp_path / "gap.safetensors", hdr, b"\0" * 12), ["'w.a'", "'w.b'", "4-8", "not fully covered"]


def _gap_at_start(tmp_path):
    hdr = {"w.late": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}
    return _raw_file(tmp_path / "late.safetensors", hdr, b"\0" * 8), ["'w.late'", "0-4", "not fully covered"]


def _trailing_bytes(tmp_path):
    hdr = {"w.last": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    return _raw_file(tmp_path / "trail.safetensors", hdr, b"\0" * 4 + b"junk"), ["'w.last'", "4 trailing bytes", "not fully covered"]


def _metadata_not_a_mapping(tmp_path):
    hdr = {"__metadata__": [1, 2], "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    return _raw_file(tmp_path / "meta.safetensors", hdr, b"\0" * 4), ["__metadata__", "list"]


def _metadata_value_not_a_string(tmp_path):
    hdr = {"__metadata__": {"format": "pt", "step": 7}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    return _raw_file(tmp_path / "meta2.safetensors", hdr, b"\0" * 4), ["__metadata__", "'step'", "not a string"]


def _shape_past_python_s_digit_limit(tmp_path):
    # json.loads refuses an integer of more than 4300 digits with a plain ValueError
    hdr = '{"w.big":{"dtype":"U8","shape":[1' + "0" * 5000 + '],"data_offsets":[0,1]}}'
    return _raw_text(tmp_path / "bigint.safetensors", hdr, b"\0"), ["cannot be read", "4300 digits"]


def _name_with_a_lone_surrogate(tmp_path):
    # a \ud800 escape is valid JSON to Python but no UTF-8 text: the name could be neither printed nor digested
    hdr = '{"w.\\ud800x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    return _raw_text(tmp_path / "surrogate.safetensors", hdr, b"\0"), [repr("w.\ud800x"), "lone surrogate"]


def _metadata_with_a_lone_surrogate(tmp_path):
    hdr = '{"__metadata__":{"format":"p\\udc80t"},"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    return _raw_text(tmp_path / "meta3.safetensors", hdr, b"\0"), ["__metadata__", "lone surrogate"]


def _header_in_utf16(tmp_path):
    # json.loads(bytes) guesses UTF-16 from the zero bytes; a safetensors header is UTF-8
    h = json.dumps({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}).encode("utf-16-le")
    p = tmp_path / "utf16.safetensors"
    p.write_bytes(struct.pack("<Q", len(h)) + h + b"\0")
    return p, ["not valid JSON"]


def _offsets_backwards(tmp_path):
    return _raw_file(tmp_path / "back.safetensors", {"w.back": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}}, b"\0" * 4), ["'w.back'"]


def _unknown_dtype(tmp_path):
    return _raw_file(tmp_path / "dt.safetensors", {"w.dt": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2), ["'w.dt'", "Q9"]


def _entry_missing_fields(tmp_path):
    return _raw_file(tmp_path / "fields.safetensors", {"w.f": {"dtype": "F32"}}), ["'w.f'"]


def _bad_shape(tmp_path):
    return _raw_file(tmp_path / "shape.safetensors", {"w.s": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}), ["'w.s'"]


def _no_tensors(tmp_path):
    return _raw_file(tmp_path / "none.safetensors", {"__metadata__": {"format": "pt"}}), ["no tensors"]


def _empty_dir(tmp_path):
    d = tmp_path / "emptydir"
    d.mkdir()
    (d / "README.md").write_text("not weights")
    return d, []


def _does_not_exist(tmp_path):
    return tmp_path / "nowhere" / "model.safetensors", []


def _shard_dir(tmp_path):
    sd = {f"model.layers.{i}.mlp.up_proj.weight": torch.full((3,), float(i)) for i in range(4)}
    return write_sharded(sd, tmp_path / "shards", shards=2)


def _index_missing_shard(tmp_path):
    d = _shard_dir(tmp_path)
    (d / "model-00002-of-00002.safetensors").unlink()
    return d, ["model.safetensors.index.json", "model-00002-of-00002.safetensors"]


def _index_names_absent_tensor(tmp_path):
    d = _shard_dir(tmp_path)
    idx = d / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    data["weight_map"]["model.ghost.weight"] = "model-00001-of-00002.safetensors"
    idx.write_text(json.dumps(data))
    return d, ["model.safetensors.index.json", "'model.ghost.weight'"]


def _index_wrong_shard(tmp_path):
    d = _shard_dir(tmp_path)
    idx = d / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    data["weight_map"]["model.layers.0.mlp.up_proj.weight"] = "model-00002-of-00002.safetensors"
    idx.write_text(json.dumps(data))
    return d, ["'model.layers.0.mlp.up_proj.weight'"]


def _index_not_json(tmp_path):
    d = _shard_dir(tmp_path)
    (d / "model.safetensors.index.json").write_text("{nope")
    return d, ["model.safetensors.index.json"]


def _index_points_outside(tmp_path):
    d = _shard_dir(tmp_path)
    idx = d / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    data["weight_map"]["model.layers.0.mlp.up_proj.weight"] = "../elsewhere.safetensors"
    idx.write_text(json.dumps(data))
    return d, ["model.safetensors.index.json", "'../elsewhere.safetensors'"]


def _index_names_a_tensor_twice(tmp_path):
    d = _shard_dir(tmp_path)
    idx = d / "model.safetensors.index.json"
    name = "model.layers.0.mlp.up_proj.weight"
    text = idx.read_text()
    entry = json.dumps(name) + ": " + json.dumps(json.loads(text)["weight_map"][name])
    assert entry in text  # json.loads would keep only the second one: which shard holds it would be a silent guess
    idx.write_text(text.replace(entry, entry + ", " + json.dumps(name) + ': "model-00002-of-00002.safetensors"', 1))
    return d, ["model.safetensors.index.json", f"{name!r}", "more than once"]


def _index_with_text(tmp_path, edit):
    d = _shard_dir(tmp_path)
    idx = d / "model.safetensors.index.json"
    idx.write_text(edit(idx.read_text()))
    return d


def _index_past_python_s_digit_limit(tmp_path):
    d = _index_with_text(tmp_path, lambda t: t.replace('"weight_map"', '"total": 1' + "0" * 5000 + ', "weight_map"', 1))
    return d, ["model.safetensors.index.json", "not a readable index", "4300 digits"]


def _index_names_a_tensor_with_a_lone_surrogate(tmp_path):
    d = _index_with_text(tmp_path, lambda t: t.replace('"model.layers.0.mlp.up_proj.weight"', '"model.layers.0.\\ud800"', 1))
    return d, ["model.safetensors.index.json", repr("model.layers.0.\ud800"), "lone surrogate"]


def _index_names_a_shard_with_a_lone_surrogate(tmp_path):
    d = _index_with_text(tmp_path, lambda t: t.replace('"model-00001-of-00002.safetensors"', '"model-\\udc80.safetensors"', 1))
    return d, ["model.safetensors.index.json", repr("model-\udc80.safetensors"), "lone surrogate"]


def _duplicate_across_shards(tmp_path):
    d = _shard_dir(tmp_path)
    (d / "model.safetensors.index.json").unlink()
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(3)}, str(d / "zz-extra.safetensors"))
    return d, ["'model.layers.0.mlp.up_proj.weight'", "zz-extra.safetensors"]


def _corrupt_second_shard(tmp_path):
    d = _shard_dir(tmp_path)
    shard = d / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-5])
    return d, ["model-00002-of-00002.safetensors", "truncated"]


REFUSED_BY_SAFETENSORS = [
    _tensor_named_twice,
    _entry_field_twice,
    _gap_between_tensors,
    _gap_at_start,
    _trailing_bytes,
    _metadata_not_a_mapping,
    _metadata_value_not_a_string,
    _shape_past_python_s_digit_limit,
    _name_with_a_lone_surrogate,
    _metadata_with_a_lone_surrogate,
    _header_in_utf16,
]

BAD = [
    _truncated_mid_data,
    _shorter_than_8,
    _empty_file,
    _header_longer_than_file,
    _header_not_json,
    _header_not_object,
    _span_wrong,
    _end_beyond_file,
    _overlap,
    _offsets_backwards,
    *REFUSED_BY_SAFETENSORS,
    _unknown_dtype,
    _entry_missing_fields,
    _bad_shape,
    _no_tensors,
    _empty_dir,
    _does_not_exist,
    _index_missing_shard,
    _index_names_absent_tensor,
    _index_wrong_shard,
    _index_not_json,
    _index_points_outside,
    _index_names_a_tensor_twice,
    _index_past_python_s_digit_limit,
    _index_names_a_tensor_with_a_lone_surrogate,
    _index_names_a_shard_with_a_lone_surrogate,
    _duplicate_across_shards,
    _corrupt_second_shard,
]


@pytest.mark.parametrize("make", BAD, ids=[f.__name__.strip("_") for f in BAD])
def test_bad_checkpoints_raise_naming_file_and_tensor(tmp_path, monkeypatch, make):
    path, fragments = make(tmp_path)
    calls = []
    real = st.digest_buffers
    monkeypatch.setattr(st, "digest_buffers", lambda buffers, **k: real((calls.append(1) or b for b in buffers), **k))
    result = None
    with pytest.raises(CheckpointError) as info:
        result = from_safetensors(path, progress=False)
    assert result is None  # never a partial table
    assert calls == []  # every header is checked before any tensor is digested
    msg = str(info.value)
    assert isinstance(info.value, WcvizError)
    assert str(path) in msg, msg
    for frag in fragments:
        assert frag in msg, (frag, msg)
    assert "\n" not in msg




@pytest.mark.parametrize("make", REFUSED_BY_SAFETENSORS, ids=[f.__name__.strip("_") for f in REFUSED_BY_SAFETENSORS])
def test_wcviz_refuses_what_the_safetensors_library_refuses(tmp_path, make):
    """The rules above are the library's own (contiguous offsets from 0 to the end of the file, a str -> str
    ``__metadata__``, one entry per name): it refuses each of these files too."""
    import safetensors

    path, _ = make(tmp_path)
    with pytest.raises(safetensors.SafetensorError):
        safetensors.deserialize(path.read_bytes())


def test_files_the_safetensors_library_writes_are_read_whole(tmp_path):
    """Headers padded to 8 bytes by every amount, metadata, empty tensors sharing an offset: all read, every tensor."""
    for n in range(1, 9):
        p = tmp_path / f"lib{n}.safetensors"
        sd = {"w" * n: torch.arange(n, dtype=torch.float32), "empty.a": torch.zeros(0, 3), "empty.b": torch.zeros(2, 0, dtype=torch.int8),
              "mask": torch.ones(n, dtype=torch.bool), "h": torch.arange(3 * n, dtype=torch.bfloat16)}  # fmt: skip
        save_file(sd, str(p), metadata={"format": "pt", "note": "x" * n})
        hlen = struct.unpack("<Q", p.read_bytes()[:8])[0]
        assert hlen % 8 == 0
        entries = st.read_header(p)
        assert sorted(e.name for e in entries) == sorted(sd)
        assert _digests(from_safetensors(p, progress=False)) == _digests(from_state_dict(load_file(str(p))))


def test_file_truncated_while_reading_raises_naming_tensor(tmp_path, monkeypatch):
    """If the data is gone by the time it is read, the short read is caught too: no partial table."""
    p = tmp_path / "race.safetensors"
    save_file({"a.first": torch.arange(8, dtype=torch.float32), "b.second": torch.arange(8, dtype=torch.float32)}, str(p))
    real = st.read_header

    def read_then_truncate(path):
        entries = real(path)
        Path(path).write_bytes(Path(path).read_bytes()[:-4])
        return entries

    monkeypatch.setattr(st, "read_header", read_then_truncate)
    with pytest.raises(CheckpointError) as info:
        from_safetensors(p, progress=False)
    assert str(p) in str(info.value) and "'b.second'" in str(info.value) and "truncated" in str(info.value)


def test_checkpoint_error_is_a_wcviz_error():
    assert issubclass(CheckpointError, WcvizError) and issubclass(CheckpointError, ValueError)
    assert issubclass(DigestError, WcvizError)
