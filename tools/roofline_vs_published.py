"""The planner's roofline against MaxText's published training throughput (its model tiering and
A3 GPU tables), with flash attention, as ``meshtrain plan`` computes it.

    python tools/roofline_vs_published.py              # the three cases, a table
    python tools/roofline_vs_published.py --markdown   # the table for BENCHMARKS.md

The roofline is an upper bound (matmuls at peak, HBM traffic and exposed communication added only
where they exceed compute), so a measured figure above it means the planner is wrong about that
hardware or model. Each case is planned at the published shape (chips, per-chip batch, sequence
length, bf16 compute, f32 master weights, flash attention, pure FSDP as MaxText runs them) under the
remat policy that recomputes at least as much as MaxText's (``full``: the lowest roofline, so the
comparison cannot pass by assuming less recomputation than the published run did).

Two figures are compared, because MFU depends on a FLOP convention and tokens/s does not:
* tokens/s per chip: the plan's roofline vs the published one (no convention involved);
* MFU: the plan's (``6·N + 6·L·n·h·T``, causal attention counted once) vs the published speed
  under the same convention; the MFU as published is printed beside it. (MaxText counts causal
  attention once since its causal-attention change; older figures count the full square, which
  makes them larger than ours for the same speed: the A3 table's TFLOP/s, and, by its ratio of MFU
  to tokens/s, the Trillium Llama 3.1 8B row.)

Exit code 1 when a roofline falls below a published figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from meshtrain.models import get_config  # noqa: E402
from meshtrain.models.flops import attention_flops_per_token, matmul_params  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Published:
    """One published run: where it is from, its shape and its figures (None: not published)."""

    name: str
    source: str
    model: str
    hardware: str
    chips: int
    batch_per_chip: int      # assumed where the source does not give it (``assumed`` says so)
    seq_len: int
    mfu: Optional[float]
    tokens_per_s_per_chip: Optional[float]
    tflops_per_chip: Optional[float] = None   # the A3 table gives TFLOP/s, full-square attention
    assumed: str = ""


CASES = [
    Published("v5p Llama2-70B", "MaxText tiering, v5p Gold", "llama2-70b", "tpu-v5p", 512, 4, 4096,
              mfu=0.654, tokens_per_s_per_chip=692,
              assumed="batch 4 per chip (the tiering table gives chips, bf16 and SL only)"),
    Published("v6e Llama3.1-8B", "MaxText tiering, Trillium Gold", "llama3.1-8b", "tpu-v6e", 256, 4, 8192,
              mfu=0.4546, tokens_per_s_per_chip=7207),
    Published("H100 Llama2-7B", "MaxText A3 table, 1× A3 (8 GPUs)", "llama2-7b", "h100", 8, 4, 4096,
              mfu=None, tokens_per_s_per_chip=None, tflops_per_chip=492,
              assumed="batch 4 per GPU; TFLOP/s with the full attention square (pre-causal convention)"),
]


def plan_case(case: Published, remat: str, timeout: float) -> dict:
    """``meshtrain plan --json`` for the case (a subprocess: each case has its own device count)."""
    argv = [sys.executable, "-m", "meshtrain", "plan", "--model", case.model, "--recipe", "fsdp",
            "--devices", str(case.chips), "--hardware", case.hardware,
            "--batch-size", str(case.batch_per_chip * case.chips), "--seq-len", str(case.seq_len),
            "--attention", "flash", "--remat", remat, "--param-dtype", "float32",
            "--compute-dtype", "bfloat16", "--json"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"meshtrain plan failed for {case.name}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)


def compare(case: Published, plan: dict) -> dict:
    step = plan["step_time"]
    ours_tps = step["tokens_per_s"] / case.chips
    cfg = get_config(case.model)
    # The published TFLOP/s, turned into tokens/s with its own convention (full attention square).
    published_tps = case.tokens_per_s_per_chip
    if published_tps is None and case.tflops_per_chip is not None:
        full = 6.0 * matmul_params(cfg) + attention_flops_per_token(cfg, case.seq_len, causal_once=False)
        published_tps = case.tflops_per_chip * 1e12 / full
    # The published speed under the plan's convention (6·N + causal attention once): MFU figures
    # are comparable only on one convention; the stated one is kept beside it.
    ours_per_token = step["model_flops"] / (case.batch_per_chip * case.chips * case.seq_len)
    published_mfu = published_tps * ours_per_token / plan["hardware"]["peak_flops"]
    return {"case": case.name, "source": case.source, "remat": plan["options"].get("remat"),
            "fits": plan["fit"] == "fits", "memory_gib": plan["memory"]["total"] / 2 ** 30,
            "roofline_mfu": step["mfu"], "published_mfu": published_mfu, "published_mfu_stated": case.mfu,
            "roofline_tokens_per_s_per_chip": ours_tps, "published_tokens_per_s_per_chip": published_tps,
            "bound": step["bound"], "holds": ours_tps >= published_tps and step["mfu"] >= published_mfu,
            "assumed": case.assumed}


def _pct(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.2%}"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--remat", default="full", choices=["full", "dots_no_batch", "dots", "none"],
                   help="remat policy to plan with (default full: the most recomputation, lowest roofline)")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--markdown", action="store_true", help="print a BENCHMARKS.md table")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per plan")
    args = p.parse_args(argv)
    wanted = {c.strip() for c in args.cases.split(",") if c.strip()}
    rows = [compare(c, plan_case(c, args.remat, args.timeout)) for c in CASES if not wanted or c.name in wanted]
    if args.json:
        print(json.dumps(rows, indent=2))
    elif args.markdown:
        print("| case | source | remat | roofline MFU | published MFU (ours; as stated) | roofline tok/s/chip "
              "| published tok/s/chip | bound | fits (plan) | holds |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['case']} | {r['source']} | {r['remat']} | {r['roofline_mfu']:.1%} | {r['published_mfu']:.1%}; "
                  f"{_pct(r['published_mfu_stated'])} "
                  f"| {r['roofline_tokens_per_s_per_chip']:,.0f} | {r['published_tokens_per_s_per_chip']:,.0f} "
                  f"| {r['bound']} | {'yes' if r['fits'] else 'no'} ({r['memory_gib']:.1f} GiB) "
                  f"| {'yes' if r['holds'] else 'NO'} |")
    else:
        for r in rows:
            print(f"{r['case']:<18} remat {r['remat']:<5} roofline MFU {r['roofline_mfu']:6.1%} vs published "
                  f"{r['published_mfu']:6.1%}; tokens/s/chip {r['roofline_tokens_per_s_per_chip']:>9,.0f} vs "
                  f"{r['published_tokens_per_s_per_chip']:>9,.0f}; {r['bound']}-bound; "
                  f"{'holds' if r['holds'] else 'BELOW PUBLISHED'}"
                  + (f" (assumed: {r['assumed']})" if r["assumed"] else ""))
    return 0 if all(r["holds"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
