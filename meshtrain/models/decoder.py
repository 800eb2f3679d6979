"""A Llama-style decoder in Flax NNX that speaks logical axis names only.

RMSNorm, rotary position embeddings, grouped-query attention, SwiGLU MLP, tied or untied
embeddings. The layer stack is one vmapped ``Block`` (its parameters carry a leading ``layers``
axis) run by :func:`meshtrain.annotate.scan_layers`: one ``lax.scan`` for deep stacks (compile time
flat in depth), straight-line code for shallow ones (the recipe's ``layer_loop``).

Example::

    cfg = get_config("tiny")
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    logits_btv = model(tokens_bt)
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshtrain import fp8
from meshtrain.annotate import constrain, scan_layers
from meshtrain.errors import ConfigError
from meshtrain.kernels.bf16_rows import RowsWeight, project
from meshtrain.models.moe import MoE, MoEConfig, find_moe_stats, pop_moe_stats
from meshtrain.parallel.attention import attention
from meshtrain.parallel.context import layout_positions
from meshtrain.parallel.heads import HeadLayout, head_layout

RESIDUAL = ("batch", "residual_seq", "embed")
#: The MLP gate's activation by name (GeGLU's gelu is the tanh approximation, as Gemma's).
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
#: One layer's KV cache (generation): the layout of the attention's keys and values.
CACHE_LAYER = ("batch", "seq", "kv_heads", "head_dim")
#: The whole cache: one layer's, stacked like the blocks' parameters.
CACHE = ("layers",) + CACHE_LAYER


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Shape of a decoder. ``head_dim * n_heads`` need not equal ``d_model``."""

    name: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    max_seq_len: int
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # Mixture of experts (n_experts=0: every block has the dense SwiGLU MLP of width d_ff). With
    # n_experts > 0 every block's MLP is an MoE layer (meshtrain.models.moe): experts_per_token
    # routed experts of width d_expert (0: d_ff) plus n_shared_experts shared ones; capacity_factor
    # None routes dropless; the router losses enter the training loss with these coefficients.
    n_experts: int = 0
    experts_per_token: int = 2
    d_expert: int = 0
    n_shared_experts: int = 0
    capacity_factor: Optional[float] = 1.25
    router_aux_coef: float = 0.01
    router_z_coef: float = 0.001
    router_norm_topk: bool = True  # renormalise the chosen experts' scores (Mixtral, Qwen3); False: raw
    # Variants of published families (meshtrain.hf imports them; the defaults are Llama's):
    qkv_bias: bool = False             # biases on the q/k/v projections (Qwen2)
    norm_offset: float = 0.0           # RMSNorm multiplies by offset + scale (Gemma: 1, its weights stored so)
    embed_scale: float = 1.0           # embeddings multiplied by this (Gemma: sqrt(d_model))
    mlp_activation: str = "silu"       # the gate's activation: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)
    tied_head_scale: Optional[float] = None  # tied logits' factor (None: d_model^-0.5; HuggingFace: 1)
    #: Llama 3.1's rotary frequency scaling (factor, low_freq_factor, high_freq_factor, original context)
    rope_scaling: Optional[Tuple[float, float, float, int]] = None

    def __post_init__(self):
        if self.rope_scaling is not None:  # (a list when read back from JSON)
            object.__setattr__(self, "rope_scaling", tuple(self.rope_scaling))
        if self.mlp_activation not in ACTIVATIONS:
            raise ConfigError(f"mlp_activation={self.mlp_activation!r} of model {self.name!r}: use one of "
                              f"{sorted(ACTIVATIONS)}")
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            # grouped-query attention shares each KV head among n_heads / n_kv_heads query heads
            raise ConfigError(f"n_heads={self.n_heads} of model {self.name!r} is not a multiple of "
                              f"n_kv_heads={self.n_kv_heads}: give a number of KV heads that divides the query heads")
        if self.n_experts:
            self.moe()  # validates top-k, capacity and widths with errors naming the field

    def moe(self) -> Optional[MoEConfig]:
        """The blocks' :class:`MoEConfig`, or ``None`` for a dense model."""
        if not self.n_experts:
            return None
        return MoEConfig(self.d_model, self.n_experts, self.experts_per_token, self.d_expert or self.d_ff,
                         self.n_shared_experts, self.capacity_factor, self.router_aux_coef, self.router_z_coef,
                         self.router_norm_topk)

    def num_params(self, active: bool = False) -> int:
        """All parameters, or (``active=True``) those one token uses: MoE blocks count the router,
        ``experts_per_token`` routed experts and the shared ones."""
        d, l = self.d_model, self.n_layers
        attn = (d + int(self.qkv_bias)) * self.head_dim * (self.n_heads + 2 * self.n_kv_heads) + \
            d * self.head_dim * self.n_heads
        moe = self.moe()
        mlp = 3 * d * self.d_ff if moe is None else (moe.active_params() if active else moe.num_params())
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return l * (attn + mlp + 2 * d) + emb + d

    def num_active_params(self) -> int:
        """Parameters a token passes through (equals :meth:`num_params` for a dense model)."""
        return self.num_params(active=True)


def _dense(equation: str, x, w, meta):
    """A projection ``jnp.einsum(equation, x, w)`` (FP8 with ``meta``), or, when the generation engine stored ``w``
    for the bf16 row kernel (a :class:`~meshtrain.kernels.bf16_rows.RowsWeight`: only when its resolved step
    says ``DecodeMatmul.BF16_ROWS``), the same product read as stored. Training never sees a ``RowsWeight``."""
    if isinstance(w, RowsWeight):
        return project(x, w)
    return fp8.einsum(equation, x, w, meta)


def _init(in_axis, out_axis):
    return jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis)


def _param(rngs, init, shape, names):
    return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=names)


class RMSNorm(nnx.Module):
    """``x / rms(x) * (offset + scale)`` in f32; ``offset`` 1 with scales stored from 0 (Gemma)."""

    def __init__(self, d: int, eps: float, offset: float = 0.0):
        self.scale = nnx.Param(jnp.full((d,), 1.0 - offset, jnp.float32), out_sharding=("embed",))
        self.eps, self.offset = eps, offset

    def __call__(self, x_btd):
        x = x_btd.astype(jnp.float32)
        y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (y * (scale + self.offset if self.offset else scale)).astype(x_btd.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: Optional[Tuple[float, float, float, int]] = None):
    """``(head_dim // 2,)`` rotary frequencies; ``scaling`` = Llama 3.1's (factor, low_freq_factor,
    high_freq_factor, original context): long wavelengths divided by ``factor``, short ones kept, a
    smooth blend between."""
    half = head_dim // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is None:
        return inv_freq
    factor, low, high, original = scaling
    wavelength = 2 * jnp.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return jnp.where(wavelength > original / low, inv_freq / factor,
                     jnp.where(wavelength < original / high, inv_freq, blended))


def rope(x_btnh, positions_bt, theta: float, scaling: Optional[Tuple[float, float, float, int]] = None):
    """Rotary embedding on the last dim (split-halves convention, as HuggingFace's rotate_half), in f32."""
    inv_freq = rope_frequencies(x_btnh.shape[-1], theta, scaling)
    angle_bth = positions_bt.astype(jnp.float32)[..., None] * inv_freq
    sin, cos = jnp.sin(angle_bth)[:, :, None, :], jnp.cos(angle_bth)[:, :, None, :]
    x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_btnh.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq_dnh = _param(rngs, _init(0, (1, 2)), (d, n, h), ("embed", "heads", "head_dim"))
        self.wk_dkh = _param(rngs, _init(0, (1, 2)), (d, k, h), ("embed", "kv_heads", "head_dim"))
        self.wv_dkh = _param(rngs, _init(0, (1, 2)), (d, k, h), ("embed", "kv_heads", "head_dim"))
        self.wo_nhd = _param(rngs, _init((0, 1), 2), (n, h, d), ("heads", "head_dim", "embed"))
        if cfg.qkv_bias:
            zeros = jax.nn.initializers.zeros
            self.bq_nh = _param(rngs, zeros, (n, h), ("heads", "head_dim"))
            self.bk_kh = _param(rngs, zeros, (k, h), ("kv_heads", "head_dim"))
            self.bv_kh = _param(rngs, zeros, (k, h), ("kv_heads", "head_dim"))
        self.theta, self.rope_scaling, self.qkv_bias = cfg.rope_theta, cfg.rope_scaling, cfg.qkv_bias
        # FP8 scales of each projection (None unless built by meshtrain.fp8.fp8_factory)
        self.fp8_q, self.fp8_k, self.fp8_v, self.fp8_o = (fp8.dot_meta() for _ in range(4))

    def _qkv(self, x_btd, positions_bt, lay: HeadLayout):
        """Queries (``lay.padded_heads`` heads: zero heads appended when padded for ``tensor``), keys and values
        (``n_kv_heads``), rotated."""
        wq_dnh = lay.pad_heads(self.wq_dnh[...], 1, ("embed", "heads", "head_dim"))
        q = _dense("btd,dnh->btnh", x_btd, wq_dnh, self.fp8_q)
        k = _dense("btd,dkh->btkh", x_btd, self.wk_dkh[...], self.fp8_k)
        v = _dense("btd,dkh->btkh", x_btd, self.wv_dkh[...], self.fp8_v)
        if self.qkv_bias:
            q = q + lay.pad_heads(self.bq_nh[...], 0, ("heads", "head_dim"))
            k, v = k + self.bk_kh[...], v + self.bv_kh[...]
        q = constrain(q, ("batch", "seq", "heads", "head_dim"))
        k = constrain(k, ("batch", "seq", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
        # names remat=offload can keep in host memory (meshtrain.remat_policies.ACTIVATION_NAMES)
        q, k, v = checkpoint_name(q, "q_proj"), checkpoint_name(k, "k_proj"), checkpoint_name(v, "v_proj")
        return rope(q, positions_bt, self.theta, self.rope_scaling), rope(k, positions_bt, self.theta,
                                                                          self.rope_scaling), v

    def _out(self, o_btnh, lay: HeadLayout, flat: bool = False):
        """The output projection. ``flat`` (generation): as one ``(n * h, d)`` matmul, a free reshape of the
        row-major ``wo_nhd``; the two-axis contraction made XLA:CPU transpose ``wo_nhd`` at every decode step."""
        o = constrain(o_btnh, ("batch", "seq", "heads", "head_dim"))
        wo_nhd = lay.pad_heads(self.wo_nhd[...], 0, ("heads", "head_dim", "embed"))  # zero rows: padding adds 0
        if isinstance(wo_nhd, RowsWeight):
            return project(o, wo_nhd)
        if flat and self.fp8_o is None:
            b, t, n, h = o.shape
            return o.reshape(b, t, n * h) @ wo_nhd.reshape(n * h, wo_nhd.shape[-1])
        return fp8.einsum("btnh,nhd->btd", o, wo_nhd, self.fp8_o)

    def __call__(self, x_btd, positions_bt, segment_ids_bt):
        lay = head_layout(self.wq_dnh[...].shape[1], self.wk_dkh[...].shape[1])
        q, k, v = self._qkv(x_btd, positions_bt, lay)
        o = attention(q, lay.kv_for_queries(k), lay.kv_for_queries(v), segment_ids_bt=segment_ids_bt)
        o = checkpoint_name(constrain(o, ("batch", "seq", "heads", "head_dim")), "attn_context")
        return self._out(o, lay)

    def cached(self, x_btd, positions_bt, allowed_bts, k_bskh, v_bskh, index):
        """Attention of ``t`` new tokens written into one layer's KV cache at slot ``index``: returns the
        output and the updated ``(k, v)`` caches. ``allowed_bts`` says which cache slots each new token
        sees (left padding and causality; :meth:`Decoder.__call__` with ``cache=`` builds it)."""
        lay = head_layout(self.wq_dnh[...].shape[1], self.wk_dkh[...].shape[1])
        q, k, v = self._qkv(x_btd, positions_bt, lay)
        k_bskh = constrain(write_cache(k_bskh, k, index), CACHE_LAYER)
        v_bskh = constrain(write_cache(v_bskh, v, index), CACHE_LAYER)
        o = cache_attention(q, lay.kv_for_queries(k_bskh).astype(q.dtype), lay.kv_for_queries(v_bskh).astype(q.dtype),
                            allowed_bts)
        return self._out(o, lay, flat=True), k_bskh, v_bskh


#: the masked logits' value (``jax.nn.dot_product_attention``'s): finite, so a row never holds only -inf
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def cache_attention(q_btnh, k_bskh, v_bskh, allowed_bts):
    """Attention of ``t`` new queries over a KV cache of ``s`` slots, ``allowed_bts`` the slots each query sees:
    ``jax.nn.dot_product_attention``'s arithmetic (logits in f32, scaled after the dot, softmax in f32).
    Grouped KV heads are not repeated: the query heads are split ``(kv_heads, group)`` (query head ``i``
    uses KV head ``i // group``, as ``jnp.repeat`` would pair them) and each product is one batched matmul
    over ``(batch, kv_heads)``, so the cache is read as it is stored. Why: repeating the cache per query head
    copied it ``group`` times at every decode step, and with many rows (a server's batch) those copies cost
    more than the weights (BENCHMARKS.md, "Serving, third pass": a 24M-parameter Llama, 8 query / 2 KV heads,
    16 rows x 256 positions: 70-123 ms per step with the copies, 32-44 ms without; 1 row: the same within
    the host's noise; ``tiny``, 64 rows: 14 -> 8.5 ms).
    Why not ``dot_product_attention`` itself: its grouped form became library (YNNPACK) calls on XLA:CPU that
    cost 1-2 us each at decode sizes (profiled, ``tiny``)."""
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    q_btkgh = q_btnh.reshape(b, t, kv, n // kv, h)
    logits_bkgts = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32)
    logits_bkgts = jnp.where(allowed_bts[:, None, None], logits_bkgts * (h ** -0.5), MASKED)
    probs_bkgts = jax.nn.softmax(logits_bkgts, axis=-1).astype(v_bskh.dtype)
    o_btkgh = jnp.einsum("bkgts,bskh->btkgh", probs_bkgts, v_bskh)
    return o_btkgh.reshape(b, t, n, h).astype(q_btnh.dtype)


def write_cache(cache_bskh, new_btkh, index):
    """``cache_bskh`` with ``new_btkh`` written from slot ``index``: an int32 scalar (every row at the same
    slot: left-padded batches) or ``(batch,)``, one slot per row for one new token each (a server's rows
    are at different lengths: :mod:`meshtrain.serving.slots`); a slot past the end writes nothing."""
    new_btkh = new_btkh.astype(cache_bskh.dtype)
    if jnp.ndim(index) == 0:
        return jax.lax.dynamic_update_slice_in_dim(cache_bskh, new_btkh, index, axis=1)
    if new_btkh.shape[1] != 1:
        raise ConfigError(f"a per-row cache index writes one token per row; got {new_btkh.shape[1]}")
    rows = jnp.arange(cache_bskh.shape[0], dtype=jnp.int32)
    return cache_bskh.at[rows, index].set(new_btkh[:, 0], mode="drop")  # a scatter: in place in a donated cache


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` (GeGLU with ``mlp_activation="gelu_tanh"``); ``mlp`` is
    the column/row split axis."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.gate_df = _param(rngs, _init(0, 1), (d, f), ("embed", "mlp"))
        self.up_df = _param(rngs, _init(0, 1), (d, f), ("embed", "mlp"))
        self.down_fd = _param(rngs, _init(0, 1), (f, d), ("mlp", "embed"))
        self.activation = cfg.mlp_activation
        self.fp8_gate, self.fp8_up, self.fp8_down = (fp8.dot_meta() for _ in range(3))  # None unless FP8

    def __call__(self, x_btd):
        gate_btf = _dense("btd,df->btf", x_btd, self.gate_df[...], self.fp8_gate)
        h_btf = ACTIVATIONS[self.activation](gate_btf) * _dense("btd,df->btf", x_btd, self.up_df[...], self.fp8_up)
        h_btf = checkpoint_name(constrain(h_btf, ("batch", "seq", "mlp")), "mlp_hidden")
        return _dense("btf,fd->btd", h_btf, self.down_fd[...], self.fp8_down)


class Block(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_offset)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_offset)
        self.mlp = MLP(cfg, rngs) if not cfg.n_experts else MoE(cfg.moe(), rngs)

    def __call__(self, x_btd, positions_bt, segment_ids_bt):
        x_btd = constrain(x_btd + self.attn(self.attn_norm(x_btd), positions_bt, segment_ids_bt), RESIDUAL)
        return constrain(x_btd + self.mlp(self.mlp_norm(x_btd)), RESIDUAL)

    def cached(self, x_btd, positions_bt, allowed_bts, k_bskh, v_bskh, index):
        """:meth:`__call__` for new tokens against this layer's KV cache (see :meth:`Attention.cached`)."""
        a_btd, k_bskh, v_bskh = self.attn.cached(self.attn_norm(x_btd), positions_bt, allowed_bts, k_bskh, v_bskh,
                                                 index)
        x_btd = constrain(x_btd + a_btd, RESIDUAL)
        return constrain(x_btd + self.mlp(self.mlp_norm(x_btd)), RESIDUAL), k_bskh, v_bskh


class Decoder(nnx.Module):
    """Token ids ``(batch, seq)`` → logits ``(batch, seq, vocab)``."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        emb_init = jax.nn.initializers.normal(1.0 if not cfg.tie_embeddings else cfg.d_model ** -0.5)
        self.embedding_vd = _param(rngs, emb_init, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(cfg, rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_offset)
        if not cfg.tie_embeddings:
            self.lm_head_dv = _param(rngs, _init(0, 1), (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

    def __call__(self, tokens_bt, positions_bt: Optional[jax.Array] = None,
                 segment_ids_bt: Optional[jax.Array] = None, *, cache=None):
        """Logits of ``tokens_bt``; with ``cache=`` (a KV cache, e.g. :class:`meshtrain.generation.KVCache`)
        ``(logits, cache)`` for generation: see :meth:`cached`. Without a cache this is the training
        forward pass, unchanged."""
        if cache is not None:
            return self.cached(tokens_bt, cache)
        cfg = self.cfg
        if tokens_bt.shape[1] > cfg.max_seq_len:
            raise ConfigError(f"sequence length {tokens_bt.shape[1]} exceeds max_seq_len {cfg.max_seq_len} of "
                             f"model {cfg.name!r}")
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(layout_positions(tokens_bt.shape[1]), tokens_bt.shape)
        x_btd = self.embed(tokens_bt)

        graphdef, layers = nnx.split(self.blocks)

        def layer(x_btd, layer_state):
            block = nnx.merge(graphdef, layer_state)
            x_btd = block(x_btd, positions_bt, segment_ids_bt)
            # MoE router statistics leave the scan as outputs (dense blocks: none, the program is unchanged)
            return x_btd, (pop_moe_stats(block) if cfg.n_experts else None)

        x_btd, stats = scan_layers(layer, x_btd, layers)
        if stats:  # their mean over layers, for the loss (meshtrain.models.moe.pop_moe_stats)
            self.moe_stats = nnx.Intermediate({k: jnp.mean(v) for k, v in stats.items()})
        return self.head(x_btd)

    def embed(self, tokens_bt):
        """Token ids → the residual stream (``embed_scale`` × the embedding rows)."""
        x_btd = jnp.take(self.embedding_vd[...], tokens_bt, axis=0)
        if self.cfg.embed_scale != 1.0:
            x_btd = x_btd * jnp.asarray(self.cfg.embed_scale, x_btd.dtype)
        return constrain(x_btd, RESIDUAL)

    def head(self, x_btd):
        """Final norm and the vocabulary projection (tied: the embedding, times ``tied_head_scale``)."""
        cfg = self.cfg
        x_btd = self.final_norm(x_btd)
        if cfg.tie_embeddings:
            scale = cfg.d_model ** -0.5 if cfg.tied_head_scale is None else cfg.tied_head_scale
            logits = jnp.einsum("btd,vd->btv", x_btd, self.embedding_vd[...])
            logits = logits * scale if scale != 1.0 else logits
        else:
            logits = _dense("btd,dv->btv", x_btd, self.lm_head_dv[...], None)
        return constrain(logits, ("batch", "seq", "vocab"))

    # -- generation: the same layers against a KV cache --------------------------------------------
    def cached(self, tokens_bt, cache, *, load_layer=None):
        """``(logits, cache)`` for ``t`` new tokens per row written at cache slot ``cache.index``.

        ``cache`` is a dataclass with ``k`` and ``v`` ``(layers, batch, seq, kv_heads, head_dim)``,
        ``index`` (int32 scalar: the slot of ``tokens_bt[:, 0]``) and ``pad`` ``(batch,)`` (int32: each
        row's left padding: slots ``< pad`` hold no token). Prompts are **left-padded**, so every row
        writes its next token at the same slot; row ``b``'s token at slot ``s`` has position
        ``s - pad[b]`` and sees the slots ``pad[b] .. s``. Returns the cache with ``k``/``v`` written
        and ``index`` advanced by ``t`` (``dataclasses.replace``). MoE router statistics are dropped.
        ``load_layer``: applied to each layer's parameters inside the layer loop, before the block runs
        (generation: int8 dequantisation and host-to-device copies, one layer at a time)."""
        cfg = self.cfg
        t = tokens_bt.shape[1]
        slots_t = cache.index + jnp.arange(t, dtype=jnp.int32)
        positions_bt = jnp.maximum(slots_t[None, :] - cache.pad[:, None], 0)
        keys_s = jnp.arange(cache.k.shape[2], dtype=jnp.int32)
        allowed_bts = ((keys_s[None, None, :] >= cache.pad[:, None, None])
                       & (keys_s[None, None, :] <= slots_t[None, :, None]))
        # a padding slot's query sees itself, so no softmax row is empty (its output is never read)
        allowed_bts = allowed_bts | (keys_s[None, :] == slots_t[:, None])[None]
        x_btd = self.embed(tokens_bt)
        graphdef, layers = nnx.split(self.blocks)

        def layer(x_btd, xs):
            layer_state, k_bskh, v_bskh = xs
            block = nnx.merge(graphdef, load_layer(layer_state) if load_layer else layer_state)
            x_btd, k_bskh, v_bskh = block.cached(x_btd, positions_bt, allowed_bts, k_bskh, v_bskh, cache.index)
            if cfg.n_experts:
                pop_moe_stats(block)  # router statistics are for the training loss
            return x_btd, (k_bskh, v_bskh)

        x_btd, (k, v) = scan_layers(layer, x_btd, (layers, cache.k, cache.v))
        return self.head(x_btd), dataclasses.replace(cache, k=k, v=v, index=cache.index + t)

    # -- pipeline contract (meshtrain.parallel.pipeline): the same parts __call__ runs ------------
    def pipeline_parts(self) -> "PipelineParts":
        """Embedding, the ``blocks`` stack (leading ``layers`` axis) and final norm + head, for the
        pipeline schedules; ``model(tokens, positions, segment_ids)`` arguments go to ``before``."""
        return PipelineParts(stack="blocks", before=self.pipeline_before, layer=_pipeline_layer,
                             after=self.pipeline_after, sown=self.pipeline_sown)

    def pipeline_before(self, tokens_bt, positions_bt: Optional[jax.Array] = None,
                        segment_ids_bt: Optional[jax.Array] = None):
        if tokens_bt.shape[1] > self.cfg.max_seq_len:
            raise ConfigError(f"sequence length {tokens_bt.shape[1]} exceeds max_seq_len {self.cfg.max_seq_len} of "
                              f"model {self.cfg.name!r}")
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(layout_positions(tokens_bt.shape[1]), tokens_bt.shape)
        return self.embed(tokens_bt), {"positions": positions_bt, "segment_ids": segment_ids_bt}

    def pipeline_sown(self, values):
        """What ``__call__`` keeps of its layers' stored values, from one micro-batch's ``values`` (the
        blocks' ``nnx.Intermediate`` state, leading ``layers`` axis): the MoE router statistics' mean over
        layers, for the loss (dense blocks store nothing)."""
        found = find_moe_stats(values)
        if found:  # per layer: the mean over the block's MoE layers (pop_moe_stats); then over layers
            self.moe_stats = nnx.Intermediate({k: jnp.mean(jnp.mean(jnp.stack([jnp.asarray(f[k], jnp.float32)
                                                                                for f in found]), axis=0))
                                               for k in found[0]})

    def pipeline_after(self, x_btd, side):
        return self.head(x_btd)


def _pipeline_layer(block, x_btd, side):
    return block(x_btd, side["positions"], side["segment_ids"])


from meshtrain.parallel.pipeline import PipelineParts  # noqa: E402  (appended: the pipeline contract type)
