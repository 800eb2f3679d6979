"""The ``meshtrain`` command (also ``python -m meshtrain``).

Each sub-command lives in ``meshtrain/commands/<name>.py`` with ``add_parser`` and ``run``.
Bad input (a ``MeshtrainError``) prints ``error: ...`` and exits 2, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

COMMANDS = ("recipes", "plan", "train", "ckpt", "launch")


def add_device_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=None,
                        help="number of devices (per process in a multi-process run); without an accelerator, "
                             "simulate this many CPU devices (default: all accelerators, or 8 CPU devices)")
    from meshtrain.distributed import add_distributed_args

    add_distributed_args(parser)


def setup_devices(requested: Optional[int], default_cpu: int = 8) -> None:
    """Set the simulated CPU device count before JAX starts its backends.

    Only the CPU backend reads ``jax_num_cpu_devices``; on a GPU/TPU machine the accelerators are
    used and ``--devices N`` picks the first N of them (:func:`meshtrain.mesh.select_devices`).
    """
    import jax

    if requested is not None and requested < 1:
        from meshtrain.errors import ConfigError

        raise ConfigError(f"--devices {requested}: give a positive number of devices")
    if "JAX_NUM_CPU_DEVICES" in os.environ and requested is None:
        return
    try:
        jax.config.update("jax_num_cpu_devices", requested or default_cpu)
    except RuntimeError:  # backends already started (e.g. called twice in one process)
        pass


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="meshtrain", description="Pick a recipe, train a Flax model anywhere.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        module = importlib.import_module(f"meshtrain.commands.{name}")
        module.add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    from meshtrain import distributed
    from meshtrain.errors import MeshtrainError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "setup_devices", True):
            setup_devices(getattr(args, "devices", None))
            # Before any backend starts: MESHTRAIN_* variables, flags or the cluster may ask for it.
            distributed.initialize(distributed.config_from_args(args))
        return int(args.run(args) or 0)
    except MeshtrainError as exc:
        where = distributed.current()
        print(f"error: {f'[process {where.process_id}] ' if where else ''}{exc}", file=sys.stderr)
        return _leave(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return _leave(130)
    except Exception:
        if not distributed.is_multiprocess():
            raise
        import traceback

        traceback.print_exc()
        return _leave(1)


def _leave(code: int) -> int:
    """In a multi-process run, a failing process leaves at once: a normal exit would wait in
    jax.distributed's shutdown barrier for peers that are themselves waiting for it."""
    from meshtrain import distributed

    if distributed.is_multiprocess():
        distributed.exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
