"""The client's share of a fan-out, side by side in one process: 256 agents' JSON answers into the one frame.

    python benchmarks/fanout_client.py

No servers: the bodies 256 agents x 500 parameters would send are made here, then turned
into the one validated frame two ways, CPU time of this process, best of 3: a frame per
agent validated again after concatenation (what the client did before), and the rows
checked per agent and built into one frame once (what it does now). Both frames are
checked equal first.
"""

import time, json
from wcviz.sources._fleet import rows_frame, assemble, check_rows, frames_of_rows
N, P = 256, 500
bodies = []
for r in range(N):
    ident = {"role": "engine", "rank": r, "dp": r // 32, "pp": (r // 8) % 4, "tp": r % 8, "ep": None}
    rows = [{"name": f"model.layers.{i // 16}.mlp.p{i % 16}.weight", "digest": "%032x" % (r * P + i), "algo": "nemo-rl-v3",
             "dtype": "bfloat16", "shape": "[4096]", "nbytes": 8192, "device": "cpu", "seconds": 1e-5, "host": "h", "phase": "current", **ident}
            for i in range(P)]
    bodies.append((f"http://127.0.0.1:{9000 + r}", ident, json.dumps({"rows": rows})))
def old():
    collected = []
    for url, ident, body in bodies:
        rows = json.loads(body)["rows"]
        collected.append((url, ident, {}, rows_frame(rows, ident, url, "/v1/digests")))
    return assemble(collected, [], targets=[u for u, _, _ in bodies])
def new():
    collected = []
    for url, ident, body in bodies:
        rows = check_rows(json.loads(body)["rows"], ident, "/v1/digests")
        collected.append((url, ident, {}, rows))
    frames, bad = frames_of_rows(collected, "/v1/digests")
    return assemble(frames, bad, targets=[u for u, _, _ in bodies], validated=True)
a = old(); b = new()
import pandas as pd
pd.testing.assert_frame_equal(a.frame, b.frame)
for label, fn in (("before: a frame per agent, validated again", old), ("after: one frame, built once", new)):
    best = min((lambda: (t := time.process_time(), fn(), time.process_time() - t)[2])() for _ in range(3))
    print(f"{label}: {best:.2f} s of CPU for {N} agents x {P} rows")

# The agent's share: the body it answers for 500 bf16 tensors of 256 values (digests, rows, JSON), best of 10.
import torch
from wcviz.sources import from_named_tensors, named_tensor_rows
from wcviz.digest import digest_many
gen = torch.Generator().manual_seed(0)
named = [(f"model.layers.{i // 16}.mlp.p{i % 16}.weight", torch.randn(256, generator=gen).to(torch.bfloat16)) for i in range(P)]
ident = {"role": "engine", "rank": 3, "dp": 0, "pp": 0, "tp": 3}
def agent_before():  # what an agent did before: a frame built, then taken apart into JSON rows
    frame = from_named_tensors(named, progress=False, **ident)
    return json.dumps({"rows": json.loads(frame.to_json(orient="records"))})
def agent_after():
    return json.dumps({"rows": named_tensor_rows(named, progress=False, **ident)})
digest_many(named)  # compile / load the kernels
assert [r["digest"] for r in json.loads(agent_after())["rows"]] == [str(d) for d in digest_many(named).values()]
for label, fn in (("agent before: frame, then rows", agent_before), ("agent after: rows only", agent_after)):
    fn()
    best = min((lambda: (t := time.perf_counter(), fn(), time.perf_counter() - t)[2])() for _ in range(10))
    print(f"{label}: {best * 1e3:.1f} ms for {P} parameters")
