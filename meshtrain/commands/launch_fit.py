"""Which layouts of an elastic job fit in memory: the explanation ``meshtrain launch --elastic`` gives
when a restart on fewer processes is refused by the pre-flight memory check (exit 2).

The launcher starts no JAX backend of its own; it runs this module once, in a child process, when a
shrunk attempt exited 2: for every layout (processes × devices per process, gradient accumulation)
the launched ``train`` command is planned on that many simulated CPU devices and its per-device
estimate (:func:`meshtrain.train.preflight.estimate_bytes`, the planner's for the built-in decoders,
as ``meshtrain train`` checks it) is compared with a device's share of the host's memory in that
layout (host memory ÷ devices per process, :data:`~meshtrain.train.preflight.HEADROOM` usable)::

    python -m meshtrain.commands.launch_fit '{"config": {"model": {"name": "tiny"}, ...},
                                              "layouts": [[2, 1], [1, 2]], "devices_per_process": 2}'

(``config``: the launched run's configuration, :meth:`~meshtrain.train.run_config.RunConfig.to_dict`.)

prints one JSON line per layout: ``{"processes", "devices", "needs", "detail"}`` (bytes per device).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence

from meshtrain.supervisor import Layout
from meshtrain.units import fmt_bytes
from meshtrain.train.preflight import HEADROOM
from meshtrain.train.run_config import RunConfig

#: Seconds the child may take to plan every layout (JAX import, abstract state, plans: no arrays).
FIT_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class Fit:
    """One layout's memory check."""

    processes: int
    devices: int
    needs: int    # bytes per device: the pre-flight estimate
    limit: int    # bytes a device has: its share of the host's memory
    detail: str

    @property
    def fits(self) -> bool:
        return self.needs <= HEADROOM * self.limit


def smallest_fit(fits: Sequence[Fit]) -> Optional[Fit]:
    return min((f for f in fits if f.fits), key=lambda f: f.devices, default=None)


def explain(fits: Sequence[Fit], layout: Layout, devices_per_process: int) -> Optional[str]:
    """The error for a shrink onto ``layout`` that does not fit (``None`` when it fits: another cause)."""
    this = next((f for f in fits if f.processes == layout.processes), None)
    if this is None or this.fits:
        return None
    best = smallest_fit(fits)
    where = (f"the smallest device count that fits is {best.devices} ({best.processes} process(es) × "
             f"{devices_per_process} devices): resume on that many (`meshtrain launch --processes {best.processes} "
             f"...` with --resume) or use" if best is not None else "no layout of this job fits: use")
    return (f"--elastic: the run does not fit on {this.devices} devices ({this.processes} process(es) × "
            f"{devices_per_process}, --grad-accum {layout.grad_accum}): the plan needs ~{fmt_bytes(this.needs)} per "
            f"device ({this.detail}) but a device has {fmt_bytes(this.limit)} ({HEADROOM:.0%} usable); {where} a "
            f"recipe that shards more (--recipe fsdp), --remat full, or a smaller --batch-size/--seq-len/--model")


def check_layouts(config: Dict[str, Any], layouts: Sequence[Layout], devices_per_process: int,
                  host_bytes: int) -> List[Fit]:
    """Run the check in a child process (JAX with enough simulated devices for the largest layout)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               JAX_NUM_CPU_DEVICES=str(max(l.processes for l in layouts) * devices_per_process))
    for name in ("MESHTRAIN_DISTRIBUTED", "MESHTRAIN_COORDINATOR", "MESHTRAIN_NUM_PROCESSES", "MESHTRAIN_PROCESS_ID"):
        env.pop(name, None)
    request = json.dumps({"config": config, "layouts": [[l.processes, l.grad_accum] for l in layouts],
                          "devices_per_process": devices_per_process})
    done = subprocess.run([sys.executable, "-m", "meshtrain.commands.launch_fit", request], env=env,
                          capture_output=True, text=True, timeout=FIT_TIMEOUT_S)
    return [Fit(**json.loads(line), limit=host_bytes // devices_per_process)   # a CPU device's share
            for line in done.stdout.splitlines() if line.startswith("{")]


def _plan_layouts(request: dict) -> List[dict]:
    import jax  # the child process: the launcher itself loads no JAX

    from meshtrain.commands.train import decoder_memory_estimate  # lazy: the child process only: the launcher loads no JAX
    from meshtrain.train.preflight import estimate_bytes  # lazy: the child process only
    from meshtrain.train.trainer import Trainer  # lazy: the child process only

    per = request["devices_per_process"]
    out = []
    for processes, accum in request["layouts"]:
        run = RunConfig.from_dict(request["config"]).with_values({"recipe.options.grad_accum": accum})
        config = run.train_config()
        plan = Trainer(config, memory_estimate=None).build_plan(jax.devices()[:processes * per])
        check = estimate_bytes(plan, decoder_memory_estimate(config.model))
        out.append({"processes": processes, "devices": processes * per, "needs": check.estimate_bytes,
                    "detail": check.detail})
    return out


if __name__ == "__main__":
    for fit in _plan_layouts(json.loads(sys.argv[1])):
        print(json.dumps(fit), flush=True)
