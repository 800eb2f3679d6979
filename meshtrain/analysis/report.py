"""Text and JSON reports for ``meshtrain plan`` (one plan, or the ``--recipe auto`` search).

Example::

    text = single_text(plan, cfg, args)     # plan table, memory verdict, collectives, step time, warnings
    data = single_dict(plan, cfg, args)     # the same as one JSON-able dict (plan.to_dict() keys kept)
    text = single_text(plan, None, args, loss_fn=my_loss, model_name="mymod:make")   # any model

A decoder config gets the analytic estimates; any other model (a ViT / BERT config, or ``cfg=None``
for a user factory) the estimates from its compiled (real mesh) or traced (``AbstractMesh``) train
step (:mod:`meshtrain.analysis.compiled`); without a loss function only the state's memory.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List

from meshtrain.analysis import gpu_aot, lowering
from meshtrain.analysis.collectives import hlo_collectives, per_axis
from meshtrain.analysis.comms import Backend, analytic_collectives, per_axis_estimate
from meshtrain.analysis.compiled import (ANALYTIC, COMPILED, MeasuredMemory, default_loss, has_analytic_model,
                                         program_cost)
from meshtrain.analysis.forecast import with_forecast
from meshtrain.analysis.hardware import get_hardware
from meshtrain.analysis.hlo_cost import HloCost, hlo_cost
from meshtrain.analysis.layout import layout_of
from meshtrain.analysis.memory import Component, estimate_memory, state_memory
from meshtrain.analysis.moe import moe_lines, moe_summary
from meshtrain.analysis.pipeline import pipeline_lines, pipeline_shape, pipeline_summary
from meshtrain.analysis.planner import AUTO_REMATS, PlanRequest, plan_auto, rule_warnings
from meshtrain.analysis.steptime import axis_links, backend_of, compiled_collectives, estimate_step_time
from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.hardware import backend_of_hardware, scheduling_flags
from meshtrain.plan import fmt_bytes
from meshtrain.parallel.resolved import resolve_step
from meshtrain.recipes import Remat, Schedule

GiB = 2 ** 30
SIG3 = ".3g"  # byte figures in the report: 3 significant digits


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


def _hardware(args, num_devices: int):
    """``--hardware`` with ``--slices``: the fast-link domain is at most ``devices / slices`` (the slices or
    nodes the devices span), so mesh axes spanning more use the slow links."""
    name = getattr(args, "hardware", "cpu") or "cpu"
    slices = getattr(args, "slices", None) or 1
    return PlanRequest(None, num_devices, name, slices=slices).hw() if slices > 1 else name


def analyse(plan, cfg, hardware: str, *, loss_fn=None):
    """Everything the report shows for one plan: hardware, memory, verdict, collectives, step time, warnings.

    ``cfg``: a decoder config (analytic), another built-in config or ``None`` (from the program, with
    ``loss_fn``, default the config's built-in loss). ``step`` is ``None`` when no loss is known.
    """
    lay = layout_of(plan)
    hw = get_hardware(hardware, num_devices=lay.num_devices)
    backend = backend_of(hw)
    cost, ops_source = None, f"analytic, XLA:{backend.value} choices"
    if has_analytic_model(cfg):
        # the hardware's target (a GPU's compute capability): the kernel the memory terms assume is the kernel line's
        memory = estimate_memory(plan, cfg, backend=gpu_aot.hardware_target(hw))
        ops = analytic_collectives(plan, cfg, backend)
        step = estimate_step_time(plan, cfg, hw, collectives=ops)
    else:
        loss_fn = loss_fn or default_loss(cfg, plan)
        if loss_fn is None:
            memory, ops, step = state_memory(plan), analytic_collectives(plan, None, backend), None
            ops_source = f"analytic parameter collectives only, XLA:{backend.value} choices"
        else:
            cost = program_cost(plan, loss_fn)
            memory = estimate_memory(plan, cfg, loss_fn=loss_fn, cost=cost)
            if cost.source == COMPILED:
                import jax

                ops = compiled_collectives(cost)
                ops_source = f"from the compiled HLO for XLA:{jax.devices()[0].platform} on this machine"
            else:
                ops = analytic_collectives(plan, None, backend)
                ops_source = (f"analytic parameter collectives only (no tensor-parallel activations), "
                              f"XLA:{backend.value} choices")
            step = estimate_step_time(plan, cfg, hw, collectives=ops, loss_fn=loss_fn, cost=cost)
    return {"hw": hw, "memory": memory, "fit": memory.verdict(hw.hbm_bytes), "backend": backend, "ops": ops,
            "ops_source": ops_source, "step": step, "warnings": rule_warnings(cfg, plan, hw, step),
            "links": axis_links(lay, hw), "cost": cost, "loss_fn": loss_fn}


def _check(plan, cfg, args, a) -> Dict[str, object]:
    check = getattr(args, "check", "none") or "none"
    if check == "none":
        return {}

    analytic = has_analytic_model(cfg)
    loss_fn = None if analytic else a["loss_fn"]
    if not analytic and loss_fn is None:
        raise ConfigError(f"--check {check} compiles the train step, which needs the model's loss: pass --loss "
                          f"module:fn (a function (model, batch) -> (loss_sum, weight[, metrics]))")
    if check == "compile":
        cost, per_op, estimate, source = a.get("cost"), {}, a["memory"].total, "analytic" if analytic else "traced"
        if cost is not None and cost.source == COMPILED:
            measured, ops = cost.memory, cost.collectives
            # the report's figures came from this very compile: check the estimate a plan makes without
            # compiling (what an AbstractMesh of any size gets) against it instead
            estimate = _traced_estimate(plan, cfg, loss_fn)
        else:
            compiled = lowering.compile_local(plan, loss_fn)
            measured, ops = MeasuredMemory.of(compiled), hlo_collectives(compiled.as_text(), plan.mesh)
            per_op = {"hlo_cost": hlo_cost(compiled.as_text()).to_dict()}
        return {"check": "compile", **per_op, "measured_memory": measured.to_dict(), "estimated_memory": estimate,
                "estimate_source": source, "memory_error": estimate / measured.peak - 1,
                "hlo_bytes_per_axis": per_axis(ops),
                "analytic_bytes_per_axis_cpu": per_axis_estimate(
                    analytic_collectives(plan, cfg if analytic else None, Backend.CPU))}
    if check == "lower":
        platform = {"tpu": "tpu", "gpu": "cuda", "cpu": "cpu"}[a["backend"].value]
        return {"check": "lower", "platform": platform,
                **lowering.lowered_summary(lowering.lower_abstract(plan, platform, loss_fn))}
    if check == "gpu":  # XLA:GPU ahead of time (meshtrain.analysis.gpu_aot, the gpu-aot extra)
        return gpu_aot.check(plan, args, a["memory"], per_axis_estimate(a["ops"]), loss_fn)
    topology = getattr(args, "topology", None) or lowering.default_topology(a["hw"].name, plan.num_devices)
    if topology is None:
        raise ConfigError(f"--check tpu needs a TPU --hardware and a common slice size (got {a['hw'].name}, "
                          f"{plan.num_devices} devices)")
    tplan, compiled = lowering.compile_tpu_topology(plan.abstract, plan.recipe, plan.batch, topology, loss_fn)
    measured = MeasuredMemory.of(compiled)
    return {"check": "tpu", "topology": topology, "measured_memory": measured.to_dict(),
            "estimated_memory": a["memory"].total, "memory_error": a["memory"].total / measured.peak - 1,
            "hlo_bytes_per_axis": per_axis(hlo_collectives(compiled.as_text(), tplan.mesh)),
            "hlo_cost": hlo_cost(compiled.as_text()).to_dict()}


def _traced_estimate(plan, cfg, loss_fn) -> int:
    """The per-device bytes :func:`estimate_memory` gives from the traced step alone (no compile)."""
    traced = program_cost(plan, loss_fn, compile=False)
    return estimate_memory(plan, cfg, loss_fn=loss_fn, cost=traced).total


def _batch_leaves(plan) -> Dict[str, Dict[str, object]]:
    return {path: {"shape": list(leaf.shape), "dtype": str(leaf.dtype), "axes": list(leaf.axes)}
            for path, leaf in plan.batch.leaves_as_given()}


def _batch_shape(plan) -> Dict[str, object]:
    out: Dict[str, object] = {"batch_size": plan.batch.batch_size}
    try:
        out["seq_len"] = plan.batch.seq_len
    except MeshtrainError:
        pass
    out["leaves"] = _batch_leaves(plan)
    return out


def _batch_line(plan) -> str:
    b = _batch_shape(plan)
    if "seq_len" in b and plan.batch.leaves() and all(leaf.axes == ("batch", "seq") for _, leaf in plan.batch.leaves()):
        return f"batch {b['batch_size']}×{b['seq_len']} tokens"
    parts = [f"{p} {'×'.join(map(str, v['shape'])) or 'scalar'} {v['dtype']}" for p, v in b["leaves"].items()]
    return f"batch of {b['batch_size']}: " + ", ".join(parts)


def _model_name(cfg, model_name) -> str:
    return model_name or getattr(cfg, "name", None) or "user model"


def single_dict(plan, cfg, args, *, loss_fn=None, model_name=None) -> Dict[str, object]:
    a = analyse(plan, cfg, _hardware(args, plan.num_devices), loss_fn=loss_fn)
    import jax

    out = plan.to_dict()
    step = a["step"]
    out.update(
        model=_model_name(cfg, model_name), hardware=a["hw"].to_dict(),
        mesh_kind="abstract" if isinstance(plan.mesh, jax.sharding.AbstractMesh) else "devices",
        local_devices=len(jax.devices()),
        batch_shape=_batch_shape(plan),
        options={"remat": plan.recipe.remat.value, "micro_batches": resolve_step(plan).batch_splits,
                 "param_dtype": plan.recipe.param_dtype, "compute_dtype": plan.recipe.compute_dtype},
        estimates=a["memory"].source,
        memory=a["memory"].to_dict(), fit=a["fit"].value, capacity_bytes=a["hw"].hbm_bytes,
        largest=[{"component": c.value, "bytes": b} for c, b in a["memory"].largest(3)],
        collectives={"backend": a["backend"].value, "source": a["ops_source"], "per_axis": per_axis_estimate(a["ops"]),
                     "links": {k: v.value for k, v in a["links"].items()},
                     "ops": [o.to_dict() for o in a["ops"]]},
        step_time=step.to_dict() if step is not None else None, warnings=a["warnings"],
        xla_flags=scheduling_flags(backend_of_hardware(a["hw"])))
    if a["cost"] is not None:
        out["program"] = a["cost"].to_dict()
    pp = _pipeline(plan, cfg, a["backend"])
    if pp is not None:
        out["pipeline"] = pp
    moe = moe_summary(plan, cfg, a["backend"])
    if moe is not None:
        out["moe"] = moe
    out.update(_check(plan, cfg, args, a))
    return _finite(_compiled_forecast(out, plan, cfg, args, out.get("hlo_cost")))


def _compiled_forecast(out, plan, cfg, args, per_op):
    """The forecast from the compiled program's per-op cost (``--check compile|gpu|tpu``; ``source: compiled``);
    without one ``meshtrain plan`` adds the analytic forecast afterwards."""
    if per_op is None:
        return out
    return with_forecast(out, plan, cfg, args, hlo=HloCost.from_dict(per_op))


def _pipeline(plan, cfg, backend):
    """:func:`pipeline_summary` with its activation and point-to-point figures taken from the
    estimates the memory and step-time rows use (:func:`estimate_memory`'s activations for each
    schedule at this plan's stages and micro-batches; the stage-axis collectives of
    :func:`analytic_collectives`), so the report shows one number for each."""
    pp = pipeline_summary(plan, cfg)
    if pp is None or not has_analytic_model(cfg) or plan.batch is None:
        return pp
    acts, wire = {}, {}
    for schedule in Schedule:
        r = pp["repeats"] if schedule is Schedule.CIRCULAR else 1
        variant = dataclasses.replace(plan, recipe=plan.recipe.with_options(schedule=schedule, repeats=r))
        acts[schedule.value] = estimate_memory(variant, cfg, backend=backend)[Component.ACTIVATIONS]
        wire[schedule.value] = sum(o.wire_bytes_per_step for o in analytic_collectives(variant, cfg, backend)
                                   if o.axes == ("stage",))
    pp = {k: v for k, v in pp.items() if k != "layer_activation_bytes"}
    pp.update(activation_bytes_per_stage=acts[pp["schedule"]], activation_bytes_per_schedule=acts,
              p2p_bytes_per_step=wire[pp["schedule"]], p2p_bytes_per_schedule=wire,
              figures="activations: the memory estimate's activations component per schedule; stage traffic: "
                      "wire bytes per device of the stage-axis collectives (hand-offs, broadcasts)")
    return pp


def _collective_rows(a) -> List[str]:
    per = per_axis_estimate(a["ops"], by_span=True)
    kinds = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
    times = {t.axes: t for t in a["step"].axes} if a["step"] is not None else {}
    rows = [f"  {'axes':14s} {'link':5s} " + " ".join(f"{k:>15s}" for k in kinds[:3])
            + f" {'wire/device':>12s} {'time':>10s} {'exposed':>10s}"]
    for key, kv in sorted(per.items()):
        t = times.get(key)
        rows.append(f"  {key:14s} {t.link.value if t else '':5s} "
                    + " ".join(f"{fmt_bytes(kv.get(k, 0), SIG3):>15s}" for k in kinds[:3])
                    + f" {fmt_bytes(t.wire_bytes, SIG3) if t else '':>12s} {_secs(t.seconds) if t else '':>10s}"
                    + f" {_secs(t.exposed_seconds) if t else '':>10s}")
    return rows if per else ["  none (one device, or nothing sharded)"]


def _flags_line(hw) -> str:
    flags = scheduling_flags(backend_of_hardware(hw))
    if not flags:
        return f"XLA scheduling flags ({backend_of_hardware(hw)}): none needed"
    return "XLA scheduling flags `meshtrain train` sets on this backend: " + "; ".join(
        f"{var}={value}" for var, value in flags.items())


def kernel_line(plan, hw) -> str:
    """Which attention kernel every layer gets when the step is compiled for ``hw``'s platform (the target's, not
    this host's): the step's one decision (:func:`meshtrain.parallel.resolved.resolve_step`), which the kernels run
    and the memory terms read."""
    step = resolve_step(plan, gpu_aot.hardware_target(hw))
    return f"attention kernel for {step.target.name}: {step.attention.describe()}"


def single_text(plan, cfg, args, *, table: bool = True, loss_fn=None, model_name=None) -> str:
    a = analyse(plan, cfg, _hardware(args, plan.num_devices), loss_fn=loss_fn)
    hw, mem, step = a["hw"], a["memory"], a["step"]
    r = plan.recipe
    lines = [plan.describe(max_rows=None)] if table else []
    lines += ["", f"hardware {hw.name}: {hw.description}; peak {_rate(hw.peak_flops, 'FLOP/s')}, HBM "
                  f"{fmt_bytes(hw.hbm_bytes, SIG3)} at {_rate(hw.hbm_bytes_per_s, 'B/s')}, fast links "
                  f"{_rate(hw.fast_link_bytes_per_s, 'B/s')} within {hw.fast_domain}, slow links "
                  f"{_rate(hw.slow_link_bytes_per_s, 'B/s')} (sources: meshtrain.analysis.hardware)",
              f"model {_model_name(cfg, model_name)}; {_batch_line(plan)}; params {r.param_dtype}, compute "
              f"{r.compute_dtype}, remat {r.remat.value}, micro-batches {resolve_step(plan).batch_splits}",
              kernel_line(plan, hw), _flags_line(hw), ""]
    if plan.heads and not table:  # the table's own heads line says it otherwise
        lines.insert(-1, f"heads: {plan.heads['describe']}")
    frac = "" if math.isinf(hw.hbm_bytes) else f" ({mem.total / hw.hbm_bytes:.0%})"
    source = "" if mem.source == ANALYTIC else f" ({mem.source})"
    lines.append(f"memory per device{source}: {fmt_bytes(mem.total, SIG3)} of {fmt_bytes(hw.hbm_bytes, SIG3)} — "
                 f"{a['fit'].value}{frac}")
    lines.append("  largest: " + ", ".join(f"{c.value} {fmt_bytes(b, SIG3)}" for c, b in mem.largest(3)))
    formulas = dict(mem.formulas)
    for c, b in mem.components:
        lines.append(f"  {c.value:16s} {fmt_bytes(b, SIG3):>12s}  {formulas[c]}")
        terms = mem.terms_of(c)
        if len(terms) > 1:  # the sum's parts, each with its formula
            lines += [f"  {'':16s} {fmt_bytes(t.bytes, SIG3):>12s}    + {t.name}: {t.formula}" for t in terms]
    lines += ["", f"collectives per step ({a['ops_source']}; bytes = result per device):"]
    lines += _collective_rows(a)
    lines += moe_lines(moe_summary(plan, cfg, a["backend"]))
    lines += pipeline_lines(_pipeline(plan, cfg, a["backend"]))
    if step is None:
        lines += ["", "step time: unknown without the model's loss; pass --loss module:fn (a function (model, "
                      "batch) -> (loss_sum, weight[, metrics])) to estimate it from the compiled program"]
    else:
        how = "" if step.source == ANALYTIC else f" ({step.source}: executed FLOPs {step.executed_flops:.3g})"
        lines += ["", f"step time ≈ {_secs(step.step_s)}{how}: compute {_secs(step.compute_s)}, HBM traffic "
                      f"{_secs(step.memory_s)}, exposed communication {_secs(step.exposed_comm_s)} "
                      f"({step.bound.value}-bound) → MFU {step.mfu:.1%} (roofline upper bound), "
                      f"{step.tokens_per_s:,.0f} {step.unit}/s"]
        lines += _step_notes(plan, cfg, step)
    lines += ["", "warnings:" if a["warnings"] else "warnings: none"] + [f"  - {w}" for w in a["warnings"]]
    chk = _check(plan, cfg, args, a)
    if chk.get("check") in ("compile", "tpu"):
        m = chk["measured_memory"]
        lines += ["", f"check ({chk['check']}{' ' + chk['topology'] if 'topology' in chk else ''}): XLA peak "
                      f"{fmt_bytes(m['peak'], SIG3)} (argument + output − alias + temp) vs estimate "
                      f"{fmt_bytes(chk['estimated_memory'], SIG3)}"
                      f"{' (' + chk['estimate_source'] + ', no compile)' if 'estimate_source' in chk else ''} "
                      f"({chk['memory_error']:+.1%})"]
        ana = chk.get("analytic_bytes_per_axis_cpu", {})
        for key, kv in sorted(chk["hlo_bytes_per_axis"].items()):
            est = ana.get(key, {}).get("total")
            lines.append(f"  HLO collectives over {key}: {fmt_bytes(kv['total'], SIG3)}"
                         + (f" vs analytic (cpu) {fmt_bytes(est, SIG3)}" if est is not None else ""))
    elif chk.get("check") == "gpu":
        lines += gpu_aot.check_lines(chk)
    elif chk.get("check") == "lower":
        lines += ["", f"check (lower for {chk['platform']} on an AbstractMesh): {chk['arguments']} arguments, "
                      f"{chk['sharded_arguments']} sharded"]
    return _compiled_forecast("\n".join(lines), plan, cfg, args, chk.get("hlo_cost"))


def _step_notes(plan, cfg, step) -> List[str]:
    """What the step time counts for an MoE model (active FLOPs) and a pipeline (the bubble)."""
    out = []
    if step.source == ANALYTIC and getattr(cfg, "n_experts", 0):
        out.append(f"  MFU counts active FLOPs: 6·N_active + attention, N_active = {cfg.num_active_params():,} of "
                   f"{cfg.num_params():,} parameters (top-{cfg.experts_per_token} of {cfg.n_experts} experts"
                   + (f" + {cfg.n_shared_experts} shared" if cfg.n_shared_experts else "") + "); executed FLOPs "
                   f"{step.executed_flops:.3g} = {step.executed_flops / step.model_flops:.2f}× model (remat, "
                   f"capacity padding" + (", pipeline" if pipeline_shape(plan) else "") + ")")
    pipe = pipeline_shape(plan) if step.source == ANALYTIC else None
    if pipe is not None:
        out.append(f"  pipeline {pipe.describe()}: compute counts the layer stack × 1/(1 - bubble) = "
                   f"{pipe.stack_factor:.3f} (every stage computes on every tick that has work) and the head on "
                   f"every stage; stage hand-offs are point-to-point over `stage`, on the critical path")
    return out


def auto(args, cfg):
    if not has_analytic_model(cfg):
        raise ConfigError(f"--recipe auto searches with the analytic decoder formulas; {_model_name(cfg, args.model)} "
                          f"has none (estimates come from compiling each layout): name a recipe, e.g. --recipe fsdp, "
                          f"and compare a few")
    if getattr(args, "mesh", None):
        raise ConfigError("--mesh cannot be combined with --recipe auto (the search picks the mesh); drop --mesh "
                          "or name a recipe")
    import jax

    n = args.devices or len(jax.devices())
    # --local-attention (or the old --attention) and --pipeline-micro-batches / --grad-accum (or the old
    # --micro-batches) fix what the search would otherwise vary, as they do for a named recipe.
    attention = getattr(args, "local_attention", None) or getattr(args, "attention", None)
    if attention not in (None, "dense", "flash"):
        raise ConfigError(f"with --recipe auto, --local-attention takes dense or flash (used by the recipes whose "
                          f"attention is dense; the context-parallel recipes keep theirs), not {attention}")
    given = [getattr(args, k, None) for k in ("pipeline_micro_batches", "grad_accum", "micro_batches")]
    micro = tuple(v for v in given if v)[:1]
    schedule = getattr(args, "schedule", None)
    req = PlanRequest(cfg, n, getattr(args, "hardware", "cpu") or "cpu", args.batch_size, args.seq_len,
                      remats=(Remat(args.remat),) if getattr(args, "remat", None) else AUTO_REMATS,
                      compute_dtype=getattr(args, "compute_dtype", None), param_dtype=args.param_dtype,
                      micro_batches=micro, slices=getattr(args, "slices", None) or 1,
                      attention=attention,
                      **({"schedules": (schedule,)} if schedule else {}))
    return plan_auto(req)


def _auto_header(result) -> str:
    req = result.request
    counts = ", ".join(f"{k}: {v}" for k, v in sorted(result.rejection_counts().items())) or "none"
    hw = req.hw()
    where = (f" in {req.slices} slices/nodes of {hw.fast_domain} (fast links within, slow across)"
             if req.slices > 1 else "")
    return (f"searched {len(result.ranked) + len(result.rejected)} layouts (built-in recipes × mesh "
            f"factorisations × remat × micro-batches × pipeline schedules {'/'.join(req.schedules)}) for "
            f"{req.model.name} on {req.num_devices} × {hw.name}{where}, batch {req.global_batch}×{req.tokens_seq}"
            + (f", attention {req.attention} where the recipe's is dense" if req.attention else "")
            + f": {len(result.ranked)} fit, rejected {counts}")


def auto_text(result, args) -> str:
    top = getattr(args, "top", 8) or 8
    lines = [_auto_header(result), "",
             f"  {'#':>2s} {'layout':72s} {'memory':>10s} {'fit':>6s} {'step':>9s} {'MFU':>6s} bound"]
    for i, c in enumerate(result.ranked[:top], 1):
        lines.append(f"  {i:2d} {c.label:72s} {fmt_bytes(c.memory.total, SIG3):>10s} {c.fit.value:>6s} "
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
