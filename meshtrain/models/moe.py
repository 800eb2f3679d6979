"""A mixture-of-experts feed-forward layer (Flax NNX, logical names only), usable in any model.

Router (f32, top-``k`` over softmax scores), ``n_experts`` SwiGLU experts of width ``d_expert``
(fine-grained experts: many narrow ones), optional DeepSeek-style *shared* experts (one SwiGLU of
width ``n_shared · d_expert`` that every token passes through), capacity or dropless dispatch
(:mod:`meshtrain.parallel.moe`). Weights carry ``expert`` on the expert dimension and the usual
names elsewhere (``embed``, ``mlp``), so the recipes' rules place them: ``ep`` shards ``expert``,
FSDP ``embed``, TP ``mlp``.

Each call stores its router statistics (``aux_loss``, ``z_loss``, ``load_max``, ``drop_frac`` and
the weighted ``penalty`` to add to the loss) into ``nnx.Intermediate`` under ``"moe_stats"``. Pop
them where the layer ran: inside a layer scan, pop in the scan body and return them as scan
outputs (the reference decoder does); in your loss, :func:`moe_loss_terms` turns them into the
loss contract's extra loss and metrics.

Example (your own model)::

    class MyBlock(nnx.Module):
        def __init__(self, rngs):
            self.ffn = MoE(MoEConfig(d_model=64, n_experts=8, top_k=2, d_expert=32), rngs)
        def __call__(self, x_btd):
            return x_btd + self.ffn(x_btd)

    def loss_fn(model, batch):
        ce_sum, count = ...                               # your loss
        extra, metrics = moe_loss_terms(pop_moe_stats(model), count)
        return ce_sum + extra, count, metrics             # metrics: moe_aux_loss, moe_load_max, ...
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain import fp8
from meshtrain.annotate import constrain
from meshtrain.errors import ConfigError
from meshtrain.parallel.moe import STAT_KEYS, capacity_for, check_capacity_factor, experts, route

STATS_NAME = "moe_stats"

#: The ``DecoderConfig`` field a ``MoEConfig`` field comes from, where the names differ (errors name both).
_DECODER_FIELDS = {"top_k": "experts_per_token", "n_shared": "n_shared_experts"}


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _where(name: str) -> str:
    return f" (DecoderConfig.{_DECODER_FIELDS[name]})" if name in _DECODER_FIELDS else ""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of one MoE layer.

    Args:
      d_model: input/output width.
      n_experts: routed experts ``E``.
      top_k: experts per token (1 <= top_k <= n_experts).
      d_expert: hidden width of each routed expert.
      n_shared: shared experts (DeepSeek-MoE), each ``d_expert`` wide; 0 for none.
      capacity_factor: slots per expert per sequence = ``min(T, ceil(cf · T · k / E))``; ``None``: dropless.
      aux_coef, z_coef: weights of the load-balancing and router z losses added to the training loss.
      norm_topk: renormalise the ``k`` chosen probabilities to sum to 1 (Mixtral, Qwen3); ``False``
        keeps raw softmax scores (Switch, DeepSeek-V2).
    """

    d_model: int
    n_experts: int
    top_k: int
    d_expert: int
    n_shared: int = 0
    capacity_factor: Optional[float] = 1.25
    aux_coef: float = 0.01
    z_coef: float = 1e-3
    norm_topk: bool = True

    def __post_init__(self):
        # Checked here, at read time, so that nothing invalid reaches the jitted step (where the error
        # would surface as a tracing failure or an out-of-memory compile).
        for name, low in (("n_experts", 1), ("d_expert", 1), ("n_shared", 0)):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ConfigError(f"{name}={value!r}{_where(name)}: use an integer >= {low}"
                                  + (" (use n_experts=0 in a DecoderConfig for a dense MLP)" if name == "n_experts"
                                     else ""))
        if not _is_int(self.top_k) or not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"top_k={self.top_k!r} with {self.n_experts} experts{_where('top_k')}: choose an integer "
                              f"1 <= top_k <= n_experts (e.g. top_k=2), or add experts")
        check_capacity_factor(self.capacity_factor)

    def num_params(self) -> int:
        d = self.d_model
        return d * self.n_experts + 3 * d * self.d_expert * (self.n_experts + self.n_shared)

    def active_params(self) -> int:
        """Parameters one token multiplies with: router, ``top_k`` routed and the shared experts."""
        d = self.d_model
        return d * self.n_experts + 3 * d * self.d_expert * (self.top_k + self.n_shared)


def _init(in_axis, out_axis, batch_axis=()):
    return jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=in_axis,
                                                out_axis=out_axis, batch_axis=batch_axis)


class MoE(nnx.Module):
    """``x (batch, seq, d) -> (batch, seq, d)`` through the routed (and shared) experts."""

    def __init__(self, cfg: MoEConfig, rngs: nnx.Rngs):
        d, e, f = cfg.d_model, cfg.n_experts, cfg.d_expert
        self.cfg = cfg
        p = lambda init, shape, names: nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=names)  # noqa
        self.router_de = p(_init(0, 1), (d, e), ("embed", None))
        self.gate_edf = p(_init(1, 2, 0), (e, d, f), ("expert", "embed", "mlp"))
        self.up_edf = p(_init(1, 2, 0), (e, d, f), ("expert", "embed", "mlp"))
        self.down_efd = p(_init(1, 2, 0), (e, f, d), ("expert", "mlp", "embed"))
        if cfg.n_shared:
            s = cfg.n_shared * f
            self.shared_gate_df = p(_init(0, 1), (d, s), ("embed", "mlp"))
            self.shared_up_df = p(_init(0, 1), (d, s), ("embed", "mlp"))
            self.shared_down_fd = p(_init(0, 1), (s, d), ("mlp", "embed"))
        # FP8 scales (None unless built by meshtrain.fp8.fp8_factory): routed experts' gate/up/down, shared ones
        self.fp8_gate, self.fp8_up, self.fp8_down = (fp8.dot_meta() for _ in range(3))
        if cfg.n_shared:
            self.fp8_shared_gate, self.fp8_shared_up, self.fp8_shared_down = (fp8.dot_meta() for _ in range(3))

    def __call__(self, x_btd):
        cfg = self.cfg
        x_btd = constrain(x_btd, ("batch", "seq", "embed"))
        logits_bte = jnp.einsum("btd,de->bte", x_btd.astype(jnp.float32), self.router_de[...].astype(jnp.float32))
        cap = None if cfg.capacity_factor is None else capacity_for(cfg.capacity_factor, x_btd.shape[1], cfg.top_k,
                                                                    cfg.n_experts)
        r = route(logits_bte, cfg.top_k, capacity=cap, norm_topk=cfg.norm_topk)
        # FP8: the experts' input and weights in e4m3 and their output's gradient in e5m2, quantized here
        # with per-tensor scales over all shards (inside the dispatch kernel's shard_map an amax would be
        # per device); the hidden activation inside the kernel stays in the compute dtype.
        xq_btd, w_gate = fp8.qdq_inputs(self.fp8_gate, x_btd, self.gate_edf[...])
        _, w_up = fp8.qdq_inputs(self.fp8_up, x_btd, self.up_edf[...])
        w_down = fp8.qdq_kernel(self.fp8_down, self.down_efd[...])
        y_btd = fp8.qdq_output_grad(self.fp8_down, experts(xq_btd, r, w_gate, w_up, w_down, capacity=cap))
        if cfg.n_shared:
            m_gate, m_up, m_down = self.fp8_shared_gate, self.fp8_shared_up, self.fp8_shared_down
            h = jax.nn.silu(fp8.einsum("btd,df->btf", x_btd, self.shared_gate_df[...], m_gate)) * \
                fp8.einsum("btd,df->btf", x_btd, self.shared_up_df[...], m_up)
            y_btd = y_btd + fp8.einsum("btf,fd->btd", constrain(h, ("batch", "seq", "mlp")), self.shared_down_fd[...],
                                       m_down)
        stats = dict(r.stats)
        stats["penalty"] = cfg.aux_coef * stats["aux_loss"] + cfg.z_coef * stats["z_loss"]
        setattr(self, STATS_NAME, nnx.Intermediate(stats))  # the latest call's statistics (cf. Module.sow)
        return constrain(y_btd.astype(x_btd.dtype), ("batch", "seq", "embed"))


def find_moe_stats(tree: Dict[str, Any]) -> List[Dict[str, jax.Array]]:
    """Every ``moe_stats`` value in a pure-dict tree of ``nnx.Intermediate`` state (any depth), in order:
    one dict of router statistics per MoE layer call."""
    found: List[Dict[str, jax.Array]] = []

    def walk(node):
        for key, value in node.items():
            if key == STATS_NAME:
                found.extend(value if isinstance(value, (tuple, list)) else (value,))
            elif isinstance(value, dict):
                walk(value)

    walk(tree)
    return found


def pop_moe_stats(module) -> Optional[Dict[str, jax.Array]]:
    """Remove every ``moe_stats`` stored in ``module`` (any depth) and return their mean per key (the
    mean over MoE layers), or ``None`` when there are none. Call it once per forward pass."""
    if not isinstance(module, nnx.Module):
        return None
    found = find_moe_stats(nnx.to_pure_dict(nnx.pop(module, nnx.Intermediate)))
    if not found:
        return None
    return {k: jnp.mean(jnp.stack([jnp.asarray(s[k], jnp.float32) for s in found])) for k in found[0]}


def moe_loss_terms(stats: Optional[Dict[str, jax.Array]], weight) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """``(extra loss sum, metric sums)`` for the loss contract: ``penalty · weight`` (so after the
    step divides by the weight the loss gains ``aux_coef·aux + z_coef·z``) and ``moe_<stat> · weight``
    for each of :data:`~meshtrain.parallel.moe.STAT_KEYS` (they arrive as the batch's values)."""
    if not stats:
        return jnp.zeros((), jnp.float32), {}
    w = jnp.asarray(weight, jnp.float32)
    return stats["penalty"] * w, {f"moe_{k}": stats[k] * w for k in STAT_KEYS if k in stats}
