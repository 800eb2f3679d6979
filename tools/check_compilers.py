"""The planner against a real compiler: each case is `meshtrain plan --check tpu --json` (an XLA:TPU
compile for a fake topology on this host, needs libtpu), and the table puts the planner's per-device
memory and per-axis collective bytes next to what the compiled program holds.

    python tools/check_compilers.py --markdown --save tpu.json   # the full table: 38 cases, v5p:2x2x2, Llama-3-8B
                                                                 # (MoE: Mixtral-8x7B) at 4 layers, 8 × 4096, remat full
    python tools/check_compilers.py --quick --markdown          # ten cases at the `small` shapes (16 × 1024)
    python tools/check_compilers.py --list                      # the cases, without compiling
    python tools/check_compilers.py --replan tpu.json --before tpu.json --markdown   # the planner now, same compiles
    python tools/check_compilers.py --gpu --markdown            # the XLA:GPU cases, 8xH100 (gpu-aot extra), `small`

``--layers N`` replaces the models' layer count (the plan CLI takes a config by name, so such a case runs the
CLI in a child that replaces the named config's fields first, as it does for a case's own overrides such
as dropless routing). Each case runs in its own process, one after the other (libtpu allows one process per host). Memory
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
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Tuple

@dataclasses.dataclass(frozen=True)
class Case:
    """One row: ``meshtrain plan`` flags, and what the case changes in the model config (``moe``: the case runs
    the table's MoE model, ``overrides``: config fields it replaces, e.g. ``capacity_factor=None``, dropless)."""

    label: str
    flags: Tuple[str, ...]
    moe: bool = False
    overrides: Tuple[Tuple[str, object], ...] = ()
    quick: bool = False  # in the ``--quick`` subset (the first ten cases, at the `small` shapes)


def _case(label: str, *flags: str, **kw) -> Case:
    return Case(label, tuple(flags), **kw)


#: Pipeline micro-batches: 2 (≥ the 2 stages) keeps batch 8 divisible by the 4-way data parallelism × micro-batches.
PP_MICRO = ("--pipeline-micro-batches", "2")

#: Every built-in recipe (recipes/*.yaml) × each attention kind that applies (dense, flash: splash on a TPU
#: target, cuDNN on a GPU one; a cp recipe's all_gather / ring / ulysses / usp) × each pipeline schedule; MoE
#: recipes with expert capacity (the model's 1.25) and dropless.
CASES: List[Case] = [
    _case("dp", "--recipe", "dp", quick=True),
    _case("dp flash (splash)", "--recipe", "dp", "--local-attention", "flash"),
    _case("fsdp", "--recipe", "fsdp", quick=True),
    _case("fsdp flash (splash)", "--recipe", "fsdp", "--local-attention", "flash", quick=True),
    _case("zero1", "--recipe", "zero1"),
    _case("zero2", "--recipe", "zero2"),
    _case("hsdp", "--recipe", "hsdp"),
    _case("tp", "--recipe", "tp", quick=True),
    _case("tp flash (splash)", "--recipe", "tp", "--local-attention", "flash"),
    _case("fsdp_tp", "--recipe", "fsdp_tp", quick=True),
    _case("fsdp_tp flash (splash)", "--recipe", "fsdp_tp", "--local-attention", "flash", quick=True),
    _case("fsdp_tp_sp", "--recipe", "fsdp_tp_sp"),
    _case("cp all_gather", "--recipe", "cp", "--context-kind", "all_gather"),
    _case("cp ring", "--recipe", "cp", "--context-kind", "ring"),
    _case("cp ulysses", "--recipe", "cp", "--context-kind", "ulysses"),
    _case("fsdp_cp all_gather", "--recipe", "fsdp_cp", "--context-kind", "all_gather"),
    _case("fsdp_cp ring", "--recipe", "fsdp_cp", quick=True),
    _case("fsdp_cp ulysses", "--recipe", "fsdp_cp", "--context-kind", "ulysses"),
    _case("fsdp_cp ulysses splash", "--recipe", "fsdp_cp", "--context-kind", "ulysses", "--flash-backend", "splash",
          quick=True),
    _case("fsdp_cp_usp usp", "--recipe", "fsdp_cp_usp"),
    _case("fsdp_tp_cp all_gather", "--recipe", "fsdp_tp_cp"),
    _case("fsdp_tp_cp ring", "--recipe", "fsdp_tp_cp", "--context-kind", "ring"),
    _case("fsdp_tp_cp ulysses", "--recipe", "fsdp_tp_cp", "--context-kind", "ulysses"),
    _case("pp gpipe", "--recipe", "pp", "--schedule", "gpipe", *PP_MICRO),
    _case("pp circular", "--recipe", "pp", "--schedule", "circular", "--repeats", "2", *PP_MICRO),
    _case("pp 1f1b", "--recipe", "pp", "--schedule", "1f1b", *PP_MICRO),
    _case("pp_fsdp gpipe", "--recipe", "pp_fsdp", "--schedule", "gpipe", *PP_MICRO, quick=True),
    _case("pp_fsdp circular", "--recipe", "pp_fsdp", "--schedule", "circular", "--repeats", "2", *PP_MICRO),
    _case("pp_fsdp 1f1b", "--recipe", "pp_fsdp", "--schedule", "1f1b", *PP_MICRO, quick=True),
    _case("pp_fsdp_tp gpipe", "--recipe", "pp_fsdp_tp", "--schedule", "gpipe", *PP_MICRO),
    _case("pp_fsdp_tp circular", "--recipe", "pp_fsdp_tp", "--schedule", "circular", "--repeats", "2", *PP_MICRO),
    _case("pp_fsdp_tp 1f1b", "--recipe", "pp_fsdp_tp", "--schedule", "1f1b", *PP_MICRO),
    _case("ep capacity", "--recipe", "ep", moe=True),
    _case("ep dropless", "--recipe", "ep", moe=True, overrides=(("capacity_factor", None),)),
    _case("fsdp_ep capacity", "--recipe", "fsdp_ep", moe=True),
    _case("fsdp_ep dropless", "--recipe", "fsdp_ep", moe=True, overrides=(("capacity_factor", None),)),
    _case("fsdp_tp_ep capacity", "--recipe", "fsdp_tp_ep", moe=True),
    _case("fsdp_tp_ep dropless", "--recipe", "fsdp_tp_ep", moe=True, overrides=(("capacity_factor", None),)),
]

#: The table's shapes (issue 24): Llama-3-8B with 4 of its 32 layers (Mixtral-8x7B for the MoE recipes), batch
#: 8 × 4096, bf16 compute, remat full; ``--quick``: the `small` decoder, batch 16 × 1024, the recipes' remat.
FULL_SHAPES = {"model": "llama3-8b", "moe_model": "mixtral-8x7b", "layers": 4, "batch_size": 8, "seq_len": 4096,
               "remat": "full"}
QUICK_SHAPES = {"model": "small", "moe_model": "small-moe", "layers": None, "batch_size": 16, "seq_len": 1024,
                "remat": None}


#: XLA:GPU cases (``--gpu``): `meshtrain plan --check gpu` for ``--topology`` (default 8xH100, the
#: ``gpu-aot`` extra), at the `small` shapes. Their batch has no segment ids (:func:`unpacked_batch`), so
#: ``--attention flash`` gets cuDNN's fused attention, which takes no segment mask; fsdp_cp runs it inside ulysses.
GPU_CASES: List[Case] = [
    _case("dp", "--recipe", "dp"),
    _case("fsdp", "--recipe", "fsdp"),
    _case("tp", "--recipe", "tp"),
    _case("fsdp_tp", "--recipe", "fsdp_tp"),
    _case("fsdp flash (cudnn)", "--recipe", "fsdp", "--attention", "flash"),
    _case("fsdp_tp flash (cudnn)", "--recipe", "fsdp_tp", "--attention", "flash"),
    _case("fsdp_cp ulysses flash (cudnn)", "--recipe", "fsdp_cp", "--context-kind", "ulysses", "--flash-backend",
          "cudnn"),
    _case("cp ring", "--recipe", "cp", "--context-kind", "ring"),
    _case("fsdp_cp all_gather", "--recipe", "fsdp_cp", "--context-kind", "all_gather"),
    _case("fsdp_cp ring", "--recipe", "fsdp_cp"),
    _case("fsdp_cp_usp usp", "--recipe", "fsdp_cp_usp"),
    _case("fsdp_tp_cp all_gather", "--recipe", "fsdp_tp_cp"),
    _case("pp gpipe", "--recipe", "pp", "--schedule", "gpipe"),
    _case("pp_fsdp circular", "--recipe", "pp_fsdp", "--schedule", "circular", "--repeats", "2"),
    _case("pp_fsdp 1f1b", "--recipe", "pp_fsdp", "--schedule", "1f1b"),
    # small-moe's own max_seq_len is 512; the table's batch is 16 × 1024 (RoPE: no table to grow)
    _case("fsdp_ep capacity", "--recipe", "fsdp_ep", moe=True, overrides=(("max_seq_len", 1024),)),
    _case("fsdp_ep dropless", "--recipe", "fsdp_ep", moe=True,
          overrides=(("max_seq_len", 1024), ("capacity_factor", None))),
]

#: ``--plan-child SPEC -- ARGV``: how a case whose model config differs from the named one runs (the plan CLI
#: takes a config by name; this child replaces the named config's fields, then runs the CLI).
CHILD_FLAG = "--plan-child"


def case_model(case: Case, args) -> Tuple[str, Dict]:
    """The model name a case plans and the config fields it replaces (``--layers``, the case's overrides)."""
    overrides = dict(case.overrides)
    if args.layers:
        overrides["n_layers"] = args.layers
    return (args.moe_model if case.moe else args.model), overrides


def plan_argv(case: Case, args, check_flags: List[str]) -> List[str]:
    """The process that runs one case: ``python -m meshtrain plan ...``, through :data:`CHILD_FLAG` when the
    case changes the model config."""
    model, overrides = case_model(case, args)
    plan = ["plan", "--model", model, *check_flags, "--compute-dtype", "bfloat16", "--json",
            *(["--remat", args.remat] if args.remat else []), *case.flags]
    if not overrides:
        return [sys.executable, "-m", "meshtrain", *plan]
    spec = json.dumps({"model": model, "overrides": overrides})
    return [sys.executable, os.path.abspath(__file__), CHILD_FLAG, spec, "--", *plan]


def describe(case: Case, args, check: str) -> str:
    """``--list``'s line: the label, the command, and the config fields the case replaces."""
    model, overrides = case_model(case, args)
    changed = ", ".join(f"{k}={v}" for k, v in overrides.items())
    return (f"{case.label}: meshtrain plan --check {check} {' '.join(case.flags)} (model {model}"
            f"{', ' + changed if changed else ''})")


def selected(case: Case, args) -> bool:
    """``--only TEXT[,TEXT...]``: the case's label contains one of the texts."""
    return args.only is None or any(text in case.label for text in args.only.split(","))


def run_plan_child(spec_json: str, argv: List[str]) -> int:
    """The child of :func:`plan_argv`: the named config with the spec's fields replaced, then the plan CLI."""
    from meshtrain.cli import main as cli_main
    from meshtrain.models import configs

    spec = json.loads(spec_json)
    configs.CONFIGS[spec["model"]] = dataclasses.replace(configs.get_config(spec["model"]), **spec["overrides"])
    return cli_main(argv)


def _run(argv: List[str], args) -> Dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    try:
        out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"did not compile in {args.timeout} s"}
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["exit %d" % out.returncode])[-1][:160]}
    return json.loads(out.stdout)


def run_case(case: Case, args) -> Dict:
    return _run(plan_argv(case, args, ["--check", "tpu", "--hardware", args.hardware, "--devices",
                                       str(args.devices), "--batch-size", str(args.batch_size), "--seq-len",
                                       str(args.seq_len)]), args)


def figures(res: Dict) -> Dict:
    """What a case's table row and ``--save`` keep: memory planned (with its components) and compiled,
    collectives per axis."""
    if "error" in res:
        return res
    return {"estimated_memory": res["estimated_memory"], "measured_memory": res["measured_memory"],
            "memory_components": {k: v["bytes"] for k, v in res["memory"]["components"].items()},
            "planned": {a: {"total": v.get("total", 0.0)} for a, v in res["collectives"]["per_axis"].items()},
            "compiled": {a: {"total": v.get("total", 0)} for a, v in res["hlo_bytes_per_axis"].items()}}


def replanned(case: Case, args, compiled: Dict) -> Dict:
    """``--replan FILE``: the planner's figures now (``meshtrain plan`` without a compile) against the compiled
    figures a ``--save`` file recorded for this case: a planner change checked in seconds, not a recompile."""
    if "error" in compiled:
        return compiled
    if args.gpu:  # the estimate --check gpu makes: --topology NxCHIP is --devices N --hardware chip
        count, chip = args.topology.lower().split("x", 1)
        target = ["--hardware", chip, "--devices", count, "--batch", unpacked_batch(args.batch_size, args.seq_len)]
    else:
        target = ["--hardware", args.hardware, "--devices", str(args.devices), "--batch-size", str(args.batch_size),
                  "--seq-len", str(args.seq_len)]
    res = _run(plan_argv(case, args, target), args)
    if "error" in res:
        return res
    res.update(estimated_memory=res["memory"]["total"], measured_memory=compiled["measured_memory"], hlo_bytes_per_axis={})
    return {**figures(res), "compiled": compiled["compiled"]}


#: The planner's target: memory and every axis's collective bytes within 10 % of the compiled program.
TOLERANCE = 0.10
#: An axis with fewer bytes than this on both sides is left out of the check and the table (a few scalars).
MIN_AXIS_BYTES = 0.1 * 2 ** 20


def within(res: Dict) -> bool:
    """Memory and each axis's collectives (those of 0.1 MiB or more) within :data:`TOLERANCE`."""
    errors = [res["estimated_memory"] / res["measured_memory"]["peak"] - 1]
    for axis in set(res["planned"]) | set(res["compiled"]):
        p, c = res["planned"].get(axis, {}).get("total", 0.0), res["compiled"].get(axis, {}).get("total", 0)
        if max(p, c) >= MIN_AXIS_BYTES:
            errors.append(p / c - 1 if c else float("inf"))
    return all(abs(e) <= TOLERANCE for e in errors)


def row(label: str, res: Dict, before: Dict = None) -> List[str]:
    if "error" in res:
        return [label] + ["—"] * (5 if before is not None else 3) + [res["error"], "no"]
    est, peak = res["estimated_memory"], res["measured_memory"]["peak"]
    old = []
    if before is not None:
        b = before.get("estimated_memory")
        old = [f"{b / 2 ** 20:,.0f} MiB", f"{b / peak - 1:+.1%}"] if b else ["—", "—"]
    planned, compiled = res["planned"], res["compiled"]
    axes = []
    for axis in sorted(set(planned) | set(compiled)):
        p, c = planned.get(axis, {}).get("total", 0.0), compiled.get(axis, {}).get("total", 0)
        if max(p, c) < MIN_AXIS_BYTES:
            continue  # e.g. a few scalars reduced over `fsdp+tensor`
        err = f"{p / c - 1:+.0%}" if c else ("0" if not p else "n/a")
        text = f"{axis} {p / 2 ** 20:.1f}/{c / 2 ** 20:.1f} MiB ({err})"
        was = (before or {}).get("planned", {}).get(axis, {}).get("total", 0.0) if before is not None else p
        if abs(was - p) > 0.005 * max(p, was):  # the planner changed: its figure before too
            text += f" [before {was / 2 ** 20:.1f}" + (f", {was / c - 1:+.0%}]" if c else "]")
        axes.append(text)
    return [label, f"{peak / 2 ** 20:,.0f} MiB", *old, f"{est / 2 ** 20:,.0f} MiB", f"{est / peak - 1:+.1%}",
            "; ".join(axes) or "none", "yes" if within(res) else "no"]


def unpacked_batch(batch_size: int, seq_len: int) -> str:
    """``--batch`` for a decoder batch without segment ids (one document per row)."""
    dims = f"{batch_size}x{seq_len}:int32@batch/seq"
    return ",".join(f"{key}={dims}" for key in ("inputs", "targets", "positions"))


def run_gpu_case(case: Case, args) -> Dict:
    return _run(plan_argv(case, args, ["--check", "gpu", "--topology", args.topology, "--batch",
                                       unpacked_batch(args.batch_size, args.seq_len)]), args)


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
    cases = [c for c in GPU_CASES if selected(c, args)]
    if args.list:
        for case in cases:
            print(describe(case, args, f"gpu --topology {args.topology}"))
        return 0
    try:
        plugin = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        plugin = False
    replan = None
    if args.replan:
        with open(args.replan) as f:
            replan = json.load(f)
    elif not plugin:
        print("the XLA:GPU plugin is not installed: pip install 'meshtrain[gpu-aot]' to compile for GPUs; "
              "nothing checked")
        return 0
    before = None
    if args.before:
        with open(args.before) as f:
            before = json.load(f)
    header = ["case", "XLA:GPU peak", *(["planned before", "error before"] if before is not None else []),
              "planned memory", "memory error", "collectives per axis: planned/compiled", "within 10 %",
              "cuDNN attention calls"]
    rows, saved = [], {}
    for case in cases:
        label = case.label
        if replan is not None:
            saved[label] = {**replanned(case, args, replan.get(label, {"error": "not in the --replan file"})),
                            "cudnn_attention_calls": replan.get(label, {}).get("cudnn_attention_calls")}
        else:
            saved[label] = gpu_figures(run_gpu_case(case, args))
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
    ap.add_argument("--model", default=None, help="the dense cases' model (default: llama3-8b; --quick, --gpu: small)")
    ap.add_argument("--moe-model", default=None, help="the MoE cases' model (default: mixtral-8x7b; --quick: "
                                                      "small-moe)")
    ap.add_argument("--layers", type=int, default=None, help="replace the models' layer count (default: 4; "
                                                               "--quick, --gpu: the model's own)")
    ap.add_argument("--remat", default=None, help="remat policy for every case (default: full; --quick, --gpu: "
                                                  "the recipe's)")
    ap.add_argument("--quick", action="store_true", help="the ten fastest-to-read cases at the `small` shapes")
    ap.add_argument("--hardware", default="tpu-v5p")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=None, help="default: 8 (--quick, --gpu: 16)")
    ap.add_argument("--seq-len", type=int, default=None, help="default: 4096 (--quick, --gpu: 1024)")
    ap.add_argument("--only", default=None, help="run the cases whose label contains this text (or one of these "
                                                 "comma-separated texts)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per case")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--gpu", action="store_true", help="the XLA:GPU cases instead (needs the gpu-aot extra)")
    ap.add_argument("--topology", default="8xH100", help="with --gpu: NxH100, NxH200 or NxA100")
    ap.add_argument("--save", default=None, help="write each case's figures to this JSON file")
    ap.add_argument("--replan", default=None, help="a --save file of an earlier run: its compiled figures "
                                                   "against the planner now, without compiling")
    ap.add_argument("--before", default=None, help="a --save file of an earlier run: its planned memory and "
                                                   "error as 'before' columns")
    if len(sys.argv) > 3 and sys.argv[1] == CHILD_FLAG and sys.argv[3] == "--":
        return run_plan_child(sys.argv[2], sys.argv[4:])
    args = ap.parse_args()
    shapes = QUICK_SHAPES if args.quick or args.gpu else FULL_SHAPES
    for key, value in shapes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.gpu:
        return gpu_main(args)
    cases = [c for c in CASES if selected(c, args) and (c.quick or not args.quick)]
    if args.list:
        for case in cases:
            print(describe(case, args, "tpu"))
        return 0
    replan = None
    if args.replan:
        with open(args.replan) as f:
            replan = json.load(f)
    elif importlib.util.find_spec("libtpu") is None:
        print("libtpu is not installed: pip install 'meshtrain[tpu]' to compile for a TPU topology; nothing checked")
        return 0
    before = None
    if args.before:
        with open(args.before) as f:
            before = json.load(f)
    header = ["case", "XLA:TPU peak", *(["planned before", "error before"] if before is not None else []),
              "planned memory", "memory error", "collectives per axis: planned/compiled", "within 10 %"]
    rows, saved = [], {}
    started = time.monotonic()
    for case in cases:
        label = case.label
        if replan is not None:
            saved[label] = replanned(case, args, replan.get(label, {"error": "not in the --replan file"}))
        else:
            saved[label] = figures(run_case(case, args))
        if args.save:  # after each case: a long run's finished cases survive an interruption
            with open(args.save, "w") as f:
                json.dump(saved, f, indent=1)
        rows.append(row(label, saved[label], before.get(label, {}) if before is not None else None))
        print("  ".join(rows[-1]), flush=True)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(saved, f, indent=1)
    layers = f" ({args.layers} layers)" if args.layers else ""
    print(f"\n{args.model}{layers} (MoE cases: {args.moe_model}{layers}), batch {args.batch_size} × {args.seq_len}, "
          f"bf16 compute, remat {args.remat or 'as the recipe'}, {args.hardware} × {args.devices}; "
          f"{len(cases)} cases in {time.monotonic() - started:,.0f} s")
    if args.markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
