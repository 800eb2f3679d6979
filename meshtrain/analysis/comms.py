"""Analytic collective inventory of a decoder train step: what XLA's SPMD partitioner emits for a
plan, with bytes per device and mesh axes, for meshes too large to compile here.

Example::

    ops = analytic_collectives(plan, cfg, Backend.TPU)
    per_axis_estimate(ops)            # {'fsdp': {'all-gather': ..., 'reduce-scatter': ..., 'total': ...}}

Bytes follow :func:`meshtrain.analysis.collectives.hlo_collectives`: the result size on one device
per execution (all-gather: the gathered tensor; reduce-scatter: the shard), ``executions`` per step.
Notation: ``E`` elements of a parameter, ``c``/``p`` compute/parameter dtype bytes, ``S`` the mesh
axes sharding it, ``B`` the axes splitting the batch, ``X = b·T·d·c`` one residual-stream
activation per device (``b`` sequences per device per micro-batch), ``m`` micro-batches.

Parameters (per leaf, ``F = S ∩ B`` gathered axes, ``R = B − S`` replica axes, ``t`` = size of ``S − B``):

* FSDP (``F`` non-empty): all-gather over ``F`` of ``E·c/t`` in the forward and again in the
  backward (an embedding table used only as a lookup: forward only), ``m`` times.
* gradients: reduce-scatter over ``F`` (result ``E·p/(t·|F|)``), then all-reduce over ``R`` of the
  shard; ZeRO-1 (optimizer sharded over ``Z ⊆ R``): reduce-scatter over ``Z`` and all-gather of the
  updated parameters over ``Z`` once per step.

Tensor parallelism over ``t`` devices (Megatron), per layer and micro-batch: forward all-reduce of
``X`` after the attention output and the MLP down projections (2), backward 2 for the input
gradients of the column-parallel projections; with sequence parallelism each all-reduce becomes a
reduce-scatter (result ``X/t``) + all-gather (``X``) and the backward re-gathers the two inputs
(6 all-gathers, 4 reduce-scatters). ``remat=full`` repeats the forward ones. Vocabulary-parallel
embedding (forward) and head (backward) add one each, and the loss 3 small ``b·T`` f32 reductions.

Backends: XLA:GPU/TPU emit the above. XLA:CPU (measured, jax 0.10) has no reduce-scatter (it
all-reduces the full tensor and slices) and does not reassociate all-reduces: the backward
all-reduces q, k, v and gate, up input-gradient partials separately (5 per layer instead of 2).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

import numpy as np

from meshtrain.analysis.collectives import axes_key, wire_bytes
from meshtrain.analysis.layout import layout_of
from meshtrain.recipes import Remat


class Backend(str, enum.Enum):
    """Which XLA backend's collective choices to model (see the module docstring)."""

    CPU = "cpu"
    GPU = "gpu"
    TPU = "tpu"


class Overlap(str, enum.Enum):
    """Whether a collective can run behind compute (latency-hiding scheduler) or sits on the critical path."""

    HIDDEN = "overlappable"
    EXPOSED = "critical path"


class Phase(str, enum.Enum):
    """When a collective runs: behind the forward or the backward compute, or after it (update)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"


@dataclasses.dataclass(frozen=True)
class CollectiveEstimate:
    kind: str
    axes: Tuple[str, ...]
    bytes: float
    executions: int
    group_size: int
    what: str
    overlap: Overlap = Overlap.HIDDEN
    phase: Phase = Phase.BACKWARD

    @property
    def bytes_per_step(self) -> float:
        return self.bytes * self.executions

    @property
    def wire_bytes_per_step(self) -> float:
        return wire_bytes(self.kind, self.bytes, self.group_size) * self.executions

    def to_dict(self) -> Dict[str, object]:
        return {"kind": self.kind, "axes": list(self.axes), "bytes": self.bytes, "executions": self.executions,
                "group_size": self.group_size, "what": self.what, "overlap": self.overlap.value,
                "phase": self.phase.value}


def _axes_in(spec) -> Tuple[str, ...]:
    out = []
    for entry in spec:
        out += [entry] if isinstance(entry, str) else list(entry or ())
    return tuple(out)


def analytic_collectives(plan, cfg, backend: "Backend | str" = Backend.TPU) -> List[CollectiveEstimate]:
    """The collectives of one train step of ``plan`` (a decoder ``cfg``), modelled for ``backend``.

    ``cfg=None`` (any other model): the parameter collectives only (FSDP gathers, gradient
    reductions, ZeRO-1; a leaf whose first logical axis is ``layers`` runs once per layer, its
    leading size), without the tensor-parallel activation collectives (they need the model's shapes).
    """
    backend = Backend(backend)
    lay = layout_of(plan)
    sizes = lay.sizes
    order = tuple(sizes)
    canon = lambda axes: tuple(a for a in order if a in set(axes))  # noqa: E731
    live = lambda axes: tuple(a for a in canon(axes) if sizes.get(a, 1) > 1)  # noqa: E731
    c = np.dtype(lay.compute_dtype).itemsize
    m = lay.micro_batches
    batch = set(lay.batch_axes)
    out: List[CollectiveEstimate] = []

    def add(kind, axes, nbytes, executions, what, overlap=Overlap.HIDDEN, phase=Phase.BACKWARD):
        axes = live(axes)
        if axes and executions and nbytes:
            out.append(CollectiveEstimate(kind, axes, float(nbytes), int(executions), lay.size(axes), what, overlap,
                                          phase))

    for leaf in plan.group("params"):
        elems = math.prod(leaf.shape)
        p = np.dtype(leaf.dtype).itemsize
        s = set(live(_axes_in(leaf.spec)))
        f, r = s & batch, batch - s
        t = lay.size(s - batch)
        layer = bool(leaf.logical_axes) and leaf.logical_axes[0] == "layers"
        per = (cfg.n_layers if cfg is not None else max(int(leaf.shape[0]), 1)) if layer else 1
        lookup = (cfg is not None and tuple(leaf.logical_axes) == ("vocab", "embed") and not cfg.tie_embeddings
                  and "embedding" in leaf.path)
        if f:
            add("all-gather", f, elems * c / t / per, per * m, f"FSDP forward gather {leaf.path}", phase=Phase.FORWARD)
            if not lookup:
                add("all-gather", f, elems * c / t / per, per * m, f"FSDP backward re-gather {leaf.path}")
        g_full = elems * p / t / per
        if f:
            if backend is Backend.CPU:
                add("all-reduce", f, g_full, per * m, f"grad reduce (as all-reduce) {leaf.path}")
            else:
                add("reduce-scatter", f, g_full / lay.size(f), per * m, f"grad reduce-scatter {leaf.path}")
        g_shard = g_full / lay.size(f)
        z = set(live(_zero_axes(plan, leaf.path))) & r
        if z:
            if backend is Backend.CPU:
                add("all-reduce", r, g_shard, per * m, f"grad all-reduce {leaf.path}")
            else:
                add("reduce-scatter", z, g_shard / lay.size(z), per * m, f"ZeRO-1 grad reduce-scatter {leaf.path}")
                add("all-reduce", r - z, g_shard / lay.size(z), per * m, f"grad all-reduce {leaf.path}")
            add("all-gather", z, elems * p / lay.size(s) / per, per, f"ZeRO-1 updated-param gather {leaf.path}",
                Overlap.EXPOSED, Phase.UPDATE)
        elif r:
            add("all-reduce", r, g_shard, per * m, f"grad all-reduce {leaf.path}")

    if cfg is not None:
        _tensor_parallel(plan, cfg, lay, backend, c, add)
    return out


def _zero_axes(plan, param_path: str) -> Tuple[str, ...]:
    """Mesh axes that shard a parameter's optimizer state but not the parameter (ZeRO-1)."""
    param = next(l for l in plan.group("params") if l.path == param_path)
    p_axes = set(_axes_in(param.spec))
    extra = set()
    for leaf in plan.group("optimizer"):
        if leaf.path.endswith(param_path) and tuple(leaf.shape) == tuple(param.shape):
            extra |= set(_axes_in(leaf.spec)) - p_axes
    return tuple(extra)


def _tensor_parallel(plan, cfg, lay, backend, c, add) -> None:
    t = lay.tensor
    if t <= 1:
        return
    B, T = plan.batch.batch_size, plan.batch.seq_len
    m = lay.micro_batches
    b = B // (lay.batch_split * m)
    x = b * T * cfg.d_model * c
    axes = lay.tensor_axes
    sp = lay.sequence > 1
    L = cfg.n_layers
    recompute = 2 if plan.recipe.remat is Remat.FULL else 0
    crit, fwd, bwd = Overlap.EXPOSED, Phase.FORWARD, Phase.BACKWARD
    bwd_ar = 5 if backend is Backend.CPU else 2
    if not sp:
        add("all-reduce", axes, x, 2 * L * m, "TP forward all-reduce (attention out, MLP down)", crit, fwd)
        add("all-reduce", axes, x, (bwd_ar + recompute) * L * m, "TP backward all-reduce (input gradients"
            + (", recomputed forward)" if recompute else ")"), crit, bwd)
    else:
        add("all-gather", axes, x, 2 * L * m, "SP forward all-gather (b,T,d) before column-parallel", crit, fwd)
        add("all-gather", axes, x, (4 + recompute) * L * m, "SP backward all-gathers (re-gather inputs, "
            "reduce-scatter transposes)", crit, bwd)
        if backend is Backend.CPU:
            add("all-reduce", axes, x, 2 * L * m, "SP forward reduce-scatter (as all-reduce)", crit, fwd)
            add("all-reduce", axes, x, (bwd_ar + recompute) * L * m, "SP backward reduce-scatter (as all-reduce)",
                crit, bwd)
        else:
            add("reduce-scatter", axes, x / t, 2 * L * m, "SP forward reduce-scatter after row-parallel", crit, fwd)
            add("reduce-scatter", axes, x / t, (2 + recompute) * L * m, "SP backward reduce-scatter", crit, bwd)
    if lay.vocab_axes == axes:
        kind, nbytes = ("reduce-scatter", x / t) if sp and backend is not Backend.CPU else ("all-reduce", x)
        add(kind, axes, nbytes, m, "vocab-parallel embedding lookup", crit, fwd)
        add(kind, axes, nbytes, m, "vocab-parallel head: input gradient", crit, bwd)
        add("all-reduce", axes, b * T * 4, 3 * m, "vocab-parallel loss (max, sum, target logit)", crit, fwd)


def per_axis_estimate(estimates: Sequence[CollectiveEstimate]) -> Dict[str, Dict[str, float]]:
    """``{axes_key: {kind: bytes per step, "total": ...}}`` like :func:`collectives.per_axis`."""
    out: Dict[str, Dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in estimates:
        key = axes_key(e.axes)
        out[key][e.kind] += e.bytes_per_step
        out[key]["total"] += e.bytes_per_step
    return {k: dict(v) for k, v in out.items()}
