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
from typing import Dict, List, Optional, Tuple

import jax
import numpy as np

from meshtrain.analysis.activations import saved_activations
from meshtrain.analysis.compiled import (ANALYTIC, COMPILED, MeasuredMemory, ProgramCost, default_loss,  # noqa: F401
                                         has_analytic_model, local_rows, program_cost, working_weight_bytes)
from meshtrain.analysis.layout import layout_of
from meshtrain.parallel.context import attention_block_shape, plan_layout
from meshtrain.recipes import AttentionKind, Remat
from meshtrain.train.step import gradient_shardings


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
class MemoryEstimate:
    """Estimated bytes per device by component, each with the formula that produced it."""

    components: Tuple[Tuple[Component, int], ...]
    formulas: Tuple[Tuple[Component, str], ...]
    source: str = ANALYTIC  # or "from the compiled program" / "from the traced program"

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
                "components": {c.value: {"bytes": b, "formula": f.get(c, "")} for c, b in self.components}}


def estimate_memory(plan, cfg=None, *, loss_fn=None, cost: Optional[ProgramCost] = None) -> MemoryEstimate:
    """Per-device memory of ``make_train_step(plan, loss_fn=loss_fn)``.

    A decoder ``cfg`` (``DecoderConfig``) uses the analytic formulas (``plan`` may live on an
    ``AbstractMesh``). Any other ``cfg`` (or ``None``: a user model) is measured on the step's program
    with ``loss_fn`` (default: the built-in loss of a built-in config), see the module docstring;
    ``cost`` reuses a :func:`~meshtrain.analysis.compiled.program_cost` already computed.
    """
    if plan.batch is None:
        raise ValueError("estimate_memory needs a plan with a batch: make_plan(..., batch=BatchSpec(B, T))")
    if not has_analytic_model(cfg):
        return program_memory(plan, loss_fn or default_loss(cfg, plan), cost=cost)
    lay = layout_of(plan)
    B, T = plan.batch.batch_size, plan.batch.seq_len
    split = lay.split()
    per = plan.per_device_bytes()
    params = plan.group("params")
    elems = sum(l.bytes_per_device // np.dtype(l.dtype).itemsize for l in params)
    grads = gradient_bytes(plan) + (4 * elems if lay.micro_batches > 1 else 0)
    weight_fraction = 0.0
    total_param_bytes = sum(l.bytes_total for l in params)
    if lay.compute_dtype != lay.param_dtype and total_param_bytes:
        weight_fraction = per["params"] / total_param_bytes
    attention = plan.recipe.attention
    model = saved_activations(plan.recipe.remat, lay.compute_dtype, cfg.tie_embeddings, attention)
    acts = model.bytes_per_device(cfg, B, T, split, weight_fraction=weight_fraction)
    none = saved_activations(Remat.NONE, lay.compute_dtype, cfg.tie_embeddings, attention)
    layer = none.layer_bytes_per_device(cfg, B, T, split)
    b_loc = B // (split.batch * split.micro_batches)
    vocab_split = lay.size(lay.vocab_axes)
    logits_grad = 4 * b_loc * (T // lay.context) * cfg.vocab_size // vocab_split
    blocks = attention_working_set(plan, cfg, b_loc)
    comps = ((Component.PARAMS, per["params"]), (Component.GRADIENTS, grads), (Component.OPTIMIZER, per["optimizer"]),
             (Component.ACTIVATIONS, acts), (Component.TEMPORARIES, layer + logits_grad + blocks),
             (Component.BATCH, per["batch"]))
    remat = plan.recipe.remat.value
    formulas = (
        (Component.PARAMS, "Σ parameter leaves: elements × dtype bytes ÷ shards (plan)"),
        (Component.GRADIENTS, "= parameters (same shardings and dtype)"
         + (" + f32 accumulator 4 B × elements per device (micro-batches)" if lay.micro_batches > 1 else "")),
        (Component.OPTIMIZER, "Σ optimizer-state leaves ÷ shards (plan)"),
        (Component.ACTIVATIONS, f"saved tensors under remat={remat}, {lay.compute_dtype}, b={b_loc} per device "
                                f"per micro-batch, ÷{lay.tensor} on heads/MLP/vocab, ÷{lay.sequence} on (b,t,d)"
                                + (f", ÷{lay.context} on the sequence (context, attention {attention.value})"
                                   if lay.context > 1 else "")),
        (Component.TEMPORARIES, "one layer with remat=none (backward working set) + f32 logits gradient 4·b·T·V/t"
                                + (" + attention score blocks 4 × 4 B·b·n·bq·bk (blockwise kernels)" if blocks else "")),
        (Component.BATCH, "input arrays (plan)"),
    )
    return MemoryEstimate(comps, formulas)


def attention_working_set(plan, cfg, b_loc: int) -> int:
    """Bytes of the score blocks a blockwise attention kind keeps live in the backward (scores,
    probabilities, their gradient and ``dp``: 4 f32 blocks of ``b × heads × bq × bk``); 0 for ``dense``
    (its ``T × T`` scores are in the activations)."""
    if plan.recipe.attention is AttentionKind.DENSE:
        return 0
    lay = layout_of(plan)
    bq, bk, heads = attention_block_shape(plan_layout(plan), plan.batch.seq_len, max(cfg.n_heads // lay.tensor, 1),
                                          b_loc)
    return 4 * 4 * b_loc * heads * bq * bk


def program_memory(plan, loss_fn, *, cost: Optional[ProgramCost] = None) -> MemoryEstimate:
    """Per-device memory of the step of any model, from its compiled or traced program (module docstring)."""
    cost = cost if cost is not None else program_cost(plan, loss_fn)
    per = plan.per_device_bytes()
    state = ((Component.PARAMS, per["params"], "Σ parameter leaves: elements × dtype bytes ÷ shards (plan)"),
             (Component.OPTIMIZER, per["optimizer"], "Σ optimizer-state leaves ÷ shards (plan)"),
             (Component.BATCH, per["batch"], "input arrays (plan)"))
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
    return MemoryEstimate(tuple((c, int(b)) for c, b, _ in rows), tuple((c, f) for c, _, f in rows), cost.source)


_GRAD_FORMULA = ("Σ parameter elements × dtype bytes ÷ the shards of the gradient's sharding (the parameter's; "
                 "the optimizer state's under zero2)")


def gradient_bytes(plan) -> int:
    """Gradient bytes per device: each parameter's bytes divided by the shards of the sharding the step
    keeps its gradient in (:func:`meshtrain.train.step.gradient_shardings`: the parameter's own, or its
    optimizer state's under ``zero2``)."""
    sizes = plan.mesh_sizes
    total = 0
    for sharding, leaf in zip(jax.tree.leaves(gradient_shardings(plan)), jax.tree.leaves(plan.abstract.params)):
        shards = 1
        for entry in sharding.spec:
            for axis in (entry if isinstance(entry, tuple) else (entry,)):
                shards *= sizes.get(axis, 1) if axis else 1
        total += int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize // shards
    return total


#: ``MemoryEstimate.source`` of :func:`state_memory`.
STATE_ONLY = "state only (no loss: activations and temporaries unknown)"


def state_memory(plan) -> MemoryEstimate:
    """Parameters, gradients (``P``), optimizer state, batch and model state per device, from the plan
    alone: what is known without a loss function (a lower bound on the step's memory)."""
    per = plan.per_device_bytes()
    rows = ((Component.PARAMS, per["params"], "Σ parameter leaves: elements × dtype bytes ÷ shards (plan)"),
            (Component.GRADIENTS, gradient_bytes(plan), _GRAD_FORMULA),
            (Component.OPTIMIZER, per["optimizer"], "Σ optimizer-state leaves ÷ shards (plan)"),
            (Component.BATCH, per["batch"], "input arrays (plan)"),
            (Component.OTHER, per.get("model_state", 0), "model state (plan)"))
    return MemoryEstimate(tuple((c, int(b)) for c, b, _ in rows), tuple((c, f) for c, _, f in rows), STATE_ONLY)


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
