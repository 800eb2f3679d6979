"""Supervised restarts for ``meshtrain launch --max-restarts K``.

When any process of the job dies, hangs (the watchdog's exit 75) or loses the coordinator, the
launcher's :class:`~meshtrain.commands.launch.ProcessGroup` stops all of them; the
:class:`Supervisor` then starts the whole job again with ``--resume latest`` (from the last
committed checkpoint), after ``backoff`` seconds, up to K times. Each attempt and how it ended is a
line of ``<run>/events.jsonl``::

    {"event": "attempt", "attempt": 1, "unix": ..., "command": [...]}
    {"event": "failed", "attempt": 0, "status": 137, "process": 1, "cause": "process 1 killed by SIGKILL", ...}
    {"event": "restart", "attempt": 1, "after_s": 2.0, "cause": "..."}
    {"event": "done", "attempt": 1, "status": 0, ...} / {"event": "gave_up", ...}

With ``elastic`` the job shrinks on each restart, as when the failed host does not come back: it
runs on the largest process count below the last one that divides the first (2 → 1, 4 → 2 → 1,
6 → 3 → 2 → 1), the recipe's mesh is re-resolved over the devices present (the command must not
pin ``--mesh``), and ``--grad-accum`` grows by the same factor so the global batch, and each
device's micro-batch, stay the same; the checkpoint reshards onto the new mesh and the data
position (samples of the whole run) carries over. ``metrics.jsonl`` gets a ``start`` record with
the mesh of every segment; each ``attempt`` event records its processes and gradient accumulation.

No restart for bad input (exit 2), Ctrl-C (130) or a signal the launcher itself received (the
cluster or the user is stopping the job). On a cluster, run ``meshtrain train --resume`` in every
process instead (``--resume`` is the contract) and let the job script or the cluster restart it:
``recipes/launch/slurm-gpu.sbatch`` retries crashes in a loop and requeues itself when the run exits
``$MESHTRAIN_PREEMPTED_EXIT`` (:mod:`meshtrain.interrupts`; SLURM's ``--requeue`` alone never
requeues a job that exited 0); a JobSet restarts on a failed pod.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple

from meshtrain.errors import EXIT_BAD_INPUT, EXIT_HANG, ConfigError
from meshtrain.events import append_event
from meshtrain.train.config import Resume
from meshtrain.train.run_config import RunConfig

#: Exit statuses that a restart cannot fix, or that mean "stop": bad input, Ctrl-C.
NO_RESTART = (EXIT_BAD_INPUT, 130)


def check_command(command: str, config: RunConfig, max_restarts: int, backoff: float) -> str:
    """The run folder of a command launched with ``--max-restarts``; ConfigError if it cannot restart."""
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts {max_restarts}: give the number of restarts allowed (>= 0)")
    if not (backoff >= 0 and backoff != float("inf")):
        raise ConfigError(f"--restart-backoff {backoff:g}: give the seconds to wait before a restart (>= 0)")
    if command != "train":
        raise ConfigError(f"--max-restarts restarts training runs; the command is {command!r}: launch `train ...`")
    if not config.checkpoint.out:
        raise ConfigError("--max-restarts needs the launched command's --out (the run folder it resumes from and "
                          "writes events.jsonl to), e.g. meshtrain launch --processes 2 --max-restarts 3 -- train "
                          "--ckpt-every 10 --out runs/job")
    return config.checkpoint.out


@dataclasses.dataclass(frozen=True)
class Layout:
    """Processes and gradient accumulation of one attempt."""

    processes: int
    grad_accum: int


def elastic_layouts(config: RunConfig, given: Collection[str], processes: int) -> List[Layout]:
    """The layouts an elastic job shrinks through: process counts that divide the first, largest
    first, with the gradient accumulation that keeps every device's micro-batch. ``given``: the dotted
    keys the command set (flags, ``--config``, ``--set``). ConfigError when the command cannot keep its
    global batch on fewer processes."""
    for key, flag, why in (
            ("recipe.mesh", "--mesh", "the mesh must be re-resolved over the devices present; leave it to the recipe"),
            ("recipe.options.micro_batches", "--micro-batches", "give --grad-accum instead (it is scaled on each "
                                                                  "shrink)")):
        if key in given:
            raise ConfigError(f"--elastic: remove {flag} from the command ({key}): {why}")
    if "data.batch_size" not in given:
        raise ConfigError("--elastic needs the command's --batch-size: the global batch it keeps on fewer processes "
                          "(the default is rounded to the device count)")
    base = config.recipe.options.grad_accum or 1
    return [Layout(n, base * processes // n) for n in range(processes, 0, -1) if processes % n == 0]


def attempt_config(config: RunConfig, attempt: int, layout: Optional[Layout] = None) -> RunConfig:
    """The configuration of attempt ``attempt``: a restart resumes from the newest checkpoint
    (``checkpoint.resume: latest``); an elastic one also takes the layout's gradient accumulation."""
    values: Dict[str, Any] = {}
    if attempt:
        values["checkpoint.resume"] = Resume.LATEST
    if layout is not None:
        values["recipe.options.grad_accum"] = layout.grad_accum
    return config.with_values(values)


#: The keys :func:`attempt_config` may change: always written to an attempt's file.
CHANGED_KEYS = ("checkpoint.resume", "recipe.options.grad_accum")


def write_attempt_config(run_dir: str, attempt: int, config: RunConfig, given: Collection[str]) -> str:
    """Write attempt ``attempt``'s configuration to ``<run_dir>/launch/attempt-<k>.yaml`` (the settings the
    command gave and those the supervisor changed; the rest keep their defaults in the child) and return
    its path, which the children get as ``--config``."""
    folder = os.path.join(run_dir, "launch")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"attempt-{attempt}.yaml")
    keys = set(given) | {k for k in CHANGED_KEYS if k != "recipe.options.grad_accum"
                         or config.recipe.options.grad_accum is not None}
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# meshtrain launch: attempt {attempt}'s configuration\n" + config.to_yaml(only=keys))
    return path


def describe(process: Optional[int], status: int) -> str:
    """Why an attempt ended, in words (``status``: the launcher's 128+N for a signal)."""
    if process is None:
        return f"exit status {status}"
    if status == EXIT_HANG:
        return f"process {process} found a hang (watchdog, exit {EXIT_HANG})"
    if status > 128 and status - 128 in {s.value for s in signal.Signals}:
        what = f"killed by {signal.Signals(status - 128).name}"
    else:
        what = f"exited with status {status}"
    return (f"coordinator (process 0) lost: {what}" if process == 0 else f"process {process} {what}")


class Supervisor:
    """Runs attempts until one succeeds, one must not be retried, or ``max_restarts`` restarts failed.

    ``attempt(k)`` starts attempt ``k`` (0: the command as given; later: with ``--resume latest``) and
    returns ``(status, failed process or None, the launcher itself was signalled)``.
    """

    def __init__(self, attempt: Callable[[int], Tuple[int, Optional[int], bool]], run_dir: str,
                 max_restarts: int, backoff: float, say: Callable[[str], None],
                 layout: Optional[Callable[[int], Layout]] = None,
                 explain: Optional[Callable[[int, int], Optional[str]]] = None):
        self.attempt, self.run_dir, self.max_restarts, self.backoff, self.say = (attempt, run_dir, max_restarts,
                                                                                 backoff, say)
        self.layout = layout   # elastic: the processes and gradient accumulation of attempt k
        self.explain = explain   # (attempt, status) -> why a status that is not retried came, or None
        self._event_error = False

    def _event(self, record: dict) -> None:
        """One line of events.jsonl; a disk that cannot take it is said once and the job goes on."""
        try:
            append_event(self.run_dir, record)
        except OSError as exc:
            if not self._event_error:
                self.say(f"cannot write {os.path.join(self.run_dir, 'events.jsonl')}: {exc.strerror or exc}; "
                         f"the restarts go on without it")
            self._event_error = True

    def _hang_report(self, process: Optional[int], status: int) -> str:
        """The watchdog's first line (who is slow, where it is stuck), from ``hang-<process>.txt``."""
        if status != EXIT_HANG or process is None:
            return ""
        try:
            with open(os.path.join(self.run_dir, f"hang-{process}.txt")) as f:
                return ": " + f.readline().strip()
        except OSError:
            return ""

    def run(self) -> int:
        k = 0
        while True:
            shape = dataclasses.asdict(self.layout(k)) if self.layout else {}
            self._event({"event": "attempt", "attempt": k, **shape, "unix": time.time()})
            status, process, signalled = self.attempt(k)
            now = time.time()
            if status == 0:
                self._event({"event": "done", "attempt": k, "status": 0, "unix": now})
                return 0
            cause = describe(process, status) + self._hang_report(process, status)
            self._event({"event": "failed", "attempt": k, "status": status, "process": process,
                                        "cause": cause, "unix": now})
            if signalled or status in NO_RESTART or k >= self.max_restarts:
                why = ("the launcher was signalled" if signalled else f"status {status} is not retried"
                       if status in NO_RESTART else f"{self.max_restarts} restart(s) used")
                told = self.explain(k, status) if self.explain and status in NO_RESTART and not signalled else None
                if told:
                    self.say(f"error: {told}")
                    why += f": {told}"
                self._event({"event": "gave_up", "attempt": k, "status": status, "cause": cause,
                                            "reason": why, "unix": now})
                if not signalled and status not in NO_RESTART:
                    self.say(f"giving up after {k + 1} attempt(s): {cause}; exit status {status}")
                return status
            k += 1
            shrink = (f" on {self.layout(k).processes} process(es) with --grad-accum {self.layout(k).grad_accum}"
                      if self.layout and self.layout(k) != self.layout(k - 1) else "")
            self.say(f"{cause}; restart {k}/{self.max_restarts} from the last committed checkpoint{shrink}"
                     + (f" in {self.backoff:g} s" if self.backoff else ""))
            self._event({"event": "restart", "attempt": k, "after_s": self.backoff, "cause": cause,
                                        "unix": now})
            try:
                time.sleep(self.backoff)
            except KeyboardInterrupt:   # Ctrl-C between attempts: no process is running
                self._event({"event": "gave_up", "attempt": k, "status": 130, "cause": cause,
                             "reason": "Ctrl-C during the backoff", "unix": time.time()})
                return 130
