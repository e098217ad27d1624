"""Tool calls in a rollout: the call syntax over a tokenizer, the Python runner in the real
sandbox, and the workflow's turn loop (policy tokens vs tool tokens, budget, max turns, a call
pending across a checkpoint, the reward from the final answer only)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from megatron_darl.config.rollout import RolloutConfig
from megatron_darl.rollout.tools import ToolCallError, ToolFormat, ToolResult, ToolRunner, python_source
from megatron_darl.rollout.workflow import Episode, GroupWorkflow, RewardPoolScorer, SampleState
from megatron_darl.types import GenerateResponse
from tests.helpers.sandbox import needs_sandbox

TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<eos>"]


class CharTokenizer:
    """Characters are tokens 100 + ord(c); the tags above are single tokens 0..4."""

    def encode(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            tag = next((t for t in TAGS if text.startswith(t, i)), None)
            ids.append(TAGS.index(tag) if tag else 100 + ord(text[i]))
            i += len(tag) if tag else 1
        return ids

    def decode(self, ids, skip_special_tokens=False):
        return "".join(("" if skip_special_tokens else TAGS[t]) if t < 100 else chr(t - 100) for t in ids)


TOK = CharTokenizer()
EOS = 4


def config(**kw) -> RolloutConfig:
    base = dict(group_size=1, max_new_tokens=80, tool="python", max_turns=3, tool_max_output_tokens=8)
    return RolloutConfig(**{**base, **kw})


def test_python_source_reads_raw_fenced_and_qwen3_json_calls():
    assert python_source("\n1 + 2\n") == "1 + 2"
    assert python_source("```python\nx = 3\nx * 2\n```") == "x = 3\nx * 2"
    call = {"name": "python", "arguments": {"code": "print(7)"}}
    assert python_source(json.dumps(call)) == "print(7)"
    call["arguments"] = json.dumps({"code": "2**10"})  # some templates send arguments as a string
    assert python_source(json.dumps(call)) == "2**10"
    for bad, why in (("{not json", "not valid JSON"), ('{"name": "search", "arguments": {"q": "x"}}', "expected"),
                     ("   ", "no code"), ("```python\n\n```", "no code")):
        with pytest.raises(ToolCallError, match=why):
            python_source(bad)


def test_tool_format_needs_single_tokens_and_cuts_long_output():
    fmt = ToolFormat(config(), TOK)
    assert (fmt.start_id, fmt.end_id) == (0, 1)
    turn = TOK.encode("I add. <tool_call>12+30</tool_call>")
    assert fmt.call_body(turn) == "12+30"
    with pytest.raises(ToolCallError, match="closed without being opened"):
        fmt.call_body(TOK.encode("12</tool_call>"))
    ids, cut = fmt.answer_ids("42\n")
    assert TOK.decode(ids) == "<tool_response>42\n</tool_response>" and not cut
    ids, cut = fmt.answer_ids("x" * 20)
    assert cut and TOK.decode(ids) == "<tool_response>" + "x" * 8 + "</tool_response>"
    with pytest.raises(ValueError, match=r"rollout.tool_call_tokens: '\[\[' is 2 tokens"):
        ToolFormat(config(tool_call_tokens=["[[", "]]"]), TOK)


def test_tool_format_over_the_qwen3_tokenizer():
    from megatron_darl.data.tokenizers import load_tokenizer

    tok = load_tokenizer("builtin:qwen3")
    fmt = ToolFormat(config(), tok)
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "sum(range(5))"}}\n</tool_call>'
    ids = tok.encode("Let me compute.\n" + call, add_special_tokens=False)
    assert ids[-1] == fmt.end_id and fmt.start_id in ids
    assert python_source(fmt.call_body(ids)) == "sum(range(5))"


@needs_sandbox
def test_runner_runs_python_in_the_sandbox_and_answers_failures():
    cfg = config(tool_wall_s=2.0, tool_cpu_s=1)
    fmt = ToolFormat(cfg, TOK)
    runner = ToolRunner(cfg, fmt)

    async def go(body):
        return await runner.arun_turn(TOK.encode(f"<tool_call>{body}</tool_call>"))

    try:
        ok = asyncio.run(go("123456789 + 987654321"))
        assert (ok.status, ok.output) == ("ok", "1111111110\n")
        printed = asyncio.run(go("```python\nfor i in range(3):\n    print(i)\n```"))
        assert printed.output == "0\n1\n2\n"
        err = asyncio.run(go("print('a')\n1/0"))
        assert err.status == "error" and err.output == "a\nZeroDivisionError: division by zero"
        slow = asyncio.run(go("while True: pass"))
        assert slow.status in ("timeout", "error") and ("CPU" in slow.output or "Timeout" in slow.output
                                                        or "SIGKILL" in slow.output or "SIGXCPU" in slow.output)
        parse = asyncio.run(go("   "))
        assert parse.status == "parse_error" and "no code" in parse.output
    finally:
        runner.close()
    c = runner.counts
    assert (c["tool_calls"], c["tool_ok"], c["tool_parse_errors"]) == (5, 2, 1)
    assert c["tool_errors"] + c["tool_timeouts"] == 2 and c["tool_time_s_total"] > 0


class FakeRunner:
    """ToolRunner's interface without a sandbox: evaluates `a+b` calls, records them."""

    def __init__(self, cfg, gate: asyncio.Event | None = None):
        self.format = ToolFormat(cfg, TOK)
        self.counts = {}
        self.calls: list[str] = []
        self.gate = gate

    async def arun_turn(self, turn_ids):
        body = self.format.call_body(turn_ids)
        self.calls.append(body)
        if self.gate is not None:
            await self.gate.wait()
        a, b = body.split("+")
        return ToolResult("ok", str(int(a) + int(b)), 0.01)


class TurnClient:
    """Plays the policy: each request answers with the next scripted turn (text), version v."""

    def __init__(self, turns, version=3):
        self.turns, self.version, self.requests = list(turns), version, []

    async def agenerate_sample(self, sample, sampling):
        self.requests.append((list(sample.next_input_ids()), sampling))
        text = self.turns.pop(0)
        ids = TOK.encode(text)[: sample.remaining]
        reason = "stop" if ids and ids[-1] in [EOS, *sampling.stop_token_ids] else "length"
        n = len(ids)
        sample.absorb(GenerateResponse("r", ids, [-0.5] * n, [self.version] * n, reason, self.version), True)


class FakePool:
    """The reward pool's interface: records what it was asked to grade, scores 1."""

    def __init__(self):
        self.texts = []

    async def ascore(self, items):
        self.texts = [it.response for it in items]
        return [type("R", (), {"score": 1.0})() for _ in items]


def RecordingScorer() -> RewardPoolScorer:
    return RewardPoolScorer(FakePool(), lambda ids: TOK.decode(ids, skip_special_tokens=True))


def episode(wf):
    class P:
        uid, input_ids, task, answer, question = 7, TOK.encode("Q:"), "math", {"answer": "42"}, "Q"
    return wf.new_episode(P())


def test_workflow_answers_a_call_and_trains_only_policy_tokens():
    cfg = config()
    runner, scorer = FakeRunner(cfg), RecordingScorer()
    wf = GroupWorkflow(cfg, scorer, tools=runner)
    client = TurnClient(["<tool_call>12+30</tool_call>", "42<eos>"])
    ep = episode(wf)
    (traj,) = asyncio.run(wf.arun_episode(client, ep))
    s = ep.samples[0]
    answer = TOK.encode("<tool_response>42</tool_response>")
    call = TOK.encode("<tool_call>12+30</tool_call>")
    assert s.output_ids == call + answer + TOK.encode("42<eos>")
    assert s.policy_mask == [1] * len(call) + [0] * len(answer) + [1] * 3
    assert traj.policy_mask.tolist() == s.policy_mask and traj.finish_reason == "stop"
    tool = traj.policy_mask == 0
    assert (traj.behav_logprobs[tool] == 0).all() and (traj.behav_versions[tool] == -1).all()
    assert (traj.behav_versions[~tool] == 3).all() and traj.num_policy_tokens == len(call) + 3
    # the second request continues from the ids the engine saw, the tool's included: no re-tokenization
    assert client.requests[1][0] == TOK.encode("Q:") + call + answer
    assert all(sp.stop_token_ids == [1] for _, sp in client.requests)
    assert client.requests[1][1].max_new_tokens == 80 and s.remaining == 80 - len(s.output_ids)
    assert scorer.pool.texts == ["42"], "the reward reads the final answer, not the tool's output"
    assert traj.metadata["tool_calls"] == 1 and traj.metadata["tool_tokens"] == len(answer)
    assert (wf.counts["turns"], wf.counts["tool_tokens"], wf.counts["samples_scored"]) == (2, len(answer), 1)


def test_workflow_stops_at_max_turns_and_at_the_budget():
    cfg = config(max_turns=2)
    wf = GroupWorkflow(cfg, RecordingScorer(), tools=FakeRunner(cfg))
    client = TurnClient(["<tool_call>1+1</tool_call>", "<tool_call>2+2</tool_call>", "unused"])
    ep = episode(wf)
    asyncio.run(wf.arun_episode(client, ep))
    s = ep.samples[0]
    assert s.done and s.tool_calls == 1 and s.finish_reason == "stop" and len(client.requests) == 2
    assert wf.tools.calls == ["1+1"] and wf.counts["tool_over_max_turns"] == 1

    call = "<tool_call>1+1</tool_call>"
    tight = config(max_new_tokens=len(TOK.encode(call)) + 3)  # the answer (2 tags + "2") leaves no token
    wf = GroupWorkflow(tight, RecordingScorer(), tools=FakeRunner(tight))
    ep = episode(wf)
    asyncio.run(wf.arun_episode(TurnClient([call]), ep))
    s = ep.samples[0]
    assert s.finish_reason == "length" and s.tool_calls == 0 and wf.counts["tool_over_budget"] == 1
    assert s.output_ids == TOK.encode(call) and 0 not in s.policy_mask


def test_a_call_in_flight_survives_a_checkpoint_and_runs_again_counted():
    cfg = config()
    gate = asyncio.Event()
    wf = GroupWorkflow(cfg, RecordingScorer(), tools=FakeRunner(cfg, gate))
    ep = episode(wf)

    async def interrupted():
        task = asyncio.ensure_future(wf.arun_episode(TurnClient(["<tool_call>5+6</tool_call>"]), ep))
        while not wf.tools.calls:
            await asyncio.sleep(0)
        task.cancel()  # the manager stops while the call runs
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(interrupted())
    saved = json.loads(json.dumps(ep.to_json()))
    assert saved["samples"][0]["tool_pending"] and saved["samples"][0]["tool_started"] == 1
    back = Episode.from_json(saved)
    wf2 = GroupWorkflow(cfg, RecordingScorer(), tools=FakeRunner(cfg))
    client = TurnClient(["11<eos>"])
    (traj,) = asyncio.run(wf2.arun_episode(client, back))
    assert wf2.tools.calls == ["5+6"] and wf2.counts["tool_reruns"] == 1
    expected = "<tool_call>5+6</tool_call><tool_response>11</tool_response>11<eos>"
    assert TOK.decode(traj.response_ids.tolist()) == expected
    assert client.requests[0][0][-1] == TOK.encode("</tool_response>")[0]


def test_restart_without_partial_rollout_drops_tool_turns_too():
    s = SampleState([1], 40)
    s.absorb(GenerateResponse("r", [0, 150, 1], [-1.0] * 3, [0] * 3, "stop", 0), True)
    s.tool_pending, s.tool_started = True, 1
    s.add_tool_output([2, 160, 3], failed=False)
    s.absorb(GenerateResponse("r", [150], [-1.0], [0], "abort", 0), keep_partial=False)
    assert (s.output_ids, s.policy_mask, s.tool_calls, s.tool_started, s.restarts) == ([], [], 0, 0, 1)


def test_sample_state_refuses_a_mask_that_does_not_fit():
    with pytest.raises(ValueError, match="policy_mask of 1 values"):
        SampleState.from_json({"prompt_ids": [1], "max_new_tokens": 4, "output_ids": [5, 6], "policy_mask": [1]})
    old = SampleState.from_json({"prompt_ids": [1], "max_new_tokens": 4, "output_ids": [5, 6]})  # saved before tools
    assert old.policy_mask == [1, 1] and not old.tool_pending


def test_config_checks_the_tool_keys():
    def keys(**kw):
        return [k for k, _ in RolloutConfig(**kw).check()]

    assert keys(tool="python", max_turns=1) == ["max_turns"]
    assert keys(tool_response_template="no slot") == ["tool_response_template"]
    assert keys(tool_call_tokens=["<a>", "<a>"]) == ["tool_call_tokens"]
    assert keys(tool_wall_s=0.0, tool_workers=0) == ["tool_workers", "tool_wall_s"]
    assert re.search("must be >= 2", dict(RolloutConfig(tool="python", max_turns=1).check())["max_turns"])


def test_the_qwen3_recipe_answers_a_call_as_qwen3s_chat_template_does():
    """The GPU recipe's tool turn, checked against the real template: prompt + the policy's call +
    our answer tokens is what Qwen3's chat template renders for the conversation with that call
    and the tool's message, up to the next assistant turn."""
    import yaml

    from megatron_darl.data.tokenizers import load_tokenizer

    recipe = yaml.safe_load(open("configs/qwen3_4b_math_tools.yaml", encoding="utf-8"))
    rc = RolloutConfig(**{k: v for k, v in recipe["rollout"].items() if k in RolloutConfig.__dataclass_fields__})
    tools = recipe["data"]["chat_kwargs"]["tools"]
    tok = load_tokenizer("builtin:qwen3")
    fmt = ToolFormat(rc, tok)
    user = [{"role": "user", "content": "What is 2**100?"}]
    prompt = tok.apply_chat_template(user, tools=tools, add_generation_prompt=True, tokenize=False)
    assert '"name": "python"' in prompt and "<tools>" in prompt, "the recipe's tool is offered in the prompt"
    call = {"name": "python", "arguments": {"code": "2**100"}}
    output = str(2**100)
    convo = user + [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
                    {"role": "tool", "content": output}]
    full = tok.apply_chat_template(convo, tools=tools, add_generation_prompt=True, tokenize=False)
    turn_end = full.index("</tool_call>", len(prompt)) + len("</tool_call>")
    policy_turn = full[len(prompt):turn_end]
    answer, cut = fmt.answer_ids(output)
    assert not cut
    assert prompt + policy_turn + tok.decode(answer) == full
    turn_ids = tok.encode(policy_turn, add_special_tokens=False)
    assert turn_ids[-1] == fmt.end_id and python_source(fmt.call_body(turn_ids)) == "2**100"


def test_evaluation_runs_the_same_turns_and_grades_the_final_answer():
    from megatron_darl.eval.scoring import aevaluate
    from megatron_darl.rollout.turns import TurnLoop

    class Engine:
        """Calls the tool on even problems, answers at once on odd ones (by the prompt's last id)."""

        def __init__(self):
            self.inputs = []

        async def agenerate(self, req):
            self.inputs.append(list(req.input_ids))
            called = any(t == 1 for t in req.input_ids)
            even = req.input_ids[1] % 2 == 0
            text = "<tool_call>40+2</tool_call>" if even and not called else "42<eos>"
            ids = TOK.encode(text)
            reason = "stop"
            return GenerateResponse(req.rid, ids, [-0.1] * len(ids), [0] * len(ids), reason, 0)

    class Pool:
        def __init__(self):
            self.responses = []

        async def ascore(self, items):
            self.responses = [it.response for it in items]
            return [type("R", (), {"score": float(it.response == "42")})() for it in items]

    class Q:
        def __init__(self, uid):
            self.uid, self.input_ids, self.question, self.task = uid, [9, uid], "q", "math"
            self.answer, self.metadata = {"answer": "42"}, {}

    cfg = config()
    loop = TurnLoop(cfg, FakeRunner(cfg))
    engine, pool = Engine(), Pool()
    scores = asyncio.run(aevaluate([engine], [Q(u) for u in range(4)], TOK, pool, max_new_tokens=60,
                                   stop_token_ids=[EOS], turns=loop))
    assert scores.scores[:, 0].tolist() == [1.0] * 4 and pool.responses == ["42"] * 4
    assert scores.tool_calls[:, 0].tolist() == [1, 0, 1, 0] and scores.tool_call_rate() == 0.5
    assert len(engine.inputs) == 6 and loop.tools.calls == ["40+2", "40+2"]


def test_preflight_refuses_a_tokenizer_without_single_call_tokens(monkeypatch, capsys):
    from megatron_darl.config import load_config
    from megatron_darl.launch.cli import train_main
    from megatron_darl.launch.preflight import tool_checks

    started = []
    monkeypatch.setattr("megatron_darl.launch.local.run_local", lambda cfg: started.append(cfg) or 0)
    monkeypatch.setattr("megatron_darl.rewards.sandbox.sandbox_problem", lambda limits=None: None)
    assert tool_checks(load_config("configs/cpu_demo_tools.yaml", [])) == []
    assert tool_checks(load_config("configs/cpu_demo_darl.yaml", [])) == []  # no tool: nothing to check
    assert train_main(["--config", "configs/cpu_demo_tools.yaml", "model.tokenizer=builtin:demo"]) == 1
    err = capsys.readouterr().err
    assert "rollout.tool_call_tokens: '<tool_call>' is 11 tokens of this tokenizer" in err and started == []
    monkeypatch.setattr("megatron_darl.rewards.sandbox.sandbox_problem", lambda limits=None: "no namespaces here")
    problems = tool_checks(load_config("configs/cpu_demo_tools.yaml", []))
    assert problems == ["rollout.tool: 'python' runs the policy's code in the sandbox, but no namespaces here"]
