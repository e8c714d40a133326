"""The GPU digest, checked and timed: the prepared script for a lent GPU (BENCHMARKS.md's GPU table).

    python benchmarks/gpu.py [--gib 1] [--repeat 10] [--json OUT.json] [--record wcviz/gpu_runs.json]

1. Identity: the Triton kernel on the GPU gives the CPU's hex (numba on the
   tensor's ``.cpu()`` copy) for several dtypes and sizes (chunk boundaries,
   a transposed view, a slice at an odd byte offset), alone and batched.
2. Speed, side by side on one ``--gib`` GiB bf16 tensor: the Triton kernel
   (every block/warp configuration tried, each checked identical), the eager
   torch reference on the same GPU, a device-to-device copy (the bandwidth
   ceiling) and a one-mix-per-lane kernel (the compute floor).
3. Whole-model batching: a Llama-3-8B-shaped bf16 model (291 tensors) and 1000
   small tensors, one batched call vs one call per tensor.

It prints markdown tables and exits 1 if any identity check fails. ``--record``
appends the measured rates to the file ``wcviz bench`` reads its GPU figures
from, labelled with the date and device. ``--device cpu --smoke`` runs the whole
script on tiny sizes under ``TRITON_INTERPRET=1`` (what the tests do), to keep
this script working on machines without a GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

from wcviz.digest import ENGINE_ALGORITHMS, _spec, _triton, digest_hex, digest_many, tensor_digest
from wcviz.digest._triton import _mix

TARGET_GBPS = 1000.0  # on >= 1 GiB of bf16 on an H200
TARGET_VS_EAGER = 25.0


@triton.jit
def _floor_kernel(x, out, n, BLOCK: tl.constexpr):
    """One SplitMix64 mix per lane, xor-reduced per block: the least work any digest kernel does."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + offs, mask=offs < n, other=0).to(tl.uint64, bitcast=True)
    tl.store(out + pid, tl.xor_sum(_mix(v), axis=0).to(tl.int64, bitcast=True))


def floor_pass(lanes: torch.Tensor, out: torch.Tensor, block: int = 1024) -> None:
    n = lanes.numel()
    _floor_kernel[(triton.cdiv(n, block),)](lanes, out, n, BLOCK=block)


class Timer:
    """Best-of-``repeat`` seconds of a function, synchronising the device around each run."""

    def __init__(self, device: torch.device, repeat: int) -> None:
        self.device, self.repeat = device, repeat

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], object], repeat: int | None = None) -> float:
        fn()  # warm: compilation, allocator
        self.sync()
        best = float("inf")
        for _ in range(repeat or self.repeat):
            t0 = time.perf_counter()
            fn()
            self.sync()
            best = min(best, time.perf_counter() - t0)
        return best


def random_tensor(numel: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Random bytes of ``numel`` elements of ``dtype`` (any dtype: made as bytes, then viewed)."""
    g = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, device=device, generator=g)
    return raw.view(dtype) if dtype != torch.bool else raw.bool()


def identity(device: torch.device, smoke: bool) -> list[tuple[str, str, bool]]:
    """(case, dtype, same hex as the CPU) for every identity case."""
    C = _spec.CHUNK
    lane_counts = [0, 3, 130] if smoke else [0, 1, 3, 1000, 4097, C - 1, C, C + 1, 3 * C + 5]
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int32, torch.int64, torch.bool]
    if smoke:
        dtypes = [torch.bfloat16, torch.int8]
    dtypes += [d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None]
    rows, batch = [], {}
    for i, dtype in enumerate(dtypes):
        per_lane = 8 // dtype.itemsize
        for lanes in lane_counts:
            numel = lanes * per_lane - (1 if lanes and per_lane > 1 else 0)  # a part-filled last lane
            x = random_tensor(numel, dtype, device, seed=1000 * i + lanes % 997)
            ok = digest_hex(x, backend="triton") == digest_hex(x.cpu(), backend="numba")
            rows.append((f"{numel} elements", str(dtype), ok))
            if lanes < 5000:
                batch[f"{dtype}/{numel}"] = x
    base = random_tensor(64 * 48, torch.bfloat16, device, seed=7).view(64, 48)
    odd = random_tensor(4099, torch.int8, device, seed=8)[3:]
    for case, x in (("transposed view", base.t()), ("slice at odd byte offset", odd)):
        rows.append((case, str(x.dtype), digest_hex(x, backend="triton") == digest_hex(x.cpu(), backend="numba")))
        batch[case] = x
    ok = _triton.self_check(device, block=1 << 18 if smoke else _triton.BLOCK)
    rows.append(("self-check (what backend 'auto' runs first)", "int64 lanes", ok))
    got = digest_many(batch, backend="triton")
    want = digest_many({k: v.cpu() for k, v in batch.items()}, backend="numba")
    rows.append((f"batch of {len(batch)} tensors", "mixed", got == want))
    return rows


def speed(device: torch.device, gib: float, timer: Timer, smoke: bool) -> tuple[list[tuple[str, float]], dict[str, float]]:
    """(method, GB/s) side by side on one bf16 tensor, and the best Triton configuration."""
    x = random_tensor(int(gib * 2**30) // 2, torch.bfloat16, device, seed=1)
    nbytes = x.numel() * 2
    lanes = x.view(torch.int64)
    seed = _spec.seeds(str(x.dtype), tuple(x.shape), nbytes)
    want = _triton.lanes_digest(lanes, seed)
    rows: list[tuple[str, float]] = []
    configs = [(1024, 4)] if smoke else [(b, w) for b in (512, 1024, 2048, 4096) for w in (4, 8)]
    best = {"gbps": 0.0}
    for block, warps in configs:
        got = _triton.lanes_digest_many([lanes], [seed], block=block, num_warps=warps)[0]
        if not torch.equal(got, want):
            raise SystemExit(f"Triton block={block} num_warps={warps} gives another digest than the default")
        s = timer(lambda b=block, w=warps: _triton.lanes_digest_many([lanes], [seed], block=b, num_warps=w))
        rows.append((f"Triton kernel (block {block}, {warps} warps)", nbytes / s / 1e9))
        if rows[-1][1] > best["gbps"]:
            best = {"gbps": rows[-1][1], "block": block, "num_warps": warps}
    rows.append(("Triton via tensor_digest (default config)", nbytes / timer(lambda: tensor_digest(x, backend="triton")) / 1e9))
    rows.append(("eager torch reference, same device", nbytes / timer(lambda: tensor_digest(x, backend="torch"), 1 if smoke else 3) / 1e9))
    dst = torch.empty_like(x)
    rows.append(("device-to-device copy (bytes read)", nbytes / timer(lambda: dst.copy_(x)) / 1e9))
    out = torch.empty(triton.cdiv(lanes.numel(), 1024), dtype=torch.int64, device=device)
    rows.append(("one mix per lane (compute floor)", nbytes / timer(lambda: floor_pass(lanes, out)) / 1e9))
    return rows, best


def engines(device: torch.device, gib: float, timer: Timer, smoke: bool) -> tuple[list[tuple[str, bool]], list[tuple[str, float]]]:
    """The engines' own checksums on the device: identity with the CPU path, and GB/s beside a device copy.

    ``sglang-gpu`` runs on the device (wcviz's vectorised torch path, bit-identical to
    SGLang's Triton kernel); ``vllm-sha256``/``sglang-cpu`` copy the bytes to the host
    and hash there (as vLLM's and SGLang's own code does), so their rate is the copy's and SHA-256's.
    """
    checks = []
    for numel in ([0, 3, 5000] if smoke else [0, 1, 3, 8191, 8192 * 4 + 3, 3 * 8192 * 4 + 7]):
        x = random_tensor(numel, torch.bfloat16, device, seed=numel % 991)
        for algo in ENGINE_ALGORITHMS:
            checks.append((f"{algo} {numel} bf16", str(digest_hex(x, algo=algo)) == str(digest_hex(x.cpu(), algo=algo))))
    odd = random_tensor(4099, torch.bfloat16, device, seed=7)[1:4097]  # a byte offset of 2: not a whole int32 word
    for algo in ENGINE_ALGORITHMS:
        checks.append((f"{algo} 4096 bf16 at byte offset 2", str(digest_hex(odd, algo=algo)) == str(digest_hex(odd.cpu(), algo=algo))))
    x = random_tensor(int(gib * 2**30) // 2, torch.bfloat16, device, seed=3)
    nbytes = x.numel() * 2
    rows = [(f"{algo} on {device.type}", nbytes / timer(lambda a=algo: digest_hex(x, algo=a), 1 if smoke else 3) / 1e9) for algo in ENGINE_ALGORITHMS]
    rows.append(("nemo-rl-v3 (Triton), same tensor", nbytes / timer(lambda: tensor_digest(x, backend="triton")) / 1e9))
    return checks, rows


def batching(device: torch.device, timer: Timer, smoke: bool) -> list[tuple[str, int, float, float, float]]:
    """(case, tensors, GB, seconds batched, seconds one call per tensor)."""
    from wcviz.bench import ZOO
    from wcviz.sim.model import parameter_shapes

    out = []
    model = "sim-tiny" if smoke else "llama-3-8b"
    shapes = parameter_shapes(ZOO[model])
    if smoke:  # the interpreter runs a program in milliseconds: a few of the smallest tensors
        shapes = dict(sorted(shapes.items(), key=lambda kv: _numel(kv[1]))[:6])
    cases = {
        f"{model} (bf16)": {n: random_tensor(_numel(s), torch.bfloat16, device, i).view(s) for i, (n, s) in enumerate(shapes.items())},
        "small tensors (4096 bf16 each)": {f"s{i}": random_tensor(4096, torch.bfloat16, device, i) for i in range(4 if smoke else 1000)},
    }
    for case, sd in cases.items():
        nbytes = sum(t.numel() * 2 for t in sd.values())
        runs = 1 if smoke else 3
        batched = timer(lambda sd=sd: digest_many(sd, backend="triton"), runs)
        looped = timer(lambda sd=sd: [tensor_digest(t, backend="triton") for t in sd.values()], runs)
        out.append((case, len(sd), nbytes / 1e9, batched, looped))
        del sd
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size of the timed bf16 tensor (default 1 GiB)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu with TRITON_INTERPRET=1 and --smoke")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script itself, measures nothing useful")
    ap.add_argument("--json", type=Path, help="write every result here")
    ap.add_argument("--record", type=Path, help="append the rates to this recorded-runs file (wcviz/gpu_runs.json)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: nothing measured (use --device cpu --smoke under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    if device.type == "cpu" and not _triton.interpreting():
        print("--device cpu needs TRITON_INTERPRET=1 (Triton compiles for GPUs only)", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()}), Triton interpreter"
    today = dt.date.today().isoformat()
    print(f"{today} on {name}; torch {torch.__version__}, triton {triton.__version__}")
    timer = Timer(device, 1 if args.smoke else args.repeat)

    checks = identity(device, args.smoke)
    bad = [c for c in checks if not c[2]]
    print(f"\n## Identity with the CPU (numba): {len(checks) - len(bad)}/{len(checks)} cases identical\n")
    print("| case | dtype | same hex |\n|---|---|---|")
    for case, dtype, ok in checks:
        print(f"| {case} | {dtype} | {'yes' if ok else '**NO**'} |")

    gib = 1 / 8192 if args.smoke else args.gib
    rows, best = speed(device, gib, timer, args.smoke)
    eager = next(g for m, g in rows if m.startswith("eager"))
    print(f"\n## Speed on {gib:g} GiB of bf16 (best of {timer.repeat})\n")
    print("| method | GB/s | × eager torch |\n|---|---:|---:|")
    for method, gbps in rows:
        print(f"| {method} | {gbps:.1f} | {gbps / eager:.1f}× |")
    copy = next(g for m, g in rows if m.startswith("device-to-device"))
    floor = next(g for m, g in rows if m.startswith("one mix"))
    print(f"\nbest Triton config: block {best.get('block')}, {best.get('num_warps')} warps: {best['gbps']:.1f} GB/s = "
          f"{best['gbps'] / copy:.0%} of the copy, {best['gbps'] / floor * 6.6:.0%} of the compute bound (floor / 6.6)")
    print(f"target ≥ {TARGET_GBPS:.0f} GB/s: {'met' if best['gbps'] >= TARGET_GBPS else 'NOT met'}; "
          f"target ≥ {TARGET_VS_EAGER:.0f}× eager: {'met' if best['gbps'] >= TARGET_VS_EAGER * eager else 'NOT met'} "
          f"({best['gbps'] / eager:.1f}×)")

    engine_checks, engine_rows = engines(device, gib, timer, args.smoke)
    bad += [(c, "bf16", ok) for c, ok in engine_checks if not ok]
    print(f"\n## The engines' own checksums: {sum(ok for _, ok in engine_checks)}/{len(engine_checks)} identical to the CPU\n")
    print("| method | GB/s |\n|---|---:|")
    for method, gbps in engine_rows:
        print(f"| {method} | {gbps:.1f} |")

    batch = batching(device, timer, args.smoke)
    print(f"\n## Whole-model batching (best of {1 if args.smoke else 3})\n")
    print("| case | tensors | GB | batched s | one call per tensor s | speed-up |\n|---|---:|---:|---:|---:|---:|")
    for case, n, gb, b, loop in batch:
        print(f"| {case} | {n} | {gb:.3f} | {b:.4f} | {loop:.4f} | {loop / b:.1f}× |")

    small = next(r for r in batch if r[0].startswith("small"))
    triton_gbps = next(g for m, g in rows if m.startswith("Triton via"))
    result = {
        "date": today, "device": name, "torch": torch.__version__, "triton": triton.__version__,
        "identity": [{"case": c, "dtype": d, "ok": ok} for c, d, ok in checks],
        "speed_gbps": dict(rows), "best_config": best, "engines": {"identity": dict(engine_checks), "gbps": dict(engine_rows)}, "batching": [dict(zip(("case", "tensors", "gb", "batched_s", "looped_s"), r)) for r in batch],
        "rates": [
            {"backend": "triton", "gbps": triton_gbps, "overhead_s": max(small[3] / small[1] - 8192 / (triton_gbps * 1e9), 0.0)},
            {"backend": "torch", "gbps": eager, "overhead_s": None},
        ],
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.record and not bad and device.type == "cuda":
        runs = json.loads(args.record.read_text()) if args.record.exists() else {"runs": []}
        for r in result["rates"]:
            if r["overhead_s"] is not None:
                runs["runs"].append({"date": today, "device": name, **r})
        args.record.write_text(json.dumps(runs, indent=1) + "\n")
        print(f"\nrecorded the rates in {args.record}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
