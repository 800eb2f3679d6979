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
    run_group("data", expected_cases=12, only="tokenizer:")


@pytest.mark.slow
def test_prepare_cases():
    run_group("data", expected_cases=7, only="prepare:")
