"""The client's share of a fan-out, side by side in one process: 256 agents' JSON answers into the one frame.

    python benchmarks/fanout_client.py

No servers: the bodies 256 agents x 500 parameters would send are made here (each agent's
table, once in the rows form and once in the columns form of ``/v1/digests``), then turned
into the one validated frame three ways, CPU time of this process, best of 3: a frame per
agent validated again after concatenation (what the client did first); the rows form read
into one frame built once; the columns form read into one frame built once (what
``fetch_agents`` asks for now). All frames are checked equal first.
"""

import time, json
from wcviz.sources._fleet import KEY, rows_frame, assemble, assemble_tables
from wcviz.sources._wire import RankTable, table_of_body, wrong_identity
N, P = 256, 500
bodies = []
for r in range(N):
    ident = {"role": "engine", "rank": r, "dp": r // 32, "pp": (r // 8) % 4, "tp": r % 8, "ep": None}
    names = [f"model.layers.{i // 16}.mlp.p{i % 16}.weight" for i in range(P)]
    cols = {"name": names, "digest": ["%032x" % (r * P + i) for i in range(P)], "algo": ["nemo-rl-v3"] * P, "dtype": ["bfloat16"] * P,
            "shape": ["[4096]"] * P, "nbytes": [8192] * P, "device": ["cpu"] * P, "seconds": [1e-5] * P}
    table = RankTable(P, cols, {"host": "h", "phase": "current", **ident})
    bodies.append((f"http://127.0.0.1:{9000 + r}", ident, json.dumps({"rows": table.rows()}), json.dumps(table.body())))
def old():
    collected = []
    for url, ident, body, _ in bodies:
        rows = json.loads(body)["rows"]
        collected.append((url, ident, {}, rows_frame(rows, ident, url, "/v1/digests")))
    return assemble(collected, [], targets=[u for u, *_ in bodies])
def one_frame(which):
    collected = []
    for url, ident, *wire in bodies:
        table = table_of_body(json.loads(wire[which]))
        assert wrong_identity(table, ident, KEY) is None
        collected.append((url, ident, {}, table))
    return assemble_tables(collected, [], "/v1/digests", targets=[u for u, *_ in bodies])
rows_form, columns_form = (lambda: one_frame(0)), (lambda: one_frame(1))
a = old(); b = rows_form(); c = columns_form()
import pandas as pd
pd.testing.assert_frame_equal(a.frame, b.frame)
pd.testing.assert_frame_equal(a.frame, c.frame)
runs = (("before: a frame per agent, validated again", old), ("rows form, one frame built once", rows_form),
        ("columns form, one frame built once", columns_form))
for label, fn in runs:
    best = min((lambda: (t := time.process_time(), fn(), time.process_time() - t)[2])() for _ in range(3))
    print(f"{label}: {best:.2f} s of CPU for {N} agents x {P} rows")

# The agent's share: the body it answers for 500 bf16 tensors of 256 values (digests, rows, JSON), best of 10.
import torch
from wcviz.sources import from_named_tensors, named_tensor_rows, named_tensor_table
from wcviz.digest import digest_many
gen = torch.Generator().manual_seed(0)
named = [(f"model.layers.{i // 16}.mlp.p{i % 16}.weight", torch.randn(256, generator=gen).to(torch.bfloat16)) for i in range(P)]
ident = {"role": "engine", "rank": 3, "dp": 0, "pp": 0, "tp": 3}
def agent_before():  # what an agent did before: a frame built, then taken apart into JSON rows
    frame = from_named_tensors(named, progress=False, **ident)
    return json.dumps({"rows": json.loads(frame.to_json(orient="records"))})
def agent_rows():
    return json.dumps({"rows": named_tensor_rows(named, progress=False, **ident)})
def agent_columns():
    return json.dumps(named_tensor_table(named, progress=False, **ident).body())
digest_many(named)  # compile / load the kernels
assert [r["digest"] for r in json.loads(agent_rows())["rows"]] == [str(d) for d in digest_many(named).values()]
untimed = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # digest times differ call to call
assert untimed(table_of_body(json.loads(agent_columns())).rows()) == untimed(json.loads(agent_rows())["rows"])
for label, fn in (("agent before: frame, then rows", agent_before), ("agent: rows", agent_rows), ("agent: columns", agent_columns)):
    fn()
    best = min((lambda: (t := time.perf_counter(), fn(), time.perf_counter() - t)[2])() for _ in range(10))
    print(f"{label}: {best * 1e3:.1f} ms for {P} parameters")
