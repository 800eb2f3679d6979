"""The zero-bubble schedule (ZB-H1, Qi et al. 2023, in lock-step SPMD): 1F1B whose backward is split
into an input-gradient half ``B`` (what the previous stage waits for) and a weight-gradient half ``W``
(what nobody waits for), with ``W`` deferred to the ticks where every stage has one.

**The schedule.** The forward and ``B`` ticks are 1F1B's: stage ``s`` runs the forward of micro-batch
``t - s`` and ``B`` of ``t - (2p-2-s)`` on tick ``t``. ``W`` of micro-batch ``j`` runs on every stage on
tick ``j + 2p - 2``, right after stage 0's ``B`` of it (the last stage to get there). So the ``W`` slot
runs on ``m`` ticks only, all of them full, while the forward and ``B`` slots still run ``m + p - 1``
ticks each: the warm-up and drain bubble holds ``F + B`` per idle slot instead of 1F1B's ``F + B + W``.

Why not the paper's ZB-H1 placement: there each device picks its own next pass, so ``W`` also fills
the idle time of stages whose neighbours are still busy. In one SPMD program every stage runs the
same slot on each tick (a slot that is idle on one stage is idle compute everywhere), so the only idle
time ``W`` can leave is the drain's: bubble ``(p-1)(1-ω)/(m + (p-1)(1-ω))`` with ``ω`` the weight
gradient's share of a stage's work (:func:`~meshtrain.parallel.pipeline.bubble_fraction`).

**How the backward splits.** One layer's VJP (``jax.vjp`` of ``layer_fn`` w.r.t. its weights and
input) gives residuals; the ``B`` tick recomputes the stage forward from the stashed stage input (as
1F1B does), runs the input-gradient chain through the stage (probing each layer's output cotangent
with a zero input ``eps``) and keeps, per layer, the output cotangent and the residuals that the
weight half reads and that depend on the micro-batch (found once by tracing: residuals made from the
weights alone are recomputed on the ``W`` tick, the others are not needed there). ``W`` rebuilds each
layer's VJP from them and takes only the weight cotangent (XLA drops the input half).

**Memory.** On top of 1F1B's stash, a stage keeps these halves for the micro-batches between their
``B`` and ``W``: at most ``p`` (stage ``p-1``: ``B`` at ``j+p-1``, ``W`` at ``j+2p-2``), a ``p``-slot
buffer (+ one slot idle ticks write to) of ``L/p`` layers × (output cotangent ``x`` + the weight half's
residuals ``a_W``) per stage; with the ``B`` tick's own VJP residuals and the halves it is writing,
at most ``(p+3)·(L/p)·(a_W + x)`` above 1F1B (:func:`meshtrain.analysis.pipeline.zero_bubble_extra_bytes`;
tests/test_pipeline_zero_bubble.py checks it against ``memory_analysis``). ``a_W`` is about a layer's
activations without remat whatever the recipe's remat: the deferral is what keeps them.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Tuple

import jax
import jax.numpy as jnp
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: which residuals the weight half reads

from meshtrain.parallel.pipeline._parts import STAGE
from meshtrain.parallel.pipeline._schedules import (_first, _floats, _mask, _on_stage, _one_f_one_b_setup,
                                                    _one_f_one_b_tick, _pick)
from meshtrain.parallel.pipeline._tables import PipelineConfig, schedule_table
from meshtrain.strategies import Schedule


@dataclasses.dataclass(frozen=True)
class LayerSplit:
    """What one layer's VJP residuals are for (found by tracing, once per step): ``stored`` the indices
    of the residual leaves the weight half reads that depend on the micro-batch (kept from ``B`` to
    ``W``), ``derived`` those it reads that come from the weights alone (recomputed on the ``W`` tick).
    ``stored_avals``: their shapes (one layer, one micro-batch)."""

    stored: Tuple[int, ...]
    derived: Tuple[int, ...]
    stored_avals: Tuple[jax.ShapeDtypeStruct, ...]


def _layer_vjp(layer_fn, w_l, h, side):
    """``((y, float values), vjp_fn)`` of one layer w.r.t. its weights and input."""
    def f(ww, hh):
        y, v = layer_fn(ww, hh, side)
        return y, _floats(v)

    return jax.vjp(f, w_l, h)


def _depends(jaxpr, dep_in: Sequence[bool]):
    """Which outputs of ``jaxpr`` depend on the inputs flagged in ``dep_in`` (an equation's outputs
    depend on all of its inputs: conservative for nested jaxprs; constants are not data)."""
    dep = {v: d for v, d in zip(jaxpr.invars, dep_in)}

    def of(v):
        return False if type(v).__name__ == "Literal" else dep.get(v, False)

    for eqn in jaxpr.eqns:
        d = any(of(v) for v in eqn.invars)
        for o in eqn.outvars:
            dep[o] = d
    return [of(v) for v in jaxpr.outvars]


def layer_split(layer_fn, w_l, h, side, ct) -> LayerSplit:
    """The :class:`LayerSplit` of ``layer_fn`` at the abstract ``w_l`` (one layer), ``h`` (its input),
    ``side`` and ``ct`` (the cotangent of ``(y, float values)``)."""
    def residuals(ww, hh, sd):
        return jax.tree.leaves(_layer_vjp(layer_fn, ww, hh, sd)[1])

    res_jaxpr = jax.make_jaxpr(residuals)(w_l, h, side).jaxpr
    n_w = len(jax.tree.leaves(w_l))
    data = _depends(res_jaxpr, [False] * n_w + [True] * (len(res_jaxpr.invars) - n_w))
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in res_jaxpr.outvars]

    def weight_half(ww, hh, sd, res, c):
        fn = _layer_vjp(layer_fn, ww, hh, sd)[1]
        return jax.tree.unflatten(jax.tree.structure(fn), res)(c)[0]

    half = jax.make_jaxpr(weight_half)(w_l, h, side, avals, ct).jaxpr
    _, used = pe.dce_jaxpr(half, [True] * len(half.outvars))
    start = len(half.invars) - len(avals) - len(jax.tree.leaves(ct))
    used = used[start:start + len(avals)]
    stored = tuple(i for i, u in enumerate(used) if u and data[i])
    derived = tuple(i for i, u in enumerate(used) if u and not data[i])
    return LayerSplit(stored, derived, tuple(avals[i] for i in stored))


def _stage_b(layer_fn, split: LayerSplit):
    """One stage's input-gradient half: ``(w_k, x, side, ct, ct_v) -> (dx, (stored residuals, g))``
    with ``g`` (leading ``k``) each layer's output cotangent."""

    def run(w_k, x, side, ct, ct_v):
        def body(h, inp):
            w_l, eps = inp
            (y, v), fn = _layer_vjp(layer_fn, w_l, h, side)
            leaves = jax.tree.leaves(fn)
            return y + eps.astype(y.dtype), (v, [leaves[i] for i in split.stored])

        def stage(xx, eps_k):
            y, (v, res) = jax.lax.scan(body, xx, (w_k, eps_k))
            return (y, v), res

        eps0 = jnp.zeros((jax.tree.leaves(w_k)[0].shape[0],) + x.shape, x.dtype)
        _, vjp, res = jax.vjp(stage, x, eps0, has_aux=True)
        dx, g = vjp((ct, ct_v))
        return dx, (res, g)

    return run


def _stage_w(layer_fn, split: LayerSplit):
    """One stage's weight-gradient half: ``(w_k, res, g, side, ct_v, h0) -> dw_k`` (``h0``: a zero
    input, only to rebuild each layer's VJP; its forward is dead code apart from what ``derived`` reads)."""

    def run(w_k, res, g, side, ct_v, h0):
        def body(_, inp):
            w_l, res_l, g_l, ctv_l = inp
            fn = _layer_vjp(layer_fn, w_l, h0, side)[1]
            leaves, treedef = jax.tree.flatten(fn)
            for i, r in zip(split.stored, res_l):
                leaves[i] = r
            return None, jax.tree.unflatten(treedef, leaves)((g_l, ctv_l))[0]

        return jax.lax.scan(body, None, (w_k, res, g, ct_v))[1]

    return run


def zero_bubble(layer_fn, stack, x_m: jax.Array, side_m, head_loss, head_params, cfg: PipelineConfig,
                *, unroll: bool = False):
    """The zero-bubble schedule: arguments and results as
    :func:`~meshtrain.parallel.pipeline.one_f_one_b` (``(loss_sum, aux_sum, d_stack, d_head_params,
    dx_m)``); the backward of each stage runs as an input-gradient tick and a deferred weight-gradient
    tick (module docstring). ``unroll``: Python tick loop (exact per-tick FLOPs in tests)."""
    s = _one_f_one_b_setup(layer_fn, stack, x_m, side_m, head_loss, head_params, cfg)
    p, m, table = s.p, s.m, s.table  # forward / B ticks: 1F1B's
    one = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), t)  # noqa: E731 (p,k,..)
    w_l, v_l = one(s.w), jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), _floats(s.v_shape))
    side_1 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), side_m)
    h = jax.ShapeDtypeStruct(x_m.shape[1:], x_m.dtype)
    split = layer_split(layer_fn, w_l, h, side_1, (jax.ShapeDtypeStruct(s.y_shape.shape, s.y_shape.dtype), v_l))
    k = jax.tree.leaves(s.w)[0].shape[1]
    slots = p  # a micro-batch waits from its B (tick j+2p-2-s) to its W (tick j+2p-2): at most p in between
    carry0 = dict(s.carry0, wbuf=(
        [_on_stage(jnp.zeros((p, slots + 1, k) + a.shape, a.dtype)) for a in split.stored_avals],  # + idle slot
        _on_stage(jnp.zeros((p, slots + 1, k) + s.y_shape.shape, s.y_shape.dtype))))
    run_b = jax.vmap(_stage_b(layer_fn, split), spmd_axis_name=STAGE)
    run_w = jax.vmap(_stage_w(layer_fn, split), spmd_axis_name=STAGE, in_axes=(0, 0, 0, 0, 0, None))
    put = jax.vmap(lambda buf, i, v: jax.lax.dynamic_update_index_in_dim(buf, v, i, 0))
    get = jax.vmap(lambda buf, i: jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False))
    bwd, wgt = s.bwd, jnp.asarray(schedule_table(Schedule.ZERO_BUBBLE, p, m).weight)

    def ct_values(c, mb, valid):
        """Micro-batch ``mb``'s cotangents of each stage's layer values (zero where ``valid`` is false)."""
        got = jax.tree.map(lambda buf: s.get_v(jnp.maximum(mb, 0), s.stages, buf), c["dv"])
        return jax.tree.map(lambda buf, a: jnp.where(_mask(valid, buf), buf, 0).astype(a.dtype), got,
                            _floats(s.v_shape))

    def b_part(c, t, dy):
        c = dict(c)
        bmb = bwd[t]
        valid = bmb >= 0
        ct = jnp.where(_mask(s.last, c["bstate"]), dy.astype(c["bstate"].dtype)[None], c["bstate"])
        ct = jnp.where(_mask(valid, ct), ct, jnp.zeros_like(ct))
        x_in = s.stash_get(c["stash"], jnp.maximum(bmb, 0) % s.slots)
        dx_t, (res, g) = run_b(s.w, x_in, _pick(side_m, bmb), ct, ct_values(c, bmb, valid))
        c["dx"] = _on_stage(jax.vmap(lambda buf, j, v: buf.at[j].add(v))(c["dx"], jnp.maximum(bmb, 0),
                                                                         dx_t.astype(jnp.float32)))
        c["bstate"] = _shift_back(dx_t)
        slot = jnp.where(valid, jnp.maximum(bmb, 0) % slots, slots)
        bufs, gbuf = c["wbuf"]
        c["wbuf"] = ([_on_stage(put(b, slot, r)) for b, r in zip(bufs, res)], _on_stage(put(gbuf, slot, g)))
        return c

    def w_part(c, t):
        c = dict(c)
        wmb = wgt[t]  # the same micro-batch on every stage; runs only on ticks where it is one (2p-2 ..)
        bufs, gbuf = c["wbuf"]
        slot = jnp.maximum(wmb, 0) % slots
        dw_t = run_w(s.w, [get(b, slot) for b in bufs], get(gbuf, slot), _pick(side_m, wmb),
                     ct_values(c, wmb, wmb >= 0), jnp.zeros(x_m.shape[1:], x_m.dtype))
        c["dw"] = jax.tree.map(lambda a, b: _on_stage(s.add(a, b)), c["dw"], dw_t)
        return c

    s.carry0 = carry0
    tick = _one_f_one_b_tick(s, x_m, side_m, head_loss, head_params, split_backward=(b_part, w_part))
    if unroll:
        c = carry0
        for t in range(table.ticks):
            c = tick(c, jnp.asarray(t), static=t)
    else:
        c, _ = jax.lax.scan(lambda cc, t: (tick(cc, t), None), carry0, jnp.arange(table.ticks))
    d_stack = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), c["dw"])  # (p, k, ...) -> (L, ...)
    return c["loss"], c["aux"], d_stack, c["dhead"], _first(c["dx"], 0, p)


def _shift_back(x: jax.Array) -> jax.Array:
    """Stage ``s`` gets stage ``s + 1``'s value (cotangents flow towards stage 0)."""
    return _on_stage(jnp.roll(x, -1, axis=0))

