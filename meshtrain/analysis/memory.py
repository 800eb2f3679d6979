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
from typing import Dict, List, Optional, Tuple

import jax
import numpy as np

from meshtrain.analysis.activations import saved_activations
from meshtrain.analysis.compiled import (ANALYTIC, COMPILED, MeasuredMemory, ProgramCost, default_loss,  # noqa: F401
                                         has_analytic_model, local_rows, program_cost, working_weight_bytes)
from meshtrain.analysis.comms import batch_dims
from meshtrain.analysis.layout import cached, layout_of
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


def estimate_memory(plan, cfg=None, *, loss_fn=None, cost: Optional[ProgramCost] = None,
                    backend=None) -> MemoryEstimate:
    """Per-device memory of ``make_train_step(plan, loss_fn=loss_fn)``.

    A decoder ``cfg`` (``DecoderConfig``) uses the analytic formulas (``plan`` may live on an
    ``AbstractMesh``). Any other ``cfg`` (or ``None``: a user model) is measured on the step's program
    with ``loss_fn`` (default: the built-in loss of a built-in config), see the module docstring;
    ``cost`` reuses a :func:`~meshtrain.analysis.compiled.program_cost` already computed.
    ``backend``: whose buffer choices to model (``"tpu"``, ``"gpu"``, ``"cpu"`` or a
    :class:`~meshtrain.analysis.comms.Backend`); default: the platform of the plan's devices on a
    ``Mesh``, XLA:CPU's on an ``AbstractMesh`` (see "XLA:TPU" in the module docstring).
    """
    if plan.batch is None:
        raise ValueError("estimate_memory needs a plan with a batch: make_plan(..., batch=BatchSpec(B, T))")
    if not has_analytic_model(cfg):
        return program_memory(plan, loss_fn or default_loss(cfg, plan), cost=cost)
    lay = layout_of(plan)
    B, T = batch_dims(plan)
    split = lay.split()
    per = plan.per_device_bytes()
    elems, total_param_bytes, stage_w = cached(plan, "param_elements", _param_elements, layout_only=True)
    pipe = pipeline_shape(plan)
    moe = moe_terms(plan, cfg)
    acfg = moe.activation_config(cfg) if moe is not None else cfg  # MoE: the dense-equivalent MLP width
    weight_fraction = 0.0
    if lay.compute_dtype != lay.param_dtype and total_param_bytes:
        weight_fraction = per["params"] / total_param_bytes
    attention = plan.recipe.attention
    remat = plan.recipe.remat
    L = cfg.n_layers
    model = saved_activations(remat, lay.compute_dtype, cfg.tie_embeddings, attention)
    none = saved_activations(Remat.NONE, lay.compute_dtype, cfg.tie_embeddings, attention)
    moe_saved = moe.saved_extra_per_layer if moe is not None and remat is not Remat.FULL else 0
    layer_saved = model.layer_bytes_per_device(acfg, B, T, split) + moe_saved
    tensors = model.bytes_per_device(acfg, B, T, split) + L * moe_saved
    wcfg = moe.weight_config(cfg) if moe is not None else cfg  # MoE: every expert's weights are cast
    casts = model.bytes_per_device(wcfg, B, T, split, weight_fraction=weight_fraction) - \
        model.bytes_per_device(wcfg, B, T, split)  # compute-dtype copies of the weights the backward keeps
    layer = none.layer_bytes_per_device(acfg, B, T, split)
    if moe is not None:
        layer += moe.saved_extra_per_layer + moe.gathered_per_layer
    b_loc = B // (split.batch * split.micro_batches)
    c = np.dtype(lay.compute_dtype).itemsize
    t_loc = T // max(lay.context, lay.sequence, 1)
    grads = gradient_bytes(plan)
    extra_temp, logits_rows, acc = 0, b_loc, ""
    tpu = pipe is None and backend_name(plan, backend) == "tpu" and c < np.dtype(lay.param_dtype).itemsize
    if tpu:
        # XLA:TPU fuses f32 upcasts into their consumers: it keeps the backward's compute-dtype gradients
        # (upcast in the reduction and optimizer update), the compute-dtype logits (upcast in the softmax)
        # and no f32 copy of the residual stream (upcast in the norms); it keeps the saved residual stream of
        # the layers twice (the backward loop reads a copy of the forward loop's stack)
        grads = gradient_bytes(plan, itemsize=c)
        btd = dict(dims=("B", "T", "d"))
        tensors += (model.tensor_bytes_per_device(acfg, B, T, split, dtype=lay.compute_dtype, stacked=True, **btd)
                    - model.tensor_bytes_per_device(acfg, B, T, split) * (4 - c) // 4
                    - model.tensor_bytes_per_device(acfg, B, T, split, **btd))
        layer -= none.tensor_bytes_per_device(acfg, B, T, split, per_layer=True, **btd)
    # the layer loop the step runs (scan_layers resolves `auto` with the same function)
    loop, unroll = resolve_layer_loop(plan.recipe.layer_loop, L, remat, plan.recipe.scan_unroll)
    straight = pipe is None and not tpu and unroll >= L  # unrolled (or unroll ≥ L): straight-line layers
    w_layers = 0
    if straight:
        # Unrolled, XLA schedules across layers (measured on XLA:CPU, tests/test_analysis_small.py):
        # * a remat policy saves nothing (the recomputation is scheduled early and kept alive): the residuals
        #   are remat=none's, less the loop constants (the T² attention mask, fused into each consumer);
        # * each layer's weights as multiplied stay live from its forward to its backward (slices of the
        #   stacked parameters; under FSDP the full-size partial weight gradients, which XLA:CPU's merged
        #   all-reduce keeps until the end of the backward): L·W_layer·c;
        # * no separate working set: a layer's backward reuses its own residuals' memory; and the gradients
        #   grow as the residuals die, so only the part of them beyond the residuals adds.
        moe_none = moe.saved_extra_per_layer if moe is not None else 0
        acts = (none.bytes_per_device(acfg, B, T, split) + L * moe_none
                - none.loop_constant_bytes_per_device(acfg, B, T, split))
        w_layers = working_weight_bytes(plan, layers_only=True)[0]
        grads = max(grads - acts, 0)
        layer = w_layers
        if lay.micro_batches > 1:
            grads += 4 * elems
            acc = " + f32 accumulator 4 B × elements per device (micro-batches)"
    elif pipe is None:
        acts = tensors + casts
        if remat is not Remat.NONE and not tpu:
            # the body's backward holds the recomputed residuals (one layer with remat=none) *and* the layer's
            # weight gradient as multiplied (full size before its reduction; measured on XLA:CPU: without it
            # remat=full is 10–15 % under); with remat=none the residuals are already in the activations
            w_layers = working_weight_bytes(plan, layers_only=True)[0] // max(L, 1)
            layer += w_layers
        layer *= unroll  # scan_unroll = k: the loop body's backward holds k layers' working sets
        if lay.micro_batches > 1:
            grads += 4 * elems
            acc = " + f32 accumulator 4 B × elements per device (micro-batches)"
    else:
        m, p = pipe.micro_batches, pipe.stages
        x = b_loc * t_loc * cfg.d_model * c  # one micro-batch's stage input on one device
        rest = tensors - L * layer_saved  # embedding output, final norm, logits: outside the stack
        stack = pipe.stage_activation_bytes(L, layer_saved, x)
        if pipe.one_f_one_b:
            acts = stack + rest + m * x + casts  # stash + one micro-batch's head + the embedding outputs
            # a stage's VJP + the f32 input cotangents + the tick's f32 weight gradient and the new accumulator
            extra_temp = (L // p) * layer_saved + 4 * m * x // c + 2 * 4 * stage_w
            if 4 * elems > grads:
                grads, acc = 4 * elems, " (1f1b: f32 accumulators, 4 B × elements per device)"
        else:
            # head on the whole batch + the ring of stage outputs; each tick also keeps the layer group it
            # indexed (a residual of the tick loop, measured on XLA:CPU)
            acts = stack + m * (rest + x) + casts + pipe.ticks * stage_w * c / pipe.repeats
            logits_rows = b_loc * m
    vocab_split = lay.size(lay.vocab_axes)
    logits_grad = 4 * logits_rows * (T // lay.context) * cfg.vocab_size // vocab_split
    blocks = attention_working_set(plan, cfg, b_loc)
    comps = ((Component.PARAMS, per["params"]), (Component.GRADIENTS, grads), (Component.OPTIMIZER, per["optimizer"]),
             (Component.ACTIVATIONS, int(acts)),
             (Component.TEMPORARIES, int((max(layer + blocks, logits_grad) if tpu else layer + logits_grad + blocks)
                                         + extra_temp)),
             (Component.BATCH, per["batch"]))
    act_formula = (f"saved tensors under remat={remat.value}, {lay.compute_dtype}, b={b_loc} per device "
                   f"per micro-batch, ÷{lay.tensor} on heads/MLP/vocab, ÷{lay.sequence} on (b,t,d)"
                   + (f", ÷{lay.context} on the sequence (context, attention {attention.value})"
                      if lay.context > 1 else ""))
    temp_formula = ((f"{unroll} layers (scan_unroll) " if unroll > 1 and not straight else "one layer ")
                    + "with remat=none (backward working set)"
                    + (f" + its weight gradient as multiplied W_layer·c = {w_layers:,} B (remat: recomputed "
                       "residuals and weight gradient together)" if w_layers and not straight else "")
                    + " + f32 logits gradient 4·b·T·V/t"
                    + (" + attention score blocks 4 × 4 B·b·n·bq·bk (blockwise kernels)" if blocks else ""))
    grad_formula = "= parameters (same shardings and dtype)"
    if straight:
        act_formula = (f"layers unrolled ({loop.value}): saved tensors under remat=none (XLA keeps the "
                       f"recomputation of any remat policy alive), less the T² loop constants; " + act_formula)
        temp_formula = (f"the {L} layers' weights as multiplied L·W_layer·c = {w_layers:,} B (kept from each "
                        "layer's forward to its backward: slices of the stacked parameters, or under FSDP the "
                        "full-size weight gradients until the merged all-reduce) + f32 logits gradient 4·b·T·V/t"
                        + (" + attention score blocks 4 × 4 B·b·n·bq·bk (blockwise kernels)" if blocks else ""))
        grad_formula = ("the part of the gradients (= parameters) beyond the saved activations: unrolled, each "
                        "layer's gradient is made as its residuals die")
    params_formula = "Σ parameter leaves: elements × dtype bytes ÷ shards (plan)"
    if tpu:
        temp_formula = ("max(one layer with remat=none (backward working set), f32 logits gradient 4·b·T·V/t): "
                        "XLA:TPU finishes the head's backward before the layers'"
                        + (" + attention score blocks 4 × 4 B·b·n·bq·bk" if blocks else ""))
        act_formula += "; XLA:TPU: logits in the compute dtype, no f32 copy of the residual stream"
    if moe is not None:
        params_formula += (f"; expert weights {moe.expert_bytes_per_device:,} B per device of "
                           f"{moe.expert_bytes_total:,} (÷{moe.ep} expert-parallel and the other shardings)")
        act_formula += (f"; MoE: MLP width → rows·f_e + shared = {moe.d_ff_equivalent} ({moe.rows:.3g} expert rows "
                        f"per token), + dispatched rows, expert outputs and f32 router logits/probabilities "
                        f"{moe.saved_extra_per_layer:,} B per layer")
        temp_formula += (" + the layer's MoE buffers" + (f" + its expert weights gathered over FSDP and their "
                                                          f"gradient {moe.gathered_per_layer:,} B"
                                                          if moe.gathered_per_layer else ""))
    if pipe is not None:
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
    formulas = (
        (Component.PARAMS, params_formula),
        (Component.GRADIENTS, ("elements per device × compute-dtype bytes (XLA:TPU upcasts in the reduction and "
                               "optimizer update)" if tpu else grad_formula) + acc),
        (Component.OPTIMIZER, "Σ optimizer-state leaves ÷ shards (plan)"),
        (Component.ACTIVATIONS, act_formula),
        (Component.TEMPORARIES, temp_formula),
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
    bq, bk, heads = attention_block_shape(plan_layout(plan), batch_dims(plan)[1], max(cfg.n_heads // lay.tensor, 1),
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
