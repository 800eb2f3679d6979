"""The run configuration: one nested, typed, frozen value shared by ``plan``, ``train``, ``generate`` and
``launch`` (and printed by ``meshtrain config show``). Each section groups settings by what they are about::

    model:        name, init_from, rules
    data:         path, batch_size, seq_len, seed, val_fraction
    recipe:       name, mesh, options (the recipe's knobs and dimension options, typed: remat, grad_accum, ...)
    optimizer:    lr, min_lr_ratio, warmup_steps, weight_decay, b1, b2, clip_norm (AdamW, warmup + cosine)
    loop:         steps, eval_every, eval_batches, log_every, nonfinite, max_skips
    checkpoint:   out, ckpt_every, peer_every, keep_last, keep_every, resume
    monitor:      progress, hardware, peak_flops_per_device, memory_check, hang_timeout, straggler_fraction
    distributed:  devices, dcn
    generation:   max_new_tokens, temperature, top_k, top_p, seed, stop_ids, quantize, weight_memory, recipe, mesh
    serve:        host, port, max_batch, max_queue, request_timeout, context, model_name (``meshtrain serve``;
                  its recipe, mesh and weight format are generation's)

Every setting is defined once: the training sections reuse :class:`~meshtrain.train.config.TrainConfig`'s
fields (help text, default, type, flag name), the recipe options the recipe's own settings
(:func:`meshtrain.recipes.recipe_settings`), so the flags, the YAML keys and their checks cannot drift.
A YAML file holds any subset, by section::

    optimizer: {lr: 1.0e-4}
    recipe: {name: fsdp_tp, options: {remat: full}}

Dotted keys name one setting (``optimizer.lr``, ``recipe.options.remat``): ``RunConfig().with_values(
{"optimizer.lr": "1e-4"})`` (text is parsed by the setting's type). An unknown key or a bad value raises
:class:`~meshtrain.errors.ConfigError` naming the dotted key and what it accepts.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Dict, Mapping, Optional, Tuple

import yaml

from meshtrain.errors import ConfigError, RecipeError
from meshtrain.recipes import AttentionKind, dimension_settings, recipe_settings
from meshtrain.settings import Setting, setting, settings_of
from meshtrain.train.config import TrainConfig

#: The training sections: ``(section, ((key, TrainConfig field), ...))``; a bare name is both.
TRAIN_SECTIONS: Tuple[Tuple[str, Tuple[Any, ...]], ...] = (
    ("model", (("name", "model"), "init_from", "rules", "lora_rank", "lora_alpha", "lora_targets", "lora_base")),
    ("data", (("path", "data"), "batch_size", "seq_len", "seed", "val_fraction")),
    ("recipe", (("name", "recipe"), "mesh")),
    ("optimizer", ("lr", "min_lr_ratio", "warmup_steps", "weight_decay", "b1", "b2", "clip_norm")),
    ("loop", ("steps", "eval_every", "eval_batches", "log_every", "nonfinite", "max_skips")),
    ("checkpoint", ("out", "ckpt_every", "peer_every", "keep_last", "keep_every", "resume")),
    ("monitor", ("progress", "hardware", "peak_flops_per_device", "memory_check", "hang_timeout",
                 "straggler_fraction")),
    ("distributed", ("devices", "dcn")),
)


def _section_class(section: str, keys: Tuple[Any, ...]) -> type:
    """A frozen dataclass whose fields are ``TrainConfig``'s (same default, type, help and flag)."""
    hints = typing.get_type_hints(TrainConfig)
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    spec = []
    for key in keys:
        key, source = key if isinstance(key, tuple) else (key, key)
        f = fields[source]
        metadata = dict(f.metadata, flag=f.metadata["flag"] or source)  # `model.name` keeps --model
        spec.append((key, hints[source], dataclasses.field(default=f.default, metadata=metadata)))
    cls = dataclasses.make_dataclass(f"{section.title()}Section", spec, frozen=True)
    cls.__module__ = __name__
    cls.__doc__ = f"The ``{section}:`` section: {', '.join(name for name, _, _ in spec)} (TrainConfig's settings)."
    return cls


ModelSection, DataSection, RecipeBase, OptimizerSection, LoopSection, CheckpointSection, MonitorSection, \
    DistributedSection = (_section_class(name, keys) for name, keys in TRAIN_SECTIONS)


def _option_settings() -> Tuple[Setting, ...]:
    """The recipe overrides a run may give, by :meth:`~meshtrain.Recipe.with_options` name."""
    out, seen = [], set()
    for s in list(recipe_settings()) + [s for _, s in dimension_settings()]:
        if s.cli and s.flag not in seen:
            seen.add(s.flag)
            out.append(s)
    return tuple(out)


def _options_class() -> type:
    """Every recipe knob and dimension option as an optional field (``None``: the recipe's own value),
    plus the two older shortcuts ``attention`` and ``micro_batches``."""
    spec = [(s.flag, Optional[s.base_type], dataclasses.field(
        default=None, metadata={"help": s.help, "flag": s.flag, "minimum": s.minimum, "choices": s.allowed,
                                "cli": True, "bare": None})) for s in _option_settings()]
    spec.append(("attention", Optional[AttentionKind], setting(None, "shortcut: a context kind or dense/flash")))
    spec.append(("micro_batches", Optional[int], setting(None, "shortcut: pipeline micro-batches or grad_accum",
                                                         minimum=1)))
    cls = dataclasses.make_dataclass("RecipeOptions", spec, frozen=True)
    cls.__module__ = __name__
    cls.__doc__ = "The recipe's knobs and dimension options to override (``None``: the recipe's own)."
    return cls


RecipeOptions = _options_class()


@dataclasses.dataclass(frozen=True)
class RecipeSection(RecipeBase):
    """The ``recipe:`` section: which recipe, its mesh sizes and typed overrides of its options, e.g.
    ``recipe: {name: fsdp_tp, mesh: "fsdp=4,tensor=2", options: {remat: full}}``."""

    options: RecipeOptions = dataclasses.field(default_factory=RecipeOptions)

    def overrides(self) -> Dict[str, Any]:
        """The options given, by :meth:`~meshtrain.Recipe.with_options` name (plain values)."""
        return {s.name: s.plain(getattr(self.options, s.name)) for s in settings_of(RecipeOptions)
                if getattr(self.options, s.name) is not None}


@dataclasses.dataclass(frozen=True)
class GenerationSection:
    """The ``generation:`` section (``meshtrain generate``): how many tokens, how they are picked, how
    the weights are held, and the recipe to generate under, e.g. ``generation: {max_new_tokens: 32,
    temperature: 0.8, top_p: 0.9}``."""

    max_new_tokens: Optional[int] = setting(None, "tokens to generate per prompt (0: only score the prompts, with "
                                            "--prompt-logprobs); required", minimum=0)
    temperature: float = setting(0.0, "0: greedy; > 0: sample")
    top_k: int = setting(0, "sample among the k most likely tokens (0: off)", minimum=0)
    top_p: float = setting(1.0, "sample from the smallest set of tokens whose probability reaches p (1: off)")
    seed: int = setting(0, "seeds the sampling", minimum=0)
    stop_ids: Optional[str] = setting(None, "comma-separated token ids that end a prompt's generation (the stop "
                                      "token is kept in the output); default: the run's end-of-sequence ids (its "
                                      "tokenizer's eos, generation_config.json's eos_token_id); none: no stop")
    # The values of meshtrain.generation.weights' WeightFormat and WeightMemory (a test keeps them equal):
    # `generation` imports `train`, so `train` names them without importing it.
    quantize: str = setting("none", "store the weights as restored (none), in bf16, or int8 weight-only "
                            "(per-channel scales)", choices=("none", "bf16", "int8"))
    weight_memory: str = setting("device", "device, or host: layer weights in pinned host memory, copied in per "
                                 "layer", choices=("device", "host"), cli=False)  # CLI: --offload-weights
    recipe: Optional[str] = setting(None, "recipe to generate under (default: the run's, or fsdp when the run's has "
                                    "a pipeline)")
    mesh: Optional[str] = setting(None, "mesh size overrides, e.g. fsdp=4,tensor=2 (default: the recipe's)")


@dataclasses.dataclass(frozen=True)
class ServeSection:
    """The ``serve:`` section (``meshtrain serve``): where it listens, how many requests decode together and
    how many may wait, e.g. ``serve: {port: 8000, max_batch: 16}``. The recipe, mesh and weight format are
    the ``generation:`` section's."""

    host: str = setting("127.0.0.1", "address to listen on (127.0.0.1: this machine only; 0.0.0.0: every "
                        "interface)")
    port: int = setting(8000, "TCP port (0: any free port; the line 'serving ... at http://HOST:PORT' names it)",
                        minimum=0)
    max_batch: int = setting(8, "KV-cache slots: requests decoded together (rounded up to a multiple of the "
                             "recipe's data-parallel size)", minimum=1)
    max_queue: int = setting(32, "requests that may wait for a slot; past it a request gets 429 with Retry-After",
                             minimum=0)
    request_timeout: float = setting(300.0, "seconds a request may wait and run before it ends with 504 (a "
                                     "stream: an error event)")
    context: Optional[int] = setting(None, "tokens per slot, prompt and completion together (default: the "
                                     "model's max_seq_len)", minimum=1)
    model_name: Optional[str] = setting(None, "the model id clients send (default: the run folder's name)")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A whole run, by section; every field has a default: ``RunConfig()`` is ``meshtrain train``'s main job.
    Build one from YAML / dotted keys (:meth:`from_dict`, :meth:`with_values`), turn it into the Trainer's
    :class:`TrainConfig` (:meth:`train_config`), print it (:meth:`to_yaml`)::

        cfg = RunConfig().with_values({"model.name": "tiny", "loop.steps": 20, "recipe.options.remat": "full"})
        Trainer(cfg.train_config()).run()
    """

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    recipe: RecipeSection = dataclasses.field(default_factory=RecipeSection)
    optimizer: OptimizerSection = dataclasses.field(default_factory=OptimizerSection)
    loop: LoopSection = dataclasses.field(default_factory=LoopSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    monitor: MonitorSection = dataclasses.field(default_factory=MonitorSection)
    distributed: DistributedSection = dataclasses.field(default_factory=DistributedSection)
    generation: GenerationSection = dataclasses.field(default_factory=GenerationSection)
    serve: ServeSection = dataclasses.field(default_factory=ServeSection)

    # -- reading --------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any, where: str = "the configuration") -> "RunConfig":
        """A RunConfig from a nested mapping (a YAML file's content), keys checked."""
        return cls().with_values(flatten(data, where))

    @classmethod
    def from_yaml_file(cls, path: str) -> "RunConfig":
        return cls.from_dict(read_yaml(path), where=path)

    def with_values(self, values: Mapping[str, Any], *, unchecked: typing.Collection[str] = ()) -> "RunConfig":
        """A copy with dotted keys replaced; a ``str`` value is parsed by the setting's type (``--set``).
        Keys in ``unchecked`` (flags, typed by argparse) keep an out-of-range value for the command's own
        check, which names the flag (``--steps 0: ...``)."""
        sections = {name: {} for name in SECTIONS}
        for key, value in values.items():
            s = setting_at(key)
            path = key.split(".")
            try:
                value = _coerce(s, value, key)
            except ConfigError:
                if key not in unchecked:
                    raise
            sections[path[0]][".".join(path[1:])] = value
        changed = {}
        for name, updates in sections.items():
            if not updates:
                continue
            section = getattr(self, name)
            options = {k.split(".", 1)[1]: v for k, v in updates.items() if k.startswith("options.")}
            own = {k: v for k, v in updates.items() if not k.startswith("options.")}
            if options:
                own["options"] = dataclasses.replace(section.options, **options)
            changed[name] = dataclasses.replace(section, **own)
        return dataclasses.replace(self, **changed)

    # -- writing --------------------------------------------------------------------------------
    def to_dict(self, only: Optional[typing.Collection[str]] = None) -> Dict[str, Dict[str, Any]]:
        """Nested plain values (YAML / JSON ready); ``only``: just these dotted keys (and the sections
        holding them). Recipe options left to the recipe (``None``) are left out."""
        out: Dict[str, Dict[str, Any]] = {}
        for key, value in self.values().items():
            if only is not None and key not in only:
                continue
            if value is None and key.startswith("recipe.options."):
                continue
            node = out
            *parents, leaf = key.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        return out

    def to_yaml(self, only: Optional[typing.Collection[str]] = None) -> str:
        return yaml.safe_dump(self.to_dict(only), sort_keys=False, default_flow_style=False)

    def values(self) -> Dict[str, Any]:
        """``{dotted key: plain value}`` of every setting."""
        out = {}
        for key in all_keys():
            value = self
            for part in key.split("."):
                value = getattr(value, part)
            out[key] = setting_at(key).plain(value)
        return out

    def differences(self, other: "RunConfig") -> Dict[str, Tuple[Any, Any]]:
        mine, theirs = self.values(), other.values()
        return {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}

    # -- the Trainer's view ---------------------------------------------------------------------
    def train_config(self) -> TrainConfig:
        """The Trainer's flat :class:`TrainConfig` (it checks the values against each other)."""
        values = {}
        for section, keys in TRAIN_SECTIONS:
            for key in keys:
                key, source = key if isinstance(key, tuple) else (key, key)
                values[source] = getattr(getattr(self, section), key)
        values["recipe_options"] = tuple(self.recipe.overrides().items())
        return TrainConfig(**values)

    @classmethod
    def from_train_config(cls, cfg: TrainConfig) -> "RunConfig":
        """The RunConfig of ``cfg`` (the run header records this); generation keeps its defaults."""
        values = {}
        for section, keys in TRAIN_SECTIONS:
            for key in keys:
                key, source = key if isinstance(key, tuple) else (key, key)
                values[f"{section}.{key}"] = getattr(cfg, source)
        for name, value in cfg.recipe_options:
            values[f"recipe.options.{name}"] = value
        return cls().with_values(values)


SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))


@functools.lru_cache(maxsize=None)
def _keyed_settings() -> Dict[str, Setting]:
    out = {}
    for f in dataclasses.fields(RunConfig):
        cls = f.default_factory
        for s in settings_of(cls):
            out[f"{f.name}.{s.name}"] = s
        if cls is RecipeSection:
            out.update({f"recipe.options.{s.name}": s for s in settings_of(RecipeOptions)})
    return out


def all_keys() -> Tuple[str, ...]:
    """Every dotted key, in section order."""
    return tuple(_keyed_settings())


def setting_at(key: str) -> Setting:
    """The setting of dotted ``key``; ConfigError naming the keys that exist there."""
    found = _keyed_settings().get(key)
    if found is not None:
        return found
    head = key.rsplit(".", 1)[0] if "." in key else ""
    siblings = sorted(k.rsplit(".", 1)[1] for k in _keyed_settings() if k.rsplit(".", 1)[0] == head)
    if siblings:
        raise ConfigError(f"unknown setting {key!r}; {head} has: {', '.join(siblings)}")
    raise ConfigError(f"unknown setting {key!r}: give section.key with a section among {', '.join(SECTIONS)} "
                      f"(`meshtrain config show` prints every key)")


def _coerce(s: Setting, value: Any, key: str) -> Any:
    """``value`` in the setting's type (text parsed as ``--set`` gives it); ConfigError names ``key``."""
    if isinstance(value, str):
        value = _from_text(s, value)
    elif s.base_type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if s.base_type is str and value is not None and not isinstance(value, str):
        raise ConfigError(f"{key}={value!r}: use a string" + (f", e.g. {s.default!r}" if s.default else ""))
    try:
        return s.coerce(value, key)
    except RecipeError as exc:   # its message names the key and what it accepts
        raise ConfigError(str(exc)) from None


def _from_text(s: Setting, text: str) -> Any:
    """A ``--set`` / YAML string as the setting's type; left as text when it does not parse (coerce
    then names the key and the type)."""
    kind = s.base_type
    if s.optional and text.strip().lower() in ("null", "none", "~", "") and text not in (s.choices or ()):
        return None   # (`none` is a value where the setting has it: load_balance, remat, ...)
    try:
        if kind is bool:
            return {"true": True, "on": True, "yes": True, "false": False, "off": False, "no": False}[text.lower()]
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except (KeyError, ValueError):
        return text   # coerce names the key and the type
    return text


def flatten(data: Any, where: str) -> Dict[str, Any]:
    """``{dotted key: value}`` of a nested mapping (sections, recipe options); ConfigError for a
    section that is not a mapping."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: give a mapping of sections ({', '.join(SECTIONS)}); got {data!r}")
    out: Dict[str, Any] = {}
    for name, body in data.items():
        if name not in SECTIONS:
            raise ConfigError(f"{where}: unknown section {name!r}; sections: {', '.join(SECTIONS)}")
        if body is None:
            continue
        if not isinstance(body, Mapping):
            raise ConfigError(f"{where}: section {name!r} must be a mapping of settings; got {body!r}")
        for key, value in body.items():
            if name == "recipe" and key == "options":
                if not isinstance(value, Mapping):
                    raise ConfigError(f"{where}: recipe.options must be a mapping, e.g. {{remat: full}}; got {value!r}")
                out.update({f"recipe.options.{k}": v for k, v in value.items()})
            else:
                out[f"{name}.{key}"] = value
    return out


def read_yaml(path: str) -> Any:
    """The content of YAML file ``path``; ConfigError when it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"--config {path!r}: cannot read it ({exc.strerror or exc}); give a YAML file such as "
                          f"`meshtrain config show` prints") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path!r}: not valid YAML ({str(exc).splitlines()[0]})") from None


#: The run configuration a training run records in its folder: ``--config <run>/config.yaml`` reruns it.
CONFIG_FILE = "config.yaml"


def recorded(cfg: TrainConfig) -> Dict[str, Dict[str, Any]]:
    """The training sections of ``cfg``'s RunConfig (what the run header and ``config.yaml`` hold)."""
    return {k: v for k, v in RunConfig.from_train_config(cfg).to_dict().items() if k not in ("generation", "serve")}


def write_record(run_dir: str, cfg: TrainConfig) -> str:
    """Write ``<run_dir>/config.yaml`` (the run's resolved configuration); its path."""
    import os

    path = os.path.join(run_dir, CONFIG_FILE)
    text = ("# meshtrain run configuration (resolved); rerun with: meshtrain train --config " + path
            + " --out NEW_FOLDER\n" + yaml.safe_dump(recorded(cfg), sort_keys=False, default_flow_style=False))
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
