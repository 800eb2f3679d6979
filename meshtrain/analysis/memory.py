"""Per-device memory of a train step, by component, for any device count; and what XLA measured.

Example::

    est = estimate_memory(plan, cfg)          # plan from make_plan (a Mesh or an AbstractMesh)
    est.total, est.largest(3)                 # bytes; [(Component.ACTIVATIONS, 48_945_408), ...]
    est.verdict(get_hardware("h100").hbm_bytes)   # Fit.FITS / Fit.TIGHT / Fit.DOES_NOT_FIT
    measured = MeasuredMemory.of(step.lower(state, batch).compile())
    measured.peak                             # argument + output − alias + temp

Components (bytes per device; ``P`` = parameter bytes per device from the plan):

* parameters, optimizer state, batch: exact, summed over the plan's leaves (their shardings).
* gradients: ``P`` (gradients take the parameters' shardings and dtype), plus an f32
  accumulator (``4 bytes × parameter elements per device``) with ``micro_batches > 1``.
* activations: what the backward keeps under the recipe's remat policy and compute dtype,
  per micro-batch (:mod:`meshtrain.analysis.activations`).
* temporaries: the working set of one layer's backward ≈ one layer's activations with nothing
  rematerialised (its intermediates and their cotangents), plus the f32 gradient of the logits
  ``4·b·T·V/t`` (``b`` sequences per device, ``t`` tensor-parallel size over the vocabulary).

Mixture of experts (:func:`meshtrain.analysis.moe.moe_terms`): parameters and optimizer state are
the plan's (expert weights ÷ ``ep`` and whatever else their shardings say); the activation formulas
see the MoE MLP as a dense one of width ``rows·f_e + n_shared·f_e`` (``rows`` expert rows per token:
capacity ``E·C/T``, dropless ``k``, or ``ep·k`` with expert parallelism: the receive buffer), plus
the dispatched rows and expert outputs ``2·rows·b·T·d·c`` and the router's f32 logits and
probabilities ``2·b·T·E·4`` per layer (not with ``remat=full``); the working set adds one layer's
expert weights as the expert kernel gathers them over FSDP, and their gradient (``2c`` per element).

The layer loop (``Recipe.layer_loop`` / ``scan_unroll``, ``auto`` resolved by
:func:`meshtrain.recipes.resolve_layer_loop`, the function the step runs; XLA:CPU/GPU formulas, not pipelines):

* ``scan`` (above): the stacked ``[L, ...]`` residuals, the gradients and one layer's working set add up. With a
  remat policy the loop body's backward also holds the layer's weight gradient as multiplied ``W_layer·c``
  (full size before its reduction) next to the recomputed residuals. ``scan_unroll=k < L``: ``k`` layers'
  working sets.
* unrolled (``unrolled``, ``auto`` on a shallow stack without remat, or ``scan_unroll ≥ L``): straight-line
  layers that XLA schedules across. The residuals are remat=none's whatever the policy (XLA hoists the
  recomputation and keeps it alive), less the ``T²`` loop constants (the dense mask, fused into each
  consumer); each layer's weights as multiplied stay live from its forward to its backward (``L·W_layer·c``:
  slices of the stacked parameters, or under FSDP the full-size partial weight gradients that XLA:CPU's merged
  all-reduce keeps to the end); there is no separate working set (a layer's backward reuses its residuals'
  memory) and the gradients add only where they outgrow the residuals (each layer's is made as its own
  residuals die).

Against XLA:CPU (`small`, 4 layers, batch 16 × 128, 8 devices, every built-in recipe): unrolled remat=none
−2 % .. +2 % (was +6 % .. +23 %), scan_unroll=2 −1 % .. +6 % (was −43 % .. −8 %), scan remat=full −9 % .. +0 %
(was −15 % .. −1 %), scan remat=none unchanged (+0.5 % .. +4 %); unrolled with remat=full +4 % .. +6 %, except
the tensor-parallel recipes, where XLA does keep less of the recomputation (tp +31 %, fsdp_tp +33 %, fsdp_tp_sp
+21 %: an over-estimate; ``auto`` never picks remat unrolled).

Pipelines (``pp`` recipes; :class:`meshtrain.analysis.pipeline.PipelineShape`, ``p`` stages, ``m``
micro-batches, ``x = b·T·d·c`` one micro-batch's stage input, ``a`` one layer's saved activations):

* gpipe / circular: ``ticks·L/(p·r)·a`` (every tick's residuals) + ``m ×`` (what lies outside the
  stack + the ring of stage outputs ``x``) + ``ticks·W_stage·c/r`` (the layer group each tick
  indexes, kept for the backward; measured on XLA:CPU); gradients ``P`` (no accumulation loop);
  the logits gradient over the whole per-device batch (the head runs after the schedule);
* 1f1b: a ``2p``-slot stash of ``x`` + one micro-batch outside the stack + ``m`` embedding outputs;
  the working set adds one stage's VJP ``(L/p)·a``, the f32 input cotangents ``4·m·x/c`` and the tick's
  f32 weight gradient and accumulator ``2·4 B·W_stage``; gradients are f32 accumulators (4 B per
  element).

Against XLA on 8 CPU devices (tests/test_planner_moe_pp.py): the `small` model's pipelines within
−7 %..+16 % of the compiled peak, dropless expert parallelism +2 %.

XLA:TPU (``backend="tpu"``, or a plan on TPU devices; non-pipeline steps whose compute dtype is narrower
than the parameters'): XLA:TPU fuses f32 upcasts into their consumers, so

* gradients take the compute dtype (``c`` bytes per element at the gradient's sharding): the backward's
  bf16 gradients are reduced and upcast inside the optimizer update, never stored in f32;
* the saved logits are the compute-dtype ones (not the f32 upcast), and no f32 copy of the residual
  stream ``(b, T, d)`` is saved or kept in a layer's working set (the norms upcast on the fly);
* the saved residual stream of the layers is counted twice (the backward loop reads a copy of the
  forward loop's stack: ≈ ``b·T·d·c`` per layer more than the traced residuals, measured at 4 and 32 layers);
* temporaries are ``max(one layer's working set, f32 logits gradient)``: the head's backward (and its
  optimizer update) finishes before the layers' backward starts.

Against XLA:TPU's memory analysis (tests/test_planner_tpu_memory.py: Llama-3-8B shapes, 4 layers, batch
8 × 4096, bf16 compute, remat full, v5p:2x2x2): dp +4.0 %, fsdp −7.1 %, zero1 −0.9 %, zero2 −2.6 %,
hsdp +8.5 %, tp +4.8 %, fsdp_tp +6.0 %, fsdp_tp_sp +2.8 % (the CPU-calibrated formulas: +18 % .. +57 %);
with all 32 layers tp +2.1 %, fsdp −8.8 %, fsdp_tp −2.4 %, hsdp −5.3 %, zero1 −3.0 %. The CPU formulas
are unchanged (``backend`` ``"cpu"`` or ``"gpu"``, or an ``AbstractMesh`` with no backend given).

Peak = sum of the components: parameters and optimizer state are live throughout, gradients and
the saved activations of all layers coexist at the start of the backward pass, where one layer's
working set is added. Measured peak (``MeasuredMemory.peak``) is XLA's buffer assignment:
arguments + outputs − aliased (donated) + temporaries. (On XLA:CPU ``peak_memory_in_bytes``
reports only the arguments; we do not use it.)

ZeRO accounting (Rajbhandari et al., 2020) for ``Ψ`` parameters with mixed-precision Adam
(``K = 12``: f32 master weights, momentum, variance), ``N_d`` data-parallel devices::

    stage 0 (DP)      (2 + 2 + K)·Ψ
    stage 1 (P_os)    2Ψ + 2Ψ + K·Ψ/N_d
    stage 2 (P_os+g)  2Ψ + (2 + K)·Ψ/N_d
    stage 3 (P_os+g+p) (2 + 2 + K)·Ψ/N_d

see :func:`zero_model_state`.

Any other model (no analytic formulas: a ``ViTConfig``, ``BertConfig`` or a user factory, ``cfg``
``None``) is measured on its own program (:mod:`meshtrain.analysis.compiled`), ``source`` says so:

* on a ``Mesh`` of existing devices, from the compiled step's ``memory_analysis()``: parameters,
  optimizer state and batch (plan), XLA's temporaries (gradients, saved activations, gathered
  weights, working set together) and the rest (model state, step counter, metrics); the total is
  XLA's peak exactly;
* on an ``AbstractMesh`` (more devices than exist), from the traced program: parameters, optimizer
  state, batch and model state (plan), gradients ``P`` (as above), activations = the loss VJP's
  residuals at one device's micro-batch (:func:`~meshtrain.analysis.compiled.saved_activation_bytes`),
  temporaries = the weights the step multiplies with where they are not the stored parameters
  (gathered over FSDP axes or cast to the compute dtype: ``Σ E·c ÷ non-batch shards``). XLA's own
  working buffers are not in it; on CPU with 8 devices it is within ~15 % of the compiled peak for
  the built-in encoders (tests/test_plan_any_model.py).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Dict, List, Optional, Tuple

import jax
import numpy as np

from meshtrain.analysis.activations import saved_activations
from meshtrain.analysis.compiled import (ANALYTIC, COMPILED, MeasuredMemory, ProgramCost, default_loss,  # noqa: F401
                                         has_analytic_model, local_rows, program_cost, working_weight_bytes)
from meshtrain.analysis.comms import batch_dims
from meshtrain.analysis.layout import Layout, cached, layout_of
from meshtrain.analysis.moe import moe_terms
from meshtrain.analysis.pipeline import pipeline_shape
from meshtrain.parallel.context import attention_block_shape, plan_layout
from meshtrain.plan import gradient_shardings
from meshtrain.recipes import AttentionKind, Remat, resolve_layer_loop


class Component(str, enum.Enum):
    PARAMS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER = "optimizer state"
    ACTIVATIONS = "activations"
    TEMPORARIES = "temporaries"
    BATCH = "batch"
    OTHER = "other"  # model state, step counter, non-donated outputs (estimates for any model)


class Fit(str, enum.Enum):
    """Verdict against a device's memory: ``fits`` (≤ 90 %), ``tight`` (90–100 %: allocator
    fragmentation and runtime buffers may tip it over), ``does not fit`` (> 100 %)."""

    FITS = "fits"
    TIGHT = "tight"
    DOES_NOT_FIT = "does not fit"


TIGHT_FRACTION = 0.9


@dataclasses.dataclass(frozen=True)
class MemoryTerm:
    """One named part of a component: bytes per device and the formula behind them. ``bytes`` is fractional
    only where a formula divides (a pipeline's tick weights ÷ r); a term starting "less" is negative."""

    component: Component
    name: str
    bytes: float
    formula: str

    def to_dict(self) -> Dict[str, object]:
        return {"name": self.name, "bytes": int(self.bytes), "formula": self.formula}


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes per device by component, each with the formula that produced it, and the named
    terms each component sums (``terms``: those that are not 0 bytes)."""

    components: Tuple[Tuple[Component, int], ...]
    formulas: Tuple[Tuple[Component, str], ...]
    source: str = ANALYTIC  # or "from the compiled program" / "from the traced program"
    terms: Tuple[MemoryTerm, ...] = ()

    @classmethod
    def of_terms(cls, terms: Tuple[MemoryTerm, ...], formulas: Tuple[Tuple[Component, str], ...],
                 source: str = ANALYTIC) -> "MemoryEstimate":
        """Components as the sums of their terms, in the order the terms name them (fractional bytes are
        summed before truncation)."""
        sums: Dict[Component, float] = {}
        for term in terms:
            sums[term.component] = sums.get(term.component, 0) + term.bytes
        return cls(tuple((c, int(b)) for c, b in sums.items()), formulas, source,
                   tuple(t for t in terms if t.bytes))

    def terms_of(self, component: Component) -> List[MemoryTerm]:
        return [t for t in self.terms if t.component is Component(component)]

    @property
    def total(self) -> int:
        return sum(b for _, b in self.components)

    def __getitem__(self, component: Component) -> int:
        return dict(self.components).get(Component(component), 0)  # a component this estimate has not: 0 bytes

    def largest(self, k: int = 3) -> List[Tuple[Component, int]]:
        return sorted(self.components, key=lambda cb: -cb[1])[:k]

    def verdict(self, capacity_bytes: float) -> Fit:
        if self.total > capacity_bytes:
            return Fit.DOES_NOT_FIT
        return Fit.TIGHT if self.total > TIGHT_FRACTION * capacity_bytes else Fit.FITS

    def to_dict(self) -> Dict[str, object]:
        f = dict(self.formulas)
        return {"total": self.total, "source": self.source,
                "components": {c.value: {"bytes": b, "formula": f.get(c, ""),
                                         "terms": [t.to_dict() for t in self.terms_of(c)]}
                               for c, b in self.components}}


def estimate_memory(plan, cfg=None, *, loss_fn=None, cost: Optional[ProgramCost] = None,
                    backend=None) -> MemoryEstimate:
    """Per-device memory of ``make_train_step(plan, loss_fn=loss_fn)``.

    A decoder ``cfg`` (``DecoderConfig``) uses the analytic formulas (``plan`` may live on an
    ``AbstractMesh``): each component is a sum of named :class:`MemoryTerm`\\ s (``est.terms``). Any other
    ``cfg`` (or ``None``: a user model) is measured on the step's program with ``loss_fn`` (default: the
    built-in loss of a built-in config), see the module docstring; ``cost`` reuses a
    :func:`~meshtrain.analysis.compiled.program_cost` already computed.
    ``backend``: whose buffer choices to model (``"tpu"``, ``"gpu"``, ``"cpu"`` or a
    :class:`~meshtrain.analysis.comms.Backend`); default: the platform of the plan's devices on a
    ``Mesh``, XLA:CPU's on an ``AbstractMesh`` (see "XLA:TPU" in the module docstring).
    """
    if plan.batch is None:
        raise ValueError("estimate_memory needs a plan with a batch: make_plan(..., batch=BatchSpec(B, T))")
    if not has_analytic_model(cfg):
        return program_memory(plan, loss_fn or default_loss(cfg, plan), cost=cost)
    s = _step_shape(plan, cfg, backend)
    acts = activation_terms(s)
    terms = (_state_term(Component.PARAMS, "parameters", s.per["params"], _params_formula(s))
             + gradient_terms(s, int(_total(acts)))
             + _state_term(Component.OPTIMIZER, "optimizer state", s.per["optimizer"], _OPTIMIZER_FORMULA)
             + acts + temporary_terms(s)
             + _state_term(Component.BATCH, "batch", s.per["batch"], _BATCH_FORMULA))
    return MemoryEstimate.of_terms(terms, _component_formulas(s))


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What the memory terms of one plan and decoder read: the layout, the per-device batch, the activation
    models, the layer loop, the pipeline and MoE shapes (``L`` layers, ``c`` compute-dtype bytes, ``b_loc``
    sequences per device per micro-batch, ``t_loc`` their length per device)."""

    plan: Any
    cfg: Any
    lay: Layout
    B: int
    T: int
    per: Dict[str, int]
    elems: int
    stage_w: int
    pipe: Any
    moe: Any
    acfg: Any
    wcfg: Any
    weight_fraction: float
    model: Any
    none: Any
    L: int
    c: int
    b_loc: int
    t_loc: int
    tpu: bool
    loop: Any
    unroll: int
    straight: bool

    @property
    def split(self):
        return self.lay.split()

    @property
    def remat(self) -> Remat:
        return self.plan.recipe.remat

    @property
    def moe_saved(self) -> int:
        """What an MoE layer saves besides its MLP-width tensors (none with ``remat=full``)."""
        return self.moe.saved_extra_per_layer if self.moe is not None and self.remat is not Remat.FULL else 0

    @property
    def layer_saved(self) -> int:
        """One layer's saved activations under the recipe's remat policy."""
        return self.model.layer_bytes_per_device(self.acfg, self.B, self.T, self.split) + self.moe_saved

    @property
    def tensors(self) -> int:
        """All saved tensors under the recipe's remat policy (MoE extras included)."""
        return self.model.bytes_per_device(self.acfg, self.B, self.T, self.split) + self.L * self.moe_saved

    @property
    def casts(self) -> int:
        """Compute-dtype copies of the weights the backward keeps (every expert's weights are cast)."""
        B, T, split = self.B, self.T, self.split
        return (self.model.bytes_per_device(self.wcfg, B, T, split, weight_fraction=self.weight_fraction)
                - self.model.bytes_per_device(self.wcfg, B, T, split))

    @property
    def stage_input(self) -> int:
        """``x = b·T·d·c``: one micro-batch's pipeline stage input on one device."""
        return self.b_loc * self.t_loc * self.cfg.d_model * self.c

    @functools.cached_property
    def layer_weights(self) -> int:
        """``W_layer·c`` where the backward holds the layer's weight gradient as multiplied (scan with a remat
        policy), ``L·W_layer·c`` unrolled, else 0."""
        if self.straight:
            return working_weight_bytes(self.plan, layers_only=True)[0]
        if self.pipe is None and self.remat is not Remat.NONE and not self.tpu:
            return working_weight_bytes(self.plan, layers_only=True)[0] // max(self.L, 1)
        return 0

    @functools.cached_property
    def attention_blocks(self) -> int:
        """Bytes of blockwise attention's score blocks (:func:`attention_working_set`)."""
        return attention_working_set(self.plan, self.cfg, self.b_loc)

    @property
    def accumulates(self) -> bool:
        """An f32 gradient accumulator over micro-batches (not pipelines: their schedule accumulates)."""
        return self.pipe is None and self.lay.micro_batches > 1


def _step_shape(plan, cfg, backend) -> StepShape:
    lay = layout_of(plan)
    B, T = batch_dims(plan)
    split = lay.split()
    per = plan.per_device_bytes()
    elems, total_param_bytes, stage_w = cached(plan, "param_elements", _param_elements, layout_only=True)
    pipe = pipeline_shape(plan)
    moe = moe_terms(plan, cfg)
    weight_fraction = 0.0
    if lay.compute_dtype != lay.param_dtype and total_param_bytes:
        weight_fraction = per["params"] / total_param_bytes
    attention, remat = plan.recipe.attention, plan.recipe.remat
    c = np.dtype(lay.compute_dtype).itemsize
    tpu = pipe is None and backend_name(plan, backend) == "tpu" and c < np.dtype(lay.param_dtype).itemsize
    # the layer loop the step runs (scan_layers resolves `auto` with the same function)
    loop, unroll = resolve_layer_loop(plan.recipe.layer_loop, cfg.n_layers, remat, plan.recipe.scan_unroll)
    return StepShape(
        plan, cfg, lay, B, T, per, elems, stage_w, pipe, moe,
        moe.activation_config(cfg) if moe is not None else cfg,  # MoE: the dense-equivalent MLP width
        moe.weight_config(cfg) if moe is not None else cfg,  # MoE: every expert's weights are cast
        weight_fraction,
        saved_activations(remat, lay.compute_dtype, cfg.tie_embeddings, attention),
        saved_activations(Remat.NONE, lay.compute_dtype, cfg.tie_embeddings, attention),
        cfg.n_layers, c, B // (split.batch * split.micro_batches), T // max(lay.context, lay.sequence, 1), tpu,
        loop, unroll, pipe is None and not tpu and unroll >= cfg.n_layers)  # straight: unrolled (or unroll ≥ L)


def _total(terms: Tuple[MemoryTerm, ...]) -> float:
    return sum(t.bytes for t in terms)


def _state_term(component: Component, name: str, nbytes: int, formula: str) -> Tuple[MemoryTerm, ...]:
    return (MemoryTerm(component, name, nbytes, formula),)


def gradient_terms(s: StepShape, activations: int) -> Tuple[MemoryTerm, ...]:
    """The gradients: ``P`` at the gradients' shardings (XLA:TPU: in the compute dtype); unrolled, only the
    part beyond the saved activations; plus an f32 accumulator with micro-batches (1f1b: f32 accumulators
    instead, where larger). ``activations``: the activation component's bytes."""
    G = Component.GRADIENTS
    if s.tpu:
        grads = MemoryTerm(G, "gradients (compute dtype)", gradient_bytes(s.plan, itemsize=s.c),
                           "elements per device × compute-dtype bytes at the gradients' shardings")
    elif s.straight:
        grads = MemoryTerm(G, "gradients beyond the saved activations",
                           max(gradient_bytes(s.plan) - activations, 0),
                           "max(P − activations, 0): unrolled, each layer's gradient is made as its residuals die")
    else:
        grads = MemoryTerm(G, "gradients", gradient_bytes(s.plan), "P: the parameters' bytes at the gradients' "
                                                                 "shardings")
    f32 = 4 * s.elems
    if s.pipe is not None and s.pipe.one_f_one_b and f32 > grads.bytes:
        return (MemoryTerm(G, "f32 gradient accumulators (1f1b)", f32, "4 B × parameter elements per device"),)
    if s.accumulates:
        return grads, MemoryTerm(G, "f32 accumulator (micro-batches)", f32, "4 B × parameter elements per device")
    return (grads,)


def activation_terms(s: StepShape) -> Tuple[MemoryTerm, ...]:
    """What the backward keeps: the saved tensors of the layer loop the step runs (scan, unrolled or a
    pipeline schedule) and the compute-dtype copies of the weights."""
    A, B, T, split, L = Component.ACTIVATIONS, s.B, s.T, s.split, s.L
    casts = MemoryTerm(A, "weight casts", s.casts, "compute-dtype copies of the weights the backward keeps")
    if s.straight:
        moe_none = s.moe.saved_extra_per_layer if s.moe is not None else 0
        return (MemoryTerm(A, "saved tensors (remat=none)", s.none.bytes_per_device(s.acfg, B, T, split),
                           "unrolled: remat=none's residuals whatever the policy"),
                MemoryTerm(A, "MoE dispatch buffers", L * moe_none, "L × dispatched rows, expert outputs, f32 router "
                                                                   "logits/probabilities"),
                MemoryTerm(A, "less loop constants", -s.none.loop_constant_bytes_per_device(s.acfg, B, T, split),
                           "the T² loop constants (the dense mask, fused into each consumer)"))
    if s.pipe is None:
        saved = (MemoryTerm(A, "saved tensors", s.model.bytes_per_device(s.acfg, B, T, split),
                            f"the tensors remat={s.remat.value} saves, all layers"),
                 MemoryTerm(A, "MoE dispatch buffers", L * s.moe_saved, "L × dispatched rows, expert outputs, f32 "
                                                                        "router logits/probabilities"))
        return saved + _tpu_activation_terms(s) + (casts,)
    x, m, pipe = s.stage_input, s.pipe.micro_batches, s.pipe
    stack = MemoryTerm(A, "pipeline stack", pipe.stage_activation_bytes(L, s.layer_saved, x),
                       "2p stage inputs 2·p·x (stash)" if pipe.one_f_one_b else "ticks·L/(p·r)·a_layer")
    rest = s.tensors - L * s.layer_saved  # embedding output, final norm, logits: outside the stack
    if pipe.one_f_one_b:
        return (stack, MemoryTerm(A, "outside the stack", rest, "one micro-batch's embedding output, norm, logits"),
                MemoryTerm(A, "embedding outputs", m * x, "m·x"), casts)
    return (stack, MemoryTerm(A, "outside the stack and stage outputs", m * (rest + x),
                              "m × (embedding output, norm, logits + the ring's stage output x)"), casts,
            MemoryTerm(A, "layer groups the ticks index", pipe.ticks * s.stage_w * s.c / pipe.repeats,
                       "ticks·W_stage·c/r"))


def _tpu_activation_terms(s: StepShape) -> Tuple[MemoryTerm, ...]:
    """XLA:TPU's differences from the traced residuals: the logits and the residual stream in the compute
    dtype (no f32 copies), and the layers' residual stream counted twice (the backward loop reads a copy)."""
    if not s.tpu:
        return ()
    A, B, T, split = Component.ACTIVATIONS, s.B, s.T, s.split
    btd = dict(dims=("B", "T", "d"))
    return (MemoryTerm(A, "residual stream copy (XLA:TPU)",
                       s.model.tensor_bytes_per_device(s.acfg, B, T, split, dtype=s.lay.compute_dtype, stacked=True,
                                                       **btd), "the layers' saved (b, T, d) stack once more"),
            MemoryTerm(A, "less f32 upcasts (XLA:TPU)", -(s.model.tensor_bytes_per_device(s.acfg, B, T, split)
                                                          * (4 - s.c) // 4), "f32 tensors held in the compute dtype"),
            MemoryTerm(A, "less f32 residual stream (XLA:TPU)",
                       -s.model.tensor_bytes_per_device(s.acfg, B, T, split, **btd), "no f32 copy of (b, T, d)"))


def temporary_terms(s: StepShape) -> Tuple[MemoryTerm, ...]:
    """The backward's working set: one layer's (``scan_unroll`` layers'; unrolled: every layer's weights as
    multiplied), the f32 logits gradient, blockwise attention's score blocks and a pipeline's extras."""
    M, B, T, split, L = Component.TEMPORARIES, s.B, s.T, s.split, s.L
    k = s.unroll if s.pipe is None and not s.straight else 1
    times = f"{k} × " if k > 1 else ""
    if s.straight:
        layer = (MemoryTerm(M, "layers' weights as multiplied", s.layer_weights, "L·W_layer·c"),)
    else:
        layer = (MemoryTerm(M, "one layer's working set", k * s.none.layer_bytes_per_device(s.acfg, B, T, split),
                            f"{times}one layer with remat=none"),)
        if s.moe is not None:
            layer += (MemoryTerm(M, "MoE buffers and gathered expert weights",
                                 k * (s.moe.saved_extra_per_layer + s.moe.gathered_per_layer),
                                 f"{times}(dispatch buffers + expert weights gathered over FSDP and their gradient)"),)
        if s.tpu:
            layer += (MemoryTerm(M, "less f32 residual stream (XLA:TPU)",
                                 -k * s.none.tensor_bytes_per_device(s.acfg, B, T, split, per_layer=True,
                                                                     dims=("B", "T", "d")),
                                 "no f32 copy of one layer's (b, T, d)"),)
        if s.layer_weights:
            layer += (MemoryTerm(M, "layer's weight gradient as multiplied", k * s.layer_weights,
                                 f"{times}W_layer·c (remat: recomputed residuals and weight gradient together)"),)
    blocks = MemoryTerm(M, "attention score blocks", s.attention_blocks,
                        "4 × 4 B·b·n·bq·bk (blockwise kernels)")
    logits_rows = s.b_loc * s.pipe.micro_batches if s.pipe is not None and not s.pipe.one_f_one_b else s.b_loc
    logits_grad = 4 * logits_rows * (T // s.lay.context) * s.cfg.vocab_size // s.lay.size(s.lay.vocab_axes)
    if s.tpu:  # XLA:TPU finishes the head's backward before the layers': the larger of the two
        beyond = max(logits_grad - int(_total(layer + (blocks,))), 0)
        return layer + (blocks, MemoryTerm(M, "f32 logits gradient beyond the working set", beyond,
                                           "max(4·b·T·V/t − the above, 0)"))
    terms = layer + (MemoryTerm(M, "f32 logits gradient", logits_grad, "4·b·T·V/t"), blocks)
    if s.pipe is not None and s.pipe.one_f_one_b:
        x, m, p = s.stage_input, s.pipe.micro_batches, s.pipe.stages
        terms += (MemoryTerm(M, "one stage's VJP", (L // p) * s.layer_saved, "L/p layers' saved activations"),
                  MemoryTerm(M, "f32 input cotangents", 4 * m * x // s.c, "4·m·x/c"),
                  MemoryTerm(M, "tick's f32 weight gradient and accumulator", 2 * 4 * s.stage_w, "2·4 B·W_stage"))
    return terms


def _params_formula(s: StepShape) -> str:
    formula = _PARAMS_FORMULA
    if s.moe is not None:
        formula += (f"; expert weights {s.moe.expert_bytes_per_device:,} B per device of "
                    f"{s.moe.expert_bytes_total:,} (÷{s.moe.ep} expert-parallel and the other shardings)")
    return formula


def _component_formulas(s: StepShape) -> Tuple[Tuple[Component, str], ...]:
    """Each component's formula in words, with the figures it used (the terms give the parts)."""
    lay, moe, pipe, L, w_layers = s.lay, s.moe, s.pipe, s.L, s.layer_weights
    unroll, straight, blocks = s.unroll, s.straight, s.attention_blocks
    acc = " + f32 accumulator 4 B × elements per device (micro-batches)" if s.accumulates else ""
    if pipe is not None and pipe.one_f_one_b and 4 * s.elems > gradient_bytes(s.plan):
        acc = " (1f1b: f32 accumulators, 4 B × elements per device)"
    act_formula = (f"saved tensors under remat={s.remat.value}, {lay.compute_dtype}, b={s.b_loc} per device "
                   f"per micro-batch, ÷{lay.tensor} on heads/MLP/vocab, ÷{lay.sequence} on (b,t,d)"
                   + (f", ÷{lay.context} on the sequence (context, attention {s.plan.recipe.attention.value})"
                      if lay.context > 1 else ""))
    temp_formula = ((f"{unroll} layers (scan_unroll) " if unroll > 1 and not straight else "one layer ")
                    + "with remat=none (backward working set)"
                    + (f" + its weight gradient as multiplied W_layer·c = {w_layers:,} B (remat: recomputed "
                       "residuals and weight gradient together)" if w_layers and not straight else "")
                    + " + f32 logits gradient 4·b·T·V/t"
                    + (" + attention score blocks 4 × 4 B·b·n·bq·bk (blockwise kernels)" if blocks else ""))
    grad_formula = "= parameters (same shardings and dtype)"
    if straight:
        act_formula = (f"layers unrolled ({s.loop.value}): saved tensors under remat=none (XLA keeps the "
                       f"recomputation of any remat policy alive), less the T² loop constants; " + act_formula)
        temp_formula = (f"the {L} layers' weights as multiplied L·W_layer·c = {w_layers:,} B (kept from each "
                        "layer's forward to its backward: slices of the stacked parameters, or under FSDP the "
                        "full-size weight gradients until the merged all-reduce) + f32 logits gradient 4·b·T·V/t"
                        + (" + attention score blocks 4 × 4 B·b·n·bq·bk (blockwise kernels)" if blocks else ""))
        grad_formula = ("the part of the gradients (= parameters) beyond the saved activations: unrolled, each "
                        "layer's gradient is made as its residuals die")
    if s.tpu:
        temp_formula = ("max(one layer with remat=none (backward working set), f32 logits gradient 4·b·T·V/t): "
                        "XLA:TPU finishes the head's backward before the layers'"
                        + (" + attention score blocks 4 × 4 B·b·n·bq·bk" if blocks else ""))
        act_formula += "; XLA:TPU: logits in the compute dtype, no f32 copy of the residual stream"
    if moe is not None:
        act_formula += (f"; MoE: MLP width → rows·f_e + shared = {moe.d_ff_equivalent} ({moe.rows:.3g} expert rows "
                        f"per token), + dispatched rows, expert outputs and f32 router logits/probabilities "
                        f"{moe.saved_extra_per_layer:,} B per layer")
        temp_formula += (" + the layer's MoE buffers" + (f" + its expert weights gathered over FSDP and their "
                                                          f"gradient {moe.gathered_per_layer:,} B"
                                                          if moe.gathered_per_layer else ""))
    if pipe is not None:
        p, x = pipe.stages, s.stage_input
        if pipe.one_f_one_b:
            act_formula += (f"; pipeline {pipe.describe()}: stash of 2p stage inputs 2·{p}·x + one micro-batch "
                            f"outside the stack + m embedding outputs (x = b·T·d·c = {x:,} B)")
            temp_formula += (f" + one stage's VJP (L/p = {L // p} layers saved) + f32 input cotangents 4·m·x/c "
                             f"+ the tick's f32 weight gradient and accumulator 2·4 B·W_stage")
        else:
            act_formula += (f"; pipeline {pipe.describe()}: every tick's stage residuals ticks·L/(p·r)·a_layer "
                            f"+ m × (outside the stack + the ring of stage outputs x = {x:,} B) + the layer group "
                            f"each tick indexes ticks·W_stage·c/r")
            temp_formula += "; logits gradient over the whole batch (b·m rows: the head runs after the schedule)"
    return (
        (Component.PARAMS, _params_formula(s)),
        (Component.GRADIENTS, ("elements per device × compute-dtype bytes (XLA:TPU upcasts in the reduction and "
                               "optimizer update)" if s.tpu else grad_formula) + acc),
        (Component.OPTIMIZER, _OPTIMIZER_FORMULA),
        (Component.ACTIVATIONS, act_formula),
        (Component.TEMPORARIES, temp_formula),
        (Component.BATCH, _BATCH_FORMULA),
    )


_PARAMS_FORMULA = "Σ parameter leaves: elements × dtype bytes ÷ shards (plan)"
_OPTIMIZER_FORMULA = "Σ optimizer-state leaves ÷ shards (plan)"
_BATCH_FORMULA = "input arrays (plan)"


def attention_working_set(plan, cfg, b_loc: int) -> int:
    """Bytes of the score blocks a blockwise attention kind keeps live in the backward (scores,
    probabilities, their gradient and ``dp``: 4 f32 blocks of ``b × heads × bq × bk``); 0 for ``dense``
    (its ``T × T`` scores are in the activations)."""
    if plan.recipe.attention is AttentionKind.DENSE:
        return 0
    lay = layout_of(plan)
    bq, bk, heads = attention_block_shape(plan_layout(plan), batch_dims(plan)[1], max(cfg.n_heads // lay.tensor, 1),
                                          b_loc)
    return 4 * 4 * b_loc * heads * bq * bk


def program_memory(plan, loss_fn, *, cost: Optional[ProgramCost] = None) -> MemoryEstimate:
    """Per-device memory of the step of any model, from its compiled or traced program (module docstring)."""
    cost = cost if cost is not None else program_cost(plan, loss_fn)
    per = plan.per_device_bytes()
    state = ((Component.PARAMS, per["params"], _PARAMS_FORMULA),
             (Component.OPTIMIZER, per["optimizer"], _OPTIMIZER_FORMULA),
             (Component.BATCH, per["batch"], _BATCH_FORMULA))
    if cost.source == COMPILED:
        m = cost.memory
        other = m.argument + m.output - m.alias - per["params"] - per["optimizer"] - per["batch"]
        temp = m.temp + min(other, 0)
        rows = state + (
            (Component.TEMPORARIES, temp, "XLA temp buffers of the compiled step (memory_analysis temp): gradients, "
                                          "saved activations, gathered weights and working set together"),
            (Component.OTHER, max(other, 0), "arguments + outputs − donated, less the above: model state, step "
                                             "counter, metrics"))
    else:
        micro = plan.recipe.micro_batches
        elems = sum(l.bytes_per_device // np.dtype(l.dtype).itemsize for l in plan.group("params"))
        grads = gradient_bytes(plan) + (4 * elems if micro > 1 else 0)
        _, extra = working_weight_bytes(plan)
        r = plan.recipe
        rows = state + (
            (Component.GRADIENTS, grads, _GRAD_FORMULA
             + (" + f32 accumulator 4 B × elements per device (micro-batches)" if micro > 1 else "")),
            (Component.ACTIVATIONS, cost.activations or 0,
             f"loss VJP residuals traced on b={local_rows(plan)} rows per device per micro-batch, remat="
             f"{r.remat.value}, {r.compute_dtype}; not divided by tensor/context parallelism"),
            (Component.TEMPORARIES, extra, "weights as multiplied where not the stored parameters: gathered over "
                                           "FSDP axes or cast to the compute dtype (Σ E·c ÷ non-batch shards); "
                                           "XLA working buffers not included"),
            (Component.OTHER, per.get("model_state", 0), "model state (plan)"))
    return _of_rows(rows, cost.source)


def _of_rows(rows, source: str) -> MemoryEstimate:
    """An estimate of one term per component from ``(component, bytes, formula)`` rows."""
    return MemoryEstimate.of_terms(tuple(MemoryTerm(c, c.value, int(b), f) for c, b, f in rows),
                                   tuple((c, f) for c, _, f in rows), source)


_GRAD_FORMULA = ("Σ parameter elements × dtype bytes ÷ the shards of the gradient's sharding (the parameter's; "
                 "the optimizer state's under zero2)")


def backend_name(plan, backend=None) -> str:
    """``"tpu"``, ``"gpu"`` or ``"cpu"``: ``backend`` if given (a string or a ``Backend``), else the platform
    of the plan's devices (a ``Mesh``), else ``"cpu"`` (an ``AbstractMesh``)."""
    if backend is not None:
        name = str(getattr(backend, "value", backend)).lower()
    elif isinstance(plan.mesh, jax.sharding.Mesh):
        name = getattr(plan.mesh.devices.flat[0], "platform", "cpu")
    else:  # an AbstractMesh: no devices to ask
        name = "cpu"
    return {"cuda": "gpu", "rocm": "gpu"}.get(name, name)


def _param_elements(plan) -> Tuple[int, int, int]:
    """``(elements per device, bytes in all, layer-weight elements per device)`` of the parameters: Σ bytes
    per device ÷ dtype bytes, Σ bytes, and the first over the stacked layer weights (leading logical axis
    ``layers``: a pipeline stage's)."""
    params = plan.group("params")
    per_leaf = [l.bytes_per_device // np.dtype(l.dtype).itemsize for l in params]
    return (sum(per_leaf), sum(l.bytes_total for l in params),
            sum(e for e, l in zip(per_leaf, params) if l.logical_axes and l.logical_axes[0] == "layers"))


def gradient_bytes(plan, itemsize: Optional[int] = None) -> int:
    """Gradient bytes per device: each parameter's bytes divided by the shards of the sharding the step
    keeps its gradient in (:func:`meshtrain.plan.gradient_shardings`: the parameter's own, or its
    optimizer state's under ``zero2``). ``itemsize``: bytes per element instead of the parameter's dtype
    (floating-point leaves only). Once per layout and ``itemsize``."""
    return cached(plan, ("gradient_bytes", itemsize), lambda p: _gradient_bytes(p, itemsize), layout_only=True)


def _gradient_bytes(plan, itemsize: Optional[int]) -> int:
    sizes = plan.mesh_sizes
    total = 0
    for sharding, leaf in zip(jax.tree.leaves(gradient_shardings(plan)), jax.tree.leaves(plan.abstract.params)):
        shards = 1
        for entry in sharding.spec:
            for axis in (entry if isinstance(entry, tuple) else (entry,)):
                shards *= sizes.get(axis, 1) if axis else 1
        size = np.dtype(leaf.dtype).itemsize
        if itemsize is not None and jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating):
            size = itemsize
        total += int(np.prod(leaf.shape)) * size // shards
    return total


#: ``MemoryEstimate.source`` of :func:`state_memory`.
STATE_ONLY = "state only (no loss: activations and temporaries unknown)"


def state_memory(plan) -> MemoryEstimate:
    """Parameters, gradients (``P``), optimizer state, batch and model state per device, from the plan
    alone: what is known without a loss function (a lower bound on the step's memory)."""
    per = plan.per_device_bytes()
    rows = ((Component.PARAMS, per["params"], _PARAMS_FORMULA),
            (Component.GRADIENTS, gradient_bytes(plan), _GRAD_FORMULA),
            (Component.OPTIMIZER, per["optimizer"], _OPTIMIZER_FORMULA),
            (Component.BATCH, per["batch"], _BATCH_FORMULA),
            (Component.OTHER, per.get("model_state", 0), "model state (plan)"))
    return _of_rows(rows, STATE_ONLY)


class ZeroStage(int, enum.Enum):
    """ZeRO stages: what is partitioned over the ``N_d`` data-parallel devices."""

    DP = 0
    OS = 1
    OS_G = 2
    OS_G_P = 3


@dataclasses.dataclass(frozen=True)
class ModelState:
    """Model-state bytes per device: ``params + grads + optimizer``."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def zero_model_state(num_params: float, stage: "ZeroStage | int", n_devices: int, *, param_bytes: float = 2,
                     grad_bytes: float = 2, optimizer_bytes: float = 12) -> ModelState:
    """ZeRO's model-state accounting per device (see the module docstring; defaults: mixed-precision
    Adam, ``2Ψ + 2Ψ + KΨ`` with ``K = 12``). ``zero_model_state(7.5e9, 1, 64).total / 1e9 ≈ 31.4``."""
    stage = ZeroStage(stage)
    nd = float(n_devices)
    psi = float(num_params)
    return ModelState(param_bytes * psi / (nd if stage >= ZeroStage.OS_G_P else 1),
                      grad_bytes * psi / (nd if stage >= ZeroStage.OS_G else 1),
                      optimizer_bytes * psi / (nd if stage >= ZeroStage.OS else 1))
