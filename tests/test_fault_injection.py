"""Test-only fault injection reaches the saver through the checkpointer it belongs to (issue 34):
the watchdog arms ``Checkpointer.faults``; no module global carries a fault from one run to the next."""

from __future__ import annotations

import json
import types

import pytest
from helpers import TINY_BATCH, TINY_SEQ, device, mesh_for, random_state, tiny_abstract

import meshtrain as mt
from meshtrain.checkpoint import Checkpointer, CheckpointError, saving
from meshtrain.checkpoint.faults import DiskFullInjector
from meshtrain.train.watchdog import Fault, FaultKind, Watchdog


@pytest.fixture(scope="module")
def plan_and_state():
    recipe, mesh = mesh_for("fsdp", 8)
    plan = mt.make_plan(tiny_abstract(), recipe, mesh, batch=mt.BatchSpec(TINY_BATCH, TINY_SEQ))
    return plan, random_state(plan, 1)


def test_the_injector_fires_once_at_or_after_its_step():
    fired = []
    faults = DiskFullInjector()
    faults.before_save(1)   # not armed: nothing happens
    faults.arm(3, fired.append)
    faults.before_save(2)
    with pytest.raises(OSError, match="No space left on device"):
        faults.before_save(4)
    faults.before_save(5)   # once
    assert fired == [4] and faults.armed is None


def test_the_watchdog_arms_its_checkpointers_saves_and_disarms_at_close(plan_and_state, tmp_path):
    plan, state = plan_and_state
    assert not hasattr(saving, "DISK_FULL_FAULT"), "the saver must not read a module-global fault"
    run = types.SimpleNamespace(run_dir=str(tmp_path), is_main=True)
    other = Checkpointer(tmp_path / "other", save_every=1, async_save=False)
    with Checkpointer(tmp_path / "checkpoints", save_every=1, async_save=False) as ckpt:
        dog = Watchdog(None, 0.2, [Fault(FaultKind.FULL, step=2, process=0, attempt=0)], disk_faults=ckpt.faults)
        dog.on_start(run)
        assert ckpt.faults.armed is not None and other.faults.armed is None   # only this run's checkpointer
        assert ckpt.maybe_save(1, device(plan, state), data_state={}, metadata={}).saved
        with pytest.raises(CheckpointError, match="disk is full"):
            ckpt.maybe_save(2, device(plan, state), data_state={}, metadata={})
        assert ckpt.all_steps() == [1]
        events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
        assert [(e["event"], e["kind"], e["step"]) for e in events] == [("fault", "full", 2)]
        dog.faults = [Fault(FaultKind.FULL, step=3, process=0, attempt=0)]
        dog.on_start(run)
        dog.close(run)
        assert ckpt.faults.armed is None   # an armed fault does not outlive its run
        assert ckpt.maybe_save(3, device(plan, state), data_state={}, metadata={}).saved
    other.close()
