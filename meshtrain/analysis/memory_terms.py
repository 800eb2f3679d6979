"""The analytic memory model of a decoder's train step as named terms: each component (parameters,
gradients, optimizer state, activations, temporaries, batch) is a sum of :class:`MemoryTerm`\\ s, each with
its bytes per device and its formula; :func:`meshtrain.analysis.memory.estimate_memory` adds them up.

Example::

    shape = step_shape(plan, cfg)                 # what the terms read: layout, batch, loop, pipeline, MoE
    temporary_terms(shape)                        # (MemoryTerm(TEMPORARIES, "one layer's working set", ...), ...)

The formulas, and what they model, are in :mod:`meshtrain.analysis.memory`'s docstring.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, Optional, Tuple

import jax
import numpy as np

from meshtrain.abstract import path_str
from meshtrain.analysis.activations import saved_activations
from meshtrain.analysis.compiled import working_weight_bytes
from meshtrain.analysis.comms import batch_dims
from meshtrain.analysis.layout import PlanLayout, cached, layout_of, per_device_bytes, resolved_step
from meshtrain.analysis.memory_gpu import (context_kernel_shape, cudnn_packed_terms, gpu_activation_terms,
                                          gpu_context_accumulator_terms, gpu_context_output_terms,
                                          gpu_one_f_one_b_terms, gpu_pipeline_activation_terms,
                                          gpu_scan_activation_terms, largest_cotangent)
from meshtrain.analysis.memory_types import Component, MemoryTerm
from meshtrain.analysis.moe import moe_terms
from meshtrain.analysis.pipeline import pipeline_shape
from meshtrain.parallel.context import attention_block_shape, plan_layout
from meshtrain.parallel.resolved import Target
from meshtrain.plan import gradient_shardings
from meshtrain.recipes import AttentionKind, Remat, Schedule
from meshtrain.remat_policies import parse_offload_names
from meshtrain.strategies import FlashBackend


def analytic_terms(plan, cfg, backend=None) -> Tuple[Tuple[MemoryTerm, ...], Tuple[Tuple[Component, str], ...]]:
    """``(terms, each component's formula)`` of a decoder ``cfg``'s step under ``plan`` (``backend``: see
    :func:`meshtrain.analysis.memory.estimate_memory`)."""
    s = step_shape(plan, cfg, backend)
    acts = activation_terms(s)
    terms = (state_term(Component.PARAMS, "parameters", s.per["params"], _params_formula(s))
             + gradient_terms(s, int(_total(acts)))
             + state_term(Component.OPTIMIZER, "optimizer state", s.per["optimizer"], OPTIMIZER_FORMULA)
             + acts + temporary_terms(s)
             + state_term(Component.BATCH, "batch", s.per["batch"], BATCH_FORMULA))
    host = host_terms(s)  # remat=offload only: other plans keep their components (and golden dumps) as they were
    return terms + host, component_formulas(s) + (((Component.HOST, HOST_FORMULA),) if host else ())


HOST_FORMULA = ("activations remat=offload saves to pinned host memory and copies back in the backward pass "
                "(the recipe's offload_activations; not in the device's total)")


def host_terms(s: "StepShape") -> Tuple[MemoryTerm, ...]:
    """The saved tensors the remat policy keeps in host memory (``Remat.OFFLOAD``), per device's share."""
    host = s.model.host_bytes_per_device(s.acfg, s.B, s.T, s.split) if not s.straight else 0
    return (MemoryTerm(Component.HOST, "offloaded activations", host, "the named activations of every layer: "
                       + s.plan.recipe.offload_activations),) if host else ()


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What the memory terms of one plan and decoder read: the layout, the per-device batch, the activation
    models, the layer loop, the pipeline and MoE shapes (``L`` layers, ``c`` compute-dtype bytes, ``b_loc``
    sequences per device per micro-batch, ``t_loc`` their length per device)."""

    plan: Any
    cfg: Any
    lay: PlanLayout
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
    #: XLA:GPU with the layers unrolled (the calibrated case: ``straight``, compute dtype narrower than the
    #: parameters'), and whether its attention (unrolled or scanned) is cuDNN's fused kernel
    gpu: bool = False
    cudnn: bool = False
    #: XLA:GPU with the layers scanned (no pipeline or MoE, compute dtype narrower than the parameters'): the
    #: backward scan stacks the layers' gradients in the compute dtype, and the head's backward (the f32 logits
    #: and their gradient) finishes before the layers' starts
    gpu_scan: bool = False
    #: XLA:GPU with a pipeline schedule (no MoE, compute dtype narrower than the parameters'): gpipe and circular
    #: transpose their largest stack between the forward and backward tick loops; the dense mask keeps no buffer
    gpu_pipeline: bool = False
    #: the step the plan compiles for this backend (:func:`meshtrain.parallel.resolved.resolve_step`)
    resolved: Any = None

    @property
    def split(self):
        return self.lay.split()

    @property
    def remat(self) -> Remat:
        return self.plan.recipe.remat

    @functools.cached_property
    def moe_saved(self) -> int:
        """What an MoE layer saves besides its MLP-width tensors (none with ``remat=full``)."""
        return self.moe.saved_extra_per_layer if self.moe is not None and self.remat is not Remat.FULL else 0

    @functools.cached_property
    def layer_saved(self) -> int:
        """One layer's saved activations under the recipe's remat policy."""
        return self.model.layer_bytes_per_device(self.acfg, self.B, self.T, self.split) + self.moe_saved

    @functools.cached_property
    def tensors(self) -> int:
        """All saved tensors under the recipe's remat policy (MoE extras included)."""
        return self.model.bytes_per_device(self.acfg, self.B, self.T, self.split) + self.L * self.moe_saved

    @functools.cached_property
    def casts(self) -> int:
        """Compute-dtype copies of the weights the backward keeps (every expert's weights are cast)."""
        B, T, split = self.B, self.T, self.split
        return (self.model.bytes_per_device(self.wcfg, B, T, split, weight_fraction=self.weight_fraction)
                - self.model.bytes_per_device(self.wcfg, B, T, split))

    @functools.cached_property
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
        """Bytes of blockwise attention's score blocks (:func:`attention_working_set`); none for cuDNN's fused
        kernel (its blocks stay in on-chip memory)."""
        return 0 if self.cudnn else attention_working_set(self.plan, self.cfg, self.b_loc)

    @functools.cached_property
    def f32_logits(self) -> int:
        """The saved f32 logits ``(b, T, V)`` on one device for one micro-batch."""
        return self.model.tensor_bytes_per_device(self.acfg, self.B, self.T, self.split)

    @functools.cached_property
    def compute_gradients(self) -> int:
        """The gradients in the compute dtype at their shardings."""
        return gradient_bytes(self.plan, itemsize=self.c)

    @functools.cached_property
    def lookup_gradient(self) -> int:
        """The compute-dtype gradient of an embedding table used only for the lookup (untied): the backward
        makes it last, after the layers'."""
        return 0 if self.cfg.tie_embeddings else gradient_bytes(self.plan, itemsize=self.c, axes=LOOKUP_TABLE_AXES)

    @property
    def layer_phase_gradients(self) -> int:
        """The gradients XLA:GPU holds while the layers' backward scan runs (all but the lookup table's)."""
        return self.compute_gradients - self.lookup_gradient

    @property
    def tpu_unrolled(self) -> bool:
        """XLA:TPU with the layers unrolled (``scan_unroll ≥ L``): one layer's backward at a time."""
        return self.tpu and self.unroll >= self.L

    @property
    def accumulates(self) -> bool:
        """An f32 gradient accumulator over micro-batches (not pipelines: their schedule accumulates)."""
        return self.pipe is None and self.lay.micro_batches > 1


#: XLA:TPU tiles an array's minor dimension in 128 lanes (:func:`saved_activations`' ``lanes``)
TPU_LANES = 128


def step_shape(plan, cfg, backend=None) -> StepShape:
    lay = layout_of(plan)
    B, T = batch_dims(plan)
    split = lay.split()
    per = per_device_bytes(plan)
    elems, total_param_bytes, stage_w = cached(plan, "param_elements", _param_elements, layout_only=True)
    pipe = pipeline_shape(plan)
    moe = moe_terms(plan, cfg)
    weight_fraction = 0.0
    if lay.compute_dtype != lay.param_dtype and total_param_bytes:
        weight_fraction = per["params"] / total_param_bytes
    # the one decision of the step (kernel, loop) that the kernels and the plan's kernel line also read
    step = resolved_step(plan, backend if isinstance(backend, Target) else backend_name(plan, backend))
    attention, remat = step.attention.kind, step.remat
    c = np.dtype(lay.compute_dtype).itemsize
    # XLA:TPU's buffer choices, pipelines included (measured: pp/pp_fsdp gpipe, circular and 1f1b at Llama-3-8B
    # shapes within 10 % with them, +7 .. +43 % with the XLA:CPU formulas)
    tpu = backend_name(plan, backend) == "tpu" and c < np.dtype(lay.param_dtype).itemsize
    # the layer loop the step runs (scan_layers resolves `auto` with the same function)
    # XLA:TPU pads the minor dimension to 128 lanes; measured around the splash kernel, whose (b, T, heads,
    # head_dim) operands keep head_dim minor, while dense and blockwise-XLA attention's layouts put a long one minor
    lanes = TPU_LANES if tpu and step.attention.backend is FlashBackend.SPLASH else 1
    loop, unroll = step.loop_for(cfg.n_layers)
    straight = pipe is None and not tpu and unroll >= cfg.n_layers
    gpu_narrow = moe is None and backend_name(plan, backend) == "gpu" and c < np.dtype(lay.param_dtype).itemsize
    narrow_gpu = pipe is None and gpu_narrow
    gpu = straight and narrow_gpu
    return StepShape(
        plan, cfg, lay, B, T, per, elems, stage_w, pipe, moe,
        moe.activation_config(cfg) if moe is not None else cfg,  # MoE: the dense-equivalent MLP width
        moe.weight_config(cfg) if moe is not None else cfg,  # MoE: every expert's weights are cast
        weight_fraction,
        saved_activations(remat, lay.compute_dtype, cfg.tie_embeddings, attention, lanes,
                          parse_offload_names(plan.recipe.offload_activations)),
        saved_activations(Remat.NONE, lay.compute_dtype, cfg.tie_embeddings, attention, lanes),
        cfg.n_layers, c, B // (split.batch * split.micro_batches), T // max(lay.context, lay.sequence, 1), tpu,
        loop, unroll, straight, gpu, narrow_gpu and step.attention.backend is FlashBackend.CUDNN,  # straight: unrolled
        narrow_gpu and not straight, gpu_pipeline=pipe is not None and gpu_narrow, resolved=step)


def _total(terms: Tuple[MemoryTerm, ...]) -> float:
    return sum(t.bytes for t in terms)


def state_term(component: Component, name: str, nbytes: int, formula: str) -> Tuple[MemoryTerm, ...]:
    return (MemoryTerm(component, name, nbytes, formula),)


def gradient_terms(s: StepShape, activations: int) -> Tuple[MemoryTerm, ...]:
    """The gradients: ``P`` at the gradients' shardings (XLA:TPU: in the compute dtype); unrolled, only the
    part beyond the saved activations; plus an f32 accumulator with micro-batches (1f1b: f32 accumulators
    instead, where larger). ``activations``: the activation component's bytes."""
    G = Component.GRADIENTS
    if s.tpu:
        grads = MemoryTerm(G, "gradients (compute dtype)", gradient_bytes(s.plan, itemsize=s.c),
                           "elements per device × compute-dtype bytes at the gradients' shardings")
    elif s.gpu_scan:
        grads = MemoryTerm(G, "gradients (compute dtype, XLA:GPU scan)", s.layer_phase_gradients,
                           "elements per device × compute-dtype bytes at the gradients' shardings, but the untied "
                           "embedding table's (made after the layers' backward, when the weight casts are freed): "
                           "the backward scan stacks each layer's gradient in the compute dtype, upcast in the "
                           "optimizer update")
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
                           "the T² loop constants (the dense mask, fused into each consumer)")
                ) + gpu_activation_terms(s) + cudnn_packed_terms(s) + gpu_context_output_terms(s)
    if s.pipe is None:
        saved = (MemoryTerm(A, "saved tensors", s.model.bytes_per_device(s.acfg, B, T, split),
                            f"the tensors remat={s.remat.value} saves, all layers"),
                 MemoryTerm(A, "MoE dispatch buffers", L * s.moe_saved, "L × dispatched rows, expert outputs, f32 "
                                                                        "router logits/probabilities"))
        return saved + _tpu_activation_terms(s) + gpu_scan_activation_terms(s) + cudnn_packed_terms(s) + (casts,)
    x, m, pipe = s.stage_input, s.pipe.micro_batches, s.pipe
    zb = pipe.schedule is Schedule.ZERO_BUBBLE  # + the deferred weight halves: a layer's remat-none residuals
    a_w = (s.none.layer_bytes_per_device(s.acfg, B, T, split)
           + (s.moe.saved_extra_per_layer if s.moe is not None else 0)) if zb else 0
    stack = MemoryTerm(A, "pipeline stack", pipe.stage_activation_bytes(L, s.layer_saved, x, a_w),
                       ("2p stage inputs 2·p·x (stash) + (p+3)·L/p·(a_W + x) weight halves" if zb else
                        "2p stage inputs 2·p·x (stash)") if pipe.one_f_one_b else "ticks·L/(p·r)·a_layer")
    rest = s.tensors - L * s.layer_saved  # embedding output, final norm, logits: outside the stack
    if pipe.one_f_one_b:
        return (stack, MemoryTerm(A, "outside the stack", rest, "one micro-batch's embedding output, norm, logits"),
                MemoryTerm(A, "embedding outputs", m * x, "m·x"), casts) + gpu_pipeline_activation_terms(s)
    # With repeats > 1 each tick picks its layer group by a dynamic index: XLA saves that slice of the stage's
    # weights per tick for the backward. With one group per stage the index is static (parallel/pipeline): no copy.
    groups = (MemoryTerm(A, "layer groups the ticks index", pipe.ticks * s.stage_w * s.c / pipe.repeats,
                         "ticks·W_stage·c/r"),) if pipe.repeats > 1 else ()
    return (stack, MemoryTerm(A, "outside the stack and stage outputs", m * (rest + x),
                              "m × (embedding output, norm, logits + the ring's stage output x)"), casts,
            *groups) + gpu_pipeline_activation_terms(s)


def _tpu_activation_terms(s: StepShape) -> Tuple[MemoryTerm, ...]:
    """XLA:TPU's differences from the traced residuals: the logits and the residual stream in the compute
    dtype (no f32 copies), and the layers' residual stream counted twice (the backward loop reads a copy)."""
    if not s.tpu:
        return ()
    A, B, T, split = Component.ACTIVATIONS, s.B, s.T, s.split
    btd = dict(dims=("B", "T", "d"))
    return (MemoryTerm(A, "less loop constants (XLA:TPU)", -s.model.loop_constant_bytes_per_device(s.acfg, B, T, split),
                       "the T² loop constants (the dense mask, fused into each consumer)"),
            MemoryTerm(A, "residual stream copy (XLA:TPU)",
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
    k = s.unroll if s.pipe is None and not s.straight and not s.tpu_unrolled else 1
    times = f"{k} × " if k > 1 else ""
    if s.straight:
        layer = (MemoryTerm(M, "layers' weights as multiplied", s.layer_weights, "L·W_layer·c"),)
        if s.gpu:  # XLA:GPU holds the last layer's residuals and the first of its backward's cotangents together
            layer += (largest_cotangent(s),) + gpu_context_accumulator_terms(s)
    elif s.tpu and s.remat is Remat.NONE and s.moe is None:  # nothing to recompute: the backward's own cotangents
        layer = (MemoryTerm(M, "one layer's largest cotangent (XLA:TPU)",
                            k * s.c * s.model.largest_layer_tensor_elements(s.acfg, B, T, split),
                            f"{times}the layer's largest saved tensor in the compute dtype (remat=none keeps the "
                            f"rest saved)"),)
    elif s.gpu_pipeline and s.pipe.one_f_one_b:  # XLA:GPU: the peak is a layer's backward in the stage's VJP
        layer = gpu_one_f_one_b_terms(s)
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
        if s.gpu_scan:  # as unrolled: the layer's backward makes its largest cotangent in f32 and the compute dtype
            layer += (largest_cotangent(s, k),)
    blocks = MemoryTerm(M, "attention score blocks", s.attention_blocks,
                        "4 × 4 B·b·n·bq·bk (blockwise kernels)")
    logits_rows = s.b_loc * s.pipe.micro_batches if s.pipe is not None and not s.pipe.one_f_one_b else s.b_loc
    logits_grad = 4 * logits_rows * (T // s.lay.context) * s.cfg.vocab_size // s.lay.size(s.lay.vocab_axes)
    if s.tpu:  # XLA:TPU finishes the head's backward before the layers': the larger of the two
        beyond = max(logits_grad - int(_total(layer + (blocks,))), 0)
        terms = layer + (blocks, MemoryTerm(M, "f32 logits gradient beyond the working set", beyond,
                                            "max(4·b·T·V/t − the above, 0)"))
    elif s.gpu_scan:  # XLA:GPU too, and the layers' phase holds the gradient stacks as well: the larger phase
        head = s.f32_logits + logits_grad
        beyond = max(head - s.layer_phase_gradients - int(_total(layer + (blocks,))), 0)
        terms = layer + (blocks, MemoryTerm(M, "f32 logits and their gradient beyond the layers' backward (XLA:GPU "
                                               "scan)", beyond,
                                            "max(saved f32 logits + 4·b·T·V/t − the layers' phase gradients − "
                                            "the above, 0)"))
    else:
        terms = layer + (MemoryTerm(M, "f32 logits gradient", logits_grad, "4·b·T·V/t"), blocks)
    if s.pipe is not None and s.pipe.one_f_one_b:
        x, m, p = s.stage_input, s.pipe.micro_batches, s.pipe.stages
        terms += (MemoryTerm(M, "one stage's VJP", (L // p) * s.layer_saved, "L/p layers' saved activations"),
                  MemoryTerm(M, "f32 input cotangents", 4 * m * x // s.c, "4·m·x/c"),
                  MemoryTerm(M, "tick's f32 weight gradient and accumulator", 2 * 4 * s.stage_w, "2·4 B·W_stage"))
    return terms


def _params_formula(s: StepShape) -> str:
    formula = PARAMS_FORMULA
    if s.moe is not None:
        formula += (f"; expert weights {s.moe.expert_bytes_per_device:,} B per device of "
                    f"{s.moe.expert_bytes_total:,} (÷{s.moe.ep} expert-parallel and the other shardings)")
    return formula


def component_formulas(s: StepShape) -> Tuple[Tuple[Component, str], ...]:
    """Each component's formula in words, with the figures it used (the terms give the parts)."""
    lay, pipe, L, w_layers = s.lay, s.pipe, s.L, s.layer_weights
    unroll, straight, blocks = s.unroll, s.straight, s.attention_blocks
    acc = " + f32 accumulator 4 B × elements per device (micro-batches)" if s.accumulates else ""
    if pipe is not None and pipe.one_f_one_b and 4 * s.elems > gradient_bytes(s.plan):
        acc = " (1f1b: f32 accumulators, 4 B × elements per device)"
    act_formula = (f"saved tensors under remat={s.remat.value}, {lay.compute_dtype}, b={s.b_loc} per device "
                   f"per micro-batch, ÷{lay.tensor} on heads/MLP/vocab, ÷{lay.sequence} on (b,t,d)"
                   + (f", ÷{lay.context} on the sequence (context, attention {s.resolved.attention.kind.value})"
                      if lay.context > 1 else ""))
    temp_formula = ((f"{unroll} layers (scan_unroll) " if unroll > 1 and not straight else "one layer ")
                    + "with remat=none (backward working set)"
                    + (f" + its weight gradient as multiplied W_layer·c = {w_layers:,} B (remat: recomputed "
                       "residuals and weight gradient together)" if w_layers and not straight else "")
                    + ("" if s.gpu_scan else " + f32 logits gradient 4·b·T·V/t")
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
    act_formula, temp_formula, grad_formula = _backend_formulas(s, act_formula, temp_formula, grad_formula)
    act_formula, temp_formula = _moe_pipeline_formulas(s, act_formula, temp_formula)
    return (
        (Component.PARAMS, _params_formula(s)),
        (Component.GRADIENTS, ("elements per device × compute-dtype bytes (XLA:TPU upcasts in the reduction and "
                               "optimizer update)" if s.tpu else grad_formula) + acc),
        (Component.OPTIMIZER, OPTIMIZER_FORMULA),
        (Component.ACTIVATIONS, act_formula),
        (Component.TEMPORARIES, temp_formula),
        (Component.BATCH, BATCH_FORMULA),
    )


def _backend_formulas(s: StepShape, act_formula: str, temp_formula: str,
                      grad_formula: str) -> Tuple[str, str, str]:
    """The activation, temporaries and gradient formulas with XLA:GPU's and XLA:TPU's buffer choices added."""
    pipe, blocks = s.pipe, s.attention_blocks
    if s.gpu:
        act_formula += ("; XLA:GPU: no f32 copy of the residual stream, each norm's output kept in the compute dtype, "
                        "of the MLP only its matmuls' operands and results"
                        + (", cuDNN's K/V at the query heads" if s.cudnn else ""))
        temp_formula += " + one layer's largest cotangent in f32 and the compute dtype (4 + c)·a_max (XLA:GPU)"
        kernel = context_kernel_shape(s)
        if kernel is not None:
            act_formula += "; the blockwise context kernels' f32 outputs (L − 1)·4 B·b·t·n·h"
            temp_formula += (f" + every layer's context-kernel f32 accumulators L·{kernel.accumulator_copies}·4 B·"
                             f"(b·t·n·h + 2·b·s·kv·h) (XLA:GPU hoists their zeros)")
    if s.gpu_scan:
        grad_formula = ("elements per device × compute-dtype bytes (XLA:GPU scan: the backward scan stacks each "
                        "layer's gradient in the compute dtype, upcast in the optimizer update), less the untied "
                        "embedding table's (made after the layers' backward)")
        act_formula += "; XLA:GPU scan: the saved f32 logits are freed before the layers' backward"
        temp_formula += (" + one layer's largest cotangent in f32 and the compute dtype (4 + c)·a_max; the saved f32 "
                         "logits and their gradient 4·b·T·V/t count where the head's phase outgrows the layers' "
                         "(XLA:GPU scan)")
    if s.gpu_pipeline:
        act_formula += ("; XLA:GPU: no T² loop constants (the dense mask is fused into each consumer)"
                        + ("" if pipe.one_f_one_b else ", the tick loops' largest stack once more, transposed for "
                                                       "the backward ticks·L/(p·r)·4 B·a_max"))
        if pipe.one_f_one_b:
            temp_formula = temp_formula.replace("one layer with remat=none (backward working set)",
                                                "the layer's backward in the stage VJP (3·4 + c)·a_max and the "
                                                "stage's largest stack transposed L/p·4 B·a_max (XLA:GPU)")
    if s.tpu:
        temp_formula = ("max(one layer with remat=none (backward working set), f32 logits gradient 4·b·T·V/t): "
                        "XLA:TPU finishes the head's backward before the layers'"
                        + (" + attention score blocks 4 × 4 B·b·n·bq·bk" if blocks else ""))
        act_formula += "; XLA:TPU: logits in the compute dtype, no f32 copy of the residual stream"
    return act_formula, temp_formula, grad_formula


def _moe_pipeline_formulas(s: StepShape, act_formula: str, temp_formula: str) -> Tuple[str, str]:
    """The activation and temporaries formulas with an MoE layer's and a pipeline schedule's buffers added."""
    moe, pipe, L = s.moe, s.pipe, s.L
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
                            f"+ m × (outside the stack + the ring of stage outputs x = {x:,} B)"
                            + (" + the layer group each tick indexes ticks·W_stage·c/r" if pipe.repeats > 1 else ""))
            temp_formula += "; logits gradient over the whole batch (b·m rows: the head runs after the schedule)"
    return act_formula, temp_formula

PARAMS_FORMULA = "Σ parameter leaves: elements × dtype bytes ÷ shards (plan)"
OPTIMIZER_FORMULA = "Σ optimizer-state leaves ÷ shards (plan)"
BATCH_FORMULA = "input arrays (plan)"


def attention_working_set(plan, cfg, b_loc: int) -> int:
    """Bytes of the score blocks a blockwise attention kind keeps live in the backward (scores,
    probabilities, their gradient and ``dp``: 4 f32 blocks of ``b × heads × bq × bk``); 0 for ``dense``
    (its ``T × T`` scores are in the activations)."""
    if resolved_step(plan).attention.kind is AttentionKind.DENSE:
        return 0
    lay = layout_of(plan)
    bq, bk, heads = attention_block_shape(plan_layout(plan), batch_dims(plan)[1], max(cfg.n_heads // lay.tensor, 1),
                                          b_loc)
    return 4 * 4 * b_loc * heads * bq * bk


GRAD_FORMULA = ("Σ parameter elements × dtype bytes ÷ the shards of the gradient's sharding (the parameter's; "
                 "the optimizer state's under zero2)")


def backend_name(plan, backend=None) -> str:
    """``"tpu"``, ``"gpu"`` or ``"cpu"``: ``backend`` if given (a string or a ``Backend``), else the platform
    of the plan's devices (a ``Mesh``), else ``"cpu"`` (an ``AbstractMesh``)."""
    if isinstance(backend, Target):
        name = backend.name
    elif backend is not None:
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


def gradient_bytes(plan, itemsize: Optional[int] = None, axes: Optional[Tuple[str, ...]] = None) -> int:
    """Gradient bytes per device: each parameter's bytes divided by the shards of the sharding the step
    keeps its gradient in (:func:`meshtrain.plan.gradient_shardings`: the parameter's own, or its
    optimizer state's under ``zero2``). ``itemsize``: bytes per element instead of the parameter's dtype
    (floating-point leaves only); ``axes``: only the parameters with these logical axes. Once per layout,
    ``itemsize`` and ``axes``."""
    return cached(plan, ("gradient_bytes", itemsize, axes), lambda p: _gradient_bytes(p, itemsize, axes),
                  layout_only=True)


#: The logical axes of an embedding table the step looks tokens up in (the head's weight is ``(embed, vocab)``).
LOOKUP_TABLE_AXES = ("vocab", "embed")


def _gradient_bytes(plan, itemsize: Optional[int], axes: Optional[Tuple[str, ...]] = None) -> int:
    sizes = plan.mesh_sizes
    total = 0
    leaves = jax.tree_util.tree_leaves_with_path(plan.abstract.params)
    for sharding, (keypath, leaf) in zip(jax.tree.leaves(gradient_shardings(plan)), leaves):
        if axes is not None and tuple(plan.abstract.param_axes.get(path_str(keypath)) or ()) != axes:
            continue
        shards = 1
        for entry in sharding.spec:
            for axis in (entry if isinstance(entry, tuple) else (entry,)):
                shards *= sizes.get(axis, 1) if axis else 1
        size = np.dtype(leaf.dtype).itemsize
        if itemsize is not None and jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating):
            size = itemsize
        total += int(np.prod(leaf.shape)) * size // shards
    return total
