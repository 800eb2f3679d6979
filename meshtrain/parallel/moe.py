"""Mixture-of-experts kernels: the router, token dispatch to experts and the combine back.

Routing (:func:`route`, f32): ``softmax`` over the router logits, top-``k`` experts per token
(Mixtral / Switch), optionally renormalised over the chosen ``k``. Two dispatch modes:

* **capacity** (GShard / Switch): each sequence (one batch row, so the result does not depend on
  the mesh) gives every expert ``C = min(T, ceil(capacity_factor · T · k / E))`` slots. Slots are filled in
  priority order: every token's first choice (in token order), then every second choice, and so on.
  Assignments past ``C`` are *dropped*: they contribute nothing and the token keeps only its
  residual. Tokens go to experts as a fixed ``(rows, E, C, d)`` buffer.
* **dropless** (MegaBlocks): assignments are sorted by expert and multiplied with
  ``jax.lax.ragged_dot`` (a grouped matmul); nothing is dropped.

Expert parallelism: when the step's rules map the ``expert`` logical axis of the expert weights to
mesh axes of size > 1, :func:`experts` runs inside ``jax.shard_map`` and exchanges tokens with
``jax.lax.all_to_all`` over those axes (each device holds ``E / ep`` experts):

* capacity: a padded fixed-size all-to-all of the ``(rows, E, C, d)`` buffer, split on ``E``;
* dropless on GPU/TPU: ``jax.lax.ragged_all_to_all`` of the expert-sorted tokens (only the rows
  that exist travel; the receive buffer holds the worst case, ``ep × local assignments``);
* dropless on CPU (XLA:CPU has no ragged all-to-all): a padded exchange with room for *every*
  local assignment for each destination (``ep × local assignments`` rows sent), so nothing drops;
  :func:`dropless_exchange` says which, and the plan states it.

With ``Expert(all_to_all=hierarchical)`` over an expert axis that spans slices (ICI × DCN) the exchange runs in two
levels, inside each slice then across slices, and under tensor parallelism each tensor rank moves its share of the
width (PCC): :mod:`meshtrain.parallel.moe_exchange` (dropless runs the padded exchange there on every platform).

Expert weights keep FSDP/TP rules elsewhere: before the exchange they are gathered on ``embed``
(FSDP) and stay split on ``mlp`` over tensor axes (a ``psum`` after the down projection).

Example::

    r = route(logits_bte, top_k=2, capacity=capacity_for(1.25, T, 2, E))
    y_btd = experts(x_btd, r, w_gate_edf, w_up_edf, w_down_efd, capacity=r.capacity)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain.annotate import current_step_context
from meshtrain.errors import ConfigError
from meshtrain.parallel.flash import match_varying, varying_axes
from meshtrain.parallel.moe_exchange import TokenExchange, active_exchange

#: Keys of the per-layer router statistics (all f32 scalars).
STAT_KEYS = ("aux_loss", "z_loss", "load_max", "drop_frac")


def check_capacity_factor(capacity_factor) -> None:
    """Raise :class:`ConfigError` unless ``capacity_factor`` is ``None`` (dropless) or a finite number > 0."""
    if capacity_factor is None:
        return
    ok = isinstance(capacity_factor, numbers.Real) and not isinstance(capacity_factor, bool)
    if not ok or not math.isfinite(capacity_factor) or not capacity_factor > 0:
        raise ConfigError(f"capacity_factor={capacity_factor!r}: use a finite number > 0 (e.g. 1.25; "
                          f">= n_experts/top_k drops nothing), or capacity_factor=None for dropless routing")


def capacity_for(capacity_factor: float, seq_len: int, top_k: int, n_experts: int) -> int:
    """Slots per expert per sequence: ``min(seq_len, ceil(capacity_factor · seq_len · top_k / n_experts))``.
    ``capacity_factor >= n_experts / top_k`` never drops (``C = seq_len``: a token picks an expert at most
    once, so an expert never receives more than ``seq_len`` tokens of a sequence); a larger factor would
    only add empty slots (``1e6`` asked the dispatch buffer for hundreds of GB), so ``C`` stops there."""
    if capacity_factor is None:
        raise ConfigError("capacity_for(None, ...): dropless routing has no capacity; pass capacity=None to "
                          "route() and experts() instead")
    check_capacity_factor(capacity_factor)
    return max(1, min(seq_len, math.ceil(capacity_factor * seq_len * top_k / n_experts)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """Where each token goes. ``(b, t, k)`` arrays: ``expert`` (int32), ``weight`` (f32 combine
    weight), ``slot`` (position in its expert's buffer of its row; capacity mode), ``kept``
    (``False`` for dropped assignments). ``counts_e`` assignments per expert before dropping,
    ``dropped_e`` dropped per expert (global over the batch), ``stats`` (:data:`STAT_KEYS`)."""

    expert: jax.Array
    weight: jax.Array
    slot: jax.Array
    kept: jax.Array
    counts_e: jax.Array
    dropped_e: jax.Array
    stats: Dict[str, jax.Array]
    capacity: Optional[int] = dataclasses.field(default=None, metadata=dict(static=True))


def route(logits_bte: jax.Array, top_k: int, *, capacity: Optional[int] = None, norm_topk: bool = True) -> Routing:
    """Top-``k`` routing over ``softmax(logits)`` in f32, with the Switch statistics:

    * ``aux_loss = E · Σ_e f_e · P_e`` with ``f_e`` the share of the ``N·k`` assignments that chose
      expert ``e`` and ``P_e`` the mean router probability of ``e`` (1.0 when perfectly balanced);
    * ``z_loss = mean_n logsumexp(logits_n)²`` (ST-MoE);
    * ``load_max = max_e count_e / mean_e count_e`` (busiest expert relative to the mean);
    * ``drop_frac`` = dropped assignments / ``N·k`` (0 in dropless mode, ``capacity=None``).
    """
    logits = logits_bte.astype(jnp.float32)
    b, t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ConfigError(f"top_k={top_k} with {e} experts: use 1 <= top_k <= n_experts")
    probs = jax.nn.softmax(logits, axis=-1)
    weight, expert = jax.lax.top_k(probs, top_k)
    if norm_topk:
        weight = weight / jnp.sum(weight, axis=-1, keepdims=True)
    expert = expert.astype(jnp.int32)
    onehot_btke = jax.nn.one_hot(expert, e, dtype=jnp.int32)
    counts = jnp.sum(onehot_btke, axis=(0, 1, 2))
    if capacity is None:
        slot = jnp.zeros_like(expert)
        kept = jnp.ones(expert.shape, bool)
    else:
        # Priority: all first choices of a row (token order), then all second choices, ...
        order_bke = jnp.swapaxes(onehot_btke, 1, 2).reshape(b, top_k * t, e)
        pos = (jnp.cumsum(order_bke, axis=1) - 1) * order_bke
        slot = jnp.swapaxes(jnp.sum(pos, axis=-1).reshape(b, top_k, t), 1, 2).astype(jnp.int32)
        kept = slot < capacity
    kept_counts = jnp.sum(onehot_btke * kept[..., None], axis=(0, 1, 2))
    n_assign = float(b * t * top_k)
    f_e = counts.astype(jnp.float32) / n_assign
    p_e = jnp.mean(probs, axis=(0, 1))
    stats = {
        "aux_loss": e * jnp.sum(f_e * p_e),
        "z_loss": jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
        "load_max": jnp.max(counts).astype(jnp.float32) / (n_assign / e),
        "drop_frac": 1.0 - jnp.sum(kept_counts).astype(jnp.float32) / n_assign,
    }
    return Routing(expert, weight, slot, kept, counts, counts - kept_counts, stats, capacity)


def swiglu_experts(x_end, w_gate_edf, w_up_edf, w_down_efd):
    """Every expert's SwiGLU on its own rows: ``x (E, n, d) -> (E, n, d)``."""
    h = jax.nn.silu(jnp.einsum("end,edf->enf", x_end, w_gate_edf)) * jnp.einsum("end,edf->enf", x_end, w_up_edf)
    return jnp.einsum("enf,efd->end", h, w_down_efd)


# -- capacity mode: per-row fixed buffers ---------------------------------------------------------

def _flat_slot(r_expert, r_slot, r_kept, n_experts, capacity):
    """Index into a row's flattened ``(E·C + 1)`` buffer; dropped assignments point at the last row."""
    return jnp.where(r_kept, r_expert * capacity + r_slot, n_experts * capacity)


def dispatch_rows(x_btd, expert_btk, slot_btk, kept_btk, n_experts: int, capacity: int):
    """``(b, E, C, d)`` buffers: row ``b``'s tokens in the slots of their experts (zeros elsewhere)."""

    def one(x_td, e_tk, s_tk, k_tk):
        idx = _flat_slot(e_tk, s_tk, k_tk, n_experts, capacity).reshape(-1)
        src = jnp.repeat(x_td, e_tk.shape[1], axis=0)
        buf = jnp.zeros((n_experts * capacity + 1, x_td.shape[-1]), x_td.dtype).at[idx].add(src)
        return buf[:-1].reshape(n_experts, capacity, x_td.shape[-1])

    return jax.vmap(one)(x_btd, expert_btk, slot_btk, kept_btk)


def combine_rows(y_becd, expert_btk, slot_btk, kept_btk, weight_btk):
    """``Σ_k weight · y[expert, slot]`` per token; dropped assignments add nothing."""
    n_experts, capacity = y_becd.shape[1], y_becd.shape[2]

    def one(y_ecd, e_tk, s_tk, k_tk, w_tk):
        flat = jnp.concatenate([y_ecd.reshape(n_experts * capacity, -1), jnp.zeros((1, y_ecd.shape[-1]), y_ecd.dtype)])
        y_tkd = flat[_flat_slot(e_tk, s_tk, k_tk, n_experts, capacity)]
        return jnp.einsum("tkd,tk->td", y_tkd, (w_tk * k_tk).astype(y_tkd.dtype))

    return jax.vmap(one)(y_becd, expert_btk, slot_btk, kept_btk, weight_btk)


# -- dropless mode: sort by expert, grouped matmul -------------------------------------------------
#
# Every reordering below is a permutation applied as a gather whose backward is the inverse gather
# (:func:`permute_rows`), and every permutation but the first sort is computed from per-expert
# counts (:func:`expert_order`). XLA:TPU compiles sorts, scatters and scatter-adds of the
# ``ep × N·k`` receive buffer slowly: with them one small-moe layer's dropless step took 44 s of
# compile CPU on v5p:2x2x2, and Mixtral's did not finish in 15 minutes; with gathers only, 7 s.

def permute_rows(x, idx, inv):
    """``x[idx]`` for a permutation ``idx`` whose inverse is ``inv``: the backward is ``g[inv]``, a
    gather, instead of the scatter-add XLA builds for the transpose of a general gather."""
    return _permute(tuple(sorted(varying_axes(x))), x, idx, inv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _permute(x_varying, x, idx, inv):
    return x[idx]


def _permute_fwd(x_varying, x, idx, inv):
    return x[idx], inv


def _permute_bwd(x_varying, inv, g):
    g_x = g[inv]
    # Under shard_map: where x is the same on every device of an axis (typed invariant) but its
    # uses differ, its cotangent is the sum over that axis, as JAX's own transposes do.
    extra = tuple(sorted(varying_axes(g_x) - frozenset(x_varying)))
    return (jax.lax.psum(g_x, extra) if extra else g_x), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def _exclusive_cumsum(c, axis: int = 0):
    return jnp.cumsum(c, axis=axis) - c


def _sorted_rows(x_nd, flat_e, order, k: int, n_experts: int):
    """Each token's ``k`` assignments (``flat_e``: their experts, token-major) sorted by expert along
    ``order`` (a stable argsort): rows ``(N·k, d)``, their experts, ``order``, its inverse and the
    per-expert counts ``(n_experts,)``."""
    onehot = (flat_e[:, None] == jnp.arange(n_experts, dtype=flat_e.dtype)[None, :]).astype(jnp.int32)
    counts = onehot.sum(0)
    rank = (jnp.cumsum(onehot, 0) * onehot).sum(1) - 1       # rank among the same expert's assignments
    inv = (_exclusive_cumsum(counts)[flat_e] + rank).astype(jnp.int32)
    xs = permute_rows(jnp.repeat(x_nd, k, axis=0), order.astype(jnp.int32), inv)
    return xs, flat_e[order], order.astype(jnp.int32), inv, counts


def expert_order(counts_il, chunk_start_i, rows: int):
    """Permutations between a receive buffer and the same rows grouped by local expert.

    The buffer (``rows`` long) holds, for each source ``i``, a chunk at ``chunk_start_i[i]`` whose
    first ``Σ_l counts_il[i, l]`` rows are sorted by local expert ``l``; the other rows are padding.
    Returns ``(idx, inv, group_sizes_l)``: ``buffer[idx]`` lists expert 0's rows (from source 0, 1,
    ...), then expert 1's, ..., then the padding rows in buffer order; ``inv`` is the inverse. Block
    arithmetic on the ``(ep, n_local)`` counts: no sort, no scatter.
    """
    counts_il = counts_il.astype(jnp.int32)
    chunk_start_i = chunk_start_i.astype(jnp.int32)
    src = (chunk_start_i[:, None] + _exclusive_cumsum(counts_il, 1)).reshape(-1)   # block starts, buffer order
    size = counts_il.reshape(-1)
    group_l = counts_il.sum(0)
    tgt = (_exclusive_cumsum(group_l)[None, :] + _exclusive_cumsum(counts_il, 0)).reshape(-1)  # target order
    valid = group_l.sum()
    r = jnp.arange(rows, dtype=jnp.int32)[:, None]
    in_src = (r >= src) & (r < src + size)                                         # (rows, blocks)
    valid_before = jnp.clip(r - src, 0, size).sum(1)
    inv = jnp.where(in_src.any(1), jnp.where(in_src, tgt + r - src, 0).sum(1), valid + r[:, 0] - valid_before)
    in_tgt = (r >= tgt) & (r < tgt + size)
    chunk_rows = counts_il.sum(1)
    chunk_end = jnp.concatenate([chunk_start_i[1:], jnp.full((1,), rows, jnp.int32)])
    pad_i = chunk_end - chunk_start_i - chunk_rows
    pad_start = _exclusive_cumsum(pad_i)
    j = r - valid                                                                  # the j-th padding row
    in_pad = (j >= pad_start) & (j < pad_start + pad_i)
    pad_pos = jnp.where(in_pad, chunk_start_i + chunk_rows + j - pad_start, 0).sum(1)
    idx = jnp.where(in_tgt.any(1), jnp.where(in_tgt, src + r - tgt, 0).sum(1), pad_pos)
    return idx.astype(jnp.int32), inv.astype(jnp.int32), group_l


def _grouped_swiglu(x_md, group_sizes_e, w_gate_edf, w_up_edf, w_down_efd):
    h = jax.nn.silu(jax.lax.ragged_dot(x_md, w_gate_edf, group_sizes_e)) * jax.lax.ragged_dot(x_md, w_up_edf,
                                                                                                group_sizes_e)
    return jax.lax.ragged_dot(h, w_down_efd, group_sizes_e)


def _unsort_combine(y_md, order, inv, weight_nk):
    n, k = weight_nk.shape
    y_ad = permute_rows(y_md, inv, order)
    return jnp.einsum("nkd,nk->nd", y_ad.reshape(n, k, -1), weight_nk.astype(y_md.dtype))


def dropless_local(x_nd, expert_nk, weight_nk, w_gate_edf, w_up_edf, w_down_efd):
    """Dropless experts on one device's tokens: sort, ``ragged_dot``, unsort, weighted sum."""
    k = expert_nk.shape[1]
    flat_e = expert_nk.reshape(-1)
    xs, _, order, inv, sizes = _sorted_rows(x_nd, flat_e, jnp.argsort(flat_e, stable=True), k,
                                            w_gate_edf.shape[0])
    return _unsort_combine(_grouped_swiglu(xs, sizes, w_gate_edf, w_up_edf, w_down_efd), order, inv, weight_nk)


# -- the entry point ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """How a step lays out the experts: mesh axes of the expert dimension (``ep`` devices), of the
    batch and of the expert ``mlp`` width (tensor). ``mesh`` is ``None`` outside a step / on one device."""

    mesh: Optional[jax.sharding.Mesh]
    expert_axes: Tuple[str, ...] = ()
    batch_axes: Tuple[str, ...] = ()
    mlp_axes: Tuple[str, ...] = ()

    @property
    def ep(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.expert_axes) if self.mesh is not None else 1


def _live(mesh, spec_entry) -> Tuple[str, ...]:
    axes = (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry or ())
    return tuple(a for a in axes if mesh.shape[a] > 1)


def expert_layout(n_experts: int, d_model: int, d_expert: int, batch: int) -> ExpertLayout:
    """The :class:`ExpertLayout` of the step being traced (no mesh outside a step or on one device)."""
    ctx = current_step_context()
    if ctx is None or ctx.mesh.size == 1:
        return ExpertLayout(None)
    sizes = dict(ctx.mesh.shape)
    w = ctx.rules.resolve("params", ("expert", "embed", "mlp"), (n_experts, d_model, d_expert), sizes,
                          path="moe expert weights", replicate_ok=ctx.replicate_ok)
    xb = ctx.rules.resolve("activations", ("batch",), (batch,), sizes, path="moe tokens",
                           replicate_ok=ctx.replicate_ok)
    spec = tuple(w.spec) + (None,) * (3 - len(tuple(w.spec)))
    bspec = tuple(xb.spec) + (None,)
    return ExpertLayout(ctx.mesh, _live(ctx.mesh, spec[0]), _live(ctx.mesh, bspec[0]), _live(ctx.mesh, spec[2]))


def dropless_exchange(mesh) -> str:
    """``"ragged"`` (``ragged_all_to_all``) on GPU/TPU meshes, ``"padded"`` on CPU (not implemented
    there): the padded exchange reserves room for every local assignment per destination."""
    devices = getattr(mesh, "devices", None)
    platform = devices.flat[0].platform if devices is not None and devices.size else "cpu"
    return "padded" if platform == "cpu" else "ragged"


def experts(x_btd, r: Routing, w_gate_edf, w_up_edf, w_down_efd, *, capacity: Optional[int]):
    """Apply the routed experts: ``y_btd = Σ_k weight · expert(x)`` (dropped assignments add nothing).

    Runs locally outside a step (or on one device); under a step whose rules shard ``expert`` over
    mesh axes, runs expert-parallel (see the module docstring). ``capacity=None``: dropless.
    """
    b, t, d = x_btd.shape
    n_experts, _, f = w_gate_edf.shape
    lay = expert_layout(n_experts, d, f, b)
    if lay.mesh is None or (capacity is not None and lay.ep == 1):
        if capacity is None:  # no mesh: one device's tokens
            y = dropless_local(x_btd.reshape(b * t, d), r.expert.reshape(b * t, -1), r.weight.reshape(b * t, -1),
                               w_gate_edf, w_up_edf, w_down_efd)
            return y.reshape(b, t, d)
        x_becd = dispatch_rows(x_btd, r.expert, r.slot, r.kept, n_experts, capacity)
        y_becd = jax.vmap(swiglu_experts, in_axes=(0, None, None, None))(x_becd, w_gate_edf, w_up_edf, w_down_efd)
        return combine_rows(y_becd, r.expert, r.slot, r.kept, r.weight).astype(x_btd.dtype)
    return _sharded(x_btd, r, w_gate_edf, w_up_edf, w_down_efd, capacity, lay)


def _sharded(x_btd, r: Routing, w_gate_edf, w_up_edf, w_down_efd, capacity, lay: ExpertLayout):
    mesh, ea, ba, ma = lay.mesh, lay.expert_axes, lay.batch_axes, lay.mlp_axes
    n_experts = w_gate_edf.shape[0]
    if lay.ep > 1:
        if n_experts % lay.ep:
            raise ConfigError(f"{n_experts} experts do not divide over the expert mesh axes {ea} ({lay.ep} devices); "
                              f"use an expert axis size that divides {n_experts} (e.g. --mesh expert=2) or a "
                              f"multiple of {lay.ep} experts")
        missing = [a for a in ea if a not in ba]
        if missing:
            raise ConfigError(f"expert parallelism over {ea} needs the batch split over those axes too (missing "
                              f"{missing}); use the `ep` strategy, which maps batch -> expert")
    bspec = ba if ba else None
    ein = (ea or None, None, ma or None)
    eout = (ea or None, ma or None, None)
    # Gather FSDP shards of the expert weights here (GSPMD): inside, each device needs its experts whole.
    w_gate_edf, w_up_edf = (jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P(*ein)))
                            for w in (w_gate_edf, w_up_edf))
    w_down_efd = jax.lax.with_sharding_constraint(w_down_efd, NamedSharding(mesh, P(*eout)))
    row = P(bspec, None, None)
    # hierarchical (moe_exchange): two exchange levels, the tensor ranks' shares (PCC); dropless runs padded there
    hier = active_exchange(current_step_context(), ea) if lay.ep > 1 else None
    tx = TokenExchange(hier, ma, math.prod(mesh.shape[a] for a in ma)) if hier is not None else None
    if tx is not None:
        tx.check_width(x_btd.shape[-1])
    kernel = _capacity_kernel if capacity is not None else (
        _dropless_kernel if dropless_exchange(mesh) == "padded" or lay.ep == 1 or tx is not None else _ragged_kernel)

    def body(x, e, s, k, w, wg, wu, wd):
        if tx is not None:  # the exchange reduces over the tensor axes itself (TokenExchange.finish)
            return kernel(x, e, s, k, w, wg, wu, wd, capacity=capacity, expert_axes=ea, ep=lay.ep, tx=tx)
        y = kernel(x, e, s, k, w, wg, wu, wd, capacity=capacity, expert_axes=ea, ep=lay.ep)
        return jax.lax.psum(y, ma) if ma else y

    fn = jax.shard_map(body, mesh=mesh, in_specs=(row, row, row, row, row, P(*ein), P(*ein), P(*eout)),
                       out_specs=row)
    return fn(x_btd, r.expert, r.slot, r.kept, r.weight, w_gate_edf, w_up_edf, w_down_efd)


def _capacity_kernel(x_btd, e_btk, s_btk, k_btk, w_btk, wg, wu, wd, *, capacity, expert_axes, ep, tx=None):
    n_experts = wg.shape[0] * ep
    x_becd = dispatch_rows(x_btd, e_btk, s_btk, k_btk, n_experts, capacity)
    if tx is not None:
        return _capacity_exchanged(x_becd, e_btk, s_btk, k_btk, w_btk, wg, wu, wd, ep, tx).astype(x_btd.dtype)
    if ep > 1:  # (b, E, C, d) -> (ep·b, E/ep, C, d): each device gets its experts' slots of every row
        x_becd = jax.lax.all_to_all(x_becd, expert_axes, 1, 0, tiled=True)
    y_becd = jax.vmap(swiglu_experts, in_axes=(0, None, None, None))(x_becd, wg, wu, wd)
    if ep > 1:
        y_becd = jax.lax.all_to_all(y_becd, expert_axes, 0, 1, tiled=True)
    return combine_rows(y_becd, e_btk, s_btk, k_btk, w_btk).astype(x_btd.dtype)


def _capacity_exchanged(x_becd, e_btk, s_btk, k_btk, w_btk, wg, wu, wd, ep: int, tx: TokenExchange):
    """The capacity kernel's exchange through ``tx`` (hierarchical, PCC): ``(b, E, C, d)`` as ``ep`` destination
    groups of ``E/ep`` experts, and back."""
    b, n_experts, capacity, d = x_becd.shape
    x_xbecd = x_becd.reshape(b, ep, n_experts // ep, capacity, d).swapaxes(0, 1)
    x_becd = tx.send(x_xbecd).reshape(ep * b, n_experts // ep, capacity, d)       # (ep sources · b, E/ep, C, d)
    y_becd = jax.vmap(swiglu_experts, in_axes=(0, None, None, None))(x_becd, wg, wu, wd)
    y_xbecd = tx.back(y_becd.reshape(ep, b, n_experts // ep, capacity, d))        # width d, or d/t under PCC
    y_becd = y_xbecd.swapaxes(0, 1).reshape(b, n_experts, capacity, -1)
    return tx.finish(combine_rows(y_becd, e_btk, s_btk, k_btk, w_btk))


def _dropless_kernel(x_btd, e_btk, s_btk, k_btk, w_btk, wg, wu, wd, *, capacity, expert_axes, ep, tx=None):
    """Dropless with a padded exchange: each destination gets room for all ``N·k`` local assignments."""
    b, t, d = x_btd.shape
    n, k = b * t, e_btk.shape[-1]
    e_nk, w_nk = e_btk.reshape(n, k), w_btk.reshape(n, k)
    if ep == 1:
        return dropless_local(x_btd.reshape(n, d), e_nk, w_nk, wg, wu, wd).reshape(b, t, d)
    n_local = wg.shape[0]
    a = n * k
    xs, es, order, inv, counts = _sort_assignments(x_btd, e_nk, n_local * ep)  # (a, d) by global expert
    dest = es // n_local
    per_dest = counts.reshape(ep, n_local).sum(1)
    start = jnp.cumsum(per_dest) - per_dest
    pos = jnp.arange(a) - start[dest]                                  # position within its destination
    send = jnp.zeros((ep, a, d), xs.dtype).at[dest, pos].set(xs)
    recv = tx.send(send) if tx is not None else jax.lax.all_to_all(send, expert_axes, 0, 0, tiled=True)  # (ep, a, d)
    counts_il = _received_counts(counts, expert_axes, ep, n_local)
    ridx, rinv, sizes = expert_order(counts_il, jnp.arange(ep, dtype=jnp.int32) * a, ep * a)
    ys = _grouped_swiglu(permute_rows(recv.reshape(ep * a, d), ridx, rinv), sizes, wg, wu, wd)
    ys = jnp.where((jnp.arange(ep * a) < jnp.sum(sizes))[:, None], ys, 0)
    y_recv = permute_rows(ys, rinv, ridx).reshape(ep, a, d)
    back = tx.back(y_recv) if tx is not None else jax.lax.all_to_all(y_recv, expert_axes, 0, 0, tiled=True)
    y_sorted = back[dest, pos]                                         # (a, d), or (a, d/t) under PCC
    y = _unsort_combine(y_sorted, order, inv, w_nk).reshape(b, t, -1).astype(x_btd.dtype)
    return tx.finish(y) if tx is not None else y


def _sort_assignments(x_btd, e_nk, n_experts: int):
    n, k = e_nk.shape
    flat_e = e_nk.reshape(-1)
    return _sorted_rows(x_btd.reshape(n, -1), flat_e, jnp.argsort(flat_e, stable=True), k, n_experts)


def _received_counts(counts_e, expert_axes, ep: int, n_local: int):
    """``(ep, n_local)``: how many rows each source sends this device for each of its local experts."""
    every = jax.lax.all_gather(counts_e, expert_axes, tiled=False).reshape(ep, ep, n_local)
    return every[:, jax.lax.axis_index(expert_axes), :]


def _ragged_kernel(x_btd, e_btk, s_btk, k_btk, w_btk, wg, wu, wd, *, capacity, expert_axes, ep):
    """Dropless with ``ragged_all_to_all`` (GPU/TPU): only existing rows travel."""
    b, t, d = x_btd.shape
    n, k = b * t, e_btk.shape[-1]
    n_local = wg.shape[0]
    a = n * k
    w_nk = w_btk.reshape(n, k)
    xs, _, order, inv, counts = _sort_assignments(x_btd, e_btk.reshape(n, k), n_local * ep)
    send_sizes = counts.reshape(ep, n_local).sum(1).astype(jnp.int32)
    in_offsets = _exclusive_cumsum(send_sizes).astype(jnp.int32)
    counts_il = _received_counts(counts, expert_axes, ep, n_local)
    # sizes[i, j]: rows device i sends device j (every device needs the whole matrix for offsets)
    sizes = jax.lax.all_gather(send_sizes, expert_axes, tiled=False).reshape(ep, ep)
    me = jax.lax.axis_index(expert_axes)
    out_offsets = _exclusive_cumsum(sizes, 0)[me].astype(jnp.int32)  # where my rows land at each j
    recv_sizes = sizes[:, me].astype(jnp.int32)
    recv_offsets = _exclusive_cumsum(recv_sizes).astype(jnp.int32)
    # A ragged_all_to_all result takes its buffer's type: make it vary as the rows sent do.
    recv = jax.lax.ragged_all_to_all(xs, match_varying(jnp.zeros((ep * a, d), xs.dtype), varying_axes(xs)), in_offsets,
                                     send_sizes, out_offsets, recv_sizes, axis_name=expert_axes)
    ridx, rinv, gsizes = expert_order(counts_il, recv_offsets, ep * a)
    ys = _grouped_swiglu(permute_rows(recv, ridx, rinv), gsizes, wg, wu, wd)
    ys = jnp.where((jnp.arange(ep * a) < jnp.sum(gsizes))[:, None], ys, 0)
    y_recv = permute_rows(ys, rinv, ridx)
    # Back: what I received from source i (at recv_offsets[i]) returns to i at its in_offsets[me].
    back_offsets = _exclusive_cumsum(sizes, 1)[:, me].astype(jnp.int32)
    y_sorted = jax.lax.ragged_all_to_all(y_recv, match_varying(jnp.zeros((a, d), ys.dtype), varying_axes(y_recv)), recv_offsets,
                                         recv_sizes, back_offsets, send_sizes, axis_name=expert_axes)
    return _unsort_combine(y_sorted, order, inv, w_nk).reshape(b, t, d).astype(x_btd.dtype)
