"""User hooks in the Trainer: what they add to a step's record is logged, ``every`` picks the steps,
a :class:`Stop` ends the run after the step, and the calls come in the documented order."""

import json
import os

import pytest

from meshtrain.train import Hook, Stop, TrainConfig, Trainer


class Recorder(Hook):
    """Adds ``twice_loss`` every ``every`` steps; stops after ``stop_at``; remembers what it saw."""

    def __init__(self, every=1, stop_at=None):
        self.every, self.stop_at = every, stop_at
        self.calls = []

    def on_start(self, run):
        self.calls.append(("start", run.step))

    def on_step(self, run, info):
        self.calls.append(("step", info.step))
        info.record["twice_loss"] = 2 * info.loss
        if info.step == self.stop_at:
            return Stop("enough")
        return None

    def on_end(self, run):
        self.calls.append(("end", run.step))

    def close(self, run):
        self.calls.append(("close", run.step))


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("every, stop_at, steps, hooked, trained, committed", [
    (2, None, 5, [2, 4, 5], 5, [2, 4, 5]),   # every 2 steps, and always the last
    (1, 3, 5, [1, 2, 3], 3, [2, 3]),         # Stop after step 3: steps 4, 5 never run; step 3 is saved
])
def test_user_hook_logs_its_value_and_can_stop_the_run(tmp_path, capsys, every, stop_at, steps, hooked, trained,
                                                       committed):
    hook = Recorder(every, stop_at)
    cfg = TrainConfig(model="tiny", recipe="dp", devices=1, steps=steps, batch_size=8, seq_len=32, eval_every=0,
                      progress="lines", log_every=1, ckpt_every=2, out=str(tmp_path / "run"))
    summary = Trainer(cfg, hooks=[hook]).run()

    assert hook.calls == [("start", 0), *(("step", s) for s in hooked), ("end", trained), ("close", trained)]
    steps_logged = [r for r in _records(summary.run_dir) if "loss" in r]
    assert [r["step"] for r in steps_logged] == list(range(1, trained + 1))
    for rec in steps_logged:   # the value a user hook adds is in the step's record, next to the loss
        assert ("twice_loss" in rec) == (rec["step"] in hooked)
        if rec["step"] in hooked:
            assert rec["twice_loss"] == 2 * rec["loss"]
    assert [r["step"] for r in _records(summary.run_dir) if r.get("event") == "checkpoint"] == committed
    assert summary.steps == trained and not summary.preempted
    assert summary.final_loss == steps_logged[-1]["loss"]
    lines = capsys.readouterr().out.splitlines()
    # the metrics record and the progress line both come after the user hook (it runs before them)
    assert any(line.startswith(f"step {trained:>6}/{steps}") and "twice_loss" in line for line in lines) \
        == (trained in hooked)
    assert lines[-2].startswith(f"done: {trained} steps")
