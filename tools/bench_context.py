"""Long-context benchmark: compiled per-device memory of the train step per attention kind and
sequence length, the planner's estimate beside it, and the context collectives in the HLO against
the planner's formulas (:mod:`meshtrain.analysis.context_comms`).

    python tools/bench_context.py                       # the issue's checks (tiny model, 8 devices)
    python tools/bench_context.py --seq-lens 1024,4096 --kinds flash,ring --json

Figures (compile only, nothing runs; ``temp`` = XLA's ``temp_size_in_bytes`` per device):

* ``ring/ulysses at cp=8 ÷ flash at cp=1`` at ``--long`` tokens (target ≤ 0.2);
* ``flash ÷ dense`` at ``--mid`` tokens (target ≤ 0.25);
* per kind: HLO bytes per step of its collective over the context axes vs the planner's estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import meshtrain as mt  # noqa: E402
from meshtrain.analysis.collectives import hlo_collectives  # noqa: E402
from meshtrain.analysis.compiled import MeasuredMemory, step_inputs  # noqa: E402
from meshtrain.analysis.context_comms import context_collectives  # noqa: E402
from meshtrain.analysis.memory import estimate_memory  # noqa: E402

#: kind -> (recipe, mesh overrides); cp=1 kinds run on one device
LAYOUTS = {
    "dense": ("dp", {"data": 1}),
    "flash": ("dp", {"data": 1}),
    "all_gather": ("cp", {"context": 8}),
    "ring": ("cp", {"context": 8}),
    "ulysses": ("cp", {"context": 8}),
    "usp": ("fsdp_cp_usp", {"fsdp": 1, "context": 4, "ulysses": 2}),
}


def plan_for(kind: str, seq_len: int, batch: int = 1, model: str = "tiny"):
    recipe_name, sizes = LAYOUTS[kind]
    recipe = mt.get_recipe(recipe_name).with_mesh(**sizes).with_options(attention=kind)
    n = 1
    for v in sizes.values():
        n *= v
    mesh = recipe.mesh.build(jax.devices()[:n])
    cfg = mt.models.get_config(model, max_seq_len=max(seq_len, 256))
    abstract = mt.abstract_state(mt.models.model_factory(cfg), __import__("optax").adamw(1e-3))
    return mt.make_plan(abstract, recipe, mesh, batch=mt.BatchSpec(batch, seq_len)), cfg


def measure(kind: str, seq_len: int, collectives: bool = False) -> dict:
    """Compiled memory (and, with ``collectives``, the context collectives) of one step."""
    plan, cfg = plan_for(kind, seq_len)
    state, batch = step_inputs(plan)
    compiled = mt.make_train_step(plan).lower(state, batch).compile()
    mem = MeasuredMemory.of(compiled)
    est = estimate_memory(plan, cfg)
    out = {"kind": kind, "seq_len": seq_len, "devices": plan.mesh.size, "temp": mem.temp, "peak": mem.peak,
           "estimate": int(est.total)}
    if collectives:
        axes = set(plan.rules.table("activations")["seq"].mesh_axes) if kind not in ("dense", "flash") else set()
        hlo = {}
        for c in hlo_collectives(compiled.as_text(), plan.mesh):
            if c.axes and set(c.axes) <= axes:
                hlo[c.kind] = hlo.get(c.kind, 0) + c.bytes_per_step
        planned = {}
        for row in context_collectives(plan, cfg, backend="cpu"):
            planned[row["kind"]] = planned.get(row["kind"], 0) + row["bytes_per_step"]
        out["hlo_bytes"], out["planned_bytes"] = hlo, planned
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", default="", help="extra sweep, e.g. 1024,2048,4096 (all kinds)")
    p.add_argument("--kinds", default=",".join(LAYOUTS))
    p.add_argument("--long", type=int, default=16384, help="sequence for ring/ulysses cp=8 vs flash cp=1")
    p.add_argument("--mid", type=int, default=8192, help="sequence for flash vs dense")
    p.add_argument("--comm-seq", type=int, default=1024, help="sequence for the collective-bytes check")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    rows = []
    checks = {}
    if args.long:
        flash = measure("flash", args.long)
        rows.append(flash)
        for kind in ("ring", "ulysses"):
            r = measure(kind, args.long)
            rows.append(r)
            checks[f"{kind} cp=8 / flash cp=1 temp at {args.long}"] = round(r["temp"] / flash["temp"], 4)
    if args.mid:
        f, d = measure("flash", args.mid), measure("dense", args.mid)
        rows += [f, d]
        checks[f"flash / dense temp at {args.mid}"] = round(f["temp"] / d["temp"], 4)
    comm = [measure(k, args.comm_seq, collectives=True) for k in kinds if k not in ("dense", "flash")]
    sweep = [measure(k, int(t)) for t in args.seq_lens.split(",") if t for k in kinds]
    result = {"checks": checks, "memory": rows + sweep, "collectives": comm}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for name, value in checks.items():
        print(f"{name}: {value}")
    print(f"{'kind':<11} {'T':>6} {'devices':>7} {'temp MiB':>10} {'peak MiB':>10} {'estimate MiB':>12}")
    for r in rows + sweep:
        print(f"{r['kind']:<11} {r['seq_len']:>6} {r['devices']:>7} {r['temp'] / 2**20:>10.1f} "
              f"{r['peak'] / 2**20:>10.1f} {r['estimate'] / 2**20:>12.1f}")
    for r in comm:
        print(f"{r['kind']:<11} T={r['seq_len']}: HLO {r['hlo_bytes']}  planned {r['planned_bytes']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
