"""kill -9 of the trainer mid-run, then `checkpoint.resume=auto`: every prompt trained exactly once.

A real asynchronous `darl-train` run (`max_head_offpolicyness=1`, replay off so each group is
trained once by design, a checkpoint every 2 steps) has its learner rank killed with SIGKILL
after the first checkpoint. The run must fail naming `learner0` and SIGKILL and leave nothing
behind. The same command with `checkpoint.resume=auto` then continues from the newest
checkpoint to `train.steps`. Across both runs `trained_prompts.jsonl` must hold each step once
and each prompt id at most once; every prompt the rollout manager had written when the
checkpoint was taken must be trained; and every trained id comes from the loader's sequence
(the order the manager draws in), up to the number of prompts drawn.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.e2e import kill_role, new_run, resume_to_end

STEPS = 6


def loader_sequence(config_path: str, n: int) -> list[int]:
    """The first n prompt uids the rollout manager draws for this config."""
    from megatron_darl.config import load_config
    from megatron_darl.data.sources import build_loader
    from megatron_darl.data.tokenizers import load_tokenizer
    from megatron_darl.model_facts import context_limit

    cfg = load_config(config_path)
    loader = build_loader(cfg.data, load_tokenizer(cfg.model.tokenizer_dir), context=context_limit(cfg))
    return [int(p.uid) for p in loader.next_batch(n)]


def newest_checkpoint(run_dir: str) -> tuple[int, dict]:
    ckpt = os.path.join(run_dir, "checkpoints")
    steps = sorted(int(d[5:]) for d in os.listdir(ckpt) if d.startswith("step_") and d[5:].isdigit())
    assert steps, f"no checkpoint in {ckpt}"
    with open(os.path.join(ckpt, f"step_{steps[-1]:08d}.rollout.json"), encoding="utf-8") as fh:
        return steps[-1], json.load(fh)


@pytest.mark.timeout(300)
def test_kill_learner_then_resume_trains_every_prompt_once(tmp_path, warm_model):
    run = new_run(tmp_path, warm_model, "resume", algo={"max_head_offpolicyness": 1},
                  train={"steps": STEPS}, checkpoint={"every_steps": 2, "keep_last": 2})
    resumed = None
    try:
        run.start()
        run.wait_for(lambda: len(run.ledger()) >= 3, 150, "3 trained steps (a checkpoint at step 2)")
        kill_role(run, "megatron_darl.trainer", "learner0")
        first = run.ledger()
        ckpt_step, side = newest_checkpoint(run.run_dir)
        assert 2 <= ckpt_step < STEPS

        resumed = resume_to_end(run, str(tmp_path / "resumed.out"), 200)
    finally:
        run.kill()
        if resumed is not None:
            resumed.kill()

    with open(os.path.join(run.run_dir, "learner_summary.json"), encoding="utf-8") as fh:
        summary = json.load(fh)
    assert summary == {**summary, "final_version": STEPS, "steps_done": STEPS - ckpt_step}  # continued, not restarted
    ledger = resumed.ledger()
    assert [r["step"] for r in ledger] == list(range(STEPS)), ledger
    assert ledger[:ckpt_step] == first[:ckpt_step]  # steps before the checkpoint kept as they were
    trained = [u for r in ledger for u in r["prompt_ids"]]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    assert all(len(r["prompt_ids"]) == 8 for r in ledger)

    # no prompt lost: what the manager had written at the checkpoint = drawn minus in flight
    drawn, inflight = side["counters"]["prompts_drawn"], {e["uid"] for e in side["episodes"]}
    assert side["counters"]["filtered_groups"] == 0 and side["counters"]["groups_dropped"] == 0
    seq = loader_sequence(resumed.config, len(trained) + 4 * 8)
    written = set(seq[:drawn]) - inflight
    assert len(written) == side["counters"]["groups_written"]
    assert written <= set(trained), f"lost across the kill: {sorted(written - set(trained))}"
    # and nothing comes from outside the draw order: trained ids are a prefix of it minus the
    # groups still generating when the run ended (at most max_head_offpolicyness+1 batches)
    assert set(trained) <= set(seq)
    assert set(seq[: len(trained) - 2 * 8]) <= set(trained)

