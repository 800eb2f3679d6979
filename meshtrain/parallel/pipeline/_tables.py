"""Schedule tables (which stage runs which micro-batch at each tick), bubbles, timelines, and the
:class:`PipelineConfig` a recipe resolves to."""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import numpy as np

from meshtrain.errors import ConfigError
from meshtrain.parallel.pipeline._parts import STAGE
from meshtrain.strategies import Pipeline, Schedule


# ---- schedule tables -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ScheduleTable:
    """What each stage does at each tick: ``forward[t, s]`` / ``backward[t, s]`` are micro-batch
    indices (-1: idle), ``group[t, s]`` the repeat (layer group) of the forward; ``weight[t, s]`` the
    micro-batch whose weight gradient the tick computes (zero_bubble only; ``None`` otherwise). The
    executors read these tables; :func:`timeline` turns them into stage × time charts."""

    schedule: Schedule
    stages: int
    micro_batches: int
    repeats: int
    forward: np.ndarray
    group: np.ndarray
    backward: np.ndarray
    weight: Optional[np.ndarray] = None

    @property
    def ticks(self) -> int:
        return int(self.forward.shape[0])

    @property
    def bubble(self) -> float:
        """Idle share of the stages' compute (what the compiled FLOPs show as extra work)."""
        return bubble_fraction(self.schedule, self.stages, self.micro_batches, self.repeats)


def schedule_table(schedule: "Schedule | str", stages: int, micro_batches: int, repeats: int = 1) -> ScheduleTable:
    """The tick table of ``schedule`` for ``stages`` × ``micro_batches`` (× ``repeats`` for circular)."""
    schedule = Schedule(schedule)
    p, m, r = stages, micro_batches, repeats if schedule is Schedule.CIRCULAR else 1
    s = np.arange(p)[None, :]
    if schedule.explicit_vjp:
        t = np.arange(m + 2 * p - 2)[:, None]
        fwd, bwd = t - s, t - (2 * p - 2 - s)
        fwd = np.where((fwd >= 0) & (fwd < m), fwd, -1)
        bwd = np.where((bwd >= 0) & (bwd < m), bwd, -1)
        weight = None
        if schedule is Schedule.ZERO_BUBBLE:
            # every stage runs the weight gradient of micro-batch t-(2p-2) on tick t: the tick of stage 0's
            # input gradient of it, the last to come; a stage s > 0 keeps that half s ticks (p slots suffice)
            wt = np.broadcast_to(t - (2 * p - 2), fwd.shape)
            weight = np.where((wt >= 0) & (wt < m), wt, -1)
        return ScheduleTable(schedule, p, m, 1, fwd, np.where(fwd >= 0, 0, -1), bwd, weight)
    t = np.arange(r * m + p - 1)[:, None]
    u = t - s  # position of the work item on stage s in the order (group 0: mb 0..m-1, group 1: ...)
    ok = (u >= 0) & (u < r * m)
    fwd = np.where(ok, u % m, -1)
    grp = np.where(ok, u // m, -1)
    return ScheduleTable(schedule, p, m, r, fwd, grp, np.full_like(fwd, -1))


#: The weight-gradient share of a stage's work per micro-batch under zero_bubble (forward, recomputed
#: forward, input gradient, weight gradient: one matmul pass each for matmul-bound layers).
WEIGHT_SHARE = 0.25


def bubble_fraction(schedule: "Schedule | str", stages: int, micro_batches: int, repeats: int = 1, *,
                    weight_share: float = WEIGHT_SHARE) -> float:
    """Idle share of compute: gpipe ``(p-1)/(m+p-1)``, circular ``(p-1)/(r·m+p-1)``, 1f1b
    ``(p-1)/(m+p-1)`` (its ``m + 2p - 2`` ticks each hold a forward and a backward slot, but the
    ``p - 1`` warm-up ticks run only forwards and the ``p - 1`` drain ticks only backwards).

    zero_bubble: ``(p-1)(1-ω)/(m + (p-1)(1-ω))`` with ``ω = weight_share``, the weight gradient's share
    of a micro-batch's stage work: the forward and input-gradient slots still run ``m + p - 1`` ticks,
    but the weight-gradient slot runs only the ``m`` ticks where every stage has one. E.g.
    ``bubble_fraction("zero_bubble", 4, 8) == 9/41`` against 1f1b's ``3/11``."""
    schedule, p, m = Schedule(schedule), stages, micro_batches
    if schedule is Schedule.ZERO_BUBBLE:
        idle = (p - 1) * (1.0 - weight_share)
        return idle / (m + idle)
    r = repeats if schedule is Schedule.CIRCULAR else 1
    return (p - 1) / (r * m + p - 1)


def timeline(table: ScheduleTable) -> np.ndarray:
    """A ``(stages, slots)`` chart of strings (``"F3"``, ``"B3"``, ``""``) in time order: gpipe and
    circular list the forward ticks then the backward ticks (autodiff replays the forward ticks in
    reverse); 1f1b lists each tick as a forward slot then a backward slot, zero_bubble as a forward,
    an input-gradient (``B``) and a weight-gradient (``W``) slot."""
    p = table.stages
    if table.schedule.explicit_vjp:
        slots = [("F", table.forward), ("B", table.backward)] + ([("W", table.weight)] if table.weight is not None
                                                                 else [])
        cols = [[f"{kind}{tab[t, s]}" if tab[t, s] >= 0 else "" for s in range(p)]
                for t in range(table.ticks) for kind, tab in slots]
    else:
        def cell(kind, t, s):
            if table.forward[t, s] < 0:
                return ""
            g = f".{table.group[t, s]}" if table.repeats > 1 else ""
            return f"{kind}{table.forward[t, s]}{g}"
        cols = [[cell("F", t, s) for s in range(p)] for t in range(table.ticks)]
        cols += [[cell("B", t, s) for s in range(p)] for t in reversed(range(table.ticks))]
    return np.array(cols, dtype=object).T


# ---- validation --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """A pipeline's shape: ``stages`` (mesh ``stage`` size), ``micro_batches``, ``repeats``, ``schedule``."""

    schedule: Schedule
    stages: int
    micro_batches: int
    repeats: int = 1

    @property
    def groups(self) -> int:
        """Layer groups the stack is cut into (``stages × repeats`` for circular, ``stages`` otherwise)."""
        return self.stages * (self.repeats if self.schedule is Schedule.CIRCULAR else 1)

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.schedule, self.stages, self.micro_batches, self.repeats)

    def check(self, n_layers: Optional[int] = None, batch_size: Optional[int] = None) -> None:
        """``ConfigError`` naming the fix for indivisible layers, too few micro-batches or a batch that
        does not split into them."""
        p, m = self.stages, self.micro_batches
        if self.schedule is Schedule.ZERO_BUBBLE and p < 2:
            raise ConfigError(f"schedule zero_bubble needs a pipeline: the mesh's stage axis has size {p}; give it "
                              f"2 or more devices (e.g. --mesh stage=2,data=...) or pick --schedule 1f1b/gpipe")
        if self.schedule is not Schedule.CIRCULAR and self.repeats != 1:
            raise ConfigError(f"repeats={self.repeats} applies to the circular schedule only; pass --schedule "
                              f"circular or --repeats 1")
        if m < p:
            raise ConfigError(f"pipeline with {p} stages needs micro_batches >= {p} (got {m}): pass "
                              f"--pipeline-micro-batches {max(p, 4 * p)} (or recipe.with_options(pipeline_micro_batches=...))")
        if n_layers is not None and n_layers % self.groups:
            what = f"stages × repeats = {p} × {self.repeats}" if self.schedule is Schedule.CIRCULAR else f"stages = {p}"
            raise ConfigError(f"the model has {n_layers} layers, not divisible by {what}; change the mesh's stage "
                              f"size" + (" or --repeats" if self.schedule is Schedule.CIRCULAR else "")
                              + f" so that it divides {n_layers}")
        if batch_size is not None and batch_size % m:
            raise ConfigError(f"batch size {batch_size} does not split into micro_batches={m}; pick a divisor")


def config_for(recipe, mesh_sizes: Dict[str, int]) -> PipelineConfig:
    """The :class:`PipelineConfig` of a recipe with the ``pp`` strategy on a mesh of ``mesh_sizes``."""
    pp = recipe.dimension(Pipeline)
    return PipelineConfig(pp.schedule, int(mesh_sizes.get(STAGE, 1)), pp.micro_batches, pp.repeats)


def bubble_warning(cfg: PipelineConfig, limit: float = 0.25) -> Optional[str]:
    """A warning line when the bubble exceeds ``limit`` (else ``None``)."""
    if cfg.bubble <= limit:
        return None
    return (f"pipeline bubble {cfg.bubble:.0%} ({cfg.schedule.value}, {cfg.stages} stages, {cfg.micro_batches} "
            f"micro-batches" + (f", {cfg.repeats} repeats" if cfg.schedule is Schedule.CIRCULAR else "")
            + f") exceeds {limit:.0%}: raise --pipeline-micro-batches" + (" or --repeats" if cfg.schedule is Schedule.CIRCULAR
                                                                 else ""))
