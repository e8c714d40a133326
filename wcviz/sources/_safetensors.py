"""Digest tables straight from safetensors checkpoints, one tensor in memory at a time.

The format is parsed here rather than through the ``safetensors`` package so
that every way a file can be wrong (truncated, a header that lies about its
offsets, an unknown dtype) becomes an error naming the file and the tensor.
All headers are checked before any tensor is read, and a table is returned
only when every tensor was digested: never a partial table.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import math
import struct
from dataclasses import dataclass
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from wcviz import _json
from wcviz._errors import CheckpointError
from wcviz._text import shape_str
from wcviz.digest import DEFAULT_ALGO, digest_buffers

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["from_safetensors", "safetensors_rows", "TensorEntry", "read_header", "checkpoint_files", "DTYPES"]

# safetensors dtype codes -> PyTorch dtype names (the digest hashes PyTorch's name).
DTYPES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F4": "float4_e2m1fn_x2",
}
# bytes per PyTorch element of each code: the header alone says how long each tensor is (no torch needed to read it)
ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8, "C64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1, "F4": 1,
}  # fmt: skip
assert set(ITEMSIZE) == set(DTYPES)
# codes whose header shape counts sub-byte values, several to one PyTorch element: safetensors writes
# float4_e2m1fn_x2 [2, 3] (pairs of 4-bit values) as F4 [2, 6], and reads it back with the last dimension halved
PACKED: dict[str, int] = {"F4": 2}
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit
MAX_DIMS = 64  # no real tensor has more; a header that claims 100,000 is refused, not digested
_MAX_DIM = (1 << 63) - 1  # a dimension must fit int64, as in PyTorch and in the digest's metadata


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as a checkpoint's header declares it (offsets absolute in the file)."""

    name: str
    file: Path
    dtype: str  # PyTorch name, without "torch."
    shape: tuple[int, ...]
    start: int
    nbytes: int


def read_header(path: str | Path) -> list[TensorEntry]:
    """Parse and check one file's header; entries in file order."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated: {size} bytes, too short for a safetensors header")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{path}: header length {hlen} exceeds the file ({size} bytes): truncated or not safetensors")
            raw = f.read(hlen)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        header = _json.loads(raw.decode("utf-8"))  # strictly: json.loads(bytes) would take UTF-16, a BOM, encoded surrogates
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e}): corrupt or not safetensors") from None
    except ValueError as e:  # JSON that Python will not read: an integer past its digit limit
        raise CheckpointError(f"{path}: header cannot be read ({_said(e)}): corrupt or not safetensors") from None
    except RecursionError:
        raise CheckpointError(f"{path}: header nests JSON too deeply to be a safetensors header") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is a JSON {type(header).__name__}, not an object")
    _refuse_lone_surrogates(path, header)
    _refuse_repeated_keys(path, header)
    _check_metadata(path, header.get("__metadata__"))
    data_start = 8 + hlen
    data_size = size - data_start
    entries = [_entry(path, name, spec, data_start, data_size) for name, spec in header.items() if name != "__metadata__"]
    entries.sort(key=lambda e: (e.start, e.nbytes))  # as safetensors does: by data_offsets
    _check_coverage(path, entries, data_start, data_size)
    return entries


def _said(e: BaseException) -> str:
    """Python's reason for refusing a value, without its advice (``use sys.set_int_max_str_digits()``)."""
    return str(e).split(";")[0].strip()


def _utf8(text: str) -> bool:
    """Whether ``text`` is UTF-8 text: a JSON ``\\ud800`` escape gives a lone surrogate, which has no UTF-8 form."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _refuse_lone_surrogates(path: Path, header: dict[str, Any]) -> None:
    """Every name and string in the header is UTF-8 text, as the safetensors library requires (it refuses the
    file); a tensor name that is not could be neither printed nor digested, so it is refused here, naming it."""
    for name, spec in header.items():
        where = "__metadata__" if name == "__metadata__" else f"tensor {name!r}"
        if not _utf8(name):
            raise CheckpointError(f"{path}: {where}: the name holds a lone surrogate (a \\ud800-\\udfff escape), not UTF-8 text; safetensors refuses it")
        stack = [spec]
        while stack:  # iteratively: a deep entry is no RecursionError
            v = stack.pop()
            if isinstance(v, dict):
                stack.extend(v.keys())
                stack.extend(v.values())
            elif isinstance(v, list):
                stack.extend(v)
            elif isinstance(v, str) and not _utf8(v):
                raise CheckpointError(f"{path}: {where}: header entry holds {v[:60]!r}, a lone surrogate, not UTF-8 text; safetensors refuses it")


def _refuse_repeated_keys(path: Path, header: dict[str, Any]) -> None:
    """A key given twice is refused, naming it: a second entry for a tensor would hide the first one's bytes."""
    if _json.repeated(header):
        name = _json.repeated(header)[0]
        what = "__metadata__" if name == "__metadata__" else f"tensor {name!r}"
        raise CheckpointError(f"{path}: header lists {what} more than once; safetensors refuses such a file")
    for name, spec in header.items():
        key = _json.first_repeated(spec)
        if key is not None:
            where = "__metadata__" if name == "__metadata__" else f"tensor {name!r}"
            raise CheckpointError(f"{path}: {where}: header entry gives key {key!r} more than once")


def _check_metadata(path: Path, meta: Any) -> None:
    """``__metadata__``, when present, maps strings to strings (as the safetensors library requires)."""
    if meta is None:
        return
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: __metadata__ is a JSON {type(meta).__name__}, not an object of strings")
    for k, v in meta.items():
        if not isinstance(v, str):
            shown = f"{str(v)[:60]} (a JSON {'null' if v is None else type(v).__name__})"
            raise CheckpointError(f"{path}: __metadata__ key {k!r} holds {shown}, not a string")


def _check_coverage(path: Path, entries: list[TensorEntry], data_start: int, data_size: int) -> None:
    """The tensors, in offset order, tile the data exactly: each begins where the one before ends, the first at 0,
    the last at the end of the file (the safetensors library's rule); a gap or trailing bytes are in no tensor."""
    end, last = 0, None
    for e in entries:
        begin = e.start - data_start
        if begin < end and last is not None:  # (end > 0: some tensor came before)
            raise CheckpointError(f"{path}: header lies: tensors {last.name!r} and {e.name!r} overlap in the file")
        if begin > end:
            after = f"after tensor {last.name!r}" if last is not None else "at the start of the data"
            raise CheckpointError(
                f"{path}: tensor {e.name!r}: header leaves bytes {end}-{begin} of the data {after} in no tensor "
                "(file not fully covered; safetensors refuses it)"
            )
        end, last = begin + e.nbytes, e
    if end != data_size:
        after = f"after tensor {last.name!r}" if last is not None else "and the header lists no tensor"
        raise CheckpointError(
            f"{path}: {data_size - end} trailing bytes {after}: the header's tensors end at byte {end} of the "
            f"{data_size} bytes of data (file not fully covered; safetensors refuses it)"
        )


def _entry(path: Path, name: str, spec: Any, data_start: int, data_size: int) -> TensorEntry:
    where = f"{path}: tensor {name!r}"
    if not name:
        raise CheckpointError(f"{path}: a tensor has an empty name; wcviz names every parameter in its tables")
    if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= set(spec):
        raise CheckpointError(f"{where}: header entry needs dtype, shape and data_offsets, got {spec!r:.120}")
    code = spec["dtype"]
    if not isinstance(code, str) or code not in DTYPES:
        shown = repr(code) if isinstance(code, str) else f"{str(code)[:60]} (a JSON {type(code).__name__})"
        raise CheckpointError(f"{where}: unknown dtype {shown}; wcviz reads {', '.join(DTYPES)}")
    shape, offsets = spec["shape"], spec["data_offsets"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise CheckpointError(f"{where}: shape {str(shape)[:120]} is not a list of non-negative ints")
    if len(shape) > MAX_DIMS:
        raise CheckpointError(f"{where}: shape has {len(shape):,} dimensions; a tensor has at most {MAX_DIMS}")
    if any(d > _MAX_DIM for d in shape):
        raise CheckpointError(f"{where}: shape dimension {max(shape)} does not fit in int64 (at most {_MAX_DIM})")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise CheckpointError(f"{where}: data_offsets {str(offsets)[:120]} is not [begin, end]")
    begin, end = offsets
    written = list(shape)  # as the header says it, for the messages
    per = PACKED.get(code, 1)
    if per > 1:
        if not shape or shape[-1] % per:
            raise CheckpointError(
                f"{where}: {code} {shape}: PyTorch's {DTYPES[code]} holds {per} values per element, so the last "
                f"dimension must be a multiple of {per}"
            )
        shape = [*shape[:-1], shape[-1] // per]  # the shape the tensor has in PyTorch, which the digest hashes
    nbytes = math.prod(shape) * ITEMSIZE[code]
    if not 0 <= begin <= end:
        raise CheckpointError(f"{where}: header lies: data_offsets {offsets} are not increasing")
    if end - begin != nbytes:
        raise CheckpointError(f"{where}: header lies: {code} {written} is {nbytes} bytes but data_offsets {offsets} span {end - begin}")
    if end > data_size:
        raise CheckpointError(f"{where}: truncated or header lies: data ends at byte {end} but the file holds {data_size} bytes of data")
    return TensorEntry(name, path, DTYPES[code], tuple(shape), data_start + begin, nbytes)


_INDEX = ".safetensors.index.json"


def _find_index(path: Path) -> Path | None:
    """The index a checkpoint path uses: the path itself if it is one, a directory's only one, or None."""
    if path.is_file():
        return path if path.name.endswith(_INDEX) else None
    indexes = sorted(path.glob("*" + _INDEX))
    if len(indexes) > 1:
        raise CheckpointError(f"{path}: several index files ({', '.join(p.name for p in indexes)}); point at one shard set")
    return indexes[0] if indexes else None


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the file itself, or a directory's shards.

    A directory with an ``*.safetensors.index.json`` (or that index file itself)
    uses the files its weight map names (and checks they exist); otherwise every
    ``*.safetensors`` in the directory.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if not path.is_file() and not path.is_dir():
        raise CheckpointError(f"{path}: not a file or directory")
    index = _find_index(path)
    if index is not None:
        weight_map = _weight_map(index)
        files = sorted({index.parent / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: lists shard {f.name!r}, which is missing from {index.parent}")
        return files
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: directory has no *.safetensors files")
    return files


def _weight_map(index: Path) -> dict[str, str]:
    try:
        data = _json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index}: not a readable index ({e})") from None
    except ValueError as e:  # JSON that Python will not read: an integer past its digit limit
        raise CheckpointError(f"{index}: not a readable index ({_said(e)})") from None
    except RecursionError:
        raise CheckpointError(f"{index}: not a readable index (its JSON nests too deeply)") from None
    wm = data.get("weight_map") if isinstance(data, dict) else None
    twice = _json.repeated(wm)
    if twice:
        name = twice[0]
        raise CheckpointError(f"{index}: weight_map lists tensor {name!r} more than once; which shard holds it is ambiguous")
    repeated = _json.first_repeated(data)
    if repeated is not None:
        raise CheckpointError(f"{index}: gives key {repeated!r} more than once in one JSON object; which one counts is ambiguous")
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(f"{index}: has no weight_map of tensor name -> file name")
    for k, v in wm.items():
        if not (_utf8(k) and _utf8(v)):
            what = f"tensor {k!r}" if not _utf8(k) else f"shard {v!r} (for tensor {k!r})"
            raise CheckpointError(f"{index}: weight_map lists {what}, which holds a lone surrogate (a \\ud800-\\udfff escape), not UTF-8 text")
    outside = sorted({f for f in wm.values() if Path(f).name != f or f in ("", ".", "..")})
    if outside:
        raise CheckpointError(f"{index}: shard {outside[0]!r} is not a file name in the index's directory")
    if not wm:
        raise CheckpointError(f"{index}: weight_map is empty: no weights")
    return wm


def _entries(path: Path) -> list[TensorEntry]:
    """Every tensor of a checkpoint, headers cross-checked against each other and the index."""
    files = checkpoint_files(path)
    entries: list[TensorEntry] = []
    seen: dict[str, Path] = {}
    for f in files:
        for e in read_header(f):
            if e.name in seen:
                raise CheckpointError(f"{path}: tensor {e.name!r} is in both {seen[e.name].name} and {f.name}")
            seen[e.name] = f
            entries.append(e)
    index = _find_index(path)
    if index is not None:
        wm = _weight_map(index)
        for name, fname in wm.items():
            if name not in seen:
                raise CheckpointError(f"{index}: lists tensor {name!r} in {fname}, which does not hold it")
            if seen[name] != index.parent / fname:
                raise CheckpointError(f"{index}: lists tensor {name!r} in {fname}, but it is in {seen[name].name}")
        extra = sorted(set(seen) - set(wm))
        if extra:
            raise CheckpointError(f"{index}: does not list tensor(s) {', '.join(extra[:5])} found in the shards")
    if not entries:
        raise CheckpointError(f"{path}: holds no tensors")
    return entries


def _advise(mm: Any) -> None:
    """Ask the OS to read the mapped file ahead (no pre-faulting: a checkpoint larger than memory streams)
    and, where the page cache can hold a file in 2 MiB folios (recent Linux on xfs, ext4 and others), to
    read it in those: the pages this reader brings in are then mapped 2 MiB at a time, by it and by every
    later reader, instead of one page fault per 64 KiB in 4 KiB pages (the kernel's rows walk the file in
    an order that makes readahead pick small folios). Advice the OS does not take is ignored: it changes
    speed, never what is read."""
    import mmap

    if not hasattr(mm, "madvise"):  # (Python builds without it)
        return
    for name in ("MADV_HUGEPAGE", "MADV_SEQUENTIAL"):
        advice = getattr(mmap, name, None)
        if advice is None:
            continue
        try:
            mm.madvise(advice)
        except OSError:  # e.g. EINVAL where transparent huge pages are compiled out
            continue


@contextlib.contextmanager
def _mapped(f: Any) -> Iterator[np.ndarray | None]:
    """The file as a read-only ``uint8`` array over a memory map (no copy, no zeroing: the kernel reads the
    page cache), or None where it cannot be mapped (then each tensor is read into a buffer)."""
    import mmap

    size = os.fstat(f.fileno()).st_size
    if not size or os.name != "posix":
        yield None
        return
    try:
        mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        yield None
        return
    _advise(mm)
    try:
        yield np.frombuffer(mm, dtype=np.uint8)
    finally:
        try:
            mm.close()
        except BufferError:  # a view of it still lives (an error on the way out): the map closes when it goes
            pass


def _view(f: Any, data: np.ndarray, e: TensorEntry) -> np.ndarray:
    """The tensor's bytes in the mapped file; a file cut short since its header was read is a CheckpointError here,
    before any byte past its end is touched (reading a mapped page that no longer exists would kill the process).

    As with any memory-mapped reader (the safetensors library maps files too), a file
    truncated between this check and the kernel's read is not caught: for nemo-rl-v3
    that is at most one batch of views (``digest_buffers``' window, 512 MiB) later.
    """
    end = e.start + e.nbytes
    size = os.fstat(f.fileno()).st_size
    if end > min(size, data.shape[0]):
        raise CheckpointError(f"{e.file}: tensor {e.name!r}: truncated: the file now holds {size} bytes, the tensor ends at byte {end}")
    return data[e.start : end]


def _read(f: Any, e: TensorEntry) -> np.ndarray:
    """The tensor's bytes, zero-padded to a multiple of 8 (what the digest folds)."""
    buf = np.zeros((e.nbytes + 7) // 8 * 8, dtype=np.uint8)
    f.seek(e.start)
    got = f.readinto(buf[: e.nbytes].data)
    if got != e.nbytes:
        raise CheckpointError(f"{e.file}: tensor {e.name!r}: truncated: read {got} of {e.nbytes} bytes")
    return buf


def safetensors_rows(
    path: str | Path,
    *,
    algo: str = DEFAULT_ALGO,
    backend: str = "auto",
    progress: bool | None = None,
) -> list[dict[str, Any]]:
    """The rows :func:`from_safetensors` makes its table of (``name``, ``digest``, ``algo``, ``dtype``,
    ``shape``, ``nbytes``, ``device``, ``seconds``), in file order, without importing pandas.

    For callers that only print or send the digests (``wcviz digest`` starts faster so).
    Every header is checked before a tensor is read; rows come back only when every tensor
    was digested. Tensors are digested by :func:`wcviz.digest.digest_buffers`: for
    nemo-rl-v3 on numba, the views of 512 MiB of the mapped file at a time in one
    kernel call (their seconds shared by bytes); the SHA-256 algorithms several tensors
    side by side. A file that cannot be memory-mapped is read into one buffer per tensor
    in flight.
    """
    from tqdm.auto import tqdm

    path = Path(path)
    entries = _entries(path)
    rows: list[dict[str, Any]] = []
    disable = None if progress is None else not progress  # None: only on a terminal
    bar = tqdm(total=sum(e.nbytes for e in entries), unit="B", unit_scale=True, desc=path.name, disable=disable)
    try:
        for file, group in itertools.groupby(entries, key=lambda e: e.file):  # entries come shard by shard
            tensors = list(group)
            with open(file, "rb") as f, _mapped(f) as data:
                buffers = ((_view(f, data, e) if data is not None else _read(f, e), e.dtype, e.shape, e.name) for e in tensors)
                timed = digest_buffers(  # nemo-rl-v3: a batch of views per kernel call; SHA-256: tensors side by side
                    buffers, algo=algo, backend=backend, done=bar.update, window_bytes=None if data is not None else 0
                )
                for e, (d, seconds) in zip(tensors, timed):
                    rows.append(
                        {
                            "name": e.name,
                            "digest": str(d),
                            "algo": d.algo,
                            "dtype": e.dtype,
                            "shape": shape_str(e.shape),
                            "nbytes": e.nbytes,
                            "device": "cpu",
                            "seconds": seconds,
                        }
                    )
                del buffers, timed  # views of the map: none may outlive it
    except OSError as err:
        raise CheckpointError(f"{path}: read failed: {err.strerror or err}") from None
    finally:
        bar.close()
    return rows


def from_safetensors(
    path: str | Path,
    *,
    algo: str = DEFAULT_ALGO,
    backend: str = "auto",
    progress: bool | None = None,
    **rank_info: Any,
) -> pd.DataFrame:
    """A digest table of a safetensors file or a directory of shards (index or not).

    Reads lazily: one tensor's bytes in memory at a time. Digests equal those of
    the same tensors loaded into PyTorch. Rows are in file order, shard by shard.
    """
    from wcviz.frame import check_rank_info, make_frame

    info = check_rank_info(rank_info)
    info.setdefault("role", "checkpoint")
    info.setdefault("phase", "current")
    return make_frame({**row, **info} for row in safetensors_rows(path, algo=algo, backend=backend, progress=progress))
