"""The planner against a real compiler: each case is `meshtrain plan --check tpu --json` (an XLA:TPU
compile for a fake topology on this host, needs libtpu), and the table puts the planner's per-device
memory and per-axis collective bytes next to what the compiled program holds.

    python tools/check_compilers.py                         # the default cases, v5p:2x2x2, small
    python tools/check_compilers.py --model small --seq-len 1024 --markdown
    python tools/check_compilers.py --list                  # the cases, without compiling
    python tools/check_compilers.py --gpu --markdown        # the XLA:GPU cases, 8xH100 (gpu-aot extra)
    python tools/check_compilers.py --gpu --save after.json --before before.json --markdown   # XLA:GPU, before/after
    python tools/check_compilers.py --save after.json --before before.json --markdown   # with before columns

Each case runs in its own process, one after the other (libtpu allows one process per host). Memory
error = estimate / compiled peak − 1; collectives: the planner's analytic bytes per mesh axis vs the
bytes of the collectives in the compiled HLO on that axis (one convention on both sides, that of
``meshtrain.analysis.collectives``: a collective's result bytes per device per execution; an all-reduce
counts the reduced tensor once, not its ring's 2·(n−1)/n wire bytes). ``--save`` writes each case's
figures to a JSON file; ``--before`` reads such a file and puts its planned memory and error beside the
new ones (the planner before a change vs after, against the same compiles). Without libtpu it says so and
exits 0 (the planner needs nothing; only the check needs the compiler).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from typing import Dict, List, Tuple

#: (label, extra `meshtrain plan` flags): recipes × attention kinds × pipeline schedules.
CASES: List[Tuple[str, List[str]]] = [
    ("dp", ["--recipe", "dp"]),
    ("fsdp", ["--recipe", "fsdp"]),
    ("fsdp flash (splash)", ["--recipe", "fsdp", "--local-attention", "flash"]),
    ("tp", ["--recipe", "tp"]),
    ("fsdp_tp", ["--recipe", "fsdp_tp"]),
    ("fsdp_tp flash (splash)", ["--recipe", "fsdp_tp", "--local-attention", "flash"]),
    ("fsdp_cp ring", ["--recipe", "fsdp_cp"]),
    ("fsdp_cp ulysses splash", ["--recipe", "fsdp_cp", "--context-kind", "ulysses", "--flash-backend", "splash"]),
    ("pp_fsdp gpipe", ["--recipe", "pp_fsdp", "--schedule", "gpipe"]),
    ("pp_fsdp 1f1b", ["--recipe", "pp_fsdp", "--schedule", "1f1b"]),
]


#: XLA:GPU cases (``--gpu``): `meshtrain plan --check gpu` for ``--topology`` (default 8xH100, the
#: ``gpu-aot`` extra). Their batch has no segment ids (:func:`unpacked_batch`), so ``--attention flash``
#: gets cuDNN's fused attention, which takes no segment mask; fsdp_cp runs it inside ulysses.
GPU_CASES: List[Tuple[str, List[str]]] = [
    ("dp", ["--recipe", "dp"]),
    ("fsdp", ["--recipe", "fsdp"]),
    ("tp", ["--recipe", "tp"]),
    ("fsdp_tp", ["--recipe", "fsdp_tp"]),
    ("fsdp flash (cudnn)", ["--recipe", "fsdp", "--attention", "flash"]),
    ("fsdp_tp flash (cudnn)", ["--recipe", "fsdp_tp", "--attention", "flash"]),
    ("fsdp_cp ulysses flash (cudnn)", ["--recipe", "fsdp_cp", "--context-kind", "ulysses", "--flash-backend", "cudnn"]),
]


def run_case(flags: List[str], args) -> Dict:
    argv = [sys.executable, "-m", "meshtrain", "plan", "--model", args.model, "--check", "tpu", "--hardware",
            args.hardware, "--devices", str(args.devices), "--batch-size", str(args.batch_size), "--seq-len",
            str(args.seq_len), "--compute-dtype", "bfloat16", "--json", *flags]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.timeout)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["exit %d" % out.returncode])[-1][:160]}
    return json.loads(out.stdout)


def figures(res: Dict) -> Dict:
    """What a case's table row and ``--save`` keep: memory planned and compiled, collectives per axis."""
    if "error" in res:
        return res
    return {"estimated_memory": res["estimated_memory"], "measured_memory": res["measured_memory"],
            "planned": {a: {"total": v.get("total", 0.0)} for a, v in res["collectives"]["per_axis"].items()},
            "compiled": {a: {"total": v.get("total", 0)} for a, v in res["hlo_bytes_per_axis"].items()}}


def row(label: str, res: Dict, before: Dict = None) -> List[str]:
    if "error" in res:
        return [label] + ["—"] * (5 if before is not None else 3) + [res["error"]]
    est, peak = res["estimated_memory"], res["measured_memory"]["peak"]
    old = []
    if before is not None:
        b = before.get("estimated_memory")
        old = [f"{b / 2 ** 20:,.0f} MiB", f"{b / peak - 1:+.1%}"] if b else ["—", "—"]
    planned, compiled = res["planned"], res["compiled"]
    axes = []
    for axis in sorted(set(planned) | set(compiled)):
        p, c = planned.get(axis, {}).get("total", 0.0), compiled.get(axis, {}).get("total", 0)
        if max(p, c) < 0.1 * 2 ** 20:
            continue  # e.g. a few scalars reduced over `fsdp+tensor`
        err = f"{p / c - 1:+.0%}" if c else ("0" if not p else "n/a")
        axes.append(f"{axis} {p / 2 ** 20:.1f}/{c / 2 ** 20:.1f} MiB ({err})")
    return [label, f"{peak / 2 ** 20:,.0f} MiB", *old, f"{est / 2 ** 20:,.0f} MiB", f"{est / peak - 1:+.1%}",
            "; ".join(axes) or "none"]


def unpacked_batch(batch_size: int, seq_len: int) -> str:
    """``--batch`` for a decoder batch without segment ids (one document per row)."""
    dims = f"{batch_size}x{seq_len}:int32@batch/seq"
    return ",".join(f"{key}={dims}" for key in ("inputs", "targets", "positions"))


def run_gpu_case(flags: List[str], args) -> Dict:
    argv = [sys.executable, "-m", "meshtrain", "plan", "--model", args.model, "--check", "gpu", "--topology",
            args.topology, "--batch", unpacked_batch(args.batch_size, args.seq_len), "--compute-dtype", "bfloat16",
            "--json", *flags]
    out = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                         timeout=args.timeout)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["exit %d" % out.returncode])[-1][:160]}
    return json.loads(out.stdout)


def gpu_figures(res: Dict) -> Dict:
    """:func:`figures` with the cuDNN fused-attention custom calls (forward + backward) of the compiled step."""
    fig = figures(res)
    if "error" not in res:
        fig["cudnn_attention_calls"] = res.get("cudnn_attention_calls")
    return fig


def gpu_row(label: str, fig: Dict, before: Dict = None) -> List[str]:
    """:func:`row` of :func:`gpu_figures` with the cuDNN calls; ``before``: an earlier run's figures."""
    calls = fig.get("cudnn_attention_calls")
    return row(label, fig, before) + [f"{calls['forward']} + {calls['backward']}" if calls else "—"]


def gpu_main(args) -> int:
    """``--gpu``: the :data:`GPU_CASES` compiled by XLA:GPU for ``args.topology``."""
    cases = [(label, flags) for label, flags in GPU_CASES if args.only is None or args.only in label]
    if args.list:
        for label, flags in cases:
            print(f"{label}: meshtrain plan --check gpu --topology {args.topology} {' '.join(flags)}")
        return 0
    try:
        plugin = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        plugin = False
    if not plugin:
        print("the XLA:GPU plugin is not installed: pip install 'meshtrain[gpu-aot]' to compile for GPUs; "
              "nothing checked")
        return 0
    before = None
    if args.before:
        with open(args.before) as f:
            before = json.load(f)
    header = ["case", "XLA:GPU peak", *(["planned before", "error before"] if before is not None else []),
              "planned memory", "memory error", "collectives per axis: planned/compiled", "cuDNN attention calls"]
    rows, saved = [], {}
    for label, flags in cases:
        saved[label] = gpu_figures(run_gpu_case(flags, args))
        rows.append(gpu_row(label, saved[label], before.get(label, {}) if before is not None else None))
        print("  ".join(rows[-1]), flush=True)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(saved, f, indent=1)
    print(f"\n{args.model}, batch {args.batch_size} × {args.seq_len} (no segment ids), bf16 compute, XLA:GPU "
          f"{args.topology} (meshtrain's scheduling flags)")
    if args.markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--hardware", default="tpu-v5p")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--only", default=None, help="run the cases whose label contains this text")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per case")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--gpu", action="store_true", help="the XLA:GPU cases instead (needs the gpu-aot extra)")
    ap.add_argument("--topology", default="8xH100", help="with --gpu: NxH100, NxH200 or NxA100")
    ap.add_argument("--save", default=None, help="write each case's figures to this JSON file")
    ap.add_argument("--before", default=None, help="a --save file of an earlier run: its planned memory and "
                                                   "error as 'before' columns")
    args = ap.parse_args()
    if args.gpu:
        return gpu_main(args)
    cases = [(label, flags) for label, flags in CASES if args.only is None or args.only in label]
    if args.list:
        for label, flags in cases:
            print(f"{label}: meshtrain plan --check tpu {' '.join(flags)}")
        return 0
    if importlib.util.find_spec("libtpu") is None:
        print("libtpu is not installed: pip install 'meshtrain[tpu]' to compile for a TPU topology; nothing checked")
        return 0
    before = None
    if args.before:
        with open(args.before) as f:
            before = json.load(f)
    header = ["case", "XLA:TPU peak", *(["planned before", "error before"] if before is not None else []),
              "planned memory", "memory error", "collectives per axis: planned/compiled"]
    rows, saved = [], {}
    for label, flags in cases:
        saved[label] = figures(run_case(flags, args))
        rows.append(row(label, saved[label], before.get(label, {}) if before is not None else None))
        print("  ".join(rows[-1]), flush=True)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(saved, f, indent=1)
    print(f"\n{args.model}, batch {args.batch_size} × {args.seq_len}, bf16 compute, {args.hardware} × {args.devices}")
    if args.markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
