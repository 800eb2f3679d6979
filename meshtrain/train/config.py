"""`TrainConfig`: every knob of a run, frozen; and the default optimizer built from it."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Dict, Optional, Tuple

import optax

from meshtrain.abstract import tree_paths
from meshtrain.axes import LogicalAxes
from meshtrain.errors import ConfigError, RecipeError
from meshtrain.recipes import BUILTIN_RECIPES, AttentionKind, Recipe, get_recipe
from meshtrain.train.step import NonFinite


class Resume(str, enum.Enum):
    """``no``: start fresh (the run folder must not hold a run); ``latest``: continue from the newest
    valid checkpoint in the run folder. ``latest`` starts fresh only when the folder holds no run at
    all (the first launch of a preemptible job); a folder with checkpoints of which none is valid, or
    with metrics but no checkpoints, is refused (nothing is deleted)."""

    NO = "no"
    LATEST = "latest"


class MemoryCheckMode(str, enum.Enum):
    """``on``: refuse to start when the plan's per-device bytes exceed a device's memory
    (:mod:`meshtrain.train.preflight`); ``off``: skip the check."""

    ON = "on"
    OFF = "off"


class Progress(str, enum.Enum):
    """``auto``: a live bar on a terminal, plain lines otherwise; ``bar``; ``lines``; ``none``."""

    AUTO = "auto"
    BAR = "bar"
    LINES = "lines"
    NONE = "none"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run. Every field has a default: ``TrainConfig()`` is the CLI's main job.

    Model and layout: ``model`` (a config name; ignored when the Trainer gets a factory), ``recipe``
    (name or YAML file), ``mesh`` (overrides, ``"fsdp=4,tensor=2"``), ``dcn`` (the part of those sizes
    that spans processes/slices, ``"data=2"``; ``None``: the outermost axes when there are several),
    ``devices``, ``recipe_options`` (the recipe's knobs and dimension options to override, by
    :meth:`~meshtrain.Recipe.with_options` name; :meth:`build_recipe` applies them).
    Data: ``data`` (``None`` = the embedded corpus), ``batch_size`` (global), ``seq_len``, ``seed``,
    ``val_fraction``. Optimizer: AdamW with linear warmup and cosine decay to ``lr * min_lr_ratio``,
    global-norm clipping at ``clip_norm`` (``0`` disables). Loop: ``steps``, ``eval_every`` and
    ``eval_batches`` (``0`` disables), ``log_every``, ``nonfinite`` policy and ``max_skips`` in a row.
    Output: ``out`` (the run folder), ``ckpt_every`` (``0`` disables), ``keep_last``, ``keep_every``,
    ``resume``, ``progress``, ``peak_flops_per_device`` or ``hardware`` (a profile name such as
``h100``, or ``cpu`` to measure this host) for MFU; ``None`` = from the device kind.
    """

    model: str = "small"
    recipe: str = "fsdp"
    #: overrides of the recipe's knobs and dimension options, ``(name, value)`` pairs in
    #: :meth:`meshtrain.Recipe.with_options`' names, e.g. ``(("remat", "full"), ("load_balance", "none"))``
    recipe_options: Tuple[Tuple[str, Any], ...] = ()
    mesh: Optional[str] = None
    dcn: Optional[str] = None
    devices: Optional[int] = None
    data: Optional[str] = None
    batch_size: int = 16
    seq_len: int = 128
    seed: int = 0
    val_fraction: float = 0.01
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    steps: int = 250
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    nonfinite: NonFinite = NonFinite.RAISE
    max_skips: int = 5
    out: Optional[str] = None
    ckpt_every: int = 0
    keep_last: int = 3
    keep_every: Optional[int] = None
    resume: Resume = Resume.NO
    progress: Progress = Progress.AUTO
    peak_flops_per_device: Optional[float] = None
    hardware: Optional[str] = None
    memory_check: MemoryCheckMode = MemoryCheckMode.ON

    def __post_init__(self):
        enums = {"nonfinite": NonFinite, "resume": Resume, "progress": Progress, "memory_check": MemoryCheckMode}
        for name, enum_type in enums.items():
            try:
                object.__setattr__(self, name, enum_type(getattr(self, name)))
            except ValueError:
                raise ConfigError(f"{name}={getattr(self, name)!r}; use one of "
                                  f"{[e.value for e in enum_type]}") from None
        positive = {"batch_size": self.batch_size, "seq_len": self.seq_len, "steps": self.steps}
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {value}: must be a positive integer")
        for name in ("eval_every", "eval_batches", "log_every", "ckpt_every", "warmup_steps", "max_skips"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise ConfigError(f"--lr {self.lr}: must be a positive finite number, e.g. --lr 3e-4")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 63:
            raise ConfigError(f"--seed {self.seed}: must be an integer >= 0")
        for name in ("min_lr_ratio", "weight_decay", "clip_norm", "val_fraction"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"--{name.replace('_', '-')} {value}: must be a finite number >= 0")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction {self.val_fraction}: must be between 0 and 1 (exclusive)")
        peak = self.peak_flops_per_device
        if peak is not None and not (math.isfinite(peak) and peak > 0):
            raise ConfigError(f"--peak-tflops {peak / 1e12:g} (peak_flops_per_device {peak:g}): must be a positive "
                              f"finite number of TFLOP/s per device, e.g. --peak-tflops 989 (H100 bf16), or omit it")
        object.__setattr__(self, "recipe_options", tuple((str(k), v) for k, v in dict(self.recipe_options).items()))
        options = dict(self.recipe_options)
        check_recipe_overrides(get_recipe(self.recipe), attention=options.get("attention"),
                               schedule=options.get("schedule"), repeats=options.get("repeats"))
        self.build_recipe()  # every other override is checked by the recipe

    def build_recipe(self) -> Recipe:
        """The run's recipe: ``recipe`` (a name or file) with ``recipe_options`` applied."""
        try:
            return get_recipe(self.recipe).with_options(**dict(self.recipe_options))
        except RecipeError as exc:
            raise ConfigError(str(exc)) from None


def check_recipe_overrides(recipe: Recipe, *, attention: Optional[str] = None, schedule: Optional[str] = None,
                           repeats: Optional[int] = None) -> None:
    """Refuse overrides that the recipe's layout would silently ignore (``meshtrain train`` and
    ``meshtrain plan`` share this): a context-parallel ``attention`` kind without a mesh axis that
    shards the sequence (it would run as plain flash attention), a pipeline ``schedule`` or
    ``repeats`` without a ``stage`` axis (no pipeline runs)."""
    try:
        kind = None if attention is None else AttentionKind(attention)
    except ValueError:
        raise ConfigError(f"--attention {attention!r}: use one of {[k.value for k in AttentionKind]}") from None
    if kind not in (None, AttentionKind.DENSE, AttentionKind.FLASH) and not _splits_sequence(recipe):
        fitting = ", ".join(n for n, r in BUILTIN_RECIPES.items() if _splits_sequence(r))
        raise ConfigError(f"--attention {attention} needs a recipe that splits the sequence over a context axis; "
                          f"recipe {recipe.name!r} has none: use --recipe one of {fitting}, or --attention dense "
                          f"or flash")
    if _has_pipeline(recipe):
        return
    for flag, value in (("--schedule", schedule), ("--repeats", repeats)):
        if value is not None:
            fitting = ", ".join(n for n, r in BUILTIN_RECIPES.items() if _has_pipeline(r))
            raise ConfigError(f"{flag} {value} applies to pipeline recipes; recipe {recipe.name!r} has no pipeline "
                              f"stages: use --recipe one of {fitting}, or drop {flag}")


def _splits_sequence(recipe: Recipe) -> bool:
    """Whether the recipe maps the ``seq`` activations onto mesh axes (context parallelism)."""
    rule = recipe.axis_rules().table("activations").get("seq")
    return bool(rule and rule.mesh_axes)


def _has_pipeline(recipe: Recipe) -> bool:
    return "stage" in recipe.axis_owners()


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(cfg.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1),
                                              end_value=cfg.lr * cfg.min_lr_ratio)


def default_optimizer(cfg: TrainConfig, param_axes: Dict[str, LogicalAxes]) -> optax.GradientTransformation:
    """AdamW (warmup + cosine) with global-norm clipping; weight decay only on matrices (parameters
    with two or more logical axes besides ``layers``: not norms, not biases)."""
    def decay_mask(params):
        return {} if not params else _mask(tree_paths(params))

    def _mask(paths):
        import jax

        return jax.tree.map(lambda p: len([a for a in param_axes.get(p, ()) if a != "layers"]) >= 2, paths)

    adamw = optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw) if cfg.clip_norm > 0 else adamw
