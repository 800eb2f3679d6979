"""Names of mesh axes and logical axes, in one place.

Mesh axes are ordered outermost (slowest links) to innermost (fastest links); a mesh built by
meshtrain always lists its axes in this order, so the innermost axis (``tensor``) lands on the
fastest interconnect.

Logical axes are what models speak. Parameters and activations use the same vocabulary but are
mapped by separate rule tables (an ``embed`` weight dimension is FSDP-sharded, an ``embed``
activation dimension is not), see :class:`meshtrain.AxisRules`.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

from meshtrain.errors import RulesError

#: Canonical mesh axes, outermost to innermost.
#: ``ulysses`` is the inner context axis of 2-D context parallelism (``usp``): its all-to-alls move
#: every attention input and output, so it sits inside ``context`` (whose ring ``ppermute`` overlaps
#: with compute and tolerates slower links) and outside ``tensor`` (per-layer all-reduces).
MESH_AXES: Tuple[str, ...] = ("stage", "data", "fsdp", "expert", "context", "ulysses", "tensor")

#: Logical axes used by meshtrain's reference models, with what they mean.
LOGICAL_AXES = {
    "batch": "examples in a batch (activations and data)",
    "seq": "sequence positions inside attention / MLP blocks",
    "residual_seq": "sequence positions in the residual stream (sharded by sequence parallelism)",
    "embed": "model width d_model",
    "heads": "query heads",
    "kv_heads": "key/value heads (grouped-query attention)",
    "head_dim": "per-head width",
    "mlp": "MLP hidden width",
    "vocab": "vocabulary",
    "expert": "mixture-of-experts experts",
    "layers": "stacked (scanned) layers",
    "stage": "pipeline stages",
}



def register_logical_axis(name: str, meaning: str) -> None:
    """Add a logical name of your model's (e.g. ``"classes"``) so recipe ``rules:`` may map it.

    Example: ``register_logical_axis("patches", "image patches")`` then, in a recipe YAML,
    ``rules: {activations: {patches: context}}``. Names already known are left as they are."""
    if not isinstance(name, str) or not name.isidentifier():
        raise RulesError(f"logical axis name {name!r}: use an identifier such as 'classes'")
    LOGICAL_AXES.setdefault(name, meaning)


#: A logical axis per tensor dimension; ``None`` means "never shard this dimension".
LogicalAxes = Tuple[Optional[str], ...]
#: What a logical axis maps to: nothing, one mesh axis, or several (outer to inner).
MeshAxes = Union[None, str, Sequence[str]]


def as_mesh_axes(value: MeshAxes) -> Tuple[str, ...]:
    """Normalise a rule target (``None`` / ``"fsdp"`` / ``["data", "fsdp"]``) to a tuple."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)
