"""`AxisRules`: the ordered logical → mesh axis mapping, and the one function that turns logical
axes into a `PartitionSpec` (:meth:`AxisRules.resolve`).

There are three tables because the same logical name means different things in different places:

* ``params``: weights (``embed -> fsdp`` under FSDP),
* ``activations``: activations and the batch (``batch -> (data, fsdp)``, ``embed -> None``),
* ``optimizer``: optimizer-state overrides; names it does not list fall back to ``params``
  (ZeRO-1 sets ``embed -> data`` here while the weights stay whole).

Example::

    rules = AxisRules.of(params={"embed": "fsdp"}, activations={"batch": ("data", "fsdp")})
    rules.resolve("params", ("vocab", "embed"), (256, 64), {"data": 2, "fsdp": 4}, path="embedder")
    # -> Resolved(spec=PartitionSpec(None, 'fsdp'), ...)
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from typing import TYPE_CHECKING, Dict, FrozenSet, Iterable, Mapping, Optional, Sequence, Tuple

from meshtrain.axes import LOGICAL_AXES, MESH_AXES, LogicalAxes, MeshAxes, as_mesh_axes
from meshtrain.errors import RulesError

if TYPE_CHECKING:
    from jax.sharding import PartitionSpec

TABLES = ("params", "activations", "optimizer")


class IndivisibleError(RulesError):
    """A dimension that does not divide its mesh axes: :meth:`AxisRules.resolve` raises it naming the tensor;
    :func:`meshtrain.make_plan` gathers them to name every offending logical name at once
    (:func:`indivisible_error`)."""

    def __init__(self, message: str, *, name: str = "", size: int = 0, split: str = "", path: str = ""):
        super().__init__(message)
        self.name, self.size, self.split, self.path = name, size, split, path


def indivisible_error(found: Sequence[IndivisibleError]) -> RulesError:
    """One error for every dimension that does not divide its mesh axes (``found``: one per tensor): the
    first's own message when one logical name is at fault, else each name with its size, mesh axes and tensors,
    and the one flag that keeps them all whole."""
    if len({e.name for e in found}) == 1:
        return found[0]
    by_name: Dict[str, list] = {}
    for e in found:
        by_name.setdefault(e.name, []).append(e)
    parts = []
    for name, errors in by_name.items():
        paths = list(dict.fromkeys(e.path for e in errors))
        more = f" and {len(paths) - 2} more" if len(paths) > 2 else ""
        parts.append(f"{name!r} (size {errors[0].size} by {errors[0].split}; {', '.join(paths[:2])}{more})")
    names = list(by_name)
    return RulesError(f"{len(names)} logical names have dimensions not divisible by their mesh axes: "
                      f"{'; '.join(parts)}. Change the mesh sizes, map them to other axes, or keep them whole on "
                      f"every device: --replicate-indivisible {','.join(names)} (in a recipe file "
                      f"replicate_indivisible: [{', '.join(names)}])")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One mapping: ``logical`` → ``mesh_axes`` (outer to inner), contributed by ``source``."""

    logical: str
    mesh_axes: Tuple[str, ...]
    source: str = "user"

    def describe(self) -> str:
        target = "+".join(self.mesh_axes) if self.mesh_axes else "replicated"
        return f"{self.logical}→{target} [{self.source}]"


@dataclasses.dataclass(frozen=True)
class Resolved:
    """The result of mapping one tensor: its spec, the rules used, dims replicated by opt-in."""

    spec: PartitionSpec
    rules: Tuple[str, ...]
    replicated_dims: Tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        return "; ".join(self.rules) if self.rules else "replicated (no rule shards these axes)"


def _table(entries: Mapping[str, MeshAxes] | Iterable[Rule], source: str, kind: str) -> Tuple[Rule, ...]:
    if isinstance(entries, Mapping):
        return tuple(Rule(k, _mesh_axes(kind, k, v), source) for k, v in entries.items())
    return tuple(entries)


def _mesh_axes(kind: str, logical: str, value) -> Tuple[str, ...]:
    """A rule's target as a tuple of known mesh axes; anything else raises naming ``rules.<kind>.<logical>``."""
    if value is None:
        return ()
    axes = (value,) if isinstance(value, str) else value
    if not isinstance(axes, (list, tuple)) or not all(isinstance(a, str) for a in axes):
        raise RulesError(f"rules.{kind}.{logical}: {value!r} is not a mesh axis name; give a mesh axis name, a "
                         f"list of them (outer to inner) or null to replicate; mesh axes: {', '.join(MESH_AXES)}")
    for axis in axes:
        if axis not in MESH_AXES:
            close = difflib.get_close_matches(axis, MESH_AXES, n=1)
            raise RulesError(f"rules.{kind}.{logical} names mesh axis {axis!r}"
                             + (f" (did you mean {close[0]!r}?)" if close else "")
                             + f"; mesh axes: {', '.join(MESH_AXES)}")
    return tuple(axes)


def _describe_tensor(what: str, path: str, shape, logical) -> str:
    return f"{what} {path!r} (shape {tuple(shape)}, logical axes {tuple(logical)})"


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Ordered logical → mesh tables for params, activations and optimizer-state overrides.

    Build one with :meth:`of` (dicts) or get it from a recipe (``recipe.axis_rules()``); pass it to
    :func:`meshtrain.make_plan`. A logical name may appear once per table: :meth:`merged` raises
    when two sources map the same name to different mesh axes.
    """

    params: Tuple[Rule, ...] = ()
    activations: Tuple[Rule, ...] = ()
    optimizer: Tuple[Rule, ...] = ()

    @classmethod
    def of(cls, params=None, activations=None, optimizer=None, source: str = "user") -> "AxisRules":
        return cls(_table(params or {}, source, "params"), _table(activations or {}, source, "activations"),
                   _table(optimizer or {}, source, "optimizer"))

    @classmethod
    def defaults(cls) -> "AxisRules":
        """Every standard logical name mapped to ``None`` (replicated): strategies override these."""
        return _defaults(cls, tuple(LOGICAL_AXES))

    def table(self, kind: str) -> Dict[str, Rule]:
        return self._table(kind)

    def _table(self, kind: str) -> Dict[str, Rule]:
        """``{logical name: rule}`` of table ``kind`` (``optimizer``: over ``params``), a new dict per call."""
        if kind not in TABLES:
            raise RulesError(f"unknown rules table {kind!r}; use one of {TABLES}")
        table = {r.logical: r for r in getattr(self, kind)}
        return {**self._table("params"), **table} if kind == "optimizer" else table

    def overridden_by(self, other: "AxisRules") -> "AxisRules":
        """A copy where every rule of ``other`` replaces this one's rule for the same name (a
        recipe's own ``rules:`` section overriding its strategies)."""
        out = {}
        for kind in TABLES:
            mine = {r.logical: r for r in getattr(self, kind)}
            mine.update({r.logical: r for r in getattr(other, kind)})
            out[kind] = tuple(mine.values())
        return AxisRules(**out)

    def merged(self, other: "AxisRules") -> "AxisRules":
        """Combine two rule sets. A name mapped by both (other than by the defaults) must agree.

        Strategies that shard the same logical name over different mesh axes compose by
        concatenation in canonical mesh order (``batch``: dp's ``data`` + fsdp's ``fsdp`` →
        ``(data, fsdp)``); that is decided in :mod:`meshtrain.recipes`, not here.
        """
        out = {}
        for kind in TABLES:
            mine = {r.logical: r for r in getattr(self, kind)}
            for rule in getattr(other, kind):
                old = mine.get(rule.logical)
                if old is not None and old.source != "default" and old.mesh_axes != rule.mesh_axes:
                    raise RulesError(
                        f"{kind} rule for logical axis {rule.logical!r} given twice: {old.describe()} and "
                        f"{rule.describe()}; keep one of them")
                mine[rule.logical] = rule
            out[kind] = tuple(mine.values())
        return AxisRules(**out)

    def resolve(self, kind: str, logical: LogicalAxes, shape: Sequence[int], mesh_sizes: Mapping[str, int],
                *, path: str, replicate_ok: FrozenSet[str] = frozenset()) -> Resolved:
        """Map one tensor's logical axes to a ``PartitionSpec`` on a mesh of ``mesh_sizes``.

        Raises ``RulesError`` naming the tensor (path, shape, logical axes) when a name is not in the
        rules, a mesh axis would be used twice, or a dimension is not divisible by its mesh axes
        (unless its logical name is in ``replicate_ok``: then that dimension is replicated and the
        fact is reported in ``Resolved.replicated_dims``). Mesh axes of size 1 are left out.
        """
        what = "activation" if kind == "activations" else ("optimizer state" if kind == "optimizer" else "parameter")
        logical = tuple(logical)
        if len(logical) != len(shape):
            raise RulesError(f"{_describe_tensor(what, path, shape, logical)}: rank {len(shape)} but "
                             f"{len(logical)} logical axes; give one logical name (or None) per dimension")
        table = self._table(kind)
        used: Dict[str, str] = {}
        entries, reasons, replicated = [], [], []
        for dim, (name, size) in enumerate(zip(logical, shape)):
            if name is None:
                entries.append(None)
                continue
            rule = table.get(name)
            if rule is None:
                raise RulesError(
                    f"{_describe_tensor(what, path, shape, logical)} uses logical axis {name!r}, which the "
                    f"{kind} rules do not map; add it to the recipe's rules.{kind} (e.g. `{name}: null` "
                    f"to replicate or `{name}: fsdp` to shard)")
            axes = []
            for axis in rule.mesh_axes:
                if axis not in mesh_sizes:
                    raise RulesError(
                        f"{_describe_tensor(what, path, shape, logical)}: rule {rule.describe()} names mesh "
                        f"axis {axis!r}, which the mesh {dict(mesh_sizes)} does not have")
                if axis in used:
                    raise RulesError(
                        f"{_describe_tensor(what, path, shape, logical)}: mesh axis {axis!r} is used by both "
                        f"{used[axis]!r} and {name!r}; map one of them elsewhere in rules.{kind}")
                used[axis] = name
                if mesh_sizes[axis] > 1:
                    axes.append(axis)
            ways = math.prod(mesh_sizes[a] for a in axes)
            if ways > 1 and size % ways:
                split = " × ".join(f"{a}={mesh_sizes[a]}" for a in axes)
                if name in replicate_ok:
                    replicated.append(f"{name} (dim {dim}, size {size}) not divisible by {split}: replicated")
                    entries.append(None)
                    continue
                raise IndivisibleError(
                    f"{_describe_tensor(what, path, shape, logical)}: dimension {dim} ({name!r}, size {size}) "
                    f"is not divisible by mesh axes {split} = {ways}; change the mesh sizes, map {name!r} to "
                    f"other axes, or keep it whole on every device (--replicate-indivisible {name}; in a recipe "
                    f"file replicate_indivisible: [{name}])", name=name, size=size, split=split, path=path)
            if axes:
                reasons.append(Rule(name, tuple(axes), rule.source).describe())
            entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
        while entries and entries[-1] is None:
            entries.pop()
        return Resolved(_partition_spec(entries), tuple(reasons), tuple(replicated))

    def to_dict(self) -> Dict[str, Dict[str, Optional[list]]]:
        return {kind: {r.logical: list(r.mesh_axes) or None for r in getattr(self, kind)} for kind in TABLES}


def _partition_spec(entries: Sequence) -> PartitionSpec:
    from jax.sharding import PartitionSpec  # on use: recipes and the run configuration load without JAX

    return PartitionSpec(*entries)


def shard_shape(shape: Sequence[int], spec: PartitionSpec, mesh_sizes: Mapping[str, int]) -> Tuple[int, ...]:
    """The per-device block shape of a tensor of ``shape`` laid out by ``spec``."""
    out = list(shape)
    for dim, entry in enumerate(spec):
        for axis in as_mesh_axes(entry):
            out[dim] //= mesh_sizes[axis]
    return tuple(out)


@functools.lru_cache(maxsize=4)
def _defaults(cls, names: Tuple[str, ...]) -> "AxisRules":
    """:meth:`AxisRules.defaults` for the logical names known (``register_logical_axis`` adds one: a new
    key); immutable, so shared: a planner search composes rules on top of it ~10^4 times."""
    base = {name: None for name in names}
    return cls.of(params=base, activations=base, source="default")
