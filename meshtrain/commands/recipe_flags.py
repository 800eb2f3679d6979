"""The recipe's flags, generated from its settings (``meshtrain train`` and ``meshtrain plan`` share them):
one flag per recipe knob (``--remat``, ``--grad-accum``, ...) and per dimension option (``--load-balance``,
``--flash-backend``, ``--context-kind``, ``--schedule``, ``--pipeline-micro-batches``, ...), ``choices`` from
the enums, the built-in default in ``--help``. Two deprecated flags are still read, with the meaning they
always had and a warning naming the new flag (:func:`meshtrain.recipes.legacy_option`): ``--attention KIND``
(a context kind sets ``--context-kind``, dense/flash ``--local-attention``) and ``--micro-batches N``
(``--pipeline-micro-batches`` under pp, else ``--grad-accum``)."""

from __future__ import annotations

from typing import Any, Collection, Dict, Optional

from meshtrain.recipes import AttentionKind, dimension_settings, recipe_settings
from meshtrain.settings import add_flags, flag_value

LEGACY = ("attention", "micro_batches")


def add_recipe_flags(parser, only: Optional[Collection[str]] = None) -> None:
    """Every recipe flag, or those named in ``only`` (``generate``'s ``--replicate-indivisible``), with one help
    text wherever they appear."""
    add_flags(parser, [s for s in recipe_settings() if only is None or s.flag in only], owner="the recipe's")
    seen = set()
    for cls, s in dimension_settings():
        if s.flag not in seen and (only is None or s.flag in only):  # (registered twice under one flag: first wins)
            seen.add(s.flag)
            add_flags(parser, [s], owner=f"the recipe's {cls.key} dimension's, which the recipe must have")
    if only is not None:
        return
    parser.add_argument("--attention", choices=[k.value for k in AttentionKind], default=None,
                        help="deprecated (warns): a context kind is --context-kind (needs a cp recipe), dense or "
                             "flash is --local-attention")
    parser.add_argument("--micro-batches", type=int, default=None,
                        help="deprecated (warns): --pipeline-micro-batches for a pp recipe, else --grad-accum")


def recipe_overrides(args) -> Dict[str, Any]:
    """The recipe flags given on the command line, by :meth:`meshtrain.Recipe.with_options` name."""
    out: Dict[str, Any] = {}
    for s in list(recipe_settings()) + [s for _, s in dimension_settings()]:
        value = getattr(args, s.flag, None) if s.cli else None
        if value is not None:
            out[s.flag] = flag_value(s, value)
    for name in LEGACY:
        if getattr(args, name, None) is not None:
            out[name] = getattr(args, name)
    return out
