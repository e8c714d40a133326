"""Fuzzing what reads untrusted bytes: every input is either read or refused with wcviz's own error, never a crash.

A checkpoint header and index, a saved table, an agent's query string, a Host header,
a name filter and a refit control message all come from outside the process. Each
property below says: whatever hypothesis makes of them, the reader answers with a
result or with the one error class its callers catch (and the CLI turns into exit 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import string
import struct
from pathlib import Path
from typing import Any

import httpx
import pytest
import safetensors
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wcviz._errors import CheckpointError, TableError
from wcviz._names import NameFilterError, name_filter
from wcviz.agent import Agent, _host_of
from wcviz.frame import read_table
from wcviz.refit import RefitProtocolError
from wcviz.refit._shm import BufferHandle, HandleError
from wcviz.refit._control import _decode
from wcviz.sources._safetensors import checkpoint_files, from_safetensors, read_header

EXAMPLES = int(os.environ.get("WCVIZ_FUZZ_EXAMPLES", "150"))  # raise it for a long run; CI keeps the suite quick
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
DTYPE_CODES = st.sampled_from(["F32", "BF16", "I64", "BOOL", "F8_E4M3", "C64", "X", ""]) | json_values
entries = st.fixed_dictionaries(
    {"dtype": DTYPE_CODES, "shape": st.lists(st.integers(min_value=-2, max_value=2**64), max_size=4) | json_values,
     "data_offsets": st.lists(st.integers(min_value=-2, max_value=2**64), max_size=3) | json_values},
)  # fmt: skip
headers = st.dictionaries(st.text(max_size=10), entries | json_values, max_size=4)


def _write(tmp: Path, header: bytes, data: bytes = b"") -> Path:
    path = tmp / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@FUZZ
@given(raw=st.binary(max_size=300))
def test_arbitrary_bytes_as_a_checkpoint(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(raw)
    with contextlib.suppress(CheckpointError):  # refused, naming the file: that is the contract
        read_header(path)


@FUZZ
@given(header=headers, data=st.binary(max_size=64))
def test_arbitrary_json_headers(tmp_path: Path, header: dict[str, Any], data: bytes) -> None:
    path = _write(tmp_path, json.dumps(header).encode(), data)
    try:
        entries = read_header(path)
    except CheckpointError:
        return
    for e in entries:  # what was accepted is consistent with the file
        assert e.start + e.nbytes <= path.stat().st_size
    _agrees_with_the_library(path, entries)
    table = from_safetensors(path, progress=False) if entries else None
    assert table is None or len(table) == len(entries)


def _agrees_with_the_library(path: Path, entries: list[Any]) -> None:
    """What wcviz accepted, the safetensors library reads too, as the same tensors over the same bytes."""
    raw = path.read_bytes()
    lib = dict(safetensors.deserialize(raw))  # raises if the library refuses what wcviz accepted
    assert sorted(lib) == sorted(e.name for e in entries)
    for e in entries:
        assert list(e.shape) == lib[e.name]["shape"]
        assert bytes(lib[e.name]["data"]) == raw[e.start : e.start + e.nbytes]


def _object_text(pairs: list[tuple[str, Any]]) -> str:
    """A JSON object written pair by pair: a key may repeat (``json.dumps`` of a dict cannot write that)."""
    return "{" + ",".join(f"{json.dumps(k)}:{v if isinstance(v, str) else json.dumps(v)}" for k, v in pairs) + "}"


@st.composite
def _tiled_headers(draw: Any) -> tuple[bytes, bytes, list[str]]:
    """A header whose tensors tile the data (the valid layout), with names drawn from a few so that some repeat,
    an entry that may give a field twice, and sometimes a gap, trailing bytes or padding to 8 bytes."""
    names = draw(st.lists(st.sampled_from(["a", "b", "c", "__metadata__"]), max_size=5))
    pairs: list[tuple[str, Any]] = []
    offset = 0
    for name in names:
        if name == "__metadata__":
            meta = draw(st.dictionaries(st.sampled_from(["format", "k"]), st.sampled_from(["pt", "x"]) | json_values, max_size=2))
            pairs.append((name, json.dumps(meta)))
            continue
        code, size = draw(st.sampled_from([("F32", 4), ("U8", 1), ("BF16", 2), ("I64", 8)]))
        shape = draw(st.lists(st.integers(0, 3), max_size=2))
        nbytes = size * math.prod(shape)
        begin = offset + draw(st.sampled_from([0, 0, 0, 1]))  # mostly contiguous, sometimes a gap
        fields = [("dtype", json.dumps(code)), ("shape", json.dumps(shape)), ("data_offsets", json.dumps([begin, begin + nbytes]))]
        if draw(st.booleans()) and draw(st.booleans()):
            fields.append(draw(st.sampled_from(fields)))  # a field given twice
        pairs.append((name, _object_text(fields)))
        offset = begin + nbytes
    text = _object_text(pairs)
    if draw(st.booleans()):
        text += " " * (-len(text) % 8)  # as the library pads its headers
    data = draw(st.binary(min_size=offset, max_size=offset)) + b"\0" * draw(st.sampled_from([0, 0, 1]))
    return text.encode(), data, names


@FUZZ
@given(case=_tiled_headers())
def test_headers_with_repeated_keys_are_refused_and_the_rest_agree_with_the_library(tmp_path: Path, case: tuple[bytes, bytes, list[str]]) -> None:
    """A tensor named twice (json keeps the last: the first one's bytes would go undigested) is refused naming it;
    whatever is accepted lists one entry per name written and is what the safetensors library reads."""
    header, data, names = case
    path = _write(tmp_path, header, data)
    repeated = sorted({n for n in names if names.count(n) > 1})
    try:
        entries = read_header(path)
    except CheckpointError as e:
        assert str(path) in str(e)
        if repeated:
            assert "more than once" in str(e) and any(repr(n) in str(e) or n == "__metadata__" for n in repeated), str(e)
        return
    assert not repeated, f"accepted a header naming {repeated} twice"
    assert sorted(e.name for e in entries) == sorted(n for n in names if n != "__metadata__")
    _agrees_with_the_library(path, entries)


any_text = st.text(alphabet=st.characters(exclude_categories=()), max_size=6)  # lone surrogates included
digits = st.sampled_from([1, 2, 4300, 4301, 6000])  # Python's json refuses an integer of more than 4300 digits


@FUZZ
@given(name=any_text, meta=any_text, n=digits, raw_utf8=st.booleans())
def test_headers_python_or_the_library_cannot_read_are_refused(tmp_path: Path, name: str, meta: str, n: int, raw_utf8: bool) -> None:
    """Names with lone surrogates (as ``\\ud800`` escapes, or as their bytes) and numbers past Python's digit limit:
    refused naming the file, or read as the safetensors library reads them."""
    def text(s: str) -> bytes:  # raw_utf8: a surrogate as its (invalid) UTF-8 bytes, else as a JSON escape
        return json.dumps(s, ensure_ascii=not raw_utf8).encode("utf-8", "surrogatepass")

    shape = b"1" + b"0" * (n - 1)
    header = b'{"__metadata__": {"k": ' + text(meta) + b"}, " + text(name) + b': {"dtype": "U8", "shape": [' + shape + b'], "data_offsets": [0, 1]}}'
    path = _write(tmp_path, header, b"\0")
    try:
        entries = read_header(path)
    except CheckpointError as e:
        assert str(path) in str(e)
        return
    _agrees_with_the_library(path, entries)


@FUZZ
@given(name=any_text, shard=any_text, n=digits)
def test_index_files_python_cannot_read_are_refused(tmp_path: Path, name: str, shard: str, n: int) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(
        f'{{"metadata": {{"total_size": 1{"0" * (n - 1)}}}, "weight_map": {{{json.dumps(name)}: {json.dumps(shard)}}}}}'
    )
    try:
        checkpoint_files(tmp_path)
    except CheckpointError as e:
        assert "model.safetensors.index.json" in str(e)


@FUZZ
@given(index=json_values)
def test_arbitrary_index_files(tmp_path: Path, index: Any) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with contextlib.suppress(CheckpointError):
        checkpoint_files(tmp_path)


@FUZZ
@given(names=st.lists(st.sampled_from(["w.a", "w.b", "w.c"]), min_size=1, max_size=4))
def test_index_files_naming_a_tensor_twice_are_refused(tmp_path: Path, names: list[str]) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": ' + _object_text([(n, json.dumps("x.safetensors")) for n in names]) + "}"
    )
    repeated = {n for n in names if names.count(n) > 1}
    try:
        files = checkpoint_files(tmp_path)
    except CheckpointError as e:
        assert bool(repeated) == ("more than once" in str(e)), str(e)
        assert not repeated or any(repr(n) in str(e) for n in repeated), str(e)
        return
    pytest.fail(f"accepted {files}: the shard the index names is missing")


@FUZZ
@given(text=st.text(alphabet=string.printable, max_size=200), suffix=st.sampled_from([".csv", ".json"]))
def test_arbitrary_tables(tmp_path: Path, text: str, suffix: str) -> None:
    path = tmp_path / f"t{suffix}"
    path.write_text(text)
    with contextlib.suppress(TableError):
        read_table(path)


@FUZZ
@given(rows=st.lists(st.dictionaries(st.sampled_from(["name", "digest", "algo", "rank", "tp", "nbytes", "shape"]), json_values, max_size=7), max_size=4))
def test_arbitrary_json_tables(tmp_path: Path, rows: list[dict[str, Any]]) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(rows))
    with contextlib.suppress(TableError):
        read_table(path)


AGENT = Agent(lambda: {"model.layers.0.mlp.up_proj.weight": torch.ones(2), "lm_head.weight": torch.zeros(3)}, role="engine", rank=0)


@settings(max_examples=EXAMPLES, deadline=None)
@given(query=st.lists(st.tuples(st.sampled_from(["name", "nme", "x"]), st.text(max_size=40)), max_size=3))
def test_arbitrary_agent_queries_are_answered_200_or_400(query: list[tuple[str, str]]) -> None:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=AGENT.app), base_url="http://127.0.0.1") as c:
            return await c.get("/v1/digests", params=query)

    r = asyncio.run(go())
    assert r.status_code in (200, 400), r.text
    assert isinstance(r.json(), dict)


@settings(max_examples=2 * EXAMPLES, deadline=None)
@given(value=st.text(max_size=40))
def test_arbitrary_host_headers(value: str) -> None:
    host = _host_of(value)
    assert host is None or (isinstance(host, str) and host == host.lower())


@settings(max_examples=2 * EXAMPLES, deadline=None)
@given(pattern=st.text(max_size=30), name=st.text(max_size=30))
def test_arbitrary_name_filters(pattern: str, name: str) -> None:
    try:
        keep = name_filter(pattern)
    except NameFilterError:
        return
    assert keep is not None and isinstance(keep(name), bool)


@settings(max_examples=2 * EXAMPLES, deadline=None)
@given(message=json_values | st.binary(max_size=40))
def test_arbitrary_refit_control_messages(message: Any) -> None:
    raw = message if isinstance(message, bytes) else json.dumps(message).encode()
    try:
        msg = _decode(raw, "sender", "ipc:///x")
    except RefitProtocolError:
        return
    assert isinstance(msg, dict)
    with contextlib.suppress(HandleError):
        BufferHandle.from_wire(msg.get("buffer"))


@pytest.mark.parametrize("depth", [10_000, 100_000])
def test_deep_json_everywhere_is_refused_not_a_recursion_error(tmp_path: Path, depth: int) -> None:
    deep = "[" * depth + "]" * depth
    with pytest.raises(CheckpointError):
        read_header(_write(tmp_path, deep.encode()))
    (tmp_path / "t.json").write_text(deep)
    with pytest.raises(TableError):
        read_table(tmp_path / "t.json")
    with pytest.raises(RefitProtocolError):
        _decode(deep.encode(), "sender", "ipc:///x")
