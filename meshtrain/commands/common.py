"""What ``meshtrain.cli`` and the command modules share: the command names, the device flags and the
simulated-device set-up. Command modules import this, never ``meshtrain.cli`` (which imports them)."""

from __future__ import annotations

import argparse
import os
from typing import Optional

from meshtrain.distributed import add_distributed_args
from meshtrain.errors import ConfigError

COMMANDS = ("recipes", "plan", "train", "generate", "serve", "ckpt", "launch", "data", "import", "export", "config")
#: Sub-commands whose module name differs from the command (``import`` is a keyword).
MODULES = {"import": "hf_import", "export": "hf_export", "config": "config_cmd"}

#: Simulated CPU devices beyond this take minutes to start and most of the host's memory.
MAX_SIMULATED_DEVICES = 512


def add_device_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=None,
                        help="number of devices (per process in a multi-process run); without an accelerator, "
                             "simulate this many CPU devices (default: all accelerators, or 8 CPU devices)")

    add_distributed_args(parser)


def _no_accelerator_expected() -> bool:
    """True when JAX will run on CPU (``JAX_PLATFORMS=cpu``, or no GPU/TPU plugin installed)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    import importlib.util

    return not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu"))


def setup_devices(requested: Optional[int], default_cpu: int = 8) -> None:
    """Set the simulated CPU device count before JAX starts its backends.

    Only the CPU backend reads ``jax_num_cpu_devices``; on a GPU/TPU machine the accelerators are
    used and ``--devices N`` picks the first N of them (:func:`meshtrain.mesh.select_devices`).
    """
    import jax

    if requested is not None and requested < 1:
        raise ConfigError(f"--devices {requested}: give a positive number of devices")
    if requested is not None and requested > MAX_SIMULATED_DEVICES and _no_accelerator_expected():
        raise ConfigError(f"--devices {requested}: at most {MAX_SIMULATED_DEVICES} simulated CPU devices per process "
                          f"(each costs host threads and memory); to plan a run on {requested} devices use "
                          f"`meshtrain plan --devices {requested}` (no devices needed)")
    if "JAX_NUM_CPU_DEVICES" in os.environ and requested is None:
        return
    try:
        jax.config.update("jax_num_cpu_devices", requested or default_cpu)
    except RuntimeError:  # backends already started (e.g. called twice in one process)
        pass
