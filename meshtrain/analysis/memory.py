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

Pipelines (``pp`` recipes; :class:`meshtrain.analysis.pipeline.PipelineShape`, ``p`` stages, ``m``
micro-batches, ``x = b·T·d·c`` one micro-batch's stage input, ``a`` one layer's saved activations):

* gpipe / circular: ``ticks·L/(p·r)·a`` (every tick's residuals) + ``m ×`` (what lies outside the
  stack + the ring of stage outputs ``x``) + ``ticks·W_stage·c/r`` (the layer group each tick
  indexes, kept for the backward; measured on XLA:CPU; only with repeats > 1: one group per stage is a static
  index, no copy); gradients ``P`` (no accumulation loop);
  the logits gradient over the whole per-device batch (the head runs after the schedule);
* 1f1b: a ``2p``-slot stash of ``x`` + one micro-batch outside the stack + ``m`` embedding outputs;
  the working set adds one stage's VJP ``(L/p)·a``, the f32 input cotangents ``4·m·x/c`` and the tick's
  f32 weight gradient and accumulator ``2·4 B·W_stage``; gradients are f32 accumulators (4 B per
  element).

XLA:TPU (``backend="tpu"``, or a plan on TPU devices; non-pipeline steps whose compute dtype is narrower
than the parameters'): XLA:TPU fuses f32 upcasts into their consumers, so

* gradients take the compute dtype (``c`` bytes per element at the gradient's sharding): the backward's
  bf16 gradients are reduced and upcast inside the optimizer update, never stored in f32;
* the saved logits are the compute-dtype ones (not the f32 upcast), and no f32 copy of the residual
  stream ``(b, T, d)`` is saved or kept in a layer's working set (the norms upcast on the fly);
* the saved residual stream of the layers is counted twice (the backward loop reads a copy of the
  forward loop's stack: ≈ ``b·T·d·c`` per layer more than the traced residuals, measured at 4 and 32 layers);
* temporaries are ``max(one layer's working set, f32 logits gradient)``: the head's backward (and its
  optimizer update) finishes before the layers' backward starts;
* the ``T²`` loop constants (the dense mask) are fused into their consumers, never stored;
* with ``remat=none`` a layer's working set is its largest cotangent (its largest saved tensor in the compute
  dtype: everything else is saved already), and with the layers unrolled one layer's backward runs at a time
  (one working set, not ``scan_unroll`` of them);
* around the splash kernel (local ``flash`` on a TPU, or ``ulysses`` asking for splash) every activation's
  minor dimension takes whole 128-lane tiles: a ``(b, T, heads, 16)`` tensor takes the room of
  ``(b, T, heads, 128)`` (dense and blockwise-XLA attention lay a long dimension minor: no padding).
  Measured against libtpu at ``small`` (head_dim 16) 16 × 1024: BENCHMARKS.md, "Compiler check".

XLA:GPU (``backend="gpu"``, or a plan on GPU devices; layers unrolled, no pipeline or MoE, compute dtype narrower
than the parameters'): the unrolled formulas above, with what XLA:GPU's fusions keep instead of JAX's residuals
(measured from the buffer assignment of the compiled step for 8 H100s):

* no f32 copy of the residual stream ``(b, T, d)`` (the norms upcast inside their fusions), but each norm's
  output in the compute dtype (``(2·L + 1)·b·T·d·c``: it is the next matmul's operand);
* of the MLP's ``(b, T, f)`` residuals only the matmuls' operands and results, one per MLP-width weight matrix
  (gate and up projections and the down projection's input; the activation's intermediates are recomputed);
* the backward's first layer holds its largest cotangent in f32 and the compute dtype, ``(4 + c)·a_max`` (dense
  attention: the ``T²`` score gradient before and after the softmax) next to every layer's residuals;
* cuDNN's fused attention (``--attention flash``, or ulysses asking for cudnn; packed documents on Hopper or
  newer): no score blocks in HBM, and K/V saved at the query heads (``L·2·b·T·(n − kv)·h·c`` more than the traced
  blockwise kernel); on a packed batch also its f32 softmax statistics per document slot, ``4·b·M·n·T`` a
  layer (``M`` = ``flash.CUDNN_MAX_SEGMENTS``);
* the blockwise context kernels (ring, all_gather, usp; ulysses without cuDNN), whose backward starts each layer's
  f32 accumulators ``dq`` (``b·t·n·h``, the local queries) and ``dk``/``dv`` (``b·s·kv·h``, the keys the kernel
  attends over: ``s = T`` all-gathered, ``t`` on a ring, ``u·t`` after Ulysses' all-to-all) from zeros: XLA:GPU
  fuses every layer's zeros into one fusion at the step's start, so all ``L`` layers' sets are live at the first
  layer's backward, ``L·k·4·(b·t·n·h + 2·b·s·kv·h)`` (``k = 2`` on a ring: its own block's visit and the ring
  loop's, whose first iteration is peeled out of the ``ppermute`` loop; else 1); and each kernel's f32 output
  stays saved next to its cast (the backward's ``delta`` reads it), ``(L − 1)·4·b·t·n·h`` (the first backward
  layer's ``delta`` is made before the peak, inside its kernel's loop).

Against XLA:GPU at ``small`` 16 × 1024: BENCHMARKS.md, "Compiler check: the planner against XLA:GPU".

XLA:GPU with the layers scanned (no pipeline or MoE, compute dtype narrower than the parameters'; any remat policy;
read off the buffer assignments of Llama-3-8B at 32 and 4 layers on 1xH200 and 8xH100 and of ``small``): the scan
formulas above, except that

* the backward scan stacks each layer's gradient in the compute dtype (``c`` bytes per element at the gradient's
  sharding; the optimizer update upcasts), next to the compute-dtype weight casts the forward made; an untied
  embedding table's gradient is made after the layers' backward, once the casts are freed, and is not counted;
* the head's backward (the saved f32 logits and their f32 gradient, ``2·4·b·T·V/t``) finishes before the layers'
  backward allocates the gradient stacks: the two phases are alternatives, the larger counts;
* a layer's backward holds its largest cotangent in f32 and the compute dtype, ``(4 + c)·a_max``, as unrolled.

XLA:GPU with a pipeline (no MoE, compute dtype narrower than the parameters'; read off the buffer assignments of
``small`` pp gpipe, pp_fsdp circular and pp_fsdp 1f1b on 8xH100): the pipeline formulas above, except that the
forward loop writes its largest stack (dense: the layers' f32 softmax exponentials) in another layout than the
backward loop reads, and the transpose between them makes a second copy, live next to the first: gpipe and circular
``ticks·L/(p·r)·4·a_max`` at the transpose after the forward tick loop (the peak), 1f1b ``L/p·4·a_max`` in a tick's
stage VJP, whose layer backward (the peak) holds, instead of one layer's remat=none working set, the layer's
largest tensor in f32 with its two f32 cotangents and one in the compute dtype, ``(3·4 + c)·a_max``; and the dense
mask, fused into each consumer, keeps no buffer (less the ``T²`` loop constants of the micro-batches outside the
stack: ``m``, 1f1b one).

The CPU formulas apply otherwise (``backend`` ``"cpu"``, or an ``AbstractMesh`` with no backend given).

How close these formulas come to XLA's own figures, recipe by recipe, and how that changed:
BENCHMARKS.md, "Memory model against XLA". Each component is a sum of named terms
(:mod:`meshtrain.analysis.memory_terms`; ``est.terms``, and the plan's memory table lists them).

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
* on an ``AbstractMesh`` (more devices than exist), from the traced program; each formula starts with how
  its figure was obtained: *exact (plan)*: parameters, optimizer state, batch and model state, gradients ``P``
  (as above); *measured (traced program)*: activations = the loss VJP's residuals at one device's
  micro-batch, each once, less those the backward never reads and those XLA recomputes inside the backward's
  fusions, not the broadcasts a fusible op expands (XLA:CPU keeps those)
  (:func:`~meshtrain.analysis.compiled.saved_activation_bytes`); *extrapolated to the mesh*: those
  residuals divided by the tensor size where they have a dimension the plan splits over the tensor axes,
  and temporaries = the weights the step multiplies with where they are not the stored parameters
  (gathered over FSDP axes or cast to the compute dtype: ``Σ E·c ÷ non-batch shards``). Under tensor
  parallelism also the all-reduced sums of matmuls over a tensor-split dimension: those a residual is fused
  from (activations) and what the backward's all-reduce buffers add to its peak (temporaries, liveness of
  the traced backward: :class:`~meshtrain.analysis.compiled.TracedActivations`). XLA's other working
  buffers are not in it. Against a real compile on 16 CPU devices: BENCHMARKS.md, "AbstractMesh
  estimate against a compile" (``tools/bench_plan_any_model.py``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Dict, List, Optional, Tuple

import numpy as np

from meshtrain.analysis.compiled import (ANALYTIC, COMPILED, MeasuredMemory, ProgramCost, default_loss,  # noqa: F401
                                         gathered_layer_bytes, has_analytic_model, local_rows, program_cost,
                                         working_weight_bytes)
from meshtrain.analysis.memory_terms import (BATCH_FORMULA, GRAD_FORMULA, OPTIMIZER_FORMULA, PARAMS_FORMULA,
                                             Component, MemoryTerm, analytic_terms, gradient_bytes)
from meshtrain.analysis.memory_terms import attention_working_set, backend_name  # noqa: F401 (re-export)
from meshtrain.analysis.layout import layout_of
from meshtrain.errors import ConfigError
from meshtrain.parallel.resolved import batch_splits


class Fit(str, enum.Enum):
    """Verdict against a device's memory: ``fits`` (≤ 90 %), ``tight`` (90–100 %: allocator
    fragmentation and runtime buffers may tip it over), ``does not fit`` (> 100 %)."""

    FITS = "fits"
    TIGHT = "tight"
    DOES_NOT_FIT = "does not fit"


TIGHT_FRACTION = 0.9


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes per device by component, each with the formula that produced it, and the named
    terms each component sums (:attr:`terms`: those that are not 0 bytes).

    The terms are kept as plain ``(component, name, bytes, formula)`` tuples of strings and numbers
    (``term_rows``), which the garbage collector stops tracking: the planner keeps an estimate for each of
    thousands of candidates, and tracked objects make every full collection slower."""

    components: Tuple[Tuple[Component, int], ...]
    formulas: Tuple[Tuple[Component, str], ...]
    source: str = ANALYTIC  # or "from the compiled program" / "from the traced program"
    term_rows: Tuple[Tuple[str, str, float, str], ...] = ()

    @property
    def terms(self) -> Tuple[MemoryTerm, ...]:
        return tuple(MemoryTerm(Component(c), name, b, f) for c, name, b, f in self.term_rows)

    @classmethod
    def of_terms(cls, terms: Tuple[MemoryTerm, ...], formulas: Tuple[Tuple[Component, str], ...],
                 source: str = ANALYTIC) -> "MemoryEstimate":
        """Components as the sums of their terms, in the order the terms name them (fractional bytes are
        summed before truncation)."""
        sums: Dict[Component, float] = {}
        for term in terms:
            sums[term.component] = sums.get(term.component, 0) + term.bytes
        return cls(tuple((c, int(b)) for c, b in sums.items()), formulas, source,
                   tuple((t.component.value, t.name, t.bytes, t.formula) for t in terms if t.bytes))

    def terms_of(self, component: Component) -> List[MemoryTerm]:
        return [t for t in self.terms if t.component is Component(component)]

    @property
    def total(self) -> int:
        """Device bytes: every component but :attr:`host`."""
        return sum(b for c, b in self.components if c is not Component.HOST)

    @property
    def host(self) -> int:
        """Bytes per device kept in host memory during the step (``remat=offload``'s activations)."""
        return self[Component.HOST]

    def __getitem__(self, component: Component) -> int:
        return dict(self.components).get(Component(component), 0)  # a component this estimate has not: 0 bytes

    def largest(self, k: int = 3) -> List[Tuple[Component, int]]:
        return sorted((cb for cb in self.components if cb[0] is not Component.HOST), key=lambda cb: -cb[1])[:k]

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
        raise ConfigError("estimate_memory needs a plan with a batch: make_plan(..., batch=BatchSpec(B, T))")
    if not has_analytic_model(cfg):
        return program_memory(plan, loss_fn or default_loss(cfg, plan), cost=cost)
    terms, formulas = analytic_terms(plan, cfg, backend)
    return MemoryEstimate.of_terms(terms, formulas)


def program_memory(plan, loss_fn, *, cost: Optional[ProgramCost] = None) -> MemoryEstimate:
    """Per-device memory of the step of any model, from its compiled or traced program (module docstring)."""
    cost = cost if cost is not None else program_cost(plan, loss_fn)
    per = plan.per_device_bytes()
    state = ((Component.PARAMS, per["params"], PARAMS_FORMULA),
             (Component.OPTIMIZER, per["optimizer"], OPTIMIZER_FORMULA),
             (Component.BATCH, per["batch"], BATCH_FORMULA))
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
        micro = batch_splits(plan.recipe)
        elems = sum(l.bytes_per_device // np.dtype(l.dtype).itemsize for l in plan.group("params"))
        grads = gradient_bytes(plan) + (4 * elems if micro > 1 else 0)
        extra = gathered_layer_bytes(plan, remat=cost.recompute is not None)
        r = plan.recipe
        t = layout_of(plan).tensor
        rows = tuple((c, b, f"{EXACT}: {f}") for c, b, f in state) + (
            (Component.GRADIENTS, grads, f"{EXACT}: " + GRAD_FORMULA
             + (" + f32 accumulator 4 B × elements per device (micro-batches)" if micro > 1 else "")),
            (Component.ACTIVATIONS, cost.activations or 0,
             f"{MEASURED}: loss VJP residuals of one device's b={local_rows(plan)} rows per micro-batch, remat="
             f"{r.remat.value}, {r.compute_dtype}, each once, less those the backward never reads and those XLA "
             f"recomputes in the backward's fusions (not the broadcasts a fusible op expands, which XLA:CPU keeps); "
             f"{EXTRAPOLATED}: ÷{t} (tensor) for residuals with a dimension the plan splits over the tensor axes, "
             f"+ the all-reduced sums (matmuls over a tensor-split dimension) a residual is fused from"
             + ("; context parallelism not applied (an upper bound)" if layout_of(plan).context > 1 else "")),
            (Component.TEMPORARIES, extra + (cost.working_set or 0) + (cost.recompute or 0) + (cost.gradient or 0),
             f"{EXTRAPOLATED}: weights as multiplied where not the stored parameters: gathered over FSDP axes or cast "
             f"to the compute dtype (Σ E·c ÷ non-batch shards"
             + ("; LoRA: the frozen base too, gathered, each target read as a new base + s·A@B"
                if getattr(plan.abstract, "frozen_paths", None) else "")
             + ("; a stacked layer weight, leading logical axis 'layers', one layer's slice: under remat the "
                "backward gathers each layer's slice again" if cost.recompute is not None else "")
             + f"); {EXTRAPOLATED}: + under tensor parallelism the "
             f"backward's all-reduce buffers (one per matmul summing over a tensor-split dimension) live at once "
             f"at its peak, {MEASURED} liveness in program order"
             + (f"; {MEASURED}: + the remat recompute, the residuals of the largest remat segment differentiated "
                f"without its policy (what the backward holds while it recomputes that segment), counted as the "
                f"step's residuals, {EXTRAPOLATED}: ÷{t} (tensor) where split" if cost.recompute else "")
             + (f"; {MEASURED}: + the first weight gradient the backward makes, at full size before its "
                f"reduce-scatter over the data-parallel axes (÷ its non-batch shards)" if cost.gradient else "")
             + "; XLA's other working buffers not included"),
            (Component.OTHER, per.get("model_state", 0) + per.get("base", 0),
             f"{EXACT}: model state" + (" and LoRA's frozen base" if "base" in per else "") + " (plan)"))
    return _of_rows(rows, cost.source)


#: How each figure of an estimate from the traced program (an ``AbstractMesh``) was obtained, as its formula says:
#: from the plan's shardings, traced on one device's rows, or carried over from those to the mesh's sizes.
EXACT = "exact (plan)"
MEASURED = "measured (traced program)"
EXTRAPOLATED = "extrapolated to the mesh"


def _of_rows(rows, source: str) -> MemoryEstimate:
    """An estimate of one term per component from ``(component, bytes, formula)`` rows."""
    return MemoryEstimate.of_terms(tuple(MemoryTerm(c, c.value, int(b), f) for c, b, f in rows),
                                   tuple((c, f) for c, _, f in rows), source)


#: ``MemoryEstimate.source`` of :func:`state_memory`.
STATE_ONLY = "state only (no loss: activations and temporaries unknown)"


def state_memory(plan) -> MemoryEstimate:
    """Parameters, gradients (``P``), optimizer state, batch and model state per device, from the plan
    alone: what is known without a loss function (a lower bound on the step's memory)."""
    per = plan.per_device_bytes()
    rows = ((Component.PARAMS, per["params"], PARAMS_FORMULA),
            (Component.GRADIENTS, gradient_bytes(plan), GRAD_FORMULA),
            (Component.OPTIMIZER, per["optimizer"], OPTIMIZER_FORMULA),
            (Component.BATCH, per["batch"], BATCH_FORMULA),
            (Component.OTHER, per.get("model_state", 0) + per.get("base", 0), "model state (plan)"))
    return _of_rows(rows, STATE_ONLY)


class ZeroPartitioning(int, enum.Enum):
    """The ZeRO paper's partitioning levels (Rajbhandari et al. 2020, P_os / P_os+g / P_os+g+p): what is
    partitioned over the ``N_d`` data-parallel devices, ``DP`` for nothing. Not the ``zero`` strategy's
    :class:`meshtrain.strategies.ZeroStage` (1 or 2): ``OS_G_P`` is what FSDP does."""

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


def zero_model_state(num_params: float, stage: "ZeroPartitioning | int", n_devices: int, *, param_bytes: float = 2,
                     grad_bytes: float = 2, optimizer_bytes: float = 12) -> ModelState:
    """ZeRO's model-state accounting per device (see the module docstring; defaults: mixed-precision
    Adam, ``2Ψ + 2Ψ + KΨ`` with ``K = 12``). ``zero_model_state(7.5e9, 1, 64).total / 1e9 ≈ 31.4``."""
    stage = ZeroPartitioning(stage)
    nd = float(n_devices)
    psi = float(num_params)
    return ModelState(param_bytes * psi / (nd if stage >= ZeroPartitioning.OS_G_P else 1),
                      grad_bytes * psi / (nd if stage >= ZeroPartitioning.OS_G else 1),
                      optimizer_bytes * psi / (nd if stage >= ZeroPartitioning.OS else 1))
