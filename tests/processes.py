"""Every process a test starts goes through here: each wait is bounded, and a process that outlives
its bound is killed with everything it started.

Why a module of its own: a test that blocks on ``proc.stderr.read()`` or ``proc.wait()`` without a
timeout can hang a whole CI run (issue 18: a SIGINT sent to a child that inherited ``SIG_IGN``
trained on for 83 minutes). ``tests/test_suite_rules.py`` fails if a test file calls ``subprocess``
directly, so new tests cannot bring the hazard back.

Children start in a session of their own (``start_new_session``) so that a kill on expiry reaches
their own children too (``meshtrain launch`` workers, multi-process runs). Signal dispositions:
``conftest.py`` gives the test process a Python SIGINT handler, which ``exec`` turns into the
default, so no child inherits an ignored SIGINT from however the suite itself was started.

Usage::

    out = processes.run([sys.executable, "-m", "meshtrain", "plan", ...], timeout=300)
    assert out.returncode == 0, out.stderr

    proc = processes.start([...], stdout=subprocess.PIPE)   # a Popen
    ...
    code, out, err = processes.finish(proc, timeout=120)     # communicate, kill on expiry
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from typing import Optional, Sequence

#: Generous bound for one CLI call on a busy 2-core machine; pass a tighter one where it fits.
DEFAULT_TIMEOUT_S = 600

#: XLA flags of every program the suite compiles, in the test process and in each child; compiling is most
#: of the suite's CPU time. (1) LLVM at -O0 cuts XLA:CPU's compile time by ~30-40 % (tools/bench_compile.py
#: --opt-levels). (2) XLA:CPU's older elemental emitters instead of its MLIR fusion emitters
#: (``--xla_cpu_use_fusion_emitters=false``): a tiny train step compiles in 0.73-1.21 CPU s instead of
#: 2.67-3.33 (dp, fsdp, fsdp_tp, pp), and test_parity + test_pipeline went from 163 to 91 CPU s. The HLO's
#: collectives, shardings and argument bytes are the same; XLA forms fewer, larger loop fusions (tiny fsdp:
#: 289 against 331) and its temp bytes move by < 0.5 % (fsdp +0.04 %, pp -0.3 %), inside every estimate's
#: tolerance. A computed value may differ in the last bits from a user's run (other code), which no test
#: compares across the two: a test compares runs of one suite. (3) One LLVM module per program
#: (``--xla_cpu_parallel_codegen_split_count=1``): XLA:CPU splits it to compile the parts on several threads,
#: which on the suite's 2 busy cores only adds work: a tiny fsdp step 0.69 -> 0.57 CPU s (median of 5,
#: ``Lowered.compile(compiler_options=...)`` alternated in one process); the generated code is the same.
#: (4) No intra-op Eigen thread pool (``--xla_cpu_multi_thread_eigen=false``): with six workers and their
#: children on 2 cores the pool's threads only contend (and spin while they wait for work): test_parity +
#: test_fp8 in one process took 64.3+6.2 and 65.9+5.9 user+sys CPU s with it against 69.3+5.9 and 71.0+6.7
#: without (alternated; -6 %). The programs are the same; a step's matmuls run on the calling thread.
#: ``MESHTRAIN_TEST_XLA_OPT=default`` leaves XLA's own settings (what a user's run compiles with).
TEST_XLA_FLAGS = ("" if os.environ.get("MESHTRAIN_TEST_XLA_OPT") == "default"
                  else "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                       "--xla_cpu_parallel_codegen_split_count=1 --xla_cpu_multi_thread_eigen=false")

#: For a child that mostly runs steps rather than compiling them (the main job's 25 `small` steps):
#: XLA's own LLVM level. There -O0 costs more CPU than it saves (main job: 51-54 user s at -O0, 36-38
#: at -O3, 34 at -O1; a tiny pp_fsdp run of 3 steps: 11.8 at -O0, 16.6 at -O3).
RUNS_MORE_THAN_COMPILES = "--xla_backend_optimization_level=3"


def with_test_xla_flags(env: Optional[dict]) -> Optional[dict]:
    """``env`` with :data:`TEST_XLA_FLAGS` in its ``XLA_FLAGS`` (``None``: the inherited environment, which
    conftest already gave them). A test that drops ``XLA_FLAGS`` from a child's environment (to leave
    out a device-count flag) still compiles like the rest of the suite."""
    if env is None or not TEST_XLA_FLAGS:
        return env
    flags = env.get("XLA_FLAGS", "")
    if "--xla_backend_optimization_level" in flags:
        return env
    return dict(env, XLA_FLAGS=f"{flags} {TEST_XLA_FLAGS}".strip())

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT
CompletedProcess = subprocess.CompletedProcess


class ProcessTimeout(AssertionError):
    """A child outlived its bound; it and its process group were killed. Fails the test with the
    tail of what it printed."""


def start(args: Sequence[str], *, text: bool = True, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` in a new session (so :func:`kill` reaches the child's children)."""
    kwargs.setdefault("start_new_session", True)
    kwargs["env"] = with_test_xla_flags(kwargs.get("env"))
    proc = subprocess.Popen(list(args), text=text, **kwargs)
    proc.own_group = kwargs["start_new_session"]  # its pid is its process group's id
    return proc


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (or the child alone if it shares ours) and reap it."""
    try:
        if getattr(proc, "own_group", False):
            os.killpg(proc.pid, signal.SIGKILL)  # also after the child itself exited: its children
        elif proc.poll() is None:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process that survives SIGKILL
        pass


def finish(proc: subprocess.Popen, timeout: float = DEFAULT_TIMEOUT_S, input: Optional[str] = None):
    """``proc.communicate`` bounded by ``timeout``; returns ``(returncode, stdout, stderr)``.

    On expiry the process group is killed and :class:`ProcessTimeout` names the command and shows
    the tail of its output.
    """
    try:
        out, err = proc.communicate(input=input, timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        out, err = proc.communicate(timeout=30)
        raise ProcessTimeout(f"{' '.join(map(str, proc.args))[:300]} ran past {timeout:.0f} s and was killed; "
                             f"stdout tail: {_tail(out)!r}; stderr tail: {_tail(err)!r}") from None
    return proc.returncode, out, err


def wait(proc: subprocess.Popen, timeout: float = DEFAULT_TIMEOUT_S) -> int:
    """``proc.wait`` bounded by ``timeout`` (for children whose output goes to files or DEVNULL)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        raise ProcessTimeout(f"{' '.join(map(str, proc.args))[:300]} ran past {timeout:.0f} s and was killed") from None


def run(args: Sequence[str], *, timeout: float = DEFAULT_TIMEOUT_S, input: Optional[str] = None,
        capture_output: bool = True, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` with a bound that kills the whole process group on expiry."""
    if capture_output:
        kwargs.setdefault("stdout", PIPE)
        kwargs.setdefault("stderr", PIPE)
    if input is not None:
        kwargs.setdefault("stdin", PIPE)
    proc = start(args, **kwargs)
    code, out, err = finish(proc, timeout, input=input)
    done = subprocess.CompletedProcess(proc.args, code, out, err)
    if check:
        done.check_returncode()
    return done


def slowdown(cpu_seconds: float = 0.2) -> float:
    """How many times slower than on an idle core a single thread runs on this machine now (>= 1):
    the wall time of a busy loop over the CPU time it got. ~1 on an idle machine, ~load / cores on a
    busy one. A test whose child must finish something within a bound (a hang timeout, a straggler's
    sleep) multiplies the bound it was tuned with on an idle machine by this (:func:`scaled`)."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while time.process_time() - cpu0 < cpu_seconds:
        sum(range(10_000))
    return max(1.0, (time.perf_counter() - wall0) / max(time.process_time() - cpu0, 1e-9))


def scaled(seconds: float, margin: float = 2.0) -> int:
    """``seconds`` (a bound that holds on an idle machine) times the measured :func:`slowdown`, times
    ``margin`` for the load rising during the test, rounded up to whole seconds."""
    return int(math.ceil(seconds * slowdown() * margin))


def _tail(data, n: int = 2000):
    if data is None:
        return ""
    if isinstance(data, bytes):
        data = data.decode(errors="replace")
    return data[-n:]
