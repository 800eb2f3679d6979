"""``meshtrain config show``: print the resolved run configuration as YAML (the defaults, a ``--config``
file, then the flags and ``--set`` given: the same resolution as ``meshtrain train``). The output is itself
a ``--config`` file::

    meshtrain config show --model tiny --set optimizer.lr=1e-4 > run.yaml
    meshtrain train --config run.yaml
"""

from __future__ import annotations

import sys

from meshtrain.commands.common import add_device_args
from meshtrain.commands.run_flags import add_peak_tflops, add_run_flags, resolve, train_keys


def add_parser(sub):
    p = sub.add_parser("config", help="show the resolved run configuration (YAML) of --config, --set and flags",
                       description="Run configurations: `meshtrain config show` prints the configuration that "
                                   "`meshtrain train` would run with the same arguments, as YAML.")
    inner = p.add_subparsers(dest="config_action", metavar="ACTION", parser_class=type(p))
    inner.required = True
    show = inner.add_parser("show", help="print the resolved configuration as YAML (a --config file)")
    add_run_flags(show, train_keys(), recipe_options=True)
    add_device_args(show)
    add_peak_tflops(show)
    show.set_defaults(run=run, setup_devices=False)


def run(args) -> int:
    resolved = resolve(args, train_keys(), recipe_options=True)
    resolved.config.train_config()  # values that contradict each other are refused here as in train
    sys.stdout.write(resolved.config.to_yaml())
    sys.stdout.flush()
    return 0
