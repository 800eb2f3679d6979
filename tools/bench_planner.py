"""Planner vs measurement on this CPU: memory, collectives and step-time ranking of the built-in
recipes, side by side in one run (8 simulated devices).

    python tools/bench_planner.py                      # small model, B=16, T=128, 6 rounds
    python tools/bench_planner.py --model tiny --rounds 3 --json out.json

Prints three tables: per-device peak memory (estimate vs ``compiled.memory_analysis()``),
collective bytes per mesh axis (analytic vs compiled HLO), and seconds per step (the ``cpu``
profile's estimate vs steps timed round-robin), with both rankings and their agreement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ.get("MESHTRAIN_BENCH_DEVICES", "8")))

import optax  # noqa: E402

import meshtrain as mt  # noqa: E402
from meshtrain.analysis import (MeasuredMemory, analytic_collectives, compare_rankings, compile_recipe,  # noqa: E402
                                estimate_memory, estimate_step_time, hlo_collectives, measure_cpu, per_axis,
                                per_axis_estimate, time_round_robin)

MiB = 2 ** 20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--recipes", default=",".join(["dp", "fsdp", "zero1", "hsdp", "tp", "fsdp_tp", "fsdp_tp_sp"]))
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)

    cfg = mt.models.get_config(args.model)
    abstract = mt.abstract_state(mt.models.model_factory(cfg), optax.adamw(1e-3))
    host = measure_cpu()
    print(f"host: {host['flops'] / 1e9:.1f} GFLOP/s f32 matmul, {host['mem_bytes_per_s'] / 1e9:.1f} GB/s copy, "
          f"all-reduce {host['latency_s'] * 1e6:.0f} µs + {host['link_bytes_per_s'] / 1e9:.1f} GB/s per device; "
          f"{len(jax.devices())} devices; model {cfg.name}, batch {args.batch_size}×{args.seq_len}")
    runs, out = [], {"model": cfg.name, "batch": [args.batch_size, args.seq_len], "host": host, "recipes": {}}
    for name in args.recipes.split(","):
        run = compile_recipe(abstract, mt.get_recipe(name), cfg, args.batch_size, args.seq_len, init="host")
        runs.append(run)
        mem_e, mem_m = estimate_memory(run.plan, cfg), MeasuredMemory.of(run.compiled)
        hlo = per_axis(hlo_collectives(run.compiled.as_text(), run.plan.mesh))
        ana = per_axis_estimate(analytic_collectives(run.plan, cfg, "cpu"))
        est = estimate_step_time(run.plan, cfg, "cpu")
        out["recipes"][name] = {"mesh": run.plan.mesh_sizes, "memory_estimate": mem_e.total,
                                "memory_measured": mem_m.peak, "hlo_bytes_per_axis": hlo,
                                "analytic_bytes_per_axis": ana, "step_estimate": est.to_dict()}

    print("\nper-device peak memory (MiB): estimate vs compiled.memory_analysis() (arg + out − alias + temp)")
    print(f"{'recipe':12s} {'mesh':28s} {'estimate':>9s} {'measured':>9s} {'error':>7s}")
    for name, r in out["recipes"].items():
        e, m = r["memory_estimate"], r["memory_measured"]
        mesh = ",".join(f"{a}={s}" for a, s in r["mesh"].items())
        print(f"{name:12s} {mesh:28s} {e / MiB:9.2f} {m / MiB:9.2f} {100 * (e / m - 1):+6.1f}%")

    print("\ncollective result bytes per step per mesh axis (MB): analytic (cpu backend) vs compiled HLO")
    for name, r in out["recipes"].items():
        hlo, ana = r["hlo_bytes_per_axis"], r["analytic_bytes_per_axis"]
        for axes in sorted(set(hlo) | set(ana)):
            h, a = hlo.get(axes, {}).get("total", 0), ana.get(axes, {}).get("total", 0)
            err = f"{100 * (a / h - 1):+6.1f}%" if h else "   n/a"
            print(f"{name:12s} {axes:12s} analytic {a / 1e6:8.3f}  HLO {h / 1e6:8.3f}  {err}")

    times = time_round_robin(runs, rounds=args.rounds, warmup=1)
    estimates = {n: r["step_estimate"]["step_s"] for n, r in out["recipes"].items()}
    cmp = compare_rankings(estimates, times)
    print(f"\nseconds per step ({args.rounds} rounds, round-robin): estimate (cpu profile) vs measured")
    print(f"{'recipe':12s} {'estimate':>9s} {'compute':>8s} {'memory':>8s} {'comm':>8s} {'median':>8s} {'min':>8s}")
    for name, r in out["recipes"].items():
        s = r["step_estimate"]
        ts = sorted(times[name])
        med = ts[len(ts) // 2]
        r["measured_s"] = times[name]
        print(f"{name:12s} {s['step_s']:9.3f} {s['compute_s']:8.3f} {s['memory_s']:8.3f} {s['exposed_comm_s']:8.3f}"
              f" {med:8.3f} {ts[0]:8.3f}")
    print("estimated order:", " < ".join(cmp.estimated_order))
    print("measured order: ", " < ".join(cmp.measured_order))
    print(f"Kendall tau {cmp.kendall_tau:+.2f}; distinguishable pairs (faster in every round, >15%): "
          f"{', '.join(f'{a}<{b}' for a, b in cmp.distinguishable) or 'none'}; "
          f"disagreements: {', '.join(f'{a}<{b}' for a, b in cmp.disagreements) or 'none'}; "
          f"estimate ties (within 5%): {', '.join(f'{a}<{b}' for a, b in cmp.ties) or 'none'}")
    out["ranking"] = {"estimated": cmp.estimated_order, "measured": cmp.measured_order, "kendall_tau": cmp.kendall_tau,
                      "distinguishable": cmp.distinguishable, "disagreements": cmp.disagreements, "ties": cmp.ties}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
