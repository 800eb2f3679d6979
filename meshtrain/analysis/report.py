"""Text and JSON reports for ``meshtrain plan`` (one plan, or the ``--recipe auto`` search).

Example::

    text = single_text(plan, cfg, args)     # plan table, memory verdict, collectives, step time, warnings
    data = single_dict(plan, cfg, args)     # the same as one JSON-able dict (plan.to_dict() keys kept)
"""

from __future__ import annotations

import math
from typing import Dict, List

from meshtrain.analysis.collectives import hlo_collectives, per_axis
from meshtrain.analysis.comms import Backend, analytic_collectives, per_axis_estimate
from meshtrain.analysis.hardware import get_hardware
from meshtrain.analysis.layout import layout_of
from meshtrain.analysis.memory import MeasuredMemory, estimate_memory
from meshtrain.analysis.planner import AUTO_REMATS, PlanRequest, plan_auto, rule_warnings
from meshtrain.analysis.steptime import axis_links, backend_of, estimate_step_time
from meshtrain.errors import ConfigError
from meshtrain.recipes import Remat

GiB = 2 ** 30


def _gib(n: float) -> str:
    """Bytes with a binary unit that keeps 3 significant digits (``unlimited`` for inf)."""
    if math.isinf(n):
        return "unlimited"
    for unit, size in (("TiB", 2 ** 40), ("GiB", GiB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _rate(x: float, unit: str) -> str:
    for prefix, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if x >= size:
            return f"{x / size:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _finite(x):
    if isinstance(x, float) and math.isinf(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _secs(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def analyse(plan, cfg, hardware: str):
    """Everything the report shows for one plan: hardware, memory, verdict, collectives, step time, warnings."""
    lay = layout_of(plan)
    hw = get_hardware(hardware, num_devices=lay.num_devices)
    memory = estimate_memory(plan, cfg)
    backend = backend_of(hw)
    ops = analytic_collectives(plan, cfg, backend)
    step = estimate_step_time(plan, cfg, hw, collectives=ops)
    return {"hw": hw, "memory": memory, "fit": memory.verdict(hw.hbm_bytes), "backend": backend, "ops": ops,
            "step": step, "warnings": rule_warnings(cfg, plan, hw, step), "links": axis_links(lay, hw)}


def _check(plan, cfg, args, a) -> Dict[str, object]:
    check = getattr(args, "check", "none") or "none"
    if check == "none":
        return {}
    from meshtrain.analysis import lowering

    if check == "compile":
        compiled = lowering.compile_local(plan)
        measured = MeasuredMemory.of(compiled)
        hlo = per_axis(hlo_collectives(compiled.as_text(), plan.mesh))
        return {"check": "compile", "measured_memory": measured.to_dict(), "estimated_memory": a["memory"].total,
                "memory_error": a["memory"].total / measured.peak - 1, "hlo_bytes_per_axis": hlo,
                "analytic_bytes_per_axis_cpu": per_axis_estimate(analytic_collectives(plan, cfg, Backend.CPU))}
    if check == "lower":
        platform = {"tpu": "tpu", "gpu": "cuda", "cpu": "cpu"}[a["backend"].value]
        return {"check": "lower", "platform": platform, **lowering.lowered_summary(lowering.lower_abstract(plan, platform))}
    topology = getattr(args, "topology", None) or lowering.default_topology(a["hw"].name, plan.num_devices)
    if topology is None:
        raise ConfigError(f"--check tpu needs a TPU --hardware and a common slice size (got {a['hw'].name}, "
                          f"{plan.num_devices} devices)")
    tplan, compiled = lowering.compile_tpu_topology(plan.abstract, plan.recipe, plan.batch, topology)
    measured = MeasuredMemory.of(compiled)
    return {"check": "tpu", "topology": topology, "measured_memory": measured.to_dict(),
            "estimated_memory": a["memory"].total, "memory_error": a["memory"].total / measured.peak - 1,
            "hlo_bytes_per_axis": per_axis(hlo_collectives(compiled.as_text(), tplan.mesh))}


def single_dict(plan, cfg, args) -> Dict[str, object]:
    a = analyse(plan, cfg, getattr(args, "hardware", "cpu") or "cpu")
    import jax

    out = plan.to_dict()
    out.update(
        model=cfg.name, hardware=a["hw"].to_dict(),
        mesh_kind="abstract" if isinstance(plan.mesh, jax.sharding.AbstractMesh) else "devices",
        local_devices=len(jax.devices()),
        batch_shape={"batch_size": plan.batch.batch_size, "seq_len": plan.batch.seq_len},
        options={"remat": plan.recipe.remat.value, "micro_batches": plan.recipe.micro_batches,
                 "param_dtype": plan.recipe.param_dtype, "compute_dtype": plan.recipe.compute_dtype},
        memory=a["memory"].to_dict(), fit=a["fit"].value, capacity_bytes=a["hw"].hbm_bytes,
        largest=[{"component": c.value, "bytes": b} for c, b in a["memory"].largest(3)],
        collectives={"backend": a["backend"].value, "per_axis": per_axis_estimate(a["ops"]),
                     "links": {k: v.value for k, v in a["links"].items()},
                     "ops": [o.to_dict() for o in a["ops"]]},
        step_time=a["step"].to_dict(), warnings=a["warnings"])
    out.update(_check(plan, cfg, args, a))
    return _finite(out)


def _collective_rows(a) -> List[str]:
    per = per_axis_estimate(a["ops"])
    kinds = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
    times = {t.axes: t for t in a["step"].axes}
    rows = [f"  {'axes':14s} {'link':5s} " + " ".join(f"{k:>15s}" for k in kinds[:3])
            + f" {'wire/device':>12s} {'time':>10s} {'exposed':>10s}"]
    for key, kv in sorted(per.items()):
        t = times.get(key)
        rows.append(f"  {key:14s} {t.link.value if t else '':5s} " + " ".join(f"{_gib(kv.get(k, 0)):>15s}" for k in kinds[:3])
                    + f" {_gib(t.wire_bytes) if t else '':>12s} {_secs(t.seconds) if t else '':>10s}"
                    + f" {_secs(t.exposed_seconds) if t else '':>10s}")
    return rows if per else ["  none (one device, or nothing sharded)"]


def single_text(plan, cfg, args, *, table: bool = True) -> str:
    a = analyse(plan, cfg, getattr(args, "hardware", "cpu") or "cpu")
    hw, mem, step = a["hw"], a["memory"], a["step"]
    r = plan.recipe
    lines = [plan.describe(max_rows=None)] if table else []
    lines += ["", f"hardware {hw.name}: {hw.description}; peak {_rate(hw.peak_flops, 'FLOP/s')}, HBM "
                  f"{_gib(hw.hbm_bytes)} at {_rate(hw.hbm_bytes_per_s, 'B/s')}, fast links "
                  f"{_rate(hw.fast_link_bytes_per_s, 'B/s')} within {hw.fast_domain}, slow links "
                  f"{_rate(hw.slow_link_bytes_per_s, 'B/s')} (sources: meshtrain.analysis.hardware)",
              f"batch {plan.batch.batch_size}×{plan.batch.seq_len} tokens; params {r.param_dtype}, compute "
              f"{r.compute_dtype}, remat {r.remat.value}, micro-batches {r.micro_batches}", ""]
    frac = "" if math.isinf(hw.hbm_bytes) else f" ({mem.total / hw.hbm_bytes:.0%})"
    lines.append(f"memory per device: {_gib(mem.total)} of {_gib(hw.hbm_bytes)} — {a['fit'].value}{frac}")
    lines.append("  largest: " + ", ".join(f"{c.value} {_gib(b)}" for c, b in mem.largest(3)))
    formulas = dict(mem.formulas)
    for c, b in mem.components:
        lines.append(f"  {c.value:16s} {_gib(b):>12s}  {formulas[c]}")
    lines += ["", f"collectives per step (analytic, XLA:{a['backend'].value} choices; bytes = result per device):"]
    lines += _collective_rows(a)
    lines += ["", f"step time ≈ {_secs(step.step_s)}: compute {_secs(step.compute_s)}, HBM traffic "
                  f"{_secs(step.memory_s)}, exposed communication {_secs(step.exposed_comm_s)} "
                  f"({step.bound.value}-bound) → MFU {step.mfu:.1%} (roofline upper bound), "
                  f"{step.tokens_per_s:,.0f} tokens/s"]
    lines += ["", "warnings:" if a["warnings"] else "warnings: none"] + [f"  - {w}" for w in a["warnings"]]
    chk = _check(plan, cfg, args, a)
    if chk.get("check") in ("compile", "tpu"):
        m = chk["measured_memory"]
        lines += ["", f"check ({chk['check']}{' ' + chk['topology'] if 'topology' in chk else ''}): XLA peak "
                      f"{_gib(m['peak'])} (argument + output − alias + temp) vs estimate {_gib(mem.total)} "
                      f"({chk['memory_error']:+.1%})"]
        ana = chk.get("analytic_bytes_per_axis_cpu", {})
        for key, kv in sorted(chk["hlo_bytes_per_axis"].items()):
            est = ana.get(key, {}).get("total")
            lines.append(f"  HLO collectives over {key}: {_gib(kv['total'])}"
                         + (f" vs analytic (cpu) {_gib(est)}" if est is not None else ""))
    elif chk.get("check") == "lower":
        lines += ["", f"check (lower for {chk['platform']} on an AbstractMesh): {chk['arguments']} arguments, "
                      f"{chk['sharded_arguments']} sharded"]
    return "\n".join(lines)


def auto(args, cfg):
    if getattr(args, "mesh", None):
        raise ConfigError("--mesh cannot be combined with --recipe auto (the search picks the mesh); drop --mesh "
                          "or name a recipe")
    import jax

    n = args.devices or len(jax.devices())
    micro = (args.micro_batches,) if getattr(args, "micro_batches", None) else ()
    req = PlanRequest(cfg, n, getattr(args, "hardware", "cpu") or "cpu", args.batch_size, args.seq_len,
                      remats=(Remat(args.remat),) if getattr(args, "remat", None) else AUTO_REMATS,
                      compute_dtype=getattr(args, "compute_dtype", None), param_dtype=args.param_dtype,
                      micro_batches=micro)
    return plan_auto(req)


def _auto_header(result) -> str:
    req = result.request
    counts = ", ".join(f"{k}: {v}" for k, v in sorted(result.rejection_counts().items())) or "none"
    return (f"searched {len(result.ranked) + len(result.rejected)} layouts (built-in recipes × mesh "
            f"factorisations × remat × micro-batches) for {req.model.name} on {req.num_devices} × {req.hw().name}, "
            f"batch {req.global_batch}×{req.tokens_seq}: {len(result.ranked)} fit, rejected {counts}")


def auto_text(result, args) -> str:
    top = getattr(args, "top", 8) or 8
    lines = [_auto_header(result), "",
             f"  {'#':>2s} {'layout':64s} {'memory':>10s} {'fit':>6s} {'step':>9s} {'MFU':>6s} bound"]
    for i, c in enumerate(result.ranked[:top], 1):
        lines.append(f"  {i:2d} {c.label:64s} {_gib(c.memory.total):>10s} {c.fit.value:>6s} "
                     f"{_secs(c.step.step_s):>9s} {c.step.mfu:6.1%} {c.step.bound.value}"
                     + (" (!)" if c.warnings else ""))
    lines += ["", "why: " + result.why.replace("\n", "\n     "), "", "winner:"]
    w = result.winner
    lines.append(single_text(w.plan, result.request.model, _Args(args, w), table=True))
    return "\n".join(lines)


def auto_dict(result, args) -> Dict[str, object]:
    w = result.winner
    out = single_dict(w.plan, result.request.model, _Args(args, w))
    out["auto"] = {"searched": len(result.ranked) + len(result.rejected), "fit": len(result.ranked),
                   "rejected": result.rejection_counts(), "why": result.why,
                   "ranked": [c.summary() for c in result.ranked[:getattr(args, "top", 8) or 8]]}
    return _finite(out)


class _Args:
    """``args`` with the winner's hardware (and no mesh override) for the single-plan report."""

    def __init__(self, args, winner):
        self.__dict__.update(vars(args))
        self.recipe = winner.recipe.name


__all__ = ["analyse", "auto", "auto_dict", "auto_text", "single_dict", "single_text"]
