"""One long-lived child that runs many probe cases through ``meshtrain.cli.main`` in its own process,
one after the other: ``tools/probe_bad_input.py --share-process`` sends it the cases that are nothing
but CLI arguments (no shell prefix, no Python snippet, no setup, no Ctrl-C), so each costs the CLI's
own work rather than a fresh interpreter's imports (~2 CPU s a case on a busy machine).

Per case, what a fresh ``python -m meshtrain ARGV`` would show is kept: file descriptors 1 and 2 go
to the case's own files (so C-level writes and ``warnings`` are captured too), the exit status is
``main``'s return value or ``SystemExit``'s code, an exception that escapes ``main`` prints its
traceback (and exits 1) as the interpreter would, the working directory is the case's folder, and
the environment carries the case's ``MESHTRAIN_PROBE_CASE`` marker (so processes it leaves alive are
found). After the case the environment, the folder, the signal handlers and the warning filters are
put back. What one process cannot give a case: a JAX backend started afresh (the device count is the
first case's, 8 simulated CPUs) -- cases that need that, a signal or a resource limit stay separate
processes.

    worker = Worker(env, cwd)                                  # in the probe (parent) process
    code, out, err, seconds = worker.run(["plan", "--model", "tiny", "--seq-len", "0"], work, marker, 300)
    worker.close()
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
import warnings
from typing import List, Tuple

#: Signals whose handlers a case may change (``train`` guards SIGTERM, ``main`` SIGINT).
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


class Worker:
    """The parent's side: starts the child on first use, sends a case, waits for its status."""

    def __init__(self, env: dict, cwd: str):
        self.env, self.cwd, self.proc = env, cwd, None
        self._count = 0

    def _start(self) -> subprocess.Popen:
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=self.env, cwd=self.cwd,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True, start_new_session=True)
        return self.proc

    def run(self, argv: List[str], work: str, marker: str, timeout: float) -> Tuple[int, str, str, float]:
        """``(exit status, stdout, stderr, seconds)`` of ``meshtrain ARGV`` run in ``work``."""
        proc, t0 = self._start(), time.monotonic()
        self._count += 1
        out_path, err_path = (os.path.join(self.cwd, f"worker-{self._count}.{n}") for n in ("out", "err"))
        proc.stdin.write(json.dumps({"argv": argv, "cwd": work, "marker": marker, "out": out_path,
                                     "err": err_path}) + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        if line:
            code, note = json.loads(line)["code"], ""
        elif not ready:   # ran past its bound: the worker goes, the next case starts a fresh one
            self.kill()
            code, note = 124, f"\n(killed after {timeout:.0f} s)"
        else:             # the worker itself ended (os._exit, a crash): that is the case's status
            code, note = self.proc.wait(timeout=60), ""
            self.proc = None
        out, err = (_read(p) for p in (out_path, err_path))
        return code, out, err + note, time.monotonic() - t0

    def kill(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait(timeout=60)
            self.proc = None

    def close(self) -> None:
        """Ends the child and waits for it (its CPU then counts in this process's children)."""
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
            self.proc = None


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _one_case(main, request: dict) -> int:
    """Runs ``main(argv)`` as ``python -m meshtrain`` would, with fds 1/2 on the case's files."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_signals = {s: signal.getsignal(s) for s in _SIGNALS}
    saved_fds = os.dup(1), os.dup(2)
    with open(request["out"], "wb") as out, open(request["err"], "wb") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    try:
        os.chdir(request["cwd"])
        os.environ["MESHTRAIN_PROBE_CASE"] = request["marker"]
        with warnings.catch_warnings():   # (a fresh warning registry: a warning seen before shows again)
            try:
                code = main(request["argv"])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if exc.code is not None and not isinstance(exc.code, int):
                    print(exc.code, file=sys.stderr)
            except BaseException:   # what the interpreter prints for an exception nothing caught
                traceback.print_exc()
                code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        for sig, handler in saved_signals.items():
            if handler is not None:
                signal.signal(sig, handler)
    return int(code or 0)


def serve(requests=None, reply=None) -> int:
    """The child's loop: one JSON request a line on stdin, one ``{"code": N}`` line back."""
    from meshtrain.cli import main

    requests = requests or sys.stdin
    reply = reply or os.fdopen(os.dup(1), "w")   # (fd 1 itself is each case's stdout)
    for line in requests:
        code = _one_case(main, json.loads(line))
        reply.write(json.dumps({"code": code}) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve())
