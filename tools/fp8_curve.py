"""FP8 (delayed scaling) against bf16 on the main job: loss curves to a PNG, final losses to stdout.

Runs ``meshtrain train`` (the ``small`` decoder, the default recipe on 8 simulated CPU devices, the
embedded corpus) twice with ``--compute-dtype bfloat16``: once plain, once with ``--fp8 delayed``.
Each run is a subprocess (its own 8-device JAX), its ``metrics.jsonl`` is read back. The issue's bar:
the FP8 run's final train and eval losses within 2 % of bf16's.

    python tools/fp8_curve.py --steps 250 --out runs/fp8-curve        # writes runs/fp8-curve/fp8_curve.png

Prints one line per run (``final train loss``, ``eval loss``, wall seconds, the step reached) and the
relative differences. A run cut off by ``--timeout`` reports the step it reached.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def run(out: str, steps: int, extra, timeout: float):
    cmd = [sys.executable, "-m", "meshtrain", "train", "--model", "small", "--steps", str(steps),
           "--compute-dtype", "bfloat16", "--out", out] + list(extra)
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8")
    start = time.time()
    with open(os.path.join(os.path.dirname(out) or ".", os.path.basename(out) + ".log"), "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return rc, time.time() - start, read_metrics(os.path.join(out, "metrics.jsonl"))


def read_metrics(path: str):
    train, evals = [], []
    if not os.path.exists(path):
        return train, evals
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if "eval_loss" in rec:
                evals.append((rec.get("step"), rec["eval_loss"]))
            if "loss" in rec and "step" in rec:
                train.append((rec["step"], rec["loss"]))
    return train, evals


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--out", default="runs/fp8-curve")
    p.add_argument("--timeout", type=float, default=3 * 3600, help="seconds per run")
    p.add_argument("--runs", default="bf16,fp8-delayed", help="which runs to train (comma-separated); the others "
                   "are read from --out (two processes can train one each, side by side)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = {}
    for name, extra in (("bf16", []), ("fp8-delayed", ["--fp8", "delayed"])):
        out = os.path.join(args.out, name)
        if name in args.runs.split(","):
            rc, wall, (train, evals) = run(out, args.steps, extra, args.timeout)
        else:
            rc, wall, (train, evals) = "(read back)", float("nan"), read_metrics(os.path.join(out, "metrics.jsonl"))
        results[name] = (train, evals)
        last = train[-1] if train else (None, float("nan"))
        ev = evals[-1][1] if evals else float("nan")
        if not train:
            print(f"{name}: exit {rc}, no metrics", flush=True)
            continue
        print(f"{name}: exit {rc}, step {last[0]}, final train loss {last[1]:.4f}, eval loss {ev:.4f}, "
              f"wall {wall:.0f} s", flush=True)
    (tb, eb), (tf, ef) = results["bf16"], results["fp8-delayed"]
    if tb and tf:
        print(f"fp8 vs bf16: train {100 * (tf[-1][1] / tb[-1][1] - 1):+.2f} %", end="")
        if eb and ef:
            print(f", eval {100 * (ef[-1][1] / eb[-1][1] - 1):+.2f} %", end="")
        print(" (the bar: within 2 %)")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (train, evals) in results.items():
        if train:
            ax.plot([s for s, _ in train], [v for _, v in train], label=f"{name} train")
        if evals:
            ax.plot([s for s, _ in evals], [v for _, v in evals], "o--", label=f"{name} eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("small decoder, default recipe, 8 CPU devices: bf16 vs FP8 (delayed)")
    ax.legend()
    png = os.path.join(args.out, "fp8_curve.png")
    fig.savefig(png, dpi=120, bbox_inches="tight")
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
