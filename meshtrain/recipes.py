"""Recipes: named, user-facing compositions of strategies plus the knobs of a run.

Pick one by name or file, override its mesh, and hand it to the plan / trainer::

    recipe = get_recipe("fsdp_tp").with_mesh(fsdp=4, tensor=2)
    recipe = get_recipe("recipes/fsdp_tp.yaml")            # the same, from a file
    print(recipe.axis_rules().to_dict())

Every built-in recipe also lives in ``recipes/<name>.yaml`` (a test keeps them identical).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import os
from typing import Any, Dict, Mapping, Optional, Tuple

from meshtrain.axes import LOGICAL_AXES
from meshtrain.errors import MeshtrainError, RecipeError
from meshtrain.mesh import AxisTypes, MeshSpec
from meshtrain.rules import TABLES, AxisRules
from meshtrain.strategies import compose, get_strategy, step_options


class Remat(str, enum.Enum):
    """What the backward pass recomputes, per scanned layer.

    * ``none``: save everything (fastest, most memory);
    * ``full``: save only layer inputs, recompute the layer (least memory);
    * ``dots``: save matmul outputs, recompute the cheap element-wise work in between;
    * ``dots_no_batch``: save only matmuls without batch dims (weight matmuls, not attention scores).
    """

    NONE = "none"
    FULL = "full"
    DOTS = "dots"
    DOTS_NO_BATCH = "dots_no_batch"


class AttentionKind(str, enum.Enum):
    """How attention is computed; context-parallel kinds shard the sequence (``parallel/``).

    * ``dense``: materialises the scores (short sequences, reference);
    * ``flash``: memory-efficient, never materialises ``T × T`` (cuDNN / splash / blockwise XLA);
    * ``all_gather``: queries stay sequence-sharded on ``context``, K/V all-gathered;
    * ``ring``: K/V blocks passed around ``context`` with ``ppermute`` (zig-zag load balance);
    * ``ulysses``: all-to-all sequence-sharded ↔ head-sharded over ``context``;
    * ``usp``: Ulysses over ``ulysses`` × ring over ``context``.
    """

    DENSE = "dense"
    FLASH = "flash"
    ALL_GATHER = "all_gather"
    RING = "ring"
    ULYSSES = "ulysses"
    USP = "usp"


class Schedule(str, enum.Enum):
    """Pipeline schedule over the ``stage`` axis (recipes with the ``pp`` strategy;
    :mod:`meshtrain.parallel.pipeline`).

    * ``gpipe``: all micro-batches forward, then all backward; bubble (p-1)/(m+p-1);
    * ``circular``: each stage holds ``repeats`` non-adjacent layer groups; bubble (p-1)/(r·m+p-1);
    * ``1f1b``: after warm-up each stage alternates a forward and a backward (explicit per-stage VJP),
      so only the micro-batches in flight keep activations.
    """

    GPIPE = "gpipe"
    CIRCULAR = "circular"
    ONE_F_ONE_B = "1f1b"


class LayerLoop(str, enum.Enum):
    """How the stack of identical layers runs (:func:`meshtrain.scan_layers`).

    * ``scan``: one ``lax.scan`` (compile time flat in depth; ``scan_unroll`` layers per iteration);
    * ``unrolled``: straight-line code (XLA schedules across layers; compile time grows with depth);
    * ``auto``: unrolled up to :data:`AUTO_UNROLL_LAYERS` layers when no remat policy is on, else
      scanned (remat saves memory only inside a loop).
    """

    AUTO = "auto"
    SCAN = "scan"
    UNROLLED = "unrolled"


#: ``LayerLoop.AUTO`` unrolls stacks of at most this many layers (measured: see BENCHMARKS.md).
AUTO_UNROLL_LAYERS = 8


def resolve_layer_loop(loop: "LayerLoop | str", n_layers: int, remat: "Remat | str" = "none",
                       scan_unroll: int = 1) -> Tuple[LayerLoop, int]:
    """The loop a stack of ``n_layers`` runs as: ``(LayerLoop.SCAN or LayerLoop.UNROLLED, layers per
    iteration)``. ``auto`` unrolls stacks of at most :data:`AUTO_UNROLL_LAYERS` layers when no remat policy
    is on (remat only saves memory inside a loop: unrolled, XLA schedules the recomputation early and keeps
    it alive; measured on XLA:CPU, tiny model: remat=full 54.9 MB vs none 47.1 MB unrolled, 36.5 MB vs
    69.2 MB scanned), else scans. Unrolled runs all ``n_layers`` per iteration (straight-line code).
    :func:`meshtrain.annotate.scan_layers` runs this; the memory model reads it."""
    loop = LayerLoop(loop)
    if loop is LayerLoop.AUTO:
        loop = LayerLoop.UNROLLED if n_layers <= AUTO_UNROLL_LAYERS and Remat(remat) is Remat.NONE \
            else LayerLoop.SCAN
    return loop, (n_layers if loop is LayerLoop.UNROLLED else min(scan_unroll, max(n_layers, 1)))


class Offload(str, enum.Enum):
    """What lives in host memory between steps (:mod:`meshtrain.offload`): ``none``, or
    ``optimizer`` (the optimizer state, in ``pinned_host`` memory, moved in for the update)."""

    NONE = "none"
    OPTIMIZER = "optimizer"


DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A named parallel layout plus the run's knobs. Immutable: use the ``with_*`` methods.

    Args:
      name, description: shown by ``meshtrain recipes``.
      strategies: registered strategy names (``meshtrain.strategies``), e.g. ``("fsdp", "tp")``.
      mesh: default ``MeshSpec`` (override per run with :meth:`with_mesh`).
      remat: :class:`Remat` policy for the layer stack.
      param_dtype / compute_dtype: storage and matmul dtypes (``float32`` or ``bfloat16``).
      micro_batches: gradient accumulation steps per optimizer step.
      attention: :class:`AttentionKind`.
      replicate_indivisible: logical names that may be replicated when a dimension does not divide
        its mesh axes (reported in the plan); everything else raises.
      max_replicated_fraction: the plan guard: at most this share of the bytes a recipe shards may
        stay replicated.
      rules: extra or overriding rules, merged after the strategies' rules.
      offload: :class:`Offload`: ``optimizer`` keeps the optimizer state in pinned host memory.
      layer_loop / scan_unroll: :class:`LayerLoop` for the layer stack, and layers per scan iteration.
      schedule: :class:`Schedule` of the pipeline (``pp`` strategy); ``micro_batches`` is then the
        pipeline's micro-batch count.
      repeats: layer groups per stage for the ``circular`` schedule (1 otherwise).
    """

    name: str
    description: str
    strategies: Tuple[str, ...]
    mesh: MeshSpec
    remat: Remat = Remat.NONE
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    micro_batches: int = 1
    attention: AttentionKind = AttentionKind.DENSE
    replicate_indivisible: Tuple[str, ...] = ()
    max_replicated_fraction: float = 0.02
    rules: AxisRules = AxisRules()
    offload: Offload = Offload.NONE
    layer_loop: LayerLoop = LayerLoop.AUTO
    scan_unroll: int = 1
    schedule: Schedule = Schedule.GPIPE
    repeats: int = 1

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass normalisation)
        set_("strategies", tuple(self.strategies))
        set_("replicate_indivisible", tuple(self.replicate_indivisible))
        try:
            set_("remat", Remat(self.remat))
            set_("attention", AttentionKind(self.attention))
            set_("offload", Offload(self.offload))
            set_("layer_loop", LayerLoop(self.layer_loop))
        except ValueError as exc:
            raise RecipeError(f"recipe {self.name!r}: {exc}; remat is one of {[r.value for r in Remat]}, "
                              f"attention one of {[a.value for a in AttentionKind]}, offload one of "
                              f"{[o.value for o in Offload]}, layer_loop one of {[x.value for x in LayerLoop]}") \
                from None
        if not isinstance(self.scan_unroll, int) or isinstance(self.scan_unroll, bool) or self.scan_unroll < 1:
            raise RecipeError(f"recipe {self.name!r}: scan_unroll={self.scan_unroll!r}; use an int >= 1 (layers per "
                              f"scan iteration)")
        for field in ("param_dtype", "compute_dtype"):
            if getattr(self, field) not in DTYPES:
                raise RecipeError(f"recipe {self.name!r}: {field}={getattr(self, field)!r}; use one of {DTYPES}")
        if not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise RecipeError(f"recipe {self.name!r}: micro_batches={self.micro_batches!r}; use an int >= 1")
        try:
            set_("schedule", Schedule(self.schedule))
        except ValueError:
            raise RecipeError(f"recipe {self.name!r}: schedule={self.schedule!r}; use one of "
                              f"{[s.value for s in Schedule]}") from None
        if not isinstance(self.repeats, int) or isinstance(self.repeats, bool) or self.repeats < 1:
            raise RecipeError(f"recipe {self.name!r}: repeats={self.repeats!r}; use an int >= 1 (layer groups per "
                              f"pipeline stage, circular schedule)")
        for name in self.replicate_indivisible:
            check_logical_name(name, f"recipe {self.name!r}: replicate_indivisible")
        if not 0.0 <= self.max_replicated_fraction <= 1.0:
            raise RecipeError(f"recipe {self.name!r}: max_replicated_fraction must be in [0, 1]")
        _, owners = compose(self.strategies)  # validates names, requirements and axis claims
        step_options(self.strategies)  # validates that the strategies' step options agree
        extra = [a for a, size in self.mesh.ici + self.mesh.dcn if a not in owners and size != 1]
        if extra:
            raise RecipeError(
                f"recipe {self.name!r}: mesh axes {extra} are used by none of its strategies "
                f"{list(self.strategies)} (they would only replicate); add a strategy that owns them")

    # -- derived ----------------------------------------------------------------------------
    def axis_rules(self) -> AxisRules:
        """Defaults ← strategies' rules ← this recipe's own ``rules`` (which may override)."""
        rules, _ = compose(self.strategies)
        return rules.overridden_by(self.rules)

    def axis_owners(self) -> Dict[str, str]:
        return compose(self.strategies)[1]

    def step_options(self) -> Dict[str, Any]:
        """The step options its strategies set (``meshtrain.strategies.STEP_OPTIONS``), e.g.
        ``{"shard_gradients": True}`` for ``zero2``."""
        return step_options(self.strategies)

    @property
    def shard_gradients(self) -> bool:
        """Whether the step keeps gradients sharded like the optimizer state (ZeRO-2)."""
        return bool(self.step_options().get("shard_gradients", False))

    # -- copies -----------------------------------------------------------------------------
    def with_mesh(self, dcn: Optional[Mapping[str, int]] = None, **sizes: int) -> "Recipe":
        """A copy with some mesh sizes replaced, e.g. ``with_mesh(fsdp=4, tensor=2)``."""
        return dataclasses.replace(self, mesh=self.mesh.with_sizes(sizes, dcn=dcn))

    def with_options(self, **changes: Any) -> "Recipe":
        """A copy with knobs replaced, e.g. ``with_options(compute_dtype="bfloat16", remat="full")``."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise RecipeError(f"unknown recipe options {sorted(unknown)}")
        return dataclasses.replace(self, **changes)

    # -- files ------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        rules = {k: v for k, v in self.rules.to_dict().items() if v}
        return {
            "name": self.name,
            "description": self.description,
            "strategies": list(self.strategies),
            "mesh": {"ici": dict(self.mesh.ici), "dcn": dict(self.mesh.dcn), "axis_types": self.mesh.axis_types.value},
            "remat": self.remat.value,
            "param_dtype": self.param_dtype,
            "compute_dtype": self.compute_dtype,
            "micro_batches": self.micro_batches,
            "attention": self.attention.value,
            "replicate_indivisible": list(self.replicate_indivisible),
            "max_replicated_fraction": self.max_replicated_fraction,
            "rules": rules,
            **({"offload": self.offload.value} if self.offload is not Offload.NONE else {}),
            **({"layer_loop": self.layer_loop.value} if self.layer_loop is not LayerLoop.AUTO else {}),
            **({"scan_unroll": self.scan_unroll} if self.scan_unroll != 1 else {}),
            **self._pipeline_dict(),
        }

    def _pipeline_dict(self) -> Dict[str, Any]:
        # Only pipeline recipes (or non-default knobs) write these keys, so other recipe files stay as they were.
        if "pp" in self.strategies or self.schedule is not Schedule.GPIPE or self.repeats != 1:
            return {"schedule": self.schedule.value, "repeats": self.repeats}
        return {}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "<dict>") -> "Recipe":
        if not isinstance(data, Mapping):
            raise RecipeError(f"{source}: a recipe must be a mapping, got {type(data).__name__}")
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        model_keys = sorted(unknown & _MODEL_SETTINGS, key=str)
        if model_keys:
            raise RecipeError(
                f"{source}: {model_keys} are settings of the model (its mixture-of-experts layers), not recipe keys: "
                f"a recipe only lays a model out. Remove them from the file and set them on the model config, "
                f"e.g. get_config('tiny-moe', capacity_factor=2.0, experts_per_token=2, n_shared_experts=1)")
        if unknown:
            raise RecipeError(f"{source}: unknown recipe keys {sorted(unknown)}; known: {sorted(known)}")
        for key in ("name", "strategies", "mesh"):
            if key not in data:
                raise RecipeError(f"{source}: recipe needs a {key!r} entry")
        strategies = data["strategies"]
        if isinstance(strategies, str) or not isinstance(strategies, (list, tuple)) or not all(
                isinstance(x, str) for x in strategies):
            raise RecipeError(f"{source}: strategies must be a list of names, e.g. strategies: [fsdp] or [fsdp, tp]; "
                              f"got {strategies!r}")
        for key, kind in (("max_replicated_fraction", (int, float)), ("micro_batches", int),
                          ("replicate_indivisible", (list, tuple)), ("description", str), ("name", str)):
            if key in data and (not isinstance(data[key], kind) or isinstance(data[key], bool)):
                want = {"max_replicated_fraction": "a number in [0, 1], e.g. 0.02", "micro_batches": "an integer >= 1",
                        "replicate_indivisible": "a list of logical names, e.g. [kv_heads]",
                        "description": "a string", "name": "a string"}[key]
                raise RecipeError(f"{source}: {key} must be {want}; got {data[key]!r}")
        mesh = data["mesh"]
        if not isinstance(mesh, Mapping) or "ici" not in mesh:
            raise RecipeError(f"{source}: mesh must be a mapping with 'ici' sizes, e.g. mesh: {{ici: {{fsdp: -1}}}}")
        data["mesh"] = _mesh_from_dict(mesh, source)
        rules = data.get("rules") or {}
        if not isinstance(rules, Mapping):
            raise RecipeError(f"{source}: rules must be a mapping of tables {TABLES} to {{logical name: mesh axes}}, "
                              f"e.g. rules: {{params: {{embed: fsdp}}}}; got {rules!r}")
        bad = set(rules) - set(TABLES)
        if bad:
            raise RecipeError(f"{source}: unknown rules tables {sorted(bad)}; use {TABLES}")
        for table, entries in rules.items():
            if entries is not None and not isinstance(entries, Mapping):
                raise RecipeError(f"{source}: rules.{table} must map logical names to mesh axes, e.g. "
                                  f"{{embed: fsdp}}; got {entries!r}")
            for name in entries or {}:
                check_logical_name(name, f"{source}: rules.{table}")
        with _naming(source):
            data["rules"] = AxisRules.of(**{k: rules.get(k) or {} for k in TABLES}, source=f"recipe:{data['name']}")
            data.setdefault("description", "")
            return cls(**data)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    @classmethod
    def load(cls, path: str) -> "Recipe":
        if not os.path.isfile(path):
            raise RecipeError(f"recipe file {path!r} does not exist")
        return cls.from_dict(load_yaml(path, what="recipe file"), source=path)


def check_logical_name(name: Any, where: str) -> None:
    """Raise :class:`RecipeError` unless ``name`` is a known logical axis (:data:`meshtrain.axes.LOGICAL_AXES`),
    with a did-you-mean for a misspelt one; ``where`` says which setting names it."""
    if isinstance(name, str) and name in LOGICAL_AXES:
        return
    close = difflib.get_close_matches(str(name), list(LOGICAL_AXES), n=1)
    raise RecipeError(
        f"{where} names logical axis {name!r}, which no model axis uses"
        + (f" (did you mean {close[0]!r}?)" if close else "")
        + f"; known: {', '.join(LOGICAL_AXES)}. A model with its own names registers them "
          f"first with meshtrain.axes.register_logical_axis(name, meaning)")


_MESH_KEYS = ("ici", "dcn", "axis_types")

#: Keys of a model's mixture-of-experts settings (``DecoderConfig`` / ``MoEConfig`` fields) that people put in
#: recipe files: they are refused with where they belong.
_MODEL_SETTINGS = frozenset({"moe", "n_experts", "experts_per_token", "top_k", "d_expert", "n_shared_experts",
                             "n_shared", "capacity_factor", "router_aux_coef", "router_z_coef", "router_norm_topk"})


def _mesh_from_dict(mesh: Mapping[str, Any], source: str) -> MeshSpec:
    unknown = sorted(set(mesh) - set(_MESH_KEYS), key=str)
    if unknown:
        raise RecipeError(f"{source}: unknown mesh keys {unknown}; use {list(_MESH_KEYS)}")
    for key in ("ici", "dcn"):
        if mesh.get(key) is not None and not isinstance(mesh[key], Mapping):
            raise RecipeError(f"{source}: mesh.{key} must map mesh axes to sizes, e.g. {key}: {{fsdp: -1}}; "
                              f"got {mesh[key]!r}")
    axis_types = mesh.get("axis_types", AxisTypes.AUTO.value)
    allowed = [t.value for t in AxisTypes]
    if axis_types not in allowed:
        raise RecipeError(f"{source}: mesh.axis_types={axis_types!r}; use one of {allowed}")
    with _naming(source):
        return MeshSpec(ici=mesh["ici"] or {}, dcn=mesh.get("dcn") or {}, axis_types=AxisTypes(axis_types))


@contextlib.contextmanager
def _naming(source: str):
    """Errors raised inside name the recipe file (or dict) they come from."""
    try:
        yield
    except MeshtrainError as exc:
        if str(exc).startswith(source):
            raise
        raise type(exc)(f"{source}: {exc}") from None


class _DuplicateKey(Exception):
    def __init__(self, key, first_line: int, second_line: int):
        super().__init__(key, first_line, second_line)
        self.key, self.first_line, self.second_line = key, first_line, second_line


def _unique_key_loader():
    """A ``yaml.SafeLoader`` whose mappings refuse a key given twice (PyYAML keeps the last silently)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            lines: Dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden on purpose
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = lines.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if first != key_node.start_mark.line + 1:
                    raise _DuplicateKey(key, first, key_node.start_mark.line + 1)
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def load_yaml(path: str, *, what: str) -> Any:
    """The YAML document in ``path``: UTF-8 text, no key given twice in one mapping; anything else raises
    :class:`RecipeError` naming the file (``what`` says what it is, e.g. ``"recipe file"``)."""
    import yaml

    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{what} {path!r} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                          f"{exc.start}); save it as UTF-8 YAML") from None
    except OSError as exc:
        raise RecipeError(f"{what} {path!r} cannot be read: {exc.strerror or exc}") from None
    try:
        return yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as dup:
        raise RecipeError(f"{what} {path!r}: key {dup.key!r} is given twice in one mapping (lines {dup.first_line} "
                          f"and {dup.second_line}); keep one") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(f"{what} {path!r} is not valid YAML: {problem}{where}") from None


def _builtin(name, description, strategies, ici, **knobs) -> Recipe:
    return Recipe(name=name, description=description, strategies=strategies, mesh=MeshSpec(ici=ici), **knobs)


BUILTIN_RECIPES: Dict[str, Recipe] = {r.name: r for r in [
    _builtin("dp", "Data parallel: replicate weights, split the batch, all-reduce gradients.",
             ("dp",), {"data": -1}),
    _builtin("fsdp", "Fully sharded data parallel (ZeRO-3): weights, gradients and Adam state split over all "
             "devices.", ("fsdp",), {"fsdp": -1}),
    _builtin("zero1", "ZeRO-1: data parallel with only the optimizer state sharded.", ("zero1",), {"data": -1}),
    _builtin("zero2", "ZeRO-2: data parallel with the optimizer state and the gradients sharded.", ("zero2",),
             {"data": -1}),
    _builtin("hsdp", "Hybrid sharded DP: FSDP inside groups, replicated across groups (put `data` on DCN).",
             ("hsdp",), {"data": 2, "fsdp": -1}),
    _builtin("tp", "Megatron tensor parallelism over all devices (data axis available for DP).",
             ("dp", "tp"), {"data": 1, "tensor": -1}),
    _builtin("fsdp_tp", "FSDP over `fsdp` × Megatron TP over `tensor` (keep tensor within a node).",
             ("dp", "fsdp", "tp"), {"data": 1, "fsdp": -1, "tensor": 2}),
    _builtin("fsdp_tp_sp", "FSDP × TP with Megatron sequence parallelism on the residual stream.",
             ("dp", "fsdp", "tp", "sp"), {"data": 1, "fsdp": -1, "tensor": 2}),
]}

# expert parallelism (MoE models; a dense model just sees `expert` as more data parallelism)
for _r in [
    _builtin("ep", "Expert parallelism: MoE experts split over `expert` (all-to-all dispatch), batch over `data` "
             "and `expert`, other weights replicated.", ("dp", "ep"), {"data": 1, "expert": -1},
             max_replicated_fraction=1.0),  # like dp, non-expert weights are replicated on purpose
    _builtin("fsdp_ep", "FSDP over `fsdp` × expert parallelism over `expert`: experts split over `expert`, every "
             "weight also sharded on `embed` over `fsdp`.", ("fsdp", "ep"), {"fsdp": -1, "expert": 4}),
    _builtin("fsdp_tp_ep", "FSDP × Megatron TP × expert parallelism: experts over `expert`, expert and dense MLP "
             "widths over `tensor`.", ("dp", "fsdp", "tp", "ep"), {"data": 1, "fsdp": -1, "expert": 2, "tensor": 2}),
]:
    BUILTIN_RECIPES[_r.name] = _r


# pipeline parallelism (meshtrain.parallel.pipeline): `stage` outermost, so it can sit on the slow links.
for _r in [
    _builtin("pp", "Pipeline parallel: the layer stack split over `stage` (2 stages), micro-batches passed between "
             "neighbours; data parallel over the rest. Pick --schedule gpipe|circular|1f1b.",
             ("dp", "pp"), {"stage": 2, "data": -1}, micro_batches=4,
             max_replicated_fraction=0.6),  # embedding and head stay whole on every stage
    _builtin("pp_fsdp", "Pipeline (2 stages) × FSDP: each stage's layers sharded over `fsdp`.",
             ("dp", "fsdp", "pp"), {"stage": 2, "data": 1, "fsdp": -1}, micro_batches=4),
    _builtin("pp_fsdp_tp", "Pipeline (2 stages) × FSDP × Megatron TP (2): 3D parallelism.",
             ("dp", "fsdp", "tp", "pp"), {"stage": 2, "data": 1, "fsdp": -1, "tensor": 2}, micro_batches=4),
]:
    BUILTIN_RECIPES[_r.name] = _r


# context parallelism (meshtrain.parallel.context): the sequence split over `context` (× `ulysses` for usp).
for _r in [
    _builtin("cp", "Context parallel: the sequence split over all devices (`context`), ring attention with zig-zag "
             "load balance; weights replicated. For long sequences; --attention all_gather|ring|ulysses.",
             ("cp",), {"context": -1}, attention="ring"),
    _builtin("fsdp_cp", "FSDP × context parallel (4): weights sharded over `fsdp`, the sequence over `context` "
             "(ring attention, zig-zag load balance).", ("dp", "fsdp", "cp"), {"data": 1, "fsdp": -1, "context": 4},
             attention="ring"),
    _builtin("fsdp_tp_cp", "FSDP × context (2) × Megatron TP (2): queries sequence-sharded, K/V all-gathered over "
             "`context` (Llama 3's long-context layout).", ("dp", "fsdp", "tp", "cp"),
             {"data": 1, "fsdp": -1, "context": 2, "tensor": 2}, attention="all_gather"),
    _builtin("fsdp_cp_usp", "FSDP × 2-D context parallel (USP): Ulysses all-to-all over `ulysses` (2) inside a ring "
             "over `context` (2).", ("dp", "fsdp", "cp", "usp"), {"data": 1, "fsdp": -1, "context": 2, "ulysses": 2},
             attention="usp"),
]:
    BUILTIN_RECIPES[_r.name] = _r

def register_recipe(recipe: Recipe) -> Recipe:
    """Add a recipe to the built-in table (other modules register CP/EP/PP recipes this way)."""
    BUILTIN_RECIPES[recipe.name] = recipe
    return recipe


def get_recipe(name_or_path: "str | Recipe") -> Recipe:
    """A built-in recipe by name, or a recipe file (``.yaml`` / ``.yml``) by path."""
    if isinstance(name_or_path, Recipe):
        return name_or_path
    if name_or_path.endswith((".yaml", ".yml")) or os.sep in name_or_path:
        return Recipe.load(name_or_path)
    try:
        return BUILTIN_RECIPES[name_or_path]
    except KeyError:
        raise RecipeError(f"unknown recipe {name_or_path!r}; built-in: {', '.join(BUILTIN_RECIPES)} "
                          f"(or pass a .yaml file)") from None


def describe_strategies(recipe: Recipe) -> str:
    return ", ".join(f"{s} ({get_strategy(s).description.split(':')[0]})" for s in recipe.strategies)
