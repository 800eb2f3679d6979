"""The ``meshtrain`` command (also ``python -m meshtrain``).

Each sub-command lives in ``meshtrain/commands/<name>.py`` with ``add_parser`` and ``run``.
Bad input (a ``MeshtrainError``) prints ``error: ...`` and exits 2, without a traceback; a full disk
or file-size limit (a ``DiskError``) the same way with exit code 74 (``meshtrain.errors.EXIT_DISK``).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from typing import List, Optional

from meshtrain import distributed, interrupts, peer_errors
from meshtrain.errors import MeshtrainError
from meshtrain.hardware import apply_scheduling_flags

# Shared with the command modules (which must not import this module: it imports them).
from meshtrain.commands.common import (COMMANDS, MAX_SIMULATED_DEVICES, MODULES as _MODULES,  # noqa: E402,F401
                                       add_device_args, setup_devices)


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to every option whose help does not already say its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS
                or not action.option_strings or isinstance(action, argparse._HelpAction)):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Sub-command parsers: no abbreviated flags (``--step 3`` is an error, not ``--steps 3``) and
    every default shown in ``--help``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)


def build_parser(argv: Optional[List[str]] = None) -> argparse.ArgumentParser:
    """The parser of ``argv``'s command alone (its module's imports only: ``meshtrain launch`` loads no JAX,
    and a bad flag is refused before any heavy import); every command's without ``argv`` or when it names
    no command yet (``meshtrain --help``, a misspelt command: the usage lists them all)."""
    import importlib

    parser = argparse.ArgumentParser(prog="meshtrain", description="Pick a recipe, train a Flax model anywhere.",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    named = argv[0] if argv and argv[0] in COMMANDS else None
    for name in COMMANDS if named is None else (named,):
        module = importlib.import_module(f"meshtrain.commands.{_MODULES.get(name, name)}")
        module.add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    warnings.formatwarning = _one_line_warning
    try:
        if args.command == "train":   # a SIGTERM while JAX starts: exit at once, if a template asks for it
            interrupts.guard_startup(_say_now)
        if getattr(args, "prepare", None) is not None:
            args.prepare(args)  # --config / --set read before the devices start (they may set distributed.devices)
        if getattr(args, "xla_flags", "none") == "auto":
            apply_scheduling_flags()  # read once, when the backend starts: before setup_devices
        if getattr(args, "setup_devices", True):
            setup_devices(getattr(args, "devices", None))
            # Before any backend starts: MESHTRAIN_* variables, flags or the cluster may ask for it.
            distributed.initialize(distributed.config_from_args(args))
        if args.command == "train":   # again: jax.distributed's own SIGTERM handler replaced it
            interrupts.guard_startup(_say_now)
        return interrupts.exit_status(int(args.run(args) or 0))
    except MeshtrainError as exc:
        where = distributed.current()
        print(f"error: {f'[process {where.process_id}] ' if where else ''}{exc}", file=sys.stderr)
        return _leave(exc.exit_code)
    except KeyboardInterrupt as exc:
        print(f"interrupted{'; ' + str(exc) if str(exc) else ''}", file=sys.stderr)
        return _leave(130)
    except Exception as exc:
        if not distributed.is_multiprocess():
            raise
        # A peer that died (killed, out of memory) fails this process's collective: one line that
        # names it, the traceback in a file; any other error keeps its traceback on the terminal.
        line = peer_errors.peer_failure(exc)
        if line is None:
            traceback.print_exc()
            return _leave(1)
        path = peer_errors.keep_traceback(exc, getattr(args, "out", None))
        print(f"error: {line}" + (f" (traceback in {path})" if path else ""), file=sys.stderr)
        return _leave(1, grace_s=0.0)   # the peer is gone: waiting in the shutdown barrier for it is pointless


def _say_now(text: str) -> None:
    """One line to stderr from any thread, even while the main thread holds ``sys.stderr``'s lock."""
    os.write(2, f"meshtrain: {text}\n".encode())


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Warnings on the command line read like errors: ``warning: ...``, without a source line."""
    return f"warning: {message}\n"


def _leave(code: int, grace_s: float = distributed.SHUTDOWN_GRACE_S) -> int:
    """In a multi-process run, a failing process leaves at once: a normal exit would wait in
    jax.distributed's shutdown barrier for peers that are themselves waiting for it."""
    if distributed.is_multiprocess():
        distributed.exit_now(code, grace_s)
    return code


if __name__ == "__main__":
    sys.exit(main())
