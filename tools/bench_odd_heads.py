"""Query heads that do not divide ``tensor``: pad or replicate? Compiled per-device cost on 8 simulated CPU devices.

    python tools/bench_odd_heads.py                       # 135M-Llama-shaped layers (9 / 3 heads), ~2 min
    python tools/bench_odd_heads.py --layers 1 --seq-len 64 --json out.json     # smoke test

A model with 9 query heads and 3 KV heads (d_model 576, head dim 64, d_ff 1536: SmolLM-135M's layer shape,
fewer layers, unrolled so XLA counts each once) is compiled, not run, under ``tp`` (tensor=8), ``fsdp_tp``
(fsdp=4 × tensor=2) and ``fsdp_tp_sp`` with each ``indivisible_heads`` policy, ``pad`` and ``replicate``.
For each it reports, per device, from the compiled train step:

* ``xla_flops``: ``compiled.cost_analysis()["flops"]`` (the per-device program; no while loops here);
* ``temp`` / ``peak``: ``compiled.memory_analysis()`` temporaries (activations, gradients) and
  argument + output − alias + temp;
* ``collective_bytes``: Σ result bytes of the step's collectives (all-reduce, all-gather, reduce-scatter, ...);
* ``state``: the plan's parameter + optimizer bytes per device (the head weights are whole either way).

The weights cost the same under both policies (an array cannot be split 9 ways over 2); the difference is the
compute and activations of the attention. Prints a table; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402

import meshtrain as mt  # noqa: E402
from meshtrain.analysis.compiled import default_loss, program_cost  # noqa: E402

RECIPES = ("tp", "fsdp_tp", "fsdp_tp_sp")
POLICIES = ("pad", "replicate")


def measure(recipe_name: str, policy: str, args) -> dict:
    cfg = mt.models.get_config("small", d_model=576, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536,
                               n_layers=args.layers, vocab_size=args.vocab, max_seq_len=max(args.seq_len, 256))
    abstract = mt.abstract_state(mt.models.model_factory(cfg), optax.adamw(1e-3))
    recipe = mt.get_recipe(recipe_name).with_options(indivisible_heads=policy, layer_loop="unrolled")
    plan = mt.make_plan(abstract, recipe, recipe.mesh.build(jax.devices()[:8]),
                        batch=mt.BatchSpec(args.batch_size, args.seq_len))
    cost = program_cost(plan, default_loss(cfg, plan), compile=True)
    per = plan.per_device_bytes()
    return {"recipe": recipe_name, "policy": policy, "mesh": plan.mesh_sizes,
            "heads": plan.heads, "xla_flops": cost.xla_flops / plan.num_devices,
            "temp": cost.memory.temp, "peak": cost.memory.peak,
            "collective_bytes": sum(c.bytes * c.executions for c in cost.collectives),
            "state": per["params"] + per["optimizer"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    rows = [measure(r, pol, args) for r in RECIPES for pol in POLICIES]
    mib = 2 ** 20
    print(f"{'recipe':<11} {'policy':<10} {'GFLOP/dev':>10} {'temp MiB':>9} {'peak MiB':>9} {'coll MiB':>9} "
          f"{'state MiB':>9}")
    for r in rows:
        print(f"{r['recipe']:<11} {r['policy']:<10} {r['xla_flops'] / 1e9:>10.2f} {r['temp'] / mib:>9.1f} "
              f"{r['peak'] / mib:>9.1f} {r['collective_bytes'] / mib:>9.1f} {r['state'] / mib:>9.1f}")
    for recipe in RECIPES:
        pad, rep = (next(r for r in rows if r["recipe"] == recipe and r["policy"] == p) for p in POLICIES)
        print(f"{recipe}: pad / replicate: flops {pad['xla_flops'] / rep['xla_flops']:.2f}, temp "
              f"{pad['temp'] / rep['temp']:.2f}, collectives {pad['collective_bytes'] / max(rep['collective_bytes'], 1):.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
