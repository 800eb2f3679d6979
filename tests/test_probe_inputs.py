"""Group ``inputs`` of tools/probe_bad_input.py (issue 35): damaged prepared token folders, generation
on a run that is not a decoder's or has a damaged header, stop ids outside the vocabulary, bad rules
files, plan flags that used to be ignored, ``--dcn`` on one host, sequence lengths the context axes do
not divide. Each part runs in a probe session of its own (its name tag, tools/probe_groups/inputs.py)."""

import collections
import os
import sys

import pytest
from probe_group import ROOT, run_group

PARTS = {"[data]": 9, "[run]": 8, "[flags]": 10}


def test_every_case_belongs_to_one_part():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from probe_groups.inputs import cases

    names = [c.name for c in cases("/nonexistent")]  # (nothing is made until a case runs)
    assert len(set(names)) == len(names) == sum(PARTS.values())
    assert collections.Counter(n[n.rindex(" ") + 1:] for n in names) == PARTS


@pytest.mark.slow
def test_damaged_prepared_token_folders():
    run_group("inputs", expected_cases=PARTS["[data]"], only="[data]", share_process=True)


@pytest.mark.slow
def test_generate_on_runs_it_cannot_use():
    run_group("inputs", expected_cases=PARTS["[run]"], only="[run]", share_process=True)


@pytest.mark.slow
def test_rules_files_and_plan_train_flags():
    run_group("inputs", expected_cases=PARTS["[flags]"], only="[flags]", share_process=True)
