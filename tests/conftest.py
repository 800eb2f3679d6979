"""8 simulated CPU devices for the whole suite, set once before JAX starts its backends.

Compiled programs are shared through a JAX compilation cache in a folder made fresh for each test
session (the controller makes it; xdist workers and the CLI subprocesses the tests start inherit it
through the environment): identical train steps compiled by several tests are compiled once. Nothing
depends on it: a test run without it gives the same results, only slower.
"""

import json
import os
import pathlib
import shutil
import signal
import tempfile

# However the suite was started (a background job of a non-interactive shell, nohup, a CI runner),
# SIGINT here gets Python's handler; `exec` turns a handler into the default, so every child a test
# starts can be interrupted as a user's terminal would (an inherited SIG_IGN would pass through).
signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ.setdefault("XLA_FLAGS", "")
from processes import with_test_xla_flags  # noqa: E402  (tests/ is on sys.path)
from child_site import suite_gc  # noqa: E402

# Every Python child a test starts imports tests/child_site/sitecustomize.py: the suite's GC thresholds
# (suite_gc.py: ~6 % of a tiny train child's CPU) and compilation-cache writes from every process.
_CHILD_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child_site")
if _CHILD_SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_CHILD_SITE, os.environ.get("PYTHONPATH", "")) if p)
suite_gc.tune()   # this process too (no measured change in-process: test_parity 37.4 CPU s either way)

# The suite's programs compile at LLVM -O0 with XLA:CPU's older emitters (processes.TEST_XLA_FLAGS says why and how to turn it off);
# set before JAX starts its backend, and inherited by every child a test starts.
os.environ["XLA_FLAGS"] = with_test_xla_flags(dict(os.environ))["XLA_FLAGS"]
_OWN_CACHE = None
if "PYTEST_XDIST_WORKER" not in os.environ and "MESHTRAIN_TEST_CACHE" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="meshtrain-tests-jax-cache-")
    os.environ["MESHTRAIN_TEST_CACHE"] = _OWN_CACHE
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS_OVERRIDE", "0")
# The bytecode of the package, the tests' helpers and tools/, written once by the controller: where
# PYTHONDONTWRITEBYTECODE is set (as in CI's image), every child a test starts would compile meshtrain's sources
# again (~0.2 CPU s per `meshtrain` process, and the suite starts hundreds); compileall writes the .pyc files
# whatever that variable says. The test modules as pytest rewrites their asserts: _prewrite_test_modules (from
# pytest_configure), else each of the six workers rewrites all of them again at collection (~2 CPU s a worker).
if "PYTEST_XDIST_WORKER" not in os.environ:
    import compileall

    for _folder in ("meshtrain", "tests", "tools"):
        compileall.compile_dir(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), _folder),
                               quiet=2)
# Reference runs built once per session and shared by the workers (helpers.built_once): always a fresh
# folder, even where a compilation cache is kept across sessions (a result must not outlive its code).
_OWN_SESSION = None
if "PYTEST_XDIST_WORKER" not in os.environ:
    _OWN_SESSION = tempfile.mkdtemp(prefix="meshtrain-tests-session-")
    os.environ["MESHTRAIN_TEST_SESSION"] = _OWN_SESSION
    # the bf16 row kernel (meshtrain/kernels) is built once per session, into it, not the user's ~/.cache
    os.environ.setdefault("MESHTRAIN_KERNEL_CACHE", os.path.join(_OWN_SESSION, "kernels"))
    # and the planner's traced activation formulas (meshtrain.analysis.trace_cache): once per session
    os.environ.setdefault("MESHTRAIN_CACHE_DIR", os.path.join(_OWN_SESSION, "cache"))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import pytest  # noqa: E402


def pytest_configure(config):
    # pytest-xdist (3.x) hands out --dist loadfile's files by test count, most first, unless told not to:
    # a slow file of few tests (test_peers, test_device_check) would start last and run alone at the end.
    # Keep the collection order instead: the longest files first (FILE_SECONDS).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if "PYTEST_XDIST_WORKER" not in os.environ and getattr(config.option, "numprocesses", None):
        _prewrite_test_modules(config)


def _prewrite_test_modules(config):
    """Writes the assert-rewritten bytecode of every test module once, in the controller, before the workers
    start (pytest writes it itself only where PYTHONDONTWRITEBYTECODE is unset, and then each worker still
    rewrites every module of a fresh clone at once). pytest's own functions, as its import hook calls them; a
    pytest whose internals differ skips this (the workers rewrite as before)."""
    try:
        from _pytest.assertion import rewrite
        state = config.stash[rewrite.assertstate_key]
    except (ImportError, AttributeError, KeyError):
        return
    here = pathlib.Path(__file__).parent
    for source in sorted(here.glob("test_*.py")) + [here / "conftest.py"]:
        pyc = rewrite.get_cache_dir(source) / (source.name[:-3] + rewrite.PYC_TAIL)
        try:
            if rewrite._read_pyc(source, pyc, state.trace) is None:
                rewrite.try_makedirs(pyc.parent)
                source_hash, code = rewrite._rewrite_test(source, config)
                rewrite._write_pyc(state, code, source_hash, pyc)
        except (AttributeError, TypeError, OSError, SyntaxError):
            return


#: Each test file's measured wall seconds (tests/file_seconds.json, the mean over whole-suite runs' CPU logs on 2
#: busy cores; ``tools/suite_profile.py LOG... --write-order`` rewrites it). ``--dist loadfile`` hands files to
#: the workers in collection order (xdist's reordering by test count is off, pytest_configure), and a worker
#: takes the next file as it nears the end of its last: longest first keeps a long file from running alone at
#: the end while the other workers sit idle (on the last three runs' logs: 856-882 s to the last test's end
#: instead of 891-904 s in the old hand-kept order). A file not measured yet goes first: its time is unknown.
#: tests/test_suite_rules.py checks that each entry names a file.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_seconds.json")) as _f:
    FILE_SECONDS: dict = json.load(_f)["seconds"]


def _longest_first(item):
    return -FILE_SECONDS.get(os.path.basename(str(item.path)), float("inf"))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_longest_first)   # stable: a file's tests keep their order (module fixtures, parameters)


#: JAX's own compile-phase events (wall seconds, this process only), summed for the CPU log: how much of a
#: test's time goes to tracing, lowering to MLIR and XLA's compile (``cache_s``: persistent-cache reads).
_JAX_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
               "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
               "/jax/core/compile/backend_compile_duration": "compile_s",
               "/jax/compilation_cache/cache_retrieval_time_sec": "cache_s"}
_jax_totals: dict = {}


def _jax_seconds() -> dict:
    if not _jax_totals:
        from jax import monitoring

        def add(event, duration, **_):
            if event in _JAX_EVENTS:
                _jax_totals[_JAX_EVENTS[event]] += duration
        _jax_totals.update({name: 0.0 for name in _JAX_EVENTS.values()})
        monitoring.register_event_duration_secs_listener(add)
    return _jax_totals


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``MESHTRAIN_TEST_CPU_LOG=FILE``: one JSON line per test with its wall seconds and the CPU seconds
    of this worker and of the children it waited for (setup, call and teardown together), so that
    ``tools/suite_profile.py FILE`` can tell compiling and running from waiting."""
    log = os.environ.get("MESHTRAIN_TEST_CPU_LOG")
    if not log:
        yield
        return
    import json
    import resource
    import time

    def cpu():
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime

    jax_s0 = dict(_jax_seconds())
    wall0, (own0, kids0) = time.monotonic(), cpu()
    yield
    own1, kids1 = cpu()
    line = {"test": item.nodeid, "wall_s": round(time.monotonic() - wall0, 3), "cpu_s": round(own1 - own0, 3),
            "children_cpu_s": round(kids1 - kids0, 3), "slow": item.get_closest_marker("slow") is not None,
            "failed": bool(getattr(item, "_meshtrain_failed", False)), "end_unix": round(time.time(), 2),
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
    line.update({name: round(s - jax_s0.get(name, 0.0), 3) for name, s in _jax_seconds().items()})
    with open(log, "a") as f:   # one short line per write: workers append without interleaving
        f.write(json.dumps(line) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Marks a test whose setup, call or teardown failed, for the CPU log's ``failed`` field (a failure
    found in a worker's log without mapping pytest's progress characters back to tests)."""
    outcome = yield
    if outcome.get_result().failed:
        item._meshtrain_failed = True


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/*.json from the code")


def pytest_unconfigure(config):
    for own in (_OWN_CACHE, _OWN_SESSION):
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs to fill (skipped where this process may not mount one, e.g. without root: the
    `ulimit -f` and injected-error cases cover the same paths)."""
    import processes

    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    proc = processes.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], timeout=60)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        processes.run(["umount", "-l", str(mnt)], timeout=60)


@pytest.fixture
def update_golden(request):
    return request.config.getoption("--update-golden")


@pytest.fixture(scope="session")
def uninterrupted():
    """The run folder of the tiny 2-process job under the launcher without faults (tests/launch_jobs.py):
    the reference that tests/test_resilience_faults.py and tests/test_resilience_elastic.py compare with,
    launched once per session whichever worker asks first. Read it, never write to it."""
    from helpers import built_once
    from launch_jobs import launch

    def build(folder):
        # supervised (--max-restarts: nothing fails, it runs once) so that its events.jsonl records the launch's
        # span, which the chaos benchmark reads when it takes this run as its --reference
        done = launch(os.path.join(folder, "run"), "--max-restarts", "1")
        assert done.returncode == 0, done.stderr[-3000:]
    return pathlib.Path(built_once("launch-tiny-2x2-uninterrupted", build)) / "run"


@pytest.fixture(scope="session")
def hang_s(uninterrupted):
    """The hang bound for this machine now: HANG_S times its measured slowdown (x2), and at least 5 times the
    longest step interval (step, data, checkpoint) of the uninterrupted run beside the same load."""
    import processes
    from launch_jobs import HANG_S, records

    steps = [r for r in records(os.path.join(uninterrupted, "metrics.jsonl")) if "loss" in r][1:]   # 1: compiles
    longest = max((r["step_time_s"] + r.get("data_wait_s", 0) + r.get("ckpt_block_s", 0) for r in steps), default=0)
    return max(processes.scaled(HANG_S), int(5 * longest) + 1)


@pytest.fixture(scope="session")
def tiny_one_device_losses():
    """The losses of ``helpers.TINY_TRAINER_RUN`` (the tiny model, 10 steps of 16 × 64 tokens) on one device
    through the Trainer: the reference of the Trainer-level parity tests (test_trainer.py,
    test_context_parallel.py), run once per session whichever worker asks first."""
    import numpy as np
    from helpers import TINY_TRAINER_RUN, built_once, losses_of

    from meshtrain.train import TrainConfig, Trainer

    def build(folder):
        run = Trainer(TrainConfig(**TINY_TRAINER_RUN, recipe="dp", devices=1, out=os.path.join(folder, "run"))).run()
        np.save(os.path.join(folder, "losses.npy"), losses_of(run.run_dir))
    return np.load(os.path.join(built_once("trainer-tiny-dp-1-device", build), "losses.npy"))
