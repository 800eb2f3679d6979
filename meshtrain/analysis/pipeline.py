"""Planner figures for pipeline recipes (``pp`` strategy): bubble per schedule, activation memory per
stage, point-to-point bytes per step. Formulas (per device; ``p`` stages, ``m`` micro-batches, ``r``
repeats, ``b = B / (dp·m)`` rows of a micro-batch on one device, ``T`` tokens, ``d`` model width,
``w`` bytes per activation element):

* bubble: gpipe ``(p-1)/(m+p-1)``, circular ``(p-1)/(r·m+p-1)``, 1f1b ``(2p-2)/(m+2p-2)`` (every tick
  runs one forward and one backward on every stage, so warm-up and drain are two ticks per stage);
* stage input of one micro-batch ``x = b·T·d·w``; one layer's saved activations (remat none)
  ``a = b·T·(4d + 2(n+k)h + 3f + n·T)·w / tensor`` (norm inputs, q/k/v, scores, MLP gate/up/product;
  remat full: ``a = x``);
* activations per stage: gpipe and circular keep all ``m`` micro-batches: ``m·(L/p)·a``; 1f1b stashes
  ``min(2p-1, m)`` stage inputs and recomputes one micro-batch at a time: ``min(2p-1, m)·x + (L/p)·a``;
* point-to-point per step: each tick every stage sends ``x`` forward and a cotangent ``x`` back:
  ``2·ticks·x``; circular also moves ``(r-1)/r`` of its layer weights (and their gradients) into the
  interleaved order.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np

from meshtrain.parallel.pipeline import PipelineConfig, bubble_fraction, bubble_warning, config_for, schedule_table
from meshtrain.errors import ConfigError
from meshtrain.recipes import Remat, Schedule


def is_pipelined(plan) -> bool:
    return bool(plan.recipe.step_options().get("pipeline"))


def pipeline_summary(plan, cfg) -> Optional[Dict[str, object]]:
    """The pipeline figures for ``plan`` (``None`` for recipes without the ``pp`` strategy)."""
    if not is_pipelined(plan):
        return None
    pc: PipelineConfig = config_for(plan.recipe, plan.mesh_sizes)
    p, m, r = pc.stages, pc.micro_batches, pc.repeats if pc.schedule is Schedule.CIRCULAR else 1
    out: Dict[str, object] = {
        "schedule": pc.schedule.value, "stages": p, "micro_batches": m, "repeats": r,
        "ticks": schedule_table(pc.schedule, p, m, r).ticks if m >= p else None,
        "bubble": pc.bubble,
        "bubble_per_schedule": {s.value: bubble_fraction(s, p, m, max(r, 1)) for s in Schedule},
        "warning": bubble_warning(pc) if m >= p else None,
        "error": _problem(pc, cfg, plan),
    }
    if cfg is None or not hasattr(cfg, "d_model") or plan.batch is None:
        return out
    sizes = plan.mesh_sizes
    dp = int(np.prod([sizes.get(a, 1) for a in ("data", "fsdp")]))
    tensor = sizes.get("tensor", 1)
    batch, seq = _batch_and_seq(plan)
    w = np.dtype(plan.recipe.compute_dtype).itemsize
    b = max(batch // (dp * m), 1)
    x = b * seq * cfg.d_model * w
    if plan.recipe.remat is Remat.FULL:
        a = x
    else:
        per_tok = (4 * cfg.d_model + 2 * (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim + 3 * cfg.d_ff
                   + cfg.n_heads * seq)
        a = b * seq * per_tok * w // tensor
    per_stage = cfg.n_layers // p
    keep = {Schedule.GPIPE.value: m * per_stage * a, Schedule.CIRCULAR.value: m * per_stage * a,
            Schedule.ONE_F_ONE_B.value: min(2 * p - 1, m) * x + per_stage * a}
    ticks = {s.value: schedule_table(s, p, m, max(r, 1)).ticks for s in Schedule} if m >= p else {}
    out.update(
        stage_input_bytes=x, layer_activation_bytes=a,
        activation_bytes_per_stage=keep[pc.schedule.value], activation_bytes_per_schedule=keep,
        p2p_bytes_per_step=2 * ticks.get(pc.schedule.value, 0) * x,
        p2p_bytes_per_schedule={k: 2 * t * x for k, t in ticks.items()},
    )
    return out


def _problem(pc: PipelineConfig, cfg, plan) -> Optional[str]:
    """What the train step would refuse (too few micro-batches, indivisible layers), or ``None``."""
    try:
        pc.check(getattr(cfg, "n_layers", None), _batch_and_seq(plan)[0] if plan.batch is not None else None)
    except ConfigError as exc:
        return str(exc)
    return None


def _batch_and_seq(plan):
    for _, leaf in plan.batch.leaves():
        if leaf.batch_dim is not None:
            shape = leaf.shape
            seq = shape[leaf.batch_dim + 1] if len(shape) > leaf.batch_dim + 1 else 1
            return shape[leaf.batch_dim], seq
    return 1, 1


def _mib(n) -> str:
    return f"{n / 2 ** 20:.2f} MiB"


def pipeline_lines(summary: Optional[Dict[str, object]]) -> List[str]:
    """Report lines for :func:`pipeline_summary` (none without a pipeline)."""
    if summary is None:
        return []
    s = summary
    per = ", ".join(f"{k} {v:.0%}" for k, v in s["bubble_per_schedule"].items())
    lines = ["", f"pipeline: {s['schedule']}, {s['stages']} stages × {s['micro_batches']} micro-batches"
                 + (f" × {s['repeats']} repeats" if s["schedule"] == "circular" else "")
                 + (f", {s['ticks']} ticks" if s["ticks"] else "") + f"; bubble {s['bubble']:.0%} (by schedule: {per})"]
    if "activation_bytes_per_stage" in s:
        acts = ", ".join(f"{k} {_mib(v)}" for k, v in s["activation_bytes_per_schedule"].items())
        lines.append(f"  activations per stage {_mib(s['activation_bytes_per_stage'])} (by schedule: {acts}); "
                     f"point-to-point {_mib(s['p2p_bytes_per_step'])} per step per device")
    if s.get("error"):
        lines.append(f"  error: the train step would refuse this: {s['error']}")
    if s.get("warning"):
        lines.append(f"  warning: {s['warning']}")
    return lines
