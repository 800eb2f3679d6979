"""Multi-process start-up: ``jax.distributed`` from flags, environment variables or the cluster.

The ``meshtrain`` command calls :func:`initialize` before JAX starts its backends, so a training
script needs nothing more than the right environment on every process::

    MESHTRAIN_COORDINATOR=10.0.0.1:12355 MESHTRAIN_NUM_PROCESSES=2 MESHTRAIN_PROCESS_ID=0 meshtrain train ...
    MESHTRAIN_COORDINATOR=10.0.0.1:12355 MESHTRAIN_NUM_PROCESSES=2 MESHTRAIN_PROCESS_ID=1 meshtrain train ...

or, in your own script (first thing, before any JAX computation)::

    from meshtrain import distributed
    info = distributed.initialize()          # reads MESHTRAIN_* / the cluster; None on one process
    print(info.describe() if info else "single process")

Where the three values come from, first match wins: flags (``--coordinator``, ``--num-processes``,
``--process-id``) → ``MESHTRAIN_COORDINATOR`` / ``MESHTRAIN_NUM_PROCESSES`` /
``MESHTRAIN_PROCESS_ID`` (``JAX_COORDINATOR_ADDRESS`` is accepted for the address) → the cluster:
SLURM (inside ``srun``), Open MPI (``mpirun``), TPU VMs on GKE (``TPU_WORKER_HOSTNAMES``), and with
``MESHTRAIN_DISTRIBUTED=on`` anything JAX itself detects (TPU VM metadata, Kubernetes, mpi4py).

``MESHTRAIN_DISTRIBUTED`` (flag ``--distributed``): ``auto`` (default: start when the values above
say there is more than one process), ``on`` (must start; an error if nothing says how), ``off``.
The coordinator (process 0) binds only the coordinator address itself unless
``MESHTRAIN_COORDINATOR_BIND`` (``--coordinator-bind``) names another, e.g. ``0.0.0.0:12355``.
``MESHTRAIN_INIT_TIMEOUT`` (``--init-timeout``, seconds, default 300) bounds the wait for the
coordinator and for all processes to join; past it the process fails with a message naming the
address and the timeout. On CPU (gloo collectives) the same bound covers the processes' first
meeting in their collectives (:func:`_meet`): XLA's own wait there is a fixed 30 s.

When another process dies mid-run, the collective waiting for it fails in this one;
:mod:`meshtrain.peer_errors` turns that error into one line naming the process that stopped answering.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import os
import re
import socket
import sys
import threading
import time
from typing import Dict, Mapping, Optional, Sequence, Tuple

from meshtrain.errors import MeshtrainError

ENV_MODE = "MESHTRAIN_DISTRIBUTED"
ENV_COORDINATOR = "MESHTRAIN_COORDINATOR"
ENV_NUM_PROCESSES = "MESHTRAIN_NUM_PROCESSES"
ENV_PROCESS_ID = "MESHTRAIN_PROCESS_ID"
ENV_BIND = "MESHTRAIN_COORDINATOR_BIND"
ENV_TIMEOUT = "MESHTRAIN_INIT_TIMEOUT"
ENV_PORT = "MESHTRAIN_COORDINATOR_PORT"

DEFAULT_TIMEOUT_S = 300.0
#: Extra seconds JAX gets beyond our own deadline, so that our message comes first (JAX aborts).
_JAX_GRACE_S = 10


class DistributedError(MeshtrainError):
    """Multi-process start-up failed: missing or bad settings, unreachable coordinator, missing peers."""


class Mode(str, enum.Enum):
    """``auto``: start ``jax.distributed`` when flags, environment or cluster say there are several
    processes; ``on``: always (error if nothing says how); ``off``: never (single process)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class Source(str, enum.Enum):
    """Where the coordinator address, process count and process id came from."""

    EXPLICIT = "flags/environment"
    SLURM = "slurm"
    JAX = "jax cluster detection"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """What the user asked for (all optional). Build it with :meth:`from_env` (flags override the
    environment) and pass it to :func:`initialize`.

    Example: ``DistributedConfig(coordinator="127.0.0.1:12355", num_processes=2, process_id=1,
    init_timeout_s=30)``.
    """

    mode: Mode = Mode.AUTO
    coordinator: Optional[str] = None
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    bind: Optional[str] = None
    init_timeout_s: float = DEFAULT_TIMEOUT_S
    #: The run's hang bound (``--hang-timeout``), if any: the coordination service's heartbeat
    #: timeout is kept above it (:func:`heartbeat_timeout_s`).
    hang_timeout_s: Optional[float] = None

    def __post_init__(self):
        try:
            object.__setattr__(self, "mode", Mode(self.mode))
        except ValueError:
            raise DistributedError(f"{ENV_MODE} / --distributed {self.mode!r}: use one of "
                                   f"{[m.value for m in Mode]}") from None
        if self.coordinator is not None:
            _split_address(self.coordinator, "coordinator")
        if self.bind is not None:
            _split_address(self.bind, "coordinator bind address")
        if self.num_processes is not None and self.num_processes < 1:
            raise DistributedError(f"--num-processes / {ENV_NUM_PROCESSES} {self.num_processes}: must be >= 1")
        if not (math.isfinite(self.init_timeout_s) and self.init_timeout_s > 0):  # NaN compares False
            raise DistributedError(f"--init-timeout / {ENV_TIMEOUT} {self.init_timeout_s:g}: must be a positive "
                                   f"number of seconds")

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides) -> "DistributedConfig":
        """The ``MESHTRAIN_*`` variables of ``environ`` (default ``os.environ``); keyword arguments
        that are not ``None`` win (that is how flags override the environment)."""
        env = os.environ if environ is None else environ
        values = {
            "mode": env.get(ENV_MODE) or Mode.AUTO,
            "coordinator": env.get(ENV_COORDINATOR) or env.get("JAX_COORDINATOR_ADDRESS") or None,
            "num_processes": _env_int(env, ENV_NUM_PROCESSES),
            "process_id": _env_int(env, ENV_PROCESS_ID),
            "bind": env.get(ENV_BIND) or None,
            "init_timeout_s": _env_float(env, ENV_TIMEOUT) or DEFAULT_TIMEOUT_S,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The resolved layout of this job, as seen from this process. ``describe()`` prints it."""

    coordinator: str
    num_processes: int
    process_id: int
    source: Source
    bind: Optional[str] = None
    local_device_ids: Optional[Tuple[int, ...]] = None
    detection_method: Optional[str] = None

    def describe(self) -> str:
        return (f"process {self.process_id} of {self.num_processes}, coordinator {self.coordinator}"
                f" (from {self.source.value})")


# -- resolving ------------------------------------------------------------------------------------
def _env_int(env: Mapping[str, str], name: str) -> Optional[int]:
    raw = env.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"{name}={raw!r} is not an integer; set it to e.g. {name}=2") from None


def _env_float(env: Mapping[str, str], name: str) -> Optional[float]:
    raw = env.get(name)
    if raw in (None, ""):
        return None
    try:
        return float(raw)
    except ValueError:
        raise DistributedError(f"{name}={raw!r} is not a number of seconds; set it to e.g. {name}=60") from None


def _split_address(address: str, what: str) -> Tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"{what} {address!r} is not HOST:PORT; write it like 10.0.0.1:12355")
    return host.strip("[]"), int(port)


def _slurm_first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[003-008,011],cpu1`` → ``gpu003``."""
    depth = 0
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            nodelist = nodelist[:i]
            break
    prefix, bracket, rest = nodelist.partition("[")
    if not bracket:
        return prefix
    ranges, _, suffix = rest.partition("]")
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def _from_slurm(env: Mapping[str, str]) -> Optional[Cluster]:
    """Inside ``srun`` (``SLURM_STEP_NUM_TASKS`` is set only for job steps, not in the batch script)."""
    if "SLURM_STEP_NUM_TASKS" not in env or "SLURM_PROCID" not in env:
        return None
    n = int(env["SLURM_STEP_NUM_TASKS"])
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
    port = env.get(ENV_PORT) or env.get("JAX_COORDINATOR_PORT")
    if not port:  # the same on every task of the job, away from the usual ephemeral range start
        port = str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
    tasks_here = int(env.get("SLURM_STEP_TASKS_PER_NODE", "1").split("(")[0].split(",")[0] or 1)
    # Several tasks per node: one accelerator each (by local rank); one task per node: all of them.
    local = (int(env["SLURM_LOCALID"]),) if tasks_here > 1 and "SLURM_LOCALID" in env else None
    return Cluster(f"{_slurm_first_host(nodes)}:{port}", n, int(env["SLURM_PROCID"]), Source.SLURM,
                   local_device_ids=local)


def _cluster_hint(env: Mapping[str, str]) -> Optional[str]:
    """A JAX detection method whose environment says "several processes" (cheap: no network)."""
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "ompi"
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
    if len([h for h in hosts.split(",") if h]) > 1 or int(env.get("MEGASCALE_NUM_SLICES", "1") or 1) > 1:
        return "gketpu"
    return None


def _from_jax(method: Optional[str], timeout_s: float) -> Optional[Cluster]:
    """Ask JAX's cluster detection (SLURM, Open MPI, TPU VMs, Kubernetes) for the values."""
    try:
        from jax._src import clusters  # private: the same code jax.distributed.initialize runs
        found = clusters.ClusterEnv.auto_detect_unset_distributed_params(
            None, None, None, None, method, int(math.ceil(timeout_s)))
    except (ImportError, AttributeError):
        return None
    except Exception as exc:  # noqa: BLE001 - detection code of many clusters; report, don't crash
        raise DistributedError(f"JAX cluster detection ({method or 'any'}) failed: {exc}; set {ENV_COORDINATOR}, "
                               f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} instead") from exc
    address, n, pid, local = found
    if address is None or n is None or pid is None:
        return None
    return Cluster(address, int(n), int(pid), Source.JAX, local_device_ids=tuple(local) if local else None,
                   detection_method=method)


def resolve(config: Optional[DistributedConfig] = None,
            environ: Optional[Mapping[str, str]] = None) -> Optional[Cluster]:
    """This process's :class:`Cluster`, or ``None`` when the run is a single process.

    Pure apart from JAX's cluster detection (only with ``mode=on`` or when the environment names a
    TPU / MPI cluster). Raises :class:`DistributedError` naming the missing setting.
    """
    env = os.environ if environ is None else environ
    cfg = config or DistributedConfig.from_env(env)
    if cfg.mode is Mode.OFF:
        return None
    names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    explicit = (cfg.coordinator, cfg.num_processes, cfg.process_id)
    found = None
    if None in explicit:  # complete explicit settings skip every detection
        found = _from_slurm(env)
        hint = _cluster_hint(env)
        if found is None and (hint or cfg.mode is Mode.ON):
            found = _from_jax(hint, cfg.init_timeout_s)
    if found is None and explicit == (None, None, None):
        if cfg.mode is Mode.ON:
            raise DistributedError(
                f"{ENV_MODE}=on but no coordinator is known: set {ENV_COORDINATOR}=HOST:PORT, "
                f"{ENV_NUM_PROCESSES}=N and {ENV_PROCESS_ID}=I on every process (or run under srun / mpirun)")
        return None
    coordinator = cfg.coordinator or (found.coordinator if found else None)
    n = cfg.num_processes if cfg.num_processes is not None else (found.num_processes if found else None)
    pid = cfg.process_id if cfg.process_id is not None else (found.process_id if found else None)
    missing = [name for name, v in zip(names, (coordinator, n, pid)) if v is None]
    if missing:
        given = ", ".join(f"{k}={v}" for k, v in zip(names, explicit) if v is not None)
        raise DistributedError(f"multi-process start-up needs {', '.join(missing)} too (given: {given}); set them "
                               f"(or the --coordinator / --num-processes / --process-id flags) on every process")
    if not 0 <= pid < n:
        raise DistributedError(f"process id {pid} is outside 0..{n - 1} for {n} processes; give each process a "
                               f"distinct {ENV_PROCESS_ID} from 0 to {n - 1}")
    if n == 1 and cfg.mode is not Mode.ON:
        return None
    source = Source.EXPLICIT if found is None or cfg.coordinator else found.source
    return Cluster(coordinator, n, pid, source, bind=cfg.bind,
                   local_device_ids=found.local_device_ids if found else None,
                   detection_method=found.detection_method if found else None)


# -- starting -------------------------------------------------------------------------------------
_current: Optional[Cluster] = None


def current() -> Optional[Cluster]:
    """The :class:`Cluster` that :func:`initialize` started in this process, or ``None``."""
    return _current


def is_multiprocess() -> bool:
    """True once ``jax.distributed`` runs with more than one process."""
    return _current is not None and _current.num_processes > 1


def _check_bind(address: str, deadline: float) -> None:
    """Fail early and clearly when process 0 cannot listen on ``address`` (port taken, foreign
    address). A host name that does not resolve yet (DNS of a starting pod) is retried until
    ``deadline``."""
    host, port = _split_address(address, "coordinator bind address")
    while True:
        try:
            infos = socket.getaddrinfo(host if host not in ("", "*") else None, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
            break
        except socket.gaierror as exc:
            if time.monotonic() >= deadline:
                raise DistributedError(f"process 0 cannot resolve the coordinator bind address {address}: "
                                       f"{exc.strerror or exc}; set {ENV_BIND} to a local address, e.g. "
                                       f"0.0.0.0:{port}") from None
            time.sleep(0.5)
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
        except OSError as exc:
            raise DistributedError(f"process 0 cannot serve the coordinator on {address}: {exc.strerror or exc}; "
                                   f"pick a free port in {ENV_COORDINATOR} (or a local address in {ENV_BIND})") from None


def _wait_reachable(address: str, deadline: float, who: str, timeout_s: float) -> None:
    host, port = _split_address(address, "coordinator")
    last = "no answer"
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as exc:
            last = exc.strerror or str(exc) or type(exc).__name__
        if time.monotonic() >= deadline:
            raise DistributedError(
                f"{who} cannot reach the coordinator at {address} within {timeout_s:g} s (last error: {last}); "
                f"start process 0 (it serves the coordinator), check that {ENV_COORDINATOR} names its host and "
                f"port and that the port is open between the hosts, or raise {ENV_TIMEOUT} / --init-timeout")
        time.sleep(0.2)


def initialize(config: Optional[DistributedConfig] = None, *, environ: Optional[Mapping[str, str]] = None
               ) -> Optional[Cluster]:
    """Start ``jax.distributed`` when the flags, environment or cluster say so; call it before any
    JAX computation. Returns the :class:`Cluster` (``None`` for a single process). Idempotent.

    Process 0 checks that it can bind the coordinator address; the others wait (until the timeout)
    for it to answer, then all join. If the coordinator is unreachable or not every process joins in
    time, this raises (or, once JAX has started connecting, prints and exits with status 2)
    a message that names the address and the timeout.
    """
    global _current
    if _current is not None:
        return _current
    cluster = resolve(config, environ)
    if cluster is None:
        return None
    import jax

    cfg = config or DistributedConfig.from_env(environ)
    timeout_s = cfg.init_timeout_s
    who = f"process {cluster.process_id} of {cluster.num_processes}"
    deadline = time.monotonic() + timeout_s
    bind = cluster.bind or cluster.coordinator
    if cluster.process_id == 0:
        _check_bind(bind, deadline)
    else:
        _wait_reachable(cluster.coordinator, deadline, who, timeout_s)
    role = "serves" if cluster.process_id == 0 else "reached"
    message = (f"error: {who} {role} the coordinator at {cluster.coordinator}, but not all "
               f"{cluster.num_processes} processes joined within {timeout_s:g} s; start every process with "
               f"{ENV_NUM_PROCESSES}={cluster.num_processes} and a distinct {ENV_PROCESS_ID} in "
               f"0..{cluster.num_processes - 1}, or raise {ENV_TIMEOUT} / --init-timeout")
    done = threading.Event()

    def watchdog():  # JAX aborts (SIGABRT, no Python exception) when connecting times out
        if not done.wait(max(0.0, deadline - time.monotonic())):
            print(message, file=sys.stderr, flush=True)
            os._exit(2)

    threading.Thread(target=watchdog, name="meshtrain-init-watchdog", daemon=True).start()
    try:
        jax.distributed.initialize(
            coordinator_address=cluster.coordinator, num_processes=cluster.num_processes,
            process_id=cluster.process_id, local_device_ids=list(cluster.local_device_ids or []) or None,
            cluster_detection_method="deactivate", coordinator_bind_address=bind,
            initialization_timeout=int(math.ceil(timeout_s)) + _JAX_GRACE_S,
            heartbeat_timeout_seconds=heartbeat_timeout_s(cfg.hang_timeout_s))
    except RuntimeError as exc:
        raise DistributedError(f"{who}: jax.distributed.initialize failed: {exc}; call "
                               f"meshtrain.distributed.initialize() before any JAX computation") from exc
    finally:
        done.set()
    _current = dataclasses.replace(cluster, bind=bind)
    _meet(who, timeout_s)
    # Every process names itself once (a cluster log interleaves them): who, where, which devices.
    print(f"meshtrain: {_current.describe()}; {jax.local_device_count()} local of {jax.device_count()} devices",
          flush=True)
    return _current


#: JAX's default: a process whose heartbeats stop for this long is declared dead and its peers abort.
HEARTBEAT_TIMEOUT_S = 100


def heartbeat_timeout_s(hang_timeout_s: Optional[float]) -> int:
    """The coordination service's heartbeat timeout: JAX's 100 s, or more than twice a longer-than-30-s
    ``--hang-timeout``. A frozen process (SIGSTOP, a stuck host) stops its heartbeats; past this timeout
    the service aborts every peer (SIGABRT, no diagnosis). The heartbeats go out about every half timeout,
    so the abort comes between half of it and all of it after the freeze: kept above twice the hang
    bound, the hang watchdog comes first, names the slow process and exits 75."""
    if hang_timeout_s is None or not (math.isfinite(hang_timeout_s) and hang_timeout_s > 0):
        return HEARTBEAT_TIMEOUT_S   # (a bad --hang-timeout is refused by the command itself)
    return max(HEARTBEAT_TIMEOUT_S, int(math.ceil(2 * hang_timeout_s)) + 30)


#: The coordination-service barrier before the first collectives (one per job: each attempt of a
#: supervised run has a coordinator of its own).
_MEET_BARRIER = "meshtrain-first-collectives"


def _meet(who: str, timeout_s: float) -> None:
    """Connect the cross-process CPU collectives now, with every process present.

    XLA:CPU connects the processes of a device group (gloo) at the group's first collective and
    waits a fixed 30 s there for the others (``GetKeyValue() timed out``; no setting changes it): on
    a loaded host, a process that reaches that collective after a slower restore or compilation
    than its peers' fails the run (``Gloo context initialization failed: DEADLINE_EXCEEDED``), and
    every restart the same way. So: compile two tiny programs, wait at a coordination-service
    barrier bounded by the init timeout, then run them while the processes are milliseconds apart.
    They connect the groups a run's collectives use: all devices (FSDP, data parallel,
    ``broadcast_one_to_all``) and each local device across the processes (``process_allgather``,
    Orbax's barriers, replicas of HSDP); later collectives in a connected group wait as long as
    XLA's collective timeout and the hang watchdog allow.
    """
    import jax
    import numpy as np
    from jax._src import distributed as jax_distributed
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if (jax.process_count() < 2 or jax.default_backend() != "cpu"
            or getattr(jax.config, "jax_cpu_collectives_implementation", None) != "gloo"):
        return
    devices = np.array(jax.devices())
    n = jax.process_count()
    groups = [(Mesh(devices, ("all",)), PartitionSpec("all"), (devices.size,))]
    if devices.size == n * jax.local_device_count():   # (the same device count in every process)
        groups.append((Mesh(devices.reshape(n, -1), ("processes", "local")), PartitionSpec("processes"), (n,)))
    try:
        programs = []
        for mesh, spec, shape in groups:
            x = jax.make_array_from_callback(shape, NamedSharding(mesh, spec),
                                             lambda index, shape=shape: np.zeros(shape, np.int32)[index])
            gather = jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, PartitionSpec()))
            programs.append((gather.lower(x).compile(), x))
        jax_distributed.global_state.client.wait_at_barrier(_MEET_BARRIER, int(math.ceil(timeout_s * 1000)))
        for program, x in programs:
            program(x).block_until_ready()
    except jax.errors.JaxRuntimeError as exc:
        raise DistributedError(f"{who}: the processes did not all reach their first collectives within "
                               f"{timeout_s:g} s ({error_gist(exc)}); raise {ENV_TIMEOUT} / --init-timeout on a "
                               f"busy host, or check that every process is still running") from exc


def error_gist(exc: BaseException, limit: int = 200) -> str:
    """The gist of a runtime error: its first line, without source locations like ``[pair.cc:534]``."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    text = re.sub(r"\[[^\]]*\.(?:cc|h|cpp):\d+\]\s*", "", text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


#: Seconds a failing process waits for its peers to leave together before it exits anyway.
SHUTDOWN_GRACE_S = 5.0


def exit_now(code: int, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Leave a multi-process run with status ``code`` within ``grace_s`` seconds.

    A normal exit waits in ``jax.distributed``'s shutdown barrier (up to minutes) for peers that may
    be stuck in a collective waiting for this process. This tries that barrier for ``grace_s``
    seconds only: peers failing the same way (a bad setting) leave together and each reports its
    own error (process 0 serves the coordination service: leaving first would abort the others
    before they print), then exits regardless."""
    sys.stdout.flush()
    sys.stderr.flush()
    if is_multiprocess():
        import jax

        t = threading.Thread(target=jax.distributed.shutdown, name="meshtrain-shutdown", daemon=True)
        t.start()
        t.join(grace_s)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (for local launches and tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# -- CLI ------------------------------------------------------------------------------------------
def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """``--distributed``, ``--coordinator``, ``--num-processes``, ``--process-id``,
    ``--coordinator-bind``, ``--init-timeout`` (each overrides its ``MESHTRAIN_*`` variable)."""
    g = parser.add_argument_group("multi-process (default: from MESHTRAIN_* variables or the cluster)")
    g.add_argument("--distributed", choices=[m.value for m in Mode], default=None,
                   help=f"start jax.distributed: auto (default), on, off [{ENV_MODE}]")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help=f"address of process 0's coordinator [{ENV_COORDINATOR}]")
    g.add_argument("--num-processes", type=int, default=None, help=f"processes in the job [{ENV_NUM_PROCESSES}]")
    g.add_argument("--process-id", type=int, default=None, help=f"this process, 0..N-1 [{ENV_PROCESS_ID}]")
    g.add_argument("--coordinator-bind", default=None, metavar="HOST:PORT",
                   help=f"where process 0 listens (default: the coordinator address) [{ENV_BIND}]")
    g.add_argument("--init-timeout", type=float, default=None, metavar="SECONDS",
                   help=f"wait this long for the coordinator and all processes (default "
                        f"{DEFAULT_TIMEOUT_S:g}) [{ENV_TIMEOUT}]")


def config_from_args(args: argparse.Namespace) -> DistributedConfig:
    return DistributedConfig.from_env(
        mode=getattr(args, "distributed", None), coordinator=getattr(args, "coordinator", None),
        num_processes=getattr(args, "num_processes", None), process_id=getattr(args, "process_id", None),
        bind=getattr(args, "coordinator_bind", None), init_timeout_s=getattr(args, "init_timeout", None),
        hang_timeout_s=getattr(args, "hang_timeout", None))


# -- hybrid meshes: the layout lives in meshtrain.mesh (reached here for older callers) ----------
_FROM_MESH = ("auto_dcn", "granules", "split_dcn")


def __getattr__(name: str):
    """``distributed.auto_dcn`` etc. load meshtrain.mesh (and JAX) on first use (PEP 562), so the
    launcher and the CLI can read distributed settings without importing JAX."""
    if name in _FROM_MESH:
        from meshtrain import mesh  # lazy: mesh imports JAX; `meshtrain launch` must start without it
        return getattr(mesh, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- stopping together ----------------------------------------------------------------------------
class StopAgreement(str, enum.Enum):
    """How the processes of a run agree on the step after which a SIGTERM stops them all.

    ``local``: one process, its own flag. ``jax-sync-point``: JAX's preemption service (on by default
    with ``jax.distributed``) catches SIGTERM on any process and
    ``multihost_utils.reached_preemption_sync_point(step)`` is True on every process at the same step
    (one past the largest step any process had reached when the notice spread). ``allgather``: the
    service is off (``jax_enable_preemption_service=False``); each process's own SIGTERM flag is
    gathered after every step (one tiny host collective) and the maximum decides.
    """

    LOCAL = "local"
    SYNC_POINT = "jax-sync-point"
    ALLGATHER = "allgather"

    @classmethod
    def current(cls) -> "StopAgreement":
        import jax

        if jax.process_count() == 1:
            return cls.LOCAL
        from jax._src import distributed as jax_distributed  # the sync manager exists only with the service on

        return cls.SYNC_POINT if jax_distributed.global_state.preemption_sync_manager is not None else cls.ALLGATHER

    @property
    def needs_handler(self) -> bool:
        """Whether a Python SIGTERM handler must set the flag (JAX's own handler serves the sync point;
        a Python handler would replace it)."""
        return self is not StopAgreement.SYNC_POINT

    def should_stop(self, step: int, requested: bool) -> bool:
        """Call after every step on every process, with this process's flag."""
        if self is StopAgreement.LOCAL:
            return requested
        import numpy as np
        from jax.experimental import multihost_utils

        if self is StopAgreement.SYNC_POINT:
            return bool(multihost_utils.reached_preemption_sync_point(step))
        return bool(np.max(multihost_utils.process_allgather(np.asarray(requested, np.int32))))
