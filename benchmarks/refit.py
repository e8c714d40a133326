"""Refit over the colocated CPU transport with verification off, log and enforce, side by side.

    python benchmarks/refit.py [--layers 9] [--hidden 2048] [--repeat 3] [--buffer-mib 256]

A Llama-shaped bf16 model of about 1 GiB (embedding, per-layer attention and
MLP matrices, norms, head) is sent from this process to receiver processes
(spawned, one per mode) that copy every tensor into their own model. The modes
take turns, ``--repeat`` rounds of one refit each; the best wall time of
``IPCSender.send`` is reported (it returns only after the receiver acknowledged
the last batch and, when verifying, sent its digests). Ratios are against off.
``log, overlap=True`` digests beside the copy at both ends (a worker thread on
one core digests while the calling thread packs or loads); the others digest,
then copy, on numba's parallel kernel. ``keep_buffers=False`` is the sender
before it kept its staging buffers between sends: fresh shared memory, faulted
in and zeroed, every refit.
Beside each wall time, the CPU time both processes spent in that send (Linux:
the receiver's from ``/proc``): what the refit costs the machine, and with the
number of cores, the least wall time any overlap of that work could reach.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import time

import torch

from wcviz.refit import IPCReceiver, IPCSender


def model(layers: int, hidden: int, vocab: int = 32000) -> dict[str, torch.Tensor]:
    """Llama-like shapes: GQA with 4x fewer KV heads, MLP width 2.75x, bf16."""
    g = torch.Generator().manual_seed(0)
    inter, kv = int(hidden * 2.75), hidden // 4

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd |= {
            p + "input_layernorm.weight": w(hidden),
            p + "self_attn.q_proj.weight": w(hidden, hidden),
            p + "self_attn.k_proj.weight": w(kv, hidden),
            p + "self_attn.v_proj.weight": w(kv, hidden),
            p + "self_attn.o_proj.weight": w(hidden, hidden),
            p + "post_attention_layernorm.weight": w(hidden),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }
    sd |= {"model.norm.weight": w(hidden), "lm_head.weight": w(vocab, hidden)}
    return sd


def receiver(address: str, layers: int, hidden: int, mode: str, streams: int, overlap: bool) -> None:
    torch.set_num_threads(1)
    mine = {n: torch.zeros_like(t) for n, t in model(layers, hidden).items()}
    metadata = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in mine.items()}

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in batch:
            mine[name].copy_(t)

    with IPCReceiver(address, metadata, load, verify=mode, timeout_s=300, overlap=overlap) as r:
        for _ in range(streams):
            r.serve()


def stop(proc: mp.process.BaseProcess) -> None:
    proc.join(60)
    if proc.is_alive():
        proc.kill()


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of this process plus process ``pid``; NaN where ``/proc`` is not there."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return time.process_time() + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--buffer-mib", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sd = model(args.layers, args.hidden)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    print(f"model: {len(sd)} tensors, {nbytes / 2**30:.2f} GiB bf16; staging buffer {args.buffer_mib} MiB x 2; "
          f"best of {args.repeat}")
    ctx = mp.get_context("spawn")
    runs: dict[str, tuple[str, dict[str, bool]]] = {
        "off": ("off", {}),
        "off, keep_buffers=False": ("off", {"keep_buffers": False}),
        "log": ("log", {}),
        "log, keep_buffers=False": ("log", {"keep_buffers": False}),
        "log, overlap=True": ("log", {"overlap": True}),
        "enforce": ("enforce", {}),
    }
    times: dict[str, list[tuple[float, float]]] = {label: [] for label in runs}
    with contextlib.ExitStack() as stack:
        ends = {}  # label -> (sender, its receiver's process)
        for label, (mode, options) in runs.items():
            overlap = options.get("overlap", False)
            s = stack.enter_context(
                IPCSender(verify=mode, buffer_bytes=args.buffer_mib << 20, timeout_s=300, **options)
            )
            proc = ctx.Process(
                target=receiver, args=(s.address, args.layers, args.hidden, mode, args.repeat + 1, overlap)
            )
            proc.start()
            stack.callback(stop, proc)
            ends[label] = (s, proc)
        for s, _ in ends.values():
            s.send(sd)  # warm-up: the receiver's first touch of its buffers, numba's kernel cache
        for _ in range(args.repeat):  # the modes in alternation: a slow minute of the host hits them all
            for label, (s, proc) in ends.items():
                c0 = cpu_seconds(proc.pid)
                t0 = time.perf_counter()
                result = s.send(sd)
                times[label].append((time.perf_counter() - t0, cpu_seconds(proc.pid) - c0))
                assert runs[label][0] == "off" or result.ok, result.describe()
    best = {label: min(t) for label, t in times.items()}
    cores = os.cpu_count() or 1
    print(f"| mode | seconds | GB/s | × off | CPU s, both processes | CPU s / {cores} cores |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, (sec, cpu) in best.items():
        print(f"| {mode} | {sec:.3f} | {nbytes / sec / 1e9:.2f} | {sec / best['off'][0]:.2f}× | {cpu:.3f} | {cpu / cores:.3f} |")


if __name__ == "__main__":
    main()
