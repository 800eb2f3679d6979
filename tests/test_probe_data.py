"""The ``data`` group of tools/probe_bad_input.py (tools/probe_groups/data.py): `meshtrain data
tokenizer` and `data prepare` on hostile input exit 2 (74 for a full disk, 130 on Ctrl-C) with one
line naming the input, change nothing and leave nothing at --out."""

import os
import sys

import pytest
from probe_group import ROOT, run_group

sys.path.insert(0, os.path.join(ROOT, "tools"))

from probe_groups import data as group  # noqa: E402  (tools/ is not a package on the path)

CASES = 19


def test_every_case_is_judged_on_what_it_leaves(tmp_path):
    cases = group.cases(str(tmp_path))
    assert len(cases) == CASES and len({c.name for c in cases}) == CASES
    for case in cases:
        failing = case.expect not in ("0", "warn")
        # a failing CLI case names what it must not leave, or runs on a mount it checks itself
        assert not failing or case.out or case.python, case.name


@pytest.mark.slow
def test_tokenizer_cases():
    run_group("data", expected_cases=12, only="tokenizer:", share_process=True)


@pytest.mark.slow
def test_prepare_cases():
    run_group("data", expected_cases=7, only="prepare:", share_process=True)


def test_the_shared_process_keeps_each_cases_status_output_and_environment(tmp_path, capsys):
    """tools/probe_worker.py's per-case run (``--share-process``): each case's exit status, its own
    stdout/stderr (file descriptors 1 and 2), a traceback for what escapes ``main``, its folder and marker
    while it runs -- and nothing of it left for the next case."""
    from probe_worker import _one_case

    def fake_main(argv):
        assert os.getcwd() == str(tmp_path) and os.environ["MESHTRAIN_PROBE_CASE"] == "m"
        os.environ["LEFT_BY_A_CASE"] = "1"
        if argv == ["raise"]:
            raise RuntimeError("boom")
        if argv == ["exit"]:
            sys.exit("error: told to")
        os.write(1, b"fd-level out\n")
        print("error: bad input", file=sys.stderr)
        return 2

    def case(argv, n):
        request = {"argv": argv, "cwd": str(tmp_path), "marker": "m", "out": str(tmp_path / f"{n}.out"),
                   "err": str(tmp_path / f"{n}.err")}
        with capsys.disabled():   # (pytest's own capture off: sys.stderr writes to file descriptor 2 again)
            code = _one_case(fake_main, request)
        return code, (tmp_path / f"{n}.out").read_text(), (tmp_path / f"{n}.err").read_text()

    cwd = os.getcwd()
    code, out, err = case(["bad"], 0)
    assert (code, out, err) == (2, "fd-level out\n", "error: bad input\n")
    code, _, err = case(["raise"], 1)
    assert code == 1 and "Traceback (most recent call last)" in err and "RuntimeError: boom" in err
    code, _, err = case(["exit"], 2)
    assert code == 1 and err.strip() == "error: told to"
    assert os.getcwd() == cwd and "LEFT_BY_A_CASE" not in os.environ and "MESHTRAIN_PROBE_CASE" not in os.environ


def test_the_shared_process_runs_the_cli_and_shows_a_warning_again(tmp_path):
    """The shared child itself (tools/probe_worker.Worker) on real commands: a refusal's status and one
    line, and the same warning in two cases in a row (a fresh process would print it each time)."""
    from probe_bad_input import child_env
    from probe_worker import Worker

    worker = Worker(child_env(), str(tmp_path))
    try:
        code, _, err, _ = worker.run(["plan", "--model", "tiny", "--seq-len", "0"], str(tmp_path), "m", 300)
        assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err
        for _ in range(2):
            code, _, err, _ = worker.run(["plan", "--model", "tiny", "--recipe", "fsdp", "--seq-len", "100000"],
                                         str(tmp_path), "m", 300)
            assert code == 0 and "warning: " in err, err
    finally:
        worker.close()
