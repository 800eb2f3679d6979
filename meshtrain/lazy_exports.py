"""PEP 562 lazy exports for a package's ``__init__`` (standard library only): a public name loads its module on
first use, so importing the package (``meshtrain``, ``meshtrain.train``) loads neither JAX nor the trainer.

Used by ``meshtrain/__init__.py`` and ``meshtrain/train/__init__.py``; give it the name → module table and the
package's ``globals()``::

    __getattr__, __dir__ = lazy_exports(globals(), {"Trainer": "meshtrain.train.trainer"}, extra=("models",))
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable, Dict, Iterable, Tuple


def lazy_exports(namespace: Dict[str, Any], exports: Dict[str, str], *, extra: Iterable[str] = ()
                 ) -> Tuple[Callable[[str], Any], Callable[[], list]]:
    """``(__getattr__, __dir__)`` for the package whose ``globals()`` is ``namespace``: ``exports`` maps each public
    name to the module defining it; the package's submodules load on first use too (``__main__`` never: it is the
    CLI entry point). ``extra``: public names already in ``namespace`` (listed by ``__dir__``). A loaded name is
    kept in ``namespace``, so ``__getattr__`` runs once per name."""
    package = namespace["__name__"]
    submodules = frozenset(m.name for m in pkgutil.iter_modules(namespace["__path__"]) if m.name != "__main__")
    public = set(exports) | set(extra)

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
        elif name in submodules:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list:
        return sorted({n for n in namespace if n.startswith("__")} | public | submodules)

    return __getattr__, __dir__
