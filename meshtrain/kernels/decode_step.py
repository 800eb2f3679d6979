"""A whole decode step of a Llama-shaped decoder in one C++ call (``decode_step.cc``, through XLA's FFI), for the
compiled decode loop on CPU.

Why: at ``tiny`` sizes (d_model 64, 2 layers, 0.3 MiB of weights) the decode step is bound by the number of
kernels, not by bytes or flops. XLA:CPU's loop body runs ~81 thunks (fusions and dots of well under a microsecond of
work each; transformers' Flax ``generate`` runs the same count), and with the loop's own bookkeeping a step took
~20-27 us against the ~3 us its arithmetic needs on weights that sit in L2 (BENCHMARKS.md, "The decode-speed bar
on tiny: the whole step in one call"). The kernel runs the embedding row, every layer (RMSNorm, q/k/v, rotary
embedding, the cache write, grouped-query attention over the cache, the output projection, the gated MLP) and
the final norm and head in one call; sampling and the loop's bookkeeping stay in XLA.

Larger models (a projection of at least :data:`meshtrain.kernels.bf16_rows.MIN_ELEMENTS` weights, e.g. a ~100M
Llama) are bound by the bytes their step reads: there the engine stores the matmul weights ``(out, in)``
(:func:`rows_layout`) and the kernel runs each step on one thread per core (:func:`team_size`), each thread reading
one contiguous block of every weight: llama-114m f32 decodes at ~52 tokens/s where XLA's step and transformers'
Flax ``generate`` run ~38 (BENCHMARKS.md, "llama-114m f32: the fused step on a team of threads").

Where it runs: :meth:`meshtrain.parallel.resolved.ResolvedStep.for_generation` decides (``DecodeMatmul.FUSED_STEP``:
XLA:CPU, 1 device, the compiled loop's per-layer weights, a model :func:`unsupported` accepts, and f32 weights and
compute at any size or bf16 weights below that size; a larger bf16 model takes :mod:`meshtrain.kernels.bf16_rows`).
The prefill and every other case stay on XLA. Built on first use with the host's compiler like
:mod:`meshtrain.kernels.bf16_rows` (the same cache folder).

Example (inside the compiled loop: ``params`` the engine's, layers one tree per layer)::

    logits_bv, cache = forward(cfg, params, token_b, cache)
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.kernels.bf16_rows import MIN_ELEMENTS, RowsWeight, load_and_register
from meshtrain.models.decoder import ACTIVATIONS, DecoderConfig, rope_frequencies

TARGET = "meshtrain_decode_step"
_SOURCE = os.path.join(os.path.dirname(__file__), "decode_step.cc")
#: the weights' names (the generation engine's tree, one layer's), in the kernel's argument order
LAYER_WEIGHTS = (("attn_norm", "scale"), ("attn", "wq_dnh"), ("attn", "wk_dkh"), ("attn", "wv_dkh"),
                 ("attn", "wo_nhd"), ("mlp_norm", "scale"), ("mlp", "gate_df"), ("mlp", "up_df"), ("mlp", "down_fd"))


def unsupported(cfg: DecoderConfig) -> Optional[str]:
    """Why the kernel cannot run decoder ``cfg`` (``None``: it can): dense Llama-shaped blocks only (no experts, no
    q/k/v biases), a SiLU or tanh-GELU gate, an even head_dim (rotary halves)."""
    if cfg.n_experts:
        return "a mixture-of-experts MLP"
    if cfg.qkv_bias:
        return "q/k/v biases"
    if cfg.mlp_activation not in ACTIVATIONS:
        return f"activation {cfg.mlp_activation!r}"
    if cfg.head_dim % 2:
        return f"an odd head_dim {cfg.head_dim}"
    return None


def largest_projection(cfg: DecoderConfig) -> int:
    """A layer's largest projection of ``cfg``, in weights (what :func:`team_size`, :func:`rows_layout` and the
    engine's choice of the decode matmuls read): the attention's or the dense MLP's (an MoE model has none)."""
    return cfg.d_model * max(cfg.d_ff if not cfg.n_experts else 0, cfg.n_heads * cfg.head_dim)


def rows_layout(largest: int) -> bool:
    """Whether the engine stores a model's matmul weights ``(out, in)`` for the kernel (a layer's largest projection
    of ``largest`` weights): where :func:`team_size` runs a step on several threads, each then reads one contiguous
    block of every weight (its outputs' rows) from memory, where over ``(in, out)`` it read a short piece of every
    row (llama-114m, 2 threads: ~18 GB/s against ~28 for a contiguous stream)."""
    return largest >= MIN_ELEMENTS


def team_size(largest: int) -> int:
    """Threads the kernel runs one step on: 1 for a model whose projections are under
    :data:`~meshtrain.kernels.bf16_rows.MIN_ELEMENTS` weights (its weights sit in cache: a hand-off between threads
    costs more than the bytes), else one per core (``os.sched_getaffinity``), at most 8: a larger model's step
    reads its weights once from memory, and one core's loads reach about half of the host's read bandwidth."""
    if largest < MIN_ELEMENTS:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


@functools.lru_cache(maxsize=1)
def _ready() -> Tuple[bool, str]:
    return load_and_register(_SOURCE, "decode_step", {TARGET: "MeshtrainDecodeStep"})


def kernel_ready() -> bool:
    """Whether the kernel is built and registered with XLA:CPU (builds it on first call; tests/test_decode_step.py
    checks it against the XLA step)."""
    return _ready()[0]


def why_not_ready() -> str:
    return _ready()[1]


def widened(params, dtype):
    """The weights the kernel reads for a model computing in ``dtype``: a bf16 model's widened to f32 once (exact:
    the kernel's arithmetic is the same, without a widening per weight and step; run it before the decode loop, in
    the same program); an f32 model's, and weights stored ``(out, in)``, as they are."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        return params
    return jax.tree.map(lambda x: x.astype(jnp.float32) if not isinstance(x, RowsWeight) and
                        jnp.issubdtype(x.dtype, jnp.floating) else x, params,
                        is_leaf=lambda x: isinstance(x, RowsWeight))


def forward(cfg: DecoderConfig, params, token_b, cache, dtype=jnp.float32):
    """``(logits_b1v, cache, (greedy_b, greedy_logprob_b))``: one new token per row (``token_b`` ``(batch,)``)
    through the whole model, written at slot ``cache.index`` of the :class:`~meshtrain.generation.loop.LayerCache`
    (updated in place: the caches are aliased to the results) and ``cache.index`` advanced by 1. ``params``: the
    engine's weights, the layers one tree each (``params["blocks"]``), in ``dtype``: f32, or bf16 (a bf16 model:
    weights read as stored, its activations and cache bf16 where the XLA step's are). The greedy choice comes with
    it (the first maximum of each row's logits and its log-probability, as
    :func:`~meshtrain.generation.sampling.choose_with_logprobs`): a greedy loop then runs no kernels over the
    vocabulary."""
    def w(x):  # f32 weights of a bf16 model stay f32 (widened): the cache's dtype says how the model rounds
        x = jnp.asarray(x)
        return x if x.dtype == jnp.float32 else x.astype(dtype)

    # the layers' matmul weights (in, out), or (out, in) where the engine stored them so (rows_layout: RowsWeight)
    out_in = isinstance(params["blocks"][0]["attn"]["wq_dnh"], RowsWeight)
    layers = []
    for layer in params["blocks"]:
        for group, name in LAYER_WEIGHTS:
            x = layer[group][name]
            if isinstance(x, RowsWeight):
                layers.append(w(x.wt))
                continue
            x = w(x)
            layers.append(x.reshape(x.shape[0] * x.shape[1], -1) if name == "wo_nhd" else x.reshape(x.shape[0], -1)
                          if x.ndim > 1 else x)
    tied = cfg.tie_embeddings
    # an untied head as stored (f32 logits: the engine's; (V, D) in the row layout); a tied one is the embedding,
    # in the compute dtype
    head = w(params["embedding_vd"]) if tied else params["lm_head_dv"]
    if isinstance(head, RowsWeight):
        head = head.wt
    head_scale = (cfg.d_model ** -0.5 if cfg.tied_head_scale is None else cfg.tied_head_scale) if tied else 1.0
    inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).astype(jnp.float32)
    caches = [c for pair in zip(cache.k, cache.v) for c in pair]
    fixed = (token_b.astype(jnp.int32), jnp.asarray(cache.index, jnp.int32), cache.pad.astype(jnp.int32), inv_freq,
             w(params["embedding_vd"]), w(params["final_norm"]["scale"]), head)
    first_cache = len(fixed) + len(layers)
    rows = token_b.shape[0]
    out_types = (jax.ShapeDtypeStruct((rows, cfg.vocab_size), jnp.float32), jax.ShapeDtypeStruct((rows,), jnp.int32),
                 jax.ShapeDtypeStruct((rows,), jnp.float32), *(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches))
    call = jax.ffi.ffi_call(TARGET, out_types, input_output_aliases={first_cache + i: 3 + i
                                                                     for i in range(len(caches))})
    f32 = np.float32
    logits_bv, greedy_b, greedy_lp_b, *written = call(
        *fixed, *layers, *caches, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        eps=f32(cfg.norm_eps), offset=f32(cfg.norm_offset), embed_scale=f32(cfg.embed_scale),
        head_scale=f32(head_scale), tied=bool(tied), gelu=cfg.mlp_activation == "gelu_tanh",
        threads=np.int64(team_size(largest_projection(cfg))), rows=bool(out_in))
    cache = dataclasses.replace(cache, k=tuple(written[0::2]), v=tuple(written[1::2]), index=cache.index + 1)
    return logits_bv[:, None, :], cache, (greedy_b, greedy_lp_b)
