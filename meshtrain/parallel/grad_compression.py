"""Compressed gradient reduction across DCN (the ``grad_compression`` option of ``dp`` and ``hsdp``).

Across slices (DCN) links are ~10-50x slower than inside one (ICI), and a data-parallel step sends
the whole gradient over them. With ``grad_compression`` the step

1. computes each ``data`` replica's gradient sum under ``shard_map`` over ``data`` only: everything
   inside the slice (the FSDP reduce-scatter over ``fsdp``, tensor parallel sums) is left to XLA and
   stays exact, in full precision;
2. compresses each device's shard of its slice's gradient (``int8`` or ``onebit`` below);
3. all-gathers the compressed payloads over ``data`` (the only collective that crosses DCN), and
4. decompresses and sums them, in f32, on every replica (all replicas see the same sum).

Schemes (blocks of :data:`BLOCK` values of the flattened local shard):

* ``int8``: per-block absmax scale (f32), values rounded to int8. Relative error ~1/254 of the block's
  largest value; unbiased enough that no state is kept. Payload: 1 byte + 4/:data:`BLOCK` per value.
* ``onebit``: *compressed all-gather with error feedback* (1-bit SGD, Seide et al. 2014; EF-SGD,
  Karimireddy et al. 2019): ``c = g + e``; send ``sign(c)`` packed 8 per byte and the block's mean
  ``|c|``; keep ``e = c - decompress(c)``. We chose it over 1-bit Adam because it compresses the
  *gradient* and leaves the optimizer alone (any optax transformation, AdamW included, runs unchanged on
  the reduced gradient, and no full-precision warm-up phase is needed); error feedback makes the
  compression error a delay rather than a loss, so the sum of what is applied tracks the sum of true
  gradients. Payload: 1/8 byte + 4/:data:`BLOCK` per value. The residual ``e`` is per replica and per
  device shard: an :class:`ErrorFeedback` variable ``(data replicas, *param shape)`` of f32 with logical
  axes ``("grad_replica", *param axes)`` (``grad_replica -> data``), i.e. model state that the plan
  shards like the parameter, checkpoints keep and restores reshard.

  With Adam (any optax chain holding one ``ScaleByAdamState``) each value is weighted by ``sqrt(nu)`` before the
  signs are taken (:func:`value_weights`): plain sign + block mean hands every value of a block the same
  magnitude, and Adam's second moment learns it. ``grad_compression_warmup`` K runs the first K steps
  uncompressed (a second compiled program) so that ``nu``, and with it the weights, is learnt from exact
  gradients, as 1-bit Adam's warm-up does. Measured (``small``, 250 steps, AdamW lr 3e-3): this narrows the
  final-loss gap from +48 % to the figure in README "Compressed gradient reduction across slices", which still
  misses a 2 % bar: compressing the *momentum* with a frozen variance (1-bit Adam proper) is what is left.

Example::

    recipe = mt.get_recipe("hsdp").with_mesh(dcn={"data": 2}, data=1).with_options(grad_compression="onebit")
    abstract = mt.abstract_state(feedback_factory(factory, recipe), optax.adamw(3e-4))
    step = mt.make_train_step(mt.make_plan(abstract, recipe, mesh, batch=mt.BatchSpec(16, 128)))
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from meshtrain.errors import ConfigError
from meshtrain.rules import AxisRules, Rule
from meshtrain.strategies import HSDP, DataParallel, GradCompression

#: values per scale (of a device's flattened gradient shard)
BLOCK = 256
#: the mesh axis compressed (the data-parallel axis; it must be the DCN one)
AXIS = "data"
#: the model attribute holding the residuals and their logical axis over the replicas
FEEDBACK_ATTR = "grad_feedback"
REPLICA_AXIS = "grad_replica"


class ErrorFeedback(nnx.Variable):
    """One parameter's error-feedback residual per ``data`` replica (``onebit``): model state, never optimised."""


@dataclasses.dataclass(frozen=True)
class CompressionChoice:
    """What the step does with the gradient reduction over :data:`AXIS` (``kind`` ``none``: nothing special).
    ``replicas`` is the ``data`` size (the DCN slices exchanging), ``payload_bytes_per_value`` what one gradient
    value costs on DCN, ``reason`` the line the plan prints."""

    kind: GradCompression
    replicas: int = 1
    reason: str = "none: the gradient all-reduce over `data` is full precision"
    #: the first ``warmup`` steps are sent uncompressed (the step's other program; see ``make_train_step``)
    warmup: int = 0

    @property
    def active(self) -> bool:
        return self.kind is not GradCompression.NONE

    @property
    def has_feedback(self) -> bool:
        return self.kind is GradCompression.ONEBIT

    @property
    def payload_bytes_per_value(self) -> float:
        bits = {GradCompression.INT8: 8.0, GradCompression.ONEBIT: 1.0}.get(self.kind, 32.0)
        return bits / 8 + (4.0 / BLOCK if self.active else 0.0)


def _dimension(recipe):
    return recipe.dimension(HSDP) or recipe.dimension(DataParallel)


def resolve(recipe, sizes=None) -> CompressionChoice:
    """The recipe's :class:`CompressionChoice`, or a :class:`ConfigError` naming the fix where it cannot apply:
    ``data`` must be the DCN axis (``dcn: {data: N}``, N > 1, and ``ici`` data 1 so that the reduction inside a
    slice stays exact), and the recipe has no pipeline, expert or context dimension (their kernels already run
    under ``shard_map``). ``sizes``: the mesh's axis sizes, checked when given."""
    dim = _dimension(recipe)
    kind = dim.grad_compression if dim is not None else GradCompression.NONE
    if kind is GradCompression.NONE:
        return CompressionChoice(kind)
    dcn = dict(recipe.mesh.dcn).get(AXIS, 1)
    ici = dict(recipe.mesh.ici).get(AXIS, 1)
    if dcn <= 1:
        raise ConfigError(f"grad_compression={kind.value}: recipe {recipe.name!r} has no data-parallel axis across "
                          f"DCN (mesh dcn {dict(recipe.mesh.dcn) or '{}'}); compression applies to the `data` axis "
                          f"between slices: put it on DCN (recipe mesh dcn: {{data: 2}}, ici data: 1) or use "
                          f"--grad-compression none")
    if ici != 1:
        raise ConfigError(f"grad_compression={kind.value}: `data` spans {ici} devices inside a slice as well as {dcn} "
                          f"slices; the reduction inside a slice must stay exact, so set ici data: 1 (put the "
                          f"devices of a slice on `fsdp`, e.g. the hsdp recipe) or use --grad-compression none")
    others = [s.key for s in recipe.strategies if s.key in ("pp", "ep", "cp")]
    if others:
        raise ConfigError(f"grad_compression={kind.value} runs the loss under shard_map over `data`, which the "
                          f"{'/'.join(others)} kernels of recipe {recipe.name!r} do not support yet; use "
                          f"--grad-compression none with them")
    if recipe.grad_accum != 1:
        raise ConfigError(f"grad_compression={kind.value} exchanges each step's gradient once; grad_accum "
                          f"{recipe.grad_accum} is not supported with it yet: raise the batch instead, or use "
                          f"--grad-compression none")
    if sizes is not None and sizes.get(AXIS, 1) != dcn:
        raise ConfigError(f"grad_compression={kind.value}: the mesh's `data` axis has {sizes.get(AXIS, 1)} devices, "
                          f"the recipe's dcn data {dcn}")
    what = ("int8 with per-block scales" if kind is GradCompression.INT8
            else "sign bits + per-block scale with error feedback (f32 residual per replica, model state), "
                 "each value weighted by Adam's second moment")
    warmup = dim.grad_compression_warmup
    return CompressionChoice(kind, dcn, f"{kind.value}: {what}, all-gathered over `data` (DCN, {dcn} slices) "
                                        f"after the exact reduction inside each slice"
                                        + (f"; the first {warmup} steps full precision" if warmup else ""), warmup)


# ---- the error-feedback state (model state) ----------------------------------------------------------------

class GradFeedback(nnx.Module):
    """The residuals of every parameter, in the order of ``jax.tree.leaves`` of the parameters' pure dict."""

    def __init__(self, params_state, replicas: int):
        leaves = jax.tree.leaves(params_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        self.residuals = nnx.List([
            ErrorFeedback(jnp.zeros((replicas,) + tuple(v.shape), jnp.float32),
                          out_sharding=(REPLICA_AXIS,) + tuple(getattr(v, "out_sharding", None) or
                                                               (None,) * len(v.shape)))
            for v in leaves])


def feedback_factory(factory: Callable, recipe) -> Callable:
    """``factory`` whose model also holds the ``onebit`` error feedback (``factory`` itself otherwise).

    Wrap the factory before :func:`meshtrain.abstract_state`, like :func:`meshtrain.fp8.recipe_factory`::

        abstract = mt.abstract_state(feedback_factory(factory, recipe), tx)
    """
    choice = resolve(recipe)
    if not choice.has_feedback:
        return factory

    def build(rngs):
        model = factory(rngs)
        setattr(model, FEEDBACK_ATTR, GradFeedback(nnx.state(model, nnx.Param), choice.replicas))
        return model

    build.grad_feedback = choice.replicas
    return build


def feedback_of(model_state) -> Optional[list]:
    """The residual leaves in a model-state pure dict (``None`` without them)."""
    holder = model_state.get(FEEDBACK_ATTR) if isinstance(model_state, dict) else None
    return None if holder is None else jax.tree.leaves(holder)


def with_feedback(model_state, residuals):
    holder = model_state[FEEDBACK_ATTR]
    return {**model_state, FEEDBACK_ATTR: jax.tree.unflatten(jax.tree.structure(holder), residuals)}


# ---- compression of one local shard ------------------------------------------------------------------------

def _blocks(x) -> Tuple[jax.Array, int]:
    flat = x.reshape(-1).astype(jnp.float32)
    pad = -flat.size % BLOCK
    return jnp.pad(flat, (0, pad)).reshape(-1, BLOCK), flat.size


def compress_int8(x):
    """``(int8 values (blocks, BLOCK), f32 scales (blocks,))`` of ``x`` (absmax per block)."""
    b, _ = _blocks(x)
    scale = jnp.max(jnp.abs(b), axis=1) / 127.0
    q = jnp.round(b / jnp.where(scale > 0, scale, 1.0)[:, None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale


def decompress_int8(q, scale):
    return q.astype(jnp.float32) * scale[..., None]


def compress_onebit(x):
    """``(packed sign bits uint8 (blocks, BLOCK/8), f32 scales (blocks,))``: scale = mean |x| of the block."""
    b, _ = _blocks(x)
    scale = jnp.mean(jnp.abs(b), axis=1)
    return jnp.packbits(b >= 0, axis=1), scale


def decompress_onebit(bits, scale):
    signs = jnp.unpackbits(bits, axis=-1, count=BLOCK).astype(jnp.float32) * 2.0 - 1.0
    return signs * scale[..., None]


def _unblock(b, like):
    return b.reshape(-1)[:like.size].reshape(like.shape)


def value_weights(second_moment):
    """Blocked ``(blocks, BLOCK)`` per-value weights ``sqrt(nu)`` for :func:`exchange` from the optimizer's second
    moment ``nu`` (this device's flattened shard): floored at 1 % of the block's mean so that a value with no
    history yet (an embedding row first seen now) cannot swamp its block, and 1 for a block with no history at
    all (the first step). Only the *relative* weights inside a block matter: a constant factor cancels."""
    r, _ = _blocks(jnp.sqrt(second_moment))
    r = jnp.maximum(r, 0.01 * jnp.mean(r, axis=1, keepdims=True))
    return jnp.where(r > 0, r, 1.0)


def exchange(kind: GradCompression, g, residual=None, weights=None):
    """The sum over :data:`AXIS` of every replica's ``g`` (this device's local shard; inside ``shard_map``
    manual over :data:`AXIS`), sent compressed; returns ``(sum, new residual or None)``.

    ``weights`` (``onebit`` only; from :func:`value_weights`, the same on every replica): the signs are taken of
    ``(g + residual) / weights`` and the block's mean magnitude is sent in those units, so each value comes back
    as ``weights * scale * sign``: a value whose typical magnitude is small comes back small. Without them every
    value of a block comes back with the block's mean magnitude, which Adam's second moment then learns as that
    value's scale (its update shrinks by ``|g| / mean|g|``). The residual stays in gradient units."""
    if kind is GradCompression.INT8:
        payload = compress_int8(g)
        unpack = decompress_int8
    else:
        corrected = g.astype(jnp.float32) + residual
        w = 1.0 if weights is None else weights
        payload = compress_onebit(_blocks(corrected)[0] / w)
        unpack = lambda bits, scale: w * decompress_onebit(bits, scale)  # noqa: E731 (w: this device's, = every replica's)
        residual = corrected - _unblock(unpack(*payload), g)
    gathered = [jax.lax.all_gather(p, AXIS) for p in payload]   # the DCN collective: int8 / packed bits
    total = jnp.sum(unpack(*gathered), axis=0)
    return _unblock(total, g), residual


# ---- the step's reduction ------------------------------------------------------------------------------------

def local_rules(rules: AxisRules) -> AxisRules:
    """``rules`` without :data:`AXIS` (inside ``shard_map`` over it, activations are this replica's rows)."""
    drop = lambda table: tuple(Rule(r.logical, tuple(a for a in r.mesh_axes if a != AXIS), r.source)  # noqa: E731
                               for r in table)
    return AxisRules(drop(rules.params), drop(rules.activations), drop(rules.optimizer))


def _batch_specs(plan):
    return [P() if leaf.batch_dim is None else P(*([None] * leaf.batch_dim), AXIS) for _, leaf in plan.batch.leaves()]


def per_replica(local_fn, plan, params, model_state, batch):
    """``local_fn(params, model_state, batch) -> (total, weight, metrics, grads, model_state)`` on each
    ``data`` replica's rows (``shard_map`` over ``data`` only; the other axes stay XLA's). Returns the
    sums of total / weight / metrics over replicas and each replica's gradient stacked on a leading axis
    ``(data, *param shape)`` sharded over ``data`` (nothing reduced across DCN yet)."""
    mesh = plan.mesh
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    batch_specs = jax.tree_util.tree_unflatten(treedef, _batch_specs(plan))
    residuals = feedback_of(model_state)
    ms_specs = jax.tree.map(lambda _: P(), model_state)
    if residuals is not None:
        ms_specs = with_feedback(ms_specs, [P(AXIS)] * len(residuals))

    def body(params, model_state, batch):
        # varying over `data`: otherwise autodiff's transpose of the broadcast psums the gradient over it
        params = jax.lax.pcast(params, (AXIS,), to="varying")
        total, weight, metrics, grads, new_ms = local_fn(params, model_state, batch)
        sums = jax.lax.psum((total, weight, metrics), AXIS)
        return sums, jax.tree.map(lambda g: g[None], grads), new_ms

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), ms_specs, batch_specs),
                       out_specs=(P(), P(AXIS), ms_specs), axis_names={AXIS})
    (total, weight, metrics), stacked, new_ms = fn(params, model_state, batch)
    return total, weight, metrics, stacked, new_ms


def adam_second_moment(opt_state, params):
    """The optimizer's second moment ``nu`` (the one optax ``ScaleByAdamState`` in ``opt_state``: adam, adamw,
    chained with clipping...) when it is laid out like ``params``; ``None`` for other optimizers (``onebit`` then
    sends plain block-mean magnitudes)."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
             if isinstance(s, optax.ScaleByAdamState)]
    if len(found) != 1 or jax.tree.structure(found[0].nu) != jax.tree.structure(params):
        return None
    return found[0].nu


def reduce_across_dcn(choice: CompressionChoice, plan, stacked, grad_sh, model_state, second_moment=None):
    """Sum the stacked per-replica gradients over ``data`` through :func:`exchange` (every mesh axis
    manual: each device compresses only its own shard). ``second_moment``: :func:`adam_second_moment`
    (``onebit`` weighs values by it; ``None``: no weights). Returns ``(grads laid out as grad_sh, model_state
    with the new residuals)``."""
    specs = jax.tree.map(lambda s: s.spec, grad_sh)
    stacked_specs = jax.tree.map(lambda s: P(AXIS, *s), specs, is_leaf=lambda x: isinstance(x, P))
    residuals = feedback_of(model_state)
    flat_specs, treedef = jax.tree_util.tree_flatten(specs, is_leaf=lambda x: isinstance(x, P))
    flat_stacked = jax.tree.leaves(stacked_specs, is_leaf=lambda x: isinstance(x, P))
    moment = second_moment if choice.has_feedback else None

    def body(stacked, residuals, moment):
        # one bucket per device: every local shard flattened and joined (one DCN exchange, padding only at its end)
        local = [g[0] for g in jax.tree.leaves(stacked)]
        sizes = np.cumsum([g.size for g in local])[:-1]
        bucket = jnp.concatenate([g.reshape(-1).astype(jnp.float32) for g in local])
        res = None if residuals is None else jnp.concatenate([r[0].reshape(-1) for r in residuals])
        weights = None if moment is None else value_weights(
            jnp.concatenate([m.reshape(-1).astype(jnp.float32) for m in jax.tree.leaves(moment)]))
        total, new_res = exchange(choice.kind, bucket, res, weights)
        out = [t.reshape(g.shape) for t, g in zip(jnp.split(total, sizes), local)]
        if new_res is not None:
            new_res = [r.reshape((1,) + g.shape) for r, g in zip(jnp.split(new_res, sizes), local)]
        return jax.tree_util.tree_unflatten(treedef, out), new_res

    res_specs = None if residuals is None else flat_stacked
    # (check_vma off: the all-gathered sum is the same on every `data` replica, which JAX cannot infer)
    moment_specs = None if moment is None else specs   # laid out like the gradient: the same shard per device
    fn = jax.shard_map(body, mesh=plan.mesh, in_specs=(stacked_specs, res_specs, moment_specs),
                       out_specs=(specs, res_specs), check_vma=False)
    grads, new_res = fn(stacked, residuals, moment)
    return grads, (model_state if residuals is None else with_feedback(model_state, new_res))


def check_model_state(plan) -> None:
    """Refuse model state the per-replica ``shard_map`` would change the meaning of (dropout RNG streams,
    batch statistics, FP8 scales: their values would be per replica)."""
    others = [k for k in plan.abstract.model_state if k != FEEDBACK_ATTR]
    if others:
        raise ConfigError(f"grad_compression supports models whose only non-parameter state is its error "
                          f"feedback; this model also has {sorted(others)} (dropout RNG, batch statistics or FP8 "
                          f"scales); use --grad-compression none")


def dcn_payload_bytes(n_values: int, kind: GradCompression) -> float:
    """Bytes one device's compressed shard of ``n_values`` gradient values occupies on the wire."""
    blocks = int(np.ceil(n_values / BLOCK))
    if kind is GradCompression.INT8:
        return blocks * BLOCK + 4 * blocks
    if kind is GradCompression.ONEBIT:
        return blocks * BLOCK / 8 + 4 * blocks
    return 4 * n_values
