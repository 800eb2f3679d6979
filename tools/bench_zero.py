"""DDP vs ZeRO-1/2/3 on a DistilBERT-shaped encoder (masked LM), 8 simulated devices, one process.

    python tools/bench_zero.py --json notebooks/data/zero_experiment.json    # bert-small shape, ~3 min
    python tools/bench_zero.py --steps 2 --layers 1 --batch-size 8 --seq-len 32 --no-full   # smoke test

Trains the same encoder, seed and masked-LM batches at a fixed global batch on: one device, ``dp``
(DDP), ``zero1``, ``zero2`` and ``fsdp`` (ZeRO-3) over 8 devices, alternating the recipes step by
step (round-robin), so that whatever else loads the machine hits all recipes alike. Reports:

* per-device memory by component, from the plan and the compiled step (bytes per device):

  - parameters  = Σ parameter leaves ÷ their shards            (``plan.per_device_bytes()["params"]``)
  - gradients   = Σ parameter leaves ÷ the shards of the step's gradient sharding
                  (``meshtrain.train.step.gradient_shardings``: the parameters' sharding, or under
                  ``zero2`` the optimizer state's)
  - optimizer   = Σ optimizer-state leaves ÷ their shards      (``plan.per_device_bytes()["optimizer"]``)
  - activations = ``compiled.memory_analysis().temp_size_in_bytes`` − gradients: XLA's other
                  temporaries: saved activations, the backward working set, the logits gradient,
                  weights gathered for a layer under fsdp and, on CPU, the full-size all-reduce
                  output that stands in for zero2's reduce-scatter before its dynamic-slice

  The four add up to what the step holds beyond its batch: state arguments + temporaries. For
  reference, ``saved`` = the masked-LM loss VJP's residuals at one device's rows, traced
  (``meshtrain.analysis.traced.saved_activation_bytes``; equal for every 8-device recipe).

  and compares parameters + gradients + optimizer with ZeRO's accounting
  (``meshtrain.analysis.memory.zero_model_state``) with meshtrain's f32 Adam: 4 B parameters, 4 B
  gradients, K = 8 B optimizer state (momentum + variance) per parameter: 16Ψ for DDP;
* the median step time per recipe (round-robin; the first step is a warm-up, not timed);
* the loss of every step, the warm-up included (equal across recipes up to f32 summation order: dropout bits are a function
  of the seed, not of the mesh);
* the planned memory of the full ``distilbert-base`` (66M-parameter encoder + MLM and classifier
  heads) at batch 32 × 512 on 8 × A100-40GB (40 GB = 40e9 bytes each), from ``make_plan`` on an
  ``AbstractMesh`` of 8 devices; activations = the masked-LM loss VJP's residuals traced at one
  device's rows (``meshtrain.analysis.traced.saved_activation_bytes``).

Exit status 1 when a check fails: components within 10 % of the ZeRO formulas, losses equal
(max relative difference to one device ≤ 1e-4).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ.get("MESHTRAIN_BENCH_DEVICES", "8")))

import numpy as np  # noqa: E402
import optax  # noqa: E402

import meshtrain as mt  # noqa: E402
from meshtrain.analysis.traced import saved_activation_bytes  # noqa: E402
from meshtrain.analysis.memory import ZeroPartitioning, zero_model_state  # noqa: E402
from meshtrain.data import default_corpus  # noqa: E402
from meshtrain.data.mlm import MLMBatches  # noqa: E402
from meshtrain.models import mlm_loss  # noqa: E402
from meshtrain.rules import shard_shape  # noqa: E402
from meshtrain.train.step import gradient_shardings  # noqa: E402

MiB = 2 ** 20
#: label -> (recipe, ZeRO stage); "single" is DDP on one device.
RECIPES = {"single": ("dp", ZeroPartitioning.DP), "dp": ("dp", ZeroPartitioning.DP), "zero1": ("zero1", ZeroPartitioning.OS),
           "zero2": ("zero2", ZeroPartitioning.OS_G), "fsdp": ("fsdp", ZeroPartitioning.OS_G_P)}
COMPONENTS = ("params", "grads", "optimizer", "activations")  # the "memory" keys in the JSON
A100_40GB = 40e9
TOLERANCE = 0.10
LOSS_RTOL = 1e-4


def gradient_bytes(plan) -> int:
    """Bytes per device of the gradients as the step keeps them before the update."""
    sizes = plan.mesh_sizes
    total = 0
    for sds, sh in zip(jax.tree.leaves(plan.abstract.params), jax.tree.leaves(gradient_shardings(plan))):
        total += math.prod(shard_shape(sds.shape, sh.spec, sizes)) * np.dtype(sds.dtype).itemsize
    return total


def model_state_formula(num_params: int, stage: ZeroPartitioning, n: int):
    """ZeRO's model state per device with meshtrain's f32 Adam: 4Ψ + 4Ψ + KΨ, K = 8."""
    z = zero_model_state(num_params, stage, n, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    return {"params": z.params, "grads": z.grads, "optimizer": z.optimizer}


def _within(got, want, tol=TOLERANCE) -> bool:
    return abs(got - want) <= tol * want


def _batch_example(batch_size, seq_len):
    return {k: jax.ShapeDtypeStruct((batch_size, seq_len), np.int32)
            for k in ("input_ids", "targets", "positions", "segment_ids")}


def run_measured(args, cfg):
    abstract = mt.abstract_state(mt.models.model_factory(cfg), optax.adamw(args.lr))
    psi = abstract.num_params
    layout = mt.BatchLayout.from_example(_batch_example(args.batch_size, args.seq_len))
    runs = {}
    for label in args.recipes:
        name, stage = RECIPES[label]
        recipe = mt.get_recipe(name)
        devices = jax.devices()[:1] if label == "single" else jax.devices()[:args.devices]
        mesh = recipe.mesh.build(devices)
        plan = mt.make_plan(abstract, recipe, mesh, batch=layout)
        state = mt.init_state(plan, seed=args.seed)
        batches = MLMBatches(default_corpus(), args.batch_size, args.seq_len, seed=args.seed)
        put = lambda b, plan=plan: {k: jax.device_put(np.asarray(v, np.int32), plan.batch_shardings[k])  # noqa: E731
                                    for k, v in b.items()}
        print(f"compiling {label} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        compiled = mt.make_train_step(plan, loss_fn=mlm_loss).lower(state, put(next(
            MLMBatches(default_corpus(), args.batch_size, args.seq_len, seed=args.seed)))).compile()
        compile_s = time.perf_counter() - t0
        per = plan.per_device_bytes()
        ma = compiled.memory_analysis()
        grads = gradient_bytes(plan)
        acts = saved_activation_bytes(plan, mlm_loss)
        n = len(devices)
        runs[label] = {
            "recipe": name, "stage": int(stage), "devices": n, "mesh": plan.mesh_sizes,
            "state": state, "compiled": compiled, "batches": batches, "put": put,
            "memory": {"params": per["params"], "grads": grads, "optimizer": per["optimizer"],
                       "activations": ma.temp_size_in_bytes - grads},
            "saved_activations": acts,
            "compiled_memory": {"argument": ma.argument_size_in_bytes, "output": ma.output_size_in_bytes,
                                "alias": ma.alias_size_in_bytes, "temp": ma.temp_size_in_bytes},
            "plan_bytes": per, "formula": model_state_formula(psi, stage, n),
            "compile_s": compile_s, "losses": [], "times": [],
        }
    # Round-robin: one step of each recipe in turn; the first step of each is a warm-up.
    for i in range(args.steps + 1):
        for label, run in runs.items():
            batch = run["put"](next(run["batches"]))
            t0 = time.perf_counter()
            run["state"], metrics = run["compiled"](run["state"], batch)
            loss = float(metrics["loss"])  # blocks
            dt = time.perf_counter() - t0
            run["losses"].append(loss)
            if i > 0:
                run["times"].append(dt)
    return psi, runs


def run_planned(args):
    """Plans of the full distilbert-base on an abstract 8-device mesh (nothing allocated)."""
    cfg = mt.models.get_config("distilbert-base")
    abstract = mt.abstract_state(mt.models.model_factory(cfg), optax.adamw(args.lr))
    psi = abstract.num_params
    layout = mt.BatchLayout.from_example(_batch_example(args.full_batch, args.full_seq))
    out = {}
    for label in ("dp", "zero1", "zero2", "fsdp"):
        name, stage = RECIPES[label]
        recipe = mt.get_recipe(name)
        plan = mt.make_plan(abstract, recipe, recipe.mesh.abstract(8), batch=layout)
        per = plan.per_device_bytes()
        mem = {"params": per["params"], "grads": gradient_bytes(plan), "optimizer": per["optimizer"],
               "activations": saved_activation_bytes(plan, mlm_loss)}
        total = sum(mem.values()) + per["batch"] + per.get("model_state", 0)
        out[label] = {"recipe": name, "stage": int(stage), "memory": mem, "batch": per["batch"], "total": total,
                      "formula": model_state_formula(psi, stage, 8), "fits_a100_40gb": total <= A100_40GB}
    return {"model": cfg.name, "num_params": psi, "batch": [args.full_batch, args.full_seq], "devices": 8,
            "capacity_bytes": A100_40GB, "recipes": out}


def _table(rows, header):
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).rjust(w) if j else str(c).ljust(w)  # noqa: E731
                              for j, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="bert-small", help="encoder config (default bert-small: d=256, 4 layers, "
                   "8 heads × 32, d_ff 1024, byte vocabulary 264)")
    p.add_argument("--layers", type=int, default=None, help="override n_layers")
    p.add_argument("--d-model", type=int, default=None, help="override d_model (and d_ff = 4 × d_model)")
    p.add_argument("--dropout", type=float, default=None, help="override the config's dropout (bert-small: 0.1)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=24, help="timed steps per recipe (after one warm-up step)")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--full-batch", type=int, default=32)
    p.add_argument("--full-seq", type=int, default=512)
    p.add_argument("--no-full", action="store_true", help="skip the distilbert-base plan")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    args.recipes = [r.strip() for r in args.recipes.split(",")]
    unknown = [r for r in args.recipes if r not in RECIPES]
    if unknown:
        p.error(f"unknown recipes {unknown}; choose from {list(RECIPES)}")

    overrides = {}
    if args.layers is not None:
        overrides["n_layers"] = args.layers
    if args.d_model is not None:
        overrides.update(d_model=args.d_model, d_ff=4 * args.d_model, head_dim=args.d_model // 8, n_heads=8)
    if args.dropout is not None:
        overrides["dropout"] = args.dropout
    cfg = mt.models.get_config(args.model, **overrides)
    psi, runs = run_measured(args, cfg)
    print(f"model {cfg.name}: d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads × {cfg.head_dim}, "
          f"d_ff {cfg.d_ff}, vocab {cfg.vocab_size}, dropout {cfg.dropout}; Ψ = {psi:,} parameters; masked LM, "
          f"global batch {args.batch_size}×{args.seq_len}, adamw, {args.steps} timed steps round-robin; "
          f"jax {jax.__version__}, {jax.devices()[0].platform}")
    print("\nper-device memory (MiB), measured (plan + compiled.memory_analysis) vs ZeRO formula (f32 Adam, "
          "4Ψ + 4Ψ + 8Ψ):")
    rows, ok = [], True
    for label, run in runs.items():
        m, f = run["memory"], run["formula"]
        checks = {c: _within(m[c], f[c]) for c in ("params", "grads", "optimizer")}
        state = m["params"] + m["grads"] + m["optimizer"]
        formula = sum(f.values())
        checks["model_state"] = _within(state, formula)
        run["checks"] = checks
        ok &= all(checks.values())
        rows.append([label, f"{run['stage']}", f"{m['params'] / MiB:.2f}", f"{m['grads'] / MiB:.2f}",
                     f"{m['optimizer'] / MiB:.2f}", f"{m['activations'] / MiB:.2f}",
                     f"{run['saved_activations'] / MiB:.2f}", f"{state / MiB:.2f}",
                     f"{formula / MiB:.2f}", f"{statistics.median(run['times']) * 1e3:.1f}",
                     f"{run['losses'][-1]:.5f}", "ok" if all(checks.values()) else "FAIL"])
    print(_table(rows, ["recipe", "ZeRO", "params", "grads", "optimizer", "activations", "(saved)",
                        "p+g+o", "formula", "step ms (median)", "final loss", "±10%"]))

    base_label = next(iter(runs))
    base = np.asarray(runs[base_label]["losses"])
    loss_diff = {}
    for label, run in runs.items():
        d = float(np.max(np.abs(np.asarray(run["losses"]) - base)) / max(float(np.max(np.abs(base))), 1e-30))
        loss_diff[label] = d
    losses_ok = all(d <= LOSS_RTOL for d in loss_diff.values())
    ok &= losses_ok
    print(f"\nloss curves vs {base_label!r}: max relative difference "
          + ", ".join(f"{k} {v:.1e}" for k, v in loss_diff.items()) + ("  (ok)" if losses_ok else "  (FAIL)"))
    print("losses: " + "; ".join(f"{k}: " + " ".join(f"{x:.4f}" for x in r["losses"]) for k, r in runs.items()))

    full = None
    if not args.no_full:
        full = run_planned(args)
        print(f"\nplanned: {full['model']} (Ψ = {full['num_params']:,}), batch {args.full_batch}×{args.full_seq}, "
              f"8 × A100-40GB (40e9 B), per device (GiB):")
        rows = []
        for label, r in full["recipes"].items():
            m, f = r["memory"], r["formula"]
            rows.append([label, r["stage"], f"{m['params'] / 2**30:.3f}", f"{m['grads'] / 2**30:.3f}",
                         f"{m['optimizer'] / 2**30:.3f}", f"{m['activations'] / 2**30:.3f}",
                         f"{(m['params'] + m['grads'] + m['optimizer']) / 2**30:.3f}",
                         f"{sum(f.values()) / 2**30:.3f}", f"{r['total'] / 2**30:.3f}",
                         "fits" if r["fits_a100_40gb"] else "does not fit"])
        print(_table(rows, ["recipe", "ZeRO", "params", "grads", "optimizer", "activations", "p+g+o", "formula",
                            "total", "A100-40GB"]))

    if args.json:
        out = {"model": {"name": cfg.name, "d_model": cfg.d_model, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
                         "head_dim": cfg.head_dim, "d_ff": cfg.d_ff, "vocab_size": cfg.vocab_size,
                         "dropout": cfg.dropout, "num_params": psi},
               "batch": [args.batch_size, args.seq_len], "steps": args.steps, "jax": jax.__version__,
               "platform": jax.devices()[0].platform, "command": "python tools/bench_zero.py " + " ".join(
                   sys.argv[1:] if argv is None else argv),
               "formula": "ZeRO model state with f32 Adam: params 4Ψ/(N if stage 3), grads 4Ψ/(N if stage>=2), "
                          "optimizer 8Ψ/(N if stage>=1); activations = compiled temp bytes - gradient bytes; "
                          "saved_activations = traced loss-VJP residuals per device",
               "recipes": {label: {k: run[k] for k in ("recipe", "stage", "devices", "mesh", "memory",
                                                       "compiled_memory", "plan_bytes", "saved_activations", "formula", "compile_s",
                                                       "losses", "times", "checks")}
                           for label, run in runs.items()},
               "loss_max_rel_diff": loss_diff, "ok": bool(ok), "full": full}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        print(f"\nwrote {args.json}")
    print("checks: " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
