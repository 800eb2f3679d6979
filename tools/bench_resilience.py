"""Chaos benchmark: a multi-process run under ``meshtrain launch --max-restarts`` with injected faults.

Runs the job once uninterrupted (the reference), then once per fault mix with faults injected at
random steps through ``MESHTRAIN_FAULT`` (:mod:`meshtrain.train.watchdog`): ``kill`` (SIGKILL of
one process), ``lose`` (SIGKILL of one process after deleting its in-memory peer copies: a lost
host, whose shards come back from its peer), ``full`` (one process's next checkpoint save fails
with ENOSPC, as on a full disk: it exits 74), ``stop`` (SIGSTOP of one process: a hang the watchdog
must find), ``slow`` (process 1 sleeps ``--slow-seconds`` after every step from its step on: a
straggler); ``elastic`` in a mix runs it with ``--elastic`` (each restart on fewer processes,
gradient accumulation keeping the global batch); ``peers`` in a mix runs it with ``--peer-every``
(in-memory peer checkpoints, :mod:`meshtrain.checkpoint.peers`: RPO at most that interval instead
of the disk one). Reports per fault:

* RPO: steps lost (the fault's step minus the step the restart resumed from);
* RTO: seconds from the fault to the next completed step (stop, detection, restart, restore, compile);

and over the run: goodput (seconds of the kept steps' compute / wall seconds of the whole launch),
the slowdown versus the uninterrupted run, jitter performance (median step time uninterrupted /
median step time while a process is slowed), the elasticity overhead (median step time after the
last shrink / uninterrupted; 1 without ``elastic``), preemption resilience (share of kill/stop
faults the run recovered from), whether the final parameters and optimizer state equal the
reference's bit for bit (elastic: the largest ||difference|| / ||reference|| over the arrays, which
must stay below 1e-4: f32 rounding of another summation order), and the seed's
score

    RS = w1 / (1 + RPO) + w2 / (1 + RTO) + w3 / overhead + w4 * jitter + w5 * resilience

(RPO in steps and RTO in seconds, each the mean over the faults; the ``1 +`` keeps a perfect RPO of 0
finite; a perfect run scores 1 minus what its RPO and RTO cost). Weights: 0.2 each.

Example (the BENCHMARKS.md table)::

    python tools/bench_resilience.py --model tiny --steps 24 --mixes kill,kill stop,kill kill,stop,slow kill,elastic
    python tools/bench_resilience.py --model tiny --steps 24 --ckpt-every 8 --peer-every 2 \
        --mixes kill,kill kill,kill,peers lose,kill,peers stop,lose,peers
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEIGHTS = {"w1": 0.2, "w2": 0.2, "w3": 0.2, "w4": 0.2, "w5": 0.2}


def final_arrays(run_dir: str, step: int) -> Dict[str, np.ndarray]:
    """Every array of checkpoint ``step`` (parameters and optimizer state) as numpy, by tree path."""
    import logging

    import jax
    import orbax.checkpoint as ocp

    logging.getLogger("absl").setLevel(logging.ERROR)   # "Metadata file does not exist": not ours to fix
    path = os.path.join(run_dir, "checkpoints", str(step), "state")
    tree = ocp.PyTreeCheckpointer().metadata(path).item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    restored = ocp.PyTreeCheckpointer().restore(path, restore_args=args)
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(restored)}


def same_arrays(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def max_relative_difference(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> float:
    """The largest ||a - b|| / ||b|| over the arrays (L2 norms; inf when the trees differ). Per array, not
    per element: an element near zero (an Adam moment) has no meaningful relative error."""
    if a.keys() != b.keys():
        return float("inf")
    diffs = [np.linalg.norm(a[k].astype(np.float64) - b[k]) / max(np.linalg.norm(b[k].astype(np.float64)), 1e-30)
             for k in a]
    return float(max(diffs, default=0.0))


def records(path: str) -> List[dict]:
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path):
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def launch(args, out: str, faults: str = "", max_restarts: int = 0, elastic: bool = False,
           peers: bool = False) -> float:
    """One launch (wall seconds); its output goes to ``out``.log."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    # the caller's XLA flags pass on (e.g. an optimization level: the test suite's -O0, whose compiled programs
    # its cache holds), less a simulated device count: each process gets --devices-per-process
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform")]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    if faults:
        env["MESHTRAIN_FAULT"] = faults
    cmd = [sys.executable, "-m", "meshtrain", "launch", "--processes", str(args.processes), "--devices-per-process",
           str(args.devices_per_process), "--grace", "2", "--restart-backoff", "0",
           *(["--max-restarts", str(max_restarts)] if max_restarts else []), *(["--elastic"] if elastic else []), "--",
           "train", "--model", args.model, "--recipe", "fsdp", "--steps", str(args.steps), "--batch-size",
           str(args.batch_size), "--seq-len", str(args.seq_len), "--eval-every", "0", "--progress", "lines",
           "--ckpt-every", str(args.ckpt_every), "--keep-last", "2",
           *(["--hang-timeout", f"{args.hang_timeout:g}"] if args.hang_timeout else []),
           *(["--peer-every", str(args.peer_every)] if peers else []), "--out", out]
    t0 = time.perf_counter()
    with open(out + ".log", "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    if rc != 0:
        raise SystemExit(f"launch for {out} exited {rc}; see {out}.log")
    return time.perf_counter() - t0


def recorded_wall(run_dir: str) -> float:
    """Seconds from an uninterrupted launch's first attempt to its end, from its ``events.jsonl``; exits with
    a one-line message for a folder that holds no such launch."""
    events = records(os.path.join(run_dir, "events.jsonl"))
    kinds = [e.get("event") for e in events]
    if kinds[:1] != ["attempt"] or kinds[-1:] != ["done"] or "failed" in kinds:
        raise SystemExit(f"--reference {run_dir}: not the folder of an uninterrupted launch (its events.jsonl "
                         f"should go from one attempt to done; it has {kinds or 'none'})")
    return events[-1]["unix"] - events[0]["unix"]


def hang_timeout_for(metrics: List[dict]) -> float:
    """A hang bound for the fault runs on this machine now: 5 x the longest step interval (step, data wait,
    checkpoint block) of the uninterrupted run, its first (compiling) step left out; at least 10 s."""
    longest = max((r["step_time_s"] + r.get("data_wait_s", 0) + r.get("ckpt_block_s", 0) for r in metrics[1:]),
                  default=0.0)
    return float(max(10, int(5 * longest) + 1))


def fault_spec(kinds: List[str], steps: int, rng: random.Random, slow_seconds: float, ckpt_every: int) -> str:
    """``kill``/``lose``/``full``/``stop`` faults at increasing random steps, one per attempt (a ``full``
    disk moved to the next disk save, where it strikes); ``slow`` faults on process 1 in the last
    attempt, from a later step."""
    crashes = [k for k in kinds if k != "slow"]
    at = sorted(rng.sample(range(2, steps - 1), len(kinds)))
    saves = list(range(ckpt_every, steps, ckpt_every)) or [steps]
    planned = sorted((min((s for s in saves if s >= step), default=saves[-1]) if kind == "full" else step, kind)
                     for kind, step in zip(crashes, at))
    spec = [f"{kind}@step={step},process={rng.randrange(2)},attempt={attempt}"
            for attempt, (step, kind) in enumerate(planned)]
    spec += [f"slow@step={step},process=1,attempt={len(crashes)},seconds={slow_seconds}"
             for step in at[len(crashes):]]
    return ";".join(spec)


def measure(args, kinds: List[str], reference: dict, rng: random.Random, work: str) -> dict:
    out = os.path.join(work, "-".join(kinds))
    elastic, peers = "elastic" in kinds, "peers" in kinds
    kinds = [k for k in kinds if k not in ("elastic", "peers")]
    spec = fault_spec(kinds, args.steps, rng, args.slow_seconds, args.ckpt_every)
    wall = launch(args, out, spec, max_restarts=len(kinds), elastic=elastic, peers=peers)
    if reference.get("events_wall"):   # a --reference's wall is its events' span: the same measure here
        events = records(os.path.join(out, "events.jsonl"))
        wall = events[-1]["unix"] - events[0]["unix"]
    events = records(os.path.join(out, "events.jsonl"))
    metrics = [r for r in records(os.path.join(out, "metrics.jsonl")) if "loss" in r and "step" in r]
    faults = []
    for i, e in enumerate(events):
        if e.get("event") != "fault":
            continue
        nxt = next(n for n in events[i + 1:] if n.get("event") == "first_step")
        cause = next(n["cause"] for n in events[i + 1:] if n.get("event") == "failed")
        faults.append({"kind": e["kind"], "process": e["process"], "step": e["step"],
                       "rpo_steps": e["step"] - nxt["resumed_from"], "rto_s": nxt["unix"] - e["unix"],
                       "cause": cause})
    slow_from = min((int(p.split("step=")[1].split(",")[0]) for p in spec.split(";") if p.startswith("slow")),
                    default=None)
    slowed = [r["step_time_s"] for r in metrics if slow_from is not None and r["step"] > slow_from]
    jitter = reference["median_step_s"] / statistics.median(slowed) if slowed else 1.0
    rpo = statistics.mean(f["rpo_steps"] for f in faults) if faults else 0.0
    rto = statistics.mean(f["rto_s"] for f in faults) if faults else 0.0
    crashes = len([k for k in kinds if k != "slow"])
    resilience = len(faults) / crashes if crashes else 1.0
    final = final_arrays(out, args.steps)
    identical = same_arrays(final, reference["arrays"])
    last_start = max((e["resumed_from"] for e in events if e.get("event") == "first_step"), default=0)
    shrunk = [r["step_time_s"] for r in metrics if r["step"] > last_start + 1]   # its first step compiles
    overhead = statistics.median(shrunk) / reference["median_step_s"] if elastic and shrunk else 1.0
    w = WEIGHTS
    rs = (w["w1"] / (1 + rpo) + w["w2"] / (1 + rto) + w["w3"] / overhead + w["w4"] * jitter
          + w["w5"] * resilience)
    stragglers = [r for r in records(os.path.join(out, "metrics.jsonl")) if r.get("event") == "stragglers"]
    return {"mix": ",".join(kinds + ["elastic"] * elastic + ["peers"] * peers), "spec": spec, "overhead": overhead,
            "max_rel_diff": max_relative_difference(final, reference["arrays"]), "faults": faults, "rpo_steps": rpo, "rto_s": rto,
            "goodput": sum(r["step_time_s"] for r in metrics) / wall, "slowdown": wall / reference["wall_s"],
            "jitter": jitter, "resilience": resilience, "identical": identical, "rs": rs,
            "straggler_reports": len(stragglers), "wall_s": wall,
            "attempts": len([e for e in events if e.get("event") == "attempt"])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--devices-per-process", type=int, default=2)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--peer-every", type=int, default=2, help="in-memory peer checkpoint interval of mixes with peers")
    p.add_argument("--hang-timeout", type=float, default=None,
                   help="the runs' --hang-timeout (default: scaled to this machine: max(10, 5 x the longest step "
                        "interval of the uninterrupted run), so that a busy host's slow step is not a hang)")
    p.add_argument("--slow-seconds", type=float, default=0.5)
    p.add_argument("--mixes", nargs="+", default=["kill,kill", "stop,kill", "kill,stop,slow", "kill,elastic"],
                   help="fault mixes, each a comma-separated list of kill, lose, full, stop, slow (and "
                        "elastic: run with --elastic; peers: with --peer-every)")
    p.add_argument("--seed", type=int, default=0, help="seeds the fault steps and processes")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one launch may take")
    p.add_argument("--work", default=None, help="folder for the runs (default: a temporary one)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--reference", default=None,
                   help="the run folder of an uninterrupted launch of the same job (e.g. an earlier --work's "
                        "reference, launched with --max-restarts) to compare with, instead of launching one; its "
                        "wall time, and then each mix's, is read from events.jsonl (first attempt to the end)")
    args = p.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="bench-resilience-")
    os.makedirs(work, exist_ok=True)
    load = os.getloadavg()[0]
    given = args.hang_timeout
    args.hang_timeout = None   # the reference: the watchdog's own bound (minutes), it has no fault to find
    if args.reference:
        ref_dir, wall = args.reference, recorded_wall(args.reference)
    else:
        ref_dir = os.path.join(work, "reference")
        wall = launch(args, ref_dir)
    ref_metrics = [r for r in records(os.path.join(ref_dir, "metrics.jsonl")) if "loss" in r and "step" in r]
    args.hang_timeout = given or hang_timeout_for(ref_metrics)
    print(f"{args.model}, {args.processes} processes x {args.devices_per_process} CPU devices, {args.steps} steps, "
          f"checkpoint every {args.ckpt_every} (peers: every {args.peer_every}), --hang-timeout "
          f"{args.hang_timeout:g}{'' if given else ' (scaled: 5 x the longest step interval, at least 10)'}; "
          f"load average {load:.2f} on {os.cpu_count()} CPUs; weights {WEIGHTS}", flush=True)
    reference = {"wall_s": wall, "arrays": final_arrays(ref_dir, args.steps), "events_wall": bool(args.reference),
                 "median_step_s": statistics.median(r["step_time_s"] for r in ref_metrics[1:] or ref_metrics)}
    print(f"uninterrupted: {wall:.1f} s, median step {reference['median_step_s'] * 1e3:.0f} ms, goodput "
          f"{sum(r['step_time_s'] for r in ref_metrics) / wall:.1%}", flush=True)
    rng = random.Random(args.seed)
    results = []
    for mix in args.mixes:
        r = measure(args, [k.strip() for k in mix.split(",") if k.strip()], reference, rng, work)
        results.append(r)
        for f in r["faults"]:
            print(f"  {r['mix']}: {f['kind']} of process {f['process']} at step {f['step']}: RPO {f['rpo_steps']} "
                  f"steps, RTO {f['rto_s']:.1f} s ({f['cause'][:90]})", flush=True)
        print(f"mix {r['mix']}: RPO {r['rpo_steps']:.2f} steps, RTO {r['rto_s']:.1f} s, goodput {r['goodput']:.1%}, "
              f"slowdown {r['slowdown']:.2f}x, jitter {r['jitter']:.2f}, elastic overhead {r['overhead']:.2f}, "
              f"resilience {r['resilience']:.2f}, "
              f"RS {r['rs']:.3f}, attempts {r['attempts']}, straggler reports {r['straggler_reports']}, "
              f"final state {'bit-identical' if r['identical'] else 'max relative difference %.1e' % r['max_rel_diff']}",
              flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"reference_wall_s": wall, "weights": WEIGHTS, "results": results}, f, indent=1)
    # bit-exact without elasticity; within f32 rounding with it (another summation order)
    ok = [(r["identical"] or ("elastic" in r["mix"] and r["max_rel_diff"] < 1e-4)) and r["resilience"] == 1.0
          for r in results]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
