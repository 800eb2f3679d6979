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
import warnings
from typing import Any, Dict, FrozenSet, Mapping, Optional, Tuple, Type, TypeVar

from meshtrain.axes import LOGICAL_AXES
from meshtrain.errors import MeshtrainError, RecipeError
from meshtrain.mesh import AxisTypes, MeshSpec
from meshtrain.remat_policies import DEFAULT_OFFLOAD, Remat, parse_offload_names
from meshtrain.rules import TABLES, AxisRules
from meshtrain.settings import Setting, coerce_all, setting, settings_of
from meshtrain.strategies import (FSDP, HSDP, Context, ContextKind, DataParallel, Expert, FlashBackend,  # noqa: F401
                                  IndivisibleHeads, LoadBalance, Pipeline, Schedule, Strategy, Tensor, ZeRO, ZeroStage,
                                  compose, ResolvedStrategies, resolve_strategies)
from meshtrain.strategies import strategies as registered_strategies
from meshtrain.yaml_files import load_yaml  # noqa: F401 (re-exported: rules files and run configurations read YAML through it)


class LocalAttention(str, enum.Enum):
    """The attention kernel on each device when no context dimension shards the sequence:
    ``dense`` (materialises the scores; short sequences, reference) or ``flash`` (never materialises
    ``T × T``: cuDNN / splash / blockwise XLA, picked by ``cp``'s ``flash_backend`` or ``auto``)."""

    DENSE = "dense"
    FLASH = "flash"


class AttentionKind(str, enum.Enum):
    """How attention is computed, resolved from a recipe (:attr:`Recipe.attention`): its
    :class:`LocalAttention` or, with a context dimension, that dimension's :class:`ContextKind`.

    * ``dense``, ``flash``: see :class:`LocalAttention`;
    * ``all_gather``: queries stay sequence-sharded on ``context``, K/V all-gathered;
    * ``ring``: K/V blocks passed around ``context`` with ``ppermute`` (zig-zag load balance by default);
    * ``ulysses``: all-to-all sequence-sharded ↔ head-sharded over ``context``;
    * ``usp``: Ulysses over ``ulysses`` × ring over ``context``.
    """

    DENSE = "dense"
    FLASH = "flash"
    ALL_GATHER = "all_gather"
    RING = "ring"
    ULYSSES = "ulysses"
    USP = "usp"


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


def direct_layer_calls(loop: "LayerLoop | str", n_layers: int, remat: "Remat | str" = "none",
                       scan_unroll: int = 1, fp8: "Fp8 | str" = "none") -> bool:
    """Whether a stack of ``n_layers`` runs as direct per-layer calls rather than a ``lax.scan``: fully unrolled
    (:func:`resolve_layer_loop`) with no remat policy and no FP8 scaling (its meta's gradient, flax's extended
    ``fp8_meta32`` dtype, has no transpose for slicing a stacked array: the scan carries it). Then the backward
    reuses what the forward gathered (an FSDP weight is all-gathered once per step, not again in the backward):
    :func:`meshtrain.annotate.scan_layers` runs the stack so, and the planner's collectives read the same answer."""
    _, unroll = resolve_layer_loop(loop, n_layers, remat, scan_unroll)
    return unroll >= n_layers > 0 and Remat(remat) is Remat.NONE and Fp8(fp8) is Fp8.NONE


class Offload(str, enum.Enum):
    """What lives in host memory between steps (:mod:`meshtrain.offload`): ``none``, or
    ``optimizer`` (the optimizer state, in ``pinned_host`` memory, moved in for the update)."""

    NONE = "none"
    OPTIMIZER = "optimizer"


class Fp8(str, enum.Enum):
    """FP8 matmuls (:mod:`meshtrain.fp8`): ``none``; ``delayed`` (each tensor's scale from the amax
    history of earlier steps, as the Transformer Engine; ``fp8_amax_history`` entries); ``current``
    (each tensor's scale from its own amax in this step: one more reduction per matmul input)."""

    NONE = "none"
    DELAYED = "delayed"
    CURRENT = "current"


DTYPES = ("float32", "bfloat16")

S = TypeVar("S", bound=Strategy)


class Strategies(ResolvedStrategies):
    """A recipe's dimensions, in order. ``"pp" in recipe.strategies`` asks by name (or registered key);
    :meth:`names` lists them."""

    def __contains__(self, item) -> bool:
        if isinstance(item, str):
            return any(item in (s.name, s.key) for s in self)
        return tuple.__contains__(self, item)

    def names(self) -> Tuple[str, ...]:
        return tuple(s.name for s in self)


#: Old recipe names (file keys, :meth:`Recipe.with_options` names, the CLI's ``--attention`` /
#: ``--micro-batches``), with where each one went. :func:`legacy_option` is the one place they are read.
LEGACY_NAMES = {
    "attention": "the local kernel is `local_attention: dense|flash`; a context-parallel kind is an option of the "
                 "cp dimension: strategies: [..., {cp: {kind: ring}}]",
    "micro_batches": "gradient accumulation is `grad_accum: N`; pipeline micro-batches are an option of the pp "
                     "dimension: strategies: [..., {pp: {micro_batches: N}}]",
    "schedule": "it is an option of the pp dimension: strategies: [..., {pp: {schedule: 1f1b}}]",
    "repeats": "it is an option of the pp dimension: strategies: [..., {pp: {schedule: circular, repeats: 2}}]",
}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A named parallel layout (a tuple of :class:`~meshtrain.strategies.Strategy` dimensions on a mesh)
    plus the run's knobs. Immutable: use :meth:`with_mesh` / :meth:`with_options`.

    Every knob is a :func:`~meshtrain.settings.setting` field: its help text, type and default are the
    CLI flag, the YAML key and the summaries (``meshtrain recipes --yaml NAME`` prints them all).
    ``strategies`` accepts objects (``FSDP()``, ``Context(kind="ulysses")``) or registered names
    (``"fsdp"``, ``"zero2"``). ``rules``: extra or overriding rules, merged after the strategies' rules.

    What a step runs (attention kernel, accumulation, pipeline schedule) is decided from the recipe by
    :func:`meshtrain.parallel.resolved.resolve_step`; read it there, or read the dimensions directly
    (``recipe.dimension(Pipeline).micro_batches``). Derived here: :attr:`shard_gradients`.
    """

    name: str
    description: str
    strategies: Tuple[Strategy, ...]
    mesh: MeshSpec
    remat: Remat = setting(Remat.NONE, "activation recomputation policy for the layer stack")
    param_dtype: str = setting("float32", "parameter storage dtype", choices=DTYPES)
    compute_dtype: str = setting("float32", "matmul dtype", choices=DTYPES)
    fp8: Fp8 = setting(Fp8.NONE, "FP8 (e4m3 forward, e5m2 gradient) dense matmuls with per-tensor scales: "
                       "delayed or current scaling")
    fp8_amax_history: int = setting(1024, "delayed FP8 scaling: amax history length per tensor", minimum=1)
    grad_accum: int = setting(1, "gradient accumulation: micro-batches per optimizer step (a pipeline's "
                              "micro-batches are pp's micro_batches)", minimum=1)
    local_attention: LocalAttention = setting(LocalAttention.DENSE, "attention kernel per device when no cp "
                                              "dimension shards the sequence")
    layer_loop: LayerLoop = setting(LayerLoop.AUTO, "run the layer stack as one scan, unrolled, or auto "
                                    "(unrolled up to 8 layers without remat)")
    scan_unroll: int = setting(1, "layers per scan iteration", minimum=1)
    offload: Offload = setting(Offload.NONE, "optimizer: keep the optimizer state (and f32 master weights) in "
                               "pinned host memory between steps")
    offload_activations: str = setting(",".join(DEFAULT_OFFLOAD), "with remat offload: the named activations "
                                       "(comma-separated) kept in pinned host memory until the backward pass")
    replicate_indivisible: Tuple[str, ...] = setting((), "logical names (comma-separated) kept whole on every device "
                                                     "of their mesh axes when a dimension does not divide them, e.g. "
                                                     "vocab,mlp (tensor parallelism already does this for heads "
                                                     "and kv_heads: see --indivisible-heads)")
    max_replicated_fraction: float = setting(0.02, "at most this share of the bytes a recipe shards may stay "
                                             "replicated (the plan guard; replicated tensors under 64 KiB each, "
                                             "such as norms, biases and small embeddings, are not counted)")
    rules: AxisRules = AxisRules()

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass normalisation)
        where = f"recipe {self.name!r}"
        with _naming(where):
            set_("strategies", Strategies(resolve_strategies(self.strategies)))
        coerce_all(self, where + ":")  # replicate_indivisible: a list, a tuple or "kv_heads,heads" -> a tuple
        set_("offload_activations", ",".join(parse_offload_names(self.offload_activations, where
                                                                  + ": offload_activations")))
        for name in self.replicate_indivisible:
            check_logical_name(name, f"{where}: replicate_indivisible")
        if not 0.0 <= self.max_replicated_fraction <= 1.0:
            raise RecipeError(f"{where}: max_replicated_fraction must be in [0, 1]")
        _, owners = compose(self.strategies)  # validates names, requirements and axis claims
        extra = [a for a, size in self.mesh.ici + self.mesh.dcn if a not in owners and size != 1]
        if extra:
            raise RecipeError(
                f"{where}: mesh axes {extra} are used by none of its strategies "
                f"{list(self.strategies.names())} (they would only replicate); add a strategy that owns them")
        if self.dimension(Pipeline) is not None and self.grad_accum != 1:
            raise RecipeError(f"{where}: grad_accum={self.grad_accum} with a pipeline (pp): the pipeline's "
                              f"micro-batches already split the batch; set pp's micro_batches instead")

    # -- derived ----------------------------------------------------------------------------
    def dimension(self, cls: Type[S]) -> Optional[S]:
        """This recipe's dimension of type ``cls`` (e.g. ``recipe.dimension(Context)``), or ``None``."""
        return next((s for s in self.strategies if isinstance(s, cls)), None)

    @property
    def shard_gradients(self) -> bool:
        """Whether the step keeps gradients sharded like the optimizer state (ZeRO-2)."""
        zero = self.dimension(ZeRO)
        return bool(zero and zero.shard_gradients)

    def axis_rules(self) -> AxisRules:
        """Defaults ← strategies' rules ← this recipe's own ``rules`` (which may override)."""
        rules, _ = compose(self.strategies)
        return rules.overridden_by(self.rules)

    def replicate_ok(self) -> FrozenSet[str]:
        """The logical names a plan may keep whole when a dimension does not divide its mesh axes: the recipe's
        ``replicate_indivisible`` and the names its dimensions handle themselves (``tp``: ``heads`` and
        ``kv_heads``, unless its ``indivisible_heads`` is ``refuse``). Every plan, step and cache reads this."""
        own = (name for s in self.strategies for name in getattr(s, "replicated_names", lambda: ())())
        return frozenset(self.replicate_indivisible) | frozenset(own)

    def axis_owners(self) -> Dict[str, str]:
        return compose(self.strategies)[1]

    # -- copies -----------------------------------------------------------------------------
    def with_mesh(self, dcn: Optional[Mapping[str, int]] = None, **sizes: int) -> "Recipe":
        """A copy with some mesh sizes replaced, e.g. ``with_mesh(fsdp=4, tensor=2)``."""
        return dataclasses.replace(self, mesh=self.mesh.with_sizes(sizes, dcn=dcn))

    def with_options(self, **changes: Any) -> "Recipe":
        """A copy with knobs or dimension options replaced, e.g. ``with_options(remat="full")``,
        ``with_options(load_balance="none", flash_backend="xla")`` (options of the recipe's ``cp``), or by
        CLI name (``context_kind``, ``pipeline_micro_batches``, ``zero_stage``). The old names ``attention`` and
        ``micro_batches`` still work, with a ``DeprecationWarning`` naming the new spelling (:func:`legacy_option`).
        A ``None`` value keeps the recipe's."""
        own = {f.name for f in dataclasses.fields(self) if f.init}
        mine: Dict[str, Any] = {}
        dims = {s.key: s for s in self.strategies}
        for key, value in changes.items():
            if value is None:
                continue
            key = legacy_option(self, key, value)
            if key in own:
                mine[key] = value
                continue
            cls, setting_ = _dimension_option(key)
            # (an option two dimensions share, e.g. dp's and hsdp's --grad-compression: whichever the recipe has)
            dim = next((d for d in self.strategies if isinstance(d, cls)
                        or any(s.flag == setting_.flag for s in settings_of(type(d)))), None)
            if dim is None:
                raise RecipeError(f"option {key!r} belongs to the {cls.key!r} dimension ({cls.__name__}); recipe "
                                  f"{self.name!r} has none (its strategies: {', '.join(self.strategies.names())})")
            dims[dim.key] = dataclasses.replace(dims[dim.key], **{setting_.name: setting_.coerce(value, key)})
        strategies = tuple(dims[s.key] for s in self.strategies)
        if all(a is b for a, b in zip(strategies, self.strategies)):
            strategies = self.strategies  # unchanged dimensions: the copy shares their composed rules (compose_memo)
        return dataclasses.replace(self, strategies=strategies, **mine)

    # -- files ------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """The recipe as a recipe file writes it: every setting, strategies as names or
        ``{key: {options that differ from the defaults}}``."""
        out: Dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "strategies": [s.to_plain() for s in self.strategies],
            "mesh": {"ici": dict(self.mesh.ici), "dcn": dict(self.mesh.dcn), "axis_types": self.mesh.axis_types.value},
        }
        for s in settings_of(type(self)):
            value = s.plain(getattr(self, s.name))
            out[s.name] = list(value) if isinstance(value, tuple) else value
        out["rules"] = {k: v for k, v in self.rules.to_dict().items() if v}
        return out

    def knobs(self) -> Dict[str, Any]:
        """Every knob and dimension option that differs from its default, flat (``remat``,
        ``cp.load_balance``, ...): the trainer's summary line and the plan's header print this."""
        out = {s.name: s.plain(getattr(self, s.name)) for s in settings_of(type(self))
               if getattr(self, s.name) != s.default and s.cli}
        for dim in self.strategies:
            out.update({f"{dim.key}.{k}": v for k, v in dim.options().items()})
        return out

    def knobs_text(self) -> str:
        """`` (remat full, cp.load_balance none)``: :meth:`knobs` as the trainer prints it ("" if none)."""
        parts = [f"{k.replace('_', ' ')} {v}" for k, v in self.knobs().items()]
        return f" ({', '.join(parts)})" if parts else ""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "<dict>") -> "Recipe":
        if not isinstance(data, Mapping):
            raise RecipeError(f"{source}: a recipe must be a mapping, got {type(data).__name__}")
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = set(data) - known
        model_keys = sorted(unknown & _MODEL_SETTINGS, key=str)
        if model_keys:
            raise RecipeError(
                f"{source}: {model_keys} are settings of the model (its mixture-of-experts layers), not recipe keys: "
                f"a recipe only lays a model out. Remove them from the file and set them on the model config, "
                f"e.g. get_config('tiny-moe', capacity_factor=2.0, experts_per_token=2, n_shared_experts=1)")
        legacy = {k: data.pop(k) for k in sorted(unknown & set(LEGACY_NAMES), key=str)}
        unknown -= set(legacy)
        if unknown:
            raise RecipeError(f"{source}: unknown recipe keys {sorted(unknown, key=str)}; known: {sorted(known)}")
        for key in ("name", "strategies", "mesh"):
            if key not in data:
                raise RecipeError(f"{source}: recipe needs a {key!r} entry")
        strategies = data["strategies"]
        if isinstance(strategies, str) or not isinstance(strategies, (list, tuple)):
            raise RecipeError(f"{source}: strategies must be a list of names or {{key: {{option: value}}}}, e.g. "
                              f"strategies: [fsdp, {{cp: {{kind: ring}}}}]; got {strategies!r}")
        for key, kind in (("replicate_indivisible", (list, tuple)), ("description", str), ("name", str)):
            if key in data and (not isinstance(data[key], kind) or isinstance(data[key], bool)):
                want = {"replicate_indivisible": "a list of logical names, e.g. [kv_heads]",
                        "description": "a string", "name": "a string"}[key]
                raise RecipeError(f"{source}: {key} must be {want}; got {data[key]!r}")
        for s in settings_of(cls):
            if s.name in data and s.name != "replicate_indivisible":
                data[s.name] = s.coerce(data[s.name], f"{source}: {s.name}")
        if "max_replicated_fraction" in data and not 0.0 <= data["max_replicated_fraction"] <= 1.0:
            raise RecipeError(f"{source}: max_replicated_fraction must be a number in [0, 1], e.g. 0.02; got "
                              f"{data['max_replicated_fraction']!r}")
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
            data["strategies"] = resolve_strategies(strategies)
            data["rules"] = AxisRules.of(**{k: rules.get(k) or {} for k in TABLES}, source=f"recipe:{data['name']}")
            data.setdefault("description", "")
            recipe = cls(**data)
        for key, value in legacy.items():  # old keys: read like with_options reads them, with a deprecation warning
            new = legacy_option(recipe, key, value, source=source, file=True)
            with _naming(source):
                recipe = recipe.with_options(**{new: value})
        return recipe

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    @classmethod
    def load(cls, path: str) -> "Recipe":
        if not os.path.isfile(path):
            raise RecipeError(f"recipe file {path!r} does not exist")
        return cls.from_dict(load_yaml(path, what="recipe file"), source=path)


def legacy_option(recipe: Recipe, key: str, value: Any, *, source: str = "", file: bool = False) -> str:
    """The option an old name stands for in ``recipe`` (its new spelling), with a ``DeprecationWarning`` naming
    it; ``key`` itself when it is not an old name. The one place old names are read, for
    :meth:`Recipe.with_options` (and so the CLI's ``--attention`` / ``--micro-batches``) and recipe files
    (``file``: a top-level ``schedule`` / ``repeats`` key is old there, while ``with_options(schedule=...)`` names
    ``pp``'s option). Example: ``legacy_option(get_recipe("dp"), "micro_batches", 4)`` → ``"grad_accum"``."""
    value = getattr(value, "value", value)
    if key == "micro_batches":
        new = "pipeline_micro_batches" if recipe.dimension(Pipeline) else "grad_accum"
    elif key == "attention":
        kinds = [k.value for k in ContextKind]
        if value not in kinds and recipe.dimension(Context) is not None:
            raise RecipeError(f"{source + ': ' if source else ''}attention={value!r}: recipe {recipe.name!r} shards "
                              f"the sequence (cp), so its attention is cp's kind: one of {kinds}")
        new = "context_kind" if value in kinds else "local_attention"
    elif key in ("schedule", "repeats") and file:
        new = key
    else:
        return key
    warnings.warn(f"{source + ': ' if source else ''}recipe option {key!r} is deprecated; for recipe {recipe.name!r} "
                  f"it is {new!r} ({LEGACY_NAMES[key]})", DeprecationWarning, stacklevel=3)
    return new


def recipe_settings() -> Tuple[Setting, ...]:
    """The recipe's own knobs (CLI flags ``--remat``, ``--grad-accum``, ...)."""
    return settings_of(Recipe)


def dimension_settings() -> Tuple[Tuple[Type[Strategy], Setting], ...]:
    """Every registered dimension's options with their class (CLI flags ``--load-balance``, ...)."""
    return tuple((cls, s) for cls in registered_strategies().values() for s in settings_of(cls))


def _dimension_option(key: str) -> Tuple[Type[Strategy], Setting]:
    """The dimension option named ``key`` (its CLI name, or its field name where that is unique)."""
    by_flag = {s.flag: (cls, s) for cls, s in dimension_settings()}
    if key in by_flag:
        return by_flag[key]
    by_name = [(cls, s) for cls, s in dimension_settings() if s.name == key]
    if len(by_name) == 1:
        return by_name[0]
    known = sorted({f.name for f in dataclasses.fields(Recipe) if f.init} | set(by_flag) | set(LEGACY_NAMES))
    raise RecipeError(f"unknown recipe option {key!r}; known: {', '.join(known)}")


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


def _builtin(name, description, strategies, ici, **knobs) -> Recipe:
    return Recipe(name=name, description=description, strategies=strategies, mesh=MeshSpec(ici=ici), **knobs)


BUILTIN_RECIPES: Dict[str, Recipe] = {r.name: r for r in [
    _builtin("dp", "Data parallel: replicate weights, split the batch, all-reduce gradients.",
             (DataParallel(),), {"data": -1}),
    _builtin("fsdp", "Fully sharded data parallel (ZeRO-3): weights, gradients and Adam state split over all "
             "devices.", (FSDP(),), {"fsdp": -1}),
    _builtin("zero1", "ZeRO-1: data parallel with only the optimizer state sharded.", (ZeRO(stage=ZeroStage.ONE),), {"data": -1}),
    _builtin("zero2", "ZeRO-2: data parallel with the optimizer state and the gradients sharded.", (ZeRO(stage=ZeroStage.TWO),),
             {"data": -1}),
    _builtin("hsdp", "Hybrid sharded DP: FSDP inside groups, replicated across groups (put `data` on DCN).",
             (HSDP(),), {"data": 2, "fsdp": -1}),
    _builtin("tp", "Megatron tensor parallelism over all devices (data axis available for DP).",
             (DataParallel(), Tensor()), {"data": 1, "tensor": -1}),
    _builtin("fsdp_tp", "FSDP over `fsdp` × Megatron TP over `tensor` (keep tensor within a node).",
             (DataParallel(), FSDP(), Tensor()), {"data": 1, "fsdp": -1, "tensor": 2}),
    _builtin("fsdp_tp_sp", "FSDP × TP with Megatron sequence parallelism on the residual stream.",
             (DataParallel(), FSDP(), Tensor(sequence_parallel=True)), {"data": 1, "fsdp": -1, "tensor": 2}),
]}

# expert parallelism (MoE models; a dense model just sees `expert` as more data parallelism)
for _r in [
    _builtin("ep", "Expert parallelism: MoE experts split over `expert` (all-to-all dispatch), batch over `data` "
             "and `expert`, other weights replicated.", (DataParallel(), Expert()), {"data": 1, "expert": -1},
             max_replicated_fraction=1.0),  # like dp, non-expert weights are replicated on purpose
    _builtin("fsdp_ep", "FSDP over `fsdp` × expert parallelism over `expert`: experts split over `expert`, every "
             "weight also sharded on `embed` over `fsdp`.", (FSDP(), Expert()), {"fsdp": -1, "expert": 4}),
    _builtin("fsdp_tp_ep", "FSDP × Megatron TP × expert parallelism: experts over `expert`, expert and dense MLP "
             "widths over `tensor`.", (DataParallel(), FSDP(), Tensor(), Expert()), {"data": 1, "fsdp": -1, "expert": 2, "tensor": 2}),
]:
    BUILTIN_RECIPES[_r.name] = _r


# pipeline parallelism (meshtrain.parallel.pipeline): `stage` outermost, so it can sit on the slow links.
for _r in [
    _builtin("pp", "Pipeline parallel: the layer stack split over `stage` (2 stages), micro-batches passed between "
             "neighbours; data parallel over the rest. Pick --schedule gpipe|circular|1f1b|zero_bubble.",
             (DataParallel(), Pipeline()), {"stage": 2, "data": -1},
             max_replicated_fraction=0.6),  # embedding and head stay whole on every stage
    _builtin("pp_fsdp", "Pipeline (2 stages) × FSDP: each stage's layers sharded over `fsdp`.",
             (DataParallel(), FSDP(), Pipeline()), {"stage": 2, "data": 1, "fsdp": -1}),
    _builtin("pp_fsdp_tp", "Pipeline (2 stages) × FSDP × Megatron TP (2): 3D parallelism.",
             (DataParallel(), FSDP(), Tensor(), Pipeline()), {"stage": 2, "data": 1, "fsdp": -1, "tensor": 2}),
]:
    BUILTIN_RECIPES[_r.name] = _r


# context parallelism (meshtrain.parallel.context): the sequence split over `context` (× `ulysses` for usp).
for _r in [
    _builtin("cp", "Context parallel: the sequence split over all devices (`context`), ring attention with zig-zag "
             "load balance; weights replicated. For long sequences; --context-kind all_gather|ring|ulysses.",
             (Context(kind=ContextKind.RING),), {"context": -1}),
    _builtin("fsdp_cp", "FSDP × context parallel (4): weights sharded over `fsdp`, the sequence over `context` "
             "(ring attention, zig-zag load balance).", (DataParallel(), FSDP(), Context(kind=ContextKind.RING)),
             {"data": 1, "fsdp": -1, "context": 4}),
    _builtin("fsdp_tp_cp", "FSDP × context (2) × Megatron TP (2): queries sequence-sharded, K/V all-gathered over "
             "`context` (Llama 3's long-context layout).", (DataParallel(), FSDP(), Tensor(), Context(kind=ContextKind.ALL_GATHER)),
             {"data": 1, "fsdp": -1, "context": 2, "tensor": 2}),
    _builtin("fsdp_cp_usp", "FSDP × 2-D context parallel (USP): Ulysses all-to-all over `ulysses` (2) inside a ring "
             "over `context` (2).", (DataParallel(), FSDP(), Context(kind=ContextKind.USP)),
             {"data": 1, "fsdp": -1, "context": 2, "ulysses": 2}),
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
    return ", ".join(f"{s} ({s.description.split(':')[0]})" for s in recipe.strategies)
