"""The public digest functions: algorithm and backend choice, batching, comparison."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Union

from wcviz._errors import AlgorithmMismatch, DigestError
from wcviz.digest import _lanes, _pool, _spec
from wcviz.digest._backends import BACKENDS, resolve_backend
from wcviz.digest._sha256 import sha256_hex

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALGORITHMS",
    "BACKENDS",
    "DIGEST_FORMATS",
    "DEFAULT_ALGO",
    "Digest",
    "DigestAccumulator",
    "tensor_digest",
    "digest_hex",
    "digest_many",
    "digest_timed",
    "compare_digests",
    "as_pairs",
    "NamedTensors",
    "TensorMeta",
    "resolve_backend",
    "parse_dtype",
    "digest_format_error",
]

DEFAULT_ALGO = _spec.ALGO
ALGORITHMS = (_spec.ALGO, "sha256", "vllm-sha256", "sglang-cpu", "sglang-gpu")  # the last three: the engines' own

# What a digest of each algorithm a table may hold looks like (lowercase hex): wcviz's own
# algorithms, and the engines' checksums that sources read ("sglang": SGLang's weight
# checker, an integer of up to 64 bits written as hex). Anything else in a table is an error.
DIGEST_FORMATS: dict[str, tuple[str, re.Pattern[str]]] = {
    _spec.ALGO: ("32 hex characters", re.compile(r"[0-9a-f]{32}")),
    "sha256": ("64 hex characters", re.compile(r"[0-9a-f]{64}")),
    "vllm-sha256": ("64 hex characters", re.compile(r"[0-9a-f]{64}")),
    "sglang-cpu": ("16 hex characters", re.compile(r"[0-9a-f]{16}")),
    "sglang-gpu": ("16 hex characters", re.compile(r"[0-9a-f]{16}")),
    "sglang": ("1 to 16 hex characters", re.compile(r"[0-9a-f]{1,16}")),  # tables of wcviz < 0.2: SGLang, unsure which path
}

# Host tensors up to this many bytes are digested together, one kernel call for
# all of them (threads across tensors); larger ones get the kernel to themselves.
SMALL_BYTES = 1 << 20

NamedTensors = Union[Mapping[str, "torch.Tensor"], Iterable[tuple[str, "torch.Tensor"]]]


class Digest(str):
    """A digest's lowercase hex form that remembers the algorithm that made it.

    It is a ``str`` (it compares, hashes and prints as its hex), so it drops into
    dicts, frames and JSON; ``.algo`` is what :func:`compare_digests` checks.
    """

    algo: str

    def __new__(cls, hexdigest: str, algo: str) -> Digest:
        self = super().__new__(cls, hexdigest)
        self.algo = algo
        return self

    @classmethod
    def many(cls, hexdigests: Iterable[str], algo: str) -> list[Digest]:
        """``[Digest(h, algo) for h in hexdigests]`` without a constructor call each (batches of thousands)."""
        out = [str.__new__(cls, h) for h in hexdigests]
        for d in out:
            d.algo = algo
        return out

    def __repr__(self) -> str:
        return f"Digest({str(self)!r}, algo={self.algo!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Digest, (str(self), self.algo))


def digest_format_error(algo: object, digest: object) -> str | None:
    """Why ``digest`` cannot be a digest of ``algo`` (unknown algorithm, wrong length or characters), or None."""
    if not isinstance(algo, str) or algo not in DIGEST_FORMATS:
        return f"unknown digest algorithm {algo!r}; tables hold {', '.join(DIGEST_FORMATS)}"
    what, pattern = DIGEST_FORMATS[algo]
    if not isinstance(digest, str) or not pattern.fullmatch(digest.lower()):
        shown = digest if not isinstance(digest, str) or len(digest) <= 80 else digest[:77] + "..."
        return f"digest {shown!r} is not a {algo} digest ({what})"
    return None


def _check_algo(algo: str, backend: str = "auto") -> str:
    """``algo``, or a ValueError naming it (or ``backend``: checked for every algorithm, used by one)."""
    if algo not in ALGORITHMS:
        raise ValueError(f"unknown digest algorithm {algo!r}; choose one of {', '.join(ALGORITHMS)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown digest backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    return algo


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A ``torch.dtype`` from itself, ``"bfloat16"`` or ``"torch.bfloat16"``."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise DigestError(f"unknown dtype {dtype!r}")
    return found


def whole_dims(shape: Sequence[Any], what: str) -> tuple[int, ...]:
    """``shape`` as whole, non-negative dimensions, or a :class:`DigestError` naming the buffer (no silent ``int(4.7)``)."""
    import numbers

    try:
        dims = tuple(shape)
    except TypeError:
        raise DigestError(f"{what}: shape must be a sequence of dimensions, got {shape!r}") from None
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral) or int(d) < 0:
            raise DigestError(f"{what}: shape {list(dims)!r} has {d!r}, not a whole dimension >= 0")
    return tuple(int(d) for d in dims)


class TensorMeta(NamedTuple):
    """What a tensor is apart from its values: its shape and its dtype (PyTorch's name without ``torch.``).

    The one metadata type: what a refit receiver declares for each parameter, what
    both ends slice and compare with. A plain tuple on the wire (``[shape, dtype]``).
    """

    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        return cls(tuple(int(d) for d in t.shape), str(t.dtype).removeprefix("torch."))

    @classmethod
    def parse(cls, shape: Sequence[int], dtype: Any) -> TensorMeta:
        """From any shape sequence and a dtype (``torch.bfloat16``, ``"bfloat16"``, ``"torch.bfloat16"``), checked."""
        return cls(whole_dims(shape, "a tensor's metadata"), str(parse_dtype(dtype)).removeprefix("torch."))

    @property
    def nbytes(self) -> int:
        import math

        return math.prod(self.shape) * parse_dtype(self.dtype).itemsize

    def describe(self) -> str:
        """``bfloat16 [8, 16] (256 bytes)``."""
        return f"{self.dtype} {list(self.shape)} ({self.nbytes} bytes)"


def _words(lanes: torch.Tensor, seed: tuple[int, int], backend: str) -> torch.Tensor:
    """Digest words of an ``int64`` lane tensor with a resolved backend, on its device."""
    import torch

    if backend == "numba":
        from wcviz.digest import _numba

        d1, d2 = _numba.lanes_digest(lanes.numpy().view("uint64"), seed)
        return torch.tensor([_spec.to_i64(d1), _spec.to_i64(d2)], dtype=torch.int64)
    if backend == "triton":
        from wcviz.digest import _triton

        return _triton.lanes_digest(lanes, seed)
    from wcviz.digest import _torch

    return _torch.lanes_digest(lanes, seed)


def _words_many(tensors: Sequence[tuple[str, torch.Tensor]], backend: str, sizes: Sequence[int] | None = None) -> Any:
    """Digest words, ``(n, 2)``, of tensors on one device, in one batched call (``.tolist()`` gives the ints).

    ``triton``: three launches for all of them, on their device, no host sync.
    ``numba``: contiguous host tensors (nearly every parameter) are read where they
    live, the rest packed into one lane array; one kernel call each way, threads
    spread across the tensors.
    """
    if backend == "triton":
        from wcviz.digest import _triton

        seeds = [_spec.seeds(*_lanes.seed_args(t)) for _, t in tensors]
        lanes = [_lanes.lanes_of(_lanes.logical_bytes(t, name)) for name, t in tensors]
        return _triton.lanes_digest_many(lanes, seeds)
    return _numba_many(tensors, sizes if sizes is not None else [t.numel() * t.element_size() for _, t in tensors])


def _numba_many(tensors: Sequence[tuple[str, torch.Tensor]], sizes: Sequence[int]) -> Any:
    """The numba path of :func:`_words_many`: ``(n, 2)`` ``uint64`` words in the order given (``sizes``: their bytes)."""
    import numpy as np

    from wcviz.digest import _numba

    n = len(tensors)
    seed_rows: list[tuple[int, int]] = []  # one per (dtype, shape) seen
    seed_of: list[int] = []  # each tensor's row in it
    known: dict[tuple[Any, Any], int] = {}
    direct: list[int] = []  # read where they live: one address and a byte count each
    addresses: list[int] = []
    lanes_of: list[int] = []  # their bytes
    packed: list[int] = []  # copied into one lane array first (a strided view, a quantized tensor, a lazy conj/neg)
    for i, (_, t) in enumerate(tensors):
        nbytes = sizes[i]
        dtype = t.dtype
        key = (dtype, t.shape)
        row = known.get(key)
        if row is None:
            row = known[key] = len(seed_rows)
            seed_rows.append(_spec.seeds(str(dtype), tuple(t.shape), nbytes))
        seed_of.append(row)
        if t.is_contiguous() and not (t.is_quantized or t.is_neg() or (dtype.is_complex and t.is_conj())):  # (only complex tensors conjugate)
            direct.append(i)
            address = t.data_ptr()
            if address == 0 and nbytes:
                _lanes.check_digestible(t, tensors[i][0])  # a ZeroTensor: refused by name
            if t.storage_offset() * t.element_size() + nbytes > t.untyped_storage().nbytes():
                _lanes.check_storage(t, tensors[i][0])  # freed or shrunk under it: read, it would crash the process
            addresses.append(address)
            lanes_of.append(nbytes)
        else:
            packed.append(i)
    seeds = np.array(seed_rows, dtype=np.uint64).reshape(-1, 2)[np.array(seed_of, dtype=np.intp)].reshape(n, 2)
    out = np.empty((n, 2), dtype=np.uint64)
    if len(direct) == n:  # the usual case: every tensor read where it lives
        return _numba.lanes_digest_at(np.array(addresses, dtype=np.uint64), np.array(lanes_of, dtype=np.int64), seeds, tensors)
    if direct:
        counts = np.array(lanes_of, dtype=np.int64)
        out[direct] = _numba.lanes_digest_at(np.array(addresses, dtype=np.uint64), counts, seeds[direct], tensors)
    if packed:
        raws = [_lanes.logical_bytes(tensors[i][1], tensors[i][0]).numpy() for i in packed]
        counts = np.array([(r.shape[0] + 7) // 8 for r in raws], dtype=np.int64)  # lanes, the last one zero-padded
        starts = np.zeros_like(counts)
        np.cumsum(counts[:-1], out=starts[1:])
        lanes = np.zeros(int(counts.sum()) * 8, dtype=np.uint8)
        for raw, at in zip(raws, starts.tolist()):
            lanes[at * 8 : at * 8 + raw.shape[0]] = raw
        out[packed] = _numba.lanes_digest_many(lanes.view(np.uint64), starts, counts, seeds[packed])
    return out


def tensor_digest(t: torch.Tensor, *, backend: str = "auto", name: str | None = None) -> torch.Tensor:
    """The "nemo-rl-v3" digest of ``t``: two ``int64`` values on ``t.device``, no host sync.

    ``name`` only labels errors. Use :func:`digest_hex` for the 32-character form.
    """
    raw = _lanes.logical_bytes(t, name)
    dtype_name, shape, nbytes = _lanes.seed_args(t)
    chosen = resolve_backend(backend, t.device.type, name)
    return _words(_lanes.lanes_of(raw), _spec.seeds(dtype_name, shape, nbytes), chosen)


def _hex_words(words: Sequence[int]) -> Digest:
    return Digest(_spec.hex_of(words[0], words[1]), _spec.ALGO)


def _sha256_of(t: torch.Tensor, name: str | None, algo: str = "sha256") -> Digest:
    """A digest computed from the tensor's bytes in one piece (every algorithm but nemo-rl-v3): one sync."""
    raw = _lanes.logical_bytes(t, name)
    if algo == "sglang-gpu" and raw.device.type == "cuda":
        from wcviz.digest._engines import sglang_gpu_words

        return Digest(f"{sglang_gpu_words(raw):016x}", algo)
    host = raw.cpu().numpy()
    if algo != "sha256":
        from wcviz.digest._engines import engine_digest

        return Digest(engine_digest(algo, host), algo)
    dtype_name, shape, nbytes = _lanes.seed_args(t)
    return Digest(sha256_hex(host.data, dtype_name, shape, nbytes), "sha256")


def digest_hex(t: torch.Tensor, *, algo: str = DEFAULT_ALGO, backend: str = "auto", name: str | None = None) -> Digest:
    """The digest of ``t`` as lowercase hex (32 characters for "nemo-rl-v3", 64 for "sha256" and "vllm-sha256",
    16 for "sglang-cpu" and "sglang-gpu": what those engines' own checkers report for the same tensor)."""
    if _check_algo(algo, backend) != _spec.ALGO:
        return _sha256_of(t, name, algo)
    return _hex_words(tensor_digest(t, backend=backend, name=name).tolist())


def as_pairs(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    """Named tensors (a mapping, or ``(name, tensor)`` pairs) as a list of pairs, each name once.

    Anything else is a ``TypeError`` naming the item; a name given twice is a
    :class:`DigestError` naming it (the tensors themselves are checked where they are
    read). What every caller that takes named tensors uses.
    """
    if isinstance(named_tensors, Mapping):
        items = list(named_tensors.items())
        bad = next((k for k in named_tensors if not isinstance(k, str)), None)  # a mapping's keys are unique already
        if bad is not None:
            raise TypeError(f"expected (name, tensor) pairs with str names, got {(bad, named_tensors[bad])!r:.80}")
        return items
    items = list(named_tensors)
    seen: set[str] = set()
    dups: list[str] = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"expected (name, tensor) pairs with str names, got {item!r:.80}")
        if item[0] in seen:
            dups.append(item[0])
        seen.add(item[0])
    if dups:
        raise DigestError(f"duplicate parameter names: {', '.join(sorted(set(dups)))}")
    return items


def digest_timed(
    named_tensors: NamedTensors, *, algo: str = DEFAULT_ALGO, backend: str = "auto", progress: bool | None = False
) -> dict[str, tuple[Digest, float]]:
    """Like :func:`digest_many`, with the seconds each digest cost.

    Tensors digested on their own (sha256, numba on a large tensor) are timed
    one by one. Batched work (Triton and the torch reference per device, numba
    on small host tensors) is timed as a whole, until its one sync, and that
    total is shared out in proportion to bytes.
    """
    names, digests, seconds = _digests(named_tensors, algo, backend, progress)
    return dict(zip(names, zip(digests, seconds)))


def _digests(
    named_tensors: NamedTensors, algo: str, backend: str, progress: bool | None, *, timed: bool = True
) -> tuple[list[str], list[Digest], list[float]]:
    """Names, digests and seconds, in input order: what :func:`digest_timed` and :func:`digest_many` share.

    Untimed and with no progress bar to move, host tensors of every size go into the one numba batch (its
    threads spread over all of them: no thread start and no idle tail per tensor); timed, a large one is
    digested, and timed, on its own."""
    batch_all = not timed and not progress
    from tqdm.auto import tqdm

    _check_algo(algo, backend)
    items = as_pairs(named_tensors)
    sizes: list[int] = []
    resolved: dict[str, str] = {}  # per device type: the backend choice is the same for every tensor there
    import torch

    strided = torch.strided
    plain = (torch.Tensor, torch.nn.Parameter)  # anything else (DTensor, FakeTensor, ...) is checked by name
    kinds: dict[Any, str] = {}  # device -> its type ("cpu", "cuda", ...): ``device.type`` makes a new str each time
    singles: list[tuple[int, Any, str]] = []  # (index, device, backend): digested one by one, or queued per device (torch)
    fold = algo == _spec.ALGO  # the tree fold (batched); the other algorithms go one tensor at a time
    batches: dict[tuple[str, Any], list[int]] = {}  # indices into items: one call per (backend, device)
    for i, (name, t) in enumerate(items):  # every input is checked before any work is done
        if type(t) not in plain or t.layout is not strided or t.is_nested:
            _lanes.check_digestible(t, name)  # raises, naming what is wrong
        device = t.device
        kind = kinds.get(device)
        if kind is None:
            kind = kinds[device] = device.type
        if kind == "meta":
            _lanes.check_digestible(t, name)
        nbytes = t.nbytes
        sizes.append(nbytes)
        if not fold:
            singles.append((i, device, "host"))
            continue
        how = resolved.get(kind)
        if how is None:
            how = resolved[kind] = resolve_backend(backend, kind, name)
        if how == "triton" or (how == "numba" and (nbytes <= SMALL_BYTES or batch_all)):
            group = batches.get((how, device))
            if group is None:
                group = batches[(how, device)] = []
            group.append(i)
        else:
            singles.append((i, device, how))
    names = [name for name, _ in items]
    if algo in _pool.HASHLIB_ALGOS:  # one SHA-256 stream per tensor: tensors side by side, on threads
        hashed = _hashed(items, sizes, algo, progress)
        return names, [d for d, _ in hashed], [s for _, s in hashed]
    n = len(items)
    out: list[Any] = [None] * n  # each tensor's Digest, by its index
    secs = [0.0] * n
    queued: dict[Any, list[tuple[int, torch.Tensor]]] = {}
    started: dict[Any, float] = {}
    bar = None if progress is False else tqdm(total=len(items), desc="digest", unit="tensor",
                                              disable=not progress if progress is not None else None)
    try:
        for i, device, how in singles:
            name, t = items[i]
            if how == "torch":
                started.setdefault(device, time.perf_counter())
                queued.setdefault(device, []).append((i, tensor_digest(t, backend="torch", name=name)))
            else:
                t0 = time.perf_counter()
                out[i] = _sha256_of(t, name, algo) if algo != _spec.ALGO else _hex_words(tensor_digest(t, backend=how, name=name).tolist())
                secs[i] = time.perf_counter() - t0
            if bar is not None:
                bar.update()
        for (how, _), group in batches.items():
            t0 = time.perf_counter()
            words = _words_many([items[i] for i in group], how, [sizes[i] for i in group])
            hexes = _spec.hex_rows(words) if how == "numba" else _spec.hex_pairs(_to_host(words))  # the one sync for this batch
            if len(group) == n:  # the usual case: one batch of everything, in input order
                out, secs = Digest.many(hexes, _spec.ALGO), _shares(sizes, time.perf_counter() - t0)
            else:
                _share(out, secs, group, hexes, sizes, time.perf_counter() - t0)
            if bar is not None:
                bar.update(len(group))
        for device, rows in queued.items():
            hexes = _spec.hex_pairs(_to_host(torch.stack([w for _, w in rows])))  # the one sync for this device
            _share(out, secs, [i for i, _ in rows], hexes, sizes, time.perf_counter() - started[device])
    finally:
        if bar is not None:
            bar.close()
    return names, out, secs


def _hashed(items: list[tuple[str, torch.Tensor]], sizes: list[int], algo: str, progress: bool | None) -> list[tuple[Digest, float]]:
    """Each tensor's SHA-256 digest on its own thread (``_pool``), each timed on its own."""
    from tqdm.auto import tqdm

    bar = None if progress is False else tqdm(total=len(items), desc="digest", unit="tensor", disable=not progress if progress is not None else None)
    jobs = ((functools.partial(_sha256_of, t, name, algo), n) for (name, t), n in zip(items, sizes))
    try:
        timed = _pool.side_by_side(jobs, done=None if bar is None else lambda _: bar.update())
    finally:
        if bar is not None:
            bar.close()
    return list(timed)


def _shares(sizes: list[int], total: float) -> list[float]:
    """``total`` seconds shared out in proportion to ``sizes`` (bytes)."""
    per_byte = total / (sum(sizes) or 1)
    return [per_byte * b for b in sizes]


def _share(out: list[Any], secs: list[float], group: list[int], hexes: list[str], sizes: list[int], total: float) -> None:
    """Record the batched digests (hex) of tensors ``group`` (indices), each with its share of the batch's seconds."""
    for i, d, s in zip(group, Digest.many(hexes, _spec.ALGO), _shares([sizes[i] for i in group], total)):
        out[i] = d
        secs[i] = s


def _to_host(words: torch.Tensor) -> list[list[int]]:
    """Bring a device's stacked digest words to the host: the one sync per device."""
    return words.tolist()


class DigestAccumulator:
    """Digests collected as a stream goes by, with no host sync until :meth:`hex`.

    Each :meth:`add` digests on the tensor's own device and keeps the two words
    there; :meth:`hex` brings them to the host once per device. This is what a
    refit sender and receiver use while tensors stream through.
    """

    def __init__(self, *, algo: str = DEFAULT_ALGO, backend: str = "auto") -> None:
        self.algo = _check_algo(algo, backend)
        self.backend = backend
        self._pending: dict[str, torch.Tensor | Digest] = {}  # device words, or a host digest

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, name: object) -> bool:
        return name in self._pending

    def add(self, name: str, t: torch.Tensor) -> None:
        """Digest ``t`` under ``name`` (a name may be added once)."""
        if name in self._pending:
            raise DigestError(f"duplicate parameter names: {name}")
        self._pending[name] = self._one(name, t)

    def _one(self, name: str, t: torch.Tensor) -> torch.Tensor | Digest:
        return _sha256_of(t, name, self.algo) if self.algo != _spec.ALGO else tensor_digest(t, backend=self.backend, name=name)

    def add_many(self, named: NamedTensors) -> None:
        """:meth:`add` each of ``named`` (a mapping, or ``(name, tensor)`` pairs), in order; the host tensors that the
        numba kernel digests go in one batched call (its threads spread over all of them: no thread start and no
        idle tail per tensor). All or nothing: a duplicate name or a tensor that cannot be digested adds none."""
        import torch

        items = as_pairs(named)
        if again := [name for name, _ in items if name in self._pending]:
            raise DigestError(f"duplicate parameter names: {', '.join(again)}")
        host: list[tuple[str, torch.Tensor]] = []
        if self.algo == _spec.ALGO and len(items) > 1:
            plain = (torch.Tensor, torch.nn.Parameter)
            host = [(n, t) for n, t in items if type(t) in plain and t.layout is torch.strided and not t.is_nested
                    and t.device.type == "cpu" and resolve_backend(self.backend, "cpu", n) == "numba"]
        done: dict[str, torch.Tensor | Digest] = {}
        if len(host) > 1:
            done = {n: _hex_words(w) for (n, _), w in zip(host, _words_many(host, "numba").tolist())}
        fresh = {name: done[name] if name in done else self._one(name, t) for name, t in items}
        self._pending.update(fresh)  # only once every one of them is digested

    def hex(self) -> dict[str, Digest]:
        """Every digest so far, as ``{name: Digest}`` in the order added; one sync per device."""
        import torch

        out: dict[str, Digest] = {n: d for n, d in self._pending.items() if isinstance(d, Digest)}
        by_device: dict[Any, list[str]] = {}
        for name, w in self._pending.items():
            if not isinstance(w, Digest):
                by_device.setdefault(w.device, []).append(name)
        for names in by_device.values():
            host = _to_host(torch.stack([self._pending[n] for n in names]))  # type: ignore[misc]
            out.update({n: _hex_words(pair) for n, pair in zip(names, host)})
        return {n: out[n] for n in self._pending}


def digest_many(
    named_tensors: NamedTensors, *, algo: str = DEFAULT_ALGO, backend: str = "auto", progress: bool | None = False
) -> dict[str, Digest]:
    """Digest many named tensors, each on its own device, syncing once per device.

    Accepts a mapping or an iterable of ``(name, tensor)``; duplicate names are
    an error that names them. Returns ``{name: Digest}`` in input order.
    """
    names, digests, _ = _digests(named_tensors, algo, backend, progress, timed=False)
    return dict(zip(names, digests))


def _algos(side: Mapping[str, str]) -> set[str]:
    return {v.algo for v in side.values() if isinstance(v, Digest)}


def _check_values(side: str, digests: Mapping[str, str], algo: str | None) -> None:
    """A :class:`DigestError` naming the first entry that is not a digest (of ``algo`` where one is known):
    two failures written the same way (``None``, ``""``, ``"error"``) must never compare equal."""
    for name, value in digests.items():
        if algo is not None:
            why = digest_format_error(algo, value)
        elif isinstance(value, str) and any(p.fullmatch(value.lower()) for _, p in DIGEST_FORMATS.values()):
            why = None
        else:
            shown = value if not isinstance(value, str) or len(value) <= 80 else value[:77] + "..."
            why = f"{shown!r} is not a digest of any algorithm wcviz knows ({', '.join(DIGEST_FORMATS)})"
        if why is not None:
            raise DigestError(f"{side} digest of {name!r}: {why}")


def compare_digests(sender: Mapping[str, str], receiver: Mapping[str, str]) -> list[str]:
    """Sorted names whose digests differ, or that only one side has.

    Digests of different algorithms cannot be compared: that raises
    :class:`AlgorithmMismatch` rather than reporting every name as different.
    """
    algos = _algos(sender) | _algos(receiver)
    if len(algos) > 1:
        raise AlgorithmMismatch(f"cannot compare digests of different algorithms: {', '.join(sorted(algos))}")
    for side, digests in (("sender", sender), ("receiver", receiver)):
        _check_values(side, digests, next(iter(algos), None))
    names = set(sender) | set(receiver)
    return sorted(
        n for n in names if n not in sender or n not in receiver or str(sender[n]).lower() != str(receiver[n]).lower()
    )
