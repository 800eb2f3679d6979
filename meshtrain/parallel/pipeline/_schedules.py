"""The executors: gpipe and circular (:func:`run_stack`, differentiated by autodiff) and 1F1B
(:func:`one_f_one_b`, its own per-stage VJP), one SPMD program over ``stage``."""

from __future__ import annotations

import functools
import math
import types
from typing import Tuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.annotate import batch_split_over, current_step_context, remat
from meshtrain.parallel.pipeline._parts import STAGE
from meshtrain.parallel.pipeline._tables import PipelineConfig, schedule_table
from meshtrain.recipes import Schedule
from meshtrain.strategies import Context, Expert


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


def _cut_rows(a: jax.Array, d: int) -> jax.Array:
    """``(rows, ...) -> (d, rows/d, ...)``: block ``j`` the rows data shard ``j`` holds (:func:`split_micro` keeps
    a shard's rows together)."""
    return a.reshape((d, a.shape[0] // d) + a.shape[1:])


def _merge_rows(a: jax.Array) -> jax.Array:
    """Inverse of :func:`_cut_rows`."""
    return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


def _on_rows(x: jax.Array, axes: Tuple[str, ...]) -> jax.Array:
    """``(p, d, ...)`` with ``p`` on ``stage`` and ``d`` on the data axes ``axes`` (per-shard gradients)."""
    ctx = current_step_context()
    spec = PartitionSpec(STAGE if STAGE in ctx.mesh.shape else None, axes,
                         *([PartitionSpec.UNCONSTRAINED] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, spec))


def _stage_groups(w: jax.Array, p: int, r: int) -> jax.Array:
    """``(L, ...) -> (p, r, L/(p·r), ...)``: group ``v = j·p + s`` (layers ``v·k .. v·k+k-1``) on stage ``s``.
    With ``r = 1`` this is each stage's own contiguous block (no data moves)."""
    k = w.shape[0] // (p * r)
    return _on_stage(jnp.swapaxes(w.reshape((r, p, k) + w.shape[1:]), 0, 1))


def _shift(x: jax.Array, direction: int) -> jax.Array:
    """Stage ``s`` gets stage ``s - direction``'s value (a collective-permute between neighbours); its cotangent
    goes back the same way (:func:`_roll_stages`)."""
    return _on_stage(_roll_stages(x, direction))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _roll_stages(x: jax.Array, direction: int) -> jax.Array:
    """``jnp.roll`` over the stage dimension whose transpose is the opposite roll: autodiff's own transpose of a
    roll (a split and a pad) compiled to two collective-permutes of the whole cotangent per tick (gpipe and
    circular's backward ticks), where one moves it."""
    return jnp.roll(x, direction, axis=0)


def _roll_stages_fwd(x, direction):
    return _roll_stages(x, direction), None


def _roll_stages_bwd(direction, _, ct):
    return (_on_stage(jnp.roll(ct, -direction, axis=0)),)


_roll_stages.defvjp(_roll_stages_fwd, _roll_stages_bwd)


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


def row_split_axes(rules, mesh_sizes, strategies) -> Tuple[str, ...]:
    """The data-parallel mesh axes over which 1F1B and zero-bubble keep one weight gradient per shard and
    reduce once after the tick loop (:func:`_row_split`): the leading run of the ``batch`` rule's axes
    (size > 1) on which no weight is sharded (``dp``'s ``data``; not FSDP's ``fsdp``, whose gradients
    ZeRO-3 reduce-scatters per tick). ``()`` under a context or expert dimension (their kernels lay the
    batch out themselves). The planner's collectives read the same function
    (:mod:`meshtrain.analysis.comms`)."""
    if any(isinstance(d, (Context, Expert)) for d in strategies):
        return ()
    rule = rules.table("activations").get("batch")
    weight_axes = {a for r in rules.table("params").values() for a in r.mesh_axes}
    axes = []
    for a in (rule.mesh_axes if rule else ()):  # the leading run: the rows' major split
        if mesh_sizes.get(a, 1) == 1:
            continue
        if a in weight_axes or a == STAGE:
            break
        axes.append(a)
    return tuple(axes)


def _row_split(rows: int, v_shape, side_m) -> Tuple[Tuple[str, ...], int]:
    """``(axes, d)``: the data-parallel mesh axes a micro-batch's ``rows`` are split over while every
    weight is whole on them (:func:`row_split_axes`), and their size. 1F1B's backward then computes each
    shard's weight gradient apart (a ``jax.vmap`` over the row split, ``spmd_axis_name=axes``) and the
    schedule sums them once after its tick loop: one data-parallel reduction a step, where a tick loop
    accumulating the summed gradient reduced it on every backward tick (measured in the compiled HLO: one
    all-reduce of the stage's gradients per tick, tests/test_planner_moe_pp.py). ``((), 1)`` where that
    does not apply: no step context or no such axis, layers that store values (their cotangents are per
    micro-batch, not per row), or side inputs without a leading row dimension."""
    ctx = current_step_context()
    if ctx is None or jax.tree.leaves(_floats(v_shape)):
        return (), 1
    if any(a.ndim < 2 or a.shape[1] != rows for a in jax.tree.leaves(side_m)):
        return (), 1
    sizes = ctx.mesh_sizes()
    axes = row_split_axes(ctx.rules, sizes, ctx.strategies)
    d = math.prod(sizes[a] for a in axes)
    return (axes, d) if d > 1 and rows % d == 0 else ((), 1)


def _per_row_split(stage_bwd, axes: Tuple[str, ...], d: int):
    """``stage_bwd`` run on each of the ``d`` row blocks of its micro-batch apart: weight gradients
    ``(d, ...)`` (one per data shard, not yet summed), input gradient ``(rows, ...)``."""
    def run(w_s, x, side, ct, ct_v):
        cut = lambda a: _cut_rows(a, d)  # noqa: E731
        with batch_split_over(axes):
            dw, dx = jax.vmap(stage_bwd, in_axes=(None, 0, 0, 0, None), spmd_axis_name=axes)(
                w_s, cut(x), jax.tree.map(cut, side), cut(ct), ct_v)
        return dw, _merge_rows(dx)

    return run


def _per_row_forward(stage, axes: Tuple[str, ...], d: int):
    """``stage(w_s, g, x, side)`` on each of the ``d`` row blocks of its micro-batch apart, block ``j``
    with weights ``w_s_d[j]`` (leaves ``(d, ...)``: one copy per data shard)."""
    def run(w_s_d, g, x, side):
        cut = lambda a: _cut_rows(a, d)  # noqa: E731
        with batch_split_over(axes):
            out, values = jax.vmap(stage, in_axes=(0, None, 0, 0), spmd_axis_name=axes)(
                w_s_d, g, cut(x), jax.tree.map(cut, side))
        return _merge_rows(out), values

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
        # one group per stage: a static index (no gather, whose transpose cannot add the fm32 FP8 meta)
        w_g = jax.tree.map(lambda a: a[0] if r == 1 else
                           jax.lax.dynamic_index_in_dim(a, jnp.maximum(g, 0), 0, keepdims=False), w_s)
        return stage_fn(w_g, x, side)

    first = jnp.arange(p) == 0
    stages = jnp.arange(p)
    state0 = _on_stage(jnp.zeros((p,) + x_m.shape[1:], x_m.dtype))
    ring0 = _on_stage(jnp.zeros((p,) + x_m.shape, x_m.dtype))  # stage 0's slots: what came back round the ring
    # each stage reads its own copy of the inputs: autodiff sums their cotangent over `stage` once, not on every tick
    x_pm = _on_stage(jnp.broadcast_to(x_m[None], (p,) + x_m.shape))
    # A micro-batch's layer values travel with it: (group r, stage p, layer k, ...) = the stack's order.
    _, v_shape = jax.eval_shape(stage, jax.tree.map(lambda a: a[0], w), 0, x_m[0],
                                jax.tree.map(lambda a: a[0], side_m))
    axes, d = _row_split(x_m.shape[1], v_shape, side_m) if not jax.tree.leaves(v_shape) else ((), 1)
    if d > 1:
        # one copy of the weights per data shard, each shard's rows run on its own copy: autodiff then
        # accumulates one weight gradient per shard through the ticks, and the copy's transpose (a sum over
        # the shards) reduces them once after the loop, not on every tick (as 1F1B's _per_row_split)
        w = jax.tree.map(lambda a: _on_rows(jnp.broadcast_to(a[:, None], (p, d) + a.shape[1:]), axes), w)
        run = jax.vmap(_per_row_forward(stage, axes, d), spmd_axis_name=STAGE)
    else:
        run = jax.vmap(stage, spmd_axis_name=STAGE)

    def v_zeros(lead):
        return jax.tree.map(lambda a: _on_stage(jnp.zeros(lead + (r, p) + a.shape, a.dtype)), v_shape)

    put_v = jax.vmap(lambda buf, g, s, v: buf.at[g, s].set(v))  # each stage writes its group's layers

    def tick(carry, t):
        state, ring, vals, vring = carry
        new = t < m
        fresh = jax.lax.dynamic_index_in_dim(x_pm, jnp.minimum(t, m - 1), 1, keepdims=False)  # (p, ...)
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
                *, unroll: bool = False, head_inputs=None, dx_per_stage: bool = False):
    """The 1F1B schedule with the backward written out per stage.

    ``layer_fn(w, x, side) -> (x, values)`` (``values``: what the layer stored, a pytree; ``{}`` for
    none). ``head_loss(head_params, y_b, values_L, i) -> (loss_sum, aux)`` runs after the last stage on
    micro-batch ``i`` with its layers' values (leaves ``(L, ...)``) (``aux`` a pytree of sums); given
    ``head_inputs`` (a pytree of per-row arrays ``(m, rows, ...)``: what the head reads of the batch) it is
    called ``head_loss(head_params, y_b, values_L, i, inputs)`` with micro-batch ``i``'s rows of them, and,
    under data parallelism, on each data shard's rows apart (their head gradients are summed once after the
    ticks, as the stack's are: :func:`_row_split`). Returns
    ``(loss_sum, aux_sum, d_stack, d_head_params, dx_m)``: gradients (f32) for ``stack`` and
    ``head_params`` and the cotangent of ``x_m`` (for the embedding's VJP; ``dx_per_stage``: as
    ``(p, m, ...)`` on ``stage``, stage 0's the cotangent and the others' zeros, so that the caller runs that
    VJP per stage and reduces the embedding's gradient over ``stage``, not the cotangents). A stage stashes only its
    *input* per micro-batch in flight and recomputes its layers in the backward; the loss's cotangent
    of a micro-batch's layer values (e.g. the router losses) joins that backward.

    Ticks ``0 .. p-2`` (warm-up) run only forwards, ticks ``m+p-1 ..`` (drain) only backwards, and the
    head runs on the ``m`` ticks in between, where a micro-batch leaves the last stage: compiled work
    ``(m+p-1)·(forward + backward) + m·head`` per stage.
    """
    s = _one_f_one_b_setup(layer_fn, stack, x_m, side_m, head_loss, head_params, cfg, head_inputs=head_inputs)
    return _run_ticks(s, _one_f_one_b_tick(s, x_m, side_m, head_loss, head_params), unroll, dx_per_stage)


def _run_ticks(s, tick, unroll: bool, dx_per_stage: bool = False):
    """Run ``tick`` over the schedule's ticks from ``s.carry0`` (unrolled: each tick its own static index) and
    return what 1F1B and zero-bubble return: ``(loss_sum, aux_sum, d_stack, d_head_params, dx_m)``."""
    if unroll:
        c = s.carry0
        for t in range(s.table.ticks):
            c = tick(c, jnp.asarray(t), static=t)
    else:
        c, _ = jax.lax.scan(lambda cc, t: (tick(cc, t), None), s.carry0, jnp.arange(s.table.ticks))
    dw = c["dw"] if s.rows_split == 1 else jax.tree.map(lambda a: jnp.sum(a, axis=1), c["dw"])  # the one reduction
    d_stack = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), dw)  # (p, k, ...) -> (L, ...)
    loss, aux, dhead = c["loss"], c["aux"], c["dhead"]
    if s.head_lead:  # one value per stage and/or data shard: summed once (one all-reduce over both)
        loss, aux, dhead = jax.tree.map(lambda a: jnp.sum(a, axis=tuple(range(s.head_lead))), (loss, aux, dhead))
    # stage 0's input cotangents in the compute dtype (exact: each micro-batch's slot holds one widened value)
    dx = c["dx"].astype(s.x_dtype)
    if dx_per_stage:
        return loss, aux, d_stack, dhead, _on_stage(jnp.where(_mask(s.first, dx), dx, jnp.zeros_like(dx)))
    return loss, aux, d_stack, dhead, _first(dx, 0, s.p)


def _one_f_one_b_setup(layer_fn, stack, x_m: jax.Array, side_m, head_loss, head_params,
                       cfg: PipelineConfig, *, split_rows: bool = True, head_inputs=None) -> types.SimpleNamespace:
    """What every tick of :func:`one_f_one_b` reads: the schedule table, the per-stage weights, the
    vmapped stage forward and backward, the stash helpers, the shapes and the initial carry.
    ``split_rows``: the backward keeps one weight gradient per data shard (:func:`_row_split`); so does the
    head where ``head_inputs`` (what it reads per row, leaves ``(m, rows, ...)``) is given."""
    p, m = cfg.stages, cfg.micro_batches
    table = schedule_table(Schedule.ONE_F_ONE_B, p, m)
    fwd, bwd = jnp.asarray(table.forward), jnp.asarray(table.backward)
    slots = 2 * p - 1  # stage s has at most 2(p-1-s)+1 micro-batches in flight
    w = jax.tree.map(lambda a: _stage_groups(a, p, 1)[:, 0], stack)
    stage_fn = _stage_fn(layer_fn)

    def stage_bwd(w_s, x, side, ct, ct_v):
        _, vjp = jax.vjp(lambda ww, xx: (lambda y, v: (y, _floats(v)))(*stage_fn(ww, xx, side)), w_s, x)
        return vjp((ct, ct_v))

    y_shape, v_shape = jax.eval_shape(stage_fn, jax.tree.map(lambda a: a[0], w), x_m[0],
                                      jax.tree.map(lambda a: a[0], side_m))  # values leaves (k, ...)
    axes, d_all = _row_split(x_m.shape[1], v_shape, side_m)
    d = d_all if split_rows else 1
    head_d = d_all if head_inputs is not None and all(
        a.ndim >= 2 and a.shape[1] == x_m.shape[1] for a in jax.tree.leaves(head_inputs)) else 1
    run_f = jax.vmap(stage_fn, spmd_axis_name=STAGE)
    run_b = jax.vmap(stage_bwd if d == 1 else _per_row_split(stage_bwd, axes, d), spmd_axis_name=STAGE)
    stash_put = jax.vmap(lambda buf, i, v: jax.lax.dynamic_update_index_in_dim(buf, v, i, 0))
    stash_get = jax.vmap(lambda buf, i: jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False))
    put_v = jax.vmap(lambda buf, s, v: buf.at[s].set(v))  # stage s writes its layers' values
    get_v = jax.vmap(lambda j, s, buf: buf[j, s], in_axes=(0, 0, None))  # stage s reads mb j's cotangents
    first = jnp.arange(p) == 0
    last = jnp.arange(p) == p - 1
    stages = jnp.arange(p)
    f32 = lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), t)  # noqa: E731

    layers = lambda a: a.reshape((-1,) + a.shape[2:])  # noqa: E731  (p, k, ...) -> (L, ...)
    v_l = jax.tree.map(lambda a: jax.ShapeDtypeStruct((p * a.shape[0],) + a.shape[1:], a.dtype), v_shape)
    (_, aux_shape) = jax.eval_shape(_head_call(head_loss, head_inputs), head_params,
                                    jnp.zeros(y_shape.shape, y_shape.dtype), v_l, 0)
    carry0 = dict(
        fstate=_on_stage(jnp.zeros((p,) + x_m.shape[1:], x_m.dtype)),
        vals=jax.tree.map(lambda a: _on_stage(jnp.zeros((p, p) + a.shape, a.dtype)), v_shape),  # travel with fstate
        bstate=_on_stage(jnp.zeros((p,) + y_shape.shape, y_shape.dtype)),
        stash=_on_stage(jnp.zeros((p, slots + 1) + x_m.shape[1:], x_m.dtype)),  # + a slot for idle ticks
        dv=jax.tree.map(lambda a: jnp.zeros((m, p) + a.shape, jnp.float32), _floats(v_shape)),  # loss -> values
        dx=_on_stage(jnp.zeros((p,) + x_m.shape, jnp.float32)),
        dw=jax.tree.map(_on_stage, f32(w)) if d == 1 else jax.tree.map(
            lambda a: _on_rows(jnp.zeros((p, d) + a.shape[1:], jnp.float32), axes), w),  # one per data shard
        dhead=f32(head_params),
        loss=jnp.zeros((), jnp.float32),
        aux=jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), aux_shape),
    )
    # the head runs on every stage's own output, the last stage's kept (_head_on_last): no hand-off of its input
    # over `stage`; then one head gradient, loss and aux sum per stage (and per data shard), summed after the ticks
    on_last = p > 1 and not jax.tree.leaves(_floats(v_shape))
    lead = ((p,) if on_last else ()) + ((head_d,) if head_d > 1 else ())
    if lead:
        place = (lambda a: _on_rows(a, axes)) if on_last and head_d > 1 else _on_stage if on_last else \
            (lambda a: _on_data(a, axes))
        carry0.update({k: jax.tree.map(lambda a: place(jnp.zeros(lead + a.shape, a.dtype)), carry0[k])
                       for k in ("dhead", "loss", "aux")})
    add = lambda a, b: a + b.astype(jnp.float32)  # noqa: E731

    return types.SimpleNamespace(p=p, m=m, table=table, rows_split=d, row_axes=axes, head_split=head_d,
                                 head_inputs=head_inputs, head_on_last=on_last, head_lead=len(lead), fwd=fwd,
                                 bwd=bwd, slots=slots, w=w, stage_fn=stage_fn, run_f=run_f, run_b=run_b,
                                 stash_put=stash_put, stash_get=stash_get, put_v=put_v, get_v=get_v, first=first,
                                 last=last, stages=stages, y_shape=y_shape, v_shape=v_shape, x_dtype=x_m.dtype,
                                 layers=layers, carry0=carry0, add=add)


def _head_call(head_loss, head_inputs):
    """``(hp, y_b, values_L, i) -> (loss_sum, aux)``: ``head_loss`` with micro-batch ``i``'s inputs
    appended where the schedule has them (``head_inputs``)."""
    if head_inputs is None:
        return head_loss
    return lambda hp, y, v, i: head_loss(hp, y, v, i, jax.tree.map(lambda a: a[i], head_inputs))


def _on_data(x: jax.Array, axes: Tuple[str, ...]) -> jax.Array:
    """``(d, ...)`` with ``d`` on the data axes ``axes`` (one value per data shard)."""
    ctx = current_step_context()
    spec = PartitionSpec(axes, *([PartitionSpec.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, spec))


def _head_rows(s: types.SimpleNamespace, c, i, y_i: jax.Array, head_loss, head_params):
    """The head tick with one head gradient per data shard: ``head_loss`` on each shard's rows of
    micro-batch ``i`` apart (a vmap over the row split, with its own copy of the head's weights, so
    that their cotangents stay per shard), accumulated per shard; no layer values (:func:`_row_split`).
    Returns ``(carry, dy)``."""
    d, axes = s.head_split, s.row_axes
    cut = lambda a: _cut_rows(a, d)  # noqa: E731
    inputs_i = jax.tree.map(lambda a: cut(a[i]), s.head_inputs)
    hp_d = jax.tree.map(lambda a: _on_data(jnp.broadcast_to(a, (d,) + a.shape), axes), head_params)

    def per_shard(hp_d, y_d):
        with batch_split_over(axes):
            return jax.vmap(lambda hp, y, inp: head_loss(hp, y, {}, i, inp), spmd_axis_name=axes)(hp_d, y_d,
                                                                                               inputs_i)

    (loss_d, vjp, aux_d) = jax.vjp(per_shard, hp_d, cut(y_i), has_aux=True)
    dhead_d, dy_d = vjp(jnp.ones(loss_d.shape, loss_d.dtype))
    c = dict(c)
    keep = lambda a, b: _on_data(s.add(a, b), axes)  # noqa: E731
    c["dhead"] = jax.tree.map(keep, c["dhead"], dhead_d)
    c["loss"] = keep(c["loss"], loss_d)
    c["aux"] = jax.tree.map(keep, c["aux"], aux_d)
    return c, _merge_rows(dy_d)


def _head_on_last(s: types.SimpleNamespace, c, i, fout: jax.Array, head_loss, head_params):
    """The head tick without a hand-off: every stage runs ``head_loss`` on its own output ``fout`` (``(p, rows,
    ...)``, a vmap over ``stage`` with one copy of the head's weights per stage) and keeps it on the last stage
    only, whose output is micro-batch ``i``'s. The masked all-reduce that handed the last stage's output to every
    stage on each head tick (``m`` a step) becomes one reduction of the head's gradients over ``stage`` after the
    ticks, merged with the data-parallel one. Each stage computes one head, as it did when all ran the last
    stage's. With the rows split over data (``s.head_split``) each stage runs each shard's rows apart too
    (:func:`_head_rows`). Layers that store values keep :func:`_first` (their cotangents go to every stage).
    Returns ``(carry, dy)`` with ``dy`` ``(p, rows, ...)``: the last stage's is the one used."""
    p, d, axes = s.p, s.head_split, s.row_axes
    if d > 1:
        inputs_i = jax.tree.map(lambda a: _cut_rows(a[i], d), s.head_inputs)

        def one_stage(hp_d, y):
            with batch_split_over(axes):
                return jax.vmap(lambda hp, yy, inp: head_loss(hp, yy, {}, i, inp), spmd_axis_name=axes)(
                    hp_d, _cut_rows(y, d), inputs_i)

        hp = jax.tree.map(lambda a: _on_rows(jnp.broadcast_to(a, (p, d) + a.shape), axes), head_params)
        place = lambda a: _on_rows(a, axes)  # noqa: E731
    else:
        call = _head_call(head_loss, s.head_inputs)

        def one_stage(hp_s, y):
            return call(hp_s, y, {}, i)

        hp = jax.tree.map(lambda a: _on_stage(jnp.broadcast_to(a, (p,) + a.shape)), head_params)
        place = _on_stage
    (loss_p, vjp, aux_p) = jax.vjp(jax.vmap(one_stage, spmd_axis_name=STAGE), hp, fout, has_aux=True)
    dhead_p, dy_p = vjp(jnp.ones(loss_p.shape, loss_p.dtype))
    mine = lambda a: jnp.where(_mask(s.last, a), a, jnp.zeros_like(a))  # noqa: E731  the last stage's only
    c = dict(c)
    keep = lambda acc, a: place(s.add(acc, mine(a)))  # noqa: E731
    c["dhead"] = jax.tree.map(keep, c["dhead"], dhead_p)
    c["loss"] = keep(c["loss"], loss_p)
    c["aux"] = jax.tree.map(keep, c["aux"], aux_p)
    return c, dy_p


def _head_handed_over(s: types.SimpleNamespace, c, i, fout: jax.Array, vals, head_loss, head_params):
    """The head tick where the layers store values (MoE): the last stage's output and the micro-batch's layer values
    go to every stage (:func:`_first`), every stage runs the same head and keeps the values' cotangents for their
    layers' backward. Returns ``(carry, dy)`` with ``dy`` ``(1, rows, ...)`` (every stage's)."""
    p = s.p
    v_i = jax.tree.map(lambda a: s.layers(_first(a, p - 1, p)), vals)
    y_i = _first(fout, p - 1, p)
    if s.head_split > 1:
        c, dy = _head_rows(s, c, i, y_i, head_loss, head_params)
        return c, dy[None]
    call = _head_call(head_loss, s.head_inputs)
    (loss_i, vjp, aux_i) = jax.vjp(lambda hp, y, vf: call(hp, y, _with_floats(v_i, vf), i), head_params,
                                   y_i, _floats(v_i), has_aux=True)
    dhead_i, dy, dv_i = vjp(jnp.ones((), loss_i.dtype))
    c["dv"] = jax.tree.map(lambda buf, d: jax.lax.dynamic_update_index_in_dim(
        buf, d.reshape(buf.shape[1:]).astype(jnp.float32), i, 0), c["dv"], dv_i)
    c["dhead"] = jax.tree.map(s.add, c["dhead"], dhead_i)
    c["loss"] = c["loss"] + loss_i.astype(jnp.float32)
    c["aux"] = jax.tree.map(s.add, c["aux"], aux_i)
    return c, dy[None]  # every stage has it: the last one uses it


def _one_f_one_b_tick(s: types.SimpleNamespace, x_m: jax.Array, side_m, head_loss, head_params, *,
                      split_backward=None):
    """``tick(carry, t, static=None) -> carry``: one tick of :func:`one_f_one_b` (forward, head, backward).

    ``split_backward``: ``(b_part, w_part)`` replacing the backward (zero_bubble, its own module):
    ``b_part(c, t, dy) -> c`` the input-gradient half on the backward ticks, ``w_part(c, t) -> c`` the
    weight-gradient half on ticks ``2p-2 ..`` (where every stage has one)."""
    (p, m, table, fwd, bwd, slots, w, run_f, run_b, stash_put, stash_get, put_v, get_v, first, last,
     stages, y_shape, v_shape, add) = (
        s.p, s.m, s.table, s.fwd, s.bwd, s.slots, s.w, s.run_f, s.run_b, s.stash_put, s.stash_get,
        s.put_v, s.get_v, s.first, s.last, s.stages, s.y_shape, s.v_shape, s.add)

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
        if s.head_on_last:
            return _head_on_last(s, dict(c), t - (p - 1), fout, head_loss, head_params)
        return _head_handed_over(s, dict(c), t - (p - 1), fout, vals, head_loss, head_params)

    def b_part(c, t, dy):
        # backward: the last stage starts from dy, the others from what their right neighbour sent
        c = dict(c)
        bmb = bwd[t]
        bvalid = bmb >= 0
        ct = jnp.where(_mask(last, c["bstate"]), dy.astype(c["bstate"].dtype), c["bstate"])  # dy (1 or p, ...)
        ct = jnp.where(_mask(bvalid, ct), ct, jnp.zeros_like(ct))  # idle ticks get a zero cotangent: no gradient
        ct_v = jax.tree.map(lambda buf, a: jnp.where(_mask(bvalid, buf), buf, 0).astype(a.dtype),
                            jax.tree.map(lambda buf: get_v(jnp.maximum(bmb, 0), stages, buf), c["dv"]),
                            _floats(v_shape))
        dw_t, dx_t = run_b(w, stash_get(c["stash"], jnp.maximum(bmb, 0) % slots), _pick(side_m, bmb), ct, ct_v)
        c["dx"] = _on_stage(jax.vmap(lambda buf, j, v: buf.at[j].add(v))(c["dx"], jnp.maximum(bmb, 0),
                                                                         dx_t.astype(jnp.float32)))
        c["bstate"] = _shift(dx_t, -1)
        keep = _on_stage if s.rows_split == 1 else lambda a: _on_rows(a, s.row_axes)  # noqa: E731
        c["dw"] = jax.tree.map(lambda a, b: keep(add(a, b)), c["dw"], dw_t)
        return c

    no_dy = _on_stage(jnp.zeros((p,) + y_shape.shape, y_shape.dtype)) if s.head_on_last else \
        jnp.zeros((1,) + y_shape.shape, y_shape.dtype)
    no_f = (_on_stage(jnp.zeros((p,) + y_shape.shape, y_shape.dtype)), s.carry0["vals"])

    def tick(c, t, static=None):
        # Warm-up ticks (t < p-1) have no backward anywhere, drain ticks (t >= m+p-1) no forward, and
        # the head has a micro-batch only in between: conditionals (the predicate is the same on every
        # device) skip that work. ``static``: a Python tick number (unrolled: plain code, exact FLOPs).
        when = lambda lo, hi: (lo <= static < hi) if static is not None else (t >= lo) & (t < hi)  # noqa: E731
        cond = lambda pred, yes, no, *ops: (yes if pred else no)(*ops) if static is not None \
            else jax.lax.cond(pred, yes, no, *ops)  # noqa: E731
        c, fout, vals = cond(when(0, m + p - 1), f_part, lambda c, t: (dict(c),) + no_f, c, t)
        c, dy = cond(when(p - 1, m + p - 1), h_part, lambda c, t, f, v: (dict(c), no_dy), c, t, fout, vals)
        if split_backward is None:
            return cond(when(p - 1, table.ticks), b_part, lambda c, t, dy: dict(c), c, t, dy)
        c = cond(when(p - 1, table.ticks), split_backward[0], lambda c, t, dy: dict(c), c, t, dy)
        return cond(when(2 * p - 2, table.ticks), split_backward[1], lambda c, t: dict(c), c, t)

    return tick
