"""Pipeline parallelism over the ``stage`` mesh axis, inside one jitted SPMD program.

**The contract.** A model that wants a pipeline has a method ``pipeline_parts()`` returning
:class:`PipelineParts`: the attribute holding its stack of identical layers (an ``nnx.vmap``'ed module
whose parameters carry a leading ``layers`` axis), what runs before the stack (embedding), one layer,
and what runs after (head)::

    class MyModel(nnx.Module):
        ...
        def pipeline_parts(self) -> PipelineParts:
            return PipelineParts(
                stack="blocks",                                         # self.blocks: leading `layers` axis
                before=lambda tokens_bt: (self.embed(tokens_bt), {}),   # the model's call args -> (x, side)
                layer=lambda block, x_btd, side: block(x_btd),          # one layer of the stack
                after=lambda x_btd, side: self.head(x_btd),             # -> what model(...) returns
                sown=None)                  # only if the layers store values (nnx.Intermediate), see below

``before`` takes the arguments the loss function passes to ``model(...)`` and returns the stack's
input ``x`` (batch first) and ``side``, a pytree of batch-first arrays every layer reads (positions,
segment ids; ``{}`` if none). The user's ``loss_fn(model, batch)`` stays as it is: under a pipeline it
receives a stand-in model whose call runs ``before`` → the schedule → ``after`` (other attributes are
the real model's, and the real model is its child node). For Linen models wrap the stack with
``nn.scan``/``nnx.bridge`` into an NNX module with a leading ``layers`` axis and expose the same parts.

**Values the layers store** (``nnx.Intermediate``: MoE router statistics, ``Module.sow``) travel with
their micro-batch through every schedule (a small ``(layers, ...)`` buffer passed on with the
activations) and reach ``sown(values)`` (leaves ``(L, ...)``, the layers of one micro-batch) before
``after``; the model stores what its own ``__call__`` would (the decoder: the mean router statistics),
and the loss reads them as usual. The loss then runs once per micro-batch and the step sums: the
result equals gradient accumulation over the same ``m`` micro-batches (router statistics such as the
load-balancing loss are per micro-batch, not over the whole batch). Layers that sow without a
``sown`` part, or that update other state in the forward pass (running batch statistics), get a
``ConfigError`` naming the fix. Dense stacks store nothing and run exactly as before.

**Schedules** (``Recipe.schedule``; ``p`` stages, ``m = Recipe.micro_batches``, ``r = Recipe.repeats``):

* ``gpipe``: every tick each stage runs its layer group on the micro-batch it holds and passes the
  result to its neighbour (``ppermute`` over ``stage``); ``m + p - 1`` ticks, then autodiff runs the
  same ticks backwards. Bubble ``(p-1)/(m+p-1)``; activations of all ``m`` micro-batches are kept.
* ``circular``: the stack is cut into ``r·p`` groups, group ``v`` on stage ``v mod p``; a micro-batch
  loops ``r`` times round the ring. ``r·m + p - 1`` ticks, bubble ``(p-1)/(r·m+p-1)``. Checkpoints keep
  the global layer order, so each step first moves ``(r-1)/r`` of each stage's layer weights into the
  interleaved order (an all-to-all over ``stage``; gradients go back the same way).
* ``1f1b``: each tick every stage runs one forward and one backward (its own VJP, recomputing the
  stage from the stashed input), the loss and head of a micro-batch run as soon as it leaves the last
  stage. ``m + 2p - 2`` ticks, but the first ``p - 1`` have no backward on any stage and the last
  ``p - 1`` no forward, and the head has a micro-batch on ``m`` ticks only: conditionals skip that
  work, so the stack runs ``m + p - 1`` forward and ``m + p - 1`` backward passes and the head ``m``;
  bubble ``(p-1)/(m+p-1)`` as in gpipe. A stage keeps only the *inputs* of the micro-batches in
  flight (at most ``2(p-1-s)+1`` on stage ``s``: a micro-batch's backward returns ``2(p-1-s)`` ticks
  after its forward, one new forward per tick; an SPMD buffer of ``2p`` slots) instead of all
  activations of all ``m``.

Every stage computes every tick (SPMD), so the bubble shows up as extra compiled FLOPs:
``FLOPs(pipelined stack) / FLOPs(stack without pipeline) = 1 / (1 - bubble)`` (gpipe, circular:
``ticks / (r·m)``; 1f1b: ``(m+p-1)/m`` of its forward + recompute + backward). The head runs on every
stage (the tick takes as long as the last stage, which needs it anyway).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.annotate import current_step_context, remat
from meshtrain.errors import ConfigError
from meshtrain.recipes import Schedule

STAGE = "stage"


@dataclasses.dataclass(frozen=True)
class PipelineParts:
    """What a model exposes for pipelining (see the module docstring for an example).

    Attributes:
      stack: attribute path of the layer stack (an ``nnx.vmap``'ed module, leading ``layers`` axis);
        dotted when nested, e.g. ``"encoder.blocks"``.
      before: ``(*model_call_args) -> (x, side)``: embedding; ``x`` and every ``side`` leaf batch-first.
      layer: ``(layer_module, x, side) -> x``: one layer of the stack.
      after: ``(x, side) -> output``: head; ``output`` is what ``model(...)`` returns.
      sown: ``(values) -> None``, needed when the layers store values with ``nnx.Intermediate`` (MoE
        router statistics, ``Module.sow``): ``values`` is what the stack's layers stored for one
        micro-batch (``nnx.to_pure_dict`` of the popped ``nnx.Intermediate`` state, every leaf with a
        leading ``layers`` axis in the stack's order); store on the model what its own ``__call__``
        would (the decoder: the mean router statistics). Called before ``after``, once per micro-batch.
    """

    stack: str  # attribute path, dotted for a nested module ("encoder.blocks")
    before: Callable[..., Tuple[Any, Any]]
    layer: Callable[[nnx.Module, Any, Any], Any]
    after: Callable[[Any, Any], Any]
    sown: Optional[Callable[[Any], None]] = None


def get_parts(model) -> PipelineParts:
    """The model's :class:`PipelineParts`; ``ConfigError`` naming what to add when it has none."""
    fn = getattr(model, "pipeline_parts", None)
    if fn is None:
        raise ConfigError(
            f"model {type(model).__name__} does not implement the pipeline contract: add a method "
            f"pipeline_parts(self) -> meshtrain.parallel.pipeline.PipelineParts(stack='<attribute of the nnx.vmap'ed "
            f"layer stack>', before=..., layer=..., after=...) (see meshtrain/parallel/pipeline.py), or pick a recipe "
            f"without the 'pp' strategy")
    parts = fn()
    if not isinstance(parts, PipelineParts):
        raise ConfigError(f"{type(model).__name__}.pipeline_parts() returned {type(parts).__name__}; return a "
                          f"meshtrain.parallel.pipeline.PipelineParts")
    if not isinstance(stack_module(model, parts.stack), nnx.Module):
        raise ConfigError(f"{type(model).__name__}.pipeline_parts().stack = {parts.stack!r} is not an nnx.Module "
                          f"attribute of the model; name the attribute holding the nnx.vmap'ed layer stack")
    return parts


def stack_module(model, path: str):
    """The module at attribute ``path`` (dotted) of ``model``, or ``None``."""
    node = model
    for name in path.split("."):
        node = getattr(node, name, None)
    return node


def get_path(tree, path: str):
    """``tree["a"]["b"]`` for ``path = "a.b"`` (``None`` when absent)."""
    for name in path.split("."):
        if not isinstance(tree, dict) or name not in tree:
            return None
        tree = tree[name]
    return tree


def with_path(tree, path: str, value):
    """A copy of the nested dict ``tree`` with ``path`` (dotted) set to ``value``."""
    head, _, rest = path.partition(".")
    out = dict(tree)
    out[head] = with_path(tree[head], rest, value) if rest else value
    return out


def without_path(tree, path: str):
    """A copy of the nested dict ``tree`` without ``path`` (dotted)."""
    head, _, rest = path.partition(".")
    out = dict(tree)
    if rest:
        out[head] = without_path(tree[head], rest)
    else:
        del out[head]
    return out


# ---- schedule tables -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ScheduleTable:
    """What each stage does at each tick: ``forward[t, s]`` / ``backward[t, s]`` are micro-batch
    indices (-1: idle), ``group[t, s]`` the repeat (layer group) of the forward. The executors read
    these tables; :func:`timeline` turns them into stage × time charts."""

    schedule: Schedule
    stages: int
    micro_batches: int
    repeats: int
    forward: np.ndarray
    group: np.ndarray
    backward: np.ndarray

    @property
    def ticks(self) -> int:
        return int(self.forward.shape[0])

    @property
    def bubble(self) -> float:
        """Idle share of the stages' compute (what the compiled FLOPs show as extra work)."""
        return bubble_fraction(self.schedule, self.stages, self.micro_batches, self.repeats)


def schedule_table(schedule: "Schedule | str", stages: int, micro_batches: int, repeats: int = 1) -> ScheduleTable:
    """The tick table of ``schedule`` for ``stages`` × ``micro_batches`` (× ``repeats`` for circular)."""
    schedule = Schedule(schedule)
    p, m, r = stages, micro_batches, repeats if schedule is Schedule.CIRCULAR else 1
    s = np.arange(p)[None, :]
    if schedule is Schedule.ONE_F_ONE_B:
        t = np.arange(m + 2 * p - 2)[:, None]
        fwd, bwd = t - s, t - (2 * p - 2 - s)
        fwd = np.where((fwd >= 0) & (fwd < m), fwd, -1)
        bwd = np.where((bwd >= 0) & (bwd < m), bwd, -1)
        return ScheduleTable(schedule, p, m, 1, fwd, np.where(fwd >= 0, 0, -1), bwd)
    t = np.arange(r * m + p - 1)[:, None]
    u = t - s  # position of the work item on stage s in the order (group 0: mb 0..m-1, group 1: ...)
    ok = (u >= 0) & (u < r * m)
    fwd = np.where(ok, u % m, -1)
    grp = np.where(ok, u // m, -1)
    return ScheduleTable(schedule, p, m, r, fwd, grp, np.full_like(fwd, -1))


def bubble_fraction(schedule: "Schedule | str", stages: int, micro_batches: int, repeats: int = 1) -> float:
    """Idle share of compute: gpipe ``(p-1)/(m+p-1)``, circular ``(p-1)/(r·m+p-1)``, 1f1b
    ``(p-1)/(m+p-1)`` (its ``m + 2p - 2`` ticks each hold a forward and a backward slot, but the
    ``p - 1`` warm-up ticks run only forwards and the ``p - 1`` drain ticks only backwards)."""
    schedule, p, m = Schedule(schedule), stages, micro_batches
    r = repeats if schedule is Schedule.CIRCULAR else 1
    return (p - 1) / (r * m + p - 1)


def timeline(table: ScheduleTable) -> np.ndarray:
    """A ``(stages, slots)`` chart of strings (``"F3"``, ``"B3"``, ``""``) in time order: gpipe and
    circular list the forward ticks then the backward ticks (autodiff replays the forward ticks in
    reverse); 1f1b lists each tick as a forward slot then a backward slot."""
    p = table.stages
    if table.schedule is Schedule.ONE_F_ONE_B:
        cols = []
        for t in range(table.ticks):
            cols.append([f"F{table.forward[t, s]}" if table.forward[t, s] >= 0 else "" for s in range(p)])
            cols.append([f"B{table.backward[t, s]}" if table.backward[t, s] >= 0 else "" for s in range(p)])
    else:
        def cell(kind, t, s):
            if table.forward[t, s] < 0:
                return ""
            g = f".{table.group[t, s]}" if table.repeats > 1 else ""
            return f"{kind}{table.forward[t, s]}{g}"
        cols = [[cell("F", t, s) for s in range(p)] for t in range(table.ticks)]
        cols += [[cell("B", t, s) for s in range(p)] for t in reversed(range(table.ticks))]
    return np.array(cols, dtype=object).T


# ---- validation --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """A pipeline's shape: ``stages`` (mesh ``stage`` size), ``micro_batches``, ``repeats``, ``schedule``."""

    schedule: Schedule
    stages: int
    micro_batches: int
    repeats: int = 1

    @property
    def groups(self) -> int:
        """Layer groups the stack is cut into (``stages × repeats`` for circular, ``stages`` otherwise)."""
        return self.stages * (self.repeats if self.schedule is Schedule.CIRCULAR else 1)

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.schedule, self.stages, self.micro_batches, self.repeats)

    def check(self, n_layers: Optional[int] = None, batch_size: Optional[int] = None) -> None:
        """``ConfigError`` naming the fix for indivisible layers, too few micro-batches or a batch that
        does not split into them."""
        p, m = self.stages, self.micro_batches
        if self.schedule is not Schedule.CIRCULAR and self.repeats != 1:
            raise ConfigError(f"repeats={self.repeats} applies to the circular schedule only; pass --schedule "
                              f"circular or --repeats 1")
        if m < p:
            raise ConfigError(f"pipeline with {p} stages needs micro_batches >= {p} (got {m}): pass "
                              f"--micro-batches {max(p, 4 * p)} (or recipe.with_options(micro_batches=...))")
        if n_layers is not None and n_layers % self.groups:
            what = f"stages × repeats = {p} × {self.repeats}" if self.schedule is Schedule.CIRCULAR else f"stages = {p}"
            raise ConfigError(f"the model has {n_layers} layers, not divisible by {what}; change the mesh's stage "
                              f"size" + (" or --repeats" if self.schedule is Schedule.CIRCULAR else "")
                              + f" so that it divides {n_layers}")
        if batch_size is not None and batch_size % m:
            raise ConfigError(f"batch size {batch_size} does not split into micro_batches={m}; pick a divisor")


def config_for(recipe, mesh_sizes: Dict[str, int]) -> PipelineConfig:
    """The :class:`PipelineConfig` of a recipe with the ``pp`` strategy on a mesh of ``mesh_sizes``."""
    return PipelineConfig(recipe.schedule, int(mesh_sizes.get(STAGE, 1)), recipe.micro_batches, recipe.repeats)


def bubble_warning(cfg: PipelineConfig, limit: float = 0.25) -> Optional[str]:
    """A warning line when the bubble exceeds ``limit`` (else ``None``)."""
    if cfg.bubble <= limit:
        return None
    return (f"pipeline bubble {cfg.bubble:.0%} ({cfg.schedule.value}, {cfg.stages} stages, {cfg.micro_batches} "
            f"micro-batches" + (f", {cfg.repeats} repeats" if cfg.schedule is Schedule.CIRCULAR else "")
            + f") exceeds {limit:.0%}: raise --micro-batches" + (" or --repeats" if cfg.schedule is Schedule.CIRCULAR
                                                                 else ""))


# ---- layout helpers ------------------------------------------------------------------------------

def split_micro(x: jax.Array, m: int) -> jax.Array:
    """``(B, ...) -> (m, B/m, ...)``; micro-batch ``i`` takes rows ``i, i+m, ...`` so each device's rows
    stay on it (no resharding of a batch split over data/fsdp)."""
    return jnp.moveaxis(x.reshape((x.shape[0] // m, m) + x.shape[1:]), 1, 0)


def merge_micro(x_m: jax.Array) -> jax.Array:
    """Inverse of :func:`split_micro`."""
    x = jnp.moveaxis(x_m, 0, 1)
    return x.reshape((-1,) + x.shape[2:])


def _on_stage(x: jax.Array) -> jax.Array:
    # Leading dim on `stage`, the rest left to the partitioner (it follows the layers' own constraints).
    ctx = current_step_context()
    if ctx is None or STAGE not in ctx.mesh.shape:
        return x
    spec = PartitionSpec(STAGE, *([PartitionSpec.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, spec))


def _stage_groups(w: jax.Array, p: int, r: int) -> jax.Array:
    """``(L, ...) -> (p, r, L/(p·r), ...)``: group ``v = j·p + s`` (layers ``v·k .. v·k+k-1``) on stage ``s``.
    With ``r = 1`` this is each stage's own contiguous block (no data moves)."""
    k = w.shape[0] // (p * r)
    return _on_stage(jnp.swapaxes(w.reshape((r, p, k) + w.shape[1:]), 0, 1))


def _shift(x: jax.Array, direction: int) -> jax.Array:
    """Stage ``s`` gets stage ``s - direction``'s value (a collective-permute between neighbours)."""
    return _on_stage(jnp.roll(x, direction, axis=0))


def _pick(tree, idx: jax.Array):
    """``tree[idx]`` on the leading dim of every leaf with ``idx`` of shape (p,) -> leaves (p, ...)."""
    return jax.tree.map(lambda a: jnp.take(a, jnp.maximum(idx, 0), axis=0), tree)


def _first(x: jax.Array, stage: int, p: int) -> jax.Array:
    """Stage ``stage``'s slice of a stage-sharded array, on every stage (a masked sum over ``stage``)."""
    mask = (jnp.arange(p) == stage).reshape((p,) + (1,) * (x.ndim - 1))
    return jnp.sum(jnp.where(mask, x, jnp.zeros_like(x)), axis=0)


def _stage_fn(layer_fn):
    """Run one stage: scan ``layer_fn(w, x, side) -> (x, values)`` over the stage's ``k`` layers (remat
    per layer from the recipe); returns ``(x, values)`` with every values leaf ``(k, ...)``."""

    def run(w_k, x, side):
        def body(h, w_layer):
            return layer_fn(w_layer, h, side)

        return jax.lax.scan(remat(body), x, w_k)

    return run


def _mask(flags: jax.Array, x) -> jax.Array:
    """``flags`` of shape (p,) broadcast against ``x`` (leading dim p)."""
    return flags.reshape(flags.shape + (1,) * (x.ndim - 1))


def _floats(tree):
    """The floating leaves of ``tree``; other leaves become ``None`` (what a VJP differentiates)."""
    return jax.tree.map(lambda a: a if jnp.issubdtype(a.dtype, jnp.inexact) else None, tree)


def _with_floats(full, floats):
    """``full`` with its floating leaves taken from ``floats`` (a :func:`_floats` of the same structure)."""
    return jax.tree.map(lambda f, a: a if f is None else f, floats, full, is_leaf=lambda v: v is None)


# ---- gpipe / circular: forward ticks, autodiff runs them backwards ----------------------------

def run_stack(layer_fn, stack, x_m: jax.Array, side_m, cfg: PipelineConfig, *, unroll: bool = False,
              sown: bool = False):
    """The layer stack on ``m`` micro-batches through the gpipe or circular schedule.

    Args:
      layer_fn: ``(one layer's params pytree, x, side) -> x``; with ``sown=True``
        ``-> (x, values)``, ``values`` a pytree the layer produced (what it stored with
        ``nnx.Intermediate``).
      stack: params pytree, every leaf with a leading ``layers`` axis (sharded on ``stage``).
      x_m: ``(m, b, ...)`` stack inputs; side_m: pytree of ``(m, b, ...)`` arrays.
      unroll: unroll the tick loop (for exact FLOP counts in tests).
      sown: see ``layer_fn``; each micro-batch carries its layers' values along with its activations
        (a ``(layers, ...)`` buffer per leaf passed on with the ``ppermute``).
    Returns ``(m, b, ...)`` outputs in micro-batch order (with ``sown=True``: ``(outputs, values)``,
    every values leaf ``(m, L, ...)``: micro-batch, layer in stack order). Differentiable
    (``jax.grad`` replays the ticks).
    """
    if not sown:
        plain = lambda w, x, side: (layer_fn(w, x, side), {})  # noqa: E731
        return run_stack(plain, stack, x_m, side_m, cfg, unroll=unroll, sown=True)[0]
    p, m = cfg.stages, cfg.micro_batches
    r = cfg.repeats if cfg.schedule is Schedule.CIRCULAR else 1
    table = schedule_table(cfg.schedule, p, m, r)
    fwd, grp = jnp.asarray(table.forward), jnp.asarray(table.group)
    w = jax.tree.map(lambda a: _stage_groups(a, p, r), stack)
    stage_fn = _stage_fn(layer_fn)

    def stage(w_s, g, x, side):
        w_g = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, jnp.maximum(g, 0), 0, keepdims=False), w_s)
        return stage_fn(w_g, x, side)

    run = jax.vmap(stage, spmd_axis_name=STAGE)
    first = jnp.arange(p) == 0
    stages = jnp.arange(p)
    state0 = _on_stage(jnp.zeros((p,) + x_m.shape[1:], x_m.dtype))
    ring0 = _on_stage(jnp.zeros((p,) + x_m.shape, x_m.dtype))  # stage 0's slots: what came back round the ring
    # A micro-batch's layer values travel with it: (group r, stage p, layer k, ...) = the stack's order.
    _, v_shape = jax.eval_shape(stage, jax.tree.map(lambda a: a[0], w), 0, x_m[0],
                                jax.tree.map(lambda a: a[0], side_m))

    def v_zeros(lead):
        return jax.tree.map(lambda a: _on_stage(jnp.zeros(lead + (r, p) + a.shape, a.dtype)), v_shape)

    put_v = jax.vmap(lambda buf, g, s, v: buf.at[g, s].set(v))  # each stage writes its group's layers

    def tick(carry, t):
        state, ring, vals, vring = carry
        new = t < m
        fresh = jax.lax.dynamic_index_in_dim(x_m, jnp.minimum(t, m - 1), 0, keepdims=True)
        back = jax.lax.dynamic_index_in_dim(ring, t % m, 1, keepdims=False)
        state = jnp.where(_mask(first, state), jnp.where(new, fresh, back), state)
        vals = jax.tree.map(lambda v, vr: jnp.where(_mask(first, v), jnp.where(
            new, jnp.zeros_like(v), jax.lax.dynamic_index_in_dim(vr, t % m, 1, keepdims=False)), v), vals, vring)
        out, v_out = run(w, grp[t], _on_stage(state), _pick(side_m, fwd[t]))
        state = _shift(out, 1)  # stage s -> s+1; the last stage's output lands on stage 0
        vals = jax.tree.map(lambda buf, v: _shift(put_v(buf, jnp.maximum(grp[t], 0), stages, v), 1), vals, v_out)
        slot = jnp.maximum(t - (p - 1), 0) % m  # early ticks write garbage that a valid tick overwrites
        ring = _on_stage(jax.lax.dynamic_update_index_in_dim(ring, state, slot, 1))
        vring = jax.tree.map(lambda buf, v: _on_stage(jax.lax.dynamic_update_index_in_dim(buf, v, slot, 1)),
                             vring, vals)
        return (state, ring, vals, vring), None

    ticks = jnp.arange(table.ticks)
    carry0 = (state0, ring0, v_zeros((p,)), v_zeros((p, m)))
    (_, ring, _, vring), _ = jax.lax.scan(tick, carry0, ticks, unroll=table.ticks if unroll else 1)
    values = jax.tree.map(lambda a: _first(a, 0, p).reshape((m, -1) + a.shape[5:]), vring)  # (m, r·p·k, ...)
    return _first(ring, 0, p), values


# ---- 1f1b: one forward and one backward per stage per tick, explicit per-stage VJP -------------

def one_f_one_b(layer_fn, stack, x_m: jax.Array, side_m, head_loss, head_params, cfg: PipelineConfig,
                *, unroll: bool = False):
    """The 1F1B schedule with the backward written out per stage.

    ``layer_fn(w, x, side) -> (x, values)`` (``values``: what the layer stored, a pytree; ``{}`` for
    none). ``head_loss(head_params, y_b, values_L, i) -> (loss_sum, aux)`` runs after the last stage on
    micro-batch ``i`` with its layers' values (leaves ``(L, ...)``) (``aux`` a pytree of sums). Returns
    ``(loss_sum, aux_sum, d_stack, d_head_params, dx_m)``: gradients (f32) for ``stack`` and
    ``head_params`` and the cotangent of ``x_m`` (for the embedding's VJP). A stage stashes only its
    *input* per micro-batch in flight and recomputes its layers in the backward; the loss's cotangent
    of a micro-batch's layer values (e.g. the router losses) joins that backward.

    Ticks ``0 .. p-2`` (warm-up) run only forwards, ticks ``m+p-1 ..`` (drain) only backwards, and the
    head runs on the ``m`` ticks in between, where a micro-batch leaves the last stage: compiled work
    ``(m+p-1)·(forward + backward) + m·head`` per stage.
    """
    p, m = cfg.stages, cfg.micro_batches
    table = schedule_table(Schedule.ONE_F_ONE_B, p, m)
    fwd, bwd = jnp.asarray(table.forward), jnp.asarray(table.backward)
    slots = 2 * p - 1  # stage s has at most 2(p-1-s)+1 micro-batches in flight
    w = jax.tree.map(lambda a: _stage_groups(a, p, 1)[:, 0], stack)
    stage_fn = _stage_fn(layer_fn)

    def stage_bwd(w_s, x, side, ct, ct_v):
        _, vjp = jax.vjp(lambda ww, xx: (lambda y, v: (y, _floats(v)))(*stage_fn(ww, xx, side)), w_s, x)
        return vjp((ct, ct_v))

    run_f = jax.vmap(stage_fn, spmd_axis_name=STAGE)
    run_b = jax.vmap(stage_bwd, spmd_axis_name=STAGE)
    stash_put = jax.vmap(lambda buf, i, v: jax.lax.dynamic_update_index_in_dim(buf, v, i, 0))
    stash_get = jax.vmap(lambda buf, i: jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False))
    put_v = jax.vmap(lambda buf, s, v: buf.at[s].set(v))  # stage s writes its layers' values
    get_v = jax.vmap(lambda j, s, buf: buf[j, s], in_axes=(0, 0, None))  # stage s reads mb j's cotangents
    first = jnp.arange(p) == 0
    last = jnp.arange(p) == p - 1
    stages = jnp.arange(p)
    f32 = lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), t)  # noqa: E731

    y_shape, v_shape = jax.eval_shape(stage_fn, jax.tree.map(lambda a: a[0], w), x_m[0],
                                      jax.tree.map(lambda a: a[0], side_m))  # values leaves (k, ...)
    layers = lambda a: a.reshape((-1,) + a.shape[2:])  # noqa: E731  (p, k, ...) -> (L, ...)
    v_l = jax.tree.map(lambda a: jax.ShapeDtypeStruct((p * a.shape[0],) + a.shape[1:], a.dtype), v_shape)
    (_, aux_shape) = jax.eval_shape(head_loss, head_params, jnp.zeros(y_shape.shape, y_shape.dtype), v_l, 0)
    carry0 = dict(
        fstate=_on_stage(jnp.zeros((p,) + x_m.shape[1:], x_m.dtype)),
        vals=jax.tree.map(lambda a: _on_stage(jnp.zeros((p, p) + a.shape, a.dtype)), v_shape),  # travel with fstate
        bstate=_on_stage(jnp.zeros((p,) + y_shape.shape, y_shape.dtype)),
        stash=_on_stage(jnp.zeros((p, slots + 1) + x_m.shape[1:], x_m.dtype)),  # + a slot for idle ticks
        dv=jax.tree.map(lambda a: jnp.zeros((m, p) + a.shape, jnp.float32), _floats(v_shape)),  # loss -> values
        dx=_on_stage(jnp.zeros((p,) + x_m.shape, jnp.float32)),
        dw=jax.tree.map(_on_stage, f32(w)),
        dhead=f32(head_params),
        loss=jnp.zeros((), jnp.float32),
        aux=jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), aux_shape),
    )
    add = lambda a, b: a + b.astype(jnp.float32)  # noqa: E731

    def f_part(c, t):
        c = dict(c)
        fmb = fwd[t]
        fresh = jax.lax.dynamic_index_in_dim(x_m, jnp.clip(t, 0, m - 1), 0, keepdims=True)
        fin = jnp.where(_mask(first, c["fstate"]), fresh, c["fstate"])
        c["stash"] = _on_stage(stash_put(c["stash"], jnp.where(fmb >= 0, fmb % slots, slots), fin))
        fout, v_out = run_f(w, fin, _pick(side_m, fmb))
        fout = _on_stage(fout)
        vals = jax.tree.map(lambda buf, v: put_v(jnp.where(_mask(first, buf), jnp.zeros_like(buf), buf), stages, v),
                            c["vals"], v_out)
        c["fstate"], c["vals"] = _shift(fout, 1), jax.tree.map(lambda a: _shift(a, 1), vals)
        return c, fout, vals

    def h_part(c, t, fout, vals):
        # head and loss of micro-batch i, leaving the last stage this tick (warm-up and drain have none)
        c = dict(c)
        i = t - (p - 1)
        v_i = jax.tree.map(lambda a: layers(_first(a, p - 1, p)), vals)
        (loss_i, vjp, aux_i) = jax.vjp(lambda hp, y, vf: head_loss(hp, y, _with_floats(v_i, vf), i), head_params,
                                       _first(fout, p - 1, p), _floats(v_i), has_aux=True)
        dhead_i, dy, dv_i = vjp(jnp.ones((), loss_i.dtype))
        c["dv"] = jax.tree.map(lambda buf, d: jax.lax.dynamic_update_index_in_dim(
            buf, d.reshape(buf.shape[1:]).astype(jnp.float32), i, 0), c["dv"], dv_i)
        c["dhead"] = jax.tree.map(add, c["dhead"], dhead_i)
        c["loss"] = c["loss"] + loss_i.astype(jnp.float32)
        c["aux"] = jax.tree.map(add, c["aux"], aux_i)
        return c, dy

    def b_part(c, t, dy):
        # backward: the last stage starts from dy, the others from what their right neighbour sent
        c = dict(c)
        bmb = bwd[t]
        bvalid = bmb >= 0
        ct = jnp.where(_mask(last, c["bstate"]), dy.astype(c["bstate"].dtype)[None], c["bstate"])
        ct = jnp.where(_mask(bvalid, ct), ct, jnp.zeros_like(ct))  # idle ticks get a zero cotangent: no gradient
        ct_v = jax.tree.map(lambda buf, a: jnp.where(_mask(bvalid, buf), buf, 0).astype(a.dtype),
                            jax.tree.map(lambda buf: get_v(jnp.maximum(bmb, 0), stages, buf), c["dv"]),
                            _floats(v_shape))
        dw_t, dx_t = run_b(w, stash_get(c["stash"], jnp.maximum(bmb, 0) % slots), _pick(side_m, bmb), ct, ct_v)
        c["dx"] = _on_stage(jax.vmap(lambda buf, j, v: buf.at[j].add(v))(c["dx"], jnp.maximum(bmb, 0),
                                                                         dx_t.astype(jnp.float32)))
        c["bstate"] = _shift(dx_t, -1)
        c["dw"] = jax.tree.map(lambda a, b: _on_stage(add(a, b)), c["dw"], dw_t)
        return c

    no_dy = jnp.zeros(y_shape.shape, y_shape.dtype)
    no_f = (_on_stage(jnp.zeros((p,) + y_shape.shape, y_shape.dtype)), carry0["vals"])

    def tick(c, t, static=None):
        # Warm-up ticks (t < p-1) have no backward anywhere, drain ticks (t >= m+p-1) no forward, and
        # the head has a micro-batch only in between: conditionals (the predicate is the same on every
        # device) skip that work. ``static``: a Python tick number (unrolled: plain code, exact FLOPs).
        when = lambda lo, hi: (lo <= static < hi) if static is not None else (t >= lo) & (t < hi)  # noqa: E731
        cond = lambda pred, yes, no, *ops: (yes if pred else no)(*ops) if static is not None \
            else jax.lax.cond(pred, yes, no, *ops)  # noqa: E731
        c, fout, vals = cond(when(0, m + p - 1), f_part, lambda c, t: (dict(c),) + no_f, c, t)
        c, dy = cond(when(p - 1, m + p - 1), h_part, lambda c, t, f, v: (dict(c), no_dy), c, t, fout, vals)
        return cond(when(p - 1, table.ticks), b_part, lambda c, t, dy: dict(c), c, t, dy)

    if unroll:
        c = carry0
        for t in range(table.ticks):
            c = tick(c, jnp.asarray(t), static=t)
    else:
        c, _ = jax.lax.scan(lambda cc, t: (tick(cc, t), None), carry0, jnp.arange(table.ticks))
    d_stack = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), c["dw"])  # (p, k, ...) -> (L, ...)
    return c["loss"], c["aux"], d_stack, c["dhead"], _first(c["dx"], 0, p)


# ---- the model-level entry points the train step uses -------------------------------------------

class _Captured(Exception):
    def __init__(self, args, kwargs):
        super().__init__("model call captured")
        self.call_args, self.call_kwargs = args, kwargs


class StandIn(nnx.Module):
    """What ``loss_fn`` receives under a pipeline: calling it runs ``call`` (the pipelined model);
    every other attribute is the real model's. The real model is also its child node, so what
    walks the model's state (``nnx.pop(model, nnx.Intermediate)``,
    :func:`meshtrain.models.moe.pop_moe_stats`) finds the values ``PipelineParts.sown`` stored."""

    def __init__(self, model, call):
        self._pipeline_model = model
        self._pipeline_call = call

    def __call__(self, *args, **kwargs):
        return self._pipeline_call(*args, **kwargs)

    def __getattr__(self, name):
        model = vars(self).get("_pipeline_model")
        if model is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(model, name)


def _capture(loss_fn, model, batch) -> Tuple[tuple, dict]:
    """The arguments ``loss_fn`` passes to ``model(...)`` for ``batch``."""

    def stop(*args, **kwargs):
        raise _Captured(args, kwargs)

    try:
        loss_fn(StandIn(model, stop), batch)
    except _Captured as got:
        return got.call_args, got.call_kwargs
    raise ConfigError(f"loss_fn {getattr(loss_fn, '__name__', loss_fn)!r} never calls model(...); a pipeline runs the "
                      f"model's layer stack inside that call")


def _path(keypath) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)


def _stack_io(model, parts: PipelineParts):
    """``layer_fn(w, x, side) -> (x, values)`` for one layer of the stack (``values``: what the layer
    stored with ``nnx.Intermediate``, a pure dict) and the stack's state. ``ConfigError`` when a layer
    changes other state (running statistics), which the schedules do not carry."""
    gd, stack = nnx.split(stack_module(model, parts.stack))

    def raw(block):  # {path: (variable type, array)} of the layer's state
        return {k: (type(v), v.get_value() if isinstance(v, nnx.Variable) else v)
                for k, v in nnx.to_flat_state(nnx.state(block))}

    def layer_fn(w, x, side):
        block = nnx.merge(gd, w)
        before = raw(block)
        y = parts.layer(block, x, side)
        values = nnx.to_pure_dict(nnx.pop(block, nnx.Intermediate))
        for key, (kind, value) in raw(block).items():
            if issubclass(kind, nnx.RngState):  # dropout counters: not carried (see README, known limits)
                continue
            if key not in before or value is not before[key][1]:
                raise ConfigError(
                    f"a layer of {type(model).__name__}.{parts.stack} changes its state {'/'.join(map(str, key))} "
                    f"({kind.__name__}) in the forward pass (e.g. running batch statistics); a pipeline carries "
                    f"only parameters and values stored with nnx.Intermediate through its schedule: store such values "
                    f"with nnx.Intermediate and apply them in PipelineParts.sown, use a layer without running "
                    f"statistics, or pick a recipe without the 'pp' strategy")
        return y, values

    return layer_fn, stack


def _store_values(parts: PipelineParts, model, values) -> None:
    """Hand one micro-batch's layer values to ``parts.sown`` (``ConfigError`` when the model has none)."""
    if not jax.tree.leaves(values):
        return
    if parts.sown is None:
        paths = sorted({_path(k) for k, _ in jax.tree_util.tree_flatten_with_path(values)[0]})
        raise ConfigError(
            f"the layers of {type(model).__name__}.{parts.stack} store values with nnx.Intermediate "
            f"({', '.join(paths)}) "
            f"that a pipeline would drop: add sown=<function(values)> to {type(model).__name__}.pipeline_parts()'s "
            f"PipelineParts to store what the model's own __call__ keeps of them (values: the layers' nnx.Intermediate "
            f"state of one micro-batch as a pure dict, leading `layers` axis; see meshtrain.models.decoder), or stop "
            f"storing them in the layer")
    parts.sown(values)


def pipelined_loss(model, loss_fn, batch, cfg: PipelineConfig, *, split_batch=None, unpack=None):
    """``loss_fn(model, batch)`` with the model's layer stack run through the gpipe / circular schedule
    (differentiate it as usual; autodiff replays the ticks).

    When the layers store values (``nnx.Intermediate``, e.g. MoE router statistics) the loss runs per
    micro-batch, as gradient accumulation over the same micro-batches would: ``loss_fn`` on
    ``split_batch()[i]`` with the model holding micro-batch ``i``'s values (``PipelineParts.sown``);
    ``unpack(loss_fn output) -> (loss_sum, weight, metrics)`` and the sums are returned as one
    ``(loss_sum, weight, metrics)``. Otherwise ``loss_fn`` runs once on the whole batch.
    """
    parts = get_parts(model)
    layer_fn, stack = _stack_io(model, parts)
    m = cfg.micro_batches
    kept = {}

    def call(*args, **kwargs):
        x, side = parts.before(*args, **kwargs)
        side_m = jax.tree.map(lambda a: split_micro(a, m), side)
        y_m, values_m = run_stack(layer_fn, stack, split_micro(x, m), side_m, cfg, sown=True)
        if jax.tree.leaves(values_m):
            kept.update(y_m=y_m, side_m=side_m, values_m=values_m)
        return parts.after(merge_micro(y_m), side)

    out = loss_fn(StandIn(model, call), batch)
    if not kept:
        return out
    if parts.sown is None:  # names what to add
        _store_values(parts, model, kept["values_m"])
    if split_batch is None or unpack is None:
        raise ConfigError("pipelined_loss: the layers store values (nnx.Intermediate); pass split_batch and unpack "
                          "so that the loss runs per micro-batch")
    graphdef, state = nnx.split(model)

    def one(xs):
        y, side, values, b = xs
        fresh = nnx.merge(graphdef, state)  # the map body's own copy (nnx refuses mutation across traces)
        pp = get_parts(fresh)

        def call_one(*args, **kwargs):
            _store_values(pp, fresh, values)
            return pp.after(y, side)

        return unpack(loss_fn(StandIn(fresh, call_one), b))

    total, weight, metrics = jax.lax.map(one, (kept["y_m"], kept["side_m"], kept["values_m"], split_batch()))
    return jnp.sum(total), jnp.sum(weight), {k: jnp.sum(v) for k, v in metrics.items()}


def value_and_grad_1f1b(build, params: Dict[str, Any], loss_fn, batch_m, cfg: PipelineConfig, unpack):
    """Loss sums and gradients of ``params`` (a pure dict) under the 1F1B schedule.

    ``build(params) -> model``; ``batch_m`` the batch cut into micro-batches (leading ``m``);
    ``unpack(loss_fn output) -> (loss_sum, weight, metrics)``. Returns
    ``(loss_sum, weight, metrics, grads)``. Embedding (``before``) gradients come from one VJP after
    the schedule; head and loss run per micro-batch inside it, with the values the layers stored for
    that micro-batch (``PipelineParts.sown``).
    """
    parts = get_parts(build(params))
    name = parts.stack
    stack_p = get_path(params, name)
    rest = without_path(params, name)

    def model_of(rest_):
        return build(with_path(rest_, name, stack_p))

    def before_all(rest_):
        model = model_of(rest_)
        pp = get_parts(model)

        def one(b):
            args, kwargs = _capture(loss_fn, model, b)
            return pp.before(*args, **kwargs)

        x_m, side_m = jax.lax.map(one, batch_m)
        return x_m, side_m

    (x_m, before_vjp, side_m) = jax.vjp(before_all, rest, has_aux=True)
    model0 = build(params)
    layer_fn, _ = _stack_io(model0, parts)
    stack_state = nnx.state(stack_module(model0, name))

    def head_loss(rest_, y_b, values, i):
        model = model_of(rest_)
        pp = get_parts(model)
        side_i = jax.tree.map(lambda a: a[i], side_m)
        b_i = jax.tree.map(lambda a: a[i], batch_m)

        def call(*args, **kwargs):
            _store_values(pp, model, values)
            return pp.after(y_b, side_i)

        total, weight, metrics = unpack(loss_fn(StandIn(model, call), b_i))
        return total, (weight, metrics)

    loss, (weight, metrics), d_stack, d_rest, dx_m = one_f_one_b(layer_fn, stack_state, x_m, side_m, head_loss,
                                                                rest, cfg)
    (d_before,) = before_vjp(dx_m.astype(x_m.dtype))
    grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), d_rest, d_before)
    grads = with_path(grads, name, nnx.to_pure_dict(d_stack) if isinstance(d_stack, nnx.State) else d_stack)
    return loss, weight, metrics, grads
