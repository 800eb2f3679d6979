"""`ShardingPlan`: the resolved, immutable layout of one model + optimizer + recipe + mesh.

It is the only place where logical names become ``NamedSharding``s for state and batch::

    plan = make_plan(abstract, get_recipe("fsdp"), batch=BatchSpec(16, 128))
    print(plan.describe())            # table: path, shape, logical axes, spec, bytes/device, rule
    plan.to_json()                    # machine-readable; diff two plans with `diff`
    plan.param_shardings              # pytree for jit in/out_shardings

Next: :func:`meshtrain.init_state` (sharded init) and :func:`meshtrain.make_train_step`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.units import BYTE_UNITS, fmt_bytes  # noqa: F401 (re-exported: the one byte formatter)
from meshtrain.abstract import AbstractState, listed, path_str
from meshtrain.batch_layout import BATCH_AXIS, BatchLayout, BatchSpec, as_batch_layout  # noqa: F401 (re-export)
from meshtrain.errors import ConfigError, PlanError, RulesError
from meshtrain.offload import offload_optimizer, to_host
from meshtrain.parallel.heads import HEAD_NAMES, heads_report
from meshtrain.recipes import Offload, Recipe, get_recipe
from meshtrain.rules import AxisRules, IndivisibleError, indivisible_error, shard_shape
from meshtrain.strategies import Pipeline

GROUPS = ("params", "optimizer", "batch", "model_state")
#: The replication guard does not count replicated tensors smaller than this (bytes, whole tensor).
REPLICATION_FLOOR_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """One leaf's layout. ``rule`` says which logical → mesh rules produced ``spec``."""

    group: str
    path: str
    shape: Tuple[int, ...]
    dtype: str
    logical_axes: Tuple[Optional[str], ...]
    spec: PartitionSpec
    bytes_total: int
    bytes_per_device: int
    rule: str
    replicated_dims: Tuple[str, ...] = ()

    @property
    def is_replicated(self) -> bool:
        return all(e is None for e in self.spec)

    def to_dict(self) -> Dict[str, Any]:
        return {"path": self.path, "shape": list(self.shape), "dtype": self.dtype,
                "logical_axes": list(self.logical_axes), "spec": _spec_json(self.spec),
                "bytes_per_device": self.bytes_per_device, "bytes_total": self.bytes_total, "rule": self.rule,
                **({"replicated_dims": list(self.replicated_dims)} if self.replicated_dims else {})}


def _spec_json(spec: PartitionSpec) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def _nbytes(shape, dtype) -> int:
    """Bytes of an array of ``shape`` and ``dtype``; a PRNG key counts its key data (threefry: 2 × uint32)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
        return int(math.prod(shape)) * int(math.prod(data.shape)) * np.dtype(data.dtype).itemsize
    return int(math.prod(shape)) * np.dtype(dtype).itemsize


#: The names of the dtypes parameters usually have: a constant table (not a memo), read for every
#: leaf of every plan, which saves the PRNG-key test on the common dtypes.
_DTYPE_NAMES = {jnp.dtype(name): name for name in ("float32", "bfloat16", "float16", "float64", "int32", "int64",
                                                     "uint32", "int8", "uint8", "bool")}


def _dtype_name(dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except (KeyError, TypeError):
        return str(dtype) if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else str(np.dtype(dtype))


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Shardings for every leaf of params, optimizer state and batch, with bytes and reasons.

    Attributes:
      mesh: the ``Mesh`` (or ``AbstractMesh`` when planning for more devices than exist).
      recipe, rules: what produced it.
      leaves: one :class:`LeafPlan` per leaf, grouped as ``params`` / ``optimizer`` / ``batch`` /
        ``model_state`` (non-parameter variables: batch statistics, RNG keys and counters).
      param_shardings, opt_shardings, batch_shardings, model_state_shardings: pytrees of
        ``NamedSharding`` mirroring the state and the batch, ready for ``jit`` (every leaf has a
        mesh sharding, scalars too).
      batch: the :class:`BatchLayout` the step takes (``None`` when planned without a batch).
    """

    mesh: Any
    recipe: Recipe
    rules: AxisRules
    leaves: Tuple[LeafPlan, ...]
    param_shardings: Any
    opt_shardings: Any
    batch_shardings: Any
    model_state_shardings: Any
    abstract: AbstractState
    batch: Optional[BatchLayout]

    # -- numbers ----------------------------------------------------------------------------
    # The plan is immutable: its own indexes (sizes, groups, bytes per group) are computed once
    # (functools.cached_property). Figures the planner derives from a plan live in the planner's memo
    # (meshtrain.analysis.layout.cached), not here.
    @functools.cached_property
    def _sizes(self) -> Dict[str, int]:
        return dict(self.mesh.shape)

    @property
    def mesh_sizes(self) -> Dict[str, int]:
        return dict(self._sizes)

    @property
    def num_devices(self) -> int:
        return int(math.prod(self.mesh_sizes.values()))

    @property
    def data_parallel_size(self) -> int:
        """How many ways the batch dimension is split (product of the mesh axes ``batch`` maps to)."""
        return data_parallel_size(self.rules, self.mesh_sizes)

    @functools.cached_property
    def _groups(self) -> Dict[str, Tuple[LeafPlan, ...]]:
        groups: Dict[str, List[LeafPlan]] = {}
        for leaf in self.leaves:
            groups.setdefault(leaf.group, []).append(leaf)
        return {g: tuple(ls) for g, ls in groups.items()}

    def group(self, name: str) -> List[LeafPlan]:
        return list(self._groups.get(name, ()))

    def per_device_bytes(self) -> Dict[str, int]:
        """Bytes each device holds: ``params``, ``optimizer``, ``batch``, ``model_state`` (only when
        the model has non-parameter variables), ``base`` (LoRA's frozen weights, not in ``model_state``;
        ``params`` are then the adapters) and ``total`` (the state: all but ``batch``). With
        ``offload="optimizer"`` the optimizer state's bytes move to ``optimizer_host`` (each device's
        share of host memory) and ``optimizer`` is 0."""
        sums = self._group_bytes
        groups = ("params", "optimizer", "batch") + (("model_state",) if self.group("model_state") else ())
        out = {g: sums.get(g, 0) for g in groups}
        frozen = getattr(self.abstract, "frozen_paths", None)
        if frozen:  # LoRA: the frozen base is model state; params and optimizer are the adapters'
            out["base"] = sum(l.bytes_per_device for l in self.group("model_state") if l.path in frozen)
            out["model_state"] -= out["base"]
        if self.recipe.offload is Offload.OPTIMIZER:  # in host memory: off the device's books
            out["optimizer_host"], out["optimizer"] = out["optimizer"], 0
        out["total"] = out["params"] + out["optimizer"] + out.get("model_state", 0) + out.get("base", 0)
        return out

    @functools.cached_property
    def _group_bytes(self) -> Dict[str, int]:
        """Σ bytes per device of each group's leaves."""
        out: Dict[str, int] = {}
        for leaf in self.leaves:
            out[leaf.group] = out.get(leaf.group, 0) + leaf.bytes_per_device
        return out

    def check_batch(self, batch) -> None:
        """Raise ``ConfigError`` naming the leaf when ``batch`` differs from the planned layout in
        structure, shape or dtype (the step calls this; cached per distinct shape signature)."""
        if self.batch is None:
            raise ConfigError("this plan has no batch layout; pass batch=BatchSpec(B, T), a BatchLayout or an "
                              "example batch to make_plan")
        self.batch.check(batch)

    def replicated(self, group: str = "params") -> List[LeafPlan]:
        """Leaves of ``group`` that no mesh axis shards, largest first."""
        return sorted((l for l in self.group(group) if l.is_replicated), key=lambda l: -l.bytes_total)

    # -- output -----------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return {
            "recipe": self.recipe.name,
            "recipe_settings": self.recipe.to_dict(),  # every knob and dimension option, as a recipe file
            "mesh": self.mesh_sizes,
            "rules": self.rules.to_dict(),
            "params": [l.to_dict() for l in self.group("params")],
            "optimizer": [l.to_dict() for l in self.group("optimizer")],
            "batch": [l.to_dict() for l in self.group("batch")],
            **({"model_state": [l.to_dict() for l in self.group("model_state")]} if self.group("model_state")
               else {}),
            "per_device_bytes": self.per_device_bytes(),
            "num_params": self.abstract.num_params,
            "replicated_params": [l.path for l in self.replicated("params")],
            **({"heads": self.heads} if self.heads else {}),
        }

    @functools.cached_property
    def heads(self) -> Optional[Dict[str, Any]]:
        """Attention heads that do not divide ``tensor``: what the step does with them (padded, replicated) and
        the bytes per device that keeping their weights whole costs (:func:`meshtrain.parallel.heads.heads_report`);
        ``None`` when they divide."""
        return heads_report(self)

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def describe(self, groups: Sequence[str] = ("params", "model_state", "batch"),
                 max_rows: Optional[int] = None) -> str:
        """A readable table: one row per leaf, then bytes per device by group."""
        lines = [f"recipe {self.recipe.name}  mesh " + " × ".join(f"{a}={s}" for a, s in self.mesh_sizes.items())
                 + f"  ({self.num_devices} devices, {self.abstract.num_params:,} parameters)"]
        header = ("group", "path", "shape", "logical axes", "spec", "per device", "rule")
        rows = []
        for g in groups:
            for leaf in self.group(g)[:max_rows]:
                rows.append((g, leaf.path, "×".join(map(str, leaf.shape)) or "()",
                             ",".join(str(a) for a in leaf.logical_axes) or "-",
                             str(tuple(leaf.spec)) if leaf.spec else "replicated",
                             fmt_bytes(leaf.bytes_per_device), leaf.rule
                             + (" | " + "; ".join(leaf.replicated_dims) if leaf.replicated_dims else "")))
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header) - 1)]
        fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]  # noqa: E731
        lines += [fmt(header), fmt(tuple("-" * w for w in widths) + ("-" * 4,))] + [fmt(r) for r in rows]
        if self.heads:
            extra = self.heads["extra_bytes_per_device"]
            lines.append(f"heads: {self.heads['describe']}; weights kept whole on every tensor rank: +"
                         f"{fmt_bytes(extra['params'])} params, +{fmt_bytes(extra['optimizer'])} optimizer state per "
                         f"device (--indivisible-heads pad|replicate|refuse)")
        b = self.per_device_bytes()
        lines.append("per device: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in b.items()))
        return "\n".join(lines)

    def __str__(self) -> str:  # printing a plan shows the table
        return self.describe()


def _resolve_leaf(rules, group, kind, path, shape, dtype, logical, mesh, recipe, memo=None
                  ) -> Tuple[LeafPlan, NamedSharding]:
    """``memo``: a dict for one ``(rules, mesh, recipe)``: leaves of the same kind, logical axes, shape and
    dtype (an optimizer moment and its parameter's other moment) resolve alike, only the path differs."""
    key = None
    if memo is not None:
        try:
            key = (kind, tuple(logical), tuple(shape), dtype)
            hit = memo.get(key)
        except TypeError:  # an unhashable dtype
            key, hit = None, None
        if hit is not None:
            res, dtype_name, total, per_device = hit
            return (LeafPlan(group, path, tuple(shape), dtype_name, tuple(logical), res.spec, total, per_device,
                             res.reason, res.replicated_dims), NamedSharding(mesh, res.spec))
    sizes = memo["__sizes__"] if memo is not None else dict(mesh.shape)
    res = _resolve_gathering(rules, kind, logical, shape, sizes, path, recipe.replicate_ok(),
                             memo.get("__indivisible__") if memo is not None else None)
    leaf = LeafPlan(group, path, tuple(shape), _dtype_name(dtype), tuple(logical), res.spec, _nbytes(shape, dtype),
                    _nbytes(shard_shape(shape, res.spec, sizes), dtype), res.reason, res.replicated_dims)
    if key is not None:
        memo[key] = (res, leaf.dtype, leaf.bytes_total, leaf.bytes_per_device)
    return leaf, NamedSharding(mesh, res.spec)


def _resolve_gathering(rules, kind, logical, shape, sizes, path, replicate_ok, found: Optional[list]):
    """``rules.resolve``; with a ``found`` list, a dimension that does not divide its mesh axes is noted there
    and kept whole, so that the plan can name every such logical name in one error (:func:`indivisible_error`)."""
    while True:
        try:
            return rules.resolve(kind, logical, shape, sizes, path=path, replicate_ok=replicate_ok)
        except IndivisibleError as exc:
            if found is None:
                raise
            found.append(exc)
            replicate_ok = replicate_ok | {exc.name}


def _plan_model_state(rules, mesh, recipe, abstract: AbstractState):
    """Non-parameter variables (batch statistics, RNG keys and counters): sharded by their own
    ``out_sharding`` names through the params rules when they have them, else replicated; either
    way every leaf gets a mesh NamedSharding. Returns ``(leaf plans, shardings tree)``."""
    state_axes = getattr(abstract, "model_state_axes", None) or {}
    leaves: List[LeafPlan] = []
    ms_sh = {}
    replicated = NamedSharding(mesh, PartitionSpec())
    flat_ms, ms_tree = abstract.model_state_structure
    for path, sds in flat_ms:
        logical = state_axes.get(path)
        if logical is None:
            leaves.append(LeafPlan("model_state", path, tuple(sds.shape), _dtype_name(sds.dtype),
                                   (None,) * len(sds.shape), PartitionSpec(), _nbytes(sds.shape, sds.dtype),
                                   _nbytes(sds.shape, sds.dtype), "non-parameter variable: replicated"))
            ms_sh[path] = replicated
            continue
        leaf, sh = _resolve_leaf(rules, "model_state", "params", path, sds.shape, sds.dtype, logical, mesh, recipe)
        leaves.append(leaf)
        ms_sh[path] = sh
    return leaves, _map_paths(ms_tree, ms_sh)


def make_plan(abstract: AbstractState, recipe: "Recipe | str", mesh=None, *,
              batch: "BatchLayout | BatchSpec | Any" = None, check: bool = True) -> ShardingPlan:
    """Resolve every leaf of ``abstract`` (params, optimizer state, model state) and ``batch`` on ``mesh``.

    Args:
      abstract: from :func:`meshtrain.abstract_state`.
      recipe: a :class:`Recipe` or its name / file.
      mesh: a ``Mesh`` (default: ``recipe.mesh.build()`` over all devices) or an ``AbstractMesh``.
      batch: the global batch: a :class:`BatchLayout`, a :class:`BatchSpec` (token batches) or an
        example batch pytree (arrays or ``ShapeDtypeStruct``s; ``batch`` on each leading dimension).
        Each leaf is resolved with the activation rules; its ``batch`` dimension must divide by
        data-parallel size × micro-batches, and under data parallelism a leaf that no mesh axis
        splits is a ``PlanError`` unless the layout allows it (``allow_replicated``).
      check: apply the parameter replication guard (``recipe.max_replicated_fraction``).
    """
    recipe = get_recipe(recipe)
    mesh = recipe.mesh.build() if mesh is None else mesh
    rules = with_model_rules(recipe.axis_rules(), abstract, dict(mesh.shape))
    check_mapped(rules, abstract)
    abstract = abstract.with_param_dtype(recipe.param_dtype)
    leaves: List[LeafPlan] = []
    memo: Dict[Any, Any] = {"__sizes__": dict(mesh.shape), "__indivisible__": []}

    flat_params, param_shape, param_tree = abstract.param_structure
    param_sh: Dict[str, NamedSharding] = {}
    for path, sds in flat_params:
        leaf, sh = _resolve_leaf(rules, "params", "params", path, sds.shape, sds.dtype, abstract.param_axes[path],
                                 mesh, recipe, memo)
        given = abstract.short_axes.get(path)
        if given is not None:  # say why the trailing dimensions stay whole
            leaf = dataclasses.replace(leaf, rule=f"{leaf.rule}; {given} logical names for {len(sds.shape)} "
                                                  f"dimensions: the trailing {len(sds.shape) - given} unsharded")
        leaves.append(leaf)
        param_sh[path] = sh
    param_shardings = _map_paths(param_tree, param_sh)

    opt_shardings = None
    if abstract.opt_state is not None:
        flat_opt, opt_tree = abstract.optimizer_structure
        opt_sh = {}
        for path, sds, logical in flat_opt:
            leaf, sh = _resolve_leaf(rules, "optimizer", "optimizer", path, sds.shape, sds.dtype, logical, mesh,
                                     recipe, memo)
            leaves.append(leaf)
            opt_sh[path] = sh
        opt_shardings = _map_paths(opt_tree, opt_sh)
        if recipe.offload is Offload.OPTIMIZER:  # the same layout, in pinned host memory between steps
            device_opt, opt_shardings = opt_shardings, to_host(opt_shardings)
            abstract = dataclasses.replace(abstract, tx=offload_optimizer(abstract.tx, device_opt, opt_shardings))

    ms_leaves, model_state_shardings = _plan_model_state(rules, mesh, recipe, abstract)
    leaves.extend(ms_leaves)
    if memo["__indivisible__"]:  # every logical name that does not divide, in one error
        raise indivisible_error(memo["__indivisible__"])

    layout = None if batch is None else as_batch_layout(batch)
    batch_shardings = None
    if layout is not None:
        batch_leaves, batch_shardings = _plan_batch(rules, mesh, recipe, layout)
        leaves.extend(batch_leaves)

    plan = ShardingPlan(mesh, recipe, rules, tuple(leaves), param_shardings, opt_shardings, batch_shardings,
                        model_state_shardings, abstract, layout)
    if check:
        _replication_guard(plan)
    return plan


def with_model_rules(rules: AxisRules, abstract: AbstractState, mesh_sizes) -> AxisRules:
    """The recipe's rules with the model rules' ``logical:`` section over its parameter table; mesh axes
    that this mesh lacks are left out (``joined_kv: tensor`` under dp: not split)."""
    logical = getattr(abstract, "logical_rules", ())
    if not logical:
        return rules
    params = {name: [a for a in axes if a in mesh_sizes] or None for name, axes in logical}
    return rules.overridden_by(AxisRules.of(params=params, source="model rules"))


def check_mapped(rules: AxisRules, abstract: AbstractState) -> None:
    """Every logical name on a parameter (or a named model variable) must be mapped: raise naming each
    unmapped name with every parameter that uses it."""
    table = rules.table("params")
    users: Dict[str, List[str]] = {}
    named = list(abstract.param_axes.items()) + list((getattr(abstract, "model_state_axes", None) or {}).items())
    for path, names in named:
        for name in names:
            if name is not None and name not in table:
                users.setdefault(name, []).append(path)
    if users:
        parts = [f"{name!r} (used by {len(paths)}: {listed(paths)})" for name, paths in users.items()]
        example = ", ".join(f"{name}: null" for name in users)
        raise RulesError(f"logical names that no rule maps: {'; '.join(parts)}; map them in the rules' logical: "
                         f"section (--rules FILE.yaml / rules=), e.g. `logical: {{{example}}}` to replicate or "
                         f"`{next(iter(users))}: tensor` to shard")


def _map_paths(paths_tree, values: Dict[str, Any]):
    paths, treedef = paths_tree
    return treedef.unflatten([values[p] for p in paths])


def data_parallel_size(rules: AxisRules, mesh_sizes) -> int:
    """Devices the batch dimension is split over (the mesh axes of the ``batch`` activation rule)."""
    rule = rules.table("activations").get("batch")
    return int(math.prod(mesh_sizes.get(a, 1) for a in (rule.mesh_axes if rule else ())))


def _plan_batch(rules: AxisRules, mesh, recipe: Recipe, layout: BatchLayout):
    """LeafPlans and a pytree of NamedShardings for every batch leaf (activation rules)."""
    sizes = dict(mesh.shape)
    dp = data_parallel_size(rules, sizes)
    pipeline = recipe.dimension(Pipeline)  # the step splits the batch into the pipeline's or accumulation's parts
    micro = pipeline.micro_batches if pipeline is not None else recipe.grad_accum
    plans: Dict[str, NamedSharding] = {}
    out: List[LeafPlan] = []
    for path, bl in layout.leaves_as_given():
        if bl.batch_dim is not None:
            size = bl.shape[bl.batch_dim]
            if size < 1 or size % (dp * micro):
                raise ConfigError(
                    f"batch size {size} is not divisible by data-parallel size {dp} × micro-batches {micro} "
                    f"(mesh {sizes}; batch leaf {path!r}, shape {bl.shape}); use a batch size that is a multiple "
                    f"of {dp * micro}")
        leaf, sh = _resolve_leaf(rules, "batch", "activations", path, bl.shape, bl.dtype, bl.axes, mesh, recipe)
        if dp > 1 and leaf.is_replicated and not layout.allows_replicated(path, bl):
            dp_axes = " × ".join(f"{a}={sizes[a]}" for a in rules.table("activations")[BATCH_AXIS].mesh_axes
                                 if sizes.get(a, 1) > 1)
            suggestion = (BATCH_AXIS,) + (None,) * (len(bl.shape) - 1) if bl.shape else None
            raise PlanError(
                f"batch leaf {path!r} (shape {bl.shape}, logical axes {bl.axes}) would be replicated: all "
                f"{dp} data-parallel devices ({dp_axes}) would hold the whole of it. Give it a {BATCH_AXIS!r} "
                + (f"axis (e.g. BatchLayout.from_example(batch, axes={{{path!r}: {suggestion}}})) "
                   if suggestion else "axis ")
                + f"or, if every device needs all of it, allow it: BatchLayout.from_example(batch, "
                f"allow_replicated=({path!r},))")
        out.append(leaf)
        plans[path] = sh
    return out, layout.map(lambda path, _: plans[path])


def gradient_shardings(plan: ShardingPlan):
    """Where the step keeps the gradients between the backward pass and the optimizer update.

    By default the parameters' shardings (DP all-reduces gradients; FSDP reduce-scatters them
    because the parameters are sharded). When the recipe's strategies set the step option
    ``shard_gradients`` (``zero2``), each gradient takes its parameter's *optimizer-state* sharding
    (the ``optimizer`` rules applied to the parameter's logical axes): the data-parallel reduction
    becomes a reduce-scatter (XLA:CPU emits all-reduce + dynamic-slice instead), each device keeps
    and updates 1/N of every gradient, and the updated parameters are all-gathered back to their
    own (replicated) sharding by the step's output shardings.
    """
    if not plan.recipe.shard_gradients:
        return plan.param_shardings
    sizes = plan.mesh_sizes
    replicate_ok = plan.recipe.replicate_ok()

    def one(keypath, sds):
        path = path_str(keypath)
        res = plan.rules.resolve("optimizer", plan.abstract.param_axes[path], sds.shape, sizes, path=path,
                                 replicate_ok=replicate_ok)
        return NamedSharding(plan.mesh, res.spec)

    return jax.tree_util.tree_map_with_path(one, plan.abstract.params)


def _whole_heads(leaf: LeafPlan) -> bool:
    """Whether ``leaf`` is replicated only because its heads dimension does not divide ``tensor``."""
    return bool(leaf.replicated_dims) and all(d.split(" ", 1)[0] in HEAD_NAMES for d in leaf.replicated_dims)


def _replication_guard(plan: ShardingPlan) -> None:
    """Fail a sharded recipe that leaves too many bytes replicated, naming the largest leaves."""
    sizes = plan.mesh_sizes
    for group, kind in (("params", "params"), ("optimizer", "optimizer")):
        # (grad_replica: onebit's error-feedback residuals per replica, model state; not a parameter layout)
        shards = any(any(sizes.get(a, 1) > 1 for a in r.mesh_axes) for r in plan.rules.table(kind).values()
                     if r.logical != "grad_replica")
        leaves = plan.group(group)
        total = sum(l.bytes_total for l in leaves)
        if not shards or not total:
            continue
        # small tensors (norms, biases, a tiny model's position table) are not what the guard is for, nor
        # head weights that tensor parallelism keeps whole because their count does not divide (plan.heads)
        # LoRA adapters (a ``lora_rank`` axis) are small by design: one kept whole under fsdp is not a bug
        repl = [l for l in plan.replicated(group) if l.bytes_total >= REPLICATION_FLOOR_BYTES
                and not (plan.heads and _whole_heads(l)) and "lora_rank" not in l.logical_axes]
        fraction = sum(l.bytes_total for l in repl) / total
        if fraction > plan.recipe.max_replicated_fraction:
            top = ", ".join(f"{l.path} {l.shape} {l.logical_axes} ({fmt_bytes(l.bytes_total)})" for l in repl[:5])
            if len(repl) > 5:  # the plan's table (meshtrain plan ... --max-replicated-fraction 1) lists them all
                top += (f" and {len(repl) - 5} more (`meshtrain plan` with --max-replicated-fraction 1 "
                        f"lists every leaf)")
            raise PlanError(
                f"recipe {plan.recipe.name!r} shards {group} but leaves {fraction:.1%} of their bytes replicated "
                f"(limit {plan.recipe.max_replicated_fraction:.1%}); largest replicated: {top}. Give these "
                f"parameters logical axes that the recipe shards (--rules FILE.yaml), or raise "
                f"max_replicated_fraction (--max-replicated-fraction; tensors under "
                f"{fmt_bytes(REPLICATION_FLOOR_BYTES)} are not counted)")
