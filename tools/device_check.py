"""The accelerator check (issue 24, item 6): run it whenever a GPU or TPU machine is at hand.

``tools/device_check.sh`` runs this. In under 8 minutes (``--budget-s``, default 420 s of runs) it
measures, with ``tools/bench_mfu.py`` (meshtrain's step against a hand-written ``jit(value_and_grad
+ optax)`` step, alternating, one process per variant):

* MFU of the 1B decoder (Llama-3.2-1B shapes) per recipe: fsdp, dp, fsdp_tp (on one device, where the
  recipes are one program: remat full and bf16 parameters instead),
  flash attention;
* flash vs dense attention (fsdp), and flash on an unpacked batch (on a GPU: cuDNN's plain layout against
  its ragged one for packed documents);
* meshtrain's XLA scheduling flags on vs off (fsdp);
* the cost of optimizer-state host offload (fsdp, ``offload=optimizer`` vs the hand-written step
  that keeps the state on the device);
* the planner's step-time prediction (``meshtrain.analysis.steptime``, for the same model, recipe,
  batch and chip) next to each measured step;

and adds a dated table to BENCHMARKS.md. Each variant is one row; a variant that fails or does not
fit in the budget says so in its row and the others still run.

On a host whose JAX sees only CPUs it refuses (exit 2) unless ``--dry-run``: the same pipeline on
8 simulated CPU devices with the ``tiny`` model and tiny shapes, printing the table (``--out FILE``
writes it there; a dry run never writes BENCHMARKS.md unless told to).

    tools/device_check.sh                          # on a GPU/TPU host: ~5-7 min, BENCHMARKS.md gets a table
    tools/device_check.sh --dry-run --out /tmp/t.md
    tools/device_check.sh --model small --batch-size 16 --seq-len 1024   # smaller, e.g. a 16 GB chip
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "BENCHMARKS.md")
HEADING = "## Device checks (issue 24; `tools/device_check.sh`)"
#: The variant every other row is compared with.
BASELINE = "fsdp flash"
#: CPU devices ``bench_mfu.py`` simulates in a dry run (its ``--devices`` default).
SIMULATED_DEVICES = 8
#: A variant is not started with less than this many seconds of the budget left.
MIN_RUN_S = 30.0


@dataclasses.dataclass(frozen=True)
class Variant:
    """One ``bench_mfu.py`` run: ``section`` groups rows in the table."""

    section: str
    label: str
    flags: tuple


#: In order of priority: the baseline first (the other rows compare with it), the recipes last.
VARIANTS = (
    Variant("recipe", BASELINE, ("--recipe", "fsdp", "--attention", "flash")),
    Variant("attention", "fsdp flash, unpacked", ("--recipe", "fsdp", "--attention", "flash", "--packing", "unpacked")),
    Variant("attention", "fsdp dense", ("--recipe", "fsdp", "--attention", "dense")),
    Variant("XLA flags", "fsdp flash, flags off", ("--recipe", "fsdp", "--attention", "flash", "--xla-flags", "none")),
    Variant("offload", "fsdp flash, optimizer offloaded", ("--recipe", "fsdp", "--attention", "flash",
                                                          "--offload", "optimizer")),
    Variant("recipe", "dp flash", ("--recipe", "dp", "--attention", "flash")),
    Variant("recipe", "fsdp_tp flash", ("--recipe", "fsdp_tp", "--attention", "flash")),
)


@dataclasses.dataclass(frozen=True)
class Shapes:
    model: str
    batch_size: int
    seq_len: int
    steps: int


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="run the same pipeline on CPU with the tiny model and tiny shapes (no accelerator needed)")
    p.add_argument("--out", default=None,
                   help="Markdown file to add the table to (default: BENCHMARKS.md; with --dry-run: none)")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds for all runs together (default 420)")
    p.add_argument("--model", default=None, help="default llama3.2-1b (--dry-run: tiny)")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default 8 per device; dry run 8)")
    p.add_argument("--seq-len", type=int, default=None, help="default 2048 (--dry-run: 32)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 5; --dry-run: 1)")
    p.add_argument("--variants", type=int, default=None,
                   help="run only the first N variants, in priority order (the baseline first); the others get a "
                        "'skipped' row (default: all)")
    args = p.parse_args(argv)
    if args.variants is not None and args.variants < 1:
        p.error(f"--variants {args.variants}: give 1 or more (1 runs the baseline only)")
    return args


def child_env(dry_run: bool) -> Dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    if dry_run:
        env["JAX_PLATFORMS"] = "cpu"
    return env


def probe(env) -> Dict[str, object]:
    """What JAX sees on this host, from a child process (this process stays on the CPU)."""
    code = ("import json, jax; d = jax.devices(); "
            "print(json.dumps({'platform': d[0].platform, 'count': len(d), 'kind': d[0].device_kind}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if out.returncode:
        raise SystemExit(f"error: JAX did not start on this host: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def shapes_for(args, device: Dict[str, object]) -> Shapes:
    if args.dry_run:
        return Shapes(args.model or "tiny", args.batch_size or 8, args.seq_len or 32, args.steps or 1)
    return Shapes(args.model or "llama3.2-1b", args.batch_size or 8 * int(device["count"]), args.seq_len or 2048,
                  args.steps or 5)


def bench(variant: Variant, shapes: Shapes, env, timeout: float) -> Dict[str, object]:
    """``bench_mfu.py --json`` for one variant: its JSON, or ``{"error": ...}``."""
    argv = [sys.executable, os.path.join(ROOT, "tools", "bench_mfu.py"), "--json", "--model", shapes.model,
            "--batch-size", str(shapes.batch_size), "--seq-len", str(shapes.seq_len), "--steps", str(shapes.steps),
            *variant.flags]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:.0f} s (the budget left)"}
    if out.returncode:
        return {"error": failure_reason(out.stderr, out.returncode)}
    return json.loads(out.stdout.strip().splitlines()[-1])


def failure_reason(stderr: str, returncode: int) -> str:
    """The line of a failed run's stderr that says why: the last exception line (JAX's note on its
    filtered traceback is not one), with an out-of-memory line after it when XLA printed one."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    raised = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Exit)\b", ln.split(":")[0].split(".")[-1])]
    reason = (raised or lines or [f"exit {returncode}"])[-1]
    oom = next((ln for ln in reversed(lines) if "RESOURCE_EXHAUSTED" in ln), None)
    if oom and oom not in reason:
        reason += " (" + oom[oom.index("RESOURCE_EXHAUSTED"):].split(" [")[0] + ")"
    return reason[:300]


def predicted_step_s(res: Dict[str, object]) -> Optional[float]:
    """The planner's step time for the run ``res`` describes (same model, recipe, options, batch, chip),
    on an AbstractMesh of its device count: nothing runs."""
    import optax

    import meshtrain as mt
    from meshtrain.analysis.comms import analytic_collectives
    from meshtrain.analysis.steptime import backend_of, estimate_step_time
    from meshtrain.hardware import get_hardware
    from meshtrain.models import model_factory
    from meshtrain.models.decoder import DecoderConfig

    n = int(str(res["device"]).split(" x ")[0])
    cfg = DecoderConfig(**res["config"])
    recipe = mt.get_recipe(res["recipe"]).with_options(
        param_dtype=res["param_dtype"], compute_dtype=res["compute_dtype"], remat=res["remat"],
        attention=res["attention"], offload=res.get("offload", "none"))
    abstract = mt.abstract_state(model_factory(cfg), optax.adamw(1e-4, weight_decay=0.1))
    spec = mt.BatchSpec(res["batch"], res["seq_len"])
    if res.get("packing") == "unpacked":
        spec = dataclasses.replace(spec, keys=tuple(k for k in spec.keys if k != "segment_ids"))
    plan = mt.make_plan(abstract, recipe, recipe.mesh.abstract(n), batch=spec)
    hw = get_hardware(res["hardware"], num_devices=n)
    ops = analytic_collectives(plan, cfg, backend_of(hw))
    return estimate_step_time(plan, cfg, hw, collectives=ops).step_s


#: On one device dp, fsdp and tp are the same program (measured on an H200: 876.7, 880.1 and 881.5 ms): the
#: recipe rows measure what else the step can change instead.
ONE_DEVICE = {"dp flash": Variant("remat", "fsdp flash, remat full", ("--recipe", "fsdp", "--attention", "flash",
                                                                     "--remat", "full")),
              "fsdp_tp flash": Variant("precision", "fsdp flash, bf16 parameters",
                                       ("--recipe", "fsdp", "--attention", "flash", "--param-dtype", "bfloat16"))}


def variants_for(devices: int) -> List[Variant]:
    """:data:`VARIANTS`; on one device the recipe rows other than the baseline become :data:`ONE_DEVICE`'s."""
    if devices >= 2:
        return list(VARIANTS)
    return [ONE_DEVICE.get(v.label, v) for v in VARIANTS]


def run_all(shapes: Shapes, env, budget_s: float, devices: int, log=print,
            limit: Optional[int] = None) -> List[Dict[str, object]]:
    start, rows, durations = time.monotonic(), [], []
    for i, v in enumerate(variants_for(devices)):
        if limit is not None and i >= limit:
            rows.append({"variant": v, "error": f"skipped: --variants {limit}"})
            log(f"{v.label}: {rows[-1]['error']}", flush=True)
            continue
        left = budget_s - (time.monotonic() - start)
        expected = statistics.median(durations) if durations else MIN_RUN_S
        if left < max(MIN_RUN_S, expected):
            rows.append({"variant": v, "error": f"skipped: {max(left, 0):.0f} s of the {budget_s:.0f} s budget left"})
            log(f"{v.label}: {rows[-1]['error']}", flush=True)
            continue
        t0 = time.monotonic()
        res = bench(v, shapes, env, timeout=left)
        durations.append(time.monotonic() - t0)
        if "error" not in res:
            try:
                res["predicted_step_s"] = predicted_step_s(res)
            except Exception as exc:  # noqa: BLE001 - a planner failure is a finding, not a reason to stop
                res["predicted_error"] = f"{type(exc).__name__}: {exc}"[:160]
        rows.append({"variant": v, **res})
        log(f"{v.label}: {'error: ' + res['error'] if 'error' in res else 'done'} ({durations[-1]:.0f} s)",
            flush=True)
    return rows


def _ms(s: Optional[float]) -> str:
    return "—" if s is None else f"{s * 1e3:,.1f}"


def table(rows: List[Dict[str, object]]) -> List[str]:
    header = ["section", "variant", "attention kernel", "meshtrain step ms", "hand-written ms", "meshtrain / hand",
              "MFU meshtrain", "MFU hand-written", f"vs {BASELINE}", "planner ms", "planner / measured"]
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    base = next((r for r in rows if r["variant"].label == BASELINE and "error" not in r), None)
    for r in rows:
        v = r["variant"]
        if "error" in r:
            out.append("| " + " | ".join([v.section, v.label, "—", r["error"]] + ["—"] * (len(header) - 4)) + " |")
            continue
        mt_, hand = r["results"]["meshtrain"], r["results"]["hand-written"]
        pred = r.get("predicted_step_s")
        vs = f"{mt_['step_s'] / base['results']['meshtrain']['step_s']:.3f}" if base else "—"
        out.append("| " + " | ".join([
            v.section, v.label, r.get("attention_kernel", "—"), _ms(mt_["step_s"]), _ms(hand["step_s"]),
            f"{r['ratio_meshtrain_over_hand']:.3f}",
            f"{mt_['mfu']:.1%}", f"{hand['mfu']:.1%}", vs, _ms(pred) if pred else r.get("predicted_error", "—"),
            f"{pred / mt_['step_s']:.2f}" if pred else "—"]) + " |")
    return out


def section_text(rows, device, shapes: Shapes, dry_run: bool, elapsed_s: float) -> str:
    ok = next((r for r in rows if "error" not in r), None)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    what = (f"{shapes.model}, batch {shapes.batch_size} × {shapes.seq_len}, {shapes.steps} timed steps per variant "
            f"(median), bf16 compute, f32 parameters")
    if ok:
        what += f", remat {ok['remat']}, peak {ok['peak_tflops_per_device']:.4g} TFLOP/s per device ({ok['hardware']})"
    devices = ok["device"] if ok else f"{device['count']} x {device['kind']} ({device['platform']})"
    lines = [f"### {when}: {devices}"
             + (" — dry run (CPU, tiny shapes: figures are not accelerator figures)" if dry_run else ""), "",
             f"`tools/device_check.sh{' --dry-run' if dry_run else ''}` in {elapsed_s:.0f} s: {what}. Each row is one "
             f"`tools/bench_mfu.py` process (meshtrain's step and the hand-written step, alternating); `vs "
             f"{BASELINE}`: meshtrain's step time over the baseline row's; planner: "
             f"`meshtrain.analysis.steptime` for the same model, recipe, batch and chip.", ""]
    return "\n".join(lines + table(rows)) + "\n"


def write(path: str, text: str) -> None:
    """Add ``text`` under :data:`HEADING` (newest first), creating the heading at the end if absent."""
    old = open(path).read() if os.path.exists(path) else ""
    if HEADING in old:
        head, tail = old.split(HEADING, 1)
        earlier = tail.lstrip("\n")
        new = f"{head}{HEADING}\n\n{text}" + (f"\n{earlier}" if earlier else "")
    else:
        new = f"{old.rstrip()}\n\n{HEADING}\n\n{text}" if old else f"{HEADING}\n\n{text}"
    with open(path, "w") as f:
        f.write(new)


def main(argv=None) -> int:
    args = parse(argv)
    env = child_env(args.dry_run)  # before this process pins itself to the CPU: the children get the host's
    os.environ["JAX_PLATFORMS"] = "cpu"  # this process only plans; the accelerator is the children's
    device = probe(env)
    if device["platform"] == "cpu" and not args.dry_run:
        print("error: tools/device_check.sh needs a GPU or TPU, and JAX sees only CPUs on this host; run it on an "
              "accelerator machine, or pass --dry-run to run the same pipeline on CPU with tiny shapes",
              file=sys.stderr)
        return 2
    shapes = shapes_for(args, device)
    print(f"device check: {device['count']} × {device['kind']} ({device['platform']}); {shapes}", flush=True)
    t0 = time.monotonic()
    devices = SIMULATED_DEVICES if args.dry_run else int(device["count"])
    rows = run_all(shapes, env, args.budget_s, devices, limit=args.variants)
    text = section_text(rows, device, shapes, args.dry_run, time.monotonic() - t0)
    print("\n" + text)
    out = args.out or (None if args.dry_run else BENCHMARKS)
    if out:
        write(out, text)
        print(f"added to {out}")
    return 0 if any("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
