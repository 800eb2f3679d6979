"""The README's examples run as written, and CI runs the README's test command."""

import os
import re
import processes
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(__file__))
README = open(os.path.join(ROOT, "README.md")).read()


def example(name):
    m = re.search(r"<!-- readme-example: " + name + r" -->\s*```python\n(.*?)```", README, re.S)
    assert m, f"README example {name!r} not found"
    return m.group(1)


@pytest.mark.parametrize("name, expect", [("own-model", r"loss ([0-9.]+) -> ([0-9.]+)"),
                                          ("own-data", r"loss ([0-9.]+) -> ([0-9.]+), eval accuracy ([0-9.]+)"),
                                          ("own-loop", r"loss ([0-9.]+)"),
                                          ("hooks", r"step 2: param_norm [0-9.]+\nstep 4: param_norm ([0-9.]+)")])
def test_readme_example_runs(name, expect, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    out = processes.run([sys.executable, "-c", example(name)], capture_output=True, text=True, cwd=tmp_path,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    m = re.search(expect, out.stdout)
    assert m, out.stdout[-2000:]
    if name == "own-model":
        assert float(m.group(2)) < float(m.group(1))  # it trained
        assert (tmp_path / "runs" / "my-model" / "metrics.jsonl").exists()
    if name == "own-data":
        assert float(m.group(2)) < 0.5 * float(m.group(1)) and float(m.group(3)) > 0.8


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    command = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest"
    assert command in README and command in ci
