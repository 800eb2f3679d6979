"""`TrainConfig`: every knob of a run, frozen; and the default optimizer built from it."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from meshtrain.axes import LogicalAxes
from meshtrain.errors import ConfigError, RecipeError
from meshtrain.recipes import BUILTIN_RECIPES, AttentionKind, Recipe, get_recipe
from meshtrain.settings import setting, settings_of

if TYPE_CHECKING:  # the optimizer's types; optax loads when the Trainer builds one
    import optax


class NonFinite(str, enum.Enum):
    """What a step does with a non-finite loss or gradient: ``raise`` (the Trainer stops and names the
    step) or ``skip`` (parameters and optimizer state stay unchanged for that step)."""

    RAISE = "raise"
    SKIP = "skip"


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
class OptimizerDefaults:
    """The learning rate and warmup a run gets when ``--lr`` / ``--warmup-steps`` are not given: one set
    for a run from scratch, one for a run that starts from trained weights (``--init-from``), whose
    pretraining-sized steps would undo what the weights know. The schedule is the same shape for both,
    relative to ``--steps``: linear warmup, then cosine to ``lr * min_lr_ratio`` at ``--steps``."""

    name: str
    lr: float
    #: warmup steps as a share of ``--steps`` (at least 1), or ``None`` for a fixed count
    warmup_fraction: Optional[float]
    warmup_steps: int = 0

    def warmup(self, steps: int) -> int:
        if self.warmup_fraction is None:
            return self.warmup_steps
        return max(1, round(self.warmup_fraction * steps))


#: ``--init-from`` absent: the defaults meshtrain's built-in models train well with.
FROM_SCRATCH = OptimizerDefaults("from scratch", lr=3e-3, warmup_fraction=None, warmup_steps=20)
#: ``--init-from`` given (issue 31: lr 3e-3 raised a chat model's eval loss 3.77 → 4.32 in 20 steps, and
#: with lr 1e-4 and 2 warmup steps it fell 3.17 → 3.10).
FINE_TUNING = OptimizerDefaults("fine-tuning", lr=1e-4, warmup_fraction=0.05)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run. Every field has a default: ``TrainConfig()`` is the CLI's main job.

    Each field is a :func:`~meshtrain.settings.setting`: its help text below is also ``meshtrain train
    --help``'s, and the flag is generated from it (``batch_size`` → ``--batch-size``, enums give the
    choices). ``model`` is ignored when the Trainer gets a factory; ``recipe_options`` overrides the
    recipe's knobs and dimension options by :meth:`~meshtrain.Recipe.with_options` name (on the command
    line: the recipe's own flags); :meth:`build_recipe` applies them. Example::

        TrainConfig(model="tiny", recipe="fsdp_tp", steps=20, recipe_options={"remat": "full"})
    """

    # Every field is a setting (meshtrain.settings): its help text here is `meshtrain train --help`'s.
    # Model and layout
    model: str = setting("small", "model config: tiny, small, llama3-8b, ... (`meshtrain plan --help` lists them), "
                         "a HuggingFace model folder, or a run folder (the model it trained)")
    recipe: str = setting("fsdp", "recipe name (`meshtrain recipes`) or .yaml file")
    #: overrides of the recipe's knobs and dimension options, ``(name, value)`` pairs in
    #: :meth:`meshtrain.Recipe.with_options`' names, e.g. ``(("remat", "full"), ("load_balance", "none"))``
    recipe_options: Tuple[Tuple[str, Any], ...] = setting((), "the recipe's knobs and dimension options to "
                                                          "override", cli=False)  # CLI: the recipe's own flags
    mesh: Optional[str] = setting(None, "mesh size overrides, e.g. fsdp=4,tensor=2 (default: the recipe's)")
    dcn: Optional[str] = setting(None, "how much of each mesh axis spans processes/slices (DCN), e.g. data=2; "
                                 "the total sizes stay as --mesh says (default: the outermost axes, when devices "
                                 "span several processes)")
    devices: Optional[int] = setting(None, "number of devices", cli=False)  # CLI: cli.add_device_args, shared
    init_from: Optional[str] = setting(None, "a HuggingFace model folder (config.json + *.safetensors) or a run "
                                       "folder: start from its weights (a run's latest checkpoint); the optimizer "
                                       "starts fresh (default: the model's own initialisation from --seed)")
    # LoRA (meshtrain.models.lora): adapters on chosen weights, the rest frozen
    lora_rank: int = setting(0, "LoRA: adapters of this rank on the target weights (--lora-targets), every other "
                             "weight frozen (no gradient, no optimizer state); 0: no LoRA, every weight trains",
                             minimum=0)
    lora_alpha: float = setting(16.0, "LoRA: the adapters' update is scaled by alpha / rank")
    lora_targets: str = setting("q,k,v,o", "LoRA: weights to adapt, comma-separated: q,k,v,o,gate,up,down,head "
                                "or parameter-path regexes (`plan --list-params`), e.g. 'attn/w[qv]'")
    lora_base: str = setting("param", "LoRA: how the frozen base weights are kept: param (the recipe's "
                             "parameter dtype), bfloat16, or int8 (targets quantised per output channel, the rest "
                             "bf16: QLoRA-style)", choices=("param", "bfloat16", "int8"))
    # Data
    data: Optional[str] = setting(None, "text file/folder or .npy/.bin token file (default: the embedded corpus, "
                                  "this Python's standard library)")
    batch_size: int = setting(16, "global batch, in sequences; when not given, rounded up to a multiple of the "
                              "recipe's data-parallel size × micro-batches where it needs one", minimum=1)
    seq_len: int = setting(128, "tokens per sequence (language models only, not vit-*)", minimum=1)
    seed: int = setting(0, "seeds initialisation, data order and dropout", minimum=0)
    val_fraction: float = setting(0.01, "share of the data held out for evaluation (0 < f < 1)")
    # Optimizer: AdamW, linear warmup then cosine decay to lr * min_lr_ratio
    lr: Optional[float] = setting(None, "peak learning rate (AdamW, warmup then cosine) (default: 3e-3 from scratch; "
                                  "1e-4 with --init-from: fine-tuning)")
    min_lr_ratio: float = setting(0.1, "final learning rate as a fraction of --lr")
    warmup_steps: Optional[int] = setting(None, "linear warmup steps (default: 20 from scratch; 1/20 of --steps, at "
                                          "least 1, with --init-from: fine-tuning); a warning when it is more "
                                          "than half the run", minimum=0)
    weight_decay: float = setting(0.1, "AdamW weight decay (matrices only: not norms, not biases)")
    b1: float = setting(0.9, "AdamW beta1")
    b2: float = setting(0.95, "AdamW beta2")
    clip_norm: float = setting(1.0, "global-norm gradient clipping; 0 disables")
    # Loop
    steps: int = setting(250, "train until this step (with --resume: in total)", minimum=1)
    eval_every: int = setting(50, "evaluate every N steps; 0 disables", minimum=0)
    eval_batches: int = setting(4, "batches per evaluation", minimum=0)
    log_every: int = setting(10, "print a progress line every N steps", minimum=0)
    nonfinite: NonFinite = setting(NonFinite.RAISE, "a non-finite loss or gradient stops the run (raise) or "
                                   "skips that update (skip)")
    max_skips: int = setting(5, "with --nonfinite skip: stop after this many skipped updates in a row", minimum=0)
    # Output
    out: Optional[str] = setting(None, "run folder (default: runs/<model>-<recipe>-<time>)")
    ckpt_every: int = setting(0, "save a checkpoint every N steps; 0: off", minimum=0)
    peer_every: int = setting(0, "every N steps also keep each process's shards, and a copy of a peer's, in host "
                              "memory (/dev/shm): a restart after a process failed resumes from there when "
                              "every shard is intact, else from disk; 0: off", minimum=0)
    keep_last: int = setting(3, "keep the newest N checkpoints", minimum=0)
    keep_every: Optional[int] = setting(None, "also keep every K-th step", minimum=1)
    resume: Resume = setting(Resume.NO, "latest (or --resume alone): continue from the newest valid checkpoint "
                             "in --out (a new run if --out holds none; refused if it holds checkpoints of which "
                             "none is valid)", bare=Resume.LATEST)
    progress: Progress = setting(Progress.AUTO, "live bar on a terminal (auto), bar, plain lines, or nothing")
    peak_flops_per_device: Optional[float] = setting(None, "peak FLOP/s per device for MFU (default: known "
                                                     "accelerators; omitted on CPU)", cli=False)  # CLI: --peak-tflops
    hardware: Optional[str] = setting(None, "the chip's profile: h100, h200, a100, b200, tpu-v4, tpu-v5e, tpu-v5p, "
                                      "tpu-v6e, or cpu (measured on this host); train: MFU's peak; plan: the chip the "
                                      "estimates are for (default: this host's, from its device kind)")
    memory_check: MemoryCheckMode = setting(MemoryCheckMode.ON, "refuse to start when the plan's per-device "
                                            "memory exceeds the device's")
    # Model rules (a model you did not write)
    rules: Optional[str] = setting(None, "YAML file of model rules: paths: {REGEX: [logical names]} for parameters "
                                   "without axes, logical: {NAME: mesh axis, list or null} (the Trainer also takes "
                                   "a dict: Trainer(rules=...))")
    # Resilience (meshtrain.train.watchdog)
    hang_timeout: Optional[float] = setting(None, "seconds without a completed step after which the watchdog "
                                            "dumps every thread's stack to <run>/hang-<process>.txt and exits 75 "
                                            "(default, in multi-process or supervised runs: max(300, 10 × the "
                                            "median step time) after 5 steps; the first step, which compiles, "
                                            "always gets at least 1800)")
    straggler_fraction: float = setting(0.2, "report a process whose host time per step exceeds the others' by "
                                        "more than this fraction of the step time (multi-process runs)")

    def __post_init__(self):
        for s in settings_of(TrainConfig):  # enums from their values; a wrong one names the allowed values
            if s.choices:
                try:
                    object.__setattr__(self, s.name, s.coerce(getattr(self, s.name), s.name))
                except RecipeError as exc:
                    raise ConfigError(str(exc)) from None
        for s in settings_of(TrainConfig):  # integer bounds, from the settings' minimum
            value = getattr(self, s.name)
            if s.minimum is not None and value is not None and (
                    not isinstance(value, int) or isinstance(value, bool) or value < s.minimum):
                bound = "a positive integer" if s.minimum == 1 else f"an integer >= {s.minimum}"
                raise ConfigError(f"--{s.flag.replace('_', '-')} {value!r}: must be {bound}")
        if self.lr is not None and (not math.isfinite(self.lr) or self.lr <= 0):
            raise ConfigError(f"--lr {self.lr}: must be a positive finite number, e.g. --lr 3e-4")
        if self.seed >= 2 ** 63:
            raise ConfigError(f"--seed {self.seed}: must be an integer >= 0")
        for name in ("min_lr_ratio", "weight_decay", "clip_norm", "val_fraction"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"--{name.replace('_', '-')} {value}: must be a finite number >= 0")
        check_watchdog_settings(self.hang_timeout, self.straggler_fraction)
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
        from meshtrain.annotate import ModelRules  # lazy: on use, the configuration loads without JAX

        ModelRules.load(self.rules)  # a bad rules file fails here, naming the file and the key
        self.lora_config()  # a bad alpha or target pattern fails here, naming the flag

    def lora_config(self):
        """The run's :class:`~meshtrain.models.lora.LoRAConfig`, or ``None`` when ``lora_rank`` is 0."""
        if not self.lora_rank:
            return None
        from meshtrain.models.lora import LoRAConfig  # lazy: on use, the configuration loads without JAX

        targets = tuple(t.strip() for t in str(self.lora_targets).split(",") if t.strip())
        return LoRAConfig(self.lora_rank, float(self.lora_alpha), targets, self.lora_base)

    @property
    def optimizer_defaults(self) -> OptimizerDefaults:
        """:data:`FINE_TUNING` for a run that starts from ``init_from``'s weights, else :data:`FROM_SCRATCH`."""
        return FINE_TUNING if self.init_from else FROM_SCRATCH

    @property
    def peak_lr(self) -> float:
        """``lr``, or the defaults' when it is not given."""
        return self.lr if self.lr is not None else self.optimizer_defaults.lr

    @property
    def warmup(self) -> int:
        """``warmup_steps``, or the defaults' for ``steps`` when it is not given."""
        return self.warmup_steps if self.warmup_steps is not None else self.optimizer_defaults.warmup(self.steps)

    def schedule_text(self) -> str:
        """The optimizer's schedule in a line, saying which values are defaults (the run's header line)."""
        given = self.lr is not None and self.warmup_steps is not None
        source = "" if given else f" ({self.optimizer_defaults.name} defaults" + (
            ": --init-from" if self.init_from else "") + "; --lr / --warmup-steps change them)"
        return (f"AdamW lr {self.peak_lr:g}, warmup {self.warmup} of {self.steps} steps, cosine to "
                f"{self.peak_lr * self.min_lr_ratio:g}{source}")

    def warmup_warning(self) -> Optional[str]:
        """A warning when the warmup is longer than half the run (the learning rate peaks late or never)."""
        if self.warmup * 2 <= self.steps:
            return None
        return (f"warmup {self.warmup} steps is more than half of --steps {self.steps}: the learning rate peaks "
                f"{'late' if self.warmup < self.steps else 'never (the warmup is cut at the last step)'}; pass "
                f"--warmup-steps {max(1, self.steps // 20)} (1/20 of the run) or more --steps")

    def build_recipe(self) -> Recipe:
        """The run's recipe: ``recipe`` (a name or file) with ``recipe_options`` applied."""
        try:
            return get_recipe(self.recipe).with_options(**dict(self.recipe_options))
        except RecipeError as exc:
            raise ConfigError(str(exc)) from None


def fitted_batch_size(batch_size: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` (a layout's data-parallel size × micro-batches) >= ``batch_size``:
    the default batch as ``meshtrain train`` and ``meshtrain plan`` fit it when ``--batch-size`` is not given,
    e.g. ``fitted_batch_size(16, 32) == 32`` for ``pp_fsdp`` on 8 devices with 8 micro-batches."""
    return -(-batch_size // multiple) * multiple


def check_watchdog_settings(hang_timeout: Optional[float], straggler_fraction: float) -> None:
    """``hang_timeout`` (seconds, or ``None``) and ``straggler_fraction`` as :mod:`meshtrain.train.watchdog`
    needs them."""
    if hang_timeout is not None and not (math.isfinite(hang_timeout) and hang_timeout > 0):
        raise ConfigError(f"--hang-timeout {hang_timeout:g}: give a positive number of seconds, or omit it for "
                          f"the default (max(300 s, 10 × the median step time))")
    if not (math.isfinite(straggler_fraction) and straggler_fraction > 0):
        raise ConfigError(f"--straggler-fraction {straggler_fraction:g}: give a positive fraction of the step "
                          f"time, e.g. 0.2")


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
    import optax

    warmup = min(cfg.warmup, max(cfg.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(0.0, cfg.peak_lr, warmup, max(cfg.steps, warmup + 1),
                                              end_value=cfg.peak_lr * cfg.min_lr_ratio)


class AdamVariance(str, enum.Enum):
    """Adam's second moment in :func:`default_optimizer`: ``learnt`` every step (AdamW), or ``freezes`` when
    ``grad_compression: onebit`` starts compressing (1-bit Adam)."""

    LEARNT = "learnt"
    FREEZES = "freezes"


def default_optimizer(cfg: TrainConfig, param_axes: Dict[str, LogicalAxes],
                      variance: AdamVariance = AdamVariance.LEARNT) -> optax.GradientTransformation:
    """AdamW (warmup + cosine) with global-norm clipping; weight decay only on matrices (parameters
    with two or more logical axes besides ``layers``: not norms, not biases).

    ``variance``: :attr:`AdamVariance.FREEZES` for ``grad_compression: onebit`` (1-bit Adam: the same optimizer
    until the compressed steps start, then its variance freezes; :mod:`meshtrain.parallel.onebit_adam`);
    default :attr:`AdamVariance.LEARNT` (optax's AdamW)."""
    import optax

    from meshtrain.abstract import tree_paths  # lazy: the optimizer's helpers load JAX: the configuration loads without it

    def decay_mask(params):
        return {} if not params else _mask(tree_paths(params))

    def _mask(paths):
        import jax

        return jax.tree.map(lambda p: len([a for a in param_axes.get(p, ()) if a != "layers"]) >= 2, paths)

    if variance is AdamVariance.FREEZES:
        from meshtrain.parallel.onebit_adam import onebit_adamw  # lazy: it loads JAX, as optax does

        return onebit_adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask,
                            clip_norm=cfg.clip_norm)
    adamw = optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw) if cfg.clip_norm > 0 else adamw
