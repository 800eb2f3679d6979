"""Probe group ``launch`` (tools/probe_groups/launch.py): a SIGKILLed launcher leaves no process and no
/dev/shm folder (also while a process hangs), and a peer's death is one line, not a traceback."""

import os
import sys

import pytest
from helpers import cache_every_process
from probe_group import ROOT, run_group

sys.path.insert(0, os.path.join(ROOT, "tools"))


def test_launch_cases_are_well_formed():
    from probe_groups import launch

    cases = launch.cases("/tmp")
    assert len(cases) == 3 and {c.group for c in cases} == {"launch"}
    for case in cases:
        if case.python:
            compile(case.python.replace("{work}", "/w"), case.name, "exec")   # the snippets are valid Python


@pytest.mark.slow
def test_launch_cases_leave_nothing_behind(monkeypatch):
    # the launched processes 1.. load their programs from the suite's compilation cache, as process 0 does
    monkeypatch.setenv("PYTHONPATH", cache_every_process(dict(os.environ))["PYTHONPATH"])
    run_group("launch", expected_cases=3)
