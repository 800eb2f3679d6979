"""YAML files as users write them: UTF-8 text, no key given twice in one mapping, and a one-line error naming the
file and the line for anything else. The recipe loader, rules files and run configurations read through
:func:`load_yaml`. Example: ``load_yaml("recipes/my.yaml", what="recipe file")``."""

from __future__ import annotations

from typing import Any, Dict

from meshtrain.errors import RecipeError


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


def load_yaml(path: str, *, what: str, error: type = RecipeError) -> Any:
    """The YAML document in ``path``: UTF-8 text, no key given twice in one mapping; anything else raises
    ``error`` (:class:`RecipeError`) naming the file (``what`` says what it is, e.g. ``"recipe file"``)."""
    import yaml

    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path!r} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                    f"{exc.start}); save it as UTF-8 YAML") from None
    except OSError as exc:
        raise error(f"{what} {path!r} cannot be read: {exc.strerror or exc}") from None
    try:
        return yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as dup:
        raise error(f"{what} {path!r}: key {dup.key!r} is given twice in one mapping (lines {dup.first_line} "
                    f"and {dup.second_line}); keep one") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise error(f"{what} {path!r} is not valid YAML: {problem}{where}") from None
