"""What ``--model`` names, for every command that takes one: ``plan``, ``train`` (and the ``train``
that ``launch`` starts) and ``generate``. One resolver, so a name means the same model everywhere::

    NAME          a built-in config: tiny, small, llama3-8b, vit-tiny, bert-tiny, ...
    HF_DIR        a HuggingFace model folder (config.json): the decoder it describes
    RUN           a run folder (its metrics.jsonl run header): the model that run trained
    file.py:fn    a function rngs -> nnx.Module (also module:fn, importable from the current directory)

Which kind a name is, is decided without reading a weight: a folder is a HuggingFace folder when it
holds ``config.json``, a run folder when it holds a run header; ``:`` marks a function; anything else
is a built-in name. Example::

    src = model_source("runs/base")      # ModelSource(text='runs/base', kind=SourceKind.RUN, ...)
    src.config                            # the DecoderConfig that run trained (an imported Llama, ...)
    abstract_state(src.factory())         # rngs -> nnx.Module, the same for plan and train

Classifying (:func:`source_kind`) loads no JAX: ``meshtrain launch`` may call it.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
from typing import Any, Callable, Dict, Optional

from meshtrain.errors import ConfigError

#: The files that make a folder one kind or the other: HuggingFace's, and meshtrain's run header
#: (``meshtrain.train.rundir.METRICS_FILE``, named here so that classifying loads no JAX; a test keeps them equal).
HF_CONFIG_FILE = "config.json"
RUN_HEADER_FILE = "metrics.jsonl"
#: What ``--model`` accepts, for error messages and help texts.
ACCEPTED = ("a built-in model name (`meshtrain plan --help` lists them), a HuggingFace folder (config.json), a run "
            "folder (`meshtrain train` or `meshtrain import` wrote it) or file.py:function (a model factory)")
FACTORY_CONTRACT = ("a model factory takes one argument, rngs (an nnx.Rngs), and returns an nnx.Module, e.g. "
                    "def make_model(rngs): return MyModel(..., rngs=rngs)")
LOSS_CONTRACT = "a loss takes (model, batch) and returns (loss_sum, weight) or (loss_sum, weight, metrics)"


class SourceKind(str, enum.Enum):
    """The four things ``--model`` may name."""

    BUILTIN = "built-in config"
    HF_FOLDER = "HuggingFace folder"
    RUN = "run folder"
    FACTORY = "model factory"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A resolved ``--model``: its ``kind``, the model ``config`` (``None`` for a factory) and, for a
    factory, the function ``make``. :meth:`factory` is what ``abstract_state`` and the Trainer take."""

    text: str
    kind: SourceKind
    config: Any = None
    make: Optional[Callable] = None

    def factory(self) -> Callable:
        """``rngs -> nnx.Module``: the factory's own function, else the config's model class."""
        if self.make is not None:
            return self.make
        from meshtrain.models import model_factory  # lazy: on use, classifying loads no JAX

        return model_factory(self.config)

    @property
    def has_weights(self) -> bool:
        """Whether the source holds weights (``--init-from`` and ``generate`` read them)."""
        return self.kind in (SourceKind.HF_FOLDER, SourceKind.RUN)

    @property
    def short_name(self) -> str:
        return short_name(self.text)


def short_name(text: str) -> str:
    """A name of ``--model`` fit for a folder name: a folder's base name, a function's name, or the
    built-in name (``runs/base`` → ``base``, ``models.py:make_mlp`` → ``make_mlp``)."""
    if ":" in text and not os.path.isdir(text):
        return text.rpartition(":")[2].replace(".", "_") or "model"
    return os.path.basename(os.path.normpath(text)) or "model"


def source_kind(text: str, flag: str = "--model") -> SourceKind:
    """Which of the four kinds ``text`` names (module docstring); a folder that is neither a
    HuggingFace folder nor a run, or a path that does not exist, is a :class:`ConfigError`."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{flag} is empty; give {ACCEPTED}")
    if os.path.isdir(text):
        if os.path.isfile(os.path.join(text, HF_CONFIG_FILE)):
            return SourceKind.HF_FOLDER
        if os.path.isfile(os.path.join(text, RUN_HEADER_FILE)):
            return SourceKind.RUN
        raise ConfigError(f"{flag} {text!r} is a folder with neither a HuggingFace config.json nor a run header "
                          f"({RUN_HEADER_FILE}); give {ACCEPTED}")
    if ":" in text:
        return SourceKind.FACTORY
    if os.sep in text or text.startswith(".") or os.path.exists(text):
        raise ConfigError(f"{flag} {text!r}: no such folder; give {ACCEPTED}")
    return SourceKind.BUILTIN


def model_source(text: str, flag: str = "--model") -> ModelSource:
    """``text`` resolved: its kind and model config (a factory's function imported and checked)."""
    kind = source_kind(text, flag)
    if kind is SourceKind.FACTORY:
        make = load_ref(text, flag)
        check_arity(make, text, flag, 1, FACTORY_CONTRACT)
        return ModelSource(text, kind, None, make)
    if kind is SourceKind.HF_FOLDER:
        from meshtrain.hf.config import decoder_config, read_hf_config  # lazy: on use, loads the models

        name = os.path.basename(os.path.normpath(text))
        return ModelSource(text, kind, decoder_config(read_hf_config(text), name, text))
    if kind is SourceKind.RUN:
        return ModelSource(text, kind, run_model_config(text, flag))
    from meshtrain.models.configs import CONFIGS, get_config  # lazy: on use, loads the models

    if text not in CONFIGS:
        raise ConfigError(f"unknown model {text!r}: {flag} takes {ACCEPTED}; built-in: {', '.join(CONFIGS)}")
    return ModelSource(text, kind, get_config(text))


def run_header(run_dir: str) -> Optional[Dict[str, Any]]:
    """The run header (first ``start`` record of ``metrics.jsonl``) of ``run_dir``, or ``None``."""
    path = os.path.join(run_dir, RUN_HEADER_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if record.get("event") == "start":
                    return record
    except (OSError, ValueError):
        return None
    return None


def run_model_config(run: str, flag: str = "--model"):
    """The model config run folder ``run`` trained (its run header's ``model_config``, checked field by
    field: a damaged header names the file and the field)."""
    from meshtrain.models.configs import config_from_fields  # lazy: on use, loads the models

    header = run_header(run)
    if header is None or not header.get("model_config"):
        raise ConfigError(f"{flag} {run!r} is a run folder whose header names no model config (a run of your own "
                          f"model through the Python API?); give the model itself, e.g. file.py:make_model")
    return config_from_fields(header["model_config"], os.path.join(run, RUN_HEADER_FILE))


def load_ref(ref: str, flag: str):
    """The object ``module:attr`` (or ``path/to/file.py:attr``) names; ``ConfigError`` saying what failed."""
    module_name, sep, attr = ref.rpartition(":")
    if not sep or not module_name or not attr or not re.fullmatch(r"[A-Za-z_][\w.]*", attr):
        raise ConfigError(f"{flag} {ref!r}: expected module:function, e.g. mypkg.models:make_model or "
                          f"path/to/models.py:make_model")
    module = _import_file(module_name, ref, flag) if module_name.endswith(".py") else \
        _import_module(module_name, ref, attr, flag)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise ConfigError(f"{flag} {ref!r}: module {module_name!r} has no {attr!r} (it has: "
                              f"{', '.join(names[:12]) or 'nothing callable'})")
        obj = getattr(obj, part)
    return obj


def _import_file(path: str, ref: str, flag: str):
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {ref!r}: no file {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)  # like `python path/to/file.py`: modules next to the file import
    key = "meshtrain_user_" + re.sub(r"\W", "_", os.path.abspath(path))
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's module: report whatever it raised
        sys.modules.pop(key, None)
        raise ConfigError(f"{flag} {ref!r}: importing {path} failed: {type(exc).__name__}: {exc}") from None
    return module


def _import_module(module_name: str, ref: str, attr: str, flag: str):
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: modules in the current directory import
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigError(f"{flag} {ref!r}: cannot import module {module_name!r} (no module named "
                              f"{exc.name!r}); run from the directory that holds it or add that directory to "
                              f"PYTHONPATH, or give a file path: path/to/{module_name.split('.')[-1]}.py:{attr}") \
                from None
        raise ConfigError(f"{flag} {ref!r}: importing {module_name} failed: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module: report whatever it raised
        raise ConfigError(f"{flag} {ref!r}: importing {module_name} failed: {type(exc).__name__}: {exc}") from None


def check_arity(fn, ref: str, flag: str, n: int, contract: str) -> None:
    """``fn`` must be callable with ``n`` positional arguments; else a ConfigError quoting ``contract``."""
    if not callable(fn):
        raise ConfigError(f"{flag} {ref!r} is a {type(fn).__name__}, not a function; {contract}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to check
    try:
        sig.bind(*([object()] * n))
    except TypeError:
        raise ConfigError(f"{flag} {ref!r} has signature {fn.__name__ if hasattr(fn, '__name__') else ''}{sig}, "
                          f"which cannot be called with {n} positional argument{'s' if n > 1 else ''}; "
                          f"{contract}") from None
