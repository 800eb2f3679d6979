"""The executors: gpipe and circular (:func:`run_stack`, differentiated by autodiff) and 1F1B
(:func:`one_f_one_b`, its own per-stage VJP), one SPMD program over ``stage``."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.annotate import current_step_context, remat
from meshtrain.parallel.pipeline._parts import STAGE
from meshtrain.parallel.pipeline._tables import PipelineConfig, schedule_table
from meshtrain.recipes import Schedule


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
        # one group per stage: a static index (no gather, whose transpose cannot add the fm32 FP8 meta)
        w_g = jax.tree.map(lambda a: a[0] if r == 1 else
                           jax.lax.dynamic_index_in_dim(a, jnp.maximum(g, 0), 0, keepdims=False), w_s)
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
    s = _one_f_one_b_setup(layer_fn, stack, x_m, side_m, head_loss, head_params, cfg)
    return _run_ticks(s, _one_f_one_b_tick(s, x_m, side_m, head_loss, head_params), unroll)


def _run_ticks(s, tick, unroll: bool):
    """Run ``tick`` over the schedule's ticks from ``s.carry0`` (unrolled: each tick its own static index) and
    return what 1F1B and zero-bubble return: ``(loss_sum, aux_sum, d_stack, d_head_params, dx_m)``."""
    if unroll:
        c = s.carry0
        for t in range(s.table.ticks):
            c = tick(c, jnp.asarray(t), static=t)
    else:
        c, _ = jax.lax.scan(lambda cc, t: (tick(cc, t), None), s.carry0, jnp.arange(s.table.ticks))
    d_stack = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), c["dw"])  # (p, k, ...) -> (L, ...)
    return c["loss"], c["aux"], d_stack, c["dhead"], _first(c["dx"], 0, s.p)


def _one_f_one_b_setup(layer_fn, stack, x_m: jax.Array, side_m, head_loss, head_params,
                       cfg: PipelineConfig) -> types.SimpleNamespace:
    """What every tick of :func:`one_f_one_b` reads: the schedule table, the per-stage weights, the
    vmapped stage forward and backward, the stash helpers, the shapes and the initial carry."""
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

    return types.SimpleNamespace(p=p, m=m, table=table, fwd=fwd, bwd=bwd, slots=slots, w=w, stage_fn=stage_fn,
                                 run_f=run_f, run_b=run_b, stash_put=stash_put, stash_get=stash_get,
                                 put_v=put_v, get_v=get_v, first=first, last=last, stages=stages,
                                 y_shape=y_shape, v_shape=v_shape, layers=layers, carry0=carry0, add=add)


def _one_f_one_b_tick(s: types.SimpleNamespace, x_m: jax.Array, side_m, head_loss, head_params, *,
                      split_backward=None):
    """``tick(carry, t, static=None) -> carry``: one tick of :func:`one_f_one_b` (forward, head, backward).

    ``split_backward``: ``(b_part, w_part)`` replacing the backward (zero_bubble, its own module):
    ``b_part(c, t, dy) -> c`` the input-gradient half on the backward ticks, ``w_part(c, t) -> c`` the
    weight-gradient half on ticks ``2p-2 ..`` (where every stage has one)."""
    (p, m, table, fwd, bwd, slots, w, stage_fn, run_f, run_b, stash_put, stash_get, put_v, get_v, first, last,
     stages, y_shape, v_shape, layers, add) = (
        s.p, s.m, s.table, s.fwd, s.bwd, s.slots, s.w, s.stage_fn, s.run_f, s.run_b, s.stash_put, s.stash_get,
        s.put_v, s.get_v, s.first, s.last, s.stages, s.y_shape, s.v_shape, s.layers, s.add)

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
