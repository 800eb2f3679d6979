"""Runs one group of ``tools/probe_bad_input.py`` (a module of ``tools/probe_groups/``) and asserts
that every case passed: the expected exit status, no traceback, no pre-existing file changed, nothing
left at the case's ``--out``, no process or ``/dev/shm`` entry left behind.

    from probe_group import run_group
    def test_data_cases():
        run_group("data", expected_cases=12)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_group(group: str, expected_cases: int, only: str = "", timeout: float = 900,
              share_process: bool = False) -> list:
    """The group's results (one dict per case); fails with each failed case's line.

    ``share_process=True`` runs the cases that are only CLI arguments in one child, one after the other
    (``probe_bad_input.py --share-process``, tools/probe_worker.py): each is still judged on its own
    status, first line, traceback and what it left, at a fraction of a fresh interpreter's CPU."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    if "MESHTRAIN_TEST_SESSION" in os.environ:   # the runs cases copy (a vit-tiny run...): made once a session
        env["MESHTRAIN_PROBE_MADE"] = os.path.join(os.environ["MESHTRAIN_TEST_SESSION"], "probe-made")
    with tempfile.TemporaryDirectory(prefix=f"probe-{group}-") as tmp:
        path = os.path.join(tmp, "probe.json")
        out = processes.run([sys.executable, os.path.join(ROOT, "tools", "probe_bad_input.py"), "--group", group,
                             "--only", only, "--json", path, "--timeout", "300",
                             *(["--share-process"] if share_process else [])], capture_output=True, text=True,
                            env=env, timeout=timeout)
        assert os.path.exists(path), out.stdout[-3000:] + out.stderr[-3000:]
        results = json.load(open(path))
    failed = [f"{r['case']}: exit {r['code']} (expected {r['expect']}), said {r['said']!r}"
              for r in results if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert out.returncode == 0, out.stdout[-3000:]
    # every case of the group ran (a case silently left out would make the test pass on less)
    assert len(results) == expected_cases, [r["case"] for r in results]
    return results
