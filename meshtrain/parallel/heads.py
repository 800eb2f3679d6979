"""Attention heads over the ``tensor`` axis when their counts do not divide it (a 135M Llama: 9 query heads,
3 KV heads, ``tensor=2``).

An array cannot be split unevenly across devices, so the weights of such heads stay whole on every tensor
rank (the plan reports the bytes this costs). What the compute does is :class:`HeadLayout`'s decision, made
once per step by :func:`meshtrain.parallel.resolved.resolve_step` from the plan and read by the models:

* KV heads that do not divide ``tensor`` are replicated; when the query heads are split, each KV head is
  repeated for the query heads that use it, so each tensor rank holds the KV heads its query heads need
  (Megatron's and MaxText's layout for ``n_kv_heads < tensor``);
* query heads that do not divide follow the tensor dimension's ``indivisible_heads``: ``pad`` (the default)
  rounds them up to a multiple of ``tensor`` with zero heads, which add nothing to the output and receive no
  gradient (the padding is sliced away), and splits them; ``replicate`` computes every head on every rank.

A model calls :func:`head_layout` with its head counts and pads its weights with it::

    lay = head_layout(n_heads, n_kv_heads)
    q_btnh = jnp.einsum("btd,dnh->btnh", x_btd, lay.pad_heads(wq_dnh, 1, ("embed", "heads", "head_dim")))
    k_btnh = lay.kv_for_queries(k_btkh)   # (b, t, padded heads, h) when KV heads are replicated
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Mapping, Optional

import jax.numpy as jnp

from meshtrain.annotate import constrain, current_step_context
from meshtrain.strategies import IndivisibleHeads, Tensor

HEAD_NAMES = ("heads", "kv_heads")


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """How ``n_heads`` query heads and ``n_kv_heads`` KV heads lie over ``ways`` tensor ranks (the devices
    the ``heads`` activation rule splits over) under ``policy``. Example: ``HeadLayout(9, 3, 2).query`` is
    ``"padded"``, ``.padded_heads`` 10, ``.kv_replicated`` True."""

    n_heads: int
    n_kv_heads: int
    ways: int = 1
    policy: IndivisibleHeads = IndivisibleHeads.PAD

    @property
    def query(self) -> str:
        """``whole`` (no tensor split), ``split`` (divisible), ``padded`` or ``replicated``."""
        if self.ways <= 1:
            return "whole"
        if self.n_heads % self.ways == 0:
            return "split"
        return "padded" if self.policy is IndivisibleHeads.PAD else "replicated"

    @property
    def padded_heads(self) -> int:
        """Query heads the attention computes: ``n_heads`` rounded up to ``ways`` when padded."""
        return -(-self.n_heads // self.ways) * self.ways if self.query == "padded" else self.n_heads

    @property
    def kv_replicated(self) -> bool:
        return self.ways > 1 and self.n_kv_heads % self.ways != 0

    @property
    def expand_kv(self) -> bool:
        """Whether KV heads are repeated per query head (replicated KV heads under split query heads)."""
        return self.kv_replicated and self.query in ("split", "padded")

    @property
    def changed(self) -> bool:
        """Whether anything differs from an even split (what the plan reports)."""
        return self.query in ("padded", "replicated") or self.kv_replicated

    def describe(self) -> str:
        """One line for the plan, e.g. ``"9 query heads padded to 10 (1 zero head) and split over tensor=2 ..."``."""
        if self.query == "padded":
            q = (f"{self.n_heads} query heads padded to {self.padded_heads} ({self.padded_heads - self.n_heads} zero "
                 f"heads: +{(self.padded_heads - self.n_heads) / self.n_heads:.0%} attention compute) and split over "
                 f"tensor={self.ways}: {self.padded_heads // self.ways} per rank")
        elif self.query == "replicated":
            q = f"{self.n_heads} query heads replicated: every one of the {self.ways} tensor ranks computes all of them"
        else:
            q = f"{self.n_heads} query heads split over tensor={self.ways}"
        kv = (f"; {self.n_kv_heads} KV heads replicated over tensor={self.ways}"
              + (" (each rank repeats the KV head of each of its query heads)" if self.expand_kv else "")
              if self.kv_replicated else "")
        return q + kv

    def to_dict(self) -> Dict[str, Any]:
        return {"query_heads": self.n_heads, "kv_heads": self.n_kv_heads, "tensor": self.ways,
                "indivisible_heads": self.policy.value, "query": self.query, "padded_heads": self.padded_heads,
                "kv": "replicated" if self.kv_replicated else "split"}

    # -- what the models call ---------------------------------------------------------------------
    def pad_heads(self, w, axis: int, logical):
        """``w`` with its query-heads dimension ``axis`` padded with zeros to :attr:`padded_heads` and
        constrained to ``logical`` (so the padded heads split over ``tensor``); ``w`` itself when not padded."""
        if self.query != "padded":
            return w
        widths = [(0, 0)] * w.ndim
        widths[axis] = (0, self.padded_heads - self.n_heads)
        return constrain(jnp.pad(w, widths), logical)

    def kv_for_queries(self, x_bskh, names=("batch", "seq", "heads", "head_dim")):
        """Keys or values ``(b, s, n_kv_heads, h)`` as the attention takes them: unchanged, or (replicated KV
        heads under split queries) repeated per query head, zero-padded to :attr:`padded_heads` and split like
        the queries, so each rank keeps the KV heads its query heads use."""
        if not self.expand_kv:
            return x_bskh
        x = jnp.repeat(x_bskh, self.n_heads // self.n_kv_heads, axis=2)
        if self.padded_heads > self.n_heads:
            x = jnp.pad(x, [(0, 0), (0, 0), (0, self.padded_heads - self.n_heads), (0, 0)])
        return constrain(x, names)

    def unpad(self, x, axis: int):
        """``x`` with padded query heads on ``axis`` cut back to ``n_heads`` (e.g. per-head outputs)."""
        return x if self.padded_heads == self.n_heads else jnp.take(x, jnp.arange(self.n_heads), axis=axis)


def resolve_heads(n_heads: int, n_kv_heads: int, rules, mesh_sizes: Mapping[str, int],
                  tensor: Optional[Tensor]) -> HeadLayout:
    """The :class:`HeadLayout` of a model with these head counts under activation ``rules`` on a mesh of
    ``mesh_sizes``, with the recipe's tensor dimension ``tensor`` (``None``: no padding policy, ``pad``'s
    default)."""
    rule = rules.table("activations").get("heads")
    ways = math.prod(mesh_sizes.get(a, 1) for a in (rule.mesh_axes if rule else ()))
    policy = tensor.indivisible_heads if tensor is not None else IndivisibleHeads.PAD
    return HeadLayout(int(n_heads), int(n_kv_heads), int(ways), policy)


def plan_heads(plan, mesh_sizes: Optional[Mapping[str, int]] = None) -> Optional[HeadLayout]:
    """The :class:`HeadLayout` of ``plan``'s model (head counts read from the parameters' ``heads`` /
    ``kv_heads`` dimensions; a model without ``kv_heads`` has as many as query heads), or ``None`` for a model
    without ``heads``. ``mesh_sizes``: another mesh's sizes (the planner's one-device trace)."""
    counts: Dict[str, int] = {}
    for leaf in plan.group("params"):
        for name, size in zip(leaf.logical_axes, leaf.shape):
            if name in HEAD_NAMES:
                counts.setdefault(name, int(size))
    if "heads" not in counts:
        return None
    sizes = plan.mesh_sizes if mesh_sizes is None else dict(mesh_sizes)
    return resolve_heads(counts["heads"], counts.get("kv_heads", counts["heads"]), plan.rules, sizes,
                         plan.recipe.dimension(Tensor))


def head_layout(n_heads: int, n_kv_heads: Optional[int] = None) -> HeadLayout:
    """The layout the active step chose for a model with these head counts (its resolved step's, or derived from
    a step context built by hand); outside a step: whole heads, nothing padded."""
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    ctx = current_step_context()
    if ctx is None:
        return HeadLayout(n_heads, n_kv_heads)
    chosen = getattr(ctx.resolved, "heads", None)
    if chosen is not None and (chosen.n_heads, chosen.n_kv_heads) == (n_heads, n_kv_heads):
        return chosen
    return resolve_heads(n_heads, n_kv_heads, ctx.rules, dict(ctx.mesh.shape), ctx.dimension(Tensor))


def replication_cost(plan, layout: HeadLayout) -> Dict[str, int]:
    """Bytes per device that keeping head dimensions whole costs over an even split, by group (``params``,
    ``optimizer``): for each leaf whose ``heads`` / ``kv_heads`` dimension the plan left whole, its bytes per
    device × (1 − 1/tensor)."""
    out = {"params": 0, "optimizer": 0}
    for group in out:
        for leaf in plan.group(group):
            if any(d.split(" ", 1)[0] in HEAD_NAMES for d in leaf.replicated_dims):
                out[group] += leaf.bytes_per_device - leaf.bytes_per_device // layout.ways
    return out


def heads_report(plan) -> Optional[Dict[str, Any]]:
    """What ``plan.json`` says about heads that do not divide ``tensor`` (``None`` when they divide): the
    :class:`HeadLayout` and its cost in bytes per device."""
    layout = plan_heads(plan)
    if layout is None or not layout.changed:
        return None
    return {**layout.to_dict(), "describe": layout.describe(),
            "extra_bytes_per_device": replication_cost(plan, layout)}
