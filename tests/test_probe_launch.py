"""Probe group ``launch`` (tools/probe_groups/launch.py): a SIGKILLed launcher leaves no process and no
/dev/shm folder (also while a process hangs), and a peer's death is one line, not a traceback."""

from probe_group import run_group


def test_launch_cases_leave_nothing_behind():
    run_group("launch", expected_cases=3)
