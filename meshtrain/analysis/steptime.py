"""Step-time estimate from compute, memory traffic and per-axis communication, and the MFU it implies.

Example::

    est = estimate_step_time(plan, cfg, get_hardware("tpu-v5p"))
    est.step_s, est.mfu, est.bound                # seconds, 0..1, "compute" / "memory" / "communication"
    for a in est.axes: print(a.axes, a.link, a.seconds)

Per device (``n`` devices, ``P`` peak FLOP/s, ``W`` HBM bytes/s)::

    compute  = executed FLOPs / n / P                       (flops.step_flops: dense attention, remat)
    memory   = HBM traffic / W
    traffic  = m·((3 + r)·weights + 3·A_none + (A_none − A_saved)) + 2·params + grads + 2·optimizer
    comm(op) = executions · (α·hops + wire bytes / link bytes/s)      per collective (comms.py)
    exposed  = Σ critical-path comm + Σ_phase max(0, overlappable comm(phase) − overlap · compute(phase))
    step     = max(compute, memory) + exposed
    MFU      = model FLOPs (6·N·tokens + attention, flops.py) / (step · n · P)

Mixture of experts: ``model FLOPs`` count the *active* parameters (top-``k`` of ``E`` experts + shared
ones, :func:`meshtrain.models.flops.matmul_params`); executed FLOPs add the capacity padding
(``E·C/T − k`` expert rows per token computed for nothing); the token all-to-all (dispatch +
combine, forward and backward, :func:`meshtrain.analysis.comms.moe_exchange_bytes`) is on the
critical path over the expert axes' links (hierarchical: its level inside a slice on the fast links,
its level across slices on the slow ones, rows ``expert (ici)`` / ``expert (dcn)``). Pipelines: executed
FLOPs of the layer stack × ``1/(1 − bubble)`` (every stage computes on every tick with work; 1f1b also re-runs each stage's
forward in its VJP) and the head on every stage (× ``p``); the per-layer collectives follow the
``m·L/(p·(1 − bubble))`` layer passes a device makes, and the stage hand-offs are critical-path
collective-permutes over ``stage`` (:func:`meshtrain.analysis.comms.analytic_collectives`).

``weights`` are the compute-dtype bytes a device multiplies with (gathered over FSDP axes),
``r = 1`` with ``remat=full``; ``A_none`` is every layer's activations with nothing saved-away
(written in the forward, read and written again in the backward), ``A_saved`` what the recipe's
remat keeps (the rest is written again when recomputed). ``hops = ⌈log₂ g⌉`` (all-gather,
reduce-scatter) or ``2⌈log₂ g⌉`` (all-reduce) for a group of ``g`` devices. A mesh axis uses the
slow links (InfiniBand / DCN) when it is a DCN axis of the recipe or when it and the axes inside it
span more devices than the fast-link domain. ``overlap`` is 1 on GPU/TPU (XLA's latency-hiding
scheduler runs FSDP gathers and gradient reductions behind compute) and 0 on CPU. Phases: the
forward's FSDP gathers hide behind the forward compute (``forward FLOPs / executed FLOPs`` of the
compute time), the backward re-gathers and gradient reductions behind the rest.

Any other model (no analytic formulas; ``cfg`` not a ``DecoderConfig``) is estimated from its
program (:mod:`meshtrain.analysis.compiled`, ``source`` says which): executed FLOPs = the step's
matmul/convolution FLOPs counted on its jaxpr (loops by trip count, remat included), HBM traffic
``m·(p·W + 3·A) + 3·params + 2·optimizer`` (``W`` weights as multiplied, ``A`` the traced saved
activations, ``p = 4`` with ``remat=full`` else 3), collectives from the compiled HLO (a real mesh;
all overlappable with the whole compute) or the parameter collectives of :mod:`comms` (an
``AbstractMesh``). ``MFU = executed FLOPs / (step · n · P)`` (recompute included), and
``tokens_per_s`` counts tokens when the batch has a ``seq`` axis, else examples (``unit``).

The result is a roofline: it assumes matmuls run at the chip's peak, so it is an upper bound on MFU
(well-tuned large runs reach roughly 40–60 %); use it to compare layouts, not to promise a number.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import numpy as np

from meshtrain.analysis.activations import saved_activations
from meshtrain.analysis.collectives import axes_key
from meshtrain.analysis.comms import (Backend, CollectiveEstimate, Overlap, Phase, analytic_collectives, batch_dims)
from meshtrain.analysis.compiled import (ANALYTIC, COMPILED, ProgramCost, default_loss, has_analytic_model,
                                         program_cost, saved_activation_bytes, working_weight_bytes)
from meshtrain.analysis.flops import StepFlops, step_flops
from meshtrain.analysis.hardware import Hardware, get_hardware
from meshtrain.analysis.layout import PlanLayout, cached, layout_of, per_device_bytes, resolved_step
from meshtrain.analysis.memory import estimate_memory
from meshtrain.analysis.moe import moe_terms
from meshtrain.analysis.pipeline import pipeline_shape
from meshtrain.recipes import Remat


class Link(str, enum.Enum):
    FAST = "fast"  # NVLink / ICI / shared memory
    SLOW = "slow"  # InfiniBand / DCN


class Bound(str, enum.Enum):
    COMPUTE = "compute"
    MEMORY = "memory"
    COMMUNICATION = "communication"


@dataclasses.dataclass(frozen=True)
class AxisTime:
    """Communication over one set of mesh axes: ``wire_bytes`` sent per device per step, seconds."""

    axes: str
    link: Link
    wire_bytes: float
    seconds: float
    exposed_seconds: float
    collectives: int


@dataclasses.dataclass(frozen=True)
class StepTimeEstimate:
    compute_s: float
    memory_s: float
    comm_s: float
    exposed_comm_s: float
    step_s: float
    mfu: float
    tokens_per_s: float
    model_flops: float
    executed_flops: float
    axes: Tuple[AxisTime, ...]
    hardware: str
    source: str = ANALYTIC  # or "from the compiled program" / "from the traced program"
    unit: str = "tokens"  # what tokens_per_s counts: "tokens", or "examples" for batches without a seq axis

    @property
    def bound(self) -> Bound:
        if self.exposed_comm_s > max(self.compute_s, self.memory_s):
            return Bound.COMMUNICATION
        return Bound.COMPUTE if self.compute_s >= self.memory_s else Bound.MEMORY

    def to_dict(self) -> Dict[str, object]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "axes"}
        d["bound"] = self.bound.value
        d["axes"] = [{**dataclasses.asdict(a), "link": a.link.value} for a in self.axes]
        return d


def backend_of(hw: Hardware) -> Backend:
    if hw.name == "cpu":
        return Backend.CPU
    return Backend.TPU if hw.name.startswith("tpu") else Backend.GPU


def axis_links(lay: PlanLayout, hw: Hardware) -> Dict[str, Link]:
    """Fast or slow links per mesh axis (see the module docstring)."""
    out, inner = {}, 1
    for axis, size in reversed(lay.mesh_sizes):
        span = size * inner
        out[axis] = Link.SLOW if (axis in lay.dcn_axes or (size > 1 and span > hw.fast_domain)) else Link.FAST
        inner = span
    return out


def collective_seconds(op: CollectiveEstimate, link: Link, hw: Hardware) -> float:
    bw = hw.fast_link_bytes_per_s if link is Link.FAST else hw.slow_link_bytes_per_s
    alpha = hw.fast_latency_s if link is Link.FAST else hw.slow_latency_s
    hops = math.ceil(math.log2(max(op.group_size, 2))) * (2 if op.kind == "all-reduce" else 1)
    return op.executions * (alpha * hops) + op.wire_bytes_per_step / bw


def _weight_shards(plan) -> Tuple[Tuple[int, int], ...]:
    """``(elements, shards over non-batch axes)`` of every parameter leaf (depends on the layout only)."""
    lay = layout_of(plan)
    batch = set(lay.batch_axes)
    out = []
    for leaf in plan.group("params"):
        axes = set()
        for e in leaf.spec:
            axes |= {e} if isinstance(e, str) else set(e or ())
        out.append((math.prod(leaf.shape), lay.size(axes - batch)))
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def _activation_bytes(remat, compute_dtype, tie_embeddings, attention, acfg, B, T, split) -> int:
    """``saved_activations(...).bytes_per_device(acfg, B, T, split)``: a pure function of its arguments,
    the same for every candidate that differs only in what it does not read."""
    return saved_activations(remat, compute_dtype, tie_embeddings, attention).bytes_per_device(acfg, B, T, split)


def _activations(remat, compute_dtype, tie_embeddings, attention, acfg, B, T, split) -> int:
    try:
        return _activation_bytes(remat, compute_dtype, tie_embeddings, attention, acfg, B, T, split)
    except TypeError:  # an unhashable config
        return saved_activations(remat, compute_dtype, tie_embeddings, attention).bytes_per_device(acfg, B, T, split)


def _seconds(op: CollectiveEstimate, wire: float, link: Link, hw: Hardware) -> float:
    """:func:`collective_seconds` with ``op.wire_bytes_per_step`` already computed."""
    if link is Link.FAST:
        bw, alpha = hw.fast_link_bytes_per_s, hw.fast_latency_s
    else:
        bw, alpha = hw.slow_link_bytes_per_s, hw.slow_latency_s
    return op.executions * (alpha * _hops(op.group_size, op.kind == "all-reduce")) + wire / bw


@functools.lru_cache(maxsize=4096)
def _hops(group_size: int, all_reduce: bool) -> int:
    return math.ceil(math.log2(max(group_size, 2))) * (2 if all_reduce else 1)


def hbm_traffic(plan, cfg, lay: PlanLayout) -> float:
    """Bytes one device reads + writes in HBM per step (see the module docstring)."""
    c = np.dtype(lay.compute_dtype).itemsize
    weights = 0.0
    for elems, shards in cached(plan, "weight_shards", _weight_shards, layout_only=True):
        weights += elems * c / shards
    B, T = batch_dims(plan)
    split = lay.split()
    moe = moe_terms(plan, cfg)
    acfg = moe.activation_config(cfg) if moe is not None else cfg
    att = resolved_step(plan).attention.kind  # flash / context kinds keep no T × T scores
    a_none = _activations(Remat.NONE, lay.compute_dtype, cfg.tie_embeddings, att, acfg, B, T, split)
    a_saved = _activations(plan.recipe.remat, lay.compute_dtype, cfg.tie_embeddings, att, acfg, B, T, split)
    passes = 4 if plan.recipe.remat is Remat.FULL else 3
    per = per_device_bytes(plan)
    pipe = pipeline_shape(plan)
    # a pipeline reads its stage's weights every tick with work and runs m·L/(p·(1-bubble)) layer passes
    # (L·m without one)
    w_runs = pipe.stage_ticks / pipe.repeats if pipe is not None else lay.micro_batches
    a_runs = pipe.layer_runs(cfg.n_layers) / cfg.n_layers if pipe is not None else lay.micro_batches
    return w_runs * passes * weights + a_runs * (3 * a_none + max(a_none - a_saved, 0)) + \
        3 * per["params"] + 2 * per["optimizer"]


def executed_flops(plan, cfg, flops: StepFlops) -> Tuple[float, float]:
    """``(executed, executed forward)`` FLOPs of one step, all devices together: :func:`step_flops`
    plus the MoE capacity padding (expert slots computed beyond the ``k`` routed rows), and under a
    pipeline the compiled view: the layer stack × ``1/(1 - bubble)`` (every stage computes on every
    tick that has work; 1f1b also re-runs each stage's forward in its VJP) and the head on every
    stage (× ``p``: it runs on the whole batch, or once per micro-batch, on every stage)."""
    B, T = batch_dims(plan)
    tokens = B * T
    exe, fwd = flops.executed, flops.executed_forward
    moe = moe_terms(plan, cfg)
    if moe is not None:
        pad = moe.padding_flops_per_token(cfg) * tokens
        exe += pad * (4 if plan.recipe.remat is Remat.FULL else 3)
        fwd += pad
    pipe = pipeline_shape(plan)
    if pipe is not None:
        head = 2.0 * cfg.vocab_size * cfg.d_model * tokens  # forward FLOPs of the output projection
        stack_exe, stack_fwd = exe - 3 * head, fwd - head
        if pipe.one_f_one_b:
            stack_exe += stack_fwd
        exe = stack_exe * pipe.stack_factor + 3 * head * pipe.stages
        fwd = stack_fwd * pipe.stack_factor + head * pipe.stages
    return exe, fwd


def estimate_step_time(plan, cfg, hardware: "Hardware | str", *, backend: Optional[Backend] = None,
                       collectives: Optional[List[CollectiveEstimate]] = None, loss_fn=None,
                       cost: Optional[ProgramCost] = None) -> StepTimeEstimate:
    """Estimated seconds per optimizer step of ``plan`` on ``hardware``: analytic for a decoder
    ``cfg``; from the step's program for any other model (``loss_fn`` default: the built-in loss of a
    built-in config; ``cost`` reuses a :func:`~meshtrain.analysis.compiled.program_cost`)."""
    if not has_analytic_model(cfg):
        return program_step_time(plan, hardware, loss_fn or default_loss(cfg, plan), backend=backend, cost=cost,
                                 collectives=collectives)
    lay = layout_of(plan)
    hw = get_hardware(hardware, num_devices=lay.num_devices)
    backend = Backend(backend) if backend is not None else backend_of(hw)
    n = lay.num_devices
    B, T = batch_dims(plan)
    flops = _step_flops(cfg, B, T, plan.recipe.remat)
    executed, executed_fwd = executed_flops(plan, cfg, flops)
    compute = executed / n / hw.peak_flops
    memory = hbm_traffic(plan, cfg, lay) / hw.hbm_bytes_per_s
    ops = collectives if collectives is not None else analytic_collectives(plan, cfg, backend)
    fwd_share = executed_fwd / executed if executed else 0.0
    comm, exposed, axes = _communication(ops, lay, hw, backend, compute, fwd_share)
    step = max(compute, memory) + exposed
    mfu = flops.model / (step * n * hw.peak_flops) if step > 0 else 0.0
    return StepTimeEstimate(compute, memory, comm, exposed, step, mfu, B * T / step,
                            flops.model, executed, axes, hw.name)


def _step_flops(cfg, B, T, remat) -> StepFlops:
    try:
        return _step_flops_cached(cfg, B, T, remat)
    except TypeError:  # an unhashable config
        return step_flops(cfg, B, T, remat)


@functools.lru_cache(maxsize=65536)
def _step_flops_cached(cfg, B, T, remat) -> StepFlops:
    return step_flops(cfg, B, T, remat)


def _communication(ops, lay: PlanLayout, hw: Hardware, backend: Backend, compute: float, fwd_share: float):
    """``(communication seconds, exposed seconds, per-axis rows)`` (see the module docstring)."""
    links = axis_links(lay, hw)
    slow = {a for a, link in links.items() if link is Link.SLOW}
    overlap = 0.0 if backend is Backend.CPU else 1.0
    per_axes: Dict[str, List] = defaultdict(lambda: [None, 0.0, 0.0, 0.0, 0])
    critical = 0.0
    hidden = {Phase.FORWARD: 0.0, Phase.BACKWARD: 0.0, Phase.UPDATE: 0.0}
    capacity = {Phase.FORWARD: overlap * compute * fwd_share, Phase.BACKWARD: overlap * compute * (1 - fwd_share),
                Phase.UPDATE: 0.0}
    seconds = []
    for op in ops:
        link = Link.SLOW if any(a in slow for a in op.axes) else Link.FAST
        if op.span:  # a level of the hierarchical expert exchange: inside a slice (ICI) or across (DCN)
            link = Link.SLOW if op.span == "dcn" else Link.FAST
        wire = op.wire_bytes_per_step
        sec = _seconds(op, wire, link, hw)  # collective_seconds(op, link, hw)
        key = axes_key(op.axes) + (f" ({op.span})" if op.span else "")
        row = per_axes[key]
        row[0] = link
        row[1] += wire
        row[2] += sec
        row[4] += op.executions
        if op.overlap is Overlap.EXPOSED:
            critical += sec
            row[3] += sec
        else:
            hidden[op.phase] += sec
        seconds.append((key, sec, link))
    exposed_phase = {ph: max(0.0, hidden[ph] - capacity[ph]) for ph in hidden}
    share = {ph: exposed_phase[ph] / hidden[ph] if hidden[ph] else 0.0 for ph in hidden}
    for op, (key, sec, link) in zip(ops, seconds):
        # per-axis exposed time: critical ops fully, overlappable ones by their phase's exposed share
        if op.overlap is Overlap.HIDDEN:
            if per_axes[key][0] is not link:  # (ops under one key share their axes, so their link)
                sec = collective_seconds(op, per_axes[key][0], hw)
            per_axes[key][3] += sec * share[op.phase]
    axes = tuple(AxisTime(key, link, wire, sec, exp, count)
                 for key, (link, wire, sec, exp, count) in sorted(per_axes.items()))
    return sum(hidden.values()) + critical, critical + sum(exposed_phase.values()), axes


def compiled_collectives(cost: ProgramCost) -> List[CollectiveEstimate]:
    """The compiled HLO's collectives as estimates (overlappable, backward phase), over mesh axes only."""
    return [CollectiveEstimate(c.kind, tuple(c.axes), float(c.bytes), int(c.executions), int(c.group_size),
                               f"HLO {c.computation}")
            for c in cost.collectives if c.axes and c.group_size > 1]


def _items(plan) -> Tuple[float, str]:
    """Tokens per step when the batch has a ``seq`` axis, else examples."""
    try:
        return float(plan.batch.batch_size * plan.batch.seq_len), "tokens"
    except Exception:  # noqa: BLE001 - a layout without a seq axis (images, tables)
        return float(plan.batch.batch_size), "examples"


def program_step_time(plan, hardware: "Hardware | str", loss_fn, *, backend: Optional[Backend] = None,
                      cost: Optional[ProgramCost] = None,
                      collectives: Optional[List[CollectiveEstimate]] = None) -> StepTimeEstimate:
    """Step time of any model from its compiled or traced program (see the module docstring)."""
    lay = layout_of(plan)
    hw = get_hardware(hardware, num_devices=lay.num_devices)
    backend = Backend(backend) if backend is not None else backend_of(hw)
    cost = cost if cost is not None else program_cost(plan, loss_fn)
    n = lay.num_devices
    compute = cost.flops / n / hw.peak_flops
    weights, _ = working_weight_bytes(plan)
    acts = cost.activations if cost.activations is not None else saved_activation_bytes(plan, loss_fn)
    passes = 4 if plan.recipe.remat is Remat.FULL else 3
    per = per_device_bytes(plan)
    traffic = lay.micro_batches * (passes * weights + 3 * acts) + 3 * per["params"] + 2 * per["optimizer"]
    memory = traffic / hw.hbm_bytes_per_s
    if collectives is not None:
        ops = collectives
    elif cost.source == COMPILED:
        ops = compiled_collectives(cost)
    else:
        ops = analytic_collectives(plan, None, backend)
    comm, exposed, axes = _communication(ops, lay, hw, backend, compute, 0.0 if cost.source == COMPILED else 1 / 3)
    step = max(compute, memory) + exposed
    mfu = cost.flops / (step * n * hw.peak_flops) if step > 0 else 0.0
    items, unit = _items(plan)
    return StepTimeEstimate(compute, memory, comm, exposed, step, mfu, items / step if step > 0 else 0.0,
                            cost.flops, cost.flops, axes, hw.name, cost.source, unit)


def fits_and_time(plan, cfg, hardware, *, loss_fn=None):
    """``(MemoryEstimate, StepTimeEstimate)`` in one call (what the planner ranks on)."""
    if has_analytic_model(cfg):
        hw = hardware if isinstance(hardware, Hardware) else get_hardware(hardware)
        return estimate_memory(plan, cfg, backend=backend_of(hw)), estimate_step_time(plan, cfg, hardware)
    cost = program_cost(plan, loss_fn or default_loss(cfg, plan))
    return (estimate_memory(plan, cfg, loss_fn=loss_fn, cost=cost),
            estimate_step_time(plan, cfg, hardware, loss_fn=loss_fn, cost=cost))
