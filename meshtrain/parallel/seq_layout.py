"""How a context-parallel attention kind lays the sequence over the mesh (:class:`ContextLayout`,
:func:`context_layout`): a pure function of the kind, the activation rules and the mesh sizes, shared by the
kernels (:mod:`meshtrain.parallel.context`) and the step resolver (:mod:`meshtrain.parallel.resolved`), which
reads it to say which kernel every layer runs. Example::

    layout = context_layout(AttentionKind.RING, rules, {"context": 4})   # layout.ring == 4, zig-zag
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import jax.numpy as jnp
import numpy as np

from meshtrain.errors import ConfigError
from meshtrain.recipes import AttentionKind
from meshtrain.strategies import LoadBalance

#: The inner context axis that ``usp`` runs Ulysses over (``ring`` runs over the others).
ULYSSES_AXIS = "ulysses"
#: Kinds that shard the sequence through their own kernel.
CONTEXT_KINDS = (AttentionKind.ALL_GATHER, AttentionKind.RING, AttentionKind.ULYSSES, AttentionKind.USP)


@dataclasses.dataclass(frozen=True)
class ContextLayout:
    """How one attention kind lays the sequence over the mesh.

    ``ring_axes`` / ``ring``: the axes (and their total size) K/V travel around (ring, usp) or are
    gathered over (all_gather); ``ulysses_axes`` / ``ulysses``: the all-to-all axes; ``zigzag``:
    whether the sequence is in zig-zag order over the ring.
    """

    kind: AttentionKind
    seq_axes: Tuple[str, ...] = ()
    ring_axes: Tuple[str, ...] = ()
    ring: int = 1
    ulysses_axes: Tuple[str, ...] = ()
    ulysses: int = 1
    zigzag: bool = False

    @property
    def sharded(self) -> bool:
        return bool(self.seq_axes)

    @property
    def reorders(self) -> bool:
        """Whether the sequence is out of natural order (zig-zag over a ring of more than one)."""
        return self.sharded and self.zigzag and self.ring > 1

    def check_length(self, seq_len: int, sizes: Optional[dict] = None) -> None:
        """A ``ConfigError`` unless ``seq_len`` splits over the layout: a multiple of :meth:`multiple`. It
        names the length, the context axes (with their sizes from ``sizes``, the mesh's) and the nearest
        lengths that work."""
        ways, multiple = self.ring * self.ulysses, self.multiple()
        if seq_len % multiple == 0:
            return
        axes = "×".join(f"{a}={sizes[a]}" if sizes and a in sizes else a for a in self.seq_axes)
        below = seq_len // multiple * multiple
        near = f"{below} or {below + multiple}" if below else f"{multiple}"
        if multiple != ways:
            raise ConfigError(
                f"sequence length {seq_len} is not divisible by 2 × context ways = {multiple} ({self.kind.value} "
                f"with zig-zag load balancing over {axes} cuts the sequence into 2 × {self.ring} ring chunks, each "
                f"split {self.ulysses} ways): use --seq-len a multiple of {multiple} (e.g. {near}), or smaller "
                f"context axes")
        raise ConfigError(f"sequence length {seq_len} is not divisible by the context axes {axes} = {ways}: use "
                          f"--seq-len a multiple of {ways} (e.g. {near}), or smaller context axes")

    def multiple(self) -> int:
        """What every sequence length must be a multiple of: the context ways, twice under zig-zag."""
        ways = self.ring * self.ulysses
        return 2 * ways if self.zigzag else ways

    def permutation(self, seq_len: int) -> np.ndarray:
        """``perm[j]``: the original position of the token at layout position ``j`` (identity
        unless zig-zag). Reorder data with ``x[:, perm]``; undo with ``y[:, np.argsort(perm)]``."""
        self.check_length(seq_len)
        if not self.zigzag:
            return np.arange(seq_len)
        return np.concatenate([ring_chunk_index(r, seq_len // self.ring, self.ring, True) for r in range(self.ring)])


def ring_chunk_index(r, t_loc: int, ring: int, zigzag: bool):
    """Original positions of the ``t_loc`` rows that ring member ``r`` holds (numpy for an int ``r``,
    jnp for a traced one)."""
    xp = np if isinstance(r, (int, np.integer)) else jnp
    if not zigzag:
        return r * t_loc + xp.arange(t_loc, dtype=np.int32)
    c = t_loc // 2
    return xp.concatenate([r * c + xp.arange(c, dtype=np.int32), (2 * ring - 1 - r) * c + xp.arange(c, dtype=np.int32)])


def context_layout(kind: AttentionKind, rules, mesh_sizes, load_balance=LoadBalance.ZIGZAG) -> ContextLayout:
    """The layout of ``kind`` under activation ``rules`` on a mesh of ``mesh_sizes``: the sequence's
    mesh axes are those the ``seq`` activation rule names (size > 1)."""
    kind = AttentionKind(kind)
    if kind not in CONTEXT_KINDS:
        return ContextLayout(kind)
    rule = rules.table("activations").get("seq")
    seq_axes = tuple(a for a in (rule.mesh_axes if rule else ()) if mesh_sizes.get(a, 1) > 1)
    if not seq_axes:
        return ContextLayout(kind)
    size = lambda axes: math.prod(mesh_sizes[a] for a in axes)  # noqa: E731
    zig = LoadBalance(load_balance or LoadBalance.ZIGZAG) is LoadBalance.ZIGZAG
    if kind is AttentionKind.ULYSSES:
        return ContextLayout(kind, seq_axes, ulysses_axes=seq_axes, ulysses=size(seq_axes))
    if kind is AttentionKind.USP:
        ring_axes = tuple(a for a in seq_axes if a != ULYSSES_AXIS)
        if ULYSSES_AXIS not in seq_axes:  # one of the two axes has size 1: the other kind alone
            return ContextLayout(AttentionKind.RING, seq_axes, seq_axes, size(seq_axes), zigzag=zig)
        if not ring_axes:
            return ContextLayout(AttentionKind.ULYSSES, seq_axes, ulysses_axes=seq_axes, ulysses=size(seq_axes))
        if seq_axes[-1] != ULYSSES_AXIS:
            raise ConfigError(f"attention 'usp' needs {ULYSSES_AXIS!r} as the innermost sequence axis; got {seq_axes}")
        return ContextLayout(kind, seq_axes, ring_axes, size(ring_axes), (ULYSSES_AXIS,), mesh_sizes[ULYSSES_AXIS],
                             zig)
    return ContextLayout(kind, seq_axes, seq_axes, size(seq_axes), zigzag=zig)
