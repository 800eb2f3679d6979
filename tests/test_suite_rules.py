"""Rules for the suite itself: no test can wait without a bound (issue 18).

A test that reads a child's output or waits for it without a timeout can hold CI to its 90-minute
limit. Children start through ``tests/processes.py`` (bounded waits, process-group kill on expiry);
pytest-timeout fails any test that still hangs, with its stack.
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


def test_every_slow_entry_names_an_existing_test():
    from conftest import slow_tests

    root = os.path.dirname(HERE)
    missing = []
    for path, function in sorted(slow_tests()):
        file = os.path.join(root, path)
        names = set()
        if os.path.isfile(file):
            names = {n.name for n in ast.walk(ast.parse(open(file).read())) if isinstance(n, ast.FunctionDef)}
        if function not in names:
            missing.append(f"{path}::{function}")
    assert not missing, f"tests/slow.txt names tests that do not exist (renamed?): {missing}"


def test_every_test_file_keeps_a_fast_test():
    from conftest import slow_tests

    slow = slow_tests()
    for name in TEST_FILES:
        if not name.startswith("test_"):
            continue
        tree = ast.parse(open(os.path.join(HERE, name)).read())
        tests = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
        fast = {t for t in tests if (f"tests/{name}", t) not in slow}
        assert fast or not tests, f"{name}: every test is in tests/slow.txt; keep one in the fast tier"


def test_every_slowest_first_entry_names_a_test_file(pytestconfig):
    from conftest import SLOWEST_FILES

    # the order reaches the workers: xdist's reordering of files by test count is off
    assert getattr(pytestconfig.option, "loadscopereorder", False) is False

    missing = [name for name in SLOWEST_FILES if name not in TEST_FILES]
    assert not missing and len(set(SLOWEST_FILES)) == len(SLOWEST_FILES), (
        f"tests/conftest.py SLOWEST_FILES names files that do not exist (renamed?) or twice: {missing}")
