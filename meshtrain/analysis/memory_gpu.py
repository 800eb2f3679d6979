"""XLA:GPU's buffer choices in the analytic memory model, as :class:`~meshtrain.analysis.memory_types.MemoryTerm`
terms that :mod:`meshtrain.analysis.memory_terms` adds to a step's terms: which attention kernel the step runs
(``StepShape.cudnn``, read off the step's :class:`~meshtrain.parallel.resolved.ResolvedStep`), what cuDNN's fused attention saves, what XLA:GPU keeps of unrolled and scanned layers, the
blockwise context kernels' f32 outputs and accumulators, and a pipeline's stack transposed between its forward and
backward tick loops. The terms read a ``StepShape`` (:func:`meshtrain.analysis.memory_terms.step_shape`, which
imports this module: named here, not imported). Each rule was read off XLA:GPU's buffer assignments
(``XLA_FLAGS=--xla_dump_to=...``; :mod:`meshtrain.analysis.memory`'s docstring says which steps). Example::

    shape = step_shape(plan, cfg, "gpu")          # meshtrain.analysis.memory_terms
    gpu_activation_terms(shape)   # (MemoryTerm(ACTIVATIONS, "less f32 residual stream (XLA:GPU)", ...), ...)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Tuple

from meshtrain.analysis.memory_types import Component, MemoryTerm
from meshtrain.parallel import flash  # flash.CUDNN_MAX_SEGMENTS read at plan time: a user may change it
from meshtrain.parallel.context import CONTEXT_KINDS
from meshtrain.recipes import AttentionKind, Remat

if TYPE_CHECKING:  # annotations only (memory_terms imports this module)
    from meshtrain.analysis.memory_terms import StepShape


def gpu_scan_activation_terms(s: "StepShape") -> Tuple[MemoryTerm, ...]:
    """XLA:GPU with the layers scanned: the saved f32 logits are gone before the layers' backward starts (the
    head's backward runs first); :func:`temporary_terms` counts them with their gradient where that phase is the
    larger one."""
    if not s.gpu_scan:
        return ()
    return (MemoryTerm(Component.ACTIVATIONS, "less f32 logits (XLA:GPU scan)", -s.f32_logits,
                       "the head's backward frees them before the layers' backward"),)


def cudnn_packed_terms(s: "StepShape") -> Tuple[MemoryTerm, ...]:
    """cuDNN's fused attention on packed documents saves f32 softmax statistics of ``(b·M, n, T)`` per layer,
    ``M`` = :data:`meshtrain.parallel.flash.CUDNN_MAX_SEGMENTS` (its room for documents a row): every layer's
    when the layers' residuals are kept (unrolled, or remat none), one layer's when the backward recomputes
    them."""
    if not s.cudnn or not s.resolved.attention.segmented:
        return ()
    layers = s.L if s.straight or s.remat is Remat.NONE else 1
    n = max(s.cfg.n_heads // s.lay.tensor, 1)
    stats = 4 * s.b_loc * flash.CUDNN_MAX_SEGMENTS * n * s.t_loc
    return (MemoryTerm(Component.ACTIVATIONS, "softmax statistics per packed document (cuDNN)", layers * stats,
                       f"{'L' if layers > 1 else '1'} × 4 B·b·M·n·T, M = {flash.CUDNN_MAX_SEGMENTS} documents a row "
                       f"(flash.CUDNN_MAX_SEGMENTS)"),)


def gpu_activation_terms(s: "StepShape") -> Tuple[MemoryTerm, ...]:
    """XLA:GPU's differences from the traced residuals of unrolled layers: its fusions read the f32 upcasts of
    the residual stream from the compute-dtype tensors they upcast, keep of the MLP only its matmuls' operands
    and results (one ``(b, T, f)`` tensor per MLP-width weight matrix: the gate and up projections and the
    down projection's input; the activation function's intermediates are recomputed), and cuDNN's fused
    attention saves K and V repeated to the query heads (the traced blockwise kernel saves them unrepeated)."""
    if not s.gpu:
        return ()
    A, B, T, split, none, c = Component.ACTIVATIONS, s.B, s.T, s.split, s.none, s.lay.compute_dtype
    btf = ("B", "T", "f")
    mlp = none.tensor_bytes_per_device(s.acfg, B, T, split, dims=btf, dtype=c, stacked=True)
    traced = none.tensor_count(dims=btf, dtype=c)
    kept = min(none.mlp_matrices, traced)
    norms = none.layer_norms * s.L + none.outer_norms
    recomputed = mlp * (traced - kept) // traced if traced else 0
    terms = (MemoryTerm(A, "less f32 residual stream (XLA:GPU)",
                        -none.tensor_bytes_per_device(s.acfg, B, T, split, dims=("B", "T", "d")),
                        "no f32 copy of (b, T, d): the norms upcast inside their fusions"),
             MemoryTerm(A, "norm outputs in the compute dtype (XLA:GPU)",
                        norms * s.b_loc * s.t_loc * s.cfg.d_model * s.c,
                        f"{none.layer_norms}·L + {none.outer_norms} norms × b·T·d·c: each norm's output is the "
                        "next matmul's operand"),
             MemoryTerm(A, "less recomputed MLP activations (XLA:GPU)", -recomputed,
                        f"(b, T, f) tensors: {traced} traced per layer, {kept} kept (one per MLP-width weight "
                        f"matrix: the matmuls' operands and results)"))
    if s.cudnn:
        g = s.cfg.n_heads // s.cfg.n_kv_heads
        kv = none.tensor_bytes_per_device(s.acfg, B, T, split, dims=("B", "T", "kv", "hh"), dtype=c, stacked=True)
        terms += (MemoryTerm(A, "K/V repeated to the query heads (cuDNN)", kv * (g - 1),
                             "L × 2·b·T·(n − kv)·h·c: cuDNN saves K and V at the query heads"),)
    return terms


@dataclasses.dataclass(frozen=True)
class ContextKernelShape:
    """What one device's blockwise context kernel (ring, all_gather, usp; ulysses without cuDNN) works on:
    the elements of its local queries ``b·t·n·h`` and of the keys it attends over ``b·s·kv·h`` (after the
    all-gather or the Ulysses all-to-all), and how many sets of backward accumulators it makes (a ring: 2, the own
    block's visit and the ring loop's)."""

    q_elements: int
    kv_elements: int
    accumulator_copies: int


def context_kernel_shape(s: "StepShape") -> Optional[ContextKernelShape]:
    """The blockwise context kernel's shape (:func:`meshtrain.parallel.context._local_kernel`), or ``None``
    where the step runs none (no context kind, an unsharded sequence, or cuDNN's fused kernel)."""
    layout = s.resolved.attention.layout
    if s.cudnn or layout.kind not in CONTEXT_KINDS or not layout.sharded:
        return None
    cfg = s.cfg
    n, kv = max(cfg.n_heads // s.lay.tensor, 1), max(cfg.n_kv_heads // s.lay.tensor, 1)
    u = layout.ulysses  # the all-to-all gives each device n/u query heads over u·t rows
    kv_u = kv // u if kv % u == 0 else 1  # (fewer K/V heads than u: repeated up to u, one each)
    gathered = layout.ring if layout.kind is AttentionKind.ALL_GATHER else 1
    rows = s.b_loc * s.t_loc
    ring = layout.kind in (AttentionKind.RING, AttentionKind.USP) and layout.ring > 1
    return ContextKernelShape(rows * n * cfg.head_dim, rows * u * gathered * kv_u * cfg.head_dim, 2 if ring else 1)


def gpu_context_output_terms(s: "StepShape") -> Tuple[MemoryTerm, ...]:
    """XLA:GPU with the layers unrolled: a blockwise context kernel's f32 output (before its cast to the compute
    dtype) stays saved next to the cast, for the backward's ``delta = Σ do·o`` in f32; every layer's but the
    first backward layer's, whose ``delta`` is made before its kernel's loop (where the peak is)."""
    shape = context_kernel_shape(s) if s.gpu else None
    if shape is None:
        return ()
    return (MemoryTerm(Component.ACTIVATIONS, "context kernels' f32 outputs (XLA:GPU)",
                       (s.L - 1) * 4 * shape.q_elements, "(L − 1) × 4 B·b·t·n·h: each layer's attention output "
                                                         "before its cast"),)


def gpu_context_accumulator_terms(s: "StepShape") -> Tuple[MemoryTerm, ...]:
    """XLA:GPU with the layers unrolled: the f32 gradient accumulators of every layer's blockwise context kernel
    (``dq`` at the queries, ``dk``/``dv`` at the keys it attends over) are zeros that XLA:GPU fuses into one
    multi-output fusion at the step's start, so all layers' are live at the first layer's backward. A ring makes
    two sets: its own block's visit (before the loop) and the ring loop's, whose first iteration XLA:GPU peels out
    of the ``ppermute`` loop to double-buffer it."""
    shape = context_kernel_shape(s) if s.gpu else None
    if shape is None:
        return ()
    k = shape.accumulator_copies
    return (MemoryTerm(Component.TEMPORARIES, "context kernels' backward accumulators (XLA:GPU)",
                       s.L * k * 4 * (shape.q_elements + 2 * shape.kv_elements),
                       f"L × {k} × 4 B·(b·t·n·h + 2·b·s·kv·h): dq, dk, dv of every layer"
                       + (" (ring: the own block's visit and the ring loop's)" if k > 1 else "")),)


def largest_cotangent(s: "StepShape", k: int = 1) -> MemoryTerm:
    """XLA:GPU: a layer's backward holds its largest cotangent in f32 and in the compute dtype (dense attention:
    the ``T²`` score gradient before and after the softmax), ``k`` layers' at once."""
    return MemoryTerm(Component.TEMPORARIES, "one layer's largest cotangent in f32 and the compute dtype (XLA:GPU)",
                      k * (4 + s.c) * s.none.largest_layer_tensor_elements(s.acfg, s.B, s.T, s.split),
                      ("k × " if k > 1 else "") + "(4 + c) × the layer's largest saved tensor (dense: the T² score "
                      "gradient before and after the softmax)")


def gpu_pipeline_activation_terms(s: "StepShape") -> Tuple[MemoryTerm, ...]:
    """XLA:GPU with a pipeline: the layers' loop writes its largest stack of residuals (dense: the f32 softmax
    exponentials, ``4·a_max`` a layer) in the layout its update slices want, and the backward loop reads it in
    another: the transpose between them makes a second copy, live next to the first (gpipe and circular: every
    tick's stack, ``ticks·L/(p·r)`` layers, at the transpose after the forward tick loop; 1f1b: one stage's VJP,
    ``L/p`` layers, in :func:`gpu_one_f_one_b_terms`). The dense mask, fused into each consumer, keeps no buffer:
    no micro-batch keeps the ``T²`` loop constants (1f1b: one micro-batch outside the stack, the others ``m``)."""
    if not s.gpu_pipeline:
        return ()
    A, B, T, split, pipe = Component.ACTIVATIONS, s.B, s.T, s.split, s.pipe
    kept = 1 if pipe.one_f_one_b else pipe.micro_batches
    less = (MemoryTerm(A, "less loop constants (XLA:GPU pipeline)",
                       -kept * s.model.loop_constant_bytes_per_device(s.acfg, B, T, split),
                       f"{'' if kept == 1 else 'm × '}the T² loop constants (the dense mask, fused into each "
                       f"consumer)"),)
    if pipe.one_f_one_b:
        return less
    largest = 4 * s.none.largest_layer_tensor_elements(s.acfg, B, T, split)
    transposed = MemoryTerm(A, "largest stack transposed for the backward (XLA:GPU pipeline)",
                            int(pipe.layer_runs(s.L) * largest),
                            "ticks·L/(p·r) × 4 B·a_max: the largest stack once more, in the backward loop's layout")
    return (transposed,) + less


def gpu_one_f_one_b_terms(s: "StepShape") -> Tuple[MemoryTerm, ...]:
    """XLA:GPU with 1f1b: the peak is a layer's backward inside a tick's stage VJP, which holds the stage's
    largest stack transposed for its backward loop (``L/p·4·a_max``) and, instead of one layer's remat=none
    working set, the layer's largest tensor sliced out of that stack in f32 with its two f32 cotangents and one in
    the compute dtype, ``(3·4 + c)·a_max``."""
    if not s.gpu_pipeline or not s.pipe.one_f_one_b:
        return ()
    M, elements = Component.TEMPORARIES, s.none.largest_layer_tensor_elements(s.acfg, s.B, s.T, s.split)
    return (MemoryTerm(M, "stage VJP's largest stack transposed for the backward (XLA:GPU 1f1b)",
                       (s.L // s.pipe.stages) * 4 * elements, "L/p × 4 B·a_max"),
            MemoryTerm(M, "layer's backward in the stage VJP (XLA:GPU 1f1b)", (3 * 4 + s.c) * elements,
                       "(3·4 + c)·a_max: the largest tensor in f32, its two f32 cotangents and one in the compute "
                       "dtype"))
