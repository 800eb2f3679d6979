"""The run configuration on the command line (``plan``, ``train``, ``generate``, ``launch``, ``config show``):
``--config FILE.yaml``, repeatable ``--set section.key=VALUE``, and one flag per setting a command uses,
generated from :mod:`meshtrain.run_config` (so a flag has the same name, help and default everywhere).

Precedence: the defaults < the ``--config`` file < the flags and ``--set`` given (``--set`` last)::

    meshtrain train --config run.yaml --set optimizer.lr=1e-4 --steps 50
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Dict, FrozenSet, Iterable, Optional, Tuple

from meshtrain.commands.recipe_flags import add_recipe_flags, recipe_overrides
from meshtrain.errors import ConfigError
from meshtrain.train.run_config import TRAIN_SECTIONS, RecipeOptions, RunConfig, flatten, read_yaml, setting_at
from meshtrain.settings import add_flags, flag_value, settings_of

#: Settings whose flag is written by hand elsewhere: ``--devices`` (commands.common, every command
#: that starts devices), ``--peak-tflops`` (a unit: TFLOP/s), ``--offload-weights`` (generate).
_HAND_WRITTEN = ("distributed.devices", "monitor.peak_flops_per_device", "generation.weight_memory")


def train_keys() -> Tuple[str, ...]:
    """The dotted keys of ``meshtrain train`` (every training section, recipe options aside)."""
    return tuple(f"{section}.{k[0] if isinstance(k, tuple) else k}" for section, keys in TRAIN_SECTIONS for k in keys)


def add_config_args(parser) -> None:
    """``--config`` and ``--set``, for every command that takes a run configuration."""
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="run configuration (YAML, by section: `meshtrain config show` prints one; a run "
                             "folder's config.yaml reproduces that run); flags and --set given override it")
    parser.add_argument("--set", dest="set_values", action="append", default=None, metavar="SECTION.KEY=VALUE",
                        help="override one setting by its dotted key, e.g. --set optimizer.lr=1e-4 (repeatable; "
                             "applied after the other flags)")


class _Recorded(argparse._StoreAction):
    """A generated flag that notes it was given (``args.given_flags``): its namespace default is then the
    setting's own value, not ``None``, and a flag given with the default value still beats ``--config``."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        namespace.given_flags = frozenset(getattr(namespace, "given_flags", None) or ()) | {self.dest}


def add_run_flags(parser, keys: Iterable[str], *, recipe_options: bool = False, with_defaults: bool = False) -> None:
    """One flag per dotted key (from its setting), ``--config``/``--set``, and with ``recipe_options``
    the recipe's flags (:mod:`~meshtrain.commands.recipe_flags`). ``with_defaults``: the parsed
    namespace holds each setting's default (as its flag writes it) when the flag is not given, for code
    that reads ``args`` directly (``meshtrain plan``); :func:`resolve` still knows which were given."""
    keys = tuple(keys)
    options = {k.rsplit(".", 1)[1] for k in keys if k.startswith("recipe.options.")}  # generate's few
    settings = [setting_at(k) for k in keys if k not in _HAND_WRITTEN and not k.startswith("recipe.options.")]
    before = len(parser._actions)
    add_flags(parser, settings)
    if with_defaults:
        for action in parser._actions[before:]:
            action.__class__ = _Recorded
        parser.set_defaults(given_flags=frozenset(), **{s.flag: to_flag(s, s.default) for s in settings if s.cli})
    if recipe_options or options:
        add_recipe_flags(parser, None if recipe_options else options)
    add_config_args(parser)


def to_flag(s, value: Any) -> Any:
    """A setting's value as its flag writes it (``on``/``off`` for a bool, an enum's value)."""
    if isinstance(value, bool) and s.base_type is bool:
        return "on" if value else "off"
    return s.plain(value)


def add_peak_tflops(parser) -> None:
    """``--peak-tflops``: ``monitor.peak_flops_per_device`` in TFLOP/s (the unit people quote)."""
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak TFLOP/s per device for MFU (default: known accelerators; omitted on CPU)")


@dataclasses.dataclass(frozen=True)
class Resolved:
    """The resolved configuration and the dotted keys that were given (file, flags or ``--set``)."""

    config: RunConfig
    given: FrozenSet[str]

    def given_here(self, key: str) -> bool:
        return key in self.given


def given_flag_values(args, keys: Iterable[str], *, recipe_options: bool = False) -> Dict[str, Any]:
    """``{dotted key: value}`` of the flags given on the command line (``None``: not given)."""
    out: Dict[str, Any] = {}
    for key in keys:
        s = setting_at(key)
        value = getattr(args, s.flag, None) if s.cli and key not in _HAND_WRITTEN else None
        recorded = getattr(args, "given_flags", None)
        if recorded is not None and s.flag not in recorded:
            continue  # the namespace's default (add_run_flags(with_defaults=True)), not a given flag
        if value is not None:
            out[key] = flag_value(s, value)
    if getattr(args, "devices", None) is not None and "distributed.devices" in keys:
        out["distributed.devices"] = args.devices
    if getattr(args, "peak_tflops", None) is not None and "monitor.peak_flops_per_device" in keys:
        out["monitor.peak_flops_per_device"] = args.peak_tflops * 1e12
    if getattr(args, "weight_memory", None) is not None and "generation.weight_memory" in keys:
        out["generation.weight_memory"] = args.weight_memory   # generate --offload-weights
    if recipe_options:
        out.update({f"recipe.options.{k}": v for k, v in recipe_overrides(args).items()})
    return out


def parse_set(items: Optional[Iterable[str]]) -> Dict[str, str]:
    """``--set KEY=VALUE`` items as ``{KEY: VALUE text}``; ConfigError for one without ``=``."""
    out: Dict[str, str] = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--set {item!r}: give section.key=value, e.g. --set optimizer.lr=1e-4")
        setting_at(key.strip())  # an unknown key is named before anything else
        out[key.strip()] = value
    return out


def resolve(args, keys: Iterable[str], *, recipe_options: bool = False,
            base: Optional[RunConfig] = None) -> Resolved:
    """The run configuration of ``args``: ``base`` (default: the defaults) < ``--config`` < flags < ``--set``."""
    keys = tuple(keys)
    layers: Dict[str, Any] = {}
    path = getattr(args, "config", None)
    if path:
        layers.update(flatten(read_yaml(path), path))
    flags = given_flag_values(args, keys, recipe_options=recipe_options)
    layers.update(flags)
    sets = parse_set(getattr(args, "set_values", None))
    layers.update(sets)
    config = (base or RunConfig()).with_values(layers, unchecked=set(flags) - set(sets))
    return Resolved(config, frozenset(layers))


def write_back(args, resolved: Resolved, keys: Iterable[str]) -> None:
    """Put resolved values where code that reads ``args`` finds them (``meshtrain plan``): each of
    ``keys`` (as its flag writes it) and the recipe options given (as the recipe flags)."""
    cfg = resolved.config
    for key in keys:
        s = setting_at(key)
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        setattr(args, "devices" if key == "distributed.devices" else s.flag, to_flag(s, value))
    for s in settings_of(RecipeOptions):
        value = getattr(cfg.recipe.options, s.name)
        if value is not None:
            setattr(args, s.flag, to_flag(s, value))


def preparer(keys: Iterable[str], *, recipe_options: bool = False):
    """``args.prepare`` for :func:`meshtrain.cli.main`: resolves the configuration before the devices
    start, so that a ``--config`` file's ``distributed.devices`` and ``monitor.hang_timeout`` take effect
    (a bad file or ``--set`` is refused before anything starts). The result is ``args.resolved``."""
    keys = tuple(keys)

    def prepare(args) -> None:
        args.resolved = resolve(args, keys, recipe_options=recipe_options)
        cfg = args.resolved.config
        args.devices = cfg.distributed.devices
        if "monitor.hang_timeout" in keys:
            args.hang_timeout = cfg.monitor.hang_timeout

    return prepare


def resolved_of(args, keys: Iterable[str], *, recipe_options: bool = False) -> Resolved:
    """``args.resolved`` when :func:`preparer` ran (the CLI), else resolved now (a test's parsed args)."""
    found = getattr(args, "resolved", None)
    return found if found is not None else resolve(args, keys, recipe_options=recipe_options)
