"""Runs with a Python tool, end to end: `kill -9` of the rollout manager in the middle of tool
calls then `checkpoint.resume=auto`, and the same episodes against the SGLang release's stand-in.

The kill: a real asynchronous `darl-train` run whose policy calls the tool on most samples (the
warm start made every example a tool episode; one tool worker, so calls queue) checkpoints every
2 steps. Once a checkpoint holds a call that had started and not finished, the rollout manager
is killed with SIGKILL. The run must fail naming the manager and SIGKILL and leave nothing
behind, sandboxed calls included. The same command with `checkpoint.resume=auto` then runs to
the end. Across both runs no prompt is trained twice, every prompt written at the checkpoint is
trained, and the calls that ran twice are exactly the calls the checkpoint held as started:
the resumed manager's `tool_reruns` counter grows by that number, no more (a call still queued
at the checkpoint never ran, so running it is not a rerun).

The stand-in: the same run with `rollout.backend=sglang`; every `/generate` body passes the
release's own request classes, turns stop on the call's closing token (`stop_token_ids`), and
continuation turns send the exact ids of prompt, call and tool answer (`input_ids`).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import TOOL_ROLLOUT
from tests.helpers.e2e import kill_role, new_run, resume_to_end
from tests.helpers.sandbox import needs_sandbox
from tests.integration.test_e2e_resume import loader_sequence, newest_checkpoint
from tests.integration.test_e2e_sglang import STEPS as STANDIN_STEPS
from tests.integration.test_e2e_sglang import train_against_standin

STEPS = 8


def started_calls(side: dict) -> int:
    """Samples of the checkpoint's episodes whose pending call had started (turns.SampleState)."""
    return sum(1 for e in side["episodes"] for s in e["samples"]
               if s["tool_pending"] and s["tool_started"] > s["tool_calls"])


def calls_in_flight_at_newest(run_dir: str) -> bool:
    ckpt = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(ckpt) or not any(d.endswith(".rollout.json") for d in os.listdir(ckpt)):
        return False
    try:
        return started_calls(newest_checkpoint(run_dir)[1]) > 0
    except (OSError, ValueError, KeyError, AssertionError):  # being written
        return False


@needs_sandbox
@pytest.mark.timeout(420)
def test_kill_manager_during_tool_calls_then_resume(tmp_path, warm_tool_model):
    run = new_run(tmp_path, warm_tool_model, "tools_kill", rollout=TOOL_ROLLOUT, algo={"max_head_offpolicyness": 1},
                  train={"steps": STEPS}, checkpoint={"every_steps": 2, "keep_last": STEPS})
    resumed = None
    try:
        run.start()
        run.wait_for(lambda: calls_in_flight_at_newest(run.run_dir), 200,
                     "a checkpoint that holds a tool call in flight")
        kill_role(run, "megatron_darl.rollout", "rollout")
        first = run.ledger()
        ckpt_step, side = newest_checkpoint(run.run_dir)
        assert 2 <= ckpt_step < STEPS
        rerun = started_calls(side)
        assert rerun > 0, "the kill came after a newer checkpoint without a call in flight"
        assert side["counters"]["tool_calls"] > 0

        resumed = resume_to_end(run, str(tmp_path / "resumed.out"), 240)
    finally:
        run.kill()
        if resumed is not None:
            resumed.kill()

    ledger = resumed.ledger()
    assert [r["step"] for r in ledger] == list(range(STEPS)), ledger
    assert ledger[:ckpt_step] == first[:ckpt_step]
    trained = [u for r in ledger for u in r["prompt_ids"]]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    drawn, inflight = side["counters"]["prompts_drawn"], {e["uid"] for e in side["episodes"]}
    assert side["counters"]["groups_dropped"] == 0
    written = set(loader_sequence(resumed.config, drawn)) - inflight
    assert written <= set(trained), f"lost across the kill: {sorted(written - set(trained))}"

    last_step, last = newest_checkpoint(run.run_dir)
    assert last_step == STEPS
    assert last["counters"]["tool_reruns"] - side["counters"]["tool_reruns"] == rerun, \
        (last["counters"]["tool_reruns"], side["counters"]["tool_reruns"], rerun)
    assert last["counters"]["tool_calls"] > side["counters"]["tool_calls"]
    with open(os.path.join(run.run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    assert any(m.get("rollout/tool_calls_per_sample", 0) > 0.5 for m in rows), "the policy seldom called the tool"


@needs_sandbox
@pytest.mark.timeout(420)
def test_tool_turns_against_an_sglang_standin(tmp_path, warm_tool_model):
    from megatron_darl.data.tokenizers import load_tokenizer

    code, out, served, run = train_against_standin(tmp_path, warm_tool_model, **TOOL_ROLLOUT)
    assert code == 0, out[-4000:]
    assert not [c for c in served if c["status"] != 200], [c for c in served if c["status"] != 200][:3]
    tok = load_tokenizer(os.path.join(run.run_dir, "model"))
    call_end, answer_start = tok.convert_tokens_to_ids(["</tool_call>", "<tool_response>"])
    generated = [c for c in served if c["route"] == "/generate" and c["stop_token_ids"]]
    probes = [c for c in served if c["route"] == "/generate" and not c["stop_token_ids"]]  # the weight probe's
    assert generated and all(c["stop_token_ids"] == [call_end] for c in generated), generated[:2]
    assert len(probes) <= STANDIN_STEPS + 1, probes[:2]  # one per version at most: every rollout turn stops on a call
    ended_on_call = [c for c in generated if c["finish"] == "stop" and c["output_ids"][-1:] == [call_end]]
    continued = [c for c in generated if answer_start in c["input_ids"]]
    assert ended_on_call and continued, "no turn stopped on a call, or none continued after a tool answer"
    for c in continued:  # the call the engine wrote, then the tool's answer, sent back as ids
        i = c["input_ids"].index(answer_start)
        assert c["input_ids"][i - 1] == call_end
    calls = [m["rollout/tool_calls"] for m in run.metrics() if "rollout/tool_calls" in m]
    assert calls and max(calls) > 0
