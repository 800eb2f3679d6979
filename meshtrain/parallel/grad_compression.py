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
* ``onebit``: sign bits packed 8 per byte and the block's mean magnitude, with *error feedback* (1-bit SGD,
  Seide et al. 2014; EF-SGD, Karimireddy et al. 2019): ``c = x + e``; send ``sign(c)`` and mean ``|c|``; keep
  ``e = c - decompress(c)``. Payload: 1/8 byte + 4/:data:`BLOCK` per value. What ``x`` is depends on the
  optimizer (:func:`sent_quantity`), because error feedback only turns the compression error into a delay when
  the compressed quantity enters the update linearly:

  - with Adam (:func:`meshtrain.parallel.onebit_adam.onebit_adamw`, which ``meshtrain train`` builds for
    ``onebit``) it is **1-bit Adam** (Tang et al. 2021): ``grad_compression_warmup`` K exact steps learn Adam's
    variance, which then freezes, so the update ``m / (sqrt(nu) + eps)`` is linear in the momentum ``m``; each
    replica sends its local momentum ``x = b1 m + (1 - b1) g_i`` (``m``: the shared momentum, the same on every
    replica) and the replicas' average is the new ``m``. The frozen variance's level follows the global
    gradient's energy per block of 64 values (:func:`meshtrain.parallel.onebit_adam.track_variance`: one more
    f32 per block, all-reduced over ``data``). optax's own Adam is refused (EF on the gradient under
    Adam's growing variance measured +8.8 % final loss where 1-bit Adam measured the figure in README).
    1-bit Adam's second, server-side error feedback (compressing the average again for the way back) is not
    needed: every replica all-gathers every replica's compressed share and averages them itself, exactly and
    identically, so nothing is compressed twice.
  - with an optimizer linear in the gradient (SGD, with or without momentum) it is the gradient (EF-SGD).

  The residual ``e`` is per replica and per device shard: an :class:`ErrorFeedback` variable ``(data replicas,
  *param shape)`` of f32 with logical axes ``("grad_replica", *param axes)`` (``grad_replica -> data``), i.e.
  model state that the plan shards like the parameter, checkpoints keep and restores reshard. The all-gather
  brings each device ``replicas - 1`` payloads, ``(R - 1) x 0.14`` bytes per value, against a full-precision
  ring all-reduce's ``2 (R - 1) / R x 4``: 28x less at 2 slices, less saved as slices grow (even at ~50); 1-bit
  Adam's variance projections add ``2 (R - 1) / R x 4 / 64`` (together 19.7x less than f32 at 2 slices).

Example::

    recipe = mt.get_recipe("hsdp").with_mesh(dcn={"data": 2}, data=1).with_options(grad_compression="onebit")
    recipe = recipe.with_options(grad_compression_warmup=50)   # onebit with Adam: 1-bit Adam's exact warm-up
    abstract = mt.abstract_state(feedback_factory(factory, recipe), onebit_adamw(3e-4))
    step = mt.make_train_step(mt.make_plan(abstract, recipe, mesh, batch=mt.BatchSpec(16, 128)))
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from meshtrain.errors import ConfigError
from meshtrain.parallel import onebit_adam
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
            else "sign bits + per-block scale with error feedback (f32 residual per replica, model state); with "
                 "Adam 1-bit Adam: the momentum is sent, the variance frozen after the warm-up but for its level per "
                 "block of 64 values (one f32 per block all-reduced)")
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


def exchange(kind: GradCompression, x, residual=None):
    """The sum over :data:`AXIS` of every replica's ``x`` (this device's local shard of the gradient, or under
    1-bit Adam of its local momentum; inside ``shard_map`` manual over :data:`AXIS`), sent compressed; returns
    ``(sum, new residual or None)``. ``onebit`` sends ``sign(x + residual)`` and the block's mean magnitude and
    keeps what was not sent as the new residual (error feedback).

    (Weighing each value by ``sqrt(nu)`` before taking signs, i.e. compressing the momentum in the units of
    Adam's update, was measured worse under 1-bit Adam: BENCHMARKS.md "Compressed gradient reduction".)"""
    if kind is GradCompression.INT8:
        payload = compress_int8(x)
        unpack = decompress_int8
    else:
        corrected = x.astype(jnp.float32) + residual
        payload = compress_onebit(corrected)
        unpack = decompress_onebit
        residual = corrected - _unblock(unpack(*payload), x)
    gathered = [jax.lax.all_gather(p, AXIS) for p in payload]   # the DCN collective: int8 / packed bits
    total = jnp.sum(unpack(*gathered), axis=0)
    return _unblock(total, x), residual


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


class Momentum(NamedTuple):
    """1-bit Adam's inputs to :func:`reduce_across_dcn`: the shared momentum ``mu`` and variance ``nu`` of the last
    step (laid out like the gradient, the same on every replica), Adam's ``b1`` and ``b2``, ``nu_correction``
    (``nu`` times it is the bias-corrected variance), ``seed`` (the step: the variance projection's signs) and
    ``scale`` = replicas / global weight, which turns a replica's gradient *sum* into its local mean gradient.
    Each replica then sends ``b1 mu + (1 - b1) scale g_i``; ``nu`` comes back with its block levels tracked
    (:func:`meshtrain.parallel.onebit_adam.track_variance`)."""

    mu: Any
    nu: Any
    b1: jax.Array
    b2: jax.Array
    nu_correction: jax.Array
    seed: jax.Array
    scale: jax.Array


def reduce_across_dcn(choice: CompressionChoice, plan, stacked, grad_sh, model_state, momentum=None):
    """Sum the stacked per-replica gradients over ``data`` through :func:`exchange` (every mesh axis manual: each
    device compresses only its own shard), or with ``momentum`` (a :class:`Momentum`) average the replicas'
    local momenta instead (1-bit Adam). Returns ``(gradient sum, or the new shared momentum, laid out as grad_sh;
    model_state with the new residuals; the new variance)``: the variance (``momentum`` only, else ``None``) is
    ``momentum.nu`` with each block's level moved towards the global gradient's energy there, estimated from one
    f32 per block that crosses DCN (:func:`meshtrain.parallel.onebit_adam.track_variance`)."""
    specs = jax.tree.map(lambda s: s.spec, grad_sh)
    stacked_specs = jax.tree.map(lambda s: P(AXIS, *s), specs, is_leaf=lambda x: isinstance(x, P))
    residuals = feedback_of(model_state)
    flat_specs, treedef = jax.tree_util.tree_flatten(specs, is_leaf=lambda x: isinstance(x, P))
    flat_stacked = jax.tree.leaves(stacked_specs, is_leaf=lambda x: isinstance(x, P))

    def body(stacked, residuals, momentum):
        # one bucket per device: every local shard flattened and joined (one DCN exchange, padding only at its end)
        local = [g[0].astype(jnp.float32) for g in jax.tree.leaves(stacked)]
        new_nu = None
        if momentum is not None:   # the frozen variance's block levels follow the global gradient's energy
            flat = lambda leaves: jnp.concatenate([x.reshape(-1).astype(jnp.float32) for x in leaves])  # noqa: E731
            nu = flat(jax.tree.leaves(momentum.nu))
            factor = onebit_adam.track_variance(momentum.scale * flat(local), nu * momentum.nu_correction,
                                                momentum.b2, momentum.seed, AXIS, choice.replicas)
            new_nu = nu * factor
        if momentum is not None:   # this replica's momentum: the shared one decayed plus its own mean gradient
            local = [momentum.b1 * m.astype(jnp.float32) + (1 - momentum.b1) * momentum.scale * g
                     for m, g in zip(jax.tree.leaves(momentum.mu), local)]
        sizes = np.cumsum([g.size for g in local])[:-1]
        bucket = jnp.concatenate([g.reshape(-1) for g in local])
        res = None if residuals is None else jnp.concatenate([r[0].reshape(-1) for r in residuals])
        total, new_res = exchange(choice.kind, bucket, res)
        if momentum is not None:   # the average of the replicas' momenta: the same on every replica
            total = total / choice.replicas
        out = [t.reshape(g.shape) for t, g in zip(jnp.split(total, sizes), local)]
        if new_res is not None:
            new_res = [r.reshape((1,) + g.shape) for r, g in zip(jnp.split(new_res, sizes), local)]
        if new_nu is not None:
            new_nu = jax.tree_util.tree_unflatten(treedef, [v.reshape(n.shape).astype(n.dtype) for v, n in zip(
                jnp.split(new_nu, sizes), jax.tree.leaves(momentum.nu))])
        return jax.tree_util.tree_unflatten(treedef, out), new_res, new_nu

    res_specs = None if residuals is None else flat_stacked
    # mu, nu: the same shard on every replica
    momentum_specs = None if momentum is None else Momentum(specs, specs, P(), P(), P(), P(), P())
    # (check_vma off: the all-gathered sum is the same on every `data` replica, which JAX cannot infer)
    fn = jax.shard_map(body, mesh=plan.mesh, in_specs=(stacked_specs, res_specs, momentum_specs),
                       out_specs=(specs, res_specs, None if momentum is None else specs), check_vma=False)
    out, new_res, new_nu = fn(stacked, residuals, momentum)
    return out, (model_state if residuals is None else with_feedback(model_state, new_res)), new_nu


class Sent(str, enum.Enum):
    """What ``onebit`` compresses: the ``gradient`` (error-feedback SGD: optimizers whose update is linear in the
    gradient, SGD with or without momentum) or Adam's ``momentum`` (1-bit Adam, :mod:`onebit_adam`)."""

    GRADIENT = "gradient"
    MOMENTUM = "momentum"


def sent_quantity(choice: CompressionChoice, opt_state) -> Sent:
    """What the step compresses with ``opt_state``'s optimizer, or a :class:`ConfigError` naming the fix: under
    ``onebit`` an optax Adam (its update is not linear in the gradient, so error feedback drifts: +8.8 % final
    loss measured) is refused in favour of :func:`onebit_adam.onebit_adamw`, which needs a warm-up to learn its
    variance before freezing it."""
    if not choice.has_feedback:
        return Sent.GRADIENT
    if onebit_adam.find_state(opt_state) is not None:
        if choice.warmup < 1:
            raise ConfigError("grad_compression=onebit with Adam is 1-bit Adam: it learns Adam's variance from exact "
                              "gradients first, then freezes it; set --grad-compression-warmup K (15-25 percent "
                              "of the run, e.g. 50 of 250 steps)")
        return Sent.MOMENTUM
    adams = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
             if isinstance(s, optax.ScaleByAdamState)]
    if adams:
        raise ConfigError("grad_compression=onebit needs meshtrain's 1-bit Adam, not optax's Adam (error feedback on "
                          "the gradient drifts under Adam's variance): build the optimizer with "
                          "meshtrain.parallel.onebit_adam.onebit_adamw(...) (`meshtrain train` does), use an "
                          "optimizer linear in the gradient (SGD), or --grad-compression int8")
    return Sent.GRADIENT


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
