"""``meshtrain launch``: run a meshtrain command as N cooperating processes on this machine.

Example (2 processes × 4 simulated CPU devices = one 8-device mesh)::

    meshtrain launch --processes 2 --devices-per-process 4 -- train --model tiny --recipe hsdp --steps 10

Every process gets ``MESHTRAIN_COORDINATOR=127.0.0.1:PORT``, ``MESHTRAIN_NUM_PROCESSES=N``,
``MESHTRAIN_PROCESS_ID=i`` and ``JAX_NUM_CPU_DEVICES=M`` (JAX on CPU; gloo collectives). Process 0
writes to this terminal as usual; the lines every process writes to stderr (and the others to
stdout) carry a ``[i]`` prefix. SIGTERM / SIGINT / SIGHUP sent to the launcher go to every process
(SIGTERM: all stop after the same step, save a checkpoint and exit 0). When one process fails, the
others get SIGTERM and, after ``--grace`` seconds, SIGKILL; the launcher exits with the first
failure's status (128 + signal for a process killed by a signal), else 0.
With ``--max-restarts K`` the launcher also restarts the whole job (new coordinator, ``--resume
latest``) when a process dies, hangs (the watchdog's exit 75) or the coordinator is lost, up to K
times, and logs each attempt to ``<run>/events.jsonl`` (:mod:`meshtrain.supervisor`).
No process outlives the launcher, even one killed by SIGKILL: each process dies with it (a
parent-death signal) and a guard process kills what is left and removes the run's in-memory peer
copies (:mod:`meshtrain.commands.launch_guard`).
For clusters use the templates in ``recipes/launch/`` (SLURM, GKE/JobSet) instead.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import List, Optional

from meshtrain import distributed, supervisor
from meshtrain.checkpoint import peer_folders
from meshtrain.commands import launch_fit, launch_guard, train
from meshtrain.commands.common import COMMANDS
from meshtrain.commands.run_flags import Resolved, add_config_args
from meshtrain.errors import ConfigError
from meshtrain.events import ENV_ATTEMPT
from meshtrain.train.preflight import HEADROOM, device_memory_limit
from meshtrain.train.run_config import RunConfig

#: Flags of the launched command that the launcher sets itself.
_OWNED = ("--coordinator", "--num-processes", "--process-id", "--distributed")

#: Memory one launched process needs: the peak RSS of `meshtrain train --model tiny --steps 2` on CPU,
#: measured with /usr/bin/time -v and /proc/PID/smaps_rollup: 640 MiB alone (1 simulated device),
#: 655 MiB (8 devices), 615 MiB (4), 570 MiB as one of 2 launched processes (about 460 MiB of it
#: private, the rest shared libraries). Mostly the interpreter with JAX and XLA: any command costs this.
PROCESS_BYTES = 640 * 2 ** 20

#: What the pre-flight helper needs of a device to read the host's memory: a CPU device has the
#: host's RAM (the launcher itself starts no JAX backend: that would take seconds and memory).
_HOST = types.SimpleNamespace(platform="cpu")


def add_parser(sub):
    p = sub.add_parser("launch", help="run a command as N local processes (multi-process on one machine)",
                       description=__doc__.split("\n\n")[0] + " Example: meshtrain launch --processes 2 "
                       "--devices-per-process 4 -- train --model tiny --recipe hsdp --steps 10",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, required=True, help="number of processes to start")
    p.add_argument("--devices-per-process", type=int, default=None,
                   help="simulated CPU devices in each process (default: 8, or JAX_NUM_CPU_DEVICES)")
    p.add_argument("--port", type=int, default=0, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("--init-timeout", type=float, default=60.0,
                   help="seconds each process waits for the coordinator and its peers (default 60)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="after a failure, seconds the other processes get between SIGTERM and SIGKILL (default 10)")
    p.add_argument("--max-restarts", type=int, default=None, metavar="K",
                   help="restart the whole job from its last checkpoint (--resume latest) when a process dies, "
                        "hangs or loses the coordinator, up to K times; needs the command's --out (default: no "
                        "restarts)")
    p.add_argument("--restart-backoff", type=float, default=1.0, metavar="SECONDS",
                   help="seconds to wait before each restart (default 1)")
    p.add_argument("--elastic", action="store_true",
                   help="with --max-restarts: each restart runs on fewer processes (the largest count that divides "
                        "--processes), the mesh re-resolved and --grad-accum scaled to keep the global batch")
    add_config_args(p)   # passed to the launched command (--config FILE and every --set after its own flags)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the meshtrain command to run in every process, after --, e.g. -- train --steps 10")
    p.set_defaults(run=run, setup_devices=False)


def host_memory_bytes() -> Optional[int]:
    """This host's physical memory (``None``: unknown), read as ``meshtrain train``'s pre-flight does."""
    return device_memory_limit(_HOST, 1)


def check_host_memory(processes: int, host_bytes: Optional[int], per_process: int = PROCESS_BYTES) -> None:
    """Refuse ``--processes`` that cannot fit in ``host_bytes`` (``None``: unknown, not checked),
    before any process starts: each needs ~``per_process`` bytes, and ``HEADROOM`` of the memory is usable
    (as for devices in :mod:`meshtrain.train.preflight`)."""
    if host_bytes is None or processes * per_process <= HEADROOM * host_bytes:
        return
    fit = int(HEADROOM * host_bytes // per_process)
    raise ConfigError(f"--processes {processes}: each meshtrain process needs ~{per_process / 2 ** 30:.2f} GiB "
                      f"(peak memory of `meshtrain train --model tiny`), {processes} need "
                      f"~{processes * per_process / 2 ** 30:.1f} GiB but this host has {host_bytes / 2 ** 30:.1f} GiB "
                      f"({HEADROOM:.0%} usable); use --processes {fit} or fewer (each with more --devices-per-process), "
                      f"or spread the processes over hosts (recipes/launch/)")


def _check_numbers(args) -> None:
    if args.processes < 1:
        raise ConfigError(f"--processes {args.processes}: give at least 1")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        raise ConfigError(f"--devices-per-process {args.devices_per_process}: give at least 1")
    if not (math.isfinite(args.grace) and args.grace >= 0):
        raise ConfigError(f"--grace {args.grace:g}: give the seconds (>= 0; 0 kills at once) the other processes "
                          f"get between SIGTERM and SIGKILL after a failure")
    if not (math.isfinite(args.init_timeout) and args.init_timeout > 0):
        raise ConfigError(f"--init-timeout {args.init_timeout:g}: give a positive number of seconds")
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port {args.port}: give a TCP port 1..65535, or 0 for a free one")


def _command(args) -> List[str]:
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    _check_numbers(args)
    if not cmd or cmd[0] not in COMMANDS or cmd[0] == "launch":
        raise ConfigError(f"give the meshtrain command to launch after --, e.g. `meshtrain launch --processes 2 "
                          f"-- train --steps 10` (one of: {', '.join(c for c in COMMANDS if c != 'launch')})"
                          + (f"; got {cmd[0]!r}" if cmd else ""))
    for flag in _OWNED:
        if any(a == flag or a.startswith(flag + "=") for a in cmd):
            raise ConfigError(f"{flag} is set by `meshtrain launch` for each process; remove it from the command")
    for i, a in enumerate(cmd):
        if a == "--devices" or a.startswith("--devices="):
            value = a.partition("=")[2] or (cmd[i + 1] if i + 1 < len(cmd) else "")
            if args.devices_per_process is not None and value != str(args.devices_per_process):
                raise ConfigError(f"--devices {value} in the command and --devices-per-process "
                                  f"{args.devices_per_process} disagree; give the per-process count once")
    return cmd


class _Relay(threading.Thread):
    """Copies a child's pipe to our stream line by line with a ``[i] `` prefix."""

    lock = threading.Lock()

    def __init__(self, pipe, out, prefix: bytes):
        super().__init__(daemon=True)
        self.pipe, self.out, self.prefix = pipe, out, prefix

    def run(self):
        for line in iter(self.pipe.readline, b""):
            with self.lock:
                self.out.write(self.prefix + line)
                self.out.flush()
        self.pipe.close()


def _status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _say(text: str) -> None:
    with _Relay.lock:
        sys.stderr.buffer.write(f"[launch] {text}\n".encode())
        sys.stderr.buffer.flush()


class Guard:
    """The launcher's side of :mod:`~meshtrain.commands.launch_guard`: starts the guard process and
    tells it the processes and folders that must not outlive the launcher."""

    def __init__(self):
        # its own session: a terminal's Ctrl-C or a kill of the launcher's process group spares it
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", launch_guard.__file__, "guard"],
                                     stdin=subprocess.PIPE, start_new_session=True)

    def note(self, text: str) -> None:
        try:
            self.proc.stdin.write(text.encode() + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):   # the guard is gone (killed by someone): the parent-death signal remains
            pass

    def close(self) -> None:
        """The launcher finishes normally: the guard leaves without touching anything."""
        self.note("bye")
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ProcessGroup:
    """N child processes supervised together: output relayed with ``[i]`` prefixes, signals forwarded,
    the others stopped (SIGTERM, then SIGKILL after ``grace`` seconds) when one fails.

    ``ProcessGroup([argv0, argv1], [env0, env1], grace=10).run()`` returns the first failure's exit
    status (``128 + signal`` for a process killed by a signal), or 0 when every process succeeded.
    """

    def __init__(self, argvs: List[List[str]], envs: List[dict], grace: float = 10.0, quiet: bool = False,
                 guard: Optional[Guard] = None):
        self.argvs, self.envs, self.grace, self.quiet, self.guard = argvs, envs, grace, quiet, guard
        self.procs: List[subprocess.Popen] = []
        self._relays: List[_Relay] = []
        self._signals = 0
        self.first: Optional[tuple] = None  # (process, returncode) of the first failure

    @property
    def signalled(self) -> bool:
        """Whether the launcher itself received SIGTERM/SIGINT/SIGHUP (and forwarded it)."""
        return self._signals > 0

    def start(self) -> None:
        out, err = sys.stdout.buffer, sys.stderr.buffer
        sys.stdout.flush()
        for i, (argv, env) in enumerate(zip(self.argvs, self.envs)):
            # Own session: a terminal's Ctrl-C reaches the launcher only, which forwards it once.
            # Started through launch_guard: it dies with this process, even one killed by SIGKILL.
            p = subprocess.Popen(launch_guard.child_argv(argv), env=env, stdout=None if i == 0 else subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True)
            self.procs.append(p)
            if self.guard is not None:
                self.guard.note(f"pid {p.pid}")
            prefix = f"[{i}] ".encode()
            self._relays.append(_Relay(p.stderr, err, prefix))
            if i:
                self._relays.append(_Relay(p.stdout, out, prefix))
        for r in self._relays:
            r.start()

    def forward(self, signum, frame=None) -> None:
        """Send ``signum`` to every live process; a second SIGINT/SIGHUP becomes SIGKILL."""
        self._signals += 1
        sig = signum if self._signals == 1 or signum == signal.SIGTERM else signal.SIGKILL
        for p in self.procs:
            self._send(p, sig)

    @staticmethod
    def _send(p: subprocess.Popen, sig) -> None:
        if p.poll() is None:
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass

    def supervise(self) -> int:
        first: Optional[tuple] = None
        kill_at: Optional[float] = None
        while True:
            codes = [p.poll() for p in self.procs]
            if first is None:
                # Several found failed at once: a process killed by a signal is the cause, the others' errors
                # (a collective that lost its peer) follow from it.
                failed = sorted(((i, rc) for i, rc in enumerate(codes) if rc not in (None, 0)), key=lambda f: f[1] > 0)
                if failed:
                    first = failed[0]
                    live = [j for j, c in enumerate(codes) if c is None]
                    self._say(f"process {first[0]} exited with status {_status(first[1])}"
                              + (f"; stopping processes {', '.join(map(str, live))} (SIGTERM, SIGKILL after "
                                 f"{self.grace:g} s)" if live else ""))
                    for j in live:
                        self._send(self.procs[j], signal.SIGTERM)
                        self._send(self.procs[j], signal.SIGCONT)  # a stopped (hung) process gets it too
                    kill_at = time.monotonic() + self.grace
            if all(c is not None for c in codes):
                break
            if kill_at is not None and time.monotonic() >= kill_at:
                for j, p in enumerate(self.procs):
                    if p.poll() is None:
                        self._say(f"process {j} did not stop within {self.grace:g} s; killing it")
                        p.kill()
                kill_at = None
            time.sleep(0.05)
        self.first = first
        return _status(first[1]) if first else 0

    def close(self) -> None:
        for p in self.procs:  # never leave a child behind (e.g. the launcher itself failed)
            if p.poll() is None:
                p.kill()
                p.wait()
            if self.guard is not None:
                self.guard.note(f"gone {p.pid}")
        for r in self._relays:
            r.join(timeout=5)

    def run(self) -> int:
        """Start, forward SIGTERM/SIGINT/SIGHUP while waiting, return the exit status."""
        previous = {s: signal.signal(s, self.forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            self.start()
            self._say(f"{len(self.procs)} processes: pids {' '.join(str(p.pid) for p in self.procs)}")
            return self.supervise()
        finally:
            self.close()
            for s, h in previous.items():
                signal.signal(s, h)

    def _say(self, text: str) -> None:
        if not self.quiet:
            _say(text)


class _CommandParser(argparse.ArgumentParser):
    """Parses the launched command as the child would (no abbreviations); an error is the launcher's."""

    def __init__(self, *a, **k):
        k.setdefault("allow_abbrev", False)
        super().__init__(*a, **k)

    def error(self, message):
        raise ConfigError(f"the launched command: {message}")


def parse_command(cmd: List[str]) -> argparse.Namespace:
    """The arguments of a launched ``train ...`` command, parsed as the child would."""
    parser = _CommandParser(prog="meshtrain")
    train.add_parser(parser.add_subparsers(dest="command", parser_class=_CommandParser))
    return parser.parse_args(cmd)


def parse_train(cmd: List[str]) -> Resolved:
    """The run configuration of a launched ``train ...`` command (its flags, --config and --set)."""
    return train.resolve_args(parse_command(cmd))


def with_config_args(args, cmd: List[str]) -> List[str]:
    """``cmd`` with the launcher's ``--config``/``--set`` (none given: ``cmd`` as it is)."""
    if not args.config and not args.set_values:
        return cmd
    if args.config and any(a == "--config" or a.startswith("--config=") for a in cmd):
        raise ConfigError("--config is given to both `meshtrain launch` and the launched command; give it once")
    extra = (["--config", args.config] if args.config else []) + [x for v in args.set_values or () for x in ("--set", v)]
    return cmd + extra


def peer_folder(cmd: List[str]) -> Optional[Path]:
    """The RAM folder of the launched run's in-memory peer copies (``train --out``), else None."""
    if cmd[0] != "train":
        return None
    try:
        out = parse_train(cmd).config.checkpoint.out
    except ConfigError:   # the children report it
        return None
    return peer_folders.store_folder(Path(out).expanduser().absolute() / "checkpoints") if out else None


def run(args) -> int:
    cmd = with_config_args(args, _command(args))
    check_host_memory(args.processes, host_memory_bytes())
    if args.elastic and args.max_restarts is None:
        raise ConfigError("--elastic applies to restarts: add --max-restarts K")
    if args.max_restarts is not None:
        supervisor.check_command(cmd[0], parse_train(cmd).config if cmd[0] == "train" else RunConfig(),
                                 args.max_restarts, args.restart_backoff)
    guard = Guard()
    try:
        folder = peer_folder(cmd)
        if folder is not None:
            guard.note(f"dir {folder}")
        return _run(args, cmd, guard)
    finally:
        guard.close()


def _run(args, cmd: List[str], guard: Guard) -> int:
    if args.max_restarts is None:
        return _attempt(args, cmd, args.port, guard=guard)[0]
    # The supervisor changes the typed configuration (resume, gradient accumulation) and hands each
    # attempt's children `train --config <run>/launch/attempt-<k>.yaml`.
    parsed = parse_command(cmd)
    resolved = train.resolve_args(parsed)
    config, given = resolved.config, resolved.given
    config.train_config()   # a value the children would refuse is refused here, once
    run_dir = supervisor.check_command(cmd[0], config, args.max_restarts, args.restart_backoff)
    if args.port and args.max_restarts:
        _say(f"--port {args.port} is used for the first attempt; restarts take a free port (the old one may linger)")
    if not config.checkpoint.ckpt_every:
        _say("the command saves no checkpoints before its last step (no --ckpt-every N): a restart starts again "
             "from step 0")
    layouts = supervisor.elastic_layouts(config, given, args.processes) if args.elastic else None
    passed = ["--xla-flags", parsed.xla_flags]   # process set-up, not run configuration

    def layout(k: int) -> supervisor.Layout:
        return layouts[min(k, len(layouts) - 1)]

    def attempt(k: int):
        child = supervisor.attempt_config(config, k, layout(k) if layouts and k else None)
        path = supervisor.write_attempt_config(run_dir, k, child, given)
        n = layout(k).processes if layouts and k else args.processes
        return _attempt(args, ["train", "--config", path, *passed], args.port if not k else 0, k, processes=n,
                        guard=guard)

    def explain(k: int, status: int) -> Optional[str]:
        """Why a shrunk attempt exited 2, when it is the memory check: the smallest device count that fits."""
        host = host_memory_bytes()
        if not layouts or not k or layout(k) == layout(0) or status != 2 or host is None:
            return None
        per = args.devices_per_process or int(os.environ.get("JAX_NUM_CPU_DEVICES") or 8)
        try:
            fits = launch_fit.check_layouts(config.to_dict(only=given), layouts, per, host)
        except (OSError, subprocess.SubprocessError, ValueError, TypeError):
            return None
        return launch_fit.explain(fits, layout(k), per)

    return supervisor.Supervisor(attempt, run_dir, args.max_restarts, args.restart_backoff, _say,
                                 layout=layout if layouts else None, explain=explain).run()


def _attempt(args, cmd: List[str], port: int, attempt: Optional[int] = None, processes: Optional[int] = None,
             guard: Optional[Guard] = None):
    """Run ``cmd`` once in every process: (exit status, first failing process, launcher signalled)."""
    n = processes or args.processes
    port = port or distributed.free_port()
    env = dict(os.environ)
    for name in (distributed.ENV_BIND, "JAX_COORDINATOR_ADDRESS"):
        env.pop(name, None)
    env.update({distributed.ENV_MODE: "on", distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
                distributed.ENV_NUM_PROCESSES: str(n), distributed.ENV_TIMEOUT: f"{args.init_timeout:g}",
                "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"})
    if args.devices_per_process is not None:
        env["JAX_NUM_CPU_DEVICES"] = str(args.devices_per_process)
    if attempt is not None:
        env[ENV_ATTEMPT] = str(attempt)
    _say(f"coordinator 127.0.0.1:{port}")
    argv = [sys.executable, "-m", "meshtrain", *cmd]
    group = ProcessGroup([argv] * n, [dict(env, **{distributed.ENV_PROCESS_ID: str(i)}) for i in range(n)],
                         grace=args.grace, guard=guard)
    status = group.run()
    return status, (group.first[0] if group.first else None), group.signalled

