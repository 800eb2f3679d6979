"""The accelerator check (issues 24 and 37): on a lent GPU or TPU, find the fastest configuration in one
short run, with the step-time forecast next to every measured row.

``tools/device_check.sh`` runs this. In under 10 minutes (``--budget-s``, default 480 s of runs; a
variant is not started when the budget left is below the median run so far) it measures, with
``tools/bench_mfu.py`` (one process per variant, ``--steps`` timed steps, median):

* the baseline: llama3.2-1B shapes, fsdp, flash attention, packed batch, remat none, bf16 compute, f32
  parameters, meshtrain's XLA flags, with the hand-written ``jit(value_and_grad + optax)`` step in the
  same process (the other rows time meshtrain's step only: half the compiles);
* what changes the step: attention backend (packed → cuDNN's ragged layout on Hopper, unpacked → its
  plain one, dense), remat (full, dots_no_batch, offload where the installed meshtrain has it), batch
  ×2, XLA flags off, bf16 parameters, fp8 (``--fp8 delayed`` where the installed meshtrain has it),
  optimizer offload, and on several devices the dp / fsdp_tp recipes;
* an 8B-shaped model cut to fit one chip (llama3-8b, 8 layers, half the batch): its own baseline with
  the hand-written step, remat full, fp8;

and writes a dated table (device, command, every row with its forecast from
:mod:`meshtrain.analysis.forecast` and the roofline) under BENCHMARKS.md's "Device checks" heading,
ending with the fastest configuration per model. A value the installed meshtrain does not know (a
``Remat`` member, a recipe option) gets a "skipped: ..." row; a failed variant says why in its row.

On a host whose JAX sees only CPUs it refuses (exit 2) unless ``--dry-run``: the same pipeline on
8 simulated CPU devices with the ``tiny`` model (``small`` cut to 2 layers for the 8B rows), tiny
shapes and one step, every code path in about a minute (``--out FILE`` writes the table there; a dry
run never writes BENCHMARKS.md unless told to).

    tools/device_check.sh                          # on a GPU/TPU host: ≤ 10 min, BENCHMARKS.md gets a table
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
#: The 8B-shaped model cut to fit one chip (``bench_mfu.py --model M --layers N``); dry run: ``small``, 2 layers.
EIGHT_B, EIGHT_B_LAYERS = "llama3-8b", 8
DRY_EIGHT_B, DRY_EIGHT_B_LAYERS = "small", 2
#: Before the first run finishes, a variant is expected to take this long (later: the median so far).
MIN_RUN_S = 30.0


@dataclasses.dataclass(frozen=True)
class Variant:
    """One ``bench_mfu.py`` run: ``section`` groups rows in the table; ``flags`` may use ``{double_batch}``,
    ``{half_batch}``, ``{model8b}`` and ``{layers8b}``; ``needs``: ``(recipe option, value)`` pairs the
    installed meshtrain must accept (else the row is skipped); ``hand``: time the hand-written step too."""

    section: str
    label: str
    flags: tuple
    needs: tuple = ()
    hand: bool = False


FLASH = ("--recipe", "fsdp", "--attention", "flash")
CUT_8B = ("--model", "{model8b}", "--layers", "{layers8b}", "--batch-size", "{half_batch}")
#: In order of priority: the baseline first (the other rows compare with it), then what most often
#: changes the step time; the recipe rows (several devices only) last.
VARIANTS = (
    Variant("baseline", BASELINE, FLASH, hand=True),
    Variant("attention", "fsdp flash, unpacked", FLASH + ("--packing", "unpacked")),
    Variant("8B cut", "8B fsdp flash", FLASH + CUT_8B, hand=True),
    Variant("remat", "fsdp flash, remat full", FLASH + ("--remat", "full")),
    Variant("batch", "fsdp flash, batch ×2", FLASH + ("--batch-size", "{double_batch}")),
    Variant("precision", "fsdp flash, fp8 delayed", FLASH + ("--fp8", "delayed"), needs=(("fp8", "delayed"),)),
    Variant("remat", "fsdp flash, remat offload", FLASH + ("--remat", "offload"), needs=(("remat", "offload"),)),
    Variant("remat", "fsdp flash, remat dots_no_batch", FLASH + ("--remat", "dots_no_batch")),
    Variant("XLA flags", "fsdp flash, flags off", FLASH + ("--xla-flags", "none")),
    Variant("8B cut", "8B fsdp flash, remat full", FLASH + CUT_8B + ("--remat", "full")),
    Variant("8B cut", "8B fsdp flash, fp8 delayed", FLASH + CUT_8B + ("--fp8", "delayed"),
            needs=(("fp8", "delayed"),)),
    Variant("attention", "fsdp dense, remat full", ("--recipe", "fsdp", "--attention", "dense", "--remat", "full")),
    Variant("precision", "fsdp flash, bf16 parameters", FLASH + ("--param-dtype", "bfloat16")),
    Variant("offload", "fsdp flash, optimizer offloaded", FLASH + ("--offload", "optimizer")),
    Variant("recipe", "dp flash", ("--recipe", "dp", "--attention", "flash")),
    Variant("recipe", "fsdp_tp flash", ("--recipe", "fsdp_tp", "--attention", "flash")),
)
#: Rows that need several devices (on one, dp, fsdp and tp are one program: 876.7, 880.1 and 881.5 ms on an H200).
MULTI_DEVICE = ("dp flash", "fsdp_tp flash")


@dataclasses.dataclass(frozen=True)
class Shapes:
    model: str
    batch_size: int
    seq_len: int
    steps: int
    dry_run: bool = False

    def fill(self, flag: str) -> str:
        """A variant's flag with its placeholders filled for these shapes."""
        # (a dry run's batch is one row per simulated device: halving it would not divide over them)
        half = self.batch_size if self.dry_run else max(self.batch_size // 2, 1)
        return flag.format(double_batch=2 * self.batch_size, half_batch=half,
                           model8b=DRY_EIGHT_B if self.dry_run else EIGHT_B,
                           layers8b=DRY_EIGHT_B_LAYERS if self.dry_run else EIGHT_B_LAYERS)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="run the same pipeline on CPU with the tiny model and tiny shapes (no accelerator needed)")
    p.add_argument("--out", default=None,
                   help="Markdown file to add the table to (default: BENCHMARKS.md; with --dry-run: none)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="seconds for all runs together (default 480: with start-up, under 10 minutes)")
    p.add_argument("--model", default=None, help="default llama3.2-1b (--dry-run: tiny)")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default 8 per device; dry run 8)")
    p.add_argument("--seq-len", type=int, default=None, help="default 2048 (--dry-run: 32)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 3; --dry-run: 1)")
    p.add_argument("--jobs", type=int, default=None,
                   help="variants run at once (default 1 on an accelerator: one chip; --dry-run: 3)")
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
        return Shapes(args.model or "tiny", args.batch_size or 8, args.seq_len or 32, args.steps or 1, True)
    return Shapes(args.model or "llama3.2-1b", args.batch_size or 8 * int(device["count"]), args.seq_len or 2048,
                  args.steps or 3)


def unsupported(variant: Variant) -> Optional[str]:
    """Why the installed meshtrain cannot run ``variant`` (an option or value it does not know), else None."""
    import meshtrain as mt

    for option, value in variant.needs:
        try:
            recipe = mt.get_recipe("fsdp").with_options(**{option: value})
            if str(getattr(getattr(recipe, option, None), "value", getattr(recipe, option, None))) != value:
                raise ValueError(f"{option} stays {getattr(recipe, option, None)!r}")
        except Exception:  # noqa: BLE001 - any refusal means: not in this meshtrain
            return f"skipped: the installed meshtrain has no {option}={value}"
    return None


def bench(variant: Variant, shapes: Shapes, env, timeout: float) -> Dict[str, object]:
    """``bench_mfu.py --json`` for one variant: its JSON, or ``{"error": ...}``."""
    argv = [sys.executable, os.path.join(ROOT, "tools", "bench_mfu.py"), "--json", "--model", shapes.model,
            "--batch-size", str(shapes.batch_size), "--seq-len", str(shapes.seq_len), "--steps", str(shapes.steps),
            "--hand", "yes" if variant.hand else "no", *(shapes.fill(f) for f in variant.flags)]
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


def planner_figures(res: Dict[str, object]) -> Dict[str, object]:
    """The roofline and the forecast for the run ``res`` describes (same model, recipe, options, batch,
    packing, chip and the attention kernel it reported), on an AbstractMesh of its device count."""
    import optax

    import meshtrain as mt
    from meshtrain.analysis.comms import analytic_collectives
    from meshtrain.analysis.forecast import forecast_step
    from meshtrain.analysis.steptime import backend_of, estimate_step_time
    from meshtrain.hardware import get_hardware
    from meshtrain.models import model_factory
    from meshtrain.models.decoder import DecoderConfig

    n = int(str(res["device"]).split(" x ")[0])
    cfg = DecoderConfig(**res["config"])
    recipe = mt.get_recipe(res["recipe"]).with_options(
        param_dtype=res["param_dtype"], compute_dtype=res["compute_dtype"], remat=res["remat"],
        local_attention=res["attention"], offload=res.get("offload", "none"))
    abstract = mt.abstract_state(model_factory(cfg), optax.adamw(1e-4, weight_decay=0.1))
    spec = mt.BatchSpec(res["batch"], res["seq_len"])
    packed = res.get("packing") != "unpacked"
    if not packed:
        spec = dataclasses.replace(spec, keys=tuple(k for k in spec.keys if k != "segment_ids"))
    plan = mt.make_plan(abstract, recipe, recipe.mesh.abstract(n), batch=spec)
    hw = get_hardware(res["hardware"], num_devices=n)
    roofline = estimate_step_time(plan, cfg, hw, collectives=analytic_collectives(plan, cfg, backend_of(hw))).step_s
    kernel = str(res.get("attention_kernel") or "")
    kernel = "cudnn_packed" if kernel == "cudnn" and packed else kernel
    fc = forecast_step(plan, cfg, hw, kernel=kernel if kernel in ("cudnn", "cudnn_packed", "splash", "xla", "dense")
                       else None)
    return {"roofline_s": roofline, "forecast_s": fc.step_s, "forecast_low_s": fc.low_s,
            "forecast_high_s": fc.high_s, "bottleneck": fc.bottleneck}


def predicted_step_s(res: Dict[str, object]) -> Optional[float]:
    """The planner's roofline step time for the run ``res`` describes (kept for older callers)."""
    return planner_figures(res)["roofline_s"]


def variants_for(devices: int) -> List[Variant]:
    """:data:`VARIANTS`; on one device without the :data:`MULTI_DEVICE` recipe rows (one program there)."""
    return [v for v in VARIANTS if devices >= 2 or v.label not in MULTI_DEVICE]


def _skip(rows, v, why, log):
    rows.append({"variant": v, "error": why})
    log(f"{v.label}: {why}", flush=True)


def _measure(v: Variant, shapes: Shapes, env, timeout: float) -> Dict[str, object]:
    res = bench(v, shapes, env, timeout=timeout)
    if "error" not in res:
        try:
            res.update(planner_figures(res))
        except Exception as exc:  # noqa: BLE001 - a planner failure is a finding, not a reason to stop
            res["predicted_error"] = f"{type(exc).__name__}: {exc}"[:160]
    return {"variant": v, **res}


def run_parallel(variants: List[Variant], shapes: Shapes, env, budget_s: float, jobs: int, log=print):
    """Every variant, ``jobs`` at a time (a dry run: CPU processes), each bounded by the budget."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        rows = list(pool.map(lambda v: _measure(v, shapes, env, budget_s), variants))
    for r in rows:
        log(f"{r['variant'].label}: {'error: ' + r['error'] if 'error' in r else 'done'}", flush=True)
    return rows


def run_all(shapes: Shapes, env, budget_s: float, devices: int, log=print,
            limit: Optional[int] = None, jobs: int = 1) -> List[Dict[str, object]]:
    start, rows, durations = time.monotonic(), [], []
    if jobs > 1:  # skip what cannot run, then run the rest together; rows stay in priority order
        todo = []
        for i, v in enumerate(variants_for(devices)):
            why = f"skipped: --variants {limit}" if limit is not None and i >= limit else unsupported(v)
            rows.append({"variant": v, "error": why} if why else None)
            todo += [] if why else [v]
        done = iter(run_parallel(todo, shapes, env, budget_s, jobs, log))
        return [r if r is not None else next(done) for r in rows]
    for i, v in enumerate(variants_for(devices)):
        if limit is not None and i >= limit:
            _skip(rows, v, f"skipped: --variants {limit}", log)
            continue
        why = unsupported(v)
        if why:
            _skip(rows, v, why, log)
            continue
        left = budget_s - (time.monotonic() - start)
        expected = statistics.median(durations) if durations else MIN_RUN_S
        if left < max(MIN_RUN_S, expected):
            _skip(rows, v, f"skipped: {max(left, 0):.0f} s of the {budget_s:.0f} s budget left", log)
            continue
        t0 = time.monotonic()
        rows.append(_measure(v, shapes, env, timeout=left))
        durations.append(time.monotonic() - t0)
        log(f"{v.label}: {'error: ' + rows[-1]['error'] if 'error' in rows[-1] else 'done'} "
            f"({durations[-1]:.0f} s)", flush=True)
    return rows


def _ms(s: Optional[float]) -> str:
    return "—" if s is None else f"{s * 1e3:,.1f}"


HEADER = ["section", "variant", "model", "attention kernel", "meshtrain step ms", "hand-written ms",
          "meshtrain / hand", "MFU", "tokens/s per chip", f"vs {BASELINE}", "forecast ms (range)",
          "forecast / measured", "bottleneck", "roofline ms"]


def _row(r, base) -> List[str]:
    v, mt_ = r["variant"], r["results"]["meshtrain"]
    hand = r["results"].get("hand-written")
    n = int(str(r["device"]).split(" x ")[0])
    same_model = base is not None and base["model"] == r["model"]
    vs = f"{mt_['step_s'] / base['results']['meshtrain']['step_s']:.3f}" if same_model else "—"
    fc = r.get("forecast_s")
    fc_cell = (f"{_ms(fc)} ({_ms(r['forecast_low_s'])}–{_ms(r['forecast_high_s'])})" if fc
               else r.get("predicted_error", "—"))
    return [v.section, v.label, r["model"], r.get("attention_kernel", "—"), _ms(mt_["step_s"]),
            _ms(hand["step_s"]) if hand else "—",
            f"{r['ratio_meshtrain_over_hand']:.3f}" if r.get("ratio_meshtrain_over_hand") else "—",
            f"{mt_['mfu']:.1%}", f"{mt_['tokens_per_s'] / n:,.0f}", vs, fc_cell,
            f"{fc / mt_['step_s']:.2f}" if fc else "—", r.get("bottleneck", "—"), _ms(r.get("roofline_s"))]


def table(rows: List[Dict[str, object]]) -> List[str]:
    out = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    ok = [r for r in rows if "error" not in r]
    for r in rows:
        if "error" in r:
            v = r["variant"]
            out.append("| " + " | ".join([v.section, v.label, "—", "—", r["error"]] + ["—"] * (len(HEADER) - 5)) + " |")
            continue
        base = next((b for b in ok if b["variant"].hand and b["model"] == r["model"]), None)
        out.append("| " + " | ".join(_row(r, base)) + " |")
    return out + [""] + fastest(rows)


def fastest(rows: List[Dict[str, object]]) -> List[str]:
    """One line per model: the measured row with the most tokens/s (its MFU and the baseline's)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows if "error" not in r):
        mine = [r for r in rows if "error" not in r and r["model"] == model]
        best = max(mine, key=lambda r: r["results"]["meshtrain"]["tokens_per_s"])
        b = best["results"]["meshtrain"]
        out.append(f"- **Fastest {model}: {best['variant'].label}**: {_ms(b['step_s'])} ms per step, "
                   f"{b['tokens_per_s']:,.0f} tokens/s, MFU {b['mfu']:.1%} ({len(mine)} configurations measured)")
    return out


def section_text(rows, device, shapes: Shapes, dry_run: bool, elapsed_s: float, command: str = "") -> str:
    ok = next((r for r in rows if "error" not in r), None)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    what = (f"{shapes.model}, batch {shapes.batch_size} × {shapes.seq_len}, {shapes.steps} timed steps per variant "
            f"(median), bf16 compute, f32 parameters")
    if ok:
        what += f", remat {ok['remat']}, peak {ok['peak_tflops_per_device']:.4g} TFLOP/s per device ({ok['hardware']})"
    devices = ok["device"] if ok else f"{device['count']} x {device['kind']} ({device['platform']})"
    command = command or f"tools/device_check.sh{' --dry-run' if dry_run else ''}"
    lines = [f"### {when}: {devices}"
             + (" — dry run (CPU, tiny shapes: figures are not accelerator figures)" if dry_run else ""), "",
             f"`{command}` in {elapsed_s:.0f} s: {what}. Each row is one `tools/bench_mfu.py` process (the "
             f"baselines also time the hand-written step, alternating); `vs {BASELINE}`: meshtrain's step time over "
             f"its model's baseline; forecast: `meshtrain.analysis.forecast` for the same model, recipe, batch, "
             f"chip and the attention kernel the run reported (fp8 is forecast as bf16); roofline: "
             f"`meshtrain.analysis.steptime`.", ""]
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
    argv = list(sys.argv[1:] if argv is None else argv)
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
    jobs = args.jobs or (3 if args.dry_run else 1)
    rows = run_all(shapes, env, args.budget_s, devices, limit=args.variants, jobs=jobs)
    command = "tools/device_check.sh" + "".join(f" {a}" for a in argv)
    text = section_text(rows, device, shapes, args.dry_run, time.monotonic() - t0, command)
    print("\n" + text)
    out = args.out or (None if args.dry_run else BENCHMARKS)
    if out:
        write(out, text)
        print(f"added to {out}")
    return 0 if any("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
