"""Settings defined once: a dataclass field with its type hint, default and help text is the only
place a recipe knob or a dimension option is written down. CLI flags (with ``choices`` and the default
in ``--help``), YAML keys and their checks, and the summaries are all derived from it here::

    @dataclasses.dataclass(frozen=True)
    class Context(Strategy):
        load_balance: LoadBalance = setting(LoadBalance.ZIGZAG, "order of the sequence chunks over the ring")

An ``enum`` type gives the allowed values; ``int`` fields take ``minimum``; ``bool`` fields are
``true``/``false`` in YAML and ``on``/``off`` on the command line.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from typing import Any, Dict, Optional, Tuple

from meshtrain.errors import RecipeError


def setting(default: Any, help: str, *, flag: Optional[str] = None, minimum: Optional[int] = None,
            choices: Optional[Tuple[str, ...]] = None, cli: bool = True, bare: Any = None) -> Any:
    """A dataclass field that is a user-facing setting: ``help`` is its ``--help`` text, ``flag`` its CLI
    name when the field name alone is ambiguous (default: the field name), ``minimum`` the least value of
    an ``int``, ``choices`` the values of a plain ``str``, ``cli=False`` keeps it out of the command line
    (YAML / Python only, or a flag written by hand for a reason given there), ``bare`` the value of the
    flag given without one (``--resume`` alone means ``--resume latest``)."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "minimum": minimum,
                                                        "choices": choices, "cli": cli, "bare": bare})


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting of a dataclass, as read from its field."""

    name: str
    type: Any
    default: Any
    help: str
    flag: str
    minimum: Optional[int]
    allowed: Optional[Tuple[str, ...]]
    cli: bool
    bare: Any = None

    # cached on the instance (a Setting is immutable): the planner coerces settings ~10^5 times a search
    @functools.cached_property
    def base_type(self) -> Any:
        """The type without ``Optional[...]``."""
        args = [a for a in typing.get_args(self.type) if a is not type(None)]
        return args[0] if typing.get_origin(self.type) is typing.Union and len(args) == 1 else self.type

    @functools.cached_property
    def optional(self) -> bool:
        return self.base_type is not self.type

    @property
    def choices(self) -> Optional[Tuple[str, ...]]:
        return tuple(e.value for e in self.base_type) if _is_enum(self.base_type) else self.allowed

    @functools.cached_property
    def names_list(self) -> bool:
        """Whether the setting is a tuple of names (``Tuple[str, ...]``): a list in YAML, comma-separated text
        on the command line (``--replicate-indivisible kv_heads,heads``)."""
        return typing.get_origin(self.base_type) is tuple

    def plain(self, value: Any) -> Any:
        """``value`` as YAML / JSON writes it (an enum's value, a list for a tuple of names)."""
        if isinstance(value, tuple):
            return list(value)
        return value.value if isinstance(value, enum.Enum) else value

    def coerce(self, value: Any, where: str) -> Any:
        """``value`` checked against the field's type (an enum member for an enum field); anything else
        raises :class:`RecipeError` naming ``where`` (the key path) and what it accepts."""
        kind = self.base_type
        if value is None and self.optional:
            return None
        if self.names_list:
            if isinstance(value, str):  # the command line's comma-separated form
                value = [part.strip() for part in value.split(",") if part.strip()]
            if not isinstance(value, (list, tuple)):  # (each name is its owner's to check: a did-you-mean)
                raise RecipeError(f"{where}={value!r}: use a list of names, e.g. [kv_heads, heads] (on the command "
                                  f"line: kv_heads,heads)")
            return tuple(value)
        if _is_enum(kind):
            try:
                return kind(value)
            except ValueError:
                raise RecipeError(f"{where}={value!r}: use one of {list(self.choices)}") from None
        if self.allowed is not None:
            if value not in self.allowed:
                raise RecipeError(f"{where}={value!r}: use one of {list(self.allowed)}")
            return value
        if kind is bool:
            if not isinstance(value, bool):
                raise RecipeError(f"{where}={value!r}: use true or false")
            return value
        if kind is int:
            if not isinstance(value, int) or isinstance(value, bool) or (
                    self.minimum is not None and value < self.minimum):
                raise RecipeError(f"{where}={value!r}: use an integer >= {self.minimum if self.minimum is not None else 0}")
            return value
        if kind is float:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise RecipeError(f"{where}={value!r}: use a number, e.g. {self.default}")
            return float(value)
        return value


def _is_enum(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, enum.Enum)


@functools.lru_cache(maxsize=None)
def settings_of(cls: type) -> Tuple[Setting, ...]:
    """The settings (fields made with :func:`setting`) of dataclass ``cls``, in field order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        out.append(Setting(f.name, hints[f.name], f.default, f.metadata["help"], f.metadata["flag"] or f.name,
                           f.metadata["minimum"], f.metadata["choices"], f.metadata["cli"], f.metadata.get("bare")))
    return tuple(out)


def setting_named(cls: type, name: str) -> Optional[Setting]:
    return next((s for s in settings_of(cls) if s.name == name), None)


def coerce_all(obj: Any, where: str) -> None:
    """Check and normalise every setting of frozen dataclass ``obj`` in place (``__post_init__``)."""
    for s in settings_of(type(obj)):
        path = s.name if not where else f"{where} {s.name}" if where.endswith(":") else f"{where}.{s.name}"
        object.__setattr__(obj, s.name, s.coerce(getattr(obj, s.name), path))


def non_defaults(obj: Any) -> Dict[str, Any]:
    """``{name: plain value}`` of the settings of ``obj`` that differ from their defaults."""
    return {s.name: s.plain(getattr(obj, s.name)) for s in settings_of(type(obj)) if getattr(obj, s.name) != s.default}


def plain_settings(obj: Any, skip: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """``{name: plain value}`` of every setting of ``obj`` (JSON-ready), but those in ``skip``."""
    return {s.name: s.plain(getattr(obj, s.name)) for s in settings_of(type(obj)) if s.name not in skip}


def from_mapping(cls: type, data: Any, where: str, **fixed: Any) -> Any:
    """``cls(**data)`` with every key checked: an unknown key or a wrong type raises :class:`RecipeError`
    naming the key path ``where.key`` and the allowed keys / values."""
    if data is None:
        data = {}
    if not isinstance(data, typing.Mapping):
        raise RecipeError(f"{where} must be a mapping of options {[s.name for s in settings_of(cls)]}; got {data!r}")
    known = {s.name: s for s in settings_of(cls)}
    unknown = sorted(set(data) - set(known), key=str)
    if unknown:
        raise RecipeError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
    return cls(**{k: known[k].coerce(v, f"{where}.{k}") for k, v in data.items()}, **fixed)


def add_flags(parser, settings, *, owner: Optional[str] = None) -> None:
    """One ``--flag`` per CLI setting, ``choices`` from its enum, the default in the help text; every
    flag defaults to ``None`` (= keep the default: take only the flags given, :func:`given_flags`).
    ``owner`` says whose default it is (e.g. "the recipe's"); ``None``: the setting's own default."""
    for s in settings:
        if not s.cli:
            continue
        kind = s.base_type
        shown = ("on" if s.default else "off") if kind is bool else s.plain(s.default)
        default_text = f"default: {shown}" if owner is None else f"default: {owner}; built-in default {shown}"
        if s.default is None and owner is None:
            default_text = ""  # the help text says what leaving it out does
        kwargs: Dict[str, Any] = {"default": None, "dest": s.flag,
                                  "help": f"{s.help} ({default_text})" if default_text else s.help}
        if s.choices:
            kwargs.update(choices=s.choices, type=type(s.choices[0]))
        elif kind is bool:
            kwargs.update(choices=("on", "off"))
        elif kind in (int, float):
            kwargs["type"] = kind
        elif s.names_list:
            kwargs["metavar"] = "NAMES"
        if s.bare is not None:
            kwargs.update(nargs="?", const=s.plain(s.bare))
        parser.add_argument("--" + s.flag.replace("_", "-"), **kwargs)


def given_flags(args, settings) -> Dict[str, Any]:
    """``{field name: value}`` of the CLI settings whose flags were given (not ``None``)."""
    out: Dict[str, Any] = {}
    for s in settings:
        value = getattr(args, s.flag, None) if s.cli else None
        if value is not None:
            out[s.name] = flag_value(s, value)
    return out


def flag_value(s: Setting, value: Any) -> Any:
    """A parsed flag's value in the setting's type (``on``/``off`` for a bool)."""
    return {"on": True, "off": False}[value] if s.base_type is bool else value
