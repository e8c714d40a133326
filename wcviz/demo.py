"""``make demo``: digest a checkpoint, catch a one-bit change, then refit an engine process.

Part 1 runs the real CLI on real files: write a small sharded checkpoint,
digest it, compare it with a copy where one bit flipped. Part 2 runs a real
refit: a trainer (this process) streams its weights to an engine process over
the colocated transport with verification ``log``, once cleanly and once with
a bit flipped on the wire, and the sender names the parameter that broke.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

__all__ = ["tiny_llama_state_dict", "write_sharded", "refit_demo", "main"]


def tiny_llama_state_dict(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 256, seed: int = 0) -> dict:
    """A Llama-shaped state dict with Hugging Face names, built in code (no downloads)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads
    inter = hidden * 3

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        sd[p + "self_attn.q_proj.weight"] = w(heads * head_dim, hidden)
        sd[p + "self_attn.k_proj.weight"] = w(kv_heads * head_dim, hidden)
        sd[p + "self_attn.v_proj.weight"] = w(kv_heads * head_dim, hidden)
        sd[p + "self_attn.o_proj.weight"] = w(hidden, heads * head_dim)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        sd[p + "mlp.gate_proj.weight"] = w(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = w(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = w(hidden, inter)
    sd["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    sd["lm_head.weight"] = w(vocab, hidden)
    return sd


def write_sharded(sd: dict, directory: Path, shards: int = 2) -> Path:
    """Write ``sd`` as ``shards`` safetensors files plus a Hugging Face index."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    names = list(sd)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: sd[n].contiguous() for n in names[s::shards]}
        save_file(part, str(directory / fname))
        weight_map.update({n: fname for n in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return directory


def _engine(address: str, faults: object, streams: int) -> None:
    """The engine process: holds its own copy of the model, loads what the trainer streams."""
    from wcviz.refit import IPCReceiver

    model = {n: t.clone().zero_() for n, t in tiny_llama_state_dict().items()}
    metadata = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in model.items()}

    def load_weights(batch: list) -> None:
        for name, t in batch:
            model[name].copy_(t)

    with IPCReceiver(address, metadata, load_weights, verify="log", faults=faults, timeout_s=60) as rx:
        for _ in range(streams):
            rx.serve()


def refit_demo() -> int:
    """Two refits with verification ``log``: a clean one, then one with a bit flipped on the wire."""
    import multiprocessing as mp

    from wcviz.refit import Fault, FaultPlan, IPCSender

    victim = "model.layers.0.mlp.down_proj.weight"
    plans = {"clean": FaultPlan(), "bit flipped on the wire": FaultPlan((Fault("flip_bit", "wire", (victim,), bit=77),))}
    sd = tiny_llama_state_dict()
    worst = 0
    for label, faults in plans.items():
        with IPCSender(verify="log", faults=faults, buffer_bytes=64 << 10, timeout_s=60) as tx:
            engine = mp.get_context("spawn").Process(target=_engine, args=(tx.address, faults, 1))
            engine.start()
            try:
                result = tx.send(sd)
            finally:
                engine.join(30)
                if engine.is_alive():
                    engine.kill()
        print(f"refit ({label}): {result.describe()}")
        worst = max(worst, len(result.bad))
    return worst


def main(argv: list[str] | None = None) -> int:
    import torch

    from wcviz.cli import main as cli

    ap = argparse.ArgumentParser(prog="python -m wcviz.demo", description=__doc__)
    ap.add_argument("--out", default="demo-out", help="where to write the checkpoints (default demo-out/)")
    out = Path(ap.parse_args(argv).out)
    shutil.rmtree(out, ignore_errors=True)
    sd = tiny_llama_state_dict()
    sent = write_sharded(sd, out / "sent")
    bad = {k: v.clone() for k, v in sd.items()}
    victim = "model.layers.1.self_attn.k_proj.weight"
    bad[victim].view(torch.int16).view(-1)[5] ^= 1  # one bit in one element
    served = write_sharded(bad, out / "served")

    print(f"$ wcviz digest {sent}", flush=True)
    cli(["digest", str(sent), "--no-progress"])
    print(f"\n$ wcviz digest {sent} --out {out / 'sent.csv'}", flush=True)
    cli(["digest", str(sent), "--out", str(out / "sent.csv"), "--no-progress"])
    print(f"\n$ wcviz compare {out / 'sent.csv'} {served}   # one bit flipped in {victim}", flush=True)
    rc = cli(["compare", str(out / "sent.csv"), str(served), "--no-progress"])
    print(f"(exit status {rc}: 1 means something differs)")

    print("\n# refit: trainer -> engine process over shared memory + ZMQ, verify: log", flush=True)
    broken = refit_demo()
    return 0 if rc == 1 and broken == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
