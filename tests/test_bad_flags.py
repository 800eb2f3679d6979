"""Flags that mean nothing are refused with one line naming the flag (issue 18), or, where a
reasonable use needs them, accepted with a one-line warning."""

from __future__ import annotations

import argparse
import json
import os

import jax
import pytest

from meshtrain.cli import main
from meshtrain.commands import launch, train

GIB = 2 ** 30

TRAIN = ["train", "--model", "tiny", "--steps", "1"]
LAUNCH = ["launch", "--processes", "2"]
LAUNCHED = ["--", "train", "--model", "tiny", "--steps", "1"]


REFUSALS = [
    (["plan", "--model", "tiny", "--seq-len", "0"], "--seq-len 0: give a positive integer"),
    (["plan", "--model", "tiny", "--batch-size", "0"], "--batch-size 0: give a positive integer"),
    (["plan", "--model", "tiny", "--recipe", "auto", "--top", "-1"], "--top -1: give a positive integer"),
    (["plan", "--model", "tiny", "--slices", "0"], "--slices 0: give a positive integer"),
    (["plan", "--model", "bert-tiny", "--seq-len", "1000"], "--seq-len 1000 is longer than model 'bert-tiny' has "
                                                           "positions (max_positions 256"),
    (["plan", "--model", "vit-tiny", "--seq-len", "8"], "--seq-len does not apply to vit-tiny"),
    (["plan", "--model", "tiny", "--recipe", "fsdp", "--attention", "ring"],
     "--attention ring needs a recipe that splits the sequence over a context axis; recipe 'fsdp' has none: use "
     "--recipe one of cp, fsdp_cp"),
    (["plan", "--model", "tiny", "--recipe", "fsdp", "--schedule", "1f1b"],
     "--schedule 1f1b applies to pipeline recipes; recipe 'fsdp' has no pipeline stages: use --recipe one of pp"),
    (TRAIN + ["--recipe", "fsdp", "--attention", "ring"], "--attention ring needs a recipe that splits the sequence"),
    (TRAIN + ["--recipe", "fsdp", "--schedule", "1f1b"], "--schedule 1f1b applies to pipeline recipes"),
    (TRAIN + ["--recipe", "dp", "--repeats", "2"], "--repeats 2 applies to pipeline recipes; recipe 'dp'"),
    (["train", "--model", "vit-tiny", "--seq-len", "64"], "--seq-len does not apply to vit-tiny"),
    (TRAIN + ["--peak-tflops", "-5"], "--peak-tflops -5 (peak_flops_per_device -5e+12): must be a positive"),
    (TRAIN + ["--peak-tflops", "0"], "--peak-tflops 0 (peak_flops_per_device 0): must be a positive"),
    (TRAIN + ["--init-timeout", "nan"], "--init-timeout / MESHTRAIN_INIT_TIMEOUT nan: must be a positive number"),
    (LAUNCH + ["--grace", "-1"] + LAUNCHED, "--grace -1: give the seconds (>= 0"),
    (LAUNCH + ["--grace", "nan"] + LAUNCHED, "--grace nan: give the seconds (>= 0"),
    (LAUNCH + ["--init-timeout", "0"] + LAUNCHED, "--init-timeout 0: give a positive number of seconds"),
    (LAUNCH + ["--port", "70000"] + LAUNCHED, "--port 70000: give a TCP port 1..65535, or 0 for a free one"),
]


@pytest.mark.parametrize("argv, fragment", REFUSALS, ids=[" ".join(argv[:1] + argv[-2:]) for argv, _ in REFUSALS])
def test_meaningless_flag_is_refused_with_one_line(argv, fragment, capsys, monkeypatch):
    monkeypatch.setattr(launch.ProcessGroup, "start", _no_child)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert fragment in err, err


def _no_child(self):
    raise AssertionError("a refused launch started a process")


def test_decoder_seq_len_beyond_its_maximum_is_planned_with_a_warning(capsys):
    # Decoders have rotary positions (no table): planning a long-context variant is documented use.
    with pytest.warns(UserWarning, match=r"--seq-len 512 is longer than model 'tiny' supports \(max_seq_len 256\)"):
        assert main(["plan", "--model", "tiny", "--seq-len", "512", "--json"]) == 0
    batch = json.loads(capsys.readouterr().out)["batch"]
    assert {leaf["path"]: leaf["shape"] for leaf in batch}["inputs"] == [16, 512]   # train's default batch


@pytest.mark.parametrize("processes, warned", [(1, True), (2, False)])
def test_dcn_in_a_single_process_run_warns(processes, warned, monkeypatch, recwarn):
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    train.check_flags(argparse.Namespace(model="tiny", seq_len=None, dcn="data=2"))
    messages = [str(w.message) for w in recwarn]
    assert messages == (["--dcn data=2 in a single-process run: no axis crosses a slow link (there are no other "
                         "processes or slices; the devices are only regrouped); it takes effect under `meshtrain "
                         "launch`, srun or mpirun"] if warned else [])


@pytest.mark.parametrize("processes, host_bytes, refusal", [
    (64, 8 * GIB, "--processes 64: each meshtrain process needs ~0.62 GiB (peak memory of `meshtrain train --model "
                  "tiny`), 64 need ~40.0 GiB but this host has 8.0 GiB (90% usable); use --processes 11 or fewer"),
    (12, 8 * GIB, "12 need ~7.5 GiB but this host has 8.0 GiB (90% usable); use --processes 11 or fewer"),
    (11, 8 * GIB, None),
    (64, None, None),  # memory unknown: not checked
])
def test_launch_checks_host_memory_before_starting(processes, host_bytes, refusal):
    from meshtrain.errors import ConfigError

    if refusal is None:
        launch.check_host_memory(processes, host_bytes)
        return
    with pytest.raises(ConfigError) as info:
        launch.check_host_memory(processes, host_bytes)
    assert refusal in str(info.value)


def test_launch_reads_the_host_memory_like_the_preflight():
    assert launch.host_memory_bytes() == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_launch_with_too_many_processes_starts_none(capsys, monkeypatch):
    monkeypatch.setattr(launch, "host_memory_bytes", lambda: 8 * GIB)
    monkeypatch.setattr(launch.ProcessGroup, "start", _no_child)
    assert main(["launch", "--processes", "64"] + LAUNCHED) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --processes 64: each meshtrain process needs") and err.count("\n") == 1, err
    assert "use --processes 11 or fewer" in err
