"""The engines' own checksums (vllm-sha256, sglang-cpu, sglang-gpu), held to the engines' sources.

- ``vllm-sha256``: vLLM 0.33.0 ``vllm/model_executor/model_loader/weight_checksum.py``
  ``compute_tensor_digests``: ``sha256(w.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())``.
- ``sglang-cpu``: SGLang 0.5.23 ``sglang/srt/managers/mm_utils.py`` ``tensor_hash`` on a
  CPU tensor: the first 8 bytes of SHA-256, big-endian, printed ``f"{h:016x}"``
  (``sglang/srt/utils/weight_checker.py`` ``_hash_tensor``).
- ``sglang-gpu``: SGLang 0.5.23 ``sglang/kernels/ops/memory/gpu_tensor_hash.py``, the
  released file itself: downloaded from the sglang==0.5.23 wheel with
  ``pip download --no-deps`` and run in Triton's interpreter (``TRITON_INTERPRET=1``) in a
  subprocess. It skips, naming why, only when the wheel cannot be had.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from wcviz import digest_hex, digest_many
from wcviz.digest import ENGINE_ALGORITHMS, digest_buffer, digest_timed, fill_digest
from wcviz.digest._engines import _sglang_gpu_host, reference_sglang_gpu, sglang_gpu_words
from wcviz.frame import make_frame
from wcviz.sources import from_named_tensors

from _wheels import sglang_file

TILE_BYTES = 8192 * 4
SIZES = [0, 1, 3, 4, 5, 1000, TILE_BYTES - 1, TILE_BYTES, TILE_BYTES + 2, 3 * TILE_BYTES + 7]


def _vllm(t: torch.Tensor) -> str:  # vLLM 0.33.0 weight_checksum.py, as written there
    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def _sglang_cpu(t: torch.Tensor) -> str:  # SGLang 0.5.23 mm_utils.tensor_hash (CPU) + weight_checker._hash_tensor
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256()
    h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return f"{int.from_bytes(h.digest()[:8], byteorder='big', signed=False):016x}"


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 10, generator=g)
    return {
        "f32": base,
        "bf16": base.to(torch.bfloat16),
        "f16.odd": torch.randn(7, generator=g).to(torch.float16),  # 14 bytes: not a multiple of 4
        "i8": torch.randint(-128, 127, (5,), generator=g, dtype=torch.int8),
        "transposed": base.t(),  # non-contiguous: the engines hash .contiguous()
        "sliced": base[1:4, ::2],
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(1.5),
    }


@pytest.mark.parametrize("name", list(_tensors()))
def test_vllm_and_sglang_cpu_match_the_engines_code(name: str) -> None:
    t = _tensors()[name]
    assert str(digest_hex(t, algo="vllm-sha256")) == _vllm(t)
    assert str(digest_hex(t, algo="sglang-cpu")) == _sglang_cpu(t)
    assert digest_hex(t, algo="sglang-cpu").algo == "sglang-cpu"


def test_engine_algorithms_are_byte_hashes_only() -> None:
    """The engines hash bytes: a reshape does not change them, a dtype with other bytes does."""
    t = torch.arange(12, dtype=torch.float32)
    for algo in ENGINE_ALGORITHMS:
        assert str(digest_hex(t, algo=algo)) == str(digest_hex(t.view(3, 4), algo=algo))
        assert str(digest_hex(t, algo=algo)) != str(digest_hex(t.to(torch.float64), algo=algo))
        assert str(digest_hex(t, algo=algo)) != str(digest_hex(t + 1, algo=algo))


@pytest.mark.parametrize("n", [*SIZES, 4 * TILE_BYTES, 4 * TILE_BYTES + 4, 9 * TILE_BYTES + 13, 13 * TILE_BYTES - 1])
def test_sglang_gpu_compiled_kernel_matches_the_reference(n: int) -> None:
    """Sizes past 4 tiles: the kernel walks 4 tiles side by side, then the tiles left over one by one."""
    raw = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    want = reference_sglang_gpu(raw)
    assert _sglang_gpu_host(raw) == want
    assert sglang_gpu_words(torch.from_numpy(raw.copy())) == want  # the torch path that runs on CUDA
    assert sglang_gpu_words(torch.from_numpy(raw.copy()), chunk_words=8192) == want  # chunked
    t = torch.from_numpy(raw.copy())
    assert str(digest_hex(t, algo="sglang-gpu")) == f"{want:016x}"


@pytest.mark.parametrize(("dtype", "start"), [(torch.bfloat16, 1), (torch.uint8, 1), (torch.uint8, 3), (torch.bfloat16, 3)])
def test_sglang_gpu_torch_path_takes_a_slice_at_an_odd_byte_offset(dtype: torch.dtype, start: int) -> None:
    """A slice whose bytes do not start on an int32 boundary: the CUDA path copies it instead of crashing."""
    base = torch.arange(4 * TILE_BYTES + 8, dtype=torch.int64).to(dtype)
    s = base[start : start + 2 * TILE_BYTES]  # a whole number of words, misaligned by ``start`` elements
    assert (s.storage_offset() * s.element_size()) % 4
    want = reference_sglang_gpu(s.contiguous().clone().view(torch.uint8).numpy())
    assert sglang_gpu_words(s) == want
    assert sglang_gpu_words(s, chunk_words=8192) == want
    assert str(digest_hex(s, algo="sglang-gpu")) == f"{want:016x}"


def test_sglang_gpu_is_position_sensitive_and_tile_sensitive() -> None:
    raw = np.zeros(3 * TILE_BYTES, dtype=np.uint8)
    base = reference_sglang_gpu(raw)
    for at in (0, 4, TILE_BYTES, 2 * TILE_BYTES + 5):
        flipped = raw.copy()
        flipped[at] = 1
        assert _sglang_gpu_host(flipped) != base
    swapped = np.concatenate([raw[:TILE_BYTES], raw[:TILE_BYTES] + 1, raw[:TILE_BYTES]])
    again = np.concatenate([raw[:TILE_BYTES] + 1, raw[:TILE_BYTES], raw[:TILE_BYTES]])
    assert _sglang_gpu_host(swapped) != _sglang_gpu_host(again)  # the word index is mixed in


def test_digest_many_batches_and_tables_carry_the_engine_algo() -> None:
    named = _tensors()
    for algo in ENGINE_ALGORITHMS:
        many = digest_many(list(named.items()), algo=algo)
        assert {k: str(v) for k, v in many.items()} == {k: str(digest_hex(t, algo=algo)) for k, t in named.items()}
        timed = digest_timed(list(named.items()), algo=algo)
        assert {k: str(v[0]) for k, v in timed.items()} == {k: str(v) for k, v in many.items()}
        frame = from_named_tensors(list(named.items()), algo=algo, role="engine", rank=0)
        assert set(frame["algo"]) == {algo}
        assert dict(zip(frame["name"], frame["digest"])) == {k: str(v) for k, v in many.items()}


def test_digest_buffer_matches_for_engine_algorithms() -> None:
    t = torch.randn(5, 3).to(torch.bfloat16)
    raw = t.contiguous().view(-1).view(torch.uint8).numpy()
    for algo in ENGINE_ALGORITHMS:
        assert str(digest_buffer(raw, "bfloat16", (5, 3), algo=algo)) == str(digest_hex(t, algo=algo))


@pytest.mark.parametrize("algo", ENGINE_ALGORITHMS)
@pytest.mark.parametrize("byte", [0, 0xA5])
def test_fill_digest_is_the_digest_of_a_filled_tensor(algo: str, byte: int) -> None:
    for shape in [(3, 5), (TILE_BYTES // 2 + 3,), (0,)]:
        t = torch.full(shape, byte, dtype=torch.uint8).view(torch.int8).to(torch.int8)
        t16 = torch.full(shape, byte, dtype=torch.uint8).view(torch.float16) if np.prod(shape) % 2 == 0 else None
        assert fill_digest(algo, "int8", shape, t.numel(), byte) == str(digest_hex(t, algo=algo))
        if t16 is not None:
            assert fill_digest(algo, "float16", tuple(t16.shape), t16.numel() * 2, byte) == str(digest_hex(t16, algo=algo))


def test_tables_check_the_engine_digest_formats() -> None:
    row = {"name": "w", "role": "engine", "rank": 0, "phase": "current"}
    make_frame([{**row, "digest": "0" * 16, "algo": "sglang-gpu"}, {**row, "name": "v", "digest": "a" * 64, "algo": "vllm-sha256"}])
    with pytest.raises(ValueError, match="sglang-gpu"):
        make_frame([{**row, "digest": "0" * 32, "algo": "sglang-gpu"}])
    with pytest.raises(ValueError, match="vllm-sha256"):
        make_frame([{**row, "digest": "0" * 16, "algo": "vllm-sha256"}])


# --------------------------------------------------------------------------- SGLang's own kernel


_RUNNER = textwrap.dedent(
    """
    import importlib.util, json, sys
    import numpy as np, torch, triton
    spec = importlib.util.spec_from_file_location("sglang_gpu_tensor_hash", sys.argv[1])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = {}

    def words(raw):
        tb = torch.from_numpy(raw.copy())
        pad = (4 - (tb.numel() & 3)) & 3            # as mod._as_uint32_words, minus its is_cuda assert
        if pad:
            tb = torch.cat([tb, torch.zeros(pad, dtype=torch.uint8)])
        return tb.view(torch.uint32)

    def kernel_hash(raw, seed=0x243F6A88, tile=8192, block=256, chunk=1024):   # mod.gpu_tensor_hash, step by step
        if raw.size == 0:                            # gpu_tensor_hash: n == 0 -> 0 (torch cannot view 0 bytes as words)
            return 0
        u32 = words(raw)
        n = u32.numel()
        grid = (triton.cdiv(n, tile),)
        partials = torch.empty(grid[0], dtype=torch.uint64)
        mod.hash_tiles32_kernel_blocked[grid](
            u32, partials, n, seed1=seed & 0xFFFFFFFF, seed2=((seed * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF,
            FM_C1=mod.FMIX32_C1, FM_C2=mod.FMIX32_C2, POS_A=mod.POS_C1, POS_B=mod.POS_C2,
            TILE=tile, BLOCK=block, USE_CG=True, num_warps=4, num_stages=4)
        cur = partials
        while cur.numel() > 1:
            nxt = torch.empty(triton.cdiv(cur.numel(), chunk), dtype=torch.uint64)
            mod.add_tree_reduce_u64_kernel[(nxt.numel(),)](cur, nxt, cur.numel(), CHUNK=chunk)
            cur = nxt
        return mod._final_splitmix64(int(cur.item()))

    for n in json.loads(sys.argv[2]):
        raw = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
        out[str(n)] = kernel_hash(raw)
    # the reduce kernel on its own, with a small CHUNK so the tree has levels: a plain sum mod 2**64
    vals = np.random.default_rng(7).integers(0, 2**63, 37, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    cur = torch.from_numpy(vals.view(np.int64)).view(torch.uint64)
    while cur.numel() > 1:
        nxt = torch.empty(triton.cdiv(cur.numel(), 4), dtype=torch.uint64)
        mod.add_tree_reduce_u64_kernel[(nxt.numel(),)](cur, nxt, cur.numel(), CHUNK=4)
        cur = nxt
    out["reduce"] = [int(v) for v in vals.tolist()], int(cur.view(torch.int64).item()) & (2**64 - 1)
    out["final"] = {str(x): mod._final_splitmix64(x) for x in (0, 1, 2**64 - 1, 0x0123456789ABCDEF)}
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def sglang_kernel_results() -> dict:
    pytest.importorskip("triton", reason="Triton runs SGLang's kernel (in its interpreter here)")
    kernel = sglang_file("sglang/kernels/ops/memory/gpu_tensor_hash.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(kernel), json.dumps(SIZES)], capture_output=True, text=True, env=env, timeout=900
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("n", SIZES)
def test_sglang_gpu_is_bit_identical_to_sglangs_own_kernel(sglang_kernel_results: dict, n: int) -> None:
    raw = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert _sglang_gpu_host(raw) == sglang_kernel_results[str(n)]
    assert reference_sglang_gpu(raw) == sglang_kernel_results[str(n)]


def test_sglangs_reduce_and_finaliser_are_what_wcviz_assumes(sglang_kernel_results: dict) -> None:
    from wcviz.digest._engines import _final64

    vals, total = sglang_kernel_results["reduce"]
    assert total == sum(vals) % 2**64
    for x, want in sglang_kernel_results["final"].items():
        assert _final64(int(x)) == want
