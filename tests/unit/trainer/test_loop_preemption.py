"""The loop stops only after a step it checkpointed, wherever in the step the preemption signal
lands. `train_loop` reads the preemption flag once a step: a signal that arrives after the
save decision (here: while the step is being logged) is acted on at the next step's end, with a
save. Reading the flag twice (once to save, once to stop) stopped unsaved in that window: the
run reported "preempted" with no checkpoint to resume (seen in CI as a missing checkpoints
folder in tests/integration/test_e2e_preempt.py).

The learner, publisher and checkpointer are recording fakes on a non-main rank (no feed), so
what is tested is the loop's own order of save, log and stop."""

from __future__ import annotations

import pytest

import megatron_darl.trainer.loop as train_mod
from megatron_darl.config import load_config


class _Flag:
    """The trainer rank's `Preemption`: a flag a signal handler sets; calling it reads the flag."""

    def __init__(self):
        self.flag, self.reads = False, 0

    def __call__(self) -> bool:
        self.reads += 1
        return self.flag


class _Learner:
    is_main = False

    def train_step(self, batch):
        return {"train/loss": 0.0}


class _Publisher:
    last_publish_s = 0.0

    def __init__(self):
        self.published = []

    def publish(self, step, **_):
        self.published.append(step)


class _Checkpointer:
    def __init__(self):
        self.saved = []

    def save(self, step):
        self.saved.append(step)


class _Telemetry:
    """Logs steps; the preemption signal arrives while step `signal_at` is logged."""

    def __init__(self, flag: _Flag, signal_at: int | None):
        self.flag, self.signal_at, self.logged = flag, signal_at, []

    def log(self, step, metrics):
        self.logged.append(step)
        if step == self.signal_at:
            self.flag.flag = True


def _loop(monkeypatch, steps: int, every: int, signal_at: int | None):
    monkeypatch.setattr(train_mod, "prepare_batch", lambda cfg, learner, cands, step: (None, None, {}))
    cfg = load_config(None, ["model.hf_dir=unused", f"train.steps={steps}", f"checkpoint.every_steps={every}"])
    flag, ckpt, pub = _Flag(), _Checkpointer(), _Publisher()
    tele = _Telemetry(flag, signal_at)
    done = train_mod.train_loop(train_mod.Trainer(cfg, _Learner(), None, pub, ckpt, tele, 0, lambda: None, flag))
    return done, ckpt.saved, tele.logged, flag.reads


@pytest.mark.parametrize("signal_at", [0, 2, 5])
def test_a_signal_after_the_save_decision_stops_at_the_next_step_with_a_save(monkeypatch, signal_at):
    done, saved, logged, reads = _loop(monkeypatch, steps=20, every=0, signal_at=signal_at)
    assert done == signal_at + 2  # the step being logged (index signal_at) plus the next one
    assert saved == [done]  # the loop stopped after a step it saved, and saved nothing else
    assert logged == list(range(done))
    assert reads == done  # one read a step: every rank agrees on it the same number of times


def test_without_a_signal_the_loop_runs_to_the_end_saving_on_schedule(monkeypatch):
    done, saved, logged, reads = _loop(monkeypatch, steps=7, every=3, signal_at=None)
    assert (done, saved, logged) == (7, [3, 6], list(range(7)))
    assert reads == 7


def test_a_signal_in_the_last_step_saves_it(monkeypatch):
    done, saved, _, _ = _loop(monkeypatch, steps=4, every=0, signal_at=2)
    assert (done, saved) == (4, [4])
