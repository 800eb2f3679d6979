"""Train an MoE decoder with a chosen router aux-loss coefficient and report the load-balance trend.

    python tools/bench_moe.py --aux-coef 0 --steps 150 --out runs/moe-noaux      # train (Trainer API)
    python tools/bench_moe.py --summarize runs/moe-aux runs/moe-noaux           # read metrics.jsonl

``meshtrain train --model small-moe --recipe fsdp_ep`` is the same run with the config's own
coefficient (0.01); this tool exists because the CLI has no flag for model-config fields. The
summary prints the first and last loss and ``moe_load_max`` (busiest expert's assignments ÷ the
mean) averaged over the first and last fifth of the steps, and every tenth of the way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def summarize(run_dir: str) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rows = [r for r in rows if "loss" in r and r.get("moe_load_max") is not None]
    n = len(rows)
    fifth = max(n // 5, 1)
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    return {"run": run_dir, "steps": n, "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
            "load_max_first_fifth": mean(rows[:fifth], "moe_load_max"),
            "load_max_last_fifth": mean(rows[-fifth:], "moe_load_max"),
            "aux_first": rows[0]["moe_aux_loss"], "aux_last": rows[-1]["moe_aux_loss"],
            "drop_frac_last": rows[-1]["moe_drop_frac"],
            "load_max_trend": [round(rows[min(i * n // 10, n - 1)]["moe_load_max"], 3) for i in range(11)]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small-moe")
    p.add_argument("--recipe", default="fsdp_ep")
    p.add_argument("--aux-coef", type=float, default=None, help="router aux-loss coefficient (default: the config's)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--out", default=None)
    p.add_argument("--summarize", nargs="+", default=None, help="run folders to summarise (no training)")
    args = p.parse_args(argv)
    if args.summarize:
        for run in args.summarize:
            print(json.dumps(summarize(run)))
        return 0
    from meshtrain.cli import setup_devices

    setup_devices(None)
    from meshtrain.models import get_config, model_factory
    from meshtrain.train import TrainConfig, Trainer

    overrides = {} if args.aux_coef is None else {"router_aux_coef": args.aux_coef}
    cfg = get_config(args.model, **overrides)
    out = args.out or f"runs/bench-moe-{args.model}-aux{cfg.router_aux_coef:g}"
    tc = TrainConfig(model=args.model, recipe=args.recipe, steps=args.steps, out=out, progress="lines", eval_every=0)
    Trainer(tc, model=model_factory(cfg), vocab_size=cfg.vocab_size).run()
    print(json.dumps(summarize(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
