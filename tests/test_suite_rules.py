"""Rules for the suite itself: no test can wait without a bound (issue 18), the tiers are marks in the
test files and every file keeps a fast test, and no assertion bounds a measured wall-clock time (issue 34).

A test that reads a child's output or waits for it without a timeout can hold CI to its 90-minute
limit. Children start through ``tests/processes.py`` (bounded waits, process-group kill on expiry);
pytest-timeout fails any test that still hangs, with its stack. A test asserting that something took
less than N seconds fails by load alone: the outcome is asserted, the wait's timeout bounds it.
"""

from __future__ import annotations

import ast
import os
import signal
import sys
import time

import pytest

import processes

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_FILES = sorted(f for f in os.listdir(HERE) if f.endswith(".py") and f != "processes.py")


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            yield node


@pytest.mark.parametrize("name", TEST_FILES)
def test_children_start_only_through_the_bounded_helper(name):
    tree = ast.parse(open(os.path.join(HERE, name)).read(), name)
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    direct = [n.lineno for n in imports
              if (isinstance(n, ast.Import) and any(a.name == "subprocess" for a in n.names))
              or (isinstance(n, ast.ImportFrom) and n.module == "subprocess")]
    assert not direct, f"{name}:{direct}: import subprocess; start children with tests/processes.py (bounded waits)"
    unbounded = [f"{name}:{c.lineno} .{c.func.attr}()" for c in _calls(tree)
                 if c.func.attr in ("communicate", "wait") and not c.args and not c.keywords
                 and isinstance(c.func.value, ast.Name) and c.func.value.id in ("proc", "p", "child")]
    assert not unbounded, f"waits on a child without a timeout: {unbounded}; use processes.finish/wait"


def test_every_test_has_a_time_limit(pytestconfig):
    assert float(pytestconfig.getini("timeout")) > 0, "pytest-timeout must be configured in pyproject.toml"


def test_the_suite_gives_children_a_default_sigint():
    # conftest.py installs Python's handler; exec turns it into SIG_DFL in every child.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_child_past_its_bound_is_killed_with_its_children(tmp_path):
    marker = tmp_path / "grandchild.pid"
    script = (f"import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(60)']); open({str(marker)!r}, 'w').write(str(g.pid)); time.sleep(60)")
    proc = processes.start([sys.executable, "-c", script], stdout=processes.PIPE, stderr=processes.PIPE)
    # The bound starts once the grandchild exists: on a loaded machine two interpreters may take
    # longer to start than any fixed bound (the outcome, not the speed, is under test).
    deadline = time.monotonic() + 300
    while not (marker.exists() and marker.read_text().strip()) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists() and marker.read_text().strip(), "the child did not start its grandchild within 300 s"
    with pytest.raises(processes.ProcessTimeout, match="ran past 1 s and was killed"):
        processes.finish(proc, timeout=1)
    pid = int(marker.read_text())
    for _ in range(100):  # the group was SIGKILLed; the grandchild is reaped by init shortly after
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"grandchild {pid} survived the kill")


def test_a_child_ignores_no_sigint_it_inherited(tmp_path):
    out = processes.run(["bash", "-c", "trap -p INT; python3 -c 'import signal; "
                         "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)'"], timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "True", out


def _is_slow_mark(node):
    """``pytest.mark.slow`` (or a call of it) as written in a decorator or ``pytestmark``."""
    node = node.func if isinstance(node, ast.Call) else node
    return isinstance(node, ast.Attribute) and node.attr == "slow" and ast.unparse(node.value) == "pytest.mark"


def _tests_by_tier(tree):
    """``(fast, slow)`` test names of a module: a test is slow by ``@pytest.mark.slow`` on it or its class,
    or by a module-level ``pytestmark`` holding the mark."""
    module_marks = [n.value for n in tree.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)]
    module_slow = any(_is_slow_mark(m) for v in module_marks
                      for m in (v.elts if isinstance(v, (ast.List, ast.Tuple)) else [v]))
    fast, slow = set(), set()
    for node in tree.body:
        inherited = module_slow
        functions = [node]
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            inherited = inherited or any(_is_slow_mark(d) for d in node.decorator_list)
            functions = [n for n in node.body]
        for f in functions:
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name.startswith("test_"):
                marked = inherited or any(_is_slow_mark(d) for d in f.decorator_list)
                (slow if marked else fast).add(f.name)
    return fast, slow


def test_every_test_file_keeps_a_fast_test():
    # `pytest -m "not slow"` (the fast tier) imports and exercises every test file
    for name in TEST_FILES:
        if not name.startswith("test_"):
            continue
        fast, slow = _tests_by_tier(ast.parse(open(os.path.join(HERE, name)).read()))
        assert fast or not slow, f"{name}: every test is marked @pytest.mark.slow; keep one in the fast tier"


def test_tiers_are_marks_not_a_side_list():
    # tests/slow.txt was read until issue 34; a branch that still adds entries to it would be ignored silently
    assert not os.path.exists(os.path.join(HERE, "slow.txt")), (
        "tests/slow.txt is no longer read: put @pytest.mark.slow on each test it lists and delete the file")


def test_the_tier_rule_sees_marks_on_functions_classes_and_modules():
    fast, slow = _tests_by_tier(ast.parse(
        "import pytest\n@pytest.mark.slow\ndef test_a(): pass\ndef test_b(): pass\n"
        "@pytest.mark.slow\nclass TestC:\n    def test_c(self): pass\n"))
    assert (fast, slow) == ({"test_b"}, {"test_a", "test_c"})
    assert _tests_by_tier(ast.parse("import pytest\npytestmark = [pytest.mark.slow]\ndef test_d(): pass\n")) \
        == (set(), {"test_d"})


def test_every_measured_file_time_names_a_test_file(pytestconfig):
    from conftest import FILE_SECONDS

    # the order reaches the workers: xdist's reordering of files by test count is off
    assert getattr(pytestconfig.option, "loadscopereorder", False) is False

    missing = [name for name in FILE_SECONDS if name not in TEST_FILES]
    assert not missing, (f"tests/file_seconds.json names files that do not exist (renamed? rewrite it with "
                         f"tools/suite_profile.py LOG... --write-order tests/file_seconds.json): {missing}")
    assert all(isinstance(s, (int, float)) and s >= 0 for s in FILE_SECONDS.values()), FILE_SECONDS


_CLOCKS = {"time", "monotonic", "perf_counter", "monotonic_ns", "time_ns", "perf_counter_ns"}


def _is_clock_call(node):
    """``time.monotonic()`` and friends (a reading of the wall clock)."""
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Attribute) and node.func.attr in _CLOCKS
         and isinstance(node.func.value, ast.Name) and node.func.value.id == "time")
        or (isinstance(node.func, ast.Name) and node.func.id in _CLOCKS - {"time"}))


def _measured_durations(code: str, filename: str = "<test>"):
    """``file:line`` of every assertion that a measured wall-clock duration is *at most* something
    (``elapsed < bound``, ``bound > t1 - t0``, ``elapsed == x``): on a loaded machine such an assertion
    fails by load alone. A duration is a difference of clock readings (``time.monotonic() - t0``) or a
    name assigned one. A deadline check (``time.monotonic() < deadline``) is the wait's own bound and
    allowed, and so is a lower bound (``elapsed >= timeout``): load only makes a wait longer."""
    tree = ast.parse(code, filename)
    instants, durations = set(), set()

    def is_instant(e):
        return _is_clock_call(e) or (isinstance(e, ast.Name) and e.id in instants) or (
            isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Sub)) and is_instant(e.left)
            and not is_instant(e.right))

    def is_duration(e):
        if isinstance(e, ast.Name):
            return e.id in durations
        if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Sub) and is_instant(e.left) and is_instant(e.right):
            return True
        return any(is_duration(c) for c in ast.iter_child_nodes(e) if isinstance(c, ast.expr))

    for _ in range(3):   # names assigned from names assigned from clock readings
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
                if is_duration(node.value):
                    durations.add(name)
                elif is_instant(node.value):
                    instants.add(name)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            sides = [cmp.left, *cmp.comparators]
            for op, left, right in zip(cmp.ops, sides, sides[1:]):
                small = ([left] if isinstance(op, (ast.Lt, ast.LtE, ast.Eq)) else []) + \
                        ([right] if isinstance(op, (ast.Gt, ast.GtE, ast.Eq)) else [])
                if any(is_duration(s) for s in small):
                    found.append(f"{filename}:{node.lineno}")
    return found


def test_no_assertion_bounds_a_measured_wall_clock_time():
    # a wait's bound is its timeout (processes.run/finish, a deadline loop); the outcome is what is asserted
    found = [hit for name in TEST_FILES for hit in _measured_durations(open(os.path.join(HERE, name)).read(), name)]
    assert not found, f"assertions on elapsed wall-clock time (they fail by load alone; assert the outcome): {found}"


@pytest.mark.parametrize("code, flagged", [
    ("t0 = time.monotonic()\nrun()\nelapsed = time.monotonic() - t0\nassert elapsed < 30", True),
    ("t0 = time.time()\nrun()\nassert time.time() - t0 <= LIMIT + 5", True),
    ("t0 = perf_counter()\nrun()\nassert 2.0 > perf_counter() - t0", True),
    ("t0 = time.monotonic()\nrun()\nwall = time.monotonic() - t0\nassert ok and wall / 2 < budget", True),
    ("t0 = time.monotonic()\nrun()\nelapsed = time.monotonic() - t0\nassert elapsed >= timeout_s", False),
    ("deadline = time.monotonic() + 300\nwhile not done():\n    assert time.monotonic() < deadline", False),
    ("assert result.seconds < 3", False),
])
def test_the_wall_clock_rule_catches_upper_bounds_on_measured_time(code, flagged):
    assert bool(_measured_durations(code)) is flagged


def test_built_once_builds_once_for_concurrent_workers(tmp_path):
    # two processes ask for the same folder at once (as two xdist workers do): one builds, the other waits
    script = ("import os, sys, time; sys.path.insert(0, {here!r}); from helpers import built_once\n"
              "def build(folder):\n"
              "    open({log!r}, 'a').write('built\\n'); time.sleep(1); open(os.path.join(folder, 'x'), 'w').write('1')\n"
              "print(open(os.path.join(built_once('k', build), 'x')).read())\n").format(here=HERE, log=str(tmp_path / "log"))
    env = dict(os.environ, MESHTRAIN_TEST_SESSION=str(tmp_path / "session"))
    children = [processes.start([sys.executable, "-c", script], stdout=processes.PIPE, stderr=processes.PIPE, env=env)
                for _ in range(2)]
    outs = [processes.finish(child, timeout=300) for child in children]
    assert [(code, out.strip()) for code, out, _ in outs] == [(0, "1"), (0, "1")], outs
    assert (tmp_path / "log").read_text() == "built\n"
