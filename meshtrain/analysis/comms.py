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
``X`` after the attention output and the MLP down projections (2; an MoE layer reduces its experts' token
buffer instead of ``X``, :func:`_moe_down_rows_bytes`), backward 2 for the input
gradients of the column-parallel projections; with sequence parallelism each all-reduce becomes a
reduce-scatter (result ``X/t``) + all-gather (``X``) and the backward re-gathers the two inputs
(6 all-gathers, 4 reduce-scatters). ``remat=full`` repeats the forward ones but the layer's last
reduction (its output is never read by the backward). Vocabulary-parallel
embedding (forward) and head (backward) add one each, and the loss 3 small ``b·T`` f32 reductions.

Pipelines (``pp`` recipes): the per-layer collectives above follow the ``m·L/(p·(1 − bubble))``
layer passes one device makes (not ``L·m``), a stage's layer weights are gathered and their
gradients reduced every tick with work (but for the data-parallel reduction, once a step: the schedules
keep one gradient per data shard through the ticks), and :func:`_pipeline_transfers` adds the stage hand-offs
(collective-permutes of one micro-batch's activations and cotangents) and broadcasts over ``stage``.

Convention (both sides, :func:`meshtrain.analysis.collectives.hlo_collectives` too): a collective's bytes are
its result's bytes on one device per execution; an all-reduce counts the reduced tensor once (not the
``2·(n−1)/n`` a ring moves on the wire: :func:`~meshtrain.analysis.collectives.wire_bytes` converts for time).
XLA:TPU and XLA:GPU all-reduce the gradient of a replicated (data-parallel) parameter in the compute dtype:
counted in ``c`` bytes there.

Backends: XLA:GPU/TPU emit the above, except that XLA:TPU (libtpu 0.0.42.1, measured) all-reduces the whole
``X`` where sequence parallelism allows a reduce-scatter, as XLA:CPU does. XLA:CPU (measured, jax 0.10) has no
reduce-scatter (it all-reduces the full tensor and slices) and does not reassociate all-reduces: the backward
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
from meshtrain.analysis.context_comms import context_collectives
from meshtrain.analysis.exchange import exchange_levels
from meshtrain.analysis.layout import cached, layout_of, resolved_step
from meshtrain.analysis.pipeline import pipeline_shape
from meshtrain.parallel import onebit_adam
from meshtrain.parallel.moe import capacity_for
from meshtrain.parallel.pipeline import row_split_axes
from meshtrain.parallel.resolved import batch_splits
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
    #: which links carry it when not its axes' (the hierarchical expert exchange's levels, both over `expert`):
    #: ``"ici"`` inside a slice, ``"dcn"`` across slices; ``""``: its axes' links
    span: str = ""

    @property
    def bytes_per_step(self) -> float:
        return self.bytes * self.executions

    @property
    def wire_bytes_per_step(self) -> float:
        return wire_bytes(self.kind, self.bytes, self.group_size) * self.executions

    def to_dict(self) -> Dict[str, object]:
        return {"kind": self.kind, "axes": list(self.axes), "bytes": self.bytes, "executions": self.executions,
                "group_size": self.group_size, "what": self.what, "overlap": self.overlap.value,
                "phase": self.phase.value, **({"span": self.span} if self.span else {})}


def batch_dims(plan) -> Tuple[int, int]:
    """``(batch_size, seq_len)`` of the plan's token batch, once per layout."""
    return cached(plan, "batch_dims", lambda p: (p.batch.batch_size, p.batch.seq_len), layout_only=True)


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
    out: List[CollectiveEstimate] = []

    def add(kind, axes, nbytes, executions, what, overlap=Overlap.HIDDEN, phase=Phase.BACKWARD, group=None, span=""):
        axes = live(axes)
        if axes and executions and nbytes:
            out.append(CollectiveEstimate(kind, axes, float(nbytes), int(executions), group or lay.size(axes), what,
                                          overlap, phase, span))

    def put(kind, axes, nbytes, executions, what, overlap=Overlap.HIDDEN, phase=Phase.BACKWARD):
        # ``add`` for axes already made live, with their group size: ``(axes, size)``
        if axes[0] and executions and nbytes:
            out.append(CollectiveEstimate(kind, axes[0], float(nbytes), int(executions), axes[1], what, overlap,
                                          phase))

    pipe = pipeline_shape(plan)
    compression = resolved_step(plan).grad_compression
    # a decoder whose layers run as direct calls (shallow, unrolled, no remat): the backward reuses the forward's
    # gathers (small/fsdp compiled: 12.87 MB of all-gathers per device, half the re-gathering count)
    once = pipe is None and cfg is not None and resolved_step(plan).direct_layer_calls(cfg.n_layers)
    for x in cached(plan, "param_collectives", _param_collective_leaves, layout_only=True):
        _param_leaf_collectives(x, plan, cfg, backend, pipe, m, c, put, compression, once)
    if cfg is not None:
        _tensor_parallel(plan, cfg, lay, backend, c, add)
        _expert_parallel(plan, cfg, lay, backend, c, add)
        _pipeline_transfers(plan, cfg, lay, c, out)
        for row in context_collectives(plan, cfg, backend.value):  # attention kinds over the context axes
            hidden = row["kind"] in ("collective-permute", "all-gather")
            add(row["kind"], row["axes"], row["bytes"], row["executions"], row["what"],
                Overlap.HIDDEN if hidden else Overlap.EXPOSED, Phase(row["phase"]))
    return out


@dataclasses.dataclass(frozen=True)
class _ParamLeaf:
    """What :func:`analytic_collectives` needs of one parameter leaf that depends only on the plan's
    layout (not on its recipe's knobs): axis sets already made live, as ``(axes, group size)``."""

    path: str
    elems: int
    p: int  # bytes per element
    lead: int  # max(leading size, 1): the layer count of a stacked leaf without a config
    layer: bool
    vocab_embed: bool
    t: int
    t_stage: int
    has_f: bool
    has_z: bool
    has_r: bool
    f: Tuple[Tuple[str, ...], int]
    r: Tuple[Tuple[str, ...], int]
    z: Tuple[Tuple[str, ...], int]
    rz: Tuple[Tuple[str, ...], int]
    size_f: int
    size_z: int
    size_s: int
    what: Tuple[str, ...]
    expert: bool = False  # an MoE expert weight (logical axis `expert`)


def _param_leaf_collectives(x, plan, cfg, backend: Backend, pipe, m: int, c: int, put, compression=None,
                            gathered_once: bool = False) -> None:
    """One parameter's collectives (FSDP gathers, gradient reductions, ZeRO-1), each passed to
    ``put(kind, (axes, size), bytes, executions, what[, overlap, phase])``; ``c`` is the compute
    dtype's item size, ``m`` the micro-batches, ``pipe`` the pipeline shape or None, ``compression`` the
    step's :class:`~meshtrain.parallel.grad_compression.CompressionChoice` (``None``: none), ``gathered_once``:
    the backward reuses the forward's FSDP gather (no re-gather)."""
    cpu = backend is Backend.CPU
    elems, p, t, layer, f, r, z = x.elems, x.p, x.t, x.layer, x.f, x.r, x.z
    per = (cfg.n_layers if cfg is not None else x.lead) if layer else 1
    lookup = (cfg is not None and x.vocab_embed and not cfg.tie_embeddings and "embedding" in x.path)
    runs, op_t = per * m, t
    if pipe is not None:
        # Each device gathers its stage's layers and reduces their gradients every tick with work
        # (measured: XLA keeps the reductions inside the tick loop; the data-parallel ones: once, below); the
        # rest runs once a step (gpipe: the
        # head sees the whole batch), or m times in 1f1b (head and loss per micro-batch) but for an untied
        # embedding table: 1f1b looks up every micro-batch at once before the ticks (pipeline/_loss.py).
        if layer:
            runs = pipe.layer_runs(per)
            op_t = x.t_stage  # one layer's weights: not split by stage
        else:
            runs = m if pipe.one_f_one_b and not lookup else 1
    reduce_runs = runs
    if pipe is not None and r[0] and set(r[0]) <= _split_rows(plan, cfg):
        # every schedule keeps one gradient per data shard through the ticks and reduces them once after
        # (parallel/pipeline/_schedules.py, row_split_axes): the device's layers and the head once a step
        reduce_runs = per / pipe.stages if layer else 1
    if x.has_f:
        put("all-gather", f, elems * c / op_t / per, runs, x.what[0], phase=Phase.FORWARD)
        if not lookup and not gathered_once:
            put("all-gather", f, elems * c / op_t / per, runs, x.what[1])
    g_full = elems * p / op_t / per
    if x.has_f:
        if cpu:
            put("all-reduce", f, g_full, runs, x.what[2])
        else:
            # XLA:GPU and XLA:TPU reduce-scatter the FSDP gradients in the compute dtype and upcast the shard
            # after (measured, tools/check_compilers.py: fsdp and fsdp_tp on 8xH100; fsdp_tp on v5p:2x2x2 at
            # Llama-3-8B shapes, 3,626 MiB on `fsdp` both sides), except that XLA:TPU reduce-scatters an expert
            # weight's in the parameter dtype (inferred from bytes, Mixtral 4 layers on v5p:2x2x2: fsdp_ep's
            # `fsdp` gap to the compile was the expert shards' bf16 bytes)
            keep = backend is Backend.TPU and x.expert
            g_scatter = g_full * c / p if c < p and not keep else g_full
            put("reduce-scatter", f, g_scatter / x.size_f, runs, x.what[3])
    g_shard = g_full / x.size_f
    if x.has_z:
        if cpu:
            put("all-reduce", r, g_shard, reduce_runs, x.what[4])
        elif backend is Backend.TPU and not plan.recipe.shard_gradients and c < p:
            # ZeRO-1 on XLA:TPU: the data-parallel all-reduce of the compute-dtype gradient, each device then
            # slicing its optimizer shard (measured, Llama-3-8B 4 layers on v5p:2x2x2: `data` carries the
            # dp step's bf16 all-reduce + the f32 updated-parameter all-gather, to the MiB)
            put("all-reduce", r, g_shard * c / p, reduce_runs, x.what[4])
        else:
            put("reduce-scatter", z, g_shard / x.size_z, reduce_runs, x.what[5])
            put("all-reduce", x.rz, g_shard / x.size_z, reduce_runs, x.what[4])
        put("all-gather", z, elems * p / x.size_s / per, per, x.what[6], Overlap.EXPOSED, Phase.UPDATE)
    elif x.has_r:
        # XLA:TPU and XLA:GPU all-reduce a replicated parameter's gradient in the compute dtype and
        # upcast after (measured: the dp step's all-reduce result is the bf16 gradient on v5p and on
        # 8xH100, tools/check_compilers.py); XLA:TPU does so for an FSDP-sharded gradient's all-reduce across
        # replicas too (measured: hsdp's `data` bytes, Llama-3-8B 4 layers, are the bf16 shard's), and so does
        # XLA:GPU (measured: fsdp_cp and fsdp_tp_cp's `context` all-reduces on 8xH100 are the bf16 shards');
        # XLA:CPU reduces in the parameter's dtype.
        g_reduce = g_shard * c / p if not cpu and c < p else g_shard
        if compression is not None and compression.active and r[0] == ("data",):
            # grad_compression: the exact reduction inside the slice above, then every replica's compressed
            # shard all-gathered over `data` (DCN): payload_bytes_per_value per value (scales included)
            payload = g_shard / p * compression.payload_bytes_per_value
            put("all-gather", r, payload * r[1], reduce_runs, f"{compression.kind.value} {x.what[4]}")
            if compression.has_feedback and onebit_adam.find_state(plan.abstract.opt_state) is not None:
                # 1-bit Adam's variance tracking: one f32 projection per VARIANCE_BLOCK values, summed over `data`
                put("all-reduce", r, g_shard / p * 4 / onebit_adam.VARIANCE_BLOCK, reduce_runs,
                    f"onebit variance {x.what[4]}")
            return
        put("all-reduce", r, g_reduce, reduce_runs, x.what[4])



def _split_rows(plan, cfg) -> frozenset:
    """The data axes a pipeline keeps per-shard gradients over (the kernel's own rule); none for an MoE model
    (its layers store router statistics, whose cotangents are per micro-batch)."""
    if cfg is not None and getattr(cfg, "n_experts", 0):
        return frozenset()
    return frozenset(row_split_axes(plan.rules, plan.mesh_sizes, plan.recipe.strategies))


def _param_collective_leaves(plan) -> Tuple[_ParamLeaf, ...]:
    lay = layout_of(plan)
    sizes = lay.sizes
    order = tuple(sizes)
    canon = lambda axes: tuple(a for a in order if a in set(axes))  # noqa: E731
    live = lambda axes: tuple(a for a in canon(axes) if sizes.get(a, 1) > 1)  # noqa: E731
    group = lambda axes: (live(axes), lay.size(live(axes)))  # noqa: E731
    batch = set(lay.batch_axes) | set(lay.context_axes)  # context parallelism splits the data too
    experts = set(expert_axes(plan))
    zero = _zero_axes_all(plan)
    out = []
    for leaf in plan.group("params"):
        s = set(live(_axes_in(leaf.spec)))
        # MoE experts split over batch axes (EP) are not gathered: each device runs its own experts.
        ex = s & experts if "expert" in (leaf.logical_axes or ()) else set()
        f, r = (s - ex) & batch, batch - s
        t = lay.size((s - batch) | ex)
        layer = bool(leaf.logical_axes) and leaf.logical_axes[0] == "layers"
        z = set(live(zero[leaf.path])) & r
        path = leaf.path
        out.append(_ParamLeaf(
            path, math.prod(leaf.shape), np.dtype(leaf.dtype).itemsize, max(int(leaf.shape[0]), 1) if layer else 1,
            layer, tuple(leaf.logical_axes) == ("vocab", "embed"), t,
            t // sizes.get("stage", 1) if "stage" in s else t, bool(f), bool(z), bool(r), group(f), group(r),
            group(z), group(r - z), lay.size(f), lay.size(z), lay.size(s),
            (f"FSDP forward gather {path}", f"FSDP backward re-gather {path}", f"grad reduce (as all-reduce) {path}",
             f"grad reduce-scatter {path}", f"grad all-reduce {path}", f"ZeRO-1 grad reduce-scatter {path}",
             f"ZeRO-1 updated-param gather {path}"), "expert" in (leaf.logical_axes or ())))
    return tuple(out)


def expert_exchange(plan):
    """The plan's :class:`~meshtrain.parallel.moe_exchange.ExpertExchange` (flat or hierarchical; its resolved step's)."""
    return cached(plan, "expert_exchange", lambda p: resolved_step(p).expert_exchange)


def expert_axes(plan) -> Tuple[str, ...]:
    """Mesh axes (size > 1) that split the ``expert`` dimension of MoE weights under ``plan``."""
    return cached(plan, "expert_axes", _expert_axes, layout_only=True)


def _expert_axes(plan) -> Tuple[str, ...]:
    rule = plan.rules.table("params").get("expert")
    return tuple(a for a in (rule.mesh_axes if rule else ()) if plan.mesh_sizes.get(a, 1) > 1)


def moe_exchange_bytes(plan, cfg, backend: "Backend | str" = Backend.CPU) -> Dict[str, float]:
    """Bytes one device's MoE token exchange moves per layer and micro-batch, for one all-to-all
    (``per_op``) and per step per layer (``per_layer_step``: dispatch + combine, forward and
    backward, ×micro-batches, +2 recomputed with remat), and the exchange kind.

    ``b`` rows per device, ``T`` sequence, ``k`` experts per token, ``E`` experts, ``d`` width,
    ``c`` compute-dtype bytes, ``ep`` expert-parallel devices, ``a = b·T·k`` local assignments:

    * capacity: the ``(b, E, C, d)`` buffer, ``C = ceil(cf·T·k/E)``: ``b·E·C·d·c`` per all-to-all;
    * dropless, CPU (padded, nothing drops): ``ep·a·d·c`` per all-to-all (+ ``ep·a`` int32 expert ids
      in the forward);
    * dropless, GPU/TPU (``ragged_all_to_all``): the rows that exist, ``a·d·c`` with balanced routing.
    """
    backend = Backend(backend)
    lay = layout_of(plan)
    ep = lay.size(expert_axes(plan))
    ex = expert_exchange(plan)
    c = np.dtype(lay.compute_dtype).itemsize
    m = lay.micro_batches
    B, T = batch_dims(plan)
    b = B // (lay.batch_split * m)
    k, E, d = cfg.experts_per_token, cfg.n_experts, cfg.d_model
    a = b * T * k
    recompute = 0 if plan.recipe.remat is Remat.NONE else 2
    if cfg.capacity_factor is not None:
        per_op, kind, exchange, ids = b * E * capacity_for(cfg.capacity_factor, T, k, E) * d * c, "all-to-all", \
            "capacity (padded fixed-size all-to-all)", 0.0
    elif backend is Backend.CPU or ex.hierarchical:
        why = "the two-level exchange is padded" if ex.hierarchical else "XLA:CPU has no ragged all-to-all"
        per_op, kind, exchange, ids = ep * a * d * c, "all-to-all", f"dropless, padded exchange ({why}; " \
            "room for every local assignment per destination, nothing drops)", ep * a * 4.0
    else:
        per_op, kind, exchange, ids = a * d * c, "ragged-all-to-all", "dropless, ragged_all_to_all", a * 4.0
    ops = (4 + recompute) * m
    if ep > 1 and (ex.hierarchical or ex.slices > 1):
        exchange += "; " + ex.describe()
    return {"ep": ep, "kind": kind, "exchange": exchange, "per_op": float(per_op), "ops_per_layer_step": ops,
            "ids_per_layer_step": ids * (1 + recompute // 2) * m,
            "per_layer_step": float(per_op) * ops + ids * (1 + recompute // 2) * m}


def _moe_down_rows_bytes(plan, cfg, x: float) -> float:
    """The MoE MLP-down output one device reduces over the tensor axes, per layer and micro-batch: the experts'
    token buffer before the combine, not the ``(b, T, d)`` stream ``x`` (measured, Mixtral 4 layers on
    v5p:2x2x2, fsdp_tp_ep: 2.5·x with capacity factor 1.25 and top-2, the ``(b, E, C, d)`` buffer; 4·x dropless,
    the ragged exchange's receive buffer of ``ep`` sources' assignments)."""
    k = cfg.experts_per_token
    if cfg.capacity_factor is not None:
        T = batch_dims(plan)[1]
        return x * cfg.n_experts * capacity_for(cfg.capacity_factor, T, k, cfg.n_experts) / T
    return x * k * max(layout_of(plan).size(expert_axes(plan)), 1)


def _expert_parallel(plan, cfg, lay, backend, c, add) -> None:
    if not getattr(cfg, "n_experts", 0):
        return
    axes = expert_axes(plan)
    if not axes:
        return
    x = moe_exchange_bytes(plan, cfg, backend)
    m = lay.micro_batches
    runs, rerun = layer_runs(plan, cfg)
    per = x["ops_per_layer_step"] // m
    ex = expert_exchange(plan)
    t = lay.tensor if ex.hierarchical else 1
    for level in exchange_levels(ex, x["per_op"], t):
        where = f" ({level.span}, {level.group} devices)" if level.span else ""
        # the hierarchical levels share `expert`: their group and span say which links carry each (steptime)
        add(x["kind"], axes, level.bytes, (per // 2) * runs, f"MoE token dispatch + combine{where} (forward)",
            Overlap.EXPOSED, Phase.FORWARD, level.group, level.span)
        add(x["kind"], axes, level.bytes, (per - per // 2) * runs + 2 * rerun, f"MoE token dispatch + combine{where} "
            f"(backward" + (", 1f1b's recomputed stage forward)" if rerun else ")"), Overlap.EXPOSED, Phase.BACKWARD,
            level.group, level.span)
    if t > 1:  # PCC: the tensor ranks all-gather the received shares and reduce-scatter the experts' outputs
        buf = x["per_op"]
        add("all-gather", lay.tensor_axes, buf, 2 * runs, "MoE PCC: all-gather of the received token shares "
            "(forward; the reduce-scatter's transpose in the backward)", Overlap.EXPOSED, Phase.FORWARD)
        add("reduce-scatter", lay.tensor_axes, buf / t, 2 * runs, "MoE PCC: reduce-scatter of the experts' "
            "outputs (forward; the all-gather's transpose in the backward)", Overlap.EXPOSED, Phase.BACKWARD)
    if x["ids_per_layer_step"]:
        add(x["kind"], axes, x["ids_per_layer_step"] / m, runs + rerun, "MoE expert ids (dropless exchange)",
            Overlap.EXPOSED, Phase.FORWARD)


def layer_runs(plan, cfg) -> Tuple[float, float]:
    """``(layer passes, re-run forward passes)`` one device makes per step, which the per-layer
    collectives (TP, MoE exchange) follow: ``L·m`` without a pipeline; under one
    (:class:`~meshtrain.analysis.pipeline.PipelineShape`) ``m·L/(p·(1 - bubble))`` (every stage
    computes on every tick with work), and 1f1b re-runs each stage's forward in its VJP (the second
    number)."""
    pipe = pipeline_shape(plan)
    if pipe is None:
        return float(cfg.n_layers * batch_splits(plan.recipe)), 0.0
    runs = pipe.layer_runs(cfg.n_layers)
    return runs, (runs if pipe.one_f_one_b else 0.0)


def _pipeline_transfers(plan, cfg, lay, c, out) -> None:
    """Traffic of a pipeline over ``stage`` (``x = b·T·d·c``, one micro-batch's stage input on one
    device), as XLA emits it for :mod:`meshtrain.parallel.pipeline` (matched against the compiled HLO
    on XLA:CPU in tests/test_planner_moe_pp.py), per stage tick with work (``n = r·m/(1 - bubble)``):

    * each stage hands ``x`` to the next stage and (backward) a cotangent ``x`` to the previous one:
      ``n`` collective-permutes each way (gpipe / circular: the hand-off's own transpose, one permute; autodiff's
      transpose of the roll compiled to two); on the critical path (the next tick needs them);
    * gpipe / circular: two all-reduces of ``m·x`` over ``stage`` once a step: the stack inputs' cotangents
      (each stage reads its own copy of the inputs, their cotangents accumulated per stage through the
      ticks) and the stack's output (the masked sum that hands stage 0's ring to every stage);
    * 1f1b / zero-bubble: the head runs on each stage's own output and the embedding's VJP on each stage's
      input cotangents, the last stage's and stage 0's kept: once per step an all-reduce of the head's and
      the embedding table's f32 gradients (an MoE model, whose layers store values, keeps 1f1b's hand-off of
      the head's input on its ``m`` head ticks);
    * circular: the stage's layer weights ``W`` move into the interleaved order (an all-to-all of
      ``W``) and their gradients back (another)."""
    pipe = pipeline_shape(plan)
    p = lay.sizes.get("stage", 1)
    if pipe is None or p <= 1:
        return
    m = pipe.micro_batches
    B, T = batch_dims(plan)
    b = B // (lay.batch_split * m)
    x = float(b * (T // max(lay.context, lay.sequence, 1)) * cfg.d_model * c)
    n = round(pipe.stage_ticks)
    crit = Overlap.EXPOSED

    def put(kind, nbytes, executions, group, what, phase):
        out.append(CollectiveEstimate(kind, ("stage",), float(nbytes), int(executions), group, what, crit, phase))

    put("collective-permute", x, n, 2, "pipeline: stage output to the next stage (every tick)", Phase.FORWARD)
    put("collective-permute", x, n, 2, "pipeline: input cotangent to the previous stage (every tick)", Phase.BACKWARD)
    outside = [l for l in plan.group("params") if not (l.logical_axes and l.logical_axes[0] == "layers")]
    f32 = lambda leaves: sum(l.bytes_per_device * 4 / np.dtype(l.dtype).itemsize for l in leaves)  # noqa: E731
    if not pipe.one_f_one_b:  # (pipeline/_schedules.py, run_stack)
        put("all-reduce", m * x, 1, p, "pipeline: the stack inputs' cotangents, summed once", Phase.BACKWARD)
        put("all-reduce", m * x, 1, p, "pipeline: the stack's output of the m micro-batches", Phase.BACKWARD)
    elif getattr(cfg, "n_experts", 0):  # layer values: the head's input handed over (_head_handed_over)
        put("all-reduce", x, m, p, "pipeline: last stage's output to every stage (m head ticks)", Phase.FORWARD)
    else:  # _head_on_last: every parameter outside the stack, f32
        put("all-reduce", f32(outside), 1, p, "pipeline: the head's per-stage gradients, summed once", Phase.BACKWARD)
    if pipe.one_f_one_b:  # the embedding's VJP per stage (pipeline/_loss.py): the table's gradient, not m·x
        put("all-reduce", f32([l for l in outside if l.logical_axes and l.logical_axes[0] == "vocab"]), 1, p,
            "pipeline: the embedding's per-stage gradient, summed once", Phase.BACKWARD)
    if pipe.repeats > 1:
        w = sum(l.bytes_per_device for l in plan.group("params") if l.logical_axes and l.logical_axes[0] == "layers")
        put("all-to-all", w, 1, p, "circular: layer weights into the interleaved order", Phase.FORWARD)
        put("all-to-all", w, 1, p, "circular: their gradients back to the layer order", Phase.BACKWARD)


def _zero_axes_all(plan) -> Dict[str, Tuple[str, ...]]:
    """:func:`_zero_axes` of every parameter, in one pass over the optimizer leaves."""
    params = plan.group("params")
    opt = [(leaf.path, tuple(leaf.shape), set(_axes_in(leaf.spec))) for leaf in plan.group("optimizer")]
    out = {}
    for param in params:
        if param.path in out:
            continue  # _zero_axes reads the first parameter leaf of a path
        p_axes = set(_axes_in(param.spec))
        shape = tuple(param.shape)
        extra = set()
        for path, oshape, axes in opt:
            if path.endswith(param.path) and oshape == shape:
                extra |= axes - p_axes
        out[param.path] = tuple(extra)
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
    B, T = batch_dims(plan)
    m = lay.micro_batches
    b = B // (lay.batch_split * m)
    # x: one device's (b, T/context, d) residual stream; context parallelism splits the sequence before any
    # tensor-parallel collective sees it
    x = b * (T // lay.context) * cfg.d_model * c
    axes = lay.tensor_axes
    # Megatron sequence parallelism: the residual sequence split over the tensor axes themselves; a sequence
    # split over `context` (cp recipes) leaves tensor parallelism's all-reduces as they are (measured:
    # fsdp_tp_cp on 8xH100 all-reduces over `tensor` exactly the fsdp_tp bytes of its T/context tokens)
    sp = bool(set(lay.sequence_axes) & set(axes))
    runs, rerun = layer_runs(plan, cfg)  # L·m, or the pipeline's layer passes per device
    # remat=full re-runs the forward's collectives in the backward, except the last one of a layer:
    # the MLP-down reduction only produces the layer's output, which the backward never reads, so XLA
    # drops it (measured on XLA:CPU and XLA:TPU: 5 TP all-reduces per layer, not 6).
    full = plan.recipe.remat is Remat.FULL
    recompute, regather = (1, 2) if full else (0, 0)
    fwd_again = 2 * rerun  # 1f1b: each stage's VJP re-runs its forward (2 forward reductions per layer)
    crit, fwd, bwd = Overlap.EXPOSED, Phase.FORWARD, Phase.BACKWARD
    bwd_ar = 5 if backend is Backend.CPU else 2
    if not sp:
        mlp_down = _moe_down_rows_bytes(plan, cfg, x) if getattr(cfg, "n_experts", 0) else x
        add("all-reduce", axes, x, runs, "TP forward all-reduce (attention out)", crit, fwd)
        if getattr(cfg, "n_experts", 0) and expert_exchange(plan).hierarchical:
            # PCC: the experts' partial sums are reduce-scattered before the exchange (_expert_parallel), and the
            # combined output all-gathered over `tensor` (its transpose, a reduction, in the backward)
            add("all-gather", axes, x, runs, "MoE PCC: all-gather of the combined output (forward)", crit, fwd)
        else:
            add("all-reduce", axes, mlp_down, runs, "TP forward all-reduce (MLP down" + (
                ", on the experts' token buffer)" if mlp_down != x else ")"), crit, fwd)
        add("all-reduce", axes, x, (bwd_ar + recompute) * runs + fwd_again, "TP backward all-reduce (input gradients"
            + (", recomputed forward)" if recompute else ")"), crit, bwd)
    else:
        add("all-gather", axes, x, 2 * runs, "SP forward all-gather (b,T,d) before column-parallel", crit, fwd)
        # the backward all-gathers the cotangents of the two reduce-scatters, and re-gathers the two layer inputs
        # unless the forward saved them: XLA:GPU without remat keeps the gathered inputs (measured, `small` on
        # 8xH100: 17 all-gathers, not 25); XLA:TPU was measured under remat full only
        inputs = 0 if backend is Backend.GPU and plan.recipe.remat is Remat.NONE else 2
        add("all-gather", axes, x, (2 + inputs + regather) * runs + fwd_again, "SP backward all-gathers ("
            + ("re-gathered inputs, " if inputs else "") + "reduce-scatter transposes)", crit, bwd)
        # XLA:CPU has no reduce-scatter; XLA:TPU all-reduces the full (b,T,d) here too (measured, libtpu
        # 0.0.42.1, fsdp_tp_sp at Llama-3-8B shapes: 22 all-reduces of x over `tensor`, no reduce-scatter)
        if backend in (Backend.CPU, Backend.TPU):
            add("all-reduce", axes, x, 2 * runs, "SP forward reduce-scatter (as all-reduce)", crit, fwd)
            add("all-reduce", axes, x, (bwd_ar + recompute) * runs + fwd_again,
                "SP backward reduce-scatter (as all-reduce)", crit, bwd)
        else:
            add("reduce-scatter", axes, x / t, 2 * runs, "SP forward reduce-scatter after row-parallel", crit, fwd)
            add("reduce-scatter", axes, x / t, (2 + recompute) * runs + fwd_again, "SP backward reduce-scatter",
                crit, bwd)
    if lay.vocab_axes == axes:
        kind, nbytes = ("reduce-scatter", x / t) if sp and backend is Backend.GPU else ("all-reduce", x)
        add(kind, axes, nbytes, m, "vocab-parallel embedding lookup", crit, fwd)
        add(kind, axes, nbytes, m, "vocab-parallel head: input gradient", crit, bwd)
        add("all-reduce", axes, b * T * 4, 3 * m, "vocab-parallel loss (max, sum, target logit)", crit, fwd)


def per_axis_estimate(estimates: Sequence[CollectiveEstimate], *, by_span: bool = False) -> Dict[str, Dict[str, float]]:
    """``{axes_key: {kind: bytes per step, "total": ...}}`` like :func:`collectives.per_axis`; ``by_span``: the
    hierarchical expert exchange's levels under keys of their own, ``"expert (ici)"`` and ``"expert (dcn)"`` (the
    step time's rows)."""
    out: Dict[str, Dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in estimates:
        key = axes_key(e.axes) + (f" ({e.span})" if by_span and e.span else "")
        out[key][e.kind] += e.bytes_per_step
        out[key]["total"] += e.bytes_per_step
    return {k: dict(v) for k, v in out.items()}
