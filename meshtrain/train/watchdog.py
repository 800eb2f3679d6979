"""The hang and straggler watchdog: a training hook with a background thread per process.

**Hangs.** The watchdog is armed in multi-process runs, under ``meshtrain launch --max-restarts``
and wherever ``--hang-timeout`` is given (a single process in a notebook or a debugger is not
killed for pausing). Its thread checks the time since this process last completed a step
(everything between two steps counts: the step, evaluation, a checkpoint save). Past the bound it
writes every thread's stack (``faulthandler``) to ``<run>/hang-<process>.txt``, headed by the frame
the main thread is stuck in and the slow process(es), prints one ``error:`` line and exits with
:data:`~meshtrain.errors.EXIT_HANG` (75) at once: a process blocked in a collective cannot leave
through Python. The bound is ``--hang-timeout`` seconds, or by default ``max(FLOOR_S, MULTIPLE ×
the median of the last RECENT_STEPS step intervals)`` once ``WARMUP_STEPS`` intervals are measured
and ``STARTUP_S`` before that. The first step (compilation, after a restore) always gets at least
``STARTUP_S``.

**Which process is slow.** Every process's thread rewrites ``<run>/watchdog/process-<i>.json``
(its last completed step, and the time its thread last ran) every ``POLL_S`` seconds. A process
whose file went stale (stopped, frozen, dead) or whose step is behind the others is named; when
every process is alive at the same step the hang is in all of them (a collective, a deadlock).

**Stragglers.** Every ``STRAGGLER_EVERY`` steps and at the last step the processes all-gather their mean host time per
step (the time between finishing one step and starting the next: data, hooks, anything slow on the
host); a process whose host time exceeds the others' median by more than ``--straggler-fraction``
of the median step interval is reported (a ``stragglers`` record in ``metrics.jsonl``, a line on
the progress display) and the run goes on. A device that is slow inside the step slows every
process alike (they meet in the step's collectives), so it shows as a slower step for all.

**Fault injection (tests and ``tools/bench_resilience.py`` only).** ``MESHTRAIN_FAULT`` holds
``;``-separated faults ``KIND@step=N,process=P[,attempt=A][,seconds=S]``: ``kill`` (SIGKILL itself
after step N), ``lose`` (delete its in-memory peer copies, then SIGKILL itself: a lost host,
:mod:`meshtrain.checkpoint.peers`), ``full`` (its first checkpoint save at or after step N fails
with ENOSPC: a full disk, exit 74; armed on the run's ``Checkpointer.faults``), ``stop`` (SIGSTOP
itself: a hang), ``slow`` (sleep S seconds, default 0.5, after every step from N: a straggler).
Fault ``k`` fires in attempt ``k`` of ``meshtrain launch --max-restarts`` (``MESHTRAIN_ATTEMPT``, 0
for the first) unless ``attempt`` says otherwise. Each
fault and the first step of every attempt are appended to ``<run>/events.jsonl``.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import faulthandler
import json
import os
import shutil
import signal
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Deque, List, Optional

from meshtrain.checkpoint import peers
from meshtrain.checkpoint.faults import DiskFullInjector
from meshtrain.errors import EXIT_HANG, ConfigError
from meshtrain.events import ENV_ATTEMPT, EVENTS_FILE, append_event  # noqa: F401 - also read here
from meshtrain.train.hooks import Hook
from meshtrain.train.config import check_watchdog_settings as check_settings
from meshtrain.train.loop import Run, StepInfo

ENV_FAULT = "MESHTRAIN_FAULT"
HEARTBEAT_DIR = "watchdog"

#: Bound before the first step completes: the compilation (minutes for a large model) and restore.
STARTUP_S = 1800.0
#: Least default bound after warm-up: an evaluation's first compile or a blocking save fits in it.
FLOOR_S = 300.0
#: Default bound after warm-up: this many median step intervals (but at least FLOOR_S).
MULTIPLE = 10.0
#: Step intervals measured before the default bound leaves STARTUP_S (the first one is not counted).
WARMUP_STEPS = 5
#: The default bound follows the median of this many recent step intervals.
RECENT_STEPS = 100
#: How often the thread checks the bound and rewrites its heartbeat file.
POLL_S = 1.0
#: A heartbeat older than this many polls means that process is not running (stopped or dead).
STALE_POLLS = 3
#: Steps between two all-gathers of the per-process host times (multi-process runs).
STRAGGLER_EVERY = 10


def hang_bound(intervals: List[float], hang_timeout: Optional[float]) -> float:
    """Seconds allowed between two completed steps, given the intervals measured so far (the first
    one, which includes the compilation, excluded by the caller)."""
    if hang_timeout is not None:
        return hang_timeout
    if len(intervals) < WARMUP_STEPS:
        return STARTUP_S
    return max(FLOOR_S, MULTIPLE * statistics.median(intervals))


# -- fault injection (tests and benchmarks) ---------------------------------------------------------
class FaultKind(str, enum.Enum):
    KILL = "kill"
    LOSE = "lose"
    FULL = "full"
    STOP = "stop"
    SLOW = "slow"


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: FaultKind
    step: int
    process: int
    attempt: int
    seconds: float = 0.5


def parse_faults(text: str) -> List[Fault]:
    """``kill@step=3,process=1;stop@step=5,process=0`` → faults (the k-th fires in attempt k)."""
    faults = []
    for k, item in enumerate(p.strip() for p in text.split(";") if p.strip()):
        kind, _, params = item.partition("@")
        try:
            values = dict(kv.split("=", 1) for kv in params.split(",") if kv)
            fault = Fault(FaultKind(kind.strip()), int(values.pop("step")), int(values.pop("process", 0)),
                          int(values.pop("attempt", k)), float(values.pop("seconds", 0.5)))
        except (KeyError, ValueError):
            raise ConfigError(f"{ENV_FAULT}={text!r}: cannot read {item!r}; write KIND@step=N,process=P"
                              f"[,attempt=A][,seconds=S] with KIND one of {[f.value for f in FaultKind]}") from None
        if values:
            raise ConfigError(f"{ENV_FAULT}={text!r}: unknown key(s) {sorted(values)} in {item!r}; use step, "
                              f"process, attempt, seconds")
        faults.append(fault)
    return faults


# -- the hook ---------------------------------------------------------------------------------------
class Watchdog(Hook):
    """See the module docstring. One per process; ``hang_timeout=None``: the default bound."""

    every = 1

    def __init__(self, hang_timeout: Optional[float] = None, straggler_fraction: float = 0.2,
                 faults: Optional[List[Fault]] = None, attempt: int = 0,
                 disk_faults: Optional[DiskFullInjector] = None):
        check_settings(hang_timeout, straggler_fraction)
        self.disk_faults = disk_faults   # the checkpointer's injector that a `full` fault arms
        self.hang_timeout, self.straggler_fraction = hang_timeout, straggler_fraction
        self.attempt = attempt
        self.faults = [f for f in (faults or []) if f.attempt == attempt]
        self.intervals: Deque[float] = collections.deque(maxlen=RECENT_STEPS)
        self.window: List[List[float]] = []   # [host s, step s] per step since the last gather
        self.step: Optional[int] = None
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def from_env(cls, hang_timeout: Optional[float], straggler_fraction: float, environ=os.environ,
                 disk_faults: Optional[DiskFullInjector] = None) -> "Watchdog":
        """The faults of ``MESHTRAIN_FAULT``; pass the run's ``Checkpointer.faults`` as ``disk_faults``
        so that a ``full`` fault can reach its saves."""
        faults = parse_faults(environ.get(ENV_FAULT, ""))
        return cls(hang_timeout, straggler_fraction, faults, int(environ.get(ENV_ATTEMPT, "0") or 0), disk_faults)

    def on_start(self, run: Run) -> None:
        import jax

        self.run, self.process, self.processes = run, jax.process_index(), jax.process_count()
        self._last = time.monotonic()
        for fault in self.faults:
            if fault.kind is FaultKind.FULL and fault.process == self.process and self.disk_faults is not None:
                self.disk_faults.arm(fault.step, self._fault_event(run, fault))
        if self.armed:
            try:
                os.makedirs(os.path.join(run.run_dir, HEARTBEAT_DIR), exist_ok=True)
            except OSError:   # a full disk: the run's own writes report it; the watchdog still watches
                pass
            self._thread = threading.Thread(target=self._watch, name="meshtrain-watchdog", daemon=True)
            self._thread.start()

    @property
    def armed(self) -> bool:
        """Whether the thread runs: several processes, a supervisor, or an explicit --hang-timeout."""
        return self.processes > 1 or os.environ.get(ENV_ATTEMPT) is not None or self.hang_timeout is not None

    def bound(self) -> float:
        if self.step is None:   # compiling the step (or restoring): never less than STARTUP_S
            return max(self.hang_timeout or 0.0, STARTUP_S)
        return hang_bound(list(self.intervals), self.hang_timeout)

    def on_step(self, run: Run, info: StepInfo) -> None:
        now = time.monotonic()
        # from one step's hooks to the next: everything a process does besides the step counts
        interval, first, self._last = now - self._last, self.step is None, now
        self.step = info.step
        if not first:
            self.intervals.append(interval)
            self.window.append([max(interval - info.step_time_s, 0.0), info.step_time_s])
        elif os.environ.get(ENV_ATTEMPT) is not None and run.is_main:
            try:   # the supervisor's log (RTO); a full disk is reported by the run's own writes
                append_event(run.run_dir, {"event": "first_step", "attempt": self.attempt, "step": info.step,
                                           "resumed_from": run.start, "unix": time.time()})
            except OSError:
                pass
        if self.processes > 1 and (info.step % STRAGGLER_EVERY == 0 or info.last):   # the same steps everywhere
            self._report_stragglers(run, info.step)
        self._inject(run, info.step)

    def on_end(self, run: Run) -> None:
        self._stop.set()   # the final save and summary are not steps

    def close(self, run: Run) -> None:
        self._stop.set()
        if self.disk_faults is not None:
            self.disk_faults.disarm()   # an injected fault does not outlive its run
        if self._thread is not None:
            self._thread.join(timeout=2 * POLL_S)

    # -- stragglers -------------------------------------------------------------------------------
    def _report_stragglers(self, run: Run, step: int) -> None:
        import numpy as np
        from jax.experimental import multihost_utils

        mine = np.asarray(self.window or [[0.0, 0.0]], np.float64).mean(axis=0)
        self.window = []
        # every process reaches this step: one tiny host collective
        every = np.asarray(multihost_utils.process_allgather(mine.astype(np.float32))).reshape(-1, 2)
        host, step_s = every[:, 0], every[:, 1]
        interval = float(statistics.median(list(self.intervals)[-STRAGGLER_EVERY:])) if self.intervals else 0.0
        slow = [i for i in range(len(host))
                if host[i] - float(np.median(np.delete(host, i))) > self.straggler_fraction * interval]
        if not slow:
            return
        run.writer.write({"event": "stragglers", "step": step, "processes": slow,
                          "host_s_per_step": [round(float(h), 4) for h in host],
                          "step_s_per_step": [round(float(s), 4) for s in step_s], "median_interval_s": interval})
        run.progress.print(f"straggler at step {step}: " + ", ".join(
            f"process {i} spends {host[i]:.2f} s/step on the host (others {float(np.median(np.delete(host, i))):.2f})"
            for i in slow) + f"; the step interval is {interval:.2f} s")

    # -- faults (tests, benchmarks) ---------------------------------------------------------------
    def _inject(self, run: Run, step: int) -> None:
        for fault in self.faults:
            if fault.process != self.process:
                continue
            if fault.kind is FaultKind.SLOW and step >= fault.step:
                time.sleep(fault.seconds)
            elif fault.kind not in (FaultKind.SLOW, FaultKind.FULL) and step == fault.step:
                append_event(run.run_dir, {"event": "fault", "kind": fault.kind.value, "step": step,
                                           "process": self.process, "attempt": self.attempt, "unix": time.time()})
                sys.stdout.flush()
                if fault.kind is FaultKind.LOSE:   # the host's memory goes with it
                    shutil.rmtree(peers.process_folder(Path(run.run_dir) / "checkpoints", self.process),
                                  ignore_errors=True)
                os.kill(os.getpid(), signal.SIGSTOP if fault.kind is FaultKind.STOP else signal.SIGKILL)

    def _fault_event(self, run: Run, fault: Fault):
        def fire(step: int) -> None:
            append_event(run.run_dir, {"event": "fault", "kind": fault.kind.value, "step": step,
                                       "process": self.process, "attempt": self.attempt, "unix": time.time()})
        return fire

    # -- the thread -------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            self._heartbeat()
            elapsed = time.monotonic() - self._last
            if elapsed > self.bound() and not self._stop.is_set():
                self._expire(elapsed)

    def _heartbeat_path(self, process: int) -> str:
        return os.path.join(self.run.run_dir, HEARTBEAT_DIR, f"process-{process}.json")

    def _heartbeat(self) -> None:
        path = self._heartbeat_path(self.process)
        try:
            with open(path + ".tmp", "w") as f:
                json.dump({"process": self.process, "pid": os.getpid(), "step": self.step,
                           "alive_unix": time.time()}, f)
            os.replace(path + ".tmp", path)
        except OSError:   # a full disk must not kill the run from here; the run's own writes report it
            pass

    def slow_processes(self) -> List[str]:
        """The processes to blame, each with why: stale heartbeat, behind, or no heartbeat at all."""
        beats = {}
        for i in range(self.processes):
            try:
                with open(self._heartbeat_path(i)) as f:
                    beats[i] = json.load(f)
            except (OSError, ValueError):
                beats[i] = None
        steps = [b["step"] for b in beats.values() if b and b.get("step") is not None]
        top, now, out = max(steps) if steps else None, time.time(), []
        for i, b in beats.items():
            if i == self.process:
                continue
            if b is None:
                out.append(f"process {i} (no heartbeat file)")
            elif now - b["alive_unix"] > STALE_POLLS * POLL_S + 1.0:
                out.append(f"process {i} (not running: no heartbeat for {now - b['alive_unix']:.0f} s, "
                           f"last step {b['step']})")
            elif top is not None and (b.get("step") is None or b["step"] < top):
                out.append(f"process {i} (behind: at step {b['step']}, others at {top})")
        return out

    def _expire(self, elapsed: float) -> None:
        frame = sys._current_frames().get(threading.main_thread().ident)
        stack = traceback.extract_stack(frame) if frame is not None else []
        ours = [f for f in stack if f"{os.sep}meshtrain{os.sep}" in f.filename] or stack
        where = (f"{ours[-1].filename}:{ours[-1].lineno} in {ours[-1].name}" if ours else "unknown")
        slow = self.slow_processes() if self.processes > 1 else []
        blame = ("slow: " + "; ".join(slow) + "; ") if slow else (
            "every process's watchdog is alive at the same step: the hang is in all of them; "
            if self.processes > 1 else "")
        path = os.path.join(self.run.run_dir, f"hang-{self.process}.txt")
        line = (f"watchdog: process {self.process} completed no step for {elapsed:.0f} s (bound "
                f"{self.bound():g} s) after step {self.step if self.step is not None else 'none (compiling)'}; "
                f"{blame}main thread stuck at {where}; every thread's stack in {path}")
        try:
            with open(path, "w") as f:
                f.write(line + "\n\nmain thread, innermost last:\n" + "".join(traceback.format_list(stack))
                        + "\nall threads (faulthandler):\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
        except OSError:
            pass
        print(f"error: {line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_HANG)
