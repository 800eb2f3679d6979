"""Compressed gradient reduction across DCN against the uncompressed one: loss curves and final losses.

Runs ``meshtrain train`` (the ``small`` decoder on ``hsdp`` with ``data`` on DCN: 8 simulated CPU devices
as 2 slices x 4, ``recipes/hsdp_dcn_onebit.yaml``, the embedded corpus) once per ``--grad-compression``
kind, each in its own subprocess, reads back each ``metrics.jsonl`` and prints the final losses (the mean
of the last ``--tail`` steps, which steadies the per-batch noise; the last step's too) and their relative
difference to ``none``. The issue's bar: within 2 % of the uncompressed final loss. With matplotlib
installed, the curves go to ``<out>/grad_compression.png``.

    python tools/bench_grad_compression.py --steps 250 --out tools/out/grad-compression
    python tools/bench_grad_compression.py --kinds none,int8,onebit --reuse none,int8   # rerun onebit only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "hsdp_dcn_onebit.yaml")


def run(out: str, kind: str, steps: int, extra, timeout: float):
    cmd = [sys.executable, "-m", "meshtrain", "train", "--model", "small", "--recipe", RECIPE, "--grad-compression",
           kind, "--steps", str(steps), "--eval-every", "0", "--progress", "none", "--ckpt-every", "0",
           "--out", out] + list(extra)
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu")
    start = time.time()
    with open(out.rstrip("/") + ".log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return rc, time.time() - start, read_losses(os.path.join(out, "metrics.jsonl"))


def read_losses(path: str):
    losses = {}
    if os.path.exists(path):
        for line in open(path):
            rec = json.loads(line)
            if "loss" in rec and "step" in rec:
                losses[rec["step"]] = rec["loss"]
    return [losses[s] for s in sorted(losses)]


def plot(curves, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=f"grad_compression={kind}", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.set_title("small on hsdp, data on DCN (2 slices x 4 simulated devices)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--kinds", default="none,int8,onebit", help="comma-separated grad_compression kinds")
    p.add_argument("--tail", type=int, default=20, help="final loss = mean of the last N steps")
    p.add_argument("--out", default="tools/out/grad-compression")
    p.add_argument("--timeout", type=float, default=3 * 3600, help="seconds per run")
    p.add_argument("--reuse", default="", help="comma-separated kinds read back from <out>/<kind>/metrics.jsonl "
                   "when it holds --steps losses (an earlier run of unchanged code), not rerun")
    p.add_argument("extra", nargs="*", help="more `meshtrain train` flags, after --")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    curves, finals = {}, {}
    for kind in args.kinds.split(","):
        kept = read_losses(os.path.join(args.out, kind, "metrics.jsonl"))
        if kind in args.reuse.split(",") and len(kept) >= args.steps:
            rc, wall, losses = "reused", 0.0, kept[:args.steps]
        else:
            rc, wall, losses = run(os.path.join(args.out, kind), kind, args.steps, args.extra, args.timeout)
        curves[kind] = losses
        tail = losses[-args.tail:] if losses else [float("nan")]
        finals[kind] = sum(tail) / len(tail)
        print(f"{kind:7s} rc={rc} steps={len(losses)} wall={wall:.0f}s final loss (mean of last {len(tail)}) "
              f"{finals[kind]:.4f} last step {losses[-1] if losses else float('nan'):.4f}", flush=True)
    if "none" in finals:
        for kind, value in finals.items():
            if kind != "none":
                rel = (value - finals["none"]) / finals["none"]
                print(f"{kind:7s} vs none: {100 * rel:+.2f} % (bar: within 2 %)")
    path = os.path.join(args.out, "grad_compression.png")
    print(f"plot: {path}" if plot(curves, path) else "plot: matplotlib not installed; curves in metrics.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
