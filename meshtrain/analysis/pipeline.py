"""Planner figures for pipeline recipes (``pp`` strategy): bubble per schedule, activation memory per
stage, point-to-point bytes per step. Formulas (per device; ``p`` stages, ``m`` micro-batches, ``r``
repeats, ``b = B / (dp·m)`` rows of a micro-batch on one device, ``T`` tokens, ``d`` model width,
``w`` bytes per activation element):

* bubble: gpipe ``(p-1)/(m+p-1)``, circular ``(p-1)/(r·m+p-1)``, 1f1b ``(p-1)/(m+p-1)`` (its ``m+2p-2``
  ticks hold a forward and a backward slot, but conditionals skip the backward on the ``p-1``
  warm-up ticks and the forward on the ``p-1`` drain ticks); zero_bubble ``(p-1)(1-ω)/(m+(p-1)(1-ω))``
  (its weight-gradient slot, ``ω = 1/4`` of the work, runs only on the ``m`` ticks where every stage has one);
* stage input of one micro-batch ``x = b·T·d·w``; one layer's saved activations (remat none)
  ``a = b·T·(4d + 2(n+k)h + 3f + n·T)·w / tensor`` (norm inputs, q/k/v, scores, MLP gate/up/product;
  remat full: ``a = x``);
* activations per stage: gpipe and circular keep all ``m`` micro-batches: ``m·(L/p)·a``; 1f1b stashes
  ``min(2p-1, m)`` stage inputs and recomputes one micro-batch at a time: ``min(2p-1, m)·x + (L/p)·a``;
  zero_bubble adds the weight halves it defers: ``(p+3)·(L/p)·(a_W + x)`` (``p`` micro-batches wait between
  their input and weight gradients, one idle-tick slot, and the input-gradient tick's own residuals and
  kept halves), ``a_W`` a layer's saved activations without remat (the weight half's residuals);
* point-to-point per step: each tick every stage sends ``x`` forward and a cotangent ``x`` back:
  ``2·ticks·x``; circular also moves ``(r-1)/r`` of its layer weights (and their gradients) into the
  interleaved order.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional

import numpy as np

from meshtrain.analysis.layout import cached
from meshtrain.parallel.pipeline import PipelineConfig, bubble_fraction, bubble_warning, config_for, schedule_table
from meshtrain.errors import ConfigError
from meshtrain.recipes import Remat, Schedule
from meshtrain.strategies import Pipeline


def is_pipelined(plan) -> bool:
    return plan.recipe.dimension(Pipeline) is not None


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
    per_tok = (4 * cfg.d_model + 2 * (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim + 3 * cfg.d_ff
               + cfg.n_heads * seq)
    a_none = b * seq * per_tok * w // tensor
    a = x if plan.recipe.remat is Remat.FULL else a_none
    per_stage = cfg.n_layers // p
    ofob = min(2 * p - 1, m) * x + per_stage * a
    keep = {Schedule.GPIPE.value: m * per_stage * a, Schedule.CIRCULAR.value: m * per_stage * a,
            Schedule.ONE_F_ONE_B.value: ofob,
            Schedule.ZERO_BUBBLE.value: ofob + zero_bubble_extra_bytes(p, per_stage, a_none, x)}
    ticks = {s.value: schedule_table(s, p, m, max(r, 1)).ticks for s in Schedule} if m >= p else {}
    out.update(
        stage_input_bytes=x, layer_activation_bytes=a,
        activation_bytes_per_stage=keep[pc.schedule.value], activation_bytes_per_schedule=keep,
        p2p_bytes_per_step=2 * ticks.get(pc.schedule.value, 0) * x,
        p2p_bytes_per_schedule={k: 2 * t * x for k, t in ticks.items()},
    )
    return out


def zero_bubble_extra_bytes(stages: int, layers_per_stage: int, weight_half_bytes: float, stage_input_bytes: float):
    """What zero_bubble keeps on a stage beyond 1f1b: ``(p+3)·(L/p)·(a_W + x)``: the weight halves of the
    ``p`` micro-batches between their input and weight gradients (each layer's output cotangent ``x`` and
    the residuals ``a_W`` the weight gradient reads), an idle-tick slot, and the input-gradient tick's own
    VJP residuals and the halves it is storing."""
    return (stages + 3) * layers_per_stage * (weight_half_bytes + stage_input_bytes)


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


# ---- helpers for the memory and step-time estimates (analysis.memory, analysis.steptime, comms) ----

class PipelineShape:
    """What the estimates need to know about a pipelined plan: ``p`` stages, ``m`` micro-batches, ``r``
    repeats (circular; 1 otherwise), the schedule, its ticks and its bubble
    (:func:`~meshtrain.parallel.pipeline.bubble_fraction`). Every stage computes on every tick that has
    work anywhere (SPMD), so the stack's compiled work is ``1 / (1 - bubble)`` of the work without a
    pipeline: ``m / (1 - bubble)`` stage passes per device per direction (gpipe ``m + p - 1``, circular
    ``(r·m + p - 1) / r`` passes of the whole stage, 1f1b ``m + p - 1``: its warm-up ticks run no
    backward and its drain ticks no forward)."""

    def __init__(self, schedule: Schedule, stages: int, micro_batches: int, repeats: int):
        self.schedule, self.stages, self.micro_batches = schedule, stages, micro_batches
        self.repeats = repeats if schedule is Schedule.CIRCULAR else 1
        self.ticks = schedule_table(schedule, stages, micro_batches, self.repeats).ticks
        self.bubble = bubble_fraction(schedule, stages, micro_batches, self.repeats)

    @property
    def one_f_one_b(self) -> bool:
        """1f1b or zero_bubble: the backward written out per stage (a stash of stage inputs, recomputed)."""
        return self.schedule.explicit_vjp

    @property
    def stack_factor(self) -> float:
        """Compiled FLOPs of the layer stack ÷ its FLOPs without a pipeline: ``1 / (1 - bubble)``
        (gpipe ``(m+p-1)/m``, circular ``(r·m+p-1)/(r·m)``, 1f1b ``(m+p-1)/m``)."""
        return 1.0 / (1.0 - self.bubble)

    @property
    def stage_ticks(self) -> float:
        """Ticks on which a stage runs a forward (or a backward) tick's worth of layers: ``r·m / (1 - bubble)``."""
        return self.repeats * self.micro_batches * self.stack_factor

    def layer_runs(self, n_layers: int) -> float:
        """Layer passes one device runs per step in each direction: ``m·L / (p·(1 - bubble))``."""
        return self.stage_ticks * n_layers / (self.stages * self.repeats)

    def stage_activation_bytes(self, n_layers: int, layer_bytes: float, stage_input_bytes: float,
                               weight_half_bytes: float = 0.0) -> float:
        """Saved activations of the stack on one device: gpipe / circular keep every forward tick's
        residuals (``ticks · L/(p·r) · a``; ticks on padding keep theirs too); 1f1b stashes the stage
        inputs of the micro-batches in flight (a ``2p``-slot buffer of ``x``); zero_bubble also keeps
        the deferred weight halves (:func:`zero_bubble_extra_bytes`, ``weight_half_bytes`` per layer)."""
        if self.schedule is Schedule.ZERO_BUBBLE:
            return 2 * self.stages * stage_input_bytes + zero_bubble_extra_bytes(
                self.stages, n_layers // self.stages, weight_half_bytes, stage_input_bytes)
        if self.one_f_one_b:
            return 2 * self.stages * stage_input_bytes
        return self.layer_runs(n_layers) * layer_bytes

    def describe(self) -> str:
        return (f"{self.schedule.value}, p={self.stages}, m={self.micro_batches}"
                + (f", r={self.repeats}" if self.schedule is Schedule.CIRCULAR else "")
                + f", {self.ticks} ticks, bubble {self.bubble:.0%}")


def pipeline_shape(plan) -> Optional[PipelineShape]:
    """The :class:`PipelineShape` of a plan whose recipe has the ``pp`` strategy (``None`` otherwise).
    One stage still runs the schedule (the train step does): gpipe then keeps all ``m`` micro-batches."""
    return cached(plan, "pipeline_shape", _pipeline_shape)


def _pipeline_shape(plan) -> Optional[PipelineShape]:
    if not is_pipelined(plan):
        return None
    pc = config_for(plan.recipe, plan.mesh_sizes)
    return _shape(pc.schedule, pc.stages, pc.micro_batches, pc.repeats)


@functools.lru_cache(maxsize=4096)
def _shape(schedule: Schedule, stages: int, micro_batches: int, repeats: int) -> PipelineShape:
    return PipelineShape(schedule, stages, micro_batches, repeats)  # immutable in use: shared


def pipeline_problem(plan, cfg) -> Optional[str]:
    """What the train step would refuse for this pipelined plan (``None`` when it would run, or for
    a plan without a pipeline): too few micro-batches, layers not divisible into the stage groups."""
    if not is_pipelined(plan):
        return None
    return _problem(config_for(plan.recipe, plan.mesh_sizes), cfg, plan)
