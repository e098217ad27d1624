"""`train.max_generated_samples`: the loop stops at the first step boundary at which the rollout
side has generated the budget, evaluates that last version (final=True) as at a normal end,
records why it stopped, and runs to train.steps without a budget. The sample check itself
(`rank.budget_check`) reads the rollout manager's status through the publisher, and is None
without a budget. Fakes for the learner, publisher, checkpointer and telemetry (non-main rank)."""

from __future__ import annotations

import megatron_darl.trainer.loop as train_mod
from megatron_darl.config import ConfigError, load_config
from megatron_darl.trainer.rank import budget_check


class _Learner:
    is_main = False

    def train_step(self, batch):
        return {}


class _Publisher:
    last_publish_s = 0.0

    def __init__(self, per_step: float):
        self.per_step, self.version = per_step, 0

    def publish(self, step, **_):
        self.version = step

    def rollout_metrics(self):  # the manager's status: generation runs one step ahead
        return {"rollout/samples_written": self.per_step * (self.version + 1), "rollout/filtered_groups": 1.0}


class _Evaluator:
    def __init__(self):
        self.calls, self.started = [], False

    def evaluate_start(self, publisher):
        self.started = True

    def maybe_run(self, version, publisher, final=False):
        self.calls.append((version, final))
        return {}


class _Quiet:
    def save(self, step):
        pass

    def log(self, step, metrics):
        self.last = step


def _run(monkeypatch, budget: int, steps: int = 50, per_step: float = 100.0):
    monkeypatch.setattr(train_mod, "prepare_batch", lambda cfg, learner, cands, step: (None, None, {}))
    cfg = load_config(None, ["model.hf_dir=unused", f"train.steps={steps}", "checkpoint.every_steps=0",
                             f"train.max_generated_samples={budget}", "rollout.group_size=8"])
    pub, ev = _Publisher(per_step), _Evaluator()
    t = train_mod.Trainer(cfg, _Learner(), None, pub, _Quiet(), _Quiet(), 0, lambda: None, lambda: False, ev,
                          budget_check(cfg, pub, True))
    return train_mod.train_loop(t), t, ev


def test_the_run_stops_at_the_first_step_boundary_at_or_after_the_budget(monkeypatch):
    done, t, ev = _run(monkeypatch, budget=1000)
    # after step s the status counts 100 (s + 1) + 8 samples: 1008 >= 1000 first after step 9
    assert done == 9 and t.stopped_on == "samples"
    assert ev.started and ev.calls[-1] == (9, True) and all(not f for _, f in ev.calls[:-1])


def test_without_a_budget_the_run_goes_to_train_steps(monkeypatch):
    done, t, ev = _run(monkeypatch, budget=0, steps=12)
    assert done == 12 and t.stopped_on == "steps" and ev.calls[-1] == (12, True)
    assert budget_check(t.cfg, None, True) is None


def test_a_budget_beyond_train_steps_stops_at_train_steps(monkeypatch):
    done, t, _ = _run(monkeypatch, budget=10**9, steps=5)
    assert done == 5 and t.stopped_on == "steps"


def test_a_negative_budget_names_the_key():
    try:
        load_config(None, ["model.hf_dir=unused", "train.max_generated_samples=-1"])
    except ConfigError as e:
        assert "train.max_generated_samples" in str(e)
    else:
        raise AssertionError("a negative budget was accepted")
